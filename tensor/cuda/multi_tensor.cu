// Multi-tensor kernels: AMP's fused unscale + non-finite check, the Adam/AdamW and SGD updates, and the
// reductions behind the global gradient norm and AMP's zero count. The math and its order are those of
// tensor/cpu/amp.cpp and tensor/cpu/optim.cpp.
//
// Multi-tensor apply: the tensors of one dtype are packed, up to kMaxTensors at a time, into one kernel
// argument struct (pointers, sizes, per-tensor scalars) and processed by ONE launch: the tensors are cut into
// chunks of kChunk elements, numbered across the batch (chunk_begin[t] is tensor t's first chunk), and each
// block walks chunks with a grid-stride loop, finding its tensor from the prefix. A model's hundred parameters
// thus cost a few launches instead of a hundred.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "tensor/cuda/common.cuh"
#include "tensor/cuda/cuda_backend.h"

namespace mixtape::cuda {

namespace {

constexpr int64_t kChunk = 16384;  // elements per chunk (one block's unit of work)
constexpr int kBlockThreads = 256;

// One launch's tensors: kDepth pointers per tensor (e.g. param, grad, exp_avg, exp_avg_sq), sizes, the chunk
// prefix and per-tensor scalars Meta. Passed by value as a kernel argument (kept under the 4 KiB limit).
template <int kDepth, class Meta, int kMax>
struct TensorBatch {
  void* ptr[kDepth][kMax];
  int64_t numel[kMax];
  int64_t chunk_begin[kMax + 1];  // chunk_begin[count] = the batch's chunk count
  Meta meta[kMax];
  int count;
};

struct NoMeta {};

// The tensor t and element range [begin, end) of the batch's chunk c.
template <class Batch>
__device__ __forceinline__ void locate(const Batch& batch, int64_t c, int& t, int64_t& begin, int64_t& end) {
  t = 0;
  while (t + 1 < batch.count && batch.chunk_begin[t + 1] <= c) ++t;
  begin = (c - batch.chunk_begin[t]) * kChunk;
  end = begin + kChunk < batch.numel[t] ? begin + kChunk : batch.numel[t];
}

// Fills batches of up to kMax tensors and calls launch(batch, chunks) for each full batch and the last one.
// add() skips empty tensors (no chunks, nothing to do).
template <int kDepth, class Meta, int kMax, class Launch>
class Batcher {
 public:
  using Batch = TensorBatch<kDepth, Meta, kMax>;
  static_assert(sizeof(Batch) <= 4000, "kernel arguments are limited to 4 KiB");

  explicit Batcher(Launch launch) : launch_(launch) { reset(); }
  void add(const std::array<void*, kDepth>& ptrs, int64_t numel, const Meta& meta) {
    if (numel == 0) return;
    const int t = batch_.count;
    for (int k = 0; k < kDepth; ++k) batch_.ptr[k][t] = ptrs[k];
    batch_.numel[t] = numel;
    batch_.meta[t] = meta;
    batch_.chunk_begin[t + 1] = batch_.chunk_begin[t] + (numel + kChunk - 1) / kChunk;
    batch_.count = t + 1;
    if (batch_.count == kMax) flush();
  }
  void flush() {
    if (batch_.count > 0) launch_(batch_, batch_.chunk_begin[batch_.count]);
    reset();
  }

 private:
  void reset() {
    batch_ = Batch{};
    batch_.count = 0;
    batch_.chunk_begin[0] = 0;
  }
  Launch launch_;
  Batch batch_;
};

template <int kDepth, class Meta, int kMax, class Launch>
Batcher<kDepth, Meta, kMax, Launch> make_batcher(Launch launch) {
  return Batcher<kDepth, Meta, kMax, Launch>(launch);
}

unsigned blocks_for_chunks(int64_t chunks) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(chunks, 65535LL * 8)));
}

