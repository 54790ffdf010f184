// build_model: one block at a time, random (Hugging Face-style) or from a checkpoint directory.
#include "models/model_factory.h"

#include <cmath>
#include <optional>
#include <unordered_set>

#include <ATen/CPUGeneratorImpl.h>

#include "memrt/error.h"
#include "models/decoder.h"
#include "models/hf_checkpoint.h"

namespace memrt {
namespace {

ConfigError shape_error(const std::string& field, const std::string& message) {
  return ConfigError("", "model." + field, message);
}

// Hugging Face's _init_weights: Linear and Embedding weights ~ N(0, init_std), biases 0, norms 1;
// GPT-2 additionally scales every c_proj weight by 1/sqrt(2 * n_layer) (residual projections).
void init_parameter(const ModelShape& shape, const std::string& name, at::Tensor& p, double std,
                    at::Generator& gen) {
  auto ends_with = [&](const char* suffix) {
    const size_t n = std::char_traits<char>::length(suffix);
    return name.size() >= n && name.compare(name.size() - n, n, suffix) == 0;
  };
  const bool norm = shape.arch == "gpt2"
                        ? name.find(".ln_") != std::string::npos
                        : ends_with("layernorm.weight") || name == "model.norm.weight";
  if (norm && ends_with(".weight")) {
    p.fill_(1.0);
  } else if (ends_with(".bias")) {
    p.zero_();
  } else {
    if (shape.arch == "gpt2" && ends_with("c_proj.weight"))
      std /= std::sqrt(2.0 * static_cast<double>(shape.n_layer));
    if (p.device().is_cpu() && p.scalar_type() == at::kFloat && p.is_contiguous()) {
      p.normal_(0.0, std, gen);  // in place: no second copy of the largest tensor while building
    } else {
      normal_in_chunks(p, std, gen);  // drawn on the CPU: the same numbers whatever the device
    }
  }
}

}  // namespace

void normal_in_chunks(const at::Tensor& p, double std, at::Generator& gen, int64_t chunk) {
  at::NoGradGuard no_grad;
  const int64_t n = p.numel();
  at::Tensor flat = p.view({-1});
  if (n < 16 || n <= chunk) {  // one draw, as at::normal_ on the whole tensor
    flat.copy_(at::empty({n}, at::kFloat).normal_(0.0, std, gen));
    return;
  }
  // at::normal_ draws a CPU tensor of 16 or more elements as consecutive blocks of 16 (and, when
  // its size is not a multiple of 16, 16 fresh values for its last 16 elements): chunks that start
  // on a block boundary, the last one of 16 to 31 elements, draw exactly its numbers.
  chunk = std::max<int64_t>(chunk / 16 * 16, 16);
  const int64_t last = (n - 16) / 16 * 16;
  at::Tensor r = at::empty({std::max<int64_t>(chunk, 32)}, at::kFloat);
  for (int64_t i = 0; i < last;) {
    const int64_t len = std::min(chunk, last - i);
    flat.narrow(0, i, len).copy_(r.narrow(0, 0, len).normal_(0.0, std, gen));
    i += len;
  }
  flat.narrow(0, last, n - last).copy_(r.narrow(0, 0, n - last).normal_(0.0, std, gen));
}

int64_t ParamSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

void validate_shape(const ModelShape& s) {
  if (ShapeProblem p = find_shape_problem(s)) throw shape_error(p.field, p.message);
}

std::vector<std::pair<std::string, std::vector<int64_t>>> model_parameter_shapes(const ModelShape& shape) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (const ParamSpec& p : parameter_specs(shape)) out.emplace_back(p.name, p.shape);
  return out;
}

