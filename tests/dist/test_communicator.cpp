// Communicator and the tp x pp x dp groups under MPI (4 ranks). Each rank's input is a function of its rank,
// so every rank knows what the collective must produce.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "amp/optimizer.h"
#include "amp/scaler.h"
#include "autograd/autograd.h"
#include "dist/groups.h"
#include "dist/process_group.h"
#include "dist/world.h"
#include "optim/sgd.h"
#include "tensor/ops.h"
#include "../test_util.h"

using namespace mixtape;
using namespace mixtape::dist;

namespace {

// Rank r's tensor: element i = (r + 1) * (i + 1) / 8 (exact in every float dtype for these sizes).
Tensor rank_tensor(int rank, int64_t n, DType dtype) {
  std::vector<double> values(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) values[static_cast<size_t>(i)] = (rank + 1) * (i + 1) / 8.0;
  return Tensor::from_vector(values, {n}).to(dtype);
}

}  // namespace

TEST(Communicator, AllReduceSumsAndMaxesInEveryDtype) {
  const Communicator world = Communicator::world();
  const int n = world.size();
  for (DType dtype : {DType::F32, DType::F64, DType::F16, DType::BF16}) {
    Tensor t = rank_tensor(world.rank(), 5, dtype);
    world.all_reduce(t, Reduction::Sum);
    Tensor m = rank_tensor(world.rank(), 5, dtype);
    world.all_reduce(m, Reduction::Max);
    const std::vector<double> sum = t.to_vector<double>(), max = m.to_vector<double>();
    for (int i = 0; i < 5; ++i) {
      EXPECT_EQ(sum[i], n * (n + 1) / 2.0 * (i + 1) / 8.0) << dtype_name(dtype);
      EXPECT_EQ(max[i], n * (i + 1) / 8.0) << dtype_name(dtype);
    }
  }
  std::vector<double> values = {double(world.rank()), 1.0};
  world.all_reduce(values, Reduction::Sum);
  EXPECT_EQ(values, (std::vector<double>{n * (n - 1) / 2.0, double(n)}));
}

TEST(Communicator, SixteenBitSumsRoundOnceFromFp32) {
  // 1 + 2^-7 on every rank (exact in bf16). Summed in bf16 step by step, each partial sum would be rounded;
  // widened to fp32, the n values add exactly and the result is rounded once: n (1 + 2^-7) rounded to bf16.
  const Communicator world = Communicator::world();
  const int n = world.size();
  Tensor ones = Tensor::full({3}, 1.0 + std::ldexp(1.0, -7), DType::BF16);
  world.all_reduce(ones, Reduction::Sum);
  const double expected = Tensor::scalar(n * (1.0 + std::ldexp(1.0, -7)), DType::F64).to(DType::BF16).item();
  EXPECT_EQ(ones.to_vector<double>()[0], expected);
}

TEST(Communicator, AllGatherReduceScatterBroadcastSendRecv) {
  const Communicator world = Communicator::world();
  const int n = world.size(), r = world.rank();
  // all_gather stacks rank i's [2] tensor as rows 2i, 2i+1.
  const Tensor gathered = world.all_gather(rank_tensor(r, 2, DType::F32));
  ASSERT_EQ(gathered.shape(), (Shape{2 * n}));
  const std::vector<float> g = gathered.to_vector<float>();
  for (int i = 0; i < n; ++i) {
    EXPECT_EQ(g[2 * i], (i + 1) / 8.0f);
    EXPECT_EQ(g[2 * i + 1], (i + 1) * 2 / 8.0f);
  }
  // reduce_scatter: rank r keeps chunk r of the sum.
  const Tensor chunk = world.reduce_scatter(rank_tensor(r, 2 * n, DType::F64), Reduction::Sum);
  ASSERT_EQ(chunk.shape(), (Shape{2}));
  for (int i = 0; i < 2; ++i) EXPECT_EQ(chunk.to_vector<double>()[i], n * (n + 1) / 2.0 * (2 * r + i + 1) / 8.0);
  // broadcast from the last rank.
  Tensor b = rank_tensor(r, 3, DType::BF16);
  world.broadcast(b, n - 1);
  EXPECT_EQ(b.to_vector<double>(), rank_tensor(n - 1, 3, DType::BF16).to_vector<double>());
  // A ring: everyone sends to the next rank and receives from the previous one (even ranks send first).
  const Tensor mine = rank_tensor(r, 4, DType::F16);
  Tensor got = Tensor::empty({4}, DType::F16);
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  if (r % 2 == 0) {
    world.send(mine, next);
    world.recv(got, prev);
  } else {
    world.recv(got, prev);
    world.send(mine, next);
  }
  EXPECT_EQ(got.to_vector<double>(), rank_tensor(prev, 4, DType::F16).to_vector<double>());
}

TEST(Communicator, MismatchedTensorsAreAnErrorOnEveryRank) {
  const Communicator world = Communicator::world();
  Tensor t = Tensor::zeros({world.rank() == 0 ? 3 : 4});
  EXPECT_ERROR_MENTIONS(world.all_reduce(t, Reduction::Sum), "the ranks disagree", "element counts 3..4");
  Tensor wrong_dtype = Tensor::zeros({4}, world.rank() == 1 ? DType::F64 : DType::F32);
  EXPECT_ERROR_MENTIONS(world.broadcast(wrong_dtype, 0), "the ranks disagree", "dtype codes");
  EXPECT_ERROR_MENTIONS(world.all_reduce(Tensor::zeros({4, 4}).mT(), Reduction::Sum), "is not contiguous");
}

