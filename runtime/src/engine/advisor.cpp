// The memory advisor (see advisor.h; docs/preflight.md, "The advisor").
#include "engine/advisor.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <sstream>

#include "config/load_config.h"
#include "engine/engine.h"
#include "memory/report.h"
#include "memrt/ops.h"
#include "plugin/plugin_host.h"

namespace memrt {
namespace {

using File = ConfigEdit::File;

// A suggestion leaves this share of the limit free: the RSS beyond the allocator's peak (the block
// cache's resident blocks, glibc's arenas) and what a changed config loads at set-up (a plugin's
// library) are not in the estimate.
constexpr double kMargin = 0.05;

// A train.yaml key as the user's file spells it (axolotl's `micro_batch_size`), else as named.
ConfigEdit yaml_edit(const TrainConfig& cfg, const std::string& key, ConfigNode value) {
  return {File::kTrainYaml, yaml_spelling(cfg.train_yaml, key), std::move(value)};
}
ConfigEdit ds_edit(std::string key, ConfigNode value) { return {File::kDsConfig, std::move(key), std::move(value)}; }
ConfigNode integer(int64_t v) { return ConfigNode::number(static_cast<double>(v)); }

// One setting the two files may both hold: train.yaml always (its key replaces every spelling, and
// a command-line override is how a user tries it), the ds_config too where it sets the key to a
// value of its own (not "auto"), since the two must agree.
void set_setting(std::vector<ConfigEdit>& edits, const TrainConfig& cfg, const std::string& ds_key,
                 const std::string& yaml_key, const ConfigNode& value) {
  const ConfigNode* n = cfg.ds_config.at_path(ds_key);
  if (n && !n->is_null() && !n->is_auto()) edits.push_back(ds_edit(ds_key, value));
  edits.push_back(yaml_edit(cfg, yaml_key, value));
}

const PluginSpec* plugin(const TrainConfig& cfg, const std::string& name) {
  for (const PluginSpec& p : cfg.plugins)
    if (p.name == name) return &p;
  return nullptr;
}

// A variant of a kind of change; a kind's variants go from the cheapest to the one that saves most.
struct Variant {
  std::string change;
  std::vector<ConfigEdit> edits;
};
struct Kind {
  std::vector<Variant> variants;
  bool changes_what_is_trained = false;
};

std::string ordinal(int64_t k) {
  if (k == 1) return "";
  const int64_t tens = k % 100, ones = k % 10;
  const char* suffix = tens / 10 == 1 ? "th" : ones == 1 ? "st" : ones == 2 ? "nd" : ones == 3 ? "rd" : "th";
  return std::to_string(k) + suffix + " ";
}

// The kinds of change the advisor tries, in the order of what they cost: exact ones first (the
// head in chunks recomputes one product; a smaller micro-batch runs smaller products; checkpointing
// recomputes a block's forward; a higher ZeRO stage communicates more; offload steps on the host),
// then those that round (bf16, 8-bit then 4-bit optimizer state), then those that change what is
// trained (LoRA, QLoRA).
std::vector<Kind> kinds(const TrainConfig& cfg, const HostMemory& host) {
  std::vector<Kind> out;
  if (!cfg.chunked_cross_entropy) {
    out.push_back({{{"the head's loss a chunk of tokens at a time (the logits never whole)",
                     {yaml_edit(cfg, "chunked_cross_entropy", ConfigNode::boolean(true))}}}});
  }

  Kind batch;
  for (int64_t f = 2; cfg.micro_batch_size % f == 0; f *= 2) {
    Variant v;
    const int64_t m = cfg.micro_batch_size / f, g = cfg.grad_accum_steps * f;
    v.change = "micro-batch " + std::to_string(m) + " with " + std::to_string(g) +
               " accumulation steps (the same global batch of " + std::to_string(cfg.train_batch_size) + ")";
    set_setting(v.edits, cfg, "train_micro_batch_size_per_gpu", "per_device_train_batch_size", integer(m));
    set_setting(v.edits, cfg, "gradient_accumulation_steps", "gradient_accumulation_steps", integer(g));
    batch.variants.push_back(std::move(v));
  }
  if (!batch.variants.empty()) out.push_back(std::move(batch));

  // Checkpointing every k-th block (plugins/checkpoint's every_n_blocks), fewest blocks first.
  const int64_t n_layer = make_run_info(cfg, 0, 1, 0).shape.n_layer;
  int64_t every = n_layer + 1;  // off
  if (const PluginSpec* p = plugin(cfg, "checkpoint")) {
    const ConfigNode* on = p->options.find("gradient_checkpointing");
    if (!on || on->as_bool()) {
      every = 1;
      if (const ConfigNode* n = p->options.at_path("activation_checkpointing.every_n_blocks"); n && !n->is_null())
        every = n->as_int();
    }
  }
  // every_n_blocks is a ds_config key (docs/checkpointing.md): without a ds_config, every block.
  Kind checkpointing;
  for (int64_t k = std::min(n_layer, every - 1); k >= 1; --k) {
    if (k > 1 && cfg.ds_config_path.empty()) continue;
    Variant v;
    v.change = "activation checkpointing of every " + ordinal(k) + "block";
    v.edits.push_back(yaml_edit(cfg, "gradient_checkpointing", ConfigNode::boolean(true)));
    if (k > 1 || cfg.ds_config.at_path("activation_checkpointing.every_n_blocks"))
      v.edits.push_back(ds_edit("activation_checkpointing.every_n_blocks", integer(k)));
    checkpointing.variants.push_back(std::move(v));
  }
  if (!checkpointing.variants.empty()) out.push_back(std::move(checkpointing));

  // ZeRO partitions over the ranks there are (more ranks on other hosts: launcher --estimate).
  if (host.world_size > 1 && cfg.zero_stage < 3) {
    Kind zero;
    for (int s = cfg.zero_stage + 1; s <= 3; ++s)
      zero.variants.push_back({"ZeRO stage " + std::to_string(s) + " over the " + std::to_string(host.world_size) + " ranks",
                               {ds_edit("zero_optimization.stage", integer(s))}});
    out.push_back(std::move(zero));
  }
  // Offload moves the optimizer's state and step from an accelerator to host memory; on a CPU
  // run both are host memory already.
  const ConfigNode* offload = cfg.ds_config.at_path("zero_optimization.offload_optimizer.device");
  if (!host.device.is_cpu() && !(offload && offload->is_string() && offload->as_string() != "none")) {
    Variant v{"the optimizer's state and step offloaded to host memory (ZeRO-Offload)",
              {ds_edit("zero_optimization.offload_optimizer.device", ConfigNode::string("cpu"))}};
    if (cfg.zero_stage == 0) v.edits.push_back(ds_edit("zero_optimization.stage", integer(1)));
    out.push_back({{std::move(v)}});
  }

  // bf16 where the device computes in it (on a CPU, with native bf16 products).
  const bool bf16_native = !host.device.is_cpu() || ops::matmul_path(at::kBFloat16) == ops::MatmulPath::kNative;
  if (cfg.compute_dtype == "fp32" && bf16_native) {
    Variant v{"bf16 compute (fp32 master weights and optimizer state)", {}};
    set_setting(v.edits, cfg, "bf16.enabled", "bf16", ConfigNode::boolean(true));
    out.push_back({{std::move(v)}});
  }

  // Low-bit optimizer state: bitsandbytes' 8-bit, then torchao's 4-bit.
  const PluginSpec* quant = plugin(cfg, "quant");
  const ConfigNode* optim = quant ? quant->options.find("optim") : nullptr;
  const std::string low = optim ? optim->as_string() : "";
  if (cfg.optimizer.type == "AdamW" && low != "adamw_torch_4bit") {
    Kind state;
    if (low.empty())
      state.variants.push_back({"8-bit AdamW state (bitsandbytes' adamw_8bit)",
                                {yaml_edit(cfg, "optim", ConfigNode::string("adamw_8bit"))}});
    state.variants.push_back({"4-bit AdamW state (torchao's adamw_torch_4bit)",
                              {yaml_edit(cfg, "optim", ConfigNode::string("adamw_torch_4bit"))}});
    out.push_back(std::move(state));
  }

  // LoRA adapters (PEFT's defaults for all-linear targets), then on a 4-bit NF4 base (QLoRA); with
  // adapters already, their base in NF4.
  Kind lora;
  lora.changes_what_is_trained = true;
  const bool adapters = plugin(cfg, "lora") != nullptr;
  std::vector<ConfigEdit> edits;
  if (!adapters) {
    edits = {yaml_edit(cfg, "use_peft", ConfigNode::boolean(true)), yaml_edit(cfg, "lora_r", integer(16)),
             yaml_edit(cfg, "lora_alpha", integer(32)), yaml_edit(cfg, "lora_target_modules", ConfigNode::string("all-linear"))};
    lora.variants.push_back({"LoRA adapters r=16 on every linear, the base frozen", edits});
  }
  const ConfigNode* four_bit = quant ? quant->options.find("load_in_4bit") : nullptr;
  if (!(four_bit && four_bit->as_bool())) {
    edits.push_back(yaml_edit(cfg, "load_in_4bit", ConfigNode::boolean(true)));
    edits.push_back(yaml_edit(cfg, "bnb_4bit_quant_type", ConfigNode::string("nf4")));
    lora.variants.push_back({adapters ? "QLoRA: the adapters' frozen base in NF4"
                                      : "QLoRA: LoRA adapters r=16 on every linear of a frozen NF4 base",
                             edits});
  }
  if (!lora.variants.empty()) out.push_back(std::move(lora));
  return out;
}

// One config estimated on every rank of the host.
struct Point {
  int64_t peak = 0;
  int64_t device = 0;  // the largest device need of the host's ranks (an accelerator's)
  Tightest fit;
};

class Estimator {
 public:
  Estimator(const ConfigSources& sources, const HostMemory& host) : sources_(sources), host_(host) {
    sources_.world_size = host.world_size;
  }

