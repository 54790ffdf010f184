// Every real ds_config in ../shared/data/ds_configs and every real train.yaml in
// ../shared/data/train_yamls either loads or is rejected with a ConfigError naming a key that is
// present in that file — never a crash or another exception. The expected verdict per file is
// written here, so a silent change in behaviour is caught. Each test prints how many files it
// checked and from where; without the folder it is skipped, saying so.
#include <gtest/gtest.h>

#include <filesystem>
#include <iostream>
#include <map>
#include <set>

#include "config_test_util.h"
#include "memrt/config_node.h"

namespace fs = std::filesystem;
using namespace memrt;

namespace {

const fs::path kShared = fs::path(MEMRT_SOURCE_DIR) / ".." / "shared" / "data";

// Every key path of a tree ("a", "a.b", "a[0].c" -> "a.c" without indices too).
void collect_keys(const ConfigNode& n, std::set<std::string>& out) {
  if (n.is_object()) {
    for (const auto& m : n.members()) {
      out.insert(m.first);
      out.insert(m.second.path());
      collect_keys(m.second, out);
    }
  } else if (n.is_array()) {
    for (const auto& item : n.as_array()) collect_keys(item, out);
  }
}

// The verdict: "" = loads; otherwise the key path the ConfigError names ("missing:<key>" when the
// file lacks a key that is required).
struct Case {
  std::string file;
  std::string rejected_key;
};

// Loads `src`; returns "" or the key path of the ConfigError, checking that the key is in `tree`.
std::string verdict(const ConfigSources& src, const ConfigNode& tree, const std::string& label) {
  try {
    const TrainConfig cfg = load_train_config(src);
    std::cout << "  " << label << ": loads, " << cfg.warnings.size() << " warning(s), " << cfg.plugins.size()
              << " plugin(s)\n";
    return {};
  } catch (const ConfigError& e) {
    const std::string got = e.key_path();
    std::set<std::string> keys;
    collect_keys(tree, keys);
    const std::string top = got.substr(0, got.find_first_of(".["));
    std::cout << "  " << label << ": " << e.what() << "\n";
    if (!keys.count(got) && !keys.count(top)) return "missing:" + got;
    return got;
  } catch (const std::exception& e) {
    ADD_FAILURE() << label << ": not a ConfigError: " << e.what();
    return "<" + std::string(e.what()) + ">";
  }
}

void check(const fs::path& dir, const Case& c, bool is_yaml) {
  SCOPED_TRACE(c.file);
  const fs::path path = dir / c.file;
  ASSERT_TRUE(fs::exists(path)) << path;
  const fs::path scratch = memrt::test::scratch_dir();
  const ConfigNode tree = is_yaml ? parse_yaml_file(path.string()) : parse_json_file(path.string());
  ConfigSources src;
  if (is_yaml) {  // a train.yaml alone
    src.train_yaml_path = path.string();
  } else {        // a ds_config with a minimal train.yaml
    src.ds_config_path = path.string();
    src.train_yaml_path = memrt::test::write_file(scratch / "train.yaml", "max_steps: 10\n");
  }
  EXPECT_EQ(verdict(src, tree, c.file), c.rejected_key);
}

// The real train.yamls all name Hub datasets (or LLaMA-Factory datasets not in the folder) and Hub
// models, which memrt rejects first. To check the
// rest of each file, the same file without those keys (written as JSON, which is YAML) is loaded
// too; its verdict is written separately.
void check_rest(const fs::path& dir, const Case& c) {
  SCOPED_TRACE(c.file + " (without dataset and Hub model keys)");
  ConfigNode tree = parse_yaml_file((dir / c.file).string());
  for (const char* k : {"datasets", "dataset", "dataset_name", "dataset_mixer", "dataset_mixture", "dataset_splits",
                        "model_name_or_path", "base_model", "deepspeed", "max_samples",
                        "stage", "template", "val_set_size", "val_size"}) {  // (LLaMA-Factory's stage: sft and template,
                                                                             // and the held-out split, go with the dataset)
    tree.erase(k);
  }
  const fs::path scratch = memrt::test::scratch_dir();
  ConfigSources src;
  src.train_yaml_path = memrt::test::write_file(scratch / c.file, tree.to_json());
  EXPECT_EQ(verdict(src, tree, c.file + " (rest)"), c.rejected_key);
}

}  // namespace

