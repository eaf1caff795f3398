#include "dist/data_parallel.h"

#include <map>
#include <utility>

#include "autograd/autograd.h"
#include "tensor/autograd_node.h"
#include "tensor/error.h"
#include "tensor/ops.h"

namespace mixtape::dist {

namespace {

constexpr const char* kWho = "GradientReducer";

DType reduction_dtype(DType dtype) { return dtype == DType::F64 ? DType::F64 : DType::F32; }

}  // namespace

GradientReducer::GradientReducer(Communicator dp, std::vector<Tensor> params, int64_t bucket_bytes)
    : dp_(std::move(dp)), params_(std::move(params)) {
  check(bucket_bytes >= 0, kWho, ": bucket_bytes must be >= 0, got ", bucket_bytes);
  // Open bucket per dtype, filled in reverse parameter order; a bucket is closed when it reaches
  // bucket_bytes. Buckets are listed in the order they close (then the open ones, in dtype order).
  std::map<DType, std::pair<std::vector<size_t>, int64_t>> open;
  for (size_t k = params_.size(); k-- > 0;) {
    const Tensor& p = params_[k];
    check(p.defined(), kWho, ": parameter ", k, " is undefined");
    check(is_floating(p.dtype()), kWho, ": parameter ", k, " is ", p.description(),
          ", expected a floating-point parameter");
    auto& [bucket, bytes] = open[p.dtype()];
    bucket.push_back(k);
    bytes += p.numel() * static_cast<int64_t>(dtype_size(p.dtype()));
    if (bytes >= bucket_bytes) {
      buckets_.push_back(std::move(bucket));
      bucket.clear();
      bytes = 0;
    }
  }
  for (auto& [dtype, entry] : open)
    if (!entry.first.empty()) buckets_.push_back(std::move(entry.first));
  bucket_of_.resize(params_.size());
  for (size_t b = 0; b < buckets_.size(); ++b)
    for (size_t k : buckets_[b]) bucket_of_[k] = b;
  for (size_t k = 0; k < params_.size(); ++k) {
    check(index_of_.emplace(params_[k].impl_ptr().get(), k).second, kWho, ": parameter ", k, " (",
          params_[k].description(), ") appears more than once");
  }
}

GradientReducer::~GradientReducer() {
  if (active_) set_leaf_grad_hook(std::move(previous_hook_));
}

void GradientReducer::reduce() {
  for (size_t b = 0; b < buckets_.size(); ++b) reduce_bucket(b);
}

void GradientReducer::begin() {
  check(!active_, kWho, ".begin: already begun; expected finish() first");
  ready_.assign(params_.size(), false);
  pending_.clear();
  for (const auto& bucket : buckets_) pending_.push_back(bucket.size());
  next_bucket_ = 0;
  reduced_in_backward_ = 0;
  previous_hook_ = set_leaf_grad_hook([this](const TensorImpl& leaf) { on_leaf_ready(leaf); });
  active_ = true;
}

void GradientReducer::on_leaf_ready(const TensorImpl& leaf) {
  const auto found = index_of_.find(&leaf);
  if (found == index_of_.end()) return;  // not one of ours (an input that requires grad, ...)
  const size_t k = found->second, b = bucket_of_[k];
  check(b >= next_bucket_ || !ready_[k], kWho, ": the gradient of parameter ", k, " (",
        params_[k].description(), ") was produced again after its bucket was reduced; expected one ",
        "backward between begin() and finish()");
  if (ready_[k]) return;
  ready_[k] = true;
  --pending_[b];
  while (next_bucket_ < buckets_.size() && pending_[next_bucket_] == 0) {
    reduce_bucket(next_bucket_++);
    ++reduced_in_backward_;
  }
}

void GradientReducer::finish() {
  check(active_, kWho, ".finish: expected begin() first");
  set_leaf_grad_hook(std::move(previous_hook_));
  previous_hook_ = nullptr;
  active_ = false;
  for (; next_bucket_ < buckets_.size(); ++next_bucket_) reduce_bucket(next_bucket_);
}

void GradientReducer::reduce_bucket(size_t b) {
  NoGradGuard no_grad;
  const double inv_size = 1.0 / dp_.size();
  const std::vector<size_t>& bucket = buckets_[b];
  const Tensor& first = params_[bucket.front()];
  const DType dtype = reduction_dtype(first.dtype());
  int64_t total = 0;
  for (size_t k : bucket) total += params_[k].numel();
  Tensor flat = Tensor::zeros({total}, dtype, first.device());
  int64_t offset = 0;
  for (size_t k : bucket) {
    const Tensor& p = params_[k];
    const Tensor grad = p.grad();
    if (grad.defined()) {
      check(grad.shape() == p.shape(), kWho, ": the gradient of parameter ", k, " is ", grad.description(),
            ", expected the parameter's shape ", p.description());
      flat.narrow(0, offset, p.numel()).copy_(grad.reshape({-1}));  // widened exactly
    }
    offset += p.numel();
  }
  dp_.all_reduce(flat, Reduction::Sum);
  flat.mul_(inv_size);  // in fp32 (f64): the 16-bit sum never exists
  offset = 0;
  for (size_t k : bucket) {
    const Tensor& p = params_[k];
    // A fresh gradient of the parameter's dtype (rounded once): never writes into a gradient that may
    // alias another tensor.
    Tensor grad = Tensor::empty(p.shape(), p.dtype(), p.device());
    grad.copy_(flat.narrow(0, offset, p.numel()).reshape(p.shape()));
    params_[k].set_grad(grad);
    offset += p.numel();
  }
}

void broadcast_parameters(const std::vector<Tensor>& params, const Communicator& dp, int root) {
  NoGradGuard no_grad;
  for (Tensor p : params) {
    Tensor data = p.detach().clone();  // contiguous, whatever the parameter's strides
    dp.broadcast(data, root);
    p.copy_(data);  // in place: the parameter stays the same leaf
  }
}

}  // namespace mixtape::dist
