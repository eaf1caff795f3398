#pragma once
// The GPT trainer's core (examples/train_gpt.cpp is its command line) and its training checkpoints.
//
// Data: a token sequence; the training split is the first floor(0.9 * N) tokens, validation the rest.
// A batch of step s (0 for the first optimizer step) has rows i = 0 .. batch-1 starting at
//   sequential: ((s * batch + i) * block) mod (n_train - block - 1)
//   random:     a Philox draw that depends only on (data seed, s, i), reduced mod (n_train - block - 1)
// Inputs are `block` tokens from the start, targets the same shifted by one. Since a batch is a pure
// function of (seed, step), the data sampler's whole state is its seed and the step.
//
// A training checkpoint is one safetensors file:
//   tensors   the model's state dict (nanoGPT names) and the optimizer's, prefixed "optimizer."
//             The model tensors are stored in fp32 whatever the precision mode (a 16-bit parameter is exactly
//             representable, and equals its fp32 master rounded), so generate and --init read every file;
//             loading converts them back to the model's dtypes. The masters and loss-scaler state are in
//             the optimizer part ("optimizer.master.<i>", "optimizer.scaler.<k>.*").
//   metadata  the GPT config (GPTConfig::to_metadata keys), "vocab" (char-level data: a JSON array of the
//             byte values, in token-id order), "optimizer.*" (the optimizer's metadata), "train.*" (every
//             option that shapes the trajectory, the precision mode "train.precision" and its options
//             "train.amp_config" included), "step" (optimizer steps done = the schedule position),
//             "data.seed", "data.position" (the next batch's step, always equal to "step": a file where they
//             differ is refused), "rng.<name>.seed|offset" for every dropout generator of the model.
// Loading it into a Trainer built with the same options restores everything, so the run continues bit for
// bit as if it had never stopped. A weights-only file (config + vocab + model tensors) is read by
// load_model_file (--init, generate); a training checkpoint also works there (its optimizer part is ignored).
#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "amp/booster.h"
#include "amp/config.h"
#include "nn/gpt.h"
#include "io/json.h"
#include "io/state_dict.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"

namespace mixtape {

struct TokenData {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> vocab;  // char-level: byte of token id t; empty for .bin token files
  int64_t vocab_size = 0;
  int64_t n_train() const { return static_cast<int64_t>(tokens.size()) * 9 / 10; }
  int64_t n_val() const { return static_cast<int64_t>(tokens.size()) - n_train(); }
};

// Character level: vocabulary = the sorted set of bytes in the file.
TokenData char_tokens(const std::string& text);
// *.bin -> little-endian uint16 ids, each checked < vocab_size (> 0 needed); any other file (.txt, or a name
// without extension) -> char_tokens of its bytes.
TokenData load_token_file(const std::string& path, int64_t vocab_size = 0);
// All of a file given as an input (`what` names it in errors: "train_gpt: data file"). A regular file or a
// pipe; a directory (which reads as empty) and a device or socket (/dev/zero never ends) are errors, as is a
// failed read.
std::string read_input_file(const std::string& what, const std::string& path);
// Whether a write to `a` or `b` would land in the other: the same inode when both exist, else the same path
// once symbolic links are followed (a dangling one too: a write creates its target) and made canonical.
bool same_file(const std::string& a, const std::string& b);

// "vocab" metadata <-> byte list. vocab_from_metadata accepts what char_tokens makes: a non-empty JSON array of
// byte values in strictly ascending order (the sorted set of a text's bytes; token id t is its t-th byte); an
// Error names the array's entry at fault ("entry 3 is 97, the same byte as entry 2 ...").
std::string vocab_to_metadata(const std::vector<uint8_t>& vocab);
std::vector<uint8_t> vocab_from_metadata(const std::string& text);
// The "vocab" entry of a file's metadata (empty when absent), of exactly vocab_size bytes (the model's: one per
// token id). A malformed one is an Error naming `what` (the file) and the entry: "<what>: metadata entry 'vocab':
// entry 3 is 97, ...", "<what>: metadata entry 'vocab': json: ...".
std::vector<uint8_t> metadata_vocab(const std::map<std::string, std::string>& metadata, const std::string& what,
                                    int64_t vocab_size);

struct TrainOptions {
  int64_t batch = 16;  // at most 2^32 rows, and batch x block at most 2^32 tokens
  int64_t steps = 1000;  // total optimizer steps; the cosine schedule decays over them
  double lr = 1e-3;
  double min_lr = 1e-4;
  int64_t warmup = 0;
  std::string optimizer = "adamw";  // sgd | adam | adamw
  double weight_decay = 0.1;  // lr x weight_decay at most 1: the decay factor 1 - lr x weight_decay stays >= 0
  double beta1 = 0.9;
  double beta2 = 0.99;
  double momentum = 0.9;  // sgd only
  std::string schedule = "cosine";  // constant | cosine
  double grad_clip = 1.0;  // 0 = off
  uint64_t seed = 1337;
  bool sequential = false;
  AmpConfig amp;  // precision mode (--precision / --amp-config); default fp32
  // Where the model, its optimizer state and the batches live. Not part of a checkpoint's identity: a run
  // saved on one device resumes on any other (the model is initialised on the CPU, then moved, so every
  // device starts from the same weights).
  Device device = Device::cpu();

