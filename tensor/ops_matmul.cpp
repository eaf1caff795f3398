// matmul: [..., M, K] @ [..., K, N] with NumPy semantics (batch dims broadcast, 1-d operands promoted to a
// matrix and the added dim squeezed away afterwards, as numpy.matmul does).
//
// Per-call overhead matters here (small products are called often and do little work each): error messages
// that format tensors (description(), an ostringstream each) are built only on failure, with
// `if (...) fail(...)` rather than check(), whose arguments are evaluated before the call.
#include <algorithm>

#include "tensor/autocast_state.h"
#include "tensor/autograd_node.h"
#include "tensor/backend.h"
#include "tensor/ops.h"
#include "tensor/scaled_linear.h"

namespace mixtape {

namespace {

// The dims before the last: their product is the row count of a tensor seen as a matrix of rows.
Shape leading_dims(const Tensor& t) { return Shape(t.shape().begin(), t.shape().end() - 1); }

// The batch shape of two matrices' leading dims under NumPy broadcasting, with an error naming both operands.
Shape broadcast_batch(const Tensor& a, const Tensor& b, const Tensor& a2, const Tensor& b2) {
  const Shape a_batch(a2.shape().begin(), a2.shape().end() - 2);
  const Shape b_batch(b2.shape().begin(), b2.shape().end() - 2);
  const size_t n = std::max(a_batch.size(), b_batch.size());
  Shape batch(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t sa = i + a_batch.size() >= n ? a_batch[i + a_batch.size() - n] : 1;
    const int64_t sb = i + b_batch.size() >= n ? b_batch[i + b_batch.size() - n] : 1;
    if (sa != sb && sa != 1 && sb != 1)
      fail("matmul: ", a.description(), " x ", b.description(), ": batch dims ", shape_str(a_batch), " and ",
           shape_str(b_batch), " do not broadcast");
    batch[i] = sa == 1 ? sb : sa;
  }
  return batch;
}

// The kernel's view of a matrix operand: [batch..., rows, cols] with stride 0 along the batch dims it lacks or
// has as 1. A plain view without autograd history (the op records its own backward).
Tensor broadcast_to_batch(const Tensor& t, const Shape& batch) {
  const size_t n = batch.size(), own = static_cast<size_t>(t.dim()) - 2;
  Shape shape = batch;
  Strides strides(n, 0);
  for (size_t i = 0; i < own; ++i) {
    const size_t d = n - own + i;
    if (t.shape()[i] == batch[d]) strides[d] = t.strides()[i];
  }
  shape.insert(shape.end(), {t.size(-2), t.size(-1)});
  strides.insert(strides.end(), {t.stride(-2), t.stride(-1)});
  return make_view(t, shape, strides, t.offset());
}

// The incoming gradient g as the operand of a backward's two products. Where the backend multiplies g's dtype
// through f32 (Backend::matmul_widens: f16 on a CPU) each product would widen g again, so it is widened once
// here; round() brings each f32 product back to g's dtype as the backend would (the same bits).
struct GradOperand {
  Tensor operand;
  DType dtype;
  Tensor round(const Tensor& product) const { return product.to(dtype); }
};
GradOperand grad_operand(const Tensor& g, bool two_products) {
  const bool widen = two_products && backend_of(g).matmul_widens(g.dtype());
  return {widen ? g.to(DType::F32) : g, g.dtype()};
}

// The gradient of an operand that was broadcast over the batch, summed back to its own shape.
Tensor reduce_to(const Tensor& grad, const Shape& shape) {
  return grad.shape() == shape ? grad : sum_to(grad, shape);
}

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b) {
  if (const auto cast = autocast_inputs(AutocastOp::Matmul, a, b)) [[unlikely]]
    return matmul((*cast)[0], (*cast)[1]);
  if (!a.defined() || !b.defined())
    fail("matmul: ", a.description(), " x ", b.description(), ": undefined operand");
  if (a.dim() < 1 || b.dim() < 1)
    fail("matmul: ", a.description(), " x ", b.description(),
         ": both operands need at least 1 dim (use mul for scalars)");
  if (!is_floating(a.dtype()) || !is_floating(b.dtype()))
    fail("matmul: ", a.description(), " x ", b.description(),
         ": expected floating dtypes (f32, f16, bf16 or f64)");
  if (a.device() != b.device())
    fail("matmul: ", a.description(), " x ", b.description(), ": operands on ", a.device(), " and ",
         b.device());
  const int64_t k_a = a.size(-1), k_b = b.dim() == 1 ? b.size(0) : b.size(-2);
  if (k_a != k_b)
    fail("matmul: ", a.description(), " x ", b.description(), ": inner dims differ (", k_a, " vs ", k_b, ")");

  // Mixed dtypes compute in the wider one; the casts are differentiable, so gradients come back in each
  // operand's own dtype.
  const DType dtype = promote(a.dtype(), b.dtype());
  const Tensor x = a.dim() == 1 ? a.to(dtype).unsqueeze(0) : a.to(dtype);  // [K] -> [1, K]
  const Tensor w = b.dim() == 1 ? b.to(dtype).unsqueeze(1) : b.to(dtype);  // [K] -> [K, 1]
  const Shape batch = broadcast_batch(a, b, x, w);
  const int64_t M = x.size(-2), N = w.size(-1);

  Shape out_shape = batch;
  out_shape.insert(out_shape.end(), {M, N});
  Tensor out = Tensor::empty(out_shape, dtype, x.device());
  backend_of(x).matmul(broadcast_to_batch(x, batch), broadcast_to_batch(w, batch), out, Tensor());

  // d(x @ w) = dx @ w + x @ dw:  grad_x = g @ w^T,  grad_w = x^T @ g, each summed over the batch dims its
  // operand was broadcast along. Only the gradients an operand needs are computed.
  const bool x_grad = x.requires_grad(), w_grad = w.requires_grad();
  const Tensor xs = x.detach(), ws = w.detach();
  auto backward = [xs, ws, x_grad, w_grad](const Tensor& g) {
    Grads grads(2);
    const GradOperand gm = grad_operand(g, x_grad && w_grad);
    if (x_grad) grads[0] = reduce_to(gm.round(matmul(gm.operand, ws.mT())), xs.shape());
    if (w_grad) {
      if (ws.dim() == 2 && g.dim() > 2) {
        // A matrix shared by the whole batch (a linear layer; x then has every batch dim itself): one
        // [K, B*M] x [B*M, N] product sums over the batch inside its reduction, instead of B products and
        // a separate sum.
        // The row count is spelled out: reshape cannot infer a -1 beside a 0 (K or N may be 0).
        const int64_t K = xs.size(-1), N = g.size(-1), rows = shape_numel(leading_dims(xs));
        grads[1] = gm.round(matmul(xs.reshape({rows, K}).mT(), gm.operand.reshape({rows, N})));
      } else {
        grads[1] = reduce_to(gm.round(matmul(xs.mT(), gm.operand)), ws.shape());
      }
    }
    return grads;
  };
  record_backward("matmul", {x, w}, out, std::move(backward), {x, w});

  if (a.dim() == 1) out = out.squeeze(-2);
  if (b.dim() == 1) out = out.squeeze(-1);
  return out;
}

// linear: x [..., K] @ weight[N, K]^T + bias[N] in one kernel call (the bias joins the accumulator, so a
// bf16 layer rounds once, and no separate add pass runs over the output).
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  // fp8 / block-scaled GEMMs for the weights a LowPrecisionScope covers (before autocast: they quantize from
  // the weight itself, as Transformer Engine does, not from a bf16 copy).
  if (const std::shared_ptr<LowPrecisionContext>& low = active_low_precision_context(); low && weight.defined())
    [[unlikely]] if (low->covers(weight)) return scaled_linear(x, weight, bias, low);
  if (const auto cast = autocast_inputs(AutocastOp::Linear, x, weight, bias)) [[unlikely]]
    return linear((*cast)[0], (*cast)[1], (*cast)[2]);
  if (!x.defined() || !weight.defined())
    fail("linear: input ", x.description(), " and weight ", weight.description(), " must be defined");
  if (!is_floating(x.dtype()) || !is_floating(weight.dtype()) || (bias.defined() && !is_floating(bias.dtype())))
    fail("linear: expected floating dtypes (f32, f16, bf16 or f64), got input ", x.description(), ", weight ",
         weight.description(), ", bias ", bias.description());
  if (x.dim() < 1 || weight.dim() != 2 || x.size(-1) != weight.size(1))
    fail("linear: input ", x.description(), " and weight ", weight.description(),
         ": expected input [..., K] and weight [N, K]");
  if (bias.defined() && (bias.dim() != 1 || bias.size(0) != weight.size(0)))
    fail("linear: bias ", bias.description(), " must be [N] = [", weight.size(0), "] for weight ",
         weight.description());
  if (x.device() != weight.device() || (bias.defined() && bias.device() != x.device()))
    fail("linear: input ", x.description(), ", weight ", weight.description(), " and bias ", bias.description(),
         " must be on one device");

