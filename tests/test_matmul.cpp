// matmul: NumPy semantics (batch broadcasting, 1-d operands), every dtype against a plain double loop,
// strided operands, gradients by finite differences, and the errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "autograd/autograd.h"
#include "autograd/gradcheck.h"
#include "tensor/backend.h"
#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/gemm16.h"
#include "tensor/ops.h"
#include "test_util.h"

using namespace mixtape;
using mixtape::testing::all_close;
using mixtape::testing::within_ulp;

namespace {

// The product of a [..., M, K] and b [..., K, N] (both >= 2-d) in double, with NumPy batch broadcasting,
// computed from the operands' values by index arithmetic alone (never through mixtape ops).
Tensor reference_matmul(const Tensor& a, const Tensor& b) {
  const std::vector<double> av = a.to_vector<double>(), bv = b.to_vector<double>();
  const Shape as(a.shape().begin(), a.shape().end() - 2), bs(b.shape().begin(), b.shape().end() - 2);
  const int64_t M = a.size(-2), K = a.size(-1), N = b.size(-1);
  const size_t n = std::max(as.size(), bs.size());
  Shape batch(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t x = i + as.size() >= n ? as[i + as.size() - n] : 1;
    const int64_t y = i + bs.size() >= n ? bs[i + bs.size() - n] : 1;
    batch[i] = std::max(x, y);
  }
  int64_t count = 1;
  for (int64_t s : batch) count *= s;
  std::vector<double> out(static_cast<size_t>(count * M * N));
  for (int64_t index = 0; index < count; ++index) {
    // Row-major batch index -> the index into each operand's own (possibly size-1) batch dims.
    int64_t rest = index, a_batch = 0, b_batch = 0, a_scale = 1, b_scale = 1;
    for (size_t d = n; d-- > 0;) {
      const int64_t i = rest % batch[d];
      rest /= batch[d];
      if (d + as.size() >= n) {
        const int64_t size = as[d + as.size() - n];
        a_batch += (size == 1 ? 0 : i) * a_scale;
        a_scale *= size;
      }
      if (d + bs.size() >= n) {
        const int64_t size = bs[d + bs.size() - n];
        b_batch += (size == 1 ? 0 : i) * b_scale;
        b_scale *= size;
      }
    }
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double total = 0;
        for (int64_t k = 0; k < K; ++k)
          total += av[static_cast<size_t>((a_batch * M + i) * K + k)] *
                   bv[static_cast<size_t>((b_batch * K + k) * N + j)];
        out[static_cast<size_t>((index * M + i) * N + j)] = total;
      }
  }
  Shape shape = batch;
  shape.push_back(M);
  shape.push_back(N);
  return Tensor::from_vector(out, shape, DType::F64);
}

// Each dtype with each bf16 route: bf16 with every route this CPU has (mixtape::testing::bf16_gemm_routes),
// another dtype with the route now, which does not concern it.
std::vector<std::pair<DType, cpu::Bf16Gemm>> dtypes_and_routes(std::initializer_list<DType> dtypes) {
  std::vector<std::pair<DType, cpu::Bf16Gemm>> out;
  for (DType dtype : dtypes) {
    const std::vector<cpu::Bf16Gemm> routes =
        dtype == DType::BF16 ? mixtape::testing::bf16_gemm_routes() : std::vector{cpu::bf16_gemm()};
    for (cpu::Bf16Gemm route : routes) out.emplace_back(dtype, route);
  }
  return out;
}

// Fraction of elements of a 16-bit result that equal the correctly rounded reference exactly.
double exact_fraction(const Tensor& actual, const Tensor& reference) {
  const std::vector<double> got = actual.to_vector<double>(), want = reference.to_vector<double>();
  size_t exact = 0;
  for (size_t i = 0; i < got.size(); ++i)
    exact += got[i] == mixtape::testing::round_to(actual.dtype(), want[i]);
  return static_cast<double>(exact) / static_cast<double>(got.size());
}

// Checks a product of positive data against the double reference with each dtype's bound:
// - f16/bf16: 1 ulp (fp32 accumulation, one rounding; see LowPrecisionIsWithinOneUlpOfRoundedExactProduct);
// - f32: relative 1e-5 (fp32 accumulation of K <= 256 positive terms: <= K * 2^-24 relative);
// - f64: relative 1e-12 (the same products summed in another order).
::testing::AssertionResult matches_reference(const Tensor& out, const Tensor& reference) {
  switch (out.dtype()) {
    case DType::F16:
    case DType::BF16: return within_ulp(out, reference, 1);
    case DType::F32: return all_close(out, reference, 0, 1e-5);
    default: return all_close(out, reference, 0, 1e-12);
  }
}

}  // namespace

TEST(Matmul, F32MatchesDoubleLoopReference) {
  // Positive data: no cancellation, so every element has a relative error bound. fp32 accumulation over
  // K terms errs by at most about K * 2^-24 ~ 1.5e-5 relative in the worst case at K = 256 and by ~sqrt(K)
  // * 2^-24 ~ 1e-6 typically; 1e-5 is the usual rel tolerance.
  for (auto [M, K, N] : {std::tuple{37, 53, 29}, std::tuple{128, 256, 96}, std::tuple{1, 300, 1}}) {
    const Tensor a = Tensor::rand({M, K}, 1), b = Tensor::rand({K, N}, 2);
    const Tensor out = matmul(a, b);
    EXPECT_EQ(out.dtype(), DType::F32);
    EXPECT_TRUE(all_close(out, reference_matmul(a, b), 0, 1e-5)) << M << "x" << K << "x" << N;
  }
  // Signed data: the error is bounded by the sum of |a_ik b_kj| (<= K * 4^2 for |values| < 4), not |c_ij|.
  const Tensor a = Tensor::randn({64, 200}, 3), b = Tensor::randn({200, 48}, 4);
  EXPECT_TRUE(all_close(matmul(a, b), reference_matmul(a, b), 200 * 16 * 1e-7, 1e-5));
}

TEST(Matmul, F64IsExactToRounding) {
  const Tensor a = Tensor::randn({33, 70}, 5, DType::F64), b = Tensor::randn({70, 41}, 6, DType::F64);
  const Tensor out = matmul(a, b);
  EXPECT_EQ(out.dtype(), DType::F64);
  // Same products summed in a possibly different order: differences are a few ulp of the row's magnitude.
  EXPECT_TRUE(all_close(out, reference_matmul(a, b), 1e-12, 1e-12));
}

