// Philox4x32-10 against the published known-answer vectors, and Tensor::rand/randn/randint: reproducible from
// the seed alone (not the thread count or shape), and distributed as claimed. Statistical bounds are 5 sigma
// of the sampling error of n = 1M draws, so a correct generator fails them with probability ~1e-6 per check,
// while a wrong one (biased, wrong range, wrong scale) misses them by far more.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "tensor/ops.h"
#include "tensor/random.h"
#include "test_util.h"

namespace mixtape {
namespace {

constexpr int64_t kSamples = 1'000'000;

// ---- Philox known answers ----------------------------------------------------------------------------
// Random123's tests/kat_vectors, the three "philox4x32 10" lines: counter words c0..c3, key words k0 k1,
// expected output words. mixtape packs c0 | c1 << 32 into counter_low, c2 | c3 << 32 into counter_high and
// k0 | k1 << 32 into key.
struct PhiloxKnownAnswer {
  uint32_t counter[4];
  uint32_t key[2];
  uint32_t expected[4];
};
constexpr PhiloxKnownAnswer kPhiloxVectors[] = {
    {{0x00000000, 0x00000000, 0x00000000, 0x00000000}, {0x00000000, 0x00000000},
     {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
    {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff},
     {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
    {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0},
     {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
};

uint64_t pack(uint32_t low, uint32_t high) { return static_cast<uint64_t>(high) << 32 | low; }

TEST(Philox, MatchesRandom123KnownAnswerVectors) {
  for (const PhiloxKnownAnswer& v : kPhiloxVectors) {
    const auto out = philox4x32(pack(v.counter[0], v.counter[1]), pack(v.counter[2], v.counter[3]),
                                pack(v.key[0], v.key[1]));
    for (int i = 0; i < 4; ++i) EXPECT_EQ(out[i], v.expected[i]) << std::hex << "word " << i << " of vector "
                                                                  << v.counter[0];
  }
}

TEST(Philox, EveryCounterAndKeyWordMatters) {
  // Flipping one bit in any of the four counter words or two key words changes the block (a packing bug
  // that dropped a word would leave it unchanged).
  const uint64_t lo = 0x0123456789abcdefULL, hi = 0xfedcba9876543210ULL, key = 0x0f1e2d3c4b5a6978ULL;
  const auto base = philox4x32(lo, hi, key);
  for (int bit : {0, 31, 32, 63}) {
    EXPECT_NE(philox4x32(lo ^ (uint64_t{1} << bit), hi, key), base) << "counter_low bit " << bit;
    EXPECT_NE(philox4x32(lo, hi ^ (uint64_t{1} << bit), key), base) << "counter_high bit " << bit;
    EXPECT_NE(philox4x32(lo, hi, key ^ (uint64_t{1} << bit)), base) << "key bit " << bit;
  }
}

TEST(Generator, AdvanceHandsOutConsecutiveCounterRanges) {
  Generator generator(42);
  EXPECT_EQ(generator.seed, 42u);
  EXPECT_EQ(generator.advance(10), 0u);
  EXPECT_EQ(generator.advance(3), 10u);
  EXPECT_EQ(generator.offset, 13u);
}

TEST(Philox, UniformBitsMapIntoTheHalfOpenUnitInterval) {
  EXPECT_EQ(uniform_from_bits(0), 0.0f);
  EXPECT_EQ(uniform_from_bits(0xffffffffu), 1.0f - 0x1p-24f);
  EXPECT_EQ(uniform_double_from_bits(0, 0), 0.0);
  EXPECT_EQ(uniform_double_from_bits(0xffffffffu, 0xffffffffu), 1.0 - 0x1p-53);
}

// ---- reproducibility ---------------------------------------------------------------------------------

// Runs `make` with OpenMP limited to `threads`, restoring the previous limit.
template <class Make>
auto with_threads(int threads, Make&& make) {
  const int previous = omp_get_max_threads();
  omp_set_num_threads(threads);
  auto result = make();
  omp_set_num_threads(previous);
  return result;
}

std::vector<Tensor> draws(uint64_t seed, const Shape& shape) {
  return {Tensor::rand(shape, seed, DType::F32),    Tensor::rand(shape, seed, DType::F64),
          Tensor::rand(shape, seed, DType::F16),    Tensor::rand(shape, seed, DType::BF16),
          Tensor::randn(shape, seed, DType::F32),   Tensor::randn(shape, seed, DType::F64),
          Tensor::randn(shape, seed, DType::BF16),  Tensor::randint(-5, 1000, shape, seed, DType::I64),
          Tensor::randint(0, 7, shape, seed, DType::I32)};
}

TEST(Random, SameSeedGivesSameValuesDifferentSeedsDiffer) {
  const Shape shape{300, 100};
  const std::vector<Tensor> a = draws(11, shape), b = draws(11, shape), c = draws(12, shape);
  for (size_t k = 0; k < a.size(); ++k) {
    EXPECT_EQ(a[k].to_vector<double>(), b[k].to_vector<double>()) << "draw " << k;
    const std::vector<double> x = a[k].to_vector<double>(), y = c[k].to_vector<double>();
    int64_t same = 0;
    for (size_t i = 0; i < x.size(); ++i) same += x[i] == y[i];
    // Independent streams coincide only as often as two draws from the distribution do (1/7 for
    // randint(0, 7), ~1/180 for a bf16 uniform); 1/5 is far above both.
    EXPECT_LT(same, static_cast<int64_t>(x.size()) / 5) << "draw " << k;
  }
}

TEST(Random, ValuesDoNotDependOnThreadCount) {
  // omp_set_num_threads(2) gives the fill two threads even on one core (and whatever OMP_NUM_THREADS says).
  const Shape shape{200'000};  // well above the size at which the fill runs in parallel
  const std::vector<Tensor> one = with_threads(1, [&] { return draws(5, shape); });
  const std::vector<Tensor> two = with_threads(2, [&] { return draws(5, shape); });
  for (size_t k = 0; k < one.size(); ++k)
    EXPECT_EQ(one[k].to_vector<double>(), two[k].to_vector<double>()) << "draw " << k;
}

TEST(Random, ElementDependsOnlyOnSeedAndIndexNotShape) {
  // A draw of n elements is the first n of a longer draw with the same seed, whatever the shape.
  const std::vector<Tensor> small = draws(9, {1000}), large = draws(9, {10, 1000}), shaped = draws(9, {10, 4, 25});
  for (size_t k = 0; k < small.size(); ++k) {
    const std::vector<double> s = small[k].to_vector<double>(), l = large[k].to_vector<double>();
    EXPECT_EQ(s, std::vector<double>(l.begin(), l.begin() + 1000)) << "draw " << k;
    EXPECT_EQ(s, shaped[k].to_vector<double>()) << "draw " << k;
  }
}

TEST(Random, UniformUsesCounterIndexUnderSeedKey) {
  // The documented stream (what a CUDA backend must reproduce): element i of rand(seed) is the top 24 bits
  // of word 0 of philox(counter = i, key = seed) for f32, the top 53 bits of words 0:1 for f64.
  const uint64_t seed = 0x1234567890ULL;
  const std::vector<double> f32 = Tensor::rand({64}, seed, DType::F32).to_vector<double>();
  const std::vector<double> f64 = Tensor::rand({64}, seed, DType::F64).to_vector<double>();
  for (uint64_t i = 0; i < 64; ++i) {
    const auto r = philox4x32(i, 0, seed);
    EXPECT_EQ(f32[i], std::ldexp(static_cast<double>(r[0] >> 8), -24)) << i;
    EXPECT_EQ(f64[i], std::ldexp(static_cast<double>((static_cast<uint64_t>(r[0]) << 32 | r[1]) >> 11), -53)) << i;
  }
}

// ---- distributions -----------------------------------------------------------------------------------

struct Moments {
  double mean = 0, variance = 0, skewness = 0, excess_kurtosis = 0, min = INFINITY, max = -INFINITY;
};

Moments moments(const std::vector<double>& x) {
  Moments m;
  const double n = static_cast<double>(x.size());
  for (double v : x) {
    m.mean += v;
    m.min = std::min(m.min, v);
    m.max = std::max(m.max, v);
  }
  m.mean /= n;
  double m2 = 0, m3 = 0, m4 = 0;
  for (double v : x) {
    const double d = v - m.mean;
    m2 += d * d;
    m3 += d * d * d;
    m4 += d * d * d * d;
  }
  m.variance = m2 / n;
  m.skewness = (m3 / n) / std::pow(m.variance, 1.5);
  m.excess_kurtosis = (m4 / n) / (m.variance * m.variance) - 3;
  return m;
}

TEST(Random, RandIsUniformOnTheHalfOpenUnitIntervalInEveryDtype) {
  for (DType dtype : {DType::F32, DType::F64, DType::F16, DType::BF16}) {
    const std::vector<double> x = Tensor::rand({kSamples}, 77, dtype).to_vector<double>();
    const Moments m = moments(x);
    EXPECT_GE(m.min, 0.0) << dtype;
    EXPECT_LT(m.max, 1.0) << dtype;  // never 1, also after rounding to 16 bits
    // U(0,1): mean 1/2 with sampling sd sqrt(1/12 / n) = 2.9e-4; variance 1/12 with sampling sd
    // sqrt((1/80 - 1/144) / n) = 7.5e-5. Rounding to bf16 adds at most (2^-8)^2 / 12 = 1.3e-6 of variance.
    EXPECT_NEAR(m.mean, 0.5, 5 * 2.9e-4) << dtype;
    EXPECT_NEAR(m.variance, 1.0 / 12, 5 * 7.5e-5 + 1.3e-6) << dtype;
    // Equal-width histogram: every one of 20 bins holds n/20 +- 5 sd (sd = sqrt(n p (1-p)) = 218).
    std::vector<int64_t> bins(20, 0);
    for (double v : x) ++bins[std::min<size_t>(19, static_cast<size_t>(v * 20))];
    for (size_t b = 0; b < bins.size(); ++b) {
      // bf16 has 128 values per binade in [0.5, 1); the bin edges k/20 are not representable, so allow the
      // few values rounding puts across an edge (half a bf16 ulp of 2^-8 around each edge: n * 2^-9 = 1953).
      const double slack = dtype == DType::BF16 ? 2000 : dtype == DType::F16 ? 300 : 0;
      EXPECT_NEAR(static_cast<double>(bins[b]), kSamples / 20.0, 5 * 218 + slack) << dtype << " bin " << b;
    }
  }
}

TEST(Random, LowPrecisionRandIsTheF32DrawRoundedAndKeptBelowOne) {
  // Same stream in every dtype: the f16/bf16 value is the f32 value rounded to nearest, except that values
  // rounding up to 1 become the largest value below 1 (1 - 2^-11 for f16, 1 - 2^-8 for bf16).
  const std::vector<float> f32 = Tensor::rand({kSamples}, 3, DType::F32).to_vector<float>();
  const std::vector<double> f16 = Tensor::rand({kSamples}, 3, DType::F16).to_vector<double>();
  const std::vector<double> bf16 = Tensor::rand({kSamples}, 3, DType::BF16).to_vector<double>();
  int64_t capped_f16 = 0, capped_bf16 = 0;
  for (int64_t i = 0; i < kSamples; ++i) {
    const double h = static_cast<float>(Half(f32[i])), b = static_cast<float>(BFloat16(f32[i]));
    capped_f16 += h == 1.0;
    capped_bf16 += b == 1.0;
    ASSERT_EQ(f16[i], h == 1.0 ? 1.0 - 0x1p-11 : h) << i;
    ASSERT_EQ(bf16[i], b == 1.0 ? 1.0 - 0x1p-8 : b) << i;
  }
  // The cap is exercised: P(round to 1) is 2^-12 for f16 and 2^-9 for bf16.
  EXPECT_GT(capped_f16, 100);
  EXPECT_GT(capped_bf16, 1000);
}

TEST(Random, RandnIsStandardNormal) {
  const std::vector<double> x = Tensor::randn({kSamples}, 2024, DType::F64).to_vector<double>();
  const Moments m = moments(x);
  // N(0,1) sampling sds for n = 1M: mean 1e-3, variance sqrt(2/n) = 1.41e-3, skewness sqrt(6/n) = 2.45e-3,
  // excess kurtosis sqrt(24/n) = 4.9e-3.
  EXPECT_NEAR(m.mean, 0.0, 5 * 1e-3);
  EXPECT_NEAR(m.variance, 1.0, 5 * 1.41e-3);
  EXPECT_NEAR(m.skewness, 0.0, 5 * 2.45e-3);
  EXPECT_NEAR(m.excess_kurtosis, 0.0, 5 * 4.9e-3);
  // Tail masses P(|z| > k) = 0.3173, 0.0455, 0.0027 with sds sqrt(p(1-p)/n) = 4.65e-4, 2.08e-4, 5.2e-5.
  const double tail[] = {0.31731050786291415, 0.04550026389635842, 0.0026997960632601866};
  const double sd[] = {4.65e-4, 2.08e-4, 5.2e-5};
  for (int k = 1; k <= 3; ++k) {
    const double fraction =
        static_cast<double>(std::count_if(x.begin(), x.end(), [k](double v) { return std::abs(v) > k; })) / kSamples;
    EXPECT_NEAR(fraction, tail[k - 1], 5 * sd[k - 1]) << "|z| > " << k;
  }
  EXPECT_TRUE(std::all_of(x.begin(), x.end(), [](double v) { return std::isfinite(v); }));
}

TEST(Random, LowPrecisionRandnIsTheF64DrawRounded) {
  // randn computes each normal in double and rounds once to the dtype.
  const Tensor f64 = Tensor::randn({100'000}, 8, DType::F64);
  for (DType dtype : {DType::F32, DType::F16, DType::BF16})
    EXPECT_EQ(Tensor::randn({100'000}, 8, dtype).to_vector<double>(), f64.to(dtype).to_vector<double>()) << dtype;
  const Moments m = moments(Tensor::randn({kSamples}, 8, DType::BF16).to_vector<double>());
  EXPECT_NEAR(m.mean, 0.0, 5 * 1e-3);
  EXPECT_NEAR(m.variance, 1.0, 5 * 1.41e-3 + 1e-4);  // + bf16 rounding noise (relative 2^-9 per value)
}

TEST(Random, RandintCoversLowToHighExclusiveEvenly) {
  for (DType dtype : {DType::I64, DType::I32}) {
    const std::vector<int64_t> x = Tensor::randint(-3, 7, {kSamples}, 31, dtype).to_vector<int64_t>();
    std::vector<int64_t> counts(10, 0);
    for (int64_t v : x) {
      ASSERT_GE(v, -3) << dtype;
      ASSERT_LT(v, 7) << dtype;  // never high
      ++counts[static_cast<size_t>(v + 3)];
    }
    // Each of the 10 values: n/10 +- 5 sd, sd = sqrt(n * 0.1 * 0.9) = 300.
    for (size_t k = 0; k < counts.size(); ++k)
      EXPECT_NEAR(static_cast<double>(counts[k]), kSamples / 10.0, 5 * 300) << dtype << " value " << k - 3.0;
  }
  // A one-value range gives that value.
  const std::vector<int64_t> one = Tensor::randint(41, 42, {1000}, 1).to_vector<int64_t>();
  EXPECT_TRUE(std::all_of(one.begin(), one.end(), [](int64_t v) { return v == 41; }));
}

TEST(Random, RandintHandlesRangesUpToTheWholeInt64) {
  constexpr int64_t lowest = std::numeric_limits<int64_t>::min(), highest = std::numeric_limits<int64_t>::max();
  const std::vector<int64_t> x = Tensor::randint(lowest, highest, {100'000}, 4).to_vector<int64_t>();
  // Uniform over [-2^63, 2^63): scaled to [-1, 1) the mean is 0 with sd sqrt(1/3 / n) = 1.8e-3, and both
  // halves are hit about equally.
  double mean = 0;
  int64_t negative = 0;
  for (int64_t v : x) {
    mean += std::ldexp(static_cast<double>(v), -63);
    negative += v < 0;
  }
  mean /= static_cast<double>(x.size());
  EXPECT_NEAR(mean, 0.0, 5 * 1.8e-3);
  EXPECT_NEAR(static_cast<double>(negative), 50'000, 5 * 158);
  const std::vector<int64_t> big = Tensor::randint(0, int64_t{1} << 62, {100'000}, 4).to_vector<int64_t>();
  double big_mean = 0;
  for (int64_t v : big) {
    ASSERT_GE(v, 0);
    big_mean += std::ldexp(static_cast<double>(v), -62);
  }
  EXPECT_NEAR(big_mean / 100'000, 0.5, 5 * 9.2e-4);  // U(0,1): sd sqrt(1/12 / n)
}

TEST(Random, RejectsBadArguments) {
  EXPECT_ERROR_MENTIONS(Tensor::rand({2}, 0, DType::I64), "rand", "i64");
  EXPECT_ERROR_MENTIONS(Tensor::randn({2}, 0, DType::I32), "randn", "i32");
  EXPECT_ERROR_MENTIONS(Tensor::randint(5, 5, {2}, 0), "randint", "5");
  EXPECT_ERROR_MENTIONS(Tensor::randint(0, 5, {2}, 0, DType::F32), "randint", "f32");
  // An i32 result cannot hold values outside int32: asking for them is an error, not silent wrap-around.
  EXPECT_ERROR_MENTIONS(Tensor::randint(0, int64_t{1} << 40, {2}, 0, DType::I32), "randint", "i32", "1099511627776");
  EXPECT_ERROR_MENTIONS(Tensor::rand({2, -1}, 0), "negative", "[2,-1]");
}

}  // namespace
}  // namespace mixtape
