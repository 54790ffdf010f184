// How the optimizers' CPU loops are built and split (optimizers_cpu.cpp), for every loop that must
// run the same way — bench/optimizer_step.cpp's roofline included.
#pragma once

#include <ATen/Config.h>

#include <cstdint>

// at::parallel_for compiles its `#pragma omp parallel` into the file that calls it: without OpenMP
// every loop here would run on one thread while at::get_num_threads() reports more.
#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error "memrt's CPU loops need OpenMP: MEMRT_OPENMP_FLAGS and memrt_openmp (cmake/MemrtDependencies.cmake)"
#endif

// Each chunk function is compiled for AVX-512, AVX2 and baseline x86-64 and picked at load time
// (GCC target_clones): one binary runs anywhere with the widest vectors the processor has.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MEMRT_SIMD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MEMRT_SIMD_CLONES
#endif

namespace memrt {

constexpr int64_t kCpuLoopGrain = 1 << 15;  // elements per task: 512 KiB of four fp32 streams

}  // namespace memrt
