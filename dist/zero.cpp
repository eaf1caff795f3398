#include "dist/zero.h"

#include <algorithm>
#include <charconv>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <exception>
#include <map>
#include <set>
#include <string>
#include <system_error>
#include <utility>

#include "autograd/autograd.h"
#include "optim/clip.h"
#include "tensor/autograd_node.h"
#include "tensor/error.h"
#include "tensor/minifloat.h"
#include "tensor/ops.h"
#include "tensor/quantize.h"

namespace mixtape::dist {

namespace {

constexpr const char* kWho = "ZeroOptimizer";

bool starts_with(const std::string& text, const std::string& prefix) { return text.rfind(prefix, 0) == 0; }

}  // namespace

ZeroOptimizer::ZeroOptimizer(std::unique_ptr<Optimizer> optimizer,
                             std::vector<std::unique_ptr<LossScaler>> scalers, Communicator dp,
                             ZeroOptions options)
    : optimizer_(std::move(optimizer)), scalers_(std::move(scalers)), dp_(std::move(dp)), options_(options) {
  check(optimizer_ != nullptr, kWho, ": expected an optimizer to wrap, got null");
  check(!scalers_.empty(), kWho, ": expected at least one loss scaler (one per loss; StaticLossScaler(1) for ",
        "no scaling), got none");
  for (size_t k = 0; k < scalers_.size(); ++k)
    check(scalers_[k] != nullptr, kWho, ": loss scaler ", k, " is null, expected a LossScaler");
  check(std::isfinite(options_.clip_grad) && options_.clip_grad >= 0, kWho,
        ": clip_grad must be finite and >= 0 (0 = off), got ", options_.clip_grad);
  for (const Tensor& param : optimizer_->params()) {
    check(optimizer_->state(param) == nullptr, kWho, ": the wrapped ", optimizer_->name(),
          " already has state for parameter ", param.described(), "; expected an optimizer that has not ",
          "taken a step (its state is kept for the fp32 shard)");
    check(Optimizer::state_dtype(param) == DType::F32, kWho, ": parameter ", param.described(),
          " computes in f64; expected f16, bf16 or f32 parameters (the optimizer state is f32)");
  }
  for (const ParamGroup& group : optimizer_->param_groups()) {
    group_counts_.push_back(static_cast<int64_t>(group.params.size()));
    for (const Tensor& param : group.params) {
      check(param.device() == optimizer_->params().front().device(), kWho, ": parameter ",
            param.described(), " is on another device than the first parameter; expected one device");
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
      const DType dtype = options_.master_weights ? DType::F32 : model_params_[index].dtype();
      piece.master = Tensor::empty({piece.length}, dtype, model_params_[index].device());
      piece.master.copy_(model_params_[index].detach().reshape({-1}).narrow(0, piece.param_offset, piece.length));
      piece.master.requires_grad_();
      owned.push_back(piece.master);
      pieces_.push_back(std::move(piece));
    }
    group.params = std::move(owned);
  }
  found_inf_.assign(scalers_.size(), false);
  used_.assign(scalers_.size(), false);
  if (publishes_fp8()) publish_masters();  // from the first forward on, the model holds what steps publish
}

ZeroOptimizer::ZeroOptimizer(std::unique_ptr<Optimizer> optimizer, std::unique_ptr<LossScaler> scaler,
                             Communicator dp, ZeroOptions options)
    : ZeroOptimizer(std::move(optimizer), one_scaler(std::move(scaler)), std::move(dp), std::move(options)) {}

void ZeroOptimizer::check_loss_id(int loss_id, const char* what) const {
  check(loss_id >= 0 && loss_id < num_losses(), kWho, ".", what, ": loss_id ", loss_id,
        " out of range, expected 0 <= loss_id < num_losses = ", num_losses());
}

LossScaler& ZeroOptimizer::scaler(int loss_id) {
  check_loss_id(loss_id, "scaler");
  return *scalers_[static_cast<size_t>(loss_id)];
}

double ZeroOptimizer::loss_scale(int loss_id) const {
  check_loss_id(loss_id, "loss_scale");
  return scalers_[static_cast<size_t>(loss_id)]->scale();
}

bool ZeroOptimizer::separate_master(size_t param) const {
  return options_.master_weights && is_low_precision(model_params_[param].dtype());
}

Tensor ZeroOptimizer::scale_loss(const Tensor& loss, int loss_id) {
  check_loss_id(loss_id, "scale_loss");
  if (pending_loss_ >= 0 && pending_loss_ != loss_id) fold_pending_grads();
  pending_loss_ = loss_id;
  used_[static_cast<size_t>(loss_id)] = true;
  return scalers_[static_cast<size_t>(loss_id)]->scale(loss);
}

void ZeroOptimizer::backward(const Tensor& loss, int loss_id) { mixtape::backward(scale_loss(loss, loss_id)); }

void ZeroOptimizer::zero_grad() {
  for (Tensor& param : model_params_) param.set_grad(Tensor());
  for (Piece& piece : pieces_) piece.master.set_grad(Tensor());
  folded_ = Tensor();
  pending_loss_ = -1;
  found_inf_.assign(scalers_.size(), false);
  used_.assign(scalers_.size(), false);
}

void ZeroOptimizer::check_known_scale(const Tensor& param) const {
  check(pending_loss_ >= 0 || !param.grad().defined(), kWho, ": parameter ", param.described(),
        " has a gradient, but no loss went through scale_loss()/backward() of this optimizer since the last step ",
        "or zero_grad(); expected its gradients to carry a known loss scale");
}

Tensor ZeroOptimizer::take_grads() {
  NoGradGuard no_grad;
  Tensor flat = Tensor::zeros({shard_size_ * dp_.size()}, DType::F32, model_params_.front().device());
  for (size_t i = 0; i < model_params_.size(); ++i) {
    const Tensor grad = model_params_[i].grad();
    if (!grad.defined()) continue;
    check_known_scale(model_params_[i]);
    check(grad.shape() == model_params_[i].shape(), kWho, ": the gradient of parameter ", i, " is ",
          grad.described(), ", expected ", model_params_[i].described());
    flat.narrow(0, offsets_[i], model_params_[i].numel()).copy_(grad.reshape({-1}));
    model_params_[i].set_grad(Tensor());  // consumed
  }
  return flat;
}

void ZeroOptimizer::fold_pending_grads() {
  NoGradGuard no_grad;
  Tensor flat = take_grads();
  const auto k = static_cast<size_t>(pending_loss_);
  pending_loss_ = -1;
  if (unscale_and_check_finite({flat}, 1.0 / scalers_[k]->scale())) {
    // The step will be skipped; leaving the inf out of the sum keeps it apart from an overflow of the sum.
    found_inf_[k] = true;
    return;
  }
  if (folded_.defined())
    folded_.add_(flat);
  else
    folded_ = flat;
}

Tensor ZeroOptimizer::gather_shard(const std::vector<Tensor>& piece_values) const {
  Tensor local = Tensor::zeros({shard_size_}, DType::F32, model_params_.front().device());
  for (size_t k = 0; k < pieces_.size(); ++k)
    local.narrow(0, pieces_[k].shard_offset, pieces_[k].length).copy_(piece_values[k]);
  return dp_.all_gather(local);
}

void ZeroOptimizer::publish_masters() {
  NoGradGuard no_grad;
  std::vector<Tensor> values;
  for (const Piece& piece : pieces_) values.push_back(piece.master.detach());
  if (!publishes_fp8()) {
    const Tensor full = gather_shard(values);
    for (size_t i = 0; i < model_params_.size(); ++i)
      model_params_[i].copy_(full.narrow(0, offsets_[i], model_params_[i].numel()).reshape(model_params_[i].shape()));
    return;
  }
  // fp8_all_gather: one E4M3 scale per parameter, 448 / its amax over every rank's pieces (MAX over dp), as
  // torchao's float8 all-gather for FSDP scales each weight. Every rank then knows every scale, so only the
  // codes travel, and the copies of a tied parameter (the embedding on the first and last pipeline stages,
  // each sharded over its own dp group) round alike. A parameter holding Inf or NaN gets NaN values.
  std::vector<double> amax(model_params_.size(), 0.0);
  std::vector<Tensor> host(values.size());
  for (size_t k = 0; k < pieces_.size(); ++k) {
    host[k] = values[k].to(Device::cpu()).to(DType::F32).contiguous();
    const float* p = static_cast<const float*>(host[k].data_ptr());
    double& a = amax[pieces_[k].param];
    for (int64_t i = 0; i < pieces_[k].length; ++i)
      a = std::isfinite(p[i]) ? std::max(a, static_cast<double>(std::fabs(p[i]))) : INFINITY;
  }
  dp_.all_reduce(amax, Reduction::Max);
  std::vector<float> encode(amax.size()), decode(amax.size());
  for (size_t i = 0; i < amax.size(); ++i) {
    const bool finite = std::isfinite(amax[i]);
    encode[i] = !finite || amax[i] == 0 ? 1.0f : std::min(kE4M3Max / static_cast<float>(amax[i]), FLT_MAX);
    decode[i] = finite ? 1.0f / encode[i] : NAN;
  }
  Tensor local = Tensor::empty({shard_size_}, DType::F8E4M3);
  std::memset(local.data_ptr(), 0, static_cast<size_t>(shard_size_));  // the padding: code 0
  for (size_t k = 0; k < pieces_.size(); ++k) {
    QuantizeOptions o;
    o.format = DType::F8E4M3;
    o.fixed_scale = encode[pieces_[k].param];
    const Quantized q = quantize(host[k].reshape({1, pieces_[k].length}), o);
    std::memcpy(static_cast<uint8_t*>(local.data_ptr()) + pieces_[k].shard_offset, q.codes.data_ptr(),
                static_cast<size_t>(pieces_[k].length));
  }
  const Tensor codes = dp_.all_gather(local);  // [dp * S]
  for (size_t i = 0; i < model_params_.size(); ++i) {
    const int64_t n = model_params_[i].numel();
    Quantized q;
    q.codes = codes.narrow(0, offsets_[i], n).reshape({1, n});
    q.scales = Tensor::from_vector(std::vector<float>{decode[i]}, {1, 1});
    q.block_rows = 1;
    q.block_cols = n;
    model_params_[i].copy_(dequantize(q).reshape(model_params_[i].shape()).to(model_params_[i].device()));
  }
}

std::vector<Tensor> ZeroOptimizer::master_values() const {
  NoGradGuard no_grad;
  std::vector<Tensor> values;
  for (const Piece& piece : pieces_) values.push_back(piece.master.detach());
  const Tensor full = gather_shard(values);
  std::vector<Tensor> out;
  for (size_t i = 0; i < model_params_.size(); ++i)
    out.push_back(full.narrow(0, offsets_[i], model_params_[i].numel()).reshape(model_params_[i].shape()).clone());
  return out;
}

StepResult ZeroOptimizer::step() {
  StepResult result;
  result.loss_scale = scalers_[0]->scale();
  NoGradGuard no_grad;
  const size_t n = scalers_.size();

  // 0. The losses used this step, over every rank: every rank reduces the same kind of buffer below.
  std::vector<double> used(n);
  for (size_t k = 0; k < n; ++k) used[k] = used_[k] ? 1.0 : 0.0;
  dp_.all_reduce(used, Reduction::Max);
  // Also over model_parallel (the tp x pp grid with dp: the two MAXes are the global one), so that every rank
  // agrees on a step without any loss below.
  if (options_.model_parallel) options_.model_parallel->all_reduce_max(used);
  size_t used_count = 0, only = 0;
  for (size_t k = 0; k < n; ++k)
    if (used[k] != 0.0) ++used_count, only = k;
  if (used_count == 0) {
    // No backward since the last step on any rank: nothing to step (MixedPrecisionOptimizer's masters have no
    // gradient then, and its optimizer leaves them alone), no scaler to update. A gradient that bypassed
    // scale_loss()/backward() is still an error.
    for (const Tensor& param : model_params_) check_known_scale(param);
    for (Piece& piece : pieces_) piece.master.set_grad(Tensor());
    return result;
  }

  // 1. Reduce-scatter the flat f32 gradients; average and unscale the shard in one pass (one loss), or average
  // the shard of the sum the folds unscaled (several).
  Tensor shard;
  if (used_count <= 1) {
    shard = dp_.reduce_scatter(take_grads(), Reduction::Sum);
    if (unscale_and_check_finite({shard}, 1.0 / (scalers_[only]->scale() * dp_.size()))) found_inf_[only] = true;
  } else {
    if (pending_loss_ >= 0) fold_pending_grads();
    if (!folded_.defined()) folded_ = take_grads();  // this rank took no backward: zeros
    shard = dp_.reduce_scatter(folded_, Reduction::Sum);
    folded_ = Tensor();
    if (unscale_and_check_finite({shard}, 1.0 / dp_.size()))
      for (size_t k = 0; k < n; ++k) found_inf_[k] = found_inf_[k] || used[k] != 0.0;
  }
  pending_loss_ = -1;

  // 2. Every rank skips together: the inf may sit in one rank's shard only. (`used` is global already, so
  // every rank, every pipeline stage included, updates the same scalers.)
  std::vector<double> found_inf(n);
  for (size_t k = 0; k < n; ++k) found_inf[k] = found_inf_[k] ? 1.0 : 0.0;
  dp_.all_reduce(found_inf, Reduction::Max);
  if (options_.model_parallel) options_.model_parallel->all_reduce_max(found_inf);
  bool any_inf = false;
  for (size_t k = 0; k < n; ++k) any_inf = any_inf || found_inf[k] != 0.0;
  const auto update_scalers = [&] {
    for (size_t k = 0; k < n; ++k)
      if (used[k] != 0.0) scalers_[k]->update(found_inf[k] != 0.0);
    found_inf_.assign(n, false);
    used_.assign(n, false);
  };
  if (any_inf) {
    for (Piece& piece : pieces_) piece.master.set_grad(Tensor());
    ++skipped_steps_;
    update_scalers();
    result.skipped = true;
    return result;
  }

  // 3. Norm: each element is owned by one dp rank (padding is zero).
  std::vector<Tensor> masters;
  for (Piece& piece : pieces_) {
    Tensor grad = shard.narrow(0, piece.shard_offset, piece.length).contiguous();
    if (grad.dtype() != piece.master.dtype()) grad = grad.to(piece.master.dtype());  // rounded once
    piece.master.set_grad(grad);
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

  // 4-5. Step the shard, gather, round once into the model parameters.
  optimizer_->step();
  publish_masters();
  update_scalers();  // 6.
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
    if (separate_master(i))
      dict.tensors["master." + std::to_string(i)] =
          masters.narrow(0, offsets_[i], model_params_[i].numel()).reshape(model_params_[i].shape()).clone();

  dict.metadata["amp.num_losses"] = std::to_string(scalers_.size());
  dict.metadata["amp.master_weights"] = options_.master_weights ? "true" : "false";
  dict.metadata["amp.skipped_steps"] = std::to_string(skipped_steps_);
  write_scaler_states(scalers_, dict.metadata);
  return dict;
}

// Parses "<prefix><i>" or "<prefix><i>.<rest>" into i (and rest); false if it is neither.
static bool parse_indexed(const std::string& key, const std::string& prefix, size_t& index, std::string* rest) {
  if (!starts_with(key, prefix)) return false;
  const char* first = key.data() + prefix.size();
  const char* last = key.data() + key.size();
  const auto [end, ec] = std::from_chars(first, last, index);
  if (ec != std::errc() || end == first) return false;
  if (rest == nullptr) return end == last;
  if (end == last || *end != '.' || end + 1 == last) return false;
  *rest = std::string(end + 1, last);
  return true;
}

void ZeroOptimizer::load_state_dict(const StateDict& dict) {
  const std::string who = std::string(kWho) + ".load_state_dict";
  NoGradGuard no_grad;
  // Collective: every rank validates and loads its part; if any rank fails, every rank that loaded rolls back
  // and throws, so that no rank goes on to the next collective alone and no rank keeps half a state.
  StateDict old_optimizer;
  std::vector<std::map<std::string, std::string>> old_scalers;
  std::vector<Tensor> new_masters(pieces_.size());
  int64_t skipped = 0;
  bool applied = false;
  std::exception_ptr failure;
  try {
    // ---- checks that do not depend on the rank: every rank finds the same fault in the dict ----
    skipped = read_amp_entries(dict.metadata, num_losses(), options_.master_weights, who);
    const std::vector<std::map<std::string, std::string>> scaler_states =
        read_scaler_states(dict.metadata, scalers_, who);
    for (const auto& [key, value] : dict.metadata) {
      size_t i = 0;
      std::string rest;
      if (starts_with(key, "state."))
        check(parse_indexed(key, "state.", i, &rest) && rest == "step" && i < model_params_.size(), who,
              ": unexpected metadata entry '", echo(key), "' (expected state.<i>.step with i < ", model_params_.size(),
              ")");
    }
    for (const auto& [key, tensor] : dict.tensors) {
      size_t i = 0;
      std::string rest;
      const bool master = parse_indexed(key, "master.", i, nullptr);
      check((master && i < model_params_.size() && separate_master(i)) ||
                (!master && parse_indexed(key, "state.", i, &rest) && i < model_params_.size()),
            who, ": unexpected tensor entry '", echo(key), "' (expected master.<i> for a 16-bit parameter with an ",
            "fp32 master, or state.<i>.<buffer>, with i < ", model_params_.size(), ")");
      const Tensor& param = model_params_[i];
      const DType dtype = master ? DType::F32 : Optimizer::state_dtype(param);
      check(tensor.defined() && tensor.shape() == param.shape() && tensor.dtype() == dtype, who,
            ": tensor entry '", echo(key), "' is ", tensor.described(), ", expected ",
            dtype_name(dtype), shape_text(param.shape()), " for parameter ", i, " (", param.described(), ")");
    }
    for (size_t i = 0; i < model_params_.size(); ++i)
      check(!separate_master(i) || dict.tensors.count("master." + std::to_string(i)), who,
            ": missing tensor entry 'master.", i, "' (the fp32 master of ", model_params_[i].described(), ")");

    // ---- this rank's part: the wrapped optimizer's dict for its pieces (numbered in group order) ----
    StateDict inner;
    for (const auto& [key, value] : dict.metadata)
      if (!starts_with(key, "amp.") && !starts_with(key, "state.") && !starts_with(key, "scaler."))
        inner.metadata[key] = value;
    int64_t first = 0;  // index of group g's first parameter
    for (size_t g = 0; g < group_counts_.size(); ++g) {
      const std::string key = "param_groups." + std::to_string(g) + ".params";
      const auto found = dict.metadata.find(key);
      check(found != dict.metadata.end() && found->second == std::to_string(group_counts_[g]), who, ": entry '",
            echo(key), "' is ", found == dict.metadata.end() ? std::string("missing") : "'" + echo(found->second) + "'",
            ", expected '", group_counts_[g], "'");
      int64_t owned = 0;  // this rank's pieces of group g
      for (const Piece& piece : pieces_) {
        const auto param = static_cast<int64_t>(piece.param);
        if (param >= first && param < first + group_counts_[g]) ++owned;
      }
      inner.metadata[key] = std::to_string(owned);
      first += group_counts_[g];
    }
    for (size_t k = 0; k < pieces_.size(); ++k) {
      const Piece& piece = pieces_[k];
      const size_t i = piece.param;
      const std::string prefix = "state." + std::to_string(i) + ".";
      const auto step = dict.metadata.find(prefix + "step");
      if (step != dict.metadata.end()) inner.metadata["state." + std::to_string(k) + ".step"] = step->second;
      for (const auto& [key, tensor] : dict.tensors)
        if (starts_with(key, prefix))
          inner.tensors["state." + std::to_string(k) + "." + key.substr(prefix.size())] =
              tensor.contiguous().reshape({-1}).narrow(0, piece.param_offset, piece.length).clone();
      const Tensor source = separate_master(i) ? dict.tensors.at("master." + std::to_string(i))
                                               : model_params_[i].detach();
      new_masters[k] = source.contiguous().reshape({-1}).narrow(0, piece.param_offset, piece.length);
    }
    old_optimizer = optimizer_->state_dict();
    for (const auto& scaler : scalers_) old_scalers.push_back(scaler->state_dict());
    optimizer_->load_state_dict(inner);  // validates its dict first: throws having changed nothing
    try {
      load_scaler_states(scalers_, scaler_states);
    } catch (...) {
      optimizer_->load_state_dict(old_optimizer);
      throw;
    }
    applied = true;
  } catch (...) {
    failure = std::current_exception();
  }
  std::vector<double> failed = {failure ? 1.0 + dp_.rank() : 0.0};  // MAX: the highest failing rank, plus one
  dp_.all_reduce(failed, Reduction::Max);
  if (failed[0] != 0.0) {
    if (applied) {
      optimizer_->load_state_dict(old_optimizer);
      load_scaler_states(scalers_, old_scalers);
    }
    if (failure) std::rethrow_exception(failure);
    check(false, who, ": rank ", static_cast<int64_t>(failed[0]) - 1, " of ", dp_.name(),
          " rejected the state dict (its error says why); nothing was loaded");
  }

  // ---- apply (every rank validated and loaded): the pieces, then every model parameter ----
  for (size_t k = 0; k < pieces_.size(); ++k) pieces_[k].master.copy_(new_masters[k]);
  publish_masters();
  skipped_steps_ = skipped;
  zero_grad();
}

void ZeroOptimizer::reload_masters() {
  NoGradGuard no_grad;
  for (Piece& piece : pieces_)
    piece.master.copy_(model_params_[piece.param].detach().reshape({-1}).narrow(0, piece.param_offset, piece.length));
  if (publishes_fp8()) publish_masters();  // the model holds what a step would have published
}

}  // namespace mixtape::dist
