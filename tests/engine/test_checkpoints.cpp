// Training-state checkpoints as users run them (docs/checkpoints.md): stop and resume exactly,
// damaged files detected, a save killed half-way, stop signals. Real launcher processes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "checkpoint/checkpoint_files.h"
#include "json_helpers.h"
#include "memrt/safetensors.h"
#include "models/hf_checkpoint.h"
#include "models/model_factory.h"
#include "run_helpers.h"

namespace {

using namespace memrt_test;
namespace fs = std::filesystem;

const char* kTinyModel =
    "model: {arch: gpt2, n_layer: 2, n_head: 2, d_model: 64, d_ff: 128, vocab_size: 256, n_ctx: 32}\n"
    "block_size: 32\nlogging_steps: 1\nlearning_rate: 3.0e-3\nwarmup_steps: 3\nseed: 5\n";
// The same with every dropout on: the resumed run matches only if the RNG state is restored.
const char* kTinyModelDropout =
    "model: {arch: gpt2, n_layer: 2, n_head: 2, d_model: 64, d_ff: 128, vocab_size: 256, n_ctx: 32,\n"
    "        embd_pdrop: 0.1, attn_pdrop: 0.1, resid_pdrop: 0.1}\n"
    "block_size: 32\nlogging_steps: 1\nlearning_rate: 3.0e-3\nwarmup_steps: 3\nseed: 5\n";

// A metrics.jsonl line's fields in order, each value as written (no re-rounding).
std::vector<std::pair<std::string, std::string>> metric_fields(const std::string& line) {
  std::vector<std::pair<std::string, std::string>> fields;
  size_t at = line.find('"');
  while (at != std::string::npos) {
    const size_t key_end = line.find('"', at + 1);
    const size_t value_end = std::min(line.find(", \"", key_end), line.rfind('}'));
    fields.emplace_back(line.substr(at + 1, key_end - at - 1), line.substr(key_end + 3, value_end - key_end - 3));
    at = line.find('"', value_end);
  }
  return fields;
}

// Every field of every metrics.jsonl line — step, loss, lr, grad_norm, skipped, skipped_steps and
// the plugins' fields (fp16's loss_scale) — but the timings and the memory measurements, which
// are of the process rather than of the training state.
std::vector<std::string> metric_lines(const fs::path& out) {
  auto measured = [](const std::string& key) {
    return key == "tokens_per_s" || key.find("bytes") != std::string::npos ||
           key.find("rss") != std::string::npos || key.find("mem") != std::string::npos;
  };
  std::vector<std::string> lines;
  std::ifstream in(out / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    std::string kept;
    for (const auto& [key, value] : metric_fields(line)) {
      if (!measured(key)) kept += (kept.empty() ? "" : ", ") + key + "=" + value;
    }
    lines.push_back(kept);
  }
  return lines;
}

// The value of `key` on each line (NaN where absent).
std::vector<double> metric_values(const fs::path& out, const std::string& key) {
  std::vector<double> values;
  std::ifstream in(out / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    double v = std::nan("");
    for (const auto& [k, value] : metric_fields(line)) {
      if (k == key) v = value == "true" ? 1.0 : value == "false" ? 0.0 : std::stod(value);
    }
    values.push_back(v);
  }
  return values;
}

// The steps per epoch a run's data line states ("..., N steps per epoch").
int64_t steps_per_epoch(const std::string& out) {
  const size_t at = out.find(" steps per epoch");
  EXPECT_NE(at, std::string::npos) << out;
  return at == std::string::npos ? 0 : std::stoll(out.substr(out.rfind(", ", at) + 2));
}

// The steps of the checkpoints in `dir` (its global_step<N> folders), ascending.
std::vector<int64_t> saved_steps(const fs::path& dir) {
  std::vector<int64_t> steps;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("global_step", 0) == 0) steps.push_back(std::stoll(name.substr(11)));
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

struct ResumeCase {
  const char* name;
  const char* ds;      // ds_config body (JSON, without the braces' plugins entry)
  const char* yaml;    // extra train.yaml lines
  int ranks;
  bool scale_moves = false;  // fp16: overflows, and the loss scale falls and rises after step 6
};

void PrintTo(const ResumeCase& c, std::ostream* os) { *os << c.name; }

class ExactResume : public ::testing::TestWithParam<ResumeCase> {};

// 12 steps straight equal 6 steps, a crash (SIGKILL at the start of step 7, after the step-6
// checkpoint), and a resumed run to 12: the same metrics line by line (every field but timings
// and memory, printed with all digits) and byte-identical final weights. Dropout is on, so the
// RNG state must be restored; fp16 starts at a loss scale that overflows and has a short window,
// so its scaler's state (scale, counters) must be restored too.
TEST_P(ExactResume, StraightEqualsStoppedAndResumed) {
  const ResumeCase& c = GetParam();
  TempDir dir(std::string("resume_") + c.name);
  const std::string yaml = dir.write("train.yaml", std::string(kTinyModelDropout) + c.yaml +
                                                       "max_steps: 12\nsave_steps: 6\n");
  const std::string ds = dir.write("ds.json", std::string("{") + c.ds + "}");
  const std::string ds_killed = dir.write(
      "ds_killed.json", std::string("{") + c.ds + R"(, "plugins": [{"name": "fixture_killer",
        "library": ")" + FIXTURE_KILLER + R"(", "options": {"rank": )" +
                            std::to_string(c.ranks - 1) + R"(, "step": 6}}]})");
  auto launch = [&](const std::string& ds_path, const fs::path& out, const std::string& extra) {
    return run(kLauncher + " --num_procs " + std::to_string(c.ranks) + " --master_port " +
               std::to_string(free_port()) + " --deepspeed " + ds_path + " " + yaml +
               " --output_dir=" + out.string() + extra);
  };
  const fs::path straight = dir.path() / "straight", stopped = dir.path() / "stopped";
  RunResult a = launch(ds, straight, "");
  ASSERT_EQ(a.exit_code, 0) << a.out;
  RunResult b = launch(ds_killed, stopped, "");
  ASSERT_NE(b.exit_code, 0) << "the killer fixture should have ended the run\n" << b.out;
  ASSERT_TRUE(fs::exists(stopped / "global_step6" / "manifest.json")) << b.out;
  RunResult r = launch(ds, stopped, " --resume");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("resumed from " + (stopped / "global_step6").string() + " at step 6"),
            std::string::npos) << r.out;

