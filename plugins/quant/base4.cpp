#include "base4.h"

#include <algorithm>

#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/linear.h>

#include <memrt/config_node.h>
#include <memrt/error.h>
#include <memrt/plugin.h>

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

Quantized4 read_bnb4bit(const CheckpointReader& checkpoint, const std::string& name,
                        const std::vector<int64_t>& shape, const Base4Options& options) {
  const std::string file = checkpoint.file_of(name);
  const auto fail = [&](const std::string& tensor, const std::string& what) {
    return FileError(file, "tensor '" + tensor + "': " + what);
  };
  const char* type_name = options.type == Map4::kNf4 ? "nf4" : "fp4";
  const std::string state_name = name + ".quant_state.bitsandbytes__" + type_name;
  if (!checkpoint.contains(state_name)) {
    const char* other = options.type == Map4::kNf4 ? "fp4" : "nf4";
    throw fail(name, std::string("stored as uint8 codes but without '") + state_name + "'" +
                         (checkpoint.contains(name + ".quant_state.bitsandbytes__" + other)
                              ? std::string(": it is quantized as ") + other + " while config.json's quantization_config says " +
                                    type_name
                              : ": not a bitsandbytes 4-bit weight as transformers saves one"));
  }
  // The quant_state: a uint8 tensor holding QuantState.as_dict()'s JSON.
  const at::Tensor state_bytes = checkpoint.tensor(state_name).contiguous();
  const std::string text(reinterpret_cast<const char*>(state_bytes.data_ptr<uint8_t>()),
                         static_cast<size_t>(state_bytes.numel()));
  const ConfigNode state = parse_json_text(text, file + " (tensor '" + state_name + "')");
  const auto field = [&](const char* key) -> const ConfigNode& {
    const ConfigNode* n = state.find(key);
    if (!n) throw fail(state_name, std::string("the quant_state has no '") + key + "'");
    return *n;
  };
  if (field("quant_type").as_string() != type_name)
    throw fail(state_name, "quant_type is \"" + field("quant_type").as_string() + "\", not \"" + type_name + "\"");
  if (field("blocksize").as_int() != 64)
    throw fail(state_name, "blocksize is " + std::to_string(field("blocksize").as_int()) +
                               "; memrt's 4-bit bases use bitsandbytes' default of 64: quantize the "
                               "full-precision model again, or load it and let load_in_4bit quantize it");
  std::vector<int64_t> stored_shape;
  for (const ConfigNode& d : field("shape").as_array()) stored_shape.push_back(d.as_int());
  if (stored_shape != shape)
    throw fail(state_name, "shape is " + c10::str(at::IntArrayRef(stored_shape)) + " but config.json's model needs " +
                               c10::str(at::IntArrayRef(shape)));
  const int64_t n = shape[0] * shape[1];
  const int64_t blocks = (n + 63) / 64;
  const auto read = [&](const std::string& tensor, at::ScalarType dtype, std::vector<int64_t> want) {
    if (!checkpoint.contains(tensor)) throw fail(tensor, "missing (the bitsandbytes 4-bit weight '" + name + "' needs it)");
    const at::Tensor t = checkpoint.tensor(tensor);
    if (t.scalar_type() != dtype || t.sizes().vec() != want)
      throw fail(tensor, std::string("is ") + c10::toString(t.scalar_type()) + " " + c10::str(t.sizes()) + ", expected " +
                             c10::toString(dtype) + " " + c10::str(at::IntArrayRef(want)));
    return t.clone();  // out of the mapped file
  };
  const auto same_map = [&](const std::string& tensor, const at::Tensor& want) {
    const at::Tensor got = read(tensor, at::kFloat, {want.numel()});
    if (!at::equal(got, want))
      throw fail(tensor, "differs from bitsandbytes' map: memrt dequantizes with the standard " + std::string(type_name) +
                             " and dynamic maps only");
  };
  same_map(name + ".quant_map", map4(options.type));

  Quantized4 q;
  q.type = options.type;
  q.block = 64;
  q.shape = shape;
  q.packed = read(name, at::kByte, {(n + 1) / 2, 1});
  const bool nested = state.contains("nested_blocksize");
  if (nested != options.double_quant)
    throw fail(state_name, std::string(nested ? "is" : "is not") + " double-quantized, but config.json's "
                           "quantization_config says bnb_4bit_use_double_quant " + (options.double_quant ? "true" : "false"));
  if (!nested) {
    q.absmax = read(name + ".absmax", at::kFloat, {blocks});
    return q;
  }
  if (field("nested_blocksize").as_int() != 256)
    throw fail(state_name, "nested_blocksize is " + std::to_string(field("nested_blocksize").as_int()) +
                               "; memrt's double quantization uses bitsandbytes' 256");
  same_map(name + ".nested_quant_map", dynamic_map(true));
  q.absmax = read(name + ".absmax", at::kByte, {blocks});
  q.nested_absmax = read(name + ".nested_absmax", at::kFloat, {(blocks + 255) / 256});
  q.offset = at::scalar_tensor(static_cast<float>(field("nested_offset").as_double()), at::kFloat);
  q.nested_block = 256;
  return q;
}

void Base4::plan_params(std::vector<ParamInfo>& params, std::set<std::string>& reads_frozen) {
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
  // quantize() reads each of them, and the layer's bias, as its block is built.
  for (const auto& [name, shape] : shapes_) {
    reads_frozen.insert(name);
    reads_frozen.insert(name.substr(0, name.rfind('.')) + ".bias");
  }
}

