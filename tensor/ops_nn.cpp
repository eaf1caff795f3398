// PLACEHOLDER: replaced by the real ops; every function throws until then.
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include "tensor/ops.h"

namespace mixtape {

LayerNormResult layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) { not_supported("layer_norm (placeholder)"); }
RMSNormResult rms_norm(const Tensor& x, const Tensor& weight, double eps) { not_supported("rms_norm (placeholder)"); }
Tensor dropout(const Tensor& x, double p, Generator& generator, bool training) { not_supported("dropout (placeholder)"); }

}  // namespace mixtape
