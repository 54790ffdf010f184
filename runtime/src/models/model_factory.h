// Building the built-in decoder models (GPT-2 and Llama style) from a ModelShape, one block at a
// time, with random initialisation or weights from a Hugging Face checkpoint directory.
//
//   ModelShape shape = read_hf_config(dir);          // or a shape from train.yaml's model: block
//   BuildOptions opt;  opt.weights_dir = dir;        // empty: Hugging Face-style random init
//   opt.on_block_ready = [&](int64_t i, Block& b) { /* quantize / partition block i */ };
//   std::shared_ptr<CausalLM> model = build_model(shape, opt);
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "memrt/model.h"
#include "memrt/model_shape.h"
#include "memrt/param_store.h"

namespace memrt {

struct BuildOptions {
  double init_std = 0.02;
  uint64_t seed = 0;
  std::string weights_dir;  // a Hugging Face checkpoint directory to load weights from; empty = random init
  // Called once per block, in order, as soon as the block exists with its final weights (random
  // or loaded), so a plugin can quantize or partition it before the next block is materialised;
  // `checkpoint` is the weights_dir's tensors (nullptr without one).
  std::function<void(int64_t index, Block& block, const CheckpointReader* checkpoint)> on_block_ready;
  // Parameters a plugin replaces (planned with a non-floating dtype): stored in the plugin's format
  // they are left to on_block_ready (zero until then), in floating point loaded as usual.
  std::set<std::string> replaced;
  // Frozen parameters the parameter store will hold in another floating dtype (a 16-bit base under
  // LoRA): cast as each segment is finished (after on_block_ready), so the whole model is never in
  // fp32 at once — a frozen 16-bit base costs 2 bytes a parameter while it is built, not 4.
  std::map<std::string, at::ScalarType> frozen_dtypes;
  // Called once per segment as soon as it is finished (after on_block_ready and the casts above):
  // the embedding (-1), each block (its index), the final norm and untied lm_head (n_layer), with
  // the segment's parameters and module buffers by their Hugging Face names — so that the caller
  // takes them into the parameter store before the next segment exists.
  std::function<void(int64_t segment, const NamedTensors& params, const NamedTensors& buffers)> on_segment_built;
  // With weights_dir: the flat elements [begin, end) of a parameter (by Hugging Face name) this
  // process keeps, or none when it keeps the whole tensor. A parameter with a range is read from
  // the checkpoint for those elements alone (only their pages of the file are touched, where the
  // file's layout is the model's: a GPT-2 Conv1D weight is transposed on disk, so its slice is
  // gathered from every page) and the rest of it is zero — ZeRO-3's partitioned weights, whose
  // other elements this rank never keeps. Random init ignores it (the generator draws them all).
  std::function<std::optional<ElementRange>(const std::string& name)> held;
};

// Builds the model (fp32, CPU). Order: embeddings, then for each block: allocate, initialise or
// load, on_block_ready; then the final norm and (untied) lm_head. With weights_dir, the
// checkpoint is checked against the shape (every tensor present, none unexpected, shapes and
// dtypes) before anything is allocated. Errors: memrt::ConfigError (bad shape), FileError (files).
std::shared_ptr<CausalLM> build_model(const ModelShape& shape, const BuildOptions& options);

// Fills `p` (contiguous, any floating dtype) with N(0, std) as one fp32 at::normal_ over all its
// elements would — the same numbers from the same generator — drawing `chunk` elements at a time
// into an fp32 buffer, so a 16-bit tensor is initialised without an fp32 copy of itself.
void normal_in_chunks(const at::Tensor& p, double std, at::Generator& gen, int64_t chunk = int64_t{1} << 16);

// Mean cross-entropy of next-token prediction, in fp32. logits (B, T, V) float (16-bit logits are
// upcast), targets (B, T) int64
// (already shifted: targets[b, t] is the token after position t); targets of -100 are ignored.
// Returns a scalar.
at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& targets);
// The sum of the token losses instead of their mean (targets of -100 add nothing).
at::Tensor causal_lm_loss_sum(const at::Tensor& logits, const at::Tensor& targets);

// Number of parameter elements; shared (tied) parameters counted once.
int64_t count_parameters(const CausalLM& model);

// One parameter of a model as built (before any plugin surgery), by shapes alone.
struct ParamSpec {
  std::string name;            // Hugging Face name, e.g. "transformer.h.0.attn.c_attn.weight"
  std::vector<int64_t> shape;  // in the model (nn::Linear: (out, in))
  bool transposed_on_disk = false;  // GPT-2 Conv1D weights: (in, out) in HF files
  int64_t block = -1;          // block index, -1 for embeddings / final norm / head
  int64_t numel() const;
};

// Every parameter of the model `shape` describes, in named_parameters() order (the tied lm_head
// is absent, as in Hugging Face). Allocates nothing: for memory estimates and checkpoint checks.
std::vector<ParamSpec> parameter_specs(const ModelShape& shape);

// Throws memrt::ConfigError naming the field when `shape` cannot be built (unknown arch, a width
// not divisible by the heads, n_head not a multiple of n_kv_head, odd Llama head_dim, ...).
void validate_shape(const ModelShape& shape);

}  // namespace memrt
