// fp16 / bf16 conversions checked exhaustively (all 65,536 patterns of each), against the F16C hardware
// instruction (float -> fp16), against integer-only references written here (float -> bf16, double -> 16-bit),
// plus the small DType helpers (size, name, promote, convert).
#include <immintrin.h>

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <vector>

#include "tensor/dtype.h"
#include "tensor/tensor.h"
#include "tensor/half.h"
#include "test_util.h"

namespace mixtape {
namespace {

uint32_t float_bits(float f) { return std::bit_cast<uint32_t>(f); }
float bits_float(uint32_t b) { return std::bit_cast<float>(b); }

// ---- independent decoders ---------------------------------------------------------------------------
// A 16-bit float with `mantissa_bits` stored mantissa bits and exponent bias `bias`, decoded with ldexp from
// its fields. `allow_top_exponent` decodes the all-ones exponent as an ordinary binade (used to get "the
// value one ulp above the largest finite", e.g. 65536 for fp16).
double decode16(uint16_t bits, int mantissa_bits, int bias, bool allow_top_exponent = false) {
  const int exponent_bits = 15 - mantissa_bits;
  const int top = (1 << exponent_bits) - 1;
  const double sign = (bits & 0x8000) ? -1.0 : 1.0;
  const int exponent = (bits >> mantissa_bits) & top;
  const int mantissa = bits & ((1 << mantissa_bits) - 1);
  if (exponent == top && !allow_top_exponent)
    return mantissa ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
  if (exponent == 0) return sign * std::ldexp(mantissa, 1 - bias - mantissa_bits);  // subnormal
  return sign * std::ldexp((1 << mantissa_bits) + mantissa, exponent - bias - mantissa_bits);
}
double decode_half(uint16_t bits, bool allow_top = false) { return decode16(bits, 10, 15, allow_top); }
double decode_bf16(uint16_t bits, bool allow_top = false) { return decode16(bits, 7, 127, allow_top); }

// ---- F16C reference --------------------------------------------------------------------------------
// vcvtps2ph with an explicit round-to-nearest-even immediate (independent of MXCSR's rounding mode).
__attribute__((target("f16c"))) void f16c_convert(const float* in, uint16_t* out, size_t n) {
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m128i h = _mm_cvtps_ph(_mm_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i), h);
  }
  for (; i < n; ++i) {
    const __m128i h = _mm_cvtps_ph(_mm_set_ss(in[i]), _MM_FROUND_TO_NEAREST_INT);
    out[i] = static_cast<uint16_t>(_mm_extract_epi16(h, 0));
  }
}

bool have_f16c() { return __builtin_cpu_supports("f16c"); }

// Compares float_to_half_bits with F16C on every value; reports the first few differences.
::testing::AssertionResult matches_f16c(const std::vector<float>& values) {
  std::vector<uint16_t> expected(values.size());
  f16c_convert(values.data(), expected.data(), values.size());
  size_t bad = 0;
  std::ostringstream report;
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t got = float_to_half_bits_portable(values[i]);
    if (got != expected[i] && bad++ < 5)
      report << std::hex << "float 0x" << float_bits(values[i]) << " (" << std::hexfloat << values[i]
             << "): got 0x" << got << ", F16C 0x" << expected[i] << std::dec << "\n";
  }
  if (bad) return ::testing::AssertionFailure() << bad << " of " << values.size() << " differ\n" << report.str();
  return ::testing::AssertionSuccess();
}

