#pragma once
// ZeRO stage 1 (DeepSpeed; Megatron-LM's DistributedOptimizer): the mixed-precision optimizer with its
// master weights and optimizer state sharded over the data-parallel group. Same interface as
// MixedPrecisionOptimizer (amp/optimizer.h): scale_loss/backward (with loss ids, one scaler per loss, Apex's
// num_losses)/step/zero_grad/state_dict.
//
// Layout: the wrapped optimizer's parameters, in group order, are flattened into one space of N elements,
// padded to dp * S (S = ceil(N / dp)); dp rank r owns elements [r S, (r + 1) S). For every parameter that
// overlaps the owned range, this rank keeps a 1-D piece of the overlap: an fp32 master (whatever the model
// dtype: f16, bf16 or f32 parameters), or with master_weights = false (Apex O3) a piece in the parameter's own
// dtype. The wrapped optimizer's param groups are rewired to those pieces (same lr / weight_decay per group),
// so its state exists only for the owned shard. SGD, Adam and AdamW are elementwise, so stepping the pieces
// equals stepping the whole parameters.
//
// One step:
//   backward(loss, k)  backward of loss * S_k (the model gradients, in their dtype, carry the scale). When
//                      the loss id changes, the gradients so far are folded (as MixedPrecisionOptimizer folds
//                      them): packed into a local flat f32 buffer, unscaled by 1 / S_k with a finite check
//                      (found_inf of loss k), added to the losses folded before (unless not finite: the step
//                      is skipped anyway), and dropped from the model.
//   step()           0. which losses this step used, MAX over dp and model_parallel (the ranks take the same
//                       path below); none: nothing happens (no backward since the last step)
//                    1. one loss used (the common case): the model gradients are packed into one flat f32
//                       buffer (missing ones as zeros) and reduce-scattered (SUM, in f32) over dp, then the
//                       shard is averaged and unscaled in one pass, unscale_and_check_finite(1 / (S_k dp));
//                       several losses: the last one is folded too, the folded sum reduce-scattered and the
//                       shard averaged (1 / dp; an f32 overflow of that sum counts for every loss used)
//                    2. found_inf per loss all-reduced MAX over dp (an inf lands in one rank's shard only)
//                       and over options.model_parallel when given: every rank skips together
//                    3. grad norm: the shard's squared norm (each element owned once) summed over dp, and
//                       over model_parallel when given (options.count_in_norm leaves replicas out); clip
//                       (log_num_zeros_in_grad: the zero elements are counted the same way, after clipping)
//                    4. the wrapped optimizer steps the owned pieces (a 16-bit piece gets its gradient rounded
//                       once to its dtype, as MixedPrecisionOptimizer does without masters)
//                    5. the updated pieces are all-gathered (f32; E4M3 under fp8_all_gather) and each model
//                       parameter takes its value, rounded once to the model dtype (exact for pieces in the
//                       model dtype); the model gradients are dropped
//                    6. the scaler of every loss used this step is updated with its found_inf (also after a
//                       skip); a loss that sat the step out is not (Apex)
//   zero_grad()      drops model and piece gradients and anything folded.
// Every call except scale_loss/backward is collective over dp (every rank must call it).
//
// Difference from MixedPrecisionOptimizer + GradientReducer: the average is never rounded to the model
// dtype before unscaling (more accurate with fp16 gradients); a parameter without a gradient on every rank
// is still stepped here with a zero gradient (weight decay applies), where the unsharded optimizer skips it.
//
// state_dict() (collective): gathered, layout-free, in MixedPrecisionOptimizer's own layout — the wrapped
// optimizer's metadata with the original parameter counts, "state.<i>.step" and full-shape
// "state.<i>.<buffer>" per model parameter i, "master.<i>" (fp32) for every 16-bit parameter when there are
// masters, "amp.*" and "scaler.<k>.*" entries — so a checkpoint does not depend on dp and loads into either
// optimizer. load_state_dict() (collective) takes the same layout (any dp), checked as MixedPrecisionOptimizer
// checks it (entries, indices, shapes, dtypes) on every rank; if any rank rejects it, every rank throws and
// nothing changes. Masters and state are sliced to this rank's shard; for fp32 parameters, and for every
// parameter without masters, the piece comes from the model parameter itself (load the model weights first).
#include <cstdint>
#include <memory>
#include <vector>

#include "amp/optimizer.h"
#include "amp/process_group.h"
#include "amp/scaler.h"
#include "dist/communicator.h"
#include "io/state_dict.h"
#include "optim/optimizer.h"

