// PLACEHOLDER: elementwise.cu is being written; until then every kernel here throws "not supported".
#include "tensor/cuda/cuda_backend.h"

namespace mixtape::cuda {

void CudaBackend::copy(const Tensor& /*src*/, const Tensor& /*dst*/) {
  not_supported("CUDA copy: the kernel is not written yet");
}

void CudaBackend::fill(const Tensor& /*dst*/, double /*value*/) {
  not_supported("CUDA fill: the kernel is not written yet");
}

void CudaBackend::arange(const Tensor& /*dst*/, double /*start*/, double /*step*/) {
  not_supported("CUDA arange: the kernel is not written yet");
}

void CudaBackend::uniform(const Tensor& /*dst*/, uint64_t /*seed*/, uint64_t /*offset*/, double /*low*/, double /*high*/) {
  not_supported("CUDA uniform: the kernel is not written yet");
}

void CudaBackend::normal(const Tensor& /*dst*/, uint64_t /*seed*/, uint64_t /*offset*/, double /*mean*/, double /*std*/) {
  not_supported("CUDA normal: the kernel is not written yet");
}

void CudaBackend::randint(const Tensor& /*dst*/, uint64_t /*seed*/, uint64_t /*offset*/, int64_t /*low*/, int64_t /*high*/) {
  not_supported("CUDA randint: the kernel is not written yet");
}

void CudaBackend::unary(UnaryOp /*op*/, const Tensor& /*x*/, const Tensor& /*out*/, double /*scalar*/) {
  not_supported("CUDA unary: the kernel is not written yet");
}

void CudaBackend::unary_backward(UnaryOp /*op*/, const Tensor& /*x*/, const Tensor& /*y*/, const Tensor& /*grad_out*/, const Tensor& /*grad_x*/, double /*scalar*/) {
  not_supported("CUDA unary_backward: the kernel is not written yet");
}

void CudaBackend::binary(BinaryOp /*op*/, const Tensor& /*a*/, const Tensor& /*b*/, const Tensor& /*out*/) {
  not_supported("CUDA binary: the kernel is not written yet");
}

void CudaBackend::binary_scalar(BinaryOp /*op*/, const Tensor& /*a*/, double /*scalar*/, bool /*scalar_first*/, const Tensor& /*out*/) {
  not_supported("CUDA binary_scalar: the kernel is not written yet");
}

void CudaBackend::where(const Tensor& /*cond*/, const Tensor& /*a*/, const Tensor& /*b*/, const Tensor& /*out*/) {
  not_supported("CUDA where: the kernel is not written yet");
}

void CudaBackend::add_inplace(const Tensor& /*dst*/, const Tensor& /*src*/, double /*alpha*/) {
  not_supported("CUDA add_inplace: the kernel is not written yet");
}

void CudaBackend::mul_scalar_inplace(const Tensor& /*dst*/, double /*value*/) {
  not_supported("CUDA mul_scalar_inplace: the kernel is not written yet");
}

void CudaBackend::dropout(const Tensor& /*x*/, double /*p*/, uint64_t /*seed*/, uint64_t /*offset*/, const Tensor& /*out*/) {
  not_supported("CUDA dropout: the kernel is not written yet");
}

}  // namespace mixtape::cuda
