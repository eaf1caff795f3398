#pragma once
// What the two training benchmarks share (bench_train_gpt on the CPU, bench_gpu_train on a GPU): the token
// stream, the trainer a step runs on, the median of step times, which modes compute in 16 bits, and running
// the PyTorch script as a child process.
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "train/training.h"

namespace mixtape::bench {

// n uniform random tokens below vocab (fixed seed): the cost of a step does not depend on the token values.
inline TokenData random_tokens(int64_t vocab, int64_t n) {
  TokenData data;
  data.vocab_size = vocab;
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(vocab - 1));
  data.tokens.resize(static_cast<size_t>(n));
  for (int32_t& t : data.tokens) t = pick(rng);
  return data;
}

// The GPT a benchmark trains, and its batch.
struct BenchModel {
  int64_t layers = 0, heads = 0, width = 0, block = 0, vocab = 0, batch = 0;
  int64_t tokens_per_step() const { return batch * block; }
};

// A Trainer whose train_step() is train_gpt's step: forward, fused cross-entropy, backward, global gradient
// clipping at norm 1, AdamW (weight decay 0.1 on matrices and embeddings) at the constant learning rate lr,
// under TrainOptions::amp = AmpConfig::parse(mode) (the mode's casts, loss scaling, overflow check and
// master-weight update included). The same seed every time: every mode starts from the same weights and
// sees the same batches. Building a tf32 trainer turns tf32 on process-wide (tensor/precision.h).
// trainer_setup gives the config and options (for the parallel trainer, bench_dist_train).
inline std::pair<GPTConfig, TrainOptions> trainer_setup(const BenchModel& model, const std::string& mode,
                                                         double lr, Device device) {
  GPTConfig config;
  config.n_layer = model.layers;
  config.n_head = model.heads;
  config.n_embd = model.width;
  config.block_size = model.block;
  config.vocab_size = model.vocab;
  TrainOptions options;
  options.batch = model.batch;
  options.steps = 1000000;
  options.lr = lr;
  options.min_lr = lr;
  options.schedule = "constant";
  options.optimizer = "adamw";
  options.weight_decay = 0.1;
  options.grad_clip = 1.0;
  options.amp = AmpConfig::parse(mode);
  options.device = device;
  return {config, options};
}

inline std::unique_ptr<Trainer> make_trainer(const BenchModel& model, const std::string& mode, double lr,
                                             Device device, const TokenData& data) {
  const auto [config, options] = trainer_setup(model, mode, lr, device);
  return std::make_unique<Trainer>(config, options, data);
}

// The median of v; NaN when v is empty.
inline double median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// A mode computes its matmuls in fp16/bf16 when it autocasts or casts the model to a 16-bit type (not fp32,
// tf32 or fp16_apex:O0, which keep everything in fp32; nor the fp8 and block-scaled modes, whose Linear GEMMs
// are emulated on the CPU: bench_train_gpt judges them against bf16).
inline bool is_low_precision(const AmpConfig& c) {
  auto low = [](std::optional<DType> d) { return d && (*d == DType::F16 || *d == DType::BF16); };
  return !c.quantizes_gemms() && (low(c.autocast_dtype()) || low(c.model_dtype()));
}

// Runs `command` through the shell and reads all it prints into `out`. false when it cannot be started;
// otherwise `status` is its wait status (see exited_with).
inline bool run_command(const std::string& command, std::string& out, int& status) {
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) return false;
  char buffer[4096];
  while (size_t n = fread(buffer, 1, sizeof(buffer), pipe)) out.append(buffer, n);
  status = pclose(pipe);
  return true;
}

// Whether a wait status is a normal exit with `code` (77: the PyTorch scripts' "skipped").
inline bool exited_with(int status, int code) { return WIFEXITED(status) && WEXITSTATUS(status) == code; }

}  // namespace mixtape::bench
