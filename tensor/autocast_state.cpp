// The autocast state, the cast and the cast cache (see autocast_state.h for the policy table).
#include "tensor/autocast_state.h"

#include <map>
#include <tuple>

#include "tensor/autograd_node.h"
#include "tensor/error.h"

namespace mixtape {

namespace {

// What makes two casts the same cast: the same bytes (storage, version) seen through the same view, to the
// same dtype. The version is part of the key, so an in-place update (an optimizer step) misses the cache.
struct CastKey {
  const void* storage;
  uint64_t version;
  int64_t offset;
  Shape shape;
  Strides strides;
  DType source, target;
  bool operator<(const CastKey& o) const {
    return std::tie(storage, version, offset, shape, strides, source, target) <
           std::tie(o.storage, o.version, o.offset, o.shape, o.strides, o.source, o.target);
  }
};

struct CastEntry {
  Tensor source;  // keeps the storage alive, so its address cannot be reused by another tensor in the key
  Tensor cast;
};

struct AutocastThreadState {
  int depth = 0;
  uint64_t casts = 0;
  std::map<CastKey, CastEntry> cache;
};

thread_local AutocastThreadState state;

bool is_narrow_float(DType d) { return d == DType::F16 || d == DType::BF16; }

}  // namespace

std::string_view policy_name(OpPolicy policy) {
  switch (policy) {
    case OpPolicy::LowerPrecision: return "lower precision";
    case OpPolicy::Fp32: return "fp32";
    case OpPolicy::Promote: return "promote";
  }
  return "?";
}

std::optional<DType> enter_autocast_scope(std::optional<DType> dtype) {
  if (dtype)
    check(is_narrow_float(*dtype), "Autocast: the autocast dtype must be f16 or bf16, got ",
          dtype_name(*dtype));
  const std::optional<DType> previous = autocast_detail::current_dtype;
  autocast_detail::current_dtype = dtype;
  ++state.depth;
  return previous;
}

void leave_autocast_scope(std::optional<DType> previous) {
  autocast_detail::current_dtype = previous;
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
  CastKey key{x.storage().get(), x.version(), x.offset(), x.shape(), x.strides(), x.dtype(), target};
  auto found = state.cache.find(key);
  // A backward() since the cast was cached has run and released its node: a forward that used it again
  // could not backpropagate ("graph already used"), so such an entry is cast afresh (one forward + backward
  // per step inside one long scope keeps working).
  if (found != state.cache.end()) {
    const std::shared_ptr<Node>& node = found->second.cast.grad_fn();
    if (node && node->backward) return found->second.cast;
  }
  ++state.casts;
  Tensor cast = x.to(target);
  state.cache.insert_or_assign(std::move(key), CastEntry{x, cast});
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
  DType target = DType::F32;
  switch (policy) {
    case OpPolicy::LowerPrecision: target = autocast; break;
    case OpPolicy::Fp32: target = DType::F32; break;
    case OpPolicy::Promote: target = *widest; break;
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
  const std::optional<DType> target = autocast_target(policy_of(op), *autocast_detail::current_dtype, inputs);
  if (!target) return std::nullopt;
  std::vector<Tensor> cast;
  cast.reserve(inputs.size());
  for (const Tensor& t : inputs) cast.push_back(autocast_cast(t, *target));
  return cast;
}

}  // namespace mixtape
