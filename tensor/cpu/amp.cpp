// AMP kernels: the fused unscale + non-finite check a loss scaler runs on every gradient each step.
#include <algorithm>
#include <cmath>
#include <vector>

#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/strided.h"  // kParallelGrain

namespace mixtape::cpu {

namespace {

// g[i] = round(g[i] * inv_scale) in acc_t<T> (fp32 for f32/f16/bf16, f64 for f64) — the multiply PyTorch's
// CUDA kernel does with a float inv_scale. Returns whether any input or product is inf/NaN. The check and the
// multiply share the one load, and `||` reduction keeps the loop free of early exits so it vectorises.
template <class T>
bool unscale_one(T* g, int64_t n, double inv_scale) {
  using Acc = acc_t<T>;
  const Acc inv = static_cast<Acc>(inv_scale);
  if (inv == Acc(1)) {
    // A scale of 1 (bf16 autocast's scaler-less step, a static scale of 1) changes no value: the check alone,
    // reading the gradients without writing them back (half the memory traffic of the pass below). x * 0 is
    // +-0 for a finite x and NaN for inf or NaN, so the sum is NaN exactly when some element is not finite.
    Acc probe = 0;
#pragma omp parallel for simd schedule(static) reduction(+ : probe) if (parallel : n >= 2 * kParallelGrain)
    for (int64_t i = 0; i < n; ++i) probe += convert<Acc>(g[i]) * Acc(0);
    return std::isnan(probe);
  }
  // Finite before and after: an x that is finite but whose scaled value overflows the dtype (inv > 1, or the
  // rounding of a 16-bit store) is reported too, as the step would otherwise write inf. The same probe as
  // above: x * 0 + y * 0 is 0 when both are finite and NaN otherwise. (A `found = found || !isfinite(...)`
  // reduction would keep the compiler from vectorising this loop: scalar multiplies and a branch per element;
  // ~1% of an fp16 step on a Zen 5 in perf annotate.)
  Acc probe = 0;
#pragma omp parallel for simd schedule(static) reduction(+ : probe) if (parallel : n >= 2 * kParallelGrain)
  for (int64_t i = 0; i < n; ++i) {
    const Acc x = convert<Acc>(g[i]);
    const T y = convert<T>(x * inv);
    probe += x * Acc(0) + convert<Acc>(y) * Acc(0);
    g[i] = y;
  }
  return std::isnan(probe);
}

}  // namespace

bool CpuBackend::unscale_and_check_finite(const std::vector<Tensor>& grads, double inv_scale) {
  for (const Tensor& g : grads)  // dtypes first: the loop below may run inside an OpenMP region
    if (!is_floating(g.dtype())) dispatch_float(g.dtype(), "unscale_and_check_finite", []<typename T>() {});
  std::vector<char> found(grads.size(), 0);
  const auto size = [&](int64_t i) { return grads[static_cast<size_t>(i)].numel(); };
  for_each_tensor(static_cast<int64_t>(grads.size()), size, [&](int64_t i) {
    const Tensor& g = grads[static_cast<size_t>(i)];
    found[static_cast<size_t>(i)] = dispatch_float(g.dtype(), "unscale_and_check_finite", [&]<typename T>() {
      return unscale_one<T>(g.data<T>(), g.numel(), inv_scale);
    });
  });
  return std::find(found.begin(), found.end(), 1) != found.end();
}

}  // namespace mixtape::cpu
