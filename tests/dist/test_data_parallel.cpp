// Data parallelism and ZeRO-1 under MPI (4 ranks): a two-layer MLP (Linear, GELU, Linear; MSE loss) trained
// with the global batch split over the dp ranks must equal the single-process run on the whole batch, which
// every rank computes locally from the same seed. Each rank's loss is the mean over its local rows; with
// equal local batches the dp average of the gradients is the full-batch gradient, and the mean of the local
// losses is the full-batch loss.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "amp/optimizer.h"
#include "amp/scaler.h"
#include "autograd/autograd.h"
#include "dist/data_parallel.h"
#include "dist/groups.h"
#include "dist/zero.h"
#include "optim/adam.h"
#include "tensor/autograd_node.h"
#include "tensor/ops.h"
#include "../test_util.h"
#include "dist_test_util.h"

using namespace mixtape;
using mixtape::testing::expect_close;
using namespace mixtape::dist;

namespace {

constexpr int64_t kBatch = 8, kIn = 6, kHidden = 12, kOut = 4;
constexpr int kSteps = 20;  // the 20 steps

enum class Mode { F32, BF16, F16 };
const char* mode_name(Mode m) { return m == Mode::F32 ? "fp32" : m == Mode::BF16 ? "bf16" : "fp16"; }
DType mode_dtype(Mode m) { return m == Mode::F32 ? DType::F32 : m == Mode::BF16 ? DType::BF16 : DType::F16; }

struct RunSpec {
  Mode mode = Mode::F32;
  enum Kind { Single, DataParallel, Zero } kind = Single;
  int64_t bucket_bytes = GradientReducer::kDefaultBucketBytes;
  int inf_step = -1;  // this step, a +inf is planted in one gradient element ...
  int inf_rank = 0;   // ... on this dp rank (the single-process run plants it too)
  bool overlap = false;  // GradientReducer::begin()/finish() around backward (buckets reduced inside it)
  int micro_batches = 1;  // backward() calls per step, each on an equal share of the local rows (loss / M)
  bool master_weights = true;  // false: the 16-bit parameters are stepped themselves (Apex O3)
  int losses = 1;     // loss ids per micro-batch (Apex num_losses): loss l on the batch of seed step + 100 l
  int inf_loss = -1;  // with losses > 1: the inf is planted right after this loss's last backward
  double init_scale = 1024;  // of loss 0's GradScaler (fp16); loss l's starts at init_scale 4^l
};

struct Outcome {
  std::vector<double> losses;     // the global-batch loss of each step
  std::vector<int> skipped;       // the steps that were skipped
  std::vector<double> grad_norms; // of the averaged, unscaled gradients (Adam is blind to their scale)
  std::vector<std::vector<double>> weights;
  double final_scale = 0;
  std::vector<double> final_scales;  // of every loss's scaler
  StateDict state;
  int64_t buckets_in_backward = 0, buckets_total = 0;  // overlap: buckets reduced by the hook / all
};

std::vector<Tensor> make_params(DType dtype) {
  const std::vector<Shape> shapes = {{kHidden, kIn}, {kHidden}, {kOut, kHidden}, {kOut}};
  std::vector<Tensor> params;
  for (size_t k = 0; k < shapes.size(); ++k) {
    Tensor p = mul(Tensor::randn(shapes[k], 100 + k), 0.4).to(dtype);
    p.requires_grad_();
    params.push_back(p);
  }
  return params;
}

std::unique_ptr<Optimizer> make_adamw(const std::vector<Tensor>& p, double lr = 1e-2) {
  // Two groups: matrices with decay, biases without.
  return std::make_unique<AdamW>(std::vector<ParamGroup>{{{p[0], p[2]}, lr, 0.1}, {{p[1], p[3]}, lr, 0.0}});
}

std::unique_ptr<LossScaler> make_scaler(Mode mode, double init_scale = 1024) {
  if (mode != Mode::F16) return std::make_unique<StaticLossScaler>(1.0);
  GradScalerOptions options;
  // Growth every 5 clean steps: the scale stays <= 2^14 over 20 steps. A natural overflow would not be a fair
  // test of "the same skipped steps": a rank's local-mean loss has 1/dp of the rows, so its backward's
  // intermediate 16-bit gradients are ~dp times the single process's and overflow at a dp times smaller
  // scale (as in PyTorch DDP and Megatron). Skips here are planted infs.
  options.init_scale = init_scale;
  options.growth_interval = 5;
  return std::make_unique<GradScaler>(options);
}

// Mean squared error over the rows [lo, hi) of step `step`'s global batch, computed in f32.
Tensor local_loss(const std::vector<Tensor>& p, int step, int64_t lo, int64_t hi, DType dtype) {
  const Tensor x = Tensor::randn({kBatch, kIn}, 1000 + step).slice(0, lo, hi).contiguous().to(dtype);
  const Tensor t = Tensor::randn({kBatch, kOut}, 2000 + step).slice(0, lo, hi).contiguous();
  const Tensor h = gelu(linear(x, p[0], p[1]));
  const Tensor y = linear(h, p[2], p[3]).to(DType::F32);
  return mean(pow(sub(y, t), 2.0));
}

void plant_inf(const std::vector<Tensor>& params) {
  // The last element of the last parameter: under ZeRO it lies in the last dp rank's shard only.
  NoGradGuard no_grad;
  Tensor p = params.back();
  std::vector<double> mask(static_cast<size_t>(p.numel()), 0.0);
  mask.back() = INFINITY;
  p.set_grad(add(p.grad(), Tensor::from_vector(mask, p.shape()).to(p.grad().dtype())));
}

// The run; dp == nullptr: the single-process reference on the whole batch.
Outcome train(const RunSpec& s, const Communicator* dp) {
  const DType dtype = mode_dtype(s.mode);
  std::vector<Tensor> params = make_params(dtype);
  const int size = dp ? dp->size() : 1, rank = dp ? dp->rank() : 0;
  if (dp) broadcast_parameters(params, *dp, 0);
  const int64_t rows = kBatch / size, lo = rank * rows, hi = lo + rows;
  std::unique_ptr<MixedPrecisionOptimizer> mpo;
  std::unique_ptr<ZeroOptimizer> zero;
  std::unique_ptr<GradientReducer> reducer;
  std::vector<std::unique_ptr<LossScaler>> scalers;
  for (int l = 0; l < s.losses; ++l) scalers.push_back(make_scaler(s.mode, s.init_scale * (1 << (2 * l))));
  if (s.kind == RunSpec::Zero) {
    ZeroOptions options;
    options.master_weights = s.master_weights;
    zero = std::make_unique<ZeroOptimizer>(make_adamw(params), std::move(scalers), *dp, options);
  } else {
    MixedPrecisionOptions options;
    options.master_weights = s.master_weights;
    mpo = std::make_unique<MixedPrecisionOptimizer>(make_adamw(params), std::move(scalers), options);
  }
  if (s.kind == RunSpec::DataParallel) reducer = std::make_unique<GradientReducer>(*dp, params, s.bucket_bytes);

  Outcome out;
  for (int step = 0; step < kSteps; ++step) {
    const int M = s.micro_batches;
    if (s.overlap) reducer->begin(M);
    std::vector<double> value = {0.0};
    const bool plants = step == s.inf_step && (!dp || rank == s.inf_rank);
    for (int m = 0; m < M; ++m) {
      const int64_t part = (hi - lo) / M;
      for (int l = 0; l < s.losses; ++l) {
        const Tensor loss =
            mul(local_loss(params, step + 100 * l, lo + m * part, lo + (m + 1) * part, dtype), 1.0 / M);
        value[0] += loss.item() / size;
        if (zero) zero->backward(loss, l); else mpo->backward(loss, l);
        if (plants && l == s.inf_loss && m == M - 1) plant_inf(params);
      }
    }
    if (dp) dp->all_reduce(value, Reduction::Sum);
    out.losses.push_back(value[0]);
    if (plants && s.inf_loss < 0) plant_inf(params);
    if (s.overlap) {
      reducer->finish();
      out.buckets_in_backward += reducer->buckets_reduced_in_backward();
      out.buckets_total += static_cast<int64_t>(reducer->buckets().size());
    } else if (reducer) {
      reducer->reduce();
    }
    const StepResult r = zero ? zero->step() : mpo->step();
    if (r.skipped) out.skipped.push_back(step);
    out.grad_norms.push_back(r.grad_norm);
    if (zero) zero->zero_grad(); else mpo->zero_grad();
  }
  for (const Tensor& p : params) out.weights.push_back(p.to_vector<double>());
  out.final_scale = zero ? zero->loss_scale() : mpo->loss_scale();
  for (int l = 0; l < s.losses; ++l) out.final_scales.push_back(zero ? zero->loss_scale(l) : mpo->loss_scale(l));
  out.state = zero ? zero->state_dict() : mpo->state_dict();
  return out;
}

void expect_same_training(const Outcome& got, const Outcome& want, Mode mode, const std::string& what) {
  const double tol = mode == Mode::F32 ? 1e-5 : 1e-2;
  const double wtol = mode == Mode::F32 ? 1e-5 : 2e-2;
  expect_close(got.losses, want.losses, tol, 1e-3, what + " losses");
  expect_close(got.grad_norms, want.grad_norms, tol, 1e-3, what + " grad norms");
  for (size_t k = 0; k < want.weights.size(); ++k)
    expect_close(got.weights[k], want.weights[k], wtol, 0.1, what + " weight " + std::to_string(k));
  EXPECT_EQ(got.skipped, want.skipped) << what;
  EXPECT_EQ(got.final_scale, want.final_scale) << what;
  EXPECT_EQ(got.final_scales, want.final_scales) << what;
}

Communicator dp2() { return make_groups({2, 1, 2}).dp; }  // ranks {0, 2} and {1, 3}

}  // namespace

