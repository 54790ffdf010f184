// The fused optimizer step (runtime/src/optim/fused_adam.h): every kernel against a scalar
// reference of the same operations, bit for bit; fp32 against torch.optim.AdamW over 100 steps
// (tests/data/reference_optim.py, run by the venv's Python); the gradient statistics of pass 1.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "memrt/error.h"
#include "optim/fused_adam.h"
#include "optim/optimizer_math.h"
#include "adam_buffers.h"
#include "test_util.h"

using namespace memrt;
using memrt::test::Buffers;
using memrt::test::make_buffers;
using memrt::test::read_raw;
using memrt::test::run_reference;
using memrt::test::TempDir;
using memrt::test::write_raw;

namespace {

constexpr int64_t kN = 3 * (1 << 15) + 37;  // several parallel chunks and a tail of 37

// AdamW's scalars of step t (1-based), with reference_optim.py's b1=0.8 b2=0.95 eps=1e-2.
AdamScalars scalars(double lr, double wd, int64_t t) {
  return adam_scalars(lr, 0.8, 0.95, 1e-2, wd, /*decoupled=*/true, /*bias_correction=*/true, t);
}

// The scalar reference: one element at a time, in this file's own loop (built without FMA
// contraction, like the kernels), widening and narrowing through LibTorch's conversions.
void reference_step(Buffers& b, const AdamScalars& s, float factor) {
  const int64_t n = b.compute.numel();
  at::Tensor grad = b.grad.to(at::kFloat);
  at::Tensor p = b.master.defined() ? b.master : b.compute.to(at::kFloat);
  float* pp = p.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  float* m = b.m.data_ptr<float>();
  float* v = b.v.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) adam_update(pp[i], g[i] * factor, m[i], v[i], s);
  b.compute.copy_(p);  // rounds to nearest-even into the compute dtype
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.numel() == b.numel() &&
         std::memcmp(a.data_ptr(), b.data_ptr(), static_cast<size_t>(a.nbytes())) == 0;
}

void expect_kernel_matches_reference(at::ScalarType compute, at::ScalarType grad, ops::CpuKernels kernels) {
  const std::string what = std::string(ops::to_string(kernels)) + " kernels, compute " +
                           c10::toString(compute) + ", gradient " + c10::toString(grad);
  at::manual_seed(11);
  Buffers kernel = make_buffers(compute, grad, kN);
  Buffers ref;
  ref.master = kernel.master.defined() ? kernel.master.clone() : at::Tensor();
  ref.compute = kernel.compute.clone();
  ref.grad = kernel.grad.clone();
  ref.m = kernel.m.clone();
  ref.v = kernel.v.clone();
  for (int64_t t = 1; t <= 3; ++t) {
    const AdamScalars s = scalars(1e-2 * static_cast<double>(t), 0.1, t);
    const float factor = 1.f / (100.f * 1.37f);  // unscale by 100, clip by 1.37
    fused_adam_cpu(kernel.range(), s, factor, kernels);
    reference_step(ref, s, factor);
    kernel.grad.copy_((at::randn({kN}) * 100).to(kernel.grad.scalar_type()));
    ref.grad.copy_(kernel.grad);
  }
  EXPECT_TRUE(same_bits(kernel.compute, ref.compute)) << what << ": compute copy";
  if (ref.master.defined()) {
    EXPECT_TRUE(same_bits(kernel.master, ref.master)) << what << ": master";
  }
  EXPECT_TRUE(same_bits(kernel.m, ref.m)) << what << ": exp_avg";
  EXPECT_TRUE(same_bits(kernel.v, ref.v)) << what << ": exp_avg_sq";
}

}  // namespace

const std::vector<std::pair<at::ScalarType, at::ScalarType>> kCombinations = {
    {at::kFloat, at::kFloat}, {at::kBFloat16, at::kBFloat16}, {at::kBFloat16, at::kFloat},
    {at::kHalf, at::kHalf}, {at::kHalf, at::kFloat}};

