// Scaled quantization and the low-precision Linear: each recipe's scales on hand-derived examples, the
// quantize -> dequantize error within each format's half step, the emulated GEMM within fp32-summation bounds of
// an f64 product of the same dequantized operands, and delayed scaling's history as Transformer Engine keeps it.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <span>
#include <vector>

#include "autograd/autograd.h"
#include "tensor/autocast_state.h"
#include "tensor/autograd_node.h"
#include "tensor/minifloat.h"
#include "tensor/ops.h"
#include "tensor/quantize.h"
#include "tensor/scaled_linear.h"
#include "tensor/tensor.h"
#include "test_util.h"

namespace mixtape {
namespace {

std::vector<float> values_of(const Tensor& t) { return t.to(DType::F32).to_vector<float>(); }
std::vector<float> scales_of(const Quantized& q) { return values_of(q.scales); }

Tensor matrix(const std::vector<float>& v, int64_t rows, int64_t cols) { return Tensor::from_vector(v, {rows, cols}); }

using mixtape::testing::quantize_options;
constexpr DType kE4M3Type = DType::F8E4M3;

TEST(Quantize, TensorwiseScaleIsFormatMaxOverAmax) {
  // amax 4: encode 448 / 4 = 112, so 1, -2, 0.5, 4 become 112, -224, 56, 448 (all E4M3 values).
  const Quantized q = quantize(matrix({1, -2, 0.5f, 4}, 2, 2), {});
  EXPECT_EQ(values_of(q.codes), (std::vector<float>{112, -224, 56, 448}));
  EXPECT_EQ(scales_of(q), (std::vector<float>{1.0f / 112.0f}));
  EXPECT_EQ(q.amax, 4.0f);
  EXPECT_EQ(q.saturated, 0);
  // E5M2 ("hybrid" gradients): 57344 / 4 = 14336; 14336 = 1.75 * 2^13 is an E5M2 value.
  QuantizeOptions e5m2;
  e5m2.format = DType::F8E5M2;
  EXPECT_EQ(values_of(quantize(matrix({4, 1}, 1, 2), e5m2).codes), (std::vector<float>{57344, 14336}));
}

TEST(Quantize, DelayedScalingUsesTheGivenScaleAndSaturates) {
  QuantizeOptions o;
  o.fixed_scale = 2.0f;
  // 300 * 2 = 600 > 448: saturated to 448; 1.3 * 2 = 2.6 rounds to 2.5 (E4M3's step is 0.25 in [2, 4)).
  const Quantized q = quantize(matrix({300, 1.3f}, 1, 2), o);
  EXPECT_EQ(values_of(q.codes), (std::vector<float>{448, 2.5f}));
  EXPECT_EQ(scales_of(q), (std::vector<float>{0.5f}));
  EXPECT_EQ(q.saturated, 1);
  EXPECT_EQ(q.amax, 300.0f);
}

TEST(Quantize, RowwiseGivesEachRowItsScale) {
  QuantizeOptions o;
  o.block_rows = 1;
  const Quantized q = quantize(matrix({1, 2, 0.1f, -0.05f}, 2, 2), o);
  EXPECT_EQ(scales_of(q), (std::vector<float>{1.0f / (448.0f / 2.0f), 1.0f / (448.0f / 0.1f)}));
  const std::vector<float> codes = values_of(q.codes);
  EXPECT_EQ(codes[0], 224.0f);
  EXPECT_EQ(codes[1], 448.0f);
  EXPECT_EQ(codes[2], 448.0f);
  EXPECT_EQ(codes[3], -224.0f);
}

TEST(Quantize, PowerOfTwoScalesRoundTheEncodeScaleDown) {
  // torchao's round_scales_to_power_of_2: amax 3 -> 448 / 3 = 149.3 -> 128; amax 0.1 -> 4480 -> 4096.
  QuantizeOptions o = quantize_options(kE4M3Type, 1, 0);
  o.power_of_two_scales = true;
  const Quantized q = quantize(matrix({3, 1, 0.1f, 0.05f}, 2, 2), o);
  EXPECT_EQ(scales_of(q), (std::vector<float>{1.0f / 128, 1.0f / 4096}));
  EXPECT_EQ(values_of(q.codes), (std::vector<float>{384, 128, 416, 208}));  // 409.6 -> 416, 204.8 -> 208
  EXPECT_ERROR_MENTIONS(quantize(matrix({1, 2}, 1, 2), [] {
                          QuantizeOptions mx = quantize_options(kE4M3Type, 1, 2, BlockScale::E8M0Floor);
                          mx.power_of_two_scales = true;
                          return mx;
                        }()),
                        "power_of_two_scales", "e8m0_floor");
}

TEST(Quantize, DeepSeekTilesAndBlocksHaveOneScaleEach) {
  // [2, 256] in 1 x 128 tiles: four scales, each 1 / (448 / amax of its tile).
  std::vector<float> x(512, 0.5f);
  x[3] = 8;          // row 0, tile 0
  x[128 + 5] = -2;   // row 0, tile 1: amax 2
  x[256 + 7] = 1;    // row 1, tile 0: amax 1 (0.5 elsewhere)
  QuantizeOptions tiles;
  tiles.block_rows = 1;
  tiles.block_cols = 128;
  const Quantized q = quantize(matrix(x, 2, 256), tiles);
  EXPECT_EQ(q.scales.shape(), (Shape{2, 2}));
  EXPECT_EQ(scales_of(q), (std::vector<float>{1 / (448 / 8.0f), 1 / (448 / 2.0f), 1 / (448 / 1.0f), 1 / (448 / 0.5f)}));
  // A [256, 130] weight in 128 x 128 blocks: a [2, 2] grid whose last column of blocks is 2 wide.
  QuantizeOptions blocks = tiles;
  blocks.block_rows = 128;
  std::vector<float> w(256 * 130, 1.0f);
  w[200 * 130 + 129] = 4;  // block (1, 1)
  const Quantized qw = quantize(matrix(w, 256, 130), blocks);
  EXPECT_EQ(scales_of(qw), (std::vector<float>{1 / 448.0f, 1 / 448.0f, 1 / 448.0f, 1 / (448 / 4.0f)}));
}

TEST(Quantize, MxScalesFollowTheOcpFloorOrNvidiasCeil) {
  // Block 0: amax 1 -> OCP: 2^(floor(log2 1) - 8) = 2^-8 (E8M0 code 119); 1 -> 256.
  // Block 1: amax 500 -> OCP: 2^(8 - 8) = 1, and 500 saturates to 448; NVIDIA: 2^ceil(log2(500 / 448)) = 2,
  // 500 / 2 = 250 -> 256 (E4M3's step is 16 in [128, 256)).
  std::vector<float> x(64, 0.0f);
  x[0] = 1;
  x[32] = 500;
  QuantizeOptions o;
  o.block_rows = 1;
  o.block_cols = 32;
  o.scale = BlockScale::E8M0Floor;
  const Quantized floor = quantize(matrix(x, 1, 64), o);
  EXPECT_EQ(floor.scales.dtype(), DType::F8E8M0);
  EXPECT_EQ(scales_of(floor), (std::vector<float>{0x1p-8f, 1.0f}));
  EXPECT_EQ(static_cast<const uint8_t*>(floor.scales.data_ptr())[0], 119);
  EXPECT_EQ(values_of(floor.codes)[0], 256.0f);
  EXPECT_EQ(values_of(floor.codes)[32], 448.0f);
  EXPECT_EQ(floor.saturated, 1);
  o.scale = BlockScale::E8M0Ceil;
  const Quantized ceil = quantize(matrix(x, 1, 64), o);
  EXPECT_EQ(scales_of(ceil), (std::vector<float>{0x1p-8f, 2.0f}));
  EXPECT_EQ(values_of(ceil.codes)[32], 256.0f);
  EXPECT_EQ(ceil.saturated, 0);
  // MXFP4 (E2M1, emax 2): amax 6 -> 2^(2 - 2) = 1.
  o.format = DType::F4E2M1;
  o.scale = BlockScale::E8M0Floor;
  EXPECT_EQ(scales_of(quantize(matrix(std::vector<float>(32, 6.0f), 1, 32), o)), (std::vector<float>{1.0f}));
}

TEST(Quantize, Nvfp4HasE4M3BlockScalesUnderAnFp32TensorScale) {
  // Tensor amax 6: tensor encode scale 6 * 448 / 6 = 448, decode 1 / 448.
  // Block 0 (amax 6): 6 / 6 * 448 = 448 stored exactly. Block 1 (amax 5): 5 / 6 * 448 = 373.3 -> E4M3 384
  // (step 32 in [256, 448]), so its values are encoded with 448 / 384: 5 -> 5.83 -> E2M1 6, dequantized
  // 6 * 384 / 448 = 5.142857.
  std::vector<float> x(32, 0.0f);
  x[0] = 6;
  x[16] = 5;
  QuantizeOptions o = quantize_options(DType::F4E2M1, 1, 16, BlockScale::E4M3TwoLevel);
  const Quantized q = quantize(matrix(x, 1, 32), o);
  EXPECT_EQ(q.scales.dtype(), DType::F8E4M3);
  EXPECT_EQ(scales_of(q), (std::vector<float>{448.0f, 384.0f}));
  EXPECT_EQ(q.tensor_scale, 1.0f / 448.0f);
  EXPECT_EQ(values_of(q.codes)[0], 6.0f);
  EXPECT_EQ(values_of(q.codes)[16], 6.0f);
  EXPECT_NEAR(values_of(dequantize(q))[16], 6.0 * 384 / 448, 1e-6);
  EXPECT_NEAR(values_of(dequantize(q))[0], 6.0, 1e-6);
  EXPECT_ERROR_MENTIONS(quantize(matrix(x, 1, 32), quantize_options(kE4M3Type, 0, 0, BlockScale::E4M3TwoLevel)),
                        "e4m3_two_level", "f4e2m1");
}

// Rows split along K over processes: the local row amaxes (2 and 0.1 here) go to the reduction, which returns
// their MAX with the other process's parts (8 and 0.05): row 0 is scaled by 448 / 8, row 1 keeps its own.
TEST(Quantize, RowwiseAmaxesReducedOverProcessesGiveOneProcesssScales) {
  QuantizeOptions o;
  o.block_rows = 1;
  std::vector<float> seen;
  o.reduce_row_amax = [&seen](std::span<float> amax) {
    seen.assign(amax.begin(), amax.end());
    amax[0] = std::max(amax[0], 8.0f);
    amax[1] = std::max(amax[1], 0.05f);
  };
  const Tensor x = matrix({1, 2, 0.1f, -0.05f}, 2, 2);
  const Quantized q = quantize(x, o);
  EXPECT_EQ(seen, (std::vector<float>{2.0f, 0.1f}));
  EXPECT_EQ(scales_of(q), (std::vector<float>{1.0f / (448.0f / 8.0f), 1.0f / (448.0f / 0.1f)}));
  EXPECT_EQ(values_of(q.codes)[1], 112.0f);  // 2 * 56
  // The training path reduces the same way: its values are the reference's dequantized ones.
  const GemmOperand op = quantize_for_gemm(x, o);
  const std::vector<float> want = values_of(dequantize(q));
  std::vector<float> got = values_of(op.values);
  for (size_t i = 0; i < got.size(); ++i) got[i] *= op.row_scale[i / 2];
  EXPECT_EQ(got, want);
}

// NVFP4's fp32 tensor scale follows the reduced tensor amax (12 elsewhere): 6 * 448 / 12 = 224.
TEST(Quantize, Nvfp4TensorScaleFollowsTheReducedAmax) {
  std::vector<float> x(16, 0.0f);
  x[0] = 6;
  QuantizeOptions o = quantize_options(DType::F4E2M1, 1, 16, BlockScale::E4M3TwoLevel);
  o.reduce_tensor_amax = [](float amax) { return std::max(amax, 12.0f); };
  EXPECT_EQ(quantize(matrix(x, 1, 16), o).tensor_scale, 1.0f / 224.0f);
  EXPECT_EQ(quantize_for_gemm(matrix(x, 1, 16), o).tensor_scale, 1.0f / 224.0f);
}

TEST(Quantize, NonFiniteValuesMakeTheirBlockNaN) {
  QuantizeOptions o;
  o.block_rows = 1;
  const Quantized q = quantize(matrix({1, INFINITY, 2, 3}, 2, 2), o);
  const std::vector<float> back = values_of(dequantize(q));
  EXPECT_TRUE(std::isnan(back[0]) && std::isnan(back[1]));
  EXPECT_NEAR(back[2], 2, 2 * 0x1p-4);
  EXPECT_NEAR(back[3], 3, 3 * 0x1p-4);
  EXPECT_TRUE(std::isinf(q.amax));
}

// |dequantize(quantize(x)) - x| is at most half a grid step: relative 2^-(M+1) above the smallest normal, and
// half the smallest subnormal (times the block's decode scale) below it.
TEST(Quantize, DequantizedValuesLieWithinHalfAStepForEveryRecipe) {
  const Tensor x = mul(Tensor::randn({64, 96}, 3), 3.0);
  struct Case {
    const char* name;
    QuantizeOptions options;
    int mantissa_bits;
    double min_subnormal;
  };
  const std::vector<Case> cases = {
      {"tensorwise e4m3", quantize_options(kE4M3Type, 0, 0), 3, 0x1p-9},
      {"tensorwise e5m2", quantize_options(DType::F8E5M2, 0, 0), 2, 0x1p-16},
      {"rowwise", quantize_options(kE4M3Type, 1, 0), 3, 0x1p-9},
      {"1x32 tiles", quantize_options(kE4M3Type, 1, 32), 3, 0x1p-9},
      {"mx floor", quantize_options(kE4M3Type, 1, 32, BlockScale::E8M0Floor), 3, 0x1p-9},
      {"mx ceil", quantize_options(kE4M3Type, 1, 32, BlockScale::E8M0Ceil), 3, 0x1p-9},
      {"nvfp4", quantize_options(DType::F4E2M1, 1, 16, BlockScale::E4M3TwoLevel), 1, 0.5},
  };
  const std::vector<float> xv = values_of(x);
  for (const Case& c : cases) {
    const Quantized q = quantize(x, c.options);
    const std::vector<float> back = values_of(dequantize(q));
    const int64_t grid_cols = q.scales.size(1);
    const std::vector<float> scales = scales_of(q);
    int64_t bad = 0;
    for (int64_t i = 0; i < x.numel(); ++i) {
      const int64_t r = i / 96, col = i % 96;
      const double decode = scales[static_cast<size_t>(r / q.block_rows * grid_cols + col / q.block_cols)] * q.tensor_scale;
      // OCP's floor rule saturates by design: a value above 448 once scaled is clamped, not rounded.
      if (c.options.scale == BlockScale::E8M0Floor && std::fabs(xv[i]) / decode > 448) continue;
      const double bound = std::max(std::fabs(xv[i]) * std::ldexp(1.0, -(c.mantissa_bits + 1)),
                                    c.min_subnormal / 2 * decode) * (1 + 1e-6);
      if (std::fabs(back[i] - xv[i]) > bound && bad++ < 3)
        ADD_FAILURE() << c.name << ": x " << xv[i] << " came back " << back[i] << " (bound " << bound << ")";
    }
    EXPECT_EQ(bad, 0) << c.name;
    if (c.options.scale != BlockScale::E8M0Floor) {
      EXPECT_EQ(q.saturated, 0) << c.name;
    }
  }
}

// The emulated GEMM against an f64 product of the same dequantized operands: within the fp32 summation bound
// K * 2^-24 * sum |a||b| (plus the scale's rounding for the tensorwise path, 2^-23 relative).
TEST(Quantize, ScaledMatmulIsTheFp32SumOfTheDequantizedProducts) {
  const int64_t M = 17, N = 9, K = 160;
  const Tensor a = Tensor::randn({M, K}, 11), b = mul(Tensor::randn({N, K}, 12), 0.02);
  const std::vector<QuantizeOptions> recipes = {
      quantize_options(kE4M3Type, 0, 0), quantize_options(kE4M3Type, 1, 0), quantize_options(kE4M3Type, 1, 128),
      quantize_options(kE4M3Type, 1, 32, BlockScale::E8M0Ceil),
      quantize_options(DType::F4E2M1, 1, 16, BlockScale::E4M3TwoLevel)};
  for (const QuantizeOptions& o : recipes) {
    const Quantized qa = quantize(a, o), qb = quantize(b, o);
    const std::vector<float> c = values_of(scaled_matmul(qa, qb));
    // The training path's product (codes with scales after, per K block, or folded into bf16 values).
    const std::vector<float> fast = values_of(scaled_matmul(quantize_for_gemm(a, o), quantize_for_gemm(b, o)));
    // The same with column-major operands (the transposed views a weight gradient quantizes).
    const Tensor a_columns = a.mT().contiguous().mT(), b_columns = b.mT().contiguous().mT();
    const std::vector<float> columns =
        values_of(scaled_matmul(quantize_for_gemm(a_columns, o), quantize_for_gemm(b_columns, o)));
    const std::vector<double> da = dequantize(qa).to(DType::F64).to_vector<double>(),
                              db = dequantize(qb).to(DType::F64).to_vector<double>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double exact = 0, magnitude = 0;
        for (int64_t k = 0; k < K; ++k) {
          exact += da[m * K + k] * db[n * K + k];
          magnitude += std::fabs(da[m * K + k] * db[n * K + k]);
        }
        const double bound = (K * 0x1p-24 + 4 * 0x1p-24) * magnitude;
        ASSERT_NEAR(c[m * N + n], exact, bound) << block_scale_name(o.scale) << " " << o.block_cols << " m " << m << " n " << n;
        ASSERT_NEAR(fast[m * N + n], exact, bound) << "training path " << block_scale_name(o.scale) << " "
                                                   << o.block_cols << " m " << m << " n " << n;
        ASSERT_NEAR(columns[m * N + n], exact, bound) << "column-major " << block_scale_name(o.scale) << " "
                                                      << o.block_cols << " m " << m << " n " << n;
      }
  }
}

// The training path (quantize_for_gemm: no codes, values ready for the GEMM) against the reference
// (quantize, then dequantize): the same values to the bit once its row and tensor scales are applied, the same
// counts, for every recipe's layout, with saturation, flushing to zero, a NaN block and stochastic rounding.
TEST(Quantize, TheGemmOperandIsTheDequantizedReferenceBitForBit) {
  Tensor x = mul(Tensor::randn({48, 80}, 21), 4.0);
  {
    std::vector<float> v = values_of(x);
    v[5] = v[20] = v[78] = 1e-9f;  // flush to zero in most blocks (20 and 78 lie past a block's first 16 values)
    v[100] = 3000.0f;  // saturates under the OCP floor rule
    x = matrix(v, 48, 80);
  }
  std::vector<float> with_nan = values_of(x), tiny = values_of(x);
  with_nan[7 * 80 + 3] = NAN;
  // Row 2 around 2^-133 (f32 subnormals): its E8M0 block scales lie below 2^-100, where code value x scale can
  // fall between bf16's subnormals.
  std::vector<float> tiny_column = tiny;  // the same down column 5: a row of the transposed view
  for (int64_t c = 0; c < 80; ++c) tiny[static_cast<size_t>(2 * 80 + c)] *= 0x1p-135f;
  for (int64_t r = 0; r < 48; ++r) tiny_column[static_cast<size_t>(r * 80 + 5)] *= 0x1p-135f;
  std::vector<QuantizeOptions> cases = {
      quantize_options(kE4M3Type, 0, 0), quantize_options(DType::F8E5M2, 0, 0), quantize_options(kE4M3Type, 1, 0),
      quantize_options(kE4M3Type, 1, 32), quantize_options(kE4M3Type, 1, 24),
      quantize_options(DType::F8E5M2, 1, 24, BlockScale::E8M0Floor), quantize_options(kE4M3Type, 32, 32),
      quantize_options(kE4M3Type, 1, 32, BlockScale::E8M0Floor), quantize_options(kE4M3Type, 1, 32, BlockScale::E8M0Ceil),
      quantize_options(DType::F4E2M1, 1, 16, BlockScale::E4M3TwoLevel),
      quantize_options(DType::F4E2M1, 16, 16, BlockScale::E4M3TwoLevel)};
  QuantizeOptions delayed = quantize_options(kE4M3Type, 0, 0);
  delayed.fixed_scale = 300.0f;  // saturates
  cases.push_back(delayed);
  QuantizeOptions stochastic = quantize_options(DType::F4E2M1, 1, 16, BlockScale::E4M3TwoLevel);
  stochastic.stochastic_seed = 5;
  stochastic.stochastic_offset = 1000;
  cases.push_back(stochastic);
  // Inputs of every kind the training path reads: f32, bf16 (read as it is), f16 (widened), transposed views
  // (the CPU quantizes them in their memory's order), one of them over 256 rows.
  const Tensor with_nan_t = matrix(with_nan, 48, 80);
  // Over 2^15 values, so that the kernels' loops run on every thread.
  std::vector<float> wide = values_of(Tensor::randn({121, 300}, 9));
  wide[3 * 300 + 290] = INFINITY;
  wide[7 * 300 + 100] = 1e-12f;
  const Tensor wide_rows = matrix(wide, 121, 300).slice(0, 1, 121);  // contiguous, at a storage offset
  for (const Tensor& input : {x, with_nan_t, matrix(tiny, 48, 80), with_nan_t.to(DType::BF16),
                              with_nan_t.to(DType::F16), with_nan_t.to(DType::BF16).mT(), matrix(tiny_column, 48, 80).mT(),
                              wide_rows, wide_rows.mT(), wide_rows.to(DType::BF16).mT()})
    for (const QuantizeOptions& o : cases) {
      SCOPED_TRACE(std::string(input.description()) + " " + dtype_name(o.format) + " " + block_scale_name(o.scale) +
                   " " + std::to_string(o.block_rows) + "x" + std::to_string(o.block_cols));
      const Quantized q = quantize(input, o);
      const GemmOperand g = quantize_for_gemm(input, o);
      const std::vector<float> want = values_of(dequantize(q)), values = values_of(g.values);
      ASSERT_EQ(values.size(), want.size());
      const size_t C = static_cast<size_t>(input.size(1));
      for (size_t i = 0; i < want.size(); ++i) {
        const float row = g.row_scale.empty() ? 1.0f : g.row_scale[i / C];
        const size_t blocks = g.k_block > 0 ? (C + static_cast<size_t>(g.k_block) - 1) / static_cast<size_t>(g.k_block) : 1;
        const float k = g.k_scales.empty() ? 1.0f : g.k_scales[i / C * blocks + i % C / static_cast<size_t>(g.k_block)];
        const float got = values[i] * k * row * g.tensor_scale;
        if (std::isnan(want[i])) EXPECT_TRUE(std::isnan(got)) << i;
        else ASSERT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(want[i])) << i << ": " << got << " " << want[i];
      }
      EXPECT_EQ(g.saturated, q.saturated);
      EXPECT_EQ(g.flushed, q.flushed);
      if (!std::isfinite(q.amax)) EXPECT_TRUE(std::isnan(g.amax));  // NaN for a tensor holding Inf or NaN
      else EXPECT_EQ(g.amax, q.amax);
    }
  // Every midpoint between neighbouring values of each format (the ties), at scale 1: nearest even.
  for (DType format : {kE4M3Type, DType::F8E5M2, DType::F4E2M1}) {
    std::vector<float> grid;
    for (uint32_t code = 0; code < (format == DType::F4E2M1 ? 8u : 128u); ++code) {
      const float v = minifloat_to_float(code, format == kE4M3Type ? kE4M3 : format == DType::F8E5M2 ? kE5M2 : kE2M1);
      if (std::isfinite(v)) grid.push_back(v);
    }
    std::vector<float> ties;
    for (size_t i = 0; i + 1 < grid.size(); ++i) ties.push_back((grid[i] + grid[i + 1]) / 2);
    QuantizeOptions o = quantize_options(format, 0, 0);
    o.fixed_scale = 1.0f;
    const Tensor t = matrix(ties, 1, static_cast<int64_t>(ties.size()));
    EXPECT_EQ(values_of(quantize_for_gemm(t, o).values), values_of(dequantize(quantize(t, o)))) << dtype_name(format);
  }
}

