#include "optim/adam.h"

#include <cmath>

#include <map>

#include "tensor/backend.h"

namespace mixtape {

namespace {

void check_options(const char* who, const AdamOptions& options) {
  check(options.beta1 >= 0 && options.beta1 < 1, who, ": beta1 must be in [0, 1), got ", options.beta1);
  check(options.beta2 >= 0 && options.beta2 < 1, who, ": beta2 must be in [0, 1), got ", options.beta2);
  check(std::isfinite(options.eps) && options.eps >= 0, who, ": eps must be finite and >= 0, got ",
        options.eps);
}

}  // namespace

Adam::Adam(const char* name, std::vector<ParamGroup> groups, AdamOptions options, bool decoupled_weight_decay)
    : Optimizer(name, std::move(groups)), options_(options), decoupled_weight_decay_(decoupled_weight_decay) {
  check_options(name, options_);
}

Adam::Adam(std::vector<ParamGroup> groups, AdamOptions options)
    : Adam("Adam", std::move(groups), options, false) {}

Adam::Adam(std::vector<Tensor> params, double lr, double weight_decay, AdamOptions options)
    : Adam(std::vector<ParamGroup>{ParamGroup{std::move(params), lr, weight_decay}}, options) {}

AdamW::AdamW(std::vector<ParamGroup> groups, AdamOptions options)
    : Adam("AdamW", std::move(groups), options, true) {}

AdamW::AdamW(std::vector<Tensor> params, double lr, double weight_decay, AdamOptions options)
    : AdamW(std::vector<ParamGroup>{ParamGroup{std::move(params), lr, weight_decay}}, options) {}

void Adam::update(const std::vector<PendingUpdate>& updates) {
  // One fused multi-tensor call per device (parameters of one model normally share one).
  std::map<std::pair<int, int>, std::vector<AdamUpdate>> by_device;
  for (const PendingUpdate& u : updates) {
    const double t = static_cast<double>(u.state->step);
    const ParamGroup& group = *u.group;
    AdamUpdate a;
    a.param = u.param;
    a.grad = u.grad;
    a.exp_avg = u.state->buffers.at("exp_avg");
    a.exp_avg_sq = u.state->buffers.at("exp_avg_sq");
    a.step_size = group.lr / (1 - std::pow(options_.beta1, t));
    a.bias_correction2_sqrt = std::sqrt(1 - std::pow(options_.beta2, t));
    a.weight_decay = group.weight_decay;
    a.decay_factor = 1 - group.lr * group.weight_decay;
    // As PyTorch, a zero weight decay skips the decay (AdamW's factor would be exactly 1 anyway).
    a.mode = group.weight_decay == 0    ? WeightDecayMode::None
             : decoupled_weight_decay_ ? WeightDecayMode::Decoupled
                                        : WeightDecayMode::L2;
    const Device device = u.param.device();
    by_device[{static_cast<int>(device.type), device.index}].push_back(std::move(a));
  }
  for (auto& [key, list] : by_device)
    backend_of(list.front().param).adam_step(list, options_.beta1, options_.beta2, options_.eps);
}

std::map<std::string, std::string> Adam::options_metadata() const {
  return {{"beta1", format_number(options_.beta1)},
          {"beta2", format_number(options_.beta2)},
          {"eps", format_number(options_.eps)}};
}

void Adam::load_options(const std::map<std::string, std::string>& metadata) {
  AdamOptions loaded;
  loaded.beta1 = read_number(metadata, "beta1");
  loaded.beta2 = read_number(metadata, "beta2");
  loaded.eps = read_number(metadata, "eps");
  check_options((std::string(name()) + ".load_state_dict").c_str(), loaded);
  options_ = loaded;
}

}  // namespace mixtape
