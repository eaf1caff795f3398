// Causal scaled-dot-product attention on CUDA, flash-attention style (forward and backward): the [T, T]
// score matrix is never formed; the math is the CPU kernel's (tensor/cpu/attention.cpp), in fp32 for
// f16/bf16/f32 and in f64 for f64, with one rounding of every stored output.
//
// Operands q, k, v, out, grad_out, grad_q/k/v are [B, H, T, D] with the head dim contiguous and any strides
// sB, sH, sT for the rest (row (b, h, t) = the D values at data + b*sB + h*sH + t*sT), so the thirds of a
// fused qkv [B, T, 3C] are read, and grads written, in place. lse [B, H, T] is contiguous.
//
// Layout of the work (SIMT, no tensor cores). A block owns 64 rows of one head (bh = b*H + h): query rows
// (forward, dq) or key rows (dk, dv). Each row belongs to a group of kGroup = 4 adjacent lanes; lane g of the
// group keeps the DMAX / 4 dims d = 16 e4 + 4 g + u (e4 < DMAX/16, u < 4) of that row's vectors in
// registers. The other side of the product is streamed through shared memory in tiles of rows converted to
// the accumulation type A and zero-padded to DMAX columns (and to whole tiles), so every lane reads whole
// 16-byte vectors and all rows of a warp read the same tile row (a broadcast). A dot product is the four
// lanes' partial sums combined by two xor shuffles (addition commutes, so all four lanes hold the same
// bits). DMAX is the head dim rounded up to 32, 64 or 128 (D <= 128).
//
// Forward (one block per (bh, query tile)): key/value tiles at or before the diagonal stream through shared
// memory; per query row the online softmax keeps the running max m, the running sum l and the unnormalised
// output o in registers (A):
//   s = scale q_i.k_j;  if s > m: a = e^(m - s), l *= a, o *= a, m = s;   p = e^(s - m), l += p, o += p v_j
// and at the end out_i = o / l (rounded once) and lse_i = m + log l.
// Backward (FlashAttention-2, deterministic: no atomics): delta_i = do_i.o_i by a small kernel; then
//   dk/dv kernel, one block per (bh, key tile): key row j keeps k_j, v_j, dk_j, dv_j in registers and streams
//     the query rows i >= j (q, do, lse, delta) through shared memory:
//       p = e^(scale q_i.k_j - lse_i);  ds = p (do_i.v_j - delta_i);  dv_j += p do_i;  dk_j += ds q_i
//   dq kernel, one block per (bh, query tile): query row i keeps q_i, do_i, dq_i in registers and streams the
//     key rows j <= i (k, v):  dq_i += ds k_j.
//   dk and dq are scaled by `scale` on store. Scores and probabilities are recomputed in both kernels with
//   the same summation order (bitwise the same p), and every sum runs in a fixed order: two runs give the
//   same bits.
#include <mma.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "tensor/cuda/common.cuh"
#include "tensor/cuda/cuda_backend.h"

namespace mixtape::cuda {

namespace {

constexpr int kGroup = 4;                              // lanes per row
constexpr int kRowsPerBlock = 64;                      // rows a block keeps in registers
constexpr int kBlockThreads = kGroup * kRowsPerBlock;  // 256
constexpr int kMaxHeadDim = 128;
constexpr int kStreamBytes = 32 * 1024;  // the two streamed tiles together (static shared memory <= 48 KiB)

// Rows per streamed tile: two [rows, DMAX] tiles of A fit in kStreamBytes (at most 64 rows).
template <class A, int DMAX>
__host__ __device__ constexpr int stream_rows() {
  constexpr int rows = kStreamBytes / (2 * DMAX * static_cast<int>(sizeof(A)));
  return rows < 64 ? rows : 64;
}

// A [B, H, T, D] operand: row (bh, t) at data + (bh / H) * sB + (bh % H) * sH + t * sT.
template <class Dt>
struct Heads {
  Dt* data;
  int64_t H, sB, sH, sT;
  __device__ __forceinline__ Dt* head(int64_t bh) const { return data + (bh / H) * sB + (bh % H) * sH; }
};

template <class Dt>
Heads<Dt> heads_of(const Tensor& t) {
  return {reinterpret_cast<Dt*>(t.data_ptr()), t.size(1), t.stride(0), t.stride(1), t.stride(2)};
}

__device__ __forceinline__ float exp_acc(float x) { return expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }
__device__ __forceinline__ float log_acc(float x) { return logf(x); }
__device__ __forceinline__ double log_acc(double x) { return log(x); }

// Four consecutive A from 16-byte aligned shared memory.
template <class A>
struct Four {
  A x[4];
};
__device__ __forceinline__ Four<float> load4(const float* p) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  return {{v.x, v.y, v.z, v.w}};
}
__device__ __forceinline__ Four<double> load4(const double* p) {
  const double2 a = reinterpret_cast<const double2*>(p)[0];
  const double2 b = reinterpret_cast<const double2*>(p)[1];
  return {{a.x, a.y, b.x, b.y}};
}

// The dim that lane g's register e (< DMAX / kGroup) holds: 16-dim chunks, 4 consecutive dims per lane.
__device__ __forceinline__ int dim_of(int g, int e) { return (e / 4) * (4 * kGroup) + g * 4 + e % 4; }

// Lane g's part of x . row, where x holds the lane's dims (dim_of) and row is a padded tile row.
template <int E, class A>
__device__ __forceinline__ A partial_dot(const A (&x)[E], const A* row, int g) {
  A acc = 0;
#pragma unroll
  for (int e4 = 0; e4 < E / 4; ++e4) {
    const Four<A> y = load4(row + e4 * 4 * kGroup + g * 4);
#pragma unroll
    for (int u = 0; u < 4; ++u) acc = fma(x[e4 * 4 + u], y.x[u], acc);
  }
  return acc;
}

// acc += alpha * row on the lane's dims.
template <int E, class A>
__device__ __forceinline__ void axpy(A (&acc)[E], A alpha, const A* row, int g) {
#pragma unroll
  for (int e4 = 0; e4 < E / 4; ++e4) {
    const Four<A> y = load4(row + e4 * 4 * kGroup + g * 4);
#pragma unroll
    for (int u = 0; u < 4; ++u) acc[e4 * 4 + u] = fma(alpha, y.x[u], acc[e4 * 4 + u]);
  }
}

// The sum of a value over the kGroup lanes of a row (the same bits in all four). Every lane of the warp must
// call it (it is only called from block-uniform loops).
template <class A>
__device__ __forceinline__ A group_sum(A x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}

// Rows r0 .. r0 + R - 1 of a head (row t at head + t * sT) into tile [R, DMAX] as A: zero past T and past D.
template <int R, int DMAX, class Dt, class A>
__device__ __forceinline__ void load_tile(A* tile, const Dt* head, int64_t sT, int64_t r0, int64_t T, int D) {
  for (int index = threadIdx.x; index < R * DMAX; index += blockDim.x) {
    const int r = index / DMAX, d = index % DMAX;
    A value = 0;
    if (d < D && r0 + r < T) value = load_as<A>(head[(r0 + r) * sT + d]);
    tile[index] = value;
  }
}

// The lane's dims of row t of a head into registers (zero past D, or everywhere when !valid).
template <int E, class Dt, class A>
__device__ __forceinline__ void load_row(A (&x)[E], const Dt* row, bool valid, int D, int g) {
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int d = dim_of(g, e);
    x[e] = valid && d < D ? load_as<A>(row[d]) : A(0);
  }
}

