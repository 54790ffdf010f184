// plugins/lora — what `finetuning_type` chooses to train beyond the full model (docs/lora.md).
//
// LoRA (`use_peft`, `adapter: lora|qlora`, `finetuning_type: lora`, or any lora_* key):
// plan_params freezes the model and adds each target projection's adapters (lora_targets.h; a
// 4-bit target of plugins/quant too: QLoRA; layers_to_transform; DoRA's magnitude), and trains the
// biases of PEFT's bias mode and the modules_to_save in full; transform_model wraps the targets in
// LoraLinear (lora_linear.h), whose A, B (and m) are the planned parameters; plan_store counts the
// adapters as adapters (LoRA+: B in groups of their own). PEFT's files (peft_files.h): a PEFT
// adapter directory (lora_model_dir / adapter_name_or_path) sets the adapters' settings and initial
// values; every checkpoint (and output_dir/adapter/, the newest) and `launcher export` write them
// (export --merge folds them into the weights). LLaMA-Factory's freeze tuning
// (`finetuning_type: freeze`, freeze.h): in plan_params only the chosen parameters train. What PEFT
// can express and memrt does not build (rank_pattern, alpha_pattern, exclude_modules, ...) is refused
// by its key rather than trained as something else.
#include <memrt/plugin.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "freeze.h"
#include "lora_linear.h"
#include "lora_targets.h"
#include "peft_files.h"

namespace {

using memrt::lora::Target;

class LoraPlugin final : public memrt::Plugin {
 public:
  int priority() const override { return memrt::priority::kLora; }

  void configure(const memrt::ConfigNode& options, memrt::ConfigDiagnostics& diag,
                 const memrt::RunInfo& /*run*/) override {
    memrt::ConfigReader r(options, diag);
    const std::string type = r.get<std::string>("finetuning_type", "lora");
    freeze_mode_ = type == "freeze";
    if (freeze_mode_) {
      configure_freeze(options, r);
    } else {
      configure_lora(options, r, diag);
    }
    r.finish();
  }

  void plan_params(memrt::ParamPlanContext& ctx) override {
    if (fan_in_fan_out_ && ctx.run.shape.arch != "gpt2")
      throw memrt::ConfigError(rule_.file, "fan_in_fan_out", "is true, but a " + ctx.run.shape.arch + " model's "
                               "projections are nn.Linear (fan_in_fan_out is for GPT-2's Conv1D): an adapter of "
                               "another model");
    if (freeze_mode_) {
      std::vector<std::string> names;
      for (const memrt::ParamInfo& p : ctx.params) names.push_back(p.name);
      const std::vector<bool> train = memrt::lora::freeze_trainable(names, ctx.run.shape.n_layer, freeze_);
      for (size_t i = 0; i < ctx.params.size(); ++i) ctx.params[i].trainable = ctx.params[i].trainable && train[i];
      return;
    }
    targets_.clear();
    for (const Target& t : memrt::lora::select_targets(ctx.params, ctx.run.shape, rule_))
      targets_[t.module] = t;
    if (memrt::lora::init_from_base(options_.init)) check_init_from_base(ctx);
    std::vector<Target> list;
    for (const auto& [name, t] : targets_) {
      list.push_back(t);
      // DoRA's norms and PiSSA's / OLoRA's decomposition, in on_block_ready.
      if (options_.dora || memrt::lora::init_from_base(options_.init)) ctx.reads_frozen.insert(name + ".weight");
    }
    memrt::lora::plan_adapters(ctx.params, list, options_.r, options_.dora);
    for (memrt::ParamInfo& p : ctx.params)
      if (at::isFloatingType(p.dtype) && trained_bias(p.name)) p.trainable = true;
    memrt::lora::plan_modules_to_save(ctx.params, ctx.run.shape, modules_to_save_, modules_key_file_,
                                      adapter_dir_.empty() ? "lora_modules_to_save" : "modules_to_save");
  }

