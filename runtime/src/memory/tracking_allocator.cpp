// The tracking allocator (docs/memory.md, "Measuring").
//
// Each block carries a 64-byte header in front of the data LibTorch sees: its size and its cell.
// The header keeps the data 64-byte aligned (what LibTorch's own allocator guarantees) and makes
// claim() and free a constant-time header access — no side table, no lock on the hot path. The
// DataPtr's context is the data pointer itself: some kernels allocate through raw_allocate(),
// which requires it.
#include "memory/tracking_allocator.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Backtrace.h>

#include "memory/block_cache.h"

namespace memrt::memory {
namespace {

constexpr size_t kHeader = 64;
constexpr uint32_t kMagic = 0x6d656d72;  // "memr"
constexpr int kCells = kNumCategories * kNumPlacements;

struct Header {
  uint64_t size;
  uint64_t mapped;  // the block cache's length of the block; 0: the block came from g_inner
  uint32_t magic;
  uint8_t cell;
};
static_assert(sizeof(Header) <= kHeader, "the header must fit in front of the data");

constexpr uint8_t cell_of(Category c, Placement p) {
  return static_cast<uint8_t>(static_cast<int>(c) * kNumPlacements + static_cast<int>(p));
}
constexpr uint8_t kUnattributedCell = cell_of(Category::kUnattributed, Placement::kDevice);

thread_local uint8_t tls_cell = kUnattributedCell;

void atomic_max(std::atomic<int64_t>& target, int64_t value) {
  int64_t prev = target.load(std::memory_order_relaxed);
  while (prev < value && !target.compare_exchange_weak(prev, value, std::memory_order_relaxed)) {
  }
}

struct Counters {
  std::array<std::atomic<int64_t>, kCells> cells{};
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> allocations{0};
  std::atomic<int64_t> frees{0};
  std::array<std::atomic<int64_t>, kCells> window_cells{};
  std::atomic<int64_t> window_total{0};
  std::mutex peak_mutex;  // taken only when the peak rises
  Table at_peak;
  // MEMRT_PEAK_BACKTRACE: where the peak's last allocation came from (a diagnostic: slow).
  const bool trace_peaks = [] {
    const char* v = std::getenv("MEMRT_PEAK_BACKTRACE");
    return v != nullptr && *v != '\0' && std::string(v) != "0";
  }();
  int64_t peak_allocation = 0;
  std::string peak_trace;

  Table snapshot() const {
    Table t;
    for (int i = 0; i < kCells; ++i)
      t.bytes[i / kNumPlacements][i % kNumPlacements] = cells[i].load(std::memory_order_relaxed);
    return t;
  }

  void add(uint8_t cell, int64_t n) {
    atomic_max(window_cells[cell], cells[cell].fetch_add(n, std::memory_order_relaxed) + n);
    const int64_t now = current.fetch_add(n, std::memory_order_relaxed) + n;
    atomic_max(window_total, now);
    if (now > peak.load(std::memory_order_relaxed)) {
      std::lock_guard<std::mutex> lock(peak_mutex);
      if (now > peak.load(std::memory_order_relaxed)) {
        peak.store(now, std::memory_order_relaxed);
        at_peak = snapshot();
        if (trace_peaks) {
          peak_allocation = n;
          peak_trace = c10::get_backtrace(/*frames_to_skip=*/3, /*maximum_number_of_frames=*/64);
        }
      }
    }
  }

  void sub(uint8_t cell, int64_t n) {
    cells[cell].fetch_sub(n, std::memory_order_relaxed);
    current.fetch_sub(n, std::memory_order_relaxed);
  }

