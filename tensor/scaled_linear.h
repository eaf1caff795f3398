#pragma once
// fp8 and block-scaled Linear layers: the three GEMMs of a Linear (forward x·Wᵀ, input gradient g·W, weight
// gradient gᵀ·x) on quantized operands (tensor/quantize.h), as Transformer Engine, torchao and DeepSeek-V3
// run them, while everything else runs as the surrounding bf16 autocast says.
//
// While a LowPrecisionScope is open on a thread, linear() on a weight the context covers runs here: its
// operands are quantized per the recipe, multiplied with fp32 sums, and the result rounded to bf16 (the bias
// joins in fp32 first). Its backward quantizes the gradient and the operands again, each along the dim its
// GEMM sums over, and returns the input gradient in the input's dtype and the weight gradient in the weight's.
//
//   GEMM     a [rows, K]           b [cols, K]           K
//   forward  x      (activation)   W   (weight)          in_features
//   dgrad    g      (gradient)     Wᵀ  (weight)          out_features
//   wgrad    gᵀ     (gradient)     xᵀ  (activation)      tokens
//
// The context keeps what the recipes remember between steps: the delayed-scaling amax history and scale
// of each covered Linear's three tensors, and counts of what quantization saturated and flushed to zero per
// tensor kind (for the precision study). Only training forwards (grad mode on) and backwards add to them: an
// evaluation quantizes with the scales in use and changes nothing. Layering: it lives in tensor/ because linear() consults it; amp/
// builds it from a precision mode (amp/booster.h).
#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tensor/quantize.h"
#include "tensor/tensor.h"

namespace mixtape {

enum class ScalingRecipe : uint8_t {
  CurrentTensorwise,  // fp8: one scale per tensor from its amax now (Colossal-AI linear_fp8, torchao tensorwise)
  DelayedTensorwise,  // fp8_delayed: one scale per tensor from an amax history (TE DelayedScaling)
  Rowwise,            // fp8_rowwise: one scale per row of each operand along K (torchao rowwise)
  Block,              // fp8_block: 1 x 128 tiles of activations and gradients, 128 x 128 weight blocks (DeepSeek-V3)
  Mx,                 // mxfp8: blocks of 32 along K with E8M0 scales (OCP MX, TE MXFP8BlockScaling)
  Nvfp4,              // nvfp4: E2M1 in blocks of 16 with E4M3 scales under an fp32 tensor scale (NVIDIA)
};

enum class AmaxComputeAlgo : uint8_t { Max, MostRecent };  // TE's "max" and "most_recent"

struct LowPrecisionRecipe {
  ScalingRecipe scaling = ScalingRecipe::CurrentTensorwise;
  DType forward_format = DType::F8E4M3;   // activations and weights
  DType gradient_format = DType::F8E5M2;  // gradients ("hybrid"); F8E4M3 for "e4m3"; F4E2M1 for nvfp4
  // Delayed scaling (TE DelayedScaling): scale = format_max / amax / 2^margin, amax over the history.
  int64_t amax_history_len = 1024;
  AmaxComputeAlgo amax_compute_algo = AmaxComputeAlgo::Max;
  int64_t margin = 0;
  bool round_scales_to_power_of_2 = false;  // tensorwise and rowwise fp32 scales (torchao's option)
  // Block sizes: the activation / gradient tile along K and the square weight block.
  int64_t block_size = 128;         // fp8_block: 1 x 128 tiles, 128 x 128 weight blocks
  int64_t mx_block_size = 32;       // mxfp8: 1 x 32 along K for every operand
  BlockScale mx_scale_rounding = BlockScale::E8M0Floor;
  int64_t nvfp4_block_size = 16;    // nvfp4: 1 x 16 tiles, 16 x 16 weight blocks
  bool stochastic_rounding = true;  // nvfp4: the gradients round stochastically
  bool random_hadamard_transform = true;  // nvfp4: 16 x 16 random Hadamard transform of the wgrad operands
  uint64_t seed = 0;                // stochastic rounding and the Hadamard signs
  int accumulator_bits = 0;         // scaled_matmul's narrow accumulator model (0: fp32)
};

enum class TensorKind : uint8_t { Activation, Weight, Gradient, Count };
const char* tensor_kind_name(TensorKind kind);  // "activation", "weight", "gradient"

// The three GEMMs of a Linear (the table above).
enum class Gemm : uint8_t { Forward, Dgrad, Wgrad };

// An in-place MAX of each value over a group of processes (every process calls it in the same order with
// the same length).
using AmaxReduction = std::function<void(std::span<float>)>;

// What quantization did to the values of one tensor kind: counts over every quantization so far.
struct QuantizationCounts {
  int64_t values = 0, saturated = 0, flushed = 0;
};

// TE's per-tensor delayed-scaling state: the amaxes of the last amax_history_len steps and the scale in use.
struct DelayedScaling {
  std::vector<float> history;  // history[0] is the step in progress (max over its quantizations)
  float scale = 1;             // the encode scale in use (TE starts at 1)
};

// The delayed-scaling state of one covered Linear: its input, weight and output-gradient tensors.
struct LinearScalingState {
  std::array<DelayedScaling, 3> tensors;  // by TensorKind
};

class LowPrecisionContext {
 public:
  explicit LowPrecisionContext(LowPrecisionRecipe recipe);  // validates (Error naming the field)

