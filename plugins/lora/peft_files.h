// plugins/lora/peft_files.h — PEFT's adapter directory, as `PeftModel.from_pretrained` reads it
// (docs/lora.md, "Files"): adapter_config.json (LoraConfig.to_dict()) and
// adapter_model.safetensors, keys "base_model.model.<module>.lora_A.weight" (r, in),
// "...lora_B.weight" (out, r), DoRA's "...lora_magnitude_vector" (out), the biases of the bias mode
// and the modules_to_save under their own names (a target's bias as "<module>.base_layer.bias").
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <memrt/config_node.h>
#include <memrt/safetensors.h>

#include "lora_linear.h"

namespace memrt::lora {

inline constexpr char kPeftConfigFile[] = "adapter_config.json";
inline constexpr char kPeftWeightsFile[] = "adapter_model.safetensors";

// What a PEFT LoRA adapter_config.json sets, of what memrt builds. A field set to something memrt
// does not build (a layers_pattern other than the models' own "h" / "layers", rank_pattern,
// alpha_pattern, another peft_type, an init_lora_weights that is a LoRA variant, ...) is a
// memrt::ConfigError naming the file and the field.
struct PeftAdapterConfig {
  std::string file;  // <dir>/adapter_config.json
  int64_t r = 8;
  double alpha = 8.0;
  double dropout = 0.0;
  bool rslora = false;
  bool dora = false;
  bool fan_in_fan_out = false;
  std::vector<std::string> target_modules;
  std::string target_regex;                  // target_modules written as a string: a full-match regex
  std::vector<int64_t> layers_to_transform;  // empty: every block
  std::string bias = "none";                 // "none" | "all" | "lora_only"
  std::vector<std::string> modules_to_save;  // trained in full, saved whole
  std::string base_model_name_or_path;       // written (null when empty); not read
  ConfigNode init_lora_weights = ConfigNode::boolean(true);  // as read, and written back
  std::vector<std::string> warnings;         // what reading found worth a line (ConfigDiagnostics' form)
};

// init_lora_weights of a LoRA to train, as PEFT's LoraConfig takes it (a boolean or a string); a
// value memrt does not build — one made from the base weights or from data — is a ConfigError
// naming `n`, saying how to start from such an adapter instead.
LoraInit read_lora_init(const ConfigNode& n);
// The init_lora_weights PEFT writes for `init`.
ConfigNode lora_init_node(LoraInit init);

// layers_to_transform as PEFT's LoraConfig takes it: an index or a list of indices (null: none).
std::vector<int64_t> read_layers(const ConfigNode& n);

PeftAdapterConfig read_peft_config(const std::string& dir);

// The adapter_config.json text PEFT writes for `c` (LoraConfig.to_dict(): the fields memrt builds
// and PEFT's defaults for the rest it reads), task CAUSAL_LM, for inference.
std::string peft_config_json(const PeftAdapterConfig& c);

// PEFT's key of a parameter of the model ("base_model.model." + its name).
std::string peft_key(const std::string& param_name);

// <dir>/adapter_model.safetensors; memrt::FileError when absent.
SafetensorsFile open_peft_weights(const std::string& dir);

}  // namespace memrt::lora
