// Activation checkpointing (plugins/checkpoint, docs/checkpointing.md):
//  - the recompute core alone: gradients through checkpointed GPT-2 and Llama blocks, dropout on,
//    equal the plain model's bit for bit in fp32 — and differ when the RNG state is not restored;
//  - the plugin in the engine: a whole training run (accumulation, several steps, every block or
//    every second one, host-offloaded inputs) gives bit-identical gradients at every step, and
//    with bf16 (the precision plugin) too;
//  - memory: what forward keeps is one block input per checkpointed block (the formula, computed
//    here from the plain terms), and every cell at the peak equals the estimate to the byte;
//  - the launcher end to end, and configuration errors naming file and key.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "../../plugins/checkpoint/recompute.h"
#include "../engine/run_helpers.h"
#include "config/load_config.h"
#include "engine/engine.h"
#include "memory/estimate.h"
#include "memory/tracking_allocator.h"
#include "memrt/config_node.h"
#include "models/model_factory.h"

namespace memrt {
namespace {

namespace fs = std::filesystem;
using memory::Category;
using memory::Placement;

ModelShape small_shape(const char* arch, double pdrop) {
  ModelShape s;
  s.arch = arch;
  s.n_layer = 3;
  s.n_head = 4;
  s.n_kv_head = std::string(arch) == "llama" ? 2 : 4;  // Llama with grouped-query attention
  s.d_model = 32;
  s.d_ff = 64;
  s.vocab_size = 256;  // the built-in corpus is bytes
  s.n_ctx = 16;
  s.tie_embeddings = std::string(arch) == "gpt2";
  s.attn_pdrop = pdrop;
  if (s.arch == "gpt2") s.embd_pdrop = s.resid_pdrop = pdrop;
  return s;
}

// ---- the core: one forward and backward, plain against checkpointed ------------------------------

std::vector<at::Tensor> grads_of_one_step(const ModelShape& shape, bool checkpointed,
                                          bool preserve_rng = true) {
  auto model = build_model(shape, BuildOptions{});  // same seed: same weights every call
  at::manual_seed(1234);
  const at::Tensor tokens = at::randint(shape.vocab_size, {2, shape.n_ctx}, at::kLong);
  at::manual_seed(99);  // the dropout masks' stream
  at::Tensor h = model->embed(tokens);
  checkpoint::RecomputeOptions options;
  options.preserve_rng_state = preserve_rng;
  for (int64_t i = 0; i < model->num_blocks(); ++i) {
    Block* block = &model->block(i);
    auto fn = [block](const at::Tensor& t) { return block->forward(t); };
    h = checkpointed ? checkpoint::checkpoint(fn, h, options) : fn(h);
  }
  at::Tensor loss = causal_lm_loss(model->head(h), tokens);
  loss.backward();
  std::vector<at::Tensor> grads;
  for (const auto& p : model->parameters()) grads.push_back(p.grad().clone());
  return grads;
}

bool all_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!at::equal(a[i], b[i])) return false;
  return true;
}

TEST(Recompute, GradientsEqualThePlainModelsBitwiseWithDropout) {
  for (const char* arch : {"gpt2", "llama"}) {
    SCOPED_TRACE(arch);
    const ModelShape s = small_shape(arch, 0.1);
    const auto plain = grads_of_one_step(s, false);
    const auto recomputed = grads_of_one_step(s, true);
    EXPECT_TRUE(all_equal(plain, recomputed));
    // The controls: dropout is really on (other masks give other gradients), and restoring the
    // generators is what makes the recompute draw the same masks.
    const auto no_dropout = grads_of_one_step(small_shape(arch, 0.0), false);
    EXPECT_FALSE(all_equal(plain, no_dropout));
    EXPECT_FALSE(all_equal(plain, grads_of_one_step(s, true, /*preserve_rng=*/false)));
    // Without dropout the generators do not matter.
    EXPECT_TRUE(all_equal(no_dropout, grads_of_one_step(small_shape(arch, 0.0), true, false)));
  }
}

