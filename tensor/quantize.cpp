#include "tensor/quantize.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

#include "tensor/autocast_state.h"
#include "tensor/backend.h"
#include "tensor/cpu/gemm_f32_out.h"
#include "tensor/cpu/quantize_kernels.h"
#include "tensor/autograd_node.h"
#include "tensor/minifloat.h"
#include "tensor/ops.h"

namespace mixtape {

const MinifloatFormat& element_format(DType format) {
  switch (format) {
    case DType::F8E4M3: return kE4M3;
    case DType::F8E5M2: return kE5M2;
    case DType::F4E2M1: return kE2M1;
    default: fail("quantize: format ", dtype_name(format), " is not an element format (expected f8e4m3, f8e5m2 "
                  "or f4e2m1)");
  }
}

namespace {

// The exponent of a format's largest finite value (OCP MX's emax_elem): 8 for E4M3, 15 for E5M2, 2 for E2M1.
int format_emax(DType format) { return floor_log2(format_max(format)); }

// Every code's value, for the 8-bit formats (E2M1 uses the first 16 entries).
struct DecodeTable {
  std::array<float, 256> value{};
  explicit DecodeTable(DType format) {
    if (format == DType::F8E8M0) {
      for (int code = 0; code < 256; ++code) value[code] = e8m0_to_float(static_cast<uint8_t>(code));
      return;
    }
    const MinifloatFormat& f = element_format(format);
    for (uint32_t code = 0; code < (1u << f.bits()); ++code) value[code] = minifloat_to_float(code, f);
  }
};

const DecodeTable& decode_table(DType format) {
  static const DecodeTable e4m3(DType::F8E4M3), e5m2(DType::F8E5M2), e2m1(DType::F4E2M1), e8m0(DType::F8E8M0);
  switch (format) {
    case DType::F8E4M3: return e4m3;
    case DType::F8E5M2: return e5m2;
    case DType::F4E2M1: return e2m1;
    case DType::F8E8M0: return e8m0;
    default: fail("decode: ", dtype_name(format), " is not a format of tensor/minifloat.h");
  }
}

// Reads and writes codes of any format in a dense byte buffer (F4E2M1 packed).
uint32_t code_at(const uint8_t* data, DType format, int64_t i) {
  return format == DType::F4E2M1 ? e2m1_code_at(data, i) : data[i];
}
void set_code(uint8_t* data, DType format, int64_t i, uint32_t code) {
  if (format == DType::F4E2M1) set_e2m1_code(data, i, static_cast<uint8_t>(code));
  else data[i] = static_cast<uint8_t>(code);
}

// The storage offset (in elements) of element `linear` of t in row-major order.
int64_t strided_offset(const Tensor& t, int64_t linear) {
  int64_t offset = t.offset();
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    const int64_t size = t.size(d);
    offset += (linear % size) * t.strides()[d];
    linear /= size;
  }
  return offset;
}

// A CPU tensor of a minifloat format, every byte 0 (fill() computes in floating dtypes only).
Tensor zeroed_codes(const Shape& shape, DType format) {
  Tensor t = Tensor::empty(shape, format);
  std::memset(t.data_ptr(), 0, t.storage()->nbytes());
  return t;
}

void check_cpu(const Tensor& t, const char* op) {
  if (!t.device().is_cpu())
    fail(op, ": not supported: ", t.described(), " on ", t.device().str(),
         " (fp8 and fp4 conversions run on the CPU for now; move the tensor with to(Device::cpu()))");
}

// The decode scale of every block of q as floats, [grid_rows * grid_cols].
std::vector<float> block_scales(const Quantized& q) {
  const Tensor& s = q.scales;
  std::vector<float> out(static_cast<size_t>(s.numel()));
  if (s.dtype() == DType::F32) {
    const float* p = static_cast<const float*>(s.data_ptr());
    std::copy(p, p + s.numel(), out.begin());
  } else {
    const DecodeTable& table = decode_table(s.dtype());
    const uint8_t* p = static_cast<const uint8_t*>(s.data_ptr());
    for (int64_t i = 0; i < s.numel(); ++i) out[static_cast<size_t>(i)] = table.value[p[i]];
  }
  return out;
}

// The scale rule of the options (tensor/scale_rules.h).
ScaleRule scale_rule(const QuantizeOptions& o) {
  ScaleRule rule;
  rule.kind = o.scale;
  rule.format_max = format_max(o.format);
  rule.format_emax = format_emax(o.format);
  rule.has_fixed_scale = o.fixed_scale.has_value();
  rule.fixed_scale = o.fixed_scale.value_or(1.0f);
  rule.power_of_two_scales = o.power_of_two_scales;
  return rule;
}

// Whether the tensor's amax is reduced over processes: one scale for the whole tensor, decided by the options
// (not the local shape, so that every process calls the collective).
bool reduces_tensor_amax(const QuantizeOptions& o) {
  return o.reduce_tensor_amax && o.block_rows == 0 && o.block_cols == 0 && !o.fixed_scale && o.scale == BlockScale::Fp32;
}
// NVFP4's fp32 tensor scale, over the blocks' E4M3 scales.
bool reduces_nvfp4_tensor_amax(const QuantizeOptions& o) {
  return o.reduce_tensor_amax && o.scale == BlockScale::E4M3TwoLevel;
}
// Per-row scales of rows split along their columns over processes (QuantizeOptions::reduce_row_amax).
bool reduces_row_amax(const QuantizeOptions& o) {
  return o.reduce_row_amax && o.block_rows == 1 && o.block_cols == 0 && !o.fixed_scale;
}

// The reductions over processes that keep the per-block amaxes' shape: NVFP4's tensor amax (returned) and, for
// per-row scales of rows split along their columns, the R rows' amaxes in place (one block per row; R values on
// every process, zeros where it holds no columns).
float reduce_row_and_nvfp4_amaxes(const QuantizeOptions& o, std::vector<float>& row_amax, int64_t R, float amax) {
  if (reduces_nvfp4_tensor_amax(o)) amax = o.reduce_tensor_amax(amax);
  if (reduces_row_amax(o)) {
    std::vector<float> zeros;
    if (row_amax.empty()) zeros.assign(static_cast<size_t>(R), 0.0f);
    o.reduce_row_amax(row_amax.empty() ? std::span<float>(zeros) : std::span<float>(row_amax));
  }
  return amax;
}

void validate(const Tensor& x, const QuantizeOptions& o) {
  if (!x.defined() || x.dim() != 2 || !is_floating(x.dtype()))
    fail("quantize: expected a 2-d f32, f16, bf16 or f64 tensor [rows, cols], got ", x.description());
  element_format(o.format);  // an Error naming the format otherwise
  if (o.block_rows < 0 || o.block_cols < 0)
    fail("quantize: block_rows ", o.block_rows, " and block_cols ", o.block_cols, " must be >= 0 (0: the whole dim)");
  if (o.power_of_two_scales && o.scale != BlockScale::Fp32)
    fail("quantize: power_of_two_scales needs scale fp32, got ", block_scale_name(o.scale));
  if (o.fixed_scale && (o.scale != BlockScale::Fp32 || !(std::isfinite(*o.fixed_scale) && *o.fixed_scale > 0)))
    fail("quantize: fixed_scale ", *o.fixed_scale, " needs scale fp32 (got ", block_scale_name(o.scale),
         ") and a positive finite value");
  if (o.scale == BlockScale::E4M3TwoLevel && o.format != DType::F4E2M1)
    fail("quantize: scale e4m3_two_level is NVFP4's and needs format f4e2m1, got ", dtype_name(o.format));
}

}  // namespace

