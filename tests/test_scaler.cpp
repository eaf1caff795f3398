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

using State = std::map<std::string, std::string>;

// `state` with one entry set (added when new).
State with_entry(State state, const std::string& key, const std::string& value) {
  state.insert_or_assign(key, value);
  return state;
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
    // 1.0 takes the read-only path (the check alone): the values must come back untouched.
    for (double inv_scale : {1.0 / 1024, 1.0 / 3, 3.0, 1.0}) {
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
        // At a scale of 1 (the check alone, nothing written) too, in the first or the second tensor.
        EXPECT_TRUE(unscale_and_check_finite({clean, g}, 1.0)) << dtype_name(dtype) << " " << bad << " at " << where;
        EXPECT_TRUE(unscale_and_check_finite({g, clean}, 1.0)) << dtype_name(dtype) << " " << bad << " at " << where;
        EXPECT_FALSE(unscale_and_check_finite({clean}, 1.0)) << dtype_name(dtype);
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
  // Finite in double, beyond fp32, where f32/f16/bf16 gradients are unscaled; f64 ones are unscaled in double.
  for (DType dtype : {DType::F32, DType::F16, DType::BF16})
    EXPECT_ERROR_MENTIONS(unscale_and_check_finite({Tensor::zeros({2}, dtype)}, 1e39), "unscale_and_check_finite",
                          "inv_scale 1e+39", "beyond fp32's range");
  const Tensor f64 = Tensor::full({2}, 1e-30, DType::F64);
  EXPECT_FALSE(unscale_and_check_finite({f64}, 1e39));
  EXPECT_EQ(f64.to_vector<double>()[0], 1e-30 * 1e39);
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
  const double start = static_cast<float>(2e38);  // the fp32 nearest 2e38
  EXPECT_EQ(run_pattern(scaler, "CC"), (std::vector<double>{start, start}));
  EXPECT_EQ(scaler.growth_tracker(), 0);
}

TEST(GradScaler, TheScaleIsAnFp32ValueUpdatedAsPyTorchsKernelDoes) {
  // _amp_update_scale_ keeps S in an fp32 tensor: S * factor in double, rounded to fp32. With factors that
  // are not powers of two the sequence differs from double arithmetic:
  //   S0 = 24 (exact in fp32); O: 24 * 0.3 = 7.199999999999999 (double) -> fp32 7.199999809265137;
  //   O: 7.199999809265137 * 0.3 = 2.159999942779541 -> fp32 2.1599998474121094;
  //   C (interval 1): 2.1599998474121094 * 1.5 = 3.239999771118164 -> fp32 3.2399997711181641.
  // (Python: struct.unpack('f', struct.pack('f', x))[0] rounds a double to fp32.)
  GradScaler scaler({.init_scale = 24, .growth_factor = 1.5, .backoff_factor = 0.3, .growth_interval = 1});
  EXPECT_EQ(run_pattern(scaler, "OOC"), (std::vector<double>{7.199999809265137, 2.1599998474121094,
                                                              3.2399997711181641}));
  // The initial scale is rounded to fp32 too (torch.full((), init_scale, dtype=torch.float32)).
  EXPECT_EQ(GradScaler({.init_scale = 0.1}).scale(), 0.10000000149011612);
  EXPECT_ERROR_MENTIONS(GradScaler({.init_scale = 1e39}), "init_scale", "1e+39", "fp32");
  // At fp32's top: 3.4028235e38 (FLT_MAX as usually printed, above it by less than half an ulp) rounds to
  // FLT_MAX = 3.4028234663852886e38; from the midpoint 2^128 - 2^103 = 3.4028235677973366e38 on, to inf.
  EXPECT_EQ(GradScaler({.init_scale = 3.4028235e38}).scale(), 3.4028234663852886e38);
  EXPECT_ERROR_MENTIONS(GradScaler({.init_scale = 3.4028235677973366e38}), "init_scale", "fp32");
  // A growth that lands just above FLT_MAX rounds to it and is kept, as PyTorch's fp32 product would be.
  GradScaler top({.init_scale = 0x1p127, .growth_factor = 1.9999999, .growth_interval = 1});
  top.update(false);
  EXPECT_EQ(top.scale(), 3.4028234663852886e38);
}

// PyTorch's load_state_dict leaves what unscale_() recorded: the gradients already unscaled are not
// unscaled again after a state is loaded between unscale() and step().
TEST(GradScaler, LoadStateDictKeepsWhatUnscaleRecorded) {
  GradScaler scaler({.init_scale = 4});
  Tensor p = parameter({1});
  SGD sgd({p}, 1.0);
  set_grad(p, {12});
  scaler.unscale(sgd);
  EXPECT_EQ(p.grad().item(), 3.0);
  scaler.load_state_dict(scaler.state_dict());
  EXPECT_ERROR_MENTIONS(scaler.unscale(sgd), "unscale() has already been called on this optimizer");
  EXPECT_TRUE(scaler.step(sgd));
  EXPECT_EQ(p.grad().item(), 3.0);
}

TEST(GradScaler, ScalesTheLossAndItsGradient) {
  GradScaler scaler({.init_scale = 1024});
  Tensor x = parameter({1.5, -2});
  const Tensor loss = scaler.scale(sum(x));
  EXPECT_EQ(loss.item(), -0.5 * 1024);
  backward(loss);
  EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{1024, 1024}));
}