TEST(DataParallel, BroadcastParametersMakesReplicasEqual) {
  const Communicator world = Communicator::world();
  std::vector<Tensor> params = make_params(DType::BF16);
  {
    NoGradGuard no_grad;
    if (world.rank() != 0) params[1].add_(Tensor::ones({kHidden}, DType::BF16));
  }
  const Tensor before = params[1];
  broadcast_parameters(params, world, 0);
  EXPECT_TRUE(params[1].same(before));  // in place: the same leaf
  EXPECT_EQ(params[1].to_vector<double>(), make_params(DType::BF16)[1].to_vector<double>());
}

TEST(DataParallel, LeafGradHookFiresOnceWhenTheGradientIsFinal) {
  Tensor x = Tensor::full({3}, 2.0);
  Tensor w = Tensor::full({3}, 3.0);
  x.requires_grad_();
  w.requires_grad_();
  std::vector<std::pair<const TensorImpl*, std::vector<double>>> calls;
  auto previous = set_leaf_grad_hook([&](const TensorImpl& leaf) {
    const Tensor& which = &leaf == x.impl_ptr().get() ? x : w;
    calls.emplace_back(&leaf, which.grad().to_vector<double>());
  });
  backward(sum(add(mul(mul(x, x), w), x)));  // d/dx = 2 x w + 1 = 13, d/dw = x^2 = 4: x is used 3 times
  set_leaf_grad_hook(std::move(previous));
  ASSERT_EQ(calls.size(), 2u);
  for (const auto& [leaf, grad] : calls)
    EXPECT_EQ(grad, leaf == x.impl_ptr().get() ? std::vector<double>(3, 13.0) : std::vector<double>(3, 4.0));
}

