#pragma once
// Contiguous runs of 16-bit values widened to float and rounded back in one vectorised pass (F16C's
// vcvtph2ps / vcvtps2ph 8 at a time for fp16, widening 16 at a time where AVX-512 is there; bf16 is a shift
// the compiler vectorises). Same results as convert<> element by element (round to nearest even), just
// without a scalar conversion per element.
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
#endif

template <class T>
inline void widen_block(const T* src, float* dst, int64_t n) {
#if defined(__F16C__)
  if constexpr (std::is_same_v<T, Half>) {
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= n; j += 16) _mm512_storeu_ps(dst + j, load16_as_float(src + j));
#endif
    for (; j + 8 <= n; j += 8)
      _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j))));
    for (; j < n; ++j) dst[j] = convert<float>(src[j]);
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) dst[j] = convert<float>(src[j]);
}

template <class T>
inline void narrow_block(const float* src, T* dst, int64_t n) {
#if defined(__F16C__)
  if constexpr (std::is_same_v<T, Half>) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; j < n; ++j) dst[j] = convert<T>(src[j]);
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) dst[j] = convert<T>(src[j]);
}

}  // namespace mixtape::cpu
