// One optimizer implementation stepping N fp32 parameters (one flat tensor), timed; run by
// bench/bench_optimizer.py, which compares them in one run.
//
//   bench_optimizer_step IMPL N SECONDS     prints one JSON line: impl, params, steps, seconds,
//                                           params_per_s (threads: OMP_NUM_THREADS)
//   IMPL  roofline        Adam's memory traffic and nothing else: read p, g, m, v, write p, m, v
//                         (28 bytes per parameter), the same chunks and threads as the kernels
//         memrt_fp32      fused_adam_cpu on fp32 p, g, m, v
//         memrt_mixed     fused_adam_cpu on an fp32 master, m, v with a bf16 gradient unscaled by
//                         a loss scale and the bf16 compute copy written back (28 bytes too)
//         memrt_mixed_fp16  the same in fp16
//         libtorch_adamw  torch::optim::AdamW (LibTorch's C++ optimizer), foreach-free
//         memrt_bnb8      plugins/quant's bitsandbytes AdamW8bit kernel: fp32 p, g, 8-bit moments
//                         with an fp32 absmax per 256 (18 bytes per parameter moved)
//         memrt_ao8, memrt_ao4  plugins/quant's torchao AdamW8bit / AdamW4bit kernels (18 and
//                         ~14 bytes per parameter)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/optim/adamw.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>

#include "optim/cpu_loops.h"
#include "optim/fused_adam.h"
#include "quant/ao_adam.h"
#include "quant/bnb_adam.h"

namespace {

MEMRT_SIMD_CLONES void traffic_chunk(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                               float* __restrict__ v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    p[i] += g[i];
    m[i] += g[i];
    v[i] += g[i];
  }
}

// Steps until `seconds` have passed (after 2 untimed steps); returns steps per second.
double time_steps(const std::function<void()>& step, double seconds) {
  step();
  step();
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  int64_t steps = 0;
  double elapsed = 0;
  do {
    step();
    ++steps;
    elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
  } while (elapsed < seconds);
  return static_cast<double>(steps) / elapsed;
}

// AdamW's first step at lr 1e-3, weight decay 0.01 (the figures do not depend on the values).
memrt::AdamScalars scalars() {
  return memrt::adam_scalars(1e-3, 0.9, 0.999, 1e-8, 0.01, /*decoupled=*/true,
                             /*bias_correction=*/true, 1);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s roofline|memrt_fp32|memrt_mixed|memrt_mixed_fp16|libtorch_adamw|memrt_bnb8|"
                 "memrt_ao8|memrt_ao4 PARAMS SECONDS\n", argv[0]);
    return 2;
  }
  const std::string impl = argv[1];
  const int64_t n = std::atoll(argv[2]);
  const double seconds = std::atof(argv[3]);
  at::manual_seed(0);
  at::Tensor p = at::randn({n}), g = at::randn({n}) * 1e-3, m = at::zeros({n}), v = at::zeros({n});

  std::function<void()> step;
  at::Tensor compute16, grad16, codes_m, codes_v, scale_m, scale_v;
  std::unique_ptr<torch::optim::AdamW> adamw;
  if (impl == "roofline") {
    step = [&] {
      at::parallel_for(0, n, memrt::kCpuLoopGrain, [&](int64_t b, int64_t e) {
        traffic_chunk(p.data_ptr<float>() + b, g.data_ptr<float>() + b, m.data_ptr<float>() + b,
                      v.data_ptr<float>() + b, e - b);
      });
    };
  } else if (impl == "memrt_fp32" || impl == "memrt_mixed" || impl == "memrt_mixed_fp16") {
    memrt::AdamRange r;
    r.exp_avg = m.data_ptr<float>();
    r.exp_avg_sq = v.data_ptr<float>();
    r.n = n;
    float factor = 1.f;
    if (impl == "memrt_fp32") {
      r.compute = p.data_ptr<float>();
      r.grad = g.data_ptr<float>();
    } else {
      const bool fp16 = impl == "memrt_mixed_fp16";
      compute16 = p.to(fp16 ? at::kHalf : at::kBFloat16);
      grad16 = (g * 65536).to(compute16.scalar_type());
      r.master = p.data_ptr<float>();
      r.compute = compute16.data_ptr();
      r.compute_type = compute16.scalar_type();
      r.grad = grad16.data_ptr();
      r.grad_type = r.compute_type;
      factor = 1.f / 65536;
    }
    step = [r, factor] { memrt::fused_adam_cpu(r, scalars(), factor); };
  } else if (impl == "libtorch_adamw") {
    p.set_requires_grad(true);
    p.mutable_grad() = g;
    adamw = std::make_unique<torch::optim::AdamW>(std::vector<at::Tensor>{p},
                                                  torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
    step = [&] { adamw->step(); };
  } else if (impl == "memrt_bnb8" || impl == "memrt_ao8" || impl == "memrt_ao4") {
    // Codes and scales as the store holds them: bitsandbytes' last block may be short; torchao's
    // kernel steps whole blocks only (its tensors are), here the first n - n % block elements.
    const int bits = impl == "memrt_ao4" ? 4 : 8;
    const int64_t block = impl == "memrt_ao4" ? 128 : 256;
    codes_m = at::zeros({bits == 8 ? n : (n + 1) / 2}, at::kByte);
    codes_v = at::zeros_like(codes_m);
    scale_m = at::zeros({(n + block - 1) / block});
    scale_v = at::zeros({(n + block - 1) / block});
    const int64_t whole = n - n % block;
    if (impl == "memrt_bnb8") {
      const memrt::quant::BnbAdamScalars s = memrt::quant::bnb_adam_scalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 1, true);
      step = [&, s] {
        memrt::quant::bnb_adam8_cpu(p.data_ptr<float>(), {g.data_ptr<float>(), at::kFloat, 1.f}, codes_m.data_ptr<uint8_t>(),
                                    scale_m.data_ptr<float>(), codes_v.data_ptr<uint8_t>(), scale_v.data_ptr<float>(), n, s);
      };
    } else {
      const memrt::quant::AoAdamScalars s = memrt::quant::ao_adam_scalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 1, true, true);
      step = [&, s, bits, whole] {
        memrt::quant::ao_adam_lowbit_cpu(bits, p.data_ptr<float>(), {g.data_ptr<float>(), at::kFloat, 1.f}, codes_m.data_ptr<uint8_t>(),
                                         scale_m.data_ptr<float>(), codes_v.data_ptr<uint8_t>(), scale_v.data_ptr<float>(),
                                         whole, s);
      };
    }
  } else {
    std::fprintf(stderr, "unknown implementation '%s'\n", impl.c_str());
    return 2;
  }
  const double steps_per_s = time_steps(step, seconds);
  std::printf("{\"impl\": \"%s\", \"params\": %lld, \"threads\": %d, \"params_per_s\": %.6g}\n", impl.c_str(),
              static_cast<long long>(n), at::get_num_threads(), steps_per_s * static_cast<double>(n));
  return 0;
}
