// train_gpt: trains a GPT (nanoGPT's model) on a text file (character level; any name not ending in .bin) or
// a .bin file of uint16 token ids, with checkpoints that resume bit for bit. The training core lives in
// train/training.h.
//
//   train_gpt --data ../shared/data/tinyshakespeare.txt --steps 2000 --save ckpt.safetensors
//   train_gpt --data ... --resume ckpt.safetensors --steps 4000 --save ckpt.safetensors
//   train_gpt --data ... --init ckpt.safetensors --eval-only            -> "val_loss <x>"
//   train_gpt --data ... --steps 500 --sample 200 --temperature 0.8       -> a line "sample:", then the text
//
// --log-json FILE: one JSON object per step: step (0-based), loss (the batch's loss before the update), lr,
// grad_norm (before clipping; null on a skipped step, whose gradients were not finite), tokens_per_s (that
// step alone), loss_scale (the scale this step's loss was multiplied by), skipped, num_zeros (with naive
// AMP's log_num_zeros_in_grad: the zero elements of the unscaled gradients, absent on a skipped step; also on
// the progress line as "zeros"), val_loss on the steps that evaluated (after that step's update), and
// peak_rss_kib: this process's peak resident memory so far in KiB (VmHWM of /proc/self/status, after the step
// and its evaluation; absent where /proc has none). The fp8 and block-scaled modes add "fp8": for each tensor
// kind (activation, weight, gradient) the values this step quantized and the fractions of them that saturated
// and that flushed to zero; fp8_delayed also "fp8_scales": the scales of the first covered Linear after the step
// ("weight_of" names it). A loss that is not finite is written as null (JSON has no NaN). The plot_loss
// program (examples/plot_loss.cpp) turns it into a PNG.
//
// The progress line's "scale" is the loss scale after the step's update (the one the next step uses, as
// Megatron-LM logs it) and "skipped" counts the skipped steps since step 1, a resumed run's included.
//
// --threads auto (the default unless OMP_NUM_THREADS is set; one process only) lets a ThreadTuner
// (train/thread_tuner.h) set each step's OpenMP thread count between 1 and the machine's, by the time steps
// take: with another process busy on a core, fewer threads can be faster. --threads N fixes the count. The
// log's "threads" is the count a step ran with.
//
// The progress line's tok/s and ETA come from the time spent in training steps only (evaluation and
// checkpoint saves are left out); "elapsed" is wall-clock time since the first step of this run.
//
// Under mpirun it trains over processes (train/parallel_training.h):
//   mpirun -np 4 train_gpt --data ... --tp 2 --pp 2 [--micro-batches 4 --pp-schedule 1f1b|gpipe]
//   mpirun -np 2 train_gpt --data ... --dp 2 [--zero 1]
// --dp defaults to the processes left over by --tp x --pp. --batch stays the global batch, so a command line
// means the same training at every layout, and checkpoints (one full file, written by rank 0) resume at any
// layout. Rank 0 prints and logs; an error on any rank ends the whole job (MPI_Abort) with its message.
#include <omp.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "train/command_line.h"
#include "amp/policy.h"
#include "dist/world.h"
#include "train/parallel_training.h"
#include "train/thread_tuner.h"
#include "train/training.h"
#include "io/json.h"
#include "io/safetensors.h"
#include "io/state_dict.h"
#include "tensor/backend.h"

using namespace mixtape;

namespace {

struct Options {
  std::string data;
  int64_t vocab_size = 0;
  GPTConfig model;
  TrainOptions train;
  int64_t eval_every = 250;
  int64_t save_every = 0;
  int64_t stop_at = -1;
  std::string init, save, resume, log_json;
  std::string precision = "fp32", amp_config_file;  // --precision, --amp-config
  std::string amp_config_text;                       // the --amp-config file's JSON
  // --resume without --precision and an --amp-config that names no mode: the checkpoint's mode (run() parses
  // amp_config_text once the checkpoint is read).
  bool amp_mode_from_checkpoint = false;
  bool eval_only = false;
  bool show_amp_policy = false;  // --show-amp-policy (handled by show_amp_policy() before the training options)
  bool final_eval = true;  // --no-final-eval turns off the validation pass forced at the last step
  int64_t sample = 0;      // characters (tokens for .bin data) to sample after training
  double temperature = 0.8;
  int64_t top_k = 0;
  std::string threads = "auto";  // --threads: auto, or a fixed count
  ParallelOptions parallel;     // --tp --pp --dp --zero --micro-batches --pp-schedule --bucket-mb
  std::set<std::string> given;  // flags set on the command line
  bool distributed() const {
    for (const char* flag : {"--tp", "--pp", "--dp", "--zero", "--micro-batches", "--pp-schedule", "--bucket-mb"})
      if (given.count(flag)) return true;
    return false;
  }
};

// Started by mpirun / mpiexec (OpenMPI, or a PMI-based launcher)?
bool under_mpi_launcher() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"})
    if (std::getenv(name)) return true;
  return false;
}

// Whether a JSON config says its "mixed_precision" (or is not an object, or not JSON at all: those are
// reported by AmpConfig::from_json).
bool names_a_mode(const std::string& text) {
  try {
    const Json value = json::parse(text);
    return !value.is_object() || json::find(value, "mixed_precision") != nullptr;
  } catch (const Error&) {
    return true;
  }
}

// The --amp-config file's options, for `mode` when given (--precision, or a resumed checkpoint's mode).
AmpConfig amp_config_from_file(const Options& o, std::optional<std::string_view> mode) {
  try {
    return AmpConfig::from_json(o.amp_config_text, mode);
  } catch (const Error& error) {
    fail("train_gpt: --amp-config file '", echo(o.amp_config_file), "': ", error.what());
  }
}

// ---- the command line ----

// The defaults: a model small enough for a quick CPU run (about 0.2 M parameters).
Options default_options() {
  Options o;
  o.model.n_layer = 2;
  o.model.n_head = 4;
  o.model.n_embd = 64;
  o.model.block_size = 64;
  o.model.vocab_size = 0;
  o.model.bias = true;
  o.model.dropout = 0.0;
  o.train.batch = 16;
  o.train.steps = 1000;
  o.train.lr = 3e-3;
  o.train.min_lr = 3e-4;
  o.train.warmup = 20;
  return o;
}

