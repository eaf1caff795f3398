// Reductions (sum, mean, max, min, var) and softmax on the CPU.
//
// A reduction is seen as   out[o] = combine_j load(x[kept_offset(o) + reduced_offset(j)])   where o runs over
// the kept dims (the output, contiguous) and j over the reduced dims. Two loop orders cover the common cases:
//  - row mode: the reduced dims are innermost in memory (sum over the last dim): each output walks its own
//    run of elements with several independent accumulators (vectorised, and more accurate than one chain);
//  - column mode: a kept dim is innermost (sum over the batch dim, the bias gradient): a block of outputs is
//    accumulated side by side while the reduced rows stream past, so memory is read in order.
// Long reductions are cut into chunks of a fixed number of elements whose partial results are combined
// pairwise. The chunking depends only on the shape, never on the thread count, so results are bitwise the
// same with 1 or 2 threads, and the rounding error grows like (chunk + log2(chunks)) eps instead of n eps.
// f16/bf16 accumulate in float, f64 in double, and every result is rounded once on store.
//
// softmax / log_softmax work row by row along their dim (the row max subtracted first), with their own
// backward kernels.
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "tensor/cpu/convert_block.h"
#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/fast_math.h"
#include "tensor/cpu/lane_sum.h"
#include "tensor/cpu/strided.h"
#include "tensor/kernel_geometry.h"

namespace mixtape::cpu {

namespace {

// ---- geometry --------------------------------------------------------------------------------------------

// x's kept / reduced dims come from reduce_geometry (tensor/kernel_geometry.h), shared with the CUDA backend.

// Offset in x of flat index `index` over (sizes, strides), row-major.
int64_t offset_of(int64_t index, const Shape& sizes, const Strides& strides) {
  int64_t offset = 0;
  for (size_t d = sizes.size(); d-- > 0;) {
    offset += (index % sizes[d]) * strides[d];
    index /= sizes[d];
  }
  return offset;
}

// Calls run(offset, count, stride) for the runs along the innermost dim that cover flat indices
// [begin, end) of (sizes, strides): elements offset + k * stride for k < count.
template <class Run>
void for_each_run(const Shape& sizes, const Strides& strides, int64_t begin, int64_t end, Run&& run) {
  const int64_t inner = sizes.back(), inner_stride = strides.back();
  while (begin < end) {
    const int64_t column = begin % inner;
    const int64_t count = std::min(inner - column, end - begin);
    run(offset_of(begin, sizes, strides), count, inner_stride);
    begin += count;
  }
}

// ---- the combining rules -----------------------------------------------------------------------------
// Each rule has identity(), load(value, output index) and combine(a, b). max/min propagate NaN like torch.

template <class A>
struct SumRule {
  A identity() const { return A(0); }
  A load(A v, int64_t) const { return v; }
  A combine(A a, A b) const { return a + b; }
};

template <class A>
struct MaxRule {
  A identity() const { return -std::numeric_limits<A>::infinity(); }
  A load(A v, int64_t) const { return v; }
  A combine(A a, A b) const { return (a > b || a != a) ? a : b; }
};

template <class A>
struct MinRule {
  A identity() const { return std::numeric_limits<A>::infinity(); }
  A load(A v, int64_t) const { return v; }
  A combine(A a, A b) const { return (a < b || a != a) ? a : b; }
};

// (x - mean[o])^2 summed: the second pass of the two-pass variance.
template <class A>
struct SquaredDeviationRule {
  const A* mean;
  A identity() const { return A(0); }
  A load(A v, int64_t o) const {
    const A d = v - mean[o];
    return d * d;
  }
  A combine(A a, A b) const { return a + b; }
};

// Pairwise (tree) combination of n values p[0], p[stride], ...: error grows like log2(n), not n.
template <class A, class Rule>
A combine_pairwise(const A* p, int64_t n, int64_t stride, const Rule& rule) {
  if (n <= 8) {
    A acc = rule.identity();
    for (int64_t i = 0; i < n; ++i) acc = rule.combine(acc, p[i * stride]);
    return acc;
  }
  const int64_t half = n / 2;
  return rule.combine(combine_pairwise(p, half, stride, rule),
                      combine_pairwise(p + half * stride, n - half, stride, rule));
}

constexpr int64_t kRowChunk = 8192;    // reduced elements per partial result in row mode
constexpr int64_t kColumnChunk = 128;  // reduced rows per partial result in column mode
constexpr int64_t kColumnBlock = 256;  // outputs accumulated side by side in column mode

// Row mode, one chunk: combines the reduced elements [begin, end) of output o (whose elements start at base).
template <class T, class A, class Rule>
A reduce_row_chunk(const T* base, const ReduceGeometry& g, int64_t begin, int64_t end, int64_t o,
                   const Rule& rule) {
  A lanes[kLanes];
  for (A& lane : lanes) lane = rule.identity();
  A acc = rule.identity();
  for_each_run(g.reduced_sizes, g.reduced_strides, begin, end,
               [&](int64_t offset, int64_t n, int64_t stride) {
                 const T* p = base + offset;
                 int64_t j = 0;
                 if (stride == 1) {
                   for (; j + kLanes <= n; j += kLanes)
                     for (int64_t l = 0; l < kLanes; ++l)
                       lanes[l] = rule.combine(lanes[l], rule.load(convert<A>(p[j + l]), o));
                 }
                 for (; j < n; ++j) acc = rule.combine(acc, rule.load(convert<A>(p[j * stride]), o));
               });
  return rule.combine(combine_pairwise(lanes, kLanes, 1, rule), acc);
}

template <class T, class A, class Rule>
void reduce_rows(const T* x, const ReduceGeometry& g, const Rule& rule, A* result) {
  const int64_t chunks = (g.n_reduced + kRowChunk - 1) / kRowChunk;
  const bool parallel = g.n_out * g.n_reduced >= 2 * kParallelGrain;
  if (chunks <= 1) {
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t o = 0; o < g.n_out; ++o) {
      const T* base = x + offset_of(o, g.kept_sizes, g.kept_strides);
      result[o] = reduce_row_chunk<T, A>(base, g, 0, g.n_reduced, o, rule);
    }
    return;
  }
  std::vector<A> partial(static_cast<size_t>(g.n_out * chunks));
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t unit = 0; unit < g.n_out * chunks; ++unit) {
    const int64_t o = unit / chunks, chunk = unit % chunks;
    const T* base = x + offset_of(o, g.kept_sizes, g.kept_strides);
    const int64_t begin = chunk * kRowChunk, end = std::min(begin + kRowChunk, g.n_reduced);
    partial[static_cast<size_t>(unit)] = reduce_row_chunk<T, A>(base, g, begin, end, o, rule);
  }
  for (int64_t o = 0; o < g.n_out; ++o)
    result[o] = combine_pairwise(partial.data() + o * chunks, chunks, 1, rule);
}

