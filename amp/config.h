#pragma once
// AmpConfig: a precision mode (a row of amp/precision_mode.h) with its options and their defaults, checked at
// construction.
//
//   mixed_precision  what it is                                            options (defaults)
//   "fp32"           plain fp32                                            —
//   "tf32"           fp32 storage, matmul inputs rounded to tf32           —
//   "fp16"           PyTorch AMP: fp16 autocast + GradScaler, fp32 params  init_scale 2^16, growth_factor 2,
//                                                                          backoff_factor 0.5,
//                                                                          growth_interval 2000, enabled true
//   "bf16"           PyTorch AMP: bf16 autocast, fp32 params               the same, enabled false (no scaler)
//   "fp16_apex"      NVIDIA Apex amp, opt_level O0..O3 (table below)       Apex's properties
//   "fp16_naive"     Colossal-AI / InternEvo naive AMP: the whole model    clip_grad 0, log_num_zeros_in_grad
//   "bf16_naive"     in fp16/bf16, fp32 master weights, the hysteresis     false, initial_scale 2^32,
//                    loss scaler (DynamicLossScaler)                       min_scale 1, growth_factor 2,
//                                                                          backoff_factor 0.5,
//                                                                          growth_interval 1000,
//                                                                          hysteresis 2, max_scale 2^32,
//                                                                          verbose false,
//                                                                          output_to_fp32 true,
//                                                                          accumulate_allreduce_grads_in_fp32
//                                                                          false, loss_scaler "dynamic"
//
// Every mode also takes lr_schedule_on_skip, what a skipped step (a non-finite gradient, which every mode
// skips) does to the learning-rate schedule: "advance" (the schedule follows the iteration, as in plain
// PyTorch and Colossal-AI training loops; the default of fp32, tf32, fp16, bf16 and fp16_apex) or "hold"
// (it follows the applied updates, as Megatron-LM's `if update_successful:` and InternEvo's
// `if success and self._lr_scheduler is not None`; the default of fp16_naive and bf16_naive). With "hold"
// the step after k skipped ones uses the schedule's position (iterations - k). Every mode also takes
// fp8_communication (default false): across processes, gradients are averaged and ZeRO's parameters gathered
// through fp8 payloads (dist/fp8_collectives.h).
//
// The naive modes' loss_scaler: "dynamic" (the hysteresis scaler above; InternEvo scales bf16 too) or
// "none" (a loss scale of 1 that never backs off: Colossal-AI's bf16 mixin and Megatron-LM's bf16). "none"
// is refused for fp16_naive, as Megatron-LM refuses it ("fp16 expects a grad scaler"): fp16 gradients
// underflow without a scale. The scaler options are validated and written whichever is chosen.
//
// Apex's property table (apex/amp/frontend.py), each property overridable as in amp.initialize():
//   opt_level  cast_model_type  patch_torch_functions  keep_batchnorm_fp32  master_weights  loss_scale
//   O0         fp32             false                  —                    false           1.0
//   O1         —                true                   —                    —               "dynamic"
//   O2         fp16             false                  true                 true            "dynamic"
//   O3         fp16             false                  false                false           1.0
// plus cast_model_outputs (—: fp32 when the model is cast), num_losses 1 (at most 1024), verbosity 1,
// min_loss_scale —, max_loss_scale 2^24. As in amp.initialize, a JSON null for a property is no override (the
// opt level's value stays). Apex refuses, and so do we: cast_model_type other than fp32, keep_batchnorm_fp32
// or master_weights with O1; patch_torch_functions outside O1. We also refuse: cast_model_type other than
// fp32 with O0 (O0 is fp32), and min_loss_scale / max_loss_scale with a static loss_scale (they bound dynamic
// scaling only; Apex ignores them). master_weights on a model left fp32 (O0, or O2 / O3 with cast_model_type
// false) is accepted, as by Apex, and keeps nothing: the parameters are fp32 already. cast_model_type false
// means "do not cast the model" (Apex's False); "fp32" casts the model, its floating inputs and outputs to
// fp32 (Apex's torch.float32, O0's and allowed with O1). keep_batchnorm_fp32 keeps BatchNorm modules in fp32
// as Apex's convert_network does, and BatchNorm only: mixtape has none, so under O2 the norm layers
// (LayerNorm, RMSNorm) are cast with the model, as Apex casts LayerNorm. Our own keep_norms_fp32 (default
// false) keeps LayerNorm and RMSNorm parameters in fp32 and runs them in fp32 in a cast model; it is refused
// with O1 (nothing is cast) and, like master_weights, does nothing on a model left fp32 (O0, or
// cast_model_type false or "fp32"); a JSON null for it is an error (it is no Apex property to leave to the
// opt level). patch_torch_functions is fp16 autocast. verbosity: 0 silent; 1 (Apex's
// default) prints Apex's "Gradient overflow.  Skipping step, loss scaler K reducing loss scale to S" on every
// skipped step; 2 also prints each growth of a dynamic scale (our own level: Apex's 2 prints its casts).
// loss_scale may be a number, "dynamic", or a numeric string ("128.0": Apex applies float() to it).
//
// Gradient accumulation over several backward calls (micro-batches) of one step: the model's 16-bit
// parameters get fp32 gradients (Tensor::set_grad_dtype) with Apex's master weights, which is what Apex's
// default (each backward's gradients unscaled into the fp32 master gradients) amounts to, and in the naive
// modes with accumulate_allreduce_grads_in_fp32 (Megatron-LM's option; its default, false, keeps
// Colossal-AI's and InternEvo's gradients in the parameters' dtype). The data-parallel reducer then averages
// fp32 gradients. See docs/amp.md.
//
// A static loss scale (O0, O3, a numeric loss_scale) skips a step whose gradients are not finite, as every
// scale does here (amp/optimizer.h); Apex steps anyway then (it only checks for overflow when dynamic).
//
// Every option that sets a loss scale (init_scale; loss_scale, min_loss_scale, max_loss_scale; initial_scale,
// min_scale, max_scale) must be a usable scale by itself, whether or not it is in use: at least
// kMinLossScale = 2^-128 + 2^-149 (the smallest float whose fp32 reciprocal is finite) and at most FLT_MAX
// once rounded to fp32 (amp/scaler.h): the loss is multiplied by the scale and the gradients by 1/scale in
// fp32. A scale read from a checkpoint is held to the same bounds (LossScaler::load_state_dict).
//
// Text forms: parse("fp16_apex:O2") (a mode, with the opt level after a colon), and JSON objects
//   {"mixed_precision": "fp16_naive", "initial_scale": 65536, "hysteresis": 3}
// whose other keys must be options of that mode (dtypes are "fp16"/"bf16"/"fp32", or "float16"/"bfloat16"/
// "float32"). Every unknown mode, unknown key and invalid value is an Error naming it; options are validated
// whether or not they are in use (a disabled GradScaler's growth_factor too).
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "amp/precision_mode.h"
#include "amp/scaler.h"
#include "tensor/dtype.h"