void add_data_and_model_options(cli::CommandLine& cli, Options& o) {
  cli.app.option_defaults()->group("data and model");
  cli.required(cli.text("--data", o.data, "FILE", "training text (characters), or .bin: uint16 token ids; the "
                        "last tenth is the validation split"),
               "train_gpt: --data FILE is required (a text file for characters, or .bin for uint16 tokens)");
  cli.integer("--vocab-size", o.vocab_size, 1, "the token ids of .bin data (.bin only)");
  cli.integer("--layers", o.model.n_layer, 1, "transformer blocks (default 2)");
  cli.integer("--heads", o.model.n_head, 1, "attention heads, dividing --width (default 4)");
  cli.integer("--width", o.model.n_embd, 1, "embedding width (default 64)");
  cli.integer("--block", o.model.block_size, 1, "context length in tokens (default 64)");
  cli.number("--dropout", o.model.dropout, "dropout probability in [0, 1) (default 0)");
}

void add_training_options(cli::CommandLine& cli, Options& o) {
  cli.app.option_defaults()->group("training");
  cli.integer("--batch", o.train.batch, 1, "sequences per step (default 16; the global batch under mpirun)");
  cli.integer("--steps", o.train.steps, 0, "optimizer steps of the run (default 1000)");
  cli.number("--lr", o.train.lr, "peak learning rate (default 3e-3)");
  cli.number("--min-lr", o.train.min_lr,
             "the cosine schedule's floor (default 3e-4, or --lr / 10 when --lr is below 3e-4)");
  cli.integer("--warmup", o.train.warmup, 0, "linear warm-up steps (default 20)");
  cli.text("--optimizer", o.train.optimizer, "sgd|adam|adamw", "the optimizer (default adamw)");
  cli.number("--weight-decay", o.train.weight_decay, "decoupled weight decay (default 0.1)");
  cli.number("--beta1", o.train.beta1, "Adam's and AdamW's beta1 (default 0.9)");
  cli.number("--beta2", o.train.beta2, "Adam's and AdamW's beta2 (default 0.99)");
  cli.number("--momentum", o.train.momentum, "SGD's momentum (default 0.9)");
  cli.text("--schedule", o.train.schedule, "constant|cosine", "the learning-rate schedule (default cosine)");
  cli.number("--grad-clip", o.train.grad_clip, "gradient norm clip (0 = off; default 1)");
  cli.integer("--seed", o.train.seed, 0, "the seed of the weights, the batches and --sample (default 1337)");
  cli.flag("--sequential", o.train.sequential, true, "batches in order instead of drawn at random");
}

void add_precision_and_device_options(cli::CommandLine& cli, Options& o) {
  cli.app.option_defaults()->group("precision and device");
  cli.text("--precision", o.precision, precision_mode_list("|"), "the precision mode (default fp32)");
  cli.text("--amp-config", o.amp_config_file, "FILE.json", "the mode's options, e.g. {\"initial_scale\": "
           "65536}; it may name the mode as \"mixed_precision\"");
  cli.flag("--show-amp-policy", o.show_amp_policy, true, "print the --precision mode's autocast policy (which "
           "ops run in 16 bits, which in f32, which in their inputs' dtype) and exit; needs no --data");
  cli.device("--device", o.train.device, "default cpu; checkpoints move freely between devices; under mpirun, "
             "cuda means each rank's own GPU: local rank mod GPU count");
  cli.text("--threads", o.threads, "auto|N", "CPU threads: N fixes the count; auto (the default, unless "
           "OMP_NUM_THREADS is set or under mpirun) takes fewer while other processes keep cores busy");
}

void add_parallel_options(cli::CommandLine& cli, Options& o) {
  cli.app.option_defaults()->group("parallel (under mpirun -np N; --batch is the global batch, divisible by "
                                   "dp x micro-batches)");
  cli.integer("--tp", o.parallel.tp, 1, "tensor-parallel ranks");
  cli.integer("--pp", o.parallel.pp, 1, "pipeline stages");
  cli.integer("--dp", o.parallel.dp, 1, "data-parallel ranks (default N / (tp x pp))");
  cli.integer("--zero", o.parallel.zero, 0, "1: ZeRO-1 over dp (0 or 1)");
  cli.integer("--micro-batches", o.parallel.micro_batches, 1, "micro-batches per dp rank");
  cli.text("--pp-schedule", o.parallel.pp_schedule, "1f1b|gpipe", "the pipeline's order of micro-batches");
  cli.add("--bucket-mb", [&o](const std::string& value) {
    o.parallel.bucket_mb = number_argument("train_gpt", "--bucket-mb", value);
    // Converted to bytes as an int64 (and a bucket beyond any model's gradients means one bucket anyway).
    check(o.parallel.bucket_mb <= 1048576, "train_gpt: --bucket-mb expects at most 1048576 (1 TiB), got '",
          value, "'");
  }, "X", "dp gradient buckets in MiB, all-reduced during the backward (default 25, PyTorch DDP's)");
}

void add_run_options(cli::CommandLine& cli, Options& o) {
  cli.app.option_defaults()->group("checkpoints and output");
  cli.text("--init", o.init, "FILE", "start from this file's weights (its model shape)");
  cli.text("--save", o.save, "FILE", "write a checkpoint at the end (and every --save-every steps)");
  cli.integer("--save-every", o.save_every, 0, "steps between checkpoints (0 = only at the end)");
  cli.text("--resume", o.resume, "FILE", "continue the checkpoint's run, with its options (not with --init)");
  cli.integer("--stop-at", o.stop_at, 0, "stop after this step (a run to be resumed later)");
  cli.integer("--eval-every", o.eval_every, 0, "steps between validation passes (0 = only at the end; "
              "default 250)");
  cli.flag("--eval-only", o.eval_only, true, "print \"val_loss <x>\" of the loaded model, train nothing (so "
           "without the training options but --batch and --seed, and without --dropout, --micro-batches, "
           "--save, --save-every, --stop-at, --eval-every, --no-final-eval, --log-json)");
  cli.text("--log-json", o.log_json, "FILE", "a JSON line per step");
  cli.flag("--no-final-eval", o.final_eval, false,
           "skip the validation pass of the last step unless --eval-every hits it");
  cli.app.option_defaults()->group("sampling (after training, seeded with --seed; the sampler is generate's)");
  cli.integer("--sample", o.sample, 0, "a line \"sample:\", then N generated characters, or token ids for .bin "
              "data (0 = off)");
  cli.positive_number("--temperature", o.temperature, "sampling temperature, > 0 (default 0.8); needs --sample");
  cli.integer("--top-k", o.top_k, 0, "sample from the K likeliest tokens (0 = all, the default); needs --sample");
}

