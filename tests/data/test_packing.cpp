// Packing (docs/tokenizers.md, "Packing"): fine-tuning samples packed several to a row, positions
// restarting and attention kept inside each sample, train exactly as the same samples one per row
// (padded): the same summed loss and the same gradients, for GPT-2 (learned positions) and Llama
// (rotary positions, grouped-query attention) — and not without the layout, which would let
// samples see each other. Samples: alpaca records tokenized with a Llama-3 kind tokenizer
// (hf_tokenizers.py, sft_records.py at test time).
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "models/decoder.h"
#include "models/model_factory.h"
#include "test_util.h"

using namespace memrt;

namespace {

// Uneven records: responses of 1 to 30 words.
std::string records(const memrt::test::TempDir& dir) {
  std::string text;
  for (int i = 0; i < 12; ++i) {
    std::string output;
    for (int w = 0; w < 1 + (i * 17) % 30; ++w) output += (w ? " " : "") + std::string(w % 3 ? "more" : "words");
    text += R"({"instruction": "Say )" + std::to_string(i) + R"(", "input": "", "output": ")" + output + "\"}\n";
  }
  const std::string path = dir.file("records.jsonl");
  std::ofstream(path) << text;
  return path;
}

struct Step {
  double loss = 0;
  std::vector<at::Tensor> grads;
};

Step run(CausalLM& model, const Batch& b, bool layout) {
  auto* decoder = dynamic_cast<DecoderLM*>(&model);
  if (layout) decoder->set_layout(b.positions);
  model.zero_grad();
  at::Tensor loss = causal_lm_loss_sum(model.forward(b.inputs), b.targets);
  loss.backward();
  decoder->set_layout({});
  Step s;
  s.loss = loss.item<double>();
  for (const at::Tensor& p : model.parameters()) s.grads.push_back(p.grad().clone());
  return s;
}

}  // namespace

TEST(Packing, PackedRowsTrainAsTheirSamplesOnePerRow) {
  memrt::test::TempDir dir;
  ASSERT_TRUE(memrt::test::run_reference("hf_tokenizers.py", dir.file("tok")) &&
              memrt::test::run_reference("sft_records.py", dir.str() + " " + dir.file("tok/llama3")));
  DataConfig cfg;
  cfg.datasets = {{records(dir), "alpaca"}};
  cfg.tokenizer = dir.file("tok/llama3/tokenizer.json");
  cfg.cache_dir = dir.file("cache");
  cfg.block_size = 512;
  const std::shared_ptr<TokenDataset> d = TokenDataset::open(cfg);
  ASSERT_EQ(d->num_samples(), 12);
  const std::vector<std::vector<int64_t>> rows = pack_samples(*d, cfg.block_size);
  ASSERT_LT(rows.size(), 12u / 2) << "several samples a row";
  std::vector<int64_t> all;
  for (const auto& row : rows) {
    int64_t used = 0;
    for (int64_t k : row) {
      all.push_back(k);
      used += d->sample_length(k);
    }
    EXPECT_LE(used, cfg.block_size);
  }
  ASSERT_EQ(all.size(), 12u) << "every sample in one row";
  const Batch packed = packed_batch(*d, rows, cfg.block_size);
  const Batch padded = sample_batch(*d, all);
  EXPECT_EQ(packed.targets.ne(-100).sum().item<int64_t>(), padded.targets.ne(-100).sum().item<int64_t>());
  EXPECT_EQ(packed.tokens, padded.tokens);

  for (const char* arch : {"gpt2", "llama"}) {
    SCOPED_TRACE(arch);
    ModelShape shape;
    shape.arch = arch;
    shape.n_layer = 2;
    shape.n_head = 4;
    shape.n_kv_head = std::string(arch) == "llama" ? 2 : 4;
    shape.d_model = 32;
    shape.d_ff = 64;
    shape.vocab_size = d->vocab_size();
    shape.n_ctx = cfg.block_size;
    BuildOptions options;
    options.seed = 3;
    options.init_std = 0.3;  // attention sharp enough that what a token sees matters
    const std::shared_ptr<CausalLM> model = build_model(shape, options);
    model->train();
    const Step want = run(*model, padded, false);
    const Step got = run(*model, packed, true);
    EXPECT_NEAR(got.loss, want.loss, 1e-5 * want.loss);
    ASSERT_EQ(got.grads.size(), want.grads.size());
    for (size_t i = 0; i < got.grads.size(); ++i) {
      const double scale = want.grads[i].abs().max().item<double>();
      EXPECT_LE((got.grads[i] - want.grads[i]).abs().max().item<double>(), 1e-4 * scale + 1e-7) << "parameter " << i;
    }
    // Without the layout the samples of a row attend to each other and sit at other positions.
    const Step mixed = run(*model, packed, false);
    EXPECT_GT(std::abs(mixed.loss - want.loss), 1e-3 * want.loss);
  }
}
