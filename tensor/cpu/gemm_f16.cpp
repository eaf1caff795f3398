// An fp16 GEMM for CPUs without fp16 arithmetic (no AVX512-FP16, no AMX-FP16).
//
// Why by hand: oneDNN 2.6 (the version Debian 12 ships) has no fp16 GEMM on such a CPU, so an fp16 product
// used to be three passes: both operands widened to f32 copies, oneDNN's f32 GEMM, and its f32 result rounded
// into the fp16 output. Those copies come from and go to memory; in the fp16 training step they took about a
// tenth of the step (README, "On a Zen 5"), so the fp16 modes ran slower than fp32. Here the widening is the
// GEMM's own packing, done a cache-sized block at a time, and the rounding is the kernel's epilogue: the fp16
// data is read once and written once.
//
// The numbers are the f32 GEMM's: an fp16 value has 11 significant bits, so every product is exact in float,
// and each output element sums its K products in float, in order of k, then adds the bias and rounds once.
//
// Layout (BLIS-style; a row-major A is widened but not repacked):
//   - B is widened into slivers of kNR = 32 columns: sliver s holds b(k, 32 s + j) at [s][k][j], zero past N.
//     A row-major B is widened 32 values at a time; a transposed one (a linear layer's weight) goes through
//     the 16 x 16 register transposes of transpose.h.
//   - Each thread takes an even share of A's 12-row tiles and widens them a block of ~kABlockBytes at a time
//     (row-major when A is; packed per tile, k-major, when A is transposed), so the block stays in the core's
//     L2 while every B sliver passes over it. An A with fewer tiles than threads splits the slivers instead.
//   - The kernel keeps a 12 x 32 tile of float sums in 24 zmm registers: per k, two loads of B and twelve
//     broadcasts of A feed 24 FMAs.
#include "tensor/cpu/gemm_f16.h"

#include <omp.h>

#include <algorithm>
#include <cstring>

#include "tensor/cpu/convert_block.h"
#include "tensor/cpu/scratch.h"
#include "tensor/cpu/transpose.h"
#include "tensor/error.h"
#include "tensor/tensor.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define MIXTAPE_GEMM_F16 1
#include <immintrin.h>
#endif

