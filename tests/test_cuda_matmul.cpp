// CUDA matmul (cuBLASLt, tensor/cuda/matmul.cu) against the CPU backend through the public front ends: every
// dtype, transposed and strided operands, batches with stride-0 (broadcast) operands, bias, K == 0, linear(),
// the fused GELU epilogue, and gradients through the tape.
//
// Bounds. Both backends accumulate f32/f16/bf16 products in f32 (f64 in f64) and round once, but in different
// orders (oneDNN's blocking vs cuBLASLt's tiles and split-K), so the accumulators differ by rounding noise of
// at most ~K * 2^-24 * S, where S = sum_k |a_ik b_kj| (+ |bias_j|) is the scale of the dot product (computed
// here in f64 from the operands). Per output dtype:
//   f64        |gpu - cpu| <= 1e-12 * S
//   f32        |gpu - cpu| <= 1e-5 * S          (tf32 off; "rel 1e-5" relative to the dot product's scale)
//   f32 tf32   |gpu - cpu| <= 2^-8 * S          (each backend rounds its inputs to 10 mantissa bits: the CPU to
//                                                 nearest, <= 2^-11 relative; tensor cores may truncate, <= 2^-10;
//                                                 a product of two such inputs is off by up to ~2^-9 on the GPU
//                                                 and ~2^-10 on the CPU, so 4 * 2^-10 covers the difference)
//   f16, bf16  within 2 ulp of the output dtype, or |gpu - cpu| <= 1 ulp(cpu) + 2 * K * 2^-24 * S: the f32
//              accumulators may straddle a rounding boundary (1 ulp), and where the result cancels to far below
//              S the accumulators' own difference can exceed an ulp of the small result.
// Every test runs with allocation poisoning (MIXTAPE_REQUIRE_CUDA): an output element the kernel leaves
// unwritten reads as NaN and fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "cuda_test_util.h"
#include "tensor/ops.h"
#include "tensor/precision.h"
#include "test_util.h"

#ifdef MIXTAPE_WITH_CUDA
namespace mixtape::cuda {
// tensor/cuda/matmul.cu: out = gelu_tanh(a @ b + bias) through cuBLASLt's GELU epilogue (not yet wired to an op).
void matmul_bias_gelu(const Tensor& a, const Tensor& b, const Tensor& out, const Tensor& bias);
}  // namespace mixtape::cuda
#endif

using namespace mixtape;
using mixtape::testing::all_close;
using mixtape::testing::cuda0;
using mixtape::testing::ulp_distance;
using mixtape::testing::uniform_tensor;

