#pragma once
// The kernels a device must provide. Backends implement kernels only: no autograd, no autocast, no shape
// policy. The op front ends (tensor/ops*.cpp) check arguments, allocate outputs and call these.
//
// One kernel contract: each kernel entry point below with arguments to check is public and non-virtual; it
// checks them (shapes, dtypes, layouts: tensor/kernel_contract.cpp) and then calls the device's protected
// `*_kernel`. So every backend sees only arguments that keep the contract, and a CPU or CUDA kernel re-checks
// only what is specific to it (a grid limit, a head dim it has no kernel for). Entry points with nothing to
// check (fill, mul_scalar_inplace, the AMP and multi-tensor updates) are the virtuals themselves.
//
// Conventions for every kernel:
// - inputs may be arbitrarily strided views (stride 0 for broadcast dims); outputs are freshly allocated
//   and contiguous unless a kernel says otherwise;
// - all floating tensors of one call share one dtype unless stated; f16/bf16 accumulate in fp32, f64 in
//   f64, and the result is rounded once on store.
#include <cstdint>
#include <string>
#include <vector>

#include "tensor/quantize.h"
#include "tensor/scale_rules.h"
#include "tensor/tensor.h"
#include "tensor/unary_ops.h"

namespace mixtape {

// Eq: 1 where a == b, else 0 (IEEE equality: inf equals inf, NaN equals nothing); no op records it, it only
// builds masks inside backward functions (max/min's ties). Not offered by binary_scalar.
enum class BinaryOp { Add, Sub, Mul, Div, Pow, Eq };
enum class ReduceOp { Sum, Mean, Max, Min };

enum class WeightDecayMode { None, L2, Decoupled };  // Adam: none, L2 folded into the gradient, AdamW

// One parameter's Adam update: its tensors (contiguous, equal numel) and its per-step scalars.
struct AdamUpdate {
  Tensor param, grad, exp_avg, exp_avg_sq;
  double step_size = 0;              // lr / (1 - beta1^t)
  double bias_correction2_sqrt = 1;  // sqrt(1 - beta2^t)
  double weight_decay = 0;           // the L2 coefficient (mode L2)
  double decay_factor = 1;           // 1 - lr * weight_decay (mode Decoupled)
  WeightDecayMode mode = WeightDecayMode::None;
};

// One parameter's SGD update.
struct SgdUpdate {
  Tensor param, grad, momentum_buffer;
  double lr = 0, weight_decay = 0;
  bool first_step = false;  // the momentum buffer starts as the first gradient
};

// Bytes held by a device's allocator.
struct MemoryStats {
  size_t allocated_bytes = 0;       // in live tensors
  size_t peak_allocated_bytes = 0;  // the most allocated_bytes has been since the last reset
  size_t cached_bytes = 0;          // freed by tensors, kept by the allocator for reuse
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Allocator& allocator() = 0;
  // Waits until every kernel queued on this device has finished (a no-op on the CPU, which runs in order).
  virtual void synchronize() {}
  virtual MemoryStats memory_stats() = 0;
  virtual void reset_peak_memory_stats() = 0;
  virtual void empty_cache() = 0;  // gives cached blocks back to the system

  // dst[i] = src[i] converted to dst's dtype (any strides on both sides, same shape).
  void copy(const Tensor& src, const Tensor& dst);
  virtual void fill(const Tensor& dst, double value) = 0;
  // dst (contiguous) [i] = start + i * step
  void arange(const Tensor& dst, double start, double step);
  // Philox-based draws on a contiguous dst: element i uses counter (offset + i) under key seed.
  void uniform(const Tensor& dst, uint64_t seed, uint64_t offset, double low, double high);
  void normal(const Tensor& dst, uint64_t seed, uint64_t offset, double mean, double std);
  void randint(const Tensor& dst, uint64_t seed, uint64_t offset, int64_t low, int64_t high);