float format_max(DType format) {
  switch (format) {
    case DType::F8E4M3: return kE4M3Max;
    case DType::F8E5M2: return kE5M2Max;
    case DType::F4E2M1: return kE2M1Max;
    default: fail("format_max: ", dtype_name(format), " is not an element format (expected f8e4m3, f8e5m2 or f4e2m1)");
  }
}

const char* block_scale_name(BlockScale scale) {
  switch (scale) {
    case BlockScale::Fp32: return "fp32";
    case BlockScale::E8M0Floor: return "e8m0_floor";
    case BlockScale::E8M0Ceil: return "e8m0_ceil";
    case BlockScale::E4M3TwoLevel: return "e4m3_two_level";
  }
  return "invalid";
}

Quantized quantize(const Tensor& x, const QuantizeOptions& options) {
  validate(x, options);
  check_cpu(x, "quantize");
  NoGradGuard no_grad;
  const Tensor xs = x.to(DType::F32).contiguous();
  const float* in = static_cast<const float*>(xs.data_ptr());
  const int64_t R = xs.size(0), C = xs.size(1);
  Quantized q;
  q.block_rows = options.block_rows == 0 ? std::max<int64_t>(R, 1) : options.block_rows;
  q.block_cols = options.block_cols == 0 ? std::max<int64_t>(C, 1) : options.block_cols;
  const int64_t grid_rows = (R + q.block_rows - 1) / q.block_rows, grid_cols = (C + q.block_cols - 1) / q.block_cols;
  const int64_t blocks = grid_rows * grid_cols;

  // Step 1: each block's amax, NaN where it holds a non-finite value; the tensor's amax (reduced over the
  // processes holding parts of the tensor, when the options say so).
  std::vector<float> block_amax(static_cast<size_t>(blocks), 0.0f);
  float amax = 0;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      const float v = std::fabs(in[r * C + c]);
      float& b = block_amax[static_cast<size_t>(r / q.block_rows * grid_cols + c / q.block_cols)];
      if (!std::isfinite(v)) b = NAN;
      else if (v > b) b = v;  // a NaN b stays NaN (the comparison is false)
      if (std::isnan(v) || std::isnan(amax)) amax = NAN;
      else amax = std::max(amax, v);
    }
  if (reduces_tensor_amax(options)) {
    amax = options.reduce_tensor_amax(amax);
    for (float& b : block_amax) b = std::isfinite(amax) ? amax : NAN;
  }
  amax = reduce_row_and_nvfp4_amaxes(options, block_amax, R, amax);
  q.amax = amax;

  // Step 2: the tensor scale (NVFP4) and each block's scale.
  const DType scale_dtype = options.scale == BlockScale::Fp32 ? DType::F32
                            : options.scale == BlockScale::E4M3TwoLevel ? DType::F8E4M3 : DType::F8E8M0;
  float tensor_encode = 1, tensor_decode = 1;
  if (options.scale == BlockScale::E4M3TwoLevel) {
    tensor_encode = !std::isfinite(amax) ? NAN : amax == 0 ? 1.0f : std::min(kE4M3Max * kE2M1Max / amax, FLT_MAX);
    tensor_decode = 1.0f / tensor_encode;
    q.tensor_scale = tensor_decode;
  }
  q.scales = Tensor::empty({grid_rows, grid_cols}, scale_dtype);
  std::vector<float> encode(static_cast<size_t>(blocks));
  std::vector<char> nan_block(static_cast<size_t>(blocks), 0);
  for (int64_t b = 0; b < blocks; ++b) {
    const float a = block_amax[static_cast<size_t>(b)];
    BlockScaling s{0, NAN, scale_dtype == DType::F8E4M3 ? static_cast<uint8_t>(0x7F) : kE8M0Nan};
    nan_block[static_cast<size_t>(b)] = !(std::isfinite(a) && std::isfinite(tensor_encode));
    if (!nan_block[static_cast<size_t>(b)])
      s = choose_block_scale(scale_rule(options), a, tensor_encode, tensor_decode);
    else
      s.encode = 0;  // a non-finite block: NaN decode scale, zero codes
    encode[static_cast<size_t>(b)] = s.encode;
    if (scale_dtype == DType::F32) static_cast<float*>(q.scales.data_ptr())[b] = s.decode;
    else static_cast<uint8_t*>(q.scales.data_ptr())[b] = s.decode_code;
  }

  // Step 3: the codes, saturating, counting what saturated and what flushed to zero.
  const MinifloatFormat& f = element_format(options.format);
  const float fmax = format_max(options.format);
  q.codes = zeroed_codes({R, C}, options.format);
  uint8_t* out = static_cast<uint8_t*>(q.codes.data_ptr());
  int64_t saturated = 0, flushed = 0;
  const bool packed = options.format == DType::F4E2M1;
  // Rows are independent except that two E2M1 codes share a byte: with an odd C a row ends mid-byte, so the
  // packed format is written by one thread.