  // What the adapters keep for backward beyond what the host's op model counts (a target's input
  // and A's output, from the planned parameters' names): with lora_dropout, each target's dropped
  // input and the dropout's mask, as wide (an upper bound: ATen keeps no mask where the input needs
  // no gradient). Plugins after this one that re-derive the activations (another compute dtype,
  // checkpointing) keep the term.
  // With DoRA, the two products by the magnitude's scale keep their other operands: the base's
  // result and the adapter's, each as wide as the output, and three (out) vectors a target: the
  // norm n (for s = m / n's gradient), s and s - 1. Not counted (DoRA's estimate is not to the
  // byte, docs/lora.md): backward's (tokens, out) temporaries, and the norm's tiles of
  // W + scaling · B A (8 MB at most, transient).
  // PiSSA and OLoRA keep their initial A0 and B0 (fp32) all the run, as adapters: PEFT's conversion
  // of every adapter saved needs them.
  void estimate_memory(memrt::memory::MemoryEstimate& e) const override {
    if (freeze_mode_) return;
    if (memrt::lora::init_from_base(options_.init))
      for (const auto& [name, t] : targets_)
        e.table.at(memrt::memory::Category::kAdapters) += options_.r * (t.in + t.out) * int64_t{4};
    if (options_.dropout == 0.0 && !options_.dora) return;
    const int64_t tokens = e.run->micro_batch_size * e.run->block_size;
    const int64_t width = static_cast<int64_t>(c10::elementSize(e.compute_dtype));
    for (const auto& [name, t] : targets_) {
      const int64_t block = memrt::memory::param_segment(name + ".weight", e.run->shape.n_layer);
      const int64_t per_token = (options_.dropout > 0.0 ? 2 * t.in : 0) + (options_.dora ? 2 * t.out : 0);
      const int64_t per_target = options_.dora ? 3 * t.out : 0;
      e.activations.per_block.at(static_cast<size_t>(block)) += (tokens * per_token + per_target) * width;
    }
    e.refresh_activations();
  }

  // What the adapters take from the base weights, here as each block is built, while every target's
  // weight is whole (by transform_model a base that ZeRO-3 partitions rests as a placeholder) and
  // as the checkpoint holds it (before a 16-bit base is cast). DoRA: its magnitudes start as the
  // base's row norms (PEFT: ||W + B A||_row with B zero), in the dtype the base is kept in; a base
  // another plugin replaced (4-bit) has no floating weight here, and its LoRA layer reads it through
  // memrt::DenseWeight. PiSSA / OLoRA: A0 and B0 from W's decomposition, and W replaced by its
  // residual W - scaling · B0 A0 (docs/lora.md, "From the base weights").
  void on_block_ready(memrt::BlockReady& ctx) override {
    if (freeze_mode_ || !(options_.dora || memrt::lora::init_from_base(options_.init))) return;
    if (memrt::lora::init_from_base(options_.init) && !ctx.checkpoint)
      throw memrt::ConfigError(init_file_, "init_lora_weights", "is " + init_node_.to_json(0) +
                               ", which starts the adapters from a pretrained base's weights, and no "
                               "model_name_or_path gives one (a random base has no components worth starting from); "
                               "set model_name_or_path, or use true");
    at::NoGradGuard no_grad;
    for (const std::string& name : ctx.block.linear_names()) {
      const std::string module = ctx.block.hf_prefix() + "." + name;
      if (!targets_.count(module)) continue;
      const auto own = ctx.block.linear(name).ptr()->named_parameters(/*recurse=*/false);
      const at::Tensor* w = own.find("weight");
      if (!w || !at::isFloatingType(w->scalar_type())) continue;
      memrt::lora::FromBase& from = from_base_[module];
      if (options_.dora) from.norm = at::linalg_vector_norm(w->to(at::kFloat), 2, {1}, false, std::nullopt);
      if (memrt::lora::init_from_base(options_.init)) {
        w->copy_(memrt::lora::init_from_weight(*w, options_, from));
        memrt::memory::claim_all({from.a, from.b}, memrt::memory::Category::kAdapters);
      }
    }
  }

