// plugins/quant/blockwise.h — the quantized formats of docs/quant.md on CPU tensors: bitsandbytes'
// dynamic maps, blockwise 8-bit quantization, NF4/FP4 4-bit quantization with double
// quantization, and their inverses, each bit-identical to bitsandbytes 0.50 on a CPU
// (tests/plugins/test_quant_formats.cpp holds them to the wheel at test time).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

#include "quant_math.h"
#include "table_codes.h"

namespace memrt::quant {

// bitsandbytes' (and torchao's) create_dynamic_map(signed, max_exponent_bits, total_bits):
// 2^total_bits fp32 values in ascending order, computed with the same LibTorch float32 operations
// (so the same bits). 8 bits: the optimizers' maps; torchao's 4-bit signed map is (true, 3, 4).
at::Tensor dynamic_map(bool is_signed, int max_exponent_bits = 7, int total_bits = 8);
// dynamic_map(is_signed) as 256 fp32 values in plain memory, built once per process: a kernel's
// constant, not a tensor the memory report would count.
const float* dynamic_map_values(bool is_signed);
// torchao's unsigned 4-bit map: linspace(0, 1, 17) without its 0 (16 values, 1/16 .. 1).
at::Tensor linear_map16();

// The 16 values of a 4-bit map by code (fp32).
at::Tensor map4(Map4 type);

// bitsandbytes' CPU quantizer for one 256-entry map: the code of every grid point of
// table_index() (the number of the map's midpoints strictly below the point).
class QuantizeTable {
 public:
  explicit QuantizeTable(const float* map256);
  explicit QuantizeTable(const at::Tensor& map256);  // 256 fp32 values, ascending
  uint8_t code(float normalized) const { return codes_[table_index(normalized)]; }
  // By grid point, kTableSize codes and 3 bytes of padding (a 32-bit gather at the last point).
  const uint8_t* data() const { return codes_.data(); }

 private:
  std::array<uint8_t, kTableSize + 3> codes_{};
};

// One block of len values: absmax = max |x| (an integer max over |x|'s bits, which vectorises),
// codes[i] = table[table_index(x[i] * (1 / absmax))] by `codes_fn` (table_codes.h), all 0 in an
// all-zero block; `table` is a QuantizeTable's data(). Inline, so a caller's per-ISA clones compile
// it with their own vectors.
inline void quantize_block(const float* __restrict x, int64_t len, const uint8_t* __restrict table,
                           uint8_t* __restrict codes, float* absmax, TableCodesFn codes_fn) {
  uint32_t largest = 0;
  for (int64_t i = 0; i < len; ++i) largest = largest > abs_bits(x[i]) ? largest : abs_bits(x[i]);
  const float m = from_bits(largest);
  *absmax = m;
  if (m == 0.f) {
    for (int64_t i = 0; i < len; ++i) codes[i] = 0;
    return;
  }
  codes_fn(x, len, 1.f / m, table, codes);
}

// Blockwise 8-bit quantization of n values (blocks of `block`, the last one shorter): absmax[b] =
// max |x| of block b; codes[i] = table.code(x[i] * (1 / absmax)) (all 0 in an all-zero block).
void quantize_blockwise(const float* x, int64_t n, int64_t block, const QuantizeTable& table,
                        uint8_t* codes, float* absmax);
// The inverse: map[codes[i]] * absmax[i / block] in fp32.
void dequantize_blockwise(const uint8_t* codes, const float* absmax, int64_t n, int64_t block,
                          const float* map256, float* out);

struct Blockwise {
  at::Tensor codes;   // uint8, the input's shape
  at::Tensor absmax;  // fp32, ceil(numel / block)
};
// bitsandbytes' quantize_blockwise(x, code=map, blocksize=block) for a CPU tensor of any floating
// dtype (widened to fp32 exactly) and its dequantize_blockwise into `dtype` (rounded to nearest-even).
Blockwise quantize_blockwise(const at::Tensor& x, const at::Tensor& map256, int64_t block);
at::Tensor dequantize_blockwise(const Blockwise& q, const at::Tensor& map256, int64_t block,
                                at::ScalarType dtype);

// A tensor in bitsandbytes' 4-bit format (quantize_4bit's output and QuantState's fields).
struct Quantized4 {
  Map4 type = Map4::kNf4;
  int64_t block = 64;
  std::vector<int64_t> shape;  // of the original tensor
  at::Tensor packed;           // uint8 [ceil(n / 2), 1], element 2j in the high nibble
  // Without double quantization: fp32 absmax per block. With it: uint8 codes of absmax - offset
  // on the signed dynamic map, blocks of 256 (nested_block), with nested_absmax (fp32 per 256)
  // and offset (fp32, 0-d: the mean of the blocks' absmax).
  at::Tensor absmax;
  at::Tensor nested_absmax;
  at::Tensor offset;
  int64_t nested_block = 256;
  bool double_quant() const { return nested_absmax.defined(); }
};

// bitsandbytes' quantize_4bit(x, blocksize=block, quant_type, compress_statistics=double_quant)
// for a CPU tensor of any floating dtype.
Quantized4 quantize_4bit(const at::Tensor& x, Map4 type, int64_t block, bool double_quant);
// Each block's scale as dequantization uses it: absmax, or with double quantization
// map[code] * nested_absmax + offset (fp32).
at::Tensor absmax_fp32(const Quantized4& q);
// bitsandbytes' dequantize_4bit: map4[code] * scale in fp32, then `dtype` (nearest-even).
at::Tensor dequantize_4bit(const Quantized4& q, at::ScalarType dtype);

}  // namespace memrt::quant
