// run_local_ranks / run_rank_processes with real child processes (dist_rank_helper's "echo" and
// "signal_parent" modes): prefixed whole lines, rank environment, exit codes, signals, grace.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <regex>
#include <set>

#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dist/local_launch.h"
#include "dist_test_util.h"
#include "memrt/error.h"

namespace memrt {
namespace {

using test::CaptureFile;
using test::contains;
using test::lines_of;

struct Outcome {
  int code = -1;
  std::string out, err;
  double seconds = 0;
};

Outcome launch(int n, std::vector<std::string> args, std::chrono::milliseconds grace = std::chrono::seconds(10)) {
  CaptureFile out, err;
  LocalLaunchOptions o;
  o.num_procs = n;
  o.executable = DIST_RANK_HELPER;
  o.args = std::move(args);
  o.master_port = 0;
  o.supervisor.stdout_fd = out.fd();
  o.supervisor.stderr_fd = err.fd();
  o.supervisor.grace_period = grace;
  Outcome r;
  auto t0 = std::chrono::steady_clock::now();
  r.code = run_local_ranks(o);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.out = out.text();
  r.err = err.text();
  return r;
}

TEST(DistLocalLaunch, PrefixesWholeLinesAndSetsTheRankEnvironment) {
  test::EnvGuard env({"OMP_NUM_THREADS"});  // unset: the launcher chooses
  Outcome r = launch(3, {"echo", "0", "-1"});
  ASSERT_EQ(r.code, 0) << r.err;
  const std::regex rank_line(R"(\[rank [0-2]\] .*)");
  std::set<std::string> outs;
  for (const auto& l : lines_of(r.out)) {
    EXPECT_TRUE(std::regex_match(l, rank_line)) << "unprefixed or mixed line: " << l;
    outs.insert(l);
  }
  // One port picked for everyone, and every rank's variables.
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex(R"(at 127\.0\.0\.1:(\d+) local)"))) << r.out;
  const std::string port = m[1];
  EXPECT_NE(port, "0");
  for (int k = 0; k < 3; ++k) {
    std::string p = "[rank " + std::to_string(k) + "] ";
    EXPECT_TRUE(outs.count(p + "hello from rank " + std::to_string(k) + " of 3 at 127.0.0.1:" + port +
                           " local " + std::to_string(k) + "/3"))
        << r.out;
    EXPECT_TRUE(outs.count(p + "second line of rank " + std::to_string(k))) << r.out;
    // A last line without a newline is still delivered, whole.
    EXPECT_TRUE(outs.count(p + "no newline at the end")) << r.out;
    EXPECT_TRUE(contains(r.err, p + "a warning from rank " + std::to_string(k) + "\n")) << r.err;
  }
  EXPECT_EQ(lines_of(r.out).size(), 9u) << r.out;
  // The launcher's one line: the threads it gave each rank.
  std::vector<std::string> launcher_lines;
  for (const auto& l : lines_of(r.err))
    if (l.rfind("[launcher]", 0) == 0) launcher_lines.push_back(l);
  ASSERT_EQ(launcher_lines.size(), 1u) << r.err;
  const std::string threads = std::to_string(std::max(1, usable_cores() / 3));
  EXPECT_TRUE(std::regex_match(launcher_lines[0], std::regex(R"(\[launcher\] (warning: )?3 ranks x )" + threads +
                                                              " threads? .*"))) << r.err;
}

// SMT siblings count once: every CPU of the mask made one core's sibling in a fake sysfs gives 1
// (or the mask's count halved when each pair shares a core); sysfs without topology gives the mask.
TEST(DistLocalLaunch, UsableCoresCountPhysicalCores) {
  const int logical = usable_cores("/nonexistent", "/nonexistent");
  const std::string root = ::testing::TempDir() + "memrt_cpus_" + std::to_string(::getpid());
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof set, &set), 0);
  auto topology = [&](int cpu, int core) {
    const std::string dir = root + "/cpu" + std::to_string(cpu) + "/topology";
    std::filesystem::create_directories(dir);
    for (const auto& [name, value] : {std::pair<const char*, int>{"core_id", core}, {"physical_package_id", 0}}) {
      FILE* f = std::fopen((dir + "/" + name).c_str(), "w");
      std::fprintf(f, "%d\n", value);
      std::fclose(f);
    }
  };
  int n = 0;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
    if (CPU_ISSET(cpu, &set)) topology(cpu, n++ / 2);  // pairs of siblings
  EXPECT_EQ(usable_cores("/nonexistent", root), (logical + 1) / 2);
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
    if (CPU_ISSET(cpu, &set)) topology(cpu, 7);  // all on one core
  EXPECT_EQ(usable_cores("/nonexistent", root), 1);
  std::filesystem::remove_all(root);
}