// The kernels this processor can run, each held to the scalar reference (and kBest, what the
// step runs by default).
std::vector<ops::CpuKernels> runnable_kernels() {
  std::vector<ops::CpuKernels> out;
  for (ops::CpuKernels k : {ops::CpuKernels::kBest, ops::CpuKernels::kAvx512, ops::CpuKernels::kAvx2, ops::CpuKernels::kPortable})
    if (ops::cpu_supports(k)) out.push_back(k);
  return out;
}

// The portable loops run the widest variant this CPU has (AVX-512, AVX2 or baseline x86-64); the
// hand-written AVX-512F and AVX2+F16C kernels of the mixed-precision step run where the CPU has
// them. Each must give the scalar reference's bits, in every dtype combination the step takes.
TEST(FusedAdam, EveryKernelMatchesTheScalarReferenceBitForBit) {
#if defined(__x86_64__)
  std::printf("portable loops built for AVX-512, AVX2 and x86-64; this CPU runs %s; hand-written kernels: "
              "AVX-512F %s, AVX2+F16C %s\n",
              __builtin_cpu_supports("avx512f") ? "AVX-512" : __builtin_cpu_supports("avx2") ? "AVX2" : "x86-64",
              ops::cpu_supports(ops::CpuKernels::kAvx512) ? "yes" : "no", ops::cpu_supports(ops::CpuKernels::kAvx2) ? "yes" : "no");
#endif
  for (ops::CpuKernels kernels : runnable_kernels())
    for (const auto& [compute, grad] : kCombinations) expect_kernel_matches_reference(compute, grad, kernels);
}

// The values random data never gives: masters whose 16-bit copies are subnormal, round to the
// largest finite value or overflow to infinity, fp32 subnormal masters, infinite and NaN masters
// and gradients, zero and subnormal gradients. Each hand-written kernel and the portable loops
// agree on every bit of every buffer (NaNs included), over steps that mix them with ordinary
// values, on a range whose 16-bit copy starts off a 32-byte boundary.
TEST(FusedAdam, SpecialValuesGiveTheSameBitsInEveryKernel) {
  const uint32_t payload_nan_bits = 0x7fa00000u;  // a signalling NaN with payload bits
  float payload_nan = 0.f;
  std::memcpy(&payload_nan, &payload_nan_bits, sizeof payload_nan);
  const std::vector<float> masters = {payload_nan, 3.0e-6f, -2.5e-7f, 6.0e-8f, 1.0e-39f, -1.0e-39f, 65504.f, 65519.f, 65520.f,
                                      -7.0e4f, 3.3e38f, -3.3e38f, 3.4e38f, -3.4e38f, INFINITY, -INFINITY, NAN, -NAN, 0.f, -0.f, 1.f};
  const std::vector<float> grads = {0.f, -0.f, 1e-7f, -3e-6f, 1e-40f, 7e4f, INFINITY, -INFINITY, NAN, 1.f, -1.f};
  constexpr int64_t n = 2 * (1 << 15) + 29;  // two parallel chunks, and a tail in the 16- and 8-lane kernels
  for (const auto& [compute, grad] : kCombinations) {
    if (compute == at::kFloat) continue;  // no master: one kernel
    SCOPED_TRACE(std::string("compute ") + c10::toString(compute) + ", gradient " + c10::toString(grad));
    at::manual_seed(3);
    Buffers start = make_buffers(compute, grad, n);
    float* p = start.master.data_ptr<float>();
    for (int64_t i = 0; i < n; i += 7) p[i] = masters[static_cast<size_t>(i / 7) % masters.size()];
    at::Tensor g = start.grad.to(at::kFloat);
    for (int64_t i = 0; i < n; i += 5) g.data_ptr<float>()[i] = grads[static_cast<size_t>(i / 5) % grads.size()];
    // With a zero gradient and no weight decay these stay put: 16-bit subnormals and overflows.
    const std::vector<float> kept = {1.0e-39f, -3.0e-6f, 2.0e-7f, 3.4e38f, -65520.f};
    for (size_t k = 0; k < kept.size(); ++k) {
      p[n - 20 + static_cast<int64_t>(k)] = kept[k];  // in the tail as well as in the body
      p[1001 + static_cast<int64_t>(k)] = kept[k];
      g.data_ptr<float>()[n - 20 + static_cast<int64_t>(k)] = g.data_ptr<float>()[1001 + static_cast<int64_t>(k)] = 0.f;
    }
    start.compute.copy_(start.master);
    start.grad.copy_(g);
    auto clone = [](const Buffers& b) {
      return Buffers{b.master.clone(), b.compute.clone(), b.grad.clone(), b.m.clone(), b.v.clone()};
    };
    // From element 3 on: the 16-bit copy does not start at a 32-byte boundary.
    auto from3 = [](AdamRange r) {
      r.master += 3;
      r.compute = static_cast<char*>(r.compute) + 3 * c10::elementSize(r.compute_type);
      r.grad = static_cast<const char*>(r.grad) + 3 * c10::elementSize(r.grad_type);
      r.exp_avg = static_cast<float*>(r.exp_avg) + 3;
      r.exp_avg_sq = static_cast<float*>(r.exp_avg_sq) + 3;
      r.n -= 3;
      return r;
    };
    auto steps = [&](Buffers& b, ops::CpuKernels kernels) {
      for (int64_t t = 1; t <= 3; ++t) fused_adam_cpu(from3(b.range()), scalars(1e-2, 0.0, t), 1.f / 64, kernels);
    };
    Buffers portable = clone(start);
    steps(portable, ops::CpuKernels::kPortable);
    for (ops::CpuKernels kernels : runnable_kernels()) {
      if (kernels == ops::CpuKernels::kPortable) continue;
      SCOPED_TRACE(std::string(ops::to_string(kernels)) + " kernels");
      Buffers b = clone(start);
      steps(b, kernels);
      EXPECT_TRUE(same_bits(b.compute, portable.compute)) << "compute copy";
      EXPECT_TRUE(same_bits(b.master, portable.master)) << "master";
      EXPECT_TRUE(same_bits(b.m, portable.m)) << "exp_avg";
      EXPECT_TRUE(same_bits(b.v, portable.v)) << "exp_avg_sq";
    }
    // The special values made it through: infinities and NaNs in the 16-bit copy, and subnormals.
    const at::Tensor c = portable.compute.to(at::kFloat);
    EXPECT_GT(c.isinf().sum().item<int64_t>(), 0);
    EXPECT_GT(c.isnan().sum().item<int64_t>(), 0);
    EXPECT_GT((c.abs().gt(0) & c.abs().lt(compute == at::kHalf ? 6.1e-5 : 1.18e-38)).sum().item<int64_t>(), 0);
  }
}

