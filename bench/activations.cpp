// GPT-2's GELU (tanh) forward and backward: memrt's fused ops::gelu_tanh against LibTorch's
// at::gelu(x, "tanh") in the same process, on the main job's MLP activation (B·T rows of F).
//
//   OMP_NUM_THREADS=1 build/bin/bench_activations [ROWS F ROUNDS]   (default 2048 1024 15)
//
// Each round times both implementations back to back (the order alternates), 10 calls each;
// the figures are the medians over the rounds of the per-call time. Prints the processor, a
// table with the ratio LibTorch / memrt, and one JSON line per implementation and direction.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "bench_timing.h"
#include "memrt/ops.h"

using memrt::bench::median;
using memrt::bench::int_arg;
using memrt::bench::ms_per_call;

int main(int argc, char** argv) {
  const int64_t rows = int_arg(argc, argv, 1, 2048);
  const int64_t cols = int_arg(argc, argv, 2, 1024);
  const int rounds = static_cast<int>(int_arg(argc, argv, 3, 15));
  at::manual_seed(0);
  const at::Tensor x = at::randn({rows, cols}) * 2;  // (rows, F): the c_fc output
  const at::Tensor dy = at::randn({rows, cols});

  // forward: the op alone; backward: the op's backward alone (forward done outside the timing).
  auto forward = [&](bool fused) {
    return [&x, fused] { (void)(fused ? memrt::ops::gelu_tanh(x) : at::gelu(x, "tanh")); };
  };
  auto backward = [&](bool fused) {
    return [&x, &dy, fused] {
      const at::Tensor leaf = x.detach().requires_grad_(true);
      const at::Tensor y = fused ? memrt::ops::gelu_tanh(leaf) : at::gelu(leaf, "tanh");
      (void)torch::autograd::grad({y}, {leaf}, {dy});
    };
  };
  std::vector<double> t[2][2];  // [fused][direction]: ms per call, per round
  for (int r = 0; r < rounds; ++r) {
    for (int k = 0; k < 2; ++k) {
      const bool fused = (r + k) % 2 == 0;
      t[fused][0].push_back(ms_per_call(forward(fused), 10));
      // The backward call includes a forward: subtract the forward measured in this round.
      t[fused][1].push_back(ms_per_call(backward(fused), 10) - t[fused][0].back());
    }
  }
  const double mf = median(t[1][0]), mb = median(t[1][1]), lf = median(t[0][0]), lb = median(t[0][1]);
  std::printf("%s\n", memrt::ops::describe_cpu_math().c_str());
  std::printf("GELU (tanh) on %lld x %lld fp32, %d threads, medians of %d alternating rounds\n\n",
              static_cast<long long>(rows), static_cast<long long>(cols), at::get_num_threads(), rounds);
  std::printf("| direction | memrt ops::gelu_tanh (ms) | LibTorch at::gelu (ms) | LibTorch / memrt |\n");
  std::printf("|---|---:|---:|---:|\n");
  std::printf("| forward | %.3f | %.3f | %.2f |\n", mf, lf, lf / mf);
  std::printf("| backward | %.3f | %.3f | %.2f |\n", mb, lb, lb / mb);
  std::printf("| both | %.3f | %.3f | %.2f |\n\n", mf + mb, lf + lb, (lf + lb) / (mf + mb));
  const double n = static_cast<double>(rows * cols);
  for (int fused = 1; fused >= 0; --fused) {
    for (int dir = 0; dir < 2; ++dir) {
      std::printf("{\"bench\": \"gelu_tanh\", \"impl\": \"%s\", \"direction\": \"%s\", \"elements\": %lld, "
                  "\"threads\": %d, \"ms\": %.4f, \"elements_per_s\": %.4g}\n",
                  fused ? "memrt" : "libtorch", dir == 0 ? "forward" : "backward",
                  static_cast<long long>(rows * cols), at::get_num_threads(), median(t[fused][dir]),
                  n / (median(t[fused][dir]) * 1e-3));
    }
  }
  return 0;
}
