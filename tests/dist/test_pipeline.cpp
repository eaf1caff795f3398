// Pipeline parallelism under MPI (4 ranks): the world is split into pipelines of 1, 2 and 4 stages; each
// pipeline trains one step of a model split by layers over its stages, and every rank compares its stage's
// gradients and the mean loss with the same model run in one process on the whole batch (every rank builds
// that reference locally from the same seeds).
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "amp/optimizer.h"
#include "amp/scaler.h"
#include "autograd/autograd.h"
#include "dist/process_group.h"
#include "dist/pipeline.h"
#include "dist/world.h"
#include "nn/gpt.h"
#include "nn/layers.h"
#include "optim/sgd.h"
#include "tensor/ops.h"
#include "../test_util.h"

using namespace mixtape;
using namespace mixtape::dist;
using namespace mixtape::testing;

namespace {

// ---- the schedule itself: every message matched, no deadlock even when every send blocks ----------------

struct Simulation {
  bool deadlocked = false;
  std::string problem;       // empty when every check passed
  std::vector<int64_t> max_in_flight;  // per stage: most micro-batches forwarded but not yet backwarded
};

// Runs every stage's operation list with rendezvous semantics (a send completes only together with the
// matching receive, the worst case of a blocking MPI_Send), as one scheduler stepping all stages.
Simulation simulate(PipelineScheduleKind kind, int P, int64_t M) {
  using Op = PipelineOperation;
  std::vector<std::vector<Op>> ops;
  for (int s = 0; s < P; ++s) ops.push_back(pipeline_operations(kind, P, s, M));
  std::vector<size_t> pc(static_cast<size_t>(P), 0);
  std::vector<std::vector<int>> state(static_cast<size_t>(P), std::vector<int>(static_cast<size_t>(M), 0));
  Simulation result;
  result.max_in_flight.assign(static_cast<size_t>(P), 0);
  std::vector<int64_t> in_flight(static_cast<size_t>(P), 0);
  auto head = [&](int s) -> const Op* {
    return pc[size_t(s)] < ops[size_t(s)].size() ? &ops[size_t(s)][pc[size_t(s)]] : nullptr;
  };
  auto fail_with = [&](const std::string& what) {
    if (result.problem.empty()) result.problem = what;
  };
  for (;;) {
    bool progressed = false, done = true;
    for (int s = 0; s < P; ++s) {
      const Op* op = head(s);
      if (!op) continue;
      done = false;
      int& st = state[size_t(s)][size_t(op->micro_batch)];
      if (op->kind == Op::Forward) {
        if (st != 0) fail_with("forward twice on stage " + std::to_string(s));
        st = 1;
        result.max_in_flight[size_t(s)] = std::max(result.max_in_flight[size_t(s)], ++in_flight[size_t(s)]);
        ++pc[size_t(s)];
        progressed = true;
      } else if (op->kind == Op::Backward) {
        if (st != 1) fail_with("backward before forward on stage " + std::to_string(s));
        st = 2;
        --in_flight[size_t(s)];
        ++pc[size_t(s)];
        progressed = true;
      } else if (op->kind == Op::SendForward || op->kind == Op::SendBackward) {
        const int peer = op->kind == Op::SendForward ? s + 1 : s - 1;
        const Op* other = head(peer);
        const Op::Kind wanted = op->kind == Op::SendForward ? Op::RecvForward : Op::RecvBackward;
        if (other && other->kind == wanted) {
          if (other->micro_batch != op->micro_batch)
            fail_with("stage " + std::to_string(s) + " sent micro-batch " + std::to_string(op->micro_batch) +
                      " where stage " + std::to_string(peer) + " expected " + std::to_string(other->micro_batch));
          ++pc[size_t(s)];
          ++pc[size_t(peer)];
          progressed = true;
        }
      }
    }
    if (done) break;
    if (!progressed) {
      result.deadlocked = true;
      std::string heads;
      for (int s = 0; s < P; ++s)
        heads += " stage " + std::to_string(s) + ": " + (head(s) ? to_string(head(s)->kind) : "done");
      fail_with("deadlock:" + heads);
      break;
    }
  }
  for (int s = 0; s < P && !result.deadlocked; ++s)
    for (int64_t m = 0; m < M; ++m)
      if (state[size_t(s)][size_t(m)] != 2)
        fail_with("micro-batch " + std::to_string(m) + " not done on stage " + std::to_string(s));
  return result;
}

// ---- a stack of Linear + GELU layers with a weight tied between the first and the last stage ----------

constexpr int64_t kLayers = 4, kWidth = 6, kBatch = 8;

struct Stack {
  std::shared_ptr<Linear> tied;  // x -> tied(x) at the start, tied(h) again before the loss
  std::vector<std::shared_ptr<Linear>> layers;
  explicit Stack(DType dtype) {
    tied = std::make_shared<Linear>(kWidth, kWidth, false, 100);
    tied->to(dtype);
    for (int64_t i = 0; i < kLayers; ++i) {
      layers.push_back(std::make_shared<Linear>(kWidth, kWidth, true, 200 + 10 * uint64_t(i)));
      layers.back()->to(dtype);
    }
  }
  Tensor layer_range(Tensor h, int64_t begin, int64_t end) const {
    for (int64_t i = begin; i < end; ++i) h = gelu((*layers[size_t(i)])(h));
    return h;
  }
  static Tensor loss(const Tensor& out, const Tensor& target) {
    const Tensor d = sub(out, target);
    return mean(mul(d, d));
  }
  // The single-process reference on the whole batch.
  Tensor full_loss(const Tensor& x, const Tensor& target) const {
    return loss((*tied)(layer_range((*tied)(x), 0, kLayers)), target);
  }
};

class StackStage : public PipelineStage {
 public:
  StackStage(const Stack& stack, int stage, int num_stages, std::vector<Tensor> targets)
      : stack_(stack), stage_(stage), num_stages_(num_stages), targets_(std::move(targets)) {}
  Tensor forward(const Tensor& input, int64_t micro_batch) override {
    Tensor h = stage_ == 0 ? (*stack_.tied)(input) : input;
    const int64_t per_stage = kLayers / num_stages_;
    h = stack_.layer_range(h, stage_ * per_stage, (stage_ + 1) * per_stage);
    if (stage_ != num_stages_ - 1) return h;
    return Stack::loss((*stack_.tied)(h), targets_[size_t(micro_batch)]);
  }

