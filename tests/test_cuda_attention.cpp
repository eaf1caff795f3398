// CUDA causal attention (tensor/cuda/attention.cu) against the CPU kernel (tensor/cpu/attention.cpp), the
// reference: the forward (out and lse) and the backward (grad q, k, v), through the backend kernels on the
// same inputs and through the front ends (scaled_dot_product_attention, causal_self_attention) with
// autograd::backward, in f32, f16, bf16 and f64; T below, at and across the 64-row tiles (1, 7, 64, 65, 130,
// 1024), head dims 1..128 (each of the kernel's 32/64/128 register widths, ragged ones included); q, k, v as
// strided views of a fused qkv; and determinism (two runs give the same bits).
//
// Bounds. Both sides compute in fp32 (f64 for f64) from the same values and round once on store; they differ
// in summation order and exp (CPU: a ~1 ulp polynomial, CUDA: expf, ~1 ulp), so:
//  - f32: |cuda - cpu| <= 1e-5 |cpu| + 1e-6 max|cpu| (out, lse) and 1e-5 |cpu| + 1e-5 max|cpu| (gradients:
//    they are sums of products whose terms cancel, so an element near 0 carries the rounding of the largest);
//  - f64: the same shape with 1e-11 / 1e-12;
//  - f16/bf16 on the same inputs (backend kernels): within 2 ulp of the output dtype, or within 1e-5 max|cpu|
//    (the f32 bound above, for elements so small that an fp32 difference of that size spans more ulps);
//  - f16/bf16 through the front end, where the backward reads the forward's own rounded output (CPU and CUDA
//    outputs may differ by an ulp, and delta_i = do_i.o_i with them), the 16-bit gradients get 2 ulp or one
//    ulp of the dtype at the largest element's scale.
// The CPU side is the portable kernel (p and ds kept in fp32, as these bounds assume): each test turns the bf16
// kernels off (testing::PortableAttention), which on a CPU with AMX or AVX512-BF16 round p and ds to bf16 first;
// and the CUDA side the SIMT kernels (testing::SimtCudaAttention), for the same reason.
//
// The tensor-core kernels (f16/bf16 at D = 32, 64, 128, the default there) round p and ds to the dtype as
// operands, so they are held to the CPU bf16 kernels' bounds against an f64 reference instead (the
// TensorCores* tests at the end, where each bound is derived).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "autograd/autograd.h"
#include "cuda_test_util.h"
#include "tensor/backend.h"
#include "tensor/kernel_contract.h"
#include "tensor/ops.h"
#include "test_util.h"

using namespace mixtape;
using mixtape::testing::cuda0;
using mixtape::testing::ulp_distance;
using mixtape::testing::uniform_tensor;

