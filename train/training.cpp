#include "train/training.h"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <system_error>

#include "autograd/autograd.h"
#include "io/json.h"
#include "io/safetensors.h"
#include "optim/adam.h"
#include "optim/sgd.h"
#include "tensor/error.h"
#include "tensor/random.h"

namespace mixtape {

namespace {

// Shortest decimal text that reads back to the same double, so a checkpoint restores options bit for bit.
const std::string& entry(const std::map<std::string, std::string>& metadata, const std::string& key,
                         const char* what) {
  const auto it = metadata.find(key);
  check(it != metadata.end(), what, ": metadata entry '", echo(key), "' is missing");
  return it->second;
}

template <class T>
T parse_number(const std::string& text, const std::string& key, const char* what) {
  const std::optional<T> value = number_from_text<T>(text);
  check(value.has_value(), what, ": metadata entry '", echo(key), "' = '", echo(text), "' is not a valid number");
  return *value;
}

template <class T>
T read(const std::map<std::string, std::string>& metadata, const std::string& key, const char* what) {
  return parse_number<T>(entry(metadata, key, what), key, what);
}

// parse(text) of metadata entry `key`; its Error (a JSON syntax error, say) comes back naming the entry:
// "training checkpoint: metadata entry 'vocab': json: ...".
template <class Parse>
auto parse_entry(const std::string& text, const std::string& key, const std::string& what, Parse parse) {
  try {
    return parse(text);
  } catch (const Error& e) {
    fail(what, ": metadata entry '", echo(key), "': ", e.what());
  }
}

// The AMP options a checkpoint trained with. A train.amp_config without lr_schedule_on_skip trained with the
// schedule following the iteration ("advance"), and an Apex one without keep_norms_fp32 kept the norm layers of
// a cast model in fp32 wherever keep_batchnorm_fp32 was true: they read as such, so that resuming under other
// values is refused by name (check_checkpoint_options) instead of training on differently.
AmpConfig amp_config_entry(const std::map<std::string, std::string>& metadata, const char* what) {
  return parse_entry(entry(metadata, "train.amp_config", what), "train.amp_config", what, [](const std::string& text) {
    AmpConfig config = AmpConfig::from_json(text);
    const Json written = json::parse(text);
    if (!json::find(written, "lr_schedule_on_skip")) config.lr_schedule_on_skip = LrScheduleOnSkip::Advance;
    const std::optional<DType> cast = config.model_dtype();
    if (config.family() == ModeFamily::Apex && !json::find(written, "keep_norms_fp32") && cast &&
        is_low_precision(*cast))
      config.apex.keep_norms_fp32 = config.apex.keep_batchnorm_fp32.value_or(false);
    config.validate();
    return config;
  });
}

// Tokens in one step's batch (batch x block), well inside int64 and memory: the inputs and targets are two
// int64 arrays of that many entries.
constexpr int64_t kMaxTokensPerStep = int64_t{1} << 32;

// A step count of a checkpoint: the schedule computes in double, and training must be able to go on counting.
constexpr int64_t kMaxStep = int64_t{1} << 53;

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

// ---- data ----

bool same_file(const std::string& a, const std::string& b) {
  namespace fs = std::filesystem;
  std::error_code error;
  if (fs::exists(a, error) && fs::exists(b, error)) return fs::equivalent(a, b, error);
  const auto resolved = [](const std::string& path) {
    std::error_code ignored;
    return fs::weakly_canonical(write_destination(path), ignored);
  };
  return resolved(a) == resolved(b);
}

std::string read_input_file(const std::string& what, const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code error;
  const fs::file_type type = fs::status(path, error).type();  // through symbolic links
  // A directory opens as a stream that reads nothing; a device may never end (/dev/zero, /dev/urandom).
  check(type != fs::file_type::directory, what, " '", echo(path), "' is a directory, expected a regular file");
  check(type != fs::file_type::character && type != fs::file_type::block && type != fs::file_type::socket, what,
        " '", echo(path), "' is a ", type == fs::file_type::socket ? "socket" : "device",
        ", expected a regular file (or a pipe)");
  std::ifstream in(path, std::ios::binary);
  check(in.good(), what, " '", echo(path), "' cannot be opened", error ? " (" + error.message() + ")" : "");
  std::ostringstream text;
  text << in.rdbuf();
  check(!in.bad(), what, " '", echo(path), "': error reading it");
  return text.str();
}

TokenData char_tokens(const std::string& text) {
  TokenData data;
  int id[256];
  for (int& v : id) v = -1;
  for (unsigned char c : text) id[c] = 1;
  for (int c = 0; c < 256; ++c)
    if (id[c] == 1) {
      id[c] = static_cast<int>(data.vocab.size());
      data.vocab.push_back(static_cast<uint8_t>(c));
    }
  data.vocab_size = static_cast<int64_t>(data.vocab.size());
  data.tokens.reserve(text.size());
  for (unsigned char c : text) data.tokens.push_back(id[c]);
  return data;
}

TokenData load_token_file(const std::string& path, int64_t vocab_size) {
  // A name ending in .bin is nanoGPT's token format; any other file is text (fortune files, say, have no
  // extension at all).
  const std::string bytes = read_input_file("train_gpt: data file", path);
  if (ends_with(path, ".bin")) {
    check(vocab_size > 0 && vocab_size <= 65536, "train_gpt: a .bin data file ('", echo(path),
          "') needs --vocab-size in [1, 65536], got ", vocab_size);
    check(bytes.size() % 2 == 0, "train_gpt: '", echo(path), "' has an odd byte count (", bytes.size(),
          "); expected little-endian uint16 token ids");
    TokenData data;
    data.vocab_size = vocab_size;
    data.tokens.resize(bytes.size() / 2);
    for (size_t i = 0; i < data.tokens.size(); ++i) {
      const int32_t id = static_cast<unsigned char>(bytes[2 * i]) | static_cast<unsigned char>(bytes[2 * i + 1]) << 8;
      check(id < vocab_size, "train_gpt: token ", i, " of '", echo(path), "' is ", id, ", not below --vocab-size ",
            vocab_size);
      data.tokens[i] = id;
    }
    return data;
  }
  check(vocab_size == 0, "train_gpt: --vocab-size applies to .bin data only ('", echo(path),
        "' is read as text: its vocabulary is its bytes)");
  return char_tokens(bytes);
}

std::string vocab_to_metadata(const std::vector<uint8_t>& vocab) {
  Json values = Json::array();
  for (uint8_t b : vocab) values.push_back(int64_t{b});
  return json::dump(values);
}

std::vector<uint8_t> metadata_vocab(const std::map<std::string, std::string>& metadata, const std::string& what,
                                    int64_t vocab_size) {
  const auto found = metadata.find("vocab");
  if (found == metadata.end()) return {};
  const std::vector<uint8_t> vocab = parse_entry(found->second, "vocab", what, vocab_from_metadata);
  // One byte per token id: a list of another length would leave sampled ids without a character, or
  // characters without an id.
  check(static_cast<int64_t>(vocab.size()) == vocab_size, what, ": metadata entry 'vocab' lists ", vocab.size(),
        " characters but vocab_size is ", vocab_size, " (a character vocabulary has one byte per token id)");
  return vocab;
}

std::vector<uint8_t> vocab_from_metadata(const std::string& text) {
  const Json value = json::parse(text);
  std::vector<uint8_t> vocab;
  for (const Json& v : json::as_array(value)) {
    const int64_t b = json::as_integer(v);
    const size_t i = vocab.size();
    check(b >= 0 && b < 256, "entry ", i, " is ", b, ", not a byte value");
    // char_tokens' vocabulary is the sorted set of the text's bytes: token id t is the t-th smallest byte. A
    // list out of that order maps ids to other characters; a repeated byte leaves an id that no text can have.
    // if/fail, not check(): the messages read the previous entry, which the first entry does not have.
    if (i > 0 && b == vocab.back())
      fail("entry ", i, " is ", b, ", the same byte as entry ", i - 1, " (a character vocabulary lists each byte once)");
    if (i > 0 && b < vocab.back())
      fail("entry ", i, " is ", b, ", below entry ", i - 1, " (", int{vocab.back()},
           "): a character vocabulary lists its bytes in ascending order");
    vocab.push_back(static_cast<uint8_t>(b));
  }
  check(!vocab.empty(), "the list is empty (a character vocabulary has at least one byte)");
  return vocab;
}

// ---- options ----

void TrainOptions::validate() const {
  check(batch > 0 && batch <= kMaxTokensPerStep, "train_gpt: --batch (train.batch) must be in [1, 2^32], got ",
        batch);
  check(steps >= 0, "train_gpt: --steps must be >= 0, got ", steps);
  check(std::isfinite(lr) && lr > 0, "train_gpt: --lr must be > 0, got ", lr);
  check(std::isfinite(min_lr) && min_lr >= 0 && min_lr <= lr, "train_gpt: --min-lr must be in [0, --lr], got ",
        min_lr);
  check(warmup >= 0, "train_gpt: --warmup must be >= 0, got ", warmup);
  check(optimizer == "sgd" || optimizer == "adam" || optimizer == "adamw",
        "train_gpt: --optimizer must be sgd, adam or adamw, got '", echo(optimizer), "'");
  check(std::isfinite(weight_decay) && weight_decay >= 0, "train_gpt: --weight-decay must be >= 0, got ",
        weight_decay);
  // AdamW and SGD scale every decayed weight by 1 - lr x weight_decay per step: past 1 that factor is negative,
  // and the weights flip sign and grow at every step. lr is the schedule's peak, so the bound holds at every
  // step. (Adam adds weight_decay x w to the gradient, which its update normalises: no such factor.)
  check(optimizer == "adam" || lr * weight_decay <= 1, "train_gpt: --weight-decay x --lr must be at most 1 (each "
        "step of ", echo(optimizer), " scales a decayed weight by 1 - lr x weight_decay), got ", weight_decay, " x ",
        lr, " = ", lr * weight_decay);
  check(beta1 >= 0 && beta1 < 1, "train_gpt: --beta1 must be in [0, 1), got ", beta1);
  check(beta2 >= 0 && beta2 < 1, "train_gpt: --beta2 must be in [0, 1), got ", beta2);
  check(momentum >= 0 && momentum < 1, "train_gpt: --momentum must be in [0, 1), got ", momentum);
  check(schedule == "constant" || schedule == "cosine", "train_gpt: --schedule must be constant or cosine, got '",
        echo(schedule), "'");
  check(std::isfinite(grad_clip) && grad_clip >= 0, "train_gpt: --grad-clip must be >= 0 (0 = off), got ",
        grad_clip);
  amp.validate();
}

std::map<std::string, std::string> TrainOptions::to_metadata() const {
  return {{"train.batch", std::to_string(batch)},
          {"train.steps", std::to_string(steps)},
          {"train.lr", exact_number_text(lr)},
          {"train.min_lr", exact_number_text(min_lr)},
          {"train.warmup", std::to_string(warmup)},
          {"train.optimizer", optimizer},
          {"train.weight_decay", exact_number_text(weight_decay)},
          {"train.beta1", exact_number_text(beta1)},
          {"train.beta2", exact_number_text(beta2)},
          {"train.momentum", exact_number_text(momentum)},
          {"train.schedule", schedule},
          {"train.grad_clip", exact_number_text(grad_clip)},
          {"train.seed", std::to_string(seed)},
          {"train.sequential", sequential ? "true" : "false"},
          {"train.precision", amp.name()},
          {"train.amp_config", amp.to_json()}};
}

TrainOptions TrainOptions::from_metadata(const std::map<std::string, std::string>& m) {
  const char* what = "training checkpoint";
  TrainOptions o;
  o.batch = read<int64_t>(m, "train.batch", what);
  o.steps = read<int64_t>(m, "train.steps", what);
  o.lr = read<double>(m, "train.lr", what);
  o.min_lr = read<double>(m, "train.min_lr", what);
  o.warmup = read<int64_t>(m, "train.warmup", what);
  o.optimizer = entry(m, "train.optimizer", what);
  o.weight_decay = read<double>(m, "train.weight_decay", what);
  o.beta1 = read<double>(m, "train.beta1", what);
  o.beta2 = read<double>(m, "train.beta2", what);
  o.momentum = read<double>(m, "train.momentum", what);
  o.schedule = entry(m, "train.schedule", what);
  o.grad_clip = read<double>(m, "train.grad_clip", what);
  o.seed = read<uint64_t>(m, "train.seed", what);
  const std::string& sequential = entry(m, "train.sequential", what);
  check(sequential == "true" || sequential == "false", what, ": train.sequential must be true or false, got '",
        echo(sequential), "'");
  o.sequential = sequential == "true";
  // Checkpoints from before the precision modes are fp32.
  if (m.count("train.amp_config")) o.amp = amp_config_entry(m, what);
  try {
    o.validate();
  } catch (const Error& error) {  // its messages name the command-line flags of the options
    fail(what, ": a saved training option (train.*) is invalid: ", error.what());
  }
  return o;
}

// ---- trainer ----

Trainer::Trainer(const GPTConfig& config, const TrainOptions& options, const TokenData& data)
    : config_(config), options_(options), data_(data), booster_(options.amp) {
  config_.validate();
  options_.validate();
  check(data.vocab_size <= config_.vocab_size, "train_gpt: the data has ", data.vocab_size,
        " token ids but the model's vocab_size is ", config_.vocab_size);
  check(data.n_train() > config_.block_size + 1, "train_gpt: the training split (", data.n_train(),
        " tokens) is shorter than block + 2 = ", config_.block_size + 2);
  check_tokens_per_step(options_, config_.block_size);
  model_ = std::make_unique<GPT>(config_, options_.seed);
  model_->to(options_.device);
  model_->train();

  std::unique_ptr<Optimizer> optimizer = make_optimizer(options_, *model_);
  // The precision mode converts the model (naive / Apex O2, O3) and wraps the optimizer; grad_clip clips the
  // unscaled (master) gradients.
  BoostOptions boost;
  boost.clip_grad = options_.grad_clip;
  optimizer_ = booster_.boost(*model_, std::move(optimizer), boost);
  schedule_ = make_schedule(options_);
  data_seed_ = data_seed_of(options_);
}

std::vector<std::string> optimizer_order(const Module& model) {
  // nanoGPT's groups: every parameter of >= 2 dims (matrices, embeddings) decays; biases and norm weights not.
  std::vector<std::string> decay, no_decay;
  for (const auto& [name, p] : model.named_parameters()) (p.dim() >= 2 ? decay : no_decay).push_back(name);
  decay.insert(decay.end(), no_decay.begin(), no_decay.end());
  return decay;
}

namespace {

// The run's optimizer over nanoGPT's two groups (decay, no decay), whatever parameters they hold.
std::unique_ptr<Optimizer> optimizer_of_groups(const TrainOptions& options, ParamGroup decay, ParamGroup no_decay) {
  decay.lr = no_decay.lr = options.lr;
  decay.weight_decay = options.weight_decay;
  no_decay.weight_decay = 0;
  std::vector<ParamGroup> groups{std::move(decay), std::move(no_decay)};
  const AdamOptions adam{options.beta1, options.beta2, 1e-8};
  if (options.optimizer == "sgd") return std::make_unique<SGD>(groups, SGDOptions{options.momentum, 0, false});
  if (options.optimizer == "adam") return std::make_unique<Adam>(groups, adam);
  return std::make_unique<AdamW>(groups, adam);
}

}  // namespace

std::unique_ptr<Optimizer> make_optimizer(const TrainOptions& options, const Module& model) {
  ParamGroup decay, no_decay;
  for (const auto& [name, p] : model.named_parameters()) (p.dim() >= 2 ? decay : no_decay).params.push_back(p);
  return optimizer_of_groups(options, std::move(decay), std::move(no_decay));
}

std::unique_ptr<LRSchedule> make_schedule(const TrainOptions& options) {
  if (options.schedule == "cosine")
    return std::make_unique<WarmupCosineLR>(options.lr, options.min_lr, options.warmup,
                                            std::max(options.steps, options.warmup));
  // Constant after a linear warm-up: the cosine between lr and lr.
  if (options.warmup > 0)
    return std::make_unique<WarmupCosineLR>(options.lr, options.lr, options.warmup, options.warmup);
  return std::make_unique<ConstantLR>(options.lr);
}

uint64_t data_seed_of(const TrainOptions& options) { return options.seed * 0x9E3779B97F4A7C15ull + 0xDA7A5EEDull; }

void check_tokens_per_step(const TrainOptions& options, int64_t block) {
  check(block > 0 && options.batch > 0 && options.batch <= kMaxTokensPerStep / block,
        "train_gpt: --batch (train.batch) ", options.batch, " x block ", block,
        " is more than 2^32 tokens per step");
}

std::pair<Tensor, Tensor> Trainer::batch(int64_t step) const {
  return training_batch(data_, options_, config_.block_size, data_seed_, step);
}

std::pair<Tensor, Tensor> training_batch(const TokenData& data, const TrainOptions& options, int64_t block,
                                         uint64_t data_seed, int64_t step) {
  const int64_t B = options.batch, T = block;
  const int64_t range = data.n_train() - T - 1;
  check(range > 0, "train_gpt: the training split (", data.n_train(), " tokens) is shorter than block + 2 = ",
        T + 2);
  check(step >= 0, "training_batch: step ", step, " is negative");
  check_tokens_per_step(options, T);
  std::vector<int64_t> x(static_cast<size_t>(B * T)), y(static_cast<size_t>(B * T));
  for (int64_t i = 0; i < B; ++i) {
    int64_t start;
    if (options.sequential) {
      // ((s*B + i) * T) mod range, reduced mod range after each product, in 128 bits: every factor is below
      // 2^63, so no step (a checkpoint's, however large) can overflow.
      using u128 = unsigned __int128;
      const u128 r = static_cast<u128>(range);
      const u128 row = (static_cast<u128>(step) % r * static_cast<u128>(B) + static_cast<u128>(i)) % r;
      start = static_cast<int64_t>(row * static_cast<u128>(T) % r);
    } else {
      // 64 random bits from (step, row) under the data seed; the modulo bias (range / 2^64) is negligible.
      const auto bits = philox4x32(static_cast<uint64_t>(step), static_cast<uint64_t>(i), data_seed);
      start = static_cast<int64_t>((static_cast<uint64_t>(bits[0]) << 32 | bits[1]) % static_cast<uint64_t>(range));
    }
    for (int64_t t = 0; t < T; ++t) {
      x[i * T + t] = data.tokens[start + t];
      y[i * T + t] = data.tokens[start + t + 1];
    }
  }
  return {Tensor::from_vector(x, {B, T}), Tensor::from_vector(y, {B, T})};
}

namespace {

// The fp8 modes' part of a step's stats: the counts since `before` and, for delayed scaling, the first covered
// Linear's scales (the scaling state is ordered by name).
void record_quantization(const LowPrecisionContext& low, const std::array<QuantizationCounts, 3>& before,
                         StepStats& stats) {
  std::array<QuantizationCounts, 3> step;
  for (size_t k = 0; k < step.size(); ++k) {
    step[k].values = low.counts()[k].values - before[k].values;
    step[k].saturated = low.counts()[k].saturated - before[k].saturated;
    step[k].flushed = low.counts()[k].flushed - before[k].flushed;
  }
  stats.quantized = step;
  if (low.recipe().scaling != ScalingRecipe::DelayedTensorwise) return;
  const std::map<std::string, DelayedScaling> state = low.scaling_state();
  if (state.empty()) return;
  const std::string layer = state.begin()->first.substr(0, state.begin()->first.rfind('.'));
  std::array<float, 3> scales{};
  for (size_t k = 0; k < scales.size(); ++k)
    scales[k] = state.at(layer + "." + tensor_kind_name(static_cast<TensorKind>(k))).scale;
  stats.delayed_scales = scales;
  stats.delayed_scales_of = layer;
}

}  // namespace

StepStats Trainer::train_step() {
  StepStats stats;
  stats.step = step_;
  model_->train();
  const auto [x, y] = batch(step_);
  using Clock = std::chrono::steady_clock;
  const auto seconds = [](Clock::time_point from, Clock::time_point to) {
    return std::chrono::duration<double>(to - from).count();
  };
  const std::shared_ptr<LowPrecisionContext>& low = booster_.low_precision();
  const std::array<QuantizationCounts, 3> counts_before = low ? low->counts() : std::array<QuantizationCounts, 3>{};
  const Clock::time_point t0 = Clock::now();
  optimizer_->zero_grad();
  ForwardProfiler* const forward_profiler = ForwardProfiler::active();
  if (forward_profiler) forward_profiler->mark();  // the forward's ops start here ...
  const Tensor loss = forward_loss(x, y);
  stats.loss = loss.item();
  const Clock::time_point t1 = Clock::now();
  if (forward_profiler) forward_profiler->pause();  // ... and end here (a loss scaler's mul is not one)
  stats.loss_scale = optimizer_->loss_scale();
  booster_.backward(loss, *optimizer_);
  const Clock::time_point t2 = Clock::now();
  if (gradient_hook) gradient_hook(step_, *model_);
  // The schedule follows the iteration, or with lr_schedule_on_skip "hold" the updates applied so far.
  const int64_t position = options_.amp.schedule_position(step_, optimizer_->skipped_steps());
  stats.lr = apply_schedule(optimizer_->optimizer(), *schedule_, position);
  const Clock::time_point t3 = Clock::now();
  const StepResult result = booster_.step(*optimizer_);
  const Clock::time_point t4 = Clock::now();
  if (low) record_quantization(*low, counts_before, stats);
  stats.forward_seconds = seconds(t0, t1);
  stats.backward_seconds = seconds(t1, t2);
  stats.optimizer_seconds = seconds(t3, t4);
  stats.grad_norm = result.grad_norm;
  stats.skipped = result.skipped;
  stats.num_zeros = result.num_zeros;
  optimizer_->zero_grad();
  ++step_;
  return stats;
}

double Trainer::evaluate() {
  const int64_t T = config_.block_size;
  const int64_t base = data_.n_train();
  const int64_t windows = (data_.n_val() - 1) / T;  // window k needs tokens k*T .. k*T + T (one more target)
  check(windows > 0, "train_gpt: the validation split (", data_.n_val(), " tokens) is shorter than block + 1 = ",
        T + 1);
  NoGradGuard no_grad;
  model_->eval();
  double total = 0;
  for (int64_t k0 = 0; k0 < windows; k0 += options_.batch) {
    const int64_t rows = std::min(options_.batch, windows - k0);
    std::vector<int64_t> x(static_cast<size_t>(rows * T)), y(static_cast<size_t>(rows * T));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t t = 0; t < T; ++t) {
        x[r * T + t] = data_.tokens[base + (k0 + r) * T + t];
        y[r * T + t] = data_.tokens[base + (k0 + r) * T + t + 1];
      }
    const Tensor loss = forward_loss(Tensor::from_vector(x, {rows, T}), Tensor::from_vector(y, {rows, T}));
    total += loss.item() * static_cast<double>(rows);  // every window has T targets: weight by rows
  }
  model_->train();
  return total / static_cast<double>(windows);
}

Tensor Trainer::forward_loss(const Tensor& x, const Tensor& y) {
  // Through the booster: autocast, or the cast model's input/output casts (the loss comes back in fp32).
  return booster_.forward(
      [&](const std::vector<Tensor>& in) { return std::vector<Tensor>{model_->forward(in[0], in[1]).loss}; },
      {x.to(options_.device), y.to(options_.device)})[0];
}

StateDict Trainer::checkpoint() {
  StateDict state = model_->state_dict();
  for (auto& [name, t] : state.tensors)
    if (is_floating(t.dtype()) && t.dtype() != DType::F32) t = t.to(DType::F32);  // exact (see the header)
  config_.to_metadata(state.metadata);
  if (!data_.vocab.empty()) state.metadata["vocab"] = vocab_to_metadata(data_.vocab);
  const StateDict opt = optimizer_->state_dict();
  for (const auto& [name, t] : opt.tensors) state.tensors["optimizer." + name] = t;
  for (const auto& [key, value] : opt.metadata) state.metadata["optimizer." + key] = value;
  for (const auto& [key, value] : options_.to_metadata()) state.metadata[key] = value;
  state.metadata["step"] = std::to_string(step_);
  state.metadata["data.seed"] = std::to_string(data_seed_);
  state.metadata["data.position"] = std::to_string(step_);
  for (const auto& [name, gen] : model_->named_generators()) {
    state.metadata["rng." + name + ".seed"] = std::to_string(gen->seed);
    state.metadata["rng." + name + ".offset"] = std::to_string(gen->offset);
  }
  booster_.save_scaling_state(state);
  return state;
}

void Trainer::save_checkpoint(const std::string& path) { save_safetensors(path, checkpoint()); }

StateDict model_part(const StateDict& state) {
  StateDict model;
  model.metadata = state.metadata;
  for (const auto& [name, t] : state.tensors)
    if (name.rfind("optimizer.", 0) != 0 && name.rfind(Booster::kScalingStatePrefix, 0) != 0) model.tensors[name] = t;
  return model;
}

namespace {

// A file's floating tensor `t` in the dtype of the model's tensor of that name (`mine`: the model's state dict;
// files hold fp32, one saved in 16 bits or f64 reads in the model's dtype); anything else unchanged, for
// load_state_dict to accept or name.
Tensor in_model_dtype(const StateDict& mine, const std::string& name, const Tensor& t) {
  const auto found = mine.tensors.find(name);
  if (found == mine.tensors.end() || !t.defined()) return t;
  const DType want = found->second.dtype();
  return is_floating(t.dtype()) && is_floating(want) && t.dtype() != want ? t.to(want) : t;
}

}  // namespace

// The model part of `state` with each floating tensor in the dtype of the model's own tensor (files hold fp32).
// Every value must be finite in that dtype (an f64 1e300 is inf in f32): one NaN weight makes every later step
// a skipped one.
StateDict Trainer::model_part_in_model_dtypes(const StateDict& state, const char* what) const {
  StateDict part = model_part(state);
  const StateDict mine = model_->state_dict();
  for (auto& [name, t] : part.tensors) {
    if (!mine.tensors.count(name) || !t.defined()) continue;  // load_state_dict names it
    const Tensor original = t;
    t = in_model_dtype(mine, name, t);
    const std::string bad = first_bad_value(t);
    check(bad.empty(), what, ": tensor '", echo(name), "' (", original.described(), ") must be finite",
          t.dtype() == original.dtype() ? "" : std::string(" in the model's ") + dtype_name(t.dtype()), ", but ",
          bad);
  }
  return part;
}

void Trainer::load_weights(const StateDict& state) {
  model_->load_state_dict(model_part_in_model_dtypes(state, "load_weights"));
  optimizer_->reload_masters();  // else the first step would start from the masters of the initial weights
}

namespace {

// Whether a file's metadata text says the value `expected` (a to_metadata text): numbers compare as numbers
// ("1e30" is "1e+30", "0.99" is "0.98999999999999999"), anything else as text.
bool same_value(const std::string& file_text, const std::string& expected) {
  const std::optional<double> a = number_from_text<double>(file_text), b = number_from_text<double>(expected);
  return a && b ? *a == *b : file_text == expected;
}

// The checkpoint's model config, read as GPTConfig::from_metadata reads it, against the trainer's.
void check_checkpoint_config(const std::map<std::string, std::string>& metadata, const GPTConfig& config,
                             const char* what) {
  std::map<std::string, std::string> mine, file;
  config.to_metadata(mine);
  for (const auto& [key, value] : mine) entry(metadata, key, what);  // a missing one is named, not defaulted
  try {
    GPTConfig::from_metadata(metadata).to_metadata(file);
  } catch (const Error& error) {
    fail(what, ": ", error.what());
  }
  for (const auto& [key, value] : mine)
    check(file.at(key) == value, what, ": model option '", key, "' is ", echo(metadata.at(key)),
          " in the checkpoint but ", value, " here");
}

// The checkpoint's train.* options, read (and validated with the command line's rules) by
// TrainOptions::from_metadata, against the trainer's: all but train.steps, which a resumed run may extend, and
// the AMP options, compared option by option (those that only change what is printed may differ).
void check_checkpoint_options(const std::map<std::string, std::string>& metadata, const TrainOptions& options,
                              const char* what) {
  const std::map<std::string, std::string> mine = options.to_metadata();
  for (const auto& [key, value] : mine) entry(metadata, key, what);  // a missing one is named
  const std::map<std::string, std::string> file = TrainOptions::from_metadata(metadata).to_metadata();
  for (const auto& [key, value] : mine) {
    if (key == "train.steps" || key == "train.amp_config") continue;
    // train.precision is the mode's name, which from_metadata takes from train.amp_config: compared as written.
    const std::string& found = key == "train.precision" ? metadata.at(key) : file.at(key);
    check(found == value, what, ": option '", key.substr(6), "' is ", echo(metadata.at(key)),
          " in the checkpoint but ", value, " here");
  }
  const std::string amp_differences =
      options.amp.training_differences(amp_config_entry(metadata, what), "the checkpoint's");
  check(amp_differences.empty(), what, ": the AMP options differ in ", amp_differences);
}

// The state buffers the run's optimizer keeps per parameter ("exp_avg", ...; none for SGD without momentum):
// those it holds after stepping once on a one-element probe.
std::set<std::string> optimizer_buffers(const TrainOptions& options) {
  Tensor probe = Tensor::zeros({1});
  probe.requires_grad_();
  probe.set_grad(Tensor::zeros({1}));
  ParamGroup group;
  group.params.push_back(probe);
  const std::unique_ptr<Optimizer> optimizer = optimizer_of_groups(options, group, ParamGroup{});
  optimizer->step();
  std::set<std::string> names;
  if (const ParamState* state = optimizer->state(probe))
    for (const auto& [name, buffer] : state->buffers) names.insert(name);
  return names;
}

// The parameter index and the rest of "optimizer.state.<i>.<rest>" (i in canonical decimal), if `key` is one.
std::optional<std::pair<size_t, std::string>> optimizer_state_key(const std::string& key) {
  static const std::string prefix = "optimizer.state.";
  if (key.rfind(prefix, 0) != 0) return std::nullopt;
  const size_t dot = key.find('.', prefix.size());
  if (dot == std::string::npos) return std::nullopt;
  const std::string digits = key.substr(prefix.size(), dot - prefix.size());
  const std::optional<size_t> index = number_from_text<size_t>(digits);
  if (!index || std::to_string(*index) != digits) return std::nullopt;
  return std::make_pair(*index, key.substr(dot + 1));
}

// Every "optimizer.state.*" entry names a parameter of the model and, for a tensor, a buffer the run's optimizer
// keeps: checked on the whole file, so that every rank of a parallel trainer (each holding some parameters)
// refuses the same file.
void check_optimizer_state_names(const StateDict& state, const GPTConfig& config, const TrainOptions& options,
                                 const char* what) {
  const size_t params = gpt_parameter_shapes(config).size();
  const std::set<std::string> buffers = optimizer_buffers(options);
  std::string kept;
  for (const std::string& buffer : buffers) kept += (kept.empty() ? "" : ", ") + buffer;
  const auto check_key = [&](const std::string& key, bool tensor) {
    if (key.rfind("optimizer.state.", 0) != 0) return;
    const auto parsed = optimizer_state_key(key);
    check(parsed && parsed->first < params, what, ": ", tensor ? "tensor" : "metadata entry", " '", echo(key),
          "' names no parameter (expected optimizer.state.<i>.", tensor ? "<buffer>" : "step", ", i < ", params,
          ")");
    check(tensor ? buffers.count(parsed->second) > 0 : parsed->second == "step", what, ": ",
          tensor ? "tensor" : "metadata entry", " '", echo(key), "': the ", options.optimizer, " optimizer keeps ",
          tensor ? (kept.empty() ? std::string("no state tensors") : "the state tensors " + kept)
                 : std::string("a step count (.step) as its metadata"), ", not '", echo(parsed->second), "'");
  };
  for (const auto& [name, t] : state.tensors) check_key(name, true);
  for (const auto& [key, value] : state.metadata) check_key(key, false);
}

// The optimizer's own settings in the checkpoint ("optimizer.beta1", "optimizer.param_groups.0.weight_decay",
// ...) are those the run's options make (make_optimizer): Optimizer::load_state_dict would otherwise put a
// value into the run that the options never allowed. The groups' learning rates are the schedule's, set
// before every step.
void check_optimizer_settings(const std::map<std::string, std::string>& metadata, const TrainOptions& options,
                              const char* what) {
  const StateDict expected = optimizer_of_groups(options, ParamGroup{}, ParamGroup{})->state_dict();
  for (const auto& [key, value] : expected.metadata) {
    if (ends_with(key, ".params") || ends_with(key, ".lr")) continue;
    const std::string file_key = "optimizer." + key;
    const std::string& found = entry(metadata, file_key, what);
    check(same_value(found, value), what, ": metadata entry '", file_key, "' is ", echo(found), ", expected ",
          value, " (the ", expected.metadata.at("type"), " setting that the checkpoint's train.* options make)");
  }
}

}  // namespace

int64_t validate_checkpoint(const StateDict& state, const GPTConfig& config, const TrainOptions& options,
                            const TokenData& data) {
  const char* what = "training checkpoint";
  check_checkpoint_config(state.metadata, config, what);
  check_checkpoint_options(state.metadata, options, what);
  bool has_optimizer = false;
  for (const auto& [key, value] : state.metadata) has_optimizer = has_optimizer || key.rfind("optimizer.", 0) == 0;
  check(has_optimizer, what, ": no optimizer state (a weights-only file? use --init for those)");
  check_optimizer_settings(state.metadata, options, what);
  check_optimizer_state_names(state, config, options, what);
  const std::vector<uint8_t> vocab = metadata_vocab(state.metadata, what, config.vocab_size);
  if (!data.vocab.empty() && state.metadata.count("vocab"))
    check(vocab == data.vocab, what, ": the data's character vocabulary differs from the checkpoint's");
  const int64_t step = read<int64_t>(state.metadata, "step", what);
  check(step >= 0 && step <= kMaxStep, what, ": step ", step, " is outside [0, 2^53]");
  check(read<uint64_t>(state.metadata, "data.seed", what) == data_seed_of(options), what, ": data.seed differs");
  // The data sampler's state is (seed, step): the position written beside them is the step, and a file where it
  // is not does not say which batch comes next.
  const int64_t position = read<int64_t>(state.metadata, "data.position", what);
  check(position == step, what, ": data.position ", position, " differs from step ", step,
        " (the next batch is the one of the step)");
  // The optimizer's values, checked here (and again by the optimizer) so that every rank of a parallel trainer
  // finds the same fault, whichever parameters it holds. Tensors (moments, fp32 masters) must be finite, a second
  // moment >= 0: one NaN there makes every later step a skipped one. A parameter's step count is in [1, 2^53].
  for (const auto& [name, t] : state.tensors) {
    if (name.rfind("optimizer.", 0) != 0) continue;
    const bool non_negative = ends_with(name, ".exp_avg_sq");
    const std::string bad = first_bad_value(t, non_negative);
    check(bad.empty(), what, ": tensor '", echo(name), "' (", t.described(), ") must be ",
          non_negative ? "finite and >= 0" : "finite", ", but ", bad);
  }
  for (const auto& [key, value] : state.metadata)
    if (key.rfind("optimizer.state.", 0) == 0 && ends_with(key, ".step")) {
      const int64_t count = parse_number<int64_t>(value, key, what);
      check(count >= 1 && count <= step, what, ": metadata entry '", echo(key), "' is ", count,
            ", expected a step count in [1, step ", step, "] (the optimizer steps once per training step at most)");
    }
  // Skipped steps are steps too: more of them than steps is a file that was edited or mixed up.
  if (const auto found = state.metadata.find("optimizer.amp.skipped_steps"); found != state.metadata.end()) {
    const int64_t skipped = parse_number<int64_t>(found->second, found->first, what);
    check(skipped >= 0 && skipped <= step, what, ": metadata entry '", found->first, "' is ", skipped,
          ", expected a count in [0, step ", step, "]");
  }
  return step;
}

std::vector<std::pair<Generator*, Generator>> checkpoint_generators(const StateDict& state, Module& model) {
  const char* what = "training checkpoint";
  std::vector<std::pair<Generator*, Generator>> generators;
  for (const auto& [name, gen] : model.named_generators()) {
    Generator g(read<uint64_t>(state.metadata, "rng." + name + ".seed", what));
    g.offset = read<uint64_t>(state.metadata, "rng." + name + ".offset", what);
    generators.emplace_back(gen, g);
  }
  return generators;
}

std::string optimizer_error_in_file_keys(std::string_view message,
                                         const std::function<std::string(const std::string&)>& file_key) {
  static constexpr std::string_view kQuote = "entry '";
  std::string out;
  size_t at = 0;
  for (size_t found; (found = message.find(kQuote, at)) != std::string_view::npos;) {
    const size_t begin = found + kQuote.size();
    const size_t end = message.find('\'', begin);
    if (end == std::string_view::npos) break;
    const std::string key(message.substr(begin, end - begin));
    out.append(message.substr(at, begin - at));
    out += file_key ? file_key(key) : "optimizer." + key;
    at = end;
  }
  out.append(message.substr(at));
  return out;
}

StateDict optimizer_part(const StateDict& state) {
  StateDict opt;
  for (const auto& [name, t] : state.tensors)
    if (name.rfind("optimizer.", 0) == 0) opt.tensors[name.substr(10)] = t;
  for (const auto& [key, value] : state.metadata)
    if (key.rfind("optimizer.", 0) == 0) opt.metadata[key.substr(10)] = value;
  return opt;
}

void Trainer::load_checkpoint(const StateDict& state) {
  // Everything is checked before anything changes.
  const int64_t step = validate_checkpoint(state, config_, options_, data_);
  const std::vector<std::pair<Generator*, Generator>> generators = checkpoint_generators(state, *model_);
  const StateDict opt = optimizer_part(state);

  // Model first: strict and fully validated before copying. The optimizer validates before changing too;
  // if it throws, the model gets its old weights back, so a rejected checkpoint changes nothing.
  // The fp8 modes' scaling state is checked before it changes; a later refusal puts the old one back.
  StateDict old_scaling;
  booster_.save_scaling_state(old_scaling);
  booster_.load_scaling_state(state);
  StateDict old_model = model_->state_dict();  // detached views of the parameters: copy the values
  for (auto& [name, t] : old_model.tensors) t = t.clone();
  try {
    model_->load_state_dict(model_part_in_model_dtypes(state, "training checkpoint"));
  } catch (...) {
    booster_.load_scaling_state(old_scaling);
    throw;
  }
  try {
    optimizer_->load_state_dict(opt);
  } catch (const Error& error) {
    model_->load_state_dict(old_model);
    booster_.load_scaling_state(old_scaling);
    fail("training checkpoint: ", optimizer_error_in_file_keys(error.what()));
  } catch (...) {
    model_->load_state_dict(old_model);
    booster_.load_scaling_state(old_scaling);
    throw;
  }
  for (auto& [gen, g] : generators) *gen = g;
  step_ = step;
}

// ---- sampling ----

namespace {

// Puts a module in eval mode and gives it back in the mode it had, also when an exception leaves early.
class EvalModeGuard {
 public:
  explicit EvalModeGuard(Module& module) : module_(module), was_training_(module.is_training()) {
    module_.eval();
  }
  ~EvalModeGuard() { module_.train(was_training_); }
  EvalModeGuard(const EvalModeGuard&) = delete;
  EvalModeGuard& operator=(const EvalModeGuard&) = delete;