 private:
  const Stack& stack_;
  int stage_, num_stages_;
  std::vector<Tensor> targets_;
};

// Ranks [k*P, (k+1)*P) form pipeline k; stage = rank % P.
Communicator pipeline_of(int P) {
  const Communicator world = Communicator::world();
  return world.split(world.rank() / P, world.rank() % P, "pipeline group of " + std::to_string(P));
}

double tolerance(DType dtype) { return dtype == DType::F64 ? 1e-12 : 1e-5; }

// One step of the split stack against the reference; `scale` is the factor the gradients must carry.
void check_stack_step(const Communicator& pp, const Communicator& embedding, DType dtype, PipelineOptions options,
                      int64_t M, double scale, const std::string& label) {
  const int P = pp.size(), s = pp.rank();
  const Tensor x = uniform_tensor({kBatch, kWidth}, 7, -1, 1, dtype);
  const Tensor target = uniform_tensor({kBatch, kWidth}, 8, -1, 1, dtype);
  Stack reference(dtype);
  const Tensor ref_loss = reference.full_loss(x, target);
  backward(ref_loss);

  Stack model(dtype);
  StackStage stage(model, s, P, split_micro_batches(target, M));
  PipelineSchedule schedule(pp, options);
  const double loss = schedule.run(stage, split_micro_batches(x, M));
  all_reduce_tied_gradients(model.tied->weight, embedding);

  const double tol = tolerance(dtype);
  EXPECT_NEAR(loss, ref_loss.item(), tol * std::max(1.0, std::abs(ref_loss.item()))) << label;
  auto expect_grad = [&](const Tensor& param, const Tensor& ref, bool owned, const std::string& what) {
    if (!owned) {
      EXPECT_FALSE(param.grad().defined()) << label << ": " << what << " is not on stage " << s;
      return;
    }
    ASSERT_TRUE(param.grad().defined()) << label << ": " << what;
    EXPECT_TRUE(all_close(mul(param.grad(), 1.0 / scale), ref.grad(), tol, tol)) << label << ": " << what;
  };
  const bool has_tied = s == 0 || s == P - 1;
  expect_grad(model.tied->weight, reference.tied->weight, has_tied, "tied weight");
  const int64_t per_stage = kLayers / P;
  for (int64_t i = 0; i < kLayers; ++i) {
    const bool owned = i / per_stage == s;
    expect_grad(model.layers[size_t(i)]->weight, reference.layers[size_t(i)]->weight, owned,
                "layer " + std::to_string(i) + " weight");
    expect_grad(model.layers[size_t(i)]->bias, reference.layers[size_t(i)]->bias, owned,
                "layer " + std::to_string(i) + " bias");
  }
}

}  // namespace

