// Elementwise ops: forward values against quad / long-double references in every dtype (exhaustively over
// all 65,536 bit patterns for f16/bf16 unary ops), broadcasting, scalar operands, non-contiguous inputs,
// where/masked_fill, the in-place kernels, gradients (gradcheck in f64) and argument errors.
//
// ULP bounds used below, and why:
// - add/sub/mul/div/sqrt/neg/abs/relu: 0 ulp in every dtype. f32 and f64 compute natively (IEEE, correctly
//   rounded). f16/bf16 compute in float and round once: the float result of one +,-,*,/,sqrt on 11-bit
//   (f16) or 8-bit (bf16) operands is either exact or rounded at 24 bits, and a second rounding to p bits
//   after a first one at >= 2p + 2 bits gives the correctly rounded result (Figueroa's double-rounding
//   theorem), so the stored value equals the exact result rounded once.
// - tensor-scalar ops: 0 ulp; computed in double, then rounded once to the dtype. (The theorem needs both
//   operands in the narrow format, and the scalar has 53 bits: the double result could still round the
//   wrong way if the exact value lay within 2^-53 (relative) of a midpoint of the dtype, which no input
//   of this test does. For f64 the kernel's one IEEE operation is exact-then-rounded by definition.)
// - transcendental ops in f16/bf16: 1 ulp. The float result is within a few float ulps (2^-23 relative)
//   of the true value; rounding it to 11 or 8 bits can only land on the other side of a rounding midpoint
//   when the true value is that close to the midpoint, which moves the result by at most one 16-bit ulp.
// - transcendental ops in f32/f64: the libm error of the function (glibc: exp, log < 1 ulp; tanh, erfc,
//   pow ~1-2 ulp) plus the roundings of the few extra float operations of the formula, bounded per op in
//   the table of UnaryOps.ForwardMatchesTheReferenceInF32AndF64; gelu's bound grows with its condition
//   number (UnaryOps.GeluMatchesTheTextbookFormulasAndPublishedValues).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <numbers>
#include <random>
#include <sstream>

#include "autograd/autograd.h"
#include "autograd/gradcheck.h"
#include "tensor/backend.h"
#include "tensor/cpu/fast_math.h"
#include "tensor/ops.h"
#include "test_util.h"

using namespace mixtape;
using mixtape::testing::all_close;
using mixtape::testing::within_ulp;

namespace {

// References compute in quad precision (113 bits) where the op is one IEEE operation, so rounding the
// reference to f64 (and then to the tested dtype) is the correctly rounded result (113 >= 2 * 53 + 2; long
// double's 64 bits would not be enough for f64). Transcendental references go through long double.
using Real = __float128;
using Reference = std::function<Real(Real)>;
using Reference2 = std::function<Real(Real, Real)>;

const Reference2 kPlus = [](Real x, Real y) { return x + y; };
const Reference2 kMinus = [](Real x, Real y) { return x - y; };
const Reference2 kTimes = [](Real x, Real y) { return x * y; };
const Reference2 kDivide = [](Real x, Real y) { return x / y; };

// Wraps a long double libm function as a Reference.
Reference via_long_double(long double (*f)(long double)) {
  return [f](Real x) { return Real(f(static_cast<long double>(x))); };
}

constexpr DType kFloatDtypes[] = {DType::F32, DType::F16, DType::BF16, DType::F64};
constexpr DType kLowPrecision[] = {DType::F16, DType::BF16};

// Uniform values in [low, high), drawn on the host (not through the code under test), rounded to dtype.
Tensor uniform(const Shape& shape, double low, double high, DType dtype, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> draw(low, high);
  std::vector<double> values(static_cast<size_t>(shape_numel(shape)));
  for (double& v : values) v = draw(rng);
  return Tensor::from_vector(values, shape, dtype);
}

// Values of both signs spread over 2^-8 .. 2^8: their sums and quotients round in every way.
Tensor spread(const Shape& shape, DType dtype, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> mantissa(1, 2), exponent(-8, 8);
  std::vector<double> values(static_cast<size_t>(shape_numel(shape)));
  for (size_t i = 0; i < values.size(); ++i)
    values[i] = (i % 2 ? -1 : 1) * mantissa(rng) * std::exp2(std::floor(exponent(rng)));
  return Tensor::from_vector(values, shape, dtype);
}

// Every one of the 65,536 f16 or bf16 bit patterns (finite, subnormal, +-0, +-inf, NaN).
Tensor all_bit_patterns(DType dtype) {
  Tensor t = Tensor::empty({65536}, dtype);
  auto* bits = static_cast<uint16_t*>(t.data_ptr());
  for (uint32_t i = 0; i < 65536; ++i) bits[i] = static_cast<uint16_t>(i);
  return t;
}

// f applied to the values x holds (already rounded to its dtype), as an f64 tensor.
Tensor reference(const Tensor& x, const Reference& f) {
  std::vector<double> values = x.to_vector<double>();
  for (double& v : values) v = static_cast<double>(f(Real(v)));
  return Tensor::from_vector(values, x.shape(), DType::F64);
}

// f(a, b) with NumPy broadcasting to out_shape; the index mapping is written out here, independently of the
// library's broadcasting.
Tensor reference(const Tensor& a, const Tensor& b, const Shape& out_shape, const Reference2& f) {
  const std::vector<double> va = a.to_vector<double>(), vb = b.to_vector<double>();
  const int64_t ndim = static_cast<int64_t>(out_shape.size());
  std::vector<double> out(static_cast<size_t>(shape_numel(out_shape)));
  for (int64_t i = 0; i < static_cast<int64_t>(out.size()); ++i) {
    int64_t rest = i, ia = 0, ib = 0, step_a = 1, step_b = 1;
    for (int64_t d = ndim - 1; d >= 0; --d) {
      const int64_t index = rest % out_shape[d];
      rest /= out_shape[d];
      const int64_t da = d - (ndim - a.dim()), db = d - (ndim - b.dim());
      if (da >= 0) {
        if (a.shape()[da] != 1) ia += index * step_a;
        step_a *= a.shape()[da];
      }
      if (db >= 0) {
        if (b.shape()[db] != 1) ib += index * step_b;
        step_b *= b.shape()[db];
      }
    }
    out[i] = static_cast<double>(f(Real(va[ia]), Real(vb[ib])));
  }
  return Tensor::from_vector(out, out_shape, DType::F64);
}

// ---- references ----
// Written from the definitions. Two use an exact identity to stay accurate in the far negative tail, where
// the textbook form cancels even in long double (1 + tanh(u) underflows to 0 for u < -22):
//   Phi(x) = (1 + erf(x / sqrt2)) / 2 = erfc(-x / sqrt2) / 2,   1 + tanh(u) = 2 / (1 + e^-2u).
// GeluMatchesTheTextbookFormulasAndPublishedValues checks the kernels against the textbook forms directly.
constexpr long double kSqrt2 = 1.4142135623730950488016887242096981L;
constexpr long double kPi = 3.1415926535897932384626433832795029L;

long double gelu_erf_ld(long double x) { return x * erfcl(-x / kSqrt2) / 2; }
long double gelu_tanh_ld(long double x) {
  const long double u = sqrtl(2 / kPi) * (x + 0.044715L * x * x * x);
  return x / (1 + expl(-2 * u));
}
long double sigmoid_ld(long double x) { return 1 / (1 + expl(-x)); }  // long double's range: no overflow
long double silu_ld(long double x) { return x / (1 + expl(-x)); }
long double rsqrt_ld(long double x) { return 1 / sqrtl(x); }

// sqrt in quad: long double's 64-bit root refined by one Newton step (quadratic convergence: > 113 bits).
Real sqrt_quad(Real x) {
  Real r = sqrtl(static_cast<long double>(x));
  if (r > 0 && r == r && r * 2 != r) r = (r + x / r) / 2;
  return r;
}

struct UnaryCase {
  const char* name;
  std::function<Tensor(const Tensor&)> op;
  Reference reference;
  bool exact;  // one correctly rounded IEEE operation: 0 ulp in every dtype
};

std::vector<UnaryCase> unary_cases() {
  return {
      {"neg", [](const Tensor& x) { return neg(x); }, [](Real x) { return -x; }, true},
      {"abs", [](const Tensor& x) { return abs(x); }, [](Real x) { return x < 0 ? -x : x; }, true},
      {"relu", [](const Tensor& x) { return relu(x); }, [](Real x) { return x < 0 ? Real(0) : x; }, true},
      {"sqrt", [](const Tensor& x) { return sqrt(x); }, sqrt_quad, true},
      {"exp", [](const Tensor& x) { return exp(x); }, via_long_double(expl), false},
      {"log", [](const Tensor& x) { return log(x); }, via_long_double(logl), false},
      {"rsqrt", [](const Tensor& x) { return rsqrt(x); }, via_long_double(rsqrt_ld), false},
      {"tanh", [](const Tensor& x) { return tanh(x); }, via_long_double(tanhl), false},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); }, via_long_double(sigmoid_ld), false},
      {"silu", [](const Tensor& x) { return silu(x); }, via_long_double(silu_ld), false},
      {"gelu", [](const Tensor& x) { return gelu(x); }, via_long_double(gelu_erf_ld), false},
      {"gelu_tanh", [](const Tensor& x) { return gelu(x, GeluApproximation::Tanh); },
       via_long_double(gelu_tanh_ld), false},
      {"pow2.5", [](const Tensor& x) { return pow(x, 2.5); },
       [](Real x) { return Real(powl(static_cast<long double>(x), 2.5L)); }, false},
      {"pow2", [](const Tensor& x) { return pow(x, 2.0); }, [](Real x) { return x * x; }, true},
      {"pow-1", [](const Tensor& x) { return pow(x, -1.0); }, [](Real x) { return 1 / x; }, true},
  };
}

