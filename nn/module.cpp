#include "nn/module.h"

#include <map>
#include <set>

#include "tensor/autograd_node.h"
#include "tensor/error.h"

namespace mixtape {

void Module::check_new_name(const std::string& name) const {
  check(!name.empty() && name.find('.') == std::string::npos, "Module: invalid name '", name,
        "' (must be non-empty and contain no '.')");
  auto taken = [&name](const auto& entries) {
    for (const auto& entry : entries)
      if (entry.first == name) return true;
    return false;
  };
  check(!taken(parameters_) && !taken(buffers_) && !taken(children_) && !taken(generators_),
        "Module: name '", name, "' is already registered");
}

void Module::register_parameter(const std::string& name, Tensor& tensor) {
  check_new_name(name);
  check(tensor.defined(), "register_parameter: '", name, "' is undefined");
  check(is_floating(tensor.dtype()), "register_parameter: '", name, "' must be floating, got ",
        tensor.described());
  check(tensor.is_leaf(), "register_parameter: '", name, "' must be a leaf tensor (detach it first)");
  tensor.requires_grad_(true);
  parameters_.emplace_back(name, &tensor);
}

void Module::register_buffer(const std::string& name, Tensor& tensor) {
  check_new_name(name);
  check(tensor.defined(), "register_buffer: '", name, "' is undefined");
  buffers_.emplace_back(name, &tensor);
}

void Module::register_generator(const std::string& name, Generator& generator) {
  check_new_name(name);
  generators_.emplace_back(name, &generator);
}

void Module::add_child(const std::string& name, std::shared_ptr<Module> child) {
  check_new_name(name);
  check(child != nullptr, "register_module: '", name, "' is null");
  check(child.get() != this, "register_module: '", name, "' is the module itself");
  children_.emplace_back(name, std::move(child));
}

void Module::collect(const std::string& prefix, bool parameters,
                     std::vector<std::pair<std::string, Tensor*>>& out) const {
  for (const auto& [name, tensor] : parameters ? parameters_ : buffers_) out.emplace_back(prefix + name, tensor);
  for (const auto& [name, child] : children_) child->collect(prefix + name + ".", parameters, out);
}

void Module::collect_generators(const std::string& prefix, std::vector<std::pair<std::string, Generator*>>& out) {
  for (const auto& [name, generator] : generators_) out.emplace_back(prefix + name, generator);
  for (const auto& [name, child] : children_) child->collect_generators(prefix + name + ".", out);
}

std::vector<std::pair<std::string, Tensor>> Module::named_parameters() const {
  std::vector<std::pair<std::string, Tensor*>> slots;
  collect("", true, slots);
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& [name, tensor] : slots) out.emplace_back(name, *tensor);
  return out;
}

std::vector<Tensor> Module::parameters() const {
  std::vector<Tensor> out;
  for (const auto& [name, tensor] : named_parameters()) out.push_back(tensor);
  return out;
}

std::vector<std::pair<std::string, Tensor>> Module::named_buffers() const {
  std::vector<std::pair<std::string, Tensor*>> slots;
  collect("", false, slots);
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& [name, tensor] : slots) out.emplace_back(name, *tensor);
  return out;
}

std::vector<std::pair<std::string, Generator*>> Module::named_generators() {
  std::vector<std::pair<std::string, Generator*>> out;
  collect_generators("", out);
  return out;
}

std::vector<std::pair<std::string, Module*>> Module::named_children() const {
  std::vector<std::pair<std::string, Module*>> out;
  for (const auto& [name, child] : children_) out.emplace_back(name, child.get());
  return out;
}

std::optional<std::string> Module::path_of(const Module& submodule) const {
  if (this == &submodule) return "";
  for (const auto& [name, child] : children_)
    if (const auto below = child->path_of(submodule)) return below->empty() ? name : name + "." + *below;
  return std::nullopt;
}

int64_t Module::num_parameters() const {
  int64_t total = 0;
  for (const auto& [name, tensor] : named_parameters()) total += tensor.numel();
  return total;
}

