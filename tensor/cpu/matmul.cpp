// CPU matmul: oneDNN for f32 and bf16 (bf16 accumulates in f32 inside oneDNN and rounds once on store), f16
// through f32 (oneDNN 2.6 has no f16 matmul on CPUs without AVX512-FP16), and a plain loop for f64, which
// only serves references and gradcheck.
//
// The kernel receives a [..., M, K], b [..., K, N] with out's batch dims already broadcast (stride 0) and a
// contiguous out. Before reaching oneDNN the geometry is simplified (simplify_matmul in
// tensor/kernel_geometry.h, shared with the CUDA backend):
//   1. batch dims of size 1 are dropped and adjacent batch dims that every operand steps through as one are
//      merged (a contiguous [B, T, M, K] has a single batch dim of B*T);
//   2. when b is the same matrix for every batch entry (a linear layer: x [B, T, C] @ W [C, N]) and a's batch
//      and row dims collapse, the batch folds into M: one [B*T, C] x [C, N] GEMM instead of B*T small ones;
//   3. each matrix is passed with its own strides (a transposed operand costs no copy) as long as one of its
//      last two dims has unit stride; broadcast batch dims become size-1 dims of that operand's memory
//      descriptor, which oneDNN broadcasts itself.
// A bias [N] (a linear layer's) is oneDNN's bias argument, broadcast over every other dim and added in the
// f32 accumulator before the one rounding to out; the f64 loop starts each output row from it.
// With allow_tf32() (tensor/precision.h) an f32 product packs both operands and rounds the packed copies to
// tf32 (10 mantissa bits, nearest even) before oneDNN's f32 product: the numerics of a TF32 tensor core.
// f16 (and tf32) need a copy of each operand anyway: an operand oneDNN could read in place is copied as its
// whole memory span in one streaming pass and keeps its own strides (Packing::Span), so a transposed f16
// operand (a weight in the forward, dY^T for the weight gradient) costs a contiguous conversion, not a
// strided gather. When oneDNN cannot take a layout (or would only offer its slow reference implementation)
// the operands are packed into contiguous buffers instead. The decision and the primitive are cached per
// geometry, so a training loop builds each primitive once.
#include <omp.h>
#include <dnnl.hpp>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/strided.h"
#include "tensor/half.h"
#include "tensor/kernel_geometry.h"
#include "tensor/precision.h"