// Like within_ulp, but allows base + k * cond(x) ulps, with cond(x) = |x f'(x) / f(x)| the condition number
// of f at the stored input. A kernel that rounds a scaled copy of its argument (x / sqrt2 for gelu, u(x) for
// its tanh form) by a few units of the dtype's precision moves f(x) by that many times cond(x) ulps, however
// exactly it evaluates f afterwards: in the far tail of gelu, cond(x) ~ x^2.
::testing::AssertionResult within_conditioned_ulp(const Tensor& actual, const Tensor& x,
                                                  long double (*f)(long double), double base, double k) {
  const std::vector<double> xs = x.to_vector<double>(), got = actual.to_vector<double>();
  int bad = 0;
  std::ostringstream report;
  for (size_t i = 0; i < xs.size(); ++i) {
    const long double v = xs[i], fv = f(v), h = 1e-7L;
    // x f'(x) / f(x) by a central difference in long double (a bound needs only a few correct digits)
    const long double slope = (f(v * (1 + h)) - f(v * (1 - h))) / (2 * h);
    const double cond = v == 0 ? 1 : static_cast<double>(fabsl(slope / fv));
    const double expected = mixtape::testing::round_to(actual.dtype(), static_cast<double>(fv));
    const double distance = mixtape::testing::ulp_distance(actual.dtype(), got[i], expected);
    if (distance > base + k * cond && bad++ < 5)
      report << "x = " << xs[i] << ": got " << got[i] << ", reference " << static_cast<double>(fv) << " ("
             << distance << " ulp, cond " << cond << ")\n";
  }
  if (bad) return ::testing::AssertionFailure() << bad << " elements beyond the bound\n" << report.str();
  return ::testing::AssertionSuccess();
}

#define EXPECT_GRADCHECK(f, ...)                                  \
  do {                                                            \
    const GradcheckResult result_ = gradcheck(f, {__VA_ARGS__});  \
    EXPECT_TRUE(result_.ok) << result_.message;                   \
  } while (0)

}  // namespace

// ---- unary forward -------------------------------------------------------------------------------------

TEST(UnaryOps, EveryF16AndBf16BitPatternMatchesTheRoundedReference) {
  for (DType dtype : kLowPrecision) {
    const Tensor x = all_bit_patterns(dtype);
    for (const UnaryCase& c : unary_cases()) {
      SCOPED_TRACE(std::string(c.name) + " " + dtype_name(dtype));
      const Tensor y = c.op(x);
      ASSERT_EQ(y.dtype(), dtype);
      EXPECT_TRUE(within_ulp(y, reference(x, c.reference), c.exact ? 0 : 1));
    }
  }
}

TEST(UnaryOps, SixteenBitTablesGiveTheFloatKernelsResultRoundedOnce) {
  // On f16/bf16 these ops read a table of the float formula's results (and silu and the gelus' backward a
  // table of the float derivative), tensor/cpu/elementwise.cpp. Their bits must be the f32 kernel's result
  // on the same (exactly widened) input, rounded once to the 16-bit type: on every bit pattern, contiguous
  // and through a transposed view, forward and backward (g * f'(x) rounded once). A NaN only has to stay a
  // NaN: its sign and payload depend on the order in which compiled code meets the operands.
  Backend& backend = backend_for(Device::cpu());
  const UnaryOp forward_ops[] = {UnaryOp::Exp,  UnaryOp::Log,     UnaryOp::Tanh,    UnaryOp::Sigmoid,
                                 UnaryOp::Silu, UnaryOp::GeluErf, UnaryOp::GeluTanh};
  const UnaryOp backward_ops[] = {UnaryOp::Silu, UnaryOp::GeluErf, UnaryOp::GeluTanh};
  auto same = [](const Tensor& actual, const Tensor& expected) {
    const Tensor a = actual.contiguous(), e = expected.contiguous();
    const auto* pa = static_cast<const uint16_t*>(a.data_ptr());
    const auto* pe = static_cast<const uint16_t*>(e.data_ptr());
    const std::vector<double> va = a.to_vector<double>(), ve = e.to_vector<double>();
    int bad = 0;
    std::ostringstream report;
    for (int64_t i = 0; i < a.numel(); ++i) {
      if (pa[i] == pe[i] || (std::isnan(va[i]) && std::isnan(ve[i]))) continue;
      if (bad++ < 5)
        report << "element " << i << ": bits " << pa[i] << " (" << va[i] << "), want " << pe[i] << " (" << ve[i]
               << ")\n";
    }
    if (bad) return ::testing::AssertionFailure() << bad << " elements differ\n" << report.str();
    return ::testing::AssertionSuccess();
  };
  for (DType dtype : kLowPrecision) {
    const Tensor x = all_bit_patterns(dtype), x32 = x.to(DType::F32);
    const Tensor g = uniform({65536}, -3, 3, dtype, 5), g32 = g.to(DType::F32);
    for (UnaryOp op : forward_ops) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " forward, UnaryOp " + std::to_string(static_cast<int>(op)));
      Tensor y = Tensor::empty({65536}, dtype), y32 = Tensor::empty({65536}, DType::F32);
      backend.unary(op, x, y, 0);
      backend.unary(op, x32, y32, 0);
      EXPECT_TRUE(same(y, y32.to(dtype)));
      // Through a transposed view: the strided loop reads the same table.
      const Tensor xt = x.view({256, 256}).mT();
      Tensor yt = Tensor::empty({256, 256}, dtype);
      backend.unary(op, xt, yt, 0);
      EXPECT_TRUE(same(yt, y.view({256, 256}).mT()));
    }
    for (UnaryOp op : backward_ops) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " backward, UnaryOp " + std::to_string(static_cast<int>(op)));
      Tensor gx = Tensor::empty({65536}, dtype), gx32 = Tensor::empty({65536}, DType::F32);
      backend.unary_backward(op, x, Tensor(), g, gx, 0);
      backend.unary_backward(op, x32, Tensor(), g32, gx32, 0);
      EXPECT_TRUE(same(gx, gx32.to(dtype)));
      const Tensor xt = x.view({256, 256}).mT(), gt = g.view({256, 256}).mT();
      Tensor gxt = Tensor::empty({256, 256}, dtype);
      backend.unary_backward(op, xt, Tensor(), gt, gxt, 0);
      EXPECT_TRUE(same(gxt, gx.view({256, 256}).mT()));
    }
  }
}

