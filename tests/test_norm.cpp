// Fused layer_norm / rms_norm and dropout: forward against plain double references, the fused backward
// kernels against finite differences (f64) and against the textbook gradient in double (f32/f16/bf16),
// thread-count independence, and the errors bad arguments raise.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "autograd/gradcheck.h"
#include "tensor/backend.h"
#include "tensor/ops.h"
#include "tensor/random.h"
#include "test_util.h"

using namespace mixtape;
using mixtape::testing::all_close;
using mixtape::testing::within_ulp;
using mixtape::testing::kFloatDtypes;
using mixtape::testing::uniform_tensor;

namespace {

void expect_gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                      const std::vector<Tensor>& inputs) {
  const GradcheckResult result = gradcheck(f, inputs);
  EXPECT_TRUE(result.ok) << result.message;
}

// Compares a result in `dtype` with the f64 reference: 16-bit dtypes within `ulp16` ulp of the reference
// rounded to the dtype; f32 and f64 with a relative tolerance on the scale of the row (the outputs are sums
// of terms of size ~1 that may cancel, so a bound relative to each small result would be meaningless).
::testing::AssertionResult matches(const Tensor& out, const Tensor& reference, double ulp16) {
  switch (out.dtype()) {
    case DType::F16:
    case DType::BF16:
      return within_ulp(out, reference, ulp16);
    case DType::F32:
      return all_close(out, reference, 4e-6, 4e-6);
    default:
      return all_close(out, reference, 1e-13, 1e-13);
  }
}

// ---- plain double references -----------------------------------------------------------------------------

struct NormReference {
  std::vector<double> out, mean, rstd;
};

// layer_norm over rows of length C: y = (x - mean) / sqrt(var + eps) * w + b (w, b empty: 1 and 0).
NormReference reference_layer_norm(const std::vector<double>& x, int64_t C, const std::vector<double>& w,
                                   const std::vector<double>& b, double eps) {
  NormReference r;
  const int64_t N = static_cast<int64_t>(x.size()) / C;
  for (int64_t i = 0; i < N; ++i) {
    long double total = 0, squares = 0;
    for (int64_t j = 0; j < C; ++j) total += x[i * C + j];
    const long double mean = total / C;
    for (int64_t j = 0; j < C; ++j) squares += (x[i * C + j] - mean) * (x[i * C + j] - mean);
    const long double rstd = 1.0L / std::sqrt(squares / C + eps);
    for (int64_t j = 0; j < C; ++j)
      r.out.push_back(static_cast<double>((x[i * C + j] - mean) * rstd * (w.empty() ? 1.0L : w[j]) +
                                          (b.empty() ? 0.0L : b[j])));
    r.mean.push_back(static_cast<double>(mean));
    r.rstd.push_back(static_cast<double>(rstd));
  }
  return r;
}

NormReference reference_rms_norm(const std::vector<double>& x, int64_t C, const std::vector<double>& w,
                                 double eps) {
  NormReference r;
  const int64_t N = static_cast<int64_t>(x.size()) / C;
  for (int64_t i = 0; i < N; ++i) {
    long double squares = 0;
    for (int64_t j = 0; j < C; ++j) squares += static_cast<long double>(x[i * C + j]) * x[i * C + j];
    const long double rstd = 1.0L / std::sqrt(squares / C + eps);
    for (int64_t j = 0; j < C; ++j)
      r.out.push_back(static_cast<double>(x[i * C + j] * rstd * (w.empty() ? 1.0L : w[j])));
    r.rstd.push_back(static_cast<double>(rstd));
  }
  return r;
}

struct NormGradReference {
  std::vector<double> grad_x, grad_w, grad_b;
};

