#pragma once
// ZeRO stage 1 (DeepSpeed; Megatron-LM's DistributedOptimizer): the mixed-precision optimizer with its fp32
// master weights and optimizer state sharded over the data-parallel group. Same interface as
// MixedPrecisionOptimizer (amp/optimizer.h) for one loss: scale_loss/backward/step/zero_grad/state_dict.
//
// Layout: the wrapped optimizer's parameters, in group order, are flattened into one space of N elements,
// padded to dp * S (S = ceil(N / dp)); dp rank r owns elements [r S, (r + 1) S). For every parameter that
// overlaps the owned range, this rank keeps a 1-D fp32 master of the overlap (f32 whatever the model dtype;
// all parameters must compute in f32: f16, bf16 or f32), and the wrapped optimizer's param groups are
// rewired to those pieces (same lr / weight_decay per group), so its state exists only for the owned shard.
// SGD, Adam and AdamW are elementwise, so stepping the pieces equals stepping the whole parameters.
//
// One step:
//   backward(loss)   backward of loss * S (the model gradients, in the model dtype, carry the scale)
//   step()           1. the model gradients are packed into one flat f32 buffer (missing ones as zeros) and
//                       reduce-scattered (SUM, in f32) over dp: this rank gets its shard of the sum
//                    2. unscale_and_check_finite(shard, 1 / (S * dp)): averaged and unscaled in one pass
//                    3. found_inf all-reduced MAX over dp (an inf lands in one rank's shard only) and over
//                       options.model_parallel when given: every rank skips together
//                    4. grad norm: the shard's squared norm (each element owned once) summed over dp, and
//                       over model_parallel when given (options.count_in_norm leaves replicas out); clip
//                       (log_num_zeros_in_grad: the zero elements are counted the same way, after clipping)
//                    5. the wrapped optimizer steps the owned fp32 pieces
//                    6. the updated pieces are all-gathered (f32) and each model parameter takes its value,
//                       rounded once to the model dtype; the model gradients are dropped
//   zero_grad()      drops model and master gradients.
// Every call except scale_loss/backward is collective over dp (every rank must call it).
//
// Difference from MixedPrecisionOptimizer + GradientReducer: the average is never rounded to the model
// dtype before unscaling (more accurate with fp16 gradients); a parameter without a gradient on every rank
// is still stepped here with a zero gradient (weight decay applies), where the unsharded optimizer skips it.
//
// state_dict() (collective): gathered, layout-free, in MixedPrecisionOptimizer's own layout — the wrapped
// optimizer's metadata with the original parameter counts, "state.<i>.step" and full-shape
// "state.<i>.<buffer>" per model parameter i, "master.<i>" (fp32) for every 16-bit parameter, "amp.*" and
// "scaler.0.*" entries — so a checkpoint does not depend on dp and loads into either optimizer.
// load_state_dict() takes the same layout (any dp): masters and state are sliced to this rank's shard; for
// fp32 parameters the master comes from the model parameter itself (load the model weights first).
#include <cstdint>
#include <memory>
#include <vector>

#include "amp/optimizer.h"
#include "amp/process_group.h"
#include "amp/scaler.h"
#include "dist/communicator.h"
#include "nn/state_dict.h"
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
};

class ZeroOptimizer {
 public:
  // optimizer: built over the model parameters (not stepped yet); its groups are rewired to the shard.
  ZeroOptimizer(std::unique_ptr<Optimizer> optimizer, std::unique_ptr<LossScaler> scaler, Communicator dp,
                ZeroOptions options = {});

  Tensor scale_loss(const Tensor& loss);  // loss * S
  void backward(const Tensor& loss);      // backward(scale_loss(loss))
  StepResult step();
  void zero_grad();

  Optimizer& optimizer() { return *optimizer_; }  // holds this rank's pieces: set lr on its param_groups()
  LossScaler& scaler() { return *scaler_; }
  double loss_scale() const { return scaler_->scale(); }
  int64_t skipped_steps() const { return skipped_steps_; }
  std::vector<Tensor> model_params() const { return model_params_; }
  int64_t shard_size() const { return shard_size_; }        // S
  int64_t total_numel() const { return total_numel_; }      // N
  const Communicator& communicator() const { return dp_; }

  StateDict state_dict() const;
  void load_state_dict(const StateDict& dict);
  // After the model's parameters were overwritten from outside (loading weights): the owned fp32 pieces take
  // the parameters' values (no communication: every rank holds the full parameters).
  void reload_masters();

 private:
  struct Piece {
    size_t param;           // index into model_params_
    int64_t param_offset;   // first element of the parameter (flattened) this piece holds
    int64_t shard_offset;   // where it sits in this rank's shard
    int64_t length;
    Tensor master;          // f32 [length], a leaf the wrapped optimizer updates
  };
  Tensor gather_shard(const std::vector<Tensor>& piece_values) const;  // [dp * S] f32

  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<LossScaler> scaler_;
  Communicator dp_;
  ZeroOptions options_;
  std::vector<Tensor> model_params_;
  std::vector<int64_t> offsets_;        // of each model parameter in the flat space
  std::vector<int64_t> group_counts_;   // original parameters per group (for state_dict)
  std::vector<Piece> pieces_;           // in the wrapped optimizer's parameter order
  int64_t total_numel_ = 0, shard_size_ = 0;
  int64_t skipped_steps_ = 0;
};

}  // namespace mixtape::dist
