// Proves the CUDA build path: compiled into libmixtape whenever MIXTAPE_CUDA is on. The CUDA backend
// proper (issue 5) replaces Device::cuda() below with real device selection.
#include <cuda_runtime.h>

#include "tensor/device.h"
#include "tensor/error.h"

namespace mixtape {

namespace {
__global__ void probe_kernel(int* out) { *out = 1; }
}  // namespace

Device Device::cuda(int index) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  check(status == cudaSuccess, "Device::cuda(", index, "): no usable GPU (cudaGetDeviceCount: ",
        cudaGetErrorString(status), ")");
  check(index >= 0 && index < count, "Device::cuda(", index, "): this machine has ", count, " GPU(s)");
  (void)&probe_kernel;
  not_supported("Device::cuda(", index, "): the CUDA backend's kernels arrive with the CUDA issue; "
                "this build only proves that .cu files compile and link");
}

}  // namespace mixtape