// E8M0-scaled values go to the GEMM as bf16 (code value x scale, exact) unless a scale lies below 2^-100, where
// the products may fall between bf16's subnormals and the operand is f32. A block of zeros (scale 2^-127) holds
// only zeros, exact under any scale: it keeps the bf16 form.
TEST(Quantize, ABlockOfZerosKeepsE8m0ValuesInBf16) {
  for (const int64_t block_rows : {1, 32}) {  // the one-pass row kernel and the general path
    for (const BlockScale rule : {BlockScale::E8M0Floor, BlockScale::E8M0Ceil}) {
      std::vector<float> v = values_of(Tensor::randn({64, 64}, 3));
      for (int64_t r = 0; r < 32; ++r)
        for (int64_t c = 0; c < 32; ++c) v[static_cast<size_t>(r * 64 + c)] = 0;
      const QuantizeOptions o = quantize_options(kE4M3Type, block_rows, 32, rule);
      const GemmOperand zeros = quantize_for_gemm(matrix(v, 64, 64), o);
      EXPECT_EQ(zeros.values.dtype(), DType::BF16) << block_rows;
      EXPECT_EQ(values_of(zeros.values), values_of(dequantize(quantize(matrix(v, 64, 64), o))));
      for (int64_t c = 0; c < 32; ++c) v[static_cast<size_t>(c)] = 0x1p-130f * static_cast<float>(c + 1);
      EXPECT_EQ(quantize_for_gemm(matrix(v, 64, 64), o).values.dtype(), DType::F32) << block_rows;
    }
  }
}

