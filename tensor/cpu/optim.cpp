// Fused optimizer kernels: one pass per parameter for Adam/AdamW and SGD, and the reductions behind the
// global gradient norm and AMP's zero count.
#include <algorithm>
#include <cmath>
#include <vector>

#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/strided.h"  // kParallelGrain

namespace mixtape::cpu {

namespace {

// The per-step scalars of one parameter's Adam update, rounded once from double to A.
template <class A>
struct AdamScalars {
  A beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias_correction2_sqrt, weight_decay,
      decay_factor;
};

// One Adam/AdamW update of n contiguous elements (llm.c's adamw_update, with Adam's L2 variant). T is the
// parameter's type, A (= acc_t<T>) the type the update computes in and the moments are kept in; the
// parameter is rounded to T once, on store. The weight-decay form is a template argument so the loop has
// no branches and vectorises (omp simd: v >= 0, so sqrt never takes its errno path). Each element's result
// depends only on that element, so any thread count and vector width give the same bits.
template <class T, WeightDecayMode kDecay>
void adam_update(T* param, const T* grad, acc_t<T>* exp_avg, acc_t<T>* exp_avg_sq, int64_t n,
                 const AdamScalars<acc_t<T>>& s) {
  using A = acc_t<T>;
#pragma omp parallel for simd schedule(static) if (parallel : n >= 2 * kParallelGrain)
  for (int64_t i = 0; i < n; ++i) {
    A p = convert<A>(param[i]);
    A g = convert<A>(grad[i]);
    if constexpr (kDecay == WeightDecayMode::Decoupled) p = p * s.decay_factor;  // AdamW, before the step
    if constexpr (kDecay == WeightDecayMode::L2) g = g + s.weight_decay * p;     // Adam: L2 in the gradient
    const A m = s.beta1 * exp_avg[i] + s.one_minus_beta1 * g;
    const A v = s.beta2 * exp_avg_sq[i] + s.one_minus_beta2 * (g * g);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    const A denom = std::sqrt(v) / s.bias_correction2_sqrt + s.eps;
    param[i] = convert<T>(p - (s.step_size * m) / denom);  // PyTorch's addcdiv order: (value * m) / denom
  }
}

// One SGD update of n contiguous elements, computed in A = acc_t<T> with the momentum buffer kept in A.
template <class T>
void sgd_update(T* param, const T* grad, acc_t<T>* momentum_buffer, int64_t n, double lr_, double weight_decay_,
                double momentum_, double dampening_, bool nesterov, bool first_step) {
  using A = acc_t<T>;
  const A lr = static_cast<A>(lr_), weight_decay = static_cast<A>(weight_decay_);
  const A momentum = static_cast<A>(momentum_), one_minus_dampening = static_cast<A>(1 - dampening_);
#pragma omp parallel for schedule(static) if (parallel : n >= 2 * kParallelGrain)
  for (int64_t i = 0; i < n; ++i) {
    const A p = convert<A>(param[i]);
    A g = convert<A>(grad[i]);
    if (weight_decay != 0) g += weight_decay * p;  // L2 penalty folded into the gradient
    if (momentum != 0) {
      const A buf = first_step ? g : momentum * momentum_buffer[i] + one_minus_dampening * g;
      momentum_buffer[i] = buf;
      g = nesterov ? g + momentum * buf : buf;
    }
    param[i] = convert<T>(p - lr * g);
  }
}

// Elements per partial sum. Fixed (not per thread) so the additions happen in the same order on any number
// of threads: the norm is reproducible bit for bit, as a resumed run needs.
constexpr int64_t kChunk = 4096;
// Independent running sums inside a chunk (element i goes to lane i % kLanes): a fixed order the compiler
// can still vectorise, where one running sum would be a serial chain of dependent adds.
constexpr int kLanes = 8;

template <class T>
double squared_norm(const T* g, int64_t n) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  // A tensor below the threading grain (run a tensor per thread by for_each_tensor) keeps its sums on the
  // stack.
  constexpr int64_t kFewChunks = 2 * kParallelGrain / kChunk;
  double few[kFewChunks];
  std::vector<double> many;
  if (chunks > kFewChunks) many.resize(static_cast<size_t>(chunks));
  double* const partial = chunks > kFewChunks ? many.data() : few;
#pragma omp parallel for schedule(static) if (parallel : n >= 2 * kParallelGrain)
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
  for (int64_t c = 0; c < chunks; ++c) total += partial[c];
  return total;
}

}  // namespace