TEST(DataParallel, BucketsFollowReverseOrderPerDtypeWithinTheSize) {
  const Communicator world = Communicator::world();
  std::vector<Tensor> params = {Tensor::zeros({10}), Tensor::zeros({3}, DType::F16), Tensor::zeros({4}),
                                Tensor::zeros({20}), Tensor::zeros({5}, DType::F16)};
  // 64 bytes: 16 f32 or 32 f16 elements.
  const GradientReducer reducer(world, params, 64);
  EXPECT_EQ(reducer.buckets(), (std::vector<std::vector<size_t>>{{3}, {2, 0}, {4, 1}}));
  const GradientReducer one_each(world, params, 0);
  EXPECT_EQ(one_each.buckets().size(), 5u);
  const GradientReducer all(world, params);
  EXPECT_EQ(all.buckets(), (std::vector<std::vector<size_t>>{{3, 2, 0}, {4, 1}}));
}

TEST(DataParallel, ReduceAveragesInFp32AndBucketingDoesNotChangeIt) {
  const Communicator world = Communicator::world();
  const int r = world.rank(), n = world.size();
  std::vector<std::vector<double>> results[3];
  const int64_t sizes[3] = {0, 64, GradientReducer::kDefaultBucketBytes};
  for (int v = 0; v < 3; ++v) {
    std::vector<Tensor> params = {Tensor::zeros({7}), Tensor::zeros({5}, DType::F16), Tensor::zeros({9}),
                                  Tensor::zeros({3}, DType::BF16), Tensor::zeros({2})};
    // fp16: 30000 + 1000 r on rank r: the sum over the ranks overflows fp16, the mean does not.
    auto grad_of = [&](size_t k, int rank) {
      if (params[k].dtype() == DType::F16) return Tensor::full(params[k].shape(), 30000.0 + 1000.0 * rank, DType::F16);
      return mul(Tensor::randn(params[k].shape(), 7 * k + 11), rank + 1.0).to(params[k].dtype());
    };
    for (size_t k = 0; k < params.size(); ++k) {
      params[k].requires_grad_();
      if (!(k == 4 && r == 1)) params[k].set_grad(grad_of(k, r));  // rank 1 lacks one: it counts as zeros
    }
    GradientReducer reducer(world, params, sizes[v]);
    reducer.reduce();
    for (const Tensor& p : params) results[v].push_back(p.grad().to_vector<double>());
    for (size_t k = 0; k < params.size(); ++k) {
      std::vector<double> sum(static_cast<size_t>(params[k].numel()), 0.0);
      for (int q = 0; q < n; ++q) {
        if (k == 4 && q == 1) continue;
        const std::vector<double> g = grad_of(k, q).to_vector<double>();
        for (size_t i = 0; i < g.size(); ++i) sum[i] += g[i];
      }
      for (size_t i = 0; i < sum.size(); ++i) {
        const double want = mixtape::testing::round_to(params[k].dtype(), sum[i] / n);
        EXPECT_NEAR(results[v][k][i], want, 1e-6 * std::abs(want)) << "param " << k << " bucket " << sizes[v];
      }
    }
  }
  EXPECT_EQ(results[0], results[1]);
  EXPECT_EQ(results[0], results[2]);
}

