// plugins/zero owns the zero_optimization section (plugins/zero/zero_config.h): the config loader
// routes it (legacy boolean form, stage, "auto" bucket sizes) and the plugin's configure checks
// every key. These tests take the path a run takes — load_train_config, the built-in plugins
// loaded from their libraries, configure — and check that a bad section fails there with the
// file, the key and what to do; that the legacy and alias forms mean what DeepSpeed means (seen
// in the memory plan the plugin then lays out); and which keys leave a note.
#include <gtest/gtest.h>

#include <optional>
#include <set>
#include <string>
#include <vector>

#include "../config/load_helper.h"
#include "config/load_config.h"
#include "engine/engine.h"
#include "plugin/plugin_host.h"

namespace memrt {
namespace {

using memory::Category;
using memory::Placement;
using test::sources;

const std::string kTop = R"({"train_micro_batch_size_per_gpu": 4, "zero_optimization": )";
const std::string kYaml = "model: {arch: gpt2, n_layer: 2, n_head: 2, d_model: 64, d_ff: 256, vocab_size: 256, "
                          "n_ctx: 32}\nblock_size: 32\n";

struct Configured {
  TrainConfig cfg;
  PluginHost plugins;
  ConfigDiagnostics diag;
};

// The ds_config `{"train_micro_batch_size_per_gpu": 4, "zero_optimization": <zero>}` as rank
// `rank` of a run of `world_size` ranks would take it.
Configured configure(const std::string& zero, int world_size = 2, const std::string& yaml = kYaml, int rank = 0) {
  Configured c;
  c.cfg = load_train_config(sources(kTop + zero + "}", yaml, {}, world_size));
  c.plugins = PluginHost::load(c.cfg.plugins);
  c.plugins.configure(make_run_info(c.cfg, rank, world_size, rank), c.diag);
  return c;
}

bool has_note(const ConfigDiagnostics& d, const std::string& part) {
  for (const auto& w : d.warnings)
    if (w.find(part) != std::string::npos) return true;
  return false;
}

struct BadZero {
  const char* name;
  std::string zero;
  std::vector<std::string> expected;  // parts of the message ("DS" = the ds_config's path)
};

void PrintTo(const BadZero& b, std::ostream* os) { *os << b.zero; }

std::vector<BadZero> bad_sections() {
  return {
      {"typo", R"({"stage": 2, "overlap_com": true})", {"DS", "'zero_optimization.overlap_com'", "did you mean 'overlap_comm'?"}},
      {"typo_in_offload", R"({"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memmory": true}})",
       {"DS", "'zero_optimization.offload_optimizer.pin_memmory'", "did you mean 'pin_memory'?"}},
      {"wrong_type", R"({"stage": 2, "overlap_comm": "yes"})", {"DS", "'zero_optimization.overlap_comm'", "boolean"}},
      {"stage_4", R"({"stage": 4})", {"DS", "'zero_optimization.stage'", "0, 1, 2 or 3"}},
      {"negative_persistence", R"({"stage": 3, "stage3_param_persistence_threshold": -1})",
       {"DS", "'zero_optimization.stage3_param_persistence_threshold'", ">= 0 elements"}},
      {"bucket_not_positive", R"({"stage": 2, "reduce_bucket_size": 0})", {"DS", "'zero_optimization.reduce_bucket_size'", "> 0"}},
      {"param_offload_below_stage3", R"({"stage": 2, "offload_param": {"device": "cpu"}})",
       {"DS", "'zero_optimization.offload_param.device'", "'zero_optimization.stage' is 2", "stage 3"}},
      {"offload_at_stage_0", R"({"stage": 0, "offload_optimizer": {"device": "cpu"}})",
       {"DS", "'zero_optimization.offload_optimizer.device'", "'zero_optimization.stage' is 0", "1, 2 or 3"}},
      {"legacy_and_new_offload", R"({"stage": 2, "cpu_offload": true, "offload_optimizer": {"device": "cpu"}})",
       {"DS", "'zero_optimization.cpu_offload'", "replacement", "offload_optimizer"}},
      {"nvme_offload", R"({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}})",
       {"DS", "'zero_optimization.offload_optimizer.device'", "\"nvme\"", "\"cpu\""}},
      {"nvme_param_offload_at_stage_3", R"({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}})",
       {"DS", "'zero_optimization.offload_param.device'", "\"nvme\""}},  // the keys before the stage
      {"unknown_device", R"({"stage": 2, "offload_optimizer": {"device": "gpu"}})",
       {"DS", "'zero_optimization.offload_optimizer.device'", "expected \"cpu\" or \"none\""}},
      {"partial_offload", R"({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}})",
       {"DS", "'zero_optimization.offload_optimizer.ratio'", "SuperOffload", "set 1"}},
      {"alias_twice", R"({"stage": 2, "stage3_max_live_parameters": 1e9, "max_live_parameters": 1e9})",
       {"DS", "'zero_optimization.max_live_parameters'", "'zero_optimization.stage3_max_live_parameters'", "keep one"}},
      {"zero_plus_plus", R"({"stage": 2, "zero_quantized_gradients": true})",
       {"DS", "'zero_optimization.zero_quantized_gradients'", "ZeRO++"}},
      {"hierarchical_partitions", R"({"stage": 2, "zero_hpz_partition_size": 2})",
       {"DS", "'zero_optimization.zero_hpz_partition_size'", "set 1"}},
      {"zenflow", R"({"stage": 2, "zenflow": {"topk_ratio": 0.1}})", {"DS", "'zero_optimization.zenflow'", "plain ZeRO"}},
      {"aio_misplaced", R"({"stage": 2, "aio": {}})", {"DS", "'zero_optimization.aio'", "top-level"}},
  };
}

class BadZeroSections : public ::testing::TestWithParam<BadZero> {};

TEST_P(BadZeroSections, FailAtConfigureNamingFileAndKey) {
  const BadZero& b = GetParam();
  const ConfigSources src = sources(kTop + b.zero + "}", kYaml, {}, 2);
  std::vector<std::string> parts;
  for (const auto& p : b.expected) parts.push_back(p == "DS" ? src.ds_config_path : p);
  // The loader routes the section without judging it; the plugin's configure does.
  const TrainConfig cfg = load_train_config(src);
  PluginHost plugins = PluginHost::load(cfg.plugins);
  ConfigDiagnostics diag;
  const std::string msg =
      test::expect_config_error([&] { plugins.configure(make_run_info(cfg, 0, 2, 0), diag); }, parts);
  std::cout << "  " << msg << "\n";
}

INSTANTIATE_TEST_SUITE_P(Zero, BadZeroSections, ::testing::ValuesIn(bad_sections()),
                         [](const ::testing::TestParamInfo<BadZero>& p) { return std::string(p.param.name); });

// Where the optimizer state is placed in the plan the configured plugins lay out for rank 0.
int64_t state_bytes(Configured& c, Placement where) {
  const EstimateReport r = estimate_memory(c.cfg, make_run_info(c.cfg, 0, 2, 0), c.plugins);
  return r.table.at(Category::kOptimizerState, where);
}

TEST(ZeroConfig, OffloadSectionAndLegacyBooleanPlaceTheStateOnTheHost) {
  Configured plain = configure(R"({"stage": 2})");
  EXPECT_GT(state_bytes(plain, Placement::kDevice), 0);
  EXPECT_EQ(state_bytes(plain, Placement::kHost), 0);
  for (const char* zero : {R"({"stage": 2, "offload_optimizer": {"device": "cpu"}})",
                           R"({"stage": 2, "cpu_offload": true})"}) {
    SCOPED_TRACE(zero);
    Configured off = configure(zero);
    EXPECT_EQ(state_bytes(off, Placement::kDevice), 0);
    EXPECT_EQ(state_bytes(off, Placement::kHost), state_bytes(plain, Placement::kDevice));
  }
  Configured legacy_off = configure(R"({"stage": 2, "cpu_offload": false})");
  EXPECT_EQ(state_bytes(legacy_off, Placement::kHost), 0);
  EXPECT_TRUE(has_note(legacy_off.diag, "'zero_optimization.cpu_offload' is deprecated"));
}

TEST(ZeroConfig, LegacyBooleanSectionIsStageOne) {
  Configured on = configure("true");
  EXPECT_EQ(on.cfg.zero_stage, 1);
  EXPECT_TRUE(test::has_warning(on.cfg, "deprecated DeepSpeed form"));
  Configured stage1 = configure(R"({"stage": 1})");
  Configured stage0 = configure(R"({"stage": 0})");
  // Stage 1 halves each rank's optimizer state on 2 ranks, up to the padding: each of the two
  // groups (decay, no decay) grows by fewer than 2 x 16 elements of 8 bytes (Adam's m and v).
  EXPECT_EQ(state_bytes(on, Placement::kDevice), state_bytes(stage1, Placement::kDevice));
  EXPECT_LT(2 * state_bytes(on, Placement::kDevice), state_bytes(stage0, Placement::kDevice) + 2 * (2 * 16) * 8);
  EXPECT_LT(state_bytes(on, Placement::kDevice), state_bytes(stage0, Placement::kDevice));
  EXPECT_EQ(configure("false").cfg.zero_stage, 0);
}

TEST(ZeroConfig, AutoBucketsAndAliasesAreAccepted) {
  // "auto" bucket sizes are filled from the model's width before the plugin reads them; the
  // stage-3 keys and their aliases are type-checked and accepted below stage 3, as DeepSpeed does.
  Configured c = configure(R"({"stage": 2, "reduce_bucket_size": "auto", "prefetch_bucket_size": "auto",
      "param_persistence_threshold": "auto", "max_live_parameters": 1e9, "gather_16bit_weights_on_model_save": true,
      "stage3_gather_fp16_weights_on_model_save": null, "sub_group_size": 1e9, "overlap_comm": true,
      "contiguous_gradients": true, "round_robin_gradients": false})");
  const ConfigNode& z = *test::plugin(c.cfg, "zero")->options.find("zero_optimization");
  EXPECT_EQ(z.find("reduce_bucket_size")->as_int(), 64 * 64);
  EXPECT_EQ(z.find("prefetch_bucket_size")->as_int(), 3686);  // floor(0.9 * 64 * 64)
  EXPECT_EQ(z.find("param_persistence_threshold")->as_int(), 640);
}

TEST(ZeroConfig, NotesForWhatCannotMatterHere) {
  Configured c = configure(R"({"stage": 2, "elastic_checkpoint": true, "overlap_comm": true,
      "offload_optimizer": {"device": "cpu", "pin_memory": true, "buffer_count": 4, "nvme_path": "/x"}})");
  EXPECT_TRUE(has_note(c.diag, "'zero_optimization.elastic_checkpoint' is accepted but ignored"));
  EXPECT_TRUE(has_note(c.diag, "'zero_optimization.overlap_comm' has no effect here: each gradient bucket"));
  EXPECT_TRUE(has_note(configure(R"({"stage": 1, "overlap_comm": true})").diag,
                       "'zero_optimization.overlap_comm' has no effect here: stage 1 all-reduces"));
  EXPECT_TRUE(has_note(c.diag, "'zero_optimization.offload_optimizer.pin_memory' has no effect on a CPU device"));
  EXPECT_TRUE(has_note(c.diag, "'zero_optimization.offload_optimizer.buffer_count' is accepted but ignored"));
  EXPECT_TRUE(has_note(c.diag, "'zero_optimization.offload_optimizer.nvme_path' is accepted but ignored"));
  // reduce_scatter false all-reduces the buckets at stage 3 too, as DeepSpeed's stage 3 does: no note.
  EXPECT_TRUE(configure(R"({"stage": 3, "reduce_scatter": false})").diag.warnings.empty());
  Configured quiet = configure(R"({"stage": 2, "overlap_comm": false, "contiguous_gradients": true,
      "reduce_scatter": false, "offload_optimizer": {"device": "cpu", "pin_memory": false}})");
  EXPECT_TRUE(quiet.diag.warnings.empty()) << quiet.diag.warnings.front();
}