namespace {

double max_abs(const std::vector<double>& values) {
  double m = 0;
  for (double x : values) m = std::max(m, std::abs(x));
  return m;
}

// One ulp of `dtype` at 1.0 (its machine epsilon).
double epsilon(DType dtype) {
  switch (dtype) {
    case DType::F16: return std::ldexp(1.0, -10);
    case DType::BF16: return std::ldexp(1.0, -7);
    case DType::F32: return std::ldexp(1.0, -23);
    default: return std::ldexp(1.0, -52);
  }
}

// The bound an element passes: |got - want| <= atol + rtol |want|, or (for 16-bit dtypes) got within max_ulp
// ulps of want.
struct Bound {
  double atol_of_max;  // atol as a fraction of max|want|
  double rtol;
  double max_ulp;  // 0: no ulp alternative
};

// `scale`: the magnitude the bound's atol is relative to, when larger than the result's own largest element (a
// gradient whose true value is 0, e.g. grad_q at T = 1, holds rounding residues only: its scale is its inputs').
::testing::AssertionResult close_to_cpu(const Tensor& cuda_result, const Tensor& cpu_result, const Bound& bound,
                                        const std::string& what, double scale = 0) {
  if (cuda_result.shape() != cpu_result.shape() || cuda_result.dtype() != cpu_result.dtype())
    return ::testing::AssertionFailure() << what << ": " << cuda_result.description() << " vs "
                                         << cpu_result.description();
  const std::vector<double> got = cuda_result.to_vector<double>(), want = cpu_result.to_vector<double>();
  const double atol = bound.atol_of_max * std::max(max_abs(want), scale);
  int bad = 0;
  std::string report;
  for (size_t i = 0; i < got.size(); ++i) {
    const double error = std::abs(got[i] - want[i]);
    bool ok = error <= atol + bound.rtol * std::abs(want[i]);
    if (!ok && bound.max_ulp > 0) ok = ulp_distance(cuda_result.dtype(), got[i], want[i]) <= bound.max_ulp;
    if (!ok) {  // NaN (e.g. an element the kernel never wrote: allocations are NaN-poisoned) lands here
      if (bad++ < 5)
        report += "  element " + std::to_string(i) + ": cuda " + std::to_string(got[i]) + ", cpu " +
                  std::to_string(want[i]) + "\n";
    }
  }
  if (bad)
    return ::testing::AssertionFailure() << what << ": " << bad << " of " << got.size()
                                         << " elements beyond the bound\n"
                                         << report;
  return ::testing::AssertionSuccess();
}

// Bounds for the kernels on identical inputs.
Bound value_bound(DType dtype) {  // out, lse
  switch (dtype) {
    case DType::F64: return {1e-12, 1e-11, 0};
    case DType::F32: return {1e-6, 1e-5, 0};
    default: return {1e-5, 0, 2};
  }
}
Bound gradient_bound(DType dtype) {
  switch (dtype) {
    case DType::F64: return {1e-12, 1e-11, 0};
    case DType::F32: return {1e-5, 1e-5, 0};
    default: return {1e-5, 0, 2};
  }
}
// Gradients through the front end (16-bit: the forward's rounded output feeds the backward; see the top).
Bound front_end_gradient_bound(DType dtype) {
  if (dtype == DType::F16 || dtype == DType::BF16) return {epsilon(dtype), 0, 2};
  return gradient_bound(dtype);
}

std::string describe(DType dtype, const Shape& shape) { return std::string(dtype_name(dtype)) + shape_str(shape); }

struct Inputs {
  Tensor q, k, v, grad_out;  // on the CPU
};

Inputs random_inputs(const Shape& shape, DType dtype, uint64_t seed) {
  return {uniform_tensor(shape, seed, -2, 2, dtype), uniform_tensor(shape, seed + 1, -2, 2, dtype),
          uniform_tensor(shape, seed + 2, -1, 1, dtype), uniform_tensor(shape, seed + 3, -1, 1, dtype)};
}

struct KernelResults {
  Tensor out, lse, grad_q, grad_k, grad_v;  // on the CPU
};

// The backend kernels of `device` on the given inputs: the forward, and the backward from the given out and
// lse (the CPU forward's, so both devices' backward kernels see identical inputs).
KernelResults run_kernels(const Inputs& in, const Tensor& out_for_backward, const Tensor& lse_for_backward,
                          Device device) {
  const Shape& shape = in.q.shape();
  const DType dtype = in.q.dtype();
  const double scale = 1.0 / std::sqrt(static_cast<double>(shape[3]));
  const Tensor q = in.q.to(device), k = in.k.to(device), v = in.v.to(device), g = in.grad_out.to(device);
  Backend& backend = backend_for(device);
  const Tensor out = Tensor::empty(shape, dtype, device);
  const Tensor lse = Tensor::empty({shape[0], shape[1], shape[2]}, stats_dtype(dtype), device);
  backend.causal_attention(q, k, v, scale, out, lse);
  KernelResults results{out.to(Device::cpu()), lse.to(Device::cpu()), {}, {}, {}};
  if (out_for_backward.defined()) {
    const Tensor grad_q = Tensor::empty(shape, dtype, device), grad_k = Tensor::empty(shape, dtype, device),
                 grad_v = Tensor::empty(shape, dtype, device);
    backend.causal_attention_backward(g, q, k, v, out_for_backward.to(device), lse_for_backward.to(device), scale,
                                      grad_q, grad_k, grad_v);
    results.grad_q = grad_q.to(Device::cpu());
    results.grad_k = grad_k.to(Device::cpu());
    results.grad_v = grad_v.to(Device::cpu());
  }
  return results;
}

struct FrontEndResults {
  Tensor out, grad_q, grad_k, grad_v;  // on the CPU
};

// scaled_dot_product_attention on `device` and its gradients by autograd::backward.
FrontEndResults run_front_end(const Inputs& in, Device device) {
  Tensor q = in.q.to(device).detach(), k = in.k.to(device).detach(), v = in.v.to(device).detach();
  q.requires_grad_();
  k.requires_grad_();
  v.requires_grad_();
  const Tensor out = scaled_dot_product_attention(q, k, v);
  backward({out}, {in.grad_out.to(device)});
  return {out.to(Device::cpu()), q.grad().to(Device::cpu()), k.grad().to(Device::cpu()),
          v.grad().to(Device::cpu())};
}

// The kernels on CUDA against the CPU's for one shape and dtype.
void expect_kernels_match_cpu(const Shape& shape, DType dtype, uint64_t seed) {
  const Inputs in = random_inputs(shape, dtype, seed);
  const KernelResults cpu_forward = run_kernels(in, Tensor(), Tensor(), Device::cpu());
  const KernelResults cpu = run_kernels(in, cpu_forward.out, cpu_forward.lse, Device::cpu());
  const KernelResults cuda = run_kernels(in, cpu_forward.out, cpu_forward.lse, cuda0());
  const std::string where = describe(dtype, shape);
  EXPECT_TRUE(close_to_cpu(cuda.out, cpu.out, value_bound(dtype), "out " + where));
  EXPECT_TRUE(close_to_cpu(cuda.lse, cpu.lse, value_bound(stats_dtype(dtype)), "lse " + where));
  // grad_q and grad_k are dS K and dS^T Q with dS = P (dP - D): at T = 1 (P = 1, dP = D) they are exactly 0 and
  // each device returns its own rounding residue of dP - D. Their atol is relative to grad_v's scale (P^T dO).
  const double dv_scale = max_abs(cpu.grad_v.to_vector<double>());
  EXPECT_TRUE(close_to_cpu(cuda.grad_q, cpu.grad_q, gradient_bound(dtype), "grad_q " + where, dv_scale));
  EXPECT_TRUE(close_to_cpu(cuda.grad_k, cpu.grad_k, gradient_bound(dtype), "grad_k " + where, dv_scale));
  EXPECT_TRUE(close_to_cpu(cuda.grad_v, cpu.grad_v, gradient_bound(dtype), "grad_v " + where));
}

// The front end on CUDA against the CPU's, forward and gradients.
void expect_front_end_matches_cpu(const Shape& shape, DType dtype, uint64_t seed) {
  const Inputs in = random_inputs(shape, dtype, seed);
  const FrontEndResults cpu = run_front_end(in, Device::cpu());
  const FrontEndResults cuda = run_front_end(in, cuda0());
  const std::string where = describe(dtype, shape);
  EXPECT_TRUE(close_to_cpu(cuda.out, cpu.out, value_bound(dtype), "out " + where));
  EXPECT_TRUE(close_to_cpu(cuda.grad_q, cpu.grad_q, front_end_gradient_bound(dtype), "grad_q " + where));
  EXPECT_TRUE(close_to_cpu(cuda.grad_k, cpu.grad_k, front_end_gradient_bound(dtype), "grad_k " + where));
  EXPECT_TRUE(close_to_cpu(cuda.grad_v, cpu.grad_v, front_end_gradient_bound(dtype), "grad_v " + where));
}

// Shapes [B, H, T, D]: T of 1, within one tile, at and across tile edges; D at each register width (32, 64,
// 128) and between them, D = 1 and D not a multiple of 4 or 16.
const std::vector<Shape> kShapes = {{1, 1, 1, 8},  {2, 3, 7, 16},  {1, 2, 64, 64},  {1, 2, 65, 64},
                                    {2, 2, 130, 8}, {1, 1, 130, 33}, {1, 1, 97, 1},  {1, 2, 130, 100},
                                    {1, 1, 70, 128}, {2, 1, 129, 5}};

const std::vector<DType> kDtypes = {DType::F32, DType::F16, DType::BF16, DType::F64};

std::vector<double> values(const Tensor& t) { return t.to_vector<double>(); }

}  // namespace