// ---- the plugin in the engine --------------------------------------------------------------------

TrainConfig engine_config(const std::string& name, const ModelShape& shape, int64_t accum) {
  TrainConfig cfg;
  cfg.micro_batch_size = 2;
  cfg.grad_accum_steps = accum;
  cfg.train_batch_size = 2 * accum;
  cfg.gradient_clipping = 1.0;
  cfg.steps_per_print = 100;
  cfg.max_steps = 3;
  cfg.seed = 5;
  cfg.optimizer.type = "AdamW";
  cfg.optimizer.lr = 1e-2;
  cfg.model.shape = shape;
  cfg.data.block_size = shape.n_ctx;
  cfg.output_dir = (fs::temp_directory_path() /
                    ("memrt_ckpt_" + name + "_" + std::to_string(getpid()))).string();
  return cfg;
}

PluginSpec spec(const char* name, const char* key, const std::string& json) {
  PluginSpec s;
  s.name = name;
  s.config_key = key;
  s.options = parse_json_text(json, "test.json");
  return s;
}

// Every step's gradients (as the host clips them), as raw bytes in plain heap memory: copies
// allocated through LibTorch would show in the memory report this test also checks.
using Bytes = std::vector<std::vector<uint8_t>>;
class GradRecorder final : public Plugin {
 public:
  explicit GradRecorder(std::vector<Bytes>* out) : out_(out) {}
  void before_optimizer_step(StepContext& c) override {  // after precision's unscale (300 < 1000)
    Bytes step;
    for (const at::Tensor& t : c.grads) {
      const auto* p = static_cast<const uint8_t*>(t.data_ptr());  // .grad is contiguous
      step.emplace_back(p, p + t.nbytes());
    }
    out_->push_back(std::move(step));
  }

 private:
  std::vector<Bytes>* out_;
};

struct Trained {
  std::vector<Bytes> grads;  // per step
  RankMemoryReport memory;
};

Trained train(TrainConfig cfg, std::vector<PluginSpec> specs) {
  Trained t;
  PluginHost host = PluginHost::load(specs);
  host.add("grad_recorder", "test", std::make_unique<GradRecorder>(&t.grads));
  host.order();
  const std::string out = cfg.output_dir;
  memory::install_tracking_allocator();
  memory::reset_peak();
  std::ostringstream log;
  Engine engine(std::move(cfg), nullptr, std::move(host), log);
  t.memory = engine.train().memory;
  fs::remove_all(out);
  return t;
}

std::string ckpt_options(const std::string& section) {
  return R"({"gradient_checkpointing": true, "activation_checkpointing": )" + section + "}";
}

struct EngineCase {
  const char* name;
  const char* arch;
  int64_t accum;
  const char* section;  // activation_checkpointing
};

const EngineCase kEngineCases[] = {
    {"gpt2_every_block", "gpt2", 2, "{}"},
    {"gpt2_every_second_offloaded", "gpt2", 1, R"({"every_n_blocks": 2, "cpu_checkpointing": true})"},
    {"llama_every_block_offloaded", "llama", 1, R"({"cpu_checkpointing": true})"},
    {"llama_every_second", "llama", 2, R"({"every_n_blocks": 2})"},
};

class CheckpointedTraining : public ::testing::TestWithParam<EngineCase> {};