namespace mixtape {

struct ApexProperties {
  std::string opt_level = "O1";
  std::optional<DType> cast_model_type;       // nullopt: the model is not cast (O1, or false at any level)
  bool patch_torch_functions = true;          // fp16 autocast around the ops
  std::optional<bool> keep_batchnorm_fp32;    // nullopt: Apex's None
  bool master_weights = false;                // O1's None counts as false: its params are fp32 already
  std::optional<double> loss_scale;           // nullopt: "dynamic"
  std::optional<DType> cast_model_outputs;    // nullopt: fp32 when the model is cast
  int64_t num_losses = 1;
  int64_t verbosity = 1;                      // 0, 1 or 2 (see above)
  std::optional<double> min_loss_scale;       // dynamic scaling floor; nullopt: none
  double max_loss_scale = kDefaultMaxLossScale;
  bool keep_norms_fp32 = false;               // ours: LayerNorm / RMSNorm stay fp32 in a cast model

  static constexpr double kDefaultMaxLossScale = 16777216.0;  // 2^24
  static constexpr int64_t kMaxNumLosses = 1024;              // one scaler (and scale) per loss

  // Apex's table, with `cast_dtype` (the mode's 16-bit dtype) as the model dtype of O2 and O3; Error if not
  // O0..O3.
  static ApexProperties for_opt_level(const std::string& opt_level, DType cast_dtype = DType::F16);
  // Apex's dynamic LossScaler for these bounds (loss_scale "dynamic"): starts at 2^16 clamped to
  // max_loss_scale, x2 after 2000 clean steps, halved on each overflow (apex_dynamic_scaler).
  DynamicLossScaler dynamic_scaler() const;
};

// The naive modes' loss scaler (see above).
enum class NaiveLossScaler : uint8_t {
  Dynamic,  // DynamicLossScaler(scaler) with hysteresis
  None,     // StaticLossScaler(1): bf16_naive only
};

// What a skipped step does to the learning-rate schedule (lr_schedule_on_skip, see above).
enum class LrScheduleOnSkip : uint8_t {
  Advance,  // the schedule's position is the iteration
  Hold,     // the schedule's position is the number of applied updates (iterations - skipped steps)
};

struct NaiveAmpOptions {
  double clip_grad = 0;                       // max grad norm; 0 = the trainer's own clipping
  bool log_num_zeros_in_grad = false;
  DynamicLossScalerOptions scaler;            // initial_scale, min_scale, max_scale, growth/backoff, hysteresis
  bool verbose = false;                       // print each scale growth and backoff (Colossal-AI's lines)
  bool output_to_fp32 = true;
  bool accumulate_allreduce_grads_in_fp32 = false;  // Megatron-LM's: fp32 gradients for the 16-bit parameters
  NaiveLossScaler loss_scaler = NaiveLossScaler::Dynamic;
};

// The fp8 / block-scaled modes' GEMM formats: Transformer Engine's Format.HYBRID (E4M3 forward, E5M2
// gradients) and Format.E4M3 (E4M3 everywhere).
enum class Fp8Format : uint8_t { Hybrid, E4M3 };

// The options of fp8, fp8_delayed, fp8_rowwise, fp8_block, mxfp8 and nvfp4 (docs/amp.md has each with its
// source). Every option is validated in every mode of the family; each acts where its recipe reads it.
struct LowPrecisionOptions {
  std::optional<Fp8Format> fp8_format;  // nullopt (JSON null): the mode's (hybrid for fp8, fp8_delayed;
                                        // e4m3 for the rest); refused for nvfp4, whose elements are E2M1
  int64_t amax_history_len = 1024;      // fp8_delayed (TE DelayedScaling)
  AmaxComputeAlgo amax_compute_algo = AmaxComputeAlgo::Max;
  int64_t margin = 0;
  // fp8 and fp8_rowwise (torchao's round_scales_to_power_of_2): nullopt (JSON null): the mode's, true for
  // fp8_rowwise as torchao's rowwise recipe sets it, false for fp8 (its tensorwise default).
  std::optional<bool> round_scales_to_power_of_2;
  int64_t block_size = 128;             // fp8_block: 1 x block_size tiles, block_size^2 weight blocks
  int64_t mx_block_size = 32;           // mxfp8
  BlockScale mx_scale_rounding = BlockScale::E8M0Floor;  // "floor" (OCP MX) or "ceil" (NVIDIA's MXFP8)
  int64_t nvfp4_block_size = 16;        // nvfp4: 1 x 16 tiles, 16 x 16 weight blocks
  bool stochastic_rounding = true;      // nvfp4's gradients
  bool random_hadamard_transform = true;  // nvfp4's weight-gradient GEMM
  // Linear modules kept in bf16, by module path or its last name ("lm_head" matches "lm_head",
  // "c_proj" every "...c_proj"). nullopt: {"lm_head"}, which a model with tied embeddings simply lacks;
  // an entry given explicitly must match a Linear of the boosted model.
  std::optional<std::vector<std::string>> exclude;
  // Ours: the GEMMs' running sums rounded to this many mantissa bits every 32 products along K (0: fp32), to
  // study a tensor core's narrow fp8 accumulator (scaled_matmul in tensor/quantize.h).
  int64_t accumulator_bits = 0;
};

struct AmpConfig {
  PrecisionMode mode = PrecisionMode::Fp32;  // "mixed_precision" in JSON
  GradScalerOptions grad_scaler;  // "fp16" / "bf16" (bf16: enabled = false unless set)
  ApexProperties apex;            // "fp16_apex"
  NaiveAmpOptions naive;          // "fp16_naive" / "bf16_naive"
  LowPrecisionOptions low_precision;  // "fp8", "fp8_delayed", "fp8_rowwise", "fp8_block", "mxfp8", "nvfp4"
  // "lr_schedule_on_skip", every mode; nullopt: the family's default (schedule_on_skip()).
  std::optional<LrScheduleOnSkip> lr_schedule_on_skip;
  // "fp8_communication", every mode (Colossal-AI's Booster option): the data-parallel gradient all-reduce carries
  // E5M2 payloads with per-chunk scales, summed in fp32 (dist/fp8_collectives.h), and ZeRO-1's parameter
  // all-gather E4M3 ones with a scale per parameter (dist/zero.h). Nothing changes with one dp rank.
  bool fp8_communication = false;