  const auto want = metric_lines(straight), got = metric_lines(stopped);
  ASSERT_EQ(want.size(), 12u);
  EXPECT_EQ(got, want);
  if (c.scale_moves) {  // the window really exercises the scaler: overflows, then both directions
    const std::vector<double> scale = metric_values(straight, "loss_scale");
    const std::vector<double> skipped = metric_values(straight, "skipped");
    bool falls = false, rises = false;
    for (size_t i = 6; i < scale.size(); ++i) {  // steps 7..12, the resumed half
      falls |= scale[i] < scale[i - 1];
      rises |= scale[i] > scale[i - 1];
    }
    EXPECT_TRUE(falls && rises) << "loss_scale should fall and rise after the checkpoint\n" << a.out;
    EXPECT_EQ(skipped.front(), 1.0) << "the first step should overflow\n" << a.out;
  }
  // Every file of the last checkpoint — the store's shards (weights, masters, moments), the
  // optimizer's and plugins' state, the RNG — byte for byte.
  for (const auto& f : fs::directory_iterator(straight / "global_step12")) {
    const fs::path name = f.path().filename();
    EXPECT_EQ(slurp(f.path().string()), slurp((stopped / "global_step12" / name).string()))
        << name << " differs";
  }
}

const ResumeCase kResumeCases[] = {
    {"fp32", R"("train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0)", "", 1},
    {"accumulation", R"("train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2)", "", 1},
    {"bf16", R"("train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": true})", "", 1},
    {"fp16", R"("train_micro_batch_size_per_gpu": 4,
                "fp16": {"enabled": true, "initial_scale_power": 24, "loss_scale_window": 2})", "", 1, true},
    {"two_ranks", R"("train_batch_size": 8, "train_micro_batch_size_per_gpu": 4)", "", 2},
    {"bf16_two_ranks", R"("train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": true})", "", 2},
    {"zero1_bf16_offload_two_ranks", R"("train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
        "bf16": {"enabled": true}, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}})", "", 2},
    {"zero2_bf16_accumulation_two_ranks", R"("train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": true}, "zero_optimization": {"stage": 2, "reduce_bucket_size": 3000})", "", 2},
    {"zero1_fp16_two_ranks", R"("train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
        "fp16": {"enabled": true, "initial_scale_power": 24, "loss_scale_window": 2},
        "zero_optimization": {"stage": 1})", "", 2},
};

INSTANTIATE_TEST_SUITE_P(Runs, ExactResume, ::testing::ValuesIn(kResumeCases),
                         [](const auto& p) { return std::string(p.param.name); });