 private:
  Module& module_;
  bool was_training_;
};

}  // namespace

std::vector<int64_t> sample_tokens(GPT& model, std::vector<int64_t> ids, int64_t n, double temperature,
                                   int64_t top_k, uint64_t seed,
                                   const std::function<void(int64_t)>& on_token) {
  const GPTConfig& config = model.config();
  const int64_t V = config.vocab_size;
  check(!ids.empty(), "sample_tokens: the prompt is empty (give at least one token to start from)");
  for (int64_t id : ids)
    check(id >= 0 && id < V, "sample_tokens: prompt token ", id, " is outside [0, ", V, ")");
  check(n >= 0, "sample_tokens: the number of tokens must be >= 0, got ", n);
  check(std::isfinite(temperature) && temperature > 0,
        "sample_tokens: temperature must be > 0 and finite, got ", temperature);
  check(top_k >= 0, "sample_tokens: top_k must be >= 0 (0 = all), got ", top_k);

  NoGradGuard no_grad;
  EvalModeGuard eval_mode(model);
  const Device device = model.parameters().front().device();  // the prompt goes where the model is
  std::vector<int64_t> out;
  // Room for the tokens up to a bound: a count far beyond what will ever be drawn (--sample 10^11) would
  // otherwise fail here with bad_alloc instead of drawing.
  const size_t room = static_cast<size_t>(std::min<int64_t>(n, int64_t{1} << 20));
  out.reserve(room);
  ids.reserve(ids.size() + room);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t T = std::min<int64_t>(static_cast<int64_t>(ids.size()), config.block_size);
    const std::vector<int64_t> window(ids.end() - T, ids.end());
    const Tensor logits = model.forward(Tensor::from_vector(window, {1, T}).to(device)).logits;  // [1, T, V]
    std::vector<double> z = logits.select(1, T - 1).select(0, 0).to_vector<double>();
    if (top_k > 0 && top_k < V) {
      // Every logit below the k-th largest is out; ties with the k-th all stay in.
      std::vector<double> sorted = z;
      std::nth_element(sorted.begin(), sorted.begin() + (top_k - 1), sorted.end(), std::greater<double>());
      const double kth = sorted[top_k - 1];
      for (double& v : z)
        if (v < kth) v = -INFINITY;
    }
    // softmax(z / temperature) in double, unnormalised: exp((z - max) / temperature), so the largest is
    // exactly 1 and never 0, and a temperature as small as a denormal cannot overflow z / temperature to inf
    // (it gives the argmax); then the inverse CDF at a Philox uniform scaled by the total. The top-k cut
    // above is taken on the logits themselves, which dividing does not reorder.
    const double max = *std::max_element(z.begin(), z.end());
    double total = 0;
    for (double& v : z) total += (v = std::exp((v - max) / temperature));
    const auto bits = philox4x32(static_cast<uint64_t>(i), 0, seed);
    const double u = uniform_double_from_bits(bits[0], bits[1]) * total;
    double acc = 0;
    int64_t next = V - 1;
    for (int64_t v = 0; v < V; ++v)
      if (z[v] > 0 && (acc += z[v]) > u) { next = v; break; }
    while (z[next] == 0) --next;  // rounding at the top end: the last token with probability > 0
    ids.push_back(next);
    out.push_back(next);
    if (on_token) on_token(next);
  }
  return out;
}