// The narrow accumulator: 64 products in two chunks of 32 whose sums are 32 and 1. In fp32 the result is 33;
// with 4 mantissa bits the running sum 32 + 1 = 33 = 1.00001b x 2^5 lies halfway between 32 and 34 and rounds
// to the even 32. With 23 bits it is fp32's sum again.
TEST(Quantize, ANarrowAccumulatorRoundsTheRunningSumEveryChunk) {
  std::vector<float> b(64, 1.0f);
  for (int k = 32; k < 64; ++k) b[k] = 1.0f / 32;
  GemmOperand ga, gb;
  ga.values = Tensor::ones({1, 64}, DType::BF16);
  gb.values = matrix(b, 1, 64).to(DType::BF16);
  EXPECT_EQ(values_of(scaled_matmul(ga, gb)), std::vector<float>{33.0f});
  EXPECT_EQ(values_of(scaled_matmul(ga, gb, 23)), std::vector<float>{33.0f});
  EXPECT_EQ(values_of(scaled_matmul(ga, gb, 4)), std::vector<float>{32.0f});
  EXPECT_EQ(values_of(scaled_matmul(ga, gb, 5)), std::vector<float>{33.0f});
  // Blocked along K (fp8_block): each block's narrow sum is promoted to fp32 before the next is added.
  ga.k_block = gb.k_block = 32;
  ga.k_scales = {1.0f, 1.0f};
  gb.k_scales = {1.0f, 1.0f};
  EXPECT_EQ(values_of(scaled_matmul(ga, gb, 4)), std::vector<float>{33.0f});
  EXPECT_ERROR_MENTIONS(scaled_matmul(ga, gb, 24), "accumulator_bits", "24");
}

