// memrt/ops.h: which path 16-bit matrix products take on which processor, and that the
// fp32-arithmetic path computes what LibTorch computes (float64 references), keeps the bytes
// LibTorch's own 16-bit kernels keep, and runs on every machine (these tests call it directly);
// the fused GELU against float64, its scalar function and LibTorch's gelu; the chunked LM head
// and cross-entropy against LibTorch's unfused float64 loss.
#include <gtest/gtest.h>

#include <torch/autograd.h>

#include "memory/tracking_allocator.h"
#include "memrt/ops.h"
#include "ops/activation_math.h"
#include "ops/cpu_math.h"

namespace memrt::ops {
namespace {

// ---- the plan --------------------------------------------------------------------------------

CpuFacts zen4() {  // AMD EPYC 9004: AVX-512 with BF16, no AVX512-FP16, no AMX
  CpuFacts f;
  f.name = "AMD EPYC 9R14";
  f.avx2 = f.avx512_core = f.avx512_bf16 = true;
  return f;
}

CpuFacts sapphire_rapids() {  // Intel Xeon 4th gen: AVX512-FP16, AMX-BF16, no AMX-FP16
  CpuFacts f = zen4();
  f.name = "Intel Xeon Platinum 8488C";
  f.intel = f.avx512_fp16 = f.amx_bf16 = true;
  return f;
}

TEST(MatmulPlan, Zen4RunsFp16AsFp32ArithmeticAndBf16Natively) {
  const MatmulPlan p = choose_matmul_plan(zen4());
  EXPECT_EQ(p.fp16, MatmulPath::kFp32Arithmetic);
  EXPECT_EQ(p.bf16, MatmulPath::kNative);
  EXPECT_EQ(p.bf16_how, "oneDNN (AVX512-BF16)");
  EXPECT_NE(p.fp16_how.find("no AVX512-FP16"), std::string::npos) << p.fp16_how;
}

TEST(MatmulPlan, SapphireRapidsRunsBothNatively) {
  const MatmulPlan p = choose_matmul_plan(sapphire_rapids());
  EXPECT_EQ(p.fp16, MatmulPath::kNative);
  EXPECT_EQ(p.bf16, MatmulPath::kNative);
  EXPECT_EQ(p.fp16_how, "oneDNN (AVX512-FP16)");
  EXPECT_EQ(p.bf16_how, "oneDNN (AMX-BF16)");
}

TEST(MatmulPlan, OneDnnIsaCapBelowFp16TakesTheFp32Path) {
  CpuFacts f = sapphire_rapids();
  f.onednn_cap = "AVX512_CORE_BF16";  // what LibTorch's ideep check sees: no fp16 GEMM
  MatmulPlan p = choose_matmul_plan(f);
  EXPECT_EQ(p.fp16, MatmulPath::kFp32Arithmetic);
  EXPECT_NE(p.fp16_how.find("ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16"), std::string::npos) << p.fp16_how;
  // AMX is above the cap too, and without it MKL's fp32 GEMM is the faster on an Intel processor.
  EXPECT_EQ(p.bf16, MatmulPath::kFp32Arithmetic);
  EXPECT_NE(p.bf16_how.find("without AMX (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16)"), std::string::npos) << p.bf16_how;
  f.onednn_cap = "AVX2";
  p = choose_matmul_plan(f);
  EXPECT_EQ(p.bf16, MatmulPath::kFp32Arithmetic);
  EXPECT_EQ(p.fp16, MatmulPath::kFp32Arithmetic);
  f.onednn_cap = "ALL";  // no cap
  EXPECT_EQ(choose_matmul_plan(f).fp16, MatmulPath::kNative);
}

TEST(MatmulPlan, Bf16TakesOneDnnWithAmxOrOnAmdAndMklsFp32GemmOnIntelWithoutAmx) {
  CpuFacts f = sapphire_rapids();
  f.amx_bf16 = false;  // a Xeon whose AMX is absent or hidden (as in some virtual machines)
  MatmulPlan p = choose_matmul_plan(f);
  EXPECT_EQ(p.bf16, MatmulPath::kFp32Arithmetic);
  EXPECT_EQ(p.bf16_how, "fp32 GEMM on bf16 storage: on an Intel processor without AMX MKL's fp32 GEMM "
                        "outruns oneDNN's bf16 one");
  EXPECT_EQ(p.fp16, MatmulPath::kNative);  // AVX512-FP16 is unaffected
  f.avx512_bf16 = false;  // an Ice Lake: AVX-512 without BF16
  EXPECT_EQ(choose_matmul_plan(f).bf16, MatmulPath::kFp32Arithmetic);
  p = choose_matmul_plan(zen4());  // AMD without AMX: oneDNN's bf16 GEMM is the faster
  EXPECT_EQ(p.bf16, MatmulPath::kNative);
}

TEST(MatmulPlan, Avx2OnlyProcessorRunsBoth16BitTypesInFp32) {
  CpuFacts f;
  f.avx2 = true;
  const MatmulPlan p = choose_matmul_plan(f);
  EXPECT_EQ(p.bf16, MatmulPath::kFp32Arithmetic);
  EXPECT_EQ(p.fp16, MatmulPath::kFp32Arithmetic);
}

TEST(MatmulPlan, DescriptionNamesProcessorIsaBlasAndEveryPath) {
  CpuFacts f = zen4();
  f.aten_isa = "AVX512";
  f.blas = "MKL 2024.2, oneDNN 3.12.0";
  const std::string line = describe(f, choose_matmul_plan(f));
  for (const char* part : {"cpu: AMD EPYC 9R14", "ATen kernels AVX512", "MKL 2024.2, oneDNN 3.12.0",
                           "fp32: MKL", "bf16: oneDNN (AVX512-BF16)", "fp16: fp32 GEMM on fp16 storage"}) {
    EXPECT_NE(line.find(part), std::string::npos) << part << " not in: " << line;
  }
  // This machine's line reads real facts.
  const std::string here = describe_cpu_math();
  EXPECT_EQ(here.rfind("cpu: ", 0), 0u) << here;
  EXPECT_NE(here.find("ATen kernels "), std::string::npos) << here;
}

TEST(MatmulPlan, FloatAndCudaAreAlwaysNative) {
  EXPECT_EQ(matmul_path(at::kFloat), MatmulPath::kNative);
  EXPECT_EQ(matmul_path(at::kHalf, at::Device(at::kCUDA, 0)), MatmulPath::kNative);
}

// ---- the fp32-arithmetic kernels against float64 ----------------------------------------------

double rel_err(const at::Tensor& got, const at::Tensor& want) {
  at::Tensor w = want.to(at::kDouble);
  return (got.to(at::kDouble) - w).abs().max().item<double>() /
         std::max(1e-30, w.abs().max().item<double>());
}

// Leaves of `dtype` with the given values, and float64 leaves holding the same (rounded) values.
std::pair<at::Tensor, at::Tensor> leaf(const at::Tensor& values, at::ScalarType dtype) {
  at::Tensor low = values.to(dtype).detach().requires_grad_(true);
  at::Tensor ref = low.detach().to(at::kDouble).requires_grad_(true);
  return {low, ref};
}

// fp16 has an 11-bit significand: a result rounded once is within 2^-11 relative; sums of a few
// hundred products rounded once in fp32 stay well inside 2e-3 of the largest value.
constexpr double kFp16Tol = 2e-3;
constexpr double kBf16Tol = 1.6e-2;  // 8-bit significand

void check_linear(at::ScalarType dtype, int64_t batch, int64_t rows, int64_t in, int64_t out, bool bias) {
  at::manual_seed(7);
  auto [x, x64] = leaf(at::randn({batch, rows, in}), dtype);
  auto [w, w64] = leaf(at::randn({out, in}) / std::sqrt(double(in)), dtype);
  auto [b, b64] = leaf(at::randn({out}), dtype);
  at::Tensor y = linear_fp32_arithmetic(x, w, bias ? b : at::Tensor());
  at::Tensor y64 = at::linear(x64, w64, bias ? b64 : at::Tensor());
  ASSERT_EQ(y.scalar_type(), dtype);
  ASSERT_EQ(y.sizes(), y64.sizes());
  const double tol = dtype == at::kHalf ? kFp16Tol : kBf16Tol;
  EXPECT_LT(rel_err(y, y64), tol);
  at::Tensor g = at::randn(y.sizes());
  y.backward(g.to(dtype));
  y64.backward(g.to(dtype).to(at::kDouble));
  EXPECT_EQ(x.grad().scalar_type(), dtype);
  EXPECT_EQ(w.grad().scalar_type(), dtype);
  EXPECT_LT(rel_err(x.grad(), x64.grad()), tol);
  EXPECT_LT(rel_err(w.grad(), w64.grad()), tol);
  if (bias) {
    EXPECT_LT(rel_err(b.grad(), b64.grad()), tol);
  } else {
    EXPECT_FALSE(b.grad().defined());
  }
}

TEST(Fp32ArithmeticLinear, MatchesFloat64InFp16AndBf16) {
  check_linear(at::kHalf, 4, 32, 64, 96, /*bias=*/true);
  check_linear(at::kBFloat16, 4, 32, 64, 96, /*bias=*/false);
}

TEST(Fp32ArithmeticLinear, ManyRowBlocksGiveTheSameResult) {
  // 4 MiB of fp32 per block: W's 3072 rows of 1024 in 3 blocks of 1024, x's 1100 rows in a block
  // of 1024 and a short one.
  check_linear(at::kHalf, 2, 550, 1024, 3072, /*bias=*/true);
}

// What the allocator sees of a linear layer, forward and backward, at its peak: what LibTorch's own
// 16-bit kernel allocates — the output and the gradients — nothing more (the fp32 blocks are
// scratch outside it).
TEST(Fp32ArithmeticLinear, AllocatesWhatLibTorchsKernelAllocates) {
  memory::install_tracking_allocator();
  at::manual_seed(5);
  const at::Tensor x = at::randn({300, 1024}).to(at::kHalf).requires_grad_(true);
  const at::Tensor w = (at::randn({3072, 1024}) * 0.03).to(at::kHalf).requires_grad_(true);
  const at::Tensor b = at::zeros({3072}).to(at::kHalf).requires_grad_(true);
  const at::Tensor g = at::randn({300, 3072}).to(at::kHalf);
  for (int round = 0; round < 2; ++round) {  // the first grows the scratch, outside the allocator
    x.mutable_grad() = at::Tensor();
    w.mutable_grad() = at::Tensor();
    b.mutable_grad() = at::Tensor();
    const int64_t before = memory::allocator_stats().current_bytes;
    memory::reset_peak();
    linear_fp32_arithmetic(x, w, b).backward(g);
    // y, then gx, gW and gb in fp16: the bytes LibTorch's fp16 kernel allocates.
    EXPECT_EQ(memory::allocator_stats().peak_bytes - before, 2 * (300 * 3072 + 300 * 1024 + 3072 * 1024 + 3072));
  }
}

// linear_into writes the product into a strided tile of an output, the weight given transposed
// (as plugins/quant's 4-bit linear writes dy W tile by tile), and computes what at::linear does.
TEST(Fp32ArithmeticLinear, IntoAStridedTileWithATransposedWeight) {
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
    at::manual_seed(9);
    auto [x, x64] = leaf(at::randn({70, 96}), dtype);
    auto [w, w64] = leaf(at::randn({96, 50}) / std::sqrt(96.0), dtype);  // used as (50, 96)^T
    at::Tensor y = at::zeros({70, 80}, x.options());
    linear_into(y.narrow(1, 10, 50), x.detach(), w.detach().t());
    EXPECT_LT(rel_err(y.narrow(1, 10, 50), at::linear(x64, w64.t())), dtype == at::kFloat ? 1e-6 : kBf16Tol);
    EXPECT_EQ(y.narrow(1, 0, 10).abs().max().item<double>(), 0.0) << "outside the tile";
    EXPECT_EQ(y.narrow(1, 60, 20).abs().max().item<double>(), 0.0) << "outside the tile";
  }
}

TEST(Fp32ArithmeticLinear, FrozenWeightGetsNoGradient) {
  at::Tensor x = at::randn({8, 16}).to(at::kHalf).requires_grad_(true);
  at::Tensor w = at::randn({4, 16}).to(at::kHalf);  // frozen (a quantized base weight, say)
  linear_fp32_arithmetic(x, w, at::Tensor()).sum().backward();
  EXPECT_TRUE(x.grad().defined());
  EXPECT_FALSE(w.grad().defined());
}

void check_attention(int64_t B, int64_t H, int64_t H_kv, int64_t T, int64_t D) {
  at::manual_seed(11);
  auto [q, q64] = leaf(at::randn({B, H, T, D}), at::kHalf);
  auto [k, k64] = leaf(at::randn({B, H_kv, T, D}), at::kHalf);
  auto [v, v64] = leaf(at::randn({B, H_kv, T, D}), at::kHalf);
  at::Tensor y = causal_attention_fp32_arithmetic(q, k, v);
  at::Tensor y64 = at::scaled_dot_product_attention(q64, k64, v64, {}, 0.0, true, std::nullopt,
                                                    /*enable_gqa=*/H != H_kv);
  EXPECT_EQ(y.scalar_type(), at::kHalf);
  EXPECT_LT(rel_err(y, y64), kFp16Tol);
  at::Tensor g = at::randn(y.sizes()).to(at::kHalf);
  y.backward(g);
  y64.backward(g.to(at::kDouble));
  EXPECT_LT(rel_err(q.grad(), q64.grad()), 4 * kFp16Tol);
  EXPECT_LT(rel_err(k.grad(), k64.grad()), 4 * kFp16Tol);
  EXPECT_LT(rel_err(v.grad(), v64.grad()), 4 * kFp16Tol);
}

TEST(Fp32ArithmeticAttention, MatchesFloat64) { check_attention(3, 4, 4, 40, 16); }

TEST(Fp32ArithmeticAttention, GroupedQueryAttention) { check_attention(2, 8, 2, 24, 16); }

TEST(Fp32ArithmeticAttention, ManyBatchBlocksGiveTheSameResult) {
  // 4 MiB per block over (4 q + 4 k) * H*T*D fp32 elements per batch entry in backward: 17 entries
  // of 8 * 4*128*64 * 4 bytes = 1 MiB each -> 4 a block.
  check_attention(17, 4, 4, 128, 64);
}

// ---- what forward keeps ----------------------------------------------------------------------

int64_t live_bytes() { return memory::allocator_stats().current_bytes; }

TEST(Fp32ArithmeticPath, ForwardKeepsWhatLibTorchsOwnKernelKeeps) {
  memory::install_tracking_allocator();
  at::manual_seed(3);
  const int64_t B = 4, T = 64, C = 128, H = 4;
  at::Tensor x = at::randn({B, T, C}).to(at::kHalf).requires_grad_(true);
  at::Tensor w = (at::randn({3 * C, C}) * 0.05).to(at::kHalf).requires_grad_(true);
  at::Tensor b = at::zeros({3 * C}).to(at::kHalf).requires_grad_(true);
  at::Tensor w_proj = (at::randn({C, C}) * 0.05).to(at::kHalf).requires_grad_(true);
  // GPT-2's attention: c_attn, heads, attention, heads merged back (a view of the attention's
  // output when it is laid out as LibTorch's kernel lays it out, else a copy c_proj keeps), c_proj.
  auto kept = [&](bool fp32) {
    const int64_t before = live_bytes();
    at::Tensor qkv = fp32 ? linear_fp32_arithmetic(x, w, b) : at::linear(x, w, b);
    auto heads = [&](const at::Tensor& t) { return t.view({B, T, H, C / H}).transpose(1, 2); };
    auto p = qkv.split(C, -1);
    at::Tensor y = fp32 ? causal_attention_fp32_arithmetic(heads(p[0]), heads(p[1]), heads(p[2]))
                        : at::scaled_dot_product_attention(heads(p[0]), heads(p[1]), heads(p[2]),
                                                           {}, 0.0, true);
    qkv = at::Tensor();
    at::Tensor merged = y.transpose(1, 2).reshape({B, T, C});
    y = at::Tensor();
    at::Tensor out = fp32 ? linear_fp32_arithmetic(merged, w_proj, {}) : at::linear(merged, w_proj);
    merged = at::Tensor();
    return std::pair<int64_t, at::Tensor>(live_bytes() - before, out);
  };
  auto [native_bytes, y_native] = kept(false);
  auto [fp32_bytes, y_fp32] = kept(true);
  EXPECT_EQ(fp32_bytes, native_bytes);
  EXPECT_LT(rel_err(y_fp32, y_native), kFp16Tol);
}

// ---- fused GELU (tanh) -------------------------------------------------------------------------

// The function in float64: x sigmoid(2u) = 0.5 x (1 + tanh u), u = sqrt(2/pi) (x + 0.044715 x^3).
double gelu64(double x) {
  const double u = std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x);
  return x / (1.0 + std::exp(-2.0 * u));
}
double gelu64_grad(double x) {
  const double k = std::sqrt(2.0 / M_PI), t = std::tanh(k * (x + 0.044715 * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x);
}

// Inputs on a fine grid over [-12, 12] and the edges: zeros, tiny, huge.
at::Tensor gelu_inputs() {
  at::Tensor grid = at::arange(-12.0, 12.0, 1.0 / 1024, at::kDouble).to(at::kFloat);
  at::Tensor edges = at::tensor({0.0f, -0.0f, 1e-30f, -1e-30f, 1e-6f, -1e-6f, 30.0f, -30.0f, 1e6f, -1e6f,
                                 1e30f, -1e30f});
  return at::cat({grid, edges});
}

TEST(FusedGelu, MatchesFloat64WithinTheConditioningOfItsArgument) {
  at::Tensor x = gelu_inputs().requires_grad_(true);
  at::Tensor y = gelu_tanh(x);
  at::Tensor dy = at::ones_like(y);
  y.backward(dy);
  const float* xs = x.data_ptr<float>();
  const float* ys = y.data_ptr<float>();
  const float* gs = x.grad().data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double xd = xs[i], want = gelu64(xd);
    // e^(-z) turns the float rounding of its argument z into |z| times that much relative error:
    // a few float ulps times (1 + |z|); results under 1e-37 in size come out as zeros.
    const double z = std::min(88.0, std::fabs(2.0 * std::sqrt(2.0 / M_PI) * (xd + 0.044715 * xd * xd * xd)));
    EXPECT_LE(std::fabs(ys[i] - want), 4.8e-7 * (1.0 + z) * std::fabs(want) + 1e-37) << "gelu(" << xd << ")";
    // The derivative lies in [-0.17, 1.13]: absolute error.
    const double want_grad = std::fabs(xd) > 20 ? (xd > 0 ? 1.0 : 0.0) : gelu64_grad(xd);
    EXPECT_LE(std::fabs(gs[i] - want_grad), 1e-6) << "gelu'(" << xd << ")";
  }
  // NaN stays NaN both ways.
  at::Tensor nan = at::full({16}, std::nanf(""), at::kFloat).requires_grad_(true);
  at::Tensor ynan = gelu_tanh(nan);
  ynan.sum().backward();
  EXPECT_TRUE(ynan.isnan().all().item<bool>());
  EXPECT_TRUE(nan.grad().isnan().all().item<bool>());
}

