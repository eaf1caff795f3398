#pragma once
// The rules quantize_for_gemm (tensor/quantize.h) applies to every block and every value, written once for the
// CPU and the GPU (MIXTAPE_HOST_DEVICE): how a block's scale follows from its amax (BlockScale), and how one
// value is scaled, rounded on the format's grid and saturated. Both backends call these very functions, so a
// CUDA quantization gives the CPU's scales, values and counts bit for bit.
//
// Every operation here is a single IEEE multiplication, division or bit manipulation (no sums a compiler could
// contract into a fused multiply-add), so the host and the device round identically.
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "tensor/dtype.h"
#include "tensor/minifloat.h"

namespace mixtape {

enum class BlockScale : uint8_t {
  Fp32,          // fp32 encode scale format_max / amax (1 where amax is 0), decode scale its fp32 reciprocal:
                 // TE / torchao tensorwise and rowwise, DeepSeek-V3's tiles and blocks
  E8M0Floor,     // OCP MX v1.0: 2^(floor(log2 amax) - emax), emax the format's largest exponent (8 for E4M3)
  E8M0Ceil,      // NVIDIA's MXFP8 recipe: 2^ceil(log2(amax / format_max)) (nothing saturates)
  E4M3TwoLevel,  // NVFP4: an fp32 tensor scale 6*448 / amax_tensor, E4M3 block decode scales under it
};

// A quiet NaN, usable in constant and device code.
MIXTAPE_HOST_DEVICE constexpr float quiet_nan() { return std::bit_cast<float>(0x7fc00000u); }

// What picks a block's scale: the kind, the element format's largest value and its exponent, and the Fp32
// options (QuantizeOptions::fixed_scale, power_of_two_scales).
struct ScaleRule {
  BlockScale kind = BlockScale::Fp32;
  float format_max = kE4M3Max;
  int format_emax = 8;
  bool has_fixed_scale = false;
  float fixed_scale = 1;
  bool power_of_two_scales = false;
};

// One block's encode multiplier and the decode scale stored for it (its code for the 8-bit scale formats).
struct BlockScaling {
  float encode;
  float decode;
  uint8_t decode_code;  // E8M0 / E4M3 scales
};

// The scale of a block with max |x| = amax (finite), by the rule of `rule.kind` (see BlockScale); the tensor's
// encode / decode scales matter to E4M3TwoLevel only. Never throws: it runs inside parallel loops.
MIXTAPE_HOST_DEVICE constexpr BlockScaling choose_block_scale(const ScaleRule& rule, float amax, float tensor_encode,
                                                              float tensor_decode) {
  const float fmax = rule.format_max;
  switch (rule.kind) {
    case BlockScale::Fp32: {
      float encode = rule.has_fixed_scale ? rule.fixed_scale : amax == 0 ? 1.0f : fmax / amax;
      encode = FLT_MAX < encode ? FLT_MAX : encode;  // amax below fmax / FLT_MAX would give Inf
      if (rule.power_of_two_scales) encode = exp2_int(floor_log2(encode));
      return {encode, 1.0f / encode, 0};
    }
    case BlockScale::E8M0Floor:
    case BlockScale::E8M0Ceil: {
      int exponent = -127;
      if (amax > 0) {
        if (rule.kind == BlockScale::E8M0Floor) {
          exponent = floor_log2(amax) - rule.format_emax;
        } else {  // ceil(log2(amax / fmax)), the ratio taken as NVIDIA does: amax * fp32(1 / fmax)
          const float ratio = amax * (1.0f / fmax);
          exponent = floor_log2(ratio);
          if (exponent < -127) exponent = -127;  // below E8M0's range (clamped there anyway)
          else if (exp2_int(exponent) < ratio) ++exponent;
        }
      }
      exponent = exponent < -127 ? -127 : exponent > 127 ? 127 : exponent;
      return {exp2_int(-exponent), exp2_int(exponent), static_cast<uint8_t>(exponent + 127)};
    }
    case BlockScale::E4M3TwoLevel: {
      // NVIDIA's NVFP4 recipe: the block's decode scale amax / 6, in units of the tensor's decode scale, stored
      // as E4M3 (saturating); the elements are encoded with the reciprocal of what that stores.
      const uint8_t code = static_cast<uint8_t>(
          float_to_minifloat(amax / kE2M1Max * tensor_encode, kE4M3, FormatOverflow::Saturate));
      const float stored = minifloat_to_float(code, kE4M3);
      // Capped at FLT_MAX: with a tiny tensor amax the tensor's decode scale is subnormal, and the reciprocal
      // of a small product would be Inf (0 * Inf is NaN).
      const float reciprocal = stored == 0 ? 0.0f : 1.0f / (stored * tensor_decode);
      return {FLT_MAX < reciprocal ? FLT_MAX : reciprocal, stored, code};
    }
  }
  return {0.0f, quiet_nan(), kE8M0Nan};  // no other kind exists (quantize's validation refused it)
}

// |scaled| rounded to nearest even on the format's grid, unclamped (may exceed the largest finite value, Inf
// stays Inf): what float_to_minifloat computes, in float arithmetic that vectorises. Below the smallest normal
// the grid step is 2^(emin - M): a multiplication by a power of two and a round to nearest even integer do
// it exactly. Above, rounding the float's bits at mantissa bit M does it (a carry moves to the next binade).
struct FormatRounding {
  float min_normal, to_steps, step;  // 2^emin, 2^(M - emin), 2^(emin - M)
  uint32_t drop_half, drop_mask;     // 2^(22 - M) - 1 and ~(2^(23 - M) - 1)
  int drop;                          // 23 - M
  MIXTAPE_HOST_DEVICE constexpr explicit FormatRounding(const MinifloatFormat& f)
      : min_normal(exp2_int(f.min_normal_exponent())),
        to_steps(exp2_int(f.mantissa_bits - f.min_normal_exponent())),
        step(exp2_int(f.min_normal_exponent() - f.mantissa_bits)),
        drop_half((1u << (22 - f.mantissa_bits)) - 1),
        drop_mask(~((1u << (23 - f.mantissa_bits)) - 1)),
        drop(23 - f.mantissa_bits) {}
  MIXTAPE_HOST_DEVICE float operator()(float magnitude) const {
#if defined(__CUDA_ARCH__)
    const float small = rintf(magnitude * to_steps) * step;  // rint: to nearest even, as nearbyint by default
#else
    const float small = std::nearbyint(magnitude * to_steps) * step;
#endif
    uint32_t bits = std::bit_cast<uint32_t>(magnitude);
    bits = (bits + drop_half + ((bits >> drop) & 1u)) & drop_mask;
    return magnitude < min_normal ? small : std::bit_cast<float>(bits);
  }
};

// One value quantized for a GEMM: the code's value (±largest finite where it saturated) and what happened.
struct EncodedValue {
  float value;
  bool saturated;  // rounded beyond the format's largest finite value (counted only in blocks with a scale)
  bool flushed;    // a nonzero finite input that became zero
};

MIXTAPE_HOST_DEVICE inline float magnitude_of(float x) { return std::bit_cast<float>(std::bit_cast<uint32_t>(x) & 0x7fffffffu); }
MIXTAPE_HOST_DEVICE inline float with_sign_of(float magnitude, float sign) {
  return std::bit_cast<float>((std::bit_cast<uint32_t>(magnitude) & 0x7fffffffu) |
                              (std::bit_cast<uint32_t>(sign) & 0x80000000u));
}

// v times the block's encode scale e, rounded to nearest even and saturated. Branch-free so that it vectorises.
// A scale of 0 (an NVFP4 block whose E4M3 scale is 0, or a block holding Inf or NaN) encodes +0, as quantize()
// does.
MIXTAPE_HOST_DEVICE inline EncodedValue encode_nearest(float v, float e, const FormatRounding& round, float fmax) {
  const float scaled = e == 0 ? 0.0f : v * e;
  const float rounded = round(magnitude_of(scaled));
  const float clamped = fmax < rounded ? fmax : rounded;  // std::min(rounded, fmax): NaN stays NaN
  const float value = with_sign_of(clamped, scaled);
  return {value, rounded > fmax, static_cast<bool>((v != 0) & (magnitude_of(v) <= FLT_MAX) & (value == 0))};
}

// The same with stochastic rounding (NVFP4's gradients), `random` the element's 32 Philox bits.
MIXTAPE_HOST_DEVICE inline EncodedValue encode_stochastic(float v, float e, const MinifloatFormat& f,
                                                          const FormatRounding& round, float fmax, uint32_t random) {
  const float scaled = e == 0 ? 0.0f : v * e;
  const float value = minifloat_to_float(float_to_minifloat(scaled, f, FormatOverflow::Saturate, &random), f);
  // Saturation counted as nearest rounding counts it (quantize()'s rule).
  return {value, round(magnitude_of(scaled)) > fmax, v != 0 && magnitude_of(v) <= FLT_MAX && value == 0};
}

// ---- the plan one quantization's values follow ---------------------------------------------------------------

// How quantize_for_gemm encodes a contiguous f32 x [R, C] over a grid of blocks [block_rows, block_cols]
// (row-major, grid_cols blocks per grid row): every value of block b is encoded with encode[b], and the code
// value times multiplier[b] is stored (1 where the GEMM applies the scale after, the decode scale where it is
// folded in, NaN for a block holding Inf or NaN, whose decode[b] is NaN). Values are stored as bf16 (exact by
// construction: the top 16 bits of the f32 product), as f32, or (CUDA, tensorwise) as the fp8 codes themselves.
struct BlockEncodePlan {
  DType format = DType::F8E4M3;
  int64_t block_rows = 1, block_cols = 1, grid_cols = 1;
  std::vector<float> encode, multiplier, decode;
  std::optional<uint64_t> stochastic_seed;  // element i draws Philox(seed, (stochastic_offset + i, stochastic_stream))
  uint64_t stochastic_offset = 0, stochastic_stream = 0;
};

struct EncodeCounts {
  int64_t saturated = 0, flushed = 0;  // as in Quantized: saturated in blocks with a scale, flushed in non-NaN blocks
};

}  // namespace mixtape
