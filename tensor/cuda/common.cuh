#pragma once
// What every CUDA kernel file shares: checked calls (failures become mixtape::Error naming the call, the
// file:line and the library's error string), the device element types behind Half/BFloat16, conversions
// that round like the CPU (nearest even, once, on store), strided offset calculators and launch shapes.
// Included only by tensor/cuda/*.cu.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>

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

}  // namespace mixtape::cuda
