// The estimate against exact measurements, and against the textbook figures (docs/memory.md).
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <sstream>
#include <tuple>

#include "engine/engine.h"
#include "memory/estimate.h"
#include "memory/tracking_allocator.h"
#include "memrt/config_node.h"
#include "models/model_factory.h"

namespace memrt {
namespace {

namespace fs = std::filesystem;
using memory::Category;

struct Case {
  const char* name;
  ModelShape shape;
  int64_t micro_batch, block_size, grad_accum;
  const char* precision = nullptr;  // the precision plugin's options (JSON), or none
  const char* freeze = nullptr;     // plugins/lora's options (JSON): freeze tuning, or none
  bool chunked = false;             // chunked_cross_entropy: the head's loss a chunk of tokens at a time
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

ModelShape shape(const char* arch, int64_t layers, int64_t heads, int64_t kv_heads, int64_t d,
                 int64_t ff, int64_t vocab, bool tied) {
  ModelShape s;
  s.arch = arch;
  s.n_layer = layers;
  s.n_head = heads;
  s.n_kv_head = kv_heads;
  s.d_model = d;
  s.d_ff = ff;
  s.vocab_size = vocab;
  s.n_ctx = 64;
  s.tie_embeddings = tied;
  return s;
}

ModelShape dropout(ModelShape s) {
  s.attn_pdrop = 0.1;
  if (s.arch == "gpt2") s.embd_pdrop = s.resid_pdrop = 0.1;
  return s;
}

TrainConfig config(const Case& c) {
  TrainConfig cfg;
  cfg.micro_batch_size = c.micro_batch;
  cfg.grad_accum_steps = c.grad_accum;
  cfg.train_batch_size = c.micro_batch * c.grad_accum;
  cfg.gradient_clipping = 1.0;
  cfg.steps_per_print = 100;
  cfg.max_steps = 3;
  cfg.optimizer.type = "AdamW";
  cfg.model.shape = c.shape;
  cfg.data.block_size = c.block_size;
  cfg.chunked_cross_entropy = c.chunked;
  cfg.output_dir = (fs::temp_directory_path() /
                    ("memrt_estimate_" + std::string(c.name) + "_" + std::to_string(getpid()))).string();
  return cfg;
}

// Shapes chosen so the backward peak falls at the loss in some (large vocabulary against the
// MLP) and in the last block in others, with and without accumulation, tied and untied heads.
const Case kCases[] = {
    {"gpt2_small_mlp", shape("gpt2", 2, 2, 2, 32, 64, 256, true), 2, 16, 1},
    {"gpt2_wide_mlp_accum", shape("gpt2", 2, 4, 4, 64, 512, 256, true), 3, 32, 2},
    {"llama_gqa_untied", shape("llama", 2, 4, 2, 64, 256, 300, false), 2, 24, 1},
    {"llama_tied_accum", shape("llama", 3, 2, 2, 32, 96, 256, true), 2, 20, 2},
    {"gpt2_bf16", shape("gpt2", 2, 2, 2, 32, 64, 256, true), 2, 16, 1, R"({"bf16": {"enabled": true}})"},
    {"gpt2_fp16_wide_mlp_accum", shape("gpt2", 2, 4, 4, 64, 512, 256, true), 3, 32, 2,
     R"({"fp16": {"enabled": true}})"},
    {"llama_bf16_gqa_untied", shape("llama", 2, 4, 2, 64, 256, 300, false), 2, 24, 1,
     R"({"bf16": {"enabled": true}})"},
    // Dropout: GPT-2's three, Llama's attention dropout (scaled_dot_product_attention's math path).
    {"gpt2_dropout", dropout(shape("gpt2", 2, 2, 2, 32, 64, 256, true)), 2, 16, 1},
    {"gpt2_dropout_wide_mlp_accum", dropout(shape("gpt2", 2, 4, 4, 64, 512, 256, true)), 3, 32, 2},
    {"llama_dropout_gqa_untied", dropout(shape("llama", 2, 4, 2, 64, 256, 300, false)), 2, 24, 1},
    // Freeze tuning (LLaMA-Factory's rule, plugins/lora): a frozen prefix keeps only its output,
    // a frozen head no copy of the final norm's output, a frozen tied embedding no gradient; only
    // trainable parameters have gradients and state. Whole segments frozen: exact.
    {"gpt2_freeze_last_block", shape("gpt2", 2, 2, 2, 32, 64, 256, true), 2, 16, 1, nullptr,
     R"({"finetuning_type": "freeze", "freeze_trainable_layers": 1})"},
    {"gpt2_freeze_last_block_and_ln_f_accum", shape("gpt2", 3, 4, 4, 64, 512, 256, true), 3, 32, 2, nullptr,
     R"({"finetuning_type": "freeze", "freeze_trainable_layers": 1, "freeze_extra_modules": "ln_f"})"},
    {"llama_freeze_last_block_untied", shape("llama", 2, 4, 2, 64, 256, 300, false), 2, 24, 1, nullptr,
     R"({"finetuning_type": "freeze", "freeze_trainable_layers": 1})"},
    {"llama_freeze_two_blocks_tied_accum", shape("llama", 3, 2, 2, 32, 96, 256, true), 2, 20, 2, nullptr,
     R"({"finetuning_type": "freeze", "freeze_trainable_layers": 2})"},
    {"llama_freeze_lm_head_untied", shape("llama", 2, 4, 2, 64, 256, 300, false), 2, 24, 1, nullptr,
     R"({"finetuning_type": "freeze", "freeze_trainable_layers": 1, "freeze_extra_modules": "lm_head"})"},
    // Part of a segment frozen, or frozen blocks after trained ones: op by op, a linear layer with a
    // frozen weight keeps no input, a norm no statistics when its input needs no gradient.
    {"gpt2_freeze_first_block_accum", shape("gpt2", 2, 4, 4, 64, 512, 256, true), 3, 32, 2, nullptr,
     R"({"finetuning_type": "freeze", "freeze_trainable_layers": -1})"},
    {"gpt2_freeze_attn_and_ln_f", shape("gpt2", 3, 2, 2, 32, 64, 256, true), 2, 16, 1, nullptr,
     R"({"finetuning_type": "freeze", "freeze_trainable_layers": 1, "freeze_trainable_modules": "attn", "freeze_extra_modules": "ln_f"})"},
    {"llama_freeze_norms_untied_accum", shape("llama", 2, 4, 2, 64, 256, 300, false), 2, 24, 2, nullptr,
     R"({"finetuning_type": "freeze", "freeze_trainable_layers": 1, "freeze_extra_modules": "norm"})"},
    {"llama_freeze_mlp_tied_embedding", shape("llama", 3, 2, 2, 32, 96, 256, true), 2, 20, 1, nullptr,
     R"({"finetuning_type": "freeze", "freeze_trainable_layers": 2, "freeze_trainable_modules": "mlp", "freeze_extra_modules": "embed_tokens"})"},
    {"gpt2_freeze_mlp_accum", shape("gpt2", 2, 4, 4, 64, 512, 256, true), 3, 32, 2, nullptr,
     R"({"finetuning_type": "freeze", "freeze_trainable_layers": 1, "freeze_trainable_modules": "mlp"})"},
    {"llama_freeze_attention_untied", shape("llama", 2, 4, 2, 64, 256, 300, false), 2, 24, 1, nullptr,
     R"({"finetuning_type": "freeze", "freeze_trainable_layers": 2, "freeze_trainable_modules": "self_attn"})"},
    // The chunked head (chunked_cross_entropy): no logits kept, the gradients of the final norm's
    // output and of the head's weight made in forward; with a vocabulary of 32768, chunks of 256
    // tokens (288 tokens: two chunks, the last short), the peak inside them or, when backward
    // holds less, in the embedding's backward (the dense gradient of the token table, a tied one's
    // beside the head's). A small vocabulary: one chunk.
    {"gpt2_chunked_head", shape("gpt2", 2, 2, 2, 32, 64, 32768, true), 6, 48, 1, nullptr, nullptr, true},
    {"gpt2_chunked_head_small_vocab", shape("gpt2", 2, 2, 2, 32, 64, 256, true), 2, 16, 1, nullptr, nullptr, true},
    {"llama_chunked_head_untied_accum", shape("llama", 2, 4, 2, 64, 256, 32768, false), 6, 48, 2, nullptr, nullptr,
     true},
    {"llama_chunked_head_frozen_lm_head", shape("llama", 2, 4, 2, 64, 256, 32768, false), 6, 48, 1, nullptr,
     R"({"finetuning_type": "freeze", "freeze_trainable_layers": 1, "freeze_extra_modules": "lm_head"})", true},
    {"gpt2_chunked_head_frozen_prefix_accum", shape("gpt2", 3, 4, 4, 64, 512, 32768, true), 6, 48, 2, nullptr,
     R"({"finetuning_type": "freeze", "freeze_trainable_layers": 1})", true},
    {"gpt2_chunked_head_bf16", shape("gpt2", 2, 2, 2, 32, 64, 32768, true), 6, 48, 1, R"({"bf16": {"enabled": true}})",
     nullptr, true},
    {"llama_chunked_head_fp16_accum", shape("llama", 2, 4, 2, 64, 256, 32768, false), 6, 48, 2,
     R"({"fp16": {"enabled": true}})", nullptr, true},
};

// The built-in plugins a case names, configured with its options (JSON).
PluginHost plugins(const Case& c) {
  std::vector<PluginSpec> specs;
  for (auto [name, key, options] : {std::tuple{"precision", "bf16", c.precision},
                                    std::tuple{"lora", "finetuning_type", c.freeze}}) {
    if (!options) continue;
    PluginSpec spec;
    spec.name = name;
    spec.config_key = key;
    spec.options = parse_json_text(options, "test");
    specs.push_back(spec);
  }
  return PluginHost::load(specs);
}

class EstimateMatchesMeasurement : public ::testing::TestWithParam<Case> {};

// Every fp32 run's peak is predicted to the byte by the formulas of docs/memory.md: the activation
// terms (what autograd keeps, op by op), backward's working memory, the gradients alive then. In
// 16-bit (the precision plugin) what forward keeps is exact too.
TEST_P(EstimateMatchesMeasurement, ToTheByte) {
  const Case& c = GetParam();
  TrainConfig cfg = config(c);
  const std::string out = cfg.output_dir;
  memory::install_tracking_allocator();
  memory::reset_peak();
  std::ostringstream log;
  Engine engine(std::move(cfg), nullptr, plugins(c), log);
  const TrainSummary s = engine.train();
  fs::remove_all(out);
  const RankMemoryReport& r = s.memory;

  const at::ScalarType dtype = !c.precision                        ? at::kFloat
                              : std::string(c.precision).find("bf16") != std::string::npos ? at::kBFloat16
                                                                                 : at::kHalf;
  const memory::ActivationEstimate a =
      memory::activation_estimate(c.shape, c.micro_batch, c.block_size, dtype, c.chunked);
  const int64_t scaled_loss = dtype == at::kHalf ? 4 : 0;  // fp16: the scaled loss
  if (!c.freeze) {
    EXPECT_EQ(r.activations_kept_bytes, a.kept() + scaled_loss) << "what forward keeps";
    if (dtype == at::kFloat) {
      EXPECT_EQ(r.activations_peak_bytes,
                a.kept() + std::max({a.backward_at_loss, a.backward_in_last_block, a.backward_in_embedding}))
          << "the largest activations cell";
    }
  }
  if (dtype == at::kFloat) {
    for (Category cat : memory::all_categories()) {
      EXPECT_EQ(r.measured.at_peak.category(cat), r.estimate.table.category(cat))
          << memory::to_string(cat) << "\n" << memory_table_text(r, 1);
    }
    EXPECT_EQ(r.measured.peak_bytes, r.estimate.peak_bytes());
  } else {
    // 16-bit: the weights, masters and optimizer state to the byte; the peak within 10% — the
    // CPU flash-attention backward's fp32 working buffers are not modelled (docs/memory.md).
    for (Category cat : {Category::kWeights, Category::kMasterWeights, Category::kOptimizerState}) {
      EXPECT_EQ(r.measured.at_peak.category(cat), r.estimate.table.category(cat))
          << memory::to_string(cat) << "\n" << memory_table_text(r, 1);
    }
    EXPECT_NEAR(static_cast<double>(r.measured.peak_bytes), static_cast<double>(r.estimate.peak_bytes()),
                0.10 * static_cast<double>(r.estimate.peak_bytes()))
        << memory_table_text(r, 1);
  }
  EXPECT_EQ(r.measured.at_peak.category(Category::kUnattributed), 0);
  EXPECT_EQ(r.gradient_bytes_claimed_late, 0) << "every gradient claimed as autograd handed it over";
  EXPECT_TRUE(r.leaks.empty());
  EXPECT_EQ(r.timeline.size(), 3u);
}

INSTANTIATE_TEST_SUITE_P(Shapes, EstimateMatchesMeasurement, ::testing::ValuesIn(kCases),
                         [](const auto& p) { return std::string(p.param.name); });

// GPT-2 124M (Radford et al. 2019; 124,439,808 parameters with the tied head): 4 bytes per
// parameter of fp32 weights, 8 of AdamW moments, 4 of gradients. The textbook's 496 / 992 / 496 MB
// are these per-parameter bytes times 124e6; with the exact count they are 497.8 / 995.5 / 497.8.
// The host's plan with every parameter trainable (no plugin planned otherwise).
memory::MemoryEstimate plan_all(const RunInfo& run, const HostPlanOptions& options) {
  return host_memory_plan(run, options, shape_params(run.shape, options.optimizer.from_ds_config));
}

TEST(Estimate, Gpt2SmallModelStatesAreTheTextbookFigures) {
  RunInfo run;
  run.shape = shape("gpt2", 12, 12, 12, 768, 3072, 50257, true);
  run.shape.n_ctx = 1024;
  run.micro_batch_size = 1;
  run.block_size = 1024;
  run.grad_accum_steps = 2;  // every gradient alive in backward
  HostPlanOptions options;
  options.optimizer.from_ds_config = true;  // DeepSpeed's one group: P is a multiple of 16, so no padding
  const memory::MemoryEstimate e = plan_all(run, options);
  const int64_t P = 124'439'808;
  ASSERT_EQ(P % 16, 0);
  EXPECT_EQ(e.table.at(Category::kWeights), 4 * P);
  EXPECT_EQ(e.table.at(Category::kOptimizerState), 8 * P);
  EXPECT_EQ(e.table.at(Category::kGradients), 4 * P);
  EXPECT_EQ(megabytes(4 * P), "497.759 MB");
  EXPECT_EQ(megabytes(8 * P), "995.518 MB");
  EXPECT_EQ(megabytes(4 * int64_t{124'000'000}), "496.000 MB");  // the textbook's rounded count
}

TEST(Estimate, SgdWithoutMomentumHasNoOptimizerState) {
  RunInfo run;
  run.shape = shape("gpt2", 1, 2, 2, 32, 64, 256, true);
  run.micro_batch_size = 1;
  run.block_size = 8;
  HostPlanOptions sgd;
  sgd.store.optimizer = "SGD";
  sgd.optimizer.from_ds_config = true;  // one group
  EXPECT_EQ(plan_all(run, sgd).table.at(Category::kOptimizerState), 0);
  sgd.store.momentum = 0.9;
  const int64_t P = count_parameters(*build_model(run.shape, BuildOptions{}));
  const int64_t padded = (P + 15) / 16 * 16;  // the group ends on a 64-byte line
  EXPECT_EQ(plan_all(run, sgd).table.at(Category::kOptimizerState), 4 * padded);
}

TEST(Estimate, DataParallelKeepsOneStagingBucketOfGradients) {
  RunInfo run;
  run.shape = shape("gpt2", 1, 2, 2, 32, 64, 256, true);
  run.micro_batch_size = 1;
  run.block_size = 8;
  const int64_t P = count_parameters(*build_model(run.shape, BuildOptions{}));
  EXPECT_EQ(plan_all(run, HostPlanOptions{}).table.at(Category::kCommBuffers), 0);
  run.world_size = 4;
  EXPECT_EQ(plan_all(run, HostPlanOptions{}).table.at(Category::kCommBuffers), 4 * P);
  HostPlanOptions small;
  small.allreduce_bucket_bytes = 1000;  // many buckets: two staging slots of one bucket each
  EXPECT_EQ(plan_all(run, small).table.at(Category::kCommBuffers), 2000);
}

// freeze tuning's module names are checked against the model, as LLaMA-Factory checks them: one
// that matches nothing is an error naming the key and every name there is.
TEST(Estimate, FreezeModulesThatMatchNothingAreErrorsListingTheNames) {
  RunInfo run;
  run.shape = shape("gpt2", 2, 2, 2, 32, 64, 256, true);
  for (auto [options, parts] : {std::pair{R"({"finetuning_type": "freeze", "freeze_trainable_modules": "self_attn"})",
                                          std::vector<std::string>{"freeze_trainable_modules", "\"self_attn\"", "attn, ln_1, ln_2, mlp"}},
                                std::pair{R"({"finetuning_type": "freeze", "freeze_extra_modules": "lm_head"})",
                                          std::vector<std::string>{"freeze_extra_modules", "\"lm_head\"", "ln_f, wpe, wte"}}}) {
    Case c{"freeze_error", run.shape, 1, 8, 1, nullptr, options};
    PluginHost host = plugins(c);
    ConfigDiagnostics diag;
    host.configure(run, diag);
    std::vector<ParamInfo> params = shape_params(run.shape, false);
    try {
      host.plan_params(params, run);
      ADD_FAILURE() << "accepted " << options;
    } catch (const ConfigError& e) {
      for (const std::string& part : parts) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  }
}

// A plugin's estimate_memory() edits the plan; what it changed is its term.
class MastersPlugin final : public Plugin {
 public:
  void estimate_memory(memory::MemoryEstimate& e) const override {
    int64_t n = 0;
    for (const auto& p : e.params) n += p.numel;
    e.table.at(Category::kMasterWeights, memory::Placement::kHost) += 4 * n;
    e.table.at(Category::kWeights) /= 2;
  }
};

TEST(Estimate, EachPluginsChangeIsItsTerm) {
  TrainConfig cfg = config(kCases[0]);
  PluginHost host;
  host.add("masters", "test", std::make_unique<MastersPlugin>());
  host.add("idle", "test", std::make_unique<Plugin>());
  host.order();
  const RunInfo run = make_run_info(cfg, 0, 1, 0);
  const EstimateReport r = estimate_memory(cfg, run, host);
  ASSERT_EQ(r.terms.size(), 2u);  // the host's plan and the plugin that changed something
  EXPECT_EQ(r.terms[0].source, "memrt");
  EXPECT_EQ(r.terms[1].source, "masters");
  const int64_t P = count_parameters(*build_model(run.shape, BuildOptions{}));
  EXPECT_EQ(r.terms[1].delta.at(Category::kMasterWeights, memory::Placement::kHost), 4 * P);
  EXPECT_EQ(r.terms[1].delta.at(Category::kWeights), -2 * P);
  memory::Table sum = r.terms[0].delta;
  for (Category c : memory::all_categories())
    for (auto p : {memory::Placement::kDevice, memory::Placement::kHost})
      sum.at(c, p) += r.terms[1].delta.at(c, p);
  EXPECT_TRUE(sum == r.table);
}

}  // namespace
}  // namespace memrt
