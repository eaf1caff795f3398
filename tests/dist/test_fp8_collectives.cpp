// fp8 payloads in the data-parallel collectives (dist/fp8_collectives.h, and ZeRO-1's parameter all-gather in
// dist/zero.h), on two ranks of the job. The expected
// values come from the formats' definitions: every E5M2 / E4M3 value is enumerated from its fields, the
// payload of a chunk is each value times format_max / amax rounded to the nearest of them, and the sums are
// taken in double (the fp32 sums under test stay within 1e-6 of them; one fp8 step is 12.5% or 6.25%).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "dist/communicator.h"
#include "amp/scaler.h"
#include "dist/fp8_collectives.h"
#include "dist/zero.h"
#include "optim/sgd.h"
#include "tensor/tensor.h"
#include "dist_test_util.h"

using namespace mixtape;
using namespace mixtape::dist;
using mixtape::testing::expect_close;

namespace {

// The non-negative finite values of a sign-exponent-mantissa format with `exp_bits` and `man_bits` (bias
// 2^(exp_bits-1) - 1), the top exponent reserved (E5M2) or only its all-ones mantissa (E4M3).
std::vector<double> format_values(int exp_bits, int man_bits, bool ieee_top) {
  const int bias = (1 << (exp_bits - 1)) - 1, top = (1 << exp_bits) - 1;
  std::vector<double> values;
  for (int e = 0; e <= top; ++e)
    for (int m = 0; m < (1 << man_bits); ++m) {
      if (e == top && (ieee_top || m == (1 << man_bits) - 1)) continue;  // Inf / NaN codes
      const double frac = static_cast<double>(m) / (1 << man_bits);
      values.push_back(e == 0 ? std::ldexp(frac, 1 - bias) : std::ldexp(1 + frac, e - bias));
    }
  return values;
}
const std::vector<double>& e5m2() { static const auto v = format_values(5, 2, true); return v; }
const std::vector<double>& e4m3() { static const auto v = format_values(4, 3, false); return v; }

// The nearest value of `grid` to |x| (the test's values are never halfway), with x's sign.
double nearest(const std::vector<double>& grid, double x) {
  double best = grid.front();
  for (double g : grid)
    if (std::abs(g - std::abs(x)) < std::abs(best - std::abs(x))) best = g;
  return std::copysign(best, x);
}

// A chunk as its payload carries it: scaled by format_max / amax, rounded to the grid, scaled back.
std::vector<double> round_trip(const std::vector<double>& grid, const std::vector<double>& chunk) {
  double amax = 0;
  for (double v : chunk) amax = std::max(amax, std::abs(v));
  const double scale = amax == 0 ? 1 : grid.back() / amax;
  std::vector<double> out;
  for (double v : chunk) out.push_back(nearest(grid, v * scale) / scale);
  return out;
}

std::vector<double> slice(const std::vector<double>& v, size_t begin, size_t end) {
  return {v.begin() + static_cast<std::ptrdiff_t>(begin), v.begin() + static_cast<std::ptrdiff_t>(end)};
}

Communicator pair() {
  const Communicator world = Communicator::world();
  return world.split(world.rank() / 2, world.rank(), "pair");
}

}  // namespace