// Calls fn.template operator()<T>(indices) once per floating dtype present, with the indices (in list order)
// of the items of that dtype.
template <class Item, class DtypeOf, class Fn>
void for_each_dtype(const std::vector<Item>& items, DtypeOf dtype_of_item, const char* what, Fn&& fn) {
  for (const Item& item : items)
    if (!is_floating(dtype_of_item(item)))  // as the CPU: dispatch_float's error names the dtype
      dispatch_float(dtype_of_item(item), what, [&]<typename T>() {});
  for (DType dtype : {DType::F32, DType::F16, DType::BF16, DType::F64}) {
    std::vector<size_t> indices;
    for (size_t i = 0; i < items.size(); ++i)
      if (dtype_of_item(items[i]) == dtype) indices.push_back(i);
    if (indices.empty()) continue;
    dispatch_float(dtype, what, [&]<typename T>() { fn.template operator()<T>(indices); });
  }
}

// ---- unscale_and_check_finite -------------------------------------------------------------------------------

constexpr int kUnscaleMax = 96;

// g = round(g * inv_scale) in the acc type; *found = 1 if any input or stored result is inf/NaN.
template <class D>
__global__ void unscale_kernel(TensorBatch<1, NoMeta, kUnscaleMax> batch, int64_t chunks, device_acc_t<D> inv,
                               int* found) {
  using A = device_acc_t<D>;
  bool bad = false;
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    int t;
    int64_t begin, end;
    locate(batch, c, t, begin, end);
    D* g = static_cast<D*>(batch.ptr[0][t]);
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      const A x = load_as<A>(g[i]);
      const D y = store<D>(x * inv);
      // Finite before and after: a finite x whose scaled value overflows the dtype is reported too.
      bad = bad || !isfinite(x) || !isfinite(load_as<A>(y));
      g[i] = y;
    }
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found = 1;
}

// ---- Adam / AdamW -------------------------------------------------------------------------------------------

template <class A>
struct AdamMeta {
  A step_size, bias_correction2_sqrt, weight_decay, decay_factor;
  int mode;  // WeightDecayMode
};

template <class A>
struct AdamScalars {
  A beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
};

constexpr int kAdamMax = 32;

// Per element, exactly tensor/cpu/optim.cpp's adam_update.
template <class D>
__global__ void adam_kernel(TensorBatch<4, AdamMeta<device_acc_t<D>>, kAdamMax> batch, int64_t chunks,
                            AdamScalars<device_acc_t<D>> s) {
  using A = device_acc_t<D>;
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    int t;
    int64_t begin, end;
    locate(batch, c, t, begin, end);
    D* param = static_cast<D*>(batch.ptr[0][t]);
    const D* grad = static_cast<const D*>(batch.ptr[1][t]);
    A* exp_avg = static_cast<A*>(batch.ptr[2][t]);
    A* exp_avg_sq = static_cast<A*>(batch.ptr[3][t]);
    const AdamMeta<A> u = batch.meta[t];
    const bool decoupled = u.mode == static_cast<int>(WeightDecayMode::Decoupled);
    const bool l2 = u.mode == static_cast<int>(WeightDecayMode::L2);
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      A p = load_as<A>(param[i]);
      A g = load_as<A>(grad[i]);
      if (decoupled) p = p * u.decay_factor;  // AdamW, before the step
      if (l2) g = g + u.weight_decay * p;     // Adam: L2 in the gradient
      const A m = s.beta1 * exp_avg[i] + s.one_minus_beta1 * g;
      const A v = s.beta2 * exp_avg_sq[i] + s.one_minus_beta2 * (g * g);
      exp_avg[i] = m;
      exp_avg_sq[i] = v;
      const A denom = sqrt(v) / u.bias_correction2_sqrt + s.eps;
      param[i] = store<D>(p - (u.step_size * m) / denom);  // PyTorch's addcdiv order: (value * m) / denom
    }
  }
}

// ---- SGD ----------------------------------------------------------------------------------------------------

template <class A>
struct SgdMeta {
  A lr, weight_decay;
  int first_step;
};

template <class A>
struct SgdScalars {
  A momentum, one_minus_dampening;
  int nesterov;
};

constexpr int kSgdMax = 48;

