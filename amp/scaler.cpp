#include "amp/scaler.h"

#include <charconv>
#include <cmath>
#include <limits>
#include <string>
#include <system_error>
#include <vector>

#include "tensor/autograd_node.h"
#include "tensor/ops.h"

namespace mixtape {

namespace {

// Shortest decimal text that reads back to the same double: a reloaded scale is bit-identical.
std::string format_number(double value) {
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof buffer, value);
  return std::string(buffer, result.ptr);
}

const std::string& entry(const char* who, const std::map<std::string, std::string>& state,
                         const std::string& key) {
  const auto it = state.find(key);
  check(it != state.end(), who, ".load_state_dict: missing entry \"", key, "\"");
  return it->second;
}

double read_number(const char* who, const std::map<std::string, std::string>& state, const std::string& key) {
  const std::string& text = entry(who, state, key);
  double value = 0;
  const auto result = std::from_chars(text.data(), text.data() + text.size(), value);
  check(result.ec == std::errc() && result.ptr == text.data() + text.size(), who,
        ".load_state_dict: entry \"", key, "\" is \"", text, "\", expected a number");
  return value;
}

int64_t read_integer(const char* who, const std::map<std::string, std::string>& state, const std::string& key) {
  const std::string& text = entry(who, state, key);
  int64_t value = 0;
  const auto result = std::from_chars(text.data(), text.data() + text.size(), value);
  check(result.ec == std::errc() && result.ptr == text.data() + text.size(), who,
        ".load_state_dict: entry \"", key, "\" is \"", text, "\", expected an integer");
  return value;
}

void check_type(const char* who, const std::map<std::string, std::string>& state) {
  const std::string& type = entry(who, state, "type");
  check(type == who, who, ".load_state_dict: the state is of a \"", type, "\", expected \"", who, "\"");
}

void check_scale(const char* who, const char* option, double value) {
  check(std::isfinite(value) && value > 0, who, ": ", option, " must be finite and > 0, got ", value);
}
void check_growth(const char* who, const char* option, double value) {
  check(std::isfinite(value) && value > 1, who, ": ", option, " must be finite and > 1, got ", value);
}
void check_backoff(const char* who, const char* option, double value) {
  check(value > 0 && value < 1, who, ": ", option, " must be in (0, 1), got ", value);
}
void check_at_least_one(const char* who, const char* option, int64_t value) {
  check(value >= 1, who, ": ", option, " must be >= 1, got ", value);
}

}  // namespace

Tensor LossScaler::scale(const Tensor& loss) const {
  check(loss.defined(), name(), ".scale: the loss is an undefined tensor");
  check(is_floating(loss.dtype()), name(), ".scale: the loss is ", loss.description(),
        ", expected a floating tensor");
  if (scale_ == 1.0) return loss;
  return mul(loss, scale_);
}

// ---------------------------------------------------------------------------------------------- GradScaler

GradScaler::GradScaler(GradScalerOptions options) : LossScaler(options.init_scale), options_(options) {
  check_scale("GradScaler", "init_scale", options.init_scale);
  check_growth("GradScaler", "growth_factor", options.growth_factor);
  check_backoff("GradScaler", "backoff_factor", options.backoff_factor);
  check_at_least_one("GradScaler", "growth_interval", options.growth_interval);
  if (!options.enabled) scale_ = 1.0;  // PyTorch's get_scale() of a disabled scaler
}

Tensor GradScaler::scale(const Tensor& loss) const {
  if (!options_.enabled) return loss;
  return LossScaler::scale(loss);
}

void GradScaler::unscale(Optimizer& optimizer) {
  if (!options_.enabled) return;
  OptimizerState& state = per_optimizer_[&optimizer];
  check(state.stage != Stage::Unscaled,
        "GradScaler.unscale: unscale() has already been called on this optimizer since the last update()");
  check(state.stage != Stage::Stepped, "GradScaler.unscale: unscale() is being called after step()");

  NoGradGuard no_grad;
  std::vector<Tensor> grads;
  for (const Tensor& param : optimizer.params()) {
    Tensor grad = param.grad();
    if (!grad.defined()) continue;
    check(grad.dtype() != DType::F16, "GradScaler.unscale: attempting to unscale FP16 gradients (",
          grad.description(), "); keep f32 master weights (amp/optimizer) for f16 parameters");
    if (!grad.is_contiguous()) {
      // A set_grad() view may alias itself (stride 0): give the parameter its own contiguous gradient.
      grad = grad.contiguous();
      Tensor(param).set_grad(grad);
    }
    grads.push_back(grad);
  }
  // 1/S in double, then rounded to fp32: PyTorch's scale.double().reciprocal().float().
  const double inv_scale = static_cast<float>(1.0 / scale_);
  state.found_inf = unscale_and_check_finite(grads, inv_scale);
  state.stage = Stage::Unscaled;
}

