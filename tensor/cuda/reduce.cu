// Reductions (sum, mean, max, min, var) and softmax / log_softmax on CUDA: the same math and accumulation
// types as tensor/cpu/reduce.cpp (f16/bf16/f32 accumulate in float, f64 in double, one rounding on store).
//
// A reduction is   out[o] = combine_j load(x[kept_offset(o) + reduced_offset(j)])   (the CPU's geometry:
// kept dims and reduced dims, size-1 dims dropped, neighbours merged). Two kernels cover the loop orders:
//  - row mode (the reduced dims are innermost in memory): one warp per (output, chunk of the reduced
//    elements); lanes read consecutive elements (16-byte packs when the run is contiguous and aligned) and
//    combine with a fixed shuffle tree;
//  - column mode (a kept dim is innermost, or rows are too short for a warp): one thread per (chunk, output),
//    adjacent threads on adjacent outputs, so a warp reads consecutive memory.
// When a reduction is split into several chunks, the partial results (acc type) form a new, contiguous
// reduction problem solved by the same kernels, until one chunk is left. Chunk sizes depend on the shape
// only, so results are bitwise reproducible run to run.
//
// softmax / log_softmax / their backward work row by row along `dim`: a warp (short rows) or a block (long
// rows) per row with 16-byte loads when `dim` is the last, contiguous dim; one thread per row otherwise (rows
// next to each other in memory then sit in neighbouring threads).
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "tensor/cuda/common.cuh"
#include "tensor/cuda/cuda_backend.h"
#include "tensor/kernel_geometry.h"

namespace mixtape::cuda {

namespace {

// ---- geometry ---------------------------------------------------------------------------------------------

// x's kept / reduced dims come from reduce_geometry (tensor/kernel_geometry.h), the CPU's own geometry.

// Dims walked in row-major order (sizes, strides in elements).
struct Walk {
  int dims = 1;
  int64_t sizes[kMaxDims] = {1};
  int64_t strides[kMaxDims] = {0};

