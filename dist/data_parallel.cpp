#include "dist/data_parallel.h"

#include <map>
#include <utility>

#include "autograd/autograd.h"
#include "dist/fp8_collectives.h"
#include "tensor/autograd_node.h"
#include "tensor/error.h"
#include "tensor/ops.h"

namespace mixtape::dist {

namespace {

constexpr const char* kWho = "GradientReducer";

DType reduction_dtype(DType dtype) { return dtype == DType::F64 ? DType::F64 : DType::F32; }

}  // namespace

GradientReducer::GradientReducer(Communicator dp, std::vector<Tensor> params, int64_t bucket_bytes,
                                 bool fp8_communication)
    : dp_(std::move(dp)), params_(std::move(params)), fp8_communication_(fp8_communication) {
  check(bucket_bytes >= 0, kWho, ": bucket_bytes must be >= 0, got ", bucket_bytes);
  // Open bucket per dtype, filled in reverse parameter order; a bucket is closed when it reaches
  // bucket_bytes. Buckets are listed in the order they close (then the open ones, in dtype order).
  std::map<DType, std::pair<std::vector<size_t>, int64_t>> open;
  for (size_t k = params_.size(); k-- > 0;) {
    const Tensor& p = params_[k];
    check(p.defined(), kWho, ": parameter ", k, " is undefined");
    check(is_floating(p.dtype()), kWho, ": parameter ", k, " is ", p.described(),
          ", expected a floating-point parameter");
    auto& [bucket, bytes] = open[p.grad_dtype()];
    bucket.push_back(k);
    bytes += p.numel() * static_cast<int64_t>(dtype_size(p.grad_dtype()));
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
          params_[k].described(), ") appears more than once");
  }
}

GradientReducer::~GradientReducer() {
  if (active_) set_leaf_grad_hook(std::move(previous_hook_));
  // in_flight_'s destructors wait for any collective still running.
}

void GradientReducer::reduce() {
  check(!active_, kWho, ".reduce: begin() is active; expected finish()");
  flat_.assign(buckets_.size(), Tensor());
  in_flight_.clear();
  in_flight_.resize(buckets_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) start_bucket(b);
  for (size_t b = 0; b < buckets_.size(); ++b) finish_bucket(b);
}

void GradientReducer::begin(int backwards) {
  check(!active_, kWho, ".begin: already begun; expected finish() first");
  check(backwards >= 1, kWho, ".begin: backwards must be >= 1, got ", backwards);
  backwards_ = backwards;
  produced_.assign(params_.size(), 0);
  pending_.clear();
  for (const auto& bucket : buckets_) pending_.push_back(bucket.size());
  next_bucket_ = next_wait_ = 0;
  flat_.assign(buckets_.size(), Tensor());
  in_flight_.clear();
  in_flight_.resize(buckets_.size());
  reduced_in_backward_ = 0;
  previous_hook_ = set_leaf_grad_hook([this](const TensorImpl& leaf) { on_leaf_ready(leaf); });
  active_ = true;
}

void GradientReducer::on_leaf_ready(const TensorImpl& leaf) {
  const auto found = index_of_.find(&leaf);
  if (found == index_of_.end()) return;  // not one of ours (an input that requires grad, ...)
  const size_t k = found->second, b = bucket_of_[k];
  check(b >= next_bucket_, kWho, ": the gradient of parameter ", k, " (", params_[k].described(),
        ") was produced again after its bucket's all-reduce started; expected ", backwards_,
        " backward call(s) between begin() and finish()");
  if (++produced_[k] == backwards_) --pending_[b];
  while (next_bucket_ < buckets_.size() && pending_[next_bucket_] == 0) {
    start_bucket(next_bucket_++);
    ++reduced_in_backward_;
  }
  // Move the oldest collective in flight on (MPI progresses non-blocking collectives only inside its calls).
  while (next_wait_ < next_bucket_ && in_flight_[next_wait_].test()) ++next_wait_;
}

void GradientReducer::finish() {
  check(active_, kWho, ".finish: expected begin() first");
  set_leaf_grad_hook(std::move(previous_hook_));
  previous_hook_ = nullptr;
  active_ = false;
  for (; next_bucket_ < buckets_.size(); ++next_bucket_) start_bucket(next_bucket_);
  for (size_t b = 0; b < buckets_.size(); ++b) finish_bucket(b);
}

void GradientReducer::abandon() {
  if (!active_) return;
  set_leaf_grad_hook(std::move(previous_hook_));
  previous_hook_ = nullptr;
  active_ = false;
}

void GradientReducer::start_bucket(size_t b) {
  NoGradGuard no_grad;
  const std::vector<size_t>& bucket = buckets_[b];
  const Tensor& first = params_[bucket.front()];
  int64_t total = 0;
  for (size_t k : bucket) total += params_[k].numel();
  Tensor flat = Tensor::zeros({total}, reduction_dtype(first.grad_dtype()), first.device());
  int64_t offset = 0;
  for (size_t k : bucket) {
    const Tensor& p = params_[k];
    const Tensor grad = p.grad();
    if (grad.defined()) {
      check(grad.shape() == p.shape(), kWho, ": the gradient of parameter ", k, " is ", grad.described(),
            ", expected the parameter's shape ", p.described());
      flat.narrow(0, offset, p.numel()).copy_(grad.reshape({-1}));  // widened exactly
    }
    offset += p.numel();
  }
  if (fp8_communication_) {  // averaged now, in fp32 on the dequantized payloads
    flat_[b] = dist::fp8_all_reduce_mean(dp_, flat).to(flat.dtype());
    return;
  }
  in_flight_[b] = dp_.all_reduce_start(flat, Reduction::Sum);
  flat_[b] = std::move(flat);
}

void GradientReducer::finish_bucket(size_t b) {
  NoGradGuard no_grad;
  in_flight_[b].wait();
  Tensor flat = std::move(flat_[b]);
  if (!fp8_communication_) flat.mul_(1.0 / dp_.size());  // in fp32 (f64): the 16-bit sum never exists
  const std::vector<size_t>& bucket = buckets_[b];
  int64_t offset = 0;
  for (size_t k : bucket) {
    const Tensor& p = params_[k];
    // A fresh gradient of the parameter's gradient dtype (rounded once): never writes into a gradient that
    // may alias another tensor.
    Tensor grad = Tensor::empty(p.shape(), p.grad_dtype(), p.device());
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
