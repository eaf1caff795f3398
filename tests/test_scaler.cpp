// Loss scalers (amp/scaler.h) and the fused unscale_and_check_finite op. Scale sequences are checked against
// sequences derived by hand from the published update rules (derivations in the comments).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "amp/scaler.h"
#include "autograd/autograd.h"
#include "optim/adam.h"
#include "optim/sgd.h"
#include "tensor/ops.h"
#include "test_util.h"

namespace mixtape {
namespace {

using testing::kFloatDtypes;
using testing::round_to;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Applies update(found_inf) for each character of `pattern` ('O' overflow, 'C' clean) and returns the
// scale after each update.
std::vector<double> run_pattern(LossScaler& scaler, const std::string& pattern) {
  std::vector<double> scales;
  for (char c : pattern) {
    scaler.update(c == 'O');
    scales.push_back(scaler.scale());
  }
  return scales;
}

Tensor parameter(const std::vector<double>& values) {
  Tensor p = Tensor::from_vector(values, {static_cast<int64_t>(values.size())}, DType::F32);
  p.requires_grad_();
  return p;
}
void set_grad(Tensor p, const std::vector<double>& values) {
  p.set_grad(Tensor::from_vector(values, {static_cast<int64_t>(values.size())}, DType::F32));
}

// ------------------------------------------------------------------------------- unscale_and_check_finite

// The reference: the element read exactly into double, multiplied in the compute precision (fp32 for
// f32/f16/bf16, with inv_scale rounded to fp32 first; double for f64) and rounded once to the dtype. Both
// roundings are spelled out here in plain C++, so the comparison is exact (0 ulp).
double reference_unscale(DType dtype, double x, double inv_scale) {
  if (dtype == DType::F64) return x * inv_scale;
  const float product = static_cast<float>(x) * static_cast<float>(inv_scale);
  return round_to(dtype, product);
}

TEST(UnscaleAndCheckFinite, MultipliesExactlyInEveryDtypeAndFindsNothingOnFiniteGradients) {
  // 100,003 elements: above the parallel threshold, with a tail that is not a multiple of any vector width.
  for (DType dtype : kFloatDtypes) {
    for (double inv_scale : {1.0 / 1024, 1.0 / 3, 3.0}) {
      const Tensor g = testing::uniform_tensor({100003}, 7, -100, 100, dtype);
      const Tensor small = testing::uniform_tensor({5}, 8, -1, 1, dtype);
      const std::vector<double> before = g.to_vector<double>(), before_small = small.to_vector<double>();
      EXPECT_FALSE(unscale_and_check_finite({g, small}, inv_scale)) << dtype_name(dtype);
      const std::vector<double> after = g.to_vector<double>(), after_small = small.to_vector<double>();
      for (size_t i = 0; i < before.size(); ++i)
        ASSERT_EQ(after[i], reference_unscale(dtype, before[i], inv_scale))
            << dtype_name(dtype) << " element " << i << " inv_scale " << inv_scale;
      for (size_t i = 0; i < before_small.size(); ++i)
        ASSERT_EQ(after_small[i], reference_unscale(dtype, before_small[i], inv_scale));
    }
  }
}

TEST(UnscaleAndCheckFinite, FindsNaNAndInfAnywhereInEveryDtype) {
  for (DType dtype : kFloatDtypes) {
    for (double bad : {kNaN, kInf, -kInf}) {
      for (int64_t where : {int64_t{0}, int64_t{70001}, int64_t{99999}}) {
        std::vector<double> values(100000, 0.5);
        values[where] = bad;
        const Tensor g = Tensor::from_vector(values, {100000}, dtype);
        const Tensor clean = Tensor::full({3}, 2.0, dtype);
        EXPECT_TRUE(unscale_and_check_finite({clean, g}, 0.5)) << dtype_name(dtype) << " " << bad << " at " << where;
        // The finite elements are still unscaled (the scaler skips the step; the values do not matter then,
        // but PyTorch's kernel unscales all of them too).
        EXPECT_EQ(g.to_vector<double>()[where == 0 ? 1 : 0], 0.25);
        EXPECT_EQ(clean.to_vector<double>()[0], 1.0);
      }
    }
  }
}

TEST(UnscaleAndCheckFinite, FindsFiniteValuesThatOverflowWhenScaled) {
  // The largest finite values of each dtype, doubled: the product is inf in the stored dtype.
  const std::map<DType, double> largest = {
      {DType::F16, 65504.0}, {DType::BF16, 3.3895313892515355e38}, {DType::F32, 3.4028234663852886e38},
      {DType::F64, std::numeric_limits<double>::max()}};
  for (const auto& [dtype, value] : largest) {
    const Tensor g = Tensor::from_vector(std::vector<double>{1.0, value}, {2}, dtype);
    EXPECT_TRUE(unscale_and_check_finite({g}, 2.0)) << dtype_name(dtype);
    const Tensor fine = Tensor::from_vector(std::vector<double>{1.0, value}, {2}, dtype);
    EXPECT_FALSE(unscale_and_check_finite({fine}, 1.0)) << dtype_name(dtype);
  }
}

TEST(UnscaleAndCheckFinite, SkipsUndefinedAndReturnsFalseOnNothing) {
  EXPECT_FALSE(unscale_and_check_finite({}, 0.5));
  EXPECT_FALSE(unscale_and_check_finite({Tensor()}, 0.5));
}

TEST(UnscaleAndCheckFinite, RejectsIntegerNonContiguousAndNonFiniteInvScale) {
  const Tensor ints = Tensor::from_vector(std::vector<int64_t>{1, 2}, {2});
  EXPECT_ERROR_MENTIONS(unscale_and_check_finite({ints}, 0.5), "unscale_and_check_finite", "i64",
                        "floating");
  const Tensor strided = Tensor::zeros({4, 4}).transpose(0, 1);
  EXPECT_ERROR_MENTIONS(unscale_and_check_finite({strided}, 0.5), "unscale_and_check_finite", "contiguous");
  EXPECT_ERROR_MENTIONS(unscale_and_check_finite({Tensor::zeros({2})}, kInf), "unscale_and_check_finite",
                        "inv_scale", "inf");
}

// ---------------------------------------------------------------------------------------------- GradScaler

TEST(GradScaler, DefaultsArePyTorchs) {
  GradScaler scaler;
  EXPECT_EQ(scaler.scale(), 65536.0);
  EXPECT_EQ(scaler.options().growth_factor, 2.0);
  EXPECT_EQ(scaler.options().backoff_factor, 0.5);
  EXPECT_EQ(scaler.options().growth_interval, 2000);
  EXPECT_TRUE(scaler.enabled());
}

TEST(GradScaler, ScaleSequenceFollowsPyTorchsRuleAndOverflowResetsTheGrowthCount) {
  // S0 = 8, growth 2, backoff 0.5, interval 3; t = growth tracker.
  // C: t=1 S=8 | C: t=2 S=8 | C: t=3 -> S=16 t=0 | C: t=1 S=16 | O: S=8 t=0 | C: t=1 8 | C: t=2 8 |
  // C: t=3 -> 16 | O: 8 | O: 4 (every overflow backs off: no hysteresis) | C: 4 | C: 4 | C: t=3 -> 8.
  // The C after the first O grows only three clean steps later: the overflow reset the count.
  GradScaler scaler({.init_scale = 8, .growth_factor = 2, .backoff_factor = 0.5, .growth_interval = 3});
  const std::vector<double> expected = {8, 8, 16, 16, 8, 8, 8, 16, 8, 4, 4, 4, 8};
  EXPECT_EQ(run_pattern(scaler, "CCCCOCCCOOCCC"), expected);
}

TEST(GradScaler, KeepsTheScaleWhenGrowingWouldOverflowFp32) {
  // PyTorch keeps S as an fp32 tensor and drops a grown S that is inf there; the tracker still resets.
  GradScaler scaler({.init_scale = 2e38, .growth_factor = 2, .backoff_factor = 0.5, .growth_interval = 1});
  EXPECT_EQ(run_pattern(scaler, "CC"), (std::vector<double>{2e38, 2e38}));
  EXPECT_EQ(scaler.growth_tracker(), 0);
}

TEST(GradScaler, ScalesTheLossAndItsGradient) {
  GradScaler scaler({.init_scale = 1024});
  Tensor x = parameter({1.5, -2});
  const Tensor loss = scaler.scale(sum(x));
  EXPECT_EQ(loss.item(), -0.5 * 1024);
  backward(loss);
  EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{1024, 1024}));
}

