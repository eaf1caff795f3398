#pragma once
// The write side of the tape: what an op records so backward() (autograd/) can run it in reverse.
// It lives in tensor/ because every op front end writes to it; the engine that reads it is in autograd/.
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace mixtape {

// One gradient per op input; an undefined Tensor means "no gradient for this input".
using Grads = std::vector<Tensor>;
// Given the gradient of the op's output, returns the gradients of its inputs (in recording order).
// Runs with grad mode off; written in terms of other ops so it works on every backend.
using BackwardFn = std::function<Grads(const Tensor& grad_output)>;

struct Edge {
  std::shared_ptr<Node> node;  // the input was made by this op ...
  std::shared_ptr<TensorImpl> leaf;  // ... or is a leaf that accumulates its .grad; both null: no grad needed
};

struct SavedVersion {
  std::shared_ptr<Storage> storage;
  uint64_t version;
  Shape shape;
  DType dtype;
};

struct Node {
  const char* op = "";
  std::vector<Edge> inputs;
  std::vector<SavedVersion> saved;  // checked before backward runs: an in-place change is an error
  BackwardFn backward;  // released after it runs (frees the saved tensors it captured)
  // Set on nodes whose closure captures no tensor (autocast's cached dtype casts): backward() leaves them
  // in place, so one such node can serve several graphs, each backpropagated separately.
  bool keep_after_backward = false;
  Shape output_shape;
  DType output_dtype = DType::F32;
  Device output_device;
  // Releases the chain of input nodes iteratively: the implicit destructor recursed once per node and
  // overflowed the stack on graphs ~10^5..10^6 ops deep.
  ~Node();
};

// Grad mode is thread-local: on by default, off inside a NoGradGuard and while backward runs.
bool grad_enabled();
class NoGradGuard {
 public:
  NoGradGuard();
  ~NoGradGuard();
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool previous_;
};

// True when grad mode is on and some input requires grad: only then does an op record a node.
bool any_requires_grad(const std::vector<Tensor>& inputs);

// Records `out = op(inputs)` on the tape if any input requires grad (and grad mode is on): `out` becomes a
// non-leaf with requires_grad. `saved` lists the tensors `backward` captured, for the in-place check.
// Capture `out` itself only as out.detach(): the node is owned by `out`, so capturing it would be a cycle.
void record_backward(const char* op, const std::vector<Tensor>& inputs, Tensor& out, BackwardFn backward,
                     const std::vector<Tensor>& saved = {});

// An op's share of a profiled run: wall seconds and how many times it was counted.
struct ProfileEntry {
  double seconds = 0;
  int64_t calls = 0;
};

// Where a forward pass spends its time, per op (autograd/'s BackwardProfiler does the backward). While a
// ForwardProfiler lives on a thread, each node recorded on that thread adds the wall time since the previous
// recording (or since mark()) to the entry of its op: ops run one after another and record their node as they
// finish, so an entry is its ops' own time plus whatever ran since the op before that recorded nothing (a
// view, a cast autocast had cached, the caller's code between ops). Only recording ops are seen: under a
// NoGradGuard, or with no input that requires grad, nothing is counted. Times are the host's wall clock and
// include the threads a kernel runs on; on a CUDA device, whose kernels are queued asynchronously, they are
// the host's time to queue them. One profiler per thread at a time: a second one while the first lives is an
// error. bench_train_gpt --phases prints these per precision mode; Trainer::train_step marks the start of
// its forward and pauses at its end.
class ForwardProfiler {
 public:
  ForwardProfiler();  // marks the start: the first recorded op's time counts from here
  ~ForwardProfiler();
  ForwardProfiler(const ForwardProfiler&) = delete;
  ForwardProfiler& operator=(const ForwardProfiler&) = delete;

  // The next recorded op's time counts from now (what ran since the last one goes uncounted); counting
  // resumes if pause() stopped it.
  void mark();
  // Recorded ops are not counted until the next mark() (the rest of a step, after its forward).
  void pause() { paused_ = true; }
  const std::map<std::string, ProfileEntry>& entries() const { return entries_; }
  double total_seconds() const;  // the entries' sum
  void clear();  // empties the entries (and marks)

  // For record_backward: the profiler of this thread, or null; `op` just recorded its node.
  static ForwardProfiler* active();
  void recorded(const char* op);

 private:
  std::map<std::string, ProfileEntry> entries_;
  std::chrono::steady_clock::time_point last_;
  bool paused_ = false;
};

}  // namespace mixtape
