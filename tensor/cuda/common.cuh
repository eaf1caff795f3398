#pragma once
// What every CUDA kernel file shares: checked calls (failures become mixtape::Error naming the call, the
// file:line and the library's error string), the device element types behind Half/BFloat16, conversions
// that round like the CPU (nearest even, once, on store), strided offset calculators and launch shapes.
// Included only by tensor/cuda/*.cu.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "tensor/dtype.h"
#include "tensor/error.h"
#include "tensor/tensor.h"

namespace mixtape::cuda {

// ---- checked calls -------------------------------------------------------------------------------------

[[noreturn]] void fail_call(const char* library, const char* call, const char* file, int line, int code,
                            const char* message);

inline void check_cuda(cudaError_t status, const char* call, const char* file, int line) {
  if (status != cudaSuccess) [[unlikely]]
    fail_call("CUDA", call, file, line, static_cast<int>(status), cudaGetErrorString(status));
}
inline void check_cublas(cublasStatus_t status, const char* call, const char* file, int line) {
  if (status != CUBLAS_STATUS_SUCCESS) [[unlikely]]
    fail_call("cuBLAS", call, file, line, static_cast<int>(status), cublasGetStatusString(status));
}

// MIXTAPE_CUDA_CHECK(cudaMemcpyAsync(...)) throws "CUDA call 'cudaMemcpyAsync(...)' failed at
// tensor/cuda/x.cu:12: invalid argument (error 1)".
#define MIXTAPE_CUDA_CHECK(call) ::mixtape::cuda::check_cuda((call), #call, __FILE__, __LINE__)
#define MIXTAPE_CUBLAS_CHECK(call) ::mixtape::cuda::check_cublas((call), #call, __FILE__, __LINE__)
// After every kernel launch: a bad launch configuration surfaces here, at the launch that caused it.
#define MIXTAPE_KERNEL_CHECK() ::mixtape::cuda::check_cuda(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)

// The plan for a key (its words), built by make() on first use and kept for the process: one cache per
// call site (make's type). Never evicted one by one (a model has a handful of shapes); cleared if it ever
// grows past 4096 plans (shapes that change every step). Callers in flight keep theirs alive through the
// shared_ptr.
template <class Plan, class Make>
std::shared_ptr<Plan> cached_plan(std::vector<int64_t> words, const Make& make) {
  struct WordsHash {
    size_t operator()(const std::vector<int64_t>& key) const {
      uint64_t h = 1469598103934665603ull;  // FNV-1a over the 64-bit words
      for (int64_t v : key) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
      return static_cast<size_t>(h);
    }
  };
  static std::mutex mutex;
  static std::unordered_map<std::vector<int64_t>, std::shared_ptr<Plan>, WordsHash> plans;
  constexpr size_t kMaxPlans = 4096;
  std::lock_guard lock(mutex);
  auto it = plans.find(words);
  if (it != plans.end()) return it->second;
  if (plans.size() >= kMaxPlans) plans.clear();
  std::shared_ptr<Plan> plan = make();
  plans.emplace(std::move(words), plan);
  return plan;
}

// One algorithm from cuBLASLt's heuristic for the matmul of desc over layouts a, b and d (d also C), under
// mixtape's preferences: at most `workspace` bytes, split-K only with partial sums kept in the compute type, and
// the operands' alignments in bytes (A and B in cuBLASLt's order). Returns the heuristic call's status; the
// algorithm is in *result when it is CUBLAS_STATUS_SUCCESS, *count >= 1 and result->state is SUCCESS.
inline cublasStatus_t lt_heuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
                                   cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t d, uint32_t a_align,
                                   uint32_t b_align, uint32_t d_align, uint64_t workspace,
                                   cublasLtMatmulHeuristicResult_t* result, int* count) {
  cublasLtMatmulPreference_t preference = nullptr;
  MIXTAPE_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference));
  // The preference is destroyed on every path (a failed check below throws).
  struct PreferenceGuard {
    cublasLtMatmulPreference_t p;
    ~PreferenceGuard() { (void)cublasLtMatmulPreferenceDestroy(p); }
  } guard{preference};
  MIXTAPE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                            &workspace, sizeof(workspace)));
  const uint32_t reduction = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  MIXTAPE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                            &reduction, sizeof(reduction)));
  MIXTAPE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                            &a_align, sizeof(a_align)));
  MIXTAPE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                            &b_align, sizeof(b_align)));
  MIXTAPE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                            &d_align, sizeof(d_align)));
  MIXTAPE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                            &d_align, sizeof(d_align)));
  *count = 0;
  return cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, d, d, preference, 1, result, count);
}

