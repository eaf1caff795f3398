// Fused layer_norm / rms_norm and dropout: front ends. The kernels (tensor/cpu/norm.cpp) see x as [N, C]
// contiguous rows; the front end flattens the leading dims and records the fused backward kernels.
#include <cmath>

#include "tensor/autocast_state.h"
#include "tensor/autograd_node.h"
#include "tensor/backend.h"
#include "tensor/kernel_contract.h"
#include "tensor/ops.h"

namespace mixtape {

namespace {

// The common checks of the norms: x floating with at least one dim; weight/bias (when given) floating of
// shape [C]. They are cast to x's dtype (a differentiable cast) and made contiguous for the kernel.
Tensor prepare_affine(const char* op, const char* name, const Tensor& x, const Tensor& t) {
  if (!t.defined()) return t;
  const int64_t C = x.shape().back();
  check(is_floating(t.dtype()), op, ": ", name, " must be floating, got ", t.described());
  check(t.dim() == 1 && t.shape()[0] == C, op, ": ", name, " ", t.described(),
        " does not match the last dim of x ", x.described(), " (expected [", C, "])");
  check(t.device() == x.device(), op, ": ", name, " is on ", t.device(), " but x is on ", x.device());
  return t.to(x.dtype()).contiguous();
}

void check_norm_input(const char* op, const Tensor& x, double eps) {
  check(x.defined(), op, ": x is undefined");
  check(is_floating(x.dtype()), op, ": expected a floating x (f32, f16, bf16 or f64), got ", x.described());
  check(x.dim() >= 1, op, ": x must have at least one dim (normalised over the last), got ", x.described());
  check(std::isfinite(eps) && eps >= 0, op, ": eps must be finite and >= 0, got ", eps);
}

Shape leading_shape(const Tensor& x) { return Shape(x.shape().begin(), x.shape().end() - 1); }

// x as contiguous [N, C] rows, without autograd history (the fused op records its own node).
Tensor as_rows(const Tensor& x) {
  const int64_t C = x.shape().back();
  return x.detach().contiguous().reshape({shape_numel(leading_shape(x)), C});
}

}  // namespace

LayerNormResult layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  if (const auto cast = autocast_inputs(AutocastOp::LayerNorm, x, weight, bias)) [[unlikely]]
    return layer_norm((*cast)[0], (*cast)[1], (*cast)[2], eps);
  check_norm_input("layer_norm", x, eps);
  const Tensor w = prepare_affine("layer_norm", "weight", x, weight);
  const Tensor b = prepare_affine("layer_norm", "bias", x, bias);
  const Tensor rows = as_rows(x);
  const int64_t N = rows.shape()[0], C = rows.shape()[1];
  Tensor out = Tensor::empty({N, C}, x.dtype(), x.device());
  const Tensor mean = Tensor::empty({N}, stats_dtype(x.dtype()), x.device());
  const Tensor rstd = Tensor::empty({N}, stats_dtype(x.dtype()), x.device());
  const Tensor wd = w.defined() ? w.detach() : w, bd = b.defined() ? b.detach() : b;
  backend_of(x).layer_norm(rows, wd, bd, eps, out, mean, rstd);
  out = out.view(x.shape());
  const bool need_w = w.defined() && w.requires_grad(), need_b = b.defined() && b.requires_grad();
  const Shape x_shape = x.shape();
  record_backward("layer_norm", {x, w, b}, out,
                  [rows, wd, mean, rstd, need_w, need_b, x_shape](const Tensor& g) {
                    const Tensor g_rows = g.contiguous().reshape(rows.shape());
                    const int64_t C = rows.shape()[1];
                    Tensor grad_x = Tensor::empty(rows.shape(), rows.dtype(), rows.device());
                    Tensor grad_w = need_w ? Tensor::empty({C}, rows.dtype(), rows.device()) : Tensor();
                    Tensor grad_b = need_b ? Tensor::empty({C}, rows.dtype(), rows.device()) : Tensor();
                    backend_of(rows).layer_norm_backward(g_rows, rows, wd, mean, rstd, grad_x, grad_w,
                                                         grad_b);
                    return Grads{grad_x.view(x_shape), grad_w, grad_b};
                  },
                  {x, w, mean, rstd});
  const Shape stats_shape = leading_shape(x);
  return {out, mean.view(stats_shape), rstd.view(stats_shape)};
}

RMSNormResult rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  if (const auto cast = autocast_inputs(AutocastOp::RMSNorm, x, weight)) [[unlikely]]
    return rms_norm((*cast)[0], (*cast)[1], eps);
  check_norm_input("rms_norm", x, eps);
  const Tensor w = prepare_affine("rms_norm", "weight", x, weight);
  const Tensor rows = as_rows(x);
  const int64_t N = rows.shape()[0], C = rows.shape()[1];
  Tensor out = Tensor::empty({N, C}, x.dtype(), x.device());
  const Tensor rstd = Tensor::empty({N}, stats_dtype(x.dtype()), x.device());
  const Tensor wd = w.defined() ? w.detach() : w;
  backend_of(x).rms_norm(rows, wd, eps, out, rstd);
  out = out.view(x.shape());
  const bool need_w = w.defined() && w.requires_grad();
  const Shape x_shape = x.shape();
  record_backward("rms_norm", {x, w}, out,
                  [rows, wd, rstd, need_w, x_shape](const Tensor& g) {
                    const Tensor g_rows = g.contiguous().reshape(rows.shape());
                    const int64_t C = rows.shape()[1];
                    Tensor grad_x = Tensor::empty(rows.shape(), rows.dtype(), rows.device());
                    Tensor grad_w = need_w ? Tensor::empty({C}, rows.dtype(), rows.device()) : Tensor();
                    backend_of(rows).rms_norm_backward(g_rows, rows, wd, rstd, grad_x, grad_w);
                    return Grads{grad_x.view(x_shape), grad_w};
                  },
                  {x, w, rstd});
  return {out, rstd.view(leading_shape(x))};
}

Tensor dropout(const Tensor& x, double p, Generator& generator, bool training) {
  check(x.defined(), "dropout: input is undefined");
  check(is_floating(x.dtype()), "dropout: expected a floating tensor (f32, f16, bf16 or f64), got ",
        x.described());
  check(p >= 0 && p < 1, "dropout: p must be in [0, 1), got ", p, " for ", x.described());
  if (!training || p == 0) return x;
  // The mask is a pure function of (seed, offset + i): nothing is stored, backward redraws it.
  const uint64_t seed = generator.seed;
  const uint64_t offset = generator.advance(static_cast<uint64_t>(x.numel()));
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  backend_of(x).dropout(x, p, seed, offset, out);
  record_backward("dropout", {x}, out, [p, seed, offset](const Tensor& g) {
    // d out_i / d x_i = keep_i / (1 - p): the same kernel applied to the gradient.
    Tensor grad = Tensor::empty(g.shape(), g.dtype(), g.device());
    backend_of(g).dropout(g, p, seed, offset, grad);
    return Grads{grad};
  });
  return out;
}

}  // namespace mixtape
