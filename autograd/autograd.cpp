#include "autograd/autograd.h"

#include <chrono>
#include <unordered_map>

#include "tensor/autocast_state.h"
#include "tensor/ops.h"

namespace mixtape {

namespace {

thread_local LeafGradHook leaf_grad_hook;
thread_local BackwardProfiler* backward_profiler = nullptr;

using Clock = std::chrono::steady_clock;

// Times a part of backward() into the thread's profiler, if there is one (no clock read otherwise): the entry
// `what`, or with what = nullptr the whole backward() call. Recorded on destruction, so also when it throws.
class ProfiledPart {
 public:
  ProfiledPart(BackwardProfiler* profiler, const char* what)
      : profiler_(profiler), what_(what), start_(profiler ? Clock::now() : Clock::time_point()) {}
  ~ProfiledPart() {
    if (!profiler_) return;
    const double seconds = std::chrono::duration<double>(Clock::now() - start_).count();
    if (what_) profiler_->add(what_, seconds);
    else profiler_->add_backward_call(seconds);
  }
  ProfiledPart(const ProfiledPart&) = delete;
  ProfiledPart& operator=(const ProfiledPart&) = delete;

 private:
  BackwardProfiler* profiler_;
  const char* what_;
  Clock::time_point start_;
};

void check_saved_versions(const Node& node) {
  for (const SavedVersion& saved : node.saved) {
    check(saved.storage->version() == saved.version, "backward: a tensor (", dtype_name(saved.dtype),
          shape_text(saved.shape), ") saved by '", node.op, "' for backward was modified in place afterwards "
          "(version ", saved.version, " when saved, ", saved.storage->version(),
          " now); clone() it before modifying, or modify a copy");
  }
}

// Casts a gradient to the dtype and shape of what it is the gradient of.
Tensor conform(const Tensor& grad, const Shape& shape, DType dtype, const char* op) {
  check(grad.shape() == shape, "backward: '", op, "' produced a gradient ", grad.described(),
        " for a tensor of shape ", shape_text(shape));
  return grad.dtype() == dtype ? grad : grad.to(dtype);
}

void accumulate_leaf(TensorImpl& leaf, const Tensor& grad) {
  Tensor g = conform(grad, leaf.shape, leaf.grad_dtype.value_or(leaf.dtype), "leaf");
  // A gradient installed in another dtype (set_grad) is widened first (to() makes a fresh buffer), so the
  // sum is formed in the grad dtype.
  if (leaf.grad && leaf.grad->dtype != g.dtype()) leaf.grad = Tensor(leaf.grad).to(g.dtype()).impl_ptr();
  if (leaf.grad) {
    Tensor(leaf.grad).add_(g);
  } else if (!g.same(grad)) {
    leaf.grad = g.impl_ptr();  // conform converted it: a fresh contiguous tensor nothing else holds
  } else if (is_private_buffer(g, 2)) {
    // Held by the caller's gradient list and `g` alone: a buffer the backward closure made and handed over
    // (e.g. the f32 gradient an autocast cast's backward widened) becomes the .grad, without a second copy.
    leaf.grad = g.impl_ptr();
  } else {
    // Own a fresh contiguous buffer: g may be a broadcast view or alias another tensor.
    Tensor owned = Tensor::empty(g.shape(), g.dtype(), g.device());
    owned.copy_(g);
    leaf.grad = owned.impl_ptr();
  }
}

}  // namespace

LeafGradHook set_leaf_grad_hook(LeafGradHook hook) {
  std::swap(hook, leaf_grad_hook);
  return hook;
}

void backward(const Tensor& loss) {
  check(loss.defined(), "backward: loss is undefined");
  check(loss.numel() == 1, "backward: loss ", loss.described(),
        " must have exactly one element; pass grad_outputs for other outputs");
  backward({loss}, {Tensor::ones(loss.shape(), loss.dtype(), loss.device())});
}

void backward(const std::vector<Tensor>& outputs, const std::vector<Tensor>& grad_outputs) {
  check(outputs.size() == grad_outputs.size(), "backward: ", outputs.size(), " outputs but ",
        grad_outputs.size(), " grad_outputs");
  BackwardProfiler* const profiler = BackwardProfiler::active();
  const ProfiledPart whole_call(profiler, nullptr);
  NoGradGuard no_grad;  // backward closures build no graph of their own
  AutocastScope no_autocast(std::nullopt);  // closures run in the saved dtypes, not an open scope's
  std::unordered_map<Node*, Tensor> pending;  // gradient summed so far for each node's output
  std::unordered_map<Node*, int> dependents;  // how many not-yet-run nodes feed into each node
  std::unordered_map<TensorImpl*, int> leaf_uses;  // not-yet-run nodes feeding each leaf (with a hook only)
  const LeafGradHook hook = leaf_grad_hook;  // this call's, even if the hook changes it
  const bool hooked = static_cast<bool>(hook);
  std::vector<std::shared_ptr<Node>> roots;

  for (size_t i = 0; i < outputs.size(); ++i) {
    const Tensor& out = outputs[i];
    check(out.defined() && out.requires_grad(), "backward: output ", i,
          " does not require grad (no input of the computation requires grad)");
    const Tensor& g = grad_outputs[i];
    check(g.defined() && g.shape() == out.shape(), "backward: grad_output ", i, " is ", g.described(),
          ", expected the shape of output ", out.described());
    if (out.is_leaf()) {
      accumulate_leaf(out.impl(), g);
      continue;
    }
    Node* node = out.grad_fn().get();
    Tensor& slot = pending[node];
    slot = slot.defined() ? add(slot, g) : g;
    roots.push_back(out.grad_fn());
  }

  // Count, for every reachable node, how many reachable nodes consume its output.
  std::vector<Node*> stack;
  std::unordered_map<Node*, bool> seen;
  for (auto& root : roots)
    if (!seen[root.get()]) {
      seen[root.get()] = true;
      stack.push_back(root.get());
    }
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    check(static_cast<bool>(node->backward), "backward: the graph through '", node->op,
          "' was already used by an earlier backward() and its saved tensors were freed");
    for (const Edge& edge : node->inputs) {
      if (hooked && edge.leaf) ++leaf_uses[edge.leaf.get()];
      if (!edge.node) continue;
      ++dependents[edge.node.get()];
      if (!seen[edge.node.get()]) {
        seen[edge.node.get()] = true;
        stack.push_back(edge.node.get());
      }
    }
  }

