// The launcher as users run it: real processes, real files, real Gloo on loopback, every run
// bounded by `timeout`.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include <rapidjson/document.h>

#include "json_helpers.h"
#include "run_helpers.h"

namespace {

using namespace memrt_test;
namespace fs = std::filesystem;

std::vector<double> losses(const fs::path& metrics) {
  std::vector<double> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    const auto at = line.find("\"loss\": ");
    if (at != std::string::npos) out.push_back(std::stod(line.substr(at + 8)));
  }
  return out;
}

// Each metrics.jsonl line up to its timings: step, loss, lr, grad_norm.
std::vector<std::string> metric_prefixes(const fs::path& metrics) {
  std::vector<std::string> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) out.push_back(line.substr(0, line.find(", \"tokens_per_s\"")));
  return out;
}

const char* kTinyYaml = R"(model: {arch: gpt2, n_layer: 2, n_head: 2, n_kv_head: 2, d_model: 64, d_ff: 128, vocab_size: 256, n_ctx: 32}
block_size: 32
learning_rate: 3.0e-3
max_steps: 20
logging_steps: 1
seed: 3
)";

TEST(Launcher, TwoRanksFollowTheOneRankLossCurve) {
  TempDir dir("two_ranks");
  // The same global batch of 8: one rank accumulates 2 micro-batches of 4, two ranks take one each.
  const std::string ds = dir.write("ds.json", R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
                                                  "gradient_clipping": 1.0})");
  const std::string yaml = dir.write("train.yaml", kTinyYaml);
  const fs::path one = dir.path() / "one", two = dir.path() / "two";
  RunResult r1 = run(kLauncher + " --deepspeed " + ds + " " + yaml + " --output_dir=" + one.string());
  ASSERT_EQ(r1.exit_code, 0) << r1.out;
  RunResult r2 = run(kLauncher + " --num_procs 2 --master_port " + std::to_string(free_port()) +
               " --deepspeed " + ds + " " + yaml + " --output_dir=" + two.string());
  ASSERT_EQ(r2.exit_code, 0) << r2.out;
  EXPECT_NE(r2.out.find("[rank 0] batch: train_batch_size 8 = micro 4 x accumulation 1 x ranks 2"),
            std::string::npos) << r2.out;

  const auto a = losses(one / "metrics.jsonl"), b = losses(two / "metrics.jsonl");
  ASSERT_EQ(a.size(), 20u) << r1.out;
  ASSERT_EQ(b.size(), 20u) << r2.out;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(b[i], a[i], 1e-5 * std::abs(a[i])) << "step " << i + 1;
  }
  EXPECT_LT(a.back(), a.front());
}

