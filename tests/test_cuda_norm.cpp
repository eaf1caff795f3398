// CUDA norm.cu, index.cu and cross_entropy.cu against the CPU backend, through the public op front ends and
// autograd: layer_norm / rms_norm forward and backward (x, weight, bias grads), embedding forward and
// backward (repeated indices, bitwise determinism), softmax cross-entropy forward and backward with ignored
// rows; f32/f16/bf16/f64, row lengths that take the 16-byte path and ones that do not, one-warp and
// multi-warp rows, non-contiguous inputs.
//
// Bounds (the CUDA kernels do the CPU's math in the CPU's accumulation type, only in another summation
// order, and round once):
//  - f16/bf16 results: within 2 ulp of the CPU's value, or within 2^-10 of the largest |value| of the tensor
//    (an output that is a small difference of terms of size ~scale carries an fp32 error of ~2^-24 scale,
//    which can be many ulps of that small output but is far below one ulp at the tensor's scale);
//  - f32: |cuda - cpu| <= 1e-5 * the largest |cpu value| (outputs are sums of terms of the tensor's scale
//    that may cancel, so a bound relative to each element would be meaningless);
//  - f64: the same with 1e-12;
//  - embedding: forward copies bits, and backward sums each row's gradients in the CPU's order in the CPU's
//    type: both must equal the CPU bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "cross_entropy_in_place.h"
#include "cuda_test_util.h"
#include "tensor/ops.h"
#include "test_util.h"

using namespace mixtape;
using mixtape::testing::cuda0;
using mixtape::testing::kFloatDtypes;
using mixtape::testing::ulp_distance;
using mixtape::testing::uniform_tensor;

namespace {

// Compares a CUDA result with the CPU's (same dtype and shape) under the bounds above.
::testing::AssertionResult close_to_cpu(const Tensor& cuda_result, const Tensor& cpu_result, double ulp16 = 2) {
  if (!cuda_result.defined() || !cpu_result.defined())
    return ::testing::AssertionFailure() << "undefined result";
  if (cuda_result.shape() != cpu_result.shape() || cuda_result.dtype() != cpu_result.dtype())
    return ::testing::AssertionFailure() << "cuda " << cuda_result.description() << " vs cpu "
                                         << cpu_result.description();
  if (cuda_result.device() != cuda0())
    return ::testing::AssertionFailure() << "result on " << cuda_result.device() << ", expected cuda:0";
  const std::vector<double> got = cuda_result.to_vector<double>(), want = cpu_result.to_vector<double>();
  double scale = 0;
  for (double v : want) scale = std::max(scale, std::abs(v));
  if (scale == 0 || !std::isfinite(scale)) scale = 1;
  const DType dtype = cpu_result.dtype();
  const bool half = dtype == DType::F16 || dtype == DType::BF16;
  const double atol = half ? scale * 0x1p-10 : (dtype == DType::F32 ? 1e-5 : 1e-12) * scale;
  int bad = 0;
  std::string report;
  for (size_t i = 0; i < got.size(); ++i) {
    const double error = std::abs(got[i] - want[i]);
    bool ok = error <= atol || (std::isnan(got[i]) && std::isnan(want[i]));
    if (!ok && half) ok = ulp_distance(dtype, got[i], want[i]) <= ulp16;
    if (!ok && bad++ < 5)
      report += "element " + std::to_string(i) + ": cuda " + std::to_string(got[i]) + ", cpu " +
                std::to_string(want[i]) + "\n";
  }
  if (bad)
    return ::testing::AssertionFailure() << bad << " of " << got.size() << " elements differ (" << dtype_name(dtype)
                                         << ", scale " << scale << ")\n"
                                         << report;
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype())
    return ::testing::AssertionFailure() << a.description() << " vs " << b.description();
  const std::vector<double> x = a.to_vector<double>(), y = b.to_vector<double>();
  for (size_t i = 0; i < x.size(); ++i)
    if (!(x[i] == y[i] && std::signbit(x[i]) == std::signbit(y[i])) && !(std::isnan(x[i]) && std::isnan(y[i])))
      return ::testing::AssertionFailure() << "element " << i << ": " << x[i] << " vs " << y[i];
  return ::testing::AssertionSuccess();
}

// A CUDA leaf with the values of a CPU tensor.
Tensor cuda_leaf(const Tensor& cpu, bool requires_grad = true) {
  Tensor t = cpu.to(cuda0()).detach();
  if (requires_grad) t.requires_grad_();
  return t;
}
Tensor cpu_leaf(const Tensor& cpu, bool requires_grad = true) {
  Tensor t = cpu.detach();
  if (requires_grad) t.requires_grad_();
  return t;
}