// Per element, exactly tensor/cpu/optim.cpp's sgd_update (ptr[2] is null without momentum).
template <class D>
__global__ void sgd_kernel(TensorBatch<3, SgdMeta<device_acc_t<D>>, kSgdMax> batch, int64_t chunks,
                           SgdScalars<device_acc_t<D>> s) {
  using A = device_acc_t<D>;
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    int t;
    int64_t begin, end;
    locate(batch, c, t, begin, end);
    D* param = static_cast<D*>(batch.ptr[0][t]);
    const D* grad = static_cast<const D*>(batch.ptr[1][t]);
    A* buffer = static_cast<A*>(batch.ptr[2][t]);
    const SgdMeta<A> u = batch.meta[t];
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      const A p = load_as<A>(param[i]);
      A g = load_as<A>(grad[i]);
      if (u.weight_decay != 0) g += u.weight_decay * p;  // L2 penalty folded into the gradient
      if (s.momentum != 0) {
        const A buf = u.first_step ? g : s.momentum * buffer[i] + s.one_minus_dampening * g;
        buffer[i] = buf;
        g = s.nesterov ? g + s.momentum * buf : buf;
      }
      param[i] = store<D>(p - u.lr * g);
    }
  }
}

// ---- sum of squares / count of zeros --------------------------------------------------------------------------

constexpr int kReduceMax = 96;

// Sums over the block with a fixed tree (thread 0 gets the total).
template <class V>
__device__ __forceinline__ V block_sum(V v) {
  __shared__ V shared[kBlockThreads / 32];
#pragma unroll
  for (int width = 16; width > 0; width /= 2) v += __shfl_down_sync(0xffffffffu, v, width);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // a previous call's reads of `shared` are done
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    v = shared[0];
    for (int k = 1; k < kBlockThreads / 32; ++k) v += shared[k];
  }
  return v;
}

// partial[first_chunk + c] = sum of squares (in double) of the batch's chunk c. A chunk's sum depends only on
// its elements and the fixed block size: thread k adds elements k, k + 256, ... in order, then a fixed tree.
template <class D>
__global__ void squares_kernel(TensorBatch<1, NoMeta, kReduceMax> batch, int64_t chunks, double* partial,
                               int64_t first_chunk) {
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    int t;
    int64_t begin, end;
    locate(batch, c, t, begin, end);
    const D* g = static_cast<const D*>(batch.ptr[0][t]);
    double sum = 0;
    for (int64_t i = begin + threadIdx.x; i < end; i += kBlockThreads) {
      // Squares of f32/f16/bf16 values are exact in double.
      const double x = load_as<double>(g[i]);
      sum += x * x;
    }
    sum = block_sum(sum);
    if (threadIdx.x == 0) partial[first_chunk + c] = sum;
  }
}

// *total = sum of partial[0..n) in a fixed order (one block).
__global__ void sum_partials_kernel(const double* partial, int64_t n, double* total) {
  double sum = 0;
  for (int64_t i = threadIdx.x; i < n; i += kBlockThreads) sum += partial[i];
  sum = block_sum(sum);
  if (threadIdx.x == 0) *total = sum;
}

template <class D>
__global__ void count_zeros_kernel(TensorBatch<1, NoMeta, kReduceMax> batch, int64_t chunks,
                                   unsigned long long* zeros) {
  using A = device_acc_t<D>;
  unsigned long long count = 0;
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    int t;
    int64_t begin, end;
    locate(batch, c, t, begin, end);
    const D* p = static_cast<const D*>(batch.ptr[0][t]);
    for (int64_t i = begin + threadIdx.x; i < end; i += kBlockThreads) count += load_as<A>(p[i]) == A(0);
  }
  count = block_sum(count);
  if (threadIdx.x == 0 && count > 0) atomicAdd(zeros, count);
}

DType dtype_of_tensor(const Tensor& t) { return t.dtype(); }

}  // namespace