TEST(GradScaler, StepUnscalesAndStepsOnFiniteGradients) {
  // S = 4: a scaled gradient [4, 8] unscales to [1, 2]; SGD lr 0.5 moves [1, 1] to [0.5, 0].
  GradScaler scaler({.init_scale = 4});
  Tensor p = parameter({1, 1});
  SGD sgd({p}, 0.5);
  set_grad(p, {4, 8});
  EXPECT_TRUE(scaler.step(sgd));
  EXPECT_EQ(p.grad().to_vector<double>(), (std::vector<double>{1, 2}));
  EXPECT_EQ(p.to_vector<double>(), (std::vector<double>{0.5, 0}));
  scaler.update();
  EXPECT_EQ(scaler.scale(), 4.0);
  EXPECT_EQ(scaler.growth_tracker(), 1);
}

TEST(GradScaler, SkipsTheStepOnInfLeavingParametersAndAdamStateUnchanged) {
  GradScaler scaler({.init_scale = 4});
  Tensor p = parameter({1, -1});
  Adam adam({p}, 0.1);
  set_grad(p, {4, 8});
  ASSERT_TRUE(scaler.step(adam));  // creates the Adam state
  scaler.update();
  const std::vector<double> params_before = p.to_vector<double>();
  const ParamState* state = adam.state(p);
  ASSERT_NE(state, nullptr);
  const int64_t step_before = state->step;
  std::map<std::string, std::vector<double>> buffers_before;
  for (const auto& [name, buffer] : state->buffers) buffers_before[name] = buffer.to_vector<double>();

  set_grad(p, {kInf, 8});
  EXPECT_FALSE(scaler.step(adam));
  EXPECT_EQ(p.to_vector<double>(), params_before);
  EXPECT_EQ(adam.state(p)->step, step_before);
  for (const auto& [name, buffer] : adam.state(p)->buffers)
    EXPECT_EQ(buffer.to_vector<double>(), buffers_before[name]) << name;
  scaler.update();
  EXPECT_EQ(scaler.scale(), 2.0);  // backed off
  EXPECT_EQ(scaler.growth_tracker(), 0);
}