// Options that would be accepted and then do nothing, and options that exclude each other. The help says each
// rule once, in the text of the option that carries it (--resume, --eval-only, --top-k, --temperature).
void add_relations(cli::CommandLine& cli) {
  auto option = [&](const std::string& name) { return cli.app.get_option(name); };
  cli.excludes(option("--init"), option("--resume"), "train_gpt: --init and --resume exclude each other");
  for (const char* flag : {"--save", "--save-every", "--log-json", "--steps", "--stop-at", "--lr", "--min-lr",
                           "--warmup", "--optimizer", "--weight-decay", "--beta1", "--beta2", "--momentum",
                           "--schedule", "--grad-clip", "--eval-every", "--no-final-eval", "--sequential",
                           "--dropout", "--micro-batches"})
    cli.excludes(option("--eval-only"), option(flag),
                 std::string("train_gpt: --eval-only only evaluates: ") + flag + " has nothing to act on");
  for (const char* flag : {"--top-k", "--temperature"})
    cli.needs(option(flag), option("--sample"),
              std::string("train_gpt: ") + flag + " shapes --sample's tokens: give --sample N too");
}

// The precision mode and its options: --precision, or the --amp-config file (with --precision, or naming its
// mode, or taking a resumed checkpoint's).
void read_amp_options(Options& o) {
  if (o.given.count("--amp-config") == 0) {
    try {
      o.train.amp = AmpConfig::parse(o.precision);
    } catch (const Error& error) {
      fail("train_gpt: --precision '", echo(o.precision), "': ", error.what());
    }
    return;
  }
  o.amp_config_text = read_input_file("train_gpt: --amp-config file", o.amp_config_file);
  const bool mode_given = o.given.count("--precision") || names_a_mode(o.amp_config_text);
  check(mode_given || !o.resume.empty(), "train_gpt: --amp-config file '", echo(o.amp_config_file), "' names no "
        "mode: give --precision MODE, or \"mixed_precision\": \"MODE\" in the file");
  o.amp_mode_from_checkpoint = !mode_given;
  if (!o.amp_mode_from_checkpoint)
    o.train.amp = amp_config_from_file(o, o.given.count("--precision")
                                              ? std::optional<std::string_view>(o.precision)
                                              : std::nullopt);
}

// The checks of values against each other (the presence-only ones are CLI11's, in add_relations).
void check_combinations(const Options& o) {
  // Naive AMP's clip_grad replaces --grad-clip (Booster); both given and different would silently drop one.
  check(!(o.train.amp.is_naive() && o.train.amp.naive.clip_grad > 0 && o.given.count("--grad-clip") &&
          o.train.amp.naive.clip_grad != o.train.grad_clip),
        "train_gpt: --grad-clip ", exact_number_text(o.train.grad_clip), " conflicts with the --amp-config's "
        "clip_grad ", exact_number_text(o.train.amp.naive.clip_grad), " (naive AMP clips at its clip_grad; "
        "give one of them)");
  // The constant schedule has no warm-up and no floor: the rate is --lr at every step (--warmup 0 and
  // --min-lr equal to --lr say just that, and stay allowed).
  if (o.train.schedule == "constant") {
    check(!o.given.count("--warmup") || o.train.warmup == 0, "train_gpt: --warmup ", o.train.warmup, " shapes the "
          "cosine schedule; --schedule constant keeps --lr at every step");
    check(!o.given.count("--min-lr") || o.train.min_lr == o.train.lr, "train_gpt: --min-lr ",
          exact_number_text(o.train.min_lr), " shapes the cosine schedule; --schedule constant keeps --lr at "
          "every step");
  }
  // Hyperparameters of another optimizer than the run's, a stop beyond the end. (With --resume the run's are the
  // checkpoint's, and every given flag is compared with it in run().)
  if (o.resume.empty()) {
    const std::string& optimizer = o.train.optimizer;
    check(!o.given.count("--momentum") || optimizer == "sgd", "train_gpt: --momentum is SGD's, and the optimizer "
          "is ", optimizer, " (give --optimizer sgd, or leave --momentum out)");
    for (const char* flag : {"--beta1", "--beta2"})
      check(!o.given.count(flag) || optimizer != "sgd", "train_gpt: ", flag, " is Adam's and AdamW's, and the "
            "optimizer is sgd");
    check(o.stop_at < 0 || o.stop_at <= o.train.steps, "train_gpt: --stop-at ", o.stop_at, " is beyond --steps ",
          o.train.steps);
  }
  check(o.save_every == 0 || !o.save.empty(), "train_gpt: --save-every needs --save FILE");
  // The model's checks in the flags' names (GPTConfig's name its fields: "n_embd (16) must be divisible by
  // n_head (3)"). With --init/--resume the shape is the file's, and given shape flags must equal it.
  check(o.model.dropout < 1, "train_gpt: --dropout must be in [0, 1), got ", exact_number_text(o.model.dropout));
  check(!o.init.empty() || !o.resume.empty() || o.model.n_embd % o.model.n_head == 0, "train_gpt: --width ",
        o.model.n_embd, " must be divisible by --heads ", o.model.n_head, " (each head takes width / heads)");
}

// The options of the command line, or none when it asked for --help (printed).
std::optional<Options> parse(int argc, char** argv) {
  Options o = default_options();
  cli::CommandLine cli("train_gpt", "train_gpt: trains a GPT on a text file (characters) or a .bin file of "
                       "uint16 token ids; checkpoints resume bit for bit; under mpirun it trains over processes");
  add_data_and_model_options(cli, o);
  add_training_options(cli, o);
  add_precision_and_device_options(cli, o);
  add_parallel_options(cli, o);
  add_run_options(cli, o);
  add_relations(cli);
  if (!cli.parse(argc, argv)) return std::nullopt;
  o.given = cli.given_names();
  read_amp_options(o);
  check_combinations(o);
  if (o.given.count("--min-lr") == 0 && o.train.min_lr > o.train.lr) o.train.min_lr = o.train.lr / 10;
  return o;
}

