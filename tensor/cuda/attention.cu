// PLACEHOLDER: attention.cu is being written; until then every kernel here throws "not supported".
#include "tensor/cuda/cuda_backend.h"

namespace mixtape::cuda {

void CudaBackend::causal_attention(const Tensor& /*q*/, const Tensor& /*k*/, const Tensor& /*v*/, double /*scale*/, const Tensor& /*out*/, const Tensor& /*lse*/) {
  not_supported("CUDA causal_attention: the kernel is not written yet");
}

void CudaBackend::causal_attention_backward(const Tensor& /*grad_out*/, const Tensor& /*q*/, const Tensor& /*k*/, const Tensor& /*v*/, const Tensor& /*out*/, const Tensor& /*lse*/, double /*scale*/, const Tensor& /*grad_q*/, const Tensor& /*grad_k*/, const Tensor& /*grad_v*/) {
  not_supported("CUDA causal_attention_backward: the kernel is not written yet");
}

}  // namespace mixtape::cuda