#if defined(__AVX512F__)
// Column mode's sum of n rows (row k at first + k * stride, width contiguous values) into float sums
// acc[0, width), for every dtype that sums in float (f32, f16, bf16). Each column is summed in order of k as
// the generic loop does (the same bits), with the running sums of up to 256 columns held in registers while
// the rows stream past, each row read as one run. The generic loop added every row into acc in memory
// (widening a 16-bit row into a buffer first): 2-3x the loads and stores. Bias gradients are such sums.
template <int kVectors, class T>
void add_rows_in_registers(const T* first, int64_t n, int64_t stride, float* acc) {
  __m512 sums[kVectors];
#pragma GCC unroll 16
  for (int v = 0; v < kVectors; ++v) sums[v] = _mm512_loadu_ps(acc + 16 * v);
  for (int64_t k = 0; k < n; ++k) {
    const T* row = first + k * stride;
#pragma GCC unroll 16
    for (int v = 0; v < kVectors; ++v) sums[v] = _mm512_add_ps(sums[v], load16_as_float(row + 16 * v));
  }
#pragma GCC unroll 16
  for (int v = 0; v < kVectors; ++v) _mm512_storeu_ps(acc + 16 * v, sums[v]);
}

template <class T>
void add_rows_in_float(const T* first, int64_t n, int64_t stride, int64_t width, float* acc) {
  int64_t c = 0;
  for (; c + 256 <= width; c += 256) add_rows_in_registers<16>(first + c, n, stride, acc + c);
  for (; c + 64 <= width; c += 64) add_rows_in_registers<4>(first + c, n, stride, acc + c);
  for (; c + 16 <= width; c += 16) add_rows_in_registers<1>(first + c, n, stride, acc + c);
  for (; c < width; ++c)
    for (int64_t k = 0; k < n; ++k) acc[c] += convert<float>(first[k * stride + c]);
}
#endif