// ---- integer-only bf16 reference ---------------------------------------------------------------------
// Keeps the upper 16 bits and rounds by comparing the dropped 16 bits with half an ulp (0x8000): above goes
// up, below goes down, exactly half goes to the even upper half. NaN: keep sign and top payload, set quiet.
uint16_t reference_bf16(uint32_t bits) {
  const bool nan = (bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0;
  uint16_t upper = static_cast<uint16_t>(bits >> 16);
  if (nan) return static_cast<uint16_t>(upper | 0x0040u);
  const uint16_t dropped = static_cast<uint16_t>(bits & 0xffffu);
  const bool round_up = dropped > 0x8000u || (dropped == 0x8000u && (upper & 1u) != 0);
  // Carrying out of the mantissa bumps the exponent; out of 0x7f7f it gives 0x7f80 = Inf, as IEEE requires.
  if (round_up) ++upper;
  return upper;
}

::testing::AssertionResult matches_bf16_reference(const std::vector<uint32_t>& patterns) {
  size_t bad = 0;
  std::ostringstream report;
  for (uint32_t bits : patterns) {
    const uint16_t got = float_to_bf16_bits(bits_float(bits)), want = reference_bf16(bits);
    if (got != want && bad++ < 5)
      report << std::hex << "float 0x" << bits << ": got 0x" << got << ", reference 0x" << want << std::dec << "\n";
  }
  if (bad) return ::testing::AssertionFailure() << bad << " of " << patterns.size() << " differ\n" << report.str();
  return ::testing::AssertionSuccess();
}

// ---- exact double -> 16-bit reference ------------------------------------------------------------------
// Rounds a double straight to a format with `precision` significant bits (11 for fp16, 8 for bf16), minimum
// normal exponent `min_exponent` and largest finite binade `max_exponent`, with integer arithmetic on the
// 53-bit significand: no intermediate float, so no double rounding. Returns the 16-bit pattern.
struct Format16 {
  int precision, min_exponent, max_exponent;
};
constexpr Format16 kHalfFormat{11, -14, 15};
constexpr Format16 kBF16Format{8, -126, 127};

uint16_t encode16(double magnitude, const Format16& f) {  // magnitude is exactly representable, finite, >= 0
  const int mantissa_bits = f.precision - 1;
  const int exponent_bias = 1 - f.min_exponent;  // biased exponent 1 is the first normal binade
  if (magnitude < std::ldexp(1.0, f.min_exponent))  // subnormal: a multiple of the smallest step
    return static_cast<uint16_t>(std::ldexp(magnitude, -(f.min_exponent - mantissa_bits)));
  const int exponent = std::ilogb(magnitude);
  const double significand = std::ldexp(magnitude, mantissa_bits - exponent);  // in [2^m, 2^(m+1))
  const uint32_t mantissa = static_cast<uint32_t>(significand) - (1u << mantissa_bits);
  return static_cast<uint16_t>(static_cast<uint32_t>(exponent + exponent_bias) << mantissa_bits | mantissa);
}

uint16_t reference_round_double(double value, const Format16& f) {
  const int mantissa_bits = f.precision - 1;
  const uint16_t sign = std::signbit(value) ? 0x8000 : 0;
  const uint16_t inf = static_cast<uint16_t>(((1u << (15 - mantissa_bits)) - 1) << mantissa_bits);
  if (std::isnan(value)) return static_cast<uint16_t>(sign | inf | (1u << (mantissa_bits - 1)));
  if (std::isinf(value)) return sign | inf;
  const double magnitude = std::fabs(value);
  if (magnitude == 0) return sign;
  int e2;
  const double fraction = std::frexp(magnitude, &e2);  // magnitude = fraction * 2^e2, fraction in [0.5, 1)
  const uint64_t significand = static_cast<uint64_t>(std::ldexp(fraction, 53));  // exact 53-bit integer
  // magnitude = significand * 2^(e2 - 53); the result's quantum is 2^q with q from the value's binade,
  // clamped at the subnormal step.
  const int q = std::max(e2 - 1 - mantissa_bits, f.min_exponent - mantissa_bits);
  const int shift = q - (e2 - 53);  // bits of the significand below the quantum (> 0 here)
  uint64_t kept = 0;
  if (shift < 64) {
    kept = significand >> shift;
    const uint64_t dropped = significand & ((uint64_t{1} << shift) - 1);
    const uint64_t half = uint64_t{1} << (shift - 1);
    if (dropped > half || (dropped == half && (kept & 1))) ++kept;
  }  // else: below a quarter of the smallest step, rounds to zero
  const double rounded = std::ldexp(static_cast<double>(kept), q);
  if (rounded >= std::ldexp(1.0, f.max_exponent + 1)) return sign | inf;
  return static_cast<uint16_t>(sign | encode16(rounded, f));
}

// Bit patterns of every finite non-negative value of a 16-bit format (0 up to the largest finite).
std::vector<uint16_t> finite_patterns(uint16_t inf_bits) {
  std::vector<uint16_t> patterns;
  for (uint32_t b = 0; b < inf_bits; ++b) patterns.push_back(static_cast<uint16_t>(b));
  return patterns;
}

// ======================================================================================================
// fp16 <-> float
// ======================================================================================================

TEST(Half, EveryPatternDecodesToItsFieldValue) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const uint16_t bits = static_cast<uint16_t>(b);
    const float value = half_bits_to_float_portable(bits);
    const double expected = decode_half(bits);
    if (std::isnan(expected)) {
      ASSERT_TRUE(std::isnan(value)) << std::hex << bits;
      continue;
    }
    ASSERT_EQ(static_cast<double>(value), expected) << std::hex << "half 0x" << bits;
    ASSERT_EQ(std::signbit(value), (bits & 0x8000) != 0) << std::hex << "half 0x" << bits;  // -0 stays -0
    ASSERT_EQ(static_cast<float>(Half::from_bits(bits)), value);
  }
}

TEST(Half, EveryNonNaNPatternRoundTripsBitExactly) {
  int checked = 0;
  for (uint32_t b = 0; b < 65536; ++b) {
    const uint16_t bits = static_cast<uint16_t>(b);
    if ((bits & 0x7c00) == 0x7c00 && (bits & 0x03ff) != 0) continue;  // NaNs: next test
    ASSERT_EQ(float_to_half_bits_portable(half_bits_to_float_portable(bits)), bits) << std::hex << "half 0x" << bits;
    ASSERT_EQ(Half(static_cast<float>(Half::from_bits(bits))).bits, bits);
    ++checked;
  }
  EXPECT_EQ(checked, 65536 - 2 * 1023);
}

