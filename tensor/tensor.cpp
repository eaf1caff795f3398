#include "tensor/tensor.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <limits>
#include <numeric>
#include <sstream>

#include "tensor/autograd_node.h"
#include "tensor/backend.h"
#include "tensor/ops.h"
#include "tensor/quantize.h"

namespace mixtape {

// ---- construction ----------------------------------------------------------------------------------

namespace {

void check_shape(const Shape& shape, const char* op) {
  for (int64_t s : shape)
    if (s < 0) fail(op, ": negative size in shape ", shape_str(shape));
}

// normalize_dim for a dim of `t` (or of a result with `ndim` dims), naming the tensor in the error.
// Hot paths (size(), stride(), data<T>(), make_view) build their messages only on failure: check() evaluates
// its arguments on every call, and description() / shape_str() each format through an ostringstream.
int64_t dim_of(const Tensor& t, int64_t dim, const char* op, int64_t ndim = -1) {
  if (ndim < 0) ndim = t.dim();
  if (dim < -ndim || dim >= ndim)
    fail(op, ": dim ", dim, " is out of range for ", t.description(), " (expected ", -ndim, "..", ndim - 1, ")");
  return dim < 0 ? dim + ndim : dim;
}

}  // namespace

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  check_shape(shape, "empty");
  auto impl = std::make_shared<TensorImpl>();
  int64_t nbytes = 0;
  if (dtype_bits(dtype) >= 8 &&
      __builtin_mul_overflow(shape_numel(shape), static_cast<int64_t>(dtype_size(dtype)), &nbytes)) [[unlikely]]
    fail("empty: ", shape_str(shape), " of ", dtype_name(dtype), " needs more bytes than fit in 64 bits");
  nbytes = storage_bytes(dtype, shape_numel(shape));
  impl->storage = std::make_shared<Storage>(nbytes, device, backend_for(device).allocator());
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

Tensor Tensor::full(const Shape& shape, double value, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  backend_for(device).fill(t, value);
  return t;
}
Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) { return full(shape, 0, dtype, device); }
Tensor Tensor::ones(const Shape& shape, DType dtype, Device device) { return full(shape, 1, dtype, device); }
Tensor Tensor::scalar(double value, DType dtype, Device device) { return full({}, value, dtype, device); }

Tensor Tensor::arange(double start, double end, double step, DType dtype, Device device) {
  check(step != 0 && std::isfinite(step) && std::isfinite(start) && std::isfinite(end),
        "arange: start/end/step must be finite and step nonzero (got ", start, ", ", end, ", ", step, ")");
  const double count = std::ceil((end - start) / step);
  // 2^62: below int64's limit, and far more than memory holds.
  check(!(count > 0x1p62), "arange: [", start, ", ", end, ") in steps of ", step, " has ", count,
        " elements; expected at most 2^62");
  Tensor t = empty({count > 0 ? static_cast<int64_t>(count) : 0}, dtype, device);
  backend_for(device).arange(t, start, step);
  return t;
}

namespace {

template <class V>
Tensor tensor_from_host(const std::vector<V>& values, const Shape& shape, DType dtype, const char* op) {
  check_shape(shape, op);
  check(static_cast<int64_t>(values.size()) == shape_numel(shape), op, ": ", values.size(),
        " values do not fill shape ", shape_text(shape), " (", shape_numel(shape), " elements)");
  Tensor t = Tensor::empty(shape, dtype);
  dispatch_all(dtype, op, [&]<typename T>() {
    T* out = t.data<T>();
    for (size_t i = 0; i < values.size(); ++i) out[i] = convert<T>(values[i]);
  });
  return t;
}

}  // namespace

Tensor Tensor::from_vector(const std::vector<float>& v, const Shape& s, DType d) {
  return tensor_from_host(v, s, d, "from_vector");
}
Tensor Tensor::from_vector(const std::vector<double>& v, const Shape& s, DType d) {
  return tensor_from_host(v, s, d, "from_vector");
}
Tensor Tensor::from_vector(const std::vector<int64_t>& v, const Shape& s, DType d) {
  return tensor_from_host(v, s, d, "from_vector");
}
Tensor Tensor::from_vector(const std::vector<int32_t>& v, const Shape& s, DType d) {
  return tensor_from_host(v, s, d, "from_vector");
}