TEST(GradScaler, TwoOptimizersStepIndependentlyAndUpdateCombinesTheirOverflows) {
  // S = 4. Optimizer 1's gradient [4, 8] is finite: it steps (SGD lr 0.5: [1, 1] -> [0.5, 0]). Optimizer
  // 2's has a NaN: it skips. update() sees one overflow: S = 2.
  GradScaler scaler({.init_scale = 4});
  Tensor p1 = parameter({1, 1}), p2 = parameter({3, 3});
  SGD sgd1({p1}, 0.5), sgd2({p2}, 0.5);
  // Two losses: the gradients accumulate before the one unscale per optimizer.
  set_grad(p1, {4, 8});
  set_grad(p2, {kNaN, 4});
  EXPECT_TRUE(scaler.step(sgd1));
  EXPECT_FALSE(scaler.step(sgd2));
  EXPECT_EQ(p1.to_vector<double>(), (std::vector<double>{0.5, 0}));
  EXPECT_EQ(p2.to_vector<double>(), (std::vector<double>{3, 3}));
  scaler.update();
  EXPECT_EQ(scaler.scale(), 2.0);
  // The next step starts fresh for both optimizers.
  set_grad(p1, {2, 2});
  set_grad(p2, {2, 2});
  EXPECT_TRUE(scaler.step(sgd1));
  EXPECT_TRUE(scaler.step(sgd2));
  EXPECT_EQ(p2.to_vector<double>(), (std::vector<double>{2.5, 2.5}));
  scaler.update();
  EXPECT_EQ(scaler.scale(), 2.0);
  EXPECT_EQ(scaler.growth_tracker(), 1);
}

TEST(GradScaler, ExplicitUnscaleBeforeStepIsNotRepeated) {
  // unscale() then step(): the gradient is divided by S once ([8] / 4 = [2]; SGD lr 1: 5 - 2 = 3).
  GradScaler scaler({.init_scale = 4});
  Tensor p = parameter({5});
  SGD sgd({p}, 1.0);
  set_grad(p, {8});
  scaler.unscale(sgd);
  EXPECT_EQ(p.grad().to_vector<double>(), (std::vector<double>{2}));
  EXPECT_TRUE(scaler.step(sgd));
  EXPECT_EQ(p.to_vector<double>(), (std::vector<double>{3}));
}

