// Tensor construction, views and copies: the geometry every op stands on.
#include <gtest/gtest.h>

#include "autograd/autograd.h"
#include "tensor/ops.h"
#include "test_util.h"

using namespace mixtape;
using mixtape::testing::all_close;

TEST(Tensor, FactoriesFillShapeAndDtype) {
  const Tensor z = Tensor::zeros({2, 3}, DType::BF16);
  EXPECT_EQ(z.shape(), (Shape{2, 3}));
  EXPECT_EQ(z.dtype(), DType::BF16);
  EXPECT_EQ(z.to_vector<double>(), std::vector<double>(6, 0.0));
  EXPECT_EQ(Tensor::full({2}, 2.5, DType::F16).to_vector<double>(), (std::vector<double>{2.5, 2.5}));
  EXPECT_EQ(Tensor::arange(0, 5, 2, DType::I64).to_vector<int64_t>(), (std::vector<int64_t>{0, 2, 4}));
  EXPECT_DOUBLE_EQ(Tensor::scalar(7).item(), 7.0);
}

TEST(Tensor, TransposeIsAViewAndContiguousCopies) {
  const Tensor a = Tensor::arange(0, 6).view({2, 3});
  const Tensor t = a.transpose(0, 1);
  EXPECT_EQ(t.shape(), (Shape{3, 2}));
  EXPECT_FALSE(t.is_contiguous());
  EXPECT_EQ(t.storage(), a.storage());
  EXPECT_EQ(t.contiguous().to_vector<double>(), (std::vector<double>{0, 3, 1, 4, 2, 5}));
}

TEST(Tensor, ViewOfNonContiguousNeedsReshape) {
  const Tensor t = Tensor::arange(0, 6).view({2, 3}).mT();
  EXPECT_THROW(t.view({6}), Error);
  EXPECT_EQ(t.reshape({6}).to_vector<double>(), (std::vector<double>{0, 3, 1, 4, 2, 5}));
}

TEST(Tensor, ToF16RoundsToNearestEven) {
  // 2049 lies halfway between the f16 neighbours 2048 and 2050: ties go to the even mantissa (2048).
  const Tensor t = Tensor::from_vector(std::vector<double>{2049.0, 2051.0}, {2}).to(DType::F16);
  EXPECT_EQ(t.to_vector<double>(), (std::vector<double>{2048.0, 2052.0}));
}

TEST(Tensor, EmptyTensorsAreContiguousWhateverTheirShape) {
  EXPECT_TRUE(Tensor::zeros({1, 2, 0, 4}).is_contiguous());
  EXPECT_TRUE(Tensor::zeros({0, 3}).mT().is_contiguous());
  EXPECT_EQ(Tensor::zeros({2, 0, 3}).contiguous().numel(), 0);
}

// A shape whose element or byte count does not fit in 64 bits is an error, not a wrapped (small) buffer; an
// empty shape with huge other sizes is empty.
TEST(Tensor, ShapesTooLargeToCountAreErrors) {
  const int64_t big = int64_t(1) << 62;
  EXPECT_ERROR_MENTIONS(Tensor::zeros({big, 4}), "shape [4611686018427387904,4]", "more elements than fit");
  EXPECT_ERROR_MENTIONS(Tensor::zeros({big, 1}, DType::F32), "empty", "f32", "more bytes than fit");
  EXPECT_ERROR_MENTIONS(Tensor::ones({1}).expand({big, 4}).numel(), "more elements than fit");
  EXPECT_EQ(shape_numel({big, 4, 0}), 0);
  EXPECT_EQ(Tensor::zeros({big, 4, 0}).numel(), 0);
  EXPECT_ERROR_MENTIONS(Tensor::arange(0, 1e30, 1e-30), "arange", "expected at most 2^62");
}

TEST(Tensor, InPlaceArithmeticOnABroadcastViewIsAnError) {
  Tensor base = Tensor::ones({1, 3});
  Tensor wide = base.expand({4, 3});
  EXPECT_THROW(wide.mul_(2), Error);
  EXPECT_THROW(wide.add_(Tensor::ones({4, 3})), Error);
  EXPECT_THROW(wide.copy_(Tensor::zeros({4, 3})), Error);
  EXPECT_EQ(base.to_vector<double>(), (std::vector<double>{1, 1, 1}));  // nothing was written
}

TEST(CpuAllocator, HandsBackTheBlockOfASizeFreedLast) {
  // The last freed block of a size is the likeliest still in cache, so it is the one a new tensor gets (the
  // first-freed block, the longest unused, is the likeliest evicted). An odd size no other test uses.
  const Shape shape{12345};
  const void* first_freed = nullptr;
  const void* last_freed = nullptr;
  {
    const Tensor a = Tensor::empty(shape), b = Tensor::empty(shape);
    first_freed = a.data_ptr();
    last_freed = b.data_ptr();
    ASSERT_NE(first_freed, last_freed);
  }  // b is destroyed first, then a
  std::swap(first_freed, last_freed);
  const Tensor c = Tensor::empty(shape);
  EXPECT_EQ(c.data_ptr(), last_freed);
  const Tensor d = Tensor::empty(shape);
  EXPECT_EQ(d.data_ptr(), first_freed);
}
