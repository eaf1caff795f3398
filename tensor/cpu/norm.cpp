// Fused layer_norm / rms_norm (forward and backward) and dropout on the CPU.
//
// The norms take x as [N, C] contiguous rows (the front end makes it so). Forward works one row at a time:
// the statistics need two reads of the row and the output one more, but a row (C * 4 bytes, a few KiB) stays
// in L1/L2 between them, so memory sees x read once and out written once. Rows are split across threads.
// Backward computes grad_x row by row and accumulates grad_weight / grad_bias over rows into partial sums,
// one per fixed block of rows, combined in a fixed order at the end: the result is bitwise the same for any
// thread count. f16/bf16 compute in float, f64 in double; mean and rstd are stored in f32 (f64 for f64).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "tensor/cpu/convert_block.h"
#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/lane_sum.h"
#include "tensor/cpu/scratch.h"
#include "tensor/cpu/strided.h"
#include "tensor/random.h"

namespace mixtape::cpu {

namespace {

// A weight (or bias) in the accumulation type, `missing` (1 for a weight, 0 for a bias) where there is none:
// converted once per call, so the row loops below have no 16-bit conversion of it.
// This array, the backward's per-block partial sums and the per-thread rows (ThreadScratch) come from the
// caching allocator: 64-byte aligned, and no heap growing and trimming between calls. In std::vectors (16-byte
// aligned) most of their 64-byte loads and stores would straddle two cache lines, which costs the bf16
// backward about twice its time. The values are the same either way.
template <class T, class A = acc_t<T>>
Tensor values_or(const Tensor& t, int64_t C, A missing) {
  Tensor values = Tensor::empty({C}, dtype_of<A>::value);
  A* v = values.data<A>();
  const T* p = t.defined() ? t.data<T>() : nullptr;
  for (int64_t j = 0; j < C; ++j) v[j] = p ? convert<A>(p[j]) : missing;
  return values;
}

template <class T, class A = acc_t<T>>
Tensor weight_values(const Tensor& weight, int64_t C) {
  return values_or<T>(weight, C, A(1));
}

// One thread's access to the rows. For f16/bf16 row i is widened into a float buffer once (and its result
// narrowed once, after): the row loops then read and write float, as for f32, and vectorise. Converting
// element by element inside them would keep them scalar (fp16's conversion does not vectorise there); the
// values are the same either way. Other dtypes are read and written in place. The buffers are
// carved from the thread's part of a ThreadScratch (on cache lines, see values_or).
template <class T>
class RowAccess {
 public:
  static constexpr bool kWiden = kSixteenBit<T>;
  RowAccess(ScratchCarver& carver, int64_t C)
      : C_(C),
        x_(carver.take<float>(kWiden ? C : 0)),
        g_(carver.take<float>(kWiden ? C : 0)),
        out_(carver.take<float>(kWiden ? C : 0)) {}

  // body(x_i, g_i, out_i) on row i of x, g (may be null) and out (may be null: then out_i is null too).
  template <class Body>
  void row(int64_t i, const T* x, const T* g, T* out, Body&& body) {
    if constexpr (kWiden) {
      widen_block(x + i * C_, x_, C_);
      if (g) widen_block(g + i * C_, g_, C_);
      body(static_cast<const float*>(x_), g ? static_cast<const float*>(g_) : nullptr, out ? out_ : nullptr);
      if (out) narrow_block(out_, out + i * C_, C_);
    } else {
      body(x + i * C_, g ? g + i * C_ : nullptr, out ? out + i * C_ : nullptr);
    }
  }