  // Marks a Linear weight as one to run in low precision; `name` is its parameter name (for the state dict).
  void cover(const Tensor& weight, const std::string& name);
  bool covers(const Tensor& weight) const { return states_.count(weight.impl_ptr().get()) != 0; }
  const LowPrecisionRecipe& recipe() const { return recipe_; }

  // Delayed scaling: ends the step: each tensor's scale is recomputed from its history (TE's
  // _default_sf_compute: kept where the amax is 0 or not finite), then the history moves on one step.
  void end_step();

  // Several processes hold parts of the covered tensors (data or tensor parallel): `reduce_max` replaces each
  // value of its argument by its MAX over them, in place (every process calls it in the same order). Then
  // current tensorwise scales come from the reduced amax of each quantization, and delayed scaling reduces each
  // step's amaxes before it updates its scales, so every rank uses the scales one process would. An evaluation
  // forward (grad mode off) reduces with `reduce_max_in_eval` instead: over the processes that split one batch
  // (tensor parallel), not over data-parallel replicas, which evaluate different batches (and different
  // numbers of them) as one process evaluates each batch by itself. Of the other recipes only NVFP4 uses it,
  // for its fp32 tensor scale (its block scales are per block, like every block-scaled recipe's).
  void set_amax_reduction(AmaxReduction reduce_max, AmaxReduction reduce_max_in_eval);

  // Processes split K of one of a covered Linear's GEMMs, each holding a contiguous part of every row (a
  // row-parallel layer's forward, a column-parallel layer's input gradient over the tensor-parallel ranks; every
  // weight gradient over the data-parallel replicas, whose K is the tokens): fp8_rowwise's per-row amaxes are
  // reduced (MAX) over them, so every rank scales a row as one process does. The recipes with blocks along K
  // need nothing: a block lies within one process wherever the split is a multiple of the block size.
  void set_k_split(const Tensor& weight, Gemm gemm, AmaxReduction reduce_max);

  const std::array<QuantizationCounts, 3>& counts() const { return counts_; }
  // The delayed scale history of every covered tensor, by "weight name.kind": {scale, amax history}.
  std::map<std::string, DelayedScaling> scaling_state() const;
  // Replaces the state with `state` (every covered tensor's entry, with this recipe's history length and a
  // positive finite scale; Error naming the first that is not, and then nothing changes).
  void load_scaling_state(const std::map<std::string, DelayedScaling>& state);
  // The steps ended so far (end_step): with the weight's name and the quantization's place in its step they
  // pick each stochastic rounding's random stream, so a stream depends on neither the layout nor the stage, and
  // a resumed run continues it.
  uint64_t steps() const { return steps_; }
  void set_steps(uint64_t steps) { steps_ = steps; }

  // Used by scaled_linear: the options to quantize a tensor of `kind` (of the Linear of `weight`) as the
  // operand of the GEMM `gemm` summing over its columns, and the bookkeeping after it. The scaling depends on
  // the kind only (tiles run along K whichever dim of the layer K is, and weight blocks are square); the GEMM
  // picks the processes a row's amax is reduced over (set_k_split). `training`: false for an evaluation
  // forward (see set_amax_reduction).
  QuantizeOptions options(TensorKind kind, const Tensor& weight, Gemm gemm, bool training = true);
  void record(TensorKind kind, const Tensor& weight, const GemmOperand& q);

 private:
  LowPrecisionRecipe recipe_;
  struct Covered {
    std::string name;
    LinearScalingState state;
    Tensor weight;              // held, so that its address (the key) cannot be reused by another tensor
    uint64_t random_key = 0;    // the stochastic-rounding key of its gradients (recipe seed and name)
    uint64_t quantized_this_step = 0;  // the stream of its next stochastically rounded quantization
    std::array<AmaxReduction, 3> k_split;  // by Gemm: set_k_split
  };
  std::map<const void*, Covered> states_;
  std::array<QuantizationCounts, 3> counts_{};
  uint64_t steps_ = 0;
  AmaxReduction reduce_max_, reduce_max_in_eval_;  // see set_amax_reduction
};

// The thread-local context linear() consults (null: none). RAII; nests.
class LowPrecisionScope {
 public:
  explicit LowPrecisionScope(std::shared_ptr<LowPrecisionContext> context);
  ~LowPrecisionScope();
  LowPrecisionScope(const LowPrecisionScope&) = delete;
  LowPrecisionScope& operator=(const LowPrecisionScope&) = delete;

 private:
  std::shared_ptr<LowPrecisionContext> previous_;
};
const std::shared_ptr<LowPrecisionContext>& active_low_precision_context();

// x [..., K] @ weight[N, K]ᵀ + bias[N] with the context's recipe (see above): bf16 out, differentiable.
// linear() calls it for covered weights inside a scope; callable directly.
Tensor scaled_linear(const Tensor& x, const Tensor& weight, const Tensor& bias,
                     const std::shared_ptr<LowPrecisionContext>& context);

}  // namespace mixtape