void Module::train(bool training) {
  training_ = training;
  for (const auto& [name, child] : children_) child->train(training);
}

namespace {

// Replaces every distinct tensor once, so two slots holding the same handle (a shared weight) still share
// the converted one.
template <class Convert>
void convert_slots(const std::vector<std::pair<std::string, Tensor*>>& slots, Convert convert) {
  std::map<const TensorImpl*, Tensor> done;
  for (const auto& [name, slot] : slots) {
    const TensorImpl* key = slot->impl_ptr().get();
    auto it = done.find(key);
    if (it == done.end()) it = done.emplace(key, convert(*slot)).first;
    *slot = it->second;
  }
}

}  // namespace

void Module::to(DType dtype) {
  NoGradGuard no_grad;
  auto convert = [dtype](const Tensor& t) {
    if (!is_floating(t.dtype()) || t.dtype() == dtype) return t;
    Tensor converted = t.detach().to(dtype);
    if (t.requires_grad()) converted.requires_grad_(true);
    if (t.impl().grad_dtype) converted.set_grad_dtype(*t.impl().grad_dtype);  // the new leaf keeps it
    return converted;
  };
  std::vector<std::pair<std::string, Tensor*>> slots;
  collect("", true, slots);
  collect("", false, slots);
  convert_slots(slots, convert);
}

void Module::to(Device device) {
  NoGradGuard no_grad;
  auto convert = [device](const Tensor& t) {
    if (t.device() == device) return t;
    Tensor moved = t.detach().to(device);
    if (t.requires_grad()) moved.requires_grad_(true);
    if (t.impl().grad_dtype) moved.set_grad_dtype(*t.impl().grad_dtype);
    return moved;
  };
  std::vector<std::pair<std::string, Tensor*>> slots;
  collect("", true, slots);
  collect("", false, slots);
  convert_slots(slots, convert);
}

void Module::zero_grad(bool set_to_none) {
  std::vector<std::pair<std::string, Tensor*>> slots;
  collect("", true, slots);
  NoGradGuard no_grad;
  for (const auto& [name, slot] : slots) {
    if (set_to_none) {
      slot->set_grad(Tensor());
    } else if (slot->grad().defined()) {
      Tensor grad = slot->grad();
      grad.zero_();
    }
  }
}

StateDict Module::state_dict() const {
  StateDict state;
  for (const auto& [name, tensor] : named_parameters()) state.tensors.emplace(name, tensor.detach());
  for (const auto& [name, tensor] : named_buffers()) state.tensors.emplace(name, tensor.detach());
  return state;
}

void Module::load_state_dict(const StateDict& state, bool strict) {
  std::vector<std::pair<std::string, Tensor*>> slots;
  collect("", true, slots);
  collect("", false, slots);
  // Validate everything first so a bad file never leaves the model half-loaded.
  std::set<std::string> expected;
  for (const auto& [name, slot] : slots) {
    expected.insert(name);
    auto it = state.tensors.find(name);
    if (it == state.tensors.end() && !strict) continue;  // PyTorch's strict=False: keep the current value
    check(it != state.tensors.end(), "load_state_dict: missing entry '", name, "' (expected ",
          slot->described(), ")");
    const Tensor& found = it->second;
    check(found.defined(), "load_state_dict: entry '", name, "' is undefined (expected ", slot->described(), ")");
    check(found.shape() == slot->shape() && found.dtype() == slot->dtype(), "load_state_dict: entry '", name,
          "' has ", found.described(), ", expected ", slot->described());
  }
  if (strict) {
    for (const auto& [name, tensor] : state.tensors)
      check(expected.count(name) == 1, "load_state_dict: unexpected entry '", name, "' (", tensor.described(),
            ") is not a parameter or buffer of this module");
  }
  NoGradGuard no_grad;
  for (const auto& [name, slot] : slots) {
    auto it = state.tensors.find(name);
    if (it != state.tensors.end()) slot->copy_(it->second);
  }
}

}  // namespace mixtape
