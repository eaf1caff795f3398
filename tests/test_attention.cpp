// Causal scaled_dot_product_attention: the streaming kernel against the naive composition (matmul, causal
// mask, softmax, matmul) up to T = 1024, 16-bit results against f64, gradients against finite differences
// and against the composition's autograd, the O(T*D) memory claim, and the errors bad shapes raise.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "autograd/autograd.h"
#include "autograd/gradcheck.h"
#include "tensor/cpu/cpu_backend.h"
#include "tensor/ops.h"
#include "test_util.h"

using namespace mixtape;
using mixtape::testing::all_close;
using mixtape::testing::kFloatDtypes;
using mixtape::testing::uniform_tensor;
using mixtape::testing::within_ulp;

namespace {

// The textbook composition: softmax(q k^T / sqrt(D) with -inf above the diagonal) v, differentiable through
// the ordinary ops. Materialises [B, H, T, T].
Tensor naive_attention(const Tensor& q, const Tensor& k, const Tensor& v) {
  const int64_t T = q.size(2), D = q.size(3);
  std::vector<double> above(static_cast<size_t>(T * T));
  for (int64_t i = 0; i < T; ++i)
    for (int64_t j = 0; j < T; ++j) above[i * T + j] = j > i ? 1.0 : 0.0;
  const Tensor mask = Tensor::from_vector(above, {T, T}, DType::F32);
  const Tensor scores = matmul(q, k.mT()) * (1.0 / std::sqrt(static_cast<double>(D)));
  return matmul(softmax(masked_fill(scores, mask, -INFINITY), -1), v);
}

// Plain double loops from the definition, for the 16-bit tests: out_i = sum_{j<=i} softmax_j(q_i.k_j /
// sqrt(D)) v_j.
std::vector<double> reference_attention(const Tensor& q, const Tensor& k, const Tensor& v) {
  const int64_t BH = q.size(0) * q.size(1), T = q.size(2), D = q.size(3);
  const std::vector<double> qv = q.to_vector<double>(), kv = k.to_vector<double>(),
                            vv = v.to_vector<double>();
  std::vector<double> out(qv.size());
  const long double scale = 1.0L / std::sqrt(static_cast<long double>(D));
  std::vector<long double> s(static_cast<size_t>(T));
  for (int64_t h = 0; h < BH; ++h)
    for (int64_t i = 0; i < T; ++i) {
      const int64_t row = (h * T + i) * D;
      long double m = -INFINITY, sum = 0;
      for (int64_t j = 0; j <= i; ++j) {
        long double dot = 0;
        for (int64_t d = 0; d < D; ++d)
          dot += static_cast<long double>(qv[row + d]) * kv[(h * T + j) * D + d];
        s[j] = dot * scale;
        m = std::max(m, s[j]);
      }
      for (int64_t j = 0; j <= i; ++j) sum += std::exp(s[j] - m);
      for (int64_t d = 0; d < D; ++d) {
        long double o = 0;
        for (int64_t j = 0; j <= i; ++j) o += std::exp(s[j] - m) / sum * vv[(h * T + j) * D + d];
        out[row + d] = static_cast<double>(o);
      }
    }
  return out;
}

struct Grads3 {
  Tensor q, k, v;
};

// Gradients of <g, attention(q, k, v)> for the given attention function.
Grads3 attention_grads(const std::function<Tensor(const Tensor&, const Tensor&, const Tensor&)>& attention,
                       const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g) {
  Tensor qq = q.detach().requires_grad_(), kk = k.detach().requires_grad_(), vv = v.detach().requires_grad_();
  backward({attention(qq, kk, vv)}, {g});
  return {qq.grad(), kk.grad(), vv.grad()};
}

double max_abs(const Tensor& t) {
  double m = 0;
  for (double x : t.to_vector<double>()) m = std::max(m, std::abs(x));
  return m;
}

void expect_gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                      const std::vector<Tensor>& inputs) {
  const GradcheckResult result = gradcheck(f, inputs);
  EXPECT_TRUE(result.ok) << result.message;
}

