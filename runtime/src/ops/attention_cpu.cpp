// Causal attention on the CPU (attention_cpu.h, docs/attention.md). The tile loops are one source,
// attention_tile.inc, compiled per instruction set; this file gathers each head into fp32 rows
// (and K, V transposed into zero-padded panels), runs them over ATen's threads one key/value head
// group per task, and rounds the results into the caller's tensors once.
#include "ops/attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "memrt/error.h"
#include "ops/activation_math.h"

namespace memrt::ops {
namespace {

constexpr int64_t kTile = 64;  // query rows and keys per tile: a 64 x 64 fp32 tile is 16 KiB

// e^x of a softmax argument (x <= 0): activation_math.h's exp_clamped, and exactly 0 below its
// range, so a masked score (-inf) adds nothing and no subnormal reaches the tile products. Inlined
// into each instruction set's loops, which the compiler vectorises.
inline float softmax_exp(float x) { return x < -87.3365448f ? 0.f : exp_clamped(x); }

using HeadForward = void (*)(const float*, const float*, const float*, const int64_t*, int64_t, int64_t, int64_t,
                             float, float*, float*, float*);
using HeadBackward = void (*)(const float*, const float*, const float*, const float*, const float*, const float*,
                              const float*, const int64_t*, int64_t, int64_t, int64_t, float, float*, float*, float*,
                              float*, float*);
struct Kernels {
  HeadForward forward;
  HeadBackward backward;
};

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
namespace avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,prefer-vector-width=512")
constexpr int kLanes = 16, kMr = 6, kNv = 4;  // 24 accumulators of 32 zmm registers
typedef float Vec __attribute__((vector_size(64)));
#include "ops/attention_tile.inc"
#pragma GCC pop_options
}  // namespace avx512

namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma")
constexpr int kLanes = 8, kMr = 6, kNv = 2;  // 12 accumulators of 16 ymm registers
typedef float Vec __attribute__((vector_size(32)));
#include "ops/attention_tile.inc"
#pragma GCC pop_options
}  // namespace avx2
#endif

namespace portable {
constexpr int kLanes = 4, kMr = 6, kNv = 2;  // SSE2's 16 xmm registers; no FMA
typedef float Vec __attribute__((vector_size(16)));
#include "ops/attention_tile.inc"
}  // namespace portable

Kernels kernels_for(CpuKernels which) {
  if (!cpu_supports(which))
    throw Error(std::string("causal attention: this processor cannot run the ") + to_string(which) + " kernels");
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  if (which == CpuKernels::kAvx512 || (which == CpuKernels::kBest && cpu_supports(CpuKernels::kAvx512)))
    return {&avx512::forward_head, &avx512::backward_head};
  if (which == CpuKernels::kAvx2 || (which == CpuKernels::kBest && cpu_supports(CpuKernels::kAvx2)))
    return {&avx2::forward_head, &avx2::backward_head};
#endif
  return {&portable::forward_head, &portable::backward_head};
}

// One head of a (B, H, T, D) tensor with a unit last stride: row t at data + t * row_stride.
template <typename T>
struct Head {
  T* data;
  int64_t row_stride;
};

template <typename T>
Head<T> head(const at::Tensor& x, int64_t b, int64_t h) {
  return {static_cast<T*>(x.data_ptr()) + b * x.stride(0) + h * x.stride(1), x.stride(2)};
}

template <typename T>
void gather_rows(Head<const T> x, int64_t rows, int64_t D, float* out) {  // out (rows x D)
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t d = 0; d < D; ++d) out[t * D + d] = static_cast<float>(x.data[t * x.row_stride + d]);
}

template <typename T>
void gather_transposed(Head<const T> x, int64_t rows, int64_t D, int64_t tp, float* out) {  // out (D x tp)
  for (int64_t d = 0; d < D; ++d) std::fill(out + d * tp + rows, out + (d + 1) * tp, 0.f);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t d = 0; d < D; ++d) out[d * tp + t] = static_cast<float>(x.data[t * x.row_stride + d]);
}

template <typename T>
void scatter_rows(const float* in, int64_t rows, int64_t D, Head<T> x) {  // one rounding per element
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t d = 0; d < D; ++d) x.data[t * x.row_stride + d] = static_cast<T>(in[t * D + d]);
}

// Per-thread fp32 scratch outside the allocator, grown as needed and kept for the next call.
float* scratch(size_t floats) {
  thread_local std::vector<float> storage;
  if (storage.size() < floats) {
    storage.clear();
    storage.shrink_to_fit();
    storage.resize(floats);
  }
  return storage.data();
}

