// CPU elementwise kernels: unary maps and their backward, binary ops with broadcasting, where, and the two
// in-place updates. Every kernel is one loop over StridedLoop runs with the math in a small lambda:
//
//   out[i] = convert<T>( f( convert<C>(in[i]) ) )
//
// where C is the compute type (float for f32/f16/bf16, double for f64; double for ops with a double scalar)
// and convert<T> rounds once on store. Each loop has a contiguous fast path (every inner stride 1) that the
// compiler vectorises for f32/f64, a path for an operand broadcast along the inner dim (stride 0, e.g. a
// per-row scale), and a general strided path.
#include <algorithm>
#include <cmath>
#include <numbers>
#include <type_traits>
#include <vector>

#include "tensor/cpu/convert_block.h"
#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/fast_math.h"
#include "tensor/cpu/strided.h"

namespace mixtape::cpu {

namespace {

// Transcendental ops cost tens of cycles per element, so they are worth two threads at smaller sizes than
// a memory-bound add.
constexpr int64_t kTranscendentalGrain = 4096;

// 16-bit operands of a contiguous run are widened into a float block, f runs over floats (a loop the
// compiler vectorises, as for f32), and the block is rounded back once: converting element by element
// inside f's loop would keep the loop scalar.
constexpr int64_t kBlock = 256;

// out = f(x) elementwise; x and out are T, f computes in C. The run lambdas are flattened (f and everything
// it calls inlined) so the contiguous loops vectorise even for a long f such as gelu.
template <class T, class C, class F>
void map_unary(const Tensor& x, const Tensor& out, int64_t grain, F f) {
  const T* in = x.data<T>();
  T* o = out.data<T>();
  const StridedLoop<2> loop(out.shape(), {out.strides(), x.strides()});
  const auto [so, si] = loop.inner_strides();
  loop.run([&](const std::array<int64_t, 2>& at, int64_t n) __attribute__((flatten)) {
    T* dst = o + at[0];
    const T* src = in + at[1];
    if constexpr (kSixteenBit<T> && std::is_same_v<C, float>) {
      if (so == 1 && si == 1) {
        alignas(64) float in_block[kBlock], out_block[kBlock];
        for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
          const int64_t m = std::min(kBlock, n - j0);
          widen_block(src + j0, in_block, m);
          for (int64_t j = 0; j < m; ++j) out_block[j] = f(in_block[j]);
          narrow_block(out_block, dst + j0, m);
        }
        return;
      }
    }
    if (so == 1 && si == 1) {
      for (int64_t j = 0; j < n; ++j) dst[j] = convert<T>(f(convert<C>(src[j])));
    } else {
      for (int64_t j = 0; j < n; ++j) dst[j * so] = convert<T>(f(convert<C>(src[j * si])));
    }
  }, grain);
}

// The n values at src as floats: src itself for float, else widened (exactly) into buffer.
template <class T>
const float* as_floats(const T* src, float* buffer, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    widen_block(src, buffer, n);
    return buffer;
  }
}

