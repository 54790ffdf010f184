// dist/local_launch.cpp — the rank supervisor: fork/exec, line-prefixed output relay through
// pipes, fail-fast on the first failing rank, signal forwarding. POSIX only.
#include "dist/local_launch.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#if defined(__linux__)
#include <sched.h>
#include <sys/prctl.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include "memrt/error.h"

extern char** environ;

namespace memrt {

namespace {

using Clock = std::chrono::steady_clock;

// ---- signals: handlers only write the signal number to a self-pipe ----------------------------

int g_signal_pipe_write = -1;

extern "C" void memrt_launch_on_signal(int sig) {
  int saved = errno;
  if (g_signal_pipe_write >= 0) {
    unsigned char b = static_cast<unsigned char>(sig);
    ssize_t r = ::write(g_signal_pipe_write, &b, 1);
    (void)r;
  }
  errno = saved;
}

// Installs the handlers for the lifetime of one supervision and restores the caller's after.
class SignalScope {
 public:
  SignalScope() {
    if (::pipe2(fds_, O_CLOEXEC | O_NONBLOCK) != 0) {
      throw Error(std::string("launcher: cannot create a pipe: ") + std::strerror(errno));
    }
    g_signal_pipe_write = fds_[1];
    struct sigaction sa {};
    sa.sa_handler = memrt_launch_on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    for (int i = 0; i < 3; ++i) ::sigaction(kSignals[i], &sa, &old_[i]);
  }
  ~SignalScope() {
    for (int i = 0; i < 3; ++i) ::sigaction(kSignals[i], &old_[i], nullptr);
    g_signal_pipe_write = -1;
    ::close(fds_[0]);
    ::close(fds_[1]);
  }
  SignalScope(const SignalScope&) = delete;
  SignalScope& operator=(const SignalScope&) = delete;
  int read_fd() const { return fds_[0]; }

 private:
  static constexpr int kSignals[3] = {SIGCHLD, SIGINT, SIGTERM};
  int fds_[2] = {-1, -1};
  struct sigaction old_[3];
};

// ---- output relay -------------------------------------------------------------------------------

void write_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t w = ::write(fd, s.data() + off, s.size() - off);
    if (w < 0) {
      if (errno == EINTR) continue;
      return;  // the reader went away; nothing sensible to do with the output
    }
    off += static_cast<size_t>(w);
  }
}

struct Stream {
  int fd = -1;      // read end of the child's pipe; -1 once closed
  int out_fd = 1;   // where its lines go
  std::string prefix;
  std::string partial;

  void emit(const std::string& line) const { write_all(out_fd, prefix + line + "\n"); }

  // Reads what is available; emits whole lines. Returns false at end of file.
  bool pump() {
    char buf[65536];
    for (;;) {
      ssize_t n = ::read(fd, buf, sizeof buf);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
        n = 0;  // treat a read error as end of file
      }
      if (n == 0) {
        if (!partial.empty()) emit(partial);
        partial.clear();
        return false;
      }
      partial.append(buf, static_cast<size_t>(n));
      size_t start = 0, nl;
      while ((nl = partial.find('\n', start)) != std::string::npos) {
        emit(partial.substr(start, nl - start));
        start = nl + 1;
      }
      partial.erase(0, start);
      if (partial.size() > (1u << 20)) {  // a 1 MiB line without newline: pass it on anyway
        emit(partial);
        partial.clear();
      }
    }
  }

  void close() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
};

struct Child {
  int rank = 0;
  pid_t pid = -1;
  bool alive = false;
  int status = 0;
  Clock::time_point ended;
  Stream out, err;
};

