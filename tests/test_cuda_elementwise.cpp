// The CUDA elementwise kernels (tensor/cuda/elementwise.cu) against the CPU backend, through the op front
// ends: the same inputs go to both devices and the results are compared element by element. The CPU kernels
// are themselves checked against exact references in test_elementwise.cpp, test_random.cpp and
// test_dtype.cpp, so agreement with them is agreement with the math.
//
// Bounds, and why:
// - copies/casts, fill, arange, uniform, randint, where, dropout, add_, mul_, +, -, *, /, sqrt, 1/sqrt, neg,
//   abs, relu, x^2, 1/x, the tensor-scalar ops (one double operation, rounded once): 0 ulp, i.e. identical
//   values. Both sides do the same correctly rounded IEEE operations and the same conversions (round to
//   nearest even; double and integers to f16/bf16 correctly rounded), and the Philox draws are the same
//   integer function.
// - normal: 1 ulp in f32/f16/bf16, 16 ulp in f64: Box-Muller's log and cos come from libdevice on the GPU
//   (log 1 ulp, cos 2 ulp in double) and glibc on the CPU; the double results differ by a few double ulps,
//   which moves the rounded f32/f16/bf16 value only when it lies that close to a rounding midpoint.
// - transcendental forward/backward ops: 8 ulp in f32, 16 in f64, 1 ulp in f16/bf16. libdevice's expf, logf,
//   tanhf, powf are within 2 ulp of the exact value (erfc in double 5 ulp), the CPU's libm/libmvec within
//   1-4 ulp, and the few roundings of each formula (sigmoid's 1 / (1 + e), gelu's products) carry those
//   differences through without amplifying them on the input ranges used here (no cancellation). In
//   f16/bf16 a float result a few float ulps off rounds to the same 16-bit value unless it lies within those
//   few ulps of a midpoint, which moves the result by one 16-bit ulp.
// - through autograd, the backward ops that read the forward's output (tanh, sigmoid, exp, ...) see each
//   device's own y, which may differ by the forward's bound, so those compare like the CPU suite compares with
//   the derivative: 8 eps relative, 16 eps absolute. The backward kernels alone (same x, y, g on both devices)
//   are held to the bounds above (relative, or absolute on the scale of the derivative's O(1) terms for the
//   derivatives that cross zero).
// - a * b + c is fused into one FMA by nvcc and, on an FMA-capable -march=native host, by GCC, but whether a
//   given expression is fused is each compiler's choice. Where a test wants identical results it picks
//   operands whose product is exact (add_'s alpha and uniform's high - low are powers of two, arange's step
//   is 0.375), so fused or not gives the same value.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "autograd/autograd.h"
#include "cuda_test_util.h"
#include "tensor/backend.h"
#include "tensor/ops.h"
#include "tensor/random.h"
#include "test_util.h"

using namespace mixtape;
using mixtape::testing::all_close;
using mixtape::testing::cuda0;
using mixtape::testing::within_ulp;

