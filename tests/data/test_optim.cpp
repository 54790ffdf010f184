// Optimizers and gradient clipping against torch.optim / torch.nn.utils.clip_grad_norm_ run by the
// venv's Python on the same parameters and gradients (tests/data/reference_optim.py).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "memrt/error.h"
#include "memrt/plugin.h"
#include "optim/grad_clip.h"
#include "optim/optimizers.h"
#include "test_util.h"

using namespace memrt;
using memrt::test::expect_error;
using memrt::test::read_raw;
using memrt::test::run_reference;
using memrt::test::TempDir;
using memrt::test::write_raw;

namespace {

// Three parameters, 5 steps, a different lr each step; parameter "c" gets no gradient in step 2.
const std::vector<std::string> kNames = {"a.weight", "b.bias", "c.weight"};
const std::vector<std::vector<int64_t>> kShapes = {{7, 5}, {13}, {2, 3}};
constexpr int kSteps = 5;
constexpr int kNoGradParam = 2, kNoGradStep = 2;
const std::vector<double> kLrs = {1e-2, 2e-2, 5e-3, 1e-2, 3e-2};

struct Problem {
  std::vector<at::Tensor> init;                // per parameter
  std::vector<std::vector<at::Tensor>> grads;  // [step][param], undefined = no gradient
};

Problem make_problem() {
  at::manual_seed(1234);
  Problem pr;
  for (const auto& shape : kShapes) pr.init.push_back(at::randn(shape));  // shape as listed
  for (int s = 0; s < kSteps; ++s) {
    std::vector<at::Tensor> g;
    for (size_t i = 0; i < kShapes.size(); ++i)
      g.push_back(s == kNoGradStep && i == kNoGradParam ? at::Tensor() : at::randn(kShapes[i]) * (s + 1));
    pr.grads.push_back(g);
  }
  return pr;
}

std::vector<float> flat(const std::vector<at::Tensor>& ts) {
  std::vector<float> out;
  for (const auto& t : ts) {
    at::Tensor c = t.to(at::kFloat).contiguous();
    out.insert(out.end(), c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
  }
  return out;
}

std::string sizes_arg() {
  std::string s;
  for (const auto& shape : kShapes) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    s += (s.empty() ? "" : ",") + std::to_string(n);
  }
  return s;
}

// Writes the problem for reference_optim.py.
void write_problem(const TempDir& dir, const Problem& pr) {
  write_raw(dir.file("params.f32"), flat(pr.init));
  std::vector<float> grads;
  for (int s = 0; s < kSteps; ++s)
    for (size_t i = 0; i < kShapes.size(); ++i) {
      const at::Tensor& g = pr.grads[static_cast<size_t>(s)][i];
      std::vector<float> v = g.defined() ? flat({g}) : flat({at::full(kShapes[i], NAN)});
      grads.insert(grads.end(), v.begin(), v.end());
    }
  write_raw(dir.file("grads.f32"), grads);
  write_raw(dir.file("lrs.f64"), kLrs);
}

std::vector<ParamGroup> groups_for(const Problem& pr, double weight_decay) {
  ParamGroup g;
  g.names = kNames;
  for (const auto& t : pr.init) g.params.push_back(t.clone().set_requires_grad(true));
  g.weight_decay = weight_decay;
  return {g};
}

void run_steps(Optimizer& opt, const Problem& pr, int steps = kSteps) {
  for (int s = 0; s < steps; ++s) {
    auto& params = opt.param_groups()[0].params;
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& g = pr.grads[static_cast<size_t>(s)][i];
      params[i].mutable_grad() = g.defined() ? g.clone() : at::Tensor();
    }
    opt.step({kLrs[static_cast<size_t>(s)]});
  }
}

// Normwise relative error: |got - want| <= 1e-6 * max|want| for every element. (Element-wise
// relative error is meaningless where a value is the small difference of large terms, as moments
// and updated weights often are; fp32 rounding alone reaches 1e-6 of such a value.)
void expect_close(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0;
  for (float w : want) scale = std::max(scale, std::abs(double(w)));
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    double err = std::abs(double(got[i]) - double(want[i]));
    worst = std::max(worst, err / scale);
    EXPECT_LE(err, 1e-6 * scale) << what << "[" << i << "]: " << got[i] << " vs reference " << want[i]
                                 << " (largest |value| " << scale << ")";
  }
  ::testing::Test::RecordProperty(what + "_max_err_over_max_abs", std::to_string(worst));
}

