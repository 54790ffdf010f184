// plugins/zero as users run it: the launcher on 1, 2 and 4 ranks, stages 0 and 1, with and
// without offload_optimizer, in fp32, bf16 and fp16, against stage 0's loss curve; and the bytes
// each rank holds against the estimate and DeepSpeed's per-rank formula.
#include <gtest/gtest.h>

#include <rapidjson/document.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "json_helpers.h"
#include "run_helpers.h"

namespace {

using namespace memrt_test;
namespace fs = std::filesystem;

// GPT-2, 2 blocks of width 64: 118,528 parameters; 20 steps of a global batch of 8 sequences.
const char* kYaml =
    "model: {arch: gpt2, n_layer: 2, n_head: 2, d_model: 64, d_ff: 256, vocab_size: 256, n_ctx: 32}\n"
    "block_size: 32\nmax_steps: 20\nlogging_steps: 1\nlearning_rate: 3.0e-3\n";

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

struct Job {
  std::string precision;  // "fp32", "bf16", "fp16"
  int stage = 0;
  bool offload = false;
  int ranks = 1;
  int accumulation = 1;  // gradient_accumulation_steps
  bool accumulate_fp32 = false;  // data_types.grad_accum_dtype "fp32"
  std::string name() const {
    return precision + "_stage" + std::to_string(stage) + (offload ? "_offload" : "") + "_" +
           std::to_string(ranks) + "ranks" + (accumulation > 1 ? "_gas" + std::to_string(accumulation) : "") +
           (accumulate_fp32 ? "_fp32grads" : "");
  }
};

std::string ds_config(const Job& r) {
  std::string ds = R"({"train_batch_size": 8, "gradient_clipping": 1.0, "gradient_accumulation_steps": )" +
                   std::to_string(r.accumulation) + ", ";
  if (r.precision == "bf16") ds += R"("bf16": {"enabled": true}, )";
  if (r.precision == "fp16") ds += R"("fp16": {"enabled": true, "initial_scale_power": 8}, )";
  if (r.accumulate_fp32) ds += R"("data_types": {"grad_accum_dtype": "fp32"}, )";
  ds += R"("zero_optimization": {"stage": )" + std::to_string(r.stage);
  // Small buckets (elements): many reduce-scatters and chunked all-gathers per step, parameters
  // larger than a bucket, and buckets straddling the ranks' partitions.
  if (r.stage > 0) ds += R"(, "reduce_bucket_size": 5000, "allgather_bucket_size": 3000)";
  if (r.offload) ds += R"(, "offload_optimizer": {"device": "cpu", "pin_memory": true})";
  return ds + "}}";
}

// Runs the launcher; returns the run's output folder.
fs::path train(const TempDir& dir, const Job& r) {
  const fs::path out = dir.path() / r.name();
  const std::string ds = dir.write(r.name() + ".json", ds_config(r));
  const std::string yaml = dir.write("train.yaml", kYaml);
  RunResult res = run("env OMP_NUM_THREADS=1 " + kLauncher + " --num_procs " + std::to_string(r.ranks) +
                      " --master_port " + std::to_string(free_port()) + " --deepspeed " + ds + " " +
                      yaml + " --output_dir=" + out.string());
  EXPECT_EQ(res.exit_code, 0) << r.name() << "\n" << res.out;
  return out;
}

double worst_relative(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0.0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) worst = std::max(worst, std::abs(a[i] / b[i] - 1.0));
  return worst;
}

}  // namespace

