// State formats shaped as the quantized optimizers lay out Adam's state, for the store's tests
// (the quant plugin defines the real ones; these only exercise the store's axes).
#pragma once

#include "memrt/param_store.h"

namespace memrt::test {

// bitsandbytes' 8-bit Adam: per moment one u8 code per element and one fp32 absmax per block of
// 256, blocks starting at each parameter's first element.
inline StateFormat blockwise8() {
  StateFormat f;
  f.name = "test_blockwise8";
  f.block = 256;
  f.blocks_per_tensor = true;
  f.tensors = {{"exp_avg", at::kByte, 1}, {"exp_avg.absmax", at::kFloat, 256},
               {"exp_avg_sq", at::kByte, 1}, {"exp_avg_sq.absmax", at::kFloat, 256}};
  return f;
}

// torchao's AdamW4bit: two codes a byte, one fp32 scale per 128 elements.
inline StateFormat fourbit() {
  StateFormat f;
  f.name = "test_4bit";
  f.block = 128;
  f.blocks_per_tensor = true;
  f.tensors = {{"exp_avg", at::kByte, 2}, {"exp_avg.scale", at::kFloat, 128},
               {"exp_avg_sq", at::kByte, 2}, {"exp_avg_sq.scale", at::kFloat, 128}};
  return f;
}

}  // namespace memrt::test