std::vector<ParamSpec> parameter_specs(const ModelShape& s) {
  validate_shape(s);
  std::vector<ParamSpec> specs;
  auto add = [&](std::string name, std::vector<int64_t> shape, int64_t block = -1,
                 bool transposed = false) {
    specs.push_back({std::move(name), std::move(shape), transposed, block});
  };
  const int64_t C = s.d_model, F = s.d_ff, V = s.vocab_size;
  if (s.arch == "gpt2") {
    add("transformer.wte.weight", {V, C});
    add("transformer.wpe.weight", {s.n_ctx, C});
    for (int64_t i = 0; i < s.n_layer; ++i) {
      const std::string p = "transformer.h." + std::to_string(i) + ".";
      add(p + "ln_1.weight", {C}, i);
      add(p + "ln_1.bias", {C}, i);
      add(p + "attn.c_attn.weight", {3 * C, C}, i, true);
      add(p + "attn.c_attn.bias", {3 * C}, i);
      add(p + "attn.c_proj.weight", {C, C}, i, true);
      add(p + "attn.c_proj.bias", {C}, i);
      add(p + "ln_2.weight", {C}, i);
      add(p + "ln_2.bias", {C}, i);
      add(p + "mlp.c_fc.weight", {F, C}, i, true);
      add(p + "mlp.c_fc.bias", {F}, i);
      add(p + "mlp.c_proj.weight", {C, F}, i, true);
      add(p + "mlp.c_proj.bias", {C}, i);
    }
    add("transformer.ln_f.weight", {C});
    add("transformer.ln_f.bias", {C});
  } else {
    const int64_t KV = s.n_kv_head * s.head_dim();
    add("model.embed_tokens.weight", {V, C});
    for (int64_t i = 0; i < s.n_layer; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      add(p + "input_layernorm.weight", {C}, i);
      add(p + "self_attn.q_proj.weight", {C, C}, i);
      add(p + "self_attn.k_proj.weight", {KV, C}, i);
      add(p + "self_attn.v_proj.weight", {KV, C}, i);
      add(p + "self_attn.o_proj.weight", {C, C}, i);
      add(p + "post_attention_layernorm.weight", {C}, i);
      add(p + "mlp.gate_proj.weight", {F, C}, i);
      add(p + "mlp.up_proj.weight", {F, C}, i);
      add(p + "mlp.down_proj.weight", {C, F}, i);
    }
    add("model.norm.weight", {C});
  }
  if (!s.tie_embeddings) add("lm_head.weight", {V, C});
  return specs;
}