  void transform_model(memrt::ModelContext& ctx) override {
    if (freeze_mode_) return;
    for (int64_t i = 0; i < ctx.model.num_blocks(); ++i) {
      memrt::Block& block = ctx.model.block(i);
      for (const std::string& name : block.linear_names()) {
        const std::string module = block.hf_prefix() + "." + name;
        auto it = targets_.find(module);
        if (it == targets_.end()) continue;
        auto from = from_base_.find(module);
        // A from the run's seeded default generator (PEFT's init), B zero; or what on_block_ready took.
        block.replace_linear(name, torch::nn::AnyModule(memrt::lora::LoraLinear(
                                       block.linear(name), it->second.in, it->second.out, options_,
                                       from == from_base_.end() ? memrt::lora::FromBase{} : from->second)));
      }
    }
    // DoRA's norms are used; PiSSA's and OLoRA's A0 and B0 stay for every adapter saved.
    for (auto& [module, from] : from_base_) from.norm = at::Tensor();
    if (!adapter_dir_.empty()) load_adapter(ctx.model);
  }

  // Every checkpoint holds the adapters as PEFT saves them (adapter_config.json,
  // adapter_model.safetensors): PeftModel.from_pretrained(base, "<output_dir>/global_step<N>")
  // loads them, as it loads a Hugging Face Trainer checkpoint of a PEFT run.
  // Every checkpoint holds PEFT's files, and output_dir/adapter/ the newest checkpoint's (Hugging
  // Face Trainer's output_dir after save_model: the adapter to load, without the training state).
  void write_checkpoint_files(memrt::CheckpointFilesContext& ctx) override {
    if (freeze_mode_) return;
    for (const char* f : write_peft_files(ctx.dir, ctx.saved, ctx.run)) ctx.files.push_back(f);
    const std::string newest = ctx.run.output_dir + "/" + kAdapterDir;
    std::filesystem::create_directories(newest);
    write_peft_files(newest, ctx.saved, ctx.run);
  }

  // `launcher export`: the base as the other plugins and the host write it, and the adapters beside
  // it in PEFT's files — PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out), out).
  // With --merge, PEFT's merge_and_unload instead: W += (B A) · scaling in fp32, transposed into
  // GPT-2's Conv1D layout, and no adapter files.
  // PiSSA / OLoRA: export reads the original base (it stays in model_name_or_path), from which A0
  // and B0 are taken again as the run took them; the adapter written and merged is PEFT's conversion.
  void export_model(memrt::ExportContext& ctx) override {
    if (freeze_mode_) return;
    const bool conv1d = ctx.run.shape.arch == "gpt2";  // Hugging Face's layout of every projection
    if (memrt::lora::init_from_base(options_.init)) {
      for (const auto& [module, t] : targets_) {
        auto it = ctx.tensors.find(module + ".weight");
        if (it == ctx.tensors.end())
          throw memrt::Error("launcher export: the base weight of '" + module + "' is not written in full "
                             "precision, so PiSSA's / OLoRA's initial adapter cannot be taken from it again");
        memrt::lora::init_from_weight(conv1d ? it->second.t() : it->second, options_, from_base_[module]);
      }
    }
    if (ctx.merge) {
      for (const auto& [module, t] : targets_) {
        auto it = ctx.tensors.find(module + ".weight");
        if (it == ctx.tensors.end())
          throw memrt::Error("launcher export --merge: the base weight of '" + module + "' is not written in "
                             "full precision, so its adapter cannot be merged into it");
        const auto [a, b] = adapter_pair(module, ctx.saved);
        const at::Tensor delta = b.mm(a) * memrt::lora::lora_scaling(options_);
        at::Tensor w = (conv1d ? it->second.t() : it->second) + delta;  // (out, in)
        if (options_.dora) {  // PEFT's DoRA merge: each row scaled to its magnitude m
          const at::Tensor m = ctx.saved.read(memrt::lora::magnitude_name(module)).to(at::kFloat);
          w = w * (m / at::linalg_vector_norm(w, 2, {1}, false, std::nullopt)).unsqueeze(1);
        }
        it->second = conv1d ? w.t().contiguous() : w;
      }
    } else {
      std::filesystem::create_directories(ctx.run.output_dir);
      write_peft_files(ctx.run.output_dir, ctx.saved, ctx.run);
    }
    for (const std::string& name : ctx.saved.names())
      if (memrt::lora::is_adapter(name)) ctx.handled.insert(name);
  }

