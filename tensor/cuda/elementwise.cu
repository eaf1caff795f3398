// CUDA elementwise kernels: copy/convert, fill, arange, the Philox draws, unary maps and their backward,
// binary ops (operands already broadcast), tensor-scalar ops, where, the in-place updates and dropout.
//
// The CPU kernels (tensor/cpu/elementwise.cpp, cpu_backend.cpp, norm.cpp's dropout) are the reference: each
// op below is the same formula in the same operation order and the same compute type
//
//   out[i] = convert<T>( f( convert<C>(in[i]) ) )
//
// with C float for f32/f16/bf16 and double for f64 (double for every op with a double scalar), rounded once on
// store. Transcendentals use libdevice's accurate functions (expf, tanhf, erfc, ...; never the __expf
// intrinsics), so a result differs from the CPU's by at most the libm difference (a few ulp of C), which
// rounding to f16/bf16 almost always hides. nvcc fuses a * b + c into one FMA by default, as GCC does for the
// CPU kernels on an FMA-capable -march=native host; which of two products a compiler fuses is its own choice,
// so where a product feeds a sum the two devices can differ by an ulp (identical when the product is exact).
//
// Every kernel is one functor over N operands (operand 0 is the output) run by one of two grid-stride loops:
// - contiguous: every operand is contiguous (after coalescing dims); groups of kVec elements are moved with
//   one 16-byte load/store per operand when every pointer is aligned for it, the remainder element by element;
// - strided: OffsetCalculator<N> turns the row-major index into each operand's offset (stride 0 for
//   broadcast dims).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numbers>
#include <type_traits>

#include "tensor/cuda/common.cuh"
#include "tensor/cuda/cuda_backend.h"
#include "tensor/largest_below.h"
#include "tensor/random.h"