// This process's peak resident memory since its exec in KiB (VmHWM in /proc/self/status), or -1 where there
// is none. Not getrusage's ru_maxrss: a child started by posix_spawn (vfork) gets its parent's peak in that.
int64_t peak_rss_kib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::strtoll(line.c_str() + 6, nullptr, 10);
  return -1;
}

std::string format_seconds(double s) {
  char buffer[32];
  const long long t = static_cast<long long>(std::llround(s));
  std::snprintf(buffer, sizeof(buffer), "%lld:%02lld", t / 60, t % 60);
  return buffer;
}

// "sample:" and then opt.sample tokens from the model (characters, or space-separated ids without a
// vocabulary), from the vocabulary's newline (token 0 without one), seeded with the training seed.
void print_sample(const Options& opt, GPT& model, const std::vector<uint8_t>& vocab) {
  std::printf("sample:\n");
  std::fflush(stdout);
  sample_tokens(model, {default_start_token(vocab)}, opt.sample, opt.temperature, opt.top_k, opt.train.seed,
                [&, first = true](int64_t next) mutable {
                  if (!vocab.empty()) {
                    check(next < static_cast<int64_t>(vocab.size()), "train_gpt: sampled token ", next,
                          " has no entry in the vocabulary");
                    std::fputc(vocab[next], stdout);
                  } else {
                    std::printf(first ? "%lld" : " %lld", static_cast<long long>(next));
                  }
                  first = false;
                });
  std::printf("\n");
  std::fflush(stdout);
}

// The files the run writes must not be the ones it reads, or each other (a log over the data, a checkpoint
// over the log): those runs would end with exit code 0 and a file lost. --save onto --resume's or --init's
// file is how a run continues in place, and stays allowed.
void check_outputs(const Options& o) {
  const std::pair<const char*, const std::string*> inputs[] = {
      {"--data", &o.data}, {"--init", &o.init}, {"--resume", &o.resume}, {"--amp-config", &o.amp_config_file}};
  for (const auto& [output, path] : {std::pair<const char*, const std::string*>{"--save", &o.save},
                                     {"--log-json", &o.log_json}}) {
    if (path->empty()) continue;
    for (const auto& [input, other] : inputs) {
      if (other->empty() || (std::string_view(output) == "--save" && (&o.init == other || &o.resume == other)))
        continue;
      check(!same_file(*path, *other), "train_gpt: ", output, " '", echo(*path), "' is the ", input,
            " file: the run would overwrite what it reads");
    }
  }
  check(o.save.empty() || o.log_json.empty() || !same_file(o.save, o.log_json), "train_gpt: --save and "
        "--log-json name the same file '", echo(o.save), "'");
  // What save_safetensors would refuse, before the training rather than after it.
  if (!o.save.empty()) {
    const SaveTarget where = save_target(o.save);
    check(where.problem.empty(), "train_gpt: --save '", echo(o.save), "' ", where.problem);
  }
}

// Options of parallelism that would have nothing to act on in the run's layout, known only once the job's
// size has given --dp its default (the ranks tp x pp leave over).
void check_parallel_flags(const Options& o, int dp) {
  check(!o.given.count("--pp-schedule") || o.parallel.pp > 1, "train_gpt: --pp-schedule orders a pipeline's "
        "micro-batches, and this run has one stage (give --pp N > 1, or leave --pp-schedule out)");
  check(!o.given.count("--bucket-mb") || (dp > 1 && !o.parallel.zero), "train_gpt: --bucket-mb sizes the "
        "buckets data parallelism averages gradients in, and this run ",
        dp > 1 ? "shards them with ZeRO-1 instead" : "has one data-parallel rank", " (leave --bucket-mb out)");
}

// Runs `body`, naming the file in an error it throws that does not name it already: the checks behind a load
// know the entry at fault, not which of the command's files it came from.
template <class F>
auto naming_file(const char* flag, const std::string& file, F&& body) {
  try {
    return body();
  } catch (const Error& error) {
    std::string_view message = error.what();
    if (message.find(echo(file)) != std::string_view::npos) throw;
    if (message.starts_with("train_gpt: ")) message.remove_prefix(11);  // said once, in front
    fail("train_gpt: ", flag, " '", echo(file), "': ", message);
  }
}

// ---- the run ----

// One process, or one rank of a parallel job: the run sees either through Engine.
struct Engine {
  std::unique_ptr<Trainer> single;
  std::unique_ptr<ParallelTrainer> parallel;
  bool printer = true;  // rank 0 prints, logs and samples

  int64_t position() const { return single ? single->step() : parallel->step(); }
  double evaluate() { return single ? single->evaluate() : parallel->evaluate(); }
  StepStats train_step() { return single ? single->train_step() : parallel->train_step(); }
  double loss_scale() { return single ? single->amp_optimizer().loss_scale() : parallel->loss_scale(); }
  int64_t skipped_steps() { return single ? single->amp_optimizer().skipped_steps() : parallel->skipped_steps(); }
  void load_weights(const StateDict& state) { single ? single->load_weights(state) : parallel->load_weights(state); }
  void load_checkpoint(const StateDict& state) {
    single ? single->load_checkpoint(state) : parallel->load_checkpoint(state);
  }
  void save_checkpoint(const std::string& path) {
    single ? single->save_checkpoint(path) : parallel->save_checkpoint(path);
  }
};

TokenData load_data(const Options& opt) {
  TokenData data = load_token_file(opt.data, opt.vocab_size);
  check(!data.tokens.empty(), "train_gpt: --data '", echo(opt.data), "' holds no tokens (an empty file?)");
  return data;
}

// The shape flags given beside --init / --resume must equal the loaded file's shape.
void check_shape_flags(const Options& opt, const GPTConfig& file_config) {
  const std::pair<const char*, int64_t> shape[] = {{"--layers", file_config.n_layer},
                                                   {"--heads", file_config.n_head},
                                                   {"--width", file_config.n_embd},
                                                   {"--block", file_config.block_size}};
  const int64_t mine[] = {opt.model.n_layer, opt.model.n_head, opt.model.n_embd, opt.model.block_size};
  for (int k = 0; k < 4; ++k)
    check(opt.given.count(shape[k].first) == 0 || mine[k] == shape[k].second, "train_gpt: ", shape[k].first, " ",
          mine[k], " differs from the ", shape[k].second, " in the loaded file");
}

