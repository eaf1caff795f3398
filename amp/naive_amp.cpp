#include "amp/naive_amp.h"

#include <optional>

#include "amp/autocast.h"
#include "tensor/autograd_node.h"
#include "tensor/error.h"
#include "tensor/ops.h"
#include "tensor/precision.h"

namespace mixtape {

namespace {

DType parse_dtype(const std::string& name) {
  if (name == "fp16" || name == "float16") return DType::F16;
  if (name == "bf16" || name == "bfloat16") return DType::BF16;
  if (name == "tf32") return DType::F32;
  fail("NaiveAMPModel: unknown dtype '", name, "' (expected fp16, bf16 or tf32; or float16, bfloat16)");
}


// The wrapped forward's boundary (InternEvo's _convert_to_fp16 / _convert_to_fp32): only fp32 goes down to
// the low dtype, only fp16/bf16 comes back up to fp32; f64 (a reference computation) is left alone.
Tensor narrow_fp32(const Tensor& t, DType low) {
  return t.defined() && t.dtype() == DType::F32 ? t.to(low) : t;
}
Tensor widen_16bit(const Tensor& t) {
  return t.defined() && is_low_precision(t.dtype()) ? t.to(DType::F32) : t;
}

}  // namespace

Tensor cast_floating(const Tensor& t, DType dtype) {
  if (!t.defined() || !is_floating(t.dtype())) return t;
  return t.to(dtype);
}

NaiveAMPModel::NaiveAMPModel(Module& model, NaiveAMPOptions options)
    : model_(model), options_(std::move(options)), dtype_(parse_dtype(options_.dtype)) {
  // "tf32": parameters stay fp32; the f32 matmuls round their inputs to tf32 (process-wide, as InternEvo sets
  // torch.backends.cuda.matmul.allow_tf32 — it is not restored when the wrapper goes away).
  for (UnaryModule* module : options_.fp32_modules)
    check(module != nullptr && model_.path_of(*module),
          "NaiveAMPModel: options.fp32_modules holds a module that is not a submodule of the wrapped model");
  if (options_.dtype == "tf32") set_allow_tf32(true);
  // The fp32 islands' values before the whole model is rounded to the low dtype (copies: to() replaces the
  // handles, but a copy is what survives whatever the conversion does to shared storage).
  std::vector<StateDict> fp32_values;
  for (UnaryModule* module : options_.fp32_modules) {
    StateDict values;
    for (const auto& [name, tensor] : module->state_dict().tensors) values.tensors.emplace(name, tensor.clone());
    fp32_values.push_back(std::move(values));
  }
  model_.to(dtype_);
  NoGradGuard no_grad;  // the copies below write into leaves
  for (size_t i = 0; i < options_.fp32_modules.size(); ++i) {
    set_fp32(*options_.fp32_modules[i]);
    for (const auto& [name, slot] : options_.fp32_modules[i]->state_dict().tensors) {
      Tensor target = slot;  // shares the module's (new, fp32) storage
      target.copy_(fp32_values[i].tensors.at(name));
    }
  }
}

void NaiveAMPModel::set_fp32(UnaryModule& module) {
  const std::optional<std::string> path = model_.path_of(module);
  check(path.has_value(), "NaiveAMPModel::set_fp32: the module is not a submodule of the wrapped model");
  check(!sealed_, "NaiveAMPModel::set_fp32: module '", path->empty() ? "(the wrapped model)" : *path,
        "': the model's parameters were already handed to an optimizer (Booster.boost), and set_fp32 now "
        "would give the module new fp32 parameters that the optimizer does not hold, silently freezing it; "
        "mark fp32 modules before boost, with BoostOptions::fp32_modules (NaiveAMPOptions::fp32_modules)");
  // Parameters come back from the low dtype: values rounded at construction stay rounded (as in InternEvo;
  // options.fp32_modules avoids that); freshly initialised norms (weight 1, bias 0) are exact either way.
  // Module::to makes new leaves, so the optimizer is built after the set_fp32 calls.
  module.to(DType::F32);
  // The hooks capture the low dtype by value: they outlive neither the module nor depend on this wrapper.
  const DType low = dtype_;
  module.set_forward_hooks([](const Tensor& x) { return cast_floating(x, DType::F32); },
                           [low](const Tensor& y) { return cast_floating(y, low); });
}

void NaiveAMPModel::sync_buffers() {
  // A group of one has nothing to agree on (InternEvo turns sync_buffer off then too).
  if (!options_.sync_buffer || options_.group == nullptr || options_.group->size() <= 1) return;
  NoGradGuard no_grad;
  Autocast no_autocast(std::nullopt);  // the average is computed in the dtypes chosen here
  const double size = options_.group->size();
  for (const auto& [name, buffer] : model_.named_buffers()) {
    if (!is_floating(buffer.dtype())) continue;
    // InternEvo: buffer.div_(world_size), then an all-reduce SUM. 16-bit buffers are averaged in fp32 and
    // rounded once on the way back: the quotients and the partial sums lose nothing to the low dtype.
    const DType work = is_low_precision(buffer.dtype()) ? DType::F32 : buffer.dtype();
    const Tensor mean = div(buffer.to(work), size).contiguous();  // a new tensor: the buffer is not touched
    options_.group->all_reduce_sum(mean);
    Tensor target = buffer;  // shares the module's storage
    target.copy_(mean);
  }
}

std::vector<Tensor> NaiveAMPModel::forward(
    const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& forward,
    const std::vector<Tensor>& inputs) {
  // Training: every forward. Eval: the first forward after a training-mode one (InternEvo's _first_eval_run).
  const bool training = model_.is_training();
  if (training || last_forward_training_) sync_buffers();
  last_forward_training_ = training;
  std::vector<Tensor> cast_inputs;
  cast_inputs.reserve(inputs.size());
  for (const Tensor& input : inputs) cast_inputs.push_back(narrow_fp32(input, dtype_));
  std::vector<Tensor> outputs = forward(cast_inputs);
  if (options_.output_to_fp32)
    for (Tensor& output : outputs) output = widen_16bit(output);
  return outputs;
}

Tensor NaiveAMPModel::operator()(const Tensor& x) {
  auto* unary = dynamic_cast<UnaryModule*>(&model_);
  check(unary != nullptr, "NaiveAMPModel: operator() needs a wrapped UnaryModule; call forward(fn, inputs) instead");
  // Through the module's operator(), so hooks set on the model itself (set_fp32 on the whole model) fire.
  return forward([unary](const std::vector<Tensor>& in) { return std::vector<Tensor>{(*unary)(in[0])}; }, {x})[0];
}

}  // namespace mixtape