std::string resolve_executable(const std::string& name) {
  if (name.empty()) throw Error("launcher: no program to run (the executable is empty)");
  if (name.find('/') != std::string::npos) {
    if (::access(name.c_str(), X_OK) != 0) {
      throw Error("launcher: cannot execute '" + name + "': " + std::strerror(errno) +
                  "; give the path of an executable file");
    }
    return name;
  }
  const char* path = std::getenv("PATH");
  std::string p = path ? path : "/usr/bin:/bin";
  size_t start = 0;
  while (start <= p.size()) {
    size_t end = p.find(':', start);
    if (end == std::string::npos) end = p.size();
    std::string dir = p.substr(start, end - start);
    if (dir.empty()) dir = ".";
    std::string cand = dir + "/" + name;
    if (::access(cand.c_str(), X_OK) == 0) return cand;
    start = end + 1;
  }
  throw Error("launcher: cannot execute '" + name + "': not found in PATH; give its full path");
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    int s = WTERMSIG(status);
    const char* name = ::strsignal(s);
    return "was killed by signal " + std::to_string(s) + " (" + (name ? name : "?") + ")";
  }
  return "ended with status " + std::to_string(status);
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace

int run_rank_processes(const std::vector<RankCommand>& commands, const SupervisorOptions& options) {
  if (commands.empty()) throw Error("launcher: no ranks to run");

  // Everything the children need is prepared before the first fork: between fork and exec only
  // async-signal-safe calls are made.
  struct Prepared {
    std::string path;
    std::vector<std::string> argv, envv;
    std::vector<char*> argp, envp;
  };
  std::vector<Prepared> prep(commands.size());
  for (size_t i = 0; i < commands.size(); ++i) {
    const RankCommand& c = commands[i];
    if (c.argv.empty()) throw Error("launcher: rank " + std::to_string(c.rank) + " has no command");
    Prepared& p = prep[i];
    p.path = resolve_executable(c.argv[0]);
    p.argv = c.argv;
    std::map<std::string, std::string> env;
    std::vector<std::string> order;
    for (char** e = environ; e && *e; ++e) {
      std::string kv(*e);
      size_t eq = kv.find('=');
      if (eq == std::string::npos) continue;
      std::string k = kv.substr(0, eq);
      if (!env.count(k)) order.push_back(k);
      env[k] = kv.substr(eq + 1);
    }
    for (const auto& [k, v] : c.env) {
      if (!env.count(k)) order.push_back(k);
      env[k] = v;
    }
    for (const auto& k : order) p.envv.push_back(k + "=" + env[k]);
    for (auto& s : p.argv) p.argp.push_back(s.data());
    p.argp.push_back(nullptr);
    for (auto& s : p.envv) p.envp.push_back(s.data());
    p.envp.push_back(nullptr);
  }
  int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (devnull < 0) throw Error(std::string("launcher: cannot open /dev/null: ") + std::strerror(errno));

  SignalScope signals;
  const pid_t supervisor = ::getpid();
  std::vector<Child> children(commands.size());
  auto say = [&](const std::string& line) { write_all(options.stderr_fd, "[launcher] " + line + "\n"); };

  auto kill_all = [&](int sig) {
    for (auto& c : children) {
      if (c.alive) ::kill(-c.pid, sig);  // the rank's whole process group
    }
  };

  for (size_t i = 0; i < commands.size(); ++i) {
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
      int e = errno;
      kill_all(SIGKILL);
      for (auto& c : children) {
        if (c.alive) ::waitpid(c.pid, nullptr, 0);
      }
      ::close(devnull);
      throw Error(std::string("launcher: cannot create pipes: ") + std::strerror(e));
    }
    pid_t pid = ::fork();
    if (pid == 0) {
      // ---- child: async-signal-safe calls only ----
      ::setpgid(0, 0);
#if defined(__linux__)
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != supervisor) ::_exit(127);
#endif
      ::dup2(devnull, 0);
      ::dup2(out[1], 1);
      ::dup2(err[1], 2);
      ::execve(prep[i].path.c_str(), prep[i].argp.data(), prep[i].envp.data());
      const char msg[] = "launcher: execve failed\n";
      ssize_t r = ::write(2, msg, sizeof msg - 1);
      (void)r;
      ::_exit(127);
    }
    int fork_errno = errno;
    ::close(out[1]);
    ::close(err[1]);
    if (pid < 0) {
      ::close(out[0]);
      ::close(err[0]);
      kill_all(SIGKILL);
      for (auto& c : children) {
        if (c.alive) ::waitpid(c.pid, nullptr, 0);
      }
      ::close(devnull);
      throw Error(std::string("launcher: fork failed: ") + std::strerror(fork_errno));
    }
    ::setpgid(pid, pid);  // also from here, so the group exists before any kill(-pid)
    Child& c = children[i];
    c.rank = commands[i].rank;
    c.pid = pid;
    c.alive = true;
    std::string prefix = "[rank " + std::to_string(c.rank) + "] ";
    c.out = Stream{out[0], options.stdout_fd, prefix, {}};
    c.err = Stream{err[0], options.stderr_fd, prefix, {}};
    ::fcntl(out[0], F_SETFL, O_NONBLOCK);
    ::fcntl(err[0], F_SETFL, O_NONBLOCK);
  }
  ::close(devnull);

  int result = 0;            // first failure's code
  bool failed = false;
  int interrupted_by = 0;    // a forwarded signal
  std::optional<Clock::time_point> kill_at;      // SIGKILL the survivors then
  std::optional<Clock::time_point> term_at;      // after a collective exit: SIGTERM the survivors then
  std::optional<Clock::time_point> drain_until;  // all reaped: stop reading then
  const auto drain_time = std::chrono::seconds(2);

  auto stop_others = [&](const std::string& why) {
    if (kill_at) return;
    size_t n = static_cast<size_t>(std::count_if(children.begin(), children.end(),
                                                 [](const Child& c) { return c.alive; }));
    if (n > 0) {
      say(why + "; stopping the other " + std::to_string(n) + " rank(s) (SIGTERM, then SIGKILL after " +
          std::to_string(options.grace_period.count()) + " ms)");
      kill_all(SIGTERM);
      kill_all(SIGCONT);  // a stopped (hung) rank receives its SIGTERM too
    }
    kill_at = Clock::now() + options.grace_period;
  };

  for (;;) {
    // ---- reap ----
    bool any_alive = false;
    for (auto& c : children) {
      if (!c.alive) continue;
      int st = 0;
      pid_t r = ::waitpid(c.pid, &st, WNOHANG);
      if (r == c.pid) {
        c.alive = false;
        c.status = st;
        c.ended = Clock::now();
        bool ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
        if (!ok && !failed && !interrupted_by && !kill_at) {
          failed = true;
          result = exit_code_of(st);
          // Let the rank's last words through before announcing it.
          for (Stream* s : {&c.out, &c.err}) {
            if (s->fd >= 0 && !s->pump()) s->close();
          }
          std::string what = "rank " + std::to_string(c.rank) + " " + describe_status(st);
          const bool collective = options.collective_exit_code != 0 && WIFEXITED(st) &&
                                  WEXITSTATUS(st) == options.collective_exit_code;
          if (options.stop_on_failure && collective) {
            term_at = Clock::now() + options.grace_period;  // the others are on their way out too
          } else if (options.stop_on_failure) {
            stop_others(what);
          } else {
            say(what);
          }
        } else if (!ok && kill_at) {
          // Stopped by us; mentioned only when it took SIGKILL.
          if (WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL) {
            say("rank " + std::to_string(c.rank) + " did not stop within the grace period and was killed");
          }
        }
      } else if (r < 0 && errno == ECHILD) {
        c.alive = false;
      } else {
        any_alive = true;
      }
    }
    if (!any_alive && !drain_until) drain_until = Clock::now() + drain_time;

    // ---- streams still open ----
    std::vector<pollfd> fds;
    std::vector<Stream*> streams;
    fds.push_back({signals.read_fd(), POLLIN, 0});
    streams.push_back(nullptr);
    for (auto& c : children) {
      for (Stream* s : {&c.out, &c.err}) {
        if (s->fd >= 0) {
          fds.push_back({s->fd, POLLIN, 0});
          streams.push_back(s);
        }
      }
    }
    if (!any_alive && fds.size() == 1) break;  // everything reaped and read

    auto now = Clock::now();
    if (term_at && now >= *term_at) {
      term_at.reset();
      stop_others("the ranks did not all exit after a refusal");
    }
    if (kill_at && now >= *kill_at) {
      kill_all(SIGKILL);
      kill_at = Clock::time_point::max();  // once
    }
    if (drain_until && now >= *drain_until) {
      // A grandchild still holds a pipe open; the ranks are gone, so stop waiting for it.
      for (size_t k = 1; k < fds.size(); ++k) streams[k]->close();
      break;
    }
    int wait_ms = -1;
    auto bound = [&](std::optional<Clock::time_point> t) {
      if (!t || *t == Clock::time_point::max()) return;
      auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(*t - now).count() + 1;
      wait_ms = wait_ms < 0 ? static_cast<int>(ms) : std::min(wait_ms, static_cast<int>(ms));
    };
    bound(kill_at);
    bound(term_at);
    bound(drain_until);
    // SIGCHLD wakes the poll through the self-pipe; the bound is a backstop against a lost wakeup.
    if (wait_ms < 0 || wait_ms > 1000) wait_ms = 1000;

    int n = ::poll(fds.data(), fds.size(), wait_ms);
    if (n < 0 && errno != EINTR) break;
    if (n <= 0) continue;
    if (fds[0].revents & POLLIN) {
      unsigned char sigs[64];
      ssize_t got;
      while ((got = ::read(signals.read_fd(), sigs, sizeof sigs)) > 0) {
        for (ssize_t k = 0; k < got; ++k) {
          int s = sigs[k];
          if (s == SIGINT || s == SIGTERM) {
            if (!interrupted_by && !failed) {
              interrupted_by = s;
              say(std::string("received ") + (s == SIGINT ? "SIGINT" : "SIGTERM") +
                  "; forwarding it to every rank");
              for (auto& c : children) {
                if (c.alive) ::kill(-c.pid, s);
              }
              kill_at = Clock::now() + options.grace_period;
            }
          }
        }
      }
    }
    for (size_t k = 1; k < fds.size(); ++k) {
      if (fds[k].revents & (POLLIN | POLLHUP | POLLERR)) {
        if (!streams[k]->pump()) streams[k]->close();
      }
    }
  }
  for (auto& c : children) {
    c.out.close();
    c.err.close();
  }
  if (options.report) {
    options.report->clear();
    for (const auto& c : children) {
      options.report->push_back({c.rank, exit_code_of(c.status),
                                 WIFSIGNALED(c.status) ? WTERMSIG(c.status) : 0, c.ended});
    }
  }
  if (failed) return result;
  if (interrupted_by) {
    int first_bad = 0;
    for (const auto& c : children) {
      if (!(WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0)) {
        first_bad = exit_code_of(c.status);
        break;
      }
    }
    return first_bad;  // 0: every rank stopped cleanly (the engine saves and exits 0)
  }
  return 0;
}

