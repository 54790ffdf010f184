// Malformed and contradictory configs: each must fail with a ConfigError whose message names the
// file, the key path, and the nearest valid key or both sides of a contradiction.
#include <gtest/gtest.h>

#include "load_helper.h"

using namespace memrt;
using namespace memrt::test;

namespace {

struct BadConfig {
  const char* name;
  std::string ds;    // "" = no ds_config
  std::string yaml;  // "" = no train.yaml
  std::vector<std::string> overrides;
  int world_size;
  std::vector<std::string> expected;  // parts of the message ("DS" / "YAML" = that file's path)
};

const std::string kMbs = R"("train_micro_batch_size_per_gpu": 4)";
const std::string kReadme = std::string(MEMRT_SOURCE_DIR) + "/README.md";  // a file that exists
// A LLaMA-Factory dataset_dir whose dataset_info.json describes a good dataset and bad ones.
const std::string kLlamaFactory = "dataset_dir: " + std::string(MEMRT_SOURCE_DIR) + "/tests/config/llamafactory\n";

std::vector<BadConfig> bad_configs() {
  return {
      // ---- unknown keys: file, key path, nearest valid key ----
      {"typo_top_level", "{" + kMbs + R"(, "gradient_clip": 1.0})", "", {}, 1,
       {"DS", "'gradient_clip'", "did you mean 'gradient_clipping'?"}},
      {"fp16_key_under_bf16", "{" + kMbs + R"(, "bf16": {"enabled": true, "loss_scale": 0}})", "", {}, 1,
       {"DS", "'bf16.loss_scale'", "unknown key"}},
      {"typo_in_optimizer_params", "{" + kMbs + R"(, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decy": 0.1}}})", "", {}, 1,
       {"DS", "'optimizer.params.weight_decy'", "did you mean 'weight_decay'?"}},
      {"typo_in_train_yaml", "", "learning_rat: 1e-3\n", {}, 1,
       {"YAML", "'learning_rat'", "did you mean 'learning_rate'?"}},
      {"typo_in_model_block", "", "model:\n  n_layers: 4\n", {}, 1,
       {"YAML", "'model.n_layers'", "did you mean 'n_layer'?"}},
      {"unknown_override_names_command_line", "", "max_steps: 5\n", {"--max_step=20"}, 1,
       {"command line: 'max_step'", "did you mean 'max_steps'?"}},
      {"unknown_plugin_entry_key", "{" + kMbs + R"(, "plugins": [{"name": "x", "library": "libx.so", "option": {}}]})", "", {}, 1,
       {"DS", "'plugins[0].option'", "did you mean 'options'?"}},
      // ---- wrong types: file, key path, expected, found ----
      {"string_where_integer", R"({"train_micro_batch_size_per_gpu": "four"})", "", {}, 1,
       {"DS", "'train_micro_batch_size_per_gpu'", "expected an integer", "a string (\"four\")"}},
      {"fractional_integer", R"({"train_micro_batch_size_per_gpu": 2.5})", "", {}, 1,
       {"DS", "'train_micro_batch_size_per_gpu'", "expected an integer", "2.5"}},
      {"bool_where_object", "{" + kMbs + R"(, "fp16": true})", "", {}, 1,
       {"DS", "'fp16'", "expected an object", "a boolean (true)"}},
      {"yaml_string_where_number", "", "learning_rate: fast\n", {}, 1,
       {"YAML", "'learning_rate'", "expected a number", "a string (\"fast\")"}},
      {"betas_wrong_length", "{" + kMbs + R"(, "optimizer": {"type": "Adam", "params": {"betas": [0.9]}}})", "", {}, 1,
       {"DS", "'optimizer.params.betas'", "two numbers"}},
      // ---- unresolved "auto" ----
      {"auto_left_unresolved", "{" + kMbs + R"(, "zero_optimization": {"stage": 3, "sub_group_size": "auto"}})", "", {}, 1,
       {"DS", "'zero_optimization.sub_group_size'", "\"auto\" could not be resolved"}},
      {"auto_steps_per_print", "{" + kMbs + R"(, "steps_per_print": "auto"})", "", {}, 1,
       {"DS", "'steps_per_print'", "\"auto\" could not be resolved", "write an integer"}},
      // ---- batch triple ----
      {"inconsistent_triple", R"({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})", "", {}, 1,
       {"DS", "'train_batch_size'", "N = 1", "16 != 4 * 2 * 1"}},
      {"triple_wrong_for_world_size", R"({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})", "", {}, 4,
       {"N = 4", "16 != 4 * 2 * 4"}},
      {"yaml_micro_batch_contradicts_ds", "{" + kMbs + "}", "per_device_train_batch_size: 8\n", {}, 1,
       {"DS", "'train_micro_batch_size_per_gpu'", "is 4", "YAML 'per_device_train_batch_size' is 8", "\"auto\""}},
      {"yaml_gas_contradicts_ds", "{" + kMbs + R"(, "gradient_accumulation_steps": 2})", "gradient_accumulation_steps: 4\n", {}, 1,
       {"DS", "'gradient_accumulation_steps'", "YAML 'gradient_accumulation_steps' is 4"}},
      {"yaml_values_break_the_ds_total", R"({"train_batch_size": 64})", "per_device_train_batch_size: 8\ngradient_accumulation_steps: 2\n", {}, 2,
       {"DS", "YAML", "N = 2", "64 != 8 * 2 * 2", "per_device_train_batch_size"}},
      // ---- contradictions between the files ----
      {"lr_contradiction", "{" + kMbs + R"(, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})", "learning_rate: 2e-4\n", {}, 1,
       {"DS", "'optimizer.params.lr'", "is 0.001", "YAML 'learning_rate' is 0.0002"}},
      {"clipping_contradiction", "{" + kMbs + R"(, "gradient_clipping": 1.0})", "max_grad_norm: 0.3\n", {}, 1,
       {"DS", "'gradient_clipping'", "YAML 'max_grad_norm' is 0.3"}},
      {"bf16_in_ds_fp16_in_yaml", "{" + kMbs + R"(, "bf16": {"enabled": true}})", "fp16: true\n", {}, 1,
       {"YAML: 'fp16'", "DS 'bf16.enabled'", "cannot be simultaneously enabled"}},
      {"fp16_and_bf16_both_in_ds", "{" + kMbs + R"(, "bf16": {"enabled": true}, "fp16": {"enabled": true}})", "", {}, 1,
       {"DS", "'fp16.enabled'", "'bf16.enabled'", "cannot be simultaneously enabled"}},
      {"ds_bf16_yaml_says_no", "{" + kMbs + R"(, "bf16": {"enabled": true}})", "bf16: false\n", {}, 1,
       {"DS", "'bf16.enabled'", "is true", "YAML 'bf16' is false"}},
      {"optimizers_differ", "{" + kMbs + R"(, "optimizer": {"type": "SGD"}})", "optim: adamw_8bit\n", {}, 1,
       {"DS", "'optimizer.type'", "YAML 'optim'", "different optimizers"}},
      {"schedulers_differ", "{" + kMbs + R"(, "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10}}})", "lr_scheduler_type: linear\n", {}, 1,
       {"DS", "'scheduler.type'", "YAML 'lr_scheduler_type'", "different schedules"}},
      {"total_steps_contradict_max_steps", "{" + kMbs + R"(, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100}}})", "max_steps: 50\n", {}, 1,
       {"DS", "'scheduler.params.total_num_steps'", "YAML 'max_steps' is 50"}},
      {"model_path_and_model_block", "", "model_name_or_path: /tmp\nmodel:\n  n_layer: 2\n", {}, 1,
       {"YAML", "'model'", "'model_name_or_path'", "not both"}},
      {"aliases_disagree", "", "per_device_train_batch_size: 4\nmicro_batch_size: 8\n", {}, 1,
       {"YAML", "'micro_batch_size'", "'per_device_train_batch_size' is 4", "two names of one setting"}},
      {"deepspeed_key_names_another_file", "{" + kMbs + "}", "deepspeed: some/other/ds.json\n", {}, 1,
       {"YAML", "'deepspeed'", "some/other/ds.json", "--deepspeed", "same file"}},
      {"torch_dtype_contradicts_precision", "", "bf16: true\ntorch_dtype: float16\n", {}, 1,
       {"YAML", "'torch_dtype'", "trains in bf16"}},
      {"qlora_without_4bit", "", "adapter: qlora\nlora_r: 8\n", {}, 1,
       {"YAML", "'adapter'", "load_in_4bit"}},
      // ---- known to DeepSpeed, cannot be honoured ----
      {"tensor_parallel", "{" + kMbs + R"(, "tensor_parallel": {"autotp_size": 2}})", "", {}, 1,
       {"DS", "'tensor_parallel'", "not supported", "data parallel"}},
      {"sequence_parallel", "{" + kMbs + R"(, "sequence_parallel_size": 4})", "", {}, 1,
       {"DS", "'sequence_parallel_size'", "not supported"}},
      {"lamb_optimizer", "{" + kMbs + R"(, "optimizer": {"type": "Lamb"}})", "", {}, 1,
       {"DS", "'optimizer.type'", "\"Lamb\"", "\"Adam\", \"AdamW\", \"SGD\""}},
      {"max_grad_norm_in_optimizer", "{" + kMbs + R"(, "optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}})", "", {}, 1,
       {"DS", "'optimizer.params.max_grad_norm'", "gradient_clipping"}},
      {"amp_section", "{" + kMbs + R"(, "amp": {"enabled": true, "opt_level": "O1"}})", "", {}, 1,
       {"DS", "'amp'", "\"fp16\" or \"bf16\""}},
      {"curriculum_enabled", "{" + kMbs + R"(, "curriculum_learning": {"enabled": true}})", "", {}, 1,
       {"DS", "'curriculum_learning'", "not supported"}},
      {"unknown_scheduler", "{" + kMbs + R"(, "scheduler": {"type": "WarmupCosine"}})", "", {}, 1,
       {"DS", "'scheduler.type'", "did you mean \"WarmupCosineLR\"?", "Supported"}},
      {"unknown_hf_scheduler", "", "lr_scheduler_type: polynomial\n", {}, 1,
       {"YAML", "'lr_scheduler_type'", "linear (the default), cosine, constant, constant_with_warmup"}},
      {"unknown_optim", "", "optim: adafactor\n", {}, 1,
       {"YAML", "'optim'", "adamw_torch", "sgd"}},
      {"hub_dataset", "", "datasets:\n  - path: tatsu-lab/alpaca\n    type: alpaca\n", {}, 1,
       {"YAML", "'datasets[0].path'", "tatsu-lab/alpaca", "does not download Hub datasets", ".jsonl"}},
      {"dataset_type_not_supported", "", "datasets:\n  - path: " + kReadme + "\n    type: completion\n", {}, 1,
       {"YAML", "'datasets[0].type'", "\"completion\"", "type: alpaca and type: chat_template"}},
      {"dataset_type_sharegpt", "", "datasets:\n  - path: " + kReadme + "\n    type: sharegpt\n", {}, 1,
       {"YAML", "'datasets[0].type'", "type: chat_template", "field_messages: conversations",
        "message_property_mappings: {role: from, content: value}"}},
      {"dataset_chat_key_on_alpaca", "", "datasets:\n  - path: " + kReadme + "\n    type: alpaca\n    roles_to_train: [gpt]\n", {}, 1,
       {"YAML", "'datasets[0].roles_to_train'", "type: chat_template datasets", "type: alpaca"}},
      {"dataset_train_on_eos", "", "datasets:\n  - path: " + kReadme + "\n    type: chat_template\n    train_on_eos: every\n", {}, 1,
       {"YAML", "'datasets[0].train_on_eos'", "\"every\"", "turn", "all", "last"}},
      {"val_set_size_without_records", "", "val_set_size: 0.05\n", {}, 1,
       {"YAML", "'val_set_size'", "there are none", "eval_file"}},
      {"val_set_size_one", "", "datasets:\n  - path: " + kReadme + "\n    type: alpaca\nval_set_size: 1\n", {}, 1,
       {"YAML", "'val_set_size'", "is 1", "a fraction of the records between 0 and 1, or a count"}},
      {"val_set_size_and_test_datasets", "", "datasets:\n  - path: " + kReadme + "\n    type: alpaca\ntest_datasets:\n  - path: " +
       kReadme + "\n    type: alpaca\nval_set_size: 0.1\n", {}, 1,
       {"YAML", "'val_set_size'", "'test_datasets'", "both name the evaluation data"}},
      {"val_set_size_and_val_size", "", "datasets:\n  - path: " + kReadme + "\n    type: alpaca\nval_set_size: 0.1\nval_size: 0.1\n", {}, 1,
       {"YAML", "'val_size'", "'val_set_size'", "both hold records out"}},
      {"chat_template_kwargs_list", "", "chat_template_kwargs: [enable_thinking]\n", {}, 1,
       {"YAML", "'chat_template_kwargs'", "a mapping of chat template variables", "{enable_thinking: false}"}},
      {"chat_template_kwargs_messages", "", "chat_template_kwargs:\n  enable_thinking: false\n  messages: []\n", {}, 1,
       {"YAML", "'chat_template_kwargs.messages'", "gets from the data and the run"}},
      {"dataset_and_train_file", "", "train_file: " + kReadme + "\ndatasets:\n  - path: " + kReadme + "\n    type: alpaca\n", {}, 1,
       {"YAML", "'datasets'", "train_file", "keep one"}},
      {"dataset_entry_key", "", "datasets:\n  - path: " + kReadme + "\n    type: alpaca\n    shards: 4\n", {}, 1,
       {"YAML", "'datasets[0].shards'", "{path, type}"}},
      // ---- LLaMA-Factory's dataset + dataset_dir ----
      {"llamafactory_no_dataset_info", "", "dataset: alpaca_en_demo\ndataset_dir: ./no/such/dir\n", {}, 1,
       {"YAML", "'dataset'", "no/such/dir/dataset_info.json is not a file", "relative to the current directory"}},
      {"llamafactory_unknown_dataset", "", kLlamaFactory + "dataset: records, alpaca_en_demo\n", {}, 1,
       {"YAML", "'dataset'", "\"alpaca_en_demo\"", "does not describe", "records, hub"}},
      {"llamafactory_hub_dataset", "", kLlamaFactory + "dataset: hub\n", {}, 1,
       {"dataset_info.json", "'hub.hf_hub_url'", "does not download", "file_name"}},
      {"llamafactory_formatting", "", kLlamaFactory + "dataset: xml\n", {}, 1,
       {"dataset_info.json", "'xml.formatting'", "\"xml\"", "alpaca, sharegpt or openai"}},
      {"llamafactory_ranking", "", kLlamaFactory + "dataset: ranked\n", {}, 1,
       {"dataset_info.json", "'ranked.ranking'", "DPO"}},
      {"llamafactory_images", "", kLlamaFactory + "dataset: images\n", {}, 1,
       {"dataset_info.json", "'images.columns.images'", "multimodal"}},
      {"llamafactory_num_samples", "", kLlamaFactory + "dataset: sampled\n", {}, 1,
       {"dataset_info.json", "'sampled.num_samples'", "max_samples"}},
      {"llamafactory_missing_file", "", kLlamaFactory + "dataset: missing_file\n", {}, 1,
       {"dataset_info.json", "'missing_file.file_name'", "nope.json", "relative to dataset_dir"}},
      {"llamafactory_csv", "", kLlamaFactory + "dataset: csv\n", {}, 1,
       {"dataset_info.json", "'csv.file_name'", "records.csv", ".json and .jsonl"}},
      {"llamafactory_typo", "", kLlamaFactory + "dataset: typo\n", {}, 1,
       {"dataset_info.json", "'typo.colums'", "did you mean 'columns'?"}},
      {"llamafactory_and_datasets", "", kLlamaFactory + "dataset: records\ndatasets:\n  - path: " + kReadme + "\n    type: alpaca\n", {}, 1,
       {"YAML", "'dataset'", "'datasets'", "keep one"}},
      {"test_datasets_and_eval_file", "", "test_datasets:\n  - path: " + kReadme + "\n    type: alpaca\neval_file: " + kReadme + "\n", {}, 1,
       {"YAML", "'test_datasets'", "'eval_file'", "keep one"}},
      {"llamafactory_eval_dataset_and_eval_file", "", kLlamaFactory + "dataset: records\neval_dataset: records\neval_file: " + kReadme + "\n", {}, 1,
       {"YAML", "'eval_dataset'", "'eval_file'", "keep one"}},
      {"llamafactory_eval_dataset_alone", "", "eval_dataset: records\n", {}, 1,
       {"YAML", "'eval_dataset'", "LLaMA-Factory's dataset:"}},
      {"llamafactory_template_alone", "", "template: llama3\n", {}, 1,
       {"YAML", "'template'", "LLaMA-Factory's dataset:"}},
      {"llamafactory_mask_history_and_prompt", "", kLlamaFactory + "dataset: records\nmask_history: true\ntrain_on_prompt: true\n", {}, 1,
       {"YAML", "'train_on_prompt'", "mask_history", "keep one"}},
      {"llamafactory_max_samples", "", kLlamaFactory + "dataset: records\nmax_samples: 0\n", {}, 1,
       {"YAML", "'max_samples'", "positive"}},
      {"llamafactory_mix_strategy", "", kLlamaFactory + "dataset: records\nmix_strategy: interleave_under\n", {}, 1,
       {"YAML", "'mix_strategy'", "concat"}},
      {"llamafactory_stage_sft_without_dataset", "", "stage: sft\n", {}, 1,
       {"YAML", "'stage'", "\"sft\"", "set dataset"}},
      {"llamafactory_stage_pt_with_dataset", "", kLlamaFactory + "dataset: records\nstage: pt\n", {}, 1,
       {"YAML", "'stage'", "\"pt\"", "stage: sft"}},
      {"chat_template_jinja_missing", "", "chat_template: jinja\n", {}, 1,
       {"YAML", "'chat_template'", "jinja", "chat_template_jinja", ".jinja file"}},
      {"chat_template_jinja_not_a_file", "", "chat_template_jinja: ./no/such.jinja\n", {}, 1,
       {"YAML", "'chat_template_jinja'", "./no/such.jinja", "neither a file nor"}},
      {"chat_template_jinja_with_a_name", "", "chat_template: chatml\nchat_template_jinja: \"{{ x }}\"\n", {}, 1,
       {"YAML", "'chat_template_jinja'", "chatml", "chat_template: jinja", "keep one"}},
      {"train_on_inputs_against_completion_only", "", "train_on_inputs: true\ncompletion_only_loss: true\n", {}, 1,
       {"YAML", "'train_on_inputs'", "completion_only_loss", "opposite"}},
      {"gradient_allreduce_sum", "{" + kMbs + R"(, "gradient_allreduce_op": "sum"})", "", {}, 1,
       {"DS", "'gradient_allreduce_op'", "\"mean\""}},
      {"stochastic_round_with_masters", "{" + kMbs + R"(, "bf16": {"enabled": true}, "optimizer": {"type": "AdamW", "params": {"bf16_stochastic_round": true}}})", "", {}, 1,
       {"DS", "'optimizer.params.bf16_stochastic_round'", "without fp32 masters", "bf16_master_weights_and_grads"}},
      // ---- malformed files and values ----
      {"zero_section_not_an_object", "{" + kMbs + R"(, "zero_optimization": 2})", "", {}, 1,
       {"DS", "'zero_optimization'", "expected an object"}},
      {"duplicate_json_key", "{" + kMbs + R"(, "steps_per_print": 10, "steps_per_print": 20})", "", {}, 1,
       {"DS", "'steps_per_print'", "duplicate key", "line 1"}},
      {"broken_json", "{\n" + kMbs + "\n \"steps_per_print\": 10\n}", "", {}, 1,
       {"DS", "invalid JSON", "line 3"}},
      {"broken_yaml", "", "max_steps: [1, 2\nseed: 3\n", {}, 1,
       {"YAML", "invalid YAML"}},
      {"gpt2_with_gqa", "", "model:\n  arch: gpt2\n  n_head: 4\n  n_kv_head: 2\n", {}, 1,
       {"YAML", "'model.n_kv_head'", "grouped-query"}},
      {"heads_do_not_divide_width", "", "model:\n  d_model: 100\n  n_head: 3\n", {}, 1,
       {"YAML", "'model.n_head'", "does not divide d_model 100"}},
      {"block_longer_than_context", "", "model:\n  n_ctx: 64\nblock_size: 128\n", {}, 1,
       {"YAML", "'block_size'", "'model.n_ctx' is 64"}},
      {"unknown_arch", "", "model:\n  arch: mistral\n", {}, 1,
       {"YAML", "'model.arch'", "\"gpt2\" and \"llama\""}},
      {"override_without_dashes", "", "max_steps: 5\n", {"max_steps=20"}, 1,
       {"command line", "--key=value"}},
      {"plugin_without_library", "{" + kMbs + R"(, "plugins": [{"name": "x"}]})", "", {}, 1,
       {"DS", "'plugins[0].library'", "required"}},
      {"plugin_listed_twice", "{" + kMbs + R"(, "plugins": [{"name": "x", "library": "a.so"}, {"name": "x", "library": "b.so"}]})", "", {}, 1,
       {"DS", "'plugins[1].name'", "second time"}},
      {"missing_train_file", "", "train_file: no/such/corpus.txt\n", {}, 1,
       {"YAML", "'train_file'", "does not exist", "built-in corpus"}},
      {"warmup_ratio_out_of_range", "", "warmup_ratio: 1.5\n", {}, 1,
       {"YAML", "'warmup_ratio'", "[0, 1]"}},
      // ---- axolotl's per-group learning rates ----
      {"lr_group_without_lr", "", "lr_groups:\n  - name: attn\n    modules: [q_proj]\n", {}, 1,
       {"YAML", "'lr_groups[0]'", "no \"lr\""}},
      {"lr_group_typo", "", "lr_groups:\n  - name: attn\n    module: [q_proj]\n    lr: 1e-4\n", {}, 1,
       {"YAML", "'lr_groups[0].module'", "did you mean 'modules'?"}},
      {"lr_group_reserved_name", "", "lr_groups:\n  - name: decay\n    modules: [q_proj]\n    lr: 1e-4\n", {}, 1,
       {"YAML", "'lr_groups[0]'", "a name of its own", "decay, no_decay and embeddings"}},
      {"embedding_lr_scale_negative", "", "embedding_lr_scale: -1\n", {}, 1,
       {"YAML", "'embedding_lr_scale'", "positive"}},
      // ---- when to save ----
      {"save_strategy_best", "", "save_strategy: best\n", {}, 1,
       {"YAML", "'save_strategy'", "metric_for_best_model", "\"steps\""}},
      {"save_strategy_unknown", "", "save_strategy: step\n", {}, 1,
       {"YAML", "'save_strategy'", "expected \"steps\", \"epoch\" or \"no\""}},
      {"save_steps_negative", "", "save_steps: -5\n", {}, 1,
       {"YAML", "'save_steps'", ">= 0"}},
      {"saves_per_epoch_and_save_steps", "", "saves_per_epoch: 2\nsave_steps: 10\n", {}, 1,
       {"YAML", "'saves_per_epoch'", "'save_steps'", "remove one"}},
  };
}

class BadConfigs : public ::testing::TestWithParam<BadConfig> {};

TEST_P(BadConfigs, FailWithTheIntendedMessage) {
  const BadConfig& b = GetParam();
  const ConfigSources src = sources(b.ds, b.yaml, b.overrides, b.world_size);
  std::vector<std::string> parts;
  for (const auto& p : b.expected) {
    if (p == "DS") parts.push_back(src.ds_config_path);
    else if (p == "YAML") parts.push_back(src.train_yaml_path);
    else if (p.rfind("YAML", 0) == 0) parts.push_back(src.train_yaml_path + p.substr(4));
    else if (p.rfind("DS", 0) == 0) parts.push_back(src.ds_config_path + p.substr(2));
    else parts.push_back(p);
  }
  const std::string msg = expect_config_error([&] { load_train_config(src); }, parts);
  std::cout << "  " << msg << "\n";
}

INSTANTIATE_TEST_SUITE_P(Config, BadConfigs, ::testing::ValuesIn(bad_configs()),
                         [](const ::testing::TestParamInfo<BadConfig>& p) { return std::string(p.param.name); });

}  // namespace

TEST(BadConfigs, AtLeastTwentyFive) { EXPECT_GE(bad_configs().size(), 25u); }
