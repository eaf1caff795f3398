// The CUDA backend's core: device discovery, the per-device registry, streams, the caching allocator and
// copies between devices. Kernels live in the other files of tensor/cuda/.
#include "tensor/cuda/cuda_backend.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <sstream>
#include <vector>

#include "tensor/cuda/common.cuh"
#include "tensor/cuda/stream.h"
#include "tensor/device.h"

namespace mixtape {

namespace {

// cudaGetDeviceCount's answer, asked once: on a machine without a driver it fails, and that is "0 GPUs".
struct DeviceCount {
  int count = 0;
  cudaError_t status = cudaSuccess;
};
const DeviceCount& device_count_once() {
  static const DeviceCount result = [] {
    DeviceCount r;
    r.status = cudaGetDeviceCount(&r.count);
    if (r.status != cudaSuccess) {
      r.count = 0;
      (void)cudaGetLastError();  // the failure is an answer, not an error to report at the next call
    }
    return r;
  }();
  return result;
}

}  // namespace

int cuda_device_count() { return device_count_once().count; }

namespace {
std::atomic<bool> poison_allocations{false};
}  // namespace

void set_cuda_allocation_poisoning(bool enabled) { poison_allocations.store(enabled); }

std::string cuda_device_name(int index) {
  const Device device = Device::cuda(index);
  cudaDeviceProp properties{};
  MIXTAPE_CUDA_CHECK(cudaGetDeviceProperties(&properties, device.index));
  return properties.name;
}

Device Device::cuda(int index) {
  const DeviceCount& devices = device_count_once();
  check(devices.status == cudaSuccess, "Device::cuda(", index, "): no usable GPU: cudaGetDeviceCount failed with '",
        cudaGetErrorString(devices.status), "' (no NVIDIA driver, or no GPU visible to this process); "
        "the CPU device keeps working");
  check(devices.count > 0, "Device::cuda(", index, "): this machine has no CUDA GPU; the CPU device keeps working");
  check(index >= 0 && index < devices.count, "Device::cuda(", index, "): this machine has ", devices.count,
        " CUDA GPU(s), numbered 0 to ", devices.count - 1);
  Device device;
  device.type = Type::CUDA;
  device.index = index;
  return device;
}

void copy_between_devices(const Tensor& src, const Tensor& dst) {
  check(src.is_contiguous() && dst.is_contiguous() && src.dtype() == dst.dtype() && src.numel() == dst.numel(),
        "copy_between_devices: expected contiguous tensors of one dtype and size, got ", src.described(), " and ",
        dst.described());
  const size_t nbytes = static_cast<size_t>(src.numel()) * dtype_size(src.dtype());
  if (nbytes == 0) return;
  if (src.device().is_cuda() && dst.device().is_cuda()) {
    cuda::CudaBackend& from = cuda::backend(src.device().index);
    cuda::CudaBackend& to = cuda::backend(dst.device().index);
    // dst's stream may still be using dst's old block, src's stream may still be writing src.
    to.synchronize();
    from.synchronize();
    // Not cudaMemcpyPeer: it is asynchronous to the host and ordered only with the legacy default stream,
    // which our cudaStreamNonBlocking streams do not wait for. Queue it on dst's stream and wait for it.
    const cudaStream_t stream = to.stream();
    MIXTAPE_CUDA_CHECK(cudaMemcpyPeerAsync(dst.data_ptr(), to.device(), src.data_ptr(), from.device(), nbytes, stream));
    MIXTAPE_CUDA_CHECK(cudaStreamSynchronize(stream));
    return;
  }
  cuda::CudaBackend& gpu = cuda::backend(src.device().is_cuda() ? src.device().index : dst.device().index);
  const cudaMemcpyKind kind = src.device().is_cuda() ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
  const cudaStream_t stream = gpu.stream();
  MIXTAPE_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), nbytes, kind, stream));
  // Complete before returning: the host side may be pageable memory that the caller frees or reads next.
  MIXTAPE_CUDA_CHECK(cudaStreamSynchronize(stream));
}

