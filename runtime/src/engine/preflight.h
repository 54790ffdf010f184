// Pre-flight (docs/preflight.md): before a rank allocates its store or its model, this host's ranks'
// estimated peaks against the memory they may use — the cgroup's limits, MemAvailable and
// memory_budget. A run that will not fit is refused with PreflightError (the launcher's exit code
// 2), nothing allocated, rather than killed by the kernel's OOM killer mid-run.
#pragma once

#include <string>

#include "config/train_config.h"
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

// Every rank calls it (a collective): each rank's estimated peak in host memory (all of it on a CPU
// run; the host cells on an accelerator, whose own memory is not checked yet), plus its resident
// memory now (LibTorch, the data), summed over the ranks of its host, against each limit of
// read_budget("/") — MemAvailable against the growth alone, the others against the whole — and
// cfg.memory_budget. Throws PreflightError on every rank of a host over a limit; else returns one
// line for the log: the need and the limit with the least room, and where it came from.
std::string preflight(const memory::Table& estimate, const TrainConfig& cfg, const c10::Device& device,
               Communicator& comm);

}  // namespace memrt
