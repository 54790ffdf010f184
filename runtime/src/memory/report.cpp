#include "memory/report.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <sstream>

namespace memrt {

using memory::Category;
using memory::Placement;

std::string megabytes(int64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3f MB", static_cast<double>(bytes) / 1e6);
  return buf;
}

std::string LeakFinding::message() const {
  std::ostringstream os;
  os << "memory: '" << memory::to_string(category) << "' grows by " << bytes_per_step
     << " bytes (" << megabytes(bytes_per_step) << ") per step (steps " << first_step << ".." << last_step
     << ", live bytes at the end of each step); something keeps tensors alive across steps";
  if (category == Category::kActivations) os << " (e.g. a loss kept with its graph)";
  return os.str();
}

std::string ResidentGrowth::message() const {
  std::ostringstream os;
  os << "memory: the process's resident memory reached " << megabytes(resident_bytes) << " by step " << step
     << ", past the " << megabytes(expected_bytes) << " expected (the RSS at pre-flight plus the estimated peak) by more "
     << "than the margin (" << megabytes(allowed_bytes) << " allowed); it passed the expectation at step " << since_step
     << ". ";
  if (categories.empty()) {
    os << "No category of memrt's tensors grew since step " << from_step << ": the growth is outside them (a library's own memory, "
          "the allocator's fragmentation)";
  } else {
    os << "Grown since step " << from_step << " (live bytes at the end of a step):";
    for (size_t i = 0; i < categories.size(); ++i) os << (i ? ", '" : " '") << memory::to_string(categories[i]) << "'";
  }
  os << " (docs/preflight.md)";
  return os.str();
}

// ---- the monitor -----------------------------------------------------------------------------------

void MemoryMonitor::begin_step() {
  if (!stepped_) {  // set-up's peak (data, model, store, state): a step beats it or it stays step 0
    last_peak_ = memory::allocator_stats().peak_bytes;
    report_.setup = memory::window_peaks();
    stepped_ = true;
  }
  memory::open_window();
}

void MemoryMonitor::begin_backward() {
  report_.activations_kept_bytes = std::max(report_.activations_kept_bytes,
                                            memory::live().category(Category::kActivations));
}

std::vector<LeakFinding> MemoryMonitor::end_step(int64_t step) {
  const memory::WindowPeaks window = memory::window_peaks();
  const memory::AllocatorStats stats = memory::allocator_stats();
  StepMemory s;
  s.step = step;
  s.live_bytes = stats.current_bytes;
  s.peak_bytes = window.total;
  s.activations_peak_bytes = window.cells.category(Category::kActivations);
  s.comm_buffers_peak_bytes = window.cells.category(Category::kCommBuffers);
  s.resident_peak_bytes = peak_rss_bytes();
  last_live_ = memory::live();
  if (first_step_ == 0) {  // step 1, or the first after a resume
    first_step_ = step;
    first_live_ = last_live_;
  }
  if (stats.peak_bytes > last_peak_) report_.peak_step = step;  // the first step to reach it
  last_peak_ = stats.peak_bytes;
  report_.activations_peak_bytes = std::max(report_.activations_peak_bytes, s.activations_peak_bytes);
  report_.timeline.push_back(s);

  std::vector<LeakFinding> found;
  if (step < 2) return found;  // step 1 allocates the optimizer's state
  recent_.push_back(memory::live());
  if (recent_.size() > static_cast<size_t>(kLeakSteps) + 1) recent_.pop_front();
  if (recent_.size() <= static_cast<size_t>(kLeakSteps)) return found;
  for (Category c : memory::all_categories()) {
    const auto i = static_cast<size_t>(c);
    if (warned_[i]) continue;
    bool grows = true;
    for (size_t k = 1; k < recent_.size() && grows; ++k)
      grows = recent_[k].category(c) > recent_[k - 1].category(c);
    if (!grows) continue;
    warned_[i] = true;
    LeakFinding f;
    f.category = c;
    f.bytes_per_step = (recent_.back().category(c) - recent_.front().category(c)) / kLeakSteps;
    f.first_step = step - kLeakSteps;
    f.last_step = step;
    report_.leaks.push_back(f);
    found.push_back(f);
  }
  return found;
}

void MemoryMonitor::expect_resident(int64_t baseline, int64_t growth) {
  baseline_ = baseline;
  growth_ = growth;
}

std::optional<ResidentGrowth> MemoryMonitor::check_resident() {
  if (baseline_ < 0 || report_.timeline.empty() || report_.resident_growth) return std::nullopt;
  const StepMemory& s = report_.timeline.back();
  const int64_t expected = baseline_ + growth_;
  if (over_since_ == 0 && s.resident_peak_bytes > expected) over_since_ = s.step;
  // The margin: the RSS beyond the allocator's peak (block cache, glibc's arenas, oneDNN's and
  // MKL's buffers) is 1.05-1.34x the allocator's peak on the shipped configs, 2.35x on the small
  // QLoRA one (30 MB of tensors, which the fixed 64 MiB covers).
  const int64_t allowed = expected + growth_ / 2 + (int64_t{64} << 20);
  if (s.resident_peak_bytes <= allowed) return std::nullopt;
  ResidentGrowth g;
  g.step = s.step;
  g.since_step = over_since_;
  g.from_step = first_step_;
  g.resident_bytes = s.resident_peak_bytes;
  g.expected_bytes = expected;
  g.allowed_bytes = allowed;
  for (Category c : memory::all_categories())
    if (last_live_.category(c) - first_live_.category(c) > (int64_t{1} << 20)) g.categories.push_back(c);
  report_.resident_growth = g;
  return g;
}

RankMemoryReport MemoryMonitor::report(int rank, EstimateReport estimate,
                                       const c10::Device& device) const {
  RankMemoryReport r = report_;
  r.rank = rank;
  r.estimate = std::move(estimate);
  r.measured = memory::allocator_stats();
  r.device = memory::device_allocator_stats(device);
  r.resident.peak_bytes = peak_rss_bytes();
  r.resident.block_cache = memory::block_cache::stats();
  return r;
}

int64_t current_rss_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages_total = 0, pages_resident = 0;
  statm >> pages_total >> pages_resident;
  return pages_resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

int64_t peak_rss_bytes() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<int64_t>(ru.ru_maxrss) * 1024;  // Linux reports KiB
}

