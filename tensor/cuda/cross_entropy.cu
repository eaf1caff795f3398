// Softmax cross-entropy on CUDA: the forward and the fused backward, with the math of
// tensor/cpu/cross_entropy.cpp (f16/bf16/f32 compute in float, f64 in double; lse saved in that type).
//
// Forward: one block per row of logits [N, V] (32..512 threads by V) computes
//   lse_i = m + log(sum_j e^(x_ij - m)),  m = the row max (0 when it is not finite, as on the CPU),
// folding the row in groups of kFold<D> elements (vector loads when aligned): 4 for f32 and for 16-bit logits
// alike, so a 16-bit row folds exactly as its widened f32 copy does (the same threads, groups and tree: the
// same bits; autocast's front end reads 16-bit logits in place because of it, tensor/ops_fused.cpp);
// then one block sums (lse_i - x_{i, t_i}) over the counted rows in double in a fixed tree (thread t takes
// rows t, t + 256, ...; a fixed shuffle/shared-memory tree combines them), so the loss is reproducible bit
// for bit; loss = total / count, 0 when no row counts.
// Backward: one block counts the counted rows into a device scalar; then one block per row writes
//   grad_ij = (e^(x_ij - lse_i) - [j == t_i]) * g / count   (0 for ignored rows)
// straight into grad_logits.
#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "tensor/cuda/common.cuh"
#include "tensor/cuda/cuda_backend.h"

namespace mixtape::cuda {

namespace {

// One block per row: the shared helpers of tensor/cuda/common.cuh.
using rowwise::block_reduce;
using rowwise::can_vectorise;
using rowwise::dev_exp;
using rowwise::dev_log;
using rowwise::load_group;
using rowwise::MaxOp;
using rowwise::Pack;
using rowwise::row_blocks;
using rowwise::row_threads;
using rowwise::store_group;
using rowwise::SumOp;
using rowwise::thread_row_fold;

// Additions, subtractions and products rounded on their own, never fused into an FMA with e^x's last product:
// nvcc may contract differently in each instantiation, and the 16-bit kernels must give the f32 kernel's bits.
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }

// Elements per group of the lse fold: the accumulation type's 16-byte width (4 for f32/f16/bf16, 2 for f64).
template <class D>
constexpr int kFold = Pack<device_acc_t<D>>::kSize;

// lse[i] = log sum_j e^(x_ij), shifted by the row max when it is finite.
template <class D, bool kVec>
__global__ void row_lse_kernel(const D* __restrict__ logits, device_acc_t<D>* __restrict__ lse, int64_t N,
                               int64_t V) {
  using A = device_acc_t<D>;
  __shared__ A shared[32];
  for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
    const D* xi = logits + i * V;
    const A m = block_reduce(thread_row_fold<D, A, kVec, kFold<D>>(xi, V, A(-INFINITY), MaxOp{}), shared, MaxOp{});
    const A shift = isfinite(m) ? m : A(0);
    const A sum_exp =
        thread_row_fold<D, A, kVec, kFold<D>>(xi, V, A(0), [=](A acc, A v) { return add_rn(acc, dev_exp(v - shift)); });
    const A sum = block_reduce(sum_exp, shared, SumOp{});
    if (threadIdx.x == 0) lse[i] = shift + dev_log(sum);
  }
}

constexpr int kLossThreads = 256;

// One block: loss = (sum over counted rows of double(lse_i - x_{i, t_i})) / count, 0 when count is 0.
template <class D, class I>
__global__ void loss_kernel(const D* __restrict__ logits, const I* __restrict__ target,
                            const device_acc_t<D>* __restrict__ lse, int64_t N, int64_t V, int64_t ignore_index,
                            device_acc_t<D>* __restrict__ loss) {
  using A = device_acc_t<D>;
  __shared__ double shared_total[32];
  __shared__ long long shared_count[32];
  double total = 0;
  long long count = 0;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
    const int64_t t = static_cast<int64_t>(target[i]);
    if (t == ignore_index) continue;
    total += static_cast<double>(lse[i] - load_as<A>(logits[i * V + t]));
    ++count;
  }
  total = block_reduce(total, shared_total, SumOp{});
  count = block_reduce(count, shared_count, SumOp{});
  if (threadIdx.x == 0)
    loss[0] = count > 0 ? static_cast<A>(total / static_cast<double>(count)) : A(0);
}

// One block: count[0] = the number of rows whose target is not ignore_index.
template <class I>
__global__ void count_kernel(const I* __restrict__ target, int64_t N, int64_t ignore_index,
                             long long* __restrict__ count_out) {
  __shared__ long long shared[32];
  long long count = 0;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x) count += static_cast<int64_t>(target[i]) != ignore_index;
  count = block_reduce(count, shared, SumOp{});
  if (threadIdx.x == 0) count_out[0] = count;
}

