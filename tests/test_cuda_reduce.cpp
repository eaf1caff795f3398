// CUDA reductions, softmax and the multi-tensor kernels (tensor/cuda/reduce.cu, tensor/cuda/multi_tensor.cu)
// against the CPU backend, through the public front ends. The CPU kernels are the reference: both sides
// accumulate in the same type (f32 for f32/f16/bf16, f64 for f64) and round once, but in different orders, so
// results agree to a few ulp of the output dtype, or to an absolute bound where a result is a cancellation
// near zero (an ulp of a tiny result means nothing). Max/min and AMP's unscale involve no sum and must match
// exactly.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "amp/scaler.h"
#include "autograd/autograd.h"
#include "cuda_test_util.h"
#include "optim/adam.h"
#include "optim/clip.h"
#include "optim/sgd.h"
#include "tensor/backend.h"
#include "tensor/ops.h"
#include "test_util.h"

using namespace mixtape;
using mixtape::testing::cuda0;
using mixtape::testing::ulp_distance;
using mixtape::testing::uniform_tensor;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

const std::vector<DType> kDtypes = {DType::F32, DType::F16, DType::BF16, DType::F64};

std::string scientific(double x) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.3g", x);
  return text;
}

// Every element of `actual` (any device) within max_ulp ulps of `expected` (CPU, same dtype) or within
// atol + rtol * |expected| of it; NaN only where expected is NaN.
::testing::AssertionResult matches_cpu(const Tensor& actual, const Tensor& expected, double max_ulp, double atol,
                                       double rtol = 0) {
  if (actual.shape() != expected.shape() || actual.dtype() != expected.dtype())
    return ::testing::AssertionFailure() << actual.description() << " vs " << expected.description();
  const std::vector<double> got = actual.to(Device::cpu()).to_vector<double>(), want = expected.to_vector<double>();
  int bad = 0;
  std::string report;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool ok = (std::isnan(got[i]) && std::isnan(want[i])) ||
                    ulp_distance(actual.dtype(), got[i], want[i]) <= max_ulp ||
                    std::abs(got[i] - want[i]) <= atol + rtol * std::abs(want[i]);
    if (!ok && bad++ < 5)
      report += "element " + std::to_string(i) + ": cuda " + std::to_string(got[i]) + ", cpu " +
                std::to_string(want[i]) + " (" + std::to_string(ulp_distance(actual.dtype(), got[i], want[i])) +
                " ulp, " + scientific(std::abs(got[i] - want[i])) + " apart)\n";
  }
  if (bad) return ::testing::AssertionFailure() << bad << " of " << got.size() << " elements differ\n" << report;
  return ::testing::AssertionSuccess();
}

// Bit-for-bit equality (NaN equal to NaN).
::testing::AssertionResult equals_cpu(const Tensor& actual, const Tensor& expected) {
  return matches_cpu(actual, expected, 0, 0);
}

// Bounds for sums of n values of magnitude <= 2 added in two different orders. Each side's rounding error is
// a random walk of ~n roundings of partial sums up to ~sqrt(n) in size; its worst case grows like n * eps.
// The bound: 2 ulp of the output dtype, or an absolute n * 4e-7 + 1e-4 for float accumulation (f32, f16,
// bf16: ~6x the typical difference at n = 800, ~10x at n = 300000), n * 1e-15 + 1e-13 for f64. The absolute
// part matters where a sum cancels towards zero and an ulp of the result means nothing.
double sum_atol(DType dtype, int64_t n) {
  return dtype == DType::F64 ? 1e-15 * static_cast<double>(n) + 1e-13 : 4e-7 * static_cast<double>(n) + 1e-4;
}
// Variance sums positive squares: relative differences ~sqrt(n) eps, bounded here by 16 sqrt(n) eps.
double var_rtol(DType dtype, int64_t n) {
  return (dtype == DType::F64 ? 16 * 1.1e-16 : 16 * 6e-8) * std::sqrt(static_cast<double>(n)) + 1e-15;
}
constexpr double kSumUlp = 2;

// Elements combined into each output of a reduction of `shape` over `dims` (all dims when empty).
int64_t reduced_count(const Shape& shape, const std::vector<int64_t>& dims) {
  int64_t n = 1;
  for (size_t d = 0; d < shape.size(); ++d)
    if (dims.empty() || std::find(dims.begin(), dims.end(), static_cast<int64_t>(d)) != dims.end()) n *= shape[d];
  return n;
}

