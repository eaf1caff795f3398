// Causal scaled_dot_product_attention: the streaming kernel against the naive composition (matmul, causal
// mask, softmax, matmul) up to T = 1024, 16-bit results against f64, gradients against finite differences
// and against the composition's autograd, strided (non-contiguous) heads against contiguous ones bit for bit,
// the O(T*D) memory claim, and the errors bad shapes raise. Then causal_self_attention (heads read in place
// in a fused [B, T, 3C] qkv): against a plain double reference, bit for bit against the split / view /
// scaled_dot_product_attention / merge composition it replaces, gradcheck, no copies, and its errors.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "autograd/autograd.h"
#include "autograd/gradcheck.h"
#include "tensor/cpu/attention_bf16.h"
#include "tensor/cpu/cpu_backend.h"
#include "tensor/ops.h"
#include "test_util.h"

using namespace mixtape;
using mixtape::testing::all_close;
using mixtape::testing::kFloatDtypes;
using mixtape::testing::peak_extra_bytes;
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
// D = 70 and T = 75 take the keys' transposed copy through its edges: 8 x 8 register blocks, then a head dim
// past one 64-wide chunk with a ragged 6, and 3 keys left over in the last block.
TEST(Attention, GradientsInEveryDtypeMatchF64Composition) {
  for (const Shape& shape : {Shape{2, 2, 100, 16}, Shape{1, 2, 75, 70}}) {
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
        EXPECT_TRUE(all_close(got, want, tolerance * max_abs(want), 0)) << dtype_name(dtype) << shape_str(shape);
      }
    }
  }
}

// Query blocks are independent tasks and the backward's split into tasks depends on the shape only, so one
// and two threads give bitwise the same results. The bf16 case with D = 64 takes a bf16 kernel (AMX or
// AVX512-BF16) where the CPU has one (one task per head there).
TEST(Attention, ResultDoesNotDependOnThreadCount) {
  struct Case {
    DType dtype;
    Shape shape;  // few heads in f32: the backward splits key blocks into groups
  };
  for (const Case& c : {Case{DType::F32, {1, 2, 300, 32}}, Case{DType::BF16, {2, 3, 200, 64}}}) {
    const Tensor q = uniform_tensor(c.shape, 24, -2, 2, c.dtype);
    const Tensor k = uniform_tensor(c.shape, 25, -2, 2, c.dtype);
    const Tensor v = uniform_tensor(c.shape, 26, -1, 1, c.dtype);
    const Tensor g = uniform_tensor(c.shape, 27, -1, 1, c.dtype);
    auto run = [&](int threads) {
      const int saved = omp_get_max_threads();
      omp_set_num_threads(threads);
      const Tensor out = scaled_dot_product_attention(q, k, v);
      const Grads3 grads = attention_grads(scaled_dot_product_attention, q, k, v, g);
      omp_set_num_threads(saved);
      return std::vector<std::vector<double>>{out.to_vector<double>(), grads.q.to_vector<double>(),
                                              grads.k.to_vector<double>(), grads.v.to_vector<double>()};
    };
    EXPECT_EQ(run(1), run(2)) << dtype_name(c.dtype) << shape_str(c.shape);
  }
}

// ---- the bf16 kernels (bf16, D a multiple of 32, on a CPU with AMX-BF16 or AVX512-BF16) ---------------------
// Each test runs every such kernel this CPU has, chosen through set_bf16_attention_kernel.

namespace {

using cpu::Bf16AttentionKernel;
using mixtape::testing::Bf16AttentionKernelScope;

std::vector<Bf16AttentionKernel> bf16_kernels() {
  std::vector<Bf16AttentionKernel> kernels;
  for (Bf16AttentionKernel kernel : {Bf16AttentionKernel::Amx, Bf16AttentionKernel::Avx512Bf16})
    if (cpu::bf16_attention_kernel_available(kernel)) kernels.push_back(kernel);
  return kernels;
}

#define SKIP_WITHOUT_BF16_KERNEL()                                                                            \
  if (bf16_kernels().empty()) GTEST_SKIP() << "this CPU (or build, or OS) has neither AMX-BF16 nor AVX512-BF16"

// Ragged T (padding rows and keys), one block and several, D of 1, 2 and 3 block widths.
const std::vector<Shape> kBf16Shapes = {{2, 3, 200, 64}, {1, 2, 33, 32}, {2, 1, 130, 96}};

}  // namespace

TEST(Bf16Attention, DefaultsToTheFastestKernelForThisCpu) {
  // AMX tiles where the CPU has them; else the AVX512-BF16 dot products, unless they are slow (below 0.75 of
  // the f32 FMA rate: the Xeon without AMX, 0.48-0.50), where the portable kernel's f32 FMAs were faster.
  Bf16AttentionKernel fastest = Bf16AttentionKernel::Portable;
  if (cpu::bf16_attention_kernel_available(Bf16AttentionKernel::Avx512Bf16) &&
      !cpu::slow_bf16_dot(cpu::bf16_dot_rate()))
    fastest = Bf16AttentionKernel::Avx512Bf16;
  if (cpu::bf16_attention_kernel_available(Bf16AttentionKernel::Amx)) fastest = Bf16AttentionKernel::Amx;
  EXPECT_EQ(cpu::bf16_attention_kernel(), fastest) << cpu::bf16_attention_kernel_name(cpu::bf16_attention_kernel());
  EXPECT_TRUE(cpu::bf16_attention_kernel_available(Bf16AttentionKernel::Portable));
}

