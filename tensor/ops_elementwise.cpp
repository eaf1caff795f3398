// Elementwise op front ends: argument checks, NumPy broadcasting, dtype promotion, the kernel call and the
// backward of each op (written with other ops so it runs on every backend).
#include <algorithm>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <string_view>
#include <utility>
#include <vector>

#include "tensor/autocast_state.h"
#include "tensor/autograd_node.h"
#include "tensor/backend.h"
#include "tensor/ops.h"

namespace mixtape {

namespace {

void check_defined(const char* op, const Tensor& x) { check(x.defined(), op, ": input is undefined"); }

void check_floating(const char* op, const Tensor& x) {
  check_defined(op, x);
  check(is_floating(x.dtype()), op, ": expected a floating tensor (f32, f16, bf16 or f64), got ",
        x.described());
}

// NumPy broadcasting of all operands: dims align from the right, and each dim is 1 or one common size.
Shape broadcast(const char* op, std::initializer_list<Tensor> operands) {
  const Tensor& first = *operands.begin();
  size_t ndim = 0;
  for (const Tensor& t : operands) {
    check(t.device() == first.device(), op, ": operands on different devices (", first.described(), ", ",
          t.described(), ")");
    ndim = std::max(ndim, static_cast<size_t>(t.dim()));
  }
  Shape shape(ndim, 1);
  for (size_t i = 0; i < ndim; ++i) {
    for (const Tensor& t : operands) {
      const size_t lead = ndim - static_cast<size_t>(t.dim());
      const int64_t size = i < lead ? 1 : t.shape()[i - lead];
      if (size == 1 || size == shape[i]) continue;
      if (shape[i] == 1) {
        shape[i] = size;
        continue;
      }
      std::ostringstream names;
      for (const Tensor& u : operands) names << (&u == &first ? "" : " and ") << u.description();
      fail(op, ": shapes do not broadcast: ", names.str(), " (dim ", i, " of the aligned shapes: ", shape[i],
           " vs ", size, ")");
    }
  }
  return shape;
}

// x without autograd history and in dtype `dtype` (a converted copy when it differs): what kernels see.
Tensor as_dtype(const Tensor& x, DType dtype) {
  const Tensor plain = x.detach();
  return plain.dtype() == dtype ? plain : plain.to(dtype);
}

// The gradient of a broadcast input: g summed over the broadcast dims back to the input's shape and cast
// to the input's dtype (the op computed in the promoted dtype).
Tensor grad_for(const Tensor& g, const Shape& shape, DType dtype) {
  const Tensor reduced = g.shape() == shape ? g : sum_to(g, shape);
  return reduced.dtype() == dtype ? reduced : reduced.to(dtype);
}

// ---- unary ----

Tensor unary_grad(UnaryOp op, const Tensor& x, const Tensor& y, const Tensor& g, double scalar) {
  const Tensor& like = x.defined() ? x : y;
  Tensor grad = Tensor::empty(like.shape(), like.dtype(), like.device());
  backend_of(like).unary_backward(op, x, y, g, grad, scalar);
  return grad;
}

// A unary op with an autocast class has the name of its row in the autocast tables (tensor/autocast_tables.h).
constexpr bool unary_autocast_names_agree() {
  for (const UnaryOpTraits& row : kUnaryOps)
    if (row.autocast != kNoAutocast && std::string_view(row.name) != autocast_op_name(row.autocast)) return false;
  return true;
}
static_assert(unary_autocast_names_agree(), "kUnaryOps and the autocast tables name an op differently");

// Every unary front end: its name, what its backward saves and its autocast class come from kUnaryOps.
Tensor unary_op(UnaryOp op, const Tensor& x, double scalar = 0) {
  const UnaryOpTraits& traits = unary_traits(op);
  if (traits.autocast != kNoAutocast)
    if (const auto cast = autocast_inputs(traits.autocast, x)) [[unlikely]] return unary_op(op, (*cast)[0], scalar);
  const char* name = traits.name;
  check_floating(name, x);
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  backend_of(x).unary(op, x, out, scalar);
  if (op == UnaryOp::Neg) {
    record_backward(name, {x}, out, [](const Tensor& g) { return Grads{neg(g)}; });
  } else if (derivative_from_output(op)) {
    const Tensor y = out.detach();
    record_backward(name, {x}, out, [op, y, scalar](const Tensor& g) {
      return Grads{unary_grad(op, Tensor(), y, g, scalar)};
    }, {y});
  } else {
    const Tensor saved = x.detach();
    record_backward(name, {x}, out, [op, saved, scalar](const Tensor& g) {
      return Grads{unary_grad(op, saved, Tensor(), g, scalar)};
    }, {x});
  }
  return out;
}

// ---- binary ----

struct BinaryInputs {
  Tensor a, b;  // detached, in their own (unbroadcast) shapes: in the compute dtype, or see prepare_binary
  Shape shape;  // the broadcast output shape
  DType dtype;  // the compute (and output) dtype: the promoted one
};

// `op`: an op whose kernel may read an input of another dtype in place (add, sub, mul, div), when the
// backend can (Backend::binary_reads_mixed). A residual add of a bf16 branch to an f32 stream then reads the
// bf16 values as they are, where a copy would write and read the f32 values once more. The result is the
// same: widening to the promoted dtype is exact.
BinaryInputs prepare_binary(const char* name, const Tensor& a, const Tensor& b,
                            std::optional<BinaryOp> op = std::nullopt) {
  check_floating(name, a);
  check_floating(name, b);
  BinaryInputs in;
  in.shape = broadcast(name, {a, b});
  in.dtype = promote(a.dtype(), b.dtype());
  const bool in_place = op && backend_of(a).binary_reads_mixed(a.dtype(), b.dtype(), in.dtype);
  in.a = in_place ? a.detach() : as_dtype(a, in.dtype);
  in.b = in_place ? b.detach() : as_dtype(b, in.dtype);
  return in;
}

// Whether the kernel of a promoting op reads a and b in place (Backend::binary_reads_mixed). Autocast's
// promote and not-listed classes then leave them to it: the kernel promotes to the same widest dtype with the same bits, and
// record_binary casts each gradient back to its input's dtype, as the hook's cast would in its backward.
bool promotes_in_kernel(const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined() || a.dtype() == b.dtype() || !is_floating(a.dtype()) || !is_floating(b.dtype()))
    return false;
  return backend_of(a).binary_reads_mixed(a.dtype(), b.dtype(), promote(a.dtype(), b.dtype()));
}

Tensor run_binary(BinaryOp op, const BinaryInputs& in) {
  Tensor out = Tensor::empty(in.shape, in.dtype, in.a.device());
  backend_of(out).binary(op, in.a.expand(in.shape), in.b.expand(in.shape), out);
  return out;
}

// Records the backward of a binary op: `grads(g)` returns the two gradients in the broadcast shape and the
// compute dtype (either may be undefined when its input needs none); they are reduced and cast here.
template <class GradFn>
void record_binary(const char* name, const Tensor& a, const Tensor& b, Tensor& out,
                   const std::vector<Tensor>& saved, GradFn grads) {
  if (!any_requires_grad({a, b})) return;
  const Shape a_shape = a.shape(), b_shape = b.shape();
  const DType a_dtype = a.dtype(), b_dtype = b.dtype();
  const bool need_a = a.requires_grad(), need_b = b.requires_grad();
  record_backward(name, {a, b}, out, [=](const Tensor& g) {
    auto [ga, gb] = grads(g, need_a, need_b);
    return Grads{need_a ? grad_for(ga, a_shape, a_dtype) : Tensor(),
                 need_b ? grad_for(gb, b_shape, b_dtype) : Tensor()};
  }, saved);
}

using GradPair = std::pair<Tensor, Tensor>;

// ---- tensor-scalar ----

Tensor scalar_op(BinaryOp op, const char* name, const Tensor& a, double scalar, bool scalar_first) {
  check_floating(name, a);
  Tensor out = Tensor::empty(a.shape(), a.dtype(), a.device());
  backend_of(a).binary_scalar(op, a, scalar, scalar_first, out);
  return out;
}

}  // namespace

