// plugins/quant's 4-bit linear (docs/quant.md, "The 4-bit linear") against bitsandbytes' own
// Linear4bit, trained on a CPU from the test venv by tests/plugins/linear4bit_reference.py: NF4 and
// FP4, with and without double quantization, compute in fp32 and bf16 (an fp32 model casting to
// it and a bf16 one), with and without a bias, weights whose size is and is not a multiple of the
// block of 64 and an odd width — the output, the input's and the bias's gradients, with the
// smallest tiles (many per weight, the last one partial) and with the plugin's own.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../data/test_util.h"
#include "reference_run.h"
#include "memrt/safetensors.h"
#include "memrt/error.h"
#include "quant/linear4bit.h"

namespace memrt::quant {
namespace {

using test::expect_close;
using test::TempDir;

struct Case {
  Map4 type;
  bool double_quant;
  at::ScalarType compute;  // bnb_4bit_compute_dtype
  at::ScalarType model;    // the dtype of x, dy and the bias
  int64_t out, in, tokens;
  bool bias;

  std::string name(int id) const {
    return std::string("lin.") + (type == Map4::kNf4 ? "nf4" : "fp4") + (double_quant ? ".dq1" : ".dq0") +
           (compute == at::kFloat ? ".f32." : ".bf16.") + std::to_string(id);
  }
};

// Widths bitsandbytes' CPU dequantize_4bit handles: its C++ kernel misplaces the scales of rows that
// do not hold whole blocks for some widths ((200, 96) and (120, 160) measured: errors of half the
// absmax against its own codes and scales read as the format defines them; (130, 70) and odd
// widths, which take its Python path, are right). The tile test below holds memrt's dequantization
// of such shapes to the whole-tensor one that test_quant_formats holds to bitsandbytes.
const std::vector<Case> kCases = {
    {Map4::kNf4, true, at::kFloat, at::kFloat, 320, 128, 37, true},     // 640 blocks: 3 nested groups
    {Map4::kFp4, false, at::kFloat, at::kFloat, 130, 70, 21, false},    // 9,100 elements: blocks straddle rows
    {Map4::kNf4, true, at::kBFloat16, at::kFloat, 320, 128, 37, true},  // an fp32 model, bf16 compute
    {Map4::kNf4, false, at::kBFloat16, at::kBFloat16, 96, 128, 19, true},
    {Map4::kFp4, true, at::kFloat, at::kFloat, 33, 45, 9, true},        // an odd width and element count
};

TEST(Linear4bit, TrainsAsBitsandbytesLinear4bitDoes) {
  TempDir dir;
  at::manual_seed(7);
  std::vector<std::pair<std::string, at::Tensor>> inputs;
  for (size_t i = 0; i < kCases.size(); ++i) {
    const Case& c = kCases[i];
    const std::string n = c.name(static_cast<int>(i));
    inputs.emplace_back(n + ".W", at::randn({c.out, c.in}) * 0.05);
    inputs.emplace_back(n + ".x", at::randn({c.tokens, c.in}).to(c.model));
    inputs.emplace_back(n + ".dy", at::randn({c.tokens, c.out}).to(c.model));
    if (c.bias) inputs.emplace_back(n + ".b", (at::randn({c.out}) * 0.1).to(c.model));
  }
  std::map<std::string, at::Tensor> in(inputs.begin(), inputs.end());
  const std::map<std::string, at::Tensor> want = test::run_reference("linear4bit_reference.py", inputs, dir);

  for (size_t i = 0; i < kCases.size(); ++i) {
    const Case& c = kCases[i];
    const std::string n = c.name(static_cast<int>(i));
    const int64_t e = static_cast<int64_t>(c10::elementSize(c.compute));
    for (int64_t budget : {int64_t{1}, kTileBytes}) {  // 64 rows / columns a tile, and the plugin's
      SCOPED_TRACE(n + (budget == 1 ? ", smallest tiles" : ", the plugin's tiles"));
      Quantized4 q = quantize_4bit(in.at(n + ".W"), c.type, 64, c.double_quant);
      ASSERT_EQ(q.packed.sizes(), want.at(n + ".packed").sizes());
      EXPECT_TRUE(q.packed.equal(want.at(n + ".packed"))) << "packed codes";
      auto scratch = std::make_shared<TileScratch>(tile_scratch_bytes(c.out, c.in, e, budget));
      at::Tensor bias = c.bias ? in.at(n + ".b").clone().set_requires_grad(true) : at::Tensor();
      Linear4bit layer(std::move(q), bias, c.compute, scratch, budget);
      const at::Tensor x = in.at(n + ".x").clone().set_requires_grad(true);
      const at::Tensor y = layer->forward(x);
      y.backward(in.at(n + ".dy"));
      expect_close(y.detach(), want.at(n + ".y"), c.compute, 4, "y");
      expect_close(x.grad(), want.at(n + ".dx"), c.compute, 4, "dx");
      if (c.bias) expect_close(bias.grad().to(at::kFloat), want.at(n + ".db"), c.compute, 4, "db");
      EXPECT_FALSE(layer->named_parameters()["weight"].requires_grad());
    }
  }
}

// The tiles cover the weight: every element dequantized once, from its own block's scale, whatever
// the tile's corner — against the whole weight dequantized at once (blockwise.h, itself held to
// bitsandbytes bit for bit by test_quant_formats).
TEST(Linear4bit, TilesDequantizeEveryElementAsTheWholeWeight) {
  at::manual_seed(3);
  for (bool dq : {false, true}) {
    // 108 blocks, and 300: two groups of the nested absmax
    for (auto [out, in] : std::vector<std::array<int64_t, 2>>{{77, 90}, {200, 96}}) {
    const Quantized4 q = quantize_4bit(at::randn({out, in}), Map4::kNf4, 64, dq);
    const at::Tensor whole = dequantize_4bit(q, at::kFloat);
    const at::Tensor dmap = dynamic_map(true);
    for (auto [r0, r1, c0, c1] : std::vector<std::array<int64_t, 4>>{{0, out, 0, in}, {5, 40, 3, 71}, {out - 1, out, in - 1, in}}) {
      for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
        const at::Tensor tile = at::empty({r1 - r0, c1 - c0}, dtype);
        dequantize_4bit_tile(q, dmap.data_ptr<float>(), r0, r1, c0, c1, tile);
        EXPECT_TRUE(tile.equal(whole.slice(0, r0, r1).slice(1, c0, c1).to(dtype)))
            << "rows " << r0 << ".." << r1 << ", columns " << c0 << ".." << c1 << ", " << dtype << (dq ? ", double quant" : "");
      }
    }
    }
  }
  EXPECT_THROW(dequantize_4bit_tile(quantize_4bit(at::randn({4, 64}), Map4::kNf4, 64, false), nullptr, 0, 5, 0, 64,
                                    at::empty({5, 64})),
               Error);
}

// memrt::DenseWeight, which DoRA reads W through: rows of W as the layer's forward multiplies by them
// (without a bias, its forward on the identity is W^T exactly: products by one, sums with zeros),
// in the compute dtype and then the caller's.
TEST(Linear4bit, DenseRowsAreTheWeightForwardMultipliesBy) {
  at::manual_seed(4);
  const int64_t out = 70, in = 96;
  for (std::optional<at::ScalarType> compute : {std::optional<at::ScalarType>(), std::optional(at::kBFloat16)}) {
    auto scratch = std::make_shared<TileScratch>(tile_scratch_bytes(out, in, 4, kTileBytes));
    Linear4bit layer(quantize_4bit(at::randn({out, in}), Map4::kNf4, 64, true), at::Tensor(), compute, scratch);
    const at::Tensor w = layer->forward(at::eye(in)).t();  // (out, in), fp32
    const DenseWeight& dense = *layer;
    EXPECT_TRUE(dense.dense_rows(0, out, at::kFloat).equal(w)) << (compute ? "bf16 compute" : "fp32 compute");
    EXPECT_TRUE(dense.dense_rows(13, 41, at::kBFloat16).equal(w.slice(0, 13, 41).to(at::kBFloat16)));
    EXPECT_EQ(dense.dense_rows(5, 5, at::kFloat).numel(), 0);
    EXPECT_THROW(dense.dense_rows(60, out + 1, at::kFloat), Error);
  }
}

// Every instruction set's kernel gives the portable loop's bits, for each output dtype, from tiles
// whose rows start on odd elements and at every length around the kernels' widths (the AVX-512
// kernel takes 8 bytes a step, AVX2 4). Each block's absmax is 4 (1 + 2^-8), 4 (1 + 2^-7 + 2^-8),
// 4 (1 + 2^-11) or 4 (1 + 2^-10 + 2^-11), so FP4's 1, 0.5 and 0.25 times it fall halfway between two
// bf16 or two fp16 values, below an even and an odd last digit: ties, which round to even.
TEST(Linear4bit, DequantizationKernelsGiveThePortableBits) {
  at::manual_seed(11);
  at::Tensor w = at::randn({37, 99}) * 0.3;
  const at::Tensor flat = w.view({-1});
  const double ties[] = {std::ldexp(1.0, -8), std::ldexp(3.0, -8), std::ldexp(1.0, -11), std::ldexp(3.0, -11)};
  for (int64_t b = 0; b * 64 < flat.numel(); ++b) flat[b * 64] = 4.0 * (1.0 + ties[b % 4]);
  const Quantized4 q = quantize_4bit(w, Map4::kFp4, 64, false);
  const at::Tensor dmap = dynamic_map(true);
  int tried = 0;
  for (ops::CpuKernels k : {ops::CpuKernels::kAvx512, ops::CpuKernels::kAvx2, ops::CpuKernels::kBest}) {
    if (!ops::cpu_supports(k)) continue;
    ++tried;
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      for (auto [c0, c1] : std::vector<std::array<int64_t, 2>>{{0, 99}, {1, 98}, {3, 20}, {7, 8}, {0, 33}}) {
        const at::Tensor want = at::empty({37, c1 - c0}, dtype), got = at::empty({37, c1 - c0}, dtype);
        dequantize_4bit_tile(q, dmap.data_ptr<float>(), 0, 37, c0, c1, want, ops::CpuKernels::kPortable);
        dequantize_4bit_tile(q, dmap.data_ptr<float>(), 0, 37, c0, c1, got, k);
        const at::ScalarType bits = dtype == at::kFloat ? at::kInt : at::kShort;
        EXPECT_TRUE(got.view(bits).equal(want.view(bits)))
            << ops::to_string(k) << ", " << dtype << ", columns " << c0 << ".." << c1;
      }
    }
  }
  std::cout << "  kernels tried against the portable loop on this processor: " << tried << "\n";
}

}  // namespace
}  // namespace memrt::quant
