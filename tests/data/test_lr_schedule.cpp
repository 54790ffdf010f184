// LR schedules against (1) hand-derived tables of the first updates and the warmup boundary, and
// (2) every update of whole schedules driven through DeepSpeed's / Hugging Face's stepping protocol
// in Python (tests/data/reference_lr.py): constructor, then per update read lr, update, step().
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "memrt/error.h"
#include "optim/lr_schedule.h"
#include "test_util.h"

using namespace memrt;
using memrt::test::expect_error;
using memrt::test::read_raw;
using memrt::test::run_reference;
using memrt::test::TempDir;

namespace {

SchedulerConfig sched(const std::string& type, int64_t warmup, int64_t total = 0) {
  SchedulerConfig c;
  c.type = type;
  c.warmup_num_steps = warmup;
  c.total_num_steps = total;
  return c;
}

std::string args_of(const SchedulerConfig& c, double lr) {
  auto num = [](double v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.17g", v);
    return std::string(buf);
  };
  return c.type + " lr=" + num(lr) + " warmup_min_lr=" + num(c.warmup_min_lr) + " warmup_max_lr=" +
         num(c.warmup_max_lr) + " warmup_num_steps=" + std::to_string(c.warmup_num_steps) +
         " total_num_steps=" + std::to_string(c.total_num_steps) + " warmup_type=" + c.warmup_type +
         " warmup_min_ratio=" + num(c.warmup_min_ratio) + " cos_min_ratio=" + num(c.cos_min_ratio);
}

// One schedule against the reference protocol: lr(0..n-1), total_steps being what the engine passes.
struct Case {
  SchedulerConfig config;
  double lr;
  int64_t total_steps;
  int n;
};

// Compares each case's lr(0..n-1) with the reference protocol's, all of them run by one process.
void check_reference(const std::vector<Case>& cases) {
  TempDir dir;
  std::string args;
  for (size_t k = 0; k < cases.size(); ++k) {
    SchedulerConfig ref = cases[k].config;
    if (ref.total_num_steps <= 0) ref.total_num_steps = cases[k].total_steps;
    args += (k ? " -- " : "") + dir.file("lrs" + std::to_string(k) + ".f64") + " " + std::to_string(cases[k].n) + " " +
            args_of(ref, cases[k].lr);
  }
  ASSERT_TRUE(run_reference("reference_lr.py", args));
  for (size_t k = 0; k < cases.size(); ++k) {
    const Case& c = cases[k];
    std::vector<double> want = read_raw<double>(dir.file("lrs" + std::to_string(k) + ".f64"));
    ASSERT_EQ(want.size(), static_cast<size_t>(c.n));
    auto s = make_lr_schedule(c.config, c.lr, c.total_steps);
    for (int i = 0; i < c.n; ++i)
      EXPECT_NEAR(s->lr(i), want[static_cast<size_t>(i)], 1e-12 * std::abs(want[static_cast<size_t>(i)]) + 1e-18)
          << c.config.type << " (case " << k << "): update after " << i << " completed steps";
  }
}

}  // namespace

// ---- hand-derived tables ----------------------------------------------------------------------

TEST(LrSchedule, EmptyTypeIsConstantOptimizerLr) {
  auto s = make_lr_schedule(SchedulerConfig{}, 3e-4, 0);
  for (int64_t k : {0, 1, 1000}) EXPECT_DOUBLE_EQ(s->lr(k), 3e-4);
}

TEST(LrSchedule, DeepSpeedWarmupLrLinearTable) {
  // min 0.1, max 1.1, W = 4, linear: t = completed - 1; t = -1 and t = 0 both give min.
  SchedulerConfig c = sched("WarmupLR", 4);
  c.warmup_min_lr = 0.1;
  c.warmup_max_lr = 1.1;
  c.warmup_type = "linear";
  auto s = make_lr_schedule(c, 99.0, 0);
  const double want[] = {0.1, 0.1, 0.35, 0.6, 0.85, 1.1, 1.1};
  for (int k = 0; k < 7; ++k) EXPECT_NEAR(s->lr(k), want[k], 1e-15) << k;
}

TEST(LrSchedule, DeepSpeedWarmupLrLogTable) {
  // min 0, max 1, W = 10, log: lr = ln(t + 1) / ln(10).
  SchedulerConfig c = sched("WarmupLR", 10);
  c.warmup_max_lr = 1.0;
  auto s = make_lr_schedule(c, 99.0, 0);
  EXPECT_EQ(s->lr(0), 0.0);
  EXPECT_EQ(s->lr(1), 0.0);               // t = 0: ln 1 = 0
  EXPECT_NEAR(s->lr(2), std::log(2.0) / std::log(10.0), 1e-15);
  EXPECT_NEAR(s->lr(10), std::log(10.0) / std::log(10.0), 1e-15);  // t = 9, last warmup step: 1
  EXPECT_EQ(s->lr(11), 1.0);
}

TEST(LrSchedule, DeepSpeedWarmupDecayTable) {
  // min 0, max 1, W = 2 (linear), T = 6: t >= 2 decays as (6 - t) / 4.
  SchedulerConfig c = sched("WarmupDecayLR", 2, 6);
  c.warmup_max_lr = 1.0;
  c.warmup_type = "linear";
  auto s = make_lr_schedule(c, 99.0, 0);
  const double want[] = {0.0, 0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0};
  for (int k = 0; k < 9; ++k) EXPECT_NEAR(s->lr(k), want[k], 1e-15) << k;
}

