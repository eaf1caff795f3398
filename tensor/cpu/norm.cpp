// PLACEHOLDER: replaced by the real kernels; every function throws until then.
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include "tensor/cpu/cpu_backend.h"

namespace mixtape::cpu {

void CpuBackend::layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, const Tensor& out, const Tensor& mean, const Tensor& rstd) { not_supported("cpu layer_norm (placeholder)"); }
void CpuBackend::layer_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor& mean, const Tensor& rstd, const Tensor& grad_x, const Tensor& grad_weight, const Tensor& grad_bias) { not_supported("cpu layer_norm_backward (placeholder)"); }
void CpuBackend::rms_norm(const Tensor& x, const Tensor& weight, double eps, const Tensor& out, const Tensor& rstd) { not_supported("cpu rms_norm (placeholder)"); }
void CpuBackend::rms_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor& rstd, const Tensor& grad_x, const Tensor& grad_weight) { not_supported("cpu rms_norm_backward (placeholder)"); }
void CpuBackend::dropout(const Tensor& x, double p, uint64_t seed, uint64_t offset, const Tensor& out) { not_supported("cpu dropout (placeholder)"); }

}  // namespace mixtape::cpu
