// A frozen linear layer's forward and backward (the input's gradient), as a QLoRA step runs each
// base projection: memrt's NF4 Linear4bit (double quantization) against the same layer dense in
// the same dtype (memrt::ops::linear, LibTorch's GEMM or memrt's fp32 arithmetic on 16-bit data).
//
//   OMP_NUM_THREADS=2 build/bin/bench_linear4bit OUT IN TOKENS DTYPE [ROUNDS]   (DTYPE f32 | bf16)
//
// Each round times both back to back (the order alternating), 3 calls each; the figures are the
// medians over the rounds of the per-call time. bench/bench_linear4bit.py drives it and times
// bitsandbytes' Linear4bit on the same shapes and threads. Prints one JSON line per layer.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "bench_timing.h"
#include "memrt/ops.h"
#include "quant/linear4bit.h"

using memrt::bench::median;
using memrt::bench::int_arg;
using memrt::bench::ms_per_call;

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: bench_linear4bit OUT IN TOKENS f32|bf16 [ROUNDS]\n");
    return 2;
  }
  const int64_t out = std::atoll(argv[1]), in = std::atoll(argv[2]), tokens = std::atoll(argv[3]);
  const at::ScalarType dtype = std::strcmp(argv[4], "bf16") == 0 ? at::kBFloat16 : at::kFloat;
  const int rounds = static_cast<int>(int_arg(argc, argv, 5, 5));
  using namespace memrt::quant;
  at::manual_seed(0);
  const at::Tensor w = at::randn({out, in}) * 0.02;
  const at::Tensor dense = w.to(dtype);
  const int64_t e = static_cast<int64_t>(c10::elementSize(dtype));
  auto scratch = std::make_shared<TileScratch>(tile_scratch_bytes(out, in, e, kTileBytes));
  Linear4bit nf4(quantize_4bit(w, Map4::kNf4, 64, true), at::Tensor(), std::nullopt, scratch);
  const at::Tensor x0 = at::randn({tokens, in}).to(dtype);
  const at::Tensor dy = at::randn({tokens, out}).to(dtype);

  auto step = [&](bool quantized) {
    return [&, quantized] {
      const at::Tensor x = x0.detach().requires_grad_(true);
      const at::Tensor y = quantized ? nf4->forward(x) : memrt::ops::linear(x, dense);
      y.backward(dy);
    };
  };
  step(true)();
  step(false)();
  std::vector<double> q, d;
  for (int r = 0; r < rounds; ++r) {
    if (r % 2 == 0) {
      q.push_back(ms_per_call(step(true), 3));
      d.push_back(ms_per_call(step(false), 3));
    } else {
      d.push_back(ms_per_call(step(false), 3));
      q.push_back(ms_per_call(step(true), 3));
    }
  }
  for (const auto& [impl, v] : {std::make_pair("memrt_nf4", median(q)), std::make_pair("dense", median(d))}) {
    std::printf("{\"bench\": \"linear4bit\", \"impl\": \"%s\", \"out\": %lld, \"in\": %lld, \"tokens\": %lld, "
                "\"dtype\": \"%s\", \"ms\": %.3f, \"threads\": %d}\n",
                impl, static_cast<long long>(out), static_cast<long long>(in), static_cast<long long>(tokens),
                argv[4], v, at::get_num_threads());
  }
  return 0;
}