// grad row i = (e^(x_ij - lse_i) - [j == t_i]) * grad_loss / count, or 0 for an ignored row.
template <class D, class I, bool kVec>
__global__ void cross_entropy_backward_kernel(const device_acc_t<D>* __restrict__ grad_loss,
                                              const D* __restrict__ logits, const I* __restrict__ target,
                                              const device_acc_t<D>* __restrict__ lse,
                                              const long long* __restrict__ count_in, int64_t N, int64_t V,
                                              int64_t ignore_index, D* __restrict__ grad) {
  using A = device_acc_t<D>;
  constexpr int W = Pack<D>::kSize;
  const int64_t groups = (V + W - 1) / W;
  const long long count = count_in[0];
  // As the CPU: row_scale = g / count (0 when nothing counts), formed once in A.
  const A row_scale = count > 0 ? grad_loss[0] / static_cast<A>(count) : A(0);
  for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
    const D* xi = logits + i * V;
    D* gi = grad + i * V;
    const int64_t t = static_cast<int64_t>(target[i]);
    const bool ignored = t == ignore_index;
    const A l = ignored ? A(0) : lse[i];
    for (int64_t k = threadIdx.x; k < groups; k += blockDim.x) {
      A v[W], o[W];
      load_group<D, A, kVec>(xi, k, V, v);
#pragma unroll
      for (int e = 0; e < W; ++e) {
        const int64_t j = k * W + e;
        const A p = dev_exp(v[e] - l);
        if (ignored)
          o[e] = A(0);
        else if (j == t)  // (p - 1) formed in A before the one rounding
          o[e] = mul_rn(sub_rn(p, A(1)), row_scale);
        else
          o[e] = mul_rn(p, row_scale);
      }
      store_group<D, A, kVec>(gi, k, V, o);
    }
  }
}

}  // namespace

void CudaBackend::softmax_cross_entropy_kernel(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                                               const Tensor& loss, const Tensor& lse) {
  const char* op = "softmax_cross_entropy";
  const int64_t N = logits.shape()[0], V = logits.shape()[1];
  cudaStream_t s = stream();
  dispatch_float(logits.dtype(), op, [&]<typename T>() {
    using D = device_t<T>;
    using A = device_acc_t<D>;
    const D* x = device_ptr<T>(logits);
    A* lse_out = static_cast<A*>(lse.data_ptr());
    if (N > 0) {
      const int threads = row_threads((V + kFold<D> - 1) / kFold<D>);
      if (can_vectorise<D, kFold<D>>(V, {x}))
        row_lse_kernel<D, true><<<row_blocks(N), threads, 0, s>>>(x, lse_out, N, V);
      else
        row_lse_kernel<D, false><<<row_blocks(N), threads, 0, s>>>(x, lse_out, N, V);
      MIXTAPE_KERNEL_CHECK();
    }
    dispatch_index(targets.dtype(), op, [&]<typename I>() {
      loss_kernel<D, I><<<1, kLossThreads, 0, s>>>(x, static_cast<const I*>(targets.data_ptr()), lse_out, N, V,
                                                   ignore_index, static_cast<A*>(loss.data_ptr()));
      MIXTAPE_KERNEL_CHECK();
    });
  });
}

void CudaBackend::softmax_cross_entropy_backward_kernel(const Tensor& grad_loss, const Tensor& logits,
                                                        const Tensor& targets, const Tensor& lse, int64_t ignore_index,
                                                        const Tensor& grad_logits) {
  const char* op = "softmax_cross_entropy_backward";
  const int64_t N = logits.shape()[0], V = logits.shape()[1];
  if (N == 0 || V == 0) return;
  cudaStream_t s = stream();
  Tensor count = Tensor::empty({1}, DType::I64, logits.device());
  auto* count_ptr = static_cast<long long*>(count.data_ptr());
  dispatch_float(logits.dtype(), op, [&]<typename T>() {
    using D = device_t<T>;
    using A = device_acc_t<D>;
    dispatch_index(targets.dtype(), op, [&]<typename I>() {
      const I* target = static_cast<const I*>(targets.data_ptr());
      count_kernel<I><<<1, kLossThreads, 0, s>>>(target, N, ignore_index, count_ptr);
      MIXTAPE_KERNEL_CHECK();
      const D* x = device_ptr<T>(logits);
      D* grad = device_ptr<T>(grad_logits);
      const A* g = static_cast<const A*>(grad_loss.data_ptr());
      const A* l = static_cast<const A*>(lse.data_ptr());
      const int threads = row_threads((V + Pack<D>::kSize - 1) / Pack<D>::kSize);
      if (can_vectorise<D>(V, {x, grad}))
        cross_entropy_backward_kernel<D, I, true><<<row_blocks(N), threads, 0, s>>>(g, x, target, l, count_ptr, N, V,
                                                                                     ignore_index, grad);
      else
        cross_entropy_backward_kernel<D, I, false><<<row_blocks(N), threads, 0, s>>>(g, x, target, l, count_ptr, N,
                                                                                      V, ignore_index, grad);
      MIXTAPE_KERNEL_CHECK();
    });
  });
}

}  // namespace mixtape::cuda