namespace mixtape::cpu {

namespace {

using dnnl::memory;

dnnl::engine& dnnl_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

dnnl::stream& dnnl_stream() {
  // A CPU stream only orders executions; one per thread keeps concurrent callers independent.
  thread_local dnnl::stream stream(dnnl_engine());
  return stream;
}

// oneDNN takes plain matrices whose rows or columns are unit-stride and do not overlap.
bool plain_layout(int64_t rows, int64_t cols, const MatrixLayout& m) {
  return (m.col_stride == 1 && m.row_stride >= std::max<int64_t>(cols, 1)) ||
         (m.row_stride == 1 && m.col_stride >= std::max<int64_t>(rows, 1));
}

// ---- f64: a plain loop ------------------------------------------------------------------------------------

// out row i = sum_k a[i, k] * b[k, :], accumulated in place in the output row; the columns are tiled so
// that the output tile stays in L1 while the rows of b stream through.
void matmul_f64(const MatmulGeometry& g, const double* a, const double* b, const double* bias, double* out) {
  int64_t batch_count = 1;
  for (int64_t s : g.batch) batch_count *= s;
  const int64_t rows = batch_count * g.M;
  constexpr int64_t kTile = 256;
  const bool parallel = rows * g.N * g.K >= 32768 && rows > 1;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t r = 0; r < rows; ++r) {
    int64_t rest = r / g.M;
    const int64_t i = r % g.M;
    int64_t a_off = i * g.a.row_stride, b_off = 0, out_off = i * g.out.row_stride;
    for (size_t d = g.batch.size(); d-- > 0;) {  // unravel the batch index, last dim fastest
      const int64_t index = rest % g.batch[d];
      rest /= g.batch[d];
      a_off += index * g.a.batch[d];
      b_off += index * g.b.batch[d];
      out_off += index * g.out.batch[d];
    }
    double* o = out + out_off;
    for (int64_t j0 = 0; j0 < g.N; j0 += kTile) {
      const int64_t j1 = std::min(g.N, j0 + kTile);
      for (int64_t j = j0; j < j1; ++j) o[j * g.out.col_stride] = bias ? bias[j] : 0.0;
      for (int64_t k = 0; k < g.K; ++k) {
        const double aik = a[a_off + k * g.a.col_stride];
        const double* brow = b + b_off + k * g.b.row_stride;
        if (g.b.col_stride == 1 && g.out.col_stride == 1) {
          for (int64_t j = j0; j < j1; ++j) o[j] += aik * brow[j];
        } else {
          for (int64_t j = j0; j < j1; ++j) o[j * g.out.col_stride] += aik * brow[j * g.b.col_stride];
        }
      }
    }
  }
}

// ---- oneDNN plans -----------------------------------------------------------------------------------------

// How an operand reaches oneDNN.
enum class Packing : uint8_t {
  None,         // its own memory, strides as they are
  Span,         // its memory span copied as one contiguous run (converted to f32, or rounded to tf32), and
                // described with its own strides: a transposed operand costs a streaming pass, not a gather
  Compact,      // copied into a contiguous buffer; broadcast batch dims stay size 1 (oneDNN broadcasts)
  Materialize,  // copied into a contiguous buffer with broadcast batch dims repeated
};

struct Plan {
  dnnl::matmul primitive;
  memory::desc a_md, b_md, out_md, bias_md;  // bias_md: zero when there is no bias
  Packing a_packing = Packing::None, b_packing = Packing::None;
  int64_t a_span = 0, b_span = 0;  // elements copied for a Packing::Span operand
  // Inputs converted to f32 and the f32 result rounded into out (f16, or bf16 where this CPU lacks it).
  bool via_f32 = false;
};

memory::data_type dnnl_type(DType dtype) {
  switch (dtype) {
    case DType::F32: return memory::data_type::f32;
    case DType::BF16: return memory::data_type::bf16;
    case DType::F16: return memory::data_type::f16;
    default: fail("matmul: dtype ", dtype_name(dtype), " has no oneDNN type");
  }
}

// The view of an operand in the simplified geometry: [batch..., rows, cols]. Broadcast batch dims get size 1
// unless `materialize` (then stride 0 and full size, so a copy repeats them).
Shape operand_shape(const MatmulGeometry& g, const MatrixLayout& m, int64_t rows, int64_t cols,
                    bool materialize) {
  Shape shape;
  for (size_t d = 0; d < g.batch.size(); ++d)
    shape.push_back(m.batch[d] == 0 && !materialize ? 1 : g.batch[d]);
  shape.push_back(rows);
  shape.push_back(cols);
  return shape;
}

Strides operand_strides(const MatrixLayout& m) {
  Strides strides = m.batch;
  strides.push_back(m.row_stride);
  strides.push_back(m.col_stride);
  return strides;
}

// The number of elements from an operand's first element to its last (its memory span in the simplified
// geometry), or -1 when a stride is negative.
int64_t operand_span(const MatmulGeometry& g, const MatrixLayout& m, int64_t rows, int64_t cols) {
  const Shape shape = operand_shape(g, m, rows, cols, false);
  const Strides strides = operand_strides(m);
  int64_t span = 1;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] <= 1) continue;
    if (strides[d] < 0) return -1;
    span += (shape[d] - 1) * strides[d];
  }
  return span;
}

// The operand's span when copying it instead of its elements pays, that is while the span holds few
// elements that are not the operand's (a transposed matrix has none; a slice of a wider tensor has many);
// else 0.
int64_t dense_span(const MatmulGeometry& g, const MatrixLayout& m, int64_t rows, int64_t cols) {
  const int64_t span = operand_span(g, m, rows, cols);
  int64_t numel = rows * cols;
  for (size_t d = 0; d < g.batch.size(); ++d) numel *= m.batch[d] == 0 ? 1 : g.batch[d];
  return span > 0 && span <= numel + numel / 4 ? span : 0;
}

