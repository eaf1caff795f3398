#include "optim/schedule.h"

#include <cmath>
#include <numbers>

namespace mixtape {

namespace {

void check_step(const char* who, int64_t step) {
  check(step >= 0, who, ".lr_at: step must be >= 0, got ", step);
}

void check_rate(const char* who, const char* what, double value) {
  check(std::isfinite(value) && value >= 0, who, ": ", what, " must be finite and >= 0, got ", value);
}

}  // namespace

ConstantLR::ConstantLR(double learning_rate) : learning_rate_(learning_rate) {
  check_rate("ConstantLR", "learning_rate", learning_rate);
}

double ConstantLR::lr_at(int64_t step) const {
  check_step("ConstantLR", step);
  return learning_rate_;
}

WarmupCosineLR::WarmupCosineLR(double learning_rate, double min_lr, int64_t warmup_iters,
                               int64_t lr_decay_iters)
    : learning_rate_(learning_rate),
      min_lr_(min_lr),
      warmup_iters_(warmup_iters),
      lr_decay_iters_(lr_decay_iters) {
  check_rate("WarmupCosineLR", "learning_rate", learning_rate);
  check_rate("WarmupCosineLR", "min_lr", min_lr);
  check(warmup_iters >= 0 && lr_decay_iters >= warmup_iters, "WarmupCosineLR: need 0 <= warmup_iters (",
        warmup_iters, ") <= lr_decay_iters (", lr_decay_iters, ")");
}

double WarmupCosineLR::lr_at(int64_t step) const {
  check_step("WarmupCosineLR", step);
  const double it = static_cast<double>(step);
  const double warmup_iters = static_cast<double>(warmup_iters_);
  const double lr_decay_iters = static_cast<double>(lr_decay_iters_);
  if (step < warmup_iters_) {
    // nanoGPT's order; a rate so large (> DBL_MAX / warmup_iters) that the product overflows is divided first,
    // which gives the same value within an ulp instead of inf (the value itself is below learning_rate).
    const double lr = learning_rate_ * (it + 1) / (warmup_iters + 1);
    return std::isfinite(lr) ? lr : learning_rate_ * ((it + 1) / (warmup_iters + 1));
  }
  if (step > lr_decay_iters_ || lr_decay_iters_ == warmup_iters_) return min_lr_;
  const double decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters);
  const double coeff = 0.5 * (1.0 + std::cos(std::numbers::pi * decay_ratio));
  return min_lr_ + coeff * (learning_rate_ - min_lr_);
}

void set_lr(Optimizer& optimizer, double lr) {
  check(std::isfinite(lr) && lr >= 0, "set_lr: learning rate must be finite and >= 0, got ", lr);
  for (ParamGroup& group : optimizer.param_groups()) group.lr = lr;
}

double apply_schedule(Optimizer& optimizer, const LRSchedule& schedule, int64_t step) {
  const double lr = schedule.lr_at(step);
  set_lr(optimizer, lr);
  return lr;
}

}  // namespace mixtape
