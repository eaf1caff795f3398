// The tape engine (autograd/autograd.cpp) and gradcheck, exercised with the view ops, clone, to(dtype) and
// small custom ops written here with host loops (so the tests do not depend on the elementwise ops).
// Gradients of views are checked against the gather map they implement: a view of iota (value = position)
// shows which source element each output element reads, and the gradient of the source must be the output
// gradient scattered back to those positions.
#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "autograd/autograd.h"
#include "autograd/gradcheck.h"
#include "tensor/autograd_node.h"
#include "tensor/backend.h"
#include "tensor/ops.h"
#include "test_util.h"

namespace mixtape {
namespace {

using testing::all_close;

// ---- helpers -----------------------------------------------------------------------------------------

Tensor iota(const Shape& shape, DType dtype = DType::F64) {
  return Tensor::arange(0, static_cast<double>(shape_numel(shape)), 1, dtype).view(shape);
}

Tensor leaf(const Tensor& values) { return values.detach().clone().requires_grad_(); }

Tensor values_f64(const std::vector<double>& values, const Shape& shape) {
  return Tensor::from_vector(values, shape, DType::F64);
}

// Distinct, non-integer gradient values, so a misplaced or dropped element shows.
Tensor gradient_like(const Tensor& t, double scale = 1.0) {
  std::vector<double> g(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < g.size(); ++i) g[i] = scale * (0.5 + 1.25 * static_cast<double>(i));
  return Tensor::from_vector(g, t.shape(), t.dtype());
}

// The gradient a gather-only view must produce: source[position] += g[k] for each output element k whose
// value (read through the view of iota) is `position`.
std::vector<double> scattered(const Tensor& view_of_iota, const Tensor& grad_out, int64_t source_numel) {
  std::vector<double> result(static_cast<size_t>(source_numel), 0.0);
  const std::vector<double> positions = view_of_iota.to_vector<double>(), g = grad_out.to_vector<double>();
  for (size_t k = 0; k < positions.size(); ++k) result[static_cast<size_t>(positions[k])] += g[k];
  return result;
}

// A contiguous f64 copy of t's values for host loops.
std::vector<double> host(const Tensor& t) { return t.to_vector<double>(); }

// y = x^2 (f64), recorded with a backward of `factor` * x * g: factor 2 is right, anything else is the
// deliberately wrong derivative gradcheck must catch. x is saved (for the in-place check).
Tensor square(const Tensor& x, double factor = 2.0) {
  const std::vector<double> xs = host(x);
  std::vector<double> ys(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) ys[i] = xs[i] * xs[i];
  Tensor out = values_f64(ys, x.shape());
  const Tensor saved = x.detach();
  record_backward("square", {x}, out, [saved, factor](const Tensor& g) {
    const std::vector<double> xv = host(saved), gv = host(g);
    std::vector<double> gx(xv.size());
    for (size_t i = 0; i < xv.size(); ++i) gx[i] = factor * xv[i] * gv[i];
    return Grads{values_f64(gx, saved.shape())};
  }, {saved});
  return out;
}

// y = a + b (same shape, f64), backward {g, g}; `wrong_b` scales b's gradient by 1.5.
Tensor pair_sum(const Tensor& a, const Tensor& b, bool wrong_b = false) {
  const std::vector<double> av = host(a), bv = host(b);
  std::vector<double> ys(av.size());
  for (size_t i = 0; i < av.size(); ++i) ys[i] = av[i] + bv[i];
  Tensor out = values_f64(ys, a.shape());
  record_backward("pair_sum", {a, b}, out, [wrong_b](const Tensor& g) {
    std::vector<double> gb = host(g);
    if (wrong_b)
      for (double& v : gb) v *= 1.5;
    return Grads{values_f64(host(g), g.shape()), values_f64(gb, g.shape())};
  });
  return out;
}

// y = x reversed along its flat order; with `forget_to_reverse` the backward passes g through unreversed
// (right scale, wrong positions).
Tensor reversed(const Tensor& x, bool forget_to_reverse = false) {
  std::vector<double> v = host(x);
  std::reverse(v.begin(), v.end());
  Tensor out = values_f64(v, x.shape());
  record_backward("reversed", {x}, out, [forget_to_reverse](const Tensor& g) {
    std::vector<double> gv = host(g);
    if (!forget_to_reverse) std::reverse(gv.begin(), gv.end());
    return Grads{values_f64(gv, g.shape())};
  });
  return out;
}

// y = x (a copy) whose backward gives x no gradient (an undefined Tensor), like a stop-gradient.
Tensor stop_gradient(const Tensor& x) {
  Tensor out = x.detach().clone();
  record_backward("stop_gradient", {x}, out, [](const Tensor&) { return Grads{Tensor()}; });
  return out;
}

// ---- gradients through views ---------------------------------------------------------------------------

TEST(Autograd, GradientFlowsThroughChainsOfViews) {
  const Shape shape{2, 3, 4};
  // The same chain on iota (to read the gather map) and on a leaf (to get the gradient).
  auto chain = [](const Tensor& t) {
    return t.permute({2, 0, 1})   // [4,2,3]
        .slice(0, 1, 4, 2)        // [2,2,3]  (k = 1, 3)
        .select(1, -1)            // [2,3]
        .transpose(0, 1)          // [3,2]    non-contiguous
        .reshape({-1})            // [6]      copy (clone + view)
        .unsqueeze(0)             // [1,6]
        .narrow(1, 1, 4)          // [1,4]
        .squeeze()                // [4]
        .view({2, 2})             // [2,2]
        .clone();
  };
  const Tensor x = leaf(Tensor::randn(shape, 1, DType::F64));
  const Tensor y = chain(x);
  ASSERT_TRUE(y.requires_grad());
  ASSERT_FALSE(y.is_leaf());
  EXPECT_STREQ(y.grad_fn()->op, "clone");
  const Tensor g = gradient_like(y);
  backward({y}, {g});
  ASSERT_TRUE(x.grad().defined());
  EXPECT_EQ(x.grad().shape(), shape);
  EXPECT_EQ(x.grad().dtype(), DType::F64);
  EXPECT_EQ(x.grad().to_vector<double>(), scattered(chain(iota(shape)), g, x.numel()));
}

TEST(Autograd, BackwardFromAOneElementLoss) {
  const Tensor x = leaf(iota({2, 3}));
  backward(x.select(0, 1).select(0, 2));  // 0-d: gradient 1 at (1, 2)
  EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{0, 0, 0, 0, 0, 1}));
  EXPECT_ERROR_MENTIONS(backward(x.select(0, 0).clone()), "backward", "f64[3]", "one element");
}