TEST(UnaryOps, ForwardMatchesTheReferenceInF32AndF64) {
  struct Bound {
    const char* name;
    double low, high;
    double ulp_f32, ulp_f64;
  };
  // Ranges reach into the tails each formula must survive (sigmoid and silu to -80, where 1 / (1 + e^-x)
  // in float would overflow). Bounds: the libm error of the function (glibc: exp, log, pow < 1 ulp; tanh
  // ~1.5) plus half an ulp per further rounded operation (sigmoid: + and /, silu: one more *), rounded up.
  // gelu is in GeluMatchesTheTextbookFormulasAndPublishedValues (its bound depends on the condition number).
  const Bound bounds[] = {
      {"neg", -100, 100, 0, 0},       {"abs", -100, 100, 0, 0},      {"relu", -100, 100, 0, 0},
      {"sqrt", 0, 1000, 0, 0},        {"exp", -80, 80, 1, 1},        {"log", 1e-3, 1e3, 1, 1},
      {"rsqrt", 1e-3, 1e3, 1, 1},     {"tanh", -10, 10, 2, 2},       {"sigmoid", -80, 80, 2, 2},
      {"silu", -80, 80, 2, 2},        {"pow2.5", 1e-3, 1e3, 1, 1},   {"pow2", -100, 100, 0, 0},
      {"pow-1", 1e-3, 1e3, 0, 0},
  };
  for (const UnaryCase& c : unary_cases()) {
    const Bound* bound = nullptr;
    for (const Bound& b : bounds)
      if (std::string(b.name) == c.name) bound = &b;
    if (std::string(c.name).starts_with("gelu")) continue;
    ASSERT_NE(bound, nullptr) << c.name;
    for (DType dtype : {DType::F32, DType::F64}) {
      SCOPED_TRACE(std::string(c.name) + " " + dtype_name(dtype));
      const Tensor x = uniform({4096}, bound->low, bound->high, dtype, 7);
      const double max_ulp = dtype == DType::F32 ? bound->ulp_f32 : bound->ulp_f64;
      EXPECT_TRUE(within_ulp(c.op(x), reference(x, c.reference), max_ulp));
    }
  }
}

TEST(UnaryOps, GeluMatchesTheTextbookFormulasAndPublishedValues) {
  // gelu scales its argument before the sensitive function (x * (sqrt2/2) into erfc, u(x) into exp), and
  // each rounding of that argument costs up to cond(x) ulps (see within_conditioned_ulp). Erf form: the
  // constant and the product round, so 3 + 2 cond(x). Tanh form: u = k (x + c x^3) takes two rounded
  // constants and five operations, but in the tail u ~ c x^3 is three times less sensitive than x, so
  // 3 + 3 cond(x). cond(x) ~ x^2 in the negative tail; -12 (f32: the output is still a normal float) ends
  // the tested range.
  for (DType dtype : {DType::F32, DType::F64}) {
    SCOPED_TRACE(dtype_name(dtype));
    const Tensor x = uniform({4096}, -12, 12, dtype, 7);
    EXPECT_TRUE(within_conditioned_ulp(gelu(x), x, gelu_erf_ld, 3, 2));
    const Tensor xt = uniform({4096}, -10, 10, dtype, 8);  // below -10 the tanh form underflows in float
    EXPECT_TRUE(within_conditioned_ulp(gelu(xt, GeluApproximation::Tanh), xt, gelu_tanh_ld, 3, 3));
    // Where 1 + erf and 1 + tanh do not cancel badly (|x| <= 3 keeps >= 55 bits in long double) the
    // textbook forms 0.5 x (1 + erf(x / sqrt2)) and 0.5 x (1 + tanh(sqrt(2/pi)(x + 0.044715 x^3))) are
    // accurate references too.
    const Tensor mid = uniform({2048}, -3, 3, dtype, 11);
    auto erf_form = [](long double v) { return 0.5L * v * (1 + erfl(v / kSqrt2)); };
    auto tanh_form = [](long double v) {
      return 0.5L * v * (1 + tanhl(sqrtl(2 / kPi) * (v + 0.044715L * v * v * v)));
    };
    EXPECT_TRUE(within_conditioned_ulp(gelu(mid), mid, erf_form, 3, 2));
    EXPECT_TRUE(within_conditioned_ulp(gelu(mid, GeluApproximation::Tanh), mid, tanh_form, 3, 3));
  }
  // x * Phi(x) from published standard normal CDF values: Phi(1) = 0.841344746068543,
  // Phi(-2) = 0.0227501319481792, Phi(-5) = 2.86651571879194e-7.
  const Tensor points = Tensor::from_vector(std::vector<double>{1, -2, -5}, {3});
  const Tensor published = Tensor::from_vector(
      std::vector<double>{0.841344746068543, -2 * 0.0227501319481792, -5 * 2.86651571879194e-7}, {3});
  EXPECT_TRUE(all_close(gelu(points), published, 0, 1e-13));
  // The erf form would return exactly 0 in f32 below x = -5.5.
  EXPECT_LT(gelu(Tensor::scalar(-8.0)).item(), 0.0);
  EXPECT_LT(gelu(Tensor::scalar(-8.0), GeluApproximation::Tanh).item(), 0.0);
}

TEST(FastMath, ErfcOfFloatAndExpNonpositiveMatchLongDoubleToTheDocumentedBound) {
  // The kernels' vectorised erfc (relative error < 2e-10 documented) and double exp (~1e-15), on a dense
  // grid of floats across the whole range where erfc of a float is a normal float, and on every float
  // within 64 ulps of the points where the fitted variable t changes behaviour (0, 1, 10.5).
  double worst_erfc = 0, worst_exp = 0;
  auto check_erfc = [&](float z) {
    const long double want = erfcl(static_cast<long double>(z));
    const double got = mixtape::cpu::erfc_of_float(z);
    if (z > 10.5f) {  // documented: 0 beyond 10.5, where erfc < 1e-49 is far below any float it feeds
      EXPECT_EQ(got, 0.0);
      EXPECT_LT(want, 1e-49L);
    } else {
      worst_erfc = std::max(worst_erfc, static_cast<double>(fabsl(got / want - 1)));
    }
  };
  for (int i = 0; i <= 400000; ++i) check_erfc(-10.0f + 20.5f * static_cast<float>(i) / 400000);
  for (float c : {0.0f, 1.0f, -1.0f, 10.5f}) {
    float below = c, above = c;
    for (int k = 0; k < 64; ++k) {
      check_erfc(below = std::nextafter(below, -INFINITY));
      check_erfc(above = std::nextafter(above, INFINITY));
    }
  }
  EXPECT_LT(worst_erfc, 2e-10);
  for (int i = 0; i <= 200000; ++i) {
    const double a = -700.0 * i / 200000;
    const long double want = expl(static_cast<long double>(a));
    worst_exp = std::max(worst_exp, static_cast<double>(fabsl(mixtape::cpu::exp_nonpositive(a) / want - 1)));
  }
  EXPECT_LT(worst_exp, 1e-14);
  EXPECT_EQ(mixtape::cpu::erfc_of_float(11.0f), 0.0);
  EXPECT_EQ(mixtape::cpu::erfc_of_float(-11.0f), 2.0);
  EXPECT_EQ(mixtape::cpu::exp_nonpositive(-800.0), 0.0);
  EXPECT_TRUE(std::isnan(mixtape::cpu::erfc_of_float(NAN)));
}