// The layer_norm gradient from the chain rule, row by row: with n = (x - mean) rstd and dn = w g,
// dx = rstd (dn - mean(dn) - n mean(dn n)), dw = sum_rows g n, db = sum_rows g.
NormGradReference reference_layer_norm_backward(const std::vector<double>& x, const std::vector<double>& g,
                                                int64_t C, const std::vector<double>& w, double eps) {
  const NormReference f = reference_layer_norm(x, C, {}, {}, eps);  // f.out is the normalised x
  NormGradReference r;
  const int64_t N = static_cast<int64_t>(x.size()) / C;
  std::vector<long double> dw(C, 0), db(C, 0);
  for (int64_t i = 0; i < N; ++i) {
    long double dn_sum = 0, dn_n_sum = 0;
    for (int64_t j = 0; j < C; ++j) {
      const long double dn = g[i * C + j] * (w.empty() ? 1.0L : w[j]);
      dn_sum += dn;
      dn_n_sum += dn * f.out[i * C + j];
      dw[j] += g[i * C + j] * f.out[i * C + j];
      db[j] += g[i * C + j];
    }
    for (int64_t j = 0; j < C; ++j) {
      const long double dn = g[i * C + j] * (w.empty() ? 1.0L : w[j]);
      r.grad_x.push_back(
          static_cast<double>(f.rstd[i] * (dn - dn_sum / C - f.out[i * C + j] * dn_n_sum / C)));
    }
  }
  r.grad_w.assign(dw.begin(), dw.end());
  r.grad_b.assign(db.begin(), db.end());
  return r;
}

// rms_norm: with n = x rstd and dn = w g, dx = rstd (dn - n mean(dn n)), dw = sum_rows g n.
NormGradReference reference_rms_norm_backward(const std::vector<double>& x, const std::vector<double>& g,
                                              int64_t C, const std::vector<double>& w, double eps) {
  const NormReference f = reference_rms_norm(x, C, {}, eps);
  NormGradReference r;
  const int64_t N = static_cast<int64_t>(x.size()) / C;
  std::vector<long double> dw(C, 0);
  for (int64_t i = 0; i < N; ++i) {
    long double dn_n_sum = 0;
    for (int64_t j = 0; j < C; ++j) {
      dn_n_sum += g[i * C + j] * (w.empty() ? 1.0L : w[j]) * f.out[i * C + j];
      dw[j] += g[i * C + j] * f.out[i * C + j];
    }
    for (int64_t j = 0; j < C; ++j) {
      const long double dn = g[i * C + j] * (w.empty() ? 1.0L : w[j]);
      r.grad_x.push_back(static_cast<double>(f.rstd[i] * (dn - f.out[i * C + j] * dn_n_sum / C)));
    }
  }
  r.grad_w.assign(dw.begin(), dw.end());
  return r;
}

Tensor f64(const std::vector<double>& values, const Shape& shape) {
  return Tensor::from_vector(values, shape, DType::F64);
}

}  // namespace

// ---- layer_norm ------------------------------------------------------------------------------------------

// 16-bit bound: the kernel computes in float (relative error a few 2^-24 on terms of size ~1), far below half
// an ulp of f16/bf16, so the one rounding on store is off by at most 1 ulp (only when the exact value lies
// within that float error of a rounding midpoint). f32 / f64: see matches().
TEST(LayerNorm, MatchesDoubleReferenceInEveryDtype) {
  const Shape shape = {7, 3, 96};
  const int64_t C = 96;
  for (DType dtype : kFloatDtypes) {
    const Tensor x = uniform_tensor(shape, 1, -2, 3, dtype);
    const Tensor w = uniform_tensor({C}, 2, 0.5, 1.5, dtype);
    const Tensor b = uniform_tensor({C}, 3, -0.5, 0.5, dtype);
    const LayerNormResult r = layer_norm(x, w, b, 1e-5);
    const NormReference ref =
        reference_layer_norm(x.to_vector<double>(), C, w.to_vector<double>(), b.to_vector<double>(), 1e-5);
    EXPECT_EQ(r.out.dtype(), dtype);
    EXPECT_TRUE(matches(r.out, f64(ref.out, shape), 1)) << dtype_name(dtype);
    // mean / rstd have shape [7, 3] and are f32 (f64 for f64 inputs).
    EXPECT_EQ(r.mean.dtype(), dtype == DType::F64 ? DType::F64 : DType::F32);
    EXPECT_EQ(r.rstd.dtype(), r.mean.dtype());
    EXPECT_EQ(r.mean.shape(), (Shape{7, 3}));
    EXPECT_EQ(r.rstd.shape(), (Shape{7, 3}));
    EXPECT_TRUE(all_close(r.mean, f64(ref.mean, {7, 3}), 1e-6, 1e-6)) << dtype_name(dtype);
    EXPECT_TRUE(all_close(r.rstd, f64(ref.rstd, {7, 3}), 0, 1e-6)) << dtype_name(dtype);
  }
}

