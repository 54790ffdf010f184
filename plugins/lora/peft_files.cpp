#include "peft_files.h"

#include <filesystem>

#include <memrt/config_node.h>
#include <memrt/error.h>

namespace memrt::lora {
namespace {

namespace fs = std::filesystem;

bool unset(const ConfigNode* n) {
  if (!n || n->is_null()) return true;
  if (n->is_array()) return n->as_array().empty();
  if (n->is_object()) return n->members().empty();
  return false;
}

// init_lora_weights as a string (true / false / absent: PEFT's default and its debugging random
// init, nothing to check). How the adapters were initialised does not change what the file's
// tensors mean, except where the initialisation changed the base too (PiSSA, OLoRA, CorDA, LoftQ,
// LoRA-GA subtract their first BA from W: the adapter is right on the residual base PEFT saved) or
// made a variant of LoRA (MiCA freezes B), which memrt does not build.
// PEFT's inits that subtract their first B·A from the base weights.
bool from_base_weights(const std::string& init) {
  return init == "pissa" || init.rfind("pissa_niter_", 0) == 0 || init == "olora" || init == "corda" ||
         init == "loftq" || init == "lora_ga";
}

void read_init(const ConfigNode& n, PeftAdapterConfig& c) {
  const std::string init = n.as_string();
  if (from_base_weights(init)) {
    ConfigDiagnostics d;
    d.note(n, "is \"" + init + "\": that initialisation subtracts the first B·A from the base weights, so this "
              "adapter means what it says on the residual model PEFT saved with it, not on the original; point "
              "model_name_or_path at that residual model, or convert the adapter to a plain LoRA one with "
              "PeftModel.save_pretrained(..., path_initial_model_for_weight_conversion=...)");
    c.warnings = d.warnings;
  } else if (init != "gaussian" && init != "eva" && init != "orthogonal") {
    throw ConfigError(c.file, "init_lora_weights",
                      "is \"" + init + "\", " +
                          (init == "mica" ? std::string("a LoRA variant (MiCA: B frozen, A trained) that memrt does not build")
                                          : std::string("which memrt does not know")) +
                          "; memrt loads adapters initialised with true, false, \"gaussian\", \"eva\", "
                          "\"orthogonal\" or (on their residual base) \"pissa\", \"olora\", \"corda\", "
                          "\"loftq\", \"lora_ga\"");
  }
}

}  // namespace

LoraInit read_lora_init(const ConfigNode& n) {
  if (n.is_bool()) return n.as_bool() ? LoraInit::kDefault : LoraInit::kLinear;
  const std::string init = n.as_string();
  if (init == "gaussian") return LoraInit::kGaussian;
  if (init == "orthogonal") return LoraInit::kOrthogonal;
  if (init == "pissa") return LoraInit::kPissa;
  if (init == "olora") return LoraInit::kOlora;
  if (init.rfind("pissa_niter_", 0) == 0)
    throw n.error("is \"" + init + "\", PiSSA from a randomized SVD (PEFT's svd_lowrank, drawing from torch's "
                  "generator), which memrt does not build; use \"pissa\", PiSSA from the exact decomposition");
  const bool from_base = from_base_weights(init);
  if (from_base || init == "eva")
    throw n.error("is \"" + init + "\", an initialisation from " + (from_base ? "the base weights" : "data") +
                  " that memrt does not build; initialise the adapter with PEFT (get_peft_model, then save_pretrained" +
                  (from_base ? ", with the residual model it leaves" : "") + ") and train from it with lora_model_dir / "
                  "adapter_name_or_path" + (from_base ? " and model_name_or_path the residual model" : "") +
                  "; or use true, false, \"gaussian\", \"orthogonal\", \"pissa\" or \"olora\"");
  throw n.error("is \"" + init + "\"; memrt initialises LoRA adapters as PEFT's true (the default), false, "
                "\"gaussian\", \"orthogonal\", \"pissa\" or \"olora\"");
}

ConfigNode lora_init_node(LoraInit init) {
  switch (init) {
    case LoraInit::kDefault: return ConfigNode::boolean(true);
    case LoraInit::kGaussian: return ConfigNode::string("gaussian");
    case LoraInit::kOrthogonal: return ConfigNode::string("orthogonal");
    case LoraInit::kLinear: return ConfigNode::boolean(false);
    case LoraInit::kPissa: return ConfigNode::string("pissa");
    case LoraInit::kOlora: return ConfigNode::string("olora");
  }
  return ConfigNode::boolean(true);
}

std::vector<int64_t> read_layers(const ConfigNode& n) {
  std::vector<int64_t> out;
  if (n.is_null()) return out;
  if (n.is_array()) {
    for (const ConfigNode& item : n.as_array()) out.push_back(item.as_int());
    if (out.empty()) throw n.error("is an empty list; list block indices, or leave it out for every block");
  } else {
    out.push_back(n.as_int());
  }
  return out;
}

PeftAdapterConfig read_peft_config(const std::string& dir) {
  PeftAdapterConfig c;
  c.file = (fs::path(dir) / kPeftConfigFile).string();
  if (!fs::exists(c.file))
    throw FileError(c.file, "not found: a PEFT adapter directory holds adapter_config.json and "
                            "adapter_model.safetensors (PeftModel.save_pretrained writes them)");
  const ConfigNode root = parse_json_file(c.file);
  const auto field = [&](const char* key) { return root.find(key); };
  const auto refuse = [&](const char* key, const std::string& why) { throw ConfigError(c.file, key, why); };
  const ConfigNode* type = field("peft_type");
  if (!type || !type->is_string() || type->as_string() != "LORA")
    refuse("peft_type", std::string("is ") + (type ? type->describe() : "absent") + "; memrt loads LoRA adapters (\"LORA\")");
  if (const ConfigNode* n = field("r")) c.r = n->as_int();
  if (const ConfigNode* n = field("lora_alpha")) c.alpha = n->as_double();
  if (const ConfigNode* n = field("lora_dropout")) c.dropout = n->as_double();
  if (const ConfigNode* n = field("use_rslora"); !unset(n)) c.rslora = n->as_bool();
  if (const ConfigNode* n = field("fan_in_fan_out"); !unset(n)) c.fan_in_fan_out = n->as_bool();
  const ConfigNode* targets = field("target_modules");
  if (unset(targets)) refuse("target_modules", "is not set: the adapter names no module");
  if (targets->is_string()) {
    c.target_regex = targets->as_string();  // PEFT: a string is a regex ("all-linear" was resolved when saved)
  } else {
    c.target_modules = targets->as_names();
  }
  if (const ConfigNode* n = field("bias"); !unset(n)) {
    c.bias = n->as_string();
    if (c.bias != "none" && c.bias != "all" && c.bias != "lora_only")
      refuse("bias", "is \"" + c.bias + "\"; PEFT's bias modes are \"none\", \"all\" and \"lora_only\"");
  }
  if (const ConfigNode* n = field("use_dora"); !unset(n)) c.dora = n->as_bool();
  if (const ConfigNode* n = field("layers_to_transform"); !unset(n)) c.layers_to_transform = read_layers(*n);
  if (const ConfigNode* n = field("layers_pattern"); !unset(n)) {
    const std::vector<std::string> patterns = n->as_names();
    for (const std::string& p : patterns)
      if (p != "h" && p != "layers")
        refuse("layers_pattern", "is " + n->to_json(0) + "; memrt's models number their blocks under \"h\" (GPT-2) "
                                 "and \"layers\" (Llama)");
  }
  if (const ConfigNode* n = field("modules_to_save"); !unset(n)) c.modules_to_save = n->as_names();
  if (const ConfigNode* n = field("init_lora_weights"); n && !n->is_null()) {
    if (n->is_string()) read_init(*n, c);
    c.init_lora_weights = *n;
  }
  for (const char* key : {"rank_pattern", "alpha_pattern",
                          "target_parameters", "exclude_modules", "megatron_config", "loftq_config"}) {
    const ConfigNode* n = field(key);
    if (!unset(n))
      refuse(key, "is set (" + n->to_json(0) + "); memrt loads LoRA adapters without it (not implemented yet)");
  }
  for (const char* key : {"use_qalora", "lora_bias"}) {
    const ConfigNode* n = field(key);
    if (n && n->is_bool() && n->as_bool()) refuse(key, "is true; memrt loads LoRA adapters without it");
  }
  return c;
}

std::string peft_config_json(const PeftAdapterConfig& c) {
  ConfigNode root = ConfigNode::object();
  ConfigNode targets = ConfigNode::array();
  for (const std::string& t : c.target_modules) targets.push_back(ConfigNode::string(t));
  if (!c.target_regex.empty()) targets = ConfigNode::string(c.target_regex);
  root.set("alpha_pattern", ConfigNode::object());
  root.set("base_model_name_or_path", c.base_model_name_or_path.empty() ? ConfigNode::null()
                                                                         : ConfigNode::string(c.base_model_name_or_path));
  root.set("bias", ConfigNode::string(c.bias));
  root.set("fan_in_fan_out", ConfigNode::boolean(c.fan_in_fan_out));
  root.set("inference_mode", ConfigNode::boolean(true));
  root.set("init_lora_weights", c.init_lora_weights);
  root.set("layers_pattern", ConfigNode::null());
  if (c.layers_to_transform.empty()) {
    root.set("layers_to_transform", ConfigNode::null());
  } else {
    ConfigNode layers = ConfigNode::array();
    for (int64_t l : c.layers_to_transform) layers.push_back(ConfigNode::number(static_cast<double>(l)));
    root.set("layers_to_transform", layers);
  }
  root.set("lora_alpha", ConfigNode::number(c.alpha));
  root.set("lora_dropout", ConfigNode::real(c.dropout));  // a float in PEFT's file, 0.0 too
  if (c.modules_to_save.empty()) {
    root.set("modules_to_save", ConfigNode::null());
  } else {
    ConfigNode modules = ConfigNode::array();
    for (const std::string& m : c.modules_to_save) modules.push_back(ConfigNode::string(m));
    root.set("modules_to_save", modules);
  }
  root.set("peft_type", ConfigNode::string("LORA"));
  root.set("r", ConfigNode::number(static_cast<double>(c.r)));
  root.set("rank_pattern", ConfigNode::object());
  root.set("revision", ConfigNode::null());
  root.set("target_modules", targets);
  root.set("task_type", ConfigNode::string("CAUSAL_LM"));
  root.set("use_dora", ConfigNode::boolean(c.dora));
  root.set("use_rslora", ConfigNode::boolean(c.rslora));
  return root.to_json(2) + "\n";
}

std::string peft_key(const std::string& param_name) { return "base_model.model." + param_name; }

SafetensorsFile open_peft_weights(const std::string& dir) {
  const std::string path = (fs::path(dir) / kPeftWeightsFile).string();
  if (!fs::exists(path))
    throw FileError(path, "not found: memrt reads PEFT adapters saved with safe_serialization (the default)");
  return SafetensorsFile::open(path);
}

}  // namespace memrt::lora