// out = f(a, b) elementwise, a, b already broadcast to out's shape; f computes in C. a, b and out have one
// dtype, or (Backend::binary_reads_mixed) an f32 out takes f16/bf16 inputs as they are: widening is exact,
// so out holds the bits f gives on an f32 copy of them; or (add_inplace) out is a itself and b has any float
// dtype. Contiguous runs with a 16-bit side compute in blocks of floats: 16-bit inputs widened a block at a
// time, a 16-bit out narrowed from the block.
template <class TO, class TA, class TB, class C, class F>
void map_binary_of(const Tensor& a, const Tensor& b, const Tensor& out, int64_t grain, F f) {
  const TA* pa = a.data<TA>();
  const TB* pb = b.data<TB>();
  TO* po = out.data<TO>();
  const StridedLoop<3> loop(out.shape(), {out.strides(), a.strides(), b.strides()});
  const auto [so, sa, sb] = loop.inner_strides();
  loop.run([&](const std::array<int64_t, 3>& at, int64_t n) __attribute__((flatten)) {
    TO* dst = po + at[0];
    const TA* x = pa + at[1];
    const TB* y = pb + at[2];
    if constexpr ((kSixteenBit<TO> || kSixteenBit<TA> || kSixteenBit<TB>) && std::is_same_v<C, float>) {
      if (so == 1 && sa == 1 && sb == 1) {
        alignas(64) float x_block[kBlock], y_block[kBlock], out_block[kSixteenBit<TO> ? kBlock : 1];
        for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
          const int64_t m = std::min(kBlock, n - j0);
          const float* xs = as_floats(x + j0, x_block, m);
          const float* ys = as_floats(y + j0, y_block, m);
          if constexpr (kSixteenBit<TO>) {
            for (int64_t j = 0; j < m; ++j) out_block[j] = f(xs[j], ys[j]);
            narrow_block(out_block, dst + j0, m);
          } else {
            for (int64_t j = 0; j < m; ++j) dst[j0 + j] = f(xs[j], ys[j]);
          }
        }
        return;
      }
    }
    if (so == 1 && sa == 1 && sb == 1) {
      for (int64_t j = 0; j < n; ++j) dst[j] = convert<TO>(f(convert<C>(x[j]), convert<C>(y[j])));
    } else if (so == 1 && sa == 1 && sb == 0) {  // b is one value along this run
      const C y0 = convert<C>(y[0]);
      for (int64_t j = 0; j < n; ++j) dst[j] = convert<TO>(f(convert<C>(x[j]), y0));
    } else if (so == 1 && sa == 0 && sb == 1) {  // a is one value along this run
      const C x0 = convert<C>(x[0]);
      for (int64_t j = 0; j < n; ++j) dst[j] = convert<TO>(f(x0, convert<C>(y[j])));
    } else {
      for (int64_t j = 0; j < n; ++j)
        dst[j * so] = convert<TO>(f(convert<C>(x[j * sa]), convert<C>(y[j * sb])));
    }
  }, grain);
}

// out = f(a, b) with a, b and out all T.
template <class T, class C, class F>
void map_binary(const Tensor& a, const Tensor& b, const Tensor& out, int64_t grain, F f) {
  map_binary_of<T, T, T, C>(a, b, out, grain, f);
}

// ---- the math of each op ---------------------------------------------------------------------------------
// A is the compute type. Formulas are chosen to avoid cancellation where the textbook form has it.

// sigmoid(z) = 1 / (1 + e^-z) and 1 - sigmoid(z), both from e = e^-|z| in (0, 1], which never overflows:
// for z < 0, sigmoid(z) = e / (1 + e). Each side keeps full relative accuracy, also deep in the tails where
// 1 / (1 + e^-z) would overflow to 0 (z < -88 in float) and 1 - sigmoid(z) would cancel.
template <class A>
struct Logistic {
  A s, one_minus_s;
};

template <class A>
Logistic<A> logistic(A z) {
  const A e = std::exp(-std::abs(z));
  const A r = A(1) / (A(1) + e);
  if (z >= A(0)) return {r, e * r};
  return {e * r, r};
}

template <class A>
A sigmoid_of(A z) {
  return logistic(z).s;
}

// Exact GELU, x * Phi(x) with Phi the standard normal CDF: Phi(x) = (1 + erf(x/sqrt2)) / 2
// = erfc(-x/sqrt2) / 2. The erfc form is the same function without the cancellation of 1 + erf(z) for
// z << 0: at x = -5 the erf form keeps only ~3 of float's 24 bits, and below about x = -5.5 it returns 0
// instead of a tiny negative value.
template <class A>
A gelu_erf_of(A x) {
  return A(0.5) * x * std::erfc(-x * A(std::numbers::sqrt2 / 2));
}

// float compute (f32, f16, bf16): the same formula in double through the vectorisable erfc_of_float, rounded
// once. x / sqrt2 is not rounded to float first, which also removes that rounding's cond(x) ulps.
[[gnu::always_inline]] inline float gelu_erf_of(float x) {
  const double xd = x;
  return static_cast<float>(0.5 * xd * erfc_of_float(-xd * (std::numbers::sqrt2 / 2)));
}

