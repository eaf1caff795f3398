#pragma once
// Adam (torch.optim.Adam: L2 weight decay added to the gradient) and AdamW (torch.optim.AdamW: decoupled
// weight decay, applied to the parameter before the Adam update). Per parameter p with gradient g, in
// group (lr, weight_decay), with t the parameter's own update count (1 on its first update):
//
//   AdamW only:  p = p * (1 - lr * weight_decay)
//   Adam only:   g = g + weight_decay * p
//   m = beta1 * m + (1 - beta1) * g                        ("exp_avg", starts at 0)
//   v = beta2 * v + (1 - beta2) * g * g                    ("exp_avg_sq", starts at 0)
//   step_size = lr / (1 - beta1^t)                         (bias corrections, in double)
//   denom     = sqrt(v) / sqrt(1 - beta2^t) + eps          (eps outside the square root)
//   p = p - (step_size * m) / denom
//
// The scalars (step_size, sqrt(1 - beta2^t), 1 - lr * weight_decay) are computed in double and rounded once
// to the compute type; the elementwise update runs in f32 (f64 for f64 parameters).
#include <map>
#include <string>
#include <vector>

#include "optim/optimizer.h"

namespace mixtape {

struct AdamOptions {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
};

class Adam : public Optimizer {
 public:
  explicit Adam(std::vector<ParamGroup> groups, AdamOptions options = {});
  // One group (PyTorch's defaults: lr 1e-3, weight_decay 0).
  Adam(std::vector<Tensor> params, double lr = 1e-3, double weight_decay = 0, AdamOptions options = {});

  const AdamOptions& options() const { return options_; }

 protected:
  Adam(const char* name, std::vector<ParamGroup> groups, AdamOptions options, bool decoupled_weight_decay);
  std::vector<std::string> buffer_names() const override { return {"exp_avg", "exp_avg_sq"}; }
  bool buffer_is_non_negative(const std::string& buffer) const override { return buffer == "exp_avg_sq"; }
  void update(const std::vector<PendingUpdate>& updates) override;
  std::map<std::string, std::string> options_metadata() const override;
  void load_options(const std::map<std::string, std::string>& metadata) override;

 private:
  AdamOptions options_;
  bool decoupled_weight_decay_;  // AdamW
};

class AdamW : public Adam {
 public:
  explicit AdamW(std::vector<ParamGroup> groups, AdamOptions options = {});
  // One group (PyTorch's defaults: lr 1e-3, weight_decay 1e-2).
  AdamW(std::vector<Tensor> params, double lr = 1e-3, double weight_decay = 1e-2, AdamOptions options = {});
};

}  // namespace mixtape
