#pragma once
// mixtape::Error and the helpers every layer uses to reject bad input with a message that names the op,
// the shapes/dtypes involved and what was expected.
#include <cstddef>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace mixtape {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A value from outside (a file, a command line, an environment variable) as it may appear inside an error
// message: printable and bounded, so that a hostile value can neither break the message (a newline, a NUL,
// a terminal escape, a lone UTF-8 byte) nor make it megabytes long. Well-formed UTF-8 is kept as it is, a
// backslash is doubled, and every other byte below 0x20, 0x7f, every byte that starts no well-formed UTF-8
// sequence and the bytes of the characters a terminal does not show as themselves (the C1 controls
// U+0080-U+009F, U+2028-U+2029, the bidirectional controls U+202A-U+202E and U+2066-U+2069) are written as
// escapes (\n, \t, \r, \0, \xNN). Past `limit` characters of that text it is cut at
// a character boundary and "... (N bytes in all)" is appended, N counting the bytes of `text` itself.
inline constexpr size_t kEchoLimit = 100;
std::string echo(std::string_view text, size_t limit = kEchoLimit);

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