  void plan_store(memrt::StorePlanContext& ctx) override {
    if (freeze_mode_) return;
    memrt::StorePlan& plan = ctx.plan;
    // Adapters sharing a group with other trainable parameters get a group of their own, so that
    // their weights are counted apart; with LoRA+ (loraplus_lr_ratio) the B matrices and every 1-d
    // trainable parameter get one more, at the ratio times the group's learning rate and with its
    // weight decay — PEFT's create_loraplus_optimizer (and LLaMA-Factory's): DoRA's magnitudes, the
    // biases of bias "all" / "lora_only", the LayerNorms of modules_to_save. Group by group: groups
    // another plugin split (8-bit state's 32-bit small tensors) keep their layouts.
    const std::vector<memrt::StoreGroup> groups = plan.groups();  // add_group changes the list
    for (const memrt::StoreGroup& g : groups) {
      std::set<std::string> adapters, bs;
      for (int slot : g.slots) {
        const memrt::ParamInfo& p = plan.slots()[static_cast<size_t>(slot)].param;
        if (memrt::lora::is_lora_b(p.name) || p.shape.size() == 1) bs.insert(p.name);
        if (memrt::lora::is_adapter(p.name)) adapters.insert(p.name);
      }
      if (!adapters.empty() && adapters.size() < g.slots.size())
        plan.add_group({g.name + "_lora", [adapters](const memrt::ParamInfo& p) { return adapters.count(p.name) > 0; },
                        g.weight_decay, g.lr_scale});
      if (loraplus_ratio_ != 1.0 && !bs.empty())
        plan.add_group({g.name + "_lora_B", [bs](const memrt::ParamInfo& p) { return bs.count(p.name) > 0; },
                        g.weight_decay, g.lr_scale * loraplus_ratio_});
    }
    const auto all_adapters = [&plan](const memrt::StoreGroup& g) {
      for (int slot : g.slots)
        if (!memrt::lora::is_adapter(plan.slots()[static_cast<size_t>(slot)].param.name)) return false;
      return !g.slots.empty();
    };
    plan.set_weights_category(memrt::memory::Category::kAdapters, memrt::GroupSelector("groups of LoRA adapters", all_adapters));
  }

 private:
  void configure_freeze(const memrt::ConfigNode& options, memrt::ConfigReader& r) {
    freeze_.file = options.file();
    freeze_.trainable_layers = r.get<int64_t>("freeze_trainable_layers", freeze_.trainable_layers);
    if (const memrt::ConfigNode* m = r.child("freeze_trainable_modules"); m && !m->is_null()) {
      freeze_.modules = m->as_names();
      if (freeze_.modules.empty()) throw m->error("names no module; use \"all\" or module names");
    }
    if (const memrt::ConfigNode* m = r.child("freeze_extra_modules"); m && !m->is_null())
      freeze_.extra = m->as_names();
    freeze_.llama_pro = r.get<bool>("use_llama_pro", false);
    if (freeze_.trainable_layers == 0)
      throw memrt::ConfigError(freeze_.file, "freeze_trainable_layers",
                               "is 0: no layer would train; use n > 0 for the last n layers or "
                               "n < 0 for the first -n");
  }

