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
#include "memrt/dense_weight.h"
#include "memrt/error.h"

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

// Each init_lora_weights memrt builds draws what PEFT's does, bit for bit, from the default generator
// seeded just before the adapter is made (lora_init_reference.py): true, false, "gaussian" and
// "orthogonal" (an odd r / 2 too); B A is zero where PEFT's is.
TEST(LoraLinear, EachInitDrawsWhatPeftsDraws) {
  struct Init {
    const char* value;
    LoraInit init;
    int64_t r, out, in;
  };
  const std::vector<Init> inits = {{"true", LoraInit::kDefault, 4, 48, 64},
                                   {"false", LoraInit::kLinear, 4, 16, 12},
                                   {"gaussian", LoraInit::kGaussian, 8, 40, 24},
                                   {"orthogonal", LoraInit::kOrthogonal, 6, 32, 20}};
  TempDir dir;
  at::manual_seed(5);
  std::vector<std::pair<std::string, at::Tensor>> inputs;
  for (size_t i = 0; i < inits.size(); ++i) {
    const Init& c = inits[i];
    inputs.emplace_back(std::string("init.") + c.value + "." + std::to_string(c.r) + "." + std::to_string(40 + i) + ".W",
                        at::randn({c.out, c.in}));
  }
  const std::map<std::string, at::Tensor> want = test::run_reference("lora_init_reference.py", inputs, dir);
  for (size_t i = 0; i < inits.size(); ++i) {
    const Init& c = inits[i];
    const std::string name = inputs[i].first.substr(0, inputs[i].first.size() - 2);
    SCOPED_TRACE(name);
    torch::nn::Linear base(torch::nn::LinearOptions(c.in, c.out).bias(false));
    {
      at::NoGradGuard no_grad;
      base->weight.copy_(inputs[i].second);
    }
    at::manual_seed(static_cast<uint64_t>(40 + i));
    LoraOptions options{c.r, 2.0 * static_cast<double>(c.r), 0.0, false};
    options.init = c.init;
    LoraLinear layer(torch::nn::AnyModule(base), c.in, c.out, options);
    EXPECT_TRUE(layer->lora_A->weight.equal(want.at(name + ".A"))) << "A";
    EXPECT_TRUE(layer->lora_B->weight.equal(want.at(name + ".B"))) << "B";
    const double ba = layer->lora_B->weight.mm(layer->lora_A->weight).abs().max().item<double>();
    if (c.init == LoraInit::kLinear) {
      EXPECT_GT(ba, 0.0) << "false leaves B at nn.Linear's init";
    } else {
      EXPECT_LT(ba, 1e-6) << "the adapter starts (up to rounding) as its base";
    }
  }
  try {
    LoraOptions odd{5, 10, 0.0, false};
    odd.init = LoraInit::kOrthogonal;
    LoraLinear layer(torch::nn::AnyModule(torch::nn::Linear(8, 8)), 8, 8, odd);
    ADD_FAILURE() << "an orthogonal init of odd rank";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("even rank"), std::string::npos) << e.what();
  }
}

// A base that stores W in a format of its own: int8 codes times 0.5 (exact in fp32), its forward
// multiplying by the decoded W, and W's rows through memrt::DenseWeight — as plugins/quant's 4-bit
// base does.
class CodedLinearImpl : public torch::nn::Module, public DenseWeight {
 public:
  explicit CodedLinearImpl(const at::Tensor& codes) { weight = register_parameter("weight", codes, false); }
  at::Tensor decoded() const { return weight.to(at::kFloat) * 0.5; }
  at::Tensor forward(const at::Tensor& x) { return at::linear(x, decoded().to(x.scalar_type())); }
  at::Tensor dense_rows(int64_t r0, int64_t r1, at::ScalarType dtype) const override {
    return decoded().narrow(0, r0, r1 - r0).to(dtype);
  }
  at::Tensor weight;
};
TORCH_MODULE(CodedLinear);

// The same base without DenseWeight: DoRA cannot read its W.
class OpaqueLinearImpl : public torch::nn::Module {
 public:
  explicit OpaqueLinearImpl(const at::Tensor& codes) { weight = register_parameter("weight", codes, false); }
  at::Tensor forward(const at::Tensor& x) { return at::linear(x, weight.to(x.scalar_type()) * 0.5); }
  at::Tensor weight;
};
TORCH_MODULE(OpaqueLinear);

// DoRA reads W a tile of rows at a time (8 MB of fp32: 1024 rows of 2048 here, so two tiles and a
// partial one): its norms equal the whole (out, in) sum's, and a base giving W through
// memrt::DenseWeight trains as a floating base holding the same W does.
TEST(LoraLinear, DoraReadsTheWeightInTilesOfRowsFromAnyBase) {
  at::manual_seed(11);
  const int64_t out = 2100, in = 2048;
  const at::Tensor codes = at::randint(-100, 100, {out, in}, at::kChar);
  const LoraOptions dora{8, 16, 0.0, false, true};
  torch::nn::Linear floating(torch::nn::LinearOptions(in, out).bias(false));
  {
    at::NoGradGuard no_grad;
    floating->weight.copy_(codes.to(at::kFloat) * 0.5);
  }
  floating->weight.set_requires_grad(false);
  LoraLinear plain(torch::nn::AnyModule(floating), in, out, dora);
  LoraLinear coded(torch::nn::AnyModule(CodedLinear(codes)), in, out, dora);
  for (LoraLinear* layer : {&plain, &coded}) {  // the same adapter in both, B away from zero
    at::manual_seed(12);
    at::NoGradGuard no_grad;
    (*layer)->lora_A->weight.copy_(at::randn({8, in}) * 0.01);
    (*layer)->lora_B->weight.copy_(at::randn({out, 8}) * 0.01);
  }
  const at::Tensor a = plain->lora_A->weight, b = plain->lora_B->weight;
  const at::Tensor whole = at::linalg_vector_norm(floating->weight + at::mm(b, a) * plain->scaling(), 2, {1}, false,
                                                  std::nullopt);
  EXPECT_TRUE(at::allclose(plain->weight_norm(at::kFloat), whole, 1e-6, 0.0));
  EXPECT_TRUE(coded->weight_norm(at::kFloat).equal(plain->weight_norm(at::kFloat)));
  EXPECT_TRUE(coded->lora_magnitude_vector.equal(plain->lora_magnitude_vector)) << "m starts as ||W||_row";

  const at::Tensor x = at::randn({6, in});
  const at::Tensor y_plain = plain->forward(x), y_coded = coded->forward(x);
  EXPECT_TRUE(y_coded.equal(y_plain));
  y_coded.sum().backward();
  y_plain.sum().backward();
  EXPECT_TRUE(coded->lora_B->weight.grad().equal(plain->lora_B->weight.grad()));
  EXPECT_TRUE(coded->lora_magnitude_vector.grad().equal(plain->lora_magnitude_vector.grad()));

  try {
    LoraLinear opaque(torch::nn::AnyModule(OpaqueLinear(codes.narrow(0, 0, 16))), in, 16, dora);
    ADD_FAILURE() << "DoRA over a base whose W it cannot read";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("memrt::DenseWeight"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("OpaqueLinearImpl"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace memrt::lora