TEST(Launcher, MainJobLossFallsWellBelowItsStart) {
  TempDir dir("main_job");
  const std::string src = MEMRT_SOURCE_DIR;
  // One thread: the test shares the machine's two cores with another (ctest -j2).
  RunResult r = run("env OMP_NUM_THREADS=1 " + kLauncher + " --deepspeed " + src + "/configs/ds_config.json " + src +
                    "/configs/train.yaml --max_steps=30 --logging_steps=1 --output_dir=" + dir.path().string());
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const auto l = losses(dir.path() / "metrics.jsonl");
  ASSERT_EQ(l.size(), 30u);
  // Byte-level: the untrained model is near ln(256) = 5.55; 30 steps bring it well below.
  EXPECT_GT(l.front(), 5.0);
  EXPECT_LT(l.back(), 0.7 * l.front()) << r.out;
  EXPECT_NE(r.out.find("done: 30 steps"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("tok/s | mem "), std::string::npos) << r.out;
}

// Fine-tuning a Hugging Face checkpoint directory already on disk (written here by the
// independent Python reference of tests/models with the safetensors package).
TEST(Launcher, TrainsFromHuggingFaceCheckpointDirectories) {
  TempDir dir("hf_dirs");
  RunResult ref = run(std::string(MEMRT_PYTHON) + " " + MEMRT_SOURCE_DIR + "/tests/models/reference.py models " +
                      dir.path().string());
  ASSERT_EQ(ref.exit_code, 0) << ref.out;
  {  // tokens below the reference models' vocabulary (61), raw uint16
    std::ofstream bin(dir.path() / "tokens.bin", std::ios::binary);
    for (uint16_t i = 0; i < 4000; ++i) {
      const uint16_t t = static_cast<uint16_t>((i * 7 + i / 13) % 61);
      bin.write(reinterpret_cast<const char*>(&t), sizeof t);
    }
  }
  const std::string ds = dir.write("ds.json", R"({"train_micro_batch_size_per_gpu": 2})");
  for (const char* model : {"gpt2", "llama"}) {
    SCOPED_TRACE(model);
    const std::string yaml = dir.write(std::string("train_") + model + ".yaml",
                                       "model_name_or_path: " + (dir.path() / model).string() +
                                           "\ntrain_file: " + (dir.path() / "tokens.bin").string() +
                                           "\nblock_size: 8\nmax_steps: 3\nlogging_steps: 1\n");
    RunResult r = run(kLauncher + " --deepspeed " + ds + " " + yaml + " --output_dir=" +
                      (dir.path() / (std::string("out_") + model)).string());
    ASSERT_EQ(r.exit_code, 0) << r.out;
    EXPECT_NE(r.out.find(std::string("model: ") + model), std::string::npos) << r.out;
    EXPECT_EQ(losses(dir.path() / (std::string("out_") + model) / "metrics.jsonl").size(), 3u);
  }
  // The weights really come from the directory: without them the same run fails naming the file.
  fs::remove(dir.path() / "gpt2" / "model.safetensors");
  RunResult missing = run(kLauncher + " --deepspeed " + ds + " " + (dir.path() / "train_gpt2.yaml").string() +
                          " --output_dir=" + (dir.path() / "out_missing").string());
  EXPECT_EQ(missing.exit_code, 1) << missing.out;
  EXPECT_NE(missing.out.find("model.safetensors"), std::string::npos) << missing.out;
}

TEST(Launcher, PrintConfigShowsTheResolvedTriple) {
  const std::string src = MEMRT_SOURCE_DIR;
  RunResult r = run(kLauncher + " --print-config --deepspeed " + src + "/configs/ds_config.json " + src +
              "/configs/train.yaml --max_steps 7");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("\"train_batch_size\": 16"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"max_steps\": 7"), std::string::npos) << r.out;
}

// The JSON's "warnings" hold every warning of the run: the loader's (a key DeepSpeed has and memrt
// ignores) and those of the plugins' own sections (zero's note on overlap_comm).
TEST(Launcher, PrintConfigJsonHoldsTheLoadersAndThePluginsWarnings) {
  TempDir dir("print_config_warnings");
  const std::string ds = dir.write("ds.json", R"({"train_micro_batch_size_per_gpu": 2, "memory_breakdown": true,
      "zero_optimization": {"stage": 1, "overlap_comm": true}})");
  RunResult r = run(kLauncher + " --print-config --deepspeed " + ds + " " + dir.write("train.yaml", kTinyYaml));
  ASSERT_EQ(r.exit_code, 0) << r.out;
  rapidjson::Document d;
  d.Parse<rapidjson::kParseStopWhenDoneFlag>(r.out.c_str());  // the plugins' lines follow the JSON
  ASSERT_FALSE(d.HasParseError()) << r.out;
  ASSERT_TRUE(d.HasMember("warnings") && d["warnings"].IsArray()) << r.out;
  std::vector<std::string> warnings;
  for (const auto& w : d["warnings"].GetArray()) warnings.emplace_back(w.GetString());
  ASSERT_EQ(warnings.size(), 2u) << r.out;
  EXPECT_NE(warnings[0].find("'memory_breakdown' is accepted but ignored"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[1].find("'zero_optimization.overlap_comm'"), std::string::npos) << warnings[1];
  EXPECT_NE(warnings[1].find("stage 1 all-reduces the gradients after backward"), std::string::npos) << warnings[1];
  for (const std::string& w : warnings) EXPECT_NE(w.find("ds.json"), std::string::npos) << w;
}