// ---- the kernels on identical inputs ---------------------------------------------------------------------

TEST(CudaAttention, KernelsMatchCpuInEveryDtype) {
  MIXTAPE_REQUIRE_CUDA();
  const mixtape::testing::PortableAttention portable_cpu;
  const mixtape::testing::SimtCudaAttention simt;
  uint64_t seed = 100;
  for (DType dtype : kDtypes)
    for (const Shape& shape : kShapes) expect_kernels_match_cpu(shape, dtype, seed += 10);
}

// GPT-2 small's head (D = 64) at a long sequence: 16 query tiles, most key tiles skipped by the mask.
TEST(CudaAttention, KernelsMatchCpuAtLongSequence) {
  MIXTAPE_REQUIRE_CUDA();
  const mixtape::testing::PortableAttention portable_cpu;
  const mixtape::testing::SimtCudaAttention simt;
  expect_kernels_match_cpu({1, 3, 1024, 64}, DType::F32, 7);
  expect_kernels_match_cpu({1, 2, 1024, 64}, DType::BF16, 8);
}

// ---- through the front end and autograd ------------------------------------------------------------------

TEST(CudaAttention, FrontEndMatchesCpuInEveryDtype) {
  MIXTAPE_REQUIRE_CUDA();
  const mixtape::testing::PortableAttention portable_cpu;
  const mixtape::testing::SimtCudaAttention simt;
  uint64_t seed = 500;
  for (DType dtype : kDtypes)
    for (const Shape& shape : {Shape{2, 2, 7, 16}, Shape{1, 2, 65, 64}, Shape{1, 1, 130, 24}})
      expect_front_end_matches_cpu(shape, dtype, seed += 10);
}

