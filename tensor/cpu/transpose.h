#pragma once
// Transposing copies, dst[r * ld_dst + c] = src[c * ld_src + r]: into float (float sources, and 16-bit ones
// widened first) 16 x 16 (AVX-512) or 8 x 8 (AVX2) at a time through register transposes, and between 16-bit
// tensors of one type 16 x 16 at a time with AVX-512; element by element, each strided access costs a cache
// line of its own. Used for the keys of the fused attention and for every copy that reads its source
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

#if defined(__AVX512F__)
// dst[c * ld + r] = rows[r][c] for r, c < 16: a 16 x 16 block of 32-bit lanes transposed in registers (lanes
// are moved, never computed on).
// (The zero-masked forms of the intrinsics with all-ones masks throughout: GCC 12's plain ones warn of an
// uninitialised value.)
template <class Lane>
inline void transpose_16x16(const __m512i (&rows)[16], Lane* dst, int64_t ld) {
  static_assert(sizeof(Lane) == 4);
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: (a0 b0 a1 b1), (a2 b2 a3 b3)
    t[i] = _mm512_maskz_unpacklo_epi32(0xFFFF, rows[i], rows[i + 1]);
    t[i + 1] = _mm512_maskz_unpackhi_epi32(0xFFFF, rows[i], rows[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + j], lane k: column 4k + j of rows i..i+3
    u[i] = _mm512_maskz_unpacklo_epi64(0xFF, t[i], t[i + 2]);
    u[i + 1] = _mm512_maskz_unpackhi_epi64(0xFF, t[i], t[i + 2]);
    u[i + 2] = _mm512_maskz_unpacklo_epi64(0xFF, t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_maskz_unpackhi_epi64(0xFF, t[i + 1], t[i + 3]);
  }
  // 128-bit lanes 0 and 2 (even) or 1 and 3 (odd) of a, then the same of b.
  auto even = [](__m512i a, __m512i b) { return _mm512_maskz_shuffle_i32x4(0xFFFF, a, b, 0x88); };
  auto odd = [](__m512i a, __m512i b) { return _mm512_maskz_shuffle_i32x4(0xFFFF, a, b, 0xDD); };
  for (int j = 0; j < 4; ++j) {  // the four 128-bit lanes of column 4k + j gathered from the row groups
    const __m512i v0 = even(u[j], u[4 + j]), v1 = odd(u[j], u[4 + j]);
    const __m512i w0 = even(u[8 + j], u[12 + j]), w1 = odd(u[8 + j], u[12 + j]);
    _mm512_storeu_si512(dst + j * ld, even(v0, w0));
    _mm512_storeu_si512(dst + (4 + j) * ld, even(v1, w1));
    _mm512_storeu_si512(dst + (8 + j) * ld, odd(v0, w0));
    _mm512_storeu_si512(dst + (12 + j) * ld, odd(v1, w1));
  }
}
#endif

// dst[r * ld_dst + c] = src[c * ld_src + r] for r < rows, c < cols, for a 16-bit T (fp16, bf16): its bits
// moved, never converted (a signalling NaN stays as it is). With AVX-512, 16 x 16 blocks: 16 values of 16
// source runs widened to 32-bit lanes, transposed in registers (transpose_16x16) and narrowed back. Used by
// copies that read a 16-bit source transposed into the same type (a bf16 matmul operand packed row-major).
// Two blocks side by side make each destination row of 32 values one 64-byte store: a bf16 weight
// gradient's packed operand has rows 4 KiB apart, all in one L1 set, and with 32-byte stores each line would
// be evicted between its two halves and fetched again (bench_ops' bf16 transpose row, Zen 5: 67-71 GB/s, 55-56
// with 32-byte stores).
template <class T>
void transpose16_into(const T* __restrict src, int64_t ld_src, int64_t rows, int64_t cols, T* __restrict dst,
                      int64_t ld_dst) {
  static_assert(sizeof(T) == 2);
  const auto* in = reinterpret_cast<const uint16_t*>(src);
  auto* out = reinterpret_cast<uint16_t*>(dst);
  // The register blocks cover rows [0, rows16) of columns [0, c0); the scalar loops below cover the rest.
  int64_t c0 = 0, rows16 = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  rows16 = rows / 16 * 16;
  // Columns c0 .. c0 + width - 1 (width 32 or 16) of every whole 16-row block, each destination row of the
  // block one store: width / 16 blocks of 16 source runs x 16 values, each widened to 32-bit lanes,
  // transposed (transpose_16x16) and narrowed back side by side.
  auto columns = [&](int width) {
    for (; c0 + width <= cols; c0 += width)
      for (int64_t r = 0; r < rows16; r += 16) {
        alignas(64) uint32_t wide[2][16 * 16];
        for (int h = 0; h < width / 16; ++h) {
          __m512i block[16];
          for (int i = 0; i < 16; ++i)
            block[i] = _mm512_maskz_cvtepu16_epi32(
                0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + (c0 + 16 * h + i) * ld_src + r)));
          transpose_16x16(block, wide[h], 16);
        }
        for (int j = 0; j < 16; ++j) {
          const __m256i left = _mm512_maskz_cvtepi32_epi16(0xFFFF, _mm512_load_si512(wide[0] + 16 * j));
          uint16_t* row = out + (r + j) * ld_dst + c0;
          if (width == 16) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), left);
          } else {
            const __m256i right = _mm512_maskz_cvtepi32_epi16(0xFFFF, _mm512_load_si512(wide[1] + 16 * j));
            _mm512_storeu_si512(row, _mm512_maskz_inserti64x4(0xFF, _mm512_castsi256_si512(left), right, 1));
          }
        }
      }
  };
  columns(32);
  columns(16);
