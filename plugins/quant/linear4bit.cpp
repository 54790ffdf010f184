#include "linear4bit.h"

#include <algorithm>
#include <array>
#include <utility>

#include <torch/autograd.h>

#include <memrt/error.h>
#include <memrt/memory.h>
#include <memrt/ops.h>

#include "cpu_loops.h"
#include "dequant4.h"

namespace memrt::quant {

namespace {

constexpr int64_t kBlocks64 = 64;  // tiles are whole multiples of this many rows or columns

int64_t tile_extent(int64_t dim, int64_t other, int64_t elem_bytes, int64_t budget) {
  const int64_t fit = budget / std::max<int64_t>(1, other * elem_bytes) / kBlocks64 * kBlocks64;
  return std::min(dim, std::max(kBlocks64, fit));
}

// len elements from element i of the packed codes, each map[code] * s, as T: an odd first element
// alone, then whole bytes through the kernel, then a last high nibble alone.
template <typename T>
inline void dequantize_run(Dequant4Fn<T> kernel, const uint8_t* packed, int64_t i, int64_t len, const float* map,
                           float s, T* out) {
  int64_t k = 0;
  if (len > 0 && (i & 1)) out[k++] = static_cast<T>(mul_rn(map[packed[i >> 1] & 15u], s));
  const uint8_t* p = packed + ((i + k) >> 1);
  const int64_t pairs = (len - k) / 2;
  kernel(p, pairs, map, s, out + k);
  if (k + 2 * pairs < len) out[len - 1] = static_cast<T>(mul_rn(map[p[pairs] >> 4], s));
}

template <typename T>
void dequantize_tile_as(const Quantized4& q, const float* dmap, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                        T* dst, ops::CpuKernels kernels) {
  const Dequant4Fn<T> kernel = dequant4_kernel<T>(kernels);
  const int64_t in = q.shape[1], block = q.block, width = c1 - c0;
  std::array<float, 16> map{};
  for (uint32_t c = 0; c < 16; ++c) map[c] = map4_value(q.type, c);
  const uint8_t* packed = q.packed.data_ptr<uint8_t>();
  const bool nested = q.double_quant();
  const float* absmax32 = nested ? nullptr : q.absmax.data_ptr<float>();
  const uint8_t* absmax8 = nested ? q.absmax.data_ptr<uint8_t>() : nullptr;
  const float* nested_absmax = nested ? q.nested_absmax.data_ptr<float>() : nullptr;
  const float offset = nested ? q.offset.item<float>() : 0.f;
  const int64_t nested_block = q.nested_block;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, width));
  at::parallel_for(r0, r1, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      T* out = dst + (row - r0) * width;
      for (int64_t i = row * in + c0, stop = row * in + c1; i < stop;) {
        const int64_t b = i / block;
        const int64_t run = std::min(stop, (b + 1) * block) - i;
        const float s = nested ? nested_scale(dmap, absmax8[b], nested_absmax[b / nested_block], offset) : absmax32[b];
        dequantize_run(kernel, packed, i, run, map.data(), s, out);
        out += run;
        i += run;
      }
    }
  });
}

// The weight is frozen: the function's inputs are x and the bias; `self` is the module, which
// outlives every graph its forward makes (the model holds it for the run).
struct Linear4bitFunction : torch::autograd::Function<Linear4bitFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const std::optional<at::Tensor>& bias, const Linear4bitImpl* self) {
    const at::Tensor b = bias.value_or(at::Tensor());
    at::Tensor y = self->multiply(x.reshape({-1, self->in_features()}), b);
    ctx->saved_data["self"] = reinterpret_cast<int64_t>(self);
    ctx->saved_data["has_bias"] = b.defined();
    ctx->saved_data["x_shape"] = x.sizes().vec();
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = self->out_features();
    return y.view(shape);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto* self = reinterpret_cast<const Linear4bitImpl*>(ctx->saved_data["self"].toInt());
    const at::Tensor dy = grads[0].reshape({-1, self->out_features()});
    at::Tensor dx, db;
    if (ctx->needs_input_grad(0)) dx = self->multiply_transposed(dy).view(ctx->saved_data["x_shape"].toIntVector());
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(1)) db = dy.sum(0);
    return {dx, db, at::Tensor()};
  }
};

}  // namespace

TileShape tile_shape(int64_t out, int64_t in, int64_t elem_bytes, int64_t budget) {
  return {tile_extent(out, in, elem_bytes, budget), tile_extent(in, out, elem_bytes, budget)};
}

int64_t tile_scratch_bytes(int64_t out, int64_t in, int64_t elem_bytes, int64_t budget) {
  const TileShape t = tile_shape(out, in, elem_bytes, budget);
  return std::max(t.rows * in, out * t.cols) * elem_bytes;
}

void dequantize_4bit_tile(const Quantized4& q, const float* dmap, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                          const at::Tensor& dst, ops::CpuKernels kernels) {
  if (q.shape.size() != 2 || r0 < 0 || r1 > q.shape[0] || r0 > r1 || c0 < 0 || c1 > q.shape[1] || c0 > c1)
    throw Error("dequantize_4bit_tile: the tile is not inside the weight");
  if (!dst.is_contiguous() || dst.numel() != (r1 - r0) * (c1 - c0))
    throw Error("dequantize_4bit_tile: the destination must be a contiguous tile of the same size");
  switch (dst.scalar_type()) {
    case at::kFloat: return dequantize_tile_as(q, dmap, r0, r1, c0, c1, dst.data_ptr<float>(), kernels);
    case at::kBFloat16: return dequantize_tile_as(q, dmap, r0, r1, c0, c1, dst.data_ptr<c10::BFloat16>(), kernels);
    case at::kHalf: return dequantize_tile_as(q, dmap, r0, r1, c0, c1, dst.data_ptr<c10::Half>(), kernels);
    default: throw Error("dequantize_4bit_tile: dequantizes into fp32, bf16 or fp16");
  }
}