// Unscaled and unclipped, the fp32 step is adam_update() element by element, bit for bit.
TEST(FusedAdam, Fp32WithFactorOneIsAdamUpdatePerElement) {
  at::manual_seed(5);
  Buffers b = make_buffers(at::kFloat, at::kFloat, kN);
  at::Tensor p = b.compute.clone(), m = b.m.clone(), v = b.v.clone();
  const AdamScalars s = scalars(1e-3, 0.01, 1);
  fused_adam_cpu(b.range(), s, 1.f);
  const float* g = b.grad.data_ptr<float>();
  for (int64_t i = 0; i < kN; ++i)
    adam_update(p.data_ptr<float>()[i], g[i], m.data_ptr<float>()[i], v.data_ptr<float>()[i], s);
  EXPECT_TRUE(same_bits(b.compute, p));
  EXPECT_TRUE(same_bits(b.m, m));
  EXPECT_TRUE(same_bits(b.v, v));
}

// 100 steps of AdamW in fp32 against torch.optim.AdamW (foreach off) on the same parameters,
// gradients and learning rates: within 1e-6 of the largest value, normwise.
TEST(FusedAdam, Fp32FollowsTorchAdamWOver100Steps) {
  constexpr int kSteps = 100;
  constexpr int64_t n = 4099;
  at::manual_seed(3);
  at::Tensor p = at::randn({n});
  at::Tensor grads = at::randn({kSteps, n});
  std::vector<double> lrs;
  for (int t = 0; t < kSteps; ++t) lrs.push_back(1e-3 * (1 + t % 7));
  TempDir dir;
  write_raw(dir.file("params.f32"), std::vector<float>(p.data_ptr<float>(), p.data_ptr<float>() + n));
  write_raw(dir.file("grads.f32"),
            std::vector<float>(grads.data_ptr<float>(), grads.data_ptr<float>() + kSteps * n));
  write_raw(dir.file("lrs.f64"), lrs);

  at::Tensor m = at::zeros({n}), v = at::zeros({n});
  for (int t = 0; t < kSteps; ++t) {
    at::Tensor g = grads[t].contiguous();
    AdamRange r;
    r.compute = p.data_ptr<float>();
    r.grad = g.data_ptr<float>();
    r.exp_avg = m.data_ptr<float>();
    r.exp_avg_sq = v.data_ptr<float>();
    r.n = n;
    fused_adam_cpu(r, scalars(lrs[static_cast<size_t>(t)], 0.1, t + 1), 1.f);
  }
  ASSERT_TRUE(run_reference("reference_optim.py", dir.str() + " adamw " + std::to_string(n) + " " +
                                                      std::to_string(kSteps) + " b1=0.8 b2=0.95 eps=1e-2 wd=0.1"));
  for (const auto& [got, file] : {std::pair<at::Tensor, std::string>{p, "out_params.f32"},
                                  {m, "out_exp_avg.f32"}, {v, "out_exp_avg_sq.f32"}}) {
    const std::vector<float> want = read_raw<float>(dir.file(file));
    ASSERT_EQ(static_cast<int64_t>(want.size()), n) << file;
    at::Tensor w = at::from_blob(const_cast<float*>(want.data()), {n}).to(at::kDouble);
    const double scale = w.abs().max().item<double>();
    const double err = (got.to(at::kDouble) - w).abs().max().item<double>();
    EXPECT_LE(err, 1e-6 * scale) << file << ": largest difference " << err << " against largest |value| " << scale;
  }
}

