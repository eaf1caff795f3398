#pragma once
// An fp16 GEMM for CPUs without fp16 arithmetic: fp16 operands widened to float block by block inside the
// GEMM, float FMAs, the result rounded to fp16 in the kernel's epilogue. See gemm_f16.cpp for why.
#include <cstdint>

#include "tensor/half.h"

namespace mixtape::cpu {

// One matrix operand: element (i, j) at data[i * row_stride + j * col_stride].
struct F16Matrix {
  const Half* data = nullptr;
  int64_t row_stride = 0;
  int64_t col_stride = 0;
};

// Whether this build and CPU run gemm_f16 (AVX-512F; F16C comes with it).
bool gemm_f16_available();

// Whether gemm_f16 takes these operands: each must have a unit stride along one of its dims.
bool gemm_f16_takes(const F16Matrix& a, const F16Matrix& b);

// out[m * out_row_stride + n] = round_to_fp16(sum_k a(m, k) * b(k, n) + bias[n]) for m < M, n < N, K > 0.
// Products are exact in float (fp16 has 11 significant bits), summed in float over k in order; bias may be
// null. Requires gemm_f16_available() and gemm_f16_takes(a, b).
void gemm_f16(int64_t M, int64_t K, int64_t N, const F16Matrix& a, const F16Matrix& b, const Half* bias,
              Half* out, int64_t out_row_stride);

}  // namespace mixtape::cpu