TEST(UnaryOps, F32GeluIsWithinOneUlpOfTheExactValue) {
  // f32 gelu computes 0.5 x erfc(-x / sqrt2) in double from the exact input (erfc_of_float, relative
  // error < 2e-10) and rounds once, so it is within one ulp of the exact value everywhere its result is a
  // normal float (x > -13), with no cond(x) term: the argument is never rounded to float.
  const Tensor x = uniform({200000}, -13, 12, DType::F32, 21);
  EXPECT_TRUE(within_ulp(gelu(x), reference(x, [](Real v) {
                return static_cast<Real>(gelu_erf_ld(static_cast<long double>(v)));
              }), 1));
}

TEST(UnaryGrad, F32GeluDerivativeIsWithinOneUlpPlusTheErfcFitError) {
  // The f32 backward computes Phi(x) + x phi(x) in double (erfc_and_gaussian shares e^(-x^2/2) between the
  // two terms) and rounds once. Its only error beyond that rounding is erfc's relative 2e-10, i.e. an
  // absolute 2e-10 * (Phi(x) + |x| phi(x)): invisible except where the two terms cancel, around the
  // derivative's zero at x = -0.7518, where it is tens of ulps of a tiny result. So the bound is one ulp
  // plus 3e-10 times the sum of the terms' magnitudes.
  const Tensor x = uniform({100000}, -12, 12, DType::F32, 23);
  Tensor xg = x.detach().requires_grad_();
  backward({sum(gelu(xg))});
  const std::vector<double> xs = x.to_vector<double>(), got = xg.grad().to_vector<double>();
  int bad = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    const long double y = xs[i], cdf = erfcl(-y / kSqrt2) / 2;
    const long double xpdf = y * expl(-y * y / 2) / sqrtl(2 * kPi);
    const double want = static_cast<double>(cdf + xpdf);
    const float magnitude = std::fabs(static_cast<float>(want));
    const double ulp = std::nextafter(magnitude, INFINITY) - magnitude;
    const double bound = ulp + 3e-10 * static_cast<double>(cdf + fabsl(xpdf));
    if (std::fabs(got[i] - want) > bound && bad++ < 5)
      ADD_FAILURE() << "x = " << xs[i] << ": got " << got[i] << ", exact " << want << " (bound " << bound << ")";
  }
  EXPECT_EQ(bad, 0);
}

TEST(UnaryOps, NonContiguousInputsGiveTheSameValues) {
  for (DType dtype : kFloatDtypes) {
    SCOPED_TRACE(dtype_name(dtype));
    const Tensor base = uniform({6, 10}, 0.1, 4, dtype, 3);
    const Tensor transposed = base.mT();             // strides [1, 10]
    const Tensor strided = base.slice(1, 1, 10, 3);  // inner stride 3
    EXPECT_TRUE(within_ulp(sqrt(transposed), reference(transposed, sqrt_quad), 0));
    EXPECT_TRUE(within_ulp(exp(strided), reference(strided, via_long_double(expl)), 1));
    EXPECT_EQ(exp(transposed).shape(), (Shape{10, 6}));
    EXPECT_TRUE(exp(transposed).is_contiguous());
  }
}

TEST(UnaryOps, ReluPassesNanAndAbsOfNegativeZeroIsZero) {
  const Tensor x = Tensor::from_vector(std::vector<double>{NAN, -0.0, -3}, {3});
  const std::vector<double> r = relu(x).to_vector<double>();
  EXPECT_TRUE(std::isnan(r[0]));
  EXPECT_EQ(r[1], 0.0);
  EXPECT_EQ(r[2], 0.0);
  EXPECT_FALSE(std::signbit(abs(x).to_vector<double>()[1]));
}

// ---- binary forward ------------------------------------------------------------------------------------

TEST(BinaryOps, ArithmeticIsCorrectlyRoundedInEveryDtype) {
  const std::vector<std::pair<const char*, std::function<Tensor(const Tensor&, const Tensor&)>>> ops = {
      {"add", [](const Tensor& a, const Tensor& b) { return a + b; }},
      {"sub", [](const Tensor& a, const Tensor& b) { return a - b; }},
      {"mul", [](const Tensor& a, const Tensor& b) { return a * b; }},
      {"div", [](const Tensor& a, const Tensor& b) { return a / b; }},
  };
  const std::vector<Reference2> refs = {kPlus, kMinus, kTimes, kDivide};
  for (DType dtype : kFloatDtypes) {
    const Tensor a = spread({20000}, dtype, 1), b = spread({20000}, dtype, 2);
    for (size_t k = 0; k < ops.size(); ++k) {
      SCOPED_TRACE(std::string(ops[k].first) + " " + dtype_name(dtype));
      const Tensor out = ops[k].second(a, b);
      EXPECT_EQ(out.dtype(), dtype);
      EXPECT_TRUE(within_ulp(out, reference(a, b, {20000}, refs[k]), 0));  // see the file comment
    }
  }
}

TEST(BinaryOps, PowMatchesReferenceWithinOneUlp) {
  for (DType dtype : kFloatDtypes) {
    SCOPED_TRACE(dtype_name(dtype));
    const Tensor a = uniform({3000}, 0.05, 4, dtype, 4), b = uniform({3000}, -3, 3, dtype, 5);
    auto pow_ref = [](Real x, Real y) {
      return Real(powl(static_cast<long double>(x), static_cast<long double>(y)));
    };
    // powf / pow are within one ulp in glibc; for f16/bf16 see the file comment.
    EXPECT_TRUE(within_ulp(pow(a, b), reference(a, b, {3000}, pow_ref), 1));
  }
}

TEST(BinaryOps, BroadcastsLikeNumpy) {
  for (DType dtype : kFloatDtypes) {
    SCOPED_TRACE(dtype_name(dtype));
    const Tensor a = spread({2, 1, 3}, dtype, 1), b = spread({4, 1}, dtype, 2);
    const Tensor sum = add(a, b), product = mul(b, a);
    EXPECT_EQ(sum.shape(), (Shape{2, 4, 3}));
    EXPECT_TRUE(within_ulp(sum, reference(a, b, {2, 4, 3}, kPlus), 0));
    EXPECT_TRUE(within_ulp(product, reference(a, b, {2, 4, 3}, kTimes), 0));
    // a 0-d operand and a [1]-shaped one broadcast against anything
    const Tensor s = Tensor::scalar(0.5, dtype), one = spread({1}, dtype, 3);
    EXPECT_TRUE(within_ulp(sub(a, s), reference(a, s, {2, 1, 3}, kMinus), 0));
    EXPECT_TRUE(within_ulp(div(one, a), reference(one, a, {2, 1, 3}, kDivide), 0));
  }
}