// Pass 1: the sum of squares against a double reduction, the same bits with 1 or 2 threads, and
// an inf or NaN anywhere (the last element included) seen, in each gradient dtype.
TEST(FusedAdam, GradStatsAreExactDeterministicAndSeeEveryNonFinite) {
  for (at::ScalarType type : {at::kFloat, at::kBFloat16, at::kHalf}) {
    at::manual_seed(9);
    at::Tensor g = (at::randn({kN}) * 10).to(type);
    const double want = g.to(at::kDouble).pow(2).sum().item<double>();
    const int threads = at::get_num_threads();
    at::set_num_threads(1);
    const GradStats one = grad_stats_cpu(g.data_ptr(), type, kN);
    at::set_num_threads(2);
    const GradStats two = grad_stats_cpu(g.data_ptr(), type, kN);
    at::set_num_threads(threads);
    EXPECT_TRUE(one.finite && two.finite) << c10::toString(type);
    EXPECT_NEAR(one.sum_squares, want, 1e-12 * want) << c10::toString(type);
    EXPECT_EQ(std::memcmp(&one.sum_squares, &two.sum_squares, sizeof(double)), 0)
        << c10::toString(type) << ": " << one.sum_squares << " with 1 thread, " << two.sum_squares << " with 2";
    for (int64_t at_index : {int64_t{0}, kN / 2, kN - 1}) {
      for (double bad : {INFINITY, -INFINITY, NAN}) {
        at::Tensor h = g.clone();
        h[at_index] = bad;
        EXPECT_FALSE(grad_stats_cpu(h.data_ptr(), type, kN).finite)
            << c10::toString(type) << ": " << bad << " at " << at_index;
      }
    }
  }
}

