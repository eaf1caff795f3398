#pragma once
// Tensor: a cheap handle (shared_ptr to TensorImpl) with shape, strides, offset, dtype and device over a
// shared Storage, plus its autograd state. Copying a Tensor copies the handle, never the data.
#include <cstdint>
#include <initializer_list>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tensor/device.h"
#include "tensor/dtype.h"
#include "tensor/shape.h"
#include "tensor/storage.h"

namespace mixtape {

struct Node;  // tensor/autograd_node.h
class Tensor;

// A tensor's description(), formatted only when printed (see ShapeText): check(ok, "op: ", t.described()).
struct TensorText {
  const Tensor* tensor;
};

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  Shape shape;
  Strides strides;  // in elements
  int64_t offset = 0;  // in elements
  DType dtype = DType::F32;
  // autograd
  bool requires_grad = false;
  std::shared_ptr<Node> grad_fn;  // the op that made this tensor (null for leaves)
  std::shared_ptr<TensorImpl> grad;  // accumulated gradient of a leaf
  // The dtype backward() accumulates a leaf's gradient in, when it is not the leaf's own (fp32 gradients of
  // 16-bit parameters: Megatron-LM's main_grad; see Tensor::set_grad_dtype).
  std::optional<DType> grad_dtype;
};

class Tensor {
 public:
  Tensor() = default;  // an undefined tensor (e.g. "no gradient")
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // ---- factories ----
  static Tensor empty(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu());
  static Tensor zeros(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu());
  static Tensor ones(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu());
  static Tensor full(const Shape& shape, double value, DType dtype = DType::F32, Device device = Device::cpu());
  static Tensor scalar(double value, DType dtype = DType::F32, Device device = Device::cpu());  // 0-d
  // [start, end) in steps of `step`, like numpy.arange.
  static Tensor arange(double start, double end, double step = 1, DType dtype = DType::F32,
                       Device device = Device::cpu());
  // From host values; the values are converted (rounded to nearest even) to dtype.
  static Tensor from_vector(const std::vector<float>& values, const Shape& shape, DType dtype = DType::F32);
  static Tensor from_vector(const std::vector<double>& values, const Shape& shape, DType dtype = DType::F64);
  static Tensor from_vector(const std::vector<int64_t>& values, const Shape& shape, DType dtype = DType::I64);
  static Tensor from_vector(const std::vector<int32_t>& values, const Shape& shape, DType dtype = DType::I32);
  // Counter-based (Philox) random draws: element i of the result depends only on (seed, i), never on the
  // thread count or the device.
  static Tensor rand(const Shape& shape, uint64_t seed, DType dtype = DType::F32, Device device = Device::cpu());
  static Tensor randn(const Shape& shape, uint64_t seed, DType dtype = DType::F32, Device device = Device::cpu());
  static Tensor randint(int64_t low, int64_t high, const Shape& shape, uint64_t seed, DType dtype = DType::I64,
                        Device device = Device::cpu());

  // ---- metadata ----
  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const { return impl().shape; }
  const Strides& strides() const { return impl().strides; }
  int64_t dim() const { return static_cast<int64_t>(impl().shape.size()); }
  int64_t size(int64_t dim) const;  // negative dims count from the end
  int64_t stride(int64_t dim) const;
  int64_t offset() const { return impl().offset; }
  int64_t numel() const { return shape_numel(impl().shape); }
  DType dtype() const { return impl().dtype; }
  Device device() const { return impl().storage->device(); }
  bool is_contiguous() const;
  const std::shared_ptr<Storage>& storage() const { return impl().storage; }
  void* data_ptr() const;  // address of element 0 (storage base + offset)
  template <class T> T* data() const {
    check_dtype(dtype_of<T>::value, "data<T>");
    return static_cast<T*>(data_ptr());
  }
  std::string description() const;  // "f32[2,3] cpu", used in error messages
  TensorText described() const { return {this}; }  // the same, formatted only when printed