namespace cuda {

void fail_call(const char* library, const char* call, const char* file, int line, int code, const char* message) {
  fail(library, " call '", call, "' failed at ", file, ":", line, ": ", message, " (error ", code, ")");
}

// ---- registry --------------------------------------------------------------------------------------------

CudaBackend& backend(int index) {
  static std::mutex mutex;
  static std::vector<std::unique_ptr<CudaBackend>> backends;
  const Device device = Device::cuda(index);  // checks the index, with the message users should see
  std::lock_guard lock(mutex);
  if (backends.empty()) backends.resize(static_cast<size_t>(cuda_device_count()));
  std::unique_ptr<CudaBackend>& slot = backends[static_cast<size_t>(device.index)];
  if (!slot) slot = std::make_unique<CudaBackend>(device.index);
  return *slot;
}

cudaStream_t device_stream(int index) { return backend(index).stream(); }

// ---- backend ---------------------------------------------------------------------------------------------

namespace {
// Asks the runtime rather than remembering: NCCL, a benchmark or user code may call cudaSetDevice too, and a
// cached answer would then launch on the wrong GPU. cudaGetDevice is a thread-local read in the runtime.
void make_current(int device) {
  int current = -1;
  MIXTAPE_CUDA_CHECK(cudaGetDevice(&current));
  if (current != device) MIXTAPE_CUDA_CHECK(cudaSetDevice(device));
}
}  // namespace

CudaBackend::CudaBackend(int device) : device_(device), allocator_(device) {
  make_current(device_);
  MIXTAPE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

CudaBackend::~CudaBackend() {
  // Process exit: the driver may already be shutting down, so failures here are ignored.
  if (stream_) {
    (void)cudaSetDevice(device_);
    (void)cudaStreamSynchronize(stream_);
    if (cublaslt_) (void)cublasLtDestroy(static_cast<cublasLtHandle_t>(cublaslt_));
    if (workspace_) (void)cudaFree(workspace_);
    (void)cudaStreamDestroy(stream_);
  }
}

cudaStream_t CudaBackend::stream() {
  make_current(device_);
  return stream_;
}

void CudaBackend::synchronize() { MIXTAPE_CUDA_CHECK(cudaStreamSynchronize(stream())); }

void* CudaBackend::cublaslt_handle() {
  if (!cublaslt_) {
    make_current(device_);
    cublasLtHandle_t handle = nullptr;
    MIXTAPE_CUBLAS_CHECK(cublasLtCreate(&handle));
    cublaslt_ = handle;
  }
  return cublaslt_;
}

void* CudaBackend::workspace() {
  if (!workspace_) {
    make_current(device_);
    MIXTAPE_CUDA_CHECK(cudaMalloc(&workspace_, kWorkspaceBytes));
  }
  return workspace_;
}

// ---- caching allocator -----------------------------------------------------------------------------------

// 512-byte granules below 1 MiB (kernels read 16-byte vectors, cuBLASLt wants 256-byte alignment), 2 MiB
// granules above, so the few large activation sizes of a model share blocks.
size_t CachingAllocator::round_size(size_t nbytes) {
  constexpr size_t kSmall = 512, kLarge = size_t{2} << 20;
  if (nbytes < (size_t{1} << 20)) return std::max(kSmall, (nbytes + kSmall - 1) / kSmall * kSmall);
  return (nbytes + kLarge - 1) / kLarge * kLarge;
}

void* CachingAllocator::allocate(size_t nbytes) {
  const size_t size = round_size(nbytes);
  void* ptr = nullptr;
  {
    std::lock_guard lock(mutex_);
    // Exact size classes: deallocate() gets only nbytes back, so a block must round to the size it has.
    auto it = free_blocks_.find(size);
    if (it != free_blocks_.end()) {
      ptr = it->second;
      free_blocks_.erase(it);
      stats_.cached_bytes -= size;
      stats_.allocated_bytes += size;
      stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
    }
  }
  if (!ptr) ptr = allocate_new(size);
  if (poison_allocations.load(std::memory_order_relaxed))
    MIXTAPE_CUDA_CHECK(cudaMemsetAsync(ptr, 0xFF, size, backend(device_).stream()));
  return ptr;
}

void* CachingAllocator::allocate_new(size_t size) {
  make_current(device_);
  void* ptr = nullptr;
  cudaError_t status = cudaMalloc(&ptr, size);
  if (status == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    empty_cache();
    status = cudaMalloc(&ptr, size);
  }
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    const MemoryStats now = stats();
    size_t free_bytes = 0, total_bytes = 0;
    (void)cudaMemGetInfo(&free_bytes, &total_bytes);
    fail("CUDA allocator: cudaMalloc of ", size, " bytes on cuda:", device_, " failed: ", cudaGetErrorString(status),
         " (", now.allocated_bytes, " bytes in live tensors, ", now.cached_bytes, " cached, device has ", free_bytes,
         " of ", total_bytes, " bytes free)");
  }
  std::lock_guard lock(mutex_);
  stats_.allocated_bytes += size;
  stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
  return ptr;
}

void CachingAllocator::deallocate(void* ptr, size_t nbytes) {
  const size_t size = round_size(nbytes);
  std::lock_guard lock(mutex_);
  free_blocks_.emplace(size, ptr);
  stats_.allocated_bytes -= size;
  stats_.cached_bytes += size;
}

MemoryStats CachingAllocator::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void CachingAllocator::reset_peak() {
  std::lock_guard lock(mutex_);
  stats_.peak_allocated_bytes = stats_.allocated_bytes;
}

void CachingAllocator::empty_cache() {
  std::multimap<size_t, void*> blocks;
  {
    std::lock_guard lock(mutex_);
    blocks.swap(free_blocks_);
    stats_.cached_bytes = 0;
  }
  if (blocks.empty()) return;
  make_current(device_);
  // Kernels queued before the frees may still read these blocks.
  MIXTAPE_CUDA_CHECK(cudaDeviceSynchronize());
  for (const auto& [size, ptr] : blocks) MIXTAPE_CUDA_CHECK(cudaFree(ptr));
}

}  // namespace cuda
}  // namespace mixtape

namespace mixtape::cuda {
// For tensor/backend.cpp, which sees CudaBackend only as a declaration.
Backend& as_backend(CudaBackend& backend) { return backend; }
}  // namespace mixtape::cuda

// ---- events (tensor/timer.cpp) ---------------------------------------------------------------------------
namespace mixtape::cuda {

std::shared_ptr<void> make_event(int device) {
  backend(device).stream();  // makes the device current
  cudaEvent_t event = nullptr;
  MIXTAPE_CUDA_CHECK(cudaEventCreate(&event));
  return std::shared_ptr<void>(event, [](void* e) { (void)cudaEventDestroy(static_cast<cudaEvent_t>(e)); });
}

void record_event(const std::shared_ptr<void>& event, int device) {
  MIXTAPE_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event.get()), backend(device).stream()));
}

double event_seconds_between(const std::shared_ptr<void>& start, const std::shared_ptr<void>& stop) {
  MIXTAPE_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(stop.get())));
  float milliseconds = 0;
  MIXTAPE_CUDA_CHECK(cudaEventElapsedTime(&milliseconds, static_cast<cudaEvent_t>(start.get()),
                                          static_cast<cudaEvent_t>(stop.get())));
  return milliseconds * 1e-3;
}

}  // namespace mixtape::cuda
