#include "tensor/storage.h"

namespace mixtape {

Storage::Storage(size_t nbytes, Device device, Allocator& allocator)
    : data_(nbytes ? allocator.allocate(nbytes) : nullptr), nbytes_(nbytes), device_(device), allocator_(&allocator) {}

Storage::~Storage() {
  if (data_) allocator_->deallocate(data_, nbytes_);
}

}  // namespace mixtape
