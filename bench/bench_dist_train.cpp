// bench_dist_train: data parallelism on the CPU. The GPT training step (bench_train_gpt's model: 4 layers,
// 4 heads, width 256, block 128, vocab 65, global batch 16, AdamW, clipping at 1, constant lr) run three ways in
// the same job, in alternating rounds so that load from elsewhere hits every side alike:
//   one process, 1 thread       the per-core baseline
//   one process, N threads      what one process makes of the job's N cores (OpenMP + oneDNN threads)
//   DP N                        ParallelTrainer with dp = N, one thread per rank (local batch 16 / N), gradients
//                               averaged over MPI in fp32 buckets of --bucket-mb (default 1 MiB: the model's
//                               12.7 MB of fp32 gradients make 13 buckets, all-reduced during the backward)
//   DP N, one bucket            the same with every gradient in one bucket, all-reduced after the backward
// and prints tokens/s (the median step of each side), the scaling efficiency DP N / (N x one process, 1 thread),
// the speedup DP N / one process with N threads, and DP N / DP N with one bucket (what the overlap gains).
//
//   mpirun -np 2 --bind-to none ./build/bench/bench_dist_train [--rounds 3] [--steps 5] [--precision fp32]
//                                                               [--bucket-mb 1] [--json FILE]
// The one-process sides run as child processes of rank 0 (this binary with --single-child), each a fresh
// process: oneDNN fixes a primitive's thread count when it creates it, so one process cannot fairly time both
// thread counts. The other ranks wait without spinning meanwhile. Needs MPI (the target exists only in builds
// with it); as root, OpenMPI wants OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1.
#include <mpi.h>
#include <omp.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_training.h"
#include "dist/world.h"
#include "train/parallel_training.h"
#include "io/json.h"
#include "tensor/error.h"

using namespace mixtape;

namespace {

const bench::BenchModel kModel{4, 4, 256, 128, 65, 16};
constexpr double kLr = 1e-3;

struct Args {
  int rounds = 3;
  int steps = 5;  // timed steps per side and round (after one warm-up step)
  std::string precision = "fp32";
  double bucket_mb = 1.0;
  std::string json;
  bool single_child = false;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--single-child") {
      a.single_child = true;
      continue;
    }
    check(i + 1 < argc, "bench_dist_train: ", flag, " needs a value");
    const std::string value = argv[++i];
    if (flag == "--rounds") a.rounds = std::stoi(value);
    else if (flag == "--steps") a.steps = std::stoi(value);
    else if (flag == "--precision") a.precision = value;
    else if (flag == "--json") a.json = value;
    else if (flag == "--bucket-mb") a.bucket_mb = std::stod(value);
    else fail("bench_dist_train: unknown option ", flag,
              " (--rounds N --steps N --precision MODE --bucket-mb X --json FILE)");
  }
  check(a.rounds >= 1 && a.steps >= 1, "bench_dist_train: --rounds and --steps must be >= 1");
  return a;
}

