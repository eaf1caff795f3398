#pragma once
// The 8- and 4-bit floating formats of fp8 training and the block-scaled (MX, NVFP4) formats, bit by bit.
//
//   format  bits       bias  largest finite   smallest subnormal  specials
//   E4M3    s.eeee.mmm    7  448 = 1.75*2^8    2^-9               S.1111.111 is NaN; no infinity ("e4m3fn")
//   E5M2    s.eeeee.mm   15  57344 = 1.75*2^15 2^-16              IEEE-like: exponent 11111 is Inf / NaN
//   E2M1    s.ee.m        1  6 = 1.5*2^2       0.5                none: ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}
//   E8M0    eeeeeeee    127  2^127             —                  no sign, no zero: 2^(e-127); 0xFF is NaN
//
// E4M3 and E5M2 are the OCP 8-bit floating point formats (OCP FP8 v1.0), which are also NVIDIA's and
// PyTorch's float8_e4m3fn / float8_e5m2. E2M1 and E8M0 are the OCP Microscaling (MX v1.0) element and scale
// formats; E2M1 is NVFP4's element too. An E2M1 value takes a nibble: two of them share a byte, the first (even
// index) in the low nibble, as PyTorch's float4_e2m1fn_x2 and cuBLASLt's CUDA_R_4F_E2M1 pack them.
//
// Encoding a float rounds to nearest, ties to even, on the format's grid (subnormals included). A magnitude
// beyond the largest finite value goes one of two ways (FormatOverflow):
//   - Cast: what an unscaled cast does in PyTorch: a value that rounds above the largest finite value becomes
//     NaN in E4M3 (it has no Inf) and Inf in E5M2; Inf becomes NaN / Inf likewise. E2M1, which has neither,
//     saturates to ±6.
//   - Saturate: what scaled quantization does (Transformer Engine, cuBLASLt's satfinite conversions): ±largest
//     finite, Inf included. NaN stays NaN (E2M1 has no NaN: callers carry it in the block scale instead).
// Decoding is exact: every code of these formats is a float. All of it is integer arithmetic, so it does not
// depend on the FPU's rounding mode or flush-to-zero flags.
#include <array>
#include <bit>
#include <cstdint>

#include "tensor/random.h"  // MIXTAPE_HOST_DEVICE

namespace mixtape {

// A sign-exponent-mantissa format with a bias; IEEE-like formats reserve the top exponent for Inf/NaN.
struct MinifloatFormat {
  int exponent_bits;
  int mantissa_bits;
  int bias;
  enum class Specials : uint8_t {
    Ieee,        // top exponent: mantissa 0 is Inf, other mantissas NaN (E5M2)
    AllOnesNan,  // only the all-ones magnitude is NaN, the rest of the top exponent is finite (E4M3)
    None,        // every code is finite (E2M1)
  } specials;

