#include "tensor/cpu/quantize_kernels.h"

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "tensor/backend.h"
#include "tensor/random.h"

namespace mixtape::cpu {

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return std::bit_cast<float>(static_cast<uint32_t>(p[i]) << 16); }
// The bits of |p[i]| as an f32: as unsigned integers they order as the magnitudes do, with Inf and every NaN
// above all finite values, so one integer max gives a run's amax and whether it holds Inf or NaN.
inline uint32_t magnitude_bits(const float* p, int64_t i) { return std::bit_cast<uint32_t>(p[i]) & 0x7fffffffu; }
inline uint32_t magnitude_bits(const uint16_t* p, int64_t i) { return static_cast<uint32_t>(p[i] & 0x7fffu) << 16; }

// The counts of one row, one accumulator per lane of a 16-wide chunk: a sum across lanes once per row rather
// than once per block (a horizontal sum per 32 values cost as much as encoding them).
constexpr int kLanes = 16;
struct RowCounts {
  int32_t saturated[kLanes] = {}, flushed[kLanes] = {};
};

// What one row's blocks came to.
struct RowResult {
  int64_t saturated = 0, flushed = 0;
  float amax = 0;          // over the row's finite blocks
  bool not_finite = false; // a block holding Inf or NaN
  bool inexact = false;    // an E8M0 decode scale below 2^-100 (folded values not exact in bf16)
};

struct RowJob {
  int64_t C, bc, grid_cols;
  const ScaleRule* rule;
  FormatRounding round;
  float fmax;
  bool folded;  // values = code value * E8M0 decode scale; else code values, fp32 scales in k_scales
};

// One block's run of n values from p: amax, scale, then the values (and the counts) into out.
template <typename In>
void quantize_run(const In* p, int64_t n, const RowJob& job, uint16_t* out, float* k_scale, RowCounts& counts,
                  RowResult& row) {
  uint32_t max_bits = 0;
#pragma omp simd reduction(max : max_bits)
  for (int64_t i = 0; i < n; ++i) max_bits = std::max(max_bits, magnitude_bits(p, i));
  const bool not_finite = max_bits >= 0x7f800000u;
  const float m = std::bit_cast<float>(max_bits);
  float e = 0, decode = NAN, multiplier = NAN;
  if (!not_finite) {
    const BlockScaling s = choose_block_scale(*job.rule, m, 1.0f, 1.0f);
    e = s.encode;
    decode = s.decode;
    multiplier = job.folded ? decode : 1.0f;
    row.amax = std::max(row.amax, m);
    row.inexact |= job.folded && !(decode >= 0x1p-100f) && m > 0;  // zeros stay exact under any scale
  }
  if (k_scale != nullptr) *k_scale = decode;
  const auto store = [&](int64_t i, float value) {
    out[i] = static_cast<uint16_t>(std::bit_cast<uint32_t>(value * multiplier) >> 16);  // exact: see the header
  };
  if (not_finite) {
    // A block holding Inf or NaN (encode 0, decode NaN): its values are NaN and count as neither saturated nor
    // flushed, as the general path has it (its scale already says what happened).
    row.not_finite = true;
    for (int64_t i = 0; i < n; ++i) store(i, encode_nearest(load(p, i), e, job.round, job.fmax).value);
    return;
  }
  // A finite block's encode scale is positive, so every saturation and flush counts.
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) {
      const EncodedValue v = encode_nearest(load(p, i + l), e, job.round, job.fmax);
      counts.saturated[l] += v.saturated;
      counts.flushed[l] += v.flushed;
      store(i + l, v.value);
    }
  for (; i < n; ++i) {
    const EncodedValue v = encode_nearest(load(p, i), e, job.round, job.fmax);
    counts.saturated[0] += v.saturated;
    counts.flushed[0] += v.flushed;
    store(i, v.value);
  }
}

template <typename In>
RowResult quantize_row(const In* in, int64_t r, const RowJob& job, uint16_t* out, float* k_scales) {
  RowCounts counts;
  RowResult row;
  for (int64_t j = 0; j < job.grid_cols; ++j) {
    const int64_t first = r * job.C + j * job.bc, n = std::min(job.bc, job.C - j * job.bc);
    quantize_run(in + first, n, job, out + first, k_scales ? k_scales + r * job.grid_cols + j : nullptr, counts, row);
  }
  for (int l = 0; l < kLanes; ++l) {
    row.saturated += counts.saturated[l];
    row.flushed += counts.flushed[l];
  }
  return row;
}