Tensor Tensor::rand(const Shape& shape, uint64_t seed, DType dtype, Device device) {
  check(is_floating(dtype), "rand: dtype must be floating, got ", dtype_name(dtype));
  Tensor t = empty(shape, dtype, device);
  backend_for(device).uniform(t, seed, 0, 0.0, 1.0);
  return t;
}

Tensor Tensor::randn(const Shape& shape, uint64_t seed, DType dtype, Device device) {
  check(is_floating(dtype), "randn: dtype must be floating, got ", dtype_name(dtype));
  Tensor t = empty(shape, dtype, device);
  backend_for(device).normal(t, seed, 0, 0.0, 1.0);
  return t;
}

Tensor Tensor::randint(int64_t low, int64_t high, const Shape& shape, uint64_t seed, DType dtype, Device device) {
  check(low < high, "randint: low (", low, ") must be below high (", high, ")");
  check(!is_floating(dtype), "randint: dtype must be i32 or i64, got ", dtype_name(dtype));
  check(dtype != DType::I32 || (low >= std::numeric_limits<int32_t>::min() &&
                                high - 1 <= std::numeric_limits<int32_t>::max()),
        "randint: values in [", low, ", ", high, ") do not fit dtype i32; use i64");
  Tensor t = empty(shape, dtype, device);
  backend_for(device).randint(t, seed, 0, low, high);
  return t;
}

// ---- metadata ----------------------------------------------------------------------------------------

TensorImpl& Tensor::impl() const {
  check(impl_ != nullptr, "use of an undefined tensor");
  return *impl_;
}

int64_t Tensor::size(int64_t d) const { return impl().shape[dim_of(*this, d, "size")]; }
int64_t Tensor::stride(int64_t d) const { return impl().strides[dim_of(*this, d, "stride")]; }

bool Tensor::is_contiguous() const {
  if (numel() == 0) return true;  // no element to lay out: any strides will do
  int64_t expected = 1;
  for (int64_t i = dim() - 1; i >= 0; --i) {
    const int64_t s = impl().shape[i];
    if (s == 1) continue;
    if (impl().strides[i] != expected) return false;
    expected *= s;
  }
  return true;
}

void* Tensor::data_ptr() const {
  // A packed f4e2m1 tensor is always its whole storage from offset 0 (make_view refuses other views of it).
  if (impl().offset == 0) return impl().storage->data();
  return static_cast<char*>(impl().storage->data()) + impl().offset * static_cast<int64_t>(dtype_size(dtype()));
}

void Tensor::check_dtype(DType expected, const char* what) const {
  if (dtype() != expected)
    fail(what, ": tensor ", description(), " has dtype ", dtype_name(dtype()), ", expected ", dtype_name(expected));
}

std::string Tensor::description() const {
  if (!defined()) return "undefined";
  std::string out = dtype_name(dtype()) + shape_str(shape());  // no stream, as in shape_str
  if (!device().is_cpu()) out += ' ' + device().str();
  return out;
}

bool is_private_buffer(const Tensor& t, long holders) {
  return t.defined() && t.storage() && t.impl_ptr().use_count() == holders && t.storage().use_count() == 1 &&
         t.is_contiguous() && t.data_ptr() == t.storage()->data() &&
         t.storage()->nbytes() == static_cast<size_t>(storage_bytes(t.dtype(), t.numel()));
}

Tensor make_view(const Tensor& base, const Shape& shape, const Strides& strides, int64_t offset) {
  if (shape.size() != strides.size())
    fail("make_view: shape ", shape_str(shape), " and strides ", shape_str(strides), " differ in length");
  if (dtype_bits(base.dtype()) < 8 && (offset != 0 || strides != contiguous_strides(shape) ||
                                        shape_numel(shape) != base.numel()))
    fail("make_view: not supported: a view ", shape_str(shape), " strides ", shape_str(strides), " offset ", offset,
         " of ", base.described(), ": ", dtype_name(base.dtype()),
         " packs two elements per byte, so only reshapes of the whole tensor are views (convert it with to())");
  const int64_t capacity = static_cast<int64_t>(base.storage()->nbytes()) * 8 / dtype_bits(base.dtype());
  int64_t lowest = offset, highest = offset;
  bool empty = false;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) fail("make_view: negative size in ", shape_str(shape));
    if (shape[i] == 0) empty = true;
    const int64_t reach = (shape[i] - 1) * strides[i];
    (reach < 0 ? lowest : highest) += reach;
  }
  if (!empty && (lowest < 0 || highest >= capacity))
    fail("make_view: view ", shape_str(shape), " strides ", shape_str(strides), " offset ", offset,
         " reaches outside a storage of ", capacity, " elements");
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = base.storage();
  impl->shape = shape;
  impl->strides = strides;
  impl->offset = offset;
  impl->dtype = base.dtype();
  return Tensor(std::move(impl));
}