  // `edits` applied to the user's config; none when the config refuses them.
  std::optional<Point> operator()(const std::vector<ConfigEdit>& edits) {
    ConfigSources s = sources_;
    s.edits.insert(s.edits.end(), edits.begin(), edits.end());
    try {
      const TrainConfig cfg = load_train_config(s);
      PluginHost plugins = PluginHost::load(cfg.plugins);
      ConfigDiagnostics diag;
      RunInfo first = make_run_info(cfg, host_.ranks.front(), host_.world_size, 0);
      first.device = host_.device;
      plugins.configure(first, diag);
      ++count;
      Point p;
      int64_t growth = 0;
      for (size_t i = 0; i < host_.ranks.size(); ++i) {
        RunInfo run = make_run_info(cfg, host_.ranks[i], host_.world_size, static_cast<int>(i));
        run.device = host_.device;
        const memory::Table table = estimate_memory(cfg, run, plugins).table;
        growth += host_growth(table, host_.device);
        p.peak = std::max(p.peak, table.total());
        p.device = std::max(p.device, device_need(table, host_.device));
      }
      const std::optional<Tightest> t = tightest(host_, growth);
      p.fit = t ? *t : Tightest{{std::numeric_limits<int64_t>::max(), "no host limit"}, growth};
      return p;
    } catch (const Error&) {
      return std::nullopt;
    }
  }