// unit(u) for u in [0, units), on every thread where `parallel`, their results combined.
template <typename Unit>
RowResult over_units(int64_t units, bool parallel, const Unit& unit) {
  int64_t saturated = 0, flushed = 0;
  float amax = 0;
  int not_finite = 0, inexact = 0;
#pragma omp parallel for schedule(static) reduction(+ : saturated, flushed) reduction(max : amax) \
    reduction(| : not_finite, inexact) if (parallel)
  for (int64_t u = 0; u < units; ++u) {
    const RowResult part = unit(u);
    saturated += part.saturated;
    flushed += part.flushed;
    amax = std::max(amax, part.amax);
    not_finite |= part.not_finite;
    inexact |= part.inexact;
  }
  RowResult all;
  all.saturated = saturated;
  all.flushed = flushed;
  all.amax = not_finite ? NAN : amax;
  all.inexact = inexact;
  return all;
}

template <typename In>
RowResult quantize_rows(const In* in, int64_t R, const RowJob& job, uint16_t* out, float* k_scales) {
  return over_units(R, R * job.C > (1 << 15), [&](int64_t r) { return quantize_row(in, r, job, out, k_scales); });
}

// ---- the blocks of a transposed input: runs down the columns of its memory ----

// x = M^T for a contiguous M [C, R]: the view's row r is M's column r, and its blocks along C are runs of bc
// rows of M. A band of bc rows of M and up to kBand columns is done at once: the amaxes are column maxima
// (vertical, one lane per column), and each lane encodes with its own column's scale, so no sum or max ever
// runs across lanes; the values stay in M's layout (op.values is their transposed view).
constexpr int64_t kBand = 256;

template <typename In>
RowResult quantize_band(const In* m, int64_t R, int64_t first_row, int64_t n, int64_t c0, int64_t width,
                        const RowJob& job, int64_t j, uint16_t* out, float* k_scales) {
  uint32_t max_bits[kBand] = {};
  for (int64_t i = 0; i < n; ++i) {
    const In* row = m + (first_row + i) * R + c0;
#pragma omp simd
    for (int64_t c = 0; c < width; ++c) max_bits[c] = std::max(max_bits[c], magnitude_bits(row, c));
  }
  float encode_scale[kBand], multiplier[kBand];
  int32_t counted[kBand];  // 1 where the block is finite: its flushes count
  RowResult band;
  for (int64_t c = 0; c < width; ++c) {
    const bool finite = max_bits[c] < 0x7f800000u;
    const float amax = std::bit_cast<float>(max_bits[c]);
    float e = 0, decode = NAN, mult = NAN;
    if (finite) {
      const BlockScaling s = choose_block_scale(*job.rule, amax, 1.0f, 1.0f);
      e = s.encode;
      decode = s.decode;
      mult = job.folded ? decode : 1.0f;
      band.amax = std::max(band.amax, amax);
      band.inexact |= job.folded && !(decode >= 0x1p-100f) && amax > 0;
    }
    band.not_finite |= !finite;
    encode_scale[c] = e;
    multiplier[c] = mult;
    counted[c] = finite;
    if (k_scales != nullptr) k_scales[(c0 + c) * job.grid_cols + j] = decode;
  }
  // A non-finite block encodes with scale 0 (its values NaN through the multiplier): nothing saturates there,
  // and its flushes do not count, as in the general path.
  for (int64_t i = 0; i < n; ++i) {
    const In* row = m + (first_row + i) * R + c0;
    uint16_t* o = out + (first_row + i) * R + c0;
    int32_t saturated = 0, flushed = 0;
#pragma omp simd reduction(+ : saturated, flushed)
    for (int64_t c = 0; c < width; ++c) {
      const EncodedValue v = encode_nearest(load(row, c), encode_scale[c], job.round, job.fmax);
      saturated += v.saturated;
      flushed += v.flushed & counted[c];
      o[c] = static_cast<uint16_t>(std::bit_cast<uint32_t>(v.value * multiplier[c]) >> 16);
    }
    band.saturated += saturated;
    band.flushed += flushed;
  }
  return band;
}

template <typename In>
RowResult quantize_columns(const In* m, int64_t R, const RowJob& job, uint16_t* out, float* k_scales) {
  const int64_t C = job.C, bands = (R + kBand - 1) / kBand;
  return over_units(job.grid_cols * bands, R * C > (1 << 15), [&](int64_t u) {
    const int64_t j = u / bands, c0 = u % bands * kBand;
    return quantize_band(m, R, j * job.bc, std::min(job.bc, C - j * job.bc), c0, std::min(kBand, R - c0), job, j,
                         out, k_scales);
  });
}

