#pragma once
// The CPU's one-pass quantize_for_gemm (tensor/quantize.h) for operands whose blocks are runs along each row,
// [1, block_cols] with block_cols < C: MXFP8's blocks of 32 and DeepSeek-V3's 1 x 128 tiles. Each run is read
// once: its amax, its scale (tensor/scale_rules.h's choose_block_scale) and its encoded values follow while
// it is in cache, reading bf16 or f32 input as it is.
//
// The general path (an amax pass, the scales, then an encode pass over an f32 copy) gives the same scales,
// values and counts bit for bit: both apply the same rules to the same f32 values. It stays the path of every
// other case (and of CUDA): scales that depend on the whole tensor (NVFP4, a reduced amax) or that span rows.
#include "tensor/quantize.h"

namespace mixtape::cpu {

// Whether quantize_row_blocks handles these options for an [R, C] operand on the CPU: blocks [1, block_cols]
// with block_cols < C, an fp8 format, E8M0 or fp32 block scales, no reduction over processes, nearest rounding.
bool row_blocks_apply(const Tensor& x, const QuantizeOptions& options);

// Quantizes x (contiguous f32 or bf16 [R, C] on the CPU; row_blocks_apply) into op: bf16 values, the code
// values times their E8M0 block scale (exact in bf16) or the code values with fp32 scales along K (k_scales,
// k_block), and op.amax and the counts. Returns false where a block holding nonzero values has an E8M0 decode
// scale below 2^-100 (an amax below about 2^-92), whose products bf16 cannot hold exactly: the caller then
// takes the general path, which stores f32 values.
bool quantize_row_blocks(const Tensor& x, const QuantizeOptions& options, const ScaleRule& rule, GemmOperand& op);

}  // namespace mixtape::cpu
