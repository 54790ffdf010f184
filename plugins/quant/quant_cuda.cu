// The quantized formats' CUDA kernels (quant_cuda.h): the CPU loops of blockwise.cpp and
// bnb_adam.cpp over quant_math.h, one thread block per quantization block. Built with
// --fmad=false (plugins/quant/CMakeLists.txt), as the CPU side is with -ffp-contract=off.
#include "quant_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstring>
#include <string>

#include <memrt/error.h>

namespace memrt::quant::cuda {

namespace {

constexpr int kThreads = 256;  // a multiple of the warp; bnb's optimizer block is one thread each
constexpr int64_t kMaxBlock = 4096;

void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw Error(std::string(what) + " (CUDA): kernel launch failed: " + cudaGetErrorString(err));
}

cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

unsigned grid_for(int64_t items) {
  const int64_t b = (items + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 65535 ? (b > 0 ? b : 1) : 65535);  // grid-stride beyond
}

// The largest of every thread's value in the block (all threads call it; blockDim.x == kThreads).
__device__ uint32_t block_max(uint32_t v) {
  __shared__ uint32_t warp_max[kThreads / 32];
  for (int offset = 16; offset > 0; offset >>= 1) {
    const uint32_t other = __shfl_xor_sync(0xffffffffu, v, offset);
    v = other > v ? other : v;
  }
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) warp_max[warp] = v;
  __syncthreads();
  uint32_t m = 0;
  for (int w = 0; w < kThreads / 32; ++w) m = warp_max[w] > m ? warp_max[w] : m;
  __syncthreads();  // warp_max is reused by the next call
  return m;
}

// A map into the block's shared memory (kThreads == 256 entries: one each).
__device__ void load_map(const Map256& map, float* shared) {
  shared[threadIdx.x] = map.value[threadIdx.x];
  __syncthreads();
}

// The code of x in a block of absmax m: quantize_block()'s rule.
__device__ uint8_t code_of(float x, float m, float inv, const uint8_t* table) {
  return m == 0.f ? uint8_t{0} : table[table_index(mul_rn(x, inv))];
}

__global__ void quantize_blockwise8_kernel(const float* __restrict__ x, int64_t n, int64_t block,
                                           const uint8_t* __restrict__ table, uint8_t* __restrict__ codes,
                                           float* __restrict__ absmax) {
  const int64_t begin = blockIdx.x * block;
  const int64_t len = n - begin < block ? n - begin : block;
  uint32_t largest = 0;
  for (int64_t i = threadIdx.x; i < len; i += kThreads) {
    const uint32_t a = abs_bits(x[begin + i]);
    largest = a > largest ? a : largest;
  }
  const float m = from_bits(block_max(largest));
  if (threadIdx.x == 0) absmax[blockIdx.x] = m;
  const float inv = 1.f / m;
  for (int64_t i = threadIdx.x; i < len; i += kThreads) codes[begin + i] = code_of(x[begin + i], m, inv, table);
}

__global__ void dequantize_blockwise8_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ absmax,
                                             int64_t n, int64_t block, Map256 map, float* __restrict__ out) {
  __shared__ float values[256];
  load_map(map, values);
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n; i += int64_t{kThreads} * gridDim.x)
    out[i] = mul_rn(values[codes[i]], absmax[i / block]);
}

__global__ void double_quant_scales_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ nested,
                                           const float* __restrict__ offset, int64_t blocks, int64_t nested_block,
                                           Map256 map, float* __restrict__ scale) {
  __shared__ float values[256];
  load_map(map, values);
  const float off = *offset;
  for (int64_t b = blockIdx.x * int64_t{kThreads} + threadIdx.x; b < blocks; b += int64_t{kThreads} * gridDim.x)
    scale[b] = nested_scale(values, codes[b], nested[b / nested_block], off);
}

struct StoreF32 {
  using T = float;
  __device__ static float store(float x) { return x; }
};
struct StoreBF16 {
  using T = __nv_bfloat16;
  __device__ static __nv_bfloat16 store(float x) { return __float2bfloat16_rn(x); }
};
struct StoreF16 {
  using T = __half;
  __device__ static __half store(float x) { return __float2half_rn(x); }
};

// One byte of codes a thread: its two values (the high nibble first; an odd n's last byte has one).
template <class S>
__global__ void dequantize4_kernel(const uint8_t* __restrict__ packed, int64_t n, Map4 type, int64_t block,
                                   const float* __restrict__ scale, typename S::T* __restrict__ out) {
  const int64_t pairs = (n + 1) / 2;
  for (int64_t j = blockIdx.x * int64_t{kThreads} + threadIdx.x; j < pairs; j += int64_t{kThreads} * gridDim.x) {
    const int64_t i = 2 * j;
    const uint8_t byte = packed[j];
    out[i] = S::store(mul_rn(map4_value(type, byte >> 4), scale[i / block]));
    if (i + 1 < n) out[i + 1] = S::store(mul_rn(map4_value(type, byte & 15u), scale[(i + 1) / block]));
  }
}

