// The Communicator on CUDA tensors (dist/nccl.h): every result is compared with the same collective on CPU
// tensors (the MPI path) or with what each rank can compute itself. Each test skips, on every rank alike, on
// a machine without a GPU (all ranks of these tests run on one machine).
//
// Which path runs depends on the machine: with one GPU per rank the 4-rank world uses NCCL; with fewer GPUs
// than ranks (the usual test machine: 4 ranks on one GPU) NCCL refuses the duplicate GPUs and the world keeps
// the host path, so the tests also run one-rank groups through NCCL (nccl::set_single_rank_groups), which
// exercises every NCCL call except send/recv on any machine with a GPU. Rank 0 prints which path ran.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "dist/communicator.h"
#include "dist/nccl.h"
#include "dist/world.h"
#include "tensor/backend.h"
#include "tensor/ops.h"
#include "../test_util.h"

using namespace mixtape;
using namespace mixtape::dist;

namespace {

// Every rank sees the same device count (one machine), so every rank skips alike, before any collective.
#define MIXTAPE_REQUIRE_CUDA_ON_EVERY_RANK()                                                                  \
  do {                                                                                                        \
    if (::mixtape::cuda_device_count() == 0)                                                                  \
      GTEST_SKIP() << "no CUDA GPU here (or mixtape built without CUDA): this NCCL/CUDA test did not run";   \
    ::mixtape::set_cuda_allocation_poisoning(true);                                                           \
  } while (0)

// Rank r's tensor: element i = (r + 1) * (i + 1) / 8 for floats, (r + 1) * (i + 1) for integers: sums and maxima
// over 4 ranks are exact in every dtype, whatever the order of the additions.
Tensor rank_tensor(int rank, int64_t n, DType dtype) {
  const bool integer = dtype == DType::I32 || dtype == DType::I64;
  std::vector<double> values(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) values[static_cast<size_t>(i)] = (rank + 1) * (i + 1) / (integer ? 1.0 : 8.0);
  return Tensor::from_vector(values, {n}).to(dtype);
}

std::vector<double> values_of(const Tensor& t) {
  return t.to(Device::cpu()).to(DType::F64).to_vector<double>();
}

void print_transport(const Communicator& c) {
  if (Communicator::world().rank() == 0)
    std::printf("[ transport ] %s: CUDA tensors via %s (NCCL %s)\n", c.name().c_str(), c.cuda_transport().c_str(),
                nccl::version().c_str());
}

const std::vector<DType> kAllDtypes = {DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64};

// Runs every collective on CUDA tensors and on the same CPU tensors, expecting identical results (inputs are
// exact in every dtype).
void expect_collectives_match_cpu(const Communicator& c) {
  const Device gpu = dist::device();
  const int n = c.size(), r = c.rank();
  for (DType dtype : kAllDtypes) {
    for (Reduction op : {Reduction::Sum, Reduction::Max}) {
      Tensor on_gpu = rank_tensor(r, 7, dtype).to(gpu);
      Tensor on_cpu = rank_tensor(r, 7, dtype);
      c.all_reduce(on_gpu, op);
      c.all_reduce(on_cpu, op);
      EXPECT_TRUE(on_gpu.device() == gpu);
      EXPECT_EQ(values_of(on_gpu), values_of(on_cpu)) << "all_reduce " << dtype_name(dtype) << " on " << c.name();
      // Non-blocking (over NCCL on the group's own stream), with a blocking collective of the same group queued
      // while it is in flight, and polled before the wait.
      Tensor async = rank_tensor(r, 7, dtype).to(gpu);
      PendingCollective pending = c.all_reduce_start(async, op);
      Tensor between = rank_tensor(r, 3, dtype).to(gpu);
      c.all_reduce(between, op);
      (void)pending.test();
      pending.wait();
      EXPECT_FALSE(pending.in_flight());
      EXPECT_EQ(values_of(async), values_of(on_cpu)) << "all_reduce_start " << dtype_name(dtype) << " on " << c.name();
      Tensor between_cpu = rank_tensor(r, 3, dtype);
      c.all_reduce(between_cpu, op);
      EXPECT_EQ(values_of(between), values_of(between_cpu)) << "all_reduce behind all_reduce_start";
    }
    // all_gather of [2, 3]: [2n, 3].
    const Tensor g_gpu = c.all_gather(rank_tensor(r, 6, dtype).reshape({2, 3}).to(gpu));
    const Tensor g_cpu = c.all_gather(rank_tensor(r, 6, dtype).reshape({2, 3}));
    EXPECT_EQ(g_gpu.shape(), (Shape{2 * n, 3}));
    EXPECT_TRUE(g_gpu.device() == gpu);
    EXPECT_EQ(values_of(g_gpu), values_of(g_cpu)) << "all_gather " << dtype_name(dtype);
    // reduce_scatter of [2n, 2]: this rank's [2, 2] chunk of the sum.
    const Tensor s_gpu = c.reduce_scatter(rank_tensor(r, 4 * n, dtype).reshape({2 * n, 2}).to(gpu), Reduction::Sum);
    const Tensor s_cpu = c.reduce_scatter(rank_tensor(r, 4 * n, dtype).reshape({2 * n, 2}), Reduction::Sum);
    EXPECT_EQ(s_gpu.shape(), (Shape{2, 2}));
    EXPECT_TRUE(s_gpu.device() == gpu);
    EXPECT_EQ(values_of(s_gpu), values_of(s_cpu)) << "reduce_scatter " << dtype_name(dtype);
    // broadcast from the last rank.
    Tensor b = rank_tensor(r, 5, dtype).to(gpu);
    c.broadcast(b, n - 1);
    EXPECT_EQ(values_of(b), values_of(rank_tensor(n - 1, 5, dtype))) << "broadcast " << dtype_name(dtype);
  }
}

}  // namespace