  void configure_lora(const memrt::ConfigNode& options, memrt::ConfigReader& r, memrt::ConfigDiagnostics& diag) {
    rule_.file = options.file();
    const memrt::ConfigNode* rank = r.child("lora_r");
    const memrt::ConfigNode* alpha = r.child("lora_alpha");
    const memrt::ConfigNode* dropout = r.child("lora_dropout");
    const memrt::ConfigNode* rslora = r.child("use_rslora");
    const memrt::ConfigNode* targets = r.child("lora_target_modules");
    const memrt::ConfigNode* dir = r.child("lora_model_dir");
    const memrt::ConfigNode* layers = r.child("layers_to_transform");
    const memrt::ConfigNode* saved = r.child("lora_modules_to_save");
    const memrt::ConfigNode* dora = r.child("use_dora");
    const memrt::ConfigNode* init = r.child("init_lora_weights");
    if (const memrt::ConfigNode* ratio = r.child("loraplus_lr_ratio"); ratio && !ratio->is_null()) {
      loraplus_ratio_ = ratio->as_double();
      if (!(loraplus_ratio_ > 0.0))
        throw ratio->error("is " + ratio->to_json(0) + "; LoRA+'s ratio of B's learning rate to A's must be positive "
                           "(16 in the paper)");
    }
    if (dir && !dir->is_null()) {
      // A saved adapter brings its own settings (PeftModel.from_pretrained); train.yaml may repeat
      // them, not contradict them.
      adapter_dir_ = dir->as_string();
      const memrt::lora::PeftAdapterConfig peft = memrt::lora::read_peft_config(adapter_dir_);
      diag.warnings.insert(diag.warnings.end(), peft.warnings.begin(), peft.warnings.end());
      const auto agree = [&](const memrt::ConfigNode* n, bool same, const std::string& what) {
        if (n && !n->is_null() && !same)
          throw n->error("is " + n->to_json(0) + " but " + peft.file + " says " + what +
                         ": the adapter loaded decides; remove the key or load another adapter");
      };
      agree(rank, rank && !rank->is_null() && rank->as_int() == peft.r, "r " + std::to_string(peft.r));
      agree(alpha, alpha && !alpha->is_null() && alpha->as_double() == peft.alpha, "lora_alpha " + std::to_string(peft.alpha));
      agree(rslora, rslora && !rslora->is_null() && rslora->as_bool() == peft.rslora, "use_rslora " + std::string(peft.rslora ? "true" : "false"));
      agree(dora, dora && !dora->is_null() && dora->as_bool() == peft.dora, "use_dora " + std::string(peft.dora ? "true" : "false"));
      options_.dora = peft.dora;
      agree(targets, false, "target_modules");
      agree(layers, layers && !layers->is_null() && memrt::lora::read_layers(*layers) == peft.layers_to_transform,
            "layers_to_transform " + (peft.layers_to_transform.empty() ? std::string("null") : std::string("another list")));
      options_.r = peft.r;
      options_.alpha = peft.alpha;
      options_.rslora = peft.rslora;
      options_.dropout = peft.dropout;
      rule_.file = peft.file;
      rule_.modules = peft.target_modules;
      rule_.all_linear = peft.target_regex == "all-linear";  // a LoraConfig saved before PEFT resolved it
      if (!rule_.all_linear) rule_.regex = peft.target_regex;
      rule_.layers = peft.layers_to_transform;
      bias_ = peft.bias;
      modules_to_save_ = peft.modules_to_save;
      agree(saved, saved && !saved->is_null() && saved->as_names() == peft.modules_to_save, "modules_to_save");
      fan_in_fan_out_ = peft.fan_in_fan_out;
      init_node_ = peft.init_lora_weights;  // how PEFT first set them, written back as it was
      if (init && !init->is_null())
        diag.note(*init, "is ignored: the adapters start from the tensors of " + adapter_dir_);
    } else if (init && !init->is_null()) {
      options_.init = memrt::lora::read_lora_init(*init);
      init_node_ = memrt::lora::lora_init_node(options_.init);
      init_file_ = init->file();
    }
    if (rank && !rank->is_null()) options_.r = rank->as_int();
    if (options_.r <= 0) throw memrt::ConfigError(rule_.file, "lora_r", "is " + std::to_string(options_.r) + "; the rank must be positive");
    if (alpha && !alpha->is_null()) options_.alpha = alpha->as_double();
    if (dropout && !dropout->is_null()) options_.dropout = dropout->as_double();
    if (!(options_.dropout >= 0.0 && options_.dropout < 1.0))
      throw memrt::ConfigError(options.file(), "lora_dropout", "is " + std::to_string(options_.dropout) +
                                                                   "; a dropout probability must be in [0, 1)");
    if (rslora && !rslora->is_null()) options_.rslora = rslora->as_bool();
    if (dora && !dora->is_null()) options_.dora = dora->as_bool();
    if (options_.init == memrt::lora::LoraInit::kOrthogonal && options_.r % 2 != 0)
      throw init->error("is \"orthogonal\", which needs an even rank (its A and B are the two halves of an r x r "
                        "orthogonal matrix); r is " + std::to_string(options_.r));
    if ((options_.init == memrt::lora::LoraInit::kLinear || memrt::lora::init_from_base(options_.init)) && options_.dora)
      throw init->error("is " + init->to_json(0) + " with use_dora: DoRA's magnitudes from a non-zero B A at init "
                        "are not built; use true, \"gaussian\" or \"orthogonal\"");
    if (layers && !layers->is_null()) rule_.layers = memrt::lora::read_layers(*layers);
    if (saved && !saved->is_null()) {
      modules_to_save_ = saved->as_names();
      modules_key_file_ = saved->file();
    } else if (!modules_to_save_.empty()) {
      modules_key_file_ = rule_.file;  // the adapter's
    }
    if (targets && !targets->is_null()) {
      if (targets->is_string()) {
        // The loader made a name list of every other string: a string here is PEFT's (a regex).
        rule_.all_linear = targets->as_string() == "all-linear";
        if (!rule_.all_linear) rule_.regex = targets->as_string();
      } else {
        rule_.modules = targets->as_names();
        if (rule_.modules.empty()) throw targets->error("names no module; list module names or use all-linear");
      }
    }
  }

