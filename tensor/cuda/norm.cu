// PLACEHOLDER: norm.cu is being written; until then every kernel here throws "not supported".
#include "tensor/cuda/cuda_backend.h"

namespace mixtape::cuda {

void CudaBackend::layer_norm(const Tensor& /*x*/, const Tensor& /*weight*/, const Tensor& /*bias*/, double /*eps*/, const Tensor& /*out*/, const Tensor& /*mean*/, const Tensor& /*rstd*/) {
  not_supported("CUDA layer_norm: the kernel is not written yet");
}

void CudaBackend::layer_norm_backward(const Tensor& /*grad_out*/, const Tensor& /*x*/, const Tensor& /*weight*/, const Tensor& /*mean*/, const Tensor& /*rstd*/, const Tensor& /*grad_x*/, const Tensor& /*grad_weight*/, const Tensor& /*grad_bias*/) {
  not_supported("CUDA layer_norm_backward: the kernel is not written yet");
}

void CudaBackend::rms_norm(const Tensor& /*x*/, const Tensor& /*weight*/, double /*eps*/, const Tensor& /*out*/, const Tensor& /*rstd*/) {
  not_supported("CUDA rms_norm: the kernel is not written yet");
}

void CudaBackend::rms_norm_backward(const Tensor& /*grad_out*/, const Tensor& /*x*/, const Tensor& /*weight*/, const Tensor& /*rstd*/, const Tensor& /*grad_x*/, const Tensor& /*grad_weight*/) {
  not_supported("CUDA rms_norm_backward: the kernel is not written yet");
}

}  // namespace mixtape::cuda
