#include "memory/block_cache.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <set>
#include <utility>

#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000  // Linux 4.17; older headers lack the name
#endif

namespace memrt::memory::block_cache {
namespace {

// Free ranges of mapped pages, indexed three ways: by address (to merge neighbours), by length
// (best fit) and by the time they were freed (the oldest is given back first).
class Pool {
 public:
  void* allocate(size_t n) {
    std::lock_guard<std::mutex> lock(mutex_);
    char* p = nullptr;
    auto fit = by_length_.lower_bound({n, nullptr});
    if (fit != by_length_.end()) {
      p = fit->second;
      const size_t length = fit->first;
      const uint64_t freed = by_address_.at(p).freed;
      erase(p);
      if (length > n) insert(p + n, length - n, freed);  // the rest stays free, pages and all
      ++stats_.hits;
    } else if ((p = grow_in_place(n)) != nullptr) {
      ++stats_.grows;
    } else {
      p = map(n);
      ++stats_.maps;
    }
    stats_.live_bytes += static_cast<int64_t>(n);
    stats_.peak_live_bytes = std::max(stats_.peak_live_bytes, stats_.live_bytes);
    give_back(stats_.live_bytes + stats_.cached_bytes - stats_.peak_live_bytes);
    return p;
  }

  void free(void* block, size_t n) {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.live_bytes -= static_cast<int64_t>(n);
    char* p = static_cast<char*>(block);
    // Merge with free neighbours, so a later larger block can reuse their pages.
    auto next = by_address_.find(p + n);
    if (next != by_address_.end()) {
      n += next->second.length;
      erase(next->first);
    }
    auto prev = by_address_.lower_bound(p);
    if (prev != by_address_.begin() && (--prev, prev->first + prev->second.length == p)) {
      p = prev->first;
      n += prev->second.length;
      erase(p);
    }
    insert(p, n, next_freed_++);
  }

  // Unmaps every free range (as torch.cuda.empty_cache() does for CUDA's cache).
  void release() {
    std::lock_guard<std::mutex> lock(mutex_);
    give_back(stats_.cached_bytes);
  }

  BlockCacheStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

 private:
  struct Range {
    size_t length;
    uint64_t freed;  // sequence number of the free that made it
  };

  void insert(char* p, size_t length, uint64_t freed) {
    by_address_.emplace(p, Range{length, freed});
    by_length_.emplace(length, p);
    by_age_.emplace(freed, p);
    stats_.cached_bytes += static_cast<int64_t>(length);
  }

  void erase(char* p) {
    auto it = by_address_.find(p);
    by_length_.erase({it->second.length, p});
    by_age_.erase({it->second.freed, p});
    stats_.cached_bytes -= static_cast<int64_t>(it->second.length);
    by_address_.erase(it);
  }

  // A large free range extended to n bytes by mapping the pages it lacks right after or right
  // before it, where that address space is unused: only those pages fault in. Up to the
  // 64 largest ranges are tried, largest first; null when none has room beside it.
  char* grow_in_place(size_t n) {
    int tries = 0;
    for (auto it = by_length_.rbegin(); it != by_length_.rend() && tries < 64; ++it, ++tries) {
      char* p = it->second;
      const size_t lacking = n - it->first;
      for (char* at : {p + it->first, reinterpret_cast<uintptr_t>(p) > lacking ? p - lacking : nullptr}) {
        if (at == nullptr) continue;
        void* q = mmap(at, lacking, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
        if (q == at) {
          erase(p);
          return std::min(p, at);
        }
        if (q != MAP_FAILED) munmap(q, lacking);  // a kernel before 4.17 took the address as a hint
      }
    }
    return nullptr;
  }

  char* map(size_t n) {
    void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      give_back(stats_.cached_bytes);  // free ranges are memory too: all of them back, one more try
      p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) throw std::bad_alloc();
    }
    return static_cast<char*>(p);
  }

  // Unmaps `excess` bytes of free pages, from the oldest range's end, then the next oldest's.
  void give_back(int64_t excess) {
    while (excess > 0 && !by_age_.empty()) {
      char* p = by_age_.begin()->second;
      const Range r = by_address_.at(p);
      const size_t cut = std::min(r.length, static_cast<size_t>(excess));
      erase(p);
      munmap(p + r.length - cut, cut);
      if (cut < r.length) insert(p, r.length - cut, r.freed);
      excess -= static_cast<int64_t>(cut);
      ++stats_.unmaps;
    }
  }

  std::mutex mutex_;
  std::map<char*, Range> by_address_;
  std::set<std::pair<size_t, char*>> by_length_;
  std::set<std::pair<uint64_t, char*>> by_age_;
  uint64_t next_freed_ = 0;
  BlockCacheStats stats_;
};

Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: blocks may be freed during static teardown
  return *p;
}

size_t page_round(size_t n) {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (n + page - 1) / page * page;
}

}  // namespace

bool enabled() {
  static const bool on = [] {
    const char* v = std::getenv("MEMRT_HOST_ALLOCATOR");
    return !(v && std::strcmp(v, "glibc") == 0);
  }();
  return on;
}

void* allocate(size_t bytes, size_t* mapped) {
  *mapped = page_round(bytes);
  return pool().allocate(*mapped);
}

void free(void* block, size_t mapped) { pool().free(block, mapped); }

void release_cached() { pool().release(); }

BlockCacheStats stats() { return pool().stats(); }

}  // namespace memrt::memory::block_cache
