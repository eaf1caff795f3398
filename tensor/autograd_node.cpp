#include "tensor/autograd_node.h"

#include "tensor/error.h"

namespace mixtape {

namespace {
thread_local bool grad_mode = true;
thread_local ForwardProfiler* forward_profiler = nullptr;
}

bool grad_enabled() { return grad_mode; }

Node::~Node() {
  std::vector<std::shared_ptr<Node>> pending;
  for (Edge& edge : inputs)
    if (edge.node) pending.push_back(std::move(edge.node));
  while (!pending.empty()) {
    std::shared_ptr<Node> node = std::move(pending.back());
    pending.pop_back();
    if (node.use_count() != 1) continue;  // someone else keeps it alive
    // This is the last reference: take its inputs (and drop its closure, whose captured tensors may own
    // further nodes) before it dies, so its own destructor has nothing left to recurse into.
    for (Edge& edge : node->inputs)
      if (edge.node) pending.push_back(std::move(edge.node));
    node->backward = nullptr;
  }
}
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
  if (forward_profiler) forward_profiler->recorded(op);
}

ForwardProfiler::ForwardProfiler() : last_(std::chrono::steady_clock::now()) {
  check(forward_profiler == nullptr,
        "ForwardProfiler: this thread already has one; profilers do not nest (use the live one, or clear() it)");
  forward_profiler = this;
}

ForwardProfiler::~ForwardProfiler() { forward_profiler = nullptr; }

ForwardProfiler* ForwardProfiler::active() { return forward_profiler; }

void ForwardProfiler::mark() {
  last_ = std::chrono::steady_clock::now();
  paused_ = false;
}

void ForwardProfiler::recorded(const char* op) {
  if (paused_) return;
  const auto now = std::chrono::steady_clock::now();
  ProfileEntry& entry = entries_[op];
  entry.seconds += std::chrono::duration<double>(now - last_).count();
  ++entry.calls;
  last_ = now;
}

double ForwardProfiler::total_seconds() const {
  double total = 0;
  for (const auto& [op, entry] : entries_) total += entry.seconds;
  return total;
}

void ForwardProfiler::clear() {
  entries_.clear();
  mark();
}

}  // namespace mixtape