TEST(BinaryOps, TransposedStridedAndBroadcastOperandsOnBothThreads) {
  // 512 x 300 = 153,600 elements: above the parallel threshold, so the strided runs are split across threads.
  const Tensor a = uniform({300, 512}, -2, 2, DType::F32, 6).mT();  // [512, 300], inner stride 512
  const Tensor row = uniform({300}, -2, 2, DType::F32, 7);           // broadcast along dim 0 (stride 0)
  const Tensor column = uniform({512, 1}, -2, 2, DType::F32, 8);     // broadcast along the inner dim
  const Tensor c = uniform({512, 600}, -2, 2, DType::F32, 9).slice(1, 0, 600, 2);  // inner stride 2
  const Tensor d = uniform({512, 300}, -2, 2, DType::F32, 10);                      // contiguous
  EXPECT_TRUE(within_ulp(add(a, row), reference(a, row, {512, 300}, kPlus), 0));
  EXPECT_TRUE(within_ulp(add(d, row), reference(d, row, {512, 300}, kPlus), 0));
  EXPECT_TRUE(within_ulp(sub(column, d), reference(column, d, {512, 300}, kMinus), 0));
  EXPECT_TRUE(within_ulp(div(d, column), reference(d, column, {512, 300}, kDivide), 0));
  EXPECT_TRUE(within_ulp(mul(column, c), reference(column, c, {512, 300}, kTimes), 0));
  EXPECT_TRUE(within_ulp(add(a, c), reference(a, c, {512, 300}, kPlus), 0));
}

TEST(BinaryOps, MixedFloatingDtypesPromoteToTheWiderOne) {
  const Tensor h = spread({64}, DType::F16, 1), b = spread({64}, DType::BF16, 2);
  const Tensor f = spread({64}, DType::F32, 3), d = spread({64}, DType::F64, 4);
  const Tensor hb = add(h, b), hf = mul(h, f), fd = sub(f, d);
  EXPECT_EQ(hb.dtype(), DType::F32);  // neither f16 nor bf16 holds the other
  EXPECT_EQ(hf.dtype(), DType::F32);
  EXPECT_EQ(fd.dtype(), DType::F64);
  EXPECT_TRUE(within_ulp(hb, reference(h, b, {64}, kPlus), 0));
  EXPECT_TRUE(within_ulp(hf, reference(h, f, {64}, kTimes), 0));
  EXPECT_TRUE(within_ulp(fd, reference(f, d, {64}, kMinus), 0));
}

TEST(ScalarOps, KeepTheScalarInDoubleAndRoundOnce) {
  // 0.1 is not representable in any dtype: rounding it to the tensor's dtype first would miss by an ulp on
  // many elements; computing in double and rounding once matches the reference exactly.
  const double s = 0.1;
  struct Case {
    const char* name;
    std::function<Tensor(const Tensor&)> op;
    Reference ref;
  };
  const Case cases[] = {
      {"x+s", [s](const Tensor& x) { return x + s; }, [s](Real x) { return x + s; }},
      {"s+x", [s](const Tensor& x) { return s + x; }, [s](Real x) { return s + x; }},
      {"x-s", [s](const Tensor& x) { return x - s; }, [s](Real x) { return x - s; }},
      {"s-x", [s](const Tensor& x) { return s - x; }, [s](Real x) { return s - x; }},
      {"x*s", [s](const Tensor& x) { return x * s; }, [s](Real x) { return x * s; }},
      {"s*x", [s](const Tensor& x) { return s * x; }, [s](Real x) { return s * x; }},
      {"x/s", [s](const Tensor& x) { return x / s; }, [s](Real x) { return x / s; }},
      {"s/x", [s](const Tensor& x) { return s / x; }, [s](Real x) { return s / x; }},
  };
  for (DType dtype : kFloatDtypes) {
    const Tensor x = spread({4000}, dtype, 5);
    for (const Case& c : cases) {
      SCOPED_TRACE(std::string(c.name) + " " + dtype_name(dtype));
      // The reference rounds the exact long double result; for f64 the kernel's double result is that
      // rounding (one IEEE operation), for the others double rounding is innocuous (see the file comment).
      const Tensor out = c.op(x);
      EXPECT_EQ(out.dtype(), dtype);
      EXPECT_TRUE(within_ulp(out, reference(x, c.ref), 0));
    }
  }
}

// ---- where / masked_fill -------------------------------------------------------------------------------

TEST(Where, SelectsWithAnyConditionDtypeAndBroadcastsAllThree) {
  const Tensor a = spread({2, 1, 3}, DType::F16, 1), b = spread({4, 1}, DType::F32, 2);
  const std::vector<double> cond_values = {1, 0, -2, 0};
  for (DType cond_dtype : {DType::I64, DType::I32, DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(cond_dtype));
    const Tensor cond = Tensor::from_vector(cond_values, {4, 1}).to(cond_dtype);
    const Tensor out = where(cond, a, b);
    EXPECT_EQ(out.dtype(), DType::F32);
    EXPECT_EQ(out.shape(), (Shape{2, 4, 3}));
    const std::vector<double> va = a.to_vector<double>(), vb = b.to_vector<double>();
    const std::vector<double> got = out.to_vector<double>();
    for (int64_t i = 0; i < 2; ++i)
      for (int64_t j = 0; j < 4; ++j)
        for (int64_t k = 0; k < 3; ++k)
          EXPECT_EQ(got[(i * 4 + j) * 3 + k], cond_values[j] != 0 ? va[i * 3 + k] : vb[j]);
  }
}

TEST(Where, NanConditionIsTrueAndIntegerValuesWork) {
  const Tensor cond = Tensor::from_vector(std::vector<double>{NAN, 0, 0.5}, {3});
  const Tensor a = Tensor::from_vector(std::vector<int64_t>{1, 2, 3}, {3});
  const Tensor b = Tensor::from_vector(std::vector<int64_t>{-1, -2, -3}, {3});
  EXPECT_EQ(where(cond, a, b).to_vector<int64_t>(), (std::vector<int64_t>{1, -2, 3}));
  EXPECT_EQ(where(cond, a, b).dtype(), DType::I64);
}

TEST(Where, TransposedConditionAndValues) {
  const Tensor cond = Tensor::from_vector(std::vector<int64_t>{1, 0, 0, 1, 1, 0}, {2, 3}).mT();  // [3, 2]
  const Tensor a = Tensor::arange(0, 6, 1, DType::F64).view({2, 3}).mT();
  const Tensor out = where(cond, a, Tensor::scalar(-1, DType::F64));
  // cond^T = [[1,1],[0,1],[0,0]], a^T = [[0,3],[1,4],[2,5]]
  EXPECT_EQ(out.to_vector<double>(), (std::vector<double>{0, 3, -1, 4, -1, -1}));
}

TEST(MaskedFill, FillsWhereMaskIsNonzeroWithBroadcastMask) {
  // A causal attention mask [T, T] over scores [B, T, T].
  const Tensor scores = uniform({2, 3, 3}, -1, 1, DType::BF16, 3);
  const Tensor future = Tensor::from_vector(std::vector<int64_t>{0, 1, 1, 0, 0, 1, 0, 0, 0}, {3, 3});
  const Tensor out = masked_fill(scores, future, -INFINITY);
  EXPECT_EQ(out.dtype(), DType::BF16);
  const std::vector<double> s = scores.to_vector<double>(), got = out.to_vector<double>();
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t i = 0; i < 3; ++i)
      for (int64_t j = 0; j < 3; ++j) {
        const size_t at = static_cast<size_t>((b * 3 + i) * 3 + j);
        if (j > i) EXPECT_EQ(got[at], -INFINITY);
        else EXPECT_EQ(got[at], s[at]);
      }
  // The fill value is rounded to the tensor's dtype: 0.1 in bf16 is 0.10009765625.
  EXPECT_EQ(masked_fill(scores, future, 0.1).to_vector<double>()[1], 0.10009765625);
}

