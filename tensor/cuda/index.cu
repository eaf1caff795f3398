// PLACEHOLDER: index.cu is being written; until then every kernel here throws "not supported".
#include "tensor/cuda/cuda_backend.h"

namespace mixtape::cuda {

void CudaBackend::embedding(const Tensor& /*weight*/, const Tensor& /*indices*/, const Tensor& /*out*/) {
  not_supported("CUDA embedding: the kernel is not written yet");
}

void CudaBackend::embedding_backward(const Tensor& /*grad_out*/, const Tensor& /*indices*/, const Tensor& /*grad_weight*/) {
  not_supported("CUDA embedding_backward: the kernel is not written yet");
}

}  // namespace mixtape::cuda