TEST(Autograd, ToDtypeBackwardCastsTheGradientBack) {
  // f64 -> f32 -> f64: the gradient comes back as f64; values representable in f32 pass exactly.
  const Tensor x = leaf(Tensor::randn({3, 4}, 2, DType::F64));
  const Tensor y = x.to(DType::F32).transpose(0, 1).to(DType::F64);
  const Tensor g = gradient_like(y);
  backward({y}, {g});
  EXPECT_EQ(x.grad().dtype(), DType::F64);
  EXPECT_EQ(x.grad().to_vector<double>(), g.transpose(0, 1).contiguous().to_vector<double>());
  // Through f16 the gradient is rounded to f16 on its way back (0.1 -> 0.0999755859375).
  const Tensor z = leaf(Tensor::zeros({2}, DType::F64));
  backward({z.to(DType::F16).to(DType::F64)}, {Tensor::full({2}, 0.1, DType::F64)});
  EXPECT_EQ(z.grad().to_vector<double>(), std::vector<double>(2, static_cast<float>(Half(0.1))));
  // A gradient given in another dtype than its output is converted to the leaf's dtype.
  const Tensor w = leaf(Tensor::zeros({2}, DType::F32));
  backward({w.transpose(0, 0)}, {Tensor::full({2}, 0.25, DType::F64)});
  EXPECT_EQ(w.grad().dtype(), DType::F32);
  EXPECT_EQ(w.grad().to_vector<double>(), (std::vector<double>{0.25, 0.25}));
}

// A gradient that a backward closure made and handed over (here mul's g * 3, a fresh [n] buffer) becomes the
// leaf's .grad as it is: the backward allocates it once, not once more for a copy (the weight gradients of an
// autocast step, widened to f32 by the cast's backward, took a second pass that way).
TEST(Autograd, AFreshGradientBecomesTheLeafsGradWithoutACopy) {
  const int64_t n = int64_t{1} << 20;
  const size_t bytes = static_cast<size_t>(n) * 4;
  const Tensor x = Tensor::ones({n}).requires_grad_();
  const Tensor loss = sum(mul(x, 3.0));
  Backend& backend = backend_for(Device::cpu());
  backend.reset_peak_memory_stats();
  const size_t before = backend.memory_stats().allocated_bytes;
  backward(loss);
  const size_t peak = backend.memory_stats().peak_allocated_bytes;
  EXPECT_GE(peak - before, bytes);           // the gradient itself
  EXPECT_LT(peak - before, bytes + bytes / 2) << "the gradient was copied";
  EXPECT_EQ(x.grad().to_vector<double>(), std::vector<double>(static_cast<size_t>(n), 3.0));
}

// One buffer returned as the gradient of two leaves (add's backward hands g to both) is copied for each:
// their .grad tensors never alias.
TEST(Autograd, AGradientSharedByTwoLeavesIsCopiedForEach) {
  const Tensor a = Tensor::ones({1000}).requires_grad_(), b = Tensor::ones({1000}).requires_grad_();
  backward(sum(mul(add(a, b), 2.0)));
  ASSERT_NE(a.grad().data_ptr(), b.grad().data_ptr());
  a.grad().add_(Tensor::ones({1000}));
  EXPECT_EQ(a.grad().to_vector<double>()[0], 3.0);
  EXPECT_EQ(b.grad().to_vector<double>()[0], 2.0);
}

TEST(Autograd, OutputThatIsALeafGetsItsGradientDirectly) {
  const Tensor x = leaf(iota({3}));
  const Tensor g = gradient_like(x);
  backward({x}, {g});
  EXPECT_EQ(x.grad().to_vector<double>(), g.to_vector<double>());
  EXPECT_NE(x.grad().storage(), g.storage());  // the leaf owns a copy
}

TEST(Autograd, RecordingFollowsRequiresGrad) {
  const Tensor plain = iota({2, 3});
  EXPECT_FALSE(plain.transpose(0, 1).requires_grad());
  EXPECT_TRUE(plain.transpose(0, 1).is_leaf());
  const Tensor x = leaf(plain);
  const Tensor v = x.transpose(0, 1);
  EXPECT_TRUE(v.requires_grad());
  EXPECT_FALSE(v.is_leaf());
  EXPECT_STREQ(v.grad_fn()->op, "transpose");
  EXPECT_FALSE(v.detach().requires_grad());
  EXPECT_EQ(v.detach().storage(), x.storage());
  EXPECT_FALSE(x.to(DType::I64).requires_grad());  // integer results are not differentiable
  EXPECT_ERROR_MENTIONS(Tensor(v).requires_grad_(false), "requires_grad_", "non-leaf");
}