  __device__ __forceinline__ int64_t offset(int64_t index) const {
    if (dims == 1) return index * strides[0];
    int64_t offset = 0;
    for (int d = dims - 1; d >= 0; --d) {
      offset += (index % sizes[d]) * strides[d];
      index /= sizes[d];
    }
    return offset;
  }
};

Walk make_walk(const Shape& sizes, const Strides& strides, const char* what) {
  check(static_cast<int>(sizes.size()) <= kMaxDims, what, ": tensors with more than ", kMaxDims,
        " non-mergeable dims are not supported on CUDA");
  Walk w;
  w.dims = static_cast<int>(sizes.size());
  for (size_t d = 0; d < sizes.size(); ++d) {
    w.sizes[d] = sizes[d];
    w.strides[d] = strides[d];
  }
  return w;
}

// ---- combining rules (as the CPU's; max/min propagate NaN) ---------------------------------------------

template <class A>
struct SumRule {
  __device__ __forceinline__ A identity() const { return A(0); }
  __device__ __forceinline__ A load(A v, int64_t) const { return v; }
  __device__ __forceinline__ A combine(A a, A b) const { return a + b; }
};

template <class A>
struct MaxRule {
  __device__ __forceinline__ A identity() const { return -std::numeric_limits<A>::infinity(); }
  __device__ __forceinline__ A load(A v, int64_t) const { return v; }
  __device__ __forceinline__ A combine(A a, A b) const { return (a > b || a != a) ? a : b; }
};

template <class A>
struct MinRule {
  __device__ __forceinline__ A identity() const { return std::numeric_limits<A>::infinity(); }
  __device__ __forceinline__ A load(A v, int64_t) const { return v; }
  __device__ __forceinline__ A combine(A a, A b) const { return (a < b || a != a) ? a : b; }
};

// (x - mean[o])^2 summed: the second pass of the two-pass variance.
template <class A>
struct SquaredDeviationRule {
  const A* mean;
  __device__ __forceinline__ A identity() const { return A(0); }
  __device__ __forceinline__ A load(A v, int64_t o) const {
    const A d = v - mean[o];
    return d * d;
  }
  __device__ __forceinline__ A combine(A a, A b) const { return a + b; }
};

// Where a kernel's results go: partial results (acc type, contiguous) or the final output, divided by
// `divisor` when `divide` (mean, var), then stored as Out (rounded once).
template <class A>
struct Sink {
  void* data = nullptr;
  bool acc_output = false;  // data is A*, else the reduction's element type
  bool divide = false;
  A divisor = A(1);
};

template <class D, class A>
__device__ __forceinline__ void emit(const Sink<A>& sink, int64_t index, A value) {
  if (sink.divide) value = value / sink.divisor;
  if (sink.acc_output)
    static_cast<A*>(sink.data)[index] = value;
  else
    static_cast<D*>(sink.data)[index] = store<D>(value);
}

__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

// 16 bytes of elements, for vector loads and stores (tensor/cuda/common.cuh).
using rowwise::aligned16;
using rowwise::Pack;

template <class A, class Rule>
__device__ __forceinline__ A warp_combine(A v, const Rule& rule) {
#pragma unroll
  for (int width = 16; width > 0; width /= 2) v = rule.combine(v, __shfl_down_sync(0xffffffffu, v, width));
  return v;
}

// Row mode: warp w handles unit (o, chunk) = (w / chunks, w % chunks); results go to partial[unit] (A) when
// chunks > 1, else to the sink at o. Contiguous rows are read in 16-byte packs. kLoad: apply rule.load (first stage) or
// combine raw partials. In is the stored element type; D the reduction's element type (for the final store).
template <class In, class D, class A, class Rule, bool kLoad>
__global__ void reduce_rows_kernel(const In* x, Walk kept, Walk reduced, int64_t n_out, int64_t n_reduced,
                                   int64_t chunk, int64_t chunks, Rule rule, A* partial, Sink<A> sink) {
  const int lane = threadIdx.x % 32;
  const int64_t warps_per_block = blockDim.x / 32;
  const bool contiguous = reduced.dims == 1 && reduced.strides[0] == 1;
  const int64_t units = n_out * chunks;
  for (int64_t unit = blockIdx.x * warps_per_block + threadIdx.x / 32; unit < units;
       unit += static_cast<int64_t>(gridDim.x) * warps_per_block) {
    const int64_t o = unit / chunks, c = unit % chunks;
    const In* base = x + kept.offset(o);
    const int64_t begin = c * chunk, end = imin(begin + chunk, n_reduced);
    A acc = rule.identity();
    auto take = [&](In element) {
      const A v = load_as<A>(element);
      if constexpr (kLoad)
        acc = rule.combine(acc, rule.load(v, o));
      else
        acc = rule.combine(acc, v);
    };
    if (contiguous) {
      // 16-byte loads when the chunk starts aligned (chunks are multiples of a pack), then the tail.
      const In* p = base + begin;
      const int64_t length = end - begin;
      int64_t tail = 0;
      if (aligned16(p)) {
        constexpr int V = Pack<In>::kSize;
        const int64_t packs = length / V;
        for (int64_t k = lane; k < packs; k += 32) {
          const Pack<In> pack = reinterpret_cast<const Pack<In>*>(p)[k];
#pragma unroll
          for (int e = 0; e < V; ++e) take(pack.v[e]);
        }
        tail = packs * V;
      }
      for (int64_t j = tail + lane; j < length; j += 32) take(p[j]);
    } else {
      for (int64_t j = begin + lane; j < end; j += 32) take(base[reduced.offset(j)]);
    }
    acc = warp_combine(acc, rule);
    if (lane == 0) {
      if (chunks > 1)
        partial[unit] = acc;
      else
        emit<D>(sink, o, acc);
    }
  }
}

// Column mode: thread t handles unit (chunk, o) = (t / n_out, t % n_out); results go to
// partial[chunk * n_out + o] when chunks > 1, else to the sink at o.
template <class In, class D, class A, class Rule, bool kLoad>
__global__ void reduce_columns_kernel(const In* x, Walk kept, Walk reduced, int64_t n_out, int64_t n_reduced,
                                      int64_t chunk, int64_t chunks, Rule rule, A* partial, Sink<A> sink) {
  const int64_t units = n_out * chunks;
  for (int64_t unit = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; unit < units;
       unit += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = unit / n_out, o = unit % n_out;
    const In* base = x + kept.offset(o);
    const int64_t begin = c * chunk, end = imin(begin + chunk, n_reduced);
    A acc = rule.identity();
    for (int64_t j = begin; j < end; ++j) {
      const A v = load_as<A>(base[reduced.offset(j)]);
      if constexpr (kLoad)
        acc = rule.combine(acc, rule.load(v, o));
      else
        acc = rule.combine(acc, v);
    }
    if (chunks > 1)
      partial[unit] = acc;
    else
      emit<D>(sink, o, acc);
  }
}

constexpr int64_t kRowChunk = 4096;          // reduced elements per warp in row mode
constexpr int64_t kShortRow = 16;            // rows up to this length use the column kernel (a thread each)
constexpr int64_t kColumnThreads = 1 << 17;  // column mode splits the reduction until this many threads run
constexpr int64_t kMinColumnChunk = 64;

// Reduces x (elements In) over geometry g into the sink; Rule for the first stage, CombineRule (the same
// combination without a load transform) for the stages over partial results.
template <class In, class D, class A, class Rule, class CombineRule, bool kLoad>
void run_reduction(CudaBackend& backend, const In* x, const ReduceGeometry& g, const Rule& rule,
                   const CombineRule& combine_rule, const Sink<A>& sink) {
  if (g.n_out == 0) return;
  const cudaStream_t stream = backend.stream();
  const Walk kept = make_walk(g.kept_sizes, g.kept_strides, "reduce");
  const Walk reduced = make_walk(g.reduced_sizes, g.reduced_strides, "reduce");
  const bool columns =
      (g.kept_sizes.back() > 1 && std::abs(g.kept_strides.back()) < std::abs(g.reduced_strides.back()) &&
       g.reduced_sizes.back() > 1) ||
      g.n_reduced <= kShortRow;
  if (columns) {
    int64_t chunk = g.n_reduced < 1 ? 1 : g.n_reduced, chunks = 1;
    if (g.n_out < kColumnThreads && g.n_reduced > kMinColumnChunk) {
      const int64_t wanted = (kColumnThreads + g.n_out - 1) / g.n_out;
      chunk = std::max(kMinColumnChunk, (g.n_reduced + wanted - 1) / wanted);
      chunks = (g.n_reduced + chunk - 1) / chunk;
    }
    Tensor partial;
    if (chunks > 1) partial = Tensor::empty({chunks, g.n_out}, dtype_of<A>::value, Device::cuda(backend.device()));
    A* partial_ptr = chunks > 1 ? static_cast<A*>(partial.data_ptr()) : nullptr;
    reduce_columns_kernel<In, D, A, Rule, kLoad><<<blocks_for(g.n_out * chunks), kThreads, 0, stream>>>(
        x, kept, reduced, g.n_out, g.n_reduced, chunk, chunks, rule, partial_ptr, sink);
    MIXTAPE_KERNEL_CHECK();
    if (chunks > 1) {
      // partial [chunks, n_out]: reduce over dim 0 (column mode again).
      ReduceGeometry next;
      next.kept_sizes = {g.n_out};
      next.kept_strides = {1};
      next.reduced_sizes = {chunks};
      next.reduced_strides = {g.n_out};
      next.n_out = g.n_out;
      next.n_reduced = chunks;
      run_reduction<A, D, A, CombineRule, CombineRule, false>(backend, partial_ptr, next, combine_rule, combine_rule,
                                                              sink);
    }
    return;
  }
  const int64_t chunks = (g.n_reduced + kRowChunk - 1) / kRowChunk;  // n_reduced > kShortRow here
  const int64_t chunk = chunks > 1 ? kRowChunk : g.n_reduced;
  Tensor partial;
  if (chunks > 1) partial = Tensor::empty({g.n_out, chunks}, dtype_of<A>::value, Device::cuda(backend.device()));
  A* partial_ptr = chunks > 1 ? static_cast<A*>(partial.data_ptr()) : nullptr;
  constexpr int kWarpsPerBlock = kThreads / 32;
  reduce_rows_kernel<In, D, A, Rule, kLoad><<<blocks_for(g.n_out * chunks, kWarpsPerBlock), kThreads, 0, stream>>>(
      x, kept, reduced, g.n_out, g.n_reduced, chunk, chunks, rule, partial_ptr, sink);
  MIXTAPE_KERNEL_CHECK();
  if (chunks > 1) {
    // partial [n_out, chunks]: reduce over dim 1 (row mode for many chunks, column mode for a few).
    ReduceGeometry next;
    next.kept_sizes = {g.n_out};
    next.kept_strides = {chunks};
    next.reduced_sizes = {chunks};
    next.reduced_strides = {1};
    next.n_out = g.n_out;
    next.n_reduced = chunks;
    run_reduction<A, D, A, CombineRule, CombineRule, false>(backend, partial_ptr, next, combine_rule, combine_rule,
                                                            sink);
  }
}

// ---- softmax ------------------------------------------------------------------------------------------------

// exp(d) for d = x - max <= 0, as the CPU's fast_exp: float results below e^-87 are exactly 0 (the CPU
// flushes them), NaN stays NaN; f64 uses exp.
__device__ __forceinline__ float softmax_exp(float d) { return d < -87.0f ? 0.0f : expf(d); }
__device__ __forceinline__ double softmax_exp(double d) { return exp(d); }
__device__ __forceinline__ float log1p_acc(float v) { return log1pf(v); }
__device__ __forceinline__ double log1p_acc(double v) { return log1p(v); }

template <class A>
struct MaxNumOp {  // both operands are never NaN here
  __device__ __forceinline__ A operator()(A a, A b) const { return a > b ? a : b; }
};
template <class A>
struct AddOp {
  __device__ __forceinline__ A operator()(A a, A b) const { return a + b; }
};

// Combines one value per thread of a row's group (a warp, or the whole block when kBlock) with a fixed
// butterfly tree; every thread of the group gets the same result. `shared` holds 32 values.
template <bool kBlock, class A, class Op>
__device__ __forceinline__ A group_reduce(A v, Op op, A* shared) {
#pragma unroll
  for (int width = 16; width > 0; width /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, width));
  if constexpr (kBlock) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    __syncthreads();  // the previous reduction's readers are done with `shared`
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = shared[0];
    for (int k = 1; k < warps; ++k) v = op(v, shared[k]);
  }
  return v;
}

