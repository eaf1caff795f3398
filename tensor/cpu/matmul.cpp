// CPU matmul: oneDNN for f32 and bf16 (bf16 accumulates in f32 inside oneDNN and rounds once on store); f16
// (oneDNN 2.6 has no f16 matmul on these CPUs) on a CPU with AMX as bf16 products of each value's two bf16
// parts (see "f16 as bf16 parts" below), on other CPUs with AVX2 or AVX-512 by gemm16 (tensor/cpu/gemm16.cpp:
// own code, the 16-bit data read and written in place) where the geometry is unbatched, and otherwise through
// f32; bf16 takes the f16 route (gemm16, else f32) where oneDNN has no bf16 GEMM for the CPU or where the
// CPU's bf16 dot product is slower than its f32 FMAs (see "bf16 products" below); and a plain loop for f64,
// which only serves references and gradcheck.
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

#include "tensor/cpu/onednn.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/gemm16.h"
#include "tensor/cpu/strided.h"
#include "tensor/half.h"
#include "tensor/kernel_geometry.h"
#include "tensor/precision.h"

namespace mixtape::cpu {

dnnl::engine& dnnl_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

dnnl::stream& dnnl_stream() {
  thread_local dnnl::stream stream(dnnl_engine());
  return stream;
}

namespace {

using dnnl::memory;

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

// ---- f16 as bf16 parts -------------------------------------------------------------------------------------
//
// oneDNN 2.6 has no f16 matmul, and f16 through f32 is slower than f32 itself (the operand copies come on top
// of the same f32 GEMM). On a CPU with AMX, whose bf16 products run several times faster than the f32 ones
// (bench_ops on a Xeon with AMX: 1.4-2.6 TFLOP/s against 330-410 GFLOP/s), an f16 product is computed from bf16
// parts instead, the scheme PyTorch's float32_matmul_precision("high") calls bf16x3:
//   An f16 value x (11 significant bits) is hi + lo exactly, hi = x rounded to bf16 (8 bits, nearest even)
//   and lo = x - hi: a multiple of x's last bit no larger than half of hi's, so 3 bits at most, exact in bf16
//   (its exponent, >= 2^-24 or zero, is far inside bf16's range), with |lo| <= 2^-8 |x|.
//   a b = ah bh + al bh + ah bl + al bl. Each term, a product of two bf16 values (<= 16 significant bits), is
//   exact in f32. The last one is at most 2^-16 |a b| and is dropped: one bf16 GEMM over K' = 3K terms,
//     A' = [Ah | Al | Ah] (M x 3K),  B' = [Bh ; Bh ; Bl] (3K x N),
//   accumulated in f32 (oneDNN's AMX kernels: tdpbf16ps, f32 products of bf16 pairs summed in f32) and
//   rounded to f16 once.
// So each product carries a relative error of at most 2^-16 (1/32 of f16's unit roundoff, 2^-11), in all
// at most 2^-16 sum_k |a_k b_k|: below the worst-case error of the f32 sum itself once K >= 86 (K 2^-24 of
// the same sum), and of random sign. Everything else is the f32 route's: f32 sums, one rounding, a bias
// joining the f32 sum. The exact 4-term sum costs more than the f32 route saves (bench_train_gpt's fp16 step
// under each on a Xeon with AMX: 0.85x-0.89x of fp32 with 4 terms, 1.09x-1.15x with 3), so the 3-term sum is
// the split.
// set_f16_matmul_split_enabled(false) restores the f32 route, with its exact products, in this process.
// A non-finite input would break the identity (inf = inf + NaN, and inf * 0 appears in terms where the
// product of the values has none): the split finds it and the product takes the f32 route instead.
// Only 2-D products with a unit-stride dim in each operand (every linear layer, forward and backward) split;
// batched ones take the f32 route.

constexpr int64_t kParts = 3;  // K' = kParts * K
std::atomic<bool> split_enabled{true};

// Whether the kernels oneDNN runs on this CPU include an ISA (its cpu_isa values are bit masks of features).
bool onednn_has(dnnl::cpu_isa isa) {
  static const auto effective = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
  const auto wanted = static_cast<unsigned>(isa);
  return (effective & wanted) == wanted;
}

// Splits the n f16 values of a contiguous run into hi (stored at hi0 and hi1) and lo; returns false when a
// value is inf or NaN.
bool split_run(const uint16_t* src, int64_t n, uint16_t* hi0, uint16_t* hi1, uint16_t* lo) {
  int64_t j = 0;
  bool finite = true;
#if defined(__AVX512F__) && defined(__F16C__)
  const __m512i exponent = _mm512_set1_epi32(0x7F800000), round = _mm512_set1_epi32(0x7FFF),
                one = _mm512_set1_epi32(1);
  __mmask16 special = 0;
  // The zero-masked forms with an all-ones mask: GCC 12's plain ones warn of an uninitialised value.
  auto shift_down = [](__m512i v) { return _mm512_maskz_srli_epi32(0xFFFF, v, 16); };
  for (; j + 16 <= n; j += 16) {
    const __m512 x = _mm512_mask_cvtph_ps(_mm512_setzero_ps(), 0xFFFF,
                                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j)));
    const __m512i bits = _mm512_castps_si512(x);
    special |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(bits, exponent), exponent);
    const __m512i odd = _mm512_and_si512(shift_down(bits), one);
    const __m512i hi = shift_down(_mm512_add_epi32(bits, _mm512_add_epi32(round, odd)));
    const __m512 low = _mm512_sub_ps(x, _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, hi, 16)));
    const __m256i hi16 = _mm512_maskz_cvtepi32_epi16(0xFFFF, hi);
    const __m256i lo16 = _mm512_maskz_cvtepi32_epi16(0xFFFF, shift_down(_mm512_castps_si512(low)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi0 + j), hi16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi1 + j), hi16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + j), lo16);
  }
  finite = special == 0;
