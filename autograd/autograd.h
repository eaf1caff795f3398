#pragma once
// The read side of the tape: backward() runs the recorded nodes in reverse order and accumulates leaf
// gradients. Recording (record_backward) and NoGradGuard live in tensor/autograd_node.h.
#include <vector>

#include "tensor/autograd_node.h"
#include "tensor/tensor.h"

namespace mixtape {

// Backpropagates from a one-element loss (gradient 1).
void backward(const Tensor& loss);
// Backpropagates from several outputs with given output gradients (pipeline stages need this form).
// Leaf gradients accumulate across calls; the graph's saved tensors are freed afterwards, so running
// backward through the same graph twice is an error.
void backward(const std::vector<Tensor>& outputs, const std::vector<Tensor>& grad_outputs);

}  // namespace mixtape