namespace mixtape::cuda {

namespace {

// ---- conversions (tensor/dtype.h's convert<To>(From), on device types) ------------------------------------

template <class T>
inline constexpr bool kIs16Bit = std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;

template <class D>
__device__ __forceinline__ float widen16(D x) {
  if constexpr (std::is_same_v<D, __half>) return __half2float(x);
  else return __bfloat162float(x);
}
// float -> f16/bf16, round to nearest even.
template <class D>
__device__ __forceinline__ D round16(float x) {
  if constexpr (std::is_same_v<D, __half>) return __float2half_rn(x);
  else return __float2bfloat16_rn(x);
}
// double -> f16/bf16, correctly rounded in one step (cvt.rn.f16.f64 / cvt.rn.bf16.f64, or CUDA's round-to-odd
// fallback for bf16 before sm_90): the value the CPU gets through double_to_float_round_to_odd.
template <class D>
__device__ __forceinline__ D round16(double x) {
  if constexpr (std::is_same_v<D, __half>) return __double2half(x);
  else return __double2bfloat16(x);
}

// tensor/half.h's integer_to_double_round_to_odd: exact up to 2^53, above that the dropped bits become a
// sticky last bit, so rounding on to a 16-bit type stays correct.
__device__ __forceinline__ double integer_to_double_round_to_odd(int64_t value) {
  uint64_t magnitude = value < 0 ? 0 - static_cast<uint64_t>(value) : static_cast<uint64_t>(value);
  const int dropped = 64 - __clzll(static_cast<long long>(magnitude)) - 53;
  if (dropped > 0) {
    const uint64_t low = magnitude & ((uint64_t{1} << dropped) - 1);
    magnitude = (magnitude >> dropped) << dropped;
    if (low) magnitude |= uint64_t{1} << dropped;
  }
  const double exact = static_cast<double>(magnitude);
  return value < 0 ? -exact : exact;
}

// One value between device element types (float, double, __half, __nv_bfloat16, int32_t, int64_t), exactly
// as convert<To>(From): into f16/bf16 round to nearest even (from double and integers correctly rounded, via
// double), out of them through float; everything else a static_cast.
template <class To, class From>
__device__ __forceinline__ To convert_to(From value) {
  if constexpr (std::is_same_v<To, From>) {
    return value;
  } else if constexpr (kIs16Bit<From>) {
    const float f = widen16(value);
    if constexpr (kIs16Bit<To>) return round16<To>(f);
    else return static_cast<To>(f);
  } else if constexpr (kIs16Bit<To>) {
    if constexpr (std::is_same_v<From, float> || std::is_same_v<From, double>) return round16<To>(value);
    else return round16<To>(integer_to_double_round_to_odd(static_cast<int64_t>(value)));
  } else {
    return static_cast<To>(value);
  }
}

// The device type's pointer to element 0 of t.
template <class D>
D* ptr(const Tensor& t) {
  return reinterpret_cast<D*>(t.data_ptr());
}

// A host value (Half, BFloat16, float, ...) as the device type with the same bits.
template <class D, class T>
D device_bits(T value) {
  static_assert(sizeof(D) == sizeof(T));
  D out;
  std::memcpy(static_cast<void*>(&out), &value, sizeof(T));
  return out;
}

// ---- math (global libdevice functions: mixtape:: declares exp/log/... for tensors) -------------------------

__device__ __forceinline__ float math_exp(float x) { return ::expf(x); }
__device__ __forceinline__ double math_exp(double x) { return ::exp(x); }
__device__ __forceinline__ float math_erfc(float x) { return ::erfcf(x); }
__device__ __forceinline__ double math_erfc(double x) { return ::erfc(x); }
__device__ __forceinline__ float math_log(float x) { return ::logf(x); }
__device__ __forceinline__ double math_log(double x) { return ::log(x); }
__device__ __forceinline__ float math_sqrt(float x) { return ::sqrtf(x); }  // IEEE (nvcc's -prec-sqrt default)
__device__ __forceinline__ double math_sqrt(double x) { return ::sqrt(x); }
__device__ __forceinline__ float math_tanh(float x) { return ::tanhf(x); }
__device__ __forceinline__ double math_tanh(double x) { return ::tanh(x); }
__device__ __forceinline__ float math_abs(float x) { return ::fabsf(x); }
__device__ __forceinline__ double math_abs(double x) { return ::fabs(x); }
// The heavy functions below are __noinline__: one copy serves every kernel (each op is instantiated per dtype,
// per loop and per vector lane), which keeps this file's compile time low; a call costs little next to them.
__device__ __noinline__ float math_pow(float x, float y) { return ::powf(x, y); }
__device__ __noinline__ double math_pow(double x, double y) { return ::pow(x, y); }

constexpr double kPi = std::numbers::pi;
constexpr double kSqrt2 = std::numbers::sqrt2;
constexpr double kInvSqrtPi = std::numbers::inv_sqrtpi;
constexpr double kInvSqrt2Pi = 0.5 * kInvSqrtPi * kSqrt2;  // 1 / sqrt(2 pi), as the CPU spells it
constexpr double kGeluTanhScale = 0.7978845608028654;    // sqrt(2 / pi)
constexpr double kGeluTanhCubic = 0.044715;

// sigmoid(z) and 1 - sigmoid(z) from e = e^-|z| in (0, 1] (no overflow, no cancellation in either tail).
template <class A>
struct Logistic {
  A s, one_minus_s;
};

template <class A>
__device__ __forceinline__ Logistic<A> logistic(A z) {
  const A e = math_exp(-math_abs(z));
  const A r = A(1) / (A(1) + e);
  if (z >= A(0)) return {r, e * r};
  return {e * r, r};
}

// x Phi(x) = 0.5 x erfc(-x / sqrt2). For float compute the CPU evaluates it in double (its own erfc, good to
// 2e-10 relative) and rounds once; double erfc here is the same function to within a double ulp.
template <class A>
__device__ __noinline__ A gelu_erf_of(A x) {
  const double xd = x;
  return static_cast<A>(0.5 * xd * ::erfc(-xd * (kSqrt2 / 2)));
}

// x Phi(x) and its derivative Phi(x) + x phi(x), phi = e^(-x^2/2) / sqrt(2 pi), evaluated in A itself: the f64
// derivative (as the CPU's template), and both for f16/bf16 storage in float (erfcf and expf are within a few
// float ulps of the double evaluation, far under the one rounding to 16 bits that follows; the double erfc
// would make a 16-bit GELU compute-bound, about ten times the time of its memory traffic).
template <class A>
__device__ __forceinline__ A gelu_erf_in(A x) {
  return A(0.5) * x * math_erfc(-x * A(kSqrt2 / 2));
}
template <class A>
__device__ __forceinline__ A gelu_erf_derivative_in(A x) {
  const A cdf = A(0.5) * math_erfc(-x * A(kSqrt2 / 2));
  const A pdf = math_exp(A(-0.5) * x * x) * A(kInvSqrt2Pi);
  return cdf + x * pdf;
}

// d/dx x Phi(x) = Phi(x) + x phi(x). Float compute: in double with phi from erfc's own Gaussian e^(-z^2),
// z = -x / sqrt2 (as the CPU's erfc_and_gaussian); f64: gelu_erf_derivative_in.
template <class A>
__device__ __noinline__ A gelu_erf_derivative(A x) {
  if constexpr (std::is_same_v<A, float>) {
    const double xd = x;
    const double z = -xd * (kSqrt2 / 2);
    const double a = z < 0 ? -z : z;
    const double erfc = ::erfc(z);
    const double gaussian = ::exp(-a * a);
    return static_cast<float>(0.5 * erfc + xd * gaussian * kInvSqrt2Pi);
  } else {
    return gelu_erf_derivative_in(x);
  }
}

// GPT-2's tanh GELU as x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3) (1 + tanh u = 2 sigmoid(2u)).
template <class A>
__device__ __forceinline__ A gelu_tanh_inner(A x) {
  return A(kGeluTanhScale) * (x + A(kGeluTanhCubic) * x * x * x);
}

template <class A>
__device__ __noinline__ A gelu_tanh_derivative(A x) {
  const Logistic<A> l = logistic(A(2) * gelu_tanh_inner(x));
  const A du = A(kGeluTanhScale) * (A(1) + A(3 * kGeluTanhCubic) * x * x);
  return l.s + A(2) * x * l.s * l.one_minus_s * du;
}

// x ^ p for a double exponent, with the CPU's exact shortcuts.
__device__ __forceinline__ double pow_scalar(double x, double p) {
  if (p == 1) return x;
  if (p == 2) return x * x;
  if (p == -1) return 1 / x;
  return math_pow(x, p);
}

// d/dx x^p = p x^(p-1); 0 for p == 0.
__device__ __forceinline__ double pow_scalar_derivative(double x, double p) {
  if (p == 0) return 0;
  if (p == 1) return 1;
  if (p == 2) return 2 * x;
  return p * math_pow(x, p - 1);
}

// ---- op functors: the math of each op, on the compute type ------------------------------------------------

struct NegOp { template <class A> __device__ A operator()(A v) const { return -v; } };
struct AbsOp { template <class A> __device__ A operator()(A v) const { return math_abs(v); } };
// v < 0 ? 0 : v lets NaN through, as on the CPU.
struct ReluOp { template <class A> __device__ A operator()(A v) const { return v < A(0) ? A(0) : v; } };
struct ExpOp { template <class A> __device__ A operator()(A v) const { return math_exp(v); } };
struct LogOp { template <class A> __device__ A operator()(A v) const { return math_log(v); } };
struct SqrtOp { template <class A> __device__ A operator()(A v) const { return math_sqrt(v); } };
// 1 / sqrt(v) with an IEEE division, not rsqrtf (which is only good to 2 ulp).
struct RsqrtOp { template <class A> __device__ A operator()(A v) const { return A(1) / math_sqrt(v); } };
struct TanhOp { template <class A> __device__ A operator()(A v) const { return math_tanh(v); } };
struct SigmoidOp { template <class A> __device__ A operator()(A v) const { return logistic(v).s; } };
struct SiluOp { template <class A> __device__ A operator()(A v) const { return v * logistic(v).s; } };
struct GeluErfOp { template <class A> __device__ A operator()(A v) const { return gelu_erf_of(v); } };
struct GeluTanhOp {
  template <class A> __device__ A operator()(A v) const { return v * logistic(A(2) * gelu_tanh_inner(v)).s; }
};
// For f16/bf16 storage the erf GELU and its derivative run in float (gelu_erf_in).
struct GeluErfFloatOp { __device__ float operator()(float v) const { return gelu_erf_in(v); } };
struct GeluErfFloatGrad {
  __device__ float operator()(float v, float g) const { return g * gelu_erf_derivative_in(v); }
};
struct PowScalarOp {  // computes in double: the exponent is never rounded to the tensor's dtype
  double p;
  __device__ double operator()(double v) const { return pow_scalar(v, p); }
};

// Backward: (v, g) -> g * op'(v), with v = x, or y = op(x) for exp, sqrt, rsqrt, tanh, sigmoid.
struct NegGrad { template <class A> __device__ A operator()(A, A g) const { return -g; } };
struct AbsGrad {  // sign(0) = 0
  template <class A> __device__ A operator()(A v, A g) const { return v > A(0) ? g : v < A(0) ? -g : A(0); }
};
struct ReluGrad { template <class A> __device__ A operator()(A v, A g) const { return v > A(0) ? g : A(0); } };
struct ExpGrad { template <class A> __device__ A operator()(A y, A g) const { return g * y; } };
struct LogGrad { template <class A> __device__ A operator()(A v, A g) const { return g / v; } };
struct SqrtGrad { template <class A> __device__ A operator()(A y, A g) const { return g / (A(2) * y); } };
struct RsqrtGrad { template <class A> __device__ A operator()(A y, A g) const { return A(-0.5) * g * y * y * y; } };
struct TanhGrad { template <class A> __device__ A operator()(A y, A g) const { return g * (A(1) - y * y); } };
struct SigmoidGrad { template <class A> __device__ A operator()(A y, A g) const { return g * y * (A(1) - y); } };
struct SiluGrad {
  template <class A> __device__ A operator()(A v, A g) const {
    const Logistic<A> l = logistic(v);
    return g * (l.s + v * l.s * l.one_minus_s);
  }
};
struct GeluErfGrad {
  template <class A> __device__ A operator()(A v, A g) const { return g * gelu_erf_derivative(v); }
};
struct GeluTanhGrad {
  template <class A> __device__ A operator()(A v, A g) const { return g * gelu_tanh_derivative(v); }
};
struct PowScalarGrad {
  double p;
  __device__ double operator()(double v, double g) const { return g * pow_scalar_derivative(v, p); }
};

struct AddOp { template <class A> __device__ A operator()(A x, A y) const { return x + y; } };
struct SubOp { template <class A> __device__ A operator()(A x, A y) const { return x - y; } };
struct MulOp { template <class A> __device__ A operator()(A x, A y) const { return x * y; } };
struct DivOp { template <class A> __device__ A operator()(A x, A y) const { return x / y; } };
struct PowOp { template <class A> __device__ A operator()(A x, A y) const { return math_pow(x, y); } };
struct EqOp { template <class A> __device__ A operator()(A x, A y) const { return x == y ? A(1) : A(0); } };

// Tensor-scalar ops, in double so the scalar is not rounded first.
struct AddScalar { double s; __device__ double operator()(double x) const { return x + s; } };
struct MulScalar { double s; __device__ double operator()(double x) const { return x * s; } };
struct SubScalar { double s; __device__ double operator()(double x) const { return x - s; } };
struct ScalarSub { double s; __device__ double operator()(double x) const { return s - x; } };
struct DivScalar { double s; __device__ double operator()(double x) const { return x / s; } };
struct ScalarDiv { double s; __device__ double operator()(double x) const { return s / x; } };
struct PowScalarExponent { double s; __device__ double operator()(double x) const { return pow_scalar(x, s); } };
struct ScalarPow { double s; __device__ double operator()(double x) const { return math_pow(s, x); } };

// ---- the two loops ----------------------------------------------------------------------------------------

template <class T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

template <int V, class T>
__device__ __forceinline__ Vec<T, V> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, V>*>(p);
}
template <int V, class T>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, V>& value) {
  *reinterpret_cast<Vec<T, V>*>(p) = value;
}