// row[d] = scale * x on the lane's dims below D, rounded once.
template <int E, class Dt, class A>
__device__ __forceinline__ void store_row(Dt* row, const A (&x)[E], A scale, int D, int g) {
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int d = dim_of(g, e);
    if (d < D) row[d] = store<Dt>(scale * x[e]);
  }
}

// Blocks run the heaviest tiles first: for the forward and dq, the last query tile (it sees the most keys).
__device__ __forceinline__ int64_t last_first_tile() {
  return static_cast<int64_t>(gridDim.y - 1 - blockIdx.y) * kRowsPerBlock;
}

// ---- forward --------------------------------------------------------------------------------------------

template <class Dt, int DMAX>
__global__ void __launch_bounds__(kBlockThreads)
    attention_forward_kernel(Heads<const Dt> q, Heads<const Dt> k, Heads<const Dt> v, Heads<Dt> out,
                             device_acc_t<Dt>* __restrict__ lse, int64_t T, int D, device_acc_t<Dt> scale) {
  using A = device_acc_t<Dt>;
  constexpr int E = DMAX / kGroup;
  constexpr int BK = stream_rows<A, DMAX>();
  __shared__ __align__(16) A k_tile[BK * DMAX];
  __shared__ __align__(16) A v_tile[BK * DMAX];

  const int64_t bh = blockIdx.x, i0 = last_first_tile();
  const int g = threadIdx.x % kGroup;
  const int64_t i = i0 + threadIdx.x / kGroup;
  const bool valid = i < T;
  const Dt* k_head = k.head(bh);
  const Dt* v_head = v.head(bh);

  A qr[E], o[E];
  load_row(qr, q.head(bh) + (valid ? i : 0) * q.sT, valid, D, g);
#pragma unroll
  for (int e = 0; e < E; ++e) o[e] = 0;
  A m = -static_cast<A>(INFINITY), l = 0;

  const int64_t key_end = T < i0 + kRowsPerBlock ? T : i0 + kRowsPerBlock;  // keys this block's rows see
  for (int64_t j0 = 0; j0 < key_end; j0 += BK) {
    __syncthreads();  // every row is done with the previous tiles
    load_tile<BK, DMAX>(k_tile, k_head, k.sT, j0, T, D);
    load_tile<BK, DMAX>(v_tile, v_head, v.sT, j0, T, D);
    __syncthreads();
    const int cols = static_cast<int>(key_end - j0 < BK ? key_end - j0 : BK);
    for (int c = 0; c < cols; ++c) {
      const A s = group_sum(partial_dot(qr, k_tile + c * DMAX, g)) * scale;
      if (valid && j0 + c <= i) {
        if (s > m) {  // a new running max: rescale what is accumulated (a = 0 on the first key: m = -inf)
          const A a = exp_acc(m - s);
          l *= a;
#pragma unroll
          for (int e = 0; e < E; ++e) o[e] *= a;
          m = s;
        }
        const A p = exp_acc(s - m);
        l += p;
        axpy(o, p, v_tile + c * DMAX, g);
      }
    }
  }
  if (valid) {
    // Row i sees key 0 at least, so l >= 1 (the max term is e^0).
    store_row(out.head(bh) + i * out.sT, o, A(1) / l, D, g);
    if (g == 0) lse[bh * T + i] = m + log_acc(l);
  }
}

// ---- backward --------------------------------------------------------------------------------------------

// delta_i = do_i . o_i in A: one warp per row.
template <class Dt>
__global__ void attention_delta_kernel(Heads<const Dt> grad_out, Heads<const Dt> out,
                                       device_acc_t<Dt>* __restrict__ delta, int64_t rows, int64_t T, int D) {
  using A = device_acc_t<Dt>;
  const int lane = threadIdx.x % 32;
  const int64_t warps_per_block = blockDim.x / 32;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * warps_per_block;
  for (int64_t row = blockIdx.x * warps_per_block + threadIdx.x / 32; row < rows; row += stride) {
    const int64_t bh = row / T, i = row % T;
    const Dt* a = grad_out.head(bh) + i * grad_out.sT;
    const Dt* b = out.head(bh) + i * out.sT;
    A sum = 0;
    for (int d = lane; d < D; d += 32) sum = fma(load_as<A>(a[d]), load_as<A>(b[d]), sum);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) delta[row] = sum;
  }
}