// ---- JSON ------------------------------------------------------------------------------------------

std::string categories_json(const memory::Table& t) {
  std::ostringstream os;
  os << "{";
  bool first = true;
  for (Category c : memory::all_categories()) {
    os << (first ? "" : ", ") << "\"" << memory::to_string(c) << "\": {\"device\": "
       << t.at(c, Placement::kDevice) << ", \"host\": " << t.at(c, Placement::kHost) << "}";
    first = false;
  }
  os << "}";
  return os.str();
}

std::string estimate_json(const EstimateReport& e, const std::string& indent) {
  std::ostringstream os;
  os << "{\n" << indent << "  \"categories\": " << categories_json(e.table) << ",\n"
     << indent << "  \"peak_bytes\": " << e.peak_bytes() << ",\n" << indent << "  \"terms\": [";
  for (size_t i = 0; i < e.terms.size(); ++i) {
    os << (i ? ",\n" : "\n") << indent << "    {\"source\": \"" << e.terms[i].source
       << "\", \"categories\": " << categories_json(e.terms[i].delta) << "}";
  }
  os << "\n" << indent << "  ]\n" << indent << "}";
  return os.str();
}

std::string rank_report_json(const RankMemoryReport& r) {
  std::ostringstream os;
  os << "{\n      \"rank\": " << r.rank << ",\n      \"estimate\": " << estimate_json(r.estimate, "      ")
     << ",\n      \"measured\": {\n        \"categories\": "
     << categories_json(r.measured.at_peak) << ",\n        \"peak_bytes\": " << r.measured.peak_bytes
     << ",\n        \"peak_step\": " << r.peak_step
     << ",\n        \"current_bytes\": " << r.measured.current_bytes
     << ",\n        \"allocations\": " << r.measured.allocations
     << ",\n        \"frees\": " << r.measured.frees
     << ",\n        \"activations_kept_bytes\": " << r.activations_kept_bytes
     << ",\n        \"activations_peak_bytes\": " << r.activations_peak_bytes
     << ",\n        \"gradient_bytes_claimed_late\": " << r.gradient_bytes_claimed_late
     << ",\n        \"setup\": {\"peak_bytes\": " << r.setup.total
     << ", \"categories\": " << categories_json(r.setup.cells) << "}"
     << ",\n        \"resident\": {\"idle_bytes\": " << r.resident.idle_bytes
     << ", \"peak_bytes\": " << r.resident.peak_bytes
     << ", \"block_cache\": {\"peak_live_bytes\": " << r.resident.block_cache.peak_live_bytes
     << ", \"cached_bytes\": " << r.resident.block_cache.cached_bytes
     << ", \"hits\": " << r.resident.block_cache.hits << ", \"grows\": " << r.resident.block_cache.grows
     << ", \"maps\": " << r.resident.block_cache.maps
     << ", \"unmaps\": " << r.resident.block_cache.unmaps << "}}"
     << ",\n        \"device_allocator\": ";
  if (r.device.available) {
    os << "{\"current_bytes\": " << r.device.current_bytes << ", \"peak_bytes\": " << r.device.peak_bytes << "}";
  } else {
    os << "null";
  }
  os << "\n      },\n      \"timeline\": [";
  for (size_t i = 0; i < r.timeline.size(); ++i) {
    const StepMemory& s = r.timeline[i];
    os << (i ? "," : "") << "\n        {\"step\": " << s.step << ", \"live_bytes\": " << s.live_bytes
       << ", \"peak_bytes\": " << s.peak_bytes
       << ", \"activations_peak_bytes\": " << s.activations_peak_bytes
       << ", \"comm_buffers_peak_bytes\": " << s.comm_buffers_peak_bytes
       << ", \"resident_peak_bytes\": " << s.resident_peak_bytes << "}";
  }
  os << "\n      ],\n      \"leaks\": [";
  for (size_t i = 0; i < r.leaks.size(); ++i) {
    const LeakFinding& f = r.leaks[i];
    os << (i ? "," : "") << "\n        {\"category\": \"" << memory::to_string(f.category)
       << "\", \"bytes_per_step\": " << f.bytes_per_step << ", \"first_step\": " << f.first_step
       << ", \"last_step\": " << f.last_step << "}";
  }
  os << "\n      ],\n      \"resident_growth\": ";
  if (const auto& g = r.resident_growth) {
    os << "{\"step\": " << g->step << ", \"since_step\": " << g->since_step << ", \"from_step\": " << g->from_step << ", \"resident_bytes\": " << g->resident_bytes
       << ", \"expected_bytes\": " << g->expected_bytes << ", \"allowed_bytes\": " << g->allowed_bytes
       << ", \"categories\": [";
    for (size_t i = 0; i < g->categories.size(); ++i)
      os << (i ? ", " : "") << "\"" << memory::to_string(g->categories[i]) << "\"";
    os << "]}";
  } else {
    os << "null";
  }
  os << "\n    }";
  return os.str();
}

