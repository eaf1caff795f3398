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

std::string Device::str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }
std::ostream& operator<<(std::ostream& out, const Device& device) { return out << device.str(); }

}  // namespace mixtape
