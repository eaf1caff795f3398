#pragma once
// The read side of the tape: backward() runs the recorded nodes in reverse order and accumulates leaf
// gradients. Recording (record_backward) and NoGradGuard live in tensor/autograd_node.h.
#include <functional>
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

}  // namespace mixtape
