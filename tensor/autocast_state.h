#pragma once
// The autocast hook that op front ends call: the thread-local autocast dtype and policy table (one of
// tensor/autocast_tables.h: PyTorch's or Apex O1's), and autocast_inputs(), which casts an op's floating
// inputs per the active table's class for it while a scope is active.
//
// Layering: tensor/ sits below amp/, so the state and the cast live here; amp/autocast.h is the user-facing
// RAII scope and amp/policy.h prints the tables. Front ends name their op by an AutocastOp constant, so there
// is no string lookup on the hot path and an op has one class per table.
//
// Cost when no scope is active: one thread-local read, then autocast_inputs returns nullopt and the front
// end carries on with its own arguments (no handle copies, no allocation).
#include <array>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "tensor/autocast_op.h"
#include "tensor/autocast_tables.h"
#include "tensor/dtype.h"
#include "tensor/tensor.h"

namespace mixtape {

std::string_view policy_name(OpPolicy policy);

// ---- the thread-local state (amp/autocast.h's Autocast scope is the way to change it) ----
namespace autocast_detail {
// The active autocast dtype of this thread (nullopt: off) and the table its ops are cast by (meaningful
// while the dtype is set). inline thread_local: one read, no call.
inline thread_local std::optional<DType> current_dtype;
inline thread_local const AutocastPolicyTable* current_table = &kPytorchAutocastPolicy;
}  // namespace autocast_detail

inline std::optional<DType> autocast_dtype() { return autocast_detail::current_dtype; }
inline bool autocast_enabled() { return autocast_detail::current_dtype.has_value(); }
// The table the active scope casts by (PyTorch's when the scope did not name one).
inline const AutocastPolicyTable& autocast_table() { return *autocast_detail::current_table; }

// What a scope replaces and restores.
struct AutocastState {
  std::optional<DType> dtype;
  const AutocastPolicyTable* table;
};

// Enter/leave one scope: `dtype` nullopt disables autocast inside it; `table` is the policy its ops are cast
// by. enter returns the previous state, which leave restores; the cast cache is dropped when the outermost
// scope is left. dtype must be F16 or BF16 (throws mixtape::Error otherwise).
AutocastState enter_autocast_scope(std::optional<DType> dtype,
                                   const AutocastPolicyTable& table = kPytorchAutocastPolicy);
void leave_autocast_scope(const AutocastState& previous);
int autocast_scope_depth();  // scopes open on this thread (enabled or not)

// RAII over enter/leave: the mechanism under amp/autocast.h's Autocast (the user-facing scope), usable from
// layers below amp/ (backward runs its closures inside AutocastScope(std::nullopt): gradients are computed
// in the dtypes the forward saved, as PyTorch does, not re-cast by a scope that happens to be open).
class AutocastScope {
 public:
  explicit AutocastScope(std::optional<DType> dtype, const AutocastPolicyTable& table = kPytorchAutocastPolicy)
      : previous_(enter_autocast_scope(dtype, table)) {}
  ~AutocastScope() { leave_autocast_scope(previous_); }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  AutocastState previous_;
};

// Cast cache introspection (tests): entries held, and casts performed by autocast on this thread.
size_t autocast_cache_size();
uint64_t autocast_cast_count();

// ---- the cast ----
// `x` cast to `target`: differentiable (Tensor::to), cached for leaf tensors that require grad, unchanged
// when undefined, integer, f64, or already in the dtype. The cache is keyed by the source and the target
// dtype only: a cast to a dtype is the same tensor whichever table asked for it.
Tensor autocast_cast(const Tensor& x, DType target);
// The dtype `policy` asks for, given the inputs' floating dtypes (nullopt: nothing to cast).
std::optional<DType> autocast_target(OpPolicy policy, DType autocast, const Tensor* const* inputs, size_t n);
std::optional<DType> autocast_target(OpPolicy policy, DType autocast, const std::vector<Tensor>& inputs);

// The front-end hook: nullopt when no scope is active or no input needs a cast (then the front end uses its
// own arguments); else the inputs cast per the op's class in the active table, in order. A front end re-enters itself with
// them; the re-entry casts nothing (every floating input is then in the target dtype), so it terminates.
template <class... T>
std::optional<std::array<Tensor, sizeof...(T)>> autocast_inputs(AutocastOp op, const T&... inputs) {
  if (!autocast_detail::current_dtype) [[likely]] return std::nullopt;
  const Tensor* ptrs[] = {&inputs...};
  const std::optional<DType> target =
      autocast_target(policy_of(*autocast_detail::current_table, op), *autocast_detail::current_dtype, ptrs,
                      sizeof...(T));
  if (!target) return std::nullopt;
  return std::array<Tensor, sizeof...(T)>{autocast_cast(inputs, *target)...};
}
std::optional<std::vector<Tensor>> autocast_inputs(AutocastOp op, const std::vector<Tensor>& inputs);

}  // namespace mixtape