// ---- accumulation and summing (need add / add_) -------------------------------------------------------------

TEST(Autograd, LeafGradientsAccumulateAcrossBackwardCalls) {
  const Tensor x = leaf(iota({2, 3}));
  const Tensor g1 = gradient_like(x.transpose(0, 1)), g2 = gradient_like(x, -0.5);
  backward({x.transpose(0, 1)}, {g1});
  backward({x.view({6}).view({2, 3})}, {g2});
  const std::vector<double> a = g1.transpose(0, 1).contiguous().to_vector<double>(), b = g2.to_vector<double>();
  std::vector<double> sum(a.size());
  for (size_t i = 0; i < a.size(); ++i) sum[i] = a[i] + b[i];
  EXPECT_EQ(x.grad().to_vector<double>(), sum);
}

// set_grad_dtype(F32) on a bf16 leaf: each incoming bf16 gradient is widened and added in fp32. 1 then
// four times 2^-9 (a quarter of bf16's ulp at 1) sums to 1 + 2^-7 in fp32; in bf16 each addition rounds back
// to 1 (nearest even). Both paths into a leaf: through a node (transpose) and as an output itself.
TEST(Autograd, LeafGradientsAccumulateInTheirGradDtype) {
  for (bool fp32 : {false, true}) {
    SCOPED_TRACE(fp32 ? "fp32 gradient" : "bf16 gradient");
    Tensor x = leaf(Tensor::zeros({2}, DType::BF16));
    if (fp32) x.set_grad_dtype(DType::F32);
    EXPECT_EQ(x.grad_dtype(), fp32 ? DType::F32 : DType::BF16);
    backward({x.transpose(0, 0)}, {Tensor::ones({2}, DType::BF16)});
    const Tensor quarter_ulp = Tensor::full({2}, std::ldexp(1.0, -9), DType::BF16);
    for (int i = 0; i < 2; ++i) backward({x.transpose(0, 0)}, {quarter_ulp});
    for (int i = 0; i < 2; ++i) backward({x}, {quarter_ulp});
    EXPECT_EQ(x.grad().dtype(), fp32 ? DType::F32 : DType::BF16);
    const double want = fp32 ? 1 + std::ldexp(1.0, -7) : 1.0;
    EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{want, want}));
  }
  Tensor x = leaf(Tensor::zeros({2}, DType::BF16));
  EXPECT_ERROR_MENTIONS(x.set_grad_dtype(DType::I64), "set_grad_dtype", "must be floating", "i64");
  EXPECT_ERROR_MENTIONS(x.transpose(0, 0).set_grad_dtype(DType::F32), "set_grad_dtype", "not a leaf");
  x.set_grad(Tensor::ones({2}, DType::BF16));
  EXPECT_ERROR_MENTIONS(x.set_grad_dtype(DType::F32), "set_grad_dtype", "already has a gradient",
                        "zero_grad");
  x.set_grad(Tensor());
  x.set_grad_dtype(DType::F32).set_grad_dtype(DType::BF16);  // back to its own dtype
  EXPECT_EQ(x.grad_dtype(), DType::BF16);
  // A gradient installed in another dtype (set_grad) is widened before backward adds to it.
  x.set_grad_dtype(DType::F32);
  x.set_grad(Tensor::ones({2}, DType::BF16));
  backward({x}, {Tensor::full({2}, std::ldexp(1.0, -9), DType::BF16)});
  EXPECT_EQ(x.grad().dtype(), DType::F32);
  EXPECT_EQ(x.grad().to_vector<double>(), std::vector<double>(2, 1 + std::ldexp(1.0, -9)));
}

TEST(Autograd, DiamondGraphSumsGradients) {
  // x -> h = clone(x) -> a = h[0:3], b = h[1:4] -> y = a + b: every path's gradient reaches h and is summed
  // there before clone's backward runs once.
  const Tensor x = leaf(iota({4}));
  const Tensor h = x.clone();
  const Tensor y = pair_sum(h.slice(0, 0, 3), h.slice(0, 1, 4));
  backward({y}, {values_f64({1, 10, 100}, {3})});
  EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{1, 11, 110, 100}));
  // The same tensor twice as the inputs of one op, and a leaf used directly by two ops.
  const Tensor z = leaf(iota({3}));
  backward({pair_sum(z, z)}, {values_f64({1, 2, 3}, {3})});
  EXPECT_EQ(z.grad().to_vector<double>(), (std::vector<double>{2, 4, 6}));
  const Tensor w = leaf(iota({2, 2}));
  backward({w.transpose(0, 1), w.view({4})}, {values_f64({1, 2, 3, 4}, {2, 2}), values_f64({10, 20, 30, 40}, {4})});
  EXPECT_EQ(w.grad().to_vector<double>(), (std::vector<double>{11, 23, 32, 44}));
}

