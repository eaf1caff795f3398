// The neighbour study (see neighbour_study.h).
//
// The model is train_gpt's run of the threads measurement: 4 layers, 4 heads, width 128, block 64, batch 16,
// fp32, on random tokens over 65 ids. Three configurations share one trainer (a step's cost does not depend
// on the weights): "default" (OpenMP's count at start, fixed), "1 thread" (fixed) and "tuner" (a ThreadTuner
// sets the count of every step, as train_gpt --threads auto does). Under each load (quiet, then a neighbour:
// a child process spinning on one core for the whole phase) each configuration first runs an untimed
// settling block (oneDNN's first calls at its counts, the tuner's first probes and its adaptation), then the
// timed blocks run in rotation, one block of each configuration in turn, so that drift of the machine meets
// every configuration alike. A configuration's figure is its tokens/s over all its timed steps (total tokens
// / total time: the tuner's probes are in it). Targets: quiet, tuner / default >= 0.97; loaded, tuner / 1
// thread >= 1.00.
#include "bench/neighbour_study.h"

#include <omp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "bench/bench_training.h"
#include "tensor/error.h"
#include "train/thread_tuner.h"

namespace mixtape::bench {

namespace {

const BenchModel kNeighbourModel{.layers = 4, .heads = 4, .width = 128, .block = 64, .vocab = 65, .batch = 16};

// A process keeping one core busy until it is killed (or this process dies).
class BusyNeighbour {
 public:
  BusyNeighbour() {
    const pid_t parent = ::getpid();
    std::fflush(stdout);  // else the child holds a copy of what is buffered
    pid_ = ::fork();
    check(pid_ >= 0, "bench_train_gpt --neighbour: fork failed");
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(0);
      volatile uint64_t spin = 0;
      while (true) spin = spin + 1;
    }
  }
  ~BusyNeighbour() {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  BusyNeighbour(const BusyNeighbour&) = delete;
  BusyNeighbour& operator=(const BusyNeighbour&) = delete;

 private:
  pid_t pid_;
};

struct Configuration {
  std::string name;
  int fixed_threads = 0;            // 0: the tuner's
  std::optional<ThreadTuner> tuner;
  double seconds = 0;
  int64_t steps = 0;
};

// `steps` steps of `trainer` under configuration c; the time of each step is the tuner's measurement.
double run_block(Trainer& trainer, Configuration& c, int steps) {
  double total = 0;
  for (int i = 0; i < steps; ++i) {
    omp_set_num_threads(c.tuner ? c.tuner->next_threads() : c.fixed_threads);
    const auto t0 = std::chrono::steady_clock::now();
    trainer.train_step();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (c.tuner) c.tuner->record(s);
    total += s;
  }
  return total;
}

// One load phase: settling blocks, then `blocks` rotations of timed blocks.
std::vector<Configuration> measure(Trainer& trainer, int max_threads, int blocks, int steps) {
  std::vector<Configuration> configs(3);
  configs[0].name = "default (" + std::to_string(max_threads) + " threads)";
  configs[0].fixed_threads = max_threads;
  configs[1].name = "1 thread";
  configs[1].fixed_threads = 1;
  configs[2].name = "tuner";
  configs[2].tuner.emplace(max_threads);
  for (Configuration& c : configs) run_block(trainer, c, steps);
  for (int b = 0; b < blocks; ++b)
    for (Configuration& c : configs) {
      c.seconds += run_block(trainer, c, steps);
      c.steps += steps;
    }
  omp_set_num_threads(max_threads);
  return configs;
}

double tokens_per_s(const Configuration& c) {
  return static_cast<double>(c.steps * kNeighbourModel.tokens_per_step()) / c.seconds;
}

void print_phase(const char* load, const std::vector<Configuration>& configs) {
  for (const Configuration& c : configs) {
    std::printf("  %-7s %-22s %9.0f tok/s", load, c.name.c_str(), tokens_per_s(c));
    if (c.tuner)
      std::printf("   (ended at %d threads; %lld probes, %lld switches)", c.tuner->current(),
                  static_cast<long long>(c.tuner->probes()), static_cast<long long>(c.tuner->switches()));
    std::printf("\n");
  }
}

}  // namespace

int neighbour_study(int blocks, int steps) {
  const int max_threads = omp_get_max_threads();
  const TokenData data = random_tokens(kNeighbourModel.vocab, 200000);
  const std::unique_ptr<Trainer> trainer = make_trainer(kNeighbourModel, "fp32", 1e-3, Device::cpu(), data);
  std::printf("Neighbour study (--neighbour): %lld layers, width %lld, block %lld, batch %lld, fp32; %d timed "
              "blocks of %d steps per configuration and load, after a settling block each\n",
              static_cast<long long>(kNeighbourModel.layers), static_cast<long long>(kNeighbourModel.width),
              static_cast<long long>(kNeighbourModel.block), static_cast<long long>(kNeighbourModel.batch), blocks,
              steps);
  std::fflush(stdout);
  const std::vector<Configuration> quiet = measure(*trainer, max_threads, blocks, steps);
  std::vector<Configuration> loaded;
  {
    const BusyNeighbour neighbour;
    loaded = measure(*trainer, max_threads, blocks, steps);
  }
  print_phase("quiet", quiet);
  print_phase("loaded", loaded);
  const double quiet_ratio = tokens_per_s(quiet[2]) / tokens_per_s(quiet[0]);
  const double loaded_ratio = tokens_per_s(loaded[2]) / tokens_per_s(loaded[1]);
  const double loaded_default = tokens_per_s(loaded[0]) / tokens_per_s(loaded[1]);
  const bool quiet_ok = quiet_ratio >= 0.97, loaded_ok = loaded_ratio >= 1.0;
  std::printf("quiet:  tuner / default   = %.3f (target >= 0.97: %s)\n", quiet_ratio, quiet_ok ? "met" : "MISSED");
  std::printf("loaded: tuner / 1 thread  = %.3f (target >= 1.00: %s); default / 1 thread = %.3f\n", loaded_ratio,
              loaded_ok ? "met" : "MISSED", loaded_default);
  return quiet_ok && loaded_ok ? 0 : 1;
}

}  // namespace mixtape::bench