// The same view on the CPU tensor and on its CUDA copy (views cost no kernel, so the CUDA side stays strided).
struct Pair {
  Tensor cpu, gpu;
};
Pair random_pair(const Shape& shape, uint64_t seed, DType dtype, double low = -2, double high = 2) {
  const Tensor cpu = uniform_tensor(shape, seed, low, high, dtype);
  return {cpu, cpu.to(cuda0())};
}
Pair view(const Pair& p, const std::function<Tensor(const Tensor&)>& make_view) {
  return {make_view(p.cpu), make_view(p.gpu)};
}

// The input layouts every reduction and softmax is checked on: contiguous, transposed (the reduced or
// softmax dim strided), sliced with a step and an offset (16-byte alignment broken), broadcast (stride 0).
std::vector<std::pair<std::string, Pair>> layouts(DType dtype, uint64_t seed) {
  std::vector<std::pair<std::string, Pair>> out;
  out.push_back({"contiguous [4,6,33]", random_pair({4, 6, 33}, seed, dtype)});
  out.push_back({"transposed [33,6,4]",
                 view(random_pair({4, 6, 33}, seed + 1, dtype), [](const Tensor& t) { return t.transpose(0, 2); })});
  out.push_back({"sliced [4,6,33] step 2 offset 1",
                 view(random_pair({4, 6, 67}, seed + 2, dtype), [](const Tensor& t) { return t.slice(2, 1, 67, 2); })});
  out.push_back(
      {"broadcast [4,6,33] from [4,1,33]", view(random_pair({4, 1, 33}, seed + 3, dtype), [](const Tensor& t) {
         return t.expand({4, 6, 33});
       })});
  return out;
}

const std::vector<std::vector<int64_t>> kDimSets = {{}, {0}, {1}, {2}, {0, 2}, {1, 2}, {0, 1}};

}  // namespace

// ---- reductions -------------------------------------------------------------------------------------------

TEST(CudaReduce, SumAndMeanMatchCpuOverEveryDimSetAndLayout) {
  MIXTAPE_REQUIRE_CUDA();
  for (DType dtype : kDtypes)
    for (const auto& [name, x] : layouts(dtype, 10))
      for (const auto& dims : kDimSets)
        for (bool keepdim : {false, true}) {
          SCOPED_TRACE(dtype_name(dtype) + std::string(" ") + name + " dims " + shape_str(dims) +
                       (keepdim ? " keepdim" : ""));
          const int64_t n = reduced_count(x.cpu.shape(), dims);
          EXPECT_TRUE(matches_cpu(sum(x.gpu, dims, keepdim), sum(x.cpu, dims, keepdim), kSumUlp, sum_atol(dtype, n)));
          EXPECT_TRUE(matches_cpu(mean(x.gpu, dims, keepdim), mean(x.cpu, dims, keepdim), kSumUlp,
                                  sum_atol(dtype, n) / static_cast<double>(n)));
        }
}

TEST(CudaReduce, MaxAndMinMatchCpuExactly) {
  MIXTAPE_REQUIRE_CUDA();
  for (DType dtype : kDtypes)
    for (const auto& [name, x] : layouts(dtype, 20))
      for (const auto& dims : kDimSets) {
        SCOPED_TRACE(dtype_name(dtype) + std::string(" ") + name + " dims " + shape_str(dims));
        EXPECT_TRUE(equals_cpu(max(x.gpu, dims), max(x.cpu, dims)));
        EXPECT_TRUE(equals_cpu(min(x.gpu, dims), min(x.cpu, dims)));
      }
}

TEST(CudaReduce, MaxAndMinPropagateNaNLikeTheCpu) {
  MIXTAPE_REQUIRE_CUDA();
  for (DType dtype : kDtypes) {
    SCOPED_TRACE(dtype_name(dtype));
    std::vector<double> values = uniform_tensor({5, 40}, 30, -2, 2, DType::F64).to_vector<double>();
    values[1 * 40 + 7] = std::numeric_limits<double>::quiet_NaN();   // row 1: one NaN mid-row
    values[3 * 40 + 39] = std::numeric_limits<double>::quiet_NaN();  // row 3: NaN last
    values[4 * 40 + 0] = std::numeric_limits<double>::infinity();    // row 4: +inf (max), no NaN
    const Tensor cpu = Tensor::from_vector(values, {5, 40}, dtype);
    const Tensor gpu = cpu.to(cuda0());
    for (int64_t dim : {0, 1}) {
      EXPECT_TRUE(equals_cpu(max(gpu, {dim}), max(cpu, {dim})));
      EXPECT_TRUE(equals_cpu(min(gpu, {dim}), min(cpu, {dim})));
    }
    EXPECT_TRUE(std::isnan(max(gpu).item()));
    EXPECT_TRUE(std::isnan(min(gpu).item()));
  }
}