// The training flags given beside --resume must equal the checkpoint's options (--amp-config: those that
// change the training).
void check_flags_match_checkpoint(const Options& opt, const TrainOptions& file_options) {
  const auto mine_meta = opt.train.to_metadata();
  const auto file_meta = file_options.to_metadata();
  static const std::pair<const char*, const char*> flags[] = {
      {"--batch", "train.batch"}, {"--lr", "train.lr"}, {"--min-lr", "train.min_lr"},
      {"--warmup", "train.warmup"}, {"--optimizer", "train.optimizer"},
      {"--weight-decay", "train.weight_decay"}, {"--beta1", "train.beta1"}, {"--beta2", "train.beta2"},
      {"--momentum", "train.momentum"}, {"--schedule", "train.schedule"}, {"--grad-clip", "train.grad_clip"},
      {"--seed", "train.seed"}, {"--sequential", "train.sequential"}, {"--precision", "train.precision"},
      {"--amp-config", "train.amp_config"}};
  for (const auto& [flag, key] : flags)
    check(opt.given.count(flag) == 0 || mine_meta.at(key) == file_meta.at(key) ||
              std::string_view(flag) == "--amp-config",  // compared option by option below
          "train_gpt: ", flag, " ", mine_meta.at(key), " differs from the checkpoint's ",
          file_meta.at(key),
          " (a resumed run keeps the checkpoint's options)");
  // --amp-config may change what is printed (verbose, verbosity, log_num_zeros_in_grad), nothing else.
  if (opt.given.count("--amp-config")) {
    const std::string differences =
        opt.train.amp.training_differences(file_options.amp, "the checkpoint's");
    check(differences.empty(), "train_gpt: --amp-config differs from the checkpoint's AMP options in ",
          differences, "; a resumed run keeps the checkpoint's options (only verbose, verbosity "
          "and log_num_zeros_in_grad may change)");
  }
}

// Training options come from the checkpoint (so the run continues exactly); --steps may extend it.
void adopt_checkpoint_options(Options& opt, const StateDict& header) {
  const int64_t steps = opt.train.steps;
  const TrainOptions file_options = TrainOptions::from_metadata(header.metadata);
  if (opt.amp_mode_from_checkpoint) opt.train.amp = amp_config_from_file(opt, file_options.amp.name());
  check_flags_match_checkpoint(opt, file_options);
  const AmpConfig amp = opt.given.count("--amp-config") ? opt.train.amp : file_options.amp;
  opt.train = file_options;
  opt.train.amp = amp;
  if (opt.given.count("--steps")) opt.train.steps = steps;
}

// The loaded file's character vocabulary against the data's.
void check_vocabulary(const Options& opt, const TokenData& data, const StateDict& header, const std::string& file) {
  const char* flag = opt.init.empty() ? "--resume" : "--init";
  const std::vector<uint8_t> file_vocab =
      metadata_vocab(header.metadata, std::string("train_gpt: ") + flag + " '" + echo(file) + "'",
                     opt.model.vocab_size);
  if (!data.vocab.empty() && header.metadata.count("vocab"))
    check(file_vocab == data.vocab,
          "train_gpt: the character vocabulary of '", echo(opt.data), "' differs from the loaded file's");
  // Text data is its bytes' vocabulary: a model of another size (a token model, without a character
  // vocabulary) would be saved with a vocabulary list that does not match it, which generate refuses,
  // and --sample would draw ids that are no byte of the text.
  check(data.vocab.empty() || opt.model.vocab_size == data.vocab_size, "train_gpt: '", echo(opt.data),
        "' is text of ", data.vocab_size, " distinct bytes (its vocabulary), but the model of '", echo(file),
        "' has vocab_size ", opt.model.vocab_size, " and no character vocabulary of that text: give it data "
        "in its own tokens (a .bin file with --vocab-size ", opt.model.vocab_size, ")");
}

// The model shape comes from the --init / --resume file when given; its model flags must then agree.
void adopt_loaded_file(Options& opt, const TokenData& data) {
  const std::string file = opt.init.empty() ? opt.resume : opt.init;
  const char* file_flag = opt.init.empty() ? "--resume" : "--init";
  naming_file(file_flag, file, [&] {
    const StateDict header = load_safetensors(file);
    const GPTConfig file_config = GPTConfig::from_metadata(header.metadata);
    // Before a model of the metadata's size is built: its tensors must be that model's parameters.
    check_gpt_shapes(file_config, model_part(header).tensors, "train_gpt: '" + file + "'");
    check_shape_flags(opt, file_config);
    const double dropout = opt.model.dropout;
    opt.model = file_config;
    if (opt.given.count("--dropout")) opt.model.dropout = dropout;
    if (!opt.resume.empty()) {
      adopt_checkpoint_options(opt, header);
      check(opt.given.count("--dropout") == 0 || dropout == file_config.dropout,
            "train_gpt: --dropout differs from the checkpoint's ", file_config.dropout);
    }
    check_vocabulary(opt, data, header, file);
  });
}

// The model's vocabulary and block against the data, before any training.
void check_data_fits(const Options& opt, const TokenData& data) {
  // Only a loaded model can be smaller than the data (a new one is made to its size).
  check(data.vocab_size <= opt.model.vocab_size, "train_gpt: the data uses ", data.vocab_size, " token ids",
        data.vocab.empty() ? " (--vocab-size)" : "", " but the model of '",
        echo(opt.init.empty() ? opt.resume : opt.init), "' has vocab_size ", opt.model.vocab_size);
  // A validation pass needs one window of block + 1 tokens: checked before the training, not after it.
  if (opt.eval_only || opt.final_eval || opt.eval_every > 0)
    check(data.n_val() > opt.model.block_size, "train_gpt: the validation split of '", echo(opt.data), "' (",
          data.n_val(), " tokens, the last tenth) is shorter than block + 1 = ", opt.model.block_size + 1,
          " (use a smaller --block, or --eval-every 0 --no-final-eval)");
}