// ---- views --------------------------------------------------------------------------------------------

namespace {

// Resolves a single -1 in a requested shape against numel.
Shape infer_shape(const Shape& requested, int64_t numel, const char* op, const Tensor& t) {
  Shape shape = requested;
  int64_t known = 1, unknown = -1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      check(unknown < 0, op, ": only one dim may be -1 in ", shape_text(requested), " (for ", t.described(), ")");
      unknown = static_cast<int64_t>(i);
    } else {
      check(shape[i] >= 0, op, ": invalid size ", shape[i], " in ", shape_text(requested), " (for ", t.described(),
            ")");
      known *= shape[i];
    }
  }
  if (unknown >= 0) {
    check(known != 0 && numel % known == 0, op, ": cannot view ", t.described(), " as ", shape_text(requested));
    shape[unknown] = numel / known;
  }
  check(shape_numel(shape) == numel, op, ": shape ", shape_text(requested), " has ", shape_numel(shape),
        " elements but ", t.described(), " has ", numel);
  return shape;
}

// Strides for viewing a tensor with (shape, strides) as new_shape without copying, if possible
// (the algorithm of numpy's _attempt_nocopy_reshape: match groups of dims with equal element counts).
bool view_strides(const Shape& shape, const Strides& strides, const Shape& new_shape, Strides& out) {
  out.assign(new_shape.size(), 0);
  if (shape_numel(shape) == 0) {
    out = contiguous_strides(new_shape);
    return true;
  }
  Shape old_shape;
  Strides old_strides;
  for (size_t i = 0; i < shape.size(); ++i)
    if (shape[i] != 1) {
      old_shape.push_back(shape[i]);
      old_strides.push_back(strides[i]);
    }
  size_t oi = 0, oj = 1, ni = 0, nj = 1;
  const size_t old_n = old_shape.size(), new_n = new_shape.size();
  // Dims of size 1 in the new shape get any stride; handle groups of non-1 dims.
  while (ni < new_n && oi < old_n) {
    if (new_shape[ni] == 1) { out[ni] = 1; ++ni; nj = ni + 1; continue; }
    int64_t np = new_shape[ni], op = old_shape[oi];
    nj = ni + 1;
    oj = oi + 1;
    while (np != op) {
      if (np < op) np *= new_shape[nj++];
      else op *= old_shape[oj++];
    }
    for (size_t k = oi; k + 1 < oj; ++k)
      if (old_strides[k] != old_strides[k + 1] * old_shape[k + 1]) return false;  // group not contiguous
    out[nj - 1] = old_strides[oj - 1];
    for (size_t k = nj - 1; k > ni; --k) out[k - 1] = out[k] * new_shape[k];
    ni = nj;
    oi = oj;
  }
  for (; ni < new_n; ++ni) {
    if (new_shape[ni] != 1) return false;
    out[ni] = 1;
  }
  return oi == old_n;
}

}  // namespace

Tensor Tensor::view(const Shape& requested) const {
  const Shape shape = infer_shape(requested, numel(), "view", *this);
  Strides strides;
  check(view_strides(impl().shape, impl().strides, shape, strides), "view: cannot view ", described(),
        " (strides ", shape_text(this->strides()), ") as ", shape_text(shape),
        " without a copy; use reshape() or contiguous()");
  Tensor out = make_view(*this, shape, strides, offset());
  const Shape input_shape = this->shape();
  record_backward("view", {*this}, out, [input_shape](const Tensor& g) { return Grads{g.reshape(input_shape)}; });
  return out;
}