// ---- element types -------------------------------------------------------------------------------------

// The CUDA type with the same bits as a mixtape element type (Half and __half are both 16 raw bits).
template <class T> struct device_type { using type = T; };
template <> struct device_type<Half> { using type = __half; };
template <> struct device_type<BFloat16> { using type = __nv_bfloat16; };
template <class T> using device_t = typename device_type<T>::type;

// The type arithmetic accumulates in on the device: float for f32/f16/bf16, double for f64 (as acc_t).
template <class D> struct device_acc { using type = float; };
template <> struct device_acc<double> { using type = double; };
template <class D> using device_acc_t = typename device_acc<D>::type;

// A tensor's element 0 as the device type.
template <class T>
device_t<T>* device_ptr(const Tensor& t) {
  return reinterpret_cast<device_t<T>*>(t.data_ptr());
}

// Loads widen exactly; stores round to nearest even, once (the CPU's contract).
template <class A> __device__ __forceinline__ A load_as(float x) { return static_cast<A>(x); }
template <class A> __device__ __forceinline__ A load_as(double x) { return static_cast<A>(x); }
template <class A> __device__ __forceinline__ A load_as(__half x) { return static_cast<A>(__half2float(x)); }
template <class A> __device__ __forceinline__ A load_as(__nv_bfloat16 x) {
  return static_cast<A>(__bfloat162float(x));
}
template <class A> __device__ __forceinline__ A load_as(int32_t x) { return static_cast<A>(x); }
template <class A> __device__ __forceinline__ A load_as(int64_t x) { return static_cast<A>(x); }

template <class D> struct store_tag {};
__device__ __forceinline__ float store_as(store_tag<float>, float x) { return x; }
__device__ __forceinline__ float store_as(store_tag<float>, double x) { return static_cast<float>(x); }
__device__ __forceinline__ double store_as(store_tag<double>, float x) { return x; }
__device__ __forceinline__ double store_as(store_tag<double>, double x) { return x; }
__device__ __forceinline__ __half store_as(store_tag<__half>, float x) { return __float2half_rn(x); }
__device__ __forceinline__ __half store_as(store_tag<__half>, double x) { return __double2half(x); }
__device__ __forceinline__ __nv_bfloat16 store_as(store_tag<__nv_bfloat16>, float x) {
  return __float2bfloat16_rn(x);
}
__device__ __forceinline__ __nv_bfloat16 store_as(store_tag<__nv_bfloat16>, double x) {
  return __double2bfloat16(x);
}
template <class A> __device__ __forceinline__ int32_t store_as(store_tag<int32_t>, A x) {
  return static_cast<int32_t>(x);
}
template <class A> __device__ __forceinline__ int64_t store_as(store_tag<int64_t>, A x) {
  return static_cast<int64_t>(x);
}
// store<__half>(x): x rounded to the device type D (nearest even).
template <class D, class A> __device__ __forceinline__ D store(A x) { return store_as(store_tag<D>{}, x); }

// ---- strided operands ----------------------------------------------------------------------------------

inline constexpr int kMaxDims = 10;

// Offsets (in elements) of N operands of one shape with their own strides, for a linear index over the
// shape in row-major order. Dims are coalesced on the host (a contiguous tensor becomes one dim), so the
// device loop divides only as often as the geometry needs.
template <int N>
struct OffsetCalculator {
  int dims = 0;
  int64_t sizes[kMaxDims] = {};
  int64_t strides[N][kMaxDims] = {};

  __device__ __forceinline__ void offsets(int64_t linear, int64_t (&out)[N]) const {
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = 0;
    for (int d = dims - 1; d >= 0; --d) {
      const int64_t index = linear % sizes[d];
      linear /= sizes[d];
#pragma unroll
      for (int k = 0; k < N; ++k) out[k] += index * strides[k][d];
    }
  }
};

