// bench_cuda_step [n] [calls] — memrt's CUDA kernels timed on the GPU, each against the bound the
// device's memory sets and, for the step, against PyTorch's own fused AdamW kernel on the same
// tensors: the fp32 fused step, the bf16 step with an fp32 master, bitsandbytes' 8-bit step, and
// the NF4 dequantization a QLoRA forward runs per projection. On the CPUs of bench/RESULTS.md the
// low-bit steps are bound by arithmetic; on a GPU the bytes they save should turn into time.
// Built where MEMRT_BUILD_CUDA is ON; ends with one JSON line per kernel.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "bench_timing.h"
#include "optim/fused_adam.h"
#include "optim/optimizer_math.h"
#include "quant/blockwise.h"
#include "quant/bnb_adam.h"
#include "quant/quant_cuda.h"

using namespace memrt;
namespace qc = memrt::quant::cuda;

namespace {

void* stream() { return at::cuda::getCurrentCUDAStream().stream(); }
void sync() { at::cuda::getCurrentCUDAStream().synchronize(); }

// Milliseconds per call on the GPU: 3 untimed calls, then the median of 5 runs of `calls` calls,
// each run timed between two synchronisations of the stream.
double gpu_ms(const std::function<void()>& f, int calls) {
  for (int i = 0; i < 3; ++i) f();
  std::vector<double> runs;
  for (int r = 0; r < 5; ++r) {
    sync();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) f();
    sync();
    runs.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / calls);
  }
  return bench::median(runs);
}

at::Tensor table_on_gpu(const quant::QuantizeTable& table) {
  return at::from_blob(const_cast<uint8_t*>(table.data()), {quant::kTableSize}, at::kByte).to(at::kCUDA);
}

struct Row {
  std::string name;
  double bytes_per_element;  // what the kernel must read and write, per element
  double ms;
};

}  // namespace

