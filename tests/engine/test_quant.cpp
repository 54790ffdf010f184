// plugins/quant as users run it: train.yaml `optim: adamw_8bit` through the launcher, on one rank
// and under ZeRO-2 with offload on two, against AdamW's loss, with bitsandbytes' state bytes
// measured as estimated; `load_in_4bit` bases (NF4, double quantization) in bitsandbytes' bytes,
// resumed from a checkpoint, on two ranks, and the Llama of configs/ to the byte.
#include <gtest/gtest.h>

#include <rapidjson/document.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "json_helpers.h"
#include "memrt/ops.h"
#include "run_helpers.h"

namespace {

using namespace memrt_test;
namespace fs = std::filesystem;

// GPT-2, 2 blocks of width 128: every weight and embedding (434,176 elements, each a whole number
// of 256-blocks) is over bitsandbytes' min_8bit_size, every bias and LayerNorm (3,584) under it.
const char* kYaml =
    "model: {arch: gpt2, n_layer: 2, n_head: 2, d_model: 128, d_ff: 512, vocab_size: 256, n_ctx: 64}\n"
    "block_size: 64\nmax_steps: 100\nlogging_steps: 1\nlearning_rate: 3.0e-3\nweight_decay: 0.1\n";
constexpr int64_t kEightBit = 434176, kThirtyTwoBit = 3584;
// 8-bit: a code per element and an fp32 absmax per 256 for each moment; 32-bit: two fp32 moments.
constexpr int64_t kStateBytes = 2 * (kEightBit + 4 * kEightBit / 256) + 8 * kThirtyTwoBit;

std::vector<double> losses(const fs::path& dir) {
  std::vector<double> out;
  std::ifstream in(dir / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    rapidjson::Document d;
    d.Parse(line.c_str());
    out.push_back(d["loss"].GetDouble());
  }
  return out;
}

double tail_mean(const std::vector<double>& v, size_t n) {
  return std::accumulate(v.end() - static_cast<long>(n), v.end(), 0.0) / static_cast<double>(n);
}

// `launch`: the launcher's own flags; `args`: train.yaml keys set on the command line.
fs::path train(const TempDir& dir, const std::string& name, const std::string& ds, const std::string& args,
               const std::string& launch = "") {
  const fs::path out = dir.path() / name;
  const RunResult r = run(kLauncher + " " + launch + " --deepspeed " + dir.write(name + ".json", ds) + " " +
                          dir.write(name + ".yaml", kYaml) + " --output_dir=" + out.string() + " " + args);
  EXPECT_EQ(r.exit_code, 0) << r.out;
  return out;
}

// Each rank's bytes of `category` (at the peak) as estimated, and their sum; every rank's peak as
// estimated too — to the byte, or with `unestimated` > 0 at most that many bytes above it.
int64_t bytes_as_estimated(const fs::path& out, const char* category, const char* placement, int64_t unestimated = 0) {
  const rapidjson::Document report = read_json(out / "memory_report.json");
  int64_t sum = 0;
  for (const auto& rank : report["ranks"].GetArray()) {
    SCOPED_TRACE("rank " + std::to_string(rank["rank"].GetInt()));
    const int64_t measured = rank["measured"]["categories"][category][placement].GetInt64();
    EXPECT_EQ(measured, rank["estimate"]["categories"][category][placement].GetInt64()) << category;
    const int64_t peak = rank["measured"]["peak_bytes"].GetInt64(), estimate = rank["estimate"]["peak_bytes"].GetInt64();
    if (unestimated == 0) {
      EXPECT_EQ(peak, estimate);
    } else {
      EXPECT_GE(peak, estimate);
      EXPECT_LE(peak, estimate + unestimated);
    }
    sum += measured;
  }
  return sum;
}

int64_t state_bytes_as_estimated(const fs::path& out, const char* placement) {
  return bytes_as_estimated(out, "optimizer_state", placement);
}

// bitsandbytes' bytes of an NF4 weight of n elements with double quantization: two codes a byte,
// an 8-bit absmax per block of 64, an fp32 nested absmax per 256 blocks and the fp32 offset.
int64_t nf4_bytes(int64_t n) {
  const int64_t blocks = (n + 63) / 64;
  return (n + 1) / 2 + blocks + 4 * ((blocks + 255) / 256) + 4;
}

// Each library's low-bit AdamW against AdamW on the same model and batches, in its own bytes:
// bitsandbytes' and torchao's 8-bit (two codes and 8/256 of absmax per parameter) and torchao's
// 4-bit (two half-byte codes and 8/128 of scales: 1.0625 bytes); the biases and LayerNorms, under
// 4096 elements, keep two fp32 moments in every library.
TEST(Quant, LowBitAdamWFollowsAdamWInTheLibrariesBytes) {
  TempDir dir("quant_lowbit");
  const std::string ds = R"({"train_batch_size": 8, "gradient_clipping": 1.0})";
  const fs::path fp32 = train(dir, "adamw", ds, "");
  const auto a = losses(fp32);
  ASSERT_EQ(a.size(), 100u);
  EXPECT_EQ(state_bytes_as_estimated(fp32, "device"), 8 * (kEightBit + kThirtyTwoBit));
  const std::pair<const char*, int64_t> runs[] = {
      {"adamw_8bit", kStateBytes},
      {"adamw_torch_8bit", kStateBytes},
      {"adamw_torch_4bit", 2 * (kEightBit / 2 + 4 * kEightBit / 128) + 8 * kThirtyTwoBit}};
  for (const auto& [optim, bytes] : runs) {
    SCOPED_TRACE(optim);
    const fs::path out = train(dir, optim, ds, std::string("--optim=") + optim);
    const auto b = losses(out);
    ASSERT_EQ(b.size(), 100u);
    EXPECT_EQ(a.front(), b.front());  // the same model and batch before any update
    EXPECT_NEAR(tail_mean(b, 10), tail_mean(a, 10), 0.02 * tail_mean(a, 10));
    EXPECT_LT(tail_mean(b, 10), 0.8 * b.front());
    EXPECT_EQ(state_bytes_as_estimated(out, "device"), bytes);
  }
}

// ZeRO-2 on two ranks with the state on the host: each rank holds whole blocks of its partition,
// together exactly one rank's bytes, and trains as one rank does.
TEST(Quant, EightBitAdamWUnderZeroTwoWithOffload) {
  TempDir dir("quant_adamw8_zero2");
  const fs::path one = train(dir, "one", R"({"train_batch_size": 8, "gradient_clipping": 1.0})", "--optim=adamw_8bit");
  const fs::path two = train(dir, "two",
                             R"({"train_batch_size": 8, "gradient_clipping": 1.0, "zero_optimization": {"stage": 2,
                                 "offload_optimizer": {"device": "cpu"}}})",
                             "--optim=adamw_8bit", "--num_procs 2 --master_port " + std::to_string(free_port()));
  EXPECT_EQ(state_bytes_as_estimated(two, "host"), kStateBytes);
  const auto a = losses(one), b = losses(two);
  ASSERT_EQ(b.size(), 100u);
  EXPECT_NEAR(tail_mean(b, 10), tail_mean(a, 10), 0.01 * tail_mean(a, 10));
}

