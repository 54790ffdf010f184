// The CPU loops of the optimizers: at::parallel_for over chunks, each chunk a plain loop over
// restrict pointers that the compiler vectorises. Each chunk function is compiled for AVX-512,
// AVX2 and baseline x86-64 and picked at load time (GCC target_clones), so one binary runs
// anywhere and uses the widest vectors the processor has. This file is built with -O3,
// -fno-math-errno (lets sqrtf vectorise) and -ffp-contract=off (no FMA contraction), so every
// variant computes exactly the scalar math of optimizer_math.h.
#include <ATen/Parallel.h>

#include "optim/optimizer_math.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MEMRT_SIMD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MEMRT_SIMD_CLONES
#endif

namespace memrt {

namespace {

constexpr int64_t kGrain = 1 << 15;  // elements per task: 512 KiB of the four fp32 streams

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

}  // namespace

void adam_update_cpu(float* p, const float* g, float* m, float* v, int64_t n,
                     const AdamScalars& s) {
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    adam_chunk(p + begin, g + begin, m + begin, v + begin, end - begin, s);
  });
}

void sgd_update_cpu(float* p, const float* g, float* buf, int64_t n, const SgdScalars& s) {
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    if (s.momentum == 0.f)
      sgd_chunk_no_momentum(p + begin, g + begin, end - begin, s);
    else
      sgd_chunk(p + begin, g + begin, buf + begin, end - begin, s);
  });
}

}  // namespace memrt