uint32_t bits_of(float f) {
  uint32_t u = 0;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// The fused step's own fp16 conversions (branch-free, so its loops vectorise) against c10::Half's:
// every fp16 value widened, and fp32 values around every rounding boundary of every fp16
// exponent narrowed, plus random ones.
TEST(FusedAdam, Fp16ConversionsAreCHalfsBitForBit) {
  for (uint32_t h = 0; h <= 0xffffu; ++h) {
    const float want = static_cast<float>(c10::Half(static_cast<uint16_t>(h), c10::Half::from_bits()));
    const float got = float_from_fp16_bits(static_cast<uint16_t>(h));
    ASSERT_EQ(bits_of(got), bits_of(want)) << "fp16 bits 0x" << std::hex << h;
  }
  auto check = [](uint32_t x) {
    float f = 0.f;
    std::memcpy(&f, &x, sizeof f);
    const uint16_t want = c10::Half(f).x;
    const uint16_t got = fp16_bits_from_float(f);
    if (std::isnan(f)) {
      ASSERT_EQ(got & 0x7c00u, 0x7c00u) << "NaN 0x" << std::hex << x;
      ASSERT_NE(got & 0x3ffu, 0u) << "NaN 0x" << std::hex << x;
    } else {
      ASSERT_EQ(got, want) << "fp32 bits 0x" << std::hex << x;
    }
  };
  // The 13 bits an fp16 drops decide the rounding: halfway, either side of it, and the extremes.
  const uint32_t low[] = {0x0000, 0x0001, 0x0fff, 0x1000, 0x1001, 0x1fff, 0x0800, 0x17ff, 0x1800};
  for (uint32_t high = 0; high < (1u << 19); ++high)
    for (uint32_t l : low) check((high << 13) | l);
  std::mt19937 rng(1);
  for (int i = 0; i < (1 << 22); ++i) check(static_cast<uint32_t>(rng()));
}

// The CUDA kernel's bf16 conversions (optimizer_math.h) against c10::BFloat16, which the CPU
// kernels use: every bf16 value, every rounding case of the 16 dropped bits, random floats.
TEST(FusedAdam, Bf16ConversionsAreCBFloat16sBitForBit) {
  for (uint32_t h = 0; h <= 0xffffu; ++h) {
    const float want = static_cast<float>(c10::BFloat16(static_cast<uint16_t>(h), c10::BFloat16::from_bits()));
    const float got = float_from_bf16_bits(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << "bf16 bits 0x" << std::hex << h;
    } else {
      ASSERT_EQ(bits_of(got), bits_of(want)) << "bf16 bits 0x" << std::hex << h;
    }
  }
  auto check = [](uint32_t x) {
    float f = 0.f;
    std::memcpy(&f, &x, sizeof f);
    ASSERT_EQ(bf16_bits_from_float(f), c10::BFloat16(f).x) << "fp32 bits 0x" << std::hex << x;
  };
  const uint32_t low[] = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff};
  for (uint32_t high = 0; high < (1u << 16); ++high)
    for (uint32_t l : low) check((high << 16) | l);
  std::mt19937 rng(2);
  for (int i = 0; i < (1 << 22); ++i) check(static_cast<uint32_t>(rng()));
}

TEST(FusedAdam, ACombinationWithoutAKernelIsAnErrorNamingIt) {
  Buffers b = make_buffers(at::kHalf, at::kHalf, 64);
  AdamRange r = b.range();
  r.master = nullptr;  // fp16 is updated through masters only (bf16 may go without)
  try {
    fused_adam_cpu(r, scalars(1e-3, 0.0, 1), 1.f);
    FAIL() << "fp16 without a master was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("compute Half, gradient Half, without an fp32 master"),
              std::string::npos)
        << e.what();
  }
  at::Tensor g = at::zeros({64}, at::kDouble);
  try {
    grad_stats_cpu(g.data_ptr(), at::kDouble, 64);
    FAIL() << "double gradients were read as another type";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no kernel for Double gradients"), std::string::npos) << e.what();
  }
  // Kernels this processor cannot run are refused, not run into an illegal instruction.
  Buffers mixed = make_buffers(at::kBFloat16, at::kBFloat16, 64);
  for (ops::CpuKernels k : {ops::CpuKernels::kAvx512, ops::CpuKernels::kAvx2}) {
    if (ops::cpu_supports(k)) continue;
    try {
      fused_adam_cpu(mixed.range(), scalars(1e-3, 0.0, 1), 1.f, k);
      FAIL() << ops::to_string(k) << " kernels ran on a processor without them";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("cannot run the ") + ops::to_string(k)), std::string::npos)
          << e.what();
    }
  }
}

