// The memory report as users get it: the leak check, the resident check, `launcher --estimate`
// (real launcher processes, real files). Every shipped config's peak: test_shipped_configs.cpp.
#include <gtest/gtest.h>

#include <rapidjson/document.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "json_helpers.h"
#include "run_helpers.h"

namespace {

using namespace memrt_test;
namespace fs = std::filesystem;

const std::string kConfigs = std::string(MEMRT_SOURCE_DIR) + "/configs/";

int64_t cells(const rapidjson::Value& categories, const char* name) {
  return categories[name]["device"].GetInt64() + categories[name]["host"].GetInt64();
}

// A plugin that keeps a 1000-byte tensor per step: the leak check names the category (the tensor
// is allocated in forward's scope: activations) and its exact rate, once.
TEST(MemoryReport, ARetainedTensorPerStepIsReportedAsALeak) {
  TempDir dir("leak");
  const std::string ds = dir.write("ds.json", std::string(R"({"train_micro_batch_size_per_gpu": 2,
      "plugins": [{"name": "fixture_leaky", "library": ")") + FIXTURE_LEAKY + R"(",
                   "options": {"bytes": 1000}}]})");
  const std::string yaml = dir.write("train.yaml", R"(model: {arch: gpt2, n_layer: 1, n_head: 2, d_model: 32, d_ff: 64, vocab_size: 256, n_ctx: 16}
block_size: 16
max_steps: 12
)");
  RunResult r = run(kLauncher + " --deepspeed " + ds + " " + yaml + " --output_dir=" + dir.path().string());
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const std::string warning =
      "warning: memory: 'activations' grows by 1000 bytes (0.001 MB) per step (steps 2..7";
  const auto at = r.out.find(warning);
  ASSERT_NE(at, std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("warning: memory", at + 1), std::string::npos) << "warned once\n" << r.out;

  const rapidjson::Document d = read_json(dir.path() / "memory_report.json");
  const auto& leaks = d["ranks"][0]["leaks"];
  ASSERT_EQ(leaks.Size(), 1u);
  EXPECT_STREQ(leaks[0]["category"].GetString(), "activations");
  EXPECT_EQ(leaks[0]["bytes_per_step"].GetInt64(), 1000);
  EXPECT_EQ(leaks[0]["first_step"].GetInt64(), 2);
  EXPECT_EQ(leaks[0]["last_step"].GetInt64(), 7);
}

// Resident memory growing past the estimate by more than the margin is warned about once, naming
// the categories that grew — none when the growth is outside memrt's tensors, the leaked
// tensors' category when it is not — and the step it began at; memory_report.json records
// it. A normal run records none.
TEST(MemoryReport, ResidentMemoryPastTheEstimateIsWarnedAboutOnce) {
  TempDir dir("resident");
  const std::string yaml = dir.write("train.yaml", R"(model: {arch: gpt2, n_layer: 1, n_head: 2, d_model: 32, d_ff: 64, vocab_size: 256, n_ctx: 16}
block_size: 16
max_steps: 8
)");
  auto train = [&](const std::string& name, const std::string& options) {
    const std::string ds = dir.write(name + ".json", std::string(R"({"train_micro_batch_size_per_gpu": 2,
        "plugins": [{"name": "fixture_leaky", "library": ")") + FIXTURE_LEAKY + R"(", "options": )" + options + "}]}");
    RunResult r = run(kLauncher + " --deepspeed " + ds + " " + yaml + " --output_dir=" + (dir.path() / name).string());
    EXPECT_EQ(r.exit_code, 0) << r.out;
    return r;
  };
  const std::string warning = "warning: memory: the process's resident memory reached ";
  // 32 MiB a step, written page by page: past the margin (64 MiB and half the tiny estimate) at step 3.
  for (const bool outside : {true, false}) {
    const std::string name = outside ? "outside" : "tensors";
    const RunResult r = train(name, std::string(R"({"bytes": 33554432, "outside": )") + (outside ? "true" : "false") + "}");
    const auto at = r.out.find(warning);
    ASSERT_NE(at, std::string::npos) << r.out;
    EXPECT_EQ(r.out.find(warning, at + 1), std::string::npos) << "warned once\n" << r.out;
    EXPECT_NE(r.out.find(outside ? "No category of memrt's tensors grew since step 1" : "Grown since step 1 (live bytes at the end of a step): 'activations'", at),
              std::string::npos) << r.out;
    const rapidjson::Document d = read_json(dir.path() / name / "memory_report.json");
    const auto& g = d["ranks"][0]["resident_growth"];
    ASSERT_TRUE(g.IsObject()) << name;
    EXPECT_GT(g["resident_bytes"].GetInt64(), g["allowed_bytes"].GetInt64());
    EXPECT_GE(g["step"].GetInt64(), 2);
    EXPECT_LE(g["step"].GetInt64(), 4);
    EXPECT_LE(g["since_step"].GetInt64(), g["step"].GetInt64());
    EXPECT_EQ(g["categories"].Size(), outside ? 0u : 1u);
    EXPECT_EQ(d["ranks"][0]["timeline"][0]["resident_peak_bytes"].GetInt64() > 0, true);
  }
  const RunResult quiet = train("quiet", R"({"bytes": 1})");
  EXPECT_EQ(quiet.out.find(warning), std::string::npos) << quiet.out;
  EXPECT_TRUE(read_json(dir.path() / "quiet" / "memory_report.json")["ranks"][0]["resident_growth"].IsNull());
}