// Three optimizer steps with dropout on: bit-identical gradients at every step (the recompute's
// generator draws are also hidden from the rest of the run), and the peak's every cell as the
// estimate says, to the byte.
TEST_P(CheckpointedTraining, GradientsBitwiseAndMemoryToTheByte) {
  const EngineCase& c = GetParam();
  const ModelShape s = small_shape(c.arch, 0.1);
  const Trained plain = train(engine_config(std::string(c.name) + "_plain", s, c.accum), {});
  const Trained ckpt = train(engine_config(c.name, s, c.accum),
                             {spec("checkpoint", "activation_checkpointing", ckpt_options(c.section))});
  ASSERT_EQ(plain.grads.size(), 3u);
  ASSERT_EQ(ckpt.grads.size(), 3u);
  for (size_t step = 0; step < 3; ++step) EXPECT_TRUE(plain.grads[step] == ckpt.grads[step]) << "step " << step;

  // What forward keeps, from the plain run's terms: a checkpointed block keeps its output (the
  // next block's saved input) instead of its intermediates.
  const memory::ActivationEstimate a = memory::activation_estimate(s, 2, s.n_ctx, at::kFloat);
  const int64_t every = std::string(c.section).find("every_n_blocks") != std::string::npos ? 2 : 1;
  const int64_t input = 2 * s.n_ctx * s.d_model * 4;
  int64_t kept = a.embedding + a.head;
  for (int64_t i = 0; i < s.n_layer; ++i) kept += (i + 1) % every == 0 ? input : a.per_block[i];
  EXPECT_EQ(plain.memory.activations_kept_bytes, a.kept());
  EXPECT_EQ(ckpt.memory.activations_kept_bytes, kept);
  EXPECT_LT(ckpt.memory.activations_kept_bytes, plain.memory.activations_kept_bytes);

  const RankMemoryReport& r = ckpt.memory;
  for (Category cat : memory::all_categories()) {
    for (Placement pl : {Placement::kDevice, Placement::kHost}) {
      EXPECT_EQ(r.measured.at_peak.at(cat, pl), r.estimate.table.at(cat, pl))
          << memory::to_string(cat) << "/" << memory::to_string(pl) << "\n" << memory_table_text(r, 1);
    }
  }
  EXPECT_EQ(r.measured.peak_bytes, r.estimate.peak_bytes());
  const bool offload = std::string(c.section).find("cpu_checkpointing") != std::string::npos;
  EXPECT_EQ(r.measured.at_peak.at(Category::kActivations, Placement::kHost) > 0, offload);
  EXPECT_EQ(r.measured.at_peak.category(Category::kUnattributed), 0);
  EXPECT_TRUE(r.leaks.empty());
}

INSTANTIATE_TEST_SUITE_P(Runs, CheckpointedTraining, ::testing::ValuesIn(kEngineCases),
                         [](const auto& p) { return std::string(p.param.name); });

// With the precision plugin: the recompute runs in bf16 and the gradients still match bit for bit.
TEST(CheckpointedTraining, ComposesWithBf16) {
  for (const char* arch : {"gpt2", "llama"}) {
    SCOPED_TRACE(arch);
    const ModelShape s = small_shape(arch, 0.1);
    const PluginSpec bf16 = spec("precision", "bf16", R"({"bf16": {"enabled": true}})");
    const Trained plain = train(engine_config(std::string("bf16_plain_") + arch, s, 2), {bf16});
    const Trained ckpt = train(engine_config(std::string("bf16_") + arch, s, 2),
                               {bf16, spec("checkpoint", "activation_checkpointing", ckpt_options("{}"))});
    ASSERT_EQ(ckpt.grads.size(), 3u);
    for (size_t step = 0; step < 3; ++step) EXPECT_TRUE(plain.grads[step] == ckpt.grads[step]) << "step " << step;
    EXPECT_LT(ckpt.memory.activations_kept_bytes, plain.memory.activations_kept_bytes);
  }
}

// ---- the launcher --------------------------------------------------------------------------------

using memrt_test::kLauncher;
using memrt_test::run;
using memrt_test::RunResult;

struct Files {
  fs::path dir;
  explicit Files(const std::string& name)
      : dir(fs::temp_directory_path() / ("memrt_ckpt_e2e_" + name + "_" + std::to_string(getpid()))) {
    fs::create_directories(dir);
  }
  ~Files() { fs::remove_all(dir); }
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(dir / name) << text;
    return (dir / name).string();
  }
  RunResult launch(const std::string& ds, const std::string& yaml, const std::string& extra = "") const {
    return run(kLauncher + " " + extra + " --deepspeed " + write("ds.json", ds) + " " +
               write("train.yaml", yaml) + " --output_dir=" + (dir / "out").string());
  }
};