bool GradScaler::step(Optimizer& optimizer) {
  if (!options_.enabled) {
    optimizer.step();
    return true;
  }
  {
    const auto it = per_optimizer_.find(&optimizer);
    check(it == per_optimizer_.end() || it->second.stage != Stage::Stepped,
          "GradScaler.step: step() has already been called since the last update()");
  }
  if (per_optimizer_[&optimizer].stage == Stage::Ready) unscale(optimizer);
  OptimizerState& state = per_optimizer_[&optimizer];
  const bool stepped = !state.found_inf;
  if (stepped) optimizer.step();
  state.stage = Stage::Stepped;
  return stepped;
}

void GradScaler::update() {
  if (!options_.enabled) return;
  check(!per_optimizer_.empty(), "GradScaler.update: no inf checks were recorded prior to update() ",
        "(call unscale() or step() first)");
  bool found_inf = false;
  for (const auto& [optimizer, state] : per_optimizer_) found_inf = found_inf || state.found_inf;
  update(found_inf);
}

void GradScaler::update(bool found_inf) {
  if (!options_.enabled) return;
  if (found_inf) {
    scale_ *= options_.backoff_factor;
    growth_tracker_ = 0;
  } else if (++growth_tracker_ == options_.growth_interval) {
    // PyTorch keeps S in an fp32 tensor and keeps a grown S only if it is finite there.
    const double grown = scale_ * options_.growth_factor;
    if (std::isfinite(static_cast<float>(grown))) scale_ = grown;
    growth_tracker_ = 0;
  }
  per_optimizer_.clear();
}

std::map<std::string, std::string> GradScaler::state_dict() const {
  if (!options_.enabled) return {};
  return {{"type", name()},
          {"scale", format_number(scale_)},
          {"growth_factor", format_number(options_.growth_factor)},
          {"backoff_factor", format_number(options_.backoff_factor)},
          {"growth_interval", std::to_string(options_.growth_interval)},
          {"growth_tracker", std::to_string(growth_tracker_)}};
}

void GradScaler::load_state_dict(const std::map<std::string, std::string>& state) {
  check(options_.enabled, "GradScaler.load_state_dict: this scaler is disabled");
  check(!state.empty(), "GradScaler.load_state_dict: the state is empty, possibly because it was saved ",
        "from a disabled GradScaler");
  check_type(name(), state);
  GradScalerOptions options = options_;
  options.init_scale = read_number(name(), state, "scale");
  options.growth_factor = read_number(name(), state, "growth_factor");
  options.backoff_factor = read_number(name(), state, "backoff_factor");
  options.growth_interval = read_integer(name(), state, "growth_interval");
  const int64_t tracker = read_integer(name(), state, "growth_tracker");
  const GradScaler checked(options);  // validates every option before anything is assigned
  check(tracker >= 0 && tracker < options.growth_interval, "GradScaler.load_state_dict: growth_tracker ",
        tracker, " is outside [0, growth_interval ", options.growth_interval, ")");
  options_ = options;
  scale_ = options.init_scale;
  growth_tracker_ = tracker;
  per_optimizer_.clear();
}

// ---------------------------------------------------------------------------------------- DynamicLossScaler

DynamicLossScaler::DynamicLossScaler(DynamicLossScalerOptions options)
    : LossScaler(options.initial_scale), options_(options), hysteresis_tracker_(options.hysteresis) {
  const char* who = "DynamicLossScaler";
  check_scale(who, "initial_scale", options.initial_scale);
  check_scale(who, "min_scale", options.min_scale);
  check(!std::isnan(options.max_scale) && options.max_scale > 0, who, ": max_scale must be > 0, got ",
        options.max_scale);
  check(options.min_scale <= options.max_scale, who, ": min_scale ", options.min_scale,
        " must be <= max_scale ", options.max_scale);
  check(options.initial_scale >= options.min_scale && options.initial_scale <= options.max_scale, who,
        ": initial_scale ", options.initial_scale, " must be within [min_scale ", options.min_scale,
        ", max_scale ", options.max_scale, "]");
  check_growth(who, "growth_factor", options.growth_factor);
  check_backoff(who, "backoff_factor", options.backoff_factor);
  check_at_least_one(who, "growth_interval", options.growth_interval);
  check_at_least_one(who, "hysteresis", options.hysteresis);
}

