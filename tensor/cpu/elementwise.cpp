// PLACEHOLDER: replaced by the real kernels; every function throws until then.
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include "tensor/cpu/cpu_backend.h"

namespace mixtape::cpu {

void CpuBackend::unary(UnaryOp op, const Tensor& x, const Tensor& out, double scalar) { not_supported("cpu unary (placeholder)"); }
void CpuBackend::unary_backward(UnaryOp op, const Tensor& x, const Tensor& y, const Tensor& grad_out, const Tensor& grad_x, double scalar) { not_supported("cpu unary_backward (placeholder)"); }
void CpuBackend::binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) { not_supported("cpu binary (placeholder)"); }
void CpuBackend::binary_scalar(BinaryOp op, const Tensor& a, double scalar, bool scalar_first, const Tensor& out) { not_supported("cpu binary_scalar (placeholder)"); }
void CpuBackend::where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) { not_supported("cpu where (placeholder)"); }
void CpuBackend::add_inplace(const Tensor& dst, const Tensor& src, double alpha) { not_supported("cpu add_inplace (placeholder)"); }
void CpuBackend::mul_scalar_inplace(const Tensor& dst, double value) { not_supported("cpu mul_scalar_inplace (placeholder)"); }

}  // namespace mixtape::cpu