#endif
  for (; j < n; ++j) {
    const float x = half_bits_to_float(src[j]);
    finite &= std::isfinite(x);
    const uint16_t hi = float_to_bf16_bits(x);
    const float low = x - bf16_bits_to_float(hi);  // exact, and its low 16 bits are zero: no rounding below
    hi0[j] = hi1[j] = hi;
    lo[j] = static_cast<uint16_t>(std::bit_cast<uint32_t>(low) >> 16);
  }
  return finite;
}

// Where split_operand puts an operand's parts, and how oneDNN reads them. The operand's unit-stride dim gives
// its runs. When that dim is K (A row-major, B column-major) each run of K becomes a run of 3K, its three
// parts side by side; otherwise (A column-major, B row-major) the K runs are stacked three times as planes.
// Zero-initialised: a plan that does not split still copies its (unused) layouts.
struct SplitLayout {
  bool runs_along_k = false;
  int64_t runs = 0, run_length = 0, run_stride = 0;  // in the operand's own memory
  int64_t rows = 0, cols = 0;  // the operand with K' = 3K: [M, 3K] for A, [3K, N] for B
  Strides strides;                       // of the packed operand, in that shape
};

SplitLayout split_layout(const MatrixLayout& m, int64_t rows, int64_t cols, bool is_a) {
  SplitLayout s;
  const bool row_runs = m.col_stride == 1 && (rows == 1 || m.row_stride >= cols);
  s.runs_along_k = row_runs == is_a;  // A's rows and B's columns run along K
  s.runs = row_runs ? rows : cols;
  s.run_length = row_runs ? cols : rows;
  s.run_stride = row_runs ? m.row_stride : m.col_stride;
  s.rows = is_a ? rows : kParts * rows;
  s.cols = is_a ? kParts * cols : cols;
  const int64_t k = is_a ? cols : rows;
  if (s.runs_along_k)  // [.. 3K ..] per run: the K' dim has unit stride
    s.strides = is_a ? Strides{kParts * k, 1} : Strides{1, kParts * k};
  else  // planes of the operand's own layout, one after another along K'
    s.strides = is_a ? Strides{1, rows} : Strides{cols, 1};
  return s;
}

