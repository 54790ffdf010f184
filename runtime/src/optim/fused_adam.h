// The fused optimizer step over one contiguous range of a parameter group (docs/parameter-store.md,
// "The step"): pass 1 reads the gradient once for the global norm and the overflow check; pass 2
// is one read-modify-write per element — the gradient unscaled and clipped by one factor,
// adam_update() (optimizer_math.h) on the fp32 master, and the 16-bit compute copy written back.
// Both passes run every element through the same scalar code, compiled for AVX-512, AVX2 and
// baseline x86-64 (picked at load time); with a master, pass 2 has hand-written AVX-512F and
// AVX2+F16C kernels of the same operations too. Every variant gives the scalar reference's bits.
#pragma once

#include <cstdint>

#include <c10/core/ScalarType.h>

#include "memrt/ops.h"
#include "optim/optimizer_math.h"

namespace at {
class Tensor;
}

namespace memrt {

// n elements of each buffer; the 16-bit ones are at::kBFloat16 or at::kHalf. 16-bit values widen
// exactly to fp32; fp32 values are rounded to nearest-even when written to 16 bits, as LibTorch's
// conversions do. With a master, the compute copy is 16-bit and the gradient is either
// the compute dtype or fp32 (DeepSpeed's data_types.grad_accum_dtype); without one, the compute
// copy is fp32, is the value Adam updates, and the gradient is fp32.
//
// Two more layouts run one portable loop (the same adam_update(), in the same order): Adam's
// moments in bf16 (DeepSpeed's bf16_optimizer_states: widened exactly, rounded to nearest-even
// after the update), and a bf16 compute copy updated without a master (DeepSpeed's
// bf16_master_weights_and_grads), rounded to nearest-even or, with `stochastic_round`, as
// torchao's bf16_stochastic_round does, with random_bits16(seed, first + i) for element i.
struct AdamRange {
  float* master = nullptr;
  void* compute = nullptr;
  at::ScalarType compute_type = at::kFloat;
  const void* grad = nullptr;
  at::ScalarType grad_type = at::kFloat;
  void* exp_avg = nullptr;  // state_type elements
  void* exp_avg_sq = nullptr;
  at::ScalarType state_type = at::kFloat;  // Float or BFloat16
  int64_t n = 0;
  bool stochastic_round = false;  // bf16 compute without a master only
  uint64_t seed = 0;
  int64_t first = 0;  // the range's first element in the numbering the draws use
};

// The range over whole contiguous tensors of n elements each (master undefined: none).
AdamRange adam_range(const at::Tensor& master, const at::Tensor& compute, const at::Tensor& grad,
                     const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq);

struct GradStats {
  double sum_squares = 0.0;  // of the gradient as stored (before any unscaling)
  bool finite = true;        // no inf or NaN among the n values
};

// Pass 1. The sum runs in double over fixed blocks of the range, combined in a fixed order: the
// result depends on n and the values only, not on the ISA or the number of threads.
GradStats grad_stats_cpu(const void* grad, at::ScalarType type, int64_t n);

// Pass 2: for each element, g = grad * grad_factor (1 / (loss scale * clip coefficient)), then
// adam_update(p, g, m, v, s) on the master (or the fp32 compute copy), then the compute copy
// written back. `kernels` (memrt/ops.h): with a master, hand-written AVX-512F or AVX2+F16C kernels
// or the portable loops (the compiler's vectorisation for AVX-512, AVX2 and baseline x86-64), all
// giving the same bits (tests hold each to the scalar reference); without one, always the portable
// loop. Throws memrt::Error for a combination the step does not take, or kernels this processor
// cannot run.
void fused_adam_cpu(const AdamRange& range, const AdamScalars& s, float grad_factor,
                    ops::CpuKernels kernels = ops::CpuKernels::kBest);

// Pass 2 on a CUDA device (builds with MEMRT_BUILD_CUDA only): one thread per element, the same
// adam_update() and conversions (optimizer_math.h), on `stream` (a cudaStream_t).
void fused_adam_cuda(const AdamRange& range, const AdamScalars& s, float grad_factor, void* stream);

}  // namespace memrt