// Low-bit state is the store's: a checkpoint of a 2-rank ZeRO-2 run resumes on one rank at stage 0
// (the codes and scales re-partitioned by name) and continues as the straight run did; and it
// composes with bf16 compute over fp32 masters, its bytes as estimated.
TEST(Quant, LowBitStateResumesOnAnotherPartitioningAndComposesWithBf16) {
  TempDir dir("quant_resume");
  const std::string zero2 = R"({"train_batch_size": 8, "gradient_clipping": 1.0, "zero_optimization": {"stage": 2}})";
  const std::string plain = R"({"train_batch_size": 8, "gradient_clipping": 1.0})";
  const std::string steps = "--optim=adamw_torch_4bit --max_steps=12 --save_steps=6";
  const fs::path straight = train(dir, "straight", zero2, steps, "--num_procs 2 --master_port " + std::to_string(free_port()));
  const std::vector<double> want = losses(straight);
  ASSERT_EQ(want.size(), 12u);
  const fs::path resumed = dir.path() / "resumed";
  fs::create_directories(resumed);
  fs::copy(straight / "global_step6", resumed / "global_step6", fs::copy_options::recursive);
  std::ofstream(resumed / "latest") << "global_step6\n";
  train(dir, "resumed", plain, steps + " --resume");
  const std::vector<double> got = losses(resumed);
  ASSERT_EQ(got.size(), 6u);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i + 6], 1e-5 * want[i + 6]) << "step " << i + 7;

  const fs::path bf16 = train(dir, "bf16", R"({"train_batch_size": 8, "gradient_clipping": 1.0, "bf16": {"enabled": true}})",
                              "--optim=adamw_8bit --max_steps=20");
  const std::vector<double> b = losses(bf16);
  ASSERT_EQ(b.size(), 20u);
  EXPECT_LT(b.back(), 0.8 * b.front());
  EXPECT_EQ(state_bytes_as_estimated(bf16, "device"), kStateBytes);
}