 private:
  int64_t C_;
  float *x_, *g_, *out_;
};

// body(rows, u) for u in [0, units), split across threads when `parallel`, each thread with its RowAccess.
template <class T, class Body>
void for_each_unit(int64_t units, int64_t C, bool parallel, Body&& body) {
  const ThreadScratch scratch(scratch_bytes<RowAccess<T>>(C), parallel);
#pragma omp parallel if (parallel)
  {
    ScratchCarver carver = scratch.carver();
    RowAccess<T> rows(carver, C);
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; ++u) body(rows, u);
  }
}

// The last pass of the backward over one row: writes dx (when wanted) and accumulates this row's share of
// dw (and db). The pointers never overlap (restrict), which lets the loop vectorise.
//   dx_j = rstd * (w_j g_j - mean(dnorm) - norm_j * mean(dnorm * norm)),  dw_j += g_j norm_j,  db_j += g_j
template <class T, class A>
inline void layer_norm_backward_row(const T* __restrict x, const T* __restrict g, const A* __restrict w,
                                    A mean, A rstd, A dnorm_mean, A dnorm_norm_mean, T* __restrict dx,
                                    A* __restrict dw, A* __restrict db, int64_t C) {
  if (dx) {
    for (int64_t j = 0; j < C; ++j) {
      const A gj = convert<A>(g[j]), norm = (convert<A>(x[j]) - mean) * rstd;
      dx[j] = convert<T>(rstd * (w[j] * gj - dnorm_mean - norm * dnorm_norm_mean));
      dw[j] += gj * norm;
      db[j] += gj;
    }
  } else {
    for (int64_t j = 0; j < C; ++j) {
      const A gj = convert<A>(g[j]);
      dw[j] += gj * ((convert<A>(x[j]) - mean) * rstd);
      db[j] += gj;
    }
  }
}

//   dx_j = rstd * (w_j g_j - norm_j * mean(dnorm * norm)),  dw_j += g_j norm_j
template <class T, class A>
inline void rms_norm_backward_row(const T* __restrict x, const T* __restrict g, const A* __restrict w, A rstd,
                                  A dnorm_norm_mean, T* __restrict dx, A* __restrict dw, int64_t C) {
  if (dx) {
    for (int64_t j = 0; j < C; ++j) {
      const A gj = convert<A>(g[j]), norm = convert<A>(x[j]) * rstd;
      dx[j] = convert<T>(rstd * (w[j] * gj - norm * dnorm_norm_mean));
      dw[j] += gj * norm;
    }
  } else {
    for (int64_t j = 0; j < C; ++j) dw[j] += convert<A>(g[j]) * (convert<A>(x[j]) * rstd);
  }
}

// Rows of a backward pass are grouped into at most kMaxRowBlocks blocks whose size depends only on N; each
// block accumulates its own grad_weight / grad_bias partial, so the combination order never depends on the
// thread count.
constexpr int64_t kMaxRowBlocks = 64;
inline int64_t rows_per_block(int64_t N) {
  return std::max<int64_t>(16, (N + kMaxRowBlocks - 1) / kMaxRowBlocks);
}

inline bool parallel_rows(int64_t N, int64_t C) { return N > 1 && N * C >= 2 * kParallelGrain; }

// Sums the per-block partials [blocks, C] into dest[C], pairwise over blocks (a tree of whole rows, so the
// inner loop runs along C), rounding once. Overwrites `partial`.
template <class T, class A>
void combine_partials(A* partial, int64_t blocks, int64_t C, T* dest) {
  for (int64_t width = 1; width < blocks; width *= 2)
    for (int64_t b = 0; b + width < blocks; b += 2 * width) {
      A* into = partial + b * C;
      const A* from = partial + (b + width) * C;
      for (int64_t c = 0; c < C; ++c) into[c] += from[c];
    }
  for (int64_t c = 0; c < C; ++c) dest[c] = convert<T>(blocks > 0 ? partial[c] : A(0));
}

}  // namespace

// ---- layer_norm ------------------------------------------------------------------------------------------

