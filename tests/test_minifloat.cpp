// The fp8 / fp4 / E8M0 formats against their specifications. References: each format's published values
// (OCP FP8 v1.0, OCP MX v1.0), a decoder written from the field layout in double, and an encoder that picks the
// nearest of all the format's values by enumeration (ties to the even code), never the code under test.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "tensor/minifloat.h"
#include "tensor/ops.h"
#include "tensor/quantize.h"
#include "tensor/tensor.h"
#include "test_util.h"

namespace mixtape {
namespace {

struct FormatSpec {
  const char* name;
  const MinifloatFormat* format;
  int exponent_bits, mantissa_bits, bias;
  double max;      // largest finite value
  double step_at_max;  // the grid step of the top binade: the next value would be max + step_at_max
};

const FormatSpec kE4M3Spec{"E4M3", &kE4M3, 4, 3, 7, 448.0, 32.0};
const FormatSpec kE5M2Spec{"E5M2", &kE5M2, 5, 2, 15, 57344.0, 8192.0};
const FormatSpec kE2M1Spec{"E2M1", &kE2M1, 2, 1, 1, 6.0, 2.0};

bool is_nan_code(const FormatSpec& s, uint32_t code) {
  const uint32_t magnitude = code & ((1u << (s.exponent_bits + s.mantissa_bits)) - 1);
  const uint32_t top = (1u << s.exponent_bits) - 1;
  if (s.format == &kE4M3) return magnitude == 0x7F;
  if (s.format == &kE5M2) return (magnitude >> 2) == top && (magnitude & 3) != 0;
  return false;
}
bool is_inf_code(const FormatSpec& s, uint32_t code) { return s.format == &kE5M2 && (code & 0x7F) == 0x7C; }

// The value of a code from its fields, in double.
double reference_decode(const FormatSpec& s, uint32_t code) {
  if (is_nan_code(s, code)) return std::numeric_limits<double>::quiet_NaN();
  const int width = s.exponent_bits + s.mantissa_bits;
  const double sign = (code >> width) & 1 ? -1.0 : 1.0;
  if (is_inf_code(s, code)) return sign * std::numeric_limits<double>::infinity();
  const uint32_t exponent = (code >> s.mantissa_bits) & ((1u << s.exponent_bits) - 1);
  const uint32_t mantissa = code & ((1u << s.mantissa_bits) - 1);
  if (exponent == 0) return sign * std::ldexp(mantissa, 1 - s.bias - s.mantissa_bits);
  return sign * std::ldexp((1u << s.mantissa_bits) + mantissa, static_cast<int>(exponent) - s.bias - s.mantissa_bits);
}

// Every non-negative finite value with its code, ascending, plus the value one step past the largest (as code
// max + 1), which a value must round to (to nearest, ties to the even code) to overflow.
std::vector<std::pair<double, uint32_t>> grid(const FormatSpec& s) {
  std::vector<std::pair<double, uint32_t>> out;
  const uint32_t magnitudes = 1u << (s.exponent_bits + s.mantissa_bits);
  for (uint32_t code = 0; code < magnitudes; ++code) {
    const double v = reference_decode(s, code);
    if (std::isfinite(v)) out.push_back({v, code});
  }
  std::sort(out.begin(), out.end());
  out.push_back({s.max + s.step_at_max, out.back().second + 1});
  return out;
}

enum class Expect { Cast, Saturate };

// The code the spec gives for v: nearest grid value, ties to the even code; overflow per the mode.
uint32_t reference_encode(const FormatSpec& s, const std::vector<std::pair<double, uint32_t>>& g, float value,
                          Expect mode) {
  const uint32_t sign = std::signbit(value) ? 1u << (s.exponent_bits + s.mantissa_bits) : 0u;
  const uint32_t max_code = g[g.size() - 2].second;
  const bool e2m1 = s.format == &kE2M1;
  const uint32_t overflow = (mode == Expect::Saturate || e2m1) ? max_code : s.format == &kE4M3 ? 0x7F : 0x7C;
  if (std::isnan(value)) return e2m1 ? sign : sign | (s.format == &kE4M3 ? 0x7F : 0x7F);
  const double a = std::fabs(static_cast<double>(value));
  if (std::isinf(a) || a >= g.back().first) return sign | overflow;
  const auto above = std::lower_bound(g.begin(), g.end(), std::make_pair(a, 0u));
  if (above->first == a) return sign | (above->second > max_code ? overflow : above->second);
  const auto below = above - 1;
  const double down = a - below->first, up = above->first - a;
  const uint32_t chosen = down < up ? below->second : up < down ? above->second
                          : (below->second % 2 == 0 ? below->second : above->second);
  return sign | (chosen > max_code ? overflow : chosen);
}

::testing::AssertionResult encodes_like_reference(const FormatSpec& s, const std::vector<float>& values) {
  const auto g = grid(s);
  size_t bad = 0;
  std::ostringstream report;
  for (float v : values)
    for (Expect mode : {Expect::Cast, Expect::Saturate}) {
      const uint32_t want = reference_encode(s, g, v, mode);
      const uint32_t got = float_to_minifloat(
          v, *s.format, mode == Expect::Cast ? FormatOverflow::Cast : FormatOverflow::Saturate);
      if (got != want && bad++ < 5)
        report << s.name << (mode == Expect::Cast ? " cast " : " saturate ") << std::hexfloat << v << ": got 0x"
               << std::hex << got << ", expected 0x" << want << std::dec << std::defaultfloat << "\n";
    }
  if (bad) return ::testing::AssertionFailure() << bad << " mismatches\n" << report.str();
  return ::testing::AssertionSuccess();
}

const FormatSpec* const kSpecs[] = {&kE4M3Spec, &kE5M2Spec, &kE2M1Spec};

TEST(Minifloat, EveryCodeDecodesToItsFieldValue) {
  for (const FormatSpec* s : kSpecs) {
    for (uint32_t code = 0; code < (1u << (1 + s->exponent_bits + s->mantissa_bits)); ++code) {
      const double want = reference_decode(*s, code);
      const float got = minifloat_to_float(code, *s->format);
      if (std::isnan(want)) EXPECT_TRUE(std::isnan(got)) << s->name << " code " << code;
      else EXPECT_EQ(static_cast<double>(got), want) << s->name << " code " << code;
    }
  }
}

TEST(Minifloat, PublishedValuesOfEachFormat) {
  // OCP FP8 v1.0, table 1: E4M3 max 448 (S.1111.110), min normal 2^-6, min subnormal 2^-9, NaN S.1111.111.
  EXPECT_EQ(minifloat_to_float(0x7E, kE4M3), 448.0f);
  EXPECT_EQ(minifloat_to_float(0x08, kE4M3), 0x1p-6f);
  EXPECT_EQ(minifloat_to_float(0x01, kE4M3), 0x1p-9f);
  EXPECT_EQ(minifloat_to_float(0xFE, kE4M3), -448.0f);
  EXPECT_TRUE(std::isnan(minifloat_to_float(0x7F, kE4M3)) && std::isnan(minifloat_to_float(0xFF, kE4M3)));
  EXPECT_EQ(minifloat_to_float(0x78, kE4M3), 256.0f);  // S.1111.000 is a number in E4M3, not Inf
  // E5M2: max 57344 (S.11110.11), min normal 2^-14, min subnormal 2^-16, Inf S.11111.00, NaN S.11111.{01,10,11}.
  EXPECT_EQ(minifloat_to_float(0x7B, kE5M2), 57344.0f);
  EXPECT_EQ(minifloat_to_float(0x04, kE5M2), 0x1p-14f);
  EXPECT_EQ(minifloat_to_float(0x01, kE5M2), 0x1p-16f);
  EXPECT_EQ(minifloat_to_float(0x7C, kE5M2), std::numeric_limits<float>::infinity());
  EXPECT_EQ(minifloat_to_float(0xFC, kE5M2), -std::numeric_limits<float>::infinity());
  for (uint32_t nan : {0x7Du, 0x7Eu, 0x7Fu}) EXPECT_TRUE(std::isnan(minifloat_to_float(nan, kE5M2)));
  // OCP MX v1.0, table: E2M1 values 0, 0.5, 1, 1.5, 2, 3, 4, 6 for codes 0..7, negated with the sign bit.
  const float e2m1[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (uint32_t code = 0; code < 8; ++code) {
    EXPECT_EQ(minifloat_to_float(code, kE2M1), e2m1[code]);
    EXPECT_EQ(minifloat_to_float(code | 8, kE2M1), -e2m1[code]);
  }
  EXPECT_EQ(format_max(DType::F8E4M3), 448.0f);
  EXPECT_EQ(format_max(DType::F8E5M2), 57344.0f);
  EXPECT_EQ(format_max(DType::F4E2M1), 6.0f);
}

// Every f16 and every bf16 bit pattern, as a float, encodes by the reference in both overflow modes.
TEST(Minifloat, EveryF16AndBf16PatternEncodesToTheNearestEvenCode) {
  std::vector<float> values;
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    values.push_back(half_bits_to_float(static_cast<uint16_t>(bits)));
    values.push_back(bf16_bits_to_float(static_cast<uint16_t>(bits)));
  }
  for (const FormatSpec* s : kSpecs) EXPECT_TRUE(encodes_like_reference(*s, values));
}

// f32: a stride through all 2^32 patterns, plus every grid value and every midpoint between neighbours
// (the ties) with the 64 floats on either side of each.
TEST(Minifloat, F32SweepAndEveryTieWithItsNeighboursEncodeToTheNearestEvenCode) {
  for (const FormatSpec* s : kSpecs) {
    std::vector<float> values;
    for (uint64_t bits = 0; bits < (uint64_t{1} << 32); bits += 4099) values.push_back(std::bit_cast<float>(uint32_t(bits)));
    const auto g = grid(*s);
    for (size_t i = 0; i < g.size(); ++i) {
      std::vector<double> centres = {g[i].first};
      if (i + 1 < g.size()) centres.push_back((g[i].first + g[i + 1].first) / 2);
      for (double c : centres) {
        const uint32_t bits = std::bit_cast<uint32_t>(static_cast<float>(c));
        for (int d = -64; d <= 64; ++d) {
          const uint32_t b = bits + static_cast<uint32_t>(d);
          if ((b & 0x7f800000u) != 0x7f800000u) {
            values.push_back(std::bit_cast<float>(b));
            values.push_back(-std::bit_cast<float>(b));
          }
        }
      }
    }
    EXPECT_TRUE(encodes_like_reference(*s, values)) << s->name;
  }
}

TEST(Minifloat, SpecialsFollowPyTorchForCastsAndSaturateForScaledQuantization) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(float_to_minifloat(inf, kE4M3, FormatOverflow::Cast), 0x7Fu);   // no Inf: NaN
  EXPECT_EQ(float_to_minifloat(-inf, kE4M3, FormatOverflow::Cast), 0xFFu);
  EXPECT_EQ(float_to_minifloat(inf, kE5M2, FormatOverflow::Cast), 0x7Cu);   // Inf
  EXPECT_EQ(float_to_minifloat(464.0f, kE4M3, FormatOverflow::Cast), 0x7Eu);  // the tie goes to 448 (even)
  EXPECT_EQ(float_to_minifloat(464.01f, kE4M3, FormatOverflow::Cast), 0x7Fu);
  EXPECT_EQ(float_to_minifloat(61440.0f, kE5M2, FormatOverflow::Cast), 0x7Cu);  // the tie goes to Inf (even)
  EXPECT_EQ(float_to_minifloat(1e6f, kE4M3, FormatOverflow::Saturate), 0x7Eu);
  EXPECT_EQ(float_to_minifloat(-inf, kE5M2, FormatOverflow::Saturate), 0xFBu);
  EXPECT_EQ(float_to_minifloat(nan, kE4M3, FormatOverflow::Saturate), 0x7Fu);
  EXPECT_EQ(float_to_minifloat(nan, kE5M2, FormatOverflow::Saturate), 0x7Fu);
  EXPECT_EQ(float_to_minifloat(100.0f, kE2M1, FormatOverflow::Cast), 0x7u);  // E2M1 saturates either way
  EXPECT_EQ(float_to_minifloat(-0.0f, kE4M3, FormatOverflow::Cast), 0x80u);  // the sign of zero is kept
  EXPECT_EQ(float_to_minifloat(0x1p-10f, kE4M3, FormatOverflow::Cast), 0x00u);  // half the min subnormal: even
  EXPECT_EQ(float_to_minifloat(0x1.8p-10f, kE4M3, FormatOverflow::Cast), 0x01u);
}

// E8M0: 2^(e - 127), no sign, no zero; PyTorch's cast: round by the mantissa, ties (1.5 * 2^k) upward.
TEST(Minifloat, E8M0DecodesEveryCodeAndCastsEveryBf16PatternAsPyTorch) {
  for (int code = 0; code < 255; ++code)
    EXPECT_EQ(static_cast<double>(e8m0_to_float(static_cast<uint8_t>(code))), std::ldexp(1.0, code - 127)) << code;
  EXPECT_TRUE(std::isnan(e8m0_to_float(0xFF)));
  auto reference = [](float v) -> uint8_t {
    const double a = std::fabs(static_cast<double>(v));
    if (std::isnan(a) || std::isinf(a)) return 0xFF;
    // Below 2^-126 (fp32 subnormals) PyTorch's bit rule gives 2^-126 above 2^-127 and 2^-127 at or below it.
    if (a < std::ldexp(1.0, -126)) return a > std::ldexp(1.0, -127) ? 1 : 0;
    const int k = static_cast<int>(std::floor(std::log2(a)));
    const double lower = std::ldexp(1.0, k);
    const int code = (a >= lower * 1.5 ? k + 1 : k) + 127;  // tie 1.5 * 2^k rounds up (normal range)
    return code >= 255 ? 0xFF : static_cast<uint8_t>(code);
  };
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const float v = bf16_bits_to_float(static_cast<uint16_t>(bits));
    ASSERT_EQ(float_to_e8m0(v), reference(v)) << std::hexfloat << v;
  }
  EXPECT_EQ(float_to_e8m0(1.0f), 127);
  EXPECT_EQ(float_to_e8m0(1.5f), 128);
  EXPECT_EQ(float_to_e8m0(1.4999999f), 127);
  EXPECT_EQ(float_to_e8m0(-4.0f), 129);  // the sign is dropped
  EXPECT_EQ(float_to_e8m0(0.0f), 0);     // no zero: the smallest, 2^-127
}