TEST(Half, NaNsComeBackAsTheSameNaNMadeQuiet) {
  // A NaN's 10-bit payload: bit 9 is the quiet bit. Decoding moves the payload to the float's top mantissa
  // bits and sets the float quiet bit (0x400000); encoding takes the top 10 bits back. So a quiet NaN
  // round-trips exactly and a signalling one comes back with bit 9 set and its other payload bits kept.
  int signalling = 0;
  for (uint32_t b = 0; b < 65536; ++b) {
    const uint16_t bits = static_cast<uint16_t>(b);
    if ((bits & 0x7c00) != 0x7c00 || (bits & 0x03ff) == 0) continue;
    const float value = half_bits_to_float_portable(bits);
    const uint32_t fbits = float_bits(value);
    ASSERT_TRUE(std::isnan(value));
    const uint32_t expected_float = (static_cast<uint32_t>(bits & 0x8000) << 16) | 0x7f800000u |
                                    (static_cast<uint32_t>(bits & 0x03ff) << 13) | 0x400000u;
    ASSERT_EQ(fbits, expected_float) << std::hex << "half 0x" << bits;
    const uint16_t back = float_to_half_bits_portable(value);
    ASSERT_EQ(back, bits | 0x0200) << std::hex << "half 0x" << bits;
    if (!(bits & 0x0200)) ++signalling;
  }
  EXPECT_EQ(signalling, 2 * 511);  // payloads 1..511 without the quiet bit, both signs
}

TEST(Half, MatchesF16COnEveryTieAndItsNeighbours) {
  if (!have_f16c()) GTEST_SKIP() << "CPU lacks F16C";
  // For every pair of adjacent halves (including 65504 and the would-be 65536) the float midpoint is exact
  // (a half has 11 significant bits, the midpoint needs 12, a float has 24); one float ulp either side must
  // round away from the tie.
  std::vector<float> values;
  for (uint16_t bits : finite_patterns(0x7c00)) {
    const double low = decode_half(bits), high = decode_half(static_cast<uint16_t>(bits + 1), true);
    const float mid = static_cast<float>((low + high) / 2);
    ASSERT_EQ(static_cast<double>(mid), (low + high) / 2);
    for (float v : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)}) {
      values.push_back(v);
      values.push_back(-v);
    }
  }
  EXPECT_TRUE(matches_f16c(values));
  // The ties go to the even neighbour, visibly: 1 + 2^-11 is halfway between 1 and 1 + 2^-10.
  EXPECT_EQ(float_to_half_bits_portable(1.0f + 0x1p-11f), 0x3c00);
  EXPECT_EQ(float_to_half_bits_portable(1.0f + 3 * 0x1p-11f), 0x3c02);
  EXPECT_EQ(float_to_half_bits_portable(0x1p-25f), 0x0000);  // half of the smallest subnormal: to even (zero)
  EXPECT_EQ(float_to_half_bits_portable(3 * 0x1p-25f), 0x0002);
}

TEST(Half, MatchesF16COnEveryFloatInTheSubnormalRange) {
  if (!have_f16c()) GTEST_SKIP() << "CPU lacks F16C";
  // Every float with biased exponent 100..113, i.e. |x| in [2^-27, 2^-13): everything that rounds to a half
  // subnormal, to zero, or up into the smallest normal, with all 2^23 mantissas (positive and negative).
  std::vector<float> values(1u << 23);
  for (uint32_t exponent = 100; exponent <= 113; ++exponent) {
    for (uint32_t sign : {0u, 0x80000000u}) {
      for (uint32_t m = 0; m < (1u << 23); ++m) values[m] = bits_float(sign | exponent << 23 | m);
      ASSERT_TRUE(matches_f16c(values)) << "exponent " << exponent;
    }
  }
  // Float subnormals and the tiniest normals all round to a signed zero.
  values.clear();
  for (uint32_t b = 0; b < (100u << 23); b += 997) {
    values.push_back(bits_float(b));
    values.push_back(bits_float(b | 0x80000000u));
  }
  EXPECT_TRUE(matches_f16c(values));
}