namespace {
std::string category_names_json() {
  std::string out = "[";
  for (Category c : memory::all_categories())
    out += std::string(out.size() > 1 ? ", " : "") + "\"" + memory::to_string(c) + "\"";
  return out + "]";
}
}  // namespace

std::string memory_estimate_json(const std::vector<std::vector<EstimateReport>>& by_world_size) {
  std::ostringstream os;
  os << "{\n  \"version\": 1,\n  \"units\": \"bytes\",\n  \"categories\": " << category_names_json()
     << ",\n  \"world_sizes\": [";
  for (size_t w = 0; w < by_world_size.size(); ++w) {
    os << (w ? "," : "") << "\n    {\"world_size\": " << by_world_size[w].size() << ", \"ranks\": [";
    for (size_t r = 0; r < by_world_size[w].size(); ++r) {
      os << (r ? "," : "") << "\n      {\"rank\": " << r
         << ", \"estimate\": " << estimate_json(by_world_size[w][r], "      ") << "}";
    }
    os << "\n    ]}";
  }
  os << "\n  ]\n}\n";
  return os.str();
}

std::string memory_report_json(int world_size, const std::vector<std::string>& rank_entries) {
  std::ostringstream os;
  os << "{\n  \"version\": 1,\n  \"units\": \"bytes\",\n  \"world_size\": " << world_size
     << ",\n  \"categories\": " << category_names_json();
  os << ",\n  \"ranks\": [";
  for (size_t i = 0; i < rank_entries.size(); ++i) os << (i ? ", " : "\n    ") << rank_entries[i];
  os << "\n  ]\n}\n";
  return os.str();
}

// ---- console -----------------------------------------------------------------------------------------

namespace {
std::string mb(int64_t bytes) {  // a right-aligned MB column
  char buf[32];
  std::snprintf(buf, sizeof buf, "%12.3f", static_cast<double>(bytes) / 1e6);
  return buf;
}

std::string row_name(Category c, Placement p) {
  std::string name = memory::to_string(c);
  if (p == Placement::kHost) name += " (host)";
  return name;
}
}  // namespace