// One warm-up step, then `n` timed ones (seconds each, appended).
template <class Step>
void time_steps(Step&& step, int n, std::vector<double>& seconds) {
  step();
  for (int i = 0; i < n; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    step();
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
}

// A barrier that waits without spinning (a blocking MPI_Barrier busy-polls a core that rank 0's baselines need).
void quiet_barrier() {
  MPI_Request request;
  MPI_Ibarrier(MPI_COMM_WORLD, &request);
  for (int done = 0; !done;) {
    MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (!done) ::usleep(2000);
  }
}

// --single-child: the one-process step at OMP_NUM_THREADS (set by the parent); prints the step times, one per line.
int single_child(const Args& args) {
  const TokenData data = bench::random_tokens(kModel.vocab, 400000);
  const auto trainer = bench::make_trainer(kModel, args.precision, kLr, Device::cpu(), data);
  std::vector<double> seconds;
  time_steps([&] { trainer->train_step(); }, args.steps, seconds);
  for (double s : seconds) std::printf("%.9f\n", s);
  return 0;
}

void run_child(const Args& args, int threads, std::vector<double>& seconds) {
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  check(n > 0, "bench_dist_train: cannot find its own executable");
  self[n] = 0;
  const std::string command = "OMP_NUM_THREADS=" + std::to_string(threads) + " '" + std::string(self) +
                              "' --single-child --steps " + std::to_string(args.steps) + " --precision " +
                              args.precision;
  std::string out;
  int status = 0;
  check(bench::run_command(command, out, status) && bench::exited_with(status, 0),
        "bench_dist_train: the one-process run failed: ", command, "\n", out);
  std::istringstream lines(out);
  for (double s; lines >> s;) seconds.push_back(s);
}

int run(int argc, char** argv) {
  const Args args = parse(argc, argv);
  if (args.single_child) return single_child(args);
  const dist::World& world = dist::init(&argc, &argv);
  const int N = world.size;
  check(kModel.batch % N == 0, "bench_dist_train: the global batch ", kModel.batch, " must be divisible by the ",
        N, " ranks");
  omp_set_num_threads(1);
  const TokenData data = bench::random_tokens(kModel.vocab, 400000);
  const auto [config, options] = bench::trainer_setup(kModel, args.precision, kLr, Device::cpu());
  ParallelOptions layout;
  layout.dp = N;
  layout.bucket_mb = args.bucket_mb;
  ParallelTrainer parallel(config, options, layout, data, dist::Communicator::world());
  layout.bucket_mb = 1e6;  // every gradient in one bucket, reduced once the backward is over
  ParallelTrainer one_bucket(config, options, layout, data, dist::Communicator::world());

  std::vector<double> single1, singleN, dp, dp_one;
  for (int r = 0; r < args.rounds; ++r) {
    quiet_barrier();
    if (world.rank == 0) {
      run_child(args, 1, single1);
      run_child(args, N, singleN);
    }
    quiet_barrier();
    time_steps([&] { parallel.train_step(); }, args.steps, dp);
    time_steps([&] { one_bucket.train_step(); }, args.steps, dp_one);
  }
  const int64_t overlapped = parallel.buckets_overlapped();
  if (world.rank != 0) return 0;

  const double tokens = double(kModel.tokens_per_step());
  const double tps1 = tokens / bench::median(single1), tpsN = tokens / bench::median(singleN);
  const double tpsdp = tokens / bench::median(dp), tpsone = tokens / bench::median(dp_one);
  const double efficiency = tpsdp / (N * tps1), speedup = tpsdp / tpsN, overlap_gain = tpsdp / tpsone;
  std::printf("bench_dist_train: GPT 4x256 block 128, global batch 16, %s, %d ranks, %d rounds x %d steps\n",
              args.precision.c_str(), N, args.rounds, args.steps);
  std::printf("  one process, 1 thread      %8.0f tokens/s\n", tps1);
  std::printf("  one process, %d threads     %8.0f tokens/s\n", N, tpsN);
  std::printf("  DP %d, 1 thread per rank    %8.0f tokens/s  (%.3g MiB buckets, %lld all-reduced during the "
              "backward)\n", N, tpsdp, args.bucket_mb, static_cast<long long>(overlapped));
  std::printf("  DP %d, one bucket           %8.0f tokens/s  (all-reduced after the backward)\n", N, tpsone);
  std::printf("  scaling efficiency: DP %d / (%d x one process with 1 thread) = %.2f\n", N, N, efficiency);
  std::printf("  speedup: DP %d / one process with %d threads = %.2f\n", N, N, speedup);
  std::printf("  overlap: DP %d / DP %d with one bucket = %.3f\n", N, N, overlap_gain);
  if (!args.json.empty()) {
    const Json o = Json::object({{"ranks", int64_t{N}},
                                {"precision", args.precision},
                                {"tokens_per_s_one_process_1_thread", tps1},
                                {"tokens_per_s_one_process_n_threads", tpsN},
                                {"tokens_per_s_dp", tpsdp},
                                {"bucket_mb", args.bucket_mb},
                                {"buckets_all_reduced_during_backward", overlapped},
                                {"tokens_per_s_dp_one_bucket", tpsone},
                                {"overlap_gain", overlap_gain},
                                {"scaling_efficiency", efficiency},
                                {"speedup_vs_one_process_n_threads", speedup}});
    std::ofstream out(args.json);
    out << json::dump(o) << '\n';
    check(out.good(), "bench_dist_train: cannot write '", args.json, "'");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return dist::run_or_abort(run, argc, argv); }
