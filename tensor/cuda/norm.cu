// Fused layer_norm / rms_norm, forward and backward, on CUDA: the same math and accumulation types as
// tensor/cpu/norm.cpp (f16/bf16/f32 in float, f64 in double, one rounding on store; mean/rstd saved in
// f32, f64 for f64).
//
// x is [N, C] contiguous rows. Forward: one block per row (32..512 threads, by C), threads reading groups of
// 16 bytes when every operand is 16-byte aligned and C is a multiple of the group, element by element
// otherwise. The statistics are the CPU's: the row is shifted by its first element, mean = x_0 + dm with
// dm = 1/C sum (x_j - x_0), var = 1/C sum (x_j - x_0 - dm)^2 (two passes), rstd = 1 / sqrt(var + eps).
// Block sums use a fixed shuffle tree, so results are bitwise the same run to run.
//
// Backward: grad_x by one block per row (two passes: the two row sums, then dx). grad_weight / grad_bias are
// reduced over rows without atomics: rows are cut into chunks whose size depends on N only; one thread per
// (chunk, column) sums its chunk's rows in order into a scratch [chunks, C] (acc type), and a second kernel
// sums each column's partials in chunk order and rounds once. Reproducible bit for bit.
#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "tensor/cuda/common.cuh"
#include "tensor/cuda/cuda_backend.h"