TEST(Quantize, StochasticRoundingIsReproducibleFromTheSeed) {
  const Tensor g = Tensor::randn({8, 64}, 5);
  QuantizeOptions o = quantize_options(DType::F4E2M1, 1, 16, BlockScale::E4M3TwoLevel);
  o.stochastic_seed = 42;
  const std::vector<float> first = values_of(dequantize(quantize(g, o))), again = values_of(dequantize(quantize(g, o)));
  EXPECT_EQ(first, again);
  o.stochastic_seed = 43;
  EXPECT_NE(values_of(dequantize(quantize(g, o))), first);
  o.stochastic_seed.reset();
  EXPECT_NE(values_of(dequantize(quantize(g, o))), first);  // nearest-even differs from a stochastic draw
}

// The training path's stochastic rounding against quantize()'s (float_to_minifloat's draws) on values across
// every binade a format meets at scale 1: above its range (saturated), its normals, its subnormals and far below
// them (where the grid step is 2^40 times the value), each drawing the same Philox bits.
TEST(Quantize, StochasticRoundingOfTheGemmOperandIsTheReferencesBitForBit) {
  std::vector<float> v;
  for (int k = -48; k <= 17; ++k)
    for (int j = 0; j < 24; ++j) v.push_back((j % 2 ? -1.0f : 1.0f) * std::ldexp(1.0f + static_cast<float>(j) / 23.0f, k));
  v.push_back(0.0f);
  v.push_back(-0.0f);
  v.push_back(std::numeric_limits<float>::denorm_min());
  const Tensor x = matrix(v, 1, static_cast<int64_t>(v.size()));
  for (const DType format : {kE4M3Type, DType::F8E5M2, DType::F4E2M1})
    for (const uint64_t seed : {1u, 2u, 3u}) {
      QuantizeOptions o = quantize_options(format, 0, 0);
      o.fixed_scale = 1.0f;
      o.stochastic_seed = seed;
      o.stochastic_offset = 77;
      const Quantized q = quantize(x, o);
      const GemmOperand g = quantize_for_gemm(x, o);
      const std::vector<float> want = values_of(dequantize(q)), got = values_of(g.values);
      for (size_t i = 0; i < want.size(); ++i)
        ASSERT_EQ(std::bit_cast<uint32_t>(got[i] * g.row_scale[0]), std::bit_cast<uint32_t>(want[i]))
            << dtype_name(format) << " seed " << seed << " value " << v[i];
      EXPECT_EQ(g.saturated, q.saturated) << dtype_name(format);
      EXPECT_EQ(g.flushed, q.flushed) << dtype_name(format);
    }
}