TEST(PipelineSchedule, EveryMessageIsMatchedWithoutDeadlockEvenWithRendezvousSends) {
  for (PipelineScheduleKind kind : {PipelineScheduleKind::GPipe, PipelineScheduleKind::OneFOneB})
    for (int P = 1; P <= 8; ++P)
      for (int64_t M = 1; M <= 12; ++M) {
        const Simulation sim = simulate(kind, P, M);
        EXPECT_TRUE(sim.problem.empty()) << to_string(kind) << " pp " << P << " M " << M << ": " << sim.problem;
        for (int s = 0; s < P; ++s) {
          // GPipe holds every micro-batch's activations; 1F1B at most pp - stage of them.
          const int64_t bound = kind == PipelineScheduleKind::GPipe ? M : std::min<int64_t>(M, P - s);
          EXPECT_EQ(sim.max_in_flight[size_t(s)], bound) << to_string(kind) << " pp " << P << " M " << M;
        }
      }
}

TEST(PipelineSchedule, OneFOneBFollowsMegatronsWarmupSteadyCooldown) {
  using Op = PipelineOperation;
  // Stage 0 of 2, 3 micro-batches: one warm-up forward, then 1F1B, then one cool-down backward.
  const std::vector<Op> stage0 = pipeline_operations(PipelineScheduleKind::OneFOneB, 2, 0, 3);
  const std::vector<Op> expected0 = {{Op::Forward, 0},     {Op::SendForward, 0},  {Op::Forward, 1},
                                     {Op::SendForward, 1}, {Op::RecvBackward, 0}, {Op::Backward, 0},
                                     {Op::Forward, 2},     {Op::SendForward, 2},  {Op::RecvBackward, 1},
                                     {Op::Backward, 1},    {Op::RecvBackward, 2}, {Op::Backward, 2}};
  EXPECT_EQ(stage0, expected0);
  // The last stage (odd: receives first in an exchange) has no warm-up.
  const std::vector<Op> stage1 = pipeline_operations(PipelineScheduleKind::OneFOneB, 2, 1, 2);
  const std::vector<Op> expected1 = {{Op::RecvForward, 0}, {Op::Forward, 0},      {Op::Backward, 0},
                                     {Op::RecvForward, 1}, {Op::SendBackward, 0}, {Op::Forward, 1},
                                     {Op::Backward, 1},    {Op::SendBackward, 1}};
  EXPECT_EQ(stage1, expected1);
  EXPECT_ERROR_MENTIONS(pipeline_operations(PipelineScheduleKind::GPipe, 2, 2, 4), "stage 2", "pipeline of 2");
  EXPECT_ERROR_MENTIONS(pipeline_operations(PipelineScheduleKind::GPipe, 2, 0, 0), "at least one micro-batch");
}

