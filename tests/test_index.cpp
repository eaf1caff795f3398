// embedding, cat, stack and split: values against plain loops over the inputs' values, gradients by finite
// differences, and the errors.
#include <gtest/gtest.h>

#include <vector>

#include "autograd/autograd.h"
#include "autograd/gradcheck.h"
#include "tensor/ops.h"
#include "test_util.h"

using namespace mixtape;
using mixtape::testing::within_ulp;

namespace {

const DType kFloatDtypes[] = {DType::F32, DType::F16, DType::BF16, DType::F64};

std::vector<double> values(const Tensor& t) { return t.to_vector<double>(); }

}  // namespace

// ---- embedding --------------------------------------------------------------------------------------------

TEST(Embedding, GathersRowsInEveryDtypeForAnyIndexShape) {
  for (DType dtype : kFloatDtypes) {
    for (DType index_dtype : {DType::I32, DType::I64}) {
      const Tensor weight = Tensor::randn({7, 5}, 1, dtype);
      const std::vector<int64_t> ids = {3, 0, 6, 3, 3, 1};
      const Tensor indices = Tensor::from_vector(ids, {2, 3}).to(index_dtype);
      const Tensor out = embedding(weight, indices);
      EXPECT_EQ(out.shape(), (Shape{2, 3, 5}));
      EXPECT_EQ(out.dtype(), dtype);
      // A gather copies values: bit-exact.
      const std::vector<double> w = values(weight), o = values(out);
      for (size_t i = 0; i < ids.size(); ++i)
        for (size_t c = 0; c < 5; ++c) EXPECT_EQ(o[i * 5 + c], w[static_cast<size_t>(ids[i]) * 5 + c]);
    }
  }
}

TEST(Embedding, ReadsTransposedWeightAndStridedIndices) {
  const Tensor storage = Tensor::randn({5, 7}, 2);
  const Tensor weight = storage.mT();  // [7, 5], column stride 7
  const Tensor indices = Tensor::from_vector(std::vector<int64_t>{6, 9, 2, 9, 0, 9}, {6}).slice(0, 0, 6, 2);
  const Tensor out = embedding(weight, indices);  // rows 6, 2, 0
  const std::vector<double> s = values(storage), o = values(out);
  const int64_t rows[] = {6, 2, 0};
  for (int64_t i = 0; i < 3; ++i)
    for (int64_t c = 0; c < 5; ++c)
      EXPECT_EQ(o[static_cast<size_t>(i * 5 + c)], s[static_cast<size_t>(c * 7 + rows[i])]);
}

TEST(EmbeddingGrad, MatchesFiniteDifferencesWithRepeatedIndices) {
  const Tensor indices = Tensor::from_vector(std::vector<int64_t>{2, 0, 2, 4, 2, 0}, {2, 3});
  auto f = [&](const std::vector<Tensor>& in) { return embedding(in[0], indices); };
  const GradcheckResult result = gradcheck(f, {Tensor::randn({5, 3}, 3)});
  EXPECT_TRUE(result.ok) << result.message;
}

TEST(EmbeddingGrad, SumsRepeatedRowsInFp32AndRoundsOnce) {
  // 64 lookups of row 1 and one of row 3 with bf16/f16 gradients. The reference is the exact (f64) sum of the
  // 16-bit gradient values rounded once. An fp32 sum of 64 terms errs by <= 64 * 2^-24 relative (positive
  // values), far below half an ulp of bf16 (2^-9) or f16 (2^-12): at most 1 ulp, at a rounding boundary.
  // Summing in the 16-bit dtype would lose ~6 bits over 64 terms (tens of ulps).
  for (DType dtype : {DType::BF16, DType::F16}) {
    std::vector<int64_t> ids(64, 1);
    ids.push_back(3);
    const int64_t n = static_cast<int64_t>(ids.size()), C = 8;
    Tensor weight = Tensor::zeros({4, C}, dtype).requires_grad_();
    const Tensor grad_out = Tensor::rand({n, C}, 4, dtype);
    backward({embedding(weight, Tensor::from_vector(ids, {n}))}, {grad_out});
    const std::vector<double> g = values(grad_out);
    std::vector<double> reference(static_cast<size_t>(4 * C), 0.0);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < C; ++c)
        reference[static_cast<size_t>(ids[i] * C + c)] += g[static_cast<size_t>(i * C + c)];
    ASSERT_EQ(weight.grad().dtype(), dtype);
    EXPECT_TRUE(within_ulp(weight.grad(), Tensor::from_vector(reference, {4, C}), 1)) << dtype_name(dtype);
  }
}