namespace {

constexpr DType kFloatDtypes[] = {DType::F32, DType::F16, DType::BF16, DType::F64};
constexpr DType kAllDtypes[] = {DType::F32, DType::F16, DType::BF16, DType::F64, DType::I32, DType::I64};

Tensor gpu(const Tensor& t) { return t.to(cuda0()); }

// Uniform values in [low, high) drawn on the host with std::mt19937_64, rounded to dtype.
Tensor host_uniform(const Shape& shape, double low, double high, DType dtype, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> draw(low, high);
  std::vector<double> values(static_cast<size_t>(shape_numel(shape)));
  for (double& v : values) v = draw(rng);
  return Tensor::from_vector(values, shape, dtype);
}

// Identical values: integers exactly, floats at 0 ulp (NaN matches NaN; +0 and -0 are not told apart).
::testing::AssertionResult identical(const Tensor& actual, const Tensor& expected) {
  if (actual.shape() != expected.shape() || actual.dtype() != expected.dtype())
    return ::testing::AssertionFailure() << actual.description() << " vs " << expected.description();
  if (!is_floating(expected.dtype())) {
    const std::vector<int64_t> got = actual.to_vector<int64_t>(), want = expected.to_vector<int64_t>();
    for (size_t i = 0; i < got.size(); ++i)
      if (got[i] != want[i])
        return ::testing::AssertionFailure() << "element " << i << ": got " << got[i] << ", expected " << want[i];
    return ::testing::AssertionSuccess();
  }
  return within_ulp(actual, expected, 0);
}

// Source values for a cast from `from` to `to`: both signs, many magnitudes, rounding ties of f16 and bf16,
// and (when the destination is floating) Inf, NaN, f16 overflow and subnormals. Float-to-integer casts get
// values an integer holds (out of range the C++ cast is undefined).
Tensor cast_source(DType from, DType to, int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  if (!is_floating(from)) {
    std::vector<int64_t> values;
    const bool wide = from == DType::I64;
    const std::vector<int64_t> special = {0, 1, -1, 2049, -2049, 65519, 65520, 1 << 24 | 1, (1 << 24) + 3,
                                          2147483647, -2147483647 - 1};
    values.insert(values.end(), special.begin(), special.end());
    if (wide) {
      // 2^60 + 2^52 + 1: a round-to-nearest double lands on a bf16 tie (see integer_to_double_round_to_odd).
      for (int64_t v : {(int64_t{1} << 60) + (int64_t{1} << 52) + 1, (int64_t{1} << 53) + 1,
                        std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min(),
                        -(int64_t{1} << 62) - 12345})
        values.push_back(v);
    }
    const int64_t bound = wide ? int64_t{1} << 62 : int64_t{2147483647};
    std::uniform_int_distribution<int64_t> draw(-bound, bound);
    std::uniform_int_distribution<int64_t> small(-3000, 3000);
    while (static_cast<int64_t>(values.size()) < n) values.push_back(values.size() % 2 ? draw(rng) : small(rng));
    values.resize(static_cast<size_t>(n));
    return Tensor::from_vector(values, {n}, from);
  }
  std::vector<double> values;
  if (is_floating(to)) {
    const double inf = std::numeric_limits<double>::infinity();
    values = {0.0, -0.0, inf, -inf, std::nan(""), 65504, 65519.99, 65520, -70000, 1e-5, 6e-8, 3e-8, 1e-30,
              3e38, 1e39, 1e300, 1 + 0x1p-11, 1 + 3 * 0x1p-11, 1 + 0x1p-8, 1 + 3 * 0x1p-8, -(1 + 0x1p-11),
              1 + 0x1p-11 + 0x1p-40, 0x1p-126 * 1.5, 0x1p-149};
  }
  // Into integers: below 2^15 from f16 (whose range ends at 65504), below 2^21 from the others.
  const double top = is_floating(to) ? 30 : from == DType::F16 ? 14 : 20;
  std::uniform_real_distribution<double> mantissa(1, 2), exponent(is_floating(to) ? -30 : -4, top);
  while (static_cast<int64_t>(values.size()) < n) {
    const double v = mantissa(rng) * std::exp2(std::floor(exponent(rng)));
    values.push_back(values.size() % 2 ? -v : v);
  }
  values.resize(static_cast<size_t>(n));
  return Tensor::from_vector(values, {n}, from);
}

struct UnaryCase {
  const char* name;
  std::function<Tensor(const Tensor&)> op;
  UnaryOp kernel;
  double scalar;
  double low, high;  // input range: inside the domain, away from cancellation
  bool exact;        // correctly rounded on both devices: 0 ulp
};

std::vector<UnaryCase> unary_cases() {
  return {
      {"neg", [](const Tensor& x) { return neg(x); }, UnaryOp::Neg, 0, -4, 4, true},
      {"abs", [](const Tensor& x) { return abs(x); }, UnaryOp::Abs, 0, -4, 4, true},
      {"relu", [](const Tensor& x) { return relu(x); }, UnaryOp::Relu, 0, -4, 4, true},
      {"sqrt", [](const Tensor& x) { return sqrt(x); }, UnaryOp::Sqrt, 0, 0.01, 50, true},
      {"rsqrt", [](const Tensor& x) { return rsqrt(x); }, UnaryOp::Rsqrt, 0, 0.01, 50, true},
      {"exp", [](const Tensor& x) { return exp(x); }, UnaryOp::Exp, 0, -10, 10, false},
      {"log", [](const Tensor& x) { return log(x); }, UnaryOp::Log, 0, 0.01, 50, false},
      {"tanh", [](const Tensor& x) { return tanh(x); }, UnaryOp::Tanh, 0, -1.5, 1.5, false},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); }, UnaryOp::Sigmoid, 0, -8, 8, false},
      {"silu", [](const Tensor& x) { return silu(x); }, UnaryOp::Silu, 0, -8, 8, false},
      {"gelu", [](const Tensor& x) { return gelu(x); }, UnaryOp::GeluErf, 0, -6, 6, false},
      {"gelu_tanh", [](const Tensor& x) { return gelu(x, GeluApproximation::Tanh); }, UnaryOp::GeluTanh, 0, -6, 6,
       false},
      {"pow2.5", [](const Tensor& x) { return pow(x, 2.5); }, UnaryOp::PowScalar, 2.5, 0.1, 4, false},
      {"pow2", [](const Tensor& x) { return pow(x, 2.0); }, UnaryOp::PowScalar, 2.0, -4, 4, true},
      {"pow-1", [](const Tensor& x) { return pow(x, -1.0); }, UnaryOp::PowScalar, -1.0, 0.1, 4, true},
      {"pow0", [](const Tensor& x) { return pow(x, 0.0); }, UnaryOp::PowScalar, 0.0, -4, 4, true},
  };
}