TEST(Matmul, LowPrecisionIsWithinOneUlpOfRoundedExactProduct) {
  // The inputs are rounded to the dtype first; the reference is the exact (f64) product of those rounded
  // values, rounded once to the dtype. The kernel accumulates in fp32 and rounds once: with positive data
  // the fp32 sum is within K * 2^-24 (< 7e-5 at K = 1024) relative of the exact one, far below half an ulp
  // of bf16 (2^-9) or f16 (2^-12), so the stored value is the correctly rounded one unless the exact value
  // lies within that distance of a rounding boundary, where it may land on the neighbour: at most 1 ulp.
  // Rounding in the accumulator instead (a 16-bit sum) would be tens of ulps off at these K.
  // bf16 on each route this CPU has (oneDNN's bf16 GEMM, f32 FMAs).
  for (const auto& [dtype, route] : dtypes_and_routes({DType::BF16, DType::F16})) {
    const mixtape::testing::Bf16GemmSetting setting(route);
    for (auto [M, K, N] : {std::tuple{17, 64, 23}, std::tuple{96, 1024, 80}}) {
      const Tensor a = Tensor::rand({M, K}, 7, dtype), b = Tensor::rand({K, N}, 8, dtype);
      const Tensor out = matmul(a, b);
      ASSERT_EQ(out.dtype(), dtype);
      const Tensor reference = reference_matmul(a, b);
      EXPECT_TRUE(within_ulp(out, reference, 1)) << dtype_name(dtype) << " K=" << K << " "
                                                  << cpu::bf16_gemm_name(route);
      // Most elements are exactly the correctly rounded value (a test that a 1-ulp bound alone cannot make).
      EXPECT_GT(exact_fraction(out, reference), 0.9) << dtype_name(dtype) << " K=" << K << " "
                                                     << cpu::bf16_gemm_name(route);
    }
  }
}

// f16 products on a CPU with AMX run as bf16 products of each value's bf16 parts, x = hi + lo, dropping the
// lo * lo term (tensor/cpu/matmul.cpp, "f16 as bf16 parts"); elsewhere, or switched off, through f32 with
// exact products. The route a scope asks for, on or off, to compare both on the same machine:
struct F16SplitSetting {
  explicit F16SplitSetting(bool enabled) : saved(cpu::set_f16_matmul_split_enabled(enabled)) {}
  ~F16SplitSetting() { cpu::set_f16_matmul_split_enabled(saved); }
  bool saved;
};

TEST(MatmulF16, TheBf16PartsRouteDropsExactlyTheLowTimesLowTerm) {
  // Row 0 of A is (a0, -1), column 0 of B is (a0, c) with c = a0^2 rounded to f16, zeros elsewhere; the
  // operands are large enough for oneDNN's AMX kernels. The exact sum a0^2 - c is held by f32 (a0^2 has 21
  // bits), so the f32 route gives it. The parts route keeps ah^2 + 2 ah al and the exact -c (-1 * c's parts,
  // -1 = hi -1, lo 0): a0^2 - c - al^2, its sum exact in any order.
  //   a0 = 1 + 2^-10: hi 1, lo 2^-10; c = 1 + 2^-9. Exact 2^-20 (an f16 subnormal), parts 0.
  //   a0 = 1 + 7 2^-10: hi rounds up to 1 + 2^-7, lo = -2^-10; c = 1 + 14 2^-10. Exact 49 2^-20, parts
  //   48 2^-20. With hi cut (truncated) instead of rounded, lo would be 7 2^-10 and the parts route 0.
  // A route that kept all four terms would give the exact value; one that lost another term, neither value.
  // A bias joins the f32 sum before the one rounding. A and B each row- and column-major.
  // The same numbers sit again in row 1 of A and column 1 of B at k = 64, 65: with K = 72 a run along K ends
  // in 8 values that the split's scalar tail handles, while rows 0 and columns 0 take its vector loop.
  constexpr int64_t M = 32, K = 72, N = 48;
  const double u = std::ldexp(1.0, -10);
  struct Case {
    double a0, c, exact, parts;
  };
  for (const Case& test : {Case{1 + u, 1 + 2 * u, u * u, 0}, Case{1 + 7 * u, 1 + 14 * u, 49 * u * u, 48 * u * u}}) {
    SCOPED_TRACE(test.a0);
    std::vector<double> av(M * K, 0.0), bv(K * N, 0.0), bias_v(N, 0.0);
    for (int64_t at : {0, 1}) {  // row/column `at`, from k = 64 * at
      av[at * K + 64 * at] = test.a0;
      av[at * K + 64 * at + 1] = -1;
      bv[64 * at * N + at] = test.a0;
      bv[(64 * at + 1) * N + at] = test.c;
    }
    bias_v[0] = u * u;
    const Tensor a = Tensor::from_vector(av, {M, K}, DType::F16), b = Tensor::from_vector(bv, {K, N}, DType::F16);
    const Tensor bias = Tensor::from_vector(bias_v, {N}, DType::F16);
    for (bool split : {true, false}) {
      const F16SplitSetting setting(split);
      const bool parts = cpu::f16_matmul_splits();
      SCOPED_TRACE(parts ? "bf16 parts" : "through f32");
      std::vector<double> want(M * N, 0.0), want_bias(M * N, 0.0);
      want[0] = want[N + 1] = parts ? test.parts : test.exact;
      for (int64_t i = 0; i < M; ++i) want_bias[i * N] = u * u;
      want_bias[0] = want[0] + u * u;
      want_bias[N + 1] = want[N + 1];
      for (const Tensor& x : {a, a.mT().contiguous().mT()}) {
        for (const Tensor& y : {b, b.mT().contiguous().mT()}) {
          EXPECT_EQ(matmul(x, y).to_vector<double>(), want);
          EXPECT_EQ(linear(x, y.mT(), bias).to_vector<double>(), want_bias);
        }
      }
    }
  }
}

