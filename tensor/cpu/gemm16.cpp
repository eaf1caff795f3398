// A GEMM on fp16 or bf16 operands for CPUs without arithmetic in that format.
//
// Why by hand: oneDNN 2.6 (the version Debian 12 ships) has no fp16 GEMM on a CPU without AVX512-FP16, and no
// bf16 GEMM on one without AVX512-BF16 (AVX2 machines, older AVX-512 ones), and no library here has one.
// Through oneDNN a 16-bit product is three passes: both operands widened to f32 copies, the f32 GEMM, and its
// f32 result rounded into the 16-bit output; those copies go to and come from memory, so the fp16 modes would
// run slower than fp32. Here the widening is the GEMM's own packing, done a cache-sized block at a time, and
// the rounding is the kernel's epilogue: the 16-bit data is read once and written once.
//
// The numbers are the f32 GEMM's: fp16 and bf16 values have at most 11 significant bits, so every product is
// exact in float, and each output element sums its K products in float, in order of k, then adds the bias and
// rounds once (nearest even).
//
// Layout (BLIS-style), for a tile of kMR rows x kNR columns (AVX-512: 12 x 32, in 24 zmm registers; AVX2:
// 6 x 16, in 12 ymm registers):
//   - B is widened into slivers of kNR columns: sliver s holds b(k, kNR s + j) at [s][k][j], zero past N. A
//     row-major B is widened a row at a time into every sliver; a transposed one (a linear layer's weight)
//     goes through the register transposes of transpose.h.
//   - Each thread starts on an even share of A's tiles and widens them a block of ~kABlockBytes (at least
//     kMinBlockTiles tiles within kMaxBlockBytes) at a time (row-major when A is; packed per tile, k-major,
//     when A is transposed), so the block stays near the core while every B sliver passes over it. A thread
//     whose share runs out takes the back half of the unstarted tiles of the one with the most (work_ranges.h),
//     so a thread slowed by a neighbour on a shared machine does not leave the others idle at the end of the
//     product (Xeon without AMX: the step's lowest 16-bit paired ratio 1.05-1.06, 0.98-1.01 with even shares).
//     An A with fewer tiles than threads splits the slivers instead.
//   - Per k the kernel loads two vectors of B and broadcasts kMR values of A into 2 kMR FMAs. A last sliver
//     of at most one vector's width takes a tile of one vector per row; one of at most kNarrow columns against
//     a packed A is multiplied with the vectors along A's rows instead (narrow_tiles).
#include "tensor/cpu/gemm16.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <vector>
#include <cstring>

#include "tensor/cpu/convert_block.h"
#include "tensor/cpu/scratch.h"
#include "tensor/cpu/transpose.h"
#include "tensor/cpu/work_ranges.h"
#include "tensor/error.h"
#include "tensor/tensor.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define MIXTAPE_GEMM16_AVX2 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define MIXTAPE_GEMM16_AVX512 1
#endif
#if defined(MIXTAPE_GEMM16_AVX2) || defined(MIXTAPE_GEMM16_AVX512)
#include <immintrin.h>
#endif