  void move(uint8_t from, uint8_t to, int64_t n) {
    cells[from].fetch_sub(n, std::memory_order_relaxed);
    atomic_max(window_cells[to], cells[to].fetch_add(n, std::memory_order_relaxed) + n);
  }
};

Counters& counters() {
  static Counters* c = new Counters();  // never destroyed: frees may come after static teardown
  return *c;
}

Header* header_of(void* data) {
  return reinterpret_cast<Header*>(static_cast<char*>(data) - kHeader);
}

// The allocator the tracker replaced; blocks come from it.
c10::Allocator* g_inner = nullptr;
c10::DeleterFnPtr g_inner_free = nullptr;

void tracked_free(void* data) {
  Header* h = header_of(data);
  counters().sub(h->cell, static_cast<int64_t>(h->size));
  counters().frees.fetch_add(1, std::memory_order_relaxed);
  h->magic = 0;
  if (h->mapped != 0) {
    block_cache::free(h, h->mapped);
  } else {
    g_inner_free(h);
  }
}

class TrackingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (n == 0) return {nullptr, nullptr, &tracked_free, c10::Device(c10::DeviceType::CPU)};
    size_t mapped = 0;
    void* base = block_cache::enabled() && n + kHeader >= block_cache::kMinBytes
                     ? block_cache::allocate(n + kHeader, &mapped)
                     : g_inner->raw_allocate(n + kHeader);
    auto* h = static_cast<Header*>(base);
    h->size = n;
    h->mapped = mapped;
    h->magic = kMagic;
    h->cell = tls_cell;
    counters().add(h->cell, static_cast<int64_t>(n));
    counters().allocations.fetch_add(1, std::memory_order_relaxed);
    void* data = static_cast<char*>(base) + kHeader;
    return {data, data, &tracked_free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &tracked_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

}  // namespace

void install_tracking_allocator() {
  static std::once_flag once;
  std::call_once(once, [] {
    g_inner = c10::GetCPUAllocator();
    g_inner_free = g_inner->raw_deleter();
    if (g_inner_free == nullptr) {  // an allocator without raw blocks: use LibTorch's own
      g_inner = c10::GetDefaultCPUAllocator();
      g_inner_free = g_inner->raw_deleter();
    }
    static TrackingAllocator* tracker = new TrackingAllocator();  // outlives every block
    c10::SetCPUAllocator(tracker, /*priority=*/100);
  });
}

bool tracking() { return g_inner != nullptr; }

AllocatorStats allocator_stats() {
  Counters& c = counters();
  AllocatorStats s;
  s.current_bytes = c.current.load();
  s.allocations = c.allocations.load();
  s.frees = c.frees.load();
  std::lock_guard<std::mutex> lock(c.peak_mutex);
  s.peak_bytes = c.peak.load();
  s.at_peak = c.at_peak;
  s.peak_allocation_bytes = c.peak_allocation;
  s.peak_backtrace = c.peak_trace;
  return s;
}

void open_window() {
  Counters& c = counters();
  for (int i = 0; i < kCells; ++i) c.window_cells[i].store(c.cells[i].load());
  c.window_total.store(c.current.load());
}

WindowPeaks window_peaks() {
  Counters& c = counters();
  WindowPeaks w;
  w.total = c.window_total.load();
  for (int i = 0; i < kCells; ++i)
    w.cells.bytes[i / kNumPlacements][i % kNumPlacements] = c.window_cells[i].load();
  return w;
}

DeviceAllocatorStats device_allocator_stats(const c10::Device& device) {
  DeviceAllocatorStats out;
  // LibTorch's device-generic interface: CUDA's caching allocator registers itself there when
  // LibTorch's CUDA libraries load, which a CUDA tensor implies (memrt itself links only the CPU ones).
  if (device.is_cuda()) {
    const auto stats = c10::getDeviceAllocator(device.type())->getDeviceStats(device.index());
    const auto& bytes = stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
    out.available = true;
    out.current_bytes = bytes.current;
    out.peak_bytes = bytes.peak;
  }
  return out;
}

void reset_peak() {
  Counters& c = counters();
  std::lock_guard<std::mutex> lock(c.peak_mutex);
  c.peak.store(c.current.load());
  c.at_peak = c.snapshot();
  c.peak_allocation = 0;
  c.peak_trace.clear();
}

// ---- the SDK (memrt/memory.h) ---------------------------------------------------------------------

Table live() { return counters().snapshot(); }

namespace {
// Moves t's storage to cell `to`; returns the bytes that moved, or -1 for storage not ours.
int64_t claim_storage(const at::Tensor& t, uint8_t to) {
  if (!t.defined() || !t.has_storage()) return -1;
  const c10::DataPtr& dp = t.storage().data_ptr();
  if (dp.get_deleter() != &tracked_free || dp.get() == nullptr) return -1;
  Header* h = header_of(dp.get());
  if (h->cell == to) return 0;
  const auto n = static_cast<int64_t>(h->size);
  counters().move(h->cell, to, n);
  h->cell = to;
  return n;
}
}  // namespace

bool claim(const at::Tensor& t, Category category, Placement placement) {
  return claim_storage(t, cell_of(category, placement)) >= 0;
}

int64_t claim_all(const std::vector<at::Tensor>& tensors, Category category, Placement placement) {
  int64_t moved = 0;
  for (const at::Tensor& t : tensors) moved += std::max<int64_t>(0, claim_storage(t, cell_of(category, placement)));
  return moved;
}

Scope::Scope(Category category, Placement placement) : saved_(tls_cell) {
  tls_cell = cell_of(category, placement);
}

Scope::~Scope() { tls_cell = saved_; }

// ---- Table ----------------------------------------------------------------------------------------

const char* to_string(Category c) {
  switch (c) {
    case Category::kWeights: return "weights";
    case Category::kMasterWeights: return "master_weights";
    case Category::kGradients: return "gradients";
    case Category::kOptimizerState: return "optimizer_state";
    case Category::kQuantState: return "quant_state";
    case Category::kAdapters: return "adapters";
    case Category::kActivations: return "activations";
    case Category::kCommBuffers: return "comm_buffers";
    case Category::kOther: return "other";
    case Category::kUnattributed: return "unattributed";
  }
  return "?";
}

const char* to_string(Placement p) { return p == Placement::kDevice ? "device" : "host"; }

int64_t Table::placement(Placement p) const {
  int64_t sum = 0;
  for (const auto& row : bytes) sum += row[static_cast<size_t>(p)];
  return sum;
}

Table Table::operator-(const Table& other) const {
  Table d;
  for (size_t i = 0; i < bytes.size(); ++i)
    for (size_t j = 0; j < bytes[i].size(); ++j) d.bytes[i][j] = bytes[i][j] - other.bytes[i][j];
  return d;
}

Table Table::operator+(const Table& other) const {
  Table d;
  for (size_t i = 0; i < bytes.size(); ++i)
    for (size_t j = 0; j < bytes[i].size(); ++j) d.bytes[i][j] = bytes[i][j] + other.bytes[i][j];
  return d;
}

}  // namespace memrt::memory
