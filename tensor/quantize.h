#pragma once
// Scaled quantization into fp8 / fp4 (tensor/minifloat.h) and the emulated GEMM on quantized operands: the
// numerics of every fp8 and block-scaled training recipe (tensor/scaled_linear.h applies them to a Linear).
//
// A quantized 2-d operand [R, C] is codes (one per value) and a grid of decode scales, one per block of
// [block_rows, block_cols] values (the last block of a dim may be short):
//     value ≈ code_value * scales[r / block_rows, c / block_cols] * tensor_scale
// C is the dim a GEMM sums over (K): per-row scales are blocks [1, C], per-tensor scales one block [R, C].
// How a block's scale is chosen is the BlockScale (each is its recipe's rule, cited in docs/low_precision.md); the codes
// are the scaled values rounded to nearest even (or stochastically) with saturation to the largest finite
// value, as Transformer Engine and cuBLASLt quantize.
//
// A block holding Inf or NaN gets a NaN scale, so its values dequantize to NaN and the training step that
// made them is skipped like any non-finite step (a saturating cast alone would turn Inf into ±448 silently).
//
// quantize, dequantize, the Quantized scaled_matmul and convert_minifloat take CPU tensors only (a CUDA tensor is
// a "not supported" Error); the training path (quantize_for_gemm, the GemmOperand scaled_matmul) runs on the
// CPU and on CUDA, through the tensor's Backend, with the same scales, values and counts on both.
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "tensor/scale_rules.h"  // BlockScale, the shared scale and rounding rules
#include "tensor/tensor.h"