void Base4::quantize(Block& block, const CheckpointReader* checkpoint) {
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
    Quantized4 q = checkpoint && checkpoint->contains(weight) && checkpoint->tensor(weight).scalar_type() == at::kByte
                       ? read_bnb4bit(*checkpoint, weight, it->second, options_)
                       : quantize_4bit(linear->weight.detach(), options_.type, 64, options_.double_quant);
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

void Base4::export_model(ExportContext& ctx) const {
  const char* type_name = options_.type == Map4::kNf4 ? "nf4" : "fp4";
  const std::vector<std::string> saved = ctx.saved.names();
  bool any = false;
  for (const auto& [name, shape] : shapes_) {
    if (std::find(saved.begin(), saved.end(), name) == saved.end() || ctx.saved.format(name) != type_name)
      continue;  // not saved in this format: export names it
    const FrozenLayout layout = linear4bit_layout(name, numel_of(shape), options_.type, options_.double_quant);
    if (ctx.merge) {
      // --merge writes a plain model: the weight dequantized as bitsandbytes' dequantize_4bit does,
      // in fp32 and Hugging Face's layout, for a later plugin to fold its adapters into.
      Quantized4 q;
      q.type = options_.type;
      q.shape = shape;
      q.packed = ctx.saved.read(name);
      q.absmax = ctx.saved.read(name, layout.tensors[1].name);
      if (options_.double_quant) {
        q.nested_absmax = ctx.saved.read(name, layout.tensors[2].name);
        q.offset = ctx.saved.read(name, layout.tensors[3].name);
      }
      const at::Tensor w = dequantize_4bit(q, at::kFloat).reshape(shape);  // (out, in)
      ctx.tensors[name] = ctx.run.shape.arch == "gpt2" ? w.t().contiguous() : w;  // GPT-2's Conv1D: (in, out)
      ctx.handled.insert(name);
      continue;  // and no quantization_config: the model is no longer 4-bit
    }
    ctx.tensors[name] = ctx.saved.read(name);
    ctx.tensors[name + ".absmax"] = ctx.saved.read(name, layout.tensors[1].name);
    ctx.tensors[name + ".quant_map"] = map4(options_.type);
    // QuantState.as_dict(packed=True)'s JSON, as json.dumps writes it. "dtype": the weight's before
    // quantizing, which dequantize_4bit returns: export's fp32.
    std::string state = std::string("{\"quant_type\": \"") + type_name + "\", \"blocksize\": 64, \"dtype\": \"float32\", " +
                        "\"shape\": [" + std::to_string(shape[0]) + ", " + std::to_string(shape[1]) + "]";
    if (options_.double_quant) {
      ctx.tensors[name + ".nested_absmax"] = ctx.saved.read(name, layout.tensors[2].name);
      ctx.tensors[name + ".nested_quant_map"] = dynamic_map(true);
      const float offset = ctx.saved.read(name, layout.tensors[3].name).item<float>();
      state += ", \"nested_blocksize\": 256, \"nested_dtype\": \"float32\", \"nested_offset\": " +
               ConfigNode::real(offset).to_json(0);
    }
    state += "}";
    ctx.tensors[name + ".quant_state.bitsandbytes__" + type_name] =
        at::from_blob(state.data(), {static_cast<int64_t>(state.size())}, at::kByte).clone();
    ctx.handled.insert(name);
    any = true;
  }
  if (!any) return;
  // BitsAndBytesConfig.to_dict() as transformers writes it into config.json (keys sorted). The
  // compute dtype: the configured one, else float32 (transformers' default, export's dtype).
  const char* compute = "float32";
  if (options_.compute_dtype == at::kBFloat16) compute = "bfloat16";
  if (options_.compute_dtype == at::kHalf) compute = "float16";
  ConfigNode q = ConfigNode::object();
  q.set("_load_in_4bit", ConfigNode::boolean(true));
  q.set("_load_in_8bit", ConfigNode::boolean(false));
  q.set("bnb_4bit_compute_dtype", ConfigNode::string(compute));
  q.set("bnb_4bit_quant_storage", ConfigNode::string("uint8"));
  q.set("bnb_4bit_quant_type", ConfigNode::string(type_name));
  q.set("bnb_4bit_use_double_quant", ConfigNode::boolean(options_.double_quant));
  q.set("llm_int8_enable_fp32_cpu_offload", ConfigNode::boolean(false));
  q.set("llm_int8_has_fp16_weight", ConfigNode::boolean(false));
  q.set("llm_int8_skip_modules", ConfigNode::null());
  q.set("llm_int8_threshold", ConfigNode::real(6.0));
  q.set("load_in_4bit", ConfigNode::boolean(true));
  q.set("load_in_8bit", ConfigNode::boolean(false));
  q.set("quant_method", ConfigNode::string("bitsandbytes"));
  ctx.config.set("quantization_config", std::move(q));
}

int64_t Base4::scratch_bytes() const {
  int64_t bytes = 0;
  for (const auto& [name, shape] : shapes_) {
    for (int64_t elem : {4, 2}) bytes = std::max(bytes, tile_scratch_bytes(shape[0], shape[1], elem, kTileBytes));
  }
  return bytes;
}

}  // namespace memrt::quant
