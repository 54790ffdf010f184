// Every shipped config as users run it, for a few steps: the measured peak against the estimate,
// attributed, no leak and no resident growth. Built twice (tests/engine/CMakeLists.txt): the
// one-rank pairs on one thread each (MEMRT_ONE_RANK_CONFIGS 1, two such tests at a time under
// ctest -j2) and the multi-rank ones on both cores.
#include <gtest/gtest.h>

#include <rapidjson/document.h>

#include <cctype>
#include <cmath>
#include <filesystem>
#include <set>
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

// Each pair is a run the configs' own comments describe. A pair that the built-in plugins still
// refuse must say "not implemented yet"; when a plugin lands, the pair moves to the measured list.
struct Pair {
  const char* ds;
  const char* yaml;
  int ranks;
  const char* overrides = "";  // a large model's run made small enough for a test
};
void PrintTo(const Pair& p, std::ostream* os) { *os << p.ds << " + " << p.yaml; }

const Pair kMeasured[] = {
    {"ds_config.json", "train.yaml", 1},
    {"ds_config.json", "train_llama.yaml", 1},
    {"ds_zero0_2rank.json", "train.yaml", 2},
    {"ds_bf16.json", "train.yaml", 1},
    {"ds_bf16.json", "train_llama.yaml", 1},
    {"ds_bf16_pure.json", "train.yaml", 1},  // bf16 weights and moments, no masters
    {"ds_fp16_dp.json", "train.yaml", 1},
    {"ds_fp16.json", "train.yaml", 2},  // ZeRO-1
    {"ds_auto.json", "train_hf.yaml", 1},  // ZeRO-2
    {"ds_qlora.json", "train_qlora.yaml", 1},  // NF4, LoRA, 8-bit AdamW, checkpointing
    {"ds_qlora.json", "train_llama100m.yaml", 1, " --per_device_train_batch_size=1 --block_size=32"},
    {"ds_zero3_offload.json", "train_llama.yaml", 2},  // ZeRO-3, parameter and optimizer offload
};

#if MEMRT_ONE_RANK_CONFIGS
TEST(MemoryReport, EveryShippedConfigIsCovered) {
  std::set<std::string> covered;
  for (const auto& p : kMeasured) covered.insert({p.ds, p.yaml});
  for (const auto& entry : fs::directory_iterator(kConfigs)) {
    EXPECT_EQ(covered.count(entry.path().filename().string()), 1u)
        << entry.path().filename() << " is in configs/ but in no pair of this test";
  }
}
#endif

// This binary's pairs: those of one rank (with one thread), or those of several.
std::vector<Pair> pairs() {
  std::vector<Pair> out;
  for (const Pair& p : kMeasured)
    if ((p.ranks == 1) == static_cast<bool>(MEMRT_ONE_RANK_CONFIGS)) out.push_back(p);
  return out;
}

class ShippedConfig : public ::testing::TestWithParam<Pair> {};

TEST_P(ShippedConfig, PeakIsWithinTenPercentOfTheEstimateAndAttributed) {
  const Pair& p = GetParam();
  TempDir dir(std::string("memreport_") + p.ds + p.yaml);
  // One rank runs on one thread, beside another test (ctest -j2); several take both cores.
  RunResult r = run(std::string(MEMRT_ONE_RANK_CONFIGS ? "env OMP_NUM_THREADS=1 " : "") + kLauncher + " --num_procs " + std::to_string(p.ranks) + " --master_port " +
                    std::to_string(free_port()) + " --deepspeed " + kConfigs + p.ds + " " +
                    kConfigs + p.yaml + " --max_steps=8 --output_dir=" + dir.path().string() + p.overrides);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("memory at the peak, rank 0 of " + std::to_string(p.ranks)), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("warning: memory"), std::string::npos) << "a normal run has no leak, nor RSS past its estimate\n" << r.out;
  ASSERT_TRUE(fs::exists(dir.path() / "memory_report.html"));

  const rapidjson::Document d = read_json(dir.path() / "memory_report.json");
  ASSERT_EQ(d["world_size"].GetInt(), p.ranks);
  ASSERT_EQ(d["ranks"].Size(), static_cast<unsigned>(p.ranks));
  for (const auto& rank : d["ranks"].GetArray()) {
    const double estimate = static_cast<double>(rank["estimate"]["peak_bytes"].GetInt64());
    const double peak = static_cast<double>(rank["measured"]["peak_bytes"].GetInt64());
    const double unattributed =
        static_cast<double>(cells(rank["measured"]["categories"], "unattributed"));
    EXPECT_LE(std::abs(peak - estimate), 0.10 * estimate)
        << "rank " << rank["rank"].GetInt() << ": measured " << peak << " vs estimate " << estimate;
    EXPECT_LT(unattributed, 0.05 * peak) << "rank " << rank["rank"].GetInt();
    EXPECT_EQ(rank["leaks"].Size(), 0u);
    EXPECT_TRUE(rank["resident_growth"].IsNull());
    EXPECT_EQ(rank["timeline"].Size(), 8u);
    // Training, not set-up, sets every shipped config's peak (0 would be set-up: docs/memory.md).
    EXPECT_GE(rank["measured"]["peak_step"].GetInt64(), 1) << "rank " << rank["rank"].GetInt();
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, ShippedConfig, ::testing::ValuesIn(pairs()),
                         [](const auto& p) {
                           std::string n = std::string(p.param.ds) + "_" + p.param.yaml;
                           for (char& c : n) c = std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
                           return n;
                         });

}  // namespace