// An operand with no columns (K = 0): no blocks, and a product of zeros.
TEST(Quantize, AnEmptyKGivesAZeroProduct) {
  for (const QuantizeOptions& o : {quantize_options(kE4M3Type, 0, 0), quantize_options(kE4M3Type, 1, 0), quantize_options(kE4M3Type, 1, 32),
                                   quantize_options(kE4M3Type, 1, 32, BlockScale::E8M0Floor)}) {
    const GemmOperand a = quantize_for_gemm(Tensor::ones({5, 0}), o), b = quantize_for_gemm(Tensor::ones({3, 0}), o);
    EXPECT_EQ(values_of(scaled_matmul(a, b)), std::vector<float>(15, 0.0f)) << block_scale_name(o.scale);
  }
}

TEST(Quantize, RefusesBadArguments) {
  EXPECT_ERROR_MENTIONS(quantize(Tensor::ones({4}), {}), "quantize", "2-d");
  EXPECT_ERROR_MENTIONS(quantize(Tensor::ones({2, 2}), quantize_options(DType::BF16, 0, 0)), "quantize", "bf16");
  EXPECT_ERROR_MENTIONS(quantize(Tensor::ones({2, 2}), quantize_options(kE4M3Type, -1, 0)), "block_rows");
  QuantizeOptions fixed;
  fixed.fixed_scale = -1.0f;
  EXPECT_ERROR_MENTIONS(quantize(Tensor::ones({2, 2}), fixed), "fixed_scale");
  const Quantized a = quantize(Tensor::ones({2, 3}), {}), b = quantize(Tensor::ones({2, 4}), {});
  EXPECT_ERROR_MENTIONS(scaled_matmul(a, b), "scaled_matmul", "K");
}