void CpuBackend::layer_norm_kernel(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                                   const Tensor& out, const Tensor& mean, const Tensor& rstd) {
  const int64_t N = x.shape()[0], C = x.shape()[1];
  dispatch_float(x.dtype(), "layer_norm", [&]<typename T>() {
    using A = acc_t<T>;
    const T* xp = x.data<T>();
    const Tensor wv = weight_values<T>(weight, C), bv = values_or<T>(bias, C, A(0));
    const A* w = weight.defined() ? wv.data<A>() : nullptr;
    const A* b = bias.defined() ? bv.data<A>() : nullptr;
    T* op = out.data<T>();
    A* mean_out = mean.defined() ? mean.data<A>() : nullptr;
    A* rstd_out = rstd.defined() ? rstd.data<A>() : nullptr;
    const A inv_C = A(1) / static_cast<A>(C);
    for_each_unit<T>(N, C, parallel_rows(N, C), [&](RowAccess<T>& rows, int64_t i) {
      rows.row(i, xp, nullptr, op, [&](const auto* xi, const auto*, auto* oi) {
        using O = std::remove_pointer_t<decltype(oi)>;
        // The statistics of the row shifted by its first element: x_j - x_0 is exact for the nearby values
        // that make a large mean, so neither the mean nor the variance loses digits when |mean| >> std.
        //   mean = x_0 + dm,  dm = 1/C sum_j (x_j - x_0);  var = 1/C sum_j (x_j - x_0 - dm)^2  (two passes)
        const A shift = C > 0 ? convert<A>(xi[0]) : A(0);
        const A dm = lane_sum<A>(C, [&](int64_t j) { return convert<A>(xi[j]) - shift; }) * inv_C;
        const A v = lane_sum<A>(C,
                                [&](int64_t j) {
                                  const A d = (convert<A>(xi[j]) - shift) - dm;
                                  return d * d;
                                }) *
                    inv_C;
        // rstd = 1 / sqrt(var + eps);  out_j = (x_j - mean) * rstd * w_j + b_j
        const A s = A(1) / std::sqrt(v + static_cast<A>(eps));
        auto normalized = [&](int64_t j) { return ((convert<A>(xi[j]) - shift) - dm) * s; };
        if (w && b) {
          for (int64_t j = 0; j < C; ++j) oi[j] = convert<O>(normalized(j) * w[j] + b[j]);
        } else if (w) {
          for (int64_t j = 0; j < C; ++j) oi[j] = convert<O>(normalized(j) * w[j]);
        } else if (b) {
          for (int64_t j = 0; j < C; ++j) oi[j] = convert<O>(normalized(j) + b[j]);
        } else {
          for (int64_t j = 0; j < C; ++j) oi[j] = convert<O>(normalized(j));
        }
        if (mean_out) mean_out[i] = shift + dm;
        if (rstd_out) rstd_out[i] = s;
      });
    });
  });
}