TEST(Half, MatchesF16CAroundOverflow) {
  if (!have_f16c()) GTEST_SKIP() << "CPU lacks F16C";
  // Every float from 60000 to 70000 (65504 is the largest half, 65520 the tie that goes to Inf), plus the
  // largest floats.
  std::vector<float> values;
  for (uint32_t b = float_bits(60000.0f); b <= float_bits(70000.0f); ++b) {
    values.push_back(bits_float(b));
    values.push_back(-bits_float(b));
  }
  for (uint32_t b = float_bits(FLT_MAX) - 100000; b <= float_bits(FLT_MAX); ++b) values.push_back(bits_float(b));
  EXPECT_TRUE(matches_f16c(values));
  EXPECT_EQ(float_to_half_bits_portable(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_half_bits_portable(std::nextafter(65520.0f, 0.0f)), 0x7bff);
  EXPECT_EQ(float_to_half_bits_portable(65520.0f), 0x7c00);
  EXPECT_EQ(float_to_half_bits_portable(-65520.0f), 0xfc00);
  EXPECT_EQ(float_to_half_bits_portable(FLT_MAX), 0x7c00);
}

TEST(Half, MatchesF16COnSpecials) {
  if (!have_f16c()) GTEST_SKIP() << "CPU lacks F16C";
  std::vector<float> values = {0.0f, -0.0f, INFINITY, -INFINITY, FLT_MIN, -FLT_MIN, FLT_TRUE_MIN, 1.0f, -1.0f};
  // NaN payloads: every value of the 10 payload bits a half keeps, with several patterns in the 13 bits it
  // drops (including payloads that live only in the dropped bits: those must still give a NaN).
  for (uint32_t top = 0; top < 1024; ++top)
    for (uint32_t low : {0u, 1u, 0x1000u, 0x1fffu})
      for (uint32_t sign : {0u, 0x80000000u}) {
        const uint32_t mantissa = top << 13 | low;
        if (mantissa) values.push_back(bits_float(sign | 0x7f800000u | mantissa));
      }
  EXPECT_TRUE(matches_f16c(values));
  EXPECT_EQ(float_to_half_bits_portable(-0.0f), 0x8000);
  EXPECT_EQ(float_to_half_bits_portable(bits_float(0x7f800001u)), 0x7e00);  // signalling, payload below the kept bits
  EXPECT_EQ(float_to_half_bits_portable(bits_float(0xffc00000u)), 0xfe00);
}

TEST(Half, MatchesF16COnTenMillionRandomFloats) {
  if (!have_f16c()) GTEST_SKIP() << "CPU lacks F16C";
  std::mt19937 rng(20240601);
  std::vector<float> values(10'000'000);
  for (float& v : values) v = bits_float(static_cast<uint32_t>(rng()));
  EXPECT_TRUE(matches_f16c(values));
}

// ======================================================================================================
// bf16 <-> float
// ======================================================================================================

TEST(BFloat16, EveryPatternDecodesToItsFieldValueAndRoundTrips) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const uint16_t bits = static_cast<uint16_t>(b);
    const float value = bf16_bits_to_float(bits);
    const double expected = decode_bf16(bits);
    const bool nan = (bits & 0x7f80) == 0x7f80 && (bits & 0x007f) != 0;
    ASSERT_EQ(nan, std::isnan(expected));
    if (nan) {
      // Decoding makes it quiet (float bit 22 = bf16 bit 6) and keeps the rest; encoding gives it back.
      ASSERT_EQ(float_bits(value), (static_cast<uint32_t>(bits) << 16) | 0x400000u) << std::hex << bits;
      ASSERT_EQ(float_to_bf16_bits(value), bits | 0x0040) << std::hex << bits;
      continue;
    }
    ASSERT_EQ(static_cast<double>(value), expected) << std::hex << "bf16 0x" << bits;
    ASSERT_EQ(std::signbit(value), (bits & 0x8000) != 0);
    ASSERT_EQ(float_to_bf16_bits(value), bits) << std::hex << "bf16 0x" << bits;
    ASSERT_EQ(BFloat16(static_cast<float>(BFloat16::from_bits(bits))).bits, bits);
  }
}

TEST(BFloat16, MatchesReferenceOnTiesAndNeighboursOfEveryPattern) {
  // Each of the 65,536 upper halves with dropped bits at 0, just above 0, just below/at/above the tie, and
  // at the top: covers every tie (to even), near-tie, the carry into the exponent, and NaN inputs.
  std::vector<uint32_t> patterns;
  for (uint32_t upper = 0; upper < 65536; ++upper)
    for (uint32_t dropped : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xfffeu, 0xffffu})
      patterns.push_back(upper << 16 | dropped);
  EXPECT_TRUE(matches_bf16_reference(patterns));
  EXPECT_EQ(float_to_bf16_bits(bits_float(0x3f808000u)), 0x3f80);  // tie, even below
  EXPECT_EQ(float_to_bf16_bits(bits_float(0x3f818000u)), 0x3f82);  // tie, even above
}

TEST(BFloat16, MatchesReferenceOnEverySubnormalAndNearFltMax) {
  std::vector<uint32_t> patterns;
  for (uint32_t b = 0; b < (0x0081u << 16); ++b) {  // float subnormals and the first normals, both signs
    patterns.push_back(b);
    patterns.push_back(b | 0x80000000u);
  }
  for (uint32_t b = 0x7f7e0000u; b < 0x7f800000u; ++b) {  // the two binades' top below FLT_MAX
    patterns.push_back(b);
    patterns.push_back(b | 0x80000000u);
  }
  EXPECT_TRUE(matches_bf16_reference(patterns));
  // 0x7f7f is the largest finite bf16; the floats above its midpoint round to Inf.
  EXPECT_EQ(float_to_bf16_bits(bits_float(0x7f7f7fffu)), 0x7f7f);
  EXPECT_EQ(float_to_bf16_bits(bits_float(0x7f7f8000u)), 0x7f80);
  EXPECT_EQ(float_to_bf16_bits(FLT_MAX), 0x7f80);
  EXPECT_EQ(float_to_bf16_bits(-FLT_MAX), 0xff80);
  EXPECT_EQ(float_to_bf16_bits(INFINITY), 0x7f80);
}

