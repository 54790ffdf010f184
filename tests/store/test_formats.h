// State formats shaped as the quantized optimizers lay out Adam's state, for the store's tests
// (the quant plugin defines the real ones; these only exercise the store's axes).
#pragma once

#include <string>

#include "memrt/param_store.h"

namespace memrt::test {

// Adam's two moments as codes (`codes_per_byte` elements a byte) plus one fp32 scale per block,
// blocks starting at each parameter's first element.
inline StateFormat blockwise(const std::string& name, int64_t block, int64_t codes_per_byte, const std::string& scale) {
  StateFormat f;
  f.name = name;
  f.block = block;
  f.blocks_per_tensor = true;
  for (const std::string moment : {"exp_avg", "exp_avg_sq"}) {
    f.tensors.push_back({moment, at::kByte, codes_per_byte});
    f.tensors.push_back({moment + "." + scale, at::kFloat, block});
  }
  return f;
}

// bitsandbytes' 8-bit Adam: one u8 code per element, one fp32 absmax per block of 256.
inline StateFormat blockwise8() { return blockwise("test_blockwise8", 256, 1, "absmax"); }

// torchao's AdamW4bit: two codes a byte, one fp32 scale per 128 elements.
inline StateFormat fourbit() { return blockwise("test_4bit", 128, 2, "scale"); }

}  // namespace memrt::test
