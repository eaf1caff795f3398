#include "dist/pipeline.h"

#include <algorithm>
#include <cmath>

#include "autograd/autograd.h"
#include "tensor/autograd_node.h"
#include "tensor/error.h"
#include "tensor/ops.h"

namespace mixtape::dist {

const char* to_string(PipelineScheduleKind kind) {
  return kind == PipelineScheduleKind::GPipe ? "GPipe" : "1F1B";
}

const char* to_string(PipelineOperation::Kind kind) {
  switch (kind) {
    case PipelineOperation::RecvForward: return "recv_forward";
    case PipelineOperation::Forward: return "forward";
    case PipelineOperation::SendForward: return "send_forward";
    case PipelineOperation::RecvBackward: return "recv_backward";
    case PipelineOperation::Backward: return "backward";
    case PipelineOperation::SendBackward: return "send_backward";
  }
  return "?";
}

std::vector<PipelineOperation> pipeline_operations(PipelineScheduleKind kind, int num_stages, int stage,
                                                   int64_t num_micro_batches) {
  check(num_stages >= 1 && stage >= 0 && stage < num_stages, "pipeline_operations: stage ", stage,
        " is not a stage of a pipeline of ", num_stages);
  check(num_micro_batches >= 1, "pipeline_operations: need at least one micro-batch, got ", num_micro_batches);
  using Op = PipelineOperation;
  const bool first = stage == 0, last = stage == num_stages - 1;
  const int64_t M = num_micro_batches;
  std::vector<Op> ops;
  // The pieces; a stage without a neighbour on that side has nothing to send or receive there.
  auto recv_forward = [&](int64_t m) { if (!first) ops.push_back({Op::RecvForward, m}); };
  auto send_forward = [&](int64_t m) { if (!last) ops.push_back({Op::SendForward, m}); };
  auto recv_backward = [&](int64_t m) { if (!last) ops.push_back({Op::RecvBackward, m}); };
  auto send_backward = [&](int64_t m) { if (!first) ops.push_back({Op::SendBackward, m}); };
  auto forward = [&](int64_t m) { ops.push_back({Op::Forward, m}); };
  auto backward = [&](int64_t m) { ops.push_back({Op::Backward, m}); };
  // An exchange with one neighbour (a send and a receive to/from the same rank): the even stage of the pair
  // sends first, the odd one receives first. Adjacent stages differ in parity, so when stage s runs
  // send_forward_recv_backward (with s + 1) while s + 1 runs send_backward_recv_forward (with s), one side's
  // send meets the other's receive, then the other way round — never two blocking sends facing each other.
  const bool sends_first = stage % 2 == 0;
  auto send_forward_recv_backward = [&](int64_t send_m, int64_t recv_m) {
    if (last) return;
    if (sends_first) {
      send_forward(send_m);
      recv_backward(recv_m);
    } else {
      recv_backward(recv_m);
      send_forward(send_m);
    }
  };
  auto send_backward_recv_forward = [&](int64_t send_m, int64_t recv_m) {
    if (first) return;
    if (sends_first) {
      send_backward(send_m);
      recv_forward(recv_m);
    } else {
      recv_forward(recv_m);
      send_backward(send_m);
    }
  };

  if (kind == PipelineScheduleKind::GPipe) {
    // Forward chain: a stage's send waits only on the next stage's receive, and the last stage only
    // receives, so the chain drains; the backward chain is its mirror image.
    for (int64_t m = 0; m < M; ++m) {
      recv_forward(m);
      forward(m);
      send_forward(m);
    }
    for (int64_t m = 0; m < M; ++m) {
      recv_backward(m);
      backward(m);
      send_backward(m);
    }
    return ops;
  }

  // 1F1B, as Megatron-LM's forward_backward_pipelining_without_interleaving.
  const int64_t warmup = std::min<int64_t>(num_stages - stage - 1, M);
  const int64_t steady = M - warmup;
  int64_t next_forward = 0, next_backward = 0;
  for (int64_t i = 0; i < warmup; ++i) {
    recv_forward(next_forward);
    forward(next_forward);
    send_forward(next_forward);
    ++next_forward;
  }
  if (steady > 0) recv_forward(next_forward);
  for (int64_t i = 0; i < steady; ++i) {
    const bool last_iteration = i == steady - 1;
    forward(next_forward);
    // The activation just computed goes forward while the gradient of the oldest micro-batch in flight
    // comes back from the same neighbour.
    send_forward_recv_backward(next_forward, next_backward);
    ++next_forward;
    backward(next_backward);
    if (last_iteration) {
      send_backward(next_backward);
    } else {
      send_backward_recv_forward(next_backward, next_forward);
    }
    ++next_backward;
  }
  for (int64_t i = 0; i < warmup; ++i) {
    recv_backward(next_backward);
    backward(next_backward);
    send_backward(next_backward);
    ++next_backward;
  }
  return ops;
}

namespace {

constexpr int kMaxDims = 7;
constexpr int kHeaderSize = 2 + kMaxDims;  // dtype code, rank, dims
constexpr int kTagHeader = 1, kTagActivation = 2, kTagGradient = 3;

}  // namespace

PipelineSchedule::PipelineSchedule(Communicator pp, PipelineOptions options)
    : pp_(std::move(pp)), options_(std::move(options)) {
  check(std::isfinite(options_.loss_scale) && options_.loss_scale > 0, "PipelineSchedule on the ", pp_.name(),
        ": loss_scale must be finite and positive, got ", options_.loss_scale);
}

void PipelineSchedule::send_activation(const Tensor& output) const {
  const int s = pp_.rank();
  const Tensor activation = output.detach().contiguous();
  check(activation.dim() <= kMaxDims, "PipelineSchedule: stage ", s, " output ", activation.described(),
        " has more than ", kMaxDims, " dims");
  std::vector<int64_t> h(kHeaderSize, 0);
  h[0] = static_cast<int64_t>(activation.dtype());
  h[1] = activation.dim();
  for (int64_t d = 0; d < activation.dim(); ++d) h[static_cast<size_t>(2 + d)] = activation.size(d);
  pp_.send(Tensor::from_vector(h, {kHeaderSize}), s + 1, kTagHeader);
  pp_.send(activation, s + 1, kTagActivation);
}

Tensor PipelineSchedule::recv_activation() const {
  const int s = pp_.rank();
  Tensor header = Tensor::empty({kHeaderSize}, DType::I64);
  pp_.recv(header, s - 1, kTagHeader);
  const std::vector<int64_t> h = header.to_vector<int64_t>();
  Shape shape(h.begin() + 2, h.begin() + 2 + h[1]);
  Tensor activation = Tensor::empty(shape, static_cast<DType>(h[0]), options_.device);
  pp_.recv(activation, s - 1, kTagActivation);
  return activation;
}

std::vector<double> PipelineSchedule::forward_only(PipelineStage& stage, const std::vector<Tensor>& micro_batches) {
  const int P = pp_.size(), s = pp_.rank();
  const int64_t M = static_cast<int64_t>(micro_batches.size());
  std::vector<double> agree = {double(M), -double(M)};
  pp_.all_reduce(agree, Reduction::Max);
  check(agree[0] == -agree[1], "PipelineSchedule::forward_only on the ", pp_.name(), " (stage ", s, " of ", P,
        "): the stages disagree on the number of micro-batches (", -agree[1], "..", agree[0], ")");
  NoGradGuard no_grad;
  std::vector<double> losses(static_cast<size_t>(M), 0.0);
  for (int64_t m = 0; m < M; ++m) {
    const size_t i = static_cast<size_t>(m);
    if (s == 0)
      check(micro_batches[i].defined(), "PipelineSchedule::forward_only on the ", pp_.name(),
            ": the first stage needs the input of every micro-batch; micro-batch ", m, " of ", M, " is undefined");
    const Tensor out = stage.forward(s == 0 ? micro_batches[i] : recv_activation(), m);
    check(out.defined(), "PipelineSchedule::forward_only: stage ", s, " of ", P,
          " returned an undefined tensor for micro-batch ", m);
    if (s == P - 1) {
      check(out.numel() == 1, "PipelineSchedule::forward_only: the last stage (", s, " of ", P,
            ") must return the micro-batch's loss (one element), got ", out.described());
      losses[i] = out.item();
    } else {
      send_activation(out);
    }
  }
  pp_.all_reduce(losses, Reduction::Sum);  // the last stage's values, zeros elsewhere
  return losses;
}

double PipelineSchedule::run(PipelineStage& stage, const std::vector<Tensor>& micro_batches) {
  const int P = pp_.size(), s = pp_.rank();
  const int64_t M = static_cast<int64_t>(micro_batches.size());
  const char* schedule_name = to_string(options_.schedule);
  // Every stage must run the same schedule over the same number of micro-batches, or the sends and
  // receives would not pair up and the job would hang: one small all-reduce turns that into an Error
  // on every rank. (max of x and of -x gives the largest and the smallest value.)
  {
    const double kind = options_.schedule == PipelineScheduleKind::GPipe ? 0 : 1;
    double missing = -1;  // the first micro-batch the first stage lacks the input of
    if (s == 0)
      for (int64_t m = M - 1; m >= 0; --m)
        if (!micro_batches[static_cast<size_t>(m)].defined()) missing = double(m);
    std::vector<double> agree = {double(M), -double(M), kind, -kind, missing};
    pp_.all_reduce(agree, Reduction::Max);
    check(agree[0] == -agree[1], "PipelineSchedule::run on the ", pp_.name(), " (stage ", s, " of ", P,
          "): the stages disagree on the number of micro-batches (", -agree[1], "..", agree[0], ")");
    check(agree[2] == -agree[3], "PipelineSchedule::run on the ", pp_.name(), " (stage ", s, " of ", P,
          "): the stages disagree on the schedule (some GPipe, some 1F1B)");
    check(agree[4] < 0, "PipelineSchedule::run on the ", pp_.name(), ": the first stage needs the input of ",
          "every micro-batch; micro-batch ", agree[4], " of ", M, " is undefined");
  }
  check(M >= 1, "PipelineSchedule::run (", schedule_name, ") on the ", pp_.name(),
        ": need at least one micro-batch");

  const bool first = s == 0, last = s == P - 1;
  const size_t n = static_cast<size_t>(M);
  std::vector<Tensor> inputs(n);        // received activations (leaves with requires_grad), stages > 0
  std::vector<Tensor> outputs(n);       // stage outputs (activation, or the loss on the last stage)
  std::vector<Tensor> output_grads(n);  // gradients received for the outputs, stages < P - 1
  std::vector<Tensor> input_grads(n);   // gradients to send back, stages > 0
  double loss_sum = 0;
  bool announced_scale = false;

  for (const PipelineOperation& op : pipeline_operations(options_.schedule, P, s, M)) {
    const size_t m = static_cast<size_t>(op.micro_batch);
    switch (op.kind) {
      case PipelineOperation::RecvForward: {
        Tensor activation = recv_activation();
        activation.requires_grad_(true);
        inputs[m] = activation;
        break;
      }
      case PipelineOperation::Forward: {
        Tensor out = stage.forward(first ? micro_batches[m] : inputs[m], op.micro_batch);
        check(out.defined(), "PipelineSchedule::run (", schedule_name, "): stage ", s, " of ", P,
              " returned an undefined tensor for micro-batch ", m);
        if (last) {
          check(out.numel() == 1, "PipelineSchedule::run (", schedule_name, "): the last stage (", s, " of ", P,
                ") must return the micro-batch's loss (one element), got ", out.described(),
                " for micro-batch ", m);
          loss_sum += out.item();
        }
        outputs[m] = out;
        break;
      }
      case PipelineOperation::SendForward: {
        send_activation(outputs[m]);
        break;
      }
      case PipelineOperation::RecvBackward: {
        // The gradient of what this stage sent: same shape and dtype, no header needed.
        Tensor grad = Tensor::empty(outputs[m].shape(), outputs[m].dtype(), options_.device);
        pp_.recv(grad, s + 1, kTagGradient);
        output_grads[m] = grad;
        break;
      }
      case PipelineOperation::Backward: {
        const Tensor& out = outputs[m];
        if (last) {
          // d(mean over the global batch)/d(loss_m) = 1 / M; times the AMP loss scale.
          Tensor scaled = options_.scale_loss ? options_.scale_loss(mul(out, 1.0 / double(M)))
                                              : mul(out, options_.loss_scale / double(M));
          if (scaled.requires_grad()) backward(scaled);
        } else {
          if (options_.scale_loss && !announced_scale) {
            options_.scale_loss(Tensor::scalar(0.0));
            announced_scale = true;
          }
          if (out.requires_grad()) backward({out}, {output_grads[m]});
        }
        if (!first) {
          // A stage that ignored its input sends zeros back.
          const Tensor g = inputs[m].grad();
          input_grads[m] = g.defined() ? g.contiguous()
                                       : Tensor::zeros(inputs[m].shape(), inputs[m].dtype(), inputs[m].device());
        }
        outputs[m] = Tensor();  // frees this micro-batch's activations (the graph went with backward)
        output_grads[m] = Tensor();
        inputs[m] = Tensor();
        break;
      }
      case PipelineOperation::SendBackward: {
        pp_.send(input_grads[m], s - 1, kTagGradient);
        input_grads[m] = Tensor();
        break;
      }
    }
  }

  // The mean loss lives on the last stage; a sum with zeros elsewhere hands it to every stage.
  std::vector<double> mean_loss = {last ? loss_sum / double(M) : 0.0};
  pp_.all_reduce(mean_loss, Reduction::Sum);
  return mean_loss[0];
}

std::vector<Tensor> split_micro_batches(const Tensor& batch, int64_t num_micro_batches) {
  check(batch.defined() && batch.dim() >= 1, "split_micro_batches: expected a batch with a leading batch dim, got ",
        batch.described());
  check(num_micro_batches >= 1, "split_micro_batches: need at least one micro-batch, got ", num_micro_batches);
  const int64_t B = batch.size(0);
  check(B % num_micro_batches == 0, "split_micro_batches: ", num_micro_batches,
        " micro-batches do not divide the batch ", batch.described(), " (batch size ", B,
        "); micro-batches must be of equal size so their mean losses average to the batch's");
  const int64_t size = B / num_micro_batches;
  std::vector<Tensor> out;
  for (int64_t m = 0; m < num_micro_batches; ++m) out.push_back(batch.narrow(0, m * size, size));
  return out;
}

Communicator make_embedding_group(const Communicator& pp) {
  const int P = pp.size(), s = pp.rank();
  const bool member = s == 0 || s == P - 1;
  return pp.split(member ? 0 : 1 + s, s, member ? "embedding group" : "embedding group (middle stage: alone)");
}

void all_reduce_tied_gradients(const Tensor& tied_weight, const Communicator& embedding_group) {
  check(tied_weight.defined(), "all_reduce_tied_gradients: the tied weight is undefined");
  if (embedding_group.size() == 1) return;
  Tensor grad = tied_weight.grad();
  if (!grad.defined()) {
    grad = Tensor::zeros(tied_weight.shape(), tied_weight.grad_dtype(), tied_weight.device());
    Tensor weight = tied_weight;
    weight.set_grad(grad);
  }
  if (grad.is_contiguous()) {
    embedding_group.all_reduce(grad, Reduction::Sum);
  } else {
    Tensor copy = grad.contiguous();
    embedding_group.all_reduce(copy, Reduction::Sum);
    grad.copy_(copy);
  }
}

void broadcast_tied_weight(const Tensor& tied_weight, const Communicator& embedding_group) {
  check(tied_weight.defined() && tied_weight.is_contiguous(), "broadcast_tied_weight: expected a defined, ",
        "contiguous weight");
  if (embedding_group.size() == 1) return;
  NoGradGuard no_grad;
  embedding_group.broadcast(tied_weight.detach(), 0);
}

}  // namespace mixtape::dist
