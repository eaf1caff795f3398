// Reductions (sum, mean, max, min, var, sum_to) and softmax / log_softmax: forward against plain double
// references, gradients against finite differences, and the errors bad arguments raise.
#include <gtest/gtest.h>
#include <omp.h>

#include <bit>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "autograd/gradcheck.h"
#include "tensor/cpu/lane_sum.h"
#include "tensor/ops.h"
#include "test_util.h"

using namespace mixtape;
using mixtape::testing::all_close;
using mixtape::testing::within_ulp;
using mixtape::testing::kFloatDtypes;
using mixtape::testing::uniform_tensor;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Plain C++ reference for a reduction over `dims` (normalised) of row-major values, accumulated in long
// double so that it is accurate beyond f64. `combine` folds one element into the running value.
std::vector<long double> reference_reduce(
    const std::vector<double>& x, const Shape& shape, const std::vector<int64_t>& dims, long double init,
    const std::function<long double(long double, long double)>& combine) {
  Shape out_shape = shape;
  for (int64_t d : dims) out_shape[d] = 1;
  std::vector<long double> out(static_cast<size_t>(shape_numel(out_shape)), init);
  const Strides out_strides = contiguous_strides(out_shape);
  for (int64_t i = 0; i < static_cast<int64_t>(x.size()); ++i) {
    int64_t rest = i, o = 0;
    for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
      const int64_t index = rest % shape[d];
      rest /= shape[d];
      if (out_shape[d] != 1) o += index * out_strides[d];
    }
    out[o] = combine(out[o], x[i]);
  }
  return out;
}

std::vector<long double> reference_sum(const Tensor& x, const std::vector<int64_t>& dims) {
  return reference_reduce(x.to_vector<double>(), x.shape(), dims, 0.0L,
                          [](long double a, long double v) { return a + v; });
}

Tensor as_f64_tensor(const std::vector<long double>& values, const Shape& shape) {
  return Tensor::from_vector(std::vector<double>(values.begin(), values.end()), shape, DType::F64);
}

Shape keep_shape(const Shape& shape, const std::vector<int64_t>& dims) {
  Shape out = shape;
  for (int64_t d : dims) out[d] = 1;
  return out;
}

void expect_gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                      const std::vector<Tensor>& inputs) {
  const GradcheckResult result = gradcheck(f, inputs);
  EXPECT_TRUE(result.ok) << result.message;
}

}  // namespace

// ---- sum
// ---------------------------------------------------------------------------------------------------

// Ulp bounds for sums of positive values (no cancellation, so the error is relative to the result):
// - f32 / f64: the kernel's accumulation chain for an output of 64 elements is at most 4 steps per lane,
//   4 pairwise levels over 16 lanes and 2 more combines; each step adds <= 1/2 ulp of a partial sum no
//   larger than the result: <= 10 ulp (the typical error is 0-2 ulp).
// - f16 / bf16: the float accumulation error is ~10 * 2^-24 relative, far below half an ulp of the 16-bit
//   result (2^-11 / 2^-8), so the single rounding on store is off by at most 1 ulp.
double sum_ulp_bound(DType dtype) { return is_low_precision(dtype) ? 1 : 10; }

TEST(Sum, MatchesDoubleReferenceOverEveryDimSetInEveryDtype) {
  const Shape shape = {5, 7, 64};
  const std::vector<std::vector<int64_t>> dim_sets = {{},     {0},    {1},    {2},   {-1},
                                                      {0, 2}, {2, 0}, {0, 1}, {1, 2}};
  for (DType dtype : kFloatDtypes) {
    const Tensor x = uniform_tensor(shape, 11, 0.5, 1.5, dtype);
    for (const auto& requested : dim_sets) {
      std::vector<int64_t> dims;
      for (int64_t d : requested) dims.push_back(d < 0 ? d + 3 : d);
      if (dims.empty()) dims = {0, 1, 2};
      std::sort(dims.begin(), dims.end());
      const Shape kept = keep_shape(shape, dims);
      const Tensor reference = as_f64_tensor(reference_sum(x, dims), kept);
      for (bool keepdim : {true, false}) {
        const Tensor out = sum(x, requested, keepdim);
        EXPECT_EQ(out.dtype(), dtype);
        const Tensor expected = keepdim ? reference : reference.reshape(out.shape());
        if (keepdim) {
          EXPECT_EQ(out.shape(), kept);
        }
        EXPECT_TRUE(within_ulp(out, expected, sum_ulp_bound(dtype)))
            << dtype_name(dtype) << " dims " << shape_str(requested) << " keepdim " << keepdim;
      }
    }
  }
}

TEST(Sum, DropsReducedDimsUnlessKeepdim) {
  const Tensor x = Tensor::zeros({2, 3, 4});
  EXPECT_EQ(sum(x).shape(), Shape{});
  EXPECT_EQ(sum(x, {}, true).shape(), (Shape{1, 1, 1}));
  EXPECT_EQ(sum(x, {1}).shape(), (Shape{2, 4}));
  EXPECT_EQ(sum(x, {-1, 0}, true).shape(), (Shape{1, 3, 1}));
}

// Long reductions are cut into chunks (8192 elements along a row, 128 rows down a column); the partials
// are combined pairwise. Sums of 1..n are exact in f64 and checkable against n(n+1)/2.
TEST(Sum, LongRowsAndLongColumnsAreExactOnIntegers) {
  const int64_t n = 100003;
  const Tensor row = Tensor::arange(1, n + 1, 1, DType::F64);
  EXPECT_EQ(sum(row).item(), static_cast<double>(n) * (n + 1) / 2);
  const Tensor columns = Tensor::arange(1, n + 1, 1, DType::F64).view({n, 1}).expand({n, 3});
  EXPECT_EQ(sum(columns, {0}).to_vector<double>(),
            std::vector<double>(3, static_cast<double>(n) * (n + 1) / 2));
}

