// load_train_config: DeepSpeed's semantics where the ds_config speaks, Hugging Face's where
// train.yaml speaks. Expected values are derived by hand from reference/deepspeed.md and Hugging
// Face's TrainingArguments defaults (cited beside each).
#include <gtest/gtest.h>

#include <cmath>

#include "config/batch_triple.h"
#include "load_helper.h"

using namespace memrt;
using namespace memrt::test;

// ---- the batch triple, deepspeed.md §1.1, row by row --------------------------------------------

TEST(BatchTriple, DerivationTableRowByRow) {
  BatchTriple b;
  // all three: only asserted
  EXPECT_EQ(derive_batch_triple(32, 4, 4, 2, b), "");
  EXPECT_EQ(b.train_batch_size, 32);
  // TBS, MBS: GAS = (TBS // MBS) // N
  EXPECT_EQ(derive_batch_triple(64, 4, std::nullopt, 4, b), "");
  EXPECT_EQ(b.grad_accum_steps, 4);
  // TBS, GAS: MBS = (TBS // N) // GAS
  EXPECT_EQ(derive_batch_triple(64, std::nullopt, 2, 4, b), "");
  EXPECT_EQ(b.micro_batch_size, 8);
  // MBS, GAS: TBS = MBS * GAS * N
  EXPECT_EQ(derive_batch_triple(std::nullopt, 3, 5, 2, b), "");
  EXPECT_EQ(b.train_batch_size, 30);
  // TBS only: GAS = 1, MBS = TBS // N
  EXPECT_EQ(derive_batch_triple(48, std::nullopt, std::nullopt, 3, b), "");
  EXPECT_EQ(b.grad_accum_steps, 1);
  EXPECT_EQ(b.micro_batch_size, 16);
  // MBS only: GAS = 1, TBS = MBS * N
  EXPECT_EQ(derive_batch_triple(std::nullopt, 6, std::nullopt, 4, b), "");
  EXPECT_EQ(b.train_batch_size, 24);
  EXPECT_EQ(b.grad_accum_steps, 1);
  // GAS only / none
  EXPECT_NE(derive_batch_triple(std::nullopt, std::nullopt, 4, 1, b).find("either train_batch_size or train_micro_batch_size_per_gpu"), std::string::npos);
  EXPECT_NE(derive_batch_triple(std::nullopt, std::nullopt, std::nullopt, 1, b).find("needs to be provided"), std::string::npos);
}

TEST(BatchTriple, FloorDivisionIsCaughtByTheProductRule) {
  BatchTriple b;
  // The reference's example: TBS=10, MBS=3, N=1 -> GAS=3 -> 10 != 3 * 3 * 1.
  EXPECT_EQ(derive_batch_triple(10, 3, std::nullopt, 1, b),
            "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size: 10 != 3 * 3 * 1");
  EXPECT_EQ(derive_batch_triple(16, 8, 1, 1, b),
            "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size: 16 != 8 * 1 * 1");
}

TEST(BatchTriple, ZeroAfterDerivationIsAnError) {
  BatchTriple b;
  EXPECT_NE(derive_batch_triple(1, std::nullopt, std::nullopt, 2, b).find("train_micro_batch_size_per_gpu: 0 has to be greater than 0"), std::string::npos);
  EXPECT_NE(derive_batch_triple(4, 8, std::nullopt, 1, b).find("gradient_accumulation_steps: 0 has to be greater than 0"), std::string::npos);
  EXPECT_NE(derive_batch_triple(std::nullopt, 4, 1, 0, b).find("world size must be positive"), std::string::npos);
}

TEST(Batch, WorldSizeEntersTheRule) {
  const std::string ds = R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 16})";
  const TrainConfig two = load(ds, "max_steps: 5\n", {}, 2);
  EXPECT_EQ(two.grad_accum_steps, 1);
  const TrainConfig one = load(ds, "max_steps: 5\n", {}, 1);
  EXPECT_EQ(one.grad_accum_steps, 2);  // (32 // 16) // 1
}

TEST(Batch, AutoFromTrainYamlAndHuggingFaceDefaults) {
  const std::string ds = R"({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                             "gradient_accumulation_steps": "auto"})";
  const TrainConfig c = load(ds, "per_device_train_batch_size: 4\ngradient_accumulation_steps: 3\n", {}, 2);
  EXPECT_EQ(c.micro_batch_size, 4);
  EXPECT_EQ(c.grad_accum_steps, 3);
  EXPECT_EQ(c.train_batch_size, 24);  // world_size * per_device * GAS
  const TrainConfig d = load(ds, "max_steps: 3\n", {}, 1);
  EXPECT_EQ(d.micro_batch_size, 8);  // TrainingArguments.per_device_train_batch_size default
  EXPECT_EQ(d.grad_accum_steps, 1);
  EXPECT_EQ(d.train_batch_size, 8);
}

TEST(Batch, AliasesFromOtherTools) {
  const TrainConfig c = load("", "micro_batch_size: 2\ngradient_accumulation_steps: 4\nnum_epochs: 2\n"
                                 "sequence_len: 64\nlr_scheduler: cosine\noptimizer: adamw_torch\n");
  EXPECT_EQ(c.micro_batch_size, 2);
  EXPECT_EQ(c.train_batch_size, 8);
  EXPECT_DOUBLE_EQ(c.num_train_epochs, 2.0);
  EXPECT_EQ(c.data.block_size, 64);
  EXPECT_EQ(c.scheduler.type, "cosine");
  EXPECT_EQ(c.optimizer.type, "AdamW");
}

// ---- the shipped configs ------------------------------------------------------------------------

