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
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "tensor/cuda/common.cuh"
#include "tensor/cuda/cuda_backend.h"
#include "tensor/kernel_contract.h"

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
// The same method on the tensor cores, FlashAttention-2's way: mma.sync m16n8k16 (16-bit operands, exact
// products summed in fp32) with the scores, probabilities and accumulators kept in registers, never in shared
// memory. Numerics (as the CPU's bf16 kernels, tensor/cpu/attention_bf16.cpp): p and ds are rounded to the input
// dtype as operands of their products (relative 2^-9 for bf16, 2^-11 for f16); the scores, the softmax
// statistics, dp, delta and every accumulator stay fp32, and each output is rounded once. Exponentials are
// exp2 of log2(e)-scaled scores (lse is stored in natural-log units).
//
// A block is 4 warps; warp w owns rows 16 w .. 16 w + 15 of the block's 64 (query rows for the forward and dq,
// key rows for dk/dv). The other side streams through shared memory in tiles of N rows, double-buffered with
// cp.async (the next tile loads while this one is multiplied). Tiles are [rows][D + 8] 16-bit arrays: the
// 16-byte pad puts the 8 rows an ldmatrix reads in 8 different bank quads.
//
// Register fragments (PTX ISA, mma.m16n8k16; lane = 4 g + t): an accumulator C[16 x 8] holds (g, 2t), (g, 2t+1),
// (g+8, 2t), (g+8, 2t+1); an A operand [16 x 16] holds pairs (g, 2t..), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..);
// a B operand [16 x 8] (k x n) holds pairs (k = 2t.., n = g), (k = 2t+8.., n = g). So the accumulators of two
// adjacent 8-column score tiles, rounded to pairs, are the A operand of the next product (p v, ds k, ...)
// without leaving the registers.
//
// Forward: online softmax over the key tiles at or before the diagonal: per row the max m and the lane's part
// of the sum l of the rounded p actually multiplied (so out = o / l stays a convex combination of v rows);
// o rescaled by 2^(m_old - m_new) before each tile's p v is added.
// dk/dv (block = 64 keys): s^T = k q^T and dp^T = v do^T per streamed query tile; p^T, ds^T = p^T (dp^T - delta)
//   rounded, dv += p^T do, dk += ds^T q.  dq (block = 64 queries): s = q k^T, dp = do v^T, dq += ds k.
namespace tc {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kRows = 64;  // rows per block (16 per warp)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Rows per streamed tile: 64, or 32 in the backward at D = 128 (two [16 x N] fp32 score tiles and two
// [16 x D] accumulators per warp stay within the 255 registers of a thread).
template <int D, bool kBackward>
constexpr int stream_rows() { return kBackward && D == 128 ? 32 : 64; }

template <int D>
struct Layout {
  static constexpr int ld = D + 8;  // 16-bit elements per tile row
  static constexpr int nf = stream_rows<D, false>(), nb = stream_rows<D, true>();
  // Dynamic shared memory (bytes): the block's own tile(s) once, the streamed ones twice (double buffer).
  static constexpr size_t forward_bytes = size_t(kRows + 2 * 2 * nf) * ld * 2;
  static constexpr size_t dkdv_bytes = size_t(2 * kRows + 2 * 2 * nb) * ld * 2 + 2 * 2 * nb * 4;
  static constexpr size_t dq_bytes = size_t(2 * kRows + 2 * 2 * nb) * ld * 2;
};

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8 x 8 16-bit matrices; lane l gives the address of row l % 8 of matrix l / 8 and receives, of each, the
// pair (row l / 4, columns 2 (l % 4) ..) (`trans`: the pair (rows 2 (l % 4) .., column l / 4)).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row))
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row))
               : "memory");
}

