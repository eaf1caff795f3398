#pragma once
// The GPT trainer over a tp x pp x dp grid of processes (train_gpt under mpirun): the same training as the
// single-process Trainer (train/training.h) for the same options, at any layout.
//
//   every rank      builds the full GPT from options.seed on the CPU (so all start from the same weights),
//                   then keeps only its part: ParallelGPT over its tensor-parallel group (dist/tensor_parallel.h),
//                   and of that only the layers of its pipeline stage (stage s of pp holds an equal share of
//                   the blocks, the first stages one more when pp does not divide n_layer; the first stage also
//                   wte and wpe, the last ln_f and the lm_head: the tied wte weight, kept on both)
//   the batch       --batch is the GLOBAL batch: batch(step) is the single-process Trainer's batch; data-parallel
//                   rank d takes rows [d B/dp, (d+1) B/dp), split into `micro_batches` equal micro-batches that
//                   flow through the pipeline (GPipe or 1F1B). B must be divisible by dp * micro_batches.
//   precision       the mode's Booster converts the stage (naive / Apex O2 cast it) and runs each stage's
//                   forward (autocast or the input/output casts); the pipeline's last stage backpropagates
//                   loss_m / M times the loss scale, every other stage announces the scale to its optimizer
//   gradients       averaged over dp (fp32 buckets, dist/data_parallel.h; each bucket's all-reduce starts inside
//                   the last micro-batch's backward once its gradients are final), or reduce-scattered by ZeRO-1
//                   (dist/zero.h) after the backward; tied wte gradients summed between the first and the last stage
//   the step        found_inf all-reduced (MAX) over the model-parallel group (tp x pp; with ZeRO also dp), so
//                   every rank skips the same steps and keeps one loss scale; the gradient norm for clipping
//                   summed over the model-parallel group, each parameter counted once: a parameter replicated
//                   over tp counts on tp rank 0 only, the tied wte on the first stage only
//   the loss        reported: the mean over the global batch (the mean of the dp ranks' micro-batch means)
//
// Equality with one process: the same batches, the same initial weights and the same sums up to their order,
// so fp32 runs agree to rounding and the low-precision modes to the rounding of their 16-bit values (tests:
// tests/dist/test_parallel_training.cpp). Dropout too: every dropout of the GPT acts on a replicated [rows, T, C]
// activation, micro-batches draw in row order, and each data-parallel rank's streams start at its first row's
// offset, so the masks are the single process's.
//
// Checkpoints are layout-free: save_checkpoint gathers (over tp with the parameters' shard specs, over pp to
// world rank 0, ZeRO state over dp) and writes the single-process Trainer's file, byte layout and all: nanoGPT
// names, fp32 model tensors, the optimizer state under the single-process parameter indices. load_checkpoint
// reads that file on every rank and slices out this rank's part, so a run saved at any layout (or by the
// single-process Trainer) resumes at any other. Every collective method must be called on every rank.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dist/communicator.h"
#include "dist/groups.h"
#include "train/training.h"

namespace mixtape {

struct ParallelOptions {
  int tp = 1, pp = 1, dp = 1;
  int zero = 0;                    // ZeRO stage: 0 (off) or 1 (optimizer state and masters sharded over dp)
  int64_t micro_batches = 1;       // per data-parallel rank and step
  std::string pp_schedule = "1f1b";  // 1f1b | gpipe
  // Data-parallel gradient buckets (dist/data_parallel.h), in MiB of gradient; 0: one bucket per parameter.
  // PyTorch DDP's bucket_cap_mb and default. A bucket's all-reduce starts inside the last micro-batch's backward
  // as soon as its gradients are final, so smaller buckets start earlier (a model smaller than one bucket
  // reduces all at the end).
  double bucket_mb = 25.0;
  // Error naming the option (and the world size when tp * pp * dp differs from it).
  void validate(int world_size) const;
};

// The inputs and targets [batch, block] (i64) of step `step` (see train/training.h for the rule).
std::pair<Tensor, Tensor> training_batch(const TokenData& data, const TrainOptions& options, int64_t block,
                                         uint64_t data_seed, int64_t step);

class ParallelTrainer {
 public:
  // Collective over `world` (Communicator::world() under mpirun; a sub-group in tests). `data` must outlive it.
  ParallelTrainer(const GPTConfig& config, const TrainOptions& options, const ParallelOptions& parallel,
                  const TokenData& data, const dist::Communicator& world);
  ~ParallelTrainer();
  ParallelTrainer(const ParallelTrainer&) = delete;  // its pipeline's loss-scale hook refers to this object
  ParallelTrainer& operator=(const ParallelTrainer&) = delete;

  StepStats train_step();  // collective; the same StepStats on every rank
  double evaluate();       // collective; Trainer::evaluate's windows, spread over dp, pipelined over pp
  int64_t step() const { return step_; }

  // The single-process checkpoint, complete on world rank 0 (other ranks get an empty StateDict). Collective.
  StateDict checkpoint();
  void save_checkpoint(const std::string& path);  // collective; rank 0 writes (atomically)
  // Every rank passes the file's contents (each may read it itself). Validates as Trainer::load_checkpoint.
  void load_checkpoint(const StateDict& state);
  void load_weights(const StateDict& state);  // model weights only (--init)
  // The full model's weights (fp32, nanoGPT names), on every rank. Collective.
  StateDict full_weights();

  // Called in train_step after the pipeline's backward, before any gradient is reduced or stepped, with the
  // step number and this rank's stage (.grad: its scaled, local gradients): for tests that plant an inf on one rank.
  // While one is set, the data-parallel all-reduce runs after it instead of overlapping the backward.
  std::function<void(int64_t step, Module& stage)> gradient_hook;
  // Data-parallel buckets whose all-reduce started inside the last step's backward (0 without dp or ZeRO).
  int64_t buckets_overlapped() const;

  const dist::ParallelGroups& groups() const;
  Module& stage_module();  // this rank's parameters (nanoGPT names, shard shapes)
  int64_t skipped_steps() const;
  double loss_scale() const;

  struct Impl;  // train/parallel_training.cpp

 private:
  std::unique_ptr<Impl> impl_;
  int64_t step_ = 0;
};

}  // namespace mixtape
