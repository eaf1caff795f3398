#pragma once
// Sums along a contiguous run with kLanes independent accumulators, combined pairwise at the end: the loop
// vectorises, and each partial sum's rounding chain is n/kLanes long instead of n.
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace mixtape::cpu {

constexpr int64_t kLanes = 16;  // independent accumulators (one or two SIMD registers of float)

#if defined(__AVX512F__)
// The 16 float lanes combined by op in registers: lane l with lane l + 8, then + 4, + 2, + 1, the tree
// combine_lanes spells out below. (Its scalar loop compiles to a store of the lanes and 15 dependent scalar
// loads and adds; this keeps the row sums of layer_norm and the bf16 attention in registers.) The masked
// extracts with all-ones masks: GCC 12's plain ones, and the casts built on them, warn of an uninitialised
// value.
template <class Op>
inline float fold_lanes(__m512 lanes, Op op) {
  const __m256 eight =
      op(_mm512_maskz_extractf32x8_ps(0xFF, lanes, 0), _mm512_maskz_extractf32x8_ps(0xFF, lanes, 1));
  const __m128 four = op(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  const __m128 two = op(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(op(two, _mm_shuffle_ps(two, two, 1)));
}

inline float sum_lanes(__m512 lanes) {
  return fold_lanes(lanes, [](auto a, auto b) {
    if constexpr (sizeof(a) == 32) return _mm256_add_ps(a, b);
    else return _mm_add_ps(a, b);
  });
}

inline float max_lanes(__m512 lanes) {
  return fold_lanes(lanes, [](auto a, auto b) {
    if constexpr (sizeof(a) == 32) return _mm256_max_ps(a, b);
    else return _mm_max_ps(a, b);
  });
}
#endif

// lanes[0] after lanes[l] += lanes[l + width] for width = kLanes / 2, ..., 1: the fixed order every partial
// sum of this file is combined in (so a sum has the same bits with or without AVX-512).
template <class A>
inline A combine_lanes(A (&lanes)[kLanes]) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<A, float> && kLanes == 16) return sum_lanes(_mm512_loadu_ps(lanes));
#endif
  for (int64_t width = kLanes / 2; width > 0; width /= 2)
    for (int64_t l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  return lanes[0];
}

// sum_{j < n} term(j), with kLanes independent partial sums combined at the end.
template <class A, class Term>
inline A lane_sum(int64_t n, Term&& term) {
  A lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += term(j + l);
  A tail = 0;
  for (; j < n; ++j) tail += term(j);
  return combine_lanes(lanes) + tail;
}

// Two sums over the same j in one pass: {sum_j first(j), sum_j second(j)}.
template <class A, class Term>
inline std::pair<A, A> lane_sum2(int64_t n, Term&& term) {
  A lanes_a[kLanes] = {}, lanes_b[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) {
      const auto [a, b] = term(j + l);
      lanes_a[l] += a;
      lanes_b[l] += b;
    }
  A tail_a = 0, tail_b = 0;
  for (; j < n; ++j) {
    const auto [a, b] = term(j);
    tail_a += a;
    tail_b += b;
  }
  // combine_lanes' scalar tree (same order, same bits), the two arrays interleaved in one loop: with
  // layer_norm's backward reading its rows from memory this is faster than a register fold of each array or two
  // calls of the scalar tree one after the other (Zen 5, rows from memory: 130-138 us against 145-147 folded).
  for (int64_t width = kLanes / 2; width > 0; width /= 2)
    for (int64_t l = 0; l < width; ++l) {
      lanes_a[l] += lanes_a[l + width];
      lanes_b[l] += lanes_b[l + width];
    }
  return {lanes_a[0] + tail_a, lanes_b[0] + tail_b};
}

// max_{j < n} v[j] ignoring NaN (-inf for n = 0), with kLanes independent maxima so it vectorises (one
// running maximum stays scalar: a compare after another). The maximum is exact: the lanes change no result.
template <class A>
inline A lane_max(const A* v, int64_t n) {
  A lanes[kLanes];
  for (A& lane : lanes) lane = -std::numeric_limits<A>::infinity();
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] = v[j + l] > lanes[l] ? v[j + l] : lanes[l];
  for (; j < n; ++j) lanes[0] = v[j] > lanes[0] ? v[j] : lanes[0];
  A m = lanes[0];
  for (int64_t l = 1; l < kLanes; ++l) m = lanes[l] > m ? lanes[l] : m;
  return m;
}

}  // namespace mixtape::cpu
