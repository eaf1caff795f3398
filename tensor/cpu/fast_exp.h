#pragma once
// exp for the kernels' hot loops (softmax, attention): a branch-free float version the compiler vectorises,
// within 1 ulp of the correctly rounded exp on [-87, 88]; below -87 it returns exactly 0 (so a masked -inf
// entry gives 0), inputs above 88 are clamped (callers pass x - max <= 0), and NaN stays NaN. glibc's expf does not
// vectorise here and costs about 3x more. f64 keeps std::exp: it is the reference dtype.
#include <bit>
#include <cmath>
#include <cstdint>

namespace mixtape::cpu {

inline float fast_exp(float x) {
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

}  // namespace mixtape::cpu
