// PLACEHOLDER: replaced by the real ops; every function throws until then.
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include "tensor/ops.h"

namespace mixtape {

Tensor embedding(const Tensor& weight, const Tensor& indices) { not_supported("embedding (placeholder)"); }
Tensor cat(const std::vector<Tensor>& tensors, int64_t dim) { not_supported("cat (placeholder)"); }
Tensor stack(const std::vector<Tensor>& tensors, int64_t dim) { not_supported("stack (placeholder)"); }
std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim) { not_supported("split (placeholder)"); }
std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim) { not_supported("split (placeholder)"); }

}  // namespace mixtape