// Threads per rank: OMP_NUM_THREADS when set (oversubscription named, with the value that fits),
// otherwise the usable cores shared out, at least one each.
TEST(DistLocalLaunch, PlanThreadsSharesTheCoresOut) {
  ThreadPlan p = plan_threads(2, 8, nullptr);
  EXPECT_EQ(p.threads, 4);
  EXPECT_FALSE(p.from_environment);
  EXPECT_FALSE(p.oversubscribed);
  EXPECT_EQ(p.note, "2 ranks x 4 threads (8 usable cores; OMP_NUM_THREADS overrides)");
  p = plan_threads(3, 2, nullptr);
  EXPECT_EQ(p.threads, 1);
  EXPECT_TRUE(p.oversubscribed);
  EXPECT_TRUE(contains(p.note, "more ranks than cores")) << p.note;
  p = plan_threads(1, 2, "1");
  EXPECT_EQ(p.threads, 1);
  EXPECT_TRUE(p.from_environment);
  EXPECT_FALSE(p.oversubscribed);
  EXPECT_EQ(p.note, "1 rank x 1 thread (OMP_NUM_THREADS) on 2 usable cores");
  p = plan_threads(2, 2, "4");
  EXPECT_EQ(p.threads, 4);
  EXPECT_TRUE(p.oversubscribed);
  EXPECT_TRUE(contains(p.note, "8 threads oversubscribe them and run slower; set OMP_NUM_THREADS=1 or unset it")) << p.note;
  EXPECT_FALSE(plan_threads(2, 2, "").from_environment);  // empty or not a number: unset
}

// A CPU quota caps the affinity mask's count, rounded up; "max" and v1's -1 mean none.
TEST(DistLocalLaunch, UsableCoresFollowTheCgroupQuota) {
  const int affinity = usable_cores("/nonexistent", "/nonexistent");  // the mask's count
  ASSERT_GE(affinity, 1);
  const std::string dir = ::testing::TempDir() + "memrt_cgroup_" + std::to_string(::getpid());
  ::mkdir(dir.c_str(), 0700);
  auto write = [&](const std::string& name, const std::string& text) {
    FILE* f = std::fopen((dir + "/" + name).c_str(), "w");
    std::fputs(text.c_str(), f);
    std::fclose(f);
  };
  write("cpu.max", "max 100000\n");
  EXPECT_EQ(usable_cores(dir, "/nonexistent"), affinity);
  write("cpu.max", "50000 100000\n");
  EXPECT_EQ(usable_cores(dir, "/nonexistent"), 1);
  write("cpu.max", "150000 100000\n");
  EXPECT_EQ(usable_cores(dir, "/nonexistent"), std::min(affinity, 2));
  std::remove((dir + "/cpu.max").c_str());
  write("cpu.cfs_quota_us", "-1\n");
  write("cpu.cfs_period_us", "100000\n");
  EXPECT_EQ(usable_cores(dir, "/nonexistent"), affinity);
  write("cpu.cfs_quota_us", "100000\n");
  EXPECT_EQ(usable_cores(dir, "/nonexistent"), 1);
  std::remove((dir + "/cpu.cfs_quota_us").c_str());
  std::remove((dir + "/cpu.cfs_period_us").c_str());
  ::rmdir(dir.c_str());
}

TEST(DistLocalLaunch, FailingRankStopsTheOthersAndSetsTheExitCode) {
  Outcome r = launch(3, {"echo", "7", "1"});
  EXPECT_EQ(r.code, 7);
  EXPECT_TRUE(contains(r.err, "[launcher] rank 1 exited with code 7; stopping the other 2 rank(s)")) << r.err;
  EXPECT_TRUE(contains(r.out, "[rank 1] hello from rank 1")) << r.out;
  EXPECT_LT(r.seconds, 10.0);  // the waiting ranks died on SIGTERM, well before the grace ran out
}

// Exit code 2 is pre-flight's refusal, which every rank reaches together: the others are left
// to exit on their own (and print their part), not stopped.
TEST(DistLocalLaunch, ARefusalLetsTheOtherRanksExitOnTheirOwn) {
  const std::string fifo = ::testing::TempDir() + "memrt_refuse_" + std::to_string(::getpid());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << "cannot create the fifo " << fifo;
  Outcome r = launch(2, {"refuse", fifo});
  ::unlink(fifo.c_str());
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.out, "[rank 0] rank 0 refused too")) << r.out << r.err;
  EXPECT_FALSE(contains(r.err, "stopping the other")) << r.err;
}

