// tf32: the rounding of a float to TensorFloat-32 and the allow_tf32 switch of f32 matmuls.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "tensor/half.h"
#include "tensor/ops.h"
#include "tensor/precision.h"
#include "test_util.h"

using namespace mixtape;
using mixtape::testing::all_close;

namespace {

// The tf32 rounding of a float from its two tf32 neighbours, compared exactly in double (independent of
// round_to_tf32's carry trick): the nearer one, the even one (bit 13 clear) on a tie; above the largest
// tf32 value the upper neighbour is Inf.
float reference_tf32(float x) {
  if (std::isnan(x) || std::isinf(x)) return x;
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t sign = bits & 0x80000000u, magnitude = bits & 0x7fffffffu;
  const uint32_t low = magnitude & ~0x1fffu, high = low + 0x2000u;  // high may be 0x7f800000 = Inf
  const double v = std::fabs(static_cast<double>(x));
  const double lo = std::bit_cast<float>(low);
  // Inf's distance: the float with the top exponent and a 2^-10 mantissa step would be 2^128 (exact in
  // double), the value round-to-nearest compares against.
  const double hi =
      high == 0x7f800000u ? std::ldexp(1.0, 128) : static_cast<double>(std::bit_cast<float>(high));
  uint32_t pick;
  if (v - lo < hi - v) pick = low;
  else if (v - lo > hi - v) pick = high;
  else pick = (low & 0x2000u) ? high : low;
  return std::bit_cast<float>(sign | pick);
}

bool same_float(float a, float b) {
  return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b) || (std::isnan(a) && std::isnan(b));
}

// a @ b in double from the operands' values rounded to tf32.
Tensor reference_tf32_matmul(const Tensor& a, const Tensor& b) {
  const std::vector<double> av = a.to_vector<double>(), bv = b.to_vector<double>();
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  std::vector<double> out(static_cast<size_t>(M * N), 0.0);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t k = 0; k < K; ++k) {
      const double x = reference_tf32(static_cast<float>(av[static_cast<size_t>(i * K + k)]));
      for (int64_t j = 0; j < N; ++j) {
        const float y = static_cast<float>(bv[static_cast<size_t>(k * N + j)]);
        out[static_cast<size_t>(i * N + j)] += x * reference_tf32(y);
      }
    }
  return Tensor::from_vector(out, {M, N}, DType::F64);
}

}  // namespace

TEST(Tf32, RoundingIsNearestEvenAtTheTenthMantissaBit) {
  // Every float whose low 16 bits lie within 3 of the tie point (0x1000 below bit 13) or that is a tie,
  // over all 2^16 high halves (signs, every exponent incl. subnormals, Inf and NaN), plus 4M random floats.
  int64_t checked = 0;
  for (uint32_t high = 0; high < 0x10000u; ++high)
    for (uint32_t low : {0x0000u, 0x0001u, 0x0fffu, 0x1000u, 0x1001u, 0x1fffu, 0x2fffu, 0x3000u, 0x3001u,
                         0xffffu}) {
      const float x = std::bit_cast<float>(high << 16 | low);
      ASSERT_TRUE(same_float(round_to_tf32(x), reference_tf32(x))) << std::hex << (high << 16 | low);
      ++checked;
    }
  std::mt19937 rng(7);
  for (int i = 0; i < 4000000; ++i) {
    const float x = std::bit_cast<float>(static_cast<uint32_t>(rng()));
    ASSERT_TRUE(same_float(round_to_tf32(x), reference_tf32(x))) << std::hex << std::bit_cast<uint32_t>(x);
  }
  EXPECT_GT(checked, 600000);
  EXPECT_EQ(round_to_tf32(1.0f + 0x1p-11f), 1.0f);                  // a tie goes to the even 1.0
  EXPECT_EQ(round_to_tf32(1.0f + 0x3p-11f), 1.0f + 0x1p-9f);         // a tie goes to the even 1 + 2^-9
  EXPECT_TRUE(std::isinf(round_to_tf32(std::numeric_limits<float>::max())));  // rounds past the top: Inf
  EXPECT_TRUE(std::isnan(round_to_tf32(NAN)));
}

TEST(Tf32, AllowTf32RoundsF32MatmulInputsAndTheGuardRestores) {
  const Tensor a = Tensor::randn({48, 96}, 81), b = Tensor::randn({96, 40}, 82);
  const Tensor exact = matmul(a, b);
  EXPECT_FALSE(allow_tf32());
  Tensor rounded;
  {
    AllowTf32Guard guard(true);
    EXPECT_TRUE(allow_tf32());
    rounded = matmul(a, b);
    // f32 accumulation of K = 96 products of |values| < ~4: absolute error well below 1e-4.
    EXPECT_TRUE(all_close(rounded, reference_tf32_matmul(a, b), 1e-4, 1e-5));
    // linear goes through the same kernel: x W^T with the weight rounded too.
    const Tensor w = b.mT().contiguous();
    EXPECT_TRUE(all_close(linear(a, w), reference_tf32_matmul(a, b), 1e-4, 1e-5));
  }
  EXPECT_FALSE(allow_tf32());
  // tf32 drops 13 mantissa bits: the products differ from the f32 ones by ~1e-3 relative, far more than f32
  // rounding (~1e-6), so the switch demonstrably acted and then stopped acting.
  const std::vector<double> r = rounded.to_vector<double>(), e = exact.to_vector<double>();
  double largest = 0;
  for (size_t i = 0; i < r.size(); ++i) largest = std::max(largest, std::fabs(r[i] - e[i]));
  EXPECT_GT(largest, 1e-3);
  EXPECT_TRUE(all_close(matmul(a, b), exact, 0, 0));
}

TEST(Tf32, OtherDtypesAreUnaffected) {
  AllowTf32Guard guard(true);
  const Tensor a = Tensor::randn({8, 16}, 83, DType::F64), b = Tensor::randn({16, 4}, 84, DType::F64);
  AllowTf32Guard off(false);
  const Tensor plain = matmul(a, b);
  AllowTf32Guard on(true);
  EXPECT_TRUE(all_close(matmul(a, b), plain, 0, 0));
}