// How many elements of the widest operand fill 16 bytes.
template <class... T>
inline constexpr int kVecOf = static_cast<int>(16 / std::max({sizeof(T)...}));

__device__ __forceinline__ int64_t thread_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t thread_count() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// A functor F over N operands provides
//   static constexpr int kVec;                       elements per group
//   void element(const int64_t (&at)[N]) const;      one element, operand k at offset at[k]
//   void group(int64_t first) const;                 elements [first, first + kVec) of contiguous operands,
//                                                    every pointer aligned to kVec elements
// One kernel holds both loops (the branch is uniform): half the kernels to compile of two separate ones.
template <int N, class F>
__global__ void elementwise_kernel(int64_t n, bool contiguous, bool vectorized, OffsetCalculator<N> calc, F f) {
  if (contiguous) {
    constexpr int V = F::kVec;
    const int64_t groups = vectorized ? n / V : 0;
    for (int64_t g = thread_index(); g < groups; g += thread_count()) f.group(g * V);
    for (int64_t i = groups * V + thread_index(); i < n; i += thread_count()) {
      int64_t at[N];
#pragma unroll
      for (int k = 0; k < N; ++k) at[k] = i;
      f.element(at);
    }
  } else {
    for (int64_t i = thread_index(); i < n; i += thread_count()) {
      int64_t at[N];
      calc.offsets(i, at);
      f.element(at);
    }
  }
}