// Packs an f16 operand as its bf16 parts along K: A' = [Ah | Al | Ah], B' = [Bh ; Bh ; Bl]. Returns false
// when it holds a non-finite value.
bool split_operand(const Tensor& t, const SplitLayout& s, bool is_a, const Tensor& packed) {
  const uint16_t* src = reinterpret_cast<const uint16_t*>(t.data<Half>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data<BFloat16>());
  const int64_t n = s.run_length, runs = s.runs;
  // Offsets of the parts (K' blocks 0..2) of run r: along a run of 3n, or one plane of runs * n apart.
  const int64_t run_step = s.runs_along_k ? kParts * n : n, part_step = s.runs_along_k ? n : runs * n;
  const int64_t second_hi = is_a ? 2 : 1, lo = is_a ? 1 : 2;  // A: hi, lo, hi;  B: hi, hi, lo
  bool finite = true;
#pragma omp parallel for schedule(static) reduction(&& : finite) if (runs * n >= 32768)
  for (int64_t r = 0; r < runs; ++r) {
    uint16_t* base = dst + r * run_step;
    finite = split_run(src + r * s.run_stride, n, base, base + second_hi * part_step, base + lo * part_step) &&
             finite;
  }
  return finite;
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
  // f16 operands split into bf16 parts (split_operand) for a bf16 product with 3K terms and an f32 result.
  bool split = false;
  SplitLayout a_split, b_split;  // where the parts go, when split
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

// Creates plan's primitive for these descriptors (bias_md zero: no bias); false when oneDNN has nothing better
// than its reference implementation for them.
bool make_primitive(const memory::desc& a_md, const memory::desc& b_md, const memory::desc& bias_md,
                    const memory::desc& out_md, Plan& plan) {
  try {
    const dnnl::matmul::desc desc = bias_md.is_zero() ? dnnl::matmul::desc(a_md, b_md, out_md)
                                                      : dnnl::matmul::desc(a_md, b_md, bias_md, out_md);
    const dnnl::matmul::primitive_desc pd(desc, dnnl_engine(), /*allow_empty=*/true);
    if (!pd || std::string(pd.impl_info_str()).rfind("ref", 0) == 0) return false;
    plan.primitive = dnnl::matmul(pd);
  } catch (const dnnl::error&) {
    return false;
  }
  plan.a_md = a_md;
  plan.b_md = b_md;
  plan.out_md = out_md;
  plan.bias_md = bias_md;
  return true;
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
  if (!make_primitive(a_md, b_md, bias_md, out_md, plan)) return false;
  plan.a_packing = a_packing;
  plan.b_packing = b_packing;
  return true;
}

// Whether an operand is stored transposed: unit row stride, its columns strided.
bool transposed_layout(const MatrixLayout& m) { return m.row_stride == 1 && m.col_stride != 1; }

// Whether A (a transposed operand: unit row stride) is better packed row-major before an f32 GEMM. oneDNN
// 2.6's AVX2 sgemm reads such an A up to 2x slower when the product is tall and narrow: a weight gradient
// dY^T X of a layer with a narrow input and a wide output ([1024, 2048] x [2048, 256]: the GPT's MLP up
// projection). The bounds (M >= 512, N <= 256: the products that gain with the transposing copy included)
// come from timing oneDNN's primitives over a grid of shapes on a Zen 3 (1.04x-1.61x there; bench_ops' matmul_f32
// At_1024x2048x256 row 1.72x-1.88x of raw oneDNN); oneDNN's AVX-512 kernels keep A's own strides.
bool pack_transposed_a(const MatmulGeometry& g) {
  return !onednn_has(dnnl::cpu_isa::avx512_core) && g.batch.empty() && transposed_layout(g.a) && g.M >= 512 &&
         g.N <= 256;
}

// The same for a bf16 product on oneDNN's AVX512-BF16 kernels (a CPU without AMX), whose brgemm reads a
// transposed A through copies of its own: the weight gradients dY^T X of a linear layer, K = the tokens of a
// batch. A is copied row-major (the 16-bit tiled transpose) when M <= N; a product with M > N is computed
// transposed instead (transpose_wide_product), so that the operand copied is always the narrower side. AMX
// kernels read A as it is. (Zen 5, the bf16 step's GEMMs: 49.9-50.4 ms a step with the copy, 52.7-52.9 without.)
bool pack_transposed_bf16_a(const MatmulGeometry& g) {
  return onednn_has(dnnl::cpu_isa::avx512_core_bf16) && !onednn_has(dnnl::cpu_isa::avx512_core_amx) &&
         g.batch.empty() && transposed_layout(g.a) && g.K >= 1024 && g.M <= g.N;
}

// Whether a short, wide product is better computed transposed: out^T = B^T A^T, when that transposed
// product is the tall, narrow one pack_transposed_a packs (B row-major, so B^T is read transposed), and
// out^T is transposed into out by the tiled copy. By oneDNN's source, its AVX2 sgemm driver picks the
// no-copy kernel for a product this narrow (1/M + 1/N >= 0.0038), which reads the wide B in place and runs
// far below the other large GEMMs on the GPT's MLP down projection's weight gradient dY^T X ([256, 2048] x
// [2048, 1024]). On AVX2 the rule takes M = 256 with N in 512..2048, where the transposed product gains with
// packing and the final transpose included; other M are left alone (bench_ops' matmul_f32/At_256x2048x1024
// row on a Zen 3: 1.53x-1.71x of raw oneDNN, 0.94x-1.01x untransposed). No bias (it would have to join out^T's
// rows); AVX-512 CPUs keep the orientation (pack_transposed_a is false there).
// For bf16 (pack_transposed_bf16_a): a product with A transposed, B row-major and M > N.
// For a product gemm16 takes (`gemm16_route`, see gemm16_geometry), only its own rule: A transposed, B row-major
// and N >= 2M >= 128, with the AVX-512 kernel. gemm16 widens B whole into f32 slivers that every A block
// streams; for the MLP down projection's weight gradient g^T x ([256, 2048] x [2048, 1024]) that is 8 MiB,
// transposed it is g's 2 MiB. The rule rests on N/M = 4 (gains) and 1/4 (loses) at M = 65 and 256 (bench_ops'
// At_ rows, Xeon without AMX: f16 At_256x2048x1024 280 GFLOP/s against 260, At_65x2048x256 192 against 172): the
// threshold of 2 between them is a guess, and smaller products keep their orientation. AVX2 keeps it too (its
// 16-bit transposing copy has no register path).
// Same bits either way: each output sums the same exact products in order of k.
// `widen`: a bf16 product goes through f32 (it is then judged as an f32 one).
bool transpose_wide_product(const MatmulGeometry& g, bool bias, DType dtype, bool widen, bool gemm16_route) {
  auto transposed = [](const MatrixLayout& m) { return MatrixLayout{m.batch, m.col_stride, m.row_stride}; };
  const MatmulGeometry swapped{g.batch, g.N, g.K, g.M, transposed(g.b), transposed(g.a), transposed(g.out)};
  if (bias) return false;
  if (gemm16_route)
    return gemm16_isa() == Gemm16Isa::Avx512 && transposed_layout(g.a) && g.b.col_stride == 1 &&
           g.b.row_stride != 1 && g.M >= 64 && g.N >= 2 * g.M;
  if (dtype == DType::BF16 && !widen)
    return g.M > g.N && transposed_layout(g.a) && pack_transposed_bf16_a(swapped);
  return g.M > 128 && g.K >= 512 && pack_transposed_a(swapped);
}

// The plan of an f16 product as a bf16 one over its parts (see "f16 as bf16 parts"); false when the geometry
// does not split or oneDNN offers only its reference implementation for it.
bool try_split_plan(const MatmulGeometry& g, bool bias, Plan& plan) {
  if (!g.batch.empty() || !plain_layout(g.M, g.K, g.a) || !plain_layout(g.K, g.N, g.b)) return false;
  const SplitLayout a = split_layout(g.a, g.M, g.K, true), b = split_layout(g.b, g.K, g.N, false);
  plan.a_split = a;
  plan.b_split = b;
  const memory::desc a_md = make_md({a.rows, a.cols}, a.strides, memory::data_type::bf16);
  const memory::desc b_md = make_md({b.rows, b.cols}, b.strides, memory::data_type::bf16);
  const memory::desc out_md = make_md({g.M, g.N}, {g.out.row_stride, g.out.col_stride}, memory::data_type::f32);
  const memory::desc bias_md = bias ? make_md({1, g.N}, {g.N, 1}, memory::data_type::f32) : memory::desc();
  if (!make_primitive(a_md, b_md, bias_md, out_md, plan)) return false;
  plan.split = true;
  return true;
}

Plan make_plan(const MatmulGeometry& g, DType dtype, bool bias, bool tf32, bool split, bool widen) {
  Plan split_plan;
  if (split && try_split_plan(g, bias, split_plan)) return split_plan;
  // f16 goes through f32; bf16 does too where oneDNN has no bf16 matmul for this CPU, or when told to.
  std::vector<std::pair<DType, bool>> attempts;  // (compute dtype, via_f32)
  if (dtype != DType::F16 && !(dtype == DType::BF16 && widen)) attempts.push_back({dtype, false});
  if (dtype != DType::F32) attempts.push_back({DType::F32, true});
  // Try the cheapest packing first: own strides, then compact copies, then fully materialised copies.
  const std::pair<Packing, Packing> packings[] = {{Packing::None, Packing::None},
                                                  {Packing::Compact, Packing::None},
                                                  {Packing::None, Packing::Compact},
                                                  {Packing::Compact, Packing::Compact},
                                                  {Packing::Materialize, Packing::Materialize}};
  const int64_t a_span = dense_span(g, g.a, g.M, g.K), b_span = dense_span(g, g.b, g.K, g.N);
  for (const auto& [compute, via_f32] : attempts) {
    const bool pack_a =
        compute == DType::F32 ? pack_transposed_a(g) : compute == DType::BF16 && pack_transposed_bf16_a(g);
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
// `split`: an f16 product may take the bf16-parts route; `widen`: a bf16 product goes through f32 even where
// oneDNN has a bf16 GEMM.
std::shared_ptr<const Plan> plan_for(const MatmulGeometry& g, DType dtype, bool bias, bool tf32, bool split,
                                     bool widen) {
  static std::mutex mutex;
  static std::unordered_map<std::vector<int64_t>, std::shared_ptr<const Plan>, KeyHash> plans;
  constexpr size_t kMaxPlans = 4096;
  std::vector<int64_t> key = {static_cast<int64_t>(dtype), bias, tf32, split, widen, g.M, g.K, g.N};
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
  auto plan = std::make_shared<const Plan>(make_plan(g, dtype, bias, tf32, split, widen));
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

// Runs a plan's primitive on prepared operands (a, b: the caller's, for the message).
void execute(const Plan& plan, const Tensor& a_in, const Tensor& b_in, const Tensor& bias_in, const Tensor& dst,
             const Tensor& a, const Tensor& b) {
  try {
    memory a_mem(plan.a_md, dnnl_engine(), a_in.data_ptr());
    memory b_mem(plan.b_md, dnnl_engine(), b_in.data_ptr());
    memory out_mem(plan.out_md, dnnl_engine(), dst.data_ptr());
    std::unordered_map<int, memory> args = {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem},
                                            {DNNL_ARG_DST, out_mem}};
    if (bias_in.defined()) args.emplace(DNNL_ARG_BIAS, memory(plan.bias_md, dnnl_engine(), bias_in.data_ptr()));
    plan.primitive.execute(dnnl_stream(), args);
    dnnl_stream().wait();
  } catch (const dnnl::error& error) {
    fail("cpu matmul: oneDNN failed on ", a.description(), " x ", b.description(), ": ", error.what());
  }
}

// An f16 product on its bf16 parts; false (and out untouched) when an operand holds inf or NaN.
bool split_matmul(const Plan& plan, const MatmulGeometry& g, const Tensor& a, const Tensor& b,
                  const Tensor& bias, const Tensor& out) {
  const Tensor a_parts = Tensor::empty({kParts * g.M * g.K}, DType::BF16, a.device());
  const Tensor b_parts = Tensor::empty({kParts * g.K * g.N}, DType::BF16, b.device());
  if (!split_operand(a, plan.a_split, true, a_parts) || !split_operand(b, plan.b_split, false, b_parts))
    return false;
  Tensor bias_f32;
  if (bias.defined()) {
    bias_f32 = Tensor::empty(bias.shape(), DType::F32, bias.device());
    cpu_backend().copy(bias, bias_f32);
  }
  const Tensor out_f32 = Tensor::empty(out.shape(), DType::F32, out.device());
  execute(plan, a_parts, b_parts, bias_f32, out_f32, a, b);
  cpu_backend().copy(out_f32, out);
  return true;
}

// Whether gemm16 (tensor/cpu/gemm16.cpp) takes an f16 or bf16 product of this geometry: unbatched, each
// operand with a unit stride along one dim, rows of out contiguous. Any other geometry goes through f32.
bool gemm16_geometry(const MatmulGeometry& g) {
  const auto layout = [](const MatrixLayout& m) { return Matrix16<Half>{nullptr, m.row_stride, m.col_stride}; };
  return gemm16_isa() != Gemm16Isa::None && g.batch.empty() && g.out.col_stride == 1 &&
         gemm16_takes(layout(g.a), layout(g.b));
}

template <class T>
void own_gemm16(const MatmulGeometry& g, const Tensor& a, const Tensor& b, const Tensor& bias, const Tensor& out) {
  const Matrix16<T> am{a.data<T>(), g.a.row_stride, g.a.col_stride};
  const Matrix16<T> bm{b.data<T>(), g.b.row_stride, g.b.col_stride};
  gemm16(g.M, g.K, g.N, am, bm, bias.defined() ? bias.data<T>() : nullptr, out.data<T>(), g.out.row_stride);
}

// ---- bf16 products: oneDNN's bf16 GEMM or f32 FMAs ------------------------------------------------------
//
// oneDNN's bf16 GEMM runs on the CPU's bf16 dot-product instruction (vdpbf16ps: 32 products a register, summed
// in pairs into 16 f32 accumulators) or on AMX tiles. Where that instruction is fast it is the route; where it
// retires at about half the f32 FMA rate (an Intel Xeon whose AMX is not exposed, such as a KVM guest), bf16
// products take the f16 route instead: gemm16, else through the f32 GEMM. Both keep the contract of a bf16
// product: the products of bf16 values are exact in f32, summed in f32, rounded to bf16 once (only the order
// of the sum differs from oneDNN's).
//
// The choice is made once per process: MIXTAPE_BF16_GEMM (auto, onednn or f32) when set, else automatic: f32
// where oneDNN has no bf16 GEMM, oneDNN's where it runs on AMX, else f32 where the measured dot-product rate
// is below kSlowBf16Dot of the FMA rate. The measurement times two register-only loops (no memory traffic)
// back to back, best of 7 passes of 100,000 rounds (~8 ms, once): passes that long keep a busy neighbour
// from lifting a slow CPU's rate past the bound, and the classes it separates lie far on either side of it.
// (A Xeon without AMX measures 0.42-0.54 and runs oneDNN's bf16 GEMMs at 163-166 GFLOP/s against 321 in f32;
// 40 processes under load measured 0.435-0.516 with these passes, up to 0.86 with 5x shorter ones.) A build
// without AVX512-BF16 code (MIXTAPE_MARCH other than such a CPU) cannot measure and keeps oneDNN's route. A run
// that must keep its bits across machines, or across the processes of one job, names the route.

constexpr double kSlowBf16Dot = 0.75;

#if defined(__AVX512BF16__)
// Seconds for `rounds` passes over 12 independent accumulators (enough chains to hide either instruction's
// latency on current cores), each updated by `step`. Registers only.
template <class Step>
__attribute__((noinline)) double time_chains(int64_t rounds, Step step, float& sink) {
  // Named variables, not an array, so that the compiler keeps every accumulator in a register.
  __m512 c0 = _mm512_set1_ps(0.0f), c1 = _mm512_set1_ps(0.1f), c2 = _mm512_set1_ps(0.2f),
         c3 = _mm512_set1_ps(0.3f), c4 = _mm512_set1_ps(0.4f), c5 = _mm512_set1_ps(0.5f),
         c6 = _mm512_set1_ps(0.6f), c7 = _mm512_set1_ps(0.7f), c8 = _mm512_set1_ps(0.8f),
         c9 = _mm512_set1_ps(0.9f), c10 = _mm512_set1_ps(1.0f), c11 = _mm512_set1_ps(1.1f);
  const double start = omp_get_wtime();
  for (int64_t r = 0; r < rounds; ++r) {
    c0 = step(c0), c1 = step(c1), c2 = step(c2), c3 = step(c3), c4 = step(c4), c5 = step(c5);
    c6 = step(c6), c7 = step(c7), c8 = step(c8), c9 = step(c9), c10 = step(c10), c11 = step(c11);
  }
  // The accumulators live in registers only: this tells the compiler they are needed here, so that it cannot
  // move the loop past the second clock reading.
  asm volatile("" : "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3), "+v"(c4), "+v"(c5), "+v"(c6), "+v"(c7), "+v"(c8),
               "+v"(c9), "+v"(c10), "+v"(c11));
  const double seconds = omp_get_wtime() - start;
  const __m512 sum = _mm512_add_ps(
      _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)),
                    _mm512_add_ps(_mm512_add_ps(c4, c5), _mm512_add_ps(c6, c7))),
      _mm512_add_ps(_mm512_add_ps(c8, c9), _mm512_add_ps(c10, c11)));
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sum);
  for (float lane : lanes) sink += lane;
  return seconds;
}
#endif

}  // namespace

