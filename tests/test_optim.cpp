// optim/: SGD, Adam and AdamW against hand-computed steps and against their published algorithms
// (PyTorch's documentation pseudocode) run in plain double; parameter groups, skipped parameters,
// zero_grad, 16-bit parameters, state_dict round trips that resume bit for bit, load errors; learning-rate
// schedules at their boundary steps; clip_grad_norm's value, scaling and non-finite handling.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <numbers>
#include <vector>

#include "autograd/autograd.h"
#include "optim/adam.h"
#include "optim/clip.h"
#include "optim/schedule.h"
#include "optim/sgd.h"
#include "tensor/ops.h"
#include "test_util.h"

using namespace mixtape;
using mixtape::testing::all_close;
using mixtape::testing::within_ulp;

namespace {

Tensor make_param(const std::vector<double>& values, DType dtype = DType::F64, Shape shape = {}) {
  if (shape.empty()) shape = {static_cast<int64_t>(values.size())};
  Tensor param = Tensor::from_vector(values, shape, dtype);
  param.requires_grad_();
  return param;
}

void give_grad(Tensor param, const std::vector<double>& grad) {
  param.set_grad(Tensor::from_vector(grad, param.shape(), param.dtype()));
}

std::vector<double> values(const Tensor& t) { return t.to_vector<double>(); }

Tensor as_f64(const std::vector<double>& v) {
  return Tensor::from_vector(v, {static_cast<int64_t>(v.size())});
}

// Deterministic test values of magnitude in [0.1, 1] (or [0.5, 2] for parameters) with mixed signs, rounded
// to multiples of 1/1024 so that f32 holds them exactly: the f32 optimizer and the double reference then
// start from the same numbers, and any difference comes from the update's arithmetic alone.
double test_value(int64_t i, int64_t salt, double low, double high) {
  const double s = std::sin(1.7 * static_cast<double>(i) + 2.3 * static_cast<double>(salt) + 0.3);
  const double magnitude = low + (high - low) * std::abs(s);
  const double value = (i + salt) % 3 == 0 ? -magnitude : magnitude;
  return std::round(value * 1024) / 1024;
}
std::vector<double> test_values(int64_t n, int64_t salt, double low, double high) {
  std::vector<double> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = test_value(i, salt, low, high);
  return v;
}

// ---- the published algorithms, per element, in double -----------------------------------------------------

// torch.optim.SGD's documented algorithm (theta: parameter, gamma: lr, lambda: weight decay, mu: momentum,
// tau: dampening):
//   g <- g + lambda theta
//   if mu != 0:  b <- g at t = 1, else b <- mu b + (1 - tau) g;   g <- nesterov ? g + mu b : b
//   theta <- theta - gamma g
struct ReferenceSGD {
  double lr, weight_decay, momentum, dampening;
  bool nesterov;
  std::vector<double> p, b;
  int64_t t = 0;

  void step(const std::vector<double>& grad) {
    ++t;
    b.resize(p.size());
    for (size_t i = 0; i < p.size(); ++i) {
      double g = grad[i] + weight_decay * p[i];
      if (momentum != 0) {
        b[i] = t == 1 ? g : momentum * b[i] + (1 - dampening) * g;
        g = nesterov ? g + momentum * b[i] : b[i];
      }
      p[i] -= lr * g;
    }
  }
};

// torch.optim.Adam / AdamW's documented algorithms:
//   AdamW: theta <- theta - gamma lambda theta          Adam: g <- g + lambda theta
//   m <- beta1 m + (1 - beta1) g;   v <- beta2 v + (1 - beta2) g^2
//   m_hat = m / (1 - beta1^t);      v_hat = v / (1 - beta2^t)
//   theta <- theta - gamma m_hat / (sqrt(v_hat) + eps)
struct ReferenceAdam {
  double lr, weight_decay, beta1, beta2, eps;
  bool decoupled;
  std::vector<double> p, m, v;
  int64_t t = 0;

  void step(const std::vector<double>& grad) {
    ++t;
    m.resize(p.size());
    v.resize(p.size());
    for (size_t i = 0; i < p.size(); ++i) {
      double g = grad[i];
      if (decoupled)
        p[i] -= lr * weight_decay * p[i];
      else
        g += weight_decay * p[i];
      m[i] = beta1 * m[i] + (1 - beta1) * g;
      v[i] = beta2 * v[i] + (1 - beta2) * g * g;
      const double m_hat = m[i] / (1 - std::pow(beta1, static_cast<double>(t)));
      const double v_hat = v[i] / (1 - std::pow(beta2, static_cast<double>(t)));
      p[i] -= lr * m_hat / (std::sqrt(v_hat) + eps);
    }
  }
};

// f32 results against the double reference: within 1e-6 relative (a few f32 roundings per step over three
// steps is ~1e-6 at most). A momentum or first moment is a sum of terms of size up to 1 (the gradients'
// bound) that can cancel to near zero when gradients change sign, so its error is bounded relative to the
// terms, not to the result: `term_scale` adds an absolute 1e-6 * term_scale (use 0.1 for moments: their
// terms are (1 - beta) * g <= 0.2 and each f32 rounding costs 6e-8 of that). f64: the same update in a
// different but equivalent arrangement, so ~1e-13.
::testing::AssertionResult close_to_reference(const Tensor& actual, const std::vector<double>& reference,
                                              double term_scale = 0) {
  if (actual.dtype() == DType::F64) return all_close(actual, as_f64(reference), 1e-13 * term_scale, 1e-13);
  return all_close(actual, as_f64(reference), 1e-6 * term_scale, 1e-6);
}

Tensor buffer(const Optimizer& optimizer, const Tensor& param, const std::string& name) {
  const ParamState* state = optimizer.state(param);
  if (!state || !state->buffers.count(name)) return Tensor();
  return state->buffers.at(name);
}

}  // namespace

// ---- SGD: hand-computed steps -----------------------------------------------------------------------------

TEST(SGD, PlainStepIsParamMinusLrTimesGrad) {
  for (DType dtype : {DType::F32, DType::F64}) {
    Tensor p = make_param({1.0, -2.0, 0.5}, dtype);
    SGD sgd({p}, /*lr=*/0.25);
    give_grad(p, {0.5, 1.0, -2.0});
    sgd.step();
    // p - 0.25 g, exact in binary
    EXPECT_EQ(values(p), (std::vector<double>{0.875, -2.25, 1.0}));
    EXPECT_EQ(sgd.state(p), nullptr) << "SGD without momentum keeps no state";
  }
}

