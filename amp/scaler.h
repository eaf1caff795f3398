#pragma once
// Loss scalers: multiply the loss by a scale S before backward so small fp16 gradients do not flush to
// zero, divide the gradients by S before the optimizer step, and adapt S to the overflows seen.
//
// One interface (LossScaler), three scalers with the published rules:
//   GradScaler         torch.cuda.amp.GradScaler: per-optimizer unscale/step, update() combines them.
//   DynamicLossScaler  Megatron-LM DynamicGradScaler / Colossal-AI naive AMP: backoff only after
//                      `hysteresis` overflows, growth refills the hysteresis, min/max clamps.
//   StaticLossScaler   a fixed scale (Megatron's ConstantGradScaler); update() does nothing.
// apex_dynamic_scaler() builds Apex's amp LossScaler out of DynamicLossScaler (hysteresis 1).
//
// state_dict(): metadata strings (numbers as the shortest text that reads back bit for bit), ready to be
// merged into a training checkpoint's StateDict metadata under a prefix; load_state_dict() checks the type
// and every entry (an unknown one is an error) before it changes anything.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "optim/optimizer.h"
#include "tensor/tensor.h"

namespace mixtape {

// The scales a loss scaler can work with. The loss is multiplied by S and the gradients by 1/S in fp32, so
// both must be finite there: S at most FLT_MAX once rounded to fp32 (3.4028235e38, FLT_MAX as usually
// printed, rounds to it), and S at least kMinLossScale = 2^-128 + 2^-149, the smallest float whose fp32
// reciprocal is finite (1/2^-128 = 2^128 is beyond fp32; 1/(2^-128 + 2^-149) = 2^128 / (1 + 2^-21) rounds to a
// finite float). Every option that sets a scale and every scale read from a saved state is held to this;
// only a dynamic scaler's backoff may leave it (a run whose gradients overflow step after step).
inline constexpr double kMinLossScale = 0x1p-128 + 0x1p-149;
inline constexpr double kMaxLossScale = 0x1.fffffep127;  // FLT_MAX
// Error "<who>: <what> <value> is not a usable loss scale: expected ..." unless `value` is such a scale.
void check_loss_scale(std::string_view who, std::string_view what, double value);

class LossScaler {
 public:
  virtual ~LossScaler() = default;
  virtual const char* name() const = 0;  // "GradScaler", "DynamicLossScaler", "StaticLossScaler"

  double scale() const { return scale_; }  // the current scale S
  // loss * S (a recorded op, so backward sees it); the loss is returned unchanged when S is exactly 1.
  virtual Tensor scale(const Tensor& loss) const;
  // Several outputs at once, as PyTorch's scale(outputs) with an iterable: each scaled as above, in order
  // (e.g. for one backward(outputs, grad_outputs) over several losses). Every output is checked first.
  std::vector<Tensor> scale(const std::vector<Tensor>& outputs) const;
  // Adapts S after a step: found_inf says whether any gradient of the step was inf or NaN.
  virtual void update(bool found_inf) = 0;

  virtual std::map<std::string, std::string> state_dict() const = 0;
  // `entry_prefix` goes before each entry's name in errors ("scaler.0." for the entries of a checkpoint's
  // metadata: entry "scaler.0.scale").
  virtual void load_state_dict(const std::map<std::string, std::string>& state,
                               std::string_view entry_prefix = {}) = 0;

 protected:
  explicit LossScaler(double scale) : scale_(scale) {}
  double scale_;
};

// ---- PyTorch GradScaler ----
struct GradScalerOptions {
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  bool enabled = true;
};

class GradScaler final : public LossScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});
  const char* name() const override { return "GradScaler"; }

  using LossScaler::scale;
  Tensor scale(const Tensor& loss) const override;  // pass-through when disabled
  // Divides the gradients of `optimizer`'s parameters by S in place and records whether any was non-finite.
  // At most once per optimizer between update()s, and not after step() (PyTorch's errors). Rejects f16
  // gradients, as PyTorch's public unscale_ does: those need f32 master weights (amp/optimizer). A call that
  // throws records nothing; an optimizer without any gradient is recorded as unscaled but not inf-checked.
  void unscale(Optimizer& optimizer);
  // Unscales if not done yet, then runs optimizer.step() unless a gradient was non-finite. Returns whether
  // it stepped. An Error if no parameter had a gradient (PyTorch: "No inf checks were recorded for this
  // optimizer"). Disabled: just optimizer.step().
  bool step(Optimizer& optimizer);
  // Combines the found_inf of every optimizer inf-checked since the last update (an Error if none was, as
  // PyTorch's "No inf checks were recorded prior to update") and applies update(found_inf_any); resets the
  // per-optimizer records.
  void update();
  // The rule itself: found_inf: S *= backoff, tracker = 0; else tracker += 1 and at growth_interval
  // S *= growth (kept only if finite in fp32, as PyTorch keeps S as an fp32 tensor), tracker = 0.
  void update(bool found_inf) override;
  // PyTorch's update(new_scale): S = new_scale rounded to fp32 (an Error unless it is a usable scale,
  // check_loss_scale), the growth tracker kept, the per-optimizer records reset; needs no inf check.
  // Disabled: nothing. (An integer argument is ambiguous between this and update(bool): write 1024.0.)
  void update(double new_scale);

  bool enabled() const { return options_.enabled; }
  int64_t growth_tracker() const { return growth_tracker_; }
  const GradScalerOptions& options() const { return options_; }

  // scale, growth_tracker and the rule (growth_factor, backoff_factor, growth_interval); empty when disabled.
  std::map<std::string, std::string> state_dict() const override;
  // As PyTorch's: the saved rule replaces this scaler's options; a disabled scaler ignores any state.
  void load_state_dict(const std::map<std::string, std::string>& state,
                       std::string_view entry_prefix = {}) override;

 private:
  enum class Stage { Unscaled, Stepped };
  struct OptimizerState {  // exists only once unscale() succeeded for the optimizer
    Stage stage = Stage::Unscaled;
    bool inf_checked = false;  // some parameter had a gradient (PyTorch: found_inf_per_device non-empty)
    bool found_inf = false;
  };
  GradScalerOptions options_;
  int64_t growth_tracker_ = 0;
  std::map<const Optimizer*, OptimizerState> per_optimizer_;
};

