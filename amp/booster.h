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
//   fp32        nothing (StaticLossScaler(1) so the loop is the same; like every mode, a step with an inf/NaN
//               gradient is skipped and counted, where PyTorch would apply it: docs/amp.md)
//   tf32        set_allow_tf32(true) (process-wide, like torch.backends.cuda.matmul.allow_tf32)
//   fp16        forward under Autocast(F16); GradScaler with the config's options; fp32 params
//   bf16        forward under Autocast(BF16); no scaler unless enabled; fp32 params
//   fp16_apex   O0: model fp32, floating inputs and outputs cast to fp32, static scale 1 · O1: Autocast(F16),
//               fp32 params, dynamic Apex scaler · O2: model fp16 with norm layers fp32, floating inputs cast
//               to fp16, floating outputs to fp32, fp32 master weights, dynamic Apex scaler · O3: model
//               fp16, no masters, scale 1 — each property overridable (num_losses: one scaler per loss,
//               loss_id in backward). As in Apex's _initialize, whenever cast_model_outputs is set (any opt
//               level) every floating output is cast to it, even when the model already computed it in
//               that dtype or it differs (O2 with "fp16": the fp32 loss comes back fp16). Deviation: a
//               static loss scale skips a step with non-finite gradients (every scale does, amp/optimizer.h);
//               Apex steps anyway (it checks for overflow only when dynamic). verbosity 1 prints Apex's
//               "Gradient overflow.  Skipping step, loss scaler K reducing loss scale to S" on every
//               skipped step; 2 also each growth (a line of ours: Apex's verbosity 2 prints its casts). The
//               dynamic scale is updated once per step (Apex: after every backward; docs/amp.md).
//   fp8 ...     fp8, fp8_delayed, fp8_rowwise, fp8_block, mxfp8, nvfp4: forward under Autocast(BF16), and the
//               Linear layers' GEMMs (all but the config's exclude, by default lm_head) quantized by the mode's
//               recipe (tensor/scaled_linear.h); fp32 params, no loss scaling; the delayed scales move on after
//               each step
//   fp16_naive  NaiveAMPModel(fp16) + masters + DynamicLossScaler with hysteresis (and the config's clip_grad,
//   bf16_naive  log_num_zeros_in_grad); bf16 likewise. verbose prints Colossal-AI's lines at each backoff
//               ("Overflow occurs, the loss scale is adjusted to S") and growth ("No overflow for
//               consecutive N steps, the loss scale is adjusted to S").
// Modules to keep in fp32 go in BoostOptions::fp32_modules: once boost() handed the parameters to the
// optimizer, the NaiveAMPModel is sealed and set_fp32 on it is an Error (its new leaves would never train).
// Nothing here is backend-specific: the same code runs wherever the ops run.
#include <functional>
#include <memory>
#include <vector>

#include "amp/config.h"
#include "amp/naive_amp.h"
#include "amp/optimizer.h"
#include "amp/process_group.h"
#include "nn/module.h"
#include "io/state_dict.h"
#include "optim/optimizer.h"
#include "tensor/scaled_linear.h"