TEST(Sum, LongF32ReductionsStayAccurate) {
  // 2^20 values in [0.5, 1.5): a single float chain would drift by ~n * eps / 2 ~ 3e-2 relative worst case;
  // the chunked, pairwise kernel stays within a few ulp. Row mode (dim 1) and column mode (dim 0).
  const Tensor x = uniform_tensor({1024, 1024}, 5, 0.5, 1.5, DType::F32);
  const Tensor total = as_f64_tensor(reference_sum(x, {0, 1}), {});
  EXPECT_TRUE(within_ulp(sum(x), total, 16));
  EXPECT_TRUE(within_ulp(sum(x.to(DType::F64)), total, 4));
  EXPECT_TRUE(within_ulp(sum(x, {0}), as_f64_tensor(reference_sum(x, {0}), {1024}), 16));
  EXPECT_TRUE(within_ulp(sum(x, {1}), as_f64_tensor(reference_sum(x, {1}), {1024}), 16));
}

TEST(Sum, NonContiguousAndBroadcastInputs) {
  const Tensor base = uniform_tensor({6, 5, 4}, 3, -1, 1, DType::F64);
  const Tensor x = base.permute({2, 0, 1}).slice(1, 0, 6, 2);  // [4, 3, 5], strided
  const Tensor dense = x.contiguous();
  for (const std::vector<int64_t>& dims : std::vector<std::vector<int64_t>>{{0}, {1}, {2}, {0, 2}, {}}) {
    std::vector<int64_t> all = dims.empty() ? std::vector<int64_t>{0, 1, 2} : dims;
    const Tensor reference = as_f64_tensor(reference_sum(dense, all), keep_shape(dense.shape(), all));
    EXPECT_TRUE(all_close(sum(x, dims, true), reference, 1e-14, 1e-13)) << shape_str(dims);
  }
  const Tensor broadcast = Tensor::from_vector(std::vector<double>{1, 2, 3}, {3, 1}).expand({3, 4});
  EXPECT_EQ(sum(broadcast, {1}).to_vector<double>(), (std::vector<double>{4, 8, 12}));
}

TEST(Sum, ResultDoesNotDependOnThreadCount) {
  const Tensor x = uniform_tensor({300, 700}, 9, -1, 1, DType::F32);
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const std::vector<double> one[3] = {sum(x).to_vector<double>(), sum(x, {0}).to_vector<double>(),
                                      sum(x, {1}).to_vector<double>()};
  omp_set_num_threads(2);
  const std::vector<double> two[3] = {sum(x).to_vector<double>(), sum(x, {0}).to_vector<double>(),
                                      sum(x, {1}).to_vector<double>()};
  omp_set_num_threads(threads);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(one[i], two[i]);
}

TEST(Sum, EmptyDimSumsToZeroAndZeroDimIsItself) {
  EXPECT_EQ(sum(Tensor::zeros({3, 0}), {1}).to_vector<double>(), (std::vector<double>{0, 0, 0}));
  EXPECT_EQ(sum(Tensor::scalar(2.5)).item(), 2.5);
  EXPECT_EQ(sum(Tensor::scalar(2.5), {0}).item(), 2.5);
}

TEST(Sum, GradientIsTheBroadcastGradient) {
  const Tensor x = uniform_tensor({3, 4, 5}, 21, -1, 1, DType::F64);
  const std::vector<std::vector<int64_t>> dim_sets = {{}, {0}, {1}, {-1}, {0, 2}, {1, 2}};
  for (const auto& dims : dim_sets)
    for (bool keepdim : {true, false})
      expect_gradcheck([&](const std::vector<Tensor>& in) { return sum(in[0], dims, keepdim); }, {x});
  // Non-contiguous input.
  expect_gradcheck([](const std::vector<Tensor>& in) { return sum(in[0].transpose(0, 2), {1}); }, {x});
}

TEST(Sum, RejectsBadDimsAndIntegerInputs) {
  const Tensor x = Tensor::zeros({2, 3});
  EXPECT_ERROR_MENTIONS(sum(x, {2}), "sum", "dim 2", "f32[2,3]");
  EXPECT_ERROR_MENTIONS(sum(x, {-3}), "sum", "dim -3", "f32[2,3]");
  EXPECT_ERROR_MENTIONS(sum(x, {1, -1}), "sum", "more than once", "f32[2,3]");
  EXPECT_ERROR_MENTIONS(sum(Tensor::zeros({2}, DType::I64)), "sum", "i64[2]", "floating");
}

// ---- sum_to --------------------------------------------------------------------------------------------

TEST(SumTo, SumsLeadingAndBroadcastDimsInEveryDtype) {
  const Shape shape = {4, 3, 5};
  for (DType dtype : kFloatDtypes) {
    const Tensor x = uniform_tensor(shape, 31, 0.5, 1.5, dtype);
    struct Case {
      Shape target;
      std::vector<int64_t> dims;  // what the reference reduces over
    };
    for (const Case& c : std::vector<Case>{{{3, 5}, {0}},
                                           {{5}, {0, 1}},
                                           {{3, 1}, {0, 2}},
                                           {{1, 1, 5}, {0, 1}},
                                           {{4, 1, 5}, {1}},
                                           {{1}, {0, 1, 2}},
                                           {{}, {0, 1, 2}}}) {
      const Tensor reference =
          as_f64_tensor(reference_sum(x, c.dims), keep_shape(shape, c.dims)).reshape(c.target);
      const Tensor out = sum_to(x, c.target);
      EXPECT_EQ(out.shape(), c.target);
      EXPECT_TRUE(within_ulp(out, reference, sum_ulp_bound(dtype)))
          << dtype_name(dtype) << shape_str(c.target);
    }
  }
}