// A bf16 parameter with fp32 gradients (Tensor::set_grad_dtype, as boost() sets them for
// accumulate_allreduce_grads_in_fp32) is bucketed with the fp32 parameters, and its average stays fp32: rank
// r's gradient 1 + r 2^-10 (below bf16's ulp of 2^-7 at 1) averages to 1 + (n - 1) / 2 * 2^-10, exact in
// fp32, where the bf16 parameter beside it gets its average rounded to bf16.
TEST(DataParallel, Fp32GradientsOf16BitParametersAreReducedWithoutRounding) {
  const Communicator world = Communicator::world();
  const int r = world.rank(), n = world.size();
  std::vector<Tensor> params = {Tensor::zeros({4}, DType::BF16), Tensor::zeros({3}, DType::BF16),
                                Tensor::zeros({2})};
  for (Tensor& p : params) p.requires_grad_();
  params[0].set_grad_dtype(DType::F32);
  GradientReducer reducer(world, params);
  std::vector<std::vector<size_t>> buckets = reducer.buckets();
  std::sort(buckets.begin(), buckets.end());
  EXPECT_EQ(buckets, (std::vector<std::vector<size_t>>{{1}, {2, 0}}));
  const double value = 1 + r * std::ldexp(1.0, -10);
  params[0].set_grad(Tensor::full({4}, value));
  params[1].set_grad(Tensor::full({3}, value, DType::BF16));
  params[2].set_grad(Tensor::full({2}, value));
  reducer.reduce();
  const double mean = 1 + (n - 1) / 2.0 * std::ldexp(1.0, -10);
  EXPECT_EQ(params[0].grad().dtype(), DType::F32);
  EXPECT_EQ(params[0].grad().to_vector<double>(), std::vector<double>(4, mean));
  EXPECT_EQ(params[1].grad().dtype(), DType::BF16);
  EXPECT_EQ(params[1].grad().to_vector<double>(), std::vector<double>(3, 1.0));  // each rank's 1, rounded
  EXPECT_EQ(params[2].grad().to_vector<double>(), std::vector<double>(2, mean));
}

TEST(DataParallel, TrainingEqualsTheSingleProcessRun) {
  const Communicator world = Communicator::world();
  const Communicator pairs = dp2();
  for (Mode mode : {Mode::F32, Mode::BF16, Mode::F16}) {
    RunSpec s;
    s.mode = mode;
    if (mode == Mode::F16) {  // one rank's inf: every rank skips
      s.inf_step = 3;
      s.inf_rank = 1;
    }
    const Outcome reference = train(s, nullptr);
    if (mode == Mode::F16) {
      EXPECT_EQ(reference.skipped, std::vector<int>{3});
    }
    s.kind = RunSpec::DataParallel;
    expect_same_training(train(s, &world), reference, mode, std::string("dp4 ") + mode_name(mode));
    expect_same_training(train(s, &pairs), reference, mode, std::string("dp2 ") + mode_name(mode));
    s.bucket_bytes = 0;
    expect_same_training(train(s, &world), reference, mode, std::string("dp4 bucket 0 ") + mode_name(mode));
    // Overlapped with backward (no planted inf: an inf planted after backward would miss the reduction).
    RunSpec plain;
    plain.mode = mode;
    const Outcome clean = train(plain, nullptr);
    RunSpec o = plain;
    o.kind = RunSpec::DataParallel;
    o.overlap = true;
    o.bucket_bytes = 64;
    const Outcome overlapped = train(o, &pairs);
    expect_same_training(overlapped, clean, mode, std::string("dp2 overlapped ") + mode_name(mode));
    EXPECT_GT(overlapped.buckets_total, kSteps);  // several buckets per step ...
    EXPECT_EQ(overlapped.buckets_in_backward, overlapped.buckets_total);  // ... all reduced inside backward
    // Two micro-batches per rank: begin(2) spans both backwards; the buckets start in the second.
    o.micro_batches = 2;
    const Outcome two = train(o, &pairs);
    expect_same_training(two, clean, mode, std::string("dp2 overlapped, 2 micro-batches ") + mode_name(mode));
    EXPECT_EQ(two.buckets_in_backward, two.buckets_total);
  }
}

// begin(n) waits for the n-th backward: after one of two backwards no bucket has started; a third backward
// after the buckets started is an error, and so is finish() without begin().
TEST(DataParallel, OverlapWaitsForTheLastOfItsBackwards) {
  const Communicator pairs = dp2();
  std::vector<Tensor> params = make_params(DType::F32);
  GradientReducer reducer(pairs, params, 64);
  const int64_t lo = pairs.rank() * 4;
  reducer.begin(2);
  backward(local_loss(params, 0, lo, lo + 2, DType::F32));
  EXPECT_EQ(reducer.buckets_reduced_in_backward(), 0);
  backward(local_loss(params, 0, lo + 2, lo + 4, DType::F32));
  EXPECT_EQ(reducer.buckets_reduced_in_backward(), static_cast<int64_t>(reducer.buckets().size()));
  EXPECT_ERROR_MENTIONS(backward(local_loss(params, 0, lo, lo + 2, DType::F32)), "was produced again",
                        "expected 2 backward call(s)");
  reducer.finish();
  EXPECT_ERROR_MENTIONS(reducer.finish(), "expected begin() first");
  EXPECT_ERROR_MENTIONS(reducer.begin(0), "backwards must be >= 1");
}

