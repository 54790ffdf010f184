#include "lora_linear.h"

#include <cmath>
#include <string>

#include <torch/nn/init.h>

#include <memrt/error.h>

namespace memrt::lora {

double lora_scaling(const LoraOptions& o) {
  return o.rslora ? o.alpha / std::sqrt(static_cast<double>(o.r)) : o.alpha / static_cast<double>(o.r);
}

LoraLinearImpl::LoraLinearImpl(torch::nn::AnyModule base, int64_t in_features, int64_t out_features,
                               LoraOptions options)
    : base_(std::move(base)), options_(options), scaling_(lora_scaling(options)) {
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
  reset_parameters();
}

void LoraLinearImpl::reset_parameters() {
  at::NoGradGuard no_grad;
  torch::nn::init::kaiming_uniform_(lora_A->weight, std::sqrt(5.0));
  lora_B->weight.zero_();
}

at::Tensor LoraLinearImpl::forward(const at::Tensor& x) {
  const at::Tensor y = base_.forward<at::Tensor>(x);
  const at::Tensor h = options_.dropout > 0.0 ? at::dropout(x, options_.dropout, is_training()) : x;
  // As PEFT: the adapter in its own dtype, added in the wider of the two, the sum in the base's dtype.
  return (y + lora_B(lora_A(h.to(lora_A->weight.scalar_type()))) * scaling_).to(y.scalar_type());
}

}  // namespace memrt::lora
