// bf16 causal attention on the CPU's bf16 product instructions: the block products of tensor/cpu/attention.cpp's
// method done by AMX tiles (_tile_dpbf16ps: C[16 x 16] fp32 += A[16 x 32] bf16 B[32 x 16] bf16) or by AVX512-BF16
// dot products (_mm512_dpbf16_ps: 16 fp32 lanes, each += a0 b0 + a1 b1 of a bf16 pair), each product exact and
// summed in fp32; the softmax and its gradient in fp32 vectors in between. Both engines read the same packed
// operands (below) and run the same loops; only the block product differs (Tiles, DotProducts).
//
// Why: bf16 products run several times faster than fp32 ones on AVX512-BF16 and AMX, so once the GEMMs of
// the bf16 step use them, the portable kernel's fp32 register tiles would be the step's largest item. Same
// inputs, outputs and layouts as the portable kernel; it is chosen by dtype, head dim and CPU only
// (bf16_attention_kernel_for), never by thread count, so a run is deterministic. The AVX512-BF16 engine is not
// chosen where the CPU's dot product is slow (slow_bf16_dot, a rate measured once per process: a Xeon without
// AMX, vdpbf16ps at half the f32 FMA rate), where the portable kernel is the faster. A machine near the bound
// could choose either kernel, and the two differ in numerics (p and ds rounded to bf16, or kept fp32):
// set_bf16_attention_kernel pins one. (Xeon without AMX, rate 0.48-0.50: forward + backward of [16, 4, 128, 64]
// 3.99-4.37 ms on the portable kernel, 4.90-5.37 on the dot products.)
//
// Method. A task is one (batch, head) slice. Its rows are first packed into per-thread buffers in the
// layouts the block products read, T padded with zero rows to Tp, a multiple of the 64-row block:
//   A operands (row-major): q, do [Tp, D]; q^T, do^T [D, Tp];
//   B operands (VNNI: pairs of consecutive k rows interleaved, [K/2, N, 2]): k^T and v^T (k = d, n = key),
//   k and v (k = key, n = d); in the backward also p and ds (k = query, n = key), block by block.
// Forward, per block of 64 query rows i0..: s = q k^T for every key up to the block's end (a [64, i0 + 64]
// strip: O(T) per thread, never O(T^2)), then per row the exact max m, p = e^(scale s - m) rounded to bf16
// (0 for hidden keys), l = the sum of the rounded p, out = (p v) / l rounded once to bf16 and
// lse = m + log l. Normalising by the sum of the values actually multiplied keeps out a convex combination of
// the v rows.
// Backward, per key block j0 and each query block i0 >= j0 (the causal pairs), as in the portable kernel:
//   p = e^(scale q k^T - lse),  dp = do v^T,  ds = p (dp - delta)  (fp32; delta_i = do_i . o_i),
//   dv^T += do^T p,  dk^T += q^T ds,  dq += ds k  (p and ds rounded to bf16 as block-product operands),
// with dk^T and dv^T stored transposed (and dk, dq scaled) once per key block, dq once per head.
// Both skip the masked upper right quadrant of each diagonal block (the top 32 query rows never see the right
// 32 keys): each product runs per half block over the rows or keys that are not masked (17% fewer products at
// T = 128; bench_ops' bf16 attention row on a Zen 5: 1.34-1.43 ms against 1.48-1.57 without the skip).
// Numerics: the scores and every sum are fp32, as in the portable kernel; the difference is the rounding of
// p and ds to bf16 before their products (relative 2^-9 each, the rounding FlashAttention does on a GPU). The
// two engines sum the same exact products in different orders, so their last bits may differ.
// tests/test_attention.cpp's Bf16Attention* tests bound each engine's outputs and gradients against f64.
#include "tensor/cpu/attention_bf16.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>

// The packing and the loops need AVX512-BF16 (and BW); the tiles need AMX on top of it.
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define MIXTAPE_BF16_ATTENTION 1
#include <immintrin.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define MIXTAPE_AMX_TILES 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

#include "tensor/cpu/attention_rows.h"
#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/fast_math.h"
#include "tensor/cpu/lane_sum.h"
#include "tensor/cpu/scratch.h"
#include "tensor/cpu/transpose.h"
#include "tensor/error.h"