TEST(MatmulF16, NonFiniteInputsGiveWhatTheValuesGive) {
  // B is all ones except b[k0][0] = inf, and A is all ones: column 0 of the product is inf + (K - 1) = inf,
  // the others K. Split naively, inf = hi inf + lo (inf - inf = NaN); with lo = 0 instead, the term al * bh
  // is 0 * inf = NaN (al = 0 for a = 1). Such a product must take the f32 route. NaN stays NaN, inf - inf in
  // one sum is NaN, as in f32; a finite product right after is exact. With K = 72 the values sit either at
  // k0 = 0 (the split's vector loop) or at k0 = 64, in the last 8 of a run along K (its scalar tail).
  constexpr int64_t M = 32, K = 72, N = 48;
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  auto b_with = [&](std::vector<double> first, int64_t k0) {
    std::vector<double> bv(K * N, 1.0);
    for (size_t k = 0; k < first.size(); ++k) bv[(k0 + static_cast<int64_t>(k)) * N] = first[k];
    return Tensor::from_vector(bv, {K, N}, DType::F16);
  };
  const Tensor ones = Tensor::ones({M, K}, DType::F16);
  for (const Tensor& a : {ones, ones.mT().contiguous().mT()}) {
    using Case = std::pair<std::vector<double>, double>;  // column 0 of B, column 0 of the product
    for (const auto& [first, column0] :
         {Case{{inf}, inf}, Case{{-inf}, -inf}, Case{{nan}, nan}, Case{{inf, -inf}, nan}}) {
      for (const int64_t k0 : {0, 64}) {
        const Tensor stored = b_with(first, k0);
        for (const Tensor& b : {stored, stored.mT().contiguous().mT()}) {
          const std::vector<double> out = matmul(a, b).to_vector<double>();
          for (int64_t i = 0; i < M; ++i) {
            if (std::isnan(column0)) EXPECT_TRUE(std::isnan(out[i * N])) << "row " << i << ": " << out[i * N];
            else EXPECT_EQ(out[i * N], column0) << "row " << i;
            EXPECT_EQ(out[i * N + 1], K) << "row " << i;
          }
          // The operands the other way round: the non-finite value in A.
          const std::vector<double> out_t = matmul(b.mT(), a.mT()).to_vector<double>();
          if (std::isnan(column0)) EXPECT_TRUE(std::isnan(out_t[0]));
          else EXPECT_EQ(out_t[0], column0);
          EXPECT_EQ(out_t[M], K);
        }
      }
    }
    EXPECT_EQ(matmul(a, b_with({2}, 0)).to_vector<double>()[0], K + 1);
  }
}

TEST(MatmulF16, TheBf16PartsStayWithinTheirBoundOfTheExactProduct) {
  if (!cpu::f16_matmul_splits()) GTEST_SKIP() << "no AMX here: f16 is multiplied through f32";
  // Each product a b loses its lo * lo term, at most 2^-16 |a b| (|lo| <= 2^-8 |x|), and the 3K terms are
  // summed in f32: |out - exact| <= half an f16 ulp of the result + (2^-16 + 3K 2^-24) sum_k |a_k b_k|. The
  // dropped terms have random signs, so in practice the f32 value is far closer and the stored f16 is the
  // correctly rounded one almost everywhere (as on the f32 route, Matmul.LowPrecisionIsWithin...): both
  // checked on signed data, in all four layouts, with K large enough (1000) for the sums to matter. Some
  // roundings must differ from the f32 route's, which shows that the parts route ran.
  EXPECT_FALSE(backend_of(Tensor::zeros({1}, DType::F16)).matmul_widens(DType::F16));
  constexpr int64_t M = 64, K = 1000, N = 96;
  const Tensor a = Tensor::randn({M, K}, 41, DType::F16), b = Tensor::randn({K, N}, 42, DType::F16);
  const std::vector<double> av = a.to_vector<double>(), bv = b.to_vector<double>();
  const Tensor reference = reference_matmul(a, b);
  const std::vector<double> exact = reference.to_vector<double>();
  Tensor through_f32;
  {
    const F16SplitSetting f32_route(false);
    EXPECT_TRUE(backend_of(a).matmul_widens(DType::F16));
    through_f32 = matmul(a, b);
  }
  for (const Tensor& x : {a, a.mT().contiguous().mT()}) {
    for (const Tensor& y : {b, b.mT().contiguous().mT()}) {
      const Tensor out = matmul(x, y);
      const std::vector<double> got = out.to_vector<double>();
      int beyond = 0;
      for (int64_t i = 0; i < M; ++i) {
        for (int64_t j = 0; j < N; ++j) {
          double magnitude = 0;
          for (int64_t k = 0; k < K; ++k) magnitude += std::abs(av[i * K + k] * bv[k * N + j]);
          const double e = exact[i * N + j];
          const double half_ulp = std::ldexp(1.0, std::max(std::ilogb(e), -14) - 11);
          const double bound = half_ulp + (std::ldexp(1.0, -16) + 3 * K * std::ldexp(1.0, -24)) * magnitude;
          beyond += std::abs(got[i * N + j] - e) > bound;
        }
      }
      EXPECT_EQ(beyond, 0);
      EXPECT_GT(exact_fraction(out, reference), 0.9);
      EXPECT_NE(got, through_f32.to_vector<double>());
    }
  }
}

TEST(Matmul, BatchDimsBroadcastInEveryDtype) {
  for (DType dtype : {DType::F32, DType::BF16, DType::F16, DType::F64}) {
    const Tensor a = Tensor::rand({2, 1, 3, 4}, 9, dtype), b = Tensor::rand({5, 4, 2}, 10, dtype);
    const Tensor out = matmul(a, b);
    EXPECT_EQ(out.shape(), (Shape{2, 5, 3, 2}));
    EXPECT_TRUE(matches_reference(out, reference_matmul(a, b))) << dtype_name(dtype);
  }
  // Broadcast on the other side, and a batch of one against a batch of many.
  const Tensor a = Tensor::rand({6, 3, 5}, 11), b = Tensor::rand({1, 5, 7}, 12);
  EXPECT_TRUE(all_close(matmul(a, b), reference_matmul(a, b), 0, 1e-6));
  EXPECT_TRUE(all_close(matmul(b.mT(), a.mT()), reference_matmul(b.mT(), a.mT()), 0, 1e-6));
}

