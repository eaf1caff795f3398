#pragma once
// Host-side geometry that the CPU and CUDA backends share: how a matmul's batch dims and a reduction's dims
// are simplified before a kernel sees them. Both backends walk the same simplified problem, so they agree on
// which operands need a copy and in which order a reduction combines its elements.
#include <cstdint>
#include <vector>

#include "tensor/shape.h"
#include "tensor/tensor.h"

namespace mixtape {

// ---- matmul ---------------------------------------------------------------------------------------------

// One matrix operand: its batch strides (0 where broadcast) and row / column strides, in elements.
struct MatrixLayout {
  Strides batch;
  int64_t row_stride = 0;
  int64_t col_stride = 0;
};

// The simplified problem: out[batch..., M, N] = a[batch..., M, K] @ b[batch..., K, N].
struct MatmulGeometry {
  Shape batch;
  int64_t M = 0, K = 0, N = 0;
  MatrixLayout a, b, out;
};

// a [..., M, K], b [..., K, N] with out's batch dims already broadcast (an operand dim of size 1 under a
// larger out dim is a broadcast: batch stride 0), out [..., M, N]:
//   1. batch dims of size 1 are dropped and adjacent batch dims that every operand steps through as one are
//      merged (a contiguous [B, T, M, K] has a single batch dim of B*T);
//   2. when b is the same matrix for every batch entry (a linear layer: x [B, T, C] @ W [C, N]) and a's and
//      out's batch steps are whole row blocks, the single batch dim folds into M: one [B*T, C] x [C, N] GEMM;
//   3. the strides of a size-1 matrix dim are made those of a dense row-major matrix where possible, so a
//      column [K, 1] or a row [1, K] with unit column stride is an ordinary row-major matrix, and a row with
//      a non-unit column stride a column-major one.
MatmulGeometry simplify_matmul(const Tensor& a, const Tensor& b, const Tensor& out);

// ---- reductions -----------------------------------------------------------------------------------------

// x's dims split into kept dims (in output order; the output is contiguous over them) and reduced dims
// (sorted so that the last has the smallest |stride|: it is the inner loop). Size-1 dims are dropped and
// neighbours that step through memory as one dim are merged. Both lists are never empty: a missing group
// is a single dim of size 1 (stride 0).
struct ReduceGeometry {
  Shape kept_sizes;
  Strides kept_strides;
  Shape reduced_sizes;
  Strides reduced_strides;
  int64_t n_out = 1;      // number of outputs
  int64_t n_reduced = 1;  // elements combined into each output
};

// `dims`: the reduced dims of x, each in [0, x.dim()) (already normalised by the op front end).
ReduceGeometry reduce_geometry(const Tensor& x, const std::vector<int64_t>& dims);

}  // namespace mixtape
