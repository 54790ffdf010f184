// Every CUDA kernel against its CPU twin, bit for bit: the fused Adam step and SGD
// (runtime/src/optim/optimizers_cuda.cu) and plugins/quant's formats (quant_cuda.cu), each on the
// same inputs as the CPU loop the other suites hold to PyTorch, bitsandbytes and torchao; then a
// short training of a small network on the GPU beside the same training on the CPU. Built where
// MEMRT_BUILD_CUDA is ON; on a machine without a CUDA device every case reports itself skipped.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include <cmath>
#include <cstring>
#include <iomanip>
#include <sstream>
#include <string>
#include <vector>

#include "adam_buffers.h"
#include "optim/fused_adam.h"
#include "optim/optimizer_math.h"
#include "quant/blockwise.h"
#include "quant/bnb_adam.h"
#include "quant/quant_cuda.h"

using namespace memrt;
namespace qc = memrt::quant::cuda;

namespace {

void* stream() { return at::cuda::getCurrentCUDAStream().stream(); }

at::Tensor gpu(const at::Tensor& t) { return t.to(at::Device(at::kCUDA, 0)); }
at::Tensor host(const at::Tensor& t) {
  at::cuda::getCurrentCUDAStream().synchronize();
  return t.to(at::kCPU);
}

// Equal bits, or the first element that differs (as floats where the type has them).
void expect_same_bits(const at::Tensor& cpu, const at::Tensor& from_gpu, const std::string& what) {
  const at::Tensor a = cpu.contiguous(), b = host(from_gpu).contiguous();
  ASSERT_EQ(a.scalar_type(), b.scalar_type()) << what;
  ASSERT_EQ(a.numel(), b.numel()) << what;
  if (std::memcmp(a.data_ptr(), b.data_ptr(), static_cast<size_t>(a.nbytes())) == 0) return;
  const at::Tensor differ = a.flatten().ne(b.flatten()).logical_and(a.flatten().eq(a.flatten()));
  const int64_t count = differ.sum().item<int64_t>();
  const int64_t first = count ? differ.nonzero()[0].item<int64_t>() : -1;
  std::ostringstream where;
  if (first >= 0) {
    where << ", first at " << first << std::setprecision(9) << ": CPU " << a.flatten()[first].item<double>()
          << ", GPU " << b.flatten()[first].item<double>();
  } else {
    where << " (NaN payloads)";
  }
  ADD_FAILURE() << what << ": " << count << " of " << a.numel() << " elements differ" << where.str();
}

class Cuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device on this machine";
    at::manual_seed(5);
  }
};

// ---- the fused Adam step and SGD ----------------------------------------------------------------

TEST_F(Cuda, FusedAdamStepIsTheCpuStepBitForBit) {
  const std::pair<at::ScalarType, at::ScalarType> combos[] = {{at::kFloat, at::kFloat},
                                                              {at::kBFloat16, at::kBFloat16},
                                                              {at::kBFloat16, at::kFloat},
                                                              {at::kHalf, at::kHalf},
                                                              {at::kHalf, at::kFloat}};
  for (const auto& [compute, grad] : combos) {
    const std::string what = std::string("compute ") + c10::toString(compute) + ", gradient " + c10::toString(grad);
    test::Buffers cpu = test::make_buffers(compute, grad, 3 * 65536 + 37);
    test::Buffers dev = cpu.to(at::Device(at::kCUDA, 0));
    for (int64_t t = 1; t <= 3; ++t) {
      const AdamScalars s = adam_scalars(1e-3, 0.9, 0.999, 1e-8, 0.01, /*decoupled=*/true, true, t);
      fused_adam_cpu(cpu.range(), s, 0.01f);
      fused_adam_cuda(dev.range(), s, 0.01f, stream());
    }
    if (cpu.master.defined()) expect_same_bits(cpu.master, dev.master, what + ": master");
    expect_same_bits(cpu.compute, dev.compute, what + ": compute copy");
    expect_same_bits(cpu.m, dev.m, what + ": exp_avg");
    expect_same_bits(cpu.v, dev.v, what + ": exp_avg_sq");
  }
}