// Across epoch boundaries: a 600-byte corpus gives a few steps per epoch, so the 12 steps span
// several epochs and the resumed half starts mid-epoch.
TEST(Checkpoints, ResumeAcrossEpochBoundariesIsExact) {
  TempDir dir("resume_epochs");
  std::string text;
  for (int i = 0; text.size() < 600; ++i) text += "In the beginning line " + std::to_string(i) + ". ";
  const std::string corpus = dir.write("corpus.txt", text);
  ResumeCase c{"epochs", R"("train_micro_batch_size_per_gpu": 4)", "", 1};
  const std::string yaml = dir.write("train.yaml", std::string(kTinyModel) + "train_file: " + corpus +
                                                       "\nmax_steps: 12\nsave_steps: 5\n");
  const std::string ds = dir.write("ds.json", std::string("{") + c.ds + "}");
  const fs::path straight = dir.path() / "straight", stopped = dir.path() / "stopped";
  RunResult a = run(kLauncher + " --deepspeed " + ds + " " + yaml + " --output_dir=" + straight.string());
  ASSERT_EQ(a.exit_code, 0) << a.out;
  ASSERT_LT(steps_per_epoch(a.out), 5) << "the corpus should give epochs shorter than the resume point";
  // Stop after step 5 by copying the straight run's checkpoint, as a stopped run would have left it.
  fs::create_directories(stopped);
  fs::copy(straight / "global_step5", stopped / "global_step5", fs::copy_options::recursive);
  std::ofstream(stopped / "latest") << "global_step5\n";
  RunResult r = run(kLauncher + " --deepspeed " + ds + " " + yaml + " --output_dir=" + stopped.string() + " --resume");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const auto want = metric_lines(straight), got = metric_lines(stopped);
  ASSERT_EQ(want.size(), 12u);
  EXPECT_EQ(std::vector<std::string>(got.begin(), got.end()),
            std::vector<std::string>(want.begin() + 5, want.end()));
}

// One flipped byte in any file of a checkpoint, or a truncated file, is an error naming the file.
TEST(Checkpoints, AnyDamagedByteIsDetectedNamingTheFile) {
  TempDir dir("damaged");
  const std::string yaml = dir.write("train.yaml", std::string(kTinyModel) + "max_steps: 3\nsave_steps: 2\n");
  const std::string ds = dir.write("ds.json", R"({"train_micro_batch_size_per_gpu": 4})");
  const fs::path good = dir.path() / "good";
  RunResult a = run(kLauncher + " --deepspeed " + ds + " " + yaml + " --output_dir=" + good.string());
  ASSERT_EQ(a.exit_code, 0) << a.out;
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(good / "global_step2")) files.push_back(e.path().filename().string());
  ASSERT_EQ(files.size(), 6u);  // config.json, store.json, plugins.json, a rank file, the manifest and its hash
  for (const std::string& file : files) {
    for (const char* how : {"flip", "truncate"}) {
      SCOPED_TRACE(file + " " + how);
      const fs::path out = dir.path() / (file + how);
      fs::create_directories(out);
      fs::copy(good / "global_step2", out / "global_step2", fs::copy_options::recursive);
      std::ofstream(out / "latest") << "global_step2\n";
      const fs::path victim = out / "global_step2" / file;
      std::string bytes = slurp(victim);
      if (std::string(how) == "flip") {
        bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 0x01);
      } else {
        bytes.resize(bytes.size() - 1);
      }
      std::ofstream(victim, std::ios::binary | std::ios::trunc) << bytes;
      RunResult r = run(kLauncher + " --deepspeed " + ds + " " + yaml + " --output_dir=" + out.string() + " --resume");
      EXPECT_NE(r.exit_code, 0) << r.out;
      EXPECT_NE(r.out.find("error: "), std::string::npos) << r.out;
      EXPECT_NE(r.out.find(victim.string()), std::string::npos) << "the message names the file\n" << r.out;
    }
  }
}

// A save killed half-way (SIGKILL while the checkpoint collects plugin state) leaves the previous
// checkpoint and `latest` intact, and the run resumes from it.
TEST(Checkpoints, ASaveKilledHalfWayLeavesThePreviousOneUsable) {
  TempDir dir("killed_save");
  const std::string yaml = dir.write("train.yaml", std::string(kTinyModel) + "max_steps: 6\nsave_steps: 2\n");
  const std::string ds = dir.write("ds.json", R"({"train_micro_batch_size_per_gpu": 4})");
  const std::string ds_killed = dir.write("ds_killed.json", std::string(R"({"train_micro_batch_size_per_gpu": 4,
      "plugins": [{"name": "fixture_killer", "library": ")") + FIXTURE_KILLER +
      R"(", "options": {"rank": 0, "step": 4, "when": "save"}}]})");
  const fs::path out = dir.path() / "out";
  RunResult a = run(kLauncher + " --deepspeed " + ds_killed + " " + yaml + " --output_dir=" + out.string());
  ASSERT_NE(a.exit_code, 0) << a.out;
  EXPECT_TRUE(fs::exists(out / ".tmp_global_step4")) << "the save was meant to die half-way";
  EXPECT_FALSE(fs::exists(out / "global_step4"));
  EXPECT_EQ(slurp(out / "latest"), "global_step2\n");
  RunResult r = run(kLauncher + " --deepspeed " + ds + " " + yaml + " --output_dir=" + out.string() + " --resume");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("at step 2"), std::string::npos) << r.out;
  EXPECT_EQ(slurp(out / "latest"), "global_step6\n");
  EXPECT_FALSE(fs::exists(out / ".tmp_global_step4")) << "the next save cleans up";
}

