// Reductions (sum, mean, max, min, var, sum_to) and softmax / log_softmax: forward against plain double
// references, gradients against finite differences, and the errors bad arguments raise.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "autograd/autograd.h"
#include "autograd/gradcheck.h"
#include "tensor/ops.h"
#include "test_util.h"

using namespace mixtape;
using mixtape::testing::all_close;
using mixtape::testing::within_ulp;

namespace {

const std::vector<DType> kFloatDtypes = {DType::F32, DType::F16, DType::BF16, DType::F64};

// Values drawn uniformly from [low, high) and rounded to dtype: the tensor holds exactly what the reference
// reads back with to_vector<double>().
Tensor uniform_tensor(const Shape& shape, uint64_t seed, double low, double high, DType dtype) {
  std::vector<double> values = Tensor::rand(shape, seed, DType::F64).to_vector<double>();
  for (double& v : values) v = low + (high - low) * v;
  return Tensor::from_vector(values, shape, dtype);
}

// Plain C++ reference for a reduction over `dims` (normalised) of row-major values, accumulated in long
// double so that it is accurate beyond f64. `combine` folds one element into the running value.
std::vector<long double> reference_reduce(const std::vector<double>& x, const Shape& shape,
                                          const std::vector<int64_t>& dims, long double init,
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

void expect_gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f, const std::vector<Tensor>& inputs) {
  const GradcheckResult result = gradcheck(f, inputs);
  EXPECT_TRUE(result.ok) << result.message;
}

}  // namespace

// ---- sum ---------------------------------------------------------------------------------------------------

// Ulp bounds for sums of positive values (no cancellation, so the error is relative to the result):
// - f32 / f64: the kernel's accumulation chain for an output of 64 elements is at most 4 steps per lane,
//   4 pairwise levels over 16 lanes and 2 more combines; each step adds <= 1/2 ulp of a partial sum no
//   larger than the result: <= 10 ulp (the typical error is 0-2 ulp).
// - f16 / bf16: the float accumulation error is ~10 * 2^-24 relative, far below half an ulp of the 16-bit
//   result (2^-11 / 2^-8), so the single rounding on store is off by at most 1 ulp.
double sum_ulp_bound(DType dtype) { return is_low_precision(dtype) ? 1 : 10; }

TEST(Sum, MatchesDoubleReferenceOverEveryDimSetInEveryDtype) {
  const Shape shape = {5, 7, 64};
  const std::vector<std::vector<int64_t>> dim_sets = {{}, {0}, {1}, {2}, {-1}, {0, 2}, {2, 0}, {0, 1}, {1, 2}};
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
  EXPECT_EQ(sum(columns, {0}).to_vector<double>(), std::vector<double>(3, static_cast<double>(n) * (n + 1) / 2));
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
    for (const Case& c : std::vector<Case>{{{3, 5}, {0}}, {{5}, {0, 1}}, {{3, 1}, {0, 2}}, {{1, 1, 5}, {0, 1}},
                                           {{4, 1, 5}, {1}}, {{1}, {0, 1, 2}}, {{}, {0, 1, 2}}}) {
      const Tensor reference = as_f64_tensor(reference_sum(x, c.dims), keep_shape(shape, c.dims)).reshape(c.target);
      const Tensor out = sum_to(x, c.target);
      EXPECT_EQ(out.shape(), c.target);
      EXPECT_TRUE(within_ulp(out, reference, sum_ulp_bound(dtype))) << dtype_name(dtype) << shape_str(c.target);
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