// dk, dv for one key tile of one head.
template <class Dt, int DMAX>
__global__ void __launch_bounds__(kBlockThreads)
    attention_backward_dkdv_kernel(Heads<const Dt> q, Heads<const Dt> k, Heads<const Dt> v,
                                   Heads<const Dt> grad_out, const device_acc_t<Dt>* __restrict__ lse,
                                   const device_acc_t<Dt>* __restrict__ delta, Heads<Dt> grad_k,
                                   Heads<Dt> grad_v, int64_t T, int D, device_acc_t<Dt> scale) {
  using A = device_acc_t<Dt>;
  constexpr int E = DMAX / kGroup;
  constexpr int BQ = stream_rows<A, DMAX>();
  __shared__ __align__(16) A q_tile[BQ * DMAX];
  __shared__ __align__(16) A do_tile[BQ * DMAX];
  __shared__ A lse_tile[BQ];
  __shared__ A delta_tile[BQ];

  // The first key tile sees every query row: it runs first.
  const int64_t bh = blockIdx.x, j0 = static_cast<int64_t>(blockIdx.y) * kRowsPerBlock;
  const int g = threadIdx.x % kGroup;
  const int64_t j = j0 + threadIdx.x / kGroup;
  const bool valid = j < T;
  const Dt* q_head = q.head(bh);
  const Dt* do_head = grad_out.head(bh);
  const A* lse_head = lse + bh * T;
  const A* delta_head = delta + bh * T;

  A kr[E], vr[E], dk[E], dv[E];
  load_row(kr, k.head(bh) + (valid ? j : 0) * k.sT, valid, D, g);
  load_row(vr, v.head(bh) + (valid ? j : 0) * v.sT, valid, D, g);
#pragma unroll
  for (int e = 0; e < E; ++e) dk[e] = dv[e] = 0;

  // Query rows before j0 see none of this tile's keys.
  for (int64_t i0 = j0; i0 < T; i0 += BQ) {
    __syncthreads();
    load_tile<BQ, DMAX>(q_tile, q_head, q.sT, i0, T, D);
    load_tile<BQ, DMAX>(do_tile, do_head, grad_out.sT, i0, T, D);
    for (int r = threadIdx.x; r < BQ; r += blockDim.x) {
      const bool in = i0 + r < T;
      lse_tile[r] = in ? lse_head[i0 + r] : A(0);
      delta_tile[r] = in ? delta_head[i0 + r] : A(0);
    }
    __syncthreads();
    const int rows = static_cast<int>(T - i0 < BQ ? T - i0 : BQ);
    for (int r = 0; r < rows; ++r) {
      const A s = group_sum(partial_dot(kr, q_tile + r * DMAX, g));
      const A dp = group_sum(partial_dot(vr, do_tile + r * DMAX, g));
      if (i0 + r >= j) {  // false for j >= T (i < T)
        const A p = exp_acc(scale * s - lse_tile[r]);
        const A ds = p * (dp - delta_tile[r]);
        axpy(dv, p, do_tile + r * DMAX, g);
        axpy(dk, ds, q_tile + r * DMAX, g);
      }
    }
  }
  if (valid) {
    store_row(grad_k.head(bh) + j * grad_k.sT, dk, scale, D, g);
    store_row(grad_v.head(bh) + j * grad_v.sT, dv, A(1), D, g);
  }
}

// dq for one query tile of one head.
template <class Dt, int DMAX>
__global__ void __launch_bounds__(kBlockThreads)
    attention_backward_dq_kernel(Heads<const Dt> q, Heads<const Dt> k, Heads<const Dt> v,
                                 Heads<const Dt> grad_out, const device_acc_t<Dt>* __restrict__ lse,
                                 const device_acc_t<Dt>* __restrict__ delta, Heads<Dt> grad_q, int64_t T,
                                 int D, device_acc_t<Dt> scale) {
  using A = device_acc_t<Dt>;
  constexpr int E = DMAX / kGroup;
  constexpr int BK = stream_rows<A, DMAX>();
  __shared__ __align__(16) A k_tile[BK * DMAX];
  __shared__ __align__(16) A v_tile[BK * DMAX];

  const int64_t bh = blockIdx.x, i0 = last_first_tile();
  const int g = threadIdx.x % kGroup;
  const int64_t i = i0 + threadIdx.x / kGroup;
  const bool valid = i < T;
  const Dt* k_head = k.head(bh);
  const Dt* v_head = v.head(bh);

  A qr[E], dor[E], dq[E];
  load_row(qr, q.head(bh) + (valid ? i : 0) * q.sT, valid, D, g);
  load_row(dor, grad_out.head(bh) + (valid ? i : 0) * grad_out.sT, valid, D, g);
#pragma unroll
  for (int e = 0; e < E; ++e) dq[e] = 0;
  const A row_lse = valid ? lse[bh * T + i] : A(0);
  const A row_delta = valid ? delta[bh * T + i] : A(0);

  const int64_t key_end = T < i0 + kRowsPerBlock ? T : i0 + kRowsPerBlock;
  for (int64_t j0 = 0; j0 < key_end; j0 += BK) {
    __syncthreads();
    load_tile<BK, DMAX>(k_tile, k_head, k.sT, j0, T, D);
    load_tile<BK, DMAX>(v_tile, v_head, v.sT, j0, T, D);
    __syncthreads();
    const int cols = static_cast<int>(key_end - j0 < BK ? key_end - j0 : BK);
    for (int c = 0; c < cols; ++c) {
      // The same sums as the dk/dv kernel's (products commute): bitwise the same p.
      const A s = group_sum(partial_dot(qr, k_tile + c * DMAX, g));
      const A dp = group_sum(partial_dot(dor, v_tile + c * DMAX, g));
      if (valid && j0 + c <= i) {
        const A p = exp_acc(scale * s - row_lse);
        const A ds = p * (dp - row_delta);
        axpy(dq, ds, k_tile + c * DMAX, g);
      }
    }
  }
  if (valid) store_row(grad_q.head(bh) + i * grad_q.sT, dq, scale, D, g);
}