TEST(Checkpoints, SaveTotalLimitKeepsTheNewest) {
  TempDir dir("limit");
  const std::string yaml = dir.write("train.yaml", std::string(kTinyModel) +
                                                       "max_steps: 8\nsave_steps: 2\nsave_total_limit: 2\n");
  const std::string ds = dir.write("ds.json", R"({"train_micro_batch_size_per_gpu": 4})");
  RunResult a = run(kLauncher + " --deepspeed " + ds + " " + yaml + " --output_dir=" + dir.path().string());
  ASSERT_EQ(a.exit_code, 0) << a.out;
  EXPECT_EQ(saved_steps(dir.path()), (std::vector<int64_t>{6, 8}));
}

// Checkpoints land where Hugging Face's Trainer puts them, the last step's included, for each
// save_strategy and save_steps (an integer, 0, a fraction of the run, HF's default of 500) and for
// axolotl's saves_per_epoch (which axolotl hands to Trainer as the fraction 1 / (saves_per_epoch x
// epochs)); the oracle is transformers' own DefaultFlowCallback driven over the same steps and epochs
// (tests/engine/hf_save_steps.py).
TEST(Checkpoints, SaveStrategiesSaveWhereHuggingFaceDoes) {
  TempDir dir("save_strategies");
  std::string text;
  for (int i = 0; text.size() < 700; ++i) text += "Saved at line " + std::to_string(i) + ". ";
  const std::string corpus = dir.write("corpus.txt", text);
  const std::string ds = dir.write("ds.json", R"({"train_micro_batch_size_per_gpu": 4})");
  struct Case {
    std::string name, yaml, hf;  // memrt's keys; the case's keys for TrainingArguments (JSON members)
    int64_t max_steps;           // 0: two epochs
  };
  const std::vector<Case> cases = {
      {"default", "", "", 7},
      {"every3", "save_steps: 3\n", R"(, "save_steps": 3)", 7},
      {"zero", "save_steps: 0\n", R"(, "save_steps": 0)", 4},
      {"fraction", "save_steps: 0.25\n", R"(, "save_steps": 0.25)", 10},
      {"epoch", "save_strategy: epoch\n", R"(, "save_strategy": "epoch")", 0},
      {"saves_per_epoch", "saves_per_epoch: 2\n", R"(, "save_steps": 0.25)", 0},
      {"no", "save_strategy: no\n", R"(, "save_strategy": "no")", 4},  // YAML: false
  };
  int64_t per_epoch = 0;
  std::map<std::string, std::vector<int64_t>> saved;
  std::string hf_cases;
  for (const Case& c : cases) {
    const fs::path out = dir.path() / c.name;
    const std::string length = c.max_steps > 0 ? "max_steps: " + std::to_string(c.max_steps) + "\n" : "num_train_epochs: 2\n";
    const RunResult r = run(kLauncher + " --deepspeed " + ds + " " +
                            dir.write(c.name + ".yaml", std::string(kTinyModel) + "train_file: " + corpus + "\n" + length + c.yaml) +
                            " --output_dir=" + out.string());
    ASSERT_EQ(r.exit_code, 0) << c.name << "\n" << r.out;
    per_epoch = steps_per_epoch(r.out);
    saved[c.name] = saved_steps(out);
    const int64_t steps = c.max_steps > 0 ? c.max_steps : 2 * per_epoch;
    hf_cases += std::string(hf_cases.empty() ? "[" : ", ") + R"({"name": ")" + c.name + R"(", "max_steps": )" +
                std::to_string(steps) + R"(, "steps_per_epoch": )" + std::to_string(per_epoch) + c.hf + "}";
  }
  ASSERT_GE(per_epoch, 4) << "epochs long enough to save twice in one";
  ASSERT_NE(per_epoch % 2, 0) << "a share of an odd epoch is rounded up";
  const fs::path want = dir.path() / "hf.json";
  const RunResult hf = run(std::string(MEMRT_PYTHON) + " " + MEMRT_SOURCE_DIR + "/tests/engine/hf_save_steps.py " +
                           dir.write("cases.json", hf_cases + "]") + " " + want.string());
  ASSERT_EQ(hf.exit_code, 0) << hf.out;
  const rapidjson::Document d = read_json(want);
  for (const Case& c : cases) {
    std::vector<int64_t> expected;
    for (const auto& v : d[c.name.c_str()].GetArray()) expected.push_back(v.GetInt64());
    EXPECT_EQ(saved[c.name], expected) << c.name;
  }
  EXPECT_EQ(saved["no"], std::vector<int64_t>{}) << "save_strategy no saves nothing";
  EXPECT_EQ(saved["default"], std::vector<int64_t>{7}) << "the last step is saved";
}