Tensor Tensor::reshape(const Shape& requested) const {
  const Shape shape = infer_shape(requested, numel(), "reshape", *this);
  Strides strides;
  if (view_strides(impl().shape, impl().strides, shape, strides)) return view(shape);
  return contiguous().view(shape);
}

Tensor Tensor::transpose(int64_t dim0, int64_t dim1) const {
  const int64_t a = dim_of(*this, dim0, "transpose"), b = dim_of(*this, dim1, "transpose");
  Shape shape = this->shape();
  Strides strides = this->strides();
  std::swap(shape[a], shape[b]);
  std::swap(strides[a], strides[b]);
  Tensor out = make_view(*this, shape, strides, offset());
  record_backward("transpose", {*this}, out, [a, b](const Tensor& g) { return Grads{g.transpose(a, b)}; });
  return out;
}

Tensor Tensor::permute(const std::vector<int64_t>& dims) const {
  check(static_cast<int64_t>(dims.size()) == dim(), "permute: ", dims.size(), " dims given for ", described());
  std::vector<int64_t> order(dims.size()), inverse(dims.size());
  std::vector<bool> seen(dims.size(), false);
  Shape shape(dims.size());
  Strides strides(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) {
    const int64_t d = dim_of(*this, dims[i], "permute");
    check(!seen[d], "permute: dim ", d, " repeated in ", shape_text(dims), " (for ", described(), ")");
    seen[d] = true;
    order[i] = d;
    inverse[d] = static_cast<int64_t>(i);
    shape[i] = this->shape()[d];
    strides[i] = this->strides()[d];
  }
  Tensor out = make_view(*this, shape, strides, offset());
  record_backward("permute", {*this}, out, [inverse](const Tensor& g) { return Grads{g.permute(inverse)}; });
  return out;
}

Tensor Tensor::slice(int64_t d, int64_t start, int64_t end, int64_t step) const {
  d = dim_of(*this, d, "slice");
  check(step > 0, "slice: step must be positive, got ", step, " (dim ", d, " of ", described(), ")");
  const int64_t n = shape()[d];
  auto clamp = [n](int64_t i) { return std::clamp(i < 0 ? i + n : i, int64_t{0}, n); };
  start = clamp(start);
  end = std::max(clamp(end), start);
  Shape shape = this->shape();
  Strides strides = this->strides();
  shape[d] = (end - start + step - 1) / step;
  strides[d] *= step;
  Tensor out = make_view(*this, shape, strides, offset() + start * this->strides()[d]);
  const Shape input_shape = this->shape();
  const DType input_dtype = dtype();
  record_backward("slice", {*this}, out, [=](const Tensor& g) {
    Tensor grad = Tensor::zeros(input_shape, input_dtype, g.device());
    grad.slice(d, start, end, step).copy_(g);
    return Grads{grad};
  });
  return out;
}

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  d = dim_of(*this, d, "narrow");
  const int64_t n = shape()[d];
  if (start < 0) start += n;
  check(start >= 0 && length >= 0 && start + length <= n, "narrow: [", start, ", ", start + length,
        ") is out of range for dim ", d, " of ", description());
  return slice(d, start, start + length);
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  d = dim_of(*this, d, "select");
  const int64_t n = shape()[d];
  check(index >= -n && index < n, "select: index ", index, " is out of range for dim ", d, " of ", described());
  if (index < 0) index += n;
  return slice(d, index, index + 1).squeeze(d);
}

Tensor Tensor::expand(const Shape& requested) const {
  if (requested.size() < shape().size())
    fail("expand: cannot expand ", description(), " to fewer dims ", shape_str(requested));
  const size_t lead = requested.size() - shape().size();
  Shape shape(requested.size());
  Strides strides(requested.size());
  for (size_t i = 0; i < requested.size(); ++i) {
    if (i < lead) {
      if (requested[i] < 0)
        fail("expand: new leading dim ", i, " must be >= 0 in ", shape_str(requested), " (for ", description(), ")");
      shape[i] = requested[i];
      strides[i] = 0;
      continue;
    }
    const int64_t have = this->shape()[i - lead];
    const int64_t want = requested[i] == -1 ? have : requested[i];
    if (want < 0 || (want != have && have != 1))
      fail("expand: cannot expand ", description(), " to ", shape_str(requested), " (dim ", i, ": ", have, " -> ",
           want, ")");
    shape[i] = want;
    strides[i] = want == have ? this->strides()[i - lead] : 0;
  }
  Tensor out = make_view(*this, shape, strides, offset());
  const Shape input_shape = this->shape();
  record_backward("expand", {*this}, out, [input_shape](const Tensor& g) { return Grads{sum_to(g, input_shape)}; });
  return out;
}

