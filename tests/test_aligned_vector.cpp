// tensor/cpu/aligned_vector.h: the kernels' small buffers start on a cache line, however large and however they
// grew, so a 64-byte vector load of element 0 (and of every 16th float after it) never straddles two lines.
#include <gtest/gtest.h>

#include <cstdint>
#include <utility>

#include "tensor/cpu/aligned_vector.h"

namespace mixtape::cpu {
namespace {

template <class T>
bool on_cache_line(const AlignedVector<T>& v) {
  return reinterpret_cast<uintptr_t>(v.data()) % 64 == 0;
}

TEST(AlignedVector, EverySizeStartsOnACacheLine) {
  for (size_t n = 1; n <= 1100; n += 37) {
    const AlignedVector<float> floats(n, 1.5f);
    const AlignedVector<double> doubles(n);
    const AlignedVector<char> bytes(n);
    EXPECT_TRUE(on_cache_line(floats)) << n << " floats";
    EXPECT_TRUE(on_cache_line(doubles)) << n << " doubles";
    EXPECT_TRUE(on_cache_line(bytes)) << n << " bytes";
    EXPECT_EQ(floats.size(), n);
    EXPECT_EQ(floats.back(), 1.5f);
  }
}

TEST(AlignedVector, StaysOnACacheLineAsItGrowsAndIsCopied) {
  AlignedVector<float> v;
  for (int i = 0; i < 5000; ++i) {
    v.push_back(static_cast<float>(i));
    ASSERT_TRUE(on_cache_line(v)) << "after " << i + 1 << " elements";
  }
  const AlignedVector<float> copy = v;
  EXPECT_TRUE(on_cache_line(copy));
  EXPECT_EQ(copy, v);
  AlignedVector<float> moved = std::move(v);
  EXPECT_TRUE(on_cache_line(moved));
  EXPECT_EQ(moved[4999], 4999.0f);
}

}  // namespace
}  // namespace mixtape::cpu