// The most bytes the CPU allocator holds beyond what was live when `fn` started, at any moment during it.
// The allocator's peak only grows, so first a ballast tensor (never touched, so never paged in) lifts the
// live bytes to the current peak; after that, the peak rises by exactly the extra bytes fn needs.
size_t peak_extra_bytes(const std::function<void()>& fn) {
  cpu::CachingAllocator& allocator = cpu::cpu_backend().caching_allocator();
  const cpu::CachingAllocator::Stats before = allocator.stats();
  const size_t gap =
      before.peak_allocated_bytes - before.allocated_bytes;  // a multiple of 512 (rounded sizes)
  const Tensor ballast = gap > 0 ? Tensor::empty({static_cast<int64_t>(gap / 4)}) : Tensor();
  const size_t peak = allocator.stats().peak_allocated_bytes;
  EXPECT_EQ(allocator.stats().allocated_bytes, peak);
  fn();
  return allocator.stats().peak_allocated_bytes - peak;
}

}  // namespace

// ---- forward ---------------------------------------------------------------------------------------------

// Both sides compute in f32 from the same inputs; they differ only in summation order and in the kernel's
// polynomial exp (~1 ulp), so the outputs (size ~0.1..1 here) agree to 1e-5 relative to each value plus
// 1e-6 of the output scale (for the rare outputs near 0, where a relative bound means nothing).
TEST(Attention, MatchesNaiveCompositionAtLongSequenceInF32) {
  const int64_t B = 1, H = 2, T = 1024, D = 32;
  const Tensor q = uniform_tensor({B, H, T, D}, 1, -2, 2, DType::F32);
  const Tensor k = uniform_tensor({B, H, T, D}, 2, -2, 2, DType::F32);
  const Tensor v = uniform_tensor({B, H, T, D}, 3, -1, 1, DType::F32);
  const Tensor out = scaled_dot_product_attention(q, k, v);
  const Tensor naive = naive_attention(q, k, v);
  EXPECT_EQ(out.dtype(), DType::F32);
  EXPECT_TRUE(all_close(out, naive, 1e-6 * max_abs(naive), 1e-5));
  // And against the composition in f64 from the same values.
  const Tensor exact = naive_attention(q.to(DType::F64), k.to(DType::F64), v.to(DType::F64));
  EXPECT_TRUE(all_close(out, exact, 1e-6 * max_abs(exact), 1e-5));
}

// Several blocks with ragged ends (T = 150 is not a multiple of the 64-row blocks) in f64: the online
// softmax's rescaling across blocks must be exact to rounding.
// D = 16 fills the f64 register tile exactly, so the kernel reads q and v in place instead of padded copies.
TEST(Attention, MatchesNaiveCompositionAcrossRaggedBlocksInF64) {
  for (int64_t D : {5, 16})
    for (int64_t T : {1, 63, 64, 65, 150}) {
      const Tensor q = uniform_tensor({2, 3, T, D}, 4, -3, 3, DType::F64);
      const Tensor k = uniform_tensor({2, 3, T, D}, 5, -3, 3, DType::F64);
      const Tensor v = uniform_tensor({2, 3, T, D}, 6, -1, 1, DType::F64);
      EXPECT_TRUE(all_close(scaled_dot_product_attention(q, k, v), naive_attention(q, k, v), 1e-14, 1e-12))
          << "T = " << T << ", D = " << D;
    }
}