namespace {

// The spacing of dtype's values at v (subnormal spacing below the smallest normal).
double ulp_of(DType dtype, double v) {
  int mantissa = 52, min_exponent = -1022;
  switch (dtype) {
    case DType::F16: mantissa = 10; min_exponent = -14; break;
    case DType::BF16: mantissa = 7; min_exponent = -126; break;
    case DType::F32: mantissa = 23; min_exponent = -126; break;
    default: break;
  }
  int exponent = 0;
  std::frexp(v, &exponent);  // |v| = f * 2^exponent with f in [0.5, 1): floor(log2 |v|) = exponent - 1
  const int e = v == 0 ? min_exponent : std::max(exponent - 1, min_exponent);
  return std::ldexp(1.0, e - mantissa);
}

// Checks a CUDA product against the CPU's with the bounds of the file comment; `scale` holds S per element
// (f64, out's shape), K is the reduction length.
::testing::AssertionResult agrees(const Tensor& gpu, const Tensor& cpu, const Tensor& scale, int64_t K,
                                  bool tf32 = false) {
  if (!gpu.device().is_cuda()) return ::testing::AssertionFailure() << "result " << gpu.description() << " not on CUDA";
  if (gpu.shape() != cpu.shape() || gpu.dtype() != cpu.dtype())
    return ::testing::AssertionFailure() << "got " << gpu.description() << ", CPU gave " << cpu.description();
  const DType dtype = cpu.dtype();
  const std::vector<double> got = gpu.to_vector<double>(), want = cpu.to_vector<double>();
  const std::vector<double> s = scale.to_vector<double>();
  int bad = 0;
  std::string report;
  for (size_t i = 0; i < got.size(); ++i) {
    const double error = std::abs(got[i] - want[i]);
    bool ok = false;
    switch (dtype) {
      case DType::F64: ok = error <= 1e-12 * s[i]; break;
      case DType::F32: ok = error <= (tf32 ? std::ldexp(1.0, -8) : 1e-5) * s[i]; break;
      default:
        ok = ulp_distance(dtype, got[i], want[i]) <= 2 ||
             error <= ulp_of(dtype, want[i]) + 2.0 * static_cast<double>(K) * std::ldexp(1.0, -24) * s[i];
    }
    if (!ok && bad++ < 5)
      report += "element " + std::to_string(i) + ": cuda " + std::to_string(got[i]) + ", cpu " +
                std::to_string(want[i]) + ", scale " + std::to_string(s[i]) + "\n";
  }
  if (bad)
    return ::testing::AssertionFailure() << bad << " of " << got.size() << " elements of " << gpu.description()
                                         << " beyond the bound (K = " << K << ")\n" << report;
  return ::testing::AssertionSuccess();
}

// S = |a| @ |b| in f64 (NumPy batch broadcasting, like the product itself).
Tensor dot_scale(const Tensor& a, const Tensor& b) {
  return matmul(abs(a.to(DType::F64)), abs(b.to(DType::F64)));
}

using View = std::function<Tensor(const Tensor&)>;
const View kSame = [](const Tensor& t) { return t; };
const View kTransposed = [](const Tensor& t) { return t.mT(); };  // the stored tensor holds [.., cols, rows]

// matmul(view_a(x), view_b(y)) for random x, y of the given stored shapes, on CUDA against the CPU. The views
// are taken on each device's own copy, so the CUDA kernel sees the same strides as the CPU one.
void expect_matmul_matches(DType dtype, const Shape& x_shape, const View& view_a, const Shape& y_shape,
                           const View& view_b, uint64_t seed, bool tf32 = false) {
  const Tensor x = uniform_tensor(x_shape, seed, -1, 1, dtype);
  const Tensor y = uniform_tensor(y_shape, seed + 1, -1, 1, dtype);
  const Tensor a_cpu = view_a(x), b_cpu = view_b(y);
  const Tensor a_gpu = view_a(x.to(cuda0())), b_gpu = view_b(y.to(cuda0()));
  AllowTf32Guard guard(tf32);
  const Tensor want = matmul(a_cpu, b_cpu);
  const Tensor got = matmul(a_gpu, b_gpu);
  EXPECT_TRUE(agrees(got, want, dot_scale(a_cpu, b_cpu), a_cpu.size(-1), tf32))
      << dtype_name(dtype) << " " << a_cpu.description() << " x " << b_cpu.description();
}

const std::vector<DType> kDtypes = {DType::F32, DType::F16, DType::BF16, DType::F64};

}  // namespace

TEST(CudaMatmul, MatchesCpuInEveryDtype) {
  MIXTAPE_REQUIRE_CUDA();
  for (DType dtype : kDtypes) {
    expect_matmul_matches(dtype, {37, 53}, kSame, {53, 29}, kSame, 1);      // odd sizes
    expect_matmul_matches(dtype, {128, 256}, kSame, {256, 96}, kSame, 3);  // tensor-core friendly
    expect_matmul_matches(dtype, {1, 64}, kSame, {64, 1}, kSame, 5);       // a dot product
    expect_matmul_matches(dtype, {7, 1}, kSame, {1, 9}, kSame, 7);         // an outer product (K = 1)
  }
}