namespace mixtape {

const char* block_scale_name(BlockScale scale);  // "fp32", "e8m0_floor", "e8m0_ceil", "e4m3_two_level"

struct QuantizeOptions {
  DType format = DType::F8E4M3;  // F8E4M3, F8E5M2 or F4E2M1
  int64_t block_rows = 0;        // rows one scale covers; 0 = all rows
  int64_t block_cols = 0;        // columns one scale covers; 0 = all columns
  BlockScale scale = BlockScale::Fp32;
  // Fp32 only: every block's encode scale is this (Transformer Engine's delayed scaling), not format_max / amax.
  std::optional<float> fixed_scale;
  // Fp32 only: each encode scale rounded down to a power of two, 2^floor(log2(format_max / amax)) (torchao's
  // round_scales_to_power_of_2): scaling and unscaling are then exact.
  bool power_of_two_scales = false;
  // One scale for the whole tensor (block_rows and block_cols 0, no fixed_scale), or NVFP4's fp32 tensor scale,
  // when the tensor is split over processes: the local amax goes in, the MAX over every process holding a part
  // of it comes out (every rank then quantizes with the same scale, as Transformer Engine's reduced amax does).
  // Unset: the local amax.
  std::function<float(float)> reduce_tensor_amax;
  // One scale per row (block_rows 1, block_cols 0) when the rows are split along their columns over processes
  // (each holds a contiguous part of every row): the rows' local amaxes go in, in place, and their MAX over the
  // processes comes out, so every rank scales a row as one process would. Unset: the local amaxes.
  std::function<void(std::span<float>)> reduce_row_amax;
  // Stochastic rounding (NVFP4's gradients): element i draws Philox(key seed, counter (offset + i, stream));
  // unset: nearest even.
  std::optional<uint64_t> stochastic_seed;
  uint64_t stochastic_offset = 0;
  uint64_t stochastic_stream = 0;
};

struct Quantized {
  Tensor codes;             // [R, C] of the format
  Tensor scales;            // decode scales [ceil(R / block_rows), ceil(C / block_cols)]: F32, F8E8M0 or F8E4M3
  float tensor_scale = 1;   // fp32 decode scale over all blocks (NVFP4; 1 for the others)
  int64_t block_rows = 0, block_cols = 0;  // resolved (never 0)
  // What quantization did, for the scaling recipes and the precision study:
  float amax = 0;           // max |x| (Inf or NaN when x holds one)
  int64_t saturated = 0;    // finite values that rounded beyond the format's largest finite value (clamped)
  int64_t flushed = 0;      // nonzero finite values that became zero
  int64_t rows() const { return codes.size(0); }
  int64_t cols() const { return codes.size(1); }
};

// Quantizes a 2-d floating tensor (any strides; f32, f16, bf16 or f64). Error for other shapes, dtypes and
// options, naming the option.
Quantized quantize(const Tensor& x, const QuantizeOptions& options);

// The values as f32 [R, C]: code_value * scale * tensor_scale, one fp32 rounding (none where the scales are
// powers of two or the block scale and code multiply exactly, as E4M3 x E2M1 does).
Tensor dequantize(const Quantized& q);

// a [M, K] @ b [N, K]^T in f32: products of the dequantized values summed in fp32. Where both operands' scales
// are constant along K (tensorwise and rowwise) the codes are multiplied and the [M, N] result scaled after,
// as cuBLASLt's scaled fp8 GEMM does (D = scale_a * scale_b * (A @ B)).
Tensor scaled_matmul(const Quantized& a, const Quantized& b);

// ---- the training path ----
// A quantized operand in the form a GEMM takes it: the same numbers as quantize() then dequantize(), built in
// one pass without the codes. values holds code_value * block scale where that product is exact in bf16 (the
// E8M0 and NVFP4 scales), the code values alone where the scales are constant along K (tensorwise, rowwise:
// row_scale then holds each row's decode scale, applied to the GEMM's result) or are fp32 scales of blocks
// along K (DeepSeek-V3's tiles: k_scales, applied to each block's partial product), and the dequantized f32
// values otherwise (E8M0 scales below 2^-100). tensor_scale multiplies the result too.
struct GemmOperand {
  Tensor values;                 // [R, C], bf16 (exact) or f32
  std::vector<float> row_scale;  // [R], or empty
  // fp32 scales along K (fp8_block): values holds the code values, and k_scales[r * blocks + j] the decode
  // scale of row r's j-th block of k_block columns; the GEMM scales each block's partial product. Else empty.
  std::vector<float> k_scales;
  int64_t k_block = 0;
  float tensor_scale = 1;
  float amax = 0;
  int64_t saturated = 0, flushed = 0;  // as in Quantized
};
// On CUDA, a tensorwise operand (one block for the whole tensor, an fp8 format) holds the fp8 codes themselves:
// values is F8E4M3 / F8E5M2 [R, C] on the device and row_scale holds the one decode scale R times, so that the
// GEMM runs on the fp8 tensor cores with the decode scales as cuBLASLt's A / B scales (exact emulation from
// the codes where the device or the shape cannot).
GemmOperand quantize_for_gemm(const Tensor& x, const QuantizeOptions& options);
// a [M, K] @ b [N, K]ᵀ in f32 (fp32 sums of exact products), scaled by the operands' row and tensor scales;
// both operands on one device, the result there. On CUDA the sums are the tensor cores' (fp8 codes: the fp8
// MMA's accumulator, promoted to fp32 by cuBLASLt; bf16 / f32 values: fp32, TF32 off) and accumulator_bits
// must be 0 (the hardware accumulates as it does: a "not supported" Error otherwise).
// operands blocked along K give one GEMM per block, scaled and summed in fp32.
// accumulator_bits (1..23; 0: fp32 throughout) models a tensor core's narrower accumulator: the running sum of
// each output is rounded to that many mantissa bits (to nearest even) after every kAccumulatorChunk products
// along K, one fp8 MMA instruction's K on Hopper (DeepSeek-V3 reports about 14 bits kept there). Sums carried
// across K blocks (fp8_block) are promoted to fp32, as DeepSeek-V3 promotes them every 128.
inline constexpr int64_t kAccumulatorChunk = 32;
Tensor scaled_matmul(const GemmOperand& a, const GemmOperand& b, int accumulator_bits = 0);

// Tensor::to between a floating dtype and a format of tensor/minifloat.h, or between two formats (see there:
// round to nearest even, PyTorch's overflow: NaN for E4M3, Inf for E5M2, ±6 for E2M1; E8M0 drops the sign).
// Error for integer dtypes, CUDA tensors and NaN into F4E2M1 (it has no NaN).
Tensor convert_minifloat(const Tensor& x, DType target);

// The largest finite value of a format (448, 57344, 6); Error for other dtypes.
float format_max(DType format);
// The encoding of an element format (F8E4M3, F8E5M2, F4E2M1: tensor/minifloat.h); Error for other dtypes.
const MinifloatFormat& element_format(DType format);

}  // namespace mixtape
