// The host's parameter groups (store/host_groups.h): Hugging Face Trainer's decay rule checked
// against transformers itself on real models' names, and axolotl's embedding and lr_groups rules
// as the estimate and the run plan them.
#include <gtest/gtest.h>
#include <rapidjson/document.h>

#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "../data/test_util.h"
#include "memory/estimate.h"
#include "memrt/error.h"
#include "store/host_groups.h"

using namespace memrt;
using memrt::test::expect_error;

namespace {

ModelShape llama() {
  ModelShape s;
  s.arch = "llama";
  s.n_layer = 2;
  s.n_head = 4;
  s.n_kv_head = 2;
  s.d_model = 32;
  s.d_ff = 64;
  s.n_ctx = 16;
  s.vocab_size = 64;
  s.tie_embeddings = false;
  return s;
}

ModelShape gpt2() {
  ModelShape s = llama();
  s.arch = "gpt2";
  s.n_kv_head = 4;
  s.tie_embeddings = true;
  return s;
}

StorePlan plan_for(const ModelShape& shape, const OptimizerConfig& cfg) {
  const std::vector<ParamInfo> params = shape_params(shape, cfg.from_ds_config);
  StoreOptions o;
  o.weight_decay = cfg.weight_decay;
  return host_store_plan(params, param_segments(params, shape.n_layer), o, cfg);
}

// name -> its group's name
std::map<std::string, std::string> group_of(const StorePlan& plan) {
  std::map<std::string, std::string> out;
  for (const StoreGroup& g : plan.groups())
    for (int slot : g.slots) out[plan.slots()[static_cast<size_t>(slot)].param.name] = g.name;
  return out;
}

}  // namespace

// Every parameter name of transformers' GPT-2, Llama and Qwen2 (biases on q/k/v) decays in memrt
// exactly when Trainer.get_decay_parameter_names says so — run at test time.
TEST(HostGroups, TheDecayRuleIsHuggingFaceTrainers) {
  memrt::test::TempDir dir;
  const std::string out = dir.file("decay.json");
  const std::string cmd = std::string(MEMRT_PYTHON) + " " + MEMRT_SOURCE_DIR +
                          "/tests/engine/torch_reference_train.py decay_names " + out + " 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(out);
  std::stringstream text;
  text << in.rdbuf();
  rapidjson::Document d;
  d.Parse(text.str().c_str());
  ASSERT_TRUE(d.IsObject());
  int checked = 0, decaying = 0;
  for (const auto& model : d.GetObject()) {
    std::set<std::string> decay;
    for (const auto& n : model.value["decay"].GetArray()) decay.insert(n.GetString());
    for (const auto& n : model.value["names"].GetArray()) {
      const std::string name = n.GetString();
      EXPECT_EQ(decays(name, false), decay.count(name) == 1) << model.name.GetString() << ": " << name;
      EXPECT_TRUE(decays(name, true)) << "a ds_config optimizer decays every parameter: " << name;
      ++checked;
      decaying += decay.count(name) ? 1 : 0;
    }
  }
  EXPECT_GT(checked, 60);
  EXPECT_GT(decaying, 0);
  EXPECT_LT(decaying, checked);
}