// ---- tensor-tensor ---------------------------------------------------------------------------------------

Tensor add(const Tensor& a, const Tensor& b) {
  if (!promotes_in_kernel(a, b))
    if (const auto cast = autocast_inputs(AutocastOp::Add, a, b)) [[unlikely]]
      return add((*cast)[0], (*cast)[1]);
  const BinaryInputs in = prepare_binary("add", a, b, BinaryOp::Add);
  Tensor out = run_binary(BinaryOp::Add, in);
  record_binary("add", a, b, out, {}, [](const Tensor& g, bool, bool) { return GradPair{g, g}; });
  return out;
}

Tensor sub(const Tensor& a, const Tensor& b) {
  if (!promotes_in_kernel(a, b))
    if (const auto cast = autocast_inputs(AutocastOp::Sub, a, b)) [[unlikely]]
      return sub((*cast)[0], (*cast)[1]);
  const BinaryInputs in = prepare_binary("sub", a, b, BinaryOp::Sub);
  Tensor out = run_binary(BinaryOp::Sub, in);
  record_binary("sub", a, b, out, {}, [](const Tensor& g, bool, bool need_b) {
    return GradPair{g, need_b ? neg(g) : Tensor()};
  });
  return out;
}

Tensor mul(const Tensor& a, const Tensor& b) {
  if (!promotes_in_kernel(a, b))
    if (const auto cast = autocast_inputs(AutocastOp::Mul, a, b)) [[unlikely]]
      return mul((*cast)[0], (*cast)[1]);
  const BinaryInputs in = prepare_binary("mul", a, b, BinaryOp::Mul);
  Tensor out = run_binary(BinaryOp::Mul, in);
  const Tensor x = in.a, y = in.b;
  record_binary("mul", a, b, out, {x, y}, [x, y](const Tensor& g, bool need_a, bool need_b) {
    return GradPair{need_a ? mul(g, y) : Tensor(), need_b ? mul(g, x) : Tensor()};
  });
  return out;
}

