// Embedding gather and its deterministic scatter-add backward on CUDA (the CPU's tensor/cpu/index.cpp).
//
// Forward: out[i, :] = weight[indices[i], :], a copy of bits (no conversion). One thread per 16-byte group
// when the weight's rows are contiguous and every row starts 16-byte aligned, one thread per element
// otherwise (a transposed, tied weight).
//
// Backward: grad_weight[v, :] += sum over {i : indices[i] == v} of grad_out[i, :], without atomics:
//  1. (index, position) pairs are sorted by index with CUB's radix sort, which is stable, so the positions of
//     one index stay in ascending order;
//  2. for each run of equal indices, one thread per column sums grad_weight's row and the run's grad_out rows
//     in that order, in the accumulation type (float for 16-bit grads, double for f64), and rounds once.
// This is exactly the CPU's order and arithmetic, so the result has the CPU's bits, on every run.
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "tensor/cuda/common.cuh"
#include "tensor/cuda/cuda_backend.h"

namespace mixtape::cuda {

namespace {

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// The raw element type of a given size (the gather copies bits).
template <int kBytes> struct raw_type;
template <> struct raw_type<2> { using type = uint16_t; };
template <> struct raw_type<4> { using type = uint32_t; };
template <> struct raw_type<8> { using type = uint64_t; };

// out[i, g] = weight[index[i], g] in 16-byte groups: rows of `groups` uint4, weight rows `row_stride` uint4s
// apart.
template <class I>
__global__ void embedding_vec_kernel(const uint4* __restrict__ weight, const I* __restrict__ index,
                                     uint4* __restrict__ out, int64_t n, int64_t groups, int64_t row_stride) {
  const int64_t total = n * groups;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = t / groups, g = t % groups;
    out[t] = weight[static_cast<int64_t>(index[i]) * row_stride + g];
  }
}

// out[i, c] = weight[index[i] * row_stride + c * col_stride] element by element (strides in elements).
template <class R, class I>
__global__ void embedding_scalar_kernel(const R* __restrict__ weight, const I* __restrict__ index,
                                        R* __restrict__ out, int64_t n, int64_t C, int64_t row_stride,
                                        int64_t col_stride) {
  const int64_t total = n * C;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = t / C, c = t % C;
    out[t] = weight[static_cast<int64_t>(index[i]) * row_stride + c * col_stride];
  }
}

// keys[k] = index[k], positions[k] = k: the pairs to sort.
template <class I>
__global__ void sort_pairs_init_kernel(const I* __restrict__ index, uint32_t* __restrict__ keys,
                                       int32_t* __restrict__ positions, int64_t n) {
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    keys[k] = static_cast<uint32_t>(index[k]);
    positions[k] = static_cast<int32_t>(k);
  }
}

// Block (k, column tile): when sorted position k starts a run of equal keys, thread c of the tile sums column
// c of grad_weight's row and of the run's grad_out rows, in run order, and stores the sum rounded once.
template <class D>
__global__ void embedding_backward_rows_kernel(const D* __restrict__ grad_out, const uint32_t* __restrict__ keys,
                                               const int32_t* __restrict__ positions, D* __restrict__ grad_weight,
                                               int64_t n, int64_t C) {
  using A = device_acc_t<D>;
  const int64_t k = blockIdx.x;
  const uint32_t row = keys[k];
  if (k > 0 && keys[k - 1] == row) return;  // not the start of a run
  const int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  D* dst = grad_weight + static_cast<int64_t>(row) * C + c;
  A sum = load_as<A>(*dst);
  for (int64_t m = k; m < n && keys[m] == row; ++m)
    sum += load_as<A>(grad_out[static_cast<int64_t>(positions[m]) * C + c]);
  *dst = store<D>(sum);
}

// Bits needed for the keys 0 .. V - 1 (at least 1).
int key_bits(int64_t V) {
  int bits = 1;
  while (bits < 32 && (int64_t{1} << bits) < V) ++bits;
  return bits;
}

}  // namespace