// With v in [1, 2] each output is a convex combination of values in [1, 2], so there is no cancellation: the
// fp32 accumulation is within ~T * 2^-24 relative (T <= 200: ~1e-5 of a 16-bit ulp), and the one rounding
// on store gives at most 1 ulp from the f64 reference rounded to the dtype.
TEST(Attention, SixteenBitOutputsAreWithinOneUlpOfF64) {
  const Shape shape = {2, 2, 200, 16};
  for (DType dtype : {DType::F16, DType::BF16}) {
    const Tensor q = uniform_tensor(shape, 7, -2, 2, dtype);
    const Tensor k = uniform_tensor(shape, 8, -2, 2, dtype);
    const Tensor v = uniform_tensor(shape, 9, 1, 2, dtype);
    const Tensor out = scaled_dot_product_attention(q, k, v);
    EXPECT_EQ(out.dtype(), dtype);
    EXPECT_TRUE(within_ulp(out, Tensor::from_vector(reference_attention(q, k, v), shape, DType::F64), 1))
        << dtype_name(dtype);
    // Mixed-sign v: outputs may cancel towards 0, where ulps shrink; the error stays within half an ulp of 1
    // (the output scale) plus the fp32 accumulation error.
    const Tensor v_signed = uniform_tensor(shape, 10, -1, 1, dtype);
    const double half_ulp_of_one = dtype == DType::F16 ? 0x1p-11 : 0x1p-8;
    EXPECT_TRUE(all_close(scaled_dot_product_attention(q, k, v_signed),
                          Tensor::from_vector(reference_attention(q, k, v_signed), shape, DType::F64),
                          half_ulp_of_one + 1e-5, 0))
        << dtype_name(dtype);
  }
}

TEST(Attention, EmptySequenceOrBatchGivesEmptyOutputAndGradients) {
  for (const Shape& shape : {Shape{1, 2, 0, 4}, Shape{0, 2, 5, 4}}) {
    Tensor q = Tensor::zeros(shape).requires_grad_();
    const Tensor out = scaled_dot_product_attention(q, q, q);
    EXPECT_EQ(out.shape(), shape);
    backward({out}, {Tensor::zeros(shape)});
    EXPECT_EQ(q.grad().shape(), shape);
  }
}

// The qkv split of a fused projection: q, k, v are strided views of one [B, T, 3, H, D] tensor.
TEST(Attention, AcceptsStridedViewsFromAFusedProjection) {
  const int64_t B = 2, T = 70, H = 3, D = 8;
  const Tensor qkv = uniform_tensor({B, T, 3, H, D}, 11, -1, 1, DType::F64);
  const Tensor q = qkv.select(2, 0).permute({0, 2, 1, 3});
  const Tensor k = qkv.select(2, 1).permute({0, 2, 1, 3});
  const Tensor v = qkv.select(2, 2).permute({0, 2, 1, 3});
  ASSERT_FALSE(q.is_contiguous());
  EXPECT_TRUE(all_close(scaled_dot_product_attention(q, k, v),
                        naive_attention(q.contiguous(), k.contiguous(), v.contiguous()), 1e-14, 1e-12));
}

// ---- backward --------------------------------------------------------------------------------------------

TEST(Attention, GradientsMatchFiniteDifferences) {
  // Small T, D, including T that no block size divides; the kernel's blocks are larger, so every case also
  // checks ragged blocks.
  for (const auto& [T, D] : std::vector<std::pair<int64_t, int64_t>>{{5, 3}, {7, 4}, {9, 3}}) {
    expect_gradcheck(
        [](const std::vector<Tensor>& in) { return scaled_dot_product_attention(in[0], in[1], in[2]); },
        {uniform_tensor({2, 2, T, D}, 12, -1, 1, DType::F64),
         uniform_tensor({2, 2, T, D}, 13, -1, 1, DType::F64),
         uniform_tensor({2, 2, T, D}, 14, -1, 1, DType::F64)});
  }
  // Through strided views of one fused qkv tensor.
  expect_gradcheck(
      [](const std::vector<Tensor>& in) {
        const Tensor& qkv = in[0];  // [B, T, 3, H, D]
        return scaled_dot_product_attention(qkv.select(2, 0).permute({0, 2, 1, 3}),
                                            qkv.select(2, 1).permute({0, 2, 1, 3}),
                                            qkv.select(2, 2).permute({0, 2, 1, 3}));
      },
      {uniform_tensor({1, 6, 3, 2, 4}, 15, -1, 1, DType::F64)});
}

