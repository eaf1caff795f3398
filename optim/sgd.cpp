#include "optim/sgd.h"

#include <cmath>

#include "tensor/cpu/strided.h"  // kParallelGrain

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

// One SGD update of n contiguous elements. T is the parameter's type, A (= acc_t<T>) the type the update
// computes in and the momentum buffer is kept in; the parameter is rounded to T once, on store.
template <class T>
void sgd_update(T* param, const T* grad, acc_t<T>* momentum_buffer, int64_t n, double lr_,
                double weight_decay_, double momentum_, double dampening_, bool nesterov, bool first_step) {
  using A = acc_t<T>;
  const A lr = static_cast<A>(lr_), weight_decay = static_cast<A>(weight_decay_);
  const A momentum = static_cast<A>(momentum_), one_minus_dampening = static_cast<A>(1 - dampening_);
#pragma omp parallel for schedule(static) if (n >= 2 * cpu::kParallelGrain)
  for (int64_t i = 0; i < n; ++i) {
    const A p = convert<A>(param[i]);
    A g = convert<A>(grad[i]);
    if (weight_decay != 0) g += weight_decay * p;  // L2 penalty folded into the gradient
    if (momentum != 0) {
      const A buf = first_step ? g : momentum * momentum_buffer[i] + one_minus_dampening * g;
      momentum_buffer[i] = buf;
      g = nesterov ? g + momentum * buf : buf;
    }
    param[i] = convert<T>(p - lr * g);
  }
}

}  // namespace

SGD::SGD(std::vector<ParamGroup> groups, SGDOptions options)
    : Optimizer("SGD", std::move(groups)), options_(options) {
  check_options("SGD", options_);
}

SGD::SGD(std::vector<Tensor> params, double lr, double weight_decay, SGDOptions options)
    : SGD(std::vector<ParamGroup>{ParamGroup{std::move(params), lr, weight_decay}}, options) {}

void SGD::update(const ParamGroup& group, const Tensor& param, const Tensor& grad, ParamState& state) {
  const int64_t n = param.numel();
  dispatch_float(param.dtype(), "SGD.step", [&]<typename T>() {
    acc_t<T>* buffer =
        options_.momentum != 0 ? state.buffers.at("momentum_buffer").data<acc_t<T>>() : nullptr;
    sgd_update<T>(param.data<T>(), grad.data<T>(), buffer, n, group.lr, group.weight_decay, options_.momentum,
                  options_.dampening, options_.nesterov, state.step == 1);
  });
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
