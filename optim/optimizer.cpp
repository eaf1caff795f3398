#include "optim/optimizer.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <set>
#include <system_error>

#include "tensor/autograd_node.h"

namespace mixtape {

namespace {

constexpr int64_t kMaxStep = int64_t{1} << 53;  // a loaded per-parameter step count's upper bound

std::string state_key(size_t index, const std::string& what) {
  return "state." + std::to_string(index) + "." + what;
}

std::string group_key(size_t group, const char* what) {
  return "param_groups." + std::to_string(group) + "." + what;
}

// Splits "state.<i>.<rest>" into i and rest; false for anything else (including a malformed index).
bool parse_state_key(const std::string& key, size_t& index, std::string& rest) {
  static const std::string prefix = "state.";
  if (key.compare(0, prefix.size(), prefix) != 0) return false;
  const char* begin = key.data() + prefix.size();
  const char* end = key.data() + key.size();
  const char* dot = std::find(begin, end, '.');
  if (dot == begin || dot == end || (*begin == '0' && dot - begin > 1)) return false;
  const auto [ptr, ec] = std::from_chars(begin, dot, index);
  if (ec != std::errc() || ptr != dot) return false;
  rest.assign(dot + 1, end);
  return !rest.empty();
}

}  // namespace

Optimizer::Optimizer(const char* name, std::vector<ParamGroup> groups) : name_(name) {
  for (ParamGroup& group : groups) add_param_group(std::move(group));
}

DType Optimizer::state_dtype(const Tensor& param) {
  return param.dtype() == DType::F64 ? DType::F64 : DType::F32;
}

void Optimizer::check_group(const ParamGroup& group, const std::vector<Tensor>& others) const {
  check(std::isfinite(group.lr) && group.lr >= 0, name(), ": learning rate must be finite and >= 0, got ",
        group.lr);
  check(std::isfinite(group.weight_decay) && group.weight_decay >= 0, name(),
        ": weight_decay must be finite and >= 0, got ", group.weight_decay);
  std::set<const TensorImpl*> seen;
  for (const Tensor& other : others) seen.insert(other.impl_ptr().get());
  for (const Tensor& param : group.params) {
    check(param.defined(), name(), ": a parameter is an undefined tensor");
    check(is_floating(param.dtype()), name(), ": parameter ", param.described(),
          " is not floating point (only f32, f16, bf16 and f64 tensors can be optimized)");
    check(param.is_leaf(), name(), ": parameter ", param.described(), " is not a leaf (made by '",
          param.grad_fn() ? param.grad_fn()->op : "", "'); optimize leaves only");
    check(seen.insert(param.impl_ptr().get()).second, name(), ": parameter ", param.described(),
          " appears more than once in the parameter groups");
  }
}

void Optimizer::add_param_group(ParamGroup group) {
  check_group(group, params());
  groups_.push_back(std::move(group));
}

std::vector<Tensor> Optimizer::params() const {
  std::vector<Tensor> all;
  for (const ParamGroup& group : groups_) all.insert(all.end(), group.params.begin(), group.params.end());
  return all;
}

const ParamState* Optimizer::state(const Tensor& param) const {
  const auto found = state_.find(param.impl_ptr());
  return found == state_.end() ? nullptr : &found->second;
}

void Optimizer::zero_grad() {
  for (ParamGroup& group : groups_)
    for (Tensor& param : group.params)
      if (param.defined()) param.set_grad(Tensor());
}

void Optimizer::check_for_step(const Tensor& param, const Tensor& grad, int64_t index) const {
  const auto where = [&] { return std::string(" (parameter ") + std::to_string(index) + ")"; };
  check(param.is_leaf(), name(), ".step: parameter ", param.described(), where(), " is not a leaf");
  check(param.is_contiguous(), name(), ".step: parameter ", param.described(), where(),
        " is not contiguous; the fused update walks parameters as flat arrays");
  check(grad.dtype() == param.dtype() && grad.shape() == param.shape() && grad.device() == param.device(),
        name(), ".step: gradient ", grad.described(), " does not match parameter ", param.described(),
        where(), " (expected the same dtype, shape and device)");
}

void Optimizer::step() {
  // Check everything first: a bad parameter must not leave the others half-updated.
  for (const ParamGroup& group : groups_) {
    check(std::isfinite(group.lr) && group.lr >= 0, name(),
          ".step: learning rate must be finite and >= 0, got ", group.lr);
    check(std::isfinite(group.weight_decay) && group.weight_decay >= 0, name(),
          ".step: weight_decay must be finite and >= 0, got ", group.weight_decay);
  }
  int64_t index = 0;
  std::set<const TensorImpl*> seen;  // param_groups() is mutable: a parameter listed twice would step twice
  for (const ParamGroup& group : groups_)
    for (const Tensor& param : group.params) {
      check(param.defined(), name(), ".step: parameter ", index, " is an undefined tensor");
      check(seen.insert(param.impl_ptr().get()).second, name(), ".step: parameter ", param.described(),
            " (", index, ") appears more than once in the parameter groups");
      const Tensor grad = param.grad();
      if (grad.defined()) check_for_step(param, grad, index);
      ++index;
    }

  NoGradGuard no_grad;
  const bool stateful = keeps_state();
  std::vector<PendingUpdate> updates;
  std::vector<ParamState> scratch;  // stateless optimizers' per-step state
  scratch.reserve(static_cast<size_t>(index));
  for (const ParamGroup& group : groups_)
    for (const Tensor& param : group.params) {
      const Tensor grad = param.grad();
      if (!grad.defined()) continue;
      ParamState* state = &scratch.emplace_back();
      if (stateful) {
        state = &state_[param.impl_ptr()];
        for (const std::string& buffer : buffer_names())
          if (!state->buffers.count(buffer))
            state->buffers[buffer] = Tensor::zeros(param.shape(), state_dtype(param), param.device());
      }
      ++state->step;
      updates.push_back({&group, param, grad.contiguous(), state});
    }
  update(updates);
  for (const PendingUpdate& u : updates) u.param.bump_version();
}

// ---- state_dict ----------------------------------------------------------------------------------------

std::string Optimizer::format_number(double value) { return exact_number_text(value); }

double Optimizer::read_number(const std::map<std::string, std::string>& metadata,
                              const std::string& key) const {
  const auto found = metadata.find(key);
  check(found != metadata.end(), name(), ".load_state_dict: missing metadata entry '", key, "'");
  const std::string& text = found->second;
  const std::optional<double> value = number_from_text<double>(text);
  check(value.has_value(), name(), ".load_state_dict: metadata entry '", key, "' is '", echo(text),
        "', expected a number");
  return *value;
}

int64_t Optimizer::read_integer(const std::map<std::string, std::string>& metadata,
                                const std::string& key) const {
  const auto found = metadata.find(key);
  check(found != metadata.end(), name(), ".load_state_dict: missing metadata entry '", key, "'");
  const std::string& text = found->second;
  const std::optional<int64_t> value = number_from_text<int64_t>(text);
  check(value.has_value() && *value >= 0, name(), ".load_state_dict: metadata entry '", key, "' is '", echo(text),
        "', expected a non-negative integer");
  return *value;
}

bool Optimizer::read_bool(const std::map<std::string, std::string>& metadata, const std::string& key) const {
  const auto found = metadata.find(key);
  check(found != metadata.end(), name(), ".load_state_dict: missing metadata entry '", key, "'");
  check(found->second == "true" || found->second == "false", name(), ".load_state_dict: metadata entry '",
        key, "' is '", echo(found->second), "', expected true or false");
  return found->second == "true";
}

StateDict Optimizer::state_dict() const {
  NoGradGuard no_grad;
  StateDict dict;
  dict.metadata["type"] = name();
  dict.metadata["param_groups"] = std::to_string(groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) {
    dict.metadata[group_key(g, "params")] = std::to_string(groups_[g].params.size());
    dict.metadata[group_key(g, "lr")] = format_number(groups_[g].lr);
    dict.metadata[group_key(g, "weight_decay")] = format_number(groups_[g].weight_decay);
  }
  for (const auto& [key, value] : options_metadata()) dict.metadata[key] = value;
  const std::vector<Tensor> all = params();
  for (size_t i = 0; i < all.size(); ++i) {
    const ParamState* param_state = state(all[i]);
    if (!param_state) continue;
    dict.metadata[state_key(i, "step")] = std::to_string(param_state->step);
    for (const auto& [buffer, tensor] : param_state->buffers)
      dict.tensors[state_key(i, buffer)] = tensor.clone();
  }
  return dict;
}

void Optimizer::load_state_dict(const StateDict& dict) {
  const std::string who = std::string(name()) + ".load_state_dict";
  const auto& metadata = dict.metadata;

  // ---- check everything, change nothing ----
  const auto type = metadata.find("type");
  check(type != metadata.end(), who, ": missing metadata entry 'type'");
  check(type->second == name(), who, ": the state dict is of a '", echo(type->second), "' optimizer, not '", name(),
        "'");
  const int64_t group_count = read_integer(metadata, "param_groups");
  check(group_count == static_cast<int64_t>(groups_.size()), who, ": the state dict has ", group_count,
        " parameter groups ('param_groups'), this optimizer has ", groups_.size());
  std::set<std::string> known = {"type", "param_groups"};
  std::vector<std::pair<double, double>> group_values;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const std::string count_key = group_key(g, "params"), lr_key = group_key(g, "lr"),
                      decay_key = group_key(g, "weight_decay");
    const int64_t count = read_integer(metadata, count_key);
    check(count == static_cast<int64_t>(groups_[g].params.size()), who, ": entry '", count_key, "' says ",
          count, " parameters, this optimizer's group ", g, " has ", groups_[g].params.size());
    const double lr = read_number(metadata, lr_key), decay = read_number(metadata, decay_key);
    check(std::isfinite(lr) && lr >= 0, who, ": entry '", lr_key, "' is ", lr, ", expected finite and >= 0");
    check(std::isfinite(decay) && decay >= 0, who, ": entry '", decay_key, "' is ", decay,
          ", expected finite and >= 0");
    group_values.emplace_back(lr, decay);
    known.insert({count_key, lr_key, decay_key});
  }
  for (const auto& [key, value] : options_metadata()) {
    check(metadata.count(key), who, ": missing metadata entry '", key, "'");
    known.insert(key);
  }