namespace mixtape::cpu {

const char* bf16_attention_kernel_name(Bf16AttentionKernel kernel) {
  switch (kernel) {
    case Bf16AttentionKernel::Portable: return "portable";
    case Bf16AttentionKernel::Avx512Bf16: return "avx512_bf16";
    case Bf16AttentionKernel::Amx: return "amx";
  }
  return "unknown";
}

bool bf16_attention_kernel_available(Bf16AttentionKernel kernel) {
  switch (kernel) {
    case Bf16AttentionKernel::Portable: return true;
    case Bf16AttentionKernel::Avx512Bf16: {
#if MIXTAPE_BF16_ATTENTION
      static const bool available = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
      return available;
#else
      return false;
#endif
    }
    case Bf16AttentionKernel::Amx: {
#if MIXTAPE_AMX_TILES
      static const bool available = [] {
        if (!__builtin_cpu_supports("amx-bf16") || !__builtin_cpu_supports("avx512bf16")) return false;
        // Linux hands a process the AMX tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
        constexpr long kReqXcompPerm = 0x1023, kXfeatureXtileData = 18;
        return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtileData) == 0;
      }();
      return available;
#else
      return false;
#endif
    }
  }
  return false;
}

namespace {

std::atomic<Bf16AttentionKernel>& selected_kernel() {
  static std::atomic<Bf16AttentionKernel> selected = [] {
    const bool amx = bf16_attention_kernel_available(Bf16AttentionKernel::Amx);
    const bool dot = bf16_attention_kernel_available(Bf16AttentionKernel::Avx512Bf16);
    // The rate is measured only where it decides.
    return automatic_bf16_attention_kernel(amx, dot, !amx && dot ? bf16_dot_rate() : 0.0);
  }();
  return selected;
}

}  // namespace

Bf16AttentionKernel automatic_bf16_attention_kernel(bool amx, bool avx512_bf16, double dot_rate) {
  if (amx) return Bf16AttentionKernel::Amx;
  if (avx512_bf16 && !slow_bf16_dot(dot_rate)) return Bf16AttentionKernel::Avx512Bf16;
  return Bf16AttentionKernel::Portable;
}

Bf16AttentionKernel bf16_attention_kernel() { return selected_kernel().load(std::memory_order_relaxed); }

Bf16AttentionKernel set_bf16_attention_kernel(Bf16AttentionKernel kernel) {
  if (!bf16_attention_kernel_available(kernel))
    fail("set_bf16_attention_kernel: not supported: the ", bf16_attention_kernel_name(kernel),
         " kernel (this build or CPU lacks its instructions)");
  return selected_kernel().exchange(kernel);
}

Bf16AttentionKernel bf16_attention_kernel_for(DType dtype, int64_t D) {
  if (dtype != DType::BF16 || D <= 0 || D % 32 != 0) return Bf16AttentionKernel::Portable;
  return bf16_attention_kernel();
}

#if MIXTAPE_BF16_ATTENTION

namespace {

constexpr int64_t kBlock = 64;  // query and key rows per block: a multiple of 32 (two tiles of 16 rows)
constexpr int64_t kHalf = kBlock / 2;  // half a block: still a multiple of 32, as the block products need

int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// Rows (b, h, t) of a [B, H, T, D] bf16 tensor: data + b*sB + h*sH + t*sT, the head dim contiguous.
struct Heads {
  BFloat16* data;
  int64_t H, sB, sH, sT;
  BFloat16* row(int64_t bh, int64_t t) const { return data + (bh / H) * sB + (bh % H) * sH + t * sT; }
};

Heads heads_of(const Tensor& t) { return {t.data<BFloat16>(), t.size(1), t.stride(0), t.stride(1), t.stride(2)}; }

#if MIXTAPE_AMX_TILES
// The tile registers, configured once per thread for a kernel: tiles 0-3 hold C (16 rows of 16 floats),
// 4-5 A (16 rows of 32 bf16), 6-7 B (16 rows of 16 bf16 pairs): 64 bytes a row for all of them.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

class TileScope {
 public:
  TileScope() {
    TileConfig config;
    for (int i = 0; i < 8; ++i) {
      config.colsb[i] = 64;
      config.rows[i] = 16;
    }
    _tile_loadconfig(&config);
  }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};
#endif  // MIXTAPE_AMX_TILES

// ---- the block product: C[M x N] (ldc floats) (+)= A[M x K] B[K x N], M, N and K multiples of 32 ----------
// A is row-major bf16 (lda), B is in VNNI form: the pair (B[2kk, n], B[2kk + 1, n]) at b + kk * ldb + 2n. An
// engine is a type with a Scope (held by each thread around its products) and a static gemm<Accumulate>.

// AVX512-BF16: a register block of C, 8 rows x 32 columns (16 zmm accumulators), stays in registers over the
// whole K; each step broadcasts one A pair per row against two 16-column rows of B pairs.
struct DotProducts {
  struct Scope {};

