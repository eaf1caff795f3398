// PLACEHOLDER: replaced by the real ops; every function throws until then.
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include "tensor/ops.h"

namespace mixtape {

Tensor add(const Tensor& a, const Tensor& b) { not_supported("add (placeholder)"); }
Tensor sub(const Tensor& a, const Tensor& b) { not_supported("sub (placeholder)"); }
Tensor mul(const Tensor& a, const Tensor& b) { not_supported("mul (placeholder)"); }
Tensor div(const Tensor& a, const Tensor& b) { not_supported("div (placeholder)"); }
Tensor pow(const Tensor& a, const Tensor& b) { not_supported("pow (placeholder)"); }
Tensor add(const Tensor& a, double b) { not_supported("add (placeholder)"); }
Tensor sub(const Tensor& a, double b) { not_supported("sub (placeholder)"); }
Tensor sub(double a, const Tensor& b) { not_supported("sub (placeholder)"); }
Tensor mul(const Tensor& a, double b) { not_supported("mul (placeholder)"); }
Tensor div(const Tensor& a, double b) { not_supported("div (placeholder)"); }
Tensor div(double a, const Tensor& b) { not_supported("div (placeholder)"); }
Tensor pow(const Tensor& a, double exponent) { not_supported("pow (placeholder)"); }
Tensor neg(const Tensor& x) { not_supported("neg (placeholder)"); }
Tensor exp(const Tensor& x) { not_supported("exp (placeholder)"); }
Tensor log(const Tensor& x) { not_supported("log (placeholder)"); }
Tensor sqrt(const Tensor& x) { not_supported("sqrt (placeholder)"); }
Tensor rsqrt(const Tensor& x) { not_supported("rsqrt (placeholder)"); }
Tensor tanh(const Tensor& x) { not_supported("tanh (placeholder)"); }
Tensor sigmoid(const Tensor& x) { not_supported("sigmoid (placeholder)"); }
Tensor relu(const Tensor& x) { not_supported("relu (placeholder)"); }
Tensor gelu(const Tensor& x, GeluApproximation approximation) { not_supported("gelu (placeholder)"); }
Tensor silu(const Tensor& x) { not_supported("silu (placeholder)"); }
Tensor abs(const Tensor& x) { not_supported("abs (placeholder)"); }
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) { not_supported("where (placeholder)"); }
Tensor masked_fill(const Tensor& x, const Tensor& mask, double value) { not_supported("masked_fill (placeholder)"); }

}  // namespace mixtape