TEST(Autograd, GradientsThatMeetAreSummedWithoutTouchingABufferAnythingElseHolds) {
  // h feeds two nodes. One returns a gradient the test also holds (shared: it must come out unchanged), the
  // other a fresh buffer (private: the engine may sum into it). Either order of arrival, the sum reaches x.
  for (bool shared_first : {true, false}) {
    SCOPED_TRACE(shared_first ? "shared gradient arrives first" : "fresh gradient arrives first");
    const Tensor x = leaf(iota({3}));
    const Tensor h = x.clone();
    const Tensor shared = values_f64({100, 200, 300}, {3});
    auto with_grad = [](const Tensor& in, const char* op, std::function<Tensor()> grad) {
      Tensor out = in.detach().clone();
      record_backward(op, {in}, out, [grad](const Tensor&) { return Grads{grad()}; });
      return out;
    };
    const Tensor a = with_grad(h, "shared", [shared] { return shared; });
    const Tensor b = with_grad(h, "fresh", [] { return values_f64({1, 2, 3}, {3}); });
    // backward runs the outputs' nodes from the back of its ready list: the last output first.
    if (shared_first)
      backward({b, a}, {gradient_like(b), gradient_like(a)});
    else
      backward({a, b}, {gradient_like(a), gradient_like(b)});
    EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{101, 202, 303}));
    EXPECT_EQ(shared.to_vector<double>(), (std::vector<double>{100, 200, 300}));
  }
}

TEST(Autograd, OutputsThatFeedEachOtherAreSummedBeforeRunning) {
  const Tensor x = leaf(iota({2, 2}));
  const Tensor y1 = x.clone();
  const Tensor y2 = y1.transpose(0, 1);  // consumes y1: y1's node must wait for y2's gradient
  backward({y1, y2}, {values_f64({1, 2, 3, 4}, {2, 2}), values_f64({10, 20, 30, 40}, {2, 2})});
  EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{11, 32, 23, 44}));
}

// ---- the backward profiler -----------------------------------------------------------------------------

// A profiler's count for `op` (0 when it has no entry), and the sum of its entries, each checked >= 0.
int64_t calls_of(const std::map<std::string, ProfileEntry>& entries, const std::string& op) {
  return entries.count(op) ? entries.at(op).calls : int64_t{0};
}
double sum_of(const std::map<std::string, ProfileEntry>& entries) {
  double sum = 0;
  for (const auto& [op, entry] : entries) {
    EXPECT_GE(entry.seconds, 0.0) << op;
    sum += entry.seconds;
  }
  return sum;
}

TEST(BackwardProfiler, CountsEachNodeUnderItsOpAndTheSumsAndLeavesApart) {
  // y = h[0:3] + h[1:4] with h = gelu(x * w): mul, gelu, the two slices' and the add's nodes once each; the two
  // slices' gradients meet at h (one sum); x and w are leaves (two accumulations).
  const Tensor x = leaf(values_f64({0.5, -1, 2, 0.25}, {4})), w = leaf(values_f64({1, 2, 3, 4}, {4}));
  const Tensor h = gelu(mul(x, w));
  const Tensor y = add(h.slice(0, 0, 3), h.slice(0, 1, 4));
  {
    BackwardProfiler profiler;
    backward({y}, {gradient_like(y)});
    auto calls = [&](const std::string& op) { return calls_of(profiler.entries(), op); };
    EXPECT_EQ(calls("mul"), 1);
    EXPECT_EQ(calls("gelu"), 1);
    EXPECT_EQ(calls("add"), 1);
    EXPECT_EQ(calls("(gradient sums)"), 1);
    EXPECT_EQ(calls("(leaf gradients)"), 2);
    EXPECT_EQ(profiler.backward_calls(), 1);
    const double parts = sum_of(profiler.entries());
    EXPECT_GT(parts, 0.0);
    EXPECT_GE(profiler.total_seconds(), parts);
    // A second call adds to the same entries; clear() empties them.
    const Tensor y2 = gelu(mul(x, w));
    backward({y2}, {gradient_like(y2)});
    EXPECT_EQ(calls("gelu"), 2);
    EXPECT_EQ(profiler.backward_calls(), 2);
    profiler.clear();
    EXPECT_TRUE(profiler.entries().empty());
    EXPECT_EQ(profiler.total_seconds(), 0.0);
  }
  // With no profiler alive nothing is recorded anywhere, and a new one starts empty.
  const Tensor y3 = gelu(mul(x, w));
  backward({y3}, {gradient_like(y3)});
  BackwardProfiler fresh;
  EXPECT_TRUE(fresh.entries().empty());
  EXPECT_EQ(fresh.backward_calls(), 0);
}

// A profiler is one per thread: a second one while the first lives is an error; another thread has its own.
template <class Profiler>
void expect_one_profiler_at_a_time_per_thread(const char* name) {
  Profiler first;
  EXPECT_ERROR_MENTIONS(Profiler(), name, "already has one");
  EXPECT_EQ(Profiler::active(), &first);
  std::thread([] {
    EXPECT_EQ(Profiler::active(), nullptr);
    Profiler second;
    EXPECT_EQ(Profiler::active(), &second);
  }).join();
  EXPECT_EQ(Profiler::active(), &first);
}

TEST(BackwardProfiler, OneAtATimePerThread) {
  expect_one_profiler_at_a_time_per_thread<BackwardProfiler>("BackwardProfiler");
}

// ---- the forward profiler ------------------------------------------------------------------------------