struct Dims {
  int64_t B, H, Hkv, T, D, tp;
  float scale;
};

Dims dims(const at::Tensor& q, const at::Tensor& k) {
  const int64_t T = q.size(2), D = q.size(3);
  return {q.size(0), q.size(1), k.size(1), T, D, (T + kTile - 1) / kTile * kTile,
          static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)))};
}

// Row b of a packed layout's positions (B, T), or nullptr: one sample per row.
const int64_t* row_positions(const at::Tensor& positions, int64_t b) {
  return positions.defined() ? positions.data_ptr<int64_t>() + b * positions.size(1) : nullptr;
}

template <typename T>
void forward_typed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                   const at::Tensor& out, const at::Tensor& lse, Kernels kernels) {
  const Dims n = dims(q, k);
  const int64_t group = n.H / n.Hkv, rows = n.T * n.D, panel = n.D * n.tp;
  at::parallel_for(0, n.B * n.Hkv, 1, [&](int64_t begin, int64_t end) {
    float* const kt = scratch(static_cast<size_t>(4 * rows + panel + kTile * kTile));
    float *const vr = kt + panel, *const qr = vr + rows, *const o = qr + rows, *const s = o + rows;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / n.Hkv, hk = task % n.Hkv;
      gather_transposed(head<const T>(k, b, hk), n.T, n.D, n.tp, kt);
      gather_rows(head<const T>(v, b, hk), n.T, n.D, vr);
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        gather_rows(head<const T>(q, b, h), n.T, n.D, qr);
        kernels.forward(qr, kt, vr, row_positions(positions, b), n.T, n.tp, n.D, n.scale, o,
                        lse.data_ptr<float>() + (b * n.H + h) * n.T, s);
        scatter_rows(o, n.T, n.D, head<T>(out, b, h));
      }
    }
  });
}

template <typename T>
void backward_typed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dout, const at::Tensor& dq,
                    const at::Tensor& dk, const at::Tensor& dv, Kernels kernels) {
  const Dims n = dims(q, k);
  const int64_t group = n.H / n.Hkv, rows = n.T * n.D, panel = n.D * n.tp;
  at::parallel_for(0, n.B * n.Hkv, 1, [&](int64_t begin, int64_t end) {
    float* const kt = scratch(static_cast<size_t>(2 * panel + 7 * rows + 2 * n.T + 2 * kTile * kTile));
    float *const vt = kt + panel, *const kr = vt + panel, *const qr = kr + rows, *const dor = qr + rows;
    float *const outr = dor + rows, *const dqr = outr + rows, *const dkr = dqr + rows, *const dvr = dkr + rows;
    float *const delta = dvr + rows, *const p = delta + n.T, *const ds = p + kTile * kTile;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / n.Hkv, hk = task % n.Hkv;
      gather_transposed(head<const T>(k, b, hk), n.T, n.D, n.tp, kt);
      gather_transposed(head<const T>(v, b, hk), n.T, n.D, n.tp, vt);
      gather_rows(head<const T>(k, b, hk), n.T, n.D, kr);
      std::fill(dkr, dkr + 2 * rows, 0.f);  // dk and dv: the group's sums
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        gather_rows(head<const T>(q, b, h), n.T, n.D, qr);
        gather_rows(head<const T>(dout, b, h), n.T, n.D, dor);
        gather_rows(head<const T>(out, b, h), n.T, n.D, outr);
        for (int64_t t = 0; t < n.T; ++t) {
          float sum = 0.f;
          for (int64_t d = 0; d < n.D; ++d) sum += dor[t * n.D + d] * outr[t * n.D + d];
          delta[t] = sum;
        }
        kernels.backward(qr, kr, kt, vt, dor, delta, lse.data_ptr<float>() + (b * n.H + h) * n.T,
                         row_positions(positions, b), n.T, n.tp, n.D, n.scale, dqr, dkr, dvr, p, ds);
        scatter_rows(dqr, n.T, n.D, head<T>(dq, b, h));
      }
      scatter_rows(dkr, n.T, n.D, head<T>(dk, b, hk));
      scatter_rows(dvr, n.T, n.D, head<T>(dv, b, hk));
    }
  });
}

// Calls f with a value of the element type of `dtype` (fp32, bf16 or fp16).
template <typename F>
void by_dtype(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    default: throw Error(std::string("causal attention: no CPU kernel for ") + c10::toString(dtype));
  }
}

