// softmax_cross_entropy: the loss and its fused gradient against plain double references, finite
// differences in f64 (with ignored rows), the no-counted-rows convention, thread-count independence, and the
// errors bad targets and shapes raise.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <functional>
#include <vector>

#include "autograd/autograd.h"
#include "autograd/gradcheck.h"
#include "tensor/ops.h"
#include "test_util.h"

using namespace mixtape;
using mixtape::testing::all_close;
using mixtape::testing::kFloatDtypes;
using mixtape::testing::uniform_tensor;
using mixtape::testing::within_ulp;

namespace {

// Targets in [0, V), with every `ignore_every`-th row (0: none) set to ignore_index.
std::vector<int64_t> make_targets(int64_t N, int64_t V, uint64_t seed, int64_t ignore_every,
                                  int64_t ignore_index) {
  std::vector<int64_t> targets = Tensor::randint(0, V, {N}, seed).to_vector<int64_t>();
  if (ignore_every > 0)
    for (int64_t i = 0; i < N; i += ignore_every) targets[i] = ignore_index;
  return targets;
}

struct CrossEntropyReference {
  double loss = 0;
  std::vector<double> grad;  // d loss / d logits, [N, V]
};

// From the definition, in long double: loss = 1/count sum_{counted i} (log sum_j e^{x_ij} - x_{i,t_i}),
// grad_ij = (e^{x_ij} / sum_k e^{x_ik} - [j == t_i]) / count on counted rows, 0 elsewhere (and everywhere
// when no row counts).
CrossEntropyReference reference_cross_entropy(const std::vector<double>& x,
                                              const std::vector<int64_t>& targets, int64_t V,
                                              int64_t ignore_index) {
  const int64_t N = static_cast<int64_t>(targets.size());
  CrossEntropyReference r;
  r.grad.assign(x.size(), 0.0);
  int64_t count = 0;
  for (int64_t t : targets) count += t != ignore_index;
  long double total = 0;
  for (int64_t i = 0; i < N; ++i) {
    if (targets[i] == ignore_index) continue;
    long double sum = 0;
    for (int64_t j = 0; j < V; ++j) sum += std::exp(static_cast<long double>(x[i * V + j]));
    total += std::log(sum) - x[i * V + targets[i]];
    for (int64_t j = 0; j < V; ++j) {
      const long double p = std::exp(static_cast<long double>(x[i * V + j])) / sum;
      r.grad[i * V + j] = static_cast<double>((p - (j == targets[i] ? 1.0L : 0.0L)) / count);
    }
  }
  r.loss = count > 0 ? static_cast<double>(total / count) : 0.0;
  return r;
}

Tensor f64(const std::vector<double>& values, const Shape& shape) {
  return Tensor::from_vector(values, shape, DType::F64);
}

void expect_gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                      const std::vector<Tensor>& inputs) {
  const GradcheckResult result = gradcheck(f, inputs);
  EXPECT_TRUE(result.ok) << result.message;
}

}  // namespace

// ---- forward ---------------------------------------------------------------------------------------------

// Every dtype computes in fp32 (f64: f64) from exactly the logits the reference reads, so 16-bit logits
// have the same bound as f32: each row's lse - x_t is within a few float ulps of its size (|loss| ~ 4 here),
// and the mean of 37 such values is within ~1e-6 relative.
TEST(SoftmaxCrossEntropy, MatchesDoubleReferenceInEveryDtypeWithIgnoredRows) {
  const int64_t N = 37, V = 53;
  const std::vector<int64_t> targets = make_targets(N, V, 1, 5, -100);
  for (DType dtype : kFloatDtypes) {
    const Tensor logits = uniform_tensor({N, V}, 2, -4, 4, dtype);
    const Tensor loss = softmax_cross_entropy(logits, Tensor::from_vector(targets, {N}));
    EXPECT_EQ(loss.dim(), 0);
    EXPECT_EQ(loss.dtype(), dtype == DType::F64 ? DType::F64 : DType::F32) << dtype_name(dtype);
    const double expected = reference_cross_entropy(logits.to_vector<double>(), targets, V, -100).loss;
    const double tolerance = dtype == DType::F64 ? 1e-14 : 2e-6;
    EXPECT_NEAR(loss.item(), expected, tolerance * std::abs(expected)) << dtype_name(dtype);
  }
}