TEST(ForwardProfiler, CountsEachRecordedOpAndOnlyThose) {
  const Tensor x = leaf(values_f64({0.5, -1, 2, 0.25}, {4})), w = leaf(values_f64({1, 2, 3, 4}, {4}));
  ForwardProfiler profiler;
  const Tensor h = gelu(mul(x, w));
  const Tensor y = add(h, neg(h));
  auto calls = [&](const std::string& op) { return calls_of(profiler.entries(), op); };
  EXPECT_EQ(calls("mul"), 1);
  EXPECT_EQ(calls("gelu"), 1);
  EXPECT_EQ(calls("neg"), 1);
  EXPECT_EQ(calls("add"), 1);
  EXPECT_DOUBLE_EQ(profiler.total_seconds(), sum_of(profiler.entries()));
  // Ops that record no node are not seen: under a NoGradGuard, or with no input that requires grad.
  {
    NoGradGuard no_grad;
    const Tensor unrecorded = mul(x, w);
  }
  const Tensor constant = mul(values_f64({1, 2}, {2}), values_f64({3, 4}, {2}));
  EXPECT_EQ(calls("mul"), 1);
  profiler.clear();
  EXPECT_TRUE(profiler.entries().empty());
  EXPECT_EQ(profiler.total_seconds(), 0.0);
}

TEST(ForwardProfiler, AnOpsTimeRunsFromTheRecordingBeforeItOrFromMarkAndPauseStopsIt) {
  // The 200 ms pauses dwarf the ops (microseconds), so the bounds below hold on any machine that is not stalled
  // for a fifth of a second.
  const Tensor x = leaf(values_f64({0.5, -1, 2, 0.25}, {4}));
  ForwardProfiler profiler;
  const Tensor a = mul(x, x);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const Tensor b = gelu(a);  // counted from mul's recording: the pause is gelu's
  EXPECT_GE(profiler.entries().at("gelu").seconds, 0.2);
  EXPECT_LT(profiler.entries().at("mul").seconds, 0.2);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  profiler.mark();
  const Tensor c = neg(b);  // counted from mark(): the pause is nobody's
  EXPECT_LT(profiler.entries().at("neg").seconds, 0.2);
  EXPECT_LT(profiler.total_seconds(), 0.4);
  // pause() stops the counting until the next mark().
  profiler.pause();
  const Tensor d = neg(c);
  EXPECT_EQ(profiler.entries().at("neg").calls, 1);
  profiler.mark();
  const Tensor e = neg(d);
  EXPECT_EQ(profiler.entries().at("neg").calls, 2);
}

TEST(ForwardProfiler, OneAtATimePerThread) {
  expect_one_profiler_at_a_time_per_thread<ForwardProfiler>("ForwardProfiler");
}

// ---- graph lifetime ------------------------------------------------------------------------------------

TEST(Autograd, SecondBackwardThroughTheSameGraphIsAnError) {
  const Tensor x = leaf(iota({2, 3}));
  const Tensor y = x.transpose(0, 1).clone();
  backward({y}, {gradient_like(y)});
  const std::vector<double> first = x.grad().to_vector<double>();
  EXPECT_ERROR_MENTIONS(backward({y}, {gradient_like(y)}), "backward", "clone", "already used");
  // ... also when reached from a new output built on the used graph.
  EXPECT_ERROR_MENTIONS(backward({y.view({6})}, {gradient_like(y.view({6}))}), "backward", "already used");
  EXPECT_EQ(x.grad().to_vector<double>(), first);  // nothing was accumulated by the failed calls
}

TEST(Autograd, SavedTensorsAreFreedAfterBackward) {
  const Tensor x = leaf(iota({3}));
  std::weak_ptr<Storage> captured_storage;
  Tensor y;
  {
    Tensor captured = x.detach().clone();  // only the node will own this storage
    captured_storage = captured.storage();
    y = x.detach().clone();
    record_backward("capture", {x}, y, [captured](const Tensor& g) { return Grads{g}; }, {captured});
  }
  const Tensor z = square(y);  // saves y.detach(): shares y's storage
  const long y_uses_before = y.storage().use_count();
  EXPECT_FALSE(captured_storage.expired());
  backward({z}, {gradient_like(z)});
  EXPECT_TRUE(captured_storage.expired());  // the closure and the saved-version record let go
  EXPECT_LT(y.storage().use_count(), y_uses_before);
  EXPECT_EQ(y.storage().use_count(), 1);
  EXPECT_FALSE(static_cast<bool>(z.grad_fn()->backward));
}

TEST(Autograd, NodeNoGradientReachesStillLetsTheNodesBelowRunAndFreesItsTensors) {
  // x -> p = clone(x) -> { q = p.view -> c = stop_gradient(q) ;  r = p.transpose }.
  // c's backward gives q nothing, so q's node gets no gradient; p's node must still run (it waits for both
  // of its consumers) and deliver r's gradient to x.
  const Tensor x = leaf(iota({2, 3}));
  const Tensor p = x.clone();
  std::weak_ptr<Storage> q_saved;
  Tensor q;
  {
    Tensor saved = p.detach().clone();
    q_saved = saved.storage();
    q = p.view({6});
    Tensor q_out = q.detach().clone();
    record_backward("holds_saved", {q}, q_out, [saved](const Tensor& g) { return Grads{g}; }, {saved});
    q = q_out;
  }
  const Tensor c = stop_gradient(q);
  const Tensor r = p.transpose(0, 1);
  const Tensor gr = gradient_like(r);
  backward({c, r}, {gradient_like(c), gr});
  ASSERT_TRUE(x.grad().defined());
  EXPECT_EQ(x.grad().to_vector<double>(), gr.transpose(0, 1).contiguous().to_vector<double>());
  EXPECT_TRUE(q_saved.expired());  // the pass-through node was released too
  // An output whose whole graph gets no gradient leaves the leaf without one.
  const Tensor w = leaf(iota({2}));
  backward({stop_gradient(w.view({2}))}, {gradient_like(w)});
  EXPECT_FALSE(w.grad().defined());
}

