// memrt's causal attention kernel (runtime/src/ops/attention_cpu.h, docs/attention.md) against
// float64 attention computed by LibTorch's math path on doubles, with LibTorch's own fp32 flash
// kernel as the yardstick: each SIMD variant this processor runs must be as close to float64 as
// LibTorch's kernel is. 16-bit inputs are computed in fp32 and rounded once: their results are the
// fp32 kernel's on the same values, rounded, bit for bit. The autograd node keeps what LibTorch's
// kernel keeps.
#include <gtest/gtest.h>

#include <torch/autograd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "memory/tracking_allocator.h"
#include "memrt/error.h"
#include "memrt/ops.h"
#include "ops/attention_cpu.h"

namespace memrt::ops {
namespace {

std::vector<CpuKernels> runnable_kernels() {
  std::vector<CpuKernels> out;
  for (CpuKernels k : {CpuKernels::kAvx512, CpuKernels::kAvx2, CpuKernels::kPortable})
    if (cpu_supports(k)) out.push_back(k);
  return out;
}

// max |got - want| over max |want|, or over 1 where every value is smaller (a single key's
// query and key gradients are zero).
double err(const at::Tensor& got, const at::Tensor& want) {
  return (got.to(at::kDouble) - want).abs().max().item<double>() / std::max(want.abs().max().item<double>(), 1.0);
}

struct Case {
  int64_t B, H, H_kv, T, D;
};

// q, k, v as the models pass them: views of one (B, T, H + 2 H_kv, D) projection, so the
// head and batch strides are not a contiguous tensor's.
struct Inputs {
  at::Tensor q, k, v, dout;
};
Inputs inputs(const Case& c, at::ScalarType dtype, uint64_t seed) {
  at::manual_seed(seed);
  const at::Tensor qkv = (at::randn({c.B, c.T, c.H + 2 * c.H_kv, c.D}) * 1.5).to(dtype);
  return {qkv.narrow(2, 0, c.H).transpose(1, 2), qkv.narrow(2, c.H, c.H_kv).transpose(1, 2),
          qkv.narrow(2, c.H + c.H_kv, c.H_kv).transpose(1, 2), at::randn({c.B, c.H, c.T, c.D}).to(dtype)};
}

struct Result {
  at::Tensor out, lse, dq, dk, dv;
};

Result run_kernel(const Inputs& x, CpuKernels kernels, const at::Tensor& positions = {}) {
  const at::Tensor& q = x.q;
  Result r;
  r.out = at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options()).transpose(1, 2);
  r.lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  causal_attention_forward_cpu(x.q, x.k, x.v, positions, r.out, r.lse, kernels);
  r.dq = at::empty(x.q.sizes(), q.options());
  r.dk = at::empty(x.k.sizes(), q.options());
  r.dv = at::empty(x.v.sizes(), q.options());
  causal_attention_backward_cpu(x.q, x.k, x.v, positions, r.out, r.lse, x.dout, r.dq, r.dk, r.dv, kernels);
  return r;
}

// A packed layout's positions (B, T): row b holds samples of lengths[b], one after another,
// positions counting 0, 1, ... in each; the rest of the row is padding, one more sample.
at::Tensor packed_positions(const std::vector<std::vector<int64_t>>& lengths, int64_t T) {
  at::Tensor pos = at::empty({static_cast<int64_t>(lengths.size()), T}, at::kLong);
  for (size_t b = 0; b < lengths.size(); ++b) {
    int64_t t = 0;
    for (int64_t n : lengths[b])
      for (int64_t i = 0; i < n; ++i) pos[b][t++] = i;
    for (int64_t i = 0; t < T; ++i) pos[b][t++] = i;
  }
  return pos;
}

// Which keys each query attends (B, 1, T, T): causal, and inside its own sample when packed.
at::Tensor attended(const at::Tensor& positions, int64_t B, int64_t T) {
  const at::Tensor i = at::arange(T, at::kLong).view({1, 1, T, 1}), j = at::arange(T, at::kLong).view({1, 1, 1, T});
  at::Tensor allowed = (j <= i).expand({B, 1, T, T});
  if (positions.defined()) allowed = allowed & (j >= i - positions.view({B, 1, T, 1}));
  return allowed;
}

// LibTorch's attention through autograd: its flash kernel on fp32, its math path on doubles; with
// positions, each query's keys masked to its own sample (attn_mask).
Result run_libtorch(const Inputs& x, at::ScalarType dtype, const at::Tensor& positions = {}) {
  const at::Tensor q = x.q.to(dtype).requires_grad_(true), k = x.k.to(dtype).requires_grad_(true),
                   v = x.v.to(dtype).requires_grad_(true);
  const bool gqa = q.size(1) != k.size(1);
  const int64_t B = q.size(0), T = q.size(2);
  const at::Tensor allowed = attended(positions, B, T);
  Result r;
  r.out = positions.defined() ? at::scaled_dot_product_attention(q, k, v, allowed, 0.0, false, std::nullopt, gqa)
                              : at::scaled_dot_product_attention(q, k, v, {}, 0.0, true, std::nullopt, gqa);
  auto g = torch::autograd::grad({r.out}, {q, k, v}, {x.dout.to(dtype)});
  r.dq = g[0], r.dk = g[1], r.dv = g[2];
  // The log-sum-exp of each row's scaled scores, in float64.
  const at::Tensor kk = gqa ? x.k.to(at::kDouble).repeat_interleave(q.size(1) / k.size(1), 1) : x.k.to(at::kDouble);
  const at::Tensor s = at::matmul(x.q.to(at::kDouble), kk.transpose(-1, -2)) / std::sqrt(double(q.size(3)));
  r.lse = s.masked_fill(allowed.logical_not(), -INFINITY).logsumexp(-1);
  return r;
}

void expect_as_close_as_libtorch(const Case& c, const at::Tensor& positions = {}) {
  SCOPED_TRACE("B=" + std::to_string(c.B) + " H=" + std::to_string(c.H) + " H_kv=" + std::to_string(c.H_kv) +
               " T=" + std::to_string(c.T) + " D=" + std::to_string(c.D) + (positions.defined() ? " packed" : ""));
  const Inputs x = inputs(c, at::kFloat, 7 + c.T);
  const Result want = run_libtorch(x, at::kDouble, positions);
  const Result flash = run_libtorch(x, at::kFloat, positions);
  // Twice LibTorch's fp32 error, floored at the typical error of an fp32 sum of the n terms each
  // output adds up (sqrt(n) unit roundoffs: keys for out and dq, the group's queries for dk and dv)
  // and at a few roundings: LibTorch's own error depends on the BLAS kernel the CPU runs (2.96e-7 on
  // dv below on an AVX2-only EPYC, where the portable kernel's 6.6e-7 is 0.45 of that floor).
  const double u = std::ldexp(1.0, -24);
  const double keys = static_cast<double>(c.T), group_queries = static_cast<double>(c.T * (c.H / c.H_kv));
  // At T = 1 the exact dq and dk are zero (a query's one key: dS = P (dP - delta) with dP = delta),
  // so any kernel's are the rounding of that difference of two D-term dots, summed in different
  // orders (LibTorch's own: 3.8e-7 on a Sapphire Rapids with AMX, memrt's AVX-512 and AVX2 1.2e-6,
  // its portable kernel 2e-15): floored there at sqrt(D) roundings of the dots' magnitude, carried
  // to dq and dk by |k| or |q| and the softmax scale.
  double cancelled = 0.0;
  if (c.T == 1) {
    const double dots = (x.dout.abs() * x.v.abs()).sum(-1).max().item<double>();
    const double operand = std::max(x.k.abs().max().item<double>(), x.q.abs().max().item<double>());
    const double roundings = std::sqrt(static_cast<double>(c.D)), softmax_scale = 1.0 / std::sqrt(static_cast<double>(c.D));
    cancelled = roundings * u * dots * operand * softmax_scale;
  }
  auto bound = [&](const at::Tensor& libtorch, const at::Tensor& ref, double terms) {
    return std::max({2 * err(libtorch, ref), std::sqrt(terms) * u, 4e-7, cancelled});
  };
  for (CpuKernels kernels : runnable_kernels()) {
    SCOPED_TRACE(to_string(kernels));
    const Result got = run_kernel(x, kernels, positions);
    EXPECT_LE(err(got.out, want.out), bound(flash.out, want.out, keys));
    EXPECT_LE((got.lse.to(at::kDouble) - want.lse).abs().max().item<double>(), 4e-6);
    EXPECT_LE(err(got.dq, want.dq), bound(flash.dq, want.dq, keys));
    EXPECT_LE(err(got.dk, want.dk), bound(flash.dk, want.dk, group_queries));
    EXPECT_LE(err(got.dv, want.dv), bound(flash.dv, want.dv, group_queries));
    std::printf("%-9s T=%-4lld D=%-3lld H/H_kv=%lld/%lld: out %.2e (LibTorch %.2e)  dq %.2e (%.2e)  dk %.2e (%.2e)  "
                "dv %.2e (%.2e)\n", to_string(kernels), (long long)c.T, (long long)c.D, (long long)c.H,
                (long long)c.H_kv, err(got.out, want.out), err(flash.out, want.out), err(got.dq, want.dq),
                err(flash.dq, want.dq), err(got.dk, want.dk), err(flash.dk, want.dk), err(got.dv, want.dv),
                err(flash.dv, want.dv));
  }
}

// Sequence lengths around the 64-row tile (one row, one short of a tile, one over, a partial
// last tile), both head sizes the models use and one more, one batch entry with one head (fewer
// tasks than threads).
TEST(CausalAttention, EachKernelIsAsCloseToFloat64AsLibTorchsFlashKernel) {
  for (const Case& c : {Case{2, 3, 3, 1, 64}, Case{2, 3, 3, 63, 64}, Case{2, 3, 3, 65, 64}, Case{2, 2, 2, 200, 64},
                        Case{1, 2, 2, 130, 128}, Case{2, 2, 2, 97, 32}, Case{1, 1, 1, 256, 64}})
    expect_as_close_as_libtorch(c);
}

// Four query heads share each key/value head: their gradients are summed into it.
TEST(CausalAttention, GroupedQueryHeadsSumIntoTheirKeyValueHead) {
  expect_as_close_as_libtorch({2, 8, 2, 150, 64});
  expect_as_close_as_libtorch({1, 6, 1, 64, 128});
}

// Packed rows (docs/attention.md, "Packed rows"): each query attends to its own sample's keys only.
// Samples start inside tiles, on tile boundaries (64, 128) and across them, two keys long and a whole
// row long, with padding after the last as one more sample; grouped-query heads; three head sizes.
TEST(CausalAttention, PackedRowsAttendWithinEachSampleAsAMaskedAttention) {
  expect_as_close_as_libtorch({2, 3, 3, 150, 64}, packed_positions({{40, 30, 70, 10}, {64, 64, 22}}, 150));
  expect_as_close_as_libtorch({1, 8, 2, 200, 64}, packed_positions({{5, 120, 2, 60}}, 200));
  expect_as_close_as_libtorch({2, 2, 2, 97, 32}, packed_positions({{97}, {3, 80}}, 97));
  expect_as_close_as_libtorch({1, 2, 2, 130, 128}, packed_positions({{65, 65}}, 130));
}

// bf16 and fp16 are computed in fp32 and rounded once: every output is the fp32 kernel's on the
// same values, rounded to the dtype, bit for bit.
TEST(CausalAttention, SixteenBitInputsGiveTheFp32KernelsResultRoundedOnce) {
  const Case c{2, 4, 2, 100, 64};
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    const Inputs x = inputs(c, dtype, 5);
    const Result got = run_kernel(x, CpuKernels::kBest);
    auto f32 = [](const at::Tensor& t) { return t.to(at::kFloat); };
    Result want;
    want.out = at::empty(x.q.sizes(), x.q.options().dtype(at::kFloat));
    want.lse = at::empty(got.lse.sizes(), got.lse.options());
    causal_attention_forward_cpu(f32(x.q), f32(x.k), f32(x.v), {}, want.out, want.lse);
    EXPECT_TRUE(at::equal(got.out, want.out.to(dtype)));
    EXPECT_TRUE(at::equal(got.lse, want.lse));
    // Backward from the 16-bit output the forward returned, as autograd hands it over.
    want.dq = at::empty(x.q.sizes(), want.out.options());
    want.dk = at::empty(x.k.sizes(), want.out.options());
    want.dv = at::empty(x.v.sizes(), want.out.options());
    causal_attention_backward_cpu(f32(x.q), f32(x.k), f32(x.v), {}, f32(got.out), got.lse, f32(x.dout), want.dq,
                                  want.dk, want.dv);
    EXPECT_TRUE(at::equal(got.dq, want.dq.to(dtype)));
    EXPECT_TRUE(at::equal(got.dk, want.dk.to(dtype)));
    EXPECT_TRUE(at::equal(got.dv, want.dv.to(dtype)));
    // And within the dtype's rounding of float64's.
    const Result ref = run_libtorch(x, at::kDouble);
    const double tol = dtype == at::kBFloat16 ? 8e-3 : 1e-3;
    EXPECT_LT(err(got.out, ref.out), tol);
    EXPECT_LT(err(got.dq, ref.dq), 4 * tol);
    EXPECT_LT(err(got.dk, ref.dk), 4 * tol);
    EXPECT_LT(err(got.dv, ref.dv), 4 * tol);
  }
}

