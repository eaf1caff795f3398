#pragma once
// Shapes, strides and the index arithmetic shared by views, broadcasting and kernels.
#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

namespace mixtape {

using Shape = std::vector<int64_t>;
using Strides = std::vector<int64_t>;

std::string shape_str(const Shape& shape);  // "[2,3,4]"
// shape_str(shape), formatted only when printed: check()'s arguments are built on every call, and the text
// only on failure (eager shape strings: ~5% of a small model's bf16 step in a perf profile, Zen 5,
// 2026-11-27).
struct ShapeText {
  const Shape& shape;
};
inline ShapeText shape_text(const Shape& shape) { return {shape}; }
std::ostream& operator<<(std::ostream& out, const ShapeText& text);
int64_t shape_numel(const Shape& shape);
Strides contiguous_strides(const Shape& shape);  // row-major
// Turns a possibly negative dim into 0..ndim-1; `op` names the caller in the error.
int64_t normalize_dim(int64_t dim, int64_t ndim, const char* op);
// NumPy broadcasting of two shapes; throws naming `op` and both shapes when they do not broadcast.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);

}  // namespace mixtape