TEST(Sum, FloatSummedColumnSumsGiveTheSameBitsContiguousOrStrided) {
  // A contiguous f32, f16 or bf16 input summed over its leading dims takes the register-held column sums
  // (AVX-512); the same values read with a column stride of 2 take the generic loop. Both sum each column in the same
  // order, so their bits must agree: widths that leave 256-, 64-, 16-column and scalar parts, rows that span
  // several 128-row chunks, an outer kept dim, and leading dims that are not one run.
  for (DType dtype : {DType::BF16, DType::F16, DType::F32}) {
    for (int64_t C : {1000, 256, 77, 5}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " C " + std::to_string(C));
      // Values over twenty binades, so that float sums round and the order of the additions shows.
      const Tensor mantissas = uniform_tensor({3, 150, 2 * C}, 41 + C, -2.0, 2.0, DType::F64);
      const Tensor binades = uniform_tensor({3, 150, 2 * C}, 42 + C, -10.0, 10.0, DType::F64);
      std::vector<double> values = mantissas.to_vector<double>();
      const std::vector<double> exponents = binades.to_vector<double>();
      for (size_t i = 0; i < values.size(); ++i) values[i] = std::ldexp(values[i], static_cast<int>(exponents[i]));
      const Tensor wide = Tensor::from_vector(values, {3, 150, 2 * C}, DType::F64).to(dtype);
      const Tensor strided = wide.slice(2, 0, 2 * C, 2);  // [3, 150, C], column stride 2
      const Tensor contiguous = strided.contiguous();
      for (const std::vector<int64_t>& dims : std::vector<std::vector<int64_t>>{{1}, {0, 1}, {0}}) {
        const Tensor a = sum(contiguous, dims), b = sum(strided, dims);
        EXPECT_EQ(a.to_vector<double>(), b.to_vector<double>()) << "dims " << dims.size() << " " << dims[0];
      }
    }
  }
}

TEST(SumTo, SameShapeIsTheInputItself) {
  const Tensor x = Tensor::ones({2, 3});
  EXPECT_TRUE(sum_to(x, {2, 3}).same(x));
  // A leading dim of size 1 needs no arithmetic, only a reshape.
  const Tensor y = sum_to(Tensor::arange(0, 3).view({1, 3}), {3});
  EXPECT_EQ(y.shape(), Shape{3});
  EXPECT_EQ(y.to_vector<double>(), (std::vector<double>{0, 1, 2}));
}

TEST(SumTo, GradientIsTheBroadcastGradient) {
  const Tensor x = uniform_tensor({2, 3, 4}, 41, -1, 1, DType::F64);
  for (const Shape& target : std::vector<Shape>{{3, 4}, {4}, {3, 1}, {2, 1, 4}, {1}, {}})
    expect_gradcheck([&](const std::vector<Tensor>& in) { return sum_to(in[0], target); }, {x});
}

TEST(SumTo, RejectsShapesThatDoNotBroadcast) {
  const Tensor x = Tensor::zeros({2, 3});
  EXPECT_ERROR_MENTIONS(sum_to(x, {2}), "sum_to", "f32[2,3]", "[2]");
  EXPECT_ERROR_MENTIONS(sum_to(x, {1, 2, 3}), "sum_to", "f32[2,3]", "[1,2,3]");
}

// ---- mean ----------------------------------------------------------------------------------------------

// mean = sum / n: the sum's bound plus one rounding of the division (f32/f64 <= 11 ulp, 16-bit <= 1 ulp: the
// division happens in float before the single rounding on store).
TEST(Mean, MatchesDoubleReferenceInEveryDtype) {
  const Shape shape = {6, 5, 48};
  for (DType dtype : kFloatDtypes) {
    const Tensor x = uniform_tensor(shape, 51, 0.5, 1.5, dtype);
    for (const std::vector<int64_t>& dims : std::vector<std::vector<int64_t>>{{0, 1, 2}, {0}, {2}, {0, 2}}) {
      std::vector<long double> reference = reference_sum(x, dims);
      int64_t n = 1;
      for (int64_t d : dims) n *= shape[d];
      for (long double& v : reference) v /= n;
      const Tensor out = mean(x, dims, true);
      EXPECT_TRUE(
          within_ulp(out, as_f64_tensor(reference, keep_shape(shape, dims)), sum_ulp_bound(dtype) + 1))
          << dtype_name(dtype) << shape_str(dims);
    }
  }
  EXPECT_EQ(mean(Tensor::arange(0, 10, 1, DType::F64)).item(), 4.5);
  EXPECT_TRUE(std::isnan(mean(Tensor::zeros({0})).item()));  // 0 / 0, as in torch
}

TEST(Mean, GradientIsOneOverNBroadcast) {
  const Tensor x = uniform_tensor({3, 4, 5}, 52, -1, 1, DType::F64);
  for (const std::vector<int64_t>& dims : std::vector<std::vector<int64_t>>{{}, {1}, {0, -1}})
    for (bool keepdim : {true, false})
      expect_gradcheck([&](const std::vector<Tensor>& in) { return mean(in[0], dims, keepdim); }, {x});
  expect_gradcheck([](const std::vector<Tensor>& in) { return mean(in[0].transpose(0, 1), {0}); }, {x});
}

TEST(Mean, RejectsBadDims) {
  EXPECT_ERROR_MENTIONS(mean(Tensor::zeros({2, 3}, DType::F16), {5}), "mean", "dim 5", "f16[2,3]");
}

// ---- max / min -------------------------------------------------------------------------------------------