#pragma omp parallel for schedule(static) reduction(+ : saturated, flushed) if (!packed && R * C > (1 << 15))
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) {
      const int64_t i = r * C + c;
      const size_t block = static_cast<size_t>(r / q.block_rows * grid_cols + c / q.block_cols);
      const float e = encode[block];
      const float scaled = in[i] * e;
      uint32_t random = 0;
      if (options.stochastic_seed)
        random = philox4x32(options.stochastic_offset + static_cast<uint64_t>(i), options.stochastic_stream,
                            *options.stochastic_seed)[0];
      // A zero encode scale is a NaN block (its decode scale says so) or an all-but-zero NVFP4 block: code 0.
      const uint32_t code = float_to_minifloat(e == 0 ? 0.0f : scaled, f, FormatOverflow::Saturate,
                                               options.stochastic_seed ? &random : nullptr);
      // Saturated: the clamp changed the result (beyond the largest finite value after rounding, not a value
      // such as 6.0000005 that rounds to 6 anyway; a finite value whose scaling overflowed to Inf too).
      if (e != 0 && std::fabs(scaled) > fmax &&
          (std::isinf(scaled) ||
           round_to_minifloat_grid(std::bit_cast<uint32_t>(std::fabs(scaled)), f) > f.max_finite_code()))
        ++saturated;
      // Flushed: a nonzero value of a block with a scale that became 0 (not one whose scale is NaN).
      if (in[i] != 0 && std::isfinite(in[i]) && !nan_block[block] && (code & f.magnitude_mask()) == 0) ++flushed;
      set_code(out, options.format, i, code);
    }
  }
  q.saturated = saturated;
  q.flushed = flushed;
  return q;
}