  const std::vector<Tensor> all = params();
  const std::vector<std::string> buffers = buffer_names();
  std::map<size_t, ParamState> loaded;
  for (const auto& [key, value] : metadata) {
    if (known.count(key)) continue;
    size_t index = 0;
    std::string what;
    check(parse_state_key(key, index, what) && what == "step" && index < all.size(), who,
          ": unexpected metadata entry '", echo(key), "'");
    const int64_t step = read_integer(metadata, key);
    // At most 2^53: the bias corrections compute in double, and the count must have room to go on.
    check(step >= 1 && step <= kMaxStep, who, ": entry '", echo(key), "' is ", step,
          ", expected a step count in [1, 2^53]");
    loaded[index].step = step;
  }
  for (const auto& [key, tensor] : dict.tensors) {
    size_t index = 0;
    std::string what;
    check(parse_state_key(key, index, what) && index < all.size() &&
              std::find(buffers.begin(), buffers.end(), what) != buffers.end(),
          who, ": unexpected tensor entry '", echo(key), "'");
    check(loaded.count(index), who, ": tensor entry '", echo(key), "' has no metadata entry '",
          state_key(index, "step"), "'");
    const Tensor& param = all[index];
    check(tensor.defined(), who, ": tensor entry '", echo(key), "' is undefined");
    check(tensor.shape() == param.shape() && tensor.dtype() == state_dtype(param), who, ": tensor entry '",
          echo(key), "' is ", tensor.described(), ", expected ", dtype_name(state_dtype(param)),
          shape_text(param.shape()), " for parameter ", index, " (", param.described(), ")");
    // A non-finite moment (or a negative second moment) would turn every later update into NaN or a skip.
    const bool non_negative = buffer_is_non_negative(what);
    const std::string bad = first_bad_value(tensor, non_negative);
    check(bad.empty(), who, ": tensor entry '", echo(key), "' must be ", non_negative ? "finite and >= 0" : "finite",
          ", but ", bad);
  }
  NoGradGuard no_grad;
  for (auto& [index, param_state] : loaded) {
    const Tensor& param = all[index];
    for (const std::string& buffer : buffers) {
      const std::string key = state_key(index, buffer);
      const auto found = dict.tensors.find(key);
      check(found != dict.tensors.end(), who, ": missing tensor entry '", key, "' (parameter ", index,
            " has a step count)");
      // A private copy on the parameter's device: the optimizer never aliases the caller's dict.
      Tensor copy = Tensor::empty(param.shape(), state_dtype(param), param.device());
      copy.copy_(found->second.to(param.device()));
      param_state.buffers[buffer] = copy;
    }
  }
  // The derived options come last: load_options parses and checks all its entries before assigning any, and
  // nothing below can throw, so a failed load leaves the optimizer as it was.
  load_options(metadata);

  // ---- apply ----
  for (size_t g = 0; g < groups_.size(); ++g) {
    groups_[g].lr = group_values[g].first;
    groups_[g].weight_decay = group_values[g].second;
  }
  state_.clear();
  for (auto& [index, param_state] : loaded) state_[all[index].impl_ptr()] = std::move(param_state);
}

}  // namespace mixtape
