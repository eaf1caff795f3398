#include "amp/optimizer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <span>
#include <utility>

#include "autograd/autograd.h"
#include "optim/clip.h"
#include "tensor/autograd_node.h"
#include "tensor/backend.h"
#include "tensor/error.h"
#include "tensor/ops.h"

namespace mixtape {

namespace {

constexpr const char* kWho = "MixedPrecisionOptimizer";

// Unscaled gradients are accumulated in the dtype the wrapped optimizer computes in: f64 for f64 parameters,
// f32 for everything else (f32, f16, bf16).
DType accumulation_dtype(const Tensor& param) { return Optimizer::state_dtype(param); }

// The metadata entry `key` as a non-negative integer (an error naming `who` if it is missing or not one).
int64_t read_count(const std::map<std::string, std::string>& metadata, const std::string& key,
                   const std::string& who) {
  const auto found = metadata.find(key);
  if (found == metadata.end()) fail(who, ": missing metadata entry '", echo(key), "'");
  const std::string& text = found->second;
  const std::optional<int64_t> value = number_from_text<int64_t>(text);
  if (!value.has_value() || *value < 0)
    fail(who, ": metadata entry '", echo(key), "' is '", echo(text), "', expected a non-negative integer");
  return *value;
}

}  // namespace

std::vector<std::unique_ptr<LossScaler>> one_scaler(std::unique_ptr<LossScaler> scaler) {
  std::vector<std::unique_ptr<LossScaler>> scalers;
  scalers.push_back(std::move(scaler));
  return scalers;
}

void write_scaler_states(const std::vector<std::unique_ptr<LossScaler>>& scalers,
                         std::map<std::string, std::string>& metadata) {
  for (size_t k = 0; k < scalers.size(); ++k)
    for (const auto& [key, value] : scalers[k]->state_dict())
      metadata["scaler." + std::to_string(k) + "." + key] = value;
}

std::vector<std::map<std::string, std::string>> read_scaler_states(
    const std::map<std::string, std::string>& metadata, const std::vector<std::unique_ptr<LossScaler>>& scalers,
    const std::string& who) {
  std::vector<std::map<std::string, std::string>> states(scalers.size());
  for (const auto& [key, value] : metadata) {
    if (key.rfind("scaler.", 0) != 0) continue;
    const size_t dot = key.find('.', 7);
    const std::string index = key.substr(7, dot == std::string::npos ? std::string::npos : dot - 7);
    const std::optional<size_t> k = number_from_text<size_t>(index);
    if (!(dot != std::string::npos && dot + 1 < key.size() && k.has_value() && *k < scalers.size()))
      fail(who, ": unexpected metadata entry '", echo(key), "' (expected scaler.<k>.<entry> with k < ",
           scalers.size(), ")");
    states[*k][key.substr(dot + 1)] = value;
  }
  for (size_t k = 0; k < scalers.size(); ++k) {
    const bool saves_state = !scalers[k]->state_dict().empty();  // a disabled GradScaler saves nothing
    if (!saves_state) {
      check(states[k].empty(), who, ": scaler ", k, " (", scalers[k]->name(),
            ") keeps no state, but the state dict has entries for it");
      continue;
    }
    const auto type = states[k].find("type");
    check(type != states[k].end(), who, ": missing metadata entry 'scaler.", k, ".type' (expected a ",
          scalers[k]->name(), ")");
    if (type->second != scalers[k]->name())
      fail(who, ": entry 'scaler.", k, ".type' is '", echo(type->second), "', expected '", scalers[k]->name(),
           "'");
  }
  return states;
}

void load_scaler_states(const std::vector<std::unique_ptr<LossScaler>>& scalers,
                        const std::vector<std::map<std::string, std::string>>& states) {
  std::vector<std::map<std::string, std::string>> old;
  for (const auto& scaler : scalers) old.push_back(scaler->state_dict());
  size_t loaded = 0;
  try {
    for (; loaded < scalers.size(); ++loaded)
      if (!old[loaded].empty())
        scalers[loaded]->load_state_dict(states[loaded], "scaler." + std::to_string(loaded) + ".");
  } catch (...) {
    for (size_t k = 0; k < loaded; ++k)
      if (!old[k].empty()) scalers[k]->load_state_dict(old[k]);
    throw;
  }
}

int64_t read_amp_entries(const std::map<std::string, std::string>& metadata, int num_losses, bool master_weights,
                         const std::string& who) {
  const int64_t num = read_count(metadata, "amp.num_losses", who);
  check(num == num_losses, who, ": the state dict has ", num, " loss scalers ('amp.num_losses'), expected ",
        num_losses);
  const auto found = metadata.find("amp.master_weights");
  check(found != metadata.end(), who, ": missing metadata entry 'amp.master_weights'");
  const std::string expected = master_weights ? "true" : "false";
  if (found->second != expected)
    fail(who, ": entry 'amp.master_weights' is '", echo(found->second), "', expected '", expected,
         "' (this optimizer's option)");
  for (const auto& [key, value] : metadata)
    if (key.rfind("amp.", 0) == 0 && key != "amp.num_losses" && key != "amp.master_weights" &&
        key != "amp.skipped_steps")
      fail(who, ": unexpected metadata entry '", echo(key), "'");
  return read_count(metadata, "amp.skipped_steps", who);
}

MixedPrecisionOptimizer::MixedPrecisionOptimizer(std::unique_ptr<Optimizer> optimizer,
                                                 std::vector<std::unique_ptr<LossScaler>> scalers,
                                                 MixedPrecisionOptions options)
    : optimizer_(std::move(optimizer)), scalers_(std::move(scalers)), options_(options) {
  check(optimizer_ != nullptr, kWho, ": expected an optimizer to wrap, got null");
  check(!scalers_.empty(), kWho,
        ": expected at least one loss scaler (one per loss; StaticLossScaler(1) for ",
        "no scaling), got none");
  for (size_t k = 0; k < scalers_.size(); ++k)
    check(scalers_[k] != nullptr, kWho, ": loss scaler ", k, " is null, expected a LossScaler");
  check(std::isfinite(options_.clip_grad) && options_.clip_grad >= 0, kWho,
        ": clip_grad must be finite and >= 0 (0 = off), got ", options_.clip_grad);
  for (const Tensor& param : optimizer_->params())
    check(optimizer_->state(param) == nullptr, kWho, ": the wrapped ", optimizer_->name(),
          " already has state for parameter ", param.described(),
          "; expected an optimizer that has not taken a step (its state must be computed on the masters)");

  NoGradGuard no_grad;
  for (ParamGroup& group : optimizer_->param_groups()) {
    for (Tensor& param : group.params) {
      model_params_.push_back(param);
      if (options_.master_weights && is_low_precision(param.dtype())) {
        // A new fp32 leaf holding the exact value of the 16-bit parameter (16-bit -> fp32 is exact).
        Tensor master = Tensor::empty(param.shape(), DType::F32, param.device());
        master.copy_(param);
        master.requires_grad_();
        param = master;  // the wrapped optimizer now updates (and keeps its state for) the master
      }
      master_params_.push_back(param);
    }
  }
  check(options_.count_in_norm.empty() || options_.count_in_norm.size() == model_params_.size(), kWho,
        ": count_in_norm has ", options_.count_in_norm.size(), " entries, expected one per parameter (",
        model_params_.size(), ")");
  accumulators_.resize(model_params_.size());
  found_inf_.assign(scalers_.size(), false);
  used_.assign(scalers_.size(), false);
}

MixedPrecisionOptimizer::MixedPrecisionOptimizer(std::unique_ptr<Optimizer> optimizer,
                                                 std::unique_ptr<LossScaler> scaler,
                                                 MixedPrecisionOptions options)
    : MixedPrecisionOptimizer(std::move(optimizer), one_scaler(std::move(scaler)), options) {}

void MixedPrecisionOptimizer::check_loss_id(int loss_id, const char* what) const {
  check(loss_id >= 0 && loss_id < num_losses(), kWho, ".", what, ": loss_id ", loss_id,
        " out of range, expected ", "0 <= loss_id < num_losses = ", num_losses());
}

LossScaler& MixedPrecisionOptimizer::scaler(int loss_id) {
  check_loss_id(loss_id, "scaler");
  return *scalers_[static_cast<size_t>(loss_id)];
}

double MixedPrecisionOptimizer::loss_scale(int loss_id) const {
  check_loss_id(loss_id, "loss_scale");
  return scalers_[static_cast<size_t>(loss_id)]->scale();
}

std::vector<Tensor> MixedPrecisionOptimizer::model_params() const { return model_params_; }
std::vector<Tensor> MixedPrecisionOptimizer::master_params() const { return master_params_; }

void MixedPrecisionOptimizer::begin_backward(int loss_id) {
  if (stepped_) {
    // The gradients still installed are the last step's unscaled ones: a new accumulation starts from zero,
    // never from them (they carry no loss scale and would be mixed with scaled ones).
    zero_grad();
  }
  if (pending_loss_ >= 0 && pending_loss_ != loss_id) fold_pending_grads();
  pending_loss_ = loss_id;
  used_[static_cast<size_t>(loss_id)] = true;
}

Tensor MixedPrecisionOptimizer::scale_loss(const Tensor& loss, int loss_id) {
  check_loss_id(loss_id, "scale_loss");
  begin_backward(loss_id);
  return scalers_[static_cast<size_t>(loss_id)]->scale(loss);
}

void MixedPrecisionOptimizer::backward(const Tensor& loss, int loss_id) {
  mixtape::backward(scale_loss(loss, loss_id));
}

void MixedPrecisionOptimizer::fold_pending_grads() {
  NoGradGuard no_grad;
  if (pending_loss_ < 0) {
    if (stepped_) return;  // the installed gradients are the previous step's, already unscaled
    for (const Tensor& param : model_params_)
      check(!param.grad().defined(), kWho, ": parameter ", param.described(),
            " has a gradient, but no loss ",
            "went through scale_loss()/backward() of this optimizer since the last step or zero_grad(); ",
            "expected its gradients to carry a known loss scale");
    return;
  }
  const double scale = scalers_[static_cast<size_t>(pending_loss_)]->scale();
  const double inv_scale = 1.0 / scale;
  // Private contiguous buffers in the accumulation dtype (a 16-bit gradient is widened exactly; an f32/f64
  // one is cloned, since the model's gradient may alias another tensor or be a broadcast view, unless it is
  // the buffer backward made and nothing else holds it), then one fused pass unscales all of them and
  // checks finiteness.
  std::vector<Tensor> unscaled(model_params_.size());
  for (size_t i = 0; i < model_params_.size(); ++i) {
    Tensor grad = model_params_[i].grad();
    if (!grad.defined()) continue;
    const DType dtype = accumulation_dtype(model_params_[i]);
    if (grad.dtype() != dtype) {
      unscaled[i] = grad.to(dtype).contiguous();
    } else {
      // Held by the parameter and `grad` alone, over a storage no other tensor (view) shares, all of it.
      unscaled[i] = is_private_buffer(grad, 2) ? grad : grad.clone();
    }
  }
  // 1/S beyond fp32 (S <= 2^-128): the scaler has backed off at step after step of inf/NaN gradients. PyTorch
  // and Megatron-LM unscale by inf there and skip every step from then on, silently; this says so once.
  const bool in_fp32 = std::any_of(unscaled.begin(), unscaled.end(),
                                   [](const Tensor& g) { return g.defined() && g.dtype() != DType::F64; });
  check(!in_fp32 || inv_scale <= std::numeric_limits<float>::max(), kWho, ": the loss scale ",
        exact_number_text(scale), scalers_.size() > 1 ? " of loss " + std::to_string(pending_loss_) : "",
        " is 2^-128 or below, too small to unscale by in fp32 (1/scale overflows): the scaler has backed off ",
        "at step after step of inf/NaN gradients, so the run has diverged (look for an inf/NaN loss; try a lower ",
        "learning rate)");
  const bool found_inf = unscale_and_check_finite(unscaled, inv_scale);
  if (found_inf) found_inf_[static_cast<size_t>(pending_loss_)] = true;
  for (size_t i = 0; i < model_params_.size(); ++i) {
    if (!unscaled[i].defined()) continue;
    if (accumulators_[i].defined())
      accumulators_[i].add_(unscaled[i]);  // f32 (f64) addition of the unscaled gradients of two losses
    else
      accumulators_[i] = unscaled[i];
    model_params_[i].set_grad(Tensor());  // consumed: the next loss starts its model gradients from zero
  }
  pending_loss_ = -1;
}

void MixedPrecisionOptimizer::clear_grads() {
  for (size_t i = 0; i < model_params_.size(); ++i) {
    model_params_[i].set_grad(Tensor());
    master_params_[i].set_grad(Tensor());
    accumulators_[i] = Tensor();
  }
  pending_loss_ = -1;
  found_inf_.assign(scalers_.size(), false);
  used_.assign(scalers_.size(), false);
}

void MixedPrecisionOptimizer::reload_masters() {
  NoGradGuard no_grad;
  for (size_t i = 0; i < master_params_.size(); ++i)
    if (!master_params_[i].same(model_params_[i])) master_params_[i].copy_(model_params_[i]);
}

void MixedPrecisionOptimizer::zero_grad() {
  clear_grads();
  stepped_ = false;
}

StepResult MixedPrecisionOptimizer::step() {
  fold_pending_grads();
  StepResult result;
  result.loss_scale = scalers_[0]->scale();

  // found_inf of each loss, then whether each loss went through scale_loss() this step, MAX over the group
  // in one collective: every rank skips together and updates the same scalers. Only the scalers of losses
  // used in this step are updated, as Apex updates a loss's scaler when that loss leaves scale_loss: a loss
  // that sat out the step neither counts a clean step nor backs off.
  const size_t n = scalers_.size();
  std::vector<double> flags(2 * n);
  for (size_t k = 0; k < n; ++k) {
    flags[k] = found_inf_[k] ? 1.0 : 0.0;
    flags[n + k] = used_[k] ? 1.0 : 0.0;
  }
  if (options_.group) options_.group->all_reduce_max(flags);
  const std::span<const double> inf_flags(flags.data(), n), used_flags(flags.data() + n, n);
  bool any_inf = false;
  for (double flag : inf_flags) any_inf = any_inf || flag != 0.0;

  if (any_inf) {
    // Nothing is updated: parameters, masters and the wrapped optimizer's state (it never runs).
    clear_grads();
    stepped_ = false;
    ++skipped_steps_;
    for (size_t k = 0; k < n; ++k)
      if (used_flags[k] != 0.0) scalers_[k]->update(inf_flags[k] != 0.0);
    result.skipped = true;
    return result;
  }

  {
    NoGradGuard no_grad;
    // Install the unscaled gradients on the masters (in the parameter's dtype for 16-bit parameters that are
    // their own masters, master_weights = false: the wrapped optimizer wants a gradient of its parameter's
    // dtype, so the f32 sum is rounded once there).
    for (size_t i = 0; i < master_params_.size(); ++i) {
      Tensor grad = accumulators_[i];
      if (grad.defined() && grad.dtype() != master_params_[i].dtype())
        grad = grad.to(master_params_[i].dtype());
      master_params_[i].set_grad(grad);
      accumulators_[i] = Tensor();
    }
  }

  std::vector<Tensor> counted;
  for (size_t i = 0; i < master_params_.size(); ++i)
    if (options_.count_in_norm.empty() || options_.count_in_norm[i]) counted.push_back(master_params_[i]);
  std::vector<double> sums = {grad_squared_norm(counted)};
  if (options_.group) options_.group->all_reduce_sum(sums);
  result.grad_norm = std::sqrt(sums[0]);
  if (options_.clip_grad > 0) clip_grads_with_norm(master_params_, options_.clip_grad, result.grad_norm);

  if (options_.log_num_zeros_in_grad) {
    std::vector<double> zeros = {static_cast<double>(grad_zero_count(counted))};
    if (options_.group) options_.group->all_reduce_sum(zeros);
    result.num_zeros = static_cast<int64_t>(zeros[0]);
  }

  optimizer_->step();
  {
    // Each separate master rounded once (nearest even) into its model parameter, in place: the parameter
    // stays the same leaf and its version is bumped, so a graph that saved it notices.
    NoGradGuard no_grad;
    for (size_t i = 0; i < master_params_.size(); ++i)
      if (!master_params_[i].same(model_params_[i])) model_params_[i].copy_(master_params_[i]);
  }
  for (size_t k = 0; k < n; ++k)
    if (used_flags[k] != 0.0) scalers_[k]->update(false);
  found_inf_.assign(scalers_.size(), false);
  used_.assign(scalers_.size(), false);
  pending_loss_ = -1;
  stepped_ = true;
  return result;
}

StateDict MixedPrecisionOptimizer::state_dict() const {
  NoGradGuard no_grad;
  StateDict dict = optimizer_->state_dict();
  for (size_t i = 0; i < master_params_.size(); ++i)
    if (!master_params_[i].same(model_params_[i]))
      dict.tensors["master." + std::to_string(i)] = master_params_[i].detach().clone();
  dict.metadata["amp.num_losses"] = std::to_string(scalers_.size());
  dict.metadata["amp.master_weights"] = options_.master_weights ? "true" : "false";
  dict.metadata["amp.skipped_steps"] = std::to_string(skipped_steps_);
  write_scaler_states(scalers_, dict.metadata);
  return dict;
}

void MixedPrecisionOptimizer::load_state_dict(const StateDict& dict) {
  const std::string who = std::string(kWho) + ".load_state_dict";
  // ---- check everything we own, change nothing ----
  const int64_t skipped = read_amp_entries(dict.metadata, num_losses(), options_.master_weights, who);
  const std::vector<std::map<std::string, std::string>> scaler_states =
      read_scaler_states(dict.metadata, scalers_, who);

  StateDict inner;  // what the wrapped optimizer's state dict holds
  for (const auto& [key, value] : dict.metadata)
    if (key.rfind("amp.", 0) != 0 && key.rfind("scaler.", 0) != 0) inner.metadata[key] = value;

  std::map<size_t, Tensor> masters;
  for (const auto& [key, tensor] : dict.tensors) {
    if (key.rfind("master.", 0) != 0) {
      inner.tensors[key] = tensor;
      continue;
    }
    const std::string index = key.substr(7);
    const std::optional<size_t> parsed = number_from_text<size_t>(index);
    if (!(parsed.has_value() && *parsed < master_params_.size() &&
          !master_params_[*parsed].same(model_params_[*parsed])))
      fail(who, ": unexpected tensor entry '", echo(key), "' (parameter ", echo(index),
           " has no separate fp32 master)");
    const size_t i = *parsed;
    if (!(tensor.defined() && tensor.shape() == master_params_[i].shape() &&
          tensor.dtype() == master_params_[i].dtype()))
      fail(who, ": tensor entry '", echo(key), "' is ", tensor.described(), ", expected ",
           master_params_[i].described());
    masters[i] = tensor;
  }
  for (size_t i = 0; i < master_params_.size(); ++i)
    check(master_params_[i].same(model_params_[i]) || masters.count(i), who,
          ": missing tensor entry 'master.", i, "' (the fp32 master of ", model_params_[i].described(),
          ")");

  // ---- apply, rolling back on a failure inside the wrapped optimizer or a scaler ----
  const StateDict old_optimizer = optimizer_->state_dict();
  optimizer_->load_state_dict(inner);  // validates its whole dict first: throws having changed nothing
  try {
    load_scaler_states(scalers_, scaler_states);
  } catch (...) {
    optimizer_->load_state_dict(old_optimizer);
    throw;
  }

  // Nothing below throws: the masters take the saved values and their model parameters the masters rounded
  // once, exactly as after a step.
  NoGradGuard no_grad;
  for (auto& [i, tensor] : masters) {
    master_params_[i].copy_(tensor.to(master_params_[i].device()));
    model_params_[i].copy_(master_params_[i]);
  }
  skipped_steps_ = skipped;
  clear_grads();
  stepped_ = false;
}

}  // namespace mixtape