// c[16 x 8] += a[16 x 16] b[16 x 8], fp32 accumulation.
template <class Dt>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<Dt, __nv_bfloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ uint16_t bits_of(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
__device__ __forceinline__ uint16_t bits_of(__half x) { return __half_as_ushort(x); }

// Two floats rounded to the dtype (nearest even), the lower column in the low half; `sum` gets their rounded
// values added (the weights actually multiplied).
template <class Dt>
__device__ __forceinline__ uint32_t round_pair(float lo, float hi, float& sum) {
  const Dt a = store<Dt>(lo), b = store<Dt>(hi);
  sum += load_as<float>(a) + load_as<float>(b);
  return static_cast<uint32_t>(bits_of(a)) | (static_cast<uint32_t>(bits_of(b)) << 16);
}
template <class Dt>
__device__ __forceinline__ uint32_t round_pair(float lo, float hi) {
  float unused = 0.0f;
  return round_pair<Dt>(lo, hi, unused);
}

// The A operands of a [16 x N] product from the fp32 accumulators of its N / 8 column tiles (see above).
template <class Dt, int N>
__device__ __forceinline__ void to_operand(uint32_t (&a)[N / 16][4], const float (&c)[N / 8][4], float& sum_lo,
                                           float& sum_hi) {
#pragma unroll
  for (int nt = 0; nt < N / 8; ++nt) {
    a[nt / 2][(nt % 2) * 2] = round_pair<Dt>(c[nt][0], c[nt][1], sum_lo);
    a[nt / 2][(nt % 2) * 2 + 1] = round_pair<Dt>(c[nt][2], c[nt][3], sum_hi);
  }
}

__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most `pending` of this thread's committed groups are still in flight.
template <int pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(pending) : "memory");
}