// This rank's place in a parallel job: --dp's default (the ranks tp x pp leave over) and its GPU.
void place_on_world(Options& opt, const dist::World& world) {
  if (!opt.given.count("--dp")) {
    const int model_parallel = opt.parallel.tp * opt.parallel.pp;
    check(world.size % model_parallel == 0, "train_gpt: --tp ", opt.parallel.tp, " x --pp ", opt.parallel.pp,
          " = ", model_parallel, " does not divide the job's ", world.size, " processes");
    opt.parallel.dp = world.size / model_parallel;
  }
  check_parallel_flags(opt, opt.parallel.dp);
  // --device cuda: this rank's own GPU (Device::cuda says so when there is none: no silent CPU fallback).
  if (opt.train.device.is_cuda()) {
    const int count = cuda_device_count();
    opt.train.device = Device::cuda(count > 0 ? world.local_rank % count : 0);
  }
}

// The trainer of this process (or rank), with the --init or --resume file loaded.
Engine make_engine(Options& opt, const TokenData& data) {
  Engine engine;
  const bool distributed = opt.distributed() || (under_mpi_launcher() && dist::init().size > 1);
  if (distributed) {
    const dist::World& world = dist::init();
    place_on_world(opt, world);
    engine.printer = world.rank == 0;
    engine.parallel = std::make_unique<ParallelTrainer>(opt.model, opt.train, opt.parallel, data,
                                                        dist::Communicator::world());
  } else {
    check_parallel_flags(opt, 1);
    engine.single = std::make_unique<Trainer>(opt.model, opt.train, data);
  }
  if (!opt.init.empty()) naming_file("--init", opt.init, [&] { engine.load_weights(load_safetensors(opt.init)); });
  if (!opt.resume.empty())
    naming_file("--resume", opt.resume, [&] { engine.load_checkpoint(load_safetensors(opt.resume)); });
  return engine;
}

// After training: --sample's tokens (a parallel job gathers the full weights, complete on rank 0).
void sample_after_training(const Options& opt, Engine& engine, const TokenData& data) {
  if (opt.sample <= 0) return;
  if (engine.single) return print_sample(opt, engine.single->model(), data.vocab);
  const StateDict weights = engine.parallel->full_weights();  // collective; complete on rank 0
  if (!engine.printer) return;
  GPT model(opt.model, 0);
  model.load_state_dict(weights);
  print_sample(opt, model, data.vocab);
}

// The parallel layout for the header line: the sizes above 1, e.g. "4 processes: tp 2, pp 2 (1f1b), 4
// micro-batches per dp rank" or "2 processes: dp 2, ZeRO-1" or "2 processes: dp 2 (25 MiB gradient buckets)".
std::string layout_text(const ParallelOptions& p) {
  std::vector<std::string> parts;
  if (p.tp > 1) parts.push_back("tp " + std::to_string(p.tp));
  if (p.pp > 1) parts.push_back("pp " + std::to_string(p.pp) + " (" + p.pp_schedule + ")");
  if (p.dp > 1 && !p.zero) {
    char buckets[64];
    std::snprintf(buckets, sizeof(buckets), " (%g MiB gradient buckets)", p.bucket_mb);
    parts.push_back("dp " + std::to_string(p.dp) + buckets);
  } else if (p.dp > 1) {
    parts.push_back("dp " + std::to_string(p.dp));
  }
  if (p.zero) parts.push_back("ZeRO-1");
  if (p.micro_batches > 1) parts.push_back(std::to_string(p.micro_batches) + " micro-batches per dp rank");
  std::string text = std::to_string(p.tp * p.pp * p.dp) + (p.tp * p.pp * p.dp == 1 ? " process" : " processes");
  for (size_t i = 0; i < parts.size(); ++i) text += (i == 0 ? ": " : ", ") + parts[i];
  return text;
}

// The header line (data, model, optimizer, precision, device and layout), and where a resumed run stands.
void print_header(const Options& opt, const TokenData& data, const Engine& engine) {
  const GPTConfig& c = opt.model;
  const GPT shape_only(c, 0);
  std::string where = opt.train.device.is_cpu() ? "" : " | device " + opt.train.device.str();
  if (engine.parallel) where += " | " + layout_text(opt.parallel);
  std::printf("train_gpt: %s: %zu tokens (train %lld, val %lld), vocab %lld | model %lld layers, %lld heads, "
              "width %lld, block %lld, dropout %g, %lld parameters | %s, lr %g -> %g (%s, warmup %lld), batch "
              "%lld, %lld steps | precision %s%s\n",
              opt.data.c_str(), data.tokens.size(), static_cast<long long>(data.n_train()),
              static_cast<long long>(data.n_val()), static_cast<long long>(data.vocab_size),
              static_cast<long long>(c.n_layer), static_cast<long long>(c.n_head), static_cast<long long>(c.n_embd),
              static_cast<long long>(c.block_size), c.dropout, static_cast<long long>(shape_only.num_parameters()),
              opt.train.optimizer.c_str(), opt.train.lr, opt.train.min_lr, opt.train.schedule.c_str(),
              static_cast<long long>(opt.train.warmup), static_cast<long long>(opt.train.batch),
              static_cast<long long>(opt.train.steps), opt.train.amp.name().c_str(), where.c_str());
  const int64_t position = engine.position();
  if (position > 0) std::printf("resumed at step %lld\n", static_cast<long long>(position));
  if (position > 0 && position >= opt.train.steps)
    std::printf("train_gpt: nothing to train: the checkpoint is at step %lld and --steps is %lld (give a "
                "larger --steps to go on)\n",
                static_cast<long long>(position), static_cast<long long>(opt.train.steps));
  std::fflush(stdout);
}

