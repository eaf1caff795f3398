#pragma once
// fp16 (IEEE binary16) and bf16 (bfloat16) scalar types.
//
// float -> half/bf16 rounds to nearest, ties to even; overflow rounds to Inf; subnormals are kept; NaN stays
// NaN and is made quiet (the same result as the F16C instruction vcvtps2ph). half/bf16 -> float is exact
// (NaNs come back quiet). All conversions are integer-only, so they do not depend on the FPU's rounding mode
// or on flush-to-zero flags.
//
// Where the compiler targets F16C (the library is built with -march=native), float_to_half_bits and
// half_bits_to_float are the vcvtps2ph / vcvtph2ps instructions, which give bit-identical results (the test
// suite checks the portable functions against F16C on every value): the software path costs ~10x more, and
// fp16 elementwise kernels spent a third of an fp16 training step in it.
#include <bit>
#include <cstdint>
#include <iosfwd>
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace mixtape {

// ---- fp16 ----------------------------------------------------------------------------------------
inline uint16_t float_to_half_bits_portable(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude >= 0x7f800000u) {  // Inf or NaN: keep the top payload bits, set the quiet bit for NaN
    const uint32_t nan = magnitude > 0x7f800000u ? 0x0200u | ((magnitude >> 13) & 0x03ffu) : 0u;
    return static_cast<uint16_t>(sign | 0x7c00u | nan);
  }
  if (magnitude >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to Inf
  if (magnitude >= 0x38800000u) {  // normal half (>= 2^-14): rebias the exponent, round 13 dropped bits
    const uint32_t odd = (magnitude >> 13) & 1u;
    const uint32_t rounded = magnitude - (112u << 23) + 0x0fffu + odd;  // ties go to the even mantissa
    return static_cast<uint16_t>(sign | (rounded >> 13));
  }
  // Subnormal half: value = m * 2^(e-150); in units of the half subnormal step 2^-24 that is m >> (126-e).
  const uint32_t exponent = magnitude >> 23;
  if (exponent < 102) return static_cast<uint16_t>(sign);  // < 2^-25 (incl. float subnormals): rounds to 0
  const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126 - exponent;  // 14..24
  uint32_t quotient = mantissa >> shift;
  const uint32_t remainder = mantissa & ((1u << shift) - 1);
  const uint32_t halfway = 1u << (shift - 1);
  if (remainder > halfway || (remainder == halfway && (quotient & 1u))) ++quotient;  // may carry to 2^-14
  return static_cast<uint16_t>(sign | quotient);
}

inline float half_bits_to_float_portable(uint16_t half) {
  const uint32_t sign = static_cast<uint32_t>(half & 0x8000u) << 16;
  const uint32_t exponent = (half >> 10) & 0x1fu;
  const uint32_t mantissa = half & 0x03ffu;
  if (exponent == 0x1fu)  // Inf, or NaN made quiet
    return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13) | (mantissa ? 0x400000u : 0u));
  if (exponent != 0) return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
  if (mantissa == 0) return std::bit_cast<float>(sign);
  // Subnormal: normalise so the leading 1 reaches bit 10 (value = mantissa * 2^-24).
  const int leading = std::countl_zero(mantissa) - 21;  // shifts needed to bring the top bit to bit 10
  const uint32_t normalized = (mantissa << leading) & 0x03ffu;
  return std::bit_cast<float>(sign | (static_cast<uint32_t>(113 - leading) << 23) | (normalized << 13));
}

