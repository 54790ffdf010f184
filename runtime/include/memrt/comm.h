// memrt/comm.h — collectives over the data-parallel ranks, as plugins use them.
//
// The host implements this over a c10d process group (Gloo on CPU, NCCL in CUDA builds); with one
// rank every call is a cheap no-op. Every call is collective: all ranks must make it, in the same
// order. A failed or timed-out collective (a peer died) throws memrt::DistributedError.
#pragma once

#include <vector>

#include <ATen/ATen.h>

namespace memrt {

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  virtual void all_reduce_sum(at::Tensor& t) = 0;  // in place
  virtual void all_reduce_max(at::Tensor& t) = 0;  // in place
  virtual void broadcast(at::Tensor& t, int root) = 0;
  // out (world_size * n elements) = concatenation of every rank's `in` (n elements), in rank order.
  virtual void all_gather(at::Tensor& out, const at::Tensor& in) = 0;
  // out (n elements) = this rank's slice of the element-wise sum of every rank's `in` (world_size * n).
  virtual void reduce_scatter_sum(at::Tensor& out, const at::Tensor& in) = 0;
  virtual void barrier() = 0;
};

}  // namespace memrt