// Calls f(j, in[j]) for the row elements j this thread owns (packs of 16 bytes when `vec`, then the tail).
template <class D, class F>
__device__ __forceinline__ void for_row(const D* in, int64_t n, bool vec, int tid, int nthreads, F&& f) {
  constexpr int V = Pack<D>::kSize;
  int64_t tail = 0;
  if (vec) {
    const int64_t packs = n / V;
    for (int64_t k = tid; k < packs; k += nthreads) {
      const Pack<D> p = reinterpret_cast<const Pack<D>*>(in)[k];
#pragma unroll
      for (int e = 0; e < V; ++e) f(k * V + e, p.v[e]);
    }
    tail = packs * V;
  }
  for (int64_t j = tail + tid; j < n; j += nthreads) f(j, in[j]);
}

// f(j, a[j], b[j]) over the row (both rows contiguous; packs when `vec`).
template <class D, class F>
__device__ __forceinline__ void for_row2(const D* a, const D* b, int64_t n, bool vec, int tid, int nthreads, F&& f) {
  constexpr int V = Pack<D>::kSize;
  int64_t tail = 0;
  if (vec) {
    const int64_t packs = n / V;
    for (int64_t k = tid; k < packs; k += nthreads) {
      const Pack<D> pa = reinterpret_cast<const Pack<D>*>(a)[k];
      const Pack<D> pb = reinterpret_cast<const Pack<D>*>(b)[k];
#pragma unroll
      for (int e = 0; e < V; ++e) f(k * V + e, pa.v[e], pb.v[e]);
    }
    tail = packs * V;
  }
  for (int64_t j = tail + tid; j < n; j += nthreads) f(j, a[j], b[j]);
}