TEST(Bf16Attention, TheAutomaticKernelFollowsTheDotProductRate) {
  // AMX first, whatever the dot product does.
  EXPECT_EQ(cpu::automatic_bf16_attention_kernel(true, true, 0.5), Bf16AttentionKernel::Amx);
  EXPECT_EQ(cpu::automatic_bf16_attention_kernel(true, false, 0.0), Bf16AttentionKernel::Amx);
  // The dot products at or above 0.75 of the FMA rate, or at a rate this build cannot measure.
  EXPECT_EQ(cpu::automatic_bf16_attention_kernel(false, true, 2.0), Bf16AttentionKernel::Avx512Bf16);
  EXPECT_EQ(cpu::automatic_bf16_attention_kernel(false, true, 0.75), Bf16AttentionKernel::Avx512Bf16);
  EXPECT_EQ(cpu::automatic_bf16_attention_kernel(false, true, 0.0), Bf16AttentionKernel::Avx512Bf16);
  // Below it, the portable kernel; and without either instruction.
  EXPECT_EQ(cpu::automatic_bf16_attention_kernel(false, true, 0.7499), Bf16AttentionKernel::Portable);
  EXPECT_EQ(cpu::automatic_bf16_attention_kernel(false, true, 0.49), Bf16AttentionKernel::Portable);
  EXPECT_EQ(cpu::automatic_bf16_attention_kernel(false, false, 2.0), Bf16AttentionKernel::Portable);
}

TEST(Bf16Attention, RefusesAKernelThisCpuLacks) {
  bool any_missing = false;
  for (Bf16AttentionKernel kernel : {Bf16AttentionKernel::Amx, Bf16AttentionKernel::Avx512Bf16}) {
    if (cpu::bf16_attention_kernel_available(kernel)) continue;
    any_missing = true;
    const Bf16AttentionKernel before = cpu::bf16_attention_kernel();
    EXPECT_ERROR_MENTIONS(cpu::set_bf16_attention_kernel(kernel), "set_bf16_attention_kernel", "not supported",
                         cpu::bf16_attention_kernel_name(kernel));
    EXPECT_EQ(cpu::bf16_attention_kernel(), before);
  }
  if (!any_missing) GTEST_SKIP() << "this CPU has every bf16 attention kernel";
}

TEST(Bf16Attention, ServesBf16WithWholeBlockHeadDimsOnly) {
  SKIP_WITHOUT_BF16_KERNEL();
  for (Bf16AttentionKernel kernel : bf16_kernels()) {
    const Bf16AttentionKernelScope scope(kernel);
    EXPECT_EQ(cpu::bf16_attention_kernel_for(DType::BF16, 64), kernel);
    EXPECT_EQ(cpu::bf16_attention_kernel_for(DType::BF16, 32), kernel);
    for (const auto& [dtype, D] : {std::pair{DType::BF16, int64_t{16}}, {DType::BF16, 70}, {DType::BF16, 0},
                                   {DType::F16, 64}, {DType::F32, 64}})
      EXPECT_EQ(cpu::bf16_attention_kernel_for(dtype, D), Bf16AttentionKernel::Portable) << dtype_name(dtype) << D;
  }
  const mixtape::testing::PortableAttention portable;
  EXPECT_EQ(cpu::bf16_attention_kernel_for(DType::BF16, 64), Bf16AttentionKernel::Portable);
}

// out = sum_j p~_j v_j / sum_j p~_j with p~ the bf16-rounded probabilities: a convex combination of the v
// rows whose weights are off by at most 2^-9 relative each, so with v in [1, 2] (outputs in [1, 2], where a
// bf16 ulp is 2^-7) the value before its rounding is within 2^-9 * (max v - min v) <= 2^-9 = 1/4 ulp of the
// exact one, plus fp32 noise; rounding adds at most 1/2 ulp: within 1 ulp in all. Mixed-sign v: within half
// an ulp of 1 (the rounding at the output's scale) plus that 2^-9 * 2 of the weights.
TEST(Bf16Attention, OutputsAreWithinOneUlpOfF64) {
  SKIP_WITHOUT_BF16_KERNEL();
  for (Bf16AttentionKernel kernel : bf16_kernels()) {
    const Bf16AttentionKernelScope scope(kernel);
    for (const Shape& shape : kBf16Shapes) {
      const Tensor q = uniform_tensor(shape, 50, -2, 2, DType::BF16);
      const Tensor k = uniform_tensor(shape, 51, -2, 2, DType::BF16);
      const Tensor v = uniform_tensor(shape, 52, 1, 2, DType::BF16);
      const Tensor out = scaled_dot_product_attention(q, k, v);
      EXPECT_TRUE(within_ulp(out, Tensor::from_vector(reference_attention(q, k, v), shape, DType::F64), 1))
          << cpu::bf16_attention_kernel_name(kernel) << shape_str(shape);
      const Tensor v_signed = uniform_tensor(shape, 53, -1, 1, DType::BF16);
      EXPECT_TRUE(all_close(scaled_dot_product_attention(q, k, v_signed),
                            Tensor::from_vector(reference_attention(q, k, v_signed), shape, DType::F64),
                            0x1p-8 + 0x1p-8 + 1e-5, 0))
          << cpu::bf16_attention_kernel_name(kernel) << shape_str(shape);
    }
  }
}