// PyTorch's scale(outputs) with a list: each output scaled (a disabled scaler passes them through), and one
// backward over both gives the sum of their scaled gradients; a bad output is an error naming its index.
TEST(GradScaler, ScalesAListOfOutputs) {
  GradScaler scaler({.init_scale = 1024});
  Tensor x = parameter({1.5, -2});
  const std::vector<Tensor> scaled = scaler.scale(std::vector<Tensor>{sum(x), mul(sum(x), 3.0)});
  ASSERT_EQ(scaled.size(), 2u);
  EXPECT_EQ(scaled[0].item(), -0.5 * 1024);
  EXPECT_EQ(scaled[1].item(), -1.5 * 1024);
  backward(scaled, {Tensor::ones({}), Tensor::ones({})});
  EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{4096, 4096}));
  const Tensor loss = sum(x);
  const std::vector<Tensor> kept = GradScaler({.enabled = false}).scale(std::vector<Tensor>{loss});
  EXPECT_TRUE(kept[0].same(loss));
  EXPECT_ERROR_MENTIONS(scaler.scale(std::vector<Tensor>{sum(x), Tensor()}), "GradScaler.scale",
                        "output 1 of 2", "undefined");
  EXPECT_ERROR_MENTIONS(scaler.scale(std::vector<Tensor>{Tensor::zeros({}, DType::I64)}), "output 0 of 1",
                        "expected a floating tensor");
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

TEST(GradScaler, UpdateToANewScaleKeepsTheGrowthTrackerAndNeedsNoInfCheck) {
  // PyTorch's update(new_scale): _scale.fill_(new_scale) (an fp32 tensor), _growth_tracker untouched, the
  // per-optimizer states cleared, and no "No inf checks were recorded" assertion on that path.
  GradScaler scaler({.init_scale = 4, .growth_interval = 3});
  scaler.update(false);
  scaler.update(false);  // tracker 2 of 3
  scaler.update(1024.0);
  EXPECT_EQ(scaler.scale(), 1024.0);
  EXPECT_EQ(scaler.growth_tracker(), 2);
  scaler.update(false);  // the third clean step grows the new scale
  EXPECT_EQ(scaler.scale(), 2048.0);
  EXPECT_EQ(scaler.growth_tracker(), 0);
  scaler.update(0.1);  // rounded to fp32, as fill_ on an fp32 tensor does
  EXPECT_EQ(scaler.scale(), 0.10000000149011612);

  // The records of unscale()/step() are reset: the optimizer can be unscaled and stepped again.
  Tensor p = parameter({5});
  SGD sgd({p}, 1.0);
  GradScaler s8({.init_scale = 8});
  set_grad(p, {8});
  EXPECT_TRUE(s8.step(sgd));  // 5 - 8 / 8 = 4
  s8.update(2.0);
  set_grad(p, {2});
  EXPECT_TRUE(s8.step(sgd));  // 4 - 2 / 2 = 3
  EXPECT_EQ(p.to_vector<double>(), (std::vector<double>{3}));

  for (double bad : {0.0, -1.0, kInf, kNaN, 1e39})
    EXPECT_ERROR_MENTIONS(scaler.update(bad), "GradScaler.update", "new_scale");
  EXPECT_EQ(scaler.scale(), 0.10000000149011612);  // unchanged by the errors
  GradScaler disabled({.enabled = false});
  disabled.update(64.0);
  EXPECT_EQ(disabled.scale(), 1.0);
}

TEST(GradScaler, UpdateWithoutAnyInfCheckIsAnError) {
  GradScaler scaler;
  EXPECT_ERROR_MENTIONS(scaler.update(), "GradScaler", "no inf checks were recorded");
}

TEST(GradScaler, AThrowingUnscaleRecordsNothingSoUpdateCountsNoCleanStep) {
  // growth_interval 1: a clean step counted by mistake would double S at once.
  GradScaler scaler({.init_scale = 4, .growth_interval = 1});
  Tensor p = Tensor::zeros({2}, DType::F16);
  p.requires_grad_();
  p.set_grad(Tensor::ones({2}, DType::F16));
  SGD sgd({p}, 0.1);
  EXPECT_ERROR_MENTIONS(scaler.unscale(sgd), "FP16 gradients");
  EXPECT_ERROR_MENTIONS(scaler.update(), "GradScaler.update",
                        "no inf checks were recorded prior to update()");
  EXPECT_EQ(scaler.scale(), 4.0);
  EXPECT_EQ(scaler.growth_tracker(), 0);
  // Nothing was recorded, so the same optimizer may be unscaled once its gradients are fixed.
  Tensor q = parameter({1});
  set_grad(q, {8});
  SGD fixed({q}, 1.0);
  EXPECT_ERROR_MENTIONS(scaler.step(sgd), "FP16 gradients");
  EXPECT_TRUE(scaler.step(fixed));
  scaler.update();
  EXPECT_EQ(scaler.scale(), 8.0);  // one clean step: the one of `fixed`
}