double transcendental_ulp(DType dtype) { return is_low_precision(dtype) ? 1 : dtype == DType::F32 ? 8 : 16; }
double epsilon(DType dtype) {
  switch (dtype) {
    case DType::F16: return 0x1p-10;
    case DType::BF16: return 0x1p-7;
    case DType::F32: return 0x1p-23;
    default: return 0x1p-52;
  }
}

}  // namespace

// ---- copy, fill, arange -------------------------------------------------------------------------------------

TEST(CudaCopy, EveryDtypePairConvertsLikeTheCpu) {
  MIXTAPE_REQUIRE_CUDA();
  for (DType from : kAllDtypes) {
    for (DType to : kAllDtypes) {
      SCOPED_TRACE(std::string(dtype_name(from)) + " -> " + dtype_name(to));
      // 1027 elements: whole 16-byte groups and a tail.
      const Tensor source = cast_source(from, to, 1027, 11);
      EXPECT_TRUE(identical(gpu(source).to(to), source.to(to)));
    }
  }
}

TEST(CudaCopy, StridedTransposedBroadcastAndMisalignedOperands) {
  MIXTAPE_REQUIRE_CUDA();
  const std::pair<DType, DType> pairs[] = {{DType::F32, DType::F16}, {DType::BF16, DType::F32},
                                           {DType::F64, DType::BF16}, {DType::F32, DType::F32},
                                           {DType::F16, DType::F16}, {DType::I64, DType::I32}};
  for (const auto& [from, to] : pairs) {
    SCOPED_TRACE(std::string(dtype_name(from)) + " -> " + dtype_name(to));
    const Tensor host = cast_source(from, to, 6 * 7 * 5, 12).reshape({6, 7, 5});
    const Tensor device = gpu(host);
    auto views = [](const Tensor& t) {
      return std::vector<Tensor>{t.permute({2, 0, 1}), t.transpose(0, 1), t.slice(1, 1, 7, 2),
                                 t.select(2, 3), t.flatten().slice(0, 1, 6 * 7 * 5),  // contiguous, misaligned
                                 t.slice(0, 2, 3).expand({4, 7, 5})};
    };
    const std::vector<Tensor> host_views = views(host), device_views = views(device);
    for (size_t v = 0; v < host_views.size(); ++v) {
      SCOPED_TRACE("view " + std::to_string(v));
      EXPECT_TRUE(identical(device_views[v].to(to).contiguous(), host_views[v].to(to).contiguous()));
      // into a strided destination: a transposed buffer written through copy_
      const Shape shape = host_views[v].shape();
      if (shape.size() < 2) continue;
      Tensor host_dst = Tensor::zeros({shape[1], shape[0]}, to).transpose(0, 1);
      Tensor device_dst = gpu(Tensor::zeros({shape[1], shape[0]}, to)).transpose(0, 1);
      if (shape.size() == 3) {
        host_dst = Tensor::zeros({shape[2], shape[1], shape[0]}, to).permute({2, 1, 0});
        device_dst = gpu(Tensor::zeros({shape[2], shape[1], shape[0]}, to)).permute({2, 1, 0});
      }
      host_dst.copy_(host_views[v]);
      device_dst.copy_(device_views[v]);
      EXPECT_TRUE(identical(device_dst.contiguous(), host_dst.contiguous()));
    }
  }
}

TEST(CudaFill, FullAndFillOfAStridedViewInEveryDtype) {
  MIXTAPE_REQUIRE_CUDA();
  for (DType dtype : kAllDtypes) {
    SCOPED_TRACE(dtype_name(dtype));
    for (double value : {0.0, 0.1, -3.7, 65519.9, 1e6, 1 + 0x1p-11}) {
      EXPECT_TRUE(identical(Tensor::full({3, 517}, value, dtype, cuda0()), Tensor::full({3, 517}, value, dtype)));
    }
    Tensor host = Tensor::zeros({8, 9}, dtype);
    Tensor device = Tensor::zeros({8, 9}, dtype, cuda0());
    host.transpose(0, 1).slice(0, 1, 9, 3).fill_(2.75);
    device.transpose(0, 1).slice(0, 1, 9, 3).fill_(2.75);
    EXPECT_TRUE(identical(device, host));
  }
}