// axolotl's rules on a Llama: the embeddings group (embed_tokens, lm_head) without weight decay at
// lr x embedding_lr_scale; lr_groups taking decaying parameters by name part, the first listed part
// that matches deciding (k_proj, listed again, goes to its later group, as axolotl's dict lookup
// does); norms stay in no_decay; everything else in decay.
TEST(HostGroups, AxolotlEmbeddingAndLrGroupsAsTheyDefineThem) {
  OptimizerConfig cfg;
  cfg.lr = 1e-3;
  cfg.weight_decay = 0.1;
  cfg.groups.embedding_lr_scale = 0.5;
  cfg.groups.lr_groups = {{"attn", {"self_attn.q_proj", "self_attn.k_proj"}, 2e-3},
                          {"mlp", {"mlp.up_proj", "self_attn.k_proj"}, 4e-4}};
  const StorePlan plan = plan_for(llama(), cfg);
  std::vector<std::string> names;
  for (const StoreGroup& g : plan.groups()) names.push_back(g.name);
  EXPECT_EQ(names, (std::vector<std::string>{"decay", "no_decay", "embeddings", "attn", "mlp"}));
  const auto groups = group_of(plan);
  EXPECT_EQ(groups.at("model.embed_tokens.weight"), "embeddings");
  EXPECT_EQ(groups.at("lm_head.weight"), "embeddings");
  EXPECT_EQ(groups.at("model.layers.1.self_attn.q_proj.weight"), "attn");
  EXPECT_EQ(groups.at("model.layers.1.self_attn.k_proj.weight"), "mlp");
  EXPECT_EQ(groups.at("model.layers.0.mlp.up_proj.weight"), "mlp");
  EXPECT_EQ(groups.at("model.layers.0.self_attn.v_proj.weight"), "decay");
  EXPECT_EQ(groups.at("model.layers.0.input_layernorm.weight"), "no_decay");
  const StoreGroup& embeddings = plan.groups()[2];
  EXPECT_EQ(embeddings.weight_decay, 0.0);
  EXPECT_DOUBLE_EQ(embeddings.lr_scale, 0.5);
  EXPECT_DOUBLE_EQ(plan.groups()[3].lr_scale, 2.0);
  EXPECT_EQ(plan.groups()[3].weight_decay, 0.1);
  EXPECT_DOUBLE_EQ(plan.groups()[4].lr_scale, 0.4);
  // embedding_lr alone: an absolute rate; lr_groups alone still puts the embeddings apart, without
  // weight decay and at the optimizer's rate (axolotl does so whenever one of its keys is set).
  cfg.groups.embedding_lr_scale = 0;
  cfg.groups.embedding_lr = 3e-4;
  EXPECT_DOUBLE_EQ(plan_for(llama(), cfg).groups()[2].lr_scale, 0.3);
  cfg.groups.embedding_lr = 0;
  EXPECT_DOUBLE_EQ(plan_for(llama(), cfg).groups()[2].lr_scale, 1.0);
  EXPECT_EQ(plan_for(llama(), cfg).groups()[2].weight_decay, 0.0);
  // Without any of the keys: Hugging Face's two groups.
  cfg.groups = {};
  EXPECT_EQ(plan_for(llama(), cfg).groups().size(), 2u);
}

// The estimate plans the same groups as the run: host_memory_plan's store is host_store_plan's.
TEST(HostGroups, TheEstimatePlansTheRunsGroups) {
  RunInfo run;
  run.shape = llama();
  run.micro_batch_size = 1;
  run.block_size = 16;
  HostPlanOptions options;
  options.optimizer.lr = 1e-3;
  options.optimizer.groups.lr_groups = {{"attn", {"q_proj"}, 2e-3}};
  const memory::MemoryEstimate e = host_memory_plan(run, options, shape_params(run.shape, false));
  ASSERT_TRUE(e.store);
  EXPECT_EQ(e.store->groups().size(), 4u);
  EXPECT_EQ(e.store->groups()[3].name, "attn");
  EXPECT_EQ(e.store->groups()[3].slots.size(), 2u);  // one q_proj per block
}

// A rule that selects nothing is an error naming train.yaml's key: axolotl's embedding keys on a
// GPT-2 (its embedding is transformer.wte, no embed_tokens or lm_head), an lr_group whose modules
// match no decaying parameter (norms never decay).
TEST(HostGroups, ARuleThatSelectsNothingNamesItsKey) {
  OptimizerConfig cfg;
  cfg.groups.file = "train.yaml";
  cfg.groups.embedding_lr_scale = 0.1;
  expect_error<ConfigError>([&] { plan_for(gpt2(), cfg); },
                            {"train.yaml", "embedding_lr_scale", "embed_tokens", "transformer.wte.weight"});
  cfg.groups.embedding_lr_scale = 0;
  cfg.groups.lr_groups = {{"attn", {"c_attn"}, 1e-3}, {"norms", {"ln_1"}, 1e-3}};
  expect_error<ConfigError>([&] { plan_for(gpt2(), cfg); },
                            {"train.yaml", "lr_groups[1].modules", "group 'norms'", "transformer.wte.weight"});
}