// Optimizer state `state` of every parameter, as the store holds it.
std::vector<float> state_flat(const ParamStore& store, const std::string& state) {
  const auto& names = store.plan().state_names();
  const int k = static_cast<int>(std::find(names.begin(), names.end(), state) - names.begin());
  std::vector<at::Tensor> ts;
  for (const auto& n : kNames) ts.push_back(store.slice(static_cast<int>(store.plan().find(n)), StoreBuffer::kState, k).first);
  return flat(ts);
}

// Runs our optimizer and the reference `kind` and compares parameters and `states`.
void check_against_reference(const OptimizerConfig& cfg, const std::string& kind, const std::string& hyper,
                             double weight_decay, const std::vector<std::string>& states) {
  Problem pr = make_problem();
  TempDir dir;
  write_problem(dir, pr);
  auto store = make_param_store(cfg, groups_for(pr, weight_decay));
  auto opt = make_optimizer(cfg, store);
  run_steps(*opt, pr);
  ASSERT_TRUE(run_reference("reference_optim.py", dir.str() + " " + kind + " " + sizes_arg() + " " +
                                                      std::to_string(kSteps) + " " + hyper));
  expect_close(flat(opt->param_groups()[0].params), read_raw<float>(dir.file("out_params.f32")), "params");
  for (const auto& s : states) expect_close(state_flat(*store, s), read_raw<float>(dir.file("out_" + s + ".f32")), s);
  TensorMap sd = opt->state_dict();
  EXPECT_EQ(sd.at("a.weight.step").item<int64_t>(), kSteps);
  EXPECT_EQ(sd.at("c.weight.step").item<int64_t>(), kSteps - 1) << "a step without gradient must not count";
}

OptimizerConfig adam_cfg(const std::string& type) {
  OptimizerConfig c;
  c.type = type;
  c.beta1 = 0.8;
  c.beta2 = 0.95;
  c.eps = 1e-2;  // large, so that where eps is added (after bias correction) shows
  return c;
}

const char* kAdamHyper = "b1=0.8 b2=0.95 eps=1e-2";

}  // namespace

TEST(Optimizer, AdamWEqualsTorchAdamW) {
  check_against_reference(adam_cfg("AdamW"), "adamw", std::string(kAdamHyper) + " wd=0.1", 0.1,
                          {"exp_avg", "exp_avg_sq"});
}

TEST(Optimizer, DeepSpeedAdamWithAdamWModeIsAdamW) {
  // DeepSpeed: "type": "Adam" with adam_w_mode true (its default) is AdamW.
  OptimizerConfig cfg = adam_cfg("Adam");
  ASSERT_TRUE(cfg.adam_w_mode);
  check_against_reference(cfg, "adamw", std::string(kAdamHyper) + " wd=0.1", 0.1, {"exp_avg", "exp_avg_sq"});
  EXPECT_EQ(make_optimizer(cfg, std::vector<ParamGroup>{})->name(), "AdamW");
}

TEST(Optimizer, AdamL2ModeEqualsTorchAdam) {
  OptimizerConfig cfg = adam_cfg("Adam");
  cfg.adam_w_mode = false;
  check_against_reference(cfg, "adam", std::string(kAdamHyper) + " wd=0.1", 0.1, {"exp_avg", "exp_avg_sq"});
  EXPECT_EQ(make_optimizer(cfg, std::vector<ParamGroup>{})->name(), "Adam");
}

TEST(Optimizer, AdamWWithoutWeightDecayEqualsTorch) {
  check_against_reference(adam_cfg("AdamW"), "adamw", std::string(kAdamHyper) + " wd=0", 0.0,
                          {"exp_avg", "exp_avg_sq"});
}

TEST(Optimizer, AdamWithoutBiasCorrectionEqualsDeepSpeedFormula) {
  // torch.optim cannot switch bias correction off; the reference is DeepSpeed's CPU Adam formula
  // written in numpy (float32), with bc1 = bc2 = 1.
  OptimizerConfig cfg = adam_cfg("AdamW");
  cfg.bias_correction = false;
  check_against_reference(cfg, "adam_nobc", std::string(kAdamHyper) + " wd=0.1", 0.1, {"exp_avg", "exp_avg_sq"});
}

TEST(Optimizer, SgdMomentumDampeningWeightDecayEqualsTorch) {
  OptimizerConfig cfg;
  cfg.type = "SGD";
  cfg.momentum = 0.9;
  cfg.dampening = 0.1;
  check_against_reference(cfg, "sgd", "momentum=0.9 dampening=0.1 nesterov=0 wd=0.01", 0.01, {"momentum_buffer"});
}

