#pragma once
// Bytes on one device, owned through that device's allocator. Views of a tensor share one Storage, and with
// it one version counter: an in-place write through any view bumps it, which is how the tape notices that a
// tensor saved for backward was changed.
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "tensor/device.h"

namespace mixtape {

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(size_t nbytes) = 0;  // never returns null; throws Error when out of memory
  virtual void deallocate(void* ptr, size_t nbytes) = 0;
};

class Storage {
 public:
  Storage(size_t nbytes, Device device, Allocator& allocator);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }
  uint64_t version() const { return version_.load(std::memory_order_relaxed); }
  void bump_version() { version_.fetch_add(1, std::memory_order_relaxed); }

 private:
  void* data_;
  size_t nbytes_;
  Device device_;
  Allocator* allocator_;
  std::atomic<uint64_t> version_{0};
};

}  // namespace mixtape
