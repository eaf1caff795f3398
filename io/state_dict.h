#pragma once
// Named tensors plus string metadata: what a safetensors file holds, and what modules, optimizers and
// loss scalers save and load. Names use nanoGPT's dotted state-dict paths ("transformer.h.0.ln_1.weight").
#include <charconv>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>

#include "tensor/tensor.h"

namespace mixtape {

// The shortest decimal text that reads back as the same double (std::to_chars): metadata scalars reload bit
// for bit, and a value in an error message is shown exactly (1 - 1e-9 reads "0.999999999", not "1").
inline std::string exact_number_text(double value) {
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof buffer, value);
  return std::string(buffer, result.ptr);
}

// The reader of such text, and of numbers given on a command line: all of `text` as a T, by std::from_chars
// (decimal as written: no leading space, '+' or hexadecimal), or std::nullopt when anything is left over or
// the value is outside T's range (then *out_of_range is set, where given: 1e999, or 1e-400, which would round
// to 0).
template <class T>
std::optional<T> number_from_text(std::string_view text, bool* out_of_range = nullptr) {
  T value{};
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (out_of_range) *out_of_range = ec == std::errc::result_out_of_range;
  if (text.empty() || ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

// The first element of `t` that is not finite, or with non_negative not >= 0 either, as "element 5 is nan";
// empty when every element is fine (always for integer tensors). For checking what a file brings: it reads
// the tensor (any device) in chunks, so a large one costs little extra memory.
std::string first_bad_value(const Tensor& t, bool non_negative = false);

struct StateDict {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> metadata;  // scalars are stored as their decimal text
};

}  // namespace mixtape