TEST(CudaReduce, LongAndShortReductionsTakeEveryKernelPath) {
  MIXTAPE_REQUIRE_CUDA();
  // Long rows (row mode split into chunks, then a second stage), long columns (column mode split into chunks),
  // a full reduction of 300k elements (two row stages), short rows (a thread per output).
  struct Case {
    Shape shape;
    std::vector<int64_t> dims;
  };
  const std::vector<Case> cases = {{{3, 20000}, {1}},      {{20000, 5}, {0}}, {{300000}, {}},   {{1000, 3}, {1}},
                                   {{7, 3, 2000}, {0, 2}}, {{2, 70000}, {0}}, {{64, 512}, {0}}, {{513, 17}, {1}}};
  for (DType dtype : {DType::F32, DType::BF16, DType::F64})
    for (const Case& c : cases) {
      SCOPED_TRACE(dtype_name(dtype) + std::string(" ") + shape_str(c.shape) + " dims " + shape_str(c.dims));
      const Pair x = random_pair(c.shape, 40, dtype, -1, 1);
      const int64_t n = reduced_count(c.shape, c.dims);
      const double atol = sum_atol(dtype, n);
      EXPECT_TRUE(matches_cpu(sum(x.gpu, c.dims), sum(x.cpu, c.dims), kSumUlp, atol));
      EXPECT_TRUE(matches_cpu(mean(x.gpu, c.dims), mean(x.cpu, c.dims), kSumUlp, atol / static_cast<double>(n)));
      EXPECT_TRUE(equals_cpu(max(x.gpu, c.dims), max(x.cpu, c.dims)));
      EXPECT_TRUE(equals_cpu(min(x.gpu, c.dims), min(x.cpu, c.dims)));
      EXPECT_TRUE(matches_cpu(var(x.gpu, c.dims), var(x.cpu, c.dims), kSumUlp, 0, var_rtol(dtype, n)));
    }
}

TEST(CudaReduce, ReductionsAreBitwiseReproducible) {
  MIXTAPE_REQUIRE_CUDA();
  const Pair x = random_pair({300000}, 50, DType::F32);
  const std::vector<double> first = sum(x.gpu).to(Device::cpu()).to_vector<double>();
  for (int run = 0; run < 3; ++run) EXPECT_EQ(sum(x.gpu).to(Device::cpu()).to_vector<double>(), first);
}

TEST(CudaVar, MatchesCpuWithEveryCorrection) {
  MIXTAPE_REQUIRE_CUDA();
  for (DType dtype : kDtypes)
    for (const auto& [name, x] : layouts(dtype, 60))
      for (const auto& dims : kDimSets)
        for (int64_t correction : {0, 1}) {
          SCOPED_TRACE(dtype_name(dtype) + std::string(" ") + name + " dims " + shape_str(dims) + " correction " +
                       std::to_string(correction));
          // Squared deviations are positive: no cancellation, a relative bound holds (the absolute one is for
          // the broadcast layout, whose variance over the broadcast dim is 0 up to rounding of the mean).
          EXPECT_TRUE(matches_cpu(var(x.gpu, dims, correction), var(x.cpu, dims, correction), kSumUlp,
                                  dtype == DType::F64 ? 1e-13 : 1e-6,
                                  var_rtol(dtype, reduced_count(x.cpu.shape(), dims))));
        }
}

// norm composes abs, pow, sum, sqrt, max and where: the CUDA kernels of those, with their sums' bounds
// (|x|^p of values up to 2 sum positively: a relative bound), forward and backward.
TEST(CudaNorm, ForwardAndBackwardMatchCpuForEveryP) {
  MIXTAPE_REQUIRE_CUDA();
  for (DType dtype : kDtypes)
    for (const auto& [name, x] : layouts(dtype, 62))
      for (const auto& dims : kDimSets)
        for (double p : {2.0, 1.0, kInf, 3.0, 0.5}) {
          SCOPED_TRACE(dtype_name(dtype) + std::string(" ") + name + " dims " + shape_str(dims) + " p " +
                       std::to_string(p));
          const double rtol = 4 * var_rtol(dtype, reduced_count(x.cpu.shape(), dims));
          const Tensor gpu = x.gpu.detach().requires_grad_(), cpu = x.cpu.detach().requires_grad_();
          const Tensor out_gpu = norm(gpu, p, dims), out_cpu = norm(cpu, p, dims);
          EXPECT_TRUE(matches_cpu(out_gpu, out_cpu, kSumUlp, 0, rtol));
          backward(sum(out_gpu));
          backward(sum(out_cpu));
          EXPECT_TRUE(matches_cpu(gpu.grad(), cpu.grad(), kSumUlp, dtype == DType::F64 ? 1e-13 : 1e-6, rtol));
        }
}

