// dist/process_group.h — one process's place in a data-parallel job, and the collectives the
// engine and the plugins run over it.
//
// Rendezvous comes from the environment that every common launcher provides:
//
//   variable      torchrun / deepspeed /     mpirun (Open MPI)              srun (Slurm)
//                 launcher --num_procs
//   rank          RANK                       OMPI_COMM_WORLD_RANK           SLURM_PROCID
//   world size    WORLD_SIZE                 OMPI_COMM_WORLD_SIZE           SLURM_NTASKS
//   local rank    LOCAL_RANK                 OMPI_COMM_WORLD_LOCAL_RANK     SLURM_LOCALID
//   store         MASTER_ADDR, MASTER_PORT   (exported by the user)         (exported by the user)
//
// RANK/WORLD_SIZE win when present; otherwise the first family found above is used. No variable
// at all, or a world size of 1, means a single process: no store, no sockets, every collective
// is the identity. Otherwise rank 0 hosts a c10d::TCPStore at MASTER_ADDR:MASTER_PORT, every rank
// connects to it, and a c10d::ProcessGroupGloo (CPU tensors) is built over it. In CUDA builds
// with NCCL the seam in process_group.cpp (make_backend) builds ProcessGroupNCCL instead.
//
// Every wait is bounded by the timeout (default 60 s; MEMRT_DIST_TIMEOUT=<seconds> overrides it).
// A collective that fails — a peer died, the network broke, a peer hung past the timeout — throws
// memrt::DistributedError naming this rank, the collective and the backend's own message; the
// context is then broken and every later collective throws at once.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "memrt/comm.h"

namespace memrt {

// Where rank, world size and local rank came from, parsed but not yet connected.
struct DistEnvironment {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr;  // empty when world_size == 1
  int master_port = 0;      // 0 when world_size == 1
  std::string source;       // "none", "torchrun", "Open MPI" or "Slurm": which variables were used
};

// Reads the variables listed at the top of this file. Throws memrt::DistributedError naming the
// variable that is missing or malformed and the launcher that normally sets it.
DistEnvironment read_dist_environment();

// How data-parallel gradients are averaged: all-reduce sum, then times 1/N (DeepSpeed's default
// "postscale"; its prescale_gradients and gradient_predivide_factor give the same mean up to
// rounding and are accepted with a warning by the config loader).
struct GradReduceOptions {
  // Upper bound of one all-reduce bucket (and of the staging buffer it uses). DeepSpeed's
  // allreduce_bucket_size counts elements; the engine converts (elements × element size).
  int64_t bucket_bytes = int64_t{500'000'000};
};

// The SDK's Communicator (memrt/comm.h) is this class: plugins reach the collectives through it.
class DistContext final : public Communicator {
 public:
  // Reads the environment (read_dist_environment) and, when world_size > 1, rendezvouses with the
  // other ranks. `timeout` bounds the rendezvous and every later collective. `device` selects the
  // backend: kCPU -> Gloo; kCUDA -> NCCL (libmemrt_nccl.so, built where LibTorch has CUDA and
  // NCCL's header was found; an error naming it otherwise).
  static std::shared_ptr<DistContext> from_environment(
      std::chrono::seconds timeout = std::chrono::seconds(60),
      c10::DeviceType device = c10::DeviceType::CPU);
  // Same, from an environment already read (tests, the launcher).
  static std::shared_ptr<DistContext> create(const DistEnvironment& env,
                                             std::chrono::seconds timeout,
                                             c10::DeviceType device = c10::DeviceType::CPU);

  ~DistContext() override;
  DistContext(const DistContext&) = delete;
  DistContext& operator=(const DistContext&) = delete;

  int rank() const override { return env_.rank; }
  int world_size() const override { return env_.world_size; }
  int local_rank() const { return env_.local_rank; }
  bool is_main() const { return rank() == 0; }
  const DistEnvironment& environment() const { return env_; }
  std::chrono::seconds timeout() const { return timeout_; }

  // In place, over all ranks. Tensors need not be contiguous (a contiguous copy is reduced and
  // copied back).
  void all_reduce_sum(at::Tensor& t) override;
  void all_reduce_max(at::Tensor& t) override;
  void broadcast(at::Tensor& t, int root) override;
  // The broadcast runs on the backend's worker thread (Gloo's, NCCL's stream); the handle waits
  // as the blocking call does, bounded by the timeout.
  std::unique_ptr<Pending> broadcast_async(at::Tensor& t, int root) override;
  // The sum over ranks into root's `t` (a contiguous copy is reduced where `t` is not); the other
  // ranks' `t` is left as the backend leaves it.
  void reduce_sum(at::Tensor& t, int root) override;
  void barrier() override;
  // out (world_size * n elements) = every rank's `in` (n elements) concatenated in rank order.
  void all_gather(at::Tensor& out, const at::Tensor& in) override;
  // out (n elements) = this rank's slice [rank * n, (rank + 1) * n) of the element-wise sum over
  // ranks of `in` (world_size * n elements).
  void reduce_scatter_sum(at::Tensor& out, const at::Tensor& in) override;

  // Data-parallel gradient averaging (ZeRO stage 0). The defined grads of `params` are treated as
  // one flat sequence per dtype and cut into buckets of at most options.bucket_bytes (a tensor
  // larger than a bucket is split across several); each bucket is packed into a reused staging
  // buffer, all-reduced once, scaled per `options` and copied back. Two staging buffers per dtype
  // alternate so packing the next bucket overlaps the previous all-reduce. The bucket plan is
  // kept while the set of grads (count, shapes, dtypes) stays the same; when it changes, the
  // ranks first check that they all hold the same set (a mismatch would otherwise hang or mix
  // unrelated gradients) and throw DistributedError naming the difference if not.
  // With world_size 1 this does nothing: the average over one rank is the gradient itself.
  void all_reduce_gradients(const std::vector<at::Tensor>& params,
                            const GradReduceOptions& options);
  // The same averaging of contiguous tensors in place (the store's flat gradient buffers).
  void all_reduce_tensors(const std::vector<at::Tensor>& tensors, const GradReduceOptions& options);

  // Bytes currently held in staging buffers (for the memory report: communication buffers).
  int64_t comm_buffer_bytes() const;

  struct Impl;  // the c10d objects; defined in process_group.cpp

 private:
  DistContext(DistEnvironment env, std::chrono::seconds timeout);
  // Both averagings: `grads` (contiguous) in buckets; `ids` name them in the plan's key.
  void reduce_in_buckets(const std::vector<at::Tensor>& grads, const std::vector<int64_t>& ids,
                         const GradReduceOptions& options);

  DistEnvironment env_;
  std::chrono::seconds timeout_;
  std::unique_ptr<Impl> impl_;  // null when world_size == 1
};

// Every rank's text, on every rank, in rank order (one length all-gather, one byte all-gather);
// `comm` may be a single rank.
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine);

}  // namespace memrt