void CpuBackend::layer_norm_backward_kernel(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                                            const Tensor& mean, const Tensor& rstd, const Tensor& grad_x,
                                            const Tensor& grad_weight, const Tensor& grad_bias) {
  const int64_t N = x.shape()[0], C = x.shape()[1];
  dispatch_float(x.dtype(), "layer_norm_backward", [&]<typename T>() {
    using A = acc_t<T>;
    const T* xp = x.data<T>();
    const T* gp = grad_out.data<T>();
    const Tensor wv = weight_values<T>(weight, C);
    const A* w = wv.data<A>();
    const A* mp = mean.data<A>();
    const A* sp = rstd.data<A>();
    T* dxp = grad_x.defined() ? grad_x.data<T>() : nullptr;
    const bool want_w = grad_weight.defined(), want_b = grad_bias.defined();
    const int64_t block_rows = rows_per_block(N);
    const int64_t blocks = (N + block_rows - 1) / block_rows;
    const Tensor partials_w = Tensor::zeros({blocks * C}, dtype_of<A>::value);
    const Tensor partials_b = Tensor::zeros({blocks * C}, dtype_of<A>::value);
    A* const partial_w = partials_w.data<A>();
    A* const partial_b = partials_b.data<A>();
    const A inv_C = A(1) / static_cast<A>(C);
    for_each_unit<T>(blocks, C, parallel_rows(N, C), [&](RowAccess<T>& rows, int64_t block) {
      A* dw = partial_w + block * C;
      A* db = partial_b + block * C;
      for (int64_t i = block * block_rows; i < std::min(N, (block + 1) * block_rows); ++i)
        rows.row(i, xp, gp, dxp, [&](const auto* xi, const auto* gi, auto* dxi) {
          const A m = mp[i], s = sp[i];
          // norm_j = (x_j - mean) * rstd;  dnorm_j = w_j * dout_j
          // dx_j = rstd * (dnorm_j - mean_k(dnorm_k) - norm_j * mean_k(dnorm_k * norm_k))
          const auto [dnorm_sum, dnorm_norm_sum] = lane_sum2<A>(C, [&](int64_t j) {
            const A norm = (convert<A>(xi[j]) - m) * s, dnorm = w[j] * convert<A>(gi[j]);
            return std::pair<A, A>{dnorm, dnorm * norm};
          });
          const A dnorm_mean = dnorm_sum * inv_C, dnorm_norm_mean = dnorm_norm_sum * inv_C;
          // One more pass writes dx and accumulates dw, db.
          layer_norm_backward_row(xi, gi, w, m, s, dnorm_mean, dnorm_norm_mean, dxi, dw, db, C);
        });
    });
    if (want_w) combine_partials<T, A>(partial_w, blocks, C, grad_weight.data<T>());
    if (want_b) combine_partials<T, A>(partial_b, blocks, C, grad_bias.data<T>());
  });
}

// ---- rms_norm --------------------------------------------------------------------------------------------

void CpuBackend::rms_norm_kernel(const Tensor& x, const Tensor& weight, double eps, const Tensor& out,
                                 const Tensor& rstd) {
  const int64_t N = x.shape()[0], C = x.shape()[1];
  dispatch_float(x.dtype(), "rms_norm", [&]<typename T>() {
    using A = acc_t<T>;
    const T* xp = x.data<T>();
    const Tensor wv = weight_values<T>(weight, C);
    const A* w = weight.defined() ? wv.data<A>() : nullptr;
    T* op = out.data<T>();
    A* rstd_out = rstd.defined() ? rstd.data<A>() : nullptr;
    const A inv_C = A(1) / static_cast<A>(C);
    for_each_unit<T>(N, C, parallel_rows(N, C), [&](RowAccess<T>& rows, int64_t i) {
      rows.row(i, xp, nullptr, op, [&](const auto* xi, const auto*, auto* oi) {
        using O = std::remove_pointer_t<decltype(oi)>;
        // rstd = 1 / sqrt(1/C sum_j x_j^2 + eps);  out_j = x_j * rstd * w_j
        const A ms = lane_sum<A>(C,
                                 [&](int64_t j) {
                                   const A v = convert<A>(xi[j]);
                                   return v * v;
                                 }) *
                     inv_C;
        const A s = A(1) / std::sqrt(ms + static_cast<A>(eps));
        if (w) {
          for (int64_t j = 0; j < C; ++j) oi[j] = convert<O>(convert<A>(xi[j]) * s * w[j]);
        } else {
          for (int64_t j = 0; j < C; ++j) oi[j] = convert<O>(convert<A>(xi[j]) * s);
        }
        if (rstd_out) rstd_out[i] = s;
      });
    });
  });
}