Tensor dequantize(const Quantized& q) {
  check(q.codes.defined() && q.codes.dim() == 2 && q.scales.defined(), "dequantize: the Quantized is empty");
  const int64_t R = q.rows(), C = q.cols();
  const int64_t grid_cols = (C + q.block_cols - 1) / q.block_cols;
  const std::vector<float> scales = block_scales(q);
  const DecodeTable& table = decode_table(q.codes.dtype());
  const uint8_t* codes = static_cast<const uint8_t*>(q.codes.data_ptr());
  Tensor out = Tensor::empty({R, C}, DType::F32);
  float* o = static_cast<float*>(out.data_ptr());
  const DType format = q.codes.dtype();
#pragma omp parallel for schedule(static) if (R * C > (1 << 15))
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      const int64_t i = r * C + c;
      const float scale = scales[static_cast<size_t>(r / q.block_rows * grid_cols + c / q.block_cols)];
      // code * block scale first: exact for E2M1 x E4M3 (NVFP4) and for power-of-two scales.
      o[i] = table.value[code_at(codes, format, i)] * scale * q.tensor_scale;
    }
  return out;
}

Tensor scaled_matmul(const Quantized& a, const Quantized& b) {
  if (a.cols() != b.cols())
    fail("scaled_matmul: a ", a.codes.description(), " and b ", b.codes.description(),
         " must share their last dim K (a [M, K] @ b [N, K]^T)");
  NoGradGuard no_grad;
  AutocastScope fp32_sums(std::nullopt);  // an open bf16 autocast would round the operands and the sums
  const int64_t M = a.rows(), N = b.rows(), K = a.cols();
  const bool scales_along_k_constant = a.block_cols >= K && b.block_cols >= K;
  if (!scales_along_k_constant) return matmul(dequantize(a), dequantize(b).mT());

  // Tensorwise / rowwise: sum the code products (exact in fp32: at most 4 + 4 significant bits each), then
  // scale each output by its row's and column's decode scales.
  auto code_values = [](const Quantized& q) {
    Quantized unit = q;
    unit.scales = Tensor::ones({1, 1});
    unit.block_rows = std::max<int64_t>(q.rows(), 1);
    unit.block_cols = std::max<int64_t>(q.cols(), 1);
    unit.tensor_scale = 1;
    return dequantize(unit);
  };
  Tensor out = matmul(code_values(a), code_values(b).mT()).contiguous();
  const std::vector<float> sa = block_scales(a), sb = block_scales(b);
  const float tensor = a.tensor_scale * b.tensor_scale;
  float* o = static_cast<float*>(out.data_ptr());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n)
      o[m * N + n] *= sa[static_cast<size_t>(m / a.block_rows)] * sb[static_cast<size_t>(n / b.block_rows)] * tensor;
  return out;
}

// ---- the training path ----------------------------------------------------------------------------------

namespace {

// Whether code_value * scale is exact in bf16 for every code of an 8-bit or E2M1 format: products of at most
// 4 + 4 significant bits, far from bf16's subnormals (a power-of-two scale at or above 2^-100, or NVFP4's E4M3
// block scales). A block of zeros (amax 0) holds only zeros, which any scale keeps exact.
bool product_exact_in_bf16(BlockScale kind, const std::vector<float>& decode, const std::vector<float>& block_amax) {
  if (kind == BlockScale::E4M3TwoLevel) return true;
  if (kind != BlockScale::E8M0Floor && kind != BlockScale::E8M0Ceil) return false;
  for (size_t b = 0; b < decode.size(); ++b)
    if (!(decode[b] >= 0x1p-100f) && !std::isnan(decode[b]) && block_amax[b] != 0) return false;
  return true;
}

}  // namespace