// bf16 moments (bf16_optimizer_states) and bf16 weights without a master
// (bf16_master_weights_and_grads), against LibTorch's own ops: per step, the moments and the weight
// widened from bf16, DeepSpeed's update in fp32 with at:: ops, each rounded back to bf16 by
// LibTorch's conversion. Five steps, within one bf16 unit in the last place of every value (LibTorch's
// vectorised arithmetic may contract a multiply-add the kernel keeps apart).
TEST(FusedAdam, Bf16MomentsAndMasterlessBf16WeightsFollowLibTorchsArithmetic) {
  constexpr int64_t n = 20000;
  at::manual_seed(21);
  at::Tensor w = at::randn({n}).to(at::kBFloat16);
  at::Tensor m = at::zeros({n}, at::kBFloat16), v = at::zeros({n}, at::kBFloat16);
  at::Tensor rw = w.clone(), rm = m.clone(), rv = v.clone();
  for (int64_t t = 1; t <= 5; ++t) {
    const at::Tensor g = (at::randn({n}) * 10).to(at::kBFloat16);
    const AdamScalars s = scalars(1e-2, 0.1, t);
    fused_adam_cpu(adam_range(at::Tensor(), w, g, m, v), s, 0.5f);
    const at::Tensor gf = g.to(at::kFloat) * 0.5f;
    at::Tensor p = rw.to(at::kFloat);
    const at::Tensor mm = rm.to(at::kFloat) * s.beta1 + gf * (1.f - s.beta1);
    const at::Tensor vv = rv.to(at::kFloat) * s.beta2 + (gf * gf) * (1.f - s.beta2);
    const at::Tensor denom = vv.sqrt() * s.bc2_rsqrt + s.eps;
    p = p - p * s.decay;
    p = p - (mm / denom) * s.step_size;
    rw = p.to(at::kBFloat16);
    rm = mm.to(at::kBFloat16);
    rv = vv.to(at::kBFloat16);
    for (const auto& [got, want, name] : {std::tuple{w, rw, "weight"}, std::tuple{m, rm, "exp_avg"}, std::tuple{v, rv, "exp_avg_sq"}}) {
      const at::Tensor ulp = (want.to(at::kFloat).abs() * (1.f / 128)).clamp_min(1e-30f);
      EXPECT_TRUE(((got.to(at::kFloat) - want.to(at::kFloat)).abs() <= ulp).all().item<bool>())
          << name << " at step " << t;
    }
  }
  // With an fp32 master the moments are the only bf16 values; the master is the kernel's fp32 p.
  at::manual_seed(22);
  Buffers b = make_buffers(at::kBFloat16, at::kBFloat16, n);
  at::Tensor m16 = at::zeros({n}, at::kBFloat16), v16 = at::zeros({n}, at::kBFloat16);
  Buffers f32 = b;
  f32.master = b.master.clone(), f32.compute = b.compute.clone();
  fused_adam_cpu(adam_range(b.master, b.compute, b.grad, m16, v16), scalars(1e-3, 0.0, 1), 1.f / 64);
  fused_adam_cpu(f32.range(), scalars(1e-3, 0.0, 1), 1.f / 64);
  // First step from zero moments: m = (1-b1) g and v = (1-b2) g^2 round to bf16, the update uses
  // the unrounded values, so the masters agree with the fp32-state step exactly.
  EXPECT_TRUE(same_bits(b.master, f32.master));
  EXPECT_TRUE(same_bits(m16, f32.m.to(at::kBFloat16)));
  EXPECT_TRUE(same_bits(v16, f32.v.to(at::kBFloat16)));
}