// fp32: every stage, rank count and placement follows the single-rank stage-0 curve within 1e-5
// relative over 20 steps (the global batch is the same for every rank count), also when
// accumulating gradients over micro-steps (stage 2 adds each micro-step's into the partition).
TEST(Zero, Fp32StagesRanksAndOffloadFollowStageZero) {
  TempDir dir("zero_fp32");
  const std::vector<double> ref = losses(train(dir, {"fp32", 0, false, 1}));
  ASSERT_EQ(ref.size(), 20u);
  ASSERT_LT(ref.back(), 0.8 * ref.front()) << "the reference run learns";
  for (const Job& r : std::vector<Job>{{"fp32", 0, false, 2}, {"fp32", 0, false, 4},
                                       {"fp32", 1, false, 1}, {"fp32", 1, false, 2},
                                       {"fp32", 1, false, 4}, {"fp32", 1, true, 2},
                                       {"fp32", 1, true, 4}, {"fp32", 2, false, 1},
                                       {"fp32", 2, false, 2}, {"fp32", 2, false, 4},
                                       {"fp32", 2, true, 2}, {"fp32", 2, true, 4},
                                       {"fp32", 2, false, 2, 2}, {"fp32", 1, false, 2, 2}}) {
    EXPECT_LT(worst_relative(losses(train(dir, r)), ref), 1e-5) << r.name();
  }
}

// 16-bit: where a stage adds the ranks' gradients in the same order as stage 0's all-reduce, its
// curve is stage 0's on the same ranks bit for bit — stage 1 (the same all-reduce), and stage 2 on
// 2 ranks (a reduce-scatter of two values is the same sum, and the mean of it by 1/2 is exact). On
// 4 ranks stage 2's reduce-scatter adds four 16-bit values in another order, a rounding-level
// perturbation like the one that separates stage 0 on 1, 2 and 4 ranks. How far such a
// perturbation carries after 20 steps varies several-fold from draw to draw (bf16 stage 0 from 1
// rank: 0.84e-4 on 4 ranks and 1.5e-4 on 2 on an AMD EPYC, 4.0e-4 and 3.1e-4 on an Intel Xeon),
// so that case is held to 4x the largest spread stage 0 shows in that precision.
TEST(Zero, SixteenBitStagesOneAndTwoStayWithinStageZerosSpread) {
  TempDir dir("zero_16bit");
  for (const char* precision : {"bf16", "fp16"}) {
    const std::vector<double> one = losses(train(dir, {precision, 0, false, 1}));
    ASSERT_EQ(one.size(), 20u) << precision;
    std::map<int, std::vector<double>> zero0;
    double spread = 1e-6;
    for (int ranks : {2, 4}) {
      zero0[ranks] = losses(train(dir, {precision, 0, false, ranks}));
      spread = std::max(spread, worst_relative(zero0[ranks], one));
    }
    for (int ranks : {2, 4}) {
      for (int stage : {1, 2}) {
        for (bool offload : {false, true}) {
          const Job r{precision, stage, offload, ranks};
          const std::vector<double> curve = losses(train(dir, r));
          const double d = worst_relative(curve, one);
          std::cout << r.name() << ": " << d << " from 1 rank (stage 0 on " << ranks
                    << " ranks: " << worst_relative(zero0[ranks], one) << ")\n";
          if (stage == 1 || ranks == 2) {
            EXPECT_EQ(curve, zero0[ranks]) << r.name() << ": the same sums as stage 0's";
          } else {
            EXPECT_LE(d, 4 * spread) << r.name() << " (stage 0's largest spread in " << precision << ": " << spread << ")";
          }
        }
      }
    }
  }
}