// q, k, v as the thirds of a fused [B, T, 3, H, D] projection (B, H, T strides free, head dim contiguous):
// read in place on CUDA, the gradient lands in the fused tensor's grad. Against the CPU on the same views,
// and bit for bit against contiguous copies on CUDA (strides change addresses only, never a sum's order).
TEST(CudaAttention, StridedViewsOfAFusedProjection) {
  MIXTAPE_REQUIRE_CUDA();
  const mixtape::testing::PortableAttention portable_cpu;
  const int64_t B = 2, T = 67, H = 3, D = 16;
  for (DType dtype : {DType::F32, DType::BF16}) {
    const Tensor qkv_cpu = uniform_tensor({B, T, 3, H, D}, 21, -2, 2, dtype);
    const Tensor g_cpu = uniform_tensor({B, H, T, D}, 22, -1, 1, dtype);
    auto strided = [&](Device device, Tensor& out) {
      Tensor qkv = qkv_cpu.to(device).detach();
      qkv.requires_grad_();
      auto head = [&](int64_t part) { return qkv.select(2, part).permute({0, 2, 1, 3}); };
      EXPECT_FALSE(head(0).is_contiguous());
      out = scaled_dot_product_attention(head(0), head(1), head(2));
      backward({out}, {g_cpu.to(device)});
      return qkv.grad().to(Device::cpu());
    };
    Tensor out_cpu, out_cuda;
    const Tensor grad_cpu = strided(Device::cpu(), out_cpu);
    const Tensor grad_cuda = strided(cuda0(), out_cuda);
    const std::string where = describe(dtype, {B, T, 3, H, D});
    EXPECT_TRUE(close_to_cpu(out_cuda.to(Device::cpu()), out_cpu, value_bound(dtype), "out " + where));
    EXPECT_TRUE(close_to_cpu(grad_cuda, grad_cpu, front_end_gradient_bound(dtype), "grad qkv " + where));

    // Contiguous copies of the same heads on CUDA: the same bits.
    Inputs contiguous;
    for (int64_t part = 0; part < 3; ++part) {
      const Tensor head = qkv_cpu.select(2, part).permute({0, 2, 1, 3}).contiguous();
      (part == 0 ? contiguous.q : part == 1 ? contiguous.k : contiguous.v) = head;
    }
    contiguous.grad_out = g_cpu;
    const FrontEndResults plain = run_front_end(contiguous, cuda0());
    EXPECT_EQ(values(out_cuda.to(Device::cpu())), values(plain.out));
    EXPECT_EQ(values(grad_cuda.select(2, 0).permute({0, 2, 1, 3})), values(plain.grad_q));
    EXPECT_EQ(values(grad_cuda.select(2, 1).permute({0, 2, 1, 3})), values(plain.grad_k));
    EXPECT_EQ(values(grad_cuda.select(2, 2).permute({0, 2, 1, 3})), values(plain.grad_v));
  }
}