TEST(GradScaler, StepAndUpdateOfAnOptimizerWithoutGradientsAreErrorsAsInPyTorch) {
  // PyTorch: step() "No inf checks were recorded for this optimizer.", update() "... prior to update.".
  GradScaler scaler({.init_scale = 4, .growth_interval = 1});
  Tensor p = parameter({1, 2});
  SGD sgd({p}, 1.0);
  EXPECT_ERROR_MENTIONS(scaler.step(sgd), "GradScaler.step", "no inf checks were recorded for this optimizer",
                        "none of its 1 parameters has a gradient");
  EXPECT_EQ(p.to_vector<double>(), (std::vector<double>{1, 2}));
  EXPECT_ERROR_MENTIONS(scaler.update(), "GradScaler.update",
                        "no inf checks were recorded prior to update()");
  EXPECT_EQ(scaler.scale(), 4.0);
  EXPECT_EQ(scaler.growth_tracker(), 0);
}

TEST(GradScaler, AnOptimizerWithoutGradientsDoesNotCountInUpdate) {
  // S = 4, interval 2. sgd1 has a finite gradient, sgd2 none: unscale(sgd2) is allowed (PyTorch records the
  // optimizer as unscaled with no inf check), update() combines sgd1's check alone: one clean step.
  GradScaler scaler({.init_scale = 4, .growth_interval = 2});
  Tensor p1 = parameter({1}), p2 = parameter({1});
  SGD sgd1({p1}, 1.0), sgd2({p2}, 1.0);
  set_grad(p1, {8});
  scaler.unscale(sgd2);
  EXPECT_TRUE(scaler.step(sgd1));
  scaler.update();
  EXPECT_EQ(scaler.growth_tracker(), 1);
  EXPECT_EQ(scaler.scale(), 4.0);
}

