#include "tensor/scaled_linear.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <utility>

#include "tensor/autocast_state.h"
#include "tensor/autograd_node.h"
#include "tensor/minifloat.h"
#include "tensor/ops.h"
#include "tensor/random.h"

namespace mixtape {

namespace {

thread_local std::shared_ptr<LowPrecisionContext> active_context;

size_t index_of(TensorKind kind) { return static_cast<size_t>(kind); }

// The 16 x 16 random Hadamard transform of NVIDIA's NVFP4 recipe: Q = D H / 4, H the Sylvester Hadamard
// matrix (entries ±1) and D a diagonal of random signs drawn from `seed`. Q is orthogonal, so applying it to
// the summed dim of both wgrad operands leaves their product unchanged while it spreads outliers over 16
// values before they are quantized.
Tensor hadamard16(uint64_t seed) {
  std::vector<float> q(256);
  const std::array<uint32_t, 4> bits = philox4x32(0, 0x4841444d /* "HADM" */, seed);
  for (int r = 0; r < 16; ++r) {
    const float sign = (bits[0] >> r) & 1 ? -0.25f : 0.25f;
    for (int c = 0; c < 16; ++c) q[static_cast<size_t>(r * 16 + c)] = (std::popcount(uint32_t(r & c)) & 1 ? -1 : 1) * sign;
  }
  return Tensor::from_vector(q, {16, 16});
}

// x [R, C] with each full group of 16 columns multiplied by q (the last, shorter group is left as it is:
// the transform is orthogonal group by group, so the GEMM's result does not change either way).
Tensor apply_hadamard(const Tensor& x, const Tensor& q) {
  const int64_t R = x.size(0), C = x.size(1), full = C / 16 * 16;
  if (full == 0) return x;
  const Tensor x32 = x.to(DType::F32).contiguous();
  Tensor head = matmul(x32.slice(1, 0, full).reshape({R * (full / 16), 16}), q).reshape({R, full});
  if (full == C) return head;
  return cat({head, x32.slice(1, full, C)}, 1);
}

void check_linear_arguments(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  if (!x.defined() || !weight.defined() || !is_floating(x.dtype()) || !is_floating(weight.dtype()))
    fail("scaled_linear: expected floating input and weight, got ", x.description(), " and ", weight.description());
  if (x.dim() < 1 || weight.dim() != 2 || x.size(-1) != weight.size(1))
    fail("scaled_linear: input ", x.description(), " and weight ", weight.description(),
         ": expected input [..., K] and weight [N, K]");
  if (bias.defined() && (bias.dim() != 1 || bias.size(0) != weight.size(0) || !is_floating(bias.dtype())))
    fail("scaled_linear: bias ", bias.description(), " must be floating [N] = [", weight.size(0), "]");
  if (x.device() != weight.device() || (bias.defined() && bias.device() != weight.device()))
    fail("scaled_linear: input ", x.described(), ", weight ", weight.described(),
         bias.defined() ? ", bias " : "", bias.defined() ? bias.description() : "", ": expected one device");
}

}  // namespace

const char* tensor_kind_name(TensorKind kind) {
  switch (kind) {
    case TensorKind::Activation: return "activation";
    case TensorKind::Weight: return "weight";
    case TensorKind::Gradient: return "gradient";
    case TensorKind::Count: break;
  }
  return "invalid";
}

LowPrecisionContext::LowPrecisionContext(LowPrecisionRecipe recipe) : recipe_(recipe) {
  const LowPrecisionRecipe& r = recipe_;
  check(r.amax_history_len >= 1, "LowPrecisionRecipe: amax_history_len must be >= 1, got ", r.amax_history_len);
  check(r.margin >= 0 && r.margin <= 64, "LowPrecisionRecipe: margin must be 0..64, got ", r.margin);
  check(r.accumulator_bits >= 0 && r.accumulator_bits <= 23, "LowPrecisionRecipe: accumulator_bits must be 0..23, got ",
        r.accumulator_bits);
  check(r.block_size >= 1 && r.mx_block_size >= 1 && r.nvfp4_block_size >= 1, "LowPrecisionRecipe: block sizes "
        "must be >= 1, got ", r.block_size, ", ", r.mx_block_size, ", ", r.nvfp4_block_size);
  check(r.mx_scale_rounding == BlockScale::E8M0Floor || r.mx_scale_rounding == BlockScale::E8M0Ceil,
        "LowPrecisionRecipe: mx_scale_rounding must be e8m0_floor or e8m0_ceil, got ",
        block_scale_name(r.mx_scale_rounding));
  for (DType format : {r.forward_format, r.gradient_format}) format_max(format);  // an element format
}

void LowPrecisionContext::set_amax_reduction(AmaxReduction reduce_max, AmaxReduction reduce_max_in_eval) {
  reduce_max_ = std::move(reduce_max);
  reduce_max_in_eval_ = std::move(reduce_max_in_eval);
}

void LowPrecisionContext::set_k_split(const Tensor& weight, Gemm gemm, AmaxReduction reduce_max) {
  const auto found = states_.find(weight.impl_ptr().get());
  check(found != states_.end(), "LowPrecisionContext.set_k_split: the weight ", weight.described(),
        " is not covered (cover() it first)");
  found->second.k_split[static_cast<size_t>(gemm)] = std::move(reduce_max);
}

namespace {

// NaN cannot be MAX-reduced portably: it travels as +Inf (either makes the tensor's block NaN).
float nan_as_inf(float a) { return std::isnan(a) ? INFINITY : a; }

// `reduce` over a list of amaxes, NaN carried as +Inf (which makes the blocks it reaches NaN all the same).
std::function<void(std::span<float>)> nan_safe(AmaxReduction reduce) {
  return [reduce = std::move(reduce)](std::span<float> values) {
    for (float& v : values) v = nan_as_inf(v);
    reduce(values);
  };
}

}  // namespace

void LowPrecisionContext::cover(const Tensor& weight, const std::string& name) {
  check(weight.defined() && weight.dim() == 2, "LowPrecisionContext: ", name, " ", weight.description(),
        " is not a Linear weight [out, in]");
  Covered& covered = states_[weight.impl_ptr().get()];
  covered.name = name;
  covered.weight = weight;
  uint64_t hash = 1469598103934665603ull;  // FNV-1a of the name
  for (const unsigned char c : name) hash = (hash ^ c) * 1099511628211ull;
  covered.random_key = recipe_.seed ^ hash;
  covered.k_split = {};
  for (DelayedScaling& d : covered.state.tensors) d.history.assign(static_cast<size_t>(recipe_.amax_history_len), 0.0f);
}

QuantizeOptions LowPrecisionContext::options(TensorKind kind, const Tensor& weight, Gemm gemm, bool training) {
  const LowPrecisionRecipe& r = recipe_;
  QuantizeOptions o;
  o.format = kind == TensorKind::Gradient ? r.gradient_format : r.forward_format;
  const bool is_weight = kind == TensorKind::Weight;
  if (const auto& reduce = training ? reduce_max_ : reduce_max_in_eval_;
      reduce && (r.scaling == ScalingRecipe::CurrentTensorwise || r.scaling == ScalingRecipe::Nvfp4))
    o.reduce_tensor_amax = [reduce](float amax) {
      float value = nan_as_inf(amax);
      reduce(std::span<float>(&value, 1));
      return value;
    };
  switch (r.scaling) {
    case ScalingRecipe::CurrentTensorwise:
      o.power_of_two_scales = r.round_scales_to_power_of_2;
      break;
    case ScalingRecipe::DelayedTensorwise:
      o.fixed_scale = states_.at(weight.impl_ptr().get()).state.tensors[index_of(kind)].scale;
      break;
    case ScalingRecipe::Rowwise:
      o.block_rows = 1;
      o.power_of_two_scales = r.round_scales_to_power_of_2;
      if (const AmaxReduction& reduce = states_.at(weight.impl_ptr().get()).k_split[static_cast<size_t>(gemm)])
        o.reduce_row_amax = nan_safe(reduce);
      break;
    case ScalingRecipe::Block:
      o.block_rows = is_weight ? r.block_size : 1;
      o.block_cols = r.block_size;
      break;
    case ScalingRecipe::Mx:
      o.block_rows = 1;
      o.block_cols = r.mx_block_size;
      o.scale = r.mx_scale_rounding;
      break;
    case ScalingRecipe::Nvfp4:
      o.block_rows = is_weight ? r.nvfp4_block_size : 1;
      o.block_cols = r.nvfp4_block_size;
      o.scale = BlockScale::E4M3TwoLevel;
      break;
  }
  if (r.scaling == ScalingRecipe::Nvfp4 && kind == TensorKind::Gradient && r.stochastic_rounding) {
    // Each quantization draws its own stream: the layer's key, and (step, its place in the step) as the high
    // counter word; the element index is the low one.
    Covered& covered = states_.at(weight.impl_ptr().get());
    o.stochastic_seed = covered.random_key;
    o.stochastic_stream = steps_ << 24 | covered.quantized_this_step++;
  }
  return o;
}

void LowPrecisionContext::record(TensorKind kind, const Tensor& weight, const GemmOperand& q) {
  QuantizationCounts& c = counts_[index_of(kind)];
  c.values += q.values.numel();
  c.saturated += q.saturated;
  c.flushed += q.flushed;
  if (recipe_.scaling == ScalingRecipe::DelayedTensorwise) {
    float& now = states_.at(weight.impl_ptr().get()).state.tensors[index_of(kind)].history[0];
    now = std::isnan(q.amax) || std::isnan(now) ? NAN : std::max(now, q.amax);
  }
}

void LowPrecisionContext::end_step() {
  ++steps_;
  for (auto& [key, covered] : states_) covered.quantized_this_step = 0;
  if (recipe_.scaling != ScalingRecipe::DelayedTensorwise) return;
  if (reduce_max_) {  // this step's amaxes, MAX over the processes holding parts of each tensor, by name
    std::map<std::string, Covered*> by_name;  // the same order on every rank (addresses differ)
    for (auto& [key, covered] : states_) by_name[covered.name] = &covered;
    std::vector<float> now;
    for (auto& [name, covered] : by_name)
      for (DelayedScaling& d : covered->state.tensors) now.push_back(nan_as_inf(d.history[0]));
    reduce_max_(now);
    size_t i = 0;
    for (auto& [name, covered] : by_name)
      for (DelayedScaling& d : covered->state.tensors) d.history[0] = now[i++];
  }
  for (auto& [key, covered] : states_)
    for (size_t k = 0; k < covered.state.tensors.size(); ++k) {
      DelayedScaling& d = covered.state.tensors[k];
      // TE's _default_sf_compute: amax by the algorithm, scale = fp8_max / amax / 2^margin, the old scale
      // kept where the amax is 0 or not finite. Then the history rolls: the newest amax moves to slot 1 and
      // slot 0 starts the next step at 0.
      float amax = d.history[0];
      if (recipe_.amax_compute_algo == AmaxComputeAlgo::Max)
        for (float a : d.history) amax = std::isnan(a) || std::isnan(amax) ? NAN : std::max(amax, a);
      const DType format = k == index_of(TensorKind::Gradient) ? recipe_.gradient_format : recipe_.forward_format;
      const float scale = format_max(format) / amax / std::ldexp(1.0f, static_cast<int>(recipe_.margin));
      if (amax > 0 && std::isfinite(amax) && std::isfinite(scale)) d.scale = scale;
      std::rotate(d.history.rbegin(), d.history.rbegin() + 1, d.history.rend());
      d.history[0] = 0;
    }
}

std::map<std::string, DelayedScaling> LowPrecisionContext::scaling_state() const {
  std::map<std::string, DelayedScaling> out;
  for (const auto& [key, covered] : states_)
    for (size_t k = 0; k < covered.state.tensors.size(); ++k)
      out[covered.name + "." + tensor_kind_name(static_cast<TensorKind>(k))] = covered.state.tensors[k];
  return out;
}

void LowPrecisionContext::load_scaling_state(const std::map<std::string, DelayedScaling>& state) {
  for (int pass = 0; pass < 2; ++pass)  // check everything, then change
    for (auto& [key, covered] : states_)
      for (size_t k = 0; k < covered.state.tensors.size(); ++k) {
        const std::string name = covered.name + "." + tensor_kind_name(static_cast<TensorKind>(k));
        const auto found = state.find(name);
        check(found != state.end(), "LowPrecisionContext: the scaling state has no entry for ", name);
        check(found->second.history.size() == static_cast<size_t>(recipe_.amax_history_len),
              "LowPrecisionContext: ", name, " has an amax history of ", found->second.history.size(),
              " steps; this recipe's amax_history_len is ", recipe_.amax_history_len);
        check(std::isfinite(found->second.scale) && found->second.scale > 0, "LowPrecisionContext: ", name,
              " has scale ", found->second.scale, "; expected a positive finite value");
        if (pass == 1) covered.state.tensors[k] = found->second;
      }
}

LowPrecisionScope::LowPrecisionScope(std::shared_ptr<LowPrecisionContext> context)
    : previous_(std::exchange(active_context, std::move(context))) {}
LowPrecisionScope::~LowPrecisionScope() { active_context = std::move(previous_); }
const std::shared_ptr<LowPrecisionContext>& active_low_precision_context() { return active_context; }

Tensor scaled_linear(const Tensor& x, const Tensor& weight, const Tensor& bias,
                     const std::shared_ptr<LowPrecisionContext>& context) {
  check_linear_arguments(x, weight, bias);
  check(context != nullptr && context->covers(weight), "scaled_linear: the weight ", weight.described(),
        " is not covered by the low-precision context");
  // The GEMMs, the bias and the Hadamard transform run in fp32 whatever autocast scope is open around the layer.
  AutocastScope no_autocast(std::nullopt);
  const int64_t K = weight.size(1), N = weight.size(0), rows = shape_numel(x.shape()) / std::max<int64_t>(K, 1);
  const Tensor x2 = x.detach().reshape({rows, K}), w = weight.detach();
  LowPrecisionContext& ctx = *context;
  // Only a training forward (grad mode on) feeds the amax histories and the counts: an evaluation quantizes with
  // the scales in use and leaves the recipe's state as training left it.
  const bool training = grad_enabled();
  Tensor out32;
  {
    NoGradGuard no_grad;
    const GemmOperand qx = quantize_for_gemm(x2, ctx.options(TensorKind::Activation, weight, Gemm::Forward, training));
    const GemmOperand qw = quantize_for_gemm(w, ctx.options(TensorKind::Weight, weight, Gemm::Forward, training));
    if (training) {
      ctx.record(TensorKind::Activation, weight, qx);
      ctx.record(TensorKind::Weight, weight, qw);
    }
    out32 = scaled_matmul(qx, qw, ctx.recipe().accumulator_bits);
    if (bias.defined()) out32.add_(bias.detach().to(DType::F32));  // in place: out32 is this layer's own
  }
  Shape out_shape = x.shape();
  out_shape.back() = N;
  Tensor out = out32.to(DType::BF16).reshape(out_shape).detach();

  const bool x_grad = x.requires_grad(), w_grad = weight.requires_grad(), b_grad = bias.defined() && bias.requires_grad();
  const DType x_dtype = x.dtype(), w_dtype = weight.dtype(), b_dtype = bias.defined() ? bias.dtype() : DType::F32;
  const Shape x_shape = x.shape();
  // weight_key is the weight's own handle (its identity keys the context's state; a leaf, so no cycle).
  auto backward = [context, weight_key = weight, x2, w, x_grad, w_grad, b_grad, x_dtype, w_dtype, b_dtype,
                   x_shape, rows, N](const Tensor& g) {
    LowPrecisionContext& ctx = *context;
    Grads grads(3);
    const Tensor g2 = g.reshape({rows, N});
    if (x_grad) {  // dgrad: g [rows, N] @ (Wᵀ [K, N])ᵀ
      const GemmOperand qg = quantize_for_gemm(g2, ctx.options(TensorKind::Gradient, weight_key, Gemm::Dgrad));
      ctx.record(TensorKind::Gradient, weight_key, qg);
      const GemmOperand qwt = quantize_for_gemm(w.mT(), ctx.options(TensorKind::Weight, weight_key, Gemm::Dgrad));
      grads[0] = scaled_matmul(qg, qwt, ctx.recipe().accumulator_bits).to(x_dtype).reshape(x_shape);
    }
    if (w_grad) {  // wgrad: gᵀ [N, rows] @ (xᵀ [K, rows])ᵀ
      Tensor gt = g2.mT(), xt = x2.mT();
      if (ctx.recipe().scaling == ScalingRecipe::Nvfp4 && ctx.recipe().random_hadamard_transform) {
        const Tensor q = hadamard16(ctx.recipe().seed).to(gt.device());
        gt = apply_hadamard(gt, q);
        xt = apply_hadamard(xt, q);
      }
      const GemmOperand qgt = quantize_for_gemm(gt, ctx.options(TensorKind::Gradient, weight_key, Gemm::Wgrad));
      const GemmOperand qxt = quantize_for_gemm(xt, ctx.options(TensorKind::Activation, weight_key, Gemm::Wgrad));
      if (!x_grad) ctx.record(TensorKind::Gradient, weight_key, qgt);
      grads[1] = scaled_matmul(qgt, qxt, ctx.recipe().accumulator_bits).to(w_dtype);
    }
    if (b_grad) grads[2] = sum_to(g.to(DType::F32), {N}).to(b_dtype);
    return grads;
  };
  record_backward("scaled_linear", {x, weight, bias}, out, std::move(backward), {x2, w});
  return out;
}

}  // namespace mixtape