// GPT's fused form: the kernel reads heads in a [B, T, 3C] qkv and writes [B, T, C] out and the [B, T, 3C]
// gradient through strides.
TEST(CudaAttention, CausalSelfAttentionMatchesCpu) {
  MIXTAPE_REQUIRE_CUDA();
  const mixtape::testing::PortableAttention portable_cpu;
  const int64_t B = 2, T = 70, n_head = 4, C = 4 * 16;
  for (DType dtype : kDtypes) {
    const Tensor qkv_cpu = uniform_tensor({B, T, 3 * C}, 31, -2, 2, dtype);
    const Tensor g_cpu = uniform_tensor({B, T, C}, 32, -1, 1, dtype);
    auto run = [&](Device device, Tensor& grad) {
      Tensor qkv = qkv_cpu.to(device).detach();
      qkv.requires_grad_();
      const Tensor out = causal_self_attention(qkv, n_head);
      backward({out}, {g_cpu.to(device)});
      grad = qkv.grad().to(Device::cpu());
      return out.to(Device::cpu());
    };
    Tensor grad_cpu, grad_cuda;
    const Tensor out_cpu = run(Device::cpu(), grad_cpu);
    const Tensor out_cuda = run(cuda0(), grad_cuda);
    const std::string where = describe(dtype, {B, T, 3 * C});
    EXPECT_TRUE(close_to_cpu(out_cuda, out_cpu, value_bound(dtype), "out " + where));
    EXPECT_TRUE(close_to_cpu(grad_cuda, grad_cpu, front_end_gradient_bound(dtype), "grad qkv " + where));
  }
}

// ---- determinism and limits ------------------------------------------------------------------------------

// No atomics anywhere: two runs of the forward and the backward give the same bits, with either kernel.
TEST(CudaAttention, TwoRunsGiveIdenticalBits) {
  MIXTAPE_REQUIRE_CUDA();
  const mixtape::testing::PortableAttention portable_cpu;
  for (CudaAttentionKernel kernel : {CudaAttentionKernel::Simt, CudaAttentionKernel::TensorCores})
  for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
    const mixtape::testing::CudaAttentionKernelScope scope(kernel);
    const Inputs in = random_inputs({2, 3, 200, 64}, dtype, 41);
    const FrontEndResults first = run_front_end(in, cuda0());
    const FrontEndResults second = run_front_end(in, cuda0());
    EXPECT_EQ(values(first.out), values(second.out)) << dtype_name(dtype);
    EXPECT_EQ(values(first.grad_q), values(second.grad_q)) << dtype_name(dtype);
    EXPECT_EQ(values(first.grad_k), values(second.grad_k)) << dtype_name(dtype);
    EXPECT_EQ(values(first.grad_v), values(second.grad_v)) << dtype_name(dtype);
  }
}

// Head dims above 128 are refused with a message that says so (the kernels keep a row in registers).
TEST(CudaAttention, RejectsHeadDimAbove128) {
  MIXTAPE_REQUIRE_CUDA();
  const mixtape::testing::PortableAttention portable_cpu;
  const Tensor q = Tensor::zeros({1, 1, 4, 160}, DType::F32).to(cuda0());
  EXPECT_ERROR_MENTIONS(scaled_dot_product_attention(q, q, q), "causal_attention", "head dim", "160", "128");
}

// ---- the tensor-core kernels -----------------------------------------------------------------------------

namespace {

// Half an ulp of 1 in the dtype (the rounding of a value in [1, 2)): 2^-8 for bf16, 2^-11 for f16. It is also
// the relative rounding of p and ds to the dtype (at most half an ulp of a value in [1, 2) relative to it).
double half_ulp_of_one(DType dtype) { return epsilon(dtype) / 2; }

Inputs widened(const Inputs& in) {
  return {in.q.to(DType::F64), in.k.to(DType::F64), in.v.to(DType::F64), in.grad_out.to(DType::F64)};
}

// Shapes for the tensor-core kernels: T of 1, ragged within a tile, across tiles and long; D = 32, 64, 128.
const std::vector<Shape> kTensorCoreShapes = {{1, 1, 1, 64},   {1, 2, 33, 32},  {2, 3, 200, 64},
                                              {2, 1, 130, 128}, {1, 2, 1024, 64}};

}  // namespace