TEST(Minifloat, StochasticRoundingIsUnbiasedAndStaysOnTheNeighbours) {
  // 1.1 lies between E4M3's 1.0 and 1.125 at 80% of the step: it rounds up with probability 0.8.
  const float v = 1.1f;
  const double want = (1.1 - 1.0) / 0.125;
  int up = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    const uint32_t r = philox4x32(static_cast<uint64_t>(i), 0, 7)[0];
    const uint32_t code = float_to_minifloat(v, kE4M3, FormatOverflow::Saturate, &r);
    ASSERT_TRUE(code == 0x38u || code == 0x39u) << code;  // 1.0 or 1.125
    up += code == 0x39u;
  }
  // Binomial: 5 standard deviations of n * p * (1 - p).
  EXPECT_NEAR(up, want * n, 5 * std::sqrt(n * want * (1 - want)));
  // A value on the grid never moves.
  for (uint32_t r : {0u, 0x80000000u, 0xFFFFFFFFu}) EXPECT_EQ(float_to_minifloat(1.125f, kE4M3, FormatOverflow::Saturate, &r), 0x39u);
}

TEST(MinifloatTensor, ToAndFromEachFormatRoundTripsEveryCode) {
  for (DType format : {DType::F8E4M3, DType::F8E5M2}) {
    std::vector<float> values;
    for (uint32_t code = 0; code < 256; ++code) {
      const float v = minifloat_to_float(code, format == DType::F8E4M3 ? kE4M3 : kE5M2);
      if (!std::isnan(v)) values.push_back(v);
    }
    const Tensor x = Tensor::from_vector(values, {static_cast<int64_t>(values.size())});
    const Tensor q = x.to(format);
    EXPECT_EQ(q.dtype(), format);
    EXPECT_EQ(q.to(DType::F32).to_vector<float>(), values);
    EXPECT_EQ(q.to(DType::BF16).to(DType::F32).to_vector<float>(), values);  // every fp8 value is a bf16
  }
  // E2M1: two codes per byte, element 0 in the low nibble.
  const Tensor x = Tensor::from_vector(std::vector<float>{1.0f, 6.0f, -0.5f}, {3});
  const Tensor q = x.to(DType::F4E2M1);
  EXPECT_EQ(q.storage()->nbytes(), 2u);
  const uint8_t* bytes = static_cast<const uint8_t*>(q.data_ptr());
  EXPECT_EQ(bytes[0], 0x72);  // 6.0 (code 7) high, 1.0 (code 2) low
  EXPECT_EQ(bytes[1] & 0xF, 0x9);  // -0.5: sign 8 | code 1
  EXPECT_EQ(q.to(DType::F32).to_vector<float>(), (std::vector<float>{1.0f, 6.0f, -0.5f}));
  EXPECT_EQ(Tensor::from_vector(std::vector<float>{3.0f, 0.75f}, {2}).to(DType::F8E8M0).to(DType::F32).to_vector<float>(),
            (std::vector<float>{4.0f, 1.0f}));  // 3 = 1.5 * 2 rounds up; 0.75 = 1.5 * 0.5 rounds up
}