void CudaBackend::embedding_kernel(const Tensor& weight, const Tensor& indices, const Tensor& out) {
  const int64_t n = out.size(0), C = out.size(1);
  if (n == 0 || C == 0) return;
  const int64_t row_stride = weight.stride(0), col_stride = weight.stride(1);
  const int64_t elem = static_cast<int64_t>(dtype_size(weight.dtype()));
  check(elem == 2 || elem == 4 || elem == 8, "cuda embedding: unexpected element size ", elem);
  const int64_t per_group = 16 / elem;
  dispatch_index(indices.dtype(), "embedding", [&]<typename I>() {
    const I* index = static_cast<const I*>(indices.data_ptr());
    const bool vec = col_stride == 1 && C % per_group == 0 && row_stride % per_group == 0 &&
                     aligned16(weight.data_ptr()) && aligned16(out.data_ptr());
    if (vec) {
      const int64_t groups = C / per_group;
      embedding_vec_kernel<I><<<blocks_for(n * groups), kThreads, 0, stream()>>>(
          static_cast<const uint4*>(weight.data_ptr()), index, static_cast<uint4*>(out.data_ptr()), n, groups,
          row_stride / per_group);
      MIXTAPE_KERNEL_CHECK();
      return;
    }
    auto scalar = [&]<class R>() {
      embedding_scalar_kernel<R, I><<<blocks_for(n * C), kThreads, 0, stream()>>>(
          static_cast<const R*>(weight.data_ptr()), index, static_cast<R*>(out.data_ptr()), n, C, row_stride,
          col_stride);
      MIXTAPE_KERNEL_CHECK();
    };
    if (elem == 2)
      scalar.template operator()<uint16_t>();
    else if (elem == 4)
      scalar.template operator()<uint32_t>();
    else
      scalar.template operator()<uint64_t>();
  });
}

void CudaBackend::embedding_backward_kernel(const Tensor& grad_out, const Tensor& indices, const Tensor& grad_weight) {
  const int64_t n = grad_out.size(0), C = grad_out.size(1), V = grad_weight.size(0);
  if (n == 0 || C == 0) return;
  check(n <= std::numeric_limits<int32_t>::max() && V <= (int64_t{1} << 32),
        "cuda embedding_backward: at most 2^31 - 1 indices and 2^32 rows are supported, got ", n, " indices and ",
        V, " rows");
  const Device device = grad_weight.device();
  cudaStream_t s = stream();

  // 1. (index, position) pairs sorted by index, stably.
  Tensor keys_in = Tensor::empty({n}, DType::I32, device), keys_out = Tensor::empty({n}, DType::I32, device);
  Tensor pos_in = Tensor::empty({n}, DType::I32, device), pos_out = Tensor::empty({n}, DType::I32, device);
  auto* k_in = static_cast<uint32_t*>(keys_in.data_ptr());
  auto* k_out = static_cast<uint32_t*>(keys_out.data_ptr());
  auto* p_in = static_cast<int32_t*>(pos_in.data_ptr());
  auto* p_out = static_cast<int32_t*>(pos_out.data_ptr());
  dispatch_index(indices.dtype(), "embedding_backward", [&]<typename I>() {
    sort_pairs_init_kernel<I><<<blocks_for(n), kThreads, 0, s>>>(static_cast<const I*>(indices.data_ptr()), k_in,
                                                                   p_in, n);
    MIXTAPE_KERNEL_CHECK();
  });
  const int items = static_cast<int>(n), end_bit = key_bits(V);
  size_t temp_bytes = 0;
  MIXTAPE_CUDA_CHECK(
      cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, k_in, k_out, p_in, p_out, items, 0, end_bit, s));
  Tensor temp = Tensor::empty({static_cast<int64_t>((temp_bytes + 7) / 8) + 1}, DType::I64, device);
  MIXTAPE_CUDA_CHECK(
      cub::DeviceRadixSort::SortPairs(temp.data_ptr(), temp_bytes, k_in, k_out, p_in, p_out, items, 0, end_bit, s));

  // 2. One block per (sorted position, column tile); only the first position of each run works.
  dispatch_float(grad_weight.dtype(), "embedding_backward", [&]<typename T>() {
    using D = device_t<T>;
    constexpr int kTile = 128;
    const int64_t tiles = (C + kTile - 1) / kTile;
    check(tiles <= 65535, "cuda embedding_backward: rows of ", C, " elements are too long");
    const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(tiles));
    embedding_backward_rows_kernel<D><<<grid, kTile, 0, s>>>(device_ptr<T>(grad_out), k_out, p_out,
                                                             device_ptr<T>(grad_weight), n, C);
    MIXTAPE_KERNEL_CHECK();
  });
}

}  // namespace mixtape::cuda