TEST(Launcher, BadConfigExitsNonZeroNamingFileKeyAndSuggestion) {
  TempDir dir("bad_config");
  const std::string ds = dir.write("ds.json", R"({"train_micro_batch_size_per_gpu": 2, "gradient_cliping": 1.0})");
  const std::string yaml = dir.write("train.yaml", kTinyYaml);
  RunResult r = run(kLauncher + " --deepspeed " + ds + " " + yaml);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find(ds), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("gradient_cliping"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("gradient_clipping"), std::string::npos) << r.out;
}

TEST(Launcher, MissingThirdPartyPluginExitsNonZero) {
  TempDir dir("missing_plugin");
  const std::string ds = dir.write("ds.json", R"({"train_micro_batch_size_per_gpu": 2,
      "plugins": [{"name": "ghost", "library": "libghost.so", "options": {}}]})");
  const std::string yaml = dir.write("train.yaml", kTinyYaml);
  RunResult r = run(kLauncher + " --deepspeed " + ds + " " + yaml);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("libghost.so not found"), std::string::npos) << r.out;
}

std::string killer_config(const TempDir& dir) {
  return dir.write("ds.json", std::string(R"({"train_micro_batch_size_per_gpu": 2, "plugins": [
      {"name": "fixture_killer", "library": ")") + FIXTURE_KILLER + R"(",
       "options": {"rank": 1, "step": 3}}]})");
}

// Under `launcher --num_procs`, the launcher sees the death and stops the other ranks.
TEST(Launcher, KilledRankStopsTheJobThroughTheLauncher) {
  TempDir dir("killed_launcher");
  const std::string yaml = dir.write("train.yaml", kTinyYaml);
  RunResult r = run(kLauncher + " --num_procs 2 --master_port " + std::to_string(free_port()) +
                  " --deepspeed " + killer_config(dir) + " " + yaml + " --output_dir=" +
                  (dir.path() / "out").string(),
              90);
  EXPECT_NE(r.exit_code, 0) << r.out;
  EXPECT_NE(r.exit_code, 124) << "timed out:\n" << r.out;
  EXPECT_NE(r.out.find("rank 1 was killed by signal 9"), std::string::npos) << r.out;
  EXPECT_LT(r.seconds, 60.0);
}

// Without a supervising launcher (torchrun-style: each rank started on its own), the surviving
// rank notices through its next collective and exits non-zero with a clear message.
TEST(Launcher, KilledRankMakesTheOtherExitOnItsOwn) {
  TempDir dir("killed_alone");
  const std::string yaml = dir.write("train.yaml", kTinyYaml);
  const std::string ds = killer_config(dir);
  const std::string env = "MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(free_port()) +
                          " WORLD_SIZE=2 LOCAL_RANK=0 ";
  const std::string common = " --deepspeed " + ds + " " + yaml + " --output_dir=" +
                             (dir.path() / "out").string();
  const fs::path log1 = dir.path() / "rank1.log";
  // Rank 1 in the background (it kills itself at step 3), rank 0 in the foreground.
  RunResult r = run("sh -c '" + env + "RANK=1 " + kLauncher + common + " > " + log1.string() +
                  " 2>&1 & " + env + "RANK=0 " + kLauncher + common + "'",
              90);
  EXPECT_NE(r.exit_code, 0) << r.out;
  EXPECT_NE(r.exit_code, 124) << "rank 0 hung:\n" << r.out;
  EXPECT_LT(r.seconds, 60.0);
  EXPECT_NE(r.out.find("a peer rank probably died"), std::string::npos) << "exit " << r.exit_code << "\n" << r.out;
}