TEST(MinifloatTensor, CastsOverflowAsPyTorchDoes) {
  const Tensor x = Tensor::from_vector(std::vector<float>{500.0f, -1e6f, 70000.0f}, {3});
  const std::vector<float> e4m3 = x.to(DType::F8E4M3).to(DType::F32).to_vector<float>();
  EXPECT_TRUE(std::isnan(e4m3[0]) && std::isnan(e4m3[1]) && std::isnan(e4m3[2]));
  const std::vector<float> e5m2 = x.to(DType::F8E5M2).to(DType::F32).to_vector<float>();
  EXPECT_EQ(e5m2[0], 512.0f);
  EXPECT_EQ(e5m2[1], -std::numeric_limits<float>::infinity());
  EXPECT_EQ(e5m2[2], std::numeric_limits<float>::infinity());
  EXPECT_EQ(x.to(DType::F4E2M1).to(DType::F32).to_vector<float>(), (std::vector<float>{6.0f, -6.0f, 6.0f}));
  // f64 rounds once: 1 + 2^-4 + 2^-40 lies just above E4M3's tie between 1.0 and 1.125 (f32 would make it the tie).
  const Tensor d = Tensor::from_vector(std::vector<double>{1.0625 + std::ldexp(1.0, -40)}, {1});
  EXPECT_EQ(d.to(DType::F8E4M3).to(DType::F32).to_vector<float>()[0], 1.125f);
}

