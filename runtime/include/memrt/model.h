// memrt/model.h — the decoder-only language models the host builds, as plugins see them.
//
// A model is an embedding, a stack of blocks and a head, and the host runs the blocks one at a
// time so it can fire the per-block phases around each of them, in forward and in backward:
//
//   h = model.embed(tokens)                 // (B, T) int64     -> (B, T, C)
//   for i in 0 .. num_blocks-1:
//       h = model.block(i).forward(h)       // (B, T, C)        -> (B, T, C)
//   logits = model.head(h)                  // (B, T, C)        -> (B, T, V)
//
// Parameter names (named_parameters()) are Hugging Face's, so plugins can target modules by the
// names users know ("transformer.h.0.attn.c_attn", "model.layers.0.self_attn.q_proj").
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "memrt/model_shape.h"

namespace memrt {

// One transformer block: (B, T, C) -> (B, T, C), causal self-attention and MLP with residuals.
class Block : public torch::nn::Module {
 public:
  virtual at::Tensor forward(const at::Tensor& x) = 0;
  // Hugging Face name prefix of this block's parameters, e.g. "transformer.h.3".
  virtual const std::string& hf_prefix() const = 0;
};

class CausalLM : public torch::nn::Module {
 public:
  virtual const ModelShape& shape() const = 0;

  virtual at::Tensor embed(const at::Tensor& tokens) = 0;  // (B, T) int64 -> (B, T, C)
  virtual int64_t num_blocks() const = 0;
  virtual Block& block(int64_t i) = 0;
  virtual at::Tensor head(const at::Tensor& hidden) = 0;   // (B, T, C) -> (B, T, V)

  // The plain forward, no hooks: embed, every block, head. (B, T) -> (B, T, V).
  at::Tensor forward(const at::Tensor& tokens) {
    at::Tensor h = embed(tokens);
    for (int64_t i = 0; i < num_blocks(); ++i) h = block(i).forward(h);
    return head(h);
  }
};

}  // namespace memrt