const char* kYaml = R"(model: {arch: gpt2, n_layer: 4, n_head: 2, d_model: 32, d_ff: 64, vocab_size: 256, n_ctx: 32,
        embd_pdrop: 0.1, attn_pdrop: 0.1, resid_pdrop: 0.1}
block_size: 32
max_steps: 4
logging_steps: 2
gradient_checkpointing: true
)";

TEST(CheckpointLauncher, TrainsWithOffloadEstimateEqualsPeakAndWarnsOnceForPartitioning) {
  Files f("run");
  const RunResult r = f.launch(R"({"train_micro_batch_size_per_gpu": 2,
      "activation_checkpointing": {"partition_activations": true, "cpu_checkpointing": true,
                                   "every_n_blocks": 2, "profile": true}})", kYaml);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  size_t warnings = 0;
  for (size_t at = r.out.find("partition_activations"); at != std::string::npos;
       at = r.out.find("partition_activations", at + 1))
    ++warnings;
  EXPECT_EQ(warnings, 1u) << r.out;
  EXPECT_NE(r.out.find("checkpoint_recompute_ms"), std::string::npos) << r.out;  // profile
  EXPECT_NE(r.out.find("(+0.0% against the estimate"), std::string::npos) << r.out;
  const std::string report = memrt_test::slurp(f.dir / "out" / "memory_report.json");
  EXPECT_NE(report.find("\"source\": \"checkpoint\""), std::string::npos) << report;
}

TEST(CheckpointLauncher, BadOptionsNameTheFileAndKey) {
  Files f("bad");
  struct Bad {
    std::string ds, yaml_extra, file, key;
  };
  const std::vector<Bad> bad = {
      {R"({"train_micro_batch_size_per_gpu": 2, "activation_checkpointing": {"every_n_blocks": 0}})", "",
       "ds.json", "activation_checkpointing.every_n_blocks"},
      {R"({"train_micro_batch_size_per_gpu": 2, "activation_checkpointing": {"every_n_blocks": 5}})", "",
       "ds.json", "activation_checkpointing.every_n_blocks"},
      {R"({"train_micro_batch_size_per_gpu": 2, "activation_checkpointing": {"every_n_block": 2}})", "",
       "ds.json", "every_n_blocks"},
      {R"({"train_micro_batch_size_per_gpu": 2})", "gradient_checkpointing_kwargs: {use_reentrnt: false}\n",
       "train.yaml", "use_reentrant"},
      {R"({"train_micro_batch_size_per_gpu": 2})", "gradient_checkpointing_kwargs: {determinism_check: none}\n",
       "train.yaml", "gradient_checkpointing_kwargs.determinism_check"},
  };
  for (const Bad& b : bad) {
    const RunResult r = f.launch(b.ds, std::string(kYaml) + b.yaml_extra, "--estimate");
    EXPECT_NE(r.exit_code, 0) << b.ds << b.yaml_extra;
    EXPECT_NE(r.out.find(b.file), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(b.key), std::string::npos) << r.out;
  }
  // Dropout probabilities are read strictly too.
  std::string yaml = kYaml;
  yaml.replace(yaml.find("attn_pdrop: 0.1"), 15, "attn_pdrop: 1.5");
  RunResult r = f.launch(R"({"train_micro_batch_size_per_gpu": 2})", yaml, "--estimate");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("model.attn_pdrop"), std::string::npos) << r.out;
  yaml = kYaml;
  yaml.replace(yaml.find("arch: gpt2"), 10, "arch: llama");
  r = f.launch(R"({"train_micro_batch_size_per_gpu": 2})", yaml, "--estimate");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("model.attn_pdrop"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("attention_dropout"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace memrt