// `load_in_4bit`: every block projection (2 x (3C^2 + C^2 + 2CF) = 393,216 weights) NF4 with double
// quantization, quantized as each block is built, counted as quant_state in bitsandbytes' bytes,
// measured as estimated at the peak; the rest of the model trains (with a warning saying so). A
// checkpoint keeps the frozen codes: a run resumed from it continues as the straight one did.
TEST(Quant, FourBitBaseTrainsInBitsandbytesBytesAndResumes) {
  TempDir dir("quant_nf4");
  const std::string ds = R"({"train_batch_size": 8, "gradient_clipping": 1.0})";
  const std::string steps = "--load_in_4bit=true --max_steps=12 --save_steps=6";
  const fs::path straight = train(dir, "straight", ds, steps);
  const std::vector<double> want = losses(straight);
  ASSERT_EQ(want.size(), 12u);
  EXPECT_LT(want.back(), 0.8 * want.front());
  const int64_t C = 128, F = 512;
  EXPECT_EQ(bytes_as_estimated(straight, "quant_state", "device"),
            2 * (nf4_bytes(3 * C * C) + nf4_bytes(C * C) + 2 * nf4_bytes(C * F)));
  bytes_as_estimated(straight, "other", "device");  // the tile scratch

  const fs::path resumed = dir.path() / "resumed";
  fs::create_directories(resumed);
  fs::copy(straight / "global_step6", resumed / "global_step6", fs::copy_options::recursive);
  std::ofstream(resumed / "latest") << "global_step6\n";
  train(dir, "resumed", ds, steps + " --resume");
  const std::vector<double> got = losses(resumed);
  ASSERT_EQ(got.size(), 6u);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i + 6], 1e-5 * want[i + 6]) << "step " << i + 7;

}

// The formats of the frozen parameters a checkpoint's store.json lists (format "" is a plain one).
std::vector<std::string> frozen_formats(const fs::path& checkpoint) {
  const rapidjson::Document store = read_json(checkpoint / "store.json");
  std::vector<std::string> out;
  for (const auto& p : store["frozen"].GetArray())
    if (p["format"].GetStringLength() > 0) out.emplace_back(p["format"].GetString());
  return out;
}