TEST(Checkpoints, PluginStateNewerThanThePluginIsRefused) {
  TempDir dir("versions");
  const std::string yaml = dir.write("train.yaml", std::string(kTinyModel) + "max_steps: 2\nsave_steps: 2\n");
  auto ds_with = [&](int version) {
    return dir.write("ds" + std::to_string(version) + ".json",
                     std::string(R"({"train_micro_batch_size_per_gpu": 4, "plugins": [{"name": "fixture_versioned",
                       "library": ")") + FIXTURE_VERSIONED + R"(", "options": {"state_version": )" +
                         std::to_string(version) + "}}]}");
  };
  RunResult a = run(kLauncher + " --deepspeed " + ds_with(2) + " " + yaml + " --output_dir=" + dir.path().string());
  ASSERT_EQ(a.exit_code, 0) << a.out;
  RunResult r = run(kLauncher + " --deepspeed " + ds_with(1) + " " + yaml + " --max_steps=3 --output_dir=" +
                    dir.path().string() + " --resume");
  EXPECT_NE(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("holds plugin 'fixture_versioned' state version 2, newer than this plugin"),
            std::string::npos) << r.out;
  RunResult plain = run(kLauncher + " --deepspeed " + dir.write("plain.json", R"({"train_micro_batch_size_per_gpu": 4})") +
                        " " + yaml + " --max_steps=3 --output_dir=" + dir.path().string() + " --resume");
  EXPECT_NE(plain.exit_code, 0) << plain.out;
  EXPECT_NE(plain.out.find("holds state of plugin 'fixture_versioned', which this run does not load"),
            std::string::npos) << plain.out;
}

// SIGTERM: the step finishes, a checkpoint is saved, the launcher exits 0 saying where.
TEST(Checkpoints, SigtermSavesAndExitsZero) {
  TempDir dir("sigterm");
  const std::string yaml = dir.write("train.yaml", std::string(kTinyModel) + "max_steps: 100000\n");
  const std::string ds = dir.write("ds.json", R"({"train_micro_batch_size_per_gpu": 4})");
  const fs::path out = dir.path() / "out";
  // Start, wait (bounded) until three steps are logged, send SIGTERM, report the exit code.
  const std::string script =
      kLauncher + " --deepspeed " + ds + " " + yaml + " --output_dir=" + out.string() + " & pid=$!; " +
      "for i in $(seq 600); do [ $(cat " + (out / "metrics.jsonl").string() +
      " 2>/dev/null | wc -l) -ge 3 ] && break; sleep 0.1; done; kill -TERM $pid; wait $pid; echo exit=$?";
  RunResult r = run("bash -c '" + script + "'", 120);
  EXPECT_NE(r.out.find("exit=0"), std::string::npos) << r.out;
  const auto at = r.out.find("stopped by SIGTERM after step ");
  ASSERT_NE(at, std::string::npos) << r.out;
  const std::string tag = slurp(out / "latest");
  EXPECT_NE(r.out.find("checkpoint saved in " + (out / tag.substr(0, tag.size() - 1)).string()),
            std::string::npos) << r.out;
  RunResult resumed = run(kLauncher + " --deepspeed " + ds + " " + yaml + " --max_steps=" +
                          std::to_string(std::stoll(tag.substr(11)) + 2) + " --output_dir=" +
                          out.string() + " --resume");
  EXPECT_EQ(resumed.exit_code, 0) << resumed.out;
}