// GPT-2's tanh approximation 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3). Evaluated as
// x * sigmoid(2u), using 1 + tanh(u) = 2 sigmoid(2u): the same function, but without the cancellation of
// 1 + tanh(u) for u << 0.
constexpr double kGeluTanhScale = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kGeluTanhCubic = 0.044715;

template <class A>
A gelu_tanh_inner(A x) {
  return A(kGeluTanhScale) * (x + A(kGeluTanhCubic) * x * x * x);
}

template <class A>
A gelu_tanh_of(A x) {
  return x * sigmoid_of(A(2) * gelu_tanh_inner(x));
}

// d/dx of 0.5 x (1 + tanh u) = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) u'. With s = sigmoid(2u):
// 1 + tanh u = 2s and 1 - tanh^2 u = 4 s (1 - s), so it is s + 2 x s (1 - s) u', u' = sqrt(2/pi)(1 + 3c x^2).
template <class A>
A gelu_tanh_derivative(A x) {
  const auto [s, one_minus_s] = logistic(A(2) * gelu_tanh_inner(x));
  const A du = A(kGeluTanhScale) * (A(1) + A(3 * kGeluTanhCubic) * x * x);
  return s + A(2) * x * s * one_minus_s * du;
}

// d/dx x Phi(x) = Phi(x) + x phi(x), phi(x) = e^(-x^2/2) / sqrt(2 pi).
template <class A>
A gelu_erf_derivative(A x) {
  const A cdf = A(0.5) * std::erfc(-x * A(std::numbers::sqrt2 / 2));
  const A pdf = std::exp(A(-0.5) * x * x) * A(0.5 * std::numbers::inv_sqrtpi * std::numbers::sqrt2);
  return cdf + x * pdf;
}

[[gnu::always_inline]] inline float gelu_erf_derivative(float x) {
  // phi(x) = e^(-x^2/2) / sqrt(2 pi) = e^(-z^2) / sqrt(2 pi) with z = -x / sqrt2: erfc's own Gaussian.
  const double xd = x;
  const auto [erfc, gaussian] = erfc_and_gaussian(-xd * (std::numbers::sqrt2 / 2));
  constexpr double kInvSqrt2Pi = 0.5 * std::numbers::inv_sqrtpi * std::numbers::sqrt2;
  return static_cast<float>(0.5 * erfc + xd * gaussian * kInvSqrt2Pi);
}

// d/dx x sigmoid(x) = s + x s (1 - s).
template <class A>
A silu_derivative(A x) {
  const auto [s, one_minus_s] = logistic(x);
  return s + x * s * one_minus_s;
}

// x ^ p for a double exponent, in double. The exponents models use most take exact shortcuts that agree
// with IEEE pow (x*x is correctly rounded, as is pow(x, 2)).
inline double pow_scalar(double x, double p) {
  if (p == 1) return x;
  if (p == 2) return x * x;
  if (p == -1) return 1 / x;
  return std::pow(x, p);
}

// d/dx x^p = p x^(p-1); 0 for p == 0 (x^0 is the constant 1, even at x = 0 where 0 * 0^-1 would be NaN).
inline double pow_scalar_derivative(double x, double p) {
  if (p == 0) return 0;
  if (p == 1) return 1;
  if (p == 2) return 2 * x;
  return p * std::pow(x, p - 1);
}

// ---- 16-bit lookup tables --------------------------------------------------------------------------------
// An f16 or bf16 input has only 65,536 values, so a transcendental op of x alone (exp, log, tanh, sigmoid,
// silu, both gelus) on a 16-bit tensor reads its result from a table: the kernel's own formula evaluated once
// per process on every bit pattern (the same float code as the elementwise path, so the same bits), then one
// load per element instead of a double-precision erfc per element. The backward's derivative table holds
// f'(x) as the float the formula gives; the gradient is then g * f'(x) rounded once, as without the table.

// One table per (dtype, formula): a function-local static of this instantiation (each lambda is a type).
template <class T, class Out, class F>
const Out* table_of(F f) {
  static const std::vector<Out> table = [&] {
    std::vector<Out> t(65536);
#pragma omp parallel for schedule(static)
    for (int64_t bits = 0; bits < 65536; ++bits) {
      const float v = convert<float>(T::from_bits(static_cast<uint16_t>(bits)));
      if constexpr (std::is_same_v<Out, uint16_t>)
        t[static_cast<size_t>(bits)] = convert<T>(f(v)).bits;
      else
        t[static_cast<size_t>(bits)] = f(v);
    }
    return t;
  }();
  return table.data();
}