// out[j] = f(in[j]) over the row.
template <class D, class F>
__device__ __forceinline__ void map_row(const D* in, D* out, int64_t n, bool vec, int tid, int nthreads, F&& f) {
  constexpr int V = Pack<D>::kSize;
  int64_t tail = 0;
  if (vec) {
    const int64_t packs = n / V;
    for (int64_t k = tid; k < packs; k += nthreads) {
      const Pack<D> p = reinterpret_cast<const Pack<D>*>(in)[k];
      Pack<D> q;
#pragma unroll
      for (int e = 0; e < V; ++e) q.v[e] = f(p.v[e]);
      reinterpret_cast<Pack<D>*>(out)[k] = q;
    }
    tail = packs * V;
  }
  for (int64_t j = tail + tid; j < n; j += nthreads) out[j] = f(in[j]);
}

// out[j] = f(a[j], b[j]) over the row.
template <class D, class F>
__device__ __forceinline__ void map_row2(const D* a, const D* b, D* out, int64_t n, bool vec, int tid, int nthreads,
                                         F&& f) {
  constexpr int V = Pack<D>::kSize;
  int64_t tail = 0;
  if (vec) {
    const int64_t packs = n / V;
    for (int64_t k = tid; k < packs; k += nthreads) {
      const Pack<D> pa = reinterpret_cast<const Pack<D>*>(a)[k];
      const Pack<D> pb = reinterpret_cast<const Pack<D>*>(b)[k];
      Pack<D> q;
#pragma unroll
      for (int e = 0; e < V; ++e) q.v[e] = f(pa.v[e], pb.v[e]);
      reinterpret_cast<Pack<D>*>(out)[k] = q;
    }
    tail = packs * V;
  }
  for (int64_t j = tail + tid; j < n; j += nthreads) out[j] = f(a[j], b[j]);
}