// The tolerance of GradientsInEveryDtypeMatchF64Composition for bf16 (4 bf16 ulps of the largest gradient):
// on top of the portable kernel's roundings, p and ds are rounded to bf16 (2^-9 relative) before their
// products, an error of the same order as the gradients' own rounding.
TEST(Bf16Attention, GradientsMatchF64Composition) {
  SKIP_WITHOUT_BF16_KERNEL();
  for (Bf16AttentionKernel kernel : bf16_kernels()) {
    const Bf16AttentionKernelScope scope(kernel);
    for (const Shape& shape : kBf16Shapes) {
      const Tensor q = uniform_tensor(shape, 54, -2, 2, DType::BF16);
      const Tensor k = uniform_tensor(shape, 55, -2, 2, DType::BF16);
      const Tensor v = uniform_tensor(shape, 56, -1, 1, DType::BF16);
      const Tensor g = uniform_tensor(shape, 57, -1, 1, DType::BF16);
      const Grads3 got = attention_grads(scaled_dot_product_attention, q, k, v, g);
      auto to64 = [](const Tensor& t) { return t.to(DType::F64); };
      const Grads3 exact = attention_grads(naive_attention, to64(q), to64(k), to64(v), to64(g));
      for (const auto& [grad, want] : {std::pair{got.q, exact.q}, {got.k, exact.k}, {got.v, exact.v}}) {
        EXPECT_EQ(grad.dtype(), DType::BF16);
        EXPECT_TRUE(all_close(grad, want, 4 * 0x1p-8 * max_abs(want), 0))
            << cpu::bf16_attention_kernel_name(kernel) << shape_str(shape);
      }
    }
  }
}

// The dispatch reaches each bf16 kernel: it rounds p to bf16 where the portable kernel keeps fp32, so the two
// give different bits on the same inputs (and agree within the bf16 tolerances above).
TEST(Bf16Attention, DiffersFromThePortableKernelInTheLastBits) {
  SKIP_WITHOUT_BF16_KERNEL();
  const Shape shape = {16, 4, 128, 64};
  const Tensor q = uniform_tensor(shape, 58, -2, 2, DType::BF16);
  const Tensor k = uniform_tensor(shape, 59, -2, 2, DType::BF16);
  const Tensor v = uniform_tensor(shape, 60, -1, 1, DType::BF16);
  Tensor portable;
  {
    const mixtape::testing::PortableAttention scope;
    portable = scaled_dot_product_attention(q, k, v);
  }
  for (Bf16AttentionKernel kernel : bf16_kernels()) {
    const Bf16AttentionKernelScope scope(kernel);
    const Tensor fast = scaled_dot_product_attention(q, k, v);
    EXPECT_NE(fast.to_vector<double>(), portable.to_vector<double>()) << cpu::bf16_attention_kernel_name(kernel);
    EXPECT_TRUE(all_close(fast, portable, 2 * 0x1p-8, 0)) << cpu::bf16_attention_kernel_name(kernel);
  }
}

// Heads whose rows start at odd bf16 offsets (a [.., D + 1] tensor narrowed to its last D columns: row stride
// D + 1, rows 2-byte but not 4-byte aligned, read as bf16 pairs by the packing; T = 100 leaves 4 rows past the
// 16-row register transposes) give bitwise the contiguous heads' results; so do the heads of a fused qkv. At
// T = 128 (whole blocks) the kernels read q and the output gradient in place, at T = 100 from packed copies.
// (The f64 tests above catch a packing that is wrong for both alike.)
TEST(Bf16Attention, OddOffsetAndFusedHeadsGiveBitwiseTheContiguousResults) {
  SKIP_WITHOUT_BF16_KERNEL();
  for (Bf16AttentionKernel kernel : bf16_kernels()) {
    for (const int64_t T : {int64_t{100}, int64_t{128}}) {
      SCOPED_TRACE(std::string(cpu::bf16_attention_kernel_name(kernel)) + ", T = " + std::to_string(T));
      const Bf16AttentionKernelScope scope(kernel);
      const int64_t B = 2, H = 2, D = 64;
      auto odd_rows = [&](uint64_t seed, double lo, double hi) {
        return uniform_tensor({B, H, T, D + 1}, seed, lo, hi, DType::BF16).narrow(3, 1, D);
      };
      const Tensor q = odd_rows(70, -2, 2), k = odd_rows(71, -2, 2);
      const Tensor v = odd_rows(72, -1, 1), g = odd_rows(73, -1, 1);
      ASSERT_EQ(q.stride(2), D + 1);
      const Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), gc = g.contiguous();
      const Grads3 odd = attention_grads(scaled_dot_product_attention, q, k, v, g);
      const Grads3 plain = attention_grads(scaled_dot_product_attention, qc, kc, vc, gc);
      EXPECT_EQ(scaled_dot_product_attention(q, k, v).to_vector<double>(),
                scaled_dot_product_attention(qc, kc, vc).to_vector<double>());
      EXPECT_EQ(odd.q.to_vector<double>(), plain.q.to_vector<double>());
      EXPECT_EQ(odd.k.to_vector<double>(), plain.k.to_vector<double>());
      EXPECT_EQ(odd.v.to_vector<double>(), plain.v.to_vector<double>());
      // The thirds of a fused [B, T, 3, H, D] projection, viewed as [B, H, T, D].
      const Tensor qkv = uniform_tensor({B, T, 3, H, D}, 74, -2, 2, DType::BF16);
      auto third = [&](int64_t i) { return qkv.select(2, i).permute({0, 2, 1, 3}); };
      EXPECT_EQ(scaled_dot_product_attention(third(0), third(1), third(2)).to_vector<double>(),
                scaled_dot_product_attention(third(0).contiguous(), third(1).contiguous(), third(2).contiguous())
                    .to_vector<double>());
    }
  }
}