// Column mode: the innermost kept dim (C outputs, x stride cs) is accumulated as a block while the reduced
// rows stream past. Outputs o = outer * C + c.
template <class T, class A, class Rule>
void reduce_columns(const T* x, const ReduceGeometry& g, const Rule& rule, A* result) {
  const int64_t C = g.kept_sizes.back(), cs = g.kept_strides.back();
  const Shape outer_sizes(g.kept_sizes.begin(), g.kept_sizes.end() - 1);
  const Strides outer_strides(g.kept_strides.begin(), g.kept_strides.end() - 1);
  const int64_t n_outer = g.n_out / C;
  const int64_t chunks = (g.n_reduced + kColumnChunk - 1) / kColumnChunk;
  const int64_t blocks = (C + kColumnBlock - 1) / kColumnBlock;
  std::vector<A> partial(chunks > 1 ? static_cast<size_t>(n_outer * chunks * C) : 0);
  const bool parallel = g.n_out * g.n_reduced >= 2 * kParallelGrain;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t unit = 0; unit < n_outer * chunks * blocks; ++unit) {
    const int64_t block = unit % blocks, chunk = unit / blocks % chunks, outer = unit / blocks / chunks;
    const int64_t c0 = block * kColumnBlock, width = std::min(kColumnBlock, C - c0);
    const T* base = x + (outer_sizes.empty() ? 0 : offset_of(outer, outer_sizes, outer_strides)) + c0 * cs;
    const int64_t o0 = outer * C + c0;
    A acc[kColumnBlock];
    for (int64_t c = 0; c < width; ++c) acc[c] = rule.identity();
    const int64_t begin = chunk * kColumnChunk, end = std::min(begin + kColumnChunk, g.n_reduced);
    for_each_run(g.reduced_sizes, g.reduced_strides, begin, end,
                 [&](int64_t offset, int64_t n, int64_t stride) {
#if defined(__AVX512F__)
                   if constexpr (std::is_same_v<Rule, SumRule<float>>) {
                     if (cs == 1) return add_rows_in_float(base + offset, n, stride, width, acc);
                   }
#endif
                   for (int64_t k = 0; k < n; ++k) {
                     const T* row = base + offset + k * stride;
                     if constexpr (kSixteenBit<T>) {
                       if (cs == 1) {  // a row block widened in one vectorised pass (convert_block.h)
                         alignas(64) float wide[kColumnBlock];
                         widen_block(row, wide, width);
                         for (int64_t c = 0; c < width; ++c)
                           acc[c] = rule.combine(acc[c], rule.load(wide[c], o0 + c));
                         continue;
                       }
                     }
                     if (cs == 1) {
                       for (int64_t c = 0; c < width; ++c)
                         acc[c] = rule.combine(acc[c], rule.load(convert<A>(row[c]), o0 + c));
                     } else {
                       for (int64_t c = 0; c < width; ++c)
                         acc[c] = rule.combine(acc[c], rule.load(convert<A>(row[c * cs]), o0 + c));
                     }
                   }
                 });
    A* dest = chunks > 1 ? partial.data() + (outer * chunks + chunk) * C + c0 : result + o0;
    std::copy(acc, acc + width, dest);
  }
  if (chunks <= 1) return;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t o = 0; o < g.n_out; ++o) {
    const int64_t outer = o / C, c = o % C;
    result[o] = combine_pairwise(partial.data() + outer * chunks * C + c, chunks, C, rule);
  }
}

// Runs the reduction in the loop order that reads memory in order.
template <class T, class A, class Rule>
void reduce_into(const T* x, const ReduceGeometry& g, const Rule& rule, A* result) {
  if (g.n_out == 0) return;
  if (g.n_reduced == 0) {
    std::fill(result, result + g.n_out, rule.identity());
    return;
  }
  const bool columns = g.kept_sizes.back() > 1 &&
                       std::abs(g.kept_strides.back()) < std::abs(g.reduced_strides.back()) &&
                       g.reduced_sizes.back() > 1;
  if (columns)
    reduce_columns<T, A>(x, g, rule, result);
  else
    reduce_rows<T, A>(x, g, rule, result);
}

}  // namespace

