#include "amp/booster.h"

#include <cstdio>
#include <map>

#include "amp/autocast.h"
#include "nn/layers.h"
#include "tensor/error.h"
#include "tensor/precision.h"

namespace mixtape {

namespace {

// Every LayerNorm / RMSNorm below `module` (Apex's keep_batchnorm_fp32 applied to our norm layers).
void collect_norms(Module& module, std::vector<UnaryModule*>& out) {
  for (const auto& [name, child] : module.named_children()) {
    if (dynamic_cast<LayerNorm*>(child) || dynamic_cast<RMSNorm*>(child))
      out.push_back(static_cast<UnaryModule*>(child));
    collect_norms(*child, out);
  }
}

const char* low_name(DType dtype) { return dtype == DType::BF16 ? "bf16" : "fp16"; }

}  // namespace

Booster::Booster(AmpConfig config) : config_(std::move(config)) { config_.validate(); }

std::unique_ptr<MixedPrecisionOptimizer> Booster::boost(Module& model, std::unique_ptr<Optimizer> optimizer,
                                                        BoostOptions options) {
  BoostedParts parts = boost_parts(model, std::move(optimizer), options);
  return std::make_unique<MixedPrecisionOptimizer>(std::move(parts.optimizer), std::move(parts.scalers),
                                                   std::move(parts.options));
}

BoostedParts Booster::boost_parts(Module& model, std::unique_ptr<Optimizer> optimizer, BoostOptions options) {
  check(model_ == nullptr, "Booster.boost: this booster already boosted a model (one model per booster)");
  check(optimizer != nullptr, "Booster.boost: the optimizer is null");
  const AmpConfig& c = config_;
  const std::vector<std::pair<std::string, Tensor>> before = model.named_parameters();

  // ---- the model ----
  if (c.mixed_precision == "tf32") set_allow_tf32(true);
  if (c.is_naive()) {
    NaiveAMPOptions naive;
    naive.dtype = low_name(*c.model_dtype());
    naive.output_to_fp32 = c.naive.output_to_fp32;
    naive.group = options.group;
    naive_ = std::make_unique<NaiveAMPModel>(model, naive);
  } else if (c.mixed_precision == "fp16_apex" && c.apex.cast_model_type) {
    const DType cast = *c.apex.cast_model_type;
    if (cast == DType::F32) {
      model.to(DType::F32);
    } else {
      NaiveAMPOptions naive;
      naive.dtype = low_name(cast);
      naive.sync_buffer = false;
      // Apex casts outputs to fp32 unless cast_model_outputs names another dtype.
      naive.output_to_fp32 = !c.apex.cast_model_outputs || *c.apex.cast_model_outputs == DType::F32;
      if (c.apex.cast_model_outputs && *c.apex.cast_model_outputs != cast &&
          *c.apex.cast_model_outputs != DType::F32)
        output_dtype_ = *c.apex.cast_model_outputs;
      // keep_batchnorm_fp32: the norm layers keep their fp32 values and run in fp32.
      if (c.apex.keep_batchnorm_fp32.value_or(false)) collect_norms(model, naive.fp32_modules);
      naive_ = std::make_unique<NaiveAMPModel>(model, naive);
    }
  } else if (c.mixed_precision == "fp16_apex" && c.apex.cast_model_outputs) {
    output_dtype_ = c.apex.cast_model_outputs;  // O1 with cast_model_outputs
  }
  model_ = &model;

  // ---- the optimizer's parameters: conversion made new leaves; swap them in, matched by identity ----
  const std::vector<std::pair<std::string, Tensor>> after = model.named_parameters();
  check(after.size() == before.size(), "Booster.boost: the model's parameter list changed during conversion");
  std::map<const void*, Tensor> replacement;
  for (size_t i = 0; i < before.size(); ++i) replacement[before[i].second.impl_ptr().get()] = after[i].second;
  for (ParamGroup& group : optimizer->param_groups())
    for (Tensor& param : group.params) {
      const auto found = replacement.find(param.impl_ptr().get());
      if (found != replacement.end()) param = found->second;
    }

  // ---- the scalers ----
  std::vector<std::unique_ptr<LossScaler>> scalers;
  MixedPrecisionOptions mp;
  mp.group = options.group;
  mp.clip_grad = options.clip_grad;
  if (c.mixed_precision == "fp16" || c.mixed_precision == "bf16") {
    if (c.grad_scaler.enabled) scalers.push_back(std::make_unique<GradScaler>(c.grad_scaler));
    else scalers.push_back(std::make_unique<StaticLossScaler>(1.0));
  } else if (c.mixed_precision == "fp16_apex") {
    const ApexProperties& a = c.apex;
    mp.master_weights = a.master_weights;
    for (int64_t i = 0; i < a.num_losses; ++i) {
      if (a.loss_scale) {
        scalers.push_back(std::make_unique<StaticLossScaler>(*a.loss_scale));
      } else {
        scalers.push_back(std::make_unique<DynamicLossScaler>(apex_dynamic_scaler(
            std::min(65536.0, a.max_loss_scale), 2000, a.min_loss_scale, a.max_loss_scale)));
      }
    }
  } else if (c.is_naive()) {
    scalers.push_back(std::make_unique<DynamicLossScaler>(c.naive.scaler));
    if (c.naive.clip_grad > 0) mp.clip_grad = c.naive.clip_grad;
    mp.log_num_zeros_in_grad = c.naive.log_num_zeros_in_grad;
  } else {
    scalers.push_back(std::make_unique<StaticLossScaler>(1.0));
  }
  return {std::move(optimizer), std::move(scalers), std::move(mp)};
}

std::vector<Tensor> Booster::forward(
    const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& forward,
    const std::vector<Tensor>& inputs) {
  check(model_ != nullptr, "Booster.forward: call boost(model, optimizer) first");
  std::optional<Autocast> scope;
  if (const auto dtype = config_.autocast_dtype()) scope.emplace(dtype);
  std::vector<Tensor> outputs = naive_ ? naive_->forward(forward, inputs) : forward(inputs);
  if (output_dtype_)
    for (Tensor& out : outputs)
      if (out.defined() && is_floating(out.dtype())) out = out.to(*output_dtype_);
  return outputs;
}

void Booster::backward(const Tensor& loss, MixedPrecisionOptimizer& optimizer, int loss_id) {
  optimizer.backward(loss, loss_id);
}

StepResult Booster::step(MixedPrecisionOptimizer& optimizer) {
  std::vector<double> before;
  for (int i = 0; i < optimizer.num_losses(); ++i) before.push_back(optimizer.loss_scale(i));
  const StepResult result = optimizer.step();
  const bool verbose = (config_.mixed_precision == "fp16_apex" && config_.apex.verbosity > 0) ||
                       (config_.is_naive() && config_.naive.verbose);
  if (verbose)
    for (int i = 0; i < optimizer.num_losses(); ++i)
      if (result.skipped && optimizer.loss_scale(i) < before[static_cast<size_t>(i)])  // Apex's message
        std::fprintf(stderr, "Gradient overflow. Skipping step, loss scaler %d reducing loss scale to %g\n", i,
                     optimizer.loss_scale(i));
  return result;
}

}  // namespace mixtape
