// dist/hostfile.h — several machines: DeepSpeed's hostfile, its --include/--exclude node specs,
// and the ssh command that starts each rank on its host.
//
//   # hostfile: one host per line, "#" comments and blank lines ignored
//   worker-0 slots=4
//   worker-1 slots=4
//
// Ranks are assigned as DeepSpeed does: node by node in hostfile order, slot by slot within a
// node (worker-0 holds ranks 0-3, worker-1 ranks 4-7). Each rank is started by its own ssh
// command running the launcher with the rendezvous environment set:
//
//   ssh worker-1 'cd /home/me/run && env MASTER_ADDR=worker-0 MASTER_PORT=29500 WORLD_SIZE=8
//       RANK=5 LOCAL_RANK=1 LOCAL_SIZE=4 CROSS_RANK=1 CROSS_SIZE=2 /opt/memrt/bin/launcher
//       --deepspeed ds.json train.yaml'
//
// ssh_rank_commands() only builds these command lines (pure, tested without ssh);
// run_rank_processes (local_launch.h) runs them with prefixed output and fail-fast.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "dist/local_launch.h"

namespace memrt {

struct HostfileEntry {
  std::string host;
  int slots = 0;
  int line = 0;  // 1-based line in the hostfile
};

// DeepSpeed's format: `^(\S+)\s+slots=(\d+)` after trimming (anything after the slots is
// ignored, as DeepSpeed does). Throws memrt::FileError naming the file and line for a bad entry,
// a duplicate host, zero slots, or a file without hosts; memrt::FileError when it cannot be read.
std::vector<HostfileEntry> parse_hostfile(const std::string& path);
std::vector<HostfileEntry> parse_hostfile_text(const std::string& text, const std::string& source);

// A host and the slot ids it runs ranks on (DeepSpeed's "world info").
struct NodeSlots {
  std::string host;
  std::vector<int> slots;
};

// The hosts and slots to use, in hostfile order, after DeepSpeed's resource filters:
// include/exclude are `NODE_SPEC[@NODE_SPEC...]` with `NODE_SPEC = host[:slot[,slot...]]`
// (mutually exclusive; a host without slots means all of its slots); num_nodes > 0 keeps the
// first num_nodes hosts; procs_per_node > 0 uses slots [0, procs_per_node) on every host.
// Throws memrt::ConfigError naming the flag (--include, --exclude, ...) and what is wrong.
std::vector<NodeSlots> select_resources(const std::vector<HostfileEntry>& hosts,
                                        const std::string& include = "",
                                        const std::string& exclude = "", int num_nodes = -1,
                                        int procs_per_node = -1);

struct SshLaunchOptions {
  std::string master_addr;   // empty: the first selected host
  int master_port = 29500;
  std::string cwd;           // remote working directory (the caller passes its own)
  std::string program;       // the launcher on the remote hosts (same path everywhere)
  std::vector<std::string> args;
  // Extra variables for every rank (exported_environment() collects the usual ones).
  std::vector<std::pair<std::string, std::string>> env;
  std::vector<std::string> ssh_args;  // before the host, e.g. {"-p", "2222"}
};

struct SshRankCommand {
  std::string host;
  int node_rank = 0;
  int local_rank = 0;
  std::string remote_command;  // what the remote shell runs (already quoted for it)
  RankCommand command;         // argv = {"ssh", ssh_args..., host, remote_command}
  std::string shell_line;      // the same, quoted for pasting into a local shell
};

// One command per rank, node by node, slot by slot (rank = position in that order).
// CUDA_VISIBLE_DEVICES is added only when a node's slots are not simply 0..n-1.
std::vector<SshRankCommand> ssh_rank_commands(const std::vector<NodeSlots>& nodes,
                                              const SshLaunchOptions& opts);

// Variables of this process worth passing to remote ranks: MEMRT_*, OMP_NUM_THREADS,
// GLOO_SOCKET_IFNAME, NCCL_*, in name order.
std::vector<std::pair<std::string, std::string>> exported_environment();

// `s` quoted for a POSIX shell (unchanged when it needs no quoting).
std::string shell_quote(const std::string& s);

}  // namespace memrt