TEST(CudaArange, MatchesTheCpuInEveryDtype) {
  MIXTAPE_REQUIRE_CUDA();
  for (DType dtype : kAllDtypes) {
    SCOPED_TRACE(dtype_name(dtype));
    EXPECT_TRUE(identical(Tensor::arange(0, 3000, 1, dtype, cuda0()), Tensor::arange(0, 3000, 1, dtype)));
    EXPECT_TRUE(identical(Tensor::arange(-40, 3000, 7, dtype, cuda0()), Tensor::arange(-40, 3000, 7, dtype)));
    // start + i * step with i * step exact (see the header: the result then does not depend on FMA)
    if (is_floating(dtype)) {
      EXPECT_TRUE(identical(Tensor::arange(-3.5, 700.25, 0.375, dtype, cuda0()),
                            Tensor::arange(-3.5, 700.25, 0.375, dtype)));
    }
  }
}

// ---- random -------------------------------------------------------------------------------------------------

TEST(CudaRandom, UniformDrawsTheCpuBitsInEveryDtype) {
  MIXTAPE_REQUIRE_CUDA();
  // 200k draws: in f16 about 50 of them round up to 1 and take the "largest value below 1" (2^-12 of draws
  // in f16, 2^-9 in bf16), so the clamp is exercised too.
  for (DType dtype : kFloatDtypes) {
    SCOPED_TRACE(dtype_name(dtype));
    const Tensor device = Tensor::rand({200000}, 1234, dtype, cuda0());
    EXPECT_TRUE(identical(device, Tensor::rand({200000}, 1234, dtype)));
    const std::vector<double> values = device.to_vector<double>();
    EXPECT_LT(*std::max_element(values.begin(), values.end()), 1.0);
  }
  // Other bounds and a nonzero counter offset, through the backend (bounds whose width is a power of two:
  // (high - low) * u is exact, so the result does not depend on whether a compiler fuses it with + low).
  for (DType dtype : kAllDtypes) {
    SCOPED_TRACE(std::string("bounds ") + dtype_name(dtype));
    Tensor host = Tensor::empty({4099}, dtype), device = Tensor::empty({4099}, dtype, cuda0());
    backend_for(Device::cpu()).uniform(host, 99, 123456789, -3, 5);
    backend_for(cuda0()).uniform(device, 99, 123456789, -3, 5);
    EXPECT_TRUE(identical(device, host));
  }
}

TEST(CudaRandom, RandintDrawsTheCpuBitsForNarrowAndFullWidthRanges) {
  MIXTAPE_REQUIRE_CUDA();
  for (DType dtype : {DType::I32, DType::I64}) {
    SCOPED_TRACE(dtype_name(dtype));
    EXPECT_TRUE(identical(Tensor::randint(-5, 17, {5001}, 77, dtype, cuda0()),
                          Tensor::randint(-5, 17, {5001}, 77, dtype)));
  }
  // Floating destinations (the front end makes integers only): the kernel directly.
  for (DType dtype : kFloatDtypes) {
    SCOPED_TRACE(dtype_name(dtype));
    Tensor host = Tensor::empty({5001}, dtype), device = Tensor::empty({5001}, dtype, cuda0());
    backend_for(Device::cpu()).randint(host, 77, 3, -70000, 70000);
    backend_for(cuda0()).randint(device, 77, 3, -70000, 70000);
    EXPECT_TRUE(identical(device, host));
  }
  // A range wider than 2^63 (high - low overflows int64) and a nonzero offset.
  const int64_t low = std::numeric_limits<int64_t>::min() / 4 * 3, high = std::numeric_limits<int64_t>::max();
  Tensor host = Tensor::empty({3001}, DType::I64), device = Tensor::empty({3001}, DType::I64, cuda0());
  backend_for(Device::cpu()).randint(host, 5, 1000, low, high);
  backend_for(cuda0()).randint(device, 5, 1000, low, high);
  EXPECT_TRUE(identical(device, host));
}

