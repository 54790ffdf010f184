// dist/nccl_backend.cpp — libmemrt_nccl: c10d's NCCL backend for a rank whose tensors are on a CUDA
// device. It is a library of its own because it links LibTorch's CUDA libraries, which libmemrt
// does not (cmake/MemrtFindTorch.cmake): process_group.cpp opens it, from beside libmemrt, only
// when a process group for CUDA tensors is made.
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <chrono>
#include <cstdint>

// The backend for `rank` of `world_size` over `store`, every collective bounded by `timeout_ms`;
// the caller owns the returned reference (c10::intrusive_ptr::reclaim).
extern "C" __attribute__((visibility("default"))) c10d::Backend* memrt_nccl_backend(
    const c10::intrusive_ptr<c10d::Store>* store, int rank, int world_size, int64_t timeout_ms) {
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = std::chrono::milliseconds(timeout_ms);
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(*store, rank, world_size, opts).release();
}