TEST(Nccl, CollectivesOnTheWorldMatchTheCpuPath) {
  MIXTAPE_REQUIRE_CUDA_ON_EVERY_RANK();
  const Communicator world = Communicator::world();
  expect_collectives_match_cpu(world);
  print_transport(world);
  if (!nccl::built()) {
    EXPECT_EQ(world.cuda_transport(), "host: this build of mixtape has no NCCL");
  } else if (world.size() == 1) {
    EXPECT_EQ(world.cuda_transport(), "none: a group of one rank moves nothing");
  } else if (std::getenv("MIXTAPE_NCCL") == nullptr) {
    // NCCL exactly when every rank has its own GPU (this test runs all ranks on one machine).
    EXPECT_EQ(world.cuda_transport() == "nccl", cuda_device_count() >= world.size()) << world.cuda_transport();
  }
}

TEST(Nccl, CollectivesInGroupsOfTwoMatchTheCpuPath) {
  MIXTAPE_REQUIRE_CUDA_ON_EVERY_RANK();
  const Communicator world = Communicator::world();
  const Communicator pair = world.split(world.rank() / 2, world.rank(), "pair group");
  expect_collectives_match_cpu(pair);
  print_transport(pair);
}

TEST(Nccl, OneRankGroupsRunEveryCollectiveThroughNccl) {
  // NCCL with one rank per communicator works on any GPU count: each rank's group is itself.
  MIXTAPE_REQUIRE_CUDA_ON_EVERY_RANK();
  const Communicator world = Communicator::world();
  struct SingleRankGroups {  // on for this test only, also when it fails
    SingleRankGroups() { nccl::set_single_rank_groups(true); }
    ~SingleRankGroups() { nccl::set_single_rank_groups(false); }
  } single_rank_groups;
  const Communicator alone = world.split(world.rank(), 0, "one-rank group");
  expect_collectives_match_cpu(alone);
  print_transport(alone);
  if (nccl::built()) {
    EXPECT_EQ(alone.cuda_transport(), "nccl");
  }
  // Large enough for NCCL to split it into many chunks, with an odd size.
  const Tensor x = Tensor::randn({(1 << 20) + 3}, 7 + static_cast<uint64_t>(world.rank()), DType::F32, dist::device());
  Tensor y = x.clone();
  alone.all_reduce(y, Reduction::Sum);
  EXPECT_EQ(values_of(y), values_of(x));
}

TEST(Nccl, LargeSumsMatchTheCpuPathWithinRounding) {
  // Random values: NCCL may add in another order than MPI (fp32: rel 1e-5), and reduces fp16/bf16 in their
  // own type, each partial sum rounded: positive inputs keep every partial sum below the total, so the result
  // is within (size - 1) roundings, i.e. size - 1 ulp, of the exact sum (the host path: within one rounding).
  MIXTAPE_REQUIRE_CUDA_ON_EVERY_RANK();
  const Communicator world = Communicator::world();
  const int64_t count = 100003;
  for (DType dtype : {DType::F32, DType::F16, DType::BF16}) {
    // Every rank's input (exact in dtype), summed in f64.
    Tensor exact = Tensor::zeros({count}, DType::F64);
    for (int rank = 0; rank < world.size(); ++rank)
      exact = exact + mixtape::testing::uniform_tensor({count}, 100 + rank, 0.5, 1.0, dtype).to(DType::F64);
    Tensor on_gpu = mixtape::testing::uniform_tensor({count}, 100 + world.rank(), 0.5, 1.0, dtype).to(dist::device());
    world.all_reduce(on_gpu, Reduction::Sum);
    const Tensor got = on_gpu.to(Device::cpu());
    if (dtype == DType::F32)
      EXPECT_TRUE(mixtape::testing::all_close(got, exact.to(DType::F32), 0, 1e-5));
    else
      EXPECT_TRUE(mixtape::testing::within_ulp(got, exact, world.size() - 1)) << dtype_name(dtype);
  }
}

