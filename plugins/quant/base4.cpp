#include "base4.h"

#include <algorithm>

#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/linear.h>

#include <memrt/error.h>

namespace memrt::quant {

namespace {

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }
bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// A weight of a block's linear projection: inside the blocks ("transformer.h.<i>." for GPT-2,
// "model.layers.<i>." for Llama), named "<...>.weight", two-dimensional (norms are one-dimensional).
bool is_block_projection(const ParamInfo& p) {
  return (starts_with(p.name, "transformer.h.") || starts_with(p.name, "model.layers.")) &&
         ends_with(p.name, ".weight") && p.shape.size() == 2;
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace

void Base4::plan_params(std::vector<ParamInfo>& params) {
  for (ParamInfo& p : params) {
    if (p.dtype == at::kByte && shapes_.count(p.name)) {  // the built model: already quantized
      p.trainable = false;
      continue;
    }
    if (!is_block_projection(p)) continue;
    if (!at::isFloatingType(p.dtype))
      throw Error("load_in_4bit: block projection '" + p.name + "' is " + std::string(c10::toString(p.dtype)) +
                  ", not a floating-point weight that can be quantized");
    shapes_[p.name] = p.shape;
    p.shape = {(numel_of(p.shape) + 1) / 2, 1};
    p.dtype = at::kByte;
    p.trainable = false;
  }
  // A 4-bit layer is part of the frozen base, its bias too (as in QLoRA, where the base trains no
  // parameter); a later plugin may train the bias again (LoRA's `bias: all`).
  for (ParamInfo& p : params) {
    if (ends_with(p.name, ".bias") && shapes_.count(p.name.substr(0, p.name.size() - 5) + ".weight"))
      p.trainable = false;
  }
}

void Base4::quantize(Block& block) {
  if (!scratch_) {
    scratch_ = std::make_shared<TileScratch>(scratch_bytes());
  }
  for (const std::string& name : block.linear_names()) {
    const std::string weight = block.hf_prefix() + "." + name + ".weight";
    auto it = shapes_.find(weight);
    if (it == shapes_.end()) continue;  // not planned as 4-bit (plan_params decides)
    auto linear = std::dynamic_pointer_cast<torch::nn::LinearImpl>(block.linear(name).ptr());
    if (!linear)
      throw Error("load_in_4bit: projection '" + block.hf_prefix() + "." + name +
                  "' is no longer a plain linear layer when its block is built (another plugin replaced "
                  "it first); 4-bit quantization runs on the model's own projections");
    if (linear->weight.sizes().vec() != it->second)
      throw Error("load_in_4bit: '" + weight + "' has shape " + c10::str(linear->weight.sizes()) +
                  ", not the planned " + c10::str(at::IntArrayRef(it->second)));
    Quantized4 q = quantize_4bit(linear->weight.detach(), options_.type, 64, options_.double_quant);
    at::Tensor bias = linear->bias.defined() ? linear->bias : at::Tensor();
    block.replace_linear(name, torch::nn::AnyModule(Linear4bit(
                                   std::move(q), bias, options_.compute_dtype, scratch_)));
  }
}

void Base4::plan_store(StorePlan& plan) const {
  for (const auto& [name, shape] : shapes_) {
    const int64_t slot = plan.find(name);
    if (slot < 0) continue;  // removed by a later plugin's plan
    plan.set_frozen_layout(static_cast<int>(slot),
                           linear4bit_layout(name, numel_of(shape), options_.type, options_.double_quant));
  }
}

int64_t Base4::scratch_bytes() const {
  int64_t bytes = 0;
  for (const auto& [name, shape] : shapes_) {
    for (int64_t elem : {4, 2}) bytes = std::max(bytes, tile_scratch_bytes(shape[0], shape[1], elem, kTileBytes));
  }
  return bytes;
}

}  // namespace memrt::quant
