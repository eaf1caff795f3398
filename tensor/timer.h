#pragma once
// Timing work on a device. On the CPU it is the wall clock; on a GPU, CUDA events queued on the device's
// stream, so the time is the device's (kernels run asynchronously: a host clock would time the launches).
#include <chrono>
#include <memory>

#include "tensor/device.h"

namespace mixtape {

class DeviceTimer {
 public:
  explicit DeviceTimer(Device device);
  void start();
  void stop();
  double seconds();  // from start() to stop(); waits for the device to reach stop()

 private:
  Device device_;
  std::chrono::steady_clock::time_point cpu_start_, cpu_stop_;
  std::shared_ptr<void> start_event_, stop_event_;  // cudaEvent_t on CUDA
};

}  // namespace mixtape
