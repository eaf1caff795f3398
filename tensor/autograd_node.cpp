#include "tensor/autograd_node.h"

namespace mixtape {

namespace {
thread_local bool grad_mode = true;
}

bool grad_enabled() { return grad_mode; }
NoGradGuard::NoGradGuard() : previous_(grad_mode) { grad_mode = false; }
NoGradGuard::~NoGradGuard() { grad_mode = previous_; }

bool any_requires_grad(const std::vector<Tensor>& inputs) {
  if (!grad_mode) return false;
  for (const Tensor& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

void record_backward(const char* op, const std::vector<Tensor>& inputs, Tensor& out, BackwardFn backward,
                     const std::vector<Tensor>& saved) {
  if (!any_requires_grad(inputs)) return;
  auto node = std::make_shared<Node>();
  node->op = op;
  node->inputs.reserve(inputs.size());
  for (const Tensor& t : inputs) {
    Edge edge;
    if (t.defined() && t.requires_grad()) {
      if (t.is_leaf()) edge.leaf = t.impl_ptr();
      else edge.node = t.grad_fn();
    }
    node->inputs.push_back(std::move(edge));
  }
  for (const Tensor& t : saved)
    if (t.defined()) node->saved.push_back({t.storage(), t.version(), t.shape(), t.dtype()});
  node->backward = std::move(backward);
  node->output_shape = out.shape();
  node->output_dtype = out.dtype();
  node->output_device = out.device();
  out.impl().requires_grad = true;
  out.impl().grad_fn = std::move(node);
}

}  // namespace mixtape
