// plugins/quant as users run it: train.yaml `optim: adamw_8bit` through the launcher, on one rank
// and under ZeRO-2 with offload on two, against AdamW's loss, with bitsandbytes' state bytes
// measured as estimated.
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

// Each rank's optimizer_state as estimated, and their sum.
int64_t state_bytes_as_estimated(const fs::path& out, const char* placement) {
  const rapidjson::Document report = read_json(out / "memory_report.json");
  int64_t sum = 0;
  for (const auto& rank : report["ranks"].GetArray()) {
    SCOPED_TRACE("rank " + std::to_string(rank["rank"].GetInt()));
    const int64_t measured = rank["measured"]["categories"]["optimizer_state"][placement].GetInt64();
    EXPECT_EQ(measured, rank["estimate"]["categories"]["optimizer_state"][placement].GetInt64());
    EXPECT_EQ(rank["measured"]["peak_bytes"].GetInt64(), rank["estimate"]["peak_bytes"].GetInt64());
    sum += measured;
  }
  return sum;
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

}  // namespace