// ---- tensor-core kernels (f16/bf16, D = 32, 64 or 128) ------------------------------------------------------
//
// The same method on the tensor cores (WMMA 16 x 16 x 16, 16-bit operands, exact products summed in fp32),
// FlashAttention-2's numerics: p and ds are rounded to the input dtype as operands of their products (relative
// 2^-9 for bf16, 2^-11 for f16), as the CPU's bf16 kernels do (tensor/cpu/attention_bf16.cpp); the scores,
// the softmax statistics, dp, delta and every accumulator stay fp32, and each output is rounded once.
// A block is 4 warps; warp w owns rows 16 w .. 16 w + 15 of the block's 64 (query rows, or key rows for dk/dv).
// The other side streams through shared memory in 64-row tiles of the input dtype. A warp's products land in
// its own fp32 rows of a shared score tile, where lane pairs do the row-wise softmax work (lane l: row l / 2,
// columns 32 (l % 2) ..) before the probabilities go back to the tensor cores as 16-bit operands.
// Forward: online softmax over the key tiles at or before the diagonal: m, l per row in the lane pair's
// registers; o (fp32, shared) rescaled by e^(m_old - m_new) before each tile's p v is added; l sums the rounded
// p actually multiplied, so out = o / l stays a convex combination of v rows.
namespace tc {

using namespace nvcuda;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kRows = 64;  // rows per block, and rows per streamed tile

// A thread's place in its block's 64 rows: each warp owns 16 of them, and each lane pair one row, the even
// lane its first half and the odd lane its second.
struct RowLane {
  int warp, row, half;
};
__device__ __forceinline__ RowLane row_lane() {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  return {warp, warp * 16 + lane / 2, lane % 2};
}

// The query tile of a block whose blockIdx.y counts the tiles from the last: the heaviest (most key tiles
// under the diagonal) is scheduled first.
__device__ __forceinline__ int heaviest_first_query_tile() { return static_cast<int>(gridDim.y - 1 - blockIdx.y); }

template <int D>
struct Layout {
  static constexpr int ldh = D + 8;      // 16-bit tiles [64][D + 8] (WMMA wants ld % 8 == 0; +8 staggers banks)
  static constexpr int lds = kRows + 4;  // fp32 score tiles [64][68]
  static constexpr int ldp = kRows + 8;  // 16-bit probability tiles [64][72]
  static constexpr int ldo = D + 4;      // fp32 accumulator tiles [64][D + 4]
  static constexpr size_t half_tile = size_t(kRows) * ldh;  // elements
  static constexpr size_t p_tile = size_t(kRows) * ldp;
  static constexpr size_t s_tile = size_t(kRows) * lds;
  static constexpr size_t o_tile = size_t(kRows) * ldo;
  // Dynamic shared memory of each kernel (bytes; every region a multiple of 32 bytes, as WMMA needs).
  static constexpr size_t forward_bytes = (3 * half_tile + p_tile) * 2 + (s_tile + o_tile) * 4;
  static constexpr size_t dkdv_bytes = (4 * half_tile + 2 * p_tile) * 2 + 2 * s_tile * 4 + 2 * kRows * 4;
  static constexpr size_t dq_bytes = (4 * half_tile + p_tile) * 2 + 2 * s_tile * 4;
  static_assert(o_tile <= 2 * s_tile, "the dk/dv and dq kernels stage their results in the two score tiles");
};

template <class Dt>
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, Dt, wmma::row_major>;
template <class Dt, class Major>
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, Dt, Major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// Rows r0 .. r0 + 63 of a head into a [64][ldh] tile, 16 bytes at a time where the row is 16-byte aligned;
// zero rows past T.
template <int D, class Dt>
__device__ __forceinline__ void load_rows(Dt* tile, const Dt* head, int64_t sT, int64_t r0, int64_t T) {
  constexpr int chunks = D / 8;
  for (int index = threadIdx.x; index < kRows * chunks; index += kThreads) {
    const int r = index / chunks, c = (index % chunks) * 8;
    Dt* dst = tile + r * Layout<D>::ldh + c;
    if (r0 + r < T) {
      const Dt* src = head + (r0 + r) * sT + c;
      if ((reinterpret_cast<uintptr_t>(src) & 15) == 0) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
      } else {
#pragma unroll
        for (int u = 0; u < 8; ++u) dst[u] = src[u];
      }
    } else {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
  }
}

// out[16 x 64] (fp32, row-major, ld lds) = a[16 x D] b^T for the warp: a row-major rows of `a_rows`, b the 64
// rows of `b_rows` (both [.][ldh] 16-bit tiles), i.e. every dot product of an a row with a b row.
template <int D, class Dt>
__device__ __forceinline__ void row_dots(float* out, const Dt* a_rows, const Dt* b_rows) {
  using L = Layout<D>;
#pragma unroll
  for (int n = 0; n < kRows / 16; ++n) {
    FragC c;
    wmma::fill_fragment(c, 0.0f);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      FragA<Dt> a;
      FragB<Dt, wmma::col_major> b;
      wmma::load_matrix_sync(a, a_rows + kk * 16, L::ldh);
      wmma::load_matrix_sync(b, b_rows + n * 16 * L::ldh + kk * 16, L::ldh);
      wmma::mma_sync(c, a, b, c);
    }
    wmma::store_matrix_sync(out + n * 16, c, L::lds, wmma::mem_row_major);
  }
}