TEST(Optimizer, SgdNesterovEqualsTorch) {
  OptimizerConfig cfg;
  cfg.type = "SGD";
  cfg.momentum = 0.7;
  cfg.nesterov = true;
  check_against_reference(cfg, "sgd", "momentum=0.7 dampening=0 nesterov=1 wd=0.001", 0.001, {"momentum_buffer"});
}

TEST(Optimizer, PlainSgdEqualsTorch) {
  OptimizerConfig cfg;
  cfg.type = "SGD";
  check_against_reference(cfg, "sgd", "momentum=0 dampening=0 nesterov=0 wd=0", 0.0, {});
}

TEST(Optimizer, LargeTensorTakesTheParallelPathWithSameResult) {
  // 300k elements: several at::parallel_for chunks and the SIMD body; compared with the same
  // update done one element at a time through at:: operations in double.
  at::manual_seed(7);
  at::Tensor p0 = at::randn({300001});
  ParamGroup g;
  g.names = {"big"};
  g.params = {p0.clone().set_requires_grad(true)};
  g.weight_decay = 0.05;
  OptimizerConfig cfg = adam_cfg("AdamW");
  auto opt = make_optimizer(cfg, {g});
  at::Tensor grad = at::randn({300001});
  opt->param_groups()[0].params[0].mutable_grad() = grad;
  opt->step({1e-2});
  // One step from zero state: m = 0.2 g, v = 0.05 g^2, bc1 = 0.2, bc2 = 0.05.
  at::Tensor pd = p0.to(at::kDouble), gd = grad.to(at::kDouble);
  at::Tensor m = 0.2 * gd, v = 0.05 * gd * gd;
  at::Tensor denom = v.sqrt() / std::sqrt(0.05) + 1e-2;
  at::Tensor want = pd * (1 - 1e-2 * 0.05) - (1e-2 / 0.2) * m / denom;
  at::Tensor got = opt->param_groups()[0].params[0].detach().to(at::kDouble);
  EXPECT_LE((got - want).abs().max().item<double>(), 1e-6 * want.abs().max().item<double>());
}

TEST(Optimizer, SixteenBitParametersStepFp32Masters) {
  // Start values exactly representable in bf16, so both runs start from the same numbers.
  at::manual_seed(3);
  at::Tensor p0 = at::randn({64}).to(at::kBFloat16).to(at::kFloat);
  at::Tensor grad = at::randn({64}).to(at::kBFloat16).to(at::kFloat);
  auto run = [&](at::ScalarType dt) {
    ParamGroup g;
    g.names = {"w"};
    g.params = {p0.to(dt).clone().set_requires_grad(true)};
    auto store = make_param_store(adam_cfg("AdamW"), {g});
    auto opt = make_optimizer(adam_cfg("AdamW"), store);
    opt->param_groups()[0].params[0].mutable_grad() = grad.to(dt);
    opt->step({1e-2});
    EXPECT_EQ(store->groups()[0].state[0].scalar_type(), at::kFloat);
    EXPECT_EQ(store->groups()[0].master.defined(), dt != at::kFloat);
    return opt->param_groups()[0].params[0].detach().clone();
  };
  at::Tensor f32 = run(at::kFloat);
  at::Tensor bf16 = run(at::kBFloat16);
  EXPECT_EQ(bf16.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(bf16, f32.to(at::kBFloat16)));  // the fp32 step, rounded once

  ParamGroup g;
  g.names = {"w"};
  g.params = {p0.to(at::kDouble).set_requires_grad(true)};
  expect_error<Error>([&] { make_optimizer(adam_cfg("AdamW"), {g}); }, {"'w'", "Double", "fp32, bf16 and fp16"});
}