// Runs f over operands[0]'s shape (every operand has that shape; operand 0 is the output).
template <int N, class F>
void launch(cudaStream_t stream, const char* what, const std::array<const Tensor*, N>& operands, const F& f) {
  const Shape& shape = operands[0]->shape();
  const int64_t n = shape_numel(shape);
  if (n == 0) return;
  std::array<Strides, N> strides;
  for (int k = 0; k < N; ++k) strides[k] = operands[k]->strides();
  const OffsetCalculator<N> calc = make_offset_calculator<N>(shape, strides, what);
  // Contiguous: one coalesced dim of stride 1 in every operand, so operand k's offset is the index itself.
  bool contiguous = calc.dims == 1;
  for (int k = 0; k < N; ++k) contiguous = contiguous && calc.strides[k][0] == 1;
  bool vectorized = contiguous && F::kVec > 1;
  for (int k = 0; k < N; ++k) {
    const auto address = reinterpret_cast<uintptr_t>(operands[k]->data_ptr());
    vectorized = vectorized && address % (static_cast<uintptr_t>(F::kVec) * dtype_size(operands[k]->dtype())) == 0;
  }
  const int64_t work = vectorized ? (n + F::kVec - 1) / F::kVec : n;
  elementwise_kernel<N, F><<<blocks_for(work), kThreads, 0, stream>>>(n, contiguous, vectorized, calc, f);
  MIXTAPE_KERNEL_CHECK();
}

// ---- functors ---------------------------------------------------------------------------------------------

// out = op(x) computed in C, operands of device type D.
template <class D, class C, class Op>
struct MapUnary {
  static constexpr int kVec = kVecOf<D>;
  D* out;
  const D* x;
  Op op;
  __device__ D apply(D v) const { return convert_to<D>(op(convert_to<C>(v))); }
  __device__ void element(const int64_t (&at)[2]) const { out[at[0]] = apply(x[at[1]]); }
  __device__ void group(int64_t first) const {
    const Vec<D, kVec> in = load_vec<kVec>(x + first);
    Vec<D, kVec> result;
#pragma unroll
    for (int j = 0; j < kVec; ++j) result.v[j] = apply(in.v[j]);
    store_vec<kVec>(out + first, result);
  }
};