TEST(PipelineSchedule, LossAndGradientsEqualOneProcessOnTheWholeBatch) {
  const Communicator world = Communicator::world();
  ASSERT_EQ(world.size(), 4) << "run under mpiexec -np 4";
  for (int P : {1, 2, 4}) {
    const Communicator pp = pipeline_of(P);
    const Communicator embedding = make_embedding_group(pp);
    EXPECT_EQ(embedding.size(), P == 1 ? 1 : (pp.rank() == 0 || pp.rank() == P - 1) ? 2 : 1);
    for (DType dtype : {DType::F64, DType::F32})
      for (PipelineScheduleKind kind : {PipelineScheduleKind::GPipe, PipelineScheduleKind::OneFOneB})
        for (int64_t M : {1, 2, 4, 8}) {
          PipelineOptions options;
          options.schedule = kind;
          check_stack_step(pp, embedding, dtype, options, M, 1.0,
                           std::string("pp ") + std::to_string(P) + " " + dtype_name(dtype) + " " +
                               to_string(kind) + " M " + std::to_string(M));
        }
  }
}

TEST(PipelineSchedule, TheLastStageBackpropagatesTheLossTimesTheAmpLossScale) {
  const Communicator pp = pipeline_of(4);
  const Communicator embedding = make_embedding_group(pp);
  for (PipelineScheduleKind kind : {PipelineScheduleKind::GPipe, PipelineScheduleKind::OneFOneB}) {
    PipelineOptions options;
    options.schedule = kind;
    options.loss_scale = 1024;  // a power of two: the scaled gradients are exactly 1024 times the reference's
    check_stack_step(pp, embedding, DType::F64, options, 4, 1024, std::string("loss_scale ") + to_string(kind));
    // A scale_loss hook (the MixedPrecisionOptimizer's): applied to each micro-batch's loss / M on the last
    // stage; the other stages call it once per run, to announce the scaled backward.
    int calls = 0;
    options.loss_scale = 1;
    options.scale_loss = [&calls](const Tensor& loss) {
      ++calls;
      return mul(loss, 8.0);
    };
    check_stack_step(pp, embedding, DType::F64, options, 4, 8, std::string("scale_loss ") + to_string(kind));
    EXPECT_EQ(calls, pp.rank() == pp.size() - 1 ? 4 : 1);
  }
}