void CpuBackend::reduce_kernel(ReduceOp op, const Tensor& x, const std::vector<int64_t>& dims, const Tensor& out) {
  const ReduceGeometry g = reduce_geometry(x, dims);
  dispatch_float(x.dtype(), "reduce", [&]<typename T>() {
    using A = acc_t<T>;
    std::vector<A> result(static_cast<size_t>(g.n_out));
    const T* in = x.data<T>();
    switch (op) {
      case ReduceOp::Sum:
      case ReduceOp::Mean:
        reduce_into<T, A>(in, g, SumRule<A>{}, result.data());
        break;
      case ReduceOp::Max:
        reduce_into<T, A>(in, g, MaxRule<A>{}, result.data());
        break;
      case ReduceOp::Min:
        reduce_into<T, A>(in, g, MinRule<A>{}, result.data());
        break;
    }
    // mean = sum / n in the accumulation type, then one rounding (n == 0 gives NaN, as in torch).
    if (op == ReduceOp::Mean)
      for (A& r : result) r /= static_cast<A>(g.n_reduced);
    T* o = out.data<T>();
    for (int64_t i = 0; i < g.n_out; ++i) o[i] = convert<T>(result[i]);
  });
}

void CpuBackend::var_kernel(const Tensor& x, const std::vector<int64_t>& dims, int64_t correction, const Tensor& out) {
  const ReduceGeometry g = reduce_geometry(x, dims);
  dispatch_float(x.dtype(), "var", [&]<typename T>() {
    using A = acc_t<T>;
    // Two passes: the mean first, then the sum of squared deviations from it. One pass (E[x^2] - E[x]^2)
    // cancels catastrophically when |mean| >> std; the second pass costs one more read of x.
    std::vector<A> mean(static_cast<size_t>(g.n_out)), squares(static_cast<size_t>(g.n_out));
    const T* in = x.data<T>();
    reduce_into<T, A>(in, g, SumRule<A>{}, mean.data());
    for (A& m : mean) m /= static_cast<A>(g.n_reduced);
    reduce_into<T, A>(in, g, SquaredDeviationRule<A>{mean.data()}, squares.data());
    // Divide by max(0, n - correction): n <= correction gives Inf or NaN, as in torch.
    const A divisor = static_cast<A>(std::max<int64_t>(0, g.n_reduced - correction));
    T* o = out.data<T>();
    for (int64_t i = 0; i < g.n_out; ++i) o[i] = convert<T>(squares[i] / divisor);
  });
}

// ---- softmax ----------------------------------------------------------------------------------------------
// Rows along `dim`: every other index picks one row. Each tensor steps along the row with its own stride, and
// the row starts are found from the other dims (sizes shared, strides per tensor).

namespace {

struct SoftmaxRows {
  int64_t length = 1;                  // elements in a row
  int64_t count = 0;                   // number of rows
  Shape other_sizes;                   // the dims other than `dim` (a single 1 when there are none)
  std::vector<Strides> other_strides;  // per tensor
  std::vector<int64_t> row_strides;    // per tensor: the stride along `dim`

  SoftmaxRows(const std::vector<const Tensor*>& tensors, int64_t dim) {
    const Tensor& first = *tensors.front();
    length = first.shape()[dim];
    count = length == 0 ? 0 : first.numel() / length;
    other_strides.resize(tensors.size());
    for (int64_t d = 0; d < first.dim(); ++d) {
      if (d == dim) continue;
      other_sizes.push_back(first.shape()[d]);
      for (size_t k = 0; k < tensors.size(); ++k) other_strides[k].push_back(tensors[k]->strides()[d]);
    }
    if (other_sizes.empty()) {
      other_sizes.push_back(1);
      for (Strides& s : other_strides) s.push_back(0);
    }
    for (const Tensor* t : tensors) row_strides.push_back(t->strides()[dim]);
  }
  int64_t start(int64_t row, size_t tensor) const {
    return offset_of(row, other_sizes, other_strides[tensor]);
  }
  bool parallel() const { return count > 1 && count * length >= 2 * kParallelGrain; }
};

}  // namespace

