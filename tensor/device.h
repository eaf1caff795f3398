#pragma once
// Where a tensor's bytes live.
#include <iosfwd>
#include <string>

namespace mixtape {

struct Device {
  enum class Type : unsigned char { CPU, CUDA };
  Type type = Type::CPU;
  int index = 0;

  static Device cpu() { return {}; }
  static Device cuda(int index = 0);  // throws "not supported" when built without CUDA
  // "cpu", "cuda" (= cuda:0) or "cuda:N"; Error naming the text otherwise (and Device::cuda's errors).
  static Device parse(const std::string& text);
  bool is_cpu() const { return type == Type::CPU; }
  bool is_cuda() const { return type == Type::CUDA; }
  bool operator==(const Device&) const = default;
  std::string str() const;  // "cpu", "cuda:0"
};

std::ostream& operator<<(std::ostream& out, const Device& device);

}  // namespace mixtape
