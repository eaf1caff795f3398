#pragma once
// Public: bench/ and tests read the CPU's routes and allocator here (bf16_gemm, f16_matmul_splits,
// caching_allocator); everything else reaches the CPU backend through tensor/backend.h.
// The CPU backend: oneDNN for matmul, hand-written OpenMP kernels for the rest. Its member functions are
// defined across tensor/cpu/*.cpp, one file per kernel family.
#include <cstddef>
#include <map>
#include <mutex>

#include "tensor/backend.h"

namespace mixtape::cpu {

// Caches freed blocks by size so a training loop's repeated allocations do not go back to the OS (glibc
// returns every block above 32 MiB with munmap, and the page faults of a fresh mmap cost as much as the
// kernel that fills it). Blocks are 64-byte aligned.
class CachingAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes) override;
  void deallocate(void* ptr, size_t nbytes) override;
  ~CachingAllocator() override;

  struct Stats {
    size_t allocated_bytes = 0;  // in live tensors
    size_t peak_allocated_bytes = 0;
    size_t cached_bytes = 0;  // freed and kept for reuse
  };
  Stats stats() const;
  void empty_cache();  // returns every cached block to the OS
  void reset_peak();
  static constexpr size_t kMaxCachedBytes = size_t{2} << 30;

 private:
  static size_t round_size(size_t nbytes);
  mutable std::mutex mutex_;
  std::multimap<size_t, void*> free_blocks_;
  Stats stats_;
};

class CpuBackend final : public Backend {
 public:
  Allocator& allocator() override { return allocator_; }
  MemoryStats memory_stats() override;
  void reset_peak_memory_stats() override;
  void empty_cache() override { allocator_.empty_cache(); }
  CachingAllocator& caching_allocator() { return allocator_; }
  void fill(const Tensor& dst, double value) override;
  // elementwise.cpp
  void mul_scalar_inplace(const Tensor& dst, double value) override;
  bool binary_reads_mixed(DType a, DType b, DType out) const override;
  // amp.cpp
  bool unscale_and_check_finite(const std::vector<Tensor>& grads, double inv_scale) override;
  // optim.cpp
  void adam_step(const std::vector<AdamUpdate>& updates, double beta1, double beta2, double eps) override;
  void sgd_step(const std::vector<SgdUpdate>& updates, double momentum, double dampening, bool nesterov) override;
  double sum_of_squares(const std::vector<Tensor>& tensors) override;
  int64_t count_zeros(const std::vector<Tensor>& tensors) override;
  // matmul.cpp
  bool matmul_widens(DType dtype) const override;

 protected:
  // The kernels behind Backend's checked entry points (tensor/backend.h).
  // cpu_backend.cpp
  void copy_kernel(const Tensor& src, const Tensor& dst) override;
  void arange_kernel(const Tensor& dst, double start, double step) override;
  void uniform_kernel(const Tensor& dst, uint64_t seed, uint64_t offset, double low, double high) override;
  void normal_kernel(const Tensor& dst, uint64_t seed, uint64_t offset, double mean, double std) override;
  void randint_kernel(const Tensor& dst, uint64_t seed, uint64_t offset, int64_t low, int64_t high) override;
  // elementwise.cpp
  void unary_kernel(UnaryOp op, const Tensor& x, const Tensor& out, double scalar) override;
  void unary_backward_kernel(UnaryOp op, const Tensor& in, const Tensor& grad_out, const Tensor& grad_x,
                             double scalar) override;
  void binary_kernel(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) override;
  void binary_scalar_kernel(BinaryOp op, const Tensor& a, double scalar, bool scalar_first,
                            const Tensor& out) override;
  void where_kernel(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) override;
  void add_inplace_kernel(const Tensor& dst, const Tensor& src, double alpha) override;
  // reduce.cpp
  void reduce_kernel(ReduceOp op, const Tensor& x, const std::vector<int64_t>& dims, const Tensor& out) override;
  void var_kernel(const Tensor& x, const std::vector<int64_t>& dims, int64_t correction, const Tensor& out) override;
  void softmax_kernel(const Tensor& x, int64_t dim, bool log, const Tensor& out) override;
  void softmax_backward_kernel(const Tensor& y, const Tensor& grad_y, int64_t dim, bool log,
                               const Tensor& grad_x) override;
  // matmul.cpp
  void matmul_kernel(const Tensor& a, const Tensor& b, const Tensor& out, const Tensor& bias) override;
  // norm.cpp
  void layer_norm_kernel(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, const Tensor& out,
                         const Tensor& mean, const Tensor& rstd) override;
  void layer_norm_backward_kernel(const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor& mean,
                                  const Tensor& rstd, const Tensor& grad_x, const Tensor& grad_weight,
                                  const Tensor& grad_bias) override;
  void rms_norm_kernel(const Tensor& x, const Tensor& weight, double eps, const Tensor& out,
                       const Tensor& rstd) override;
  void rms_norm_backward_kernel(const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                                const Tensor& grad_x, const Tensor& grad_weight) override;
  void dropout_kernel(const Tensor& x, double p, uint64_t seed, uint64_t offset, const Tensor& out) override;
  // index.cpp
  void embedding_kernel(const Tensor& weight, const Tensor& indices, const Tensor& out) override;
  void embedding_backward_kernel(const Tensor& grad_out, const Tensor& indices, const Tensor& grad_weight) override;
  // cross_entropy.cpp
  void softmax_cross_entropy_kernel(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                                    const Tensor& loss, const Tensor& lse) override;
  void softmax_cross_entropy_backward_kernel(const Tensor& grad_loss, const Tensor& logits, const Tensor& targets,
                                             const Tensor& lse, int64_t ignore_index,
                                             const Tensor& grad_logits) override;
  // attention.cpp
  void causal_attention_kernel(const Tensor& q, const Tensor& k, const Tensor& v, double scale, const Tensor& out,
                               const Tensor& lse) override;
  void causal_attention_backward_kernel(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                                        const Tensor& out, const Tensor& lse, double scale, const Tensor& grad_q,
                                        const Tensor& grad_k, const Tensor& grad_v) override;