// out = op(a, b) computed in C.
template <class D, class C, class Op>
struct MapBinary {
  static constexpr int kVec = kVecOf<D>;
  D* out;
  const D* a;
  const D* b;
  Op op;
  __device__ D apply(D x, D y) const { return convert_to<D>(op(convert_to<C>(x), convert_to<C>(y))); }
  __device__ void element(const int64_t (&at)[3]) const { out[at[0]] = apply(a[at[1]], b[at[2]]); }
  __device__ void group(int64_t first) const {
    const Vec<D, kVec> x = load_vec<kVec>(a + first), y = load_vec<kVec>(b + first);
    Vec<D, kVec> result;
#pragma unroll
    for (int j = 0; j < kVec; ++j) result.v[j] = apply(x.v[j], y.v[j]);
    store_vec<kVec>(out + first, result);
  }
};

template <class To, class From>
struct CopyFn {
  static constexpr int kVec = kVecOf<To, From>;
  To* out;
  const From* in;
  __device__ void element(const int64_t (&at)[2]) const { out[at[0]] = convert_to<To>(in[at[1]]); }
  __device__ void group(int64_t first) const {
    const Vec<From, kVec> x = load_vec<kVec>(in + first);
    Vec<To, kVec> result;
#pragma unroll
    for (int j = 0; j < kVec; ++j) result.v[j] = convert_to<To>(x.v[j]);
    store_vec<kVec>(out + first, result);
  }
};

// Raw element bits: fill and where move values without looking at them.
template <int Bytes> struct bits_type;
template <> struct bits_type<2> { using type = uint16_t; };
template <> struct bits_type<4> { using type = uint32_t; };
template <> struct bits_type<8> { using type = uint64_t; };

template <class Bits>
struct FillFn {
  static constexpr int kVec = kVecOf<Bits>;
  Bits* out;
  Bits value;
  __device__ void element(const int64_t (&at)[1]) const { out[at[0]] = value; }
  __device__ void group(int64_t first) const {
    Vec<Bits, kVec> result;
#pragma unroll
    for (int j = 0; j < kVec; ++j) result.v[j] = value;
    store_vec<kVec>(out + first, result);
  }
};

// out = cond != 0 ? a : b. A condition is true when its bits under `truth_mask` are nonzero: all bits for an
// integer, all but the sign for a float (so -0 is false and NaN is true, as the CPU's c != 0 in float).
template <class CondBits, class Bits>
struct WhereFn {
  static constexpr int kVec = 1;
  Bits* out;
  const CondBits* cond;
  const Bits* a;
  const Bits* b;
  CondBits truth_mask;
  __device__ void element(const int64_t (&at)[4]) const {
    out[at[0]] = (cond[at[1]] & truth_mask) != 0 ? a[at[2]] : b[at[3]];
  }
  __device__ void group(int64_t first) const {
    out[first] = (cond[first] & truth_mask) != 0 ? a[first] : b[first];
  }
};

// dst += alpha * src in C (double when either side is f64, else float), rounded once into dst's type.
template <class DT, class DS, class C>
struct AddInplaceFn {
  static constexpr int kVec = kVecOf<DT, DS>;
  DT* dst;
  const DS* src;
  C scale;
  __device__ DT apply(DT d, DS s) const { return convert_to<DT>(convert_to<C>(d) + scale * convert_to<C>(s)); }
  __device__ void element(const int64_t (&at)[2]) const { dst[at[0]] = apply(dst[at[0]], src[at[1]]); }
  __device__ void group(int64_t first) const {
    Vec<DT, kVec> d = load_vec<kVec>(dst + first);
    const Vec<DS, kVec> s = load_vec<kVec>(src + first);
#pragma unroll
    for (int j = 0; j < kVec; ++j) d.v[j] = apply(d.v[j], s.v[j]);
    store_vec<kVec>(dst + first, d);
  }
};

// Dropout on a contiguous out (so operand 0's offset is the row-major index i): keep iff
// uniform_from_bits(philox(offset + i, key = seed)[0]) >= threshold, kept values scaled in A.
template <class D>
struct DropoutFn {
  using A = device_acc_t<D>;
  static constexpr int kVec = kVecOf<D>;
  D* out;
  const D* x;
  uint64_t seed, offset;
  float threshold;
  A scale;
  __device__ D apply(int64_t i, D v) const {
    const float u = uniform_from_bits(philox4x32(offset + static_cast<uint64_t>(i), 0, seed)[0]);
    return convert_to<D>(u >= threshold ? convert_to<A>(v) * scale : A(0));
  }
  __device__ void element(const int64_t (&at)[2]) const { out[at[0]] = apply(at[0], x[at[1]]); }
  __device__ void group(int64_t first) const {
    const Vec<D, kVec> in = load_vec<kVec>(x + first);
    Vec<D, kVec> result;
#pragma unroll
    for (int j = 0; j < kVec; ++j) result.v[j] = apply(first + j, in.v[j]);
    store_vec<kVec>(out + first, result);
  }
};

