#include "lora_linear.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>

#include <torch/nn/init.h>

#include <memrt/dense_weight.h>
#include <memrt/error.h>
#include <memrt/ops.h>

namespace memrt::lora {

namespace {
// Rows of W + scaling · B A made at once for DoRA's norm: the whole (out, in) sum never exists.
constexpr int64_t kNormTileBytes = int64_t{8} << 20;
}  // namespace

double lora_scaling(const LoraOptions& o) {
  return o.rslora ? o.alpha / std::sqrt(static_cast<double>(o.r)) : o.alpha / static_cast<double>(o.r);
}

at::Tensor init_from_weight(const at::Tensor& w, const LoraOptions& options, FromBase& from) {
  at::NoGradGuard no_grad;
  const at::Tensor w32 = w.to(at::kFloat);
  const int64_t r = options.r, rank = std::min(w32.size(0), w32.size(1));
  if (r > rank)
    throw Error("LoRA: init_lora_weights \"" + std::string(options.init == LoraInit::kPissa ? "pissa" : "olora") +
                "\" takes r = " + std::to_string(r) + " components of a " + std::to_string(w32.size(0)) + " x " +
                std::to_string(w32.size(1)) + " weight, which has " + std::to_string(rank) + "; use a smaller lora_r");
  const double scaling = lora_scaling(options);
  if (options.init == LoraInit::kPissa) {
    // W = V diag(S) Uh; each adapter takes the square root of the scaled-down singular values.
    const auto [v, s, uh] = at::linalg_svd(w32, /*full_matrices=*/false);
    const at::Tensor root = (s.narrow(0, 0, r) / scaling).sqrt();
    // Products by a diagonal, element by element: PEFT's diag(...) @ sums one such product and zeros.
    from.a = (root.unsqueeze(1) * uh.narrow(0, 0, r)).contiguous();  // diag(sqrt(S_r)) Uh_r: (r, in)
    from.b = (v.narrow(1, 0, r) * root.unsqueeze(0)).contiguous();   // V_r diag(sqrt(S_r)): (out, r)
  } else if (options.init == LoraInit::kOlora) {
    const auto [q, rr] = at::linalg_qr(w32);  // reduced
    // Copies of their own, not views keeping all of Q and R alive.
    from.a = rr.narrow(0, 0, r).clone(at::MemoryFormat::Contiguous);
    from.b = q.narrow(1, 0, r).clone(at::MemoryFormat::Contiguous);
  } else {
    throw Error("LoRA: init_from_weight is for PiSSA and OLoRA");
  }
  return w32 - at::mm(from.b * scaling, from.a);  // PEFT's (scaling * B) @ A, in its order
}

LoraLinearImpl::LoraLinearImpl(torch::nn::AnyModule base, int64_t in_features, int64_t out_features,
                               LoraOptions options, FromBase from_base)
    : base_(std::move(base)), options_(options), from_base_(std::move(from_base)), scaling_(lora_scaling(options)),
      in_features_(in_features) {
  if (options_.r <= 0) throw Error("LoRA: rank r must be positive, got " + std::to_string(options_.r));
  if (options_.dropout < 0.0 || options_.dropout >= 1.0)
    throw Error("LoRA: lora_dropout must be in [0, 1), got " + std::to_string(options_.dropout));
  // The base's tensors under their own names (not the base as a child: "<t>.weight" stays).
  const std::shared_ptr<torch::nn::Module> inner = base_.ptr();
  for (const auto& p : inner->named_parameters(/*recurse=*/false)) register_parameter(p.key(), p.value(), p.value().requires_grad());
  for (const auto& b : inner->named_buffers(/*recurse=*/false)) register_buffer(b.key(), b.value());
  if (!inner->named_children().is_empty())
    throw Error("LoRA: the layer to adapt has submodules; only a flat linear layer can be wrapped");
  lora_A = register_module("lora_A", memrt::Linear(torch::nn::LinearOptions(in_features, options_.r).bias(false)));
  lora_B = register_module("lora_B", memrt::Linear(torch::nn::LinearOptions(options_.r, out_features).bias(false)));
  if (options_.dora) lora_magnitude_vector = register_parameter("lora_magnitude_vector", at::empty({out_features}, at::kFloat));
  reset_parameters();
}

at::Tensor LoraLinearImpl::base_bias() const {
  const auto own = named_parameters(/*recurse=*/false);
  const at::Tensor* b = own.find("bias");
  return b ? *b : at::Tensor();
}

at::Tensor LoraLinearImpl::base_weight_parameter() const {
  const auto own = named_parameters(/*recurse=*/false);
  const at::Tensor* w = own.find("weight");
  return w && at::isFloatingType(w->scalar_type()) ? *w : at::Tensor();
}

at::Tensor LoraLinearImpl::base_rows(int64_t r0, int64_t r1, at::ScalarType dtype) const {
  at::NoGradGuard no_grad;
  if (const at::Tensor w = base_weight_parameter(); w.defined()) return w.narrow(0, r0, r1 - r0).to(dtype);
  if (const auto* dense = dynamic_cast<const DenseWeight*>(base_.ptr().get())) return dense->dense_rows(r0, r1, dtype);
  throw Error("LoRA: DoRA needs the weight of the layer it adapts, and " + base_.ptr()->name() +
              " has no floating \"weight\" and does not implement memrt::DenseWeight (memrt/dense_weight.h): "
              "the plugin that made the layer should implement it, or train this target without use_dora");
}

at::Tensor LoraLinearImpl::weight_norm(at::ScalarType dtype) const {
  at::NoGradGuard no_grad;
  const int64_t out = lora_B->weight.size(0);
  const int64_t row_bytes = in_features_ * static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t rows = std::max<int64_t>(1, kNormTileBytes / row_bytes);
  at::Tensor norm = at::empty({out}, at::TensorOptions().dtype(dtype));
  for (int64_t r0 = 0; r0 < out; r0 += rows) {
    const int64_t r1 = std::min(out, r0 + rows);
    const at::Tensor lora = at::mm(lora_B->weight.narrow(0, r0, r1 - r0), lora_A->weight).to(dtype);  // (rows, in)
    norm.narrow(0, r0, r1 - r0).copy_(at::linalg_vector_norm(base_rows(r0, r1, dtype) + lora * scaling_, 2, {1}, false,
                                                             std::nullopt));
  }
  return norm;
}

void LoraLinearImpl::reset_parameters() {
  at::NoGradGuard no_grad;
  const at::Tensor& a = lora_A->weight;  // (r, in)
  const at::Tensor& b = lora_B->weight;  // (out, r)
  const int64_t r = options_.r;
  switch (options_.init) {
    case LoraInit::kDefault:
      torch::nn::init::kaiming_uniform_(a, std::sqrt(5.0));
      b.zero_();
      break;
    case LoraInit::kGaussian:
      a.normal_(0.0, 1.0 / static_cast<double>(r));
      b.zero_();
      break;
    case LoraInit::kOrthogonal: {
      // Rows of one orthogonal matrix, odd ones for A and even ones for B: their products vanish,
      // so B A = 0 while neither is zero (PEFT's orthogonal_init, its draws in its order).
      if (r % 2 != 0)
        throw Error("LoRA: init_lora_weights \"orthogonal\" needs an even rank, got r = " + std::to_string(r));
      const at::Tensor q = std::get<0>(at::linalg_qr(at::randn({r, r})));
      const at::Tensor q_odd = q.slice(0, 0, r, 2);
      const at::Tensor q_even = q.slice(0, 1, r, 2);
      const at::Tensor new_a = at::randn({in_features_, r / 2}).mm(q_odd).t() / 10.0;
      const at::Tensor new_b = at::randn({r / 2, b.size(0)}).t().mm(q_even) / 10.0;
      a.copy_(new_a);
      b.copy_(new_b);
      break;
    }
    case LoraInit::kLinear:
      break;  // nn.Linear's own kaiming-uniform init of both, drawn when they were made
    case LoraInit::kPissa:
    case LoraInit::kOlora:
      if (!from_base_.a.defined() || !from_base_.b.defined())
        throw Error("LoRA: PiSSA's and OLoRA's adapters start from the base weight, taken while it is whole "
                    "(init_from_weight, in the lora plugin's on_block_ready); none was given");
      a.copy_(from_base_.a);
      b.copy_(from_base_.b);
      break;
  }
  if (options_.dora) {
    if (options_.init == LoraInit::kLinear || init_from_base(options_.init))
      throw Error("LoRA: DoRA with init_lora_weights false, \"pissa\" or \"olora\" is not built (its magnitudes "
                  "would need the whole W + scaling * B A at init); use true, \"gaussian\" or \"orthogonal\"");
    lora_magnitude_vector.copy_(from_base_.norm.defined() ? from_base_.norm : weight_norm(at::kFloat));
  }
  from_base_ = FromBase{};
}

at::Tensor LoraLinearImpl::forward(const at::Tensor& x) {
  const at::Tensor y = base_.forward<at::Tensor>(x);
  if (options_.dora) {  // PEFT's order of operations (DoraLinearLayer.forward), in x's dtype
    const at::ScalarType dtype = x.scalar_type();
    const bool drop = options_.dropout > 0.0 && is_training();
    const at::Tensor h = drop ? at::dropout(x, options_.dropout, true) : x;
    const at::Tensor scale = lora_magnitude_vector.to(dtype) / weight_norm(dtype);  // (out)
    const at::Tensor bias = base_bias();
    // x_d W^T: the base's output less its bias, unless dropout changed x; then the product by a
    // floating weight (ops::linear: a 16-bit product at speed on CPUs without 16-bit GEMM too), or
    // the base's own forward for one in another format (which multiplies by the same W).
    at::Tensor base_result = bias.defined() ? y - bias : y;
    if (drop) {
      const at::Tensor w = base_weight_parameter();
      base_result = w.defined() ? memrt::ops::linear(h, w.to(dtype)) : base_.forward<at::Tensor>(h).to(dtype);
      if (!w.defined() && bias.defined()) base_result = base_result - bias.to(dtype);
    }
    const at::Tensor lora = lora_B(lora_A(h.to(lora_A->weight.scalar_type()))).to(dtype);
    // (s - 1) · base_result + (s · lora) · scaling, added to y: PEFT's operations in its order, one
    // statement each so that each (tokens, out) temporary is freed as soon as it is used.
    at::Tensor adapted = scale * lora;
    adapted = adapted * scaling_;
    at::Tensor dora = (scale - 1) * base_result;
    dora = dora + adapted;
    adapted.reset();
    return (y + dora).to(y.scalar_type());
  }
  const at::Tensor h = options_.dropout > 0.0 ? at::dropout(x, options_.dropout, is_training()) : x;
  // As PEFT: the adapter in its own dtype, added in the wider of the two, the sum in the base's
  // dtype. One statement each: B's output is freed once scaled, so the forward holds three (tokens,
  // out) tensors at once, as PEFT's does — one expression would keep its temporaries to the end, four
  // (docs/lora.md). (Not in place: the base's output may be a custom Function's view.)
  at::Tensor lora = lora_B(lora_A(h.to(lora_A->weight.scalar_type())));
  lora = lora * scaling_;
  return (y + lora).to(y.scalar_type());
}

}  // namespace memrt::lora