// Max and min select an input element: the result is exact in every dtype (0 ulp).
TEST(MaxMin, SelectTheExtremeElementExactlyInEveryDtype) {
  const Shape shape = {4, 6, 37};
  for (DType dtype : kFloatDtypes) {
    const Tensor x = uniform_tensor(shape, 61, -5, 5, dtype);
    const std::vector<double> values = x.to_vector<double>();
    for (const std::vector<int64_t>& dims :
         std::vector<std::vector<int64_t>>{{0, 1, 2}, {0}, {1}, {2}, {0, 2}}) {
      const auto greater = [](long double a, long double v) { return v > a ? v : a; };
      const auto smaller = [](long double a, long double v) { return v < a ? v : a; };
      const long double inf = std::numeric_limits<long double>::infinity();
      const Shape kept = keep_shape(shape, dims);
      EXPECT_TRUE(within_ulp(max(x, dims, true),
                             as_f64_tensor(reference_reduce(values, shape, dims, -inf, greater), kept), 0))
          << dtype_name(dtype) << shape_str(dims);
      EXPECT_TRUE(within_ulp(min(x, dims, true),
                             as_f64_tensor(reference_reduce(values, shape, dims, inf, smaller), kept), 0))
          << dtype_name(dtype) << shape_str(dims);
    }
  }
}

TEST(MaxMin, PropagateNaNAndHandleInfinities) {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  const Tensor x =
      Tensor::from_vector(std::vector<double>{1, nan, 3, -inf, -inf, -inf, 2, inf, 0}, {3, 3}, DType::F32);
  const std::vector<double> largest = max(x, {1}).to_vector<double>(),
                            smallest = min(x, {1}).to_vector<double>();
  EXPECT_TRUE(std::isnan(largest[0]));
  EXPECT_TRUE(std::isnan(smallest[0]));
  EXPECT_EQ(largest[1], -inf);
  EXPECT_EQ(largest[2], inf);
  EXPECT_EQ(smallest[2], 0);
}

TEST(MaxMin, GradientGoesToTheExtremeElement) {
  const Tensor x = uniform_tensor({3, 4, 5}, 62, -1, 1, DType::F64);  // distinct values
  for (const std::vector<int64_t>& dims : std::vector<std::vector<int64_t>>{{}, {0}, {2}, {0, 2}})
    for (bool keepdim : {true, false}) {
      expect_gradcheck([&](const std::vector<Tensor>& in) { return max(in[0], dims, keepdim); }, {x});
      expect_gradcheck([&](const std::vector<Tensor>& in) { return min(in[0], dims, keepdim); }, {x});
    }
}

TEST(MaxMin, GradientIsSplitEvenlyAmongTies) {
  // Two tied maxima: the central difference at a tie is (1 + 0) / 2, which is the even split, so gradcheck
  // applies. Rows: a pair tied at the max, a pair tied at the min, and no ties.
  const Tensor pairs = Tensor::from_vector(std::vector<double>{3, 1, 3, 2, 0, 5, 0, 4, 1, 2, 3, 4}, {3, 4});
  expect_gradcheck([](const std::vector<Tensor>& in) { return max(in[0], {1}); }, {pairs});
  expect_gradcheck([](const std::vector<Tensor>& in) { return min(in[0], {1}); }, {pairs});
  // Three ties each get a third (torch.amax semantics).
  Tensor x = Tensor::from_vector(std::vector<double>{2, 7, 7, 1, 7}, {5}).requires_grad_();
  backward(max(x));
  EXPECT_TRUE(all_close(x.grad(), Tensor::from_vector(std::vector<double>{0, 1. / 3, 1. / 3, 0, 1. / 3}, {5}),
                        1e-15, 0));
}

// An infinite extremum takes the gradient like any other: the ties are found by comparison (inf - inf would be
// NaN, and every element got NaN). norm(x, inf) is max(|x|) and follows; f16 overflowing to inf is the case
// mixed precision meets.
TEST(MaxMin, GradientGoesToAnInfiniteExtremum) {
  const double inf = std::numeric_limits<double>::infinity();
  for (DType dtype : {DType::F32, DType::F16, DType::BF16, DType::F64}) {
    SCOPED_TRACE(dtype_name(dtype));
    Tensor x = Tensor::from_vector(std::vector<double>{1, inf, 2, -inf, 3, inf}, {2, 3}, dtype).requires_grad_();
    backward(max(x));
    EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{0, 0.5, 0, 0, 0, 0.5}));
    x.set_grad(Tensor());
    backward(sum(min(x, {1})));
    EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{1, 0, 0, 1, 0, 0}));
    Tensor z = Tensor::from_vector(std::vector<double>{1, -inf, 2}, {3}, dtype).requires_grad_();
    backward(norm(z, inf));
    EXPECT_EQ(z.grad().to_vector<double>(), (std::vector<double>{0, -1, 0}));
  }
}

TEST(MaxMin, RejectEmptyReductionsAndBadDims) {
  EXPECT_ERROR_MENTIONS(max(Tensor::zeros({2, 0}), {1}), "max", "empty", "f32[2,0]");
  EXPECT_ERROR_MENTIONS(min(Tensor::zeros({2, 3}), {0, 3}), "min", "dim 3", "f32[2,3]");
}

// ---- var -------------------------------------------------------------------------------------------------