Tensor Tensor::unsqueeze(int64_t d) const {
  d = dim_of(*this, d, "unsqueeze", dim() + 1);
  Shape shape = this->shape();
  Strides strides = this->strides();
  const int64_t stride = d < dim() ? strides[d] * shape[d] : 1;
  shape.insert(shape.begin() + d, 1);
  strides.insert(strides.begin() + d, stride);
  Tensor out = make_view(*this, shape, strides, offset());
  record_backward("unsqueeze", {*this}, out, [d](const Tensor& g) { return Grads{g.squeeze(d)}; });
  return out;
}

Tensor Tensor::squeeze(int64_t d) const {
  d = dim_of(*this, d, "squeeze");
  if (shape()[d] != 1) return *this;
  Shape shape = this->shape();
  Strides strides = this->strides();
  shape.erase(shape.begin() + d);
  strides.erase(strides.begin() + d);
  Tensor out = make_view(*this, shape, strides, offset());
  record_backward("squeeze", {*this}, out, [d](const Tensor& g) { return Grads{g.unsqueeze(d)}; });
  return out;
}

Tensor Tensor::squeeze() const {
  Shape shape;
  for (int64_t s : this->shape())
    if (s != 1) shape.push_back(s);
  return shape.size() == this->shape().size() ? *this : reshape(shape);
}

// ---- copies --------------------------------------------------------------------------------------------

Tensor Tensor::contiguous() const { return is_contiguous() ? *this : clone(); }

Tensor Tensor::clone() const {
  Tensor out = empty(shape(), dtype(), device());
  backend_of(*this).copy(*this, out);
  record_backward("clone", {*this}, out, [](const Tensor& g) { return Grads{g}; });
  return out;
}

Tensor Tensor::to(DType target) const {
  if (target == dtype()) return *this;
  // fp8 / fp4: a rounding cast that nothing differentiates through (tensor/quantize.h).
  if (is_minifloat(target) || is_minifloat(dtype())) return convert_minifloat(*this, target);
  Tensor out = empty(shape(), target, device());
  backend_of(*this).copy(*this, out);
  if (is_floating(target) && is_floating(dtype())) {
    const DType source = dtype();
    record_backward("to", {*this}, out, [source](const Tensor& g) { return Grads{g.to(source)}; });
  }
  return out;
}

Tensor Tensor::to(Device target) const {
  if (target == device()) return *this;
  // The bytes travel contiguous and in this dtype (a strided or converting copy runs on one device).
  const Tensor dense = contiguous();
  Tensor out = empty(shape(), dtype(), target);
  copy_between_devices(dense, out);
  if (is_floating(dtype())) {
    const Device source = device();
    record_backward("to", {dense}, out, [source](const Tensor& g) { return Grads{g.to(source)}; });
  }
  return out;
}

Tensor Tensor::detach() const {
  return make_view(*this, shape(), strides(), offset());
}

// ---- in place ------------------------------------------------------------------------------------------