TEST(Shipped, MainJob) {
  ConfigSources s;
  s.ds_config_path = source("configs/ds_config.json");
  s.train_yaml_path = source("configs/train.yaml");
  const TrainConfig c = load_train_config(s);
  EXPECT_EQ(c.micro_batch_size, 16);
  EXPECT_EQ(c.grad_accum_steps, 1);
  EXPECT_EQ(c.train_batch_size, 16);
  EXPECT_EQ(c.max_steps, 200);
  EXPECT_EQ(c.steps_per_print, 10);
  EXPECT_DOUBLE_EQ(c.gradient_clipping, 1.0);
  EXPECT_EQ(c.optimizer.type, "AdamW");
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 1e-3);
  EXPECT_DOUBLE_EQ(c.optimizer.weight_decay, 0.1);
  EXPECT_EQ(c.scheduler.type, "WarmupCosineLR");
  EXPECT_EQ(c.scheduler.warmup_num_steps, 20);
  EXPECT_EQ(c.scheduler.total_num_steps, 200);
  EXPECT_EQ(c.scheduler.warmup_type, "linear");
  EXPECT_EQ(c.model.shape.arch, "gpt2");
  EXPECT_EQ(c.model.shape.n_layer, 4);
  EXPECT_EQ(c.model.shape.n_head, 4);
  EXPECT_EQ(c.model.shape.d_model, 256);
  EXPECT_EQ(c.model.shape.d_ff, 1024);
  EXPECT_EQ(c.model.shape.vocab_size, 256);
  EXPECT_EQ(c.model.shape.n_ctx, 128);
  EXPECT_EQ(c.data.block_size, 128);
  EXPECT_TRUE(c.data.train_files.empty());
  EXPECT_EQ(c.output_dir, "output/main");
  EXPECT_EQ(c.compute_dtype, "fp32");
  EXPECT_TRUE(c.plugins.empty());
  EXPECT_TRUE(c.warnings.empty());
}

TEST(Shipped, EveryExampleLoads) {
  struct Pair { const char* ds; const char* yaml; int n; };
  for (const Pair& p : {Pair{"configs/ds_config.json", "configs/train_llama.yaml", 1},
                        Pair{"configs/ds_auto.json", "configs/train_hf.yaml", 1},
                        Pair{"configs/ds_zero0_2rank.json", "configs/train.yaml", 2},
                        Pair{"configs/ds_zero3_offload.json", "configs/train_llama.yaml", 1},
                        Pair{"configs/ds_fp16.json", "configs/train_llama.yaml", 1},
                        Pair{"configs/ds_qlora.json", "configs/train_qlora.yaml", 1}}) {
    SCOPED_TRACE(std::string(p.ds) + " + " + p.yaml);
    ConfigSources s;
    s.ds_config_path = source(p.ds);
    s.train_yaml_path = source(p.yaml);
    s.world_size = p.n;
    TrainConfig c;
    ASSERT_NO_THROW(c = load_train_config(s));
    EXPECT_EQ(c.train_batch_size, c.micro_batch_size * c.grad_accum_steps * p.n);
  }
}

TEST(Shipped, TwoRankConfigIsRejectedOnOneRankWithTheEquation) {
  ConfigSources s;
  s.ds_config_path = source("configs/ds_zero0_2rank.json");
  s.train_yaml_path = source("configs/train.yaml");
  expect_config_error([&] { load_train_config(s); },
                      {"ds_zero0_2rank.json", "train.yaml", "N = 1", "32 != 16 * 1 * 1"});
}

TEST(Shipped, LlamaBlock) {
  ConfigSources s;
  s.ds_config_path = source("configs/ds_config.json");
  s.train_yaml_path = source("configs/train_llama.yaml");
  const TrainConfig c = load_train_config(s);
  EXPECT_EQ(c.model.shape.arch, "llama");
  EXPECT_EQ(c.model.shape.n_kv_head, 2);
  EXPECT_EQ(c.model.shape.d_ff, 768);
  EXPECT_FALSE(c.model.shape.tie_embeddings);
  EXPECT_EQ(c.train_batch_size, 16);
}

// ---- "auto" resolved from train.yaml with Hugging Face's table ------------------------------------

TEST(Auto, HuggingFaceStyleConfig) {
  ConfigSources s;
  s.ds_config_path = source("configs/ds_auto.json");
  s.train_yaml_path = source("configs/train_hf.yaml");
  const TrainConfig c = load_train_config(s);
  EXPECT_EQ(c.train_batch_size, 16);
  EXPECT_DOUBLE_EQ(c.gradient_clipping, 0.5);  // max_grad_norm
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 5e-4);
  EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.95);
  EXPECT_DOUBLE_EQ(c.optimizer.eps, 1e-8);
  EXPECT_DOUBLE_EQ(c.optimizer.weight_decay, 0.01);
  EXPECT_EQ(c.scheduler.type, "WarmupDecayLR");
  EXPECT_DOUBLE_EQ(c.scheduler.warmup_min_lr, 0.0);
  EXPECT_DOUBLE_EQ(c.scheduler.warmup_max_lr, 5e-4);
  EXPECT_EQ(c.scheduler.warmup_num_steps, 10);  // ceil(0.1 * 100)
  EXPECT_EQ(c.scheduler.total_num_steps, 100);
  EXPECT_EQ(c.compute_dtype, "bf16");
  const PluginSpec* prec = plugin(c, "precision");
  ASSERT_NE(prec, nullptr);
  EXPECT_TRUE(prec->options.at_path("bf16.enabled")->as_bool());
  EXPECT_FALSE(prec->options.at_path("fp16.enabled")->as_bool());  // present, off
  const PluginSpec* zero = plugin(c, "zero");
  ASSERT_NE(zero, nullptr);
  EXPECT_EQ(c.zero_stage, 2);
  EXPECT_EQ(zero->options.at_path("zero_optimization.reduce_bucket_size")->as_int(), 256 * 256);  // h*h
}

TEST(Auto, DefaultsWhenTrainYamlIsSilent) {
  const std::string ds = R"({"train_micro_batch_size_per_gpu": 2, "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}}})";
  const TrainConfig c = load(ds, "max_steps: 50\n");
  EXPECT_DOUBLE_EQ(c.gradient_clipping, 1.0);      // max_grad_norm default
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 5e-5);          // learning_rate default
  EXPECT_DOUBLE_EQ(c.optimizer.beta1, 0.9);
  EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.999);
  EXPECT_DOUBLE_EQ(c.optimizer.eps, 1e-8);
  EXPECT_DOUBLE_EQ(c.optimizer.weight_decay, 0.0);
  EXPECT_DOUBLE_EQ(c.scheduler.warmup_max_lr, 5e-5);
  EXPECT_EQ(c.scheduler.warmup_num_steps, 0);
}

