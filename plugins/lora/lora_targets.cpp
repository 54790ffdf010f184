#include "lora_targets.h"

#include <memrt/error.h>
#include <memrt/model.h>

#include <algorithm>
#include <map>
#include <regex>
#include <set>

namespace memrt::lora {
namespace {

bool starts_with(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }
bool ends_with(const std::string& s, const std::string& x) {
  return s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0;
}

// "transformer.h.3.attn.c_attn" -> "attn.c_attn" and 3: the module below the block's prefix and
// the block's index ("" and -1 outside the blocks).
std::pair<std::string, int64_t> block_module(const std::string& module) {
  for (const std::string prefix : {"transformer.h.", "model.layers."}) {
    if (!starts_with(module, prefix)) continue;
    const size_t dot = module.find('.', prefix.size());
    if (dot == std::string::npos) return {std::string(), -1};
    return {module.substr(dot + 1), std::stoll(module.substr(prefix.size(), dot - prefix.size()))};
  }
  return {std::string(), -1};
}

bool matches(const std::string& module, const std::vector<std::string>& targets) {
  return std::any_of(targets.begin(), targets.end(),
                     [&](const std::string& t) { return module == t || ends_with(module, "." + t); });
}

std::regex compile_target_regex(const TargetRule& rule) {
  try {
    return std::regex(rule.regex, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    throw ConfigError(rule.file, "lora_target_modules",
                      "is the regular expression \"" + rule.regex + "\", which does not compile (" + e.what() +
                          "); memrt reads ECMAScript syntax, which Python's re shares but for its own extensions "
                          "((?P<name>...), inline flags): rewrite it without them, or list the module names");
  }
}

// A regex target must match only block projections: every other module the parameters name (the
// model and its blocks, attention and MLP containers, norms, embeddings, lm_head) is refused, as
// PEFT refuses modules it cannot adapt and memrt adapts none outside the blocks' projections.
void refuse_other_modules(const std::vector<ParamInfo>& params, const std::regex& re, const TargetRule& rule,
                          const std::set<std::string>& projections) {
  std::set<std::string> modules;
  for (const ParamInfo& p : params) {
    if (is_adapter(p.name)) continue;
    for (size_t dot = p.name.find('.'); dot != std::string::npos; dot = p.name.find('.', dot + 1))
      modules.insert(p.name.substr(0, dot));
  }
  for (const std::string& m : modules) {
    if (projections.count(m) || !std::regex_match(m, re)) continue;
    throw ConfigError(rule.file, "lora_target_modules",
                      "is the regular expression \"" + rule.regex + "\", which matches '" + m +
                          "': not a projection of a block (LoRA adapts those linear layers only; PEFT refuses "
                          "other module types); narrow the expression");
  }
}

}  // namespace

std::string lora_a_name(const std::string& module) { return module + ".lora_A.weight"; }
std::string lora_b_name(const std::string& module) { return module + ".lora_B.weight"; }
bool is_lora_b(const std::string& name) { return ends_with(name, ".lora_B.weight"); }
std::string magnitude_name(const std::string& module) { return module + ".lora_magnitude_vector"; }
bool is_magnitude(const std::string& name) { return ends_with(name, ".lora_magnitude_vector"); }
bool is_adapter(const std::string& name) {
  return ends_with(name, ".lora_A.weight") || is_lora_b(name) || is_magnitude(name);
}

std::vector<Target> select_targets(const std::vector<ParamInfo>& params, const ModelShape& shape,
                                   const TargetRule& rule) {
  const std::string& arch = shape.arch;
  std::map<std::string, std::vector<int64_t>> built;  // the model's own shapes, for replaced weights
  std::vector<std::string> wanted = rule.modules;
  if (wanted.empty() && !rule.all_linear) {
    wanted = arch == "llama" ? std::vector<std::string>{"q_proj", "v_proj"} : std::vector<std::string>{"c_attn"};
  }
  if (!rule.regex.empty() && !rule.layers.empty())
    throw ConfigError(rule.file, "layers_to_transform",
                      "is set with lora_target_modules a regular expression, which PEFT's LoraConfig refuses: "
                      "name the blocks in the expression instead (e.g. \\.(0|1)\\.)");
  const bool by_regex = !rule.regex.empty() && !rule.all_linear;
  const std::regex re = by_regex ? compile_target_regex(rule) : std::regex();
  for (int64_t layer : rule.layers)
    if (layer < 0 || layer >= shape.n_layer)
      throw ConfigError(rule.file, "layers_to_transform", "names block " + std::to_string(layer) + "; the model's blocks are 0.." +
                                                              std::to_string(shape.n_layer - 1));
  const auto transformed = [&](int64_t layer) {
    return rule.layers.empty() || std::find(rule.layers.begin(), rule.layers.end(), layer) != rule.layers.end();
  };
  std::vector<Target> out;
  std::set<std::string> available, projections;
  for (const ParamInfo& p : params) {
    if (!ends_with(p.name, ".weight") || p.shape.size() != 2 || is_adapter(p.name)) continue;
    const std::string module = p.name.substr(0, p.name.size() - 7);
    const auto [short_name, layer] = block_module(module);
    if (short_name.empty()) continue;  // not inside a block: embeddings, lm_head
    available.insert(short_name.substr(short_name.rfind('.') + 1));
    projections.insert(module);
    if (by_regex ? !std::regex_match(module, re) : !rule.all_linear && !matches(module, wanted)) continue;
    if (!transformed(layer)) continue;
    if (at::isFloatingType(p.dtype)) {
      out.push_back({module, p.shape[1], p.shape[0]});
      continue;
    }
    if (built.empty())
      for (auto& [name, dims] : model_parameter_shapes(shape)) built[name] = std::move(dims);
    auto it = built.find(p.name);
    if (it == built.end() || it->second.size() != 2)
      throw Error("LoRA: target '" + module + "' is not a projection of the " + arch + " model");
    out.push_back({module, it->second[1], it->second[0]});
  }
  if (by_regex) refuse_other_modules(params, re, rule, projections);
  if (out.empty()) {
    std::string names, asked;
    for (const std::string& n : available) names += (names.empty() ? "" : ", ") + n;
    for (const std::string& n : wanted) asked += (asked.empty() ? "" : ", ") + n;
    const std::string what = by_regex ? "is the regular expression \"" + rule.regex + "\", which"
                             : rule.modules.empty() ? "is not set, and PEFT's default for " + arch + " (" + asked + ")"
                                                    : "names " + asked + ", which";
    throw ConfigError(rule.file, "lora_target_modules",
                      what + " matches no projection of the model's blocks; choose from: " + names +
                          (by_regex && !projections.empty()
                               ? " (the expression must match a whole name, e.g. " + *projections.begin() + ")"
                               : " (or all-linear)"));
  }
  return out;
}

void plan_adapters(std::vector<ParamInfo>& params, const std::vector<Target>& targets, int64_t r, bool dora) {
  std::map<std::string, const Target*> by_module;
  for (const Target& t : targets) by_module[t.module] = &t;
  std::vector<ParamInfo> out;
  out.reserve(params.size() + 2 * targets.size());
  for (size_t i = 0; i < params.size(); ++i) {
    ParamInfo p = params[i];
    p.trainable = false;
    out.push_back(p);
    const size_t dot = p.name.rfind('.');
    const std::string module = p.name.substr(0, dot);
    auto it = by_module.find(module);
    if (it == by_module.end()) continue;
    // The target's last own parameter: the next one belongs to another module.
    if (i + 1 < params.size() && params[i + 1].name.rfind(module + ".", 0) == 0 &&
        params[i + 1].name.find('.', module.size() + 1) == std::string::npos)
      continue;
    const Target& t = *it->second;
    // LoraLinear's own parameters come before its submodules': the magnitude, then A and B.
    if (dora) out.push_back({magnitude_name(module), {t.out}, at::kFloat, true, true});
    out.push_back({lora_a_name(module), {r, t.in}, at::kFloat, true, true});
    out.push_back({lora_b_name(module), {t.out, r}, at::kFloat, true, true});
  }
  params = std::move(out);
}

bool saved_module(const std::string& name, const std::vector<std::string>& modules) {
  const std::string module = name.substr(0, name.rfind('.'));
  return std::any_of(modules.begin(), modules.end(), [&](const std::string& m) { return ends_with(module, m); });
}

void plan_modules_to_save(std::vector<ParamInfo>& params, const ModelShape& shape,
                          const std::vector<std::string>& modules, const std::string& file, const std::string& key) {
  for (const std::string& m : modules) {
    if (shape.tie_embeddings && (m == "lm_head" || ends_with("transformer.wte", m) || ends_with("model.embed_tokens", m)))
      throw ConfigError(file, key,
                        "names " + m + ", but this " + shape.arch + " model ties lm_head to the token embedding: PEFT "
                        "would train an untied copy, which memrt does not make; use a model with "
                        "tie_word_embeddings false, or leave it out");
    bool found = false;
    for (ParamInfo& p : params) {
      if (is_adapter(p.name) || !saved_module(p.name, {m})) continue;
      if (!at::isFloatingType(p.dtype))
        throw ConfigError(file, key, "names " + m + ", whose '" + p.name + "' is stored as " +
                                                            c10::toString(p.dtype) + " (a quantized base): it cannot train in full");
      p.trainable = true;
      found = true;
    }
    if (!found) {
      std::set<std::string> names;
      for (const ParamInfo& p : params)
        if (block_module(p.name.substr(0, p.name.rfind('.'))).first.empty()) names.insert(p.name.substr(0, p.name.rfind('.')));
      std::string list;
      for (const std::string& n : names) list += (list.empty() ? "" : ", ") + n;
      throw ConfigError(file, key, "names " + m + ", which matches no module of the model (outside the "
                                                      "blocks it has: " + list + ")");
    }
  }
}

bool bias_trains(const std::string& name, const std::string& bias, const std::map<std::string, Target>& targets) {
  if (bias == "all") return name.find("bias") != std::string::npos;
  return bias == "lora_only" && ends_with(name, ".bias") && targets.count(name.substr(0, name.size() - 5)) > 0;
}

}  // namespace memrt::lora
