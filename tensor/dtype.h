#pragma once
// Element types and the one place that maps a DType to its C++ type (dispatch_*).
#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <type_traits>

#include "tensor/error.h"
#include "tensor/half.h"

namespace mixtape {

// F8E4M3 .. F4E2M1 are the low-precision storage formats of tensor/minifloat.h (fp8, the MX scale, fp4): no
// op computes in them; Tensor::to converts into and out of them, and tensor/quantize.h quantizes with scales.
enum class DType : uint8_t { F32, F16, BF16, F64, I32, I64, F8E4M3, F8E5M2, F8E8M0, F4E2M1 };

// Bytes per element. Error for F4E2M1, whose elements are half a byte (storage_bytes counts them).
size_t dtype_size(DType dtype);
int dtype_bits(DType dtype);
// The bytes `numel` elements take: F4E2M1 packs two per byte (tensor/minifloat.h says which nibble).
int64_t storage_bytes(DType dtype, int64_t numel);
// "f32", "f16", "bf16", "f64", "i32", "i64", "f8e4m3", "f8e5m2", "f8e8m0", "f4e2m1"
const char* dtype_name(DType dtype);
inline bool is_floating(DType dtype) { return dtype <= DType::F64; }  // the dtypes ops compute in
inline bool is_minifloat(DType dtype) { return dtype >= DType::F8E4M3 && dtype <= DType::F4E2M1; }
inline bool is_low_precision(DType dtype) { return dtype == DType::F16 || dtype == DType::BF16; }
// The dtype two floating inputs compute in: the wider one; f16 with bf16 gives f32 (neither holds the other).
DType promote(DType a, DType b);
std::ostream& operator<<(std::ostream& out, DType dtype);

template <class T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::F32; };
template <> struct dtype_of<Half> { static constexpr DType value = DType::F16; };
template <> struct dtype_of<BFloat16> { static constexpr DType value = DType::BF16; };
template <> struct dtype_of<double> { static constexpr DType value = DType::F64; };
template <> struct dtype_of<int32_t> { static constexpr DType value = DType::I32; };
template <> struct dtype_of<int64_t> { static constexpr DType value = DType::I64; };

// The type arithmetic on T accumulates in: float for f32/f16/bf16, double for f64.
template <class T> struct accumulate_type { using type = float; };
template <> struct accumulate_type<double> { using type = double; };
template <> struct accumulate_type<int32_t> { using type = int64_t; };
template <> struct accumulate_type<int64_t> { using type = int64_t; };
template <class T> using acc_t = typename accumulate_type<T>::type;

// Converts one value between element types: into f16/bf16 with round-to-nearest-even (from double and
// integers via double, correctly rounded), out of them exactly.
template <class To, class From>
inline To convert(From value) {
  constexpr bool to_16 = std::is_same_v<To, Half> || std::is_same_v<To, BFloat16>;
  constexpr bool from_16 = std::is_same_v<From, Half> || std::is_same_v<From, BFloat16>;
  if constexpr (std::is_same_v<To, From>) return value;
  else if constexpr (to_16 && from_16) return To(static_cast<float>(value));
  else if constexpr (to_16 && std::is_same_v<From, float>) return To(value);
  else if constexpr (to_16 && std::is_integral_v<From>) return To(integer_to_double_round_to_odd(value));
  else if constexpr (to_16) return To(static_cast<double>(value));
  else if constexpr (from_16) return static_cast<To>(static_cast<float>(value));
  else return static_cast<To>(value);
}

// Calls fn.template operator()<T>() with T the C++ type of dtype. `what` names the caller in the error.
//   dispatch_float(t.dtype(), "exp", [&]<typename T>() { exp_kernel<T>(...); });
template <class Fn>
decltype(auto) dispatch_float(DType dtype, const char* what, Fn&& fn) {
  switch (dtype) {
    case DType::F32: return fn.template operator()<float>();
    case DType::F16: return fn.template operator()<Half>();
    case DType::BF16: return fn.template operator()<BFloat16>();
    case DType::F64: return fn.template operator()<double>();
    default: fail(what, ": dtype ", dtype_name(dtype), " is not supported (expected f32, f16, bf16 or f64)");
  }
}

template <class Fn>
decltype(auto) dispatch_index(DType dtype, const char* what, Fn&& fn) {
  switch (dtype) {
    case DType::I32: return fn.template operator()<int32_t>();
    case DType::I64: return fn.template operator()<int64_t>();
    default: fail(what, ": dtype ", dtype_name(dtype), " is not supported (expected i32 or i64)");
  }
}

template <class Fn>
decltype(auto) dispatch_all(DType dtype, const char* what, Fn&& fn) {
  if (is_floating(dtype)) return dispatch_float(dtype, what, std::forward<Fn>(fn));
  return dispatch_index(dtype, what, std::forward<Fn>(fn));
}

}  // namespace mixtape
