// plugins/quant owns the 4-bit base's keys — bitsandbytes' (load_in_4bit, bnb_4bit_*), axolotl's and
// LLaMA-Factory's (quantization_bit, quantization_type, double_quantization, quantization_method):
// the loader routes them and the plugin's configure checks them. These tests take a run's path
// (load_train_config, the built-in plugins from their libraries, configure) and check that a bad
// key fails there naming the file, the key and what to use, and that each spelling means what its
// tool means, seen in the bytes of the plan the plugin lays out.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "../config/load_helper.h"
#include "config/load_config.h"
#include "engine/engine.h"
#include "plugin/plugin_host.h"

namespace memrt {
namespace {

using memory::Category;
using test::sources;

const std::string kDs = R"({"train_micro_batch_size_per_gpu": 4})";
const std::string kModel = "model: {arch: gpt2, n_layer: 2, n_head: 2, d_model: 64, d_ff: 256, vocab_size: 256, "
                           "n_ctx: 32}\nblock_size: 32\n";

struct BadKeys {
  const char* name;
  std::string yaml;
  std::vector<std::string> expected;  // parts of the message ("YAML" = the train.yaml's path)
};

void PrintTo(const BadKeys& b, std::ostream* os) { *os << b.yaml; }

std::vector<BadKeys> bad_keys() {
  return {
      {"int8_weights", "load_in_8bit: true\n", {"YAML", "'load_in_8bit'", "LLM.int8", "load_in_4bit"}},
      {"switch_not_bool", "load_in_4bit: \"on\"\n", {"YAML", "'load_in_4bit'", "boolean"}},
      {"eight_bits", "quantization_bit: 8\n", {"YAML", "'quantization_bit'", "is 8", "use 4"}},
      {"three_bits", "quantization_bit: 3\n", {"YAML", "'quantization_bit'", "4 bits"}},
      {"gptq", "quantization_bit: 4\nquantization_method: gptq\n", {"YAML", "'quantization_method'", "\"bnb\""}},
      {"both_switches_disagree", "load_in_4bit: false\nquantization_bit: 4\n", {"YAML", "'quantization_bit'", "remove one"}},
      {"unknown_type", "load_in_4bit: true\nbnb_4bit_quant_type: int4\n", {"YAML", "'bnb_4bit_quant_type'", "\"nf4\""}},
      {"spellings_disagree", "load_in_4bit: true\nbnb_4bit_quant_type: nf4\nquantization_type: fp4\n",
       {"YAML", "'bnb_4bit_quant_type'", "but quantization_type", "keep one"}},
      {"compute_dtype", "load_in_4bit: true\nbnb_4bit_compute_dtype: float64\n",
       {"YAML", "'bnb_4bit_compute_dtype'", "bfloat16"}},
      {"storage", "load_in_4bit: true\nbnb_4bit_quant_storage: bfloat16\n",
       {"YAML", "'bnb_4bit_quant_storage'", "uint8"}},
      {"double_quant_not_bool", "load_in_4bit: true\nbnb_4bit_use_double_quant: maybe\n",
       {"YAML", "'bnb_4bit_use_double_quant'"}},
  };
}

class BadQuantKeys : public ::testing::TestWithParam<BadKeys> {};

TEST_P(BadQuantKeys, FailAtConfigureNamingFileAndKey) {
  const BadKeys& b = GetParam();
  const ConfigSources src = sources(kDs, kModel + b.yaml);
  std::vector<std::string> parts;
  for (const auto& p : b.expected) parts.push_back(p == "YAML" ? src.train_yaml_path : p);
  const TrainConfig cfg = load_train_config(src);
  PluginHost plugins = PluginHost::load(cfg.plugins);
  ConfigDiagnostics diag;
  const std::string msg = test::expect_config_error([&] { plugins.configure(make_run_info(cfg, 0, 1, 0), diag); }, parts);
  std::cout << "  " << msg << "\n";
}

INSTANTIATE_TEST_SUITE_P(Quant, BadQuantKeys, ::testing::ValuesIn(bad_keys()),
                         [](const ::testing::TestParamInfo<BadKeys>& p) { return std::string(p.param.name); });

// quant_state of the plan the configured plugins lay out for `yaml`.
int64_t quant_state_bytes(const std::string& yaml) {
  const TrainConfig cfg = load_train_config(sources(kDs, kModel + yaml));
  PluginHost plugins = PluginHost::load(cfg.plugins);
  ConfigDiagnostics diag;
  const RunInfo run = make_run_info(cfg, 0, 1, 0);
  plugins.configure(run, diag);
  return estimate_memory(cfg, run, plugins).table.at(Category::kQuantState);
}

// The projections of kModel: per block c_attn (3 x 64 x 64), c_proj (64 x 64), c_fc and mlp.c_proj (64 x 256).
int64_t base_bytes(bool double_quant) {
  int64_t sum = 0;
  for (int64_t n : {12288, 4096, 16384, 16384}) {
    const int64_t blocks = n / 64;
    sum += n / 2 + (double_quant ? blocks + 4 * ((blocks + 255) / 256) + 4 : 4 * blocks);
  }
  return 2 * sum;
}

// axolotl's and LLaMA-Factory's defaults (NF4 with double quantization), each tool's spelling of a
// choice, and the keys that mean nothing without a 4-bit base.
TEST(QuantConfig, EachToolsSpellingLaysOutItsFormat) {
  EXPECT_EQ(quant_state_bytes("load_in_4bit: true\n"), base_bytes(true));
  EXPECT_EQ(quant_state_bytes("quantization_bit: 4\n"), base_bytes(true));
  EXPECT_EQ(quant_state_bytes("load_in_4bit: true\nbnb_4bit_use_double_quant: false\n"), base_bytes(false));
  EXPECT_EQ(quant_state_bytes("quantization_bit: 4\nquantization_method: bnb\nquantization_type: fp4\n"
                              "double_quantization: false\n"),
            base_bytes(false));
  EXPECT_EQ(quant_state_bytes("load_in_4bit: true\nbnb_4bit_quant_type: fp4\nquantization_type: fp4\n"
                              "bnb_4bit_compute_dtype: torch.bfloat16\nbnb_4bit_quant_storage: uint8\n"),
            base_bytes(true));
  EXPECT_EQ(quant_state_bytes("load_in_4bit: false\n"), 0);
  const TrainConfig off = test::load(kDs, kModel + "load_in_4bit: false\nbnb_4bit_quant_type: nf4\n");
  EXPECT_TRUE(test::has_warning(off, "'bnb_4bit_quant_type' is accepted but ignored"));
  EXPECT_EQ(test::plugin(off, "quant"), nullptr);
  const TrainConfig alone = test::load(kDs, kModel + "load_in_4bit: true\n");
  EXPECT_TRUE(test::has_warning(alone, "without LoRA"));
}

}  // namespace
}  // namespace memrt
