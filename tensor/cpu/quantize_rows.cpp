#include "tensor/cpu/quantize_rows.h"

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>

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
    row.inexact |= job.folded && !(decode >= 0x1p-100f);
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

template <typename In>
RowResult quantize_rows(const In* in, int64_t R, const RowJob& job, uint16_t* out, float* k_scales) {
  int64_t saturated = 0, flushed = 0;
  float amax = 0;
  int not_finite = 0, inexact = 0;
#pragma omp parallel for schedule(static) reduction(+ : saturated, flushed) reduction(max : amax) \
    reduction(| : not_finite, inexact) if (R * job.C > (1 << 15))
  for (int64_t r = 0; r < R; ++r) {
    const RowResult row = quantize_row(in, r, job, out, k_scales);
    saturated += row.saturated;
    flushed += row.flushed;
    amax = std::max(amax, row.amax);
    not_finite |= row.not_finite;
    inexact |= row.inexact;
  }
  RowResult all;
  all.saturated = saturated;
  all.flushed = flushed;
  all.amax = not_finite ? NAN : amax;
  all.inexact = inexact;
  return all;
}

}  // namespace

bool row_blocks_apply(const Tensor& x, const QuantizeOptions& o) {
  const bool fp8 = o.format == DType::F8E4M3 || o.format == DType::F8E5M2;
  const bool scales = o.scale == BlockScale::Fp32 || o.scale == BlockScale::E8M0Floor || o.scale == BlockScale::E8M0Ceil;
  return x.device().is_cpu() && x.dim() == 2 && fp8 && scales && o.block_rows == 1 && o.block_cols >= 1 &&
         o.block_cols < x.size(1) && !o.reduce_tensor_amax && !o.reduce_row_amax && !o.stochastic_seed &&
         x.size(1) < (int64_t{1} << 31);
}

bool quantize_row_blocks(const Tensor& x, const QuantizeOptions& options, const ScaleRule& rule, GemmOperand& op) {
  const int64_t R = x.size(0), C = x.size(1), bc = options.block_cols, grid_cols = (C + bc - 1) / bc;
  const bool folded = rule.kind != BlockScale::Fp32;
  const RowJob job{C, bc, grid_cols, &rule, FormatRounding(options.format == DType::F8E5M2 ? kE5M2 : kE4M3),
                   rule.format_max, folded};
  op.values = Tensor::empty({R, C}, DType::BF16);
  op.row_scale.clear();
  op.k_scales.assign(folded ? 0 : static_cast<size_t>(R * grid_cols), 0.0f);
  op.k_block = folded ? 0 : bc;
  op.tensor_scale = 1;
  uint16_t* out = static_cast<uint16_t*>(op.values.data_ptr());
  float* k_scales = folded ? nullptr : op.k_scales.data();
  const RowResult all = x.dtype() == DType::BF16
                            ? quantize_rows(static_cast<const uint16_t*>(x.data_ptr()), R, job, out, k_scales)
                            : quantize_rows(static_cast<const float*>(x.data_ptr()), R, job, out, k_scales);
  if (all.inexact) return false;
  op.amax = all.amax;
  op.saturated = all.saturated;
  op.flushed = all.flushed;
  return true;
}

}  // namespace mixtape::cpu
