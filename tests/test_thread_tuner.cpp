// ThreadTuner against simulated machines: each step's time is a function of the thread count it ran with
// (and of whether a neighbour keeps a core busy), so where the tuner goes and what it costs are exact.
#include <gtest/gtest.h>

#include <array>
#include <algorithm>
#include <functional>
#include <vector>

#include "tensor/error.h"
#include "train/thread_tuner.h"

namespace mixtape {
namespace {

// A 2-core machine in units of the quiet 2-thread step: 1 thread takes 1.9 (not quite twice: the threads'
// shares wait for each other). With a neighbour on one core, 1 thread keeps its core (1.9) and 2 threads take
// 2.1 (the step waits for the share on the busy core).
double two_cores(int threads, bool loaded) {
  if (threads == 1) return 1.9;
  return loaded ? 2.1 : 1.0;
}

struct SimulatedRun {
  double seconds = 0;
  int64_t steps_at_one = 0;
};

// `steps` more steps, the first one at each count in the tuner's life twice as long (warm-up); loaded(step)
// says when the neighbour runs.
struct Simulation {
  explicit Simulation(int max_threads) : tuner(max_threads) {}
  ThreadTuner tuner;
  std::array<bool, 9> warm{};  // warm[n]: a step has run at n threads
};

SimulatedRun simulate(Simulation& sim, int64_t steps, const std::function<bool(int64_t)>& loaded,
                      const std::function<double(int, bool)>& machine = two_cores) {
  ThreadTuner& tuner = sim.tuner;
  std::array<bool, 9>& warm = sim.warm;
  SimulatedRun run;
  for (int64_t step = 0; step < steps; ++step) {
    const int threads = tuner.next_threads();
    double t = machine(threads, loaded(step));
    if (!warm[threads]) t *= 2, warm[threads] = true;
    run.seconds += t;
    run.steps_at_one += threads == 1;
    tuner.record(t);
  }
  return run;
}

const auto quiet = [](int64_t) { return false; };
const auto busy = [](int64_t) { return true; };

TEST(ThreadTuner, AQuietMachineKeepsEveryThreadAndPaysLittleForTheProbes) {
  Simulation sim(2);
  const ThreadTuner& tuner = sim.tuner;
  const SimulatedRun first = simulate(sim, 200, quiet);
  EXPECT_EQ(tuner.current(), 2);
  EXPECT_EQ(tuner.switches(), 0);
  // Without probes: 1 warm-up step of 2.0 and 199 of 1.0.
  const double ideal_200 = 2.0 + 199;
  EXPECT_LT(first.seconds / ideal_200, 1.03);
  EXPECT_GT(tuner.probes(), 0);  // it did look
  const SimulatedRun rest = simulate(sim, 1800, quiet);
  EXPECT_EQ(tuner.current(), 2);
  EXPECT_LT(rest.seconds / 1800, 1.004);  // a probe step at 1.9 per wait of up to 640 steps
}

TEST(ThreadTuner, ABusyNeighbourMovesItToOneThreadWithinTheFirstProbes) {
  Simulation sim(2);
  const ThreadTuner& tuner = sim.tuner;
  simulate(sim, 40, busy);
  EXPECT_EQ(tuner.current(), 1);
  // From then on it runs at 1 thread's speed, up to the probes of 2 threads.
  const SimulatedRun rest = simulate(sim, 1000, busy);
  EXPECT_EQ(tuner.current(), 1);
  EXPECT_LT(rest.seconds / (1000 * 1.9), 1.01);
}

TEST(ThreadTuner, FollowsANeighbourThatComesAndGoes) {
  Simulation sim(2);
  const ThreadTuner& tuner = sim.tuner;
  // Long quiet: the probes are max_interval apart by the time the neighbour starts.
  simulate(sim, 2000, quiet);
  ASSERT_EQ(tuner.current(), 2);
  // The 2-thread median drifts from 1.0 to 2.1: the probes start over and find 1 thread.
  simulate(sim, 40, busy);
  EXPECT_EQ(tuner.current(), 1);
  simulate(sim, 1000, busy);
  EXPECT_EQ(tuner.current(), 1);
  // The neighbour leaves. 1 thread's time does not change, so only the probes of 2 threads find out: within
  // one max_interval (and the window) of steps.
  const ThreadTunerOptions defaults;
  simulate(sim, defaults.max_interval + defaults.window + 2, quiet);
  EXPECT_EQ(tuner.current(), 2);
}

TEST(ThreadTuner, StepTimeNoiseDoesNotMoveIt) {
  Simulation sim(2);
  const ThreadTuner& tuner = sim.tuner;
  // +-4% from step to step, a fixed pattern: a 1-thread probe is never 5% faster than the 2-thread median.
  int64_t step = 0;
  simulate(sim, 3000, quiet, [&](int threads, bool) {
    const double noise = 1 + 0.04 * ((step++ * 7919) % 9 - 4) / 4.0;
    return two_cores(threads, false) * noise;
  });
  EXPECT_EQ(tuner.current(), 2);
  EXPECT_EQ(tuner.switches(), 0);
}

TEST(ThreadTuner, ClimbsToTheBestCountOfALargerMachine) {
  // 4 cores, one kept busy: 3 threads are fastest.
  const auto four_cores = [](int threads, bool) {
    const double times[] = {0, 3.6, 1.9, 1.3, 1.6};
    return times[threads];
  };
  Simulation sim(4);
  const ThreadTuner& tuner = sim.tuner;
  simulate(sim, 600, busy, four_cores);
  EXPECT_EQ(tuner.current(), 3);
}

// On a machine whose load does not change, the count of every step is a function of the step number: a
// tuner built for a run resumed at step s gives the counts of the uninterrupted run from s on (a probe cut
// by the resumption included), so both runs' steps run alike.
TEST(ThreadTuner, AResumedRunTakesUpTheScheduleAtItsStep) {
  const auto counts = [](ThreadTuner& tuner, int64_t steps) {
    std::vector<int> out;
    for (int64_t i = 0; i < steps; ++i) {
      out.push_back(tuner.next_threads());
      tuner.record(two_cores(out.back(), false));
    }
    return out;
  };
  ThreadTuner whole(2);
  const std::vector<int> reference = counts(whole, 1500);
  ASSERT_GT(std::count(reference.begin(), reference.end(), 1), 0);  // it did probe
  // The first probe is at steps 30 and 31, the next at 92 and 93 (after a wait of 60), each with its warm-up
  // step; the third is step 214 alone (after a wait of 120).
  EXPECT_EQ(reference[29], 2);
  EXPECT_EQ(reference[30], 1);
  EXPECT_EQ(reference[31], 1);
  EXPECT_EQ(reference[32], 2);
  EXPECT_EQ(reference[92], 1);
  EXPECT_EQ(reference[93], 1);
  EXPECT_EQ(reference[213], 2);
  EXPECT_EQ(reference[214], 1);
  EXPECT_EQ(reference[215], 2);
  for (int64_t start : {1, 29, 30, 31, 32, 92, 93, 94, 214, 215, 500, 1000}) {
    ThreadTuner resumed(2, start);
    const std::vector<int> tail = counts(resumed, 1500 - start);
    EXPECT_TRUE(std::equal(tail.begin(), tail.end(), reference.begin() + start)) << "resumed at step " << start;
  }
}

TEST(ThreadTuner, OneThreadNeverProbes) {
  Simulation sim(1);
  const ThreadTuner& tuner = sim.tuner;
  simulate(sim, 500, busy);
  EXPECT_EQ(tuner.current(), 1);
  EXPECT_EQ(tuner.probes(), 0);
}

TEST(ThreadTuner, RejectsBadSettingsAndTimes) {
  EXPECT_THROW(ThreadTuner(0), Error);
  ThreadTunerOptions options;
  options.max_interval = options.first_interval - 1;
  EXPECT_THROW(ThreadTuner(2, 0, options), Error);
  EXPECT_THROW(ThreadTuner(2, -1), Error);
  ThreadTuner tuner(2);
  EXPECT_THROW(tuner.record(-1), Error);
  EXPECT_THROW(tuner.record(1.0 / 0.0), Error);
}

}  // namespace
}  // namespace mixtape
