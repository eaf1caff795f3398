// Causal scaled-dot-product attention on the CPU, flash-attention style (forward and backward).
//
// q, k, v, out (and grad_out, grad_q, grad_k, grad_v) are [B, H, T, D] with the head dim D contiguous (stride
// 1) and any strides sB, sH, sT for the rest: row (b, h, t) is the D values at data + b*sB + h*sH + t*sT.
// So the three thirds of a fused qkv projection [B, T, 3C], viewed as [B, T, H, D] and transposed to
// [B, H, T, D] (sB = 3TC, sH = D, sT = 3C), are read in place, and out / grad_qkv are written straight into
// [B, T, C] / [B, T, 3C] layouts: attention in a GPT needs no copies around it. Outputs must not overlap
// each other or the inputs. lse [B, H, T] is contiguous. Strides change only where rows are read and
// written, never an order of summation: strided and contiguous inputs give bitwise the same results.
//
// Each (batch, head) is a [T, D] slice. The [T, T] score matrix is
// never formed. The forward walks a block of kBlockQ query rows over the key blocks at or before its
// diagonal, keeping per row the running max m, the running sum l and the unnormalised output o in fp32
// (f64 for f64) — the online softmax:
//   s_ij = scale q_i.k_j  (j <= i);   m' = max(m, max_j s_ij);   a = e^(m - m')
//   l' = a l + sum_j e^(s_ij - m');   o' = a o + sum_j e^(s_ij - m') v_j
// and at the end out_i = o / l (rounded once to the dtype) and lse_i = m + log l.
// The backward recomputes p_ij = e^(s_ij - lse_i) block by block from q, k and lse:
//   dv_j = sum_i p_ij do_i;   dp_ij = do_i.v_j;   ds_ij = p_ij (dp_ij - delta_i),  delta_i = do_i.o_i
//   dq_i = scale sum_j ds_ij k_j;   dk_j = scale sum_i ds_ij q_i
// (delta_i = sum_j p_ij dp_ij, the softmax backward's row term, equals do_i.o_i). It loops over key blocks
// outside and query blocks inside, so dk_j and dv_j are finished in a per-thread tile and stored once; dq
// accumulates in an fp32 [T, D] buffer per thread (or per task, see the backward). Memory beyond inputs and
// outputs is O(B*H*T*D) at most (see each kernel) plus per-thread tiles of a few blocks — never O(T^2).
//
// Every block product is C (+)= A B on fp32 (f64) matrices (product_tiles below): B is row-major with a
// padded width, so the inner loop runs along contiguous memory, and a register tile of C (8 x 32 floats
// with AVX-512, 6 x 16 with AVX2: see kMaxTileRows) stays in vector registers over the whole inner
// dimension. The key block (k^T, v) is reused from cache by every query row of a block. f32 (f64) inputs
// whose D fills whole tiles are read in place, with their row stride sT as the leading dimension; other
// dtypes and widths are converted to padded fp32 (f64) rows once per head, never once per block pair.
#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "tensor/cpu/attention_bf16.h"
#include "tensor/cpu/attention_rows.h"
#include "tensor/cpu/convert_block.h"
#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/fast_math.h"
#include "tensor/cpu/lane_sum.h"
#include "tensor/cpu/transpose.h"