TEST(SGD, MomentumBufferStartsAsTheUndampedGradientThenAccumulates) {
  // lr 0.1, momentum 0.9, dampening 0.1, p = [1, -2]:
  //   t=1 g=[0.5, 1]:  b = g = [0.5, 1] (no dampening on the first step);  p = [0.95, -2.1]
  //   t=2 g=[0.5, -1]: b = 0.9 [0.5, 1] + 0.9 [0.5, -1] = [0.9, 0];          p = [0.86, -2.1]
  //   t=3 g=[0, 1]:    b = 0.9 [0.9, 0] + 0.9 [0, 1] = [0.81, 0.9];          p = [0.779, -2.19]
  Tensor p = make_param({1.0, -2.0});
  SGD sgd({p}, 0.1, 0, {.momentum = 0.9, .dampening = 0.1});
  const std::vector<std::vector<double>> grads = {{0.5, 1.0}, {0.5, -1.0}, {0.0, 1.0}};
  const std::vector<std::vector<double>> buffers = {{0.5, 1.0}, {0.9, 0.0}, {0.81, 0.9}};
  const std::vector<std::vector<double>> params = {{0.95, -2.1}, {0.86, -2.1}, {0.779, -2.19}};
  for (size_t t = 0; t < grads.size(); ++t) {
    give_grad(p, grads[t]);
    sgd.step();
    EXPECT_TRUE(all_close(buffer(sgd, p, "momentum_buffer"), as_f64(buffers[t]), 1e-15, 1e-15))
        << "step " << t;
    EXPECT_TRUE(all_close(p, as_f64(params[t]), 1e-15, 1e-15)) << "step " << t;
    EXPECT_EQ(sgd.state(p)->step, static_cast<int64_t>(t + 1));
  }
}

TEST(SGD, NesterovStepsAlongGradientPlusMomentumTimesBuffer) {
  // lr 0.1, momentum 0.9, p = 1, g = 0.5 twice:
  //   t=1: b = 0.5;               g' = 0.5 + 0.9*0.5 = 0.95;   p = 1 - 0.095 = 0.905
  //   t=2: b = 0.45 + 0.5 = 0.95; g' = 0.5 + 0.855 = 1.355;    p = 0.905 - 0.1355 = 0.7695
  Tensor p = make_param({1.0});
  SGD sgd({p}, 0.1, 0, {.momentum = 0.9, .nesterov = true});
  give_grad(p, {0.5});
  sgd.step();
  EXPECT_NEAR(p.item(), 0.905, 1e-15);
  give_grad(p, {0.5});
  sgd.step();
  EXPECT_NEAR(p.item(), 0.7695, 1e-15);
  EXPECT_NEAR(buffer(sgd, p, "momentum_buffer").item(), 0.95, 1e-15);
}

TEST(SGD, WeightDecayAddsTheL2TermToTheGradient) {
  // lr 0.1, weight_decay 0.1, p = 2, g = 0.5 twice:
  //   t=1: g' = 0.5 + 0.2 = 0.7;     p = 2 - 0.07 = 1.93
  //   t=2: g' = 0.5 + 0.193 = 0.693; p = 1.93 - 0.0693 = 1.8607
  Tensor p = make_param({2.0});
  SGD sgd({p}, 0.1, 0.1);
  give_grad(p, {0.5});
  sgd.step();
  EXPECT_NEAR(p.item(), 1.93, 1e-15);
  give_grad(p, {0.5});
  sgd.step();
  EXPECT_NEAR(p.item(), 1.8607, 1e-15);
}

TEST(SGD, MatchesThePublishedAlgorithmOverThreeStepsInEveryVariant) {
  const std::vector<SGDOptions> variants = {
      {0, 0, false}, {0.9, 0, false}, {0.9, 0.3, false}, {0.9, 0, true}, {0.5, 0.5, false}};
  for (DType dtype : {DType::F32, DType::F64})
    for (const SGDOptions& options : variants)
      for (double weight_decay : {0.0, 0.05}) {
        SCOPED_TRACE(::testing::Message()
                     << dtype_name(dtype) << " momentum " << options.momentum << " dampening "
                     << options.dampening << " nesterov " << options.nesterov << " wd " << weight_decay);
        const std::vector<double> start = test_values(5, 0, 0.5, 2.0);
        Tensor p = make_param(start, dtype);
        SGD sgd({p}, 0.05, weight_decay, options);
        ReferenceSGD reference{
            0.05, weight_decay, options.momentum, options.dampening, options.nesterov, start, {}};
        for (int64_t t = 0; t < 3; ++t) {
          const std::vector<double> g = test_values(5, t + 1, 0.1, 1.0);
          give_grad(p, g);
          sgd.step();
          reference.step(g);
        }
        EXPECT_TRUE(close_to_reference(p, reference.p));
        if (options.momentum != 0) {
          EXPECT_TRUE(close_to_reference(buffer(sgd, p, "momentum_buffer"), reference.b, 1.0));
          EXPECT_EQ(buffer(sgd, p, "momentum_buffer").dtype(), dtype);
        }
      }
}

// ---- Adam / AdamW: hand-computed steps --------------------------------------------------------------------

TEST(Adam, ConstantGradientMovesTheParamByLrOverOnePlusEpsEachStep) {
  // lr 0.1, betas (0.9, 0.999), eps 1e-8, p = 1, g = 0.5 every step. The bias corrections make
  // m_hat = 0.5 and v_hat = 0.25 at every t (t=1: m = 0.05, v = 0.00025; t=2: m = 0.095 = 0.19 * 0.5,
  // v = 0.00049975 = 0.001999 * 0.25), so each step moves p by 0.1 * 0.5 / (0.5 + 1e-8) = 0.1 / (1 + 2e-8)
  // = 0.1 - 2e-9 + O(1e-17): p = 0.900000002, 0.800000004, 0.700000006.
  Tensor p = make_param({1.0});
  Adam adam({p}, 0.1);
  const std::vector<double> expected = {0.900000002, 0.800000004, 0.700000006};
  const std::vector<double> m = {0.05, 0.095, 0.1355}, v = {0.00025, 0.00049975, 0.00074925025};
  for (size_t t = 0; t < 3; ++t) {
    give_grad(p, {0.5});
    adam.step();
    EXPECT_NEAR(p.item(), expected[t], 1e-15) << "step " << t;
    EXPECT_NEAR(buffer(adam, p, "exp_avg").item(), m[t], 1e-16);
    EXPECT_NEAR(buffer(adam, p, "exp_avg_sq").item(), v[t], 1e-18);
  }
}