int main(int argc, char** argv) {
  if (!at::hasCUDA()) {
    std::fprintf(stderr, "bench_cuda_step: no CUDA device on this machine\n");
    return 1;
  }
  const int64_t n = memrt::bench::int_arg(argc, argv, 1, int64_t{1} << 28);
  const int calls = static_cast<int>(memrt::bench::int_arg(argc, argv, 2, 20));
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  at::manual_seed(0);

  std::vector<Row> rows;
  // The bound: a device-to-device copy of n fp32 values (8 bytes moved per element).
  {
    const at::Tensor src = at::randn({n}, cuda), dst = at::empty({n}, cuda);
    rows.push_back({"copy (the bandwidth bound)", 8.0, gpu_ms([&] { dst.copy_(src); }, calls)});
  }
  const AdamScalars s = adam_scalars(1e-3, 0.9, 0.999, 1e-8, 0.01, /*decoupled=*/true, true, 10);
  // fp32: p, g, m, v read, p, m, v written: 28 bytes.
  {
    at::Tensor p = at::randn({n}, cuda), g = at::randn({n}, cuda), m = at::zeros({n}, cuda), v = at::zeros({n}, cuda);
    const AdamRange range = adam_range(at::Tensor(), p, g, m, v);
    const auto step32 = [&] { fused_adam_cuda(range, s, 1.0f, stream()); };
    rows.push_back({"memrt fused AdamW, fp32", 28.0, gpu_ms(step32, calls)});
    const at::Tensor step = at::full({}, 10.0, cuda);
    const auto torch_step = [&] {
      at::_fused_adamw_({p}, {g}, {m}, {v}, {}, {step}, 1e-3, 0.9, 0.999, 0.01, 1e-8, false, false);
    };
    rows.push_back({"PyTorch _fused_adamw_, fp32", 28.0, gpu_ms(torch_step, calls)});
  }
  // bf16 compute copy and gradient with an fp32 master: master, g(2), m, v read; master,
  // compute(2), m, v written: 28 bytes.
  {
    at::Tensor master = at::randn({n}, cuda), compute = master.to(at::kBFloat16);
    at::Tensor g = at::randn({n}, cuda).to(at::kBFloat16), m = at::zeros({n}, cuda), v = at::zeros({n}, cuda);
    const AdamRange range = adam_range(master, compute, g, m, v);
    const auto step16 = [&] { fused_adam_cuda(range, s, 1.0f, stream()); };
    rows.push_back({"memrt fused AdamW, bf16 + fp32 master", 28.0, gpu_ms(step16, calls)});
  }
  // bitsandbytes' 8-bit AdamW: p, g, two codes read; p, two codes written; the absmax of each
  // 256-element block read and written: 16 + 16 / 256 bytes.
  {
    const int64_t blocks = (n + quant::kBnbBlock - 1) / quant::kBnbBlock;
    const quant::QuantizeTable signed_table(quant::dynamic_map(true)), unsigned_table(quant::dynamic_map(false));
    const at::Tensor st = table_on_gpu(signed_table), ut = table_on_gpu(unsigned_table);
    const qc::Map256 smap = qc::map256(quant::dynamic_map_values(true));
    const qc::Map256 umap = qc::map256(quant::dynamic_map_values(false));
    at::Tensor p = at::randn({n}, cuda), g = at::randn({n}, cuda);
    at::Tensor mc = at::full({n}, signed_table.code(0.f), cuda.dtype(at::kByte)), ma = at::zeros({blocks}, cuda);
    at::Tensor vc = at::full({n}, unsigned_table.code(0.f), cuda.dtype(at::kByte)), va = at::zeros({blocks}, cuda);
    const quant::BnbAdamScalars bs = quant::bnb_adam_scalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 10, true);
    const auto step8 = [&] {
      qc::bnb_adam8(p.data_ptr<float>(), g.data_ptr<float>(), 1.0f, mc.data_ptr<uint8_t>(), ma.data_ptr<float>(),
                    vc.data_ptr<uint8_t>(), va.data_ptr<float>(), n, bs, smap, umap, st.data_ptr<uint8_t>(),
                    ut.data_ptr<uint8_t>(), stream());
    };
    rows.push_back({"memrt bitsandbytes 8-bit AdamW", 16.0 + 16.0 / quant::kBnbBlock, gpu_ms(step8, calls)});
  }
  // NF4 (block 64) to bf16, as a QLoRA forward dequantizes a projection: half a byte of codes and
  // 4 / 64 of scale read, 2 bytes written.
  {
    const int64_t blocks = n / 64;
    const at::Tensor packed = at::randint(0, 256, {n / 2}, cuda.dtype(at::kByte));
    const at::Tensor scale = at::rand({blocks}, cuda);
    at::Tensor out = at::empty({blocks * 64}, cuda.dtype(at::kBFloat16));
    const auto dequant = [&] {
      qc::dequantize4(packed.data_ptr<uint8_t>(), blocks * 64, quant::Map4::kNf4, 64, scale.data_ptr<float>(),
                      qc::OutType::kBFloat16, out.data_ptr(), stream());
    };
    rows.push_back({"memrt NF4 dequantize to bf16", 0.5 + 2.0 + 4.0 / 64, gpu_ms(dequant, calls)});
  }

  const auto props = at::cuda::getCurrentDeviceProperties();
  const double bandwidth = rows[0].bytes_per_element * n / (rows[0].ms * 1e-3);  // bytes/s
  std::printf("%s, %lld elements, median of 5 runs of %d calls\n", props->name, static_cast<long long>(n), calls);
  std::printf("%-40s %10s %14s %10s %14s\n", "kernel", "ms", "elements/s", "GB/s", "of the bound");
  for (const Row& r : rows) {
    const double per_s = n / (r.ms * 1e-3);
    std::printf("%-40s %10.3f %14.4g %10.1f %14.3f\n", r.name.c_str(), r.ms, per_s, per_s * r.bytes_per_element / 1e9,
                per_s * r.bytes_per_element / bandwidth);
  }
  const double fp32_ms = rows[1].ms;
  std::printf("time against memrt's fp32 step: PyTorch fused %.3f, bf16+master %.3f, bnb 8-bit %.3f\n",
              rows[2].ms / fp32_ms, rows[3].ms / fp32_ms, rows[4].ms / fp32_ms);
  for (const Row& r : rows) {
    std::printf("{\"bench\": \"cuda_step\", \"device\": \"%s\", \"kernel\": \"%s\", \"n\": %lld, \"ms\": %.4f, "
                "\"bytes_per_element\": %.4f, \"fraction_of_copy_bandwidth\": %.4f}\n",
                props->name, r.name.c_str(), static_cast<long long>(n), r.ms, r.bytes_per_element,
                n / (r.ms * 1e-3) * r.bytes_per_element / bandwidth);
  }
  return 0;
}
