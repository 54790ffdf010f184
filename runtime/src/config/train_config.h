// The fully resolved configuration of one run: ds_config.json + train.yaml + command-line
// overrides, with DeepSpeed's defaults and derivations applied and every "auto" resolved.
// Host-internal: plugins never see this struct, only their own ConfigNode subtree.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "memrt/config_node.h"
#include "memrt/model_shape.h"

namespace memrt {

// One key set in one of the run's two files, as a user would edit it there (the memory advisor's
// changes, docs/preflight.md): a dotted key path ("zero_optimization.offload_optimizer.device",
// "activation_checkpointing.every_n_blocks"); a train.yaml key replaces every spelling of it, as a
// command-line override does.
struct ConfigEdit {
  enum class File { kDsConfig, kTrainYaml };
  File file = File::kTrainYaml;
  std::string key;
  ConfigNode value;
};

// Where a run's configuration comes from.
struct ConfigSources {
  std::string ds_config_path;   // may be empty: no ds_config (or train.yaml's `deepspeed:` key)
  std::string train_yaml_path;  // may be empty: no train.yaml
  std::vector<std::string> overrides;  // the command-line words after the yaml: "--max_steps=20" or "--max_steps" "20"
  std::vector<ConfigEdit> edits;       // applied after the overrides
  int world_size = 1;                  // data-parallel ranks
};

// One of axolotl's `lr_groups`: the decaying parameters whose name contains one of `modules`
// train at learning rate `lr` (relative to the optimizer's, the schedule scales both alike).
struct LrGroup {
  std::string name;
  std::vector<std::string> modules;
  double lr = 0.0;
};

// The host's per-group rules beyond decay / no decay (store/host_groups.h): axolotl's train.yaml
// keys. Any of them switches to axolotl's grouping (embeddings without weight decay).
struct GroupRules {
  double embedding_lr_scale = 0.0;  // 0: unset
  double embedding_lr = 0.0;        // 0: unset; embedding_lr_scale wins when both are set
  std::vector<LrGroup> lr_groups;
  std::string file;  // the train.yaml that set them, for errors
  bool any() const { return embedding_lr_scale > 0 || embedding_lr > 0 || !lr_groups.empty(); }
};

struct OptimizerConfig {
  std::string type = "AdamW";  // canonical: "Adam", "AdamW", "SGD"
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool bias_correction = true;
  // DeepSpeed: "Adam" with weight decay is decoupled (AdamW) unless adam_w_mode is false.
  bool adam_w_mode = true;
  double momentum = 0.0, dampening = 0.0;  // SGD
  bool nesterov = false;                   // SGD
  // torchao's bf16_stochastic_round: bf16 weights updated without fp32 masters
  // (bf16.bf16_master_weights_and_grads) are rounded stochastically, drawn from `seed` (the run's
  // seed, copied by the loader), the element and the update count: deterministic given the seed.
  bool bf16_stochastic_round = false;
  uint64_t seed = 42;
  // Built from the ds_config's optimizer section (DeepSpeed: weight decay on every trainable
  // parameter) rather than from train.yaml (Hugging Face: no decay on biases and norm weights).
  bool from_ds_config = false;
  GroupRules groups;
};

struct SchedulerConfig {
  // "" (constant lr), DeepSpeed's "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", or, when the
  // ds_config has no scheduler, Hugging Face's lr_scheduler_type: "linear", "cosine", "constant",
  // "constant_with_warmup".
  std::string type;
  double warmup_min_lr = 0.0;
  double warmup_max_lr = 1e-3;  // resolved (null -> optimizer lr)
  // -1: not known yet — ceil(warmup_ratio * total_num_steps), filled by the engine once
  // total_num_steps is (train.yaml warmup_ratio with max_steps derived from epochs).
  int64_t warmup_num_steps = 0;
  double warmup_ratio = 0.0;
  std::string warmup_type = "log";  // "log" | "linear"
  int64_t total_num_steps = 0;  // -1: follows TrainConfig::max_steps once the engine knows it
  double warmup_min_ratio = 0.0;  // WarmupCosineLR
  double cos_min_ratio = 1e-4;    // WarmupCosineLR
};

struct ModelConfig {
  // A local Hugging Face checkpoint directory (config.json + safetensors); empty: random init
  // from `shape`. When set, `shape` is read from its config.json.
  std::string name_or_path;
  ModelShape shape;
  double init_std = 0.02;
};

// How the conversations of an axolotl `type: chat_template` dataset are read and which of their
// tokens train: its dataset keys, with axolotl's defaults (docs/tokenizers.md, "Datasets").
struct ChatTemplateDataset {
  std::string field_messages = "messages", field_system = "system", field_tools = "tools";
  // message_property_mappings: the template's message key -> the record's. Empty: role, content,
  // tool and reasoning_content as they are.
  std::vector<std::pair<std::string, std::string>> property_mappings;
  // roles: the record's role -> the template's. Empty: human/user -> user, gpt/assistant ->
  // assistant, system, tool.
  std::vector<std::pair<std::string, std::string>> roles;
  std::vector<std::string> roles_to_train{"assistant"};
  // "turn" | "all" | "last" | "" (none); train_on_eot unset: train_on_eos's.
  std::string train_on_eos = "turn";
  std::optional<std::string> train_on_eot;
  std::string message_field_training;  // a message's key saying whether it trains, overriding its role
  // a message's key listing {begin_offset, end_offset, train}: the characters of its content that train
  std::string message_field_training_detail;
  bool drop_system_message = false;
  // split_thinking: an assistant's <think>...</think> (or <reasoning>, <|begin_of_thought|>) text is
  // moved from its content to the template's template_thinking_key. Without message_property_mappings
  // a message's field_thinking is read as that key.
  bool split_thinking = false;
  std::string template_thinking_key = "reasoning_content", field_thinking = "reasoning_content";
};

// A dataset of LLaMA-Factory's dataset_info.json: how its records read, with LLaMA-Factory's
// defaults (its DatasetAttr). An empty name is unset: a "columns" or "tags" object leaves the
// ones it omits unset, as in LLaMA-Factory (docs/tokenizers.md, "Datasets").
struct LlamaFactoryDataset {
  std::string name;                  // its key in dataset_info.json
  std::string formatting = "alpaca";  // "alpaca" | "sharegpt" | "openai"
  // columns: alpaca's prompt, query, response and history; sharegpt's and openai's messages; all: system, tools.
  std::string prompt = "instruction", query = "input", response = "output", history, messages = "conversations",
              system, tools;
  // sharegpt's and openai's tags: a message's keys, and the roles they name.
  std::string role_tag = "from", content_tag = "value", user_tag = "human", assistant_tag = "gpt",
              observation_tag = "observation", function_tag = "function_call", system_tag = "system";
  int64_t part = 0;  // which file of the dataset's directory this source is (0: its first, or its file)
};

// A file of fine-tuning records (axolotl's `datasets:` entry, a LLaMA-Factory dataset;
// docs/tokenizers.md, "Datasets").
struct DatasetSource {
  std::string path;
  // "alpaca" | "prompt_completion" | "messages" | "chat_template" | "llamafactory" (data/records.h)
  std::string type;
  ChatTemplateDataset chat{};  // type chat_template
  LlamaFactoryDataset llamafactory{};  // type llamafactory
  int64_t max_samples = -1;  // LLaMA-Factory's max_samples: the dataset's first records only (-1: all)
};

// How LLaMA-Factory's supervised processor turns a dataset's conversations into samples: its
// template (by name; empty: parsed from the model's chat template) and data keys.
struct LlamaFactoryOptions {
  std::string template_name;
  bool mask_history = false;                  // train on the last turn only
  std::optional<std::string> default_system;  // replaces the template's
  bool enable_thinking = true;                // reasoning templates: an empty thought is trained
};

// The records of `datasets` held out for evaluation, as axolotl's val_set_size or LLaMA-Factory's
// val_size choose them (docs/tokenizers.md, "Held-out records"): `size` of them (a fraction when
// at most 1), drawn with the run's seed.
struct HeldOut {
  enum class Tool { kNone, kAxolotl, kLlamaFactory };
  Tool tool = Tool::kNone;
  double size = 0;
  bool shuffle = true;  // axolotl's shuffle_merged_datasets: the merged records shuffled before the split
  std::string key;      // "val_set_size" or "val_size", for messages
};

struct DataConfig {
  // train_file, or the files of dataset_name's split, read in order as one dataset (Hugging Face
  // datasets concatenates a split's files so); empty: the built-in corpus.
  std::vector<std::string> train_files;
  // A JSONL file's text documents are each line's value of this field (TRL's dataset_text_field).
  std::string text_field = "text";
  // Non-empty: the run trains on these records, one sample each, instead of train_files.
  std::vector<DatasetSource> datasets;
  // Records: the loss counts the prompt's tokens too (axolotl's train_on_inputs; TRL's
  // completion_only_loss: false). Samples are padded to the longest of their micro-batch, or to
  // block_size with pad_to_sequence_len.
  bool train_on_prompt = false;
  bool pad_to_block = false;
  // Records: several samples per row of block_size tokens, attention and positions kept inside
  // each (sample_packing / packing; docs/tokenizers.md, "Packing"). Streams are contiguous already.
  bool pack = false;
  // Conversations: only the assistant's text (the chat template's {% generation %} blocks) is
  // trained (TRL's assistant_only_loss); else every token.
  bool assistant_only = false;
  // axolotl's eot_tokens: the tokens that end a turn in a chat_template dataset. Unset: the EOS token.
  std::optional<std::vector<std::string>> eot_tokens;
  // axolotl's chat_template_kwargs: more variables for the chat template (e.g. enable_thinking), as a
  // JSON object; empty: none.
  std::string chat_template_kwargs;
  LlamaFactoryOptions llamafactory;  // datasets of type llamafactory
  // A chat template's Jinja source given in train.yaml (alignment-handbook's and TRL's chat_template),
  // rendering conversations instead of the model's own; where it was given, for its errors.
  std::string chat_template, chat_template_where;
  // Or a template memrt ships, by the name axolotl gives it (data/chat_template.h,
  // named_chat_template); with chat_template_fallback only when the model has none (axolotl's
  // tokenizer_default_fallback_NAME).
  std::string chat_template_name;
  bool chat_template_fallback = false;
  // model_name_or_path's tokenizer.json, when it has one: text and JSONL (and the built-in corpus)
  // are tokenized with it; empty: they are bytes (docs/tokenizers.md).
  std::string tokenizer;
  // Where tokenized data is cached (axolotl's dataset_prepared_path, LLaMA-Factory's tokenized_path);
  // empty: $XDG_CACHE_HOME/memrt/tokenized, else ~/.cache/memrt/tokenized.
  std::string cache_dir;
  int64_t block_size = 128;  // tokens per sample (context length)
  // Evaluated as `launcher eval` and eval_steps do (docs/data-and-optim.md, "Evaluation"); the
  // same formats as train_files, several files read as one. Empty: no evaluation.
  std::vector<std::string> eval_files;
  // Or records evaluated the same way (LLaMA-Factory's eval_dataset), read as `datasets` are.
  std::vector<DatasetSource> eval_datasets;
  // Or records held out of `datasets` (docs/tokenizers.md, "Held-out records").
  HeldOut held_out;
};

// When a training run evaluates eval_file (besides once after its last step): every `steps`
// optimizer steps, or `per_epoch` times an epoch (Hugging Face's eval_strategy: epoch is 1, axolotl's
// evals_per_epoch); 0 and 0: only at the end.
struct EvalSchedule {
  int64_t steps = 0;
  int64_t per_epoch = 0;
  int64_t batch_size = 0;  // windows per forward on each rank; 0: micro_batch_size
};

// A plugin to load: a built-in one claimed by ds_config sections and/or train.yaml keys, or a
// third-party library named in the ds_config's "plugins" array.
//
// Built-in plugins own several keys; their `options` is an object holding, under their own names,
// the ds_config sections and train.yaml keys they own, with aliases normalised, "auto" resolved and
// the keys memrt accepts-but-ignores removed (docs/configuration.md, "Plugin sections"):
//   precision  {"fp16": {...}, "bf16": {...}, "data_types": {...}}   (bfloat16 -> bf16)
//   zero       {"zero_optimization": {...}}
//   checkpoint {"activation_checkpointing": {...}, "gradient_checkpointing": bool,
//               "gradient_checkpointing_kwargs": {...}}
//   lora       {"lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.05, "lora_target_modules": [...]
//               or "all-linear", "lora_model_dir": "..."}
//   quant      {"load_in_4bit": true, "bnb_4bit_quant_type": "nf4", ..., "optim": "adamw_8bit"}
// A third-party plugin's `options` is its entry's "options" object as written.
struct PluginSpec {
  std::string name;          // "precision", "zero", ..., or the third-party plugin's name
  std::string library;       // a path, or empty for a built-in (resolved by the loader)
  std::string config_key;    // the first key the plugin owns ("fp16", "plugins[0]", "lora_r")
  ConfigNode options;        // its config subtree, "auto" already resolved
  std::vector<std::string> config_keys;  // every key it owns, "file: key" ("train.yaml: lora_r")
};

struct TrainConfig {
  std::string ds_config_path;
  std::string train_yaml_path;
  ConfigSources sources;  // what it was loaded from, to load it again changed (the memory advisor)

