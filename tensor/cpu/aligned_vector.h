#pragma once
// A std::vector whose elements start on a 64-byte boundary, for the kernels' small per-call buffers (a row
// widened to float, a weight vector, per-block partial sums). std::vector's allocator gives 16-byte alignment,
// so most 64-byte AVX-512 loads and stores of such a buffer straddled two cache lines: layer_norm's backward of
// a bf16 [2048, 256] took 185-186 us (medians) with its buffers so and 83-86 us aligned (two Zen 5 cores, a
// scratch program calling the kernel), and the fp16_naive training step's layer_norm 0.94 + 1.24 ms (forward +
// backward, `bench_train_gpt --phases`) against 0.74 + 0.89. The values are the same either way: only the
// addresses move.
#include <cstddef>
#include <new>
#include <vector>

namespace mixtape::cpu {

template <class T>
struct CacheLineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlignment{64};

  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) noexcept {}

  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlignment)); }
  void deallocate(T* p, std::size_t) noexcept { ::operator delete(p, kAlignment); }

  template <class U>
  bool operator==(const CacheLineAllocator<U>&) const noexcept {
    return true;
  }
};

template <class T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

}  // namespace mixtape::cpu
