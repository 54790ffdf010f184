// Pieces shared by the GPT-2 and Llama models: RMSNorm, rotary tables, replaceable projections,
// the block-by-block container.
#include <algorithm>

#include "memrt/error.h"
#include "memrt/memory.h"
#include "memrt/ops.h"
#include "models/decoder.h"

namespace memrt {

// ---- RMSNorm ----------------------------------------------------------------------------------

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", at::ones({dim}));  // (C)
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  return at::rms_norm(x, {weight.size(0)}, weight, eps_);  // (..., C)
}

// ---- rotary tables ----------------------------------------------------------------------------

std::pair<at::Tensor, at::Tensor> RopeCache::get(int64_t seq_len, const at::TensorOptions& options,
                                                  const SequenceLayout& layout) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!cos_.defined() || cos_.size(0) < seq_len || cos_.device() != options.device() ||
      cos_.scalar_type() != options.dtype().toScalarType()) {
    const int64_t rows = std::max<int64_t>(seq_len, cos_.defined() ? cos_.size(0) : 0);
    auto f64 = at::TensorOptions().dtype(at::kDouble);
    // inv_freq[i] = theta^(-2i / head_dim), i < head_dim / 2                          // (D/2)
    at::Tensor inv_freq = at::pow(theta_, -at::arange(0, head_dim_, 2, f64) / double(head_dim_));
    at::Tensor freqs = at::outer(at::arange(rows, f64), inv_freq);                     // (T, D/2)
    at::Tensor angles = at::cat({freqs, freqs}, -1);                                   // (T, D)
    cos_ = angles.cos().to(options);
    sin_ = angles.sin().to(options);
    // Built inside the first forward, kept by the model for good: not an activation.
    memory::claim(cos_, memory::Category::kOther);
    memory::claim(sin_, memory::Category::kOther);
  }
  if (!layout.packed()) return {cos_.narrow(0, 0, seq_len), sin_.narrow(0, 0, seq_len)};
  if (!layout.rope_cos.defined() || layout.rope_cos.scalar_type() != cos_.scalar_type() ||
      layout.rope_cos.device() != cos_.device()) {
    const at::Tensor& pos = layout.positions;  // (B, T)
    auto at_positions = [&](const at::Tensor& table) {
      return table.index_select(0, pos.reshape({-1}).to(table.device())).view({pos.size(0), 1, pos.size(1), head_dim_});
    };
    layout.rope_cos = at_positions(cos_);
    layout.rope_sin = at_positions(sin_);
  }
  return {layout.rope_cos, layout.rope_sin};  // (B, 1, T, hd) each
}

// ---- blocks -----------------------------------------------------------------------------------

std::vector<std::string> DecoderBlock::linear_names() const {
  std::vector<std::string> names;
  for (const auto& s : slots_) names.push_back(s->name);
  return names;
}

DecoderBlock::Slot& DecoderBlock::slot(const std::string& name) {
  for (auto& s : slots_)
    if (s->name == name) return *s;
  std::string known;
  for (const auto& s : slots_) known += (known.empty() ? "" : ", ") + s->name;
  throw Error(prefix_ + ": no linear projection named '" + name + "' (this block has: " + known +
              ")");
}

torch::nn::AnyModule& DecoderBlock::linear(const std::string& name) { return slot(name).module; }

void DecoderBlock::replace_linear(const std::string& name, torch::nn::AnyModule module) {
  Slot& s = slot(name);
  if (module.is_empty()) throw Error(prefix_ + "." + name + ": replace_linear given an empty module");
  s.parent->replace_module(s.child, module.ptr());
  s.module = std::move(module);
}

torch::nn::AnyModule& DecoderBlock::add_linear(torch::nn::Module& parent,
                                               const std::string& parent_name,
                                               const std::string& child, int64_t in, int64_t out,
                                               bool bias) {
  auto lin = parent.register_module(child, Linear(  // weight (out, in)
                                               torch::nn::LinearOptions(in, out).bias(bias)));
  slots_.push_back(std::make_unique<Slot>(
      Slot{parent_name + "." + child, &parent, child, torch::nn::AnyModule(lin)}));
  return slots_.back()->module;
}

// ---- the model container ----------------------------------------------------------------------

Block& DecoderLM::block(int64_t i) {
  if (i < 0 || i >= num_blocks())
    throw Error("model: block index " + std::to_string(i) + " out of range [0, " +
                std::to_string(num_blocks()) + ")");
  return *blocks_[static_cast<size_t>(i)];
}

void DecoderLM::append_block(std::shared_ptr<Block> block) {
  layers_->push_back(block);
  blocks_.push_back(std::move(block));
}

}  // namespace memrt