// Two ranks under ZeRO-2, bf16 compute with bnb_4bit_compute_dtype bfloat16 and FP4 without double
// quantization, asked for in bitsandbytes' keys on one rank and in LLaMA-Factory's on two: both
// keep the 8 projections as FP4, each rank holds the whole frozen base (4-bit bases are replicated
// below stage 3), and two ranks train as one does.
TEST(Quant, FourBitBaseUnderZeroTwoInBf16) {
  TempDir dir("quant_fp4_zero2");
  const std::string common = "--bnb_4bit_compute_dtype=bfloat16 --max_steps=20 --save_steps=20";
  const std::string bnb = "--load_in_4bit=true --bnb_4bit_quant_type=fp4 --bnb_4bit_use_double_quant=false ";
  const std::string llama_factory = "--quantization_bit=4 --quantization_type=fp4 --double_quantization=false ";
  const std::string bf16 = R"("gradient_clipping": 1.0, "bf16": {"enabled": true})";
  const fs::path one = train(dir, "one", R"({"train_batch_size": 8, )" + bf16 + "}", bnb + common);
  const fs::path two = train(dir, "two", R"({"train_batch_size": 8, "zero_optimization": {"stage": 2}, )" + bf16 + "}",
                             llama_factory + common, "--num_procs 2 --master_port " + std::to_string(free_port()));
  for (const fs::path& run : {one, two}) {
    SCOPED_TRACE(run.filename().string());
    EXPECT_EQ(frozen_formats(run / "global_step20"), std::vector<std::string>(8, "fp4"));
  }
  const int64_t C = 128, F = 512;
  // FP4 without double quantization: two codes a byte and an fp32 absmax per 64.
  auto fp4_bytes = [](int64_t n) { return n / 2 + 4 * ((n + 63) / 64); };
  const int64_t base = 2 * (fp4_bytes(3 * C * C) + fp4_bytes(C * C) + 2 * fp4_bytes(C * F));
  // Where bf16 products take the fp32 path (an AVX2-only AMD, an Intel without AMX), the attention
  // runs LibTorch's fp32 kernel on fp32 copies of the micro-batch (4 x 64 tokens a rank), which the
  // estimate does not count yet (docs/precision.md): at most 8 such copies of (4 x 64 x C) floats
  // above it, in backward. Elsewhere the peak is the estimate to the byte.
  const bool fp32_attention = memrt::ops::matmul_path(at::kBFloat16) == memrt::ops::MatmulPath::kFp32Arithmetic;
  EXPECT_EQ(bytes_as_estimated(two, "quant_state", "device", fp32_attention ? 8 * 4 * 64 * C * 4 : 0), 2 * base);
  const auto a = losses(one), b = losses(two);
  ASSERT_EQ(b.size(), 20u);
  EXPECT_LT(a.back(), 0.8 * a.front());
  EXPECT_NEAR(tail_mean(b, 5), tail_mean(a, 5), 0.02 * tail_mean(a, 5));
}

// The Llama of configs/train_llama.yaml with load_in_4bit: its 3,014,656 projection weights in
// bitsandbytes' NF4 bytes with double quantization (4.127 bits per weight), the report's
// quant_state exactly as estimated.
TEST(Quant, LlamaFromConfigsLoadsInFourBitsToTheByte) {
  TempDir dir("quant_llama_nf4");
  const fs::path out = dir.path() / "llama";
  const RunResult r = run(kLauncher + " --deepspeed " + MEMRT_SOURCE_DIR + "/configs/ds_config.json " +
                          MEMRT_SOURCE_DIR + "/configs/train_llama.yaml --load_in_4bit=true --max_steps=2 --output_dir=" +
                          out.string());
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("load_in_4bit' without LoRA"), std::string::npos) << r.out;
  const int64_t C = 256, KV = 64, F = 768;
  const int64_t weights = 4 * (2 * C * C + 2 * KV * C + 3 * C * F);
  const int64_t bytes = 4 * (2 * nf4_bytes(C * C) + 2 * nf4_bytes(KV * C) + 3 * nf4_bytes(C * F));
  EXPECT_EQ(weights, 3014656);
  EXPECT_EQ(bytes_as_estimated(out, "quant_state", "device"), bytes);
  EXPECT_NEAR(8.0 * static_cast<double>(bytes) / static_cast<double>(weights), 4.127, 0.0005);
}

