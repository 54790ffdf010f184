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
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MEMRT_AVX512_KERNELS 1
#include <immintrin.h>
#endif

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

#if MEMRT_AVX512_KERNELS
// ---- the mixed-precision step in AVX-512F --------------------------------------------------------
// GCC vectorises the 16-bit loops above at most 8 lanes wide, each conversion several
// instructions: on an AMD EPYC Zen 4 they took about twice the fp32 loop's time per element in
// cache, and no longer hid under the memory traffic. These take 16 lanes, widen and narrow fp16 with the
// processor's IEEE conversions and bf16 with the scalar code's integer rounding, and do
// adam_update()'s operations in its order without FMA: the scalar reference's bits, as the
// portable loops give (tests/data/test_fused_adam.cpp holds both to it).
#define MEMRT_AVX512 __attribute__((target("avx512f")))
// GCC 12 warns inside its own AVX-512 headers (their _mm512_undefined_* placeholders, GCC PR
// 105593, fixed in GCC 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace avx512 {

struct Scalars {
  __m512 beta1, one_minus_beta1, beta2, one_minus_beta2, eps, l2, decay, step_size, bc2_rsqrt, factor;
};

MEMRT_AVX512 inline Scalars broadcast(const AdamScalars& s, float factor) {
  return {_mm512_set1_ps(s.beta1), _mm512_set1_ps(1.f - s.beta1), _mm512_set1_ps(s.beta2),
          _mm512_set1_ps(1.f - s.beta2), _mm512_set1_ps(s.eps), _mm512_set1_ps(s.l2),
          _mm512_set1_ps(s.decay), _mm512_set1_ps(s.step_size), _mm512_set1_ps(s.bc2_rsqrt),
          _mm512_set1_ps(factor)};
}

// adam_update() (optimizer_math.h) on 16 lanes.
MEMRT_AVX512 inline void adam_update(__m512& p, __m512 g, __m512& m, __m512& v, const Scalars& s) {
  g = _mm512_add_ps(g, _mm512_mul_ps(s.l2, p));
  m = _mm512_add_ps(_mm512_mul_ps(s.beta1, m), _mm512_mul_ps(s.one_minus_beta1, g));
  v = _mm512_add_ps(_mm512_mul_ps(s.beta2, v), _mm512_mul_ps(s.one_minus_beta2, _mm512_mul_ps(g, g)));
  const __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(v), s.bc2_rsqrt), s.eps);
  p = _mm512_sub_ps(p, _mm512_mul_ps(s.decay, p));
  p = _mm512_sub_ps(p, _mm512_mul_ps(s.step_size, _mm512_div_ps(m, denom)));
}

MEMRT_AVX512 inline __m256i load16(const void* x) { return _mm256_loadu_si256(static_cast<const __m256i*>(x)); }

MEMRT_AVX512 inline __m512 widen(const float* x) { return _mm512_loadu_ps(x); }
MEMRT_AVX512 inline __m512 widen(const c10::BFloat16* x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load16(x)), 16));
}
// Exact, and a NaN comes out quiet with its payload, as float_from_fp16_bits() gives.
MEMRT_AVX512 inline __m512 widen(const c10::Half* x) { return _mm512_cvtph_ps(load16(x)); }

// bf16_bits_from_float(): round to nearest-even on the bits; a NaN becomes 0x7fc0.
MEMRT_AVX512 inline __m256i narrow(const c10::BFloat16*, __m512 f) {
  const __m512i bits = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i h = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  h = _mm512_mask_mov_epi32(h, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(h);
}
// fp16_bits_from_float(): vcvtps2ph rounds to nearest-even as it does, but keeps the top of a
// NaN's payload, where every NaN becomes sign | 0x7e00: NaN lanes become their sign's quiet NaN
// (0x7fc00000, which converts to 0x7e00) first.
MEMRT_AVX512 inline __m256i narrow(const c10::Half*, __m512 f) {
  const __m512i quiet = _mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(f), _mm512_set1_epi32(INT32_MIN)),
                                        _mm512_set1_epi32(0x7fc00000));
  f = _mm512_mask_mov_ps(f, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_castsi512_ps(quiet));
  return _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// Pass 2 with a master, 16 lanes at a time. The compute copy is only written, and an ordinary store