// The chunked head: memrt's key, and the Liger kernel switches of Hugging Face's Trainer,
// LLaMA-Factory and axolotl (the fused linear cross-entropy is the one that changes memory); off
// by default, as in each of them.
TEST(TrainYaml, ChunkedCrossEntropyAndTheLigerSwitches) {
  const std::string ds = R"({"train_micro_batch_size_per_gpu": 2})";
  EXPECT_FALSE(load(ds, "max_steps: 5\n").chunked_cross_entropy);
  for (const char* key : {"chunked_cross_entropy", "use_liger_kernel", "enable_liger_kernel",
                          "liger_fused_linear_cross_entropy"}) {
    EXPECT_TRUE(load(ds, std::string(key) + ": true\n").chunked_cross_entropy) << key;
    EXPECT_FALSE(load(ds, std::string(key) + ": false\n").chunked_cross_entropy) << key;
  }
  EXPECT_TRUE(load(ds, "use_liger_kernel: false\n", {"--chunked_cross_entropy=true"}).chunked_cross_entropy);
}

// DeepSpeed's flops_profiler: enabled, profile_step and output_file are read; the module-tree keys
// are noted only when the profiler is on (HF's example files carry a disabled section); step 0 is
// an error naming the key.
TEST(DsConfig, FlopsProfilerSection) {
  const std::string yaml = "max_steps: 5\n";
  const TrainConfig off = load(R"({"train_micro_batch_size_per_gpu": 2, "flops_profiler": {"enabled": false,
      "profile_step": 1, "module_depth": -1, "top_modules": 1, "detailed": true, "output_file": null}})", yaml);
  EXPECT_FALSE(off.flops_profiler.enabled);
  EXPECT_TRUE(off.warnings.empty()) << off.warnings.front();
  const TrainConfig on = load(R"({"train_micro_batch_size_per_gpu": 2, "flops_profiler": {"enabled": true,
      "profile_step": 3, "top_modules": 1, "output_file": "p.txt"}})", yaml);
  EXPECT_TRUE(on.flops_profiler.enabled);
  EXPECT_EQ(on.flops_profiler.profile_step, 3);
  EXPECT_EQ(on.flops_profiler.output_file, "p.txt");
  ASSERT_EQ(on.warnings.size(), 1u);
  EXPECT_NE(on.warnings[0].find("flops_profiler.top_modules"), std::string::npos) << on.warnings[0];
  expect_config_error([&] { load(R"({"flops_profiler": {"enabled": true, "profile_step": 0}})", yaml); },
                      {"flops_profiler.profile_step", "at least 1"});
  expect_config_error([&] { load(R"({"flops_profiler": {"enabled": true, "profile_steps": 2}})", yaml); },
                      {"profile_steps"});
}

// Saving and evaluating: Hugging Face's defaults (save_strategy steps, save_steps 500), a fraction of
// the run, axolotl's saves_per_epoch, and an unquoted `no` (YAML's false) as "no".
TEST(Saving, StrategiesAndTheirDefaults) {
  const std::string ds = R"({"train_micro_batch_size_per_gpu": 2})";
  const TrainConfig d = load(ds, "max_steps: 5\n");
  EXPECT_EQ(d.save_strategy, "steps");
  EXPECT_EQ(d.save_steps, 500);
  EXPECT_DOUBLE_EQ(load(ds, "max_steps: 5\nsave_steps: 0.1\n").save_steps, 0.1);
  EXPECT_EQ(load(ds, "max_steps: 5\nsaves_per_epoch: 4\n").saves_per_epoch, 4);
  const TrainConfig no = load(ds, "max_steps: 5\nsave_strategy: no\neval_strategy: no\neval_steps: 2\n");
  EXPECT_EQ(no.save_strategy, "no");
  EXPECT_EQ(no.eval.steps, 0) << "eval_strategy no: only after the last step";
}

TEST(Auto, WarmupFromRatioWaitsForEpochSteps) {
  const std::string ds = R"({"train_micro_batch_size_per_gpu": 2,
    "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": "auto", "total_num_steps": "auto"}}})";
  const TrainConfig c = load(ds, "num_train_epochs: 2\nwarmup_ratio: 0.1\n");
  EXPECT_EQ(c.max_steps, -1);
  EXPECT_EQ(c.scheduler.total_num_steps, -1);
  EXPECT_EQ(c.scheduler.warmup_num_steps, -1);
  EXPECT_DOUBLE_EQ(c.scheduler.warmup_ratio, 0.1);
  const TrainConfig d = load(ds, "max_steps: 33\nwarmup_ratio: 0.1\n");
  EXPECT_EQ(d.scheduler.warmup_num_steps, 4);  // ceil(3.3)
  const TrainConfig e = load(ds, "max_steps: 33\nwarmup_ratio: 0.1\nwarmup_steps: 7\n");
  EXPECT_EQ(e.scheduler.warmup_num_steps, 7);  // warmup_steps wins, as in Hugging Face
  EXPECT_TRUE(has_warning(e, "warmup_ratio"));
}

TEST(Auto, ZeroBucketSizesFromTheModelWidth) {
  const std::string ds = R"({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3,
    "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"}})";
  const TrainConfig c = load(ds, "model:\n  d_model: 64\n  n_head: 4\n");
  const ConfigNode& z = *plugin(c, "zero")->options.find("zero_optimization");
  EXPECT_EQ(z.find("reduce_bucket_size")->as_int(), 4096);              // h*h
  EXPECT_EQ(z.find("stage3_prefetch_bucket_size")->as_int(), 3686);     // floor(0.9*h*h)
  EXPECT_EQ(z.find("stage3_param_persistence_threshold")->as_int(), 640);  // 10*h
}

TEST(Auto, Fp16EnabledFromTrainYaml) {
  const std::string ds = R"({"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": "auto", "loss_scale": 0,
    "initial_scale_power": 12}, "bf16": {"enabled": "auto"}})";
  const TrainConfig c = load(ds, "fp16: true\n");
  EXPECT_EQ(c.compute_dtype, "fp16");
  const PluginSpec* p = plugin(c, "precision");
  ASSERT_NE(p, nullptr);
  EXPECT_TRUE(p->options.at_path("fp16.enabled")->as_bool());
  EXPECT_EQ(p->options.at_path("fp16.initial_scale_power")->as_int(), 12);
  EXPECT_FALSE(p->options.at_path("bf16.enabled")->as_bool());
  EXPECT_EQ(p->config_keys.size(), 2u);
}

