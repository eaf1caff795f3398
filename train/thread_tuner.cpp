#include "train/thread_tuner.h"

#include <algorithm>
#include <cmath>

#include "tensor/error.h"

namespace mixtape {

namespace {

// The steps of probe k: the first probe at each neighbouring count warms it up (caches, first touches) with
// a step before the measured one; later probes are the measured step alone. A function of k only, so that a
// resumed run's schedule is the uninterrupted run's.
int probe_steps(int64_t k) { return k < 2 ? 2 : 1; }

}  // namespace

ThreadTuner::ThreadTuner(int max_threads, int64_t first_step, ThreadTunerOptions options)
    : options_(options), max_(max_threads), current_(max_threads), step_(first_step),
      interval_(options.first_interval) {
  check(max_threads >= 1, "ThreadTuner: max_threads must be >= 1, got ", max_threads);
  check(first_step >= 0, "ThreadTuner: first_step must be >= 0, got ", first_step);
  check(options.first_interval >= 1 && options.max_interval >= options.first_interval,
        "ThreadTuner: expected 1 <= first_interval <= max_interval, got ", options.first_interval, " and ",
        options.max_interval);
  check(options.window >= 1, "ThreadTuner: window must be >= 1, got ", options.window);
  check(options.margin >= 0 && options.margin < 1 && options.drift > 0,
        "ThreadTuner: expected margin in [0, 1) and drift > 0, got ", options.margin, " and ", options.drift);
  // The quiet schedule up to first_step: every probe lost, each wait twice the one before.
  next_probe_ = options_.first_interval;
  while (next_probe_ + probe_steps(probes_) <= first_step) {
    next_probe_ += probe_steps(probes_);
    ++probes_;
    interval_ = std::min(2 * interval_, options_.max_interval);
    next_probe_ += interval_;
  }
  // A resumption in the middle of a probe runs the probe's remaining steps (without a decision: no median).
  if (max_ > 1 && first_step >= next_probe_) {
    start_probe();
    probe_step_ = static_cast<int>(first_step - next_probe_) + 1;
  }
}

double ThreadTuner::median() const {
  std::vector<double> sorted = recent_;
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size();
  return n % 2 ? sorted[n / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) / 2;
}

void ThreadTuner::record(double seconds) {
  check(std::isfinite(seconds) && seconds >= 0, "ThreadTuner::record: a step time must be finite and >= 0, got ",
        seconds);
  ++step_;
  if (probe_step_ > 0) {
    if (probe_step_++ == probe_length_) end_probe(seconds);
  } else {
    recent_.push_back(seconds);
    if (static_cast<int64_t>(recent_.size()) > options_.window) recent_.erase(recent_.begin());
    if (static_cast<int64_t>(recent_.size()) == options_.window) {
      const double now = median();
      if (decided_median_ == 0) {
        decided_median_ = now;
      } else if (std::abs(now - decided_median_) > options_.drift * decided_median_) {
        // The machine changed (a neighbour came or went): look at the other counts again soon.
        decided_median_ = now;
        interval_ = options_.first_interval;
        next_probe_ = std::min(next_probe_, step_ + interval_);
      }
    }
  }
  if (probe_step_ == 0 && step_ >= next_probe_ && max_ > 1) start_probe();
}

void ThreadTuner::start_probe() {
  // Probes alternate between the count below and the count above, where both exist.
  const bool down = probes_ % 2 == 0;
  int candidate = down ? current_ - 1 : current_ + 1;
  if (candidate < 1 || candidate > max_) candidate = down ? current_ + 1 : current_ - 1;
  probe_threads_ = candidate;
  probe_step_ = 1;
  probe_length_ = probe_steps(probes_);
  ++probes_;
}

void ThreadTuner::end_probe(double seconds) {
  probe_step_ = 0;
  // No steps at the current count yet (a run resumed just before a probe): nothing to compare with.
  if (!recent_.empty() && seconds < median() * (1 - options_.margin)) {
    current_ = probe_threads_;
    recent_.assign(1, seconds);
    decided_median_ = 0;
    interval_ = options_.first_interval;
    ++switches_;
  } else {
    interval_ = std::min(2 * interval_, options_.max_interval);
  }
  next_probe_ = step_ + interval_;
}

}  // namespace mixtape