TEST_F(Cuda, SgdStepIsTheCpuStepBitForBit) {
  const int64_t n = 100003;
  at::Tensor p = at::randn({n}), buf = at::zeros({n});
  at::Tensor dp = gpu(p), dbuf = gpu(buf);
  SgdScalars s;
  s.lr = 0.05f;
  s.momentum = 0.9f;
  s.dampening = 0.1f;
  s.weight_decay = 0.01f;
  s.nesterov = true;
  for (int t = 0; t < 3; ++t) {
    const at::Tensor g = at::randn({n});
    const at::Tensor dg = gpu(g);
    s.first_step = t == 0;
    sgd_update_cpu(p.data_ptr<float>(), g.data_ptr<float>(), buf.data_ptr<float>(), n, s);
    sgd_update_cuda(dp.data_ptr<float>(), dg.data_ptr<float>(), dbuf.data_ptr<float>(), n, s, stream());
  }
  expect_same_bits(p, dp, "parameters");
  expect_same_bits(buf, dbuf, "momentum buffer");
}

// ---- plugins/quant ------------------------------------------------------------------------------

// Values that reach every part of the maps: normal values at several scales, a zero block, exact
// powers of two and a tail block shorter than the rest.
at::Tensor quant_input(int64_t n, int64_t block) {
  at::Tensor x = at::randn({n}) * at::pow(10.0, at::randint(-3, 3, {n}).to(at::kFloat));
  x.narrow(0, block, block).zero_();
  x.narrow(0, 2 * block, 8).copy_(at::tensor({1.f, -1.f, 0.5f, -0.25f, 4.f, 0.f, -0.f, 1e-30f}));
  return x;
}

at::Tensor table_on_gpu(const quant::QuantizeTable& table) {
  return gpu(at::from_blob(const_cast<uint8_t*>(table.data()), {quant::kTableSize}, at::kByte));
}

TEST_F(Cuda, BlockwiseEightBitIsTheCpuFormatBitForBit) {
  for (bool is_signed : {true, false}) {
    const at::Tensor map = quant::dynamic_map(is_signed);
    const quant::QuantizeTable table(map);
    const at::Tensor dtable = table_on_gpu(table);
    const qc::Map256 dmap = qc::map256(quant::dynamic_map_values(is_signed));
    for (int64_t block : {64, 256, 4096}) {
      const std::string what = std::string(is_signed ? "signed" : "unsigned") + " map, blocks of " + std::to_string(block);
      const int64_t n = 5 * block + block / 3;
      at::Tensor x = quant_input(n, block);
      if (!is_signed) x = x.abs();
      const quant::Blockwise want = quant::quantize_blockwise(x, map, block);
      const at::Tensor dx = gpu(x);
      at::Tensor codes = at::empty({n}, dx.options().dtype(at::kByte));
      at::Tensor absmax = at::empty({(n + block - 1) / block}, dx.options());
      qc::quantize_blockwise8(dx.data_ptr<float>(), n, block, dtable.data_ptr<uint8_t>(), codes.data_ptr<uint8_t>(),
                              absmax.data_ptr<float>(), stream());
      expect_same_bits(want.codes, codes, what + ": codes");
      expect_same_bits(want.absmax, absmax, what + ": absmax");

      at::Tensor out = at::empty({n}, dx.options());
      qc::dequantize_blockwise8(codes.data_ptr<uint8_t>(), absmax.data_ptr<float>(), n, block, dmap,
                                out.data_ptr<float>(), stream());
      expect_same_bits(quant::dequantize_blockwise(want, map, block, at::kFloat), out, what + ": dequantized");
    }
  }
}