namespace mixtape::cpu {

namespace {

constexpr int64_t kBlockQ = 64;  // query rows per block
constexpr int64_t kBlockK = 64;  // key rows per block (a multiple of kTileCols: S tiles have no ragged edge)

// The register tile of C: kMaxTileRows rows of two vectors. Its accumulators, the row of B and one
// broadcast A value must fit in the vector registers, or the k loop spills: with AVX-512 (32 registers),
// 8 rows of 2 x 64 bytes (32 floats or 16 doubles) take 16; with AVX2 (16 registers), 6 rows of 2 x 32
// bytes (16 floats or 8 doubles) take 12. (GCC's vectoriser, left to the plain loops, tiled 8 x 32 floats
// on AVX2 too, spilling half the tile, and made a tangle of 128-bit shuffles of 6 x 16: the tile below
// is written in GCC's vector types instead, which it keeps in registers on both.)
#if defined(__AVX512F__)
constexpr int64_t kVectorBytes = 64;
constexpr int kMaxTileRows = 8;
#elif defined(__AVX__)
constexpr int64_t kVectorBytes = 32;
constexpr int kMaxTileRows = 6;
#else
constexpr int64_t kVectorBytes = 16;
constexpr int kMaxTileRows = 6;
#endif
constexpr int kTileVectors = 2;
template <class A>
constexpr int64_t kTileCols = kTileVectors * kVectorBytes / static_cast<int64_t>(sizeof(A));
static_assert(kBlockK % kTileCols<float> == 0 && kBlockK % kTileCols<double> == 0);

inline int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// C[R x kTileCols] (row stride ldc) = (Accumulate ? C : 0) + sum_k A(r, k) B[k, :], with
// A(r, k) = a[r * a_rs + k * a_cs] (so A may be read transposed) and B row-major (row stride ldb). The
// accumulator tile lives in vector registers for the whole k loop (R <= kMaxTileRows, see above). Each
// element is acc += A(r, k) * B(k, j) in k order (one fused multiply-add, as the scalar loop contracts to),
// so the result does not depend on R or on the vector width.
template <class A, int R, bool Accumulate>
inline void product_tile(int64_t K, const A* __restrict a, int64_t a_rs, int64_t a_cs, const A* __restrict b,
                         int64_t ldb, A* __restrict c, int64_t ldc) {
  typedef A V __attribute__((vector_size(kVectorBytes)));
  // The same vector as it may lie in memory: aligned only as A is (GCC's unaligned vector access). Memory
  // is read and written through it, never through the address of an accumulator, which would make GCC
  // keep the tile on the stack.
  typedef A Unaligned __attribute__((vector_size(kVectorBytes), aligned(alignof(A))));
  constexpr int64_t L = kVectorBytes / static_cast<int64_t>(sizeof(A));  // lanes per vector
  auto at = [](const A* p) { return *reinterpret_cast<const Unaligned*>(p); };
  V acc[R][kTileVectors];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kTileVectors; ++v) acc[r][v] = Accumulate ? at(c + r * ldc + v * L) : V{};
  for (int64_t k = 0; k < K; ++k) {
    V bk[kTileVectors];
    for (int v = 0; v < kTileVectors; ++v) bk[v] = at(b + k * ldb + v * L);
    for (int r = 0; r < R; ++r) {
      const A ark = a[r * a_rs + k * a_cs];
      for (int v = 0; v < kTileVectors; ++v) acc[r][v] += ark * bk[v];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kTileVectors; ++v) *reinterpret_cast<Unaligned*>(c + r * ldc + v * L) = acc[r][v];
}

// What a block product may skip under the causal mask. Within a block pair whose query rows start `offset`
// = i0 - j0 (>= 0) rows after its key rows, query row r sees key c when c <= r + offset; the probabilities
// (and their gradients) of the keys it does not see are zero.
enum class Causal {
  None,          // every entry
  ColsAfterRow,  // C = scores [queries x keys]: a tile whose rows see none of its columns is not computed
                 // (left unwritten: callers read only the keys a row sees)
  KAfterRow,     // C = [queries x D] summed over keys k: row r's sum stops after key r + offset
  KBeforeRow,    // C = [keys x D] summed over queries k: row r's sum starts at query r - offset
};

// C[M x N] (+)= A[M x K] B[K x N] with N a multiple of kTileCols (buffers are padded): tiles of
// kMaxTileRows rows, then 4, then the last 1..3. Each element of C is a sum over k in order whatever the
// tiling, so the forward and the backward compute bitwise the same scores. Under a causal mask a tile's k
// range is cut to where A's entries can be nonzero (the zero terms it leaves out change no sum) and tiles
// of masked scores are skipped: a diagonal block pair does about half the work of a full one.
template <bool Accumulate, class A>
void product_tiles(int64_t M, int64_t N, int64_t K, const A* a, int64_t a_rs, int64_t a_cs, const A* b,
                   int64_t ldb, A* c, int64_t ldc, Causal causal = Causal::None, int64_t offset = 0) {
  for (int64_t j0 = 0; j0 < N; j0 += kTileCols<A>) {
    // The tile of R rows from row i0.
    auto tile = [&]<int R>(int64_t i0) {
      int64_t k_lo = 0, k_hi = K;
      switch (causal) {
        case Causal::None:
          break;
        case Causal::ColsAfterRow:
          if (i0 + R - 1 + offset < j0) return;
          break;
        case Causal::KAfterRow:
          k_hi = std::clamp<int64_t>(i0 + R + offset, 0, K);
          break;
        case Causal::KBeforeRow:
          k_lo = std::clamp<int64_t>(i0 - offset, 0, K);
          break;
      }
      if (Accumulate && k_lo == k_hi) return;
      product_tile<A, R, Accumulate>(k_hi - k_lo, a + i0 * a_rs + k_lo * a_cs, a_rs, a_cs, b + k_lo * ldb + j0,
                                     ldb, c + i0 * ldc + j0, ldc);
    };
    int64_t i0 = 0;
    for (; i0 + kMaxTileRows <= M; i0 += kMaxTileRows) tile.template operator()<kMaxTileRows>(i0);
    if (M - i0 >= 4) {
      tile.template operator()<4>(i0);
      i0 += 4;
    }
    switch (M - i0) {
      case 3:
        tile.template operator()<3>(i0);
        break;
      case 2:
        tile.template operator()<2>(i0);
        break;
      case 1:
        tile.template operator()<1>(i0);
        break;
      default:
        break;
    }
  }
}

// A [B, H, T, D] operand of the kernels: row (b, h, t) = the D contiguous values at
// data + b*sB + h*sH + t*sT. Heads are numbered bh = b*H + h.
template <class T>
struct Heads {
  T* data;
  int64_t H, sB, sH, sT;
  T* head(int64_t bh) const { return data + (bh / H) * sB + (bh % H) * sH; }  // row (b, h, 0)
  T* row(int64_t bh, int64_t t) const { return head(bh) + t * sT; }
};

template <class T>
Heads<T> heads_of(const Tensor& t) {
  return {t.data<std::remove_const_t<T>>(), t.size(1), t.stride(0), t.stride(1), t.stride(2)};
}

// A row-major matrix of A with leading dimension ld (row r at data + r * ld).
template <class A>
struct Rows {
  const A* data;
  int64_t ld;
};

// Runs of 16-bit values to and from float (A = float for them) go through one vectorised conversion
// (tensor/cpu/convert_block.h): converting element by element in these loops keeps them scalar (fp16's F16C
// instruction has no scalar form the compiler vectorises), which made fp16 attention twice as slow as f32's.
// Same values either way.
// dst[0, n) = src[0, n) as A.
template <class T, class A>
void load_run(const T* __restrict src, A* __restrict dst, int64_t n) {
  if constexpr (kSixteenBit<T>)
    widen_block(src, dst, n);
  else
    for (int64_t d = 0; d < n; ++d) dst[d] = convert<A>(src[d]);
}

// dst[r, d] = src[r * ld_src + d] for r < rows, d < D; columns D..Dp-1 are zero (padding that products read).
template <class T, class A>
void load_rows(const T* __restrict src, int64_t ld_src, int64_t rows, int64_t D, A* __restrict dst,
               int64_t Dp) {
  for (int64_t r = 0; r < rows; ++r) {
    load_run(src + r * ld_src, dst + r * Dp, D);
    for (int64_t d = D; d < Dp; ++d) dst[r * Dp + d] = A(0);
  }
}

// Whether [rows, D] rows of T must be copied to serve as a row-major [rows, Dp] matrix of A.
template <class T, class A>
bool needs_copy(int64_t D, int64_t Dp) {
  return !std::is_same_v<T, A> || D != Dp;
}

// The [rows, D] rows at src (row stride ld_src) as a row-major matrix of A with Dp columns: src itself, with
// its own row stride, when it already is one (f32 or f64 with D a multiple of kTileCols), else a converted,
// zero-padded [rows, Dp] copy in `buffer`.
template <class T, class A>
Rows<A> rows_in_acc(const T* src, int64_t ld_src, int64_t rows, int64_t D, int64_t Dp, A* buffer) {
  if constexpr (std::is_same_v<T, A>)
    if (D == Dp) return {src, ld_src};
  load_rows(src, ld_src, rows, D, buffer, Dp);
  return {buffer, Dp};
}

// dst[d, c] = src[c * ld_src + d] for c < cols, zero for cols <= c < ld: keys as the B operand of q k^T.
// Element by element, the strided stores made this copy a tenth of the attention's time; transpose_into
// (tensor/cpu/transpose.h) goes through 8 x 8 register transposes.
template <class T, class A>
void load_transposed(const T* __restrict src, int64_t ld_src, int64_t cols, int64_t D, A* __restrict dst,
                     int64_t ld) {
  for (int64_t d = 0; d < D; ++d) std::fill(dst + d * ld + cols, dst + (d + 1) * ld, A(0));
  transpose_into(src, ld_src, D, cols, dst, ld);
}

// Run a loop in parallel only when it has enough work to pay for waking the threads.
inline bool worth_parallel(int64_t tasks, int64_t BH, int64_t T, int64_t D) {
  return tasks > 1 && BH * T * T * D >= (int64_t{1} << 20);
}

// For query row i (absolute) and the key block starting at j0 with `cols` keys: how many keys it may see.
inline int64_t visible_keys(int64_t i, int64_t j0, int64_t cols) {
  return std::clamp<int64_t>(i - j0 + 1, 0, cols);
}

}  // namespace

// ---- forward ---------------------------------------------------------------------------------------------

void CpuBackend::causal_attention_kernel(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                                         const Tensor& out, const Tensor& lse) {
  const char* op = "causal_attention";
  const int64_t B = q.shape()[0], H = q.shape()[1], T = q.shape()[2], D = q.shape()[3];
  // bf16 on a CPU with AMX or AVX512-BF16: tensor/cpu/attention_bf16.cpp
  if (const Bf16AttentionKernel kernel = bf16_attention_kernel_for(q.dtype(), D);
      kernel != Bf16AttentionKernel::Portable) {
    bf16_causal_attention(kernel, q, k, v, scale, out, lse);
    return;
  }
  dispatch_float(q.dtype(), op, [&]<typename T_>() {
    using A = acc_t<T_>;
    const int64_t Dp = round_up(std::max<int64_t>(D, 1), kTileCols<A>);  // padded width of row-major tiles
    const int64_t BH = B * H, query_blocks = (T + kBlockQ - 1) / kBlockQ;
    const int64_t tasks = BH * query_blocks;
    const bool parallel = worth_parallel(tasks, BH, T, D);
    const A scale_a = static_cast<A>(scale);
    const Heads<const T_> qh = heads_of<const T_>(q), kh = heads_of<const T_>(k), vh = heads_of<const T_>(v);
    const Heads<T_> oh = heads_of<T_>(out);
    A* lse_out = lse.data<A>();
    // Every query block of a head reads all the head's earlier key blocks, so k and v are prepared once up
    // front: k^T as [BH, D, Tp] (keys padded to whole blocks with zeros: score tiles are kBlockK wide) and v
    // as [BH * T, Dp] (or v itself, in place, when its rows already are that). At most twice the input's
    // size; freed on return.
    const int64_t Tp = round_up(T, kBlockK);
    const Tensor kt_tensor = Tensor::empty({BH * D * Tp}, dtype_of<A>::value);
    const bool copy_v = needs_copy<T_, A>(D, Dp);
    const Tensor vs_tensor = Tensor::empty({copy_v ? BH * T * Dp : 0}, dtype_of<A>::value);
    A* kt_all = kt_tensor.data<A>();
    A* vs_copy = vs_tensor.data<A>();
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t bh = 0; bh < BH; ++bh) {
      load_transposed(kh.head(bh), kh.sT, T, D, kt_all + bh * D * Tp, Tp);
      if (copy_v) load_rows(vh.head(bh), vh.sT, T, D, vs_copy + bh * T * Dp, Dp);
    }
    // Head bh's v as a [T, Dp] matrix of A.
    auto v_rows = [&](int64_t bh) -> Rows<A> {
      if (copy_v) return {vs_copy + bh * T * Dp, Dp};
      return rows_in_acc(vh.head(bh), vh.sT, T, D, Dp, static_cast<A*>(nullptr));  // in place: no copy
    };
#pragma omp parallel if (parallel)
    {
      std::vector<A> q_copy(needs_copy<T_, A>(D, Dp) ? kBlockQ * Dp : 0);
      std::vector<A> o(kBlockQ * Dp), s(kBlockQ * kBlockK), m(kBlockQ), l(kBlockQ);
      // Tasks run from the last query block (the most key blocks) to the first, for a balanced finish.
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < tasks; ++task) {
        const int64_t qb = query_blocks - 1 - task / BH, bh = task % BH;
        const int64_t i0 = qb * kBlockQ, rows = std::min(kBlockQ, T - i0);
        const Rows<A> qs = rows_in_acc(qh.row(bh, i0), qh.sT, rows, D, Dp, q_copy.data());
        const Rows<A> vr = v_rows(bh);
        std::fill(o.begin(), o.end(), A(0));
        std::fill(m.begin(), m.end(), -std::numeric_limits<A>::infinity());
        std::fill(l.begin(), l.end(), A(0));
        for (int64_t j0 = 0; j0 < i0 + rows; j0 += kBlockK) {
          const int64_t cols = std::min({kBlockK, T - j0, i0 + rows - j0});
          const A* kt = kt_all + bh * D * Tp + j0;  // [D, kBlockK] block of k^T, row stride Tp
          const A* vs = vr.data + j0 * vr.ld;       // [cols, Dp] block of v, row stride vr.ld
          // s = q k^T for the block (scaled below).
          product_tiles<false>(rows, kBlockK, D, qs.data, qs.ld, 1, kt, Tp, s.data(), kBlockK, Causal::ColsAfterRow,
                               i0 - j0);
          // Online softmax: turn each row of s into e^(scale s - m') in place (0 where the mask hides a key).
          for (int64_t r = 0; r < rows; ++r) {
            A* sr = s.data() + r * kBlockK;
            const int64_t n = visible_keys(i0 + r, j0, cols);
#pragma omp simd
            for (int64_t c = 0; c < n; ++c) sr[c] *= scale_a;
            const A block_max = lane_max(sr, n);
            const A m_new = std::max(m[r], block_max);
            A block_sum = 0;
#pragma omp simd reduction(+ : block_sum)
            for (int64_t c = 0; c < n; ++c) {
              sr[c] = fast_exp(sr[c] - m_new);
              block_sum += sr[c];
            }
            std::fill(sr + n, sr + cols, A(0));
            // Rescale what earlier blocks accumulated to the new max (a = 0 on the first block: m = -inf).
            const A a = n > 0 ? fast_exp(m[r] - m_new) : A(1);
            if (a != A(1)) {
              A* orow = o.data() + r * Dp;
              for (int64_t d = 0; d < Dp; ++d) orow[d] *= a;
            }
            l[r] = l[r] * a + block_sum;
            m[r] = m_new;
          }
          // o += p v
          product_tiles<true>(rows, Dp, cols, s.data(), kBlockK, 1, vs, vr.ld, o.data(), Dp, Causal::KAfterRow,
                              i0 - j0);
        }
        for (int64_t r = 0; r < rows; ++r) {
          // Row i sees key 0 at least, so l >= 1 (the max term is e^0) and the division is safe.
          const A inv_l = A(1) / l[r];
          store_scaled_run(o.data() + r * Dp, inv_l, oh.row(bh, i0 + r), D);
          lse_out[bh * T + i0 + r] = m[r] + std::log(l[r]);
        }
      }
    }
  });
}

