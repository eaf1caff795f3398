// Front ends of the automatic-mixed-precision ops (see tensor/ops.h).
#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <string_view>
#include <vector>

#include "tensor/backend.h"
#include "tensor/ops.h"

namespace mixtape {

bool unscale_and_check_finite(const std::vector<Tensor>& grads, double inv_scale) {
  check(std::isfinite(inv_scale), "unscale_and_check_finite: inv_scale must be finite, got ", inv_scale);
  // The tensors grouped by device, in order of each device's first tensor: one fused pass per backend.
  std::vector<std::vector<Tensor>> per_device;
  for (size_t i = 0; i < grads.size(); ++i) {
    const Tensor& g = grads[i];
    if (!g.defined()) continue;
    check(is_floating(g.dtype()), "unscale_and_check_finite: tensor ", i, " is ", g.described(),
          ", expected a floating dtype (f32, f16, bf16 or f64)");
    check(g.is_contiguous(), "unscale_and_check_finite: tensor ", i, " is ", g.described(),
          " and not contiguous; expected contiguous gradients (a strided view may alias itself)");
    auto same_device = [&g](const std::vector<Tensor>& group) { return group.front().device() == g.device(); };
    const auto group = std::find_if(per_device.begin(), per_device.end(), same_device);
    if (group == per_device.end()) per_device.push_back({g});
    else group->push_back(g);
  }
  // f32, f16 and bf16 gradients are multiplied in fp32: an inv_scale beyond its range (1 / a scale below
  // 2^-128) would be converted to fp32 undefinedly.
  const bool in_fp32 = std::any_of(per_device.begin(), per_device.end(), [](const std::vector<Tensor>& group) {
    return std::any_of(group.begin(), group.end(), [](const Tensor& g) { return g.dtype() != DType::F64; });
  });
  if (in_fp32 && std::abs(inv_scale) > std::numeric_limits<float>::max()) {
    char text[32];
    const auto written = std::to_chars(text, text + sizeof text, inv_scale);  // exact: not FLT_MAX's 6 digits
    fail("unscale_and_check_finite: inv_scale ", std::string_view(text, written.ptr - text), " is beyond fp32's "
         "range, in which f32, f16 and bf16 gradients are unscaled (the loss scale is 2^-128 or below)");
  }
  // Every device is unscaled, whatever another found (PyTorch's found_inf_per_device, then any of them).
  bool found_inf = false;
  for (const std::vector<Tensor>& group : per_device) {
    if (backend_of(group.front()).unscale_and_check_finite(group, inv_scale)) found_inf = true;
    for (const Tensor& g : group) g.bump_version();  // changed in place: a graph that saved it must notice
  }
  return found_inf;
}

}  // namespace mixtape