std::vector<long double> reference_var(const Tensor& x, const std::vector<int64_t>& dims,
                                       int64_t correction) {
  const std::vector<double> values = x.to_vector<double>();
  std::vector<long double> means = reference_sum(x, dims);
  int64_t n = 1;
  for (int64_t d : dims) n *= x.shape()[d];
  for (long double& m : means) m /= n;
  // Squared deviations from each output's mean: reduce (x - mean[o])^2 with the same index mapping.
  const Shape kept = keep_shape(x.shape(), dims);
  const Strides kept_strides = contiguous_strides(kept);
  std::vector<long double> squares(means.size(), 0);
  for (int64_t i = 0; i < x.numel(); ++i) {
    int64_t rest = i, o = 0;
    for (int64_t d = x.dim() - 1; d >= 0; --d) {
      if (kept[d] != 1) o += (rest % x.shape()[d]) * kept_strides[d];
      rest /= x.shape()[d];
    }
    squares[o] += (values[i] - means[o]) * (values[i] - means[o]);
  }
  for (long double& s : squares) s /= (n - correction);
  return squares;
}

// Two-pass variance of values with mean ~3 and spread ~1 (no catastrophic cancellation): the squares sum
// like the sums above (<= 10 ulp in f32/f64, dominated by the chunked accumulation of 40-element outputs),
// plus the effect of the float mean's error, which is second order; 16-bit results <= 1 ulp after one
// rounding.
TEST(Var, MatchesTwoPassDoubleReferenceInEveryDtype) {
  const Shape shape = {5, 8, 40};
  for (DType dtype : kFloatDtypes) {
    const Tensor x = uniform_tensor(shape, 71, 2, 4, dtype);
    for (const std::vector<int64_t>& dims : std::vector<std::vector<int64_t>>{{0, 1, 2}, {0}, {2}, {0, 2}})
      for (int64_t correction : {0, 1, 2}) {
        const Tensor out = var(x, dims, correction, true);
        EXPECT_TRUE(within_ulp(out,
                               as_f64_tensor(reference_var(x, dims, correction), keep_shape(shape, dims)),
                               sum_ulp_bound(dtype) + 2))
            << dtype_name(dtype) << shape_str(dims) << " correction " << correction;
      }
  }
}

TEST(Var, LargeMeanDoesNotCancel) {
  // Values 1e6 + {0, 1, 2, 3}: E[x^2] - E[x]^2 would lose everything in f32; the two-pass result is exact.
  const Tensor x = Tensor::from_vector(std::vector<double>{1e6, 1e6 + 1, 1e6 + 2, 1e6 + 3}, {4}, DType::F32);
  EXPECT_EQ(var(x, {}, 0).item(), 1.25);
  EXPECT_EQ(var(x).item(), static_cast<double>(static_cast<float>(5.0 / 3.0)));  // 5 / (4 - 1), rounded once
}

TEST(Var, GradientIsTwiceTheDeviationOverNMinusCorrection) {
  const Tensor x = uniform_tensor({3, 4, 5}, 72, -1, 1, DType::F64);
  for (const std::vector<int64_t>& dims : std::vector<std::vector<int64_t>>{{}, {1}, {0, 2}})
    for (int64_t correction : {0, 1})
      for (bool keepdim : {true, false})
        expect_gradcheck([&](const std::vector<Tensor>& in) { return var(in[0], dims, correction, keepdim); },
                         {x});
}

TEST(Var, RejectsNegativeCorrectionAndBadDims) {
  EXPECT_ERROR_MENTIONS(var(Tensor::zeros({2, 3}), {1}, -1), "var", "correction", "f32[2,3]");
  EXPECT_ERROR_MENTIONS(var(Tensor::zeros({2, 3}), {2}), "var", "dim 2", "f32[2,3]");
}

// ---- norm ------------------------------------------------------------------------------------------------

// (sum |x|^p)^(1/p) (max |x| for inf) in long double.
std::vector<long double> reference_norm(const Tensor& x, double p, const std::vector<int64_t>& dims) {
  if (std::isinf(p))
    return reference_reduce(x.to_vector<double>(), x.shape(), dims, 0.0L,
                            [](long double a, long double v) { return std::max(a, std::fabs(v)); });
  std::vector<long double> out = reference_reduce(
      x.to_vector<double>(), x.shape(), dims, 0.0L,
      [p](long double a, long double v) { return a + std::pow(std::fabs(v), static_cast<long double>(p)); });
  for (long double& v : out) v = std::pow(v, 1.0L / p);
  return out;
}

// Values of both signs in [-3, 3), 40-element reductions. Bounds: p = 1 and inf are a sum of |x| (the sums'
// <= 10 ulp) and an exact max; p = 2 sums squares (<= 10 ulp, plus the squares' own 1/2 ulp) and the
// square root halves that relative error and adds 1/2 ulp; for other p, each |x|^p and the sum give ~11 ulp
// relative, the 1/p power multiplies that by 1/p (at most 2 here, p >= 0.5) and adds its own 1-2 ulp: bound
// 12 ulp in f32/f64. 16-bit: computed in fp32, off by at most 1 ulp after one rounding.
TEST(Norm, MatchesLongDoubleReferenceForEveryPInEveryDtype) {
  const Shape shape = {5, 8, 40};
  const std::vector<std::vector<int64_t>> kNormDims = {{0, 1, 2}, {0}, {2}, {0, 2}};
  for (DType dtype : kFloatDtypes) {
    const Tensor x = uniform_tensor(shape, 81, -3, 3, dtype);
    for (double p : {2.0, 1.0, kInf, 3.0, 1.5, 0.5})
      for (const std::vector<int64_t>& dims : kNormDims) {
        const Tensor out = norm(x, p, dims, true);
        EXPECT_EQ(out.dtype(), dtype);
        EXPECT_TRUE(within_ulp(out, as_f64_tensor(reference_norm(x, p, dims), keep_shape(shape, dims)),
                               is_low_precision(dtype) ? 1 : 12))
            << dtype_name(dtype) << " p " << p << " dims " << shape_str(dims);
      }
  }
  // The default is the 2-norm over every element, without kept dims.
  const Tensor v = Tensor::from_vector(std::vector<float>{3, -4}, {2});
  EXPECT_EQ(norm(v).item(), 5.0);
  EXPECT_EQ(norm(v).dim(), 0);
  EXPECT_EQ(norm(Tensor::zeros({2, 3}), 2, {1}).shape(), (Shape{2}));
}