// ---- optimizer and scheduler -------------------------------------------------------------------

TEST(Optimizer, DeepSpeedAdamIsAdamWUnlessAdamWModeIsFalse) {
  const TrainConfig a = load(R"({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "adam",
    "params": {"lr": 2e-4, "weight_decay": 0.01, "bias_correction": false, "torch_adam": true}}})", "max_steps: 1\n");
  EXPECT_EQ(a.optimizer.type, "Adam");
  EXPECT_TRUE(a.optimizer.adam_w_mode);
  EXPECT_FALSE(a.optimizer.bias_correction);
  const TrainConfig b = load(R"({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam",
    "params": {"adam_w_mode": false}}})", "max_steps: 1\n");
  EXPECT_FALSE(b.optimizer.adam_w_mode);
  EXPECT_DOUBLE_EQ(b.optimizer.lr, 1e-3);  // FusedAdam's default lr
}

TEST(Optimizer, SgdParams) {
  const TrainConfig c = load(R"({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD",
    "params": {"lr": 0.1, "momentum": 0.9, "nesterov": true, "weight_decay": 1e-4}}})", "max_steps: 1\n");
  EXPECT_EQ(c.optimizer.type, "SGD");
  EXPECT_DOUBLE_EQ(c.optimizer.momentum, 0.9);
  EXPECT_TRUE(c.optimizer.nesterov);
}

TEST(Optimizer, FromTrainYamlWhenTheDsConfigHasNone) {
  const TrainConfig c = load(R"({"train_micro_batch_size_per_gpu": 1})",
                             "optim: adamw_torch_fused\nlearning_rate: 3e-4\nadam_beta2: 0.95\nweight_decay: 0.1\n");
  EXPECT_EQ(c.optimizer.type, "AdamW");
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 3e-4);
  EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.95);
  EXPECT_EQ(plugin(c, "quant"), nullptr);
  const TrainConfig s = load("", "optim: sgd\n");
  EXPECT_EQ(s.optimizer.type, "SGD");
}

TEST(Optimizer, EightBitOptimizerLoadsTheQuantPlugin) {
  const TrainConfig c = load("", "optim: paged_adamw_8bit\n");
  EXPECT_EQ(c.optimizer.type, "AdamW");
  const PluginSpec* q = plugin(c, "quant");
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(q->options.find("optim")->as_string(), "paged_adamw_8bit");
  // The ds_config route: a low-bit optim with the ds_config's AdamW, whose hyper-parameters it takes.
  const TrainConfig d = load(R"({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW",
                                 "params": {"lr": 2e-4, "betas": [0.8, 0.95], "weight_decay": 0.05}}})",
                             "optim: adamw_torch_4bit\n");
  EXPECT_EQ(d.optimizer.type, "AdamW");
  EXPECT_DOUBLE_EQ(d.optimizer.lr, 2e-4);
  EXPECT_DOUBLE_EQ(d.optimizer.beta1, 0.8);
  EXPECT_DOUBLE_EQ(d.optimizer.weight_decay, 0.05);
  ASSERT_NE(plugin(d, "quant"), nullptr);
  EXPECT_EQ(plugin(d, "quant")->options.find("optim")->as_string(), "adamw_torch_4bit");
}

// axolotl's per-group learning rates go to the optimizer's group rules (store/host_groups.h), with
// the list as written; --print-config shows them.
TEST(Optimizer, AxolotlLrGroupsAndEmbeddingLr) {
  const TrainConfig c = load("", "learning_rate: 1e-4\nembedding_lr: 1e-5\nlr_groups:\n"
                                 "  - name: attn\n    modules: [self_attn.q_proj, self_attn.k_proj]\n    lr: 3e-4\n"
                                 "  - name: mlp\n    modules: mlp.down_proj\n    lr: 5e-5\n");
  const GroupRules& g = c.optimizer.groups;
  EXPECT_DOUBLE_EQ(g.embedding_lr, 1e-5);
  EXPECT_EQ(g.embedding_lr_scale, 0.0);
  ASSERT_EQ(g.lr_groups.size(), 2u);
  EXPECT_EQ(g.lr_groups[0].name, "attn");
  EXPECT_EQ(g.lr_groups[0].modules, (std::vector<std::string>{"self_attn.q_proj", "self_attn.k_proj"}));
  EXPECT_DOUBLE_EQ(g.lr_groups[0].lr, 3e-4);
  EXPECT_EQ(g.lr_groups[1].modules, (std::vector<std::string>{"mlp.down_proj"}));
  EXPECT_NE(g.file.find("train.yaml"), std::string::npos);
  const std::string json = resolved_config_json(c);
  EXPECT_NE(json.find("\"lr_groups\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"embedding_lr\""), std::string::npos) << json;
  // Both embedding keys: axolotl takes the scale, and says nothing; memrt warns.
  const TrainConfig both = load("", "embedding_lr: 1e-5\nembedding_lr_scale: 0.5\n");
  EXPECT_TRUE(has_warning(both, "embedding_lr"));
  EXPECT_DOUBLE_EQ(both.optimizer.groups.embedding_lr_scale, 0.5);
}

TEST(Optimizer, AbsentDsParamsTakeExplicitTrainYamlValues) {
  const TrainConfig c = load(R"({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"}})",
                             "learning_rate: 2e-4\n");
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 2e-4);
}

TEST(Scheduler, HuggingFaceTypesWhenTheDsConfigHasNone) {
  const TrainConfig lin = load("", "max_steps: 100\nwarmup_steps: 5\n");
  EXPECT_EQ(lin.scheduler.type, "linear");  // TrainingArguments default
  EXPECT_EQ(lin.scheduler.warmup_num_steps, 5);
  EXPECT_EQ(lin.scheduler.total_num_steps, 100);
  EXPECT_DOUBLE_EQ(lin.scheduler.warmup_max_lr, 5e-5);
  const TrainConfig cw = load("", "max_steps: 100\nwarmup_ratio: 0.05\nlr_scheduler_type: constant_with_warmup\n");
  EXPECT_EQ(cw.scheduler.type, "constant_with_warmup");
  EXPECT_EQ(cw.scheduler.warmup_num_steps, 5);
}

