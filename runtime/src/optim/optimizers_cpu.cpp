// The CPU loops of the optimizers and of the fused step (fused_adam.h): at::parallel_for over
// chunks, each chunk a plain loop over restrict pointers that the compiler vectorises. Each chunk
// function is compiled for AVX-512, AVX2 and baseline x86-64 and picked at load time (GCC
// target_clones), so one binary runs anywhere and uses the widest vectors the processor has. This
// file is built with -O3, -fno-math-errno (lets sqrtf vectorise) and -ffp-contract=off (no FMA
// contraction), so every variant computes exactly the scalar math of optimizer_math.h.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "memrt/error.h"
#include "optim/cpu_loops.h"
#include "optim/fused_adam.h"
#include "optim/optimizer_math.h"

namespace memrt {

namespace {

MEMRT_SIMD_CLONES void adam_chunk(float* __restrict__ p, const float* __restrict__ g,
                                  float* __restrict__ m, float* __restrict__ v, int64_t n,
                                  AdamScalars s) {
  for (int64_t i = 0; i < n; ++i) adam_update(p[i], g[i], m[i], v[i], s);
}

MEMRT_SIMD_CLONES void sgd_chunk(float* __restrict__ p, const float* __restrict__ g,
                                 float* __restrict__ buf, int64_t n, SgdScalars s) {
  for (int64_t i = 0; i < n; ++i) sgd_update(p[i], g[i], buf[i], s);
}

MEMRT_SIMD_CLONES void sgd_chunk_no_momentum(float* __restrict__ p, const float* __restrict__ g,
                                             int64_t n, SgdScalars s) {
  for (int64_t i = 0; i < n; ++i) {
    float unused = 0.f;
    sgd_update(p[i], g[i], unused, s);
  }
}

// ---- the fused step -----------------------------------------------------------------------------

// Widening to fp32: fp16 through the branch-free conversion (the same bits as c10::Half's, which
// keeps a loop scalar), the others through their own.
template <typename T>
inline float widen(T x) {
  return static_cast<float>(x);
}
template <>
inline float widen<c10::Half>(c10::Half x) {
  return float_from_fp16_bits(x.x);
}

// Narrowing to the compute dtype, likewise.
template <typename C>
inline C narrow(float x) {
  return static_cast<C>(x);
}
template <>
inline c10::Half narrow<c10::Half>(float x) {
  return c10::Half(fp16_bits_from_float(x), c10::Half::from_bits());
}

// One element of pass 2. P: the value Adam updates (the master, or the fp32 compute copy).
template <typename C, typename G, bool kMaster>
inline void fused_adam_element(float* master, C* compute, const G* grad, float* m, float* v,
                               int64_t i, const AdamScalars& s, float factor) {
  float p;
  if constexpr (kMaster) {
    p = master[i];
  } else {
    p = widen(compute[i]);
  }
  adam_update(p, widen(grad[i]) * factor, m[i], v[i], s);
  if constexpr (kMaster) master[i] = p;
  compute[i] = narrow<C>(p);
}

#define MEMRT_FUSED_ADAM_CHUNK(NAME, C, G, MASTER)                                                \
  MEMRT_SIMD_CLONES void NAME(float* __restrict__ master, C* __restrict__ compute,               \
                              const G* __restrict__ grad, float* __restrict__ m,                 \
                              float* __restrict__ v, int64_t n, AdamScalars s, float factor) {   \
    for (int64_t i = 0; i < n; ++i)                                                              \
      fused_adam_element<C, G, MASTER>(master, compute, grad, m, v, i, s, factor);               \
  }
MEMRT_FUSED_ADAM_CHUNK(fused_fp32, float, float, false)
MEMRT_FUSED_ADAM_CHUNK(fused_bf16, c10::BFloat16, c10::BFloat16, true)
MEMRT_FUSED_ADAM_CHUNK(fused_bf16_fp32_grad, c10::BFloat16, float, true)
MEMRT_FUSED_ADAM_CHUNK(fused_fp16, c10::Half, c10::Half, true)
MEMRT_FUSED_ADAM_CHUNK(fused_fp16_fp32_grad, c10::Half, float, true)
#undef MEMRT_FUSED_ADAM_CHUNK

// Pass 1 over one block: kLanes independent double sums (lane l takes elements l, l + kLanes,
// ...), so a vector unit computes exactly what the scalar loop does; then the lanes in order.
constexpr int kLanes = 16;

#define MEMRT_GRAD_STATS_CHUNK(NAME, G)                                                          \
  MEMRT_SIMD_CLONES GradStats NAME(const G* __restrict__ grad, int64_t n) {                      \
    double lanes[kLanes] = {};                                                                   \
    int64_t i = 0;                                                                               \
    for (; i + kLanes <= n; i += kLanes) {                                                       \
      for (int l = 0; l < kLanes; ++l) {                                                         \
        const double x = widen(grad[i + l]);                                                     \
        lanes[l] += x * x;                                                                       \
      }                                                                                          \
    }                                                                                            \
    for (int l = 0; i < n; ++i, ++l) {                                                           \
      const double x = widen(grad[i]);                                                           \
      lanes[l] += x * x;                                                                         \
    }                                                                                            \
    GradStats out;                                                                               \
    for (double lane : lanes) out.sum_squares += lane;                                           \
    /* Squares of finite fp32 values cannot overflow a double sum, and an inf or NaN makes */    \
    /* it inf or NaN: the sum is finite exactly when every value is. */                          \
    out.finite = std::isfinite(out.sum_squares);                                                 \
    return out;                                                                                  \
  }
MEMRT_GRAD_STATS_CHUNK(stats_fp32, float)
MEMRT_GRAD_STATS_CHUNK(stats_bf16, c10::BFloat16)
MEMRT_GRAD_STATS_CHUNK(stats_fp16, c10::Half)
#undef MEMRT_GRAD_STATS_CHUNK

}  // namespace

GradStats grad_stats_cpu(const void* grad, at::ScalarType type, int64_t n) {
  if (type != at::kFloat && type != at::kBFloat16 && type != at::kHalf) {
    throw Error(std::string("gradient statistics: no kernel for ") + c10::toString(type) +
                " gradients (Float, BFloat16 or Half)");
  }
  // Fixed blocks, whatever the thread count; their results are combined in block order.
  const int64_t blocks = (n + kCpuLoopGrain - 1) / kCpuLoopGrain;
  std::vector<GradStats> partial(static_cast<size_t>(blocks));
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t begin = b * kCpuLoopGrain, len = std::min(kCpuLoopGrain, n - begin);
      GradStats& out = partial[static_cast<size_t>(b)];
      if (type == at::kBFloat16) {
        out = stats_bf16(static_cast<const c10::BFloat16*>(grad) + begin, len);
      } else if (type == at::kHalf) {
        out = stats_fp16(static_cast<const c10::Half*>(grad) + begin, len);
      } else {
        out = stats_fp32(static_cast<const float*>(grad) + begin, len);
      }
    }
  });
  GradStats total;
  for (const GradStats& p : partial) {
    total.sum_squares += p.sum_squares;
    total.finite = total.finite && p.finite;
  }
  return total;
}