// What the plan of a small product chooses.
bool onednn_has_bf16_gemm() {
  static const bool exists = [] {
    const Tensor a = Tensor::zeros({16, 16}, DType::BF16);
    return !plan_for(simplify_matmul(a, a, a), DType::BF16, false, false, false, false)->via_f32;
  }();
  return exists;
}

double bf16_dot_rate() {
#if defined(__AVX512BF16__)
  static const double rate = [] {
    if (!__builtin_cpu_supports("avx512bf16")) return 0.0;
    const __m512 x = _mm512_set1_ps(1.0001f), y = _mm512_set1_ps(0.9999f);
    const __m512bh xb = _mm512_cvtne2ps_pbh(x, x), yb = _mm512_cvtne2ps_pbh(y, y);
    auto fma = [&](__m512 c) { return _mm512_fmadd_ps(x, y, c); };
    auto dot = [&](__m512 c) { return _mm512_dpbf16_ps(c, xb, yb); };
    constexpr int64_t kRounds = 100000;  // 1.2 M instructions: ~0.2 ms of FMAs, ~0.9 ms of dot products
    float sink = 0;
    double fma_s = 1e30, dot_s = 1e30;
    time_chains(kRounds, fma, sink);  // wakes the vector unit up
    for (int i = 0; i < 7; ++i) {
      fma_s = std::min(fma_s, time_chains(kRounds, fma, sink));
      dot_s = std::min(dot_s, time_chains(kRounds, dot, sink));
    }
    if (!(sink == sink)) return 0.0;  // keeps the loops' results alive
    // An FMA is 16 multiply-adds, a dot product 32.
    return (32.0 / dot_s) / (16.0 / fma_s);
  }();
  return rate;
#else
  return 0.0;
#endif
}