TEST(GradScaler, UnscaleReplacesANonContiguousGradientByAnUnscaledContiguousOne) {
  // The gradient [[8, 16], [24, 32]] seen transposed; S = 8 gives [[1, 3], [2, 4]] in row-major order.
  GradScaler scaler({.init_scale = 8});
  Tensor p = Tensor::zeros({2, 2});
  p.requires_grad_();
  p.set_grad(Tensor::from_vector(std::vector<double>{8, 16, 24, 32}, {2, 2}, DType::F32).transpose(0, 1));
  ASSERT_FALSE(p.grad().is_contiguous());
  SGD sgd({p}, 1.0);
  scaler.unscale(sgd);
  EXPECT_TRUE(p.grad().is_contiguous());
  EXPECT_EQ(p.grad().to_vector<double>(), (std::vector<double>{1, 3, 2, 4}));
}

TEST(GradScaler, UnscalingTwiceOrAfterStepOrSteppingTwiceIsAnError) {
  GradScaler scaler;
  Tensor p = parameter({1});
  SGD sgd({p}, 0.1);
  set_grad(p, {1});
  scaler.unscale(sgd);
  EXPECT_ERROR_MENTIONS(scaler.unscale(sgd), "unscale() has already been called on this optimizer",
                        "since the last update()");
  scaler.step(sgd);
  EXPECT_ERROR_MENTIONS(scaler.unscale(sgd), "after step()");
  EXPECT_ERROR_MENTIONS(scaler.step(sgd), "step() has already been called");
  scaler.update();
  scaler.unscale(sgd);  // allowed again after update()
}

TEST(GradScaler, UpdateWithoutAnyInfCheckIsAnError) {
  GradScaler scaler;
  EXPECT_ERROR_MENTIONS(scaler.update(), "GradScaler", "no inf checks were recorded");
}

TEST(GradScaler, RefusesToUnscaleFp16Gradients) {
  GradScaler scaler;
  Tensor p = Tensor::zeros({2}, DType::F16);
  p.requires_grad_();
  p.set_grad(Tensor::ones({2}, DType::F16));
  SGD sgd({p}, 0.1);
  EXPECT_ERROR_MENTIONS(scaler.unscale(sgd), "FP16 gradients", "f16[2]");
}

TEST(GradScaler, DisabledIsAPassThrough) {
  GradScaler scaler({.enabled = false});
  EXPECT_EQ(scaler.scale(), 1.0);
  const Tensor loss = Tensor::scalar(3.0);
  EXPECT_EQ(scaler.scale(loss).item(), 3.0);
  Tensor p = parameter({1});
  SGD sgd({p}, 1.0);
  set_grad(p, {4});
  EXPECT_TRUE(scaler.step(sgd));  // gradient not divided: 1 - 4 = -3
  EXPECT_EQ(p.to_vector<double>(), (std::vector<double>{-3}));
  scaler.update();
  scaler.update(true);
  EXPECT_EQ(scaler.scale(), 1.0);
  EXPECT_TRUE(scaler.state_dict().empty());
}

TEST(GradScaler, StateDictRoundTripReproducesTheFutureSequence) {
  const GradScalerOptions options{.init_scale = 8, .growth_factor = 4, .backoff_factor = 0.25,
                                  .growth_interval = 3};
  GradScaler a(options);
  run_pattern(a, "CCCCOCC");  // S: 8 8 32 32 8 8 8; tracker 2
  const std::map<std::string, std::string> state = a.state_dict();
  EXPECT_EQ(state.at("type"), "GradScaler");
  EXPECT_EQ(state.at("growth_tracker"), "2");
  GradScaler b;  // different options: the state carries them, as PyTorch's does
  b.load_state_dict(state);
  EXPECT_EQ(b.scale(), 8.0);
  const std::string future = "CCCOCCCCO";
  EXPECT_EQ(run_pattern(b, future), run_pattern(a, future));
}

TEST(GradScaler, LoadStateDictRejectsBadStateAndChangesNothing) {
  GradScaler scaler({.init_scale = 16});
  EXPECT_ERROR_MENTIONS(scaler.load_state_dict({}), "empty");
  EXPECT_ERROR_MENTIONS(scaler.load_state_dict({{"type", "DynamicLossScaler"}}), "DynamicLossScaler",
                        "expected \"GradScaler\"");
  auto state = GradScaler().state_dict();
  state["scale"] = "abc";
  EXPECT_ERROR_MENTIONS(scaler.load_state_dict(state), "scale", "abc");
  state = GradScaler().state_dict();
  state["growth_factor"] = "0.5";
  EXPECT_ERROR_MENTIONS(scaler.load_state_dict(state), "growth_factor", "0.5");
  EXPECT_EQ(scaler.scale(), 16.0);
}