// Writes draw(i) into element i of a contiguous output (random draws, arange).
template <class D, class Draw>
struct GenerateFn {
  static constexpr int kVec = 1;
  D* out;
  Draw draw;
  __device__ void element(const int64_t (&at)[1]) const { out[at[0]] = draw(at[0]); }
  __device__ void group(int64_t first) const { out[first] = draw(first); }
};

// ---- random draws: cpu_backend.cpp's formulas, element i from the Philox block of counter offset + i -----

template <class D>
struct UniformDraw {
  uint64_t seed, offset;
  double low, high;
  D largest_below_high;  // what a draw that rounded up to `high` becomes
  __device__ D operator()(int64_t i) const {
    const auto r = philox4x32(offset + static_cast<uint64_t>(i), 0, seed);
    const double u = std::is_same_v<D, double> ? uniform_double_from_bits(r[0], r[1])
                                               : static_cast<double>(uniform_from_bits(r[0]));
    const D value = convert_to<D>(low + (high - low) * u);
    return convert_to<double>(value) < high ? value : largest_below_high;
  }
};

template <class D>
struct NormalDraw {
  uint64_t seed, offset;
  double mean, std;
  __device__ D operator()(int64_t i) const {
    const auto r = philox4x32(offset + static_cast<uint64_t>(i), 0, seed);
    // Box-Muller on u1 in (0, 1] and u2 in [0, 1), in double.
    const double u1 = 1.0 - uniform_double_from_bits(r[0], r[1]);
    const double u2 = uniform_double_from_bits(r[2], r[3]);
    const double z = ::sqrt(-2.0 * ::log(u1)) * ::cos(2.0 * kPi * u2);
    return convert_to<D>(mean + std * z);
  }
};

template <class D>
struct RandintDraw {
  uint64_t seed, offset;
  uint64_t low, range;  // uint64 arithmetic: ranges wider than 2^63 overflow int64
  __device__ D operator()(int64_t i) const {
    const auto r = philox4x32(offset + static_cast<uint64_t>(i), 0, seed);
    // 64 random bits reduced by multiply-high, as the CPU's 128-bit product.
    const uint64_t bits = static_cast<uint64_t>(r[0]) << 32 | r[1];
    const uint64_t pick = __umul64hi(bits, range);
    return convert_to<D>(static_cast<int64_t>(low + pick));
  }
};

template <class D>
struct ArangeDraw {
  double start, step;
  __device__ D operator()(int64_t i) const { return convert_to<D>(start + static_cast<double>(i) * step); }
};

template <class D, class C, class Op>
void run_unary(cudaStream_t stream, const char* what, const Tensor& x, const Tensor& out, Op op) {
  launch<2>(stream, what, {&out, &x}, MapUnary<D, C, Op>{ptr<D>(out), ptr<const D>(x), op});
}

template <class D, class C, class Op>
void run_binary(cudaStream_t stream, const char* what, const Tensor& a, const Tensor& b, const Tensor& out, Op op) {
  launch<3>(stream, what, {&out, &a, &b}, MapBinary<D, C, Op>{ptr<D>(out), ptr<const D>(a), ptr<const D>(b), op});
}

template <class Draw>
void run_generate(cudaStream_t stream, const char* what, const Tensor& dst, const Draw& draw) {
  using D = decltype(draw(int64_t{0}));
  launch<1>(stream, what, {&dst}, GenerateFn<D, Draw>{ptr<D>(dst), draw});
}

}  // namespace

// ---- copy, fill, arange -----------------------------------------------------------------------------------

void CudaBackend::copy_kernel(const Tensor& src, const Tensor& dst) {
  if (src.dtype() == dst.dtype() && src.is_contiguous() && dst.is_contiguous()) {
    const size_t nbytes = static_cast<size_t>(dst.numel()) * dtype_size(dst.dtype());
    if (nbytes == 0 || src.data_ptr() == dst.data_ptr()) return;
    MIXTAPE_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), nbytes, cudaMemcpyDeviceToDevice, stream()));
    return;
  }
  const cudaStream_t s = stream();
  dispatch_all(dst.dtype(), "copy", [&]<typename To>() {
    dispatch_all(src.dtype(), "copy", [&]<typename From>() {
      using DTo = device_t<To>;
      using DFrom = device_t<From>;
      launch<2>(s, "copy", {&dst, &src}, CopyFn<DTo, DFrom>{ptr<DTo>(dst), ptr<const DFrom>(src)});
    });
  });
}

void CudaBackend::fill(const Tensor& dst, double value) {
  const cudaStream_t s = stream();
  dispatch_all(dst.dtype(), "fill", [&]<typename T>() {
    using Bits = typename bits_type<sizeof(T)>::type;
    const Bits bits = device_bits<Bits>(convert<T>(value));  // rounded on the host, as the CPU does
    launch<1>(s, "fill", {&dst}, FillFn<Bits>{ptr<Bits>(dst), bits});
  });
}