bool slow_bf16_dot(double dot_rate) { return dot_rate > 0 && dot_rate < kSlowBf16Dot; }

Bf16Gemm automatic_bf16_gemm(bool onednn_has_bf16, bool amx, double dot_rate) {
  if (!onednn_has_bf16) return Bf16Gemm::F32;
  if (amx) return Bf16Gemm::Onednn;  // AMX tiles
  return slow_bf16_dot(dot_rate) ? Bf16Gemm::F32 : Bf16Gemm::Onednn;  // an unknown rate keeps oneDNN's
}

const char* bf16_gemm_name(Bf16Gemm route) { return route == Bf16Gemm::Onednn ? "onednn" : "f32"; }

Bf16Gemm bf16_gemm_from_env(const char* value) {
  const std::string v = value == nullptr ? "" : value;
  if (v.empty() || v == "auto") {
    const bool exists = onednn_has_bf16_gemm(), amx = onednn_has(dnnl::cpu_isa::avx512_core_amx);
    // The rate is measured only where it decides.
    return automatic_bf16_gemm(exists, amx, exists && !amx ? bf16_dot_rate() : 0.0);
  }
  if (v == "f32") return Bf16Gemm::F32;
  if (v != "onednn") fail("MIXTAPE_BF16_GEMM=", v, ": expected auto, onednn or f32");
  if (!onednn_has_bf16_gemm())
    fail("MIXTAPE_BF16_GEMM=onednn: not supported: oneDNN has no bf16 GEMM for this CPU");
  return Bf16Gemm::Onednn;
}