TEST(Matmul, SharedMatrixOverBatchIsOneLinearLayer) {
  // x [B, T, C] @ W [C, N]: the batch folds into M inside the kernel.
  for (DType dtype : {DType::F32, DType::BF16}) {
    const Tensor x = Tensor::rand({4, 8, 48}, 13, dtype), w = Tensor::rand({48, 24}, 14, dtype);
    const Tensor out = matmul(x, w);
    EXPECT_EQ(out.shape(), (Shape{4, 8, 24}));
    EXPECT_TRUE(matches_reference(out, reference_matmul(x, w))) << dtype_name(dtype);
  }
}

TEST(Matmul, TransposedAndStridedOperandsGiveTheSameResult) {
  for (const auto& [dtype, route] : dtypes_and_routes({DType::F32, DType::BF16, DType::F16, DType::F64})) {
    const mixtape::testing::Bf16GemmSetting setting(route);
    SCOPED_TRACE(std::string("bf16 route ") + cpu::bf16_gemm_name(route));
    const Tensor at = Tensor::rand({40, 24}, 15, dtype), bt = Tensor::rand({36, 40}, 16, dtype);
    const Tensor a = at.mT(), b = bt.mT();  // [24, 40] and [40, 36], column-major
    EXPECT_TRUE(matches_reference(matmul(a, b), reference_matmul(a, b))) << dtype_name(dtype);
    EXPECT_TRUE(matches_reference(matmul(a, bt.mT().contiguous()), reference_matmul(a, b)))
        << dtype_name(dtype);
    // Batched transposes, and a last dim with stride 2 (no unit stride: packed before oneDNN).
    const Tensor ab = Tensor::rand({3, 40, 24}, 17, dtype).mT(),
                 bb = Tensor::rand({3, 36, 40}, 18, dtype).mT();
    EXPECT_TRUE(matches_reference(matmul(ab, bb), reference_matmul(ab, bb))) << dtype_name(dtype);
    const Tensor strided = Tensor::rand({24, 80}, 19, dtype).slice(1, 0, 80, 2);  // [24, 40], strides (80, 2)
    EXPECT_TRUE(matches_reference(matmul(strided, b), reference_matmul(strided, b))) << dtype_name(dtype);
    // A batch slice: batch stride larger than the matrix.
    const Tensor every_other = Tensor::rand({6, 24, 40}, 20, dtype).slice(0, 0, 6, 2);
    EXPECT_TRUE(matches_reference(matmul(every_other, b), reference_matmul(every_other, b)))
        << dtype_name(dtype);
    // A tall, transposed A with a narrow product (a weight gradient X^T dY): on CPUs where oneDNN runs its
    // AVX2 kernels the plan packs A row-major through the tiled transposing copy (tensor/cpu/matmul.cpp).
    const Tensor tall = Tensor::rand({70, 600}, 26, dtype).mT(), narrow = Tensor::rand({70, 30}, 27, dtype);
    EXPECT_TRUE(matches_reference(matmul(tall, narrow), reference_matmul(tall, narrow))) << dtype_name(dtype);
    // A short, wide product with a row-major B (the other weight gradient): on the same CPUs it is computed
    // as out^T = B^T A^T and transposed into out. A plain and transposed, an offset (a row slice), and a
    // size-1 batch dim that the geometry drops.
    const Tensor wide = Tensor::rand({520, 600}, 28, dtype);
    const Tensor short_a = Tensor::rand({210, 520}, 29, dtype).slice(0, 10, 210, 1);  // [200, 520], offset
    const Tensor short_at = Tensor::rand({520, 200}, 30, dtype).mT();
    for (const Tensor& s : {short_a, short_at}) {
      EXPECT_TRUE(matches_reference(matmul(s, wide), reference_matmul(s, wide))) << dtype_name(dtype);
    }
    const Tensor batch1 = short_at.unsqueeze(0), wide1 = wide.unsqueeze(0);  // [1, 200, 520] x [1, 520, 600]
    EXPECT_TRUE(matches_reference(matmul(batch1, wide1), reference_matmul(batch1, wide1)))
        << dtype_name(dtype);
    // Weight gradients dY^T X over a long K (the tokens; >= 1024 and ragged for the 16-bit transposes): with
    // bf16 on oneDNN's AVX512-BF16 kernels, A is copied row-major when M <= N, and a product with M > N and
    // B row-major is computed as out^T = B^T A^T with B^T copied. Both sides of M = N, and B transposed.
    const int64_t K = 1100;
    const Tensor dy_narrow = Tensor::rand({K, 40}, 31, dtype), dy_wide = Tensor::rand({K, 72}, 32, dtype);
    const Tensor x_narrow = Tensor::rand({K, 40}, 33, dtype), x_wide = Tensor::rand({K, 72}, 34, dtype);
    for (const auto& [dy, x] : {std::pair{dy_narrow, x_wide}, {dy_wide, x_narrow}, {dy_narrow, x_narrow}}) {
      EXPECT_TRUE(matches_reference(matmul(dy.mT(), x), reference_matmul(dy.mT(), x)))
          << dtype_name(dtype) << " " << shape_str(dy.shape()) << " " << shape_str(x.shape());
      const Tensor x_cols = x.mT().contiguous().mT();  // the same values, B column-major
      EXPECT_TRUE(matches_reference(matmul(dy.mT(), x_cols), reference_matmul(dy.mT(), x)))
          << dtype_name(dtype) << " " << shape_str(dy.shape()) << " " << shape_str(x.shape());
    }
  }
}

