#include "tensor/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <numbers>
#include <type_traits>

#include "tensor/cpu/convert_block.h"

#include "tensor/cpu/strided.h"
#include "tensor/cpu/transpose.h"
#include "tensor/largest_below.h"
#include "tensor/random.h"

namespace mixtape {

namespace cpu {

CpuBackend& cpu_backend() {
  static CpuBackend backend;  // the per-device registry's CPU entry
  return backend;
}

// ---- allocator -------------------------------------------------------------------------------------------

size_t CachingAllocator::round_size(size_t nbytes) { return (nbytes + 511) / 512 * 512; }

void* CachingAllocator::allocate(size_t nbytes) {
  const size_t size = round_size(nbytes);
  {
    std::lock_guard lock(mutex_);
    // The block of this size freed last: the likeliest to be still in cache (a multimap keeps equal keys in
    // insertion order, so it is the last of the range; find() would give the first, the longest unused).
    auto it = free_blocks_.upper_bound(size);
    if (it != free_blocks_.begin() && std::prev(it)->first == size) {
      --it;
      void* ptr = it->second;
      free_blocks_.erase(it);
      stats_.cached_bytes -= size;
      stats_.allocated_bytes += size;
      stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
      return ptr;
    }
  }
  void* ptr = std::aligned_alloc(64, size);
  if (!ptr) {
    empty_cache();
    ptr = std::aligned_alloc(64, size);
  }
  check(ptr != nullptr, "CPU allocator: out of memory allocating ", nbytes, " bytes");
  std::lock_guard lock(mutex_);
  stats_.allocated_bytes += size;
  stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
  return ptr;
}

void CachingAllocator::deallocate(void* ptr, size_t nbytes) {
  const size_t size = round_size(nbytes);
  {
    std::lock_guard lock(mutex_);
    stats_.allocated_bytes -= size;
    if (stats_.cached_bytes + size <= kMaxCachedBytes) {
      free_blocks_.emplace(size, ptr);
      stats_.cached_bytes += size;
      return;
    }
  }
  std::free(ptr);
}

CachingAllocator::~CachingAllocator() { empty_cache(); }

CachingAllocator::Stats CachingAllocator::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void CachingAllocator::reset_peak() {
  std::lock_guard lock(mutex_);
  stats_.peak_allocated_bytes = stats_.allocated_bytes;
}

MemoryStats CpuBackend::memory_stats() {
  const CachingAllocator::Stats s = allocator_.stats();
  return {s.allocated_bytes, s.peak_allocated_bytes, s.cached_bytes};
}

void CpuBackend::reset_peak_memory_stats() { allocator_.reset_peak(); }

void CachingAllocator::empty_cache() {
  std::lock_guard lock(mutex_);
  for (auto& [size, ptr] : free_blocks_) std::free(ptr);
  free_blocks_.clear();
  stats_.cached_bytes = 0;
}

// ---- copy, fill, arange --------------------------------------------------------------------------------

void CpuBackend::copy_kernel(const Tensor& src, const Tensor& dst) {
  const StridedLoop<2> loop(dst.shape(), {dst.strides(), src.strides()});
  dispatch_all(dst.dtype(), "copy", [&]<typename To>() {
    dispatch_all(src.dtype(), "copy", [&]<typename From>() {
      To* out = dst.data<To>();
      const From* in = src.data<From>();
      const auto [so, si] = loop.inner_strides();
      const auto body = [&](const std::array<int64_t, 2>& at, int64_t n) {
        To* o = out + at[0];
        const From* i = in + at[1];
        // fp16/bf16 <-> f32 (autocast casts, matmul operands): vectorised block conversion, through a small
        // gathered block when the source is strided (a transposed weight).
        if constexpr (std::is_same_v<To, float> && kSixteenBit<From>) {
          if (so == 1 && si == 1) return widen_block(i, o, n);
          if (so == 1) {
            From block[256];
            for (int64_t j0 = 0; j0 < n; j0 += 256) {
              const int64_t m = std::min<int64_t>(256, n - j0);
              for (int64_t j = 0; j < m; ++j) block[j] = i[(j0 + j) * si];
              widen_block(block, o + j0, m);
            }
            return;
          }
        } else if constexpr (kSixteenBit<To> && std::is_same_v<From, float>) {
          if (so == 1 && si == 1) return narrow_block(i, o, n);
        }
        if (so == 1 && si == 1) {
          for (int64_t j = 0; j < n; ++j) o[j] = convert<To>(i[j]);
        } else {
          for (int64_t j = 0; j < n; ++j) o[j * so] = convert<To>(i[j * si]);
        }
      };
      // src read transposed: tiles, through register transposes (into float, or 16-bit into the same type)
      if (loop.transposes(1)) {
        const int64_t dst_rows = loop.row_stride(0);
        loop.run_tiled([&](const std::array<int64_t, 2>& at, int64_t rows, int64_t cols) {
          if constexpr (std::is_same_v<To, float> && (std::is_same_v<From, float> || kSixteenBit<From>)) {
            transpose_into(in + at[1], si, rows, cols, out + at[0], dst_rows);
          } else if constexpr (std::is_same_v<To, From> && kSixteenBit<From>) {
            transpose16_into(in + at[1], si, rows, cols, out + at[0], dst_rows);
          } else {
            for (int64_t r = 0; r < rows; ++r) body({at[0] + r * dst_rows, at[1] + r}, cols);
          }
        });
      } else {
        loop.run(body);
      }
    });
  });
}

void CpuBackend::fill(const Tensor& dst, double value) {
  const StridedLoop<1> loop(dst.shape(), {dst.strides()});
  dispatch_all(dst.dtype(), "fill", [&]<typename T>() {
    const T v = convert<T>(value);
    T* out = dst.data<T>();
    const int64_t s = loop.inner_strides()[0];
    loop.run([&](const std::array<int64_t, 1>& at, int64_t n) {
      for (int64_t j = 0; j < n; ++j) out[at[0] + j * s] = v;
    });
  });
}

void CpuBackend::arange_kernel(const Tensor& dst, double start, double step) {
  dispatch_all(dst.dtype(), "arange", [&]<typename T>() {
    T* out = dst.data<T>();
    const int64_t n = dst.numel();
    for (int64_t i = 0; i < n; ++i) out[i] = convert<T>(start + static_cast<double>(i) * step);
  });
}

// ---- random ---------------------------------------------------------------------------------------------
// Element i takes the Philox block for counter (offset + i) and uses what it needs of its four words, so a
// draw never depends on how elements are grouped into threads (or, later, into GPU blocks).

namespace {

template <class Draw>
void philox_fill(const Tensor& dst, const char* op, Draw&& draw) {
  const StridedLoop<1> loop(dst.shape(), {dst.strides()});
  dispatch_all(dst.dtype(), op, [&]<typename T>() {
    T* out = dst.data<T>();
    loop.run([&](const std::array<int64_t, 1>& at, int64_t n) {
      for (int64_t j = 0; j < n; ++j) out[at[0] + j] = draw.template operator()<T>(at[0] + j);
    }, 4096);
  });
}

}  // namespace

void CpuBackend::uniform_kernel(const Tensor& dst, uint64_t seed, uint64_t offset, double low, double high) {
  philox_fill(dst, "uniform", [&]<typename T>(int64_t i) -> T {
    const auto r = philox4x32(offset + static_cast<uint64_t>(i), 0, seed);
    const double u = std::is_same_v<T, double> ? uniform_double_from_bits(r[0], r[1])
                                               : static_cast<double>(uniform_from_bits(r[0]));
    // u < 1, but low + (high - low) * u can still round up to `high` in T (in f16 every u above 1 - 2^-12
    // does): such draws take the largest T below high, so the interval stays half-open in every dtype.
    const T value = convert<T>(low + (high - low) * u);
    return static_cast<double>(value) < high ? value : largest_below<T>(high);
  });
}

void CpuBackend::normal_kernel(const Tensor& dst, uint64_t seed, uint64_t offset, double mean, double std) {
  philox_fill(dst, "normal", [&]<typename T>(int64_t i) {
    const auto r = philox4x32(offset + static_cast<uint64_t>(i), 0, seed);
    // Box-Muller on two uniforms in (0, 1]: the first is shifted off 0 so log() stays finite.
    const double u1 = 1.0 - uniform_double_from_bits(r[0], r[1]);
    const double u2 = uniform_double_from_bits(r[2], r[3]);
    const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
    return convert<T>(mean + std * z);
  });
}

void CpuBackend::randint_kernel(const Tensor& dst, uint64_t seed, uint64_t offset, int64_t low, int64_t high) {
  // In uint64 arithmetic: high - low and low + pick overflow int64 for ranges wider than 2^63.
  const uint64_t range = static_cast<uint64_t>(high) - static_cast<uint64_t>(low);
  philox_fill(dst, "randint", [&]<typename T>(int64_t i) {
    const auto r = philox4x32(offset + static_cast<uint64_t>(i), 0, seed);
    // 64 random bits reduced by multiply-high: bias below 2^-32 for any range that fits an int64.
    const uint64_t bits = static_cast<uint64_t>(r[0]) << 32 | r[1];
    const uint64_t pick = static_cast<uint64_t>((static_cast<unsigned __int128>(bits) * range) >> 64);
    return convert<T>(static_cast<int64_t>(static_cast<uint64_t>(low) + pick));
  });
}

}  // namespace cpu
}  // namespace mixtape
