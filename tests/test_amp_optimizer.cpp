// MixedPrecisionOptimizer (amp/optimizer.h): fp32 master weights for 16-bit parameters, unscaling and
// overflow skipping with one scaler per loss, clipping and zero counting on the unscaled gradients, the
// process-group hook, and a bit-exact resume through state_dict.
//
// Gradients are made exact where possible: a loss sum(p * c) has the gradient c, and with a power-of-two
// loss scale S both c * S (in fp16) and the unscale by 1/S are exact, so expected values are computed in
// plain double from c without going through the code under test.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "amp/optimizer.h"
#include "amp/scaler.h"
#include "autograd/autograd.h"
#include "optim/adam.h"
#include "optim/clip.h"
#include "optim/sgd.h"
#include "tensor/autograd_node.h"
#include "tensor/ops.h"
#include "test_util.h"

namespace mixtape {
namespace {

using testing::round_to;

constexpr double kInf = std::numeric_limits<double>::infinity();

Tensor leaf(const std::vector<double>& values, DType dtype) {
  Tensor p = Tensor::from_vector(values, {static_cast<int64_t>(values.size())}, dtype);
  p.requires_grad_();
  return p;
}

Tensor constant(const std::vector<double>& values, DType dtype) {
  return Tensor::from_vector(values, {static_cast<int64_t>(values.size())}, dtype);
}

// sum(p * c): its gradient with respect to p is exactly c.
Tensor linear_loss(const Tensor& p, const std::vector<double>& c) {
  return sum(mul(p, constant(c, p.dtype()))).to(DType::F32);
}

std::vector<double> values(const Tensor& t) { return t.detach().to_vector<double>(); }

std::vector<std::unique_ptr<LossScaler>> scalers(std::unique_ptr<LossScaler> a,
                                                 std::unique_ptr<LossScaler> b) {
  std::vector<std::unique_ptr<LossScaler>> list;
  list.push_back(std::move(a));
  list.push_back(std::move(b));
  return list;
}

std::unique_ptr<LossScaler> static_scaler(double scale) { return std::make_unique<StaticLossScaler>(scale); }
std::unique_ptr<LossScaler> apex_scaler(double scale) {
  return std::make_unique<DynamicLossScaler>(apex_dynamic_scaler(scale));
}

// Bit-exact comparison of two state dicts (tensor values compared as doubles: f32/f16/bf16 -> f64 is exact).
void expect_same_state(const StateDict& a, const StateDict& b) {
  EXPECT_EQ(a.metadata, b.metadata);
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (const auto& [key, tensor] : a.tensors) {
    ASSERT_TRUE(b.tensors.count(key)) << key;
    EXPECT_EQ(tensor.dtype(), b.tensors.at(key).dtype()) << key;
    EXPECT_EQ(values(tensor), values(b.tensors.at(key))) << key;
  }
}

// ------------------------------------------------------------------------------------------ master weights

// Every update lr * g ~ 1e-4 is below half the spacing of the 16-bit numbers just under 1.0 (fp16: 2^-12 ~
// 2.4e-4, bf16: 2^-9 ~ 2e-3), so a 16-bit parameter stepped directly never moves, while the fp32 master
// accumulates the updates and its rounding moves the 16-bit parameter once the sum passes half an ulp.
TEST(MasterWeights, Fp16ParameterWithoutMastersDoesNotMoveWithMastersItDoes) {
  constexpr int kSteps = 60;
  constexpr double kLr = 1e-3;
  for (DType dtype : {DType::F16, DType::BF16}) {
    const std::vector<double> c = {0.1, 0.1, 0.1};
    const double g = round_to(dtype, 0.1);  // the model gradient in the 16-bit dtype (S = 1024 exact)

    Tensor plain = leaf({1, 1, 1}, dtype);  // plain SGD on the 16-bit parameter
    SGD sgd({plain}, kLr);
    Tensor no_master = leaf({1, 1, 1}, dtype);
    MixedPrecisionOptions off;
    off.master_weights = false;
    MixedPrecisionOptimizer without(std::make_unique<SGD>(std::vector<Tensor>{no_master}, kLr),
                                    static_scaler(1024), off);
    Tensor with_master = leaf({1, 1, 1}, dtype);
    MixedPrecisionOptimizer with(std::make_unique<SGD>(std::vector<Tensor>{with_master}, kLr),
                                 static_scaler(1024));
    ASSERT_FALSE(with.master_params()[0].same(with_master));
    EXPECT_EQ(with.master_params()[0].dtype(), DType::F32);
    EXPECT_TRUE(without.master_params()[0].same(no_master));

    for (int step = 0; step < kSteps; ++step) {
      sgd.zero_grad();
      backward(linear_loss(plain, c));
      sgd.step();
      without.zero_grad();
      without.backward(linear_loss(no_master, c));
      EXPECT_FALSE(without.step().skipped);
      with.zero_grad();
      with.backward(linear_loss(with_master, c));
      EXPECT_FALSE(with.step().skipped);
    }
    const std::string name = dtype_name(dtype);
    EXPECT_EQ(values(plain), std::vector<double>(3, 1.0)) << name;
    EXPECT_EQ(values(no_master), std::vector<double>(3, 1.0)) << name;

    // The master: kSteps fp32 updates of lr * g each; every one rounds by at most half an fp32 ulp at ~1
    // (2^-24) in the product and in the subtraction, hence the bound 2 * kSteps * 2^-24.
    const double exact = 1.0 - kSteps * kLr * g;
    const Tensor master = with.master_params()[0];
    for (double m : values(master)) EXPECT_NEAR(m, exact, 2 * kSteps * std::ldexp(1.0, -24)) << name;
    for (double m : values(master)) EXPECT_LT(m, 1.0 - kSteps * kLr * g * 0.99) << name;
    // The model parameter is the master rounded once to its dtype, and it did move.
    const std::vector<double> model = values(with_master), masters = values(master);
    for (size_t i = 0; i < model.size(); ++i) {
      EXPECT_EQ(model[i], round_to(dtype, masters[i])) << name;
      EXPECT_LT(model[i], 1.0) << name;
    }
  }
}

TEST(MasterWeights, ModelParameterStaysTheSameLeafAndItsVersionIsBumped) {
  Tensor p = leaf({1, 2}, DType::F16);
  MixedPrecisionOptimizer opt(std::make_unique<SGD>(std::vector<Tensor>{p}, 0.5), static_scaler(1));
  const uint64_t version = p.version();
  opt.backward(linear_loss(p, {1, 1}));
  opt.step();
  EXPECT_TRUE(opt.model_params()[0].same(p));
  EXPECT_TRUE(p.is_leaf());
  EXPECT_GT(p.version(), version);
  EXPECT_EQ(values(p), (std::vector<double>{0.5, 1.5}));
  EXPECT_FALSE(p.grad().defined()) << "16-bit model gradients are dropped once folded into the masters";
}

// ---------------------------------------------------------------------------------------------- skipping

// Megatron's DynamicGradScaler with hysteresis 2: the first overflow only uses up the hysteresis (S stays),
// every further one halves S. Nothing else moves on a skipped step.
TEST(MixedPrecisionSkippedStep, LeavesParametersMastersAndAdamStateBitExactAndBacksOffTheScaler) {
  Tensor w = leaf({0.5, -1.25, 2.0}, DType::F16);
  Tensor b = leaf({0.75, 0.125}, DType::F32);
  DynamicLossScalerOptions scaler_options;
  scaler_options.initial_scale = 1024;  // 2^16 would itself overflow the fp16 backward (fp16 max 65504)
  scaler_options.hysteresis = 2;
  MixedPrecisionOptimizer opt(std::make_unique<Adam>(std::vector<Tensor>{w, b}, 1e-2),
                              std::make_unique<DynamicLossScaler>(scaler_options));
  auto loss = [&] { return add(linear_loss(w, {0.25, 0.5, -0.75}), linear_loss(b, {1.5, -2})); };
  for (int step = 0; step < 2; ++step) {
    opt.zero_grad();
    opt.backward(loss());
    ASSERT_FALSE(opt.step().skipped);
  }
  const StateDict before = opt.state_dict();
  const std::vector<double> w_before = values(w), b_before = values(b),
                            master_before = values(opt.master_params()[0]);

  std::vector<double> used_scales;
  for (int skip = 0; skip < 3; ++skip) {
    opt.zero_grad();
    opt.backward(loss());
    // An overflow in one element of one gradient (the scaled fp16 gradient of w).
    w.set_grad(constant({1, kInf, 1}, DType::F16));
    const StepResult result = opt.step();
    EXPECT_TRUE(result.skipped);
    EXPECT_EQ(result.grad_norm, 0);
    used_scales.push_back(result.loss_scale);
    EXPECT_EQ(values(w), w_before);
    EXPECT_EQ(values(b), b_before);
    EXPECT_EQ(values(opt.master_params()[0]), master_before);
    EXPECT_FALSE(w.grad().defined());
    EXPECT_FALSE(b.grad().defined());
    EXPECT_FALSE(opt.master_params()[0].grad().defined());
  }
  EXPECT_EQ(used_scales, (std::vector<double>{1024, 1024, 512}));
  EXPECT_EQ(opt.loss_scale(), 256);
  EXPECT_EQ(opt.skipped_steps(), 3);
  const ParamState* state = opt.optimizer().state(opt.master_params()[0]);
  ASSERT_NE(state, nullptr);
  EXPECT_EQ(state->step, 2);
  // The whole wrapped-optimizer state (exp_avg, exp_avg_sq, step counts) and the masters are bit-identical;
  // only the scaler entries and the skip count differ.
  StateDict after = opt.state_dict();
  StateDict expected = before;
  for (const char* key :
       {"amp.skipped_steps", "scaler.0.scale", "scaler.0.growth_tracker", "scaler.0.hysteresis_tracker"}) {
    expected.metadata.erase(key);
    after.metadata.erase(key);
  }
  expect_same_state(after, expected);

  // A clean step afterwards updates again.
  opt.zero_grad();
  opt.backward(loss());
  const StepResult clean = opt.step();
  EXPECT_FALSE(clean.skipped);
  EXPECT_EQ(clean.loss_scale, 256);
  EXPECT_NE(values(w), w_before);
  EXPECT_EQ(opt.optimizer().state(opt.master_params()[0])->step, 3);
}

// ----------------------------------------------------------------------------------------------- unscale

TEST(MixedPrecisionUnscale, AScaleTooSmallToUnscaleInFp32IsAnErrorSayingTheRunDiverged) {
  // S = 2^-130: 1/S = 2^130 is beyond fp32, where f32/f16/bf16 gradients are unscaled. PyTorch unscales by
  // inf and skips every step from there on without a word; a scaler only gets there after backing off at
  // step after step of overflows, so this is an error that says the run diverged. Nothing changes.
  for (DType dtype : {DType::F32, DType::F16}) {
    Tensor p = leaf({1, 1}, dtype);
    // Apex's rule without a floor, backed off from 2^-126 by four overflows (no option may set such a scale).
    auto scaler = std::make_unique<DynamicLossScaler>(apex_dynamic_scaler(0x1p-126));
    for (int i = 0; i < 4; ++i) scaler->update(true);
    MixedPrecisionOptimizer opt(std::make_unique<SGD>(std::vector<Tensor>{p}, 0.1), std::move(scaler));
    opt.backward(linear_loss(p, {1, 1}));
    EXPECT_ERROR_MENTIONS(opt.step(), "the loss scale 7.346839692639297e-40", "2^-128 or below", "diverged");
    EXPECT_EQ(values(p), (std::vector<double>{1, 1}));
  }
}

TEST(MixedPrecisionUnscale, MasterGradientsAreModelGradientsDividedByTheScale) {
  constexpr double kScale = 1024;
  Tensor h = leaf({0.5, -1, 2, 0.25}, DType::F16);
  Tensor f = leaf({1, 2, 3}, DType::F32);
  Tensor d = leaf({1, 2}, DType::F64);
  MixedPrecisionOptimizer opt(std::make_unique<SGD>(std::vector<Tensor>{h, f, d}, 0.0),
                              static_scaler(kScale));
  const Tensor loss = add(add(linear_loss(h, {0.1, -3.3, 1e-3, 7}), linear_loss(f, {0.3, -1e-5, 2.5})),
                          linear_loss(d, {0.7, -0.9}));
  backward(opt.scale_loss(loss));  // the caller runs backward itself
  const std::vector<double> gh = values(h.grad()), gf = values(f.grad()), gd = values(d.grad());
  EXPECT_EQ(h.grad().dtype(), DType::F16);
  // The model gradients carry the scale.
  EXPECT_EQ(gh[3], round_to(DType::F16, 7.0) * kScale);
  ASSERT_FALSE(opt.step().skipped);

  const Tensor mh = opt.master_params()[0];
  ASSERT_EQ(mh.grad().dtype(), DType::F32);
  const std::vector<double> master_h = values(mh.grad());
  for (size_t i = 0; i < gh.size(); ++i) EXPECT_EQ(master_h[i], round_to(DType::F32, gh[i] / kScale)) << i;
  ASSERT_TRUE(opt.master_params()[1].same(f));
  ASSERT_EQ(f.grad().dtype(), DType::F32);
  const std::vector<double> master_f = values(f.grad());
  for (size_t i = 0; i < gf.size(); ++i) EXPECT_EQ(master_f[i], round_to(DType::F32, gf[i] / kScale)) << i;
  ASSERT_EQ(d.grad().dtype(), DType::F64);
  const std::vector<double> master_d = values(d.grad());
  for (size_t i = 0; i < gd.size(); ++i) EXPECT_EQ(master_d[i], gd[i] / kScale) << i;
  EXPECT_EQ(master_f[1], round_to(DType::F32, -1e-5));  // scaled and unscaled by a power of two: exact
  EXPECT_FALSE(h.grad().defined());
}

// ------------------------------------------------------------------------------------------------ clipping

// The wrapper must clip the unscaled gradients exactly as clip_grad_norm clips an fp32 model holding them.
TEST(MixedPrecisionClipGrad, ReportsTheUnscaledNormAndClipsLikeClipGradNormOnAnFp32Reference) {
  const std::vector<double> w0 = {0.5, -1.5, 2.25}, b0 = {0.125, 4};
  const std::vector<double> gw = {3, -4, 0.5}, gb = {1.25, -2};  // fp16-exact, so gw * 1024 is too
  Tensor w = leaf(w0, DType::F16), b = leaf(b0, DType::F32);
  MixedPrecisionOptions options;
  options.clip_grad = 0.5;
  MixedPrecisionOptimizer opt(std::make_unique<SGD>(std::vector<Tensor>{w, b}, 0.1), static_scaler(1024),
                              options);
  Tensor rw = leaf(w0, DType::F32), rb = leaf(b0, DType::F32);
  SGD reference({rw, rb}, 0.1);

  opt.scale_loss(Tensor::scalar(0));  // the caller provides the scaled gradients itself
  w.set_grad(constant({3 * 1024., -4 * 1024., 0.5 * 1024.}, DType::F16));
  b.set_grad(constant({1.25 * 1024, -2 * 1024.}, DType::F32));
  rw.set_grad(constant(gw, DType::F32));
  rb.set_grad(constant(gb, DType::F32));
  const double expected_norm = clip_grad_norm({rw, rb}, 0.5);
  reference.step();

  const StepResult result = opt.step();
  ASSERT_FALSE(result.skipped);
  EXPECT_EQ(result.grad_norm, expected_norm);
  EXPECT_NEAR(result.grad_norm, std::sqrt(9 + 16 + 0.25 + 1.5625 + 4), 1e-12);
  EXPECT_EQ(values(opt.master_params()[0].grad()), values(rw.grad()));
  EXPECT_EQ(values(b.grad()), values(rb.grad()));
  EXPECT_EQ(values(opt.master_params()[0]), values(rw));
  EXPECT_EQ(values(b), values(rb));
  const std::vector<double> model = values(w), master = values(rw);
  for (size_t i = 0; i < model.size(); ++i) EXPECT_EQ(model[i], round_to(DType::F16, master[i]));
}

TEST(MixedPrecisionNumZeros, CountsZeroElementsOfTheUnscaledGradientsOnlyWhenAsked) {
  for (bool log : {false, true}) {
    Tensor w = leaf({1, 2, 3, 4}, DType::F16), b = leaf({1, 2, 3}, DType::F32),
           unused = leaf({5}, DType::F32);
    MixedPrecisionOptions options;
    options.log_num_zeros_in_grad = log;
    MixedPrecisionOptimizer opt(std::make_unique<SGD>(std::vector<Tensor>{w, b, unused}, 0.1),
                                static_scaler(8), options);
    opt.backward(add(linear_loss(w, {0, 1, 0, 0}), linear_loss(b, {2, 0, 1})));
    const StepResult result = opt.step();
    EXPECT_EQ(result.num_zeros, log ? 4 : -1);
  }
}

// ----------------------------------------------------------------------------------------- process groups

// Stands in for the other ranks of a group: records what it is asked to reduce and answers as if another
// rank overflowed (max_result 1) or held the same squared norm and zero count (sum doubles).
class FakeGroup : public ProcessGroup {
 public:
  double max_result = 0;
  std::vector<std::vector<double>> max_calls, sum_calls;
  std::string name() const override { return "fake group of 2"; }
  int size() const override { return 2; }
  void all_reduce_max(std::span<double> values) override {
    max_calls.emplace_back(values.begin(), values.end());
    for (double& v : values) v = std::max(v, max_result);
  }
  void all_reduce_sum(std::span<double> values) override {
    sum_calls.emplace_back(values.begin(), values.end());
    for (double& v : values) v *= 2;
  }
  void all_reduce_sum(const Tensor&) override {}
};

TEST(MixedPrecisionProcessGroupHook, AnotherRanksOverflowSkipsTheStepAndBacksOffTheScaler) {
  Tensor w = leaf({1, 2}, DType::F16);
  FakeGroup group;
  group.max_result = 1;
  MixedPrecisionOptions options;
  options.group = &group;
  MixedPrecisionOptimizer opt(std::make_unique<SGD>(std::vector<Tensor>{w}, 0.1), apex_scaler(1024), options);
  opt.backward(linear_loss(w, {1, 1}));  // finite here
  const StepResult result = opt.step();
  EXPECT_TRUE(result.skipped);
  ASSERT_EQ(group.max_calls.size(), 1u);
  EXPECT_EQ(group.max_calls[0], (std::vector<double>{0, 1}));  // found no inf here; the loss was used
  EXPECT_EQ(values(w), (std::vector<double>{1, 2}));
  EXPECT_EQ(opt.loss_scale(), 512);
  EXPECT_EQ(opt.skipped_steps(), 1);
}

TEST(MixedPrecisionProcessGroupHook, TheNormAndTheZeroCountAreSummedOverTheGroup) {
  Tensor w = leaf({1, 2, 3}, DType::F16);
  FakeGroup group;
  MixedPrecisionOptions options;
  options.group = &group;
  options.clip_grad = 1.0;
  options.log_num_zeros_in_grad = true;
  MixedPrecisionOptimizer opt(std::make_unique<SGD>(std::vector<Tensor>{w}, 1.0), static_scaler(64), options);
  opt.backward(linear_loss(w, {3, 0, 4}));
  const StepResult result = opt.step();
  ASSERT_FALSE(result.skipped);
  // The local squared norm 25 and zero count 1, each doubled by the "other rank".
  ASSERT_EQ(group.sum_calls.size(), 2u);
  EXPECT_EQ(group.sum_calls[0], std::vector<double>{25});
  EXPECT_EQ(group.sum_calls[1], std::vector<double>{1});
  EXPECT_EQ(result.grad_norm, std::sqrt(50.0));
  EXPECT_EQ(result.num_zeros, 2);
  // Clipped with the group norm: g * 1 / (sqrt(50) + 1e-6), as clip_grads_with_norm does in f32.
  Tensor ref = leaf({0, 0, 0}, DType::F32);
  ref.set_grad(constant({3, 0, 4}, DType::F32));
  clip_grads_with_norm({ref}, 1.0, std::sqrt(50.0));
  EXPECT_EQ(values(opt.master_params()[0].grad()), values(ref.grad()));
}

TEST(MixedPrecisionProcessGroupHook, CountInNormLeavesReplicatedParametersOutOfTheNormButStillClipsThem) {
  // b stands for a parameter replicated on the other rank (a LayerNorm weight under tensor parallelism): this
  // rank leaves it out of the sum, so the group counts it once; it is still clipped and stepped.
  Tensor w = leaf({1, 2, 3}, DType::F16);
  Tensor b = leaf({5, 5}, DType::F32);
  FakeGroup group;
  MixedPrecisionOptions options;
  options.group = &group;
  options.clip_grad = 1.0;
  options.log_num_zeros_in_grad = true;
  options.count_in_norm = {true, false};
  MixedPrecisionOptimizer opt(std::make_unique<SGD>(std::vector<Tensor>{w, b}, 1.0), static_scaler(64), options);
  opt.backward(add(linear_loss(w, {3, 0, 4}), linear_loss(b, {0, 12})));
  const StepResult result = opt.step();
  ASSERT_FALSE(result.skipped);
  ASSERT_EQ(group.sum_calls.size(), 2u);
  EXPECT_EQ(group.sum_calls[0], std::vector<double>{25});  // b's 144 left out
  EXPECT_EQ(group.sum_calls[1], std::vector<double>{1});   // and b's zero too
  EXPECT_EQ(result.grad_norm, std::sqrt(50.0));
  Tensor ref = leaf({0, 0}, DType::F32);
  ref.set_grad(constant({0, 12}, DType::F32));
  clip_grads_with_norm({ref}, 1.0, std::sqrt(50.0));
  EXPECT_EQ(values(opt.master_params()[1].grad()), values(ref.grad()));

  options.count_in_norm = {true};
  EXPECT_ERROR_MENTIONS(MixedPrecisionOptimizer(std::make_unique<SGD>(std::vector<Tensor>{w, b}, 1.0),
                                                static_scaler(64), options),
                        "count_in_norm has 1 entries, expected one per parameter (2)");
}

// ---------------------------------------------------------------------------------------- several losses

TEST(MixedPrecisionSeveralLosses, GradientsOfTwoLossesAreUnscaledEachWithItsOwnScale) {
  Tensor w = leaf({1, 2, 3}, DType::F16);
  Tensor b = leaf({1, 1}, DType::F32);
  MixedPrecisionOptimizer opt(std::make_unique<SGD>(std::vector<Tensor>{w, b}, 0.0),
                              scalers(apex_scaler(1024), apex_scaler(8)));
  ASSERT_EQ(opt.num_losses(), 2);
  const std::vector<double> c1 = {0.1, -0.5, 3}, c2 = {0.3, 0.25, -7}, d1 = {1, 2}, d2 = {0.5, -0.5};
  opt.backward(add(linear_loss(w, c1), linear_loss(b, d1)), 0);
  opt.backward(add(linear_loss(w, c2), linear_loss(b, d2)), 1);
  ASSERT_FALSE(opt.step().skipped);
  // c * S rounds nowhere (fp16 values times a power of two), so each unscaled part is c rounded to fp16,
  // and their fp32 sum rounds once.
  const std::vector<double> gw = values(opt.master_params()[0].grad()), gb = values(b.grad());
  for (size_t i = 0; i < 3; ++i)
    EXPECT_EQ(gw[i], round_to(DType::F32, round_to(DType::F16, c1[i]) + round_to(DType::F16, c2[i]))) << i;
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(gb[i], d1[i] + d2[i]) << i;
}

TEST(MixedPrecisionSeveralLosses, AnOverflowInOneLossBacksOffOnlyItsScalerAndSkipsTheStep) {
  for (int bad : {0, 1}) {
    Tensor w = leaf({1, 2, 3}, DType::F16);
    MixedPrecisionOptimizer opt(std::make_unique<SGD>(std::vector<Tensor>{w}, 0.1),
                                scalers(apex_scaler(1024), apex_scaler(8)));
    opt.backward(linear_loss(w, {1, 1, 1}), 0);
    if (bad == 0) w.set_grad(constant({1, std::nan(""), 1}, DType::F16));
    opt.backward(linear_loss(w, {1, 1, 1}), 1);
    if (bad == 1) w.set_grad(constant({kInf, 1, 1}, DType::F16));
    EXPECT_TRUE(opt.step().skipped) << bad;
    EXPECT_EQ(values(w), (std::vector<double>{1, 2, 3}));
    EXPECT_EQ(opt.loss_scale(0), bad == 0 ? 512 : 1024) << bad;
    EXPECT_EQ(opt.loss_scale(1), bad == 1 ? 4 : 8) << bad;
    EXPECT_EQ(opt.skipped_steps(), 1);
  }
}

TEST(MixedPrecisionSeveralLosses, OnlyTheScalersOfLossesUsedInAStepAreUpdated) {
  // Growth after every clean step (interval 1, no hysteresis), so each update of a scaler shows in its scale.
  auto growing = [] {
    DynamicLossScalerOptions o;
    o.initial_scale = 8;
    o.max_scale = 1 << 20;
    o.growth_interval = 1;
    o.hysteresis = 1;
    return std::make_unique<DynamicLossScaler>(o);
  };
  Tensor w = leaf({1, 2, 3}, DType::F16);
  MixedPrecisionOptimizer opt(std::make_unique<SGD>(std::vector<Tensor>{w}, 0.0), scalers(growing(), growing()));
  // Step 1: only loss 0 -> S0 8 -> 16, S1 stays 8 (Apex updates a loss's scaler as it leaves scale_loss).
  opt.backward(linear_loss(w, {1, 1, 1}), 0);
  ASSERT_FALSE(opt.step().skipped);
  EXPECT_EQ(opt.loss_scale(0), 16);
  EXPECT_EQ(opt.loss_scale(1), 8);
  // Step 2: an overflow in loss 1 alone -> skipped; S1 8 -> 4 backs off, S0 (not used) stays 16.
  opt.zero_grad();
  opt.backward(linear_loss(w, {1, 1, 1}), 1);
  w.set_grad(constant({kInf, 1, 1}, DType::F16));
  EXPECT_TRUE(opt.step().skipped);
  EXPECT_EQ(opt.loss_scale(0), 16);
  EXPECT_EQ(opt.loss_scale(1), 4);
  // Step 3: both losses, clean -> both grow: 32 and 8.
  opt.zero_grad();
  opt.backward(linear_loss(w, {1, 1, 1}), 0);
  opt.backward(linear_loss(w, {1, 1, 1}), 1);
  ASSERT_FALSE(opt.step().skipped);
  EXPECT_EQ(opt.loss_scale(0), 32);
  EXPECT_EQ(opt.loss_scale(1), 8);
}

// ----------------------------------------------------------------------------------------------- parity

// fp32 parameters are their own masters and S = 1 unscales by exactly 1: the wrapper must be invisible.
TEST(MixedPrecisionEquivalence, Fp32ModelWithStaticScaleOneMatchesTheBareAdamBitForBit) {
  const std::vector<double> init = {0.3, -1.7, 2.2, 0.01};
  Tensor a = leaf(init, DType::F32), b = leaf(init, DType::F32);
  Adam bare({a}, 3e-2, 0.01);
  MixedPrecisionOptimizer wrapped(std::make_unique<Adam>(std::vector<Tensor>{b}, 3e-2, 0.01),
                                  static_scaler(1));
  auto loss = [](const Tensor& p) { return sum(mul(mul(p, p), constant({1, 2, 3, 4}, DType::F32))); };
  for (int step = 0; step < 5; ++step) {
    bare.zero_grad();
    backward(loss(a));
    bare.step();
    wrapped.zero_grad();
    wrapped.backward(loss(b));
    ASSERT_FALSE(wrapped.step().skipped);
    EXPECT_EQ(values(a), values(b)) << step;
  }
  EXPECT_NE(values(a), init);
}

// PyTorch's GradScaler rule with growth_interval 2: two clean steps double S, an overflow halves it and
// resets the tracker. Steps: C C O C C C use S = 2^16, 2^16, 2^17 (overflow -> 2^16), 2^16, 2^16, 2^17.
TEST(MixedPrecisionGradScalerInside, ScaleSequenceFollowsPyTorchsRuleAcrossAnOverflow) {
  Tensor w = leaf({1, 2}, DType::F32);
  GradScalerOptions scaler_options;
  scaler_options.growth_interval = 2;
  MixedPrecisionOptimizer opt(std::make_unique<SGD>(std::vector<Tensor>{w}, 0.01),
                              std::make_unique<GradScaler>(scaler_options));
  std::vector<double> used;
  const std::string pattern = "CCOCCC";
  for (char c : pattern) {
    opt.zero_grad();
    opt.backward(linear_loss(w, {0.5, 0.25}));
    if (c == 'O') w.set_grad(constant({kInf, 0}, DType::F32));
    const StepResult result = opt.step();
    EXPECT_EQ(result.skipped, c == 'O');
    used.push_back(result.loss_scale);
    if (c == 'C') {
      EXPECT_EQ(values(w.grad()), (std::vector<double>{0.5, 0.25}));
    }
  }
  EXPECT_EQ(used, (std::vector<double>{65536, 65536, 131072, 65536, 65536, 131072}));
  EXPECT_EQ(opt.loss_scale(), 131072);
  EXPECT_EQ(opt.skipped_steps(), 1);
}

// ------------------------------------------------------------------------------------------- state_dict

struct TrainingRun {
  Tensor w, b;
  std::unique_ptr<MixedPrecisionOptimizer> opt;
};

TrainingRun make_run(const std::vector<double>& w0, const std::vector<double>& b0) {
  TrainingRun run;
  run.w = leaf(w0, DType::F16);
  run.b = leaf(b0, DType::F32);
  DynamicLossScalerOptions scaler_options;
  scaler_options.initial_scale = 4096;
  scaler_options.growth_interval = 3;
  scaler_options.hysteresis = 2;
  run.opt = std::make_unique<MixedPrecisionOptimizer>(
      std::make_unique<Adam>(std::vector<Tensor>{run.w, run.b}, 5e-3, 0.01),
      std::make_unique<DynamicLossScaler>(scaler_options));
  return run;
}

// Step `step` of a deterministic training run: a loss whose gradients depend on the parameters, and an
// injected overflow at steps 2 and 6.
void train_step(TrainingRun& run, int step) {
  run.opt->zero_grad();
  const Tensor lw = sum(mul(mul(run.w, run.w), constant({1, -2, 0.5}, DType::F16))).to(DType::F32);
  const Tensor lb = sum(mul(run.b, constant({0.25 * step, -1}, DType::F32)));
  run.opt->backward(add(lw, lb));
  if (step == 2 || step == 6) run.w.set_grad(constant({1, kInf, 1}, DType::F16));
  run.opt->step();
}

TEST(MixedPrecisionStateDict, ResumedRunContinuesBitExactly) {
  const std::vector<double> w0 = {0.7, -0.3, 1.9}, b0 = {0.5, -0.25};
  TrainingRun whole = make_run(w0, b0);
  for (int step = 0; step < 9; ++step) train_step(whole, step);

  TrainingRun first = make_run(w0, b0);
  for (int step = 0; step < 4; ++step) train_step(first, step);
  const StateDict saved = first.opt->state_dict();
  EXPECT_TRUE(saved.tensors.count("master.0"));
  EXPECT_FALSE(saved.tensors.count("master.1"));  // b is its own master
  EXPECT_EQ(saved.metadata.at("amp.skipped_steps"), "1");
  EXPECT_EQ(saved.metadata.at("scaler.0.type"), "DynamicLossScaler");

  // A fresh process: the model comes back from its own checkpoint (fp16 values), then the optimizer.
  TrainingRun resumed = make_run(values(first.w), values(first.b));
  resumed.opt->load_state_dict(saved);
  EXPECT_EQ(values(resumed.opt->master_params()[0]), values(first.opt->master_params()[0]));
  EXPECT_EQ(resumed.opt->skipped_steps(), 1);
  EXPECT_EQ(resumed.opt->loss_scale(), first.opt->loss_scale());
  for (int step = 4; step < 9; ++step) train_step(resumed, step);

  EXPECT_EQ(values(resumed.w), values(whole.w));
  EXPECT_EQ(values(resumed.b), values(whole.b));
  EXPECT_EQ(values(resumed.opt->master_params()[0]), values(whole.opt->master_params()[0]));
  EXPECT_EQ(resumed.opt->skipped_steps(), 2);
  expect_same_state(resumed.opt->state_dict(), whole.opt->state_dict());
}

TEST(MixedPrecisionStateDict, BadDictsAreRejectedAndChangeNothing) {
  TrainingRun run = make_run({0.7, -0.3, 1.9}, {0.5, -0.25});
  for (int step = 0; step < 3; ++step) train_step(run, step);
  const StateDict good = run.opt->state_dict();

  TrainingRun target = make_run({1, 2, 3}, {4, 5});
  train_step(target, 0);
  const StateDict before = target.opt->state_dict();
  const std::vector<double> w_before = values(target.w);

  StateDict wrong_type = good;
  wrong_type.metadata["scaler.0.type"] = "StaticLossScaler";
  EXPECT_ERROR_MENTIONS(target.opt->load_state_dict(wrong_type), "MixedPrecisionOptimizer", "scaler.0.type",
                        "DynamicLossScaler");
  StateDict wrong_shape = good;
  wrong_shape.tensors["master.0"] = Tensor::zeros({4}, DType::F32);
  EXPECT_ERROR_MENTIONS(target.opt->load_state_dict(wrong_shape), "MixedPrecisionOptimizer", "master.0",
                        "f32[3]");
  StateDict wrong_dtype = good;
  wrong_dtype.tensors["master.0"] = Tensor::zeros({3}, DType::F16);
  EXPECT_ERROR_MENTIONS(target.opt->load_state_dict(wrong_dtype), "MixedPrecisionOptimizer", "master.0",
                        "f16");
  StateDict missing_master = good;
  missing_master.tensors.erase("master.0");
  EXPECT_ERROR_MENTIONS(target.opt->load_state_dict(missing_master), "MixedPrecisionOptimizer", "master.0");
  StateDict two_losses = good;
  two_losses.metadata["amp.num_losses"] = "2";
  EXPECT_ERROR_MENTIONS(target.opt->load_state_dict(two_losses), "MixedPrecisionOptimizer", "amp.num_losses");
  // Caught by the scaler after the wrapped optimizer loaded: rolled back.
  StateDict bad_scale = good;
  bad_scale.metadata["scaler.0.scale"] = "-1";
  EXPECT_ERROR_MENTIONS(target.opt->load_state_dict(bad_scale), "DynamicLossScaler", "scale");
  // Caught by the wrapped optimizer.
  StateDict bad_adam = good;
  bad_adam.tensors["state.1.exp_avg"] = Tensor::zeros({7}, DType::F32);
  EXPECT_ERROR_MENTIONS(target.opt->load_state_dict(bad_adam), "Adam", "state.1.exp_avg");

  expect_same_state(target.opt->state_dict(), before);
  EXPECT_EQ(values(target.w), w_before);
}

// ------------------------------------------------------------------------------------------- construction

TEST(MixedPrecisionConstruction, RejectsNoScalerANullScalerAndAnOptimizerThatAlreadyStepped) {
  Tensor w = leaf({1, 2}, DType::F16);
  EXPECT_ERROR_MENTIONS(MixedPrecisionOptimizer(std::make_unique<SGD>(std::vector<Tensor>{w}, 0.1),
                                                std::vector<std::unique_ptr<LossScaler>>{}),
                        "MixedPrecisionOptimizer", "at least one loss scaler");
  EXPECT_ERROR_MENTIONS(MixedPrecisionOptimizer(std::make_unique<SGD>(std::vector<Tensor>{w}, 0.1),
                                                std::unique_ptr<LossScaler>()),
                        "MixedPrecisionOptimizer", "null");
  EXPECT_ERROR_MENTIONS(MixedPrecisionOptimizer(nullptr, static_scaler(1)), "MixedPrecisionOptimizer",
                        "optimizer");

  Tensor f = leaf({1, 2}, DType::F32);
  auto stepped = std::make_unique<Adam>(std::vector<Tensor>{f}, 0.1);
  f.set_grad(constant({1, 1}, DType::F32));
  stepped->step();
  EXPECT_ERROR_MENTIONS(MixedPrecisionOptimizer(std::move(stepped), static_scaler(1)),
                        "MixedPrecisionOptimizer", "Adam", "not taken a step");

  MixedPrecisionOptimizer opt(std::make_unique<SGD>(std::vector<Tensor>{w}, 0.1), static_scaler(1));
  EXPECT_ERROR_MENTIONS(opt.scale_loss(Tensor::scalar(1), 1), "MixedPrecisionOptimizer", "loss_id 1",
                        "num_losses = 1");
}

TEST(MixedPrecisionConstruction, GradientsThatBypassedTheLossScaleAreRejected) {
  Tensor w = leaf({1, 2}, DType::F16);
  MixedPrecisionOptimizer opt(std::make_unique<SGD>(std::vector<Tensor>{w}, 0.1), static_scaler(1024));
  backward(linear_loss(w, {1, 1}));  // not through scale_loss: the scale of these gradients is unknown
  EXPECT_ERROR_MENTIONS(opt.step(), "MixedPrecisionOptimizer", "scale_loss");
}

}  // namespace
}  // namespace mixtape