TEST(LayerNorm, WeightAndBiasAreOptional) {
  const int64_t C = 40;
  const Tensor x = uniform_tensor({5, C}, 4, -1, 1, DType::F64);
  const Tensor w = uniform_tensor({C}, 5, 0.5, 1.5, DType::F64);
  const Tensor b = uniform_tensor({C}, 6, -0.5, 0.5, DType::F64);
  const std::vector<double> xv = x.to_vector<double>(), wv = w.to_vector<double>(),
                            bv = b.to_vector<double>();
  EXPECT_TRUE(all_close(layer_norm(x, {}, {}).out, f64(reference_layer_norm(xv, C, {}, {}, 1e-5).out, {5, C}),
                        1e-13, 1e-13));
  EXPECT_TRUE(all_close(layer_norm(x, w, {}).out, f64(reference_layer_norm(xv, C, wv, {}, 1e-5).out, {5, C}),
                        1e-13, 1e-13));
  EXPECT_TRUE(all_close(layer_norm(x, {}, b).out, f64(reference_layer_norm(xv, C, {}, bv, 1e-5).out, {5, C}),
                        1e-13, 1e-13));
}

TEST(LayerNorm, LargeMeanDoesNotCancel) {
  // x = 1e4 + noise of std ~0.03 in f32: a one-pass E[x^2] - E[x]^2 would lose every digit of the variance
  // (1e8 vs 1e-3 in float), and even a float mean of the raw values is off by ~1e-3 = 3% of the std. The
  // kernel centres the row on its first element (exact for such values) and then makes two passes.
  const int64_t C = 256;
  std::vector<double> noise = Tensor::rand({4, C}, 8, DType::F64).to_vector<double>();
  for (double& v : noise) v = 1e4 + 0.1 * (v - 0.5);
  const Tensor x = Tensor::from_vector(noise, {4, C}, DType::F32);
  const NormReference ref = reference_layer_norm(x.to_vector<double>(), C, {}, {}, 0);
  EXPECT_TRUE(all_close(layer_norm(x, {}, {}, 0).out, f64(ref.out, {4, C}), 1e-5, 1e-5));
}

TEST(LayerNorm, NonContiguousInputIsNormalisedOverItsLastDim) {
  const Tensor base = uniform_tensor({8, 6}, 9, -1, 1, DType::F64);
  const Tensor x = base.transpose(0, 1);  // [6, 8], rows are strided
  const NormReference ref = reference_layer_norm(x.contiguous().to_vector<double>(), 8, {}, {}, 1e-5);
  EXPECT_TRUE(all_close(layer_norm(x, {}, {}).out, f64(ref.out, {6, 8}), 1e-13, 1e-13));
}