// acc[dn] (16 x 16 blocks of a 16 x D result) += p[16 x 64] x[64 x D]: p the warp's rows of a [.][ldp]
// 16-bit tile, x a [64][ldh] tile.
template <int D, class Dt>
__device__ __forceinline__ void accumulate_products(FragC (&acc)[D / 16], const Dt* p_rows, const Dt* x) {
  using L = Layout<D>;
#pragma unroll
  for (int kk = 0; kk < kRows / 16; ++kk) {
    FragA<Dt> a;
    wmma::load_matrix_sync(a, p_rows + kk * 16, L::ldp);
#pragma unroll
    for (int dn = 0; dn < D / 16; ++dn) {
      FragB<Dt, wmma::row_major> b;
      wmma::load_matrix_sync(b, x + kk * 16 * L::ldh + dn * 16, L::ldh);
      wmma::mma_sync(acc[dn], a, b, acc[dn]);
    }
  }
}

// The warp's accumulators through its rows of the fp32 staging tile into row `t` of a head (scaled, rounded
// once), lane pair by lane pair; nothing for rows past T.
template <int D, class Dt>
__device__ __forceinline__ void store_rows(FragC (&acc)[D / 16], float* stage, int warp, int row, int half,
                                           Dt* dst_row, bool valid, float scale) {
  using L = Layout<D>;
#pragma unroll
  for (int dn = 0; dn < D / 16; ++dn)
    wmma::store_matrix_sync(stage + warp * 16 * L::ldo + dn * 16, acc[dn], L::ldo, wmma::mem_row_major);
  __syncwarp();
  if (valid)
    for (int d = half * (D / 2); d < (half + 1) * (D / 2); ++d) dst_row[d] = store<Dt>(scale * stage[row * L::ldo + d]);
  __syncwarp();
}

