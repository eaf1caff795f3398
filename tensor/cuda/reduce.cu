// PLACEHOLDER: reduce.cu is being written; until then every kernel here throws "not supported".
#include "tensor/cuda/cuda_backend.h"

namespace mixtape::cuda {

void CudaBackend::reduce(ReduceOp /*op*/, const Tensor& /*x*/, const std::vector<int64_t>& /*dims*/, const Tensor& /*out*/) {
  not_supported("CUDA reduce: the kernel is not written yet");
}

void CudaBackend::var(const Tensor& /*x*/, const std::vector<int64_t>& /*dims*/, int64_t /*correction*/, const Tensor& /*out*/) {
  not_supported("CUDA var: the kernel is not written yet");
}

void CudaBackend::softmax(const Tensor& /*x*/, int64_t /*dim*/, bool /*log*/, const Tensor& /*out*/) {
  not_supported("CUDA softmax: the kernel is not written yet");
}

void CudaBackend::softmax_backward(const Tensor& /*y*/, const Tensor& /*grad_y*/, int64_t /*dim*/, bool /*log*/, const Tensor& /*grad_x*/) {
  not_supported("CUDA softmax_backward: the kernel is not written yet");
}

}  // namespace mixtape::cuda