// A plugin's Control::stop_training on one rank stops every rank after the same step, and they
// all exit 0 — on one rank as on two. Set before the host's cross-rank vote (before_optimizer_step
// of step 2, 0-based) it ends the run after that step (3 steps); set after the vote
// (after_optimizer_step) it counts in the next step's vote (4 steps). The step it ended after is
// saved (docs/checkpoints.md, "When"). A short process-group timeout bounds a run whose ranks would
// disagree.
TEST(Launcher, StopTrainingOnOneRankStopsEveryRankAfterTheSameStep) {
  struct Case {
    const char* in;
    int ranks;
    int64_t steps;
  };
  for (const Case& c : {Case{"before_optimizer_step", 2, 3}, Case{"after_optimizer_step", 2, 4},
                        Case{"before_optimizer_step", 1, 3}, Case{"after_optimizer_step", 1, 4}}) {
    SCOPED_TRACE(std::string(c.in) + ", " + std::to_string(c.ranks) + " rank(s)");
    TempDir dir("stop_training");
    const std::string ds = dir.write(
        "ds.json", std::string(R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": )") + (c.ranks == 1 ? "2" : "1") +
                       R"(, "plugins": [{"name": "fixture_stopper", "library": ")" + FIXTURE_STOPPER +
                       R"(", "options": {"rank": )" + std::to_string(c.ranks - 1) +
                       R"(, "step": 2, "in": ")" + c.in + R"("}}]})");
    const std::string yaml = dir.write("train.yaml", kTinyYaml);
    const fs::path out = dir.path() / "out";
    RunResult r = run("env MEMRT_DIST_TIMEOUT=10 " + kLauncher + " --num_procs " + std::to_string(c.ranks) +
                          " --master_port " + std::to_string(free_port()) + " --deepspeed " + ds + " " +
                          yaml + " --output_dir=" + out.string(),
                      90);
    EXPECT_EQ(r.exit_code, 0) << r.out;
    EXPECT_LT(r.seconds, 60.0) << r.out;
    const std::string steps = std::to_string(c.steps);
    for (int rank = 0; rank < c.ranks; ++rank) {
      EXPECT_NE(r.out.find("fixture_stopper: rank " + std::to_string(rank) + " ended after step " + steps + "\n"),
                std::string::npos) << "rank " << rank << "\n" << r.out;
    }
    EXPECT_NE(r.out.find("stopped after step " + steps + ": a plugin set Control::stop_training"),
              std::string::npos) << r.out;
    EXPECT_EQ(losses(out / "metrics.jsonl").size(), static_cast<size_t>(c.steps)) << r.out;
    EXPECT_EQ(slurp(out / "latest"), "global_step" + steps + "\n") << r.out;
  }
}

// The host measures and clips the gradients the optimizer then uses. A plugin that leaves a
// non-contiguous gradient (the data-parallel all-reduce replaces it by a contiguous copy) changes
// nothing: two ranks with clipping, with and without fixture_strided, log the same loss, lr and
// grad_norm at every step, to the last digit.
TEST(Launcher, GradientsReplacedByTheAllReduceAreTheOnesClipped) {
  TempDir dir("strided");
  const std::string body = R"("train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.5)";
  const std::string ds = dir.write("ds.json", "{" + body + "}");
  const std::string ds_strided = dir.write("ds_strided.json", "{" + body +
      R"(, "plugins": [{"name": "fixture_strided", "library": ")" + FIXTURE_STRIDED + R"(", "options": {}}]})");
  const std::string yaml = dir.write("train.yaml", kTinyYaml);
  auto launch = [&](const std::string& config, const std::string& name) {
    return run("env MEMRT_DIST_TIMEOUT=20 " + kLauncher + " --num_procs 2 --master_port " +
                   std::to_string(free_port()) + " --deepspeed " + config + " " + yaml +
                   " --max_steps=8 --output_dir=" + (dir.path() / name).string(),
               120);
  };
  RunResult plain = launch(ds, "plain");
  ASSERT_EQ(plain.exit_code, 0) << plain.out;
  RunResult strided = launch(ds_strided, "strided");
  ASSERT_EQ(strided.exit_code, 0) << strided.out;
  const auto want = metric_prefixes(dir.path() / "plain" / "metrics.jsonl");
  ASSERT_EQ(want.size(), 8u) << plain.out;
  EXPECT_NE(want.front().find("\"grad_norm\": "), std::string::npos);
  const double first_norm = std::stod(want.front().substr(want.front().find("\"grad_norm\": ") + 13));
  EXPECT_GT(first_norm, 0.5) << "the first step should be clipped";
  EXPECT_EQ(metric_prefixes(dir.path() / "strided" / "metrics.jsonl"), want);
}

}  // namespace