TEST(AdamVsAdamW, DifferExactlyInWhereWeightDecayEnters) {
  // lr 0.1, weight_decay 0.1, p = 1, g = 0.5, one step (m_hat = g', v_hat = g'^2):
  //   Adam:  g' = 0.5 + 0.1*1 = 0.6;  p = 1 - 0.1 * 0.6 / (0.6 + 1e-8)           = 0.9 + 1.6667e-9
  //   AdamW: p = 1 * (1 - 0.1*0.1) = 0.99;  p = 0.99 - 0.1 * 0.5 / (0.5 + 1e-8) = 0.89 + 2e-9
  Tensor a = make_param({1.0}), w = make_param({1.0});
  Adam adam({a}, 0.1, 0.1);
  AdamW adamw({w}, 0.1, 0.1);
  give_grad(a, {0.5});
  give_grad(w, {0.5});
  adam.step();
  adamw.step();
  EXPECT_NEAR(a.item(), 1 - 0.1 * 0.6 / (0.6 + 1e-8), 1e-15);
  EXPECT_NEAR(a.item(), 0.9 + 1e-8 / 6, 1e-15);
  EXPECT_NEAR(w.item(), 0.99 - 0.1 * 0.5 / (0.5 + 1e-8), 1e-15);
  EXPECT_NEAR(w.item(), 0.89 + 2e-9, 1e-15);
  EXPECT_NEAR(buffer(adam, a, "exp_avg").item(), 0.06, 1e-16) << "Adam's moments see the decayed gradient";
  EXPECT_NEAR(buffer(adamw, w, "exp_avg").item(), 0.05, 1e-16) << "AdamW's moments see the raw gradient";
}

TEST(AdamVsAdamW, AreBitIdenticalWithoutWeightDecay) {
  for (DType dtype : {DType::F32, DType::BF16, DType::F64}) {
    const std::vector<double> start = test_values(7, 0, 0.5, 2.0);
    Tensor a = make_param(start, dtype), w = make_param(start, dtype);
    Adam adam({a}, 0.01, 0.0);
    AdamW adamw({w}, 0.01, 0.0);
    for (int64_t t = 0; t < 3; ++t) {
      give_grad(a, test_values(7, t + 1, 0.1, 1.0));
      give_grad(w, test_values(7, t + 1, 0.1, 1.0));
      adam.step();
      adamw.step();
    }
    EXPECT_EQ(values(a), values(w)) << dtype_name(dtype);
  }
}

TEST(Adam, MatchesThePublishedAlgorithmOverThreeSteps) {
  for (DType dtype : {DType::F32, DType::F64})
    for (bool decoupled : {false, true})
      for (double weight_decay : {0.0, 0.1}) {
        SCOPED_TRACE(::testing::Message()
                     << dtype_name(dtype) << (decoupled ? " AdamW" : " Adam") << " wd " << weight_decay);
        // Three parameters: a scalar, a vector, and a matrix large enough (> 2 * 32768 elements) to take the
        // OpenMP path of the fused loop.
        const std::vector<int64_t> sizes = {1, 5, 70000};
        std::vector<Tensor> params;
        std::vector<ReferenceAdam> references;
        const AdamOptions options{.beta1 = 0.8, .beta2 = 0.95, .eps = 1e-6};
        for (size_t k = 0; k < sizes.size(); ++k) {
          const std::vector<double> start = test_values(sizes[k], 10 * k, 0.5, 2.0);
          params.push_back(make_param(start, dtype, k == 2 ? Shape{350, 200} : Shape{sizes[k]}));
          references.push_back({0.01, weight_decay, 0.8, 0.95, 1e-6, decoupled, start, {}, {}});
        }
        std::unique_ptr<Optimizer> optimizer;
        if (decoupled)
          optimizer = std::make_unique<AdamW>(params, 0.01, weight_decay, options);
        else
          optimizer = std::make_unique<Adam>(params, 0.01, weight_decay, options);
        for (int64_t t = 0; t < 3; ++t) {
          for (size_t k = 0; k < sizes.size(); ++k) {
            const std::vector<double> g = test_values(sizes[k], 10 * k + t + 1, 0.1, 1.0);
            give_grad(params[k], g);
            references[k].step(g);
          }
          optimizer->step();
        }
        for (size_t k = 0; k < sizes.size(); ++k) {
          EXPECT_TRUE(close_to_reference(params[k].flatten(), references[k].p)) << "param " << k;
          EXPECT_TRUE(
              close_to_reference(buffer(*optimizer, params[k], "exp_avg").flatten(), references[k].m, 0.1));
          EXPECT_TRUE(
              close_to_reference(buffer(*optimizer, params[k], "exp_avg_sq").flatten(), references[k].v));
          EXPECT_EQ(optimizer->state(params[k])->step, 3);
        }
      }
}

TEST(Adam, SmallAndLargeParamsTakeTheSameBitsOnAnyThreadCount) {
  // Tensors below the threading grain are stepped a tensor per thread, larger ones by a loop split across the
  // threads. The small params repeat the large one's first elements (values, gradients and so moments), so
  // a difference between the two paths (a tensor skipped or stepped twice, another formula) or between
  // thread counts shows as a mismatch. Their speed is bench_ops' adamw row.
  const int64_t large = 70000;
  const std::vector<int64_t> small = {1, 5, 16, 37, 100, 4096};
  auto run = [&](int threads) {
    const std::vector<double> start = test_values(large, 1, 0.5, 2.0);
    std::vector<Tensor> params = {make_param(start, DType::F32)};
    for (int64_t n : small) params.push_back(make_param({start.begin(), start.begin() + n}, DType::F32));
    AdamW optimizer(params, 0.01, 0.1);
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    for (int64_t t = 0; t < 3; ++t) {
      const std::vector<double> g = test_values(large, t + 2, 0.1, 1.0);
      for (Tensor& p : params) give_grad(p, std::vector<double>(g.begin(), g.begin() + p.numel()));
      optimizer.step();
    }
    omp_set_num_threads(saved);
    std::vector<std::vector<float>> out;
    for (const Tensor& p : params) out.push_back(p.to_vector<float>());
    return out;
  };
  const auto one = run(1), two = run(2);
  EXPECT_EQ(one, two);
  for (size_t k = 1; k < one.size(); ++k)
    EXPECT_EQ(one[k], std::vector<float>(one[0].begin(), one[0].begin() + static_cast<int64_t>(one[k].size())))
        << "param of " << one[k].size() << " elements";
}

