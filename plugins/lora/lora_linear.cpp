#include "lora_linear.h"

#include <cmath>
#include <string>

#include <torch/nn/init.h>

#include <memrt/error.h>
#include <memrt/ops.h>

namespace memrt::lora {

double lora_scaling(const LoraOptions& o) {
  return o.rslora ? o.alpha / std::sqrt(static_cast<double>(o.r)) : o.alpha / static_cast<double>(o.r);
}

LoraLinearImpl::LoraLinearImpl(torch::nn::AnyModule base, int64_t in_features, int64_t out_features,
                               LoraOptions options)
    : base_(std::move(base)), options_(options), scaling_(lora_scaling(options)), in_features_(in_features) {
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

at::Tensor LoraLinearImpl::base_weight(at::ScalarType dtype) {
  at::NoGradGuard no_grad;
  const auto own = named_parameters(/*recurse=*/false);
  const at::Tensor* w = own.find("weight");
  if (w && at::isFloatingType(w->scalar_type())) return w->to(dtype);
  // Another format (4-bit codes): the base's forward on the identity, less its bias, is W^T.
  const at::Tensor eye = at::eye(in_features_, at::TensorOptions().dtype(dtype));
  at::Tensor wt = base_.forward<at::Tensor>(eye).to(dtype);  // (in, out)
  if (const at::Tensor b = base_bias(); b.defined()) wt = wt - b.to(dtype);
  return wt.t();
}

at::Tensor LoraLinearImpl::weight_norm(const at::Tensor& w) {
  at::NoGradGuard no_grad;
  const at::Tensor lora = at::mm(lora_B->weight, lora_A->weight).to(w.scalar_type());  // (out, in)
  return at::linalg_vector_norm(w + lora * scaling_, 2, {1}, false, std::nullopt);
}

void LoraLinearImpl::reset_parameters() {
  at::NoGradGuard no_grad;
  torch::nn::init::kaiming_uniform_(lora_A->weight, std::sqrt(5.0));
  lora_B->weight.zero_();
  if (options_.dora) lora_magnitude_vector.copy_(weight_norm(base_weight(at::kFloat)));
}

at::Tensor LoraLinearImpl::forward(const at::Tensor& x) {
  const at::Tensor y = base_.forward<at::Tensor>(x);
  if (options_.dora) {  // PEFT's order of operations (DoraLinearLayer.forward), in x's dtype
    const at::ScalarType dtype = x.scalar_type();
    const bool drop = options_.dropout > 0.0 && is_training();
    const at::Tensor h = drop ? at::dropout(x, options_.dropout, true) : x;
    const at::Tensor w = base_weight(dtype);
    const at::Tensor scale = lora_magnitude_vector.to(dtype) / weight_norm(w);  // (out)
    const at::Tensor bias = base_bias();
    // ops::linear: a 16-bit product at speed on CPUs without 16-bit GEMM too.
    const at::Tensor base_result = drop ? memrt::ops::linear(h, w) : bias.defined() ? y - bias : y;
    const at::Tensor lora = lora_B(lora_A(h.to(lora_A->weight.scalar_type()))).to(dtype);
    return (y + ((scale - 1) * base_result + scale * lora * scaling_)).to(y.scalar_type());
  }
  const at::Tensor h = options_.dropout > 0.0 ? at::dropout(x, options_.dropout, is_training()) : x;
  // As PEFT: the adapter in its own dtype, added in the wider of the two, the sum in the base's dtype.
  return (y + lora_B(lora_A(h.to(lora_A->weight.scalar_type()))) * scaling_).to(y.scalar_type());
}

}  // namespace memrt::lora