TEST(Norm, SixteenBitInputsDoNotOverflowInTheirOwnDtype) {
  // 300^2 = 90000 is above fp16's 65504: squared in fp16 the norm would be inf; it is computed in fp32.
  const Tensor x = Tensor::full({4}, 300.0, DType::F16);
  EXPECT_EQ(norm(x).item(), 600.0);
}

TEST(Norm, GradientsMatchFiniteDifferences) {
  const Tensor x = uniform_tensor({3, 4, 5}, 82, -1, 1, DType::F64);
  for (double p : {2.0, 1.0, kInf, 3.0, 1.5, 0.5})
    for (const std::vector<int64_t>& dims : std::vector<std::vector<int64_t>>{{}, {1}, {0, 2}})
      for (bool keepdim : {true, false})
        expect_gradcheck([&](const std::vector<Tensor>& in) { return norm(in[0], p, dims, keepdim); }, {x});
}

// Where the norm is not differentiable PyTorch's subgradient is used: 0 where the norm is 0 (no NaN), 0 at
// x_i = 0 for p < 2 and p = 1, and for inf the gradient split among the tied maxima with their signs.
TEST(Norm, GradientIsZeroWhereTheNormIsZeroAndSplitAmongTiesForInf) {
  for (double p : {2.0, 1.0, kInf, 3.0, 0.5}) {
    const Tensor zeros = Tensor::zeros({2, 3}, DType::F64).requires_grad_();
    backward(sum(norm(zeros, p, {1})));
    EXPECT_EQ(zeros.grad().to_vector<double>(), std::vector<double>(6, 0.0)) << "p " << p;
    const Tensor some = Tensor::from_vector(std::vector<double>{0, 2, -1}, {3}, DType::F64).requires_grad_();
    backward(norm(some, p));
    EXPECT_EQ(some.grad().to_vector<double>()[0], 0.0) << "p " << p;
  }
  const Tensor x = Tensor::from_vector(std::vector<double>{3, -3, 1, 0}, {4}, DType::F64).requires_grad_();
  backward(norm(x, kInf));
  EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{0.5, -0.5, 0, 0}));
  // p = 2: x / norm, in the input's dtype.
  const Tensor h = Tensor::from_vector(std::vector<float>{3, -4}, {2}, DType::BF16).requires_grad_();
  backward(norm(h));
  EXPECT_EQ(h.grad().dtype(), DType::BF16);
  EXPECT_EQ(h.grad().to_vector<double>(), (std::vector<double>{0.6015625, -0.80078125}));  // 0.6, -0.8
}

// For p < 1 the gradient sign(x) |x|^(p-1) norm^(1-p) is large but finite at tiny x: x |x|^(p-2) would
// overflow there (|x|^(p-2) = 1e45 for x = 1e-30, p = 0.5, beyond f32). Here the norm is (1e-15 + 1)^2, 1 in
// f32, so the gradient is (1e-30)^-0.5 = 1e15 and 1.
TEST(Norm, GradientOfSmallPStaysFiniteAtTinyInputs) {
  const Tensor x = Tensor::from_vector(std::vector<float>{1e-30f, 1}, {2}).requires_grad_();
  backward(norm(x, 0.5));
  const std::vector<double> g = x.grad().to_vector<double>();
  EXPECT_NEAR(g[0], 1e15, 1e15 * 1e-6);
  EXPECT_NEAR(g[1], 1.0, 1e-6);
}

// 16-bit inputs: the backward computes in fp32 and rounds once, so each gradient element is within 1 ulp of
// the exact (f64) gradient of the same 16-bit values; a transposed input gives the transposed gradient.
TEST(Norm, SixteenBitAndStridedGradientsMatchTheF64Gradient) {
  for (DType dtype : {DType::BF16, DType::F16})
    for (double p : {2.0, 3.0, 1.5, 0.5, 1.0, kInf}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " p " + std::to_string(p));
      const Tensor values = uniform_tensor({4, 6}, 83, -2, 2, dtype);
      const Tensor x = values.detach().requires_grad_(), exact = values.to(DType::F64).requires_grad_();
      backward(sum(norm(x, p, {1})));
      backward(sum(norm(exact, p, {1})));
      EXPECT_EQ(x.grad().dtype(), dtype);
      EXPECT_TRUE(within_ulp(x.grad(), exact.grad(), 1));
      const Tensor t = values.detach().transpose(0, 1).requires_grad_();  // [6, 4], strided
      backward(sum(norm(t, p, {0})));
      EXPECT_TRUE(all_close(t.grad(), x.grad().transpose(0, 1), 0, 0));
    }
}

TEST(Norm, UnsupportedPAndBadArgumentsAreErrors) {
  const Tensor x = Tensor::zeros({2, 3});
  for (double p : {0.0, -1.0, -kInf, std::nan("")})
    EXPECT_ERROR_MENTIONS(norm(x, p), "not supported: norm with p", "f32[2,3]", "p > 0");
  EXPECT_ERROR_MENTIONS(norm(x, 2, {2}), "norm", "dim 2", "f32[2,3]");
  EXPECT_ERROR_MENTIONS(norm(Tensor::zeros({2}, DType::I64)), "norm", "floating");
  EXPECT_ERROR_MENTIONS(norm(Tensor::zeros({2, 0}), kInf, {1}), "norm", "inf norm", "empty");
  EXPECT_EQ(norm(Tensor::zeros({2, 0}), 2, {1}).to_vector<double>(), (std::vector<double>{0, 0}));
}

