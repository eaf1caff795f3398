// The autocast state, the cast and the cast cache (the policy tables are tensor/autocast_tables.h).
#include "tensor/autocast_state.h"

#include <map>
#include <tuple>

#include "tensor/autograd_node.h"
#include "tensor/error.h"

namespace mixtape {

namespace {

// A cached cast belongs to one tensor handle's impl (the leaf itself, as PyTorch keys its cache by the source
// TensorImpl): two leaves that share storage (b = a.detach()) get their own casts, so each gets its own
// gradient. The entry remembers what it was cast from (storage version, view); an in-place update (an
// optimizer step) replaces the entry instead of adding one per version.
struct CastKey {
  const TensorImpl* source;
  DType target;
  bool operator<(const CastKey& o) const { return std::tie(source, target) < std::tie(o.source, o.target); }
};

struct CastEntry {
  Tensor source;  // keeps the impl alive, so its address cannot be reused by another tensor in the key
  uint64_t version;
  Tensor cast;
  bool current(const Tensor& x) const {
    return version == x.version() && source.storage() == x.storage() && source.offset() == x.offset() &&
           source.shape() == x.shape() && source.strides() == x.strides();
  }
};

struct AutocastThreadState {
  int depth = 0;
  uint64_t casts = 0;
  std::map<CastKey, CastEntry> cache;
};

thread_local AutocastThreadState state;

}  // namespace

std::string_view policy_name(OpPolicy policy) {
  switch (policy) {
    case OpPolicy::LowerPrecision: return "lower precision";
    case OpPolicy::Fp32: return "fp32";
    case OpPolicy::Promote: return "promote";
    case OpPolicy::Unlisted: return "not listed";
  }
  return "?";
}

AutocastState enter_autocast_scope(std::optional<DType> dtype, const AutocastPolicyTable& table) {
  if (dtype)
    check(is_low_precision(*dtype), "Autocast: the autocast dtype must be f16 or bf16, got ",
          dtype_name(*dtype));
  const AutocastState previous{autocast_detail::current_dtype, autocast_detail::current_table};
  autocast_detail::current_dtype = dtype;
  autocast_detail::current_table = &table;
  ++state.depth;
  return previous;
}

void leave_autocast_scope(const AutocastState& previous) {
  autocast_detail::current_dtype = previous.dtype;
  autocast_detail::current_table = previous.table;
  if (--state.depth == 0) state.cache.clear();
}

int autocast_scope_depth() { return state.depth; }
size_t autocast_cache_size() { return state.cache.size(); }
uint64_t autocast_cast_count() { return state.casts; }

Tensor autocast_cast(const Tensor& x, DType target) {
  // f64 is never narrowed (it is the reference dtype) and no policy widens to anything but f32/f64.
  if (!x.defined() || !is_floating(x.dtype()) || x.dtype() == DType::F64 || x.dtype() == target) return x;
  // Only leaves that require grad are cached (PyTorch does the same): those are the weights, identical in
  // every use within a forward, so a weight feeding several ops is cast once. Activations are new tensors
  // each forward, are rarely reused, and caching them would keep them (and their casts) alive until the
  // scope closes. Casts made with grad mode off are not cached either: they carry no backward node, and a
  // later use with grad on would silently cut the gradient to the weight.
  const bool cacheable = x.is_leaf() && x.requires_grad() && grad_enabled();
  if (!cacheable) {
    ++state.casts;
    return x.to(target);
  }
  const CastKey key{x.impl_ptr().get(), target};
  auto found = state.cache.find(key);
  if (found != state.cache.end() && found->second.current(x)) return found->second.cast;
  ++state.casts;
  Tensor cast = x.to(target);
  // The cast's backward captures no tensor (only the source dtype), so its node survives backward(): two
  // forwards sharing a cached weight cast can be backpropagated one after the other, as in PyTorch.
  cast.grad_fn()->keep_after_backward = true;
  state.cache.insert_or_assign(key, CastEntry{x, x.version(), cast});
  return cast;
}

std::optional<DType> autocast_target(OpPolicy policy, DType autocast, const Tensor* const* inputs, size_t n) {
  std::optional<DType> widest;
  bool any_castable = false;  // a defined floating input of another dtype than the target, not f64
  for (size_t i = 0; i < n; ++i) {
    const Tensor& t = *inputs[i];
    if (!t.defined() || !is_floating(t.dtype())) continue;
    widest = widest ? promote(*widest, t.dtype()) : t.dtype();
  }
  if (!widest) return std::nullopt;
  // A lower-precision op with an f64 input runs in its inputs' dtypes: rounding the other operands to the
  // autocast dtype before an f64 product would silently lose their precision (PyTorch never casts f64 and
  // the mixed-dtype call then fails; here the kernel promotes to f64 as outside autocast).
  if (policy == OpPolicy::LowerPrecision && *widest == DType::F64) return std::nullopt;
  DType target = DType::F32;
  switch (policy) {
    case OpPolicy::LowerPrecision: target = autocast; break;
    case OpPolicy::Fp32: target = DType::F32; break;
    // Unlisted ops run in their inputs' dtype; mixed floating inputs meet in the widest, the type promotion
    // they get outside autocast.
    case OpPolicy::Promote:
    case OpPolicy::Unlisted: target = *widest; break;
  }
  for (size_t i = 0; i < n; ++i) {
    const Tensor& t = *inputs[i];
    if (t.defined() && is_floating(t.dtype()) && t.dtype() != DType::F64 && t.dtype() != target)
      any_castable = true;
  }
  if (!any_castable) return std::nullopt;
  return target;
}

std::optional<DType> autocast_target(OpPolicy policy, DType autocast, const std::vector<Tensor>& inputs) {
  std::vector<const Tensor*> ptrs;
  ptrs.reserve(inputs.size());
  for (const Tensor& t : inputs) ptrs.push_back(&t);
  return autocast_target(policy, autocast, ptrs.data(), ptrs.size());
}

std::optional<std::vector<Tensor>> autocast_inputs(AutocastOp op, const std::vector<Tensor>& inputs) {
  if (!autocast_detail::current_dtype) [[likely]] return std::nullopt;
  const std::optional<DType> target =
      autocast_target(policy_of(*autocast_detail::current_table, op), *autocast_detail::current_dtype, inputs);
  if (!target) return std::nullopt;
  std::vector<Tensor> cast;
  cast.reserve(inputs.size());
  for (const Tensor& t : inputs) cast.push_back(autocast_cast(t, *target));
  return cast;
}

}  // namespace mixtape