  constexpr int bits() const { return 1 + exponent_bits + mantissa_bits; }
  constexpr uint32_t sign_bit() const { return 1u << (exponent_bits + mantissa_bits); }
  constexpr uint32_t magnitude_mask() const { return sign_bit() - 1; }
  // The magnitude code of the largest finite value.
  constexpr uint32_t max_finite_code() const {
    switch (specials) {
      case Specials::Ieee: return ((((1u << exponent_bits) - 1) << mantissa_bits)) - 1;
      case Specials::AllOnesNan: return magnitude_mask() - 1;
      case Specials::None: return magnitude_mask();
    }
    return 0;
  }
  constexpr uint32_t inf_code() const { return ((1u << exponent_bits) - 1) << mantissa_bits; }  // Ieee only
  // The magnitude code a NaN encodes to, the all-ones one as in PyTorch (E5M2 0x7F, E4M3 0x7F); E2M1 has none.
  constexpr uint32_t nan_code() const { return magnitude_mask(); }
  constexpr int min_normal_exponent() const { return 1 - bias; }
};

inline constexpr MinifloatFormat kE4M3{4, 3, 7, MinifloatFormat::Specials::AllOnesNan};
inline constexpr MinifloatFormat kE5M2{5, 2, 15, MinifloatFormat::Specials::Ieee};
inline constexpr MinifloatFormat kE2M1{2, 1, 1, MinifloatFormat::Specials::None};

inline constexpr float kE4M3Max = 448.0f, kE5M2Max = 57344.0f, kE2M1Max = 6.0f;

enum class FormatOverflow : uint8_t { Cast, Saturate };

// The value of a code (sign bit included). Exact.
MIXTAPE_HOST_DEVICE constexpr float minifloat_to_float(uint32_t code, const MinifloatFormat& f) {
  const bool negative = (code & f.sign_bit()) != 0;
  const uint32_t magnitude = code & f.magnitude_mask();
  const uint32_t exponent = magnitude >> f.mantissa_bits, mantissa = magnitude & ((1u << f.mantissa_bits) - 1);
  const uint32_t top = (1u << f.exponent_bits) - 1;
  float value = 0;
  if (f.specials == MinifloatFormat::Specials::Ieee && exponent == top) {
    value = mantissa == 0 ? std::bit_cast<float>(0x7f800000u) : std::bit_cast<float>(0x7fc00000u);
  } else if (f.specials == MinifloatFormat::Specials::AllOnesNan && magnitude == f.magnitude_mask()) {
    value = std::bit_cast<float>(0x7fc00000u);
  } else {
    // exponent 0: mantissa * 2^(1 - bias - M); otherwise (2^M + mantissa) * 2^(exponent - bias - M).
    const uint32_t significand = exponent == 0 ? mantissa : (1u << f.mantissa_bits) | mantissa;
    const int power = (exponent == 0 ? 1 : static_cast<int>(exponent)) - f.bias - f.mantissa_bits;
    // significand < 2^4 and |power| < 30 here: build 2^power from its bits (normal in fp32) and multiply.
    value = static_cast<float>(significand) * std::bit_cast<float>(static_cast<uint32_t>(power + 127) << 23);
  }
  return negative ? -value : value;
}

// The magnitude code a finite float's magnitude rounds to on the format's grid extended past its largest
// value (so it may exceed max_finite_code()): to nearest even, or stochastically when `random` is given (the
// magnitude rounds up with probability (distance to the grid value below) / (grid step), drawn from 32 random
// bits, so the expected value is the input's to 2^-32 of a step).
MIXTAPE_HOST_DEVICE constexpr uint64_t round_to_minifloat_grid(uint32_t magnitude_bits, const MinifloatFormat& f,
                                                               const uint32_t* random = nullptr) {
  // magnitude = m * 2^(e - 23), m with its implicit bit (float subnormals: e = -126, no implicit bit).
  const int biased = static_cast<int>(magnitude_bits >> 23);
  const int e = biased == 0 ? -126 : biased - 127;
  const uint32_t m = (magnitude_bits & 0x7fffffu) | (biased == 0 ? 0u : 0x800000u);
  // Units of the format's grid step at this magnitude, 2^(e_grid - M) with e_grid = max(e, emin):
  // n = m * 2^(e - 23 - e_grid + M) = m >> shift, rounded.
  const int e_grid = e > f.min_normal_exponent() ? e : f.min_normal_exponent();
  const int shift = 23 + e_grid - f.mantissa_bits - e;  // >= 23 - M > 0
  uint64_t n = shift >= 32 ? 0 : m >> shift;
  const uint64_t remainder = shift >= 32 ? m : m & ((uint64_t{1} << shift) - 1);
  if (random != nullptr) {
    // Round up with probability remainder / 2^shift: compare against remainder scaled to 32 bits.
    const uint64_t threshold = shift >= 56 ? 0 : (remainder << 32) >> shift;
    if (*random < threshold) ++n;
  } else if (shift < 32) {
    const uint64_t half = uint64_t{1} << (shift - 1);
    if (remainder > half || (remainder == half && (n & 1))) ++n;
  }
  // The code: ((e_grid - emin) << M) + n covers subnormals (n < 2^M at e_grid = emin), normals (n in
  // [2^M, 2^(M+1))) and the carry of rounding into the next binade (n = 2^(M+1)).
  return (static_cast<uint64_t>(e_grid - f.min_normal_exponent()) << f.mantissa_bits) + n;
}

// Encodes `value` (see the file comment for overflow and specials); `random` as in round_to_minifloat_grid.
MIXTAPE_HOST_DEVICE constexpr uint32_t float_to_minifloat(float value, const MinifloatFormat& f, FormatOverflow overflow,
                                                          const uint32_t* random = nullptr) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint32_t sign = (bits >> 31) ? f.sign_bit() : 0u;
  const uint32_t magnitude_bits = bits & 0x7fffffffu;
  const bool saturate = overflow == FormatOverflow::Saturate || f.specials == MinifloatFormat::Specials::None;
  const uint32_t beyond_max =
      sign | (saturate ? f.max_finite_code()
                       : f.specials == MinifloatFormat::Specials::Ieee ? f.inf_code() : f.nan_code());
  if (magnitude_bits > 0x7f800000u) return f.specials == MinifloatFormat::Specials::None ? sign : sign | f.nan_code();
  if (magnitude_bits == 0x7f800000u) return beyond_max;
  const uint64_t code = round_to_minifloat_grid(magnitude_bits, f, random);
  return code > f.max_finite_code() ? beyond_max : sign | static_cast<uint32_t>(code);
}