TEST(LrSchedule, DeepSpeedWarmupCosineFirstUpdateIsZero) {
  // WarmupCosineLR.get_lr returns 0 before the first scheduler step, whatever warmup_min_ratio.
  SchedulerConfig c = sched("WarmupCosineLR", 4, 10);
  c.warmup_min_ratio = 0.5;
  c.warmup_type = "linear";
  auto s = make_lr_schedule(c, 2.0, 0);
  EXPECT_EQ(s->lr(0), 0.0);
  EXPECT_NEAR(s->lr(1), 2.0 * 0.5, 1e-15);  // t = 0: ratio = wmin
  EXPECT_NEAR(s->lr(4), 2.0 * (0.5 + 0.5 * 3.0 / 4.0), 1e-15);
  // t = W = 4: progress (4 - 4 + 1) / (10 - 4) = 1/6.
  double r = 1e-4 + (1 - 1e-4) * (1 + std::cos(M_PI / 6.0)) / 2;
  EXPECT_NEAR(s->lr(5), 2.0 * r, 1e-15);
  EXPECT_NEAR(s->lr(11), 2.0 * 1e-4, 1e-15);   // t = 10: progress 1 -> cos_min_ratio
  EXPECT_NEAR(s->lr(500), 2.0 * 1e-4, 1e-15);  // clamped after the end
}

TEST(LrSchedule, HuggingFaceLinearTable) {
  // LambdaLR: update k uses lambda(k). W = 2, T = 6: 0, 0.5, 1, 0.75, 0.5, 0.25, 0, 0.
  auto s = make_lr_schedule(sched("linear", 2), 1.0, 6);
  const double want[] = {0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0};
  for (int k = 0; k < 8; ++k) EXPECT_NEAR(s->lr(k), want[k], 1e-15) << k;
}

TEST(LrSchedule, HuggingFaceCosineAndConstants) {
  auto cos = make_lr_schedule(sched("cosine", 0), 1.0, 4);
  const double want[] = {1.0, (1 + std::cos(M_PI / 4)) / 2, 0.5, (1 + std::cos(3 * M_PI / 4)) / 2, 0.0};
  for (int k = 0; k < 5; ++k) EXPECT_NEAR(cos->lr(k), want[k], 1e-15) << k;
  auto cw = make_lr_schedule(sched("constant_with_warmup", 4), 2.0, 0);
  EXPECT_EQ(cw->lr(0), 0.0);
  EXPECT_NEAR(cw->lr(3), 1.5, 1e-15);
  EXPECT_EQ(cw->lr(4), 2.0);
  EXPECT_EQ(make_lr_schedule(sched("constant", 0), 2.0, 0)->lr(7), 2.0);
}

// ---- whole schedules through the libraries' protocols ------------------------------------------

TEST(LrScheduleReference, DeepSpeedWarmupLr) {
  SchedulerConfig c = sched("WarmupLR", 7);
  c.warmup_min_lr = 1e-5;
  c.warmup_max_lr = 3e-4;
  SchedulerConfig linear = c;
  linear.warmup_type = "linear";
  check_reference({{c, 1e-3, 0, 20},
                   {linear, 1e-3, 0, 20},
                   {sched("WarmupLR", 1), 1e-3, 0, 5},    // W = max(2, 1)
                   {sched("WarmupLR", 0), 1e-3, 0, 5}});  // W = max(2, 0): "auto" without warmup
}

TEST(LrScheduleReference, DeepSpeedWarmupDecayLr) {
  SchedulerConfig c = sched("WarmupDecayLR", 5, 30);
  c.warmup_min_lr = 1e-5;
  c.warmup_max_lr = 3e-4;
  SchedulerConfig follows = sched("WarmupDecayLR", 5, -1);  // total from the run's step count
  follows.warmup_type = "linear";
  check_reference({{c, 1e-3, 0, 40}, {follows, 1e-3, 25, 30}});
}

TEST(LrScheduleReference, DeepSpeedWarmupCosineLr) {
  SchedulerConfig c = sched("WarmupCosineLR", 6, 40);
  c.warmup_min_ratio = 0.1;
  SchedulerConfig linear = c;
  linear.warmup_type = "linear";
  linear.cos_min_ratio = 0.05;
  check_reference({{c, 6e-4, 0, 50}, {linear, 6e-4, 0, 50}});
}

TEST(LrScheduleReference, HuggingFace) {
  check_reference({{sched("linear", 5), 5e-4, 30, 35},
                   {sched("cosine", 5), 5e-4, 30, 35},
                   {sched("cosine", 0), 5e-4, 30, 35},
                   {sched("constant", 0), 5e-4, 30, 5},
                   {sched("constant_with_warmup", 8), 5e-4, 30, 12}});
}

// ---- errors -----------------------------------------------------------------------------------

TEST(LrScheduleErrors, UnknownTypeAndBadParams) {
  expect_error<ConfigError>([] { make_lr_schedule(sched("OneCycle", 1), 1e-3, 10); },
                            {"scheduler.type", "OneCycle", "WarmupLR", "linear"});
  expect_error<ConfigError>([] { make_lr_schedule(sched("WarmupLR", -1), 1e-3, 10); },
                            {"scheduler.params.warmup_num_steps", "non-negative"});
  expect_error<ConfigError>([] { make_lr_schedule(sched("WarmupDecayLR", 5, 0), 1e-3, 0); },
                            {"scheduler.params.total_num_steps", "WarmupDecayLR"});
  expect_error<ConfigError>([] { make_lr_schedule(sched("linear", 5), 1e-3, 0); }, {"max_steps"});
  expect_error<ConfigError>([] { make_lr_schedule(sched("cosine", -1), 1e-3, 10); }, {"warmup_steps"});
  SchedulerConfig c = sched("WarmupLR", 5);
  c.warmup_type = "exp";
  expect_error<ConfigError>([&] { make_lr_schedule(c, 1e-3, 10); }, {"warmup_type", "exp"});
}