std::string label(DType dtype, int64_t N, int64_t C) {
  return std::string(dtype_name(dtype)) + " [" + std::to_string(N) + ", " + std::to_string(C) + "]";
}

// Row lengths: a multiple of 8 (16-byte groups for every dtype), an odd one (element loads), one long
// enough for several warps per row on each path.
const std::vector<int64_t> kRowLengths = {8, 37, 768, 2053};

}  // namespace

// ---- layer_norm ------------------------------------------------------------------------------------------

TEST(CudaLayerNorm, ForwardAndBackwardMatchCpu) {
  MIXTAPE_REQUIRE_CUDA();
  for (DType dtype : kFloatDtypes)
    for (int64_t C : kRowLengths) {
      const int64_t N = 67;  // three chunks of the weight-gradient reduction
      // A mean far from 0 relative to the spread: the shifted statistics matter.
      const Tensor x = uniform_tensor({N, C}, 10 + static_cast<uint64_t>(C), 2, 4, dtype);
      const Tensor w = uniform_tensor({C}, 2, 0.5, 1.5, dtype), b = uniform_tensor({C}, 3, -0.5, 0.5, dtype);
      const Tensor g = uniform_tensor({N, C}, 4, -1, 1, dtype);
      Tensor xc = cpu_leaf(x), wc = cpu_leaf(w), bc = cpu_leaf(b);
      const LayerNormResult rc = layer_norm(xc, wc, bc, 1e-5);
      backward({rc.out}, {g});
      Tensor xg = cuda_leaf(x), wg = cuda_leaf(w), bg = cuda_leaf(b);
      const LayerNormResult rg = layer_norm(xg, wg, bg, 1e-5);
      backward({rg.out}, {g.to(cuda0())});
      const std::string at = label(dtype, N, C);
      EXPECT_TRUE(close_to_cpu(rg.out, rc.out)) << at;
      EXPECT_TRUE(close_to_cpu(rg.mean, rc.mean)) << at;
      EXPECT_TRUE(close_to_cpu(rg.rstd, rc.rstd)) << at;
      EXPECT_TRUE(close_to_cpu(xg.grad(), xc.grad())) << at;
      EXPECT_TRUE(close_to_cpu(wg.grad(), wc.grad())) << at;
      EXPECT_TRUE(close_to_cpu(bg.grad(), bc.grad())) << at;
    }
}

TEST(CudaLayerNorm, WithoutWeightOrBiasAndOnNonContiguousInput) {
  MIXTAPE_REQUIRE_CUDA();
  for (DType dtype : kFloatDtypes)
    for (int64_t C : {int64_t{16}, int64_t{45}}) {
      // x [2, 9, C] read through a transpose (on each device): the front end makes the rows contiguous, and
      // the gradient flows back through the transpose to the leaf.
      const Tensor base = uniform_tensor({C, 18}, 5, -2, 2, dtype);
      auto as_x = [C](const Tensor& leaf) { return leaf.transpose(0, 1).reshape({2, 9, C}); };
      const Tensor g = uniform_tensor({2, 9, C}, 6, -1, 1, dtype);
      const Tensor w = uniform_tensor({C}, 7, 0.5, 1.5, dtype), b = uniform_tensor({C}, 8, -0.5, 0.5, dtype);
      const std::string at = label(dtype, 18, C);
      for (int variant = 0; variant < 3; ++variant) {  // neither, weight only, bias only
        Tensor xc = cpu_leaf(base), xg = cuda_leaf(base);
        Tensor wc = variant == 1 ? cpu_leaf(w) : Tensor(), wg = variant == 1 ? cuda_leaf(w) : Tensor();
        Tensor bc = variant == 2 ? cpu_leaf(b) : Tensor(), bg = variant == 2 ? cuda_leaf(b) : Tensor();
        const LayerNormResult rc = layer_norm(as_x(xc), wc, bc), rg = layer_norm(as_x(xg), wg, bg);
        backward({rc.out}, {g});
        backward({rg.out}, {g.to(cuda0())});
        EXPECT_TRUE(close_to_cpu(rg.out, rc.out)) << at << " variant " << variant;
        EXPECT_TRUE(close_to_cpu(xg.grad(), xc.grad())) << at << " variant " << variant;
        if (variant == 1) {
          EXPECT_TRUE(close_to_cpu(wg.grad(), wc.grad())) << at;
        }
        if (variant == 2) {
          EXPECT_TRUE(close_to_cpu(bg.grad(), bc.grad())) << at;
        }
      }
    }
}

