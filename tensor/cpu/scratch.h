#pragma once
// Per-thread scratch for a kernel's parallel region, carved out of one uninitialised Tensor::empty.
//
// Why not a std::vector per thread: glibc serves a few hundred KiB from the top of the heap and, on free, trims
// the top back to the OS, so every call of the kernel faulted its scratch pages in again (zeroed by the
// kernel, then zeroed again by the vector): dozens of brk calls a training step. The caching allocator hands
// the same block back call after call, its stats count it, and nothing is initialised that the kernel
// overwrites anyway.
#include <omp.h>

#include <cstddef>
#include <cstdint>

#include "tensor/error.h"
#include "tensor/tensor.h"

namespace mixtape::cpu {

// Hands out consecutive 64-byte aligned arrays of a buffer. Without a buffer it only counts the bytes, so one
// layout's constructor both sizes and carves its scratch (scratch_bytes below).
class ScratchCarver {
 public:
  explicit ScratchCarver(std::byte* base = nullptr) : base_(base) {}
  template <class T>
  T* take(int64_t n) {
    T* p = base_ ? reinterpret_cast<T*>(base_ + used_) : nullptr;
    used_ += (static_cast<size_t>(n) * sizeof(T) + 63) / 64 * 64;
    return p;
  }
  size_t used() const { return used_; }

 private:
  std::byte* base_;
  size_t used_ = 0;
};

// The bytes a Layout (constructible from a ScratchCarver& and args) takes.
template <class Layout, class... Args>
size_t scratch_bytes(const Args&... args) {
  ScratchCarver counter;
  [[maybe_unused]] const Layout layout(counter, args...);
  return counter.used();
}

// `bytes` of scratch for each thread of a parallel region with `parallel` as its if-clause; carver() inside
// the region gives the calling thread its own part. Each part is rounded up to whole cache lines, so every
// thread's arrays start on one (the carver keeps them there), whatever `bytes` is.
class ThreadScratch {
 public:
  ThreadScratch(size_t bytes, bool parallel)
      : bytes_((bytes + 63) / 64 * 64),
        threads_(parallel ? omp_get_max_threads() : 1),
        buffer_(Tensor::empty({static_cast<int64_t>((bytes_ * static_cast<size_t>(threads_) + 3) / 4)})) {}

  ScratchCarver carver() const {
    const int thread = omp_get_thread_num();
    check(thread < threads_, "ThreadScratch: thread ", thread, " of a region sized for ", threads_);
    return ScratchCarver(static_cast<std::byte*>(buffer_.data_ptr()) + bytes_ * static_cast<size_t>(thread));
  }

 private:
  size_t bytes_;
  int threads_;
  Tensor buffer_;  // f32 elements only for their bytes; the caching allocator aligns blocks to 64 bytes
};

}  // namespace mixtape::cpu