TEST_F(Cuda, FourBitDequantizationIsTheCpuFormatBitForBit) {
  const qc::Map256 signed_map = qc::map256(quant::dynamic_map_values(true));
  for (quant::Map4 type : {quant::Map4::kNf4, quant::Map4::kFp4}) {
    for (bool dq : {false, true}) {
      const std::string what = std::string(type == quant::Map4::kNf4 ? "nf4" : "fp4") + (dq ? ", double quant" : "");
      const int64_t n = 64 * 300 + 33;  // odd: the last byte holds one code
      const quant::Quantized4 q = quant::quantize_4bit(quant_input(n, 64), type, 64, dq);
      const int64_t blocks = (n + 63) / 64;
      at::Tensor scale;
      if (dq) {
        const at::Tensor codes = gpu(q.absmax), nested = gpu(q.nested_absmax), offset = gpu(q.offset);
        scale = at::empty({blocks}, codes.options().dtype(at::kFloat));
        qc::double_quant_scales(codes.data_ptr<uint8_t>(), nested.data_ptr<float>(), offset.data_ptr<float>(), blocks,
                                q.nested_block, signed_map, scale.data_ptr<float>(), stream());
        expect_same_bits(quant::absmax_fp32(q), scale, what + ": block scales");
      } else {
        scale = gpu(q.absmax);
      }
      const at::Tensor packed = gpu(q.packed);
      const std::pair<at::ScalarType, qc::OutType> outs[] = {
          {at::kFloat, qc::OutType::kFloat}, {at::kBFloat16, qc::OutType::kBFloat16}, {at::kHalf, qc::OutType::kHalf}};
      for (const auto& [dtype, out_type] : outs) {
        const at::Tensor want = quant::dequantize_4bit(q, dtype).flatten();
        at::Tensor out = at::empty({n}, packed.options().dtype(dtype));
        qc::dequantize4(packed.data_ptr<uint8_t>(), n, type, 64, scale.data_ptr<float>(), out_type, out.data_ptr(),
                        stream());
        expect_same_bits(want, out, what + " into " + c10::toString(dtype));
        // One element in, where 16-byte stores cannot go: the one-byte-a-thread path for every value.
        at::Tensor shifted = at::empty({n + 1}, packed.options().dtype(dtype)).narrow(0, 1, n);
        qc::dequantize4(packed.data_ptr<uint8_t>(), n, type, 64, scale.data_ptr<float>(), out_type,
                        shifted.data_ptr(), stream());
        expect_same_bits(want, shifted, what + " into " + c10::toString(dtype) + ", unaligned");
      }
    }
  }
}

TEST_F(Cuda, BitsandbytesEightBitAdamStepIsTheCpuStepBitForBit) {
  const int64_t n = 256 * 37 + 100;  // a tail block
  const int64_t blocks = (n + 255) / 256;
  const quant::QuantizeTable signed_table(quant::dynamic_map(true)), unsigned_table(quant::dynamic_map(false));
  const at::Tensor dst = table_on_gpu(signed_table), dut = table_on_gpu(unsigned_table);
  const qc::Map256 smap = qc::map256(quant::dynamic_map_values(true));
  const qc::Map256 umap = qc::map256(quant::dynamic_map_values(false));

  at::Tensor p = at::randn({n}), mc = at::zeros({n}, at::kByte), ma = at::zeros({blocks});
  at::Tensor vc = at::zeros({n}, at::kByte), va = at::zeros({blocks});
  // bitsandbytes' zero state: code of 0 on each map with absmax 0.
  mc.fill_(signed_table.code(0.f));
  vc.fill_(unsigned_table.code(0.f));
  at::Tensor dp = gpu(p), dmc = gpu(mc), dma = gpu(ma), dvc = gpu(vc), dva = gpu(va);
  for (int64_t t = 1; t <= 5; ++t) {
    const at::Tensor g = at::randn({n}) * 3;
    const at::Tensor dg = gpu(g);
    const quant::BnbAdamScalars s = quant::bnb_adam_scalars(1e-3, 0.9, 0.999, 1e-8, 0.01, t, true);
    quant::bnb_adam8_cpu(p.data_ptr<float>(), quant::GradIn{g.data_ptr<float>(), at::kFloat, 0.5f},
                         mc.data_ptr<uint8_t>(), ma.data_ptr<float>(), vc.data_ptr<uint8_t>(), va.data_ptr<float>(), n, s);
    qc::bnb_adam8(dp.data_ptr<float>(), dg.data_ptr<float>(), 0.5f, dmc.data_ptr<uint8_t>(), dma.data_ptr<float>(),
                  dvc.data_ptr<uint8_t>(), dva.data_ptr<float>(), n, s, smap, umap, dst.data_ptr<uint8_t>(),
                  dut.data_ptr<uint8_t>(), stream());
  }
  expect_same_bits(p, dp, "parameters after 5 steps");
  expect_same_bits(mc, dmc, "exp_avg codes");
  expect_same_bits(ma, dma, "exp_avg absmax");
  expect_same_bits(vc, dvc, "exp_avg_sq codes");
  expect_same_bits(va, dva, "exp_avg_sq absmax");
}