int64_t default_start_token(const std::vector<uint8_t>& vocab) {
  const auto it = std::find(vocab.begin(), vocab.end(), uint8_t('\n'));
  return it != vocab.end() ? it - vocab.begin() : 0;
}

namespace {

// load_model_file's model from the file's contents; `what` names the file.
std::unique_ptr<GPT> load_model(const StateDict& state, const std::string& what, std::vector<uint8_t>* vocab) {
  const GPTConfig config = GPTConfig::from_metadata(state.metadata);
  StateDict weights = model_part(state);
  check_gpt_shapes(config, weights.tensors, what);  // before the model of the metadata's size is built
  // A character vocabulary has one byte per token id (train_gpt writes both from the same text).
  const std::vector<uint8_t> file_vocab = metadata_vocab(state.metadata, what, config.vocab_size);
  auto model = std::make_unique<GPT>(config, 0);
  const StateDict mine = model->state_dict();
  for (auto& [name, t] : weights.tensors) t = in_model_dtype(mine, name, t);  // as --init reads them
  model->load_state_dict(weights);
  // A NaN (or a value beyond the model's dtype) would not fail: every sample would silently be garbage.
  for (const auto& [name, p] : model->named_parameters()) {
    const std::string bad = first_bad_value(p);
    check(bad.empty(), what, ": tensor '", name, "' must be finite in the model's ", dtype_name(p.dtype()),
          ", but ", bad);
  }
  model->eval();
  if (vocab) *vocab = file_vocab;
  return model;
}

}  // namespace