namespace mixtape::cuda {

namespace {

// One block per row: the shared helpers of tensor/cuda/common.cuh.
using rowwise::block_sum;
using rowwise::can_vectorise;
using rowwise::dev_sqrt;
using rowwise::load_group;
using rowwise::Pack;
using rowwise::row_blocks;
using rowwise::row_threads;
using rowwise::store_group;
using rowwise::thread_row_fold;

// ---- forward ----------------------------------------------------------------------------------------------

// kMean: layer_norm (shifted two-pass statistics, bias); otherwise rms_norm (rstd = 1/sqrt(mean(x^2) + eps)).
template <class D, bool kVec, bool kMean>
__global__ void norm_forward_kernel(const D* __restrict__ x, const D* __restrict__ w, const D* __restrict__ b,
                                    D* __restrict__ out, device_acc_t<D>* __restrict__ mean_out,
                                    device_acc_t<D>* __restrict__ rstd_out, int64_t N, int64_t C,
                                    device_acc_t<D> eps) {
  using A = device_acc_t<D>;
  constexpr int V = Pack<D>::kSize;
  __shared__ A shared[32];
  const int64_t groups = (C + V - 1) / V;
  const A inv_C = A(1) / static_cast<A>(C);
  for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
    const D* xi = x + i * C;
    D* oi = out + i * C;
    A shift = A(0), dm = A(0), s;
    if constexpr (kMean) {
      shift = C > 0 ? load_as<A>(xi[0]) : A(0);
      const A sum_shifted =
          thread_row_fold<D, A, kVec>(xi, C, A(0), [=](A acc, A v) { return acc + (v - shift); });
      dm = block_sum(sum_shifted, shared) * inv_C;
      const A sum_squares = thread_row_fold<D, A, kVec>(xi, C, A(0), [=](A acc, A v) {
        const A d = (v - shift) - dm;
        return acc + d * d;
      });
      const A var = block_sum(sum_squares, shared) * inv_C;
      s = A(1) / dev_sqrt(var + eps);
    } else {
      const A sum_squares = thread_row_fold<D, A, kVec>(xi, C, A(0), [](A acc, A v) { return acc + v * v; });
      const A ms = block_sum(sum_squares, shared) * inv_C;
      s = A(1) / dev_sqrt(ms + eps);
    }
    for (int64_t k = threadIdx.x; k < groups; k += blockDim.x) {
      A v[V], wv[V], bv[V];
      load_group<D, A, kVec>(xi, k, C, v);
      if (w) load_group<D, A, kVec>(w, k, C, wv);
      if (kMean && b) load_group<D, A, kVec>(b, k, C, bv);
      A o[V];
#pragma unroll
      for (int e = 0; e < V; ++e) {
        if constexpr (kMean) {
          const A norm = ((v[e] - shift) - dm) * s;
          if (w && b)
            o[e] = norm * wv[e] + bv[e];
          else if (w)
            o[e] = norm * wv[e];
          else if (b)
            o[e] = norm + bv[e];
          else
            o[e] = norm;
        } else {
          o[e] = w ? v[e] * s * wv[e] : v[e] * s;
        }
      }
      store_group<D, A, kVec>(oi, k, C, o);
    }
    if (threadIdx.x == 0) {
      if (kMean && mean_out) mean_out[i] = shift + dm;
      if (rstd_out) rstd_out[i] = s;
    }
  }
}

// ---- backward: grad_x -------------------------------------------------------------------------------------

//   norm_j = (x_j - mean) * rstd (x_j * rstd for rms_norm);  dnorm_j = w_j * g_j
//   dx_j = rstd * (dnorm_j - mean_k(dnorm_k) - norm_j * mean_k(dnorm_k * norm_k))   (no mean term for rms)
template <class D, bool kVec, bool kMean>
__global__ void norm_backward_dx_kernel(const D* __restrict__ g, const D* __restrict__ x, const D* __restrict__ w,
                                        const device_acc_t<D>* __restrict__ mean,
                                        const device_acc_t<D>* __restrict__ rstd, D* __restrict__ dx, int64_t N,
                                        int64_t C) {
  using A = device_acc_t<D>;
  constexpr int V = Pack<D>::kSize;
  __shared__ A shared[32];
  const int64_t groups = (C + V - 1) / V;
  const A inv_C = A(1) / static_cast<A>(C);
  for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
    const D* xi = x + i * C;
    const D* gi = g + i * C;
    D* di = dx + i * C;
    const A m = kMean ? mean[i] : A(0), s = rstd[i];
    A acc_dnorm = A(0), acc_dnorm_norm = A(0);
    for (int64_t k = threadIdx.x; k < groups; k += blockDim.x) {
      A xv[V], gv[V], wv[V];
      load_group<D, A, kVec>(xi, k, C, xv);
      load_group<D, A, kVec>(gi, k, C, gv);
      if (w) load_group<D, A, kVec>(w, k, C, wv);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        if (kVec || k * V + e < C) {
          const A norm = kMean ? (xv[e] - m) * s : xv[e] * s;
          const A dnorm = w ? wv[e] * gv[e] : gv[e];
          if (kMean) acc_dnorm += dnorm;
          acc_dnorm_norm += dnorm * norm;
        }
      }
    }
    const A dnorm_mean = kMean ? block_sum(acc_dnorm, shared) * inv_C : A(0);
    const A dnorm_norm_mean = block_sum(acc_dnorm_norm, shared) * inv_C;
    for (int64_t k = threadIdx.x; k < groups; k += blockDim.x) {
      A xv[V], gv[V], wv[V], o[V];
      load_group<D, A, kVec>(xi, k, C, xv);
      load_group<D, A, kVec>(gi, k, C, gv);
      if (w) load_group<D, A, kVec>(w, k, C, wv);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const A dnorm = w ? wv[e] * gv[e] : gv[e];
        if constexpr (kMean) {
          const A norm = (xv[e] - m) * s;
          o[e] = s * (dnorm - dnorm_mean - norm * dnorm_norm_mean);
        } else {
          const A norm = xv[e] * s;
          o[e] = s * (dnorm - norm * dnorm_norm_mean);
        }
      }
      store_group<D, A, kVec>(di, k, C, o);
    }
  }
}

// ---- backward: grad_weight / grad_bias --------------------------------------------------------------------

// Thread (column c, chunk blockIdx.y) sums rows [chunk * rows_per_chunk, ...) in order:
//   partial_w[chunk, c] = sum g_ic * norm_ic,  partial_b[chunk, c] = sum g_ic   (partial_b may be null)
template <class D, bool kMean>
__global__ void norm_weight_partial_kernel(const D* __restrict__ g, const D* __restrict__ x,
                                           const device_acc_t<D>* __restrict__ mean,
                                           const device_acc_t<D>* __restrict__ rstd, int64_t N, int64_t C,
                                           int64_t rows_per_chunk, device_acc_t<D>* __restrict__ partial_w,
                                           device_acc_t<D>* __restrict__ partial_b) {
  using A = device_acc_t<D>;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t chunk = blockIdx.y;
  const int64_t begin = chunk * rows_per_chunk;
  const int64_t end = begin + rows_per_chunk < N ? begin + rows_per_chunk : N;
  A sw = A(0), sb = A(0);
  for (int64_t r = begin; r < end; ++r) {
    const A gv = load_as<A>(g[r * C + c]);
    const A xv = load_as<A>(x[r * C + c]);
    const A norm = kMean ? (xv - mean[r]) * rstd[r] : xv * rstd[r];
    sw += gv * norm;
    sb += gv;
  }
  if (partial_w) partial_w[chunk * C + c] = sw;
  if (partial_b) partial_b[chunk * C + c] = sb;
}

