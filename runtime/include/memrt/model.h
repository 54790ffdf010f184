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
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/linear.h>

#include "memrt/model_shape.h"
#include "memrt/ops.h"

namespace memrt {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// The projection every block starts with: torch::nn::Linear's parameters ("weight" (out, in),
// "bias") and options, its forward through memrt::ops::linear, so a 16-bit model runs at speed on
// CPUs without 16-bit GEMM. A plugin wrapping a projection reads it as torch::nn::LinearImpl.
class LinearImpl : public torch::nn::LinearImpl {
 public:
  using torch::nn::LinearImpl::LinearImpl;
  at::Tensor forward(const at::Tensor& x) { return ops::linear(x, weight, bias); }
};
TORCH_MODULE(Linear);

// One transformer block: (B, T, C) -> (B, T, C), causal self-attention and MLP with residuals.
class Block : public torch::nn::Module {
 public:
  virtual at::Tensor forward(const at::Tensor& x) = 0;
  // Hugging Face name prefix of this block's parameters, e.g. "transformer.h.3".
  virtual const std::string& hf_prefix() const = 0;

  // The linear projections the block calls, by name relative to the block, in call order:
  //   gpt2:  attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj
  //   llama: self_attn.q_proj, self_attn.k_proj, self_attn.v_proj, self_attn.o_proj,
  //          mlp.gate_proj, mlp.up_proj, mlp.down_proj
  // Each starts as a memrt::Linear (weight (out, in); GPT-2's Conv1D is transposed on load).
  virtual std::vector<std::string> linear_names() const = 0;
  // The module the block calls for projection `name`; unknown name: memrt::Error.
  virtual torch::nn::AnyModule& linear(const std::string& name) = 0;
  // Model surgery (LoRA, NF4): installs `module` — anything with
  // `at::Tensor forward(const at::Tensor&)` — as projection `name`, registered under the same
  // name, so its parameters appear as "<hf_prefix>.<name>.<its own names>" (a LoRA wrapper
  // keeping the original as child "base_layer" gives PEFT's names). Unknown name: memrt::Error.
  virtual void replace_linear(const std::string& name, torch::nn::AnyModule module) = 0;
};

class CausalLM : public torch::nn::Module {
 public:
  virtual const ModelShape& shape() const = 0;

  virtual at::Tensor embed(const at::Tensor& tokens) = 0;  // (B, T) int64 -> (B, T, C)
  virtual int64_t num_blocks() const = 0;
  virtual Block& block(int64_t i) = 0;
  virtual at::Tensor head(const at::Tensor& hidden) = 0;   // (B, T, C) -> (B, T, V)

  // Parameters outside the blocks, with Hugging Face names: those embed() reads (the token
  // embedding first, then any position embedding), and those head() reads besides a tied token
  // embedding (final norm, untied lm_head). The host hands each segment its parameters from these.
  virtual NamedTensors embedding_parameters() = 0;
  virtual NamedTensors final_parameters() = 0;

  // The plain forward, no hooks: embed, every block, head. (B, T) -> (B, T, V).
  at::Tensor forward(const at::Tensor& tokens) {
    at::Tensor h = embed(tokens);
    for (int64_t i = 0; i < num_blocks(); ++i) h = block(i).forward(h);
    return head(h);
  }
};

// The parameters of the built-in model `shape` describes, as build_model makes them: Hugging Face
// names and memrt's shapes (every projection (out, in), GPT-2's Conv1D too), in named_parameters()
// order (ABI 2.9). What a plugin reads where another plugin's plan replaced a parameter (the
// (out, in) of a projection planned as 4-bit codes).
std::vector<std::pair<std::string, std::vector<int64_t>>> model_parameter_shapes(const ModelShape& shape);

// The Hugging Face checkpoint a model is loaded from, as plugins read it while blocks are built
// (BlockReady::checkpoint, ABI 2.7): tensors by Hugging Face name, memory-mapped, in their dtype
// and layout on disk. The host loads every parameter it can itself; a parameter a plugin replaces
// (plan_params gave it a non-floating dtype, e.g. a 4-bit base) that the file holds in the
// plugin's own format — a non-floating tensor under the parameter's name, with companions named
// "<name>.<suffix>" — is left to the plugin, which reads it here.
class CheckpointReader {
 public:
  virtual ~CheckpointReader() = default;
  virtual bool contains(const std::string& name) const = 0;
  // The tensor as stored; memrt::FileError naming the checkpoint when absent.
  virtual at::Tensor tensor(const std::string& name) const = 0;
  // The file holding `name`, for messages.
  virtual std::string file_of(const std::string& name) const = 0;
};

}  // namespace memrt