// --stop-at against a resumed run (parse() checked a fresh one): within its steps (the checkpoint's, unless
// --steps is given), and not before the step it resumes at (it trained nothing and rewrote the checkpoint).
void check_resumed_stop(const Options& opt, const Engine& engine) {
  if (opt.stop_at < 0 || opt.resume.empty()) return;
  const int64_t position = engine.position();
  check(opt.stop_at <= opt.train.steps, "train_gpt: --stop-at ", opt.stop_at, " is beyond the run's ",
        opt.train.steps, " steps (", opt.given.count("--steps") ? "--steps" : "the checkpoint's --steps", ")");
  check(opt.stop_at >= position, "train_gpt: --stop-at ", opt.stop_at, " is before step ", position,
        ", where --resume '", echo(opt.resume), "' continues: there is nothing to train up to it");
  if (engine.printer && opt.stop_at == position && position < opt.train.steps)
    std::printf("train_gpt: nothing to train: the checkpoint is at step %lld, --stop-at's step\n",
                static_cast<long long>(position));
}

// A checkpoint that cannot be written is reported before the training it is to keep, not after it.
void check_save_target(const Options& opt) {
  if (opt.save.empty()) return;
  const std::filesystem::path parent = std::filesystem::path(opt.save).parent_path();
  check(parent.empty() || std::filesystem::is_directory(parent), "train_gpt: cannot write --save '",
        opt.save, "': the directory '", parent.string(), "' does not exist");
  // A directory that takes no new file (read-only, /proc) passes the check above: a file is created there
  // (and removed) to find it before the training.
  const SaveTarget where = save_target(opt.save, /*try_create=*/true);
  check(where.problem.empty(), "train_gpt: --save '", echo(opt.save), "' ", where.problem);
}

// The --log-json file (rank 0's), appended to by a resumed run.
std::ofstream open_log(const Options& opt, const Engine& engine) {
  std::ofstream log;
  if (!opt.log_json.empty() && engine.printer) {
    errno = 0;
    log.open(opt.log_json, engine.position() > 0 ? std::ios::app : std::ios::trunc);
    const int error = errno;  // the open(2) behind the stream sets it
    check(log.good(), "train_gpt: cannot open --log-json file '", echo(opt.log_json), "'",
          error != 0 ? std::string(": ") + std::strerror(error) : std::string());
  }
  return log;
}

void save_run(const Options& opt, Engine& engine) {
  if (opt.save.empty()) return;
  engine.save_checkpoint(opt.save);
  if (engine.printer)
    std::printf("saved %s at step %lld\n", opt.save.c_str(), static_cast<long long>(engine.position()));
}

// What a step's log line and progress line report.
struct StepReport {
  StepStats stats;
  int64_t step = 0;              // optimizer steps done, this one included
  double step_tokens_per_s = 0;  // this step alone (the log's)
  double tokens_per_s = 0;       // this run's training steps so far (the progress line's)
  double elapsed = 0, eta = 0;   // seconds
  bool evaluated = false;
  double val_loss = NAN;  // after this step's update, when evaluated
  int threads = 0;        // the OpenMP threads the step ran with
};

// Whether the mode scales its loss: the progress line then shows the scale and the skipped steps.
bool scales_loss(const AmpConfig& amp) { return amp.family() != ModeFamily::Plain; }

void warn_non_finite_loss(const Options& opt, const StepStats& s) {
  const AmpConfig& amp = opt.train.amp;
  const bool fp16 = amp.autocast_dtype() == DType::F16 || amp.model_dtype() == DType::F16;
  std::printf("train_gpt: warning: step %lld: the loss is %s: %s (try a lower --lr)\n",
              static_cast<long long>(s.step + 1), fixed_text(s.loss, 4).c_str(),
              fp16 ? "the forward pass overflowed fp16's range (65504) or training diverged"
                   : "training diverged");
}

void write_log_line(std::ofstream& log, const Options& opt, const StepReport& r) {
  const StepStats& s = r.stats;
  Json line = Json::object({{"step", s.step}, {"loss", log_value(s.loss)}, {"lr", s.lr},
                            {"grad_norm", s.skipped ? Json() : log_value(s.grad_norm)},
                            {"tokens_per_s", r.step_tokens_per_s},
                            {"loss_scale", s.loss_scale}, {"skipped", s.skipped}, {"threads", r.threads}});
  if (s.num_zeros >= 0) line.emplace("num_zeros", s.num_zeros);
  if (r.evaluated) line.emplace("val_loss", log_value(r.val_loss));
  if (s.quantized) {
    Json fp8 = Json::object();
    for (size_t k = 0; k < s.quantized->size(); ++k) {
      const QuantizationCounts& c = (*s.quantized)[k];
      const double n = c.values > 0 ? static_cast<double>(c.values) : 1.0;
      fp8.emplace(tensor_kind_name(static_cast<TensorKind>(k)),
                  Json::object({{"values", c.values}, {"saturated", static_cast<double>(c.saturated) / n},
                                {"flushed", static_cast<double>(c.flushed) / n}}));
    }
    line.emplace("fp8", std::move(fp8));
  }
  if (s.delayed_scales) {
    Json scales = Json::object({{"weight_of", s.delayed_scales_of}});
    for (size_t k = 0; k < s.delayed_scales->size(); ++k)
      scales.emplace(tensor_kind_name(static_cast<TensorKind>(k)), (*s.delayed_scales)[k]);
    line.emplace("fp8_scales", std::move(scales));
  }
  if (const int64_t kib = peak_rss_kib(); kib > 0) line.emplace("peak_rss_kib", kib);
  log << json::dump(line) << '\n';
  log.flush();
  // A full disk or a failing device: the log would stop mid-line with exit code 0.
  check(log.good(), "train_gpt: cannot write --log-json file '", echo(opt.log_json), "' at step ", r.step,
        " (disk full?)");
}

void print_progress(const Options& opt, Engine& engine, const StepReport& r) {
  const StepStats& s = r.stats;
  const std::string grad_norm = s.skipped ? "n/a (skipped)" : fixed_text(s.grad_norm, 3);
  std::printf("step %5lld/%lld | loss %s | lr %.2e | grad norm %s | %.0f tok/s | %s elapsed | ETA %s",
              static_cast<long long>(r.step), static_cast<long long>(opt.train.steps),
              fixed_text(s.loss, 4).c_str(), s.lr, grad_norm.c_str(), r.tokens_per_s,
              format_seconds(r.elapsed).c_str(), format_seconds(r.eta).c_str());
  if (scales_loss(opt.train.amp))
    std::printf(" | scale %s | skipped %lld", exact_number_text(engine.loss_scale()).c_str(),
                static_cast<long long>(engine.skipped_steps()));
  if (s.num_zeros >= 0) std::printf(" | zeros %lld", static_cast<long long>(s.num_zeros));
  if (r.evaluated) std::printf(" | val loss %s", fixed_text(r.val_loss, 4).c_str());
  std::printf("\n");
  std::fflush(stdout);
}

