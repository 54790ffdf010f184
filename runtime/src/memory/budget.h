// The memory a run may use (docs/preflight.md): the limits of its cgroup (v2 or v1), the host's
// available memory, and the user's memory_budget. Read from a root directory, so that tests read
// fixture trees.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace memrt::memory {

// One limit and where it came from ("cgroup v2 memory.max (/sys/fs/cgroup/a/memory.max)").
struct MemoryLimit {
  int64_t bytes = 0;
  std::string source;
};

struct MemoryBudget {
  std::vector<MemoryLimit> limits;  // those that exist, in the order read
};

// The limits under `root` ("/" on a machine): the cgroup v2 memory.max and memory.high of this
// process's cgroup and every cgroup above it (a parent's limit binds its children), else the
// cgroup v1 memory.limit_in_bytes of its memory cgroup, and /proc/meminfo's MemAvailable. A file
// missing or unreadable is a limit that does not exist ("max", or v1's unlimited 2^63 rounded
// to pages, likewise); a malformed value is a memrt::FileError naming the file and the value.
MemoryBudget read_budget(const std::string& root = "/");

}  // namespace memrt::memory