  template <bool Accumulate>
  static void gemm(int64_t M, int64_t N, int64_t K, const BFloat16* a, int64_t lda, const BFloat16* b, int64_t ldb,
                   float* c, int64_t ldc) {
    constexpr int kRows = 8;
    for (int64_t i = 0; i < M; i += kRows)
      for (int64_t j = 0; j < N; j += 32) {
        __m512 acc[kRows][2];
#pragma GCC unroll 8
        for (int r = 0; r < kRows; ++r) {
          const float* cr = c + (i + r) * ldc + j;
          acc[r][0] = Accumulate ? _mm512_loadu_ps(cr) : _mm512_setzero_ps();
          acc[r][1] = Accumulate ? _mm512_loadu_ps(cr + 16) : _mm512_setzero_ps();
        }
        const BFloat16* a_rows = a + i * lda;
        const BFloat16* b_pairs = b + 2 * j;
        for (int64_t kk = 0; kk < K / 2; ++kk) {
          const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b_pairs + kk * ldb);
          const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b_pairs + kk * ldb + 32);
#pragma GCC unroll 8
          for (int r = 0; r < kRows; ++r) {
            int32_t pair;  // A[i + r, 2kk] and A[i + r, 2kk + 1]
            std::memcpy(&pair, a_rows + r * lda + 2 * kk, sizeof pair);
            const __m512bh ar = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], ar, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], ar, b1);
          }
        }
#pragma GCC unroll 8
        for (int r = 0; r < kRows; ++r) {
          float* cr = c + (i + r) * ldc + j;
          _mm512_storeu_ps(cr, acc[r][0]);
          _mm512_storeu_ps(cr + 16, acc[r][1]);
        }
      }
  }
};

#if MIXTAPE_AMX_TILES
// AMX: blocks of 32 x 32 (four C tiles) walk K in steps of 32.
struct Tiles {
  using Scope = TileScope;

  template <bool Accumulate>
  static void gemm(int64_t M, int64_t N, int64_t K, const BFloat16* a, int64_t lda, const BFloat16* b, int64_t ldb,
                   float* c, int64_t ldc) {
    const int64_t sa = lda * 2, sb = ldb * 2, sc = ldc * 4;  // row strides in bytes
    for (int64_t i = 0; i < M; i += 32)
      for (int64_t j = 0; j < N; j += 32) {
        float* c0 = c + i * ldc + j;
        float* c1 = c0 + 16 * ldc;
        if constexpr (Accumulate) {
          _tile_loadd(0, c0, sc);
          _tile_loadd(1, c0 + 16, sc);
          _tile_loadd(2, c1, sc);
          _tile_loadd(3, c1 + 16, sc);
        } else {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        }
        for (int64_t k = 0; k < K; k += 32) {
          _tile_loadd(4, a + i * lda + k, sa);
          _tile_loadd(5, a + (i + 16) * lda + k, sa);
          _tile_loadd(6, b + (k / 2) * ldb + 2 * j, sb);
          _tile_loadd(7, b + (k / 2) * ldb + 2 * (j + 16), sb);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, c0, sc);
        _tile_stored(1, c0 + 16, sc);
        _tile_stored(2, c1, sc);
        _tile_stored(3, c1 + 16, sc);
      }
  }
};
#endif  // MIXTAPE_AMX_TILES

// dst[0, n) = src[0, n) rounded to bf16 (nearest even), n a multiple of 32. Block-product operands only: the
// instruction flushes subnormal inputs (below 1.2e-38) to 0, where convert<BFloat16> keeps them.
inline void narrow_tile_row(const float* src, BFloat16* dst, int64_t n) {
  for (int64_t j = 0; j < n; j += 32) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + j + 16), _mm512_loadu_ps(src + j));
    _mm512_storeu_si512(dst + j, (__m512i)v);
  }
}

// 32 bf16 as two registers of floats, exactly: a float is a bf16 with 16 zero bits below it, so the even
// elements of each pair shift up and the odd ones are masked in place. The masked shift with an all-ones mask:
// GCC 12's plain one warns of an uninitialised value.
inline __m512 widen_even(__m512i v) { return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, v, 16)); }
inline __m512 widen_odd(__m512i v) { return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(-65536))); }