// SIGTERM to the launcher of two ranks: it forwards the signal, the ranks agree to stop at the
// same step, save one checkpoint together, and everything exits 0.
TEST(Checkpoints, SigtermStopsTwoRanksTogether) {
  TempDir dir("sigterm2");
  const std::string yaml = dir.write("train.yaml", std::string(kTinyModel) + "max_steps: 100000\n");
  const std::string ds = dir.write("ds.json", R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4})");
  const fs::path out = dir.path() / "out";
  const std::string script =
      kLauncher + " --num_procs 2 --master_port " + std::to_string(free_port()) + " --deepspeed " +
      ds + " " + yaml + " --output_dir=" + out.string() + " & pid=$!; " +
      "for i in $(seq 600); do [ $(cat " + (out / "metrics.jsonl").string() +
      " 2>/dev/null | wc -l) -ge 3 ] && break; sleep 0.1; done; kill -TERM $pid; wait $pid; echo exit=$?";
  RunResult r = run("bash -c '" + script + "'", 120);
  EXPECT_NE(r.out.find("exit=0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[rank 0] stopped by SIGTERM after step "), std::string::npos) << r.out;
  const std::string tag = slurp(out / "latest");
  ASSERT_FALSE(tag.empty()) << r.out;
  const fs::path ckpt = out / tag.substr(0, tag.size() - 1);
  EXPECT_TRUE(fs::exists(ckpt / "rank00000.safetensors")) << r.out;
  EXPECT_TRUE(fs::exists(ckpt / "rank00001.safetensors")) << r.out;
}

// `launcher export` writes a directory `transformers` loads, giving memrt's logits to 1e-5: GPT-2
// trained in bf16 (exported from the store's fp32 masters), and Llama in fp32 on 1 rank and under
// ZeRO-3 on 2.
TEST(Checkpoints, ExportLoadsInTransformersWithTheSameLogits) {
  struct Model {
    const char* name;
    const char* model;
    const char* ds;
    const char* tensors;  // the model's parameter tensors, all from the store
    int ranks = 1;
  };
  const Model models[] = {
      {"gpt2_bf16", "{arch: gpt2, n_layer: 2, n_head: 2, d_model: 64, d_ff: 128, vocab_size: 256, n_ctx: 32}",
       R"({"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": true}})", "28"},
      {"llama", "{arch: llama, n_layer: 2, n_head: 4, n_kv_head: 2, d_model: 64, d_ff: 96, vocab_size: 256, n_ctx: 32}",
       R"({"train_micro_batch_size_per_gpu": 4})", "21"},
      // ZeRO-3 on 2 ranks: no rank ever held the whole model; each rank's file holds its share.
      // With stage3_gather_16bit_weights_on_model_save the checkpoint holds the consolidated model
      // too (model/), the very files `launcher export` writes from it.
      {"llama_zero3", "{arch: llama, n_layer: 2, n_head: 4, n_kv_head: 2, d_model: 64, d_ff: 96, vocab_size: 256, n_ctx: 32}",
       R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
           "stage3_gather_16bit_weights_on_model_save": true}})",
       "21", 2},
  };
  for (const Model& m : models) {
    SCOPED_TRACE(m.name);
    TempDir dir(std::string("export_") + m.name);
    const std::string yaml = dir.write("train.yaml", std::string("model: ") + m.model +
                                                         "\nblock_size: 32\nmax_steps: 3\nsave_steps: 3\n");
    const std::string ds = dir.write("ds.json", m.ds);
    const fs::path out = dir.path() / "run", hf = dir.path() / "hf";
    RunResult a = run(kLauncher + " --num_procs " + std::to_string(m.ranks) + " --master_port " +
                      std::to_string(free_port()) + " --deepspeed " + ds + " " + yaml + " --output_dir=" + out.string());
    ASSERT_EQ(a.exit_code, 0) << a.out;
    RunResult e = run(kLauncher + " export " + out.string() + " " + hf.string());
    ASSERT_EQ(e.exit_code, 0) << e.out;
    EXPECT_NE(e.out.find(std::string("in ") + m.tensors + " tensors, from the exact weights saved by " +
                         std::to_string(m.ranks) + " rank(s)"),
              std::string::npos) << e.out;
    const fs::path saved_model = out / "global_step3" / "model";
    if (std::string(m.name) == "llama_zero3") {
      for (const char* f : {"config.json", "model.safetensors"})
        EXPECT_EQ(slurp(saved_model / f), slurp(hf / f)) << f << "\n" << a.out;
    } else {
      EXPECT_FALSE(fs::exists(saved_model));
    }
    if (std::string(m.name) == "gpt2_bf16") {
      // The fp32 masters, not the bf16 copy the model computed with: most values are not bf16's.
      const auto exported = memrt::SafetensorsFile::open((hf / "model.safetensors").string());
      const at::Tensor w = exported.tensor("transformer.h.0.mlp.c_fc.weight");
      EXPECT_GT(w.ne(w.to(at::kBFloat16).to(at::kFloat)).to(at::kFloat).mean().item<double>(), 0.5);
    }
    const std::string ids = "1,50,100,200,255,7,9,11,13,17,19,23";
    const fs::path logits_file = dir.path() / "logits.safetensors";
    RunResult py = run(std::string(MEMRT_PYTHON) + " " + MEMRT_SOURCE_DIR + "/tests/engine/hf_logits.py " +
                       hf.string() + " " + ids + " " + logits_file.string());
    ASSERT_EQ(py.exit_code, 0) << py.out;
    const at::Tensor theirs = memrt::SafetensorsFile::open(logits_file.string()).tensor("logits");

    memrt::BuildOptions build;
    build.weights_dir = hf.string();
    auto model = memrt::build_model(memrt::read_hf_config(hf.string()), build);
    at::NoGradGuard no_grad;
    at::Tensor h = model->embed(at::tensor({1, 50, 100, 200, 255, 7, 9, 11, 13, 17, 19, 23}, at::kLong).view({1, -1}));
    for (int64_t i = 0; i < model->num_blocks(); ++i) h = model->block(i).forward(h);
    const at::Tensor ours = model->head(h);
    ASSERT_EQ(ours.sizes(), theirs.sizes());
    EXPECT_LT((ours - theirs).abs().max().item<double>(), 1e-5);
  }
}

