// Backend's public kernel entry points: each checks its op's arguments once, here, then runs the device's
// kernel. The messages name the op and what it got against what it expected; a check's message is built
// only when it fails (these run on every kernel call).
#include "tensor/kernel_contract.h"

#include <string>
#include <utility>

#include "tensor/backend.h"

namespace mixtape {

namespace {

// The device kind a message names ("cpu", "cuda"), for the checks whose messages say where they ran.
const char* device_kind(const Tensor& t) { return t.device().is_cuda() ? "cuda" : "cpu"; }

void check_same_shape(const char* op, const Tensor& a, const Tensor& b) {
  check(a.shape() == b.shape(), op, ": ", a.described(), " and ", b.described(), " differ in shape");
}

// softmax's operands: one shape and one dtype.
void check_same_shape_and_dtype(const char* op, const Tensor& a, const Tensor& b) {
  check(a.shape() == b.shape() && a.dtype() == b.dtype(), op, ": ", a.described(), " and ", b.described(),
        " must have the same shape and dtype");
}

void check_contiguous_destination(const char* op, const Tensor& dst) {
  check(dst.is_contiguous(), op, ": destination must be contiguous");
}

void check_reduce_output(const char* op, const Tensor& x, const std::vector<int64_t>& dims, const Tensor& out) {
  Shape expected = x.shape();
  for (int64_t d : dims) {
    check(d >= 0 && d < x.dim(), op, ": dim ", d, " out of range for ", x.described());
    expected[static_cast<size_t>(d)] = 1;
  }
  check(out.shape() == expected && out.is_contiguous() && out.dtype() == x.dtype(), op, ": output ",
        out.described(), " must be contiguous ", dtype_name(x.dtype()), shape_text(expected), " for input ",
        x.described());
}

// ---- norms: x [N, C] rows, [C] parameters, [N] statistics --------------------------------------------------

void check_rows(const char* op, const char* name, const Tensor& t, int64_t N, int64_t C, DType dtype) {
  check(t.defined() && t.dim() == 2 && t.shape()[0] == N && t.shape()[1] == C && t.is_contiguous() &&
            t.dtype() == dtype,
        op, ": ", name, " must be contiguous ", dtype_name(dtype), "[", N, ",", C, "], got ", t.described());
}

// An undefined vector is an argument the caller leaves out (a weight, or a statistic it does not want).
void check_vector(const char* op, const char* name, const Tensor& t, int64_t n, DType dtype) {
  if (!t.defined()) return;
  check(t.dim() == 1 && t.shape()[0] == n && t.is_contiguous() && t.dtype() == dtype, op, ": ", name,
        " must be contiguous ", dtype_name(dtype), "[", n, "], got ", t.described());
}

// x [N, C]; returns {N, C}.
std::pair<int64_t, int64_t> norm_rows(const char* op, const Tensor& x) {
  check(x.dim() == 2, op, ": x must be [N, C], got ", x.described());
  const int64_t N = x.shape()[0], C = x.shape()[1];
  check_rows(op, "x", x, N, C, x.dtype());
  return {N, C};
}

// ---- cross-entropy: logits [N, V], targets [N], 0-d loss, [N] lse -------------------------------------------

// An empty tensor has no layout to get wrong (and is_contiguous() says no for some empty shapes).
void check_tensor(const char* op, const char* name, const Tensor& t, const Shape& shape, DType dtype) {
  check(t.defined() && t.shape() == shape && (t.is_contiguous() || t.numel() == 0) && t.dtype() == dtype, op,
        ": ", name, " must be contiguous ", dtype_name(dtype), shape_text(shape), ", got ", t.described());
}

void check_targets(const char* op, const Tensor& targets, int64_t N) {
  check(targets.defined() && targets.dim() == 1 && targets.shape()[0] == N && targets.is_contiguous() &&
            (targets.dtype() == DType::I32 || targets.dtype() == DType::I64),
        op, ": targets must be contiguous i32/i64 [", N, "], got ", targets.described());
}

// logits [N, V]; returns {N, V}.
std::pair<int64_t, int64_t> logit_rows(const char* op, const Tensor& logits) {
  check(logits.dim() == 2, op, ": logits must be [N, V], got ", logits.described());
  const int64_t N = logits.shape()[0], V = logits.shape()[1];
  check_tensor(op, "logits", logits, {N, V}, logits.dtype());
  return {N, V};
}

// ---- attention: [B, H, T, D] operands, [B, H, T] lse -------------------------------------------------------

// q [B, H, T, D]: its shape is the one every other operand is checked against.
void check_query(const char* op, const Tensor& q) {
  if (!q.defined() || q.dim() != 4) [[unlikely]]
    fail(op, ": q must be [B, H, T, D], got ", q.defined() ? q.description() : std::string("undefined"));
}

// A [B, H, T, D] operand: the given shape and dtype, the head dim contiguous (any other strides).
void check_bhtd(const char* op, const char* name, const Tensor& t, const Shape& shape, DType dtype) {
  // An empty tensor (or D = 1) has no layout to get wrong.
  const bool ok = t.defined() && t.shape() == shape && t.dtype() == dtype &&
                  (t.stride(3) == 1 || t.size(3) == 1 || t.numel() == 0);
  if (!ok) [[unlikely]]
    fail(op, ": ", name, " must be ", dtype_name(dtype), shape_str(shape),
         " [B, H, T, D] with the head dim D contiguous (stride 1; B, H, T may have any strides), got ",
         t.defined() ? t.description() : std::string("undefined"), " with strides ",
         t.defined() ? shape_str(t.strides()) : std::string("[]"));
}

// lse: contiguous [B, H, T] statistics of q's rows.
void check_lse(const char* op, const Tensor& lse, const Tensor& q) {
  const Shape shape{q.shape()[0], q.shape()[1], q.shape()[2]};
  const DType dtype = stats_dtype(q.dtype());
  const bool ok = lse.defined() && lse.shape() == shape && lse.dtype() == dtype &&
                  (lse.is_contiguous() || lse.numel() == 0);
  if (!ok) [[unlikely]]
    fail(op, ": lse must be contiguous ", dtype_name(dtype), shape_str(shape), ", got ",
         lse.defined() ? lse.description() : std::string("undefined"));
}

// ---- embedding: indices [n], rows [n, C] -------------------------------------------------------------------

void check_embedding(const Tensor& weight, const Tensor& indices, const Tensor& out) {
  const bool ok = indices.dim() == 1 && indices.is_contiguous() && out.dim() == 2 && out.is_contiguous() &&
                  weight.dim() == 2 && out.size(0) == indices.numel() && out.size(1) == weight.size(1) &&
                  out.dtype() == weight.dtype();
  if (!ok)
    fail(device_kind(out), " embedding: expected indices [n] and a contiguous out [n, C], got weight ",
         weight.description(), ", indices ", indices.description(), ", out ", out.description());
}

void check_embedding_backward(const Tensor& grad_out, const Tensor& indices, const Tensor& grad_weight) {
  const bool ok = indices.dim() == 1 && indices.is_contiguous() && grad_out.dim() == 2 &&
                  grad_out.is_contiguous() && grad_out.size(0) == indices.numel() && grad_weight.dim() == 2 &&
                  grad_weight.is_contiguous() && grad_out.size(1) == grad_weight.size(1) &&
                  grad_out.dtype() == grad_weight.dtype();
  if (!ok)
    fail(device_kind(grad_weight), " embedding_backward: expected a contiguous grad_out [n, C], indices [n] and a "
         "contiguous grad_weight [V, C], got ", grad_out.description(), ", ", indices.description(), ", ",
         grad_weight.description());
}

}  // namespace

void check_matmul(const Tensor& a, const Tensor& b, const Tensor& out, const Tensor& bias) {
  const char* kind = device_kind(out);
  if (a.dim() < 2 || a.dim() != b.dim() || a.dim() != out.dim())
    fail(kind, " matmul: operands ", a.description(), " x ", b.description(), " -> ", out.description(),
         " must have the same number (>= 2) of dims");
  if (a.dtype() != b.dtype() || a.dtype() != out.dtype())
    fail(kind, " matmul: dtypes differ: ", a.description(), " x ", b.description(), " -> ", out.description());
  if (bias.defined() && (bias.dim() != 1 || bias.size(0) != out.size(-1) || bias.dtype() != out.dtype() ||
                         !bias.is_contiguous()))
    fail(kind, " matmul: bias ", bias.description(), " must be a contiguous ", dtype_name(out.dtype()), "[",
         out.size(-1), "] for output ", out.description());
  if (out.numel() != 0 && !out.is_contiguous())
    fail(kind, " matmul: output ", out.description(), " must be contiguous");
}

// ---- copy, fill, arange, random ----------------------------------------------------------------------------

void Backend::copy(const Tensor& src, const Tensor& dst) {
  check(src.shape() == dst.shape(), "copy: source ", src.described(), " and destination ", dst.described(),
        " differ in shape");
  copy_kernel(src, dst);
}

void Backend::arange(const Tensor& dst, double start, double step) {
  check_contiguous_destination("arange", dst);
  arange_kernel(dst, start, step);
}

void Backend::uniform(const Tensor& dst, uint64_t seed, uint64_t offset, double low, double high) {
  check_contiguous_destination("uniform", dst);
  uniform_kernel(dst, seed, offset, low, high);
}

void Backend::normal(const Tensor& dst, uint64_t seed, uint64_t offset, double mean, double std) {
  check_contiguous_destination("normal", dst);
  normal_kernel(dst, seed, offset, mean, std);
}

void Backend::randint(const Tensor& dst, uint64_t seed, uint64_t offset, int64_t low, int64_t high) {
  check_contiguous_destination("randint", dst);
  randint_kernel(dst, seed, offset, low, high);
}

// ---- elementwise -------------------------------------------------------------------------------------------

void Backend::unary(UnaryOp op, const Tensor& x, const Tensor& out, double scalar) {
  check_same_shape("unary", x, out);
  unary_kernel(op, x, out, scalar);
}

void Backend::unary_backward(UnaryOp op, const Tensor& x, const Tensor& y, const Tensor& grad_out,
                             const Tensor& grad_x, double scalar) {
  const bool from_output = derivative_from_output(op);
  const Tensor& in = from_output ? y : x;
  check(in.defined(), "unary_backward: the op needs its ", from_output ? "output" : "input", " but got none");
  check_same_shape("unary_backward", in, grad_x);
  check_same_shape("unary_backward", grad_out, grad_x);
  unary_backward_kernel(op, in, grad_out, grad_x, scalar);
}

void Backend::binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  check_same_shape("binary", a, out);
  check_same_shape("binary", b, out);
  // binary_reads_mixed is the device's own answer, so one check serves every backend: a kernel indexes a and
  // b as out's dtype unless the device reads mixed dtypes in place.
  if (a.dtype() != out.dtype() || b.dtype() != out.dtype())
    check(binary_reads_mixed(a.dtype(), b.dtype(), out.dtype()), "binary: inputs ", a.described(), " and ",
          b.described(), " for output ", out.described(),
          ": expected the output's dtype, or f32, f16 or bf16 inputs for an f32 output");
  binary_kernel(op, a, b, out);
}