// The optimizer's own state is each parameter's update count (the moments and masters are the
// store's, which checkpoints save: tests/store/test_store_checkpoint.cpp); loading is strict.
TEST(Optimizer, StateDictHoldsUpdateCountsAndLoadsThemStrictly) {
  Problem pr = make_problem();
  auto opt = make_optimizer(adam_cfg("AdamW"), groups_for(pr, 0.0));
  EXPECT_TRUE(opt->state_dict().empty()) << "no updates yet";
  run_steps(*opt, pr, 3);
  TensorMap good = opt->state_dict();
  ASSERT_EQ(good.size(), kNames.size());
  EXPECT_EQ(good.at("a.weight.step").item<int64_t>(), 3);
  EXPECT_EQ(good.at("c.weight.step").item<int64_t>(), 2) << "no gradient in step 3";

  auto fresh = make_optimizer(adam_cfg("AdamW"), groups_for(pr, 0.0));
  fresh->load_state_dict(good);
  EXPECT_EQ(fresh->state_dict().at("c.weight.step").item<int64_t>(), 2);

  TensorMap moments = good;
  moments["a.weight.exp_avg"] = at::zeros({7, 5});
  expect_error<Error>([&] { opt->load_state_dict(moments); }, {"a.weight.exp_avg", "unexpected"});
  TensorMap unknown = good;
  unknown["d.weight.step"] = at::scalar_tensor(1, at::kLong);
  expect_error<Error>([&] { opt->load_state_dict(unknown); }, {"d.weight.step", "unexpected"});
  TensorMap not_scalar = good;
  not_scalar["a.weight.step"] = at::zeros({2}, at::kLong);
  expect_error<Error>([&] { opt->load_state_dict(not_scalar); }, {"a.weight.step", "int64 scalar"});
}

TEST(Optimizer, StateBytesExact) {
  Problem pr = make_problem();
  // One group of 35 + 13 + 6 elements, padded to a multiple of 16 (64 bytes of fp32).
  const int64_t numel = 64;
  auto state_bytes = [&](const OptimizerConfig& cfg) {
    const auto store = make_param_store(cfg, groups_for(pr, 0));
    int64_t bytes = 0;
    for (const ParamStore::Group& g : store->groups())
      for (const at::Tensor& t : g.state) bytes += static_cast<int64_t>(t.nbytes());
    EXPECT_EQ(bytes, store->plan().bytes().at(memory::Category::kOptimizerState));
    return bytes;
  };
  EXPECT_EQ(state_bytes(adam_cfg("AdamW")), numel * 8);  // m, v fp32
  OptimizerConfig sgd;
  sgd.type = "SGD";
  EXPECT_EQ(state_bytes(sgd), 0);
  sgd.momentum = 0.9;
  EXPECT_EQ(state_bytes(sgd), numel * 4);
}

TEST(Optimizer, ZeroGradDropsGradients) {
  Problem pr = make_problem();
  auto opt = make_optimizer(adam_cfg("AdamW"), groups_for(pr, 0));
  opt->param_groups()[0].params[0].mutable_grad() = at::ones(kShapes[0]);
  opt->zero_grad();
  EXPECT_FALSE(opt->param_groups()[0].params[0].grad().defined());
}

TEST(OptimizerErrors, ConfigAndGroups) {
  OptimizerConfig cfg;
  cfg.type = "Lamb";
  expect_error<ConfigError>([&] { make_optimizer(cfg, std::vector<ParamGroup>{}); }, {"optimizer.type", "Lamb", "Adam, AdamW, SGD"});
  cfg = adam_cfg("AdamW");
  cfg.beta2 = 1.0;
  expect_error<ConfigError>([&] { make_optimizer(cfg, std::vector<ParamGroup>{}); }, {"betas[1]"});
  cfg = OptimizerConfig();
  cfg.type = "SGD";
  cfg.nesterov = true;
  expect_error<ConfigError>([&] { make_optimizer(cfg, std::vector<ParamGroup>{}); }, {"nesterov", "momentum > 0"});

  Problem pr = make_problem();
  auto groups = groups_for(pr, 0);
  groups.push_back(groups[0]);  // every name twice
  expect_error<Error>([&] { make_optimizer(adam_cfg("AdamW"), groups); }, {"a.weight", "twice"});
  groups = groups_for(pr, 0);
  groups[0].names.pop_back();
  expect_error<Error>([&] { make_optimizer(adam_cfg("AdamW"), groups); }, {"2 names for 3 parameters"});
}

// ---- gradient clipping -----------------------------------------------------------------------

