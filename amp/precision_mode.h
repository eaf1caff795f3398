#pragma once
// The precision modes, as one table: every name users type (train_gpt --precision, AmpConfig::parse, the
// "mixed_precision" key of a JSON config) is a row here, and everything that lists or tells modes apart —
// AmpConfig's parsing, validation and to_json, Booster's composition, train_gpt --help, precision_study and
// the benchmarks' mode lists — reads this table.
//
// A mode of an existing family is one row: the family's behaviour (its options, its scaler, how Booster
// casts the model) is written once, in the `switch (family)` statements of amp/config.cpp and
// amp/booster.cpp, which have no default case so that -Wswitch names every switch a new family must join.
// The static_assert below makes this table fail to build until a new PrecisionMode has its row.
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tensor/autocast_tables.h"
#include "tensor/dtype.h"
#include "tensor/scaled_linear.h"

namespace mixtape {

enum class PrecisionMode : uint8_t {
  Fp32, Tf32, Fp16, Bf16, Fp16Apex, Fp16Naive, Bf16Naive,
  Fp8, Fp8Delayed, Fp8Rowwise, Fp8Block, Mxfp8, Nvfp4,
  Count
};

// The framework whose behaviour a mode reproduces: its options, its loss scaler and what it casts.
enum class ModeFamily : uint8_t {
  Plain,       // fp32 arithmetic (tf32: matmul inputs rounded to tf32); nothing cast, no loss scaling
  PytorchAmp,  // torch.autocast + torch.amp.GradScaler; fp32 parameters
  Apex,        // NVIDIA Apex amp.initialize, opt levels O0..O3 (ApexProperties in amp/config.h)
  Naive,       // Colossal-AI / InternEvo naive AMP: the whole model in 16 bits, fp32 masters, hysteresis
  LowPrecision,  // fp8 and block-scaled GEMMs (Transformer Engine, torchao, DeepSeek-V3, MX, NVFP4): the
                 // Linear layers' GEMMs on quantized operands (tensor/scaled_linear.h) inside bf16 autocast;
                 // fp32 parameters, no loss scaling
};

// Where the mode's 16-bit dtype is used.
enum class ModeCast : uint8_t {
  None,        // nothing is cast (fp32, tf32)
  Autocast,    // ops run under Autocast(compute_dtype); parameters stay fp32
  WholeModel,  // the parameters are cast to compute_dtype (NaiveAMPModel)
  ByOptLevel,  // Apex: O1 autocasts, O2/O3 cast the model, O0 casts it to fp32 (ApexProperties)
};

enum class MasterWeights : uint8_t {
  Fp32,        // fp32 master copies of every 16-bit parameter (none where the parameters are fp32)
  ByOptLevel,  // Apex's master_weights property (O2: true; O3: false, the fp16 parameters are stepped)
};

enum class ScalerKind : uint8_t {
  Static,       // a loss scale of 1 (nothing scaled; the step is still skipped on a non-finite gradient)
  GradScaler,   // PyTorch's GradScaler (its `enabled` default is the row's grad_scaler_enabled)
  Apex,         // Apex's scaler: dynamic (2^16, x2 after 2000 clean steps) or a static loss_scale
  Hysteresis,   // DynamicLossScaler with hysteresis (Megatron-LM / Colossal-AI); the naive loss_scaler
                // "none" gives a loss scale of 1 instead
};

// The options every mode accepts in a JSON config, besides "mixed_precision": what the training loop does
// around the mode (every mode skips a step whose gradients are not finite) and how its processes talk.
inline constexpr std::array<std::string_view, 2> kCommonAmpKeys{"lr_schedule_on_skip", "fp8_communication"};
// The options each family accepts in a JSON config, besides "mixed_precision" and kCommonAmpKeys.
inline constexpr std::array<std::string_view, 5> kGradScalerKeys{"init_scale", "growth_factor", "backoff_factor",
                                                                 "growth_interval", "enabled"};
inline constexpr std::array<std::string_view, 12> kApexKeys{
    "opt_level",   "cast_model_type",    "patch_torch_functions", "keep_batchnorm_fp32",
    "master_weights", "loss_scale",      "cast_model_outputs",    "num_losses",
    "verbosity",   "min_loss_scale",     "max_loss_scale",        "keep_norms_fp32"};
inline constexpr std::array<std::string_view, 13> kNaiveKeys{
    "clip_grad", "log_num_zeros_in_grad", "initial_scale", "min_scale", "growth_factor",
    "backoff_factor", "growth_interval", "hysteresis", "max_scale", "verbose", "output_to_fp32",
    "accumulate_allreduce_grads_in_fp32", "loss_scaler"};

// The fp8 / block-scaled family's options (amp/config.h's LowPrecisionOptions).
inline constexpr std::array<std::string_view, 13> kLowPrecisionKeys{
    "fp8_format",     "amax_history_len", "amax_compute_algo", "margin",
    "round_scales_to_power_of_2", "block_size", "mx_block_size", "mx_scale_rounding",
    "nvfp4_block_size", "stochastic_rounding", "random_hadamard_transform", "exclude",
    "accumulator_bits"};

struct PrecisionModeRow {
  PrecisionMode mode;
  std::string_view name;        // what users type; Apex's opt level follows a colon ("fp16_apex:O2")
  ModeFamily family;
  DType compute_dtype;          // the 16-bit dtype the mode computes in (F32 for the plain modes)
  ModeCast cast;
  MasterWeights master_weights;
  ScalerKind scaler;
  bool grad_scaler_enabled;     // GradScaler's `enabled` default (PyTorch: on for fp16, off for bf16); false
                                // for the other scalers
  bool tf32_matmuls;            // set_allow_tf32(true), process-wide, when the model is boosted
  std::span<const std::string_view> option_keys;
  // The framework's autocast lists its forward is cast by (tensor/autocast_tables.h); Apex's applies at O1
  // only. nullptr: the family autocasts nothing (plain: no cast; naive: the whole model is cast).
  const AutocastPolicyTable* autocast_policy;
  // The recipe of the Linear GEMMs (tensor/scaled_linear.h) for the LowPrecision family; nullopt elsewhere.
  std::optional<ScalingRecipe> gemm_scaling;
};

// THE precision-mode table, in PrecisionMode order (checked at compile time below).
inline constexpr std::array<PrecisionModeRow, static_cast<size_t>(PrecisionMode::Count)> kPrecisionModes{{
    // mode                 name          family                  dtype       cast
    //   master weights            scaler                  GradScaler on  tf32   option keys
    //   autocast policy           GEMM scaling (the LowPrecision family)
    {PrecisionMode::Fp32,      "fp32",       ModeFamily::Plain,      DType::F32,  ModeCast::None,
     MasterWeights::Fp32,       ScalerKind::Static,     false,         false, {},
     nullptr, std::nullopt},
    {PrecisionMode::Tf32,      "tf32",       ModeFamily::Plain,      DType::F32,  ModeCast::None,
     MasterWeights::Fp32,       ScalerKind::Static,     false,         true,  {},
     nullptr, std::nullopt},
    {PrecisionMode::Fp16,      "fp16",       ModeFamily::PytorchAmp, DType::F16,  ModeCast::Autocast,
     MasterWeights::Fp32,       ScalerKind::GradScaler, true,          false, kGradScalerKeys,
     &kPytorchAutocastPolicy, std::nullopt},
    {PrecisionMode::Bf16,      "bf16",       ModeFamily::PytorchAmp, DType::BF16, ModeCast::Autocast,
     MasterWeights::Fp32,       ScalerKind::GradScaler, false,         false, kGradScalerKeys,
     &kPytorchAutocastPolicy, std::nullopt},
    {PrecisionMode::Fp16Apex,  "fp16_apex",  ModeFamily::Apex,       DType::F16,  ModeCast::ByOptLevel,
     MasterWeights::ByOptLevel, ScalerKind::Apex,       false,         false, kApexKeys,
     &kApexO1AutocastPolicy, std::nullopt},
    {PrecisionMode::Fp16Naive, "fp16_naive", ModeFamily::Naive,      DType::F16,  ModeCast::WholeModel,
     MasterWeights::Fp32,       ScalerKind::Hysteresis, false,         false, kNaiveKeys,
     nullptr, std::nullopt},
    {PrecisionMode::Bf16Naive, "bf16_naive", ModeFamily::Naive,      DType::BF16, ModeCast::WholeModel,
     MasterWeights::Fp32,       ScalerKind::Hysteresis, false,         false, kNaiveKeys,
     nullptr, std::nullopt},
    {PrecisionMode::Fp8,        "fp8",        ModeFamily::LowPrecision, DType::BF16, ModeCast::Autocast,
     MasterWeights::Fp32,       ScalerKind::Static,     false,         false, kLowPrecisionKeys,
     &kPytorchAutocastPolicy, ScalingRecipe::CurrentTensorwise},
    {PrecisionMode::Fp8Delayed, "fp8_delayed", ModeFamily::LowPrecision, DType::BF16, ModeCast::Autocast,
     MasterWeights::Fp32,       ScalerKind::Static,     false,         false, kLowPrecisionKeys,
     &kPytorchAutocastPolicy, ScalingRecipe::DelayedTensorwise},
    {PrecisionMode::Fp8Rowwise, "fp8_rowwise", ModeFamily::LowPrecision, DType::BF16, ModeCast::Autocast,
     MasterWeights::Fp32,       ScalerKind::Static,     false,         false, kLowPrecisionKeys,
     &kPytorchAutocastPolicy, ScalingRecipe::Rowwise},
    {PrecisionMode::Fp8Block,   "fp8_block",  ModeFamily::LowPrecision, DType::BF16, ModeCast::Autocast,
     MasterWeights::Fp32,       ScalerKind::Static,     false,         false, kLowPrecisionKeys,
     &kPytorchAutocastPolicy, ScalingRecipe::Block},
    {PrecisionMode::Mxfp8,      "mxfp8",      ModeFamily::LowPrecision, DType::BF16, ModeCast::Autocast,
     MasterWeights::Fp32,       ScalerKind::Static,     false,         false, kLowPrecisionKeys,
     &kPytorchAutocastPolicy, ScalingRecipe::Mx},
    {PrecisionMode::Nvfp4,      "nvfp4",      ModeFamily::LowPrecision, DType::BF16, ModeCast::Autocast,
     MasterWeights::Fp32,       ScalerKind::Static,     false,         false, kLowPrecisionKeys,
     &kPytorchAutocastPolicy, ScalingRecipe::Nvfp4},
}};

constexpr bool precision_modes_in_order() {
  for (size_t i = 0; i < kPrecisionModes.size(); ++i)
    if (static_cast<size_t>(kPrecisionModes[i].mode) != i) return false;
  return true;
}
static_assert(precision_modes_in_order(), "kPrecisionModes rows must follow PrecisionMode order");

// What a family fixes for all of its rows: what it casts (and by which autocast lists), its master weights,
// its scaler and its options.
// amp/config.cpp reads a family's options and Booster composes its pieces from these columns, so a row that
// disagreed with its family would be read or built as another family's mode.
constexpr bool row_follows_its_family(const PrecisionModeRow& row) {
  auto keys_are = [&](std::span<const std::string_view> keys) {
    return row.option_keys.data() == keys.data() && row.option_keys.size() == keys.size();
  };
  const bool low = row.compute_dtype == DType::F16 || row.compute_dtype == DType::BF16;
  switch (row.family) {
    case ModeFamily::Plain:
      return row.cast == ModeCast::None && row.compute_dtype == DType::F32 && row.scaler == ScalerKind::Static &&
             row.master_weights == MasterWeights::Fp32 && row.option_keys.empty() &&
             row.autocast_policy == nullptr && !row.gemm_scaling;
    case ModeFamily::PytorchAmp:
      return row.cast == ModeCast::Autocast && low && row.scaler == ScalerKind::GradScaler &&
             row.master_weights == MasterWeights::Fp32 && keys_are(kGradScalerKeys) &&
             row.autocast_policy == &kPytorchAutocastPolicy && !row.gemm_scaling;
    case ModeFamily::Apex:
      return row.cast == ModeCast::ByOptLevel && low && row.scaler == ScalerKind::Apex &&
             row.master_weights == MasterWeights::ByOptLevel && keys_are(kApexKeys) &&
             row.autocast_policy == &kApexO1AutocastPolicy && !row.gemm_scaling;
    case ModeFamily::Naive:
      return row.cast == ModeCast::WholeModel && low && row.scaler == ScalerKind::Hysteresis &&
             row.master_weights == MasterWeights::Fp32 && keys_are(kNaiveKeys) && row.autocast_policy == nullptr &&
             !row.gemm_scaling;
    case ModeFamily::LowPrecision:  // Transformer Engine's setting: fp8 inside bf16 autocast
      return row.cast == ModeCast::Autocast && row.compute_dtype == DType::BF16 && row.scaler == ScalerKind::Static &&
             row.master_weights == MasterWeights::Fp32 && keys_are(kLowPrecisionKeys) &&
             row.autocast_policy == &kPytorchAutocastPolicy && row.gemm_scaling.has_value();
  }
  return false;
}

constexpr bool every_row_follows_its_family() {
  for (const PrecisionModeRow& row : kPrecisionModes) {
    if (!row_follows_its_family(row)) return false;
    if (row.grad_scaler_enabled && row.scaler != ScalerKind::GradScaler) return false;
    if (row.tf32_matmuls && row.compute_dtype != DType::F32) return false;
  }
  return true;
}
static_assert(every_row_follows_its_family(),
              "a kPrecisionModes row disagrees with its family (row_follows_its_family)");

// Apex's opt levels: each is a mode name of its own where modes are listed ("fp16_apex:O2").
inline constexpr std::array<std::string_view, 4> kApexOptLevels{"O0", "O1", "O2", "O3"};

constexpr const PrecisionModeRow& mode_row(PrecisionMode mode) { return kPrecisionModes[static_cast<size_t>(mode)]; }

// The row named `name` (no opt level), or nullopt.
constexpr std::optional<PrecisionMode> find_precision_mode(std::string_view name) {
  for (const PrecisionModeRow& row : kPrecisionModes)
    if (row.name == name) return row.mode;
  return std::nullopt;
}

// Every mode's name in table order, Apex's once per opt level in `apex_opt_levels` ({"O2"}:
// "fp16_apex:O2"; kApexOptLevels: all four), or once without a level when `apex_opt_levels` is empty.
std::vector<std::string> precision_mode_names(std::span<const std::string_view> apex_opt_levels = {});

// The modes joined by `separator` for help texts: "fp32|tf32|fp16|bf16|fp16_apex[:O0..O3]|...".
std::string precision_mode_list(std::string_view separator);

}  // namespace mixtape
