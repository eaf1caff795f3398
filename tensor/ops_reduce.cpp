// Reductions (sum, mean, max, min, var, norm, sum_to) and softmax / log_softmax: front ends and backward.
#include <algorithm>
#include <cmath>
#include <sstream>

#include "tensor/autocast_state.h"
#include "tensor/autograd_node.h"
#include "tensor/backend.h"
#include "tensor/ops.h"

namespace mixtape {

namespace {

void check_floating(const char* op, const Tensor& x) {
  check(x.defined(), op, ": input is undefined");
  check(is_floating(x.dtype()), op, ": expected a floating tensor (f32, f16, bf16 or f64), got ",
        x.described());
}

// The dims a reduction runs over, normalised (sorted, unique), and the shapes of its result.
struct ReduceDims {
  std::vector<int64_t> dims;  // sorted, unique, in 0..ndim-1; empty for a 0-d input
  Shape keep_shape;           // x's shape with the reduced dims set to 1
  Shape out_shape;            // keep_shape without those dims unless keepdim
  int64_t count = 1;          // elements combined into each output
};

ReduceDims resolve_dims(const char* op, const Tensor& x, const std::vector<int64_t>& requested,
                        bool keepdim) {
  check_floating(op, x);
  const int64_t ndim = x.dim();
  ReduceDims r;
  if (requested.empty()) {
    for (int64_t d = 0; d < ndim; ++d) r.dims.push_back(d);
  } else {
    // A 0-d tensor accepts dim 0 / -1 (as in torch) and has nothing to reduce.
    const int64_t range = std::max<int64_t>(ndim, 1);
    for (int64_t d : requested) {
      check(d >= -range && d < range, op, ": dim ", d, " is out of range for ", x.described(),
            " (expected ", -range, "..", range - 1, ")");
      if (ndim > 0) r.dims.push_back(d < 0 ? d + ndim : d);
    }
    std::sort(r.dims.begin(), r.dims.end());
    const auto repeated = std::adjacent_find(r.dims.begin(), r.dims.end());
    check(repeated == r.dims.end(), op, ": dim ", repeated == r.dims.end() ? 0 : *repeated,
          " appears more than once in ", shape_text(requested), " for ", x.described());
  }
  r.keep_shape = x.shape();
  for (int64_t d : r.dims) {
    r.count *= x.shape()[d];
    r.keep_shape[d] = 1;
  }
  for (int64_t d = 0; d < ndim; ++d)
    if (keepdim || !std::binary_search(r.dims.begin(), r.dims.end(), d))
      r.out_shape.push_back(r.keep_shape[d]);
  return r;
}

// Runs the reduction kernel; the result has r.out_shape and no autograd history yet.
Tensor run_reduce(ReduceOp op, const Tensor& x, const ReduceDims& r) {
  Tensor out = Tensor::empty(r.keep_shape, x.dtype(), x.device());
  backend_of(x).reduce(op, x, r.dims, out);
  return r.out_shape == r.keep_shape ? out : out.view(r.out_shape);
}

// The gradient of a reduced output brought back to x's shape (a broadcast view, no copy).
Tensor expand_back(const Tensor& g, const Shape& keep_shape, const Shape& x_shape) {
  return g.reshape(keep_shape).expand(x_shape);
}

// max / min: the gradient goes to the elements equal to the extremum, split evenly among ties (torch.amax).
Tensor extremum(const char* op, ReduceOp kind, const Tensor& x, const std::vector<int64_t>& dims,
                bool keepdim) {
  const ReduceDims r = resolve_dims(op, x, dims, keepdim);
  check(r.count > 0, op, ": cannot reduce over an empty dim of ", x.described());
  Tensor out = run_reduce(kind, x, r);
  const Tensor extreme = out.detach();
  record_backward(op, {x}, out,
                  [x, extreme, r](const Tensor& g) {
                    // 1 exactly where x equals the extremum, by comparison: x - m would be NaN, not 0, where
                    // both are the same infinity.
                    const Tensor xd = x.detach();
                    const Tensor is_extreme = Tensor::empty(x.shape(), x.dtype(), x.device());
                    backend_of(x).binary(BinaryOp::Eq, xd, extreme.reshape(r.keep_shape).expand(x.shape()),
                                         is_extreme);
                    const Tensor ties = sum(is_extreme, r.dims, true);
                    return Grads{mul(is_extreme, div(g.reshape(r.keep_shape), ties))};
                  },
                  {x, extreme});
  return out;
}

void check_softmax(const char* op, const Tensor& x, int64_t dim) {
  check_floating(op, x);
  const int64_t range = std::max<int64_t>(x.dim(), 1);
  check(dim >= -range && dim < range, op, ": dim ", dim, " is out of range for ", x.described(),
        " (expected ", -range, "..", range - 1, ")");
}

Tensor softmax_impl(const char* op, const Tensor& input, int64_t dim, bool log) {
  check_softmax(op, input, dim);
  // A 0-d tensor is a row of one element.
  const Tensor x = input.dim() == 0 ? input.reshape({1}) : input;
  dim = dim < 0 ? dim + x.dim() : dim;
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
  backend_of(x).softmax(x, dim, log, y);
  if (input.dim() == 0) y = y.view({});
  const Tensor saved = y.detach();
  record_backward(op, {input}, y, [saved, dim, log](const Tensor& g) {
    const Tensor y1 = saved.dim() == 0 ? saved.reshape({1}) : saved;
    Tensor grad = Tensor::empty(y1.shape(), y1.dtype(), y1.device());
    backend_of(y1).softmax_backward(y1, g.reshape(y1.shape()), dim, log, grad);
    return Grads{grad.reshape(saved.shape())};
  }, {saved});
  return y;
}

}  // namespace

Tensor sum(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  if (const auto cast = autocast_inputs(AutocastOp::Sum, x)) [[unlikely]]
    return sum((*cast)[0], dims, keepdim);
  const ReduceDims r = resolve_dims("sum", x, dims, keepdim);
  Tensor out = run_reduce(ReduceOp::Sum, x, r);
  const Shape x_shape = x.shape();
  record_backward("sum", {x}, out,
                  [r, x_shape](const Tensor& g) { return Grads{expand_back(g, r.keep_shape, x_shape)}; });
  return out;
}

Tensor mean(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  if (const auto cast = autocast_inputs(AutocastOp::Mean, x)) [[unlikely]]
    return mean((*cast)[0], dims, keepdim);
  const ReduceDims r = resolve_dims("mean", x, dims, keepdim);
  Tensor out = run_reduce(ReduceOp::Mean, x, r);
  const Shape x_shape = x.shape();
  record_backward("mean", {x}, out, [r, x_shape](const Tensor& g) {
    // d mean / dx_i = 1/n: scale the (small) reduced gradient, then broadcast it.
    return Grads{expand_back(div(g, static_cast<double>(r.count)), r.keep_shape, x_shape)};
  });
  return out;
}

Tensor max(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return extremum("max", ReduceOp::Max, x, dims, keepdim);
}

Tensor min(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return extremum("min", ReduceOp::Min, x, dims, keepdim);
}

Tensor var(const Tensor& x, const std::vector<int64_t>& dims, int64_t correction, bool keepdim) {
  if (const auto cast = autocast_inputs(AutocastOp::Var, x)) [[unlikely]]
    return var((*cast)[0], dims, correction, keepdim);
  const ReduceDims r = resolve_dims("var", x, dims, keepdim);
  check(correction >= 0, "var: correction must be >= 0, got ", correction, " for ", x.described());
  Tensor out = Tensor::empty(r.keep_shape, x.dtype(), x.device());
  backend_of(x).var(x, r.dims, correction, out);
  if (r.out_shape != r.keep_shape) out = out.view(r.out_shape);
  record_backward("var", {x}, out,
                  [x, r, correction](const Tensor& g) {
                    // d var / dx_i = 2 (x_i - mean) / (n - correction); the mean term's own derivative sums
                    // to zero.
                    const double scale =
                        2.0 / static_cast<double>(std::max<int64_t>(0, r.count - correction));
                    const Tensor centered = sub(x, mean(x, r.dims, true));
                    return Grads{mul(centered, mul(g.reshape(r.keep_shape), scale))};
                  },
                  {x});
  return out;
}

Tensor norm(const Tensor& x, double p, const std::vector<int64_t>& dims, bool keepdim) {
  if (const auto cast = autocast_inputs(AutocastOp::Norm, x)) [[unlikely]]
    return norm((*cast)[0], p, dims, keepdim);
  const ReduceDims r = resolve_dims("norm", x, dims, keepdim);
  check(p > 0, "not supported: norm with p = ", p, " for ", x.described(),
        " (expected p > 0, finite or inf; PyTorch's p = 0, p < 0 and -inf are not implemented)");
  check(!(std::isinf(p) && r.count == 0), "norm: the inf norm of ", x.described(), " over dims ",
        shape_text(r.dims), " reduces empty sets (a max of nothing); expected a non-empty reduction");
  const DType acc = x.dtype() == DType::F64 ? DType::F64 : DType::F32;
  AutocastScope no_autocast(std::nullopt);  // the ops below are the norm's own arithmetic
  if (p == 1 || std::isinf(p)) {
    // Recorded compositions: abs's gradient is sign(x) (0 at 0), max's is split among ties (PyTorch's).
    const Tensor a = abs(x.to(acc));
    return (p == 1 ? sum(a, dims, keepdim) : max(a, dims, keepdim)).to(x.dtype());
  }
  Tensor value;  // keep_shape, in acc
  {
    NoGradGuard no_grad;
    const Tensor xa = x.to(acc);
    value = p == 2 ? sqrt(sum(mul(xa, xa), r.dims, true)) : pow(sum(pow(abs(xa), p), r.dims, true), 1.0 / p);
  }
  Tensor out = value.to(x.dtype());
  if (r.out_shape != r.keep_shape) out = out.view(r.out_shape);
  const Tensor saved = value.detach();  // may be out's own storage: captured detached (no cycle)
  record_backward("norm", {x}, out,
                  [x, r, p, saved](const Tensor& g) {
                    // d norm / dx_i = sign(x_i) |x_i|^(p-1) / norm^(p-1) (x_i / norm for p = 2), and 0 where
                    // the norm is 0 (PyTorch's subgradient) or, for p < 2, where x_i is 0. For p < 2 the
                    // power is taken as |x|^(p-1) (as PyTorch): x |x|^(p-2) would overflow first for tiny x.
                    const DType dtype = saved.dtype();
                    const Tensor xa = x.to(dtype), zero = Tensor::zeros({}, dtype, x.device());
                    const Tensor gk = g.reshape(r.keep_shape).to(dtype);
                    if (p == 2) return Grads{mul(xa, where(saved, div(gk, saved), zero)).to(x.dtype())};
                    const Tensor a = abs(xa);
                    const Tensor scaled = p > 2 ? mul(xa, pow(a, p - 2))
                                                : where(xa, mul(div(xa, a), pow(a, p - 1)), zero);
                    const Tensor per_norm = where(saved, div(gk, pow(saved, p - 1)), zero);
                    return Grads{mul(scaled, per_norm).to(x.dtype())};
                  },
                  {x, saved});
  return out;
}

Tensor sum_to(const Tensor& x, const Shape& shape) {
  check(x.defined(), "sum_to: input is undefined");
  const int64_t lead = x.dim() - static_cast<int64_t>(shape.size());
  bool ok = lead >= 0;
  for (size_t i = 0; ok && i < shape.size(); ++i) ok = shape[i] == 1 || shape[i] == x.shape()[lead + i];
  check(ok, "sum_to: cannot sum ", x.described(), " to ", shape_text(shape), " (", shape_text(shape),
        " must broadcast to ", shape_text(x.shape()), ")");
  if (x.shape() == shape) return x;
  // Reduce the leading extra dims and the dims where `shape` has 1 but x does not, then drop the leading
  // dims.
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < x.dim(); ++d)
    if (d < lead || (shape[d - lead] == 1 && x.shape()[d] != 1)) dims.push_back(d);
  if (dims.empty()) return x.reshape(shape);
  return sum(x, dims, true).reshape(shape);
}

Tensor softmax(const Tensor& x, int64_t dim) {
  if (const auto cast = autocast_inputs(AutocastOp::Softmax, x)) [[unlikely]] return softmax((*cast)[0], dim);
  return softmax_impl("softmax", x, dim, false);
}
Tensor log_softmax(const Tensor& x, int64_t dim) {
  if (const auto cast = autocast_inputs(AutocastOp::LogSoftmax, x)) [[unlikely]] return log_softmax((*cast)[0], dim);
  return softmax_impl("log_softmax", x, dim, true);
}

}  // namespace mixtape