TEST(RealConfigs, DeepSpeedConfigsLoadOrNameTheKey) {
  const fs::path dir = kShared / "ds_configs";
  if (!fs::is_directory(dir)) GTEST_SKIP() << "shared data folder absent: " << dir;
  const std::vector<Case> cases = {
      {"OpenGVLab__InternVL__internvl_g__zero_stage1_config.json",
       ""},
      {"OpenGVLab__InternVL__segmentation__zero_configs__adam_zero1_amp.json",
       "amp"},
      {"allenai__open-instruct__configs__ds_configs__stage3_no_offloading.conf.json",
       ""},
      {"axolotl-ai-cloud__axolotl__deepspeed_configs__zero1.json",
       ""},
      {"axolotl-ai-cloud__axolotl__deepspeed_configs__zero2_torch_compile.json",
       ""},
      {"axolotl-ai-cloud__axolotl__deepspeed_configs__zero3_bf16.json",
       ""},
      {"bigscience-workshop__Megatron-DeepSpeed__tests__ds_config_cl.json",
       "curriculum_learning"},
      {"deepspeedai__DeepSpeedExamples__benchmarks__autosp__configs__autosp_config.json",
       "sequence_parallel_size"},
      {"deepspeedai__DeepSpeedExamples__compression__gpt2__config__ds_config_W8A8_Qgroup64_fp16.json",
       "compression_training"},
      {"deepspeedai__DeepSpeedExamples__inference__sglang__ds_offload_nvme_aio.json",
       "zero_optimization.stage3_max_live_parameters"},  // "auto", which Hugging Face does not fill
      // zero_optimization's keys are the zero plugin's to check (test_real_configs_plugins).
      {"deepspeedai__DeepSpeedExamples__training__DeepSpeed-ZenFlow__finetuning__zf_config.json",
       ""},
      {"deepspeedai__DeepSpeedExamples__training__MoQ__test.json",
       "quantize_training"},
      {"deepspeedai__DeepSpeedExamples__training__autotuning__hf__dsconfigs__ds_config_fp16_tune.json",
       ""},
      {"deepspeedai__DeepSpeedExamples__training__autotuning__hf__dsconfigs__ds_config_z3.json",
       ""},
      {"deepspeedai__DeepSpeedExamples__training__bf16_master_weight__configs__bf16_full.json",
       "torch_autocast"},
      {"deepspeedai__DeepSpeedExamples__training__bing_bert__01_adam__nccl__deepspeed_bsz4k_01adam_config_seq128_nccl.json",
       "optimizer.type"},
      {"deepspeedai__DeepSpeedExamples__training__bing_bert__1-bit_adam__nccl__deepspeed_bsz4k_onebitadam_config_seq128_nccl.json",
       "optimizer.type"},
      {"deepspeedai__DeepSpeedExamples__training__bing_bert__1-bit_lamb__nccl__deepspeed_bsz64k_onebitlamb_config_seq128_nccl.json",
       "optimizer.type"},
      {"deepspeedai__DeepSpeedExamples__training__bing_bert__deepspeed_bsz4k_progressive_layer_drop_config_seq128.json",
       "progressive_layer_drop"},
      {"deepspeedai__DeepSpeedExamples__training__bing_bert__deepspeed_bsz64k_lamb_config_seq128.json",
       "sparse_attention"},
      {"deepspeedai__DeepSpeedExamples__training__data_efficiency__gpt_finetuning__config__ds_config_gpt_base_random_ltd.json",
       "data_efficiency"},
      {"deepspeedai__DeepSpeedExamples__training__gan__gan_deepspeed_config.json",
       ""},
      {"deepspeedai__DeepSpeedExamples__training__imagenet__config__ds_fp16_z1_config.json",
       "cuda_visible_devices"},
      {"deepspeedai__DeepSpeedExamples__training__pipeline_parallelism__ds_config.json",
       ""},
      {"deepspeedai__DeepSpeedExamples__training__tensor_parallel__hf_integration__configs__ds_config.json",
       "tensor_parallel"},
      {"deepspeedai__DeepSpeed__deepspeed__autotuning__config_templates__template_zero3.json",
       ""},
      {"deepspeedai__DeepSpeed__examples__sdma_allgather__ds_config_zero3.json",
       ""},
      {"deepspeedai__DeepSpeed__tests__model__Megatron_GPT2__ds_config_func_bs8_zero0_gas3.json",
       ""},
      {"deepspeedai__DeepSpeed__tests__model__Megatron_GPT2__ds_config_func_bs8_zero2_offload.json",
       ""},
      {"deepspeedai__DeepSpeed__tests__model__Megatron_GPT2__ds_config_func_scheduler.json",
       ""},
      {"deepspeedai__DeepSpeed__tests__model__Megatron_GPT2__ds_config_perf_bs16.json",
       ""},
      {"deepspeedai__DeepSpeed__tests__torch_compile__ds_config_z3_deepcompile_no_persist.json",
       ""},
      {"haotian-liu__LLaVA__scripts__zero2.json",
       ""},
      {"hiyouga__LLaMA-Factory__examples__deepspeed__ds_z0_config.json",
       ""},
      {"hiyouga__LLaMA-Factory__examples__deepspeed__ds_z2_autotp_config.json",
       "tensor_parallel"},
      {"hiyouga__LLaMA-Factory__examples__deepspeed__ds_z2_offload_config.json",
       ""},
      {"hiyouga__LLaMA-Factory__examples__deepspeed__ds_z3_config.json",
       ""},
      {"hiyouga__LLaMA-Factory__examples__deepspeed__ds_z3_fp8_config.json",
       ""},
      {"huggingface__accelerate__examples__alst_ulysses_sequence_parallelism__sp-alst.ds-config.json",
       ""},
      {"huggingface__accelerate__examples__deepspeed_config_templates__zero_stage3_offload_config.json",
       ""},
      {"huggingface__accelerate__tests__deepspeed__ds_config_zero3.json",
       ""},
      {"lm-sys__FastChat__playground__deepspeed_config_s2.json",
       ""},
      {"microsoft__Megatron-DeepSpeed__examples_deepspeed__curriculum_learning__ds_zero_stage_1_config_baseline.json",
       "optimizer.params.max_grad_norm"},
  };
  std::set<std::string> listed;
  for (const auto& c : cases) {
    listed.insert(c.file);
    check(dir, c, false);
  }
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().filename() == "INDEX.md") continue;
    EXPECT_TRUE(listed.count(e.path().filename().string())) << "no verdict written for " << e.path().filename();
  }
  std::cout << "checked " << cases.size() << " ds_configs from " << dir.lexically_normal().string() << "\n";
}