// ---- in-place kernels ----------------------------------------------------------------------------------

TEST(InPlace, AddBroadcastsConvertsAndScales) {
  Tensor dst = spread({4, 3}, DType::BF16, 1);
  const Tensor before = dst.clone();
  const Tensor src = spread({3}, DType::F32, 2);
  dst.add_(src, 0.5);
  // fp32 accumulation: d + 0.5 s is computed in float and rounded to bf16. (Not the exact sum rounded once:
  // s has 24 bits, so the float rounding can create a bf16 tie, and the result may differ by an ulp.)
  const std::vector<double> d = before.to_vector<double>(), s = src.to_vector<double>();
  const std::vector<double> got = dst.to_vector<double>();
  for (size_t i = 0; i < got.size(); ++i) {
    const float expected = static_cast<float>(d[i]) + 0.5f * static_cast<float>(s[i % 3]);
    EXPECT_EQ(got[i], static_cast<double>(static_cast<float>(BFloat16(expected))));
  }
  EXPECT_GT(dst.version(), before.version());
}

TEST(InPlace, AddInEveryDtypePairIsTheFloatSumRoundedOnce) {
  // dst += alpha src for every pair of f32, f16 and bf16: d + alpha s in float, rounded to dst's dtype once.
  // alpha is a power of two, so alpha s is exact whether or not the compiler fuses the multiply into the add.
  // Contiguous runs with a 16-bit side go through float blocks of 256 (40 x 25 = 1000 elements: whole blocks
  // and a tail); a dst stored transposed under a row-major src takes the element-by-element loop. Planted: inf,
  // NaN, and a sum past f16's largest finite value (65504).
  const Shape shape{40, 25};
  for (DType dt : {DType::F32, DType::F16, DType::BF16}) {
    for (DType st : {DType::F32, DType::F16, DType::BF16}) {
      for (double alpha : {1.0, -0.5, 2.0}) {
        SCOPED_TRACE(std::string(dtype_name(dt)) + " += " + std::to_string(alpha) + " x " + dtype_name(st));
        std::vector<double> d = spread(shape, dt, 7).to_vector<double>(), s = spread(shape, st, 8).to_vector<double>();
        d[3] = std::numeric_limits<double>::infinity();
        s[500] = std::numeric_limits<double>::quiet_NaN();
        d[999] = 60000.0;
        s[999] = 40000.0;
        const Tensor src = Tensor::from_vector(s, shape, st);
        const std::vector<double> d_held = Tensor::from_vector(d, shape, dt).to_vector<double>();
        const std::vector<double> s_held = src.to_vector<double>();
        std::vector<double> want(d.size());
        for (size_t i = 0; i < d.size(); ++i) {
          const float sum = static_cast<float>(d_held[i]) + static_cast<float>(alpha) * static_cast<float>(s_held[i]);
          want[i] = Tensor::from_vector(std::vector<float>{sum}, {1}, dt).to_vector<double>()[0];
        }
        Tensor contiguous = Tensor::from_vector(d, shape, dt);
        contiguous.add_(src, alpha);
        Tensor transposed = Tensor::from_vector(d, shape, dt).transpose(0, 1).contiguous().transpose(0, 1);
        transposed.add_(src, alpha);
        for (const Tensor* got : {&contiguous, &transposed}) {
          const std::vector<double> g = got->to_vector<double>();
          int wrong = 0;
          for (size_t i = 0; i < g.size(); ++i) {
            const bool same = std::isnan(want[i]) ? std::isnan(g[i]) : g[i] == want[i];
            if (!same && ++wrong <= 3)
              ADD_FAILURE() << (got == &contiguous ? "contiguous" : "transposed") << " [" << i << "]: " << g[i]
                            << ", want " << want[i];
          }
          EXPECT_EQ(wrong, 0);
        }
        if (dt == DType::F16 && alpha > 0) {
          EXPECT_TRUE(std::isinf(contiguous.to_vector<double>()[999]));
        }
      }
    }
  }
}

TEST(InPlace, MulKeepsTheScalarInDouble) {
  for (DType dtype : kFloatDtypes) {
    SCOPED_TRACE(dtype_name(dtype));
    const Tensor x = spread({1000}, dtype, 4);
    Tensor y = x.clone();
    y.mul_(0.1);
    EXPECT_TRUE(within_ulp(y, reference(x, [](Real v) { return v * Real(0.1); }), 0));
  }
}

// ---- gradients ----------------------------------------------------------------------------------------

TEST(UnaryGrad, GradcheckEveryOp) {
  struct Case {
    const char* name;
    std::function<Tensor(const Tensor&)> op;
    double low, high;
  };
  const Case cases[] = {
      {"neg", [](const Tensor& x) { return neg(x); }, -2, 2},
      {"abs", [](const Tensor& x) { return abs(x); }, -2, 2},
      {"relu", [](const Tensor& x) { return relu(x); }, -2, 2},
      {"exp", [](const Tensor& x) { return exp(x); }, -2, 2},
      {"log", [](const Tensor& x) { return log(x); }, 0.2, 3},
      {"sqrt", [](const Tensor& x) { return sqrt(x); }, 0.2, 3},
      {"rsqrt", [](const Tensor& x) { return rsqrt(x); }, 0.2, 3},
      {"tanh", [](const Tensor& x) { return tanh(x); }, -3, 3},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); }, -4, 4},
      {"silu", [](const Tensor& x) { return silu(x); }, -4, 4},
      {"gelu", [](const Tensor& x) { return gelu(x); }, -4, 4},
      {"gelu_tanh", [](const Tensor& x) { return gelu(x, GeluApproximation::Tanh); }, -4, 4},
      {"pow2.5", [](const Tensor& x) { return pow(x, 2.5); }, 0.2, 3},
      {"pow2", [](const Tensor& x) { return pow(x, 2.0); }, -2, 2},
      {"pow-1", [](const Tensor& x) { return pow(x, -1.0); }, 0.2, 3},
      {"pow0", [](const Tensor& x) { return pow(x, 0.0); }, -2, 2},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const Tensor x = uniform({3, 4}, c.low, c.high, DType::F64, 21);
    EXPECT_GRADCHECK([&](const std::vector<Tensor>& in) { return c.op(in[0]); }, x);
    // through a transposed (non-contiguous) input
    EXPECT_GRADCHECK([&](const std::vector<Tensor>& in) { return c.op(in[0].mT()); }, x);
  }
}

TEST(UnaryGrad, ReluAndAbsHaveZeroDerivativeAtZero) {
  Tensor x = Tensor::from_vector(std::vector<double>{-1, 0, 2}, {3}, DType::F64).requires_grad_();
  backward({relu(x)}, {Tensor::ones({3}, DType::F64)});
  EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{0, 0, 1}));
  Tensor z = Tensor::from_vector(std::vector<double>{-1, 0, 2}, {3}, DType::F64).requires_grad_();
  backward({abs(z)}, {Tensor::ones({3}, DType::F64)});
  EXPECT_EQ(z.grad().to_vector<double>(), (std::vector<double>{-1, 0, 1}));
}