namespace {

std::atomic<Bf16Gemm>& chosen_bf16_gemm() {
  static std::atomic<Bf16Gemm> route{bf16_gemm_from_env(std::getenv("MIXTAPE_BF16_GEMM"))};
  return route;
}

}  // namespace

Bf16Gemm bf16_gemm() { return chosen_bf16_gemm().load(std::memory_order_relaxed); }

Bf16Gemm set_bf16_gemm(Bf16Gemm route) {
  if (route == Bf16Gemm::Onednn && !onednn_has_bf16_gemm())
    fail("set_bf16_gemm(onednn): not supported: oneDNN has no bf16 GEMM for this CPU");
  return chosen_bf16_gemm().exchange(route);
}

bool f16_matmul_splits() {
  return split_enabled.load(std::memory_order_relaxed) && onednn_has(dnnl::cpu_isa::avx512_core_amx);
}

namespace {

// The one route chooser of 16-bit products, read by matmul (with the product's geometry) and matmul_widens.
// f16: on its bf16 parts where f16_matmul_splits, else gemm16. bf16: oneDNN's bf16 GEMM, or like f16 where
// bf16_gemm() is F32. gemm16 takes a product where its geometry allows (gemm16_geometry); any other product
// of a dtype without a GEMM of its own is computed through f32.
struct Route16 {
  DType dtype = DType::F32;
  bool f16_split = false;     // f16 as exact sums of bf16 products (oneDNN on AMX)
  bool bf16_via_f32 = false;  // bf16 on f32 FMAs (gemm16 or the f32 GEMM), not oneDNN's bf16 GEMM
  // gemm16 where the geometry allows, else through f32
  bool wants_gemm16() const { return (dtype == DType::F16 && !f16_split) || bf16_via_f32; }
};

Route16 route16_for(DType dtype) {
  Route16 route;
  route.dtype = dtype;
  route.f16_split = dtype == DType::F16 && f16_matmul_splits();
  route.bf16_via_f32 = dtype == DType::BF16 && bf16_gemm() == Bf16Gemm::F32;
  return route;
}

// An empty sum (K = 0): out = bias (or 0) in every row.
void matmul_empty_sum(Backend& backend, const Tensor& out, const Tensor& bias) {
  if (bias.defined()) {
    Strides rows(static_cast<size_t>(out.dim()), 0);
    rows.back() = 1;
    backend.copy(make_view(bias, out.shape(), rows, bias.offset()), out);
  } else {
    backend.fill(out, 0);
  }
}

// out^T = B^T A^T, then out^T transposed into out (the product of B^T A^T takes the same route, untransposed).
void matmul_transposed(Backend& backend, const MatmulGeometry& g, const Tensor& a, const Tensor& b,
                       const Tensor& out) {
  const Tensor b_t = make_view(b, {g.N, g.K}, {g.b.col_stride, g.b.row_stride}, b.offset());
  const Tensor a_t = make_view(a, {g.K, g.M}, {g.a.col_stride, g.a.row_stride}, a.offset());
  const Tensor out_t = Tensor::empty({g.N, g.M}, out.dtype(), out.device());
  backend.matmul(b_t, a_t, out_t, Tensor());
  backend.copy(make_view(out_t, {g.M, g.N}, {1, g.M}, 0),
               make_view(out, {g.M, g.N}, {g.out.row_stride, g.out.col_stride}, out.offset()));
}

// A product through oneDNN's GEMM, by its plan (plan_for): f16 on its bf16 parts where the route splits (the
// f32 route when an input is not finite), else the operands packed, widened or rounded to tf32 as the plan
// says, and a result computed via f32 rounded into out once.
void matmul_onednn(Backend& backend, const MatmulGeometry& g, const Tensor& a, const Tensor& b, const Tensor& bias,
                   const Tensor& out, const Route16& route) {
  const bool has_bias = bias.defined();
  const bool tf32 = a.dtype() == DType::F32 && allow_tf32();
  std::shared_ptr<const Plan> shared_plan =
      plan_for(g, a.dtype(), has_bias, tf32, route.f16_split, route.bf16_via_f32);
  if (shared_plan->split) {
    if (split_matmul(*shared_plan, g, a, b, bias, out)) return;
    // a non-finite input: the f32 route
    shared_plan = plan_for(g, a.dtype(), has_bias, tf32, false, route.bf16_via_f32);
  }
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
    backend.copy(bias, bias_in);
  }
  // Via f32 the result lands in an f32 buffer and is rounded into out once.
  const Tensor out_f32 = plan.via_f32 ? Tensor::empty(out.shape(), DType::F32, out.device()) : Tensor();
  const Tensor& dst = plan.via_f32 ? out_f32 : out;
  execute(plan, a_in, b_in, bias_in, dst, a, b);
  if (plan.via_f32) backend.copy(out_f32, out);
}

}  // namespace