// A Hugging Face directory that transformers saved quantized by bitsandbytes (bnb4bit_checkpoint.py:
// a Llama loaded with BitsAndBytesConfig, then save_pretrained) loads as stored, with no quant key
// in train.yaml: config.json's quantization_config turns the 4-bit base on and decides its format
// (a train.yaml key saying otherwise is ignored with a warning, as in transformers). Its codes are
// the ones memrt makes from the full-precision checkpoint (quantization equal to bitsandbytes'), so
// the two runs train alike to the bit — a Llama in NF4 with double quantization and in FP4 without,
// a GPT-2 (Conv1D projections) in NF4 — counted as estimated. A map memrt does not dequantize with, or another quant_method, is refused naming
// the file and the tensor or key.
TEST(Quant, BitsandbytesFourBitCheckpointLoadsAsSaved) {
  TempDir dir("quant_prequantized");
  const RunResult py = run(std::string(MEMRT_PYTHON) + " " + MEMRT_SOURCE_DIR + "/tests/engine/bnb4bit_checkpoint.py " +
                           dir.path().string());
  ASSERT_EQ(py.exit_code, 0) << py.out;
  const std::string ds = dir.write("ds.json", R"({"train_batch_size": 8, "gradient_clipping": 1.0})");
  const std::string yaml = dir.write("train.yaml", "block_size: 64\nmax_steps: 4\nlogging_steps: 1\nlearning_rate: 1.0e-3\n");
  const auto launch = [&](const std::string& name, const std::string& model, const std::string& args) {
    const fs::path out = dir.path() / name;
    return std::make_pair(run(kLauncher + " --deepspeed " + ds + " " + yaml + " --model_name_or_path=" +
                              (dir.path() / model).string() + " --output_dir=" + out.string() + " " + args),
                          out);
  };
  const struct {
    const char* dir;
    const char* full_precision;
    const char* quantize_on_load;
  } cases[] = {{"nf4", "fp", "--load_in_4bit=true"},
               {"fp4", "fp", "--load_in_4bit=true --bnb_4bit_quant_type=fp4 --bnb_4bit_use_double_quant=false"},
               {"gpt2_nf4", "gpt2_fp", "--load_in_4bit=true"}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.dir);
    const auto [saved, saved_out] = launch(std::string(c.dir) + "_saved", c.dir, "--bnb_4bit_quant_type=nf4");
    ASSERT_EQ(saved.exit_code, 0) << saved.out;
    EXPECT_NE(saved.out.find("'bnb_4bit_quant_type' is ignored: " + (dir.path() / c.dir / "config.json").string() +
                             " is already quantized"),
              std::string::npos)
        << saved.out;
    const auto [loaded, loaded_out] = launch(std::string(c.dir) + "_on_load", c.full_precision, c.quantize_on_load);
    ASSERT_EQ(loaded.exit_code, 0) << loaded.out;
    const std::vector<double> want = losses(loaded_out), got = losses(saved_out);
    ASSERT_EQ(got.size(), 4u);
    EXPECT_EQ(got, want);
    EXPECT_EQ(bytes_as_estimated(saved_out, "quant_state", "device"),
              bytes_as_estimated(loaded_out, "quant_state", "device"));
  }

  const auto [bad_map, unused1] = launch("bad_map", "nf4_badmap", "");
  EXPECT_NE(bad_map.exit_code, 0);
  EXPECT_NE(bad_map.out.find("model.safetensors: tensor 'model.layers.1.mlp.up_proj.weight.quant_map': differs from "
                             "bitsandbytes' map"),
            std::string::npos)
      << bad_map.out;
  const auto [gptq, unused2] = launch("gptq", "nf4_gptq", "");
  EXPECT_NE(gptq.exit_code, 0);
  EXPECT_NE(gptq.out.find("config.json: 'quantization_config.quant_method': is \"gptq\""), std::string::npos) << gptq.out;
}