bool CudaBackend::unscale_and_check_finite(const std::vector<Tensor>& grads, double inv_scale) {
  if (grads.empty()) return false;
  const cudaStream_t s = stream();
  const Tensor flag = Tensor::empty({1}, DType::I32, Device::cuda(device()));
  int* found = static_cast<int*>(flag.data_ptr());
  MIXTAPE_CUDA_CHECK(cudaMemsetAsync(found, 0, sizeof(int), s));
  for_each_dtype(grads, dtype_of_tensor, "unscale_and_check_finite",
                 [&]<typename T>(const std::vector<size_t>& indices) {
                   using D = device_t<T>;
                   using A = device_acc_t<D>;
                   const A inv = static_cast<A>(inv_scale);
                   auto batcher = make_batcher<1, NoMeta, kUnscaleMax>([&](const auto& batch, int64_t chunks) {
                     unscale_kernel<D><<<blocks_for_chunks(chunks), kBlockThreads, 0, s>>>(batch, chunks, inv, found);
                     MIXTAPE_KERNEL_CHECK();
                   });
                   for (size_t i : indices) batcher.add({grads[i].data_ptr()}, grads[i].numel(), NoMeta{});
                   batcher.flush();
                 });
  int host_found = 0;
  MIXTAPE_CUDA_CHECK(cudaMemcpyAsync(&host_found, found, sizeof(int), cudaMemcpyDeviceToHost, s));
  MIXTAPE_CUDA_CHECK(cudaStreamSynchronize(s));
  return host_found != 0;
}

void CudaBackend::adam_step(const std::vector<AdamUpdate>& updates, double beta1, double beta2, double eps) {
  const cudaStream_t s = stream();
  for_each_dtype(
      updates, [](const AdamUpdate& u) { return u.param.dtype(); }, "adam_step",
      [&]<typename T>(const std::vector<size_t>& indices) {
        using D = device_t<T>;
        using A = device_acc_t<D>;
        // The scalars come in double and are rounded once to the compute type, as on the CPU.
        const AdamScalars<A> scalars{static_cast<A>(beta1), static_cast<A>(1 - beta1), static_cast<A>(beta2),
                                     static_cast<A>(1 - beta2), static_cast<A>(eps)};
        auto batcher = make_batcher<4, AdamMeta<A>, kAdamMax>([&](const auto& batch, int64_t chunks) {
          adam_kernel<D><<<blocks_for_chunks(chunks), kBlockThreads, 0, s>>>(batch, chunks, scalars);
          MIXTAPE_KERNEL_CHECK();
        });
        for (size_t i : indices) {
          const AdamUpdate& u = updates[i];
          const AdamMeta<A> meta{static_cast<A>(u.step_size), static_cast<A>(u.bias_correction2_sqrt),
                                 static_cast<A>(u.weight_decay), static_cast<A>(u.decay_factor),
                                 static_cast<int>(u.mode)};
          batcher.add({u.param.data_ptr(), u.grad.data_ptr(), u.exp_avg.data_ptr(), u.exp_avg_sq.data_ptr()},
                      u.param.numel(), meta);
        }
        batcher.flush();
      });
}

void CudaBackend::sgd_step(const std::vector<SgdUpdate>& updates, double momentum, double dampening, bool nesterov) {
  const cudaStream_t s = stream();
  for_each_dtype(
      updates, [](const SgdUpdate& u) { return u.param.dtype(); }, "sgd_step",
      [&]<typename T>(const std::vector<size_t>& indices) {
        using D = device_t<T>;
        using A = device_acc_t<D>;
        const SgdScalars<A> scalars{static_cast<A>(momentum), static_cast<A>(1 - dampening), nesterov ? 1 : 0};
        auto batcher = make_batcher<3, SgdMeta<A>, kSgdMax>([&](const auto& batch, int64_t chunks) {
          sgd_kernel<D><<<blocks_for_chunks(chunks), kBlockThreads, 0, s>>>(batch, chunks, scalars);
          MIXTAPE_KERNEL_CHECK();
        });
        for (size_t i : indices) {
          const SgdUpdate& u = updates[i];
          const SgdMeta<A> meta{static_cast<A>(u.lr), static_cast<A>(u.weight_decay), u.first_step ? 1 : 0};
          void* buffer = momentum != 0 ? u.momentum_buffer.data_ptr() : nullptr;
          batcher.add({u.param.data_ptr(), u.grad.data_ptr(), buffer}, u.param.numel(), meta);
        }
        batcher.flush();
      });
}