// ops::causal_attention takes the kernel for CPU inputs it supports, through autograd, keeping
// exactly the bytes LibTorch's flash kernel keeps (q, k, v, out, the fp32 log-sum-exp), with
// `out` laid out so that merging the heads back is a view; dropout and other head sizes keep
// LibTorch's kernel.
TEST(CausalAttention, TheOpKeepsWhatLibTorchsKernelKeeps) {
  memory::install_tracking_allocator();
  const Case c{2, 4, 4, 96, 64};
  const Inputs x = inputs(c, at::kFloat, 3);
  auto kept = [&](bool memrt) {
    const at::Tensor q = x.q.detach().requires_grad_(true), k = x.k.detach().requires_grad_(true),
                     v = x.v.detach().requires_grad_(true);
    const int64_t before = memory::allocator_stats().current_bytes;
    at::Tensor y = memrt ? causal_attention(q, k, v, 0.0) : at::scaled_dot_product_attention(q, k, v, {}, 0.0, true);
    at::Tensor merged = y.transpose(1, 2).reshape({c.B, c.T, c.H * c.D});
    EXPECT_EQ(merged.data_ptr(), y.data_ptr()) << "merging the heads is a view";
    y = at::Tensor();
    const int64_t bytes = memory::allocator_stats().current_bytes - before;
    auto g = torch::autograd::grad({merged}, {q, k, v}, {x.dout.transpose(1, 2).reshape({c.B, c.T, c.H * c.D})});
    return std::make_pair(bytes, g);
  };
  auto [memrt_bytes, memrt_grads] = kept(true);
  auto [libtorch_bytes, libtorch_grads] = kept(false);
  EXPECT_EQ(memrt_bytes, libtorch_bytes);
  for (int i = 0; i < 3; ++i) EXPECT_LT(err(memrt_grads[i], libtorch_grads[i].to(at::kDouble)), 1e-5) << i;
  EXPECT_TRUE(causal_attention_cpu_takes(x.q, x.k, x.v));
  EXPECT_FALSE(causal_attention_cpu_takes(x.q.narrow(3, 0, 40), x.k.narrow(3, 0, 40), x.v.narrow(3, 0, 40)));
  // Called directly with what it does not take, the kernel says what, instead of writing past an end.
  auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const at::Tensor out = at::empty(x.q.sizes());
  EXPECT_NE(message([&] { causal_attention_forward_cpu(x.q, x.k, x.v, {}, out, at::empty({c.B, c.H, c.T + 1})); })
                .find("log-sum-exp must be contiguous fp32"), std::string::npos);
  EXPECT_NE(message([&] { causal_attention_forward_cpu(x.q.narrow(3, 0, 40), x.k, x.v, {}, out, at::empty({c.B, c.H, c.T})); })
                .find("does not take"), std::string::npos);
}

