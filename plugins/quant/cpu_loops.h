// plugins/quant/cpu_loops.h — included by the files whose loops run at::parallel_for (blockwise.cpp,
// bnb_adam.cpp, ao_adam.cpp). Its `#pragma omp parallel` is compiled into the calling file: built
// without OpenMP, every loop would run on one thread whatever at::get_num_threads() says.
#pragma once

#include <ATen/Config.h>
#include <ATen/Parallel.h>

#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error "plugins/quant's CPU loops need OpenMP: build them through memrt_quant_sources (plugins/quant/CMakeLists.txt)"
#endif

// A block's loops are compiled for x86-64-v4 (AVX-512), x86-64-v3 (AVX2, FMA) and baseline x86-64
// and picked at load time (GCC target_clones), as the runtime's step: -ffp-contract=off and no
// fast-math keep every variant's bits those of the scalar code the tests hold to the libraries.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MEMRT_QUANT_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MEMRT_QUANT_CLONES
#endif