TEST(PipelineSchedule, TrainsWithAMixedPrecisionOptimizerOnEveryStageLikeOneProcess) {
  // Three SGD steps under a GradScaler (scale 2^10): the last stage scales each micro-batch's loss through
  // the optimizer's scale_loss; the other stages' optimizers learn of the scaled backward from the hook's one
  // call, so step() accepts the gradients that arrived through the pipeline (and unscales them).
  const Tensor x = uniform_tensor({kBatch, kWidth}, 7, -1, 1, DType::F32);
  const Tensor target = uniform_tensor({kBatch, kWidth}, 8, -1, 1, DType::F32);
  GradScalerOptions scaler_options;
  scaler_options.init_scale = 1024;
  constexpr int kSteps = 3;
  Stack reference(DType::F32);
  std::vector<Tensor> all_params = {reference.tied->weight};
  for (const auto& layer : reference.layers) {
    all_params.push_back(layer->weight);
    all_params.push_back(layer->bias);
  }
  MixedPrecisionOptimizer ref_optimizer(std::make_unique<SGD>(all_params, 0.1),
                                        std::make_unique<GradScaler>(scaler_options));
  std::vector<double> ref_losses;
  for (int step = 0; step < kSteps; ++step) {
    const Tensor loss = reference.full_loss(x, target);
    ref_losses.push_back(loss.item());
    ref_optimizer.backward(loss);
    ref_optimizer.step();
  }

  for (int P : {2, 4}) {
    const Communicator pp = pipeline_of(P);
    const Communicator embedding = make_embedding_group(pp);
    const int s = pp.rank();
    Stack model(DType::F32);
    const int64_t per_stage = kLayers / P;
    std::vector<Tensor> params;
    if (s == 0 || s == P - 1) params.push_back(model.tied->weight);
    for (int64_t i = s * per_stage; i < (s + 1) * per_stage; ++i) {
      params.push_back(model.layers[size_t(i)]->weight);
      params.push_back(model.layers[size_t(i)]->bias);
    }
    CommunicatorGroup group(pp);  // the model-parallel group of this layout
    MixedPrecisionOptions amp_options;
    amp_options.group = &group;
    MixedPrecisionOptimizer optimizer(std::make_unique<SGD>(params, 0.1),
                                      std::make_unique<GradScaler>(scaler_options), amp_options);
    PipelineOptions options;
    options.scale_loss = [&optimizer](const Tensor& loss) { return optimizer.scale_loss(loss); };
    PipelineSchedule schedule(pp, options);
    StackStage stage(model, s, P, split_micro_batches(target, 4));
    for (int step = 0; step < kSteps; ++step) {
      const double loss = schedule.run(stage, split_micro_batches(x, 4));
      all_reduce_tied_gradients(model.tied->weight, embedding);
      const StepResult result = optimizer.step();
      EXPECT_FALSE(result.skipped) << "pp " << P << " step " << step;
      EXPECT_EQ(result.loss_scale, 1024) << "pp " << P << " step " << step;
      EXPECT_NEAR(loss, ref_losses[size_t(step)], 1e-5 * std::abs(ref_losses[size_t(step)])) << "pp " << P;
    }
    if (s == 0 || s == P - 1) {  // both copies of the tied weight took the same (summed) steps
      EXPECT_TRUE(all_close(model.tied->weight, reference.tied->weight, 1e-5, 1e-5)) << "pp " << P;
    }
    for (int64_t i = s * per_stage; i < (s + 1) * per_stage; ++i) {
      EXPECT_TRUE(all_close(model.layers[size_t(i)]->weight, reference.layers[size_t(i)]->weight, 1e-5, 1e-5))
          << "pp " << P << " layer " << i;
      EXPECT_TRUE(all_close(model.layers[size_t(i)]->bias, reference.layers[size_t(i)]->bias, 1e-5, 1e-5))
          << "pp " << P << " layer " << i;
    }
  }
}

// The GPT split by layers: embeddings and the first blocks on the first stage; the last blocks, ln_f, the
// logits through the tied wte weight and the cross-entropy on the last stage.
namespace {

class GPTStage : public PipelineStage {
 public:
  GPTStage(GPT& gpt, int stage, int num_stages, std::vector<Tensor> targets)
      : gpt_(gpt), stage_(stage), num_stages_(num_stages), targets_(std::move(targets)) {}
  Tensor forward(const Tensor& input, int64_t micro_batch) override {
    const int64_t per_stage = gpt_.config().n_layer / num_stages_;
    Tensor x = input;
    if (stage_ == 0) {
      const Tensor positions = Tensor::arange(0, double(input.size(1)), 1, DType::I64);
      x = (*gpt_.drop)(add((*gpt_.wte)(input), (*gpt_.wpe)(positions)));
    }
    for (int64_t i = stage_ * per_stage; i < (stage_ + 1) * per_stage; ++i) x = (*gpt_.h)[size_t(i)](x);
    if (stage_ != num_stages_ - 1) return x;
    x = (*gpt_.ln_f)(x);
    const Tensor logits = matmul(x, gpt_.wte->weight.mT());
    const Tensor& targets = targets_[size_t(micro_batch)];
    const int64_t rows = targets.numel();
    return softmax_cross_entropy(logits.view({rows, gpt_.config().vocab_size}), targets.reshape({rows}), -1);
  }

 private:
  GPT& gpt_;
  int stage_, num_stages_;
  std::vector<Tensor> targets_;
};

}  // namespace