// narrow_tile_row, returning the fp32 sum of the rounded values: 16 lane sums, added pairwise at the end.
inline float narrow_tile_row_sum(const float* src, BFloat16* dst, int64_t n) {
  __m512 lanes = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 32) {
    const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + j + 16), _mm512_loadu_ps(src + j));
    _mm512_storeu_si512(dst + j, v);
    lanes = _mm512_add_ps(lanes, widen_even(v));
    lanes = _mm512_add_ps(lanes, widen_odd(v));
  }
  return sum_lanes(lanes);
}

// max_{c < n} v[c] for n >= 1, 16 lanes at a time, the last ones masked: the exact maximum, NaN ignored (as
// lane_max in tensor/cpu/lane_sum.h, whose scalar tail cost this kernel for rows not a multiple of 16).
inline float row_max(const float* v, int64_t n) {
  __m512 lanes = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) lanes = _mm512_maskz_max_ps(0xFFFF, _mm512_loadu_ps(v + c), lanes);
  if (c < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - c)) - 1);
    lanes = _mm512_mask_max_ps(lanes, tail, _mm512_maskz_loadu_ps(tail, v + c), lanes);
  }
  return max_lanes(lanes);
}

// sum_{d < D} a[d] b[d] in fp32 (D a multiple of 32): 16 lanes of fused products, folded at the end.
inline float dot_row(const BFloat16* a, const BFloat16* b, int64_t D) {
  __m512 lanes = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 32) {
    const __m512i x = _mm512_loadu_si512(a + d), y = _mm512_loadu_si512(b + d);
    lanes = _mm512_fmadd_ps(widen_even(x), widen_even(y), lanes);
    lanes = _mm512_fmadd_ps(widen_odd(x), widen_odd(y), lanes);
  }
  return sum_lanes(lanes);
}

// dst[(c * 2) + e] = bf16(row_e[c]) for e = 0, 1 and c < n (n a multiple of 32): two rows of a B operand
// interleaved into a VNNI row.
inline void narrow_pair_row(const float* row0, const float* row1, BFloat16* dst, int64_t n) {
  // 16-bit lanes: [row0 0..15, row1 0..15] -> [row0 0, row1 0, row0 1, row1 1, ...]
  alignas(64) static constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                                           21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26,
                                                           11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i index = _mm512_load_si512(kInterleave);
  for (int64_t j = 0; j < n; j += 16) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(row1 + j), _mm512_loadu_ps(row0 + j));
    _mm512_storeu_si512(dst + 2 * j, _mm512_permutexvar_epi16(index, (__m512i)v));
  }
}

// ---- packing a head's rows --------------------------------------------------------------------------------

// [Tp, D] row-major: rows 0..T-1 of the head, then zero rows.
void pack_rows(const Heads& x, int64_t bh, int64_t T, int64_t Tp, int64_t D, BFloat16* dst) {
  for (int64_t t = 0; t < T; ++t) std::memcpy(dst + t * D, x.row(bh, t), static_cast<size_t>(D) * 2);
  std::memset(static_cast<void*>(dst + T * D), 0, static_cast<size_t>((Tp - T) * D) * 2);
}

// A head's rows as a row-major A operand (rows .. + ld): read in place where the head has no padding rows (T a
// multiple of the block, so no product reaches past row T - 1), else packed into `scratch` as pack_rows does.
struct RowOperand {
  const BFloat16* data;
  int64_t ld;
  const BFloat16* row(int64_t t) const { return data + t * ld; }
};

RowOperand row_operand(const Heads& x, int64_t bh, int64_t T, int64_t Tp, int64_t D, BFloat16* scratch) {
  if (T == Tp) return {x.row(bh, 0), x.sT};
  pack_rows(x, bh, T, Tp, D, scratch);
  return {scratch, D};
}

// VNNI with k = t: [Tp / 2, D, 2], element (t, d) at (t / 2) * 2D + 2d + t % 2 (a B operand summed over rows):
// rows t and t + 1 interleaved 32 values at a time (D is a multiple of 32).
void pack_row_pairs(const Heads& x, int64_t bh, int64_t T, int64_t Tp, int64_t D, BFloat16* dst) {
  // 16-bit lanes of (r0, r1): the first 16 of each interleaved, then the last 16.
  alignas(64) static constexpr uint16_t kLow[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                    8,  40, 9,  41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t kHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                     24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i low = _mm512_load_si512(kLow), high = _mm512_load_si512(kHigh);
  for (int64_t t = 0; t < Tp; t += 2) {
    const BFloat16* r0 = t < T ? x.row(bh, t) : nullptr;
    const BFloat16* r1 = t + 1 < T ? x.row(bh, t + 1) : nullptr;
    BFloat16* out = dst + t * D;
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i a = r0 ? _mm512_loadu_si512(r0 + d) : _mm512_setzero_si512();
      const __m512i b = r1 ? _mm512_loadu_si512(r1 + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + 2 * d, _mm512_permutex2var_epi16(a, low, b));
      _mm512_storeu_si512(out + 2 * d + 32, _mm512_permutex2var_epi16(a, high, b));
    }
  }
}

