#pragma once
// fp8 payloads for the data-parallel gradient all-reduce: Colossal-AI's fp8_communication, which halves (against
// bf16) or quarters (against fp32) the bytes it moves.
//
// A payload is fp8 codes plus one fp32 decode scale per chunk: the chunk's values times format_max / amax,
// rounded to nearest even (saturating: tensor/quantize.h), and the scale amax / format_max. Each rank scales
// each chunk it sends by that chunk's own amax, and every sum is taken in fp32 on the dequantized values.
// A chunk holding Inf or NaN travels with a NaN scale, so every value it reaches turns NaN and the step that
// made it is skipped on every rank, as a non-finite fp32 all-reduce would make it.
//
// fp8_all_reduce_mean is Colossal-AI's all_reduce_fp8 (its DDP comm hook): a reduce-scatter by all-to-all
// (rank j receives chunk j of every rank and sums them) and an all-gather of the re-quantized mean chunk. Every
// rank ends with the same values, its own contribution included after the fp8 round trip. The payloads are E5M2
// by default (the hook's: range for gradients, whose values span many binades). ZeRO-1's fp8 parameter
// all-gather, which needs one scale per parameter, is dist/zero.h's.
#include "dist/communicator.h"
#include "tensor/tensor.h"

namespace mixtape::dist {

// The mean over the group of x (floating, 1-d, the same numel everywhere; any device) with fp8 payloads
// (format F8E5M2 or F8E4M3): f32 [numel], equal on every rank.
Tensor fp8_all_reduce_mean(const Communicator& group, const Tensor& x, DType format = DType::F8E5M2);

}  // namespace mixtape::dist