namespace {

// In-place ops record nothing on the tape, so with grad mode on they may only write tensors outside the
// graph: changing a leaf would corrupt the values its gradient is taken at, and changing a non-leaf would
// leave its recorded op in place, so the gradient would silently ignore the change.
// A write through a view whose elements alias each other (a broadcast dim: stride 0, size > 1) would
// apply the update once per alias.
void check_no_overlap(const Tensor& t, const char* op) {
  for (int64_t d = 0; d < t.dim(); ++d)
    check(!(t.strides()[d] == 0 && t.shape()[d] > 1), op, ": in-place write to ", t.described(),
          " whose dim ", d, " is a broadcast (stride 0), so its elements overlap; write to a contiguous() copy");
}

void check_inplace(const Tensor& t, const char* op) {
  if (!grad_enabled() || !t.requires_grad()) return;
  check(!t.is_leaf(), op, ": in-place change of a leaf that requires grad (", t.described(),
        "); wrap it in NoGradGuard (optimizer steps) or use an out-of-place op");
  fail(op, ": in-place change of ", t.description(), ", which requires grad (made by '", t.grad_fn()->op,
       "'); in-place ops are not recorded on the tape, so its gradient would be wrong: use an out-of-place op, "
       "or NoGradGuard if no gradient should flow through the change");
}

// With grad mode on, the source of an in-place op must not need a gradient: none would reach it.
void check_source_untracked(const Tensor& src, const char* op) {
  if (!grad_enabled() || !src.requires_grad()) return;
  fail(op, ": the source ", src.description(), " requires grad, but in-place ops are not recorded on the ",
       "tape, so no gradient would reach it; pass src.detach() (or use NoGradGuard) if none should, or use an ",
       "out-of-place op if one should");
}

// The source of an in-place op, safe to read while `dst` is written: an elementwise kernel reading a source
// that shares memory with the destination would read elements it has already written (x[1:] += x[:-1]), so
// such a source is copied first. A source that is the destination itself, element for element, reads each
// element just before writing it and needs no copy.
Tensor readable_source(const Tensor& dst, const Tensor& src) {
  const Tensor s = src.detach().expand(dst.shape());
  if (s.storage() != dst.storage() || s.numel() == 0) return s;
  if (s.offset() == dst.offset() && s.strides() == dst.strides()) return s;
  // The element range [first, last] each view can touch, in elements of their (shared) storage.
  auto range = [](const Tensor& t) {
    int64_t first = t.offset(), last = t.offset();
    for (int64_t d = 0; d < t.dim(); ++d) {
      const int64_t reach = t.strides()[d] * (t.shape()[d] - 1);
      (reach < 0 ? first : last) += reach;
    }
    return std::pair<int64_t, int64_t>(first, last);
  };
  const auto [s_first, s_last] = range(s);
  const auto [d_first, d_last] = range(dst);
  if (s_last < d_first || d_last < s_first) return s;
  return s.clone();
}

}  // namespace

Tensor& Tensor::fill_(double value) {
  check_inplace(*this, "fill_");
  backend_of(*this).fill(*this, value);
  bump_version();
  return *this;
}

Tensor& Tensor::copy_(const Tensor& src) {
  check_inplace(*this, "copy_");
  check_no_overlap(*this, "copy_");
  check(src.defined(), "copy_: source is undefined (destination ", described(), ")");
  check_source_untracked(src, "copy_");
  const Shape shape = broadcast_shapes(src.shape(), this->shape(), "copy_");
  check(shape == this->shape(), "copy_: source ", src.described(), " does not broadcast to destination ",
        described());
  // From another device: the bytes move first (as they are), then convert and spread on this device.
  const Tensor here = src.device() == device() ? src : src.detach().to(device());
  backend_of(*this).copy(readable_source(*this, here), *this);
  bump_version();
  return *this;
}

Tensor& Tensor::add_(const Tensor& other, double alpha) {
  check_inplace(*this, "add_");
  check_no_overlap(*this, "add_");
  check(other.device() == device(), "add_: other on ", other.device(), ", this on ", device());
  check_source_untracked(other, "add_");
  const Shape shape = broadcast_shapes(other.shape(), this->shape(), "add_");
  check(shape == this->shape(), "add_: ", other.described(), " does not broadcast to ", described());
  backend_of(*this).add_inplace(*this, readable_source(*this, other), alpha);
  bump_version();
  return *this;
}

Tensor& Tensor::mul_(double value) {
  check_inplace(*this, "mul_");
  check_no_overlap(*this, "mul_");
  backend_of(*this).mul_scalar_inplace(*this, value);
  bump_version();
  return *this;
}

// ---- host access ---------------------------------------------------------------------------------------

double Tensor::item() const {
  check(numel() == 1, "item: tensor ", described(), " has ", numel(), " elements, expected exactly 1");
  return to_vector<double>()[0];
}

