// MEMRT_HOST_DEVICE: marks the per-element math (ops/activation_math.h, optim/optimizer_math.h)
// callable from both host code and CUDA kernels when nvcc compiles it; nothing elsewhere.
#pragma once

#if defined(__CUDACC__)
#define MEMRT_HOST_DEVICE __host__ __device__
#else
#define MEMRT_HOST_DEVICE
#endif