TEST(LayerNorm, GradientsMatchFiniteDifferences) {
  const Tensor x = uniform_tensor({2, 3, 6}, 10, -1, 1, DType::F64);
  const Tensor w = uniform_tensor({6}, 11, 0.5, 1.5, DType::F64);
  const Tensor b = uniform_tensor({6}, 12, -0.5, 0.5, DType::F64);
  expect_gradcheck([](const std::vector<Tensor>& in) { return layer_norm(in[0], in[1], in[2]).out; },
                   {x, w, b});
  expect_gradcheck([](const std::vector<Tensor>& in) { return layer_norm(in[0], in[1], {}).out; }, {x, w});
  expect_gradcheck([](const std::vector<Tensor>& in) { return layer_norm(in[0], {}, in[1]).out; }, {x, b});
  expect_gradcheck([](const std::vector<Tensor>& in) { return layer_norm(in[0], {}, {}).out; }, {x});
  // Non-contiguous x.
  expect_gradcheck(
      [](const std::vector<Tensor>& in) { return layer_norm(in[0].transpose(0, 2), {}, in[1]).out; },
      {uniform_tensor({6, 3, 2}, 13, -1, 1, DType::F64), uniform_tensor({6}, 14, -1, 1, DType::F64)});
}

// The fused backward in every dtype against the chain-rule gradient in double. grad_x is a sum of terms of
// size ~1 that may cancel, so the bound is absolute + relative at the row's scale: float accumulation over
// C = 64 gives ~1e-6 (f32 bound 4e-6); a 16-bit result adds one rounding of at most half an ulp at 1
// (f16 2^-11 ~ 4.9e-4, bound 1e-3; bf16 2^-8 ~ 3.9e-3, bound 8e-3). grad_w / grad_b sum N = 300 rows of
// size ~1 (scale ~sqrt(300) ~ 17), so their absolute bound is 20x.
namespace {
double backward_tolerance(DType dtype) {
  switch (dtype) {
    case DType::F64:
      return 1e-12;
    case DType::F32:
      return 4e-6;
    case DType::F16:
      return 1e-3;
    default:
      return 8e-3;
  }
}
}  // namespace

TEST(LayerNorm, FusedBackwardMatchesChainRuleInEveryDtype) {
  const int64_t N = 300, C = 64;
  for (DType dtype : kFloatDtypes) {
    Tensor x = uniform_tensor({N, C}, 15, -1, 1, dtype).requires_grad_();
    Tensor w = uniform_tensor({C}, 16, 0.5, 1.5, dtype).requires_grad_();
    Tensor b = uniform_tensor({C}, 17, -0.5, 0.5, dtype).requires_grad_();
    const Tensor g = uniform_tensor({N, C}, 18, -1, 1, dtype);
    backward({layer_norm(x, w, b).out}, {g});
    const NormGradReference ref = reference_layer_norm_backward(x.to_vector<double>(), g.to_vector<double>(),
                                                                C, w.to_vector<double>(), 1e-5);
    const double tolerance = backward_tolerance(dtype);
    EXPECT_TRUE(all_close(x.grad(), f64(ref.grad_x, {N, C}), tolerance, tolerance)) << dtype_name(dtype);
    // grad_w / grad_b are sums over 300 rows: scale ~ sqrt(300) ~ 17, so the absolute floor scales too.
    EXPECT_TRUE(all_close(w.grad(), f64(ref.grad_w, {C}), 20 * tolerance, tolerance)) << dtype_name(dtype);
    EXPECT_TRUE(all_close(b.grad(), f64(ref.grad_b, {C}), 20 * tolerance, tolerance)) << dtype_name(dtype);
  }
}

