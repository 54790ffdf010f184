// Pre-flight (see preflight.h).
#include "engine/preflight.h"

#include <unistd.h>

#include <functional>
#include <optional>

#include <ATen/ATen.h>
#include <c10/core/CachingDeviceAllocator.h>

#include "engine/advisor.h"
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

int64_t host_growth(const memory::Table& estimate, const c10::Device& device) {
  return device.is_cpu() ? estimate.total() : estimate.placement(memory::Placement::kHost);
}

std::optional<Tightest> tightest(const HostMemory& host, int64_t growth) {
  std::optional<Tightest> out;
  for (const memory::MemoryLimit& l : host.limits) {
    const int64_t need = l.source.rfind("MemAvailable", 0) == 0 ? growth : growth + host.resident;
    if (!out || l.bytes - need < out->limit.bytes - out->need) out = Tightest{l, need};
  }
  return out;
}

std::optional<memory::MemoryLimit> device_free_memory(const c10::Device& device) {
  if (device.is_cpu()) return std::nullopt;
  try {
    const auto [free, total] = c10::getDeviceAllocator(device.type())->getMemoryInfo(device.index());
    return memory::MemoryLimit{static_cast<int64_t>(free), "the free memory of " + device.str() + " (" +
                                                               megabytes(static_cast<int64_t>(free)) + " of " +
                                                               megabytes(static_cast<int64_t>(total)) +
                                                               ", its context counted)"};
  } catch (const c10::Error&) {  // an allocator that cannot say
    return std::nullopt;
  }
}

int64_t device_need(const memory::Table& estimate, const c10::Device& device) {
  return device.is_cpu() ? 0 : estimate.placement(memory::Placement::kDevice);
}

std::vector<memory::MemoryLimit> host_limits(int64_t memory_budget) {
  std::vector<memory::MemoryLimit> limits = memory::read_budget("/").limits;
  if (memory_budget > 0) limits.push_back({memory_budget, "memory_budget (train.yaml or --memory_budget)"});
  return limits;
}

Verdict judge(const HostMemory& host, int64_t growth, int64_t device, const memory::Table& estimate, int rank,
              const ConfigSources& sources) {
  Verdict v;
  const std::string ranks = std::to_string(host.ranks.size());
  const std::optional<Tightest> t = tightest(host, growth);
  const bool device_fits = !host.device_limit || device <= host.device_limit->bytes;
  if (device_fits && (!t || t->fits())) {
    v.line = !t ? "memory pre-flight: no limit found (no cgroup limit, no MemAvailable, no memory_budget)"
                : "memory pre-flight: this host's " + ranks + " rank(s) need an estimated " + megabytes(t->need) +
                      " of " + megabytes(t->limit.bytes) + " allowed by " + t->limit.source;
    if (host.device_limit)
      v.line += "; rank " + std::to_string(rank) + " needs " + megabytes(device) + " of " + host.device_limit->source;
    return v;
  }
  v.fits = false;
  std::string cells;
  for (memory::Category c : memory::all_categories()) {
    const int64_t b = estimate.category(c);
    if (b != 0) cells += std::string(cells.empty() ? "" : ", ") + memory::to_string(c) + " " + megabytes(b);
  }
  v.line = device_fits ? "this host's " + ranks + " rank(s) need an estimated " + std::to_string(t->need) + " B (" +
                             megabytes(t->need) + ") at their peak, more than " + t->limit.source + " allows: " +
                             std::to_string(t->limit.bytes) + " B (" + megabytes(t->limit.bytes) + ")."
                       : "rank " + std::to_string(rank) + " needs an estimated " + std::to_string(device) + " B (" +
                             megabytes(device) + ") of its device at its peak, more than " + host.device_limit->source +
                             ".";
  v.line += " Rank " + std::to_string(rank) + "'s estimated peak " + megabytes(estimate.total()) + " = " + cells +
            "; the host's ranks hold " + megabytes(host.resident) + " already (resident).";
  v.advice = sources.train_yaml_path.empty() && sources.ds_config_path.empty()
                 ? "Make a rank hold less (docs/preflight.md)."
                 : advice_text(advise(sources, host), sources);
  return v;
}

std::string preflight(const memory::Table& estimate, int64_t resident, const TrainConfig& cfg,
                      const c10::Device& device, Communicator& comm) {
  // Each rank's row: its estimated peak in host memory (what it will still allocate), its resident
  // memory now (LibTorch, the data: what it holds already) and its host; summed, every rank has
  // every row.
  at::Tensor rows = at::zeros({comm.world_size(), 3}, at::kLong);  // (ranks, 3)
  rows[comm.rank()][0] = host_growth(estimate, device);
  rows[comm.rank()][1] = resident;
  rows[comm.rank()][2] = host_id();
  comm.all_reduce_sum(rows);
  HostMemory host;
  host.world_size = comm.world_size();
  host.device = device;
  int64_t growth = 0;
  for (int r = 0; r < comm.world_size(); ++r) {
    if (rows[r][2].item<int64_t>() != rows[comm.rank()][2].item<int64_t>()) continue;
    growth += rows[r][0].item<int64_t>();
    host.resident += rows[r][1].item<int64_t>();
    host.ranks.push_back(r);
  }
  host.limits = host_limits(cfg.memory_budget);
  host.device_limit = device_free_memory(device);
  // What the allocator holds before the advisor's estimates: nothing of the model, nothing of the store.
  const int64_t allocated = memory::allocator_stats().peak_bytes;
  // A host's first rank speaks for it (a rank refused for its own device speaks for itself): the
  // others' messages point at it rather than repeat it.
  const int64_t device_bytes = device_need(estimate, device);
  const bool speaks = comm.rank() == host.ranks.front() || (host.device_limit && device_bytes > host.device_limit->bytes);
  const Verdict v = judge(host, growth, device_bytes, estimate, comm.rank(), speaks ? cfg.sources : ConfigSources{});
  // Every rank learns which were refused: none goes on to wait for them.
  at::Tensor refused = at::zeros({comm.world_size()}, at::kLong);
  refused[comm.rank()] = v.fits ? 0 : 1;
  comm.all_reduce_sum(refused);
  if (refused.sum().item<int64_t>() == 0) return v.line;
  if (v.fits) {
    std::string which;
    for (int r = 0; r < comm.world_size(); ++r)
      if (refused[r].item<int64_t>() != 0) which += (which.empty() ? "" : ", ") + std::to_string(r);
    throw PreflightError("this run would not fit in memory, so it did not start: rank(s) " + which +
                         " would not fit (their messages say why and what would)");
  }
  if (!speaks) {
    throw PreflightError("this run would not fit in memory, so it did not start: this host's ranks need more than it "
                         "allows (rank " + std::to_string(host.ranks.front()) + " says how much, and what would fit)");
  }
  throw PreflightError("this run would not fit in memory, so it did not start: " + v.line +
                       " Nothing was allocated (the allocator's peak so far: " + std::to_string(allocated) + " B).\n" +
                       v.advice + "\nOr start anyway with --no_preflight.");
}

}  // namespace memrt