// `launcher export` of a ZeRO-3 checkpoint (4 wide GPT-2 blocks, 9.6 MB in fp32; its largest
// tensor, a block's c_fc weight, 1 MB) holds one tensor at a time: each parameter a view of the
// mapped rank file it lies in, transposed into Conv1D's layout and converted to --dtype only as it
// is written. The allocator's peak over the whole export stays below twice the largest tensor —
// DeepSpeed's zero_to_fp32 holds the model (DeepSpeed #4025). The bf16 file is the fp32 one
// rounded, tensor for tensor.
TEST(Checkpoints, ExportHoldsOneTensorAtATime) {
  TempDir dir("export_streaming");
  const std::string yaml = dir.write("train.yaml", "model: {arch: gpt2, n_layer: 4, n_head: 2, d_model: 128, d_ff: 2048, "
                                                   "vocab_size: 256, n_ctx: 16}\nblock_size: 16\nmax_steps: 1\nsave_steps: 1\n");
  const std::string ds = dir.write("ds.json", R"({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": true},
                                                  "zero_optimization": {"stage": 3}})");
  const fs::path out = dir.path() / "run";
  RunResult a = run(kLauncher + " --num_procs 2 --master_port " + std::to_string(free_port()) + " --deepspeed " + ds +
                    " " + yaml + " --output_dir=" + out.string());
  ASSERT_EQ(a.exit_code, 0) << a.out;
  const int64_t largest = 128 * 2048 * 4, model = 2407168 * 4;
  for (const char* dtype : {"fp32", "bf16"}) {
    SCOPED_TRACE(dtype);
    RunResult e = run(kLauncher + " export " + out.string() + " " + (dir.path() / dtype).string() + " --dtype " + dtype);
    ASSERT_EQ(e.exit_code, 0) << e.out;
    const std::string said = "export held at most ";
    const size_t at = e.out.find(said);
    ASSERT_NE(at, std::string::npos) << e.out;
    const int64_t held = std::stoll(e.out.substr(at + said.size()));
    EXPECT_LT(held, 2 * largest) << e.out;
    EXPECT_LT(held, model / 4) << e.out;
  }
  const auto fp32 = memrt::SafetensorsFile::open((dir.path() / "fp32" / "model.safetensors").string());
  const auto bf16 = memrt::SafetensorsFile::open((dir.path() / "bf16" / "model.safetensors").string());
  ASSERT_EQ(bf16.names(), fp32.names());
  for (const std::string& name : fp32.names()) {
    const at::Tensor f = fp32.tensor(name), b = bf16.tensor(name);
    ASSERT_EQ(b.scalar_type(), at::kBFloat16) << name;
    EXPECT_TRUE(b.equal(f.to(at::kBFloat16))) << name;
  }
}