// Stochastic rounding (torchao's bf16_stochastic_round): given the 16 random bits of an element,
// the result is torchao's — truncate towards zero, one ulp away from zero when the random bits are
// below the dropped ones; over many seeds the mean is the fp32 value (unbiased), where
// round-to-nearest of a small update to a large weight never moves it; the draws depend only on
// the seed and the element's index (threads and range splits do not change them).
TEST(FusedAdam, StochasticRoundingIsTorchaosAndUnbiased) {
  for (float x : {1.0f, -3.14159f, 1e-3f, -65504.f, 3.3895314e38f}) {
    uint32_t bits = 0;
    std::memcpy(&bits, &x, sizeof bits);
    for (uint32_t r : {0u, 1u, 0x7fffu, 0x8000u, 0xfffeu, 0xffffu, bits & 0xffffu, (bits & 0xffffu) - 1}) {
      const uint32_t torchao = (r < (bits & 0xffffu)) ? (bits & 0xffff0000u) + 0x10000u : (bits & 0xffff0000u);
      EXPECT_EQ(bf16_bits_stochastic(x, r), static_cast<uint16_t>(torchao >> 16)) << x << " " << r;
    }
  }
  EXPECT_EQ(bf16_bits_stochastic(std::nanf(""), 0), 0x7fc0u);
  EXPECT_EQ(bf16_bits_stochastic(INFINITY, 0xffff), 0x7f80u);

  // A weight of 1.0 and an update of 3/8 of its bf16 ulp on 10000 elements: round-to-nearest never
  // moves it; stochastic rounding moves 3/8 of them by one ulp, so the mean update is 3/8 ulp
  // (within 1% and three standard deviations of the draw).
  constexpr int64_t n = 10000;
  const float ulp = 1.f / 128;  // bf16 spacing at 1.0
  at::Tensor w = at::ones({n}, at::kBFloat16);
  at::Tensor g = at::full({n}, -1.f);
  at::Tensor m = at::zeros({n}), v = at::zeros({n});
  AdamScalars s;  // lr such that the update is 3/8 ulp: step_size * m / (sqrt(v) + eps) with m/sqrt(v) = 1
  s.beta1 = 0.f, s.beta2 = 0.f, s.eps = 0.f, s.step_size = 0.375f * ulp;
  AdamRange r = adam_range(at::Tensor(), w, g, m, v);
  r.stochastic_round = true;
  r.seed = 1234;
  fused_adam_cpu(r, s, 1.f);
  const double mean = (w.to(at::kDouble) - 1.0).mean().item<double>();
  EXPECT_NEAR(mean, 0.375 * ulp, 0.01 * 0.375 * ulp + 3 * ulp * std::sqrt(0.375 * 0.625 / n));
  // The same draws on one thread and in two halves.
  at::Tensor w1 = at::ones({n}, at::kBFloat16), w2 = at::ones({n}, at::kBFloat16);
  at::Tensor m1 = at::zeros({n}), v1 = at::zeros({n}), m2 = at::zeros({n}), v2 = at::zeros({n});
  {
    const int threads = at::get_num_threads();
    at::set_num_threads(1);
    AdamRange a = adam_range(at::Tensor(), w1, g, m1, v1);
    a.stochastic_round = true, a.seed = 1234;
    fused_adam_cpu(a, s, 1.f);
    at::set_num_threads(threads);
  }
  for (int64_t half : {0, 1}) {
    const int64_t lo = half * n / 2, len = n / 2;
    AdamRange a = adam_range(at::Tensor(), w2.narrow(0, lo, len), g.narrow(0, lo, len), m2.narrow(0, lo, len),
                             v2.narrow(0, lo, len));
    a.stochastic_round = true, a.seed = 1234, a.first = lo;
    fused_adam_cpu(a, s, 1.f);
  }
  EXPECT_TRUE(same_bits(w1, w));
  EXPECT_TRUE(same_bits(w2, w));
  // Without stochastic rounding the weights do not move at all.
  at::Tensor w3 = at::ones({n}, at::kBFloat16);
  at::Tensor m3 = at::zeros({n}), v3 = at::zeros({n});
  fused_adam_cpu(adam_range(at::Tensor(), w3, g, m3, v3), s, 1.f);
  EXPECT_EQ(w3.to(at::kFloat).sub(1.f).abs().max().item<float>(), 0.f);
}