  // Elementwise; x/a/b are already broadcast to out's shape. `scalar` is the exponent for PowScalar.
  void unary(UnaryOp op, const Tensor& x, const Tensor& out, double scalar);
  // grad_x = grad_out * d op(x) / dx. The derivative reads x or y = op(x), as kUnaryOps says (unary_ops.h);
  // the other of the two may be undefined.
  void unary_backward(UnaryOp op, const Tensor& x, const Tensor& y, const Tensor& grad_out, const Tensor& grad_x,
                      double scalar);
  // a and b have out's dtype, or, where binary_reads_mixed says so, their own (each converted as it is read).
  void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out);
  // Whether binary(op, a, b, out) takes a and b in these dtypes for an `out` of the wider one: the promoting
  // ops (add, sub, mul, div) then read a narrower input in place instead of copying it to the wider dtype.
  virtual bool binary_reads_mixed(DType, DType, DType) const { return false; }
  // out = a op scalar, or scalar op a when scalar_first. The scalar stays in double until the op runs.
  void binary_scalar(BinaryOp op, const Tensor& a, double scalar, bool scalar_first, const Tensor& out);
  // out = cond ? a : b, with cond a bool-like tensor (nonzero = true) of any dtype.
  void where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out);
  // dst += alpha * src (in place, src broadcast to dst)
  void add_inplace(const Tensor& dst, const Tensor& src, double alpha);
  virtual void mul_scalar_inplace(const Tensor& dst, double value) = 0;
  // AMP: multiplies each contiguous floating tensor of `grads` in place by inv_scale (in fp32, f64 for f64,
  // rounded once) and returns whether any element was non-finite before or after the multiply. One pass.
  virtual bool unscale_and_check_finite(const std::vector<Tensor>& grads, double inv_scale) = 0;

  // ---- fused optimizer updates (multi-tensor: a device may batch every tensor of the list into few launches)
  // Adam/AdamW on contiguous tensors (see optim/adam.h for the update); exp_avg/exp_avg_sq are kept in
  // acc_t<param dtype>; the per-step scalars come in double and are rounded once to that type.
  virtual void adam_step(const std::vector<AdamUpdate>& updates, double beta1, double beta2, double eps) = 0;
  // SGD with momentum (optim/sgd.h); momentum_buffer is undefined when momentum == 0.
  virtual void sgd_step(const std::vector<SgdUpdate>& updates, double momentum, double dampening,
                        bool nesterov) = 0;
  // Sum of squares of every element of every tensor, accumulated in double in an order fixed by the sizes
  // alone (reproducible bit for bit on one device): the global gradient norm's reduction.
  virtual double sum_of_squares(const std::vector<Tensor>& tensors) = 0;
  // How many elements of the tensors are exactly zero (AMP's log_num_zeros_in_grad).
  virtual int64_t count_zeros(const std::vector<Tensor>& tensors) = 0;

  // Reduces x over `dims` (sorted, unique) into out, which has x's shape with those dims set to 1.
  void reduce(ReduceOp op, const Tensor& x, const std::vector<int64_t>& dims, const Tensor& out);
  // Variance over dims with `correction` (0: population, 1: Bessel); two-pass for accuracy.
  void var(const Tensor& x, const std::vector<int64_t>& dims, int64_t correction, const Tensor& out);
  void softmax(const Tensor& x, int64_t dim, bool log, const Tensor& out);
  // grad_x from y = softmax(x) (or log_softmax when log).
  void softmax_backward(const Tensor& y, const Tensor& grad_y, int64_t dim, bool log, const Tensor& grad_x);

  // out[..., M, N] = a[..., M, K] @ b[..., K, N] (+ bias[N]); batch dims are already broadcast (may have
  // stride 0). bias (contiguous [N], a's dtype) may be undefined; when given it is added to the accumulator
  // before the single rounding into out (a linear layer's epilogue).
  void matmul(const Tensor& a, const Tensor& b, const Tensor& out, const Tensor& bias);
  // Whether matmul on this dtype widens its operands to f32 and rounds the f32 product (no GEMM of that dtype
  // here, as for f16 on a CPU): a caller that feeds one operand to several products then widens it once.
  virtual bool matmul_widens(DType) const { return false; }

  // Normalisation over the last dim of x [N, C] (contiguous). mean/rstd are f32 [N] (f64 when x is f64, so
  // the reference dtype keeps full precision: stats_dtype); weight/bias [C] may be undefined. rms_norm has
  // no mean.
  void layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, const Tensor& out,
                  const Tensor& mean, const Tensor& rstd);
  // grad_x / grad_weight / grad_bias may be undefined (not needed); mean and rstd are required.
  void layer_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor& mean,
                           const Tensor& rstd, const Tensor& grad_x, const Tensor& grad_weight,
                           const Tensor& grad_bias);
  void rms_norm(const Tensor& x, const Tensor& weight, double eps, const Tensor& out, const Tensor& rstd);
  void rms_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                         const Tensor& grad_x, const Tensor& grad_weight);

  // out[i, :] = weight[indices[i], :]; indices i32/i64 (already range-checked by the front end).
  void embedding(const Tensor& weight, const Tensor& indices, const Tensor& out);
  // grad_weight (zeroed by the caller) [indices[i], :] += grad_out[i, :], deterministic order.
  void embedding_backward(const Tensor& grad_out, const Tensor& indices, const Tensor& grad_weight);

  // Dropout: keep element i iff uniform(seed, offset + i) >= p; out = keep ? x / (1 - p) : 0. The draw is
  // counter-based, so backward is the same call on grad_out (no mask is stored) and CPU and GPU agree.
  void dropout(const Tensor& x, double p, uint64_t seed, uint64_t offset, const Tensor& out);

  // Cross-entropy over rows of logits [N, V] (contiguous) with targets i32/i64 [N], each in [0, V) or
  // ignore_index (range-checked by the front end). loss (0-d; f32, or f64 for f64 logits) = mean over the
  // counted rows of lse_i - logits[i, target_i], 0 when none counts; lse (f32 [N], f64 for f64) is saved.
  void softmax_cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index, const Tensor& loss,
                             const Tensor& lse);
  // grad_logits [N, V] (logits' dtype) = (softmax(logits) - onehot(target)) * grad_loss / count, recomputed
  // from logits and lse straight into grad_logits; ignored rows get 0. grad_loss is 0-d, loss's dtype.
  void softmax_cross_entropy_backward(const Tensor& grad_loss, const Tensor& logits, const Tensor& targets,
                                      const Tensor& lse, int64_t ignore_index, const Tensor& grad_logits);
  // Causal attention over q, k, v, out [B, H, T, D]: out_i = sum_{j <= i} softmax_j(scale q_i.k_j) v_j.
  // Every [B, H, T, D] operand here needs only its last dim contiguous (B, H, T strides are free: e.g. the
  // thirds of a fused qkv [B, T, 3C] seen as heads); outputs are written through their strides and must not
  // overlap. lse [B, H, T] (f32, f64 for f64; contiguous) gets each query row's log-sum-exp of scores;
  // memory O(B*H*T*D).
  void causal_attention(const Tensor& q, const Tensor& k, const Tensor& v, double scale, const Tensor& out,
                        const Tensor& lse);
  // grad_q/k/v [B, H, T, D] (strided as above) from grad_out, the forward's out and lse; probabilities
  // recomputed.
  void causal_attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                                 const Tensor& out, const Tensor& lse, double scale, const Tensor& grad_q,
                                 const Tensor& grad_k, const Tensor& grad_v);

  // ---- fp8 and block-scaled GEMMs: quantize_for_gemm's two passes and scaled_matmul (tensor/quantize.h) ----
  // The rules that pick scales and round values are tensor/scale_rules.h's, one copy for every device; what
  // a device provides is the passes over the data. The CPU's kernels are the defaults below (host memory).
  // Each row's max |x| over every run of block_cols values of x (contiguous f32 [R, C], or bf16 on the CPU,
  // which reads it without an f32 copy): [R * ceil(C / block_cols)] on the host, row-major, NaN for a run
  // holding Inf or NaN (max is exact: any order agrees).
  std::vector<float> quantize_row_amax(const Tensor& x, int64_t block_cols);
  // Encodes x (as above) by plan into values (contiguous [R, C] on x's device: bf16, f32, or the fp8 codes of
  // plan.format where the device's GEMM takes them); returns what saturated and flushed.
  EncodeCounts quantize_encode(const Tensor& x, const BlockEncodePlan& plan, const Tensor& values);
  // out (contiguous f32 [M, N]) = scaled_matmul(a, b, accumulator_bits) (tensor/quantize.h), operands on out's
  // device and already checked by scaled_matmul; their values contiguous (on the CPU: or column-major).
  void scaled_gemm(const GemmOperand& a, const GemmOperand& b, int accumulator_bits, const Tensor& out);

 protected:
  // The device's kernels, called only by the entry points above once the arguments keep the contract.
  virtual void copy_kernel(const Tensor& src, const Tensor& dst) = 0;
  virtual void arange_kernel(const Tensor& dst, double start, double step) = 0;
  virtual void uniform_kernel(const Tensor& dst, uint64_t seed, uint64_t offset, double low, double high) = 0;
  virtual void normal_kernel(const Tensor& dst, uint64_t seed, uint64_t offset, double mean, double std) = 0;
  virtual void randint_kernel(const Tensor& dst, uint64_t seed, uint64_t offset, int64_t low, int64_t high) = 0;
  virtual void unary_kernel(UnaryOp op, const Tensor& x, const Tensor& out, double scalar) = 0;
  // `in` is x or y, whichever the op's derivative reads (already checked to be defined).
  virtual void unary_backward_kernel(UnaryOp op, const Tensor& in, const Tensor& grad_out, const Tensor& grad_x,
                                     double scalar) = 0;
  virtual void binary_kernel(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) = 0;
  virtual void binary_scalar_kernel(BinaryOp op, const Tensor& a, double scalar, bool scalar_first,
                                    const Tensor& out) = 0;
  virtual void where_kernel(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) = 0;
  virtual void add_inplace_kernel(const Tensor& dst, const Tensor& src, double alpha) = 0;
  virtual void reduce_kernel(ReduceOp op, const Tensor& x, const std::vector<int64_t>& dims, const Tensor& out) = 0;
  virtual void var_kernel(const Tensor& x, const std::vector<int64_t>& dims, int64_t correction,
                          const Tensor& out) = 0;
  virtual void softmax_kernel(const Tensor& x, int64_t dim, bool log, const Tensor& out) = 0;
  virtual void softmax_backward_kernel(const Tensor& y, const Tensor& grad_y, int64_t dim, bool log,
                                       const Tensor& grad_x) = 0;
  // Called only when out has elements (an empty product has nothing to write).
  virtual void matmul_kernel(const Tensor& a, const Tensor& b, const Tensor& out, const Tensor& bias) = 0;
  virtual void layer_norm_kernel(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                                 const Tensor& out, const Tensor& mean, const Tensor& rstd) = 0;
  virtual void layer_norm_backward_kernel(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                                          const Tensor& mean, const Tensor& rstd, const Tensor& grad_x,
                                          const Tensor& grad_weight, const Tensor& grad_bias) = 0;
  virtual void rms_norm_kernel(const Tensor& x, const Tensor& weight, double eps, const Tensor& out,
                               const Tensor& rstd) = 0;
  virtual void rms_norm_backward_kernel(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                                        const Tensor& rstd, const Tensor& grad_x, const Tensor& grad_weight) = 0;
  virtual void embedding_kernel(const Tensor& weight, const Tensor& indices, const Tensor& out) = 0;
  virtual void embedding_backward_kernel(const Tensor& grad_out, const Tensor& indices,
                                         const Tensor& grad_weight) = 0;
  virtual void dropout_kernel(const Tensor& x, double p, uint64_t seed, uint64_t offset, const Tensor& out) = 0;
  virtual void softmax_cross_entropy_kernel(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                                            const Tensor& loss, const Tensor& lse) = 0;
  virtual void softmax_cross_entropy_backward_kernel(const Tensor& grad_loss, const Tensor& logits,
                                                     const Tensor& targets, const Tensor& lse, int64_t ignore_index,
                                                     const Tensor& grad_logits) = 0;
  virtual void causal_attention_kernel(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                                       const Tensor& out, const Tensor& lse) = 0;
  virtual void causal_attention_backward_kernel(const Tensor& grad_out, const Tensor& q, const Tensor& k,
                                                const Tensor& v, const Tensor& out, const Tensor& lse, double scale,
                                                const Tensor& grad_q, const Tensor& grad_k,
                                                const Tensor& grad_v) = 0;
  // The CPU's (tensor/cpu/quantize_kernels.cpp, tensor/quantize.cpp): host memory. A device with its own
  // memory overrides all three.
  virtual std::vector<float> quantize_row_amax_kernel(const Tensor& x, int64_t block_cols);
  virtual EncodeCounts quantize_encode_kernel(const Tensor& x, const BlockEncodePlan& plan, const Tensor& values);
  virtual void scaled_gemm_kernel(const GemmOperand& a, const GemmOperand& b, int accumulator_bits,
                                  const Tensor& out);
};

