#include "tensor/timer.h"

#include "tensor/error.h"

namespace mixtape {

#ifdef MIXTAPE_WITH_CUDA
namespace cuda {  // tensor/cuda/cuda_backend.cu
std::shared_ptr<void> make_event(int device);
void record_event(const std::shared_ptr<void>& event, int device);
double event_seconds_between(const std::shared_ptr<void>& start, const std::shared_ptr<void>& stop);
}  // namespace cuda
#endif

DeviceTimer::DeviceTimer(Device device) : device_(device) {
#ifdef MIXTAPE_WITH_CUDA
  if (device_.is_cuda()) {
    start_event_ = cuda::make_event(device_.index);
    stop_event_ = cuda::make_event(device_.index);
  }
#else
  if (device_.is_cuda()) not_supported("DeviceTimer on ", device_, ": this build of mixtape has no CUDA backend");
#endif
}

void DeviceTimer::start() {
#ifdef MIXTAPE_WITH_CUDA
  if (device_.is_cuda()) return cuda::record_event(start_event_, device_.index);
#endif
  cpu_start_ = std::chrono::steady_clock::now();
}

void DeviceTimer::stop() {
#ifdef MIXTAPE_WITH_CUDA
  if (device_.is_cuda()) return cuda::record_event(stop_event_, device_.index);
#endif
  cpu_stop_ = std::chrono::steady_clock::now();
}

double DeviceTimer::seconds() {
#ifdef MIXTAPE_WITH_CUDA
  if (device_.is_cuda()) return cuda::event_seconds_between(start_event_, stop_event_);
#endif
  return std::chrono::duration<double>(cpu_stop_ - cpu_start_).count();
}

}  // namespace mixtape