template <class Dt, int D>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(Heads<const Dt> q, Heads<const Dt> k, Heads<const Dt> v, Heads<Dt> out, float* lse, int64_t T,
                   float scale) {
  using L = Layout<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  Dt* q_tile = reinterpret_cast<Dt*>(smem);
  Dt* k_tile = q_tile + L::half_tile;
  Dt* v_tile = k_tile + L::half_tile;
  Dt* p_tile = v_tile + L::half_tile;
  float* s_tile = reinterpret_cast<float*>(p_tile + L::p_tile);
  float* o_tile = s_tile + L::s_tile;
  const int64_t bh = blockIdx.x;
  const int query_tile = heaviest_first_query_tile();
  const int64_t q0 = static_cast<int64_t>(query_tile) * kRows;
  const auto [warp, row, half] = row_lane();
  const int64_t i = q0 + row;
  load_rows<D>(q_tile, q.head(bh), q.sT, q0, T);
  for (int index = threadIdx.x; index < kRows * L::ldo; index += kThreads) o_tile[index] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  float* s_row = s_tile + row * L::lds + half * 32;
  Dt* p_row = p_tile + row * L::ldp + half * 32;
  float* o_row = o_tile + row * L::ldo + half * (D / 2);
  for (int key_tile = 0; key_tile <= query_tile; ++key_tile) {
    const int64_t j0 = static_cast<int64_t>(key_tile) * kRows;
    __syncthreads();  // the previous tile's k and v are no longer read
    load_rows<D>(k_tile, k.head(bh), k.sT, j0, T);
    load_rows<D>(v_tile, v.head(bh), v.sT, j0, T);
    __syncthreads();
    row_dots<D>(s_tile + warp * 16 * L::lds, q_tile + warp * 16 * L::ldh, k_tile);
    __syncwarp();
    float s[32];
    float tile_max = -INFINITY;
#pragma unroll
    for (int c = 0; c < 32; ++c) {
      const int64_t j = j0 + half * 32 + c;
      s[c] = (i < T && j <= i) ? scale * s_row[c] : -INFINITY;
      tile_max = fmaxf(tile_max, s[c]);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    const float m_new = fmaxf(m, tile_max);
    const float alpha = m_new == -INFINITY ? 1.0f : expf(m - m_new);  // 0 for the first visible tile
    float p_sum = 0.0f;
#pragma unroll
    for (int c = 0; c < 32; ++c) {
      const Dt p = store<Dt>(s[c] == -INFINITY ? 0.0f : expf(s[c] - m_new));
      p_row[c] = p;
      p_sum += load_as<float>(p);
    }
    p_sum += __shfl_xor_sync(0xffffffffu, p_sum, 1);
    l = l * alpha + p_sum;
    m = m_new;
    for (int d = 0; d < D / 2; ++d) o_row[d] *= alpha;
    __syncwarp();
    FragC o[D / 16];
#pragma unroll
    for (int dn = 0; dn < D / 16; ++dn)
      wmma::load_matrix_sync(o[dn], o_tile + warp * 16 * L::ldo + dn * 16, L::ldo, wmma::mem_row_major);
    accumulate_products<D>(o, p_tile + warp * 16 * L::ldp, v_tile);
#pragma unroll
    for (int dn = 0; dn < D / 16; ++dn)
      wmma::store_matrix_sync(o_tile + warp * 16 * L::ldo + dn * 16, o[dn], L::ldo, wmma::mem_row_major);
    __syncwarp();
  }
  if (i < T) {
    Dt* dst = out.head(bh) + i * out.sT + half * (D / 2);
    for (int d = 0; d < D / 2; ++d) dst[d] = store<Dt>(o_row[d] / l);
    if (half == 0) lse[bh * T + i] = m + logf(l);
  }
}

// dk, dv for 64 key rows (block (bh, key tile)); streams the query tiles at or after the diagonal.
template <class Dt, int D>
__global__ void __launch_bounds__(kThreads)
    backward_dkdv_kernel(Heads<const Dt> q, Heads<const Dt> k, Heads<const Dt> v, Heads<const Dt> grad_out,
                         const float* lse, const float* delta, Heads<Dt> grad_k, Heads<Dt> grad_v, int64_t T,
                         float scale) {
  using L = Layout<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  Dt* k_tile = reinterpret_cast<Dt*>(smem);
  Dt* v_tile = k_tile + L::half_tile;
  Dt* q_tile = v_tile + L::half_tile;
  Dt* do_tile = q_tile + L::half_tile;
  Dt* p_tile = do_tile + L::half_tile;
  Dt* ds_tile = p_tile + L::p_tile;
  float* s_tile = reinterpret_cast<float*>(ds_tile + L::p_tile);
  float* dp_tile = s_tile + L::s_tile;
  float* lse_tile = dp_tile + L::s_tile;
  float* delta_tile = lse_tile + kRows;
  const int64_t bh = blockIdx.x, k0 = static_cast<int64_t>(blockIdx.y) * kRows;  // blockIdx.y 0 is heaviest
  const auto [warp, row, half] = row_lane();
  const int64_t j = k0 + row;
  load_rows<D>(k_tile, k.head(bh), k.sT, k0, T);
  load_rows<D>(v_tile, v.head(bh), v.sT, k0, T);
  FragC dk[D / 16], dv[D / 16];
#pragma unroll
  for (int dn = 0; dn < D / 16; ++dn) {
    wmma::fill_fragment(dk[dn], 0.0f);
    wmma::fill_fragment(dv[dn], 0.0f);
  }
  const int64_t tiles = (T + kRows - 1) / kRows;
  for (int64_t query_tile = blockIdx.y; query_tile < tiles; ++query_tile) {
    const int64_t i0 = query_tile * kRows;
    __syncthreads();
    load_rows<D>(q_tile, q.head(bh), q.sT, i0, T);
    load_rows<D>(do_tile, grad_out.head(bh), grad_out.sT, i0, T);
    for (int c = threadIdx.x; c < kRows; c += kThreads) {
      lse_tile[c] = i0 + c < T ? lse[bh * T + i0 + c] : 0.0f;
      delta_tile[c] = i0 + c < T ? delta[bh * T + i0 + c] : 0.0f;
    }
    __syncthreads();
    // s^T = k q^T and dp^T = v do^T for the warp's 16 keys and the tile's 64 queries.
    row_dots<D>(s_tile + warp * 16 * L::lds, k_tile + warp * 16 * L::ldh, q_tile);
    row_dots<D>(dp_tile + warp * 16 * L::lds, v_tile + warp * 16 * L::ldh, do_tile);
    __syncwarp();
#pragma unroll 4
    for (int c = half * 32; c < half * 32 + 32; ++c) {
      const int64_t i = i0 + c;
      float p = 0.0f, ds = 0.0f;
      if (j < T && i < T && i >= j) {
        p = expf(scale * s_tile[row * L::lds + c] - lse_tile[c]);
        ds = p * (dp_tile[row * L::lds + c] - delta_tile[c]);
      }
      p_tile[row * L::ldp + c] = store<Dt>(p);
      ds_tile[row * L::ldp + c] = store<Dt>(ds);
    }
    __syncwarp();
    accumulate_products<D>(dv, p_tile + warp * 16 * L::ldp, do_tile);   // dv += p^T do
    accumulate_products<D>(dk, ds_tile + warp * 16 * L::ldp, q_tile);   // dk += ds^T q
  }
  __syncthreads();  // the staging rows below span other warps' score rows
  store_rows<D>(dk, s_tile, warp, row, half, grad_k.head(bh) + j * grad_k.sT, j < T, scale);
  store_rows<D>(dv, s_tile, warp, row, half, grad_v.head(bh) + j * grad_v.sT, j < T, 1.0f);
}

// dq for 64 query rows (block (bh, query tile)); streams the key tiles at or before the diagonal.
template <class Dt, int D>
__global__ void __launch_bounds__(kThreads)
    backward_dq_kernel(Heads<const Dt> q, Heads<const Dt> k, Heads<const Dt> v, Heads<const Dt> grad_out,
                       const float* lse, const float* delta, Heads<Dt> grad_q, int64_t T, float scale) {
  using L = Layout<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  Dt* q_tile = reinterpret_cast<Dt*>(smem);
  Dt* do_tile = q_tile + L::half_tile;
  Dt* k_tile = do_tile + L::half_tile;
  Dt* v_tile = k_tile + L::half_tile;
  Dt* ds_tile = v_tile + L::half_tile;
  float* s_tile = reinterpret_cast<float*>(ds_tile + L::p_tile);
  float* dp_tile = s_tile + L::s_tile;
  const int64_t bh = blockIdx.x;
  const int query_tile = heaviest_first_query_tile();
  const int64_t q0 = static_cast<int64_t>(query_tile) * kRows;
  const auto [warp, row, half] = row_lane();
  const int64_t i = q0 + row;
  const float row_lse = i < T ? lse[bh * T + i] : 0.0f, row_delta = i < T ? delta[bh * T + i] : 0.0f;
  load_rows<D>(q_tile, q.head(bh), q.sT, q0, T);
  load_rows<D>(do_tile, grad_out.head(bh), grad_out.sT, q0, T);
  FragC dq[D / 16];
#pragma unroll
  for (int dn = 0; dn < D / 16; ++dn) wmma::fill_fragment(dq[dn], 0.0f);
  for (int key_tile = 0; key_tile <= query_tile; ++key_tile) {
    const int64_t j0 = static_cast<int64_t>(key_tile) * kRows;
    __syncthreads();
    load_rows<D>(k_tile, k.head(bh), k.sT, j0, T);
    load_rows<D>(v_tile, v.head(bh), v.sT, j0, T);
    __syncthreads();
    row_dots<D>(s_tile + warp * 16 * L::lds, q_tile + warp * 16 * L::ldh, k_tile);    // s = q k^T
    row_dots<D>(dp_tile + warp * 16 * L::lds, do_tile + warp * 16 * L::ldh, v_tile);  // dp = do v^T
    __syncwarp();
#pragma unroll 4
    for (int c = half * 32; c < half * 32 + 32; ++c) {
      const int64_t jc = j0 + c;
      float ds = 0.0f;
      if (i < T && jc <= i) {
        const float p = expf(scale * s_tile[row * L::lds + c] - row_lse);
        ds = p * (dp_tile[row * L::lds + c] - row_delta);
      }
      ds_tile[row * L::ldp + c] = store<Dt>(ds);
    }
    __syncwarp();
    accumulate_products<D>(dq, ds_tile + warp * 16 * L::ldp, k_tile);  // dq += ds k
  }
  __syncthreads();
  store_rows<D>(dq, s_tile, warp, row, half, grad_q.head(bh) + i * grad_q.sT, i < T, scale);
}

// Opts a kernel into more than 48 KiB of dynamic shared memory (once per instantiation and device; cheap).
template <class Kernel>
void allow_shared_bytes(Kernel kernel, size_t bytes) {
  MIXTAPE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

// Calls fn.template operator()<D>() for the head dims the tensor-core kernels serve.
template <class Fn>
void dispatch_exact_head_dim(int64_t D, Fn&& fn) {
  if (D == 32)
    fn.template operator()<32>();
  else if (D == 64)
    fn.template operator()<64>();
  else
    fn.template operator()<128>();
}

}  // namespace tc

// ---- host side -------------------------------------------------------------------------------------------

DType stats_dtype(DType x) { return x == DType::F64 ? DType::F64 : DType::F32; }

// The CPU kernel's layout checks: [B, H, T, D] of the given shape and dtype with the head dim contiguous.
void check_bhtd(const char* op, const char* name, const Tensor& t, const Shape& shape, DType dtype) {
  const bool ok = t.defined() && t.shape() == shape && t.dtype() == dtype &&
                  (t.stride(3) == 1 || t.size(3) == 1 || t.numel() == 0);
  if (!ok) [[unlikely]]
    fail(op, ": ", name, " must be ", dtype_name(dtype), shape_str(shape),
         " [B, H, T, D] with the head dim D contiguous (stride 1; B, H, T may have any strides), got ",
         t.defined() ? t.description() : std::string("undefined"), " with strides ",
         t.defined() ? shape_str(t.strides()) : std::string("[]"));
}

void check_stats(const char* op, const Tensor& lse, const Shape& shape, DType dtype) {
  const bool ok = lse.defined() && lse.shape() == shape && lse.dtype() == dtype &&
                  (lse.is_contiguous() || lse.numel() == 0);
  if (!ok) [[unlikely]]
    fail(op, ": lse must be contiguous ", dtype_name(dtype), shape_str(shape), ", got ",
         lse.defined() ? lse.description() : std::string("undefined"));
}

// The grid of a per-(head, 64-row tile) kernel: heads along x (up to 2^31 - 1), tiles along y.
dim3 tile_grid(const char* op, int64_t BH, int64_t T) {
  const int64_t tiles = (T + kRowsPerBlock - 1) / kRowsPerBlock;
  check(BH <= 2147483647LL && tiles <= 65535, op, ": B*H = ", BH, " and T = ", T,
        " exceed the CUDA grid (B*H < 2^31, T <= ", 65535LL * kRowsPerBlock, ")");
  return dim3(static_cast<unsigned>(BH), static_cast<unsigned>(tiles));
}

// Whether the tensor-core kernels serve this call (see set_cuda_attention_kernel).
bool tensor_cores_serve(DType dtype, int64_t D) {
  return cuda_attention_kernel() == CudaAttentionKernel::TensorCores &&
         (dtype == DType::F16 || dtype == DType::BF16) && (D == 32 || D == 64 || D == 128);
}

template <class Dt>
constexpr bool kSixteenBit = std::is_same_v<Dt, __half> || std::is_same_v<Dt, __nv_bfloat16>;

// Calls fn.template operator()<DMAX>() with DMAX the smallest of 32, 64, 128 that holds D.
template <class Fn>
void dispatch_head_dim(const char* op, int64_t D, Fn&& fn) {
  if (D > kMaxHeadDim) [[unlikely]]
    fail(op, ": head dim D = ", D, " is not supported on CUDA (at most ", kMaxHeadDim, ")");
  if (D <= 32)
    fn.template operator()<32>();
  else if (D <= 64)
    fn.template operator()<64>();
  else
    fn.template operator()<128>();
}

}  // namespace