// ---- softmax / log_softmax -------------------------------------------------------------------------------

// Reference along `dim` of row-major values, in long double: softmax_j = exp(x_j - m) / sum_k exp(x_k - m).
std::vector<double> reference_softmax(const Tensor& x, int64_t dim, bool log) {
  const std::vector<double> values = x.to_vector<double>();
  std::vector<double> out(values.size());
  const int64_t n = x.shape()[dim];
  int64_t inner = 1;
  for (int64_t d = dim + 1; d < x.dim(); ++d) inner *= x.shape()[d];
  const int64_t outer = x.numel() / (n * inner);
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = 0; i < inner; ++i) {
      auto at = [&](int64_t j) { return static_cast<size_t>((o * n + j) * inner + i); };
      long double m = -std::numeric_limits<long double>::infinity(), total = 0;
      for (int64_t j = 0; j < n; ++j) m = std::max<long double>(m, values[at(j)]);
      for (int64_t j = 0; j < n; ++j) total += std::exp(static_cast<long double>(values[at(j)]) - m);
      for (int64_t j = 0; j < n; ++j) {
        const long double shifted = values[at(j)] - m;
        out[at(j)] = static_cast<double>(log ? shifted - std::log(total) : std::exp(shifted) / total);
      }
    }
  return out;
}

// Bounds, for inputs in [-6, 6) so that |x - max| <= 12 (u = 2^-24 in f32, 2^-53 in f64):
// - every exp(x_j - m) inherits the rounding of x_j - m: a relative error of up to |x_j - m| u/2 = 6u. exp
//   itself, the row sum (the 1 kept apart) and the final division or log1p add ~3u more. A relative error
//   of 9u is up to 18 ulp for a value at the bottom of its binade: bound 20 ulp for softmax and log_softmax
//   (log_softmax = (x - m) - log1p(rest) subtracts values of one sign, so nothing cancels).
// - 16-bit: the float result is within ~9 * 2^-24 relative of exact, far below half an ulp: <= 1 ulp.
double softmax_ulp_bound(DType dtype) { return is_low_precision(dtype) ? 1 : 20; }

TEST(Softmax, MatchesDoubleReferenceOverEveryDimInEveryDtype) {
  const Shape shape = {3, 17, 40};
  for (DType dtype : kFloatDtypes) {
    const Tensor x = uniform_tensor(shape, 81, -6, 6, dtype);
    for (int64_t dim : {0, 1, 2, -1}) {
      const int64_t d = dim < 0 ? dim + 3 : dim;
      const Tensor y = softmax(x, dim), log_y = log_softmax(x, dim);
      EXPECT_EQ(y.dtype(), dtype);
      EXPECT_TRUE(within_ulp(y, Tensor::from_vector(reference_softmax(x, d, false), shape, DType::F64),
                             softmax_ulp_bound(dtype)))
          << dtype_name(dtype) << " dim " << dim;
      EXPECT_TRUE(within_ulp(log_y, Tensor::from_vector(reference_softmax(x, d, true), shape, DType::F64),
                             softmax_ulp_bound(dtype)))
          << dtype_name(dtype) << " log, dim " << dim;
    }
  }
}

TEST(Softmax, RowsSumToOneAndLargeInputsDoNotOverflow) {
  // exp(1000) overflows even f64; subtracting the row max keeps every exponent <= 0.
  const Tensor x =
      Tensor::from_vector(std::vector<double>{1000, 1001, 1002, -1000, 0, 1000}, {2, 3}, DType::F32);
  const std::vector<double> y = softmax(x, 1).to_vector<double>();
  for (double v : y) EXPECT_TRUE(std::isfinite(v));
  EXPECT_NEAR(y[0] + y[1] + y[2], 1.0, 1e-6);
  EXPECT_NEAR(y[5], 1.0, 1e-6);
  EXPECT_NEAR(log_softmax(x, 1).to_vector<double>()[3], -2000.0, 1e-3);
  // A masked (-inf) entry gets exactly zero probability.
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<double> masked =
      softmax(Tensor::from_vector(std::vector<double>{0, -inf, 0}, {3}, DType::BF16), 0).to_vector<double>();
  EXPECT_EQ(masked, (std::vector<double>{0.5, 0, 0.5}));
}

TEST(Softmax, WidelySpreadLogitsKeepTheirRelativeAccuracy) {
  // Logits in [-80, 0): probabilities down to e^-80 ~ 2e-35 (still normal floats). Each exp(x - m) inherits
  // the rounding of x - m, |x - m| u/2 <= 40 * 2^-24 ~ 2.4e-6 relative, plus a few ulp: bound 4e-6.
  const Tensor x = uniform_tensor({8, 200}, 86, -80, 0, DType::F32);
  const Tensor reference = Tensor::from_vector(reference_softmax(x, 1, false), {8, 200}, DType::F64);
  EXPECT_TRUE(all_close(softmax(x, 1), reference, 0, 4e-6));
  const Tensor log_reference = Tensor::from_vector(reference_softmax(x, 1, true), {8, 200}, DType::F64);
  EXPECT_TRUE(all_close(log_softmax(x, 1), log_reference, 0, 1e-6));
}

TEST(Softmax, NonContiguousInput) {
  const Tensor base = uniform_tensor({5, 4, 6}, 82, -3, 3, DType::F64);
  const Tensor x = base.permute({2, 0, 1});  // [6, 5, 4], strided
  for (int64_t dim : {0, 1, 2}) {
    const Tensor reference =
        Tensor::from_vector(reference_softmax(x.contiguous(), dim, false), x.shape(), DType::F64);
    EXPECT_TRUE(all_close(softmax(x, dim), reference, 1e-15, 1e-14)) << dim;
  }
}

