// Large host blocks for the tracking allocator, mapped from the kernel and reused (docs/memory.md,
// "Resident memory").
//
// glibc keeps freed blocks: its mmap threshold rises to the size of any mapped block freed (up to
// 32 MiB), after which blocks that size come from the heap and stay resident once freed. A
// training step frees and re-allocates the same activation sizes every step, so the process's
// RSS ends well above what the tensors ever held at once. Every block of at least kMinBytes comes
// from this pool instead: page-granular ranges mapped from the kernel, kept once freed.
//
//   allocate(n):  the smallest free range of at least n bytes: its first n serve, the rest stays
//                 free (hits); else a free range grown in place by the pages it lacks (grows);
//                 else n new bytes (maps). Then free pages are unmapped, from the oldest range's
//                 end, until live + free is under the cap again.
//   free(block):  a free range, merged with free neighbours; its pages stay resident.
//
// where cap is the highest live total so far, so the pool's mapped bytes (live + free: the
// resident bytes of tensor storage) never exceed the allocator's peak for these blocks.
#pragma once

#include <cstddef>
#include <cstdint>

namespace memrt::memory {

struct BlockCacheStats {
  int64_t live_bytes = 0;         // mapped bytes of blocks in use
  int64_t cached_bytes = 0;       // mapped bytes of free ranges kept for reuse
  int64_t peak_live_bytes = 0;    // the highest live_bytes so far
  int64_t hits = 0;               // allocations served from a free range
  int64_t grows = 0;              // allocations served by a free range grown in place
  int64_t maps = 0;               // allocations that mapped new memory
  int64_t unmaps = 0;             // free ranges (or their ends) returned to the kernel
};

namespace block_cache {

constexpr size_t kMinBytes = size_t{256} << 10;  // smaller blocks stay with glibc

// Whether blocks go through the cache: MEMRT_HOST_ALLOCATOR=glibc turns it off (for comparison
// in bench/bench_rss.py); anything else, or unset, leaves it on. Read once.
bool enabled();

// A block of at least `bytes`, page aligned; *mapped receives its real length (free needs it).
void* allocate(size_t bytes, size_t* mapped);
void free(void* block, size_t mapped);

// Unmaps every cached block (as torch.cuda.empty_cache() does for CUDA's cache).
void release_cached();

BlockCacheStats stats();

}  // namespace block_cache
}  // namespace memrt::memory