  // PiSSA and OLoRA start from a pretrained base in full precision (docs/lora.md, "From the base
  // weights"): each refusal names init_lora_weights.
  void check_init_from_base(const memrt::ParamPlanContext& ctx) const {
    const std::string init = options_.init == memrt::lora::LoraInit::kPissa ? "pissa" : "olora";
    const auto refuse = [&](const std::string& why) {
      throw memrt::ConfigError(init_file_, "init_lora_weights", "is \"" + init + "\", " + why);
    };
    if (init == "olora" && ctx.run.shape.arch == "gpt2")
      refuse("which PEFT builds for nn.Linear only (its olora_init decomposes GPT-2's Conv1D weight as stored, "
             "(in, out), and makes adapters of the wrong shape); use \"pissa\", which transposes it");
    for (const memrt::ParamInfo& p : ctx.params) {
      const std::string module = p.name.size() > 7 ? p.name.substr(0, p.name.size() - 7) : std::string();
      auto t = targets_.find(module);
      if (t == targets_.end() || p.name != module + ".weight") continue;
      if (!at::isFloatingType(p.dtype))
        refuse("and " + p.name + " is kept in 4 bits (load_in_4bit): PEFT refuses PiSSA on a quantized base too; "
               "initialise on the 16-bit model and quantize its residual, or train this base with true");
      if (options_.r > std::min(t->second.in, t->second.out))
        refuse("which takes r = " + std::to_string(options_.r) + " components of " + p.name + " (" +
               std::to_string(t->second.out) + " x " + std::to_string(t->second.in) + "); use a smaller lora_r");
    }
  }

