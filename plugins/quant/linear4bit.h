// plugins/quant/linear4bit.h — the 4-bit linear: bitsandbytes' Linear4bit as it trains (a frozen
// NF4/FP4 weight; the input's and the bias's gradients), computed a tile of the weight at a time
// (docs/quant.md, "The 4-bit linear").
//
//   forward   y = x W^T + b in the compute dtype: for each tile of rows of W, dequantize it into the
//             shared scratch and multiply straight into y's columns of those rows
//   backward  dx = dy W: for each tile of columns of W, dequantize it again and multiply into dx's
//             columns; db = the sum of dy over tokens. Nothing of x is kept, nor any full W.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <memrt/dense_weight.h>
#include <memrt/param_store.h>

#include "blockwise.h"
#include "dequant4.h"

namespace memrt::quant {

// Bytes of weight dequantized at once (in the compute dtype) by the plugin's linears.
constexpr int64_t kTileBytes = int64_t{8} << 20;

// A tile of an (out, in) weight within `budget` bytes: forward takes `rows` rows, backward `cols`
// columns; multiples of 64 (whole quantization blocks of a row when `in` is a multiple of 64) and at
// least 64, never more than the weight has.
struct TileShape {
  int64_t rows = 0;
  int64_t cols = 0;
};
TileShape tile_shape(int64_t out, int64_t in, int64_t elem_bytes, int64_t budget);
// The scratch such a linear needs: its larger tile.
int64_t tile_scratch_bytes(int64_t out, int64_t in, int64_t elem_bytes, int64_t budget);

// W[r0:r1, c0:c1] of the (out, in) weight `q` holds (q.shape), dequantized into `dst` — contiguous
// (r1 - r0, c1 - c0) in fp32, bf16 or fp16 — exactly as bitsandbytes' dequantize_4bit computes those
// elements: map4[code] * scale in fp32, then dst's dtype (nearest-even). `dmap` is the signed dynamic
// map (256 fp32) for a double-quantized q. `kernels`: the inner loop's instruction set (dequant4.h).
void dequantize_4bit_tile(const Quantized4& q, const float* dmap, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                          const at::Tensor& dst, ops::CpuKernels kernels = ops::CpuKernels::kBest);

// One buffer every 4-bit linear of a model dequantizes into (forward and backward run one linear at
// a time), allocated at its largest size up front and claimed as `other`.
class TileScratch {
 public:
  explicit TileScratch(int64_t bytes);
  // A contiguous (rows, cols) view of `dtype` at its start; throws when it does not fit.
  at::Tensor tile(int64_t rows, int64_t cols, at::ScalarType dtype) const;
  int64_t bytes() const { return buffer_.numel(); }

 private:
  at::Tensor buffer_;  // uint8
};

// The frozen layout of 4-bit linear weight `weight_name` ("<module>.weight") of `numel` elements:
// the packed codes (the parameter, uint8 [ceil(numel / 2), 1]), then its module's buffers
// "<module>.weight_absmax" (uint8 codes with double quantization, else fp32; one per block of 64)
// and, with double quantization, "<module>.weight_nested_absmax" (fp32, one per 256 blocks) and
// "<module>.weight_offset" (fp32, 0-d); every one quant_state. Format "nf4" or "fp4".
FrozenLayout linear4bit_layout(const std::string& weight_name, int64_t numel, Map4 type, bool double_quant);

// bitsandbytes' Linear4bit: parameters "weight" (the packed codes, frozen) and "bias" (as given:
// trainable or not), buffers "weight_absmax" and, double-quantized, "weight_nested_absmax" and
// "weight_offset". The input is cast to the compute dtype (bnb_4bit_compute_dtype; unset: the
// input's) and the output back to the input's dtype, as bitsandbytes does. Tiles take up to
// `tile_budget` bytes of `scratch`, which must hold tile_scratch_bytes(..., tile_budget).
class Linear4bitImpl : public torch::nn::Module, public DenseWeight {
 public:
  Linear4bitImpl(Quantized4 q, const at::Tensor& bias, std::optional<at::ScalarType> compute_dtype,
                 std::shared_ptr<const TileScratch> scratch, int64_t tile_budget = kTileBytes);
  at::Tensor forward(const at::Tensor& x);

  int64_t out_features() const { return q_.shape[0]; }
  int64_t in_features() const { return q_.shape[1]; }
  at::Tensor bias;  // undefined without one

  // y (M, out) in the compute dtype = x (M, in) W^T (+ bias), and dx (M, in) = dy (M, out) W.
  at::Tensor multiply(const at::Tensor& x, const at::Tensor& bias) const;
  at::Tensor multiply_transposed(const at::Tensor& dy) const;
  // memrt::DenseWeight: rows of W dequantized as forward does (in the compute dtype), then `dtype`.
  at::Tensor dense_rows(int64_t r0, int64_t r1, at::ScalarType dtype) const override;

 private:
  Quantized4 q_;
  std::optional<at::ScalarType> compute_dtype_;
  std::shared_ptr<const TileScratch> scratch_;
  int64_t tile_budget_;
};
TORCH_MODULE(Linear4bit);

}  // namespace memrt::quant
