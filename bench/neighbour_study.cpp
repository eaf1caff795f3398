// The neighbour study (see neighbour_study.h).
//
// The model: 4 layers, 4 heads, width 128, block 64, batch 16, fp32, on random tokens over 65 ids. The
// configurations share one trainer (a step's cost does not depend on the weights): "default" (OpenMP's count
// at start, fixed), "1 thread" (fixed), "tuner" (a ThreadTuner sets the count of every step, as train_gpt
// --threads auto does) and a control (the phase's baseline a second time: default when quiet, 1 thread when
// loaded). Under each load (quiet, then a neighbour: a child process spinning on one core for the whole phase)
// each configuration first runs an untimed settling block (oneDNN's first calls at its counts; for the tuner
// 250 steps at least: its first probes and its adaptation), then the timed blocks run in rotations, one block
// of each configuration in turn (the first one moving on from rotation to rotation), so that drift of the
// machine meets every configuration alike. A
// configuration's figure is its tokens/s over all its timed steps (total tokens / total time: the tuner's
// probes are in it). Targets: quiet, tuner / default >= 0.97; loaded, tuner / 1 thread >= 1.00. The control's
// ratio to its baseline is how far the noise alone moves a ratio; a ratio short of its target by less than
// that is reported as met within the noise.
#include "bench/neighbour_study.h"

#include <omp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
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

// The tuner's settling steps: past its first probes (steps 30-31, 92-93 and 214 of a quiet schedule) and its
// adaptation, so that the timed blocks see its steady state: a probe every 641 steps at most while the load
// holds.
constexpr int kTunerSettlingSteps = 250;

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

// One load phase: settling blocks, then `blocks` rotations of timed blocks. The configurations: default,
// 1 thread, tuner, and a control: a second copy of the phase's baseline (default when quiet, 1 thread when
// loaded), placed after the tuner, whose ratio to the baseline is the noise of the measurement.
std::vector<Configuration> measure(Trainer& trainer, int max_threads, int blocks, int steps, bool loaded) {
  std::vector<Configuration> configs(4);
  configs[0].name = "default (" + std::to_string(max_threads) + " threads)";
  configs[0].fixed_threads = max_threads;
  configs[1].name = "1 thread";
  configs[1].fixed_threads = 1;
  configs[2].name = "tuner";
  configs[2].tuner.emplace(max_threads);
  configs[3].name = loaded ? "1 thread (control)" : configs[0].name + " (control)";
  configs[3].fixed_threads = loaded ? 1 : max_threads;
  for (Configuration& c : configs) run_block(trainer, c, c.tuner ? std::max(steps, kTunerSettlingSteps) : steps);
  // The first configuration of a rotation moves on each time, so that none always follows the same other
  // one (a block after a 1-thread block starts with the second core idle for seconds).
  for (int b = 0; b < blocks; ++b)
    for (size_t i = 0; i < configs.size(); ++i) {
      Configuration& c = configs[(b + i) % configs.size()];
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
  const std::vector<Configuration> quiet = measure(*trainer, max_threads, blocks, steps, false);
  std::vector<Configuration> loaded;
  {
    const BusyNeighbour neighbour;
    loaded = measure(*trainer, max_threads, blocks, steps, true);
  }
  print_phase("quiet", quiet);
  print_phase("loaded", loaded);
  // A target is met when the ratio reaches it, or falls short of it by no more than the control's distance
  // from 1 (the same configuration measured twice): then the two cannot be told apart in this run.
  const auto verdict = [](const char* what, double ratio, double target, double control) {
    const double noise = std::abs(1 - control);
    const char* judged = ratio >= target ? "met" : ratio >= target - noise ? "met within the noise" : "MISSED";
    std::printf("%s = %.3f (target >= %.2f: %s; the same configuration twice: %.3f)\n", what, ratio, target,
                judged, control);
    return ratio >= target - noise;
  };
  const bool quiet_ok = verdict("quiet:  tuner / default  ", tokens_per_s(quiet[2]) / tokens_per_s(quiet[0]), 0.97,
                                tokens_per_s(quiet[3]) / tokens_per_s(quiet[0]));
  const bool loaded_ok = verdict("loaded: tuner / 1 thread ", tokens_per_s(loaded[2]) / tokens_per_s(loaded[1]),
                                 1.0, tokens_per_s(loaded[3]) / tokens_per_s(loaded[1]));
  std::printf("loaded: default / 1 thread = %.3f\n", tokens_per_s(loaded[0]) / tokens_per_s(loaded[1]));
  return quiet_ok && loaded_ok ? 0 : 1;
}

}  // namespace mixtape::bench