TEST(LayerNorm, SixteenBitKernelsEqualTheF32KernelRoundedOnce) {
  // f16/bf16 rows are widened to float once per row and computed as f32 rows are (tensor/cpu/norm.cpp), so
  // every result (out, mean, rstd; grad_x, grad_weight, grad_bias) must be the f32 kernel's on the widened
  // inputs, rounded once to the 16-bit type: bit for bit, for layer_norm and rms_norm, with a row length
  // that is not a multiple of the conversion width.
  Backend& backend = backend_for(Device::cpu());
  auto bits_equal = [](const Tensor& a, const Tensor& b) {
    const Tensor ac = a.contiguous(), bc = b.contiguous();
    const size_t bytes = static_cast<size_t>(ac.numel()) * dtype_size(ac.dtype());
    return ac.dtype() == bc.dtype() && ac.shape() == bc.shape() &&
           std::memcmp(ac.data_ptr(), bc.data_ptr(), bytes) == 0;
  };
  for (DType dtype : {DType::F16, DType::BF16}) {
    for (int64_t C : {64, 1003}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " C=" + std::to_string(C));
      const int64_t N = 300;
      const Tensor x = uniform_tensor({N, C}, 21, -2, 3, dtype), w = uniform_tensor({C}, 22, 0.5, 1.5, dtype),
                   b = uniform_tensor({C}, 23, -0.5, 0.5, dtype), g = uniform_tensor({N, C}, 24, -1, 1, dtype);
      const Tensor x32 = x.to(DType::F32), w32 = w.to(DType::F32), b32 = b.to(DType::F32), g32 = g.to(DType::F32);
      auto empty = [](const Shape& shape, DType d) { return Tensor::empty(shape, d); };
      // layer_norm
      Tensor out = empty({N, C}, dtype), mean = empty({N}, DType::F32), rstd = empty({N}, DType::F32);
      Tensor out32 = empty({N, C}, DType::F32), mean32 = empty({N}, DType::F32), rstd32 = empty({N}, DType::F32);
      backend.layer_norm(x, w, b, 1e-5, out, mean, rstd);
      backend.layer_norm(x32, w32, b32, 1e-5, out32, mean32, rstd32);
      EXPECT_TRUE(bits_equal(out, out32.to(dtype)));
      EXPECT_TRUE(bits_equal(mean, mean32));
      EXPECT_TRUE(bits_equal(rstd, rstd32));
      Tensor gx = empty({N, C}, dtype), gw = empty({C}, dtype), gb = empty({C}, dtype);
      Tensor gx32 = empty({N, C}, DType::F32), gw32 = empty({C}, DType::F32), gb32 = empty({C}, DType::F32);
      backend.layer_norm_backward(g, x, w, mean, rstd, gx, gw, gb);
      backend.layer_norm_backward(g32, x32, w32, mean32, rstd32, gx32, gw32, gb32);
      EXPECT_TRUE(bits_equal(gx, gx32.to(dtype)));
      EXPECT_TRUE(bits_equal(gw, gw32.to(dtype)));
      EXPECT_TRUE(bits_equal(gb, gb32.to(dtype)));
      // rms_norm
      backend.rms_norm(x, w, 1e-5, out, rstd);
      backend.rms_norm(x32, w32, 1e-5, out32, rstd32);
      EXPECT_TRUE(bits_equal(out, out32.to(dtype)));
      EXPECT_TRUE(bits_equal(rstd, rstd32));
      backend.rms_norm_backward(g, x, w, rstd, gx, gw);
      backend.rms_norm_backward(g32, x32, w32, rstd32, gx32, gw32);
      EXPECT_TRUE(bits_equal(gx, gx32.to(dtype)));
      EXPECT_TRUE(bits_equal(gw, gw32.to(dtype)));
    }
  }
}

TEST(LayerNorm, BackwardDoesNotDependOnThreadCount) {
  const int64_t N = 2048, C = 64;  // large enough for the parallel path
  auto grads = [&] {
    Tensor x = uniform_tensor({N, C}, 19, -1, 1, DType::F32).requires_grad_();
    Tensor w = uniform_tensor({C}, 20, 0.5, 1.5, DType::F32).requires_grad_();
    Tensor b = uniform_tensor({C}, 21, -0.5, 0.5, DType::F32).requires_grad_();
    backward({layer_norm(x, w, b).out}, {uniform_tensor({N, C}, 22, -1, 1, DType::F32)});
    return std::vector<std::vector<double>>{x.grad().to_vector<double>(), w.grad().to_vector<double>(),
                                            b.grad().to_vector<double>()};
  };
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const auto one = grads();
  omp_set_num_threads(2);
  const auto two = grads();
  omp_set_num_threads(threads);
  EXPECT_EQ(one, two);
}

