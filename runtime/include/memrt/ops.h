// memrt/ops.h — the model's matrix products and activations, run the fastest way this processor
// allows.
//
// LibTorch runs a 16-bit GEMM on the CPU through oneDNN only where oneDNN has instructions for
// that dtype: fp16 needs AVX512-FP16 or AMX-FP16 (or AVX2-VNNI-2), bf16 needs AVX-512 (or
// AVX2-VNNI-2). Elsewhere — fp16 on an AMD Zen 4, for one — the same call falls into a scalar
// loop some 100x slower than fp32. memrt decides once per process, from the processor's flags and
// oneDNN's ISA cap (ONEDNN_MAX_CPU_ISA), which path each dtype takes:
//
//   kNative          LibTorch's own kernel for the dtype (always on CUDA).
//   kFp32Arithmetic  fp32 GEMM (MKL) on the 16-bit tensors, converted a block at a time into a
//                    per-thread scratch; inputs, outputs, saved activations and gradients stay
//                    16-bit, so the memory a step keeps and DeepSpeed's fp16/bf16 semantics do
//                    not change. Also bf16 on an Intel processor without AMX, where MKL's fp32
//                    GEMM outruns oneDNN's bf16 one.
//
// Models and plugins that replace a projection (LoRA, quantized linears) call these instead of
// at::linear / at::scaled_dot_product_attention; in fp32 they are exactly those.
#pragma once

#include <string>

#include <ATen/ATen.h>

namespace memrt::ops {

enum class MatmulPath { kNative, kFp32Arithmetic };
const char* to_string(MatmulPath path);

// The path GEMMs of `dtype` take on `device` in this process (fixed at first use).
MatmulPath matmul_path(at::ScalarType dtype, at::Device device = at::kCPU);

// y = x W^T + b, as at::linear. x (..., in), weight (out, in), bias (out) or undefined.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias = {});

// The same product written into `y` (M, out; any strides, x's dtype), for kernels that fill an
// output a tile at a time (plugins/quant's 4-bit linear): x (M, in), weight (out, in) of any
// strides, no autograd. Natively at::(add)mm_out; on the fp32 path it allocates nothing the memory
// report counts (its blocks are a per-thread scratch, like the BLAS's packing buffers).
void linear_into(const at::Tensor& y, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias = {});

// Causal scaled-dot-product attention with 1/sqrt(head_dim) scaling, as
// at::scaled_dot_product_attention(q, k, v, {}, dropout_p, /*is_causal=*/true, {}, gqa).
// q (B, H, T, D); k, v (B, H_kv, T, D) with H a multiple of H_kv (grouped-query attention).
// ABI 2.21: `positions` (B, T) int64, a packed layout's (docs/attention.md, "Packed rows"): each
// token's position in its sample, 0 at a sample's first token and one more at each next; token t
// attends to keys t - positions[b, t] .. t only, as flash-attention's variable-length kernels and
// transformers' position_ids packing compute it. Undefined: one sample per row.
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double dropout_p, const at::Tensor& positions = {});

// The causal LM's loss summed over tokens without the (N, V) logits ever held whole, as
// at::cross_entropy_loss(at::linear(x, weight).to(at::kFloat), targets, {}, Sum, ignore_index)
// computes it: x (N, C) and weight (V, C) of one floating dtype on the CPU, targets (N) int64 in
// [0, V) or ignore_index (those rows add nothing). Rows go a chunk at a time (32 MiB of fp32
// logits, at least 64 rows): the chunk's logits in x's dtype (rounded as at::linear rounds them),
// log-softmax in fp32, and — the loss being the graph's last node — the chunk's gradients with
// respect to x and weight at once, so backward only scales them by its incoming scalar. It keeps
// those two gradients (N x C and V x C, for the inputs that require one) from forward to backward,
// never logits. Returns an fp32 scalar.
at::Tensor linear_cross_entropy_sum(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets,
                                    int64_t ignore_index = -100);
// The rows of each chunk it takes for `rows` tokens and a vocabulary of `vocab` (the last chunk
// may be shorter); a chunk holds rows x vocab logits in x's dtype, and again in fp32 for 16 bits.
int64_t linear_cross_entropy_chunk_rows(int64_t rows, int64_t vocab);

// GPT-2's GELU, the tanh approximation: as at::gelu(x, "tanh"). On contiguous fp32 CPU tensors it
// is one fused pass forward and one backward (x / (1 + e^(-2u)), no tanh: about twice LibTorch's
// speed on a Zen 4, within a few ulp of the exact function where LibTorch's 1 + tanh cancels);
// elsewhere it is at::gelu. Saves x for backward, as at::gelu does.
at::Tensor gelu_tanh(const at::Tensor& x);

// The instruction sets of memrt's hand-written CPU kernels (the optimizer step's, plugins/quant's
// dequantization), picked at run time: kBest is the widest this processor runs, kPortable the
// compiler's loops. Every kernel gives the portable loop's bits; tests hold each to it.
enum class CpuKernels { kBest, kAvx512, kAvx2, kPortable };
// kAvx512: AVX-512F; kAvx2: AVX2 and F16C; kBest and kPortable: always.
bool cpu_supports(CpuKernels kernels);
const char* to_string(CpuKernels kernels);  // "best", "AVX-512F", "AVX2+F16C", "portable"

// One line for the start of a run: the processor, the ISA ATen's kernels use, the BLAS, and the
// path fp32/bf16/fp16 matrix products take, so that a slow machine explains itself.
std::string describe_cpu_math();

}  // namespace memrt::ops