// Runs fn on a thread with a small stack, where recursing once per graph node would overflow: 128 KiB, or
// the smallest power of two up to 512 KiB that pthread accepts (the thread's static TLS comes out of its
// stack, and the CUDA libraries bring a large one). 10,000 nodes of recursion need over 1 MB either way.
void run_on_small_stack(const std::function<void()>& fn) {
  auto trampoline = [](void* arg) -> void* {
    (*static_cast<const std::function<void()>*>(arg))();
    return nullptr;
  };
  int status = -1;
  for (size_t stack = 128 * 1024; stack <= 512 * 1024 && status != 0; stack *= 2) {
    pthread_attr_t attributes;
    pthread_attr_init(&attributes);
    pthread_attr_setstacksize(&attributes, stack);
    pthread_t thread;
    status = pthread_create(&thread, &attributes, trampoline, const_cast<std::function<void()>*>(&fn));
    if (status == 0) pthread_join(thread, nullptr);
    pthread_attr_destroy(&attributes);
  }
  ASSERT_EQ(status, 0) << "no thread with a stack of at most 512 KiB could be started";
}

TEST(Autograd, DeepGraphsRunAndFreeWithoutRecursion) {
  // 10,000 chained views: backward walks the chain with explicit stacks, and releasing the graph must not
  // recurse once per node (each level of a recursive release takes ~100+ bytes of stack: over 1 MB here).
  bool ok = false;
  run_on_small_stack([&] {
    const Tensor x = leaf(iota({2, 2}));
    Tensor y = x;
    for (int i = 0; i < 10'000; ++i) y = y.transpose(0, 1);
    backward({y}, {values_f64({1, 2, 3, 4}, {2, 2})});
    y = Tensor();  // drops the whole (used) graph
    Tensor z = x;
    for (int i = 0; i < 10'000; ++i) z = z.view({4}).view({2, 2});
    z = Tensor();  // drops an unused graph
    ok = x.grad().to_vector<double>() == std::vector<double>{1, 2, 3, 4};  // an even number of transposes
  });
  EXPECT_TRUE(ok);
}

TEST(Autograd, InputsThatDoNotRequireGradGetNoGradient) {
  const Tensor x = leaf(iota({3}));
  const Tensor constant = iota({3});
  const Tensor y = pair_sum(x, constant);
  backward({y}, {values_f64({1, 2, 3}, {3})});
  EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{1, 2, 3}));
  EXPECT_FALSE(constant.grad().defined());
}

// ---- in-place changes ---------------------------------------------------------------------------------------

TEST(Autograd, SavedTensorModifiedInPlaceIsReportedNotDifferentiatedWrongly) {
  {  // a leaf, changed under NoGradGuard after square saved it
    Tensor x = leaf(iota({3}));
    const Tensor y = square(x);
    {
      NoGradGuard no_grad;
      x.fill_(5);
    }
    EXPECT_ERROR_MENTIONS(backward({y}, {gradient_like(y)}), "backward", "square", "modified in place", "f64[3]");
    EXPECT_FALSE(x.grad().defined());
  }
  {  // a non-leaf, changed through a view of it
    const Tensor x = leaf(iota({2, 2}));
    Tensor h = x.clone();
    const Tensor y = square(h);
    {
      NoGradGuard no_grad;
      h.select(0, 1).fill_(-1);  // the view shares h's storage and so its version counter
    }
    EXPECT_ERROR_MENTIONS(backward({y}, {gradient_like(y)}), "backward", "square", "modified in place");
    EXPECT_FALSE(x.grad().defined());
  }
  {  // a change before the op saved the tensor is fine
    const Tensor x = leaf(iota({3}));
    Tensor h = x.clone();
    {
      NoGradGuard no_grad;
      h.fill_(2);
    }
    const Tensor y = square(h);
    backward({y}, {values_f64({1, 1, 1}, {3})});
    EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{4, 4, 4}));  // 2 * h = 4 (h was filled)
  }
}

// The ops whose backward reads their own output or statistics register them too: softmax and log_softmax
// (their output), max / min (the extremum), layer_norm / rms_norm (the mean and rstd they also return). A
// change through a detached alias is reported, not differentiated at the changed values.
TEST(Autograd, OutputsAndStatisticsSavedForBackwardAreCheckedToo) {
  auto expect_reported = [](const char* op, const std::function<Tensor(const Tensor&)>& run_and_modify) {
    SCOPED_TRACE(op);
    const Tensor x = leaf(Tensor::randn({2, 4}, 5, DType::F64));
    const Tensor y = run_and_modify(x);
    EXPECT_ERROR_MENTIONS(backward({y}, {gradient_like(y)}), "backward", op, "modified in place");
    EXPECT_FALSE(x.grad().defined());
  };
  expect_reported("softmax", [](const Tensor& x) {
    const Tensor y = softmax(x, 1);
    y.detach().fill_(0.5);
    return y;
  });
  expect_reported("log_softmax", [](const Tensor& x) {
    const Tensor y = log_softmax(x, 1);
    y.detach().fill_(0);
    return y;
  });
  expect_reported("max", [](const Tensor& x) {
    const Tensor y = max(x, {1});
    y.detach().fill_(1);
    return y;
  });
  expect_reported("layer_norm", [](const Tensor& x) {
    const LayerNormResult r = layer_norm(x, Tensor(), Tensor());
    Tensor(r.rstd).fill_(100);
    return r.out;
  });
  expect_reported("rms_norm", [](const Tensor& x) {
    const RMSNormResult r = rms_norm(x, Tensor());
    Tensor(r.rstd).fill_(100);
    return r.out;
  });
  expect_reported("layer_norm", [](const Tensor& x) {  // the mean too
    const LayerNormResult r = layer_norm(x, Tensor(), Tensor());
    Tensor(r.mean).fill_(0);
    return r.out;
  });
}

