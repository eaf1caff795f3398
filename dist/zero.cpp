#include "dist/zero.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <system_error>
#include <utility>

#include "autograd/autograd.h"
#include "optim/clip.h"
#include "tensor/autograd_node.h"
#include "tensor/error.h"
#include "tensor/ops.h"

namespace mixtape::dist {

namespace {

constexpr const char* kWho = "ZeroOptimizer";

bool starts_with(const std::string& text, const std::string& prefix) { return text.rfind(prefix, 0) == 0; }

}  // namespace

ZeroOptimizer::ZeroOptimizer(std::unique_ptr<Optimizer> optimizer, std::unique_ptr<LossScaler> scaler,
                             Communicator dp, ZeroOptions options)
    : optimizer_(std::move(optimizer)), scaler_(std::move(scaler)), dp_(std::move(dp)), options_(options) {
  check(optimizer_ != nullptr, kWho, ": expected an optimizer to wrap, got null");
  check(scaler_ != nullptr, kWho, ": expected a loss scaler (StaticLossScaler(1) for no scaling), got null");
  check(std::isfinite(options_.clip_grad) && options_.clip_grad >= 0, kWho,
        ": clip_grad must be finite and >= 0 (0 = off), got ", options_.clip_grad);
  for (const Tensor& param : optimizer_->params()) {
    check(optimizer_->state(param) == nullptr, kWho, ": the wrapped ", optimizer_->name(),
          " already has state for parameter ", param.description(), "; expected an optimizer that has not ",
          "taken a step (its state is kept for the fp32 shard)");
    check(Optimizer::state_dtype(param) == DType::F32, kWho, ": parameter ", param.description(),
          " computes in f64; expected f16, bf16 or f32 parameters (the shard is f32)");
  }
  for (const ParamGroup& group : optimizer_->param_groups()) {
    group_counts_.push_back(static_cast<int64_t>(group.params.size()));
    for (const Tensor& param : group.params) {
      check(param.device() == optimizer_->params().front().device(), kWho, ": parameter ",
            param.description(), " is on another device than the first parameter; expected one device");
      model_params_.push_back(param);
      offsets_.push_back(total_numel_);
      total_numel_ += param.numel();
    }
  }
  check(total_numel_ > 0, kWho, ": the wrapped optimizer has no parameters");
  check(options_.count_in_norm.empty() || options_.count_in_norm.size() == model_params_.size(), kWho,
        ": count_in_norm has ", options_.count_in_norm.size(), " entries, expected one per parameter (",
        model_params_.size(), ") or none");
  const int64_t dp_size = dp_.size();
  shard_size_ = (total_numel_ + dp_size - 1) / dp_size;
  const int64_t lo = dp_.rank() * shard_size_, hi = lo + shard_size_;
  check(lo < total_numel_, kWho, ": ", total_numel_, " parameter elements over ", dp_.name(), " of ", dp_size,
        " leave rank ", dp_.rank(), " nothing to own (shard ", shard_size_, "); expected at least ",
        (dp_size - 1) * shard_size_ + 1, " elements");

  NoGradGuard no_grad;
  size_t index = 0;
  for (ParamGroup& group : optimizer_->param_groups()) {
    std::vector<Tensor> owned;
    for (size_t j = 0; j < group.params.size(); ++j, ++index) {
      const int64_t begin = std::max(offsets_[index], lo);
      const int64_t end = std::min(offsets_[index] + model_params_[index].numel(), hi);
      if (begin >= end) continue;
      Piece piece{index, begin - offsets_[index], begin - lo, end - begin, Tensor()};
      piece.master = Tensor::empty({piece.length}, DType::F32, model_params_[index].device());
      piece.master.copy_(model_params_[index].detach().reshape({-1}).narrow(0, piece.param_offset, piece.length));
      piece.master.requires_grad_();
      owned.push_back(piece.master);
      pieces_.push_back(std::move(piece));
    }
    group.params = std::move(owned);
  }
}

Tensor ZeroOptimizer::scale_loss(const Tensor& loss) { return scaler_->scale(loss); }

void ZeroOptimizer::backward(const Tensor& loss) { mixtape::backward(scale_loss(loss)); }

void ZeroOptimizer::zero_grad() {
  for (Tensor& param : model_params_) param.set_grad(Tensor());
  for (Piece& piece : pieces_) piece.master.set_grad(Tensor());
}

Tensor ZeroOptimizer::gather_shard(const std::vector<Tensor>& piece_values) const {
  Tensor local = Tensor::zeros({shard_size_}, DType::F32, model_params_.front().device());
  for (size_t k = 0; k < pieces_.size(); ++k)
    local.narrow(0, pieces_[k].shard_offset, pieces_[k].length).copy_(piece_values[k]);
  return dp_.all_gather(local);
}

StepResult ZeroOptimizer::step() {
  StepResult result;
  result.loss_scale = scaler_->scale();
  NoGradGuard no_grad;
  const Device device = model_params_.front().device();

  // 1-2. Reduce-scatter the flat f32 gradients; average and unscale the shard in one pass.
  Tensor flat = Tensor::zeros({shard_size_ * dp_.size()}, DType::F32, device);
  for (size_t i = 0; i < model_params_.size(); ++i) {
    const Tensor grad = model_params_[i].grad();
    if (!grad.defined()) continue;
    check(grad.shape() == model_params_[i].shape(), kWho, ": the gradient of parameter ", i, " is ",
          grad.description(), ", expected ", model_params_[i].description());
    flat.narrow(0, offsets_[i], model_params_[i].numel()).copy_(grad.reshape({-1}));
    model_params_[i].set_grad(Tensor());  // consumed
  }
  Tensor shard = dp_.reduce_scatter(flat, Reduction::Sum);
  flat = Tensor();
  const bool local_inf = unscale_and_check_finite({shard}, 1.0 / (scaler_->scale() * dp_.size()));

  // 3. Every rank skips together: the inf may sit in one rank's shard only.
  std::vector<double> flag = {local_inf ? 1.0 : 0.0};
  dp_.all_reduce(flag, Reduction::Max);
  if (options_.model_parallel) options_.model_parallel->all_reduce_max(flag);
  if (flag[0] != 0.0) {
    for (Piece& piece : pieces_) piece.master.set_grad(Tensor());
    ++skipped_steps_;
    scaler_->update(true);
    result.skipped = true;
    return result;
  }

  // 4. Norm: each element is owned by one dp rank (padding is zero).
  std::vector<Tensor> masters;
  for (Piece& piece : pieces_) {
    piece.master.set_grad(shard.narrow(0, piece.shard_offset, piece.length).contiguous());
    masters.push_back(piece.master);
  }
  std::vector<Tensor> counted;
  for (size_t k = 0; k < pieces_.size(); ++k)
    if (options_.count_in_norm.empty() || options_.count_in_norm[pieces_[k].param]) counted.push_back(masters[k]);
  std::vector<double> sums = {grad_squared_norm(counted)};
  dp_.all_reduce(sums, Reduction::Sum);
  if (options_.model_parallel) options_.model_parallel->all_reduce_sum(sums);
  result.grad_norm = std::sqrt(sums[0]);
  if (options_.clip_grad > 0) clip_grads_with_norm(masters, options_.clip_grad, result.grad_norm);
  if (options_.log_num_zeros_in_grad) {  // as MixedPrecisionOptimizer counts them: after clipping
    std::vector<double> zeros = {static_cast<double>(grad_zero_count(counted))};
    dp_.all_reduce(zeros, Reduction::Sum);
    if (options_.model_parallel) options_.model_parallel->all_reduce_sum(zeros);
    result.num_zeros = static_cast<int64_t>(zeros[0]);
  }

  // 5-6. Step the shard, gather, round once into the model parameters.
  optimizer_->step();
  const Tensor full = gather_shard(masters);
  for (size_t i = 0; i < model_params_.size(); ++i)
    model_params_[i].copy_(full.narrow(0, offsets_[i], model_params_[i].numel()).reshape(model_params_[i].shape()));
  scaler_->update(false);
  return result;
}

StateDict ZeroOptimizer::state_dict() const {
  NoGradGuard no_grad;
  const StateDict inner = optimizer_->state_dict();
  StateDict dict;
  for (const auto& [key, value] : inner.metadata)
    if (!starts_with(key, "state.")) dict.metadata[key] = value;
  for (size_t g = 0; g < group_counts_.size(); ++g)
    dict.metadata["param_groups." + std::to_string(g) + ".params"] = std::to_string(group_counts_[g]);

  // Step counts (MAX over dp: a rank without a piece of parameter i knows nothing of it) and buffer names.
  std::vector<double> steps(model_params_.size(), 0.0);
  std::set<std::string> names;
  for (const Piece& piece : pieces_) {
    if (const ParamState* state = optimizer_->state(piece.master)) {
      steps[piece.param] = std::max(steps[piece.param], static_cast<double>(state->step));
      for (const auto& [name, buffer] : state->buffers) names.insert(name);
    }
  }
  dp_.all_reduce(steps, Reduction::Max);
  std::vector<double> count = {static_cast<double>(names.size())};
  std::vector<double> max_count = count;
  dp_.all_reduce(max_count, Reduction::Max);
  check(max_count[0] == count[0], kWho, ".state_dict: rank ", dp_.rank(), " of ", dp_.name(), " keeps ",
        names.size(), " state buffers, another rank ", max_count[0], "; expected every rank to have stepped");
  for (const std::string& name : names) {
    std::vector<Tensor> values;
    for (const Piece& piece : pieces_) {
      const ParamState* state = optimizer_->state(piece.master);
      values.push_back(state ? state->buffers.at(name)
                             : Tensor::zeros({piece.length}, DType::F32, piece.master.device()));
    }
    const Tensor full = gather_shard(values);
    for (size_t i = 0; i < model_params_.size(); ++i)
      if (steps[i] > 0)
        dict.tensors["state." + std::to_string(i) + "." + name] =
            full.narrow(0, offsets_[i], model_params_[i].numel()).reshape(model_params_[i].shape()).clone();
  }
  for (size_t i = 0; i < model_params_.size(); ++i)
    if (steps[i] > 0) dict.metadata["state." + std::to_string(i) + ".step"] = std::to_string(int64_t(steps[i]));

  std::vector<Tensor> master_values;
  for (const Piece& piece : pieces_) master_values.push_back(piece.master.detach());
  const Tensor masters = gather_shard(master_values);
  for (size_t i = 0; i < model_params_.size(); ++i)
    if (model_params_[i].dtype() == DType::F16 || model_params_[i].dtype() == DType::BF16)
      dict.tensors["master." + std::to_string(i)] =
          masters.narrow(0, offsets_[i], model_params_[i].numel()).reshape(model_params_[i].shape()).clone();

  dict.metadata["amp.num_losses"] = "1";
  dict.metadata["amp.master_weights"] = "true";
  dict.metadata["amp.skipped_steps"] = std::to_string(skipped_steps_);
  for (const auto& [key, value] : scaler_->state_dict()) dict.metadata["scaler.0." + key] = value;
  return dict;
}

void ZeroOptimizer::load_state_dict(const StateDict& dict) {
  const std::string who = std::string(kWho) + ".load_state_dict";
  NoGradGuard no_grad;
  // Translate the layout-free dict into the wrapped optimizer's (pieces numbered in group order).
  StateDict inner;
  std::map<std::string, std::string> scaler_state;
  int64_t skipped = 0;
  for (const auto& [key, value] : dict.metadata) {
    if (starts_with(key, "scaler.0.")) {
      scaler_state[key.substr(9)] = value;
    } else if (key == "amp.skipped_steps") {
      const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), skipped);
      check(!value.empty() && ec == std::errc() && end == value.data() + value.size() && skipped >= 0, who,
            ": metadata entry 'amp.skipped_steps' is '", value, "', expected a non-negative integer");
    } else if (key == "amp.num_losses") {
      check(value == "1", who, ": the state dict has ", value, " loss scalers, expected 1");
    } else if (key == "amp.master_weights") {
      check(value == "true", who, ": entry 'amp.master_weights' is '", value, "', expected 'true'");
    } else if (!starts_with(key, "state.")) {
      inner.metadata[key] = value;
    }
  }
  int64_t first = 0;  // index of group g's first parameter
  for (size_t g = 0; g < group_counts_.size(); ++g) {
    const std::string key = "param_groups." + std::to_string(g) + ".params";
    const auto found = dict.metadata.find(key);
    check(found != dict.metadata.end() && found->second == std::to_string(group_counts_[g]), who, ": entry '",
          key, "' is ", found == dict.metadata.end() ? std::string("missing") : "'" + found->second + "'",
          ", expected '", group_counts_[g], "'");
    int64_t owned = 0;  // this rank's pieces of group g
    for (const Piece& piece : pieces_) {
      const auto param = static_cast<int64_t>(piece.param);
      if (param >= first && param < first + group_counts_[g]) ++owned;
    }
    inner.metadata[key] = std::to_string(owned);
    first += group_counts_[g];
  }
  std::vector<Tensor> new_masters(pieces_.size());
  for (size_t k = 0; k < pieces_.size(); ++k) {
    const Piece& piece = pieces_[k];
    const size_t i = piece.param;
    const Tensor& param = model_params_[i];
    const std::string prefix = "state." + std::to_string(i) + ".";
    for (const auto& [key, value] : dict.metadata)
      if (key == prefix + "step") inner.metadata["state." + std::to_string(k) + ".step"] = value;
    for (const auto& [key, tensor] : dict.tensors) {
      if (!starts_with(key, prefix)) continue;
      check(tensor.numel() == param.numel(), who, ": tensor entry '", key, "' is ", tensor.description(),
            ", expected ", param.numel(), " elements (", param.description(), ")");
      inner.tensors["state." + std::to_string(k) + "." + key.substr(prefix.size())] =
          tensor.contiguous().reshape({-1}).narrow(0, piece.param_offset, piece.length).to(DType::F32).clone();
    }
    Tensor source = param.detach();
    if (param.dtype() == DType::F16 || param.dtype() == DType::BF16) {
      const auto found = dict.tensors.find("master." + std::to_string(i));
      check(found != dict.tensors.end() && found->second.numel() == param.numel(), who,
            ": missing or misshapen tensor entry 'master.", i, "' (the fp32 master of ", param.description(), ")");
      source = found->second;
    }
    new_masters[k] = source.contiguous().reshape({-1}).narrow(0, piece.param_offset, piece.length);
  }
  optimizer_->load_state_dict(inner);  // validates its dict first
  scaler_->load_state_dict(scaler_state);
  for (size_t k = 0; k < pieces_.size(); ++k) pieces_[k].master.copy_(new_masters[k]);
  // Every model parameter takes its master rounded once (the same on every rank: from the gathered shard).
  std::vector<Tensor> values;
  for (const Piece& piece : pieces_) values.push_back(piece.master.detach());
  const Tensor full = gather_shard(values);
  for (size_t i = 0; i < model_params_.size(); ++i)
    model_params_[i].copy_(full.narrow(0, offsets_[i], model_params_[i].numel()).reshape(model_params_[i].shape()));
  skipped_steps_ = skipped;
  zero_grad();
}

void ZeroOptimizer::reload_masters() {
  NoGradGuard no_grad;
  for (Piece& piece : pieces_)
    piece.master.copy_(model_params_[piece.param].detach().reshape({-1}).narrow(0, piece.param_offset, piece.length));
}

}  // namespace mixtape::dist
