#include "optim/clip.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "tensor/autograd_node.h"
#include "tensor/cpu/strided.h"  // kParallelGrain
#include "tensor/ops.h"

namespace mixtape {

namespace {

// Elements per partial sum. Fixed (not per thread) so the additions happen in the same order on any number
// of threads: the norm is reproducible bit for bit, as a resumed run needs.
constexpr int64_t kChunk = 4096;
// Independent running sums inside a chunk (element i goes to lane i % kLanes): a fixed order the compiler
// can still vectorise, where one running sum would be a serial chain of dependent adds.
constexpr int kLanes = 8;

template <class T>
double squared_norm(const T* g, int64_t n) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> partial(chunks);
#pragma omp parallel for schedule(static) if (n >= 2 * cpu::kParallelGrain)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * kChunk, end = std::min(n, begin + kChunk);
    // Squares of f32/f16/bf16 values are exact in double, and the sums lose far less than a float
    // accumulator would (f32 keeps 24 bits: a million similar squares would lose ~10 of them).
    double lanes[kLanes] = {};
    int64_t i = begin;
    for (; i + kLanes <= end; i += kLanes)
      for (int j = 0; j < kLanes; ++j) {
        const double x = convert<double>(g[i + j]);
        lanes[j] += x * x;
      }
    for (int j = 0; i < end; ++i, ++j) {
      const double x = convert<double>(g[i]);
      lanes[j] += x * x;
    }
    partial[c] =
        ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  }
  double total = 0;
  for (double p : partial) total += p;
  return total;
}

}  // namespace

double grad_squared_norm(const std::vector<Tensor>& params) {
  NoGradGuard no_grad;
  double total = 0;
  for (const Tensor& param : params) {
    check(param.defined(), "grad_norm: a parameter is an undefined tensor");
    const Tensor grad = param.grad();
    if (!grad.defined()) continue;
    if (!grad.device().is_cpu())
      not_supported("grad_norm on ", grad.device(), " gradients (", grad.description(), ")");
    const Tensor flat = grad.contiguous();
    total += dispatch_float(flat.dtype(), "grad_norm",
                            [&]<typename T>() { return squared_norm<T>(flat.data<T>(), flat.numel()); });
  }
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