void CpuBackend::adam_step(const std::vector<AdamUpdate>& updates, double beta1, double beta2, double eps) {
  for (const AdamUpdate& u : updates)  // dtypes first: the updates below may run inside an OpenMP region
    if (!is_floating(u.param.dtype())) dispatch_float(u.param.dtype(), "adam_step", []<typename T>() {});
  const auto size = [&](int64_t i) { return updates[static_cast<size_t>(i)].param.numel(); };
  for_each_tensor(static_cast<int64_t>(updates.size()), size, [&](int64_t i) {
    const AdamUpdate& u = updates[static_cast<size_t>(i)];
    dispatch_float(u.param.dtype(), "adam_step", [&]<typename T>() {
      using A = acc_t<T>;
      const AdamScalars<A> s{static_cast<A>(beta1),
                             static_cast<A>(1 - beta1),
                             static_cast<A>(beta2),
                             static_cast<A>(1 - beta2),
                             static_cast<A>(eps),
                             static_cast<A>(u.step_size),
                             static_cast<A>(u.bias_correction2_sqrt),
                             static_cast<A>(u.weight_decay),
                             static_cast<A>(u.decay_factor)};
      T* p = u.param.data<T>();
      const T* g = u.grad.data<T>();
      A* m = u.exp_avg.data<A>();
      A* v = u.exp_avg_sq.data<A>();
      const int64_t n = u.param.numel();
      switch (u.mode) {
        case WeightDecayMode::None: return adam_update<T, WeightDecayMode::None>(p, g, m, v, n, s);
        case WeightDecayMode::L2: return adam_update<T, WeightDecayMode::L2>(p, g, m, v, n, s);
        case WeightDecayMode::Decoupled: return adam_update<T, WeightDecayMode::Decoupled>(p, g, m, v, n, s);
      }
    });
  });
}

void CpuBackend::sgd_step(const std::vector<SgdUpdate>& updates, double momentum, double dampening, bool nesterov) {
  for (const SgdUpdate& u : updates)
    dispatch_float(u.param.dtype(), "sgd_step", [&]<typename T>() {
      acc_t<T>* buffer = momentum != 0 ? u.momentum_buffer.data<acc_t<T>>() : nullptr;
      sgd_update<T>(u.param.data<T>(), u.grad.data<T>(), buffer, u.param.numel(), u.lr, u.weight_decay, momentum,
                    dampening, nesterov, u.first_step);
    });
}

double CpuBackend::sum_of_squares(const std::vector<Tensor>& tensors) {
  // Copies (of non-contiguous tensors) and dtype checks first: the sums may run inside an OpenMP region.
  std::vector<Tensor> flat;
  for (const Tensor& t : tensors) {
    if (!is_floating(t.dtype())) dispatch_float(t.dtype(), "sum_of_squares", []<typename T>() {});
    flat.push_back(t.contiguous());
  }
  std::vector<double> sums(flat.size());
  const auto size = [&](int64_t i) { return flat[static_cast<size_t>(i)].numel(); };
  for_each_tensor(static_cast<int64_t>(flat.size()), size, [&](int64_t i) {
    const Tensor& t = flat[static_cast<size_t>(i)];
    sums[static_cast<size_t>(i)] = dispatch_float(
        t.dtype(), "sum_of_squares", [&]<typename T>() { return squared_norm<T>(t.data<T>(), t.numel()); });
  });
  double total = 0;  // in the tensors' order, as before: the same bits on any thread count
  for (double sum : sums) total += sum;
  return total;
}

int64_t CpuBackend::count_zeros(const std::vector<Tensor>& tensors) {
  int64_t zeros = 0;
  for (const Tensor& t : tensors) {
    const Tensor flat = t.contiguous();
    const int64_t n = flat.numel();
    zeros += dispatch_float(flat.dtype(), "count_zeros", [&]<typename T>() {
      const T* p = flat.data<T>();
      int64_t count = 0;
#pragma omp parallel for simd reduction(+ : count) if (parallel : n >= 2 * kParallelGrain)
      for (int64_t i = 0; i < n; ++i) count += convert<acc_t<T>>(p[i]) == 0;
      return count;
    });
  }
  return zeros;
}

}  // namespace mixtape::cpu
