#pragma once
// Transposing copies into float: dst[r * ld_dst + c] = src[c * ld_src + r]. Float (and 16-bit, widened first)
// sources go 8 x 8 at a time through register transposes; element by element, each strided access costs a
// cache line of its own. Used for the keys of the fused attention and for every copy that reads its source
// transposed (tensor/cpu/strided.h's run_tiled), matmul operands packed row-major among them.
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "tensor/cpu/convert_block.h"

namespace mixtape::cpu {

#if defined(__AVX2__)
// dst[(d + j) * ld + c] = rows[c][d + j] for c, j < 8: an 8 x 8 block of floats transposed in registers.
inline void transpose_8x8(const float* const rows[8], int64_t d, float* dst, int64_t ld) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows[i] + d);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);  // a0 b0 a1 b1 | a4 b4 a5 b5
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));  // a0 b0 c0 d0 | a4 b4 c4 d4
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int j = 0; j < 4; ++j) {  // columns j and j + 4: the low and high halves of rows 0-3 and 4-7
    _mm256_storeu_ps(dst + j * ld, _mm256_permute2f128_ps(r[j], r[j + 4], 0x20));
    _mm256_storeu_ps(dst + (j + 4) * ld, _mm256_permute2f128_ps(r[j], r[j + 4], 0x31));
  }
}
#endif

// dst[r * ld_dst + c] = src[c * ld_src + r] for r < rows, c < cols, converted to A (float or double). Source
// rows are taken 8 at a time and walked in chunks of 64 elements (16-bit chunks widened to float first).
template <class T, class A>
void transpose_into(const T* __restrict src, int64_t ld_src, int64_t rows, int64_t cols, A* __restrict dst,
                    int64_t ld_dst) {
  int64_t c0 = 0;
#if defined(__AVX2__)
  if constexpr (std::is_same_v<A, float> && (std::is_same_v<T, float> || kSixteenBit<T>)) {
    constexpr int64_t kChunk = 64;
    alignas(64) float widened[kSixteenBit<T> ? 8 * kChunk : 1];
    for (; c0 + 8 <= cols; c0 += 8)
      for (int64_t r0 = 0; r0 < rows; r0 += kChunk) {
        const int64_t m = std::min(kChunk, rows - r0);
        const float* lines[8];
        for (int i = 0; i < 8; ++i) {
          if constexpr (kSixteenBit<T>) {
            widen_block(src + (c0 + i) * ld_src + r0, widened + i * kChunk, m);
            lines[i] = widened + i * kChunk;
          } else {
            lines[i] = src + (c0 + i) * ld_src + r0;
          }
        }
        int64_t r = 0;
        for (; r + 8 <= m; r += 8) transpose_8x8(lines, r, dst + (r0 + r) * ld_dst + c0, ld_dst);
        for (; r < m; ++r)
          for (int i = 0; i < 8; ++i) dst[(r0 + r) * ld_dst + c0 + i] = lines[i][r];
      }
  }
#endif
  for (int64_t c = c0; c < cols; ++c)
    for (int64_t r = 0; r < rows; ++r) dst[r * ld_dst + c] = convert<A>(src[c * ld_src + r]);
}

}  // namespace mixtape::cpu