TEST(BFloat16, NaNsStayQuietNaNs) {
  // Every float NaN shape: payload in the kept bits only, in the dropped bits only (a naive truncation would
  // turn 0x7f800001 into Inf), and the all-ones payload that a naive rounding would carry into the sign.
  std::vector<uint32_t> patterns;
  for (uint32_t upper = 0x7f80; upper <= 0x7fff; ++upper)
    for (uint32_t dropped : {0x0000u, 0x0001u, 0x8000u, 0xffffu})
      for (uint32_t sign : {0u, 0x80000000u}) {
        const uint32_t bits = sign | upper << 16 | dropped;
        if ((bits & 0x7fffffffu) > 0x7f800000u) patterns.push_back(bits);
      }
  for (uint32_t bits : patterns) {
    const uint16_t got = float_to_bf16_bits(bits_float(bits));
    ASSERT_EQ(got & 0x7f80, 0x7f80) << std::hex << bits;
    ASSERT_NE(got & 0x0040, 0) << std::hex << bits;  // quiet
    ASSERT_EQ(got & 0x8000, (bits >> 16) & 0x8000) << std::hex << bits;  // sign kept
    ASSERT_EQ(got & 0x003f, (bits >> 16) & 0x003f) << std::hex << bits;  // top payload kept
  }
  EXPECT_TRUE(matches_bf16_reference(patterns));
}

TEST(BFloat16, MatchesReferenceOnTenMillionRandomFloats) {
  std::mt19937 rng(7);
  std::vector<uint32_t> patterns(10'000'000);
  for (uint32_t& p : patterns) p = static_cast<uint32_t>(rng());
  EXPECT_TRUE(matches_bf16_reference(patterns));
}

// ======================================================================================================
// double -> fp16 / bf16 (correct rounding, no double rounding through float)
// ======================================================================================================

// Doubles at, and just off, every tie of the format: double -> float would round x +/- 1 double ulp back
// onto the tie, and the float -> 16-bit step would then round that tie to even, which is wrong for x + ulp
// when even is below (and for x - ulp when even is above).
std::vector<double> doubles_around_ties(uint16_t inf_bits, double (*decode)(uint16_t, bool)) {
  std::vector<double> values;
  for (uint16_t bits : finite_patterns(inf_bits)) {
    const double low = decode(bits, false), high = decode(static_cast<uint16_t>(bits + 1), true);
    const double mid = (low + high) / 2;
    for (double v : {mid, std::nextafter(mid, 0.0), std::nextafter(mid, INFINITY), mid * (1 + 0x1p-40),
                     mid * (1 - 0x1p-40), mid * (1 + 0x1p-25), mid * (1 - 0x1p-25), low, high}) {
      values.push_back(v);
      values.push_back(-v);
    }
  }
  return values;
}

TEST(Half, FromDoubleIsCorrectlyRoundedEvenWhereFloatWouldDoubleRound) {
  const std::vector<double> values = doubles_around_ties(0x7c00, decode_half);
  int bad = 0, naive_wrong = 0;
  for (double v : values) {
    const uint16_t want = reference_round_double(v, kHalfFormat);
    if (Half(v).bits != want && bad++ < 5)
      ADD_FAILURE() << std::hexfloat << "double " << v << ": got 0x" << std::hex << Half(v).bits << ", want 0x" << want;
    if (float_to_half_bits_portable(static_cast<float>(v)) != want) ++naive_wrong;
    ASSERT_EQ(convert<Half>(v).bits, Half(v).bits);
  }
  EXPECT_EQ(bad, 0);
  // The inputs do exercise double rounding: going through a round-to-nearest float is wrong on many of them.
  EXPECT_GT(naive_wrong, 10000);
}

TEST(BFloat16, FromDoubleIsCorrectlyRoundedEvenWhereFloatWouldDoubleRound) {
  const std::vector<double> values = doubles_around_ties(0x7f80, decode_bf16);
  int bad = 0, naive_wrong = 0;
  for (double v : values) {
    const uint16_t want = reference_round_double(v, kBF16Format);
    if (BFloat16(v).bits != want && bad++ < 5)
      ADD_FAILURE() << std::hexfloat << "double " << v << ": got 0x" << std::hex << BFloat16(v).bits << ", want 0x"
                    << want;
    if (float_to_bf16_bits(static_cast<float>(v)) != want) ++naive_wrong;
    ASSERT_EQ(convert<BFloat16>(v).bits, BFloat16(v).bits);
  }
  EXPECT_EQ(bad, 0);
  EXPECT_GT(naive_wrong, 10000);
}

