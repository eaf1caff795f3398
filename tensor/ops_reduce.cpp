// PLACEHOLDER: replaced by the real ops; every function throws until then.
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include "tensor/ops.h"

namespace mixtape {

Tensor sum(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) { not_supported("sum (placeholder)"); }
Tensor mean(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) { not_supported("mean (placeholder)"); }
Tensor max(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) { not_supported("max (placeholder)"); }
Tensor min(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) { not_supported("min (placeholder)"); }
Tensor var(const Tensor& x, const std::vector<int64_t>& dims, int64_t correction, bool keepdim) { not_supported("var (placeholder)"); }
Tensor sum_to(const Tensor& x, const Shape& shape) { not_supported("sum_to (placeholder)"); }
Tensor softmax(const Tensor& x, int64_t dim) { not_supported("softmax (placeholder)"); }
Tensor log_softmax(const Tensor& x, int64_t dim) { not_supported("log_softmax (placeholder)"); }

}  // namespace mixtape