void CudaBackend::causal_attention(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                                   const Tensor& out, const Tensor& lse) {
  const char* op = "causal_attention";
  if (!q.defined() || q.dim() != 4) [[unlikely]]
    fail(op, ": q must be [B, H, T, D], got ", q.defined() ? q.description() : std::string("undefined"));
  const int64_t B = q.shape()[0], H = q.shape()[1], T = q.shape()[2], D = q.shape()[3];
  check_bhtd(op, "q", q, q.shape(), q.dtype());
  check_bhtd(op, "k", k, q.shape(), q.dtype());
  check_bhtd(op, "v", v, q.shape(), q.dtype());
  check_bhtd(op, "out", out, q.shape(), q.dtype());
  check_stats(op, lse, {B, H, T}, stats_dtype(q.dtype()));
  if (q.numel() == 0) return;  // nothing to compute (no rows, or no heads)
  const int64_t BH = B * H;
  const dim3 grid = tile_grid(op, BH, T);
  const bool tensor_cores = tensor_cores_serve(q.dtype(), D);
  dispatch_float(q.dtype(), op, [&]<typename T_>() {
    using Dt = device_t<T_>;
    using A = device_acc_t<Dt>;
    if constexpr (kSixteenBit<Dt>) {
      if (tensor_cores) {
        tc::dispatch_exact_head_dim(D, [&]<int DH>() {
          constexpr size_t bytes = tc::Layout<DH>::forward_bytes;
          tc::allow_shared_bytes(tc::forward_kernel<Dt, DH>, bytes);
          tc::forward_kernel<Dt, DH><<<grid, tc::kThreads, bytes, stream()>>>(
              heads_of<const Dt>(q), heads_of<const Dt>(k), heads_of<const Dt>(v), heads_of<Dt>(out),
              reinterpret_cast<float*>(lse.data_ptr()), T, static_cast<float>(scale));
          MIXTAPE_KERNEL_CHECK();
        });
        return;
      }
    }
    dispatch_head_dim(op, D, [&]<int DMAX>() {
      attention_forward_kernel<Dt, DMAX><<<grid, kBlockThreads, 0, stream()>>>(
          heads_of<const Dt>(q), heads_of<const Dt>(k), heads_of<const Dt>(v), heads_of<Dt>(out),
          reinterpret_cast<A*>(lse.data_ptr()), T, static_cast<int>(D), static_cast<A>(scale));
      MIXTAPE_KERNEL_CHECK();
    });
  });
}