// ---- backward --------------------------------------------------------------------------------------------

void CpuBackend::causal_attention_backward_kernel(const Tensor& grad_out, const Tensor& q, const Tensor& k,
                                                  const Tensor& v, const Tensor& out, const Tensor& lse, double scale,
                                                  const Tensor& grad_q, const Tensor& grad_k, const Tensor& grad_v) {
  const char* op = "causal_attention_backward";
  const int64_t B = q.shape()[0], H = q.shape()[1], T = q.shape()[2], D = q.shape()[3];
  if (const Bf16AttentionKernel kernel = bf16_attention_kernel_for(q.dtype(), D);
      kernel != Bf16AttentionKernel::Portable) {
    bf16_causal_attention_backward(kernel, grad_out, q, k, v, out, lse, scale, grad_q, grad_k, grad_v);
    return;
  }
  dispatch_float(q.dtype(), op, [&]<typename T_>() {
    using A = acc_t<T_>;
    const int64_t Dp = round_up(std::max<int64_t>(D, 1), kTileCols<A>);
    const int64_t BH = B * H, key_blocks = (T + kBlockK - 1) / kBlockK;
    const Heads<const T_> qh = heads_of<const T_>(q), kh = heads_of<const T_>(k), vh = heads_of<const T_>(v);
    const Heads<const T_> goh = heads_of<const T_>(grad_out), oh = heads_of<const T_>(out);
    const Heads<T_> gqh = heads_of<T_>(grad_q), gkh = heads_of<T_>(grad_k), gvh = heads_of<T_>(grad_v);
    const A* lse_in = lse.data<A>();
    const A scale_a = static_cast<A>(scale);

    // A task is one head's key blocks kb = group, group + groups, ... With few heads, each head's key
    // blocks are split into interleaved groups (causal work shrinks with kb; interleaving balances it) so
    // there are at least kMinTasks tasks; each group then owns a dq partial, summed in group order after. The
    // split depends on the shape only, so results are bitwise the same for any thread count.
    constexpr int64_t kMinTasks = 4;
    const int64_t groups = std::clamp<int64_t>((kMinTasks + BH - 1) / std::max<int64_t>(BH, 1), 1,
                                               std::max<int64_t>(key_blocks, 1));
    const int64_t tasks = BH * groups;
    const bool parallel = worth_parallel(tasks, BH, T, D);
    const int64_t threads = parallel ? omp_get_max_threads() : 1;

    // delta_i = do_i . o_i, one per query row.
    const Tensor delta_tensor = Tensor::empty({BH * T}, dtype_of<A>::value);
    A* delta = delta_tensor.data<A>();
#pragma omp parallel if (parallel)
    {
      std::vector<A> gor(kSixteenBit<T_> ? D : 0), outr(gor.size());
#pragma omp for schedule(static)
      for (int64_t bh = 0; bh < BH; ++bh)
        for (int64_t i = 0; i < T; ++i) {
          const A* g_row;
          const A* o_row;
          if constexpr (kSixteenBit<T_>) {
            load_run(goh.row(bh, i), gor.data(), D);
            load_run(oh.row(bh, i), outr.data(), D);
            g_row = gor.data();
            o_row = outr.data();
          } else {
            static_assert(std::is_same_v<T_, A>, "attention computes 16-bit inputs in float, others in place");
            g_row = goh.row(bh, i);
            o_row = oh.row(bh, i);
          }
          A sum = 0;
#pragma omp simd reduction(+ : sum)
          for (int64_t d = 0; d < D; ++d) sum += g_row[d] * o_row[d];
          delta[bh * T + i] = sum;
        }
    }
    // fp32 [T, Dp] dq accumulators: one per thread (stored at the end of each task) when groups == 1, else
    // one per task. When q, do and k are not already [T, Dp] matrices of A, each thread also converts its
    // head's q, do and k once per task (three [T, Dp] copies per thread).
    const int64_t accumulators = groups == 1 ? threads : tasks;
    const Tensor dq_tensor = Tensor::empty({accumulators * T * Dp}, dtype_of<A>::value);
    A* dq_all = dq_tensor.data<A>();
    const bool copy = needs_copy<T_, A>(D, Dp);
    const Tensor head_copies = Tensor::empty({copy ? threads * 3 * T * Dp : 0}, dtype_of<A>::value);

#pragma omp parallel if (parallel)
    {
      std::vector<A> kt(D * kBlockK), vt(D * kBlockK), p(kBlockQ * kBlockK), ds(kBlockQ * kBlockK);
      std::vector<A> dk(kBlockK * Dp), dv(kBlockK * Dp);
      A* copies = copy ? head_copies.data<A>() + omp_get_thread_num() * 3 * T * Dp : nullptr;
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < tasks; ++task) {
        const int64_t bh = task / groups, group = task % groups;
        const Rows<A> qm = rows_in_acc(qh.head(bh), qh.sT, T, D, Dp, copies);
        const Rows<A> dom = rows_in_acc(goh.head(bh), goh.sT, T, D, Dp, copy ? copies + T * Dp : nullptr);
        const Rows<A> km = rows_in_acc(kh.head(bh), kh.sT, T, D, Dp, copy ? copies + 2 * T * Dp : nullptr);
        A* dq = dq_all + (groups == 1 ? omp_get_thread_num() : task) * T * Dp;
        std::fill(dq, dq + T * Dp, A(0));
        for (int64_t kb = group; kb < key_blocks; kb += groups) {
          const int64_t j0 = kb * kBlockK, cols = std::min(kBlockK, T - j0);
          load_transposed(kh.row(bh, j0), kh.sT, cols, D, kt.data(), kBlockK);
          load_transposed(vh.row(bh, j0), vh.sT, cols, D, vt.data(), kBlockK);
          std::fill(dk.begin(), dk.end(), A(0));
          std::fill(dv.begin(), dv.end(), A(0));
          // Query blocks that see this key block: those ending at or after j0.
          for (int64_t i0 = j0 / kBlockQ * kBlockQ; i0 < T; i0 += kBlockQ) {
            const int64_t rows = std::min(kBlockQ, T - i0);
            const A* qs = qm.data + i0 * qm.ld;
            const A* dos = dom.data + i0 * dom.ld;
            // p = e^(scale q k^T - lse) (0 where masked): the forward's probabilities, recomputed.
            product_tiles<false>(rows, kBlockK, D, qs, qm.ld, 1, kt.data(), kBlockK, p.data(), kBlockK,
                                 Causal::ColsAfterRow, i0 - j0);
            // dp = do v^T
            product_tiles<false>(rows, kBlockK, D, dos, dom.ld, 1, vt.data(), kBlockK, ds.data(), kBlockK,
                                 Causal::ColsAfterRow, i0 - j0);
            for (int64_t r = 0; r < rows; ++r) {
              const int64_t i = i0 + r, n = visible_keys(i, j0, cols);
              const A row_lse = lse_in[bh * T + i], row_delta = delta[bh * T + i];
              probabilities_and_gradient_row(p.data() + r * kBlockK, ds.data() + r * kBlockK, n, kBlockK, scale_a,
                                             row_lse, row_delta);
            }
            // dv += p^T do;  dk += ds^T q;  dq += ds k  (dk and dq are scaled on store)
            product_tiles<true>(cols, Dp, rows, p.data(), 1, kBlockK, dos, dom.ld, dv.data(), Dp, Causal::KBeforeRow,
                                i0 - j0);
            product_tiles<true>(cols, Dp, rows, ds.data(), 1, kBlockK, qs, qm.ld, dk.data(), Dp, Causal::KBeforeRow,
                                i0 - j0);
            product_tiles<true>(rows, Dp, cols, ds.data(), kBlockK, 1, km.data + j0 * km.ld, km.ld,
                                dq + i0 * Dp, Dp, Causal::KAfterRow, i0 - j0);
          }
          for (int64_t c = 0; c < cols; ++c) {
            store_scaled_run(dk.data() + c * Dp, scale_a, gkh.row(bh, j0 + c), D);
            store_scaled_run(dv.data() + c * Dp, A(1), gvh.row(bh, j0 + c), D);
          }
        }
        if (groups == 1)
          for (int64_t i = 0; i < T; ++i) {
            store_scaled_run(dq + i * Dp, scale_a, gqh.row(bh, i), D);
          }
      }
    }
    if (groups > 1) {
      // dq_i = scale * sum over groups (in group order) of the partials.
#pragma omp parallel for schedule(static) if (parallel)
      for (int64_t row = 0; row < BH * T; ++row) {
        const int64_t bh = row / T, i = row % T;
        T_* gq = gqh.row(bh, i);
        for (int64_t d = 0; d < D; ++d) {
          A sum = 0;
          for (int64_t g = 0; g < groups; ++g) sum += dq_all[((bh * groups + g) * T + i) * Dp + d];
          gq[d] = convert<T_>(scale_a * sum);
        }
      }
    }
  });
}

}  // namespace mixtape::cpu