int pick_free_port(const std::string& addr) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  if (::getaddrinfo(addr.empty() ? nullptr : addr.c_str(), "0", &hints, &res) != 0 || !res) {
    throw Error("launcher: cannot resolve master address '" + addr +
                "' to pick a free port; pass --master_addr with an address of this host");
  }
  int port = -1;
  std::string why;
  for (addrinfo* a = res; a && port < 0; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0) {
      sockaddr_storage ss{};
      socklen_t len = sizeof ss;
      if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) == 0) {
        port = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                        : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
      }
    } else {
      why = std::strerror(errno);
    }
    ::close(fd);
  }
  ::freeaddrinfo(res);
  if (port <= 0) {
    throw Error("launcher: cannot bind a port on master address '" + addr + "'" +
                (why.empty() ? std::string() : ": " + why) +
                "; pass --master_addr with an address of this host, or --master_port");
  }
  return port;
}

int usable_cores(const std::string& cgroup_root, const std::string& cpu_root) {
  int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    // Physical cores: the CPUs of the mask by (package, core); SMT siblings share one core's FMA
    // units, and a GEMM thread on each runs no faster than one. The mask's count if sysfs is silent.
    std::set<std::pair<int, int>> physical;
    bool known = true;
    for (int cpu = 0; cpu < CPU_SETSIZE && known; ++cpu) {
      if (!CPU_ISSET(cpu, &set)) continue;
      const std::string topology = cpu_root + "/cpu" + std::to_string(cpu) + "/topology/";
      std::ifstream core(topology + "core_id"), package(topology + "physical_package_id");
      int c = -1, p = -1;
      known = static_cast<bool>(core >> c) && static_cast<bool>(package >> p);
      physical.emplace(p, c);
    }
    cores = std::max(1, known ? static_cast<int>(physical.size()) : CPU_COUNT(&set));
  }
  // A quota of q microseconds every p: q / p CPUs' worth of time, rounded up.
  auto cap = [&](double quota, double period) {
    if (quota > 0 && period > 0) cores = std::min(cores, std::max(1, static_cast<int>(std::ceil(quota / period))));
  };
  std::ifstream v2(cgroup_root + "/cpu.max");  // "max 100000" or "150000 100000"
  std::string quota;
  double period = 0;
  if (v2 >> quota >> period) {
    if (quota != "max") cap(std::atof(quota.c_str()), period);
  } else {
    std::ifstream q(cgroup_root + "/cpu.cfs_quota_us"), pr(cgroup_root + "/cpu.cfs_period_us");
    double q1 = -1, p1 = 0;
    if (q >> q1 && pr >> p1) cap(q1, p1);  // -1: no quota
  }
  return cores;
}

