// plugins/lora's adapter layer (docs/lora.md) against PEFT's LoRA layer, run from the test venv by
// tests/plugins/lora_reference.py: the output and the gradients of the input and of both adapter
// matrices, for LoRA and rsLoRA scaling, with and without a bias, on an fp32 base and on a bf16 base
// with fp32 adapters (as PEFT keeps them); and what the wrapper exposes to the store.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "../data/test_util.h"
#include "reference_run.h"
#include "memrt/safetensors.h"
#include "lora/lora_linear.h"

namespace memrt::lora {
namespace {

using test::expect_close;
using test::TempDir;

struct Case {
  int64_t r;
  double alpha;
  bool rslora;
  at::ScalarType dtype;  // the base's, x's and dy's
  int64_t out, in, tokens;
  bool bias;

  std::string name(int id) const {
    return "lora." + std::to_string(r) + "." + std::to_string(static_cast<int>(alpha)) + "." + (rslora ? "1" : "0") +
           (dtype == at::kFloat ? ".f32." : ".bf16.") + std::to_string(id);
  }
};

const std::vector<Case> kCases = {
    {4, 8, false, at::kFloat, 48, 64, 13, true},
    {8, 16, true, at::kFloat, 40, 24, 7, false},
    {4, 8, false, at::kBFloat16, 32, 64, 9, true},
};

TEST(LoraLinear, ForwardAndBackwardArePefts) {
  TempDir dir;
  at::manual_seed(3);
  std::vector<std::pair<std::string, at::Tensor>> inputs;
  for (size_t i = 0; i < kCases.size(); ++i) {
    const Case& c = kCases[i];
    const std::string n = c.name(static_cast<int>(i));
    inputs.emplace_back(n + ".W", at::randn({c.out, c.in}) / std::sqrt(static_cast<double>(c.in)));
    if (c.bias) inputs.emplace_back(n + ".b", at::randn({c.out}) * 0.1);
    inputs.emplace_back(n + ".A", at::randn({c.r, c.in}) * 0.1);
    inputs.emplace_back(n + ".B", at::randn({c.out, c.r}) * 0.1);  // non-zero: the adapter's path counts
    inputs.emplace_back(n + ".x", at::randn({c.tokens, c.in}));
    inputs.emplace_back(n + ".dy", at::randn({c.tokens, c.out}));
  }
  std::map<std::string, at::Tensor> in(inputs.begin(), inputs.end());
  std::map<std::string, at::Tensor> want = test::run_reference("lora_reference.py", inputs, dir);

  for (size_t i = 0; i < kCases.size(); ++i) {
    const Case& c = kCases[i];
    const std::string n = c.name(static_cast<int>(i));
    SCOPED_TRACE(n);
    ASSERT_EQ(want.at(n + ".adapter_dtype").scalar_type(), at::kFloat) << "PEFT keeps the adapters in fp32";
    torch::nn::Linear base(torch::nn::LinearOptions(c.in, c.out).bias(c.bias));
    base->to(c.dtype);
    {
      at::NoGradGuard no_grad;
      base->weight.copy_(in.at(n + ".W"));
      base->weight.requires_grad_(false);
      if (c.bias) base->bias.copy_(in.at(n + ".b"));
    }
    LoraLinear layer(torch::nn::AnyModule(base), c.in, c.out, LoraOptions{c.r, c.alpha, 0.0, c.rslora});
    {
      at::NoGradGuard no_grad;
      layer->lora_A->weight.copy_(in.at(n + ".A"));
      layer->lora_B->weight.copy_(in.at(n + ".B"));
    }
    const at::Tensor x = in.at(n + ".x").to(c.dtype).requires_grad_(true);
    const at::Tensor y = layer->forward(x);
    y.backward(in.at(n + ".dy").to(c.dtype));
    const double ulps = c.dtype == at::kFloat ? 16 : 0;  // bf16: PEFT's bits (same kernels, same cast order)
    expect_close(y.detach(), want.at(n + ".y"), c.dtype, ulps, "y");
    expect_close(x.grad(), want.at(n + ".dx"), c.dtype, ulps, "dx");
    expect_close(layer->lora_A->weight.grad(), want.at(n + ".dA"), at::kFloat, 16, "dA");
    expect_close(layer->lora_B->weight.grad(), want.at(n + ".dB"), at::kFloat, 16, "dB");
  }
}

// The wrapper names the base's tensors as the base did and adds PEFT's adapter names; its base
// weight is the base's own tensor (the store re-points it with set_data for both); a fresh adapter
// is PEFT's init: A uniform within ±1/sqrt(in), B zero, so the layer starts as its base.
TEST(LoraLinear, KeepsTheBaseNamesAndStartsAsTheBase) {
  torch::nn::Linear base(torch::nn::LinearOptions(24, 16));
  LoraLinear layer(torch::nn::AnyModule(base), 24, 16, LoraOptions{4, 8, 0.0, false});
  std::vector<std::string> names;
  for (const auto& p : layer->named_parameters()) names.push_back(p.key());
  EXPECT_EQ(names, (std::vector<std::string>{"weight", "bias", "lora_A.weight", "lora_B.weight"}));
  EXPECT_TRUE(layer->named_parameters()["weight"].is_same(base->weight));

  const at::Tensor a = layer->lora_A->weight;
  EXPECT_LE(a.abs().max().item<double>(), 1.0 / std::sqrt(24.0));
  EXPECT_GT(a.abs().max().item<double>(), 0.5 / std::sqrt(24.0));
  EXPECT_TRUE(layer->lora_B->weight.eq(0).all().item<bool>());
  const at::Tensor x = at::randn({5, 24});
  EXPECT_TRUE(at::equal(layer->forward(x), base->forward(x)));

  at::Tensor moved = at::full({16, 24}, 0.5f);
  layer->named_parameters()["weight"].set_data(moved);
  EXPECT_TRUE(base->weight.eq(0.5).all().item<bool>()) << "set_data on the wrapper's weight reaches the base";
  EXPECT_DOUBLE_EQ(lora_scaling(LoraOptions{16, 32, 0.0, false}), 2.0);
  EXPECT_DOUBLE_EQ(lora_scaling(LoraOptions{16, 32, 0.0, true}), 8.0);
}

}  // namespace
}  // namespace memrt::lora
