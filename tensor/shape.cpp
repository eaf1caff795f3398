#include "tensor/shape.h"

#include <charconv>
#include <cstdint>
#include <ostream>

#include "tensor/error.h"

namespace mixtape {

// With to_chars, not a stream: check() formats its message's parts before it knows whether it fails, so
// shapes are formatted on hot paths (every view, reshape and backward node), and a stream's construction and
// locale lookups cost several times the formatting itself.
std::string shape_str(const Shape& shape) {
  std::string out = "[";
  char digits[24];
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) out += ',';
    out.append(digits, std::to_chars(digits, digits + sizeof digits, shape[i]).ptr);
  }
  out += ']';
  return out;
}

std::ostream& operator<<(std::ostream& out, const ShapeText& text) { return out << shape_str(text.shape); }

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  bool overflow = false;
  for (int64_t s : shape) overflow |= __builtin_mul_overflow(n, s, &n);
  if (overflow) [[unlikely]] {
    for (int64_t s : shape)
      if (s == 0) return 0;  // an empty shape whose other sizes overflowed on the way
    fail("shape ", shape_str(shape), " has more elements than fit in a signed 64-bit count");
  }
  return n;
}

Strides contiguous_strides(const Shape& shape) {
  Strides strides(shape.size());
  int64_t stride = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = stride;
    // Only an empty shape (a 0 elsewhere) can overflow here, and its strides address nothing: saturate.
    if (__builtin_mul_overflow(stride, shape[i] > 1 ? shape[i] : 1, &stride)) stride = INT64_MAX;
  }
  return strides;
}

int64_t normalize_dim(int64_t dim, int64_t ndim, const char* op) {
  const int64_t fixed = dim < 0 ? dim + ndim : dim;
  check(fixed >= 0 && fixed < ndim, op, ": dim ", dim, " is out of range for a tensor of ", ndim,
        " dims (expected ", -ndim, "..", ndim - 1, ")");
  return fixed;
}

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  const size_t ndim = std::max(a.size(), b.size());
  Shape out(ndim);
  for (size_t i = 0; i < ndim; ++i) {
    const int64_t da = i < ndim - a.size() ? 1 : a[i - (ndim - a.size())];
    const int64_t db = i < ndim - b.size() ? 1 : b[i - (ndim - b.size())];
    check(da == db || da == 1 || db == 1, op, ": shapes ", shape_text(a), " and ", shape_text(b),
          " do not broadcast (dim ", i, ": ", da, " vs ", db, ")");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

}  // namespace mixtape