TEST(Scheduler, WarmupLRDefaults) {
  const TrainConfig c = load(R"({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    "scheduler": {"type": "WarmupLR"}})", "max_steps: 10\n");
  EXPECT_EQ(c.scheduler.warmup_num_steps, 1000);   // DeepSpeed default
  EXPECT_DOUBLE_EQ(c.scheduler.warmup_max_lr, 0.01);  // null -> optimizer lr (v0.17.2+)
  EXPECT_EQ(c.scheduler.warmup_type, "log");
  const TrainConfig d = load(R"({"train_micro_batch_size_per_gpu": 1, "scheduler": {"type": "WarmupDecayLR",
    "params": {"total_num_steps": 500}}})", "");
  EXPECT_DOUBLE_EQ(d.scheduler.warmup_max_lr, 0.001);  // WarmupDecayLR's own default
  EXPECT_EQ(d.scheduler.total_num_steps, 500);
  const TrainConfig e = load(R"({"train_micro_batch_size_per_gpu": 1, "scheduler": {"type": "WarmupCosineLR",
    "params": {"total_num_steps": 500, "warmup_num_steps": 10, "warmup_min_ratio": 0.1}}})", "");
  EXPECT_DOUBLE_EQ(e.scheduler.cos_min_ratio, 1e-4);
  EXPECT_DOUBLE_EQ(e.scheduler.warmup_min_ratio, 0.1);
}

// ---- plugin sections --------------------------------------------------------------------------

TEST(Plugins, PrecisionFromTrainYamlAlone) {
  const TrainConfig c = load("", "bf16: true\n");
  const PluginSpec* p = plugin(c, "precision");
  ASSERT_NE(p, nullptr);
  EXPECT_TRUE(p->options.at_path("bf16.enabled")->as_bool());
  EXPECT_EQ(c.compute_dtype, "bf16");
  EXPECT_EQ(plugin(load("", "max_steps: 1\n"), "precision"), nullptr);
}

TEST(Plugins, PrecisionPresentWhenDisabled) {
  const TrainConfig c = load(R"({"train_micro_batch_size_per_gpu": 1, "bfloat16": {"enabled": false}})", "");
  const PluginSpec* p = plugin(c, "precision");
  ASSERT_NE(p, nullptr);
  EXPECT_FALSE(p->options.at_path("bf16.enabled")->as_bool());  // the old name is normalised
  EXPECT_EQ(c.compute_dtype, "fp32");
}

// The loader routes zero_optimization to plugins/zero (tests/plugins/test_zero_config.cpp checks
// its keys there) after the legacy boolean form and the stage, which RunInfo carries.
TEST(Plugins, ZeroSectionIsRoutedWithItsStage) {
  const TrainConfig c = load(R"({"train_micro_batch_size_per_gpu": 1, "zero_optimization": true})", "");
  EXPECT_EQ(c.zero_stage, 1);
  EXPECT_TRUE(has_warning(c, "deprecated"));
  EXPECT_EQ(plugin(c, "zero")->options.at_path("zero_optimization.stage")->as_int(), 1);
  const std::string ds = R"({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "cpu_offload": true,
    "max_live_parameters": 1e9}})";
  const TrainConfig d = load(ds, "");
  EXPECT_EQ(d.zero_stage, 2);
  const ConfigNode& z = *plugin(d, "zero")->options.find("zero_optimization");
  EXPECT_EQ(z.to_json(0), parse_json_text(ds, "ds.json").find("zero_optimization")->to_json(0));  // as written
  EXPECT_EQ(load(R"({"train_micro_batch_size_per_gpu": 1})", "").zero_stage, 0);
  EXPECT_EQ(plugin(load(R"({"train_micro_batch_size_per_gpu": 1})", ""), "zero"), nullptr);
}

TEST(Plugins, CheckpointFromSectionOrTrainYaml) {
  const TrainConfig a = load("", "gradient_checkpointing: true\ngradient_checkpointing_kwargs:\n  use_reentrant: false\n");
  const PluginSpec* p = plugin(a, "checkpoint");
  ASSERT_NE(p, nullptr);
  EXPECT_TRUE(p->options.find("gradient_checkpointing")->as_bool());
  EXPECT_FALSE(p->options.at_path("gradient_checkpointing_kwargs.use_reentrant")->as_bool());
  const TrainConfig b = load(R"({"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": {"cpu_checkpointing": true,
    "contiguous_memory_optimization": false}})", "");
  EXPECT_TRUE(plugin(b, "checkpoint")->options.at_path("activation_checkpointing.cpu_checkpointing")->as_bool());
  EXPECT_TRUE(plugin(b, "checkpoint")->options.find("gradient_checkpointing")->as_bool());
  EXPECT_TRUE(has_warning(b, "contiguous_memory_optimization"));
  EXPECT_EQ(plugin(load("", "gradient_checkpointing: false\n"), "checkpoint"), nullptr);
}

TEST(Plugins, LoraKeysAndAliases) {
  const TrainConfig a = load("", "adapter: lora\nlora_rank: 8\nlora_alpha: 16\nlora_dropout: 0.05\nlora_target: q_proj, v_proj\n");
  const PluginSpec* p = plugin(a, "lora");
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->options.find("lora_r")->as_int(), 8);
  EXPECT_EQ(p->options.at_path("lora_target_modules[1]")->as_string(), "v_proj");
  const TrainConfig b = load("", "use_peft: true\nlora_r: 4\nlora_target_linear: true\n");
  EXPECT_EQ(plugin(b, "lora")->options.find("lora_target_modules")->as_string(), "all-linear");
  const TrainConfig c = load("", "finetuning_type: lora\nlora_target: all\n");
  EXPECT_EQ(plugin(c, "lora")->options.find("lora_target_modules")->as_string(), "all-linear");
  const TrainConfig d = load("", "use_peft: false\nlora_r: 4\n");
  EXPECT_EQ(plugin(d, "lora"), nullptr);
  EXPECT_TRUE(has_warning(d, "turns LoRA off"));
  // A string with a regular expression's characters is PEFT's full-match regex (axolotl passes
  // its string through), kept whole; a plain string is a comma-separated list.
  const TrainConfig e = load("", "adapter: lora\nlora_target_modules: 'model\\.layers\\.[01]\\.self_attn\\.(q|v)_proj'\n");
  EXPECT_EQ(plugin(e, "lora")->options.find("lora_target_modules")->as_string(), R"(model\.layers\.[01]\.self_attn\.(q|v)_proj)");
  const TrainConfig f = load("", "adapter: lora\nlora_target_modules: self_attn.q_proj,v_proj\n");
  EXPECT_EQ(plugin(f, "lora")->options.at_path("lora_target_modules[0]")->as_string(), "self_attn.q_proj");
}