namespace mixtape::cpu {

#if defined(MIXTAPE_GEMM_F16)

namespace {

constexpr int kMR = 12;                     // rows of the register tile
constexpr int kNR = 32;                     // columns of the register tile: two zmm
constexpr int64_t kABlockBytes = 768 << 10;  // the widened A block a thread keeps in its L2

// The widened A block of a thread: rows [m0, m0 + rows) of A, padded with zero rows to whole 12-row tiles.
// Row-major (element (r, k) at [r * ld + k]) when A's k stride is 1. Otherwise packed tile by tile, k-major
// within a tile (element (12 t + i, k) at [t * K * 12 + k * 12 + i]), so the kernel reads it as one stream.
struct ABlock {
  float* data;
  int64_t ld;  // row-major: the row stride; packed: kMR
  bool row_major;
};

// ld of a row-major block: K rounded up to 16 floats, plus 16 when that is a multiple of 256 floats, so the
// twelve rows the kernel walks together do not fall into one L1 set.
int64_t row_major_ld(int64_t K) {
  int64_t ld = (K + 15) / 16 * 16;
  if (ld % 256 == 0) ld += 16;
  return ld;
}

void widen_a_block(const F16Matrix& a, int64_t m0, int64_t rows, int64_t padded_rows, int64_t K,
                   const ABlock& block) {
  if (block.row_major) {
    for (int64_t r = 0; r < rows; ++r) widen_block(a.data + (m0 + r) * a.row_stride, block.data + r * block.ld, K);
    // The padding rows' sums are never stored; zeroed so that no garbage (denormals) slows the FMAs.
    for (int64_t r = rows; r < padded_rows; ++r) std::memset(block.data + r * block.ld, 0, sizeof(float) * K);
    return;
  }
  // a.row_stride == 1: at each k, the block's rows are one contiguous run, 12 of them per tile.
  for (int64_t k = 0; k < K; ++k) {
    const Half* src = a.data + k * a.col_stride + m0;
    for (int64_t r0 = 0; r0 < padded_rows; r0 += kMR) {
      const int64_t n = std::clamp<int64_t>(rows - r0, 0, kMR);
      const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
      const __m256i h = _mm256_maskz_loadu_epi16(mask, src + r0);
      _mm512_mask_storeu_ps(block.data + r0 * K + k * kMR, 0x0FFF, _mm512_maskz_cvtph_ps(mask, h));
    }
  }
}

// Sliver s of B: b(k, n0 + j) at out[k * kNR + j], zero for n0 + j >= N.
void widen_b_sliver(const F16Matrix& b, int64_t K, int64_t N, int64_t n0, float* out) {
  const int64_t cols = std::min<int64_t>(kNR, N - n0);
  if (b.col_stride == 1) {
    for (int64_t k = 0; k < K; ++k) {
      float* line = out + k * kNR;
      widen_block(b.data + k * b.row_stride + n0, line, cols);
      std::fill(line + cols, line + kNR, 0.0f);
    }
    return;
  }
  // b.row_stride == 1: column n0 + j is a contiguous run over k; transposed in registers.
  transpose_into(b.data + n0 * b.col_stride, b.col_stride, K, cols, out, kNR);
  if (cols < kNR)
    for (int64_t k = 0; k < K; ++k) std::fill(out + k * kNR + cols, out + (k + 1) * kNR, 0.0f);
}

// Row k of a row-major B into every sliver: b(k, n) at packed[(n / kNR) * K * kNR + k * kNR + n % kNR].
void widen_b_row(const F16Matrix& b, int64_t K, int64_t N, int64_t k, float* packed) {
  const Half* row = b.data + k * b.row_stride;
  int64_t n0 = 0;
  for (; n0 + kNR <= N; n0 += kNR) widen_block(row + n0, packed + n0 * K + k * kNR, kNR);
  if (n0 < N) {
    float* line = packed + n0 * K + k * kNR;
    widen_block(row + n0, line, N - n0);
    std::fill(line + (N - n0), line + kNR, 0.0f);
  }
}

// A 12 x 32 tile (12 x 16 with kVecs = 1, for a last sliver of at most 16 columns): sums over k of
// a(r, k) * sliver[k][j], plus bias, rounded into out's first `rows` rows and `cols` columns.
template <bool kRowMajorA, int kVecs>
void tile(int64_t K, const float* __restrict a, int64_t lda, const float* __restrict sliver,
          const float* __restrict bias, int rows, int cols, Half* __restrict out, int64_t ldo) {
  static_assert(kVecs == 1 || kVecs == 2);
  __m512 c[kMR][kVecs];
  for (int r = 0; r < kMR; ++r)
    for (int v = 0; v < kVecs; ++v) c[r][v] = _mm512_setzero_ps();
  const float* rows_a[kMR];
  for (int r = 0; r < kMR; ++r) rows_a[r] = kRowMajorA ? a + r * lda : a + r;
  for (int64_t k = 0; k < K; ++k) {
    __m512 b[kVecs];
    for (int v = 0; v < kVecs; ++v) b[v] = _mm512_loadu_ps(sliver + k * kNR + 16 * v);
#pragma GCC unroll 12
    for (int r = 0; r < kMR; ++r) {
      const __m512 x = _mm512_set1_ps(kRowMajorA ? rows_a[r][k] : a[k * lda + r]);
      for (int v = 0; v < kVecs; ++v) c[r][v] = _mm512_fmadd_ps(x, b[v], c[r][v]);
    }
  }
  __mmask16 mask[kVecs];
  __m512 bias_v[kVecs];
  for (int v = 0; v < kVecs; ++v) {
    const int n = std::clamp(cols - 16 * v, 0, 16);
    mask[v] = static_cast<__mmask16>((1u << n) - 1);
    bias_v[v] = bias ? _mm512_maskz_loadu_ps(mask[v], bias + 16 * v) : _mm512_setzero_ps();
  }
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int r = 0; r < rows; ++r) {
    for (int v = 0; v < kVecs; ++v) {
      const __m256i h = _mm512_maskz_cvtps_ph(0xFFFF, _mm512_add_ps(c[r][v], bias_v[v]), kRound);
      _mm256_mask_storeu_epi16(out + r * ldo + 16 * v, mask[v], h);
    }
  }
}

// The tile for A's layout and the sliver's width.
void run_tile(bool row_major_a, int64_t K, const float* a, int64_t lda, const float* sliver, const float* bias,
              int rows, int cols, Half* out, int64_t ldo) {
  if (row_major_a) {
    if (cols > 16) return tile<true, 2>(K, a, lda, sliver, bias, rows, cols, out, ldo);
    return tile<true, 1>(K, a, lda, sliver, bias, rows, cols, out, ldo);
  }
  if (cols > 16) return tile<false, 2>(K, a, lda, sliver, bias, rows, cols, out, ldo);
  tile<false, 1>(K, a, lda, sliver, bias, rows, cols, out, ldo);
}

}  // namespace

bool gemm_f16_available() { return true; }

bool gemm_f16_takes(const F16Matrix& a, const F16Matrix& b) {
  return (a.row_stride == 1 || a.col_stride == 1) && (b.row_stride == 1 || b.col_stride == 1);
}

