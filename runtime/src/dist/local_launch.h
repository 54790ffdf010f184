// dist/local_launch.h — what `launcher --num_procs N` does: start N ranks of one program on this
// host with the rendezvous environment set, print their output line by line prefixed with the
// rank, and stop them all as soon as one fails.
//
//   memrt::LocalLaunchOptions o;
//   o.num_procs = 4;
//   o.executable = "/proc/self/exe";          // or any program; no shell is involved
//   o.args = {"--deepspeed", "ds.json", "train.yaml"};
//   o.master_port = 0;                        // pick a free port
//   return memrt::run_local_ranks(o);         // 0, or the first failing rank's exit code
//
// Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, CROSS_RANK (0), CROSS_SIZE (1),
// MASTER_ADDR and MASTER_PORT, on top of the launcher's own environment; OMP_NUM_THREADS is set
// to max(1, usable cores / N) when the launcher's environment does not set it (as torchrun does),
// so N ranks do not oversubscribe the cores, and the launcher says what it chose (plan_threads).
#pragma once

#include <chrono>
#include <string>
#include <utility>
#include <vector>

namespace memrt {

// One process of a job: its rank (for the "[rank R] " prefix), the program and its arguments
// (argv[0] is the program path or a name searched in PATH), and variables to add to the
// launcher's environment.
struct RankCommand {
  int rank = 0;
  std::vector<std::string> argv;
  std::vector<std::pair<std::string, std::string>> env;
};

// How one rank ended (SupervisorOptions::report).
struct RankExit {
  int rank = 0;
  int exit_code = 0;  // the process's exit code, or 128 + signal when killed by one
  int signal = 0;     // the signal that killed it, 0 if it exited
  std::chrono::steady_clock::time_point ended;  // when the supervisor reaped it
};

struct SupervisorOptions {
  // After the first failure (or a forwarded SIGINT/SIGTERM) the others get SIGTERM, then SIGKILL
  // once this has passed (DeepSpeed waits 30 s; ranks that save on SIGTERM need a few seconds).
  std::chrono::milliseconds grace_period{std::chrono::seconds(10)};
  // Where prefixed lines go (the launcher's own stdout and stderr by default). Each line is one
  // write(), so lines from different ranks never mix.
  int stdout_fd = 1;
  int stderr_fd = 2;
  // false: a failing rank is reported but the others are left to notice on their own (tests of
  // dead-rank detection use this).
  bool stop_on_failure = true;
  // A rank exiting with this code ended in a step every rank takes (pre-flight's refusal: exit
  // code 2, which every rank reaches together): the others get the grace period to exit on their
  // own — and to print their part — before SIGTERM. 0: none.
  int collective_exit_code = 2;
  // When set, receives how every rank ended, in rank-command order.
  std::vector<RankExit>* report = nullptr;
};

// Starts every command (fork/exec, no shell; each in its own process group, stdin from
// /dev/null, killed if the supervisor itself dies), relays "[rank R] <line>" from each one's
// stdout to stdout_fd and its stderr to stderr_fd, and waits for all of them. When one exits
// non-zero or is killed by a signal, prints which rank and how ("[launcher] rank 1 exited with
// code 3" / "[launcher] rank 1 was killed by signal 9 (Killed)"), SIGTERMs the others and
// SIGKILLs them after the grace period. SIGINT and SIGTERM sent to the caller during the run are
// forwarded to every rank (the caller's handlers are restored afterwards).
// Returns 0 when every rank exits 0; otherwise the first failing rank's exit code, 128 + signal
// when it was killed by a signal, or 128 + the forwarded signal when interrupted.
// Throws memrt::Error before starting anything when a program cannot be executed.
int run_rank_processes(const std::vector<RankCommand>& commands,
                       const SupervisorOptions& options = {});

struct LocalLaunchOptions {
  int num_procs = 1;
  std::string executable;          // path, or a name searched in PATH
  std::vector<std::string> args;   // after the executable
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;         // 0: pick a free port on master_addr
  SupervisorOptions supervisor;
};

// N local ranks of `executable args...` (see the top of this file). Returns like
// run_rank_processes. Throws memrt::Error for num_procs < 1, an empty or non-executable
// executable, or a master_port out of range.
int run_local_ranks(const LocalLaunchOptions& opts);

// The cores this process may run on: the physical cores of its CPU affinity mask (taskset, a
// cpuset; SMT siblings counted once, from `cpu_root`/cpuN/topology), fewer when a CPU quota caps
// them — cgroup v2's cpu.max or v1's cpu.cfs_quota_us / cpu.cfs_period_us under `cgroup_root`,
// rounded up (a container given 1.5 CPUs gets 2 threads). At least 1.
int usable_cores(const std::string& cgroup_root = "/sys/fs/cgroup",
                 const std::string& cpu_root = "/sys/devices/system/cpu");

// The intra-op threads of each of `ranks` processes on a host with `cores` usable cores:
// OMP_NUM_THREADS when the environment sets it (`omp_num_threads`, null when unset), otherwise
// max(1, cores / ranks). `note` is the launcher's line about it; `oversubscribed` when the ranks'
// threads together exceed the cores (the note then says how to fix it).
struct ThreadPlan {
  int threads = 1;
  bool from_environment = false;
  bool oversubscribed = false;
  std::string note;
};
ThreadPlan plan_threads(int ranks, int cores, const char* omp_num_threads);

// A TCP port that was free on `addr` a moment ago (bind to port 0, read it back, close).
int pick_free_port(const std::string& addr = "127.0.0.1");

}  // namespace memrt