TileScratch::TileScratch(int64_t bytes) : buffer_(at::empty({bytes}, at::kByte)) {
  memory::claim(buffer_, memory::Category::kOther);
}

at::Tensor TileScratch::tile(int64_t rows, int64_t cols, at::ScalarType dtype) const {
  const int64_t need = rows * cols * static_cast<int64_t>(c10::elementSize(dtype));
  if (need > buffer_.numel())
    throw Error("4-bit linear: a tile of " + std::to_string(need) + " bytes does not fit the scratch of " +
                std::to_string(buffer_.numel()) + " (internal error: the plugin sized it for other linears)");
  return buffer_.narrow(0, 0, need).view(dtype).view({rows, cols});
}

FrozenLayout linear4bit_layout(const std::string& weight_name, int64_t numel, Map4 type, bool double_quant) {
  const std::string module = weight_name.substr(0, weight_name.size() - std::string(".weight").size());
  const int64_t blocks = (numel + 63) / 64;
  FrozenLayout l;
  l.format = type == Map4::kNf4 ? "nf4" : "fp4";
  const memory::Category q = memory::Category::kQuantState;
  l.tensors.push_back({weight_name, at::kByte, {(numel + 1) / 2, 1}, q});
  l.tensors.push_back({module + ".weight_absmax", double_quant ? at::kByte : at::kFloat, {blocks}, q});
  if (double_quant) {
    l.tensors.push_back({module + ".weight_nested_absmax", at::kFloat, {(blocks + 255) / 256}, q});
    l.tensors.push_back({module + ".weight_offset", at::kFloat, {}, q});
  }
  return l;
}

Linear4bitImpl::Linear4bitImpl(Quantized4 q, const at::Tensor& bias_in, std::optional<at::ScalarType> compute_dtype,
                               std::shared_ptr<const TileScratch> scratch, int64_t tile_budget)
    : q_(std::move(q)), compute_dtype_(compute_dtype), scratch_(std::move(scratch)), tile_budget_(tile_budget) {
  if (q_.shape.size() != 2 || q_.block != 64)
    throw Error("Linear4bit: expects a 2-D weight quantized in blocks of 64");
  dynamic_map_values(true);  // built now, while the model is, not in the first forward
  register_parameter("weight", q_.packed, /*requires_grad=*/false);
  if (bias_in.defined()) bias = register_parameter("bias", bias_in, bias_in.requires_grad());
  register_buffer("weight_absmax", q_.absmax);
  if (q_.double_quant()) {
    register_buffer("weight_nested_absmax", q_.nested_absmax);
    register_buffer("weight_offset", q_.offset);
  }
}

at::Tensor Linear4bitImpl::forward(const at::Tensor& x) {
  const at::ScalarType dtype = compute_dtype_.value_or(x.scalar_type());
  const at::Tensor b = bias.defined() ? bias.to(dtype) : at::Tensor();
  const at::Tensor y = Linear4bitFunction::apply(x.to(dtype), b.defined() ? std::optional<at::Tensor>(b) : std::nullopt, this);
  return y.to(x.scalar_type());
}

at::Tensor Linear4bitImpl::multiply(const at::Tensor& x, const at::Tensor& b) const {
  const int64_t M = x.size(0), out = out_features(), in = in_features();
  const at::ScalarType dtype = x.scalar_type();
  at::Tensor y = at::empty({M, out}, x.options());
  if (M == 0) return y;
  const TileShape t = tile_shape(out, in, static_cast<int64_t>(c10::elementSize(dtype)), tile_budget_);
  for (int64_t r = 0; r < out; r += t.rows) {
    const int64_t rows = std::min(t.rows, out - r);
    const at::Tensor w = scratch_->tile(rows, in, dtype);
    dequantize_4bit_tile(q_, dynamic_map_values(true), r, r + rows, 0, in, w);
    ops::linear_into(y.narrow(1, r, rows), x, w, b.defined() ? b.narrow(0, r, rows) : at::Tensor());
  }
  return y;
}

at::Tensor Linear4bitImpl::multiply_transposed(const at::Tensor& dy) const {
  const int64_t M = dy.size(0), out = out_features(), in = in_features();
  const at::ScalarType dtype = dy.scalar_type();
  at::Tensor dx = at::empty({M, in}, dy.options());
  if (M == 0) return dx;
  const TileShape t = tile_shape(out, in, static_cast<int64_t>(c10::elementSize(dtype)), tile_budget_);
  for (int64_t c = 0; c < in; c += t.cols) {
    const int64_t cols = std::min(t.cols, in - c);
    const at::Tensor w = scratch_->tile(out, cols, dtype);
    dequantize_4bit_tile(q_, dynamic_map_values(true), 0, out, c, c + cols, w);
    ops::linear_into(dx.narrow(1, c, cols), dy, w.t());  // dy w: w^T is the (cols, out) weight
  }
  return dx;
}

at::Tensor Linear4bitImpl::dense_rows(int64_t r0, int64_t r1, at::ScalarType dtype) const {
  if (r0 < 0 || r1 < r0 || r1 > out_features())
    throw Error("Linear4bit: rows " + std::to_string(r0) + ".." + std::to_string(r1) + " of a weight of " +
                std::to_string(out_features()) + " rows");
  at::Tensor w = at::empty({r1 - r0, in_features()}, at::TensorOptions().dtype(compute_dtype_.value_or(dtype)));
  dequantize_4bit_tile(q_, dynamic_map_values(true), r0, r1, 0, in_features(), w);
  return w.to(dtype);
}

}  // namespace memrt::quant