TEST(Matmul, OneDimensionalOperandsFollowNumpy) {
  const Tensor v = Tensor::rand({5}, 21), u = Tensor::rand({5}, 22), m = Tensor::rand({5, 3}, 23),
               n = Tensor::rand({4, 5}, 24), batch = Tensor::rand({2, 5, 3}, 25);
  const Tensor dot = matmul(v, u);
  EXPECT_EQ(dot.shape(), Shape{});
  EXPECT_TRUE(all_close(dot.reshape({1, 1}), reference_matmul(v.view({1, 5}), u.view({5, 1})), 0, 1e-6));
  const Tensor vm = matmul(v, m);  // [5] @ [5, 3] -> [3]
  EXPECT_EQ(vm.shape(), Shape{3});
  EXPECT_TRUE(all_close(vm.view({1, 3}), reference_matmul(v.view({1, 5}), m), 0, 1e-6));
  const Tensor nv = matmul(n, v);  // [4, 5] @ [5] -> [4]
  EXPECT_EQ(nv.shape(), Shape{4});
  EXPECT_TRUE(all_close(nv.view({4, 1}), reference_matmul(n, v.view({5, 1})), 0, 1e-6));
  const Tensor vb = matmul(v, batch);  // [5] @ [2, 5, 3] -> [2, 3]
  EXPECT_EQ(vb.shape(), (Shape{2, 3}));
  EXPECT_TRUE(all_close(vb.view({2, 1, 3}), reference_matmul(v.view({1, 5}), batch), 0, 1e-6));
  const Tensor bv = matmul(batch.mT(), u);  // [2, 3, 5] @ [5] -> [2, 3]
  EXPECT_EQ(bv.shape(), (Shape{2, 3}));
  EXPECT_TRUE(all_close(bv.view({2, 3, 1}), reference_matmul(batch.mT(), u.view({5, 1})), 0, 1e-6));
}

TEST(Matmul, MixedDtypesComputeInTheWiderOne) {
  const Tensor a = Tensor::rand({3, 4}, 26, DType::BF16), b = Tensor::rand({4, 2}, 27, DType::F32);
  const Tensor out = matmul(a, b);
  EXPECT_EQ(out.dtype(), DType::F32);
  EXPECT_TRUE(all_close(out, reference_matmul(a, b), 0, 1e-6));
  EXPECT_EQ(matmul(Tensor::rand({3, 4}, 28, DType::F16), Tensor::rand({4, 2}, 29, DType::BF16)).dtype(),
            DType::F32);
  EXPECT_EQ(matmul(Tensor::rand({3, 4}, 30, DType::F64), b).dtype(), DType::F64);
}

TEST(Matmul, EmptyInnerDimGivesZerosAndEmptyOuterDimGivesEmpty) {
  EXPECT_EQ(matmul(Tensor::ones({3, 0}), Tensor::ones({0, 2})).to_vector<double>(),
            std::vector<double>(6, 0.0));
  EXPECT_EQ(matmul(Tensor::ones({0, 4}), Tensor::ones({4, 2})).shape(), (Shape{0, 2}));
  EXPECT_EQ(matmul(Tensor::ones({2, 0, 3, 4}), Tensor::ones({4, 2})).shape(), (Shape{2, 0, 3, 2}));
}

// Gradients through an empty inner (K = 0) or outer dim: empty or zero, of the operands' shapes. The weight
// gradient of a shared matrix flattens the batch rows, whose count is spelled out (reshape cannot infer -1
// beside a 0).
TEST(MatmulGrad, EmptyDimsGiveEmptyOrZeroGradients) {
  struct Case { Shape x, w; };
  for (const Case& c : std::vector<Case>{{{2, 5, 0}, {0, 3}}, {{3, 0}, {0, 2}}, {{2, 0, 4}, {4, 3}},
                                         {{2, 3, 4}, {4, 0}}}) {
    Tensor x = Tensor::ones(c.x).requires_grad_(), w = Tensor::ones(c.w).requires_grad_();
    backward(sum(matmul(x, w)));
    EXPECT_EQ(x.grad().shape(), c.x);
    EXPECT_EQ(w.grad().shape(), c.w);
    EXPECT_EQ(x.grad().to_vector<double>(), std::vector<double>(x.numel(), 0.0));
    EXPECT_EQ(w.grad().to_vector<double>(), std::vector<double>(w.numel(), 0.0));
    // linear(x, w^T) has the same shapes transposed.
    Tensor lx = Tensor::ones(c.x).requires_grad_(), lw = Tensor::ones(c.w).mT().contiguous().requires_grad_();
    Tensor lb = Tensor::ones({c.w[1]}).requires_grad_();
    backward(sum(linear(lx, lw, lb)));
    EXPECT_EQ(lx.grad().to_vector<double>(), std::vector<double>(lx.numel(), 0.0));
    EXPECT_EQ(lw.grad().shape(), lw.shape());
    EXPECT_EQ(lw.grad().to_vector<double>(), std::vector<double>(lw.numel(), 0.0));
    // The bias gradient counts the rows (0 when there are none).
    const double rows = double(shape_numel(Shape(c.x.begin(), c.x.end() - 1)));
    EXPECT_EQ(lb.grad().to_vector<double>(), std::vector<double>(lb.numel(), rows)) << shape_str(c.x);
  }
}

TEST(Matmul, RepeatedCallsThroughTheCachedPlanAgreeBitwise) {
  const Tensor a = Tensor::rand({64, 32}, 31), b = Tensor::rand({32, 16}, 32);
  const std::vector<float> first = matmul(a, b).to_vector<float>();
  for (int i = 0; i < 3; ++i) EXPECT_EQ(matmul(a, b).to_vector<float>(), first);
}

// ---- gradients --------------------------------------------------------------------------------------------

TEST(MatmulGrad, MatchesFiniteDifferences) {
  auto f = [](const std::vector<Tensor>& in) { return matmul(in[0], in[1]); };
  EXPECT_TRUE(gradcheck(f, {Tensor::randn({3, 4}, 40), Tensor::randn({4, 5}, 41)}).ok);
  // Transposed (non-contiguous) inputs.
  auto ft = [](const std::vector<Tensor>& in) { return matmul(in[0].mT(), in[1].mT()); };
  EXPECT_TRUE(gradcheck(ft, {Tensor::randn({4, 3}, 42), Tensor::randn({5, 4}, 43)}).ok);
  // A linear layer: [B, T, C] @ [C, N] (the weight's gradient sums over B and T in one product).
  const GradcheckResult linear = gradcheck(f, {Tensor::randn({2, 3, 4}, 44), Tensor::randn({4, 5}, 45)});
  EXPECT_TRUE(linear.ok) << linear.message;
  // Same batch on both sides.
  EXPECT_TRUE(gradcheck(f, {Tensor::randn({2, 3, 4}, 46), Tensor::randn({2, 4, 5}, 47)}).ok);
}