// The per-thread scratch comes from the caching allocator (tensor/cpu/scratch.h), not from the heap: its peak
// rises during a call by at least one thread's packed head buffers (3 in the forward, 8 in the backward,
// [Tp, D] bf16 each), and a repeated call takes its blocks from the cache, so the allocator holds no new
// memory after it.
TEST(Bf16Attention, TakesItsScratchFromTheCachingAllocator) {
  SKIP_WITHOUT_BF16_KERNEL();
  cpu::CachingAllocator& allocator = cpu::cpu_backend().caching_allocator();
  const int64_t B = 2, H = 4, T = 128, D = 64;
  const size_t head_bytes = static_cast<size_t>(T * D * 2);
  for (Bf16AttentionKernel kernel : bf16_kernels()) {
    SCOPED_TRACE(cpu::bf16_attention_kernel_name(kernel));
    const Tensor q = uniform_tensor({B, H, T, D}, 80, -2, 2, DType::BF16);
    const Tensor k = uniform_tensor({B, H, T, D}, 81, -2, 2, DType::BF16);
    const Tensor v = uniform_tensor({B, H, T, D}, 82, -1, 1, DType::BF16);
    const Tensor g = uniform_tensor({B, H, T, D}, 83, -1, 1, DType::BF16);
    const Tensor out = Tensor::empty(q.shape(), DType::BF16), lse = Tensor::empty({B, H, T});
    const Tensor gq = Tensor::empty(q.shape(), DType::BF16), gk = Tensor::empty(q.shape(), DType::BF16);
    const Tensor gv = Tensor::empty(q.shape(), DType::BF16);
    auto forward = [&] { cpu::bf16_causal_attention(kernel, q, k, v, 0.125, out, lse); };
    auto backward = [&] { cpu::bf16_causal_attention_backward(kernel, g, q, k, v, out, lse, 0.125, gq, gk, gv); };
    EXPECT_GE(peak_extra_bytes(forward), 3 * head_bytes);
    EXPECT_GE(peak_extra_bytes(backward), 8 * head_bytes);
    const cpu::CachingAllocator::Stats before = allocator.stats();
    backward();
    const cpu::CachingAllocator::Stats after = allocator.stats();
    EXPECT_EQ(after.allocated_bytes + after.cached_bytes, before.allocated_bytes + before.cached_bytes);
  }
}

// ---- memory ----------------------------------------------------------------------------------------------

// At T = 2048 one head's score matrix alone is T*T*4 = 16 MiB. The fused forward + backward needs only the
// output and the three gradients (4 x the [B, H, T, D] input size), lse and delta ([B, H, T]), the forward's
// k^T copy (1 x, freed before the backward) and the backward's fp32 dq accumulators: with B*H = 2 the
// backward splits each head's key blocks into 2 groups with one [T, D] accumulator each (2 x). The autograd
// engine hands the three gradients to the leaves as their .grad without copying them. The peak is ~6 x the
// input (at most 7 x is checked): linear in T, and at T/D = 64 already 9 x below B*H*T*T*4, which the naive
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

// ---- strided heads ---------------------------------------------------------------------------------------

namespace {

// The layouts a [B, H, T, D] operand arrives in, each built from its own base tensor holding `values`
// (contiguous [B, H, T, D]) at the viewed positions.
enum class Layout { Contiguous, HeadsOfTokens, EveryOtherRow, WideBatchStride, StridedHeadDim };

const char* layout_name(Layout layout) {
  switch (layout) {
    case Layout::Contiguous: return "contiguous";
    case Layout::HeadsOfTokens: return "[B, T, H, D] transposed";
    case Layout::EveryOtherRow: return "every other row of [B, H, 2T+1, D]";
    case Layout::WideBatchStride: return "select(1, 1) of [B, 2, H, T, D]";
    case Layout::StridedHeadDim: return "[B, H, D, T] transposed";
  }
  return "";
}

Tensor in_layout(const Tensor& values, Layout layout) {
  const int64_t B = values.size(0), H = values.size(1), T = values.size(2), D = values.size(3);
  switch (layout) {
    case Layout::Contiguous:
      return values.clone();
    case Layout::HeadsOfTokens:  // sB = THD, sH = D, sT = HD: a fused projection's heads
      return values.transpose(1, 2).contiguous().transpose(1, 2);
    case Layout::EveryOtherRow: {  // sT = 2D, offset D
      Tensor base = Tensor::zeros({B, H, 2 * T + 1, D}, values.dtype());
      Tensor view = base.slice(2, 1, 2 * T + 1, 2);
      view.copy_(values);
      return view;
    }
    case Layout::WideBatchStride: {  // sB = 2HTD, offset HTD
      Tensor base = Tensor::zeros({B, 2, H, T, D}, values.dtype());
      Tensor view = base.select(1, 1);
      view.copy_(values);
      return view;
    }
    case Layout::StridedHeadDim:  // stride(3) = T: the one layout the front end copies first
      return values.transpose(2, 3).contiguous().transpose(2, 3);
  }
  return values;
}

}  // namespace

