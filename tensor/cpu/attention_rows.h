#pragma once
// Row work the causal-attention kernels share (tensor/cpu/attention.cpp, the portable one, and
// tensor/cpu/attention_bf16.cpp, bf16 on AMX tiles or AVX512-BF16 dot products): storing a scaled fp32 row into
// the output dtype, and the backward's recomputed probabilities and their gradient for one query row of a block.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "tensor/cpu/convert_block.h"
#include "tensor/cpu/fast_math.h"

namespace mixtape::cpu {

// dst[0, n) = scale * src[0, n), each product rounded once to T. fp16 goes through narrow_block's F16C
// conversion in chunks (converting element by element keeps the loop scalar); bf16's rounding is integer
// arithmetic the compiler vectorises in place.
template <class A, class T>
inline void store_scaled_run(const A* __restrict src, A scale, T* __restrict dst, int64_t n) {
  if constexpr (std::is_same_v<T, Half>) {
    constexpr int64_t kChunk = 64;
    alignas(64) float scaled[kChunk];
    for (int64_t d0 = 0; d0 < n; d0 += kChunk) {
      const int64_t m = std::min(kChunk, n - d0);
      for (int64_t d = 0; d < m; ++d) scaled[d] = scale * src[d0 + d];
      narrow_block(scaled, dst + d0, m);
    }
  } else {
    for (int64_t d = 0; d < n; ++d) dst[d] = convert<T>(scale * src[d]);
  }
}

// One query row of a backward block, in place: s (its scores q.k) becomes p = e^(scale s - lse) and dp (its
// do.v) becomes ds = p (dp - delta) for the n keys the row sees; the rest of the row, up to width, is zero.
// One loop over the whole width, the hidden keys selected to zero: a loop over the first n alone left a scalar
// remainder of up to 15 elements (each a scalar exp) in every row whose n is not a multiple of the vector
// width, and on the diagonal blocks that is nearly every row. What the hidden entries held (stale sums,
// even NaN) is computed on and then discarded.
template <class A>
inline void probabilities_and_gradient_row(A* __restrict s, A* __restrict dp, int64_t n, int64_t width, A scale,
                                           A lse, A delta) {
#pragma omp simd
  for (int64_t c = 0; c < width; ++c) {
    const A p = fast_exp(scale * s[c] - lse);
    const A ds = p * (dp[c] - delta);  // ds = p (dp - delta)
    s[c] = c < n ? p : A(0);
    dp[c] = c < n ? ds : A(0);
  }
}

}  // namespace mixtape::cpu