  static const std::vector<std::string>& modes();  // every mode name (precision_mode_names())
  // "fp32", "bf16", "fp16_apex:O2", ...: the mode's defaults. Validated.
  static AmpConfig parse(std::string_view mode);
  // A JSON object as above. `mode`, when given (train_gpt --precision), is the mode if the object has no
  // "mixed_precision"; if it has one, they must agree (Error otherwise). Validated.
  static AmpConfig from_json(std::string_view text, std::optional<std::string_view> mode = std::nullopt);

  void validate() const;         // Error naming the mode, the option and the allowed values
  std::string to_json() const;   // every option of the mode; from_json(to_json()) gives the same config
  std::string name() const;      // "bf16", "fp16_apex:O2"
  // The options whose values differ from `other`'s, as "key value (<other_label> value)" joined by ", ",
  // e.g. "hysteresis 3 (the checkpoint's 2)", except those that only change what is printed (verbose,
  // verbosity, log_num_zeros_in_grad): what a resumed run may not change. Empty when the two train alike.
  std::string training_differences(const AmpConfig& other,
                                   std::string_view other_label = "the other's") const;

  const PrecisionModeRow& row() const { return mode_row(mode); }
  ModeFamily family() const { return row().family; }

  // What the mode does, for Booster and the logs.
  std::optional<DType> autocast_dtype() const;  // F16/BF16 when ops are autocast (fp16, bf16, apex O1)
  std::optional<DType> model_dtype() const;     // the dtype parameters are cast to (naive, apex O2/O3, O0)
  // Whether boost() gives the 16-bit parameters fp32 gradients (see above).
  bool fp32_grads() const;
  bool is_naive() const { return family() == ModeFamily::Naive; }
  bool quantizes_gemms() const { return family() == ModeFamily::LowPrecision; }
  // The fp8 / block-scaled modes: the GEMM recipe from the row and the options (Error for other modes), and
  // the Linear modules left in bf16.
  LowPrecisionRecipe low_precision_recipe() const;
  Fp8Format fp8_format() const;  // low_precision.fp8_format or the mode's default
  bool round_scales_to_power_of_2() const;  // low_precision's or the mode's default
  std::vector<std::string> excluded_modules() const;
  // lr_schedule_on_skip, or the family's default when unset: Hold for the naive modes, Advance otherwise.
  LrScheduleOnSkip schedule_on_skip() const;
  // The learning-rate schedule's position at iteration `step` (0-based) after `skipped_steps` skipped steps
  // before it: `step` with Advance, step - skipped_steps (the applied updates so far) with Hold.
  int64_t schedule_position(int64_t step, int64_t skipped_steps) const;
};

}  // namespace mixtape