TEST(RealConfigs, TrainYamlsLoadOrNameTheKey) {
  const fs::path dir = kShared / "train_yamls";
  if (!fs::is_directory(dir)) GTEST_SKIP() << "shared data folder absent: " << dir;
  const std::vector<Case> cases = {
      {"axolotl-ai-cloud__axolotl__examples__archived__openllama-3b__qlora.yml",
       "gptq_groupsize"},
      {"axolotl-ai-cloud__axolotl__examples__gemma3__gemma-3-1b-qlora.yml",
       "unfrozen_parameters"},
      {"axolotl-ai-cloud__axolotl__examples__jamba__qlora_deepspeed.yaml",
       "missing:"},
      {"axolotl-ai-cloud__axolotl__examples__llama-2__qlora.yml",
       "base_model"},
      {"axolotl-ai-cloud__axolotl__examples__llama-3__lora-1b.yml",
       "base_model"},
      {"hiyouga__LLaMA-Factory__examples__train_lora__qwen3_lora_sft_ds3.yaml",
       "missing:"},
      {"hiyouga__LLaMA-Factory__examples__train_qlora__qwen3_lora_sft_otfq.yaml",
       "model_name_or_path"},
      {"huggingface__alignment-handbook__recipes__zephyr-7b-beta__dpo__config_qlora.yaml",
       "dataset_mixer"},
      {"huggingface__alignment-handbook__recipes__zephyr-7b-beta__sft__config_qlora.yaml",
       "dataset_mixture"},
      {"huggingface__trl__examples__cli_configs__example_config.yaml",  // (its dataset_name is a Hub name too)
       "model_name_or_path"},
  };
  std::set<std::string> listed;
  for (const auto& c : cases) {
    listed.insert(c.file);
    check(dir, c, true);
  }
  const std::vector<Case> rest = {
      {"axolotl-ai-cloud__axolotl__examples__archived__openllama-3b__qlora.yml",
       "gptq_groupsize"},
      {"axolotl-ai-cloud__axolotl__examples__gemma3__gemma-3-1b-qlora.yml",
       "unfrozen_parameters"},
      {"axolotl-ai-cloud__axolotl__examples__jamba__qlora_deepspeed.yaml",
       ""},
      {"axolotl-ai-cloud__axolotl__examples__llama-2__qlora.yml",
       ""},
      {"axolotl-ai-cloud__axolotl__examples__llama-3__lora-1b.yml",
       ""},
      {"hiyouga__LLaMA-Factory__examples__train_lora__qwen3_lora_sft_ds3.yaml",
       ""},
      {"hiyouga__LLaMA-Factory__examples__train_qlora__qwen3_lora_sft_otfq.yaml",
       ""},
      {"huggingface__alignment-handbook__recipes__zephyr-7b-beta__dpo__config_qlora.yaml",
       "beta"},
      {"huggingface__alignment-handbook__recipes__zephyr-7b-beta__sft__config_qlora.yaml",
       ""},
      {"huggingface__trl__examples__cli_configs__example_config.yaml",
       ""},
  };
  for (const auto& c : rest) check_rest(dir, c);
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().filename() == "INDEX.md") continue;
    EXPECT_TRUE(listed.count(e.path().filename().string())) << "no verdict written for " << e.path().filename();
  }
  std::cout << "checked " << cases.size() << " train.yamls (and " << rest.size()
            << " of them again without their Hub keys) from " << dir.lexically_normal().string() << "\n";
}
