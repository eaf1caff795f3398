#pragma once
// For tests that run on a GPU: they skip, with a message in the test output, on a machine without one, and
// they run with allocation poisoning on (every new CUDA block is NaN-filled), so an output element a kernel
// forgot to write fails the comparison instead of passing by luck.
#include <gtest/gtest.h>

#include "tensor/backend.h"
#include "tensor/device.h"
#include "test_util.h"

#define MIXTAPE_REQUIRE_CUDA()                                                                          \
  do {                                                                                                  \
    if (::mixtape::cuda_device_count() == 0)                                                            \
      GTEST_SKIP() << "no CUDA GPU here (or mixtape built without CUDA): this GPU test did not run";    \
    ::mixtape::set_cuda_allocation_poisoning(true);                                                     \
  } while (0)

namespace mixtape::testing {
inline Device cuda0() { return Device::cuda(0); }

// Makes `kernel` serve CUDA attention for a scope, restoring the previous choice after.
using CudaAttentionKernelScope = ScopedChoice<CudaAttentionKernel, set_cuda_attention_kernel>;

// The SIMT kernels (fp32 p and ds) serve every CUDA attention call for a scope, 16-bit ones included.
struct SimtCudaAttention : CudaAttentionKernelScope {
  SimtCudaAttention() : CudaAttentionKernelScope(CudaAttentionKernel::Simt) {}
};
}  // namespace mixtape::testing
