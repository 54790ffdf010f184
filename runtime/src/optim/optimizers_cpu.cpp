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
#define MEMRT_X86_KERNELS 1
#include <immintrin.h>
#endif

#include "memrt/error.h"
#include "optim/cpu_loops.h"
#include "optim/fused_adam.h"
#include "optim/optimizer_math.h"

namespace memrt {

namespace {

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

// ---- bf16 moments, bf16 weights without a master: one portable loop ------------------------------
// Element i: widen the moments (bf16 exactly) and the weight (the master, else the compute copy),
// adam_update(), then narrow: moments and a masterless bf16 weight to nearest-even (c10's
// conversions, as the other loops), or the weight stochastically.
template <typename C, typename G, typename S>
void adam_any_chunk(const AdamRange& r, int64_t begin, int64_t end, const AdamScalars& s, float factor) {
  C* compute = static_cast<C*>(r.compute);
  const G* grad = static_cast<const G*>(r.grad);
  S* m = static_cast<S*>(r.exp_avg);
  S* v = static_cast<S*>(r.exp_avg_sq);
  const bool stochastic = r.stochastic_round && !r.master;  // checked: bf16 compute only
  for (int64_t i = begin; i < end; ++i) {
    float p = r.master ? r.master[i] : widen(compute[i]);
    float mm = widen(m[i]), vv = widen(v[i]);
    adam_update(p, widen(grad[i]) * factor, mm, vv, s);
    m[i] = narrow<S>(mm);
    v[i] = narrow<S>(vv);
    if (r.master) r.master[i] = p;
    if constexpr (std::is_same_v<C, c10::BFloat16>) {
      if (stochastic) {
        const uint16_t bits = bf16_bits_stochastic(p, random_bits16(r.seed, static_cast<uint64_t>(r.first + i)));
        compute[i] = c10::BFloat16(bits, c10::BFloat16::from_bits());
        continue;
      }
    }
    compute[i] = narrow<C>(p);
  }
}

void adam_any_layout(const AdamRange& r, const AdamScalars& s, float factor) {
  using BF = c10::BFloat16;
  using H = c10::Half;
  const at::ScalarType c = r.compute_type, g = r.grad_type, st = r.state_type;
  if (st != at::kFloat && st != at::kBFloat16)
    throw Error(std::string("fused Adam step: no kernel for ") + c10::toString(st) + " optimizer state (Float or BFloat16)");
  if (r.stochastic_round && (r.master || c != at::kBFloat16))
    throw Error("fused Adam step: stochastic rounding is for bf16 weights updated without an fp32 master");
  if (!r.master && c != at::kFloat && c != at::kBFloat16)
    throw Error(std::string("fused Adam step: ") + c10::toString(c) + " weights are updated through an fp32 "
                "master (only fp32 and bf16 weights are updated in place)");
  if (g != c && g != at::kFloat)
    throw Error(std::string("fused Adam step: no kernel for ") + c10::toString(g) + " gradients of " +
                c10::toString(c) + " weights (the compute dtype or Float)");
  auto run = [&](auto kernel) {
    at::parallel_for(0, r.n, kCpuLoopGrain, [&](int64_t begin, int64_t end) { kernel(r, begin, end, s, factor); });
  };
  auto with_state = [&](auto compute_tag, auto grad_tag) {
    using C = decltype(compute_tag);
    using G = decltype(grad_tag);
    if (st == at::kBFloat16) return run(adam_any_chunk<C, G, BF>);
    run(adam_any_chunk<C, G, float>);
  };
  auto with_grad = [&](auto compute_tag) {
    using C = decltype(compute_tag);
    if (g == at::kFloat) return with_state(C{}, float{});
    return with_state(C{}, C{});
  };
  if (c == at::kFloat) return with_state(float{}, float{});
  if (c == at::kBFloat16) return with_grad(BF{});
  with_grad(H{});
}

#if MEMRT_X86_KERNELS
// ---- the mixed-precision step on hand-written vectors -------------------------------------------
// GCC vectorises the 16-bit loops above at most 8 lanes wide, each conversion several
// instructions: on an AMD EPYC Zen 4 they took about twice the fp32 loop's time per element in
// cache, and on an AVX2-only AMD EPYC (family 23) the bf16 step took 1.35x and the fp16 step 2.2x
// the fp32 step's time, no longer hidden under the memory traffic. These kernels (one source,
// fused_mixed_simd.inc, per instruction set) take a register's width of lanes, widen and narrow
// fp16 with the processor's IEEE conversions (F16C) and bf16 with the scalar code's integer
// rounding, and do adam_update()'s operations in its order without FMA: the scalar reference's
// bits, as the portable loops give (tests/data/test_fused_adam.cpp holds each to it).

namespace avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f")
// GCC 12 warns inside its own AVX-512 headers (their _mm512_undefined_* placeholders, GCC PR
// 105593, fixed in GCC 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

using Vec = __m512;
constexpr int kLanes = 16;
inline Vec set1(float x) { return _mm512_set1_ps(x); }
inline Vec load(const float* x) { return _mm512_loadu_ps(x); }
inline void store(float* x, Vec v) { _mm512_storeu_ps(x, v); }
inline Vec sqrt_ps(Vec v) { return _mm512_sqrt_ps(v); }

inline __m256i load16(const void* x) { return _mm256_loadu_si256(static_cast<const __m256i*>(x)); }
inline Vec widen(const float* x) { return _mm512_loadu_ps(x); }
inline Vec widen(const c10::BFloat16* x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load16(x)), 16));
}
// Exact, and a NaN comes out quiet with its payload, as float_from_fp16_bits() gives.
inline Vec widen(const c10::Half* x) { return _mm512_cvtph_ps(load16(x)); }