// MEMRT_PEAK_BACKTRACE: the report names where the peak's last allocation came from — in this
// run, the step's backward (memrt's engine among the frames) — and says nothing of it by default.
TEST(MemoryReport, PeakBacktraceNamesWhereThePeakWasReached) {
  TempDir dir("peak_trace");
  const std::string ds = dir.write("ds.json", R"({"train_micro_batch_size_per_gpu": 2})");
  const std::string yaml = dir.write("train.yaml", R"(model: {arch: gpt2, n_layer: 1, n_head: 2, d_model: 32, d_ff: 64, vocab_size: 256, n_ctx: 16}
block_size: 16
max_steps: 2
)");
  const std::string args = " --deepspeed " + ds + " " + yaml + " --output_dir=" + dir.path().string();
  const RunResult traced = run("env MEMRT_PEAK_BACKTRACE=1 " + kLauncher + args);
  ASSERT_EQ(traced.exit_code, 0) << traced.out;
  const auto at = traced.out.find("the allocation that set the peak: ");
  ASSERT_NE(at, std::string::npos) << traced.out;
  EXPECT_NE(traced.out.find("memrt::Engine::", at), std::string::npos) << traced.out;
  const RunResult plain = run("env MEMRT_PEAK_BACKTRACE=0 " + kLauncher + args);
  ASSERT_EQ(plain.exit_code, 0) << plain.out;
  EXPECT_EQ(plain.out.find("the allocation that set the peak"), std::string::npos) << plain.out;
}

// What a run makes resident follows the allocator: with activation checkpointing each step frees
// and re-allocates activations of many sizes, which glibc's malloc kept resident (peak RSS grew by
// 2.5x the allocator's peak on this model). The block cache holds no more than the highest live
// total, so the growth over the idle launcher is the allocator's peak plus what is not tensor
// storage (measured 1.13x; bench/bench_rss.py).
TEST(MemoryReport, ResidentMemoryFollowsTheAllocatorUnderCheckpointing) {
  TempDir dir("resident");
  const std::string ds = dir.write("ds.json", R"({"train_micro_batch_size_per_gpu": 4,
      "activation_checkpointing": {}})");
  const std::string yaml = dir.write("train.yaml", R"(model: {arch: gpt2, n_layer: 12, n_head: 4, d_model: 256, d_ff: 1024, vocab_size: 256, n_ctx: 512}
block_size: 512
max_steps: 3
)");
  RunResult r = run(kLauncher + " --deepspeed " + ds + " " + yaml + " --output_dir=" + dir.path().string());
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("resident (RSS): "), std::string::npos) << r.out;

  const rapidjson::Document d = read_json(dir.path() / "memory_report.json");
  const auto& measured = d["ranks"][0]["measured"];
  const auto& resident = measured["resident"];
  const int64_t idle = resident["idle_bytes"].GetInt64();
  const int64_t peak_rss = resident["peak_bytes"].GetInt64();
  const int64_t peak = measured["peak_bytes"].GetInt64();
  ASSERT_GT(idle, 0);
  ASSERT_GT(peak_rss, idle + peak) << "the tensors alone were resident at the peak";
  EXPECT_LT(static_cast<double>(peak_rss - idle), 1.2 * static_cast<double>(peak))
      << "peak RSS " << peak_rss << " - idle RSS " << idle << " against the allocator's peak " << peak;
  const auto& cache = resident["block_cache"];
  EXPECT_GT(cache["hits"].GetInt64(), cache["maps"].GetInt64()) << "most blocks are reused";
}

// --estimate: the plan per rank for world sizes 1..N, from shapes alone, in a file of the report's
// schema; the plain-data-parallel ranks are identical and differ across world sizes only by the
// all-reduce's staging bucket.
TEST(MemoryReport, EstimateCommandPlansWorldSizesOneToN) {
  TempDir dir("estimate");
  RunResult r = run(kLauncher + " --estimate --num_procs 3 --deepspeed " + kConfigs +
                    "ds_config.json " + kConfigs + "train.yaml --output_dir=" + dir.path().string());
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("per rank at world size 3"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("peak of the largest rank by world size"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(dir.path() / "metrics.jsonl")) << "nothing trained";

  const rapidjson::Document d = read_json(dir.path() / "memory_estimate.json");
  const auto& ws = d["world_sizes"];
  ASSERT_EQ(ws.Size(), 3u);
  const int64_t single = ws[0]["ranks"][0]["estimate"]["peak_bytes"].GetInt64();
  const int64_t weights = cells(ws[0]["ranks"][0]["estimate"]["categories"], "weights");
  EXPECT_EQ(weights, 4 * int64_t{3'257'856});  // the main model's parameters, fp32
  for (unsigned w = 0; w < 3; ++w) {
    ASSERT_EQ(ws[w]["world_size"].GetInt(), static_cast<int>(w + 1));
    ASSERT_EQ(ws[w]["ranks"].Size(), w + 1);
    for (const auto& rank : ws[w]["ranks"].GetArray()) {
      const auto& e = rank["estimate"];
      EXPECT_EQ(e["peak_bytes"].GetInt64(), single + (w > 0 ? weights : 0));
      EXPECT_EQ(cells(e["categories"], "comm_buffers"), w > 0 ? weights : 0);
    }
  }
}

}  // namespace