void fused_adam_cpu(const AdamRange& r, const AdamScalars& s, float factor) {
  using BF = c10::BFloat16;
  using H = c10::Half;
  auto run = [&](auto chunk, auto* compute, const auto* grad) {
    at::parallel_for(0, r.n, kCpuLoopGrain, [&](int64_t begin, int64_t end) {
      chunk(r.master ? r.master + begin : nullptr, compute + begin, grad + begin, r.exp_avg + begin,
            r.exp_avg_sq + begin, end - begin, s, factor);
    });
  };
  const bool master = r.master != nullptr;
  const at::ScalarType c = r.compute_type, g = r.grad_type;
  if (!master && c == at::kFloat && g == at::kFloat) {
    run(fused_fp32, static_cast<float*>(r.compute), static_cast<const float*>(r.grad));
  } else if (master && c == at::kBFloat16 && g == at::kBFloat16) {
    run(fused_bf16, static_cast<BF*>(r.compute), static_cast<const BF*>(r.grad));
  } else if (master && c == at::kBFloat16 && g == at::kFloat) {
    run(fused_bf16_fp32_grad, static_cast<BF*>(r.compute), static_cast<const float*>(r.grad));
  } else if (master && c == at::kHalf && g == at::kHalf) {
    run(fused_fp16, static_cast<H*>(r.compute), static_cast<const H*>(r.grad));
  } else if (master && c == at::kHalf && g == at::kFloat) {
    run(fused_fp16_fp32_grad, static_cast<H*>(r.compute), static_cast<const float*>(r.grad));
  } else {
    throw Error(std::string("fused Adam step: no kernel for compute ") + c10::toString(c) +
                ", gradient " + c10::toString(g) + (master ? ", with" : ", without") +
                " an fp32 master (it takes Float without a master, or BFloat16/Half with one and a "
                "gradient of the compute dtype or Float)");
  }
}

void adam_update_cpu(float* p, const float* g, float* m, float* v, int64_t n,
                     const AdamScalars& s) {
  at::parallel_for(0, n, kCpuLoopGrain, [&](int64_t begin, int64_t end) {
    adam_chunk(p + begin, g + begin, m + begin, v + begin, end - begin, s);
  });
}

void sgd_update_cpu(float* p, const float* g, float* buf, int64_t n, const SgdScalars& s) {
  at::parallel_for(0, n, kCpuLoopGrain, [&](int64_t begin, int64_t end) {
    if (s.momentum == 0.f)
      sgd_chunk_no_momentum(p + begin, g + begin, end - begin, s);
    else
      sgd_chunk(p + begin, g + begin, buf + begin, end - begin, s);
  });
}

}  // namespace memrt