TEST(UnaryGrad, BackwardKernelsMatchTheDerivativeInEveryDtype) {
  // grad_x = g * f'(x) computed in float for f32/f16/bf16 and rounded once, compared with the derivative in
  // long double. Ops that differentiate through their rounded output (exp, sqrt, rsqrt, tanh, sigmoid) carry
  // that output's rounding error too, so the bound is a few ulps of the dtype, absolute and relative.
  struct Case {
    const char* name;
    std::function<Tensor(const Tensor&)> op;
    std::function<long double(long double)> derivative;
    double low, high;
  };
  const Case cases[] = {
      {"exp", [](const Tensor& x) { return exp(x); }, [](long double x) { return expl(x); }, -2, 2},
      {"log", [](const Tensor& x) { return log(x); }, [](long double x) { return 1 / x; }, 0.2, 3},
      {"sqrt", [](const Tensor& x) { return sqrt(x); },
       [](long double x) { return 0.5L / sqrtl(x); }, 0.2, 3},
      {"rsqrt", [](const Tensor& x) { return rsqrt(x); },
       [](long double x) { return -0.5L * powl(x, -1.5L); }, 0.2, 3},
      {"tanh", [](const Tensor& x) { return tanh(x); },
       [](long double x) { return 1 - tanhl(x) * tanhl(x); }, -3, 3},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); },
       [](long double x) { return sigmoid_ld(x) * (1 - sigmoid_ld(x)); }, -6, 6},
      {"silu", [](const Tensor& x) { return silu(x); },
       [](long double x) { return sigmoid_ld(x) * (1 + x * (1 - sigmoid_ld(x))); }, -6, 6},
      {"gelu", [](const Tensor& x) { return gelu(x); },
       [](long double x) { return erfcl(-x / kSqrt2) / 2 + x * expl(-x * x / 2) / sqrtl(2 * kPi); }, -6, 6},
      {"gelu_tanh", [](const Tensor& x) { return gelu(x, GeluApproximation::Tanh); },
       [](long double x) {  // d/dx 0.5 x (1 + tanh u), differentiated by hand
         const long double k = sqrtl(2 / kPi), u = k * (x + 0.044715L * x * x * x), t = tanhl(u);
         return 0.5L * (1 + t) + 0.5L * x * (1 - t * t) * k * (1 + 3 * 0.044715L * x * x);
       }, -6, 6},
      {"pow2.5", [](const Tensor& x) { return pow(x, 2.5); },
       [](long double x) { return 2.5L * powl(x, 1.5L); }, 0.2, 3},
  };
  for (DType dtype : {DType::F32, DType::F16, DType::BF16}) {
    const double eps = dtype == DType::F32 ? 0x1p-23 : dtype == DType::F16 ? 0x1p-10 : 0x1p-7;
    for (const Case& c : cases) {
      SCOPED_TRACE(std::string(c.name) + " " + dtype_name(dtype));
      Tensor x = uniform({256}, c.low, c.high, dtype, 31).requires_grad_();
      const Tensor g = uniform({256}, 0.5, 2, dtype, 32);
      backward({c.op(x)}, {g});
      ASSERT_EQ(x.grad().dtype(), dtype);
      const std::vector<double> xs = x.to_vector<double>(), gs = g.to_vector<double>();
      std::vector<double> expected(xs.size());
      for (size_t i = 0; i < xs.size(); ++i) expected[i] = static_cast<double>(gs[i] * c.derivative(xs[i]));
      EXPECT_TRUE(all_close(x.grad(), Tensor::from_vector(expected, {256}, DType::F64), 8 * eps, 8 * eps));
    }
  }
}

TEST(UnaryGrad, BroadcastOutputGradientIsRead) {
  // A stride-0 output gradient (as the backward of a sum hands down) goes through the strided kernel path.
  Tensor x = uniform({4, 5}, -2, 2, DType::F32, 41).requires_grad_();
  const Tensor g = Tensor::from_vector(std::vector<float>{0.5f, -1, 2, 3, 1}, {5}).expand({4, 5});
  backward({tanh(x)}, {g});
  const std::vector<double> xs = x.to_vector<double>(), grads = x.grad().to_vector<double>();
  for (size_t i = 0; i < xs.size(); ++i) {
    const double t = static_cast<float>(std::tanh(xs[i]));
    EXPECT_NEAR(grads[i], g.to_vector<double>()[i] * (1 - t * t), 1e-6);
  }
}

TEST(BinaryGrad, GradcheckSameShapes) {
  const Tensor a = uniform({3, 4}, 0.5, 2, DType::F64, 51), b = uniform({3, 4}, 0.5, 2, DType::F64, 52);
  EXPECT_GRADCHECK([](const std::vector<Tensor>& in) { return add(in[0], in[1]); }, a, b);
  EXPECT_GRADCHECK([](const std::vector<Tensor>& in) { return sub(in[0], in[1]); }, a, b);
  EXPECT_GRADCHECK([](const std::vector<Tensor>& in) { return mul(in[0], in[1]); }, a, b);
  EXPECT_GRADCHECK([](const std::vector<Tensor>& in) { return div(in[0], in[1]); }, a, b);
  EXPECT_GRADCHECK([](const std::vector<Tensor>& in) { return pow(in[0], in[1]); }, a, b);
  // one input used twice: the gradients of both uses add up
  EXPECT_GRADCHECK([](const std::vector<Tensor>& in) { return mul(in[0], in[0]); }, a);
}

TEST(BinaryGrad, GradcheckTransposedInput) {
  const Tensor a = uniform({4, 3}, 0.5, 2, DType::F64, 53), b = uniform({3, 4}, 0.5, 2, DType::F64, 54);
  EXPECT_GRADCHECK([](const std::vector<Tensor>& in) { return mul(in[0].mT(), in[1]); }, a, b);
  EXPECT_GRADCHECK([](const std::vector<Tensor>& in) { return div(in[1], in[0].mT()); }, a, b);
  EXPECT_GRADCHECK([](const std::vector<Tensor>& in) { return pow(in[0].mT(), in[1]); }, a, b);
}

TEST(BinaryGrad, GradcheckBroadcastInputsSumBackToTheirShapes) {
  const Tensor a = uniform({2, 1, 3}, 0.5, 2, DType::F64, 55), b = uniform({4, 1}, 0.5, 2, DType::F64, 56);
  EXPECT_GRADCHECK([](const std::vector<Tensor>& in) { return add(in[0], in[1]); }, a, b);
  EXPECT_GRADCHECK([](const std::vector<Tensor>& in) { return sub(in[0], in[1]); }, a, b);
  EXPECT_GRADCHECK([](const std::vector<Tensor>& in) { return mul(in[0], in[1]); }, a, b);
  EXPECT_GRADCHECK([](const std::vector<Tensor>& in) { return div(in[0], in[1]); }, a, b);
  EXPECT_GRADCHECK([](const std::vector<Tensor>& in) { return pow(in[0], in[1]); }, a, b);
  const Tensor s = uniform({}, 0.5, 2, DType::F64, 57);  // 0-d
  EXPECT_GRADCHECK([](const std::vector<Tensor>& in) { return mul(in[0], in[1]); }, a, s);
}