// Stage 3 gathers each segment when it runs: the prefetch and live-parameter limits hold whatever
// their value (a note each, at stage 3 only). stage3_gather_16bit_weights_on_model_save true at
// stage 3 has the host write the consolidated model into each checkpoint; "auto" is false there,
// as Accelerate fills it.
TEST(ZeroConfig, StageThreeHonoursThePrefetchLimitsAndNotesTheReuseDistance) {
  const std::string keys = R"("stage3_prefetch_bucket_size": "auto", "stage3_max_live_parameters": 1e9,
      "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": true})";
  Configured three = configure(R"({"stage": 3, )" + keys);
  EXPECT_TRUE(has_note(three.diag, "'zero_optimization.stage3_max_reuse_distance' has no effect here: every segment "
                                   "is released after its forward"));
  EXPECT_EQ(three.diag.warnings.size(), 1u) << three.diag.warnings.back();
  EXPECT_TRUE(three.cfg.save_consolidated_model);
  Configured two = configure(R"({"stage": 2, )" + keys);
  EXPECT_TRUE(two.diag.warnings.empty());
  EXPECT_FALSE(two.cfg.save_consolidated_model);
  Configured automatic = configure(R"({"stage": 3, "stage3_gather_16bit_weights_on_model_save": "auto"})");
  EXPECT_FALSE(automatic.cfg.save_consolidated_model);
  EXPECT_TRUE(test::has_warning(automatic.cfg, "'zero_optimization.stage3_gather_16bit_weights_on_model_save' is \"auto\": read as false"));
  EXPECT_TRUE(automatic.diag.warnings.empty()) << automatic.diag.warnings.front();
}

