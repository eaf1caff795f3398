#pragma once
// MixedPrecisionOptimizer: wraps any Optimizer (SGD, Adam, AdamW, ...) so it trains fp16/bf16 parameters
// through fp32 master weights, with one or more loss scalers (Megatron-LM's MixedPrecisionOptimizer /
// Float16OptimizerWithFloat16Params, Apex's O2 master weights, Colossal-AI's naive AMP optimizer).
//
// At construction every fp16/bf16 parameter of the wrapped optimizer gets an fp32 master copy, and the
// wrapped optimizer's param groups are rewired to the masters (so its state — momenta, exp_avg — is kept
// for, and computed on, the masters). fp32 parameters are their own masters (Megatron's
// fp32_from_fp32_params). The wrapped optimizer must not have taken a step yet.
//
// One step:
//   backward(loss[, loss_id])  backward of loss * S[loss_id]. Gradients of different losses carry different
//                              scales, so when the loss id changes the model gradients so far are folded
//                              into the master gradients first (Apex's stash-and-unscale for num_losses).
//                              Backward calls under one loss id (micro-batches) add their scaled
//                              gradients in the parameters' gradient dtype until the fold: the parameter's
//                              own, or fp32 after Tensor::set_grad_dtype (Booster does it for Apex's
//                              master weights and accumulate_allreduce_grads_in_fp32; docs/amp.md).
//   step()                     1. fold: master_grad += model_grad / S (fp32, one fused pass that also
//                                 checks finiteness: unscale_and_check_finite); model grads dropped
//                              2. found_inf and "loss used this step" all-reduced (MAX) over the process
//                                 group, if one is given
//                              3. found_inf: skip — parameters, masters and optimizer state unchanged
//                              4. optional clip_grad on the unscaled master grads (squared norm summed
//                                 over the process group), optional log_num_zeros_in_grad
//                              5. the wrapped optimizer steps on the masters; each master is rounded once
//                                 (nearest even) into its model parameter
//                              6. the scaler of every loss used in this step is updated with that loss's
//                                 found_inf (also after a skip); a loss that sat the step out is not (Apex)
//   zero_grad()                drops model and master gradients.
// After a step the unscaled gradients stay on the masters (and on fp32 parameters, their own masters) for
// inspection until zero_grad() or the next scale_loss()/backward(), which starts from zero gradients: a new
// accumulation never mixes the last step's unscaled gradients with scaled ones. Gradients must reach the
// model through scale_loss()/backward() of this optimizer (their scale must be known): step() rejects model
// gradients that appeared otherwise.
//
// Without master weights (Apex O3, or master_weights = false) the model parameters are stepped directly:
// 16-bit parameters lose every update below half their ulp — the reason master weights exist (tested).
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "amp/process_group.h"
#include "amp/scaler.h"
#include "io/state_dict.h"
#include "optim/optimizer.h"
#include "tensor/tensor.h"

namespace mixtape {

struct MixedPrecisionOptions {
  bool master_weights = true;           // fp32 masters for fp16/bf16 parameters
  double clip_grad = 0;                 // max global L2 norm of the unscaled gradients; 0 = off
  bool log_num_zeros_in_grad = false;   // count zero elements of the unscaled gradients (StepResult)
  ProcessGroup* group = nullptr;        // found_inf MAX and norm/zero-count SUM over it; null = local
  // Per parameter (the wrapped optimizer's order): whether it counts in the gradient norm and the zero count
  // on this rank. Empty: all. Under model parallelism a parameter replicated on several ranks of the group (a
  // LayerNorm weight on every tensor-parallel rank, a tied embedding on the first and the last pipeline stage)
  // counts on one of them only, so the SUM over the group counts it once.
  std::vector<bool> count_in_norm;
};

struct StepResult {
  bool skipped = false;        // a gradient was inf/NaN (on any rank of the group): nothing was updated
  double grad_norm = 0;        // of the unscaled gradients, before clipping (0 if skipped)
  int64_t num_zeros = -1;      // zero gradient elements; -1 unless log_num_zeros_in_grad (and on a skipped step)
  double loss_scale = 1;       // S[0] used for this step (before the update)
};

// A list of one scaler (for the one-loss constructors).
std::vector<std::unique_ptr<LossScaler>> one_scaler(std::unique_ptr<LossScaler> scaler);

// The AMP part of a mixed-precision optimizer's state dict, shared by MixedPrecisionOptimizer and
// dist::ZeroOptimizer (one layout, so a checkpoint loads into either):
//   "scaler.<k>.<entry>" for each scaler k;
//   "amp.num_losses" and "amp.skipped_steps", non-negative counts.
void write_scaler_states(const std::vector<std::unique_ptr<LossScaler>>& scalers,
                         std::map<std::string, std::string>& metadata);
// The "scaler.<k>.<entry>" entries of `metadata`, one map per scaler. Checks k < scalers.size() and each
// scaler's "type" (a scaler that keeps no state, a disabled GradScaler, must have no entries); `who` names
// the caller in the errors.
std::vector<std::map<std::string, std::string>> read_scaler_states(
    const std::map<std::string, std::string>& metadata, const std::vector<std::unique_ptr<LossScaler>>& scalers,
    const std::string& who);
// Loads each scaler's state. If one throws, the scalers loaded before it get their old state back and the
// error propagates: the scalers are unchanged.
void load_scaler_states(const std::vector<std::unique_ptr<LossScaler>>& scalers,
                        const std::vector<std::map<std::string, std::string>>& states);
// Checks the "amp.*" entries: amp.num_losses equals num_losses, amp.master_weights equals master_weights
// ("true"/"false"), no other amp.* entry; returns amp.skipped_steps. Errors name `who`.
int64_t read_amp_entries(const std::map<std::string, std::string>& metadata, int num_losses, bool master_weights,
                         const std::string& who);

class MixedPrecisionOptimizer {
 public:
  // scalers: one per loss (Apex num_losses); at least one. Use StaticLossScaler(1) for "no scaling" (bf16).
  MixedPrecisionOptimizer(std::unique_ptr<Optimizer> optimizer,
                          std::vector<std::unique_ptr<LossScaler>> scalers, MixedPrecisionOptions options = {});
  MixedPrecisionOptimizer(std::unique_ptr<Optimizer> optimizer, std::unique_ptr<LossScaler> scaler,
                          MixedPrecisionOptions options = {});

