// PLACEHOLDER: replaced by the real kernels; every function throws until then.
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include "tensor/cpu/cpu_backend.h"

namespace mixtape::cpu {

void CpuBackend::matmul(const Tensor& a, const Tensor& b, const Tensor& out) { not_supported("cpu matmul (placeholder)"); }

}  // namespace mixtape::cpu
