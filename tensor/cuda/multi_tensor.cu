// PLACEHOLDER: multi_tensor.cu is being written; until then every kernel here throws "not supported".
#include "tensor/cuda/cuda_backend.h"

namespace mixtape::cuda {

bool CudaBackend::unscale_and_check_finite(const std::vector<Tensor>& /*grads*/, double /*inv_scale*/) {
  not_supported("CUDA unscale_and_check_finite: the kernel is not written yet");
}

void CudaBackend::adam_step(const std::vector<AdamUpdate>& /*updates*/, double /*beta1*/, double /*beta2*/, double /*eps*/) {
  not_supported("CUDA adam_step: the kernel is not written yet");
}

void CudaBackend::sgd_step(const std::vector<SgdUpdate>& /*updates*/, double /*momentum*/, double /*dampening*/, bool /*nesterov*/) {
  not_supported("CUDA sgd_step: the kernel is not written yet");
}

double CudaBackend::sum_of_squares(const std::vector<Tensor>& /*tensors*/) {
  not_supported("CUDA sum_of_squares: the kernel is not written yet");
}

int64_t CudaBackend::count_zeros(const std::vector<Tensor>& /*tensors*/) {
  not_supported("CUDA count_zeros: the kernel is not written yet");
}

}  // namespace mixtape::cuda
