// Models: golden logits and loss against an independent PyTorch reference, Hugging Face names,
// checkpoint directories (load, save, strictness), initialisation, block-by-block materialisation.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>
#include <torch/nn/modules/linear.h>

#include "memrt/safetensors.h"
#include "memrt/error.h"
#include "models/hf_checkpoint.h"
#include "models/model_factory.h"
#include "test_util.h"

namespace memrt {
namespace {
using namespace memrt_test;

std::shared_ptr<CausalLM> load(const std::string& dir, BuildOptions options = {}) {
  options.weights_dir = dir;
  return build_model(read_hf_config(dir), options);
}

at::Tensor blockwise_logits(CausalLM& model, const at::Tensor& tokens) {  // (B, T) -> (B, T, V)
  at::Tensor h = model.embed(tokens);                                     // (B, T, C)
  for (int64_t i = 0; i < model.num_blocks(); ++i) h = model.block(i).forward(h);
  return model.head(h);
}

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

std::map<std::string, at::Tensor> params_of(const CausalLM& model) {
  std::map<std::string, at::Tensor> m;
  for (const auto& p : model.named_parameters()) m[p.key()] = p.value();
  return m;
}

// ---- golden ---------------------------------------------------------------------------------

class Golden : public ::testing::TestWithParam<const char*> {};

TEST_P(Golden, LogitsAndLossMatchTheIndependentReference) {
  const std::string root = golden_models_dir();
  ASSERT_FALSE(root.empty());
  const std::string dir = root + "/" + GetParam();
  SafetensorsFile golden = SafetensorsFile::open(dir + "/golden.safetensors");
  at::Tensor tokens = golden.tensor("tokens");  // (B, T+1) int64
  const int64_t T = tokens.size(1) - 1;
  at::Tensor inputs = tokens.narrow(1, 0, T), targets = tokens.narrow(1, 1, T);

  auto model = load(dir);
  at::Tensor logits = blockwise_logits(*model, inputs);  // (B, T, V)
  ASSERT_EQ(logits.sizes(), golden.tensor("logits").sizes());
  const double logits_diff = max_abs_diff(logits, golden.tensor("logits"));
  EXPECT_LT(logits_diff, 1e-5);
  std::printf("%s: max |logits - reference| = %.3g\n", GetParam(), logits_diff);
  at::Tensor loss = causal_lm_loss(logits, targets);
  EXPECT_EQ(loss.dim(), 0);
  EXPECT_LT(std::abs(loss.item<double>() - golden.tensor("loss").item<double>()), 1e-5);
  // The plain forward is the same path.
  EXPECT_EQ(max_abs_diff(model->forward(inputs), logits), 0.0);

  // Every parameter receives a gradient.
  causal_lm_loss(model->forward(inputs), targets).backward();
  for (const auto& p : model->named_parameters()) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_TRUE(p.value().grad().isfinite().all().item<bool>()) << p.key();
  }
}

INSTANTIATE_TEST_SUITE_P(Models, Golden, ::testing::Values("gpt2", "llama", "llama_tied_bf16"));

// ---- names and counts -------------------------------------------------------------------------

TEST(Models, ParameterNamesAreHuggingFaces) {
  const std::string root = golden_models_dir();
  ASSERT_FALSE(root.empty());
  for (const char* name : {"gpt2", "llama", "llama_tied_bf16"}) {
    SCOPED_TRACE(name);
    const std::string dir = root + "/" + name;
    auto model = load(dir);
    std::vector<std::string> got, want;
    for (const auto& p : model->named_parameters()) got.push_back(p.key());
    for (const auto& s : parameter_specs(model->shape())) want.push_back(s.name);
    EXPECT_EQ(got, want);
    // Exactly the names in the checkpoint written by the Python reference.
    std::set<std::string> on_disk;
    HfWeights weights = HfWeights::open(dir);
    for (const auto& [n, file] : weights.files_by_name()) on_disk.insert(n);
    EXPECT_EQ(std::set<std::string>(got.begin(), got.end()), on_disk);
  }
  auto gpt2 = load(root + "/gpt2");
  EXPECT_EQ(gpt2->block(1).hf_prefix(), "transformer.h.1");
  EXPECT_EQ(gpt2->block(0).linear_names(),
            (std::vector<std::string>{"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}));
  auto llama = load(root + "/llama");
  EXPECT_EQ(llama->block(0).hf_prefix(), "model.layers.0");
  EXPECT_EQ(params_of(*llama).at("model.layers.1.self_attn.k_proj.weight").sizes(),
            at::IntArrayRef({16, 32}));  // GQA: 2 kv heads x head_dim 8
}

int64_t spec_params(const ModelShape& s) {
  int64_t n = 0;
  for (const auto& p : parameter_specs(s)) n += p.numel();
  return n;
}

TEST(Models, ParameterCountsMatchPublishedSizes) {
  ModelShape gpt2;  // GPT-2 small: 124,439,808 parameters (tied head)
  gpt2.arch = "gpt2";
  gpt2.n_layer = 12, gpt2.n_head = 12, gpt2.n_kv_head = 12, gpt2.d_model = 768, gpt2.d_ff = 3072;
  gpt2.vocab_size = 50257, gpt2.n_ctx = 1024;
  EXPECT_EQ(spec_params(gpt2), 124439808);

  ModelShape llama2;  // Llama-2-7B: 6,738,415,616 parameters (untied head)
  llama2.arch = "llama";
  llama2.n_layer = 32, llama2.n_head = 32, llama2.n_kv_head = 32, llama2.d_model = 4096;
  llama2.d_ff = 11008, llama2.vocab_size = 32000, llama2.n_ctx = 4096;
  llama2.tie_embeddings = false;
  EXPECT_EQ(spec_params(llama2), 6738415616);

  ModelShape tiny = llama2;  // TinyLlama-1.1B: 1,100,048,384 parameters (GQA, 4 kv heads)
  tiny.n_layer = 22, tiny.d_model = 2048, tiny.d_ff = 5632, tiny.n_kv_head = 4, tiny.n_ctx = 2048;
  EXPECT_EQ(spec_params(tiny), 1100048384);

  // count_parameters on a built model counts the tied embedding once.
  ModelShape small = gpt2;
  small.n_layer = 2, small.d_model = 64, small.n_head = 4, small.n_kv_head = 4, small.d_ff = 256;
  small.vocab_size = 100, small.n_ctx = 32;
  auto model = build_model(small, {});
  const int64_t C = 64, F = 256, V = 100, P = 32, L = 2;  // hand-derived
  EXPECT_EQ(count_parameters(*model),
            V * C + P * C + L * (2 * 2 * C + (3 * C * C + 3 * C) + (C * C + C) + (C * F + F) +
                                 (F * C + C)) + 2 * C);
}

// ---- initialisation ----------------------------------------------------------------------------

TEST(Models, InitialisationFollowsHuggingFace) {
  ModelShape s;
  s.arch = "gpt2", s.n_layer = 8, s.d_model = 128, s.n_head = 4, s.n_kv_head = 4, s.d_ff = 512;
  s.vocab_size = 512, s.n_ctx = 64;
  BuildOptions opt;
  opt.init_std = 0.05;
  opt.seed = 7;
  auto a = build_model(s, opt);
  auto pa = params_of(*a);
  auto std_of = [](const at::Tensor& t) { return t.std().item<double>(); };
  EXPECT_NEAR(std_of(pa.at("transformer.wte.weight")), 0.05, 0.05 * 0.03);
  EXPECT_NEAR(std_of(pa.at("transformer.h.3.attn.c_attn.weight")), 0.05, 0.05 * 0.03);
  EXPECT_NEAR(std_of(pa.at("transformer.h.3.mlp.c_fc.weight")), 0.05, 0.05 * 0.03);
  const double scaled = 0.05 / std::sqrt(2.0 * 8);
  EXPECT_NEAR(std_of(pa.at("transformer.h.3.attn.c_proj.weight")), scaled, scaled * 0.05);
  EXPECT_NEAR(std_of(pa.at("transformer.h.3.mlp.c_proj.weight")), scaled, scaled * 0.03);
  EXPECT_TRUE(at::equal(pa.at("transformer.h.3.attn.c_attn.bias"), at::zeros({3 * 128})));
  EXPECT_TRUE(at::equal(pa.at("transformer.h.0.ln_1.weight"), at::ones({128})));
  EXPECT_TRUE(at::equal(pa.at("transformer.ln_f.bias"), at::zeros({128})));

  auto b = build_model(s, opt);  // same seed: same weights
  for (const auto& [name, t] : params_of(*b)) EXPECT_TRUE(at::equal(t, pa.at(name))) << name;
  opt.seed = 8;
  auto c = build_model(s, opt);
  EXPECT_FALSE(at::equal(params_of(*c).at("transformer.h.0.mlp.c_fc.weight"),
                         pa.at("transformer.h.0.mlp.c_fc.weight")));

  ModelShape l = s;
  l.arch = "llama", l.n_kv_head = 2, l.tie_embeddings = false;
  auto llama = build_model(l, opt);
  auto pl = params_of(*llama);
  EXPECT_TRUE(at::equal(pl.at("model.layers.2.input_layernorm.weight"), at::ones({128})));
  EXPECT_TRUE(at::equal(pl.at("model.norm.weight"), at::ones({128})));
  EXPECT_NEAR(std_of(pl.at("lm_head.weight")), 0.05, 0.05 * 0.03);
  EXPECT_NEAR(std_of(pl.at("model.layers.2.mlp.down_proj.weight")), 0.05, 0.05 * 0.03);
}

// A 16-bit tensor is initialised a chunk at a time through an fp32 buffer: the numbers are those a
// single fp32 at::normal_ over the whole draws from the same generator (sizes on and off its blocks
// of 16, chunks that do and do not divide them), and the generator is left where that draw leaves
// it. build_model makes a frozen bf16 token embedding and head that way, with no fp32 copy: their
// values are the fp32 build's, rounded.
TEST(Models, ChunkedInitialisationDrawsWhatOneDrawDoes) {
  for (int64_t n : {1, 15, 16, 17, 40, 64, 1000, 4099})
    for (int64_t chunk : {int64_t{16}, int64_t{48}, int64_t{100}, int64_t{1} << 20}) {
      at::Generator g1 = at::detail::createCPUGenerator(5), g2 = at::detail::createCPUGenerator(5);
      const at::Tensor whole = at::empty({n}).normal_(0.0, 0.02, g1);
      const at::Tensor chunked = at::empty({n});
      normal_in_chunks(chunked, 0.02, g2, chunk);
      EXPECT_TRUE(at::equal(chunked, whole)) << n << " elements, chunks of " << chunk;
      EXPECT_TRUE(at::equal(at::empty({8}).normal_(0.0, 1.0, g2), at::empty({8}).normal_(0.0, 1.0, g1)))
          << n << " elements, chunks of " << chunk;
    }
  ModelShape l;
  l.arch = "llama", l.n_layer = 2, l.d_model = 64, l.n_head = 4, l.n_kv_head = 2, l.d_ff = 128;
  l.vocab_size = 300, l.n_ctx = 16, l.tie_embeddings = false;
  BuildOptions opt;
  opt.seed = 3;
  const auto fp32 = params_of(*build_model(l, opt));
  opt.frozen_dtypes = {{"model.embed_tokens.weight", at::kBFloat16}, {"lm_head.weight", at::kBFloat16}};
  const auto bf16 = params_of(*build_model(l, opt));
  for (const char* name : {"model.embed_tokens.weight", "lm_head.weight"}) {
    EXPECT_EQ(bf16.at(name).scalar_type(), at::kBFloat16) << name;
    EXPECT_TRUE(at::equal(bf16.at(name), fp32.at(name).to(at::kBFloat16))) << name;
  }
  EXPECT_TRUE(at::equal(bf16.at("model.layers.1.mlp.up_proj.weight"), fp32.at("model.layers.1.mlp.up_proj.weight")));
}

TEST(Models, BadShapesAreConfigErrors) {
  ModelShape s;
  s.arch = "bert";
  EXPECT_THROW(build_model(s, {}), ConfigError);
  s = ModelShape{};
  s.d_model = 130;  // not divisible by 4 heads
  EXPECT_THROW(build_model(s, {}), ConfigError);
  s = ModelShape{};
  s.arch = "llama", s.n_head = 4, s.n_kv_head = 3;
  EXPECT_THROW(build_model(s, {}), ConfigError);
  s = ModelShape{};
  s.n_kv_head = 2;  // gpt2 has no GQA
  try {
    build_model(s, {});
    ADD_FAILURE();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("n_kv_head"), std::string::npos) << e.what();
  }
}

// ---- block by block ----------------------------------------------------------------------------

// Counts live CPU bytes allocated through LibTorch (c10::SetCPUAllocator).
class CountingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    void* p = c10::alloc_cpu(n);
    std::lock_guard<std::mutex> lock(mutex());
    sizes()[p] = n;
    live() += static_cast<int64_t>(n);
    return {p, p, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  static int64_t& live() {
    static int64_t bytes = 0;
    return bytes;
  }

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::unordered_map<void*, size_t>& sizes() {
    static std::unordered_map<void*, size_t> s;
    return s;
  }
  static void release(void* p) {
    {
      std::lock_guard<std::mutex> lock(mutex());
      auto it = sizes().find(p);
      if (it != sizes().end()) {
        live() -= static_cast<int64_t>(it->second);
        sizes().erase(it);
      }
    }
    c10::free_cpu(p);
  }
};

TEST(Models, OnBlockReadyRunsOncePerBlockInOrderBeforeTheNextBlockExists) {
  for (const char* arch : {"gpt2", "llama"}) {
    SCOPED_TRACE(arch);
    ModelShape s;
    s.arch = arch, s.n_layer = 5, s.d_model = 256, s.n_head = 4, s.n_kv_head = 4, s.d_ff = 1024;
    s.vocab_size = 64, s.n_ctx = 16;
    int64_t block_bytes = 0, embed_bytes = 0;  // fp32 bytes of block 0, and before block 0
    for (const auto& p : parameter_specs(s)) {
      if (p.block == 0) block_bytes += p.numel() * 4;
      const bool embedding = p.name == "transformer.wte.weight" ||
                             p.name == "transformer.wpe.weight" ||
                             p.name == "model.embed_tokens.weight";
      if (embedding) embed_bytes += p.numel() * 4;
    }
    static CountingAllocator counting;
    c10::Allocator* previous = c10::GetCPUAllocator();
    c10::SetCPUAllocator(&counting, /*priority=*/100);
    const int64_t base = CountingAllocator::live();
    std::vector<int64_t> order, live_at_call;
    std::vector<std::string> prefixes;
    BuildOptions opt;
    opt.on_block_ready = [&](int64_t i, Block& b, const CheckpointReader*) {
      order.push_back(i);
      prefixes.push_back(b.hf_prefix());
      live_at_call.push_back(CountingAllocator::live() - base);
      // Its weights are final when the callback runs (not the Linear's default init).
      for (const auto& p : b.named_parameters()) {
        const bool norm = p.key().find("norm") != std::string::npos ||
                          p.key().find("ln_") != std::string::npos;
        if (norm && p.key().find("weight") != std::string::npos) {
          EXPECT_TRUE(at::equal(p.value(), at::ones_like(p.value()))) << p.key();
        }
      }
    };
    auto model = build_model(s, opt);
    c10::SetCPUAllocator(previous, /*priority=*/100);

    EXPECT_EQ(order, (std::vector<int64_t>{0, 1, 2, 3, 4}));
    for (int64_t i = 0; i < 5; ++i)
      EXPECT_EQ(prefixes[i], std::string(std::string(arch) == "gpt2" ? "transformer.h."
                                                                      : "model.layers.") +
                                 std::to_string(i));
    // At callback i, blocks 0..i exist and block i+1 does not: live bytes are the embeddings plus
    // i+1 blocks, well under i+2 blocks.
    for (size_t i = 0; i < live_at_call.size(); ++i) {
      const int64_t present = embed_bytes + static_cast<int64_t>(i + 1) * block_bytes;
      EXPECT_GE(live_at_call[i], present) << "block " << i;
      EXPECT_LT(live_at_call[i], present + block_bytes / 2) << "block " << i;
    }
  }
}

// A LoRA-style wrapper: the original Linear as "base_layer" plus a low-rank update B A x.
struct LowRankImpl : torch::nn::Module {
  LowRankImpl(Linear base, int64_t r) : base_layer(register_module("base_layer", base)) {
    A = register_parameter("lora_A", at::randn({r, base->weight.size(1)}));  // (r, in)
    B = register_parameter("lora_B", at::zeros({base->weight.size(0), r}));  // (out, r)
  }
  at::Tensor forward(const at::Tensor& x) {
    return base_layer(x) + at::linear(at::linear(x, A), B);
  }
  Linear base_layer;
  at::Tensor A, B;
};
TORCH_MODULE(LowRank);

TEST(Models, ProjectionsCanBeReplacedByPlugins) {
  const std::string root = golden_models_dir();
  ASSERT_FALSE(root.empty());
  auto model = load(root + "/llama");
  at::Tensor tokens = at::randint(0, 67, {1, 6}, at::kLong);
  at::Tensor before = model->forward(tokens);
  Block& block = model->block(1);
  auto q = block.linear("self_attn.q_proj").get<Linear>();
  LowRank lora(q, 2);
  block.replace_linear("self_attn.q_proj", torch::nn::AnyModule(lora));
  auto names = params_of(*model);
  EXPECT_TRUE(names.count("model.layers.1.self_attn.q_proj.base_layer.weight"));
  EXPECT_TRUE(names.count("model.layers.1.self_attn.q_proj.lora_B"));
  EXPECT_FALSE(names.count("model.layers.1.self_attn.q_proj.weight"));
  EXPECT_LT(max_abs_diff(model->forward(tokens), before), 1e-6);  // B = 0: same function
  {
    at::NoGradGuard g;
    lora->B.fill_(0.1);
  }
  EXPECT_GT(max_abs_diff(model->forward(tokens), before), 1e-3);  // the block calls the wrapper
  EXPECT_THROW(block.replace_linear("self_attn.nope", torch::nn::AnyModule(lora)), Error);
  // A replaced projection cannot be saved as a plain HF checkpoint.
  EXPECT_THROW(save_hf_checkpoint(*model, scratch_dir() + "/out"), Error);
}

// ---- checkpoint directories -------------------------------------------------------------------

void copy_dir(const std::string& from, const std::string& to) {
  fs::create_directories(to);
  for (const auto& e : fs::directory_iterator(from))
    if (e.path().filename() != "golden.safetensors")
      fs::copy_file(e.path(), fs::path(to) / e.path().filename(),
                    fs::copy_options::overwrite_existing);
}

TEST(HfCheckpoint, ReadsConfigJson) {
  const std::string root = golden_models_dir();
  ASSERT_FALSE(root.empty());
  ModelShape g = read_hf_config(root + "/gpt2");
  EXPECT_EQ(g.arch, "gpt2");
  EXPECT_EQ(g.n_layer, 2);
  EXPECT_EQ(g.d_model, 32);
  EXPECT_EQ(g.d_ff, 48);
  EXPECT_EQ(g.n_ctx, 16);
  EXPECT_EQ(g.vocab_size, 61);
  EXPECT_TRUE(g.tie_embeddings);
  ModelShape l = read_hf_config(root + "/llama");
  EXPECT_EQ(l.arch, "llama");
  EXPECT_EQ(l.n_kv_head, 2);
  EXPECT_EQ(l.d_ff, 56);
  EXPECT_DOUBLE_EQ(l.rope_theta, 500.0);
  EXPECT_DOUBLE_EQ(l.norm_eps, 1e-5);
  EXPECT_FALSE(l.tie_embeddings);
}

void expect_config_error(const std::string& dir, const std::string& json,
                         const std::vector<std::string>& parts) {
  std::ofstream(dir + "/config.json") << json;
  try {
    read_hf_config(dir);
    ADD_FAILURE() << "accepted " << json;
  } catch (const ConfigError& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

TEST(HfCheckpoint, UnsupportedConfigsAreClearErrors) {
  const std::string dir = scratch_dir();
  EXPECT_THROW(read_hf_config(dir), FileError);  // no config.json
  expect_config_error(dir, R"({"model_type": "bert"})", {"config.json", "model_type", "bert"});
  expect_config_error(dir, R"({"n_layer": 2})", {"model_type", "missing"});
  expect_config_error(dir, R"({"model_type": "gpt2", "activation_function": "relu"})",
                      {"activation_function", "relu", "gelu_new"});
  expect_config_error(dir, R"({"model_type": "llama", "rope_scaling": {"type": "linear", "factor": 2}})",
                      {"rope_scaling"});
  expect_config_error(dir, R"({"model_type": "llama", "hidden_act": "gelu"})", {"hidden_act"});
  expect_config_error(dir, R"({"model_type": "llama", "attention_bias": true})", {"attention_bias"});
  expect_config_error(dir, R"({"model_type": "llama", "num_key_value_heads": 5})", {"n_kv_head"});
  expect_config_error(dir, R"({"model_type": "gpt2", "n_layer": "two"})", {"n_layer", "integer"});
  std::ofstream(dir + "/config.json") << "{ not json";
  EXPECT_THROW(read_hf_config(dir), FileError);
}

TEST(HfCheckpoint, SaveThenLoadEqualsTheOriginal) {
  const std::string root = golden_models_dir();
  ASSERT_FALSE(root.empty());
  const std::string out = scratch_dir();
  for (const char* name : {"gpt2", "llama", "llama_tied_bf16"}) {
    for (int64_t shard_bytes : {int64_t{0}, int64_t{20000}}) {
      SCOPED_TRACE(std::string(name) + " shard " + std::to_string(shard_bytes));
      auto original = load(root + "/" + name);
      const std::string dir = out + "/" + name + "_" + std::to_string(shard_bytes);
      save_hf_checkpoint(*original, dir, shard_bytes);
      EXPECT_EQ(fs::exists(dir + "/model.safetensors"), shard_bytes == 0);
      EXPECT_EQ(fs::exists(dir + "/model.safetensors.index.json"), shard_bytes != 0);
      auto reloaded = load(dir);
      auto a = params_of(*original), b = params_of(*reloaded);
      ASSERT_EQ(a.size(), b.size());
      for (const auto& [k, t] : a) EXPECT_TRUE(at::equal(t, b.at(k))) << k;
      EXPECT_EQ(read_hf_config(dir).n_kv_head, original->shape().n_kv_head);
      // Saving the other layout into the same folder replaces the weight files.
      save_hf_checkpoint(*original, dir, shard_bytes == 0 ? 20000 : 0);
      EXPECT_EQ(fs::exists(dir + "/model.safetensors"), shard_bytes != 0);
      auto again = load(dir);
      EXPECT_TRUE(at::equal(params_of(*again).begin()->second, a.begin()->second));
    }
  }
  // The Python package reads both layouts with the reference's names and values.
  std::string log;
  fs::create_directories(out + "/py");
  save_hf_checkpoint(*load(root + "/gpt2"), out + "/py/single");
  save_hf_checkpoint(*load(root + "/gpt2"), out + "/py/sharded", 10000);
  copy_dir(root + "/gpt2", out + "/py/gpt2");
  // The tied head is omitted, as transformers does; Conv1D weights are (in, out) on disk.
  SafetensorsFile f = SafetensorsFile::open(out + "/py/single/model.safetensors");
  EXPECT_FALSE(f.contains("lm_head.weight"));
  EXPECT_EQ(f.entry("transformer.h.0.mlp.c_fc.weight").shape, (std::vector<int64_t>{32, 48}));
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(run_reference("verify_hf", out + "/py/single", log), 0) << log;
  EXPECT_EQ(run_reference("verify_hf", out + "/py/sharded", log), 0) << log;
}

// Rewrites <dir>/model.safetensors through `edit` (name -> tensor map).
void edit_weights(const std::string& dir,
                  const std::function<void(std::map<std::string, at::Tensor>&)>& edit) {
  std::map<std::string, at::Tensor> t;
  {
    SafetensorsFile f = SafetensorsFile::open(dir + "/model.safetensors");
    for (const auto& n : f.names()) t[n] = f.tensor(n).clone();
  }
  edit(t);
  write_safetensors(dir + "/model.safetensors",
                    std::vector<std::pair<std::string, at::Tensor>>(t.begin(), t.end()),
                    {{"format", "pt"}});
}

void expect_load_error(const std::string& dir, const std::vector<std::string>& parts) {
  try {
    load(dir);
    ADD_FAILURE() << "loaded";
  } catch (const FileError& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

TEST(HfCheckpoint, StrictLoading) {
  const std::string root = golden_models_dir();
  ASSERT_FALSE(root.empty());
  const std::string base = scratch_dir();
  const std::string src = root + "/gpt2";
  int k = 0;
  auto fresh = [&] {
    std::string d = base + "/case" + std::to_string(k++);
    copy_dir(src, d);
    return d;
  };

  std::string d = fresh();
  edit_weights(d, [](auto& t) { t.erase("transformer.h.1.mlp.c_fc.bias"); });
  expect_load_error(d, {"transformer.h.1.mlp.c_fc.bias", "missing"});

  d = fresh();
  edit_weights(d, [](auto& t) { t["transformer.h.7.ln_1.weight"] = at::ones({32}); });
  expect_load_error(d, {"transformer.h.7.ln_1.weight", "unexpected", "model.safetensors"});

  d = fresh();
  edit_weights(d, [](auto& t) { t["transformer.h.0.attn.c_proj.bias"] = at::zeros({31}); });
  expect_load_error(d, {"transformer.h.0.attn.c_proj.bias", "shape", "[31]", "[32]"});

  d = fresh();
  edit_weights(d, [](auto& t) {
    t["transformer.ln_f.bias"] = at::zeros({32}, at::kInt);
  });
  expect_load_error(d, {"transformer.ln_f.bias", "I32"});

  d = fresh();  // a tied head on disk that differs from the embedding
  edit_weights(d, [](auto& t) { t["lm_head.weight"] = at::zeros({61, 32}); });
  expect_load_error(d, {"lm_head.weight", "tie_word_embeddings"});

  d = fresh();  // a config that does not match the weights
  {
    std::string cfg = read_bytes(d + "/config.json");
    cfg.replace(cfg.find("\"n_inner\": 48"), 13, "\"n_inner\": 64");
    write_bytes(d + "/config.json", cfg);
  }
  expect_load_error(d, {"transformer.h.0.mlp.c_fc.weight", "[32, 48]", "[32, 64]"});

  d = fresh();  // no weights at all
  fs::remove(d + "/model.safetensors");
  expect_load_error(d, {"model.safetensors"});

  // Sharded: an index naming a missing shard; a shard holding a tensor the index does not list.
  const std::string lsrc = root + "/llama";
  d = base + "/llama_missing_shard";
  copy_dir(lsrc, d);
  fs::remove(d + "/model-00002-of-00002.safetensors");
  expect_load_error(d, {"model-00002-of-00002.safetensors", "does not exist"});
  d = base + "/llama_unlisted";
  copy_dir(lsrc, d);
  {
    std::string idx = read_bytes(d + "/model.safetensors.index.json");
    const std::string entry = "\"model.norm.weight\": \"model-00002-of-00002.safetensors\",";
    auto pos = idx.find(entry);
    ASSERT_NE(pos, std::string::npos) << idx;
    idx.erase(pos, entry.size());
    write_bytes(d + "/model.safetensors.index.json", idx);
  }
  expect_load_error(d, {"model.norm.weight", "not listed"});
}

TEST(HfCheckpoint, AcceptsBaseModelNamesBuffersAndAnEqualTiedHead) {
  const std::string root = golden_models_dir();
  ASSERT_FALSE(root.empty());
  const std::string d = scratch_dir() + "/gpt2_base";
  copy_dir(root + "/gpt2", d);
  at::Tensor wte;
  edit_weights(d, [&](auto& t) {
    std::map<std::string, at::Tensor> renamed;
    for (auto& [k, v] : t) renamed[k.substr(std::string("transformer.").size())] = v;
    // The causal-mask buffers older transformers versions saved, and a copy of the tied head.
    renamed["h.0.attn.bias"] = at::ones({1, 1, 16, 16}).tril();
    renamed["h.0.attn.masked_bias"] = at::scalar_tensor(-1e4);
    renamed["lm_head.weight"] = renamed["wte.weight"].clone();
    wte = renamed["wte.weight"];
    t = renamed;
  });
  auto model = load(d);
  EXPECT_TRUE(at::equal(params_of(*model).at("transformer.wte.weight"), wte));
  auto reference = load(root + "/gpt2");
  at::Tensor tokens = at::randint(0, 61, {2, 5}, at::kLong);
  EXPECT_EQ(max_abs_diff(model->forward(tokens), reference->forward(tokens)), 0.0);
}

// ZeRO-3's partitioned weights (BuildOptions::held): from a checkpoint, a parameter with a held
// range is read for those elements alone, the rest zero; the file's pages outside the ranges are
// never read. The file is evicted from the page cache first (written, synced, POSIX_FADV_DONTNEED),
// so that after the build mincore shows what this process read: each held slice's pages, and not
// one whole page of the rest of those tensors (the kernel reads ahead nothing: the file's header
// alone at open, then what each copy asks for). A GPT-2 Conv1D weight, transposed on disk, is read
// whole but keeps the same elements; a sharded bf16 checkpoint gives the same elements converted.
TEST(HfCheckpoint, HeldSlicesAloneAreReadFromTheFile) {
  ModelShape l;
  l.arch = "llama", l.n_layer = 2, l.d_model = 512, l.n_head = 4, l.n_kv_head = 4, l.d_ff = 2048;
  l.vocab_size = 256, l.n_ctx = 16;
  ModelShape g = l;
  g.arch = "gpt2", g.d_ff = 512, g.d_model = 128;
  const std::string root = scratch_dir() + "/held";
  const auto middle_third = [](int64_t n) { return ElementRange{n / 3, 2 * n / 3}; };
  const int64_t big = int64_t{1} << 17;  // elements: the projections, not the norms
  struct Case {
    const char* name;
    ModelShape shape;
    at::ScalarType dtype;  // on disk
    int64_t shard_bytes;   // 0: one file, whose pages are checked
  };
  // Also what most Hub checkpoints are: bf16 on disk (each slice converted as it is copied), sharded.
  for (const Case& c : {Case{"llama", l, at::kFloat, 0}, Case{"gpt2", g, at::kFloat, 0},
                        Case{"llama_bf16_sharded", l, at::kBFloat16, int64_t{1} << 20}}) {
    SCOPED_TRACE(c.name);
    const ModelShape& shape = c.shape;
    const std::string dir = root + "/" + c.name;
    BuildOptions random;
    random.seed = 3;
    {
      auto model = build_model(shape, random);
      at::NoGradGuard no_grad;
      for (auto& p : model->named_parameters()) p.value().set_data(p.value().to(c.dtype));
      save_hf_checkpoint(*model, dir, c.shard_bytes);
    }
    ASSERT_EQ(fs::exists(dir + "/model.safetensors.index.json"), c.shard_bytes > 0);
    const auto whole = params_of(*load(dir));
    const std::string file = dir + "/model.safetensors";
    const int fd = c.shard_bytes > 0 ? -1 : ::open(file.c_str(), O_RDONLY);
    if (c.shard_bytes == 0) {
      ASSERT_GE(fd, 0);
      ASSERT_EQ(::fdatasync(fd), 0);
      ASSERT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
    }

    std::map<std::string, ElementRange> held;
    for (const ParamSpec& spec : parameter_specs(shape))
      if (spec.numel() >= big / 4) held[spec.name] = middle_third(spec.numel());
    held.begin()->second = ElementRange{};  // a rank past the end of a parameter keeps none of it
    BuildOptions opt;
    opt.held = [&](const std::string& name) -> std::optional<ElementRange> {
      auto it = held.find(name);
      return it == held.end() ? std::nullopt : std::optional<ElementRange>(it->second);
    };
    const auto sliced = params_of(*load(dir, opt));
    for (const auto& [name, t] : whole) {
      auto it = held.find(name);
      if (it == held.end()) {
        EXPECT_TRUE(at::equal(sliced.at(name), t)) << name;
        continue;
      }
      const auto [lo, hi] = it->second;
      const at::Tensor want = at::zeros_like(t).view(-1);
      want.narrow(0, lo, hi - lo).copy_(t.view(-1).narrow(0, lo, hi - lo));
      EXPECT_TRUE(at::equal(sliced.at(name).view(-1), want)) << name;
    }
    if (std::string(c.name) != "llama") {
      if (fd >= 0) ::close(fd);
      continue;
    }
    // What the build read of the file: its pages in the page cache.
    const long page = ::sysconf(_SC_PAGESIZE);
    const size_t bytes = static_cast<size_t>(fs::file_size(file));
    void* map = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
    ASSERT_NE(map, MAP_FAILED);
    std::vector<unsigned char> resident((bytes + page - 1) / page);
    ASSERT_EQ(::mincore(map, bytes, resident.data()), 0);
    ::munmap(map, bytes);
    ::close(fd);
    SafetensorsFile f = SafetensorsFile::open(file);
    const int64_t data = static_cast<int64_t>(bytes - f.data_bytes());  // the header before the tensors
    const auto pages = [&](int64_t from, int64_t to) {  // of the pages wholly inside data bytes [from, to):
      std::pair<int64_t, int64_t> n{0, 0};                // {resident, all}
      for (int64_t p = (data + from + page - 1) / page; (p + 1) * page <= data + to; ++p, ++n.second)
        n.first += resident[static_cast<size_t>(p)] & 1;
      return n;
    };
    int64_t checked = 0;
    for (const auto& [name, range] : held) {
      SCOPED_TRACE(name);
      const SafetensorsFile::Entry& e = f.entry(name);
      const int64_t lo = static_cast<int64_t>(e.begin) + range.begin * 4, hi = static_cast<int64_t>(e.begin) + range.end * 4;
      const auto slice = pages(lo, hi), before = pages(static_cast<int64_t>(e.begin), lo),
                 after = pages(hi, static_cast<int64_t>(e.end));
      EXPECT_EQ(slice.first, slice.second) << "the slice is read";
      EXPECT_EQ(before.first, 0) << "nothing before the slice";
      EXPECT_EQ(after.first, 0) << "nothing after it";
      checked += before.second + after.second;
    }
    EXPECT_GT(checked, 2000) << "pages of the file left unread";
  }
}

}  // namespace
}  // namespace memrt