// What both directions need of their tensors beyond causal_attention_cpu_takes: `sized` of q's
// sizes and dtype with a unit last stride, the log-sum-exp (B, H, T) fp32 contiguous.
void check_operands(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                    const at::Tensor& lse, std::initializer_list<const at::Tensor*> sized) {
  check_packed_positions(positions, q.size(0), q.size(2));
  if (!causal_attention_cpu_takes(q, k, v))
    throw Error("causal attention: the CPU kernel does not take q " + c10::str(q.sizes(), " ", q.scalar_type()) +
                ", k " + c10::str(k.sizes()) + ", v " + c10::str(v.sizes()) +
                " (causal_attention_cpu_takes says what it does)");
  if (lse.scalar_type() != at::kFloat || !lse.is_contiguous() || lse.sizes() != q.sizes().slice(0, 3))
    throw Error("causal attention: the log-sum-exp must be contiguous fp32 of q's (B, H, T) " +
                c10::str(q.sizes().slice(0, 3)) + ", got " + c10::str(lse.sizes(), " ", lse.scalar_type()));
  for (const at::Tensor* t : sized)
    if (t->sizes() != q.sizes() || t->scalar_type() != q.scalar_type() || t->stride(3) != 1 || !t->device().is_cpu())
      throw Error("causal attention: an output or gradient of q's sizes and dtype with a unit last stride is " +
                  c10::str(t->sizes(), " ", t->scalar_type()) + " with strides " + c10::str(t->strides()));
}

}  // namespace

void check_packed_positions(const at::Tensor& positions, int64_t B, int64_t T) {
  if (!positions.defined()) return;
  if (positions.scalar_type() != at::kLong || !positions.device().is_cpu() || !positions.is_contiguous() ||
      positions.dim() != 2 || positions.size(0) != B || positions.size(1) != T)
    throw Error("causal attention: a packed layout's positions must be contiguous int64 (B, T) = (" +
                std::to_string(B) + ", " + std::to_string(T) + ") on the CPU, got " +
                c10::str(positions.sizes(), " ", positions.scalar_type(), " on ", positions.device()));
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t p = pos[b * T + t], before = t ? pos[b * T + t - 1] : -1;
      if (p != 0 && p != before + 1)
        throw Error("causal attention: packed positions[" + std::to_string(b) + ", " + std::to_string(t) + "] is " +
                    std::to_string(p) + "; each row's positions count 0, 1, ... within each sample, so it must be 0 " +
                    "(a sample's first token)" + (t ? " or " + std::to_string(before + 1) : std::string()));
    }
}

bool causal_attention_cpu_takes(at::ScalarType dtype, int64_t head_dim) {
  return (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) && head_dim > 0 &&
         head_dim % 16 == 0 && head_dim <= 256;
}

bool causal_attention_cpu_takes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const at::ScalarType dtype = q.scalar_type();
  for (const at::Tensor* x : {&q, &k, &v})
    if (!x->device().is_cpu() || x->scalar_type() != dtype || x->dim() != 4 || x->stride(3) != 1) return false;
  const int64_t D = q.size(3);
  return causal_attention_cpu_takes(dtype, D) && k.sizes() == v.sizes() && k.size(0) == q.size(0) &&
         k.size(2) == q.size(2) && k.size(3) == D && k.size(1) > 0 && q.size(1) % k.size(1) == 0;
}

void causal_attention_forward_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& positions, const at::Tensor& out, const at::Tensor& lse,
                                  CpuKernels kernels) {
  check_operands(q, k, v, positions, lse, {&out});
  const Kernels run = kernels_for(kernels);
  by_dtype(q.scalar_type(), [&](auto element) { forward_typed<decltype(element)>(q, k, v, positions, out, lse, run); });
}

void causal_attention_backward_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& positions, const at::Tensor& out, const at::Tensor& lse,
                                   const at::Tensor& dout, const at::Tensor& dq, const at::Tensor& dk,
                                   const at::Tensor& dv, CpuKernels kernels) {
  check_operands(q, k, v, positions, lse, {&out, &dout, &dq});
  for (const at::Tensor* t : {&dk, &dv})
    if (t->sizes() != k.sizes() || t->scalar_type() != k.scalar_type() || t->stride(3) != 1)
      throw Error("causal attention: dk and dv must have k's sizes and dtype and a unit last stride, got " +
                  c10::str(t->sizes(), " ", t->scalar_type()));
  const Kernels run = kernels_for(kernels);
  by_dtype(q.scalar_type(), [&](auto element) {
    backward_typed<decltype(element)>(q, k, v, positions, out, lse, dout, dq, dk, dv, run);
  });
}

}  // namespace memrt::ops
