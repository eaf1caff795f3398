#include "amp/booster.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>
#include <string>

#include "amp/autocast.h"
#include "nn/layers.h"
#include "tensor/error.h"
#include "tensor/precision.h"

namespace mixtape {

namespace {

// Every LayerNorm / RMSNorm below `module` (keep_norms_fp32). Apex's keep_batchnorm_fp32 keeps BatchNorm
// only, of which mixtape has none: it collects nothing.
void collect_norms(Module& module, std::vector<UnaryModule*>& out) {
  for (const auto& [name, child] : module.named_children()) {
    if (dynamic_cast<LayerNorm*>(child) || dynamic_cast<RMSNorm*>(child))
      out.push_back(static_cast<UnaryModule*>(child));
    collect_norms(*child, out);
  }
}

const char* low_name(DType dtype) { return dtype == DType::BF16 ? "bf16" : "fp16"; }

// Every Linear below `module` with its dotted path.
void collect_linears(Module& module, const std::string& prefix, std::vector<std::pair<std::string, Linear*>>& out) {
  for (const auto& [name, child] : module.named_children()) {
    const std::string path = prefix.empty() ? name : prefix + "." + name;
    if (auto* linear = dynamic_cast<Linear*>(child)) out.push_back({path, linear});
    collect_linears(*child, path, out);
  }
}

// Whether an exclude entry names the module at `path`: the whole path, or its last names ("c_proj" and
// "mlp.c_proj" both match "transformer.h.0.mlp.c_proj").
bool names_module(const std::string& entry, const std::string& path) {
  return path == entry || (path.size() > entry.size() && path.ends_with(entry) &&
                           path[path.size() - entry.size() - 1] == '.');
}

// The fp8 / block-scaled context covering every Linear of `model` that the config does not exclude. An
// exclude entry the user gave that matches no Linear is an Error (a misspelt name would silently quantize the
// layer it meant to keep).
std::shared_ptr<LowPrecisionContext> make_low_precision_context(const AmpConfig& c, Module& model,
                                                                const BoostOptions& options) {
  auto context = std::make_shared<LowPrecisionContext>(c.low_precision_recipe());
  // Every Linear-like layer by its module path and weight: the model's nn::Linear layers and the caller's own.
  std::vector<std::pair<std::string, Tensor>> layers;
  std::vector<std::pair<std::string, Linear*>> linears;
  if (auto* linear = dynamic_cast<Linear*>(&model)) linears.push_back({"", linear});  // a bare Linear
  collect_linears(model, "", linears);
  for (const auto& [path, linear] : linears) layers.push_back({path, linear->weight});
  for (const auto& [name, weight] : options.linear_weights) {
    check(name.ends_with(".weight"), "Booster.boost: BoostOptions::linear_weights entry '", name,
          "' is not a weight's parameter name (<module path>.weight)");
    layers.push_back({name.substr(0, name.size() - 7), weight});
  }
  const std::vector<std::string> exclude = c.excluded_modules();
  std::vector<bool> used(exclude.size(), false);
  std::vector<std::pair<std::string, Tensor>> covered;
  for (const auto& [path, weight] : layers) {
    bool excluded = false;
    for (size_t i = 0; i < exclude.size(); ++i)
      if (names_module(exclude[i], path)) excluded = used[i] = true;
    if (excluded) continue;
    covered.push_back({path.empty() ? "weight" : path + ".weight", weight});
    context->cover(weight, covered.back().first);
  }
  check(!layers.empty(), "Booster.boost: ", c.name(), " quantizes the GEMMs of Linear modules, and the model has "
        "none (its layers would all run in bf16)");
  auto reduction = [](ProcessGroup* group) -> AmaxReduction {
    if (group == nullptr || group->size() == 1) return {};
    return [group](std::span<float> values) {
      std::vector<double> wide(values.begin(), values.end());  // exact both ways
      group->all_reduce_max(wide);
      for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(wide[i]);
    };
  };
  if (options.amax_group != nullptr && options.amax_group->size() > 1)
    context->set_amax_reduction(reduction(options.amax_group), reduction(options.amax_group_in_eval));
  const auto listed = [](const std::vector<std::string>& names, const std::string& name) {
    return std::find(names.begin(), names.end(), name) != names.end();
  };
  // A split named for a layer that is not there (a misspelt name) would leave its rows unreduced silently.
  for (const std::vector<std::string>* names : {&options.row_parallel_weights, &options.column_parallel_weights})
    for (const std::string& name : *names)
      check(std::any_of(layers.begin(), layers.end(),
                        [&](const auto& layer) { return (layer.first.empty() ? "weight" : layer.first + ".weight") == name; }),
            "Booster.boost: BoostOptions ", names == &options.row_parallel_weights ? "row" : "column",
            "_parallel_weights entry '", name, "' names no Linear weight of the model");
  // fp8_rowwise across processes needs to know which of them split each GEMM's K (see BoostOptions).
  if (c.row().gemm_scaling == ScalingRecipe::Rowwise && options.amax_group != nullptr && options.amax_group->size() > 1)
    check(options.tensor_parallel_group != nullptr || options.data_parallel_group != nullptr, "Booster.boost: ",
          c.name(), " over the ", options.amax_group->name(), " needs BoostOptions::tensor_parallel_group or "
          "data_parallel_group: its row scales are reduced over the processes that split a row");
  for (const auto& [name, weight] : covered) {
    if (listed(options.row_parallel_weights, name))
      context->set_k_split(weight, Gemm::Forward, reduction(options.tensor_parallel_group));
    if (listed(options.column_parallel_weights, name))
      context->set_k_split(weight, Gemm::Dgrad, reduction(options.tensor_parallel_group));
    context->set_k_split(weight, Gemm::Wgrad, reduction(options.data_parallel_group));
  }
  if (c.low_precision.exclude)
    for (size_t i = 0; i < exclude.size(); ++i)
      check(used[i], "Booster.boost: ", c.name(), " exclude entry \"", exclude[i],
            "\" names no Linear module of the model");
  return context;
}

// The scaler when it is a DynamicLossScaler, else null.
const DynamicLossScaler* dynamic_scaler(const LossScaler* scaler) {
  return dynamic_cast<const DynamicLossScaler*>(scaler);
}

}  // namespace

Booster::Booster(AmpConfig config) : config_(std::move(config)) { config_.validate(); }

std::unique_ptr<MixedPrecisionOptimizer> Booster::boost(Module& model, std::unique_ptr<Optimizer> optimizer,
                                                        BoostOptions options) {
  BoostedParts parts = boost_parts(model, std::move(optimizer), options);
  return std::make_unique<MixedPrecisionOptimizer>(std::move(parts.optimizer), std::move(parts.scalers),
                                                   std::move(parts.options));
}

namespace {

// Everything boost() refuses, checked before the model changes, so a failed boost() leaves the model and the
// booster as they were and a corrected call can follow.
void check_boost_arguments(const AmpConfig& c, Module& model, const Optimizer& optimizer,
                           const BoostOptions& options) {
  for (UnaryModule* module : options.fp32_modules)
    check(module != nullptr && model.path_of(*module), "Booster.boost: BoostOptions::fp32_modules holds a "
          "module that is not a submodule of the model");
  check(std::isfinite(options.clip_grad) && options.clip_grad >= 0,
        "Booster.boost: BoostOptions::clip_grad must be finite and >= 0 (0 = off), got ", options.clip_grad);
  // The optimizer's state (momenta, step counts) belongs to the parameters it was computed for; the wrapper
  // moves the parameters to fp32 masters, so the state would be left behind on tensors no longer trained.
  for (const Tensor& param : optimizer.params())
    check(optimizer.state(param) == nullptr, "Booster.boost: the ", optimizer.name(),
          " already has state for parameter ", param.described(),
          "; expected an optimizer that has not taken a step (boost the model before training it)");
  // fp32 gradients are set on leaves without a gradient: a 16-bit parameter (which conversion keeps as it
  // is) must not have one yet; an fp32 one becomes a new 16-bit leaf or stays fp32.
  const std::vector<std::pair<std::string, Tensor>> params = model.named_parameters();
  if (c.fp32_grads())
    for (const auto& [name, param] : params)
      check(!is_low_precision(param.dtype()) || !param.grad().defined(), "Booster.boost: parameter ", name,
            " ", param.described(), " already has a gradient; ", c.name(),
            " gives the 16-bit parameters fp32 gradients, which needs none yet (boost the model before ",
            "training it, or zero_grad first)");
  // The optimizer must train this model: a tensor it holds that is not one of the model's parameters would
  // stay behind when conversion replaces them (the model would not train at all with an optimizer built on
  // another model's parameters), and in the other modes it would be trained without the mode's casts.
  std::set<const void*> model_params;
  for (const auto& [name, param] : params) model_params.insert(param.impl_ptr().get());
  const std::vector<ParamGroup>& groups = optimizer.param_groups();
  for (size_t g = 0; g < groups.size(); ++g)
    for (size_t i = 0; i < groups[g].params.size(); ++i)
      check(model_params.count(groups[g].params[i].impl_ptr().get()) != 0, "Booster.boost: the ",
            optimizer.name(), "'s parameter ", i, " of group ", g, " (", groups[g].params[i].described(),
            ") is not a parameter of the model; expected an optimizer built on the model's parameters ",
            "(model.parameters() or a subset)");
}

// Conversion made new leaves: the optimizer's parameters that it replaced are swapped for them, matched by
// identity (`before` and `after` are the model's parameters in the same order).
void swap_converted_parameters(const std::vector<std::pair<std::string, Tensor>>& before,
                               const std::vector<std::pair<std::string, Tensor>>& after, Optimizer& optimizer) {
  check(after.size() == before.size(), "Booster.boost: the model's parameter list changed during conversion");
  std::map<const void*, Tensor> replacement;
  for (size_t i = 0; i < before.size(); ++i) replacement[before[i].second.impl_ptr().get()] = after[i].second;
  for (ParamGroup& group : optimizer.param_groups())
    for (Tensor& param : group.params) {
      const auto found = replacement.find(param.impl_ptr().get());
      if (found != replacement.end()) param = found->second;
    }
}

// The mode's loss scalers: one per loss (Apex's num_losses), one otherwise.
std::vector<std::unique_ptr<LossScaler>> make_scalers(const AmpConfig& c) {
  std::vector<std::unique_ptr<LossScaler>> scalers;
  switch (c.row().scaler) {
    case ScalerKind::Static:
      scalers.push_back(std::make_unique<StaticLossScaler>(1.0));
      break;
    case ScalerKind::GradScaler:
      if (c.grad_scaler.enabled) scalers.push_back(std::make_unique<GradScaler>(c.grad_scaler));
      else scalers.push_back(std::make_unique<StaticLossScaler>(1.0));
      break;
    case ScalerKind::Apex:
      for (int64_t i = 0; i < c.apex.num_losses; ++i) {
        if (c.apex.loss_scale) {
          scalers.push_back(std::make_unique<StaticLossScaler>(*c.apex.loss_scale));
        } else {
          scalers.push_back(std::make_unique<DynamicLossScaler>(c.apex.dynamic_scaler()));
        }
      }
      break;
    case ScalerKind::Hysteresis:
      switch (c.naive.loss_scaler) {
        case NaiveLossScaler::Dynamic:
          scalers.push_back(std::make_unique<DynamicLossScaler>(c.naive.scaler));
          break;
        case NaiveLossScaler::None:  // bf16_naive as Colossal-AI's bf16 mixin and Megatron-LM run it
          scalers.push_back(std::make_unique<StaticLossScaler>(1.0));
          break;
      }
      break;
  }
  return scalers;
}

// The mixed-precision step's options: the master weights, clipping, and the naive modes' zero count.
MixedPrecisionOptions step_options(const AmpConfig& c, const BoostOptions& options) {
  MixedPrecisionOptions mp;
  mp.group = options.model_parallel_group;
  mp.clip_grad = options.clip_grad;
  switch (c.row().master_weights) {
    case MasterWeights::Fp32:
      mp.master_weights = true;
      break;
    case MasterWeights::ByOptLevel:  // Apex O3 steps its fp16 parameters themselves
      mp.master_weights = c.apex.master_weights;
      break;
  }
  if (c.is_naive()) {
    if (c.naive.clip_grad > 0) mp.clip_grad = c.naive.clip_grad;
    mp.log_num_zeros_in_grad = c.naive.log_num_zeros_in_grad;
  }
  return mp;
}

}  // namespace

BoostedParts Booster::boost_parts(Module& model, std::unique_ptr<Optimizer> optimizer, BoostOptions options) {
  check(model_ == nullptr, "Booster.boost: this booster already boosted a model (one model per booster)");
  check(optimizer != nullptr, "Booster.boost: the optimizer is null");
  check_boost_arguments(config_, model, *optimizer, options);
  print_verbose_ = options.print_verbose;
  // Built first: its checks (exclude names, layouts) refuse before anything changes.
  std::shared_ptr<LowPrecisionContext> low_precision;
  if (config_.quantizes_gemms()) low_precision = make_low_precision_context(config_, model, options);
  const std::vector<std::pair<std::string, Tensor>> before = model.named_parameters();
  convert_model(model, options);
  model_ = &model;
  const std::vector<std::pair<std::string, Tensor>> after = model.named_parameters();
  swap_converted_parameters(before, after, *optimizer);
  // From here the optimizer holds the parameters: a later set_fp32 would make leaves it does not hold.
  if (naive_) naive_->seal();
  low_precision_ = std::move(low_precision);
  if (config_.fp32_grads())
    for (const auto& [name, param] : after)
      if (is_low_precision(param.dtype())) Tensor(param).set_grad_dtype(DType::F32);
  return {std::move(optimizer), make_scalers(config_), step_options(config_, options)};
}

void Booster::convert_model(Module& model, const BoostOptions& options) {
  const AmpConfig& c = config_;
  if (c.row().tf32_matmuls) set_allow_tf32(true);
  switch (c.row().cast) {
    case ModeCast::None:
    case ModeCast::Autocast:  // forward() opens the autocast scope
      break;
    case ModeCast::WholeModel: {
      NaiveAMPOptions naive;
      naive.dtype = low_name(*c.model_dtype());
      naive.output_to_fp32 = c.naive.output_to_fp32;
      naive.group = options.data_parallel_group;
      naive.fp32_modules = options.fp32_modules;
      naive_ = std::make_unique<NaiveAMPModel>(model, naive);
      break;
    }
    case ModeCast::ByOptLevel:
      convert_model_as_apex(model, options);
      break;
  }
}

// Apex's _initialize: with a cast_model_type (O0's fp32 too) the model is cast, every floating input is cast
// to it and every floating output to cast_model_outputs (fp32 if unset); without one, floating outputs are
// cast to cast_model_outputs when it is set. Each cast happens even when it changes nothing inside the model
// (O2 with cast_model_outputs "fp16" casts the fp32 loss to fp16).
void Booster::convert_model_as_apex(Module& model, const BoostOptions& options) {
  const AmpConfig& c = config_;
  const std::optional<DType> cast = c.model_dtype();
  if (!cast) {
    output_dtype_ = c.apex.cast_model_outputs;  // O1 (or no cast) with cast_model_outputs
    return;
  }
  input_dtype_ = *cast;
  output_dtype_ = c.apex.cast_model_outputs.value_or(DType::F32);
  if (*cast == DType::F32) {
    model.to(DType::F32);
    return;
  }
  NaiveAMPOptions naive;
  naive.dtype = low_name(*cast);
  naive.sync_buffer = false;
  naive.output_to_fp32 = false;  // forward() casts the outputs, as Apex does
  // keep_norms_fp32: the norm layers keep their fp32 values and run in fp32, as do fp32_modules.
  // keep_batchnorm_fp32 would keep BatchNorm modules so; a model here has none.
  naive.fp32_modules = options.fp32_modules;
  if (c.apex.keep_norms_fp32) {
    std::vector<UnaryModule*> norms;
    collect_norms(model, norms);
    std::vector<UnaryModule*>& fp32 = naive.fp32_modules;
    for (UnaryModule* norm : norms)
      if (std::find(fp32.begin(), fp32.end(), norm) == fp32.end()) fp32.push_back(norm);
  }
  naive_ = std::make_unique<NaiveAMPModel>(model, naive);
}

std::vector<Tensor> Booster::forward(
    const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& forward,
    const std::vector<Tensor>& inputs) {
  check(model_ != nullptr, "Booster.forward: call boost(model, optimizer) first");
  // The mode's own autocast lists: PyTorch's for fp16/bf16, Apex's for apex O1 (every family that autocasts
  // names its table: row_follows_its_family).
  std::optional<Autocast> scope;
  if (const auto dtype = config_.autocast_dtype()) scope.emplace(dtype, *config_.row().autocast_policy);
  std::optional<LowPrecisionScope> low_precision;
  if (low_precision_) low_precision.emplace(low_precision_);
  std::vector<Tensor> cast_inputs = inputs;
  if (input_dtype_)
    for (Tensor& input : cast_inputs) input = cast_floating(input, *input_dtype_);
  std::vector<Tensor> outputs = naive_ ? naive_->forward(forward, cast_inputs) : forward(cast_inputs);
  if (output_dtype_)
    for (Tensor& out : outputs) out = cast_floating(out, *output_dtype_);
  return outputs;
}

void Booster::save_scaling_state(StateDict& state) const {
  if (!low_precision_) return;
  state.metadata[std::string(kScalingStatePrefix) + "steps"] = std::to_string(low_precision_->steps());
  if (low_precision_->recipe().scaling != ScalingRecipe::DelayedTensorwise) return;
  for (const auto& [name, scaling] : low_precision_->scaling_state()) {
    const std::string key = kScalingStatePrefix + name;
    state.tensors[key + ".scale"] = Tensor::from_vector(std::vector<float>{scaling.scale}, {1});
    state.tensors[key + ".amax_history"] =
        Tensor::from_vector(scaling.history, {static_cast<int64_t>(scaling.history.size())});
  }
}

void Booster::load_scaling_state(const StateDict& state) {
  if (!low_precision_) return;
  const std::string draws_key = std::string(kScalingStatePrefix) + "steps";
  const auto draws = state.metadata.find(draws_key);
  check(draws != state.metadata.end(), "Booster: the checkpoint has no ", draws_key, " (it is not from an ",
        config_.name(), " run)");
  uint64_t draw_count = 0;
  try {
    size_t used = 0;
    draw_count = std::stoull(draws->second, &used);
    check(used == draws->second.size(), "trailing text");
  } catch (const std::exception&) {
    fail("Booster: ", draws_key, " is '", draws->second, "', expected a count");
  }
  if (low_precision_->recipe().scaling == ScalingRecipe::DelayedTensorwise) {
    std::map<std::string, DelayedScaling> scaling = low_precision_->scaling_state();  // the names to read
    for (auto& [name, entry] : scaling) {
      const std::string key = kScalingStatePrefix + name;
      const auto scale = state.tensors.find(key + ".scale"), history = state.tensors.find(key + ".amax_history");
      check(scale != state.tensors.end() && history != state.tensors.end(), "Booster: the checkpoint lacks ", key,
            ".scale or .amax_history (", config_.name(), " keeps both for every fp8 tensor)");
      check(scale->second.numel() == 1 && history->second.dim() == 1 && is_floating(history->second.dtype()) &&
                is_floating(scale->second.dtype()),
            "Booster: ", key, " holds ", scale->second.description(), " and ", history->second.description(),
            "; expected f32[1] and f32[amax_history_len]");
      entry.scale = static_cast<float>(scale->second.item());
      entry.history = history->second.to(DType::F32).to_vector<float>();
      for (const float a : entry.history)
        check(!(a < 0), "Booster: ", key, ".amax_history holds ", a, "; an amax is never negative");
    }
    low_precision_->load_scaling_state(scaling);
  }
  low_precision_->set_steps(draw_count);
}

void Booster::backward(const Tensor& loss, MixedPrecisionOptimizer& optimizer, int loss_id) {
  optimizer.backward(loss, loss_id);
}

StepResult Booster::step(MixedPrecisionOptimizer& optimizer) {
  std::vector<const LossScaler*> scalers;
  for (int i = 0; i < optimizer.num_losses(); ++i) scalers.push_back(&optimizer.scaler(i));
  return step([&optimizer] { return optimizer.step(); }, scalers);
}

StepResult Booster::step(const std::function<StepResult()>& step,
                          const std::vector<const LossScaler*>& scalers) {
  // Only scalers updated in this step report (a loss that sat the step out keeps an earlier outcome).
  std::vector<uint64_t> updates_before;
  for (const LossScaler* scaler : scalers) {
    const DynamicLossScaler* dynamic = dynamic_scaler(scaler);
    updates_before.push_back(dynamic ? dynamic->update_count() : 0);
  }
  const StepResult result = step();
  // Delayed scaling's history moves on every step, skipped or not (TE updates it after every backward).
  if (low_precision_) low_precision_->end_step();
  if (!print_verbose_) return result;
  using Update = DynamicLossScaler::Update;
  // What scaler i's update in this step did; None if it was not updated (or is not dynamic).
  auto outcome = [&](size_t i) {
    const DynamicLossScaler* dynamic = dynamic_scaler(scalers[i]);
    const bool updated = dynamic && dynamic->update_count() != updates_before[i];
    return updated ? dynamic->last_update() : Update::None;
  };
  if (config_.family() == ModeFamily::Apex && config_.apex.verbosity > 0) {
    for (size_t i = 0; i < scalers.size(); ++i) {
      const std::string scale = exact_number_text(scalers[i]->scale());
      const Update update = outcome(i);
      const DynamicLossScaler* dynamic = dynamic_scaler(scalers[i]);
      if (dynamic == nullptr) {  // a static scale: Apex would have stepped (docs/amp.md)
        if (result.skipped && i == 0)
          std::fprintf(stderr, "Gradient overflow.  Skipping step (static loss scale %s, kept: mixtape skips "
                       "a non-finite step where Apex steps)\n", scale.c_str());
      } else if (update == Update::Overflow || update == Update::Backoff) {
        // Apex's message (apex/amp/handle.py), on every skipped step, at the min_loss_scale floor too.
        std::fprintf(stderr, "Gradient overflow.  Skipping step, loss scaler %zu reducing loss scale to %s\n",
                     i, scale.c_str());
      } else if (config_.apex.verbosity >= 2 && update == Update::Growth) {
        std::fprintf(stderr, "No overflow for %lld consecutive steps, loss scaler %zu increasing loss scale "
                     "to %s\n", static_cast<long long>(dynamic->options().growth_interval), i, scale.c_str());
      }
    }
  } else if (config_.is_naive() && config_.naive.verbose && !scalers.empty()) {
    // Colossal-AI's DynamicGradScaler log lines, at each backoff and each growth (clamped ones included).
    const std::string scale = exact_number_text(scalers[0]->scale());
    const Update update = outcome(0);  // Growth and Backoff only come from a DynamicLossScaler
    if (update == Update::Backoff)
      std::fprintf(stderr, "Overflow occurs, the loss scale is adjusted to %s\n", scale.c_str());
    else if (update == Update::Growth)
      std::fprintf(stderr, "No overflow for consecutive %lld steps, the loss scale is adjusted to %s\n",
                   static_cast<long long>(dynamic_scaler(scalers[0])->options().growth_interval),
                   scale.c_str());
  }
  return result;
}

}  // namespace mixtape