TEST(CudaVar, IsTwoPassAccurateForALargeMean) {
  MIXTAPE_REQUIRE_CUDA();
  // |mean| = 1000 >> std ~ 0.6: one pass (E[x^2] - E[x]^2) would lose every digit in f32.
  const Pair x = random_pair({16, 300}, 70, DType::F32, 999, 1001);
  EXPECT_TRUE(matches_cpu(var(x.gpu, {1}), var(x.cpu, {1}), kSumUlp, 0, var_rtol(DType::F32, 300)));
}

// ---- softmax ------------------------------------------------------------------------------------------------

namespace {

// softmax or log_softmax forward and backward on both devices for x (a CPU/CUDA pair of one layout).
// Forward bounds: 4 ulp (CUDA's expf is within 2 ulp, the CPU's polynomial within 1, then a division), or a
// relative 2e-6 in f32 for long rows (the two sides sum the row in different orders), or an absolute bound
// for results near 0 (log_softmax's (x - max) - log(sum) can cancel).
void check_softmax(const Pair& x, int64_t dim, bool log, uint64_t seed) {
  const DType dtype = x.cpu.dtype();
  const bool f64 = dtype == DType::F64;
  const double atol = f64 ? 1e-13 : 1e-6, rtol = f64 ? 1e-13 : 2e-6;
  const int64_t d = dim < 0 ? dim + x.cpu.dim() : dim;
  const int64_t n = x.cpu.shape()[d];
  Tensor xc = x.cpu.detach(), xg = x.gpu.detach();
  const bool through_autograd = dtype == DType::F32 || f64;
  if (through_autograd) {
    xc.requires_grad_();
    xg.requires_grad_();
  }
  const Tensor yc = log ? log_softmax(xc, dim) : softmax(xc, dim);
  const Tensor yg = log ? log_softmax(xg, dim) : softmax(xg, dim);
  EXPECT_TRUE(matches_cpu(yg, yc, 4, atol, rtol)) << "forward";
  if (through_autograd) {
    // The op's backward through the tape from the same upstream gradient, each side from its own y (which
    // differ by a few ulp, moving grad_x by about as much).
    const Pair g = random_pair(x.cpu.shape(), seed, dtype, -1, 1);
    backward({yc}, {g.cpu});
    backward({yg}, {g.gpu});
    EXPECT_TRUE(matches_cpu(xg.grad(), xc.grad(), 4, f64 ? 1e-12 : 1e-5, 2 * rtol)) << "backward through autograd";
  }
  // The backward kernel on identical inputs, every dtype (16-bit forward results may differ by an ulp, and an
  // ulp of a bf16 log-probability is 1% of its exp): y = the CPU's forward result (contiguous) on both
  // devices, grad_y = x's layout itself (strided as x, any values do for a gradient). Its row sum has the
  // rounding of any sum of n values.
  const Tensor y_cpu = yc.detach();
  const Tensor y_gpu = y_cpu.to(cuda0());
  const Tensor dc = Tensor::empty(x.cpu.shape(), dtype, Device::cpu());
  const Tensor dg = Tensor::empty(x.cpu.shape(), dtype, cuda0());
  backend_for(Device::cpu()).softmax_backward(y_cpu, x.cpu, d, log, dc);
  backend_for(cuda0()).softmax_backward(y_gpu, x.gpu, d, log, dg);
  EXPECT_TRUE(matches_cpu(dg, dc, kSumUlp, sum_atol(dtype, n), rtol)) << "softmax_backward kernel";
}

}  // namespace

TEST(CudaSoftmax, ForwardAndBackwardMatchCpuOverLastAndMiddleDims) {
  MIXTAPE_REQUIRE_CUDA();
  for (DType dtype : kDtypes)
    for (bool log : {false, true}) {
      SCOPED_TRACE(dtype_name(dtype) + std::string(log ? " log_softmax" : " softmax"));
      uint64_t seed = 100;
      for (const auto& [name, x] : layouts(dtype, seed))
        for (int64_t dim : {-1, 1, 0}) {
          SCOPED_TRACE(name + " dim " + std::to_string(dim));
          check_softmax(x, dim, log, ++seed);
        }
    }
}