TEST(Nccl, SendRecvMoveCudaTensors) {
  MIXTAPE_REQUIRE_CUDA_ON_EVERY_RANK();
  const Communicator world = Communicator::world();
  if (world.size() < 2) GTEST_SKIP() << "a transfer between ranks needs at least 2 ranks; this run has 1";
  const Device gpu = dist::device();
  const int n = world.size(), r = world.rank();
  // A ring over the world (per-pair NCCL communicators): even ranks send first.
  for (DType dtype : {DType::F32, DType::BF16, DType::I64}) {
    const Tensor mine = rank_tensor(r, 9, dtype).to(gpu);
    Tensor got = Tensor::empty({9}, dtype, gpu);
    const int next = (r + 1) % n, prev = (r + n - 1) % n;
    if (r % 2 == 0) {
      world.send(mine, next, 3);
      world.recv(got, prev, 3);
    } else {
      world.recv(got, prev, 3);
      world.send(mine, next, 3);
    }
    EXPECT_EQ(values_of(got), values_of(rank_tensor(prev, 9, dtype))) << dtype_name(dtype);
  }
  // Within groups of two (the group's own communicator), both directions, as a pipeline's activations and
  // gradients go.
  const Communicator pair = world.split(r / 2, r, "pipeline pair");
  Tensor back = Tensor::empty({2, 4}, DType::F16, gpu);
  if (pair.rank() == 0) {
    pair.send(rank_tensor(r, 8, DType::F16).reshape({2, 4}).to(gpu), 1);
    pair.recv(back, 1);
    EXPECT_EQ(values_of(back), values_of(rank_tensor(r + 1, 8, DType::F16)));
  } else {
    pair.recv(back, 0);
    EXPECT_EQ(values_of(back), values_of(rank_tensor(r - 1, 8, DType::F16)));
    pair.send(rank_tensor(r, 8, DType::F16).reshape({2, 4}).to(gpu), 0);
  }
}

TEST(Nccl, MismatchedTransfersAreAnErrorOnBothEnds) {
  MIXTAPE_REQUIRE_CUDA_ON_EVERY_RANK();
  const Communicator world = Communicator::world();
  if (world.size() < 2) GTEST_SKIP() << "a transfer between ranks needs at least 2 ranks; this run has 1";
  const Device gpu = dist::device();
  const int r = world.rank();
  // Ranks 0 and 1 (2 and 3 alike): the sender sends 3 elements, the receiver expects 4.
  if (r % 2 == 0) {
    EXPECT_ERROR_MENTIONS(world.send(Tensor::zeros({3}, DType::F32, gpu), r + 1), "dist::send", "expects 4 elements");
  } else {
    Tensor into = Tensor::empty({4}, DType::F32, gpu);
    EXPECT_ERROR_MENTIONS(world.recv(into, r - 1), "dist::recv", "sends 3 elements");
  }
  // Both ends sending to each other.
  EXPECT_ERROR_MENTIONS(world.send(Tensor::zeros({3}, DType::F32, gpu), r ^ 1), "are both sending to");
  EXPECT_ERROR_MENTIONS(world.send(Tensor::zeros({1}, DType::F32, gpu), r ^ 1, 32767), "reserved");
  // Tensors that disagree in dtype across the group: an Error on every rank, before any NCCL call.
  Tensor t = Tensor::zeros({4}, r == 1 ? DType::F64 : DType::F32, gpu);
  EXPECT_ERROR_MENTIONS(world.all_reduce(t, Reduction::Sum), "the ranks disagree", "dtype codes");
  // The group still works afterwards.
  Tensor ok = rank_tensor(r, 3, DType::F32).to(gpu);
  world.all_reduce(ok, Reduction::Max);
  EXPECT_EQ(values_of(ok), values_of(rank_tensor(world.size() - 1, 3, DType::F32)));
}

TEST(Nccl, GroupsMixingCpuAndCudaTensorsTakeTheHostPath) {
  MIXTAPE_REQUIRE_CUDA_ON_EVERY_RANK();
  const Communicator world = Communicator::world();
  const int r = world.rank(), n = world.size();
  Tensor t = rank_tensor(r, 5, DType::F32);
  if (r % 2 == 1) t = t.to(dist::device());
  world.all_reduce(t, Reduction::Sum);
  EXPECT_EQ(t.device().is_cuda(), r % 2 == 1);
  std::vector<double> expected;
  for (int i = 0; i < 5; ++i) expected.push_back(n * (n + 1) / 2.0 * (i + 1) / 8.0);
  EXPECT_EQ(values_of(t), expected);
}
