// Embedding gather and its scatter-add backward.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/strided.h"

namespace mixtape::cpu {

// out[i, :] = weight[indices[i], :]. A row gather: rows are copied as bytes when the weight's rows are
// contiguous, element by element otherwise (a transposed, tied weight).
void CpuBackend::embedding_kernel(const Tensor& weight, const Tensor& indices, const Tensor& out) {
  const int64_t n = out.size(0), C = out.size(1);
  const int64_t row_stride = weight.stride(0), col_stride = weight.stride(1);
  const bool parallel = n * C >= kParallelGrain && n > 1;
  dispatch_float(weight.dtype(), "embedding", [&]<typename T>() {
    const T* w = weight.data<T>();
    T* o = out.data<T>();
    dispatch_index(indices.dtype(), "embedding", [&]<typename I>() {
      const I* index = indices.data<I>();
#pragma omp parallel for schedule(static) if (parallel)
      for (int64_t i = 0; i < n; ++i) {
        const T* row = w + static_cast<int64_t>(index[i]) * row_stride;
        T* dst = o + i * C;
        if (col_stride == 1) {
          std::memcpy(dst, row, static_cast<size_t>(C) * sizeof(T));
        } else {
          for (int64_t c = 0; c < C; ++c) dst[c] = row[c * col_stride];
        }
      }
    });
  });
}

// grad_weight[v, :] += sum over {i : indices[i] == v} of grad_out[i, :].
// Deterministic without atomics: positions are grouped by vocabulary row (a stable sort, so each group keeps
// ascending positions), and each row is summed by one thread in that fixed order. The sum runs in acc_t
// (fp32 for 16-bit grads, so a token repeated thousands of times does not lose its small contributions) and
// is rounded once into grad_weight.
void CpuBackend::embedding_backward_kernel(const Tensor& grad_out, const Tensor& indices, const Tensor& grad_weight) {
  const int64_t n = grad_out.size(0), C = grad_out.size(1);
  if (n == 0 || C == 0) return;

  // order: positions sorted by the row they hit; groups[g] .. groups[g + 1] share one row.
  std::vector<int64_t> row_of(static_cast<size_t>(n));
  dispatch_index(indices.dtype(), "embedding_backward", [&]<typename I>() {
    const I* index = indices.data<I>();
    for (int64_t i = 0; i < n; ++i) row_of[i] = static_cast<int64_t>(index[i]);
  });
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return row_of[x] < row_of[y]; });
  std::vector<int64_t> groups;
  for (int64_t k = 0; k < n; ++k)
    if (k == 0 || row_of[order[k]] != row_of[order[k - 1]]) groups.push_back(k);
  const int64_t group_count = static_cast<int64_t>(groups.size());
  groups.push_back(n);

  const bool parallel = n * C >= kParallelGrain && group_count > 1;
  dispatch_float(grad_weight.dtype(), "embedding_backward", [&]<typename T>() {
    using Acc = acc_t<T>;
    const T* g = grad_out.data<T>();
    T* gw = grad_weight.data<T>();
#pragma omp parallel if (parallel)
    {
      std::vector<Acc> sum(static_cast<size_t>(C));
#pragma omp for schedule(dynamic, 16)
      for (int64_t group = 0; group < group_count; ++group) {
        T* dst = gw + row_of[order[groups[group]]] * C;
        for (int64_t c = 0; c < C; ++c) sum[c] = convert<Acc>(dst[c]);
        for (int64_t k = groups[group]; k < groups[group + 1]; ++k) {
          const T* src = g + order[k] * C;
          for (int64_t c = 0; c < C; ++c) sum[c] += convert<Acc>(src[c]);
        }
        for (int64_t c = 0; c < C; ++c) dst[c] = convert<T>(sum[c]);
      }
    }
  });
}

}  // namespace mixtape::cpu