namespace {

// Step 1 of quantize_for_gemm: each block's max |x| (NaN for a block holding Inf or NaN) from each row's runs
// along the block columns, and the tensor's (reduced over processes where the options say so).
struct BlockAmax {
  std::vector<float> blocks;  // [grid_rows * grid_cols]
  float tensor = 0;
};

BlockAmax combine_block_amax(std::vector<float> row_amax, int64_t R, int64_t br, int64_t grid_rows, int64_t grid_cols,
                             const QuantizeOptions& options) {
  BlockAmax out;
  float amax = 0;
  for (const float a : row_amax) amax = std::isnan(a) || std::isnan(amax) ? NAN : std::max(a, amax);
  // Every process calls the reduction, whatever its local shape (a rank may hold no rows).
  if (reduces_tensor_amax(options)) {
    amax = options.reduce_tensor_amax(amax);
    for (float& a : row_amax) a = std::isnan(a) || std::isnan(amax) ? NAN : amax;  // the one block's amax
  }
  amax = reduce_row_and_nvfp4_amaxes(options, row_amax, R, amax);
  out.tensor = amax;
  if (br == 1) {
    out.blocks = std::move(row_amax);  // one row per block: the rows' maxima are the blocks'
    return out;
  }
  out.blocks.assign(static_cast<size_t>(grid_rows * grid_cols), 0.0f);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < grid_cols; ++j) {
      const float a = row_amax[static_cast<size_t>(r * grid_cols + j)];
      float& b = out.blocks[static_cast<size_t>(r / br * grid_cols + j)];
      b = std::isnan(a) || std::isnan(b) ? NAN : std::max(a, b);
    }
  return out;
}

// Step 2: every block's encode and decode scale by the options' rule (a block holding Inf or NaN, or a
// non-finite NVFP4 tensor scale: encode 0, decode NaN); the NVFP4 tensor decode scale into op.
void choose_scales(const BlockAmax& amax, const QuantizeOptions& options, BlockEncodePlan& plan, GemmOperand& op) {
  float tensor_encode = 1, tensor_decode = 1;
  if (options.scale == BlockScale::E4M3TwoLevel) {
    const float a = amax.tensor;
    tensor_encode = !std::isfinite(a) ? NAN : a == 0 ? 1.0f : std::min(kE4M3Max * kE2M1Max / a, FLT_MAX);
    tensor_decode = 1.0f / tensor_encode;
    op.tensor_scale = tensor_decode;
  }
  const std::vector<float>& block_amax = amax.blocks;
  plan.encode.resize(block_amax.size());
  plan.decode.resize(block_amax.size());
  const int64_t blocks = static_cast<int64_t>(block_amax.size());
  const ScaleRule rule = scale_rule(options);
#pragma omp parallel for schedule(static) if (blocks > 4096)
  for (int64_t i = 0; i < blocks; ++i) {
    const size_t b = static_cast<size_t>(i);
    if (std::isfinite(block_amax[b]) && std::isfinite(tensor_encode)) {
      const BlockScaling s = choose_block_scale(rule, block_amax[b], tensor_encode, tensor_decode);
      plan.encode[b] = s.encode;
      plan.decode[b] = s.decode;
    } else {
      plan.encode[b] = 0;
      plan.decode[b] = NAN;
    }
  }
}

// Step 3: the operand's form (where the scales go) and the values' dtype; fills op's scales and plan.multiplier.
DType choose_form(int64_t R, int64_t C, int64_t br, int64_t bc, const QuantizeOptions& options, Device device,
                  const BlockAmax& amax, BlockEncodePlan& plan, GemmOperand& op) {
  const std::vector<float>& decode = plan.decode;
  const int64_t grid_cols = plan.grid_cols;
  const bool post_scaled = bc >= C;  // one scale per row along K: the codes go in, the scales come after
  const bool folded = !post_scaled && product_exact_in_bf16(options.scale, decode, amax.blocks);
  // fp32 scales along K (DeepSeek-V3's tiles): the codes go in, and each K block's partial product is scaled
  // and summed in fp32, as DeepSeek-V3 promotes its fp8 partial sums every 128 of K.
  const bool k_blocked = !post_scaled && !folded && options.scale == BlockScale::Fp32;
  if (post_scaled) {
    op.row_scale.resize(static_cast<size_t>(R));
    // (No blocks where C is 0: the product over an empty K is zero whatever the scale.)
    for (int64_t r = 0; r < R; ++r)
      op.row_scale[static_cast<size_t>(r)] = decode.empty() ? 1.0f : decode[static_cast<size_t>(r / br)];
  } else if (k_blocked) {
    op.k_block = bc;
    op.k_scales.resize(static_cast<size_t>(R * grid_cols));
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < grid_cols; ++j)
        op.k_scales[static_cast<size_t>(r * grid_cols + j)] = decode[static_cast<size_t>(r / br * grid_cols + j)];
  } else if (!folded) {
    op.tensor_scale = 1;  // the f32 values below are fully dequantized
  }
  // Each code value is stored times this (nothing when post-scaled or blocked along K, else the block scale:
  // exact in bf16 where folded, in f32 one rounding as dequantize() computes it, whose tensor scale is 1
  // there). A NaN block (encode 0, decode NaN) stores NaN: its values are not numbers.
  plan.multiplier.resize(decode.size());
  for (size_t b = 0; b < decode.size(); ++b)
    plan.multiplier[b] = post_scaled || k_blocked ? (std::isnan(decode[b]) ? NAN : 1.0f) : decode[b];
  // A tensorwise operand on CUDA keeps its fp8 codes for the fp8 tensor cores.
  const bool tensorwise = post_scaled && br >= R && R > 0 && C > 0;
  if (tensorwise && device.is_cuda() && options.format != DType::F4E2M1) return options.format;
  return post_scaled || folded || k_blocked ? DType::BF16 : DType::F32;
}

}  // namespace

