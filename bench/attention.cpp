// Causal attention forward and backward: memrt's kernel (ops::causal_attention) against LibTorch's
// at::scaled_dot_product_attention (its CPU flash kernel) in the same process.
//
//   build/bin/bench_attention [B H H_KV T D DTYPE ROUNDS [SAMPLE]]   (default 4 4 4 512 64 fp32 9)
//
// SAMPLE: packed rows (docs/attention.md, "Packed rows") of samples SAMPLE tokens long (the last
// of a row shorter): memrt's one pass over each row (ops::causal_attention's positions) against
// LibTorch's kernel sample by sample, the outputs joined (what a packed row costs without a
// variable-length kernel); the rates then count each sample's causal half.
//
// DTYPE: fp32, bf16 or fp16. Each round times both back to back (the order alternates), 5 calls
// each; the figures are medians over rounds. Rates count causal FLOPs: forward 2 products of
// B·H·D·T(T+1)/2 multiply-adds, backward 5 (LibTorch's kernel and memrt's both recompute the
// scores). Prints the processor, a table, and one JSON line.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bench_timing.h"
#include "memrt/ops.h"

using memrt::bench::int_arg;
using memrt::bench::median;
using memrt::bench::ms_per_call;

int main(int argc, char** argv) {
  const int64_t B = int_arg(argc, argv, 1, 4), H = int_arg(argc, argv, 2, 4), Hkv = int_arg(argc, argv, 3, 4);
  const int64_t T = int_arg(argc, argv, 4, 512), D = int_arg(argc, argv, 5, 64);
  const std::string name = argc > 6 ? argv[6] : "fp32";
  const int rounds = static_cast<int>(int_arg(argc, argv, 7, 9));
  const int64_t sample = int_arg(argc, argv, 8, 0);
  at::Tensor positions;  // (B, T): 0, 1, ... restarting every `sample` tokens
  std::vector<int64_t> lengths;
  if (sample > 0) {
    positions = (at::arange(T, at::kLong) % sample).expand({B, T}).contiguous();
    for (int64_t t = 0; t < T; t += sample) lengths.push_back(std::min(sample, T - t));
  }
  const at::ScalarType dtype = name == "bf16" ? at::kBFloat16 : name == "fp16" ? at::kHalf : at::kFloat;
  at::manual_seed(0);
  // q, k, v as the models pass them: views of one (B, T, 3, H, D)-like projection.
  const at::Tensor qkv = at::randn({B, T, H + 2 * Hkv, D}).to(dtype);
  const at::Tensor q = qkv.narrow(2, 0, H).transpose(1, 2), k = qkv.narrow(2, H, Hkv).transpose(1, 2),
                   v = qkv.narrow(2, H + Hkv, Hkv).transpose(1, 2);
  const at::Tensor dy = at::randn({B, H, T, D}).to(dtype);

  auto libtorch = [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
    return at::scaled_dot_product_attention(a, b, c, {}, 0.0, true, std::nullopt, Hkv != H);
  };
  auto attention = [&](bool memrt, const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
    if (memrt) return memrt::ops::causal_attention(a, b, c, 0.0, positions);
    if (lengths.empty()) return libtorch(a, b, c);
    std::vector<at::Tensor> spans;
    int64_t begin = 0;
    for (int64_t n : lengths) {
      spans.push_back(libtorch(a.narrow(2, begin, n), b.narrow(2, begin, n), c.narrow(2, begin, n)));
      begin += n;
    }
    return at::cat(spans, 2);
  };
  auto forward = [&](bool memrt) { return [&, memrt] { (void)attention(memrt, q, k, v); }; };
  auto both = [&](bool memrt) {
    return [&, memrt] {
      const at::Tensor lq = q.detach().requires_grad_(true), lk = k.detach().requires_grad_(true),
                       lv = v.detach().requires_grad_(true);
      (void)torch::autograd::grad({attention(memrt, lq, lk, lv)}, {lq, lk, lv}, {dy});
    };
  };
  std::vector<double> t[2][2];  // [memrt][forward, backward]
  for (int r = 0; r < rounds; ++r)
    for (int i = 0; i < 2; ++i) {
      const bool memrt = (r + i) % 2 == 0;
      t[memrt][0].push_back(ms_per_call(forward(memrt), 5));
      t[memrt][1].push_back(ms_per_call(both(memrt), 5) - t[memrt][0].back());
    }
  double causal = static_cast<double>(T * (T + 1) / 2);
  if (!lengths.empty()) {
    causal = 0;
    for (int64_t n : lengths) causal += static_cast<double>(n * (n + 1) / 2);
  }
  const double mac = static_cast<double>(B * H * D) * causal;
  auto rate = [&](double ms, int products) { return 2.0 * products * mac / (ms * 1e6); };
  const double mf = median(t[1][0]), mb = median(t[1][1]), lf = median(t[0][0]), lb = median(t[0][1]);
  std::printf("%s\n", memrt::ops::describe_cpu_math().c_str());
  std::printf("causal attention B=%lld H=%lld H_kv=%lld T=%lld D=%lld %s, %d threads, medians of %d rounds%s\n\n",
              (long long)B, (long long)H, (long long)Hkv, (long long)T, (long long)D, name.c_str(),
              at::get_num_threads(), rounds,
              sample > 0 ? (", packed rows of " + std::to_string(sample) + "-token samples (LibTorch: sample by sample)").c_str()
                         : "");
  std::printf("| direction | memrt (ms) | GFLOP/s | LibTorch flash (ms) | GFLOP/s | LibTorch / memrt |\n");
  std::printf("|---|---:|---:|---:|---:|---:|\n");
  std::printf("| forward | %.3f | %.1f | %.3f | %.1f | %.2f |\n", mf, rate(mf, 2), lf, rate(lf, 2), lf / mf);
  std::printf("| backward | %.3f | %.1f | %.3f | %.1f | %.2f |\n", mb, rate(mb, 5), lb, rate(lb, 5), lb / mb);
  std::printf("| both | %.3f | %.1f | %.3f | %.1f | %.2f |\n", mf + mb, rate(mf + mb, 7), lf + lb, rate(lf + lb, 7),
              (lf + lb) / (mf + mb));
  std::printf("{\"bench\": \"attention\", \"shape\": [%lld, %lld, %lld, %lld, %lld], \"dtype\": \"%s\", "
              "\"sample\": %lld, \"threads\": %d, \"memrt_ms\": [%.4f, %.4f], \"libtorch_ms\": [%.4f, %.4f], \"speedup\": %.3f}\n",
              (long long)B, (long long)H, (long long)Hkv, (long long)T, (long long)D, name.c_str(), (long long)sample,
              at::get_num_threads(), mf, mb, lf, lb, (lf + lb) / (mf + mb));
}
