#include "optim/clip.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "tensor/autograd_node.h"
#include <map>

#include "tensor/backend.h"
#include "tensor/ops.h"

namespace mixtape {

namespace {

// The defined gradients of `params` grouped by device, devices in a fixed order: one fused reduction per
// device, reproducible bit for bit (as a resumed run needs).
std::map<std::pair<int, int>, std::vector<Tensor>> grads_by_device(const std::vector<Tensor>& params,
                                                                   const char* who) {
  std::map<std::pair<int, int>, std::vector<Tensor>> by_device;
  for (const Tensor& param : params) {
    check(param.defined(), who, ": a parameter is an undefined tensor");
    const Tensor grad = param.grad();
    if (!grad.defined()) continue;
    by_device[{static_cast<int>(grad.device().type), grad.device().index}].push_back(grad);
  }
  return by_device;
}

}  // namespace

double grad_squared_norm(const std::vector<Tensor>& params) {
  NoGradGuard no_grad;
  double total = 0;
  for (auto& [key, grads] : grads_by_device(params, "grad_norm"))
    total += backend_of(grads.front()).sum_of_squares(grads);
  return total;
}

int64_t grad_zero_count(const std::vector<Tensor>& params) {
  NoGradGuard no_grad;
  int64_t total = 0;
  for (auto& [key, grads] : grads_by_device(params, "grad_zero_count"))
    total += backend_of(grads.front()).count_zeros(grads);
  return total;
}

double grad_norm(const std::vector<Tensor>& params) { return std::sqrt(grad_squared_norm(params)); }

void clip_grads_with_norm(const std::vector<Tensor>& params, double max_norm, double total_norm) {
  check(std::isfinite(max_norm) && max_norm > 0, "clip_grad_norm: max_norm must be finite and > 0, got ",
        max_norm);
  if (!std::isfinite(total_norm)) return;  // leave the gradients for the caller to inspect (see clip.h)
  const double clip_coef = max_norm / (total_norm + 1e-6);
  if (!(clip_coef < 1)) return;
  NoGradGuard no_grad;
  for (const Tensor& param : params) {
    const Tensor grad = param.grad();
    if (!grad.defined()) continue;
    if (grad.is_contiguous()) {
      Tensor(grad).mul_(clip_coef);  // in place, as PyTorch: whoever holds the gradient sees it scaled
    } else {
      // A set_grad() view may alias itself (a broadcast has stride 0): scaling it in place would scale the
      // shared elements once per alias, so it is replaced by a scaled copy.
      Tensor(param).set_grad(mul(grad, clip_coef));
    }
  }
}

double clip_grad_norm(const std::vector<Tensor>& params, double max_norm, bool error_if_nonfinite) {
  check(std::isfinite(max_norm) && max_norm > 0, "clip_grad_norm: max_norm must be finite and > 0, got ",
        max_norm);
  const double total_norm = grad_norm(params);
  if (error_if_nonfinite && !std::isfinite(total_norm))
    fail("clip_grad_norm: the total norm of the gradients is ", total_norm,
         " (a gradient holds inf or NaN); the gradients were not scaled");
  clip_grads_with_norm(params, max_norm, total_norm);
  return total_norm;
}

}  // namespace mixtape
