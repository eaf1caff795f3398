#pragma once
// Vectorisable transcendental functions for the kernels' hot loops. glibc's expf and erfcf do not vectorise
// here and cost 3x (exp) to 10x (erfc) more per element.
//
// fast_exp(float), for softmax and attention: a branch-free float exp the compiler vectorises, within 1 ulp
// of the correctly rounded exp on [-87, 88]; below -87 it returns exactly 0 (so a masked -inf entry gives
// 0), inputs above 88 are clamped (callers pass x - max <= 0), and NaN stays NaN. f64 keeps std::exp: it is
// the reference dtype.
#include <bit>
#include <cmath>
#include <cstdint>

namespace mixtape::cpu {

[[gnu::always_inline]] inline float fast_exp(float x) {
  // exp(x) = 2^n * exp(r) with n = round(x / ln 2) and |r| <= ln 2 / 2; ln 2 is split in two parts so
  // x - n ln 2 is exact; exp(r) is a degree-7 minimax polynomial (Cephes' expf coefficients).
  constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: x + kRound - kRound rounds x to an integer
  constexpr float kLowest = -87.0f, kHighest = 88.0f;
  const float xc = x < kLowest ? kLowest : (x > kHighest ? kHighest : x);
  const float n = (xc * kLog2e + kRound) - kRound;
  const float r = (xc - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const float two_to_n = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);  // n in [-126, 127]
  return x < kLowest ? 0.0f : p * two_to_n;
}

inline double fast_exp(double x) { return std::exp(x); }

// exp(a) for a <= 0 in double, for results that are rounded to float (or used with float inputs): relative
// error ~1e-15, far below float's 6e-8; below -700 it returns 0 (every float result it feeds is 0 or
// subnormal there anyway). Same scheme as fast_exp: a = n ln2 + r, |r| <= ln2/2, ln2 split so r is exact,
// then the Taylor series of e^r to degree 12 (truncation < 0.35^13 / 13! ~ 2e-16).
[[gnu::always_inline]] inline double exp_nonpositive(double a) {
  constexpr double kLog2e = 1.4426950408889634, kLn2Hi = 0.6931471803691238, kLn2Lo = 1.9082149292705877e-10;
  constexpr double kRound = 6755399441055744.0;  // 1.5 * 2^52
  const double ac = a < -700.0 ? -700.0 : a;
  const double shifted = ac * kLog2e + kRound;  // n = round(a / ln 2) sits in its low mantissa bits
  const double n = shifted - kRound;
  const double r = (ac - n * kLn2Hi) - n * kLn2Lo;
  double p = 1.0 / 479001600.0;  // 1/12!
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r * r + r + 1.0;
  // 2^n from the bits of `shifted` (2^52 * 1.5 + n): its low bits hold n in two's complement, and shifting
  // (bits + 1023) left by 52 keeps just n + 1023 (in [13, 1023] for n in [-1010, 0]) as the exponent field.
  // Integer adds and shifts vectorise on AVX2; a double-to-int64 conversion does not (it needs AVX-512DQ),
  // and with one the whole erfc loop ran scalar on AVX2 machines.
  const double two_to_n = std::bit_cast<double>((std::bit_cast<int64_t>(shifted) + 1023) << 52);
  return a < -700.0 ? 0.0 : p * two_to_n;
}

// erfc(z) in double for a z that is a float (or any double): relative error < 2e-10 (~0.003 float ulp), so
// a float result computed from it rounds correctly but for about one case in 10^7. For z >= 0,
//   erfc(z) = e^(-z^2) t g(t),  t = 1 / (1 + z/2),
// with g a degree-12 polynomial in t fitted (weighted least squares, relative error, Chebyshev nodes) to
// erfc(z) e^(z^2) (1 + z/2) on z in [0, 10.5]; the idea of the variable t is Numerical Recipes' erfcc, whose
// own 10-term formula is only good to 1.2e-7. z^2 is exact in double when z is a float. Beyond z = 10.5,
// erfc(z) < 1e-49 and the result is 0; for z < 0, erfc(z) = 2 - erfc(-z). NaN stays NaN.
// erfc_and_gaussian also returns the e^(-z^2) it computed on the way (GELU's derivative needs both).
struct ErfcAndGaussian {
  double erfc, gaussian;
};

[[gnu::always_inline]] inline ErfcAndGaussian erfc_and_gaussian(double z) {
  const double a = z < 0 ? -z : z;
  const double t = 1.0 / (1.0 + 0.5 * a);
  double g = -0.00995666089534071;
  g = g * t + 0.03851514023410352;
  g = g * t + 0.013797818240323827;
  g = g * t - 0.3342017072638458;
  g = g * t + 0.779231334502315;
  g = g * t - 0.8104990720117495;
  g = g * t + 0.39661809204015097;
  g = g * t - 0.18625789656946815;
  g = g * t + 0.13364204987178638;
  g = g * t + 0.16705439260029847;
  g = g * t + 0.24794189607431485;
  g = g * t + 0.2820174409407522;
  g = g * t + 0.2820971720880584;
  const double gaussian = exp_nonpositive(-a * a);
  const double tail = a > 10.5 ? 0.0 : gaussian * t * g;
  return {z < 0 ? 2.0 - tail : tail, gaussian};
}

[[gnu::always_inline]] inline double erfc_of_float(double z) { return erfc_and_gaussian(z).erfc; }

}  // namespace mixtape::cpu
