#pragma once
// The CUDA backend: cuBLASLt for matmul, hand-written kernels for the rest, all queued on one stream per
// device, memory from a caching allocator. Member functions are defined across tensor/cuda/*.cu, one file
// per kernel family (the same split as tensor/cpu/). Included only by .cu files.
#include <cuda_runtime.h>

#include <cstddef>
#include <map>
#include <mutex>

#include "tensor/backend.h"

namespace mixtape::cuda {

// Keeps freed device blocks by size, so the training loop never calls cudaMalloc/cudaFree once warm. All
// kernels of a device run on its one stream, so a block freed by one kernel's tensor can be handed to the
// next kernel at once: stream order guarantees the earlier kernel is done with it before the later one runs.
class CachingAllocator final : public Allocator {
 public:
  explicit CachingAllocator(int device) : device_(device) {}
  void* allocate(size_t nbytes) override;
  void deallocate(void* ptr, size_t nbytes) override;
  MemoryStats stats() const;
  void reset_peak();
  void empty_cache();  // synchronizes the device, then cudaFree's every cached block
  static size_t round_size(size_t nbytes);

 private:
  void* allocate_new(size_t size);  // cudaMalloc, emptying the cache and retrying once when out of memory

  int device_;
  mutable std::mutex mutex_;
  std::multimap<size_t, void*> free_blocks_;  // by rounded size
  MemoryStats stats_;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device);
  ~CudaBackend() override;
  int device() const { return device_; }
  // Makes this backend's device current on the calling thread and returns its stream: every launch and
  // async copy of this backend goes through here.
  cudaStream_t stream();
  // The cuBLASLt handle and a workspace of kWorkspaceBytes on this device (for matmul.cu).
  void* cublaslt_handle();
  void* workspace();
  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;

  Allocator& allocator() override { return allocator_; }
  void synchronize() override;
  MemoryStats memory_stats() override { return allocator_.stats(); }
  void reset_peak_memory_stats() override { allocator_.reset_peak(); }
  void empty_cache() override { allocator_.empty_cache(); }

  void fill(const Tensor& dst, double value) override;  // elementwise.cu
  void mul_scalar_inplace(const Tensor& dst, double value) override;
  // multi_tensor.cu
  bool unscale_and_check_finite(const std::vector<Tensor>& grads, double inv_scale) override;
  void adam_step(const std::vector<AdamUpdate>& updates, double beta1, double beta2, double eps) override;
  void sgd_step(const std::vector<SgdUpdate>& updates, double momentum, double dampening, bool nesterov) override;
  double sum_of_squares(const std::vector<Tensor>& tensors) override;
  int64_t count_zeros(const std::vector<Tensor>& tensors) override;

 protected:
  // The kernels behind Backend's checked entry points (tensor/backend.h).
  // elementwise.cu
  void copy_kernel(const Tensor& src, const Tensor& dst) override;
  void arange_kernel(const Tensor& dst, double start, double step) override;
  void uniform_kernel(const Tensor& dst, uint64_t seed, uint64_t offset, double low, double high) override;
  void normal_kernel(const Tensor& dst, uint64_t seed, uint64_t offset, double mean, double std) override;
  void randint_kernel(const Tensor& dst, uint64_t seed, uint64_t offset, int64_t low, int64_t high) override;
  void unary_kernel(UnaryOp op, const Tensor& x, const Tensor& out, double scalar) override;
  void unary_backward_kernel(UnaryOp op, const Tensor& in, const Tensor& grad_out, const Tensor& grad_x,
                             double scalar) override;
  void binary_kernel(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) override;
  void binary_scalar_kernel(BinaryOp op, const Tensor& a, double scalar, bool scalar_first,
                            const Tensor& out) override;
  void where_kernel(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) override;
  void add_inplace_kernel(const Tensor& dst, const Tensor& src, double alpha) override;
  void dropout_kernel(const Tensor& x, double p, uint64_t seed, uint64_t offset, const Tensor& out) override;
  // reduce.cu
  void reduce_kernel(ReduceOp op, const Tensor& x, const std::vector<int64_t>& dims, const Tensor& out) override;
  void var_kernel(const Tensor& x, const std::vector<int64_t>& dims, int64_t correction, const Tensor& out) override;
  void softmax_kernel(const Tensor& x, int64_t dim, bool log, const Tensor& out) override;
  void softmax_backward_kernel(const Tensor& y, const Tensor& grad_y, int64_t dim, bool log,
                               const Tensor& grad_x) override;
  // matmul.cu
  void matmul_kernel(const Tensor& a, const Tensor& b, const Tensor& out, const Tensor& bias) override;
  // norm.cu
  void layer_norm_kernel(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, const Tensor& out,
                         const Tensor& mean, const Tensor& rstd) override;
  void layer_norm_backward_kernel(const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor& mean,
                                  const Tensor& rstd, const Tensor& grad_x, const Tensor& grad_weight,
                                  const Tensor& grad_bias) override;
  void rms_norm_kernel(const Tensor& x, const Tensor& weight, double eps, const Tensor& out,
                       const Tensor& rstd) override;
  void rms_norm_backward_kernel(const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                                const Tensor& grad_x, const Tensor& grad_weight) override;
  // index.cu
  void embedding_kernel(const Tensor& weight, const Tensor& indices, const Tensor& out) override;
  void embedding_backward_kernel(const Tensor& grad_out, const Tensor& indices, const Tensor& grad_weight) override;
  // cross_entropy.cu
  void softmax_cross_entropy_kernel(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                                    const Tensor& loss, const Tensor& lse) override;
  void softmax_cross_entropy_backward_kernel(const Tensor& grad_loss, const Tensor& logits, const Tensor& targets,
                                             const Tensor& lse, int64_t ignore_index,
                                             const Tensor& grad_logits) override;
  // attention.cu
  void causal_attention_kernel(const Tensor& q, const Tensor& k, const Tensor& v, double scale, const Tensor& out,
                               const Tensor& lse) override;
  void causal_attention_backward_kernel(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                                        const Tensor& out, const Tensor& lse, double scale, const Tensor& grad_q,
                                        const Tensor& grad_k, const Tensor& grad_v) override;
  // fp8.cu
  std::vector<float> quantize_row_amax_kernel(const Tensor& x, int64_t block_cols) override;
  EncodeCounts quantize_encode_kernel(const Tensor& x, const BlockEncodePlan& plan, const Tensor& values) override;
  void scaled_gemm_kernel(const GemmOperand& a, const GemmOperand& b, int accumulator_bits,
                          const Tensor& out) override;

 private:
  int device_;
  cudaStream_t stream_ = nullptr;
  void* cublaslt_ = nullptr;
  void* workspace_ = nullptr;
  CachingAllocator allocator_;
};

// fp8.cu: the device's compute capability as major * 10 + minor (90 for sm_90), and how many scaled_matmul
// products have run on the fp8 tensor cores in this process (a test's evidence that the path was taken).
int compute_capability(int device);
int64_t fp8_tensor_core_gemms();

// The backend of CUDA device `index` (created on first use; Error when there is no such device).
CudaBackend& backend(int index);
// The backend that owns t (t must be a CUDA tensor).
inline CudaBackend& backend_of(const Tensor& t) { return backend(t.device().index); }

}  // namespace mixtape::cuda