TEST(SoftmaxCrossEntropy, LeadingDimsAndI32TargetsAreRows) {
  const int64_t B = 3, T = 4, V = 7;
  const Tensor logits = uniform_tensor({B, T, V}, 3, -2, 2, DType::F64);
  const std::vector<int64_t> targets = make_targets(B * T, V, 4, 3, -100);
  std::vector<int32_t> targets32(targets.begin(), targets.end());
  const double expected = reference_cross_entropy(logits.to_vector<double>(), targets, V, -100).loss;
  EXPECT_NEAR(softmax_cross_entropy(logits, Tensor::from_vector(targets32, {B, T})).item(), expected, 1e-14);
  EXPECT_NEAR(softmax_cross_entropy(logits, Tensor::from_vector(targets, {B, T})).item(), expected, 1e-14);
  // Non-contiguous logits: the same rows read through a transposed view.
  const Tensor transposed = logits.transpose(0, 1).contiguous().transpose(0, 1);
  ASSERT_FALSE(transposed.is_contiguous());
  EXPECT_NEAR(softmax_cross_entropy(transposed, Tensor::from_vector(targets, {B, T})).item(), expected,
              1e-14);
}

// Large logits (|x| up to 80) would overflow e^x in float without the max shift.
TEST(SoftmaxCrossEntropy, LargeLogitsDoNotOverflow) {
  const int64_t N = 6, V = 9;
  const Tensor logits = uniform_tensor({N, V}, 5, -80, 80, DType::F32);
  const std::vector<int64_t> targets = make_targets(N, V, 6, 0, -100);
  const double expected = reference_cross_entropy(logits.to_vector<double>(), targets, V, -100).loss;
  EXPECT_NEAR(softmax_cross_entropy(logits, Tensor::from_vector(targets, {N})).item(), expected,
              1e-6 * std::abs(expected) + 1e-6);
}

TEST(SoftmaxCrossEntropy, CustomIgnoreIndexMayBeAClass) {
  const int64_t N = 10, V = 4;
  const Tensor logits = uniform_tensor({N, V}, 7, -1, 1, DType::F64);
  const std::vector<int64_t> targets = make_targets(N, V, 8, 0, -100);  // some rows have target 2
  const double expected = reference_cross_entropy(logits.to_vector<double>(), targets, V, 2).loss;
  EXPECT_NEAR(softmax_cross_entropy(logits, Tensor::from_vector(targets, {N}), 2).item(), expected, 1e-14);
  // Rows with target 2 really were dropped: the loss differs from the one counting every row.
  EXPECT_GT(std::abs(expected - reference_cross_entropy(logits.to_vector<double>(), targets, V, -100).loss),
            1e-3);
}

// The mean over zero rows is defined as 0 with gradient 0: a batch that is all padding must not poison
// training with NaN.
TEST(SoftmaxCrossEntropy, NoCountedRowGivesZeroLossAndZeroGradient) {
  for (DType dtype : kFloatDtypes) {
    Tensor logits = uniform_tensor({3, 5}, 9, -1, 1, dtype).requires_grad_();
    const Tensor loss = softmax_cross_entropy(logits, Tensor::full({3}, -100, DType::I64));
    EXPECT_EQ(loss.item(), 0.0) << dtype_name(dtype);
    backward(loss);
    for (double g : logits.grad().to_vector<double>()) EXPECT_EQ(g, 0.0) << dtype_name(dtype);
  }
  // No rows at all, or rows without classes that are all ignored.
  EXPECT_EQ(softmax_cross_entropy(Tensor::zeros({0, 5}), Tensor::zeros({0}, DType::I64)).item(), 0.0);
  EXPECT_EQ(softmax_cross_entropy(Tensor::zeros({3, 0}), Tensor::full({3}, -100, DType::I64)).item(), 0.0);
}

// ---- backward --------------------------------------------------------------------------------------------

TEST(SoftmaxCrossEntropy, GradientsMatchFiniteDifferencesWithIgnoredRows) {
  const int64_t N = 6, V = 5;
  const Tensor targets = Tensor::from_vector(make_targets(N, V, 10, 3, -100), {N});
  expect_gradcheck([&](const std::vector<Tensor>& in) { return softmax_cross_entropy(in[0], targets); },
                   {uniform_tensor({N, V}, 11, -2, 2, DType::F64)});
  // [B, T, V] through a non-contiguous view, i32 targets.
  const Tensor targets32 = Tensor::from_vector(std::vector<int32_t>{1, -100, 0, 3, 2, 4}, {2, 3});
  expect_gradcheck(
      [&](const std::vector<Tensor>& in) { return softmax_cross_entropy(in[0].transpose(0, 1), targets32); },
      {uniform_tensor({3, 2, V}, 12, -2, 2, DType::F64)});
}