// VNNI with k = d: [D / 2, Tp, 2], element (t, d) at (d / 2) * 2Tp + 2t + d % 2 (x^T as a B operand): the head
// seen as [T, D / 2] pairs of bf16, transposed pair by pair, 16 x 16 pairs at a time (D / 2 is a multiple of
// 16); rows past the last whole block of 16 pair by pair.
void pack_col_pairs(const Heads& x, int64_t bh, int64_t T, int64_t Tp, int64_t D, BFloat16* dst) {
  auto* out = reinterpret_cast<uint32_t*>(dst);
  const int64_t pairs = D / 2;
  int64_t t0 = 0;
  for (; t0 + 16 <= T; t0 += 16)
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
      __m512i rows[16];
      for (int r = 0; r < 16; ++r) rows[r] = _mm512_loadu_si512(x.row(bh, t0 + r) + 2 * p0);
      transpose_16x16(rows, out + p0 * Tp + t0, Tp);
    }
  for (int64_t t = t0; t < T; ++t)
    for (int64_t p = 0; p < pairs; ++p) std::memcpy(out + p * Tp + t, x.row(bh, t) + 2 * p, 4);
  for (int64_t p = 0; p < pairs; ++p) std::fill(out + p * Tp + T, out + (p + 1) * Tp, 0u);
}

// [D, Tp] row-major: the head transposed, zero columns T..Tp-1. First as pairs (pack_col_pairs: row p holds
// (x[t, 2p], x[t, 2p + 1]) for every t), then each pair row split into rows 2p and 2p + 1, 32 values at a time.
void pack_transposed(const Heads& x, int64_t bh, int64_t T, int64_t Tp, int64_t D, BFloat16* pairs,
                     BFloat16* dst) {
  pack_col_pairs(x, bh, T, Tp, D, pairs);
  // 16-bit lanes of two registers of pairs (64 values): the even ones (the first of each pair), then the odd.
  alignas(64) static constexpr uint16_t kEven[32] = {0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                                     32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54, 56, 58, 60, 62};
  alignas(64) static constexpr uint16_t kOdd[32] = {1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
                                                    33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
  const __m512i even = _mm512_load_si512(kEven), odd = _mm512_load_si512(kOdd);
  for (int64_t p = 0; p < D / 2; ++p) {
    const BFloat16* row = pairs + p * 2 * Tp;
    for (int64_t t = 0; t < Tp; t += 32) {  // Tp is a multiple of 32
      const __m512i lo = _mm512_loadu_si512(row + 2 * t), hi = _mm512_loadu_si512(row + 2 * t + 32);
      _mm512_storeu_si512(dst + 2 * p * Tp + t, _mm512_permutex2var_epi16(lo, even, hi));
      _mm512_storeu_si512(dst + (2 * p + 1) * Tp + t, _mm512_permutex2var_epi16(lo, odd, hi));
    }
  }
}

// A thread's buffers (the layouts above), carved from its part of a ThreadScratch.
struct ForwardScratch {
  ForwardScratch(ScratchCarver& c, int64_t Tp, int64_t D)
      : qa(c.take<BFloat16>(Tp * D)),
        kt(c.take<BFloat16>(Tp * D)),
        vp(c.take<BFloat16>(Tp * D)),
        p(c.take<BFloat16>(kBlock * Tp)),
        s(c.take<float>(kBlock * Tp)),
        o(c.take<float>(kBlock * D)),
        m(c.take<float>(kBlock)),
        l(c.take<float>(kBlock)) {}
  BFloat16 *qa, *kt, *vp, *p;
  float *s, *o, *m, *l;
};

struct BackwardScratch {
  BackwardScratch(ScratchCarver& c, int64_t Tp, int64_t D)
      : qa(c.take<BFloat16>(Tp * D)),
        qt(c.take<BFloat16>(Tp * D)),
        kt(c.take<BFloat16>(Tp * D)),
        kp(c.take<BFloat16>(Tp * D)),
        vt(c.take<BFloat16>(Tp * D)),
        doa(c.take<BFloat16>(Tp * D)),
        dot(c.take<BFloat16>(Tp * D)),
        pairs(c.take<BFloat16>(Tp * D)),
        p_pairs(c.take<BFloat16>(kBlock * kBlock)),
        ds_pairs(c.take<BFloat16>(kBlock * kBlock)),
        ds_rows(c.take<BFloat16>(kBlock * kBlock)),
        s(c.take<float>(kBlock * kBlock)),
        dp(c.take<float>(kBlock * kBlock)),
        dkt(c.take<float>(kBlock * D)),
        dvt(c.take<float>(kBlock * D)),
        dq(c.take<float>(Tp * D)),
        delta(c.take<float>(Tp)),
        dk_rows(c.take<float>(kBlock * D)),
        dv_rows(c.take<float>(kBlock * D)) {}
  BFloat16 *qa, *qt, *kt, *kp, *vt, *doa, *dot, *pairs, *p_pairs, *ds_pairs, *ds_rows;
  float *s, *dp, *dkt, *dvt, *dq, *delta, *dk_rows, *dv_rows;
};

bool worth_parallel(int64_t BH, int64_t T, int64_t D) { return BH > 1 && BH * T * T * D >= (int64_t{1} << 20); }

template <class Engine>
void forward(const Tensor& q, const Tensor& k, const Tensor& v, double scale, const Tensor& out, const Tensor& lse) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), BH = B * H;
  if (B * H * T == 0) return;
  const int64_t Tp = round_up(T, kBlock);
  const Heads qh = heads_of(q), kh = heads_of(k), vh = heads_of(v), oh = heads_of(out);
  float* lse_out = lse.data<float>();
  const float scale_f = static_cast<float>(scale);
  const bool parallel = worth_parallel(BH, T, D);
  const ThreadScratch scratch(scratch_bytes<ForwardScratch>(Tp, D), parallel);
