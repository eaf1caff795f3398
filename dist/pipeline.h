#pragma once
// Pipeline parallelism (Megatron-LM's non-interleaved schedules): the model is split by layers into stages,
// one per rank of the pipeline group; the global batch is split into micro-batches that flow through the
// stages. Activations go forward (stage s -> s + 1) and activation gradients backward (s + 1 -> s) with
// blocking Communicator::send/recv.
//
//   GPipe: every micro-batch forward, then every micro-batch backward (activations of all M live at once).
//   1F1B:  stage s runs min(pp - s - 1, M) warm-up forwards, then alternates one forward / one backward, then
//          the cool-down backwards (at most pp - s micro-batches in flight: the memory win of 1F1B).
//
// Gradients accumulate in the parameters' .grad over the micro-batches: the last stage backpropagates
// loss_m * (loss_scale / M), so they sum to the gradient of the mean loss over the global batch (times the
// AMP loss scale), exactly as one backward over the whole batch would (micro-batches of equal size).
//
// Shapes: the sender of an activation first sends a small header (dtype and shape, 9 int64s), so a stage
// may return an activation of any shape/dtype for any micro-batch (autocast may make it bf16). Gradients
// need no header: the stage that receives a gradient is the one that sent the activation and knows its
// shape and dtype.
//
// Deadlock freedom with blocking sends (an MPI_Send of a large message waits for the matching receive):
// the schedule is a fixed list of operations per stage (pipeline_operations, tested by simulating
// rendezvous sends for every pp and M). Where 1F1B needs a "send to a neighbour, receive from the same
// neighbour" exchange (Megatron's send_forward_recv_backward / send_backward_recv_forward, done there with
// batched isend/irecv), the even stage of the pair sends first and the odd one receives first, so the two
// blocking calls of one side always meet the two of the other side in the same order.
// Also checked under real rendezvous: with `mpiexec --mca pml ob1 --mca btl self,tcp --mca btl_tcp_eager_limit 64
// --mca btl_tcp_max_send_size 64` the tests pass, and with both sides of an exchange sending first they hang.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dist/communicator.h"
#include "tensor/tensor.h"

namespace mixtape::dist {

// What one rank of the pipeline runs: its slice of the model. For the GPT: the first stage holds the
// embeddings and the first blocks, middle stages blocks, the last stage the last blocks, ln_f, the lm_head
// (the tied wte weight) and the loss; the last stage reads the micro-batch's targets by its index.
class PipelineStage {
 public:
  virtual ~PipelineStage() = default;
  // First stage: `input` is the micro-batch's input (e.g. token ids); later stages: the activation received
  // from the previous stage, a leaf with requires_grad (its .grad is sent back). The last stage returns the
  // micro-batch's loss (one element, the mean over the micro-batch), the others their output activation.
  virtual Tensor forward(const Tensor& input, int64_t micro_batch) = 0;
};

enum class PipelineScheduleKind { GPipe, OneFOneB };
const char* to_string(PipelineScheduleKind kind);

// One step of a stage's schedule, on micro-batch `micro_batch`.
struct PipelineOperation {
  enum Kind { RecvForward, Forward, SendForward, RecvBackward, Backward, SendBackward } kind;
  int64_t micro_batch;
  bool operator==(const PipelineOperation&) const = default;
};
const char* to_string(PipelineOperation::Kind kind);

// The ordered operations of stage `stage` of `num_stages` for M micro-batches (what PipelineSchedule::run
// executes): exposed so tests can check the schedule itself (every message matched, no deadlock).
std::vector<PipelineOperation> pipeline_operations(PipelineScheduleKind kind, int num_stages, int stage,
                                                   int64_t num_micro_batches);

struct PipelineOptions {
  PipelineScheduleKind schedule = PipelineScheduleKind::OneFOneB;
  // Received activations and gradients are placed here (this rank's device).
  Device device = Device::cpu();
  // AMP: the last stage backpropagates loss_m / M * loss_scale. With scale_loss set, it backpropagates
  // scale_loss(loss_m / M) instead (pass [&](const Tensor& l) { return optimizer.scale_loss(l); } for a
  // MixedPrecisionOptimizer), and every other stage calls scale_loss once per run on a 0-d f32 zero before
  // its first backward (result unused), so a MixedPrecisionOptimizer on every stage knows that the gradients
  // arriving in its parameters carry its loss scale.
  double loss_scale = 1.0;
  std::function<Tensor(const Tensor&)> scale_loss;
};

class PipelineSchedule {
 public:
  // `pp`: the pipeline group; its rank is the stage index.
  explicit PipelineSchedule(Communicator pp, PipelineOptions options = {});

  // One training step's forward and backward over the micro-batches (gradients accumulate in the stage's
  // parameters; zero them before, step after). `micro_batches` has one entry per micro-batch on every stage
  // (the same count everywhere: checked over the group); only the first stage reads the tensors (others may
  // pass undefined ones). Returns the mean of the micro-batches' (unscaled) losses, on every stage.
  double run(PipelineStage& stage, const std::vector<Tensor>& micro_batches);

  // Forward only (evaluation: no gradients, no schedule): every micro-batch flows through the stages in order.
  // Returns each micro-batch's loss (as the last stage computed it), on every stage. Micro-batches may differ
  // in size here.
  std::vector<double> forward_only(PipelineStage& stage, const std::vector<Tensor>& micro_batches);

  const Communicator& group() const { return pp_; }
  const PipelineOptions& options() const { return options_; }
  int stage_index() const { return pp_.rank(); }
  int num_stages() const { return pp_.size(); }
  bool is_first_stage() const { return pp_.rank() == 0; }
  bool is_last_stage() const { return pp_.rank() == pp_.size() - 1; }

 private:
  void send_activation(const Tensor& output) const;  // header (dtype, shape), then the values, to stage + 1
  Tensor recv_activation() const;                    // from stage - 1, on options.device

  Communicator pp_;
  PipelineOptions options_;
};

// `batch` split along dim 0 into `num_micro_batches` equal views; Error unless the count divides dim 0.
std::vector<Tensor> split_micro_batches(const Tensor& batch, int64_t num_micro_batches);

// ---- tied weights between the first and the last stage (the GPT's wte, used again as the lm_head) ----

// Splits `pp` into the embedding group {first stage, last stage}; every rank of pp must call it. Middle
// stages get a group of their own (size 1), on which the functions below do nothing. With pp == 1 the group
// is the one stage (the tied weight's two uses already sum in its gradient).
Communicator make_embedding_group(const Communicator& pp);
// Sums the tied weight's gradient over the embedding group, in place, so the first and the last stage
// both hold d(loss)/d(weight) of both uses. A rank whose copy got no gradient contributes zeros (and gets
// the sum as its gradient).
void all_reduce_tied_gradients(const Tensor& tied_weight, const Communicator& embedding_group);
// Copies rank 0's (the first stage's) value of the tied weight to the last stage, so both start equal.
void broadcast_tied_weight(const Tensor& tied_weight, const Communicator& embedding_group);

}  // namespace mixtape::dist
