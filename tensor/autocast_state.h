#pragma once
// The autocast hook that op front ends call: the thread-local autocast dtype, the ONE per-op policy table,
// and autocast_inputs(), which casts an op's floating inputs per its policy while a scope is active.
//
// Layering: tensor/ sits below amp/, so the state, the table and the cast live here; amp/autocast.h is the
// user-facing RAII scope and amp/policy.h exposes and prints this same table (it has no table of its own).
// Front ends name their op by an AutocastOp constant, so there is no string lookup on the hot path and
// an op cannot have two policies.
//
// Cost when no scope is active: one thread-local read, then autocast_inputs returns nullopt and the front
// end carries on with its own arguments (no handle copies, no allocation).
#include <array>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "tensor/autocast_op.h"
#include "tensor/dtype.h"
#include "tensor/tensor.h"

namespace mixtape {

struct AutocastTableEntry {
  AutocastOp op;
  const char* name;  // the front end's name in ops.h
  OpPolicy policy;
  const char* note;  // what else it covers, or "" (e.g. bmm is matmul with batch dims)
};

// THE policy table, in AutocastOp order (checked at compile time below). Ops not listed run in their
// inputs' dtype under autocast (gelu, relu, embedding, dropout, max, ...).
inline constexpr std::array<AutocastTableEntry, static_cast<size_t>(AutocastOp::Count)> kAutocastTable{{
    {AutocastOp::Matmul, "matmul", OpPolicy::LowerPrecision, "also bmm: matmul with batch dims"},
    {AutocastOp::Linear, "linear", OpPolicy::LowerPrecision, ""},
    {AutocastOp::ScaledDotProductAttention, "scaled_dot_product_attention", OpPolicy::LowerPrecision, ""},
    {AutocastOp::CausalSelfAttention, "causal_self_attention", OpPolicy::LowerPrecision, ""},
    {AutocastOp::Softmax, "softmax", OpPolicy::Fp32, ""},
    {AutocastOp::LogSoftmax, "log_softmax", OpPolicy::Fp32, ""},
    {AutocastOp::SoftmaxCrossEntropy, "softmax_cross_entropy", OpPolicy::Fp32, "cross entropy; targets stay"},
    {AutocastOp::LayerNorm, "layer_norm", OpPolicy::Fp32, ""},
    {AutocastOp::RMSNorm, "rms_norm", OpPolicy::Fp32, ""},
    {AutocastOp::Exp, "exp", OpPolicy::Fp32, ""},
    {AutocastOp::Log, "log", OpPolicy::Fp32, ""},
    {AutocastOp::Rsqrt, "rsqrt", OpPolicy::Fp32, "as in PyTorch's CUDA autocast"},
    {AutocastOp::Pow, "pow", OpPolicy::Fp32, "tensor and scalar exponents"},
    {AutocastOp::Sum, "sum", OpPolicy::Fp32, ""},
    {AutocastOp::Mean, "mean", OpPolicy::Fp32, ""},
    {AutocastOp::Norm, "norm", OpPolicy::Fp32, "p-norm, p > 0 or inf"},
    {AutocastOp::Var, "var", OpPolicy::Fp32, ""},
    {AutocastOp::Add, "add", OpPolicy::Promote, "tensor-tensor form"},
    {AutocastOp::Sub, "sub", OpPolicy::Promote, "tensor-tensor form"},
    {AutocastOp::Mul, "mul", OpPolicy::Promote, "tensor-tensor form"},
    {AutocastOp::Div, "div", OpPolicy::Promote, "tensor-tensor form"},
    {AutocastOp::Cat, "cat", OpPolicy::Promote, ""},
    {AutocastOp::Stack, "stack", OpPolicy::Promote, ""},
    {AutocastOp::Where, "where", OpPolicy::Promote, "a and b; the condition is never cast"},
}};

constexpr bool autocast_table_in_order() {
  for (size_t i = 0; i < kAutocastTable.size(); ++i)
    if (static_cast<size_t>(kAutocastTable[i].op) != i) return false;
  return true;
}
static_assert(autocast_table_in_order(), "kAutocastTable rows must follow AutocastOp order");

constexpr OpPolicy policy_of(AutocastOp op) { return kAutocastTable[static_cast<size_t>(op)].policy; }
std::string_view policy_name(OpPolicy policy);

// ---- the thread-local state (amp/autocast.h's Autocast scope is the way to change it) ----
namespace autocast_detail {
// The active autocast dtype of this thread (nullopt: off). inline thread_local: one read, no call.
inline thread_local std::optional<DType> current_dtype;
}  // namespace autocast_detail

inline std::optional<DType> autocast_dtype() { return autocast_detail::current_dtype; }
inline bool autocast_enabled() { return autocast_detail::current_dtype.has_value(); }

// Enter/leave one scope: `dtype` nullopt disables autocast inside it. enter returns the previous dtype,
// which leave restores; the cast cache is dropped when the outermost scope is left. dtype must be F16 or
// BF16 (throws mixtape::Error otherwise).
std::optional<DType> enter_autocast_scope(std::optional<DType> dtype);
void leave_autocast_scope(std::optional<DType> previous);
int autocast_scope_depth();  // scopes open on this thread (enabled or not)

// RAII over enter/leave: the mechanism under amp/autocast.h's Autocast (the user-facing scope), usable from
// layers below amp/ (backward runs its closures inside AutocastScope(std::nullopt): gradients are computed
// in the dtypes the forward saved, as PyTorch does, not re-cast by a scope that happens to be open).
class AutocastScope {
 public:
  explicit AutocastScope(std::optional<DType> dtype) : previous_(enter_autocast_scope(dtype)) {}
  ~AutocastScope() { leave_autocast_scope(previous_); }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  std::optional<DType> previous_;
};

// Cast cache introspection (tests): entries held, and casts performed by autocast on this thread.
size_t autocast_cache_size();
uint64_t autocast_cast_count();

// ---- the cast ----
// `x` cast for an op of `policy` under `target`: differentiable (Tensor::to), cached for leaf tensors that
// require grad, unchanged when undefined, integer, f64, or already in the dtype.
Tensor autocast_cast(const Tensor& x, DType target);
// The dtype `policy` asks for, given the inputs' floating dtypes (nullopt: nothing to cast).
std::optional<DType> autocast_target(OpPolicy policy, DType autocast, const Tensor* const* inputs, size_t n);
std::optional<DType> autocast_target(OpPolicy policy, DType autocast, const std::vector<Tensor>& inputs);

// The front-end hook: nullopt when no scope is active or no input needs a cast (then the front end uses its
// own arguments); else the inputs cast per the op's policy, in order. A front end re-enters itself with
// them; the re-entry casts nothing (every floating input is then in the target dtype), so it terminates.
template <class... T>
std::optional<std::array<Tensor, sizeof...(T)>> autocast_inputs(AutocastOp op, const T&... inputs) {
  if (!autocast_detail::current_dtype) [[likely]] return std::nullopt;
  const Tensor* ptrs[] = {&inputs...};
  const std::optional<DType> target =
      autocast_target(policy_of(op), *autocast_detail::current_dtype, ptrs, sizeof...(T));
  if (!target) return std::nullopt;
  return std::array<Tensor, sizeof...(T)>{autocast_cast(inputs, *target)...};
}
std::optional<std::vector<Tensor>> autocast_inputs(AutocastOp op, const std::vector<Tensor>& inputs);

}  // namespace mixtape