// A memory descriptor for dims with the given strides; strides of size-1 dims are replaced by the extent of
// the dims inside them (oneDNN ignores them, but keeps them in its layout checks).
memory::desc make_md(const Shape& dims, const Strides& strides, memory::data_type type) {
  memory::dims md_dims(dims.begin(), dims.end()), md_strides(strides.begin(), strides.end());
  int64_t extent = 1;
  for (size_t d = dims.size(); d-- > 0;) {
    if (dims[d] == 1 && d + 2 < dims.size()) md_strides[d] = extent;
    extent = std::max(extent, md_strides[d] * dims[d]);
  }
  return memory::desc(md_dims, type, md_strides);
}

// Creates the primitive for one choice of packing; empty when oneDNN has nothing better than its reference
// implementation for it.
bool try_plan(const MatmulGeometry& g, memory::data_type type, bool bias, Packing a_packing,
              Packing b_packing, Plan& plan) {
  auto md_for = [&](const MatrixLayout& m, int64_t rows, int64_t cols, Packing packing) {
    const Shape shape = operand_shape(g, m, rows, cols, packing == Packing::Materialize);
    if (packing == Packing::None || packing == Packing::Span) {
      if (!plain_layout(rows, cols, m)) return memory::desc();
      return make_md(shape, operand_strides(m), type);
    }
    return make_md(shape, contiguous_strides(shape), type);
  };
  const memory::desc a_md = md_for(g.a, g.M, g.K, a_packing);
  const memory::desc b_md = md_for(g.b, g.K, g.N, b_packing);
  if (a_md.is_zero() || b_md.is_zero()) return false;
  const Shape out_shape = operand_shape(g, g.out, g.M, g.N, true);
  const memory::desc out_md = make_md(out_shape, operand_strides(g.out), type);
  // The bias as a [1, ..., 1, N] tensor: oneDNN broadcasts it over the size-1 dims.
  memory::desc bias_md;
  if (bias) {
    Shape bias_shape(out_shape.size(), 1);
    bias_shape.back() = g.N;
    bias_md = make_md(bias_shape, contiguous_strides(bias_shape), type);
  }
  try {
    const dnnl::matmul::desc desc = bias ? dnnl::matmul::desc(a_md, b_md, bias_md, out_md)
                                         : dnnl::matmul::desc(a_md, b_md, out_md);
    const dnnl::matmul::primitive_desc pd(desc, dnnl_engine(), /*allow_empty=*/true);
    if (!pd) return false;
    const std::string impl = pd.impl_info_str();
    if (impl.rfind("ref", 0) == 0) return false;
    plan.primitive = dnnl::matmul(pd);
  } catch (const dnnl::error&) {
    return false;
  }
  plan.a_md = a_md;
  plan.b_md = b_md;
  plan.out_md = out_md;
  plan.bias_md = bias_md;
  plan.a_packing = a_packing;
  plan.b_packing = b_packing;
  return true;
}

// Whether A (a transposed operand: unit row stride) is better packed row-major before an f32 GEMM. oneDNN
// 2.6's AVX2 sgemm reads such an A up to 2x slower when the product is tall and narrow: a weight gradient
// X^T dY of a layer with a wide input and a narrow output ([1024, 2048] x [2048, 256] in the GPT's MLP).
// Measured on Zen 3 with the transposing copy included: M >= 512 with N <= 256 gains 1.04x-1.6x, wider
// products gain nothing; bench_ops' matmul_f32 At_ rows track it. oneDNN's AVX-512 kernels were not
// measured this way, so there A keeps its own strides.
bool onednn_has_avx512() {
  static const bool avx512 = [] {
    const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
    const auto core = static_cast<unsigned>(dnnl::cpu_isa::avx512_core);  // a bit mask of its features
    return (isa & core) == core;
  }();
  return avx512;
}

bool pack_transposed_a(const MatmulGeometry& g) {
  return !onednn_has_avx512() && g.batch.empty() && g.a.row_stride == 1 && g.a.col_stride != 1 &&
         g.M >= 512 && g.N <= 256;
}