// Also without master weights (Apex O3: the shard holds pieces of the 16-bit parameters themselves), against
// the unsharded optimizer without masters: the same training, and a state dict of that optimizer's layout (no
// "master.<i>", "amp.master_weights" false) that loads into it; a dict written with masters is refused.
TEST(Zero, EqualsPlainDataParallelAndTheSingleProcessRun) {
  const Communicator world = Communicator::world();
  const Communicator pairs = dp2();
  for (const auto& [mode, master_weights] : std::vector<std::pair<Mode, bool>>{
           {Mode::F32, true}, {Mode::BF16, true}, {Mode::F16, true}, {Mode::BF16, false}, {Mode::F16, false}}) {
    const std::string what = std::string(mode_name(mode)) + (master_weights ? "" : " without master weights");
    RunSpec s;
    s.mode = mode;
    s.master_weights = master_weights;
    // The inf sits in the last rank's shard only: the found_inf MAX over dp makes every rank skip.
    if (mode == Mode::F16) {
      s.inf_step = 3;
      s.inf_rank = 0;
    }
    const Outcome reference = train(s, nullptr);
    s.kind = RunSpec::DataParallel;
    const Outcome plain = train(s, &world);
    s.kind = RunSpec::Zero;
    const Outcome zero4 = train(s, &world);
    expect_same_training(zero4, reference, mode, "zero dp4 " + what);
    expect_same_training(zero4, plain, mode, "zero vs plain dp4 " + what);
    expect_same_training(train(s, &pairs), reference, mode, "zero dp2 " + what);
    // The gathered state dict has MixedPrecisionOptimizer's layout and values.
    std::vector<std::string> zero_keys, ref_keys;
    for (const auto& [key, t] : zero4.state.tensors) zero_keys.push_back(key);
    for (const auto& [key, t] : reference.state.tensors) ref_keys.push_back(key);
    EXPECT_EQ(zero_keys, ref_keys) << what;
    EXPECT_EQ(zero4.state.metadata, reference.state.metadata) << what;
    for (const auto& [key, t] : reference.state.tensors)
      if (zero4.state.tensors.count(key))
        expect_close(zero4.state.tensors.at(key).to_vector<double>(), t.to_vector<double>(),
                     mode == Mode::F32 ? 1e-4 : 5e-2, key.find("exp_avg_sq") != std::string::npos ? 1e-4 : 1e-2,
                     what + " " + key);
    if (master_weights) continue;
    EXPECT_EQ(zero4.state.metadata.at("amp.master_weights"), "false");
    for (const std::string& key : zero_keys) EXPECT_NE(key.rfind("master.", 0), 0u) << key;
    std::vector<Tensor> p = make_params(mode_dtype(mode));
    MixedPrecisionOptions no_masters;
    no_masters.master_weights = false;
    MixedPrecisionOptimizer mpo(make_adamw(p), make_scaler(mode), no_masters);
    EXPECT_NO_THROW(mpo.load_state_dict(zero4.state)) << what;
    ZeroOptions zero_no_masters;
    zero_no_masters.master_weights = false;
    ZeroOptimizer zero(make_adamw(p), make_scaler(mode), world, zero_no_masters);
    StateDict with_masters = zero4.state;
    with_masters.metadata["amp.master_weights"] = "true";
    EXPECT_ERROR_MENTIONS(zero.load_state_dict(with_masters), "'amp.master_weights' is 'true', expected 'false'");
  }
}

// Master weights matter under ZeRO-1 too. AdamW's steps are ~lr = 1e-5, below half an fp16 ulp of every
// weight of magnitude >= 2^-4 (there half an ulp is >= 2^-15 = 3.1e-5). Without masters those weights never
// move; the fp32 masters add the steps up and move many of them within 20 steps.
TEST(Zero, WithoutMasterWeightsSmallUpdatesAreLostAndWithMastersTheyAreKept) {
  const Communicator world = Communicator::world();
  const int64_t rows = kBatch / world.size(), lo = world.rank() * rows;
  const std::vector<Tensor> initial = make_params(DType::F16);
  int64_t large = 0;  // weights with |w| >= 2^-4
  for (const Tensor& p : initial)
    for (double w : p.to_vector<double>()) large += std::abs(w) >= 0.0625;
  ASSERT_GT(large, 50);
  auto moved = [&](bool master_weights) {
    std::vector<Tensor> p = make_params(DType::F16);
    ZeroOptions options;
    options.master_weights = master_weights;
    ZeroOptimizer zero(make_adamw(p, 1e-5), make_scaler(Mode::F16), world, options);
    for (int step = 0; step < kSteps; ++step) {
      zero.backward(local_loss(p, step, lo, lo + rows, DType::F16));
      EXPECT_FALSE(zero.step().skipped) << "step " << step;
      zero.zero_grad();
    }
    int64_t count = 0;
    for (size_t k = 0; k < p.size(); ++k) {
      const std::vector<double> before = initial[k].to_vector<double>(), after = p[k].to_vector<double>();
      for (size_t i = 0; i < before.size(); ++i) count += std::abs(before[i]) >= 0.0625 && after[i] != before[i];
    }
    return count;
  };
  EXPECT_EQ(moved(false), 0);
  EXPECT_GT(moved(true), large / 4);
}

