#pragma once
// The op front ends. Each checks its arguments (throwing mixtape::Error naming the op, shapes and dtypes),
// computes in the dtype its inputs promote to, calls the backend kernel and records its backward.
// Floating ops accept f32/f16/bf16/f64; f16/bf16 accumulate in fp32 and round once on store.
// Inside an Autocast scope (amp/autocast.h) the ops of the scope's policy table (tensor/autocast_tables.h:
// PyTorch's or Apex O1's) first cast their floating inputs per their class there (lower precision, fp32,
// promote, or not listed: the inputs' dtype); ops in no table are unaffected.
#include <cstdint>
#include <vector>

#include "tensor/random.h"
#include "tensor/tensor.h"

namespace mixtape {

// ---- elementwise (NumPy broadcasting; mixed floating dtypes promote to the wider) ----
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& a, const Tensor& b);  // a > 0 where b is not an integer, as in IEEE pow
Tensor add(const Tensor& a, double b);
Tensor sub(const Tensor& a, double b);
Tensor sub(double a, const Tensor& b);
Tensor mul(const Tensor& a, double b);
Tensor div(const Tensor& a, double b);
Tensor div(double a, const Tensor& b);
Tensor pow(const Tensor& a, double exponent);
Tensor neg(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor rsqrt(const Tensor& x);
Tensor tanh(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor relu(const Tensor& x);
enum class GeluApproximation { None, Tanh };  // erf form (exact) or the tanh form of GPT-2
Tensor gelu(const Tensor& x, GeluApproximation approximation = GeluApproximation::None);
Tensor silu(const Tensor& x);
Tensor abs(const Tensor& x);

inline Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
inline Tensor operator+(const Tensor& a, double b) { return add(a, b); }
inline Tensor operator+(double a, const Tensor& b) { return add(b, a); }
inline Tensor operator-(const Tensor& a, double b) { return sub(a, b); }
inline Tensor operator-(double a, const Tensor& b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, double b) { return mul(a, b); }
inline Tensor operator*(double a, const Tensor& b) { return mul(b, a); }
inline Tensor operator/(const Tensor& a, double b) { return div(a, b); }
inline Tensor operator/(double a, const Tensor& b) { return div(a, b); }
inline Tensor operator-(const Tensor& x) { return neg(x); }

// cond is any dtype (nonzero = true); a and b promote; all three broadcast.
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
Tensor masked_fill(const Tensor& x, const Tensor& mask, double value);  // x where mask is 0, else value

// ---- reductions (dims may be negative; empty dims = all dims) ----
Tensor sum(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor max(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);  // grad split among ties
Tensor min(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor var(const Tensor& x, const std::vector<int64_t>& dims = {}, int64_t correction = 1, bool keepdim = false);
// The vector p-norm over dims (torch.linalg.vector_norm; torch.norm(x, p, dim)): (sum |x|^p)^(1/p) for a
// finite p > 0, max |x| for p = inf. f16/bf16 compute in fp32 (f64 in f64) and round once. Gradient as
// PyTorch's: sign(x) |x|^(p-1) / norm^(p-1), 0 where the norm is 0; for p = inf, sign(x) split among the tied
// maxima.
// p = 0, p < 0 and -inf are "not supported" errors.
Tensor norm(const Tensor& x, double p = 2, const std::vector<int64_t>& dims = {}, bool keepdim = false);
// Sums a broadcast result back to `shape` (the backward of broadcasting).
Tensor sum_to(const Tensor& x, const Shape& shape);

Tensor softmax(const Tensor& x, int64_t dim);
Tensor log_softmax(const Tensor& x, int64_t dim);

// ---- linear algebra ----
// [.., M, K] @ [.., K, N] with batch dims broadcast; 1-d operands are treated as in numpy.matmul.
// f32 and bf16 run natively in oneDNN (fp32 accumulation); f16 is converted to f32 on the way in.
Tensor matmul(const Tensor& a, const Tensor& b);
// x [..., K] @ weight[N, K]^T (+ bias[N], which may be undefined) -> [..., N], like torch.nn.functional.linear;
// the bias is added inside the matmul kernel (one rounding, no separate pass). Mixed dtypes promote.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());

// ---- indexing and joining ----
Tensor embedding(const Tensor& weight, const Tensor& indices);  // weight [V, C], indices i32/i64 any shape
Tensor cat(const std::vector<Tensor>& tensors, int64_t dim);
Tensor stack(const std::vector<Tensor>& tensors, int64_t dim);
std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim);  // last piece may be smaller
std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim);

// ---- fused normalisation (over the last dim) ----
struct LayerNormResult {
  Tensor out;
  Tensor mean;  // f32 (f64 for f64 x), x's shape without the last dim
  Tensor rstd;  // f32 (f64 for f64 x), 1 / sqrt(var + eps)
};
LayerNormResult layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5);
struct RMSNormResult {
  Tensor out;
  Tensor rstd;  // f32 (f64 for f64 x), 1 / sqrt(mean(x^2) + eps)
};
RMSNormResult rms_norm(const Tensor& x, const Tensor& weight, double eps = 1e-6);

// ---- dropout ----
// Zeroes each element with probability p and scales the rest by 1/(1-p); identity when !training or p == 0.
// Draws numel counters from `generator`.
Tensor dropout(const Tensor& x, double p, Generator& generator, bool training = true);

// ---- fused loss and attention ----
// Mean over the rows whose target != ignore_index of -log softmax(logits)[target], with logits [..., V] and
// targets i32/i64 [...] each in [0, V) or ignore_index. The softmax runs in fp32 (f64 for f64 logits); the
// result is a 0-d f32 (f64 for f64). When no row counts the loss is 0 and its gradient 0 (not NaN).
Tensor softmax_cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index = -100);
// Causal self-attention softmax(q k^T / sqrt(D) + mask) v over q, k, v [B, H, T, D] of one dtype (any
// strides; read in place when the last dim is contiguous), computed block by block (online softmax): memory
// O(B*H*T*D), never a [T, T] score matrix. The output is contiguous [B, H, T, D].
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v);
// GPT's multi-head causal self-attention from a fused projection: qkv [B, T, 3C] holds q, k, v in that order
// along the last dim (nanoGPT's c_attn), each [B, T, C] split into n_head heads of D = C / n_head. Returns
// [B, T, C], the heads' outputs side by side (what goes into c_proj). Equals scaled_dot_product_attention on
// the thirds viewed as [B, H, T, D] and merged back, bit for bit, but the kernel reads the heads in qkv and
// writes them into the [B, T, C] output (and the gradient into one [B, T, 3C]) in place: no copies around it.
Tensor causal_self_attention(const Tensor& qkv, int64_t n_head);

// ---- automatic mixed precision ----
// PyTorch's _amp_foreach_non_finite_check_and_unscale_: multiplies every gradient in `grads` (contiguous,
// floating, any mix of dtypes and devices) in place by inv_scale — computed in fp32 (f64 for f64) and
// rounded once — and returns true when any element was inf or NaN before the multiply or became inf through
// it. One fused pass per device over its tensors (every device is unscaled, as PyTorch's GradScaler does with
// its found_inf per device); no autograd (gradients are leaves of nothing). Undefined tensors are skipped.
// inv_scale must be finite (1 / a scale that itself overflowed is the caller's bug).
bool unscale_and_check_finite(const std::vector<Tensor>& grads, double inv_scale);

}  // namespace mixtape
