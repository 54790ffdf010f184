// What a run measured about its memory, the leak check, and the reports built from it
// (docs/memory.md, "Reports" and "Leak check").
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "memory/block_cache.h"
#include "memory/tracking_allocator.h"
#include "memrt/memory.h"
#include "memrt/param_store.h"

namespace memrt {

struct StepMemory {
  int64_t step = 0;                    // 1-based: after this many optimizer steps
  int64_t live_bytes = 0;              // at the end of the step, gradients dropped
  int64_t peak_bytes = 0;              // the largest live bytes during the step
  int64_t activations_peak_bytes = 0;  // the largest activations cell during the step
  int64_t comm_buffers_peak_bytes = 0;  // the largest comm_buffers cell: staging, ZeRO-3's gathers
  int64_t resident_peak_bytes = 0;      // the process's RSS high-water mark by the end of the step
};

struct LeakFinding {
  memory::Category category = memory::Category::kUnattributed;
  int64_t bytes_per_step = 0;
  int64_t first_step = 0, last_step = 0;
  std::string message() const;  // the warning, as printed
};

// The resident memory past what the estimate allows for (docs/preflight.md, "During the run").
struct ResidentGrowth {
  int64_t step = 0;        // the first step whose RSS high-water mark passed `allowed_bytes`
  int64_t since_step = 0;  // the first step whose high-water mark passed `expected_bytes`
  int64_t resident_bytes = 0, expected_bytes = 0, allowed_bytes = 0;
  int64_t from_step = 0;   // the run's first step (1, or the first after a resume)
  std::vector<memory::Category> categories;  // those whose live bytes grew since from_step (by > 1 MiB)
  std::string message() const;  // the warning, as printed
};

// One rank's estimate, with the terms behind it.
struct EstimateReport {
  memory::Table table;
  std::vector<memory::EstimateTerm> terms;
  std::vector<ParamInfo> params;  // the parameters as the plugins planned them (plan_params on the shapes)
  std::shared_ptr<const StorePlan> store;  // the parameter store as the plugins laid it out on the shapes
  // The frozen parameters plugins read as their block is built (PluginHost::plan_params); none: any.
  std::optional<std::set<std::string>> frozen_reads;
  int64_t peak_bytes() const { return table.total(); }
};

// The process's resident set, which is what the OOM killer sees on a CPU: the tensors (as the
// allocator counts them) plus the code, libraries and allocator slack that the allocator does not.
struct ResidentMemory {
  int64_t idle_bytes = 0;  // RSS at the start of set-up, before the data and the model
  int64_t peak_bytes = 0;  // the process's high-water mark so far
  memory::BlockCacheStats block_cache;
  int64_t growth() const { return peak_bytes - idle_bytes; }
};
int64_t current_rss_bytes();
int64_t peak_rss_bytes();

struct RankMemoryReport {
  int rank = 0;
  EstimateReport estimate;
  memory::AllocatorStats measured;
  memory::DeviceAllocatorStats device;  // the CUDA caching allocator, when training on a GPU
  int64_t peak_step = 0;               // the step during which the peak was reached (0: set-up)
  int64_t activations_kept_bytes = 0;  // the most forward kept for backward, over micro-steps
  int64_t activations_peak_bytes = 0;  // the largest activations cell, over steps
  int64_t gradient_bytes_claimed_late = 0;  // gradients the per-parameter hooks missed (0)
  // Set-up (data, model, store, optimizer state, before step 1): the largest live bytes and the
  // largest of each cell — `weights` holds the model being built and the store's compute copy.
  memory::WindowPeaks setup;
  ResidentMemory resident;
  std::vector<StepMemory> timeline;
  std::vector<LeakFinding> leaks;
  std::optional<ResidentGrowth> resident_growth;
};

// Follows one rank through the steps; the engine calls it at fixed points of each step.
class MemoryMonitor {
 public:
  // Leak check: a category growing at each of this many consecutive steps is a leak.
  static constexpr int kLeakSteps = 5;

  void begin_step();      // opens the step's window
  void begin_backward();  // forward has kept what backward needs: record it
  // End of step `step` (1-based), gradients dropped. Returns the leaks first found now.
  std::vector<LeakFinding> end_step(int64_t step);
  void add_late_gradient_claims(int64_t bytes) { report_.gradient_bytes_claimed_late += bytes; }
  // The resident check's expectation: the RSS where pre-flight measured it, and what the
  // estimated peak adds to host memory.
  void expect_resident(int64_t baseline, int64_t growth);
  // After end_step: the resident memory past the estimate by more than the margin, the first time.
  std::optional<ResidentGrowth> check_resident();
  // Before the model is built: the RSS the run's own memory is measured from.
  // Set-up starts: its RSS before the data and the model, and the window of its largest cells.
  void begin_setup() {
    report_.resident.idle_bytes = current_rss_bytes();
    memory::open_window();
  }

  // The measurement so far, with `estimate` beside it.
  RankMemoryReport report(int rank, EstimateReport estimate, const c10::Device& device) const;

 private:
  RankMemoryReport report_;
  int64_t last_peak_ = 0;
  bool stepped_ = false;  // begin_step has run once: set-up's peak is known
  std::deque<memory::Table> recent_;  // end-of-step live tables, steps >= 2
  std::vector<bool> warned_ = std::vector<bool>(memory::kNumCategories, false);
  int64_t baseline_ = -1, growth_ = 0;  // expect_resident's
  memory::Table first_live_, last_live_;  // the live table at the end of the run's first step and the last
  int64_t first_step_ = 0;                // that first step (0: none yet)
  int64_t over_since_ = 0;              // the first step past the expectation (0: none yet)
};

// {"device": n, "host": m} per category, in the order of memory::all_categories().
std::string categories_json(const memory::Table& t);
// One rank's entry of memory_report.json's "ranks".
std::string rank_report_json(const RankMemoryReport& r);
// memory_report.json from every rank's entry (rank order).
std::string memory_report_json(int world_size, const std::vector<std::string>& rank_entries);
// memory_estimate.json: by_world_size[w - 1][rank] for world sizes 1..N.
std::string memory_estimate_json(const std::vector<std::vector<EstimateReport>>& by_world_size);
// `launcher --estimate`'s table: every rank at the largest world size, rank 0's terms, and the
// peak by world size.
std::string estimate_table_text(const std::vector<std::vector<EstimateReport>>& by_world_size);

// The console table: estimate against the measurement at the peak, per category.
std::string memory_table_text(const RankMemoryReport& r, int world_size);

// "12.345 MB": the MB of the reports (10^6 bytes).
std::string megabytes(int64_t bytes);

}  // namespace memrt