// Rows r0 .. r0 + R - 1 of a head into a [R][ld] tile: 16-byte cp.async where the source is 16-byte aligned
// (complete after cp_async_wait and a barrier), element by element where it is not; zero rows past T.
template <int D, int R, class Dt>
__device__ __forceinline__ void load_rows(Dt* tile, const Dt* head, int64_t sT, int64_t r0, int64_t T) {
  constexpr int chunks = D / 8;
  for (int index = threadIdx.x; index < R * chunks; index += kThreads) {
    const int r = index / chunks, c = (index % chunks) * 8;
    Dt* dst = tile + r * Layout<D>::ld + c;
    if (r0 + r < T) {
      const Dt* src = head + (r0 + r) * sT + c;
      if ((reinterpret_cast<uintptr_t>(src) & 15) == 0) {
        cp_async_16(dst, src);
      } else {
#pragma unroll
        for (int u = 0; u < 8; ++u) dst[u] = src[u];
      }
    } else {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
  }
}

// c[N / 8] (a [16 x N] result) = a b^T with a the warp's 16 rows of a [.][ld] tile (row-major, D columns) and b
// the N rows of another: every dot product of an a row with a b row.
template <class Dt, int D, int N>
__device__ __forceinline__ void row_dots(float (&c)[N / 8][4], const Dt* a_rows, const Dt* b_rows) {
  constexpr int ld = Layout<D>::ld;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int nt = 0; nt < N / 8; ++nt) c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[4];
    ldmatrix_x4(a, a_rows + (lane % 16) * ld + kk * 16 + (lane / 16) * 8);
#pragma unroll
    for (int np = 0; np < N / 16; ++np) {
      uint32_t b[4];  // column tiles 2 np and 2 np + 1, each its k halves
      ldmatrix_x4(b, b_rows + (np * 16 + (lane / 16) * 8 + lane % 8) * ld + kk * 16 + ((lane / 8) % 2) * 8);
      mma<Dt>(c[2 * np], a, b[0], b[1]);
      mma<Dt>(c[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// acc[D / 8] (a [16 x D] result) += a x with a the A operands of a [16 x N] matrix and x the N rows of a
// [.][ld] tile (row-major, D columns).
template <class Dt, int D, int N>
__device__ __forceinline__ void accumulate_products(float (&acc)[D / 8][4], const uint32_t (&a)[N / 16][4],
                                                    const Dt* x) {
  constexpr int ld = Layout<D>::ld;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int kk = 0; kk < N / 16; ++kk) {
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t b[4];  // column tiles 2 dp and 2 dp + 1, each its k halves
      ldmatrix_x4_trans(b, x + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * ld + dp * 16 + (lane / 16) * 8);
      mma<Dt>(acc[2 * dp], a[kk], b[0], b[1]);
      mma<Dt>(acc[2 * dp + 1], a[kk], b[2], b[3]);
    }
  }
}

// Row r of the warp's accumulators (half 0: row g, half 1: row g + 8) times `scale`, rounded once, into dst.
template <class Dt, int D>
__device__ __forceinline__ void store_row(Dt* dst, const float (&acc)[D / 8][4], int half, float scale) {
  const int t = threadIdx.x % 4;
  const bool pairs = (reinterpret_cast<uintptr_t>(dst) & 3) == 0;
#pragma unroll
  for (int dn = 0; dn < D / 8; ++dn) {
    const float x0 = scale * acc[dn][2 * half], x1 = scale * acc[dn][2 * half + 1];
    Dt* p = dst + dn * 8 + 2 * t;
    if (pairs) {
      *reinterpret_cast<uint32_t*>(p) = round_pair<Dt>(x0, x1);
    } else {
      p[0] = store<Dt>(x0);
      p[1] = store<Dt>(x1);
    }
  }
}

// The query tile of a block whose blockIdx.y counts the tiles from the last: the heaviest (most key tiles
// under the diagonal) is scheduled first.
__device__ __forceinline__ int64_t heaviest_first_query_tile() { return gridDim.y - 1 - blockIdx.y; }

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

template <class Dt, int D>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(Heads<const Dt> q, Heads<const Dt> k, Heads<const Dt> v, Heads<Dt> out, float* lse, int64_t T,
                   float scale) {
  constexpr int N = Layout<D>::nf, ld = Layout<D>::ld;
  extern __shared__ __align__(128) unsigned char smem[];
  Dt* q_tile = reinterpret_cast<Dt*>(smem);
  Dt* stages = q_tile + kRows * ld;  // stage s: k rows at stages + 2 s N ld, v rows N ld after
  const int64_t bh = blockIdx.x, q0 = heaviest_first_query_tile() * kRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row_lo = q0 + warp * 16 + lane / 4, row_hi = row_lo + 8;
  const float scale2 = scale * kLog2e;
  const int64_t key_end = T < q0 + kRows ? T : q0 + kRows;  // keys this block's rows see
  const int tiles = static_cast<int>((key_end + N - 1) / N);

  load_rows<D, kRows>(q_tile, q.head(bh), q.sT, q0, T);
  load_rows<D, N>(stages, k.head(bh), k.sT, 0, T);
  load_rows<D, N>(stages + N * ld, v.head(bh), v.sT, 0, T);
  cp_async_commit();

  float o[D / 8][4];
#pragma unroll
  for (int dn = 0; dn < D / 8; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.0f;
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.0f, l_hi = 0.0f;  // m in log2 units; l the lane's part
  for (int tile = 0; tile < tiles; ++tile) {
    const int64_t j0 = static_cast<int64_t>(tile) * N;
    const Dt* k_tile = stages + (tile % 2) * 2 * N * ld;
    const Dt* v_tile = k_tile + N * ld;
    if (tile + 1 < tiles) {
      Dt* next = stages + ((tile + 1) % 2) * 2 * N * ld;
      load_rows<D, N>(next, k.head(bh), k.sT, j0 + N, T);
      load_rows<D, N>(next + N * ld, v.head(bh), v.sT, j0 + N, T);
    }
    cp_async_commit();
    cp_async_wait<1>();  // this tile (and q) has landed
    __syncthreads();
    float s[N / 8][4];
    row_dots<Dt, D, N>(s, q_tile + warp * 16 * ld, k_tile);
    // Scale to log2 units and mask the keys after each row (and past T, which only rows past T could see).
    const bool masked = j0 + N - 1 > q0 + warp * 16;
    float max_lo = -INFINITY, max_hi = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < N / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t j = j0 + nt * 8 + 2 * (lane % 4) + e;
        s[nt][e] = masked && j > row_lo ? -INFINITY : s[nt][e] * scale2;
        s[nt][2 + e] = masked && j > row_hi ? -INFINITY : s[nt][2 + e] * scale2;
        max_lo = fmaxf(max_lo, s[nt][e]);
        max_hi = fmaxf(max_hi, s[nt][2 + e]);
      }
    const float new_lo = fmaxf(m_lo, quad_max(max_lo)), new_hi = fmaxf(m_hi, quad_max(max_hi));
    // A row that has seen no key yet keeps m = -inf: subtract 0 instead (its p are all 0).
    const float base_lo = new_lo == -INFINITY ? 0.0f : new_lo, base_hi = new_hi == -INFINITY ? 0.0f : new_hi;
    const float alpha_lo = exp2f(m_lo - base_lo), alpha_hi = exp2f(m_hi - base_hi);  // 0 on the first keys
    m_lo = new_lo;
    m_hi = new_hi;
#pragma unroll
    for (int nt = 0; nt < N / 8; ++nt) {
      s[nt][0] = exp2f(s[nt][0] - base_lo);
      s[nt][1] = exp2f(s[nt][1] - base_lo);
      s[nt][2] = exp2f(s[nt][2] - base_hi);
      s[nt][3] = exp2f(s[nt][3] - base_hi);
    }
    uint32_t p[N / 16][4];
    float sum_lo = 0.0f, sum_hi = 0.0f;
    to_operand<Dt, N>(p, s, sum_lo, sum_hi);
    l_lo = l_lo * alpha_lo + sum_lo;
    l_hi = l_hi * alpha_hi + sum_hi;
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
      o[dn][0] *= alpha_lo;
      o[dn][1] *= alpha_lo;
      o[dn][2] *= alpha_hi;
      o[dn][3] *= alpha_hi;
    }
    accumulate_products<Dt, D, N>(o, p, v_tile);
    __syncthreads();  // every warp is done with this stage before it is refilled
  }
  l_lo = quad_sum(l_lo);
  l_hi = quad_sum(l_hi);
  // A row below T sees key 0 at least, so l >= 1 (the max term is 2^0).
  if (row_lo < T) store_row<Dt, D>(out.head(bh) + row_lo * out.sT, o, 0, 1.0f / l_lo);
  if (row_hi < T) store_row<Dt, D>(out.head(bh) + row_hi * out.sT, o, 1, 1.0f / l_hi);
  if (lane % 4 == 0) {
    if (row_lo < T) lse[bh * T + row_lo] = m_lo * kLn2 + logf(l_lo);
    if (row_hi < T) lse[bh * T + row_hi] = m_hi * kLn2 + logf(l_hi);
  }
}

// dk, dv for 64 key rows (block (bh, key tile); blockIdx.y 0, the heaviest, first); streams the query tiles
// at or after the diagonal.
template <class Dt, int D>
__global__ void __launch_bounds__(kThreads)
    backward_dkdv_kernel(Heads<const Dt> q, Heads<const Dt> k, Heads<const Dt> v, Heads<const Dt> grad_out,
                         const float* lse, const float* delta, Heads<Dt> grad_k, Heads<Dt> grad_v, int64_t T,
                         float scale) {
  constexpr int N = Layout<D>::nb, ld = Layout<D>::ld;
  extern __shared__ __align__(128) unsigned char smem[];
  Dt* k_tile = reinterpret_cast<Dt*>(smem);
  Dt* v_tile = k_tile + kRows * ld;
  Dt* stages = v_tile + kRows * ld;  // stage s: q rows at stages + 2 s N ld, do rows N ld after
  float* stats = reinterpret_cast<float*>(stages + 2 * 2 * N * ld);  // stage s: lse2 at stats + 2 s N, delta after
  const int64_t bh = blockIdx.x, k0 = static_cast<int64_t>(blockIdx.y) * kRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t key_lo = k0 + warp * 16 + lane / 4, key_hi = key_lo + 8;
  const float scale2 = scale * kLog2e;
  const int tiles = static_cast<int>((T - k0 + N - 1) / N);  // query rows before k0 see none of these keys
  const float* lse_head = lse + bh * T;
  const float* delta_head = delta + bh * T;

  auto load_stage = [&](int tile) {
    const int64_t i0 = k0 + static_cast<int64_t>(tile) * N;
    Dt* q_stage = stages + (tile % 2) * 2 * N * ld;
    load_rows<D, N>(q_stage, q.head(bh), q.sT, i0, T);
    load_rows<D, N>(q_stage + N * ld, grad_out.head(bh), grad_out.sT, i0, T);
    float* st = stats + (tile % 2) * 2 * N;
    for (int c = threadIdx.x; c < N; c += kThreads) {
      const bool in = i0 + c < T;
      st[c] = in ? lse_head[i0 + c] * kLog2e : 0.0f;
      st[N + c] = in ? delta_head[i0 + c] : 0.0f;
    }
  };
  load_rows<D, kRows>(k_tile, k.head(bh), k.sT, k0, T);
  load_rows<D, kRows>(v_tile, v.head(bh), v.sT, k0, T);
  load_stage(0);
  cp_async_commit();

  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int dn = 0; dn < D / 8; ++dn) dk[dn][0] = dk[dn][1] = dk[dn][2] = dk[dn][3] = dv[dn][0] = dv[dn][1] =
      dv[dn][2] = dv[dn][3] = 0.0f;
  for (int tile = 0; tile < tiles; ++tile) {
    const int64_t i0 = k0 + static_cast<int64_t>(tile) * N;
    const Dt* q_stage = stages + (tile % 2) * 2 * N * ld;
    const Dt* do_stage = q_stage + N * ld;
    const float* lse2 = stats + (tile % 2) * 2 * N;
    const float* delta_stage = lse2 + N;
    if (tile + 1 < tiles) load_stage(tile + 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    // s^T = k q^T and dp^T = v do^T: the warp's 16 keys against the tile's N queries.
    float s[N / 8][4], dp[N / 8][4];
    row_dots<Dt, D, N>(s, k_tile + warp * 16 * ld, q_stage);
    row_dots<Dt, D, N>(dp, v_tile + warp * 16 * ld, do_stage);
    // Query i sees key j where i >= j (and i < T): masking is needed on the diagonal tiles and past T.
    const bool masked = i0 < k0 + warp * 16 + 16 || i0 + N > T;
#pragma unroll
    for (int nt = 0; nt < N / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = nt * 8 + 2 * (lane % 4) + e;
        const int64_t i = i0 + c;
        float p_lo = exp2f(s[nt][e] * scale2 - lse2[c]), p_hi = exp2f(s[nt][2 + e] * scale2 - lse2[c]);
        if (masked) {
          if (i < key_lo || i >= T) p_lo = 0.0f;
          if (i < key_hi || i >= T) p_hi = 0.0f;
        }
        s[nt][e] = p_lo;
        s[nt][2 + e] = p_hi;
        dp[nt][e] = p_lo * (dp[nt][e] - delta_stage[c]);
        dp[nt][2 + e] = p_hi * (dp[nt][2 + e] - delta_stage[c]);
      }
    uint32_t p_op[N / 16][4], ds_op[N / 16][4];
    float unused_lo = 0.0f, unused_hi = 0.0f;
    to_operand<Dt, N>(p_op, s, unused_lo, unused_hi);
    to_operand<Dt, N>(ds_op, dp, unused_lo, unused_hi);
    accumulate_products<Dt, D, N>(dv, p_op, do_stage);  // dv += p^T do
    accumulate_products<Dt, D, N>(dk, ds_op, q_stage);  // dk += ds^T q
    __syncthreads();
  }
  if (key_lo < T) {
    store_row<Dt, D>(grad_k.head(bh) + key_lo * grad_k.sT, dk, 0, scale);
    store_row<Dt, D>(grad_v.head(bh) + key_lo * grad_v.sT, dv, 0, 1.0f);
  }
  if (key_hi < T) {
    store_row<Dt, D>(grad_k.head(bh) + key_hi * grad_k.sT, dk, 1, scale);
    store_row<Dt, D>(grad_v.head(bh) + key_hi * grad_v.sT, dv, 1, 1.0f);
  }
}

// dq for 64 query rows (block (bh, query tile)); streams the key tiles at or before the diagonal.
template <class Dt, int D>
__global__ void __launch_bounds__(kThreads)
    backward_dq_kernel(Heads<const Dt> q, Heads<const Dt> k, Heads<const Dt> v, Heads<const Dt> grad_out,
                       const float* lse, const float* delta, Heads<Dt> grad_q, int64_t T, float scale) {
  constexpr int N = Layout<D>::nb, ld = Layout<D>::ld;
  extern __shared__ __align__(128) unsigned char smem[];
  Dt* q_tile = reinterpret_cast<Dt*>(smem);
  Dt* do_tile = q_tile + kRows * ld;
  Dt* stages = do_tile + kRows * ld;  // stage s: k rows at stages + 2 s N ld, v rows N ld after
  const int64_t bh = blockIdx.x, q0 = heaviest_first_query_tile() * kRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row_lo = q0 + warp * 16 + lane / 4, row_hi = row_lo + 8;
  const float scale2 = scale * kLog2e;
  const float lse2_lo = row_lo < T ? lse[bh * T + row_lo] * kLog2e : 0.0f;
  const float lse2_hi = row_hi < T ? lse[bh * T + row_hi] * kLog2e : 0.0f;
  const float delta_lo = row_lo < T ? delta[bh * T + row_lo] : 0.0f;
  const float delta_hi = row_hi < T ? delta[bh * T + row_hi] : 0.0f;
  const int64_t key_end = T < q0 + kRows ? T : q0 + kRows;
  const int tiles = static_cast<int>((key_end + N - 1) / N);

  load_rows<D, kRows>(q_tile, q.head(bh), q.sT, q0, T);
  load_rows<D, kRows>(do_tile, grad_out.head(bh), grad_out.sT, q0, T);
  load_rows<D, N>(stages, k.head(bh), k.sT, 0, T);
  load_rows<D, N>(stages + N * ld, v.head(bh), v.sT, 0, T);
  cp_async_commit();

  float dq[D / 8][4];
#pragma unroll
  for (int dn = 0; dn < D / 8; ++dn) dq[dn][0] = dq[dn][1] = dq[dn][2] = dq[dn][3] = 0.0f;
  for (int tile = 0; tile < tiles; ++tile) {
    const int64_t j0 = static_cast<int64_t>(tile) * N;
    const Dt* k_stage = stages + (tile % 2) * 2 * N * ld;
    const Dt* v_stage = k_stage + N * ld;
    if (tile + 1 < tiles) {
      Dt* next = stages + ((tile + 1) % 2) * 2 * N * ld;
      load_rows<D, N>(next, k.head(bh), k.sT, j0 + N, T);
      load_rows<D, N>(next + N * ld, v.head(bh), v.sT, j0 + N, T);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    float s[N / 8][4], dp[N / 8][4];
    row_dots<Dt, D, N>(s, q_tile + warp * 16 * ld, k_stage);   // s = q k^T
    row_dots<Dt, D, N>(dp, do_tile + warp * 16 * ld, v_stage);  // dp = do v^T
    const bool masked = j0 + N - 1 > q0 + warp * 16;
#pragma unroll
    for (int nt = 0; nt < N / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t j = j0 + nt * 8 + 2 * (lane % 4) + e;
        float p_lo = exp2f(s[nt][e] * scale2 - lse2_lo), p_hi = exp2f(s[nt][2 + e] * scale2 - lse2_hi);
        if (masked) {
          if (j > row_lo) p_lo = 0.0f;
          if (j > row_hi) p_hi = 0.0f;
        }
        dp[nt][e] = p_lo * (dp[nt][e] - delta_lo);
        dp[nt][2 + e] = p_hi * (dp[nt][2 + e] - delta_hi);
      }
    uint32_t ds_op[N / 16][4];
    float unused_lo = 0.0f, unused_hi = 0.0f;
    to_operand<Dt, N>(ds_op, dp, unused_lo, unused_hi);
    accumulate_products<Dt, D, N>(dq, ds_op, k_stage);  // dq += ds k
    __syncthreads();
  }
  if (row_lo < T) store_row<Dt, D>(grad_q.head(bh) + row_lo * grad_q.sT, dq, 0, scale);
  if (row_hi < T) store_row<Dt, D>(grad_q.head(bh) + row_hi * grad_q.sT, dq, 1, scale);
}

// Opts a kernel into more than 48 KiB of dynamic shared memory (once per instantiation and device; cheap).
template <class Kernel>
void allow_shared_bytes(Kernel kernel, size_t bytes) {
  MIXTAPE_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
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

void CudaBackend::causal_attention_kernel(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                                          const Tensor& out, const Tensor& lse) {
  const char* op = "causal_attention";
  const int64_t B = q.shape()[0], H = q.shape()[1], T = q.shape()[2], D = q.shape()[3];
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

void CudaBackend::causal_attention_backward_kernel(const Tensor& grad_out, const Tensor& q, const Tensor& k,
                                                   const Tensor& v, const Tensor& out, const Tensor& lse, double scale,
                                                   const Tensor& grad_q, const Tensor& grad_k, const Tensor& grad_v) {
  const char* op = "causal_attention_backward";
  const int64_t B = q.shape()[0], H = q.shape()[1], T = q.shape()[2], D = q.shape()[3];
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
