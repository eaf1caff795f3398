#pragma once
// Sums along a contiguous run with kLanes independent accumulators, combined pairwise at the end: the loop
// vectorises, and each partial sum's rounding chain is n/kLanes long instead of n.
#include <cstdint>
#include <limits>
#include <utility>

namespace mixtape::cpu {

constexpr int64_t kLanes = 16;  // independent accumulators (one or two SIMD registers of float)

// sum_{j < n} term(j), with kLanes independent partial sums combined at the end.
template <class A, class Term>
inline A lane_sum(int64_t n, Term&& term) {
  A lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += term(j + l);
  A tail = 0;
  for (; j < n; ++j) tail += term(j);
  for (int64_t width = kLanes / 2; width > 0; width /= 2)
    for (int64_t l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  return lanes[0] + tail;
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