// out = f(x) through f's table.
template <class T, class F>
void map_unary_table(const Tensor& x, const Tensor& out, F f) {
  const uint16_t* table = table_of<T, uint16_t>(f);
  const T* in = x.data<T>();
  T* o = out.data<T>();
  const StridedLoop<2> loop(out.shape(), {out.strides(), x.strides()});
  const auto [so, si] = loop.inner_strides();
  loop.run([&](const std::array<int64_t, 2>& at, int64_t n) {
    T* dst = o + at[0];
    const T* src = in + at[1];
    for (int64_t j = 0; j < n; ++j) dst[j * so].bits = table[src[j * si].bits];
  });
}

// grad_x = grad_out * f'(x) with f' from its table, computed in float and rounded once.
template <class T, class F>
void map_derivative_table(const Tensor& x, const Tensor& grad_out, const Tensor& grad_x, F derivative) {
  const float* table = table_of<T, float>(derivative);
  const T* px = x.data<T>();
  const T* pg = grad_out.data<T>();
  T* po = grad_x.data<T>();
  const StridedLoop<3> loop(grad_x.shape(), {grad_x.strides(), x.strides(), grad_out.strides()});
  const auto [so, sx, sg] = loop.inner_strides();
  loop.run([&](const std::array<int64_t, 3>& at, int64_t n) {
    T* dst = po + at[0];
    const T* xs = px + at[1];
    const T* gs = pg + at[2];
    if (so == 1 && sx == 1 && sg == 1) {
      alignas(64) float g_block[kBlock], out_block[kBlock];
      for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
        const int64_t m = std::min(kBlock, n - j0);
        widen_block(gs + j0, g_block, m);
        for (int64_t j = 0; j < m; ++j) out_block[j] = g_block[j] * table[xs[j0 + j].bits];
        narrow_block(out_block, dst + j0, m);
      }
      return;
    }
    for (int64_t j = 0; j < n; ++j)
      dst[j * so] = convert<T>(convert<float>(gs[j * sg]) * table[xs[j * sx].bits]);
  });
}

}  // namespace

// ---- unary -----------------------------------------------------------------------------------------------

// The switches below have a case for every row of kUnaryOps (tensor/unary_ops.h), forward and backward; a new
// op fails to build here until it has its kernels.
static_assert(static_cast<int>(UnaryOp::Count) == 13, "a new UnaryOp needs its unary and unary_backward cases");

