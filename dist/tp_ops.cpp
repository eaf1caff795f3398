#include "dist/tp_ops.h"

#include "tensor/autograd_node.h"
#include "tensor/error.h"
#include "tensor/ops.h"

namespace mixtape::dist {

namespace {

void check_input(const Tensor& x, const char* op) {
  if (!x.defined() || x.dim() < 1) [[unlikely]]
    fail(op, ": expected a defined tensor with at least one dim, got ",
         x.defined() ? x.description() : std::string("undefined"));
}

}  // namespace

Tensor all_gather_last_dim(const Tensor& x, const Communicator& tp) {
  NoGradGuard no_grad;
  const Tensor d = x.detach();
  if (tp.size() == 1) return d.contiguous();
  const int64_t k = d.size(-1);
  const int64_t rows = k == 0 ? 0 : d.numel() / k;
  // [rows, k] -> [k, rows] so the gathered dim is dim 0; rank i's block becomes rows [i k, (i+1) k) of
  // [tp k, rows], i.e. columns [i k, (i+1) k) once transposed back.
  const Tensor gathered = tp.all_gather(d.reshape({rows, k}).mT().contiguous());
  Shape shape = d.shape();
  shape.back() = k * tp.size();
  return gathered.mT().contiguous().reshape(shape);
}

Tensor chunk_last_dim(const Tensor& x, const Communicator& tp, const char* op) {
  NoGradGuard no_grad;
  const Tensor d = x.detach();
  const int64_t n = d.size(-1);
  if (n % tp.size() != 0) [[unlikely]]
    fail(op, ": the last dim of ", d.description(), " (", n, ") is not divisible by the ", tp.name(), " size ",
         tp.size(), " (rank ", tp.rank(), ")");
  if (tp.size() == 1) return d.contiguous();
  const int64_t k = n / tp.size();
  return d.narrow(-1, tp.rank() * k, k).contiguous();
}

Tensor copy_to_tp_region(const Tensor& x, const Communicator& tp) {
  check_input(x, "copy_to_tp_region");
  if (tp.size() == 1) return x;
  Tensor out = x.detach();
  record_backward("copy_to_tp_region", {x}, out, [tp](const Tensor& g) {
    Tensor summed = g.detach().contiguous().clone();
    tp.all_reduce(summed, Reduction::Sum);
    return Grads{summed};
  });
  return out;
}

Tensor reduce_from_tp_region(const Tensor& x, const Communicator& tp) {
  check_input(x, "reduce_from_tp_region");
  if (tp.size() == 1) return x;
  Tensor out;
  {
    NoGradGuard no_grad;
    out = x.detach().contiguous().clone();
  }
  tp.all_reduce(out, Reduction::Sum);
  record_backward("reduce_from_tp_region", {x}, out, [](const Tensor& g) { return Grads{g}; });
  return out;
}

Tensor scatter_to_tp_region(const Tensor& x, const Communicator& tp) {
  check_input(x, "scatter_to_tp_region");
  Tensor out = chunk_last_dim(x, tp, "scatter_to_tp_region");
  if (tp.size() == 1) return x;
  record_backward("scatter_to_tp_region", {x}, out,
                  [tp](const Tensor& g) { return Grads{all_gather_last_dim(g, tp)}; });
  return out;
}

Tensor gather_from_tp_region(const Tensor& x, const Communicator& tp) {
  check_input(x, "gather_from_tp_region");
  if (tp.size() == 1) return x;
  Tensor out = all_gather_last_dim(x, tp);
  record_backward("gather_from_tp_region", {x}, out,
                  [tp](const Tensor& g) { return Grads{chunk_last_dim(g, tp, "gather_from_tp_region backward")}; });
  return out;
}

}  // namespace mixtape::dist