// The rows of one launch: group g of this block, the row loop, and this thread's place in its group.
template <bool kBlock>
struct RowGroup {
  __device__ __forceinline__ static int64_t groups_per_block() { return kBlock ? 1 : blockDim.x / 32; }
  __device__ __forceinline__ static int64_t first_row() {
    return blockIdx.x * groups_per_block() + (kBlock ? 0 : threadIdx.x / 32);
  }
  __device__ __forceinline__ static int64_t row_step() { return static_cast<int64_t>(gridDim.x) * groups_per_block(); }
  __device__ __forceinline__ static int tid() {
    return kBlock ? static_cast<int>(threadIdx.x) : static_cast<int>(threadIdx.x % 32);
  }
  __device__ __forceinline__ static int nthreads() { return kBlock ? static_cast<int>(blockDim.x) : 32; }
};

// Softmax over contiguous rows (dim last, stride 1 in x and y); row starts from `rows` (other dims).
// sum = 1 + rest, with rest the terms other than one maximum (each further maximum adds exactly 1): the 1
// kept apart lets log_softmax use log1p(rest), as the CPU does.
constexpr int kMaxRowThreads = 512;  // the largest block a row gets

template <class D, bool kBlock>
__global__ void __launch_bounds__(kMaxRowThreads)
    softmax_rows_kernel(const D* x, D* y, OffsetCalculator<2> rows, int64_t count, int64_t n, bool log) {
  using A = device_acc_t<D>;
  using G = RowGroup<kBlock>;
  __shared__ A shared[32];
  const int tid = G::tid(), nthreads = G::nthreads();
  for (int64_t r = G::first_row(); r < count; r += G::row_step()) {
    int64_t off[2];
    rows.offsets(r, off);
    const D* xr = x + off[0];
    D* yr = y + off[1];
    const bool vec = aligned16(xr) && aligned16(yr);
    // The row max, ignoring NaN (a NaN element still makes its row NaN through the sum below).
    A m = -std::numeric_limits<A>::infinity();
    for_row(xr, n, vec, tid, nthreads, [&](int64_t, D v) {
      const A a = load_as<A>(v);
      m = a > m ? a : m;
    });
    m = group_reduce<kBlock>(m, MaxNumOp<A>{}, shared);
    A rest = 0, ties = 0;
    for_row(xr, n, vec, tid, nthreads, [&](int64_t, D v) {
      const A a = load_as<A>(v);
      if (a == m)
        ties += A(1);
      else
        rest += softmax_exp(a - m);
    });
    rest = group_reduce<kBlock>(rest, AddOp<A>{}, shared);
    ties = group_reduce<kBlock>(ties, AddOp<A>{}, shared);
    if (ties > A(1)) rest += ties - A(1);
    if (log) {
      const A log_total = log1p_acc(rest);
      map_row(xr, yr, n, vec, tid, nthreads, [&](D v) { return store<D>((load_as<A>(v) - m) - log_total); });
    } else {
      const A total = A(1) + rest;
      map_row(xr, yr, n, vec, tid, nthreads, [&](D v) { return store<D>(softmax_exp(load_as<A>(v) - m) / total); });
    }
  }
}