void CpuBackend::unary_kernel(UnaryOp op, const Tensor& x, const Tensor& out, double scalar) {
  dispatch_float(out.dtype(), "unary", [&]<typename T>() {
    using A = acc_t<T>;
    const int64_t heavy = kTranscendentalGrain, light = kParallelGrain;
    if constexpr (kSixteenBit<T>) {
      switch (op) {
        case UnaryOp::Exp: return map_unary_table<T>(x, out, [](float v) { return std::exp(v); });
        case UnaryOp::Log: return map_unary_table<T>(x, out, [](float v) { return std::log(v); });
        case UnaryOp::Tanh: return map_unary_table<T>(x, out, [](float v) { return std::tanh(v); });
        case UnaryOp::Sigmoid: return map_unary_table<T>(x, out, [](float v) { return sigmoid_of(v); });
        case UnaryOp::Silu: return map_unary_table<T>(x, out, [](float v) { return v * sigmoid_of(v); });
        case UnaryOp::GeluErf: return map_unary_table<T>(x, out, [](float v) { return gelu_erf_of(v); });
        case UnaryOp::GeluTanh: return map_unary_table<T>(x, out, [](float v) { return gelu_tanh_of(v); });
        default: break;
      }
    }
    switch (op) {
      case UnaryOp::Neg: return map_unary<T, A>(x, out, light, [](A v) { return -v; });
      case UnaryOp::Abs: return map_unary<T, A>(x, out, light, [](A v) { return std::abs(v); });
      // v < 0 ? 0 : v lets NaN through (as PyTorch does) and compiles to a vector blend.
      case UnaryOp::Relu: return map_unary<T, A>(x, out, light, [](A v) { return v < A(0) ? A(0) : v; });
      case UnaryOp::Exp: return map_unary<T, A>(x, out, heavy, [](A v) { return std::exp(v); });
      case UnaryOp::Log: return map_unary<T, A>(x, out, heavy, [](A v) { return std::log(v); });
      case UnaryOp::Sqrt: return map_unary<T, A>(x, out, light, [](A v) { return std::sqrt(v); });
      case UnaryOp::Rsqrt: return map_unary<T, A>(x, out, light, [](A v) { return A(1) / std::sqrt(v); });
      case UnaryOp::Tanh: return map_unary<T, A>(x, out, heavy, [](A v) { return std::tanh(v); });
      case UnaryOp::Sigmoid: return map_unary<T, A>(x, out, heavy, [](A v) { return sigmoid_of(v); });
      case UnaryOp::Silu: return map_unary<T, A>(x, out, heavy, [](A v) { return v * sigmoid_of(v); });
      case UnaryOp::GeluErf: return map_unary<T, A>(x, out, heavy, [](A v) { return gelu_erf_of(v); });
      case UnaryOp::GeluTanh: return map_unary<T, A>(x, out, heavy, [](A v) { return gelu_tanh_of(v); });
      case UnaryOp::PowScalar:  // the exponent stays in double, so pow runs in double for every dtype
        return map_unary<T, double>(x, out, heavy, [scalar](double v) { return pow_scalar(v, scalar); });
      case UnaryOp::Count: break;  // not an op
    }
    fail("unary: unknown op ", static_cast<int>(op));
  });
}

// grad_x = grad_out * op'(v), v = `in`: x, or y = op(x) where kUnaryOps says the derivative reads the output.
void CpuBackend::unary_backward_kernel(UnaryOp op, const Tensor& in, const Tensor& grad_out, const Tensor& grad_x,
                                       double scalar) {
  dispatch_float(grad_x.dtype(), "unary_backward", [&]<typename T>() {
    using A = acc_t<T>;
    const int64_t heavy = kTranscendentalGrain, light = kParallelGrain;
    // Each lambda gets (v, g): v is x or y as above, g the output gradient.
    auto run = [&](int64_t grain, auto derivative_times_grad) {
      map_binary<T, A>(in, grad_out, grad_x, grain, derivative_times_grad);
    };
    if constexpr (kSixteenBit<T>) {
      auto tabled = [&](auto derivative) { map_derivative_table<T>(in, grad_out, grad_x, derivative); };
      switch (op) {
        case UnaryOp::Silu: return tabled([](float v) { return silu_derivative(v); });
        case UnaryOp::GeluErf: return tabled([](float v) { return gelu_erf_derivative(v); });
        case UnaryOp::GeluTanh: return tabled([](float v) { return gelu_tanh_derivative(v); });
        default: break;
      }
    }
    switch (op) {
      case UnaryOp::Neg: return run(light, [](A, A g) { return -g; });
      // d|x|/dx = sign(x), with sign(0) = 0.
      case UnaryOp::Abs: return run(light, [](A v, A g) { return v > A(0) ? g : v < A(0) ? -g : A(0); });
      // relu'(0) = 0: a zero input passes no gradient.
      case UnaryOp::Relu: return run(light, [](A v, A g) { return v > A(0) ? g : A(0); });
      case UnaryOp::Exp: return run(light, [](A y, A g) { return g * y; });
      case UnaryOp::Log: return run(light, [](A v, A g) { return g / v; });
      // d sqrt(x) = 1 / (2 sqrt(x)) = 1 / (2y)
      case UnaryOp::Sqrt: return run(light, [](A y, A g) { return g / (A(2) * y); });
      // d x^-1/2 = -x^-3/2 / 2 = -y^3 / 2
      case UnaryOp::Rsqrt: return run(light, [](A y, A g) { return A(-0.5) * g * y * y * y; });
      case UnaryOp::Tanh: return run(light, [](A y, A g) { return g * (A(1) - y * y); });
      case UnaryOp::Sigmoid: return run(light, [](A y, A g) { return g * y * (A(1) - y); });
      case UnaryOp::Silu: return run(heavy, [](A v, A g) { return g * silu_derivative(v); });
      case UnaryOp::GeluErf: return run(heavy, [](A v, A g) { return g * gelu_erf_derivative(v); });
      case UnaryOp::GeluTanh: return run(heavy, [](A v, A g) { return g * gelu_tanh_derivative(v); });
      case UnaryOp::PowScalar:  // in double, as the forward
        return map_binary<T, double>(in, grad_out, grad_x, heavy, [scalar](double v, double g) {
          return g * pow_scalar_derivative(v, scalar);
        });
      case UnaryOp::Count: break;  // not an op
    }
    fail("unary_backward: unknown op ", static_cast<int>(op));
  });
}