// Box-Muller in double on both devices: sqrt(-2 log u1) cos(2 pi u2). CUDA's and glibc's log and cos differ by an
// ulp or two of their results; near a zero of the cosine (a draw close to the mean) that is a few ulp of 1, not of
// the tiny draw (seen on an H100: 128 ulp of 0.0042). So f64 draws agree within 16 ulp of the larger of the draw
// and the standard deviation (an absolute bound at the distribution's scale); the narrower dtypes round that away
// and agree within an ulp of the draw itself.
::testing::AssertionResult normal_draws_agree(const Tensor& device, const Tensor& host, double stddev) {
  if (host.dtype() != DType::F64) return within_ulp(device, host, 1);
  const std::vector<double> got = device.to(Device::cpu()).to_vector<double>(), want = host.to_vector<double>();
  const double ulp_of_1 = std::ldexp(1.0, -52);
  int bad = 0;
  std::string report;
  for (size_t i = 0; i < want.size(); ++i) {
    const double error = std::abs(got[i] - want[i]), bound = 16 * ulp_of_1 * std::max(std::abs(want[i]), stddev);
    if (!(error <= bound) && bad++ < 5)
      report += "element " + std::to_string(i) + ": got " + std::to_string(got[i]) + ", reference " +
                std::to_string(want[i]) + ", error " + std::to_string(error / bound) + "x the bound\n";
  }
  if (bad) return ::testing::AssertionFailure() << bad << " f64 draws beyond 16 ulp at their scale\n" << report;
  return ::testing::AssertionSuccess();
}

TEST(CudaRandom, NormalMatchesTheCpuWithinAnUlpAtItsScale) {
  MIXTAPE_REQUIRE_CUDA();
  for (DType dtype : kFloatDtypes) {
    SCOPED_TRACE(dtype_name(dtype));
    EXPECT_TRUE(normal_draws_agree(Tensor::randn({100003}, 4321, dtype, cuda0()), Tensor::randn({100003}, 4321, dtype),
                                   1.0));
    Tensor host = Tensor::empty({2049}, dtype), device = Tensor::empty({2049}, dtype, cuda0());
    backend_for(Device::cpu()).normal(host, 8, 77777, 0.5, 2.0);
    backend_for(cuda0()).normal(device, 8, 77777, 0.5, 2.0);
    EXPECT_TRUE(normal_draws_agree(device, host, 2.0));
  }
}

// ---- unary ---------------------------------------------------------------------------------------------------

TEST(CudaUnary, EveryOpMatchesTheCpuInEveryDtype) {
  MIXTAPE_REQUIRE_CUDA();
  for (const UnaryCase& c : unary_cases()) {
    for (DType dtype : kFloatDtypes) {
      SCOPED_TRACE(std::string(c.name) + " " + dtype_name(dtype));
      const double bound = c.exact ? 0 : transcendental_ulp(dtype);
      const Tensor x = host_uniform({33, 65}, c.low, c.high, dtype, 5);
      const Tensor xd = gpu(x);
      EXPECT_TRUE(within_ulp(c.op(xd), c.op(x), bound)) << "contiguous";
      EXPECT_TRUE(within_ulp(c.op(xd.mT()), c.op(x.mT()), bound)) << "transposed";
      EXPECT_TRUE(within_ulp(c.op(xd.flatten().slice(0, 1, 33 * 65)), c.op(x.flatten().slice(0, 1, 33 * 65)), bound))
          << "misaligned";
    }
  }
}

TEST(CudaUnary, SpecialValuesGoThroughLikeOnTheCpu) {
  MIXTAPE_REQUIRE_CUDA();
  // NaN, infinities, zeros of both signs and the tails where sigmoid and gelu underflow or saturate.
  const double inf = std::numeric_limits<double>::infinity();
  // (-80, not -100: e^-100 is a float subnormal with 5 significant bits, where one ulp of exp is 4% of silu.)
  const std::vector<double> values = {std::nan(""), inf, -inf, 0.0, -0.0, -80, -30, -12, 12, 30, 100, 1e-30};
  for (DType dtype : kFloatDtypes) {
    const Tensor x = Tensor::from_vector(values, {static_cast<int64_t>(values.size())}, dtype);
    for (const UnaryCase& c : unary_cases()) {
      if (c.low > 0) continue;  // domain-limited ops
      SCOPED_TRACE(std::string(c.name) + " " + dtype_name(dtype));
      EXPECT_TRUE(within_ulp(c.op(gpu(x)), c.op(x), c.exact ? 0 : transcendental_ulp(dtype)));
    }
  }
}