// Softmax over strided rows: one thread per row (neighbouring rows sit in neighbouring threads).
template <class D>
__global__ void softmax_strided_kernel(const D* x, D* y, OffsetCalculator<2> rows, int64_t count, int64_t n, int64_t sx,
                                       int64_t sy, bool log) {
  using A = device_acc_t<D>;
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; r < count;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t off[2];
    rows.offsets(r, off);
    const D* xr = x + off[0];
    D* yr = y + off[1];
    A m = -std::numeric_limits<A>::infinity();
    for (int64_t j = 0; j < n; ++j) {
      const A a = load_as<A>(xr[j * sx]);
      m = a > m ? a : m;
    }
    A rest = 0, ties = 0;
    for (int64_t j = 0; j < n; ++j) {
      const A a = load_as<A>(xr[j * sx]);
      if (a == m)
        ties += A(1);
      else
        rest += softmax_exp(a - m);
    }
    if (ties > A(1)) rest += ties - A(1);
    if (log) {
      const A log_total = log1p_acc(rest);
      for (int64_t j = 0; j < n; ++j) yr[j * sy] = store<D>((load_as<A>(xr[j * sx]) - m) - log_total);
    } else {
      const A total = A(1) + rest;
      for (int64_t j = 0; j < n; ++j) yr[j * sy] = store<D>(softmax_exp(load_as<A>(xr[j * sx]) - m) / total);
    }
  }
}

// Backward over contiguous rows:
//   log:  dx_j = g_j - exp(y_j) * sum_k g_k          (y = log_softmax(x))
//   else: dx_j = y_j * (g_j - sum_k g_k y_k)          (y = softmax(x))
template <class D, bool kBlock>
__global__ void __launch_bounds__(kMaxRowThreads)
    softmax_backward_rows_kernel(const D* y, const D* g, D* dx, OffsetCalculator<3> rows, int64_t count, int64_t n,
                                 bool log) {
  using A = device_acc_t<D>;
  using G = RowGroup<kBlock>;
  __shared__ A shared[32];
  const int tid = G::tid(), nthreads = G::nthreads();
  for (int64_t r = G::first_row(); r < count; r += G::row_step()) {
    int64_t off[3];
    rows.offsets(r, off);
    const D* yr = y + off[0];
    const D* gr = g + off[1];
    D* dr = dx + off[2];
    const bool vec = aligned16(yr) && aligned16(gr) && aligned16(dr);
    A total = 0;
    if (log)
      for_row(gr, n, vec, tid, nthreads, [&](int64_t, D gv) { total += load_as<A>(gv); });
    else
      for_row2(gr, yr, n, vec, tid, nthreads, [&](int64_t, D gv, D yv) { total += load_as<A>(gv) * load_as<A>(yv); });
    total = group_reduce<kBlock>(total, AddOp<A>{}, shared);
    if (log)
      map_row2(yr, gr, dr, n, vec, tid, nthreads,
               [&](D yv, D gv) { return store<D>(load_as<A>(gv) - softmax_exp(load_as<A>(yv)) * total); });
    else
      map_row2(yr, gr, dr, n, vec, tid, nthreads,
               [&](D yv, D gv) { return store<D>(load_as<A>(yv) * (load_as<A>(gv) - total)); });
  }
}