GemmOperand quantize_for_gemm(const Tensor& x, const QuantizeOptions& options) {
  validate(x, options);
  NoGradGuard no_grad;
  AutocastScope fp32(std::nullopt);
  // The CPU's kernels read bf16 as it is (no f32 copy); other devices take f32.
  const bool as_is = x.device().is_cpu() && (x.dtype() == DType::BF16 || x.dtype() == DType::F32);
  if (as_is && cpu::row_blocks_apply(x, options)) {  // one pass (tensor/cpu/quantize_kernels.h)
    GemmOperand op;
    if (cpu::quantize_row_blocks(x, options, scale_rule(options), op)) return op;
  }
  // One scale for a transposed input: its memory's order quantized, the GEMM given the transposed view (with
  // one scale the order changes nothing, but for the elements' stochastic draws, numbered in the view's order).
  if (as_is && !x.is_contiguous() && x.mT().is_contiguous() && options.block_rows == 0 && options.block_cols == 0 &&
      !options.stochastic_seed) {
    GemmOperand op = quantize_for_gemm(x.mT(), options);
    op.values = op.values.mT();
    if (!op.row_scale.empty()) op.row_scale.assign(static_cast<size_t>(x.size(0)), op.row_scale.front());
    return op;
  }
  const Tensor xs = as_is ? x.contiguous() : x.to(DType::F32).contiguous();
  Backend& backend = backend_of(xs);
  const int64_t R = xs.size(0), C = xs.size(1);
  const int64_t br = options.block_rows == 0 ? std::max<int64_t>(R, 1) : options.block_rows;
  const int64_t bc = options.block_cols == 0 ? std::max<int64_t>(C, 1) : options.block_cols;
  const int64_t grid_rows = (R + br - 1) / br, grid_cols = (C + bc - 1) / bc;
  GemmOperand op;
  BlockEncodePlan plan;
  plan.format = options.format;
  plan.block_rows = br;
  plan.block_cols = bc;
  plan.grid_cols = grid_cols;
  plan.stochastic_seed = options.stochastic_seed;
  plan.stochastic_offset = options.stochastic_offset;
  plan.stochastic_stream = options.stochastic_stream;

  const BlockAmax amax = combine_block_amax(backend.quantize_row_amax(xs, bc), R, br, grid_rows, grid_cols, options);
  op.amax = amax.tensor;
  choose_scales(amax, options, plan, op);
  const DType values_dtype = choose_form(R, C, br, bc, options, xs.device(), amax, plan, op);
  op.values = Tensor::empty({R, C}, values_dtype, xs.device());
  const EncodeCounts counts = backend.quantize_encode(xs, plan, op.values);
  op.saturated = counts.saturated;
  op.flushed = counts.flushed;
  return op;
}