TEST(CudaLayerNorm, WeightGradientsOverManyRowsAreReproducible) {
  MIXTAPE_REQUIRE_CUDA();
  for (DType dtype : {DType::F32, DType::BF16}) {
    const int64_t N = 1500, C = 96;  // 47 chunks of 32 rows
    const Tensor x = uniform_tensor({N, C}, 11, -1, 1, dtype);
    const Tensor w = uniform_tensor({C}, 12, 0.5, 1.5, dtype), b = uniform_tensor({C}, 13, -0.5, 0.5, dtype);
    const Tensor g = uniform_tensor({N, C}, 14, -1, 1, dtype);
    Tensor wc = cpu_leaf(w), bc = cpu_leaf(b);
    backward({layer_norm(x, wc, bc).out}, {g});
    Tensor first_w, first_b;
    for (int run = 0; run < 2; ++run) {
      Tensor wg = cuda_leaf(w), bg = cuda_leaf(b);
      backward({layer_norm(x.to(cuda0()), wg, bg).out}, {g.to(cuda0())});
      EXPECT_TRUE(close_to_cpu(wg.grad(), wc.grad())) << dtype_name(dtype);
      EXPECT_TRUE(close_to_cpu(bg.grad(), bc.grad())) << dtype_name(dtype);
      if (run == 0) {
        first_w = wg.grad();
        first_b = bg.grad();
      } else {
        EXPECT_TRUE(bitwise_equal(wg.grad(), first_w)) << dtype_name(dtype);
        EXPECT_TRUE(bitwise_equal(bg.grad(), first_b)) << dtype_name(dtype);
      }
    }
  }
}

// ---- rms_norm --------------------------------------------------------------------------------------------

TEST(CudaRmsNorm, ForwardAndBackwardMatchCpu) {
  MIXTAPE_REQUIRE_CUDA();
  for (DType dtype : kFloatDtypes)
    for (int64_t C : kRowLengths)
      for (bool with_weight : {true, false}) {
        const int64_t N = 67;
        const Tensor x = uniform_tensor({N, C}, 20 + static_cast<uint64_t>(C), -2, 2, dtype);
        const Tensor w = uniform_tensor({C}, 21, 0.5, 1.5, dtype);
        const Tensor g = uniform_tensor({N, C}, 22, -1, 1, dtype);
        Tensor xc = cpu_leaf(x), xg = cuda_leaf(x);
        Tensor wc = with_weight ? cpu_leaf(w) : Tensor(), wg = with_weight ? cuda_leaf(w) : Tensor();
        const RMSNormResult rc = rms_norm(xc, wc, 1e-6), rg = rms_norm(xg, wg, 1e-6);
        backward({rc.out}, {g});
        backward({rg.out}, {g.to(cuda0())});
        const std::string at = label(dtype, N, C) + (with_weight ? " weight" : " no weight");
        EXPECT_TRUE(close_to_cpu(rg.out, rc.out)) << at;
        EXPECT_TRUE(close_to_cpu(rg.rstd, rc.rstd)) << at;
        EXPECT_TRUE(close_to_cpu(xg.grad(), xc.grad())) << at;
        if (with_weight) {
          EXPECT_TRUE(close_to_cpu(wg.grad(), wc.grad())) << at;
        }
      }
}

TEST(CudaRmsNorm, NonContiguousInputAndReproducibleWeightGradient) {
  MIXTAPE_REQUIRE_CUDA();
  const int64_t N = 700, C = 40;
  const Tensor x = uniform_tensor({C, N}, 23, -2, 2, DType::F32);  // used as x^T [N, C] on each device
  const Tensor w = uniform_tensor({C}, 24, 0.5, 1.5, DType::F32);
  const Tensor g = uniform_tensor({N, C}, 25, -1, 1, DType::F32);
  Tensor xc = cpu_leaf(x), wc = cpu_leaf(w);
  backward({rms_norm(xc.transpose(0, 1), wc).out}, {g});
  Tensor first;
  for (int run = 0; run < 2; ++run) {
    Tensor xg = cuda_leaf(x), wg = cuda_leaf(w);
    backward({rms_norm(xg.transpose(0, 1), wg).out}, {g.to(cuda0())});
    EXPECT_TRUE(close_to_cpu(xg.grad(), xc.grad()));
    EXPECT_TRUE(close_to_cpu(wg.grad(), wc.grad()));
    if (run == 0) {
      first = wg.grad();
    } else {
      EXPECT_TRUE(bitwise_equal(wg.grad(), first));
    }
  }
}