// ---- Megatron-LM / Colossal-AI dynamic scaler with hysteresis ----
struct DynamicLossScalerOptions {
  double initial_scale = 4294967296.0;  // 2^32
  double min_scale = 1.0;
  double max_scale = 4294967296.0;  // 2^32
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 1000;
  int64_t hysteresis = 2;
  // Apex: min_scale only floors the backoff, so S may start below it (it grows from there until the first
  // overflow lifts it to min_scale). Otherwise initial_scale must lie in [min_scale, max_scale].
  bool allow_initial_below_min = false;
  // Megatron-LM keeps S, min_scale and both factors in fp32 tensors (Colossal-AI S and its bounds, with the
  // factors cast to fp32 by the multiplication): each is rounded to fp32 and every update is an fp32
  // product, S = fp32(S * fp32(factor)). Apex keeps them in Python floats: double throughout (false). The
  // two agree for the powers of two of the defaults; a factor such as 1.1 gives different sequences.
  bool fp32_scale = true;
};

class DynamicLossScaler : public LossScaler {
 public:
  explicit DynamicLossScaler(DynamicLossScalerOptions options = {});
  const char* name() const override { return "DynamicLossScaler"; }
  // overflow: growth_tracker = 0, hysteresis_tracker = max(hysteresis_tracker - 1, 0), and when it is 0
  //           S = max(S * backoff, min_scale) (every further overflow backs off until a growth refills it);
  // clean:    growth_tracker += 1; at growth_interval: growth_tracker = 0, hysteresis_tracker = hysteresis,
  //           S = min(S * growth, max_scale).
  void update(bool found_inf) override;

  int64_t growth_tracker() const { return growth_tracker_; }
  int64_t hysteresis_tracker() const { return hysteresis_tracker_; }
  const DynamicLossScalerOptions& options() const { return options_; }

  // What the latest update() did: an overflow the hysteresis absorbed, a backoff (at min_scale too), a
  // growth (at max_scale too) or a clean step that did not grow; and how many update() calls there have been.
  // A caller that reports scale changes (Booster's verbose lines) compares the count around a step: a scaler
  // whose loss sat the step out is not updated, and its latest outcome is an earlier step's.
  enum class Update { None, Clean, Overflow, Backoff, Growth };
  Update last_update() const { return last_update_; }
  uint64_t update_count() const { return update_count_; }

  // scale, the two trackers and the rule: min_scale, max_scale, growth_factor, backoff_factor,
  // growth_interval, hysteresis.
  std::map<std::string, std::string> state_dict() const override;
  // The saved rule must be this scaler's (an Error naming the option otherwise): the Megatron/Colossal-AI
  // rule and Apex's share this type; the scale must lie in [min_scale, max_scale] ((0, max_scale] with
  // allow_initial_below_min), the trackers in [0, growth_interval) and [0, hysteresis]. A state without the
  // rule entries (Megatron-LM's own holds only the scale and the trackers) loads unchecked against the rule.
  void load_state_dict(const std::map<std::string, std::string>& state,
                       std::string_view entry_prefix = {}) override;

 private:
  DynamicLossScalerOptions options_;
  double in_rule_dtype(double value) const;  // rounded to fp32 with fp32_scale, else itself
  // The rule as update() computes with it: the options, rounded to fp32 where options_.fp32_scale says so.
  double min_scale_, max_scale_, growth_factor_, backoff_factor_;
  int64_t growth_tracker_ = 0;
  int64_t hysteresis_tracker_;
  Update last_update_ = Update::None;
  uint64_t update_count_ = 0;
};

// ---- fixed scale ----
class StaticLossScaler final : public LossScaler {
 public:
  explicit StaticLossScaler(double scale = 1.0);
  const char* name() const override { return "StaticLossScaler"; }
  void update(bool) override {}
  std::map<std::string, std::string> state_dict() const override;
  // The scale comes from the configuration: a saved scale must equal it (an Error naming both otherwise).
  void load_state_dict(const std::map<std::string, std::string>& state,
                       std::string_view entry_prefix = {}) override;
};

// Apex amp's dynamic LossScaler (apex/amp/scaler.py update_scale): overflow: S = max(min_loss_scale, S / 2),
// unskipped = 0; clean: unskipped += 1; at scale_window: S = min(max_loss_scale, S * 2), unskipped = 0.
// That is DynamicLossScaler with hysteresis 1 (each overflow backs off). S starts at
// min(max_loss_scale, init_scale), possibly below min_loss_scale (the floor applies at the first backoff).
// Apex's min_loss_scale=None (no floor) is std::nullopt here, mapped to the smallest positive double so S
// can never reach 0.
DynamicLossScaler apex_dynamic_scaler(double init_scale = 65536.0, int64_t scale_window = 2000,
                                      std::optional<double> min_loss_scale = std::nullopt,
                                      double max_loss_scale = 16777216.0 /* 2^24 */,
                                      double scale_factor = 2.0);

}  // namespace mixtape