std::string estimate_table_text(const std::vector<std::vector<EstimateReport>>& by_world_size) {
  std::ostringstream os;
  const std::vector<EstimateReport>& ranks = by_world_size.back();
  os << "per rank at world size " << ranks.size() << " (MB = 10^6 bytes):\n  " << std::left
     << std::setw(24) << "category" << std::right;
  for (size_t r = 0; r < ranks.size(); ++r) os << std::setw(13) << ("rank " + std::to_string(r));
  os << "\n";
  for (Category c : memory::all_categories()) {
    for (Placement p : {Placement::kDevice, Placement::kHost}) {
      const bool any = std::any_of(ranks.begin(), ranks.end(),
                                   [&](const EstimateReport& e) { return e.table.at(c, p) != 0; });
      if (!any) continue;
      os << "  " << std::left << std::setw(24) << row_name(c, p) << std::right;
      for (const EstimateReport& e : ranks) os << " " << mb(e.table.at(c, p));
      os << "\n";
    }
  }
  os << "  " << std::left << std::setw(24) << "peak" << std::right;
  for (const EstimateReport& e : ranks) os << " " << mb(e.peak_bytes());
  os << "\n\nterms of rank 0 (what the host and each plugin add, MB):\n";
  for (const memory::EstimateTerm& t : ranks.front().terms) {
    os << "  " << std::left << std::setw(12) << t.source << std::right;
    for (Category c : memory::all_categories()) {
      for (Placement p : {Placement::kDevice, Placement::kHost}) {
        const int64_t d = t.delta.at(c, p);
        if (d == 0) continue;
        char buf[96];
        std::snprintf(buf, sizeof buf, " %s %+.3f", row_name(c, p).c_str(), static_cast<double>(d) / 1e6);
        os << buf;
      }
    }
    os << "\n";
  }
  os << "\npeak of the largest rank by world size (MB):\n  world size ";
  for (const auto& w : by_world_size) os << std::setw(12) << w.size() << " ";
  os << "\n  peak       ";
  for (const auto& w : by_world_size) {
    int64_t peak = 0;
    for (const EstimateReport& e : w) peak = std::max(peak, e.peak_bytes());
    os << mb(peak) << " ";
  }
  os << "\n";
  return os.str();
}

std::string memory_table_text(const RankMemoryReport& r, int world_size) {
  std::ostringstream os;
  const memory::Table& est = r.estimate.table;
  const memory::Table& got = r.measured.at_peak;
  os << "memory at the peak, rank " << r.rank << " of " << world_size
     << " (MB = 10^6 bytes):\n"
     << "  category                     estimate     measured\n";
  for (Category c : memory::all_categories()) {
    for (Placement p : {Placement::kDevice, Placement::kHost}) {
      if (est.at(c, p) == 0 && got.at(c, p) == 0) continue;
      os << "  " << std::left << std::setw(24) << row_name(c, p) << std::right << mb(est.at(c, p))
         << " " << mb(got.at(c, p)) << "\n";
    }
  }
  const int64_t peak = r.measured.peak_bytes;
  const double off = r.estimate.peak_bytes() > 0
                         ? 100.0 * (static_cast<double>(peak) / r.estimate.peak_bytes() - 1.0)
                         : 0.0;
  const int64_t unattributed = got.category(Category::kUnattributed);
  char line[256];
  const std::string when = r.peak_step > 0 ? "at step " + std::to_string(r.peak_step)
                                           : "in set-up, before step 1: docs/memory.md, \"Not modelled\"";
  std::snprintf(line, sizeof line, "  %-24s%s %s  (%+.1f%% against the estimate, %s)\n", "peak",
                mb(r.estimate.peak_bytes()).c_str(), mb(peak).c_str(), off, when.c_str());
  os << line;
  std::snprintf(line, sizeof line,
                "  unattributed at the peak: %s (%.2f%%); activations kept by forward %s, "
                "largest %s\n",
                megabytes(unattributed).c_str(),
                peak > 0 ? 100.0 * static_cast<double>(unattributed) / static_cast<double>(peak) : 0.0,
                megabytes(r.activations_kept_bytes).c_str(),
                megabytes(r.activations_peak_bytes).c_str());
  os << line;
  if (!r.measured.peak_backtrace.empty()) {  // MEMRT_PEAK_BACKTRACE: the frames that name a function
    os << "  the allocation that set the peak: " << r.measured.peak_allocation_bytes << " bytes, from\n";
    std::istringstream frames(r.measured.peak_backtrace);
    for (std::string f; std::getline(frames, f);)
      if (!f.empty() && f.find("<unknown function>") == std::string::npos) os << "    " << f << "\n";
  }
  const ResidentMemory& rss = r.resident;
  if (rss.peak_bytes > 0) {
    std::snprintf(line, sizeof line,
                  "  resident (RSS): %s before the model was built, peak %s: grew %s, %.2fx the "
                  "allocator's peak\n",
                  megabytes(rss.idle_bytes).c_str(), megabytes(rss.peak_bytes).c_str(),
                  megabytes(rss.growth()).c_str(),
                  peak > 0 ? static_cast<double>(rss.growth()) / static_cast<double>(peak) : 0.0);
    os << line;
  }
  return os.str();
}

}  // namespace memrt