TEST(BinaryGrad, MixedDtypeGradientsComeBackInEachInputsDtype) {
  Tensor a = Tensor::from_vector(std::vector<double>{1.5, -2}, {2}, DType::F16).requires_grad_();
  Tensor b = Tensor::from_vector(std::vector<double>{0.1, 3}, {2}, DType::F32).requires_grad_();
  const Tensor y = mul(a, b);
  ASSERT_EQ(y.dtype(), DType::F32);
  backward({y}, {Tensor::ones({2})});
  EXPECT_EQ(a.grad().dtype(), DType::F16);
  EXPECT_EQ(b.grad().dtype(), DType::F32);
  // d(ab)/da = b (0.1f rounded to f16 is 0.0999755859375), d(ab)/db = a
  EXPECT_EQ(a.grad().to_vector<double>(), (std::vector<double>{0.0999755859375, 3}));
  EXPECT_EQ(b.grad().to_vector<double>(), (std::vector<double>{1.5, -2}));
}

TEST(BinaryGrad, PowAtZeroBaseAndZeroExponent) {
  // (a, b) = (0, 2): da = 2 * 0 = 0, db = 0 (a == 0).  (0, 0): da = 0 (b == 0), db = 0.
  // (2, 0): da = 0 (b == 0), db = 2^0 log 2.  (-2, 2): da = 2 * (-2) = -4, db = NaN (log of a negative).
  Tensor a = Tensor::from_vector(std::vector<double>{0, 0, 2, -2}, {4}, DType::F64).requires_grad_();
  Tensor b = Tensor::from_vector(std::vector<double>{2, 0, 0, 2}, {4}, DType::F64).requires_grad_();
  backward({pow(a, b)}, {Tensor::ones({4}, DType::F64)});
  EXPECT_EQ(a.grad().to_vector<double>(), (std::vector<double>{0, 0, 0, -4}));
  const std::vector<double> db = b.grad().to_vector<double>();
  EXPECT_EQ(db[0], 0);
  EXPECT_EQ(db[1], 0);
  EXPECT_DOUBLE_EQ(db[2], std::log(2.0));
  EXPECT_TRUE(std::isnan(db[3]));
  // pow(x, 0) is constant: zero gradient also at x = 0.
  Tensor x = Tensor::from_vector(std::vector<double>{0, 3}, {2}, DType::F64).requires_grad_();
  backward({pow(x, 0.0)}, {Tensor::ones({2}, DType::F64)});
  EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{0, 0}));
}

TEST(BinaryGrad, OnlyInputsThatRequireGradGetOne) {
  Tensor a = uniform({3}, 1, 2, DType::F32, 58).requires_grad_();
  const Tensor b = uniform({3}, 1, 2, DType::F32, 59);
  backward({div(a, b)}, {Tensor::ones({3})});
  EXPECT_TRUE(a.grad().defined());
  EXPECT_FALSE(b.grad().defined());
}

TEST(ScalarGrad, GradcheckEveryScalarOverload) {
  const Tensor x = uniform({3, 4}, 0.5, 2, DType::F64, 61);
  EXPECT_GRADCHECK([](const std::vector<Tensor>& in) { return add(in[0], 0.5); }, x);
  EXPECT_GRADCHECK([](const std::vector<Tensor>& in) { return sub(in[0], 0.5); }, x);
  EXPECT_GRADCHECK([](const std::vector<Tensor>& in) { return sub(0.5, in[0]); }, x);
  EXPECT_GRADCHECK([](const std::vector<Tensor>& in) { return mul(in[0], -1.5); }, x);
  EXPECT_GRADCHECK([](const std::vector<Tensor>& in) { return div(in[0], 3.0); }, x);
  EXPECT_GRADCHECK([](const std::vector<Tensor>& in) { return div(2.0, in[0]); }, x);
  EXPECT_GRADCHECK([](const std::vector<Tensor>& in) { return div(2.0, in[0].mT()); }, x);
}

TEST(WhereGrad, GradcheckWithBroadcastAndNoGradientForTheCondition) {
  const Tensor cond = Tensor::from_vector(std::vector<int64_t>{1, 0, 0, 1}, {4, 1});
  const Tensor a = uniform({2, 1, 3}, -1, 1, DType::F64, 71), b = uniform({3}, -1, 1, DType::F64, 72);
  EXPECT_GRADCHECK([](const std::vector<Tensor>& in) { return where(in[0], in[1], in[2]); }, cond, a, b);
  // a floating condition that requires grad gets none
  Tensor c = Tensor::from_vector(std::vector<double>{0, 1, 0}, {3}, DType::F64).requires_grad_();
  Tensor x = a.clone().requires_grad_();
  backward({where(c, x, b)}, {Tensor::ones({2, 1, 3}, DType::F64)});
  EXPECT_FALSE(c.grad().defined());
  EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{0, 1, 0, 0, 1, 0}));
}

TEST(MaskedFillGrad, GradientIsZeroWhereFilled) {
  const Tensor mask = Tensor::from_vector(std::vector<int64_t>{0, 1, 1, 0, 0, 1, 0, 0, 0}, {3, 3});
  const Tensor x = uniform({2, 3, 3}, -1, 1, DType::F64, 81);
  EXPECT_GRADCHECK([&](const std::vector<Tensor>& in) { return masked_fill(in[0], mask, -5.0); }, x);
  // x broadcast against a bigger mask
  const Tensor row = uniform({3}, -1, 1, DType::F64, 82);
  EXPECT_GRADCHECK([&](const std::vector<Tensor>& in) { return masked_fill(in[0], mask, 2.0); }, row);
}

// ---- errors --------------------------------------------------------------------------------------------

TEST(ElementwiseErrors, ShapesThatDoNotBroadcastNameTheOpAndShapes) {
  const Tensor a = Tensor::zeros({2, 3}), b = Tensor::zeros({4});
  EXPECT_ERROR_MENTIONS(add(a, b), "add", "f32[2,3]", "f32[4]", "broadcast");
  EXPECT_ERROR_MENTIONS(mul(b, a), "mul", "f32[2,3]", "f32[4]");
  EXPECT_ERROR_MENTIONS(pow(a, b), "pow", "[2,3]", "[4]");
  EXPECT_ERROR_MENTIONS(where(Tensor::zeros({5}), a, a), "where", "[5]", "[2,3]");
  EXPECT_ERROR_MENTIONS(masked_fill(a, Tensor::zeros({2, 2}, DType::I64), 0), "masked_fill", "f32[2,3]",
                        "i64[2,2]");
}

TEST(ElementwiseErrors, IntegerTensorsAreRejectedByFloatingOps) {
  const Tensor i = Tensor::arange(0, 3, 1, DType::I64);
  EXPECT_ERROR_MENTIONS(exp(i), "exp", "i64[3]", "floating");
  EXPECT_ERROR_MENTIONS(gelu(i), "gelu", "i64[3]");
  EXPECT_ERROR_MENTIONS(pow(Tensor::zeros({2}, DType::I32), 2.0), "pow", "i32[2]");
  EXPECT_ERROR_MENTIONS(add(Tensor::zeros({3}), i), "add", "i64[3]");
  EXPECT_ERROR_MENTIONS(mul(i, 2.0), "mul", "i64[3]");
  EXPECT_ERROR_MENTIONS(masked_fill(i, i, 1), "masked_fill", "i64[3]");
  EXPECT_ERROR_MENTIONS(where(i, i, Tensor::zeros({3})), "where", "i64[3]", "f32[3]");
}

TEST(ElementwiseErrors, UndefinedInputsAreNamed) {
  EXPECT_ERROR_MENTIONS(relu(Tensor()), "relu", "undefined");
  EXPECT_ERROR_MENTIONS(add(Tensor::zeros({1}), Tensor()), "add", "undefined");
  EXPECT_ERROR_MENTIONS(where(Tensor(), Tensor::zeros({1}), Tensor::zeros({1})), "where", "undefined");
}