// Builds the calculator for operands of `shape` with the given strides; `what` names the op in the error
// for a geometry of more than kMaxDims (non-mergeable) dims.
template <int N>
OffsetCalculator<N> make_offset_calculator(const Shape& shape, const std::array<Strides, N>& strides,
                                           const char* what) {
  OffsetCalculator<N> calc;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    const int m = calc.dims;
    bool merge = m > 0;
    for (int k = 0; k < N && merge; ++k) merge = calc.strides[k][m - 1] == strides[k][d] * shape[d];
    if (merge) {
      calc.sizes[m - 1] *= shape[d];
      for (int k = 0; k < N; ++k) calc.strides[k][m - 1] = strides[k][d];
    } else {
      check(m < kMaxDims, what, ": tensors with more than ", kMaxDims,
            " non-mergeable dims are not supported on CUDA");
      calc.sizes[m] = shape[d];
      for (int k = 0; k < N; ++k) calc.strides[k][m] = strides[k][d];
      calc.dims = m + 1;
    }
  }
  if (calc.dims == 0) {  // a scalar or an all-ones shape: one element
    calc.dims = 1;
    calc.sizes[0] = 1;
    for (int k = 0; k < N; ++k) calc.strides[k][0] = 0;
  }
  return calc;
}

// ---- launch shapes -------------------------------------------------------------------------------------

inline constexpr int kThreads = 256;
// Blocks for a grid-stride loop over n items: enough to fill any current GPU, never more than n needs.
inline unsigned blocks_for(int64_t n, int threads = kThreads) {
  const int64_t needed = (n + threads - 1) / threads;
  constexpr int64_t kMaxBlocks = 65535LL * 8;
  return static_cast<unsigned>(needed < 1 ? 1 : (needed > kMaxBlocks ? kMaxBlocks : needed));
}

// ---- one block per row ---------------------------------------------------------------------------------
// The building blocks of kernels that give each row of a contiguous [N, C] matrix to one block and reduce
// along it twice (norm.cu's mean / variance, cross_entropy.cu's max / sum of exponentials); reduce.cu uses
// Pack and aligned16. In a namespace of their own: other files have private helpers with some of these names
// (index.cu's aligned16, multi_tensor.cu's block_sum).
namespace rowwise {

// 16 bytes of elements, for vector loads and stores.
template <class D>
struct alignas(16) Pack {
  static constexpr int kSize = 16 / static_cast<int>(sizeof(D));
  D v[kSize];
};

__host__ __device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// Whether rows of n elements of D can use groups of W elements (16 bytes unless given) with these operands:
// n a multiple of W and every pointer aligned to the group's size (null ones are ignored).
template <class D, int W = Pack<D>::kSize>
bool can_vectorise(int64_t n, std::initializer_list<const void*> pointers) {
  if (n % W != 0) return false;
  for (const void* p : pointers)
    if (p && reinterpret_cast<uintptr_t>(p) % (W * sizeof(D)) != 0) return false;
  return true;
}

// 32..512 threads per row, enough for about four groups each (always a power of two).
inline int row_threads(int64_t groups) {
  int threads = 32;
  while (threads < 512 && threads * 4 < groups) threads *= 2;
  return threads;
}

// Blocks for N rows (a grid-stride loop over rows covers the rest).
inline unsigned row_blocks(int64_t N) {
  return static_cast<unsigned>(std::min<int64_t>(N, int64_t{1} << 20));
}

__device__ __forceinline__ float dev_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double dev_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float dev_exp(float x) { return expf(x); }
__device__ __forceinline__ double dev_exp(double x) { return exp(x); }
__device__ __forceinline__ float dev_log(float x) { return logf(x); }
__device__ __forceinline__ double dev_log(double x) { return log(x); }

struct SumOp {
  template <class A> __device__ __forceinline__ A operator()(A a, A b) const { return a + b; }
};
// std::max(a, b) as the CPU's row max uses it: b when a < b, else a (a NaN b is skipped).
struct MaxOp {
  template <class A> __device__ __forceinline__ A operator()(A a, A b) const { return a < b ? b : a; }
};

// op over the block (blockDim.x a multiple of 32, at most 1024), thread 0's result broadcast to every thread.
// Fixed tree: reproducible. `shared` holds 32 A. Warps past blockDim.x / 32 are never combined in (rather
// than entering as a zero), so a sum can return -0 only when every thread's value was -0; a thread that
// accumulates from +0 never holds -0.
template <class A, class Op>
__device__ __forceinline__ A block_reduce(A v, A* shared, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v = op(v, __shfl_down_sync(0xffffffffu, v, o));
  const int warps = static_cast<int>(blockDim.x) / 32;
  if (warps == 1) return __shfl_sync(0xffffffffu, v, 0);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();  // the previous call's readers are done with shared
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    // Lanes past the warps repeat warp 0's value and are never combined in.
    v = shared[lane < warps ? lane : 0];
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
      const A other = __shfl_down_sync(0xffffffffu, v, o);
      if (lane + o < warps) v = op(v, other);
    }
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  return shared[0];
}

