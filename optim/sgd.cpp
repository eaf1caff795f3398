#include "optim/sgd.h"

#include <cmath>

#include <map>

#include "tensor/backend.h"

namespace mixtape {

namespace {

void check_options(const char* who, const SGDOptions& options) {
  check(std::isfinite(options.momentum) && options.momentum >= 0, who,
        ": momentum must be finite and >= 0, got ", options.momentum);
  check(std::isfinite(options.dampening), who, ": dampening must be finite, got ", options.dampening);
  check(!options.nesterov || (options.momentum > 0 && options.dampening == 0), who,
        ": nesterov momentum needs momentum > 0 and dampening == 0 (got momentum ", options.momentum,
        ", dampening ", options.dampening, ")");
}

}  // namespace

SGD::SGD(std::vector<ParamGroup> groups, SGDOptions options)
    : Optimizer("SGD", std::move(groups)), options_(options) {
  check_options("SGD", options_);
}

SGD::SGD(std::vector<Tensor> params, double lr, double weight_decay, SGDOptions options)
    : SGD(std::vector<ParamGroup>{ParamGroup{std::move(params), lr, weight_decay}}, options) {}

void SGD::update(const std::vector<PendingUpdate>& updates) {
  std::map<std::pair<int, int>, std::vector<SgdUpdate>> by_device;
  for (const PendingUpdate& u : updates) {
    SgdUpdate s;
    s.param = u.param;
    s.grad = u.grad;
    if (options_.momentum != 0) s.momentum_buffer = u.state->buffers.at("momentum_buffer");
    s.lr = u.group->lr;
    s.weight_decay = u.group->weight_decay;
    s.first_step = u.state->step == 1;
    const Device device = u.param.device();
    by_device[{static_cast<int>(device.type), device.index}].push_back(std::move(s));
  }
  for (auto& [key, list] : by_device)
    backend_of(list.front().param).sgd_step(list, options_.momentum, options_.dampening, options_.nesterov);
}

std::map<std::string, std::string> SGD::options_metadata() const {
  return {{"momentum", format_number(options_.momentum)},
          {"dampening", format_number(options_.dampening)},
          {"nesterov", options_.nesterov ? "true" : "false"}};
}

void SGD::load_options(const std::map<std::string, std::string>& metadata) {
  SGDOptions loaded;
  loaded.momentum = read_number(metadata, "momentum");
  loaded.dampening = read_number(metadata, "dampening");
  loaded.nesterov = read_bool(metadata, "nesterov");
  check_options("SGD.load_state_dict", loaded);
  options_ = loaded;
}

}  // namespace mixtape
