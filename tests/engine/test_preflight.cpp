// Pre-flight (docs/preflight.md) as users meet it: a run whose estimate exceeds --memory_budget is
// refused with exit code 2 before it allocates, saying what it needs by category and what to do;
// ranks on one host add up; --no_preflight starts it anyway; a budget that is not a size names the key.
#include <gtest/gtest.h>

#include <string>

#include "run_helpers.h"

namespace {

using namespace memrt_test;

const char* kYaml =
    "model: {arch: gpt2, n_layer: 2, n_head: 2, d_model: 64, d_ff: 256, vocab_size: 256, n_ctx: 32}\n"
    "block_size: 32\nmax_steps: 1\nlogging_steps: 1\n";

// The number right after `said` in `out` (-1 when absent).
int64_t number_after(const std::string& out, const std::string& said) {
  const size_t at = out.find(said);
  return at == std::string::npos ? -1 : std::stoll(out.substr(at + said.size()));
}

}  // namespace

TEST(Preflight, ARunThatWouldNotFitIsRefusedBeforeItAllocatesAndTheRanksOfAHostAddUp) {
  TempDir dir("preflight");
  const std::string ds = dir.write("ds.json", R"({"train_micro_batch_size_per_gpu": 4})");
  const std::string yaml = dir.write("train.yaml", kYaml);
  auto launch = [&](int ranks, const std::string& args) {
    return run("env OMP_NUM_THREADS=1 " + kLauncher + " --num_procs " + std::to_string(ranks) + " --master_port " +
               std::to_string(free_port()) + " --deepspeed " + ds + " " + yaml + " --output_dir=" +
               (dir.path() / "out").string() + " " + args);
  };
  const RunResult refused = launch(1, "--memory_budget=1MiB");
  EXPECT_EQ(refused.exit_code, 2) << refused.out;
  for (const char* part : {"this run would not fit in memory, so it did not start", "1 rank(s)",
                           "memory_budget (train.yaml or --memory_budget) allows: 1048576 B", "weights",
                           "optimizer_state", "activations", "resident at set-up", "--no_preflight",
                           "docs/preflight.md"})
    EXPECT_NE(refused.out.find(part), std::string::npos) << part << "\n" << refused.out;
  // Nothing was allocated: no model, no store (the data of this run is read into no tensor).
  const int64_t allocated = number_after(refused.out, "the allocator's peak so far: ");
  EXPECT_GE(allocated, 0) << refused.out;
  EXPECT_LT(allocated, 100000) << refused.out;
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "out" / "memory_report.json"));
  const int64_t need = number_after(refused.out, "need an estimated ");
  ASSERT_GT(need, 0) << refused.out;

  // A budget above one rank's need and below two ranks' on the same host.
  const std::string budget = "--memory_budget=" + std::to_string(need * 3 / 2);
  const RunResult one = launch(1, budget);
  EXPECT_EQ(one.exit_code, 0) << one.out;
  EXPECT_NE(one.out.find("memory pre-flight: this host's 1 rank(s) need an estimated "), std::string::npos) << one.out;
  EXPECT_NE(one.out.find("allowed by memory_budget"), std::string::npos) << one.out;
  const RunResult two = launch(2, budget);
  EXPECT_EQ(two.exit_code, 2) << two.out;
  EXPECT_NE(two.out.find("this host's 2 rank(s) need"), std::string::npos) << two.out;

  const RunResult anyway = launch(1, "--memory_budget=1MiB --no_preflight");
  EXPECT_EQ(anyway.exit_code, 0) << anyway.out;

  const RunResult bad = launch(1, "--memory_budget=lots");
  EXPECT_EQ(bad.exit_code, 1) << bad.out;
  EXPECT_NE(bad.out.find("memory_budget"), std::string::npos) << bad.out;
  EXPECT_NE(bad.out.find("6GiB"), std::string::npos) << bad.out;
}
