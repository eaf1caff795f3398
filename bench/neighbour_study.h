#pragma once
// bench_train_gpt --neighbour: the training step with and without a busy neighbour process, at the default
// thread count, at 1 thread and under train_gpt's ThreadTuner (train/thread_tuner.h), as ratios measured in
// one run.
namespace mixtape::bench {

// `blocks` timed blocks of `steps` steps per configuration and load; prints the table and the two ratios the
// tuner is judged by. Returns 0, or 1 when a target is missed.
int neighbour_study(int blocks, int steps);

}  // namespace mixtape::bench