// ---- the Backend's two passes (quantize_for_gemm's general path) ----

// encode_stochastic (tensor/scale_rules.h) without branches: the same value for every input. |v e| rounds up
// to the next grid value with probability (distance to the grid value below) / (grid step), drawn as
// round_to_minifloat_grid draws it: up when random < floor(fraction * 2^32). Below the smallest normal the
// fraction is that of |v e| in grid steps (a power-of-two scaling, exact); above it, the dropped mantissa bits.
inline EncodedValue encode_stochastic_fast(float v, float e, const FormatRounding& round, float fmax,
                                           bool nan_to_zero, uint32_t random) {
  const float scaled = e == 0 ? 0.0f : v * e;
  const float a = magnitude_of(scaled);
  // Below the smallest normal only (else 0, which the select below drops): a large a would make steps Inf, and
  // Inf - Inf a NaN whose conversion to an integer is undefined.
  const float steps = (a < round.min_normal ? a : 0.0f) * round.to_steps, whole = std::floor(steps);
  const uint64_t small_threshold = static_cast<uint64_t>((steps - whole) * 0x1p32f);
  const float small = (whole + static_cast<float>(random < small_threshold)) * round.step;
  const uint32_t bits = std::bit_cast<uint32_t>(a), dropped = bits & ~round.drop_mask;
  const uint32_t large_up = random < (static_cast<uint64_t>(dropped) << (32 - round.drop)) ? 1u : 0u;
  const float large = std::bit_cast<float>((bits & round.drop_mask) + (large_up << round.drop));
  const float rounded = a < round.min_normal ? small : large;  // Inf stays Inf (no bits dropped)
  float magnitude = fmax < rounded ? fmax : rounded;           // saturated, as float_to_minifloat's Saturate
  if (a != a) magnitude = nan_to_zero ? 0.0f : a;              // a format without NaN encodes NaN as zero
  const float value = with_sign_of(magnitude, scaled);
  return {value, round(a) > fmax, static_cast<bool>((v != 0) & (magnitude_of(v) <= FLT_MAX) & (value == 0))};
}

template <typename In>
std::vector<float> row_amax(const In* in, int64_t R, int64_t C, int64_t bc) {
  const int64_t grid_cols = (C + bc - 1) / bc;
  std::vector<float> amax(static_cast<size_t>(R * grid_cols));
#pragma omp parallel for schedule(static) if (R * C > (1 << 15))
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < grid_cols; ++j) {
      const In* p = in + r * C + j * bc;
      const int64_t n = std::min(bc, C - j * bc);
      uint32_t max_bits = 0;
#pragma omp simd reduction(max : max_bits)
      for (int64_t i = 0; i < n; ++i) max_bits = std::max(max_bits, magnitude_bits(p, i));
      amax[static_cast<size_t>(r * grid_cols + j)] = max_bits >= 0x7f800000u ? NAN : std::bit_cast<float>(max_bits);
    }
  return amax;
}

// One block's run of n values encoded with stochastic rounding, element i drawing Philox(key seed, counter
// (counter + i, stream)): the draws of a chunk first, then its values, each loop free of branches so that
// both vectorise, 16 lanes wide (NVFP4's runs are 16 values: wider vectors would leave them all to the
// scalar remainder loop).
struct StochasticRun {
  uint64_t counter, stream, seed;
  float e, multiplier;
  FormatRounding round;
  float fmax;
  bool nan_to_zero;
};

inline void store_value(uint16_t* out, int64_t i, float stored) {
  out[i] = static_cast<uint16_t>(std::bit_cast<uint32_t>(stored) >> 16);  // exact: the top half of the f32 value
}
inline void store_value(float* out, int64_t i, float stored) { out[i] = stored; }