void CudaBackend::causal_attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k,
                                            const Tensor& v, const Tensor& out, const Tensor& lse, double scale,
                                            const Tensor& grad_q, const Tensor& grad_k, const Tensor& grad_v) {
  const char* op = "causal_attention_backward";
  if (!q.defined() || q.dim() != 4) [[unlikely]]
    fail(op, ": q must be [B, H, T, D], got ", q.defined() ? q.description() : std::string("undefined"));
  const int64_t B = q.shape()[0], H = q.shape()[1], T = q.shape()[2], D = q.shape()[3];
  check_bhtd(op, "grad_out", grad_out, q.shape(), q.dtype());
  check_bhtd(op, "q", q, q.shape(), q.dtype());
  check_bhtd(op, "k", k, q.shape(), q.dtype());
  check_bhtd(op, "v", v, q.shape(), q.dtype());
  check_bhtd(op, "out", out, q.shape(), q.dtype());
  check_bhtd(op, "grad_q", grad_q, q.shape(), q.dtype());
  check_bhtd(op, "grad_k", grad_k, q.shape(), q.dtype());
  check_bhtd(op, "grad_v", grad_v, q.shape(), q.dtype());
  check_stats(op, lse, {B, H, T}, stats_dtype(q.dtype()));
  if (q.numel() == 0) return;
  const int64_t BH = B * H;
  const dim3 grid = tile_grid(op, BH, T);
  // delta_i = do_i . o_i for every query row (scratch from the caching allocator).
  const Tensor delta = Tensor::empty({BH * T}, stats_dtype(q.dtype()), q.device());
  const bool tensor_cores = tensor_cores_serve(q.dtype(), D);
  dispatch_float(q.dtype(), op, [&]<typename T_>() {
    using Dt = device_t<T_>;
    using A = device_acc_t<Dt>;
    const Heads<const Dt> qh = heads_of<const Dt>(q), kh = heads_of<const Dt>(k), vh = heads_of<const Dt>(v);
    const Heads<const Dt> goh = heads_of<const Dt>(grad_out), oh = heads_of<const Dt>(out);
    const A* lse_data = reinterpret_cast<const A*>(lse.data_ptr());
    A* delta_data = reinterpret_cast<A*>(delta.data_ptr());
    const A scale_a = static_cast<A>(scale);

    constexpr int kDeltaThreads = 256;
    attention_delta_kernel<Dt><<<blocks_for(BH * T * 32, kDeltaThreads), kDeltaThreads, 0, stream()>>>(
        goh, oh, delta_data, BH * T, T, static_cast<int>(D));
    MIXTAPE_KERNEL_CHECK();
    if constexpr (kSixteenBit<Dt>) {
      if (tensor_cores) {
        tc::dispatch_exact_head_dim(D, [&]<int DH>() {
          constexpr size_t dkdv_bytes = tc::Layout<DH>::dkdv_bytes, dq_bytes = tc::Layout<DH>::dq_bytes;
          tc::allow_shared_bytes(tc::backward_dkdv_kernel<Dt, DH>, dkdv_bytes);
          tc::backward_dkdv_kernel<Dt, DH><<<grid, tc::kThreads, dkdv_bytes, stream()>>>(
              qh, kh, vh, goh, lse_data, delta_data, heads_of<Dt>(grad_k), heads_of<Dt>(grad_v), T, scale_a);
          MIXTAPE_KERNEL_CHECK();
          tc::allow_shared_bytes(tc::backward_dq_kernel<Dt, DH>, dq_bytes);
          tc::backward_dq_kernel<Dt, DH><<<grid, tc::kThreads, dq_bytes, stream()>>>(
              qh, kh, vh, goh, lse_data, delta_data, heads_of<Dt>(grad_q), T, scale_a);
          MIXTAPE_KERNEL_CHECK();
        });
        return;
      }
    }
    dispatch_head_dim(op, D, [&]<int DMAX>() {
      attention_backward_dkdv_kernel<Dt, DMAX><<<grid, kBlockThreads, 0, stream()>>>(
          qh, kh, vh, goh, lse_data, delta_data, heads_of<Dt>(grad_k), heads_of<Dt>(grad_v), T,
          static_cast<int>(D), scale_a);
      MIXTAPE_KERNEL_CHECK();
      attention_backward_dq_kernel<Dt, DMAX><<<grid, kBlockThreads, 0, stream()>>>(
          qh, kh, vh, goh, lse_data, delta_data, heads_of<Dt>(grad_q), T, static_cast<int>(D), scale_a);
      MIXTAPE_KERNEL_CHECK();
    });
  });
}

}  // namespace mixtape::cuda