TEST(GradScaler, RejectsEveryInvalidOption) {
  EXPECT_ERROR_MENTIONS(GradScaler({.init_scale = 0}), "GradScaler", "init_scale", "0");
  EXPECT_ERROR_MENTIONS(GradScaler({.init_scale = -1}), "init_scale", "-1");
  EXPECT_ERROR_MENTIONS(GradScaler({.init_scale = kInf}), "init_scale", "inf");
  EXPECT_ERROR_MENTIONS(GradScaler({.init_scale = kNaN}), "init_scale", "nan");
  EXPECT_ERROR_MENTIONS(GradScaler({.growth_factor = 1}), "growth_factor", "1");
  EXPECT_ERROR_MENTIONS(GradScaler({.growth_factor = 0.5}), "growth_factor", "0.5");
  EXPECT_ERROR_MENTIONS(GradScaler({.backoff_factor = 1}), "backoff_factor", "1");
  EXPECT_ERROR_MENTIONS(GradScaler({.backoff_factor = 0}), "backoff_factor", "0");
  EXPECT_ERROR_MENTIONS(GradScaler({.backoff_factor = 1.5}), "backoff_factor", "1.5");
  EXPECT_ERROR_MENTIONS(GradScaler({.growth_interval = 0}), "growth_interval", "0");
}

// --------------------------------------------------------------------------------------- DynamicLossScaler

TEST(DynamicLossScaler, DefaultsAreMegatrons) {
  DynamicLossScaler scaler;
  EXPECT_EQ(scaler.scale(), 4294967296.0);
  EXPECT_EQ(scaler.options().min_scale, 1.0);
  EXPECT_EQ(scaler.options().max_scale, 4294967296.0);
  EXPECT_EQ(scaler.options().growth_interval, 1000);
  EXPECT_EQ(scaler.options().hysteresis, 2);
  EXPECT_EQ(scaler.hysteresis_tracker(), 2);
}

TEST(DynamicLossScaler, HalvesOnlyAfterHysteresisOverflows) {
  // hysteresis 3: h = 3 -> O: h=2 (keep 16) -> O: h=1 (keep) -> O: h=0 -> S = 8 -> O: h=-1 -> S = 4.
  DynamicLossScaler scaler({.initial_scale = 16, .min_scale = 1, .max_scale = 64, .growth_interval = 5,
                            .hysteresis = 3});
  EXPECT_EQ(run_pattern(scaler, "OOOO"), (std::vector<double>{16, 16, 8, 4}));
}

TEST(DynamicLossScaler, ScaleSequenceFollowsMegatronsRuleWithClampsAndHysteresisRefill) {
  // S0 = 16, min 2, max 64, growth 2, backoff 0.5, interval 2, hysteresis 2; g = growth, h = hysteresis.
  //  O: g=0 h=1       -> 16    O: h=0 -> 8          O: h=-1 -> 4       C: g=1 -> 4
  //  O: g=0 h=-2 -> 2          O: h=-3 -> max(1, 2) = 2 (min clamp)    C: g=1 -> 2
  //  C: g=2 -> g=0 h=2 (refilled) S=4                O: h=1 -> 4 (refill absorbs one overflow)
  //  C: g=1 4   C: g=2 -> 8 (h=2)   then 8 clean: 8 16 16 32 32 64 64 min(128, 64)=64 (max clamp).
  DynamicLossScaler scaler({.initial_scale = 16, .min_scale = 2, .max_scale = 64, .growth_factor = 2,
                            .backoff_factor = 0.5, .growth_interval = 2, .hysteresis = 2});
  const std::vector<double> expected = {16, 8, 4, 4, 2, 2, 2, 4, 4, 4, 8, 8, 16, 16, 32, 32, 64, 64, 64};
  EXPECT_EQ(run_pattern(scaler, "OOOCOOCCOCCCCCCCCCC"), expected);
}