// ---- embedding -------------------------------------------------------------------------------------------

TEST(CudaEmbedding, ForwardGathersTheCpuBits) {
  MIXTAPE_REQUIRE_CUDA();
  const int64_t V = 50;
  for (DType dtype : kFloatDtypes)
    for (DType index_dtype : {DType::I64, DType::I32})
      for (int64_t C : {int64_t{8}, int64_t{37}, int64_t{768}}) {
        const Tensor indices = Tensor::randint(0, V, {3, 41}, 30, index_dtype);  // many repeats
        const Tensor weight = uniform_tensor({V, C}, 31, -1, 1, dtype);
        // Also a transposed (tied) weight, transposed on each device: rows are strided, element loads.
        const Tensor tied = uniform_tensor({C, V}, 32, -1, 1, dtype);
        const std::string at = label(dtype, V, C) + " " + dtype_name(index_dtype);
        const Tensor out = embedding(weight.to(cuda0()), indices.to(cuda0()));
        EXPECT_EQ(out.shape(), (Shape{3, 41, C})) << at;
        EXPECT_TRUE(bitwise_equal(out, embedding(weight, indices))) << at;
        const Tensor tied_out = embedding(tied.to(cuda0()).transpose(0, 1), indices.to(cuda0()));
        EXPECT_TRUE(bitwise_equal(tied_out, embedding(tied.transpose(0, 1), indices))) << at << " tied";
      }
}

TEST(CudaEmbedding, BackwardEqualsCpuBitForBitAndIsDeterministic) {
  MIXTAPE_REQUIRE_CUDA();
  for (DType dtype : kFloatDtypes)
    for (int64_t C : {int64_t{64}, int64_t{37}, int64_t{300}}) {
      // Few rows, many lookups: every row is hit ~500 times (16-bit grads sum in fp32 on both devices).
      const int64_t V = 20, n = 10000;
      const Tensor indices = Tensor::randint(0, V - 2, {n}, 33);  // the last two rows are never hit
      const Tensor g = uniform_tensor({n, C}, 34, -1, 1, dtype);
      const Tensor w = uniform_tensor({V, C}, 35, -1, 1, dtype);
      Tensor wc = cpu_leaf(w);
      backward({embedding(wc, indices)}, {g});
      const std::string at = label(dtype, V, C);
      Tensor first;
      for (int run = 0; run < 2; ++run) {
        Tensor wg = cuda_leaf(w);
        backward({embedding(wg, indices.to(cuda0()))}, {g.to(cuda0())});
        EXPECT_TRUE(bitwise_equal(wg.grad(), wc.grad())) << at;
        if (run == 0) {
          first = wg.grad();
        } else {
          EXPECT_TRUE(bitwise_equal(wg.grad(), first)) << at;
        }
      }
    }
}

TEST(CudaEmbedding, BackwardWithI32IndicesAndALargeVocabulary) {
  MIXTAPE_REQUIRE_CUDA();
  const int64_t V = 70000, n = 4096, C = 24;  // keys need 17 bits
  const std::vector<int64_t> drawn = Tensor::randint(0, V, {n}, 36).to_vector<int64_t>();
  std::vector<int32_t> ids(drawn.begin(), drawn.end());
  for (int64_t i = 0; i < n; i += 3) ids[static_cast<size_t>(i)] = static_cast<int32_t>(V - 1);  // a hot row
  const Tensor indices = Tensor::from_vector(ids, {64, 64});
  const Tensor g = uniform_tensor({64, 64, C}, 37, -1, 1, DType::BF16);
  Tensor wc = cpu_leaf(Tensor::zeros({V, C}, DType::BF16)), wg = cuda_leaf(Tensor::zeros({V, C}, DType::BF16));
  backward({embedding(wc, indices)}, {g});
  backward({embedding(wg, indices.to(cuda0()))}, {g.to(cuda0())});
  EXPECT_TRUE(bitwise_equal(wg.grad(), wc.grad()));
}

// ---- softmax cross-entropy -------------------------------------------------------------------------------

