// The tracking allocator counts LibTorch's CPU allocations exactly, per cell (docs/memory.md).
#include <gtest/gtest.h>

#include <thread>

#include <ATen/ATen.h>

#include "memory/tracking_allocator.h"
#include "memrt/memory.h"

namespace {

using memrt::memory::Category;
using memrt::memory::Placement;
namespace memory = memrt::memory;

class TrackingAllocator : public ::testing::Test {
 protected:
  void SetUp() override { memory::install_tracking_allocator(); }
};

TEST_F(TrackingAllocator, CountsEveryByteInTheScopesCell) {
  const memory::AllocatorStats before = memory::allocator_stats();
  const int64_t adapters = memory::live().at(Category::kAdapters);
  {
    memory::Scope scope(Category::kAdapters);
    at::Tensor t = at::empty({1000}, at::kFloat);  // 4000 bytes
    at::Tensor u = at::empty({3, 7}, at::kDouble);  // 168 bytes
    EXPECT_EQ(memory::live().at(Category::kAdapters), adapters + 4168);
    const memory::AllocatorStats during = memory::allocator_stats();
    EXPECT_EQ(during.current_bytes, before.current_bytes + 4168);
    EXPECT_EQ(during.allocations, before.allocations + 2);
  }
  const memory::AllocatorStats after = memory::allocator_stats();
  EXPECT_EQ(memory::live().at(Category::kAdapters), adapters);
  EXPECT_EQ(after.current_bytes, before.current_bytes);
  EXPECT_EQ(after.frees, before.frees + 2);
}

TEST_F(TrackingAllocator, OutsideEveryScopeIsUnattributedAndScopesNest) {
  const memory::Table base = memory::live();
  at::Tensor a = at::empty({10}, at::kFloat);
  at::Tensor b, c;
  {
    memory::Scope outer(Category::kWeights);
    {
      memory::Scope inner(Category::kOptimizerState, Placement::kHost);
      b = at::empty({20}, at::kFloat);
    }
    c = at::empty({30}, at::kFloat);
  }
  const memory::Table d = memory::live() - base;
  EXPECT_EQ(d.at(Category::kUnattributed), 40);
  EXPECT_EQ(d.at(Category::kOptimizerState, Placement::kHost), 80);
  EXPECT_EQ(d.at(Category::kOptimizerState, Placement::kDevice), 0);
  EXPECT_EQ(d.at(Category::kWeights), 120);
  EXPECT_EQ(d.total(), 240);
}

TEST_F(TrackingAllocator, ClaimMovesAStorageAndViewsShareIt) {
  const memory::Table base = memory::live();
  at::Tensor t = at::zeros({4, 256}, at::kFloat);  // 4096 bytes, unattributed
  at::Tensor row = t[2];                           // a view: same storage
  ASSERT_TRUE(memory::claim(row, Category::kMasterWeights, Placement::kHost));
  memory::Table d = memory::live() - base;
  EXPECT_EQ(d.at(Category::kMasterWeights, Placement::kHost), 4096);
  EXPECT_EQ(d.at(Category::kUnattributed), 0);
  EXPECT_EQ(memory::claim_all({t, row}, Category::kGradients), 4096);  // moved once
  EXPECT_EQ(memory::claim_all({t}, Category::kGradients), 0);          // already there
  t = at::Tensor();
  row = at::Tensor();
  EXPECT_EQ((memory::live() - base).total(), 0);  // freed from the cell it was claimed into
}

TEST_F(TrackingAllocator, StorageItDidNotAllocateCannotBeClaimed) {
  std::vector<float> outside(16, 1.0f);
  at::Tensor blob = at::from_blob(outside.data(), {16}, at::kFloat);
  const memory::Table base = memory::live();
  EXPECT_FALSE(memory::claim(blob, Category::kWeights));
  EXPECT_FALSE(memory::claim(at::Tensor(), Category::kWeights));
  EXPECT_TRUE(memory::live() == base);
}

TEST_F(TrackingAllocator, ThePeakKeepsTheCellsOfItsInstant) {
  memory::reset_peak();
  const int64_t base = memory::allocator_stats().current_bytes;
  at::Tensor w, a, c;
  {
    memory::Scope s(Category::kWeights);
    w = at::empty({250000}, at::kFloat);  // 1 MB
  }
  {
    memory::Scope s(Category::kActivations);
    a = at::empty({500000}, at::kFloat);  // 2 MB
  }
  a = at::Tensor();
  {
    memory::Scope s(Category::kGradients);
    c = at::empty({125000}, at::kFloat);  // 0.5 MB: live 1.5 MB, below the 3 MB peak
  }
  const memory::AllocatorStats st = memory::allocator_stats();
  EXPECT_EQ(st.peak_bytes, base + 3'000'000);
  EXPECT_EQ(st.at_peak.total(), st.peak_bytes);
  EXPECT_EQ(st.at_peak.at(Category::kActivations) - memory::live().at(Category::kActivations),
            2'000'000);
  EXPECT_EQ(st.at_peak.at(Category::kGradients) - memory::live().at(Category::kGradients),
            -500'000);
}

TEST_F(TrackingAllocator, AWindowRemembersEachCellsLargestValue) {
  at::Tensor keep;
  memory::open_window();
  const memory::Table start = memory::live();
  {
    memory::Scope s(Category::kActivations);
    at::Tensor t = at::empty({1000}, at::kFloat);
    keep = at::empty({10}, at::kFloat);
  }
  const memory::WindowPeaks w = memory::window_peaks();
  EXPECT_EQ(w.cells.at(Category::kActivations) - start.at(Category::kActivations), 4040);
  EXPECT_EQ(memory::live().at(Category::kActivations) - start.at(Category::kActivations), 40);
  EXPECT_GE(w.total, start.total() + 4040);
}

TEST_F(TrackingAllocator, AScopeIsPerThread) {
  const memory::Table base = memory::live();
  memory::Scope s(Category::kAdapters);
  at::Tensor other_thread;
  std::thread([&] { other_thread = at::empty({8}, at::kFloat); }).join();
  const memory::Table d = memory::live() - base;
  EXPECT_EQ(d.at(Category::kUnattributed), 32);
  EXPECT_EQ(d.at(Category::kAdapters), 0);
}

// Kernels that allocate through raw_allocate() need the context to be the data pointer (a
// wrapper that stores another context aborts inside gelu).
TEST_F(TrackingAllocator, KernelsUsingRawAllocationsWork) {
  at::Tensor x = at::randn({64, 1024});
  at::Tensor y = at::gelu(x, "tanh").sum();
  at::Tensor z = at::scaled_dot_product_attention(at::randn({2, 2, 16, 8}), at::randn({2, 2, 16, 8}),
                                                  at::randn({2, 2, 16, 8}), {}, 0.0, true);
  EXPECT_TRUE(std::isfinite(y.item<float>()));
  EXPECT_EQ(z.sizes(), (at::IntArrayRef{2, 2, 16, 8}));
}

}  // namespace
