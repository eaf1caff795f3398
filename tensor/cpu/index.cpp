// PLACEHOLDER: replaced by the real kernels; every function throws until then.
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include "tensor/cpu/cpu_backend.h"

namespace mixtape::cpu {

void CpuBackend::embedding(const Tensor& weight, const Tensor& indices, const Tensor& out) { not_supported("cpu embedding (placeholder)"); }
void CpuBackend::embedding_backward(const Tensor& grad_out, const Tensor& indices, const Tensor& grad_weight) { not_supported("cpu embedding_backward (placeholder)"); }

}  // namespace mixtape::cpu
