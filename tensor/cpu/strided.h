#pragma once
// Walking N operands of one shape with their own strides: the loop under every CPU elementwise kernel.
// Dims are coalesced first (a contiguous tensor is one long row), then the element range is split evenly
// across OpenMP threads, so every kernel built on this uses all cores.
#include <omp.h>

#include <array>
#include <cstdint>
#include <vector>

#include <algorithm>

#include "tensor/shape.h"

namespace mixtape::cpu {

// Below this many elements a loop runs on one thread (spawning costs more than it saves).
inline constexpr int64_t kParallelGrain = 32768;

// Calls body(i) for every i < count, a tensor at a time: the per-tensor loops of the optimizers and the loss
// scaler. Tensors below the threading grain (size(i) elements) run single-threaded, spread over the threads a
// tensor at a time (dynamic: their sizes differ), so a small model's parameters use every core; larger ones
// run one after another, each split across the threads by its own loop. Each call touches only its own
// tensors, so the order changes no bit. `body` must not throw (an exception cannot leave an OpenMP region):
// callers check dtypes first.
template <class Size, class Body>
void for_each_tensor(int64_t count, Size size, Body body) {
  std::vector<int64_t> small;
  for (int64_t i = 0; i < count; ++i) {
    if (size(i) < 2 * kParallelGrain) small.push_back(i);
    else body(i);
  }
  const int64_t n_small = static_cast<int64_t>(small.size());
#pragma omp parallel for schedule(dynamic, 1) if (n_small > 1)
  for (int64_t k = 0; k < n_small; ++k) body(small[static_cast<size_t>(k)]);
}

template <size_t N>
class StridedLoop {
 public:
  StridedLoop(const Shape& shape, const std::array<Strides, N>& strides) {
    total_ = shape_numel(shape);
    if (total_ == 0) {  // nothing to walk; the other sizes of an empty shape may be huge (their products wrap)
      shape_.push_back(0);
      for (size_t k = 0; k < N; ++k) strides_[k].push_back(1), inner_strides_[k] = 1;
      return;
    }
    // Drop size-1 dims, then merge dim i into i+1 when every operand steps through them as one dim.
    for (size_t d = 0; d < shape.size(); ++d) {
      if (shape[d] == 1) continue;
      const size_t m = shape_.size();
      bool merge = m > 0;
      for (size_t k = 0; k < N && merge; ++k) merge = strides_[k][m - 1] == strides[k][d] * shape[d];
      if (merge) {
        shape_[m - 1] *= shape[d];
        for (size_t k = 0; k < N; ++k) strides_[k][m - 1] = strides[k][d];
      } else {
        shape_.push_back(shape[d]);
        for (size_t k = 0; k < N; ++k) strides_[k].push_back(strides[k][d]);
      }
    }
    if (shape_.empty()) {  // a scalar or all-ones shape: one element
      shape_.push_back(1);
      for (size_t k = 0; k < N; ++k) strides_[k].push_back(1);
    }
    for (size_t k = 0; k < N; ++k) inner_strides_[k] = strides_[k].back();
  }

  int64_t total() const { return total_; }
  int64_t inner_size() const { return shape_.back(); }
  const std::array<int64_t, N>& inner_strides() const { return inner_strides_; }
  bool inner_contiguous() const {
    for (int64_t s : inner_strides_)
      if (s != 1) return false;
    return true;
  }

  // Whether operand 0 is unit-stride along the inner dim while operand k is unit-stride along the dim outside
  // it and not along the inner one: operand k is read transposed (a transposed weight made contiguous, a
  // matmul operand packed).
  bool transposes(size_t k) const {
    const size_t rank = shape_.size();
    return rank >= 2 && inner_strides_[0] == 1 && inner_strides_[k] != 1 && strides_[k][rank - 2] == 1;
  }

  // Operand k's stride along the dim outside the inner one (1 for the operand that transposes(k) names).
  int64_t row_stride(size_t k) const { return shape_.size() >= 2 ? strides_[k][shape_.size() - 2] : 0; }