void CudaBackend::arange_kernel(const Tensor& dst, double start, double step) {
  const cudaStream_t s = stream();
  dispatch_all(dst.dtype(), "arange", [&]<typename T>() {
    run_generate(s, "arange", dst, ArangeDraw<device_t<T>>{start, step});
  });
}

// ---- random -----------------------------------------------------------------------------------------------

void CudaBackend::uniform_kernel(const Tensor& dst, uint64_t seed, uint64_t offset, double low, double high) {
  const cudaStream_t s = stream();
  dispatch_all(dst.dtype(), "uniform", [&]<typename T>() {
    using D = device_t<T>;
    run_generate(s, "uniform", dst, UniformDraw<D>{seed, offset, low, high, device_bits<D>(largest_below<T>(high))});
  });
}

void CudaBackend::normal_kernel(const Tensor& dst, uint64_t seed, uint64_t offset, double mean, double std) {
  const cudaStream_t s = stream();
  dispatch_all(dst.dtype(), "normal", [&]<typename T>() {
    run_generate(s, "normal", dst, NormalDraw<device_t<T>>{seed, offset, mean, std});
  });
}

void CudaBackend::randint_kernel(const Tensor& dst, uint64_t seed, uint64_t offset, int64_t low, int64_t high) {
  const uint64_t range = static_cast<uint64_t>(high) - static_cast<uint64_t>(low);
  const cudaStream_t s = stream();
  dispatch_all(dst.dtype(), "randint", [&]<typename T>() {
    run_generate(s, "randint", dst, RandintDraw<device_t<T>>{seed, offset, static_cast<uint64_t>(low), range});
  });
}

// ---- unary ------------------------------------------------------------------------------------------------

// The switches below have a case for every row of kUnaryOps (tensor/unary_ops.h), forward and backward; a new
// op fails to build here until it has its kernels.
static_assert(static_cast<int>(UnaryOp::Count) == 13, "a new UnaryOp needs its unary and unary_backward cases");

void CudaBackend::unary_kernel(UnaryOp op, const Tensor& x, const Tensor& out, double scalar) {
  const cudaStream_t s = stream();
  dispatch_float(out.dtype(), "unary", [&]<typename T>() {
    using D = device_t<T>;
    using A = device_acc_t<D>;
    auto run = [&](auto f) { run_unary<D, A>(s, "unary", x, out, f); };
    switch (op) {
      case UnaryOp::Neg: return run(NegOp{});
      case UnaryOp::Abs: return run(AbsOp{});
      case UnaryOp::Relu: return run(ReluOp{});
      case UnaryOp::Exp: return run(ExpOp{});
      case UnaryOp::Log: return run(LogOp{});
      case UnaryOp::Sqrt: return run(SqrtOp{});
      case UnaryOp::Rsqrt: return run(RsqrtOp{});
      case UnaryOp::Tanh: return run(TanhOp{});
      case UnaryOp::Sigmoid: return run(SigmoidOp{});
      case UnaryOp::Silu: return run(SiluOp{});
      case UnaryOp::GeluErf:
        if constexpr (sizeof(D) == 2) return run(GeluErfFloatOp{});
        else return run(GeluErfOp{});
      case UnaryOp::GeluTanh: return run(GeluTanhOp{});
      case UnaryOp::PowScalar: return run_unary<D, double>(s, "unary", x, out, PowScalarOp{scalar});
      case UnaryOp::Count: break;  // not an op
    }
    fail("unary: unknown op ", static_cast<int>(op));
  });
}

// grad_x = grad_out * op'(v), v = `in`: x, or y = op(x) where kUnaryOps says the derivative reads the output.
void CudaBackend::unary_backward_kernel(UnaryOp op, const Tensor& in, const Tensor& grad_out, const Tensor& grad_x,
                                        double scalar) {
  const cudaStream_t s = stream();
  dispatch_float(grad_x.dtype(), "unary_backward", [&]<typename T>() {
    using D = device_t<T>;
    using A = device_acc_t<D>;
    auto run = [&](auto f) { run_binary<D, A>(s, "unary_backward", in, grad_out, grad_x, f); };
    switch (op) {
      case UnaryOp::Neg: return run(NegGrad{});
      case UnaryOp::Abs: return run(AbsGrad{});
      case UnaryOp::Relu: return run(ReluGrad{});
      case UnaryOp::Exp: return run(ExpGrad{});
      case UnaryOp::Log: return run(LogGrad{});
      case UnaryOp::Sqrt: return run(SqrtGrad{});
      case UnaryOp::Rsqrt: return run(RsqrtGrad{});
      case UnaryOp::Tanh: return run(TanhGrad{});
      case UnaryOp::Sigmoid: return run(SigmoidGrad{});
      case UnaryOp::Silu: return run(SiluGrad{});
      case UnaryOp::GeluErf:
        if constexpr (sizeof(D) == 2) return run(GeluErfFloatGrad{});
        else return run(GeluErfGrad{});
      case UnaryOp::GeluTanh: return run(GeluTanhGrad{});
      case UnaryOp::PowScalar:
        return run_binary<D, double>(s, "unary_backward", in, grad_out, grad_x, PowScalarGrad{scalar});
      case UnaryOp::Count: break;  // not an op
    }
    fail("unary_backward: unknown op ", static_cast<int>(op));
  });
}