  bool fits(const std::optional<Point>& p) const {
    auto within = [](int64_t need, int64_t limit) {
      return need <= limit - static_cast<int64_t>(kMargin * static_cast<double>(limit));
    };
    return p && within(p->fit.need, p->fit.limit.bytes) &&
           (!host_.device_limit || within(p->device, host_.device_limit->bytes));
  }

  int64_t count = 0;

 private:
  ConfigSources sources_;
  const HostMemory& host_;
};

std::vector<ConfigEdit> joined(const std::vector<const Variant*>& chosen) {
  std::vector<ConfigEdit> edits;
  for (const Variant* v : chosen) edits.insert(edits.end(), v->edits.begin(), v->edits.end());
  return edits;
}

// A dotted key as it is written in the file: `a: {b: v}` in YAML, `"a": {"b": v}` in JSON.
std::string nested(const std::string& key, const std::string& value, bool json) {
  const size_t dot = key.find('.');
  const std::string head = key.substr(0, dot);
  const std::string name = json ? "\"" + head + "\"" : head;
  if (dot == std::string::npos) return name + ": " + value;
  return name + ": {" + nested(key.substr(dot + 1), value, json) + "}";
}

}  // namespace

Advice advise(const ConfigSources& sources, const HostMemory& host) {
  Advice advice;
  if (host.ranks.empty() || (host.limits.empty() && !host.device_limit)) return advice;
  ConfigSources base = sources;
  base.world_size = host.world_size;
  const std::vector<Kind> all = kinds(load_train_config(base), host);
  Estimator estimate(sources, host);
  auto suggest = [&](const std::vector<size_t>& kinds_used, const std::vector<const Variant*>& chosen, const Point& p) {
    Suggestion s;
    for (size_t i = 0; i < chosen.size(); ++i) {
      s.change += (i ? "; " : "") + chosen[i]->change;
      s.changes_what_is_trained = s.changes_what_is_trained || all[kinds_used[i]].changes_what_is_trained;
    }
    s.edits = joined(chosen);
    s.peak = p.peak;
    s.device = p.device;
    s.fit = p.fit;
    advice.suggestions.push_back(std::move(s));
  };

  // Single changes: each kind's cheapest variant that fits. A combination takes of a kind only
  // variants cheaper than that one: `usable[k]` of them.
  std::vector<size_t> usable(all.size());
  for (size_t k = 0; k < all.size(); ++k) {
    usable[k] = all[k].variants.size();
    for (size_t i = 0; i < all[k].variants.size(); ++i) {
      const Variant& v = all[k].variants[i];
      const std::optional<Point> p = estimate(v.edits);
      if (!estimate.fits(p)) continue;
      suggest({k}, {&v}, *p);
      usable[k] = i;
      break;
    }
  }

  // Combinations, pairs then triples, while fewer than three changes are found, of the variants
  // cheaper than a kind's own single change (all of a kind that does not fit alone: a checkpointed
  // block fewer with a smaller micro-batch can cost less than either alone). Each kind of a
  // combination takes its cheapest such variant that fits beside the others' (starting from their
  // most saving ones); a combination holding one already found is not tried. Those that keep what
  // is trained come first, then the cheapest kinds.
  struct Combination {
    std::vector<size_t> kinds;
    std::vector<const Variant*> chosen;
    Point point;
    bool changes_what_is_trained = false;
  };
  std::vector<Combination> found;
  std::vector<size_t> open;
  for (size_t k = 0; k < all.size(); ++k)
    if (usable[k] > 0) open.push_back(k);
  for (size_t size = 2; size <= 3 && size <= open.size() && advice.suggestions.size() + found.size() < 3; ++size) {
    std::vector<size_t> pick(size);
    for (size_t i = 0; i < size; ++i) pick[i] = i;
    for (;;) {
      Combination c;
      for (size_t i : pick) {
        c.kinds.push_back(open[i]);
        c.chosen.push_back(&all[open[i]].variants[usable[open[i]] - 1]);
        c.changes_what_is_trained = c.changes_what_is_trained || all[open[i]].changes_what_is_trained;
      }
      const bool holds_found = std::any_of(found.begin(), found.end(), [&](const Combination& f) {
        return std::includes(c.kinds.begin(), c.kinds.end(), f.kinds.begin(), f.kinds.end());
      });
      std::optional<Point> p = holds_found ? std::nullopt : estimate(joined(c.chosen));
      if (estimate.fits(p)) {
        for (size_t i = 0; i < size; ++i) {
          for (const Variant& v : all[c.kinds[i]].variants) {
            if (&v == c.chosen[i]) break;  // the one that fits already
            std::vector<const Variant*> trial = c.chosen;
            trial[i] = &v;
            const std::optional<Point> q = estimate(joined(trial));
            if (!estimate.fits(q)) continue;
            c.chosen = trial;
            p = q;
            break;
          }
        }
        c.point = *p;
        found.push_back(std::move(c));
      }
      // The next combination in lexicographic order.
      size_t i = size;
      while (i > 0 && pick[i - 1] == open.size() - size + i - 1) --i;
      if (i == 0) break;
      ++pick[i - 1];
      for (size_t j = i; j < size; ++j) pick[j] = pick[j - 1] + 1;
    }
  }
  std::stable_sort(found.begin(), found.end(), [](const Combination& a, const Combination& b) {
    return !a.changes_what_is_trained && b.changes_what_is_trained;
  });
  for (const Combination& c : found) {
    if (advice.suggestions.size() >= 3) break;
    suggest(c.kinds, c.chosen, c.point);
  }
  advice.estimates = estimate.count;
  return advice;
}

std::string advice_text(const Advice& advice, const ConfigSources& sources) {
  std::ostringstream os;
  if (advice.suggestions.empty()) {
    os << "No change the advisor tries (docs/preflight.md) fits, alone or combined (" << advice.estimates
       << " configs estimated): more ranks on more hosts (ZeRO), a smaller model or a larger budget.";
    return os.str();
  }
  const Suggestion& first = advice.suggestions.front();
  os << "These changes would fit, each found by estimating the run with it (" << advice.estimates
     << " configs estimated; cheapest first; each leaves " << static_cast<int>(kMargin * 100) << "% of "
     << first.fit.limit.source << " free):";
  const std::string ds_name = sources.ds_config_path.empty() ? "the ds_config (--deepspeed)" : sources.ds_config_path;
  const std::string yaml_name = sources.train_yaml_path.empty() ? "train.yaml" : sources.train_yaml_path;
  int n = 0;
  for (const Suggestion& s : advice.suggestions) {
    os << "\n  " << ++n << ". " << s.change << (s.changes_what_is_trained ? " [changes what is trained]" : "")
       << ": estimated peak " << s.peak << " B (" << megabytes(s.peak) << ") per rank, " << megabytes(s.fit.need)
       << " of " << megabytes(s.fit.limit.bytes) << " for the host";
    if (s.device > 0) os << ", " << megabytes(s.device) << " of its device";
    std::string yaml, overrides, ds;
    for (const ConfigEdit& e : s.edits) {
      const bool in_yaml = e.file == File::kTrainYaml;
      const std::string value = in_yaml && e.value.is_string() ? e.value.as_string() : e.value.to_json(0);
      (in_yaml ? yaml : ds) += std::string((in_yaml ? yaml : ds).empty() ? "" : ", ") + nested(e.key, value, !in_yaml);
      if (in_yaml) overrides += " --" + e.key + "=" + value;
    }
    if (!ds.empty()) os << "\n       in " << ds_name << ": " << ds;
    if (!yaml.empty()) os << "\n       in " << yaml_name << ": " << yaml << "  (or on the command line:" << overrides << ")";
  }
  return os.str();
}

}  // namespace memrt