template <class D>
__global__ void softmax_backward_strided_kernel(const D* y, const D* g, D* dx, OffsetCalculator<3> rows, int64_t count,
                                                int64_t n, int64_t sy, int64_t sg, int64_t sd, bool log) {
  using A = device_acc_t<D>;
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; r < count;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t off[3];
    rows.offsets(r, off);
    const D* yr = y + off[0];
    const D* gr = g + off[1];
    D* dr = dx + off[2];
    A total = 0;
    if (log) {
      for (int64_t j = 0; j < n; ++j) total += load_as<A>(gr[j * sg]);
      for (int64_t j = 0; j < n; ++j)
        dr[j * sd] = store<D>(load_as<A>(gr[j * sg]) - softmax_exp(load_as<A>(yr[j * sy])) * total);
    } else {
      for (int64_t j = 0; j < n; ++j) total += load_as<A>(gr[j * sg]) * load_as<A>(yr[j * sy]);
      for (int64_t j = 0; j < n; ++j) dr[j * sd] = store<D>(load_as<A>(yr[j * sy]) * (load_as<A>(gr[j * sg]) - total));
    }
  }
}

// The dims other than `dim`, with each tensor's strides over them: the row starts.
template <int N>
OffsetCalculator<N> row_starts(const std::array<const Tensor*, N>& tensors, int64_t dim, const char* what) {
  Shape other;
  std::array<Strides, N> strides;
  for (int64_t d = 0; d < tensors[0]->dim(); ++d) {
    if (d == dim) continue;
    other.push_back(tensors[0]->shape()[d]);
    for (int k = 0; k < N; ++k) strides[k].push_back(tensors[k]->strides()[d]);
  }
  return make_offset_calculator<N>(other, strides, what);
}

constexpr int64_t kWarpRowMax = 1024;  // rows up to this length get one warp, longer rows one block

int block_threads_for_row(int64_t n) { return n <= 8192 ? 256 : kMaxRowThreads; }
unsigned blocks_for_rows(int64_t count) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(count, 65535LL * 8)));
}

}  // namespace

void CudaBackend::reduce_kernel(ReduceOp op, const Tensor& x, const std::vector<int64_t>& dims, const Tensor& out) {
  const ReduceGeometry g = reduce_geometry(x, dims);
  dispatch_float(x.dtype(), "reduce", [&]<typename T>() {
    using D = device_t<T>;
    using A = device_acc_t<D>;
    const D* in = device_ptr<T>(x);
    Sink<A> sink;
    sink.data = out.data_ptr();
    // mean = sum / n in the accumulation type, then one rounding (n == 0 gives NaN, as in torch).
    sink.divide = op == ReduceOp::Mean;
    sink.divisor = static_cast<A>(g.n_reduced);
    switch (op) {
      case ReduceOp::Sum:
      case ReduceOp::Mean:
        run_reduction<D, D, A, SumRule<A>, SumRule<A>, true>(*this, in, g, SumRule<A>{}, SumRule<A>{}, sink);
        break;
      case ReduceOp::Max:
        run_reduction<D, D, A, MaxRule<A>, MaxRule<A>, true>(*this, in, g, MaxRule<A>{}, MaxRule<A>{}, sink);
        break;
      case ReduceOp::Min:
        run_reduction<D, D, A, MinRule<A>, MinRule<A>, true>(*this, in, g, MinRule<A>{}, MinRule<A>{}, sink);
        break;
    }
  });
}