TEST(MatmulGrad, OneDimensionalOperands) {
  auto f = [](const std::vector<Tensor>& in) { return matmul(in[0], in[1]); };
  EXPECT_TRUE(gradcheck(f, {Tensor::randn({4}, 48), Tensor::randn({4}, 49)}).ok);
  EXPECT_TRUE(gradcheck(f, {Tensor::randn({4}, 50), Tensor::randn({4, 3}, 51)}).ok);
  EXPECT_TRUE(gradcheck(f, {Tensor::randn({3, 4}, 52), Tensor::randn({4}, 53)}).ok);
}

TEST(MatmulGrad, BroadcastBatchDimsSumBack) {
  auto f = [](const std::vector<Tensor>& in) { return matmul(in[0], in[1]); };
  const GradcheckResult both = gradcheck(f, {Tensor::randn({2, 1, 3, 4}, 54), Tensor::randn({5, 4, 2}, 55)});
  EXPECT_TRUE(both.ok) << both.message;
  const GradcheckResult shared_a = gradcheck(f, {Tensor::randn({3, 4}, 56), Tensor::randn({2, 4, 2}, 57)});
  EXPECT_TRUE(shared_a.ok) << shared_a.message;
}

TEST(MatmulGrad, GradientsKeepEachOperandsDtype) {
  Tensor a = Tensor::rand({3, 4}, 58, DType::BF16).requires_grad_();
  Tensor b = Tensor::rand({4, 2}, 59, DType::F32).requires_grad_();
  backward({matmul(a, b)}, {Tensor::ones({3, 2})});
  EXPECT_EQ(a.grad().dtype(), DType::BF16);
  EXPECT_EQ(b.grad().dtype(), DType::F32);
  // d/db sum(a @ b) = a^T @ ones: column sums of a.
  const std::vector<double> av = a.to_vector<double>(), gb = b.grad().to_vector<double>();
  for (int k = 0; k < 4; ++k)
    EXPECT_NEAR(gb[static_cast<size_t>(k * 2)], av[k] + av[4 + k] + av[8 + k], 1e-6);
}

// ---- errors -----------------------------------------------------------------------------------------------

TEST(MatmulErrors, NameTheOpTheShapesAndTheProblem) {
  EXPECT_ERROR_MENTIONS(matmul(Tensor::ones({4, 3}), Tensor::ones({5, 2})), "matmul", "f32[4,3]", "f32[5,2]",
                        "inner dims differ (3 vs 5)");
  EXPECT_ERROR_MENTIONS(matmul(Tensor::ones({2, 3, 4}), Tensor::ones({3, 4, 2})), "matmul", "f32[2,3,4]",
                        "f32[3,4,2]", "batch dims", "do not broadcast");
  EXPECT_ERROR_MENTIONS(matmul(Tensor::ones({3}, DType::I64), Tensor::ones({3})), "matmul", "i64[3]",
                        "floating");
  EXPECT_ERROR_MENTIONS(matmul(Tensor::scalar(2), Tensor::ones({3})), "matmul", "f32[]", "at least 1 dim");
  EXPECT_ERROR_MENTIONS(matmul(Tensor::ones({3}), Tensor::ones({4})), "matmul", "f32[3]", "f32[4]",
                        "inner dims differ (3 vs 4)");
}

// ---- linear: x @ W^T + b with the bias in the matmul kernel ----------------------------------------------

namespace {

// x [..., K] @ w[N, K]^T + b[N] in double by index arithmetic (b may be undefined).
Tensor reference_linear(const Tensor& x, const Tensor& w, const Tensor& b) {
  const std::vector<double> xv = x.to_vector<double>(), wv = w.to_vector<double>();
  const std::vector<double> bv = b.defined() ? b.to_vector<double>() : std::vector<double>();
  const int64_t K = w.size(1), N = w.size(0), rows = x.numel() / K;
  std::vector<double> out(static_cast<size_t>(rows * N));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t n = 0; n < N; ++n) {
      double total = b.defined() ? bv[static_cast<size_t>(n)] : 0.0;
      for (int64_t k = 0; k < K; ++k)
        total += xv[static_cast<size_t>(r * K + k)] * wv[static_cast<size_t>(n * K + k)];
      out[static_cast<size_t>(r * N + n)] = total;
    }
  Shape shape = x.shape();
  shape.back() = N;
  return Tensor::from_vector(out, shape, DType::F64);
}

}  // namespace

TEST(Linear, MatchesTheReferenceInEveryDtypeWithAndWithoutBias) {
  // Positive data, so matches_reference's per-dtype bounds apply; for f16/bf16 the bias enters the fp32
  // accumulator, so the whole x W^T + b is rounded once (1 ulp, like a plain product).
  for (DType dtype : {DType::F32, DType::BF16, DType::F16, DType::F64}) {
    for (bool with_bias : {true, false}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + (with_bias ? " with bias" : " without bias"));
      const Tensor x = Tensor::rand({3, 17, 64}, 60, dtype), w = Tensor::rand({40, 64}, 61, dtype);
      const Tensor b = with_bias ? Tensor::rand({40}, 62, dtype) : Tensor();
      const Tensor out = linear(x, w, b);
      ASSERT_EQ(out.shape(), (Shape{3, 17, 40}));
      ASSERT_EQ(out.dtype(), dtype);
      EXPECT_TRUE(matches_reference(out, reference_linear(x, w, b)));
    }
  }
}

TEST(Linear, VectorInputStridedInputAndEmptyInnerDim) {
  const Tensor w = Tensor::rand({6, 5}, 63), b = Tensor::rand({6}, 64);
  const Tensor v = Tensor::rand({5}, 65);
  const Tensor out = linear(v, w, b);
  EXPECT_EQ(out.shape(), (Shape{6}));
  EXPECT_TRUE(all_close(out, reference_linear(v, w, b), 0, 1e-6));
  // A transposed (non-contiguous) input gives the values of its contiguous copy.
  const Tensor xt = Tensor::rand({5, 7}, 66).mT();
  EXPECT_TRUE(all_close(linear(xt, w, b), reference_linear(xt.contiguous(), w, b), 0, 1e-6));
  // K = 0: every row is the bias.
  const Tensor empty = linear(Tensor::zeros({4, 0}), Tensor::zeros({6, 0}), b);
  EXPECT_TRUE(all_close(empty, b.unsqueeze(0).expand({4, 6}), 0, 0));
}

