// plugins/lora's choice of target modules against PEFT's own (lora_targets_reference.py runs
// peft.get_peft_model on transformers' models of the same architectures): name lists with suffixes
// and layers_to_transform, all-linear, and target_modules as a full-match regular expression; where
// PEFT refuses a config, memrt refuses it too. And what reading a PEFT adapter_config.json makes of
// target_modules and init_lora_weights.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "../data/test_util.h"
#include "lora/lora_targets.h"
#include "lora/peft_files.h"
#include "memrt/config_node.h"
#include "memrt/error.h"
#include "memrt/model.h"

namespace memrt::lora {
namespace {

using test::TempDir;

struct Case {
  std::string arch;
  std::vector<std::string> modules;  // a list; or
  std::string regex;                 // a string (all-linear or a regex)
  std::vector<int64_t> layers;
};

ModelShape shape_of(const std::string& arch) {
  ModelShape s;
  s.arch = arch;
  s.n_layer = 2;
  s.d_model = 16;
  s.n_head = 2;
  s.n_kv_head = arch == "llama" ? 1 : 2;
  s.d_ff = arch == "llama" ? 24 : 64;
  s.vocab_size = 64;
  s.n_ctx = 32;
  s.tie_embeddings = arch == "gpt2";
  return s;
}

std::vector<ParamInfo> params_of(const ModelShape& s) {
  std::vector<ParamInfo> out;
  for (const auto& [name, dims] : model_parameter_shapes(s)) out.push_back({name, dims});
  return out;
}

// memrt's choice: the adapted modules' names, or the error's message.
ConfigNode memrt_choice(const Case& c) {
  TargetRule rule;
  rule.file = "train.yaml";
  rule.modules = c.modules;
  rule.all_linear = c.regex == "all-linear";
  if (!rule.all_linear) rule.regex = c.regex;
  rule.layers = c.layers;
  ConfigNode out = ConfigNode::object();
  try {
    const ModelShape s = shape_of(c.arch);
    std::set<std::string> names;
    for (const Target& t : select_targets(params_of(s), s, rule)) names.insert(t.module);
    ConfigNode list = ConfigNode::array();
    for (const std::string& n : names) list.push_back(ConfigNode::string(n));
    out.set("adapted", list);
  } catch (const ConfigError& e) {
    out.set("error", ConfigNode::string(e.what()));
  }
  return out;
}

TEST(LoraTargets, ChosenAsPeftChoosesThem) {
  const std::vector<Case> cases = {
      {"llama", {"q_proj", "v_proj"}, "", {}},
      {"llama", {"self_attn.o_proj", "up_proj"}, "", {0}},
      {"llama", {}, R"(model\.layers\.1\.self_attn\.(q|k)_proj)", {}},
      {"llama", {}, R"(.*\.mlp\..*_proj)", {}},
      {"gpt2", {}, R"(transformer\.h\.0\.(attn\.c_attn|mlp\.c_fc))", {}},
      {"gpt2", {}, R"(.*\.attn\.c_.*)", {}},
      {"gpt2", {}, "all-linear", {}},
      // (all-linear with layers_to_transform, which PEFT's LoraConfig refuses as it refuses any
      // string with it, memrt takes as the list all-linear resolves to: what the adapter file says.)
      // PEFT refuses each of these: a norm and a whole block are not modules it adapts, a regex with
      // layers_to_transform is a config it rejects, and a regex matching nothing finds no target.
      {"llama", {}, ".*norm", {}},
      {"llama", {}, R"(.*layers\.0)", {}},
      {"llama", {}, R"(model\.layers\.0.*)", {}},  // block 0's projections, and the block itself
      {"llama", {}, ".*q_proj", {0}},
      {"llama", {}, ".*c_attn", {}},
      {"llama", {}, R"(self_attn\.q_proj)", {}},  // the whole name must match, not a part of it
  };
  TempDir dir;
  ConfigNode in = ConfigNode::array();
  for (const Case& c : cases) {
    ConfigNode k = ConfigNode::object();
    k.set("arch", ConfigNode::string(c.arch));
    k.set("n_layer", ConfigNode::number(2));
    if (c.regex.empty()) {
      ConfigNode list = ConfigNode::array();
      for (const std::string& m : c.modules) list.push_back(ConfigNode::string(m));
      k.set("target_modules", list);
    } else {
      k.set("target_modules", ConfigNode::string(c.regex));
    }
    if (!c.layers.empty()) {
      ConfigNode layers = ConfigNode::array();
      for (int64_t l : c.layers) layers.push_back(ConfigNode::number(static_cast<double>(l)));
      k.set("layers_to_transform", layers);
    }
    in.push_back(k);
  }
  std::ofstream(dir.file("in.json")) << in.to_json(0);
  const std::string cmd = std::string(MEMRT_PYTHON) + " " + MEMRT_SOURCE_DIR + "/tests/plugins/lora_targets_reference.py " +
                          dir.file("in.json") + " " + dir.file("out.json");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const ConfigNode peft = parse_json_file(dir.file("out.json"));
  ASSERT_EQ(peft.as_array().size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE("case " + std::to_string(i) + ": " + in.as_array()[i].to_json(0));
    const ConfigNode& want = peft.as_array()[i];
    const ConfigNode got = memrt_choice(cases[i]);
    if (want.find("error")) {
      ASSERT_NE(got.find("error"), nullptr) << "PEFT refuses it (" << want.find("error")->as_string().substr(0, 120)
                                            << "...) but memrt adapts " << got.to_json(0);
      const std::string message = got.find("error")->as_string();
      EXPECT_NE(message.find(cases[i].layers.empty() ? "lora_target_modules" : "layers_to_transform"), std::string::npos)
          << message;
    } else {
      ASSERT_EQ(got.find("error"), nullptr) << got.find("error")->as_string();
      EXPECT_EQ(got.find("adapted")->to_json(0), want.find("adapted")->to_json(0));
    }
  }
}

TEST(LoraTargets, ARegexPythonAloneReadsIsAnErrorNamingTheKey) {
  TargetRule rule;
  rule.file = "train.yaml";
  rule.regex = R"((?P<proj>q|v)_proj)";
  const ModelShape s = shape_of("llama");
  try {
    select_targets(params_of(s), s, rule);
    FAIL() << "a named group compiled";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("lora_target_modules"), std::string::npos) << m;
    EXPECT_NE(m.find("does not compile"), std::string::npos) << m;
  }
}

std::string write_adapter_config(const TempDir& dir, const std::string& name, const std::string& fields) {
  const std::string path = dir.file(name);
  std::filesystem::create_directories(path);
  std::ofstream(path + "/adapter_config.json")
      << R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": )" << fields << "}";
  return path;
}

TEST(PeftFiles, TargetModulesAndInitAsPeftWritesThem) {
  TempDir dir;
  // A string is PEFT's regex; written back as the string.
  const PeftAdapterConfig regex = read_peft_config(write_adapter_config(dir, "regex", R"("model\\.layers\\.0\\..*_proj")"));
  EXPECT_EQ(regex.target_regex, R"(model\.layers\.0\..*_proj)");
  EXPECT_TRUE(regex.target_modules.empty());
  EXPECT_NE(peft_config_json(regex).find(R"("target_modules": "model\\.layers\\.0\\..*_proj")"), std::string::npos)
      << peft_config_json(regex);
  // Initialisations that leave the base as it was load silently.
  int k = 0;
  for (const char* init : {"true", "false", R"("gaussian")", R"("eva")", R"("orthogonal")"}) {
    const PeftAdapterConfig c = read_peft_config(write_adapter_config(
        dir, "plain_" + std::to_string(k++), std::string(R"(["q_proj"], "init_lora_weights": )") + init));
    EXPECT_TRUE(c.warnings.empty()) << init;
    EXPECT_NE(peft_config_json(c).find(std::string(R"("init_lora_weights": )") + init), std::string::npos)
        << "written back as read: " << peft_config_json(c);
  }
  // Those that subtract B·A from the base load with a line saying which base they need.
  for (const char* init : {"pissa", "pissa_niter_16", "olora", "corda", "lora_ga"}) {
    const PeftAdapterConfig c = read_peft_config(write_adapter_config(
        dir, std::string("residual_") + init, std::string(R"(["q_proj"], "init_lora_weights": ")") + init + "\""));
    ASSERT_EQ(c.warnings.size(), 1u) << init;
    EXPECT_NE(c.warnings[0].find("init_lora_weights"), std::string::npos) << c.warnings[0];
    EXPECT_NE(c.warnings[0].find("residual model"), std::string::npos) << c.warnings[0];
  }
  // A variant memrt does not build, and a value nobody defines, are errors naming the file and key.
  for (const char* init : {"mica", "kaiming"}) {
    const std::string path = write_adapter_config(dir, std::string("refused_") + init,
                                                  std::string(R"(["q_proj"], "init_lora_weights": ")") + init + "\"");
    try {
      read_peft_config(path);
      FAIL() << init << " was accepted";
    } catch (const ConfigError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("adapter_config.json"), std::string::npos) << m;
      EXPECT_NE(m.find("init_lora_weights"), std::string::npos) << m;
    }
  }
}

