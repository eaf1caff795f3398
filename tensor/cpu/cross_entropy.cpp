// Softmax cross-entropy on the CPU: the forward and the fused backward.
//
// logits are [N, V] contiguous rows, targets [N]. Rows are independent, so both kernels split rows across
// threads. The forward reads a row twice (its max, then sum_j e^(x_j - max)); a row of V values stays in
// L2 between the passes. It stores only lse_i = max + log(sum) per row; the loss is then
//   loss = 1/count sum_{counted i} (lse_i - x_{i, t_i})
// summed in row order in double, so it does not depend on the thread count. The backward writes
//   grad_ij = (e^(x_ij - lse_i) - [j == t_i]) * g / count
// straight into grad_logits: the softmax is never stored. f16/bf16 compute in float, f64 in double; lse is
// stored in that accumulation type (f32, f64 for f64).
//
// A 16-bit row is widened into a float buffer and runs the f32 kernel's own row functions (the gradient row is
// rounded once at the end), so 16-bit logits give bit for bit the loss, lse and (rounded) gradient of their
// f32 copy: autocast's front end relies on that to read 16-bit logits in place (tensor/ops_fused.cpp).
#include <algorithm>
#include <cmath>
#include <limits>

#include "tensor/cpu/convert_block.h"
#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/scratch.h"
#include "tensor/cpu/strided.h"

namespace mixtape::cpu {

namespace {

inline bool parallel_rows(int64_t N, int64_t V) { return N > 1 && N * V >= 2 * kParallelGrain; }

template <class I>
int64_t counted_rows(const I* targets, int64_t N, int64_t ignore_index) {
  int64_t count = 0;
  for (int64_t i = 0; i < N; ++i) count += static_cast<int64_t>(targets[i]) != ignore_index;
  return count;
}

// log sum_j e^(x_j) of one row in A, shifted by the row max so that no exponential overflows. A row whose
// max is infinite gets no shift (so all -inf gives -inf, a +inf gives +inf or NaN, as the math does).
// Not inlined: the f32 rows and the widened 16-bit rows run this one compiled loop (the same bits).
template <class A>
[[gnu::noinline]] A row_log_sum_exp(const A* __restrict x, int64_t V) {
  A m = -std::numeric_limits<A>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < V; ++j) m = std::max(m, x[j]);
  const A shift = std::isfinite(m) ? m : A(0);
  A sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < V; ++j) sum += std::exp(x[j] - shift);
  return shift + std::log(sum);
}

// One counted row's gradient: g_j = e^(x_j - l) * row_scale, and at the target (p - 1) formed in A before the
// one rounding, so p close to 1 keeps its digits.
template <class A>
[[gnu::noinline]] void row_gradient(const A* __restrict x, A* __restrict g, int64_t V, int64_t t, A l,
                                    A row_scale) {
  for (int64_t j = 0; j < V; ++j) g[j] = std::exp(x[j] - l) * row_scale;
  g[t] = (std::exp(x[t] - l) - A(1)) * row_scale;
}

// Each thread's float rows for the f32 row functions: a 16-bit row widened (and its gradient before the one
// rounding); f32 and f64 rows are used in place and take no scratch.
template <class T>
struct AccRows {
  float* x = nullptr;
  float* g = nullptr;
  AccRows(ScratchCarver& carver, int64_t V, bool gradient) {
    if constexpr (kSixteenBit<T>) {
      x = carver.take<float>(V);
      if (gradient) g = carver.take<float>(V);
    }
  }
  // The row as the accumulation type: itself, or widened into x.
  const acc_t<T>* widened(const T* row, int64_t V) const {
    if constexpr (kSixteenBit<T>) {
      widen_block(row, x, V);
      return x;
    } else {
      return row;
    }
  }
};

}  // namespace

void CpuBackend::softmax_cross_entropy_kernel(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                                              const Tensor& loss, const Tensor& lse) {
  const char* op = "softmax_cross_entropy";
  const int64_t N = logits.shape()[0], V = logits.shape()[1];
  dispatch_float(logits.dtype(), op, [&]<typename T>() {
    using A = acc_t<T>;
    dispatch_index(targets.dtype(), op, [&]<typename I>() {
      const T* x = logits.data<T>();
      const I* target = targets.data<I>();
      A* lse_out = lse.data<A>();
      const bool parallel = parallel_rows(N, V);
      const ThreadScratch scratch(scratch_bytes<AccRows<T>>(V, false), parallel);
#pragma omp parallel if (parallel)
      {
        ScratchCarver carver = scratch.carver();
        const AccRows<T> rows(carver, V, false);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < N; ++i) lse_out[i] = row_log_sum_exp<A>(rows.widened(x + i * V, V), V);
      }
      // -log softmax(x_i)[t] = lse_i - x_{i,t}; summed in row order (thread-count independent) in double.
      double total = 0;
      int64_t count = 0;
      for (int64_t i = 0; i < N; ++i) {
        const int64_t t = static_cast<int64_t>(target[i]);
        if (t == ignore_index) continue;
        total += static_cast<double>(lse_out[i] - convert<A>(x[i * V + t]));
        ++count;
      }
      // No counted row: the mean of nothing is defined as 0 (and its gradient is 0), not 0/0.
      loss.data<A>()[0] = count > 0 ? static_cast<A>(total / static_cast<double>(count)) : A(0);
    });
  });
}

void CpuBackend::softmax_cross_entropy_backward_kernel(const Tensor& grad_loss, const Tensor& logits,
                                                       const Tensor& targets, const Tensor& lse, int64_t ignore_index,
                                                       const Tensor& grad_logits) {
  const char* op = "softmax_cross_entropy_backward";
  const int64_t N = logits.shape()[0], V = logits.shape()[1];
  dispatch_float(logits.dtype(), op, [&]<typename T>() {
    using A = acc_t<T>;
    dispatch_index(targets.dtype(), op, [&]<typename I>() {
      const T* x = logits.data<T>();
      const I* target = targets.data<I>();
      const A* lse_in = lse.data<A>();
      T* grad = grad_logits.data<T>();
      const int64_t count = counted_rows(target, N, ignore_index);
      // d loss / d x_ij = (p_ij - [j == t_i]) / count for counted rows; the chain rule multiplies by g.
      const A row_scale = count > 0 ? grad_loss.data<A>()[0] / static_cast<A>(count) : A(0);
      const bool parallel = parallel_rows(N, V);
      const ThreadScratch scratch(scratch_bytes<AccRows<T>>(V, true), parallel);
#pragma omp parallel if (parallel)
      {
        ScratchCarver carver = scratch.carver();
        const AccRows<T> rows(carver, V, true);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < N; ++i) {
          const T* xi = x + i * V;
          T* gi = grad + i * V;
          const int64_t t = static_cast<int64_t>(target[i]);
          if (t == ignore_index) {
            std::fill(gi, gi + V, convert<T>(A(0)));
          } else if constexpr (kSixteenBit<T>) {
            row_gradient<A>(rows.widened(xi, V), rows.g, V, t, lse_in[i], row_scale);
            narrow_block(rows.g, gi, V);
          } else {
            row_gradient<A>(xi, gi, V, t, lse_in[i], row_scale);
          }
        }
      }
    });
  });
}

}  // namespace mixtape::cpu