// ---- E8M0, the MX scale: 2^(code - 127), code 0..254; 0xFF is NaN ------------------------------------------
inline constexpr uint8_t kE8M0Nan = 0xFF;

MIXTAPE_HOST_DEVICE constexpr float e8m0_to_float(uint8_t code) {
  if (code == kE8M0Nan) return std::bit_cast<float>(0x7fc00000u);
  if (code == 0) return std::bit_cast<float>(0x00400000u);  // 2^-127, an fp32 subnormal
  return std::bit_cast<float>(static_cast<uint32_t>(code) << 23);
}

// A float cast to E8M0, as PyTorch's float8_e8m0fnu cast does it: the sign is dropped (E8M0 has none), the
// magnitude rounds to the nearest power of two by its mantissa (ties to even: 1.5 * 2^k rounds up to
// 2^(k+1)), Inf, NaN and what rounds above 2^127 give NaN. E8M0 has no zero: 0 gives 2^-127, and below 2^-126
// (fp32 subnormals) PyTorch's bit rule gives 2^-126 for values above 2^-127 and 2^-127 for the rest.
MIXTAPE_HOST_DEVICE constexpr uint8_t float_to_e8m0(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value) & 0x7fffffffu;
  const uint32_t exponent = bits >> 23, mantissa = bits & 0x7fffffu;
  if (exponent == 0xFF) return kE8M0Nan;
  // The grid value below is 2^(exponent - 127) (normal) or 2^-127 (subnormal, code 0); the mantissa's top
  // bit is the half-way bit, its other bits break the tie; the "even" neighbour is the one whose implied
  // mantissa bit is 0, which for a normal number is the one above.
  const bool half = (mantissa & 0x400000u) != 0, beyond_half = (mantissa & 0x3fffffu) != 0;
  const bool below_is_odd = exponent > 0;
  uint32_t code = exponent;
  if (half && (beyond_half || below_is_odd)) ++code;
  return code >= 0xFF ? kE8M0Nan : static_cast<uint8_t>(code);
}

// 2^e for e in [-149, 127], built from its bits (std::ldexp costs a call per block scale).
MIXTAPE_HOST_DEVICE constexpr float exp2_int(int e) {
  return e >= -126 ? std::bit_cast<float>(static_cast<uint32_t>(e + 127) << 23)
                   : std::bit_cast<float>(uint32_t{1} << (e + 149));
}

// floor(log2 |magnitude|) of a finite float (-150 for zero): the exponent of the OCP MX scale rule.
MIXTAPE_HOST_DEVICE constexpr int floor_log2(float magnitude) {
  const uint32_t bits = std::bit_cast<uint32_t>(magnitude) & 0x7fffffffu;
  const int exponent = static_cast<int>(bits >> 23);
  if (exponent != 0) return exponent - 127;
  const uint32_t mantissa = bits & 0x7fffffu;  // subnormal: the top set bit's position
  return mantissa == 0 ? -150 : -149 + (31 - std::countl_zero(mantissa));
}

// ---- E2M1 packing --------------------------------------------------------------------------------------
// Element i of a packed array lives in byte i / 2, in the low nibble when i is even.
MIXTAPE_HOST_DEVICE constexpr uint8_t e2m1_code_at(const uint8_t* packed, int64_t i) {
  return static_cast<uint8_t>((packed[i >> 1] >> ((i & 1) * 4)) & 0xF);
}
MIXTAPE_HOST_DEVICE constexpr void set_e2m1_code(uint8_t* packed, int64_t i, uint8_t code) {
  const int shift = static_cast<int>(i & 1) * 4;
  packed[i >> 1] = static_cast<uint8_t>((packed[i >> 1] & ~(0xF << shift)) | ((code & 0xF) << shift));
}

}  // namespace mixtape