// DeepSpeed's flops_profiler: the profiled step's matrix products are the model's, counted from
// its shapes here (6 x tokens x the linears' in*out: forward, and both products of backward, every
// weight trained, the head tied to the embedding).
TEST(Launcher, FlopsProfilerTimesTheStepItNamesAndCountsItsProducts) {
  TempDir dir("flops_profiler");
  const std::string yaml = dir.write("train.yaml", kTinyYaml);
  const std::string ds = dir.write("ds.json", R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
      "flops_profiler": {"enabled": true, "profile_step": 2, "module_depth": -1, "top_modules": 1,
                         "detailed": true, "output_file": null}})");
  RunResult r = run(kLauncher + " --deepspeed " + ds + " " + yaml + " --max_steps=3 --output_dir=" +
                    (dir.path() / "a").string());
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("step profile (flops_profiler, step 2):"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("flops_profiler.module_depth' is accepted but ignored"), std::string::npos) << r.out;

  const rapidjson::Document p = read_json(dir.path() / "a" / "step_profile.json");
  EXPECT_EQ(p["step"].GetInt64(), 2);
  const int64_t d = 64, ff = 128, vocab = 256, layers = 2, tokens = 8 * 32;
  const int64_t linear = layers * (d * 3 * d + d * d + d * ff + ff * d) + vocab * d;
  EXPECT_EQ(p["gemm_flops"].GetDouble(), 6.0 * tokens * static_cast<double>(linear));
  const double step_s = p["step_s"].GetDouble(), recorded_s = p["recorded_s"].GetDouble();
  EXPECT_GT(p["gemm_s"].GetDouble(), 0.0);
  EXPECT_LE(p["gemm_s"].GetDouble(), recorded_s);
  EXPECT_LE(recorded_s, step_s);
  EXPECT_GT(recorded_s, 0.0);  // no lower bound relative to step_s: a preempted thread is outside
                               // every scope for as long as the scheduler likes
  double rows_s = 0.0;
  std::map<std::string, int64_t> calls;
  for (const auto& op : p["ops"].GetArray()) {
    rows_s += op["self_s"].GetDouble();
    calls[op["name"].GetString()] = op["calls"].GetInt64();
  }
  EXPECT_NEAR(rows_s, recorded_s, 1e-9 * step_s + 1e-12);
  EXPECT_EQ(calls["memrt::forward"], 2);  // two micro-batches of 4
  EXPECT_EQ(calls["memrt::backward"], 2);
  EXPECT_EQ(calls["memrt::optimizer_step"], 1);
  EXPECT_EQ(calls["memrt::gelu_tanh"], 2 * layers);

  // output_file takes the table; a step the run never reaches is said so.
  const fs::path table = dir.path() / "profile.txt";
  const std::string ds_file = dir.write("ds_file.json", R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
      "flops_profiler": {"enabled": true, "output_file": ")" + table.string() + R"("}})");
  r = run(kLauncher + " --deepspeed " + ds_file + " " + yaml + " --max_steps=1 --output_dir=" + (dir.path() / "b").string());
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("step profile (flops_profiler, step 1) written to " + table.string()), std::string::npos) << r.out;
  std::ifstream in(table);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("aten::mm"), std::string::npos) << text;
  EXPECT_TRUE(fs::exists(dir.path() / "b" / "step_profile.json"));

  const std::string ds_late = dir.write("ds_late.json", R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
      "flops_profiler": {"enabled": true, "profile_step": 9}})");
  r = run(kLauncher + " --deepspeed " + ds_late + " " + yaml + " --max_steps=2 --output_dir=" + (dir.path() / "c").string());
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("flops_profiler.profile_step 9 was not reached (the run ended after step 2)"), std::string::npos)
      << r.out;
  EXPECT_FALSE(fs::exists(dir.path() / "c" / "step_profile.json"));

  // An output_file that cannot be written costs the run nothing: a warning, and the table in the log.
  const std::string missing = (dir.path() / "no_such_folder" / "p.txt").string();
  const std::string ds_bad = dir.write("ds_bad.json", R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
      "flops_profiler": {"enabled": true, "output_file": ")" + missing + R"("}})");
  r = run(kLauncher + " --deepspeed " + ds_bad + " " + yaml + " --max_steps=2 --output_dir=" + (dir.path() / "d").string());
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("warning: flops_profiler.output_file " + missing + " cannot be written"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("step profile (flops_profiler, step 1):"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("step     2/2"), std::string::npos) << r.out;
}

