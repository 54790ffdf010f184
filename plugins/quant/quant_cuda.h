// plugins/quant/quant_cuda.h — the quantized formats' CUDA kernels (quant_cuda.cu, compiled where
// MEMRT_BUILD_CUDA is ON). Each is a CPU loop of blockwise.h / bnb_adam.h run on the GPU over the
// same quant_math.h functions, so the CPU tests against bitsandbytes vouch for it and
// tests/cuda/test_cuda_kernels.cpp holds it to its CPU twin bit for bit where a GPU is present:
// a thread block per quantization block in turn, the block's absmax an integer max over |x|'s bits (as
// the CPU takes it), every fp32 operation rounded as the source writes it (no contraction).
// Pointers are device pointers; `stream` is a cudaStream_t; failures throw memrt::Error.
// Plain C++: no CUDA or LibTorch header.
#pragma once

#include <cstdint>

#include "quant_math.h"

namespace memrt::quant::cuda {

// A 256-entry map (a dynamic map), passed to the kernels by value (it lands in each block's
// shared memory).
struct Map256 {
  float value[256];
};
// dynamic_map_values(is_signed) as a Map256.
Map256 map256(const float* values);

// quantize_blockwise(): blocks of `block` (<= 4096) values, absmax[b] = max |x| of block b,
// codes[i] = table[table_index(x[i] * (1 / absmax))] (0 in an all-zero block). `table` is a
// QuantizeTable's kTableSize codes, in device memory.
void quantize_blockwise8(const float* x, int64_t n, int64_t block, const uint8_t* table, uint8_t* codes,
                         float* absmax, void* stream);
// dequantize_blockwise(): out[i] = map[codes[i]] * absmax[i / block].
void dequantize_blockwise8(const uint8_t* codes, const float* absmax, int64_t n, int64_t block, const Map256& map,
                           float* out, void* stream);

// absmax_fp32() of a double-quantized 4-bit tensor: scale[b] = map[codes[b]] * nested_absmax[b /
// nested_block] + *offset (two fp32 roundings), for `blocks` blocks.
void double_quant_scales(const uint8_t* codes, const float* nested_absmax, const float* offset, int64_t blocks,
                         int64_t nested_block, const Map256& signed_map, float* scale, void* stream);
// A 4-bit map's 16 values (map4_value() of each code), passed to the kernels by value.
struct Map16 {
  float value[16];
};
Map16 map16(Map4 type);

// dequantize_4bit(): out[i] = map4[code i] * scale[i / block], rounded to the output's type to
// nearest-even: OutType kFloat (float*), kBFloat16 or kHalf (their 16 bits).
enum class OutType { kFloat, kBFloat16, kHalf };
void dequantize4(const uint8_t* packed, int64_t n, Map4 type, int64_t block, const float* scale, OutType out_type,
                 void* out, void* stream);

// bnb_adam8_cpu(): n elements from a block boundary, blocks of kBnbBlock (256); g in fp32 times
// `grad_factor`; both moments dequantized, updated with p, and requantized with the block's new
// absmax. The tables are QuantizeTables' codes in device memory.
void bnb_adam8(float* p, const float* g, float grad_factor, uint8_t* m_codes, float* m_absmax, uint8_t* v_codes,
               float* v_absmax, int64_t n, const BnbAdamScalars& s, const Map256& signed_map,
               const Map256& unsigned_map, const uint8_t* signed_table, const uint8_t* unsigned_table,
               void* stream);

}  // namespace memrt::quant::cuda