TEST(Half, FromDoubleMatchesReferenceOnRandomDoublesAndSpecials) {
  std::mt19937_64 rng(99);
  int bad_half = 0, bad_bf16 = 0;
  for (int i = 0; i < 1'000'000; ++i) {
    // Random sign and 52-bit mantissa, exponent spread over each format's range and a little beyond.
    const uint64_t r = rng();
    const double unit = std::bit_cast<double>((r & 0x800fffffffffffffULL) | 0x3ff0000000000000ULL);
    const double h = std::ldexp(unit, static_cast<int>(r >> 53 & 63) - 30);  // 2^-30 .. 2^33
    const double b = std::ldexp(unit, static_cast<int>(r >> 52 & 511) - 255);  // 2^-255 .. 2^256
    bad_half += Half(h).bits != reference_round_double(h, kHalfFormat);
    bad_bf16 += BFloat16(b).bits != reference_round_double(b, kBF16Format);
  }
  EXPECT_EQ(bad_half, 0);
  EXPECT_EQ(bad_bf16, 0);
  for (double v : {0.0, -0.0, 1e-300, -1e-300, 1e300, -1e300, 65504.0, 65519.99, 65520.0, 3.4e38, 3.3961e38,
                   static_cast<double>(FLT_MAX), static_cast<double>(INFINITY), -static_cast<double>(INFINITY)}) {
    EXPECT_EQ(Half(v).bits, reference_round_double(v, kHalfFormat)) << v;
    EXPECT_EQ(BFloat16(v).bits, reference_round_double(v, kBF16Format)) << v;
  }
  EXPECT_EQ(Half(-1e-300).bits, 0x8000);  // the sign of an underflow survives
  EXPECT_EQ(BFloat16(1e300).bits, 0x7f80);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  EXPECT_TRUE(std::isnan(static_cast<float>(Half(nan))));
  EXPECT_TRUE(std::isnan(static_cast<float>(BFloat16(nan))));
  EXPECT_TRUE(std::isnan(static_cast<float>(BFloat16(-nan))));
}

// ======================================================================================================
// DType helpers
// ======================================================================================================

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::F32), 4u);
  EXPECT_EQ(dtype_size(DType::F16), 2u);
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  EXPECT_EQ(dtype_size(DType::F64), 8u);
  EXPECT_EQ(dtype_size(DType::I32), 4u);
  EXPECT_EQ(dtype_size(DType::I64), 8u);
  EXPECT_STREQ(dtype_name(DType::F32), "f32");
  EXPECT_STREQ(dtype_name(DType::F16), "f16");
  EXPECT_STREQ(dtype_name(DType::BF16), "bf16");
  EXPECT_STREQ(dtype_name(DType::F64), "f64");
  EXPECT_STREQ(dtype_name(DType::I32), "i32");
  EXPECT_STREQ(dtype_name(DType::I64), "i64");
  std::ostringstream out;
  out << DType::BF16 << ' ' << Half(1.5f) << ' ' << BFloat16(-2.0f);
  EXPECT_EQ(out.str(), "bf16 1.5 -2");
  EXPECT_ERROR_MENTIONS(dtype_size(static_cast<DType>(99)), "dtype_size", "99");
  EXPECT_STREQ(dtype_name(static_cast<DType>(99)), "invalid");
}

TEST(DType, Classification) {
  for (DType d : {DType::F32, DType::F16, DType::BF16, DType::F64}) EXPECT_TRUE(is_floating(d)) << d;
  for (DType d : {DType::I32, DType::I64}) EXPECT_FALSE(is_floating(d)) << d;
  EXPECT_TRUE(is_low_precision(DType::F16));
  EXPECT_TRUE(is_low_precision(DType::BF16));
  EXPECT_FALSE(is_low_precision(DType::F32));
  EXPECT_FALSE(is_low_precision(DType::F64));
}

TEST(DType, PromoteGivesTheWiderFloatingTypeSymmetrically) {
  const DType all[] = {DType::F32, DType::F16, DType::BF16, DType::F64};
  for (DType a : all)
    for (DType b : all) {
      const DType p = promote(a, b);
      EXPECT_EQ(p, promote(b, a)) << a << "," << b;
      if (a == b) EXPECT_EQ(p, a);
      else if (a == DType::F64 || b == DType::F64) EXPECT_EQ(p, DType::F64);
      else EXPECT_EQ(p, DType::F32) << a << "," << b;  // incl. f16 with bf16: neither holds the other
    }
  EXPECT_EQ(promote(DType::I64, DType::I64), DType::I64);
  EXPECT_ERROR_MENTIONS(promote(DType::I32, DType::F32), "promote", "i32", "f32");
  EXPECT_ERROR_MENTIONS(promote(DType::F16, DType::I64), "promote", "f16", "i64");
  EXPECT_ERROR_MENTIONS(promote(DType::I32, DType::I64), "promote", "i32", "i64", "to()");
}

