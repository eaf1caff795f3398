#include "tensor/device.h"

#include <ostream>

#include "tensor/error.h"

namespace mixtape {

#ifndef MIXTAPE_WITH_CUDA
Device Device::cuda(int index) {
  not_supported("Device::cuda(", index, "): this build of mixtape has no CUDA backend "
                "(configure with -DMIXTAPE_CUDA=ON on a machine with the CUDA toolkit)");
}
#endif

Device Device::parse(const std::string& text) {
  if (text == "cpu") return cpu();
  if (text == "cuda") return cuda(0);
  if (text.rfind("cuda:", 0) == 0) {
    const std::string number = text.substr(5);
    const bool digits = !number.empty() && number.size() <= 6 &&
                        number.find_first_not_of("0123456789") == std::string::npos;
    check(digits, "Device::parse: '", text, "' is not a device (expected cpu, cuda or cuda:N)");
    return cuda(std::stoi(number));
  }
  fail("Device::parse: '", text, "' is not a device (expected cpu, cuda or cuda:N)");
}

std::string Device::str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }
std::ostream& operator<<(std::ostream& out, const Device& device) { return out << device.str(); }

}  // namespace mixtape
