// The block cache behind the tracking allocator's large blocks (docs/memory.md, "Resident
// memory"): freed blocks serve later ones, split and merged so their resident pages serve again,
// the oldest are given back first, and it never holds more than the highest live total.
#include <gtest/gtest.h>

#include <sys/mman.h>

#include <cerrno>

#include <cstring>
#include <random>
#include <vector>

#include "memory/block_cache.h"
#include "memory/report.h"

namespace {

namespace block_cache = memrt::memory::block_cache;
using memrt::memory::BlockCacheStats;

constexpr size_t kMiB = size_t{1} << 20;

struct Block {
  void* p = nullptr;
  size_t mapped = 0;
};

Block allocate(size_t bytes) {
  Block b;
  b.p = block_cache::allocate(bytes, &b.mapped);
  return b;
}

void touch(const Block& b) { std::memset(b.p, 1, b.mapped); }

int64_t held(const BlockCacheStats& s) { return s.live_bytes + s.cached_bytes; }

// Each test starts from an empty cache (in one process, the blocks a test left cached would
// serve the next).
class BlockCache : public ::testing::Test {
 protected:
  void SetUp() override { block_cache::release_cached(); }
};

TEST_F(BlockCache, AFreedBlockServesTheNextAllocationOfItsSize) {
  const Block a = allocate(3 * kMiB + 100);
  EXPECT_EQ(a.mapped % 4096, 0u);
  EXPECT_GE(a.mapped, 3 * kMiB + 100);
  touch(a);
  block_cache::free(a.p, a.mapped);
  const BlockCacheStats before = block_cache::stats();
  const Block b = allocate(3 * kMiB + 100);
  const BlockCacheStats after = block_cache::stats();
  EXPECT_EQ(b.p, a.p);
  EXPECT_EQ(after.hits, before.hits + 1);
  EXPECT_EQ(after.maps, before.maps);
  block_cache::free(b.p, b.mapped);
}

size_t pages(size_t bytes) { return bytes / 4096 * 4096; }

// Mapping a block anew costs a page fault per page; a free range split or merged to the size asked
// for keeps the pages it had, which the process's RSS shows.
TEST_F(BlockCache, SplittingAndMergingKeepTheResidentPages) {
  const size_t size = 32 * kMiB;
  const Block big = allocate(size);
  touch(big);
  block_cache::free(big.p, big.mapped);

  // 3/4 of it, then the rest: both from the free range, without a page fault.
  BlockCacheStats before = block_cache::stats();
  int64_t rss0 = memrt::current_rss_bytes();
  const Block head = allocate(size / 4 * 3);
  const Block tail = allocate(size / 4);
  touch(head);
  touch(tail);
  BlockCacheStats after = block_cache::stats();
  EXPECT_EQ(head.p, big.p);
  EXPECT_EQ(tail.p, static_cast<char*>(big.p) + size / 4 * 3);
  EXPECT_EQ(after.maps, before.maps);
  EXPECT_EQ(after.hits, before.hits + 2);
  EXPECT_LT(memrt::current_rss_bytes() - rss0, static_cast<int64_t>(kMiB))
      << "touching the parts of a split range faulted pages in: its resident pages were not kept";

  // Freed in either order, the parts merge back into one range that serves the whole size.
  block_cache::free(tail.p, tail.mapped);
  block_cache::free(head.p, head.mapped);
  before = block_cache::stats();
  rss0 = memrt::current_rss_bytes();
  const Block whole = allocate(size);
  touch(whole);
  after = block_cache::stats();
  EXPECT_EQ(whole.p, big.p);
  EXPECT_EQ(after.maps, before.maps);
  EXPECT_LT(memrt::current_rss_bytes() - rss0, static_cast<int64_t>(kMiB))
      << "touching a merged range faulted pages in";
  block_cache::free(whole.p, whole.mapped);
}

// Whether every page of [p, p + bytes) was unmapped: it is not mapped now, or the kernel has
// since handed its address to `fresh` (a new mapping, so the old pages were gone).
bool given_back(const void* p, size_t bytes, const Block& fresh) {
  const auto* begin = static_cast<const char*>(fresh.p);
  unsigned char residency = 0;
  for (const char* q = static_cast<const char*>(p); q < static_cast<const char*>(p) + bytes; q += 4096) {
    const bool in_fresh = q >= begin && q < begin + fresh.mapped;
    if (!in_fresh && !(mincore(const_cast<char*>(q), 4096, &residency) != 0 && errno == ENOMEM)) return false;
  }
  return true;
}

bool kept(const void* p, size_t bytes, const Block& fresh) {
  const auto* q = static_cast<const char*>(p);
  const auto* begin = static_cast<const char*>(fresh.p);
  std::vector<unsigned char> residency(bytes / 4096);
  return (q + bytes <= begin || q >= begin + fresh.mapped) &&
         mincore(const_cast<char*>(q), bytes, residency.data()) == 0;
}

// A free range too small for a block grows into the unused address space beside it: only the
// pages it lacks are mapped and fault in.
TEST_F(BlockCache, AFreeRangeGrowsInPlace) {
  const Block small = allocate(8 * kMiB);
  touch(small);
  block_cache::free(small.p, small.mapped);
  const BlockCacheStats before = block_cache::stats();
  const int64_t rss0 = memrt::current_rss_bytes();
  const Block grown = allocate(12 * kMiB);
  touch(grown);
  const BlockCacheStats after = block_cache::stats();
  EXPECT_EQ(after.grows, before.grows + 1);
  EXPECT_EQ(after.maps, before.maps);
  const auto* p = static_cast<const char*>(small.p);
  EXPECT_TRUE(grown.p == p || static_cast<const char*>(grown.p) + 4 * kMiB == p)
      << "the block does not contain the free range it grew from";
  const int64_t faulted = memrt::current_rss_bytes() - rss0;
  EXPECT_GT(faulted, static_cast<int64_t>(3 * kMiB));
  EXPECT_LT(faulted, static_cast<int64_t>(5 * kMiB)) << "more than the 4 MiB it grew by faulted in";
  block_cache::free(grown.p, grown.mapped);
}

// When a new block does not fit and must be mapped, free pages are unmapped so that the pool stays
// under the cap: oldest range first, and no more of them than the new block needs.
TEST_F(BlockCache, GivesBackTheOldestFreePagesFirst) {
  // Two free ranges, each enclosed by live spacers (so they can neither merge nor grow in place),
  // carved from one block that sets a new highest live total.
  const size_t half = pages(static_cast<size_t>(block_cache::stats().peak_live_bytes) / 2) + 4 * kMiB;
  const Block whole = allocate(2 * half + 3 * kMiB);
  touch(whole);
  block_cache::free(whole.p, whole.mapped);
  const Block spacer1 = allocate(kMiB);
  const Block older = allocate(half);
  const Block spacer2 = allocate(kMiB);
  const Block newer = allocate(half);
  const Block spacer3 = allocate(kMiB);
  ASSERT_EQ(spacer3.p, static_cast<char*>(whole.p) + 2 * half + 2 * kMiB) << "best fit splits the free range in order";
  block_cache::free(older.p, older.mapped);
  block_cache::free(newer.p, newer.mapped);
  const BlockCacheStats s = block_cache::stats();
  ASSERT_EQ(s.cached_bytes, static_cast<int64_t>(2 * half));
  ASSERT_EQ(s.live_bytes + s.cached_bytes, s.peak_live_bytes);

  // A block larger than either range: it is mapped, and exactly its size is given back first,
  // all of the older range and the end of the newer one.
  const size_t n = half + 2 * kMiB;
  const Block fresh = allocate(n);
  const BlockCacheStats after = block_cache::stats();
  EXPECT_EQ(after.maps, s.maps + 1);
  EXPECT_EQ(after.cached_bytes, static_cast<int64_t>(2 * half - n));
  EXPECT_TRUE(given_back(older.p, half, fresh)) << "the older range was kept";
  EXPECT_TRUE(kept(newer.p, half - 2 * kMiB, fresh)) << "more of the newer range was given back than needed";
  EXPECT_TRUE(given_back(static_cast<char*>(newer.p) + half - 2 * kMiB, 2 * kMiB, fresh));
  for (const Block& b : {fresh, spacer1, spacer2, spacer3}) block_cache::free(b.p, b.mapped);
}

// live + cached, the bytes the cache holds mapped, never exceeds the highest live total, whatever
// the sequence of sizes; and every block it hands out is writable for its full length.
TEST_F(BlockCache, NeverHoldsMoreThanTheHighestLiveTotal) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<size_t> size(256 << 10, 12 * kMiB);
  std::vector<Block> live;
  for (int i = 0; i < 400; ++i) {
    if (live.size() < 8 && (live.empty() || rng() % 3 != 0)) {
      live.push_back(allocate(size(rng)));
      touch(live.back());
    } else {
      const size_t k = rng() % live.size();
      block_cache::free(live[k].p, live[k].mapped);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    }
    const BlockCacheStats s = block_cache::stats();
    ASSERT_LE(held(s), s.peak_live_bytes) << "after operation " << i;
  }
  for (const Block& b : live) block_cache::free(b.p, b.mapped);
  const BlockCacheStats s = block_cache::stats();
  EXPECT_EQ(s.live_bytes, 0);
  EXPECT_GT(s.hits, 0);
  EXPECT_GT(s.unmaps, 0) << "a random sequence of sizes must give some pages back to stay under the cap";
}

}  // namespace
