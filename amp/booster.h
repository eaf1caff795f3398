#pragma once
// Booster: the one-line entry point (Colossal-AI's Booster) that maps a precision mode (amp/config.h) onto
// the pieces of amp/: autocast, NaiveAMPModel, MixedPrecisionOptimizer and the loss scalers.
//
//   Booster booster(AmpConfig::parse("fp16_apex:O2"));
//   auto optimizer = booster.boost(model, std::make_unique<AdamW>(groups, options));
//   for (...) {
//     optimizer->zero_grad();
//     Tensor loss = booster.forward([&](const std::vector<Tensor>& in) { ... return {loss}; }, {x, y})[0];
//     booster.backward(loss, *optimizer);
//     StepResult r = booster.step(*optimizer);       // r.skipped on overflow
//   }
//
// What each mode does:
//   fp32        nothing (StaticLossScaler(1) so the loop is the same)
//   tf32        set_allow_tf32(true) (process-wide, like torch.backends.cuda.matmul.allow_tf32)
//   fp16        forward under Autocast(F16); GradScaler with the config's options; fp32 params
//   bf16        forward under Autocast(BF16); no scaler unless enabled; fp32 params
//   fp16_apex   O0: model fp32, static scale 1 · O1: Autocast(F16), fp32 params, dynamic Apex scaler ·
//               O2: model fp16 with norm layers fp32, inputs cast to fp16, outputs to fp32, fp32 master
//               weights, dynamic Apex scaler · O3: model fp16, no masters, scale 1 — each property
//               overridable (num_losses: one scaler per loss, loss_id in backward)
//   fp16_naive  NaiveAMPModel(fp16) + masters + DynamicLossScaler with hysteresis (and the config's clip_grad,
//   bf16_naive  log_num_zeros_in_grad); bf16 likewise
// Nothing here is backend-specific: the same code runs wherever the ops run.
#include <functional>
#include <memory>
#include <vector>

#include "amp/config.h"
#include "amp/naive_amp.h"
#include "amp/optimizer.h"
#include "amp/process_group.h"
#include "nn/module.h"
#include "optim/optimizer.h"

namespace mixtape {

struct BoostOptions {
  double clip_grad = 0;           // used unless the config sets its own (naive clip_grad > 0)
  ProcessGroup* group = nullptr;  // found_inf / grad norm all-reduce, buffer sync
};

// What boost() assembles a MixedPrecisionOptimizer from: the wrapped optimizer (its parameters swapped for the
// converted model's), one scaler per loss, and the mode's options. For callers that build another optimizer
// wrapper on the same parts (dist::ZeroOptimizer) or adjust the options first (count_in_norm).
struct BoostedParts {
  std::unique_ptr<Optimizer> optimizer;
  std::vector<std::unique_ptr<LossScaler>> scalers;
  MixedPrecisionOptions options;
};

class Booster {
 public:
  explicit Booster(AmpConfig config = {});  // validates

  // Converts `model` in place for the mode and wraps `optimizer` (built on the model's parameters, before
  // its first step) with the mode's scalers. The optimizer's parameters that the conversion replaced are
  // swapped for the new ones (matched by identity). One model per booster; the model must outlive it.
  std::unique_ptr<MixedPrecisionOptimizer> boost(Module& model, std::unique_ptr<Optimizer> optimizer,
                                                 BoostOptions options = {});
  // The same conversion of the model, returning the parts instead of the MixedPrecisionOptimizer.
  BoostedParts boost_parts(Module& model, std::unique_ptr<Optimizer> optimizer, BoostOptions options = {});

  // Runs `forward` with the mode's casts: inside autocast for fp16 / bf16 / apex O1; with floating inputs
  // cast to the model dtype and floating outputs to fp32 (or cast_model_outputs) when the model is cast.
  std::vector<Tensor> forward(const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& forward,
                              const std::vector<Tensor>& inputs);
  void backward(const Tensor& loss, MixedPrecisionOptimizer& optimizer, int loss_id = 0);
  StepResult step(MixedPrecisionOptimizer& optimizer);

  const AmpConfig& config() const { return config_; }
  NaiveAMPModel* naive_model() { return naive_.get(); }  // null unless the mode casts the model

 private:
  AmpConfig config_;
  Module* model_ = nullptr;
  std::unique_ptr<NaiveAMPModel> naive_;
  std::optional<DType> output_dtype_;  // apex cast_model_outputs other than fp32
};

}  // namespace mixtape
