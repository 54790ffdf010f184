// The quantized formats' CUDA kernels (quant_cuda.h): the CPU loops of blockwise.cpp and
// bnb_adam.cpp over quant_math.h: a thread block per quantization block where a block's values need
// each other (absmax), wide loads and stores where each value stands alone. Built with
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

// The largest of every thread's a and of every thread's b in the block, each (all threads call it;
// blockDim.x == kThreads): one exchange through shared memory for both.
__device__ void block_max2(uint32_t& a, uint32_t& b) {
  __shared__ uint32_t warp_a[kThreads / 32], warp_b[kThreads / 32];
  for (int offset = 16; offset > 0; offset >>= 1) {
    const uint32_t oa = __shfl_xor_sync(0xffffffffu, a, offset), ob = __shfl_xor_sync(0xffffffffu, b, offset);
    a = oa > a ? oa : a;
    b = ob > b ? ob : b;
  }
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
    warp_a[warp] = a;
    warp_b[warp] = b;
  }
  __syncthreads();
  a = b = 0;
  for (int w = 0; w < kThreads / 32; ++w) {
    a = warp_a[w] > a ? warp_a[w] : a;
    b = warp_b[w] > b ? warp_b[w] : b;
  }
  __syncthreads();  // the arrays are reused by the next call
}

__device__ uint32_t block_max(uint32_t v) {
  uint32_t unused = 0;
  block_max2(v, unused);
  return v;
}

