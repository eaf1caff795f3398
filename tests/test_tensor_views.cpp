// Views (share storage, compose, index the right elements), copies (contiguous, clone, to), in-place fill_ /
// copy_, host access (item, str) and the errors of all of them. Expected values come from row-major index
// arithmetic on an arange source, computed here without going through the view code.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "autograd/autograd.h"
#include "tensor/ops.h"
#include "test_util.h"

namespace mixtape {
namespace {

// arange(0, n) viewed as `shape`: element at multi-index i has value = its row-major position.
Tensor iota(const Shape& shape, DType dtype = DType::F32) {
  return Tensor::arange(0, static_cast<double>(shape_numel(shape)), 1, dtype).view(shape);
}

// Row-major position of a multi-index in `shape`.
int64_t position(const Shape& shape, const std::vector<int64_t>& index) {
  int64_t p = 0;
  for (size_t d = 0; d < shape.size(); ++d) p = p * shape[d] + index[d];
  return p;
}

// Values of a view of shape `shape`, element i = value_at(multi-index i), in row-major order.
std::vector<double> expected(const Shape& shape, const std::function<double(const std::vector<int64_t>&)>& value_at) {
  std::vector<double> out;
  std::vector<int64_t> index(shape.size(), 0);
  for (int64_t n = 0; n < shape_numel(shape); ++n) {
    out.push_back(value_at(index));
    for (size_t d = shape.size(); d-- > 0;) {
      if (++index[d] < shape[d]) break;
      index[d] = 0;
    }
  }
  return out;
}

// ---- views share storage and index correctly -----------------------------------------------------------

TEST(TensorViews, ViewAndReshapeShareStorageAndInferMinusOne) {
  const Tensor t = iota({2, 3, 4});
  const Tensor v = t.view({6, -1});
  EXPECT_EQ(v.shape(), (Shape{6, 4}));
  EXPECT_EQ(v.storage(), t.storage());
  EXPECT_EQ(t.reshape({-1}).shape(), (Shape{24}));
  EXPECT_EQ(t.reshape({4, -1, 3}).shape(), (Shape{4, 2, 3}));
  EXPECT_EQ(t.view({1, 24, 1}).strides()[1], 1);
  EXPECT_EQ(t.flatten().to_vector<double>(), t.to_vector<double>());
  // A write through the view is seen by the base (one storage) and bumps the shared version counter.
  const uint64_t version = t.version();
  Tensor(v).select(0, 5).fill_(-1);
  EXPECT_GT(t.version(), version);
  EXPECT_EQ(t.to_vector<double>()[20], -1);
  EXPECT_EQ(t.to_vector<double>()[23], -1);
  EXPECT_EQ(t.to_vector<double>()[19], 19);
  // Zero-element tensors view freely.
  EXPECT_EQ(Tensor::zeros({0, 3}).view({3, 0, 5}).shape(), (Shape{3, 0, 5}));
  EXPECT_EQ(Tensor::zeros({0, 3}).reshape({-1}).shape(), (Shape{0}));
}

TEST(TensorViews, ViewOfNonContiguousSplitsDimsWhenStridesAllow) {
  const Tensor t = iota({2, 3, 4}).transpose(0, 1);  // [3,2,4], strides [4,12,1]
  // Splitting the contiguous last dim is a view; merging the transposed dims is not.
  const Tensor split = t.view({3, 2, 2, 2});
  EXPECT_EQ(split.storage(), t.storage());
  EXPECT_EQ(split.to_vector<double>(), t.contiguous().to_vector<double>());
  const Tensor merged = t.reshape({6, 4});  // needs a copy
  EXPECT_NE(merged.storage(), t.storage());
  EXPECT_EQ(merged.to_vector<double>(), expected({6, 4}, [](const std::vector<int64_t>& i) {
              return static_cast<double>(position({2, 3, 4}, {i[0] % 2, i[0] / 2, i[1]}));
            }));
  // Merging dims that stay contiguous in a sliced tensor is still a view.
  const Tensor rows = iota({6, 4}).slice(0, 1, 5);  // [4,4] with row stride 4: rows are contiguous
  EXPECT_EQ(rows.view({16}).storage(), rows.storage());
  const Tensor cols = iota({6, 4}).slice(1, 0, 2);  // [6,2] with row stride 4: not mergeable
  EXPECT_EQ(cols.view({6, 2, 1}).storage(), cols.storage());
  EXPECT_ERROR_MENTIONS(cols.view({12}), "view", "f32[6,2]", "[12]");
}

TEST(TensorViews, ViewSucceedsExactlyWhenAStridedLayoutExists) {
  // Random non-contiguous sources (permuted, stepped slices of iota: value = storage offset) viewed as random
  // shapes of the same size. Oracle: a view exists iff the strides read off the unit steps of the target
  // shape reproduce every element's storage offset. view() must succeed exactly then, with the same values
  // in the same row-major order, and throw otherwise.
  std::mt19937 rng(3);
  auto pick = [&](int low, int high) { return std::uniform_int_distribution<int>(low, high)(rng); };
  int viewable = 0, not_viewable = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    Shape base_shape(static_cast<size_t>(pick(1, 4)));
    for (int64_t& s : base_shape) s = pick(1, 4);
    Tensor t = iota(base_shape);
    std::vector<int64_t> order(base_shape.size());
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    t = t.permute(order);
    for (int64_t d = 0; d < t.dim(); ++d)
      if (t.size(d) > 2 && pick(0, 2) == 0) t = t.slice(d, pick(0, 1), t.size(d), pick(1, 2));
    // A random shape with t's element count: its prime factors spread over up to 4 dims, plus some 1s.
    std::vector<int64_t> primes;
    for (int64_t n = t.numel(), p = 2; n > 1; p += p == 2 ? 1 : 2)
      while (n % p == 0) {
        primes.push_back(p);
        n /= p;
      }
    Shape target(static_cast<size_t>(pick(1, 4)), 1);
    for (int64_t p : primes) target[static_cast<size_t>(pick(0, static_cast<int>(target.size()) - 1))] *= p;
    if (pick(0, 2) == 0) target.insert(target.begin() + pick(0, static_cast<int>(target.size())), 1);

    const std::vector<double> offsets = t.to_vector<double>();  // row-major storage offsets of t
    const Strides unit = contiguous_strides(target);
    bool exists = true;
    std::vector<double> step(target.size(), 0);
    for (size_t k = 0; k < target.size(); ++k)
      if (target[k] > 1) step[k] = offsets[static_cast<size_t>(unit[k])] - offsets[0];
    for (int64_t n = 0; n < t.numel() && exists; ++n) {
      double predicted = offsets[0];
      for (size_t k = 0; k < target.size(); ++k) predicted += static_cast<double>((n / unit[k]) % target[k]) * step[k];
      exists = predicted == offsets[static_cast<size_t>(n)];
    }
    if (exists) {
      ++viewable;
      const Tensor v = t.view(target);
      ASSERT_EQ(v.shape(), target);
      ASSERT_EQ(v.storage(), t.storage());
      ASSERT_EQ(v.to_vector<double>(), offsets) << t.description() << " strides " << shape_str(t.strides())
                                                << " as " << shape_str(target);
    } else {
      ++not_viewable;
      EXPECT_THROW(t.view(target), Error) << t.description() << " strides " << shape_str(t.strides()) << " as "
                                          << shape_str(target);
    }
  }
  EXPECT_GT(viewable, 500);  // both outcomes are well represented
  EXPECT_GT(not_viewable, 500);
}

TEST(TensorViews, TransposeAndPermuteMoveIndices) {
  const Shape shape{2, 3, 4};
  const Tensor t = iota(shape);
  const Tensor tr = t.transpose(0, 2);
  EXPECT_EQ(tr.shape(), (Shape{4, 3, 2}));
  EXPECT_EQ(tr.storage(), t.storage());
  EXPECT_EQ(tr.to_vector<double>(), expected(tr.shape(), [&](const std::vector<int64_t>& i) {
              return static_cast<double>(position(shape, {i[2], i[1], i[0]}));
            }));
  EXPECT_EQ(t.transpose(-1, -3).to_vector<double>(), tr.to_vector<double>());
  const Tensor p = t.permute({2, 0, 1});  // out dim k is in dim dims[k]
  EXPECT_EQ(p.shape(), (Shape{4, 2, 3}));
  EXPECT_EQ(p.to_vector<double>(), expected(p.shape(), [&](const std::vector<int64_t>& i) {
              return static_cast<double>(position(shape, {i[1], i[2], i[0]}));
            }));
  EXPECT_EQ(t.permute({-1, 0, -2}).to_vector<double>(), p.to_vector<double>());
  EXPECT_EQ(iota({3, 5}).mT().shape(), (Shape{5, 3}));
}

TEST(TensorViews, SliceWithStepsAndNegativeOrOutOfRangeBounds) {
  const Tensor t = iota({10});
  EXPECT_EQ(t.slice(0, 1, 8, 3).to_vector<double>(), (std::vector<double>{1, 4, 7}));
  EXPECT_EQ(t.slice(0, 1, 9, 3).to_vector<double>(), (std::vector<double>{1, 4, 7}));
  EXPECT_EQ(t.slice(0, 1, 10, 3).to_vector<double>(), (std::vector<double>{1, 4, 7}));
  EXPECT_EQ(t.slice(0, -4, -1).to_vector<double>(), (std::vector<double>{6, 7, 8}));
  EXPECT_EQ(t.slice(0, -100, 100, 4).to_vector<double>(), (std::vector<double>{0, 4, 8}));  // clamped
  EXPECT_EQ(t.slice(0, 7, 3).numel(), 0);  // end before start: empty
  EXPECT_EQ(t.slice(0, 10, 20).numel(), 0);
  EXPECT_EQ(t.slice(0, 2, 6).storage(), t.storage());
  // On an inner dim, and composed with another slice.
  const Tensor m = iota({4, 6});
  const Tensor s = m.slice(1, 1, 6, 2).slice(0, -3, 4, 2);  // rows 1,3 ; cols 1,3,5
  EXPECT_EQ(s.shape(), (Shape{2, 3}));
  EXPECT_EQ(s.to_vector<double>(), (std::vector<double>{7, 9, 11, 19, 21, 23}));
}

TEST(TensorViews, NarrowSelectExpandUnsqueezeSqueeze) {
  const Shape shape{2, 3, 4};
  const Tensor t = iota(shape);
  EXPECT_EQ(t.narrow(2, 1, 2).to_vector<double>(), expected({2, 3, 2}, [&](const std::vector<int64_t>& i) {
              return static_cast<double>(position(shape, {i[0], i[1], i[2] + 1}));
            }));
  EXPECT_EQ(t.narrow(1, -2, 2).to_vector<double>(), t.slice(1, 1, 3).to_vector<double>());
  const Tensor sel = t.select(1, -1);
  EXPECT_EQ(sel.shape(), (Shape{2, 4}));
  EXPECT_EQ(sel.to_vector<double>(), (std::vector<double>{8, 9, 10, 11, 20, 21, 22, 23}));
  EXPECT_EQ(t.select(0, 1).select(0, 2).select(0, 3).item(), 23);  // down to 0-d
  // expand: size-1 dims and new leading dims get stride 0 (no copy); -1 keeps a dim.
  const Tensor column = iota({3, 1});
  const Tensor e = column.expand({2, 3, 4});
  EXPECT_EQ(e.shape(), (Shape{2, 3, 4}));
  EXPECT_EQ(e.strides()[0], 0);
  EXPECT_EQ(e.strides()[2], 0);
  EXPECT_EQ(e.storage(), column.storage());
  EXPECT_EQ(e.to_vector<double>(), expected({2, 3, 4}, [](const std::vector<int64_t>& i) {
              return static_cast<double>(i[1]);
            }));
  EXPECT_EQ(column.expand({-1, 5}).shape(), (Shape{3, 5}));
  EXPECT_EQ(column.expand({3, 0}).numel(), 0);
  // unsqueeze / squeeze
  EXPECT_EQ(t.unsqueeze(0).shape(), (Shape{1, 2, 3, 4}));
  EXPECT_EQ(t.unsqueeze(-1).shape(), (Shape{2, 3, 4, 1}));
  EXPECT_EQ(t.unsqueeze(2).shape(), (Shape{2, 3, 1, 4}));
  EXPECT_EQ(t.unsqueeze(2).to_vector<double>(), t.to_vector<double>());
  EXPECT_TRUE(t.unsqueeze(1).is_contiguous());
  EXPECT_EQ(t.unsqueeze(1).squeeze(1).shape(), shape);
  EXPECT_TRUE(t.squeeze(1).same(t));  // not size 1: no-op
  EXPECT_EQ(iota({1, 3, 1, 2, 1}).squeeze().shape(), (Shape{3, 2}));
  EXPECT_EQ(iota({1, 1}).squeeze().shape(), (Shape{}));
  // A squeeze of a non-contiguous tensor stays a view.
  const Tensor nc = iota({3, 1, 4}).transpose(0, 2);
  EXPECT_EQ(nc.squeeze().storage(), nc.storage());
  EXPECT_EQ(nc.squeeze().to_vector<double>(), nc.contiguous().view({4, 3}).to_vector<double>());
}

TEST(TensorViews, ViewsComposeIntoTheRightElements) {
  const Shape shape{3, 4, 5};
  const Tensor t = iota(shape);
  // permute -> [5,3,4]; slice dim0 1..5 step 2 -> [2,3,4] (k = 1,3); select dim1 index -1 (i = 2) -> [2,4];
  // transpose -> [4,2]; unsqueeze(1) -> [4,1,2]; expand -> [4,3,2].
  const Tensor v = t.permute({2, 0, 1}).slice(0, 1, 5, 2).select(1, -1).transpose(0, 1).unsqueeze(1).expand({4, 3, 2});
  EXPECT_EQ(v.shape(), (Shape{4, 3, 2}));
  EXPECT_EQ(v.storage(), t.storage());
  EXPECT_EQ(v.to_vector<double>(), expected(v.shape(), [&](const std::vector<int64_t>& i) {
              const int64_t j = i[0], k = 1 + 2 * i[2];  // t[2, j, k]
              return static_cast<double>(position(shape, {2, j, k}));
            }));
  // ... and reading through a reshape that must copy.
  EXPECT_EQ(v.reshape({24}).to_vector<double>(), v.to_vector<double>());
}

// ---- copies ---------------------------------------------------------------------------------------------

TEST(TensorCopies, ContiguousCopiesOnlyWhenNeeded) {
  const Tensor t = iota({3, 4});
  EXPECT_TRUE(t.contiguous().same(t));
  const Tensor tr = t.transpose(0, 1);
  const Tensor c = tr.contiguous();
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_NE(c.storage(), t.storage());
  EXPECT_EQ(c.strides(), (Strides{3, 1}));
  EXPECT_EQ(c.to_vector<double>(), tr.to_vector<double>());
  // Size-1 dims and zero strides from slicing one row do not break contiguity.
  EXPECT_TRUE(t.slice(0, 1, 2).is_contiguous());
  EXPECT_FALSE(iota({3}).unsqueeze(1).expand({3, 2}).is_contiguous());
}

TEST(TensorCopies, CloneIsAlwaysAFreshContiguousCopy) {
  Tensor t = iota({2, 3});
  Tensor c = t.clone();
  EXPECT_NE(c.storage(), t.storage());
  c.fill_(7);
  EXPECT_EQ(t.to_vector<double>(), (std::vector<double>{0, 1, 2, 3, 4, 5}));
  const Tensor cc = t.transpose(0, 1).clone();
  EXPECT_TRUE(cc.is_contiguous());
  EXPECT_EQ(cc.to_vector<double>(), (std::vector<double>{0, 3, 1, 4, 2, 5}));
  EXPECT_EQ(iota({2, 2}, DType::BF16).clone().dtype(), DType::BF16);
}

TEST(TensorCopies, ToDtypeRoundTrips) {
  const std::vector<double> values{0.1, -2.5, 1e-3, 65504, 3.0e38, -0.0};
  const Tensor f64 = Tensor::from_vector(values, {6});
  // f64 -> f32 -> f64 rounds once, to float.
  std::vector<double> as_float;
  for (double v : values) as_float.push_back(static_cast<float>(v));
  EXPECT_EQ(f64.to(DType::F32).to(DType::F64).to_vector<double>(), as_float);
  // Widening is exact and so round-trips: f16 -> f32 -> f16, bf16 -> f64 -> bf16.
  const Tensor h = f64.to(DType::F16);
  EXPECT_EQ(h.to(DType::F32).to(DType::F16).to_vector<double>(), h.to_vector<double>());
  const Tensor b = f64.to(DType::BF16);
  EXPECT_EQ(b.to(DType::F64).to(DType::BF16).to_vector<double>(), b.to_vector<double>());
  // Values are rounded to nearest even directly from f64.
  const std::vector<double> hv = h.to_vector<double>(), bv = b.to_vector<double>();
  for (size_t i = 0; i < values.size(); ++i) {
    EXPECT_EQ(hv[i], static_cast<float>(Half(values[i]))) << values[i];
    EXPECT_EQ(bv[i], static_cast<float>(BFloat16(values[i]))) << values[i];
  }
  EXPECT_TRUE(std::isinf(hv[4]));  // 3e38 overflows f16
  EXPECT_TRUE(std::signbit(hv[5]));  // -0 stays -0
  // Integers: float -> int truncates toward zero; small ints survive int -> float -> int.
  EXPECT_EQ(Tensor::from_vector(std::vector<float>{2.9f, -2.9f, 7.0f}, {3}).to(DType::I64).to_vector<int64_t>(),
            (std::vector<int64_t>{2, -2, 7}));
  const Tensor ints = Tensor::from_vector(std::vector<int64_t>{-3, 0, 2048, 123456789}, {4});
  EXPECT_EQ(ints.to(DType::F64).to(DType::I32).to_vector<int64_t>(), ints.to_vector<int64_t>());
  EXPECT_EQ(ints.to(DType::F16).to_vector<double>(), (std::vector<double>{-3, 0, 2048, INFINITY}));
  // Same dtype: the same tensor; a non-contiguous source converts in logical order.
  EXPECT_TRUE(f64.to(DType::F64).same(f64));
  EXPECT_EQ(iota({2, 3}).transpose(0, 1).to(DType::F64).to_vector<double>(),
            (std::vector<double>{0, 3, 1, 4, 2, 5}));
}

// ---- in place ---------------------------------------------------------------------------------------------

TEST(TensorInPlace, FillWritesOnlyTheViewAndConvertsTheValue) {
  Tensor m = Tensor::zeros({3, 4});
  m.select(1, 2).fill_(5);  // a strided column
  EXPECT_EQ(m.to_vector<double>(), (std::vector<double>{0, 0, 5, 0, 0, 0, 5, 0, 0, 0, 5, 0}));
  Tensor h = Tensor::zeros({2}, DType::F16);
  h.fill_(0.1);
  EXPECT_EQ(h.to_vector<double>()[0], static_cast<float>(Half(0.1)));
  Tensor i = Tensor::zeros({2}, DType::I32);
  i.fill_(-4);
  EXPECT_EQ(i.to_vector<int64_t>(), (std::vector<int64_t>{-4, -4}));
  Tensor big = Tensor::zeros({100'000});  // parallel path
  big.slice(0, 1, 100'000, 2).fill_(1);
  const std::vector<double> v = big.to_vector<double>();
  for (size_t k = 0; k < v.size(); ++k) ASSERT_EQ(v[k], k % 2 ? 1.0 : 0.0) << k;
}

TEST(TensorInPlace, CopyBroadcastsAndConverts) {
  Tensor dst = Tensor::zeros({2, 3}, DType::F64);
  dst.copy_(Tensor::from_vector(std::vector<double>{1, 2, 3}, {3}));  // rows
  EXPECT_EQ(dst.to_vector<double>(), (std::vector<double>{1, 2, 3, 1, 2, 3}));
  dst.copy_(Tensor::from_vector(std::vector<double>{7, 8}, {2, 1}));  // columns
  EXPECT_EQ(dst.to_vector<double>(), (std::vector<double>{7, 7, 7, 8, 8, 8}));
  dst.copy_(Tensor::scalar(-1));  // 0-d f32 into f64
  EXPECT_EQ(dst.to_vector<double>(), std::vector<double>(6, -1.0));
  // Into a transposed view: element (i, j) of the view is element (j, i) of the base.
  Tensor base = Tensor::zeros({3, 2}, DType::BF16);
  base.transpose(0, 1).copy_(Tensor::from_vector(std::vector<double>{1.001, 2, 3, 4, 5, 6}, {2, 3}));
  EXPECT_EQ(base.to_vector<double>(), (std::vector<double>{1, 4, 2, 5, 3, 6}));  // 1.001 rounds to bf16 1
  // From a non-contiguous source, with dtype conversion.
  Tensor ints = Tensor::zeros({3, 2}, DType::I64);
  ints.copy_(iota({2, 3}).transpose(0, 1));
  EXPECT_EQ(ints.to_vector<int64_t>(), (std::vector<int64_t>{0, 3, 1, 4, 2, 5}));
  const uint64_t version = ints.version();
  ints.copy_(Tensor::zeros({2}, DType::I64));
  EXPECT_GT(ints.version(), version);
}

// A source that shares memory with the destination is read as it was before the op (numpy's and PyTorch's
// a[1:] = a[:-1] result), not element by element as the destination is written; the identical view is its
// own source. Large views take the parallel kernels.
TEST(TensorInPlace, OverlappingSourceAndDestinationReadTheSourceAsItWas) {
  for (int64_t n : {5, 100'001}) {
    SCOPED_TRACE(n);
    std::vector<double> expected_add(n, 1.0), expected_copy(n);
    for (int64_t i = 0; i < n; ++i) expected_copy[i] = i < 1 ? 0 : double(i - 1);
    for (int64_t i = 1; i < n; ++i) expected_add[i] = 2;
    Tensor a = Tensor::ones({n}, DType::F64);
    a.slice(0, 1, n).add_(a.slice(0, 0, n - 1));
    EXPECT_EQ(a.to_vector<double>(), expected_add);
    Tensor b = iota({n});
    b.slice(0, 1, n).copy_(b.slice(0, 0, n - 1));
    EXPECT_EQ(b.to_vector<double>(), expected_copy);
    Tensor c = iota({n});  // the other direction: a[:-1] = a[1:]
    c.slice(0, 0, n - 1).copy_(c.slice(0, 1, n));
    EXPECT_EQ(c.to_vector<double>()[n - 2], double(n - 1));
    EXPECT_EQ(c.to_vector<double>()[0], 1.0);
  }
  Tensor c = iota({2, 2});
  c.add_(c.mT());
  EXPECT_EQ(c.to_vector<double>(), (std::vector<double>{0, 3, 3, 6}));
  Tensor d = iota({2, 2});
  d.copy_(d.mT());
  EXPECT_EQ(d.to_vector<double>(), (std::vector<double>{0, 2, 1, 3}));
  Tensor e = iota({3});
  e.add_(e, 2.0);  // the same view: each element reads itself
  EXPECT_EQ(e.to_vector<double>(), (std::vector<double>{0, 3, 6}));
  Tensor f = iota({2, 3}, DType::F32);  // a broadcast row of the destination itself
  f.add_(f.select(0, 0));
  EXPECT_EQ(f.to_vector<double>(), (std::vector<double>{0, 2, 4, 3, 5, 7}));
}

// With grad mode on, the source of copy_ / add_ must not require grad: the op records nothing, so it would
// silently get no gradient. detach() or NoGradGuard says none is wanted.
TEST(TensorInPlace, ASourceThatRequiresGradIsAnErrorOutsideNoGradGuard) {
  Tensor w = iota({2});
  w.requires_grad_();
  Tensor buffer = Tensor::zeros({2}, DType::F64);
  EXPECT_ERROR_MENTIONS(buffer.copy_(w), "copy_", "source f32[2]", "requires grad", "detach()");
  EXPECT_ERROR_MENTIONS(buffer.add_(mul(w, 2.0)), "add_", "requires grad");
  EXPECT_EQ(buffer.to_vector<double>(), (std::vector<double>{0, 0}));
  buffer.copy_(w.detach());
  buffer.add_(w.detach());
  {
    NoGradGuard no_grad;
    buffer.add_(w);
  }
  EXPECT_EQ(buffer.to_vector<double>(), (std::vector<double>{0, 3}));
}

TEST(TensorInPlace, CopyBetweenRandomStridedViewsKeepsLogicalOrder) {
  // Source and destination are independently permuted, stepped views; some are large enough for the
  // parallel strided loop, which splits the element range across threads in the middle of rows.
  std::mt19937 rng(17);
  auto pick = [&](int low, int high) { return std::uniform_int_distribution<int>(low, high)(rng); };
  auto permutation = [&](size_t n) {
    std::vector<int64_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    return order;
  };
  for (int trial = 0; trial < 300; ++trial) {
    const bool large = trial % 60 == 0;
    Shape shape(static_cast<size_t>(pick(1, 4)));
    for (int64_t& s : shape) s = pick(1, 5);
    if (large) shape = {static_cast<int64_t>(pick(2, 3)), 1, static_cast<int64_t>(pick(40'000, 50'000))};
    // Source: arange(1, n + 1) laid out in a permuted order, read through the inverse permutation.
    const std::vector<int64_t> order = permutation(shape.size());
    Shape stored(shape.size());
    for (size_t k = 0; k < shape.size(); ++k) stored[static_cast<size_t>(order[k])] = shape[k];
    // stored dim order[k] holds view dim k, so view dim k = stored dim order[k]: permute(order).
    const Tensor src = Tensor::arange(1, static_cast<double>(shape_numel(shape)) + 1, 1, DType::F64)
                           .view(stored).permute(order);
    ASSERT_EQ(src.shape(), shape);
    // Destination: every dim of a zero base twice as long, sliced with step 2 and permuted the same way.
    const std::vector<int64_t> dst_order = permutation(shape.size());
    Shape dst_stored(shape.size());
    for (size_t k = 0; k < shape.size(); ++k) dst_stored[static_cast<size_t>(dst_order[k])] = 2 * shape[k];
    const Tensor base = Tensor::zeros(dst_stored, large ? DType::F64 : DType::F32);
    Tensor dst = base.permute(dst_order);
    for (int64_t d = 0; d < dst.dim(); ++d) dst = dst.slice(d, pick(0, 1), dst.size(d), 2);
    ASSERT_EQ(dst.shape(), shape);
    dst.copy_(src);
    ASSERT_EQ(dst.to_vector<double>(), src.to_vector<double>()) << "trial " << trial;
    const std::vector<double> all = base.to_vector<double>();
    EXPECT_EQ(std::count_if(all.begin(), all.end(), [](double v) { return v != 0; }), src.numel()) << trial;
  }
}

TEST(TensorInPlace, TransposingCopyVisitsEveryElementOnceInEveryDtypePair) {
  // A source read transposed into a destination whose rows are contiguous takes the tiled walk of the copy
  // kernel (tiles of 16 x 256; between 16-bit types, blocks 32 and 16 columns wide): sizes that leave partial
  // tiles and partial register blocks at both edges, a batch dim, a destination with padded rows, and one
  // shape big enough to split the tiles across threads. Values are position % 251, exact in every dtype
  // here, and the expected element is computed from its indices.
  struct Case {
    Shape shape;  // destination [B, R, C]; the source is stored [B, C, R] and transposed
    int64_t pad;  // extra columns in each destination row
  };
  const Case cases[] = {{{1, 1000, 77}, 0}, {{3, 75, 130}, 5}, {{2, 300, 170}, 0}, {{4, 33, 65}, 3}};
  const std::pair<DType, DType> pairs[] = {{DType::F32, DType::F32}, {DType::F16, DType::F32},
                                           {DType::BF16, DType::F32}, {DType::F32, DType::F16},
                                           {DType::F32, DType::BF16}, {DType::F64, DType::F64},
                                           {DType::BF16, DType::BF16}, {DType::F16, DType::F16}};
  for (const Case& c : cases) {
    const int64_t B = c.shape[0], R = c.shape[1], C = c.shape[2];
    std::vector<double> stored(static_cast<size_t>(B * C * R));
    for (size_t p = 0; p < stored.size(); ++p) stored[p] = static_cast<double>(p % 251);
    for (const auto& [from, to] : pairs) {
      const Tensor src = Tensor::from_vector(stored, {B, C, R}).to(from).transpose(1, 2);
      const Tensor base = Tensor::full({B, R, C + c.pad}, -1, to);
      Tensor dst = base.slice(2, 0, C);
      dst.copy_(src);
      const std::vector<double> all = base.to_vector<double>();  // base is contiguous: read as stored
      int64_t wrong = 0;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t r = 0; r < R; ++r)
          for (int64_t col = 0; col < C + c.pad; ++col) {
            const double got = all[static_cast<size_t>((b * R + r) * (C + c.pad) + col)];
            const double want = col < C ? static_cast<double>((b * C * R + col * R + r) % 251) : -1;
            if (got != want && ++wrong <= 3)
              ADD_FAILURE() << dtype_name(from) << " -> " << dtype_name(to) << " " << shape_str(c.shape)
                            << " at [" << b << ", " << r << ", " << col << "]: " << got << ", want " << want;
          }
      EXPECT_EQ(wrong, 0) << dtype_name(from) << " -> " << dtype_name(to) << " " << shape_str(c.shape);
    }
  }
}

// A transposing copy between 16-bit tensors of one type moves bits: every one of the 65,536 patterns (NaNs
// with payloads, signalling ones among them, infinities, subnormals, -0) lands bit for bit where the
// transpose puts it, on the register-transpose paths ([256, 256]: whole tiles of 32-wide blocks; [273, 241]:
// 32-wide blocks, then a 16-wide one, then single columns, and rows past the last whole block of 16) and at
// ragged edges.
TEST(TensorInPlace, SixteenBitTransposingCopyMovesEveryBitPattern) {
  for (DType dtype : {DType::BF16, DType::F16}) {
    for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{256, 256}, {4096, 16}, {16, 4096}, {273, 241}}) {
      const int64_t n = rows * cols;
      const Tensor src = Tensor::empty({cols, rows}, dtype);  // read transposed: [rows, cols]
      auto* bits = static_cast<uint16_t*>(src.data_ptr());
      for (int64_t i = 0; i < n; ++i) bits[i] = static_cast<uint16_t>((i * 40503) & 0xFFFF);  // odd: a bijection
      const Tensor dst = src.transpose(0, 1).contiguous();
      ASSERT_EQ(dst.shape(), (Shape{rows, cols}));
      const auto* out = static_cast<const uint16_t*>(dst.data_ptr());
      int64_t wrong = 0;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c)
          if (out[r * cols + c] != bits[c * rows + r] && ++wrong <= 3)
            ADD_FAILURE() << dtype_name(dtype) << " [" << rows << ", " << cols << "] at [" << r << ", " << c
                          << "]: 0x" << std::hex << out[r * cols + c] << ", want 0x" << bits[c * rows + r]
                          << std::dec;
      EXPECT_EQ(wrong, 0) << dtype_name(dtype) << " [" << rows << ", " << cols << "]";
    }
  }
}

// ---- host access ------------------------------------------------------------------------------------------

TEST(TensorHost, ItemReadsTheOnlyElement) {
  EXPECT_EQ(Tensor::scalar(2.5).item(), 2.5);
  EXPECT_EQ(Tensor::full({1, 1, 1}, -3, DType::BF16).item(), -3);
  EXPECT_EQ(Tensor::full({1}, 123456789, DType::I64).item(), 123456789);
  EXPECT_EQ(iota({2, 3}).select(0, 1).select(0, 2).item(), 5);
}

TEST(TensorHost, StrPrintsLikePyTorch) {
  EXPECT_EQ(Tensor::scalar(2.5).str(), "tensor(2.5, dtype=f32)");
  EXPECT_EQ(Tensor::from_vector(std::vector<float>{1, 2, 3, 4, 5, 6}, {2, 3}).str(),
            "tensor([[1, 2, 3],\n"
            "        [4, 5, 6]], dtype=f32)");
  EXPECT_EQ(iota({10}, DType::I64).str(), "tensor([0, 1, 2, ..., 7, 8, 9], dtype=i64)");
  EXPECT_EQ(iota({6}).str(), "tensor([0, 1, 2, 3, 4, 5], dtype=f32)");  // 6 = 2 * 3 edge values: no elision
  EXPECT_EQ(Tensor::from_vector(std::vector<double>{NAN, INFINITY, -INFINITY, 0.1, -1e-7}, {5}).str(),
            "tensor([nan, inf, -inf, 0.1, -1e-07], dtype=f64)");
  EXPECT_EQ(Tensor::from_vector(std::vector<float>{0.1f}, {1}, DType::F16).str(), "tensor([0.0999756], dtype=f16)");
  EXPECT_EQ(Tensor::zeros({0}).str(), "tensor([], dtype=f32)");
  EXPECT_EQ(Tensor::zeros({2}, DType::F64).requires_grad_().str(), "tensor([0, 0], dtype=f64, requires_grad)");
  // A long outer dim elides whole rows, each kept row on its own line.
  EXPECT_EQ(iota({8, 2}).str(),
            "tensor([[0, 1],\n"
            "        [2, 3],\n"
            "        [4, 5],\n"
            "        ...,\n"
            "        [10, 11],\n"
            "        [12, 13],\n"
            "        [14, 15]], dtype=f32)");
  // Through a view: printed in logical order.
  EXPECT_EQ(iota({2, 2}).mT().str(), "tensor([[0, 2],\n        [1, 3]], dtype=f32)");
  // 64-bit integers print exactly (not through a double).
  EXPECT_EQ(Tensor::from_vector(std::vector<int64_t>{std::numeric_limits<int64_t>::max(),
                                                     std::numeric_limits<int64_t>::min(), 9007199254740993},
                                {3})
                .str(),
            "tensor([9223372036854775807, -9223372036854775808, 9007199254740993], dtype=i64)");
  std::ostringstream out;
  out << iota({2}, DType::I32);
  EXPECT_EQ(out.str(), "tensor([0, 1], dtype=i32)");
}

// ---- errors name the op and the tensors ---------------------------------------------------------------

TEST(TensorErrors, OutOfRangeDimsAndIndices) {
  const Tensor t = iota({2, 3, 4});
  EXPECT_ERROR_MENTIONS(t.transpose(0, 3), "transpose", "dim 3", "f32[2,3,4]");
  EXPECT_ERROR_MENTIONS(t.transpose(-4, 0), "transpose", "dim -4", "f32[2,3,4]");
  EXPECT_ERROR_MENTIONS(t.size(3), "size", "dim 3", "f32[2,3,4]");
  EXPECT_ERROR_MENTIONS(t.stride(-5), "stride", "dim -5", "f32[2,3,4]");
  EXPECT_ERROR_MENTIONS(t.permute({0, 1}), "permute", "2 dims", "f32[2,3,4]");
  EXPECT_ERROR_MENTIONS(t.permute({0, 1, 3}), "permute", "dim 3", "f32[2,3,4]");
  EXPECT_ERROR_MENTIONS(t.permute({0, 1, -3}), "permute", "repeated", "f32[2,3,4]");
  EXPECT_ERROR_MENTIONS(t.slice(3, 0, 1), "slice", "dim 3", "f32[2,3,4]");
  EXPECT_ERROR_MENTIONS(t.slice(0, 0, 1, 0), "slice", "step", "0", "f32[2,3,4]");
  EXPECT_ERROR_MENTIONS(t.slice(0, 0, 1, -1), "slice", "step", "-1", "f32[2,3,4]");
  EXPECT_ERROR_MENTIONS(t.select(1, 3), "select", "index 3", "f32[2,3,4]");
  EXPECT_ERROR_MENTIONS(t.select(1, -4), "select", "index -4", "f32[2,3,4]");
  EXPECT_ERROR_MENTIONS(t.select(3, 0), "select", "dim 3", "f32[2,3,4]");
  EXPECT_ERROR_MENTIONS(t.narrow(2, 2, 3), "narrow", "[2, 5)", "f32[2,3,4]");
  EXPECT_ERROR_MENTIONS(t.narrow(2, 0, -1), "narrow", "f32[2,3,4]");
  EXPECT_ERROR_MENTIONS(t.unsqueeze(4), "unsqueeze", "dim 4", "f32[2,3,4]");
  EXPECT_ERROR_MENTIONS(t.squeeze(-4), "squeeze", "dim -4", "f32[2,3,4]");
  EXPECT_ERROR_MENTIONS(Tensor::scalar(1).transpose(0, 0), "transpose", "f32[]");
}

TEST(TensorErrors, NegativeSizesAndBadShapes) {
  EXPECT_ERROR_MENTIONS(Tensor::empty({2, -3}), "empty", "negative", "[2,-3]");
  EXPECT_ERROR_MENTIONS(Tensor::zeros({-1}), "negative", "[-1]");
  EXPECT_ERROR_MENTIONS(Tensor::from_vector(std::vector<float>{1, 2}, {-2}), "from_vector", "[-2]");
  EXPECT_ERROR_MENTIONS(Tensor::from_vector(std::vector<float>{1, 2, 3, 4, 5}, {2, 3}), "from_vector", "5 values",
                        "[2,3]");
  const Tensor t = iota({2, 3, 4});
  EXPECT_ERROR_MENTIONS(t.view({-2, 12}), "view", "[-2,12]", "f32[2,3,4]");
  EXPECT_ERROR_MENTIONS(t.view({-1, -1}), "view", "-1", "f32[2,3,4]");
  EXPECT_ERROR_MENTIONS(t.view({5, 5}), "view", "[5,5]", "25", "f32[2,3,4]", "24");
  EXPECT_ERROR_MENTIONS(t.view({5, -1}), "view", "[5,-1]", "f32[2,3,4]");
  EXPECT_ERROR_MENTIONS(t.reshape({7, -1}), "reshape", "[7,-1]", "f32[2,3,4]");
  EXPECT_ERROR_MENTIONS(Tensor::zeros({0, 3}).view({-1, 0}), "view", "[-1,0]", "f32[0,3]");
  EXPECT_ERROR_MENTIONS(Tensor::arange(0, 1, 0), "arange", "step");
}

TEST(TensorErrors, BadViewOfNonContiguous) {
  const Tensor t = iota({2, 3}).mT();
  EXPECT_ERROR_MENTIONS(t.view({6}), "view", "f32[3,2]", "[6]", "reshape");
}

TEST(TensorErrors, ExpandMismatch) {
  const Tensor t = iota({3});
  EXPECT_ERROR_MENTIONS(t.expand({4}), "expand", "f32[3]", "[4]");
  EXPECT_ERROR_MENTIONS(t.expand({2, 4}), "expand", "f32[3]", "[2,4]");
  EXPECT_ERROR_MENTIONS(iota({2, 3}).expand({3}), "expand", "f32[2,3]", "fewer dims");
  EXPECT_ERROR_MENTIONS(t.expand({-1, 3}), "expand", "f32[3]", "[-1,3]");
  EXPECT_ERROR_MENTIONS(iota({1}).expand({-2}), "expand", "f32[1]", "[-2]");
}

TEST(TensorErrors, CopyShapeMismatch) {
  Tensor dst = Tensor::zeros({2, 3});
  EXPECT_ERROR_MENTIONS(dst.copy_(Tensor::zeros({4})), "copy_", "[4]", "[2,3]");
  EXPECT_ERROR_MENTIONS(dst.copy_(Tensor::zeros({2, 2, 3})), "copy_", "f32[2,2,3]", "f32[2,3]");
  EXPECT_ERROR_MENTIONS(dst.copy_(Tensor::zeros({3, 1})), "copy_", "[3,1]", "[2,3]");
}

TEST(TensorErrors, ItemAndDataNameTheTensor) {
  EXPECT_ERROR_MENTIONS(iota({2, 3}).item(), "item", "f32[2,3]", "6 elements");
  EXPECT_ERROR_MENTIONS(Tensor::zeros({0}).item(), "item", "f32[0]", "0 elements");
  const Tensor h = Tensor::zeros({2}, DType::F16);
  EXPECT_ERROR_MENTIONS(h.data<float>(), "data<T>", "f16[2]", "f32");
  EXPECT_ERROR_MENTIONS(Tensor::zeros({2}, DType::I32).data<int64_t>(), "data<T>", "i32[2]", "i64");
  EXPECT_EQ(h.data<Half>(), h.data_ptr());
  EXPECT_ERROR_MENTIONS(Tensor::zeros({2}, DType::I64).requires_grad_(), "requires_grad_", "i64[2]");
}

// The formats every error message uses for shapes and tensors (built without streams).
TEST(TensorErrors, DescriptionAndShapeFormats) {
  EXPECT_EQ(Tensor::zeros({2, 3}, DType::BF16).description(), "bf16[2,3]");
  EXPECT_EQ(Tensor::zeros({}).description(), "f32[]");
  EXPECT_EQ(Tensor::zeros({0, 7}, DType::I64).description(), "i64[0,7]");
  EXPECT_EQ(shape_str({}), "[]");
  EXPECT_EQ(shape_str({-1, 0, 12}), "[-1,0,12]");
  EXPECT_EQ(shape_str({std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()}),
            "[-9223372036854775808,9223372036854775807]");
}

TEST(TensorErrors, CheckFormatsItsLazyPartsAsTheEagerOnes) {
  // check() takes t.described() and shape_text(s) so that a passing check builds no string; a failing one
  // must print exactly what description() and shape_str() give, an undefined tensor included.
  const Tensor t = Tensor::zeros({2, 3}, DType::BF16), undefined;
  const Shape shape = {4, -1};
  try {
    check(false, "op: ", t.described(), " and ", undefined.described(), " at ", shape_text(shape));
    FAIL() << "check(false, ...) did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "op: " + t.description() + " and undefined at " + shape_str(shape));
    EXPECT_EQ(std::string(e.what()), "op: bf16[2,3] and undefined at [4,-1]");
  }
  EXPECT_NO_THROW(check(true, t.described(), shape_text(shape)));
}

TEST(TensorErrors, UndefinedTensor) {
  const Tensor undefined;
  EXPECT_FALSE(undefined.defined());
  EXPECT_EQ(undefined.description(), "undefined");
  EXPECT_EQ(undefined.str(), "tensor(undefined)");
  EXPECT_ERROR_MENTIONS(undefined.shape(), "undefined tensor");
  EXPECT_ERROR_MENTIONS(undefined.numel(), "undefined tensor");
  EXPECT_ERROR_MENTIONS(undefined.view({1}), "undefined tensor");
  EXPECT_ERROR_MENTIONS(undefined.item(), "undefined tensor");
  Tensor dst = Tensor::zeros({2});
  EXPECT_ERROR_MENTIONS(dst.copy_(undefined), "copy_", "undefined", "f32[2]");
}

}  // namespace
}  // namespace mixtape
