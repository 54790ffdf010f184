// Pre-flight (docs/preflight.md): before a rank allocates its store or its model, this host's ranks'
// estimated peaks against the memory they may use — the cgroup's limits, MemAvailable and
// memory_budget. A run that will not fit is refused with PreflightError (the launcher's exit code
// 2), nothing allocated, rather than killed by the kernel's OOM killer mid-run; the refusal names
// the config changes that would fit (engine/advisor.h).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "config/train_config.h"
#include "memory/budget.h"
#include "memrt/comm.h"
#include "memrt/error.h"
#include "memrt/memory.h"

namespace memrt {

// A run refused because it would not fit; what() has the estimate by category, the budget and
// where it came from, and what to do.
class PreflightError : public Error {
 public:
  using Error::Error;
};

// This host as pre-flight sees it: its ranks, what they hold already, the limits they share.
struct HostMemory {
  std::vector<int> ranks;  // the ranks on this host, ascending
  int world_size = 1;
  int64_t resident = 0;    // their resident memory (RSS) at set-up, summed
  std::vector<memory::MemoryLimit> limits;  // read_budget("/")'s and memory_budget
  c10::Device device = c10::kCPU;
  // On an accelerator: the free memory of this rank's device at set-up (device_free_memory), which
  // the device cells of its estimate must fit. None on a CPU.
  std::optional<memory::MemoryLimit> device_limit;
};

// The free memory of accelerator `device` as LibTorch's allocator for it reports it (for CUDA,
// cudaMemGetInfo after the context exists: what the driver, other processes and this process's
// context and cache leave). None on a CPU, or where the allocator cannot say.
std::optional<memory::MemoryLimit> device_free_memory(const c10::Device& device);

// What a rank's estimate needs of its accelerator: its device cells (0 on a CPU run, where every
// cell is host memory).
int64_t device_need(const memory::Table& estimate, const c10::Device& device);

// What a rank's estimate adds to its host's memory: all of it on a CPU run, its host cells on an
// accelerator (whose own memory is not checked yet).
int64_t host_growth(const memory::Table& estimate, const c10::Device& device);

// The host's need against the limit with the least room left: MemAvailable's need is the ranks'
// growth alone (what they hold already is not available memory), every other limit's the growth
// plus what they hold. None when there is no limit.
struct Tightest {
  memory::MemoryLimit limit;
  int64_t need = 0;
  bool fits() const { return need <= limit.bytes; }
};
std::optional<Tightest> tightest(const HostMemory& host, int64_t growth);

// The limits a host's ranks share: read_budget("/")'s, and `memory_budget` when above zero.
std::vector<memory::MemoryLimit> host_limits(int64_t memory_budget);

// One host's verdict for `growth` (its ranks' summed) and `rank`'s `device` need: when both fit,
// `line` is the log's line (the need against the limit with the least room, and where it came
// from); when not, `line` gives the need, that limit and `rank`'s `estimate` by category, and
// `advice` the changes that would fit (engine/advisor.h, for the config `sources` name).
struct Verdict {
  bool fits = true;
  std::string line;
  std::string advice;
};
Verdict judge(const HostMemory& host, int64_t growth, int64_t device, const memory::Table& estimate, int rank,
              const ConfigSources& sources);

// Every rank calls it (a collective): each rank's growth plus `resident` (its RSS now: LibTorch, the
// data), summed over the ranks of its host, against each limit of read_budget("/") and
// cfg.memory_budget, and on an accelerator its device cells against its device's free memory. When
// any rank's host or device would not fit, every rank throws PreflightError — a refused host's first
// rank (or a rank refused for its own device) with the estimate and the advisor's changes that fit,
// computed from cfg.sources; the others pointing at it — so that no rank waits for another in a
// later collective; else returns one line for the log: the need and the limit with the least room,
// and where it came from.
std::string preflight(const memory::Table& estimate, int64_t resident, const TrainConfig& cfg,
                      const c10::Device& device, Communicator& comm);

}  // namespace memrt
