// Autocast: the scope (amp/autocast.h) under its default table (PyTorch's, tensor/autocast_tables.h), the
// front-end hook, the cast cache, and a GPT forward/backward under bf16 autocast. Each table's classes
// against its framework's lists: tests/test_autocast_policy.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include "amp/autocast.h"
#include "amp/policy.h"
#include "autograd/autograd.h"
#include "nn/gpt.h"
#include "tensor/ops.h"
#include "tests/cross_entropy_in_place.h"
#include "tests/test_util.h"

namespace mixtape {
namespace {

const std::vector<DType> kAutocastDtypes = {DType::F16, DType::BF16};

Tensor randn(const Shape& shape, uint64_t seed, DType dtype = DType::F32) {
  return Tensor::randn(shape, seed, dtype);
}
// Positive values for log / pow / divisions.
Tensor positive(const Shape& shape, uint64_t seed, DType dtype) {
  return testing::uniform_tensor(shape, seed, 0.5, 2.0, dtype);
}

// ---- the policy classes ----

TEST(AutocastPolicy, LowerPrecisionOpsRunInTheAutocastDtype) {
  for (DType low : kAutocastDtypes) {
    Autocast guard(low);
    const Tensor a = randn({3, 4}, 1), b = randn({4, 5}, 2);
    EXPECT_EQ(matmul(a, b).dtype(), low);
    EXPECT_EQ(matmul(randn({2, 3, 4}, 3), randn({2, 4, 5}, 4)).dtype(), low);  // bmm is batched matmul
    EXPECT_EQ(linear(a, randn({6, 4}, 5), randn({6}, 6)).dtype(), low);
    EXPECT_EQ(linear(a, randn({6, 4}, 5)).dtype(), low);  // no bias: the undefined tensor is left alone
    const Tensor q = randn({1, 2, 4, 8}, 7), k = randn({1, 2, 4, 8}, 8), v = randn({1, 2, 4, 8}, 9);
    EXPECT_EQ(scaled_dot_product_attention(q, k, v).dtype(), low);
    EXPECT_EQ(causal_self_attention(randn({1, 4, 3 * 16}, 10), 2).dtype(), low);
  }
}

TEST(AutocastPolicy, Fp32OpsReturnF32FromHalfInputs) {
  for (DType low : kAutocastDtypes) {
    Autocast guard(low);
    const Tensor x = randn({3, 8}, 11, low), p = positive({3, 8}, 12, low);
    EXPECT_EQ(softmax(x, -1).dtype(), DType::F32);
    EXPECT_EQ(log_softmax(x, -1).dtype(), DType::F32);
    EXPECT_EQ(softmax_cross_entropy(x, Tensor::randint(0, 8, {3}, 13)).dtype(), DType::F32);
    EXPECT_EQ(layer_norm(x, Tensor::ones({8}, low), Tensor::zeros({8}, low)).out.dtype(), DType::F32);
    EXPECT_EQ(rms_norm(x, Tensor::ones({8}, low)).out.dtype(), DType::F32);
    EXPECT_EQ(exp(x).dtype(), DType::F32);
    EXPECT_EQ(log(p).dtype(), DType::F32);
    EXPECT_EQ(rsqrt(p).dtype(), DType::F32);
    EXPECT_EQ(pow(p, x).dtype(), DType::F32);
    EXPECT_EQ(pow(p, 2.5).dtype(), DType::F32);
    EXPECT_EQ(sum(x).dtype(), DType::F32);
    EXPECT_EQ(norm(x).dtype(), DType::F32);
    EXPECT_EQ(norm(x, 3, {1}).dtype(), DType::F32);
    EXPECT_EQ(norm(x, std::numeric_limits<double>::infinity(), {0}).dtype(), DType::F32);
  }
}

TEST(AutocastPolicy, Fp32OpsComputeWhatTheExplicitlyWidenedInputsGive) {
  Autocast guard(DType::BF16);
  const Tensor x = randn({4, 16}, 14, DType::BF16);
  const Tensor widened = x.to(DType::F32);
  // The same kernel on the same f32 values: bit for bit.
  EXPECT_TRUE(testing::all_close(softmax(x, -1), softmax(widened, -1), 0, 0));
  EXPECT_TRUE(testing::all_close(sum(x, {1}), sum(widened, {1}), 0, 0));
  EXPECT_TRUE(testing::all_close(norm(x, 2, {1}), norm(widened, 2, {1}), 0, 0));
}

// add/sub/mul/div/cat/stack/where are in none of PyTorch's autocast lists: mixed floating inputs meet in the
// widest, as outside autocast (type promotion).
TEST(AutocastPolicy, UnlistedOpsMeetMixedInputsInTheWidest) {
  for (DType low : kAutocastDtypes) {
    Autocast guard(low);
    const Tensor h = randn({2, 3}, 15, low), f = positive({2, 3}, 16, DType::F32);
    const uint64_t before = autocast_cast_count();
    EXPECT_EQ(add(h, f).dtype(), DType::F32);
    EXPECT_EQ(sub(h, f).dtype(), DType::F32);
    EXPECT_EQ(mul(h, f).dtype(), DType::F32);
    EXPECT_EQ(div(h, f).dtype(), DType::F32);
    EXPECT_EQ(cat({h, f}, 0).dtype(), DType::F32);
    EXPECT_EQ(stack({h, f}, 0).dtype(), DType::F32);
    EXPECT_EQ(where(h, h, f).dtype(), DType::F32);
    // One cast of h per op for cat, stack and where (h is not a leaf that requires grad, so it is not
    // cached): their promotion happens in the hook, on the tape. add, sub, mul and div on the CPU read h in
    // place and promote inside the kernel (Backend::binary_reads_mixed), so the hook casts nothing for them
    // (AutocastPolicy.KernelPromotionGivesTheHooksBitsAndGradients).
    EXPECT_EQ(autocast_cast_count() - before, 3u);
    // Same-dtype inputs stay as they are: promotion never narrows and never goes to f32 on its own.
    EXPECT_EQ(add(h, h).dtype(), low);
    EXPECT_EQ(cat({h, h}, 1).dtype(), low);
    EXPECT_EQ(autocast_cast_count() - before, 3u);
  }
}

TEST(AutocastPolicy, KernelPromotionGivesTheHooksBitsAndGradients) {
  // add/sub/mul/div of an f16/bf16 and an f32 tensor: the CPU kernel reads the 16-bit input in place. The
  // outputs and both gradients must be bit for bit those of the explicit cast the hook would make, with and
  // without autocast, including a broadcast 16-bit operand; and no f32 copy of the 16-bit input is made.
  using BinaryFn = Tensor (*)(const Tensor&, const Tensor&);
  const BinaryFn ops[] = {[](const Tensor& a, const Tensor& b) { return add(a, b); },
                          [](const Tensor& a, const Tensor& b) { return sub(a, b); },
                          [](const Tensor& a, const Tensor& b) { return mul(a, b); },
                          [](const Tensor& a, const Tensor& b) { return div(a, b); }};
  for (DType low : kAutocastDtypes)
    for (bool autocast : {false, true})
      for (bool broadcast : {false, true}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(low) << (autocast ? " autocast" : "")
                                          << (broadcast ? " broadcast" : ""));
        int k = 0;
        for (BinaryFn op : ops) {
          SCOPED_TRACE(k++);
          Tensor h = positive(broadcast ? Shape{1, 5} : Shape{3, 5}, 60, low).detach().requires_grad_();
          Tensor f = positive({3, 5}, 61, DType::F32).detach().requires_grad_();
          Tensor h_ref = h.detach().requires_grad_(), f_ref = f.detach().requires_grad_();
          std::optional<Autocast> guard;
          if (autocast) guard.emplace(low);
          const Tensor out = op(h, f), expected = op(h_ref.to(DType::F32), f_ref);
          guard.reset();
          EXPECT_EQ(out.dtype(), DType::F32);
          EXPECT_EQ(out.to_vector<float>(), expected.to_vector<float>());
          const Tensor g = positive({3, 5}, 62, DType::F32);
          backward({out}, {g});
          backward({expected}, {g});
          EXPECT_EQ(h.grad().dtype(), low);
          EXPECT_EQ(h.grad().to_vector<float>(), h_ref.grad().to_vector<float>());
          EXPECT_EQ(f.grad().to_vector<float>(), f_ref.grad().to_vector<float>());
        }
      }
  // Memory: adding a bf16 branch to an f32 stream allocates the f32 output only, not an f32 copy of the
  // branch (which casting first, then adding, would make: twice the output's bytes).
  const int64_t n = 1 << 16;
  const Tensor stream = Tensor::randn({n}, 63), branch = Tensor::randn({n}, 64, DType::BF16);
  const size_t bytes = testing::peak_extra_bytes([&] { add(stream, branch); });
  EXPECT_GE(bytes, static_cast<size_t>(n) * 4);
  EXPECT_LT(bytes, static_cast<size_t>(n) * 8);
}

// The one Fp32 op that reads 16-bit inputs in place: its kernels compute in fp32 on the widened values.
TEST(AutocastPolicy, CrossEntropyReadsSixteenBitLogitsInPlace) {
  testing::expect_cross_entropy_reads_sixteen_bit_logits_in_place(Device::cpu());
}

TEST(AutocastPolicy, OpsOutsideTheTableKeepTheirInputDtype) {
  Autocast guard(DType::BF16);
  const Tensor f = randn({2, 4}, 17);
  const uint64_t before = autocast_cast_count();
  EXPECT_EQ(gelu(f).dtype(), DType::F32);
  EXPECT_EQ(relu(randn({2, 4}, 18, DType::F16)).dtype(), DType::F16);
  EXPECT_EQ(tanh(f).dtype(), DType::F32);
  EXPECT_EQ(max(f).dtype(), DType::F32);
  EXPECT_EQ(embedding(f, Tensor::randint(0, 2, {3}, 19)).dtype(), DType::F32);
  EXPECT_EQ(autocast_cast_count(), before);
}

TEST(AutocastPolicy, IntegerAndF64InputsAreNeverCast) {
  Autocast guard(DType::F16);
  const Tensor d = randn({3, 3}, 20, DType::F64);
  EXPECT_EQ(matmul(d, d).dtype(), DType::F64);  // f64 is the reference dtype: left alone
  EXPECT_EQ(sum(d).dtype(), DType::F64);
  const Tensor targets = Tensor::randint(0, 3, {3}, 21);
  EXPECT_EQ(autocast_cast(targets, DType::F16).dtype(), DType::I64);
  EXPECT_TRUE(autocast_cast(targets, DType::F16).same(targets));
  EXPECT_EQ(softmax_cross_entropy(randn({3, 3}, 22, DType::F16), targets).dtype(), DType::F32);
}

TEST(AutocastPolicy, NothingChangesWithoutAScope) {
  ASSERT_FALSE(Autocast::enabled());
  const uint64_t before = autocast_cast_count();
  EXPECT_EQ(matmul(randn({2, 2}, 23), randn({2, 2}, 24)).dtype(), DType::F32);
  EXPECT_EQ(softmax(randn({2, 2}, 25, DType::BF16), -1).dtype(), DType::BF16);
  EXPECT_EQ(sum(randn({2, 2}, 26, DType::F16)).dtype(), DType::F16);
  EXPECT_EQ(autocast_cast_count(), before);
}

// ---- the scope ----

TEST(Autocast, RejectsDtypesOtherThanF16AndBF16) {
  EXPECT_ERROR_MENTIONS(Autocast(DType::F32), "Autocast", "f16 or bf16", "f32");
  EXPECT_ERROR_MENTIONS(Autocast(DType::I64), "Autocast", "i64");
  EXPECT_FALSE(Autocast::enabled());
  EXPECT_EQ(autocast_scope_depth(), 0);
}

TEST(Autocast, InnerScopeCanDisableAndTheOuterStateReturns) {
  const Tensor a = randn({2, 2}, 27), b = randn({2, 2}, 28);
  {
    Autocast outer(DType::BF16);
    EXPECT_EQ(matmul(a, b).dtype(), DType::BF16);
    {
      Autocast off(std::nullopt);
      EXPECT_FALSE(Autocast::enabled());
      EXPECT_EQ(matmul(a, b).dtype(), DType::F32);
    }
    EXPECT_EQ(Autocast::dtype(), DType::BF16);
    EXPECT_EQ(matmul(a, b).dtype(), DType::BF16);
  }
  EXPECT_FALSE(Autocast::enabled());
  EXPECT_EQ(matmul(a, b).dtype(), DType::F32);
}

TEST(Autocast, InnerScopeCanChangeTheDtype) {
  const Tensor a = randn({2, 2}, 29), b = randn({2, 2}, 30);
  Autocast outer(DType::BF16);
  {
    Autocast inner(DType::F16);
    EXPECT_EQ(matmul(a, b).dtype(), DType::F16);
  }
  EXPECT_EQ(matmul(a, b).dtype(), DType::BF16);
}

TEST(Autocast, IsThreadLocal) {
  Autocast guard(DType::BF16);
  const Tensor a = randn({2, 2}, 31), b = randn({2, 2}, 32);
  std::optional<DType> other_dtype = DType::F64;
  bool other_enabled = true;
  std::thread other([&] {
    other_enabled = Autocast::enabled();
    other_dtype = matmul(a, b).dtype();
  });
  other.join();
  EXPECT_FALSE(other_enabled);
  EXPECT_EQ(other_dtype, DType::F32);
  EXPECT_EQ(matmul(a, b).dtype(), DType::BF16);
  // And a scope opened on another thread does not leak here.
  std::thread opener([] {
    Autocast inner(DType::F16);
    (void)inner;
  });
  opener.join();
  EXPECT_EQ(Autocast::dtype(), DType::BF16);
}

// ---- gradients ----

TEST(Autocast, GradientsReachF32LeavesAsF32AndMatchTheExplicitCasts) {
  const Tensor x0 = randn({4, 8}, 33), w0 = randn({8, 3}, 34);
  Tensor x = x0.detach(), w = w0.detach();
  x.requires_grad_();
  w.requires_grad_();
  Tensor loss;
  {
    Autocast guard(DType::BF16);
    loss = sum(mul(matmul(x, w), matmul(x, w)));  // sum is fp32 policy: the loss is f32
  }
  EXPECT_EQ(loss.dtype(), DType::F32);
  backward(loss);
  ASSERT_TRUE(w.grad().defined());
  EXPECT_EQ(w.grad().dtype(), DType::F32);
  EXPECT_EQ(x.grad().dtype(), DType::F32);

  // The same computation with the casts written out: identical ops, so identical gradients.
  Tensor xe = x0.detach(), we = w0.detach();
  xe.requires_grad_();
  we.requires_grad_();
  const Tensor y = matmul(xe.to(DType::BF16), we.to(DType::BF16));
  backward(sum(mul(y, y).to(DType::F32)));
  EXPECT_TRUE(testing::all_close(w.grad(), we.grad(), 0, 0));
  EXPECT_TRUE(testing::all_close(x.grad(), xe.grad(), 0, 0));

  // Against the all-f32 gradient: 2 (x w) x^T summed over K=8 and N=3 with bf16 operands (8 significand
  // bits, relative rounding 2^-9 per operand, a few roundings per path): within 2^-5 relative plus a small
  // absolute term for sums that cancel.
  Tensor xf = x0.detach(), wf = w0.detach();
  xf.requires_grad_();
  wf.requires_grad_();
  const Tensor yf = matmul(xf, wf);
  backward(sum(mul(yf, yf)));
  EXPECT_TRUE(testing::all_close(w.grad(), wf.grad(), 0.1, 1.0 / 32));
}

TEST(Autocast, EachLeafGetsItsGradientInItsOwnDtype) {
  Tensor h = randn({2, 5}, 46, DType::BF16).detach(), f = randn({2, 5}, 47).detach();
  h.requires_grad_();
  f.requires_grad_();
  Tensor loss;
  {
    Autocast guard(DType::F16);
    // softmax widens h to f32 (fp32 policy); mul and add promote; matmul narrows f to f16.
    loss = add(sum(mul(softmax(h, -1), h)), sum(matmul(f, f.mT())));
  }
  backward(loss);
  EXPECT_EQ(h.grad().dtype(), DType::BF16);
  EXPECT_EQ(f.grad().dtype(), DType::F32);
}

TEST(Autocast, BackwardInsideAnOpenScopeComputesInTheSavedDtypes) {
  Tensor w = randn({3, 3}, 35).detach();
  w.requires_grad_();
  Autocast guard(DType::BF16);
  const Tensor loss = sum(matmul(randn({2, 3}, 36), w));
  backward(loss);  // backward ignores the open scope
  EXPECT_EQ(w.grad().dtype(), DType::F32);
  EXPECT_TRUE(Autocast::enabled());
}

// ---- the cast cache ----

TEST(AutocastCache, ALeafWeightIsCastOncePerScope) {
  Tensor w = randn({4, 4}, 37).detach();
  w.requires_grad_();
  const Tensor x = randn({2, 4}, 38, DType::BF16);
  Tensor first_cast;
  {
    Autocast guard(DType::BF16);
    const uint64_t before = autocast_cast_count();
    matmul(x, w);
    matmul(x, w);
    linear(x, w);
    EXPECT_EQ(autocast_cast_count() - before, 1u);
    EXPECT_EQ(autocast_cache_size(), 1u);
    first_cast = autocast_cast(w, DType::BF16);
    EXPECT_TRUE(first_cast.same(autocast_cast(w, DType::BF16)));  // the same tensor object
    {
      Autocast inner(DType::BF16);  // an inner scope shares the outermost scope's cache
      EXPECT_TRUE(first_cast.same(autocast_cast(w, DType::BF16)));
    }
    EXPECT_EQ(autocast_cache_size(), 1u);
    // A different target dtype, or a different view of the weight, is another cast.
    EXPECT_FALSE(autocast_cast(w, DType::F16).same(first_cast));
    EXPECT_EQ(autocast_cache_size(), 2u);
  }
  EXPECT_EQ(autocast_cache_size(), 0u);  // dropped when the outermost scope closes
  Autocast again(DType::BF16);
  EXPECT_FALSE(autocast_cast(w, DType::BF16).same(first_cast));
}

TEST(AutocastCache, AnInPlaceUpdateOfTheWeightMissesTheCache) {
  Tensor w = randn({4, 4}, 39).detach();
  w.requires_grad_();
  Autocast guard(DType::BF16);
  const Tensor before = autocast_cast(w, DType::BF16);
  w.bump_version();  // what an optimizer step does
  EXPECT_FALSE(autocast_cast(w, DType::BF16).same(before));
}

TEST(AutocastCache, ActivationsAndNoGradCastsAreNotCached) {
  Autocast guard(DType::BF16);
  const Tensor activation = randn({4, 4}, 40);  // requires no grad
  EXPECT_FALSE(autocast_cast(activation, DType::BF16).same(autocast_cast(activation, DType::BF16)));
  Tensor w = randn({4, 4}, 41).detach();
  w.requires_grad_();
  Tensor nonleaf = mul(w, w);
  EXPECT_FALSE(autocast_cast(nonleaf, DType::BF16).same(autocast_cast(nonleaf, DType::BF16)));
  {
    NoGradGuard no_grad;
    EXPECT_EQ(matmul(activation, w).dtype(), DType::BF16);
  }
  EXPECT_EQ(autocast_cache_size(), 0u);
  // ...so a later use with grad on still reaches w.
  backward(sum(matmul(activation, w)));
  EXPECT_TRUE(w.grad().defined());
}

TEST(AutocastCache, ACachedCastServesASecondForwardAndBackwardInTheSameScope) {
  Tensor w = randn({3, 2}, 44).detach();
  w.requires_grad_();
  const Tensor x = randn({4, 3}, 45);
  Autocast guard(DType::BF16);
  backward(sum(matmul(x, w)));
  const std::vector<double> once = w.grad().to_vector<double>();
  backward(sum(matmul(x, w)));  // the cached cast's backward node runs a second time
  const std::vector<double> twice = w.grad().to_vector<double>();
  ASSERT_EQ(once.size(), twice.size());
  for (size_t i = 0; i < once.size(); ++i) EXPECT_EQ(twice[i], 2 * once[i]);  // x2 is exact in binary
}

TEST(AutocastCache, TwoForwardsSharingACachedCastAreBackpropagatedOneAfterTheOther) {
  Tensor w = randn({3, 2}, 46).detach();
  w.requires_grad_();
  const Tensor x1 = randn({4, 3}, 47), x2 = randn({5, 3}, 48);
  Autocast guard(DType::BF16);
  const Tensor l1 = sum(matmul(x1, w)), l2 = sum(matmul(x2, w));  // both graphs use the one cached cast
  EXPECT_EQ(autocast_cache_size(), 1u);
  backward(l1);
  const std::vector<double> first = w.grad().to_vector<double>();
  backward(l2);  // failed ("graph already used") while the first backward released the cast's node
  const std::vector<double> both = w.grad().to_vector<double>();
  // The gradient of sum(x @ w) is the column sums of x, repeated per column of w; rounded to bf16 (the
  // product's dtype) before reaching w. Each backward must add exactly its own graph's contribution.
  w.set_grad(Tensor());
  {
    Autocast alone(DType::BF16);  // a fresh scope: the second graph alone
    backward(sum(matmul(x2, w)));
  }
  const std::vector<double> second = w.grad().to_vector<double>();
  ASSERT_EQ(both.size(), first.size());
  for (size_t i = 0; i < both.size(); ++i) EXPECT_EQ(both[i], static_cast<float>(first[i] + second[i]));
}

TEST(AutocastCache, LeavesSharingStorageGetTheirOwnCastsAndGradients) {
  const Tensor base = randn({3, 2}, 49);
  Tensor a = base.detach(), b = base.detach();  // two leaves over the same bytes
  a.requires_grad_();
  b.requires_grad_();
  const Tensor x = randn({4, 3}, 50);
  Tensor reference = base.detach();
  reference.requires_grad_();
  {
    Autocast guard(DType::BF16);
    backward(sum(matmul(x, reference)));
  }
  {
    Autocast guard(DType::BF16);
    backward(add(sum(matmul(x, a)), sum(matmul(x, b))));
    EXPECT_EQ(autocast_cache_size(), 2u);
  }
  // Keyed by storage, b got a's cached cast: a received both gradients and b none.
  ASSERT_TRUE(a.grad().defined());
  ASSERT_TRUE(b.grad().defined());
  EXPECT_EQ(a.grad().to_vector<double>(), reference.grad().to_vector<double>());
  EXPECT_EQ(b.grad().to_vector<double>(), reference.grad().to_vector<double>());
}

TEST(AutocastCache, InPlaceUpdatesInOneLongScopeReplaceTheEntryInsteadOfAddingOne) {
  Tensor w = randn({4, 4}, 51).detach();
  w.requires_grad_();
  Autocast guard(DType::BF16);
  Tensor previous = autocast_cast(w, DType::BF16);
  for (int step = 0; step < 5; ++step) {
    w.bump_version();  // an optimizer step
    const Tensor cast = autocast_cast(w, DType::BF16);
    EXPECT_FALSE(cast.same(previous));
    EXPECT_TRUE(cast.same(autocast_cast(w, DType::BF16)));
    previous = cast;
  }
  EXPECT_EQ(autocast_cache_size(), 1u);  // not one stale bf16 copy of the weight per step
}

TEST(Autocast, ALowerPrecisionOpWithAnF64InputCastsNothing) {
  const Tensor a = Tensor::from_vector(std::vector<double>{1.0, 2.0}, {1, 2});
  const Tensor b = Tensor::from_vector(std::vector<float>{1.0001f, 3.0001f}, {2, 1});
  const double exact = matmul(a, b).item();  // promoted to f64 outside autocast
  Autocast guard(DType::F16);
  const Tensor out = matmul(a, b);
  EXPECT_EQ(out.dtype(), DType::F64);
  EXPECT_EQ(out.item(), exact);  // b was not rounded to f16 on the way (1.0001 -> 1, 3.0001 -> 3)
}

// ---- a model ----

TEST(Autocast, GPTForwardUnderBF16IsCloseToF32AndGivesF32Grads) {
  GPTConfig config;
  config.n_layer = 2;
  config.n_head = 2;
  config.n_embd = 32;
  config.block_size = 16;
  config.vocab_size = 11;
  GPT model(config, 3);
  const Tensor idx = Tensor::randint(0, 11, {2, 16}, 42), targets = Tensor::randint(0, 11, {2, 16}, 43);
  const double fp32_loss = model.forward(idx, targets).loss.item();
  Tensor loss;
  {
    Autocast guard(DType::BF16);
    loss = model.forward(idx, targets).loss;
  }
  EXPECT_EQ(loss.dtype(), DType::F32);
  ASSERT_TRUE(std::isfinite(loss.item()));
  // The loss is ~log(11) = 2.4; bf16 keeps 8 significand bits (relative 2^-9 per rounding) in the matmuls
  // and attention, while softmax, the norms and the cross entropy run in f32. With weights of std 0.02 the
  // logits are small, and the relative error of the loss stays within a few bf16 roundings: 1e-2 absolute.
  EXPECT_NEAR(loss.item(), fp32_loss, 1e-2);
  EXPECT_NE(loss.item(), fp32_loss);  // the matmuls did run in bf16
  backward(loss);
  for (const auto& [name, p] : model.named_parameters()) {
    ASSERT_TRUE(p.grad().defined()) << name;
    EXPECT_EQ(p.grad().dtype(), DType::F32) << name;
    for (double g : p.grad().to_vector<double>()) ASSERT_TRUE(std::isfinite(g)) << name;
  }
}

// ---- the table ----

TEST(AutocastPolicyTable, ListsEveryOpOnceWithItsPolicy) {
  for (const AutocastPolicyTable* policy : {&kPytorchAutocastPolicy, &kApexO1AutocastPolicy}) {
    SCOPED_TRACE(policy->framework);
    const std::string table = autocast_policy_table_markdown(*policy);
    std::set<std::string> names;
    for (const AutocastTableEntry& entry : policy->rows) {
      EXPECT_TRUE(names.insert(entry.name).second) << entry.name << " is in the table twice";
      const std::string cell = std::string("| `") + entry.name + "` |";
      const size_t at = table.find(cell);
      ASSERT_NE(at, std::string::npos) << entry.name;
      EXPECT_EQ(table.find(cell, at + 1), std::string::npos) << entry.name << " printed twice";
    }
    EXPECT_EQ(names.size(), static_cast<size_t>(AutocastOp::Count));
    // Header + separator + one row per op.
    EXPECT_EQ(std::count(table.begin(), table.end(), '\n') - 2,  // minus the blank line and the footnote
              static_cast<long>(policy->rows.size()) + 2);
  }
}

}  // namespace
}  // namespace mixtape