  void validate() const;  // Error naming the option
  std::map<std::string, std::string> to_metadata() const;  // keys "train.<option>"
  static TrainOptions from_metadata(const std::map<std::string, std::string>& metadata);
};

struct StepStats {
  int64_t step = 0;  // the step number (0-based) this update was
  double loss = 0;   // the batch's loss before the update
  double lr = 0;     // the learning rate this step used (its schedule position: AmpConfig::schedule_position)
  double grad_norm = 0;  // of the unscaled gradients, before clipping (0 when the step was skipped)
  bool skipped = false;  // a gradient overflowed: the update was skipped and the loss scale backed off
  double loss_scale = 1;  // the scale this step's loss was multiplied by
  // Zero elements of the unscaled gradients (naive AMP's log_num_zeros_in_grad); -1: off, or a skipped step.
  int64_t num_zeros = -1;
  // Wall time of the step's phases: zero_grad, forward and loss (the loss read back); backward (the
  // booster's, loss scaling included); the optimizer step (unscale and overflow check, clipping, the update,
  // master weights copied back). The batch's sampling and the learning-rate schedule are in none of them.
  // Trainer fills them; ParallelTrainer leaves them 0 (its pipeline interleaves forward and backward).
  double forward_seconds = 0, backward_seconds = 0, optimizer_seconds = 0;
  // The fp8 / block-scaled modes: what this step's quantizations did per tensor kind (activation, weight,
  // gradient), and with fp8_delayed the scales the next step uses for the first covered Linear (by name,
  // transformer.h.0.attn.c_attn in a GPT); empty in the other modes.
  std::optional<std::array<QuantizationCounts, 3>> quantized;
  std::optional<std::array<float, 3>> delayed_scales;
  std::string delayed_scales_of;  // the weight those scales belong to
};

class Trainer {
 public:
  // Builds the model (initialised from options.seed) and the optimizer. `data` must outlive the trainer.
  Trainer(const GPTConfig& config, const TrainOptions& options, const TokenData& data);

  // Inputs and targets [batch, block] (i64) of step s.
  std::pair<Tensor, Tensor> batch(int64_t step) const;
  // One optimizer step on batch(step()), then step() advances.
  StepStats train_step();
  // Mean token loss over every non-overlapping validation window that fits (eval mode, no gradients).
  // Does not touch any random state. Error if the validation split is shorter than block + 1.
  double evaluate();

  int64_t step() const { return step_; }
  GPT& model() { return *model_; }
  // The wrapped optimizer: its parameters are the fp32 master weights when the mode keeps them.
  Optimizer& optimizer() { return optimizer_->optimizer(); }
  MixedPrecisionOptimizer& amp_optimizer() { return *optimizer_; }
  Booster& booster() { return booster_; }
  const TrainOptions& options() const { return options_; }

  // Called in train_step after backward, before the optimizer step, with the step number and the model (its
  // .grad hold the scaled gradients): for tests and experiments that inspect or plant gradients (an inf, say).
  std::function<void(int64_t step, Module& model)> gradient_hook;

  StateDict checkpoint();
  void save_checkpoint(const std::string& path);
  // Restores model, optimizer, step and random state. The checkpoint's config and options must equal this
  // trainer's (Error naming the first that differs, except "train.steps", which may be extended).
  void load_checkpoint(const StateDict& state);
  // Model weights only (strict), from a weights file or a training checkpoint.
  void load_weights(const StateDict& state);

 private:
  Tensor forward_loss(const Tensor& x, const Tensor& y);  // the mean loss, in fp32
  // The model part in the model's dtypes, each value checked finite there (Error naming `what` and the entry).
  StateDict model_part_in_model_dtypes(const StateDict& state, const char* what) const;