namespace {

// x rounded to nearest even at `bits` mantissa bits (Inf and NaN unchanged).
float round_mantissa(float x, int bits) {
  uint32_t u = std::bit_cast<uint32_t>(x);
  if ((u & 0x7f800000u) == 0x7f800000u || bits >= 23) return x;
  const int drop = 23 - bits;
  u = (u + ((1u << (drop - 1)) - 1) + ((u >> drop) & 1u)) & ~((1u << drop) - 1);
  return std::bit_cast<float>(u);
}

// a[:, k0:k1] @ b[:, k0:k1]ᵀ into out (f32 [M, N]): in fp32 at once, or with a narrow accumulator (see
// scaled_matmul) one chunk of kAccumulatorChunk products at a time.
void sum_products(const Tensor& a, const Tensor& b, int64_t k0, int64_t k1, int accumulator_bits, const Tensor& out) {
  if (accumulator_bits == 0) {
    cpu::gemm_nt_f32_out(a.narrow(1, k0, k1 - k0), b.narrow(1, k0, k1 - k0), out);
    return;
  }
  const int64_t M = out.size(0), N = out.size(1);
  Tensor chunk = Tensor::empty({M, N}, DType::F32);
  float* o = static_cast<float*>(out.data_ptr());
  const float* c = static_cast<const float*>(chunk.data_ptr());
  for (int64_t k = k0; k < k1; k += kAccumulatorChunk) {
    cpu::gemm_nt_f32_out(a.narrow(1, k, std::min(kAccumulatorChunk, k1 - k)),
                         b.narrow(1, k, std::min(kAccumulatorChunk, k1 - k)), chunk);
#pragma omp parallel for schedule(static) if (M * N > (1 << 15))
    for (int64_t i = 0; i < M * N; ++i)
      o[i] = round_mantissa(k == k0 ? c[i] : o[i] + c[i], accumulator_bits);
  }
}

}  // namespace

Tensor scaled_matmul(const GemmOperand& a, const GemmOperand& b, int accumulator_bits) {
  check(accumulator_bits >= 0 && accumulator_bits <= 23, "scaled_matmul: accumulator_bits ", accumulator_bits,
        " must be 0 (fp32) or 1..23");
  check(a.values.dim() == 2 && b.values.dim() == 2 && a.values.size(1) == b.values.size(1),
        "scaled_matmul: a ", a.values.description(), " and b ", b.values.description(),
        " must share their last dim K (a [M, K] @ b [N, K]^T)");
  check(a.values.device() == b.values.device(), "scaled_matmul: a ", a.values.described(), " and b ",
        b.values.described(), " must be on one device");
  if (a.k_block > 0 || b.k_block > 0)
    check(a.k_block == b.k_block && a.values.dtype() == DType::BF16 && b.values.dtype() == DType::BF16,
          "scaled_matmul: operands blocked along K by ", a.k_block, " and ", b.k_block, "; expected the same");
  NoGradGuard no_grad;
  AutocastScope fp32(std::nullopt);
  Tensor out = Tensor::empty({a.values.size(0), b.values.size(0)}, DType::F32, a.values.device());
  backend_of(out).scaled_gemm(a, b, accumulator_bits, out);
  return out;
}

