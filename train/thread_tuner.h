#pragma once
// The OpenMP thread count of a training loop, chosen from the time its steps take.
//
// Why: the CPU kernels (mixtape's and oneDNN's) split each op into one static share per thread, so a step
// lasts as long as its slowest thread. On a quiet machine every thread has a core and all of them are fastest;
// when another process keeps a core busy, the thread that shares that core gets part of it, every other thread
// waits for it at each op's end, and the step can run slower than on fewer threads (on 2 cores with one core
// kept busy: 2 threads at about half the speed of 1 thread with libgomp's spinning wait, 0.9x with a passive
// one). No setting of the waiting itself (OMP_WAIT_POLICY, GOMP_SPINCOUNT) makes the shared core's share
// finish sooner.
//
// How: steps run at the current count; at scheduled steps one step runs at a neighbouring count (the count
// below or above, in turn, within [1, max]) as a probe and is measured (the first probe at each count runs a
// step before it to warm that count up: caches, first touches). A probe faster than the current count's
// recent median by more than `margin` makes its count current and starts the schedule over; a probe that is
// not doubles the wait to the next (up to max_interval), so a quiet machine pays for probes more and more
// rarely. When the current count's median moves by more than `drift` from what it was at the last decision (a
// neighbour came or went), the waits start over too.
//
// Cost on a quiet 2-core machine: a step per probe at 1 thread (about twice as long): under 3% over the first
// 200 steps, about 0.7% over 1000, 0.15% in the long run (a probe every 641 steps). The tuner is plain
// logic over the times it is given (no clock, no OpenMP calls): the training loop sets the count it returns
// and reports each step's time.
//
// The bits: mixtape's own kernels give the same bits on every thread count; oneDNN's f32 GEMM may split a
// long sum over threads (a weight gradient of few outputs and many tokens), and where it does, the last bits
// of a step depend on the count it ran with. On a machine whose load does not change, the counts are a
// function of the step number alone (the schedule counts from step 0, and a tuner built for a resumed run at
// step s takes up the schedule at s), so a run and its resumption from a checkpoint step alike. A run that
// must repeat bit for bit under changing load fixes the count (train_gpt --threads N, or OMP_NUM_THREADS).
#include <cstdint>
#include <vector>

namespace mixtape {

struct ThreadTunerOptions {
  int64_t first_interval = 30;   // steps before the first probe, and after a switch or a drift
  int64_t max_interval = 640;    // the longest wait between probes
  double margin = 0.05;          // a probe must be this much faster than the median to win
  double drift = 0.4;            // a median this far from the last decision's restarts the probes
  int64_t window = 8;            // the steps at the current count whose median is compared
};

class ThreadTuner {
 public:
  // max_threads >= 1: the count a quiet machine is fastest with (OpenMP's count at start); the tuner starts
  // there. first_step: the training step the next record() is of (a resumed run's), where the schedule
  // stands as if the run had been quiet since step 0.
  explicit ThreadTuner(int max_threads, int64_t first_step = 0, ThreadTunerOptions options = {});

  // The count the next step runs with.
  int next_threads() const { return probe_step_ > 0 ? probe_threads_ : current_; }
  // The step just run (at next_threads()) took `seconds`.
  void record(double seconds);

  int current() const { return current_; }  // the count between probes
  int64_t switches() const { return switches_; }
  int64_t probes() const { return probes_; }

 private:
  double median() const;
  void start_probe();
  void end_probe(double seconds);

  ThreadTunerOptions options_;
  int max_;
  int current_;
  int64_t step_;                  // the step the next record() is of
  int64_t next_probe_;            // the step the next probe starts at
  int64_t interval_;              // steps between the end of a probe and the start of the next
  std::vector<double> recent_;    // the last `window` steps at current_, oldest first
  double decided_median_ = 0;     // the median at the last decision (0: none yet)
  int probe_step_ = 0;            // 1, 2: the step of a probe the next record() is of; 0: no probe
  int probe_length_ = 0;          // the steps of the probe under way
  int probe_threads_ = 0;
  int64_t switches_ = 0, probes_ = 0;
};

}  // namespace mixtape
