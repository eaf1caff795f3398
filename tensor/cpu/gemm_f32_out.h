#pragma once
// out[M, N] = a[M, K] @ b[N, K]ᵀ in f32 from bf16 (or f32) operands: the fp8 / block-scaled GEMMs' product
// (tensor/quantize.h), whose operands are exact in bf16 and whose sums must stay in fp32 (a bf16 output, as
// matmul() gives for bf16 operands, would round every partial result the recipes scale afterwards).
// oneDNN's bf16 matmul with an f32 destination: products exact in f32, sums in f32.
#include "tensor/tensor.h"

namespace mixtape::cpu {

// a, b: both bf16 or both f32, each row-major or column-major (rows, or columns, may be strided: a block of a
// wider matrix); out: contiguous f32 [M, N].
void gemm_nt_f32_out(const Tensor& a, const Tensor& b, const Tensor& out);

}  // namespace mixtape::cpu