// Thread blocks for a kernel that loops over `items` units of work (quantization blocks): as many
// as the device keeps resident (2048 threads per multiprocessor), so each block loads its maps once.
// Any grid gives the same results; where the device cannot be asked, an H200's 132 multiprocessors.
unsigned resident_grid(int64_t items) {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    sms = 132;
  const int64_t most = int64_t{sms} * (2048 / kThreads);
  return static_cast<unsigned>(items < most ? (items > 0 ? items : 1) : most);
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

// Each output type: one value rounded to it, and 16 (at a 16-byte-aligned address) in wide stores.
struct StoreF32 {
  using T = float;
  __device__ static float store(float x) { return x; }
  __device__ static void store16(float* out, const float (&v)[16]) {
#pragma unroll
    for (int k = 0; k < 4; ++k)
      reinterpret_cast<float4*>(out)[k] = make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
  }
};
// 16 values of a 16-bit type: pairs packed into words, two 16-byte stores.
template <class S>
__device__ void store16_pairs(typename S::T* out, const float (&v)[16]) {
  uint32_t w[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) w[k] = S::bits(S::store(v[2 * k])) | (uint32_t{S::bits(S::store(v[2 * k + 1]))} << 16);
  reinterpret_cast<uint4*>(out)[0] = make_uint4(w[0], w[1], w[2], w[3]);
  reinterpret_cast<uint4*>(out)[1] = make_uint4(w[4], w[5], w[6], w[7]);
}
struct StoreBF16 {
  using T = __nv_bfloat16;
  __device__ static __nv_bfloat16 store(float x) { return __float2bfloat16_rn(x); }
  __device__ static uint32_t bits(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
  __device__ static void store16(T* out, const float (&v)[16]) { store16_pairs<StoreBF16>(out, v); }
};
struct StoreF16 {
  using T = __half;
  __device__ static __half store(float x) { return __float2half_rn(x); }
  __device__ static uint32_t bits(__half x) { return __half_as_ushort(x); }
  __device__ static void store16(T* out, const float (&v)[16]) { store16_pairs<StoreF16>(out, v); }
};

// A 4-bit map's 16 values into the block's shared memory. (map4_value() picks from a local array,
// which a GPU keeps in per-thread local memory: once per element, that was most of the kernel.)
__device__ void load_map16(const Map16& map, float* shared) {
  if (threadIdx.x < 16) shared[threadIdx.x] = map.value[threadIdx.x];
  __syncthreads();
}

// The general path, also the tail of the fast one: one byte of codes a thread, from element
// `first` (even) to n: its two values (the high nibble first; an odd n's last byte has one).
template <class S>
__global__ void dequantize4_kernel(const uint8_t* __restrict__ packed, int64_t first, int64_t n, Map16 map,
                                   int64_t block, const float* __restrict__ scale, typename S::T* __restrict__ out) {
  __shared__ float values[16];
  load_map16(map, values);
  const int64_t pairs = (n - first + 1) / 2;
  for (int64_t j = blockIdx.x * int64_t{kThreads} + threadIdx.x; j < pairs; j += int64_t{kThreads} * gridDim.x) {
    const int64_t i = first + 2 * j;
    const uint32_t byte = packed[i / 2];
    out[i] = S::store(mul_rn(values[byte >> 4], scale[i / block]));
    if (i + 1 < n) out[i + 1] = S::store(mul_rn(values[byte & 15u], scale[(i + 1) / block]));
  }
}

// The fast path, for a power-of-two block of at least 16 and aligned buffers: 16 values a thread,
// from 8 bytes read at once, all in one block (scale index: group >> shift), written 16 bytes at a
// time. The same value for each element as the general path.
template <class S>
__global__ void dequantize4_groups_kernel(const uint2* __restrict__ packed, int64_t groups, Map16 map, int shift,
                                          const float* __restrict__ scale, typename S::T* __restrict__ out) {
  __shared__ float values[16];
  load_map16(map, values);
  for (int64_t j = blockIdx.x * int64_t{kThreads} + threadIdx.x; j < groups; j += int64_t{kThreads} * gridDim.x) {
    const uint2 bytes = packed[j];
    const float sc = scale[j >> shift];
    float v[16];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t byte = ((k < 4 ? bytes.x : bytes.y) >> (8 * (k % 4))) & 0xffu;  // little-endian: byte k
      v[2 * k] = mul_rn(values[byte >> 4], sc);
      v[2 * k + 1] = mul_rn(values[byte & 15u], sc);
    }
    S::store16(out + 16 * j, v);
  }
}

// bnb blocks (256 elements) in turn, one element a thread, bnb_adam8_block()'s steps; each thread
// block loads the maps once and loops over blocks (a grid the device keeps resident). (A warp per
// bnb block, eight elements a lane and the absmax a warp reduction without barriers, took 13% longer
// on an H200: bench/RESULTS.md.)
static_assert(kBnbBlock == kThreads, "a thread per element of a bitsandbytes block");
__global__ void bnb_adam8_kernel(float* __restrict__ p, const float* __restrict__ g, float grad_factor,
                                 uint8_t* __restrict__ m_codes, float* __restrict__ m_absmax,
                                 uint8_t* __restrict__ v_codes, float* __restrict__ v_absmax, int64_t n,
                                 BnbAdamScalars s, Map256 signed_map, Map256 unsigned_map,
                                 const uint8_t* __restrict__ signed_table, const uint8_t* __restrict__ unsigned_table) {
  __shared__ float smap[256], umap[256];
  smap[threadIdx.x] = signed_map.value[threadIdx.x];
  load_map(unsigned_map, umap);
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const int64_t i = b * kThreads + threadIdx.x;
    const bool live = i < n;
    float m = 0.f, v = 0.f;
    if (live) {
      m = mul_rn(smap[m_codes[i]], m_absmax[b]);
      v = mul_rn(umap[v_codes[i]], v_absmax[b]);
      bnb_adam_moments(mul_rn(g[i], grad_factor), m, v, s);
      p[i] = bnb_adam8_param(p[i], m, v, s);
    }
    uint32_t m_bits = live ? abs_bits(m) : 0u, v_bits = live ? abs_bits(v) : 0u;
    block_max2(m_bits, v_bits);  // every thread has read this block's absmax before it is written
    const float m_max = from_bits(m_bits), v_max = from_bits(v_bits);
    if (threadIdx.x == 0) {
      m_absmax[b] = m_max;
      v_absmax[b] = v_max;
    }
    if (live) {
      m_codes[i] = code_of(m, m_max, 1.f / m_max, signed_table);
      v_codes[i] = code_of(v, v_max, 1.f / v_max, unsigned_table);
    }
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

Map16 map16(Map4 type) {
  Map16 m;
  for (uint32_t c = 0; c < 16; ++c) m.value[c] = map4_value(type, c);
  return m;
}

namespace {

template <class S>
void launch_dequantize4(const uint8_t* packed, int64_t n, const Map16& map, int64_t block, const float* scale,
                        typename S::T* out, cudaStream_t st) {
  const auto aligned = [](const void* ptr, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; };
  int shift = -1;
  if (block >= 16 && (block & (block - 1)) == 0 && aligned(packed, 8) && aligned(out, 16)) {
    shift = 0;
    while ((int64_t{16} << shift) < block) ++shift;
  }
  const int64_t groups = shift >= 0 ? n / 16 : 0;
  if (groups > 0)
    dequantize4_groups_kernel<S><<<grid_for(groups), kThreads, 0, st>>>(reinterpret_cast<const uint2*>(packed), groups,
                                                                        map, shift, scale, out);
  if (16 * groups < n)
    dequantize4_kernel<S><<<grid_for((n - 16 * groups + 1) / 2), kThreads, 0, st>>>(packed, 16 * groups, n, map,
                                                                                   block, scale, out);
}

}  // namespace

void dequantize4(const uint8_t* packed, int64_t n, Map4 type, int64_t block, const float* scale, OutType out_type,
                 void* out, void* stream) {
  if (n == 0) return;
  const Map16 map = map16(type);
  const cudaStream_t st = as_stream(stream);
  switch (out_type) {
    case OutType::kFloat:
      launch_dequantize4<StoreF32>(packed, n, map, block, scale, static_cast<float*>(out), st);
      break;
    case OutType::kBFloat16:
      launch_dequantize4<StoreBF16>(packed, n, map, block, scale, static_cast<__nv_bfloat16*>(out), st);
      break;
    case OutType::kHalf:
      launch_dequantize4<StoreF16>(packed, n, map, block, scale, static_cast<__half*>(out), st);
      break;
  }
  check_launch("dequantize_4bit");
}

void bnb_adam8(float* p, const float* g, float grad_factor, uint8_t* m_codes, float* m_absmax, uint8_t* v_codes,
               float* v_absmax, int64_t n, const BnbAdamScalars& s, const Map256& signed_map,
               const Map256& unsigned_map, const uint8_t* signed_table, const uint8_t* unsigned_table,
               void* stream) {
  if (n == 0) return;
  bnb_adam8_kernel<<<resident_grid((n + kThreads - 1) / kThreads), kThreads, 0, as_stream(stream)>>>(
      p, g, grad_factor, m_codes, m_absmax, v_codes, v_absmax, n, s, signed_map, unsigned_map, signed_table,
      unsigned_table);
  check_launch("bitsandbytes 8-bit Adam step");
}

}  // namespace memrt::quant::cuda