std::shared_ptr<CausalLM> build_model(const ModelShape& shape, const BuildOptions& options) {
  const std::vector<ParamSpec> specs = parameter_specs(shape);  // validates the shape
  std::unordered_map<std::string, const ParamSpec*> spec_of;
  for (const auto& s : specs) spec_of[s.name] = &s;

  std::optional<HfWeights> weights;
  if (!options.weights_dir.empty()) {
    weights = HfWeights::open(options.weights_dir);
    weights->check(shape, specs, options.replaced);  // before anything is allocated
  }
  at::Generator gen = at::detail::createCPUGenerator(options.seed);

  auto fill = [&](const NamedTensors& params) {
    at::NoGradGuard no_grad;
    for (const auto& [name, param] : params) {
      at::Tensor p = param;
      auto it = spec_of.find(name);
      if (it == spec_of.end())
        throw Error("build_model: internal error: parameter '" + name + "' has no spec");
      if (p.numel() == 0 && it->second->numel() > 0) {  // made with no rows (DecoderLM): allocated here
        auto planned = options.frozen_dtypes.find(name);
        p.set_data(at::empty(it->second->shape,
                             p.options().dtype(planned != options.frozen_dtypes.end() ? planned->second : at::kFloat)));
      }
      if (weights && weights->plugin_reads(name)) {
        p.zero_();  // stored in a plugin's format: its on_block_ready reads it
      } else if (weights) {
        const std::optional<ElementRange> keep = options.held ? options.held(name) : std::nullopt;
        const at::Tensor stored = weights->read(*it->second, keep);
        if (keep) {
          p.zero_();
          if (!keep->empty()) p.view(-1).narrow(0, keep->begin, keep->size()).copy_(stored);
        } else {
          p.copy_(stored);  // converts bf16/fp16 on disk to fp32
        }
        weights->drop_pages(*it->second);  // the file need not stay resident
      } else
        init_parameter(shape, name, p, options.init_std, gen);
    }
  };

  // A finished segment's frozen parameters in the dtype the store will keep them in.
  auto settle = [&](const NamedTensors& params) {
    at::NoGradGuard no_grad;
    for (const auto& [name, param] : params) {
      auto it = options.frozen_dtypes.find(name);
      if (it != options.frozen_dtypes.end() && param.is_floating_point() && param.scalar_type() != it->second) {
        at::Tensor p = param;
        p.set_data(p.to(it->second));
      }
    }
  };
  auto built = [&](int64_t segment, const NamedTensors& params, const NamedTensors& buffers) {
    if (options.on_segment_built) options.on_segment_built(segment, params, buffers);
  };
  std::shared_ptr<DecoderLM> model = shape.arch == "gpt2" ? make_gpt2(shape) : make_llama(shape);
  fill(model->embedding_parameters());
  settle(model->embedding_parameters());
  built(-1, model->embedding_parameters(), {});
  for (int64_t i = 0; i < shape.n_layer; ++i) {
    std::shared_ptr<Block> block = model->new_block(i);
    auto block_named = [&](bool buffers) {
      NamedTensors out;
      for (const auto& item : buffers ? block->named_buffers(/*recurse=*/true) : block->named_parameters(/*recurse=*/true))
        out.emplace_back(block->hf_prefix() + "." + item.key(), item.value());
      return out;
    };
    fill(block_named(false));
    model->append_block(block);
    if (options.on_block_ready) options.on_block_ready(i, *block, weights ? &*weights : nullptr);
    settle(block_named(false));  // what on_block_ready left floating (a quantized block's norms)
    built(i, block_named(false), block_named(true));
  }
  model->finish();
  fill(model->final_parameters());
  settle(model->final_parameters());
  built(shape.n_layer, model->final_parameters(), {});
  return model;
}

namespace {

at::Tensor lm_loss(const at::Tensor& logits, const at::Tensor& targets, at::Reduction::Reduction reduction) {
  if (logits.dim() != 3 || targets.dim() != 2 || logits.size(0) != targets.size(0) ||
      logits.size(1) != targets.size(1))
    throw Error("causal LM loss: expected logits (B, T, V) and targets (B, T), got " +
                c10::str(logits.sizes()) + " and " + c10::str(targets.sizes()));
  if (targets.scalar_type() != at::kLong)
    throw Error("causal LM loss: targets must be int64 token ids, got " +
                std::string(c10::toString(targets.scalar_type())));
  const int64_t V = logits.size(2);
  // 16-bit logits are upcast first (as Hugging Face models do): the log-probabilities of a large
  // vocabulary need fp32.
  const at::Tensor l = logits.scalar_type() == at::kFloat ? logits : logits.to(at::kFloat);
  return at::cross_entropy_loss(l.reshape({-1, V}), targets.reshape({-1}), {}, reduction);  // scalar, fp32
}

}  // namespace

at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& targets) {
  return lm_loss(logits, targets, at::Reduction::Mean);
}

at::Tensor causal_lm_loss_sum(const at::Tensor& logits, const at::Tensor& targets) {
  return lm_loss(logits, targets, at::Reduction::Sum);
}

int64_t count_parameters(const CausalLM& model) {
  std::unordered_set<const c10::TensorImpl*> seen;
  int64_t n = 0;
  for (const at::Tensor& p : model.parameters(/*recurse=*/true))
    if (seen.insert(p.unsafeGetTensorImpl()).second) n += p.numel();
  return n;
}

}  // namespace memrt