// out = sum_j p~_j v_j / sum_j p~_j with p~ the probabilities rounded to the dtype (relative error at most
// u = half_ulp_of_one each; the online softmax rescales o and l by the same factors, so the weights stay
// consistent): a convex combination of the v rows whose weights are off by at most u relative each. With v in
// [1, 2] (outputs in [1, 2], where an ulp is 4u), the value before its rounding is within u (max v - min v) <=
// u = 1/4 ulp of the exact one, plus fp32 noise; rounding adds at most 1/2 ulp: within 1 ulp in all. Mixed-sign
// v in [-1, 1]: within half an ulp of 1 (the rounding at the output's scale) plus u * 2 for the weights. (f16's
// subnormal p below 2^-14 round with an absolute 2^-25: at T = 1024 at most 2^-15 of a weight sum >= 1.)
TEST(CudaAttention, TensorCoreOutputsAreWithinOneUlpOfF64) {
  MIXTAPE_REQUIRE_CUDA();
  const mixtape::testing::CudaAttentionKernelScope scope(CudaAttentionKernel::TensorCores);
  uint64_t seed = 900;
  for (DType dtype : {DType::BF16, DType::F16})
    for (const Shape& shape : kTensorCoreShapes) {
      SCOPED_TRACE(describe(dtype, shape));
      const Tensor q = uniform_tensor(shape, ++seed, -2, 2, dtype), k = uniform_tensor(shape, ++seed, -2, 2, dtype);
      const Tensor v = uniform_tensor(shape, ++seed, 1, 2, dtype);
      const Tensor out = scaled_dot_product_attention(q.to(cuda0()), k.to(cuda0()), v.to(cuda0())).to(Device::cpu());
      const Tensor exact = scaled_dot_product_attention(q.to(DType::F64), k.to(DType::F64), v.to(DType::F64));
      EXPECT_TRUE(mixtape::testing::within_ulp(out, exact, 1));
      const Tensor v_signed = uniform_tensor(shape, ++seed, -1, 1, dtype);
      const Tensor out_signed =
          scaled_dot_product_attention(q.to(cuda0()), k.to(cuda0()), v_signed.to(cuda0())).to(Device::cpu());
      const Tensor exact_signed =
          scaled_dot_product_attention(q.to(DType::F64), k.to(DType::F64), v_signed.to(DType::F64));
      EXPECT_TRUE(mixtape::testing::all_close(out_signed, exact_signed, 3 * half_ulp_of_one(dtype) + 1e-5, 0));
    }
}

// Gradients through the front end against the f64 composition, the CPU bf16 kernels' bound (tests/
// test_attention.cpp's Bf16Attention.GradientsMatchF64Composition): 4 u of the largest gradient. On top of the
// SIMT kernels' roundings, p and ds are rounded (u relative each) before their products, an error of the same
// order as the gradients' own rounding.
TEST(CudaAttention, TensorCoreGradientsMatchF64) {
  MIXTAPE_REQUIRE_CUDA();
  const mixtape::testing::CudaAttentionKernelScope scope(CudaAttentionKernel::TensorCores);
  uint64_t seed = 950;
  for (DType dtype : {DType::BF16, DType::F16})
    for (const Shape& shape : kTensorCoreShapes) {
      SCOPED_TRACE(describe(dtype, shape));
      const Inputs in = random_inputs(shape, dtype, seed += 10);
      const FrontEndResults got = run_front_end(in, cuda0());
      const FrontEndResults exact = run_front_end(widened(in), Device::cpu());
      // At T = 1 grad_q and grad_k are exactly 0 (dp = delta) and hold rounding residues only (seen on an H100:
      // f16 residues against f64's ~1e-16): their scale there is grad_v's, as in expect_kernels_match_cpu.
      const double dv_scale = max_abs(values(exact.grad_v));
      for (const auto& [grad, want, name, floor] : {std::tuple{got.grad_q, exact.grad_q, "grad_q", dv_scale},
                                                    {got.grad_k, exact.grad_k, "grad_k", dv_scale},
                                                    {got.grad_v, exact.grad_v, "grad_v", 0.0}}) {
        EXPECT_EQ(grad.dtype(), dtype);
        const double scale = shape[2] == 1 ? std::max(max_abs(values(want)), floor) : max_abs(values(want));
        EXPECT_TRUE(mixtape::testing::all_close(grad, want, 4 * half_ulp_of_one(dtype) * scale, 0)) << name;
      }
    }
}