  // ---- views (share storage; differentiable) ----
  Tensor view(const Shape& shape) const;  // one dim may be -1; needs compatible strides
  Tensor reshape(const Shape& shape) const;  // a view when possible, else a copy
  Tensor flatten() const { return reshape({-1}); }
  Tensor transpose(int64_t dim0, int64_t dim1) const;
  Tensor permute(const std::vector<int64_t>& dims) const;
  Tensor mT() const { return transpose(-2, -1); }  // swaps the last two dims
  Tensor slice(int64_t dim, int64_t start, int64_t end, int64_t step = 1) const;  // python-style bounds
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor select(int64_t dim, int64_t index) const;  // removes dim
  Tensor expand(const Shape& shape) const;  // -1 keeps a dim; new leading dims allowed
  Tensor unsqueeze(int64_t dim) const;
  Tensor squeeze(int64_t dim) const;  // no-op if that dim is not 1
  Tensor squeeze() const;  // all dims of size 1

  // ---- copies ----
  Tensor contiguous() const;  // itself if already contiguous
  Tensor clone() const;  // always a fresh contiguous copy (differentiable)
  Tensor to(DType dtype) const;  // rounds to nearest even; itself if already dtype (differentiable)
  Tensor to(Device device) const;
  Tensor detach() const;  // same data, no autograd history

  // ---- in place (bump the version counter) ----
  Tensor& fill_(double value);
  Tensor& zero_() { return fill_(0); }
  Tensor& copy_(const Tensor& src);  // src broadcast to this shape, converted to this dtype
  Tensor& add_(const Tensor& other, double alpha = 1);  // this += alpha * other
  Tensor& mul_(double value);

  // ---- host access ----
  double item() const;  // one-element tensors only
  template <class T> std::vector<T> to_vector() const;  // converted to T, row-major; T in {float,double,int64_t}
  std::string str() const;  // printed values, like PyTorch's repr

  // ---- autograd ----
  bool requires_grad() const { return impl().requires_grad; }
  Tensor& requires_grad_(bool enabled = true);
  bool is_leaf() const { return impl().grad_fn == nullptr; }
  Tensor grad() const { return Tensor(impl().grad); }
  void set_grad(const Tensor& grad);
  // The dtype backward() gives this leaf's gradient: its own dtype unless set_grad_dtype() chose another.
  // backward() widens (or rounds) each incoming gradient to it and adds in it, so fp32 here makes the
  // gradients of several backward calls (micro-batches) of a 16-bit parameter add up in fp32. Floating dtypes
  // only, on a leaf that has no gradient yet (Error otherwise).
  DType grad_dtype() const { return impl().grad_dtype.value_or(impl().dtype); }
  Tensor& set_grad_dtype(DType dtype);
  const std::shared_ptr<Node>& grad_fn() const { return impl().grad_fn; }
  uint64_t version() const { return impl().storage->version(); }
  void bump_version() const { impl().storage->bump_version(); }

  TensorImpl& impl() const;
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  bool same(const Tensor& other) const { return impl_ == other.impl_; }

 private:
  void check_dtype(DType expected, const char* what) const;
  std::shared_ptr<TensorImpl> impl_;
};

std::ostream& operator<<(std::ostream& out, const Tensor& tensor);
std::ostream& operator<<(std::ostream& out, const TensorText& text);

// A new tensor over `base`'s storage with the given geometry (no autograd history). Used by view ops and
// kernels; checks that the view stays inside the storage.
Tensor make_view(const Tensor& base, const Shape& shape, const Strides& strides, int64_t offset);

// Whether `t` is a private buffer its holders may keep or change as their own: contiguous over the whole of a
// storage that no other tensor shares, its tensor held by exactly `holders` handles (the caller's counted).
// A view, an alias of a saved tensor or a tensor someone else also keeps is not.
bool is_private_buffer(const Tensor& t, long holders);

}  // namespace mixtape