TEST(CudaSoftmax, LongRowsUnalignedRowsAndWideValuesMatchCpu) {
  MIXTAPE_REQUIRE_CUDA();
  for (DType dtype : {DType::F32, DType::F16, DType::BF16})
    for (bool log : {false, true}) {
      SCOPED_TRACE(dtype_name(dtype) + std::string(log ? " log_softmax" : " softmax"));
      // A block per row (rows longer than 1024), with a tail after the 16-byte packs.
      check_softmax(random_pair({3, 5003}, 200, dtype, -8, 8), -1, log, 201);
      // Contiguous rows whose starts are not 16-byte aligned (row length 37, offset 1): the scalar path.
      check_softmax(view(random_pair({9, 38}, 202, dtype, -8, 8), [](const Tensor& t) { return t.slice(1, 1, 38); }),
                    -1, log, 203);
      // Aligned packs exactly (64 per row), a row of one element, and a strided long dim.
      check_softmax(random_pair({16, 64}, 204, dtype, -8, 8), -1, log, 205);
      check_softmax(random_pair({5, 1}, 206, dtype), -1, log, 207);
      check_softmax(random_pair({1500, 3}, 208, dtype, -8, 8), 0, log, 209);
    }
}

TEST(CudaSoftmax, NaNAndInfRowsMatchCpu) {
  MIXTAPE_REQUIRE_CUDA();
  std::vector<double> values = uniform_tensor({4, 40}, 300, -3, 3, DType::F64).to_vector<double>();
  values[0 * 40 + 5] = std::numeric_limits<double>::quiet_NaN();  // row 0: NaN everywhere
  values[1 * 40 + 3] = -std::numeric_limits<double>::infinity();  // row 1: a masked entry gives 0
  values[2 * 40 + 9] = 80;                                        // row 2: one dominant entry, ties absent
  values[3 * 40 + 1] = 5;                                         // row 3: two tied maxima
  values[3 * 40 + 2] = 5;
  for (bool log : {false, true}) {
    const Tensor cpu = Tensor::from_vector(values, {4, 40}, DType::F32);
    const Tensor gpu = cpu.to(cuda0());
    EXPECT_TRUE(matches_cpu(log ? log_softmax(gpu, 1) : softmax(gpu, 1), log ? log_softmax(cpu, 1) : softmax(cpu, 1), 4,
                            1e-6, 2e-6))
        << (log ? "log_softmax" : "softmax");
  }
}

// ---- AMP: unscale_and_check_finite --------------------------------------------------------------------------

namespace {

// Gradients of every dtype, more tensors than one launch packs, sizes around the chunk size.
std::vector<Tensor> amp_grads(uint64_t seed) {
  std::vector<Tensor> grads;
  grads.push_back(uniform_tensor({1000}, seed, -100, 100, DType::F32));
  grads.push_back(uniform_tensor({37}, seed + 1, -100, 100, DType::F16));
  grads.push_back(uniform_tensor({40000}, seed + 2, -100, 100, DType::BF16));
  grads.push_back(uniform_tensor({10}, seed + 3, -100, 100, DType::F64));
  grads.push_back(uniform_tensor({16385}, seed + 4, -100, 100, DType::F32));
  for (int k = 0; k < 120; ++k) grads.push_back(uniform_tensor({k % 7 + 1, 3}, seed + 10 + k, -100, 100, DType::F32));
  return grads;
}

std::vector<Tensor> to_cuda(const std::vector<Tensor>& tensors) {
  std::vector<Tensor> out;
  for (const Tensor& t : tensors) out.push_back(t.to(cuda0()));
  return out;
}

}  // namespace

TEST(CudaAmp, UnscaleMatchesCpuBitForBitAndFindsNoInfInFiniteGrads) {
  MIXTAPE_REQUIRE_CUDA();
  const std::vector<Tensor> cpu = amp_grads(400);
  const std::vector<Tensor> gpu = to_cuda(cpu);
  const double inv_scale = 1.0 / 65536.0 * 3;  // not a power of two: the multiply rounds
  EXPECT_FALSE(unscale_and_check_finite(cpu, inv_scale));
  EXPECT_FALSE(unscale_and_check_finite(gpu, inv_scale));
  for (size_t i = 0; i < cpu.size(); ++i) EXPECT_TRUE(equals_cpu(gpu[i], cpu[i])) << "tensor " << i;
}