double CudaBackend::sum_of_squares(const std::vector<Tensor>& tensors) {
  if (tensors.empty()) return 0;
  const cudaStream_t s = stream();
  // Contiguous copies of strided tensors (a broadcast gradient counts each of its elements, as on the CPU).
  std::vector<Tensor> flats;
  flats.reserve(tensors.size());
  int64_t total_chunks = 0;
  for (const Tensor& t : tensors) {
    flats.push_back(t.contiguous());
    total_chunks += (t.numel() + kChunk - 1) / kChunk;
  }
  if (total_chunks == 0) return 0;
  // One partial sum per chunk, in a fixed order (dtype groups, then list order), then one fixed-order sum:
  // the result depends on the sizes alone.
  const Tensor partial = Tensor::empty({total_chunks + 1}, DType::F64, Device::cuda(device()));
  double* partial_ptr = static_cast<double*>(partial.data_ptr());
  int64_t first_chunk = 0;
  for_each_dtype(flats, dtype_of_tensor, "sum_of_squares", [&]<typename T>(const std::vector<size_t>& indices) {
    using D = device_t<T>;
    auto batcher = make_batcher<1, NoMeta, kReduceMax>([&](const auto& batch, int64_t chunks) {
      squares_kernel<D><<<blocks_for_chunks(chunks), kBlockThreads, 0, s>>>(batch, chunks, partial_ptr, first_chunk);
      MIXTAPE_KERNEL_CHECK();
      first_chunk += chunks;
    });
    for (size_t i : indices) batcher.add({flats[i].data_ptr()}, flats[i].numel(), NoMeta{});
    batcher.flush();
  });
  double* total = partial_ptr + total_chunks;
  sum_partials_kernel<<<1, kBlockThreads, 0, s>>>(partial_ptr, total_chunks, total);
  MIXTAPE_KERNEL_CHECK();
  double host_total = 0;
  MIXTAPE_CUDA_CHECK(cudaMemcpyAsync(&host_total, total, sizeof(double), cudaMemcpyDeviceToHost, s));
  MIXTAPE_CUDA_CHECK(cudaStreamSynchronize(s));
  return host_total;
}

int64_t CudaBackend::count_zeros(const std::vector<Tensor>& tensors) {
  if (tensors.empty()) return 0;
  const cudaStream_t s = stream();
  std::vector<Tensor> flats;
  flats.reserve(tensors.size());
  for (const Tensor& t : tensors) flats.push_back(t.contiguous());
  const Tensor counter = Tensor::empty({1}, DType::I64, Device::cuda(device()));
  auto* zeros = static_cast<unsigned long long*>(counter.data_ptr());
  MIXTAPE_CUDA_CHECK(cudaMemsetAsync(zeros, 0, sizeof(unsigned long long), s));
  for_each_dtype(flats, dtype_of_tensor, "count_zeros", [&]<typename T>(const std::vector<size_t>& indices) {
    using D = device_t<T>;
    auto batcher = make_batcher<1, NoMeta, kReduceMax>([&](const auto& batch, int64_t chunks) {
      count_zeros_kernel<D><<<blocks_for_chunks(chunks), kBlockThreads, 0, s>>>(batch, chunks, zeros);
      MIXTAPE_KERNEL_CHECK();
    });
    for (size_t i : indices) batcher.add({flats[i].data_ptr()}, flats[i].numel(), NoMeta{});
    batcher.flush();
  });
  unsigned long long host_zeros = 0;
  MIXTAPE_CUDA_CHECK(cudaMemcpyAsync(&host_zeros, zeros, sizeof(host_zeros), cudaMemcpyDeviceToHost, s));
  MIXTAPE_CUDA_CHECK(cudaStreamSynchronize(s));
  return static_cast<int64_t>(host_zeros);
}

}  // namespace mixtape::cuda
