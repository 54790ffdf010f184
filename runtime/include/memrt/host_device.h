// memrt/host_device.h — MEMRT_HOST_DEVICE marks per-element math that host code and CUDA kernels
// both call when nvcc compiles it (the runtime's ops/activation_math.h and optim/optimizer_math.h,
// a plugin's own, such as plugins/quant/quant_math.h); nothing else.
#pragma once

#if defined(__CUDACC__)
#define MEMRT_HOST_DEVICE __host__ __device__
#else
#define MEMRT_HOST_DEVICE
#endif