void CpuBackend::rms_norm_backward_kernel(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                                          const Tensor& rstd, const Tensor& grad_x, const Tensor& grad_weight) {
  const int64_t N = x.shape()[0], C = x.shape()[1];
  dispatch_float(x.dtype(), "rms_norm_backward", [&]<typename T>() {
    using A = acc_t<T>;
    const T* xp = x.data<T>();
    const T* gp = grad_out.data<T>();
    const Tensor wv = weight_values<T>(weight, C);
    const A* w = wv.data<A>();
    const A* sp = rstd.data<A>();
    T* dxp = grad_x.defined() ? grad_x.data<T>() : nullptr;
    const bool want_w = grad_weight.defined();
    const int64_t block_rows = rows_per_block(N);
    const int64_t blocks = (N + block_rows - 1) / block_rows;
    const Tensor partials_w = Tensor::zeros({blocks * C}, dtype_of<A>::value);
    A* const partial_w = partials_w.data<A>();
    const A inv_C = A(1) / static_cast<A>(C);
    for_each_unit<T>(blocks, C, parallel_rows(N, C), [&](RowAccess<T>& rows, int64_t block) {
      A* dw = partial_w + block * C;
      for (int64_t i = block * block_rows; i < std::min(N, (block + 1) * block_rows); ++i)
        rows.row(i, xp, gp, dxp, [&](const auto* xi, const auto* gi, auto* dxi) {
          const A s = sp[i];
          // norm_j = x_j * rstd;  dnorm_j = w_j * dout_j;  d rstd / dx_j = -rstd^3 x_j / C, so
          // dx_j = rstd * (dnorm_j - norm_j * mean_k(dnorm_k * norm_k))
          const A dnorm_norm_mean =
              lane_sum<A>(C, [&](int64_t j) { return w[j] * convert<A>(gi[j]) * (convert<A>(xi[j]) * s); }) *
              inv_C;
          // One more pass writes dx and accumulates dw.
          rms_norm_backward_row(xi, gi, w, s, dnorm_norm_mean, dxi, dw, C);
        });
    });
    if (want_w) combine_partials<T, A>(partial_w, blocks, C, grad_weight.data<T>());
  });
}

// ---- dropout ---------------------------------------------------------------------------------------------

void CpuBackend::dropout_kernel(const Tensor& x, double p, uint64_t seed, uint64_t offset, const Tensor& out) {
  // Element i (row-major index) is kept iff u_i >= p with u_i = uniform(philox(offset + i, key = seed)[0]);
  // kept elements are scaled by 1 / (1 - p) so the expectation is unchanged. The draw depends only on
  // (seed, offset + i): the same on any thread count, and backward recomputes the same mask.
  const StridedLoop<2> loop(out.shape(), {out.strides(), x.strides()});
  dispatch_float(x.dtype(), "dropout", [&]<typename T>() {
    using A = acc_t<T>;
    const A scale = static_cast<A>(1.0 / (1.0 - p));
    // u is a multiple of 2^-24, so u >= p iff u >= (the smallest multiple of 2^-24 that is >= p), which is
    // exact in float; comparing in float keeps the draw loop in 32-bit lanes.
    const float threshold = static_cast<float>(std::ceil(p * 0x1p24) * 0x1p-24);
    T* o = out.data<T>();
    const T* in = x.data<T>();
    const int64_t sx = loop.inner_strides()[1];
    loop.run(
        [&](const std::array<int64_t, 2>& at, int64_t n) {
          // out is contiguous, so its offset is the row-major element index. The uniforms are drawn in blocks
          // in a loop of their own, which the compiler vectorises (Philox is integer multiplies and xors).
          constexpr int64_t kBlock = 256;
          float u[kBlock];
          for (int64_t start = 0; start < n; start += kBlock) {
            const int64_t count = std::min(kBlock, n - start);
            const uint64_t first = offset + static_cast<uint64_t>(at[0] + start);
            for (int64_t k = 0; k < count; ++k)
              u[k] = uniform_from_bits(philox4x32(first + static_cast<uint64_t>(k), 0, seed)[0]);
            T* ok = o + at[0] + start;
            const T* xk = in + at[1] + start * sx;
            if (sx == 1) {
              for (int64_t k = 0; k < count; ++k)
                ok[k] = convert<T>(u[k] >= threshold ? convert<A>(xk[k]) * scale : A(0));
            } else {
              for (int64_t k = 0; k < count; ++k)
                ok[k] = convert<T>(u[k] >= threshold ? convert<A>(xk[k * sx]) * scale : A(0));
            }
          }
        },
        4096);
  });
}

}  // namespace mixtape::cpu