TEST(Linear, EqualsMatmulPlusBiasInF32) {
  // The fused epilogue and the two-op composition differ only by the rounding of the bias add.
  const Tensor x = Tensor::randn({2, 9, 32}, 67), w = Tensor::randn({24, 32}, 68), b = Tensor::randn({24}, 69);
  EXPECT_TRUE(all_close(linear(x, w, b), add(matmul(x, w.mT()), b), 1e-5, 1e-5));
}

TEST(LinearGrad, MatchesFiniteDifferences) {
  auto f = [](const std::vector<Tensor>& in) { return linear(in[0], in[1], in[2]); };
  const GradcheckResult three_d =
      gradcheck(f, {Tensor::randn({2, 3, 4}, 70), Tensor::randn({5, 4}, 71), Tensor::randn({5}, 72)});
  EXPECT_TRUE(three_d.ok) << three_d.message;
  const GradcheckResult vector =
      gradcheck(f, {Tensor::randn({4}, 73), Tensor::randn({3, 4}, 74), Tensor::randn({3}, 75)});
  EXPECT_TRUE(vector.ok) << vector.message;
  auto no_bias = [](const std::vector<Tensor>& in) { return linear(in[0].mT(), in[1]); };
  const GradcheckResult strided = gradcheck(no_bias, {Tensor::randn({4, 3}, 76), Tensor::randn({2, 4}, 77)});
  EXPECT_TRUE(strided.ok) << strided.message;
}

// The backward's two products in every dtype, bitwise as matmul gives them one by one: also where the CPU
// multiplies f16 through f32 and the backward widens the incoming gradient once for both products.
TEST(LinearGrad, EqualsTheTwoProductsBitForBitInEveryDtype) {
  EXPECT_FALSE(backend_of(Tensor::zeros({1})).matmul_widens(DType::F32));
  for (cpu::Gemm16Isa route : mixtape::testing::gemm16_routes()) {  // each 16-bit route this build has
    const mixtape::testing::Gemm16Setting setting(route);
    SCOPED_TRACE(std::string("gemm16 ") + cpu::gemm16_isa_name(route));
    // f16 widens unless it has a GEMM of its own: bf16 pairs on AMX (MatmulF16.*), or gemm16 (Gemm16.*).
    EXPECT_EQ(backend_of(Tensor::zeros({1}, DType::F16)).matmul_widens(DType::F16),
              !cpu::f16_matmul_splits() && route == cpu::Gemm16Isa::None);
    for (const auto& [dtype, bf16_route] : dtypes_and_routes({DType::F32, DType::BF16, DType::F16, DType::F64})) {
      const mixtape::testing::Bf16GemmSetting bf16_setting(bf16_route);
      SCOPED_TRACE(std::string(dtype_name(dtype)) + ", bf16 route " + cpu::bf16_gemm_name(bf16_route));
      // bf16 widens where it takes the f32 route without gemm16.
      EXPECT_EQ(backend_of(Tensor::zeros({1}, DType::BF16)).matmul_widens(DType::BF16),
                bf16_route == cpu::Bf16Gemm::F32 && route == cpu::Gemm16Isa::None);
      Tensor x = Tensor::randn({3, 17, 64}, 80, dtype), w = Tensor::randn({40, 64}, 81, dtype);
      const Tensor g = Tensor::randn({3, 17, 40}, 82, dtype);
      x.requires_grad_();
      w.requires_grad_();
      backward({linear(x, w)}, {g});
      ASSERT_EQ(x.grad().dtype(), dtype);
      ASSERT_EQ(w.grad().dtype(), dtype);
      EXPECT_EQ(x.grad().to_vector<double>(), matmul(g, w.detach()).to_vector<double>());
      EXPECT_EQ(w.grad().to_vector<double>(),
                matmul(g.reshape({-1, 40}).mT(), x.detach().reshape({-1, 64})).to_vector<double>());
    }
  }
}

// matmul's backward shares the incoming gradient between its two products the same way: a matrix shared by
// the batch, and a batch of matrices (its gradient summed back from the broadcast).
TEST(MatmulGrad, EqualsTheTwoProductsBitForBitInEveryDtype) {
  for (cpu::Gemm16Isa route : mixtape::testing::gemm16_routes()) {
    const mixtape::testing::Gemm16Setting setting(route);
    for (const auto& [dtype, bf16_route] : dtypes_and_routes({DType::F32, DType::BF16, DType::F16})) {
      const mixtape::testing::Bf16GemmSetting bf16_setting(bf16_route);
      for (const Shape& w_shape : {Shape{64, 40}, Shape{1, 64, 40}}) {
        SCOPED_TRACE(std::string("gemm16 ") + cpu::gemm16_isa_name(route) + " " + dtype_name(dtype) +
                     shape_str(w_shape) + ", bf16 route " + cpu::bf16_gemm_name(bf16_route));
        Tensor x = Tensor::randn({3, 17, 64}, 83, dtype), w = Tensor::randn(w_shape, 84, dtype);
        const Tensor g = Tensor::randn({3, 17, 40}, 85, dtype);
        x.requires_grad_();
        w.requires_grad_();
        backward({matmul(x, w)}, {g});
        ASSERT_EQ(w.grad().shape(), w_shape);
        EXPECT_EQ(x.grad().to_vector<double>(), matmul(g, w.detach().mT()).to_vector<double>());
        const Tensor per_batch = matmul(x.detach().mT(), g);  // [3, 64, 40]
        const Tensor want = w_shape.size() == 2
                                ? matmul(x.detach().reshape({-1, 64}).mT(), g.reshape({-1, 40}))
                                : sum(per_batch, {0}, true);
        EXPECT_EQ(w.grad().to_vector<double>(), want.to_vector<double>());
      }
    }
  }
}