// Copies the bytes of contiguous src into contiguous dst (same dtype and numel) on another device; returns
// when the copy is complete.
void copy_between_devices(const Tensor& src, const Tensor& dst);
// Testing aid: while on, every new CUDA allocation is filled with 0xFF bytes (NaN in f32/f16/bf16/f64, -1 in
// integers), so a kernel that leaves an output element unwritten shows up as a NaN. Off by default; a no-op
// without CUDA.
void set_cuda_allocation_poisoning(bool enabled);
// Which kernels serve causal attention on CUDA in f16/bf16 with a head dim of 32, 64 or 128. TensorCores (the
// default): the products on the tensor cores, with p and ds rounded to the input dtype as their operands, as
// FlashAttention and the CPU's bf16 kernels do. Simt: p and ds kept in fp32, the CPU portable kernel's
// numerics, several times slower. f32, f64 and other head dims always take Simt. Returns the previous choice;
// without CUDA the setting is kept and changes nothing.
enum class CudaAttentionKernel { Simt, TensorCores };
CudaAttentionKernel set_cuda_attention_kernel(CudaAttentionKernel kernel);
CudaAttentionKernel cuda_attention_kernel();
// How many CUDA devices this process can use: 0 in a build without CUDA or on a machine without GPU/driver.
int cuda_device_count();
// The GPU's name as the driver reports it ("NVIDIA H100 80GB HBM3"); Error for a bad index or without CUDA.
std::string cuda_device_name(int index);

// The backend of a device (the per-device registry). CPU always exists; CUDA only when built with it.
Backend& backend_for(Device device);
inline Backend& backend_of(const Tensor& t) { return backend_for(t.device()); }
// A device's allocator statistics (current, peak and cached bytes) and a wait for its queued work.
inline MemoryStats memory_stats(Device device) { return backend_for(device).memory_stats(); }
inline void synchronize(Device device) { backend_for(device).synchronize(); }

}  // namespace mixtape