#pragma omp parallel if (parallel)
  {
    [[maybe_unused]] const typename Engine::Scope scope;  // AMX: the tile configuration of this thread
    ScratchCarver carver = scratch.carver();
    const ForwardScratch b(carver, Tp, D);
    BFloat16 *const qa = b.qa, *const kt = b.kt, *const vp = b.vp, *const p = b.p;
    float *const s = b.s, *const o = b.o, *const m = b.m, *const l = b.l;
#pragma omp for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < BH; ++bh) {
      const RowOperand qr = row_operand(qh, bh, T, Tp, D, qa);
      pack_col_pairs(kh, bh, T, Tp, D, kt);
      pack_row_pairs(vh, bh, T, Tp, D, vp);
      for (int64_t i0 = 0; i0 < T; i0 += kBlock) {
        // Each half of the block's rows sees the keys up to its own end: the top half skips the diagonal
        // block's upper right quadrant, which the mask hides.
        for (int64_t h0 = 0; h0 < kBlock; h0 += kHalf) {
          const int64_t keys = i0 + h0 + kHalf;
          Engine::template gemm<false>(kHalf, keys, D, qr.row(i0 + h0), qr.ld, kt, 2 * Tp, s + h0 * Tp, Tp);
          for (int64_t r = h0; r < h0 + kHalf; ++r) {
            const int64_t i = i0 + r;
            float* sr = s + r * Tp;
            BFloat16* pr = p + r * Tp;
            if (i >= T) {  // a padding row: no probabilities
              std::fill(pr, pr + keys, BFloat16());
              continue;
            }
            // Over all `keys` columns (a multiple of 32), the hidden ones (c > i) selected to zero: loops over
            // the first n = i + 1 alone ran their last n % 16 elements as scalar code (see
            // probabilities_and_gradient_row).
            const int64_t n = i + 1;
#pragma omp simd
            for (int64_t c = 0; c < keys; ++c) sr[c] *= scale_f;
            const float max = row_max(sr, n);
#pragma omp simd
            for (int64_t c = 0; c < keys; ++c) {
              const float e = fast_exp(sr[c] - max);
              sr[c] = c < n ? e : 0.0f;
            }
            m[r] = max;
            l[r] = narrow_tile_row_sum(sr, pr, keys);  // >= 1: the max's own term is e^0, exactly 1 in bf16
          }
          Engine::template gemm<false>(kHalf, D, keys, p + h0 * Tp, Tp, vp, 2 * D, o + h0 * D, D);
        }
        for (int64_t r = 0; r < std::min(kBlock, T - i0); ++r) {
          store_scaled_run(o + r * D, 1.0f / l[r], oh.row(bh, i0 + r), D);
          lse_out[bh * T + i0 + r] = m[r] + std::log(l[r]);
        }
      }
    }
  }
}