// ---- binary ----------------------------------------------------------------------------------------------

namespace {

bool reads_as_float(DType dtype) { return dtype == DType::F32 || dtype == DType::F16 || dtype == DType::BF16; }

// The arithmetic ops on an f32 out from inputs of mixed dtypes (binary_reads_mixed), read in place.
void binary_mixed(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  auto for_input = [&](const Tensor& t, auto body) {
    switch (t.dtype()) {
      case DType::F32: return body(float());
      case DType::F16: return body(Half());
      case DType::BF16: return body(BFloat16());
      default: fail("binary: not supported: ", t.described(), " read as f32 (expected f32, f16 or bf16)");
    }
  };
  for_input(a, [&](auto a_type) {
    for_input(b, [&](auto b_type) {
      using TA = decltype(a_type);
      using TB = decltype(b_type);
      auto run = [&](auto f) { map_binary_of<float, TA, TB, float>(a, b, out, kParallelGrain, f); };
      switch (op) {
        case BinaryOp::Add: return run([](float x, float y) { return x + y; });
        case BinaryOp::Sub: return run([](float x, float y) { return x - y; });
        case BinaryOp::Mul: return run([](float x, float y) { return x * y; });
        case BinaryOp::Div: return run([](float x, float y) { return x / y; });
        default:
          fail("binary: not supported: op ", static_cast<int>(op), " on mixed dtypes ", a.described(), " and ",
               b.described(), " (expected add, sub, mul or div)");
      }
    });
  });
}

}  // namespace

bool CpuBackend::binary_reads_mixed(DType a, DType b, DType out) const {
  return out == DType::F32 && reads_as_float(a) && reads_as_float(b);
}

void CpuBackend::binary_kernel(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  // Backend::binary lets mixed dtypes through only where binary_reads_mixed says so.
  if (a.dtype() != out.dtype() || b.dtype() != out.dtype()) return binary_mixed(op, a, b, out);
  dispatch_float(out.dtype(), "binary", [&]<typename T>() {
    // f16/bf16 compute in float: +, -, *, / of two 11-bit (f16) or 8-bit (bf16) values rounded to float's
    // 24 bits and then to the 16-bit type is correctly rounded (double rounding is harmless when the wider
    // format has at least 2p + 2 bits), so these match an exact computation rounded once.
    using A = acc_t<T>;
    const int64_t light = kParallelGrain;
    switch (op) {
      case BinaryOp::Add: return map_binary<T, A>(a, b, out, light, [](A x, A y) { return x + y; });
      case BinaryOp::Sub: return map_binary<T, A>(a, b, out, light, [](A x, A y) { return x - y; });
      case BinaryOp::Mul: return map_binary<T, A>(a, b, out, light, [](A x, A y) { return x * y; });
      case BinaryOp::Div: return map_binary<T, A>(a, b, out, light, [](A x, A y) { return x / y; });
      case BinaryOp::Pow:
        return map_binary<T, A>(a, b, out, kTranscendentalGrain, [](A x, A y) { return std::pow(x, y); });
      case BinaryOp::Eq: return map_binary<T, A>(a, b, out, light, [](A x, A y) { return A(x == y ? 1 : 0); });
    }
    fail("binary: unknown op ", static_cast<int>(op));
  });
}

