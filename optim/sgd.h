#pragma once
// Stochastic gradient descent with momentum, dampening, Nesterov momentum and L2 weight decay, with
// torch.optim.SGD's update exactly. Per parameter p with gradient g, in group (lr, weight_decay):
//
//   g   = g + weight_decay * p                        (if weight_decay != 0)
//   if momentum != 0:
//     buf = g                                         (first update: the buffer starts as the gradient,
//                                                      undamped)
//     buf = momentum * buf + (1 - dampening) * g      (later updates)
//     g   = nesterov ? g + momentum * buf : buf
//   p   = p - lr * g
//
// State: "momentum_buffer" per parameter, only when momentum != 0 (without momentum SGD keeps no state).
#include <map>
#include <string>
#include <vector>

#include "optim/optimizer.h"

namespace mixtape {

struct SGDOptions {
  double momentum = 0;
  double dampening = 0;
  bool nesterov = false;  // needs momentum > 0 and dampening == 0, as in PyTorch
};

class SGD : public Optimizer {
 public:
  explicit SGD(std::vector<ParamGroup> groups, SGDOptions options = {});
  // One group.
  SGD(std::vector<Tensor> params, double lr, double weight_decay = 0, SGDOptions options = {});

  const SGDOptions& options() const { return options_; }

 protected:
  std::vector<std::string> buffer_names() const override { return {"momentum_buffer"}; }
  bool keeps_state() const override { return options_.momentum != 0; }
  void update(const std::vector<PendingUpdate>& updates) override;
  std::map<std::string, std::string> options_metadata() const override;
  void load_options(const std::map<std::string, std::string>& metadata) override;

 private:
  SGDOptions options_;
};

}  // namespace mixtape