template <typename In, typename Out>
EncodeCounts encode_stochastic_run(const In* __restrict in, int64_t n, const StochasticRun& run, Out* __restrict out) {
  constexpr int64_t kChunk = 64;
  alignas(64) uint32_t random[kChunk];
  const uint32_t stream_low = static_cast<uint32_t>(run.stream), stream_high = static_cast<uint32_t>(run.stream >> 32);
  const uint32_t seed_low = static_cast<uint32_t>(run.seed), seed_high = static_cast<uint32_t>(run.seed >> 32);
  // Locals, not the struct's fields, in the loops: a store through out could alias those, which stops vectorising.
  const uint64_t first_counter = run.counter;
  const float e = run.e, multiplier = run.multiplier, fmax = run.fmax;
  const FormatRounding round = run.round;
  const bool nan_to_zero = run.nan_to_zero;
  EncodeCounts counts;
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t width = std::min(kChunk, n - c0);
#pragma omp simd simdlen(16)
    for (int64_t i = 0; i < width; ++i) {
      const uint64_t counter = first_counter + static_cast<uint64_t>(c0 + i);
      uint32_t w0 = static_cast<uint32_t>(counter), w1 = static_cast<uint32_t>(counter >> 32), w2 = stream_low,
               w3 = stream_high;
      philox4x32_rounds(w0, w1, w2, w3, seed_low, seed_high);
      random[i] = w0;  // philox4x32(counter, stream, seed)[0]
    }
    int32_t saturated = 0, flushed = 0;
#pragma omp simd simdlen(16) reduction(+ : saturated, flushed)
    for (int64_t i = 0; i < width; ++i) {
      const EncodedValue v = encode_stochastic_fast(load(in, c0 + i), e, round, fmax, nan_to_zero, random[i]);
      saturated += v.saturated;
      flushed += v.flushed;
      store_value(out, c0 + i, v.value * multiplier);
    }
    counts.saturated += saturated;
    counts.flushed += flushed;
  }
  return counts;
}

// Encodes by plan; Out is uint16_t (bf16 bits: exact, the top half of the f32 product) or float.
template <typename In, typename Out>
EncodeCounts encode(const In* in, int64_t R, int64_t C, const BlockEncodePlan& plan, Out* out) {
  const int64_t br = plan.block_rows, bc = plan.block_cols, grid_cols = plan.grid_cols;
  const MinifloatFormat& f = element_format(plan.format);
  const FormatRounding round(f);
  const float fmax = format_max(plan.format);
  const auto store = [out](int64_t i, float stored) {
    if constexpr (std::is_same_v<Out, uint16_t>) out[i] = static_cast<uint16_t>(std::bit_cast<uint32_t>(stored) >> 16);
    else out[i] = stored;
  };
  // One run of a block's row: n values from `first`, encoded with `e`, each code value times `multiplier`
  // (tensor/scale_rules.h). Branch-free so that it vectorises; 32-bit counts within a run (at most C < 2^31
  // values) keep the vectorised loop at 16 lanes.
  const auto encode_run = [&](int64_t first, int64_t n, float e, float multiplier, int64_t& sat, int64_t& flush) {
    int32_t run_sat = 0, run_flush = 0;
    for (int64_t i = 0; i < n; ++i) {
      const EncodedValue v = encode_nearest(load(in, first + i), e, round, fmax);
      run_sat += v.saturated;
      run_flush += v.flushed;
      store(first + i, v.value * multiplier);
    }
    sat += run_sat;
    flush += run_flush;
  };
  // The same with stochastic rounding (NVFP4's gradients): element i draws Philox(seed, offset + i).
  const bool nan_to_zero = f.specials == MinifloatFormat::Specials::None;
  const auto encode_run_stochastic = [&](int64_t first, int64_t n, float e, float multiplier, int64_t& sat,
                                         int64_t& flush) {
    const StochasticRun run{plan.stochastic_offset + static_cast<uint64_t>(first), plan.stochastic_stream,
                            *plan.stochastic_seed, e, multiplier, round, fmax, nan_to_zero};
    const EncodeCounts counts = encode_stochastic_run(in + first, n, run, out + first);
    sat += counts.saturated;
    flush += counts.flushed;
  };
  int64_t saturated = 0, flushed = 0;
  // A NaN block's values count as neither saturated nor flushed (its scale already says what happened).
#pragma omp parallel for schedule(static) reduction(+ : saturated, flushed) if (R * C > (1 << 15))
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < grid_cols; ++j) {
      const size_t b = static_cast<size_t>(r / br * grid_cols + j);
      const float e = plan.encode[b], multiplier = plan.multiplier[b];
      const int64_t first = r * C + j * bc, n = std::min(bc, C - j * bc);
      int64_t block_saturated = 0, block_flushed = 0;
      if (plan.stochastic_seed) encode_run_stochastic(first, n, e, multiplier, block_saturated, block_flushed);
      else encode_run(first, n, e, multiplier, block_saturated, block_flushed);
      saturated += e == 0 ? 0 : block_saturated;
      flushed += std::isnan(plan.decode[b]) ? 0 : block_flushed;
    }
  return {saturated, flushed};
}

