// Real multi-process runs over Gloo on loopback: 2- and 3-rank collectives, bucketed gradient
// averaging, data-parallel equivalence with one process, the ssh command lines run through a
// local shell, and ranks dying mid-collective. The checks themselves are in dist_rank_helper;
// here every rank must print its OK line and exit 0 (or, for a dead peer, fail in time).
#include <gtest/gtest.h>

#include <chrono>

#include "dist/hostfile.h"
#include "dist/local_launch.h"
#include "dist_test_util.h"

namespace memrt {
namespace {

using test::CaptureFile;
using test::contains;

struct Outcome {
  int code = -1;
  std::string out, err;
};

Outcome launch(int n, const std::vector<std::string>& args) {
  CaptureFile out, err;
  LocalLaunchOptions o;
  o.num_procs = n;
  o.executable = DIST_RANK_HELPER;
  o.args = args;
  o.master_port = 0;  // a free port: concurrent tests never collide
  o.supervisor.stdout_fd = out.fd();
  o.supervisor.stderr_fd = err.fd();
  Outcome r;
  r.code = run_local_ranks(o);
  r.out = out.text();
  r.err = err.text();
  return r;
}

void expect_all_ok(const Outcome& r, int n, const std::string& mode) {
  EXPECT_EQ(r.code, 0) << r.err << r.out;
  for (int k = 0; k < n; ++k) {
    std::string ok = "[rank " + std::to_string(k) + "] OK " + mode + " rank " + std::to_string(k) +
                     " world " + std::to_string(n);
    EXPECT_TRUE(contains(r.out, ok)) << "missing '" << ok << "'\n" << r.out << r.err;
  }
  EXPECT_FALSE(contains(r.err, "FAIL")) << r.err;
}

// Single process, no launcher variables: the helper's checks hold with world size 1.
Outcome run_alone(const std::vector<std::string>& args) {
  test::EnvGuard g(test::dist_variables());
  CaptureFile out, err;
  RankCommand c;
  c.argv = {DIST_RANK_HELPER};
  c.argv.insert(c.argv.end(), args.begin(), args.end());
  SupervisorOptions o;
  o.stdout_fd = out.fd();
  o.stderr_fd = err.fd();
  Outcome r;
  r.code = run_rank_processes({c}, o);
  r.out = out.text();
  r.err = err.text();
  return r;
}

TEST(DistCollectives, TwoRanks) { expect_all_ok(launch(2, {"collectives"}), 2, "collectives"); }
TEST(DistCollectives, ThreeRanks) { expect_all_ok(launch(3, {"collectives"}), 3, "collectives"); }
TEST(DistCollectives, OneRank) { expect_all_ok(run_alone({"collectives"}), 1, "collectives"); }

// Bucket sizes: 64 B (smaller than every tensor but the scalar: tensors split over many
// buckets), 1000 B (smaller than the 8448 B matrix), 4096 B, 1 MiB (everything in one bucket).
const std::vector<std::string> kGradArgs = {"grads", "64", "1000", "4096", "1048576"};

TEST(DistGradientAllReduce, TwoRanksEqualsPlainAverage) { expect_all_ok(launch(2, kGradArgs), 2, "grads"); }
TEST(DistGradientAllReduce, ThreeRanksEqualsPlainAverage) { expect_all_ok(launch(3, kGradArgs), 3, "grads"); }
TEST(DistGradientAllReduce, OneRankLeavesGradients) { expect_all_ok(run_alone(kGradArgs), 1, "grads"); }

TEST(DistGradientAllReduce, DataParallelEqualsOneProcess) {
  expect_all_ok(launch(2, {"dp_equiv"}), 2, "dp_equiv");
  expect_all_ok(launch(3, {"dp_equiv"}), 3, "dp_equiv");
  expect_all_ok(launch(4, {"dp_equiv"}), 4, "dp_equiv");
}

// The per-rank ssh command lines of a 2-host hostfile, with "ssh HOST" replaced by "sh -c": the
// quoting, the environment and the rank assignment are exercised by a real shell and a real job.
TEST(DistSshCommands, RunThroughALocalShell) {
  auto nodes = select_resources(parse_hostfile_text("node-a slots=1\nnode-b slots=2\n", "hostfile"));
  SshLaunchOptions o;
  o.master_addr = "127.0.0.1";
  o.master_port = pick_free_port();
  o.cwd = ::testing::TempDir();
  o.program = DIST_RANK_HELPER;
  o.args = {"collectives"};
  std::vector<RankCommand> cmds;
  for (const auto& c : ssh_rank_commands(nodes, o)) {
    RankCommand local = c.command;
    local.argv = {"/bin/sh", "-c", c.remote_command};
    cmds.push_back(local);
  }
  CaptureFile out, err;
  SupervisorOptions so;
  so.stdout_fd = out.fd();
  so.stderr_fd = err.fd();
  Outcome r;
  {
    test::EnvGuard g(test::dist_variables());
    r.code = run_rank_processes(cmds, so);
  }
  r.out = out.text();
  r.err = err.text();
  expect_all_ok(r, 3, "collectives");
}

// A rank SIGKILLed in the middle of a run of all-reduces: every other rank must notice, print a
// DistributedError naming itself, the collective and the likely cause, and exit non-zero, well
// within 60 s. The launcher is told not to stop them, so they must stop on their own.
void dead_rank(int n, int victim) {
  CaptureFile out, err;
  LocalLaunchOptions o;
  o.num_procs = n;
  o.executable = DIST_RANK_HELPER;
  o.args = {"die", std::to_string(victim), "20"};
  o.master_port = 0;
  o.supervisor.stdout_fd = out.fd();
  o.supervisor.stderr_fd = err.fd();
  o.supervisor.stop_on_failure = false;
  std::vector<RankExit> report;
  o.supervisor.report = &report;
  EXPECT_EQ(run_local_ranks(o), 128 + 9);
  const std::string e = err.text();
  ASSERT_EQ(report.size(), static_cast<size_t>(n));
  EXPECT_EQ(report[victim].signal, 9) << e;
  double worst = 0;
  for (int k = 0; k < n; ++k) {
    if (k == victim) continue;
    EXPECT_EQ(report[k].exit_code, 3) << "rank " << k << "\n" << e;
    double s = std::chrono::duration<double>(report[k].ended - report[victim].ended).count();
    worst = std::max(worst, s);
    std::string p = "[rank " + std::to_string(k) + "] ";
    EXPECT_TRUE(contains(e, p + "caught DistributedError")) << e;
    EXPECT_TRUE(contains(e, "rank " + std::to_string(k) + " of " + std::to_string(n) +
                                ": all_reduce_sum of a Float tensor of shape [262144]"))
        << e;
    EXPECT_TRUE(contains(e, "a peer rank probably died")) << e;
    EXPECT_TRUE(contains(e, "Gloo said:")) << e;
    // The next collective is refused at once.
    EXPECT_TRUE(contains(e, p + "then: rank " + std::to_string(k) + ": barrier refused")) << e;
  }
  std::cout << n << " ranks, rank " << victim << " SIGKILLed: the last survivor exited "
            << worst << " s after it\n";
  ::testing::Test::RecordProperty("seconds_to_detect_rank_" + std::to_string(victim) + "_of_" +
                                      std::to_string(n),
                                  std::to_string(worst));
  EXPECT_LT(worst, 60.0);
}

TEST(DistDeadRank, ThreeRanksMiddleRankKilled) { dead_rank(3, 1); }

// A rank that hangs (SIGSTOP) instead of dying: the others give up when the collective timeout
// (MEMRT_DIST_TIMEOUT = 3 s here) expires; the launcher then stops the job: SIGTERM followed by
// SIGCONT ends even the stopped rank long before the (20 s) grace period runs out.
TEST(DistDeadRank, HungRankHitsTheTimeout) {
  test::EnvGuard g(test::dist_variables());
  g.set("MEMRT_DIST_TIMEOUT", "3");
  CaptureFile out, err;
  LocalLaunchOptions o;
  o.num_procs = 2;
  o.executable = DIST_RANK_HELPER;
  o.args = {"die", "1", "5", "hang"};
  o.master_port = 0;
  o.supervisor.stdout_fd = out.fd();
  o.supervisor.stderr_fd = err.fd();
  o.supervisor.grace_period = std::chrono::seconds(20);
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(run_local_ranks(o), 3);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string e = err.text();
  EXPECT_TRUE(contains(e, "[rank 0] caught DistributedError")) << e;
  EXPECT_TRUE(contains(e, "rank 0 of 2: all_reduce_sum")) << e;
  EXPECT_TRUE(contains(e, "each collective waits at most 3 s")) << e;
  EXPECT_TRUE(contains(e, "[launcher] rank 0 exited with code 3")) << e;
  EXPECT_FALSE(contains(e, "did not stop within the grace period")) << e;
  std::cout << "a hung rank with a 3 s timeout: the job ended after " << s << " s\n";
  EXPECT_LT(s, 15.0);
}
TEST(DistDeadRank, TwoRanksStoreHostKilled) { dead_rank(2, 0); }

}  // namespace
}  // namespace memrt