TEST(MinifloatTensor, RefusesWhatTheFormatsCannotDo) {
  const Tensor x = Tensor::from_vector(std::vector<float>{1, 2, 3, 4}, {2, 2});
  EXPECT_ERROR_MENTIONS(Tensor::from_vector(std::vector<float>{NAN}, {1}).to(DType::F4E2M1), "f4e2m1", "NaN");
  EXPECT_ERROR_MENTIONS(Tensor::from_vector(std::vector<int64_t>{1}, {1}).to(DType::F8E4M3), "f8e4m3", "i64");
  EXPECT_ERROR_MENTIONS(add(x.to(DType::F8E4M3), x.to(DType::F8E4M3)), "f8e4m3");  // no arithmetic in fp8
  EXPECT_ERROR_MENTIONS(x.to(DType::F4E2M1).mT(), "f4e2m1", "two elements per byte");
  EXPECT_EQ(x.to(DType::F4E2M1).reshape({4}).to(DType::F32).to_vector<float>(), (std::vector<float>{1, 2, 3, 4}));
  // A strided fp8 view converts element by element.
  EXPECT_EQ(x.to(DType::F8E4M3).mT().to(DType::F32).to_vector<float>(), (std::vector<float>{1, 3, 2, 4}));
  EXPECT_ERROR_MENTIONS(dtype_size(DType::F4E2M1), "dtype_size", "f4e2m1");
  EXPECT_EQ(storage_bytes(DType::F4E2M1, 5), 3);
  EXPECT_EQ(dtype_size(DType::F8E8M0), 1u);
}

}  // namespace
}  // namespace mixtape