// out[c] = sum over chunks (in order) of partial[chunk, c], rounded once; 0 when there are no chunks.
// A few blocks of threads (one per column) each sum up to 1024 partials: the loads are issued kBatch at a time
// before their (sequential, in-order) additions, so the time is a few memory latencies per batch, not one per
// partial (the same sums in the same order, so the same bits).
template <class D>
__global__ void combine_partials_kernel(const device_acc_t<D>* __restrict__ partial, int64_t chunks, int64_t C,
                                        D* __restrict__ out) {
  using A = device_acc_t<D>;
  constexpr int kBatch = 32;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < C;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    A s = A(0);
    int64_t k = 0;
    for (; k + kBatch <= chunks; k += kBatch) {
      A v[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) v[u] = partial[(k + u) * C + c];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) s += v[u];
    }
    for (; k < chunks; ++k) s += partial[k * C + c];
    out[c] = store<D>(s);
  }
}

// Rows per chunk of the weight reduction: a function of N only (at most 1024 chunks, at least 32 rows each).
int64_t rows_per_chunk(int64_t N) { return std::max<int64_t>(32, (N + 1023) / 1024); }

template <class T>
device_t<T>* ptr_or_null(const Tensor& t) {
  return t.defined() ? device_ptr<T>(t) : nullptr;
}
template <class A>
A* acc_ptr_or_null(const Tensor& t) {
  return t.defined() ? static_cast<A*>(t.data_ptr()) : nullptr;
}

template <class D, bool kMean>
void launch_forward(cudaStream_t stream, const D* x, const D* w, const D* b, D* out, device_acc_t<D>* mean,
                    device_acc_t<D>* rstd, int64_t N, int64_t C, double eps) {
  if (N == 0) return;
  const int64_t groups = (C + Pack<D>::kSize - 1) / Pack<D>::kSize;
  const int threads = row_threads(groups);
  const auto e = static_cast<device_acc_t<D>>(eps);
  if (can_vectorise<D>(C, {x, w, b, out}))
    norm_forward_kernel<D, true, kMean><<<row_blocks(N), threads, 0, stream>>>(x, w, b, out, mean, rstd, N, C, e);
  else
    norm_forward_kernel<D, false, kMean><<<row_blocks(N), threads, 0, stream>>>(x, w, b, out, mean, rstd, N, C, e);
  MIXTAPE_KERNEL_CHECK();
}

// grad_x (when dx is not null) and the weight / bias reductions (when dw / db are not null).
template <class D, bool kMean>
void launch_backward(cudaStream_t stream, Device device, const D* g, const D* x, const D* w,
                     const device_acc_t<D>* mean, const device_acc_t<D>* rstd, D* dx, D* dw, D* db, int64_t N,
                     int64_t C) {
  using A = device_acc_t<D>;
  if (dx && N > 0) {
    const int64_t groups = (C + Pack<D>::kSize - 1) / Pack<D>::kSize;
    const int threads = row_threads(groups);
    if (can_vectorise<D>(C, {g, x, w, dx}))
      norm_backward_dx_kernel<D, true, kMean><<<row_blocks(N), threads, 0, stream>>>(g, x, w, mean, rstd, dx, N, C);
    else
      norm_backward_dx_kernel<D, false, kMean><<<row_blocks(N), threads, 0, stream>>>(g, x, w, mean, rstd, dx, N, C);
    MIXTAPE_KERNEL_CHECK();
  }
  if ((!dw && !db) || C == 0) return;
  const int64_t per_chunk = rows_per_chunk(N);
  const int64_t chunks = (N + per_chunk - 1) / per_chunk;
  const DType acc_dtype = sizeof(A) == 8 ? DType::F64 : DType::F32;
  // Scratch from the caching allocator; freed (stream-ordered) when these tensors go out of scope.
  Tensor partial_w, partial_b;
  if (dw) partial_w = Tensor::empty({std::max<int64_t>(chunks, 1), C}, acc_dtype, device);
  if (db) partial_b = Tensor::empty({std::max<int64_t>(chunks, 1), C}, acc_dtype, device);
  A* pw = dw ? static_cast<A*>(partial_w.data_ptr()) : nullptr;
  A* pb = db ? static_cast<A*>(partial_b.data_ptr()) : nullptr;
  if (chunks > 0) {
    const dim3 grid(static_cast<unsigned>((C + kThreads - 1) / kThreads), static_cast<unsigned>(chunks));
    norm_weight_partial_kernel<D, kMean><<<grid, kThreads, 0, stream>>>(g, x, mean, rstd, N, C, per_chunk, pw, pb);
    MIXTAPE_KERNEL_CHECK();
  }
  if (dw) {
    combine_partials_kernel<D><<<blocks_for(C), kThreads, 0, stream>>>(pw, chunks, C, dw);
    MIXTAPE_KERNEL_CHECK();
  }
  if (db) {
    combine_partials_kernel<D><<<blocks_for(C), kThreads, 0, stream>>>(pb, chunks, C, db);
    MIXTAPE_KERNEL_CHECK();
  }
}

}  // namespace