// Each rank's masters and Adam moments: 12 bytes per element of its partition (DeepSpeed's
// 12 Psi / N for mixed-precision Adam) plus the padding the layout uses, in host memory when
// offloaded; the 16-bit weights whole on every rank. Stage 2 adds 2 bytes per partition element
// of gradients (DeepSpeed's 2 Psi / N) and no rank holds another gradient at the peak. Measured
// equals the estimate.
TEST(Zero, EachRankHoldsItsPartitionsAsEstimated) {
  TempDir dir("zero_bytes");
  for (int stage : {1, 2}) {
    for (bool offload : {false, true}) {
      const Job r{"bf16", stage, offload, 2};
      const rapidjson::Document report = read_json(train(dir, r) / "memory_report.json");
      ASSERT_EQ(report["ranks"].Size(), 2u);
      // Groups: decay 116,736 elements (weights of embeddings, attention, MLP) and no_decay 1,792
      // (biases, LayerNorms), each padded to a multiple of 2 x 16.
      const int64_t decay = 116736, no_decay = 1792;
      const int64_t padded = (decay + 31) / 32 * 32 + (no_decay + 31) / 32 * 32;
      const char* where = offload ? "host" : "device";
      for (const auto& rank : report["ranks"].GetArray()) {
        SCOPED_TRACE(r.name() + " rank " + std::to_string(rank["rank"].GetInt()));
        const auto& measured = rank["measured"]["categories"];
        const auto& estimate = rank["estimate"]["categories"];
        EXPECT_EQ(measured["master_weights"][where].GetInt64(), 4 * padded / 2);
        EXPECT_EQ(measured["optimizer_state"][where].GetInt64(), 8 * padded / 2);
        EXPECT_EQ(measured["weights"]["device"].GetInt64(), 2 * padded);
        std::vector<const char*> exact = {"weights", "master_weights", "optimizer_state"};
        if (stage == 2) {
          EXPECT_EQ(measured["gradients"][where].GetInt64(), 2 * padded / 2);
          EXPECT_EQ(measured["gradients"][offload ? "device" : "host"].GetInt64(), 0);
          exact.push_back("gradients");
        }
        for (const char* cat : exact)
          for (const char* pl : {"device", "host"})
            EXPECT_EQ(measured[cat][pl].GetInt64(), estimate[cat][pl].GetInt64()) << cat << " " << pl;
      }
    }
  }
}

// DeepSpeed's data_types.grad_accum_dtype "fp32" with bf16 weights under stage 2: each micro-step's
// bf16 gradient is reduce-scattered and added into an fp32 partition, 4 bytes per partition
// element, measured as estimated; the curve over 2 micro-steps per step stays within 4x the spread
// bf16 stage 0 shows against fp32. Below stage 2 gradients are autograd's own: refused, naming the
// key.
TEST(Zero, Bf16GradientsAccumulateInFp32PartitionsUnderStageTwo) {
  TempDir dir("zero_fp32_grads");
  const std::vector<double> fp32 = losses(train(dir, {"fp32", 0, false, 1, 2}));
  const std::vector<double> bf16 = losses(train(dir, {"bf16", 0, false, 1, 2}));
  Job r{"bf16", 2, false, 2, 2};
  r.accumulate_fp32 = true;
  const fs::path out = train(dir, r);
  const std::vector<double> curve = losses(out);
  ASSERT_EQ(curve.size(), 20u);
  const double spread = std::max(1e-6, worst_relative(bf16, fp32));
  EXPECT_LE(worst_relative(curve, fp32), 4 * spread) << "bf16 stage 0 from fp32: " << spread;

  // The bytes on one micro-step per step (with two, a tied embedding's 16-bit gradient waiting in
  // autograd for its second use is measured on top, in 16-bit stage 2 as well: not estimated yet).
  Job one{"bf16", 2, false, 2};
  one.accumulate_fp32 = true;
  const rapidjson::Document report = read_json(train(dir, one) / "memory_report.json");
  const int64_t padded = (116736 + 31) / 32 * 32 + (1792 + 31) / 32 * 32;  // as in the test above
  for (const auto& rank : report["ranks"].GetArray()) {
    SCOPED_TRACE("rank " + std::to_string(rank["rank"].GetInt()));
    const auto& measured = rank["measured"]["categories"]["gradients"];
    EXPECT_EQ(measured["device"].GetInt64(), 4 * padded / 2);
    EXPECT_EQ(measured["device"].GetInt64(), rank["estimate"]["categories"]["gradients"]["device"].GetInt64());
  }

  Job below{"bf16", 1, false, 2};
  below.accumulate_fp32 = true;
  const std::string ds = dir.write("stage1.json", ds_config(below));
  RunResult res = run(kLauncher + " --print-config --deepspeed " + ds + " " + dir.write("train.yaml", kYaml));
  EXPECT_NE(res.exit_code, 0) << res.out;
  EXPECT_NE(res.out.find("grad_accum_dtype"), std::string::npos) << res.out;
  EXPECT_NE(res.out.find("ZeRO stage 2"), std::string::npos) << res.out;
  EXPECT_NE(res.out.find("stage1.json"), std::string::npos) << res.out;
}

