// Where the CPU kernels' buffers come from (tensor/cpu/scratch.h, the caching allocator): every array starts
// on a cache line, whatever its size, so a 64-byte vector load of its element 0 (and of every 16th float
// after it) never straddles two lines. The norms' backward ran ~2x slower from 16-byte-aligned std::vectors.
#include <gtest/gtest.h>
#include <omp.h>

#include <cstdint>
#include <vector>

#include "tensor/cpu/scratch.h"
#include "tensor/tensor.h"

namespace mixtape::cpu {
namespace {

bool on_cache_line(const void* p) { return reinterpret_cast<uintptr_t>(p) % 64 == 0; }

TEST(Scratch, EveryArrayCarvedForEveryThreadStartsOnACacheLine) {
  for (int64_t n = 1; n <= 1100; n += 37) {
    const ThreadScratch scratch(3 * static_cast<size_t>(n) * sizeof(double), /*parallel=*/true);
    std::vector<int> misaligned(static_cast<size_t>(omp_get_max_threads()), 0);
#pragma omp parallel
    {
      ScratchCarver carver = scratch.carver();
      const float* a = carver.take<float>(n);
      const double* b = carver.take<double>(n);
      const char* c = carver.take<char>(n);
      misaligned[static_cast<size_t>(omp_get_thread_num())] = !on_cache_line(a) + !on_cache_line(b) + !on_cache_line(c);
    }
    for (size_t t = 0; t < misaligned.size(); ++t) EXPECT_EQ(misaligned[t], 0) << n << " elements, thread " << t;
  }
}

TEST(Scratch, EveryCpuTensorBlockStartsOnACacheLine) {
  for (int64_t n = 1; n <= 1100; n += 37) {
    const Tensor floats = Tensor::empty({n}, DType::F32), doubles = Tensor::zeros({n}, DType::F64);
    EXPECT_TRUE(on_cache_line(floats.data_ptr())) << n << " floats";
    EXPECT_TRUE(on_cache_line(doubles.data_ptr())) << n << " doubles";
  }
}

}  // namespace
}  // namespace mixtape::cpu