// Megatron-LM's DynamicGradScaler.update, rule for rule. Differences: Megatron has no max_scale (Colossal-AI
// has, as min(S * growth, max_scale)); Megatron keeps S in fp32, we in double (equal for the powers of two
// the defaults produce). Colossal-AI counts hysteresis up from 0 instead of down from `hysteresis`: the same
// sequence of scales.
void DynamicLossScaler::update(bool found_inf) {
  if (found_inf) {
    growth_tracker_ = 0;
    hysteresis_tracker_ -= 1;
    if (hysteresis_tracker_ <= 0) scale_ = std::max(scale_ * options_.backoff_factor, options_.min_scale);
  } else {
    growth_tracker_ += 1;
    if (growth_tracker_ == options_.growth_interval) {
      growth_tracker_ = 0;
      hysteresis_tracker_ = options_.hysteresis;
      scale_ = std::min(scale_ * options_.growth_factor, options_.max_scale);
    }
  }
}

std::map<std::string, std::string> DynamicLossScaler::state_dict() const {
  return {{"type", name()},
          {"scale", format_number(scale_)},
          {"growth_tracker", std::to_string(growth_tracker_)},
          {"hysteresis_tracker", std::to_string(hysteresis_tracker_)}};
}

// Megatron's state_dict holds only the scale and the two trackers; the options come from the constructor.
void DynamicLossScaler::load_state_dict(const std::map<std::string, std::string>& state) {
  check_type(name(), state);
  const double scale = read_number(name(), state, "scale");
  const int64_t growth = read_integer(name(), state, "growth_tracker");
  const int64_t hysteresis = read_integer(name(), state, "hysteresis_tracker");
  check(std::isfinite(scale) && scale > 0, "DynamicLossScaler.load_state_dict: scale must be finite and > 0, ",
        "got ", scale);
  check(growth >= 0 && growth < options_.growth_interval, "DynamicLossScaler.load_state_dict: growth_tracker ",
        growth, " is outside [0, growth_interval ", options_.growth_interval, ")");
  check(hysteresis <= options_.hysteresis, "DynamicLossScaler.load_state_dict: hysteresis_tracker ",
        hysteresis, " exceeds hysteresis ", options_.hysteresis);
  scale_ = scale;
  growth_tracker_ = growth;
  hysteresis_tracker_ = hysteresis;
}

// Checked against apex/amp/scaler.py LossScaler.unscale_and_update: overflow: S /= 2 (later versions:
// max(min_loss_scale, S / 2) when min_loss_scale is set), unskipped = 0; clean: unskipped += 1; then, in the
// same call, unskipped == scale_window: S = min(max_loss_scale, S * 2), unskipped = 0. Apex's factor is a
// fixed 2; scale_factor generalises it as growth = scale_factor, backoff = 1 / scale_factor.
// Checked against apex/amp/scaler.py LossScaler.unscale_and_update: overflow: S /= 2 (later versions:
// max(min_loss_scale, S / 2) when min_loss_scale is set), unskipped = 0; clean: unskipped += 1; then, in the
// same call, unskipped == scale_window: S = min(max_loss_scale, S * 2), unskipped = 0. Apex's factor is a
// fixed 2; scale_factor generalises it as growth = scale_factor, backoff = 1 / scale_factor.
DynamicLossScaler apex_dynamic_scaler(double init_scale, int64_t scale_window,
                                      std::optional<double> min_loss_scale, double max_loss_scale,
                                      double scale_factor) {
  check(std::isfinite(scale_factor) && scale_factor > 1, "apex_dynamic_scaler: scale_factor must be finite ",
        "and > 1, got ", scale_factor);
  check_scale("apex_dynamic_scaler", "init_scale", init_scale);
  check_at_least_one("apex_dynamic_scaler", "scale_window", scale_window);
  if (min_loss_scale) check_scale("apex_dynamic_scaler", "min_loss_scale", *min_loss_scale);
  DynamicLossScalerOptions options;
  options.initial_scale = init_scale;
  options.min_scale = min_loss_scale.value_or(std::numeric_limits<double>::denorm_min());
  options.max_scale = max_loss_scale;
  options.growth_factor = scale_factor;
  options.backoff_factor = 1.0 / scale_factor;
  options.growth_interval = scale_window;
  options.hysteresis = 1;  // Apex backs off on every overflow
  return DynamicLossScaler(options);
}

// ----------------------------------------------------------------------------------------- StaticLossScaler

StaticLossScaler::StaticLossScaler(double scale) : LossScaler(scale) {
  check_scale("StaticLossScaler", "scale", scale);
}

std::map<std::string, std::string> StaticLossScaler::state_dict() const {
  return {{"type", name()}, {"scale", format_number(scale_)}};
}

void StaticLossScaler::load_state_dict(const std::map<std::string, std::string>& state) {
  check_type(name(), state);
  const double scale = read_number(name(), state, "scale");
  check_scale("StaticLossScaler.load_state_dict", "scale", scale);
  scale_ = scale;
}

}  // namespace mixtape
