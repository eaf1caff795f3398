#pragma once
// Public: bench/ and tests read which ISA serves gemm16 (gemm16_isa) and call gemm16 directly against references.
// A GEMM on fp16 or bf16 operands for CPUs without arithmetic in that format: the 16-bit values widened to
// float block by block inside the GEMM, float FMAs, the result rounded back in the kernel's epilogue. See
// gemm16.cpp for why and how.
#include <cstdint>
#include <vector>

#include "tensor/half.h"

namespace mixtape::cpu {

// One matrix operand: element (i, j) at data[i * row_stride + j * col_stride].
template <class T>
struct Matrix16 {
  const T* data = nullptr;
  int64_t row_stride = 0;
  int64_t col_stride = 0;
};
using F16Matrix = Matrix16<Half>;
using Bf16Matrix = Matrix16<BFloat16>;

// The vector code gemm16 runs. The library is built for the CPU it runs on (-march=native), so the build
// decides what exists: Avx512 needs AVX-512 F, BW and VL, Avx2 needs AVX2 and FMA, both F16C. None: gemm16
// throws "not supported" and 16-bit products go through the f32 GEMM.
enum class Gemm16Isa { None, Avx2, Avx512 };
const char* gemm16_isa_name(Gemm16Isa isa);

// The kernels this build has, widest first (empty: none).
std::vector<Gemm16Isa> gemm16_kernels();

// The kernel gemm16 runs: the widest this build has, unless the environment variable MIXTAPE_GEMM16
// (none, avx2 or avx512; read on first use) or set_gemm16_isa chose another.
Gemm16Isa gemm16_isa();

// MIXTAPE_GEMM16's value as a kernel: null or empty gives the widest built; an unknown name or a kernel this
// build lacks is an error.
Gemm16Isa gemm16_isa_from_env(const char* value);

// For tests and comparisons: makes gemm16 run `isa` (None switches it off: 16-bit products go through f32).
// Returns the previous choice; throws "not supported" for a kernel this build lacks.
Gemm16Isa set_gemm16_isa(Gemm16Isa isa);

// Whether gemm16 takes these operands: each must have a unit stride along one of its dims.
template <class T>
bool gemm16_takes(const Matrix16<T>& a, const Matrix16<T>& b) {
  return (a.row_stride == 1 || a.col_stride == 1) && (b.row_stride == 1 || b.col_stride == 1);
}

// out[m * out_row_stride + n] = T(sum_k a(m, k) * b(k, n) + bias[n]) for m < M, n < N (M, K, N > 0), T = Half
// or BFloat16. Products are exact in float (fp16 and bf16 have at most 11 significant bits), summed in float
// over k in order (one FMA each), then the bias is added and the sum rounded to T once (nearest even). bias
// may be null. Requires gemm16_isa() != None and gemm16_takes(a, b).
template <class T>
void gemm16(int64_t M, int64_t K, int64_t N, const Matrix16<T>& a, const Matrix16<T>& b, const T* bias, T* out,
            int64_t out_row_stride);

}  // namespace mixtape::cpu
