#pragma once
// Autocast: a thread-local scope in which the ops of a policy table (tensor/autocast_tables.h: PyTorch's by
// default, or Apex O1's; amp/policy.h prints them) run in a lower precision, in fp32, or in their widest
// input dtype, with the casts recorded on the tape (Tensor::to), so gradients reach fp32 leaves as fp32.
//
//   {
//     Autocast guard(DType::BF16);       // PyTorch's table: matmul/linear/attention in bf16; softmax, norms,
//                                        // losses in f32; mean, var and the elementwise ops in their inputs'
//     Tensor loss = model.forward(x, y);
//     {
//       Autocast off(std::nullopt);      // a region that must stay in the inputs' dtypes
//       ...
//     }                                  // bf16 autocast again
//   }                                    // off; the weight-cast cache is dropped here
//   backward(loss);                      // backward ignores autocast: it runs in the dtypes saved forward
//
// Autocast(DType::F16, kApexO1AutocastPolicy) casts by Apex O1's lists instead (Booster opens each mode's
// scope with its table, PrecisionModeRow::autocast_policy).
//
// Scopes nest; each restores the state it found. Leaf tensors that require grad (weights) are cast once per
// outermost scope and dtype (the cast cache, one entry per leaf): several forwards in one scope share the
// casts and may be backpropagated one by one; an in-place update of a weight (an optimizer step inside a
// long scope) replaces its entry. The mechanism lives in tensor/autocast_state.h, below amp/, because op
// front ends call it.
#include <optional>

#include "tensor/autocast_state.h"
#include "tensor/dtype.h"

namespace mixtape {

class Autocast {
 public:
  // dtype: F16 or BF16 turns autocast on in that dtype; std::nullopt turns it off inside this scope.
  // Any other dtype throws mixtape::Error.
  explicit Autocast(std::optional<DType> dtype) : scope_(dtype) {}
  // The same, casting by `table` (a precision mode's: PrecisionModeRow::autocast_policy).
  Autocast(std::optional<DType> dtype, const AutocastPolicyTable& table) : scope_(dtype, table) {}
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

  static bool enabled() { return autocast_enabled(); }
  static std::optional<DType> dtype() { return autocast_dtype(); }
  static const AutocastPolicyTable& table() { return autocast_table(); }

 private:
  AutocastScope scope_;
};

}  // namespace mixtape