TEST(LayerNorm, RejectsMismatchedWeightAndBadInput) {
  const Tensor x = Tensor::zeros({2, 4});
  EXPECT_ERROR_MENTIONS(layer_norm(x, Tensor::ones({5}), {}), "layer_norm", "weight", "f32[5]", "f32[2,4]",
                        "[4]");
  EXPECT_ERROR_MENTIONS(layer_norm(x, {}, Tensor::ones({4, 1})), "layer_norm", "bias", "f32[4,1]",
                        "f32[2,4]");
  EXPECT_ERROR_MENTIONS(layer_norm(Tensor::zeros({2, 4}, DType::I32), {}, {}), "layer_norm", "i32[2,4]",
                        "floating");
  EXPECT_ERROR_MENTIONS(layer_norm(Tensor::scalar(1), {}, {}), "layer_norm", "f32[]", "at least one dim");
  EXPECT_ERROR_MENTIONS(layer_norm(x, {}, {}, -1), "layer_norm", "eps");
}

// ---- rms_norm --------------------------------------------------------------------------------------------

// 16-bit bound: out = x rstd w has no cancellation; the float computation is within a few 2^-24 relative,
// so the one rounding on store gives <= 1 ulp.
TEST(RMSNorm, MatchesDoubleReferenceInEveryDtype) {
  const Shape shape = {5, 4, 80};
  const int64_t C = 80;
  for (DType dtype : kFloatDtypes) {
    const Tensor x = uniform_tensor(shape, 23, -2, 3, dtype);
    const Tensor w = uniform_tensor({C}, 24, 0.5, 1.5, dtype);
    const RMSNormResult r = rms_norm(x, w, 1e-6);
    const NormReference ref = reference_rms_norm(x.to_vector<double>(), C, w.to_vector<double>(), 1e-6);
    EXPECT_EQ(r.out.dtype(), dtype);
    EXPECT_TRUE(matches(r.out, f64(ref.out, shape), 1)) << dtype_name(dtype);
    EXPECT_EQ(r.rstd.dtype(), dtype == DType::F64 ? DType::F64 : DType::F32);
    EXPECT_TRUE(all_close(r.rstd, f64(ref.rstd, {5, 4}), 0, 1e-6)) << dtype_name(dtype);
  }
  const Tensor x = uniform_tensor({3, 7}, 25, -1, 1, DType::F64);
  EXPECT_TRUE(all_close(rms_norm(x, {}).out,
                        f64(reference_rms_norm(x.to_vector<double>(), 7, {}, 1e-6).out, {3, 7}), 1e-13,
                        1e-13));
}

TEST(RMSNorm, GradientsMatchFiniteDifferences) {
  const Tensor x = uniform_tensor({3, 2, 5}, 26, -1, 1, DType::F64);
  const Tensor w = uniform_tensor({5}, 27, 0.5, 1.5, DType::F64);
  expect_gradcheck([](const std::vector<Tensor>& in) { return rms_norm(in[0], in[1]).out; }, {x, w});
  expect_gradcheck([](const std::vector<Tensor>& in) { return rms_norm(in[0], {}).out; }, {x});
  expect_gradcheck([](const std::vector<Tensor>& in) { return rms_norm(in[0].transpose(0, 2), {}).out; },
                   {uniform_tensor({5, 2, 3}, 28, -1, 1, DType::F64)});
}

TEST(RMSNorm, FusedBackwardMatchesChainRuleInEveryDtype) {
  const int64_t N = 300, C = 64;
  for (DType dtype : kFloatDtypes) {
    Tensor x = uniform_tensor({N, C}, 29, -1, 1, dtype).requires_grad_();
    Tensor w = uniform_tensor({C}, 30, 0.5, 1.5, dtype).requires_grad_();
    const Tensor g = uniform_tensor({N, C}, 31, -1, 1, dtype);
    backward({rms_norm(x, w).out}, {g});
    const NormGradReference ref = reference_rms_norm_backward(x.to_vector<double>(), g.to_vector<double>(), C,
                                                              w.to_vector<double>(), 1e-6);
    const double tolerance = backward_tolerance(dtype);
    EXPECT_TRUE(all_close(x.grad(), f64(ref.grad_x, {N, C}), tolerance, tolerance)) << dtype_name(dtype);
    EXPECT_TRUE(all_close(w.grad(), f64(ref.grad_w, {C}), 20 * tolerance, tolerance)) << dtype_name(dtype);
  }
}

