#include "amp/scaler.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "io/state_dict.h"
#include "tensor/autograd_node.h"
#include "tensor/error.h"
#include "tensor/ops.h"

namespace mixtape {

namespace {

using State = std::map<std::string, std::string>;

// `prefix` is put before each entry's name in errors: "scaler.0." where the state is a part of a checkpoint's
// metadata (load_scaler_states), so that the message names the entry as the file holds it.
std::string entry_name(std::string_view prefix, std::string_view key) {
  std::string name(prefix);
  name.append(key);
  // Appended piece by piece: GCC 12 warns falsely (-Wrestrict) on "'" + std::string here.
  std::string quoted(1, '\'');
  quoted.append(echo(name));
  quoted.push_back('\'');
  return quoted;
}

const std::string& entry(const char* who, const State& state, const std::string& key, std::string_view prefix) {
  const auto it = state.find(key);
  check(it != state.end(), who, ".load_state_dict: missing entry ", entry_name(prefix, key));
  return it->second;
}

double read_number(const char* who, const State& state, const std::string& key, std::string_view prefix) {
  const std::string& text = entry(who, state, key, prefix);
  const std::optional<double> value = number_from_text<double>(text);
  if (!value.has_value())
    fail(who, ".load_state_dict: entry ", entry_name(prefix, key), " is \"", echo(text), "\", expected a number");
  return *value;
}

int64_t read_integer(const char* who, const State& state, const std::string& key, std::string_view prefix) {
  const std::string& text = entry(who, state, key, prefix);
  const std::optional<int64_t> value = number_from_text<int64_t>(text);
  if (!value.has_value())
    fail(who, ".load_state_dict: entry ", entry_name(prefix, key), " is \"", echo(text),
         "\", expected an integer");
  return *value;
}

// The type first (a state of another scaler names its type, not its entries), then no entry beyond `known`.
void check_type_and_entries(const char* who, const State& state, std::initializer_list<const char*> known,
                            std::string_view prefix) {
  const std::string& type = entry(who, state, "type", prefix);
  if (type != who) fail(who, ".load_state_dict: the state is of a \"", echo(type), "\", expected \"", who, "\"");
  for (const auto& [key, value] : state) {
    if (std::find(known.begin(), known.end(), key) != known.end()) continue;
    std::string expected;
    for (const char* name : known) expected += (expected.empty() ? "" : ", ") + std::string(name);
    fail(who, ".load_state_dict: unknown entry ", entry_name(prefix, key), " (expected only ", expected, ")");
  }
}

// `who` names the scaler and call ("GradScaler", "GradScaler.load_state_dict"), `what` the option or entry.
void check_growth(const std::string& who, const std::string& what, double value) {
  check(std::isfinite(value) && value > 1, who, ": ", what, " must be finite and > 1, got ",
        exact_number_text(value));
}
void check_backoff(const std::string& who, const std::string& what, double value) {
  check(value > 0 && value < 1, who, ": ", what, " must be in (0, 1), got ", exact_number_text(value));
}
void check_at_least_one(const std::string& who, const std::string& what, int64_t value) {
  check(value >= 1, who, ": ", what, " must be >= 1, got ", value);
}

// `value` rounded to fp32 as IEEE rounds it (to nearest, ties to even), spelled out beyond FLT_MAX, where a
// double-to-float conversion is not to be relied on: from the midpoint of FLT_MAX and 2^128 on, inf; below
// it, FLT_MAX (3.4028235e38, FLT_MAX's usual printed form, is such a value).
double fp32_or_inf(double value) {
  const double magnitude = std::abs(value);
  if (magnitude >= 0x1p128 - 0x1p103) return std::copysign(INFINITY, value);
  if (magnitude > std::numeric_limits<float>::max())
    return std::copysign(static_cast<double>(std::numeric_limits<float>::max()), value);
  return static_cast<float>(value);  // NaN stays NaN
}

// A scale bound as printed: Apex's rule without min_loss_scale floors at the smallest positive double
// (apex_dynamic_scaler), which is "none" to the user.
std::string bound_text(double value) {
  return value == std::numeric_limits<double>::denorm_min() ? "none (Apex's min_loss_scale None)"
                                                            : exact_number_text(value);
}

// A saved rule option against this scaler's own.
void check_same_option(const char* who, const char* option, double saved, double own) {
  check(saved == own, who, ".load_state_dict: the state was saved with ", option, " ", bound_text(saved),
        ", this scaler has ", option, " ", bound_text(own), " (a state resumes only under its own rule)");
}
void check_same_option(const char* who, const char* option, int64_t saved, int64_t own) {
  check(saved == own, who, ".load_state_dict: the state was saved with ", option, " ", saved,
        ", this scaler has ", option, " ", own, " (a state resumes only under its own rule)");
}

}  // namespace

void check_loss_scale(std::string_view who, std::string_view what, double value) {
  const bool usable = value >= kMinLossScale && std::isfinite(fp32_or_inf(value));  // false for NaN
  check(usable, who, ": ", what, " ", exact_number_text(value), " is not a usable loss scale: expected a ",
        "positive finite scale whose fp32 reciprocal is finite (>= ", exact_number_text(kMinLossScale),
        ", 2^-128 + 2^-149) and that is finite in fp32 (<= ", exact_number_text(kMaxLossScale),
        ", FLT_MAX, once rounded to fp32): the loss is multiplied by the scale and the gradients by 1/scale "
        "in fp32");
}

Tensor LossScaler::scale(const Tensor& loss) const {
  check(loss.defined(), name(), ".scale: the loss is an undefined tensor");
  check(is_floating(loss.dtype()), name(), ".scale: the loss is ", loss.described(),
        ", expected a floating tensor");
  if (scale_ == 1.0) return loss;
  return mul(loss, scale_);
}

std::vector<Tensor> LossScaler::scale(const std::vector<Tensor>& outputs) const {
  for (size_t i = 0; i < outputs.size(); ++i) {
    check(outputs[i].defined(), name(), ".scale: output ", i, " of ", outputs.size(),
          " is an undefined tensor");
    check(is_floating(outputs[i].dtype()), name(), ".scale: output ", i, " of ", outputs.size(), " is ",
          outputs[i].described(), ", expected a floating tensor");
  }
  std::vector<Tensor> scaled;
  scaled.reserve(outputs.size());
  for (const Tensor& output : outputs) scaled.push_back(scale(output));
  return scaled;
}

// ---------------------------------------------------------------------------------------------- GradScaler

namespace {

// PyTorch keeps S in an fp32 tensor: the initial scale is rounded to fp32, and every update computes
// S * factor in double and rounds it to fp32 (_amp_update_scale_), so a factor that is not a power of two
// gives PyTorch's sequence bit for bit.
// `keeper` names whose fp32 the value is kept in, for the error.
double fp32_scale(const char* who, const char* what, double scale,
                  const char* keeper = "PyTorch's GradScaler keeps its scale") {
  const double rounded = fp32_or_inf(scale);
  check(std::isfinite(rounded) && rounded > 0, who, ": ", what, " ", exact_number_text(scale),
        " is not a finite positive number in fp32, where ", keeper);
  return rounded;
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options) : LossScaler(options.init_scale), options_(options) {
  check_loss_scale("GradScaler", "init_scale", options.init_scale);
  scale_ = fp32_scale("GradScaler", "init_scale", options.init_scale);
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
  if (const auto it = per_optimizer_.find(&optimizer); it != per_optimizer_.end()) {
    check(it->second.stage != Stage::Unscaled,
          "GradScaler.unscale: unscale() has already been called on this optimizer since the last update()");
    check(it->second.stage != Stage::Stepped, "GradScaler.unscale: unscale() is being called after step()");
  }
  // 1/S in double, then rounded to fp32: PyTorch's scale.double().reciprocal().float().
  const double inv_scale = fp32_or_inf(1.0 / scale_);
  check(std::isfinite(inv_scale), "GradScaler.unscale: the scale is ", exact_number_text(scale_),
        ", too small to unscale by: 1/scale overflows fp32 (repeated overflows backed it off; look for ",
        "inf/NaN gradients)");

  // Every check before anything changes: a call that throws leaves no record (no clean step to count).
  std::vector<std::pair<Tensor, Tensor>> params_and_grads;
  for (const Tensor& param : optimizer.params()) {
    const Tensor grad = param.grad();
    if (!grad.defined()) continue;
    check(grad.dtype() != DType::F16, "GradScaler.unscale: attempting to unscale FP16 gradients (",
          grad.described(), "); keep f32 master weights (amp/optimizer) for f16 parameters");
    params_and_grads.emplace_back(param, grad);
  }
  NoGradGuard no_grad;
  std::vector<Tensor> grads;
  for (auto& [param, grad] : params_and_grads) {
    if (!grad.is_contiguous()) {
      // A set_grad() view may alias itself (stride 0): give the parameter its own contiguous gradient.
      grad = grad.contiguous();
      param.set_grad(grad);
    }
    grads.push_back(grad);
  }
  const bool found_inf = unscale_and_check_finite(grads, inv_scale);
  OptimizerState& state = per_optimizer_[&optimizer];
  state.stage = Stage::Unscaled;
  state.inf_checked = !grads.empty();
  state.found_inf = found_inf;
}

bool GradScaler::step(Optimizer& optimizer) {
  if (!options_.enabled) {
    optimizer.step();
    return true;
  }
  auto it = per_optimizer_.find(&optimizer);
  check(it == per_optimizer_.end() || it->second.stage != Stage::Stepped,
        "GradScaler.step: step() has already been called since the last update()");
  if (it == per_optimizer_.end()) {
    unscale(optimizer);
    it = per_optimizer_.find(&optimizer);
  }
  OptimizerState& state = it->second;
  // PyTorch asserts this before stepping and leaves the optimizer unscaled (not stepped).
  check(state.inf_checked, "GradScaler.step: no inf checks were recorded for this optimizer: none of its ",
        optimizer.params().size(), " parameters has a gradient (run backward on a loss that uses them)");
  const bool stepped = !state.found_inf;
  if (stepped) optimizer.step();
  state.stage = Stage::Stepped;
  return stepped;
}

void GradScaler::update() {
  if (!options_.enabled) return;
  bool inf_checked = false, found_inf = false;
  for (const auto& [optimizer, state] : per_optimizer_) {
    inf_checked = inf_checked || state.inf_checked;
    found_inf = found_inf || (state.inf_checked && state.found_inf);
  }
  check(inf_checked, "GradScaler.update: no inf checks were recorded prior to update() (call unscale() or ",
        "step() on an optimizer whose parameters have gradients first)");
  update(found_inf);
}

void GradScaler::update(bool found_inf) {
  if (!options_.enabled) return;
  if (found_inf) {
    scale_ = static_cast<float>(scale_ * options_.backoff_factor);  // fp32, as in PyTorch (fp32_scale)
    growth_tracker_ = 0;
  } else if (++growth_tracker_ == options_.growth_interval) {
    // PyTorch keeps a grown S only if it is finite in fp32.
    const double grown = fp32_or_inf(scale_ * options_.growth_factor);
    if (std::isfinite(grown)) scale_ = grown;
    growth_tracker_ = 0;
  }
  per_optimizer_.clear();
}

void GradScaler::update(double new_scale) {
  if (!options_.enabled) return;
  check_loss_scale("GradScaler.update", "new_scale", new_scale);
  scale_ = fp32_scale("GradScaler.update", "new_scale", new_scale);
  per_optimizer_.clear();
}

std::map<std::string, std::string> GradScaler::state_dict() const {
  if (!options_.enabled) return {};
  return {{"type", name()},
          {"scale", exact_number_text(scale_)},
          {"growth_factor", exact_number_text(options_.growth_factor)},
          {"backoff_factor", exact_number_text(options_.backoff_factor)},
          {"growth_interval", std::to_string(options_.growth_interval)},
          {"growth_tracker", std::to_string(growth_tracker_)}};
}

// PyTorch's load_state_dict: a disabled scaler returns at once; otherwise the saved scale (in fp32), tracker
// and rule (growth_factor, backoff_factor, growth_interval) replace this scaler's. What unscale() and step()
// recorded for each optimizer since the last update() stays, as in PyTorch: loading a state between
// unscale() and step() must not let the same gradients be unscaled twice.
void GradScaler::load_state_dict(const std::map<std::string, std::string>& state, std::string_view prefix) {
  if (!options_.enabled) return;
  const char* who = name();
  const std::string loader = std::string(who) + ".load_state_dict";
  check(!state.empty(), loader,
        ": the state is empty, possibly because it was saved from a disabled GradScaler");
  check_type_and_entries(
      who, state, {"type", "scale", "growth_factor", "backoff_factor", "growth_interval", "growth_tracker"},
      prefix);
  GradScalerOptions options = options_;
  options.init_scale = read_number(who, state, "scale", prefix);
  options.growth_factor = read_number(who, state, "growth_factor", prefix);
  options.backoff_factor = read_number(who, state, "backoff_factor", prefix);
  options.growth_interval = read_integer(who, state, "growth_interval", prefix);
  const int64_t tracker = read_integer(who, state, "growth_tracker", prefix);
  const auto entry = [&](const char* key) { return "entry " + entry_name(prefix, key); };
  check_loss_scale(loader, entry("scale"), options.init_scale);
  check_growth(loader, entry("growth_factor"), options.growth_factor);
  check_backoff(loader, entry("backoff_factor"), options.backoff_factor);
  check_at_least_one(loader, entry("growth_interval"), options.growth_interval);
  check(tracker >= 0 && tracker < options.growth_interval, loader, ": ", entry("growth_tracker"), " is ", tracker,
        ", expected a value in [0, growth_interval ", options.growth_interval, ")");
  const double scale = fp32_scale(loader.c_str(), entry("scale").c_str(), options.init_scale);
  options_ = options;
  scale_ = scale;
  growth_tracker_ = tracker;
}

// ---------------------------------------------------------------------------------------- DynamicLossScaler

DynamicLossScaler::DynamicLossScaler(DynamicLossScalerOptions options)
    : LossScaler(options.initial_scale), options_(options), hysteresis_tracker_(options.hysteresis) {
  const char* who = "DynamicLossScaler";
  check_loss_scale(who, "initial_scale", options.initial_scale);
  // Apex's rule floors at min_scale only at a backoff, and its "no floor" is the smallest positive double.
  if (options.allow_initial_below_min) {
    check(options.min_scale > 0, who, ": min_scale must be > 0, got ", exact_number_text(options.min_scale));
  } else {
    check_loss_scale(who, "min_scale", options.min_scale);
  }
  check_loss_scale(who, "max_scale", options.max_scale);
  check(options.min_scale <= options.max_scale, who, ": min_scale ", exact_number_text(options.min_scale),
        " must be <= max_scale ", exact_number_text(options.max_scale));
  if (options.allow_initial_below_min) {
    check(options.initial_scale <= options.max_scale, who, ": initial_scale ",
          exact_number_text(options.initial_scale), " must be <= max_scale ",
          exact_number_text(options.max_scale));
  } else {
    check(options.initial_scale >= options.min_scale && options.initial_scale <= options.max_scale, who,
          ": initial_scale ", exact_number_text(options.initial_scale), " must be within [min_scale ",
          exact_number_text(options.min_scale), ", max_scale ", exact_number_text(options.max_scale), "]");
  }
  check_growth(who, "growth_factor", options.growth_factor);
  check_backoff(who, "backoff_factor", options.backoff_factor);
  check_at_least_one(who, "growth_interval", options.growth_interval);
  check_at_least_one(who, "hysteresis", options.hysteresis);
  const auto in_rule = [&](const char* what, double value) {
    return options.fp32_scale ? fp32_scale(who, what, value, "Megatron-LM keeps its scale (fp32_scale)") : value;
  };
  scale_ = in_rule("initial_scale", options.initial_scale);
  min_scale_ = in_rule("min_scale", options.min_scale);
  max_scale_ = in_rule("max_scale", options.max_scale);
  growth_factor_ = in_rule("growth_factor", options.growth_factor);
  backoff_factor_ = in_rule("backoff_factor", options.backoff_factor);
  // A factor that rounds to 1 in fp32 would never change S: refused as the unrounded value would be.
  check(growth_factor_ > 1, who, ": growth_factor ", exact_number_text(options.growth_factor),
        " is 1 in fp32 (fp32_scale), expected > 1");
  check(backoff_factor_ < 1, who, ": backoff_factor ", exact_number_text(options.backoff_factor),
        " is 1 in fp32 (fp32_scale), expected < 1");
}

double DynamicLossScaler::in_rule_dtype(double value) const {
  return options_.fp32_scale ? fp32_or_inf(value) : value;
}

// Megatron-LM's DynamicGradScaler.update, rule for rule, in fp32 as Megatron's tensors (fp32_scale; Apex's
// rule in double). Differences: Megatron has no max_scale (Colossal-AI has, as min(S * growth, max_scale));
// Megatron lets the hysteresis tracker count on below 0, we stop it at 0 (every value
// <= 0 backs off alike, and it cannot wrap). Colossal-AI counts hysteresis up from 0 instead of down from
// `hysteresis`: the same sequence of scales.
void DynamicLossScaler::update(bool found_inf) {
  ++update_count_;
  if (found_inf) {
    growth_tracker_ = 0;
    hysteresis_tracker_ = std::max<int64_t>(hysteresis_tracker_ - 1, 0);
    last_update_ = hysteresis_tracker_ == 0 ? Update::Backoff : Update::Overflow;
    // Rounding after the bound is the same as before it (the bounds are values of the rule's dtype), and keeps
    // an out-of-range double away from the conversion to fp32.
    if (hysteresis_tracker_ == 0) scale_ = in_rule_dtype(std::max(scale_ * backoff_factor_, min_scale_));
  } else {
    growth_tracker_ += 1;
    last_update_ = Update::Clean;
    if (growth_tracker_ == options_.growth_interval) {
      growth_tracker_ = 0;
      hysteresis_tracker_ = options_.hysteresis;
      scale_ = in_rule_dtype(std::min(scale_ * growth_factor_, max_scale_));
      last_update_ = Update::Growth;
    }
  }
}

std::map<std::string, std::string> DynamicLossScaler::state_dict() const {
  return {{"type", name()},
          {"scale", exact_number_text(scale_)},
          {"growth_tracker", std::to_string(growth_tracker_)},
          {"hysteresis_tracker", std::to_string(hysteresis_tracker_)},
          {"min_scale", exact_number_text(options_.min_scale)},
          {"max_scale", exact_number_text(options_.max_scale)},
          {"growth_factor", exact_number_text(options_.growth_factor)},
          {"backoff_factor", exact_number_text(options_.backoff_factor)},
          {"growth_interval", std::to_string(options_.growth_interval)},
          {"hysteresis", std::to_string(options_.hysteresis)}};
}

// Megatron's state_dict holds only the scale and the two trackers, Colossal-AI's also growth_factor,
// backoff_factor and hysteresis; ours holds the whole rule and refuses a state saved under another one (the
// naive and the Apex rule share the type name). The options come from the constructor.
void DynamicLossScaler::load_state_dict(const std::map<std::string, std::string>& state,
                                        std::string_view prefix) {
  const char* who = name();
  const char* loader = "DynamicLossScaler.load_state_dict";
  const std::initializer_list<const char*> rule = {"min_scale",      "max_scale",       "growth_factor",
                                                   "backoff_factor", "growth_interval", "hysteresis"};
  check_type_and_entries(who, state,
                         {"type", "scale", "growth_tracker", "hysteresis_tracker", "min_scale", "max_scale",
                          "growth_factor", "backoff_factor", "growth_interval", "hysteresis"},
                         prefix);
  const double saved_scale = read_number(who, state, "scale", prefix);
  const int64_t growth = read_integer(who, state, "growth_tracker", prefix);
  int64_t hysteresis = read_integer(who, state, "hysteresis_tracker", prefix);
  const bool has_rule =
      std::any_of(rule.begin(), rule.end(), [&](const char* key) { return state.count(key) > 0; });
  if (has_rule) {
    check_same_option(who, "min_scale", read_number(who, state, "min_scale", prefix), options_.min_scale);
    check_same_option(who, "max_scale", read_number(who, state, "max_scale", prefix), options_.max_scale);
    check_same_option(who, "growth_factor", read_number(who, state, "growth_factor", prefix), options_.growth_factor);
    check_same_option(who, "backoff_factor", read_number(who, state, "backoff_factor", prefix),
                      options_.backoff_factor);
    check_same_option(who, "growth_interval", read_integer(who, state, "growth_interval", prefix),
                      options_.growth_interval);
    check_same_option(who, "hysteresis", read_integer(who, state, "hysteresis", prefix), options_.hysteresis);
  } else if (hysteresis < 0) {
    hysteresis = 0;  // a state without the rule (Megatron-LM's) may count below 0: all such values act as 0
  }
  // The saved scale in the rule's dtype first (a state saved under fp32_scale holds such a value already; one saved
  // by the double rule, fp32_scale = false, may not), then against the bounds as the rule computes with them.
  // A scale below the Apex rule's floor or unusable in fp32 is refused too: the first step would fail on it.
  const auto entry = [&](const char* key) { return "entry " + entry_name(prefix, key); };
  check_loss_scale(loader, entry("scale"), saved_scale);
  const double scale = in_rule_dtype(saved_scale);
  const std::string max = exact_number_text(max_scale_);
  if (options_.allow_initial_below_min) {
    check(scale <= max_scale_, loader, ": ", entry("scale"), " is ", exact_number_text(saved_scale),
          ", expected a value in (0, max_scale ", max, "]", options_.fp32_scale ? " in fp32" : "");
  } else {
    check(scale >= min_scale_ && scale <= max_scale_, loader, ": ", entry("scale"), " is ",
          exact_number_text(saved_scale), ", expected a value in [min_scale ", exact_number_text(min_scale_),
          ", max_scale ", max, "]");
  }
  check(growth >= 0 && growth < options_.growth_interval, loader, ": ", entry("growth_tracker"), " is ", growth,
        ", expected a value in [0, growth_interval ", options_.growth_interval, ")");
  check(hysteresis >= 0 && hysteresis <= options_.hysteresis, loader, ": ", entry("hysteresis_tracker"), " is ",
        hysteresis, ", expected a value in [0, hysteresis ", options_.hysteresis, "]");
  scale_ = scale;
  growth_tracker_ = growth;
  hysteresis_tracker_ = hysteresis;
}

// Checked against apex/amp/scaler.py: LossScaler.__init__ starts at min(max_loss_scale, init_scale);
// update_scale: overflow: S = max(min_loss_scale, S / 2) (S / 2 when min_loss_scale is None), unskipped = 0;
// clean: unskipped += 1; then, in the same call, unskipped == scale_window: S = min(max_loss_scale, S * 2),
// unskipped = 0. Apex's factor is a fixed 2; scale_factor generalises it as growth = scale_factor,
// backoff = 1 / scale_factor. Apex checks none of its options; we reject what would make no rule.
DynamicLossScaler apex_dynamic_scaler(double init_scale, int64_t scale_window,
                                      std::optional<double> min_loss_scale, double max_loss_scale,
                                      double scale_factor) {
  const char* who = "apex_dynamic_scaler";
  check_growth(who, "scale_factor", scale_factor);
  check_loss_scale(who, "init_scale", init_scale);
  check_at_least_one(who, "scale_window", scale_window);
  // The scale is Apex's Python float, but the loss is multiplied by it in fp32 (check_loss_scale).
  check_loss_scale(who, "max_loss_scale", max_loss_scale);
  if (min_loss_scale) {
    check_loss_scale(who, "min_loss_scale", *min_loss_scale);
    check(*min_loss_scale <= max_loss_scale, who, ": min_loss_scale ", exact_number_text(*min_loss_scale),
          " must be <= max_loss_scale ", exact_number_text(max_loss_scale));
  }
  DynamicLossScalerOptions options;
  options.initial_scale = std::min(max_loss_scale, init_scale);
  options.min_scale = min_loss_scale.value_or(std::numeric_limits<double>::denorm_min());
  options.max_scale = max_loss_scale;
  options.growth_factor = scale_factor;
  options.backoff_factor = 1.0 / scale_factor;
  options.growth_interval = scale_window;
  options.hysteresis = 1;  // Apex backs off on every overflow
  options.allow_initial_below_min = true;
  options.fp32_scale = false;  // Apex's LossScaler keeps its scale in a Python float
  return DynamicLossScaler(options);
}

// ----------------------------------------------------------------------------------------- StaticLossScaler

StaticLossScaler::StaticLossScaler(double scale) : LossScaler(scale) {
  // Losses are scaled in fp32 (a 16-bit loss in its own dtype): a scale that is inf there would make every
  // gradient inf and every step a skipped one (Apex, given loss_scale=1e39, runs so without a word).
  check_loss_scale("StaticLossScaler", "scale", scale);
}

std::map<std::string, std::string> StaticLossScaler::state_dict() const {
  return {{"type", name()}, {"scale", exact_number_text(scale_)}};
}

// Nothing to load: the state only confirms that it was saved under this scaler's configured scale.
void StaticLossScaler::load_state_dict(const std::map<std::string, std::string>& state,
                                       std::string_view prefix) {
  check_type_and_entries(name(), state, {"type", "scale"}, prefix);
  const double scale = read_number(name(), state, "scale", prefix);
  check(scale == scale_, "StaticLossScaler.load_state_dict: the state was saved with scale ",
        exact_number_text(scale), ", this scaler has scale ", exact_number_text(scale_),
        " (a static scale comes from the configuration)");
}

}  // namespace mixtape