// LLaMA-Factory's freeze tuning goes to plugins/lora, which owns finetuning_type and freeze_*.
TEST(Plugins, FreezeTuningKeysGoToTheLoraPlugin) {
  const TrainConfig a = load("", "finetuning_type: freeze\nfreeze_trainable_layers: -3\n"
                                 "freeze_trainable_modules: mlp,self_attn\nfreeze_extra_modules: [norm]\n"
                                 "lora_r: 8\n");
  const PluginSpec* p = plugin(a, "lora");
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->options.find("finetuning_type")->as_string(), "freeze");
  EXPECT_EQ(p->options.find("freeze_trainable_layers")->as_int(), -3);
  EXPECT_EQ(p->options.find("freeze_trainable_modules")->as_string(), "mlp,self_attn");
  EXPECT_EQ(p->options.find("lora_r"), nullptr);
  EXPECT_TRUE(has_warning(a, "trains no adapters"));
  const TrainConfig b = load("", "freeze_trainable_layers: 4\n");  // without freeze: ignored, said
  EXPECT_EQ(plugin(b, "lora"), nullptr);
  EXPECT_TRUE(has_warning(b, "applies only with finetuning_type: freeze"));
  expect_config_error([] { load("", "finetuning_type: freeze\nuse_peft: true\n"); },
                      {"finetuning_type", "use_peft", "turns LoRA on"});
  expect_config_error([] { load("", "finetuning_type: freeze\nload_in_4bit: true\n"); },
                      {"finetuning_type", "load_in_4bit", "only LoRA adapters"});
  expect_config_error([] { load("", "finetuning_type: oft\n"); }, {"finetuning_type", "\"freeze\""});
}

TEST(Plugins, QloraBuildsQuantAndLora) {
  ConfigSources s;
  s.train_yaml_path = source("configs/train_qlora.yaml");
  const TrainConfig c = load_train_config(s);
  const PluginSpec* q = plugin(c, "quant");
  ASSERT_NE(q, nullptr);
  EXPECT_TRUE(q->options.find("load_in_4bit")->as_bool());
  EXPECT_EQ(q->options.find("bnb_4bit_quant_type")->as_string(), "nf4");
  EXPECT_EQ(q->options.find("optim")->as_string(), "adamw_8bit");  // one plugin owns both keys
  EXPECT_NE(plugin(c, "lora"), nullptr);
  EXPECT_NE(plugin(c, "checkpoint"), nullptr);
  const TrainConfig d = load("", "quantization_bit: 4\nfinetuning_type: lora\n");  // routed as written
  ASSERT_NE(plugin(d, "quant"), nullptr);
  EXPECT_EQ(plugin(d, "quant")->options.find("quantization_bit")->as_int(), 4);
}

TEST(Plugins, ThirdPartyPluginsArray) {
  const auto s = sources(R"({"train_micro_batch_size_per_gpu": 1, "plugins": [
      {"name": "spike_guard", "library": "plugins/libspike.so", "options": {"factor": 4.0, "anything": [1]}},
      {"name": "logger", "library": "/abs/liblog.so"}]})", "");
  const TrainConfig c = load_train_config(s);
  ASSERT_EQ(c.plugins.size(), 2u);
  const std::string dir = std::filesystem::path(s.ds_config_path).parent_path().string();
  EXPECT_EQ(c.plugins[0].library, dir + "/plugins/libspike.so");  // relative to the ds_config's folder
  EXPECT_EQ(c.plugins[0].config_key, "plugins[0]");
  EXPECT_DOUBLE_EQ(c.plugins[0].options.find("factor")->as_double(), 4.0);  // not validated here
  EXPECT_EQ(c.plugins[0].options.at_path("factor")->path(), "plugins[0].options.factor");
  EXPECT_EQ(c.plugins[1].library, "/abs/liblog.so");
  EXPECT_TRUE(c.plugins[1].options.is_object());
}

// ---- warnings, overrides, misc ----------------------------------------------------------------

TEST(Warnings, HarmlessKeysGiveOneLineEach) {
  const TrainConfig c = load(R"({"train_micro_batch_size_per_gpu": 1, "memory_breakdown": false,
    "tensorboard": {"enabled": true}, "comms_logger": {}, "steps_per_print": 100, "_comment": "x"})",
                             "report_to: none\nwandb_project:\ntf32: false\n");
  EXPECT_EQ(c.warnings.size(), 6u);  // wandb_project is null: nothing to ignore
  EXPECT_TRUE(has_warning(c, "'memory_breakdown' is accepted but ignored"));
  EXPECT_TRUE(has_warning(c, "'report_to' is accepted but ignored"));
  EXPECT_EQ(c.steps_per_print, 100);
}

TEST(Overrides, BothSyntaxesAndYamlTyping) {
  const TrainConfig c = load("", "max_steps: 200\nlearning_rate: 1e-3\n",
                             {"--max_steps=20", "--learning_rate", "2e-4", "--bf16", "--model.n_layer=2",
                              "--output_dir", "out/x", "--warmup_steps", "5"},
                             1);
  EXPECT_EQ(c.max_steps, 20);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 2e-4);
  EXPECT_EQ(c.compute_dtype, "bf16");
  EXPECT_EQ(c.model.shape.n_layer, 2);
  EXPECT_EQ(c.output_dir, "out/x");
  EXPECT_EQ(c.train_yaml.find("max_steps")->file(), "command line");
}

