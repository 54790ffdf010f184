// The low-bit AdamW kernels of plugins/quant as step kernels of the parameter store against the
// libraries themselves, run at test time (tests/plugins/quant_optim_reference.py): five steps
// through the host's store optimizer of bitsandbytes' AdamW8bit (tensors above and under
// min_8bit_size, a last block shorter than 256) and torchao's AdamW8bit and AdamW4bit (tensors
// torchao quantizes and tensors it keeps plain); then two ranks' partitions, which must hold
// stage 0's codes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../data/test_util.h"
#include "config/train_config.h"
#include "memrt/safetensors.h"
#include "memrt/param_store.h"
#include "optim/optimizers.h"
#include "quant/ao_adam.h"
#include "quant/bnb_adam.h"

namespace memrt::quant {
namespace {

using test::TempDir;

constexpr int kSteps = 5;

// bitsandbytes: 8288 elements, 8-bit, its last block 96 long; 1000: 32-bit (under 4096); 40 x 125:
// 8-bit. torchao quantizes 8192 and 64 x 128 and keeps 1000 (small) and 40 x 125 (not whole blocks)
// plain.
const std::vector<std::vector<int64_t>> kBnbShapes = {{8288}, {1000}, {40, 125}};
const std::vector<std::vector<int64_t>> kAoShapes = {{8192}, {1000}, {40, 125}, {64, 128}};

// A library's optimizer as plugins/quant builds it: the reference's name, the store layout and the
// kernels of its formats.
struct LowBit {
  std::string reference;  // quant_optim_reference.py's OPTIM
  std::function<void(StorePlan&)> plan;
  std::vector<std::pair<std::string, std::shared_ptr<const StepKernel>>> kernels;
};

LowBit bnb8() { return {"bnb8", plan_bnb_adam8, {{kBnb8Format, bnb_adam_kernel(true)}, {kBnb32Format, bnb_adam_kernel(false)}}}; }
LowBit ao(int bits) {
  return {bits == 8 ? "ao8" : "ao4", [bits](StorePlan& plan) { plan_ao_adam(plan, bits); },
          {{ao_format(bits).name, ao_adam_kernel(bits)}, {kAo32Format, ao_adam_kernel(32)}}};
}

OptimizerConfig adamw() {
  OptimizerConfig cfg;
  cfg.type = "AdamW";
  cfg.lr = 1e-2;
  cfg.beta1 = 0.85;
  cfg.beta2 = 0.995;
  cfg.eps = 1e-6;
  cfg.weight_decay = 0.1;
  return cfg;
}

struct Inputs {
  std::vector<at::Tensor> params;
  std::vector<std::vector<at::Tensor>> grads;  // [step][param]
};

Inputs make_inputs(const std::vector<std::vector<int64_t>>& shapes) {
  at::manual_seed(8);
  Inputs in;
  for (const auto& shape : shapes) in.params.push_back(at::randn(shape));
  for (int t = 0; t < kSteps; ++t) {
    in.grads.emplace_back();
    for (const auto& shape : shapes) in.grads.back().push_back(at::randn(shape) * (t + 1));
  }
  return in;
}

std::map<std::string, at::Tensor> reference(const LowBit& lowbit, const Inputs& in, const OptimizerConfig& cfg,
                                            const TempDir& dir) {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (size_t i = 0; i < in.params.size(); ++i) tensors.emplace_back("param." + std::to_string(i), in.params[i]);
  for (int t = 0; t < kSteps; ++t)
    for (size_t i = 0; i < in.params.size(); ++i)
      tensors.emplace_back("grad." + std::to_string(t) + "." + std::to_string(i), in.grads[static_cast<size_t>(t)][i]);
  write_safetensors(dir.file("in.safetensors"), tensors);
  char hyper[256];
  std::snprintf(hyper, sizeof hyper, " %d %.17g %.17g %.17g %.17g %.17g", kSteps, cfg.lr, cfg.beta1, cfg.beta2, cfg.eps,
                cfg.weight_decay);
  const std::string cmd = std::string(MEMRT_PYTHON) + " " + MEMRT_SOURCE_DIR + "/tests/plugins/quant_optim_reference.py " +
                          dir.file("in.safetensors") + " " + dir.file("out.safetensors") + " " + lowbit.reference + hyper;
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::map<std::string, at::Tensor> out;
  const SafetensorsFile f = SafetensorsFile::open(dir.file("out.safetensors"));
  for (const std::string& name : f.names()) out[name] = f.tensor(name).clone();
  return out;
}

// One rank's store with the library's layout, stepped kSteps times with every parameter's full
// gradient (a rank of world_size steps only its partition of the state).
struct Trained {
  std::shared_ptr<ParamStore> store;
  std::unique_ptr<Optimizer> optimizer;
};

Trained train(const LowBit& lowbit, const Inputs& in, const OptimizerConfig& cfg, int rank, int world_size) {
  std::vector<ParamInfo> infos;
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (size_t i = 0; i < in.params.size(); ++i) {
    infos.push_back({"p" + std::to_string(i), in.params[i].sizes().vec(), at::kFloat, true, true});
    named.emplace_back(infos.back().name, in.params[i].clone());
  }
  StoreOptions options = store_options(cfg);
  options.rank = rank;
  options.world_size = world_size;
  StorePlan plan(infos, options);
  lowbit.plan(plan);
  if (world_size > 1) plan.set_extent(StoreBuffer::kState, Extent::kPartition);
  plan.check();
  Trained run;
  run.store = std::make_shared<ParamStore>(std::move(plan), named, at::kCPU);
  auto kernels = std::make_shared<StepKernelTable>();
  for (const auto& [format, kernel] : lowbit.kernels) kernels->set(format, kernel);
  run.optimizer = make_optimizer(cfg, run.store, kernels);
  for (int t = 0; t < kSteps; ++t) {
    for (size_t i = 0; i < in.params.size(); ++i)
      run.store->param(static_cast<int>(i)).mutable_grad() = in.grads[static_cast<size_t>(t)][i] * 4;
    // The gradients as a loss-scaled or clipped step hands them over: 4x, with the factor 1/4
    // (exact in fp32), so the kernels must apply the factor to match the library's steps.
    run.optimizer->step({cfg.lr, 0.25});
    run.optimizer->zero_grad();
  }
  return run;
}

void expect_equal_bits(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_TRUE(want.defined()) << what;
  ASSERT_EQ(got.numel(), want.numel()) << what;
  ASSERT_EQ(got.scalar_type(), want.scalar_type()) << what;
  const at::Tensor g = got.contiguous().view({-1}), w = want.contiguous().view({-1});
  const at::Tensor differ = got.scalar_type() == at::kFloat ? g.view(at::kInt) != w.view(at::kInt) : g != w;
  const int64_t count = differ.sum().item<int64_t>();
  if (count == 0) return;
  const int64_t first = differ.nonzero()[0][0].item<int64_t>();
  ADD_FAILURE() << what << ": " << count << " of " << g.numel() << " differ; first at " << first << ": memrt "
                << g[first].item<double>() << ", the library " << w[first].item<double>();
}

// torch's CPU sqrt (which bitsandbytes' update calls) is MKL's, not the correctly rounded one memrt
// and CUDA use: 44 of 8,288 square roots differ by one ulp on a Xeon. A denominator one ulp off
// moves that step's update by one ulp of the update, so a parameter differs from bitsandbytes' by
// at most a few ulps of the updates it received (|update| <= lr * 4 here), however small the
// parameter itself. The moments never see it (their update reads no parameter): codes and absmax
// agree bit for bit.
void expect_within_update_ulps(const at::Tensor& got, const at::Tensor& want, double lr, const std::string& what) {
  const double largest_update = 4 * lr;
  const double bound = kSteps * largest_update * std::ldexp(1.0, -23) + std::ldexp(1.0, -23) * want.abs().max().item<double>();
  const double worst = (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
  EXPECT_LE(worst, bound) << what << ": largest difference " << worst;
  EXPECT_GT((got == want).sum().item<int64_t>(), got.numel() * 9 / 10) << what << ": most elements agree bit for bit";
}

TEST(QuantOptim, BitsandbytesAdamW8bitAfterFiveSteps) {
  const Inputs in = make_inputs(kBnbShapes);
  const OptimizerConfig cfg = adamw();
  TempDir dir;
  auto want = reference(bnb8(), in, cfg, dir);
  const Trained run = train(bnb8(), in, cfg, 0, 1);
  const StorePlan& plan = run.store->plan();
  for (size_t i = 0; i < kBnbShapes.size(); ++i) {
    const int slot = static_cast<int>(i);
    const std::string n = std::to_string(i);
    const std::string& format = plan.state_format(plan.slots()[i].group).name;
    EXPECT_EQ(format, in.params[i].numel() < kBnbMin8BitSize ? kBnb32Format : kBnb8Format) << n;
    expect_within_update_ulps(run.store->param(slot), want["param." + n], cfg.lr, "parameter " + n);
    if (format == kBnb8Format) {
      expect_equal_bits(run.store->slice(slot, StoreBuffer::kState, 0).first, want["state1." + n].view({-1}), "exp_avg codes " + n);
      expect_equal_bits(run.store->slice(slot, StoreBuffer::kState, 1).first, want["absmax1." + n], "exp_avg absmax " + n);
      expect_equal_bits(run.store->slice(slot, StoreBuffer::kState, 2).first, want["state2." + n].view({-1}), "exp_avg_sq codes " + n);
      expect_equal_bits(run.store->slice(slot, StoreBuffer::kState, 3).first, want["absmax2." + n], "exp_avg_sq absmax " + n);
    } else {
      expect_equal_bits(run.store->slice(slot, StoreBuffer::kState, 0).first, want["state1." + n].view({-1}), "exp_avg " + n);
      expect_equal_bits(run.store->slice(slot, StoreBuffer::kState, 1).first, want["state2." + n].view({-1}), "exp_avg_sq " + n);
    }
  }
}

// torchao's step is compiled by inductor from single_param_adam; memrt performs the same fp32
// operations in the same order (beta^step from fp32 beta in double, rounded once), and every
// parameter, code and scale agrees bit for bit.
TEST(QuantOptim, TorchaoAdamW8bitAnd4bitAfterFiveSteps) {
  const Inputs in = make_inputs(kAoShapes);
  const OptimizerConfig cfg = adamw();
  for (int bits : {8, 4}) {
    SCOPED_TRACE(std::to_string(bits) + "-bit");
    TempDir dir;
    auto want = reference(ao(bits), in, cfg, dir);
    const Trained run = train(ao(bits), in, cfg, 0, 1);
    const StorePlan& plan = run.store->plan();
    for (size_t i = 0; i < kAoShapes.size(); ++i) {
      const int slot = static_cast<int>(i);
      const std::string n = std::to_string(i);
      const int64_t numel = in.params[i].numel();
      const bool quantized = numel >= kAoMinQuantSize && numel % ao_block(bits) == 0;
      EXPECT_EQ(plan.state_format(plan.slots()[i].group).name, quantized ? ao_format(bits).name : std::string(kAo32Format)) << n;
      expect_equal_bits(run.store->param(slot), want["param." + n], "parameter " + n);
      const std::vector<std::string> names = quantized ? std::vector<std::string>{"exp_avg", "exp_avg.scale", "exp_avg_sq", "exp_avg_sq.scale"}
                                                       : std::vector<std::string>{"exp_avg", "exp_avg_sq"};
      for (size_t k = 0; k < names.size(); ++k)
        expect_equal_bits(run.store->slice(slot, StoreBuffer::kState, static_cast<int>(k)).first,
                          want[names[k] + "." + n].contiguous().view({-1}), names[k] + " " + n);
    }
  }
}

// bitsandbytes #1840: under FSDP its flattening changes which tensors pass min_8bit_size and where
// blocks start. Here each parameter keeps its own blocks on every partitioning: two ranks'
// partitions of the state, put together, are stage 0's codes and absmax block for block.
TEST(QuantOptim, TwoRanksPartitionsHoldStageZerosBlocks) {
  const OptimizerConfig cfg = adamw();
  for (const LowBit& lowbit : {bnb8(), ao(8), ao(4)}) {
    SCOPED_TRACE(lowbit.reference);
    const Inputs in = make_inputs(lowbit.reference == "bnb8" ? kBnbShapes : kAoShapes);
    const Trained whole = train(lowbit, in, cfg, 0, 1);
    const Trained r0 = train(lowbit, in, cfg, 0, 2), r1 = train(lowbit, in, cfg, 1, 2);
    const StorePlan& plan = whole.store->plan();
    for (size_t i = 0; i < in.params.size(); ++i) {
      const int slot = static_cast<int>(i);
      const StateFormat& format = plan.state_format(plan.slots()[i].group);
      for (size_t k = 0; k < format.tensors.size(); ++k) {
        const at::Tensor want = whole.store->slice(slot, StoreBuffer::kState, static_cast<int>(k)).first;
        const auto [a, a_first] = r0.store->slice(slot, StoreBuffer::kState, static_cast<int>(k));
        const auto [b, b_first] = r1.store->slice(slot, StoreBuffer::kState, static_cast<int>(k));
        const std::string what = "p" + std::to_string(i) + " " + format.tensors[k].name;
        ASSERT_EQ(a.numel() + b.numel(), want.numel()) << what << ": the ranks' values do not add up to the tensor";
        EXPECT_EQ(a.numel() == 0 ? b_first : a_first, 0) << what;
        if (a.numel() && b.numel()) {
          EXPECT_EQ(b_first, a.numel()) << what;
        }
        expect_equal_bits(at::cat({a, b}), want, what + " (rank 0 then rank 1)");
      }
    }
  }
}

// The kernels read a 16-bit gradient a block at a time: each element widened exactly and times the
// factor, as LibTorch's conversion and an fp32 product give it.
TEST(QuantOptim, GradientsOfEveryDtypeLoadAsWidenedTimesTheFactor) {
  at::manual_seed(3);
  const at::Tensor g = at::randn({1000}) * 100;
  for (at::ScalarType t : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const at::Tensor in = g.to(t);
    std::vector<float> out(300);
    const GradIn grad{in.data_ptr(), t, 0.37f};
    grad.load(500, 300, out.data());
    const at::Tensor want = in.slice(0, 500, 800).to(at::kFloat) * 0.37f;
    expect_equal_bits(at::from_blob(out.data(), {300}, at::kFloat).clone(), want, c10::toString(t));
  }
}

}  // namespace
}  // namespace memrt::quant