TEST(DistLocalLaunch, RankKilledBySignal) {
  Outcome r = launch(2, {"echo", "kill", "0"});
  EXPECT_EQ(r.code, 128 + 9);
  EXPECT_TRUE(contains(r.err, "[launcher] rank 0 was killed by signal 9 (Killed)")) << r.err;
}

TEST(DistLocalLaunch, SigkillAfterGracePeriod) {
  // Rank 0 fails; rank 1 ignores SIGTERM and must be SIGKILLed after the (short) grace period.
  // Rank 0 fails only once rank 1 ignores SIGTERM (the fifo), else SIGTERM could beat it.
  const std::string ready = ::testing::TempDir() + "memrt_ready_" + std::to_string(::getpid());
  ASSERT_EQ(::mkfifo(ready.c_str(), 0600), 0) << "cannot create the fifo " << ready;
  Outcome r = launch(2, {"echo", "5", "0", "ignore_term", ready}, std::chrono::milliseconds(300));
  ::unlink(ready.c_str());
  EXPECT_EQ(r.code, 5);
  EXPECT_TRUE(contains(r.err, "rank 1 did not stop within the grace period and was killed")) << r.err;
  EXPECT_GE(r.seconds, 0.3);
  EXPECT_LT(r.seconds, 10.0);
}

TEST(DistLocalLaunch, ForwardsSigtermToTheRanks) {
  // Rank 0 sends SIGTERM to its parent (the launcher, i.e. this test process): the launcher must
  // forward it, the ranks die of it, and the launcher reports 128 + SIGTERM.
  Outcome r = launch(2, {"signal_parent"});
  EXPECT_EQ(r.code, 128 + 15);
  EXPECT_TRUE(contains(r.err, "[launcher] received SIGTERM; forwarding it to every rank")) << r.err;
}

TEST(DistLocalLaunch, ReportsHowEveryRankEnded) {
  CaptureFile out, err;
  std::vector<RankCommand> cmds(2);
  for (int k = 0; k < 2; ++k) {
    cmds[k].rank = k;
    // rank 0 exits 3 at once; rank 1 exits 0 on its own (FAILRANK -1: no waiting)
    cmds[k].argv = {DIST_RANK_HELPER, "echo", k == 0 ? "3" : "0", k == 0 ? "0" : "-1"};
    cmds[k].env = {{"RANK", std::to_string(k)}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"},
                   {"LOCAL_SIZE", "1"}, {"MASTER_ADDR", "x"}, {"MASTER_PORT", "1"}};
  }
  SupervisorOptions o;
  o.stdout_fd = out.fd();
  o.stderr_fd = err.fd();
  o.stop_on_failure = false;
  std::vector<RankExit> report;
  o.report = &report;
  EXPECT_EQ(run_rank_processes(cmds, o), 3);
  ASSERT_EQ(report.size(), 2u);
  EXPECT_EQ(report[0].exit_code, 3);
  EXPECT_EQ(report[1].exit_code, 0);  // not stopped: it finished on its own
  EXPECT_TRUE(contains(err.text(), "[launcher] rank 0 exited with code 3\n")) << err.text();
}

TEST(DistLocalLaunch, Errors) {
  LocalLaunchOptions o;
  o.executable = DIST_RANK_HELPER;
  o.num_procs = 0;
  EXPECT_THROW(run_local_ranks(o), Error);
  o.num_procs = 1;
  o.master_port = 70000;
  EXPECT_THROW(run_local_ranks(o), Error);
  o.master_port = 0;
  o.executable = "memrt-no-such-program";
  try {
    run_local_ranks(o);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "cannot execute 'memrt-no-such-program': not found in PATH")) << e.what();
  }
  o.executable = std::string(MEMRT_SOURCE_DIR) + "/no/such/file";
  EXPECT_THROW(run_local_ranks(o), Error);
}

TEST(DistLocalLaunch, PicksFreePorts) {
  int p = pick_free_port("127.0.0.1");
  EXPECT_GT(p, 0);
  EXPECT_LE(p, 65535);
  EXPECT_THROW(pick_free_port("no-such-host.invalid"), Error);
}

}  // namespace
}  // namespace memrt