void gemm_f16(int64_t M, int64_t K, int64_t N, const F16Matrix& a, const F16Matrix& b, const Half* bias,
              Half* out, int64_t out_row_stride) {
  check(M > 0 && K > 0 && N > 0, "gemm_f16: M ", M, ", K ", K, ", N ", N, " must be positive");
  check(gemm_f16_takes(a, b), "gemm_f16: operands need a unit stride along one dim (a strides ", a.row_stride, ", ",
        a.col_stride, "; b strides ", b.row_stride, ", ", b.col_stride, ")");
  const int64_t slivers = (N + kNR - 1) / kNR;
  const int64_t flops = 2 * M * K * N;
  const bool parallel = flops >= (int64_t{1} << 21) && omp_get_max_threads() > 1;
  const int threads = parallel ? omp_get_max_threads() : 1;

  // B, widened into slivers, shared by the threads.
  const Tensor b_buffer = Tensor::empty({slivers * K * kNR});
  float* packed_b = b_buffer.data<float>();
  // The bias widened once (the tile adds 32 floats at a time, so it is padded to whole slivers).
  const Tensor bias_buffer = bias ? Tensor::empty({slivers * kNR}) : Tensor();
  float* bias_f32 = bias ? bias_buffer.data<float>() : nullptr;
  if (bias) {
    widen_block(bias, bias_f32, N);
    std::fill(bias_f32 + N, bias_f32 + slivers * kNR, 0.0f);
  }

  // Each thread takes an even share of A's 12-row tiles (when there are fewer tiles than threads, of the B
  // slivers instead) and widens its tiles a block at a time, each block small enough to stay in its L2 while
  // every B sliver passes over it.
  const bool row_major_a = a.col_stride == 1;
  const int64_t tiles = (M + kMR - 1) / kMR;
  const int64_t ld_row_major = row_major_ld(K);
  const int64_t tile_bytes = kMR * (row_major_a ? ld_row_major : K) * int64_t{sizeof(float)};
  const int64_t split_tiles = tiles >= threads ? threads : 1;
  const int64_t share = (tiles + split_tiles - 1) / split_tiles;
  const int64_t tiles_per_block = std::clamp<int64_t>(kABlockBytes / tile_bytes, 1, share);
  const int64_t ld = row_major_a ? ld_row_major : kMR;
  const size_t scratch = static_cast<size_t>(tiles_per_block * tile_bytes);
  const ThreadScratch a_scratch(scratch, parallel);

#pragma omp parallel num_threads(threads) if (parallel)
  {
    if (b.col_stride == 1) {  // row by row, each row read once from end to end into every sliver
#pragma omp for schedule(static)
      for (int64_t k = 0; k < K; ++k) widen_b_row(b, K, N, k, packed_b);
    } else {
#pragma omp for schedule(static)
      for (int64_t s = 0; s < slivers; ++s) widen_b_sliver(b, K, N, s * kNR, packed_b + s * K * kNR);
    }
    ScratchCarver carver = a_scratch.carver();
    const ABlock block{carver.take<float>(static_cast<int64_t>(scratch / sizeof(float))), ld, row_major_a};
    const int64_t thread = omp_get_thread_num(), team = omp_get_num_threads();
    // This thread's tiles [t_begin, t_end) and slivers [s_begin, s_end).
    int64_t t_begin = 0, t_end = tiles, s_begin = 0, s_end = slivers;
    if (split_tiles > 1) {
      t_begin = tiles * thread / team;
      t_end = tiles * (thread + 1) / team;
    } else {
      s_begin = slivers * thread / team;
      s_end = slivers * (thread + 1) / team;
    }
    for (int64_t t0 = t_begin; t0 < t_end && s_begin < s_end; t0 += tiles_per_block) {
      const int64_t m0 = t0 * kMR;
      const int64_t rows = std::min(std::min(t_end - t0, tiles_per_block) * kMR, M - m0);
      const int64_t padded = (rows + kMR - 1) / kMR * kMR;
      widen_a_block(a, m0, rows, padded, K, block);
      for (int64_t s = s_begin; s < s_end; ++s) {
        const float* sliver = packed_b + s * K * kNR;
        const int cols = static_cast<int>(std::min<int64_t>(kNR, N - s * kNR));
        const float* bias_s = bias_f32 ? bias_f32 + s * kNR : nullptr;
        for (int64_t r0 = 0; r0 < rows; r0 += kMR) {
          const int tile_rows = static_cast<int>(std::min<int64_t>(kMR, rows - r0));
          Half* dst = out + (m0 + r0) * out_row_stride + s * kNR;
          const float* a_tile = block.data + r0 * (row_major_a ? ld : K);
          run_tile(row_major_a, K, a_tile, ld, sliver, bias_s, tile_rows, cols, dst, out_row_stride);
        }
      }
    }
  }
}

#else  // no AVX-512 in this build

bool gemm_f16_available() { return false; }

bool gemm_f16_takes(const F16Matrix&, const F16Matrix&) { return false; }

void gemm_f16(int64_t, int64_t, int64_t, const F16Matrix&, const F16Matrix&, const Half*, Half*, int64_t) {
  fail("gemm_f16: not supported: this build has no AVX-512 (the fp16 product goes through the f32 GEMM)");
}

#endif

}  // namespace mixtape::cpu