  // A target's A (r, in) and B (out, r) as saved, in fp32; PiSSA / OLoRA: PEFT's conversion to a
  // plain LoRA on the original base, A' = [A; A0] and B' = [B, -B0] (B'A' = BA - B0A0).
  std::pair<at::Tensor, at::Tensor> adapter_pair(const std::string& module, const memrt::SavedParameters& saved) const {
    at::Tensor a = saved.read(memrt::lora::lora_a_name(module)).to(at::kFloat);
    at::Tensor b = saved.read(memrt::lora::lora_b_name(module)).to(at::kFloat);
    if (memrt::lora::init_from_base(options_.init)) {
      const memrt::lora::FromBase& from = from_base_.at(module);
      a = at::cat({a, from.a}, 0);
      b = at::cat({b, -from.b}, 1);
    }
    return {a, b};
  }

  // adapter_config.json and adapter_model.safetensors in `dir` from the saved adapters (their fp32
  // masters where the run kept them); returns the files' names.
  std::vector<const char*> write_peft_files(const std::string& dir, const memrt::SavedParameters& saved,
                                            const memrt::RunInfo& run) const {
    memrt::lora::PeftAdapterConfig c;
    c.base_model_name_or_path = run.model_name_or_path;
    c.r = options_.r;
    c.alpha = options_.alpha;
    const bool converted = memrt::lora::init_from_base(options_.init);
    if (converted) {  // PEFT's save_pretrained(..., path_initial_model_for_weight_conversion=...)
      c.r = 2 * options_.r;
      c.alpha = options_.rslora ? options_.alpha * std::sqrt(2.0) : 2 * options_.alpha;  // scaling kept
    }
    c.dropout = options_.dropout;
    c.rslora = options_.rslora;
    c.dora = options_.dora;
    c.fan_in_fan_out = run.shape.arch == "gpt2";  // PEFT's flag for GPT-2's Conv1D projections
    c.layers_to_transform = rule_.layers;
    c.bias = bias_;
    c.modules_to_save = modules_to_save_;
    c.init_lora_weights = converted ? memrt::ConfigNode::boolean(true) : init_node_;
    std::set<std::string> modules;  // the targets' own names, as PEFT resolves target_modules
    for (const auto& [name, t] : targets_) modules.insert(name.substr(name.rfind('.') + 1));
    c.target_modules.assign(modules.begin(), modules.end());
    c.target_regex = rule_.regex;  // a regex stays one: its resolved names could not say which blocks
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const std::string& name : saved.names()) {
      if (!in_adapter_file(name)) continue;
      at::Tensor t = saved.read(name);
      if (converted && memrt::lora::is_adapter(name)) {
        const std::string module = name.substr(0, name.rfind(".lora_"));
        const auto [a, b] = adapter_pair(module, saved);
        t = (memrt::lora::is_lora_b(name) ? b : a).to(t.scalar_type());
      }
      tensors.emplace_back(file_key(name), t);
    }
    memrt::write_file_atomic(dir + "/" + memrt::lora::kPeftConfigFile, memrt::lora::peft_config_json(c));
    memrt::write_safetensors(dir + "/" + memrt::lora::kPeftWeightsFile, tensors, {{"format", "pt"}});
    return {memrt::lora::kPeftConfigFile, memrt::lora::kPeftWeightsFile};
  }

  // Whether the bias mode trains parameter `name` (a bias), and then PEFT saves it with the adapter.
  bool trained_bias(const std::string& name) const { return memrt::lora::bias_trains(name, bias_, targets_); }

