// The built-in decoder models behind build_model (host-internal; plugins see memrt/model.h).
//
//   GPT-2: transformer.{wte, wpe, h.<i>.{ln_1, attn.{c_attn, c_proj}, ln_2, mlp.{c_fc, c_proj}},
//          ln_f}, lm_head tied to wte (or its own weight when untied)
//   Llama: model.{embed_tokens, layers.<i>.{input_layernorm, self_attn.{q,k,v,o}_proj,
//          post_attention_layernorm, mlp.{gate,up,down}_proj}, norm}, lm_head (tied or not)
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "memrt/model.h"

namespace memrt {

// Dropout as Hugging Face's models apply it: only while training and when p > 0. The fused
// kernel keeps a 1-byte mask for backward (torch.nn.functional.dropout on the CPU keeps a
// full-width copy of its scaled mask instead).
inline at::Tensor train_dropout(const at::Tensor& x, double p, bool training) {
  if (!training || p == 0.0) return x;
  return std::get<0>(at::native_dropout(x, p, true));
}

// y = x / sqrt(mean(x^2) + eps) * weight over the last dimension (Llama's RMSNorm).
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  at::Tensor forward(const at::Tensor& x);  // (..., C) -> (..., C)
  at::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

// How the rows of a packed micro-batch hold several samples (docs/tokenizers.md, "Packing"): each
// token's position in its sample, which also says where each sample starts (position 0).
// Unset (no positions): one sample per row, positions 0, 1, ... Shared by a model and its blocks;
// the engine sets it for a micro-step (the recompute of activation checkpointing, inside that
// micro-step's backward, sees the same layout) and clears it after. Attention reads it as
// ops::causal_attention's `positions`: each token attends to its own sample's tokens only.
struct SequenceLayout {
  at::Tensor positions;  // (B, T) int64
  bool packed() const { return positions.defined(); }
  // The rotary tables at `positions`, gathered by the first block's RopeCache::get and shared by
  // the others (one (B, 1, T, head_dim) pair per micro-step, not one per block).
  mutable at::Tensor rope_cos, rope_sin;
};

// Rotary position embedding tables, shared by every Llama block, computed on the device and dtype
// of the activations on first use and cached.
class RopeCache {
 public:
  RopeCache(int64_t head_dim, double theta) : head_dim_(head_dim), theta_(theta) {}
  // cos, sin: (T, head_dim) each, HF layout (the half-dim frequencies repeated twice); with a
  // packed layout, (B, 1, T, head_dim) at each token's own position.
  std::pair<at::Tensor, at::Tensor> get(int64_t seq_len, const at::TensorOptions& options,
                                        const SequenceLayout& layout = {});

 private:
  int64_t head_dim_;
  double theta_;
  std::mutex mutex_;
  at::Tensor cos_, sin_;
};

// The part every block shares: its HF prefix and its replaceable projections.
class DecoderBlock : public Block {
 public:
  explicit DecoderBlock(std::string prefix) : prefix_(std::move(prefix)) {}
  const std::string& hf_prefix() const override { return prefix_; }
  std::vector<std::string> linear_names() const override;
  torch::nn::AnyModule& linear(const std::string& name) override;
  void replace_linear(const std::string& name, torch::nn::AnyModule module) override;

 protected:
  // Registers a Linear as `parent`.`child` and as projection "<parent_name>.<child>".
  torch::nn::AnyModule& add_linear(torch::nn::Module& parent, const std::string& parent_name,
                                   const std::string& child, int64_t in, int64_t out, bool bias);

 private:
  struct Slot {
    std::string name;
    torch::nn::Module* parent;
    std::string child;
    torch::nn::AnyModule module;
  };
  Slot& slot(const std::string& name);
  std::string prefix_;
  std::vector<std::unique_ptr<Slot>> slots_;  // stable addresses: forward holds references
};

// A decoder LM built block by block: construct (embeddings), then append_block(new_block(i)) for
// each block, then finish() (final norm, lm_head). The token embedding and an untied lm_head, the
// two (V, C) tensors, are made with no rows: build_model allocates them in the dtype the store
// will keep them in, so a 16-bit frozen one never exists in fp32 beside the finished blocks.
class DecoderLM : public CausalLM {
 public:
  explicit DecoderLM(ModelShape shape) : shape_(std::move(shape)) {}
  const ModelShape& shape() const override { return shape_; }
  int64_t num_blocks() const override { return static_cast<int64_t>(blocks_.size()); }
  Block& block(int64_t i) override;

  virtual std::shared_ptr<Block> new_block(int64_t index) = 0;  // allocated, not yet appended
  void append_block(std::shared_ptr<Block> block);
  virtual void finish() = 0;
  // The packed layout of the next micro-batch: its positions (SequenceLayout), or undefined for
  // one sample per row.
  void set_layout(at::Tensor positions) {
    *layout_ = SequenceLayout();
    layout_->positions = std::move(positions);
  }
  // Parameters outside the blocks, with HF names: those that exist before the first block
  // (embeddings) and those finish() creates (final norm, untied lm_head).
  NamedTensors embedding_parameters() override = 0;
  NamedTensors final_parameters() override = 0;

  // The head in its two parts, for a loss that never holds the whole logits
  // (ops::linear_cross_entropy_sum): head(h) is ops::linear(final_norm(h), head_weight()).
  virtual at::Tensor final_norm(const at::Tensor& hidden) = 0;  // (B, T, C) -> (B, T, C)
  virtual const at::Tensor& head_weight() const = 0;             // (V, C): lm_head's, or the tied wte's
  at::Tensor head(const at::Tensor& hidden) final { return ops::linear(final_norm(hidden), head_weight()); }

 protected:
  ModelShape shape_;
  torch::nn::ModuleList layers_;  // registered by the subclass under its HF name
  std::vector<std::shared_ptr<Block>> blocks_;
  std::shared_ptr<SequenceLayout> layout_ = std::make_shared<SequenceLayout>();  // shared with the blocks
};

std::shared_ptr<DecoderLM> make_gpt2(const ModelShape& shape);
std::shared_ptr<DecoderLM> make_llama(const ModelShape& shape);

}  // namespace memrt