std::unique_ptr<GPT> load_model_file(const std::string& path, std::vector<uint8_t>* vocab) {
  const std::string what = "load_model_file: '" + echo(path) + "'";
  // Every error names the file: those of the readers below know the entry at fault, not the file.
  try {
    return load_model(load_safetensors(path), what, vocab);
  } catch (const Error& error) {
    if (std::string_view(error.what()).find(echo(path)) != std::string_view::npos) throw;
    fail(what, ": ", error.what());
  }
}

// Both read the whole value as written (number_from_text): a value out of the type's range is an error, not a
// clamp.
int64_t integer_argument(const std::string& program, const std::string& flag, const std::string& value,
                         int64_t low, int64_t high) {
  const std::optional<int64_t> v = number_from_text<int64_t>(value);
  check(v && *v >= low && *v <= high, program, ": ", flag, " expects an integer in [", low, ", ", high, "], got '",
        echo(value), "'");
  return *v;
}

double number_argument(const std::string& program, const std::string& flag, const std::string& value) {
  bool out_of_range = false;
  const std::optional<double> v = number_from_text<double>(value, &out_of_range);
  check(v && std::isfinite(*v) && *v >= 0, program, ": ", flag, " expects a non-negative decimal number",
        out_of_range ? " (this one is out of the range of a double: too large, or so small it would round to 0)"
                     : "", ", got '", echo(value), "'");
  return *v;
}

std::string fixed_text(double x, int digits) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "%.*f", digits, x);
  return buffer;
}

Json log_value(double x) { return std::isfinite(x) ? Json(x) : Json(); }

double log_number(const Json* value) {
  if (!value || value->is_null()) return NAN;
  return json::as_number(*value);
}

int run_program(int (*run)(int, char**), int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

}  // namespace mixtape