  // Run nodes whose consumers have all run (reverse topological order = the tape in reverse). A node that
  // no gradient reached still "runs" as a pass-through, so the nodes below it are released in turn.
  std::vector<std::shared_ptr<Node>> ready;
  for (auto& root : roots)
    if (dependents[root.get()] == 0) {
      ready.push_back(root);
      dependents[root.get()] = -1;  // queued once even if it is several outputs' node
    }
  while (!ready.empty()) {
    std::shared_ptr<Node> node = std::move(ready.back());
    ready.pop_back();
    Grads grads(node->inputs.size());
    if (auto it = pending.find(node.get()); it != pending.end()) {
      check_saved_versions(*node);
      const Tensor grad_output = conform(it->second, node->output_shape, node->output_dtype, node->op);
      pending.erase(it);
      {
        const ProfiledPart part(profiler, node->op);
        grads = node->backward(grad_output);
      }
      check(grads.size() == node->inputs.size(), "backward: '", node->op, "' returned ", grads.size(),
            " gradients for ", node->inputs.size(), " inputs");
      // Blame a misshapen gradient on the op that returned it (the consumer), not on its input.
      for (size_t i = 0; i < grads.size(); ++i) {
        const Edge& edge = node->inputs[i];
        if (!grads[i].defined() || (!edge.node && !edge.leaf)) continue;
        const Shape& expected = edge.node ? edge.node->output_shape : edge.leaf->shape;
        check(grads[i].shape() == expected, "backward: '", node->op, "' returned a gradient ",
              grads[i].described(), " for input ", i, " of shape ", shape_text(expected));
      }
    }
    if (!node->keep_after_backward) {
      node->backward = nullptr;  // frees the saved tensors
      node->saved.clear();
    }
    for (size_t i = 0; i < grads.size(); ++i) {
      const Edge& edge = node->inputs[i];
      if (edge.leaf && grads[i].defined()) {
        const ProfiledPart part(profiler, "(leaf gradients)");
        accumulate_leaf(*edge.leaf, grads[i]);
      }
      if (hooked && edge.leaf && --leaf_uses[edge.leaf.get()] == 0) hook(*edge.leaf);
      if (!edge.node) continue;
      if (grads[i].defined()) {
        Tensor& slot = pending[edge.node.get()];
        if (slot.defined()) {
          const ProfiledPart part(profiler, "(gradient sums)");
          Tensor& g = grads[i];
          // Into a buffer nothing else holds (usually the fresh gradient, still in cache) when the two agree
          // in dtype and shape: the same sum, as addition commutes, without a new buffer and its cold pages.
          const bool alike = g.dtype() == slot.dtype() && g.shape() == slot.shape() && g.device() == slot.device();
          if (alike && is_private_buffer(g, 1)) {
            g.add_(slot);
            slot = g;
          } else if (alike && is_private_buffer(slot, 1)) {
            slot.add_(g);
          } else {
            slot = add(slot, g);
          }
        } else {
          slot = grads[i];
        }
      }
      if (--dependents[edge.node.get()] == 0) ready.push_back(edge.node);
    }
  }
}

BackwardProfiler::BackwardProfiler() {
  check(backward_profiler == nullptr,
        "BackwardProfiler: this thread already has one; profilers do not nest (use the live one, or clear() it)");
  backward_profiler = this;
}

BackwardProfiler::~BackwardProfiler() { backward_profiler = nullptr; }

BackwardProfiler* BackwardProfiler::active() { return backward_profiler; }

void BackwardProfiler::add(const char* what, double seconds) {
  Entry& entry = entries_[what];
  entry.seconds += seconds;
  ++entry.calls;
}

void BackwardProfiler::add_backward_call(double seconds) {
  total_seconds_ += seconds;
  ++backward_calls_;
}

void BackwardProfiler::clear() {
  entries_.clear();
  total_seconds_ = 0;
  backward_calls_ = 0;
}

}  // namespace mixtape