#endif
  for (int64_t c = c0; c < cols; ++c)
    for (int64_t r = 0; r < rows16; ++r) out[r * ld_dst + c] = in[c * ld_src + r];
  for (int64_t r = rows16; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[r * ld_dst + c] = in[c * ld_src + r];
}

// dst[r * ld_dst + c] = src[c * ld_src + r] for r < rows, c < cols, converted to A (float or double). Source
// rows are taken 8 at a time and walked in chunks of 64 elements (16-bit chunks widened to float first).
template <class T, class A>
void transpose_into(const T* __restrict src, int64_t ld_src, int64_t rows, int64_t cols, A* __restrict dst,
                    int64_t ld_dst) {
  int64_t c0 = 0;
#if defined(__AVX2__)
  if constexpr (std::is_same_v<A, float> && (std::is_same_v<T, float> || kSixteenBit<T>)) {
    constexpr int64_t kChunk = 64;
    // W source rows at a time, walked in chunks of kChunk elements, each W x W block transposed by `block`.
    auto by_blocks = [&]<int W>(auto&& block) {
      alignas(64) float widened[kSixteenBit<T> ? W * kChunk : 1];
      for (; c0 + W <= cols; c0 += W)
        for (int64_t r0 = 0; r0 < rows; r0 += kChunk) {
          const int64_t m = std::min(kChunk, rows - r0);
          const float* lines[W];
          for (int i = 0; i < W; ++i) {
            if constexpr (kSixteenBit<T>) {
              widen_block(src + (c0 + i) * ld_src + r0, widened + i * kChunk, m);
              lines[i] = widened + i * kChunk;
            } else {
              lines[i] = src + (c0 + i) * ld_src + r0;
            }
          }
          int64_t r = 0;
          for (; r + W <= m; r += W) block(lines, r, dst + (r0 + r) * ld_dst + c0);
          for (; r < m; ++r)
            for (int i = 0; i < W; ++i) dst[(r0 + r) * ld_dst + c0 + i] = lines[i][r];
        }
    };
#if defined(__AVX512F__)
    by_blocks.template operator()<16>([&](const float* const* lines, int64_t r, float* out) {
      __m512i block[16];
      for (int i = 0; i < 16; ++i) block[i] = _mm512_castps_si512(_mm512_loadu_ps(lines[i] + r));
      transpose_16x16(block, out, ld_dst);
    });
#endif
    by_blocks.template operator()<8>([&](const float* const* lines, int64_t r, float* out) {
      transpose_8x8(lines, r, out, ld_dst);
    });
  }
#endif
  for (int64_t c = c0; c < cols; ++c)
    for (int64_t r = 0; r < rows; ++r) dst[r * ld_dst + c] = convert<A>(src[c * ld_src + r]);
}

}  // namespace mixtape::cpu
