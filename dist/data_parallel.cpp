#include "dist/data_parallel.h"

#include <map>
#include <utility>

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
}

void GradientReducer::reduce() {
  NoGradGuard no_grad;
  const double inv_size = 1.0 / dp_.size();
  for (const std::vector<size_t>& bucket : buckets_) {
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
