// Pre-flight (see preflight.h).
#include "engine/preflight.h"

#include <unistd.h>

#include <functional>
#include <optional>

#include <ATen/ATen.h>

#include "memory/budget.h"
#include "memory/report.h"
#include "memory/tracking_allocator.h"

namespace memrt {
namespace {

// This host's name, hashed into 53 bits (exact in a double, summed over ranks as an integer).
int64_t host_id() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0) return 0;
  return static_cast<int64_t>(std::hash<std::string>{}(name) & ((uint64_t{1} << 53) - 1));
}

}  // namespace

std::string preflight(const memory::Table& estimate, const TrainConfig& cfg, const c10::Device& device,
               Communicator& comm) {
  // Each rank's row: its estimated peak in host memory (what it will still allocate), its resident
  // memory now (LibTorch, the data: what it holds already) and its host; summed, every rank has
  // every row.
  const int64_t growth = device.is_cpu() ? estimate.total() : estimate.placement(memory::Placement::kHost);
  const int64_t resident = current_rss_bytes();
  at::Tensor rows = at::zeros({comm.world_size(), 3}, at::kLong);  // (ranks, 3)
  rows[comm.rank()][0] = growth;
  rows[comm.rank()][1] = resident;
  rows[comm.rank()][2] = host_id();
  comm.all_reduce_sum(rows);
  int64_t host_growth = 0, host_resident = 0, ranks = 0;
  for (int r = 0; r < comm.world_size(); ++r) {
    if (rows[r][2].item<int64_t>() != rows[comm.rank()][2].item<int64_t>()) continue;
    host_growth += rows[r][0].item<int64_t>();
    host_resident += rows[r][1].item<int64_t>();
    ++ranks;
  }

  memory::MemoryBudget budget = memory::read_budget("/");
  if (cfg.memory_budget > 0) budget.limits.push_back({cfg.memory_budget, "memory_budget (train.yaml or --memory_budget)"});
  // MemAvailable is what the host has left beside what this job holds already: the growth goes
  // against it; every other limit bounds the whole.
  // The limit with the least room left; over it, the run is refused.
  std::optional<memory::MemoryLimit> over;
  int64_t over_need = 0;
  for (const memory::MemoryLimit& l : budget.limits) {
    const int64_t need = l.source.rfind("MemAvailable", 0) == 0 ? host_growth : host_growth + host_resident;
    if (!over || l.bytes - need < over->bytes - over_need) {
      over = l;
      over_need = need;
    }
  }
  if (!over) return "memory pre-flight: no limit found (no cgroup limit, no MemAvailable, no memory_budget)";
  if (over_need <= over->bytes)
    return "memory pre-flight: this host's " + std::to_string(ranks) + " rank(s) need an estimated " + megabytes(over_need) +
           " of " + megabytes(over->bytes) + " allowed by " + over->source;

  std::string cells;
  for (memory::Category c : memory::all_categories()) {
    const int64_t b = estimate.category(c);
    if (b != 0) cells += std::string(cells.empty() ? "" : ", ") + memory::to_string(c) + " " + megabytes(b);
  }
  throw PreflightError(
      "this run would not fit in memory, so it did not start: this host's " + std::to_string(ranks) +
      " rank(s) need an estimated " + std::to_string(over_need) + " B (" + megabytes(over_need) + ") at their peak, more than " +
      over->source + " allows: " + std::to_string(over->bytes) + " B (" + megabytes(over->bytes) + "). Rank " +
      std::to_string(comm.rank()) + "'s estimated peak " + megabytes(growth) + " = " + cells + "; resident at set-up " +
      megabytes(resident) + ". Nothing was allocated (the allocator's peak so far: " +
      std::to_string(memory::allocator_stats().peak_bytes) + " B). Make a rank hold less — activation "
      "checkpointing, a smaller micro-batch with more accumulation, bf16, an 8-bit or 4-bit optimizer, "
      "offload_optimizer, a higher ZeRO stage over more ranks (`launcher --estimate` prints the plan per "
      "rank; docs/preflight.md) — or start anyway with --no_preflight");
}

}  // namespace memrt