TEST(CudaMatmul, Tf32MatchesCpuWithinTheTf32Bound) {
  MIXTAPE_REQUIRE_CUDA();
  expect_matmul_matches(DType::F32, {64, 200}, kSame, {200, 48}, kSame, 11, /*tf32=*/true);
  expect_matmul_matches(DType::F32, {3, 33, 40}, kSame, {24, 40}, kTransposed, 13, /*tf32=*/true);
  // The switch is read per call: with it off again, the f32 bound holds.
  expect_matmul_matches(DType::F32, {64, 200}, kSame, {200, 48}, kSame, 11, /*tf32=*/false);
}

TEST(CudaMatmul, TransposedOperandsNeedNoCopyAndMatch) {
  MIXTAPE_REQUIRE_CUDA();
  for (DType dtype : kDtypes) {
    // a = x^T with x [K, M]; b = y^T with y [N, K] (a linear layer's weight); and both.
    expect_matmul_matches(dtype, {40, 24}, kTransposed, {40, 33}, kSame, 21);
    expect_matmul_matches(dtype, {24, 40}, kSame, {33, 40}, kTransposed, 23);
    expect_matmul_matches(dtype, {40, 24}, kTransposed, {33, 40}, kTransposed, 25);
    // Batched and transposed.
    expect_matmul_matches(dtype, {3, 40, 24}, kTransposed, {3, 33, 40}, kTransposed, 27);
  }
}

TEST(CudaMatmul, BatchedAndBroadcastBatches) {
  MIXTAPE_REQUIRE_CUDA();
  const View first_column_block = [](const Tensor& t) { return t.narrow(0, 0, 1); };
  for (DType dtype : kDtypes) {
    // One strided batch dim.
    expect_matmul_matches(dtype, {5, 17, 24}, kSame, {5, 24, 19}, kSame, 31);
    // Two batch dims that merge into one (contiguous).
    expect_matmul_matches(dtype, {2, 3, 17, 24}, kSame, {2, 3, 24, 19}, kSame, 33);
    // b broadcast over the batch as a true stride-0 batch: a is transposed, so the batch cannot fold into M.
    expect_matmul_matches(dtype, {4, 24, 17}, kTransposed, {1, 24, 19}, kSame, 35);
    // a broadcast over b's batch (a 2-d operand against a batched one: stride 0 on cuBLASLt's B).
    expect_matmul_matches(dtype, {17, 24}, kSame, {4, 24, 19}, kSame, 37);
    // A shared 2-d b: the batch folds into M (a linear layer's x [B, T, C] @ W [C, N]).
    expect_matmul_matches(dtype, {2, 6, 24}, kSame, {24, 19}, kSame, 39);
    // Two batch dims that do not merge (b broadcast over the leading one): the operands are materialised.
    expect_matmul_matches(dtype, {2, 3, 17, 24}, kSame, {3, 24, 19}, kSame, 41);
    // A size-1 batch dim taken from a larger tensor (its stride is meaningless).
    expect_matmul_matches(dtype, {3, 17, 24}, first_column_block, {1, 24, 19}, kSame, 43);
  }
}

TEST(CudaMatmul, UnalignedAndStridedOperands) {
  MIXTAPE_REQUIRE_CUDA();
  // Offset by one element: pointers aligned to the element size only, odd leading dimensions.
  const View drop_first_column = [](const Tensor& t) { return t.narrow(-1, 1, t.size(-1) - 1); };
  // Every second column: neither dim unit-stride, so cuBLASLt cannot read it and it is copied first.
  const View even_columns = [](const Tensor& t) { return t.slice(-1, 0, t.size(-1), 2); };
  for (DType dtype : kDtypes) {
    expect_matmul_matches(dtype, {33, 41}, drop_first_column, {40, 27}, drop_first_column, 51);
    expect_matmul_matches(dtype, {33, 80}, even_columns, {40, 27}, kSame, 53);
    expect_matmul_matches(dtype, {33, 40}, kSame, {40, 54}, even_columns, 55);
    expect_matmul_matches(dtype, {2, 33, 80}, even_columns, {2, 27, 40}, kTransposed, 57);
  }
}