void CpuBackend::softmax_kernel(const Tensor& x, int64_t dim, bool log, const Tensor& out) {
  const SoftmaxRows rows({&x, &out}, dim);
  const int64_t n = rows.length, sx = rows.row_strides[0], so = rows.row_strides[1];
  dispatch_float(x.dtype(), "softmax", [&]<typename T>() {
    using A = acc_t<T>;
    const T* in = x.data<T>();
    T* o = out.data<T>();
#pragma omp parallel if (rows.parallel())
    {
      std::vector<A> e(static_cast<size_t>(n));  // the row in the accumulation type, then exp(x - max)
#pragma omp for schedule(static)
      for (int64_t r = 0; r < rows.count; ++r) {
        const T* xr = in + rows.start(r, 0);
        T* yr = o + rows.start(r, 1);
        // Subtracting the row max m makes every exponent <= 0: no overflow, and the largest term is exactly 1
        // so the sum is >= 1 (no underflow to 0). softmax is unchanged: exp(x - m) / sum exp(x - m).
        for (int64_t j = 0; j < n; ++j) e[j] = convert<A>(xr[j * sx]);
        const A m = lane_max(e.data(), n);
        const int64_t argmax = std::find(e.begin(), e.begin() + n, m) - e.begin();  // n when m is NaN or -inf
        // sum = 1 + rest, with rest the sum of the terms other than (one) maximum. Keeping the 1 apart lets
        // log_softmax use log1p(rest): for a confident row (rest << 1), log(1 + rest) rounded in float would
        // lose all the digits of rest below 2^-24.
        if (log) {
          // log_softmax_j = (x_j - m) - log1p(rest)
          const A rest =
              lane_sum<A>(n, [&](int64_t j) { return j == argmax ? A(0) : fast_exp(e[j] - m); });
          const A log_total = std::log1p(rest);
          for (int64_t j = 0; j < n; ++j) yr[j * so] = convert<T>((e[j] - m) - log_total);
        } else {
          // softmax_j = exp(x_j - m) / (1 + rest)
          for (int64_t j = 0; j < n; ++j) e[j] = fast_exp(e[j] - m);
          const A rest = lane_sum<A>(n, [&](int64_t j) { return j == argmax ? A(0) : e[j]; });
          const A total = A(1) + rest;
          for (int64_t j = 0; j < n; ++j) yr[j * so] = convert<T>(e[j] / total);
        }
      }
    }
  });
}

void CpuBackend::softmax_backward_kernel(const Tensor& y, const Tensor& grad_y, int64_t dim, bool log,
                                         const Tensor& grad_x) {
  const SoftmaxRows rows({&y, &grad_y, &grad_x}, dim);
  const int64_t n = rows.length, sy = rows.row_strides[0], sg = rows.row_strides[1], sd = rows.row_strides[2];
  dispatch_float(y.dtype(), "softmax_backward", [&]<typename T>() {
    using A = acc_t<T>;
    const T* yp = y.data<T>();
    const T* gp = grad_y.data<T>();
    T* dp = grad_x.data<T>();
#pragma omp parallel for schedule(static) if (rows.parallel())
    for (int64_t r = 0; r < rows.count; ++r) {
      const T* yr = yp + rows.start(r, 0);
      const T* gr = gp + rows.start(r, 1);
      T* dr = dp + rows.start(r, 2);
      if (log) {
        // y = log_softmax(x): dx_j = g_j - softmax_j * sum_k g_k, with softmax_j = exp(y_j)
        A total = 0;
        for (int64_t j = 0; j < n; ++j) total += convert<A>(gr[j * sg]);
        for (int64_t j = 0; j < n; ++j)
          dr[j * sd] = convert<T>(convert<A>(gr[j * sg]) - fast_exp(convert<A>(yr[j * sy])) * total);
      } else {
        // y = softmax(x): dy_j/dx_i = y_j (delta_ij - y_i), so dx_j = y_j (g_j - sum_k g_k y_k)
        A dot = 0;
        for (int64_t j = 0; j < n; ++j) dot += convert<A>(gr[j * sg]) * convert<A>(yr[j * sy]);
        for (int64_t j = 0; j < n; ++j)
          dr[j * sd] = convert<T>(convert<A>(yr[j * sy]) * (convert<A>(gr[j * sg]) - dot));
      }
    }
  });
}

}  // namespace mixtape::cpu