TEST(PipelineSchedule, GPTSplitByLayersMatchesTheWholeModelWithTiedEmbeddings) {
  GPTConfig config;
  config.n_layer = 4;
  config.n_head = 2;
  config.n_embd = 8;
  config.block_size = 4;
  config.vocab_size = 11;
  const Tensor idx = Tensor::randint(0, config.vocab_size, {8, 4}, 21);
  const Tensor targets = Tensor::randint(0, config.vocab_size, {8, 4}, 22);
  GPT reference(config, 5);
  reference.to(DType::F64);
  const Tensor ref_loss = reference.forward(idx, targets).loss;
  backward(ref_loss);
  std::map<std::string, Tensor> ref_grads;
  for (const auto& [name, param] : reference.named_parameters()) ref_grads[name] = param.grad();

  for (int P : {2, 4}) {
    const Communicator pp = pipeline_of(P);
    const Communicator embedding = make_embedding_group(pp);
    const int s = pp.rank();
    for (PipelineScheduleKind kind : {PipelineScheduleKind::GPipe, PipelineScheduleKind::OneFOneB})
      for (int64_t M : {1, 4}) {
        GPT gpt(config, 5);
        gpt.to(DType::F64);
        GPTStage stage(gpt, s, P, split_micro_batches(targets, M));
        PipelineOptions options;
        options.schedule = kind;
        const double loss = PipelineSchedule(pp, options).run(stage, split_micro_batches(idx, M));
        all_reduce_tied_gradients(gpt.wte->weight, embedding);
        const std::string label = "pp " + std::to_string(P) + " " + to_string(kind) + " M " + std::to_string(M);
        EXPECT_NEAR(loss, ref_loss.item(), 1e-12) << label;
        const int64_t per_stage = config.n_layer / P;
        for (const auto& [name, param] : gpt.named_parameters()) {
          bool owned = false;
          if (name == "transformer.wte.weight") owned = s == 0 || s == P - 1;
          else if (name == "transformer.wpe.weight") owned = s == 0;
          else if (name.rfind("transformer.ln_f.", 0) == 0) owned = s == P - 1;
          else owned = std::stoi(name.substr(std::string("transformer.h.").size())) / per_stage == s;
          if (!owned) {
            EXPECT_FALSE(param.grad().defined()) << label << ": " << name;
            continue;
          }
          if (!param.grad().defined()) {
            ADD_FAILURE() << label << ": " << name << " has no gradient";
            continue;
          }
          EXPECT_TRUE(all_close(param.grad(), ref_grads.at(name), 1e-12, 1e-12)) << label << ": " << name;
        }
      }
  }
}

TEST(PipelineSchedule, ErrorsNameTheProblem) {
  EXPECT_ERROR_MENTIONS(split_micro_batches(Tensor::zeros({6, 3}), 4), "split_micro_batches", "4 micro-batches",
                        "do not divide", "[6,3]");
  EXPECT_ERROR_MENTIONS(split_micro_batches(Tensor::zeros({6, 3}), 0), "at least one micro-batch");
  const Communicator pp = pipeline_of(2);
  PipelineOptions bad;
  bad.loss_scale = 0;
  EXPECT_ERROR_MENTIONS(PipelineSchedule(pp, bad), "loss_scale", "positive");
  // Stages that disagree on the number of micro-batches fail together, before any send.
  Stack model(DType::F64);
  StackStage stage(model, pp.rank(), 2, split_micro_batches(Tensor::zeros({8, kWidth}, DType::F64), 4));
  const Tensor x = Tensor::zeros({8, kWidth}, DType::F64);
  EXPECT_ERROR_MENTIONS(PipelineSchedule(pp).run(stage, split_micro_batches(x, pp.rank() == 0 ? 4 : 2)),
                        "disagree on the number of micro-batches", "2..4");
  // Or on the schedule.
  PipelineOptions gpipe;
  gpipe.schedule = PipelineScheduleKind::GPipe;
  EXPECT_ERROR_MENTIONS(
      PipelineSchedule(pp, pp.rank() == 0 ? gpipe : PipelineOptions{}).run(stage, split_micro_batches(x, 4)),
      "disagree on the schedule");
  // The first stage needs every micro-batch's input.
  EXPECT_ERROR_MENTIONS(PipelineSchedule(pp).run(stage, std::vector<Tensor>(4)), "first stage needs the input");
}
