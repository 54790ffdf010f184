// memrt's causal attention on the CPU (docs/attention.md): a flash-attention kernel whose tile
// products are register-blocked micro-kernels, compiled for AVX-512, AVX2+FMA and baseline x86-64
// and picked at run time. Inputs of any float dtype are computed in fp32 and rounded once.
#pragma once

#include <cstdint>

#include <ATen/ATen.h>

#include "memrt/ops.h"

namespace memrt::ops {

// Whether the kernel takes these inputs: CPU tensors of one dtype (fp32, bf16 or fp16), q (B, H,
// T, D) and k, v (B, H_kv, T, D) with H a multiple of H_kv, D a multiple of 16 up to 256, and a
// unit last stride (the other strides are free: the models pass views of one projection).
bool causal_attention_cpu_takes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);
// Whether it takes CPU inputs of this dtype and head size (laid out as above): what the activation
// estimate asks (docs/memory.md, "Packed rows").
bool causal_attention_cpu_takes(at::ScalarType dtype, int64_t head_dim);

// Throws an Error unless `positions` is undefined (one sample per row) or a packed layout's
// positions (docs/attention.md, "Packed rows"): (B, T) int64, contiguous on the CPU, each row
// starting at 0 and each next entry 0 (a sample's first token) or the one before + 1.
void check_packed_positions(const at::Tensor& positions, int64_t B, int64_t T);

// Forward: writes `out` (q's sizes and dtype, any strides with a unit last one) and `lse` (B, H,
// T) fp32 contiguous, the log-sum-exp of each row's scaled scores, as LibTorch's flash kernel
// saves it. `positions` undefined: causal attention over each whole row; else a packed layout's
// (check_packed_positions): token t of row b attends to keys t - positions[b, t] .. t only.
void causal_attention_forward_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& positions, const at::Tensor& out, const at::Tensor& lse,
                                  CpuKernels kernels = CpuKernels::kBest);

// Backward from the forward's q, k, v, positions, out, lse and the output's gradient: writes dq,
// dk, dv (their inputs' sizes and dtype). A key/value head's gradients sum its query heads' in fp32.
void causal_attention_backward_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& positions, const at::Tensor& out, const at::Tensor& lse,
                                   const at::Tensor& dout, const at::Tensor& dq, const at::Tensor& dk,
                                   const at::Tensor& dv, CpuKernels kernels = CpuKernels::kBest);

}  // namespace memrt::ops