TEST(Autograd, InPlaceOnATensorThatRequiresGradIsAnErrorOutsideNoGradGuard) {
  Tensor x = leaf(iota({2, 3}));
  EXPECT_ERROR_MENTIONS(x.fill_(1), "fill_", "leaf", "f64[2,3]", "NoGradGuard");
  EXPECT_ERROR_MENTIONS(x.zero_(), "fill_", "leaf");
  EXPECT_ERROR_MENTIONS(x.copy_(iota({3})), "copy_", "leaf", "f64[2,3]");
  EXPECT_ERROR_MENTIONS(x.add_(iota({3})), "add_", "leaf");
  EXPECT_ERROR_MENTIONS(x.mul_(2), "mul_", "leaf");
  // In-place ops are not recorded on the tape, so changing a non-leaf in the graph would silently give a
  // wrong gradient: also an error.
  Tensor h = x.clone();
  EXPECT_ERROR_MENTIONS(h.fill_(0), "fill_", "f64[2,3]", "requires grad");
  EXPECT_ERROR_MENTIONS(Tensor(h.select(0, 0)).copy_(iota({3})), "copy_", "f64[3]");
  EXPECT_EQ(x.to_vector<double>(), (std::vector<double>{0, 1, 2, 3, 4, 5}));  // nothing was written
  {
    NoGradGuard no_grad;  // what an optimizer step does
    x.fill_(1);
    h.fill_(2);
  }
  EXPECT_EQ(x.to_vector<double>(), std::vector<double>(6, 1.0));
  EXPECT_EQ(h.to_vector<double>(), std::vector<double>(6, 2.0));
}

// ---- grad mode ----------------------------------------------------------------------------------------------

TEST(Autograd, NoGradGuardStopsRecordingNestsAndRestores) {
  const Tensor x = leaf(iota({2, 3}));
  EXPECT_TRUE(grad_enabled());
  {
    NoGradGuard outer;
    EXPECT_FALSE(grad_enabled());
    const Tensor y = x.transpose(0, 1).clone();
    EXPECT_FALSE(y.requires_grad());
    EXPECT_TRUE(y.is_leaf());
    {
      NoGradGuard inner;
      EXPECT_FALSE(grad_enabled());
    }
    EXPECT_FALSE(grad_enabled());  // the inner guard restores "off", not "on"
    // Grad mode is per thread: another thread records while this one is inside the guard.
    bool other_thread_records = false;
    std::thread([&] { other_thread_records = grad_enabled() && x.view({6}).requires_grad(); }).join();
    EXPECT_TRUE(other_thread_records);
  }
  EXPECT_TRUE(grad_enabled());
  EXPECT_TRUE(x.transpose(0, 1).requires_grad());
  // backward runs its closures with grad mode off and restores it afterwards, also when it throws.
  const Tensor y = x.clone();
  backward({y}, {gradient_like(y)});
  EXPECT_TRUE(grad_enabled());
  EXPECT_THROW(backward({y}, {gradient_like(y)}), Error);
  EXPECT_TRUE(grad_enabled());
}

// ---- errors -------------------------------------------------------------------------------------------------

TEST(Autograd, BackwardRejectsBadArguments) {
  const Tensor x = leaf(iota({2, 3}));
  const Tensor y = x.transpose(0, 1);
  EXPECT_ERROR_MENTIONS(backward({y}, {}), "backward", "1 outputs", "0 grad_outputs");
  EXPECT_ERROR_MENTIONS(backward({y}, {iota({2, 3})}), "backward", "grad_output 0", "f64[2,3]", "f64[3,2]");
  EXPECT_ERROR_MENTIONS(backward({y}, {Tensor()}), "backward", "grad_output 0", "undefined");
  EXPECT_ERROR_MENTIONS(backward({iota({2})}, {iota({2})}), "backward", "output 0", "does not require grad");
  EXPECT_ERROR_MENTIONS(backward(Tensor()), "backward", "undefined");
}

TEST(Autograd, BackwardRejectsGradientsOfTheWrongCountOrShape) {
  const Tensor x = leaf(iota({2, 3}));
  Tensor too_many = x.detach().clone();
  record_backward("too_many", {x}, too_many, [](const Tensor& g) { return Grads{g, g}; });
  EXPECT_ERROR_MENTIONS(backward({too_many}, {gradient_like(too_many)}), "backward", "too_many", "2 gradients",
                        "1 inputs");
  Tensor misshapen = x.detach().clone();
  record_backward("misshapen", {x}, misshapen, [](const Tensor& g) { return Grads{g.view({6})}; });
  EXPECT_ERROR_MENTIONS(backward({misshapen}, {gradient_like(misshapen)}), "backward", "misshapen", "f64[6]",
                        "[2,3]");
  // The same when the input is another node's output (the blame is on the op that produced the gradient).
  const Tensor h = x.clone();
  Tensor inner = h.detach().clone();
  record_backward("misshapen_inner", {h}, inner, [](const Tensor& g) { return Grads{g.view({3, 2})}; });
  EXPECT_ERROR_MENTIONS(backward({inner}, {gradient_like(inner)}), "backward", "misshapen_inner", "f64[3,2]",
                        "[2,3]");
}

