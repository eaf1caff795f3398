// Indexing and joining: embedding (a row gather with a deterministic scatter-add backward), cat, stack and
// split. split returns narrow() views, so its backward is narrow's; stack is unsqueeze + cat.
// Messages that format tensors are built only on failure (`if (...) fail(...)`): check() evaluates its
// arguments on every call, and description() costs about half a microsecond.
#include <algorithm>
#include <string>

#include "tensor/autocast_state.h"
#include "tensor/autograd_node.h"
#include "tensor/backend.h"
#include "tensor/ops.h"

namespace mixtape {

namespace {

// Every index must address a row of the weight: the kernels index without checking.
void check_indices_in_range(const Tensor& flat_indices, int64_t rows, const Tensor& weight) {
  // Device indices are read through the host (a small copy next to the gather: a bad index must be an
  // Error, never a read outside the weight).
  const Tensor host = flat_indices.device().is_cpu() ? flat_indices : flat_indices.to(Device::cpu());
  dispatch_index(host.dtype(), "embedding", [&]<typename I>() {
    const I* index = host.data<I>();
    const int64_t n = host.numel();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t v = static_cast<int64_t>(index[i]);
      if (v < 0 || v >= rows)
        fail("embedding: index ", v, " (at position ", i, ") is out of range for a weight ",
             weight.description(), " of ", rows, " rows (expected 0 <= index < ", rows, ")");
    }
  });
}

std::string descriptions(const std::vector<Tensor>& tensors) {
  std::string out;
  for (size_t i = 0; i < tensors.size(); ++i) out += (i ? ", " : "") + tensors[i].description();
  return out;
}

}  // namespace

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  if (!weight.defined() || !indices.defined())
    fail("embedding: weight ", weight.description(), " and indices ", indices.description(),
         " must both be defined");
  if (weight.dim() != 2) fail("embedding: weight ", weight.description(), " must be 2-d [V, C]");
  if (!is_floating(weight.dtype()))
    fail("embedding: weight ", weight.description(), " must be floating (f32, f16, bf16 or f64)");
  if (indices.dtype() != DType::I32 && indices.dtype() != DType::I64)
    fail("embedding: indices ", indices.description(), " must be i32 or i64");
  check(weight.device() == indices.device(), "embedding: weight on ", weight.device(), ", indices on ",
        indices.device());
  const int64_t V = weight.size(0), C = weight.size(1);
  const Tensor flat = indices.contiguous().reshape({-1});
  const int64_t n = flat.numel();
  check_indices_in_range(flat, V, weight);

  Shape out_shape = indices.shape();
  out_shape.push_back(C);
  Tensor out = Tensor::empty(out_shape, weight.dtype(), weight.device());
  backend_of(weight).embedding(weight.detach(), flat, make_view(out, {n, C}, {C, 1}, 0));

  const DType dtype = weight.dtype();
  // grad_weight[v] = sum of the output rows' gradients over the positions that looked up v.
  auto backward = [flat, n, V, C, dtype](const Tensor& g) {
    Tensor grad_weight = Tensor::zeros({V, C}, dtype, g.device());
    backend_of(g).embedding_backward(g.reshape({n, C}).contiguous(), flat, grad_weight);
    return Grads{grad_weight};
  };
  record_backward("embedding", {weight}, out, std::move(backward), {flat});
  return out;
}

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim) {
  if (const auto cast = autocast_inputs(AutocastOp::Cat, tensors)) [[unlikely]] return cat(*cast, dim);
  check(!tensors.empty(), "cat: needs at least one tensor");
  for (size_t i = 0; i < tensors.size(); ++i) check(tensors[i].defined(), "cat: tensor ", i, " is undefined");
  const Tensor& first = tensors[0];
  if (first.dim() < 1)
    fail("cat: tensors must have at least 1 dim (got ", descriptions(tensors), "); use stack for scalars");
  const int64_t d = normalize_dim(dim, first.dim(), "cat");
  Shape shape = first.shape();
  shape[d] = 0;
  DType dtype = first.dtype();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    if (t.dim() != first.dim())
      fail("cat: tensor ", i, " ", t.description(), " has ", t.dim(), " dims but tensor 0 ",
           first.description(), " has ", first.dim());
    for (int64_t k = 0; k < t.dim(); ++k) {
      if (k != d && t.shape()[k] != first.shape()[k])
        fail("cat: tensor ", i, " ", t.description(), " differs from tensor 0 ", first.description(),
             " in dim ", k, " (only dim ", d, " may differ)");
    }
    check(t.device() == first.device(), "cat: tensor ", i, " is on ", t.device(), ", tensor 0 on ",
          first.device());
    if (t.dtype() != dtype && !(is_floating(t.dtype()) && is_floating(dtype)))
      fail("cat: cannot join ", descriptions(tensors), ": integer tensors join only with the same dtype");
    dtype = promote(dtype, t.dtype());
    shape[d] += t.shape()[d];
  }

  Tensor out = Tensor::empty(shape, dtype, first.device());
  std::vector<int64_t> starts, lengths;
  int64_t start = 0;
  for (const Tensor& t : tensors) {
    const int64_t length = t.shape()[d];
    if (length > 0) {
      Shape piece_shape = shape;
      piece_shape[d] = length;
      const Tensor piece = make_view(out, piece_shape, out.strides(), start * out.strides()[d]);
      backend_of(out).copy(t.detach(), piece);  // converts to the joined dtype
    }
    starts.push_back(start);
    lengths.push_back(length);
    start += length;
  }
  record_backward("cat", tensors, out, [d, starts, lengths](const Tensor& g) {
    // Each input's gradient is its slice of g (a view; the engine casts it back to the input's dtype).
    Grads grads;
    for (size_t i = 0; i < starts.size(); ++i) grads.push_back(g.narrow(d, starts[i], lengths[i]));
    return grads;
  });
  return out;
}