  // The elements of run() in tiles of up to kTileRows rows x kTileCols inner elements, for an operand that
  // transposes(k): row by row, each element of it sits in its own cache line, which the next row needs again
  // only after a whole row has streamed past; a tile uses its lines while they are still in L1. Calls
  // tile(offsets, rows, cols): operand k's element (r, c) of the tile is at offsets[k] + r * row_stride(k)
  // + c * inner_strides()[k]. The tiles are split across threads.
  // A tile is 16 rows (one 16 x 16 register transpose of tensor/cpu/transpose.h tall, two 8 x 8 ones) by 256
  // inner elements: it writes 16 runs of 1 KiB (in f32) and reads 256 runs of 64 bytes, one cache line each.
  // 16 rows: the AVX-512 transpose's height (fewer waste it, more run slower); any width from 128 to 1024 runs
  // alike (bench_ops' transpose row, Zen 5: 16-row tiles 72-75 GB/s, 32-row 53-56, 64 x 64 43, 8-row ~21).
  template <class Tile>
  void run_tiled(Tile&& tile, int64_t grain = kParallelGrain) const {
    constexpr int64_t kTileRows = 16, kTileCols = 256;
    if (total_ == 0) return;
    const size_t rank = shape_.size();
    const int64_t rows = shape_[rank - 2], cols = shape_[rank - 1];
    const int64_t row_tiles = (rows + kTileRows - 1) / kTileRows;
    const int64_t col_tiles = (cols + kTileCols - 1) / kTileCols;
    const int64_t tasks = total_ / (rows * cols) * row_tiles * col_tiles;
#pragma omp parallel for schedule(static) if (total_ >= 2 * grain)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t r0 = task / col_tiles % row_tiles * kTileRows, c0 = task % col_tiles * kTileCols;
      std::array<int64_t, N> offsets{};
      int64_t rest = task / col_tiles / row_tiles;
      for (size_t d = rank - 2; d-- > 0;) {
        const int64_t i = rest % shape_[d];
        rest /= shape_[d];
        for (size_t k = 0; k < N; ++k) offsets[k] += i * strides_[k][d];
      }
      for (size_t k = 0; k < N; ++k) offsets[k] += r0 * strides_[k][rank - 2] + c0 * inner_strides_[k];
      tile(offsets, std::min(kTileRows, rows - r0), std::min(kTileCols, cols - c0));
    }
  }

  // Calls body(offsets, count) for runs of consecutive inner-dim elements: operand k's elements are at
  // offsets[k] + j * inner_strides()[k] for j < count. Runs are split across threads.
  template <class Body>
  void run(Body&& body, int64_t grain = kParallelGrain) const {
    if (total_ == 0) return;
    const int threads = total_ >= 2 * grain ? omp_get_max_threads() : 1;
    if (threads == 1) {
      run_range(0, total_, body);
      return;
    }
#pragma omp parallel num_threads(threads)
    {
      const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
      run_range(total_ * t / nt, total_ * (t + 1) / nt, body);
    }
  }

 private:
  template <class Body>
  void run_range(int64_t begin, int64_t end, Body& body) const {
    const int64_t inner = shape_.back();
    int64_t row = begin / inner, col = begin % inner;
    while (begin < end) {
      std::array<int64_t, N> offsets{};
      int64_t rest = row;
      for (size_t d = shape_.size() - 1; d-- > 0;) {
        const int64_t i = rest % shape_[d];
        rest /= shape_[d];
        for (size_t k = 0; k < N; ++k) offsets[k] += i * strides_[k][d];
      }
      for (size_t k = 0; k < N; ++k) offsets[k] += col * inner_strides_[k];
      const int64_t count = std::min(inner - col, end - begin);
      body(offsets, count);
      begin += count;
      ++row;
      col = 0;
    }
  }

  int64_t total_ = 0;
  Shape shape_;
  std::array<Strides, N> strides_;
  std::array<int64_t, N> inner_strides_{};
};

}  // namespace mixtape::cpu