// ---- gradcheck ----------------------------------------------------------------------------------------------

TEST(Gradcheck, CatchesAWrongDerivative) {
  const Tensor x = Tensor::randn({3, 2}, 5, DType::F64);
  const GradcheckResult wrong = gradcheck([](const std::vector<Tensor>& in) { return square(in[0], 3.0); }, {x});
  EXPECT_FALSE(wrong.ok);
  EXPECT_GT(wrong.max_abs_error, 1e-2);
  EXPECT_NE(wrong.message.find("input 0"), std::string::npos) << wrong.message;
  const GradcheckResult right = gradcheck([](const std::vector<Tensor>& in) { return square(in[0]); }, {x});
  EXPECT_TRUE(right.ok) << right.message;
  EXPECT_LT(right.max_abs_error, 1e-6);
}

TEST(Gradcheck, CatchesAGradientSentToTheWrongElements) {
  const Tensor x = Tensor::randn({5}, 6, DType::F64);
  const GradcheckResult wrong = gradcheck([](const std::vector<Tensor>& in) { return reversed(in[0], true); }, {x});
  EXPECT_FALSE(wrong.ok);
  const GradcheckResult right = gradcheck([](const std::vector<Tensor>& in) { return reversed(in[0]); }, {x});
  EXPECT_TRUE(right.ok) << right.message;
}

TEST(Gradcheck, NamesTheInputWithTheWrongGradient) {
  const Tensor a = Tensor::randn({2, 3}, 7, DType::F64), b = Tensor::randn({3, 2}, 8, DType::F64);
  auto f = [](bool wrong) {
    return [wrong](const std::vector<Tensor>& in) { return pair_sum(in[0].transpose(0, 1), in[1], wrong); };
  };
  EXPECT_TRUE(gradcheck(f(false), {a, b}).ok);
  const GradcheckResult result = gradcheck(f(true), {a, b});
  EXPECT_FALSE(result.ok);
  EXPECT_EQ(result.message.find("input 0"), std::string::npos) << result.message;
  EXPECT_NE(result.message.find("input 1"), std::string::npos) << result.message;
}

TEST(Gradcheck, PassesEveryViewOpAndClone) {
  const Tensor x = Tensor::randn({2, 3, 4}, 9, DType::F64);
  const std::vector<std::pair<const char*, std::function<Tensor(const Tensor&)>>> cases = {
      {"view", [](const Tensor& t) { return t.view({4, -1}); }},
      {"reshape (copy)", [](const Tensor& t) { return t.transpose(0, 2).reshape({6, 4}); }},
      {"transpose", [](const Tensor& t) { return t.transpose(0, 2); }},
      {"permute", [](const Tensor& t) { return t.permute({1, 2, 0}); }},
      {"slice", [](const Tensor& t) { return t.slice(2, -3, 4, 2); }},
      {"narrow", [](const Tensor& t) { return t.narrow(1, 1, 2); }},
      {"select", [](const Tensor& t) { return t.select(1, -1); }},
      {"unsqueeze/squeeze", [](const Tensor& t) { return t.unsqueeze(1).select(3, 0).unsqueeze(-1).squeeze(); }},
      {"clone", [](const Tensor& t) { return t.mT().clone(); }},
      {"contiguous", [](const Tensor& t) { return t.transpose(0, 1).contiguous(); }},
      {"identity", [](const Tensor& t) { return t; }},
  };
  for (const auto& [name, op] : cases) {
    const GradcheckResult result = gradcheck([&](const std::vector<Tensor>& in) { return op(in[0]); }, {x});
    EXPECT_TRUE(result.ok) << name << "\n" << result.message;
  }
}

TEST(Gradcheck, PassesThroughF32AndBack) {
  // f64 -> f32 -> f64: the finite difference sees f32 rounding (relative 2^-24 = 6e-8 per evaluation), so
  // the step is 1e-2, which keeps the quotient's error below 2 * 6e-8 * |x| / 2e-2 = 3e-5 for |x| <= 5.
  const Tensor x = Tensor::randn({3, 4}, 10, DType::F64);
  GradcheckOptions options;
  options.eps = 1e-2;
  options.atol = 1e-4;
  const GradcheckResult result = gradcheck(
      [](const std::vector<Tensor>& in) { return in[0].to(DType::F32).permute({1, 0}).to(DType::F64); }, {x}, options);
  EXPECT_TRUE(result.ok) << result.message;
  EXPECT_GT(result.max_abs_error, 0);  // the f32 rounding is visible, i.e. the cast did happen
}

TEST(Gradcheck, PassesExpand) {
  // expand's backward sums the broadcast dims back (sum_to).
  const Tensor x = Tensor::randn({3, 1}, 11, DType::F64);
  const GradcheckResult result =
      gradcheck([](const std::vector<Tensor>& in) { return in[0].expand({2, 3, 4}); }, {x});
  EXPECT_TRUE(result.ok) << result.message;
}

TEST(Gradcheck, PassesIntegerInputsThroughUnperturbed) {
  const Tensor x = Tensor::randn({4, 3}, 12, DType::F64);
  const Tensor index = Tensor::from_vector(std::vector<int64_t>{2}, {1});
  const GradcheckResult result = gradcheck(
      [](const std::vector<Tensor>& in) {
        EXPECT_EQ(in[1].dtype(), DType::I64);
        return in[0].select(0, static_cast<int64_t>(in[1].item()));
      },
      {x, index});
  EXPECT_TRUE(result.ok) << result.message;
}

}  // namespace
}  // namespace mixtape