template <class V>
std::vector<V> Tensor::to_vector() const {
  // A device tensor is copied to the host first (which waits for the kernels that write it).
  const Tensor dense = device().is_cpu() ? contiguous() : detach().to(Device::cpu());
  std::vector<V> values(static_cast<size_t>(numel()));
  dispatch_all(dtype(), "to_vector", [&]<typename T>() {
    const T* in = dense.data<T>();
    for (size_t i = 0; i < values.size(); ++i) values[i] = convert<V>(in[i]);
  });
  return values;
}
template std::vector<float> Tensor::to_vector<float>() const;
template std::vector<double> Tensor::to_vector<double>() const;
template std::vector<int64_t> Tensor::to_vector<int64_t>() const;

std::string Tensor::str() const {
  if (!defined()) return "tensor(undefined)";
  std::ostringstream out;
  const bool floating = is_floating(dtype());
  // Integers are read as int64 (a double would print 2^53 + 1 and INT64_MAX wrongly).
  const std::vector<double> values = floating ? to_vector<double>() : std::vector<double>{};
  const std::vector<int64_t> integers = floating ? std::vector<int64_t>{} : to_vector<int64_t>();
  const Shape& s = shape();
  constexpr size_t kEdge = 3;  // elements shown at each end of a long dim
  out << "tensor(";
  // Recursive printer over dims, eliding the middle of dims longer than 2*kEdge.
  std::vector<int64_t> row_stride(s.size(), 1);
  for (size_t i = s.size(); i-- > 1;) row_stride[i - 1] = row_stride[i] * s[i];
  auto print_value = [&](int64_t i) {
    if (!floating) { out << integers[i]; return; }
    const double v = values[i];
    if (std::isnan(v)) out << "nan";
    else if (std::isinf(v)) out << (v > 0 ? "inf" : "-inf");
    else out << std::setprecision(6) << v;
  };
  auto print = [&](auto&& self, size_t d, int64_t base) -> void {
    if (d == s.size()) { print_value(base); return; }
    out << '[';
    // Between elements of the last dim ", "; between rows of an outer dim a newline aligned under the '['.
    const std::string separator = d + 1 == s.size() ? ", " : ",\n" + std::string(d + 8, ' ');
    for (int64_t i = 0; i < s[d]; ++i) {
      if (s[d] > int64_t{2 * kEdge} && i == int64_t{kEdge}) {
        out << "..." << separator;
        i = s[d] - kEdge - 1;
        continue;
      }
      self(self, d + 1, base + i * row_stride[d]);
      if (i + 1 < s[d]) out << separator;
    }
    out << ']';
  };
  print(print, 0, 0);
  out << ", dtype=" << dtype_name(dtype());
  if (!device().is_cpu()) out << ", device=" << device();
  if (requires_grad()) out << ", requires_grad";
  out << ')';
  return out.str();
}

std::ostream& operator<<(std::ostream& out, const Tensor& tensor) { return out << tensor.str(); }
std::ostream& operator<<(std::ostream& out, const TensorText& text) { return out << text.tensor->description(); }

// ---- autograd ------------------------------------------------------------------------------------------

Tensor& Tensor::requires_grad_(bool enabled) {
  check(!enabled || is_floating(dtype()), "requires_grad_: only floating tensors can require grad, got ",
        described());
  check(is_leaf() || enabled, "requires_grad_: cannot turn off requires_grad on a non-leaf (use detach())");
  impl().requires_grad = enabled;
  return *this;
}

void Tensor::set_grad(const Tensor& grad) {
  if (grad.defined())
    check(grad.shape() == shape(), "set_grad: gradient ", grad.described(), " does not match ", described());
  impl().grad = grad.impl_ptr();
}

Tensor& Tensor::set_grad_dtype(DType dtype) {
  check(is_floating(dtype), "set_grad_dtype: ", described(), ": the gradient dtype must be floating, got ",
        dtype_name(dtype));
  check(is_leaf(), "set_grad_dtype: ", described(), " is not a leaf; only leaves accumulate gradients");
  check(!impl().grad, "set_grad_dtype: ", described(), " already has a gradient (",
        Tensor(impl().grad).described(), "); set the dtype before backward or after zero_grad");
  impl().grad_dtype = dtype == impl().dtype ? std::nullopt : std::optional<DType>(dtype);
  return *this;
}

}  // namespace mixtape