// A checkpoint of 2 ranks of ZeRO-2 resumes on 1 rank of stage 0, on 4 ranks of stage 1 and on
// the same 2 ranks under stage 0 (re-partitioned on load: masters, moments and gradients
// partitioned otherwise or not at all; fp32, 4 micro-batches of 2 per step whatever the world
// size) and continues the straight 2-rank run's loss curve within 1e-5 relative. On the same ranks
// each rank reads its own file only (its update counts too: every rank must have kept every
// parameter's, or the parameters outside its old partition restart Adam's bias correction).
//
// The same from 2 ranks of ZeRO-3 (compute weights partitioned too; biases and norms whole) onto 1
// and 4 ranks of stage 3 and 2 ranks of stage 2.
TEST(Checkpoints, ResumesOnAnotherNumberOfRanks) {
  TempDir dir("resume_world");
  const std::string yaml = dir.write("train.yaml", std::string(kTinyModel) + "max_steps: 12\nsave_steps: 6\n");
  auto ds_stage = [&](int stage) {
    return dir.write("ds" + std::to_string(stage) + ".json",
                     R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
                         "zero_optimization": {"stage": )" + std::to_string(stage) +
                         R"(, "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 1000}})");
  };
  auto launch = [&](int ranks, int stage, const fs::path& out, const std::string& extra) {
    return run(kLauncher + " --num_procs " + std::to_string(ranks) + " --master_port " +
               std::to_string(free_port()) + " --deepspeed " + ds_stage(stage) + " " + yaml +
               " --output_dir=" + out.string() + extra);
  };
  for (const auto& [from, onto] : {std::pair{2, std::vector<std::pair<int, int>>{{1, 0}, {4, 1}, {2, 0}}},
                                   std::pair{3, std::vector<std::pair<int, int>>{{1, 3}, {4, 3}, {2, 2}}}}) {
    const fs::path straight = dir.path() / ("straight" + std::to_string(from));
    RunResult a = launch(2, from, straight, "");
    ASSERT_EQ(a.exit_code, 0) << a.out;
    const std::vector<double> want = metric_values(straight, "loss");
    ASSERT_EQ(want.size(), 12u);
    for (const auto& [ranks, stage] : onto) {
      SCOPED_TRACE("stage " + std::to_string(from) + " onto " + std::to_string(ranks) + " rank(s), stage " + std::to_string(stage));
      const fs::path out = dir.path() / ("from" + std::to_string(from) + "_on" + std::to_string(ranks));
      fs::create_directories(out);
      fs::copy(straight / "global_step6", out / "global_step6", fs::copy_options::recursive);
      std::ofstream(out / "latest") << "global_step6\n";
      RunResult r = launch(ranks, stage, out, " --resume");
      ASSERT_EQ(r.exit_code, 0) << r.out;
      // Each rank reads its partition of every buffer: rank 0's is in rank 0's file except on one
      // rank, where its partition is everything.
      const std::string read = "; rank 0 read " + std::string(ranks == 1 ? "2" : "1") + " of 2 rank file(s)\n";
      EXPECT_NE(r.out.find(ranks == 2 ? "at step 6" + read
                                       : "at step 6 (saved by 2 rank(s), re-partitioned onto " + std::to_string(ranks) + ")" + read),
                std::string::npos) << r.out;
      const std::vector<double> got = metric_values(out, "loss");
      ASSERT_EQ(got.size(), 6u) << r.out;  // steps 7..12
      for (size_t i = 0; i < got.size(); ++i)
        EXPECT_NEAR(got[i], want[i + 6], 1e-5 * std::abs(want[i + 6])) << "step " << i + 7;
    }
  }
}

// The precision plugin's state version 3 is the loss scaler alone (the fp32 masters live in the
// parameter store); a checkpoint of version 2, whose plugin state held the masters (remade here
// from a version-3 one), is refused with a message saying which layout it is and what to do.
TEST(Checkpoints, PrecisionStateOfTheOldLayoutIsRefusedSayingSo) {
  TempDir dir("precision_v2");
  const std::string yaml = dir.write("train.yaml", std::string(kTinyModel) + "max_steps: 2\nsave_steps: 2\n");
  const std::string ds = dir.write("ds.json", R"({"train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": true}})");
  const fs::path out = dir.path() / "out", ckpt = out / "global_step2";
  RunResult a = run(kLauncher + " --deepspeed " + ds + " " + yaml + " --output_dir=" + out.string());
  ASSERT_EQ(a.exit_code, 0) << a.out;

  const std::string file = (ckpt / "rank00000.safetensors").string();
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::map<std::string, std::string> metadata;
  {
    const auto state = memrt::SafetensorsFile::open(file);
    for (const std::string& name : state.names()) tensors.emplace_back(name, state.tensor(name).clone());
    metadata = state.metadata();
  }
  ASSERT_EQ(metadata.at("plugin_state_versions"), "{\"precision\": 3}");
  metadata["plugin_state_versions"] = "{\"precision\": 2}";
  memrt::write_safetensors(file, tensors, metadata);
  memrt::Manifest m = memrt::read_manifest(ckpt.string());
  memrt::add_to_manifest(m, ckpt.string(), "rank00000.safetensors");
  memrt::write_manifest(ckpt.string(), m);

  RunResult r = run(kLauncher + " --deepspeed " + ds + " " + yaml + " --max_steps=3 --output_dir=" +
                    out.string() + " --resume");
  EXPECT_NE(r.exit_code, 0) << r.out;
  for (const char* part : {"precision state is version 2", "kept the fp32 masters", "reads version 3 only",
                           "memrt version that wrote it"}) {
    EXPECT_NE(r.out.find(part), std::string::npos) << part << "\n" << r.out;
  }
}

}  // namespace