// init_lora_weights of a LoRA to train (train.yaml's init_lora_weights / axolotl's
// peft_init_lora_weights): the values memrt builds — drawn, or PiSSA's and OLoRA's decompositions
// of the base — written as PEFT writes them; PiSSA from a randomized SVD names what to use instead;
// one that needs data or quantization is an error naming the key and saying how to start from
// PEFT's adapter.
TEST(PeftFiles, InitLoraWeightsToTrainAreTheOnesMemrtBuilds) {
  const auto node = [](const std::string& json) {
    return parse_yaml_value(json, "train.yaml", "peft_init_lora_weights");
  };
  EXPECT_EQ(read_lora_init(node("true")), LoraInit::kDefault);
  EXPECT_EQ(read_lora_init(node("false")), LoraInit::kLinear);
  EXPECT_EQ(read_lora_init(node(R"("gaussian")")), LoraInit::kGaussian);
  EXPECT_EQ(read_lora_init(node(R"("orthogonal")")), LoraInit::kOrthogonal);
  EXPECT_EQ(read_lora_init(node(R"("pissa")")), LoraInit::kPissa);
  EXPECT_EQ(read_lora_init(node(R"("olora")")), LoraInit::kOlora);
  for (LoraInit init : {LoraInit::kDefault, LoraInit::kLinear, LoraInit::kGaussian, LoraInit::kOrthogonal,
                        LoraInit::kPissa, LoraInit::kOlora})
    EXPECT_EQ(read_lora_init(lora_init_node(init)), init);
  EXPECT_EQ(lora_init_node(LoraInit::kGaussian).to_json(0), R"("gaussian")");
  EXPECT_EQ(lora_init_node(LoraInit::kPissa).to_json(0), R"("pissa")");
  EXPECT_EQ(lora_init_node(LoraInit::kDefault).to_json(0), "true");
  try {
    read_lora_init(node(R"("pissa_niter_4")"));
    ADD_FAILURE() << "pissa_niter_4 was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("use \"pissa\""), std::string::npos) << e.what();
  }
  for (const char* init : {"corda", "loftq", "lora_ga", "eva", "kaiming"}) {
    try {
      read_lora_init(node(std::string("\"") + init + "\""));
      FAIL() << init << " was accepted";
    } catch (const ConfigError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("peft_init_lora_weights"), std::string::npos) << m;
      EXPECT_NE(m.find("\"orthogonal\""), std::string::npos) << "names what memrt builds: " << m;
      if (std::string(init) != "kaiming") EXPECT_NE(m.find("adapter_name_or_path"), std::string::npos) << m;
    }
  }
}

}  // namespace
}  // namespace memrt::lora