// `launcher export` of a 4-bit run writes what transformers saves from a bitsandbytes model: a Llama
// in NF4 with double quantization and a GPT-2 (Conv1D projections) in FP4 without, trained 3 steps
// on one sample (every batch is that sample, so each logged loss is the model's loss on it). The
// export loads in transformers with bitsandbytes, bnb_4bit_export.py checking every tensor and
// quant_state against what bitsandbytes packs from the loaded model, byte for byte; transformers'
// loss on the sample, memrt's loss after loading the export as stored, and the straight run's at its
// 4th step (the same weights: the step's loss comes before its update) agree to fp32 rounding.
TEST(Quant, FourBitExportLoadsInTransformersAndBack) {
  TempDir dir("quant_export");
  std::string sample;
  for (int i = 0; i < 33; ++i) sample += static_cast<char>('a' + (i * 7) % 26);
  std::string text;
  for (int i = 0; i < 4; ++i) text += sample;
  const std::string data = dir.write("sample.txt", text);
  const std::string ds = dir.write("ds.json", R"({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0})");
  const struct {
    const char* name;
    const char* model;
    const char* quant;
    const char* written;  // export's count of the quantized weights
  } cases[] = {{"llama_nf4", "{arch: llama, n_layer: 2, n_head: 4, n_kv_head: 2, d_model: 64, d_ff: 128, vocab_size: 256, n_ctx: 32}",
                "--load_in_4bit=true", "quant: 14"},
               {"gpt2_fp4", "{arch: gpt2, n_layer: 2, n_head: 2, d_model: 64, d_ff: 128, vocab_size: 256, n_ctx: 32}",
                "--load_in_4bit=true --bnb_4bit_quant_type=fp4 --bnb_4bit_use_double_quant=false", "quant: 8"}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string common = " --train_file=" + data + " --logging_steps=1 --learning_rate=1.0e-3 --output_dir=";
    const fs::path out = dir.path() / c.name, hf = dir.path() / (std::string(c.name) + "_hf");
    const RunResult a = run(kLauncher + " --deepspeed " + ds + " " +
                            dir.write(std::string(c.name) + ".yaml", std::string("model: ") + c.model + "\nblock_size: 32\n") +
                            " " + c.quant + " --max_steps=4 --save_steps=3" + common + out.string());
    ASSERT_EQ(a.exit_code, 0) << a.out;
    const RunResult e = run(kLauncher + " export " + (out / "global_step3").string() + " " + hf.string());
    ASSERT_EQ(e.exit_code, 0) << e.out;
    EXPECT_NE(e.out.find(std::string("parameters written by plugins (") + c.written + "), the rest fp32"), std::string::npos) << e.out;

    const RunResult py = run(std::string(MEMRT_PYTHON) + " " + MEMRT_SOURCE_DIR + "/tests/engine/bnb4bit_export.py " +
                             hf.string() + " " + data + " 32");
    ASSERT_EQ(py.exit_code, 0) << py.out;
    const size_t at = py.out.rfind("loss ");
    ASSERT_NE(at, std::string::npos) << py.out;
    const double theirs = std::stod(py.out.substr(at + 5));

    // memrt reads the export as stored (its config.json's quantization_config turns the base on).
    const fs::path back = dir.path() / (std::string(c.name) + "_back");
    const RunResult b = run(kLauncher + " --deepspeed " + ds + " " + dir.write("back.yaml", "block_size: 32\n") +
                            " --model_name_or_path=" + hf.string() + " --max_steps=1" + common + back.string());
    ASSERT_EQ(b.exit_code, 0) << b.out;
    const double ours = losses(back).at(0), trained = losses(out).at(3);
    EXPECT_NEAR(ours, theirs, 1e-6 * theirs);
    EXPECT_NEAR(ours, trained, 1e-6 * trained);
  }
}

}  // namespace