Tensor stack(const std::vector<Tensor>& tensors, int64_t dim) {
  if (const auto cast = autocast_inputs(AutocastOp::Stack, tensors)) [[unlikely]] return stack(*cast, dim);
  check(!tensors.empty(), "stack: needs at least one tensor");
  for (size_t i = 0; i < tensors.size(); ++i) {
    check(tensors[i].defined(), "stack: tensor ", i, " is undefined");
    if (tensors[i].shape() != tensors[0].shape())
      fail("stack: tensor ", i, " ", tensors[i].description(), " differs in shape from tensor 0 ",
           tensors[0].description(), " (stack needs equal shapes)");
  }
  const int64_t d = normalize_dim(dim, tensors[0].dim() + 1, "stack");
  std::vector<Tensor> unsqueezed;
  unsqueezed.reserve(tensors.size());
  for (const Tensor& t : tensors) unsqueezed.push_back(t.unsqueeze(d));
  return cat(unsqueezed, d);
}

std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim) {
  check(x.defined(), "split: input is undefined");
  if (x.dim() < 1) fail("split: cannot split a 0-d tensor ", x.description());
  const int64_t d = normalize_dim(dim, x.dim(), "split");
  const int64_t n = x.shape()[d];
  if (split_size <= 0) fail("split: split_size must be positive, got ", split_size, " for ", x.description());
  std::vector<Tensor> pieces;
  if (n == 0) pieces.push_back(x.narrow(d, 0, 0));  // one empty piece, as numpy.array_split
  for (int64_t start = 0; start < n; start += split_size)
    pieces.push_back(x.narrow(d, start, std::min(split_size, n - start)));
  return pieces;
}

std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim) {
  check(x.defined(), "split: input is undefined");
  if (x.dim() < 1) fail("split: cannot split a 0-d tensor ", x.description());
  const int64_t d = normalize_dim(dim, x.dim(), "split");
  int64_t total = 0;
  for (int64_t s : sizes) {
    if (s < 0) fail("split: negative size in ", shape_str(sizes), " for ", x.description());
    total += s;
  }
  if (total != x.shape()[d])
    fail("split: sizes ", shape_str(sizes), " sum to ", total, " but dim ", d, " of ", x.description(),
         " has ", x.shape()[d]);
  std::vector<Tensor> pieces;
  int64_t start = 0;
  for (int64_t s : sizes) {
    pieces.push_back(x.narrow(d, start, s));
    start += s;
  }
  return pieces;
}

}  // namespace mixtape