TEST(RMSNorm, RejectsMismatchedWeight) {
  EXPECT_ERROR_MENTIONS(rms_norm(Tensor::zeros({3, 6}), Tensor::ones({3})), "rms_norm", "weight", "f32[3]",
                        "f32[3,6]", "[6]");
  EXPECT_ERROR_MENTIONS(rms_norm(Tensor::zeros({3}, DType::I64), {}), "rms_norm", "i64[3]");
}

// ---- dropout ---------------------------------------------------------------------------------------------

namespace {

// The mask from the definition: keep i iff uniform_from_bits(philox4x32(offset + i, 0, seed)[0]) >= p.
std::vector<bool> reference_keep(int64_t n, double p, uint64_t seed, uint64_t offset) {
  std::vector<bool> keep(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    keep[i] = uniform_from_bits(philox4x32(offset + static_cast<uint64_t>(i), 0, seed)[0]) >= p;
  return keep;
}

}  // namespace

// Kept elements are x / (1 - p): the kernel multiplies by 1/(1-p) in float (f64: double), two roundings
// before the store, so f32 is within 1 ulp of the exact quotient; 16-bit dtypes round once more from a
// float that is within 2^-23 relative of it: <= 1 ulp.
TEST(Dropout, MatchesTheCounterBasedDefinitionInEveryDtype) {
  const double p = 0.25;
  for (DType dtype : kFloatDtypes) {
    const Tensor x = uniform_tensor({37, 29}, 32, -2, 2, dtype);
    Generator generator(1234);
    generator.offset = 77;
    const Tensor out = dropout(x, p, generator);
    EXPECT_EQ(generator.offset, 77u + 37 * 29);
    const std::vector<bool> keep = reference_keep(x.numel(), p, 1234, 77);
    std::vector<double> expected = x.to_vector<double>();
    for (size_t i = 0; i < expected.size(); ++i) expected[i] = keep[i] ? expected[i] / (1 - p) : 0.0;
    EXPECT_TRUE(within_ulp(out, f64(expected, {37, 29}), 1)) << dtype_name(dtype);
  }
}

TEST(Dropout, KeepsExactlyTheElementsWhoseUniformIsAtLeastP) {
  // Take an element whose uniform u (a multiple of 2^-24) is >= 0.5, where float spacing is 2^-24 too:
  // p = u keeps it, p = u + 2^-26 (which rounds to u in float) must drop it.
  const uint64_t seed = 11;
  int64_t index = 0;
  float u = 0;
  for (; index < 100; ++index) {
    u = uniform_from_bits(philox4x32(static_cast<uint64_t>(index), 0, seed)[0]);
    if (u >= 0.5f) break;
  }
  ASSERT_GE(u, 0.5f);
  for (double p : {static_cast<double>(u), static_cast<double>(u) + 0x1p-26}) {
    Generator generator(seed);
    const double kept =
        dropout(Tensor::ones({index + 1}, DType::F64), p, generator).to_vector<double>()[index];
    EXPECT_EQ(kept != 0, static_cast<double>(u) >= p) << "p - u = " << p - u;
  }
}

TEST(Dropout, FractionDroppedIsNearP) {
  const int64_t n = 1 << 20;
  Generator generator(99);
  for (double p : {0.1, 0.5, 0.9}) {
    const std::vector<double> out = dropout(Tensor::ones({n}), p, generator).to_vector<double>();
    int64_t dropped = 0;
    for (double v : out) dropped += v == 0;
    // Binomial standard deviation sqrt(p (1-p) / n) <= 4.9e-4; allow 5 of them.
    EXPECT_NEAR(static_cast<double>(dropped) / n, p, 2.5e-3) << "p = " << p;
  }
}

TEST(Dropout, SameSeedAndOffsetGiveTheSameMaskAndTheGeneratorMovesOn) {
  const Tensor x = Tensor::ones({1000});
  Generator a(5), b(5);
  const std::vector<double> first = dropout(x, 0.5, a).to_vector<double>();
  EXPECT_EQ(first, dropout(x, 0.5, b).to_vector<double>());
  // The next draw uses fresh counters, so it is a different mask.
  EXPECT_NE(first, dropout(x, 0.5, a).to_vector<double>());
  Generator other_seed(6);
  EXPECT_NE(first, dropout(x, 0.5, other_seed).to_vector<double>());
}

TEST(Dropout, MaskDoesNotDependOnThreadCount) {
  const Tensor x = uniform_tensor({512, 512}, 33, -1, 1, DType::F32);  // large enough for the parallel path
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  Generator one_thread(42);
  const std::vector<double> one = dropout(x, 0.3, one_thread).to_vector<double>();
  omp_set_num_threads(2);
  Generator two_threads(42);
  const std::vector<double> two = dropout(x, 0.3, two_threads).to_vector<double>();
  omp_set_num_threads(threads);
  EXPECT_EQ(one, two);
}

TEST(Dropout, NonContiguousInputUsesRowMajorElementIndices) {
  const Tensor base = uniform_tensor({6, 5}, 34, -1, 1, DType::F64);
  const Tensor x = base.transpose(0, 1);
  Generator a(3), b(3);
  EXPECT_EQ(dropout(x, 0.4, a).to_vector<double>(), dropout(x.contiguous(), 0.4, b).to_vector<double>());
}

TEST(Dropout, IdentityWhenNotTrainingOrPIsZero) {
  const Tensor x = Tensor::ones({4});
  Generator generator(1);
  EXPECT_TRUE(dropout(x, 0.5, generator, false).same(x));
  EXPECT_TRUE(dropout(x, 0.0, generator).same(x));
  EXPECT_EQ(generator.offset, 0u);  // no counters were used
}

TEST(Dropout, GradientIsTheSameMaskScaled) {
  // A fresh generator inside f keeps the mask fixed across gradcheck's evaluations.
  expect_gradcheck(
      [](const std::vector<Tensor>& in) {
        Generator generator(7);
        return dropout(in[0], 0.3, generator);
      },
      {uniform_tensor({4, 6}, 35, -1, 1, DType::F64)});
  // The gradient of sum(dropout(x)) is keep / (1 - p), with the mask recomputed from (seed, offset).
  Tensor x = Tensor::ones({200}).requires_grad_();
  Generator generator(8);
  generator.offset = 1000;
  backward(sum(dropout(x, 0.5, generator)));
  const std::vector<bool> keep = reference_keep(200, 0.5, 8, 1000);
  const std::vector<double> grad = x.grad().to_vector<double>();
  for (size_t i = 0; i < keep.size(); ++i) EXPECT_EQ(grad[i], keep[i] ? 2.0 : 0.0) << i;
}

TEST(Dropout, RejectsPOutsideZeroToOne) {
  const Tensor x = Tensor::ones({2, 3});
  Generator generator(1);
  EXPECT_ERROR_MENTIONS(dropout(x, 1.0, generator), "dropout", "p", "[0, 1)", "f32[2,3]");
  EXPECT_ERROR_MENTIONS(dropout(x, -0.1, generator), "dropout", "p", "f32[2,3]");
  EXPECT_ERROR_MENTIONS(dropout(x, std::nan(""), generator), "dropout", "p");
  EXPECT_ERROR_MENTIONS(dropout(Tensor::ones({2}, DType::I64), 0.5, generator), "dropout", "i64[2]");
}