template <typename In>
EncodeCounts encode_into(const In* in, int64_t R, int64_t C, const BlockEncodePlan& plan, const Tensor& values) {
  if (values.dtype() == DType::BF16) return encode(in, R, C, plan, static_cast<uint16_t*>(values.data_ptr()));
  return encode(in, R, C, plan, static_cast<float*>(values.data_ptr()));
}

}  // namespace

bool row_blocks_apply(const Tensor& x, const QuantizeOptions& o) {
  const bool fp8 = o.format == DType::F8E4M3 || o.format == DType::F8E5M2;
  const bool scales = o.scale == BlockScale::Fp32 || o.scale == BlockScale::E8M0Floor || o.scale == BlockScale::E8M0Ceil;
  const bool layout = x.is_contiguous() || x.mT().is_contiguous();
  return x.device().is_cpu() && x.dim() == 2 && (x.dtype() == DType::BF16 || x.dtype() == DType::F32) && layout &&
         fp8 && scales && o.block_rows == 1 && o.block_cols >= 1 && o.block_cols < x.size(1) &&
         !o.reduce_tensor_amax && !o.reduce_row_amax && !o.stochastic_seed && x.size(1) < (int64_t{1} << 31);
}

bool quantize_row_blocks(const Tensor& x, const QuantizeOptions& options, const ScaleRule& rule, GemmOperand& op) {
  const int64_t R = x.size(0), C = x.size(1), bc = options.block_cols, grid_cols = (C + bc - 1) / bc;
  const bool folded = rule.kind != BlockScale::Fp32;
  const RowJob job{C, bc, grid_cols, &rule, FormatRounding(options.format == DType::F8E5M2 ? kE5M2 : kE4M3),
                   rule.format_max, folded};
  const bool transposed = !x.is_contiguous();  // x = M^T, M contiguous [C, R]
  op.values = transposed ? Tensor::empty({C, R}, DType::BF16).mT() : Tensor::empty({R, C}, DType::BF16);
  op.row_scale.clear();
  op.k_scales.assign(folded ? 0 : static_cast<size_t>(R * grid_cols), 0.0f);
  op.k_block = folded ? 0 : bc;
  op.tensor_scale = 1;
  uint16_t* out = static_cast<uint16_t*>(op.values.data_ptr());
  float* k_scales = folded ? nullptr : op.k_scales.data();
  const bool bf16 = x.dtype() == DType::BF16;
  const void* in = x.data_ptr();
  const RowResult all =
      transposed ? (bf16 ? quantize_columns(static_cast<const uint16_t*>(in), R, job, out, k_scales)
                         : quantize_columns(static_cast<const float*>(in), R, job, out, k_scales))
                 : (bf16 ? quantize_rows(static_cast<const uint16_t*>(in), R, job, out, k_scales)
                         : quantize_rows(static_cast<const float*>(in), R, job, out, k_scales));
  if (all.inexact) return false;
  op.amax = all.amax;
  op.saturated = all.saturated;
  op.flushed = all.flushed;
  return true;
}

}  // namespace mixtape::cpu

namespace mixtape {

// ---- the CPU's kernels of the Backend's quantization entry points (its defaults: host memory) ----

std::vector<float> Backend::quantize_row_amax_kernel(const Tensor& x, int64_t block_cols) {
  const int64_t R = x.size(0), C = x.size(1);
  if (x.dtype() == DType::BF16) return cpu::row_amax(static_cast<const uint16_t*>(x.data_ptr()), R, C, block_cols);
  return cpu::row_amax(static_cast<const float*>(x.data_ptr()), R, C, block_cols);
}

EncodeCounts Backend::quantize_encode_kernel(const Tensor& x, const BlockEncodePlan& plan, const Tensor& values) {
  check(values.dtype() == DType::BF16 || values.dtype() == DType::F32, "quantize_for_gemm: not supported: ",
        values.described(), " on the CPU (its GEMM operands hold bf16 or f32 values)");
  const int64_t R = x.size(0), C = x.size(1);
  check(C < (int64_t{1} << 31), "quantize_for_gemm: ", x.description(), " has rows of 2^31 or more values");
  if (x.dtype() == DType::BF16) return cpu::encode_into(static_cast<const uint16_t*>(x.data_ptr()), R, C, plan, values);
  return cpu::encode_into(static_cast<const float*>(x.data_ptr()), R, C, plan, values);
}

}  // namespace mixtape