// DeepSpeed's wall_clock_breakdown: each logged step carries its phases' milliseconds per optimizer
// step, which together are most of the step (tokens over tokens/s) and never more; without the
// key, none of them.
TEST(Launcher, WallClockBreakdownTimesEachPhase) {
  TempDir dir("wall_clock");
  const std::string yaml = dir.write("train.yaml", kTinyYaml);
  const std::string ds = dir.write("ds.json", R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
                                                  "wall_clock_breakdown": true})");
  RunResult r = run(kLauncher + " --deepspeed " + ds + " " + yaml + " --max_steps=4 --output_dir=" + (dir.path() / "a").string());
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(r.out.find("wall_clock_breakdown"), std::string::npos) << r.out;  // no warning: it is honoured
  std::ifstream in(dir.path() / "a" / "metrics.jsonl");
  int lines = 0;
  for (std::string line; std::getline(in, line); ++lines) {
    rapidjson::Document m;
    m.Parse(line.c_str());
    ASSERT_FALSE(m.HasParseError()) << line;
    double phases = 0.0;
    for (const char* key : {"data_ms", "forward_ms", "backward_ms", "gradient_reduce_ms", "optimizer_step_ms"}) {
      ASSERT_TRUE(m.HasMember(key)) << key << " in " << line;
      EXPECT_GE(m[key].GetDouble(), 0.0) << key;
      phases += m[key].GetDouble();
    }
    EXPECT_GT(m["forward_ms"].GetDouble(), 0.0);
    EXPECT_GT(m["backward_ms"].GetDouble(), 0.0);
    const double step_ms = 1e3 * 8 * 32 / m["tokens_per_s"].GetDouble();  // 8 sequences of 32 tokens
    // The phases are disjoint parts of the step. (How much of a 3 ms step they cover depends on
    // what else the machine runs, so no lower bound is asserted: under ctest -j2 it fell to 40%.)
    EXPECT_LE(phases, step_ms) << line;
  }
  EXPECT_EQ(lines, 4);

  const std::string plain = dir.write("plain.json", R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4})");
  r = run(kLauncher + " --deepspeed " + plain + " " + yaml + " --max_steps=1 --output_dir=" + (dir.path() / "b").string());
  ASSERT_EQ(r.exit_code, 0) << r.out;
  std::ifstream in_b(dir.path() / "b" / "metrics.jsonl");
  std::string line;
  ASSERT_TRUE(static_cast<bool>(std::getline(in_b, line)));
  EXPECT_EQ(line.find("forward_ms"), std::string::npos) << line;
}