TEST(CudaUnaryGrad, BackwardKernelsMatchTheCpuOnTheSameInputs) {
  MIXTAPE_REQUIRE_CUDA();
  for (const UnaryCase& c : unary_cases()) {
    for (DType dtype : kFloatDtypes) {
      SCOPED_TRACE(std::string(c.name) + " " + dtype_name(dtype));
      const Tensor x = host_uniform({1031}, c.low, c.high, dtype, 6);
      const Tensor y = c.op(x);
      const Tensor g = host_uniform({1031}, -2, 2, dtype, 7);
      Tensor host_grad = Tensor::empty({1031}, dtype), device_grad = Tensor::empty({1031}, dtype, cuda0());
      backend_for(Device::cpu()).unary_backward(c.kernel, x, y, g, host_grad, c.scalar);
      backend_for(cuda0()).unary_backward(c.kernel, gpu(x), gpu(y), gpu(g), device_grad, c.scalar);
      // Derivatives made of correctly rounded operations are identical on both devices (x^p's p x^(p-1) calls
      // pow for p other than 0, 1, 2). tanh's 1 - y^2 may be fused into one FMA on one side only: y^2's
      // rounding (half an ulp of y^2 < 0.82) relative to 1 - y^2 > 0.18 is at most ~3 ulp of the result.
      const bool general_pow = c.kernel == UnaryOp::PowScalar && c.scalar != 0 && c.scalar != 1 && c.scalar != 2;
      const bool exact = (c.exact && !general_pow) || c.kernel == UnaryOp::Exp || c.kernel == UnaryOp::Log ||
                         c.kernel == UnaryOp::Sigmoid;
      if (exact || c.kernel == UnaryOp::Tanh) {
        EXPECT_TRUE(within_ulp(device_grad, host_grad, exact ? 0 : 4));
      } else {
        // The transcendental derivatives are sums of O(1) terms (silu' and both gelu' cross zero, where a
        // relative bound means nothing): k ulps relative, or k eps absolute on the scale of |g| <= 2.
        const double k = transcendental_ulp(dtype) * epsilon(dtype);
        EXPECT_TRUE(all_close(device_grad, host_grad, 2 * k, k));
      }
    }
  }
}

TEST(CudaUnaryGrad, AutogradThroughEveryOpMatchesTheCpu) {
  MIXTAPE_REQUIRE_CUDA();
  for (const UnaryCase& c : unary_cases()) {
    for (DType dtype : kFloatDtypes) {
      SCOPED_TRACE(std::string(c.name) + " " + dtype_name(dtype));
      const Tensor x0 = host_uniform({17, 31}, c.low, c.high, dtype, 8);
      const Tensor g = host_uniform({31, 17}, 0.5, 2, dtype, 9);
      Tensor host_x = x0.clone().requires_grad_(), device_x = gpu(x0).requires_grad_();
      // through a transposed view, so the backward kernel also sees strided operands
      backward({c.op(host_x.mT())}, {g});
      backward({c.op(device_x.mT())}, {gpu(g)});
      ASSERT_TRUE(device_x.grad().defined());
      EXPECT_EQ(device_x.grad().device(), cuda0());
      const double tolerance = 8 * epsilon(dtype);
      EXPECT_TRUE(all_close(device_x.grad(), host_x.grad(), 2 * tolerance, tolerance));
    }
  }
}

// ---- binary ---------------------------------------------------------------------------------------------------

TEST(CudaBinary, BroadcastStridedAndContiguousOperandsMatchTheCpu) {
  MIXTAPE_REQUIRE_CUDA();
  struct Case {
    const char* name;
    std::function<Tensor(const Tensor&, const Tensor&)> op;
    bool exact;
  };
  const Case cases[] = {{"add", [](const Tensor& a, const Tensor& b) { return add(a, b); }, true},
                        {"sub", [](const Tensor& a, const Tensor& b) { return sub(a, b); }, true},
                        {"mul", [](const Tensor& a, const Tensor& b) { return mul(a, b); }, true},
                        {"div", [](const Tensor& a, const Tensor& b) { return div(a, b); }, true},
                        {"pow", [](const Tensor& a, const Tensor& b) { return pow(a, b); }, false}};
  for (const Case& c : cases) {
    for (DType dtype : kFloatDtypes) {
      SCOPED_TRACE(std::string(c.name) + " " + dtype_name(dtype));
      const double bound = c.exact ? 0 : transcendental_ulp(dtype);
      // positive bases so pow is real; exponents of both signs
      const Tensor a = host_uniform({4, 1, 37}, 0.1, 4, dtype, 21), b = host_uniform({3, 1}, -3, 3, dtype, 22);
      EXPECT_TRUE(within_ulp(c.op(gpu(a), gpu(b)), c.op(a, b), bound)) << "broadcast";
      const Tensor p = host_uniform({2053}, 0.1, 4, dtype, 23), q = host_uniform({2053}, -3, 3, dtype, 24);
      EXPECT_TRUE(within_ulp(c.op(gpu(p), gpu(q)), c.op(p, q), bound)) << "contiguous";
      const Tensor m = host_uniform({19, 23}, 0.1, 4, dtype, 25), n = host_uniform({23, 19}, -3, 3, dtype, 26);
      EXPECT_TRUE(within_ulp(c.op(gpu(m), gpu(n).mT()), c.op(m, n.mT()), bound)) << "transposed";
      EXPECT_TRUE(within_ulp(c.op(gpu(p).slice(0, 1, 2053), gpu(q).slice(0, 0, 2052)),
                             c.op(p.slice(0, 1, 2053), q.slice(0, 0, 2052)), bound))
          << "misaligned";
    }
  }
}