 private:
  CachingAllocator allocator_;
};

CpuBackend& cpu_backend();

// Whether f16 products run as exact sums of bf16 products on oneDNN's AMX kernels (matmul.cpp): this CPU has
// AMX-BF16 and the route is enabled. Elsewhere f16 is multiplied by gemm16 (gemm16.h) or through f32.
bool f16_matmul_splits();
// Turns that route on or off for every later product (on by default) and returns the previous setting: tests
// compare it with the f32 route on the same machine.
bool set_f16_matmul_split_enabled(bool enabled);

// Whether oneDNN has a bf16 GEMM for this CPU (AVX512-BF16 or AMX). Without one, bf16 products run in gemm16
// or through f32, and bf16 has no arithmetic of its own here (PyTorch's bf16 autocast has no fast path either).
bool onednn_has_bf16_gemm();

// How bf16 products run (matmul.cpp, "bf16 products"): on oneDNN's bf16 GEMM (the CPU's bf16 dot product or
// AMX), or on f32 FMAs (gemm16 where the geometry allows, else the f32 GEMM) like f16. Both multiply exactly
// and sum in f32, then round once; the order of the sum differs.
enum class Bf16Gemm { Onednn, F32 };
const char* bf16_gemm_name(Bf16Gemm route);  // "onednn", "f32"

// The route in effect: MIXTAPE_BF16_GEMM's (read on first use), else automatic_bf16_gemm for this CPU.
Bf16Gemm bf16_gemm();
// For tests and comparisons: makes every later bf16 product take `route`; returns the previous one. Onednn
// where oneDNN has no bf16 GEMM is "not supported".
Bf16Gemm set_bf16_gemm(Bf16Gemm route);
// MIXTAPE_BF16_GEMM's value as a route: null, empty or "auto" give the automatic choice; "onednn" where oneDNN
// has no bf16 GEMM, or an unknown name, is an error.
Bf16Gemm bf16_gemm_from_env(const char* value);
// Whether a bf16_dot_rate() value says the bf16 dot product is slow: measured (> 0) and below 0.75 of the f32
// FMA rate. bf16 products (below) and bf16 attention (attention_bf16.h) leave it for f32 FMAs there.
bool slow_bf16_dot(double dot_rate);
// The automatic choice: F32 without a oneDNN bf16 GEMM; Onednn on AMX or where the rate is unknown (<= 0);
// otherwise F32 where slow_bf16_dot(dot_rate).
Bf16Gemm automatic_bf16_gemm(bool onednn_has_bf16, bool amx, double dot_rate);
// This core's multiply-adds per second in bf16 dot products (vdpbf16ps) over those in f32 FMAs, measured once
// in register-only loops; 0 where the build or CPU has no AVX512-BF16.
double bf16_dot_rate();

}  // namespace mixtape::cpu