// d(a/b)/da = 1/b; d(a/b)/db = -a/b^2 = -(a/b)/b, so grad_b = -grad_a * out.
Tensor div(const Tensor& a, const Tensor& b) {
  if (!promotes_in_kernel(a, b))
    if (const auto cast = autocast_inputs(AutocastOp::Div, a, b)) [[unlikely]]
      return div((*cast)[0], (*cast)[1]);
  const BinaryInputs in = prepare_binary("div", a, b, BinaryOp::Div);
  Tensor out = run_binary(BinaryOp::Div, in);
  const Tensor y = in.b, quotient = out.detach();
  record_binary("div", a, b, out, {y, quotient}, [y, quotient](const Tensor& g, bool, bool need_b) {
    const Tensor ga = div(g, y);
    return GradPair{ga, need_b ? neg(mul(ga, quotient)) : Tensor()};
  });
  return out;
}

// d(a^b)/da = b a^(b-1): taken as 0 where b == 0 (a^0 is the constant 1; the formula gives 0 * 0^-1 = NaN at
// a == 0). For a == 0 and 0 < b < 1 it is +inf, as the true derivative.
// d(a^b)/db = a^b log(a): taken as 0 where a == 0 (the limit of a^b log a as a -> 0+ for b > 0, and PyTorch's
// convention for b >= 0; for b < 0 the one-sided limit would be -inf). For a < 0 it is NaN: log(a) is
// undefined and a^b is real only for integer b, so there is no derivative in b.
Tensor pow(const Tensor& a, const Tensor& b) {
  if (const auto cast = autocast_inputs(AutocastOp::Pow, a, b)) [[unlikely]]
    return pow((*cast)[0], (*cast)[1]);
  const BinaryInputs in = prepare_binary("pow", a, b);
  Tensor out = run_binary(BinaryOp::Pow, in);
  const Tensor base = in.a, exponent = in.b, power = out.detach();
  const std::vector<Tensor> saved{base, exponent, power};
  record_binary("pow", a, b, out, saved, [base, exponent, power](const Tensor& g, bool need_a, bool need_b) {
    const Tensor zero = Tensor::zeros({}, g.dtype(), g.device());
    Tensor ga, gb;
    if (need_a) ga = mul(g, where(exponent, mul(exponent, pow(base, sub(exponent, 1.0))), zero));
    if (need_b) gb = mul(g, where(base, mul(power, log(base)), zero));
    return GradPair{ga, gb};
  });
  return out;
}

// ---- tensor-scalar ---------------------------------------------------------------------------------------

Tensor add(const Tensor& a, double b) {
  Tensor out = scalar_op(BinaryOp::Add, "add", a, b, false);
  record_backward("add", {a}, out, [](const Tensor& g) { return Grads{g}; });
  return out;
}

Tensor sub(const Tensor& a, double b) {
  Tensor out = scalar_op(BinaryOp::Sub, "sub", a, b, false);
  record_backward("sub", {a}, out, [](const Tensor& g) { return Grads{g}; });
  return out;
}

Tensor sub(double a, const Tensor& b) {
  Tensor out = scalar_op(BinaryOp::Sub, "sub", b, a, true);
  record_backward("sub", {b}, out, [](const Tensor& g) { return Grads{neg(g)}; });
  return out;
}

Tensor mul(const Tensor& a, double b) {
  Tensor out = scalar_op(BinaryOp::Mul, "mul", a, b, false);
  record_backward("mul", {a}, out, [b](const Tensor& g) { return Grads{mul(g, b)}; });
  return out;
}

Tensor div(const Tensor& a, double b) {
  Tensor out = scalar_op(BinaryOp::Div, "div", a, b, false);
  record_backward("div", {a}, out, [b](const Tensor& g) { return Grads{div(g, b)}; });
  return out;
}