TEST(EmbeddingGrad, IsBitwiseDeterministicOnLargeInputs) {
  // Large enough to run on every thread; the grouping by row fixes the summation order.
  const int64_t V = 300, n = 20000, C = 64;
  const Tensor indices = Tensor::randint(0, V, {n}, 5);
  const Tensor grad_out = Tensor::randn({n, C}, 6);
  std::vector<float> first;
  for (int run = 0; run < 3; ++run) {
    Tensor weight = Tensor::randn({V, C}, 7).requires_grad_();
    backward({embedding(weight, indices)}, {grad_out});
    const std::vector<float> grad = weight.grad().to_vector<float>();
    if (run == 0) {
      first = grad;
    } else {
      EXPECT_EQ(grad, first);
    }
  }
  // And the sums are right: compare one row with a double loop.
  const std::vector<int64_t> ids = indices.to_vector<int64_t>();
  const std::vector<double> g = values(grad_out);
  std::vector<double> row(C, 0.0);
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] == 17)
      for (int64_t c = 0; c < C; ++c) row[c] += g[static_cast<size_t>(i * C + c)];
  for (int64_t c = 0; c < C; ++c) EXPECT_NEAR(first[static_cast<size_t>(17 * C + c)], row[c], 1e-4);
}

TEST(EmbeddingErrors, NameTheOpTheIndexAndTheVocabulary) {
  const Tensor weight = Tensor::randn({5, 3}, 8);
  EXPECT_ERROR_MENTIONS(embedding(weight, Tensor::from_vector(std::vector<int64_t>{1, 10}, {2})), "embedding",
                        "index 10", "f32[5,3]", "5 rows");
  EXPECT_ERROR_MENTIONS(embedding(weight, Tensor::from_vector(std::vector<int32_t>{-1}, {1})), "embedding",
                        "index -1", "5 rows");
  EXPECT_ERROR_MENTIONS(embedding(weight, Tensor::ones({2})), "embedding", "f32[2]", "i32 or i64");
  EXPECT_ERROR_MENTIONS(embedding(Tensor::ones({5}), Tensor::zeros({2}, DType::I64)), "embedding", "f32[5]",
                        "2-d");
  EXPECT_ERROR_MENTIONS(embedding(Tensor::zeros({5, 3}, DType::I64), Tensor::zeros({2}, DType::I64)),
                        "embedding", "i64[5,3]", "floating");
}

// ---- cat, stack -------------------------------------------------------------------------------------------

TEST(Cat, JoinsAlongAnyDimInEveryDtype) {
  for (DType dtype : kFloatDtypes) {
    const Tensor a = Tensor::arange(0, 6, 1, dtype).view({2, 3}),
                 b = Tensor::arange(6, 10, 1, dtype).view({2, 2});
    const Tensor along_1 = cat({a, b}, -1);
    EXPECT_EQ(along_1.shape(), (Shape{2, 5}));
    EXPECT_EQ(values(along_1), (std::vector<double>{0, 1, 2, 6, 7, 3, 4, 5, 8, 9}));
    const Tensor c = Tensor::arange(10, 13, 1, dtype).view({1, 3});
    const Tensor along_0 = cat({a, c, a.slice(0, 1, 2)}, 0);
    EXPECT_EQ(along_0.shape(), (Shape{4, 3}));
    EXPECT_EQ(values(along_0), (std::vector<double>{0, 1, 2, 3, 4, 5, 10, 11, 12, 3, 4, 5}));
  }
  // Non-contiguous inputs and empty pieces.
  const Tensor t = Tensor::arange(0, 6).view({2, 3}).mT();  // [[0,3],[1,4],[2,5]]
  EXPECT_EQ(values(cat({t, Tensor::empty({3, 0}), t}, 1)),
            (std::vector<double>{0, 3, 0, 3, 1, 4, 1, 4, 2, 5, 2, 5}));
  EXPECT_EQ(values(cat({Tensor::from_vector(std::vector<int64_t>{1, 2}, {2}),
                        Tensor::from_vector(std::vector<int64_t>{3}, {1})},
                       0)),
            (std::vector<double>{1, 2, 3}));
}