// The sum of v over the block, the same value in every thread.
template <class A>
__device__ __forceinline__ A block_sum(A v, A* shared) {
  return block_reduce(v, shared, SumOp{});
}

// W elements of D, aligned to their size: one vector load (16 bytes for W = Pack<D>::kSize).
template <class D, int W>
struct alignas(W * sizeof(D)) Group {
  D v[W];
};

// Group k of a row of n elements: elements [k * W, k * W + W) as A (W = Pack<D>::kSize unless given). kVec: one
// vector load (the caller guarantees alignment to W elements and n % W == 0); otherwise element loads,
// elements past n read as 0 (callers skip them).
template <class D, class A, bool kVec, int W = Pack<D>::kSize>
__device__ __forceinline__ void load_group(const D* p, int64_t k, int64_t n, A (&out)[W]) {
  if constexpr (kVec) {
    const Group<D, W> pk = reinterpret_cast<const Group<D, W>*>(p)[k];
#pragma unroll
    for (int e = 0; e < W; ++e) out[e] = load_as<A>(pk.v[e]);
  } else {
#pragma unroll
    for (int e = 0; e < W; ++e) {
      const int64_t j = k * W + e;
      out[e] = j < n ? load_as<A>(p[j]) : A(0);
    }
  }
}

// This thread's part of a fold over a row of n elements: acc = f(acc, element as A) over the elements of
// groups threadIdx.x, threadIdx.x + blockDim.x, ... in order (elements past n skipped). block_reduce then
// combines the threads' parts: a row statistic (sum, sum of squares, max, sum of exponentials) in two lines.
// The order depends on W (groups of W = Pack<D>::kSize elements unless given) and blockDim.x, not on kVec.
template <class D, class A, bool kVec, int W = Pack<D>::kSize, class F>
__device__ __forceinline__ A thread_row_fold(const D* row, int64_t n, A acc, F f) {
  const int64_t groups = (n + W - 1) / W;
  for (int64_t k = threadIdx.x; k < groups; k += blockDim.x) {
    A v[W];
    load_group<D, A, kVec, W>(row, k, n, v);
#pragma unroll
    for (int e = 0; e < W; ++e)
      if (kVec || k * W + e < n) acc = f(acc, v[e]);
  }
  return acc;
}

// Stores group k of a row of n elements, each rounded once to D; elements past n are not written.
template <class D, class A, bool kVec>
__device__ __forceinline__ void store_group(D* p, int64_t k, int64_t n, const A (&in)[Pack<D>::kSize]) {
  constexpr int W = Pack<D>::kSize;
  if constexpr (kVec) {
    Pack<D> pk;
#pragma unroll
    for (int e = 0; e < W; ++e) pk.v[e] = store<D>(in[e]);
    reinterpret_cast<Pack<D>*>(p)[k] = pk;
  } else {
#pragma unroll
    for (int e = 0; e < W; ++e) {
      const int64_t j = k * W + e;
      if (j < n) p[j] = store<D>(in[e]);
    }
  }
}

}  // namespace rowwise

}  // namespace mixtape::cuda