// Whether a short, wide product is better computed transposed: out^T = B^T A^T, when that transposed
// product is the tall, narrow one pack_transposed_a packs (B row-major, so B^T is read transposed), and
// out^T is transposed into out by the tiled copy. By oneDNN's source, its AVX2 sgemm driver picks the
// no-copy kernel for a product this narrow (1/M + 1/N >= 0.0038), which reads the wide B in place; the GPT's
// MLP weight gradient X^T dY ([256, 2048] x [2048, 1024]) took 14.6 ms (~74 GFLOP/s) in the training step
// (ONEDNN_VERBOSE) against 119-154 GFLOP/s for the other large GEMMs. Measured on Zen 3 (a scratch program
// timing oneDNN primitives, 2 threads, packing and the final transpose included): M = 256 with N in
// 512..2048 gains 1.04x-1.7x with A plain or transposed; M = 128 and M >= 384 were mixed (0.72x-1.47x) and
// are left alone. bench_ops' matmul_f32/At_256x2048x1024 row tracks it. No bias (it would have to join
// out^T's rows); AVX-512 CPUs were not measured (pack_transposed_a is false there).
bool transpose_wide_product(const MatmulGeometry& g, bool bias) {
  auto transposed = [](const MatrixLayout& m) { return MatrixLayout{m.batch, m.col_stride, m.row_stride}; };
  const MatmulGeometry swapped{g.batch, g.N, g.K, g.M, transposed(g.b), transposed(g.a), transposed(g.out)};
  return !bias && g.M > 128 && g.K >= 512 && pack_transposed_a(swapped);
}

Plan make_plan(const MatmulGeometry& g, DType dtype, bool bias, bool tf32) {
  // f16 goes through f32; bf16 does too where this CPU has no fast bf16 matmul.
  std::vector<std::pair<DType, bool>> attempts;  // (compute dtype, via_f32)
  if (dtype != DType::F16) attempts.push_back({dtype, false});
  if (dtype != DType::F32) attempts.push_back({DType::F32, true});
  // Try the cheapest packing first: own strides, then compact copies, then fully materialised copies.
  const std::pair<Packing, Packing> packings[] = {{Packing::None, Packing::None},
                                                  {Packing::Compact, Packing::None},
                                                  {Packing::None, Packing::Compact},
                                                  {Packing::Compact, Packing::Compact},
                                                  {Packing::Materialize, Packing::Materialize}};
  const int64_t a_span = dense_span(g, g.a, g.M, g.K), b_span = dense_span(g, g.b, g.K, g.N);
  for (const auto& [compute, via_f32] : attempts) {
    const bool pack_a = compute == DType::F32 && pack_transposed_a(g);
    for (auto [a_packing, b_packing] : packings) {
      if (pack_a && a_packing == Packing::None) continue;  // the slow case: A is copied row-major
      // Converting to f32 (or rounding to tf32) copies every operand: an operand oneDNN could read in place
      // is copied as its span with its own strides where that span is dense, else this variant is skipped
      // for the compact copies that follow.
      if (via_f32 || tf32) {
        if (a_packing == Packing::None) {
          if (a_span == 0) continue;
          a_packing = Packing::Span;
        }
        if (b_packing == Packing::None) {
          if (b_span == 0) continue;
          b_packing = Packing::Span;
        }
      }
      Plan plan;
      if (try_plan(g, dnnl_type(compute), bias, a_packing, b_packing, plan)) {
        plan.via_f32 = via_f32;
        plan.a_span = a_span;
        plan.b_span = b_span;
        return plan;
      }
    }
  }
  fail("matmul: oneDNN has no implementation for ", dtype_name(dtype), " batch ", shape_str(g.batch), " M ",
       g.M, " K ", g.K, " N ", g.N);
}