// The dispatch: the tensor cores serve f16/bf16 at D = 32, 64, 128 (their rounded p changes the last bits
// against the SIMT kernels), and nothing else (f32, f64 and other head dims give the SIMT kernels' bits).
TEST(CudaAttention, TensorCoresServeSixteenBitHeadsOf32To128Only) {
  MIXTAPE_REQUIRE_CUDA();
  EXPECT_EQ(cuda_attention_kernel(), CudaAttentionKernel::TensorCores);  // the default
  auto forward = [](const Tensor& q, CudaAttentionKernel kernel) {
    const mixtape::testing::CudaAttentionKernelScope scope(kernel);
    const Tensor on_gpu = q.to(cuda0());
    return values(scaled_dot_product_attention(on_gpu, on_gpu * 0.5, on_gpu * -1.0).to(Device::cpu()));
  };
  for (const auto& [dtype, D, served] : {std::tuple{DType::BF16, int64_t{64}, true}, {DType::F16, int64_t{128}, true},
                                         {DType::BF16, int64_t{32}, true}, {DType::BF16, int64_t{48}, false},
                                         {DType::F16, int64_t{16}, false}, {DType::F32, int64_t{64}, false},
                                         {DType::F64, int64_t{64}, false}}) {
    const Tensor q = uniform_tensor({2, 2, 150, D}, 77, -2, 2, dtype);
    const std::vector<double> simt = forward(q, CudaAttentionKernel::Simt);
    const std::vector<double> tensor_cores = forward(q, CudaAttentionKernel::TensorCores);
    if (served)
      EXPECT_NE(tensor_cores, simt) << describe(dtype, q.shape());
    else
      EXPECT_EQ(tensor_cores, simt) << describe(dtype, q.shape());
  }
}

// The heads of a fused qkv (rows 16-byte aligned) and heads whose rows start at odd element offsets (a
// [.., D + 1] tensor narrowed to its last D columns: the element-by-element load path) give bitwise the
// contiguous heads' results, forward and backward.
TEST(CudaAttention, TensorCoresReadStridedAndUnalignedHeadsInPlace) {
  MIXTAPE_REQUIRE_CUDA();
  const mixtape::testing::CudaAttentionKernelScope scope(CudaAttentionKernel::TensorCores);
  const int64_t B = 2, H = 3, T = 100, D = 64;
  for (DType dtype : {DType::BF16, DType::F16}) {
    SCOPED_TRACE(dtype_name(dtype));
    // Views made on the GPU (a copy between devices is contiguous).
    const Tensor qkv = uniform_tensor({B, T, 3, H, D}, 81, -2, 2, dtype).to(cuda0());
    auto fused = [&](int64_t part) { return qkv.select(2, part).permute({0, 2, 1, 3}); };
    auto odd = [&](uint64_t seed) {
      return uniform_tensor({B, H, T, D + 1}, seed, -2, 2, dtype).to(cuda0()).narrow(3, 1, D);
    };
    const Tensor g = uniform_tensor({B, H, T, D}, 85, -1, 1, dtype);
    for (const Inputs& in : {Inputs{fused(0), fused(1), fused(2), g}, Inputs{odd(82), odd(83), odd(84), g}}) {
      ASSERT_FALSE(in.q.is_contiguous());
      const FrontEndResults strided = run_front_end(in, cuda0());
      const FrontEndResults plain =
          run_front_end({in.q.contiguous(), in.k.contiguous(), in.v.contiguous(), g}, cuda0());
      EXPECT_EQ(values(strided.out), values(plain.out));
      EXPECT_EQ(values(strided.grad_q), values(plain.grad_q));
      EXPECT_EQ(values(strided.grad_k), values(plain.grad_k));
      EXPECT_EQ(values(strided.grad_v), values(plain.grad_v));
    }
  }
}
