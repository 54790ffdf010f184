// The host's parameter groups (store/host_groups.h).
#include "store/host_groups.h"

#include <algorithm>
#include <cctype>
#include <utility>

#include "memrt/error.h"

namespace memrt {
namespace {

bool contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// axolotl's embeddings group (OptimizerMixin.create_optimizer_grouped_parameters).
bool axolotl_embedding(const std::string& name) {
  return ends_with(name, "modules_to_save.default.weight") || contains(name, "embed_tokens") ||
         contains(name, "lm_head");
}

std::string some_names(const StorePlan& plan, bool (*keep)(const ParamSlot&)) {
  std::string out;
  int shown = 0;
  for (const ParamSlot& s : plan.slots()) {
    if (!keep(s)) continue;
    if (shown++ == 6) return out + ", ...";
    out += (out.empty() ? "" : ", ") + s.param.name;
  }
  return out.empty() ? "none" : out;
}

}  // namespace

bool decays(const std::string& name, bool decay_all) {
  if (decay_all) return true;
  std::string lower = name;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  if (contains(lower, "bias") || contains(lower, "layernorm") || contains(lower, "rmsnorm")) return false;
  // Component by component: "norm", "*_norm", and the LayerNorm modules "ln_*".
  for (size_t begin = 0; begin <= lower.size();) {
    size_t end = lower.find('.', begin);
    if (end == std::string::npos) end = lower.size();
    const std::string part = lower.substr(begin, end - begin);
    if (part == "norm" || ends_with(part, "_norm") || part.compare(0, 3, "ln_") == 0) return false;
    begin = end + 1;
  }
  return true;
}

StorePlan host_store_plan(const std::vector<ParamInfo>& params, const std::vector<int64_t>& segments,
                          const StoreOptions& options, const OptimizerConfig& optimizer) {
  StorePlan plan(params, options, segments);
  const GroupRules& rules = optimizer.groups;
  if (!rules.any() || plan.groups().empty()) return plan;
  auto trainable = [](const ParamSlot& s) { return s.group >= 0; };

  // Embeddings: no weight decay, their own learning rate.
  const double embedding_scale = rules.embedding_lr_scale > 0 ? rules.embedding_lr_scale
                                 : rules.embedding_lr > 0     ? rules.embedding_lr / optimizer.lr
                                                              : 1.0;
  bool any_embedding = false;
  for (const ParamSlot& s : plan.slots()) any_embedding = any_embedding || (trainable(s) && axolotl_embedding(s.param.name));
  if (any_embedding) {
    plan.add_group({"embeddings", [](const ParamInfo& p) { return axolotl_embedding(p.name); }, 0.0, embedding_scale});
  } else if (rules.embedding_lr_scale > 0 || rules.embedding_lr > 0) {
    throw ConfigError(rules.file, rules.embedding_lr_scale > 0 ? "embedding_lr_scale" : "embedding_lr",
                      "selects the trainable parameters named *embed_tokens*, *lm_head* or "
                      "*modules_to_save.default.weight* (axolotl's rule), and this model trains none (its "
                      "trainable parameters: " + some_names(plan, +trainable) +
                      "); remove the key");
  }

  // lr_groups: module fragment -> group, in axolotl's lookup order (a fragment listed again moves
  // to its later group but keeps its first place, as a Python dict does).
  std::vector<std::pair<std::string, size_t>> lookup;
  for (size_t g = 0; g < rules.lr_groups.size(); ++g)
    for (const std::string& module : rules.lr_groups[g].modules) {
      auto it = std::find_if(lookup.begin(), lookup.end(), [&](const auto& e) { return e.first == module; });
      if (it == lookup.end()) lookup.emplace_back(module, g); else it->second = g;
    }
  auto group_of = [&](const ParamInfo& p) -> int64_t {
    if (!p.decay || axolotl_embedding(p.name)) return -1;
    for (const auto& [module, g] : lookup)
      if (contains(p.name, module.c_str())) return static_cast<int64_t>(g);
    return -1;
  };
  for (size_t g = 0; g < rules.lr_groups.size(); ++g) {
    const LrGroup& lr_group = rules.lr_groups[g];
    bool any = false;
    for (const ParamSlot& s : plan.slots()) any = any || (trainable(s) && group_of(s.param) == static_cast<int64_t>(g));
    if (!any) {
      throw ConfigError(rules.file, "lr_groups[" + std::to_string(g) + "].modules",
                        "of group '" + lr_group.name + "' match no trainable parameter with weight decay "
                        "(axolotl matches a module as a part of the parameter's name; the decaying "
                        "trainable parameters: " + some_names(plan, +[](const ParamSlot& s) { return s.group >= 0 && s.param.decay; }) + ")");
    }
    plan.add_group({lr_group.name, [&group_of, g](const ParamInfo& p) { return group_of(p) == static_cast<int64_t>(g); },
                    optimizer.weight_decay, lr_group.lr / optimizer.lr});
  }
  return plan;
}

}  // namespace memrt