// Apex's num_losses under ZeRO-1: two losses per micro-batch, two micro-batches, so every step folds at each
// change of loss id. An inf is planted on one rank in loss 1's gradients at step 3, or in loss 0's at step 8
// (folded when loss 1 begins): every rank skips that step, only that loss's scaler backs off, and the run
// equals the unsharded optimizer's. The final scales, by hand (GradScaler: x2 after 5 clean steps in a row,
// x0.5 on an overflow; loss 0 from 256, loss 1 from 1024, 20 steps):
//   a scaler that never overflows grows after steps 4, 9, 14, 19: x16;
//   one that overflows at step 3: clean again from step 4, grows after 8, 13, 18: x0.5 x8 = x4;
//   one that overflows at step 8: grows after 4, backs off at 8, grows after 13, 18: x2 x0.5 x4 = x4.
TEST(Zero, SeveralLossesAreUnscaledEachWithItsOwnScaleAsInTheUnshardedOptimizer) {
  const Communicator world = Communicator::world();
  const Communicator pairs = dp2();
  struct Case {
    int inf_step, inf_loss;
    std::vector<double> scales;
  };
  for (const Case& c : {Case{3, 1, {256.0 * 16, 1024.0 * 4}}, Case{8, 0, {256.0 * 4, 1024.0 * 16}}}) {
    const std::string what =
        "inf in loss " + std::to_string(c.inf_loss) + " at step " + std::to_string(c.inf_step);
    RunSpec s;
    s.mode = Mode::F16;
    s.losses = 2;
    s.micro_batches = 2;
    s.init_scale = 256;
    s.inf_step = c.inf_step;
    s.inf_loss = c.inf_loss;
    s.inf_rank = 1;
    const Outcome reference = train(s, nullptr);
    EXPECT_EQ(reference.skipped, std::vector<int>{c.inf_step}) << what;
    EXPECT_EQ(reference.final_scales, c.scales) << what;
    s.kind = RunSpec::Zero;
    const Outcome zero4 = train(s, &world);
    expect_same_training(zero4, reference, s.mode, "two losses, zero dp4, " + what);
    expect_same_training(train(s, &pairs), reference, s.mode, "two losses, zero dp2, " + what);
    EXPECT_EQ(zero4.state.metadata, reference.state.metadata) << what;  // both scalers, num_losses 2
  }
}

TEST(Zero, StateDictLoadsIntoAnotherDpSizeAndTrainingContinues) {
  const Communicator world = Communicator::world();
  const Communicator pairs = dp2();
  // Train 3 steps on dp4, save; a fresh dp2 ZeroOptimizer loads it and both take 2 more steps.
  std::vector<Tensor> a = make_params(DType::F16), b = make_params(DType::F16);
  ZeroOptimizer za(make_adamw(a), make_scaler(Mode::F16), world);
  ZeroOptimizer zb(make_adamw(b), make_scaler(Mode::F16), pairs);
  auto train_step = [](ZeroOptimizer& z, const std::vector<Tensor>& p, const Communicator& dp, int step) {
    const int64_t rows = kBatch / dp.size();
    z.backward(local_loss(p, step, dp.rank() * rows, (dp.rank() + 1) * rows, DType::F16));
    z.step();
    z.zero_grad();
  };
  for (int step = 0; step < 3; ++step) train_step(za, a, world, step);
  const StateDict saved = za.state_dict();
  {
    NoGradGuard no_grad;
    for (size_t k = 0; k < a.size(); ++k) b[k].copy_(a[k]);  // the model weights travel separately
  }
  zb.load_state_dict(saved);
  const StateDict reloaded = zb.state_dict();
  EXPECT_EQ(reloaded.metadata, saved.metadata);
  for (const auto& [key, t] : saved.tensors)
    EXPECT_EQ(reloaded.tensors.at(key).to_vector<double>(), t.to_vector<double>()) << key;
  for (int step = 3; step < 5; ++step) {
    train_step(za, a, world, step);
    train_step(zb, b, pairs, step);
  }
  for (size_t k = 0; k < a.size(); ++k)
    expect_close(b[k].to_vector<double>(), a[k].to_vector<double>(), 1e-2, 0.1, "weight " + std::to_string(k));
  EXPECT_EQ(za.loss_scale(), zb.loss_scale());
}

