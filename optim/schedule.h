#pragma once
// Learning-rate schedules: a function from the step number (0 for the first optimizer step) to the learning
// rate, and the helper that writes it into an optimizer's groups before each step.
#include <cstdint>

#include "optim/optimizer.h"

namespace mixtape {

class LRSchedule {
 public:
  virtual ~LRSchedule() = default;
  virtual double lr_at(int64_t step) const = 0;  // step >= 0
};

// The same learning rate at every step.
class ConstantLR : public LRSchedule {
 public:
  explicit ConstantLR(double learning_rate);
  double lr_at(int64_t step) const override;

 private:
  double learning_rate_;
};

// nanoGPT's get_lr, exactly (it = step; the divisions are in double):
//   it <  warmup_iters:                  learning_rate * (it + 1) / (warmup_iters + 1)
//   it >  lr_decay_iters:                min_lr
//   otherwise:  decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)        (in [0, 1])
//               coeff       = 0.5 * (1 + cos(pi * decay_ratio))                             (1 .. 0)
//               lr          = min_lr + coeff * (learning_rate - min_lr)
// So the warm-up never reaches 0 or learning_rate itself (step 0 gets learning_rate / (warmup + 1)), step
// warmup_iters gets learning_rate, and lr_decay_iters gets min_lr. Requires
// 0 <= warmup_iters <= lr_decay_iters; where they are equal (nanoGPT divides 0 by 0 there) the decay is
// instantaneous and step warmup_iters already gets min_lr.
class WarmupCosineLR : public LRSchedule {
 public:
  WarmupCosineLR(double learning_rate, double min_lr, int64_t warmup_iters, int64_t lr_decay_iters);
  double lr_at(int64_t step) const override;

 private:
  double learning_rate_, min_lr_;
  int64_t warmup_iters_, lr_decay_iters_;
};

// Sets every group's lr to `lr` (nanoGPT: all groups share the schedule's learning rate).
void set_lr(Optimizer& optimizer, double lr);
// set_lr(optimizer, schedule.lr_at(step)); returns that learning rate (for logging).
double apply_schedule(Optimizer& optimizer, const LRSchedule& schedule, int64_t step);

}  // namespace mixtape