TEST(DynamicLossScaler, OverflowResetsTheGrowthCount) {
  // interval 3, hysteresis 2: C C (g=2) O (g=0, h=1: keep) C C C (g=3 -> grow, h=2) -> 32.
  DynamicLossScaler scaler({.initial_scale = 16, .min_scale = 1, .max_scale = 1024, .growth_interval = 3,
                            .hysteresis = 2});
  EXPECT_EQ(run_pattern(scaler, "CCOCCC"), (std::vector<double>{16, 16, 16, 16, 16, 32}));
  EXPECT_EQ(scaler.hysteresis_tracker(), 2);
}

TEST(DynamicLossScaler, ScalesTheLoss) {
  DynamicLossScaler scaler({.initial_scale = 256, .min_scale = 1, .max_scale = 256});
  EXPECT_EQ(scaler.scale(Tensor::scalar(0.5)).item(), 128.0);
}

TEST(DynamicLossScaler, StateDictRoundTripReproducesTheFutureSequence) {
  const DynamicLossScalerOptions options{.initial_scale = 64, .min_scale = 1, .max_scale = 512,
                                         .growth_interval = 3, .hysteresis = 3};
  DynamicLossScaler a(options);
  run_pattern(a, "OOCC");  // h = 1, g = 2: one more overflow backs off, one more clean grows
  DynamicLossScaler b(options);
  b.load_state_dict(a.state_dict());
  EXPECT_EQ(b.growth_tracker(), 2);
  EXPECT_EQ(b.hysteresis_tracker(), 1);
  const std::string future = "OCCCOOOCCC";
  const std::vector<double> from_b = run_pattern(b, future);
  EXPECT_EQ(from_b, run_pattern(a, future));
  // ... and differs from a fresh scaler's, so the state really carried something.
  DynamicLossScaler fresh(options);
  EXPECT_NE(from_b, run_pattern(fresh, future));
}

TEST(DynamicLossScaler, LoadStateDictRejectsBadState) {
  DynamicLossScaler scaler;
  EXPECT_ERROR_MENTIONS(scaler.load_state_dict(StaticLossScaler(2).state_dict()), "StaticLossScaler",
                        "expected \"DynamicLossScaler\"");
  auto state = scaler.state_dict();
  state["growth_tracker"] = "5000";
  EXPECT_ERROR_MENTIONS(scaler.load_state_dict(state), "growth_tracker", "5000");
  state = scaler.state_dict();
  state.erase("hysteresis_tracker");
  EXPECT_ERROR_MENTIONS(scaler.load_state_dict(state), "missing", "hysteresis_tracker");
}

TEST(DynamicLossScaler, RejectsEveryInvalidOption) {
  using O = DynamicLossScalerOptions;
  EXPECT_ERROR_MENTIONS(DynamicLossScaler(O{.initial_scale = 0}), "DynamicLossScaler", "initial_scale", "0");
  EXPECT_ERROR_MENTIONS(DynamicLossScaler(O{.initial_scale = kInf}), "initial_scale", "inf");
  EXPECT_ERROR_MENTIONS(DynamicLossScaler(O{.min_scale = 0}), "min_scale", "0");
  EXPECT_ERROR_MENTIONS(DynamicLossScaler(O{.initial_scale = 4, .min_scale = 8, .max_scale = 2}), "min_scale",
                        "8", "max_scale", "2");
  EXPECT_ERROR_MENTIONS(DynamicLossScaler(O{.initial_scale = 1024, .min_scale = 1, .max_scale = 512}),
                        "initial_scale", "1024", "512");
  EXPECT_ERROR_MENTIONS(DynamicLossScaler(O{.growth_factor = 1}), "growth_factor", "1");
  EXPECT_ERROR_MENTIONS(DynamicLossScaler(O{.backoff_factor = 1}), "backoff_factor", "1");
  EXPECT_ERROR_MENTIONS(DynamicLossScaler(O{.backoff_factor = -0.5}), "backoff_factor", "-0.5");
  EXPECT_ERROR_MENTIONS(DynamicLossScaler(O{.growth_interval = 0}), "growth_interval", "0");
  EXPECT_ERROR_MENTIONS(DynamicLossScaler(O{.hysteresis = 0}), "hysteresis", "0");
}

// ------------------------------------------------------------------------------------ Apex and static

TEST(ApexDynamicScaler, DefaultsAreApexs) {
  const DynamicLossScaler scaler = apex_dynamic_scaler();
  EXPECT_EQ(scaler.scale(), 65536.0);
  EXPECT_EQ(scaler.options().growth_interval, 2000);
  EXPECT_EQ(scaler.options().max_scale, 16777216.0);
  EXPECT_EQ(scaler.options().hysteresis, 1);
}