void Backend::binary_scalar(BinaryOp op, const Tensor& a, double scalar, bool scalar_first, const Tensor& out) {
  check_same_shape("binary_scalar", a, out);
  // Eq has no scalar form (backend.h); checked here, so the kernels switch on the ops that have one.
  const bool has_scalar_form = op == BinaryOp::Add || op == BinaryOp::Sub || op == BinaryOp::Mul ||
                               op == BinaryOp::Div || op == BinaryOp::Pow;
  check(has_scalar_form, "binary_scalar: unknown op ", static_cast<int>(op));
  binary_scalar_kernel(op, a, scalar, scalar_first, out);
}

void Backend::where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) {
  check_same_shape("where", cond, out);
  check_same_shape("where", a, out);
  check_same_shape("where", b, out);
  check(a.dtype() == out.dtype() && b.dtype() == out.dtype(), "where: ", a.described(), " and ", b.described(),
        " must have the dtype of ", out.described());
  where_kernel(cond, a, b, out);
}

void Backend::add_inplace(const Tensor& dst, const Tensor& src, double alpha) {
  check_same_shape("add_inplace", src, dst);
  add_inplace_kernel(dst, src, alpha);
}

void Backend::dropout(const Tensor& x, double p, uint64_t seed, uint64_t offset, const Tensor& out) {
  check(x.shape() == out.shape() && x.dtype() == out.dtype() && out.is_contiguous(), "dropout: output ",
        out.described(), " must be contiguous with the shape and dtype of ", x.described());
  check(p >= 0 && p < 1, "dropout: p must be in [0, 1), got ", p);
  dropout_kernel(x, p, seed, offset, out);
}