// The kernels address row (b, h, t) through the B, H, T strides and sum in the same order whatever the
// layout, so every layout of q, k, v and of the incoming gradient gives bitwise the contiguous results. Each
// dtype and D covers both ways rows are read: in place (f32 with D = 32, f64 with D = 16: whole register
// tiles, read with their row stride) and through padded fp32 copies (D = 5, and every 16-bit dtype);
// T = 150 with B*H = 2 also takes the backward's split of key blocks into groups (dq partials stored through
// strides).
TEST(Attention, StridedHeadsGiveBitwiseTheContiguousResults) {
  struct Case {
    DType dtype;
    Shape shape;
  };
  for (const Case& c : {Case{DType::F32, {2, 2, 70, 32}}, Case{DType::F32, {2, 2, 70, 5}},
                        Case{DType::F64, {2, 2, 70, 16}}, Case{DType::BF16, {2, 2, 70, 32}},
                        Case{DType::F16, {2, 2, 70, 8}}, Case{DType::F32, {1, 2, 150, 32}}}) {
    const Tensor q = uniform_tensor(c.shape, 40, -2, 2, c.dtype);
    const Tensor k = uniform_tensor(c.shape, 41, -2, 2, c.dtype);
    const Tensor v = uniform_tensor(c.shape, 42, -1, 1, c.dtype);
    const Tensor g = uniform_tensor(c.shape, 43, -1, 1, c.dtype);
    const Tensor out = scaled_dot_product_attention(q, k, v);
    const Grads3 grads = attention_grads(scaled_dot_product_attention, q, k, v, g);
    for (Layout layout : {Layout::HeadsOfTokens, Layout::EveryOtherRow, Layout::WideBatchStride,
                          Layout::StridedHeadDim}) {
      const std::string what =
          std::string(dtype_name(c.dtype)) + shape_str(c.shape) + ", " + layout_name(layout);
      const Tensor qs = in_layout(q, layout), ks = in_layout(k, layout), vs = in_layout(v, layout);
      ASSERT_NE(qs.strides(), contiguous_strides(qs.shape())) << what;
      const Tensor strided_out = scaled_dot_product_attention(qs, ks, vs);
      EXPECT_TRUE(strided_out.is_contiguous()) << what;
      EXPECT_EQ(strided_out.to_vector<double>(), out.to_vector<double>()) << what;
      const Grads3 strided = attention_grads(scaled_dot_product_attention, qs, ks, vs, in_layout(g, layout));
      EXPECT_EQ(strided.q.to_vector<double>(), grads.q.to_vector<double>()) << what;
      EXPECT_EQ(strided.k.to_vector<double>(), grads.k.to_vector<double>()) << what;
      EXPECT_EQ(strided.v.to_vector<double>(), grads.v.to_vector<double>()) << what;
    }
  }
}

// The kernel itself writes out and the gradients through their strides: here into the interleaved
// [B, T, H, D] layout, in place of the default contiguous buffers.
TEST(Attention, KernelWritesOutputsThroughTheirStrides) {
  const Shape shape = {2, 3, 70, 32};
  const Tensor q = uniform_tensor(shape, 44, -2, 2, DType::F32);
  const Tensor k = uniform_tensor(shape, 45, -2, 2, DType::F32);
  const Tensor v = uniform_tensor(shape, 46, -1, 1, DType::F32);
  const Tensor g = uniform_tensor(shape, 47, -1, 1, DType::F32);
  const double scale = 1.0 / std::sqrt(32.0);
  cpu::CpuBackend& backend = cpu::cpu_backend();
  auto interleaved = [&] { return Tensor::zeros({2, 70, 3, 32}).transpose(1, 2); };  // [B, T, H, D] storage
  const Tensor lse = Tensor::empty({2, 3, 70}), lse_strided = Tensor::empty({2, 3, 70});
  const Tensor out = Tensor::empty(shape), out_strided = interleaved();
  backend.causal_attention(q, k, v, scale, out, lse);
  backend.causal_attention(q, k, v, scale, out_strided, lse_strided);
  EXPECT_EQ(out_strided.to_vector<double>(), out.to_vector<double>());
  EXPECT_EQ(lse_strided.to_vector<double>(), lse.to_vector<double>());
  const Tensor gq = Tensor::empty(shape), gk = Tensor::empty(shape), gv = Tensor::empty(shape);
  const Tensor gq_s = interleaved(), gk_s = interleaved(), gv_s = interleaved();
  backend.causal_attention_backward(g, q, k, v, out, lse, scale, gq, gk, gv);
  backend.causal_attention_backward(g, q, k, v, out, lse, scale, gq_s, gk_s, gv_s);
  EXPECT_EQ(gq_s.to_vector<double>(), gq.to_vector<double>());
  EXPECT_EQ(gk_s.to_vector<double>(), gk.to_vector<double>());
  EXPECT_EQ(gv_s.to_vector<double>(), gv.to_vector<double>());
}