TEST(Bf16Gemm, TheAutomaticRouteFollowsTheDotProductRate) {
  using cpu::Bf16Gemm;
  // No oneDNN bf16 GEMM: f32 whatever the rate.
  EXPECT_EQ(cpu::automatic_bf16_gemm(false, false, 2.0), Bf16Gemm::F32);
  EXPECT_EQ(cpu::automatic_bf16_gemm(false, true, 2.0), Bf16Gemm::F32);
  // AMX: oneDNN's tiles, whatever the dot product does.
  EXPECT_EQ(cpu::automatic_bf16_gemm(true, true, 0.5), Bf16Gemm::Onednn);
  // A rate this build cannot measure keeps oneDNN's GEMM.
  EXPECT_EQ(cpu::automatic_bf16_gemm(true, false, 0.0), Bf16Gemm::Onednn);
  // The Xeon without AMX measured 0.48-0.50; AMD's Zen 4 and Zen 5 run bf16 GEMMs at ~2x f32. The bound: 0.75.
  EXPECT_EQ(cpu::automatic_bf16_gemm(true, false, 0.49), Bf16Gemm::F32);
  EXPECT_EQ(cpu::automatic_bf16_gemm(true, false, 0.7499), Bf16Gemm::F32);
  EXPECT_EQ(cpu::automatic_bf16_gemm(true, false, 0.75), Bf16Gemm::Onednn);
  EXPECT_EQ(cpu::automatic_bf16_gemm(true, false, 2.0), Bf16Gemm::Onednn);
}

TEST(Bf16Gemm, TheDotProductRateIsMeasuredWhereTheCpuHasTheInstruction) {
  const double rate = cpu::bf16_dot_rate();
  if (!__builtin_cpu_supports("avx512bf16")) {
    EXPECT_EQ(rate, 0.0);
    return;
  }
  if (rate == 0.0) GTEST_SKIP() << "the library was built without AVX512-BF16 (MIXTAPE_MARCH)";
  // One instruction per cycle or every few cycles against two FMAs per cycle: within (0.1, 10) of the FMA rate.
  EXPECT_GT(rate, 0.1);
  EXPECT_LT(rate, 10.0);
  EXPECT_EQ(cpu::bf16_dot_rate(), rate) << "measured once per process";
}

TEST(Bf16Gemm, TheEnvironmentVariableNamesARouteThisCpuHas) {
  using cpu::Bf16Gemm;
  EXPECT_EQ(cpu::bf16_gemm_from_env(nullptr), cpu::bf16_gemm_from_env("auto"));
  EXPECT_EQ(cpu::bf16_gemm_from_env(""), cpu::bf16_gemm_from_env("auto"));
  if (std::getenv("MIXTAPE_BF16_GEMM") == nullptr) {
    EXPECT_EQ(cpu::bf16_gemm(), cpu::bf16_gemm_from_env("auto"));
  }
  EXPECT_EQ(cpu::bf16_gemm_from_env("f32"), Bf16Gemm::F32);
  EXPECT_ERROR_MENTIONS(cpu::bf16_gemm_from_env("F32"), "MIXTAPE_BF16_GEMM=F32", "expected auto, onednn or f32");
  if (cpu::onednn_has_bf16_gemm()) {
    EXPECT_EQ(cpu::bf16_gemm_from_env("onednn"), Bf16Gemm::Onednn);
  } else {
    EXPECT_ERROR_MENTIONS(cpu::bf16_gemm_from_env("onednn"), "MIXTAPE_BF16_GEMM=onednn", "not supported",
                          "no bf16 GEMM");
    EXPECT_ERROR_MENTIONS(cpu::set_bf16_gemm(Bf16Gemm::Onednn), "set_bf16_gemm(onednn)", "not supported");
  }
}

// vdpbf16ps and AMX's tdpbf16ps treat subnormal inputs as zero (Intel's SDM); f32 FMAs keep them. So a product
// of bf16 subnormals shows which route ran: 32 products 2^-130 * 1 sum to 2^-125 exactly on f32 FMAs, to 0 on
// the dot product. Unbatched (gemm16 on the f32 route, where the build has it) and batched (a oneDNN plan: the
// f32 GEMM on widened operands, or the bf16 GEMM), each route asked for first and second, so that a plan cached
// under one route is never served to the other.
TEST(Bf16Gemm, SubnormalInputsShowWhichRouteRan) {
  const double tiny = std::ldexp(1.0, -130), sum = std::ldexp(1.0, -125);
  const Tensor a = Tensor::full({4, 32}, tiny, DType::BF16), b = Tensor::full({32, 16}, 1.0, DType::BF16);
  const Tensor a3 = Tensor::full({2, 4, 32}, tiny, DType::BF16), b3 = Tensor::full({2, 32, 16}, 1.0, DType::BF16);
  ASSERT_EQ(a.to_vector<double>()[0], tiny) << "bf16 holds 2^-130 as a subnormal";
  const bool flushes = __builtin_cpu_supports("avx512bf16") && cpu::onednn_has_bf16_gemm();
  std::vector<std::vector<cpu::Bf16Gemm>> orders = {{cpu::Bf16Gemm::F32}};
  if (cpu::onednn_has_bf16_gemm())
    orders = {{cpu::Bf16Gemm::Onednn, cpu::Bf16Gemm::F32}, {cpu::Bf16Gemm::F32, cpu::Bf16Gemm::Onednn}};
  for (const auto& order : orders) {
    for (cpu::Bf16Gemm route : order) {
      const mixtape::testing::Bf16GemmSetting setting(route);
      SCOPED_TRACE(cpu::bf16_gemm_name(route));
      for (const auto& [x, y] : {std::pair{a, b}, std::pair{a3, b3}}) {
        const std::vector<double> out = matmul(x, y).to_vector<double>();
        if (route == cpu::Bf16Gemm::F32) {
          EXPECT_EQ(out, std::vector<double>(out.size(), sum)) << shape_str(x.shape());
        } else if (flushes) {
          EXPECT_EQ(out, std::vector<double>(out.size(), 0.0)) << shape_str(x.shape());
        }
      }
    }
  }
}

TEST(LinearErrors, NameTheOpTheShapesAndTheProblem) {
  EXPECT_ERROR_MENTIONS(linear(Tensor::ones({2, 3}), Tensor::ones({4, 5})), "linear", "f32[2,3]", "f32[4,5]",
                        "weight [N, K]");
  EXPECT_ERROR_MENTIONS(linear(Tensor::ones({2, 3}), Tensor::ones({4, 3}), Tensor::ones({5})), "linear",
                        "f32[5]", "[N] = [4]");
  EXPECT_ERROR_MENTIONS(linear(Tensor::ones({2, 3}, DType::I32), Tensor::ones({4, 3})), "linear", "i32[2,3]",
                        "floating");
}