// grad = (p - onehot) * g / count is formed in fp32 and rounded once: 16-bit grads are within 1 ulp of the
// rounded double value (p - 1 loses nothing here: with 53 classes and |x| <= 4 no p comes near 1). f32 is
// within a few float ulps of each value; f64 within 1e-15 of the scale g / count.
TEST(SoftmaxCrossEntropy, FusedGradientMatchesDoubleReferenceInEveryDtype) {
  const int64_t N = 37, V = 53;
  const double upstream = 2.5;
  const std::vector<int64_t> targets = make_targets(N, V, 13, 4, -100);
  for (DType dtype : kFloatDtypes) {
    Tensor logits = uniform_tensor({N, V}, 14, -4, 4, dtype).requires_grad_();
    const Tensor loss = softmax_cross_entropy(logits, Tensor::from_vector(targets, {N}));
    backward({loss}, {Tensor::scalar(upstream, loss.dtype())});
    std::vector<double> expected = reference_cross_entropy(logits.to_vector<double>(), targets, V, -100).grad;
    for (double& g : expected) g *= upstream;
    const Tensor reference = f64(expected, {N, V});
    EXPECT_EQ(logits.grad().dtype(), dtype);
    if (is_low_precision(dtype))
      EXPECT_TRUE(within_ulp(logits.grad(), reference, 1)) << dtype_name(dtype);
    else if (dtype == DType::F32)
      EXPECT_TRUE(all_close(logits.grad(), reference, 1e-9, 2e-6));
    else
      EXPECT_TRUE(all_close(logits.grad(), reference, 1e-16, 1e-13));
  }
}

// A vocabulary-sized row count takes the parallel path; the loss is summed in row order and each grad row
// is independent, so one and two threads agree bitwise.
TEST(SoftmaxCrossEntropy, ResultDoesNotDependOnThreadCount) {
  const int64_t N = 64, V = 3000;
  const Tensor targets = Tensor::from_vector(make_targets(N, V, 15, 7, -100), {N});
  const Tensor base = uniform_tensor({N, V}, 16, -5, 5, DType::F32);
  auto run = [&](int threads) {
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    Tensor logits = base.detach().requires_grad_();
    const Tensor loss = softmax_cross_entropy(logits, targets);
    backward(loss);
    omp_set_num_threads(saved);
    std::vector<double> values = logits.grad().to_vector<double>();
    values.push_back(loss.item());
    return values;
  };
  EXPECT_EQ(run(1), run(2));
  const double expected =
      reference_cross_entropy(base.to_vector<double>(), targets.to_vector<int64_t>(), V, -100).loss;
  EXPECT_NEAR(run(2).back(), expected, 2e-6 * expected);
}

// ---- errors ----------------------------------------------------------------------------------------------

TEST(SoftmaxCrossEntropy, RejectsTargetsOutOfRangeNamingValueRowAndV) {
  const Tensor logits = Tensor::zeros({4, 10});
  EXPECT_ERROR_MENTIONS(
      softmax_cross_entropy(logits, Tensor::from_vector(std::vector<int64_t>{1, 2, 10, 3}, {4})),
      "softmax_cross_entropy", "target 10", "row 2", "V = 10", "f32[4,10]");
  EXPECT_ERROR_MENTIONS(
      softmax_cross_entropy(logits, Tensor::from_vector(std::vector<int32_t>{-1, 0, 0, 0}, {4})),
      "softmax_cross_entropy", "target -1", "row 0", "V = 10");
  // -100 is only special when it is the ignore_index.
  EXPECT_ERROR_MENTIONS(
      softmax_cross_entropy(logits, Tensor::from_vector(std::vector<int64_t>{0, -100, 0, 0}, {4}), -1),
      "softmax_cross_entropy", "target -100", "row 1", "ignore_index -1");
}

TEST(SoftmaxCrossEntropy, RejectsBadShapesAndDtypes) {
  const Tensor logits = Tensor::zeros({4, 10});
  EXPECT_ERROR_MENTIONS(softmax_cross_entropy(logits, Tensor::zeros({5}, DType::I64)),
                        "softmax_cross_entropy", "i64[5]", "f32[4,10]", "[4]");
  EXPECT_ERROR_MENTIONS(softmax_cross_entropy(logits, Tensor::zeros({4, 1}, DType::I64)),
                        "softmax_cross_entropy", "i64[4,1]", "[4]");
  EXPECT_ERROR_MENTIONS(softmax_cross_entropy(logits, Tensor::zeros({4})), "softmax_cross_entropy", "targets",
                        "f32[4]", "i32 or i64");
  EXPECT_ERROR_MENTIONS(
      softmax_cross_entropy(Tensor::zeros({4, 10}, DType::I32), Tensor::zeros({4}, DType::I64)),
      "softmax_cross_entropy", "i32[4,10]", "floating");
  EXPECT_ERROR_MENTIONS(softmax_cross_entropy(Tensor::scalar(1), Tensor::scalar(0, DType::I64)),
                        "softmax_cross_entropy", "f32[]", "class dim");
}
