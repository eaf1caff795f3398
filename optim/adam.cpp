#include "optim/adam.h"

#include <cmath>

#include "tensor/cpu/strided.h"  // kParallelGrain

namespace mixtape {

namespace {

void check_options(const char* who, const AdamOptions& options) {
  check(options.beta1 >= 0 && options.beta1 < 1, who, ": beta1 must be in [0, 1), got ", options.beta1);
  check(options.beta2 >= 0 && options.beta2 < 1, who, ": beta2 must be in [0, 1), got ", options.beta2);
  check(std::isfinite(options.eps) && options.eps >= 0, who, ": eps must be finite and >= 0, got ",
        options.eps);
}

// The per-step scalars of one parameter's update, computed in double from (lr, t) and rounded once to A.
template <class A>
struct AdamScalars {
  A beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  A step_size;              // lr / (1 - beta1^t)
  A bias_correction2_sqrt;  // sqrt(1 - beta2^t)
  A weight_decay;           // Adam: the L2 coefficient added to the gradient
  A decay_factor;           // AdamW: 1 - lr * weight_decay
};

enum class WeightDecay { None, L2, Decoupled };

// One Adam/AdamW update of n contiguous elements (llm.c's adamw_update, with Adam's L2 variant). T is the
// parameter's type, A (= acc_t<T>) the type the update computes in and the moments are kept in; the
// parameter is rounded to T once, on store. The weight-decay form is a template argument so the loop has
// no branches and vectorises (omp simd: v >= 0, so sqrt never takes its errno path). Each element's result
// depends only on that element, so any thread count and vector width give the same bits.
template <class T, WeightDecay kDecay>
void adam_update(T* param, const T* grad, acc_t<T>* exp_avg, acc_t<T>* exp_avg_sq, int64_t n,
                 const AdamScalars<acc_t<T>>& s) {
  using A = acc_t<T>;
#pragma omp parallel for simd schedule(static) if (n >= 2 * cpu::kParallelGrain)
  for (int64_t i = 0; i < n; ++i) {
    A p = convert<A>(param[i]);
    A g = convert<A>(grad[i]);
    if constexpr (kDecay == WeightDecay::Decoupled) p = p * s.decay_factor;  // AdamW, before the Adam step
    if constexpr (kDecay == WeightDecay::L2) g = g + s.weight_decay * p;  // Adam: L2 folded into the gradient
    const A m = s.beta1 * exp_avg[i] + s.one_minus_beta1 * g;
    const A v = s.beta2 * exp_avg_sq[i] + s.one_minus_beta2 * (g * g);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    const A denom = std::sqrt(v) / s.bias_correction2_sqrt + s.eps;
    param[i] = convert<T>(p - (s.step_size * m) / denom);  // PyTorch's addcdiv order: (value * m) / denom
  }
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

void Adam::update(const ParamGroup& group, const Tensor& param, const Tensor& grad, ParamState& state) {
  const double t = static_cast<double>(state.step);
  const double bias_correction1 = 1 - std::pow(options_.beta1, t);
  const double bias_correction2 = 1 - std::pow(options_.beta2, t);
  dispatch_float(param.dtype(), name(), [&]<typename T>() {
    using A = acc_t<T>;
    AdamScalars<A> s;
    s.beta1 = static_cast<A>(options_.beta1);
    s.one_minus_beta1 = static_cast<A>(1 - options_.beta1);
    s.beta2 = static_cast<A>(options_.beta2);
    s.one_minus_beta2 = static_cast<A>(1 - options_.beta2);
    s.eps = static_cast<A>(options_.eps);
    s.step_size = static_cast<A>(group.lr / bias_correction1);
    s.bias_correction2_sqrt = static_cast<A>(std::sqrt(bias_correction2));
    s.weight_decay = static_cast<A>(group.weight_decay);
    s.decay_factor = static_cast<A>(1 - group.lr * group.weight_decay);
    T* p = param.data<T>();
    const T* g = grad.data<T>();
    A* m = state.buffers.at("exp_avg").data<A>();
    A* v = state.buffers.at("exp_avg_sq").data<A>();
    const int64_t n = param.numel();
    // As PyTorch, a zero weight decay skips the decay (AdamW's factor would be exactly 1 anyway).
    if (group.weight_decay == 0)
      adam_update<T, WeightDecay::None>(p, g, m, v, n, s);
    else if (decoupled_weight_decay_)
      adam_update<T, WeightDecay::Decoupled>(p, g, m, v, n, s);
    else
      adam_update<T, WeightDecay::L2>(p, g, m, v, n, s);
  });
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