// ---- the low-precision Linear ------------------------------------------------------------------------

std::shared_ptr<LowPrecisionContext> context_for(const Tensor& weight, LowPrecisionRecipe recipe) {
  auto context = std::make_shared<LowPrecisionContext>(recipe);
  context->cover(weight, "layer.weight");
  return context;
}

TEST(ScaledLinear, CurrentScalingMatchesTheProductOfTheQuantizedOperands) {
  Tensor x = Tensor::randn({4, 3, 32}, 1), w = mul(Tensor::randn({16, 32}, 2), 0.1), b = Tensor::randn({16}, 3);
  x.requires_grad_(true);
  w.requires_grad_(true);
  b.requires_grad_(true);
  auto context = context_for(w, {});
  Tensor out;
  {
    LowPrecisionScope scope(context);
    out = linear(x, w, b);
  }
  EXPECT_EQ(out.dtype(), DType::BF16);
  EXPECT_EQ(out.shape(), (Shape{4, 3, 16}));
  // The reference: bf16 of (dequantized x) (dequantized W)ᵀ + b, in f64.
  const Tensor dx = dequantize(quantize(x.detach().reshape({12, 32}), {})).to(DType::F64);
  const Tensor dw = dequantize(quantize(w.detach(), {})).to(DType::F64);
  const std::vector<float> want =
      values_of(add(matmul(dx, dw.mT()), b.detach().to(DType::F64)).to(DType::BF16));
  const std::vector<float> got = values_of(out);
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], std::fabs(want[i]) * 0x1p-7) << i;
  // Backward: E5M2 gradients, E4M3 operands; the gradients are close to the fp32 layer's.
  backward(sum(out.to(DType::F32)));
  const Tensor gx = x.grad(), gw = w.grad(), gb = b.grad();
  EXPECT_EQ(gx.dtype(), DType::F32);
  EXPECT_EQ(gw.dtype(), DType::F32);
  const Tensor ones = Tensor::ones({12, 16});
  const std::vector<float> want_gx = values_of(matmul(ones, w.detach())), got_gx = values_of(gx);
  for (size_t i = 0; i < want_gx.size(); ++i) EXPECT_NEAR(got_gx[i], want_gx[i], 0.07 * std::fabs(want_gx[i]) + 0.02);
  EXPECT_EQ(values_of(gb), std::vector<float>(16, 12.0f));
  EXPECT_EQ(context->counts()[static_cast<size_t>(TensorKind::Activation)].values, 12 * 32);
  EXPECT_EQ(context->counts()[static_cast<size_t>(TensorKind::Gradient)].values, 12 * 16);
}