struct KeyHash {
  size_t operator()(const std::vector<int64_t>& key) const {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the 64-bit words
    for (int64_t v : key) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

// The plan for a geometry, built on first use. Plans are never evicted individually (a model has a handful
// of shapes); the cache is cleared if it ever grows past kMaxPlans (shapes that change every step).
std::shared_ptr<const Plan> plan_for(const MatmulGeometry& g, DType dtype, bool bias, bool tf32) {
  static std::mutex mutex;
  static std::unordered_map<std::vector<int64_t>, std::shared_ptr<const Plan>, KeyHash> plans;
  constexpr size_t kMaxPlans = 4096;
  std::vector<int64_t> key = {static_cast<int64_t>(dtype), bias, tf32, g.M, g.K, g.N};
  for (const MatrixLayout* m : {&g.a, &g.b, &g.out}) {
    key.push_back(m->row_stride);
    key.push_back(m->col_stride);
  }
  key.insert(key.end(), g.batch.begin(), g.batch.end());
  key.insert(key.end(), g.a.batch.begin(), g.a.batch.end());
  key.insert(key.end(), g.b.batch.begin(), g.b.batch.end());
  key.insert(key.end(), g.out.batch.begin(), g.out.batch.end());
  std::lock_guard lock(mutex);
  auto it = plans.find(key);
  if (it != plans.end()) return it->second;
  if (plans.size() >= kMaxPlans) plans.clear();  // callers in flight keep their plan alive
  auto plan = std::make_shared<const Plan>(make_plan(g, dtype, bias, tf32));
  plans.emplace(std::move(key), plan);
  return plan;
}

// The operand as the plan wants it: its own memory, or a contiguous (possibly converted) copy.
Tensor prepare_operand(const Tensor& t, const MatmulGeometry& g, const MatrixLayout& m, int64_t rows,
                       int64_t cols, Packing packing, int64_t span, DType compute) {
  if (packing == Packing::None) return t;
  if (packing == Packing::Span) {  // the span from element 0, converted in one contiguous pass
    Tensor packed = Tensor::empty({span}, compute, t.device());
    cpu_backend().copy(make_view(t, {span}, {1}, t.offset()), packed);
    return packed;
  }
  const bool materialize = packing == Packing::Materialize;
  const Shape shape = operand_shape(g, m, rows, cols, materialize);
  const Tensor view = make_view(t, shape, operand_strides(m), t.offset());
  Tensor packed = Tensor::empty(shape, compute, t.device());
  cpu_backend().copy(view, packed);
  return packed;
}

// Rounds a packed f32 operand to tf32 in place.
void round_packed_to_tf32(const Tensor& packed) {
  float* p = packed.data<float>();
  const int64_t n = packed.numel();
#pragma omp parallel for schedule(static) if (n >= 65536)
  for (int64_t i = 0; i < n; ++i) p[i] = round_to_tf32(p[i]);
}

}  // namespace

void CpuBackend::matmul(const Tensor& a, const Tensor& b, const Tensor& out, const Tensor& bias) {
  // Messages are formatted only on failure (check() would format its arguments on every call).
  if (a.dim() < 2 || a.dim() != b.dim() || a.dim() != out.dim())
    fail("cpu matmul: operands ", a.description(), " x ", b.description(), " -> ", out.description(),
         " must have the same number (>= 2) of dims");
  if (a.dtype() != b.dtype() || a.dtype() != out.dtype())
    fail("cpu matmul: dtypes differ: ", a.description(), " x ", b.description(), " -> ", out.description());
  const bool has_bias = bias.defined();
  if (has_bias && (bias.dim() != 1 || bias.size(0) != out.size(-1) || bias.dtype() != out.dtype() ||
                   !bias.is_contiguous()))
    fail("cpu matmul: bias ", bias.description(), " must be a contiguous ", dtype_name(out.dtype()), "[",
         out.size(-1), "] for output ", out.description());
  if (out.numel() == 0) return;
  if (!out.is_contiguous()) fail("cpu matmul: output ", out.description(), " must be contiguous");
  if (a.size(-1) == 0) {  // an empty sum: out = bias (or 0) in every row
    if (has_bias) {
      Strides rows(static_cast<size_t>(out.dim()), 0);
      rows.back() = 1;
      copy(make_view(bias, out.shape(), rows, bias.offset()), out);
    } else {
      fill(out, 0);
    }
    return;
  }
  const MatmulGeometry g = simplify_matmul(a, b, out);
  if (a.dtype() == DType::F64) {
    matmul_f64(g, a.data<double>(), b.data<double>(), has_bias ? bias.data<double>() : nullptr,
               out.data<double>());
    return;
  }
  check(a.dtype() == DType::F32 || is_low_precision(a.dtype()), "cpu matmul: dtype ", dtype_name(a.dtype()),
        " is not supported (expected f32, f16, bf16 or f64)");
  if (transpose_wide_product(g, has_bias)) {  // out^T = B^T A^T, then out^T transposed into out
    const Tensor b_t = make_view(b, {g.N, g.K}, {g.b.col_stride, g.b.row_stride}, b.offset());
    const Tensor a_t = make_view(a, {g.K, g.M}, {g.a.col_stride, g.a.row_stride}, a.offset());
    const Tensor out_t = Tensor::empty({g.N, g.M}, out.dtype(), out.device());
    matmul(b_t, a_t, out_t, Tensor());
    copy(make_view(out_t, {g.M, g.N}, {1, g.M}, 0),
         make_view(out, {g.M, g.N}, {g.out.row_stride, g.out.col_stride}, out.offset()));
    return;
  }

  const bool tf32 = a.dtype() == DType::F32 && allow_tf32();
  const std::shared_ptr<const Plan> shared_plan = plan_for(g, a.dtype(), has_bias, tf32);
  const Plan& plan = *shared_plan;
  const DType compute = plan.via_f32 ? DType::F32 : a.dtype();
  const Tensor a_in = prepare_operand(a, g, g.a, g.M, g.K, plan.a_packing, plan.a_span, compute);
  const Tensor b_in = prepare_operand(b, g, g.b, g.K, g.N, plan.b_packing, plan.b_span, compute);
  if (tf32) {  // the plan packed both (fresh buffers, never the caller's memory)
    round_packed_to_tf32(a_in);
    round_packed_to_tf32(b_in);
  }
  Tensor bias_in = bias;
  if (has_bias && bias.dtype() != compute) {  // via f32: the bias joins the f32 accumulator as f32
    bias_in = Tensor::empty(bias.shape(), compute, bias.device());
    copy(bias, bias_in);
  }
  // Via f32 the result lands in an f32 buffer and is rounded into out once.
  const Tensor out_f32 = plan.via_f32 ? Tensor::empty(out.shape(), DType::F32, out.device()) : Tensor();
  const Tensor& dst = plan.via_f32 ? out_f32 : out;
  try {
    memory a_mem(plan.a_md, dnnl_engine(), a_in.data_ptr());
    memory b_mem(plan.b_md, dnnl_engine(), b_in.data_ptr());
    memory out_mem(plan.out_md, dnnl_engine(), dst.data_ptr());
    std::unordered_map<int, memory> args = {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem},
                                            {DNNL_ARG_DST, out_mem}};
    if (has_bias) args.emplace(DNNL_ARG_BIAS, memory(plan.bias_md, dnnl_engine(), bias_in.data_ptr()));
    plan.primitive.execute(dnnl_stream(), args);
    dnnl_stream().wait();
  } catch (const dnnl::error& error) {
    fail("cpu matmul: oneDNN failed on ", a.description(), " x ", b.description(), ": ", error.what());
  }
  if (plan.via_f32) copy(out_f32, out);
}

bool CpuBackend::matmul_widens(DType dtype) const {
  if (dtype == DType::F16) return true;  // never a GEMM of its own (make_plan)
  if (dtype != DType::BF16) return false;
  // bf16 widens where this CPU has no bf16 GEMM: what the plan of a small product chooses.
  static const bool bf16_widens = [] {
    const Tensor a = Tensor::zeros({16, 16}, DType::BF16);
    return plan_for(simplify_matmul(a, a, a), DType::BF16, false, false)->via_f32;
  }();
  return bf16_widens;
}

}  // namespace mixtape::cpu