// d(s/b)/db = -s/b^2 = -(s/b)/b.
Tensor div(double a, const Tensor& b) {
  Tensor out = scalar_op(BinaryOp::Div, "div", b, a, true);
  const Tensor x = b.detach(), quotient = out.detach();
  record_backward("div", {b}, out, [x, quotient](const Tensor& g) {
    return Grads{neg(div(mul(g, quotient), x))};
  }, {b, quotient});
  return out;
}

// d(x^p)/dx = p x^(p-1), and 0 for p == 0.
Tensor pow(const Tensor& a, double exponent) { return unary_op(UnaryOp::PowScalar, a, exponent); }

// ---- unary -----------------------------------------------------------------------------------------------

Tensor neg(const Tensor& x) { return unary_op(UnaryOp::Neg, x); }
Tensor exp(const Tensor& x) { return unary_op(UnaryOp::Exp, x); }
Tensor log(const Tensor& x) { return unary_op(UnaryOp::Log, x); }
Tensor sqrt(const Tensor& x) { return unary_op(UnaryOp::Sqrt, x); }
Tensor rsqrt(const Tensor& x) { return unary_op(UnaryOp::Rsqrt, x); }
Tensor tanh(const Tensor& x) { return unary_op(UnaryOp::Tanh, x); }
Tensor sigmoid(const Tensor& x) { return unary_op(UnaryOp::Sigmoid, x); }
Tensor relu(const Tensor& x) { return unary_op(UnaryOp::Relu, x); }  // relu'(0) = 0
Tensor gelu(const Tensor& x, GeluApproximation approximation) {
  return unary_op(approximation == GeluApproximation::Tanh ? UnaryOp::GeluTanh : UnaryOp::GeluErf, x);
}
Tensor silu(const Tensor& x) { return unary_op(UnaryOp::Silu, x); }
Tensor abs(const Tensor& x) { return unary_op(UnaryOp::Abs, x); }  // abs'(0) = 0

// ---- selection -------------------------------------------------------------------------------------------

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  // Only a and b take part in autocast: the condition is a mask, never cast.
  if (const auto cast = autocast_inputs(AutocastOp::Where, a, b)) [[unlikely]]
    return where(cond, (*cast)[0], (*cast)[1]);
  check_defined("where", cond);
  check_defined("where", a);
  check_defined("where", b);
  const bool both_floating = is_floating(a.dtype()) && is_floating(b.dtype());
  check(a.dtype() == b.dtype() || both_floating, "where: cannot combine ", a.described(), " with ",
        b.described(), " (mixing integer and floating values needs an explicit to())");
  const Shape shape = broadcast("where", {cond, a, b});
  const DType dtype = promote(a.dtype(), b.dtype());
  const Tensor c = cond.detach(), x = as_dtype(a, dtype), y = as_dtype(b, dtype);
  Tensor out = Tensor::empty(shape, dtype, a.device());
  backend_of(out).where(c.expand(shape), x.expand(shape), y.expand(shape), out);
  if (any_requires_grad({a, b})) {
    const Shape a_shape = a.shape(), b_shape = b.shape();
    const DType a_dtype = a.dtype(), b_dtype = b.dtype();
    const bool need_a = a.requires_grad(), need_b = b.requires_grad();
    // The condition selects which input each output element came from; it has no gradient itself.
    record_backward("where", {cond, a, b}, out, [=](const Tensor& g) {
      const Tensor zero = Tensor::zeros({}, g.dtype(), g.device());
      return Grads{Tensor(), need_a ? grad_for(where(c, g, zero), a_shape, a_dtype) : Tensor(),
                   need_b ? grad_for(where(c, zero, g), b_shape, b_dtype) : Tensor()};
    }, {cond});
  }
  return out;
}

// out = mask ? value : x, with x and mask broadcast together (value rounded to x's dtype).
Tensor masked_fill(const Tensor& x, const Tensor& mask, double value) {
  check_floating("masked_fill", x);
  check_defined("masked_fill", mask);
  const Shape shape = broadcast("masked_fill", {x, mask});
  const Tensor m = mask.detach();
  const Tensor fill = Tensor::scalar(value, x.dtype(), x.device());
  Tensor out = Tensor::empty(shape, x.dtype(), x.device());
  backend_of(out).where(m.expand(shape), fill.expand(shape), x.detach().expand(shape), out);
  const Shape x_shape = x.shape();
  record_backward("masked_fill", {x, mask}, out, [m, x_shape](const Tensor& g) {
    return Grads{grad_for(masked_fill(g, m, 0.0), x_shape, g.dtype()), Tensor()};
  }, {mask});
  return out;
}

}  // namespace mixtape