TEST(CudaMatmul, RepeatedCallsReuseThePlanAndGiveTheSameBits) {
  MIXTAPE_REQUIRE_CUDA();
  const Tensor a = uniform_tensor({64, 96}, 61, -1, 1, DType::BF16).to(cuda0());
  const Tensor b = uniform_tensor({96, 80}, 62, -1, 1, DType::BF16).to(cuda0());
  const std::vector<double> first = matmul(a, b).to_vector<double>();
  for (int i = 0; i < 3; ++i) EXPECT_EQ(matmul(a, b).to_vector<double>(), first);
}

TEST(CudaMatmul, EmptyReductionWritesZerosAndEmptyOutputsNothing) {
  MIXTAPE_REQUIRE_CUDA();
  for (DType dtype : kDtypes) {
    // K == 0: every element is an empty sum (allocation poisoning would leave NaN in unwritten ones).
    const Tensor a = Tensor::zeros({5, 0}, dtype).to(cuda0()), b = Tensor::zeros({0, 7}, dtype).to(cuda0());
    const Tensor out = matmul(a, b);
    EXPECT_EQ(out.shape(), (Shape{5, 7}));
    EXPECT_EQ(out.to_vector<double>(), std::vector<double>(35, 0.0)) << dtype_name(dtype);
    const Tensor batched =
        matmul(Tensor::zeros({2, 3, 0}, dtype).to(cuda0()), Tensor::zeros({2, 0, 4}, dtype).to(cuda0()));
    EXPECT_EQ(batched.to_vector<double>(), std::vector<double>(24, 0.0)) << dtype_name(dtype);
    // M == 0 or N == 0: nothing to write, no error.
    EXPECT_EQ(matmul(Tensor::zeros({0, 6}, dtype).to(cuda0()), Tensor::ones({6, 4}, dtype).to(cuda0())).shape(),
              (Shape{0, 4}));
    EXPECT_EQ(matmul(Tensor::ones({3, 6}, dtype).to(cuda0()), Tensor::zeros({6, 0}, dtype).to(cuda0())).shape(),
              (Shape{3, 0}));
  }
}

TEST(CudaMatmul, EmptyReductionWithBiasWritesTheBias) {
  MIXTAPE_REQUIRE_CUDA();
  for (DType dtype : kDtypes) {
    const Tensor bias = uniform_tensor({6}, 71, -1, 1, dtype);
    const Tensor x = Tensor::zeros({2, 4, 0}, dtype), weight = Tensor::zeros({6, 0}, dtype);
    const Tensor out = linear(x.to(cuda0()), weight.to(cuda0()), bias.to(cuda0()));
    EXPECT_EQ(out.shape(), (Shape{2, 4, 6}));
    std::vector<double> want;
    for (int row = 0; row < 8; ++row)
      for (double v : bias.to_vector<double>()) want.push_back(v);
    EXPECT_EQ(out.to_vector<double>(), want) << dtype_name(dtype);
  }
}

TEST(CudaMatmul, LinearWithBiasMatchesCpu) {
  MIXTAPE_REQUIRE_CUDA();
  for (DType dtype : kDtypes) {
    for (const Shape& x_shape : {Shape{29, 48}, Shape{2, 7, 48}, Shape{48}}) {
      const Tensor x = uniform_tensor(x_shape, 81, -1, 1, dtype);
      const Tensor weight = uniform_tensor({40, 48}, 82, -1, 1, dtype);
      const Tensor bias = uniform_tensor({40}, 83, -1, 1, dtype);
      const Tensor want = linear(x, weight, bias);
      const Tensor got = linear(x.to(cuda0()), weight.to(cuda0()), bias.to(cuda0()));
      // S = |x| @ |W|^T + |bias|
      const Tensor scale = add(dot_scale(x, weight.mT()), abs(bias.to(DType::F64)));
      EXPECT_TRUE(agrees(got, want, scale, 48)) << dtype_name(dtype) << " x " << x.description();
      // Without a bias too.
      EXPECT_TRUE(agrees(linear(x.to(cuda0()), weight.to(cuda0())), linear(x, weight), dot_scale(x, weight.mT()), 48))
          << dtype_name(dtype) << " x " << x.description() << " without bias";
    }
  }
}

