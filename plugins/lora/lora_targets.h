// plugins/lora/lora_targets.h — which block projections get LoRA adapters, and the parameters that
// adds, decided from names and shapes alone (plan_params runs on the estimate's shapes and on the
// built model; docs/lora.md, "Phases").
//
// Targets as PEFT matches `target_modules` (tuners_utils.check_target_module_exists) against a
// module's full dotted name ("model.layers.0.self_attn.q_proj"):
//   a list      the name equals an entry or ends with "." + entry ("q_proj", "self_attn.q_proj")
//   a string    a regular expression the whole name must match (re.fullmatch), e.g.
//               "model\.layers\.[0-3]\.self_attn\.(q|v)_proj" (ECMAScript syntax: Python's own
//               extensions such as (?P<name>...) are an error naming the key)
//   all-linear  every projection of the blocks (never lm_head)
//   none given  PEFT's default for the architecture: GPT-2 ["c_attn"], Llama ["q_proj", "v_proj"]
// and, with layers_to_transform, only in the blocks of those indices (PEFT's layer index: the
// number after "h." / "layers." in the module's name).
// Candidates are the blocks' projections ("<block>.<module>.weight", 2-D); a selection matching
// none of them is an error naming the key and the module names available.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <memrt/model_shape.h>
#include <memrt/param_store.h>

namespace memrt::lora {

struct TargetRule {
  std::string file;                  // the config file, for errors
  std::vector<std::string> modules;  // lora_target_modules; empty: the architecture's default
  std::string regex;                 // lora_target_modules as a string (not all-linear); else empty
  bool all_linear = false;
  std::vector<int64_t> layers;       // layers_to_transform; empty: every block
};

struct Target {
  std::string module;  // full dotted name, "transformer.h.0.attn.c_attn"
  int64_t in = 0, out = 0;
};

// The targets among `params` (model order) of the model `shape` describes: a target's (in, out) is
// its weight's shape, or for a weight another plugin planned in another form (4-bit codes) the
// model's own (model_parameter_shapes). Throws memrt::ConfigError naming lora_target_modules when
// nothing matches, or a regex matches a module that is not a block projection (a norm, a block, an
// embedding, lm_head: PEFT refuses the first ones and memrt adapts none of them), or
// layers_to_transform when it names a block the model does not have or comes with a regex (PEFT's
// LoraConfig refuses that pair).
std::vector<Target> select_targets(const std::vector<ParamInfo>& params, const ModelShape& shape,
                                   const TargetRule& rule);

// The adapters' names: "<module>.lora_A.weight" (r, in), "<module>.lora_B.weight" (out, r) and,
// with DoRA, "<module>.lora_magnitude_vector" (out).
std::string lora_a_name(const std::string& module);
std::string lora_b_name(const std::string& module);
std::string magnitude_name(const std::string& module);
bool is_magnitude(const std::string& param_name);
bool is_adapter(const std::string& param_name);
bool is_lora_b(const std::string& param_name);

// Freezes every parameter and inserts each target's adapters (fp32, trainable, decaying) right
// after the target's own parameters ("<module>.weight", "<module>.bias"): where LoraLinear's
// named_parameters() puts them, so the plan lists the parameters in the model's order.
void plan_adapters(std::vector<ParamInfo>& params, const std::vector<Target>& targets, int64_t r, bool dora);

// PEFT's modules_to_save: every parameter of a module whose name ends with one of `modules`
// ("lm_head", "embed_tokens") trains in full. (PEFT trains a copy beside the frozen original;
// memrt trains the module itself: the same values, one copy.) An entry that matches nothing, or a
// module whose weight is tied to another (GPT-2's lm_head and wte), is a ConfigError naming
// `key` in `file`.
void plan_modules_to_save(std::vector<ParamInfo>& params, const ModelShape& shape,
                          const std::vector<std::string>& modules, const std::string& file, const std::string& key);
bool saved_module(const std::string& param_name, const std::vector<std::string>& modules);

// PEFT's bias modes (LoraConfig.bias): which biases train besides the adapters — "none"; "all":
// every parameter whose name contains "bias" (PEFT's test); "lora_only": the targets' own biases.
bool bias_trains(const std::string& param_name, const std::string& bias, const std::map<std::string, Target>& targets);

}  // namespace memrt::lora