// One bnb block (256 elements) a thread block, one element a thread: bnb_adam8_block()'s steps.
__global__ void bnb_adam8_kernel(float* __restrict__ p, const float* __restrict__ g, float grad_factor,
                                 uint8_t* __restrict__ m_codes, float* __restrict__ m_absmax,
                                 uint8_t* __restrict__ v_codes, float* __restrict__ v_absmax, int64_t n,
                                 BnbAdamScalars s, Map256 signed_map, Map256 unsigned_map,
                                 const uint8_t* __restrict__ signed_table, const uint8_t* __restrict__ unsigned_table) {
  __shared__ float smap[256], umap[256];
  load_map(signed_map, smap);
  load_map(unsigned_map, umap);
  const int64_t b = blockIdx.x;
  const int64_t i = b * kThreads + threadIdx.x;
  const bool live = i < n;
  float m = 0.f, v = 0.f;
  if (live) {
    m = mul_rn(smap[m_codes[i]], m_absmax[b]);
    v = mul_rn(umap[v_codes[i]], v_absmax[b]);
    bnb_adam_moments(mul_rn(g[i], grad_factor), m, v, s);
    p[i] = bnb_adam8_param(p[i], m, v, s);
  }
  const float m_max = from_bits(block_max(live ? abs_bits(m) : 0u));
  const float v_max = from_bits(block_max(live ? abs_bits(v) : 0u));
  if (threadIdx.x == 0) {
    m_absmax[b] = m_max;
    v_absmax[b] = v_max;
  }
  if (live) {
    m_codes[i] = code_of(m, m_max, 1.f / m_max, signed_table);
    v_codes[i] = code_of(v, v_max, 1.f / v_max, unsigned_table);
  }
}

}  // namespace

Map256 map256(const float* values) {
  Map256 m;
  std::memcpy(m.value, values, sizeof m.value);
  return m;
}

void quantize_blockwise8(const float* x, int64_t n, int64_t block, const uint8_t* table, uint8_t* codes,
                         float* absmax, void* stream) {
  if (block <= 0 || block > kMaxBlock)
    throw Error("quantize_blockwise (CUDA): block " + std::to_string(block) + " is outside 1.." +
                std::to_string(kMaxBlock));
  if (n == 0) return;
  const int64_t blocks = (n + block - 1) / block;
  quantize_blockwise8_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, as_stream(stream)>>>(x, n, block, table,
                                                                                                codes, absmax);
  check_launch("quantize_blockwise");
}

void dequantize_blockwise8(const uint8_t* codes, const float* absmax, int64_t n, int64_t block, const Map256& map,
                           float* out, void* stream) {
  if (n == 0) return;
  dequantize_blockwise8_kernel<<<grid_for(n), kThreads, 0, as_stream(stream)>>>(codes, absmax, n, block, map, out);
  check_launch("dequantize_blockwise");
}

void double_quant_scales(const uint8_t* codes, const float* nested_absmax, const float* offset, int64_t blocks,
                         int64_t nested_block, const Map256& signed_map, float* scale, void* stream) {
  if (blocks == 0) return;
  double_quant_scales_kernel<<<grid_for(blocks), kThreads, 0, as_stream(stream)>>>(codes, nested_absmax, offset,
                                                                                   blocks, nested_block, signed_map,
                                                                                   scale);
  check_launch("4-bit double-quantization scales");
}

void dequantize4(const uint8_t* packed, int64_t n, Map4 type, int64_t block, const float* scale, OutType out_type,
                 void* out, void* stream) {
  if (n == 0) return;
  const unsigned grid = grid_for((n + 1) / 2);
  const cudaStream_t st = as_stream(stream);
  switch (out_type) {
    case OutType::kFloat:
      dequantize4_kernel<StoreF32><<<grid, kThreads, 0, st>>>(packed, n, type, block, scale, static_cast<float*>(out));
      break;
    case OutType::kBFloat16:
      dequantize4_kernel<StoreBF16>
          <<<grid, kThreads, 0, st>>>(packed, n, type, block, scale, static_cast<__nv_bfloat16*>(out));
      break;
    case OutType::kHalf:
      dequantize4_kernel<StoreF16><<<grid, kThreads, 0, st>>>(packed, n, type, block, scale, static_cast<__half*>(out));
      break;
  }
  check_launch("dequantize_4bit");
}

void bnb_adam8(float* p, const float* g, float grad_factor, uint8_t* m_codes, float* m_absmax, uint8_t* v_codes,
               float* v_absmax, int64_t n, const BnbAdamScalars& s, const Map256& signed_map,
               const Map256& unsigned_map, const uint8_t* signed_table, const uint8_t* unsigned_table,
               void* stream) {
  if (n == 0) return;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  bnb_adam8_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, as_stream(stream)>>>(
      p, g, grad_factor, m_codes, m_absmax, v_codes, v_absmax, n, s, signed_map, unsigned_map, signed_table,
      unsigned_table);
  check_launch("bitsandbytes 8-bit Adam step");
}

}  // namespace memrt::quant::cuda