  // loss * S[loss_id] (a recorded op) — for callers that run backward themselves.
  Tensor scale_loss(const Tensor& loss, int loss_id = 0);
  // backward(scale_loss(loss, loss_id)), folding pending gradients of another loss id first.
  void backward(const Tensor& loss, int loss_id = 0);
  StepResult step();
  void zero_grad();

  Optimizer& optimizer() { return *optimizer_; }  // holds the masters: set lr on its param_groups()
  const Optimizer& optimizer() const { return *optimizer_; }
  std::vector<Tensor> model_params() const;   // in the wrapped optimizer's parameter order
  std::vector<Tensor> master_params() const;  // same order; a master is the model tensor itself when fp32
  int num_losses() const { return static_cast<int>(scalers_.size()); }
  LossScaler& scaler(int loss_id = 0);
  double loss_scale(int loss_id = 0) const;
  const MixedPrecisionOptions& options() const { return options_; }
  int64_t skipped_steps() const { return skipped_steps_; }

  // The wrapped optimizer's state dict (its state is the masters'), plus
  //   tensors  "master.<i>"           fp32 master of parameter i (only for parameters with a separate master)
  //   metadata "amp.num_losses", "amp.master_weights", "amp.skipped_steps", "scaler.<k>.<entry>" per scaler
  // load_state_dict validates everything (types, shapes, scaler types) before changing anything; a failure
  // inside the wrapped optimizer's or a scaler's own load rolls back what was loaded. On success the masters
  // take the saved values, each model parameter its master rounded once, and pending gradients are dropped.
  StateDict state_dict() const;
  void load_state_dict(const StateDict& dict);
  // After the model's parameters were overwritten from outside (loading weights): each separate fp32 master
  // takes its parameter's value (exact: 16-bit -> fp32), so the next step starts from the loaded weights.
  void reload_masters();

 private:
  void fold_pending_grads();  // model grads (scaled by S[pending_loss_]) -> master grads, records found_inf
  void begin_backward(int loss_id);  // clears after a step, folds another loss id's grads, sets pending
  void clear_grads();                // model and master gradients, accumulators, found_inf, pending
  void check_loss_id(int loss_id, const char* what) const;

  std::unique_ptr<Optimizer> optimizer_;
  std::vector<std::unique_ptr<LossScaler>> scalers_;
  MixedPrecisionOptions options_;
  std::vector<Tensor> model_params_;
  std::vector<Tensor> master_params_;
  std::vector<bool> found_inf_;  // per loss id, since the last step
  std::vector<bool> used_;       // per loss id: went through scale_loss()/backward() since the last step
  int pending_loss_ = -1;        // loss id whose scale the model grads carry; -1: none pending
  // Per parameter: the sum of the unscaled gradients folded since the last step, in Optimizer::state_dtype
  // (f32; f64 for f64 parameters). Kept apart from .grad so a parameter that is its own master never holds
  // scaled and unscaled gradients at once; installed as the master's .grad by step().
  std::vector<Tensor> accumulators_;
  bool stepped_ = false;         // the installed gradients are the last step's (already unscaled, consumed)
  int64_t skipped_steps_ = 0;
};

}  // namespace mixtape
