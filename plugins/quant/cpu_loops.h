// plugins/quant/cpu_loops.h — included by the files whose loops run at::parallel_for (blockwise.cpp,
// bnb_adam.cpp, ao_adam.cpp). Its `#pragma omp parallel` is compiled into the calling file: built
// without OpenMP, every loop would run on one thread whatever at::get_num_threads() says.
#pragma once

#include <ATen/Config.h>
#include <ATen/Parallel.h>

#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error "plugins/quant's CPU loops need OpenMP: build them through memrt_quant_sources (plugins/quant/CMakeLists.txt)"
#endif