TEST(GradScaler, UnscaleAfterTheScaleBackedOffPastFp32sRangeIsAnErrorOfTheScaler) {
  // 130 overflows from S = 1: S = 2^-130 and 1/S = 2^130 > fp32's largest finite 2^128 (1 - 2^-24).
  GradScaler scaler({.init_scale = 1});
  run_pattern(scaler, std::string(130, 'O'));
  EXPECT_EQ(scaler.scale(), std::ldexp(1.0, -130));
  Tensor p = parameter({1});
  set_grad(p, {1});
  SGD sgd({p}, 1.0);
  EXPECT_ERROR_MENTIONS(scaler.unscale(sgd), "GradScaler.unscale", "scale is 7.346839692639297e-40",
                        "1/scale overflows fp32");
  EXPECT_ERROR_MENTIONS(scaler.update(), "no inf checks were recorded");  // the failed unscale left nothing
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

TEST(GradScaler, LoadStateDictErrorsNameTheCallAndTheEntry) {
  GradScaler scaler({.init_scale = 16});
  const std::map<std::string, std::string> state = GradScaler().state_dict();
  EXPECT_ERROR_MENTIONS(scaler.load_state_dict(with_entry(state, "scale", "0")), "GradScaler.load_state_dict",
                        "entry 'scale' 0 is not a usable loss scale");
  EXPECT_ERROR_MENTIONS(scaler.load_state_dict(with_entry(state, "backoff_factor", "1")),
                        "GradScaler.load_state_dict", "entry 'backoff_factor'", "(0, 1)", "got 1");
  EXPECT_ERROR_MENTIONS(scaler.load_state_dict(with_entry(state, "growth_tracker", "2000")),
                        "GradScaler.load_state_dict", "entry 'growth_tracker'", "2000",
                        "[0, growth_interval 2000)");
  EXPECT_EQ(scaler.scale(), 16.0);
}

TEST(GradScaler, DisabledLoadStateDictIsANoOpAsInPyTorch) {
  // PyTorch's load_state_dict begins with "if not self._enabled: return".
  GradScaler scaler({.enabled = false});
  scaler.load_state_dict({});
  scaler.load_state_dict(GradScaler({.init_scale = 8}).state_dict());
  EXPECT_EQ(scaler.scale(), 1.0);
  EXPECT_TRUE(scaler.state_dict().empty());
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

TEST(LossScaler, ErrorsPrintValuesExactly) {
  // Six significant digits would print 1 - 1e-9 as "1" and 1 + 1e-12 as "1": the errors would read
  // "growth_factor must be > 1, got 1" for a value that is not 1.
  EXPECT_ERROR_MENTIONS(GradScaler({.growth_factor = 1 - 1e-9}), "growth_factor", "got 0.999999999");
  EXPECT_ERROR_MENTIONS(DynamicLossScaler({.backoff_factor = 1 + 1e-12}), "backoff_factor",
                        "got 1.000000000001");
  EXPECT_ERROR_MENTIONS(
      DynamicLossScaler({.initial_scale = 1.0000001, .min_scale = 1.0000001, .max_scale = 1}),
      "min_scale 1.0000001", "max_scale 1");
  auto state = DynamicLossScaler().state_dict();
  // (4294967296.5 would round to the fp32 max_scale 2^32 and load; 2^32 + 512.5 rounds to 2^32 + 512, above it.)
  state["scale"] = "4294967808.5";
  EXPECT_ERROR_MENTIONS(DynamicLossScaler().load_state_dict(state), "4294967808.5");
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
  // hysteresis 3: h = 3 -> O: h=2 (keep 16) -> O: h=1 (keep) -> O: h=0 -> S = 8 -> O: h stays 0 -> S = 4
  // (Megatron counts on to h=-1; every h <= 0 backs off alike).
  DynamicLossScaler scaler({.initial_scale = 16, .min_scale = 1, .max_scale = 64, .growth_interval = 5,
                            .hysteresis = 3});
  EXPECT_EQ(run_pattern(scaler, "OOOO"), (std::vector<double>{16, 16, 8, 4}));
  EXPECT_EQ(scaler.hysteresis_tracker(), 0);
}

TEST(DynamicLossScaler, ScaleSequenceFollowsMegatronsRuleWithClampsAndHysteresisRefill) {
  // S0 = 16, min 2, max 64, growth 2, backoff 0.5, interval 2, hysteresis 2; g = growth, h = hysteresis.
  //  O: g=0 h=1       -> 16    O: h=0 -> 8          O: h=0 (stays) -> 4    C: g=1 -> 4
  //  O: g=0 h=0 -> 2           O: h=0 -> max(1, 2) = 2 (min clamp)    C: g=1 -> 2
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

TEST(DynamicLossScaler, TheScaleAndTheRuleAreFp32ValuesAsInMegatronsTensors) {
  // Megatron-LM holds S, min_scale, growth_factor and backoff_factor in fp32 tensors, so each update is an
  // fp32 product of fp32 values. S0 = 24, growth 1.5, backoff 0.3 (fp32: 0.30000001192092896), interval 1,
  // hysteresis 1:
  //   O: 24 * 0.30000001192092896 = 7.200000286102295 (exact in fp32);
  //   O: 7.200000286102295 * 0.30000001192092896 = 2.1600001716613804 -> fp32 2.1600000858306885;
  //   C: 2.1600000858306885 * 1.5 = 3.2400001287460327 -> fp32 3.2400002479553223.
  // In double the sequence would be 7.199999999999999, 2.1599999999999997, 3.2399999999999993, and PyTorch's
  // GradScaler (a double factor, rounded after) gives 7.199999809265137, ...: three rules, three sequences.
  // (Python: struct.unpack('f', struct.pack('f', x))[0] rounds a double to fp32.)
  const DynamicLossScalerOptions options{.initial_scale = 24, .min_scale = 1, .max_scale = 1e6,
                                         .growth_factor = 1.5, .backoff_factor = 0.3, .growth_interval = 1,
                                         .hysteresis = 1};
  DynamicLossScaler megatron(options);
  EXPECT_EQ(run_pattern(megatron, "OOC"),
            (std::vector<double>{7.200000286102295, 2.1600000858306885, 3.2400002479553223}));
  // Apex's rule (a Python float) stays in double: 24 / 1.5 = 16 exactly, then 16 / 1.5 = 10.666666666666666.
  DynamicLossScaler apex = apex_dynamic_scaler(24, 1, std::nullopt, 1e6, 1.5);
  EXPECT_FALSE(apex.options().fp32_scale);
  EXPECT_EQ(run_pattern(apex, "OO"), (std::vector<double>{16, 10.666666666666666}));
  // The state round trip keeps the fp32 value; the initial scale and the bounds are rounded to fp32 too.
  DynamicLossScaler reloaded(options);
  reloaded.load_state_dict(megatron.state_dict());
  EXPECT_EQ(reloaded.scale(), 3.2400002479553223);
  // A state of the double rule (fp32_scale = false) loads under bounds that fp32 rounds: its scale is rounded
  // first (0.1 -> 0.10000000149011612, the rounded min_scale itself; 3000000001 -> 3e9 = max_scale in fp32).
  DynamicLossScaler at_min({.initial_scale = 1, .min_scale = 0.1});
  at_min.load_state_dict(with_entry(DynamicLossScaler({.initial_scale = 1, .min_scale = 0.1}).state_dict(),
                                    "scale", "0.1"));
  EXPECT_EQ(at_min.scale(), 0.10000000149011612);
  DynamicLossScaler at_max({.initial_scale = 1, .max_scale = 3000000001});
  at_max.load_state_dict(with_entry(DynamicLossScaler({.initial_scale = 1, .max_scale = 3000000001}).state_dict(),
                                    "scale", "3000000001"));
  EXPECT_EQ(at_max.scale(), 3e9);
  EXPECT_EQ(DynamicLossScaler({.initial_scale = 0.1, .min_scale = 0.01}).scale(), 0.10000000149011612);
  DynamicLossScaler floored({.initial_scale = 1, .min_scale = 0.1, .backoff_factor = 0.5, .hysteresis = 1});
  EXPECT_EQ(run_pattern(floored, "OOOO"), (std::vector<double>{0.5, 0.25, 0.125, 0.10000000149011612}));
  // What is not a finite positive fp32 value, or a factor that rounds to 1 there, is refused.
  EXPECT_ERROR_MENTIONS(DynamicLossScaler({.initial_scale = 1e-46, .min_scale = 1e-50}), "DynamicLossScaler",
                        "initial_scale 1e-46", "fp32");
  EXPECT_ERROR_MENTIONS(DynamicLossScaler({.growth_factor = 1 + 1e-9}), "growth_factor 1.000000001",
                        "is 1 in fp32");
  EXPECT_ERROR_MENTIONS(DynamicLossScaler({.backoff_factor = 1 - 1e-9}), "backoff_factor 0.999999999",
                        "is 1 in fp32");
  DynamicLossScalerOptions in_double = options;
  in_double.fp32_scale = false;
  DynamicLossScaler double_rule(in_double);
  EXPECT_EQ(run_pattern(double_rule, "OOC"),
            (std::vector<double>{7.199999999999999, 2.1599999999999997, 3.2399999999999993}));
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

TEST(DynamicLossScaler, LoadStateDictChecksTheScaleAndTheTrackersAgainstTheRule) {
  // Defaults: min_scale 1, max_scale 2^32, growth_interval 1000, hysteresis 2. The scaler can only reach
  // scales in [min, max], growth_tracker in [0, 1000) and hysteresis_tracker in [0, 2].
  DynamicLossScaler scaler;
  scaler.update(true);  // h = 1
  const std::map<std::string, std::string> before = scaler.state_dict();
  const auto with = [](const char* key, const char* value) {
    return with_entry(DynamicLossScaler().state_dict(), key, value);
  };
  EXPECT_ERROR_MENTIONS(scaler.load_state_dict(with("scale", "8589934592")),
                        "DynamicLossScaler.load_state_dict", "entry 'scale' is 8589934592",
                        "[min_scale 1, max_scale 4294967296]");
  EXPECT_ERROR_MENTIONS(scaler.load_state_dict(with("scale", "0.5")), "entry 'scale' is 0.5",
                        "[min_scale 1, max_scale 4294967296]");
  EXPECT_ERROR_MENTIONS(scaler.load_state_dict(with("scale", "inf")), "entry 'scale' inf is not a usable");
  EXPECT_ERROR_MENTIONS(scaler.load_state_dict(with("growth_tracker", "-1")),
                        "DynamicLossScaler.load_state_dict", "entry 'growth_tracker' is -1",
                        "[0, growth_interval 1000)");
  EXPECT_ERROR_MENTIONS(scaler.load_state_dict(with("hysteresis_tracker", "3")),
                        "DynamicLossScaler.load_state_dict", "entry 'hysteresis_tracker' is 3",
                        "[0, hysteresis 2]");
  EXPECT_ERROR_MENTIONS(scaler.load_state_dict(with("hysteresis_tracker", "-1")),
                        "entry 'hysteresis_tracker' is -1", "[0, hysteresis 2]");
  // The most negative tracker would wrap to the largest on the next overflow.
  EXPECT_ERROR_MENTIONS(scaler.load_state_dict(with("hysteresis_tracker", "-9223372036854775808")),
                        "hysteresis_tracker", "-9223372036854775808");
  EXPECT_EQ(scaler.state_dict(), before);
}

TEST(DynamicLossScaler, LoadStateDictRefusesAStateSavedUnderAnotherRule) {
  const DynamicLossScalerOptions base{.initial_scale = 64, .min_scale = 2, .max_scale = 1024,
                                      .growth_factor = 2, .backoff_factor = 0.5, .growth_interval = 10,
                                      .hysteresis = 2};
  const auto changed = [&](auto edit) {
    DynamicLossScalerOptions options = base;
    edit(options);
    return options;
  };
  // One option changed at a time: the error names it with both values.
  const std::vector<std::pair<DynamicLossScalerOptions, std::string>> saved_under = {
      {changed([](auto& o) { o.min_scale = 1; }), "saved with min_scale 1, this scaler has min_scale 2"},
      {changed([](auto& o) { o.max_scale = 2048; }),
       "saved with max_scale 2048, this scaler has max_scale 1024"},
      {changed([](auto& o) { o.growth_factor = 4; }), "growth_factor 4, this scaler has growth_factor 2"},
      {changed([](auto& o) { o.backoff_factor = 0.25; }),
       "backoff_factor 0.25, this scaler has backoff_factor 0.5"},
      {changed([](auto& o) { o.growth_interval = 20; }),
       "growth_interval 20, this scaler has growth_interval 10"},
      {changed([](auto& o) { o.hysteresis = 3; }), "saved with hysteresis 3, this scaler has hysteresis 2"}};
  DynamicLossScaler scaler(base);
  scaler.update(true);
  const std::map<std::string, std::string> before = scaler.state_dict();
  for (const auto& [options, expected] : saved_under)
    EXPECT_ERROR_MENTIONS(scaler.load_state_dict(DynamicLossScaler(options).state_dict()),
                          "DynamicLossScaler.load_state_dict", expected);
  EXPECT_EQ(scaler.state_dict(), before);
  // The naive (Megatron / Colossal-AI) rule and Apex's share the type name, not the rule.
  DynamicLossScaler apex = apex_dynamic_scaler();
  EXPECT_ERROR_MENTIONS(apex.load_state_dict(DynamicLossScaler().state_dict()), "DynamicLossScaler",
                        "saved with min_scale 1, this scaler has min_scale none (Apex's min_loss_scale "
                        "None)");
  EXPECT_ERROR_MENTIONS(DynamicLossScaler().load_state_dict(apex.state_dict()),
                        "saved with min_scale none (Apex's min_loss_scale None), this scaler has "
                        "min_scale 1");
  scaler.load_state_dict(DynamicLossScaler(base).state_dict());  // the same rule loads
  EXPECT_EQ(scaler.hysteresis_tracker(), 2);
}

TEST(DynamicLossScaler, LoadsAStateWrittenBeforeTheRuleEntries) {
  // That format holds type, scale and the two trackers, and its hysteresis tracker counted on below 0.
  DynamicLossScaler scaler({.initial_scale = 64, .min_scale = 1, .max_scale = 512, .growth_interval = 3});
  scaler.load_state_dict({{"type", "DynamicLossScaler"}, {"scale", "16"}, {"growth_tracker", "1"},
                          {"hysteresis_tracker", "-3"}});
  EXPECT_EQ(scaler.scale(), 16.0);
  EXPECT_EQ(scaler.growth_tracker(), 1);
  EXPECT_EQ(scaler.hysteresis_tracker(), 0);
  // h <= 0 backs off at the next overflow: O: g=0 -> 8 | C: g=1 8 | C: g=2 8 | C: g=3 -> 16, h=2 |
  // O: h=1 -> 16 (the refill absorbs it).
  EXPECT_EQ(run_pattern(scaler, "OCCCO"), (std::vector<double>{8, 8, 8, 16, 16}));
  // Part of the rule is no format: the rest is missing.
  auto partial = DynamicLossScaler().state_dict();
  partial.erase("hysteresis");
  EXPECT_ERROR_MENTIONS(DynamicLossScaler().load_state_dict(partial), "DynamicLossScaler.load_state_dict",
                        "missing entry 'hysteresis'");
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
  EXPECT_ERROR_MENTIONS(DynamicLossScaler(O{.initial_scale = 0.5, .min_scale = 1}), "initial_scale 0.5",
                        "[min_scale 1, max_scale 4294967296]");
  EXPECT_ERROR_MENTIONS(DynamicLossScaler(O{.growth_factor = 1}), "growth_factor", "1");
  EXPECT_ERROR_MENTIONS(DynamicLossScaler(O{.backoff_factor = 1}), "backoff_factor", "1");
  EXPECT_ERROR_MENTIONS(DynamicLossScaler(O{.backoff_factor = -0.5}), "backoff_factor", "-0.5");
  EXPECT_ERROR_MENTIONS(DynamicLossScaler(O{.growth_interval = 0}), "growth_interval", "0");
  EXPECT_ERROR_MENTIONS(DynamicLossScaler(O{.hysteresis = 0}), "hysteresis", "0");
}

TEST(DynamicLossScaler, RejectsNonFiniteValuesOfEveryOption) {
  using O = DynamicLossScalerOptions;
  for (double bad : {kInf, kNaN}) {
    const std::string text = std::isnan(bad) ? "nan" : "inf";
    EXPECT_ERROR_MENTIONS(DynamicLossScaler(O{.max_scale = bad}), "DynamicLossScaler: max_scale " + text,
                          "finite");
    EXPECT_ERROR_MENTIONS(DynamicLossScaler(O{.min_scale = bad}), "min_scale " + text);
    EXPECT_ERROR_MENTIONS(DynamicLossScaler(O{.initial_scale = bad}), "initial_scale " + text);
    EXPECT_ERROR_MENTIONS(DynamicLossScaler(O{.growth_factor = bad}), "growth_factor", "got " + text);
    EXPECT_ERROR_MENTIONS(DynamicLossScaler(O{.backoff_factor = bad}), "backoff_factor", "got " + text);
  }
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

TEST(ApexDynamicScaler, StartsAtInitScaleClampedToMaxLossScale) {
  // Apex LossScaler.__init__: self._loss_scale = min(max_loss_scale, init_scale).
  DynamicLossScaler scaler = apex_dynamic_scaler(1048576, 2, std::nullopt, 65536);
  EXPECT_EQ(scaler.scale(), 65536.0);
  EXPECT_EQ(run_pattern(scaler, "CCO"), (std::vector<double>{65536, 65536, 32768}));  // min(2^17, 2^16)
}

TEST(ApexDynamicScaler, MayStartBelowMinLossScaleWhichFloorsOnlyTheBackoff) {
  // init 2^16, window 2, min 2^20, max 2^24: Apex starts at 2^16, below its floor.
  //  O: max(2^16 / 2, 2^20) = 2^20   C: u=1 2^20   C: u=2 -> 2^21.
  DynamicLossScaler overflow_first = apex_dynamic_scaler(65536, 2, 1048576.0);
  EXPECT_EQ(overflow_first.scale(), 65536.0);
  EXPECT_EQ(run_pattern(overflow_first, "OCC"), (std::vector<double>{1048576, 1048576, 2097152}));
  //  C: u=1 2^16   C: u=2 -> 2^17   O: max(2^17 / 2, 2^20) = 2^20.
  DynamicLossScaler growth_first = apex_dynamic_scaler(65536, 2, 1048576.0);
  EXPECT_EQ(run_pattern(growth_first, "CCO"), (std::vector<double>{65536, 131072, 1048576}));
  // A state saved while still below the floor loads back (a checkpoint before the first overflow).
  DynamicLossScaler saved = apex_dynamic_scaler(65536, 2, 1048576.0);
  saved.update(false);
  growth_first.load_state_dict(saved.state_dict());
  EXPECT_EQ(growth_first.scale(), 65536.0);
  EXPECT_EQ(growth_first.growth_tracker(), 1);
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
  EXPECT_ERROR_MENTIONS(apex_dynamic_scaler(16, 2, 32.0, 8.0), "apex_dynamic_scaler", "min_loss_scale 32",
                        "max_loss_scale 8");
  EXPECT_ERROR_MENTIONS(apex_dynamic_scaler(16, 2, 4.0, kInf), "apex_dynamic_scaler", "max_loss_scale",
                        "inf");
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

TEST(StaticLossScaler, LoadStateDictOnlyConfirmsTheConfiguredScale) {
  // The scale is configuration, like Megatron's ConstantGradScaler's: a state saved under another one is
  // another configuration, not something to load.
  StaticLossScaler a(0.125), b(4);
  EXPECT_ERROR_MENTIONS(b.load_state_dict(a.state_dict()), "StaticLossScaler.load_state_dict",
                        "saved with scale 0.125", "this scaler has scale 4");
  EXPECT_EQ(b.scale(), 4.0);
  b.load_state_dict(StaticLossScaler(4).state_dict());
  EXPECT_EQ(b.scale(), 4.0);
}

TEST(StaticLossScaler, RejectsAnInvalidScale) {
  EXPECT_ERROR_MENTIONS(StaticLossScaler(0), "StaticLossScaler", "scale", "0");
  EXPECT_ERROR_MENTIONS(StaticLossScaler(-kInf), "scale", "-inf");
  // Beyond fp32, where the loss is multiplied by it (FLT_MAX itself is fine).
  EXPECT_ERROR_MENTIONS(StaticLossScaler(1e39), "StaticLossScaler: scale 1e+39 is not a usable loss scale");
  EXPECT_EQ(StaticLossScaler(3.4028234663852886e38).scale(), 3.4028234663852886e38);
  EXPECT_ERROR_MENTIONS(apex_dynamic_scaler(16, 2, std::nullopt, 1e300), "max_loss_scale 1e+300",
                        "is not a usable loss scale");
}

TEST(LossScaler, LoadStateDictRejectsUnknownEntries) {
  // "_growth_tracker" is PyTorch's spelling, not ours.
  const GradScaler grad;
  EXPECT_ERROR_MENTIONS(GradScaler().load_state_dict(with_entry(grad.state_dict(), "_growth_tracker", "0")),
                        "GradScaler.load_state_dict", "unknown entry '_growth_tracker'",
                        "expected only type, scale");
  EXPECT_ERROR_MENTIONS(
      DynamicLossScaler().load_state_dict(with_entry(DynamicLossScaler().state_dict(), "max_scale_", "1")),
      "DynamicLossScaler.load_state_dict", "unknown entry 'max_scale_'");
  StaticLossScaler fixed(2);
  EXPECT_ERROR_MENTIONS(fixed.load_state_dict(with_entry(fixed.state_dict(), "loss_scale", "2")),
                        "StaticLossScaler.load_state_dict", "unknown entry 'loss_scale'",
                        "expected only type, scale");
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

// ---- the usable loss scales ----
// The loss is multiplied by S and the gradients by 1/S in fp32. The smallest S whose fp32 reciprocal is
// finite: 2^-128 is a (subnormal) float but 1/2^-128 = 2^128 is beyond fp32; the next float up,
// 2^-128 + 2^-149, has 1/S = 2^128 / (1 + 2^-21) < FLT_MAX. The largest S: FLT_MAX (2^128 - 2^104).
const float kSmallestUsable = std::nextafter(std::ldexp(1.0f, -128), 1.0f);
const double kLowest = kSmallestUsable;                                    // 2.938737278354183e-39
const double kBelowLowest = std::nextafter(kSmallestUsable, 0.0f);         // 2^-128 = 2.938735877055719e-39
const double kFltMax = std::numeric_limits<float>::max();                  // 3.4028234663852886e+38
const double kFirstAboveFp32 = std::ldexp(1.0, 128) - std::ldexp(1.0, 103);  // rounds to inf in fp32

TEST(LossScaleBounds, AreTheSmallestFloatWithAFiniteFp32ReciprocalAndFltMax) {
  volatile float one = 1.0f;  // the divisions below in fp32 at run time
  EXPECT_TRUE(std::isinf(one / std::ldexp(1.0f, -128)));
  EXPECT_TRUE(std::isfinite(one / kSmallestUsable));
  EXPECT_EQ(kLowest, std::ldexp(1.0, -128) + std::ldexp(1.0, -149));
  EXPECT_EQ(kMinLossScale, kLowest);
  EXPECT_EQ(kMaxLossScale, kFltMax);
  EXPECT_EQ(kBelowLowest, 2.938735877055719e-39);  // the literal the messages below show
  EXPECT_EQ(kLowest, 2.938737278354183e-39);
}

// The message every refused scale gets, after "<who>: <what> <value>".
const std::vector<std::string> kUnusable = {"is not a usable loss scale", ">= 2.938737278354183e-39",
                                            "<= 3.4028234663852886e+38"};

template <class... Parts>
std::vector<std::string> mentions(const Parts&... parts) {
  std::vector<std::string> all = {parts...};
  all.insert(all.end(), kUnusable.begin(), kUnusable.end());
  return all;
}

TEST(GradScaler, InitScaleAndNewScaleAreUsableLossScales) {
  EXPECT_EQ(GradScaler({.init_scale = kLowest}).scale(), kLowest);
  EXPECT_EQ(GradScaler({.init_scale = kFltMax}).scale(), kFltMax);
  EXPECT_ERROR_MENTIONS_ALL(GradScaler({.init_scale = kBelowLowest}),
                            mentions("GradScaler: init_scale 2.938735877055719e-39"));
  EXPECT_ERROR_MENTIONS_ALL(GradScaler({.init_scale = 1e-45}), mentions("GradScaler: init_scale 1e-45"));
  EXPECT_ERROR_MENTIONS_ALL(GradScaler({.init_scale = kFirstAboveFp32}),
                            mentions("GradScaler: init_scale 3.4028235677973366e+38"));
  GradScaler scaler;
  scaler.update(kLowest);
  EXPECT_EQ(scaler.scale(), kLowest);
  EXPECT_ERROR_MENTIONS_ALL(scaler.update(kBelowLowest),
                            mentions("GradScaler.update: new_scale 2.938735877055719e-39"));
  EXPECT_EQ(scaler.scale(), kLowest);
}

TEST(DynamicLossScaler, EveryScaleOptionIsAUsableLossScale) {
  const DynamicLossScaler lowest({.initial_scale = kLowest, .min_scale = kLowest, .max_scale = kLowest});
  EXPECT_EQ(lowest.scale(), kLowest);
  EXPECT_EQ(DynamicLossScaler({.initial_scale = kFltMax, .max_scale = kFltMax}).scale(), kFltMax);
  EXPECT_ERROR_MENTIONS_ALL(
      DynamicLossScaler({.initial_scale = kBelowLowest, .min_scale = kLowest, .max_scale = kLowest}),
      mentions("DynamicLossScaler: initial_scale 2.938735877055719e-39"));
  EXPECT_ERROR_MENTIONS_ALL(DynamicLossScaler({.min_scale = kBelowLowest}),
                            mentions("DynamicLossScaler: min_scale 2.938735877055719e-39"));
  EXPECT_ERROR_MENTIONS_ALL(DynamicLossScaler({.initial_scale = kLowest, .min_scale = kLowest,
                                               .max_scale = kBelowLowest}),
                            mentions("DynamicLossScaler: max_scale 2.938735877055719e-39"));
  EXPECT_ERROR_MENTIONS_ALL(DynamicLossScaler({.max_scale = kFirstAboveFp32}),
                            mentions("DynamicLossScaler: max_scale 3.4028235677973366e+38"));
}

TEST(StaticLossScaler, TheScaleIsAUsableLossScale) {
  EXPECT_EQ(StaticLossScaler(kLowest).scale(), kLowest);
  EXPECT_ERROR_MENTIONS_ALL(StaticLossScaler{kBelowLowest},
                            mentions("StaticLossScaler: scale 2.938735877055719e-39"));
  EXPECT_ERROR_MENTIONS_ALL(StaticLossScaler{1e-45}, mentions("StaticLossScaler: scale 1e-45"));
}

TEST(ApexDynamicScaler, TheGivenBoundsAreUsableLossScalesAndNoFloorStaysAllowed) {
  EXPECT_EQ(apex_dynamic_scaler(16, 2, kLowest, 1024).options().min_scale, kLowest);
  EXPECT_EQ(apex_dynamic_scaler(kLowest, 2, std::nullopt, kLowest).scale(), kLowest);
  EXPECT_ERROR_MENTIONS_ALL(apex_dynamic_scaler(16, 2, kBelowLowest, 1024),
                            mentions("apex_dynamic_scaler: min_loss_scale 2.938735877055719e-39"));
  EXPECT_ERROR_MENTIONS_ALL(apex_dynamic_scaler(16, 2, std::nullopt, kBelowLowest),
                            mentions("apex_dynamic_scaler: max_loss_scale 2.938735877055719e-39"));
}

// A saved scale is held to the same bounds where it is read; the entry is named as the caller's prefix says
// (a checkpoint's metadata holds it as "scaler.<k>.scale").
TEST(LossScaler, ASavedScaleIsAUsableLossScaleNamedByItsEntry) {
  GradScaler grad_scaler;
  State saved = GradScaler().state_dict();
  grad_scaler.load_state_dict(with_entry(saved, "scale", "2.938737278354183e-39"));
  EXPECT_EQ(grad_scaler.scale(), kLowest);
  EXPECT_ERROR_MENTIONS_ALL(grad_scaler.load_state_dict(with_entry(saved, "scale", "2.938735877055719e-39")),
                            mentions("GradScaler.load_state_dict: entry 'scale' 2.938735877055719e-39"));
  EXPECT_ERROR_MENTIONS_ALL(
      grad_scaler.load_state_dict(with_entry(saved, "scale", "1e-45"), "scaler.0."),
      mentions("GradScaler.load_state_dict: entry 'scaler.0.scale' 1e-45"));
  EXPECT_EQ(grad_scaler.scale(), kLowest);

  // Apex's rule has no floor (min_loss_scale None), so only the usable range bounds the saved scale.
  DynamicLossScaler apex = apex_dynamic_scaler();
  saved = apex.state_dict();
  apex.load_state_dict(with_entry(saved, "scale", "2.938737278354183e-39"));
  EXPECT_EQ(apex.scale(), kLowest);
  EXPECT_ERROR_MENTIONS_ALL(
      apex.load_state_dict(with_entry(saved, "scale", "2.938735877055719e-39"), "scaler.2."),
      mentions("DynamicLossScaler.load_state_dict: entry 'scaler.2.scale' 2.938735877055719e-39"));
  EXPECT_ERROR_MENTIONS(apex.load_state_dict(with_entry(saved, "scale", "x"), "scaler.2."),
                        "entry 'scaler.2.scale' is \"x\", expected a number");
  EXPECT_EQ(apex.scale(), kLowest);
}

}  // namespace
}  // namespace mixtape