void Backend::scaled_gemm_kernel(const GemmOperand& a, const GemmOperand& b, int accumulator_bits, const Tensor& out) {
  check(a.values.dtype() != DType::F8E4M3 && a.values.dtype() != DType::F8E5M2 &&
            b.values.dtype() != DType::F8E4M3 && b.values.dtype() != DType::F8E5M2,
        "scaled_matmul: not supported: fp8 code operands ", a.values.described(), " and ", b.values.described(),
        " on the CPU (its quantize_for_gemm gives bf16 or f32 values)");
  const int64_t M = a.values.size(0), N = b.values.size(0), K = a.values.size(1);
  if (a.k_block > 0 || b.k_block > 0) {
    // Codes in, one GEMM per K block, each partial product scaled by its rows' and columns' block scales and
    // added in fp32 (DeepSeek-V3's promotion).
    const int64_t kb = a.k_block, blocks = (K + kb - 1) / kb;
    Tensor partial = Tensor::empty({M, N}, DType::F32);
    float* o = static_cast<float*>(out.data_ptr());
    const float* p = static_cast<const float*>(partial.data_ptr());
    std::vector<float> column_scales(static_cast<size_t>(N));  // b's scales of block j, contiguous
    // Block 0's product goes straight into out and is scaled in the pass that adds block 1's: one pass fewer.
    std::vector<float> first_scales(static_cast<size_t>(N));
    for (int64_t n = 0; n < N; ++n) first_scales[static_cast<size_t>(n)] = b.k_scales[static_cast<size_t>(n * blocks)];
    const float* cs0 = first_scales.data();
    sum_products(a.values, b.values, 0, std::min(kb, K), accumulator_bits, out);
    if (blocks == 1) {
#pragma omp parallel for schedule(static) if (M * N > (1 << 15))
      for (int64_t m = 0; m < M; ++m) {
        const float sa0 = a.k_scales[static_cast<size_t>(m * blocks)];
        float* o_row = o + m * N;
#pragma omp simd
        for (int64_t n = 0; n < N; ++n) o_row[n] = o_row[n] * (sa0 * cs0[n]);
      }
      return;
    }
    for (int64_t j = 1; j < blocks; ++j) {
      const int64_t k0 = j * kb, n_k = std::min(kb, K - k0);
      sum_products(a.values, b.values, k0, k0 + n_k, accumulator_bits, partial);
      for (int64_t n = 0; n < N; ++n)
        column_scales[static_cast<size_t>(n)] = b.k_scales[static_cast<size_t>(n * blocks + j)];
      const float* cs = column_scales.data();
#pragma omp parallel for schedule(static) if (M * N > (1 << 15))
      for (int64_t m = 0; m < M; ++m) {
        const float sa = a.k_scales[static_cast<size_t>(m * blocks + j)];
        float* o_row = o + m * N;
        const float* p_row = p + m * N;
        if (j == 1) {
          const float sa0 = a.k_scales[static_cast<size_t>(m * blocks)];
#pragma omp simd
          for (int64_t n = 0; n < N; ++n) {
            const float first = o_row[n] * (sa0 * cs0[n]);
            o_row[n] = first + p_row[n] * (sa * cs[n]);
          }
        } else {
#pragma omp simd
          for (int64_t n = 0; n < N; ++n) o_row[n] += p_row[n] * (sa * cs[n]);
        }
      }
    }
    return;
  }
  if (a.values.dtype() == b.values.dtype()) {
    sum_products(a.values, b.values, 0, K, accumulator_bits, out);
  } else {  // one operand f32: the other's exact bf16 values widen exactly
    sum_products(a.values.to(DType::F32).contiguous(), b.values.to(DType::F32).contiguous(), 0, K, accumulator_bits, out);
  }
  const float tensor = a.tensor_scale * b.tensor_scale;
  if (a.row_scale.empty() && b.row_scale.empty() && tensor == 1) return;
  float* o = static_cast<float*>(out.data_ptr());
#pragma omp parallel for schedule(static) if (M * N > (1 << 15))
  for (int64_t m = 0; m < M; ++m) {
    const float row = a.row_scale.empty() ? 1.0f : a.row_scale[static_cast<size_t>(m)];
    for (int64_t n = 0; n < N; ++n)  // the order of quantize()'s scaled_matmul: row, column, tensor
      o[m * N + n] *= row * (b.row_scale.empty() ? 1.0f : b.row_scale[static_cast<size_t>(n)]) * tensor;
  }
}

Tensor convert_minifloat(const Tensor& x, DType target) {
  check(x.defined(), "to(", dtype_name(target), "): the tensor is undefined");
  const DType source = x.dtype();
  const char* op = "to";
  if (!(is_floating(source) || is_minifloat(source)) || !(is_floating(target) || is_minifloat(target)))
    fail("to(", dtype_name(target), "): not supported from ", x.description(),
         ": fp8 and fp4 convert to and from floating dtypes only (convert integers through f32)");
  check_cpu(x, op);
  NoGradGuard no_grad;
  const int64_t n = x.numel();
  // Read every source value as a float (f64 rounded to odd first, so that the second rounding is exact).
  std::vector<float> values(static_cast<size_t>(n));
  if (is_minifloat(source)) {
    const DecodeTable& table = decode_table(source);
    const uint8_t* p = static_cast<const uint8_t*>(x.storage()->data());
    for (int64_t i = 0; i < n; ++i)
      values[static_cast<size_t>(i)] =
          table.value[source == DType::F4E2M1 ? e2m1_code_at(p, i) : p[strided_offset(x, i)]];
  } else if (source == DType::F64) {
    const Tensor dense = x.contiguous();
    const double* p = static_cast<const double*>(dense.data_ptr());
    for (int64_t i = 0; i < n; ++i) values[static_cast<size_t>(i)] = double_to_float_round_to_odd(p[i]);
  } else {
    const Tensor dense = x.to(DType::F32).contiguous();
    std::copy_n(static_cast<const float*>(dense.data_ptr()), n, values.begin());
  }

  if (is_floating(target)) return Tensor::from_vector(values, x.shape(), target);
  Tensor out = zeroed_codes(x.shape(), target);
  uint8_t* o = static_cast<uint8_t*>(out.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    const float v = values[static_cast<size_t>(i)];
    if (target == DType::F8E8M0) {
      o[i] = float_to_e8m0(v);
      continue;
    }
    if (target == DType::F4E2M1 && std::isnan(v))
      fail("to(f4e2m1): element ", i, " of ", x.description(), " is NaN, which f4e2m1 cannot hold (it has no NaN)");
    set_code(o, target, i, float_to_minifloat(v, element_format(target), FormatOverflow::Cast));
  }
  return out;
}

}  // namespace mixtape
