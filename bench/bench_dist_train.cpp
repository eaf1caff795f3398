// bench_dist_train: data parallelism on the CPU. The GPT training step (bench_train_gpt's model: 4 layers,
// 4 heads, width 256, block 128, vocab 65, global batch 16, AdamW, clipping at 1) run three ways in the same job,
// in alternating rounds so that load from elsewhere hits every side alike:
//   one process, 1 thread       rank 0 alone (the other ranks wait), OMP threads 1: the per-core baseline
//   one process, N threads      rank 0 alone with the job's N cores as OpenMP threads: what one process makes of
//                               the same cores
//   DP N                        ParallelTrainer with dp = N (every rank 1 thread, local batch 16 / N), gradients
//                               averaged over MPI in fp32 buckets
// and prints tokens/s (median step of each side), the scaling efficiency DP N / (N x one process, 1 thread) and
// the speedup DP N / one process, N threads.
//
//   mpirun -np 2 --bind-to none ./build/bench/bench_dist_train [--rounds 3] [--steps 5] [--precision fp32]
//                                                               [--json FILE]
// Needs MPI (the target exists only in builds with it). Run as root: OMPI_ALLOW_RUN_AS_ROOT=1
// OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "dist/world.h"
#include "examples/parallel_training.h"
#include "examples/training.h"
#include "nn/json.h"
#include "tensor/error.h"

using namespace mixtape;

namespace {

struct Args {
  int rounds = 3;
  int steps = 5;  // timed steps per side and round (after one warm-up step per round)
  std::string precision = "fp32";
  std::string json;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    check(i + 1 < argc, "bench_dist_train: ", flag, " needs a value");
    const std::string value = argv[++i];
    if (flag == "--rounds") a.rounds = std::stoi(value);
    else if (flag == "--steps") a.steps = std::stoi(value);
    else if (flag == "--precision") a.precision = value;
    else if (flag == "--json") a.json = value;
    else fail("bench_dist_train: unknown option ", flag, " (--rounds N --steps N --precision MODE --json FILE)");
  }
  check(a.rounds >= 1 && a.steps >= 1, "bench_dist_train: --rounds and --steps must be >= 1");
  return a;
}

// A random token stream over 65 ids: a step's cost does not depend on the token values.
TokenData random_tokens() {
  TokenData data;
  data.vocab_size = 65;
  std::mt19937 rng(1234);
  data.tokens.resize(400000);
  for (int32_t& t : data.tokens) t = static_cast<int32_t>(rng() % 65);
  return data;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <class Step>
void time_steps(Step&& step, int n, std::vector<double>& seconds) {
  step();  // warm-up
  for (int i = 0; i < n; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    step();
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
}

int run(int argc, char** argv) {
  const Args args = parse(argc, argv);
  const dist::World& world = dist::init(&argc, &argv);
  const dist::Communicator comm = dist::Communicator::world();
  const int N = world.size;
  GPTConfig config;
  config.n_layer = 4;
  config.n_head = 4;
  config.n_embd = 256;
  config.block_size = 128;
  config.vocab_size = 65;
  config.bias = true;
  TrainOptions options;
  options.batch = 16;
  options.steps = 100000;
  options.lr = 3e-4;
  options.min_lr = 3e-5;
  options.amp = AmpConfig::parse(args.precision);
  const TokenData data = random_tokens();
  check(options.batch % N == 0, "bench_dist_train: the global batch 16 must be divisible by the ", N, " ranks");

  std::vector<double> single1, singleN, dp;
  std::unique_ptr<Trainer> one;
  if (world.rank == 0) one = std::make_unique<Trainer>(config, options, data);
  ParallelOptions layout;
  layout.dp = N;
  ParallelTrainer parallel(config, options, layout, data, comm);
  for (int r = 0; r < args.rounds; ++r) {
    if (world.rank == 0) {
      omp_set_num_threads(1);
      time_steps([&] { one->train_step(); }, args.steps, single1);
      omp_set_num_threads(N);
      time_steps([&] { one->train_step(); }, args.steps, singleN);
    }
    omp_set_num_threads(1);
    comm.barrier();
    time_steps([&] { parallel.train_step(); }, args.steps, dp);
    comm.barrier();
  }
  if (world.rank != 0) return 0;

  const double tokens = double(options.batch * config.block_size);
  const double tps1 = tokens / median(single1), tpsN = tokens / median(singleN), tpsdp = tokens / median(dp);
  const double efficiency = tpsdp / (N * tps1), speedup = tpsdp / tpsN;
  std::printf("bench_dist_train: GPT 4x256 block 128, global batch 16, %s, %d ranks, %d rounds x %d steps\n",
              args.precision.c_str(), N, args.rounds, args.steps);
  std::printf("  one process, 1 thread    %8.0f tokens/s\n", tps1);
  std::printf("  one process, %d threads   %8.0f tokens/s\n", N, tpsN);
  std::printf("  DP %d (1 thread per rank) %8.0f tokens/s\n", N, tpsdp);
  std::printf("  scaling efficiency DP %d / (%d x one process, 1 thread) = %.2f\n", N, N, efficiency);
  std::printf("  speedup DP %d / one process with %d threads = %.2f\n", N, N, speedup);
  if (!args.json.empty()) {
    json::Value::Object o{{"ranks", int64_t{N}},
                          {"precision", args.precision},
                          {"tokens_per_s_one_process_1_thread", tps1},
                          {"tokens_per_s_one_process_n_threads", tpsN},
                          {"tokens_per_s_dp", tpsdp},
                          {"scaling_efficiency", efficiency},
                          {"speedup_vs_one_process_n_threads", speedup}};
    std::ofstream out(args.json);
    out << json::Value(o).dump() << '\n';
    check(out.good(), "bench_dist_train: cannot write '", args.json, "'");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return dist::run_or_abort(run, argc, argv); }