TEST(Cat, MixedFloatingDtypesPromote) {
  const Tensor out = cat({Tensor::ones({2}, DType::BF16), Tensor::full({1}, 0.1, DType::F32)}, 0);
  EXPECT_EQ(out.dtype(), DType::F32);
  EXPECT_EQ(values(out), (std::vector<double>{1, 1, static_cast<double>(0.1f)}));
  EXPECT_EQ(cat({Tensor::ones({1}, DType::F16), Tensor::ones({1}, DType::BF16)}, 0).dtype(), DType::F32);
  EXPECT_EQ(cat({Tensor::ones({1}, DType::F16), Tensor::ones({1}, DType::F64)}, 0).dtype(), DType::F64);
}

TEST(CatGrad, MatchesFiniteDifferences) {
  auto f = [](const std::vector<Tensor>& in) { return cat({in[0], in[1].mT(), in[2]}, 1); };
  const GradcheckResult result =
      gradcheck(f, {Tensor::randn({3, 2}, 9), Tensor::randn({4, 3}, 10), Tensor::randn({3, 1}, 11)});
  EXPECT_TRUE(result.ok) << result.message;
}

TEST(CatGrad, GradientsComeBackInEachInputsDtype) {
  Tensor a = Tensor::ones({2}, DType::BF16).requires_grad_(),
         b = Tensor::ones({3}, DType::F32).requires_grad_();
  backward({cat({a, b}, 0)}, {Tensor::arange(1, 6)});
  EXPECT_EQ(a.grad().dtype(), DType::BF16);
  EXPECT_EQ(values(a.grad()), (std::vector<double>{1, 2}));
  EXPECT_EQ(values(b.grad()), (std::vector<double>{3, 4, 5}));
}

TEST(Stack, AddsANewDim) {
  const Tensor a = Tensor::arange(0, 3), b = Tensor::arange(3, 6);
  const Tensor rows = stack({a, b}, 0);
  EXPECT_EQ(rows.shape(), (Shape{2, 3}));
  EXPECT_EQ(values(rows), (std::vector<double>{0, 1, 2, 3, 4, 5}));
  const Tensor cols = stack({a, b}, -1);
  EXPECT_EQ(cols.shape(), (Shape{3, 2}));
  EXPECT_EQ(values(cols), (std::vector<double>{0, 3, 1, 4, 2, 5}));
  EXPECT_EQ(stack({Tensor::scalar(1), Tensor::scalar(2)}, 0).shape(), Shape{2});
}

TEST(StackGrad, MatchesFiniteDifferences) {
  auto f = [](const std::vector<Tensor>& in) { return stack({in[0], in[1].mT()}, 1); };
  const GradcheckResult result = gradcheck(f, {Tensor::randn({2, 3}, 12), Tensor::randn({3, 2}, 13)});
  EXPECT_TRUE(result.ok) << result.message;
}

TEST(CatErrors, NameTheOpAndTheShapes) {
  EXPECT_ERROR_MENTIONS(cat({}, 0), "cat", "at least one");
  EXPECT_ERROR_MENTIONS(cat({Tensor::ones({2, 3}), Tensor::ones({3, 3})}, 1), "cat", "f32[3,3]", "f32[2,3]",
                        "dim 0");
  EXPECT_ERROR_MENTIONS(cat({Tensor::ones({2, 3}), Tensor::ones({3})}, 0), "cat", "f32[3]", "dims");
  EXPECT_ERROR_MENTIONS(cat({Tensor::ones({2}), Tensor::ones({2})}, 1), "cat", "dim");
  EXPECT_ERROR_MENTIONS(cat({Tensor::ones({2}), Tensor::zeros({2}, DType::I64)}, 0), "cat", "f32[2]",
                        "i64[2]");
  EXPECT_ERROR_MENTIONS(cat({Tensor::scalar(1)}, 0), "cat", "f32[]", "at least 1 dim");
  EXPECT_ERROR_MENTIONS(stack({Tensor::ones({2, 3}), Tensor::ones({2, 4})}, 0), "stack", "f32[2,4]",
                        "f32[2,3]");
  EXPECT_ERROR_MENTIONS(stack({}, 0), "stack", "at least one");
}