TEST(DType, ConvertBetweenIntegersAndFloats) {
  // Float -> integer truncates toward zero (static_cast semantics, as in PyTorch's .to(int)).
  EXPECT_EQ(convert<int32_t>(2.75f), 2);
  EXPECT_EQ(convert<int32_t>(-2.75f), -2);
  EXPECT_EQ(convert<int64_t>(Half(3.5f)), 3);
  EXPECT_EQ(convert<int64_t>(BFloat16(-7.5f)), -7);
  EXPECT_EQ(convert<int64_t>(1e15), 1000000000000000);
  // Integer -> float: exact when representable, else round to nearest even.
  EXPECT_EQ(convert<float>(int64_t{16777217}), 16777216.0f);  // 2^24 + 1: tie, to even
  EXPECT_EQ(convert<float>(int64_t{16777219}), 16777220.0f);
  EXPECT_EQ(convert<double>(int32_t{-123456789}), -123456789.0);
  EXPECT_EQ(convert<Half>(int64_t{2049}).bits, Half(2048.0f).bits);  // tie, to even
  EXPECT_EQ(convert<Half>(int64_t{2051}).bits, Half(2052.0f).bits);
  EXPECT_EQ(convert<Half>(int32_t{65519}).bits, 0x7bff);
  EXPECT_EQ(convert<Half>(int32_t{65520}).bits, 0x7c00);  // overflow -> Inf
  EXPECT_EQ(convert<Half>(int64_t{-70000}).bits, 0xfc00);
  EXPECT_EQ(convert<BFloat16>(int32_t{257}).bits, BFloat16(256.0f).bits);
  EXPECT_EQ(convert<BFloat16>(int32_t{259}).bits, BFloat16(260.0f).bits);
  // Beyond 2^53 an int64 is not exact in double; a round-to-nearest double would put 2^60 + 2^52 + 1 on
  // the bf16 tie 2^60 + 2^52 (-> even = 2^60), but it lies above the tie and must round up.
  const int64_t above_tie = (int64_t{1} << 60) + (int64_t{1} << 52) + 1;
  EXPECT_EQ(static_cast<double>(convert<BFloat16>(above_tie)), 0x1p60 + 0x1p53);
  EXPECT_EQ(static_cast<double>(convert<BFloat16>(-above_tie)), -(0x1p60 + 0x1p53));
  const int64_t below_tie = (int64_t{1} << 60) + (int64_t{1} << 52) - 1;
  EXPECT_EQ(static_cast<double>(convert<BFloat16>(below_tie)), 0x1p60);
  EXPECT_EQ(static_cast<double>(convert<BFloat16>(std::numeric_limits<int64_t>::max())), 0x1p63);
  EXPECT_EQ(static_cast<double>(convert<BFloat16>(std::numeric_limits<int64_t>::min())), -0x1p63);
  // 16-bit <-> 16-bit goes through float exactly.
  EXPECT_EQ(convert<BFloat16>(Half(1.0f + 0x1p-10f)).bits, BFloat16(1.0f).bits);  // below bf16 resolution
  EXPECT_EQ(convert<Half>(BFloat16(3.0f)).bits, Half(3.0f).bits);
  EXPECT_EQ(convert<float>(Half::from_bits(0x0001)), 0x1p-24f);
}

}  // namespace
}  // namespace mixtape

namespace mixtape {

// The library's kernels convert with float_to_half_bits / half_bits_to_float, which are F16C instructions when
// the library is built for a CPU that has them: they must agree bit for bit with the portable reference
// checked above, on all 65,536 halves and on floats around every rounding boundary.
TEST(Half, LibraryConversionsAgreeWithThePortableReferenceOnEveryValue) {
  std::vector<float> halves_as_float(65536), floats;
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    halves_as_float[bits] = half_bits_to_float_portable(static_cast<uint16_t>(bits));
    const float f = halves_as_float[bits];
    if (std::isnan(f)) continue;
    floats.push_back(f);
    floats.push_back(std::nextafter(f, INFINITY));
    floats.push_back(std::nextafter(f, -INFINITY));
  }
  std::mt19937 rng(42);
  for (int i = 0; i < 100000; ++i) floats.push_back(std::bit_cast<float>(static_cast<uint32_t>(rng())));
  // float -> half in the library (Tensor::to runs the CPU backend's copy kernel), then back portably.
  const Tensor h = Tensor::from_vector(floats, {static_cast<int64_t>(floats.size())}).to(DType::F16);
  const uint16_t* hb = static_cast<const uint16_t*>(h.contiguous().data_ptr());
  size_t bad = 0;
  for (size_t i = 0; i < floats.size(); ++i)
    if (hb[i] != float_to_half_bits_portable(floats[i]) && bad++ < 5)
      ADD_FAILURE() << std::hexfloat << floats[i] << ": library 0x" << std::hex << hb[i];
  // half -> float in the library, on every bit pattern.
  Tensor all = Tensor::empty({65536}, DType::F16, Device::cpu());
  uint16_t* ab = static_cast<uint16_t*>(all.data_ptr());
  for (uint32_t bits = 0; bits < 65536; ++bits) ab[bits] = static_cast<uint16_t>(bits);
  const std::vector<float> back = all.to(DType::F32).to_vector<float>();
  for (uint32_t bits = 0; bits < 65536; ++bits)
    if (std::bit_cast<uint32_t>(back[bits]) != std::bit_cast<uint32_t>(halves_as_float[bits]) && bad++ < 10)
      ADD_FAILURE() << "half 0x" << std::hex << bits << ": library " << std::hexfloat << back[bits];
  // The widening loop's 16-, 8- and 1-wide parts: a run starting 3 elements in, of odd length.
  const std::vector<float> part = all.slice(0, 3, 65530).to(DType::F32).to_vector<float>();
  for (size_t i = 0; i < part.size(); ++i)
    if (std::bit_cast<uint32_t>(part[i]) != std::bit_cast<uint32_t>(halves_as_float[i + 3]) && bad++ < 10)
      ADD_FAILURE() << "half 0x" << std::hex << i + 3 << " (in a slice): library " << std::hexfloat << part[i];
  EXPECT_EQ(bad, 0u);
}