// set_k_split: fp8_rowwise reduces the row amaxes of exactly the GEMMs whose K the processes split (here the
// forward's and the weight gradient's, each operand once: two rows lists per GEMM), not the input gradient's.
TEST(ScaledLinear, RowwiseReducesRowAmaxesOfTheSplitGemmsOnly) {
  Tensor x = Tensor::randn({6, 8}, 1), w = Tensor::randn({4, 8}, 2);
  x.requires_grad_(true);
  w.requires_grad_(true);
  LowPrecisionRecipe recipe;
  recipe.scaling = ScalingRecipe::Rowwise;
  recipe.gradient_format = DType::F8E4M3;
  auto context = context_for(w, recipe);
  std::vector<size_t> forward, wgrad;  // the lengths each reduction saw
  context->set_k_split(w, Gemm::Forward, [&forward](std::span<float> a) { forward.push_back(a.size()); });
  context->set_k_split(w, Gemm::Wgrad, [&wgrad](std::span<float> a) { wgrad.push_back(a.size()); });
  {
    LowPrecisionScope scope(context);
    backward(sum(linear(x, w, Tensor()).to(DType::F32)));
  }
  EXPECT_EQ(forward, (std::vector<size_t>{6, 4}));  // x's 6 rows, W's 4
  EXPECT_EQ(wgrad, (std::vector<size_t>{4, 8}));    // gᵀ's 4 rows, xᵀ's 8
  EXPECT_ERROR_MENTIONS(context->set_k_split(Tensor::randn({2, 2}, 3), Gemm::Dgrad, {}), "is not covered");
}

// Inside bf16 autocast (how the fp8 modes run it) the GEMM still sums in fp32: the same bits as outside it.
TEST(ScaledLinear, AnOpenAutocastScopeChangesNothing) {
  const Tensor x = Tensor::randn({64, 48}, 1), w = Tensor::randn({40, 48}, 2), b = Tensor::randn({40}, 3);
  for (ScalingRecipe scaling : {ScalingRecipe::CurrentTensorwise, ScalingRecipe::Mx}) {
    LowPrecisionRecipe recipe;
    recipe.scaling = scaling;
    auto context = context_for(w, recipe);
    LowPrecisionScope scope(context);
    const std::vector<float> plain = values_of(linear(x, w, b));
    AutocastScope bf16(DType::BF16);
    EXPECT_EQ(values_of(linear(x, w, b)), plain);
  }
}