TEST(Overrides, OverrideWinsOverYamlInContradictionChecks) {
  // The override replaces the yaml value, so the ds_config agrees with the result.
  const TrainConfig c = load(R"({"train_micro_batch_size_per_gpu": 4})", "per_device_train_batch_size: 2\n",
                             {"--per_device_train_batch_size=4"});
  EXPECT_EQ(c.micro_batch_size, 4);
}

TEST(Overrides, AnOverrideReplacesEverySpellingOfItsKey) {
  // axolotl's names in the file, Hugging Face's on the command line: the command line wins, as
  // it would over the same spelling (not "two names of one setting").
  const auto dir = std::filesystem::path(MEMRT_BINARY_DIR) / "test_scratch" / "config" / "override_alias";
  for (const char* name : {"in_yaml", "on_command_line"}) {
    std::filesystem::create_directories(dir / name);
    write_file(dir / name / "config.json", R"({"model_type": "llama", "hidden_size": 64})");
  }
  const TrainConfig c = load("", "base_model: " + (dir / "in_yaml").string() + "\nsequence_len: 64\nmicro_batch_size: 2\n",
                             {"--model_name_or_path=" + (dir / "on_command_line").string(), "--block_size=32",
                              "--per_device_train_batch_size", "4"});
  EXPECT_EQ(c.model.name_or_path, (dir / "on_command_line").string());
  EXPECT_EQ(c.data.block_size, 32);
  EXPECT_EQ(c.micro_batch_size, 4);
  EXPECT_EQ(c.train_yaml.find("base_model"), nullptr);
  // A checkpoint directory on the command line replaces the yaml's model block (random init).
  const TrainConfig d = load("", "model:\n  n_layer: 2\n  d_model: 32\n",
                             {"--model_name_or_path", (dir / "on_command_line").string()});
  EXPECT_EQ(d.model.name_or_path, (dir / "on_command_line").string());
  EXPECT_EQ(d.train_yaml.find("model"), nullptr);
  // The LoRA targets in another tool's form: LLaMA-Factory's lora_target and axolotl's
  // lora_target_linear are replaced by a target list on the command line, and the reverse.
  const TrainConfig e = load("", "finetuning_type: lora\nlora_target: all\n", {"--lora_target_modules=q_proj,v_proj"});
  EXPECT_EQ(plugin(e, "lora")->options.at_path("lora_target_modules[1]")->as_string(), "v_proj");
  const TrainConfig f = load("", "adapter: lora\nlora_target_modules: [q_proj]\n", {"--lora_target_linear=true"});
  EXPECT_EQ(plugin(f, "lora")->options.find("lora_target_modules")->as_string(), "all-linear");
}

TEST(TrainYaml, DeepspeedKeyNamingTheSameFileIsAccepted) {
  const auto s = sources(R"({"train_micro_batch_size_per_gpu": 3})", "max_steps: 1\n");
  const std::string yaml = write_file(std::filesystem::path(s.train_yaml_path).parent_path() / "t2.yaml",
                                      "deepspeed: " + s.ds_config_path + "\n");
  ConfigSources s2 = s;
  s2.train_yaml_path = yaml;
  EXPECT_EQ(load_train_config(s2).micro_batch_size, 3);
  s2.ds_config_path.clear();  // the yaml's deepspeed: key alone names the ds_config
  EXPECT_EQ(load_train_config(s2).micro_batch_size, 3);
}

TEST(TrainYaml, ModelFromLocalCheckpointDirectory) {
  const auto dir = std::filesystem::path(MEMRT_BINARY_DIR) / "test_scratch" / "config" / "hf_ckpt";
  std::filesystem::create_directories(dir / "ckpt");
  write_file(dir / "ckpt" / "config.json", R"({"model_type": "llama", "hidden_size": 512})");
  const TrainConfig c = load(R"({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}})",
                             "model_name_or_path: " + (dir / "ckpt").string() + "\n");
  EXPECT_EQ(c.model.name_or_path, (dir / "ckpt").string());
  EXPECT_EQ(plugin(c, "zero")->options.at_path("zero_optimization.reduce_bucket_size")->as_int(), 512 * 512);
}

TEST(TrainYaml, DatasetTextFieldNamesTheJsonlField) {
  EXPECT_EQ(load("", "").data.text_field, "text");
  EXPECT_EQ(load("", "dataset_text_field: content\n").data.text_field, "content");
  expect_config_error([] { load("", "dataset_text_field: ''\n"); }, {"dataset_text_field", "empty"});
}