TEST(Adam, SixteenBitParamsKeepF32StateAndRoundOnceOnStore) {
  for (DType dtype : {DType::F16, DType::BF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    // Values exact in the 16-bit dtype, so the reference starts from the same numbers.
    std::vector<double> start = test_values(64, 0, 0.5, 2.0), g = test_values(64, 1, 0.1, 1.0);
    for (double& x : start) x = mixtape::testing::round_to(dtype, x);
    for (double& x : g) x = mixtape::testing::round_to(dtype, x);
    Tensor p = make_param(start, dtype);
    AdamW adamw({p}, 0.05, 0.1);
    ReferenceAdam reference{0.05, 0.1, 0.9, 0.999, 1e-8, true, start, {}, {}};
    give_grad(p, g);
    adamw.step();
    reference.step(g);
    // One rounding to the 16-bit dtype at the end of an f32 computation that is within ~1e-6 relative of
    // the double one: the stored value is the correctly rounded reference or, next to a rounding boundary,
    // its neighbour — at most 1 ulp.
    EXPECT_TRUE(within_ulp(p, as_f64(reference.p), 1));
    EXPECT_EQ(p.dtype(), dtype);
    const Tensor exp_avg = buffer(adamw, p, "exp_avg");
    EXPECT_EQ(exp_avg.dtype(), DType::F32);
    EXPECT_EQ(buffer(adamw, p, "exp_avg_sq").dtype(), DType::F32);
    EXPECT_TRUE(all_close(exp_avg, as_f64(reference.m), 0, 1e-6)) << "the moments are not rounded to 16 bits";
  }
}

// ---- what every optimizer shares --------------------------------------------------------------------------

TEST(Optimizer, ParamGroupsUseTheirOwnLearningRateAndWeightDecay) {
  // SGD, one step, g = 0.5 for both: group 0 (lr 0.1, wd 0): p = 1 - 0.05 = 0.95;
  // group 1 (lr 0.2, wd 0.5): g' = 0.5 + 0.5 = 1, p = 1 - 0.2 = 0.8.
  Tensor a = make_param({1.0}), b = make_param({1.0});
  SGD sgd(std::vector<ParamGroup>{{{a}, 0.1, 0.0}, {{b}, 0.2, 0.5}});
  give_grad(a, {0.5});
  give_grad(b, {0.5});
  sgd.step();
  EXPECT_NEAR(a.item(), 0.95, 1e-15);
  EXPECT_NEAR(b.item(), 0.8, 1e-15);
  ASSERT_EQ(sgd.param_groups().size(), 2u);
  EXPECT_EQ(sgd.params().size(), 2u);
  EXPECT_TRUE(sgd.params()[1].same(b));
}

TEST(Optimizer, ParamWithoutGradIsSkippedAndGetsNoState) {
  Tensor a = make_param({1.0, 2.0}), b = make_param({3.0});
  AdamW adamw({a, b}, 0.1, 0.1);
  give_grad(a, {0.5, 0.5});
  const uint64_t b_version = b.version();
  adamw.step();
  adamw.step();
  EXPECT_EQ(values(b), std::vector<double>{3.0}) << "not even the decoupled weight decay touches it";
  EXPECT_EQ(b.version(), b_version);
  EXPECT_EQ(adamw.state(b), nullptr);
  EXPECT_EQ(adamw.state(a)->step, 2);
  // Its first update, later, is its own step 1 (bias correction from t = 1): the same as a fresh optimizer's.
  give_grad(b, {0.25});
  adamw.step();
  EXPECT_EQ(adamw.state(b)->step, 1);
  EXPECT_EQ(adamw.state(a)->step, 3);
  Tensor fresh = make_param({3.0});
  AdamW reference({fresh}, 0.1, 0.1);
  give_grad(fresh, {0.25});
  reference.step();
  EXPECT_EQ(values(b), values(fresh));
}

TEST(Optimizer, ZeroGradDropsEveryGradient) {
  Tensor a = make_param({1.0}), b = make_param({2.0}), c = make_param({3.0});
  SGD sgd(std::vector<ParamGroup>{{{a, b}, 0.1, 0.0}, {{c}, 0.1, 0.0}});
  give_grad(a, {1.0});
  give_grad(c, {1.0});
  sgd.zero_grad();
  EXPECT_FALSE(a.grad().defined());
  EXPECT_FALSE(b.grad().defined());
  EXPECT_FALSE(c.grad().defined());
  sgd.step();  // nothing to do
  EXPECT_EQ(a.item(), 1.0);
  // The next backward starts from nothing (no stale gradient is accumulated into).
  backward(sum(mul(a, 3.0)));
  EXPECT_EQ(a.grad().item(), 3.0);
}

TEST(Optimizer, StepChangesParamsInPlaceAndBumpsTheirVersion) {
  Tensor p = make_param({1.0, 2.0}, DType::F32);
  const void* data = p.data_ptr();
  Tensor saved_by_graph = mul(p, p);  // saves p for its backward
  SGD sgd({p}, 0.1);
  give_grad(p, {1.0, 1.0});
  const uint64_t version = p.version();
  sgd.step();
  EXPECT_EQ(p.data_ptr(), data);
  EXPECT_GT(p.version(), version);
  // A graph that saved p now sees that it changed.
  EXPECT_THROW(backward(sum(saved_by_graph)), Error);
}

TEST(Optimizer, StepChecksEveryGradientBeforeChangingAnyParam) {
  Tensor a = make_param({1.0}, DType::F32), b = make_param({1.0}, DType::F32);
  SGD sgd({a, b}, 0.1);
  give_grad(a, {1.0});
  b.set_grad(Tensor::from_vector(std::vector<double>{1.0}, {1}, DType::F64));
  EXPECT_ERROR_MENTIONS(sgd.step(), "SGD.step", "f64[1]", "f32[1]", "parameter 1");
  EXPECT_EQ(a.item(), 1.0) << "the first parameter was updated before the bad gradient was found";
}

TEST(Optimizer, RejectsNonContiguousParamsAtStep) {
  Tensor base = Tensor::zeros({2, 3});
  Tensor transposed = base.transpose(0, 1);  // a leaf view, not contiguous
  transposed.requires_grad_();
  SGD sgd({transposed}, 0.1);
  transposed.set_grad(Tensor::ones({3, 2}));
  EXPECT_ERROR_MENTIONS(sgd.step(), "SGD.step", "not contiguous");
}

TEST(Optimizer, ConstructionRejectsBadParamsAndHyperparameters) {
  Tensor p = make_param({1.0});
  Tensor non_leaf = mul(p, 2.0);
  EXPECT_ERROR_MENTIONS(SGD({non_leaf}, 0.1), "SGD", "not a leaf", "mul");
  EXPECT_ERROR_MENTIONS(SGD({Tensor::zeros({2}, DType::I64)}, 0.1), "SGD", "i64[2]", "floating");
  EXPECT_ERROR_MENTIONS(SGD(std::vector<ParamGroup>{{{p}, 0.1, 0.0}, {{p}, 0.1, 0.0}}), "more than once");
  EXPECT_ERROR_MENTIONS(SGD({p}, -0.1), "SGD", "learning rate", "-0.1");
  EXPECT_ERROR_MENTIONS(SGD({p}, 0.1, -1), "SGD", "weight_decay");
  EXPECT_ERROR_MENTIONS(SGD({p}, 0.1, 0, {.momentum = 0, .nesterov = true}), "nesterov", "momentum");
  EXPECT_ERROR_MENTIONS(SGD({p}, 0.1, 0, {.momentum = 0.9, .dampening = 0.1, .nesterov = true}), "dampening");
  EXPECT_ERROR_MENTIONS(SGD({p}, 0.1, 0, {.momentum = -0.5}), "momentum", "-0.5");
  EXPECT_ERROR_MENTIONS(Adam({p}, 0.1, 0, {.beta1 = 1.0}), "Adam", "beta1");
  EXPECT_ERROR_MENTIONS(AdamW({p}, 0.1, 0, {.beta2 = -0.1}), "AdamW", "beta2");
  EXPECT_ERROR_MENTIONS(Adam({p}, 0.1, 0, {.eps = -1e-8}), "Adam", "eps");
  SGD sgd({p}, 0.1);
  EXPECT_ERROR_MENTIONS(sgd.add_param_group({{p}, 0.1, 0.0}), "more than once");
  sgd.param_groups()[0].lr = std::numeric_limits<double>::quiet_NaN();
  give_grad(p, {1.0});
  EXPECT_ERROR_MENTIONS(sgd.step(), "SGD.step", "learning rate");
}

// ---- state_dict -------------------------------------------------------------------------------------------

namespace {

using MakeOptimizer = std::function<std::unique_ptr<Optimizer>(const std::vector<Tensor>&)>;

// Three parameters in two groups; the last gets gradients only from step 3 on, so a checkpoint taken after
// step 2 has no state for it.
std::vector<Tensor> fresh_params() {
  return {make_param(test_values(6, 1, 0.5, 2.0), DType::F32, {2, 3}),
          make_param(test_values(3, 2, 0.5, 2.0), DType::F32),
          make_param(test_values(4, 3, 0.5, 2.0), DType::F32)};
}

void give_step_grads(const std::vector<Tensor>& params, int64_t step) {
  for (size_t k = 0; k < params.size(); ++k)
    if (k != 2 || step >= 3) give_grad(params[k], test_values(params[k].numel(), 7 * step + k, 0.1, 1.0));
}

std::vector<std::vector<double>> snapshot(const std::vector<Tensor>& params) {
  std::vector<std::vector<double>> out;
  for (const Tensor& p : params) out.push_back(values(p));
  return out;
}

void expect_resume_is_bit_exact(const MakeOptimizer& make) {
  const WarmupCosineLR schedule(0.05, 0.005, 2, 5);
  // The uninterrupted run: steps 0..5.
  std::vector<Tensor> uninterrupted = fresh_params();
  std::unique_ptr<Optimizer> optimizer = make(uninterrupted);
  for (int64_t step = 0; step < 6; ++step) {
    give_step_grads(uninterrupted, step);
    apply_schedule(*optimizer, schedule, step);
    optimizer->step();
  }
  // The interrupted run: steps 0..2, checkpoint (parameter values + optimizer state), then keep going with
  // the first optimizer to show the checkpoint is a snapshot that later steps do not change.
  std::vector<Tensor> first = fresh_params();
  std::unique_ptr<Optimizer> before = make(first);
  for (int64_t step = 0; step < 3; ++step) {
    give_step_grads(first, step);
    apply_schedule(*before, schedule, step);
    before->step();
  }
  const StateDict saved = before->state_dict();
  const std::vector<std::vector<double>> saved_params = snapshot(first);
  for (int64_t step = 3; step < 6; ++step) {
    give_step_grads(first, step);
    before->step();
  }
  // Resume: new parameters holding the checkpointed values, a new optimizer built with other
  // hyperparameters (the load restores them), then steps 3..5.
  std::vector<Tensor> resumed = fresh_params();
  for (size_t k = 0; k < resumed.size(); ++k) {
    NoGradGuard no_grad;
    resumed[k].copy_(Tensor::from_vector(saved_params[k], resumed[k].shape(), DType::F32));
  }
  std::unique_ptr<Optimizer> after = make(resumed);
  after->param_groups()[0].lr = 123;
  after->param_groups()[1].weight_decay = 0.5;
  after->load_state_dict(saved);
  for (int64_t step = 3; step < 6; ++step) {
    give_step_grads(resumed, step);
    apply_schedule(*after, schedule, step);
    after->step();
  }
  EXPECT_EQ(snapshot(resumed), snapshot(uninterrupted));
  for (size_t k = 0; k < resumed.size(); ++k) {
    ASSERT_NE(after->state(resumed[k]), nullptr);
    EXPECT_EQ(after->state(resumed[k])->step, optimizer->state(uninterrupted[k])->step);
    for (const auto& [name, tensor] : optimizer->state(uninterrupted[k])->buffers)
      EXPECT_EQ(values(after->state(resumed[k])->buffers.at(name)), values(tensor)) << name;
  }
}

std::vector<ParamGroup> two_groups(const std::vector<Tensor>& params, double weight_decay) {
  return {{{params[0], params[2]}, 0.05, weight_decay}, {{params[1]}, 0.05, 0.0}};
}

}  // namespace

TEST(OptimizerStateDict, ResumedSGDMatchesTheUninterruptedRunBitForBit) {
  expect_resume_is_bit_exact([](const std::vector<Tensor>& params) {
    return std::make_unique<SGD>(two_groups(params, 0.01), SGDOptions{.momentum = 0.9, .nesterov = true});
  });
  expect_resume_is_bit_exact([](const std::vector<Tensor>& params) {
    return std::make_unique<SGD>(two_groups(params, 0.01), SGDOptions{.momentum = 0.8, .dampening = 0.2});
  });
}

TEST(OptimizerStateDict, ResumedAdamMatchesTheUninterruptedRunBitForBit) {
  expect_resume_is_bit_exact([](const std::vector<Tensor>& params) {
    return std::make_unique<Adam>(two_groups(params, 0.01), AdamOptions{.beta1 = 0.85, .beta2 = 0.95});
  });
}

TEST(OptimizerStateDict, ResumedAdamWMatchesTheUninterruptedRunBitForBit) {
  expect_resume_is_bit_exact([](const std::vector<Tensor>& params) {
    return std::make_unique<AdamW>(two_groups(params, 0.1), AdamOptions{.beta1 = 0.9, .beta2 = 0.95});
  });
}

TEST(OptimizerStateDict, NamesEntriesLikePyTorchAndStoresNumbersExactly) {
  Tensor a = make_param({1.0, 2.0}, DType::F32), b = make_param({1.0}, DType::BF16), c = make_param({1.0});
  const double lr = 0.1 + 0.2;  // 0.30000000000000004: needs all 17 digits
  AdamW adamw(std::vector<ParamGroup>{{{a, b}, lr, 0.1}, {{c}, 1e-3, 0.0}},
              {.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8});
  give_grad(a, {0.5, 0.5});
  give_grad(b, {0.5});
  adamw.step();
  b.set_grad(Tensor());
  give_grad(a, {0.5, 0.5});
  adamw.step();
  const StateDict dict = adamw.state_dict();
  EXPECT_EQ(dict.metadata.at("type"), "AdamW");
  EXPECT_EQ(dict.metadata.at("param_groups"), "2");
  EXPECT_EQ(dict.metadata.at("param_groups.0.params"), "2");
  EXPECT_EQ(dict.metadata.at("param_groups.1.params"), "1");
  EXPECT_EQ(std::stod(dict.metadata.at("param_groups.0.lr")), lr);
  EXPECT_EQ(dict.metadata.at("param_groups.1.lr"), "0.001");
  EXPECT_EQ(dict.metadata.at("beta2"), "0.95");
  EXPECT_EQ(dict.metadata.at("eps"), "1e-08");
  EXPECT_EQ(dict.metadata.at("state.0.step"), "2");
  EXPECT_EQ(dict.metadata.at("state.1.step"), "1");
  EXPECT_EQ(dict.metadata.count("state.2.step"), 0u) << "parameter 2 never had a gradient";
  ASSERT_EQ(dict.tensors.size(), 4u);
  EXPECT_EQ(dict.tensors.at("state.0.exp_avg").shape(), (Shape{2}));
  EXPECT_EQ(dict.tensors.at("state.1.exp_avg_sq").dtype(), DType::F32) << "bf16 parameter, f32 state";
  EXPECT_NE(dict.tensors.at("state.0.exp_avg").data_ptr(), adamw.state(a)->buffers.at("exp_avg").data_ptr());
  SGD sgd({c}, 0.1, 0, {.momentum = 0.5, .nesterov = false});
  EXPECT_EQ(sgd.state_dict().metadata.at("nesterov"), "false");
  EXPECT_EQ(sgd.state_dict().metadata.at("momentum"), "0.5");
}

TEST(OptimizerStateDict, LoadRejectsMismatchesByNameAndChangesNothing) {
  Tensor a = make_param({1.0, 2.0, 3.0}, DType::F32), b = make_param({1.0}, DType::F32);
  Adam adam({a, b}, 0.1);
  give_grad(a, {0.5, 0.5, 0.5});
  give_grad(b, {0.5});
  adam.step();
  const StateDict good = adam.state_dict();
  const std::vector<double> exp_avg = values(adam.state(a)->buffers.at("exp_avg"));

  auto changed = [&](const std::function<void(StateDict&)>& change) {
    StateDict dict = good;
    dict.metadata["param_groups.0.lr"] = "0.5";  // would show if a failed load applied anything
    dict.tensors["state.0.exp_avg"] = Tensor::full({3}, 9.0);
    change(dict);
    return dict;
  };
  EXPECT_ERROR_MENTIONS(adam.load_state_dict(changed([](StateDict& d) { d.metadata["type"] = "SGD"; })),
                        "Adam.load_state_dict", "'SGD'", "'Adam'");
  EXPECT_ERROR_MENTIONS(adam.load_state_dict(changed([](StateDict& d) { d.metadata.erase("type"); })),
                        "'type'");
  EXPECT_ERROR_MENTIONS(adam.load_state_dict(changed([](StateDict& d) { d.metadata["param_groups"] = "2"; })),
                        "2 parameter groups", "'param_groups'");
  EXPECT_ERROR_MENTIONS(
      adam.load_state_dict(changed([](StateDict& d) { d.metadata["param_groups.0.params"] = std::string("3"); })),
      "'param_groups.0.params'", "3 parameters");
  EXPECT_ERROR_MENTIONS(
      adam.load_state_dict(changed([](StateDict& d) { d.tensors["state.0.exp_avg"] = Tensor::zeros({2}); })),
      "'state.0.exp_avg'", "f32[2]", "f32[3]");
  EXPECT_ERROR_MENTIONS(adam.load_state_dict(changed([](StateDict& d) {
    d.tensors["state.0.exp_avg_sq"] = Tensor::zeros({3}, DType::F64);
  })),
                        "'state.0.exp_avg_sq'", "f64[3]", "expected f32[3]");
  EXPECT_ERROR_MENTIONS(
      adam.load_state_dict(changed([](StateDict& d) { d.tensors.erase("state.1.exp_avg_sq"); })), "missing",
      "'state.1.exp_avg_sq'");
  EXPECT_ERROR_MENTIONS(adam.load_state_dict(changed([](StateDict& d) { d.metadata.erase("state.1.step"); })),
                        "'state.1.step'");
  EXPECT_ERROR_MENTIONS(adam.load_state_dict(changed(
                            [](StateDict& d) { d.tensors["state.0.momentum_buffer"] = Tensor::zeros({3}); })),
                        "unexpected", "'state.0.momentum_buffer'");
  EXPECT_ERROR_MENTIONS(adam.load_state_dict(changed([](StateDict& d) { d.metadata["state.2.step"] = "1"; })),
                        "unexpected", "'state.2.step'");
  EXPECT_ERROR_MENTIONS(adam.load_state_dict(changed([](StateDict& d) { d.metadata["momentum"] = "0.9"; })),
                        "unexpected", "'momentum'");
  EXPECT_ERROR_MENTIONS(adam.load_state_dict(changed([](StateDict& d) { d.metadata["state.0.step"] = "0"; })),
                        "'state.0.step'");
  EXPECT_ERROR_MENTIONS(
      adam.load_state_dict(changed([](StateDict& d) { d.metadata["param_groups.0.lr"] = "fast"; })),
      "'param_groups.0.lr'", "'fast'", "number");
  EXPECT_ERROR_MENTIONS(adam.load_state_dict(changed([](StateDict& d) { d.metadata["eps"] = "1e-8x"; })),
                        "'eps'");
  // The options are checked last (after every structural check passed): still nothing may change.
  EXPECT_ERROR_MENTIONS(adam.load_state_dict(changed([](StateDict& d) { d.metadata["beta1"] = "1.5"; })),
                        "Adam.load_state_dict", "beta1", "1.5");
  EXPECT_EQ(adam.param_groups()[0].lr, 0.1);
  EXPECT_EQ(adam.options().beta1, 0.9);
  EXPECT_EQ(values(adam.state(a)->buffers.at("exp_avg")), exp_avg);
  EXPECT_EQ(adam.state(a)->step, 1);

  // And the good dict (with the changed lr and exp_avg) loads, as a copy the optimizer owns.
  StateDict other = changed([](StateDict&) {});
  adam.load_state_dict(other);
  EXPECT_EQ(adam.param_groups()[0].lr, 0.5);
  EXPECT_EQ(values(adam.state(a)->buffers.at("exp_avg")), (std::vector<double>{9, 9, 9}));
  other.tensors["state.0.exp_avg"].fill_(0);
  EXPECT_EQ(values(adam.state(a)->buffers.at("exp_avg")), (std::vector<double>{9, 9, 9}));
}

// A NaN moment, a negative second moment or a step count at INT64_MAX (whose ++ would overflow) would make every
// later update NaN or skipped: the load rejects them, naming the entry, and changes nothing.
TEST(OptimizerStateDict, LoadRejectsNonFiniteMomentsNegativeSquaresAndHugeStepCounts) {
  Tensor a = make_param({1.0, 2.0, 3.0}, DType::F32);
  Adam adam({a}, 0.1);
  give_grad(a, {0.5, 0.5, 0.5});
  adam.step();
  const StateDict good = adam.state_dict();
  const std::vector<double> exp_avg_sq = values(adam.state(a)->buffers.at("exp_avg_sq"));
  auto with = [&](const std::string& key, std::vector<double> v) {
    StateDict dict = good;
    dict.tensors[key] = Tensor::from_vector(v, {3}, DType::F32);
    return dict;
  };
  EXPECT_ERROR_MENTIONS(adam.load_state_dict(with("state.0.exp_avg", {0, NAN, 0})), "Adam.load_state_dict",
                        "'state.0.exp_avg' must be finite", "element 1 is nan");
  EXPECT_ERROR_MENTIONS(adam.load_state_dict(with("state.0.exp_avg_sq", {0, 0, INFINITY})),
                        "'state.0.exp_avg_sq' must be finite and >= 0", "element 2 is inf");
  EXPECT_ERROR_MENTIONS(adam.load_state_dict(with("state.0.exp_avg_sq", {1, -1, 1})),
                        "'state.0.exp_avg_sq' must be finite and >= 0", "element 1 is -1");
  EXPECT_NO_THROW(adam.load_state_dict(with("state.0.exp_avg", {-1, -2, -3})));  // a first moment may be < 0
  adam.load_state_dict(good);
  for (const char* step : {"9223372036854775807", "9007199254740993"}) {
    StateDict dict = good;
    dict.metadata["state.0.step"] = step;
    EXPECT_ERROR_MENTIONS(adam.load_state_dict(dict), "'state.0.step'", step, "[1, 2^53]");
  }
  EXPECT_EQ(values(adam.state(a)->buffers.at("exp_avg_sq")), exp_avg_sq);
  EXPECT_EQ(adam.state(a)->step, 1);

  Tensor p = make_param({1.0, 2.0}, DType::F32);
  SGD sgd({p}, 0.1, 0, SGDOptions{0.9, 0, false});
  give_grad(p, {1.0, 1.0});
  sgd.step();
  StateDict dict = sgd.state_dict();
  dict.tensors["state.0.momentum_buffer"] =
      Tensor::from_vector(std::vector<double>{-INFINITY, 0}, {2}, DType::F32);
  EXPECT_ERROR_MENTIONS(sgd.load_state_dict(dict), "SGD.load_state_dict", "'state.0.momentum_buffer' must be finite",
                        "element 0 is -inf");
}

// ---- learning-rate schedules ------------------------------------------------------------------------------

TEST(WarmupCosineLR, FollowsNanoGPTsGetLrAtTheBoundaries) {
  const double lr = 6e-4, min_lr = 6e-5;
  const WarmupCosineLR schedule(lr, min_lr, /*warmup_iters=*/10, /*lr_decay_iters=*/100);
  // Warm-up: lr * (it + 1) / (warmup + 1) — never 0, and just below lr at the last warm-up step.
  EXPECT_DOUBLE_EQ(schedule.lr_at(0), lr * 1 / 11);
  EXPECT_DOUBLE_EQ(schedule.lr_at(9), lr * 10 / 11);
  // Decay starts at lr (decay_ratio 0, coeff 1), passes the midpoint at decay_ratio 0.5 (coeff 0.5) ...
  EXPECT_DOUBLE_EQ(schedule.lr_at(10), lr);
  EXPECT_DOUBLE_EQ(schedule.lr_at(55), min_lr + 0.5 * (lr - min_lr));
  EXPECT_DOUBLE_EQ(schedule.lr_at(32),
                   min_lr + 0.5 * (1 + std::cos(std::numbers::pi * 22 / 90)) * (lr - min_lr));
  // ... and reaches min_lr at lr_decay_iters (cos(pi) = -1 exactly in double), where it stays.
  EXPECT_EQ(schedule.lr_at(100), min_lr);
  EXPECT_EQ(schedule.lr_at(101), min_lr);
  EXPECT_EQ(schedule.lr_at(1000000), min_lr);
  for (int64_t step = 10; step < 100; ++step) EXPECT_GE(schedule.lr_at(step), schedule.lr_at(step + 1));
}

TEST(WarmupCosineLR, WithoutWarmUpStartsAtTheFullRate) {
  const WarmupCosineLR schedule(1.0, 0.1, 0, 4);
  EXPECT_DOUBLE_EQ(schedule.lr_at(0), 1.0);
  EXPECT_DOUBLE_EQ(schedule.lr_at(2), 0.55);
  EXPECT_EQ(schedule.lr_at(4), 0.1);
}

TEST(WarmupCosineLR, EqualWarmUpAndDecayEndDropsStraightToTheFloor) {
  const WarmupCosineLR schedule(1.0, 0.1, 3, 3);
  EXPECT_DOUBLE_EQ(schedule.lr_at(2), 0.75);
  EXPECT_EQ(schedule.lr_at(3), 0.1);
  EXPECT_EQ(schedule.lr_at(4), 0.1);
}

TEST(WarmupCosineLR, AHugeRateWarmsUpWithoutOverflowing) {
  // nanoGPT's lr * (it + 1) overflows for lr = 1e308 at it = 1: the warm-up value itself, 1e308 * 2 / 11, is
  // finite and is what the schedule returns (train_gpt --lr 1e308 failed at step 2 in set_lr).
  const WarmupCosineLR schedule(1e308, 0.0, 10, 100);
  for (int64_t step = 0; step <= 10; ++step) {
    const double expected = 1e308 * (static_cast<double>(step + 1) / 11);
    EXPECT_TRUE(std::isfinite(schedule.lr_at(step))) << "step " << step;
    EXPECT_NEAR(schedule.lr_at(step), expected, expected * 1e-15) << "step " << step;
  }
  EXPECT_EQ(schedule.lr_at(10), 1e308);
}

TEST(WarmupCosineLR, RejectsBadArguments) {
  EXPECT_ERROR_MENTIONS(WarmupCosineLR(1.0, 0.1, 10, 5), "WarmupCosineLR", "warmup_iters (10)",
                        "lr_decay_iters (5)");
  EXPECT_ERROR_MENTIONS(WarmupCosineLR(1.0, 0.1, -1, 5), "warmup_iters (-1)");
  EXPECT_ERROR_MENTIONS(WarmupCosineLR(-1.0, 0.1, 1, 5), "learning_rate");
  EXPECT_ERROR_MENTIONS(WarmupCosineLR(1.0, 0.1, 1, 5).lr_at(-1), "step", "-1");
  EXPECT_ERROR_MENTIONS(ConstantLR(std::numeric_limits<double>::infinity()), "ConstantLR", "learning_rate");
}

TEST(ConstantLR, IsTheSameAtEveryStepAndApplyScheduleSetsEveryGroup) {
  const ConstantLR schedule(0.25);
  EXPECT_EQ(schedule.lr_at(0), 0.25);
  EXPECT_EQ(schedule.lr_at(123456), 0.25);
  Tensor a = make_param({1.0}), b = make_param({1.0});
  SGD sgd(std::vector<ParamGroup>{{{a}, 0.1, 0.1}, {{b}, 0.2, 0.0}});
  EXPECT_EQ(apply_schedule(sgd, WarmupCosineLR(1.0, 0.0, 3, 10), 1), 0.5);
  EXPECT_EQ(sgd.param_groups()[0].lr, 0.5);
  EXPECT_EQ(sgd.param_groups()[1].lr, 0.5);
  EXPECT_EQ(sgd.param_groups()[0].weight_decay, 0.1) << "weight decay stays per group";
  apply_schedule(sgd, schedule, 7);
  EXPECT_EQ(sgd.param_groups()[1].lr, 0.25);
  EXPECT_ERROR_MENTIONS(set_lr(sgd, -1), "set_lr", "-1");
}

// ---- clip_grad_norm ---------------------------------------------------------------------------------------

TEST(ClipGradNorm, ReturnsTheGlobalL2NormOverEveryGradient) {
  // f32 grads (3, 4), f64 grad (12), bf16 grad (0), one parameter without a gradient:
  // sqrt(9 + 16 + 144 + 0) = 13.
  Tensor a = make_param({1, 1}, DType::F32), b = make_param({1}), c = make_param({1}, DType::BF16),
         d = make_param({1});
  give_grad(a, {3, 4});
  give_grad(b, {12});
  give_grad(c, {0});
  EXPECT_EQ(grad_norm({a, b, c, d}), 13.0);
  EXPECT_EQ(clip_grad_norm({a, b, c, d}, 100.0), 13.0);
  EXPECT_EQ(values(a.grad()), (std::vector<double>{3, 4})) << "below max_norm: untouched";
}

TEST(ClipGradNorm, ScalesEveryGradientByMaxNormOverNormPlusEpsilon) {
  for (DType dtype : {DType::F32, DType::BF16, DType::F64}) {
    SCOPED_TRACE(dtype_name(dtype));
    Tensor a = make_param({1, 1}, dtype), b = make_param({1}, dtype);
    give_grad(a, {3, 4});
    give_grad(b, {12});
    EXPECT_EQ(clip_grad_norm({a, b}, 6.5), 13.0) << "returns the norm before clipping";
    const double coef = 6.5 / (13 + 1e-6);  // PyTorch's clip_coef
    // Each element is multiplied in double and rounded once to its dtype: the correctly rounded product.
    EXPECT_TRUE(within_ulp(a.grad(), as_f64({3 * coef, 4 * coef}), 0));
    EXPECT_TRUE(within_ulp(b.grad(), as_f64({12 * coef}), 0));
    if (dtype != DType::BF16) {
      EXPECT_NEAR(grad_norm({a, b}), 6.5, 1e-5);
    }
  }
}

TEST(ClipGradNorm, AtExactlyMaxNormScalesByTheFactorJustBelowOneAsPyTorchDoes) {
  Tensor a = make_param({1, 1});
  give_grad(a, {3, 4});
  clip_grad_norm({a}, 5.0);
  EXPECT_EQ(values(a.grad())[0], 3 * (5.0 / (5.0 + 1e-6)));
  EXPECT_LT(values(a.grad())[0], 3.0);
}

TEST(ClipGradNorm, ScalesABroadcastGradientOncePerElement) {
  // The gradient [3, 3, 3, 3] is one stored element seen four times (stride 0): norm 6, clipped to 3.
  Tensor p = make_param({0, 0, 0, 0}, DType::F32);
  p.set_grad(Tensor::full({1}, 3.0).expand({4}));
  EXPECT_EQ(clip_grad_norm({p}, 3.0), 6.0);
  const double scaled = static_cast<float>(3 * (3.0 / (6.0 + 1e-6)));
  EXPECT_EQ(values(p.grad()), std::vector<double>(4, scaled));
}

TEST(ClipGradNorm, NonFiniteNormIsReturnedAndGradientsAreLeftUntouched) {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  Tensor a = make_param({1, 1}, DType::F32), b = make_param({1}, DType::F32);
  give_grad(a, {3, 4});
  give_grad(b, {inf});
  EXPECT_EQ(clip_grad_norm({a, b}, 1.0), inf);
  EXPECT_EQ(values(a.grad()), (std::vector<double>{3, 4}));
  give_grad(b, {nan});
  EXPECT_TRUE(std::isnan(clip_grad_norm({a, b}, 1.0)));
  EXPECT_EQ(values(a.grad()), (std::vector<double>{3, 4}));
  EXPECT_ERROR_MENTIONS(clip_grad_norm({a, b}, 1.0, /*error_if_nonfinite=*/true), "clip_grad_norm", "nan",
                        "not scaled");
  give_grad(b, {-inf});
  EXPECT_ERROR_MENTIONS(clip_grad_norm({a, b}, 1.0, true), "clip_grad_norm", "inf");
  EXPECT_EQ(values(a.grad()), (std::vector<double>{3, 4}));
  // A finite norm with error_if_nonfinite clips as usual.
  give_grad(b, {0});
  EXPECT_EQ(clip_grad_norm({a, b}, 1.0, true), 5.0);
  EXPECT_NEAR(values(a.grad())[0], 0.6, 1e-6);
}

TEST(ClipGradNorm, NormDoesNotDependOnTheThreadCount) {
  // 300,000 f32 elements: enough for the parallel path. The partial sums are per fixed chunk, so one
  // thread and two threads add the same numbers in the same order.
  const int64_t n = 300000;
  std::vector<double> g = Tensor::randn({n}, 42, DType::F64).to_vector<double>();
  for (double& x : g) x = static_cast<float>(x);
  Tensor p = make_param(std::vector<double>(n, 0.0), DType::F32);
  give_grad(p, g);
  // Small tensors too: they are summed a tensor per thread, and their sums added in the tensors' order.
  std::vector<Tensor> params = {p};
  for (int64_t k = 0; k < 12; ++k) {
    const int64_t m = 1 + 997 * k;
    params.push_back(make_param(std::vector<double>(m, 0.0), DType::F32));
    give_grad(params.back(), std::vector<double>(g.begin(), g.begin() + m));
  }
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const double one = grad_norm({p}), one_all = grad_norm(params);
  omp_set_num_threads(2);
  const double two = grad_norm({p}), two_all = grad_norm(params);
  omp_set_num_threads(threads);
  EXPECT_EQ(one, two);
  EXPECT_EQ(one_all, two_all);
  // Against a plain double sum in index order (a different order: agreement to double rounding).
  double sum = 0;
  for (double x : g) sum += x * x;
  EXPECT_NEAR(one, std::sqrt(sum), 1e-12 * std::sqrt(sum));
}

TEST(ClipGradNorm, RejectsNonPositiveOrNonFiniteMaxNorm) {
  Tensor a = make_param({1.0});
  give_grad(a, {1.0});
  EXPECT_ERROR_MENTIONS(clip_grad_norm({a}, 0.0), "clip_grad_norm", "max_norm");
  EXPECT_ERROR_MENTIONS(clip_grad_norm({a}, -1.0), "max_norm", "-1");
  EXPECT_ERROR_MENTIONS(clip_grad_norm({a}, std::numeric_limits<double>::quiet_NaN()), "max_norm");
}