// The same for bf16: the copy kernel's vectorised conversions (tensor/cpu/convert_block.h: 16 at a time with
// AVX-512, then rounding 8 at a time with AVX2, the rest one by one) against the integer reference, on every
// tie and its neighbours, the float subnormals, NaNs (signalling ones among them) and random floats, and the
// widening (a shift, NaNs made quiet) on every bf16 pattern. Each conversion runs whole, in slices of 24 (16 + 8
// values) from offsets 0, 8 and 16, and in slices of 7, so that every value passes through each width of loop.
TEST(BFloat16, LibraryConversionsAgreeWithTheReferenceOnEveryValue) {
  std::vector<float> floats;
  std::vector<uint16_t> want;
  auto add = [&](uint32_t bits) {
    floats.push_back(std::bit_cast<float>(bits));
    want.push_back(reference_bf16(bits));
  };
  for (uint32_t upper = 0; upper < 65536; ++upper)
    for (uint32_t dropped : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) add(upper << 16 | dropped);
  for (uint32_t b = 0; b < 0x00800000u; b += 0x101u) add(b);
  std::mt19937 rng(43);
  for (int i = 0; i < 100000; ++i) add(static_cast<uint32_t>(rng()));
  const int64_t total = static_cast<int64_t>(floats.size());
  const Tensor all = Tensor::from_vector(floats, {total});
  // Converts all[start, end) for every slice of `width` (the last one shorter) after `offset`, and the values
  // before `offset` in slices of 8 (the offsets are multiples of 8: each value meets the 8-wide loop once).
  auto slices = [](int64_t size, int64_t offset, int64_t width, auto&& body) {
    for (int64_t start = 0; start < offset; start += 8) body(start, std::min(offset, start + 8));
    for (int64_t start = offset; start < size; start += width) body(start, std::min(size, start + width));
  };
  size_t bad = 0;
  for (auto [offset, width] : {std::pair<int64_t, int64_t>{0, total}, {0, 24}, {8, 24}, {16, 24}, {0, 7}}) {
    slices(total, offset, width, [&](int64_t start, int64_t end) {
      const Tensor b = all.slice(0, start, end).to(DType::BF16).contiguous();
      const uint16_t* bb = static_cast<const uint16_t*>(b.data_ptr());
      for (int64_t i = start; i < end; ++i) {
        const size_t at = static_cast<size_t>(i);
        if (bb[i - start] != want[at] && bad++ < 5)
          ADD_FAILURE() << "float 0x" << std::hex << std::bit_cast<uint32_t>(floats[at]) << ": library 0x"
                        << bb[i - start] << ", reference 0x" << want[at] << " (slices of " << std::dec << width
                        << ")";
      }
    });
  }
  Tensor every = Tensor::empty({65536}, DType::BF16, Device::cpu());
  uint16_t* eb = static_cast<uint16_t*>(every.data_ptr());
  for (uint32_t bits = 0; bits < 65536; ++bits) eb[bits] = static_cast<uint16_t>(bits);
  for (auto [offset, width] : {std::pair<int64_t, int64_t>{0, 65536}, {0, 24}, {8, 24}, {16, 24}, {0, 7}}) {
    slices(65536, offset, width, [&](int64_t start, int64_t end) {
      const std::vector<float> back = every.slice(0, start, end).to(DType::F32).to_vector<float>();
      for (int64_t i = start; i < end; ++i) {
        uint32_t expected = static_cast<uint32_t>(i) << 16;
        if ((expected & 0x7fffffffu) > 0x7f800000u) expected |= 0x400000u;  // a NaN, made quiet
        const uint32_t got = std::bit_cast<uint32_t>(back[static_cast<size_t>(i - start)]);
        if (got != expected && bad++ < 10)
          ADD_FAILURE() << "bf16 0x" << std::hex << i << ": library 0x" << got << ", want 0x" << expected
                        << " (slices of " << std::dec << width << ")";
      }
    });
  }
  EXPECT_EQ(bad, 0u);
}

}  // namespace mixtape