// Gradients through several blocks (T = 150: two full 64-blocks and a ragged one; B*H = 2 splits the key
// blocks of a head into groups whose dq partials are summed; D = 16 reads q, k, do in place) against the
// composition's autograd in f64.
TEST(Attention, GradientsMatchNaiveCompositionAcrossBlocks) {
  for (const Shape& shape : {Shape{1, 2, 150, 5}, Shape{3, 4, 130, 7}, Shape{1, 3, 70, 16}}) {
    const Tensor q = uniform_tensor(shape, 16, -2, 2, DType::F64);
    const Tensor k = uniform_tensor(shape, 17, -2, 2, DType::F64);
    const Tensor v = uniform_tensor(shape, 18, -1, 1, DType::F64);
    const Tensor g = uniform_tensor(shape, 19, -1, 1, DType::F64);
    const Grads3 fused = attention_grads(scaled_dot_product_attention, q, k, v, g);
    const Grads3 naive = attention_grads(naive_attention, q, k, v, g);
    EXPECT_TRUE(all_close(fused.q, naive.q, 1e-13, 1e-11)) << shape_str(shape);
    EXPECT_TRUE(all_close(fused.k, naive.k, 1e-13, 1e-11)) << shape_str(shape);
    EXPECT_TRUE(all_close(fused.v, naive.v, 1e-13, 1e-11)) << shape_str(shape);
  }
}

// f32 and 16-bit gradients against the f64 composition's, relative to each gradient's scale: fp32
// accumulation over <= T terms keeps f32 within ~1e-5 of it; 16-bit inputs and dout give 16-bit grads
// within a few ulps of the scale (the rounded out and dout enter delta, then one rounding on store).
TEST(Attention, GradientsInEveryDtypeMatchF64Composition) {
  const Shape shape = {2, 2, 100, 16};
  for (const auto& [dtype, tolerance] : std::vector<std::pair<DType, double>>{
           {DType::F32, 1e-5}, {DType::F16, 4 * 0x1p-11}, {DType::BF16, 4 * 0x1p-8}}) {
    const Tensor q = uniform_tensor(shape, 20, -2, 2, dtype);
    const Tensor k = uniform_tensor(shape, 21, -2, 2, dtype);
    const Tensor v = uniform_tensor(shape, 22, -1, 1, dtype);
    const Tensor g = uniform_tensor(shape, 23, -1, 1, dtype);
    const Grads3 fused = attention_grads(scaled_dot_product_attention, q, k, v, g);
    auto to64 = [](const Tensor& t) { return t.to(DType::F64); };
    const Grads3 exact = attention_grads(naive_attention, to64(q), to64(k), to64(v), to64(g));
    for (const auto& [got, want] : {std::pair{fused.q, exact.q}, {fused.k, exact.k}, {fused.v, exact.v}}) {
      EXPECT_EQ(got.dtype(), dtype);
      EXPECT_TRUE(all_close(got, want, tolerance * max_abs(want), 0)) << dtype_name(dtype);
    }
  }
}

// Query blocks are independent tasks and the backward's split into tasks depends on the shape only, so one
// and two threads give bitwise the same results.
TEST(Attention, ResultDoesNotDependOnThreadCount) {
  const Shape shape = {1, 2, 300, 32};  // few heads: the backward splits key blocks into groups
  const Tensor q = uniform_tensor(shape, 24, -2, 2, DType::F32);
  const Tensor k = uniform_tensor(shape, 25, -2, 2, DType::F32);
  const Tensor v = uniform_tensor(shape, 26, -1, 1, DType::F32);
  const Tensor g = uniform_tensor(shape, 27, -1, 1, DType::F32);
  auto run = [&](int threads) {
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    Tensor qq = q.detach().requires_grad_(), kk = k.detach().requires_grad_(),
           vv = v.detach().requires_grad_();
    const Tensor out = scaled_dot_product_attention(qq, kk, vv);
    backward({out}, {g});
    omp_set_num_threads(saved);
    std::vector<std::vector<double>> values = {out.to_vector<double>(), qq.grad().to_vector<double>(),
                                               kk.grad().to_vector<double>(), vv.grad().to_vector<double>()};
    return values;
  };
  EXPECT_EQ(run(1), run(2));
}

// ---- memory ----------------------------------------------------------------------------------------------