TEST(ApexDynamicScaler, BacksOffOnEveryOverflowAndClampsToMinAndMax) {
  // Apex update_scale, S0 = 16, window 2, min 4, max 64:
  //  O: max(4, 8) = 8   O: 4   O: max(4, 2) = 4 (min clamp)
  //  C: u=1 4   C: u=2 -> 8   C 8   C 16   C 16   C 32   C 32   C 64   C 64   C: min(64, 128) = 64.
  DynamicLossScaler scaler = apex_dynamic_scaler(16, 2, 4.0, 64);
  const std::vector<double> expected = {8, 4, 4, 4, 8, 8, 16, 16, 32, 32, 64, 64, 64};
  EXPECT_EQ(run_pattern(scaler, "OOOCCCCCCCCCC"), expected);
}

TEST(ApexDynamicScaler, WithoutMinLossScaleKeepsHalvingAboveZero) {
  DynamicLossScaler scaler = apex_dynamic_scaler(1, 2);
  EXPECT_EQ(run_pattern(scaler, "OO"), (std::vector<double>{0.5, 0.25}));
  for (int i = 0; i < 2000; ++i) scaler.update(true);
  EXPECT_GT(scaler.scale(), 0.0);
}

TEST(ApexDynamicScaler, RejectsInvalidOptions) {
  EXPECT_ERROR_MENTIONS(apex_dynamic_scaler(16, 2, 4.0, 64, 1.0), "scale_factor", "1");
  EXPECT_ERROR_MENTIONS(apex_dynamic_scaler(16, 0), "apex_dynamic_scaler", "scale_window", "0");
  EXPECT_ERROR_MENTIONS(apex_dynamic_scaler(0), "init_scale", "0");
  EXPECT_ERROR_MENTIONS(apex_dynamic_scaler(16, 2, 4.0, 8.0), "min_scale", "max_scale", "8");
  EXPECT_ERROR_MENTIONS(apex_dynamic_scaler(16, 2, -1.0), "min_loss_scale", "-1");
}

TEST(StaticLossScaler, NeverChangesItsScale) {
  StaticLossScaler scaler(128);
  EXPECT_EQ(run_pattern(scaler, "OOCCO"), (std::vector<double>(5, 128)));
  EXPECT_EQ(scaler.scale(Tensor::scalar(2.0)).item(), 256.0);
}

TEST(StaticLossScaler, ScaleOneReturnsTheLossItself) {
  StaticLossScaler scaler;
  EXPECT_EQ(scaler.scale(), 1.0);
  Tensor x = parameter({2});
  const Tensor loss = sum(x);
  const Tensor scaled = scaler.scale(loss);
  EXPECT_EQ(scaled.item(), 2.0);
  backward(scaled);
  EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{1}));
}

TEST(StaticLossScaler, StateDictRoundTripAndInvalidScale) {
  StaticLossScaler a(0.125), b(4);
  b.load_state_dict(a.state_dict());
  EXPECT_EQ(b.scale(), 0.125);
  EXPECT_ERROR_MENTIONS(StaticLossScaler(0), "StaticLossScaler", "scale", "0");
  EXPECT_ERROR_MENTIONS(StaticLossScaler(-kInf), "scale", "-inf");
}

TEST(LossScaler, StateGoesIntoACheckpointsMetadata) {
  // The trainer stores a scaler's state as metadata entries under a prefix of its StateDict.
  DynamicLossScaler a({.initial_scale = 1024, .min_scale = 1, .max_scale = 4096, .growth_interval = 2});
  run_pattern(a, "COC");
  StateDict checkpoint;
  for (const auto& [key, value] : a.state_dict()) checkpoint.metadata["loss_scaler." + key] = value;
  std::map<std::string, std::string> restored;
  for (const auto& [key, value] : checkpoint.metadata)
    if (key.rfind("loss_scaler.", 0) == 0) restored[key.substr(12)] = value;
  DynamicLossScaler b({.initial_scale = 1024, .min_scale = 1, .max_scale = 4096, .growth_interval = 2});
  b.load_state_dict(restored);
  EXPECT_EQ(run_pattern(b, "CCOOC"), run_pattern(a, "CCOOC"));
}

}  // namespace
}  // namespace mixtape
