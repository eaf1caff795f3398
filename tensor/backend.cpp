// The per-device backend registry: the CPU backend always, CUDA backends when built with them.
#include "tensor/backend.h"

#include <atomic>

#include "tensor/cpu/cpu_backend.h"

namespace mixtape {

#ifdef MIXTAPE_WITH_CUDA
namespace cuda {
class CudaBackend;
CudaBackend& backend(int index);  // tensor/cuda/cuda_backend.cu
Backend& as_backend(CudaBackend& backend);
}  // namespace cuda
#endif

Backend& backend_for(Device device) {
  if (device.is_cpu()) return cpu::cpu_backend();
#ifdef MIXTAPE_WITH_CUDA
  return cuda::as_backend(cuda::backend(device.index));
#else
  not_supported("backend for ", device, ": this build of mixtape has no CUDA backend");
#endif
}

namespace {
std::atomic<CudaAttentionKernel> attention_kernel{CudaAttentionKernel::TensorCores};
}  // namespace
CudaAttentionKernel set_cuda_attention_kernel(CudaAttentionKernel kernel) { return attention_kernel.exchange(kernel); }
CudaAttentionKernel cuda_attention_kernel() { return attention_kernel.load(); }

#ifndef MIXTAPE_WITH_CUDA
int cuda_device_count() { return 0; }
void set_cuda_allocation_poisoning(bool) {}
std::string cuda_device_name(int index) {
  not_supported("cuda_device_name(", index, "): this build of mixtape has no CUDA backend");
}

void copy_between_devices(const Tensor& src, const Tensor& dst) {
  not_supported("copy from ", src.device(), " to ", dst.device(), ": this build of mixtape has no CUDA backend");
}
#endif

}  // namespace mixtape