TEST(CudaAmp, UnscaleReportsAnInfPlantedInOneTensorAndStillScalesTheRest) {
  MIXTAPE_REQUIRE_CUDA();
  for (size_t planted : {size_t{2}, size_t{100}}) {
    std::vector<Tensor> cpu = amp_grads(500);
    std::vector<double> values = cpu[planted].to_vector<double>();
    values[values.size() / 2] = std::numeric_limits<double>::infinity();
    cpu[planted] = Tensor::from_vector(values, cpu[planted].shape(), cpu[planted].dtype());
    const std::vector<Tensor> gpu = to_cuda(cpu);
    EXPECT_TRUE(unscale_and_check_finite(cpu, 0.5));
    EXPECT_TRUE(unscale_and_check_finite(gpu, 0.5)) << "inf in tensor " << planted;
    for (size_t i = 0; i < cpu.size(); ++i) EXPECT_TRUE(equals_cpu(gpu[i], cpu[i])) << "tensor " << i;
  }
}

TEST(CudaAmp, UnscaleReportsAFiniteValueThatOverflowsWhenStored) {
  MIXTAPE_REQUIRE_CUDA();
  // 60000 * 2 = 120000 > f16's 65504: finite in, inf stored.
  const Tensor g = Tensor::from_vector(std::vector<double>{1, 60000, -3}, {3}, DType::F16).to(cuda0());
  EXPECT_TRUE(unscale_and_check_finite({g}, 2.0));
  const Tensor ok = Tensor::from_vector(std::vector<double>{1, 60000, -3}, {3}, DType::F16).to(cuda0());
  EXPECT_FALSE(unscale_and_check_finite({ok}, 0.5));
}

TEST(CudaAmp, UnscaleTakesGradientsOnSeveralDevicesAndChecksEachOfThem) {
  MIXTAPE_REQUIRE_CUDA();
  // CPU and GPU tensors interleaved, an inf planted on either side in turn: every tensor is unscaled on its own
  // device (the same bits as an all-CPU call) and the inf is found wherever it is.
  for (const bool inf_on_gpu : {false, true}) {
    SCOPED_TRACE(inf_on_gpu ? "inf on the GPU" : "inf on the CPU");
    std::vector<Tensor> reference = amp_grads(600);
    const size_t planted = inf_on_gpu ? 3 : 2;  // odd indices go to the GPU below
    std::vector<double> values = reference[planted].to_vector<double>();
    values[0] = std::numeric_limits<double>::infinity();
    reference[planted] = Tensor::from_vector(values, reference[planted].shape(), reference[planted].dtype());
    std::vector<Tensor> mixed;
    for (size_t i = 0; i < reference.size(); ++i)
      mixed.push_back(i % 2 == 1 ? reference[i].to(cuda0()) : reference[i].clone());
    EXPECT_TRUE(unscale_and_check_finite(reference, 0.25));
    EXPECT_TRUE(unscale_and_check_finite(mixed, 0.25));
    for (size_t i = 0; i < reference.size(); ++i) {
      EXPECT_EQ(mixed[i].device().is_cuda(), i % 2 == 1);
      EXPECT_TRUE(equals_cpu(mixed[i].to(Device::cpu()), reference[i])) << "tensor " << i;
    }
  }
  const std::vector<Tensor> finite = {amp_grads(700)[0], amp_grads(700)[1].to(cuda0())};
  EXPECT_FALSE(unscale_and_check_finite(finite, 0.25));
}

TEST(CudaAmp, GradScalerStepsAnOptimizerWithParametersOnTheCpuAndTheGpu) {
  MIXTAPE_REQUIRE_CUDA();
  // PyTorch's GradScaler keeps a found_inf per device and skips the step if any is set; an optimizer may hold
  // CPU and GPU parameters (optim/optimizer.h). A clean step unscales both and steps; an inf on the GPU alone
  // skips the step for both and backs the scale off.
  Tensor on_cpu = Tensor::from_vector(std::vector<float>{1, 2}, {2}).requires_grad_();
  Tensor on_gpu = Tensor::from_vector(std::vector<float>{3, 4}, {2}).to(cuda0()).requires_grad_();
  SGD sgd({on_cpu, on_gpu}, 0.5);
  GradScaler scaler(GradScalerOptions{.init_scale = 8});
  auto give = [&](float gpu_value) {
    on_cpu.set_grad(Tensor::from_vector(std::vector<float>{8, 16}, {2}));  // 8 * {1, 2}: scaled by S = 8
    on_gpu.set_grad(Tensor::from_vector(std::vector<float>{gpu_value, 8}, {2}).to(cuda0()));
  };
  give(24);
  EXPECT_TRUE(scaler.step(sgd));
  scaler.update();
  EXPECT_EQ(on_cpu.to_vector<float>(), (std::vector<float>{0.5f, 1.0f}));  // 1 - 0.5 * 1, 2 - 0.5 * 2
  EXPECT_EQ(on_gpu.to(Device::cpu()).to_vector<float>(), (std::vector<float>{1.5f, 3.5f}));
  give(std::numeric_limits<float>::infinity());
  EXPECT_FALSE(scaler.step(sgd));
  scaler.update();
  EXPECT_EQ(scaler.scale(), 4.0);
  EXPECT_EQ(on_cpu.to_vector<float>(), (std::vector<float>{0.5f, 1.0f}));
  EXPECT_EQ(on_gpu.to(Device::cpu()).to_vector<float>(), (std::vector<float>{1.5f, 3.5f}));
}