TEST(CudaBinary, MixedDtypesPromoteAndGradientsMatch) {
  MIXTAPE_REQUIRE_CUDA();
  const Tensor a = host_uniform({5, 7}, -2, 2, DType::F16, 31), b = host_uniform({7}, 0.5, 2, DType::BF16, 32);
  EXPECT_TRUE(identical(mul(gpu(a), gpu(b)), mul(a, b)));  // f16 * bf16 -> f32
  for (DType dtype : kFloatDtypes) {
    SCOPED_TRACE(dtype_name(dtype));
    const Tensor x0 = host_uniform({9, 11}, -2, 2, dtype, 33), y0 = host_uniform({9, 11}, 0.5, 2, dtype, 34);
    const Tensor g = host_uniform({9, 11}, -1, 1, dtype, 35);
    Tensor hx = x0.clone().requires_grad_(), hy = y0.clone().requires_grad_();
    Tensor dx = gpu(x0).requires_grad_(), dy = gpu(y0).requires_grad_();
    backward({sub(div(mul(hx, hy), hy), hy)}, {g});
    backward({sub(div(mul(dx, dy), dy), dy)}, {gpu(g)});
    EXPECT_TRUE(identical(dx.grad(), hx.grad()));
    EXPECT_TRUE(identical(dy.grad(), hy.grad()));
  }
}

TEST(CudaScalarOps, KeepTheScalarInDoubleLikeTheCpu) {
  MIXTAPE_REQUIRE_CUDA();
  for (DType dtype : kFloatDtypes) {
    SCOPED_TRACE(dtype_name(dtype));
    const Tensor x = host_uniform({41, 53}, 0.1, 5, dtype, 41);
    const Tensor xd = gpu(x);
    EXPECT_TRUE(identical(add(xd, 0.1), add(x, 0.1)));
    EXPECT_TRUE(identical(sub(xd, 0.3), sub(x, 0.3)));
    EXPECT_TRUE(identical(sub(0.3, xd), sub(0.3, x)));
    EXPECT_TRUE(identical(mul(xd.mT(), 0.1), mul(x.mT(), 0.1)));
    EXPECT_TRUE(identical(div(xd, 3.0), div(x, 3.0)));
    EXPECT_TRUE(identical(div(2.0, xd.mT()), div(2.0, x.mT())));
    // scalar ^ tensor has no front end of its own: the kernel directly
    Tensor host = Tensor::empty(x.shape(), dtype), device = Tensor::empty(x.shape(), dtype, cuda0());
    backend_for(Device::cpu()).binary_scalar(BinaryOp::Pow, x, 1.7, true, host);
    backend_for(cuda0()).binary_scalar(BinaryOp::Pow, xd, 1.7, true, device);
    // one double pow (libdevice 2 ulp of double) rounded once: 1 ulp at most in f32/f16/bf16
    EXPECT_TRUE(within_ulp(device, host, dtype == DType::F64 ? 8 : 1));
  }
}

// ---- where, in place --------------------------------------------------------------------------------------------

TEST(CudaWhere, AnyConditionDtypeBroadcastAndIntegerValues) {
  MIXTAPE_REQUIRE_CUDA();
  const std::vector<double> conditions = {0, 1, -0.0, std::nan(""), 2, 0, -1, 0.5};
  for (DType cond_dtype : kAllDtypes) {
    for (DType dtype : kAllDtypes) {
      SCOPED_TRACE(std::string(dtype_name(cond_dtype)) + " ? " + dtype_name(dtype));
      std::vector<double> c = conditions;
      if (!is_floating(cond_dtype)) c[3] = 3;  // no NaN integer
      const Tensor cond = Tensor::from_vector(c, {8, 1}, cond_dtype);
      const Tensor a = Tensor::arange(1, 6, 1, dtype).reshape({1, 5});
      const Tensor b = Tensor::full({}, -7, dtype);
      EXPECT_TRUE(identical(where(gpu(cond), gpu(a), gpu(b)), where(cond, a, b)));
    }
  }
  // transposed condition and values, strided on every operand
  std::vector<double> mask(6 * 9);
  for (size_t i = 0; i < mask.size(); ++i) mask[i] = (i * 7) % 3 == 0 ? 0.0 : static_cast<double>(i);
  for (DType dtype : {DType::F32, DType::BF16, DType::I64}) {
    SCOPED_TRACE(std::string("transposed ") + dtype_name(dtype));
    const Tensor cond = Tensor::from_vector(mask, {6, 9}, DType::F32);
    const Tensor a = Tensor::arange(0, 54, 1, dtype).reshape({9, 6});
    const Tensor b = Tensor::arange(100, 154, 1, dtype).reshape({9, 6});
    EXPECT_TRUE(identical(where(gpu(cond).mT(), gpu(a), gpu(b).slice(0, 0, 9)),
                          where(cond.mT(), a, b.slice(0, 0, 9))));
    if (is_floating(dtype)) {
      EXPECT_TRUE(identical(masked_fill(gpu(a).mT(), gpu(cond), -1.5), masked_fill(a.mT(), cond, -1.5)));
    }
  }
}