TEST(CudaMatmul, LinearBiasIsAddedBeforeTheOneRounding) {
  MIXTAPE_REQUIRE_CUDA();
  // bf16 (8 significant bits: the ulp of 1 is 2^-7): x @ W^T = 1 + 2^-9 exactly, bias 2^-8, so the f32
  // accumulator holds 1 + 3 * 2^-9, nearer to 1 + 2^-7 than to 1: one rounding gives 1 + 2^-7. Rounding the
  // product first (1 + 2^-9 -> 1) and adding the bias after (1 + 2^-8, a tie -> even -> 1) would give 1.
  const Tensor x = Tensor::from_vector(std::vector<double>{1.0, std::ldexp(1.0, -9)}, {1, 2}, DType::BF16);
  const Tensor weight = Tensor::from_vector(std::vector<double>{1.0, 1.0}, {1, 2}, DType::BF16);
  const Tensor bias = Tensor::from_vector(std::vector<double>{std::ldexp(1.0, -8)}, {1}, DType::BF16);
  const Tensor got = linear(x.to(cuda0()), weight.to(cuda0()), bias.to(cuda0()));
  EXPECT_EQ(got.to_vector<double>(), std::vector<double>{1.0 + std::ldexp(1.0, -7)});
  EXPECT_EQ(linear(x, weight, bias).to_vector<double>(), got.to_vector<double>());
}

TEST(CudaMatmul, GradientsMatchCpu) {
  MIXTAPE_REQUIRE_CUDA();
  struct Case {
    Shape a, b;
  };
  // Plain, batched, b broadcast over a's batch (its gradient sums over the batch), a 2-d a against a batch.
  const std::vector<Case> cases = {{{13, 24}, {24, 9}}, {{3, 13, 24}, {3, 24, 9}}, {{3, 13, 24}, {24, 9}},
                                   {{13, 24}, {2, 24, 9}}, {{2, 3, 13, 24}, {3, 24, 9}}};
  for (DType dtype : {DType::F32, DType::F64}) {
    // f64: both backends accumulate in double over K <= 39 terms of magnitude <= 1 (errors ~1e-15); f32 the
    // same in float (worst case 39 * 2^-24 * 39 ~ 1e-4 over sums of up to 39 products; typically far less).
    const double tolerance = dtype == DType::F64 ? 1e-11 : 1e-4;
    for (const Case& c : cases) {
      const Tensor a0 = uniform_tensor(c.a, 91, -1, 1, dtype), b0 = uniform_tensor(c.b, 92, -1, 1, dtype);
      Tensor a_cpu = a0.detach().requires_grad_(), b_cpu = b0.detach().requires_grad_();
      Tensor a_gpu = a0.to(cuda0()).detach().requires_grad_(), b_gpu = b0.to(cuda0()).detach().requires_grad_();
      const Tensor out_cpu = matmul(a_cpu, b_cpu), out_gpu = matmul(a_gpu, b_gpu);
      const Tensor grad_out = uniform_tensor(out_cpu.shape(), 93, -1, 1, dtype);
      backward({out_cpu}, {grad_out});
      backward({out_gpu}, {grad_out.to(cuda0())});
      ASSERT_TRUE(a_gpu.grad().defined() && b_gpu.grad().defined());
      EXPECT_TRUE(a_gpu.grad().device().is_cuda());
      EXPECT_TRUE(all_close(a_gpu.grad(), a_cpu.grad(), tolerance, tolerance))
          << dtype_name(dtype) << " grad a of " << shape_str(c.a) << " x " << shape_str(c.b);
      EXPECT_TRUE(all_close(b_gpu.grad(), b_cpu.grad(), tolerance, tolerance))
          << dtype_name(dtype) << " grad b of " << shape_str(c.a) << " x " << shape_str(c.b);
    }
  }
}