// ---- reductions and softmax --------------------------------------------------------------------------------

void Backend::reduce(ReduceOp op, const Tensor& x, const std::vector<int64_t>& dims, const Tensor& out) {
  check_reduce_output("reduce", x, dims, out);
  reduce_kernel(op, x, dims, out);
}

void Backend::var(const Tensor& x, const std::vector<int64_t>& dims, int64_t correction, const Tensor& out) {
  check_reduce_output("var", x, dims, out);
  var_kernel(x, dims, correction, out);
}

void Backend::softmax(const Tensor& x, int64_t dim, bool log, const Tensor& out) {
  check_same_shape_and_dtype("softmax", x, out);
  check(dim >= 0 && dim < x.dim(), "softmax: dim ", dim, " out of range for ", x.described());
  softmax_kernel(x, dim, log, out);
}

void Backend::softmax_backward(const Tensor& y, const Tensor& grad_y, int64_t dim, bool log, const Tensor& grad_x) {
  check_same_shape_and_dtype("softmax_backward", y, grad_y);
  check_same_shape_and_dtype("softmax_backward", y, grad_x);
  check(dim >= 0 && dim < y.dim(), "softmax_backward: dim ", dim, " out of range for ", y.described());
  softmax_backward_kernel(y, grad_y, dim, log, grad_x);
}