// ---- a short training ---------------------------------------------------------------------------
// A two-layer tanh network fitting a fixed random target, trained for 30 steps with memrt's fused
// AdamW step on each device (LibTorch's autograd for the gradients). The products differ in
// rounding between cuBLAS and the CPU's GEMM, so the two losses agree to a tolerance, not in bits;
// the GPU's must fall as the CPU's does.
std::vector<double> train(at::Device device) {
  at::manual_seed(3);
  const at::Tensor x = at::randn({256, 64}).to(device), y = at::randn({256, 8}).to(device);
  std::vector<at::Tensor> params = {(at::randn({64, 128}) * 0.1).to(device), at::zeros({128}).to(device),
                                    (at::randn({128, 8}) * 0.1).to(device), at::zeros({8}).to(device)};
  std::vector<at::Tensor> m, v;
  for (at::Tensor& p : params) {
    p.requires_grad_(true);
    m.push_back(at::zeros_like(p));
    v.push_back(at::zeros_like(p));
  }
  std::vector<double> losses;
  for (int64_t t = 1; t <= 30; ++t) {
    const at::Tensor h = at::tanh(at::addmm(params[1], x, params[0]));
    const at::Tensor loss = at::mse_loss(at::addmm(params[3], h, params[2]), y);
    loss.backward();
    losses.push_back(loss.item<double>());
    const AdamScalars s = adam_scalars(1e-2, 0.9, 0.999, 1e-8, 0.01, true, true, t);
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor p = params[i].detach();
      const at::Tensor g = params[i].grad();
      const AdamRange r = adam_range(at::Tensor(), p, g, m[i], v[i]);
      if (device.is_cuda()) {
        fused_adam_cuda(r, s, 1.f, stream());
      } else {
        fused_adam_cpu(r, s, 1.f);
      }
      params[i].mutable_grad().zero_();
    }
  }
  return losses;
}

TEST_F(Cuda, AShortTrainingOnTheGpuFollowsTheCpu) {
  const std::vector<double> cpu = train(at::kCPU);
  const std::vector<double> dev = train(at::Device(at::kCUDA, 0));
  ASSERT_EQ(cpu.size(), dev.size());
  for (size_t t = 0; t < cpu.size(); ++t)
    EXPECT_NEAR(dev[t], cpu[t], 1e-3 * cpu[t]) << "step " << t + 1;
  EXPECT_LT(dev.back(), 0.8 * dev.front());
  std::printf("loss, step 1 -> 30: CPU %.6f -> %.6f, GPU %.6f -> %.6f\n", cpu.front(), cpu.back(), dev.front(),
              dev.back());
}

}  // namespace
