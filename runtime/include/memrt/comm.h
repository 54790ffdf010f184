// memrt/comm.h — collectives over the data-parallel ranks, as plugins use them.
//
// The host implements this over a c10d process group (Gloo on CPU, NCCL in CUDA builds); with one
// rank every call is a cheap no-op. Every call is collective: all ranks must make it, in the same
// order. A failed or timed-out collective (a peer died) throws memrt::DistributedError.
#pragma once

#include <memory>
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

  // ---- ABI 2.18: a collective that runs while the caller computes ----
  // A started collective. wait() returns once it is complete (a failure throws as the blocking call
  // would); the destructor waits too, so a tensor handed over is never freed under the backend.
  class Pending {
   public:
    virtual ~Pending() = default;
    virtual void wait() = 0;
  };
  // Starts broadcast(t, root) and returns: `t` (contiguous) must be neither read nor written until
  // the handle's wait() returns. Issued in the same order on every rank, like every collective. A
  // backend without asynchronous collectives broadcasts before returning (this default).
  virtual std::unique_ptr<Pending> broadcast_async(at::Tensor& t, int root) {
    broadcast(t, root);
    struct Done final : Pending {
      void wait() override {}
    };
    return std::make_unique<Done>();
  }

  // ---- ABI 2.20 ----
  // `t` on rank `root` := the element-wise sum over ranks of `t`; on the other ranks its values are
  // unspecified afterwards (the backend may use it as scratch). Half an all-reduce's traffic where
  // only one rank needs the sum (ZeRO's gradient buckets: the rank owning that partition). A
  // backend without it all-reduces (this default).
  virtual void reduce_sum(at::Tensor& t, int /*root*/) { all_reduce_sum(t); }
};

}  // namespace memrt