// Chunk 1 of rank 0 holds values 10^10 times smaller than its chunk 0: with one scale for the whole tensor they
// would land below E5M2's smallest subnormal (2^-16 of 57344 / 10^4) and vanish; with a scale per chunk they
// arrive with E5M2's relative precision. Every rank ends with the same mean.
TEST(Fp8Collectives, AllReduceMeanSumsPerChunkScaledE5M2PayloadsInFp32) {
  const Communicator group = pair();
  const std::vector<std::vector<double>> x = {{1.0e4, 1.1, 3.0e-7, 1.0e-7, 5.0}, {-2.0e3, 0.9, 1.3e-7, 0.0, 7.0}};
  const int r = group.rank();
  const Tensor got = fp8_all_reduce_mean(group, Tensor::from_vector(x[r], {5}));
  ASSERT_EQ(got.dtype(), DType::F32);
  // 5 values over 2 ranks: chunks of 3, the last padded with a zero.
  std::vector<double> want;
  for (size_t c = 0; c < 2; ++c) {
    const size_t b = 3 * c, e = std::min<size_t>(b + 3, 5);
    const std::vector<double> a = round_trip(e5m2(), slice(x[0], b, e)), q = round_trip(e5m2(), slice(x[1], b, e));
    std::vector<double> mean;
    for (size_t i = 0; i < a.size(); ++i) mean.push_back((a[i] + q[i]) / 2);
    for (double v : round_trip(e5m2(), mean)) want.push_back(v);
  }
  ASSERT_NE(want[3], 0.0);  // the small chunk survived (the reference's own premise)
  expect_close(got.to_vector<double>(), want, 1e-6, 0.0, "the mean");
  // And it is not the exact mean: the payloads are fp8 (1.1 and 0.9 are off E5M2's grid at their scales).
  EXPECT_NE(got.to_vector<double>()[1], 1.0);
}

TEST(Fp8Collectives, AllReduceMeanOfAChunkHoldingInfIsNaNOnEveryRank) {
  const Communicator group = pair();
  std::vector<double> mine = {1.0, 2.0, 3.0, 4.0};
  if (group.rank() == 1) mine[0] = std::numeric_limits<double>::infinity();
  const std::vector<double> got = fp8_all_reduce_mean(group, Tensor::from_vector(mine, {4})).to_vector<double>();
  EXPECT_TRUE(std::isnan(got[0]) && std::isnan(got[1])) << got[0] << " " << got[1];  // chunk 0: skipped step
  EXPECT_TRUE(std::isfinite(got[2]) && std::isfinite(got[3]));
}

TEST(Fp8Collectives, BadPayloadsAreErrors) {
  const Communicator group = pair();
  const Tensor x = Tensor::from_vector(std::vector<double>{1, 2}, {2});
  EXPECT_THROW(fp8_all_reduce_mean(group, x, DType::F4E2M1), Error);
  EXPECT_THROW(fp8_all_reduce_mean(group, x.reshape({1, 2})), Error);
}

// ZeRO-1 with fp8_all_gather at DP2: every model parameter holds its master rounded to E4M3 with its own scale
// (448 / its amax over both ranks' pieces), from construction on, while the masters stay exact. The two
// parameters straddle the ranks' shards; with one scale per shard instead, the small one (amax 0.01) would be
// scaled by the large one's 100 and lose its digits.
TEST(Fp8Collectives, ZeroPublishesEachParameterAsE4M3WithItsOwnScale) {
  const Communicator group = pair();
  Tensor a = Tensor::from_vector(std::vector<float>{100.0f, -37.3f, 0.2f, 61.0f, 3.3f, -99.5f}, {6});
  Tensor b = Tensor::from_vector(std::vector<float>{0.01f, -0.0037f, 0.00061f, 0.0071f}, {4});
  const std::vector<double> big = a.to_vector<double>(), small = b.to_vector<double>();
  a.requires_grad_(true);
  b.requires_grad_(true);
  ZeroOptions options;
  options.fp8_all_gather = true;
  ZeroOptimizer zero(std::make_unique<SGD>(std::vector<Tensor>{a, b}, 0.1), std::make_unique<StaticLossScaler>(1.0),
                     group, options);
  ASSERT_TRUE(zero.publishes_fp8());
  expect_close(a.to_vector<double>(), round_trip(e4m3(), big), 1e-6, 0.0, "the large parameter");
  expect_close(b.to_vector<double>(), round_trip(e4m3(), small), 1e-6, 0.0, "the small parameter");
  EXPECT_NE(b.to_vector<double>()[1], small[1]);  // rounded
  const std::vector<Tensor> masters = zero.master_values();
  EXPECT_EQ(masters[0].to_vector<double>(), big);
  EXPECT_EQ(masters[1].to_vector<double>(), small);
}