// ---- optimizers ---------------------------------------------------------------------------------------------

namespace {

// Parameters (CPU and an identical CUDA copy) of several sizes, enough of them for two batches per launch.
struct ParamSet {
  std::vector<Tensor> cpu, gpu;
};
ParamSet make_params(DType dtype, uint64_t seed) {
  ParamSet set;
  std::vector<Shape> shapes = {{1}, {5}, {350, 200}, {16384}, {16385}, {3, 7}};
  for (int k = 0; k < 50; ++k) shapes.push_back({k + 1});  // 56 params: two launches for Adam and SGD
  for (const Shape& shape : shapes) {
    Tensor cpu = uniform_tensor(shape, seed++, -2, 2, dtype);
    Tensor gpu = cpu.to(cuda0());
    cpu.requires_grad_();
    gpu.requires_grad_();
    set.cpu.push_back(cpu);
    set.gpu.push_back(gpu);
  }
  return set;
}
void give_grads(const ParamSet& set, uint64_t seed) {
  for (size_t k = 0; k < set.cpu.size(); ++k) {
    const Tensor g = uniform_tensor(set.cpu[k].shape(), seed + k, -1, 1, set.cpu[k].dtype());
    Tensor(set.cpu[k]).set_grad(g);
    Tensor(set.gpu[k]).set_grad(g.to(cuda0()));
  }
}

// Same math in the same order on both devices; only FMA contraction may differ (nvcc contracts a * b + c into
// one rounding, GCC where it chooses): an ulp of the largest term per operation. Where an update cancels the
// parameter (p - lr * u near 0) that is many ulp of the small result, so the bound is a few ulp of the operands'
// scale (parameters in [-2, 2], moments and momentum up to ~4) in the arithmetic's precision (f32 for the 16-bit
// dtypes), or 4 ulp of the result. Seen on an H100: 47 of 70000 f32 AdamW parameters beyond 4 ulp, all near 0.
double contraction_atol(DType dtype) {
  return 16 * std::ldexp(1.0, dtype == DType::F64 ? -52 : -23);  // 4 ulp at a scale of 4
}
void expect_params_match(const ParamSet& set, const Optimizer& cpu_opt, const Optimizer& gpu_opt,
                         const std::vector<std::string>& buffers) {
  for (size_t k = 0; k < set.cpu.size(); ++k) {
    const double atol = contraction_atol(set.cpu[k].dtype());
    EXPECT_TRUE(matches_cpu(set.gpu[k], set.cpu[k], 4, atol)) << "param " << k;
    for (const std::string& name : buffers) {
      const ParamState* c = cpu_opt.state(set.cpu[k]);
      const ParamState* g = gpu_opt.state(set.gpu[k]);
      ASSERT_NE(c, nullptr);
      ASSERT_NE(g, nullptr);
      // Moments: f32 (f64) arithmetic repeated over 3 steps; exp_avg can cancel towards 0.
      EXPECT_TRUE(matches_cpu(g->buffers.at(name), c->buffers.at(name), 8, atol)) << name << " of param " << k;
    }
  }
}

}  // namespace

TEST(CudaOptim, AdamAndAdamWStepsMatchCpu) {
  MIXTAPE_REQUIRE_CUDA();
  for (DType dtype : kDtypes)
    for (bool decoupled : {false, true})
      for (double weight_decay : {0.0, 0.1}) {
        SCOPED_TRACE(dtype_name(dtype) + std::string(decoupled ? " AdamW" : " Adam") + " wd " +
                     std::to_string(weight_decay));
        const ParamSet set = make_params(dtype, 600);
        const AdamOptions options{.beta1 = 0.8, .beta2 = 0.95, .eps = 1e-6};
        std::unique_ptr<Optimizer> cpu_opt, gpu_opt;
        if (decoupled) {
          cpu_opt = std::make_unique<AdamW>(set.cpu, 0.01, weight_decay, options);
          gpu_opt = std::make_unique<AdamW>(set.gpu, 0.01, weight_decay, options);
        } else {
          cpu_opt = std::make_unique<Adam>(set.cpu, 0.01, weight_decay, options);
          gpu_opt = std::make_unique<Adam>(set.gpu, 0.01, weight_decay, options);
        }
        for (uint64_t t = 0; t < 3; ++t) {
          give_grads(set, 700 + 100 * t);
          cpu_opt->step();
          gpu_opt->step();
        }
        expect_params_match(set, *cpu_opt, *gpu_opt, {"exp_avg", "exp_avg_sq"});
      }
}