  DType dtype = promote(x.dtype(), weight.dtype());
  if (bias.defined()) dtype = promote(dtype, bias.dtype());
  const Tensor xs = x.to(dtype), ws = weight.to(dtype);
  const Tensor bs = bias.defined() ? bias.to(dtype) : Tensor();
  const int64_t K = ws.size(1), N = ws.size(0);
  Shape out_shape = xs.shape();
  out_shape.back() = N;
  Tensor out = Tensor::empty(out_shape, dtype, xs.device());
  {
    // The kernel's operands: x as [..., M, K] ([1, K] for a vector), weight^T [K, N] broadcast over x's batch.
    const Tensor x2 = xs.dim() == 1 ? xs.detach().unsqueeze(0) : xs.detach();
    const Tensor out2 = xs.dim() == 1 ? out.unsqueeze(0) : out;
    const Shape batch(x2.shape().begin(), x2.shape().end() - 2);
    const Tensor b_contig = bs.defined() ? bs.detach().contiguous() : Tensor();
    backend_of(xs).matmul(x2, broadcast_to_batch(ws.detach().mT(), batch), out2, b_contig);
  }

  // grad_x = g @ W, grad_W = g^T x over all rows at once, grad_b = g summed over all but the last dim. grad_x
  // comes last: it is what the next backward node reads, so it is still in cache when that node runs.
  const bool x_grad = xs.requires_grad(), w_grad = ws.requires_grad(), b_grad = bs.defined() && bs.requires_grad();
  const Tensor xd = xs.detach(), wd = ws.detach();
  auto backward = [xd, wd, x_grad, w_grad, b_grad, K, N](const Tensor& g) {
    Grads grads(3);
    const GradOperand gm = grad_operand(g, x_grad && w_grad);
    if (w_grad) {  // the row count spelled out: reshape cannot infer a -1 beside a 0 (K or N may be 0)
      const int64_t rows = shape_numel(leading_dims(xd));
      grads[1] = gm.round(matmul(gm.operand.reshape({rows, N}).mT(), xd.reshape({rows, K})));
    }
    if (b_grad) grads[2] = sum_to(g, {N});
    if (x_grad) grads[0] = gm.round(matmul(gm.operand, wd));
    return grads;
  };
  record_backward("linear", {xs, ws, bs}, out, std::move(backward), {xs, ws});
  return out;
}

}  // namespace mixtape