// ---- matmul ------------------------------------------------------------------------------------------------

void Backend::matmul(const Tensor& a, const Tensor& b, const Tensor& out, const Tensor& bias) {
  check_matmul(a, b, out, bias);
  if (out.numel() == 0) return;
  matmul_kernel(a, b, out, bias);
}

// ---- norms -------------------------------------------------------------------------------------------------

void Backend::layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, const Tensor& out,
                         const Tensor& mean, const Tensor& rstd) {
  const char* op = "layer_norm";
  const auto [N, C] = norm_rows(op, x);
  check_rows(op, "out", out, N, C, x.dtype());
  check_vector(op, "weight", weight, C, x.dtype());
  check_vector(op, "bias", bias, C, x.dtype());
  check_vector(op, "mean", mean, N, stats_dtype(x.dtype()));
  check_vector(op, "rstd", rstd, N, stats_dtype(x.dtype()));
  layer_norm_kernel(x, weight, bias, eps, out, mean, rstd);
}

void Backend::layer_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor& mean,
                                  const Tensor& rstd, const Tensor& grad_x, const Tensor& grad_weight,
                                  const Tensor& grad_bias) {
  const char* op = "layer_norm_backward";
  const auto [N, C] = norm_rows(op, x);
  check_rows(op, "grad_out", grad_out, N, C, x.dtype());
  check_vector(op, "weight", weight, C, x.dtype());
  check_vector(op, "mean", mean, N, stats_dtype(x.dtype()));
  check_vector(op, "rstd", rstd, N, stats_dtype(x.dtype()));
  check(mean.defined() && rstd.defined(), "layer_norm_backward: mean and rstd are required");
  if (grad_x.defined()) check_rows(op, "grad_x", grad_x, N, C, x.dtype());
  check_vector(op, "grad_weight", grad_weight, C, x.dtype());
  check_vector(op, "grad_bias", grad_bias, C, x.dtype());
  layer_norm_backward_kernel(grad_out, x, weight, mean, rstd, grad_x, grad_weight, grad_bias);
}

void Backend::rms_norm(const Tensor& x, const Tensor& weight, double eps, const Tensor& out, const Tensor& rstd) {
  const char* op = "rms_norm";
  const auto [N, C] = norm_rows(op, x);
  check_rows(op, "out", out, N, C, x.dtype());
  check_vector(op, "weight", weight, C, x.dtype());
  check_vector(op, "rstd", rstd, N, stats_dtype(x.dtype()));
  rms_norm_kernel(x, weight, eps, out, rstd);
}