// ops::causal_attention on packed rows: each sample's attention as the same op computes it on that
// sample alone (fp32, 1e-6 of the largest value), forward and backward, through autograd; it keeps
// exactly what the op keeps for unpacked rows (no output per sample joined into another copy), and
// 16-bit rows are the fp32 result rounded once. Positions that do not count 0, 1, ... are an error
// naming the entry.
TEST(CausalAttention, TheOpOnPackedRowsIsEachSamplesOwnAttentionKeepingNoMore) {
  memory::install_tracking_allocator();
  const Case c{2, 4, 2, 96, 64};
  const std::vector<std::vector<int64_t>> lengths{{30, 50, 16}, {7, 64}};
  const at::Tensor positions = packed_positions(lengths, c.T);
  const Inputs x = inputs(c, at::kFloat, 11);
  auto leaf = [](const at::Tensor& t) { return t.detach().requires_grad_(true); };
  const at::Tensor q = leaf(x.q), k = leaf(x.k), v = leaf(x.v);
  int64_t before = memory::allocator_stats().current_bytes;
  at::Tensor packed = causal_attention(q, k, v, 0.0, positions);
  const int64_t packed_bytes = memory::allocator_stats().current_bytes - before;
  const auto packed_grads = torch::autograd::grad({packed}, {q, k, v}, {x.dout});
  {
    const at::Tensor q1 = leaf(x.q), k1 = leaf(x.k), v1 = leaf(x.v);
    before = memory::allocator_stats().current_bytes;
    const at::Tensor rows = causal_attention(q1, k1, v1, 0.0);
    EXPECT_EQ(packed_bytes, memory::allocator_stats().current_bytes - before) << "kept as for unpacked rows";
  }
  std::vector<at::Tensor> spans_out;
  std::vector<at::Tensor> want_grads{at::zeros_like(x.q), at::zeros_like(x.k), at::zeros_like(x.v)};
  for (int64_t b = 0; b < c.B; ++b) {
    int64_t begin = 0;
    std::vector<int64_t> spans = lengths[b];
    int64_t used = 0;
    for (int64_t n : spans) used += n;
    if (used < c.T) spans.push_back(c.T - used);  // the padding
    for (int64_t n : spans) {
      auto span = [&](const at::Tensor& t) { return leaf(t.narrow(0, b, 1).narrow(2, begin, n)); };
      const at::Tensor qs = span(x.q), ks = span(x.k), vs = span(x.v);
      const at::Tensor ys = causal_attention(qs, ks, vs, 0.0);
      EXPECT_LT(err(packed.narrow(0, b, 1).narrow(2, begin, n), ys.to(at::kDouble)), 1e-6) << b << " " << begin;
      const auto g = torch::autograd::grad({ys}, {qs, ks, vs}, {x.dout.narrow(0, b, 1).narrow(2, begin, n)});
      for (int i = 0; i < 3; ++i) want_grads[i].narrow(0, b, 1).narrow(2, begin, n).copy_(g[i]);
      begin += n;
    }
  }
  for (int i = 0; i < 3; ++i) EXPECT_LT(err(packed_grads[i], want_grads[i].to(at::kDouble)), 1e-6) << i;

  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    const at::Tensor q16 = x.q.to(dtype), k16 = x.k.to(dtype), v16 = x.v.to(dtype);
    auto f32 = [](const at::Tensor& t) { return t.to(at::kFloat); };
    EXPECT_TRUE(at::equal(causal_attention(q16, k16, v16, 0.0, positions),
                          causal_attention(f32(q16), f32(k16), f32(v16), 0.0, positions).to(dtype)));
  }

  at::Tensor bad = positions.clone();
  bad[1][20] = 3;  // row 1's second sample (from column 7) has position 13 there
  try {
    causal_attention(x.q, x.k, x.v, 0.0, bad);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("positions[1, 20] is 3"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("0 (a sample's first token) or 13"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace memrt::ops