// all_reduce_start: several collectives in flight at once (blocking ones between them), completed by polling,
// by wait() or by the destructor, with the blocking all_reduce's results (16-bit values rounded once from fp32).
TEST(Communicator, NonBlockingAllReduceEqualsTheBlockingOne) {
  const Communicator world = Communicator::world();
  const int r = world.rank();
  std::vector<Tensor> tensors, expected;
  std::vector<PendingCollective> pending;
  for (DType dtype : {DType::F32, DType::F16, DType::F64, DType::BF16}) {
    for (Reduction op : {Reduction::Sum, Reduction::Max}) {
      Tensor want = rank_tensor(r, 1000, dtype);
      world.all_reduce(want, op);
      expected.push_back(want);
      tensors.push_back(rank_tensor(r, 1000, dtype));
      pending.push_back(world.all_reduce_start(tensors.back(), op));
      EXPECT_TRUE(pending.back().in_flight());
    }
  }
  Tensor ones = Tensor::full({3}, 1.0 + std::ldexp(1.0, -7), DType::BF16);
  {
    PendingCollective in_scope = world.all_reduce_start(ones, Reduction::Sum);
  }  // waited for by the destructor
  EXPECT_EQ(ones.to_vector<double>()[0],
            Tensor::scalar(world.size() * (1.0 + std::ldexp(1.0, -7)), DType::F64).to(DType::BF16).item());
  while (!pending[0].test()) {
  }
  EXPECT_FALSE(pending[0].in_flight());
  EXPECT_TRUE(pending[0].test());  // complete: stays complete
  for (size_t i = 0; i < pending.size(); ++i) {
    pending[i].wait();
    EXPECT_EQ(tensors[i].to_vector<double>(), expected[i].to_vector<double>()) << "collective " << i;
  }
  Tensor t = Tensor::zeros({r == 0 ? 3 : 4});
  EXPECT_ERROR_MENTIONS(world.all_reduce_start(t, Reduction::Sum), "all_reduce_start", "the ranks disagree");
}

TEST(ParallelGroups, RanksAreLaidOutTpFirstThenDpThenPp) {
  const Communicator world = Communicator::world();
  ASSERT_EQ(world.size(), 4) << "run under mpiexec -np 4";
  const ParallelGroups g = make_groups({2, 2, 1});  // tp 2, pp 2
  const int r = world.rank();
  EXPECT_EQ(g.tp_rank, r % 2);
  EXPECT_EQ(g.pp_rank, r / 2);
  EXPECT_EQ(g.tp.size(), 2);
  EXPECT_EQ(g.pp.size(), 2);
  EXPECT_EQ(g.dp.size(), 1);
  EXPECT_EQ(g.model_parallel.size(), 4);
  // A sum over the tensor-parallel group adds the two adjacent ranks only.
  std::vector<double> v = {double(r)};
  g.tp.all_reduce(v, Reduction::Sum);
  EXPECT_EQ(v[0], (r / 2) * 4 + 1);
  const ParallelGroups d = make_groups({2, 1, 2});  // tp 2, dp 2
  EXPECT_EQ(d.dp_rank, r / 2);
  std::vector<double> w = {double(r)};
  d.dp.all_reduce(w, Reduction::Sum);
  EXPECT_EQ(w[0], (r % 2) * 2 + 2);  // ranks r % 2 and r % 2 + 2
  EXPECT_EQ(d.model_parallel.size(), 2);
  EXPECT_ERROR_MENTIONS(make_groups({2, 2, 2}), "tp 2 x pp 2 x dp 2 = 8 ranks, but the job has 4");
}

TEST(DistributedAmp, AnInfOnOneRankMakesEveryRankSkipAndBackOff) {
  // Each rank has its own parameter (as tensor-parallel shards do); rank 1's gradient overflows. With the
  // model-parallel group, found_inf is all-reduced: every rank skips the step and halves its scale alike.
  const Communicator world = Communicator::world();
  CommunicatorGroup group(world);
  Tensor w = Tensor::ones({4}, DType::F16).requires_grad_();
  MixedPrecisionOptions options;
  options.group = &group;
  MixedPrecisionOptimizer optimizer(std::make_unique<SGD>(std::vector<Tensor>{w}, 0.1),
                                    std::make_unique<GradScaler>(), options);
  const double scale_before = optimizer.loss_scale();
  // d loss / d w = 1/64 per element: scaled by 65536 it is 1024, well inside fp16 — except on rank 1.
  optimizer.backward(sum(w.to(DType::F32) * (world.rank() == 1 ? INFINITY : 1.0 / 64)));
  const StepResult result = optimizer.step();
  EXPECT_TRUE(result.skipped) << "rank " << world.rank();
  EXPECT_EQ(optimizer.loss_scale(), scale_before / 2);
  EXPECT_EQ(w.to_vector<double>(), (std::vector<double>{1, 1, 1, 1}));
  // The next step is finite everywhere: every rank steps (the control that the skip above was the inf's).
  optimizer.zero_grad();
  optimizer.backward(sum(w.to(DType::F32) * (1.0 / 64)));
  EXPECT_FALSE(optimizer.step().skipped) << "rank " << world.rank();
  EXPECT_NE(w.to_vector<double>()[0], 1.0);
}
