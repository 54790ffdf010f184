// The fp16 loss scaler (plugins/precision/loss_scaler.h) against DeepSpeed, as a state machine:
// scripted overflow sequences, with the scale and hysteresis expected after every step written as
// literal numbers derived by hand from DeepSpeed's source, not computed by the code under test.
//
// Source: deepspeedai/DeepSpeed at commit edaa7221267243c7be7fb49c5d5f5c4fb97b4641. Citations are
// file:line at that commit:
//
//   kZero = DynamicLossScaler (deepspeed/runtime/fp16/loss_scaler.py), built for ZeRO 1-3 by
//   CreateLossScaler (loss_scaler.py:304-310; zero/stage_1_and_2.py:648-651, zero/stage3.py:511-514)
//   and updated once per step (stage_1_and_2.py:2526-2527, stage3.py:3062-3063):
//     __init__   loss_scaler.py:222-228  cur_iter = 0, last_overflow_iter = -1, factor 2.0,
//                                        cur_hysteresis = delayed_shift (= fp16.hysteresis)
//     overflow   :267      if delayed_shift == 1 or cur_hysteresis == 1:
//                :268-270    if cur_scale == min_scale: raise "Current loss scale already at minimum..."
//                :272        next_scale = max(cur_scale / 2, min_scale)       (log :274-277)
//                :285      else: cur_hysteresis -= 1                            (log :280-284)
//                :286      last_overflow_iter = cur_iter
//     clean      :288-292  if consecutive_hysteresis: cur_hysteresis = delayed_shift (log :290)
//                :294      stable = cur_iter - last_overflow_iter - 1
//                :295      if stable > 0 and stable % scale_window == 0:
//                :296-297    if not consecutive_hysteresis: cur_hysteresis = delayed_shift
//                :298        cur_scale *= 2
//     always     :299      cur_iter += 1
//
//   kFp16Optimizer = FP16_Optimizer._update_scale (deepspeed/runtime/fp16/fused_optimizer.py;
//   unfused_optimizer.py:272-296 is the same rule):
//     overflow   fused_optimizer.py:400-404  cur_scale = max(cur_scale / 2, min_loss_scale);
//                                            last_overflow_iter = cur_iter  (no hysteresis, no raise)
//     clean      :410-412  stable = cur_iter - last_overflow_iter - 1;
//                          if stable > 0 and stable % scale_window == 0: cur_scale *= 2
//     static     :417-420  logs the overflow, scale unchanged
//     always     :421      cur_iter += 1
//   with cur_scale = 2**initial_scale_power, cur_iter = 0, last_overflow_iter = -1
//   (loss_scaler.py:93, :111, :119-121; precision_config.py:202-209; engine.py:2280-2299).
//
// "it N" below is cur_iter when update() is called; O = overflow, C = clean.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <memrt/error.h>

#include "precision/loss_scaler.h"