TEST(CudaOptim, SgdStepsMatchCpuInEveryVariant) {
  MIXTAPE_REQUIRE_CUDA();
  struct Variant {
    double momentum, dampening, weight_decay;
    bool nesterov;
  };
  for (DType dtype : {DType::F32, DType::BF16, DType::F64})
    for (const Variant& v : {Variant{0, 0, 0, false}, Variant{0.9, 0, 0.01, false}, Variant{0.9, 0.1, 0, false},
                             Variant{0.9, 0, 0.05, true}}) {
      SCOPED_TRACE(dtype_name(dtype) + std::string(" momentum ") + std::to_string(v.momentum) + " dampening " +
                   std::to_string(v.dampening) + " wd " + std::to_string(v.weight_decay) +
                   (v.nesterov ? " nesterov" : ""));
      const ParamSet set = make_params(dtype, 800);
      const SGDOptions options{.momentum = v.momentum, .dampening = v.dampening, .nesterov = v.nesterov};
      SGD cpu_opt(set.cpu, 0.05, v.weight_decay, options);
      SGD gpu_opt(set.gpu, 0.05, v.weight_decay, options);
      for (uint64_t t = 0; t < 3; ++t) {
        give_grads(set, 900 + 100 * t);
        cpu_opt.step();
        gpu_opt.step();
      }
      expect_params_match(set, cpu_opt, gpu_opt,
                          v.momentum != 0 ? std::vector<std::string>{"momentum_buffer"} : std::vector<std::string>{});
    }
}

// ---- gradient norm, determinism, zero count -----------------------------------------------------------------

TEST(CudaOptim, GradNormMatchesCpuToOneInATrillion) {
  MIXTAPE_REQUIRE_CUDA();
  ParamSet set;
  for (DType dtype : kDtypes) {
    const ParamSet part = make_params(dtype, 1000 + static_cast<uint64_t>(dtype) * 100);
    set.cpu.insert(set.cpu.end(), part.cpu.begin(), part.cpu.end());
    set.gpu.insert(set.gpu.end(), part.gpu.begin(), part.gpu.end());
  }
  give_grads(set, 1500);
  const double cpu = grad_norm(set.cpu), gpu = grad_norm(set.gpu);
  // Squares are exact in double and both sides add in double, in different orders: ~1e-16 relative per add.
  EXPECT_NEAR(gpu, cpu, 1e-12 * cpu);
}

TEST(CudaOptim, SumOfSquaresIsIdenticalBitForBitRunToRun) {
  MIXTAPE_REQUIRE_CUDA();
  std::vector<Tensor> grads = to_cuda(amp_grads(1600));
  grads.push_back(uniform_tensor({3, 1000000}, 1601, -1, 1, DType::F32).to(cuda0()));
  Backend& backend = backend_for(cuda0());
  const double first = backend.sum_of_squares(grads);
  for (int run = 0; run < 3; ++run)
    EXPECT_EQ(std::bit_cast<uint64_t>(backend.sum_of_squares(grads)), std::bit_cast<uint64_t>(first));
  double cpu = 0;
  for (const Tensor& g : grads) cpu += backend_for(Device::cpu()).sum_of_squares({g.to(Device::cpu())});
  EXPECT_NEAR(first, cpu, 1e-12 * cpu);
}

TEST(CudaOptim, CountZerosMatchesCpu) {
  MIXTAPE_REQUIRE_CUDA();
  std::vector<Tensor> cpu;
  for (DType dtype : kDtypes) {
    std::vector<double> values = uniform_tensor({20000}, 1700, -1, 1, DType::F64).to_vector<double>();
    for (size_t i = 0; i < values.size(); i += 7) values[i] = 0;
    values[1] = -0.0;  // negative zero is zero
    cpu.push_back(Tensor::from_vector(values, {20000}, dtype));
  }
  const std::vector<Tensor> gpu = to_cuda(cpu);
  const int64_t expected = backend_for(Device::cpu()).count_zeros(cpu);
  EXPECT_EQ(backend_for(cuda0()).count_zeros(gpu), expected);
  EXPECT_GT(expected, 4 * (20000 / 7));
}
