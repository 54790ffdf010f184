// ds_config.json + train.yaml + overrides -> TrainConfig. The decisions (which key is supported,
// accepted with a warning or rejected, and every default) are tabled in docs/configuration.md;
// keep the two in step.
#include "config/load_config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <tuple>

#include "config/batch_triple.h"
#include "config/data_files.h"

namespace memrt {
namespace {

namespace fs = std::filesystem;

const char* const kCommandLine = "command line";

// ---- small helpers ------------------------------------------------------------------------------

std::string where(const ConfigNode& n) {
  return (n.file().empty() ? std::string("config") : n.file()) + " '" + n.path() + "'";
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool same_number(double a, double b) {
  return a == b || std::fabs(a - b) <= 1e-12 * std::max(std::fabs(a), std::fabs(b));
}

std::string num_text(double v) { return ConfigNode::number(v).to_json(0); }

// A value of the ds_config (`ds`) that contradicts an explicit train.yaml value (`yaml`).
[[noreturn]] void contradiction(const ConfigNode& ds, const std::string& ds_value, const ConfigNode& yaml,
                                const std::string& yaml_value, const std::string& advice) {
  throw ConfigError(ds.file(), ds.path(),
                    "is " + ds_value + " but " + where(yaml) + " is " + yaml_value + ": " + advice);
}

const std::string kSetAuto = "make them equal, or set the ds_config value to \"auto\" so train.yaml decides";

enum class Ty { Bool, Int, Num, Str, Obj, Any };

void check_type(const ConfigNode& n, Ty t) {
  switch (t) {
    case Ty::Bool: n.as_bool(); break;
    case Ty::Int: n.as_int(); break;
    case Ty::Num: n.as_double(); break;
    case Ty::Str: n.as_string(); break;
    case Ty::Obj:
      if (!n.is_object()) throw n.error("expected an object, found " + n.describe());
      break;
    case Ty::Any: break;
  }
}

// Reads `key` and copies it (type-checked, "auto" kept for the final check) into `out` as `as`.
const ConfigNode* pass(ConfigReader& r, ConfigNode& out, const char* key, Ty t, const char* as = nullptr) {
  const ConfigNode* n = r.child(key);
  if (!n || n->is_null()) return nullptr;
  if (!n->is_auto()) check_type(*n, t);
  const std::string name = as ? as : key;
  if (out.contains(name)) {
    throw n->error("gives '" + name + "' a second time (it is an alias of '" + name + "'): keep one");
  }
  out.set(name, *n);
  return n;
}

// A section with an "enabled" flag: disabled -> one warning; enabled -> error.
void reject_if_enabled(ConfigReader& r, ConfigDiagnostics& diag, const char* key, const std::string& instead) {
  const ConfigNode* n = r.child(key);
  if (!n || n->is_null()) return;
  const ConfigNode* enabled = n->is_object() ? n->find("enabled") : nullptr;
  if (enabled && enabled->is_bool() && !enabled->as_bool()) {
    diag.warnings.push_back(where(*n) + " is accepted but ignored: it is disabled, and memrt does not support it (" +
                            instead + ")");
    return;
  }
  throw n->error("is not supported by memrt: " + instead);
}

void scan_for_auto(const ConfigNode& n) {
  if (n.is_auto()) {
    throw n.error(
        "\"auto\" could not be resolved: memrt resolves \"auto\" from train.yaml only for the keys "
        "Hugging Face fills (see docs/configuration.md, \"auto\" values); write the value explicitly");
  }
  if (n.is_array()) {
    for (const auto& item : n.as_array()) scan_for_auto(item);
  } else if (n.is_object()) {
    for (const auto& m : n.members()) scan_for_auto(m.second);
  }
}

// ---- train.yaml ---------------------------------------------------------------------------------

// Canonical train.yaml key -> the spellings accepted for it (canonical first).
const std::vector<std::pair<std::string, std::vector<std::string>>> kYamlKeys = {
    {"model_name_or_path", {"model_name_or_path", "base_model"}},
    {"model", {"model"}},
    {"train_file", {"train_file"}},
    {"dataset_name", {"dataset_name"}},
    {"dataset_config_name", {"dataset_config_name", "dataset_config"}},
    {"dataset_train_split", {"dataset_train_split"}},
    {"dataset_test_split", {"dataset_test_split"}},
    {"dataset_text_field", {"dataset_text_field"}},
    {"datasets", {"datasets"}},
    {"test_datasets", {"test_datasets"}},
    {"train_on_inputs", {"train_on_inputs", "train_on_prompt"}},
    {"dataset", {"dataset"}},
    {"eval_dataset", {"eval_dataset"}},
    {"dataset_dir", {"dataset_dir"}},
    {"template", {"template"}},
    {"mask_history", {"mask_history"}},
    {"default_system", {"default_system"}},
    {"enable_thinking", {"enable_thinking"}},
    {"max_samples", {"max_samples"}},
    {"mix_strategy", {"mix_strategy"}},
    {"completion_only_loss", {"completion_only_loss"}},
    {"assistant_only_loss", {"assistant_only_loss"}},
    {"chat_template", {"chat_template"}},
    {"chat_template_jinja", {"chat_template_jinja"}},
    {"eot_tokens", {"eot_tokens"}},
    {"chat_template_kwargs", {"chat_template_kwargs"}},
    {"pad_to_sequence_len", {"pad_to_sequence_len"}},
    {"sample_packing", {"sample_packing", "packing", "neat_packing"}},
    {"dataset_prepared_path", {"dataset_prepared_path", "tokenized_path"}},
    {"eval_file", {"eval_file", "validation_file"}},
    {"eval_steps", {"eval_steps"}},
    {"eval_strategy", {"eval_strategy", "evaluation_strategy"}},
    {"evals_per_epoch", {"evals_per_epoch"}},
    {"per_device_eval_batch_size", {"per_device_eval_batch_size", "eval_batch_size"}},
    {"block_size", {"block_size", "sequence_len", "max_seq_length", "cutoff_len", "max_length"}},
    {"output_dir", {"output_dir"}},
    {"seed", {"seed"}},
    {"memory_budget", {"memory_budget"}},
    {"no_preflight", {"no_preflight"}},
    {"chunked_cross_entropy",
     {"chunked_cross_entropy", "use_liger_kernel", "enable_liger_kernel", "liger_fused_linear_cross_entropy"}},
    {"logging_steps", {"logging_steps"}},
    {"save_steps", {"save_steps"}},
    {"save_strategy", {"save_strategy"}},
    {"saves_per_epoch", {"saves_per_epoch"}},
    {"save_total_limit", {"save_total_limit"}},
    {"max_steps", {"max_steps"}},
    {"num_train_epochs", {"num_train_epochs", "num_epochs"}},
    {"per_device_train_batch_size", {"per_device_train_batch_size", "micro_batch_size"}},
    {"gradient_accumulation_steps", {"gradient_accumulation_steps"}},
    {"learning_rate", {"learning_rate"}},
    {"weight_decay", {"weight_decay"}},
    {"lr_groups", {"lr_groups"}},
    {"embedding_lr", {"embedding_lr"}},
    {"embedding_lr_scale", {"embedding_lr_scale"}},
    {"adam_beta1", {"adam_beta1"}},
    {"adam_beta2", {"adam_beta2"}},
    {"adam_epsilon", {"adam_epsilon"}},
    {"max_grad_norm", {"max_grad_norm"}},
    {"lr_scheduler_type", {"lr_scheduler_type", "lr_scheduler"}},
    {"warmup_steps", {"warmup_steps"}},
    {"warmup_ratio", {"warmup_ratio"}},
    {"bf16", {"bf16"}},
    {"fp16", {"fp16"}},
    {"torch_dtype", {"torch_dtype"}},
    {"gradient_checkpointing", {"gradient_checkpointing"}},
    {"gradient_checkpointing_kwargs", {"gradient_checkpointing_kwargs"}},
    {"optim", {"optim", "optimizer"}},
    {"lora_r", {"lora_r", "lora_rank"}},
    {"lora_alpha", {"lora_alpha"}},
    {"lora_dropout", {"lora_dropout"}},
    {"lora_target_modules", {"lora_target_modules"}},
    {"lora_target", {"lora_target"}},
    {"lora_target_linear", {"lora_target_linear"}},
    {"lora_model_dir", {"lora_model_dir", "adapter_name_or_path"}},
    {"use_rslora", {"use_rslora", "peft_use_rslora"}},
    {"use_dora", {"use_dora", "peft_use_dora"}},
    {"init_lora_weights", {"init_lora_weights", "peft_init_lora_weights"}},
    {"loraplus_lr_ratio", {"loraplus_lr_ratio"}},
    {"layers_to_transform", {"layers_to_transform", "peft_layers_to_transform"}},
    {"lora_modules_to_save", {"lora_modules_to_save", "additional_target"}},
    {"use_peft", {"use_peft"}},
    {"adapter", {"adapter"}},
    {"finetuning_type", {"finetuning_type"}},
    {"freeze_trainable_layers", {"freeze_trainable_layers"}},
    {"freeze_trainable_modules", {"freeze_trainable_modules"}},
    {"freeze_extra_modules", {"freeze_extra_modules"}},
    {"use_llama_pro", {"use_llama_pro"}},
    {"load_in_4bit", {"load_in_4bit"}},
    {"load_in_8bit", {"load_in_8bit"}},
    {"bnb_4bit_quant_type", {"bnb_4bit_quant_type"}},
    {"bnb_4bit_use_double_quant", {"bnb_4bit_use_double_quant"}},
    {"bnb_4bit_compute_dtype", {"bnb_4bit_compute_dtype"}},
    {"bnb_4bit_quant_storage", {"bnb_4bit_quant_storage"}},
    {"quantization_type", {"quantization_type"}},
    {"double_quantization", {"double_quantization"}},
    {"quantization_bit", {"quantization_bit"}},
    {"quantization_method", {"quantization_method"}},
    {"deepspeed", {"deepspeed"}},
    {"resume_from_checkpoint", {"resume_from_checkpoint"}},
    {"stage", {"stage"}},
    {"val_set_size", {"val_set_size"}},
    {"val_size", {"val_size"}},
    {"shuffle_merged_datasets", {"shuffle_merged_datasets"}},
    {"gptq_model_v1", {"gptq_model_v1"}},
};

// Keys of other tools that do not change what memrt trains: accepted with one warning each.
const std::vector<std::pair<const char*, const char*>> kYamlIgnored = {
    {"report_to", "metrics go to output_dir/metrics.jsonl"},
    {"run_name", "metrics go to output_dir/metrics.jsonl"},
    {"logging_dir", "metrics go to output_dir/metrics.jsonl"},
    {"logging_strategy", "memrt logs every logging_steps steps"},
    {"logging_first_step", "memrt logs every logging_steps steps"},
    {"wandb_project", "no Weights & Biases logging"},
    {"wandb_entity", "no Weights & Biases logging"},
    {"wandb_watch", "no Weights & Biases logging"},
    {"wandb_name", "no Weights & Biases logging"},
    {"wandb_log_model", "no Weights & Biases logging"},
    {"hub_model_id", "nothing is pushed to the Hugging Face Hub"},
    {"hub_strategy", "nothing is pushed to the Hugging Face Hub"},
    {"hub_private_repo", "nothing is pushed to the Hugging Face Hub"},
    {"push_to_hub", "nothing is pushed to the Hugging Face Hub"},
    {"push_dataset_to_hub", "nothing is pushed to the Hugging Face Hub"},
    {"model_revision", "models are local directories"},
    {"trust_remote_code", "memrt runs its own built-in architectures, never remote code"},
    {"attn_implementation", "memrt has one attention implementation"},
    {"flash_attention", "memrt has one attention implementation"},
    {"tf32", "TF32 matmul is a GPU setting; memrt keeps fp32 matmul exact"},
    {"save_only_model", "checkpoints always hold the full training state"},
    {"overwrite_output_dir", "memrt writes into output_dir"},
    {"do_train", "memrt always trains"},
    {"do_eval", "memrt evaluates eval_file when it is set, after the last step and as eval_steps says"},
    {"eval_sample_packing", "memrt always packs the eval text into contiguous block_size windows"},
    {"eval_accumulation_steps", "memrt sums the eval loss as it goes; nothing is accumulated"},
    {"prediction_loss_only", "memrt's evaluation computes the loss alone"},
    {"dataloader_num_workers", "memrt's data loader has no worker processes"},
    {"preprocessing_num_workers", "memrt's data loader has no worker processes"},
    {"dataset_num_proc", "memrt's data loader has no worker processes"},
    {"ddp_timeout", "a dead rank is detected by memrt's own bounded timeout"},
    {"ddp_find_unused_parameters", "every parameter of memrt's models gets a gradient"},
    {"log_level", "memrt logs at one level"},
    {"plot_loss", "metrics.jsonl holds the loss curve"},
    {"low_cpu_mem_usage", "memrt always materialises models one block at a time"},
    {"special_tokens", "memrt tokenizes with model_name_or_path's tokenizer.json as saved (bytes without one)"},
    {"tokenizer_type", "memrt tokenizes with model_name_or_path's tokenizer.json (bytes without one)"},
    {"model_type", "the architecture comes from the model block or the checkpoint's config.json"},
    {"torchdistx_path", "not needed"},
    {"loss_watchdog_threshold", "not implemented; see the loss-spike guard example plugin"},
    {"loss_watchdog_patience", "not implemented; see the loss-spike guard example plugin"},
    {"disable_tqdm", "the progress bar shows only on a terminal"},
    {"overwrite_cache", "the tokenized cache is keyed by the data, the tokenizer and the options: a change tokenizes again"},
};

// Keys of other tools whose meaning memrt cannot honour: ignoring them would change the training.
const std::vector<std::pair<const char*, const char*>> kYamlRejected = {
    {"dataset_mixer", "memrt reads local files: list them in axolotl's datasets: [{path, type}] or set train_file"},
    {"dataset_mixture", "memrt reads local files: list them in axolotl's datasets: [{path, type}] or set train_file"},
    {"dataset_splits", "memrt reads a local train_file; set train_file"},
    {"tool_format", "LLaMA-Factory's tool formats are not built; records with tools are refused"},
    {"interleave_probs", "LLaMA-Factory's datasets are concatenated (mix_strategy: concat)"},
    {"unfrozen_parameters", "memrt trains every parameter, the layers finetuning_type: freeze chooses (freeze_trainable_layers, freeze_trainable_modules, freeze_extra_modules), or LoRA adapters"},
    {"beta", "DPO is not supported: memrt trains causal language modelling"},
    {"max_prompt_length", "DPO is not supported: memrt trains causal language modelling"},
    {"pissa_init", "LLaMA-Factory's pissa_init is PEFT's init_lora_weights \"pissa_niter_16\" by default (pissa_iter), a randomized SVD memrt does not build; write init_lora_weights: pissa for PiSSA from the exact decomposition"},
    {"gptq_groupsize", "GPTQ is not supported; 4-bit weights come from load_in_4bit (NF4/FP4)"},
};

struct YamlValues {
  std::map<std::string, const ConfigNode*> v;  // canonical -> node (absent or null: missing)
  const ConfigNode* get(const std::string& key) const {
    auto it = v.find(key);
    return it == v.end() ? nullptr : it->second;
  }
};

YamlValues read_yaml(const ConfigNode& ty, ConfigDiagnostics& diag) {
  YamlValues y;
  ConfigReader r(ty, diag);
  for (const auto& [canonical, names] : kYamlKeys) {
    const ConfigNode* first = nullptr;
    for (const auto& name : names) {
      const ConfigNode* n = r.child(name);
      if (!n || n->is_null()) continue;
      if (first && first->to_json(0) != n->to_json(0)) {
        throw ConfigError(n->file(), n->path(),
                          "is " + n->to_json(0) + " but " + where(*first) + " is " + first->to_json(0) +
                              ": they are two names of one setting (" + canonical + "); keep one");
      }
      if (!first) first = n;
    }
    if (first) y.v[canonical] = first;
  }
  for (const auto& [key, why] : kYamlIgnored) r.ignore(key, why);
  for (const auto& [key, instead] : kYamlRejected) r.reject(key, instead);
  r.finish();
  return y;
}

// Every spelling of the train.yaml key that `name` spells (null: not a train.yaml key).
const std::vector<std::string>* spellings_of(const std::string& name) {
  for (const auto& entry : kYamlKeys) {
    const auto& names = entry.second;
    if (std::find(names.begin(), names.end(), name) != names.end()) return &names;
  }
  return nullptr;
}

// Canonical keys that choose one thing in different forms: setting one replaces the others (a
// checkpoint directory replaces the yaml's model block and the reverse; a target list replaces
// LLaMA-Factory's lora_target and axolotl's lora_target_linear).
const std::vector<std::vector<std::string>> kSameChoice = {
    {"model_name_or_path", "model"},
    {"lora_target_modules", "lora_target", "lora_target_linear"},
};

// The top-level train.yaml keys a command-line `key` replaces: every spelling of it (`base_model`
// for `model_name_or_path`) and of the keys that make the same choice in another form (kSameChoice).
std::vector<std::string> replaced_keys(const std::string& key) {
  const std::vector<std::string>* names = spellings_of(key);
  if (!names) return {};
  std::vector<std::string> replaced = *names;
  for (const std::vector<std::string>& group : kSameChoice) {
    if (std::find(group.begin(), group.end(), names->front()) == group.end()) continue;
    for (const std::string& other : group)
      if (other != names->front()) replaced.insert(replaced.end(), spellings_of(other)->begin(), spellings_of(other)->end());
  }
  return replaced;
}

// Sets the dotted `key` of `root` to `node`, making the blocks on the way (whose errors name `file`);
// a train.yaml key (`yaml_spellings`) replaces the key under every spelling, as setting the key
// itself would.
void set_key(ConfigNode& root, const std::string& key, ConfigNode node, const std::string& file, bool yaml_spellings) {
  if (root.is_null()) root = ConfigNode::object(file, "");
  if (yaml_spellings)
    for (const std::string& replaced : replaced_keys(key)) root.erase(replaced);
  ConfigNode* parent = &root;
  size_t start = 0;
  for (size_t dot = key.find('.'); dot != std::string::npos; dot = key.find('.', start)) {
    const std::string part = key.substr(start, dot - start);
    ConfigNode* child = parent->find(part);
    if (!child || !child->is_object()) child = &parent->set(part, ConfigNode::object(file, key.substr(0, dot)));
    parent = child;
    start = dot + 1;
  }
  parent->set(key.substr(start), std::move(node));
}

// Applies "--key=value" / "--key value" words to the train.yaml tree. Dotted keys reach into
// blocks ("--model.n_layer=2"). An override replaces the key under every spelling, as it would
// replace the key itself: `--model_name_or_path=D` over axolotl's `base_model: E` trains D.
void apply_overrides(ConfigNode& ty, const std::vector<std::string>& words) {
  for (size_t i = 0; i < words.size(); ++i) {
    const std::string& w = words[i];
    if (w.size() < 3 || w.compare(0, 2, "--") != 0) {
      throw ConfigError(kCommandLine, "",
                        "unexpected word '" + w + "' after the train.yaml: overrides are written "
                        "--key=value or --key value (for example --max_steps=20)");
    }
    std::string key = w.substr(2), value;
    const size_t eq = key.find('=');
    if (eq != std::string::npos) {
      value = key.substr(eq + 1);
      key = key.substr(0, eq);
    } else if (i + 1 < words.size() && words[i + 1].compare(0, 2, "--") != 0) {
      value = words[++i];
    } else {
      value = "true";  // a bare flag, as Hugging Face's argument parser reads `--bf16`
    }
    if (key.empty()) throw ConfigError(kCommandLine, "", "empty key in '" + w + "'");
    set_key(ty, key, parse_yaml_value(value, kCommandLine, key), kCommandLine, true);
  }
}

// Applies the memory advisor's edits (ConfigEdit) of one file to its tree, after the overrides;
// the blocks they make name `origin` in errors (a train.yaml edit is printed as an override).
void apply_edits(ConfigNode& tree, ConfigEdit::File file, const std::string& origin, const std::vector<ConfigEdit>& edits) {
  for (const ConfigEdit& e : edits)
    if (e.file == file) set_key(tree, e.key, e.value, origin, file == ConfigEdit::File::kTrainYaml);
}

// ---- the loader -------------------------------------------------------------------------------

struct Loader {
  const ConfigSources& src;
  ConfigDiagnostics diag;
  TrainConfig cfg;
  YamlValues y;
  ConfigNode ty;  // the train.yaml tree with the overrides applied (`y` points into it)
  ConfigNode ds;  // the ds_config tree (an empty object when there is none)
  std::string ds_file;
  std::string yaml_file;

  explicit Loader(const ConfigSources& s) : src(s) {}

  const ConfigNode* yv(const char* key) const { return y.get(key); }
  double ynum(const char* key, double fallback) const {
    const ConfigNode* n = yv(key);
    return n ? n->as_double() : fallback;
  }

  void run();
  void read_inputs();
  void read_ds_top(ConfigReader& dr);
  void read_flops_profiler(const ConfigNode* section);
  void resolve_batch(const ConfigNode* tbs, const ConfigNode* mbs, const ConfigNode* gas);
  double resolve_value(ConfigReader& r, const char* key, const char* yaml_key, double hf_default,
                       double ds_default, bool resolve_absent_from_yaml = true);
  void resolve_optimizer(const ConfigNode* opt);
  void resolve_group_rules();
  void resolve_scheduler(const ConfigNode* sch);
  void resolve_precision(const ConfigNode* fp16, const ConfigNode* bf16, const ConfigNode* dtypes);
  void resolve_zero(const ConfigNode* zero);
  void resolve_checkpoint(const ConfigNode* ac);
  void resolve_lora_and_quant();
  void resolve_plugins(const ConfigNode* plugins);
  void resolve_model_and_data();
  void resolve_eval();
  void read_dataset_name(const ConfigNode& name);
  std::vector<std::string> dataset_split_files(const char* key, const char* fallback) const;
  void resolve_saving();
  void resolve_records();
  void read_llamafactory_datasets();
  void read_held_out();
  int64_t model_width() const;
  void add_plugin(const std::string& name, std::string first_key, std::vector<std::string> keys,
                  ConfigNode options);

  // optimizer.params.bf16_stochastic_round when true: checked against the bf16 section.
  const ConfigNode* stochastic_round_ = nullptr;
  // model_name_or_path's config.json `quantization_config`: a checkpoint saved quantized.
  std::optional<ConfigNode> hf_quant_;
  // dataset_name's directory, as datasets splits it.
  std::optional<LocalDataset> dataset_dir_;
};

void Loader::read_inputs() {
  ty = ConfigNode::object(src.train_yaml_path, "");
  if (!src.train_yaml_path.empty()) {
    ty = parse_yaml_file(src.train_yaml_path);
    if (ty.is_null()) ty = ConfigNode::object(src.train_yaml_path, "");  // an empty file
    if (!ty.is_object()) {
      throw ConfigError(src.train_yaml_path, "", "expected a map of keys at the top, found " + ty.describe());
    }
  }
  yaml_file = src.train_yaml_path.empty() ? std::string("train.yaml") : src.train_yaml_path;
  apply_overrides(ty, src.overrides);
  apply_edits(ty, ConfigEdit::File::kTrainYaml, kCommandLine, src.edits);
  y = read_yaml(ty, diag);
  cfg.train_yaml = ty;
  cfg.train_yaml_path = src.train_yaml_path;

  // The ds_config: --deepspeed, or train.yaml's `deepspeed:` key; both must name one file.
  std::string path = src.ds_config_path;
  if (const ConfigNode* d = yv("deepspeed")) {
    const std::string& named = d->as_string();
    if (path.empty()) {
      path = named;
    } else {
      std::error_code ec;
      const bool same = fs::equivalent(fs::path(named), fs::path(path), ec);
      if (!same) {
        throw d->error("names '" + named + "' but the ds_config given on the command line (--deepspeed) is '" +
                       path + "': they must be the same file; remove the key or make them agree");
      }
    }
  }
  ds_file = path;
  ds = ConfigNode::object(path, "");
  if (!path.empty()) {
    ds = parse_json_file(path);
    if (!ds.is_object()) throw ConfigError(path, "", "expected a JSON object at the top, found " + ds.describe());
  }
  apply_edits(ds, ConfigEdit::File::kDsConfig, path, src.edits);
  cfg.ds_config = ds;
  cfg.ds_config_path = path;
}

void Loader::run() {
  if (src.world_size <= 0) {
    throw ConfigError(kCommandLine, "world_size", "must be at least 1, got " + std::to_string(src.world_size));
  }
  cfg.world_size = src.world_size;
  cfg.sources = src;
  read_inputs();

  ConfigReader dr(ds, diag);
  const ConfigNode* tbs = dr.child("train_batch_size");
  const ConfigNode* mbs = dr.child("train_micro_batch_size_per_gpu");
  const ConfigNode* gas = dr.child("gradient_accumulation_steps");
  const ConfigNode* opt = dr.child("optimizer");
  const ConfigNode* sch = dr.child("scheduler");
  const ConfigNode* fp16 = dr.child("fp16");
  const ConfigNode* bf16 = dr.child("bf16");
  const ConfigNode* bfloat16 = dr.child("bfloat16");
  const ConfigNode* dtypes = dr.child("data_types");
  const ConfigNode* zero = dr.child("zero_optimization");
  const ConfigNode* ac = dr.child("activation_checkpointing");
  const ConfigNode* plugins = dr.child("plugins");
  if (bf16 && bfloat16) {
    throw bfloat16->error("and '" + bf16->path() + "' are the same section (bfloat16 is the old name of bf16): keep bf16");
  }
  if (bfloat16) bf16 = bfloat16;
  read_ds_top(dr);  // the other top-level keys, then finish()

  resolve_batch(tbs, mbs, gas);
  resolve_model_and_data();  // before the optimizer: ZeRO's "auto" bucket sizes need the width
  resolve_optimizer(opt);
  resolve_scheduler(sch);
  resolve_precision(fp16, bf16, dtypes);
  resolve_zero(zero);
  resolve_checkpoint(ac);
  resolve_lora_and_quant();
  resolve_plugins(plugins);
  for (const auto& p : cfg.plugins) scan_for_auto(p.options);
  cfg.optimizer.seed = cfg.seed;  // stochastic rounding's draws
  cfg.warnings = diag.warnings;
}

// DeepSpeed's flops_profiler: memrt profiles operators, not modules, with LibTorch's profiler
// (docs/profiling.md); the keys that shape DeepSpeed's per-module tree are noted.
void Loader::read_flops_profiler(const ConfigNode* section) {
  if (!section || section->is_null()) return;
  ConfigReader r(*section, diag);
  TrainConfig::FlopsProfiler& p = cfg.flops_profiler;
  p.enabled = r.get<bool>("enabled", false);
  p.profile_step = r.get<int64_t>("profile_step", 1);
  if (p.profile_step < 1) {
    throw r.child("profile_step")->error("must be at least 1 (the optimizer step to profile, counted from 1), got " +
                                         std::to_string(p.profile_step));
  }
  p.output_file = r.get<std::string>("output_file", "");
  const char* why = "memrt's profile lists operators by their own time, not a module tree (docs/profiling.md)";
  for (const char* key : {"module_depth", "top_modules", "detailed", "recompute_fwd_factor"}) {
    if (p.enabled) {
      r.ignore(key, why);
    } else {
      r.child(key);  // a disabled section's settings are not worth a warning each
    }
  }
  r.finish();
}

void Loader::read_ds_top(ConfigReader& dr) {
  // gradient_clipping: DeepSpeed's code default is 1.0 (v0.19.3+); "auto" -> max_grad_norm (HF 1.0).
  cfg.gradient_clipping = resolve_value(dr, "gradient_clipping", "max_grad_norm", 1.0, 1.0);
  if (cfg.gradient_clipping < 0) {
    throw ConfigError(ds_file, "gradient_clipping", "must be >= 0 (0 turns clipping off), got " + num_text(cfg.gradient_clipping));
  }
  // steps_per_print: train.yaml logging_steps wins when set (it is the Hugging Face user's setting).
  if (const ConfigNode* n = dr.child("steps_per_print"); n && !n->is_null()) cfg.steps_per_print = n->as_int();
  if (const ConfigNode* n = yv("logging_steps")) cfg.steps_per_print = n->as_int();
  if (cfg.steps_per_print <= 0) {
    throw ConfigError(ds_file, "steps_per_print", "must be positive, got " + std::to_string(cfg.steps_per_print));
  }
  if (const ConfigNode* n = dr.child("gradient_allreduce_op"); n && !n->is_null() && n->as_string() != "mean") {
    throw n->error("is not supported by memrt with value \"" + n->as_string() +
                   "\": memrt averages gradients across ranks (\"mean\", DeepSpeed's default)");
  }
  if (const ConfigNode* n = dr.child("sequence_parallel_size"); n && !n->is_null()) {
    if (n->as_int() > 1) {
      throw n->error("is not supported by memrt (sequence parallelism): memrt is data parallel; use ZeRO "
                     "(zero_optimization.stage) and activation checkpointing to fit long sequences");
    }
    diag.warnings.push_back(where(*n) + " is accepted but ignored: 1 means no sequence parallelism");
  }

  read_flops_profiler(dr.child("flops_profiler"));
  if (const ConfigNode* n = dr.child("wall_clock_breakdown"); n && !n->is_null()) cfg.wall_clock_breakdown = n->as_bool();

  static const std::vector<std::pair<const char*, const char*>> ignored = {
      {"memory_breakdown", "memrt always writes output_dir/memory_report.json"},
      {"dump_state", "use launcher --print-config"},
      {"tensorboard", "metrics go to output_dir/metrics.jsonl"},
      {"wandb", "metrics go to output_dir/metrics.jsonl"},
      {"csv_monitor", "metrics go to output_dir/metrics.jsonl"},
      {"comet", "metrics go to output_dir/metrics.jsonl"},
      {"monitor_config", "metrics go to output_dir/metrics.jsonl"},
      {"comms_logger", "memrt has no communication logger"},
      {"comms_config", "memrt has no communication logger"},
      {"autotuning", "memrt has no autotuner"},
      {"timers", "memrt has no per-phase timers"},
      {"compile", "memrt runs LibTorch eagerly (no torch.compile)"},
      {"prescale_gradients", "memrt averages after the all-reduce; the result is the same up to rounding"},
      {"gradient_predivide_factor", "memrt averages after the all-reduce; the result is the same up to rounding"},
      {"communication_data_type", "memrt reduces gradients in their own dtype"},
      {"seq_parallel_communication_data_type", "memrt has no sequence parallelism"},
      {"sparse_gradients", "embedding gradients are reduced densely (same values)"},
      {"disable_allgather", "legacy DeepSpeed switch"},
      {"allgather_size", "legacy DeepSpeed switch"},
      {"zero_allow_untested_optimizer", "memrt has no optimizer whitelist"},
      {"zero_force_ds_cpu_optimizer", "memrt's offload always steps with its own CPU optimizer"},
      {"dataloader_drop_last", "memrt's data loader is configured in train.yaml"},
      {"vocabulary_size", "the vocabulary size comes from the model"},
      {"log_level", "memrt logs at one level"},
      {"checkpoint", "memrt's checkpoints are always written atomically and verified on load"},
      {"aio", "NVMe offload is not supported, so asynchronous I/O settings have no use"},
      {"eigenvalue", "memrt computes no Hessian eigenvalues"},
      {"nebula", "no Nebula checkpoint service"},
  };
  for (const auto& [key, why] : ignored) dr.ignore(key, why);

  static const std::vector<std::pair<const char*, const char*>> rejected = {
      {"amp", "apex AMP; use the \"fp16\" or \"bf16\" section"},
      {"tensor_parallel", "tensor parallelism; memrt is data parallel (ZeRO stages 1-3 partition the model state instead)"},
      {"pipeline", "pipeline parallelism; memrt is data parallel (ZeRO-3 partitions the parameters instead)"},
      {"expert_parallel", "mixture-of-experts parallelism; memrt trains dense GPT-2/Llama models"},
      {"compression_training", "compression training; 4-bit weights come from train.yaml load_in_4bit, 8-bit optimizer states from optim: adamw_8bit"},
      {"weight_quantization", "weight quantization; 4-bit weights come from train.yaml load_in_4bit"},
      {"sparse_attention", "sparse attention; memrt's models use dense causal attention"},
  };
  for (const auto& [key, instead] : rejected) dr.reject(key, instead);
  reject_if_enabled(dr, diag, "quantize_training", "MoQ quantize-aware training; 4-bit weights come from train.yaml load_in_4bit");
  reject_if_enabled(dr, diag, "curriculum_learning", "curriculum learning; memrt reads train_file in seeded random order");
  reject_if_enabled(dr, diag, "data_efficiency", "data efficiency (curriculum / random-LTD); memrt reads train_file in seeded random order");
  reject_if_enabled(dr, diag, "progressive_layer_drop", "progressive layer drop; every layer runs every step");
  reject_if_enabled(dr, diag, "elasticity", "elastic batch sizes; set the batch triple explicitly");
  reject_if_enabled(dr, diag, "hybrid_engine", "the RLHF hybrid engine; memrt trains causal language models");
  reject_if_enabled(dr, diag, "torch_autocast", "torch autocast; use the \"bf16\" or \"fp16\" section");

  // Comment keys ("_comment", "comment") carry no setting.
  for (const auto& m : ds.members()) {
    if (!m.first.empty() && (m.first[0] == '_' || lower(m.first) == "comment")) dr.ignore(m.first, "a comment");
  }
  dr.finish();
}

// A numeric ds value that "auto" and train.yaml may decide: auto -> the yaml value or the Hugging
// Face default; a number -> must agree with an explicit yaml value; absent -> the yaml value if
// explicit (memrt's rule: never silently prefer a DeepSpeed default over what the user wrote),
// else DeepSpeed's default.
double Loader::resolve_value(ConfigReader& r, const char* key, const char* yaml_key, double hf_default,
                             double ds_default, bool resolve_absent_from_yaml) {
  const ConfigNode* n = r.child(key);
  const ConfigNode* yn = yaml_key ? yv(yaml_key) : nullptr;
  if (!n || n->is_null()) return yn && resolve_absent_from_yaml ? yn->as_double() : ds_default;
  if (n->is_auto()) return yn ? yn->as_double() : hf_default;
  const double v = n->as_double();
  if (yn && !same_number(v, yn->as_double())) contradiction(*n, num_text(v), *yn, num_text(yn->as_double()), kSetAuto);
  return v;
}

void Loader::resolve_batch(const ConfigNode* tbs, const ConfigNode* mbs, const ConfigNode* gas) {
  const ConfigNode* y_mbs = yv("per_device_train_batch_size");
  const ConfigNode* y_gas = yv("gradient_accumulation_steps");
  const int n = src.world_size;
  std::optional<int64_t> t, m, g;
  std::vector<std::string> origin;  // where each value came from, for the error message
  const auto present = [](const ConfigNode* x) { return x && !x->is_null(); };

  // Micro batch and accumulation first: "auto" train_batch_size is computed from them.
  const auto one = [&](const ConfigNode* ds_node, const ConfigNode* y_node, int64_t hf_default,
                       const char* ds_key, std::optional<int64_t>& out) {
    if (present(ds_node) && !ds_node->is_auto()) {
      out = ds_node->as_int();
      if (y_node && y_node->as_int() != *out) {
        throw ConfigError(ds_node->file(), ds_node->path(),
                          "is " + std::to_string(*out) + " but " + where(*y_node) + " is " +
                              std::to_string(y_node->as_int()) + ": " + kSetAuto);
      }
      origin.push_back(std::string(ds_key) + " = " + std::to_string(*out) + " from " + where(*ds_node));
    } else if (y_node) {
      out = y_node->as_int();
      origin.push_back(std::string(ds_key) + " = " + std::to_string(*out) + " from " + where(*y_node));
    } else if (present(ds_node)) {  // "auto" with nothing in train.yaml: Hugging Face's default
      out = hf_default;
      origin.push_back(std::string(ds_key) + " = " + std::to_string(*out) + " (\"auto\" in " + ds_file +
                       ", Hugging Face's default)");
    }
  };
  one(mbs, y_mbs, 8, "train_micro_batch_size_per_gpu", m);
  one(gas, y_gas, 1, "gradient_accumulation_steps", g);
  if (present(tbs)) {
    if (tbs->is_auto()) {
      t = m.value_or(8) * g.value_or(1) * n;
      if (!m) m = 8;
      if (!g) g = 1;
      origin.push_back("train_batch_size = " + std::to_string(*t) + " (\"auto\": micro batch * accumulation * N)");
    } else {
      t = tbs->as_int();
      origin.push_back("train_batch_size = " + std::to_string(*t) + " from " + where(*tbs));
    }
  }
  if (!t && !m) {  // neither file gives a batch size: Hugging Face's per_device_train_batch_size
    m = 8;
    diag.warnings.push_back(yaml_file + ": no batch size in either file: per_device_train_batch_size = 8 "
                            "(Hugging Face's default); set it in train.yaml");
  }
  BatchTriple b;
  const std::string err = derive_batch_triple(t, m, g, n, b);
  if (!err.empty()) {
    std::string from;
    for (const auto& o : origin) from += (from.empty() ? "" : "; ") + o;
    const std::string files = ds_file.empty() ? yaml_file : ds_file + " and " + yaml_file;
    throw ConfigError(ds_file.empty() ? yaml_file : ds_file, "train_batch_size",
                      "inconsistent batch sizes in " + files + " with N = " + std::to_string(n) +
                          " data-parallel ranks: " + err + (from.empty() ? "" : " [" + from + "]") +
                          ". Fix: give train_micro_batch_size_per_gpu and gradient_accumulation_steps "
                          "and leave train_batch_size out (or \"auto\"), so it follows N");
  }
  cfg.train_batch_size = b.train_batch_size;
  cfg.micro_batch_size = b.micro_batch_size;
  cfg.grad_accum_steps = b.grad_accum_steps;

  // Training length and the other train.yaml scalars.
  if (const ConfigNode* x = yv("max_steps")) cfg.max_steps = x->as_int();
  if (cfg.max_steps == 0 || cfg.max_steps < -1) {
    throw yv("max_steps")->error("must be positive, or -1 to train num_train_epochs epochs, got " +
                                 std::to_string(cfg.max_steps));
  }
  cfg.num_train_epochs = ynum("num_train_epochs", 3.0);  // Hugging Face's default
  if (cfg.num_train_epochs <= 0) throw yv("num_train_epochs")->error("must be positive");
  resolve_saving();
  if (const ConfigNode* x = yv("save_total_limit"); x && !x->is_null()) {
    cfg.save_total_limit = x->as_int();
    if (cfg.save_total_limit < 0) throw x->error("must be >= 0 (0 or null: keep every checkpoint)");
  }
  if (const ConfigNode* x = yv("output_dir")) cfg.output_dir = x->as_string();
  if (const ConfigNode* x = yv("seed")) {
    const int64_t s = x->as_int();
    if (s < 0) throw x->error("must be >= 0");
    cfg.seed = static_cast<uint64_t>(s);
  }
  if (const ConfigNode* x = yv("chunked_cross_entropy")) cfg.chunked_cross_entropy = x->as_bool();
  if (const ConfigNode* x = yv("memory_budget"); x && !x->is_null()) {
    const std::optional<int64_t> bytes = x->is_string() ? parse_size(x->as_string()) : parse_size(x->to_json(0));
    if (!bytes) throw x->error("is " + x->to_json(0) + ": write a size in bytes or with a unit, e.g. 6GiB, 6.5GB, 512MiB");
    cfg.memory_budget = *bytes;
  }
  if (const ConfigNode* x = yv("no_preflight")) cfg.preflight = !x->as_bool();
  if (const ConfigNode* x = yv("resume_from_checkpoint")) {
    if (!(x->is_bool() && !x->as_bool())) {
      throw x->error("is not supported in train.yaml: resume with `launcher ... --resume` (newest "
                     "checkpoint in output_dir) or `--resume=TAG`");
    }
  }
  if (const ConfigNode* x = yv("stage")) {  // LLaMA-Factory's: pt on text, sft on its datasets
    const std::string stage = x->as_string();
    const bool records = yv("dataset") || yv("datasets");
    if (stage == "pt" && yv("dataset"))
      throw x->error("is \"pt\", and LLaMA-Factory's pretraining on dataset: is not built: use stage: sft, or put the "
                     "text in train_file");
    if (stage == "sft" && !records)
      throw x->error("is \"sft\", supervised fine-tuning on a dataset: (dataset_info.json's), which this config does "
                     "not set; set dataset, or stage: pt to train on train_file's text");
    if (stage != "pt" && stage != "sft")
      throw x->error("is \"" + stage + "\", which memrt does not support: memrt trains causal language modelling, "
                     "on text (stage: pt) or on a dataset's responses (stage: sft)");
  }
  if (const ConfigNode* x = yv("gptq_model_v1")) {
    if (x->as_bool()) throw x->error("is not supported: GPTQ models cannot be loaded; use load_in_4bit");
  }
}

// ---- optimizer --------------------------------------------------------------------------------

// "adamw" (decoupled decay), "adam" (L2 decay), "sgd", or "adamw_lowbit" (bitsandbytes' or torchao's low-bit AdamW: the quant plugin).
std::string optim_family(const ConfigNode& optim, ConfigDiagnostics& diag) {
  const std::string o = lower(optim.as_string());
  if (o == "adamw_torch" || o == "adamw_torch_fused" || o == "adamw_hf" || o == "adamw" ||
      o == "adamw_apex_fused" || o == "adamw_torch_xla" || o == "adamw_torch_npu_fused") {
    return "adamw";
  }
  if (o == "paged_adamw_32bit" || o == "paged_adamw") {
    diag.warnings.push_back(where(optim) + " is \"" + o + "\": trained as plain AdamW (paging is a CUDA "
                            "memory feature; optimizer offload is zero_optimization.offload_optimizer)");
    return "adamw";
  }
  if (o == "adam") return "adam";
  if (o == "sgd") return "sgd";
  if (o == "adamw_8bit" || o == "adamw_bnb_8bit" || o == "paged_adamw_8bit" || o == "adamw_torch_8bit" ||
      o == "adamw_torch_4bit")
    return "adamw_lowbit";
  throw optim.error("is \"" + optim.as_string() + "\", which memrt does not support; supported: adamw_torch, "
                    "adamw_torch_fused, adamw_hf, paged_adamw_32bit (all AdamW), adam, sgd, the 8-bit "
                    "adamw_8bit, adamw_bnb_8bit, paged_adamw_8bit (bitsandbytes) and adamw_torch_8bit, "
                    "adamw_torch_4bit (torchao)");
}

void Loader::resolve_optimizer(const ConfigNode* opt) {
  OptimizerConfig& o = cfg.optimizer;
  const ConfigNode* y_optim = yv("optim");
  const std::string y_family = y_optim ? optim_family(*y_optim, diag) : "adamw";
  if (y_family == "adamw_lowbit") {
    ConfigNode options = ConfigNode::object(yaml_file, "");
    options.set("optim", *y_optim);
    add_plugin("quant", "optim", {yaml_file + ": " + y_optim->path()}, options);
  }

  o.from_ds_config = opt && !opt->is_null();
  if (!o.from_ds_config) {  // Hugging Face builds the optimizer from train.yaml
    o.type = y_family == "sgd" ? "SGD" : y_family == "adam" ? "Adam" : "AdamW";
    o.adam_w_mode = y_family != "adam";
    o.lr = ynum("learning_rate", 5e-5);
    o.beta1 = ynum("adam_beta1", 0.9);
    o.beta2 = ynum("adam_beta2", 0.999);
    o.eps = ynum("adam_epsilon", 1e-8);
    o.weight_decay = ynum("weight_decay", 0.0);
  } else {
    ConfigDiagnostics& d = diag;
    ConfigReader r(*opt, d);
    const ConfigNode* type_node = r.child("type");
    if (!type_node) throw ConfigError(opt->file(), join_key_path(opt->path(), "type"), "is required: \"AdamW\", \"Adam\" or \"SGD\"");
    const std::string t = lower(type_node->as_string());
    static const std::set<std::string> deepspeed_only = {"lamb", "onebitadam", "zerooneadam", "onebitlamb",
                                                         "adagrad", "lion", "muon", "muadam", "muadamw", "musgd"};
    if (deepspeed_only.count(t)) {
      throw type_node->error("is \"" + type_node->as_string() + "\", which memrt does not support; supported: "
                             "\"Adam\", \"AdamW\", \"SGD\" (and low-bit AdamW with train.yaml optim: adamw_8bit, adamw_torch_4bit, ...)");
    }
    if (t != "adam" && t != "adamw" && t != "sgd") {
      throw type_node->error("is \"" + type_node->as_string() + "\", an unknown optimizer; supported: \"Adam\", "
                             "\"AdamW\", \"SGD\" (case-insensitive, as in DeepSpeed)");
    }
    o.type = t == "adam" ? "Adam" : t == "adamw" ? "AdamW" : "SGD";
    r.ignore("legacy_fusion", "memrt has one fused path");
    static const ConfigNode kAbsent;
    const ConfigNode* params = r.child("params");
    ConfigReader p(params ? *params : kAbsent, d);
    o.lr = resolve_value(p, "lr", "learning_rate", ynum("learning_rate", 5e-5), 1e-3);
    o.weight_decay = resolve_value(p, "weight_decay", "weight_decay", 0.0, 0.0);
    if (o.type == "SGD") {
      o.momentum = p.get<double>("momentum", 0.0);
      o.dampening = p.get<double>("dampening", 0.0);
      o.nesterov = p.get<bool>("nesterov", false);
      p.reject_if_true("maximize", "memrt minimises the loss");
    } else {
      o.eps = resolve_value(p, "eps", "adam_epsilon", 1e-8, 1e-8);
      const ConfigNode* betas = p.child("betas");
      const ConfigNode* yb1 = yv("adam_beta1");
      const ConfigNode* yb2 = yv("adam_beta2");
      if (!betas || betas->is_null() || betas->is_auto()) {
        o.beta1 = yb1 ? yb1->as_double() : 0.9;
        o.beta2 = yb2 ? yb2->as_double() : 0.999;
      } else {
        const auto& b = betas->as_array();
        if (b.size() != 2) throw betas->error("expected two numbers [beta1, beta2], found " + std::to_string(b.size()));
        o.beta1 = b[0].as_double();
        o.beta2 = b[1].as_double();
        if (yb1 && !same_number(o.beta1, yb1->as_double())) contradiction(b[0], num_text(o.beta1), *yb1, num_text(yb1->as_double()), kSetAuto);
        if (yb2 && !same_number(o.beta2, yb2->as_double())) contradiction(b[1], num_text(o.beta2), *yb2, num_text(yb2->as_double()), kSetAuto);
      }
      o.bias_correction = p.get<bool>("bias_correction", true);
      // DeepSpeed: effective AdamW = type AdamW or adam_w_mode (default true).
      o.adam_w_mode = p.get<bool>("adam_w_mode", true) || o.type == "AdamW";
      o.bf16_stochastic_round = p.get<bool>("bf16_stochastic_round", false);  // torchao's name
      if (o.bf16_stochastic_round) stochastic_round_ = params->find("bf16_stochastic_round");
      p.get<bool>("torch_adam", false);               // implementation choice only: same math
      p.get<bool>("fp32_optimizer_states", true);     // memrt's states are fp32 unless 8-bit
      p.reject_if_true("amsgrad", "AMSGrad; use Adam or AdamW");
      p.reject("max_grad_norm", "'max_grad_norm' is not supported as an optimizer parameter, please switch to "
                                "using the deepspeed parameter 'gradient_clipping' (top level of the ds_config)");
    }
    p.finish();
    r.finish();
    if (o.lr <= 0) throw ConfigError(opt->file(), join_key_path(opt->path(), "params.lr"), "must be positive, got " + num_text(o.lr));
    // train.yaml `optim` and the ds_config optimizer must describe the same optimizer; a low-bit
    // AdamW there picks its library's implementation of the ds_config's AdamW (its hyper-parameters).
    if (y_optim) {
      const std::string ds_family = o.type == "SGD" ? "sgd" : o.adam_w_mode ? "adamw" : "adam";
      if (ds_family != (y_family == "adamw_lowbit" ? "adamw" : y_family)) {
        throw ConfigError(type_node->file(), type_node->path(),
                          "is \"" + type_node->as_string() + "\"" +
                              (o.type == "Adam" ? std::string(o.adam_w_mode ? " (decoupled weight decay: adam_w_mode)" : " (adam_w_mode false)") : "") +
                              " but " + where(*y_optim) + " is \"" + y_optim->as_string() +
                              "\": they name different optimizers; remove one (a low-bit AdamW, optim: adamw_8bit, "
                              "adamw_torch_4bit, ..., goes alone or with a ds_config AdamW)");
      }
    }
  }
  if (o.lr <= 0) throw ConfigError(yaml_file, "learning_rate", "must be positive, got " + num_text(o.lr));
  resolve_group_rules();
  if (o.beta1 < 0 || o.beta1 >= 1 || o.beta2 < 0 || o.beta2 >= 1) {
    throw ConfigError(opt ? opt->file() : yaml_file, opt ? "optimizer.params.betas" : "adam_beta1",
                      "betas must be in [0, 1), got [" + num_text(o.beta1) + ", " + num_text(o.beta2) + "]");
  }
}

// axolotl's per-group learning rates: embedding_lr_scale / embedding_lr and lr_groups, applied by
// the host's store plan (store/host_groups.h).
void Loader::resolve_group_rules() {
  GroupRules& g = cfg.optimizer.groups;
  g.file = yaml_file;
  auto positive = [](const ConfigNode& n) {
    const double v = n.as_double();
    if (!(v > 0)) throw n.error("must be a positive number, got " + num_text(v));
    return v;
  };
  if (const ConfigNode* n = yv("embedding_lr_scale")) g.embedding_lr_scale = positive(*n);
  if (const ConfigNode* n = yv("embedding_lr")) g.embedding_lr = positive(*n);
  if (g.embedding_lr_scale > 0 && g.embedding_lr > 0) {
    diag.warnings.push_back(where(*yv("embedding_lr")) + " is ignored: embedding_lr_scale is set, and "
                            "axolotl applies the scale when both are");
  }
  const ConfigNode* groups = yv("lr_groups");
  if (!groups || groups->is_null()) return;
  if (!groups->is_array()) throw groups->error("must be a list of {name, modules, lr}");
  static const std::set<std::string> reserved = {"decay", "no_decay", "embeddings"};
  for (const ConfigNode& item : groups->as_array()) {
    ConfigReader r(item, diag);
    LrGroup group;
    group.name = r.required<std::string>("name");
    const ConfigNode* modules = r.child("modules");
    const ConfigNode* lr = r.child("lr");
    r.finish();  // an unknown key first: a misspelt "modules" is named as such
    if (!modules) throw item.error("has no \"modules\": the list of name parts whose parameters join the group");
    group.modules = modules->as_names();
    if (group.modules.empty()) throw modules->error("is empty: name at least one module");
    if (!lr) throw item.error("has no \"lr\": the group's learning rate");
    group.lr = positive(*lr);
    if (group.name.empty() || reserved.count(group.name) ||
        std::any_of(g.lr_groups.begin(), g.lr_groups.end(), [&](const LrGroup& x) { return x.name == group.name; }))
      throw item.error("has name \"" + group.name + "\": each lr_group needs a name of its own, other than "
                       "decay, no_decay and embeddings (the store's groups)");
    g.lr_groups.push_back(std::move(group));
  }
}

// ---- scheduler --------------------------------------------------------------------------------

void Loader::resolve_scheduler(const ConfigNode* sch) {
  SchedulerConfig& s = cfg.scheduler;
  const ConfigNode* y_type = yv("lr_scheduler_type");
  const ConfigNode* y_warm = yv("warmup_steps");
  const ConfigNode* y_ratio = yv("warmup_ratio");
  if (y_ratio && (y_ratio->as_double() < 0 || y_ratio->as_double() > 1)) {
    throw y_ratio->error("must be in [0, 1], got " + num_text(y_ratio->as_double()));
  }
  if (y_warm && y_warm->as_int() < 0) throw y_warm->error("must be >= 0");
  // Hugging Face's warmup: warmup_steps if > 0, else ceil(warmup_ratio * total steps).
  s.warmup_ratio = y_ratio ? y_ratio->as_double() : 0.0;
  int64_t hf_warmup = 0;
  if (y_warm && y_warm->as_int() > 0) {
    hf_warmup = y_warm->as_int();
    s.warmup_ratio = 0;
    if (y_ratio && y_ratio->as_double() > 0) {
      diag.warnings.push_back(where(*y_ratio) + " is ignored: warmup_steps is set and takes precedence (as in Hugging Face)");
    }
  } else if (s.warmup_ratio > 0) {
    hf_warmup = cfg.max_steps > 0 ? static_cast<int64_t>(std::ceil(s.warmup_ratio * static_cast<double>(cfg.max_steps))) : -1;
  }
  const int64_t hf_total = cfg.max_steps;  // -1: the engine fills it from the epochs
  const double lr = cfg.optimizer.lr;

  if (!sch || sch->is_null()) {
    const std::string t = y_type ? y_type->as_string() : "linear";  // Hugging Face's default
    static const std::set<std::string> supported = {"linear", "cosine", "constant", "constant_with_warmup"};
    if (!supported.count(t)) {
      throw y_type->error("is \"" + t + "\", which memrt does not support; supported: linear (the default), "
                          "cosine, constant, constant_with_warmup; or a ds_config scheduler WarmupLR, "
                          "WarmupDecayLR, WarmupCosineLR");
    }
    s.type = t;
    s.warmup_min_lr = 0;
    s.warmup_max_lr = lr;
    s.warmup_num_steps = t == "constant" ? 0 : hf_warmup;
    s.warmup_type = "linear";
    s.total_num_steps = hf_total;
    return;
  }

  ConfigReader r(*sch, diag);
  const ConfigNode* type_node = r.child("type");
  if (!type_node) {
    throw ConfigError(sch->file(), join_key_path(sch->path(), "type"),
                      "is required: \"WarmupLR\", \"WarmupDecayLR\" or \"WarmupCosineLR\"");
  }
  const std::string t = type_node->as_string();
  if (t == "OneCycle" || t == "LRRangeTest") {
    throw type_node->error("is \"" + t + "\", which memrt does not support; supported: \"WarmupLR\", "
                           "\"WarmupDecayLR\", \"WarmupCosineLR\"");
  }
  if (t != "WarmupLR" && t != "WarmupDecayLR" && t != "WarmupCosineLR") {
    const std::string near = nearest_key(t, {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR"});
    throw type_node->error("is \"" + t + "\", an unknown scheduler" +
                           (near.empty() ? std::string() : "; did you mean \"" + near + "\"?") +
                           " Supported: \"WarmupLR\", \"WarmupDecayLR\", \"WarmupCosineLR\"");
  }
  s.type = t;
  if (y_type) {  // both files name a scheduler: they must be the same shape
    static const std::map<std::string, std::set<std::string>> compatible = {
        {"WarmupLR", {"constant", "constant_with_warmup"}},
        {"WarmupDecayLR", {"linear"}},
        {"WarmupCosineLR", {"cosine"}}};
    if (!compatible.at(t).count(y_type->as_string())) {
      throw ConfigError(type_node->file(), type_node->path(),
                        "is \"" + t + "\" but " + where(*y_type) + " is \"" + y_type->as_string() +
                            "\": they name different schedules; remove one");
    }
  }
  static const ConfigNode kAbsent;
  const ConfigNode* params = r.child("params");
  ConfigReader p(params ? *params : kAbsent, diag);
  // warmup_num_steps (DeepSpeed default 1000; "auto" -> train.yaml warmup).
  {
    const ConfigNode* n = p.child("warmup_num_steps");
    if (!n || n->is_null()) {
      s.warmup_num_steps = y_warm || y_ratio ? hf_warmup : 1000;
    } else if (n->is_auto()) {
      s.warmup_num_steps = hf_warmup;
    } else {
      s.warmup_num_steps = n->as_int();
      if (s.warmup_num_steps < 0) throw n->error("must be >= 0");
      if (y_warm && y_warm->as_int() > 0 && y_warm->as_int() != s.warmup_num_steps) {
        contradiction(*n, std::to_string(s.warmup_num_steps), *y_warm, std::to_string(y_warm->as_int()), kSetAuto);
      }
      s.warmup_ratio = 0;
    }
  }
  if (t == "WarmupLR" || t == "WarmupDecayLR") {
    s.warmup_min_lr = resolve_value(p, "warmup_min_lr", nullptr, 0.0, 0.0);
    // WarmupLR: null -> the optimizer's lr (DeepSpeed v0.17.2+); WarmupDecayLR: 0.001.
    const ConfigNode* n = p.child("warmup_max_lr");
    const ConfigNode* y_lr = yv("learning_rate");
    if (!n || n->is_null()) {
      s.warmup_max_lr = t == "WarmupLR" || y_lr ? lr : 0.001;
    } else if (n->is_auto()) {
      s.warmup_max_lr = lr;
    } else {
      s.warmup_max_lr = n->as_double();
      if (y_lr && !same_number(s.warmup_max_lr, y_lr->as_double())) {
        contradiction(*n, num_text(s.warmup_max_lr), *y_lr, num_text(y_lr->as_double()), kSetAuto);
      }
    }
  } else {
    s.warmup_min_ratio = p.get<double>("warmup_min_ratio", 0.0);
    s.cos_min_ratio = p.get<double>("cos_min_ratio", 1e-4);
    s.warmup_min_lr = 0;
    s.warmup_max_lr = lr;
  }
  if (t == "WarmupDecayLR" || t == "WarmupCosineLR") {
    const ConfigNode* n = p.child("total_num_steps");
    const ConfigNode* y_max = yv("max_steps");
    if (!n || n->is_null()) {
      if (!y_max) {
        throw ConfigError(sch->file(), join_key_path(sch->path(), "params.total_num_steps"),
                          "is required by " + t + ": give a number, or \"auto\" (train.yaml max_steps, or the "
                          "steps of num_train_epochs)");
      }
      s.total_num_steps = hf_total;
    } else if (n->is_auto()) {
      s.total_num_steps = hf_total;
    } else {
      s.total_num_steps = n->as_int();
      if (s.total_num_steps <= 0) throw n->error("must be positive");
      if (y_max && cfg.max_steps > 0 && cfg.max_steps != s.total_num_steps) {
        contradiction(*n, std::to_string(s.total_num_steps), *y_max, std::to_string(cfg.max_steps), kSetAuto);
      }
    }
    if (s.total_num_steps > 0 && s.warmup_num_steps > s.total_num_steps) {
      diag.warnings.push_back(where(*sch) + ": total_num_steps " + std::to_string(s.total_num_steps) +
                              " is less than warmup_num_steps " + std::to_string(s.warmup_num_steps) +
                              " (DeepSpeed warns the same)");
    }
  }
  if (const ConfigNode* n = p.child("warmup_type"); n && !n->is_null()) {
    s.warmup_type = n->as_string();
    if (s.warmup_type != "log" && s.warmup_type != "linear") {
      throw n->error("is \"" + s.warmup_type + "\"; expected \"log\" (DeepSpeed's default) or \"linear\"");
    }
  }
  if (const ConfigNode* n = p.child("last_batch_iteration"); n && !n->is_null() && n->as_int() != -1) {
    throw n->error("must be -1 (memrt restores the schedule position from its checkpoints; resume with --resume)");
  }
  p.finish();
  r.finish();
}

// ---- plugin sections ----------------------------------------------------------------------------

void Loader::add_plugin(const std::string& name, std::string first_key, std::vector<std::string> keys,
                        ConfigNode options) {
  for (auto& p : cfg.plugins) {
    if (p.name == name) {  // a second owner of the same built-in plugin: merge
      for (const auto& m : options.members()) p.options.set(m.first, m.second);
      p.config_keys.insert(p.config_keys.end(), keys.begin(), keys.end());
      return;
    }
  }
  PluginSpec spec;
  spec.name = name;
  spec.config_key = std::move(first_key);
  spec.config_keys = std::move(keys);
  spec.options = std::move(options);
  cfg.plugins.push_back(std::move(spec));
}

void Loader::resolve_precision(const ConfigNode* fp16, const ConfigNode* bf16, const ConfigNode* dtypes) {
  ConfigNode options = ConfigNode::object(ds_file, "");
  std::vector<std::string> keys;
  // enabled: "auto" -> train.yaml fp16 / bf16; a value must agree with an explicit train.yaml one.
  const auto section = [&](const ConfigNode* sec, const char* name, const char* yaml_key, bool is_fp16) -> bool {
    const ConfigNode* y_flag = yv(yaml_key);
    if (y_flag && y_flag->is_auto()) {  // axolotl's `bf16: auto`: bf16 where the GPU supports it
      diag.warnings.push_back(where(*y_flag) + " is \"auto\": resolved to false (memrt decides at config time, "
                              "before any device is known); write true to train in " + yaml_key);
      y_flag = nullptr;
    }
    const bool y_value = y_flag ? y_flag->as_bool() : false;
    if (!sec || sec->is_null()) {
      if (y_value) {
        ConfigNode s = ConfigNode::object(y_flag->file(), name);
        s.set("enabled", ConfigNode::boolean(true, y_flag->file(), y_flag->path()));
        options.set(name, s);
        keys.push_back(y_flag->file() + ": " + y_flag->path());
      }
      return y_value;
    }
    ConfigReader r(*sec, diag);
    ConfigNode out = ConfigNode::object(sec->file(), sec->path());
    bool enabled = false;
    const ConfigNode* en = r.child("enabled");
    if (en && en->is_auto()) {
      enabled = y_value;
    } else if (en && !en->is_null()) {
      enabled = en->as_bool();
      if (y_flag && y_flag->as_bool() != enabled) {
        contradiction(*en, enabled ? "true" : "false", *y_flag, y_value ? "true" : "false", kSetAuto);
      }
    }
    out.set("enabled", ConfigNode::boolean(enabled, en ? en->file() : sec->file(), join_key_path(sec->path(), "enabled")));
    if (is_fp16) {
      pass(r, out, "loss_scale", Ty::Num);
      pass(r, out, "initial_scale_power", Ty::Int);
      pass(r, out, "loss_scale_window", Ty::Int);
      pass(r, out, "hysteresis", Ty::Int);
      pass(r, out, "consecutive_hysteresis", Ty::Bool);
      pass(r, out, "min_loss_scale", Ty::Num);
      r.ignore("auto_cast", "memrt's model inputs are token ids; the precision plugin casts the model itself");
      r.reject_if_true("fp16_master_weights_and_grads", "memrt keeps fp32 master weights; to save memory use ZeRO or 8-bit optimizer states");
    } else {
      pass(r, out, "check_grad_overflow", Ty::Bool);
      r.ignore("immediate_grad_update", "memrt accumulates gradients in the precision plugin's own way");
      pass(r, out, "bf16_master_weights_and_grads", Ty::Bool);
      pass(r, out, "bf16_optimizer_states", Ty::Bool);
    }
    r.finish();
    options.set(name, out);
    keys.push_back(ds_file + ": " + sec->path());
    return enabled;
  };
  const bool fp16_on = section(fp16, "fp16", "fp16", true);
  const bool bf16_on = section(bf16, "bf16", "bf16", false);
  if (stochastic_round_) {
    const ConfigNode* in_place = bf16_on && bf16 && bf16->is_object() ? bf16->find("bf16_master_weights_and_grads") : nullptr;
    if (!in_place || !in_place->is_bool() || !in_place->as_bool())
      throw ConfigError(stochastic_round_->file(), stochastic_round_->path(),
                        "rounds bf16 weights that the step updates without fp32 masters; set \"bf16\": "
                        "{\"enabled\": true, \"bf16_master_weights_and_grads\": true}, or remove it");
  }
  if (fp16_on && bf16_on) {
    // Name both sides, wherever each was switched on.
    const auto side = [&](const ConfigNode* sec, const char* yaml_key) -> const ConfigNode* {
      const ConfigNode* en = sec && sec->is_object() ? sec->find("enabled") : nullptr;
      if (en && en->is_bool()) return en;
      return yv(yaml_key);
    };
    const ConfigNode* a = side(fp16, "fp16");
    const ConfigNode* b = side(bf16, "bf16");
    const std::string b_text = b ? where(*b) : std::string("bf16");
    if (!a) throw ConfigError(ds_file, "fp16.enabled", "and " + b_text + " are both on: bfloat16 and fp16 modes cannot be simultaneously enabled; choose one");
    throw ConfigError(a->file(), a->path(),
                      "enables fp16 and " + b_text + " enables bf16: bfloat16 and fp16 modes cannot be "
                      "simultaneously enabled; choose one");
  }
  cfg.compute_dtype = fp16_on ? "fp16" : bf16_on ? "bf16" : "fp32";
  if (const ConfigNode* td = yv("torch_dtype")) {
    const std::string v = td->as_string();
    const std::string want = v == "bfloat16" ? "bf16" : v == "float16" ? "fp16" : v == "float32" ? "fp32" : v;
    if (v != "auto" && want != cfg.compute_dtype) {
      if (want != "bf16" && want != "fp16" && want != "fp32") {
        throw td->error("is \"" + v + "\"; expected \"auto\", \"float32\", \"bfloat16\" or \"float16\"");
      }
      throw td->error("is \"" + v + "\" but the run trains in " + cfg.compute_dtype +
                      " (set by bf16/fp16 in train.yaml or the ds_config): make them agree, e.g. bf16: true with "
                      "torch_dtype: bfloat16");
    }
  }
  if (dtypes && !dtypes->is_null()) {
    ConfigReader r(*dtypes, diag);
    ConfigNode out = ConfigNode::object(dtypes->file(), dtypes->path());
    for (const char* key : {"grad_accum_dtype", "param_dtype"}) {
      if (const ConfigNode* n = pass(r, out, key, Ty::Str)) {
        if (n->as_string() != "fp32" && n->as_string() != "fp16" && n->as_string() != "bf16") {
          throw n->error("is \"" + n->as_string() + "\"; expected \"fp32\", \"fp16\" or \"bf16\"");
        }
      }
    }
    if (const ConfigNode* n = out.find("param_dtype"); n && n->as_string() != cfg.compute_dtype) {
      throw n->error("is \"" + n->as_string() + "\" but fp16/bf16 say the run trains in " + cfg.compute_dtype +
                     ": they must agree (DeepSpeed asserts the same)");
    }
    r.ignore("buffer_dtype", "buffers keep the dtype the precision plugin gives them");
    r.finish();
    options.set("data_types", out);
    keys.push_back(ds_file + ": " + dtypes->path());
  }
  if (!options.members().empty()) add_plugin("precision", keys.front(), keys, options);
}

int64_t Loader::model_width() const { return cfg.model.shape.d_model; }

// zero_optimization belongs to plugins/zero, which reads and checks its keys (configure). Here:
// the legacy boolean form, the stage (RunInfo::zero_stage, which the precision plugin reads too)
// and the "auto" bucket sizes, which come from the model's width in train.yaml.
void Loader::resolve_zero(const ConfigNode* zero) {
  if (!zero || zero->is_null()) return;
  ConfigNode out = ConfigNode::object(zero->file(), zero->path());
  if (zero->is_bool()) {  // legacy: true -> stage 1, false -> stage 0
    out.set("stage", ConfigNode::number(zero->as_bool() ? 1 : 0, zero->file(), join_key_path(zero->path(), "stage")));
    diag.warnings.push_back(where(*zero) + " is a boolean (deprecated DeepSpeed form): read as {\"stage\": " +
                            std::string(zero->as_bool() ? "1" : "0") + "}; write a section with \"stage\" instead");
  } else {
    check_type(*zero, Ty::Obj);
    out = *zero;
  }
  if (const ConfigNode* stage = out.find("stage"); stage && !stage->is_null()) {
    cfg.zero_stage = static_cast<int>(stage->as_int());
  }
  // "auto" -> from the model width h, as Hugging Face fills them: h*h, 0.9*h*h, 10*h.
  const double h = static_cast<double>(model_width());
  for (const auto& [key, value] : {std::pair{"reduce_bucket_size", h * h},
                                   {"stage3_prefetch_bucket_size", 0.9 * h * h},
                                   {"prefetch_bucket_size", 0.9 * h * h},
                                   {"stage3_param_persistence_threshold", 10 * h},
                                   {"param_persistence_threshold", 10 * h}}) {
    if (const ConfigNode* n = out.find(key); n && n->is_auto()) {
      out.set(key, ConfigNode::number(std::floor(value), n->file(), n->path()));
    }
  }
  // Accelerate fills it from its zero3_save_16bit_model, false unless the user asks. True at stage 3,
  // the host writes the consolidated model into each checkpoint (the plugin checks the key's type).
  for (const char* key : {"stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                          "stage3_gather_fp16_weights_on_model_save"}) {
    const ConfigNode* n = out.find(key);
    if (n && n->is_auto()) {
      diag.warnings.push_back(where(*n) + " is \"auto\": read as false, as Accelerate fills it "
                              "(zero3_save_16bit_model); `launcher export` writes any checkpoint as one "
                              "Hugging Face model");
      out.set(key, ConfigNode::boolean(false, n->file(), n->path()));
    } else if (n && n->is_bool() && n->as_bool() && cfg.zero_stage == 3) {
      cfg.save_consolidated_model = true;
    }
  }
  ConfigNode options = ConfigNode::object(zero->file(), "");
  options.set("zero_optimization", out);
  add_plugin("zero", "zero_optimization", {ds_file + ": zero_optimization"}, options);
}

void Loader::resolve_checkpoint(const ConfigNode* ac) {
  const ConfigNode* y_gc = yv("gradient_checkpointing");
  const ConfigNode* y_kw = yv("gradient_checkpointing_kwargs");
  const bool has_section = ac && !ac->is_null();
  if (!has_section && !(y_gc && y_gc->as_bool()) ) {
    if (y_kw) diag.warnings.push_back(where(*y_kw) + " is accepted but ignored: gradient_checkpointing is off");
    return;
  }
  ConfigNode options = ConfigNode::object(has_section ? ac->file() : yaml_file, "");
  std::vector<std::string> keys;
  if (has_section) {
    ConfigReader r(*ac, diag);
    ConfigNode out = ConfigNode::object(ac->file(), ac->path());
    pass(r, out, "cpu_checkpointing", Ty::Bool);
    pass(r, out, "profile", Ty::Bool);
    pass(r, out, "every_n_blocks", Ty::Int);  // memrt's: which blocks (DeepSpeed has no such key)
    if (const ConfigNode* n = r.child("partition_activations"); n && !n->is_null() && n->as_bool()) {
      diag.warnings.push_back(where(*n) + " is accepted but ignored: it partitions over model-parallel ranks, "
                              "and memrt has none (DeepSpeed saves nothing with pure data parallelism either)");
    }
    r.ignore("contiguous_memory_optimization", "memrt's recompute keeps no contiguous checkpoint buffers");
    r.ignore("number_checkpoints", "memrt's recompute keeps no contiguous checkpoint buffers");
    r.ignore("synchronize_checkpoint_boundary", "a device synchronisation for timing; not needed");
    r.finish();
    options.set("activation_checkpointing", out);
    keys.push_back(ds_file + ": " + ac->path());
  }
  // On when train.yaml says so, or when the section is present and train.yaml does not say no.
  const bool on = y_gc ? y_gc->as_bool() : true;
  options.set("gradient_checkpointing",
              ConfigNode::boolean(on, y_gc ? y_gc->file() : ac->file(), y_gc ? y_gc->path() : ac->path()));
  if (y_gc) keys.push_back(y_gc->file() + ": " + y_gc->path());
  if (y_kw) {
    if (!y_kw->is_object()) throw y_kw->error("expected a map (e.g. use_reentrant: false), found " + y_kw->describe());
    options.set("gradient_checkpointing_kwargs", *y_kw);
    keys.push_back(y_kw->file() + ": " + y_kw->path());
  }
  add_plugin("checkpoint", keys.front(), keys, options);
}

void Loader::resolve_lora_and_quant() {
  // ---- quantized base weights: plugins/quant owns these keys and checks them; the loader routes
  // them there when one asks for a quantized base, and notes whether 4 bits were asked for (QLoRA
  // and freeze tuning depend on it).
  const ConfigNode* q4 = yv("load_in_4bit");
  const ConfigNode* qbit = yv("quantization_bit");
  const ConfigNode* q8 = yv("load_in_8bit");
  // Present and not `false` (a value of the wrong type is routed too: the plugin names it).
  const auto asks = [](const ConfigNode* n) { return n && !n->is_null() && !(n->is_bool() && !n->as_bool()); };
  const char* quant_keys[] = {"load_in_4bit", "load_in_8bit", "quantization_bit", "quantization_method",
                              "quantization_type", "double_quantization", "bnb_4bit_quant_type",
                              "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype", "bnb_4bit_quant_storage"};
  if (hf_quant_) {
    // A checkpoint saved quantized loads quantized whatever train.yaml says, with its own settings
    // (transformers: "the quantization_config from the model will be used").
    const ConfigNode& hq = *hf_quant_;
    const ConfigNode* method = hq.find("quant_method");
    if (!method || !method->is_string() || method->as_string() != "bitsandbytes")
      throw ConfigError(hq.file(), method ? method->path() : hq.path(),
                        std::string("is ") + (method && method->is_string() ? "\"" + method->as_string() + "\""
                                                                            : method ? method->describe() : "absent") +
                            ": memrt loads checkpoints quantized by bitsandbytes in 4 bits (quant_method "
                            "\"bitsandbytes\", load_in_4bit true); use the model's full-precision checkpoint "
                            "(with load_in_4bit: true to quantize it as it loads)");
    ConfigNode qopts = ConfigNode::object(hq.file(), hq.path());
    std::vector<std::string> qkeys;
    for (const char* k : {"load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant",
                          "bnb_4bit_compute_dtype", "bnb_4bit_quant_storage"}) {
      if (const ConfigNode* n = hq.find(k)) {
        qopts.set(k, *n);
        qkeys.push_back(n->file() + ": " + n->path());
      }
    }
    if (!asks(hq.find("load_in_4bit")) && !asks(hq.find("load_in_8bit")))
      throw ConfigError(hq.file(), hq.path(), "quantizes neither in 4 nor in 8 bits (load_in_4bit and load_in_8bit "
                                              "are not true): not a bitsandbytes checkpoint memrt can load");
    if (const ConfigNode* skip = hq.find("llm_int8_skip_modules"); skip && !skip->is_null() && !skip->as_names().empty())
      diag.warnings.push_back(where(*skip) + " is not read: memrt quantizes every block projection and no other module; "
                              "a listed projection stored in full precision is quantized as it loads");
    for (const char* k : quant_keys) {
      if (const ConfigNode* n = yv(k))
        diag.warnings.push_back(where(*n) + " is ignored: " + hq.file() + " is already quantized, and its " +
                                "quantization_config decides (as in transformers)");
    }
    add_plugin("quant", qkeys.front(), qkeys, qopts);
    q4 = hq.find("load_in_4bit");
    qbit = q8 = nullptr;
  } else if (asks(q4) || asks(qbit) || asks(q8)) {
    ConfigNode qopts = ConfigNode::object(yaml_file, "");
    std::vector<std::string> qkeys;
    for (const char* k : quant_keys) {
      if (const ConfigNode* n = yv(k)) {
        qopts.set(k, *n);
        qkeys.push_back(n->file() + ": " + n->path());
      }
    }
    add_plugin("quant", qkeys.front(), qkeys, qopts);
  } else {
    for (const char* k : quant_keys) {
      const ConfigNode* n = yv(k);
      if (n && n != q4 && n != q8) diag.warnings.push_back(where(*n) + " is accepted but ignored: load_in_4bit is not true");
    }
  }
  const bool load4 = asks(q4) || asks(qbit);

  // ---- LoRA: on when use_peft / adapter / finetuning_type say so, or when LoRA keys are given
  // without any switch.
  std::optional<bool> lora_switch;
  const ConfigNode* switch_node = nullptr;
  if (const ConfigNode* n = yv("use_peft")) {
    lora_switch = n->as_bool();
    switch_node = n;
  }
  if (const ConfigNode* n = yv("adapter")) {
    const std::string a = n->as_string();
    if (a != "lora" && a != "qlora") throw n->error("is \"" + a + "\"; memrt supports \"lora\" and \"qlora\"");
    if (a == "qlora" && !load4) {
      throw n->error("is \"qlora\" but load_in_4bit is not true: QLoRA trains adapters on 4-bit base weights; set load_in_4bit: true");
    }
    if (lora_switch && !*lora_switch) {
      throw ConfigError(n->file(), n->path(), "is \"" + a + "\" but " + where(*switch_node) + " is false: remove one");
    }
    lora_switch = true;
    switch_node = n;
  }
  // LLaMA-Factory's freeze tuning: plugins/lora owns finetuning_type and the freeze_* keys.
  const char* freeze_keys[] = {"freeze_trainable_layers", "freeze_trainable_modules",
                               "freeze_extra_modules", "use_llama_pro"};
  const ConfigNode* type = yv("finetuning_type");
  if (type && type->as_string() == "freeze") {
    if (lora_switch && *lora_switch) {
      throw ConfigError(type->file(), type->path(), "is \"freeze\" but " + where(*switch_node) +
                                                        " turns LoRA on: remove one");
    }
    if (load4) {
      const ConfigNode* src_node = q4 ? q4 : qbit;
      throw ConfigError(type->file(), type->path(), "is \"freeze\" but " + where(*src_node) +
                                                        " quantizes the base: quantized models train "
                                                        "only LoRA adapters (as in LLaMA-Factory); remove one");
    }
    ConfigNode fopts = ConfigNode::object(yaml_file, "");
    fopts.set("finetuning_type", *type);
    std::vector<std::string> fkeys{type->file() + ": " + type->path()};
    for (const char* k : freeze_keys) {
      if (const ConfigNode* n = yv(k)) {
        fopts.set(k, *n);
        fkeys.push_back(n->file() + ": " + n->path());
      }
    }
    for (const char* k : {"lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target",
                          "lora_target_linear", "lora_model_dir", "use_rslora", "loraplus_lr_ratio",
                          "layers_to_transform", "lora_modules_to_save", "use_dora", "init_lora_weights"}) {
      if (const ConfigNode* n = yv(k))
        diag.warnings.push_back(where(*n) + " is ignored: " + where(*type) + " trains no adapters");
    }
    add_plugin("lora", fkeys.front(), fkeys, fopts);
    return;
  }
  for (const char* k : freeze_keys) {
    if (const ConfigNode* n = yv(k))
      diag.warnings.push_back(where(*n) + " is ignored: it applies only with finetuning_type: freeze");
  }
  if (const ConfigNode* n = type) {
    const std::string f = n->as_string();
    if (f != "lora" && f != "full") {
      throw n->error("is \"" + f + "\"; memrt supports \"full\", \"freeze\" and \"lora\"");
    }
    if (lora_switch && *lora_switch != (f == "lora")) {
      throw ConfigError(n->file(), n->path(), "is \"" + f + "\" but " + where(*switch_node) + " says otherwise: remove one");
    }
    lora_switch = f == "lora";
    switch_node = n;
  }
  ConfigNode lopts = ConfigNode::object(yaml_file, "");
  std::vector<std::string> lkeys;
  if (switch_node) lkeys.push_back(switch_node->file() + ": " + switch_node->path());
  const auto take = [&](const char* key, Ty t) {
    if (const ConfigNode* n = yv(key)) {
      check_type(*n, t);
      lopts.set(key, *n);
      lkeys.push_back(n->file() + ": " + n->path());
    }
  };
  take("lora_r", Ty::Int);
  take("lora_alpha", Ty::Num);
  take("lora_dropout", Ty::Num);
  take("lora_model_dir", Ty::Str);
  take("use_rslora", Ty::Bool);
  take("use_dora", Ty::Bool);
  take("init_lora_weights", Ty::Any);  // PEFT's: a boolean or a string
  take("loraplus_lr_ratio", Ty::Num);
  take("layers_to_transform", Ty::Any);  // an index or a list (PEFT's LoraConfig)
  take("lora_modules_to_save", Ty::Any);  // a list, or LLaMA-Factory's comma-separated string
  // Target modules: a list, "all" (LLaMA-Factory) / lora_target_linear: true (axolotl) -> "all-linear"
  // (PEFT's spelling), a comma-separated string of names, or a string with a regular expression's
  // characters (axolotl passes a string to PEFT, which takes it as a full-match regex) kept a string.
  const ConfigNode* tm = yv("lora_target_modules");
  const ConfigNode* tt = yv("lora_target");
  const ConfigNode* tl = yv("lora_target_linear");
  const ConfigNode* given = nullptr;
  for (const ConfigNode* n : {tm, tt, tl}) {
    if (!n || (n == tl && !n->as_bool())) continue;
    if (given) throw ConfigError(n->file(), n->path(), "and " + where(*given) + " both choose the LoRA target modules: keep one");
    given = n;
  }
  if (given) {
    ConfigNode value = *given;
    if (given == tl) {
      value = ConfigNode::string("all-linear", given->file(), given->path());
    } else if (given->is_string()) {
      const std::string s = given->as_string();
      if (s == "all" || s == "all-linear") {
        value = ConfigNode::string("all-linear", given->file(), given->path());
      } else if (s.find_first_of("*+?()[]{}|^$\\") != std::string::npos) {
        value = *given;  // module names never hold these characters
      } else {
        value = ConfigNode::array(given->file(), given->path());
        for (const std::string& name : given->as_names())
          value.push_back(ConfigNode::string(name, given->file(), given->path()));
      }
    } else {
      given->as_names();  // checks every item is a string
    }
    lopts.set("lora_target_modules", value);
    lkeys.push_back(given->file() + ": " + given->path());
  }
  const bool has_lora_keys = !lopts.members().empty();
  const bool lora_on = lora_switch.value_or(has_lora_keys);
  // Each tool's own defaults where its switch says whose file this is (docs/lora.md, "Keys users
  // write"): LLaMA-Factory's lora_target "all" and lora_alpha twice the rank; axolotl has no
  // implicit targets. HF/TRL's (use_peft) are PEFT's, the plugin's own.
  const bool from_adapter_dir = lopts.contains("lora_model_dir");
  if (lora_on && switch_node && type && switch_node == type && !from_adapter_dir) {
    if (!lopts.contains("lora_target_modules"))
      lopts.set("lora_target_modules", ConfigNode::string("all-linear", type->file(), type->path()));
    if (!lopts.contains("lora_alpha")) {
      const int64_t rank = lopts.contains("lora_r") ? lopts.find("lora_r")->as_int() : 8;
      lopts.set("lora_alpha", ConfigNode::number(static_cast<double>(2 * rank), type->file(), type->path()));
    }
  }
  if (lora_on && switch_node && switch_node->path() == "adapter" && !from_adapter_dir && !lopts.contains("lora_target_modules"))
    throw ConfigError(switch_node->file(), "lora_target_modules",
                      "is not set: axolotl's adapter: " + switch_node->as_string() + " needs the modules to adapt; set "
                      "lora_target_modules (e.g. [q_proj, v_proj]) or lora_target_linear: true");
  if (lora_on) {
    add_plugin("lora", lkeys.front(), lkeys, lopts);
  } else if (has_lora_keys) {
    diag.warnings.push_back(where(*switch_node) + " turns LoRA off: the lora_* keys are ignored");
  }
  if (load4 && !lora_on) {
    const ConfigNode* src_node = q4 ? q4 : qbit;
    diag.warnings.push_back(where(*src_node) + " without LoRA: the blocks' projections are frozen in 4 bits and "
                            "only the other parameters (embeddings, norms, biases, lm_head) train, which Hugging "
                            "Face and LLaMA-Factory refuse; QLoRA adds adapters (use_peft: true or adapter: qlora)");
  }
}

void Loader::resolve_plugins(const ConfigNode* plugins) {
  if (!plugins || plugins->is_null()) return;
  const fs::path base = fs::path(ds_file).parent_path();
  std::set<std::string> names;
  size_t i = 0;
  for (const auto& entry : plugins->as_array()) {
    ConfigReader r(entry, diag);
    const std::string name = r.required<std::string>("name");
    const std::string library = r.required<std::string>("library");
    const ConfigNode* options = r.child("options");
    r.finish();
    if (name.empty()) throw ConfigError(entry.file(), join_key_path(entry.path(), "name"), "must not be empty");
    static const std::set<std::string> builtin = {"precision", "zero", "quant", "lora", "checkpoint"};
    if (builtin.count(name)) {
      throw ConfigError(entry.file(), join_key_path(entry.path(), "name"),
                        "is \"" + name + "\", the name of a built-in plugin configured by its own section; choose another name");
    }
    if (!names.insert(name).second) {
      throw ConfigError(entry.file(), join_key_path(entry.path(), "name"), "is \"" + name + "\" a second time: each plugin is listed once");
    }
    if (options && !options->is_null() && !options->is_object()) {
      throw options->error("expected an object of the plugin's own keys, found " + options->describe());
    }
    PluginSpec spec;
    spec.name = name;
    fs::path lib(library);
    spec.library = lib.is_absolute() || library.empty() ? library : (base / lib).lexically_normal().string();
    spec.config_key = "plugins[" + std::to_string(i) + "]";
    spec.config_keys = {ds_file + ": " + entry.path()};
    spec.options = options && !options->is_null() ? *options : ConfigNode::object(entry.file(), join_key_path(entry.path(), "options"));
    cfg.plugins.push_back(std::move(spec));
    ++i;
  }
}

// ---- model and data -----------------------------------------------------------------------------

void Loader::resolve_model_and_data() {
  const ConfigNode* path = yv("model_name_or_path");
  const ConfigNode* block = yv("model");
  const ConfigNode* bs = yv("block_size");
  if (path && block) {
    throw ConfigError(block->file(), block->path(),
                      "and " + where(*path) + " both describe the model: use a model block (random init) or "
                      "model_name_or_path (a local Hugging Face checkpoint directory), not both");
  }
  ModelShape& m = cfg.model.shape;
  if (path) {
    cfg.model.name_or_path = path->as_string();
    std::error_code ec;
    if (!fs::is_directory(cfg.model.name_or_path, ec)) {
      throw path->error("is \"" + cfg.model.name_or_path + "\", which is not a local directory: memrt loads Hugging "
                        "Face checkpoint directories (config.json + safetensors) from disk and does not download; "
                        "download it first (e.g. huggingface-cli download ... --local-dir DIR) and name DIR");
    }
    // The shape comes from config.json (read by the model loader); the width is needed here for
    // ZeRO's "auto" bucket sizes.
    const fs::path cj = fs::path(cfg.model.name_or_path) / "config.json";
    if (fs::exists(cj, ec)) {
      const ConfigNode hf = parse_json_file(cj.string());
      for (const char* k : {"hidden_size", "n_embd", "d_model"}) {
        if (const ConfigNode* n = hf.find(k); n && n->is_number()) {
          m.d_model = n->as_int();
          break;
        }
      }
      if (const ConfigNode* q = hf.find("quantization_config"); q && !q->is_null()) hf_quant_ = *q;
    }
    // The model's own tokenizer tokenizes text data (docs/tokenizers.md): its tokenizer.json, else
    // a sentencepiece tokenizer.model.
    for (const char* name : {"tokenizer.json", "tokenizer.model"}) {
      const fs::path file = fs::path(cfg.model.name_or_path) / name;
      if (fs::is_regular_file(file, ec)) {
        cfg.data.tokenizer = file.string();
        break;
      }
    }
  } else if (block) {
    ConfigReader r(*block, diag);
    m.arch = r.get<std::string>("arch", "gpt2");
    if (m.arch != "gpt2" && m.arch != "llama") {
      throw ConfigError(block->file(), join_key_path(block->path(), "arch"),
                        "is \"" + m.arch + "\"; memrt's built-in architectures are \"gpt2\" and \"llama\"");
    }
    const bool llama = m.arch == "llama";
    m.n_layer = r.get<int64_t>("n_layer", m.n_layer);
    m.n_head = r.get<int64_t>("n_head", m.n_head);
    m.n_kv_head = r.get<int64_t>("n_kv_head", m.n_head);
    m.d_model = r.get<int64_t>("d_model", m.d_model);
    // MLP width: GPT-2 4*C; Llama 8/3*C rounded up to a multiple of 256 (Meta's rule).
    const int64_t ff_default = llama ? ((8 * m.d_model / 3 + 255) / 256) * 256 : 4 * m.d_model;
    m.d_ff = r.get<int64_t>("d_ff", ff_default);
    m.vocab_size = r.get<int64_t>("vocab_size", m.vocab_size);
    const ConfigNode* n_ctx = r.child("n_ctx");
    m.norm_eps = r.get<double>("norm_eps", m.norm_eps);
    m.rope_theta = r.get<double>("rope_theta", m.rope_theta);
    m.tie_embeddings = r.get<bool>("tie_embeddings", !llama);  // GPT-2 ties; Llama does not
    // Dropout under Hugging Face's names: GPT-2 embd_pdrop, attn_pdrop, resid_pdrop; Llama
    // attention_dropout (find_shape_problem refuses GPT-2's embedding/residual dropout on Llama).
    const char* attn_key = llama ? "attention_dropout" : "attn_pdrop";
    const char* other_attn_key = llama ? "attn_pdrop" : "attention_dropout";
    if (const ConfigNode* n = r.child(other_attn_key)) {
      throw n->error(std::string("is ") + (llama ? "GPT-2's" : "Llama's") + " name for attention dropout; arch " +
                     m.arch + " calls it " + attn_key);
    }
    m.embd_pdrop = r.get<double>("embd_pdrop", m.embd_pdrop);
    m.attn_pdrop = r.get<double>(attn_key, m.attn_pdrop);
    m.resid_pdrop = r.get<double>("resid_pdrop", m.resid_pdrop);
    cfg.model.init_std = r.get<double>("init_std", cfg.model.init_std);
    r.finish();
    if (cfg.model.init_std <= 0) throw ConfigError(block->file(), join_key_path(block->path(), "init_std"), "must be positive");
    if (n_ctx && !n_ctx->is_null()) {
      m.n_ctx = n_ctx->as_int();
    } else if (bs) {
      m.n_ctx = bs->as_int();  // the context the data asks for
    }
    if (ShapeProblem p = find_shape_problem(m)) {
      throw ConfigError(block->file(), join_key_path(block->path(), p.field), p.message);
    }
    if (bs && bs->as_int() > m.n_ctx) {
      throw ConfigError(bs->file(), bs->path(), "is " + std::to_string(bs->as_int()) + " but " +
                        where(*n_ctx) + " is " + std::to_string(m.n_ctx) + ": a sample cannot be longer than the model's context");
    }
  }
  cfg.data.block_size = bs ? bs->as_int() : (block ? m.n_ctx : cfg.data.block_size);
  if (cfg.data.block_size <= 0) throw bs->error("must be positive");
  if (const ConfigNode* f = yv("train_file")) {
    cfg.data.train_files = {f->as_string()};
    std::error_code ec;
    if (!fs::exists(f->as_string(), ec)) {
      throw f->error("is \"" + f->as_string() + "\", which does not exist (relative paths are relative to the "
                     "current directory); leave train_file out to use the built-in corpus");
    }
  }
  if (const ConfigNode* name = yv("dataset_name")) {
    for (const char* other : {"train_file", "datasets", "dataset"})
      if (const ConfigNode* o = yv(other)) throw name->error("and " + where(*o) + " both name the training data; keep one");
    read_dataset_name(*name);
  }
  if (const ConfigNode* f = yv("dataset_text_field")) {
    cfg.data.text_field = f->as_string();
    if (cfg.data.text_field.empty()) throw f->error("is empty; name the JSONL field that holds each document's text");
  }
  resolve_records();
  resolve_eval();
}

// One key of an axolotl `type: chat_template` dataset entry, read into `chat` with axolotl's meaning;
// false when `key` is not one of them.
bool read_chat_dataset_key(const std::string& key, const ConfigNode& value, ChatTemplateDataset& chat) {
  auto members = [](const ConfigNode& object, const char* what) {
    if (!object.is_object()) throw object.error(std::string("expected ") + what + ", found " + object.describe());
    return object.members();
  };
  auto eos_mode = [](const ConfigNode& v) -> std::string {
    if (v.is_null() || (v.is_bool() && !v.as_bool())) return "";
    const std::string& mode = v.as_string();
    if (mode != "turn" && mode != "all" && mode != "last")
      throw v.error("is \"" + mode + "\"; expected turn (the EOS/EOT token after each trained turn), all, last or null");
    return mode;
  };
  if (key == "field_messages") {
    chat.field_messages = value.as_string();
  } else if (key == "field_system") {
    chat.field_system = value.as_string();
  } else if (key == "field_tools") {
    chat.field_tools = value.as_string();
  } else if (key == "message_property_mappings") {
    for (const auto& [name, from] : members(value, "{role: FIELD, content: FIELD, ...}"))
      chat.property_mappings.emplace_back(name, from.as_string());
  } else if (key == "message_field_role" || key == "message_field_content") {  // axolotl's older spelling
    chat.property_mappings.emplace_back(key == "message_field_role" ? "role" : "content", value.as_string());
  } else if (key == "roles") {
    for (const auto& [role, sources] : members(value, "{user: [human, user], assistant: [gpt, assistant], ...}"))
      for (const std::string& from : sources.as_names()) chat.roles.emplace_back(from, role);
  } else if (key == "roles_to_train") {
    chat.roles_to_train = value.is_null() ? std::vector<std::string>{} : value.as_names();
  } else if (key == "train_on_eos") {
    chat.train_on_eos = eos_mode(value);
  } else if (key == "train_on_eot") {
    chat.train_on_eot = eos_mode(value);
  } else if (key == "message_field_training") {
    chat.message_field_training = value.as_string();
  } else if (key == "message_field_training_detail") {
    chat.message_field_training_detail = value.as_string();
  } else if (key == "drop_system_message") {
    chat.drop_system_message = value.as_bool();
  } else if (key == "split_thinking") {
    chat.split_thinking = value.as_bool();
  } else if (key == "template_thinking_key") {
    chat.template_thinking_key = value.as_string();
  } else if (key == "field_thinking") {
    chat.field_thinking = value.as_string();
  } else if (key == "chat_template") {
    if (value.as_string() != "tokenizer_default")
      throw value.error("is \"" + value.as_string() + "\"; a dataset renders with the run's chat template "
                        "(tokenizer_default, or train.yaml's chat_template): leave it out");
  } else {
    return false;
  }
  return true;
}

// axolotl's datasets (and test_datasets): a list of {path, type, ...} entries of local files, into `into`.
void read_axolotl_datasets(const ConfigNode& list, std::vector<DatasetSource>& into) {
  if (!list.is_array() || list.as_array().empty())
    throw list.error("expected a list of datasets such as [{path: data.jsonl, type: alpaca}]");
  for (const ConfigNode& item : list.as_array()) {
    if (!item.is_object()) throw item.error("expected {path: FILE, type: alpaca}, found " + item.describe());
    DatasetSource src;
    const ConfigNode* type = item.find("type");
    if (!type) throw item.error("has no type; memrt reads type: alpaca and type: chat_template records (prompt/completion JSONL as train_file)");
    src.type = type->as_string();
    if (src.type == "sharegpt")
      throw type->error("is \"sharegpt\", which axolotl replaced by chat_template: write type: chat_template, "
                        "field_messages: conversations, message_property_mappings: {role: from, content: value}");
    if (src.type != "alpaca" && src.type != "chat_template")
      throw type->error("is \"" + src.type + "\"; memrt reads type: alpaca and type: chat_template here "
                        "(prompt/completion JSONL goes in train_file)");
    const ConfigNode* chat_key = nullptr;  // the first key that only a chat_template dataset takes
    for (const auto& [key, value] : item.members()) {
      if (key == "path") {
        src.path = value.as_string();
      } else if (key == "type") {
      } else if (key == "ds_type" || key == "split") {
        const std::string v = value.as_string();
        if ((key == "ds_type" && v != "json") || (key == "split" && v != "train"))
          throw value.error("is \"" + v + "\"; memrt reads local JSON/JSONL files whole (ds_type: json, split: train)");
      } else if (read_chat_dataset_key(key, value, src.chat)) {
        if (!chat_key) chat_key = &value;
      } else {
        throw value.error("is not supported in a dataset entry; memrt reads {path, type} (ds_type: json and "
                          "split: train allowed), and for type: chat_template axolotl's field_messages, "
                          "message_property_mappings, roles, roles_to_train, train_on_eos, train_on_eot, "
                          "message_field_training, message_field_training_detail, drop_system_message, "
                          "split_thinking, template_thinking_key, "
                          "field_system, field_tools and field_thinking");
      }
    }
    if (chat_key && src.type != "chat_template")
      throw chat_key->error("applies to type: chat_template datasets, and this one is type: " + src.type);
    const ConfigNode* path = item.find("path");
    if (!path) throw item.error("has no path; expected {path: FILE, type: alpaca}");
    std::error_code ec;
    if (!fs::is_regular_file(src.path, ec))
      throw path->error("is \"" + src.path + "\", which is not a local file: memrt does not download Hub datasets; "
                        "download it (e.g. huggingface-cli download --repo-type dataset NAME) and set path to its "
                        ".jsonl or .json file");
    into.push_back(src);
  }
}

// Fine-tuning records: axolotl's datasets: [{path, type}] of local files and LLaMA-Factory's dataset
// (docs/tokenizers.md), their held-out twins, and which of their tokens the loss counts.
void Loader::resolve_records() {
  if (const ConfigNode* list = yv("datasets")) {
    if (yv("train_file"))
      throw list->error("and " + where(*yv("train_file")) + " both name the training data; keep one");
    read_axolotl_datasets(*list, cfg.data.datasets);
  }
  if (const ConfigNode* list = yv("test_datasets")) {  // axolotl's held-out records: evaluated as eval_file is
    if (const ConfigNode* file = yv("eval_file"))
      throw list->error("and " + where(*file) + " both name the evaluation data; keep one");
    read_axolotl_datasets(*list, cfg.data.eval_datasets);
  }
  read_llamafactory_datasets();
  read_held_out();
  if (const ConfigNode* eot = yv("eot_tokens")) cfg.data.eot_tokens = eot->as_names();
  if (const ConfigNode* kwargs = yv("chat_template_kwargs")) {
    if (!kwargs->is_object())
      throw kwargs->error("expected a mapping of chat template variables, e.g. {enable_thinking: false}; found " +
                          kwargs->describe());
    for (const char* own : {"messages", "tools", "add_generation_prompt"})
      if (kwargs->find(own))
        throw kwargs->find(own)->error("is a variable the chat template gets from the data and the run; leave it out");
    cfg.data.chat_template_kwargs = kwargs->to_json(0);
  }
  const ConfigNode* inputs = yv("train_on_inputs");
  const ConfigNode* completion_only = yv("completion_only_loss");
  if (inputs && completion_only && inputs->as_bool() == completion_only->as_bool())
    throw inputs->error("is " + inputs->to_json(0) + " but " + where(*completion_only) + " is " +
                        completion_only->to_json(0) + ": they say opposite things about the prompt's tokens; keep one");
  cfg.data.train_on_prompt = inputs ? inputs->as_bool() : completion_only ? !completion_only->as_bool() : false;
  if (const ConfigNode* pad = yv("pad_to_sequence_len")) cfg.data.pad_to_block = pad->as_bool();
  if (const ConfigNode* pack = yv("sample_packing")) cfg.data.pack = pack->as_bool();
  if (const ConfigNode* assistant = yv("assistant_only_loss")) cfg.data.assistant_only = assistant->as_bool();
  // chat_template: a template's source (alignment-handbook, TRL) replaces the model's; axolotl's
  // tokenizer_default is the model's own, `jinja` takes chat_template_jinja (a file or the source),
  // tokenizer_default_fallback_NAME the model's own or else NAME, and another name one memrt ships
  // (checked where the data is read: data/chat_template.h).
  const ConfigNode* t = yv("chat_template");
  const ConfigNode* jinja = yv("chat_template_jinja");
  const std::string choice = t ? t->as_string() : jinja ? "jinja" : "tokenizer_default";
  const std::string fallback = "tokenizer_default_fallback_";
  if (jinja && choice != "jinja")
    throw jinja->error("is given, and " + where(*t) + " is " + choice + ": chat_template_jinja is read with "
                       "chat_template: jinja; keep one");
  if (choice.find("{{") != std::string::npos || choice.find("{%") != std::string::npos) {
    cfg.data.chat_template = choice;
    cfg.data.chat_template_where = t->file() + ": chat_template";
  } else if (choice == "jinja") {
    if (!jinja)
      throw t->error("is jinja, which takes its template from chat_template_jinja: set it to a .jinja file or the "
                     "template's source");
    const std::string& v = jinja->as_string();
    std::error_code ec;
    const bool file = v.find("{{") == std::string::npos && v.find("{%") == std::string::npos;
    if (file && !fs::is_regular_file(v, ec))
      throw jinja->error("is \"" + v + "\", neither a file nor a template's source ({{ ... }} or {% ... %})");
    if (file) {
      std::ifstream in(v, std::ios::binary);
      cfg.data.chat_template.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    } else {
      cfg.data.chat_template = v;
    }
    cfg.data.chat_template_where = file ? v : jinja->file() + ": chat_template_jinja";
  } else if (choice != "tokenizer_default") {
    const bool falls_back = choice.rfind(fallback, 0) == 0;
    cfg.data.chat_template_name = falls_back ? choice.substr(fallback.size()) : choice;
    cfg.data.chat_template_fallback = falls_back;
    cfg.data.chat_template_where = t->file() + ": chat_template";
  }
}

// A dataset of dataset_info.json (`entry`, under the key `name`): LLaMA-Factory's DatasetAttr, its
// file or the files of its directory, each one source of records.
std::vector<DatasetSource> llamafactory_sources(const ConfigNode& entry, const std::string& name, const std::string& dir,
                                               ConfigDiagnostics& diag) {
  if (!entry.is_object()) throw entry.error("expected an object describing the dataset, found " + entry.describe());
  ConfigReader r(entry, diag);
  for (const char* hub : {"hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name"})
    r.reject(hub, "memrt does not download datasets: download it (e.g. huggingface-cli download --repo-type dataset "
                  "NAME) into dataset_dir and describe it with file_name");
  for (const char* key : {"num_samples", "subset", "folder"})
    r.reject(key, "memrt reads a local dataset's file whole; cut the file, or set max_samples (its first records)");
  LlamaFactoryDataset d;
  d.name = name;
  const ConfigNode* file = r.child("file_name");
  const ConfigNode* formatting = r.child("formatting");
  if (formatting) d.formatting = formatting->as_string();
  if (d.formatting != "alpaca" && d.formatting != "sharegpt" && d.formatting != "openai")
    throw formatting->error("is \"" + d.formatting + "\"; expected alpaca, sharegpt or openai");
  if (const ConfigNode* ranking = r.child("ranking"); ranking && ranking->as_bool())
    throw ranking->error("is true: ranked (DPO, reward model) datasets are not supported; memrt fine-tunes on responses");
  if (const ConfigNode* split = r.child("split"); split && split->as_string() != "train")
    throw split->error("is \"" + split->as_string() + "\"; a local file has one split, train");
  if (const ConfigNode* columns = r.child("columns")) {  // given: the columns it omits are unset
    if (!columns->is_object()) throw columns->error("expected an object of column names, found " + columns->describe());
    ConfigReader c(*columns, diag);
    for (auto [key, field] : {std::pair{"prompt", &d.prompt}, {"query", &d.query}, {"response", &d.response},
                              {"history", &d.history}, {"messages", &d.messages}, {"system", &d.system}, {"tools", &d.tools}}) {
      const ConfigNode* n = c.child(key);
      *field = n && !n->is_null() ? n->as_string() : "";
    }
    for (const char* media : {"images", "videos", "audios"})
      c.reject(media, "multimodal datasets are not supported; memrt trains language models");
    for (const char* pref : {"chosen", "rejected", "kto_tag"})
      c.reject(pref, "preference datasets (DPO, KTO) are not supported; memrt fine-tunes on responses");
    c.finish();
  }
  if (const ConfigNode* tags = r.child("tags")) {
    if (!tags->is_object()) throw tags->error("expected an object of tags, found " + tags->describe());
    ConfigReader t(*tags, diag);
    for (auto [key, field] : {std::pair{"role_tag", &d.role_tag}, {"content_tag", &d.content_tag}, {"user_tag", &d.user_tag},
                              {"assistant_tag", &d.assistant_tag}, {"observation_tag", &d.observation_tag},
                              {"function_tag", &d.function_tag}, {"system_tag", &d.system_tag}}) {
      const ConfigNode* n = t.child(key);
      *field = n && !n->is_null() ? n->as_string() : "";
    }
    t.finish();
  }
  r.finish();
  if (!file) throw entry.error("has no file_name; memrt reads local datasets: {\"file_name\": \"data.json\", ...}");
  const fs::path at = fs::path(dir) / file->as_string();
  std::vector<std::string> paths;
  std::error_code ec;
  if (fs::is_directory(at, ec)) {  // its files, in name order
    for (const auto& e : fs::directory_iterator(at, ec))
      if (e.is_regular_file()) paths.push_back(e.path().string());
    std::sort(paths.begin(), paths.end());
  } else if (fs::is_regular_file(at, ec)) {
    paths.push_back(at.string());
  } else {
    throw file->error("is \"" + file->as_string() + "\", and " + at.string() + " is neither a file nor a directory "
                      "(file_name is relative to dataset_dir)");
  }
  if (paths.empty()) throw file->error("is the directory " + at.string() + ", which holds no file");
  std::vector<DatasetSource> sources;
  for (const std::string& path : paths) {
    const std::string ext = fs::path(path).extension().string();
    if (ext != ".json" && ext != ".jsonl")
      throw file->error("names " + path + "; memrt reads LLaMA-Factory datasets from .json and .jsonl files (convert "
                        "csv, parquet or arrow to JSON lines)");
    DatasetSource src;
    src.path = path;
    src.type = "llamafactory";
    src.llamafactory = d;
    src.llamafactory.part = static_cast<int64_t>(sources.size());
    sources.push_back(src);
  }
  return sources;
}

// axolotl's val_set_size and LLaMA-Factory's val_size: records of the training datasets held out
// for evaluation (docs/tokenizers.md, "Held-out records"); 0 holds none out.
void Loader::read_held_out() {
  const ConfigNode* axolotl = yv("val_set_size");
  const ConfigNode* llamafactory = yv("val_size");
  if (axolotl && llamafactory)
    throw llamafactory->error("and " + where(*axolotl) + " both hold records out; keep one");
  const ConfigNode* shuffle = yv("shuffle_merged_datasets");
  const ConfigNode* x = axolotl ? axolotl : llamafactory;
  if (!x || x->as_double() == 0) return;
  HeldOut& h = cfg.data.held_out;
  h.tool = axolotl ? HeldOut::Tool::kAxolotl : HeldOut::Tool::kLlamaFactory;
  h.key = axolotl ? "val_set_size" : "val_size";
  h.size = x->as_double();
  if (h.size > 1) h.size = std::floor(h.size);  // int(size), as both tools read a count
  if (h.size < 0 || h.size == 1)
    throw x->error("is " + x->to_json(0) + "; expected a fraction of the records between 0 and 1, or a count of "
                   "them above 1");
  if (cfg.data.datasets.empty())
    throw x->error(axolotl ? std::string("holds records of datasets: out, and there are none; for a train_file, put "
                                         "the held-out text in its own file and set eval_file to it")
                           : std::string("holds records of dataset: out, and there are none"));
  if (!cfg.data.eval_datasets.empty() || yv("eval_file")) {
    const ConfigNode* other = yv("eval_file") ? yv("eval_file") : yv("test_datasets") ? yv("test_datasets")
                                                                                       : yv("eval_dataset");
    throw x->error("and " + where(*other) + " both name the evaluation data; keep one");
  }
  if (shuffle) h.shuffle = shuffle->as_bool();
}

// LLaMA-Factory's dataset: names in dataset_dir's dataset_info.json, and the keys of its template
// and supervised processor (docs/tokenizers.md, "Datasets").
void Loader::read_llamafactory_datasets() {
  const ConfigNode* names = yv("dataset");
  if (!names) {
    for (const char* key : {"dataset_dir", "template", "mask_history", "default_system", "enable_thinking", "max_samples",
                            "mix_strategy", "eval_dataset"})
      if (const ConfigNode* n = yv(key))
        throw n->error("applies to LLaMA-Factory's dataset: (names in dataset_dir's dataset_info.json), which this "
                       "config does not set");
    return;
  }
  for (const char* other : {"datasets", "train_file"})
    if (const ConfigNode* n = yv(other))
      throw names->error("and " + where(*n) + " both name the training data; keep one");
  const ConfigNode* dir_key = yv("dataset_dir");
  const std::string dir = dir_key ? dir_key->as_string() : "data";
  if (dir == "ONLINE" || dir.rfind("REMOTE:", 0) == 0)
    throw dir_key->error("is \"" + dir + "\": memrt does not download datasets; download them into a directory with "
                         "their dataset_info.json and set dataset_dir to it");
  const std::string info_path = (fs::path(dir) / "dataset_info.json").string();
  std::error_code ec;
  if (!fs::is_regular_file(info_path, ec))
    throw names->error("names datasets of dataset_dir's dataset_info.json, and " + info_path + " is not a file (dataset_dir " +
                       (dir_key ? "is \"" + dir + "\"" : std::string("defaults to \"data\"")) +
                       ", relative to the current directory)");
  const ConfigNode info = parse_json_file(info_path);
  if (!info.is_object()) throw info.error("expected an object of datasets by name, found " + info.describe());
  int64_t max_samples = -1;
  if (const ConfigNode* m = yv("max_samples")) {
    max_samples = m->as_int();
    if (max_samples <= 0) throw m->error("must be positive (the first records of each dataset)");
  }
  if (const ConfigNode* mix = yv("mix_strategy"); mix && mix->as_string() != "concat")
    throw mix->error("is \"" + mix->as_string() + "\"; memrt concatenates the datasets (concat)");
  auto read = [&](const ConfigNode& key, std::vector<DatasetSource>& into) {
    for (const std::string& name : key.as_names()) {
      const ConfigNode* entry = info.find(name);
      if (!entry) {
        std::string known;
        for (const auto& m : info.members()) known += (known.empty() ? "" : ", ") + m.first;
        throw key.error("names \"" + name + "\", which " + info_path + " does not describe (it has " + known + ")");
      }
      for (DatasetSource& src : llamafactory_sources(*entry, name, dir, diag)) {
        src.max_samples = max_samples;
        into.push_back(std::move(src));
      }
    }
  };
  read(*names, cfg.data.datasets);
  if (const ConfigNode* eval = yv("eval_dataset")) {
    if (const ConfigNode* file = yv("eval_file"))
      throw eval->error("and " + where(*file) + " both name the evaluation data; keep one");
    read(*eval, cfg.data.eval_datasets);
  }
  LlamaFactoryOptions& lf = cfg.data.llamafactory;
  if (const ConfigNode* t = yv("template")) lf.template_name = t->as_string();
  if (const ConfigNode* m = yv("mask_history")) lf.mask_history = m->as_bool();
  if (const ConfigNode* s = yv("default_system")) lf.default_system = s->as_string();
  if (const ConfigNode* e = yv("enable_thinking")) lf.enable_thinking = e->as_bool();
  if (const ConfigNode* p = yv("train_on_inputs"); p && p->as_bool() && lf.mask_history)
    throw p->error("is true, and mask_history trains on the last turn only: LLaMA-Factory refuses the two together; "
                   "keep one");
}

// A save_strategy or eval_strategy: a string; YAML reads an unquoted `no` as false, which means "no".
std::string strategy_name(const ConfigNode& node) {
  return node.is_bool() && !node.as_bool() ? std::string("no") : node.as_string();
}

// When to save checkpoints: Hugging Face's save_strategy and save_steps (an integer, or a fraction
// of the run below 1), axolotl's saves_per_epoch.
void Loader::resolve_saving() {
  const ConfigNode* strategy = yv("save_strategy");
  const ConfigNode* steps = yv("save_steps");
  const ConfigNode* per_epoch = yv("saves_per_epoch");
  if (strategy) cfg.save_strategy = strategy_name(*strategy);
  if (cfg.save_strategy == "best") {
    throw strategy->error("is \"best\", which saves when metric_for_best_model improves; memrt keeps no best "
                          "model: use \"steps\" (every save_steps and at the end), \"epoch\" or \"no\"");
  }
  if (cfg.save_strategy != "steps" && cfg.save_strategy != "epoch" && cfg.save_strategy != "no")
    throw strategy->error("is \"" + cfg.save_strategy + "\"; expected \"steps\", \"epoch\" or \"no\"");
  if (steps) {
    cfg.save_steps = steps->as_double();
    if (cfg.save_steps < 0) throw steps->error("must be >= 0 (0: a checkpoint after the last step only; below 1: that fraction of the run's steps)");
    if (cfg.save_steps >= 1) steps->as_int();  // a whole number of steps, else an error naming the value
  }
  if (per_epoch && !per_epoch->is_null()) {
    cfg.saves_per_epoch = per_epoch->as_int();
    if (cfg.saves_per_epoch <= 0) throw per_epoch->error("must be positive (checkpoints per epoch)");
    if (steps) {
      throw per_epoch->error("says when to save, and so does " + where(*steps) + "; axolotl takes one of them: "
                             "remove one");
    }
  }
}

// TRL's (and run_clm's) dataset_name where it is a local path: a file is the train_file; a
// directory is read as datasets' load_dataset(DIR, name=dataset_config_name) reads it, its
// dataset_train_split ("train") trained on and, when the run evaluates, its dataset_test_split
// ("test") evaluated (docs/tokenizers.md, "A dataset directory"). Hub names are refused.
void Loader::read_dataset_name(const ConfigNode& name) {
  const std::string path = name.as_string();
  std::error_code ec;
  const ConfigNode* config = yv("dataset_config_name");
  if (fs::is_regular_file(path, ec)) {
    if (config) throw config->error("names a config of a dataset directory, and " + where(name) + " is a file; leave it out");
    cfg.data.train_files = {path};
    return;
  }
  if (!fs::is_directory(path, ec))
    throw name.error("is \"" + path + "\", which is not a local directory or file; memrt downloads nothing: fetch "
                     "the dataset (huggingface-cli download --repo-type dataset " + path + " --local-dir DIR) and "
                     "set dataset_name to DIR (relative paths are relative to the current directory)");
  try {
    dataset_dir_ = find_local_dataset(path, config ? config->as_string() : "");
  } catch (const FileError& e) {
    throw name.error(std::string("names a directory datasets cannot load: ") + e.what());
  }
  if (dataset_dir_->module != "json" && dataset_dir_->module != "text") {
    const std::vector<std::string>& first = dataset_dir_->splits.front().second;
    throw name.error("is a dataset of " + dataset_dir_->module + " files (" + (first.empty() ? path : first.front()) +
                     "); memrt reads JSON, JSONL and text: convert it, e.g. python -c \"import datasets; "
                     "datasets.load_dataset('" + path + "', split='train').to_json('train.jsonl')\", and set "
                     "train_file to the result");
  }
  cfg.data.train_files = dataset_split_files("dataset_train_split", "train");
}

// The files of dataset_name's split that `key` names (default `fallback`), in datasets' order.
std::vector<std::string> Loader::dataset_split_files(const char* key, const char* fallback) const {
  const ConfigNode* chosen = yv(key);
  const std::string split = chosen ? chosen->as_string() : fallback;
  const ConfigNode& name = *yv("dataset_name");
  const std::vector<std::string>* files = dataset_dir_->split(split);
  const std::string in = where(name) + " (" + name.as_string() + ")";
  if (!files || files->empty())
    throw ConfigError(name.file(), chosen ? chosen->path() : name.path(),
                      "names the split \"" + split + "\", and " + in + " has " + dataset_dir_->split_names() +
                          ": set " + key + " to one of them");
  // One format a split: a .json file is an array of records, a .jsonl file a record a line.
  const std::string ext = fs::path(files->front()).extension().string();
  for (const std::string& file : *files) {
    const std::string e = fs::path(file).extension().string();
    if (e != ".jsonl" && e != ".json" && e != ".txt")
      throw ConfigError(name.file(), name.path(), "names a dataset whose " + split + " split holds " + file +
                                                      "; memrt reads .jsonl, .json and .txt files as they are (not "
                                                      "compressed): rename or decompress it");
    if (e != ext)
      throw ConfigError(name.file(), name.path(), "names a dataset whose " + split + " split holds " + files->front() +
                                                      " and " + file + "; memrt reads a split's files alike: make "
                                                      "them all " + ext + " (or all " + e + ")");
  }
  return *files;
}

// eval_file and when to evaluate it: Hugging Face's eval_strategy (steps: every eval_steps, which
// defaults to logging_steps; epoch: once an epoch; no: only after the last step), axolotl's
// eval_steps and evals_per_epoch alone.
void Loader::resolve_eval() {
  // Where tokenized data is cached; null (axolotl's examples leave it empty): the default.
  if (const ConfigNode* prepared = yv("dataset_prepared_path"); prepared && !prepared->is_null())
    cfg.data.cache_dir = prepared->as_string();
  const ConfigNode* file = yv("eval_file");
  if (file) {
    cfg.data.eval_files = {file->as_string()};
    std::error_code ec;
    if (!fs::is_regular_file(file->as_string(), ec)) {
      throw file->error("is \"" + file->as_string() + "\", which is not a file (relative paths are relative to the "
                        "current directory); eval_file takes the formats train_file does");
    }
  }
  const ConfigNode* steps = yv("eval_steps");
  const ConfigNode* per_epoch = yv("evals_per_epoch");
  const ConfigNode* strategy = yv("eval_strategy");
  const std::string how = strategy ? strategy_name(*strategy) : steps ? "steps" : per_epoch ? "epoch" : "no";
  if (how == "steps") {
    cfg.eval.steps = steps ? steps->as_int() : cfg.steps_per_print;  // Hugging Face: logging_steps
    if (cfg.eval.steps <= 0) throw steps->error("must be positive (evaluate every eval_steps optimizer steps)");
  } else if (how == "epoch") {
    cfg.eval.per_epoch = per_epoch && !strategy ? per_epoch->as_int() : 1;
    if (cfg.eval.per_epoch <= 0) throw per_epoch->error("must be positive (evaluations per epoch)");
  } else if (how != "no") {
    throw strategy->error("is \"" + how + "\"; expected \"no\", \"steps\" or \"epoch\"");
  }
  if (const ConfigNode* b = yv("per_device_eval_batch_size")) {
    cfg.eval.batch_size = b->as_int();
    if (cfg.eval.batch_size <= 0) throw b->error("must be positive (eval windows per forward on each rank)");
  }
  if (!file && dataset_dir_ && how != "no") cfg.data.eval_files = dataset_split_files("dataset_test_split", "test");
  if (!file && cfg.data.eval_files.empty() && cfg.data.eval_datasets.empty() &&
      cfg.data.held_out.tool == HeldOut::Tool::kNone && (cfg.eval.steps > 0 || cfg.eval.per_epoch > 0)) {  // a note
    const ConfigNode* why = strategy ? strategy : steps ? steps : per_epoch;
    diag.warnings.push_back(where(*why) + " asks for evaluation but no eval_file is set: nothing is evaluated; set "
                            "eval_file (or validation_file) to a held-out file in a format train_file takes");
    cfg.eval = EvalSchedule{};
  }
}

}  // namespace

std::string yaml_spelling(const ConfigNode& train_yaml, const std::string& key) {
  if (const std::vector<std::string>* names = spellings_of(key))
    for (const std::string& name : *names)
      if (train_yaml.find(name)) return name;
  return key;
}

std::optional<int64_t> parse_size(const std::string& text) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  std::string unit = text.substr(used);
  unit.erase(0, unit.find_first_not_of(' '));
  std::transform(unit.begin(), unit.end(), unit.begin(), [](unsigned char c) { return std::tolower(c); });
  double scale = unit.empty() || unit == "b" ? 1 : 0;
  const double kib = 1024;
  for (const auto& [letter, binary, decimal] : {std::tuple{"k", kib, 1e3}, {"m", kib * kib, 1e6},
                                                {"g", kib * kib * kib, 1e9}, {"t", kib * kib * kib * kib, 1e12}}) {
    const std::string p = letter;
    if (unit == p || unit == p + "i" || unit == p + "ib") scale = binary;
    if (unit == p + "b") scale = decimal;
  }
  const double bytes = v * scale;
  if (scale == 0 || !std::isfinite(bytes) || !(bytes >= 1) || bytes > 9.2e18) return std::nullopt;
  return static_cast<int64_t>(std::llround(bytes));
}

TrainConfig load_train_config(const ConfigSources& sources) {
  Loader loader(sources);
  loader.run();
  return std::move(loader.cfg);
}

std::string resolved_config_json(const TrainConfig& cfg) {
  const auto num = [](double v) { return ConfigNode::number(v); };
  const auto str = [](const std::string& v) { return ConfigNode::string(v); };
  ConfigNode root = ConfigNode::object();
  root.set("ds_config", str(cfg.ds_config_path));
  root.set("train_yaml", str(cfg.train_yaml_path));
  ConfigNode batch = ConfigNode::object();
  batch.set("train_batch_size", num(static_cast<double>(cfg.train_batch_size)));
  batch.set("train_micro_batch_size_per_gpu", num(static_cast<double>(cfg.micro_batch_size)));
  batch.set("gradient_accumulation_steps", num(static_cast<double>(cfg.grad_accum_steps)));
  batch.set("world_size", num(cfg.world_size));
  batch.set("equation", str(batch_equation({cfg.train_batch_size, cfg.micro_batch_size, cfg.grad_accum_steps}, cfg.world_size)));
  root.set("batch", batch);
  root.set("gradient_clipping", num(cfg.gradient_clipping));
  root.set("steps_per_print", num(static_cast<double>(cfg.steps_per_print)));
  if (cfg.wall_clock_breakdown) root.set("wall_clock_breakdown", ConfigNode::boolean(true));
  if (cfg.flops_profiler.enabled) {
    ConfigNode fp = ConfigNode::object();
    fp.set("profile_step", num(static_cast<double>(cfg.flops_profiler.profile_step)));
    if (!cfg.flops_profiler.output_file.empty()) fp.set("output_file", str(cfg.flops_profiler.output_file));
    root.set("flops_profiler", fp);
  }
  root.set("max_steps", num(static_cast<double>(cfg.max_steps)));
  root.set("num_train_epochs", num(cfg.num_train_epochs));
  root.set("save_strategy", str(cfg.save_strategy));
  root.set("save_steps", num(cfg.save_steps));
  if (cfg.saves_per_epoch > 0) root.set("saves_per_epoch", num(static_cast<double>(cfg.saves_per_epoch)));
  root.set("save_total_limit", num(static_cast<double>(cfg.save_total_limit)));
  root.set("output_dir", str(cfg.output_dir));
  root.set("seed", num(static_cast<double>(cfg.seed)));
  root.set("compute_dtype", str(cfg.compute_dtype));
  root.set("chunked_cross_entropy", ConfigNode::boolean(cfg.chunked_cross_entropy));
  if (cfg.memory_budget > 0) root.set("memory_budget", num(static_cast<double>(cfg.memory_budget)));
  root.set("preflight", ConfigNode::boolean(cfg.preflight));
  root.set("zero_stage", num(cfg.zero_stage));

  const OptimizerConfig& o = cfg.optimizer;
  ConfigNode opt = ConfigNode::object();
  opt.set("type", str(o.type));
  opt.set("lr", num(o.lr));
  opt.set("weight_decay", num(o.weight_decay));
  if (o.type == "SGD") {
    opt.set("momentum", num(o.momentum));
    opt.set("dampening", num(o.dampening));
    opt.set("nesterov", ConfigNode::boolean(o.nesterov));
  } else {
    ConfigNode betas = ConfigNode::array();
    betas.push_back(num(o.beta1));
    betas.push_back(num(o.beta2));
    opt.set("betas", betas);
    opt.set("eps", num(o.eps));
    opt.set("bias_correction", ConfigNode::boolean(o.bias_correction));
    opt.set("adam_w_mode", ConfigNode::boolean(o.adam_w_mode));
    if (o.bf16_stochastic_round) opt.set("bf16_stochastic_round", ConfigNode::boolean(true));
  }
  if (o.groups.embedding_lr_scale > 0) opt.set("embedding_lr_scale", num(o.groups.embedding_lr_scale));
  else if (o.groups.embedding_lr > 0) opt.set("embedding_lr", num(o.groups.embedding_lr));
  if (!o.groups.lr_groups.empty()) {
    ConfigNode groups = ConfigNode::array();
    for (const LrGroup& g : o.groups.lr_groups) {
      ConfigNode item = ConfigNode::object();
      item.set("name", str(g.name));
      ConfigNode modules = ConfigNode::array();
      for (const std::string& m : g.modules) modules.push_back(str(m));
      item.set("modules", modules);
      item.set("lr", num(g.lr));
      groups.push_back(item);
    }
    opt.set("lr_groups", groups);
  }
  root.set("optimizer", opt);

  const SchedulerConfig& s = cfg.scheduler;
  ConfigNode sch = ConfigNode::object();
  sch.set("type", str(s.type.empty() ? "constant" : s.type));
  sch.set("warmup_min_lr", num(s.warmup_min_lr));
  sch.set("warmup_max_lr", num(s.warmup_max_lr));
  sch.set("warmup_num_steps", num(static_cast<double>(s.warmup_num_steps)));
  if (s.warmup_num_steps < 0) sch.set("warmup_ratio", num(s.warmup_ratio));
  sch.set("warmup_type", str(s.warmup_type));
  sch.set("total_num_steps", num(static_cast<double>(s.total_num_steps)));
  if (s.type == "WarmupCosineLR") {
    sch.set("warmup_min_ratio", num(s.warmup_min_ratio));
    sch.set("cos_min_ratio", num(s.cos_min_ratio));
  }
  root.set("scheduler", sch);

  ConfigNode model = ConfigNode::object();
  if (!cfg.model.name_or_path.empty()) {
    model.set("name_or_path", str(cfg.model.name_or_path));
  } else {
    const ModelShape& m = cfg.model.shape;
    model.set("arch", str(m.arch));
    model.set("n_layer", num(static_cast<double>(m.n_layer)));
    model.set("n_head", num(static_cast<double>(m.n_head)));
    model.set("n_kv_head", num(static_cast<double>(m.n_kv_head)));
    model.set("d_model", num(static_cast<double>(m.d_model)));
    model.set("d_ff", num(static_cast<double>(m.d_ff)));
    model.set("vocab_size", num(static_cast<double>(m.vocab_size)));
    model.set("n_ctx", num(static_cast<double>(m.n_ctx)));
    model.set("norm_eps", num(m.norm_eps));
    model.set("rope_theta", num(m.rope_theta));
    model.set("tie_embeddings", ConfigNode::boolean(m.tie_embeddings));
    if (m.arch == "llama") {
      model.set("attention_dropout", num(m.attn_pdrop));
    } else {
      model.set("embd_pdrop", num(m.embd_pdrop));
      model.set("attn_pdrop", num(m.attn_pdrop));
      model.set("resid_pdrop", num(m.resid_pdrop));
    }
    model.set("init_std", num(cfg.model.init_std));
  }
  root.set("model", model);
  auto files = [&](const std::vector<std::string>& list) {  // one file as train.yaml names it; a split's several
    if (list.size() == 1) return str(list.front());
    ConfigNode out = ConfigNode::array();
    for (const std::string& f : list) out.push_back(str(f));
    return out;
  };
  auto sources = [&](const std::vector<DatasetSource>& list) {
    ConfigNode out = ConfigNode::array();
    for (const DatasetSource& src : list) {
      ConfigNode d = ConfigNode::object();
      d.set("path", str(src.path));
      d.set("type", str(src.type));
      if (src.type == "llamafactory") {
        d.set("dataset", str(src.llamafactory.name));
        d.set("formatting", str(src.llamafactory.formatting));
      }
      out.push_back(d);
    }
    return out;
  };
  ConfigNode data = ConfigNode::object();
  if (cfg.data.datasets.empty()) {
    data.set("train_file", cfg.data.train_files.empty() ? str("(built-in corpus)") : files(cfg.data.train_files));
  } else {
    data.set("datasets", sources(cfg.data.datasets));
    if (!cfg.data.llamafactory.template_name.empty()) data.set("template", str(cfg.data.llamafactory.template_name));
  }
  data.set("train_on_inputs", ConfigNode::boolean(cfg.data.train_on_prompt));
  data.set("pad_to_sequence_len", ConfigNode::boolean(cfg.data.pad_to_block));
  data.set("sample_packing", ConfigNode::boolean(cfg.data.pack));
  data.set("assistant_only_loss", ConfigNode::boolean(cfg.data.assistant_only));
  data.set("block_size", num(static_cast<double>(cfg.data.block_size)));
  data.set("tokenizer", str(cfg.data.tokenizer.empty() ? "(bytes)" : cfg.data.tokenizer));
  if (!cfg.data.cache_dir.empty()) data.set("dataset_prepared_path", str(cfg.data.cache_dir));
  const HeldOut& held = cfg.data.held_out;
  if (!cfg.data.eval_files.empty() || !cfg.data.eval_datasets.empty() || held.tool != HeldOut::Tool::kNone) {
    if (held.tool != HeldOut::Tool::kNone) {  // records held out of the training ones
      data.set(held.key, num(held.size));
      if (held.tool == HeldOut::Tool::kAxolotl) data.set("shuffle_merged_datasets", ConfigNode::boolean(held.shuffle));
    } else if (cfg.data.eval_datasets.empty()) {
      data.set("eval_file", files(cfg.data.eval_files));
    } else {
      data.set("eval_datasets", sources(cfg.data.eval_datasets));
    }
    ConfigNode eval = ConfigNode::object();
    eval.set("steps", num(static_cast<double>(cfg.eval.steps)));
    eval.set("per_epoch", num(static_cast<double>(cfg.eval.per_epoch)));
    eval.set("batch_size", num(static_cast<double>(cfg.eval.batch_size > 0 ? cfg.eval.batch_size : cfg.micro_batch_size)));
    data.set("eval", eval);
  }
  root.set("data", data);

  ConfigNode plugins = ConfigNode::array();
  for (const auto& p : cfg.plugins) {
    ConfigNode e = ConfigNode::object();
    e.set("name", str(p.name));
    e.set("library", str(p.library.empty() ? "(built-in)" : p.library));
    ConfigNode keys = ConfigNode::array();
    for (const auto& k : p.config_keys) keys.push_back(str(k));
    e.set("config_keys", keys);
    e.set("options", p.options);
    plugins.push_back(e);
  }
  root.set("plugins", plugins);
  ConfigNode warnings = ConfigNode::array();
  for (const auto& w : cfg.warnings) warnings.push_back(str(w));
  root.set("warnings", warnings);
  return root.to_json(2) + "\n";
}

}  // namespace memrt