TEST(CudaCrossEntropy, ForwardAndBackwardMatchCpuWithIgnoredRows) {
  MIXTAPE_REQUIRE_CUDA();
  const int64_t N = 50;
  for (DType dtype : kFloatDtypes)
    for (int64_t V : {int64_t{8}, int64_t{37}, int64_t{1000}, int64_t{5003}})
      for (DType target_dtype : {DType::I64, DType::I32}) {
        std::vector<int64_t> t = Tensor::randint(0, V, {N}, 40 + static_cast<uint64_t>(V)).to_vector<int64_t>();
        for (int64_t i = 0; i < N; i += 7) t[static_cast<size_t>(i)] = -100;
        const Tensor targets = target_dtype == DType::I64
                                   ? Tensor::from_vector(t, {N})
                                   : Tensor::from_vector(std::vector<int32_t>(t.begin(), t.end()), {N});
        const Tensor logits = uniform_tensor({N, V}, 41, -4, 4, dtype);
        Tensor lc = cpu_leaf(logits), lg = cuda_leaf(logits);
        const Tensor loss_c = softmax_cross_entropy(lc, targets);
        const Tensor loss_g = softmax_cross_entropy(lg, targets.to(cuda0()));
        backward(loss_c);
        backward(loss_g);
        const std::string at = label(dtype, N, V) + " " + dtype_name(target_dtype);
        EXPECT_TRUE(close_to_cpu(loss_g, loss_c)) << at;
        EXPECT_TRUE(close_to_cpu(lg.grad(), lc.grad())) << at;
        // Ignored rows get exactly 0.
        const std::vector<double> grad = lg.grad().to_vector<double>();
        for (int64_t j = 0; j < V; ++j) EXPECT_EQ(grad[static_cast<size_t>(j)], 0.0) << at;
      }
}

TEST(CudaCrossEntropy, NonContiguousLogitsCustomIgnoreIndexAndReproducibleLoss) {
  MIXTAPE_REQUIRE_CUDA();
  const int64_t V = 24;
  // logits [2, 30, V] read through a transpose; ignore_index 2 is a class.
  const Tensor logits = uniform_tensor({V, 60}, 42, -3, 3, DType::F32);  // the leaf; read as below
  auto as_logits = [](const Tensor& leaf) { return leaf.transpose(0, 1).reshape({2, 30, V}); };
  const Tensor targets = Tensor::randint(0, V, {2, 30}, 43);
  Tensor lc = cpu_leaf(logits);
  const Tensor loss_c = softmax_cross_entropy(as_logits(lc), targets, 2);
  backward(loss_c);
  Tensor first;
  for (int run = 0; run < 2; ++run) {
    Tensor lg = cuda_leaf(logits);
    const Tensor loss_g = softmax_cross_entropy(as_logits(lg), targets.to(cuda0()), 2);
    backward(loss_g);
    EXPECT_TRUE(close_to_cpu(loss_g, loss_c));
    EXPECT_TRUE(close_to_cpu(lg.grad(), lc.grad()));
    if (run == 0) {
      first = loss_g;
    } else {
      EXPECT_TRUE(bitwise_equal(loss_g, first));
    }
  }
}

// 16-bit logits fold in the f32 kernel's order (groups of 4 whatever the storage width), so autocast reads
// them in place: the same bits as the widened logits on the GPU too.
TEST(CudaCrossEntropy, SixteenBitLogitsGiveTheWidenedLogitsBitsUnderAutocast) {
  MIXTAPE_REQUIRE_CUDA();
  mixtape::testing::expect_cross_entropy_reads_sixteen_bit_logits_in_place(cuda0());
}

TEST(CudaCrossEntropy, NoCountedRowGivesZeroLossAndZeroGradient) {
  MIXTAPE_REQUIRE_CUDA();
  for (DType dtype : kFloatDtypes) {
    Tensor logits = cuda_leaf(uniform_tensor({3, 5}, 44, -1, 1, dtype));
    const Tensor loss = softmax_cross_entropy(logits, Tensor::full({3}, -100, DType::I64, cuda0()));
    EXPECT_EQ(loss.item(), 0.0) << dtype_name(dtype);
    backward(loss);
    for (double g : logits.grad().to_vector<double>()) EXPECT_EQ(g, 0.0) << dtype_name(dtype);
  }
  EXPECT_EQ(softmax_cross_entropy(Tensor::zeros({0, 5}, DType::F32, cuda0()),
                                  Tensor::zeros({0}, DType::I64, cuda0()))
                .item(),
            0.0);
}