TEST(FusedGelu, KernelIsTheScalarFunctionBitForBit) {
  // Every SIMD variant computes GeluTanh's operations in order, without FMA contraction (this
  // file is built with -ffp-contract=off too): the loop's bits are the scalar function's.
  at::manual_seed(11);
  at::Tensor x = at::cat({at::randn({100003}) * 4, gelu_inputs()}).requires_grad_(true);
  at::Tensor dy = at::randn({x.numel()});
  at::Tensor y = gelu_tanh(x);
  y.backward(dy);
  const float* xs = x.data_ptr<float>();
  const float* ys = y.data_ptr<float>();
  const float* gs = x.grad().data_ptr<float>();
  const float* dys = dy.data_ptr<float>();
  int64_t differ = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const float f = GeluTanh::forward(xs[i]), b = GeluTanh::backward(xs[i], dys[i]);
    differ += std::memcmp(&f, ys + i, 4) != 0 || std::memcmp(&b, gs + i, 4) != 0;
  }
  EXPECT_EQ(differ, 0);
}

TEST(FusedGelu, AgreesWithLibTorchsGelu) {
  // LibTorch computes 0.5 x (1 + tanh u) in float, whose 1 + tanh cancels for negative x: the
  // two agree to a few float ulps of |x| (and exactly in what they return for other tensors).
  at::manual_seed(5);
  at::Tensor values = at::randn({4, 64, 257}) * 3;
  at::Tensor x = values.clone().requires_grad_(true), xt = values.clone().requires_grad_(true);
  at::Tensor dy = at::randn(values.sizes());
  at::Tensor y = gelu_tanh(x), yt = at::gelu(xt, "tanh");
  y.backward(dy);
  yt.backward(dy);
  const at::Tensor scale = 1 + values.abs();
  EXPECT_LT(((y - yt).abs() / scale).max().item<double>(), 1e-6);
  EXPECT_LT(((x.grad() - xt.grad()).abs() / (1 + dy.abs())).max().item<double>(), 1e-5);
  // Non-contiguous fp32, bf16 and fp16 take LibTorch's gelu: the same bits.
  at::Tensor strided = values.transpose(1, 2);
  EXPECT_TRUE(at::equal(gelu_tanh(strided), at::gelu(strided, "tanh")));
  for (at::ScalarType t : {at::kBFloat16, at::kHalf}) {
    EXPECT_TRUE(at::equal(gelu_tanh(values.to(t)), at::gelu(values.to(t), "tanh"))) << t;
  }
}