namespace mixtape {

struct BoostOptions {
  double clip_grad = 0;           // used unless the config sets its own (naive clip_grad > 0)
  // The two groups of a parallel job (amp/process_group.h), null for one process:
  // found_inf (MAX) and the grad norm (SUM of squares) over the ranks that hold different parts of the model
  // (tensor x pipeline parallel; MixedPrecisionOptions::group) ...
  ProcessGroup* model_parallel_group = nullptr;
  // ... and the naive modes' buffer averaging over the replicas of the same part (data parallel;
  // NaiveAMPOptions::group). One group for both would sum the replicas' identical norms (sqrt(dp) too large)
  // or average buffers across different layers.
  ProcessGroup* data_parallel_group = nullptr;
  // Submodules that keep fp32 parameters and run in fp32 where the mode casts the model to fp16/bf16 (naive
  // modes, apex O2/O3: NaiveAMPOptions::fp32_modules, merged with the norms of keep_norms_fp32). In the
  // other modes the parameters are fp32 already and this changes nothing (autocast still picks op dtypes).
  std::vector<UnaryModule*> fp32_modules = {};
  // Whether this process prints the mode's verbose lines (Apex verbosity, naive verbose). In a job of several
  // processes one of them should (they all take the same steps): a parallel trainer sets it on rank 0 only.
  bool print_verbose = true;
  // The fp8 and block-scaled modes. linear_weights: the weights of the caller's own Linear-like layers (a
  // tensor-parallel layer's shard), by parameter name, covered like every nn::Linear of the model (and
  // excluded by the same names). amax_group: the processes that hold parts of the same layers (data and
  // tensor parallel ranks of one pipeline stage); the tensorwise scales are reduced (MAX) over it, so every rank
  // quantizes as one process would. amax_group_in_eval: the tensor-parallel ranks, over which an evaluation
  // forward reduces (data-parallel replicas evaluate different batches). Null, or a group of one: nothing is
  // reduced.
  std::vector<std::pair<std::string, Tensor>> linear_weights = {};
  ProcessGroup* amax_group = nullptr;
  ProcessGroup* amax_group_in_eval = nullptr;
  // Where processes split K of a covered layer's GEMMs (LowPrecisionContext::set_k_split: fp8_rowwise reduces its
  // row amaxes over them): tensor_parallel_group for the forward of the row-parallel weights and the input
  // gradient of the column-parallel ones (by parameter name, among linear_weights), and data_parallel_group
  // (above) for every covered weight's gradient, whose K is the tokens.
  ProcessGroup* tensor_parallel_group = nullptr;
  std::vector<std::string> row_parallel_weights = {}, column_parallel_weights = {};
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
  // swapped for the new ones (matched by identity). An optimizer holding a tensor that is not one of the
  // model's parameters is an Error (a subset is fine). One model per booster; the model must outlive it.
  std::unique_ptr<MixedPrecisionOptimizer> boost(Module& model, std::unique_ptr<Optimizer> optimizer,
                                                 BoostOptions options = {});
  // The same conversion of the model, returning the parts instead of the MixedPrecisionOptimizer.
  BoostedParts boost_parts(Module& model, std::unique_ptr<Optimizer> optimizer, BoostOptions options = {});

  // Runs `forward` with the mode's casts: inside autocast for fp16 / bf16 / apex O1; naive modes: fp32 inputs
  // to the low dtype, fp16/bf16 outputs to fp32 (output_to_fp32); apex with a cast_model_type: every floating
  // input to it, every floating output to cast_model_outputs (fp32 if unset); apex without one: floating
  // outputs to cast_model_outputs when set.
  std::vector<Tensor> forward(const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& forward,
                              const std::vector<Tensor>& inputs);
  void backward(const Tensor& loss, MixedPrecisionOptimizer& optimizer, int loss_id = 0);
  // optimizer.step(), then the mode's verbose lines for the scalers this step updated (when print_verbose).
  StepResult step(MixedPrecisionOptimizer& optimizer);
  // The same around another wrapper's step (dist::ZeroOptimizer) with its scalers, one per loss.
  StepResult step(const std::function<StepResult()>& step, const std::vector<const LossScaler*>& scalers);

  const AmpConfig& config() const { return config_; }
  // Null unless the mode casts the model to fp16/bf16. Sealed by boost(): set_fp32 on it is an Error.
  NaiveAMPModel* naive_model() { return naive_.get(); }
  // The fp8 / block-scaled modes' GEMM state (tensor/scaled_linear.h): which Linear layers it covers, their
  // delayed scaling and what quantization saturated and flushed; null in the other modes.
  const std::shared_ptr<LowPrecisionContext>& low_precision() const { return low_precision_; }
  // The fp8 modes' state a resumed run needs, as checkpoint entries under "amp_scaling.": delayed scaling's
  // scale and amax history per covered tensor ("amp_scaling.<weight>.<kind>.scale" and ".amax_history",
  // f32) and the steps the recipe has ended (metadata "amp_scaling.steps": NVFP4's random streams follow it).
  // Nothing in other modes.
  void save_scaling_state(StateDict& state) const;
  // Reads them back (Error, changing nothing, when an entry is missing or malformed; a history may hold Inf or
  // NaN, which the recipe records, but no negative amax). Nothing in other modes.
  void load_scaling_state(const StateDict& state);
  static constexpr const char* kScalingStatePrefix = "amp_scaling.";

 private:
  // boost()'s conversion of the model for the mode (the row's cast); Apex's per its properties.
  void convert_model(Module& model, const BoostOptions& options);
  void convert_model_as_apex(Module& model, const BoostOptions& options);

  AmpConfig config_;
  bool print_verbose_ = true;
  Module* model_ = nullptr;
  std::unique_ptr<NaiveAMPModel> naive_;
  std::optional<DType> input_dtype_;   // apex: cast_model_type (floating inputs are cast to it)
  std::optional<DType> output_dtype_;  // apex: cast_model_outputs, or fp32 when the model is cast
  std::shared_ptr<LowPrecisionContext> low_precision_;  // fp8 / block-scaled modes
};

}  // namespace mixtape
