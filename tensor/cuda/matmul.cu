// PLACEHOLDER: matmul.cu is being written; until then every kernel here throws "not supported".
#include "tensor/cuda/cuda_backend.h"

namespace mixtape::cuda {

void CudaBackend::matmul(const Tensor& /*a*/, const Tensor& /*b*/, const Tensor& /*out*/, const Tensor& /*bias*/) {
  not_supported("CUDA matmul: the kernel is not written yet");
}

}  // namespace mixtape::cuda