// log_num_zeros_in_grad: each rank counts the zeros of its shard's pieces and the counts are summed over dp,
// so ZeRO reports the single-process optimizer's count: an element is neither missed nor counted twice, the
// shard's padding past the last parameter does not count, and neither do the pieces count_in_norm leaves out.
TEST(Zero, CountsZeroGradientElementsAsTheSingleProcessOptimizer) {
  const Communicator world = Communicator::world();
  const int64_t rows = kBatch / world.size(), lo = world.rank() * rows;
  // Planted on every rank after backward: row 0 of p0's gradient (kIn elements, in the first rank's shard)
  // and the whole of p3's (kOut, the last parameter: the last rank's shard). Nothing else is exactly zero.
  auto plant_zeros = [](const std::vector<Tensor>& p) {
    NoGradGuard no_grad;
    p[0].grad().narrow(0, 0, 1).zero_();
    p[3].grad().zero_();
  };
  for (Mode mode : {Mode::F32, Mode::F16}) {
    SCOPED_TRACE(mode_name(mode));
    const DType dtype = mode_dtype(mode);
    std::vector<Tensor> ref = make_params(dtype), sharded = make_params(dtype), partial = make_params(dtype);
    MixedPrecisionOptions mp_options;
    mp_options.log_num_zeros_in_grad = true;
    MixedPrecisionOptimizer mpo(make_adamw(ref), make_scaler(mode), mp_options);
    ZeroOptions counting;
    counting.log_num_zeros_in_grad = true;
    ZeroOptimizer zero(make_adamw(sharded), make_scaler(mode), world, counting);
    ZeroOptions matrices_only = counting;
    matrices_only.count_in_norm = {true, true, false, false};  // optimizer order: p0, p2 | p1, p3
    ZeroOptimizer zero_partial(make_adamw(partial), make_scaler(mode), world, matrices_only);
    std::vector<Tensor> quiet = make_params(dtype);
    ZeroOptimizer silent(make_adamw(quiet), make_scaler(mode), world);
    for (int step = 0; step < 3; ++step) {
      mpo.backward(local_loss(ref, step, 0, kBatch, dtype));
      plant_zeros(ref);
      const StepResult want = mpo.step();
      zero.backward(local_loss(sharded, step, lo, lo + rows, dtype));
      plant_zeros(sharded);
      const StepResult got = zero.step();
      zero_partial.backward(local_loss(partial, step, lo, lo + rows, dtype));
      plant_zeros(partial);
      const StepResult got_partial = zero_partial.step();
      ASSERT_FALSE(want.skipped || got.skipped || got_partial.skipped) << "step " << step;
      EXPECT_EQ(want.num_zeros, kIn + kOut) << "step " << step;
      EXPECT_EQ(got.num_zeros, want.num_zeros) << "step " << step;
      EXPECT_EQ(got_partial.num_zeros, kIn) << "step " << step;
      mpo.zero_grad();
      zero.zero_grad();
      zero_partial.zero_grad();
    }
    silent.backward(local_loss(quiet, 0, lo, lo + rows, dtype));
    EXPECT_EQ(silent.step().num_zeros, -1);  // not asked for: not counted
  }
}

TEST(Zero, ClipsWithTheGlobalNormAndLeavesOutWhatCountInNormExcludes) {
  const Communicator world = Communicator::world();
  const int64_t rows = kBatch / world.size(), lo = world.rank() * rows;
  // Reference: one process, full batch, MixedPrecisionOptimizer with clipping (the norm is ~2: clip at 0.5).
  std::vector<Tensor> ref = make_params(DType::F32), sharded = make_params(DType::F32),
                      partial = make_params(DType::F32);
  MixedPrecisionOptions mp_options;
  mp_options.clip_grad = 0.5;
  MixedPrecisionOptimizer mpo(make_adamw(ref), make_scaler(Mode::F32), mp_options);
  ZeroOptions zero_options;
  zero_options.clip_grad = 0.5;
  ZeroOptimizer zero(make_adamw(sharded), make_scaler(Mode::F32), world, zero_options);
  ZeroOptions only_matrices;
  only_matrices.count_in_norm = {true, true, false, false};  // optimizer order: p0, p2 | p1, p3
  ZeroOptimizer zero_partial(make_adamw(partial), make_scaler(Mode::F32), world, only_matrices);
  for (int step = 0; step < 3; ++step) {
    mpo.backward(local_loss(ref, step, 0, kBatch, DType::F32));
    std::vector<double> matrix_norm = {0};
    for (int k : {0, 2})
      for (double g : ref[k].grad().to_vector<double>()) matrix_norm[0] += g * g;
    const StepResult want = mpo.step();
    zero.backward(local_loss(sharded, step, lo, lo + rows, DType::F32));
    const StepResult got = zero.step();
    zero_partial.backward(local_loss(partial, step, lo, lo + rows, DType::F32));
    const StepResult got_partial = zero_partial.step();
    EXPECT_NEAR(got.grad_norm, want.grad_norm, 1e-5 * want.grad_norm) << "step " << step;
    EXPECT_GT(want.grad_norm, 0.5) << "step " << step;  // clipping is active
    if (step == 0) {
      EXPECT_NEAR(got_partial.grad_norm, std::sqrt(matrix_norm[0]), 1e-5 * got_partial.grad_norm);
    }
    mpo.zero_grad();
    zero.zero_grad();
    zero_partial.zero_grad();
  }
  for (size_t k = 0; k < ref.size(); ++k)
    expect_close(sharded[k].to_vector<double>(), ref[k].to_vector<double>(), 1e-5, 0.1, "weight " + std::to_string(k));
  EXPECT_ERROR_MENTIONS(ZeroOptimizer(make_adamw(make_params(DType::F32)), make_scaler(Mode::F32), world,
                                      ZeroOptions{0, nullptr, {true}}),
                        "count_in_norm has 1 entries");
}

