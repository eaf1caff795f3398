// NaiveAMPModel's sync_buffer over a real data-parallel group (4 MPI ranks): InternEvo's
// _reduce_module_buffer averages every floating buffer over dp before a training forward and at the first
// eval forward after training. tests/test_naive_amp.cpp checks the rule against a fake group; here the sums
// travel through MPI, through the CommunicatorGroup that train_gpt hands Booster
// (BoostOptions::data_parallel_group) and NaiveAMPModel.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "amp/booster.h"
#include "amp/naive_amp.h"
#include "autograd/autograd.h"
#include "dist/communicator.h"
#include "dist/process_group.h"
#include "nn/layers.h"
#include "optim/adam.h"
#include "tensor/ops.h"

using namespace mixtape;
using namespace mixtape::dist;

namespace {

// A Linear layer plus a floating running statistic and an integer step count, as a norm layer with running
// statistics would hold them.
class RunningModule : public UnaryModule {
 public:
  RunningModule() {
    linear = register_module("linear", std::make_shared<Linear>(3, 3, true, 11));
    running = Tensor::zeros({3});
    register_buffer("running", running);
    steps = Tensor::zeros({1}, DType::I64);
    register_buffer("steps", steps);
  }
  Tensor forward(const Tensor& x) override { return (*linear)(x); }
  std::shared_ptr<Linear> linear;
  Tensor running;
  Tensor steps;
};

// Rank r holds r + 0.25 * i in element i (exact in fp16 and bf16) and 10 * r in its step count.
void fill_by_rank(RunningModule& model, int rank) {
  NoGradGuard no_grad;
  const DType dtype = model.running.dtype();
  model.running.copy_(Tensor::from_vector(std::vector<double>{rank + 0.0, rank + 0.25, rank + 0.5}, {3})
                          .to(dtype));
  model.steps.fill_(10.0 * rank);
}

// The mean over ranks 0..size-1 of rank + 0.25 * i.
std::vector<double> expected_mean(int size) {
  const double mean_rank = (size - 1) / 2.0;
  return {mean_rank, mean_rank + 0.25, mean_rank + 0.5};
}

TEST(NaiveAmpBuffers, AveragedOverTheWorldAtATrainingForwardAndAtTheFirstEvalForwardAfterIt) {
  const Communicator world = Communicator::world();
  CommunicatorGroup group(world);
  const Tensor x = Tensor::ones({2, 3});
  for (const char* dtype : {"fp16", "bf16"}) {
    SCOPED_TRACE(dtype);
    RunningModule model;
    NaiveAMPModel amp(model, {.dtype = dtype, .group = &group});
    fill_by_rank(model, world.rank());
    amp(x);  // training: the buffers are averaged before the forward
    EXPECT_EQ(model.running.to_vector<double>(), expected_mean(world.size()));
    // An integer buffer is left alone.
    EXPECT_EQ(model.steps.to_vector<int64_t>(), std::vector<int64_t>{10 * world.rank()});

    fill_by_rank(model, world.rank());
    model.eval();
    amp(x);  // the first eval forward after training syncs once more ...
    EXPECT_EQ(model.running.to_vector<double>(), expected_mean(world.size()));
    fill_by_rank(model, world.rank());
    amp(x);  // ... and the next one does not
    EXPECT_EQ(model.running.to_vector<double>()[0], world.rank());
  }
}

TEST(NaiveAmpBuffers, BoosterNaiveModesAverageThroughTheBoostGroup) {
  const Communicator world = Communicator::world();
  CommunicatorGroup group(world);
  const Tensor x = Tensor::ones({2, 3});
  for (const char* mode : {"fp16_naive", "bf16_naive"}) {
    SCOPED_TRACE(mode);
    RunningModule model;
    Booster booster(AmpConfig::parse(mode));
    const auto optimizer = booster.boost(model, std::make_unique<Adam>(model.parameters(), 1e-3),
                                   {.data_parallel_group = &group});
    fill_by_rank(model, world.rank());
    const std::vector<Tensor> out =
        booster.forward([&model](const std::vector<Tensor>& in) { return std::vector<Tensor>{model(in[0])}; },
                        {x});
    EXPECT_EQ(model.running.dtype(), mode[0] == 'f' ? DType::F16 : DType::BF16);
    EXPECT_EQ(model.running.to_vector<double>(), expected_mean(world.size()));
    EXPECT_EQ(out[0].dtype(), DType::F32);  // output_to_fp32
  }
}

}  // namespace
