#pragma once
// The largest value of an element type strictly below a bound: what a uniform draw in [low, high) becomes when
// it rounds up to `high` in its dtype, so that the interval stays half-open in every dtype. Host code, shared
// by the CPU's and the CUDA backend's uniform kernels (the CUDA one passes the value to its draws).
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "tensor/dtype.h"

namespace mixtape {

template <class T>
T largest_below(double bound) {
  if constexpr (std::is_integral_v<T>) {
    return static_cast<T>(std::ceil(bound) - 1);
  } else {
    const T nearest = convert<T>(bound);
    if (static_cast<double>(nearest) < bound) return nearest;
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
      return std::nextafter(nearest, -std::numeric_limits<T>::infinity());
    } else {  // f16/bf16 sign-magnitude bits: one step toward -Inf
      const uint16_t bits = nearest.bits;
      const bool negative = bits & 0x8000u, zero = (bits & 0x7fffu) == 0;
      return T::from_bits(static_cast<uint16_t>(zero ? 0x8001u : negative ? bits + 1 : bits - 1));
    }
  }
}

}  // namespace mixtape