TEST(FusedGelu, KeepsWhatLibTorchsGeluKeeps) {
  memory::install_tracking_allocator();
  at::Tensor w = (at::randn({1024, 256}) * 0.05).requires_grad_(true);
  at::Tensor x = at::randn({8, 128, 256});
  auto kept = [&](bool fused) {
    const int64_t before = live_bytes();
    at::Tensor h = at::linear(x, w);  // GPT-2's c_fc: gelu's input is also what autograd keeps
    at::Tensor y = fused ? gelu_tanh(h) : at::gelu(h, "tanh");
    h = at::Tensor();
    return std::pair<int64_t, at::Tensor>(live_bytes() - before, y);
  };
  auto [libtorch_bytes, y1] = kept(false);
  auto [fused_bytes, y2] = kept(true);
  EXPECT_EQ(fused_bytes, libtorch_bytes);
  EXPECT_GT(fused_bytes, 0);
}

// ---- the LM head and its cross-entropy, chunked ----------------------------------------------

// The unfused loss in float64 (LibTorch's linear and cross_entropy) of the same values, its
// backward run with the same incoming scalar; the chunked loss and gradients against it.
struct CrossEntropyCase {
  int64_t rows, width, vocab;
  bool x_grad, w_grad;
};

void check_linear_cross_entropy(const CrossEntropyCase& c, at::ScalarType dtype, double tol) {
  SCOPED_TRACE(std::string(c10::toString(dtype)) + " rows " + std::to_string(c.rows));
  at::manual_seed(11);
  auto [x, x64] = leaf(at::randn({c.rows, c.width}), dtype);
  auto [w, w64] = leaf(at::randn({c.vocab, c.width}) / std::sqrt(double(c.width)), dtype);
  x.requires_grad_(c.x_grad);
  x64.requires_grad_(c.x_grad);
  w.requires_grad_(c.w_grad);
  w64.requires_grad_(c.w_grad);
  at::Tensor targets = at::randint(c.vocab, {c.rows}, at::kLong);
  targets.index_put_({at::arange(0, c.rows, 7)}, -100);  // every 7th row not counted
  const double scale = 0.37;  // as the engine scales: world size / tokens counted

  at::Tensor loss = linear_cross_entropy_sum(x, w, targets);
  EXPECT_EQ(loss.scalar_type(), at::kFloat);
  // The reference rounds the logits to the compute dtype before the fp32 softmax, as at::linear
  // does; in float64 from there.
  const at::Tensor logits = at::linear(x64, w64).to(dtype).to(at::kDouble);
  at::Tensor loss64 = at::cross_entropy_loss(logits, targets, {}, at::Reduction::Sum);
  EXPECT_LT(std::abs(loss.item<double>() / loss64.item<double>() - 1.0), dtype == at::kFloat ? 1e-6 : 1e-5);
  (loss * scale).backward();
  (loss64 * scale).backward();
  if (c.x_grad) {
    EXPECT_EQ(x.grad().scalar_type(), dtype);
    EXPECT_LT(rel_err(x.grad(), x64.grad()), tol);
    // Rows not counted have no gradient at all.
    EXPECT_EQ(x.grad()[0].abs().max().item<double>(), 0.0);
  }
  if (c.w_grad) {
    EXPECT_EQ(w.grad().scalar_type(), dtype);
    EXPECT_LT(rel_err(w.grad(), w64.grad()), tol);
  } else {
    EXPECT_FALSE(w.grad().defined());
  }
}