template <class Engine>
void backward(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
              const Tensor& lse, double scale, const Tensor& grad_q, const Tensor& grad_k, const Tensor& grad_v) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), BH = B * H;
  if (B * H * T == 0) return;
  const int64_t Tp = round_up(T, kBlock);
  const Heads qh = heads_of(q), kh = heads_of(k), vh = heads_of(v), goh = heads_of(grad_out), oh = heads_of(out);
  const Heads gqh = heads_of(grad_q), gkh = heads_of(grad_k), gvh = heads_of(grad_v);
  const float* lse_in = lse.data<float>();
  const float scale_f = static_cast<float>(scale);
  const bool parallel = worth_parallel(BH, T, D);
  const ThreadScratch scratch(scratch_bytes<BackwardScratch>(Tp, D), parallel);
#pragma omp parallel if (parallel)
  {
    [[maybe_unused]] const typename Engine::Scope scope;  // AMX: the tile configuration of this thread
    ScratchCarver carver = scratch.carver();
    const BackwardScratch b(carver, Tp, D);
    BFloat16 *const qa = b.qa, *const qt = b.qt, *const kt = b.kt, *const kp = b.kp, *const vt = b.vt;
    BFloat16 *const doa = b.doa, *const dot = b.dot, *const pairs = b.pairs;
    BFloat16 *const p_pairs = b.p_pairs, *const ds_pairs = b.ds_pairs, *const ds_rows = b.ds_rows;
    float *const s = b.s, *const dp = b.dp, *const dkt = b.dkt, *const dvt = b.dvt, *const dq = b.dq;
    float *const delta = b.delta, *const dk_rows = b.dk_rows, *const dv_rows = b.dv_rows;
#pragma omp for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < BH; ++bh) {
      const RowOperand qr = row_operand(qh, bh, T, Tp, D, qa);
      pack_transposed(qh, bh, T, Tp, D, pairs, qt);
      pack_col_pairs(kh, bh, T, Tp, D, kt);
      pack_row_pairs(kh, bh, T, Tp, D, kp);
      pack_col_pairs(vh, bh, T, Tp, D, vt);
      const RowOperand dor = row_operand(goh, bh, T, Tp, D, doa);
      pack_transposed(goh, bh, T, Tp, D, pairs, dot);
      for (int64_t i = 0; i < T; ++i) delta[i] = dot_row(goh.row(bh, i), oh.row(bh, i), D);
      std::fill(dq, dq + Tp * D, 0.0f);
      for (int64_t j0 = 0; j0 < T; j0 += kBlock) {
        std::fill(dkt, dkt + kBlock * D, 0.0f);
        std::fill(dvt, dvt + kBlock * D, 0.0f);
        for (int64_t i0 = j0; i0 < T; i0 += kBlock) {
          // On the diagonal block, the upper right quadrant (query rows of the top half, keys of the right
          // half) is masked: p and ds are zero there, so every product below skips it.
          const bool diagonal = i0 == j0;
          for (int64_t h0 = 0; h0 < kBlock; h0 += kHalf) {  // s and dp for the keys each half of the rows sees
            const int64_t keys = diagonal ? h0 + kHalf : kBlock;
            Engine::template gemm<false>(kHalf, keys, D, qr.row(i0 + h0), qr.ld, kt + 2 * j0, 2 * Tp,
                                         s + h0 * kBlock, kBlock);
            Engine::template gemm<false>(kHalf, keys, D, dor.row(i0 + h0), dor.ld, vt + 2 * j0, 2 * Tp,
                                         dp + h0 * kBlock, kBlock);
          }
          for (int64_t r = 0; r < kBlock; ++r) {
            const int64_t i = i0 + r;
            const int64_t n = i < T ? std::clamp<int64_t>(i - j0 + 1, 0, kBlock) : 0;  // keys row i sees
            const float row_lse = i < T ? lse_in[bh * T + i] : 0.0f, row_delta = i < T ? delta[i] : 0.0f;
            float* dsr = dp + r * kBlock;
            probabilities_and_gradient_row(s + r * kBlock, dsr, n, kBlock, scale_f, row_lse, row_delta);
            narrow_tile_row(dsr, ds_rows + r * kBlock, kBlock);
          }
          for (int64_t r = 0; r < kBlock; r += 2) {  // p and ds as B operands summed over query rows
            narrow_pair_row(s + r * kBlock, s + (r + 1) * kBlock, p_pairs + r * kBlock, kBlock);
            narrow_pair_row(dp + r * kBlock, dp + (r + 1) * kBlock, ds_pairs + r * kBlock, kBlock);
          }
          // dv^T += do^T p;  dk^T += q^T ds (per half of the keys, over the query rows that see them);
          // dq += ds k (per half of the query rows, over the keys they see).
          for (int64_t h0 = 0; h0 < kBlock; h0 += kHalf) {
            const int64_t r0 = diagonal ? h0 : 0;  // the first query row that sees keys h0..
            const int64_t pairs_at = (r0 / 2) * 2 * kBlock + 2 * h0;
            Engine::template gemm<true>(D, kHalf, kBlock - r0, dot + i0 + r0, Tp, p_pairs + pairs_at, 2 * kBlock,
                                        dvt + h0, kBlock);
            Engine::template gemm<true>(D, kHalf, kBlock - r0, qt + i0 + r0, Tp, ds_pairs + pairs_at, 2 * kBlock,
                                        dkt + h0, kBlock);
            const int64_t keys = diagonal ? h0 + kHalf : kBlock;
            Engine::template gemm<true>(kHalf, D, keys, ds_rows + h0 * kBlock, kBlock, kp + j0 * D, 2 * D,
                                        dq + (i0 + h0) * D, D);
          }
        }
        // dk^T and dv^T [D, 64] back to rows [64, D] (register-block transposes), then stored.
        const int64_t keys = std::min(kBlock, T - j0);
        transpose_into(dkt, kBlock, keys, D, dk_rows, D);
        transpose_into(dvt, kBlock, keys, D, dv_rows, D);
        for (int64_t c = 0; c < keys; ++c) {
          store_scaled_run(dk_rows + c * D, scale_f, gkh.row(bh, j0 + c), D);
          store_scaled_run(dv_rows + c * D, 1.0f, gvh.row(bh, j0 + c), D);
        }
      }
      for (int64_t i = 0; i < T; ++i) store_scaled_run(dq + i * D, scale_f, gqh.row(bh, i), D);
    }
  }
}

}  // namespace

