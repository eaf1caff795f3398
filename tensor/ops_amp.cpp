// Front ends of the automatic-mixed-precision ops (see tensor/ops.h).
#include <cmath>
#include <vector>

#include "tensor/backend.h"
#include "tensor/ops.h"

namespace mixtape {

bool unscale_and_check_finite(const std::vector<Tensor>& grads, double inv_scale) {
  check(std::isfinite(inv_scale), "unscale_and_check_finite: inv_scale must be finite, got ", inv_scale);
  std::vector<Tensor> defined;
  for (size_t i = 0; i < grads.size(); ++i) {
    const Tensor& g = grads[i];
    if (!g.defined()) continue;
    check(is_floating(g.dtype()), "unscale_and_check_finite: tensor ", i, " is ", g.described(),
          ", expected a floating dtype (f32, f16, bf16 or f64)");
    check(g.is_contiguous(), "unscale_and_check_finite: tensor ", i, " is ", g.described(),
          " and not contiguous; expected contiguous gradients (a strided view may alias itself)");
    if (!defined.empty())
      check(g.device() == defined.front().device(), "unscale_and_check_finite: tensor ", i, " is ",
            g.described(), " but the first is ", defined.front().described(),
            "; expected one device");
    defined.push_back(g);
  }
  if (defined.empty()) return false;
  const bool found_inf = backend_of(defined.front()).unscale_and_check_finite(defined, inv_scale);
  for (const Tensor& g : defined) g.bump_version();  // changed in place: a graph that saved it must notice
  return found_inf;
}

}  // namespace mixtape