TEST(Softmax, GradientsMatchFiniteDifferences) {
  const Tensor x = uniform_tensor({2, 5, 3}, 83, -2, 2, DType::F64);
  for (int64_t dim : {1, -1, 0}) {
    expect_gradcheck([&](const std::vector<Tensor>& in) { return softmax(in[0], dim); }, {x});
    expect_gradcheck([&](const std::vector<Tensor>& in) { return log_softmax(in[0], dim); }, {x});
  }
  expect_gradcheck([](const std::vector<Tensor>& in) { return softmax(in[0].transpose(0, 2), 1); }, {x});
  expect_gradcheck([](const std::vector<Tensor>& in) { return log_softmax(in[0].transpose(0, 1), 1); }, {x});
}

TEST(Softmax, BackwardKernelMatchesTheJacobianInLowPrecision) {
  // softmax: dx_j = y_j (g_j - sum_k g_k y_k); log_softmax: dx_j = g_j - exp(y_j) sum_k g_k; computed here
  // in double from the 16-bit y and g the kernel sees. Results of size ~1 that may cancel: absolute bound
  // of one ulp at 1 (f16 2^-10, bf16 2^-7) plus float error.
  for (DType dtype : {DType::F32, DType::F16, DType::BF16}) {
    for (bool log : {false, true}) {
      Tensor x = uniform_tensor({4, 33}, 84, -3, 3, dtype).requires_grad_();
      const Tensor g = uniform_tensor({4, 33}, 85, -1, 1, dtype);
      const Tensor y = log ? log_softmax(x, 1) : softmax(x, 1);
      backward({y}, {g});
      const std::vector<double> yv = y.to_vector<double>(), gv = g.to_vector<double>();
      std::vector<double> expected(yv.size());
      for (int64_t r = 0; r < 4; ++r) {
        long double dot = 0, total = 0;
        for (int64_t j = 0; j < 33; ++j) {
          dot += static_cast<long double>(gv[r * 33 + j]) * yv[r * 33 + j];
          total += gv[r * 33 + j];
        }
        for (int64_t j = 0; j < 33; ++j) {
          const size_t i = static_cast<size_t>(r * 33 + j);
          expected[i] = static_cast<double>(log ? gv[i] - std::exp(static_cast<long double>(yv[i])) * total
                                                : yv[i] * (gv[i] - dot));
        }
      }
      const double tolerance = dtype == DType::F32 ? 1e-6 : dtype == DType::F16 ? 1e-3 : 8e-3;
      EXPECT_TRUE(
          all_close(x.grad(), Tensor::from_vector(expected, {4, 33}, DType::F64), tolerance, tolerance))
          << dtype_name(dtype) << (log ? " log" : "");
    }
  }
}

TEST(Softmax, RejectsBadDimAndIntegerInput) {
  EXPECT_ERROR_MENTIONS(softmax(Tensor::zeros({2, 3}), 2), "softmax", "dim 2", "f32[2,3]");
  EXPECT_ERROR_MENTIONS(log_softmax(Tensor::zeros({2, 3}), -3), "log_softmax", "dim -3", "f32[2,3]");
  EXPECT_ERROR_MENTIONS(softmax(Tensor::zeros({2}, DType::I32), 0), "softmax", "i32[2]");
}

// lane_sum (tensor/cpu/lane_sum.h), which the norms, the attention kernels and the softmax rows build on:
// element j goes to lane j % 16 in order, the rest after the last whole group to a tail, and the lanes are
// combined as lanes[l] += lanes[l + w] for w = 8, 4, 2, 1, then the tail added, on every CPU. The library is
// built for its CPU (-march) and this file is not, so the check goes through a kernel: layer_norm's mean of a
// row whose first element is 0 is that sum times 1/C. Values spread over 2^-40..2^40 with both signs make
// nearly any other order round differently (it fails when the AVX-512 fold adds lane l to lane l + 1 before
// l + 2, tried).
namespace {

float tree_sum(const std::vector<float>& v) {
  float lanes[16] = {};
  size_t j = 0;
  for (; j + 16 <= v.size(); j += 16)
    for (size_t l = 0; l < 16; ++l) lanes[l] += v[j + l];
  float tail = 0;
  for (; j < v.size(); ++j) tail += v[j];
  for (size_t width = 8; width > 0; width /= 2)
    for (size_t l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  return lanes[0] + tail;
}

}  // namespace

TEST(LaneSum, CombinesItsLanesInTheDocumentedOrder) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> exponent(-40, 40);
  const int64_t rows = 64;
  for (int64_t C : {16, 17, 256, 300}) {
    std::vector<float> x(static_cast<size_t>(rows * C));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 1; c < C; ++c) {  // x[r, 0] = 0: the kernel's shift by the first element is exact
        const float sign = (rng() & 1) ? 1.0f : -1.0f;
        x[static_cast<size_t>(r * C + c)] =
            std::ldexp(sign, exponent(rng)) * (1.0f + static_cast<float>(rng() % 1000) / 997.0f);
      }
    const LayerNormResult result = layer_norm(Tensor::from_vector(x, {rows, C}), Tensor(), Tensor(), 1e-5);
    const std::vector<float> means = result.mean.to_vector<float>();
    int differing = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const std::vector<float> row(x.begin() + r * C, x.begin() + (r + 1) * C);
      const float expected = tree_sum(row) * (1.0f / static_cast<float>(C));
      differing += std::bit_cast<uint32_t>(means[static_cast<size_t>(r)]) != std::bit_cast<uint32_t>(expected);
    }
    EXPECT_EQ(differing, 0) << "C = " << C << ": rows whose mean is not the documented tree's sum / C";
  }
}