namespace memrt::precision {
namespace {

constexpr bool O = true;   // the step overflowed
constexpr bool C = false;  // the step was clean

// `steps` updates with the same outcome, each of which must leave exactly these values.
struct Span {
  int64_t steps;
  bool overflow;
  double scale;
  int64_t hysteresis;
};

::testing::AssertionResult Follows(LossScaler& s, const std::vector<Span>& runs) {
  for (const Span& r : runs) {
    for (int64_t i = 0; i < r.steps; ++i) {
      const int64_t it = s.state().cur_iter;
      s.update(r.overflow);
      const LossScalerState st = s.state();
      if (st.cur_scale != r.scale || st.cur_hysteresis != r.hysteresis || st.cur_iter != it + 1)
        return ::testing::AssertionFailure()
               << "after it " << it << " (" << (r.overflow ? "O" : "C") << "): scale "
               << st.cur_scale << " hysteresis " << st.cur_hysteresis << " cur_iter "
               << st.cur_iter << ", expected scale " << r.scale << " hysteresis " << r.hysteresis
               << " cur_iter " << it + 1;
    }
  }
  return ::testing::AssertionSuccess();
}

LossScalerOptions dynamic(int power, int64_t window, int64_t hysteresis, double min = 1.0,
                          bool consecutive = false) {
  LossScalerOptions o;
  o.initial_scale_power = power;
  o.loss_scale_window = window;
  o.hysteresis = hysteresis;
  o.min_loss_scale = min;
  o.consecutive_hysteresis = consecutive;
  return o;
}

// The message of the memrt::Error `f` throws ("" if it throws none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const memrt::Error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// The worked example of the reference summary with DeepSpeed's defaults (scale 2^16, window 1000,
// hysteresis 2, consecutive off):
//   it 0 O: cur_hysteresis 2 != 1 and delayed_shift 2 != 1 (:267) -> hysteresis 2 -> 1 (:285),
//           scale stays 65536; last_overflow_iter = 0 (:286)
//   it 1 O: cur_hysteresis == 1 -> 65536 != min 1 -> max(32768, 1) = 32768 (:272); last = 1
//   it 2 O: hysteresis still 1 (a halving does not refill it) -> 16384; last = 2
//   it 3..1002 C: stable = it - 2 - 1 = 0..999 (:294): 0 is not > 0 and 1..999 are not multiples
//           of 1000 (:295) -> 16384, hysteresis 1 (consecutive off: no refill, :288)
//   it 1003 C: stable 1000 -> hysteresis = 2 (:297), scale 32768 (:298)
//   it 1004..2002 C: stable 1001..1999 -> 32768
//   it 2003 C: stable 2000 -> 65536, hysteresis 2
//   it 2004 O: hysteresis is 2 again, so this overflow is tolerated: 2 -> 1, scale 65536
TEST(LossScaler, ZeroWorkedExampleFromReference) {
  LossScaler s(LossScalerOptions{}, ScalerKind::kZero);
  EXPECT_TRUE(s.dynamic());
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_TRUE(Follows(s, {{1, O, 65536, 1},
                          {1, O, 32768, 1},
                          {1, O, 16384, 1},
                          {1000, C, 16384, 1},
                          {1, C, 32768, 2},
                          {999, C, 32768, 2},
                          {1, C, 65536, 2},
                          {1, O, 65536, 1}}));
  const LossScalerState st = s.state();
  EXPECT_EQ(st.cur_iter, 2005);
  EXPECT_EQ(st.last_overflow_iter, 2004);
}

// Window 3, initial_scale_power 10 (2^10 = 1024), hysteresis 2:
//   it 0..2 C: last_overflow_iter = -1, stable = it - (-1) - 1 = it = 0, 1, 2 -> 1024
//   it 3 C: stable 3 -> 2048 (:298); it 4, 5: stable 4, 5 -> 2048
//   it 6 C: stable 6 -> 4096; it 7, 8 -> 4096; it 9 C: stable 9 -> 8192
//   it 10 O: hysteresis 2 -> 1, 8192, last 10
//   it 11 O: hysteresis 1 -> 4096, last 11
//   it 12..14 C: stable 0, 1, 2 -> 4096, hysteresis 1
//   it 15 C: stable 3 -> 8192, hysteresis refilled to 2 (:297)
//   it 16 O: 2 -> 1, 8192, last 16
//   it 17..19 C: stable 0, 1, 2 -> 8192, hysteresis 1; it 20 C: stable 3 -> 16384, hysteresis 2
// The first doubling after an overflow takes window + 1 = 4 clean steps; from the start, it 3.
TEST(LossScaler, ZeroSmallWindowDoublesEveryWindow) {
  LossScaler s(dynamic(10, 3, 2), ScalerKind::kZero);
  EXPECT_EQ(s.scale(), 1024.0);
  EXPECT_TRUE(Follows(s, {{3, C, 1024, 2},
                          {1, C, 2048, 2},
                          {2, C, 2048, 2},
                          {1, C, 4096, 2},
                          {2, C, 4096, 2},
                          {1, C, 8192, 2},
                          {1, O, 8192, 1},
                          {1, O, 4096, 1},
                          {3, C, 4096, 1},
                          {1, C, 8192, 2},
                          {1, O, 8192, 1},
                          {3, C, 8192, 1},
                          {1, C, 16384, 2}}));
}

// Hysteresis 3, scale 2^8 = 256, window 2: the first two overflows in a row only use up hysteresis
// (3 -> 2 -> 1, :285); from then on every overflow halves (:267, cur_hysteresis == 1) and the
// hysteresis stays 1 until a doubling refills it (:297).
//   it 0 O: 256, 2   it 1 O: 256, 1   it 2 O: 128, 1   it 3 O: 64, 1 (last 3)
//   it 4, 5 C: stable 0, 1 -> 64, 1   it 6 C: stable 2 -> 128, hysteresis 3
//   it 7 O: 3 -> 2, 128
TEST(LossScaler, ZeroHysteresisIsNotRefilledByAHalving) {
  LossScaler s(dynamic(8, 2, 3), ScalerKind::kZero);
  EXPECT_TRUE(Follows(s, {{1, O, 256, 2},
                          {1, O, 256, 1},
                          {1, O, 128, 1},
                          {1, O, 64, 1},
                          {2, C, 64, 1},
                          {1, C, 128, 3},
                          {1, O, 128, 2}}));
}

// The same sequence O C O C O C C C C O O with consecutive_hysteresis off and on (scale 2^10,
// window 3, hysteresis 2).
// Off: a clean step does not refill (:288 false), so after the first overflow every later one halves:
//   it 0 O: 2 -> 1, 1024   it 1 C: stable 0, 1024, 1   it 2 O: 512 (last 2)   it 3 C: 512, 1
//   it 4 O: 256 (last 4)   it 5..7 C: stable 0, 1, 2 -> 256, 1   it 8 C: stable 3 -> 512, 2 (:297)
//   it 9 O: 2 -> 1, 512    it 10 O: 256
// On: every clean step refills to 2 (:292), so isolated overflows never halve:
//   it 0 O: 2 -> 1, 1024   it 1 C: hysteresis 2   it 2 O: 2 -> 1   it 3 C: 2   it 4 O: 2 -> 1
//   it 5..7 C: hysteresis 2, stable 0, 1, 2 -> 1024   it 8 C: stable 3 -> 2048
//   it 9 O: 2 -> 1, 2048   it 10 O: back-to-back, hysteresis 1 -> 1024
TEST(LossScaler, ZeroConsecutiveHysteresisOffAndOn) {
  LossScaler off(dynamic(10, 3, 2, 1.0, false), ScalerKind::kZero);
  EXPECT_TRUE(Follows(off, {{1, O, 1024, 1},
                            {1, C, 1024, 1},
                            {1, O, 512, 1},
                            {1, C, 512, 1},
                            {1, O, 256, 1},
                            {3, C, 256, 1},
                            {1, C, 512, 2},
                            {1, O, 512, 1},
                            {1, O, 256, 1}}));
  LossScaler on(dynamic(10, 3, 2, 1.0, true), ScalerKind::kZero);
  EXPECT_TRUE(Follows(on, {{1, O, 1024, 1},
                           {1, C, 1024, 2},
                           {1, O, 1024, 1},
                           {1, C, 1024, 2},
                           {1, O, 1024, 1},
                           {3, C, 1024, 2},
                           {1, C, 2048, 2},
                           {1, O, 2048, 1},
                           {1, O, 1024, 1}}));
}

// min_loss_scale 1000 (not a power of two), scale 2^12 = 4096, window 2, hysteresis 1 (so kZero
// halves on every overflow, :267 delayed_shift == 1, like kFp16Optimizer does): both kinds agree
// until an overflow comes at the minimum.
//   it 0 O: 2048   it 1 O: 1024   it 2 O: max(512, 1000) = 1000 (:272 / fused :401-403), last 2
//   it 3 C: stable 0, it 4 C: stable 1 -> 1000   it 5 C: stable 2 -> 2000 (off powers of two)
//   it 6 C: stable 3 -> 2000   it 7 C: stable 4 -> 4000
//   it 8 O: 2000   it 9 O: max(1000, 1000) = 1000, last 9
// it 10 O: kZero: cur_scale == min_scale (:268) -> raises, nothing changes (the raise comes before
//          :286 and :299); kFp16Optimizer: max(500, 1000) = 1000, skips and goes on:
//   it 11 O: 1000 (last 11)   it 12, 13 C: stable 0, 1 -> 1000   it 14 C: stable 2 -> 2000
TEST(LossScaler, MinLossScaleNotAPowerOfTwoAndReachingIt) {
  const std::vector<Span> to_minimum = {{1, O, 2048, 1}, {1, O, 1024, 1}, {1, O, 1000, 1},
                                       {2, C, 1000, 1}, {1, C, 2000, 1}, {1, C, 2000, 1},
                                       {1, C, 4000, 1}, {1, O, 2000, 1}, {1, O, 1000, 1}};

  LossScaler zero(dynamic(12, 2, 1, 1000.0), ScalerKind::kZero);
  EXPECT_TRUE(Follows(zero, to_minimum));
  const std::string message = error_of([&] { zero.update(O); });
  EXPECT_TRUE(contains(message, "Current loss scale already at minimum - cannot decrease scale "
                                "anymore. Exiting run."))
      << message;
  EXPECT_TRUE(contains(message, "fp16.min_loss_scale = 1000")) << message;
  const LossScalerState st = zero.state();
  EXPECT_EQ(st.cur_scale, 1000.0);
  EXPECT_EQ(st.cur_iter, 10);
  EXPECT_EQ(st.last_overflow_iter, 9);
  EXPECT_EQ(st.cur_hysteresis, 1);

  LossScaler fp16(dynamic(12, 2, 1, 1000.0), ScalerKind::kFp16Optimizer);
  EXPECT_TRUE(Follows(fp16, to_minimum));
  EXPECT_TRUE(Follows(fp16, {{2, O, 1000, 1}, {2, C, 1000, 1}, {1, C, 2000, 1}}));
}

// At the minimum kZero still honours hysteresis: the raise is only reached on the halving branch.
// Scale 2^1 = 2, min 1, hysteresis 2, window 1000:
//   it 0 O: 2 -> 1 hysteresis, scale 2   it 1 O: max(1, 1) = 1   it 2 O: 1 == min -> raise
TEST(LossScaler, ZeroRaisesOnlyWhenHysteresisIsUsedUp) {
  LossScaler s(dynamic(1, 1000, 2), ScalerKind::kZero);
  EXPECT_TRUE(Follows(s, {{1, O, 2, 1}, {1, O, 1, 1}}));
  EXPECT_TRUE(contains(error_of([&] { s.update(O); }), "fp16.min_loss_scale = 1"));
  EXPECT_EQ(s.state().cur_iter, 2);
}

// Both kinds on the same sequence O C O O C C C O O O O (scale 2^5 = 32, window 2, hysteresis 2,
// min 8). They differ at it 0 and it 7 (kZero's hysteresis absorbs one overflow) and at it 9
// (kZero raises at the minimum, kFp16Optimizer clamps and goes on).
// kZero:
//   it 0 O: 2 -> 1, 32   it 1 C: stable 0, 32, 1   it 2 O: 16 (last 2)   it 3 O: max(8, 8) = 8 (last 3)
//   it 4, 5 C: stable 0, 1 -> 8   it 6 C: stable 2 -> 16, hysteresis 2
//   it 7 O: 2 -> 1, 16   it 8 O: 8   it 9 O: 8 == min -> raise
// kFp16Optimizer (hysteresis ignored; the state keeps the configured 2):
//   it 0 O: 16   it 1 C: stable 0, 16   it 2 O: 8   it 3 O: max(4, 8) = 8 (last 3)
//   it 4, 5 C: stable 0, 1 -> 8   it 6 C: stable 2 -> 16
//   it 7 O: 8   it 8, 9, 10 O: 8
// consecutive_hysteresis and hysteresis do not change kFp16Optimizer (fused_optimizer.py:397-422
// never reads them): hysteresis 5 with consecutive on gives the same scales.
TEST(LossScaler, BothKindsOnTheSameSequence) {
  LossScaler zero(dynamic(5, 2, 2, 8.0), ScalerKind::kZero);
  EXPECT_TRUE(Follows(zero, {{1, O, 32, 1},
                             {1, C, 32, 1},
                             {1, O, 16, 1},
                             {1, O, 8, 1},
                             {2, C, 8, 1},
                             {1, C, 16, 2},
                             {1, O, 16, 1},
                             {1, O, 8, 1}}));
  EXPECT_TRUE(contains(error_of([&] { zero.update(O); }), "fp16.min_loss_scale = 8"));

  LossScaler fp16(dynamic(5, 2, 2, 8.0), ScalerKind::kFp16Optimizer);
  EXPECT_TRUE(Follows(fp16, {{1, O, 16, 2},
                             {1, C, 16, 2},
                             {1, O, 8, 2},
                             {1, O, 8, 2},
                             {2, C, 8, 2},
                             {1, C, 16, 2},
                             {1, O, 8, 2},
                             {3, O, 8, 2}}));

  LossScaler fp16_h5(dynamic(5, 2, 5, 8.0, true), ScalerKind::kFp16Optimizer);
  EXPECT_TRUE(Follows(fp16_h5, {{1, O, 16, 5},
                                {1, C, 16, 5},
                                {1, O, 8, 5},
                                {1, O, 8, 5},
                                {2, C, 8, 5},
                                {1, C, 16, 5},
                                {1, O, 8, 5},
                                {3, O, 8, 5}}));
}

// initial_scale_power p starts the scale at 2**p (precision_config.py:204, loss_scaler.py:119).
// p = 0 with min 1 starts at the minimum: with hysteresis 1 kZero's very first overflow raises.
TEST(LossScaler, InitialScalePower) {
  EXPECT_EQ(LossScaler(dynamic(0, 1000, 2), ScalerKind::kZero).scale(), 1.0);
  EXPECT_EQ(LossScaler(dynamic(5, 1000, 2), ScalerKind::kZero).scale(), 32.0);
  EXPECT_EQ(LossScaler(dynamic(20, 1000, 2), ScalerKind::kFp16Optimizer).scale(), 1048576.0);
  EXPECT_EQ(LossScaler(dynamic(32, 1000, 2), ScalerKind::kZero).scale(), 4294967296.0);
  EXPECT_EQ(LossScaler(dynamic(-3, 1000, 2, 0.01), ScalerKind::kZero).scale(), 0.125);

  LossScaler at_min(dynamic(0, 1000, 1), ScalerKind::kZero);
  EXPECT_TRUE(contains(error_of([&] { at_min.update(O); }), "Current loss scale already at minimum"));
}

// A start below the minimum is not rejected by DeepSpeed, and its rule then raises the scale on an
// overflow: 2^0 = 1, min 4, hysteresis 1: it 0 O: 1 != 4 (:268), max(0.5, 4) = 4 (:272); it 1 O:
// 4 == min -> kZero raises; kFp16Optimizer: max(2, 4) = 4.
TEST(LossScaler, StartBelowTheMinimumIsClampedUpLikeDeepSpeed) {
  LossScaler zero(dynamic(0, 1000, 1, 4.0), ScalerKind::kZero);
  EXPECT_TRUE(Follows(zero, {{1, O, 4, 1}}));
  EXPECT_TRUE(contains(error_of([&] { zero.update(O); }), "fp16.min_loss_scale = 4"));
  LossScaler fp16(dynamic(0, 1000, 1, 4.0), ScalerKind::kFp16Optimizer);
  EXPECT_TRUE(Follows(fp16, {{2, O, 4, 1}}));
}

// A static scale (loss_scale > 0): ZeRO builds the no-op LossScaler (loss_scaler.py:309-310,
// update_scale :148-149), FP16_Optimizer only logs (fused_optimizer.py:417-420). The scale never
// moves, never raises, and every overflow is reported. DeepSpeed checks loss_scale_window,
// min_loss_scale only when dynamic (precision_config.py:188), so unused invalid values pass.
TEST(LossScaler, StaticScaleNeverChanges) {
  for (ScalerKind kind : {ScalerKind::kZero, ScalerKind::kFp16Optimizer}) {
    LossScalerOptions o;
    o.loss_scale = 128;
    o.loss_scale_window = 0;
    o.min_loss_scale = 0;
    o.hysteresis = 0;
    LossScaler s(o, kind);
    EXPECT_FALSE(s.dynamic());
    EXPECT_EQ(s.scale(), 128.0);
    EXPECT_EQ(s.update(O), "Grad overflow on iteration: 0. Using static loss scale of: 128. "
                           "Skipping step.");
    EXPECT_EQ(s.update(C), "");
    EXPECT_EQ(s.update(O), "Grad overflow on iteration: 2. Using static loss scale of: 128. "
                           "Skipping step.");
    EXPECT_TRUE(Follows(s, {{2000, O, 128, 0}, {2000, C, 128, 0}}));
    EXPECT_EQ(s.state().cur_iter, 4003);
  }
  LossScalerOptions half;
  half.loss_scale = 0.5;
  LossScaler s(half, ScalerKind::kZero);
  EXPECT_EQ(s.update(O), "Grad overflow on iteration: 0. Using static loss scale of: 0.5. "
                         "Skipping step.");
}

// Save after a prefix, load into a fresh scaler, and both continue identically. kZero, scale 2^10,
// window 3, hysteresis 2, consecutive off:
//   prefix  it 0 O: 1024, 1   it 1 C: 1024, 1   it 2 O: 512, 1 (last 2)
//           -> state {512, cur_iter 3, last_overflow_iter 2, hysteresis 1}
//   suffix  it 3..5 C: stable 0, 1, 2 -> 512, 1   it 6 C: stable 3 -> 1024, 2
//           it 7 O: 2 -> 1, 1024   it 8 O: 512 (last 8)   it 9..11 C: 512, 1   it 12 C: 1024, 2
// A fresh scaler without the load would run the suffix from {1024, 0, -1, 2}: it 0..2 C -> 1024,
// it 3 C: stable 3 -> 2048.
TEST(LossScaler, ZeroStateSaveLoadContinuesIdentically) {
  const LossScalerOptions o = dynamic(10, 3, 2);
  LossScaler a(o, ScalerKind::kZero);
  EXPECT_TRUE(Follows(a, {{1, O, 1024, 1}, {1, C, 1024, 1}, {1, O, 512, 1}}));
  const LossScalerState saved = a.state();
  EXPECT_EQ(saved.cur_scale, 512.0);
  EXPECT_EQ(saved.cur_iter, 3);
  EXPECT_EQ(saved.last_overflow_iter, 2);
  EXPECT_EQ(saved.cur_hysteresis, 1);

  LossScaler b(o, ScalerKind::kZero);
  b.load_state(saved);
  EXPECT_EQ(b.scale(), 512.0);
  const std::vector<Span> suffix = {{3, C, 512, 1}, {1, C, 1024, 2}, {1, O, 1024, 1},
                                   {1, O, 512, 1}, {3, C, 512, 1},  {1, C, 1024, 2}};
  EXPECT_TRUE(Follows(a, suffix));
  EXPECT_TRUE(Follows(b, suffix));
  EXPECT_EQ(b.state().last_overflow_iter, 8);

  LossScaler fresh(o, ScalerKind::kZero);
  EXPECT_TRUE(Follows(fresh, {{3, C, 1024, 2}, {1, C, 2048, 2}}));
}

// kFp16Optimizer, scale 2^10, window 3: prefix it 0 O: 512; it 1 C: 512; it 2 O: 256 (last 2) ->
// {256, 3, 2, hysteresis 2 (unused)}; suffix it 3..5 C: stable 0..2 -> 256; it 6 C: 512; it 7 O: 256.
TEST(LossScaler, Fp16OptimizerStateSaveLoadContinuesIdentically) {
  const LossScalerOptions o = dynamic(10, 3, 2);
  LossScaler a(o, ScalerKind::kFp16Optimizer);
  EXPECT_TRUE(Follows(a, {{1, O, 512, 2}, {1, C, 512, 2}, {1, O, 256, 2}}));
  LossScaler b(o, ScalerKind::kFp16Optimizer);
  b.load_state(a.state());
  const std::vector<Span> suffix = {{3, C, 256, 2}, {1, C, 512, 2}, {1, O, 256, 2}};
  EXPECT_TRUE(Follows(a, suffix));
  EXPECT_TRUE(Follows(b, suffix));
}

TEST(LossScaler, LoadStateRejectsImpossibleStates) {
  LossScaler zero(dynamic(10, 3, 2), ScalerKind::kZero);
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  EXPECT_TRUE(contains(error_of([&] { zero.load_state({0.0, 3, 2, 1}); }), "cur_scale"));
  EXPECT_TRUE(contains(error_of([&] { zero.load_state({-4.0, 3, 2, 1}); }), "cur_scale"));
  EXPECT_TRUE(contains(error_of([&] { zero.load_state({inf, 3, 2, 1}); }), "cur_scale"));
  EXPECT_TRUE(contains(error_of([&] { zero.load_state({nan, 3, 2, 1}); }), "cur_scale"));
  EXPECT_TRUE(contains(error_of([&] { zero.load_state({512, -1, -1, 1}); }), "cur_iter"));
  EXPECT_TRUE(contains(error_of([&] { zero.load_state({512, 3, 3, 1}); }), "last_overflow_iter"));
  EXPECT_TRUE(contains(error_of([&] { zero.load_state({512, 3, -2, 1}); }), "last_overflow_iter"));
  EXPECT_TRUE(contains(error_of([&] { zero.load_state({512, 3, 2, 0}); }), "cur_hysteresis"));
  EXPECT_EQ(zero.scale(), 1024.0);  // a rejected state leaves the scaler as it was

  LossScaler fp16(dynamic(10, 3, 2), ScalerKind::kFp16Optimizer);
  EXPECT_EQ(error_of([&] { fp16.load_state({512, 3, 2, 0}); }), "");
  EXPECT_TRUE(contains(error_of([&] { fp16.load_state({512, 3, 2, -1}); }), "cur_hysteresis"));
  EXPECT_EQ(error_of([&] { fp16.load_state({512, 0, -1, 2}); }), "");
}

// The returned lines for one sequence per kind, DeepSpeed's words (loss_scaler.py:274-283 for
// kZero, fused_optimizer.py:268-271 for kFp16Optimizer; the raise uses fused_optimizer.py:414-416,
// the refill loss_scaler.py:290). kZero, scale 2^16, window 2, hysteresis 2:
//   it 0 O: hysteresis 2 -> 1   it 1 O: 65536 -> 32768 (last 1)   it 2, 3 C: stable 0, 1: nothing
//   it 4 C: stable 2 -> 65536   it 5 C: stable 3: nothing   it 6 C: stable 4 -> 131072
TEST(LossScaler, LogLines) {
  LossScaler zero(dynamic(16, 2, 2), ScalerKind::kZero);
  EXPECT_EQ(zero.update(O),
            "OVERFLOW! Skipping step. Attempted loss scale: 65536, but hysteresis is 2. Reducing "
            "hysteresis to 1");
  EXPECT_EQ(zero.update(O), "OVERFLOW! Skipping step. Attempted loss scale: 65536, reducing to 32768");
  EXPECT_EQ(zero.update(C), "");
  EXPECT_EQ(zero.update(C), "");
  EXPECT_EQ(zero.update(C),
            "No Grad overflow for 2 iterations. Increasing dynamic loss scale from 32768 to 65536");
  EXPECT_EQ(zero.update(C), "");
  EXPECT_EQ(zero.update(C),
            "No Grad overflow for 2 iterations. Increasing dynamic loss scale from 65536 to 131072");

  // Consecutive on: it 0 O: 2 -> 1; it 1 C: refilled (DeepSpeed logs this on every clean step,
  // memrt only when the hysteresis changes); it 2 C: already 2, nothing.
  LossScaler consecutive(dynamic(16, 2, 2, 1.0, true), ScalerKind::kZero);
  EXPECT_EQ(consecutive.update(O),
            "OVERFLOW! Skipping step. Attempted loss scale: 65536, but hysteresis is 2. Reducing "
            "hysteresis to 1");
  EXPECT_EQ(consecutive.update(C), "Consecutive hysteresis is enabled. Restoring hysteresis to 2");
  EXPECT_EQ(consecutive.update(C), "");

  // kFp16Optimizer, scale 2^16, window 2: it 0 O: 32768 (last 0); it 1, 2 C: stable 0, 1; it 3 C:
  // stable 2 -> 65536.
  LossScaler fp16(dynamic(16, 2, 2), ScalerKind::kFp16Optimizer);
  EXPECT_EQ(fp16.update(O),
            "Overflow detected. Skipping step. Attempted loss scale: 65536, reducing to 32768");
  EXPECT_EQ(fp16.update(C), "");
  EXPECT_EQ(fp16.update(C), "");
  EXPECT_EQ(fp16.update(C),
            "No Grad overflow for 2 iterations. Increasing dynamic loss scale from 32768 to 65536");

  // Scales that are not integers: 2^0 = 1, min 0.1: 1 -> 0.5 -> 0.25 -> 0.125 -> max(0.0625, 0.1)
  // = 0.1 -> 0.1.
  LossScaler small(dynamic(0, 1000, 2, 0.1), ScalerKind::kFp16Optimizer);
  const char* prefix = "Overflow detected. Skipping step. Attempted loss scale: ";
  EXPECT_EQ(small.update(O), prefix + std::string("1, reducing to 0.5"));
  EXPECT_EQ(small.update(O), prefix + std::string("0.5, reducing to 0.25"));
  EXPECT_EQ(small.update(O), prefix + std::string("0.25, reducing to 0.125"));
  EXPECT_EQ(small.update(O), prefix + std::string("0.125, reducing to 0.1"));
  EXPECT_EQ(small.update(O), prefix + std::string("0.1, reducing to 0.1"));
}

TEST(LossScaler, FormatScale) {
  EXPECT_EQ(format_scale(65536), "65536");
  EXPECT_EQ(format_scale(1), "1");
  EXPECT_EQ(format_scale(4294967296.0), "4294967296");
  EXPECT_EQ(format_scale(std::ldexp(1.0, 70)), "1180591620717411303424");
  EXPECT_EQ(format_scale(0.5), "0.5");
  EXPECT_EQ(format_scale(0.1), "0.1");
  EXPECT_EQ(format_scale(1.0 / 3.0), "0.3333333333333333");
  EXPECT_EQ(format_scale(1.5), "1.5");
}

// Each invalid option is refused with a message naming its fp16 key (precision_config.py:120-133
// and :183-197 check loss_scale, loss_scale_window, min_loss_scale; memrt also checks hysteresis,
// which DeepSpeed does not: below 1 its scale would never be halved, and initial_scale_power).
TEST(LossScaler, InvalidOptionsNameTheirKey) {
  const auto error_for = [](LossScalerOptions o) {
    return error_of([&] { LossScaler s(o, ScalerKind::kZero); });
  };
  LossScalerOptions o;
  o.loss_scale = -1;
  EXPECT_TRUE(contains(error_for(o), "fp16.loss_scale ")) << error_for(o);
  o.loss_scale = std::numeric_limits<double>::infinity();
  EXPECT_TRUE(contains(error_for(o), "fp16.loss_scale ")) << error_for(o);
  o.loss_scale = std::numeric_limits<double>::quiet_NaN();
  EXPECT_TRUE(contains(error_for(o), "fp16.loss_scale ")) << error_for(o);
  o = LossScalerOptions{};
  o.loss_scale_window = 0;
  EXPECT_TRUE(contains(error_for(o), "fp16.loss_scale_window must be > 0")) << error_for(o);
  o = LossScalerOptions{};
  o.min_loss_scale = 0;
  EXPECT_TRUE(contains(error_for(o), "fp16.min_loss_scale must be")) << error_for(o);
  o.min_loss_scale = -2;
  EXPECT_TRUE(contains(error_for(o), "fp16.min_loss_scale must be")) << error_for(o);
  o = LossScalerOptions{};
  o.hysteresis = 0;
  EXPECT_TRUE(contains(error_for(o), "fp16.hysteresis must be >= 1")) << error_for(o);
  o = LossScalerOptions{};
  o.initial_scale_power = 1024;
  EXPECT_TRUE(contains(error_for(o), "fp16.initial_scale_power")) << error_for(o);
  o.initial_scale_power = -1075;
  EXPECT_TRUE(contains(error_for(o), "fp16.initial_scale_power")) << error_for(o);
  o = LossScalerOptions{};
  EXPECT_EQ(error_for(o), "");
}

}  // namespace
}  // namespace memrt::precision