TEST(LinearCrossEntropy, MatchesTheUnfusedLossAndGradients) {
  // 40000 logits a row: 32 MiB of fp32 hold 209, so three chunks of 500 rows, the last one short.
  for (const CrossEntropyCase& c : {CrossEntropyCase{500, 48, 40000, true, true}, CrossEntropyCase{30, 16, 300, true, true},
                                    CrossEntropyCase{450, 32, 40000, true, false},
                                    CrossEntropyCase{450, 32, 40000, false, true}}) {
    check_linear_cross_entropy(c, at::kFloat, 1e-5);
  }
  // 16-bit: the gradients of the logits are rounded to the compute dtype for both products, as
  // LibTorch's 16-bit linear rounds them; the weight's gradient is also rounded once per chunk.
  check_linear_cross_entropy({500, 48, 40000, true, true}, at::kBFloat16, kBf16Tol);
  check_linear_cross_entropy({500, 48, 40000, true, true}, at::kHalf, kFp16Tol);
}

// No logits held whole: in forward and backward together the allocator's peak above the inputs is
// the two gradients and one chunk's logits (and its fp32 copy in 16 bits), not rows x vocab — with
// room for the BLAS's own scratch, which depends on the CPU: oneDNN's bf16 GEMM takes ~0.3 MB from
// the allocator without AMX, 1.5 MB with it (measured on a Sapphire Rapids with AMX-BF16), against
// the 50 MB a second chunk would add.
TEST(LinearCrossEntropy, HoldsOneChunkOfLogitsAndTheGradients) {
  memory::install_tracking_allocator();
  at::manual_seed(3);
  const int64_t N = 2048, C = 64, V = 32768;  // 32 MiB of fp32 logits: chunks of 256 rows
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const at::Tensor x = at::randn({N, C}).to(dtype).requires_grad_(true);
    const at::Tensor w = (at::randn({V, C}) * 0.1).to(dtype).requires_grad_(true);
    const at::Tensor t = at::randint(V, {N}, at::kLong);
    const int64_t b = static_cast<int64_t>(c10::elementSize(dtype));
    const int64_t before = memory::allocator_stats().current_bytes;
    memory::reset_peak();
    linear_cross_entropy_sum(x, w, t).backward();
    const int64_t chunk = 256 * V * (dtype == at::kFloat ? 4 : 4 + b);
    const int64_t grads = (N * C + V * C) * b;
    const int64_t peak = memory::allocator_stats().peak_bytes - before;
    EXPECT_GE(peak, chunk + grads);
    EXPECT_LT(peak, chunk + grads + (4 << 20)) << "small tensors only beyond a chunk and the gradients";
    EXPECT_LT(peak, N * V * 4 / 4) << "a quarter of the whole logits";
  }
}

TEST(LinearCrossEntropy, WithoutGradientsComputesTheLossAlone) {
  at::manual_seed(4);
  const at::Tensor x = at::randn({100, 16}), w = at::randn({500, 16}), t = at::randint(500, {100}, at::kLong);
  const double want = at::cross_entropy_loss(at::linear(x.to(at::kDouble), w.to(at::kDouble)), t, {},
                                             at::Reduction::Sum).item<double>();
  at::NoGradGuard no_grad;
  EXPECT_NEAR(linear_cross_entropy_sum(x, w, t).item<double>(), want, 1e-5 * std::abs(want));
}

TEST(LinearCrossEntropy, ATargetOutsideTheVocabularyIsAnErrorNamingIt) {
  const at::Tensor x = at::randn({4, 8}), w = at::randn({10, 8});
  try {
    linear_cross_entropy_sum(x, w, at::tensor({1, 2, 10, -100}, at::kLong));
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("target 10 is outside the vocabulary [0, 10)"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace memrt::ops
