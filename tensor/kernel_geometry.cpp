#include "tensor/kernel_geometry.h"

#include <algorithm>
#include <cstdlib>
#include <utility>

namespace mixtape {

namespace {

// Strides of a size-1 dim are meaningless; give them the values of a dense row-major matrix where possible,
// so that a column [K, 1] or a row [1, K] with unit column stride is an ordinary row-major matrix, and a
// row with a non-unit column stride a column-major one.
void canonicalize(int64_t rows, int64_t cols, MatrixLayout& m) {
  if (cols == 1) m.col_stride = 1;
  if (rows == 1) m.row_stride = m.col_stride == 1 ? cols : 1;
}

// Merges neighbours that step through memory as one dim; an empty list becomes one dim of size 1.
void merge_dims(Shape& sizes, Strides& strides) {
  Shape merged_sizes;
  Strides merged_strides;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (!merged_sizes.empty() && merged_strides.back() == strides[d] * sizes[d]) {
      merged_sizes.back() *= sizes[d];
      merged_strides.back() = strides[d];
    } else {
      merged_sizes.push_back(sizes[d]);
      merged_strides.push_back(strides[d]);
    }
  }
  if (merged_sizes.empty()) {
    merged_sizes.push_back(1);
    merged_strides.push_back(0);
  }
  sizes = std::move(merged_sizes);
  strides = std::move(merged_strides);
}

}  // namespace

MatmulGeometry simplify_matmul(const Tensor& a, const Tensor& b, const Tensor& out) {
  MatmulGeometry g;
  const int64_t nb = out.dim() - 2;
  g.M = out.size(-2);
  g.N = out.size(-1);
  g.K = a.size(-1);
  // Batch dims (size-1 dims dropped; an operand dim of size 1 under a larger out dim is a broadcast).
  for (int64_t d = 0; d < nb; ++d) {
    const int64_t size = out.shape()[d];
    if (size == 1) continue;
    const int64_t sa = a.shape()[d] == size ? a.strides()[d] : 0;
    const int64_t sb = b.shape()[d] == size ? b.strides()[d] : 0;
    const int64_t so = out.strides()[d];
    const size_t m = g.batch.size();
    // Merge into the previous batch dim when all three step through both dims as one.
    if (m > 0 && g.a.batch[m - 1] == sa * size && g.b.batch[m - 1] == sb * size &&
        g.out.batch[m - 1] == so * size) {
      g.batch[m - 1] *= size;
      g.a.batch[m - 1] = sa;
      g.b.batch[m - 1] = sb;
      g.out.batch[m - 1] = so;
    } else {
      g.batch.push_back(size);
      g.a.batch.push_back(sa);
      g.b.batch.push_back(sb);
      g.out.batch.push_back(so);
    }
  }
  g.a.row_stride = a.stride(-2);
  g.a.col_stride = a.stride(-1);
  g.b.row_stride = b.stride(-2);
  g.b.col_stride = b.stride(-1);
  g.out.row_stride = out.stride(-2);
  g.out.col_stride = out.stride(-1);
  canonicalize(g.M, g.K, g.a);
  canonicalize(g.K, g.N, g.b);
  canonicalize(g.M, g.N, g.out);
  // A shared b: fold a single batch dim into M when a's and out's batch steps are whole row blocks (then row
  // r of batch entry i is row i * M + r of one taller matrix with the same row stride).
  if (g.batch.size() == 1 && g.b.batch[0] == 0 && g.a.batch[0] == g.M * g.a.row_stride &&
      g.out.batch[0] == g.M * g.out.row_stride) {
    g.M *= g.batch[0];
    g.batch.clear();
    g.a.batch.clear();
    g.b.batch.clear();
    g.out.batch.clear();
    canonicalize(g.M, g.K, g.a);
    canonicalize(g.M, g.N, g.out);
  }
  return g;
}

ReduceGeometry reduce_geometry(const Tensor& x, const std::vector<int64_t>& dims) {
  std::vector<bool> reduced(static_cast<size_t>(x.dim()), false);
  for (int64_t d : dims) reduced[static_cast<size_t>(d)] = true;
  ReduceGeometry g;
  std::vector<std::pair<int64_t, int64_t>> reduced_dims;  // (stride, size)
  for (int64_t d = 0; d < x.dim(); ++d) {
    const int64_t size = x.shape()[d], stride = x.strides()[d];
    if (reduced[static_cast<size_t>(d)]) {
      g.n_reduced *= size;
      if (size != 1) reduced_dims.push_back({stride, size});
    } else {
      g.n_out *= size;
      if (size != 1) {
        g.kept_sizes.push_back(size);
        g.kept_strides.push_back(stride);
      }
    }
  }
  // The order of the reduced dims is free (only the rounding changes): walk the largest stride outermost.
  std::stable_sort(reduced_dims.begin(), reduced_dims.end(),
                   [](const auto& a, const auto& b) { return std::abs(a.first) > std::abs(b.first); });
  for (const auto& [stride, size] : reduced_dims) {
    g.reduced_sizes.push_back(size);
    g.reduced_strides.push_back(stride);
  }
  merge_dims(g.kept_sizes, g.kept_strides);
  merge_dims(g.reduced_sizes, g.reduced_strides);
  return g;
}

}  // namespace mixtape
