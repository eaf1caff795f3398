#pragma once
// mixtape::Error and the helpers every layer uses to reject bad input with a message that names the op,
// the shapes/dtypes involved and what was expected.
#include <sstream>
#include <stdexcept>
#include <string>

namespace mixtape {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Concatenates its arguments with operator<< and throws Error.
template <class... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  throw Error(message.str());
}

// Throws Error(parts...) unless ok. The parts are only formatted on failure, but they are built on every
// call: pass t.described() and shape_text(s) (tensor/tensor.h, tensor/shape.h), not t.description() and
// shape_str(s), so that a check that passes builds no string.
template <class... Parts>
inline void check(bool ok, const Parts&... parts) {
  if (!ok) [[unlikely]] fail(parts...);
}

// For features that are declared but not built: "not supported: <what>".
template <class... Parts>
[[noreturn]] void not_supported(const Parts&... parts) {
  fail("not supported: ", parts...);
}

}  // namespace mixtape