// The training loop up to --steps (or --stop-at): each step, its evaluation when due (after its update), its
// log line, its progress line, and a checkpoint when due.
void train_loop(const Options& opt, Engine& engine, std::ofstream& log, ThreadTuner* tuner) {
  const int64_t end = opt.stop_at >= 0 ? std::min(opt.stop_at, opt.train.steps) : opt.train.steps;
  const int64_t first = engine.position();
  const int64_t tokens_per_step = opt.train.batch * opt.model.block_size;
  const auto start = std::chrono::steady_clock::now();
  double train_seconds = 0;  // inside train_step only: the rate excludes evaluations and saves
  bool warned_non_finite = false;  // the first non-finite loss is explained once
  while (engine.position() < end) {
    if (tuner) omp_set_num_threads(tuner->next_threads());
    const int threads = omp_get_max_threads();
    const auto t0 = std::chrono::steady_clock::now();
    StepReport r{.stats = engine.train_step(), .threads = threads};
    const auto t1 = std::chrono::steady_clock::now();
    const double step_seconds = std::chrono::duration<double>(t1 - t0).count();
    if (tuner) {
      tuner->record(step_seconds);
      omp_set_num_threads(tuner->current());  // evaluations and saves run at the count between probes
    }
    train_seconds += step_seconds;
    r.elapsed = std::chrono::duration<double>(t1 - start).count();
    r.step = engine.position();
    const int64_t done = r.step - first;
    r.step_tokens_per_s = double(tokens_per_step) / step_seconds;
    r.tokens_per_s = double(done * tokens_per_step) / train_seconds;
    // Remaining steps at the training step rate so far (future evaluations and saves are not included).
    r.eta = train_seconds / double(done) * double(end - r.step);
    const bool last = r.step == end;
    r.evaluated = (opt.eval_every > 0 && r.step % opt.eval_every == 0) || (last && opt.final_eval);
    if (r.evaluated) r.val_loss = engine.evaluate();
    if (engine.printer && !warned_non_finite && !std::isfinite(r.stats.loss)) {
      warned_non_finite = true;
      warn_non_finite_loss(opt, r.stats);
    }
    if (log.is_open()) write_log_line(log, opt, r);
    if (engine.printer && (last || r.evaluated || done == 1 || r.step % 10 == 0)) print_progress(opt, engine, r);
    if (opt.save_every > 0 && r.step % opt.save_every == 0 && !last) save_run(opt, engine);
  }
}

// --threads auto: the tuner, unless OpenMP's count was chosen through its environment, the steps run on a GPU,
// or the run is one rank of a parallel job (whose ranks step together: one rank's count would change every
// rank's step time).
std::optional<ThreadTuner> thread_tuner(const Options& opt, const Engine& engine) {
  if (opt.threads != "auto" || std::getenv("OMP_NUM_THREADS") || !opt.train.device.is_cpu() || engine.parallel)
    return std::nullopt;
  return ThreadTuner(omp_get_max_threads(), engine.position());
}

// Whether the command line asks for --show-amp-policy (before a "--").
bool show_amp_policy_requested(int argc, char** argv) {
  for (int i = 1; i < argc && std::strcmp(argv[i], "--") != 0; ++i)
    if (std::strcmp(argv[i], "--show-amp-policy") == 0) return true;
  return false;
}

// train_gpt --precision MODE --show-amp-policy: the mode's autocast policy table (amp/policy.h), or the line
// saying the mode autocasts nothing. It reads --precision only, so it needs none of the training options.
int show_amp_policy(int argc, char** argv) {
  std::string precision = "fp32";
  bool show = false;
  cli::CommandLine cli("train_gpt", "train_gpt --show-amp-policy: prints a precision mode's autocast policy");
  cli.text("--precision", precision, precision_mode_list("|"), "the precision mode (default fp32)");
  cli.flag("--show-amp-policy", show, true, "print the mode's autocast policy and exit");
  cli.help_on_unknown = false;
  cli.unknown_message = [](const std::string& arg) {
    return "train_gpt: --show-amp-policy takes only --precision, got '" + echo(arg) + "'";
  };
  if (!cli.parse(argc, argv)) return 0;  // --help
  AmpConfig config;
  try {
    config = AmpConfig::parse(precision);
  } catch (const Error& error) {
    fail("train_gpt: --precision '", echo(precision), "': ", error.what());
  }
  print_autocast_policy_table(std::cout, config);
  return 0;
}

int run(int argc, char** argv) {
  if (show_amp_policy_requested(argc, argv)) return show_amp_policy(argc, argv);
  std::optional<Options> parsed = parse(argc, argv);
  if (!parsed) return 0;  // --help
  Options& opt = *parsed;
  if (opt.threads != "auto")
    omp_set_num_threads(static_cast<int>(integer_argument("train_gpt", "--threads", opt.threads, 1, 4096)));
  check_outputs(opt);
  const TokenData data = load_data(opt);
  if (!opt.init.empty() || !opt.resume.empty()) adopt_loaded_file(opt, data);
  else opt.model.vocab_size = data.vocab_size;
  check_data_fits(opt, data);
  Engine engine = make_engine(opt, data);
  if (opt.eval_only) {
    const double val_loss = engine.evaluate();
    if (engine.printer) std::printf("val_loss %.6f\n", val_loss);
    sample_after_training(opt, engine, data);
    return 0;
  }
  if (engine.printer) print_header(opt, data, engine);
  check_resumed_stop(opt, engine);
  if (engine.printer) check_save_target(opt);
  std::ofstream log = open_log(opt, engine);
  std::optional<ThreadTuner> tuner = thread_tuner(opt, engine);
  train_loop(opt, engine, log, tuner ? &*tuner : nullptr);
  save_run(opt, engine);
  sample_after_training(opt, engine, data);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Under mpirun an error on one rank must end every rank (the others may be waiting in a collective for it).
  if (under_mpi_launcher()) return dist::run_or_abort(run, argc, argv);
  return run_program(run, argc, argv);
}