// ---- split ------------------------------------------------------------------------------------------------

TEST(Split, BySizeGivesViewsWithASmallerLastPiece) {
  const Tensor x = Tensor::arange(0, 14).view({2, 7});
  const std::vector<Tensor> pieces = split(x, 3, 1);
  ASSERT_EQ(pieces.size(), 3u);
  EXPECT_EQ(pieces[0].shape(), (Shape{2, 3}));
  EXPECT_EQ(pieces[2].shape(), (Shape{2, 1}));
  EXPECT_EQ(pieces[1].storage(), x.storage());  // a view, not a copy
  EXPECT_EQ(values(pieces[1]), (std::vector<double>{3, 4, 5, 10, 11, 12}));
  EXPECT_EQ(values(pieces[2]), (std::vector<double>{6, 13}));
  EXPECT_EQ(split(x, 2, 0).size(), 1u);
  EXPECT_EQ(split(Tensor::empty({0, 3}), 2, 0).size(), 1u);
}

TEST(Split, BySizesListsEveryPiece) {
  const Tensor x = Tensor::arange(0, 6);
  const std::vector<Tensor> pieces = split(x, std::vector<int64_t>{1, 0, 3, 2}, 0);
  ASSERT_EQ(pieces.size(), 4u);
  EXPECT_EQ(values(pieces[0]), (std::vector<double>{0}));
  EXPECT_EQ(pieces[1].numel(), 0);
  EXPECT_EQ(values(pieces[2]), (std::vector<double>{1, 2, 3}));
  EXPECT_EQ(values(pieces[3]), (std::vector<double>{4, 5}));
}

TEST(SplitGrad, MatchesFiniteDifferences) {
  // A middle piece joined with another input: the piece's gradient lands in its own slice, zeros elsewhere.
  auto f = [](const std::vector<Tensor>& in) {
    return cat({split(in[0], std::vector<int64_t>{1, 2, 1}, 1)[1], in[1]}, 1);
  };
  const GradcheckResult result = gradcheck(f, {Tensor::randn({3, 4}, 14), Tensor::randn({3, 2}, 16)});
  EXPECT_TRUE(result.ok) << result.message;
  // Every piece of one input rejoined in another order: the pieces' gradients accumulate into one input.
  auto h = [](const std::vector<Tensor>& in) {
    const std::vector<Tensor> pieces = split(in[0], 2, 1);  // widths 2, 2, 1
    return cat({pieces[2], pieces[0], pieces[1]}, 1);
  };
  const GradcheckResult reordered = gradcheck(h, {Tensor::randn({3, 5}, 17)});
  EXPECT_TRUE(reordered.ok) << reordered.message;
  auto g = [](const std::vector<Tensor>& in) { return split(in[0], 2, 0)[1]; };
  EXPECT_TRUE(gradcheck(g, {Tensor::randn({5, 2}, 15)}).ok);
}

TEST(SplitErrors, NameTheOpAndTheShapes) {
  EXPECT_ERROR_MENTIONS(split(Tensor::ones({6}), 0, 0), "split", "split_size", "f32[6]");
  EXPECT_ERROR_MENTIONS(split(Tensor::ones({6}), std::vector<int64_t>{2, 3}, 0), "split", "[2,3]", "sum to 5",
                        "f32[6]", "has 6");
  EXPECT_ERROR_MENTIONS(split(Tensor::ones({6}), std::vector<int64_t>{7, -1}, 0), "split", "negative");
  EXPECT_ERROR_MENTIONS(split(Tensor::scalar(1), 1, 0), "split", "f32[]");
  EXPECT_ERROR_MENTIONS(split(Tensor::ones({6}), 2, 1), "split");
}