namespace {

// Pass 1 of the store's optimizer (grad_summary: the norm) and clip_divisor against
// torch.nn.utils.clip_grad_norm_ on the same gradients.
void check_clip(double max_norm) {
  at::manual_seed(11);
  ParamGroup group;
  group.names = kNames;
  std::vector<at::Tensor> grads;
  for (const auto& shape : kShapes) {
    group.params.push_back(at::zeros(shape).set_requires_grad(true));  // shape as listed
    grads.push_back(at::randn(shape) * 3);
  }
  group.names.push_back("no_grad.bias");  // no gradient: undefined, counts 0
  group.params.push_back(at::zeros({4}).set_requires_grad(true));
  TempDir dir;
  write_raw(dir.file("grads.f32"), flat(grads));
  write_raw(dir.file("params.f32"), std::vector<float>(flat(grads).size(), 0.f));
  write_raw(dir.file("lrs.f64"), std::vector<double>{0.0});
  ASSERT_TRUE(run_reference("reference_optim.py",
                            dir.str() + " clip " + sizes_arg() + " 1 max_norm=" + std::to_string(max_norm)));

  auto opt = make_optimizer(adam_cfg("AdamW"), {group});
  for (size_t i = 0; i < grads.size(); ++i) opt->param_groups()[0].params[i].mutable_grad() = grads[i];
  const GradSummary summary = opt->grad_summary();
  EXPECT_TRUE(summary.finite);
  const double norm = std::sqrt(summary.sum_squares);
  const double want_norm = read_raw<double>(dir.file("out_norm.f64")).at(0);
  EXPECT_NEAR(norm, want_norm, 1e-6 * want_norm);
  const double divisor = clip_divisor(norm, max_norm);
  std::vector<at::Tensor> clipped;
  for (const at::Tensor& g : grads) clipped.push_back(g / divisor);
  expect_close(flat(clipped), read_raw<float>(dir.file("out_grads.f32")), "clipped_grads");
}

}  // namespace

TEST(GradClip, ClipsLikeTorchClipGradNorm) { check_clip(1.0); }

TEST(GradClip, LeavesSmallGradientsLikeTorch) { check_clip(1e4); }

TEST(GradClip, OffAndNonFinite) {
  EXPECT_EQ(clip_divisor(17.3, 0.0), 1.0);  // gradient_clipping 0: off
  EXPECT_EQ(clip_divisor(std::numeric_limits<double>::infinity(), 1.0), 1.0);
  EXPECT_EQ(clip_divisor(std::nan(""), 1.0), 1.0);
  EXPECT_EQ(clip_divisor(0.5, 1.0), 1.0);
  EXPECT_DOUBLE_EQ(clip_divisor(17.3, 2.0), (17.3 + 1e-6) / 2.0);
}

// Pass 1 sees inf and NaN in any gradient, in any dtype, and counts only the gradients there are.
TEST(GradClip, SummaryFlagsNonFiniteGradients) {
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (float bad : {std::numeric_limits<float>::infinity(), std::nanf("")}) {
      ParamGroup g;
      g.names = {"a.weight", "b.weight"};
      g.params = {at::zeros({40}, dt).set_requires_grad(true), at::zeros({3}, dt).set_requires_grad(true)};
      auto opt = make_optimizer(adam_cfg("AdamW"), {g});
      at::Tensor grad = at::full({40}, 2.f).to(dt);
      opt->param_groups()[0].params[0].mutable_grad() = grad;
      GradSummary s = opt->grad_summary();
      EXPECT_TRUE(s.finite);
      EXPECT_EQ(s.sum_squares, 160.0) << c10::toString(dt);
      grad[17] = bad;
      s = opt->grad_summary();
      EXPECT_FALSE(s.finite) << c10::toString(dt) << " " << bad;
    }
  }
}

// The SDK's default pass 1, for an optimizer a plugin brings: every .grad of its groups, squared
// and summed in double; an inf in any gradient makes the summary non-finite.
TEST(GradClip, DefaultSummaryOfAPluginsOptimizerReadsItsGroups) {
  class Minimal final : public Optimizer {
   public:
    std::string name() const override { return "minimal"; }
    void step(const StepScalars&) override {}
    std::vector<ParamGroup>& param_groups() override { return groups; }
    const std::vector<ParamGroup>& param_groups() const override { return groups; }
    TensorMap state_dict() const override { return {}; }
    void load_state_dict(const TensorMap&) override {}
    std::vector<ParamGroup> groups;
  } opt;
  ParamGroup g;
  g.names = {"a", "b", "c"};
  g.params = {at::zeros({3}).set_requires_grad(true), at::zeros({2}).set_requires_grad(true),
              at::zeros({4}).set_requires_grad(true)};  // "c" gets no gradient
  g.params[0].mutable_grad() = at::full({3}, 2.f);
  g.params[1].mutable_grad() = at::full({2}, -3.f).to(at::kBFloat16);
  opt.groups = {g};
  GradSummary s = opt.grad_summary();
  EXPECT_EQ(s.sum_squares, 3 * 4.0 + 2 * 9.0);
  EXPECT_TRUE(s.finite);
  opt.groups[0].params[1].mutable_grad()[1] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(opt.grad_summary().finite);
}