  GPTConfig config_;
  TrainOptions options_;
  const TokenData& data_;
  std::unique_ptr<GPT> model_;
  Booster booster_;
  std::unique_ptr<MixedPrecisionOptimizer> optimizer_;
  std::unique_ptr<LRSchedule> schedule_;
  uint64_t data_seed_;
  int64_t step_ = 0;
};

// The model tensors of a state dict (drops the "optimizer." and "amp_scaling." entries).
StateDict model_part(const StateDict& state);
// The optimizer part of a training checkpoint, "optimizer." stripped from tensor names and metadata keys.
StateDict optimizer_part(const StateDict& state);
// An optimizer's load_state_dict error with each entry it names ("entry 'state.3.exp_avg'") written as the
// checkpoint names it: file_key(key), by default "optimizer." + key ("entry 'optimizer.state.3.exp_avg'").
std::string optimizer_error_in_file_keys(std::string_view message,
                                         const std::function<std::string(const std::string&)>& file_key = {});

// ---- the pieces of a Trainer, shared with the parallel trainer (train/parallel_training.h) ----

// nanoGPT's two parameter groups: every parameter of >= 2 dims (matrices, embeddings) decays, biases and norm
// weights do not. optimizer_order gives the parameter names in the optimizer's order (the decay group, then the
// other, each in named_parameters order): a checkpoint's "optimizer.state.<i>.*" index i counts in it.
std::vector<std::string> optimizer_order(const Module& model);
std::unique_ptr<Optimizer> make_optimizer(const TrainOptions& options, const Module& model);
std::unique_ptr<LRSchedule> make_schedule(const TrainOptions& options);
uint64_t data_seed_of(const TrainOptions& options);
// Error naming --batch (train.batch) unless batch x block is at most 2^32 tokens (checked without overflow).
void check_tokens_per_step(const TrainOptions& options, int64_t block);
// The inputs and targets [batch, block] (i64) of step `step` (the rule at the top of this file).
std::pair<Tensor, Tensor> training_batch(const TokenData& data, const TrainOptions& options, int64_t block,
                                         uint64_t data_seed, int64_t step);
// Checks a training checkpoint against a trainer's config, options (all but train.steps) and data, compared as
// values ("1e30" is "1e+30", "True" is "true"); its train.* options with TrainOptions::validate's rules; that it
// holds optimizer state whose settings (betas, eps, momentum, dampening, nesterov, each group's weight decay) are
// those make_optimizer makes of the options; that its vocabulary is well formed (metadata_vocab); that its
// optimizer tensors are finite and that "step" (in [0, 2^53]) and "data.position" agree; returns its step. Error
// naming the first entry at fault, what the file has and what was expected.
int64_t validate_checkpoint(const StateDict& state, const GPTConfig& config, const TrainOptions& options,
                            const TokenData& data);
// The checkpoint's "rng.<name>.seed|offset" for every generator of `model` (Error if one is missing).
std::vector<std::pair<Generator*, Generator>> checkpoint_generators(const StateDict& state, Module& model);

// ---- sampling (generate, train_gpt --sample) ----

// Autoregressive sampling: appends n tokens to prompt_ids and returns those n new tokens (not the prompt).
// Token i (0-based among the new ones) is drawn from softmax(logits / temperature) of the last position of
// the window (the last min(length, block_size) tokens), restricted to the logits >= the top_k-th largest
// (top_k = 0 or >= vocab_size: all), by the inverse CDF (in token-id order, in double) at the uniform
// uniform_double_from_bits(philox4x32(i, 0, seed)). So a run is a pure function of (model, prompt, n,
// temperature, top_k, seed); top_k = 1 is greedy (argmax) whatever the seed, unless the top logits tie
// exactly (tied logits all stay in).
// Runs without gradients and in eval mode (no dropout), restoring the model's mode afterwards. on_token is
// called with each new token as soon as it is drawn (for streaming output).
// Errors: empty prompt, a prompt id outside [0, vocab_size), n < 0, temperature not > 0 and finite,
// top_k < 0.
std::vector<int64_t> sample_tokens(GPT& model, std::vector<int64_t> prompt_ids, int64_t n, double temperature,
                                   int64_t top_k, uint64_t seed,
                                   const std::function<void(int64_t)>& on_token = {});

// The token a sample starts from without a prompt: the newline of a character vocabulary when it has one,
// else token 0.
int64_t default_start_token(const std::vector<uint8_t>& vocab);

// The model saved in a weights file or checkpoint: config from its metadata, weights loaded strictly, eval
// mode. vocab receives the "vocab" metadata (empty when absent; checked by metadata_vocab). The tensors are
// checked against the config's parameter shapes (check_gpt_shapes) before the model is built. Every error
// names the file ("load_model_file: '<path>': ...").
std::unique_ptr<GPT> load_model_file(const std::string& path, std::vector<uint8_t>* vocab = nullptr);

// ---- the example programs' command lines and printed numbers ----

// A flag's value as an integer in [low, high], else Error "<program>: <flag> expects an integer in [<low>,
// <high>], got '<value>'" (empty, leading space, trailing characters or out of range included).
int64_t integer_argument(const std::string& program, const std::string& flag, const std::string& value,
                         int64_t low, int64_t high = INT64_MAX);
// A flag's value as a finite decimal number >= 0, else Error "<program>: <flag> expects a non-negative decimal
// number, got '<value>'" (hexadecimal, leading space and a value that would round to 0 or overflow included).
double number_argument(const std::string& program, const std::string& flag, const std::string& value);

// x with `digits` decimals, or "nan", "inf", "-inf" when it is not finite (printf may write "-nan").
std::string fixed_text(double x, int digits);

// An example program's main: run(argc, argv), or on an exception what it says as "error: ..." on stderr
// (after what was printed to stdout) and exit status 1.
int run_program(int (*run)(int, char**), int argc, char** argv);

// Numbers in train_gpt's --log-json lines. JSON has no NaN or infinity, so a non-finite number is written as
// null (log_value) and read back as NaN, as is an absent key (log_number).
Json log_value(double x);
double log_number(const Json* value);

}  // namespace mixtape