TEST(Zero, BadLossIdsAndGradientsOfUnknownScaleAreErrors) {
  const Communicator world = Communicator::world();
  const int64_t rows = kBatch / world.size(), lo = world.rank() * rows;
  std::vector<Tensor> p = make_params(DType::F16);
  std::vector<std::unique_ptr<LossScaler>> two;
  two.push_back(make_scaler(Mode::F16));
  two.push_back(make_scaler(Mode::F16));
  ZeroOptimizer zero(make_adamw(p), std::move(two), world);
  EXPECT_EQ(zero.num_losses(), 2);
  EXPECT_ERROR_MENTIONS(zero.backward(local_loss(p, 0, lo, lo + rows, DType::F16), 2),
                        "loss_id 2 out of range, expected 0 <= loss_id < num_losses = 2");
  EXPECT_ERROR_MENTIONS(zero.loss_scale(-1), "loss_id -1 out of range");
  // A backward that bypassed the optimizer: its gradients carry no known scale (on every rank alike).
  backward(local_loss(p, 0, lo, lo + rows, DType::F16));
  EXPECT_ERROR_MENTIONS(zero.step(), "has a gradient, but no loss went through scale_loss()/backward()");
  zero.zero_grad();
  std::vector<std::unique_ptr<LossScaler>> none;
  EXPECT_ERROR_MENTIONS(ZeroOptimizer(make_adamw(make_params(DType::F32)), std::move(none), world),
                        "expected at least one loss scaler");
}

// A state dict any rank rejects is rejected by every rank, and nothing changes anywhere: the faults that show
// in the whole dict (as MixedPrecisionOptimizer checks it) and one only the rank owning that parameter's piece
// can see (a buffer name AdamW does not keep, for the last parameter: the last rank's shard).
TEST(Zero, ABadStateDictIsRejectedOnEveryRankAndChangesNothing) {
  const Communicator world = Communicator::world();
  const int64_t rows = kBatch / world.size(), lo = world.rank() * rows;
  std::vector<Tensor> p = make_params(DType::F16);
  ZeroOptimizer zero(make_adamw(p), make_scaler(Mode::F16), world);
  for (int step = 0; step < 2; ++step) {
    zero.backward(local_loss(p, step, lo, lo + rows, DType::F16));
    zero.step();
    zero.zero_grad();
  }
  const StateDict good = zero.state_dict();
  // Optimizer order: p0, p2 | p1, p3.
  auto edited = [&](const std::function<void(StateDict&)>& edit) {
    StateDict d = good;
    edit(d);
    return d;
  };
  const std::vector<std::pair<StateDict, std::string>> bad = {
      {edited([](StateDict& d) { d.tensors.erase("master.3"); }), "missing tensor entry 'master.3'"},
      {edited([](StateDict& d) { d.tensors["master.3"] = d.tensors["master.3"].to(DType::F16); }),
       "tensor entry 'master.3' is f16"},
      {edited([](StateDict& d) { d.tensors["master.1"] = d.tensors["master.1"].reshape({-1}); }),
       "tensor entry 'master.1' is f32[48]"},
      {edited([](StateDict& d) { d.tensors["bogus"] = Tensor::zeros({2}); }), "unexpected tensor entry 'bogus'"},
      {edited([](StateDict& d) { d.tensors["state.7.exp_avg"] = Tensor::zeros({2}); }),
       "unexpected tensor entry 'state.7.exp_avg'"},
      {edited([](StateDict& d) { d.metadata["state.9.step"] = "2"; }), "unexpected metadata entry 'state.9.step'"},
      {edited([](StateDict& d) { d.tensors["state.3.exp_avg"] = d.tensors["state.3.exp_avg"].to(DType::F16); }),
       "tensor entry 'state.3.exp_avg' is f16"},
      {edited([](StateDict& d) { d.tensors["state.3.bogus"] = d.tensors["state.3.exp_avg"]; }),
       world.rank() == world.size() - 1 ? "unexpected tensor entry 'state.3.bogus'"
                                        : "rank 3 of world rejected the state dict"},
  };
  for (const auto& [dict, message] : bad) {
    EXPECT_ERROR_MENTIONS(zero.load_state_dict(dict), message);
    const StateDict now = zero.state_dict();
    EXPECT_EQ(now.metadata, good.metadata) << message;
    for (const auto& [key, t] : good.tensors)
      EXPECT_EQ(now.tensors.at(key).to_vector<double>(), t.to_vector<double>()) << message << ": " << key;
  }
  EXPECT_NO_THROW(zero.load_state_dict(good));
}

// step() with no backward since the last step (on any rank) changes nothing, as MixedPrecisionOptimizer's
// step does then: AdamW's momentum and weight decay would otherwise move every weight.
TEST(Zero, AStepWithoutABackwardChangesNothing) {
  const Communicator world = Communicator::world();
  const int64_t rows = kBatch / world.size(), lo = world.rank() * rows;
  for (bool master_weights : {true, false}) {
    std::vector<Tensor> p = make_params(DType::F16);
    ZeroOptions options;
    options.master_weights = master_weights;
    ZeroOptimizer zero(make_adamw(p), make_scaler(Mode::F16), world, options);
    zero.backward(local_loss(p, 0, lo, lo + rows, DType::F16));
    zero.step();
    std::vector<std::vector<double>> before;
    for (const Tensor& t : p) before.push_back(t.to_vector<double>());
    const StateDict state = zero.state_dict();
    zero.step();  // right after a step
    zero.zero_grad();
    zero.step();  // after zero_grad
    for (size_t k = 0; k < p.size(); ++k) EXPECT_EQ(p[k].to_vector<double>(), before[k]) << "weight " << k;
    EXPECT_EQ(zero.state_dict().metadata, state.metadata);
  }
}