ThreadPlan plan_threads(int ranks, int cores, const char* omp_num_threads) {
  ThreadPlan plan;
  const std::string per = ranks == 1 ? "1 rank" : std::to_string(ranks) + " ranks";
  auto threads_word = [](int n) { return std::to_string(n) + (n == 1 ? " thread" : " threads"); };
  const int from_env = omp_num_threads ? std::atoi(omp_num_threads) : 0;
  if (from_env > 0) {
    plan.threads = from_env;
    plan.from_environment = true;
    plan.oversubscribed = static_cast<int64_t>(from_env) * ranks > cores;
    plan.note = per + " x " + threads_word(from_env) + " (OMP_NUM_THREADS) on " + std::to_string(cores) + " usable cores";
    if (plan.oversubscribed) {
      plan.note += ": " + std::to_string(from_env * ranks) + " threads oversubscribe them and run slower; set OMP_NUM_THREADS=" +
                   std::to_string(std::max(1, cores / ranks)) + " or unset it";
    }
    return plan;
  }
  plan.threads = std::max(1, cores / ranks);
  plan.oversubscribed = ranks > cores;
  plan.note = per + " x " + threads_word(plan.threads) + " (" + std::to_string(cores) +
              " usable cores; OMP_NUM_THREADS overrides)";
  if (plan.oversubscribed) plan.note += ": more ranks than cores run slower";
  return plan;
}

