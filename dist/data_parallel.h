#pragma once
// Data parallelism (PyTorch DDP's gradient reduction, Megatron-LM's DistributedDataParallel): every dp rank
// holds a full replica, runs forward/backward on its own slice of the global batch, and the gradients are
// averaged over the data-parallel group before the optimizer step, so every replica takes the same step.
//
// Mean loss over the global batch: each rank's loss is the mean over its LOCAL batch. When every rank has
// the same number of samples, the mean over dp of the local-mean gradients is exactly the gradient of the
// mean over the global batch (the single-process run). Unequal local batches would need the loss weighted
// by local/global size by the caller.
//
// fp8_communication (Colossal-AI's option, dist/fp8_collectives.h): each bucket's average travels as E5M2
// payloads with per-chunk scales, summed in fp32, by a blocking fp8_all_reduce_mean when the bucket is full (so
// it does not overlap the rest of the backward as the fp32 all-reduce does). Every replica still ends with the
// same gradients.
//
// Buckets: parameters are visited in reverse order (the order backward produces their gradients, as DDP
// does), grouped by gradient dtype (Tensor::grad_dtype() at construction: fp32 for a 16-bit parameter whose
// gradients accumulate in fp32), and packed into flat contiguous buffers of about bucket_bytes (counted in
// the gradient's dtype; a parameter larger than that is a bucket by itself; bucket_bytes = 0 puts every
// parameter in its own bucket). One all_reduce per bucket. The flat buffer is kept in the reduction dtype:
// f32 for f16/bf16/f32 gradients, f64 for f64, so 16-bit gradients are summed in fp32, divided by the dp
// size in fp32 and rounded once back to their gradient dtype: the average of scaled fp16 gradients cannot
// overflow where the sum would (the sum never exists in fp16), and fp32 gradients are never rounded.
//
// Overlap with backward: between begin() and finish(), the reducer listens to autograd's leaf-gradient hook
// (autograd/autograd.h) and starts a bucket's all-reduce (non-blocking: Communicator::all_reduce_start) as soon
// as backward has made the last of its gradients final, while backward goes on with the rest of the graph.
// Buckets are started strictly in bucket order (a bucket that fills early waits for the ones before it), so
// every rank issues the same sequence of collectives whatever order its backward finishes leaves in. MPI moves a
// non-blocking collective on only inside MPI calls, so every later leaf-gradient event polls the oldest one in
// flight; over NCCL it runs on the group's own stream beside the backward's kernels. finish() starts the buckets
// left (parameters backward did not reach), waits for all, and removes the hook. begin(n) spans n backward()
// calls (the micro-batches of one step): a gradient is final after the n-th backward has produced it, so the
// buckets fill during the last micro-batch's backward. A gradient that grows after its bucket was started is an
// Error. reduce() (after backward) starts every bucket, then waits: the same results as the overlapped form.
//
// A parameter without a gradient on this rank contributes zeros (the ranks must agree on the buckets);
// after reduce() every parameter has its averaged gradient (a zero one if no rank had one: an optimizer then
// steps it, weight decay included, where the single-process run would skip it). The hook is per thread:
// begin(), backward() and finish() run on one thread. With MixedPrecisionOptimizer: call reduce()
// between backward and step(); the gradients keep their loss scale (every rank uses the same scale), an inf
// on any rank makes the reduced gradient non-finite on every rank, so all skip together; give the optimizer
// the model-parallel group (not dp) for the norm: after reduce() the gradients are replicated over dp.
#include <cstdint>
#include <functional>
#include <map>
#include <vector>

#include "dist/communicator.h"
#include "tensor/tensor.h"

namespace mixtape::dist {

class GradientReducer {
 public:
  static constexpr int64_t kDefaultBucketBytes = 25 * 1024 * 1024;

  // params: the replica's parameters, the same list (shapes, dtypes, order) on every rank of `dp`.
  GradientReducer(Communicator dp, std::vector<Tensor> params, int64_t bucket_bytes = kDefaultBucketBytes,
                  bool fp8_communication = false);

  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  // Averages every parameter's .grad over the dp group (SUM / dp, in fp32 or f64), bucket by bucket.
  void reduce();
  // Overlapped form: begin(backwards) before the first of `backwards` backward() calls, finish() after the last
  // (see above).
  void begin(int backwards = 1);
  void finish();
  // After an error inside the backward: removes the hook without starting or waiting for anything (collectives
  // already in flight complete when the peers' do; the next begin() or reduce() waits for them).
  void abandon();
  // Buckets whose all-reduce started inside backward (from the hook) since the last begin().
  int64_t buckets_reduced_in_backward() const { return reduced_in_backward_; }

  // The buckets: indices into params, in packing order (reverse parameter order within one dtype).
  const std::vector<std::vector<size_t>>& buckets() const { return buckets_; }
  const Communicator& communicator() const { return dp_; }
  const std::vector<Tensor>& params() const { return params_; }

 private:
  void start_bucket(size_t b);   // packs the bucket's gradients and starts their all-reduce
  void finish_bucket(size_t b);  // waits for it, averages, and sets the gradients
  void on_leaf_ready(const TensorImpl& leaf);

  Communicator dp_;
  std::vector<Tensor> params_;
  bool fp8_communication_ = false;
  std::vector<std::vector<size_t>> buckets_;
  std::vector<size_t> bucket_of_;        // per parameter
  // Overlap state (between begin() and finish()).
  bool active_ = false;
  int backwards_ = 1;                    // backward() calls between begin() and finish()
  std::vector<int> produced_;            // per parameter: times backward has made its gradient final
  std::vector<size_t> pending_;          // per bucket: parameters not yet final
  size_t next_bucket_ = 0;               // buckets before it are started
  size_t next_wait_ = 0;                 // buckets before it are finished
  std::vector<Tensor> flat_;             // per bucket in flight: the fp32 (f64) buffer
  std::vector<PendingCollective> in_flight_;  // per bucket
  int64_t reduced_in_backward_ = 0;
  std::map<const TensorImpl*, size_t> index_of_;
  std::function<void(const TensorImpl&)> previous_hook_;
};

// Rank root's values replace every rank's parameters (in place), so the replicas start equal.
void broadcast_parameters(const std::vector<Tensor>& params, const Communicator& dp, int root = 0);

}  // namespace mixtape::dist