// ---- binary -----------------------------------------------------------------------------------------------

void CudaBackend::binary_kernel(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  const cudaStream_t s = stream();
  dispatch_float(out.dtype(), "binary", [&]<typename T>() {
    using D = device_t<T>;
    using A = device_acc_t<D>;
    auto run = [&](auto f) { run_binary<D, A>(s, "binary", a, b, out, f); };
    switch (op) {
      case BinaryOp::Add: return run(AddOp{});
      case BinaryOp::Sub: return run(SubOp{});
      case BinaryOp::Mul: return run(MulOp{});
      case BinaryOp::Div: return run(DivOp{});
      case BinaryOp::Pow: return run(PowOp{});
      case BinaryOp::Eq: return run(EqOp{});
    }
    fail("binary: unknown op ", static_cast<int>(op));
  });
}

void CudaBackend::binary_scalar_kernel(BinaryOp op, const Tensor& a, double scalar, bool scalar_first,
                                       const Tensor& out) {
  const cudaStream_t s = stream();
  dispatch_float(out.dtype(), "binary_scalar", [&]<typename T>() {
    using D = device_t<T>;
    auto run = [&](auto f) { run_unary<D, double>(s, "binary_scalar", a, out, f); };
    switch (op) {
      case BinaryOp::Add: return run(AddScalar{scalar});
      case BinaryOp::Mul: return run(MulScalar{scalar});
      case BinaryOp::Sub: return scalar_first ? run(ScalarSub{scalar}) : run(SubScalar{scalar});
      case BinaryOp::Div: return scalar_first ? run(ScalarDiv{scalar}) : run(DivScalar{scalar});
      case BinaryOp::Pow: return scalar_first ? run(ScalarPow{scalar}) : run(PowScalarExponent{scalar});
      case BinaryOp::Eq: break;  // no scalar form: Backend::binary_scalar rejects it
    }
  });
}

// ---- where ------------------------------------------------------------------------------------------------

void CudaBackend::where_kernel(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) {
  const cudaStream_t s = stream();
  dispatch_all(cond.dtype(), "where", [&]<typename Cond>() {
    dispatch_all(out.dtype(), "where", [&]<typename T>() {
      using CondBits = typename bits_type<sizeof(Cond)>::type;
      using Bits = typename bits_type<sizeof(T)>::type;
      constexpr CondBits kSign = CondBits{1} << (8 * sizeof(Cond) - 1);
      const CondBits mask =
          is_floating(cond.dtype()) ? static_cast<CondBits>(~kSign) : static_cast<CondBits>(~CondBits{0});
      launch<4>(s, "where", {&out, &cond, &a, &b},
                WhereFn<CondBits, Bits>{ptr<Bits>(out), ptr<const CondBits>(cond), ptr<const Bits>(a),
                                        ptr<const Bits>(b), mask});
    });
  });
}

// ---- in place ---------------------------------------------------------------------------------------------

void CudaBackend::add_inplace_kernel(const Tensor& dst, const Tensor& src, double alpha) {
  const cudaStream_t s = stream();
  dispatch_float(dst.dtype(), "add_inplace", [&]<typename T>() {
    dispatch_float(src.dtype(), "add_inplace", [&]<typename S>() {
      using C = std::conditional_t<std::is_same_v<T, double> || std::is_same_v<S, double>, double, float>;
      using DT = device_t<T>;
      using DS = device_t<S>;
      launch<2>(s, "add_inplace", {&dst, &src},
                AddInplaceFn<DT, DS, C>{ptr<DT>(dst), ptr<const DS>(src), static_cast<C>(alpha)});
    });
  });
}

void CudaBackend::mul_scalar_inplace(const Tensor& dst, double value) {
  // binary_scalar Mul reading and writing dst: each element is read by the thread that writes it.
  binary_scalar(BinaryOp::Mul, dst, value, false, dst);
}

// ---- dropout ----------------------------------------------------------------------------------------------

void CudaBackend::dropout_kernel(const Tensor& x, double p, uint64_t seed, uint64_t offset, const Tensor& out) {
  // u is a multiple of 2^-24, so u >= p iff u >= the smallest multiple of 2^-24 that is >= p (exact in float).
  const float threshold = static_cast<float>(std::ceil(p * 0x1p24) * 0x1p-24);
  const cudaStream_t s = stream();
  dispatch_float(x.dtype(), "dropout", [&]<typename T>() {
    using D = device_t<T>;
    using A = device_acc_t<D>;
    launch<2>(s, "dropout", {&out, &x},
              DropoutFn<D>{ptr<D>(out), ptr<const D>(x), seed, offset, threshold, static_cast<A>(1.0 / (1.0 - p))});
  });
}

}  // namespace mixtape::cuda
