// bench_nccl: the collectives of dist::Communicator on CUDA tensors (the NCCL path), beside a device-to-device copy
// of the same bytes in the same run.
//
//   ./build/bench/bench_nccl                     # world size 1: NCCL's one-rank communicator (every collective
//                                                # still goes through NCCL: dist::nccl::set_single_rank_groups)
//   mpirun -np 8 ./build/bench/bench_nccl        # one GPU per rank
//
// For each dtype (f32, bf16) and size (1, 16, 128 MiB per rank) it times all_reduce (sum), all_gather,
// reduce_scatter (sum) and broadcast, and Tensor::copy_ of the same tensor (the baseline: it reads and writes
// the bytes once), each as the median of 20 iterations of 10 back-to-back calls between CUDA events
// (DeviceTimer), after a warm-up. Printed per row: time per call, the algorithm bandwidth (the tensor's bytes
// per second) and the bus bandwidth in NCCL's convention (all_reduce x 2 (n-1)/n, all_gather / reduce_scatter
// x (n-1)/n, broadcast x 1), which is 0 at n = 1: there the row shows what a call costs on top of moving nothing
// between ranks, and the copy column is the yardstick.
// Without a GPU, NCCL or MPI it prints why and exits with status 77.
#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "dist/communicator.h"
#include "dist/nccl.h"
#include "dist/world.h"
#include "tensor/backend.h"
#include "tensor/ops.h"
#include "tensor/timer.h"

using namespace mixtape;

namespace {

constexpr int kIterations = 20, kCallsPerIteration = 10;

// Seconds per call: the median over kIterations of kCallsPerIteration calls, after a warm-up.
double time_per_call(Device device, const std::function<void()>& call) {
  for (int i = 0; i < 3; ++i) call();
  DeviceTimer timer(device);
  std::vector<double> per_call;
  for (int i = 0; i < kIterations; ++i) {
    timer.start();
    for (int k = 0; k < kCallsPerIteration; ++k) call();
    timer.stop();
    per_call.push_back(timer.seconds() / kCallsPerIteration);
  }
  std::sort(per_call.begin(), per_call.end());
  return per_call[per_call.size() / 2];
}

int run(int argc, char** argv) {
  if (cuda_device_count() == 0) {
    std::printf("bench_nccl: no CUDA GPU here: nothing measured\n");
    return 77;
  }
  if (!dist::nccl::built()) {
    std::printf("bench_nccl: this build of mixtape has no NCCL: nothing measured\n");
    return 77;
  }
  const dist::World& world = dist::init(&argc, &argv);
  dist::nccl::set_single_rank_groups(true);  // at world size 1 too, every collective goes through NCCL
  const dist::Communicator comm = dist::Communicator::world();
  const Device device = dist::device();
  const int n = world.size;
  if (world.rank == 0)
    std::printf("bench_nccl: %d rank(s), %s\n%-8s %-6s %-15s %12s %14s %14s %10s\n", n,
                cuda_device_name(device.index).c_str(),
                "dtype", "MiB", "op", "us/call", "algo GB/s", "bus GB/s", "vs copy");
  for (DType dtype : {DType::F32, DType::BF16}) {
    for (int64_t mib : {1, 16, 128}) {
      const int64_t numel = mib * 1024 * 1024 / static_cast<int64_t>(dtype_size(dtype));
      const Tensor x = Tensor::ones({numel}, dtype).to(device);
      Tensor y = Tensor::empty({numel}, dtype, device);
      const double bytes = double(numel) * double(dtype_size(dtype));
      const double copy = time_per_call(device, [&] { y.copy_(x); });
      struct Row {
        const char* op;
        double bus_factor;
        std::function<void()> call;
      };
      const std::vector<Row> rows = {
          {"copy_", 1.0, [&] { y.copy_(x); }},
          {"all_reduce", 2.0 * (n - 1) / n, [&] { comm.all_reduce(x, dist::Reduction::Sum); }},
          {"all_gather", double(n - 1) / n, [&] { (void)comm.all_gather(x); }},
          {"reduce_scatter", double(n - 1) / n, [&] { (void)comm.reduce_scatter(x, dist::Reduction::Sum); }},
          {"broadcast", 1.0, [&] { comm.broadcast(x, 0); }}};
      for (const Row& row : rows) {
        const double t = row.op == std::string("copy_") ? copy : time_per_call(device, row.call);
        if (world.rank == 0)
          std::printf("%-8s %-6lld %-15s %12.1f %14.1f %14.1f %9.2fx\n", dtype_name(dtype),
                      static_cast<long long>(mib), row.op, t * 1e6, bytes / t / 1e9, bytes * row.bus_factor / t / 1e9,
                      copy / t);
      }
    }
  }
  if (world.rank == 0) std::printf("transport: %s\n", comm.cuda_transport().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return dist::run_or_abort(run, argc, argv); }
