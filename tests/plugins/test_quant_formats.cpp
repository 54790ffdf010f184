// plugins/quant's formats (docs/quant.md) against bitsandbytes and torchao themselves, run at test
// time from the test venv by tests/plugins/quant_reference.py: the dynamic and 4-bit maps,
// blockwise 8-bit codes and absmax, NF4/FP4 packed codes, absmax and double-quantization fields,
// and every dequantization, bit for bit — for fp32 and bf16 inputs and sizes that are and are not
// a multiple of the block; torchao's optimizer-state maps and quantizer.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "../data/test_util.h"
#include "reference_run.h"
#include "memrt/safetensors.h"
#include "quant/ao_adam.h"
#include "quant/ao_codes.h"
#include "quant/blockwise.h"
#include "quant/bucket_codes.h"
#include "quant/table_codes.h"

namespace memrt::quant {
namespace {

using test::TempDir;

// The same bits (floats compared as integers, so -0 differs from 0 and NaN from NaN exactly).
void expect_bits(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_TRUE(want.defined()) << what << ": bitsandbytes wrote none";
  ASSERT_EQ(got.scalar_type(), want.scalar_type()) << what;
  ASSERT_EQ(got.numel(), want.numel()) << what;
  const at::Tensor g = got.contiguous().view({-1}), w = want.contiguous().view({-1});
  const at::ScalarType bits = got.element_size() == 4 ? at::kInt : got.element_size() == 2 ? at::kShort : at::kByte;
  const at::Tensor differ = g.view(bits) != w.view(bits);
  const int64_t count = differ.sum().item<int64_t>();
  if (count == 0) return;
  const int64_t first = differ.nonzero()[0][0].item<int64_t>();
  ADD_FAILURE() << what << ": " << count << " of " << g.numel() << " differ; first at " << first << ": memrt "
                << g[first].item<double>() << ", the library " << w[first].item<double>();
}

// Values a quantizer rounds at the edges of: normal ones at several scales, a block of zeros, a
// block holding one value, and values exactly on and one ulp around the 8-bit table's grid
// boundaries and the map's midpoints (with the block's absmax 1, so each is its own normalised value).
at::Tensor awkward_values(int64_t n, const at::Tensor& map) {
  at::Tensor x = at::randn({n}) * at::pow(10.0, at::randint(-4, 3, {n}).to(at::kFloat));
  if (n >= 512) {
    x.slice(0, 0, 256).zero_();
    x.slice(0, 256, 512).zero_();
    x[300] = -3.5f;
  }
  if (n >= 4096) {
    std::vector<float> edge;
    for (int64_t i = 0; i + 1 < 256; ++i) {
      const float m = 0.5f * (map[i].item<float>() + map[i + 1].item<float>());
      for (float v : {m, std::nextafter(m, -2.f), std::nextafter(m, 2.f)}) edge.push_back(v);
    }
    for (int64_t k = 0; k < 600; ++k) {  // trunc((v + 1) * 0.5 * 65535 + 0.5) steps at k + 0.5
      const float v = static_cast<float>(2.0 * (static_cast<double>(k) * 109 + 0.5) / 65535.0 - 1.0);
      for (float w : {v, std::nextafter(v, -2.f), std::nextafter(v, 2.f)}) edge.push_back(w);
    }
    const int64_t at = 1024;
    for (size_t i = 0, b = 0; i < edge.size() && at + static_cast<int64_t>(b + 256) <= n; b += 256) {
      x[at + static_cast<int64_t>(b)] = 1.f;  // the block's absmax
      for (int64_t j = 1; j < 256 && i < edge.size(); ++j, ++i) x[at + static_cast<int64_t>(b) + j] = edge[i];
    }
  }
  return x;
}

TEST(QuantFormats, MapsAreBitsandbytesBitForBit) {
  TempDir dir;
  auto want = test::run_reference("quant_reference.py", {{"bw8.256.0", at::randn({256})}}, dir);
  expect_bits(dynamic_map(true), want["map.signed"], "dynamic map, signed");
  expect_bits(dynamic_map(false), want["map.unsigned"], "dynamic map, unsigned");
  expect_bits(map4(Map4::kNf4), want["map4.nf4"], "NF4 map");
  expect_bits(map4(Map4::kFp4), want["map4.fp4"], "FP4 map");
}

TEST(QuantFormats, BlockwiseEightBitIsBitsandbytesBitForBit) {
  at::manual_seed(24);
  std::vector<std::pair<std::string, at::Tensor>> inputs;
  int id = 0;
  for (bool is_signed : {true, false}) {
    const at::Tensor map = dynamic_map(is_signed);
    for (int64_t block : {256, 64}) {
      for (int64_t n : {int64_t{256} * 40, int64_t{1000}, int64_t{5}}) {
        at::Tensor x = awkward_values(n, map);
        if (!is_signed) x = x.abs();
        const std::string prefix = std::string(is_signed ? "bw8." : "bw8u.") + std::to_string(block) + ".";
        inputs.emplace_back(prefix + std::to_string(id++), x);
        inputs.emplace_back(prefix + std::to_string(id++), x.to(at::kBFloat16));
      }
    }
  }
  TempDir dir;
  auto want = test::run_reference("quant_reference.py", inputs, dir);
  for (const auto& [name, x] : inputs) {
    const bool is_signed = name.rfind("bw8.", 0) == 0;
    const int64_t block = std::stoll(name.substr(name.find('.') + 1));
    const at::Tensor map = dynamic_map(is_signed);
    const std::string what = name + " (" + c10::toString(x.scalar_type()) + ", " + std::to_string(x.numel()) + ")";
    const Blockwise q = quantize_blockwise(x, map, block);
    expect_bits(q.codes, want[name + ".codes"], what + " codes");
    expect_bits(q.absmax, want[name + ".absmax"], what + " absmax");
    // Dequantized from bitsandbytes' own codes, so each half of the round trip is checked alone.
    const Blockwise theirs{want[name + ".codes"], want[name + ".absmax"]};
    expect_bits(dequantize_blockwise(theirs, map, block, at::kFloat), want[name + ".deq_f32"], what + " dequantized");
    expect_bits(dequantize_blockwise(theirs, map, block, at::kBFloat16), want[name + ".deq_bf16"],
                what + " dequantized to bf16");
  }
}

TEST(QuantFormats, FourBitWithAndWithoutDoubleQuantIsBitsandbytesBitForBit) {
  at::manual_seed(4);
  std::vector<std::pair<std::string, at::Tensor>> inputs;
  int id = 0;
  for (const char* type : {"nf4", "fp4"}) {
    for (const char* dq : {"dq0", "dq1"}) {
      // 64 * 300 blocks: more than one nested block of 256; 1000 and 1343: a partial last block
      // (of 40 and 63), an odd count. A weight-like scale, one all-zero block, exact zeros, and in
      // block 2 and the last block values on and 1-2 ulps around each midpoint of the map times
      // an absmax that is not a power of 2 (full blocks multiply by 1 / absmax, a partial one divides).
      for (int64_t n : {int64_t{64} * 300, int64_t{1000}, int64_t{1343}}) {
        at::Tensor x = at::randn({n}) * 0.02;
        x.slice(0, 64, 128).zero_();
        x[5] = 0.f;
        const Map4Bounds bounds = map4_bounds(std::string(type) == "nf4" ? Map4::kNf4 : Map4::kFp4);
        for (int64_t start : {int64_t{128}, (n - 1) / 64 * 64}) {
          const float m = 0.0371f;
          int64_t i = start;
          x[i++] = -m;
          for (int k = 0; k < 15 && i + 4 <= std::min(start + 64, n); ++k) {
            const float v = bounds.midpoint[k] * m;
            const float down = std::nextafter(v, -1.f), up = std::nextafter(v, 1.f);
            for (float w : {v, down, up, std::nextafter(up, 1.f)}) x[i++] = w;
          }
        }
        const std::string prefix = std::string("q4.") + type + "." + dq + ".";
        inputs.emplace_back(prefix + std::to_string(id++), n % 2 ? x : x.view({-1, 8}));
        inputs.emplace_back(prefix + std::to_string(id++), x.to(at::kBFloat16));
      }
    }
  }
  TempDir dir;
  auto want = test::run_reference("quant_reference.py", inputs, dir);
  for (const auto& [name, x] : inputs) {
    const Map4 type = name.find(".nf4.") != std::string::npos ? Map4::kNf4 : Map4::kFp4;
    const bool dq = name.find(".dq1.") != std::string::npos;
    const std::string what = name + " (" + c10::toString(x.scalar_type()) + ", " + std::to_string(x.numel()) + ")";
    const Quantized4 q = quantize_4bit(x, type, 64, dq);
    expect_bits(q.packed, want[name + ".packed"], what + " packed codes");
    expect_bits(q.absmax, want[name + ".absmax"], what + " absmax");
    EXPECT_EQ(q.packed.sizes(), want[name + ".packed"].sizes()) << what;
    if (dq) {
      expect_bits(q.nested_absmax, want[name + ".nested_absmax"], what + " nested absmax");
      expect_bits(q.offset, want[name + ".offset"], what + " offset");
    }
    Quantized4 theirs = q;
    theirs.packed = want[name + ".packed"];
    theirs.absmax = want[name + ".absmax"];
    if (dq) {
      theirs.nested_absmax = want[name + ".nested_absmax"];
      theirs.offset = want[name + ".offset"];
    }
    // FP4's code 8 is zero: bitsandbytes' map says +0 and its Python path (odd last dimension)
    // gives +0, its C++ kernel (even) -0. memrt gives the map's +0; a sign of zero is compared
    // for NF4 only.
    auto zero_sign = [&](const at::Tensor& t) { return type == Map4::kFp4 ? t + 0.0 : t; };  // -0 + 0 = +0
    expect_bits(zero_sign(dequantize_4bit(theirs, at::kFloat)), zero_sign(want[name + ".deq_f32"]),
                what + " dequantized");
    expect_bits(zero_sign(dequantize_4bit(theirs, at::kBFloat16)), zero_sign(want[name + ".deq_bf16"]),
                what + " dequantized to bf16");
  }
}

// torchao's optimizer-state quantizer (its low-bit AdamW's copy_ into the state): maps, scales and
// codes, on random values and on values at, and one ulp around, the midpoints between its codes
// (the rule rounds a tie up).
TEST(QuantFormats, TorchaoStateQuantizerIsTorchaosBitForBit) {
  at::manual_seed(40);
  std::vector<std::pair<std::string, at::Tensor>> inputs;
  int id = 0;
  for (int bits : {8, 4}) {
    for (bool is_signed : {true, false}) {
      const at::Tensor map = ao_map(bits, is_signed);
      const int64_t block = ao_block(bits);
      std::vector<float> edge;
      for (int64_t c = 0; c + 1 < map.numel(); ++c) {
        const float lo = map[c].item<float>(), hi = map[c + 1].item<float>();
        const float mid = lo + (hi - lo) * 0.5f;
        for (float v : {mid, std::nextafter(mid, -2.f), std::nextafter(mid, 2.f)}) edge.push_back(v);
      }
      at::Tensor x = at::randn({block * 40}) * 0.3;
      if (!is_signed) x = x.abs();
      // Blocks from 1 on: the edges at absmax 1 (each value its own normalised one), then at
      // absmax 0.37 (x / 0.37 must be divided, not multiplied by a reciprocal, to land as torchao's).
      size_t b = 1;
      for (float absmax : {1.f, 0.37f}) {
        for (size_t i = 0; i < edge.size(); ++b) {
          x[static_cast<int64_t>(b) * block] = absmax;
          for (int64_t j = 1; j < block && i < edge.size(); ++j, ++i)
            x[static_cast<int64_t>(b) * block + j] = edge[i] * absmax;
        }
      }
      inputs.emplace_back("ao" + std::to_string(bits) + "." + (is_signed ? "s." : "u.") + std::to_string(id++), x);
    }
  }
  TempDir dir;
  auto want = test::run_reference("quant_reference.py", inputs, dir);
  for (int bits : {8, 4})
    for (const char* sign : {"s", "u"})
      expect_bits(ao_map(bits, std::string(sign) == "s"), want["aomap." + std::to_string(bits) + "." + sign],
                  "torchao map " + std::to_string(bits) + "." + sign);
  for (const auto& [name, x] : inputs) {
    const int bits = name[2] - '0';
    const bool is_signed = name[4] == 's';
    const int64_t n = x.numel();
    at::Tensor codes = at::empty({bits == 8 ? n : n / 2}, at::kByte);
    at::Tensor scale = at::empty({n / ao_block(bits)}, at::kFloat);
    ao_quantize(bits, is_signed, x.data_ptr<float>(), n, codes.data_ptr<uint8_t>(), scale.data_ptr<float>());
    expect_bits(codes, want[name + ".codes"], name + " codes");
    expect_bits(scale, want[name + ".scale"], name + " scales");
  }
}

// The 8-bit quantizer's hand-written loops (table_codes.h) give the portable loop's codes, which
// the test above holds to bitsandbytes': on the awkward values (the table's steps and the map's
// midpoints, one ulp either side), values past the clamps, infinities and NaN, at lengths around
// the kernels' widths (16 and 8); and its dequantizer loops the portable loop's values of those codes,
// bit for bit.
TEST(QuantFormats, EightBitQuantizerKernelsGiveThePortableCodes) {
  at::manual_seed(12);
  const at::Tensor map = dynamic_map(true);
  const QuantizeTable table(map);
  at::Tensor x = awkward_values(4096, map);
  const float odd[] = {-1.f, 1.f, -1.5f, 2.f, std::nextafter(1.f, 2.f), std::nextafter(-1.f, -2.f),
                       std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                       std::numeric_limits<float>::quiet_NaN(), 0.f, -0.f};
  for (size_t i = 0; i < sizeof(odd) / sizeof(odd[0]); ++i) x[static_cast<int64_t>(i) * 7] = odd[i];
  const float* values = x.data_ptr<float>();
  int tried = 0;
  for (ops::CpuKernels k : {ops::CpuKernels::kAvx512, ops::CpuKernels::kAvx2, ops::CpuKernels::kBest}) {
    if (!ops::cpu_supports(k)) continue;
    ++tried;
    for (int64_t len : {int64_t{4096}, int64_t{255}, int64_t{17}, int64_t{15}, int64_t{8}, int64_t{7}}) {
      for (float inv : {1.f, 0.37f}) {
        std::vector<uint8_t> want(static_cast<size_t>(len)), got(static_cast<size_t>(len));
        table_codes_kernel(ops::CpuKernels::kPortable)(values, len, inv, table.data(), want.data());
        table_codes_kernel(k)(values, len, inv, table.data(), got.data());
        EXPECT_EQ(got, want) << ops::to_string(k) << ", " << len << " values, times " << inv;
        std::vector<float> want_values(static_cast<size_t>(len)), got_values(static_cast<size_t>(len));
        table_values_kernel(ops::CpuKernels::kPortable)(want.data(), len, map.data_ptr<float>(), 1.f / inv, want_values.data());
        table_values_kernel(k)(want.data(), len, map.data_ptr<float>(), 1.f / inv, got_values.data());
        EXPECT_EQ(0, std::memcmp(got_values.data(), want_values.data(), sizeof(float) * static_cast<size_t>(len)))
            << ops::to_string(k) << ", " << len << " values dequantized";
      }
    }
  }
  std::cout << "  kernels tried against the portable loop on this processor: " << tried << "\n";
}

// torchao's quantizer loops (ao_codes.h) give the portable loop's codes on each of its four maps:
// values on, and one ulp either side of, every map value and every midpoint, random values at
// several scales, infinities and NaN (clamped before the 8-bit table), at lengths around the
// kernels' widths (16 and 8), divided by 1 and by a scale that is no power of two; and every one
// of the 2^24 fp32 values in [-1, 1] with the low 8 bits of their pattern zero, and both sides of
// every split the 8-bit maps' tables hold (bucket_codes.h), through those tables.
TEST(QuantFormats, TorchaoQuantizerKernelsGiveThePortableCodes) {
  at::manual_seed(13);
  int tried = 0;
  for (ops::CpuKernels k : {ops::CpuKernels::kAvx512, ops::CpuKernels::kAvx2, ops::CpuKernels::kBest}) {
    if (!ops::cpu_supports(k)) continue;
    ++tried;
    for (int bits : {8, 4}) {
      for (bool is_signed : {true, false}) {
        const at::Tensor map = ao_map(bits, is_signed).contiguous();
        const int size = static_cast<int>(map.numel());
        const float* mv = map.data_ptr<float>();
        const AoQuantizer portable(mv, size, ops::CpuKernels::kPortable), kernel(mv, size, k);
        // Every 8-bit map has its table on this processor's vector kernels (the search otherwise).
        EXPECT_EQ(kernel.uses_table(), size == 256) << ops::to_string(k) << ", " << bits << "-bit map";
        std::vector<float> x;
        for (int i = 0; i < size; ++i) {
          const float mid = i + 1 < size ? 0.5f * (mv[i] + mv[i + 1]) : mv[i];
          for (float v : {mv[i], mid}) {
            float below = v, above = v;
            x.push_back(v);
            for (int ulp = 0; ulp < 4; ++ulp) {
              below = std::nextafter(below, -2.f);
              above = std::nextafter(above, 2.f);
              x.push_back(below);
              x.push_back(above);
            }
          }
        }
        const at::Tensor r = at::rand({1000}) * 2 - 1;
        for (int64_t i = 0; i < r.numel(); ++i) x.push_back(r[i].item<float>() * (i % 3 == 0 ? 1e-3f : 1.f));
        for (float v : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                        std::numeric_limits<float>::quiet_NaN(), 0.f, -0.f, 1.f, -1.f, 1.5f, -1.5f})
          x.push_back(v);
        for (int64_t len : {static_cast<int64_t>(x.size()), int64_t{255}, int64_t{17}, int64_t{15}, int64_t{8}, int64_t{7}}) {
          for (float scale : {1.f, 0.37f}) {
            std::vector<uint8_t> want(static_cast<size_t>(len)), got(static_cast<size_t>(len));
            portable.codes(x.data(), len, scale, want.data());
            kernel.codes(x.data(), len, scale, got.data());
            EXPECT_EQ(got, want) << ops::to_string(k) << ", " << bits << "-bit " << (is_signed ? "signed" : "unsigned")
                                 << " map, " << len << " values, divided by " << scale;
          }
        }
        if (size == 256) {
          std::vector<float> sweep;
          for (uint32_t b = 0; b < (1u << 24); ++b) {
            float v = 0.f;
            const uint32_t bits32 = b << 8;
            std::memcpy(&v, &bits32, sizeof v);
            if (std::fabs(v) <= 1.f) sweep.push_back(v);
          }
          // The table's own edges (bucket_codes.h): each split's key and the one below it, the
          // first tabulated bucket and the last shared one, both signs.
          BucketCodes table;
          ASSERT_TRUE(table.build([mv](float y) { return ao_code(mv, 256, y); }));
          const auto value = [](bool negative, uint32_t m, uint32_t key) {
            const uint32_t bits32 = (negative ? 0x80000000u : 0u) | m << 16 | (negative ? key ^ 0xffffu : key);
            float v = 0.f;
            std::memcpy(&v, &bits32, sizeof v);
            return v;
          };
          int64_t splits = 0;
          for (bool negative : {false, true}) {
            for (uint32_t m = table.base; m < 0x3f80u; ++m) {
              const uint32_t e = table.entries[(negative ? table.half : 0) + 1 + m - table.base];
              if ((e & 0xffu) == ((e >> 8) & 0xffu)) continue;
              ++splits;
              for (uint32_t key : {(e >> 16) - 1, e >> 16}) sweep.push_back(value(negative, m, key));
            }
            for (uint32_t key : {0u, 0xffffu}) {
              sweep.push_back(value(negative, table.base, key));
              if (table.base > 0) sweep.push_back(value(negative, table.base - 1, key));
            }
          }
          EXPECT_GT(splits, 200) << "a table of the map's 255 rounding boundaries, nearly all inside buckets";
          const int64_t n = static_cast<int64_t>(sweep.size());
          std::vector<uint8_t> want(sweep.size()), got(sweep.size());
          portable.codes(sweep.data(), n, 1.f, want.data());
          kernel.codes(sweep.data(), n, 1.f, got.data());
          int64_t differ = 0;
          for (size_t i = 0; i < sweep.size(); ++i) differ += want[i] != got[i];
          EXPECT_EQ(differ, 0) << ops::to_string(k) << ", " << (is_signed ? "signed" : "unsigned") << " 8-bit map: of "
                               << n << " values in [-1, 1]";
        }
      }
    }
  }
  std::cout << "  kernels tried against the portable loop on this processor: " << tried << "\n";
}

}  // namespace
}  // namespace memrt::quant