TEST(CudaMatmul, LinearGradientsMatchCpu) {
  MIXTAPE_REQUIRE_CUDA();
  const Tensor x0 = uniform_tensor({2, 5, 32}, 101, -1, 1, DType::F32);
  const Tensor w0 = uniform_tensor({24, 32}, 102, -1, 1, DType::F32);
  const Tensor b0 = uniform_tensor({24}, 103, -1, 1, DType::F32);
  Tensor x_cpu = x0.detach().requires_grad_(), w_cpu = w0.detach().requires_grad_(),
         b_cpu = b0.detach().requires_grad_();
  Tensor x_gpu = x0.to(cuda0()).detach().requires_grad_(), w_gpu = w0.to(cuda0()).detach().requires_grad_(),
         b_gpu = b0.to(cuda0()).detach().requires_grad_();
  const Tensor grad_out = uniform_tensor({2, 5, 24}, 104, -1, 1, DType::F32);
  backward({linear(x_cpu, w_cpu, b_cpu)}, {grad_out});
  backward({linear(x_gpu, w_gpu, b_gpu)}, {grad_out.to(cuda0())});
  EXPECT_TRUE(all_close(x_gpu.grad(), x_cpu.grad(), 1e-4, 1e-4));
  EXPECT_TRUE(all_close(w_gpu.grad(), w_cpu.grad(), 1e-4, 1e-4));
  EXPECT_TRUE(all_close(b_gpu.grad(), b_cpu.grad(), 1e-5, 1e-5));
}

TEST(CudaMatmul, ErrorsNameTheOperands) {
  MIXTAPE_REQUIRE_CUDA();
  const Tensor a = Tensor::ones({3, 4}).to(cuda0()), b = Tensor::ones({5, 2}).to(cuda0());
  EXPECT_ERROR_MENTIONS(matmul(a, b), "matmul", "inner dims differ");
  EXPECT_ERROR_MENTIONS(matmul(a, Tensor::ones({4, 2})), "matmul", "cpu");
}

#ifdef MIXTAPE_WITH_CUDA
TEST(CudaMatmul, GeluEpilogueAppliesBiasThenGelu) {
  MIXTAPE_REQUIRE_CUDA();
  // The CPU reference in f64: gelu_tanh(x @ W^T + bias). cuBLASLt's GELU is its own tanh-form approximation of
  // unstated accuracy, so this checks the wiring (bias added, then GELU, every element written) to 1e-3, not the
  // last bits.
  for (bool with_bias : {true, false}) {
    const Tensor x = uniform_tensor({33, 40}, 111, -2, 2, DType::F32);
    const Tensor weight = uniform_tensor({24, 40}, 112, -0.5, 0.5, DType::F32);
    const Tensor bias = with_bias ? uniform_tensor({24}, 113, -1, 1, DType::F32) : Tensor();
    Tensor pre = matmul(x.to(DType::F64), weight.to(DType::F64).mT());
    if (with_bias) pre = add(pre, bias.to(DType::F64));
    const Tensor want = gelu(pre, GeluApproximation::Tanh);
    const Tensor out = Tensor::empty({33, 24}, DType::F32, cuda0());
    cuda::matmul_bias_gelu(x.to(cuda0()), weight.to(cuda0()).mT(), out, with_bias ? bias.to(cuda0()) : Tensor());
    EXPECT_TRUE(all_close(out, want, 1e-3, 1e-3)) << (with_bias ? "with bias" : "without bias");
  }
}
#endif
