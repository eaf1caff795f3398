// PLACEHOLDER: replaced by the real kernels; every function throws until then.
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include "tensor/cpu/cpu_backend.h"

namespace mixtape::cpu {

void CpuBackend::reduce(ReduceOp op, const Tensor& x, const std::vector<int64_t>& dims, const Tensor& out) { not_supported("cpu reduce (placeholder)"); }
void CpuBackend::var(const Tensor& x, const std::vector<int64_t>& dims, int64_t correction, const Tensor& out) { not_supported("cpu var (placeholder)"); }
void CpuBackend::softmax(const Tensor& x, int64_t dim, bool log, const Tensor& out) { not_supported("cpu softmax (placeholder)"); }
void CpuBackend::softmax_backward(const Tensor& y, const Tensor& grad_y, int64_t dim, bool log, const Tensor& grad_x) { not_supported("cpu softmax_backward (placeholder)"); }

}  // namespace mixtape::cpu