namespace mixtape::cpu {

namespace {

constexpr Gemm16Isa widest_built() {
#if defined(MIXTAPE_GEMM16_AVX512)
  return Gemm16Isa::Avx512;
#elif defined(MIXTAPE_GEMM16_AVX2)
  return Gemm16Isa::Avx2;
#else
  return Gemm16Isa::None;
#endif
}

// `who` may choose `isa`: None or a kernel this build has; else "not supported", naming what it has.
void require_built(Gemm16Isa isa, const std::string& who) {
  const std::vector<Gemm16Isa> kernels = gemm16_kernels();
  if (isa != Gemm16Isa::None && std::find(kernels.begin(), kernels.end(), isa) == kernels.end())
    fail(who, ": not supported: this build has no ", gemm16_isa_name(isa), " kernel (its widest: ",
         gemm16_isa_name(widest_built()), ")");
}

// The kernel in use: MIXTAPE_GEMM16's choice, else the widest built. Read on first use.
std::atomic<Gemm16Isa>& chosen_isa() {
  static std::atomic<Gemm16Isa> isa{gemm16_isa_from_env(std::getenv("MIXTAPE_GEMM16"))};
  return isa;
}

// ---- the vector code, per instruction set -------------------------------------------------------------------

#if defined(MIXTAPE_GEMM16_AVX512)
struct Avx512 {
  using V = __m512;
  static constexpr int kLanes = 16, kMR = 12;
  // The widened A block a thread keeps near while every B sliver passes over it: kABlockBytes, and at least
  // kMinBlockTiles tiles as long as they fit in kMaxBlockBytes (so 8 tiles, 96 rows, at the GPT's K of 256 to
  // 2048; past K = 2048 the byte bound alone). The bounds are tuned, not derived: timings of the f16 step's
  // GEMM shapes under this rule and under a single 768 KiB bound: 0.1-1.3% faster in sum (Xeon without AMX).
  static constexpr int64_t kABlockBytes = 64 << 10, kMinBlockTiles = 8, kMaxBlockBytes = 768 << 10;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V broadcast(float x) { return _mm512_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  template <class T> static void store_narrow(T* p, V v) { store16_from_float(p, v); }
  // A packed tile's kMR values of one k, zero in the lanes past them.
  static V load_rows(const float* p) { return _mm512_maskz_loadu_ps((1u << kMR) - 1, p); }
};
#endif

#if defined(MIXTAPE_GEMM16_AVX2)
struct Avx2 {
  using V = __m256;
  static constexpr int kLanes = 8, kMR = 6;
  // AVX2 CPUs have 512 KiB L2 and less: the byte rule alone (no minimum of tiles has been timed there).
  static constexpr int64_t kABlockBytes = 384 << 10, kMinBlockTiles = 1, kMaxBlockBytes = 384 << 10;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V broadcast(float x) { return _mm256_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  template <class T> static void store_narrow(T* p, V v) { store8_from_float(p, v); }
  // A packed tile's kMR values of one k, zero in the lanes past them.
  static V load_rows(const float* p) {
    static_assert(kMR == 6, "the mask below has kMR lanes set");
    return _mm256_maskload_ps(p, _mm256_setr_epi32(-1, -1, -1, -1, -1, -1, 0, 0));
  }
};
#endif

// ---- widening into the packed layouts ---------------------------------------------------------------------

// The widened A block of a thread: rows [m0, m0 + rows) of A, padded with zero rows to whole tiles.
// Row-major (element (r, k) at [r * ld + k]) when A's k stride is 1. Otherwise packed tile by tile, k-major
// within a tile (element (kMR t + i, k) at [t * K * kMR + k * kMR + i]), so the kernel reads it as one stream.
constexpr int64_t kLines = 32;  // k lines of a transposed A widened before they are dealt out to the tiles

struct ABlock {
  float* data;
  float* lines;  // packed layout only: kLines k's rows, widened before they are dealt out to the tiles
  int64_t ld;   // row-major: the row stride; packed: kMR
  bool row_major;
};

// ld of a row-major block: K rounded up to 16 floats, plus 16 when that is a multiple of 256 floats, so the
// rows the kernel walks together do not fall into one L1 set.
int64_t row_major_ld(int64_t K) {
  int64_t ld = (K + 15) / 16 * 16;
  if (ld % 256 == 0) ld += 16;
  return ld;
}

template <class T>
void widen_a_block(const Matrix16<T>& a, int64_t m0, int64_t rows, int64_t padded_rows, int64_t K, int mr,
                   const ABlock& block) {
  if (block.row_major) {
    for (int64_t r = 0; r < rows; ++r) widen_block(a.data + (m0 + r) * a.row_stride, block.data + r * block.ld, K);
    // The padding rows' sums are never stored; zeroed so that no garbage (denormals) slows the FMAs.
    for (int64_t r = rows; r < padded_rows; ++r) std::memset(block.data + r * block.ld, 0, sizeof(float) * K);
    return;
  }
  // a.row_stride == 1: at each k the block's rows are one contiguous run. kLines of them are widened whole
  // into `lines`, then dealt out tile by tile, so that each tile's part is written as one run (dealing out
  // each k on its own wrote 48 bytes to every tile in turn, K * 48 bytes apart: a fifth of the packing's
  // time in the fp16 step).
  // The padding rows of each line, zeroed once: the widening below writes only the first `rows`.
  for (int64_t k = 0; k < std::min(kLines, K); ++k)
    std::fill(block.lines + k * padded_rows + rows, block.lines + (k + 1) * padded_rows, 0.0f);
  for (int64_t k0 = 0; k0 < K; k0 += kLines) {
    const int64_t n = std::min(kLines, K - k0);
    for (int64_t k = 0; k < n; ++k)
      widen_block(a.data + (k0 + k) * a.col_stride + m0, block.lines + k * padded_rows, rows);
    for (int64_t r0 = 0; r0 < padded_rows; r0 += mr) {
      float* dst = block.data + r0 * K + k0 * mr;
      for (int64_t k = 0; k < n; ++k)
        std::memcpy(dst + k * mr, block.lines + k * padded_rows + r0, sizeof(float) * static_cast<size_t>(mr));
    }
  }
}

// Row k of a row-major B into every sliver: b(k, n) at packed[(n / nr) * K * nr + k * nr + n % nr].
template <class T>
void widen_b_row(const Matrix16<T>& b, int64_t K, int64_t N, int64_t k, int nr, float* packed) {
  const T* row = b.data + k * b.row_stride;
  int64_t n0 = 0;
  for (; n0 + nr <= N; n0 += nr) widen_block(row + n0, packed + n0 * K + k * nr, nr);
  if (n0 < N) {
    float* line = packed + n0 * K + k * nr;
    widen_block(row + n0, line, N - n0);
    std::fill(line + (N - n0), line + nr, 0.0f);
  }
}

// Sliver starting at column n0 of a B whose k stride is 1: column n0 + j is a contiguous run over k,
// transposed in registers into out[k * nr + j], zero for n0 + j >= N.
template <class T>
void widen_b_sliver(const Matrix16<T>& b, int64_t K, int64_t N, int64_t n0, int nr, float* out) {
  const int64_t cols = std::min<int64_t>(nr, N - n0);
  transpose_into(b.data + n0 * b.col_stride, b.col_stride, K, cols, out, nr);
  if (cols < nr)
    for (int64_t k = 0; k < K; ++k) std::fill(out + k * nr + cols, out + (k + 1) * nr, 0.0f);
}

// ---- the kernel ---------------------------------------------------------------------------------------------

// A tile of Isa::kMR rows x kVecs vectors: the sums over k of a(r, k) * sliver[k][j], plus the bias, rounded
// into out's first `rows` rows and `cols` columns. `bias` points at the sliver's part of the padded bias.
template <class Isa, class T, bool kRowMajorA, int kVecs>
void tile(int64_t K, const float* __restrict a, int64_t lda, const float* __restrict sliver, int64_t nr,
          const float* __restrict bias, int rows, int cols, T* __restrict out, int64_t ldo) {
  using V = typename Isa::V;
  constexpr int kMR = Isa::kMR, kLanes = Isa::kLanes;
  V c[kMR][kVecs];
  for (int r = 0; r < kMR; ++r)
    for (int v = 0; v < kVecs; ++v) c[r][v] = Isa::zero();
  if constexpr (kRowMajorA && kMR == 12) {
    // A row-major A read in place, 12 rows at once. Twelve row pointers are more than x86 has registers to
    // spare beside the loop's own: GCC may keep one on the stack and one in a vector register and reload both
    // every k (perf annotate), depending on unrelated code elsewhere in this file. Four pointers
    // (rows 0, 3, 6 and 9) and the row stride scaled by 1, 2, 4 or 8 in the address reach all twelve: row
    // r = kBase[r] + kScale[r], so no row pointer is reloaded inside the k loop (bench_ops' f16 rows that take
    // this kernel, one thread, Xeon without AMX: 149-159 GFLOP/s against 137-148 with twelve pointers).
    constexpr int kBase[12] = {0, 0, 0, 3, 0, 3, 6, 3, 0, 9, 6, 3};
    constexpr int kScale[12] = {0, 1, 2, 0, 4, 2, 0, 4, 8, 0, 4, 8};
    const float *p0 = a, *p3 = a + 3 * lda, *p6 = a + 6 * lda, *p9 = a + 9 * lda, *b_k = sliver;
    for (int64_t k = 0; k < K; ++k, ++p0, ++p3, ++p6, ++p9, b_k += nr) {
      V b[kVecs];
      for (int v = 0; v < kVecs; ++v) b[v] = Isa::load(b_k + kLanes * v);
#pragma GCC unroll 12
      for (int r = 0; r < kMR; ++r) {
        const float* base = kBase[r] == 0 ? p0 : kBase[r] == 3 ? p3 : kBase[r] == 6 ? p6 : p9;
        const V x = Isa::broadcast(base[kScale[r] * lda]);
        for (int v = 0; v < kVecs; ++v) c[r][v] = Isa::fma(x, b[v], c[r][v]);
      }
    }
  } else {
    const float* rows_a[kMR];
    for (int r = 0; r < kMR; ++r) rows_a[r] = kRowMajorA ? a + r * lda : a + r;
    for (int64_t k = 0; k < K; ++k) {
      V b[kVecs];
      for (int v = 0; v < kVecs; ++v) b[v] = Isa::load(sliver + k * nr + kLanes * v);
#pragma GCC unroll 12
      for (int r = 0; r < kMR; ++r) {
        const V x = Isa::broadcast(kRowMajorA ? rows_a[r][k] : a[k * lda + r]);
        for (int v = 0; v < kVecs; ++v) c[r][v] = Isa::fma(x, b[v], c[r][v]);
      }
    }
  }
  V bias_v[kVecs];
  for (int v = 0; v < kVecs; ++v) bias_v[v] = bias ? Isa::load(bias + kLanes * v) : Isa::zero();
  // Every c[r][v] is named by constants only, so the sums stay in registers: a whole tile is rounded and
  // stored straight from them; a partial one goes through a buffer of floats. (A loop up to a runtime row
  // count would index the sums with a variable and make the compiler spill every one of them to memory;
  // perf: 7.1% of the kernel's samples outside its k loop, 3.2% with constant indices, Xeon without AMX.)
  if (rows == kMR && cols == kVecs * kLanes) {
#pragma GCC unroll 12
    for (int r = 0; r < kMR; ++r)
      for (int v = 0; v < kVecs; ++v) Isa::store_narrow(out + r * ldo + kLanes * v, Isa::add(c[r][v], bias_v[v]));
    return;
  }
  alignas(64) float sums[kMR][kVecs * kLanes];
#pragma GCC unroll 12
  for (int r = 0; r < kMR; ++r)
    for (int v = 0; v < kVecs; ++v) Isa::store(sums[r] + kLanes * v, Isa::add(c[r][v], bias_v[v]));
  for (int r = 0; r < rows; ++r) narrow_block(sums[r], out + r * ldo, cols);
}

// The tile for A's layout and the sliver's width.
template <class Isa, class T>
void run_tile(bool row_major_a, int64_t K, const float* a, int64_t lda, const float* sliver, const float* bias,
              int rows, int cols, T* out, int64_t ldo) {
  constexpr int64_t nr = 2 * Isa::kLanes;
  if (cols > Isa::kLanes) {
    if (row_major_a) return tile<Isa, T, true, 2>(K, a, lda, sliver, nr, bias, rows, cols, out, ldo);
    return tile<Isa, T, false, 2>(K, a, lda, sliver, nr, bias, rows, cols, out, ldo);
  }
  if (row_major_a) return tile<Isa, T, true, 1>(K, a, lda, sliver, nr, bias, rows, cols, out, ldo);
  tile<Isa, T, false, 1>(K, a, lda, sliver, nr, bias, rows, cols, out, ldo);
}

// The first kW <= kNarrow columns of a sliver (its only ones: B's last few columns) against up to kGroup
// packed tiles of A (`rows` rows from `a`, tile g at a + g K kMR), with the vectors along A's rows: per k, one
// load of each tile's kMR values and kW broadcasts of B into kGroup kW FMAs, where the tile kernel spends kMR
// FMAs a k on each tile however narrow the sliver. The same sums (one FMA per k, in order of k, then the
// bias, one rounding), so the same bits. The kGroup chains of FMAs hide each other's latency; tiles past
// `rows` (a short last group) are read from the first one and their sums dropped, which keeps the loop's
// shape fixed at the cost of some wasted FMAs there.
// A packed (transposed) A only: a row-major A would have to be packed for it, with register transposes that
// cost more than the narrow tail saves (the vocabulary head's 2048x256x65: 228 GFLOP/s with them, 234 without).
constexpr int kNarrow = 4, kGroup = 4;

template <class Isa, class T, int kW>
void narrow_tiles(int64_t K, const float* __restrict a, const float* __restrict sliver, int64_t nr,
                  const float* __restrict bias, int rows, T* __restrict out, int64_t ldo) {
  using V = typename Isa::V;
  constexpr int kMR = Isa::kMR, kLanes = Isa::kLanes;
  const float* tiles[kGroup];
  for (int g = 0; g < kGroup; ++g) tiles[g] = g * kMR < rows ? a + g * K * kMR : a;
  V c[kGroup][kW];
  for (int g = 0; g < kGroup; ++g)
    for (int j = 0; j < kW; ++j) c[g][j] = Isa::zero();
  for (int64_t k = 0; k < K; ++k) {
    V b[kW];
    for (int j = 0; j < kW; ++j) b[j] = Isa::broadcast(sliver[k * nr + j]);
    for (int g = 0; g < kGroup; ++g) {
      const V x = Isa::load_rows(tiles[g] + k * kMR);
      for (int j = 0; j < kW; ++j) c[g][j] = Isa::fma(x, b[j], c[g][j]);
    }
  }
  alignas(64) float sums[kGroup][kW][kLanes];
  for (int g = 0; g < kGroup; ++g)
    for (int j = 0; j < kW; ++j) Isa::store(sums[g][j], Isa::add(c[g][j], Isa::broadcast(bias ? bias[j] : 0.0f)));
  for (int r = 0; r < rows; ++r) {
    float row[kW];
    for (int j = 0; j < kW; ++j) row[j] = sums[r / kMR][j][r % kMR];
    narrow_block(row, out + r * ldo, kW);
  }
}

template <class Isa, class T>
void run_narrow_tiles(int64_t K, const float* a, const float* sliver, const float* bias, int rows, int cols, T* out,
                      int64_t ldo) {
  constexpr int64_t nr = 2 * Isa::kLanes;
  static_assert(kNarrow == 4);
  switch (cols) {  // 1..kNarrow
    case 1: return narrow_tiles<Isa, T, 1>(K, a, sliver, nr, bias, rows, out, ldo);
    case 2: return narrow_tiles<Isa, T, 2>(K, a, sliver, nr, bias, rows, out, ldo);
    case 3: return narrow_tiles<Isa, T, 3>(K, a, sliver, nr, bias, rows, out, ldo);
    default: return narrow_tiles<Isa, T, 4>(K, a, sliver, nr, bias, rows, out, ldo);
  }
}

// ---- the driver ---------------------------------------------------------------------------------------------

template <class Isa, class T>
void run(int64_t M, int64_t K, int64_t N, const Matrix16<T>& a, const Matrix16<T>& b, const T* bias, T* out,
         int64_t out_row_stride) {
  constexpr int kMR = Isa::kMR, kNR = 2 * Isa::kLanes;
  const int64_t slivers = (N + kNR - 1) / kNR;
  const int64_t flops = 2 * M * K * N;
  const bool parallel = flops >= (int64_t{1} << 21) && omp_get_max_threads() > 1;
  const int threads = parallel ? omp_get_max_threads() : 1;

  // B, widened into slivers, shared by the threads; the bias widened once, padded to whole slivers.
  const Tensor b_buffer = Tensor::empty({slivers * K * kNR});
  float* packed_b = b_buffer.data<float>();
  const Tensor bias_buffer = bias ? Tensor::empty({slivers * kNR}) : Tensor();
  float* bias_f32 = bias ? bias_buffer.data<float>() : nullptr;
  if (bias) {
    widen_block(bias, bias_f32, N);
    std::fill(bias_f32 + N, bias_f32 + slivers * kNR, 0.0f);
  }

  // Each thread starts on an even share of A's tiles (WorkRanges; an even share of B's slivers when A has
  // fewer tiles than threads) and widens its tiles a block at a time.
  const bool row_major_a = a.col_stride == 1;
  const int64_t tiles = (M + kMR - 1) / kMR;
  const int64_t ld_row_major = row_major_ld(K);
  const int64_t tile_bytes = kMR * (row_major_a ? ld_row_major : K) * int64_t{sizeof(float)};
  const int64_t split_tiles = tiles >= threads ? threads : 1;
  const int64_t share = (tiles + split_tiles - 1) / split_tiles;
  const int64_t at_least = std::min(Isa::kMinBlockTiles, Isa::kMaxBlockBytes / tile_bytes);
  const int64_t tiles_per_block = std::clamp<int64_t>(std::max(Isa::kABlockBytes / tile_bytes, at_least), 1, share);
  const int64_t ld = row_major_a ? ld_row_major : kMR;
  const int64_t block_floats = tiles_per_block * tile_bytes / int64_t{sizeof(float)};
  const int64_t line_floats = row_major_a ? 0 : kLines * tiles_per_block * kMR;
  const ThreadScratch a_scratch(static_cast<size_t>(block_floats + line_floats + 32) * sizeof(float), parallel);

  // Each chunk streams all of B's slivers past its tiles again, so a share of fewer than four blocks is taken
  // in whole blocks: halved down to one tile, a small share (11 tiles a thread in the vocabulary head's weight
  // gradient, 256 x 2048 x 65 transposed, K = 2048) would end in one-tile chunks that each stream all of B
  // (Xeon without AMX, bench_ops' At_65x2048x256: 154-175 GFLOP/s so, 181-189 in whole blocks). The GPT's
  // larger products give each thread 32 to 86 tiles, and halve down to one.
  const int64_t least = share >= 4 * tiles_per_block ? 1 : tiles_per_block;
  WorkRanges tile_ranges(tiles, threads, tiles_per_block, least);
#pragma omp parallel num_threads(threads) if (parallel)
  {
    // Each thread's share of A's tiles, set before the barrier that closes B's widening.
    if (split_tiles > 1) tile_ranges.start(omp_get_thread_num(), omp_get_num_threads());
    if (b.col_stride == 1) {  // row by row, each row read once from end to end into every sliver
#pragma omp for schedule(static)
      for (int64_t k = 0; k < K; ++k) widen_b_row(b, K, N, k, kNR, packed_b);
    } else {
#pragma omp for schedule(static)
      for (int64_t s = 0; s < slivers; ++s) widen_b_sliver(b, K, N, s * kNR, kNR, packed_b + s * K * kNR);
    }
    ScratchCarver carver = a_scratch.carver();
    float* block_data = carver.take<float>(block_floats);
    float* lines = carver.take<float>(line_floats);
    const ABlock block{block_data, lines, ld, row_major_a};
    // Widens tiles [t0, t0 + count) of A and multiplies them with slivers [s_begin, s_end) of B.
    const auto multiply = [&](int64_t t0, int64_t count, int64_t s_begin, int64_t s_end) {
      const int64_t m0 = t0 * kMR;
      const int64_t rows = std::min(count * kMR, M - m0);
      const int64_t padded = (rows + kMR - 1) / kMR * kMR;
      widen_a_block(a, m0, rows, padded, K, kMR, block);
      for (int64_t s = s_begin; s < s_end; ++s) {
        const float* sliver = packed_b + s * K * kNR;
        const int cols = static_cast<int>(std::min<int64_t>(kNR, N - s * kNR));
        const float* bias_s = bias_f32 ? bias_f32 + s * kNR : nullptr;
        if (!row_major_a && cols <= kNarrow) {
          for (int64_t r0 = 0; r0 < rows; r0 += kGroup * kMR)
            run_narrow_tiles<Isa>(K, block.data + r0 * K, sliver, bias_s,
                                  static_cast<int>(std::min<int64_t>(kGroup * kMR, rows - r0)), cols,
                                  out + (m0 + r0) * out_row_stride + s * kNR, out_row_stride);
          continue;
        }
        for (int64_t r0 = 0; r0 < rows; r0 += kMR) {
          const int tile_rows = static_cast<int>(std::min<int64_t>(kMR, rows - r0));
          T* dst = out + (m0 + r0) * out_row_stride + s * kNR;
          const float* a_tile = block.data + r0 * (row_major_a ? ld : K);
          run_tile<Isa>(row_major_a, K, a_tile, ld, sliver, bias_s, tile_rows, cols, dst, out_row_stride);
        }
      }
    };
    if (split_tiles > 1) {
      int64_t t0 = 0, count = 0;
      while (tile_ranges.next(omp_get_thread_num(), t0, count)) multiply(t0, count, 0, slivers);
    } else {
      const int64_t thread = omp_get_thread_num(), team = omp_get_num_threads();
      const int64_t s_begin = slivers * thread / team, s_end = slivers * (thread + 1) / team;
      for (int64_t t0 = 0; t0 < tiles && s_begin < s_end; t0 += tiles_per_block)
        multiply(t0, std::min(tiles - t0, tiles_per_block), s_begin, s_end);
    }
  }
}

}  // namespace

const char* gemm16_isa_name(Gemm16Isa isa) {
  switch (isa) {
    case Gemm16Isa::None: return "none";
    case Gemm16Isa::Avx2: return "AVX2";
    case Gemm16Isa::Avx512: return "AVX-512";
  }
  return "?";
}

Gemm16Isa gemm16_isa_from_env(const char* value) {
  if (value == nullptr || *value == '\0') return widest_built();
  const std::string v = value;
  Gemm16Isa isa;
  if (v == "none") isa = Gemm16Isa::None;
  else if (v == "avx2") isa = Gemm16Isa::Avx2;
  else if (v == "avx512") isa = Gemm16Isa::Avx512;
  else fail("MIXTAPE_GEMM16=", v, ": expected none, avx2 or avx512");
  require_built(isa, "MIXTAPE_GEMM16=" + v);
  return isa;
}

Gemm16Isa gemm16_isa() { return chosen_isa().load(std::memory_order_relaxed); }

Gemm16Isa set_gemm16_isa(Gemm16Isa isa) {
  require_built(isa, "set_gemm16_isa");
  return chosen_isa().exchange(isa);
}

std::vector<Gemm16Isa> gemm16_kernels() {
  std::vector<Gemm16Isa> kernels;
#if defined(MIXTAPE_GEMM16_AVX512)
  kernels.push_back(Gemm16Isa::Avx512);
#endif
#if defined(MIXTAPE_GEMM16_AVX2)
  kernels.push_back(Gemm16Isa::Avx2);
#endif
  return kernels;
}

template <class T>
void gemm16(int64_t M, int64_t K, int64_t N, const Matrix16<T>& a, const Matrix16<T>& b, const T* bias, T* out,
            int64_t out_row_stride) {
  static_assert(std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>);
  const char* name = std::is_same_v<T, Half> ? "f16" : "bf16";
  if (M <= 0 || K <= 0 || N <= 0) fail("gemm16 (", name, "): M ", M, ", K ", K, ", N ", N, " must be positive");
  if (!gemm16_takes(a, b))
    fail("gemm16 (", name, "): operands need a unit stride along one dim (a strides ", a.row_stride, ", ",
         a.col_stride, "; b strides ", b.row_stride, ", ", b.col_stride, ")");
  switch (gemm16_isa()) {
#if defined(MIXTAPE_GEMM16_AVX512)
    case Gemm16Isa::Avx512: return run<Avx512>(M, K, N, a, b, bias, out, out_row_stride);
#endif
#if defined(MIXTAPE_GEMM16_AVX2)
    case Gemm16Isa::Avx2: return run<Avx2>(M, K, N, a, b, bias, out, out_row_stride);
#endif
    default:
      fail("gemm16 (", name, "): not supported: ",
           widest_built() == Gemm16Isa::None ? "this build has neither AVX2 with FMA and F16C nor AVX-512"
                                              : "switched off by set_gemm16_isa",
           " (16-bit products go through the f32 GEMM)");
  }
}

template void gemm16<Half>(int64_t, int64_t, int64_t, const Matrix16<Half>&, const Matrix16<Half>&, const Half*,
                           Half*, int64_t);
template void gemm16<BFloat16>(int64_t, int64_t, int64_t, const Matrix16<BFloat16>&, const Matrix16<BFloat16>&,
                               const BFloat16*, BFloat16*, int64_t);

}  // namespace mixtape::cpu