// At T = 2048 one head's score matrix alone is T*T*4 = 16 MiB. The fused forward + backward needs only the
// output and the three gradients (4 x the [B, H, T, D] input size), lse and delta ([B, H, T]), the forward's
// k^T copy (1 x, freed before the backward) and the backward's fp32 dq accumulators: with B*H = 2 the
// backward splits each head's key blocks into 2 groups with one [T, D] accumulator each (2 x). The autograd
// engine then copies the three gradients into the leaves' .grad (3 x, after the kernel's scratch is freed).
// The peak is ~7 x the input: linear in T, and at T/D = 64 already 9 x below B*H*T*T*4, which the naive
// composition, measured the same way, exceeds.
TEST(Attention, MemoryStaysLinearInSequenceLength) {
  const int64_t B = 1, H = 2, T = 2048, D = 32;
  const Tensor q = uniform_tensor({B, H, T, D}, 28, -1, 1, DType::F32).requires_grad_();
  const Tensor k = uniform_tensor({B, H, T, D}, 29, -1, 1, DType::F32).requires_grad_();
  const Tensor v = uniform_tensor({B, H, T, D}, 30, -1, 1, DType::F32).requires_grad_();
  const Tensor g = uniform_tensor({B, H, T, D}, 31, -1, 1, DType::F32);
  const size_t input_bytes = static_cast<size_t>(B * H * T * D * 4);
  const size_t scores_bytes = static_cast<size_t>(B * H * T * T * 4);
  const size_t fused = peak_extra_bytes([&] { backward({scaled_dot_product_attention(q, k, v)}, {g}); });
  EXPECT_GT(fused, 4 * input_bytes);  // the measurement sees the outputs and gradients at least
  EXPECT_LE(fused, 7 * input_bytes) << fused << " bytes";
  EXPECT_LT(fused, scores_bytes / 9) << fused << " bytes";
  const size_t naive = peak_extra_bytes([&] { backward({naive_attention(q, k, v)}, {g}); });
  EXPECT_GT(naive, scores_bytes) << naive << " bytes";
}

// ---- errors ----------------------------------------------------------------------------------------------

TEST(Attention, RejectsMismatchedShapesDtypesAndHeadDims) {
  const Tensor q = Tensor::zeros({2, 3, 8, 4});
  EXPECT_ERROR_MENTIONS(scaled_dot_product_attention(q, Tensor::zeros({2, 3, 8, 5}), q),
                        "scaled_dot_product_attention", "head dim", "f32[2,3,8,4]", "f32[2,3,8,5]");
  EXPECT_ERROR_MENTIONS(scaled_dot_product_attention(q, q, Tensor::zeros({2, 3, 8, 6})),
                        "scaled_dot_product_attention", "head dim", "f32[2,3,8,6]");
  EXPECT_ERROR_MENTIONS(scaled_dot_product_attention(q, Tensor::zeros({2, 3, 9, 4}), q),
                        "scaled_dot_product_attention", "f32[2,3,9,4]", "f32[2,3,8,4]", "shape");
  EXPECT_ERROR_MENTIONS(scaled_dot_product_attention(q, q, Tensor::zeros({1, 3, 8, 4})),
                        "scaled_dot_product_attention", "f32[1,3,8,4]");
  EXPECT_ERROR_MENTIONS(scaled_dot_product_attention(Tensor::zeros({3, 8, 4}), Tensor::zeros({3, 8, 4}),
                                                     Tensor::zeros({3, 8, 4})),
                        "scaled_dot_product_attention", "[B, H, T, D]", "f32[3,8,4]");
  EXPECT_ERROR_MENTIONS(scaled_dot_product_attention(q, q.to(DType::F16), q), "scaled_dot_product_attention",
                        "dtype", "f16[2,3,8,4]");
  const Tensor qi = Tensor::zeros({2, 3, 8, 4}, DType::I32);
  EXPECT_ERROR_MENTIONS(scaled_dot_product_attention(qi, qi, qi), "scaled_dot_product_attention", "floating",
                        "i32[2,3,8,4]");
}