TEST(Zero, StagesNotBuiltAndPartialOffloadAreRefusedNamingTheKey) {
  TempDir dir("zero_refused");
  const std::string yaml = dir.write("train.yaml", kYaml);
  const std::pair<const char*, std::vector<std::string>> cases[] = {
      {R"({"train_batch_size": 8, "zero_optimization": {"stage": 3}})", {"zero_optimization", "stage 3", "not implemented yet"}},
      {R"({"train_batch_size": 8, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}})",
       {"offload_optimizer", "ratio", "remove ratio or set 1"}},
      {R"({"train_batch_size": 8, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme"}}})",
       {"offload_optimizer.device", "nvme", "\"cpu\""}},
  };
  for (const auto& [ds, parts] : cases) {
    RunResult res = run(kLauncher + " --deepspeed " + dir.write("ds.json", ds) + " " + yaml +
                        " --output_dir=" + (dir.path() / "out").string());
    EXPECT_NE(res.exit_code, 0) << ds << "\n" << res.out;
    for (const std::string& part : parts) EXPECT_NE(res.out.find(part), std::string::npos) << part << "\n" << res.out;
  }
}

// `launcher --estimate --num_procs N` gives, for every world size 1..N and rank, DeepSpeed's
// per-rank model states of mixed-precision Adam at stage 2 — 2 Psi of bf16 weights, (2 + 12)
// Psi / N of gradients, masters and moments, the last offloaded to the host — with the padding
// the layout uses at that world size, from shapes alone.
TEST(Zero, EstimateGivesDeepSpeedsPerRankModelStatesForEveryWorldSize) {
  TempDir dir("zero_estimate");
  const std::string ds = dir.write("ds.json", R"({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": true},
      "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})");
  RunResult r = run(kLauncher + " --estimate --num_procs 4 --deepspeed " + ds + " " +
                    dir.write("train.yaml", kYaml) + " --output_dir=" + dir.path().string());
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const rapidjson::Document d = read_json(dir.path() / "memory_estimate.json");
  ASSERT_EQ(d["world_sizes"].Size(), 4u);
  const int64_t decay = 116736, no_decay = 1792;  // as in EachRankHoldsItsPartitionsAsEstimated
  for (const auto& w : d["world_sizes"].GetArray()) {
    const int64_t n = w["world_size"].GetInt();
    const int64_t unit = 16 * n;
    const int64_t padded = (decay + unit - 1) / unit * unit + (no_decay + unit - 1) / unit * unit;
    ASSERT_EQ(w["ranks"].Size(), static_cast<unsigned>(n));
    for (const auto& rank : w["ranks"].GetArray()) {
      SCOPED_TRACE("world size " + std::to_string(n) + ", rank " + std::to_string(rank["rank"].GetInt()));
      const auto& e = rank["estimate"]["categories"];
      EXPECT_EQ(e["weights"]["device"].GetInt64(), 2 * padded);
      EXPECT_EQ(e["gradients"]["host"].GetInt64(), 2 * padded / n);
      EXPECT_EQ(e["master_weights"]["host"].GetInt64(), 4 * padded / n);
      EXPECT_EQ(e["optimizer_state"]["host"].GetInt64(), 8 * padded / n);
      for (const char* cat : {"gradients", "master_weights", "optimizer_state"})
        EXPECT_EQ(e[cat]["device"].GetInt64(), 0) << cat;
    }
  }
}