TEST(Attention, KernelRejectsAStridedHeadDimNamingTheTensorAndItsStrides) {
  cpu::CpuBackend& backend = cpu::cpu_backend();
  const Tensor q = Tensor::zeros({1, 2, 8, 4}), lse = Tensor::empty({1, 2, 8});
  const Tensor strided = Tensor::zeros({1, 2, 4, 8}).transpose(2, 3);  // strides [64,32,1,8]
  EXPECT_ERROR_MENTIONS(backend.causal_attention(q, strided, q, 0.5, Tensor::empty({1, 2, 8, 4}), lse),
                        "causal_attention", "k must be f32[1,2,8,4]", "head dim D contiguous",
                        "strides [64,32,1,8]");
  EXPECT_ERROR_MENTIONS(backend.causal_attention(q, q, q, 0.5, Tensor::empty({1, 2, 8, 5}), lse),
                        "causal_attention", "out", "f32[1,2,8,5]", "f32[1,2,8,4]");
  EXPECT_ERROR_MENTIONS(backend.causal_attention(q, q, q, 0.5, Tensor::empty({1, 2, 8, 4}),
                                                 Tensor::empty({1, 8, 2}).transpose(1, 2)),
                        "causal_attention", "lse must be contiguous f32[1,2,8]");
  EXPECT_ERROR_MENTIONS(backend.causal_attention_backward(strided, q, q, q, q, lse, 0.5, q.clone(), q.clone(),
                                                          q.clone()),
                        "causal_attention_backward", "grad_out", "strides [64,32,1,8]");
  EXPECT_ERROR_MENTIONS(backend.causal_attention_backward(q, q, q, q, q, lse, 0.5, q.clone(), strided,
                                                          q.clone()),
                        "causal_attention_backward", "grad_k", "head dim D contiguous");
}

// ---- causal_self_attention -------------------------------------------------------------------------------

