#pragma once
// Contiguous runs of 16-bit values widened to float and rounded back in one vectorised pass (fp16 by F16C's
// vcvtph2ps / vcvtps2ph, bf16 by a shift and an integer rounding): 16 at a time with AVX-512, then 8 at a time
// (fp16 both ways with F16C, bf16 rounding with AVX2), the rest one by one. Same results as convert<> element
// by element (round to nearest even; a NaN made quiet), just without a scalar conversion per element.
#include <cstdint>
#include <type_traits>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "tensor/dtype.h"

namespace mixtape::cpu {

// The 16-bit storage types whose runs these functions widen to float and narrow back; kernels that compute
// them in float use it to pick their block-converting loops.
template <class T>
constexpr bool kSixteenBit = std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>;

#if defined(__AVX512F__)
// 16 consecutive values as a register of floats, exactly: floats as they are, fp16 through vcvtph2ps, bf16 by
// a shift (a float is a bf16 with 16 zero bits below it). The masked forms with all-ones masks: GCC 12's
// plain _mm512_cvtph_ps and _mm512_slli_epi32 warn of an uninitialised value.
inline __m512 load16_as_float(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16_as_float(const Half* p) {
  return _mm512_mask_cvtph_ps(_mm512_setzero_ps(), 0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16_as_float(const BFloat16* p) {
  const __m512i bits = _mm512_maskz_cvtepu16_epi32(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, bits, 16));
}

// The inverse: a register of floats rounded into 16 consecutive values, each as convert<T> rounds it (nearest
// even; bf16 by float_to_bf16_bits' integer rounding, NaN made quiet; not vcvtneps2bf16, which flushes
// subnormals). Masked forms with all-ones masks again, for the same warnings.
inline void store16_from_float(Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_maskz_cvtps_ph(0xFFFF, v, _MM_FROUND_TO_NEAREST_INT |
                                                                                         _MM_FROUND_NO_EXC));
}
inline void store16_from_float(BFloat16* p, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v), high = _mm512_maskz_srli_epi32(0xFFFF, bits, 16);
  const __m512i odd = _mm512_and_si512(high, _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_maskz_srli_epi32(0xFFFF, _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), odd), 16);
  const __m512i quiet = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
  const __m512i out = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), quiet);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_maskz_cvtepi32_epi16(0xFFFF, out));
}
#endif

// 8 floats rounded into 8 consecutive values, as store16_from_float does 16 (fp16 needs F16C, bf16 AVX2 too).
#if defined(__F16C__)
inline void store8_from_float(Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif
#if defined(__AVX2__) && defined(__F16C__)
inline void store8_from_float(BFloat16* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v), high = _mm256_srli_epi32(bits, 16);
  const __m256i odd = _mm256_and_si256(high, _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), odd), 16);
  const __m256i quiet = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
  const __m256i out = _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  // Each 128-bit half packs its 4 values into its low 64 bits; the permute brings the two halves together.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(out, out), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
#endif

template <class T>
inline void widen_block(const T* src, float* dst, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, Half>)  // vcvtph2ps quiets a signalling NaN, as convert<float> does
    for (; j + 16 <= n; j += 16) _mm512_storeu_ps(dst + j, load16_as_float(src + j));
  if constexpr (std::is_same_v<T, BFloat16>) {  // the shift keeps a signalling NaN; convert<float> quiets it
    for (; j + 16 <= n; j += 16) {
      const __m512 v = load16_as_float(src + j);
      const __m512i quiet = _mm512_mask_or_epi32(_mm512_castps_si512(v), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                                 _mm512_castps_si512(v), _mm512_set1_epi32(0x400000));
      _mm512_storeu_ps(dst + j, _mm512_castsi512_ps(quiet));
    }
  }
#endif
#if defined(__F16C__)
  if constexpr (std::is_same_v<T, Half>)
    for (; j + 8 <= n; j += 8)
      _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j))));
#endif
  for (; j < n; ++j) dst[j] = convert<float>(src[j]);
}

template <class T>
inline void narrow_block(const float* src, T* dst, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  if constexpr (kSixteenBit<T>)
    for (; j + 16 <= n; j += 16) store16_from_float(dst + j, _mm512_loadu_ps(src + j));
#endif
#if defined(__F16C__)
  if constexpr (std::is_same_v<T, Half>)
    for (; j + 8 <= n; j += 8) store8_from_float(dst + j, _mm256_loadu_ps(src + j));
#endif
#if defined(__AVX2__) && defined(__F16C__)
  if constexpr (std::is_same_v<T, BFloat16>)
    for (; j + 8 <= n; j += 8) store8_from_float(dst + j, _mm256_loadu_ps(src + j));
#endif
  for (; j < n; ++j) dst[j] = convert<T>(src[j]);
}

}  // namespace mixtape::cpu