// TRL's dataset_name as a local directory: its train split trained on, its test split evaluated
// when the run evaluates (the split files datasets finds: test_data_files.cpp checks them against
// datasets itself); a file, as train_file; a Hub name, and what memrt does not read, refused.
TEST(TrainYaml, DatasetNameIsALocalDatasetDirectory) {
  const auto dir = std::filesystem::path(MEMRT_BINARY_DIR) / "test_scratch" / "config" / "dataset_dirs";
  std::filesystem::remove_all(dir);  // (scratch_dir() is the train.yaml's, emptied by each load)
  std::filesystem::create_directories(dir / "sft" / "data");
  for (const char* f : {"data/train.jsonl", "data/test.jsonl", "data/dev.jsonl"})
    write_file(dir / "sft" / f, R"({"prompt": "a", "completion": "b"})" "\n");
  const std::string sft = (dir / "sft").string();
  TrainConfig c = load("", "dataset_name: " + sft + "\n");
  using Files = std::vector<std::string>;
  EXPECT_EQ(c.data.train_files, Files{sft + "/data/train.jsonl"});
  EXPECT_TRUE(c.data.eval_files.empty()) << "eval_strategy is no: TRL evaluates nothing";
  c = load("", "dataset_name: " + sft + "\neval_strategy: steps\neval_steps: 5\n");
  EXPECT_EQ(c.data.eval_files, Files{sft + "/data/test.jsonl"});
  EXPECT_EQ(c.eval.steps, 5);
  c = load("", "dataset_name: " + sft + "\ndataset_train_split: validation\ndataset_test_split: train\n"
               "eval_strategy: epoch\n");
  EXPECT_EQ(c.data.train_files, Files{sft + "/data/dev.jsonl"});
  EXPECT_EQ(c.data.eval_files, Files{sft + "/data/train.jsonl"});
  EXPECT_EQ(load("", "dataset_name: " + sft + "/data/dev.jsonl\n").data.train_files, Files{sft + "/data/dev.jsonl"});

  expect_config_error([&] { load("", "dataset_name: " + sft + "\ndataset_train_split: train_sft\n"); },
                      {"dataset_train_split", "\"train_sft\"", "train, validation, test"});
  expect_config_error([&] { load("", "dataset_name: " + sft + "\ntrain_file: " + sft + "/data/dev.jsonl\n"); },
                      {"dataset_name", "train_file", "keep one"});
  expect_config_error([] { load("", "dataset_name: trl-lib/Capybara\n"); },
                      {"dataset_name", "trl-lib/Capybara", "huggingface-cli download"});
  expect_config_error([&] { load("", "dataset_name: " + sft + "\ndataset_config: sft\n"); },
                      {"dataset_name", "no config \"sft\""});
  expect_config_error([&] { load("", "dataset_name: " + sft + "/data/dev.jsonl\ndataset_config: sft\n"); },
                      {"dataset_config", "is a file"});
  write_file(dir / "sft" / "data" / "train-2.jsonl", "{}\n");  // a split in two files: both, in datasets' order
  EXPECT_EQ(load("", "dataset_name: " + sft + "\n").data.train_files,
            (Files{sft + "/data/train-2.jsonl", sft + "/data/train.jsonl"}));
  write_file(dir / "sft" / "data" / "train-3.json", "[]\n");
  expect_config_error([&] { load("", "dataset_name: " + sft + "\n"); },
                      {"dataset_name", "train-2.jsonl and " + sft + "/data/train-3.json", "alike"});
  std::filesystem::remove(dir / "sft" / "data" / "train-3.json");
  std::filesystem::create_directories(dir / "pq" / "data");
  write_file(dir / "pq" / "data" / "train-00000-of-00001.parquet", "PAR1");
  expect_config_error([&] { load("", "dataset_name: " + (dir / "pq").string() + "\n"); },
                      {"dataset_name", "parquet", "to_json('train.jsonl')"});
  std::filesystem::create_directories(dir / "gz");
  write_file(dir / "gz" / "train.jsonl.gz", "");
  expect_config_error([&] { load("", "dataset_name: " + (dir / "gz").string() + "\n"); },
                      {"dataset_name", "train.jsonl.gz", "decompress"});
}

TEST(TrainYaml, HuggingFaceDefaults) {
  const TrainConfig c = load("", "");
  EXPECT_EQ(c.micro_batch_size, 8);
  EXPECT_EQ(c.max_steps, -1);
  EXPECT_DOUBLE_EQ(c.num_train_epochs, 3.0);
  EXPECT_EQ(c.seed, 42u);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 5e-5);
  EXPECT_DOUBLE_EQ(c.gradient_clipping, 1.0);
  EXPECT_EQ(c.scheduler.type, "linear");
  EXPECT_EQ(c.scheduler.total_num_steps, -1);
  EXPECT_EQ(c.data.block_size, 128);
}

TEST(PrintConfig, ResolvedJsonHasTheEquationPluginsAndWarnings) {
  const TrainConfig c = load(R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
    "memory_breakdown": true, "wall_clock_breakdown": true, "bf16": {"enabled": true}})", "max_steps: 7\n", {}, 2);
  const std::string json = resolved_config_json(c);
  const ConfigNode back = parse_json_text(json, "printed");
  EXPECT_EQ(back.at_path("batch.train_batch_size")->as_int(), 16);
  EXPECT_EQ(back.at_path("batch.world_size")->as_int(), 2);
  EXPECT_EQ(back.at_path("batch.equation")->as_string().rfind("16 = 4 * 2 * 2", 0), 0u);
  EXPECT_EQ(back.at_path("plugins[0].name")->as_string(), "precision");
  EXPECT_TRUE(back.at_path("plugins[0].options.bf16.enabled")->as_bool());
  EXPECT_EQ(back.at_path("max_steps")->as_int(), 7);
  EXPECT_TRUE(back.at_path("wall_clock_breakdown")->as_bool());
  EXPECT_EQ(back.at_path("optimizer.type")->as_string(), "AdamW");
  EXPECT_EQ(back.find("warnings")->as_array().size(), 1u);
}

// Records to train on and held-out records (axolotl's datasets and test_datasets, or val_set_size) are
// both printed.
TEST(PrintConfig, ResolvedJsonNamesTheDatasetsAndTheHeldOutOnes) {
  const std::string readme = std::string(MEMRT_SOURCE_DIR) + "/README.md";  // a file that exists
  const TrainConfig c = load("", "datasets:\n  - path: " + readme + "\n    type: alpaca\ntest_datasets:\n  - path: " +
                                     readme + "\n    type: chat_template\neval_steps: 5\n", {}, 1);
  const ConfigNode back = parse_json_text(resolved_config_json(c), "printed");
  ASSERT_NE(back.at_path("data.eval_datasets[0].type"), nullptr) << resolved_config_json(c);
  EXPECT_EQ(back.at_path("data.datasets[0].type")->as_string(), "alpaca");
  EXPECT_EQ(back.at_path("data.eval_datasets[0].path")->as_string(), readme);
  EXPECT_EQ(back.at_path("data.eval_datasets[0].type")->as_string(), "chat_template");
  EXPECT_EQ(back.at_path("data.eval.steps")->as_int(), 5);
  EXPECT_EQ(back.find("data")->find("eval_file"), nullptr);
  // Records held out of the training ones (val_set_size) instead.
  const TrainConfig held = load("", "datasets:\n  - path: " + readme + "\n    type: alpaca\nval_set_size: 0.05\n"
                                    "shuffle_merged_datasets: false\n", {}, 1);
  const ConfigNode held_back = parse_json_text(resolved_config_json(held), "printed");
  ASSERT_NE(held_back.at_path("data.val_set_size"), nullptr) << resolved_config_json(held);
  EXPECT_EQ(held_back.at_path("data.val_set_size")->as_double(), 0.05);
  EXPECT_FALSE(held_back.at_path("data.shuffle_merged_datasets")->as_bool());
  EXPECT_NE(held_back.at_path("data.eval"), nullptr);
  EXPECT_EQ(held_back.find("data")->find("eval_datasets"), nullptr);
}