void CpuBackend::binary_scalar_kernel(BinaryOp op, const Tensor& a, double scalar, bool scalar_first,
                                      const Tensor& out) {
  dispatch_float(out.dtype(), "binary_scalar", [&]<typename T>() {
    // Computed in double so the scalar is not rounded first: a * 0.1 is the product with 0.1 as a double,
    // rounded once to T (for f32 the double result is correctly rounded to float: 53 >= 2 * 24 + 2).
    const double s = scalar;
    const int64_t light = kParallelGrain, heavy = kTranscendentalGrain;
    auto run = [&](int64_t grain, auto f) { map_unary<T, double>(a, out, grain, f); };
    switch (op) {
      case BinaryOp::Add: return run(light, [s](double x) { return x + s; });
      case BinaryOp::Mul: return run(light, [s](double x) { return x * s; });
      case BinaryOp::Sub:
        if (scalar_first) return run(light, [s](double x) { return s - x; });
        return run(light, [s](double x) { return x - s; });
      case BinaryOp::Div:
        if (scalar_first) return run(light, [s](double x) { return s / x; });
        return run(light, [s](double x) { return x / s; });
      case BinaryOp::Pow:
        if (scalar_first) return run(heavy, [s](double x) { return std::pow(s, x); });
        return run(heavy, [s](double x) { return pow_scalar(x, s); });
      case BinaryOp::Eq: break;  // no scalar form: Backend::binary_scalar rejects it
    }
  });
}

// ---- where -----------------------------------------------------------------------------------------------

void CpuBackend::where_kernel(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) {
  const StridedLoop<4> loop(out.shape(), {out.strides(), cond.strides(), a.strides(), b.strides()});
  dispatch_all(cond.dtype(), "where", [&]<typename Cond>() {
    dispatch_all(out.dtype(), "where", [&]<typename T>() {
      const Cond* pc = cond.data<Cond>();
      const T* pa = a.data<T>();
      const T* pb = b.data<T>();
      T* po = out.data<T>();
      const auto [so, sc, sa, sb] = loop.inner_strides();
      // Nonzero is true; a NaN condition is nonzero. f16/bf16 conditions are compared through float.
      auto truth = [](Cond c) { return static_cast<acc_t<Cond>>(c) != acc_t<Cond>(0); };
      loop.run([&](const std::array<int64_t, 4>& at, int64_t n) {
        T* dst = po + at[0];
        const Cond* c = pc + at[1];
        const T* x = pa + at[2];
        const T* y = pb + at[3];
        if (so == 1 && sc == 1 && sa == 1 && sb == 1) {
          for (int64_t j = 0; j < n; ++j) dst[j] = truth(c[j]) ? x[j] : y[j];
        } else {
          for (int64_t j = 0; j < n; ++j) dst[j * so] = truth(c[j * sc]) ? x[j * sa] : y[j * sb];
        }
      });
    });
  });
}

// ---- in place --------------------------------------------------------------------------------------------

void CpuBackend::add_inplace_kernel(const Tensor& dst, const Tensor& src, double alpha) {
  // dst = dst + alpha src through map_binary_of, dst both an input and the output (each element is read
  // before it is written), so 16-bit runs go through its float blocks.
  dispatch_float(dst.dtype(), "add_inplace", [&]<typename T>() {
    dispatch_float(src.dtype(), "add_inplace", [&]<typename S>() {
      // Compute in double when either side is f64, else in float (fp32 accumulation for 16-bit grads).
      using C = std::conditional_t<std::is_same_v<T, double> || std::is_same_v<S, double>, double, float>;
      const C scale = static_cast<C>(alpha);
      map_binary_of<T, T, S, C>(dst, src, dst, kParallelGrain, [scale](C d, C s) { return d + scale * s; });
    });
  });
}

void CpuBackend::mul_scalar_inplace(const Tensor& dst, double value) {
  // The same loop as binary_scalar Mul, reading and writing dst (each element is read before it is written).
  binary_scalar(BinaryOp::Mul, dst, value, false, dst);
}

}  // namespace mixtape::cpu