TEST(ScaledLinear, UncoveredWeightsAndClosedScopesRunTheOrdinaryLinear) {
  const Tensor x = Tensor::randn({2, 8}, 1), w = Tensor::randn({4, 8}, 2), other = Tensor::randn({4, 8}, 3);
  auto context = context_for(w, {});
  {
    LowPrecisionScope scope(context);
    EXPECT_EQ(linear(x, other, Tensor()).dtype(), DType::F32);
    EXPECT_EQ(linear(x, w, Tensor()).dtype(), DType::BF16);
  }
  EXPECT_EQ(linear(x, w, Tensor()).dtype(), DType::F32);
}

TEST(ScaledLinear, DelayedScalingFollowsTheAmaxHistory) {
  Tensor w = Tensor::full({2, 2}, 0.5);
  w.requires_grad_(true);
  LowPrecisionRecipe recipe;
  recipe.scaling = ScalingRecipe::DelayedTensorwise;
  recipe.amax_history_len = 4;
  auto context = context_for(w, recipe);
  auto step = [&](float amax) {
    Tensor x = Tensor::from_vector(std::vector<float>{amax, 0.25f}, {1, 2});
    {
      LowPrecisionScope scope(context);
      backward(sum(linear(x, w, Tensor()).to(DType::F32)));
    }
    context->end_step();
  };
  auto scale = [&](const char* kind) { return context->scaling_state().at(std::string("layer.weight.") + kind).scale; };
  EXPECT_EQ(scale("activation"), 1.0f);  // TE starts at 1
  step(2.0f);
  // After the step: scale = 448 / 2, the weight's 448 / 0.5, the gradient's (ones, E5M2) 57344 / 1.
  EXPECT_EQ(scale("activation"), 224.0f);
  EXPECT_EQ(scale("weight"), 896.0f);
  EXPECT_EQ(scale("gradient"), 57344.0f);
  const DelayedScaling h = context->scaling_state().at("layer.weight.activation");  // a copy: the map is a temporary
  EXPECT_EQ(h.history, (std::vector<float>{0, 2, 0, 0}));
  step(1.0f);  // "max" over the history keeps 2
  EXPECT_EQ(scale("activation"), 224.0f);
  for (int i = 0; i < 3; ++i) step(1.0f);  // 2 has left the 4-step history
  EXPECT_EQ(scale("activation"), 448.0f);
}

TEST(ScaledLinear, DelayedScalingKeepsTheScaleWhenTheAmaxIsZeroOrNotFinite) {
  Tensor w = Tensor::full({2, 2}, 0.5);
  LowPrecisionRecipe recipe;
  recipe.scaling = ScalingRecipe::DelayedTensorwise;
  recipe.amax_compute_algo = AmaxComputeAlgo::MostRecent;
  recipe.amax_history_len = 2;
  recipe.margin = 1;
  auto context = context_for(w, recipe);
  auto forward = [&](float v) {
    LowPrecisionScope scope(context);
    linear(Tensor::from_vector(std::vector<float>{v, v}, {1, 2}), w, Tensor());
    context->end_step();
    return context->scaling_state().at("layer.weight.activation").scale;
  };
  EXPECT_EQ(forward(4.0f), 448.0f / 4 / 2);  // margin 1 halves it
  EXPECT_EQ(forward(0.0f), 448.0f / 4 / 2);
  EXPECT_EQ(forward(INFINITY), 448.0f / 4 / 2);
  EXPECT_EQ(forward(1.0f), 448.0f / 1 / 2);  // most_recent
}

TEST(ScaledLinear, EveryRecipeTrainsALinearLayerTowardsItsTarget) {
  // y = x Wtᵀ with a fixed target Wt: a few SGD steps on the mean squared error shrink it for each recipe.
  const Tensor target = mul(Tensor::randn({8, 64}, 9), 0.1);
  for (ScalingRecipe scaling : {ScalingRecipe::CurrentTensorwise, ScalingRecipe::DelayedTensorwise,
                                ScalingRecipe::Rowwise, ScalingRecipe::Block, ScalingRecipe::Mx, ScalingRecipe::Nvfp4}) {
    Tensor w = Tensor::zeros({8, 64});
    w.requires_grad_(true);
    LowPrecisionRecipe recipe;
    recipe.scaling = scaling;
    recipe.block_size = 32;
    if (scaling == ScalingRecipe::Nvfp4) recipe.forward_format = recipe.gradient_format = DType::F4E2M1;
    if (scaling == ScalingRecipe::Rowwise || scaling == ScalingRecipe::Block || scaling == ScalingRecipe::Mx)
      recipe.gradient_format = DType::F8E4M3;
    auto context = context_for(w, recipe);
    double first = 0, last = 0;
    for (int step = 0; step < 60; ++step) {
      const Tensor x = Tensor::randn({32, 64}, 100 + step);
      Tensor loss;
      {
        LowPrecisionScope scope(context);
        const Tensor y = linear(x, w, Tensor()).to(DType::F32);
        const Tensor diff = sub(y, matmul(x, target.mT()));
        loss = mean(mul(diff, diff));
      }
      backward(loss);
      {
        NoGradGuard no_grad;
        w.add_(w.grad(), -0.5);
        w.set_grad(Tensor());
      }
      context->end_step();
      (step == 0 ? first : last) = loss.item();
    }
    EXPECT_LT(last, first * 0.1) << static_cast<int>(scaling);
  }
}

}  // namespace
}  // namespace mixtape