void CudaBackend::var_kernel(const Tensor& x, const std::vector<int64_t>& dims, int64_t correction, const Tensor& out) {
  const ReduceGeometry g = reduce_geometry(x, dims);
  if (g.n_out == 0) return;
  dispatch_float(x.dtype(), "var", [&]<typename T>() {
    using D = device_t<T>;
    using A = device_acc_t<D>;
    const D* in = device_ptr<T>(x);
    // Two passes: the mean first (kept in the accumulation type), then the sum of squared deviations from it.
    const Tensor mean = Tensor::empty({g.n_out}, dtype_of<A>::value, Device::cuda(device()));
    Sink<A> mean_sink;
    mean_sink.data = mean.data_ptr();
    mean_sink.acc_output = true;
    mean_sink.divide = true;
    mean_sink.divisor = static_cast<A>(g.n_reduced);
    run_reduction<D, D, A, SumRule<A>, SumRule<A>, true>(*this, in, g, SumRule<A>{}, SumRule<A>{}, mean_sink);
    // Divide by max(0, n - correction): n <= correction gives Inf or NaN, as in torch.
    Sink<A> sink;
    sink.data = out.data_ptr();
    sink.divide = true;
    sink.divisor = static_cast<A>(std::max<int64_t>(0, g.n_reduced - correction));
    const SquaredDeviationRule<A> rule{static_cast<const A*>(mean.data_ptr())};
    run_reduction<D, D, A, SquaredDeviationRule<A>, SumRule<A>, true>(*this, in, g, rule, SumRule<A>{}, sink);
  });
}

void CudaBackend::softmax_kernel(const Tensor& x, int64_t dim, bool log, const Tensor& out) {
  const int64_t n = x.shape()[dim];
  const int64_t count = n == 0 ? 0 : x.numel() / n;
  if (count == 0) return;
  const OffsetCalculator<2> rows = row_starts<2>({&x, &out}, dim, "softmax");
  const int64_t sx = x.strides()[dim], so = out.strides()[dim];
  const bool contiguous_rows = (sx == 1 && so == 1) || n == 1;
  const cudaStream_t s = stream();
  dispatch_float(x.dtype(), "softmax", [&]<typename T>() {
    using D = device_t<T>;
    const D* in = device_ptr<T>(x);
    D* o = device_ptr<T>(out);
    if (contiguous_rows && n <= kWarpRowMax) {
      softmax_rows_kernel<D, false><<<blocks_for(count, kThreads / 32), kThreads, 0, s>>>(in, o, rows, count, n, log);
    } else if (contiguous_rows) {
      softmax_rows_kernel<D, true>
          <<<blocks_for_rows(count), block_threads_for_row(n), 0, s>>>(in, o, rows, count, n, log);
    } else {
      softmax_strided_kernel<D><<<blocks_for(count), kThreads, 0, s>>>(in, o, rows, count, n, sx, so, log);
    }
    MIXTAPE_KERNEL_CHECK();
  });
}

void CudaBackend::softmax_backward_kernel(const Tensor& y, const Tensor& grad_y, int64_t dim, bool log,
                                          const Tensor& grad_x) {
  const int64_t n = y.shape()[dim];
  const int64_t count = n == 0 ? 0 : y.numel() / n;
  if (count == 0) return;
  const OffsetCalculator<3> rows = row_starts<3>({&y, &grad_y, &grad_x}, dim, "softmax_backward");
  const int64_t sy = y.strides()[dim], sg = grad_y.strides()[dim], sd = grad_x.strides()[dim];
  const bool contiguous_rows = (sy == 1 && sg == 1 && sd == 1) || n == 1;
  const cudaStream_t s = stream();
  dispatch_float(y.dtype(), "softmax_backward", [&]<typename T>() {
    using D = device_t<T>;
    const D* yp = device_ptr<T>(y);
    const D* gp = device_ptr<T>(grad_y);
    D* dp = device_ptr<T>(grad_x);
    if (contiguous_rows && n <= kWarpRowMax) {
      softmax_backward_rows_kernel<D, false>
          <<<blocks_for(count, kThreads / 32), kThreads, 0, s>>>(yp, gp, dp, rows, count, n, log);
    } else if (contiguous_rows) {
      softmax_backward_rows_kernel<D, true>
          <<<blocks_for_rows(count), block_threads_for_row(n), 0, s>>>(yp, gp, dp, rows, count, n, log);
    } else {
      softmax_backward_strided_kernel<D>
          <<<blocks_for(count), kThreads, 0, s>>>(yp, gp, dp, rows, count, n, sy, sg, sd, log);
    }
    MIXTAPE_KERNEL_CHECK();
  });
}

}  // namespace mixtape::cuda