namespace {

// Plain double loops from the definition, indexing qkv [B, T, 3C] directly: head h of token t reads
// q = qkv[b, t, h*D : (h+1)*D], k at column C + h*D, v at 2C + h*D, and writes out[b, t, h*D : (h+1)*D].
std::vector<double> reference_self_attention(const Tensor& qkv, int64_t H) {
  const int64_t B = qkv.size(0), T = qkv.size(1), C = qkv.size(2) / 3, D = C / H;
  const std::vector<double> x = qkv.contiguous().to_vector<double>();
  auto at = [&](int64_t b, int64_t t, int64_t part, int64_t h, int64_t d) {
    return static_cast<long double>(x[(b * T + t) * 3 * C + part * C + h * D + d]);
  };
  std::vector<double> out(static_cast<size_t>(B * T * C));
  const long double scale = 1.0L / std::sqrt(static_cast<long double>(D));
  std::vector<long double> s(static_cast<size_t>(T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < T; ++i) {
        long double m = -INFINITY, sum = 0;
        for (int64_t j = 0; j <= i; ++j) {
          long double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += at(b, i, 0, h, d) * at(b, j, 1, h, d);
          s[j] = dot * scale;
          m = std::max(m, s[j]);
        }
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(s[j] - m);
        for (int64_t d = 0; d < D; ++d) {
          long double o = 0;
          for (int64_t j = 0; j <= i; ++j) o += std::exp(s[j] - m) / sum * at(b, j, 2, h, d);
          out[(b * T + i) * C + h * D + d] = static_cast<double>(o);
        }
      }
  return out;
}

// What CausalSelfAttention computed before the fused op: split qkv into thirds, view each as heads
// [B, H, T, D], scaled_dot_product_attention, merge the heads back to [B, T, C].
Tensor attention_through_heads(const Tensor& qkv, int64_t H) {
  const int64_t B = qkv.size(0), T = qkv.size(1), C = qkv.size(2) / 3, D = C / H;
  const std::vector<Tensor> parts = split(qkv, C, 2);
  auto heads = [&](const Tensor& t) { return t.view({B, T, H, D}).transpose(1, 2); };
  return scaled_dot_product_attention(heads(parts[0]), heads(parts[1]), heads(parts[2]))
      .transpose(1, 2)
      .reshape({B, T, C});
}

// qkv [B, T, 3C] = [q | k | v] with q, k in [-2, 2] and v in [v_low, v_high].
Tensor make_qkv(int64_t B, int64_t T, int64_t C, uint64_t seed, double v_low, double v_high, DType dtype) {
  return cat({uniform_tensor({B, T, C}, seed, -2, 2, dtype),  // q
              uniform_tensor({B, T, C}, seed + 1, -2, 2, dtype),  // k
              uniform_tensor({B, T, C}, seed + 2, v_low, v_high, dtype)},  // v
             2);
}

// Gradient of <g, f(qkv)> with respect to qkv.
Tensor qkv_grad(const std::function<Tensor(const Tensor&)>& f, const Tensor& qkv, const Tensor& g) {
  Tensor x = qkv.detach().requires_grad_();
  backward({f(x)}, {g});
  return x.grad();
}

}  // namespace

// Against plain double loops over qkv: f32 and f64 to their accumulation error (as the scaled_dot_product_
// attention tests: f32 1e-5 relative plus 1e-6 of the output scale; f64 1e-12 relative); 16-bit with v in
// [1, 2], where every output is a convex combination without cancellation, within 1 ulp (the fp32
// accumulation error is ~T * 2^-24 relative, far below a 16-bit ulp, then one rounding on store).
// T = 150 spans three query blocks (one ragged); H = 3 heads of D = 32 (in place for f32 and f64).
TEST(CausalSelfAttentionOp, MatchesPlainDoubleReferenceInEveryDtype) {
  const int64_t B = 2, T = 150, H = 3, C = 96;
  for (DType dtype : {DType::F32, DType::F64, DType::F16, DType::BF16}) {
    const bool narrow = dtype == DType::F16 || dtype == DType::BF16;
    const Tensor qkv = make_qkv(B, T, C, 50, narrow ? 1 : -1, narrow ? 2 : 1, dtype);
    const Tensor out = causal_self_attention(qkv, H);
    ASSERT_EQ(out.shape(), (Shape{B, T, C}));
    EXPECT_EQ(out.dtype(), dtype);
    EXPECT_TRUE(out.is_contiguous());
    const Tensor exact = Tensor::from_vector(reference_self_attention(qkv, H), {B, T, C}, DType::F64);
    if (dtype == DType::F32)
      EXPECT_TRUE(all_close(out, exact, 1e-6 * max_abs(exact), 1e-5));
    else if (dtype == DType::F64)
      EXPECT_TRUE(all_close(out, exact, 1e-14, 1e-12));
    else
      EXPECT_TRUE(within_ulp(out, exact, 1)) << dtype_name(dtype);
  }
}

// The fused op runs the same kernel over the same rows in the same order as the composition it replaces, so
// the output and the qkv gradient are bitwise equal in every dtype and for either way of reading rows
// (D = 32: in place for f32 and f64; D = 5: padded copies), including few heads (B*H = 2: the backward's
// key-block groups) and a non-contiguous incoming gradient.
TEST(CausalSelfAttentionOp, EqualsTheHeadsCompositionBitwiseForwardAndBackward) {
  struct Case {
    int64_t B, T, H, D;
  };
  for (DType dtype : {DType::F32, DType::F64, DType::F16, DType::BF16})
    for (const Case& c : {Case{2, 70, 3, 32}, Case{2, 150, 4, 5}, Case{1, 130, 2, 32}}) {
      const int64_t C = c.H * c.D;
      const std::string what = std::string(dtype_name(dtype)) + " B=" + std::to_string(c.B) +
                               " T=" + std::to_string(c.T) + " H=" + std::to_string(c.H) +
                               " D=" + std::to_string(c.D);
      const Tensor qkv = make_qkv(c.B, c.T, C, 60, -1, 1, dtype);
      const Tensor g = uniform_tensor({c.B, c.T, C}, 63, -1, 1, dtype);
      const auto fused = [&](const Tensor& x) { return causal_self_attention(x, c.H); };
      const auto composed = [&](const Tensor& x) { return attention_through_heads(x, c.H); };
      EXPECT_EQ(fused(qkv).to_vector<double>(), composed(qkv).to_vector<double>()) << what;
      const Tensor grad = qkv_grad(fused, qkv, g);
      ASSERT_EQ(grad.shape(), qkv.shape()) << what;
      EXPECT_EQ(grad.dtype(), dtype) << what;
      EXPECT_EQ(grad.to_vector<double>(), qkv_grad(composed, qkv, g).to_vector<double>()) << what;
      // The same gradient arriving as a transposed view (last dim strided: copied once before the kernel).
      const Tensor g_strided = g.transpose(1, 2).contiguous().transpose(1, 2);
      EXPECT_EQ(qkv_grad(fused, qkv, g_strided).to_vector<double>(), grad.to_vector<double>()) << what;
    }
}

TEST(CausalSelfAttentionOp, GradientsMatchFiniteDifferences) {
  // Several heads, T not a multiple of anything, D = 3 (padded copies) and D = 16 (f64 rows read in place).
  using Sizes = std::tuple<int64_t, int64_t, int64_t>;  // T, H, D
  for (const auto& [T, H, D] : std::vector<Sizes>{{5, 2, 3}, {9, 3, 2}, {6, 2, 16}})
    expect_gradcheck([H](const std::vector<Tensor>& in) { return causal_self_attention(in[0], H); },
                     {uniform_tensor({2, T, 3 * H * D}, 70, -1, 1, DType::F64)});
  // A transposed qkv (last dim strided: copied once) and one sliced along T (read in place with its strides).
  expect_gradcheck(
      [](const std::vector<Tensor>& in) { return causal_self_attention(in[0].transpose(1, 2), 2); },
      {uniform_tensor({2, 12, 7}, 71, -1, 1, DType::F64)});  // [B, 3C, T]
  expect_gradcheck(
      [](const std::vector<Tensor>& in) { return causal_self_attention(in[0].slice(1, 1, 8, 2), 2); },
      {uniform_tensor({2, 9, 12}, 72, -1, 1, DType::F64)});  // every other token of [B, 9, 3C]
}

// Non-contiguous qkv views give the results of their contiguous copies, bit for bit.
TEST(CausalSelfAttentionOp, NonContiguousQkvGivesTheContiguousResults) {
  const int64_t B = 2, T = 70, C = 64, H = 2;
  const Tensor qkv = make_qkv(B, T, C, 80, -1, 1, DType::F32);
  const Tensor g = uniform_tensor({B, T, C}, 83, -1, 1, DType::F32);
  const auto fused = [&](const Tensor& x) { return causal_self_attention(x, H); };
  const std::vector<double> out = fused(qkv).to_vector<double>();
  const std::vector<double> grad = qkv_grad(fused, qkv, g).to_vector<double>();
  Tensor wide = Tensor::zeros({B, 2 * T, 3 * C});  // every other token: sB = 6TC, sT = 6C
  wide.slice(1, 0, 2 * T, 2).copy_(qkv);
  const Tensor transposed = qkv.transpose(1, 2).contiguous().transpose(1, 2);  // stride(2) = T
  for (const Tensor& view : {wide.slice(1, 0, 2 * T, 2), transposed}) {
    ASSERT_FALSE(view.is_contiguous());
    EXPECT_EQ(fused(view).to_vector<double>(), out);
    EXPECT_EQ(qkv_grad(fused, view, g).to_vector<double>(), grad);
  }
}

TEST(CausalSelfAttentionOp, EmptyBatchOrSequenceGivesEmptyOutputAndGradient) {
  for (const Shape& shape : {Shape{0, 5, 12}, Shape{2, 0, 12}}) {
    Tensor qkv = Tensor::zeros(shape).requires_grad_();
    const Tensor out = causal_self_attention(qkv, 2);
    EXPECT_EQ(out.shape(), (Shape{shape[0], shape[1], 4}));
    backward({out}, {Tensor::zeros(out.shape())});
    EXPECT_EQ(qkv.grad().shape(), shape);
  }
}

// The forward allocates its output, lse and the kernel's k^T scratch (the size of one third of qkv) and
// nothing else: a single copy of q, k or v (one third each) or of the merged output would exceed the bound.
// The backward allocates the one [B, T, 3C] gradient plus the kernel's delta ([B, H, T]) and per-thread dq
// scratch (threads x [T, D] fp32): no copy of qkv, out or the incoming gradient, no zero fill of a gradient
// assembled from thirds. (qkv.grad is preset, so the engine adds into it instead of copying.) Sizes are
// multiples of the allocator's 512-byte rounding, so the bounds are exact.
TEST(CausalSelfAttentionOp, AllocatesNoCopiesOfItsInputsOrOutputs) {
  const int64_t B = 2, T = 128, C = 128, H = 2, D = 64;
  Tensor qkv = uniform_tensor({B, T, 3 * C}, 90, -1, 1, DType::F32).requires_grad_();
  qkv.set_grad(Tensor::zeros(qkv.shape()));
  const Tensor g = uniform_tensor({B, T, C}, 91, -1, 1, DType::F32);
  const size_t third = static_cast<size_t>(B * T * C * 4), stats = static_cast<size_t>(B * H * T * 4);
  Tensor out;
  const size_t forward_bytes = peak_extra_bytes([&] { out = causal_self_attention(qkv, H); });
  EXPECT_LE(forward_bytes, third + stats + third) << forward_bytes << " bytes";  // out, lse, k^T
  const size_t dq = static_cast<size_t>(omp_get_max_threads() * T * D * 4);
  const size_t backward_bytes = peak_extra_bytes([&] { backward({out}, {g}); });
  EXPECT_LE(backward_bytes, 3 * third + stats + dq) << backward_bytes << " bytes";
  EXPECT_EQ(qkv.grad().to_vector<double>(),
            qkv_grad([&](const Tensor& x) { return causal_self_attention(x, H); }, qkv, g).to_vector<double>());
}

TEST(CausalSelfAttentionOp, RejectsBadShapesDtypesAndHeadCounts) {
  const char* op = "causal_self_attention";
  EXPECT_ERROR_MENTIONS(causal_self_attention(Tensor(), 2), op, "undefined", "[B, T, 3C]");
  EXPECT_ERROR_MENTIONS(causal_self_attention(Tensor::zeros({2, 4, 12}, DType::I32), 2), op, "floating",
                        "i32[2,4,12]");
  EXPECT_ERROR_MENTIONS(causal_self_attention(Tensor::zeros({4, 12}), 2), op, "[B, T, 3C]", "f32[4,12]");
  EXPECT_ERROR_MENTIONS(causal_self_attention(Tensor::zeros({1, 2, 4, 12}), 2), op, "[B, T, 3C]",
                        "f32[1,2,4,12]");
  EXPECT_ERROR_MENTIONS(causal_self_attention(Tensor::zeros({2, 4, 13}), 1), op, "f32[2,4,13]", "3C");
  EXPECT_ERROR_MENTIONS(causal_self_attention(Tensor::zeros({2, 4, 18}), 4), op, "f32[2,4,18]",
                        "multiple of n_head = 4");
  EXPECT_ERROR_MENTIONS(causal_self_attention(Tensor::zeros({2, 4, 0}), 1), op, "f32[2,4,0]", "3C");
  EXPECT_ERROR_MENTIONS(causal_self_attention(Tensor::zeros({2, 4, 12}), 0), op, "n_head", "0",
                        "f32[2,4,12]");
}