// first reads each of its lines (30 bytes of traffic per parameter instead of 28): it is written
// with non-temporal stores from its first 32-byte boundary on. (They leave it out of the cache,
// which costs the next forward something only for a model small enough to be cheap to read.)
// The elements before that boundary and the tail go through the scalar element.
template <typename C, typename G>
MEMRT_AVX512 void fused_mixed(float* __restrict__ master, C* __restrict__ compute, const G* __restrict__ grad,
                              float* __restrict__ m, float* __restrict__ v, int64_t n, AdamScalars s, float factor) {
  const Scalars vs = broadcast(s, factor);
  int64_t i = 0;
  for (; i < n && reinterpret_cast<uintptr_t>(compute + i) % 32 != 0; ++i)
    fused_adam_element<C, G, true>(master, compute, grad, m, v, i, s, factor);
  for (; i + 16 <= n; i += 16) {
    __m512 p = _mm512_loadu_ps(master + i), mi = _mm512_loadu_ps(m + i), vi = _mm512_loadu_ps(v + i);
    adam_update(p, _mm512_mul_ps(widen(grad + i), vs.factor), mi, vi, vs);
    _mm512_storeu_ps(master + i, p);
    _mm512_storeu_ps(m + i, mi);
    _mm512_storeu_ps(v + i, vi);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(compute + i), narrow(compute + i, p));
  }
  _mm_sfence();  // the streamed stores are visible before the step returns
  for (; i < n; ++i) fused_adam_element<C, G, true>(master, compute, grad, m, v, i, s, factor);
}

}  // namespace avx512
#pragma GCC diagnostic pop
#endif

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

bool cpu_has_avx512f() {
#if MEMRT_AVX512_KERNELS
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
#else
  return false;
#endif
}

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

void fused_adam_cpu(const AdamRange& r, const AdamScalars& s, float factor, CpuKernels kernels) {
  using BF = c10::BFloat16;
  using H = c10::Half;
  auto run = [&](auto chunk, auto* compute, const auto* grad) {
    at::parallel_for(0, r.n, kCpuLoopGrain, [&](int64_t begin, int64_t end) {
      chunk(r.master ? r.master + begin : nullptr, compute + begin, grad + begin, r.exp_avg + begin,
            r.exp_avg_sq + begin, end - begin, s, factor);
    });
  };
  // The mixed-precision step: the AVX-512 kernel where the processor has it, else the portable loop.
  auto run_mixed = [&](auto portable, auto* compute, const auto* grad) {
#if MEMRT_AVX512_KERNELS
    using C = std::remove_pointer_t<decltype(compute)>;
    using G = std::remove_const_t<std::remove_pointer_t<decltype(grad)>>;
    if (kernels == CpuKernels::kBest && cpu_has_avx512f()) return run(avx512::fused_mixed<C, G>, compute, grad);
#endif
    run(portable, compute, grad);
  };
  const bool master = r.master != nullptr;
  const at::ScalarType c = r.compute_type, g = r.grad_type;
  if (!master && c == at::kFloat && g == at::kFloat) {
    run(fused_fp32, static_cast<float*>(r.compute), static_cast<const float*>(r.grad));
  } else if (master && c == at::kBFloat16 && g == at::kBFloat16) {
    run_mixed(fused_bf16, static_cast<BF*>(r.compute), static_cast<const BF*>(r.grad));
  } else if (master && c == at::kBFloat16 && g == at::kFloat) {
    run_mixed(fused_bf16_fp32_grad, static_cast<BF*>(r.compute), static_cast<const float*>(r.grad));
  } else if (master && c == at::kHalf && g == at::kHalf) {
    run_mixed(fused_fp16, static_cast<H*>(r.compute), static_cast<const H*>(r.grad));
  } else if (master && c == at::kHalf && g == at::kFloat) {
    run_mixed(fused_fp16_fp32_grad, static_cast<H*>(r.compute), static_cast<const float*>(r.grad));
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