// bf16_bits_from_float(): round to nearest-even on the bits; a NaN becomes 0x7fc0.
inline __m256i narrow(const c10::BFloat16*, Vec f) {
  const __m512i bits = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i h = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  h = _mm512_mask_mov_epi32(h, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(h);
}
// fp16_bits_from_float(): vcvtps2ph rounds to nearest-even as it does, but keeps the top of a
// NaN's payload, where every NaN becomes sign | 0x7e00: NaN lanes become their sign's quiet NaN
// (0x7fc00000, which converts to 0x7e00) first.
inline __m256i narrow(const c10::Half*, Vec f) {
  const __m512i quiet = _mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(f), _mm512_set1_epi32(INT32_MIN)),
                                        _mm512_set1_epi32(0x7fc00000));
  f = _mm512_mask_mov_ps(f, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_castsi512_ps(quiet));
  return _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline void stream(void* x, __m256i packed) { _mm256_stream_si256(static_cast<__m256i*>(x), packed); }

#include "optim/fused_mixed_simd.inc"

#pragma GCC diagnostic pop
#pragma GCC pop_options
}  // namespace avx512

namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,f16c")

using Vec = __m256;
constexpr int kLanes = 8;
inline Vec set1(float x) { return _mm256_set1_ps(x); }
inline Vec load(const float* x) { return _mm256_loadu_ps(x); }
inline void store(float* x, Vec v) { _mm256_storeu_ps(x, v); }
inline Vec sqrt_ps(Vec v) { return _mm256_sqrt_ps(v); }

inline __m128i load16(const void* x) { return _mm_loadu_si128(static_cast<const __m128i*>(x)); }
inline Vec widen(const float* x) { return _mm256_loadu_ps(x); }
inline Vec widen(const c10::BFloat16* x) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load16(x)), 16));
}
inline Vec widen(const c10::Half* x) { return _mm256_cvtph_ps(load16(x)); }

// As avx512::narrow. The 32-bit results (all below 2^16) go to 16 bits with an unsigned pack,
// which works within each 128-bit half: the halves' low quadwords hold the eight values in order.
inline __m128i narrow(const c10::BFloat16*, Vec f) {
  const __m256i bits = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i h = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  h = _mm256_blendv_epi8(h, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08));
}
inline __m128i narrow(const c10::Half*, Vec f) {
  const __m256 quiet = _mm256_or_ps(_mm256_and_ps(f, _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN))),
                                    _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)));
  f = _mm256_blendv_ps(f, quiet, _mm256_cmp_ps(f, f, _CMP_UNORD_Q));
  return _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline void stream(void* x, __m128i packed) { _mm_stream_si128(static_cast<__m128i*>(x), packed); }

#include "optim/fused_mixed_simd.inc"

#pragma GCC pop_options
}  // namespace avx2
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

void fused_adam_cpu(const AdamRange& r, const AdamScalars& s, float factor, ops::CpuKernels kernels) {
  using BF = c10::BFloat16;
  using H = c10::Half;
  if (r.state_type != at::kFloat || r.stochastic_round || (!r.master && r.compute_type == at::kBFloat16))
    return adam_any_layout(r, s, factor);
  float* const exp_avg = static_cast<float*>(r.exp_avg);
  float* const exp_avg_sq = static_cast<float*>(r.exp_avg_sq);
  auto run = [&](auto chunk, auto* compute, const auto* grad) {
    at::parallel_for(0, r.n, kCpuLoopGrain, [&](int64_t begin, int64_t end) {
      chunk(r.master ? r.master + begin : nullptr, compute + begin, grad + begin, exp_avg + begin,
            exp_avg_sq + begin, end - begin, s, factor);
    });
  };
  // The mixed-precision step: the widest hand-written kernel the processor has (or the one asked
  // for), else the portable loop.
  if (kernels == ops::CpuKernels::kBest) {
    kernels = ops::cpu_supports(ops::CpuKernels::kAvx512) ? ops::CpuKernels::kAvx512
              : ops::cpu_supports(ops::CpuKernels::kAvx2) ? ops::CpuKernels::kAvx2
                                                 : ops::CpuKernels::kPortable;
  } else if (!ops::cpu_supports(kernels)) {
    throw Error(std::string("fused Adam step: this processor cannot run the ") + ops::to_string(kernels) +
                " kernels (ask for ops::CpuKernels::kBest, which picks the widest it can)");
  }
  auto run_mixed = [&](auto portable, auto* compute, const auto* grad) {
#if MEMRT_X86_KERNELS
    using C = std::remove_pointer_t<decltype(compute)>;
    using G = std::remove_const_t<std::remove_pointer_t<decltype(grad)>>;
    if (kernels == ops::CpuKernels::kAvx512) return run(avx512::fused_mixed<C, G>, compute, grad);
    if (kernels == ops::CpuKernels::kAvx2) return run(avx2::fused_mixed<C, G>, compute, grad);
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

void sgd_update_cpu(float* p, const float* g, float* buf, int64_t n, const SgdScalars& s) {
  at::parallel_for(0, n, kCpuLoopGrain, [&](int64_t begin, int64_t end) {
    if (s.momentum == 0.f)
      sgd_chunk_no_momentum(p + begin, g + begin, end - begin, s);
    else
      sgd_chunk(p + begin, g + begin, buf + begin, end - begin, s);
  });
}

}  // namespace memrt