// ---- layer_norm ------------------------------------------------------------------------------------------

void CudaBackend::layer_norm_kernel(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                                    const Tensor& out, const Tensor& mean, const Tensor& rstd) {
  const int64_t N = x.shape()[0], C = x.shape()[1];
  dispatch_float(x.dtype(), "layer_norm", [&]<typename T>() {
    using D = device_t<T>;
    using A = device_acc_t<D>;
    launch_forward<D, true>(stream(), device_ptr<T>(x), ptr_or_null<T>(weight), ptr_or_null<T>(bias),
                            device_ptr<T>(out), acc_ptr_or_null<A>(mean), acc_ptr_or_null<A>(rstd), N, C, eps);
  });
}

void CudaBackend::layer_norm_backward_kernel(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                                             const Tensor& mean, const Tensor& rstd, const Tensor& grad_x,
                                             const Tensor& grad_weight, const Tensor& grad_bias) {
  const int64_t N = x.shape()[0], C = x.shape()[1];
  dispatch_float(x.dtype(), "layer_norm_backward", [&]<typename T>() {
    using D = device_t<T>;
    using A = device_acc_t<D>;
    launch_backward<D, true>(stream(), x.device(), device_ptr<T>(grad_out), device_ptr<T>(x),
                             ptr_or_null<T>(weight), acc_ptr_or_null<A>(mean), acc_ptr_or_null<A>(rstd),
                             ptr_or_null<T>(grad_x), ptr_or_null<T>(grad_weight), ptr_or_null<T>(grad_bias), N, C);
  });
}

// ---- rms_norm --------------------------------------------------------------------------------------------

void CudaBackend::rms_norm_kernel(const Tensor& x, const Tensor& weight, double eps, const Tensor& out,
                                  const Tensor& rstd) {
  const int64_t N = x.shape()[0], C = x.shape()[1];
  dispatch_float(x.dtype(), "rms_norm", [&]<typename T>() {
    using D = device_t<T>;
    using A = device_acc_t<D>;
    launch_forward<D, false>(stream(), device_ptr<T>(x), ptr_or_null<T>(weight), static_cast<const D*>(nullptr),
                             device_ptr<T>(out), static_cast<A*>(nullptr), acc_ptr_or_null<A>(rstd), N, C, eps);
  });
}

void CudaBackend::rms_norm_backward_kernel(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                                           const Tensor& rstd, const Tensor& grad_x, const Tensor& grad_weight) {
  const int64_t N = x.shape()[0], C = x.shape()[1];
  dispatch_float(x.dtype(), "rms_norm_backward", [&]<typename T>() {
    using D = device_t<T>;
    using A = device_acc_t<D>;
    launch_backward<D, false>(stream(), x.device(), device_ptr<T>(grad_out), device_ptr<T>(x),
                              ptr_or_null<T>(weight), static_cast<const A*>(nullptr), acc_ptr_or_null<A>(rstd),
                              ptr_or_null<T>(grad_x), ptr_or_null<T>(grad_weight), static_cast<D*>(nullptr), N, C);
  });
}

}  // namespace mixtape::cuda