TEST(CudaInPlace, AddBroadcastsConvertsAndScales) {
  MIXTAPE_REQUIRE_CUDA();
  for (DType dst_dtype : kFloatDtypes) {
    for (DType src_dtype : kFloatDtypes) {
      SCOPED_TRACE(std::string(dtype_name(dst_dtype)) + " += " + dtype_name(src_dtype));
      const Tensor d0 = host_uniform({13, 259}, -2, 2, dst_dtype, 51);
      const Tensor s0 = host_uniform({259}, -2, 2, src_dtype, 52);
      Tensor host = d0.clone(), device = gpu(d0);
      host.add_(s0, -2);
      device.add_(gpu(s0), -2);
      EXPECT_TRUE(identical(device, host)) << "broadcast source";
      // contiguous same-shape source (the vectorised path) and a transposed destination, each step from equal
      // starting values (so one-ulp differences do not add up)
      device = gpu(host);
      const Tensor s1 = host_uniform({13, 259}, -2, 2, src_dtype, 53);
      host.add_(s1);
      device.add_(gpu(s1));
      EXPECT_TRUE(identical(device, host)) << "contiguous";
      device = gpu(host);
      const Tensor s2 = host_uniform({259, 13}, -2, 2, src_dtype, 54);
      host.mT().add_(s2, 0.25);
      device.mT().add_(gpu(s2), 0.25);
      EXPECT_TRUE(identical(device, host)) << "transposed destination";
    }
  }
}

TEST(CudaInPlace, MulKeepsTheScalarInDouble) {
  MIXTAPE_REQUIRE_CUDA();
  for (DType dtype : kFloatDtypes) {
    SCOPED_TRACE(dtype_name(dtype));
    const Tensor x = host_uniform({7, 301}, -3, 3, dtype, 61);
    Tensor host = x.clone(), device = gpu(x);
    host.mul_(0.1);
    device.mul_(0.1);
    EXPECT_TRUE(identical(device, host));
    host.mT().mul_(-3.3);
    device.mT().mul_(-3.3);
    EXPECT_TRUE(identical(device, host));
  }
}

// ---- dropout -------------------------------------------------------------------------------------------------

TEST(CudaDropout, SameMaskAndValuesAsTheCpuForwardAndBackward) {
  MIXTAPE_REQUIRE_CUDA();
  for (DType dtype : kFloatDtypes) {
    for (double p : {0.1, 0.5, 0.9}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " p = " + std::to_string(p));
      // values away from 0, so a zero in the output is a dropped element
      const Tensor x0 = host_uniform({37, 129}, 0.5, 2, dtype, 71);
      Generator host_rng(2024), device_rng(2024);
      host_rng.advance(1001);  // a nonzero counter offset
      device_rng.advance(1001);
      Tensor host_x = x0.clone().requires_grad_(), device_x = gpu(x0).requires_grad_();
      const Tensor host_out = dropout(host_x, p, host_rng), device_out = dropout(device_x, p, device_rng);
      EXPECT_TRUE(identical(device_out, host_out));
      const std::vector<double> values = host_out.to_vector<double>();
      int64_t dropped = 0;
      for (double v : values) dropped += v == 0;
      EXPECT_NEAR(static_cast<double>(dropped) / static_cast<double>(values.size()), p, 0.05);
      // backward redraws the same mask on each device
      const Tensor g = host_uniform({37, 129}, -1, 1, dtype, 72);
      backward({host_out}, {g});
      backward({device_out}, {gpu(g)});
      EXPECT_TRUE(identical(device_x.grad(), host_x.grad()));
      // a strided input: the mask still follows the output's row-major index
      const Tensor t0 = host_uniform({129, 37}, 0.5, 2, dtype, 73);
      EXPECT_TRUE(identical(dropout(gpu(t0).mT(), p, device_rng), dropout(t0.mT(), p, host_rng)));
    }
  }
}