int run_local_ranks(const LocalLaunchOptions& opts) {
  if (opts.num_procs < 1) {
    throw Error("launcher: --num_procs must be at least 1, got " + std::to_string(opts.num_procs));
  }
  if (opts.master_port < 0 || opts.master_port > 65535) {
    throw Error("launcher: --master_port must be between 0 (pick a free port) and 65535, got " +
                std::to_string(opts.master_port));
  }
  const int port = opts.master_port == 0 ? pick_free_port(opts.master_addr) : opts.master_port;
  const ThreadPlan plan = plan_threads(opts.num_procs, usable_cores(), std::getenv("OMP_NUM_THREADS"));
  write_all(opts.supervisor.stderr_fd, std::string("[launcher] ") + (plan.oversubscribed ? "warning: " : "") + plan.note + "\n");
  const std::string threads = plan.from_environment ? std::string() : std::to_string(plan.threads);
  std::vector<RankCommand> cmds;
  for (int r = 0; r < opts.num_procs; ++r) {
    RankCommand c;
    c.rank = r;
    c.argv.push_back(opts.executable);
    c.argv.insert(c.argv.end(), opts.args.begin(), opts.args.end());
    c.env = {{"RANK", std::to_string(r)},
             {"LOCAL_RANK", std::to_string(r)},
             {"WORLD_SIZE", std::to_string(opts.num_procs)},
             {"LOCAL_SIZE", std::to_string(opts.num_procs)},
             {"CROSS_RANK", "0"},
             {"CROSS_SIZE", "1"},
             {"MASTER_ADDR", opts.master_addr},
             {"MASTER_PORT", std::to_string(port)}};
    if (!threads.empty()) c.env.emplace_back("OMP_NUM_THREADS", threads);
    cmds.push_back(std::move(c));
  }
  return run_rank_processes(cmds, opts.supervisor);
}

}  // namespace memrt