  // Whether PEFT's adapter file holds parameter `name`: the adapters, the biases of the bias mode,
  // the modules trained in full.
  bool in_adapter_file(const std::string& name) const {
    return memrt::lora::is_adapter(name) || trained_bias(name) || memrt::lora::saved_module(name, modules_to_save_);
  }

  // A parameter's key in PEFT's file: a target's own bias is its base layer's
  // ("<module>.base_layer.bias", where PEFT's LoRA layer keeps the wrapped one).
  std::string file_key(const std::string& name) const {
    const std::string module = name.size() > 5 ? name.substr(0, name.size() - 5) : std::string();
    if (name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0 && targets_.count(module))
      return memrt::lora::peft_key(module + ".base_layer.bias");
    return memrt::lora::peft_key(name);
  }

  // The loaded adapter's tensors into the wrapped layers (DoRA's magnitudes too), the biases its bias
  // mode trains and the modules it trains in full, by PEFT key; anything else in the file is an
  // error naming it.
  void load_adapter(memrt::CausalLM& model) const {
    const memrt::SafetensorsFile file = memrt::lora::open_peft_weights(adapter_dir_);
    std::set<std::string> unread;
    for (const std::string& key : file.names()) unread.insert(key);
    at::NoGradGuard no_grad;
    for (const auto& item : model.named_parameters(/*recurse=*/true)) {
      if (!in_adapter_file(item.key())) continue;
      const std::string key = file_key(item.key());
      if (!file.contains(key))
        throw memrt::FileError(file.path(), "has no tensor " + key + ", which the adapter's target_modules (and bias \"" +
                                                bias_ + "\") ask for");
      const at::Tensor t = file.tensor(key);
      if (t.sizes() != item.value().sizes())
        throw memrt::FileError(file.path(), key + " has shape " + c10::str(t.sizes()) + "; the model's is " +
                                                c10::str(item.value().sizes()) + " (another base model or rank?)");
      item.value().copy_(t);
      unread.erase(key);
    }
    if (!unread.empty())
      throw memrt::FileError(file.path(), "holds " + *unread.begin() + (unread.size() > 1 ? " and " + std::to_string(unread.size() - 1) + " more" : "") +
                                              ", which this model's LoRA adapters do not have; memrt loads adapters of "
                                              "lora_A, lora_B and DoRA's magnitude, the biases of their bias mode "
                                              "and the modules trained in full");
  }

  static constexpr char kAdapterDir[] = "adapter";  // in output_dir: the newest checkpoint's adapter

  bool freeze_mode_ = false;
  memrt::lora::FreezeOptions freeze_;
  memrt::lora::LoraOptions options_;
  memrt::lora::TargetRule rule_;
  std::string adapter_dir_;  // lora_model_dir / adapter_name_or_path: a PEFT adapter to start from
  std::string bias_ = "none";  // PEFT's bias mode, from the adapter loaded
  std::vector<std::string> modules_to_save_;  // trained in full (PEFT's modules_to_save)
  std::string modules_key_file_;              // the file that named them, for errors
  bool fan_in_fan_out_ = false;
  double loraplus_ratio_ = 1.0;  // LoRA+: B's learning rate over A's
  memrt::ConfigNode init_node_ = memrt::ConfigNode::boolean(true);  // init_lora_weights, as adapter_config.json says it
  std::string init_file_;  // the file that set init_lora_weights, for errors
  std::map<std::string, Target> targets_;  // by module name
  // By target, what on_block_ready took from its base weight: DoRA's ||W||_row (to transform_model),
  // PiSSA's / OLoRA's A0 and B0 (all the run: every adapter saved is converted with them).
  std::map<std::string, memrt::lora::FromBase> from_base_;
};

}  // namespace

MEMRT_PLUGIN(LoraPlugin, "lora", "0.4.0", "LoRA adapters (PEFT's), freeze tuning (LLaMA-Factory's)")