void bf16_causal_attention(Bf16AttentionKernel kernel, const Tensor& q, const Tensor& k, const Tensor& v,
                           double scale, const Tensor& out, const Tensor& lse) {
#if MIXTAPE_AMX_TILES
  if (kernel == Bf16AttentionKernel::Amx) return forward<Tiles>(q, k, v, scale, out, lse);
#endif
  if (kernel == Bf16AttentionKernel::Avx512Bf16) return forward<DotProducts>(q, k, v, scale, out, lse);
  fail("causal_attention: not supported: the ", bf16_attention_kernel_name(kernel), " kernel in this build");
}

void bf16_causal_attention_backward(Bf16AttentionKernel kernel, const Tensor& grad_out, const Tensor& q,
                                    const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                                    double scale, const Tensor& grad_q, const Tensor& grad_k, const Tensor& grad_v) {
#if MIXTAPE_AMX_TILES
  if (kernel == Bf16AttentionKernel::Amx)
    return backward<Tiles>(grad_out, q, k, v, out, lse, scale, grad_q, grad_k, grad_v);
#endif
  if (kernel == Bf16AttentionKernel::Avx512Bf16)
    return backward<DotProducts>(grad_out, q, k, v, out, lse, scale, grad_q, grad_k, grad_v);
  fail("causal_attention_backward: not supported: the ", bf16_attention_kernel_name(kernel),
       " kernel in this build");
}

#else  // built without AVX512-BF16

void bf16_causal_attention(Bf16AttentionKernel kernel, const Tensor&, const Tensor&, const Tensor&, double,
                           const Tensor&, const Tensor&) {
  fail("causal_attention: not supported: the ", bf16_attention_kernel_name(kernel),
       " kernel (this build has no AVX512-BF16)");
}

void bf16_causal_attention_backward(Bf16AttentionKernel kernel, const Tensor&, const Tensor&, const Tensor&,
                                    const Tensor&, const Tensor&, const Tensor&, double, const Tensor&,
                                    const Tensor&, const Tensor&) {
  fail("causal_attention_backward: not supported: the ", bf16_attention_kernel_name(kernel),
       " kernel (this build has no AVX512-BF16)");
}

#endif

}  // namespace mixtape::cpu