#if defined(__F16C__)
inline uint16_t float_to_half_bits(float value) {
  return static_cast<uint16_t>(_cvtss_sh(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline float half_bits_to_float(uint16_t half) { return _cvtsh_ss(half); }
#else
inline uint16_t float_to_half_bits(float value) { return float_to_half_bits_portable(value); }
inline float half_bits_to_float(uint16_t half) { return half_bits_to_float_portable(half); }
#endif

// ---- bf16 ----------------------------------------------------------------------------------------
inline uint16_t float_to_bf16_bits(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);  // quiet NaN
  // Round the 16 dropped bits to nearest even; a carry out of the mantissa bumps the exponent, and out of
  // the largest finite value gives Inf, exactly as round-to-nearest-even requires.
  const uint32_t odd = (bits >> 16) & 1u;
  return static_cast<uint16_t>((bits + 0x7fffu + odd) >> 16);
}

// ---- tf32 (NVIDIA TensorFloat-32: fp32's 8-bit exponent, 10 of its 23 mantissa bits) -------------------
// float -> the nearest tf32 value, ties to even, kept in a float (the low 13 mantissa bits zero): what a TF32
// tensor-core matmul does to its inputs. Like bf16, a carry may bump the exponent, and the largest finite
// floats round to Inf; subnormals round at the same bit; NaN stays NaN (quiet), Inf stays Inf.
inline float round_to_tf32(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return std::bit_cast<float>(bits | 0x400000u);  // quiet NaN
  const uint32_t odd = (bits >> 13) & 1u;
  return std::bit_cast<float>((bits + 0x0fffu + odd) & ~0x1fffu);
}

inline float bf16_bits_to_float(uint16_t bf16) {
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  if ((bits & 0x7fffffffu) > 0x7f800000u) bits |= 0x400000u;  // NaN made quiet
  return std::bit_cast<float>(bits);
}

// ---- double -> 16-bit --------------------------------------------------------------------------------
// Rounding double -> float -> half with two round-to-nearest steps can be wrong on a tie created by the
// first step. Rounding the first step to odd instead makes the second step exact (float keeps 13+ more
// bits than half or bf16), so these give the correctly rounded 16-bit value of a double.
inline float double_to_float_round_to_odd(double value) {
  float rounded = static_cast<float>(value);
  if (static_cast<double>(rounded) != value && value == value) {
    uint32_t bits = std::bit_cast<uint32_t>(rounded);
    if ((bits & 1u) == 0) {  // even: step to the odd neighbour that lies on value's side
      const bool overshot = (rounded < 0 ? -static_cast<double>(rounded) : static_cast<double>(rounded)) >
                            (value < 0 ? -value : value);
      bits = overshot ? bits - 1 : bits + 1;
      rounded = std::bit_cast<float>(bits);
    }
  }
  return rounded;
}

// An integer as a double rounded to odd: exact up to 2^53; above, the bits a double cannot hold are folded
// into a sticky last bit, so rounding it on to float/half/bf16 afterwards is still correct (a round-to-nearest
// double would land 2^60 + 2^52 + 1 on the bf16 tie 2^60 + 2^52 and round it down).
inline double integer_to_double_round_to_odd(int64_t value) {
  uint64_t magnitude = value < 0 ? 0 - static_cast<uint64_t>(value) : static_cast<uint64_t>(value);
  const int dropped = 64 - std::countl_zero(magnitude) - 53;  // significant bits beyond a double's 53
  if (dropped > 0) {
    const uint64_t low = magnitude & ((uint64_t{1} << dropped) - 1);
    magnitude = (magnitude >> dropped) << dropped;
    if (low) magnitude |= uint64_t{1} << dropped;  // sticky: 53 bits, odd, exact in double
  }
  const double exact = static_cast<double>(magnitude);
  return value < 0 ? -exact : exact;
}

// ---- scalar types ----------------------------------------------------------------------------------
// Storage types only: arithmetic converts to float, computes, and rounds once on store.
struct Half {
  uint16_t bits = 0;
  Half() = default;
  explicit Half(float value) : bits(float_to_half_bits(value)) {}
  explicit Half(double value) : Half(double_to_float_round_to_odd(value)) {}
  static Half from_bits(uint16_t raw) { Half h; h.bits = raw; return h; }
  operator float() const { return half_bits_to_float(bits); }
};

struct BFloat16 {
  uint16_t bits = 0;
  BFloat16() = default;
  explicit BFloat16(float value) : bits(float_to_bf16_bits(value)) {}
  explicit BFloat16(double value) : BFloat16(double_to_float_round_to_odd(value)) {}
  static BFloat16 from_bits(uint16_t raw) { BFloat16 b; b.bits = raw; return b; }
  operator float() const { return bf16_bits_to_float(bits); }
};

static_assert(sizeof(Half) == 2 && sizeof(BFloat16) == 2);

std::ostream& operator<<(std::ostream& out, Half value);
std::ostream& operator<<(std::ostream& out, BFloat16 value);

}  // namespace mixtape