namespace mixtape::dist {

struct ZeroOptions {
  double clip_grad = 0;                    // max global L2 norm of the unscaled gradients; 0 = off
  ProcessGroup* model_parallel = nullptr;  // found_inf MAX and norm SUM also over it; null = dp only
  // Per model parameter (the wrapped optimizer's order): whether it counts in the gradient norm on this rank.
  // Empty: all. Under tensor parallelism, a parameter replicated over tp (a LayerNorm weight) counts on
  // tp rank 0 only, so the SUM over model_parallel does not count it tp times.
  std::vector<bool> count_in_norm;
  // Count the zero elements of the unscaled (and clipped) gradients in StepResult::num_zeros (naive AMP's
  // log_num_zeros_in_grad): each rank counts its shard's counted pieces, summed over dp and model_parallel.
  bool log_num_zeros_in_grad = false;
  // fp32 masters for the 16-bit parameters. false (Apex O3, or O2 with master_weights false): the shard holds
  // pieces of the parameters in their own dtype, stepped directly; the optimizer state is still sharded.
  bool master_weights = true;
  // fp8_communication (Colossal-AI's option), with more than one dp rank: step 5's all-gather (and construction
  // and loading) publish the masters as E4M3 codes, one scale per parameter (448 / its amax, MAX-reduced over
  // dp first, as torchao's float8 all-gather for FSDP), so every model parameter holds the E4M3 round trip of
  // its master while the masters keep their full precision. The reduce-scatter of step 1 stays fp32, as
  // Colossal-AI's reduce_scatter_fp8 falls back to the plain one. state_dict() then holds no exact copy of
  // the fp32 parameters' masters (it takes them from the model): a checkpoint saves master_values() as the
  // weights (train/parallel_training.cpp does), and loading publishes them through E4M3 again.
  bool fp8_all_gather = false;
};

class ZeroOptimizer {
 public:
  // optimizer: built over the model parameters (not stepped yet); its groups are rewired to the shard.
  // scalers: one per loss (Apex num_losses); at least one. StaticLossScaler(1) for "no scaling".
  ZeroOptimizer(std::unique_ptr<Optimizer> optimizer, std::vector<std::unique_ptr<LossScaler>> scalers,
                Communicator dp, ZeroOptions options = {});
  ZeroOptimizer(std::unique_ptr<Optimizer> optimizer, std::unique_ptr<LossScaler> scaler, Communicator dp,
                ZeroOptions options = {});

  Tensor scale_loss(const Tensor& loss, int loss_id = 0);  // loss * S[loss_id], folding another loss id's
  void backward(const Tensor& loss, int loss_id = 0);      // backward(scale_loss(loss, loss_id))
  StepResult step();
  void zero_grad();

  Optimizer& optimizer() { return *optimizer_; }  // holds this rank's pieces: set lr on its param_groups()
  int num_losses() const { return static_cast<int>(scalers_.size()); }
  LossScaler& scaler(int loss_id = 0);
  double loss_scale(int loss_id = 0) const;
  int64_t skipped_steps() const { return skipped_steps_; }
  std::vector<Tensor> model_params() const { return model_params_; }
  int64_t shard_size() const { return shard_size_; }        // S
  int64_t total_numel() const { return total_numel_; }      // N
  const Communicator& communicator() const { return dp_; }

  StateDict state_dict() const;
  void load_state_dict(const StateDict& dict);
  // After the model's parameters were overwritten from outside (loading weights): the owned pieces take
  // the parameters' values (no communication: every rank holds the full parameters; under fp8_all_gather the
  // model parameters then take the fp8 round trip of them, as after a step: collective).
  void reload_masters();
  // The masters, whole (collective over dp): per model parameter its exact value as f32, which differs from the
  // model parameter under fp8_all_gather (a checkpoint saves these as the weights) and for 16-bit parameters.
  std::vector<Tensor> master_values() const;
  // Whether the model parameters hold the E4M3 round trip of the masters (fp8_all_gather over dp > 1).
  bool publishes_fp8() const { return options_.fp8_all_gather && dp_.size() > 1; }

 private:
  struct Piece {
    size_t param;           // index into model_params_
    int64_t param_offset;   // first element of the parameter (flattened) this piece holds
    int64_t shard_offset;   // where it sits in this rank's shard
    int64_t length;
    Tensor master;          // [length], f32 (or the parameter's dtype without masters), a leaf the wrapped
                            // optimizer updates
  };
  Tensor gather_shard(const std::vector<Tensor>& piece_values) const;  // [dp * S] f32
  // Step 5: every model parameter takes its master, rounded once to its dtype (after the fp8 round trip under
  // fp8_all_gather); the same values on every rank.
  void publish_masters();
  bool separate_master(size_t param) const;  // "master.<i>" in the state dict: an f32 master of a 16-bit one
  void check_loss_id(int loss_id, const char* what) const;
  Tensor take_grads();         // the model gradients packed into a flat f32 [dp * S]; dropped from the model
  void fold_pending_grads();   // take_grads() of the pending loss, unscaled and checked, added to folded_
  void check_known_scale(const Tensor& param) const;  // no gradient unless a loss is pending

  std::unique_ptr<Optimizer> optimizer_;
  std::vector<std::unique_ptr<LossScaler>> scalers_;
  Communicator dp_;
  ZeroOptions options_;
  std::vector<Tensor> model_params_;
  std::vector<int64_t> offsets_;        // of each model parameter in the flat space
  std::vector<int64_t> group_counts_;   // original parameters per group (for state_dict)
  std::vector<Piece> pieces_;           // in the wrapped optimizer's parameter order
  int64_t total_numel_ = 0, shard_size_ = 0;
  int64_t skipped_steps_ = 0;
  std::vector<bool> found_inf_;  // per loss id, found while folding since the last step (this rank)
  std::vector<bool> used_;       // per loss id: went through scale_loss()/backward() since the last step
  int pending_loss_ = -1;        // loss id whose scale the model gradients carry; -1: none
  Tensor folded_;                // f32 [dp * S]: the unscaled gradients of the losses folded so far; or none
};

}  // namespace mixtape::dist
