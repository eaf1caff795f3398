#pragma once
// The read side of the tape: backward() runs the recorded nodes in reverse order and accumulates leaf
// gradients. Recording (record_backward) and NoGradGuard live in tensor/autograd_node.h.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "tensor/autograd_node.h"
#include "tensor/tensor.h"

namespace mixtape {

// Backpropagates from a one-element loss (gradient 1).
void backward(const Tensor& loss);
// Backpropagates from several outputs with given output gradients (pipeline stages need this form).
// Leaf gradients accumulate across calls, in each leaf's grad_dtype() (its own dtype unless
// Tensor::set_grad_dtype chose another); the graph's saved tensors are freed afterwards, so running
// backward through the same graph twice is an error.
void backward(const std::vector<Tensor>& outputs, const std::vector<Tensor>& grad_outputs);

// Leaf-gradient hook: while one is installed on this thread, backward() calls it once per leaf that a node of
// the graph feeds, as soon as no node still to run can add to that leaf's gradient (its .grad is final for
// this call; undefined if no gradient reached it). Data parallelism starts a bucket's all-reduce there, while
// backward goes on. Returns the hook installed before; an empty function removes it.
using LeafGradHook = std::function<void(const TensorImpl& leaf)>;
LeafGradHook set_leaf_grad_hook(LeafGradHook hook);

// Where backward() spends its time, per op. While a BackwardProfiler lives on a thread, every backward() run
// on that thread adds each node's wall time to the entry of the op the node was recorded by ("linear",
// "gelu", "layer_norm", "to" for a cast, ...), the time spent summing gradients that meet at a node to
// "(gradient sums)" and accumulating leaf gradients to "(leaf gradients)", and its own wall time to
// total_seconds(). Times are wall clock and include the threads a kernel runs on; what total_seconds() has
// beyond the entries is the engine's own bookkeeping. One profiler per thread at a time: a second one while
// the first lives is an error. bench_train_gpt --phases prints these per precision mode. (The forward's
// counterpart, ForwardProfiler, is in tensor/autograd_node.h beside the recording it hooks.)
class BackwardProfiler {
 public:
  using Entry = ProfileEntry;  // calls: node runs (or sums, or leaf accumulations)
  BackwardProfiler();
  ~BackwardProfiler();
  BackwardProfiler(const BackwardProfiler&) = delete;
  BackwardProfiler& operator=(const BackwardProfiler&) = delete;

  const std::map<std::string, Entry>& entries() const { return entries_; }
  double total_seconds() const { return total_seconds_; }
  int64_t backward_calls() const { return backward_calls_; }
  void clear();

  // For backward(): the profiler of this thread, or null.
  static BackwardProfiler* active();
  void add(const char* what, double seconds);
  void add_backward_call(double seconds);

 private:
  std::map<std::string, Entry> entries_;
  double total_seconds_ = 0;
  int64_t backward_calls_ = 0;
};

}  // namespace mixtape