  // Batch triple, consistent: train_batch_size == micro_batch_size * grad_accum_steps * world_size.
  int64_t train_batch_size = 0;
  int64_t micro_batch_size = 0;
  int64_t grad_accum_steps = 0;
  int world_size = 1;

  double gradient_clipping = 0.0;  // 0: off
  int64_t steps_per_print = 10;    // log cadence (train.yaml logging_steps when set)
  // DeepSpeed's flops_profiler (docs/profiling.md): optimizer step `profile_step` (1-based) runs
  // under LibTorch's profiler and its table goes to the log, or to output_file when one is given;
  // output_dir/step_profile.json gets every row.
  struct FlopsProfiler {
    bool enabled = false;
    int64_t profile_step = 1;
    std::string output_file;
  } flops_profiler;
  // DeepSpeed's wall_clock_breakdown: the log line and metrics.jsonl add each phase's time per
  // optimizer step (data_ms, forward_ms, backward_ms, gradient_reduce_ms, optimizer_step_ms),
  // averaged over the steps since the last line.
  bool wall_clock_breakdown = false;
  // > 0: train this many optimizer steps. -1: derive from num_train_epochs once the dataset's
  // size is known (the engine does; a scheduler's total_num_steps of -1 follows it).
  int64_t max_steps = -1;
  double num_train_epochs = 1.0;
  // Checkpoints, as Hugging Face's Trainer saves them (docs/checkpoints.md, "When"): save_strategy
  // "steps" (its default) every save_steps optimizer steps (an integer; 0: none on the way; below 1:
  // that fraction of the run's steps, rounded up) and after the last step; "epoch" at each epoch's
  // last step and the last; "no": none. axolotl's saves_per_epoch: every
  // ceil(steps per epoch / saves_per_epoch) steps.
  std::string save_strategy = "steps";
  double save_steps = 500;
  int64_t saves_per_epoch = 0;
  int64_t save_total_limit = 0;    // > 0: keep at most this many checkpoints (0: all)
  // "fp32", "fp16" or "bf16": what the precision plugin will train in (fp16/bf16 sections or
  // train.yaml fp16/bf16). Informational: the precision plugin does the work.
  std::string compute_dtype = "fp32";
  int zero_stage = 0;              // zero_optimization.stage (0: plain data parallel)
  // zero_optimization.stage3_gather_16bit_weights_on_model_save at stage 3: each checkpoint also
  // holds the consolidated Hugging Face model (its model/ folder, in the compute dtype).
  bool save_consolidated_model = false;
  std::string output_dir = "output";
  uint64_t seed = 42;
  // The LM head and its loss a chunk of tokens at a time, the logits never whole
  // (ops::linear_cross_entropy_sum; docs/models.md, "The head and its loss").
  bool chunked_cross_entropy = false;
  // The memory this host's ranks may use together (train.yaml memory_budget, bytes; 0: none) and
  // whether set-up checks the estimate against it and the machine's limits first (--no_preflight
  // skips it; docs/preflight.md).
  int64_t memory_budget = 0;
  bool preflight = true;

  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  ModelConfig model;
  DataConfig data;
  EvalSchedule eval;
  std::vector<PluginSpec> plugins;

  // Both input files and the overrides as parsed, for --print-config.
  ConfigNode ds_config;
  ConfigNode train_yaml;
  std::vector<std::string> warnings;
};

}  // namespace memrt