bool set_f16_matmul_split_enabled(bool enabled) { return split_enabled.exchange(enabled); }

void CpuBackend::matmul_kernel(const Tensor& a, const Tensor& b, const Tensor& out, const Tensor& bias) {
  if (a.size(-1) == 0) return matmul_empty_sum(*this, out, bias);
  const MatmulGeometry g = simplify_matmul(a, b, out);
  if (a.dtype() == DType::F64) {
    matmul_f64(g, a.data<double>(), b.data<double>(), bias.defined() ? bias.data<double>() : nullptr,
               out.data<double>());
    return;
  }
  check(a.dtype() == DType::F32 || is_low_precision(a.dtype()), "cpu matmul: dtype ", dtype_name(a.dtype()),
        " is not supported (expected f32, f16, bf16 or f64)");
  // The routes are read once per call, so that a set_bf16_gemm or set_f16_matmul_split_enabled on another
  // thread cannot split one product between routes (a transposed product's inner call reads them again;
  // either route gives the whole product).
  const Route16 route = route16_for(a.dtype());
  const bool gemm16_route = route.wants_gemm16() && gemm16_geometry(g);
  if (transpose_wide_product(g, bias.defined(), a.dtype(), route.bf16_via_f32, gemm16_route))
    return matmul_transposed(*this, g, a, b, out);
  if (gemm16_route) {
    if (a.dtype() == DType::F16) own_gemm16<Half>(g, a, b, bias, out);
    else own_gemm16<BFloat16>(g, a, b, bias, out);
    return;
  }
  matmul_onednn(*this, g, a, b, bias, out, route);
}

// A 16-bit product that wants gemm16 widens to f32 where this CPU has no gemm16 (its geometry decides the
// rest per call, and a caller cannot know it ahead).
bool CpuBackend::matmul_widens(DType dtype) const {
  return route16_for(dtype).wants_gemm16() && gemm16_isa() == Gemm16Isa::None;
}

}  // namespace mixtape::cpu