// From a checkpoint, a ZeRO-3 rank reads the elements it keeps (held_elements, on the plan the
// estimate and the run share): of a frozen weight the store partitions, its share — unless a
// plugin reads the weight whole as its block is built (named in ParamPlanContext::reads_frozen:
// DoRA's targets, for their norms; a 4-bit base's projections and biases, never partitioned), or
// a plugin built before ABI 2.20 is loaded, which cannot say what it reads (then every frozen
// weight is read whole).
TEST(ZeroConfig, StageThreeReadsTheFrozenSharesThatNoPluginReadsWhole) {
  const std::string dora = kYaml + "adapter: lora\nlora_r: 4\nlora_target_modules: [c_attn]\nuse_dora: true\n";
  const std::string zero = R"({"stage": 3, "stage3_param_persistence_threshold": 0})";
  for (int rank : {0, 1}) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    Configured c = configure(zero, 2, dora, rank);
    const EstimateReport e = estimate_memory(c.cfg, make_run_info(c.cfg, rank, 2, rank), c.plugins);
    ASSERT_TRUE(e.frozen_reads.has_value()) << "every plugin loaded is of this SDK";
    EXPECT_EQ(*e.frozen_reads, (std::set<std::string>{"transformer.h.0.attn.c_attn.weight",
                                                      "transformer.h.1.attn.c_attn.weight"}));
    auto held = [&](const std::string& name) { return held_elements(*e.store, e.frozen_reads, name); };
    const int64_t half = 64 * 256 / 2;  // mlp.c_fc (64 x 256), frozen, not a target
    EXPECT_EQ(held("transformer.h.1.mlp.c_fc.weight"), (ElementRange{rank * half, (rank + 1) * half}));
    EXPECT_EQ(held("transformer.wte.weight"), (ElementRange{rank * 128 * 64, (rank + 1) * 128 * 64}));
    EXPECT_EQ(held("transformer.h.0.ln_1.bias"), (ElementRange{rank * 32, (rank + 1) * 32}));
    EXPECT_FALSE(held("transformer.h.0.attn.c_attn.weight")) << "DoRA's norms read it whole";
    EXPECT_FALSE(held_elements(*e.store, std::nullopt, "transformer.h.1.mlp.c_fc.weight"))
        << "a plugin that cannot say what it reads";
    // Above the persistence threshold a frozen weight is whole on every rank.
    Configured kept = configure(R"({"stage": 3, "stage3_param_persistence_threshold": 100})", 2, dora, rank);
    const EstimateReport k = estimate_memory(kept.cfg, make_run_info(kept.cfg, rank, 2, rank), kept.plugins);
    EXPECT_FALSE(held_elements(*k.store, k.frozen_reads, "transformer.h.0.ln_1.bias"));
    EXPECT_TRUE(held_elements(*k.store, k.frozen_reads, "transformer.h.1.mlp.c_fc.weight"));
  }
}

}  // namespace
}  // namespace memrt
