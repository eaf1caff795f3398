#pragma once
// Module: a node in a tree of named parameters, buffers, random streams and child modules, with
// train/eval mode, dtype/device conversion and state_dict()/load_state_dict() under nanoGPT's dotted names
// ("transformer.h.0.attn.c_attn.weight").
//
// Ownership: a module keeps its parameters and buffers as Tensor members and registers their addresses, so
// to(dtype) can replace a handle in place and the member sees it. Children are held as std::shared_ptr by the
// parent (the parent usually also keeps a typed copy of the pointer). Modules are neither copyable nor movable:
// the registered addresses point into the object itself.
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "io/state_dict.h"
#include "tensor/random.h"
#include "tensor/tensor.h"

namespace mixtape {

class Module {
 public:
  Module() = default;
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // ---- the tree (names must be unique within one module; registration order is the listing order) ----
  // `tensor` must be a member of this module; it is marked requires_grad.
  void register_parameter(const std::string& name, Tensor& tensor);
  // A non-trainable tensor that is saved in the state dict (e.g. a running statistic).
  void register_buffer(const std::string& name, Tensor& tensor);
  // A random stream whose (seed, offset) a training checkpoint saves to resume bit-exactly.
  void register_generator(const std::string& name, Generator& generator);
  // Adds `child` under `name` and returns it, typed, for the caller's member.
  template <class M> std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> child) {
    add_child(name, child);
    return child;
  }

  // Own entries first, then each child's (recursively), like PyTorch's named_parameters().
  std::vector<std::pair<std::string, Tensor>> named_parameters() const;
  std::vector<Tensor> parameters() const;
  std::vector<std::pair<std::string, Tensor>> named_buffers() const;
  std::vector<std::pair<std::string, Generator*>> named_generators();
  std::vector<std::pair<std::string, Module*>> named_children() const;
  // The dotted name of `submodule` below this module ("h.0.ln_1"; "" for this module itself), or nullopt when
  // it is not in this module's tree.
  std::optional<std::string> path_of(const Module& submodule) const;
  int64_t num_parameters() const;  // total element count of all parameters

  // ---- mode ----
  void train(bool training = true);  // recursive
  void eval() { train(false); }
  bool is_training() const { return training_; }

  // ---- conversion ----
  // Converts floating parameters and buffers in place: each becomes a new leaf of `dtype` (requires_grad kept,
  // gradient dropped). Integer buffers are left alone.
  void to(DType dtype);
  void to(Device device);  // moves every parameter and buffer (gradients dropped)
  // Clears every parameter's gradient (set_to_none) or zeroes it in place.
  void zero_grad(bool set_to_none = true);

  // ---- checkpoints ----
  // Parameters and buffers by dotted name, detached (sharing storage with the module).
  StateDict state_dict() const;
  // Copies values into the existing tensors (under NoGradGuard, so the parameters stay leaves). Every entry is
  // checked before anything is copied: an entry that is missing or unexpected (when strict), or of another shape
  // or dtype (always) is an Error naming the entry, the expected and the found shape/dtype. With strict = false,
  // missing entries keep their current values and unexpected ones are ignored, as in PyTorch.
  void load_state_dict(const StateDict& state, bool strict = true);

 private:
  void add_child(const std::string& name, std::shared_ptr<Module> child);
  void check_new_name(const std::string& name) const;
  // Every registered tensor slot (parameters or buffers) with its dotted name, recursively.
  void collect(const std::string& prefix, bool parameters, std::vector<std::pair<std::string, Tensor*>>& out) const;
  void collect_generators(const std::string& prefix, std::vector<std::pair<std::string, Generator*>>& out);

  bool training_ = true;
  std::vector<std::pair<std::string, Tensor*>> parameters_;
  std::vector<std::pair<std::string, Tensor*>> buffers_;
  std::vector<std::pair<std::string, Generator*>> generators_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
};

// A module with one tensor in and one out (layers that can be swapped behind one pointer, e.g. the norm).
//
// Call it as module(x), not module.forward(x): operator() runs the forward hooks, if set, around the virtual
// forward — pre(x) replaces the input, post(y) replaces the output — like PyTorch's forward pre-hooks and
// forward hooks. Parents call their children through operator() so a hook set on any child fires (amp/'s
// NaiveAMPModel casts an fp32 island's input and output this way; nn/ itself knows nothing of dtypes).
// Hooks are plain functions of a tensor: whatever they do (a Tensor::to) is recorded on the tape as usual.
class UnaryModule : public Module {
 public:
  using ForwardHook = std::function<Tensor(const Tensor&)>;

  virtual Tensor forward(const Tensor& x) = 0;
  Tensor operator()(const Tensor& x) {
    if (!pre_hook_ && !post_hook_) [[likely]] return forward(x);
    Tensor y = forward(pre_hook_ ? pre_hook_(x) : x);
    return post_hook_ ? post_hook_(y) : y;
  }

  // Replaces both hooks (an empty function is no hook); clear_forward_hooks() removes them.
  void set_forward_hooks(ForwardHook pre, ForwardHook post) {
    pre_hook_ = std::move(pre);
    post_hook_ = std::move(post);
  }
  void clear_forward_hooks() { set_forward_hooks(nullptr, nullptr); }
  bool has_forward_hooks() const { return pre_hook_ || post_hook_; }

 private:
  ForwardHook pre_hook_;
  ForwardHook post_hook_;
};

// Children named "0", "1", ... (nanoGPT's transformer.h).
template <class M>
class ModuleList : public Module {
 public:
  void push_back(std::shared_ptr<M> module) {
    register_module(std::to_string(items_.size()), module);
    items_.push_back(std::move(module));
  }
  size_t size() const { return items_.size(); }
  M& operator[](size_t i) const { return *items_.at(i); }
  auto begin() const { return items_.begin(); }
  auto end() const { return items_.end(); }

 private:
  std::vector<std::shared_ptr<M>> items_;
};

}  // namespace mixtape