void Backend::rms_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                                const Tensor& grad_x, const Tensor& grad_weight) {
  const char* op = "rms_norm_backward";
  const auto [N, C] = norm_rows(op, x);
  check_rows(op, "grad_out", grad_out, N, C, x.dtype());
  check_vector(op, "weight", weight, C, x.dtype());
  check_vector(op, "rstd", rstd, N, stats_dtype(x.dtype()));
  check(rstd.defined(), "rms_norm_backward: rstd is required");
  if (grad_x.defined()) check_rows(op, "grad_x", grad_x, N, C, x.dtype());
  check_vector(op, "grad_weight", grad_weight, C, x.dtype());
  rms_norm_backward_kernel(grad_out, x, weight, rstd, grad_x, grad_weight);
}

// ---- embedding ---------------------------------------------------------------------------------------------

void Backend::embedding(const Tensor& weight, const Tensor& indices, const Tensor& out) {
  check_embedding(weight, indices, out);
  embedding_kernel(weight, indices, out);
}

void Backend::embedding_backward(const Tensor& grad_out, const Tensor& indices, const Tensor& grad_weight) {
  check_embedding_backward(grad_out, indices, grad_weight);
  embedding_backward_kernel(grad_out, indices, grad_weight);
}

// ---- cross-entropy -----------------------------------------------------------------------------------------

void Backend::softmax_cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                                    const Tensor& loss, const Tensor& lse) {
  const char* op = "softmax_cross_entropy";
  const auto [N, V] = logit_rows(op, logits);
  check_targets(op, targets, N);
  check_tensor(op, "loss", loss, {}, stats_dtype(logits.dtype()));
  check_tensor(op, "lse", lse, {N}, stats_dtype(logits.dtype()));
  softmax_cross_entropy_kernel(logits, targets, ignore_index, loss, lse);
}

void Backend::softmax_cross_entropy_backward(const Tensor& grad_loss, const Tensor& logits, const Tensor& targets,
                                             const Tensor& lse, int64_t ignore_index, const Tensor& grad_logits) {
  const char* op = "softmax_cross_entropy_backward";
  const auto [N, V] = logit_rows(op, logits);
  check_targets(op, targets, N);
  check_tensor(op, "grad_loss", grad_loss, {}, stats_dtype(logits.dtype()));
  check_tensor(op, "lse", lse, {N}, stats_dtype(logits.dtype()));
  check_tensor(op, "grad_logits", grad_logits, {N, V}, logits.dtype());
  softmax_cross_entropy_backward_kernel(grad_loss, logits, targets, lse, ignore_index, grad_logits);
}

// ---- attention ---------------------------------------------------------------------------------------------

void Backend::causal_attention(const Tensor& q, const Tensor& k, const Tensor& v, double scale, const Tensor& out,
                               const Tensor& lse) {
  const char* op = "causal_attention";
  check_query(op, q);
  for (const auto& [name, t] : {std::pair<const char*, const Tensor&>{"q", q}, {"k", k}, {"v", v}, {"out", out}})
    check_bhtd(op, name, t, q.shape(), q.dtype());
  check_lse(op, lse, q);
  causal_attention_kernel(q, k, v, scale, out, lse);
}

void Backend::causal_attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                                        const Tensor& out, const Tensor& lse, double scale, const Tensor& grad_q,
                                        const Tensor& grad_k, const Tensor& grad_v) {
  const char* op = "causal_attention_backward";
  check_query(op, q);
  for (const auto& [name, t] : {std::pair<const char*, const Tensor&>{"grad_out", grad_out},
                                {"q", q},
                                {"k", k},
                                {"v", v},
                                {"out", out},
                                {"grad_q", grad_q},
                                {"grad_k", grad_k},
                                {"grad_v", grad_v}})
    check_bhtd(op, name, t, q.shape(), q.dtype());
  check_lse(op, lse, q);
  causal_attention_backward_kernel(grad_out, q, k, v, out, lse, scale, grad_q, grad_k, grad_v);
}

}  // namespace mixtape
