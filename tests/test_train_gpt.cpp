// The GPT trainer's core (optim/training.h): batches, evaluation, and resumption that is bit-exact.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <unistd.h>

#include "autograd/autograd.h"
#include "optim/training.h"
#include "nn/safetensors.h"
#include "test_util.h"

using namespace mixtape;

namespace {

// A small deterministic text with some structure (so the loss can fall).
std::string sample_text() {
  std::string text;
  const char* words[] = {"the ", "cat ", "sat ", "on ", "a ", "mat.\n", "dog ", "ran "};
  uint64_t state = 12345;
  for (int i = 0; i < 3000; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    text += words[(state >> 33) % 8];
  }
  return text;
}

GPTConfig tiny_config(int64_t vocab, double dropout) {
  GPTConfig c;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 16;
  c.block_size = 8;
  c.vocab_size = vocab;
  c.dropout = dropout;
  return c;
}

TrainOptions tiny_options(const std::string& optimizer) {
  TrainOptions o;
  o.batch = 4;
  o.steps = 8;
  o.lr = 3e-3;
  o.min_lr = 3e-4;
  o.warmup = 2;
  o.optimizer = optimizer;
  o.grad_clip = 1.0;
  o.seed = 7;
  return o;
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / (name + "." + std::to_string(getpid()) + ".safetensors"))
      .string();
}

bool bit_equal(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  const Tensor ac = a.contiguous(), bc = b.contiguous();
  return std::memcmp(ac.data_ptr(), bc.data_ptr(), static_cast<size_t>(a.numel()) * dtype_size(a.dtype())) == 0;
}

void expect_resume_is_bit_exact(const std::string& optimizer, bool sequential) {
  const TokenData data = char_tokens(sample_text());
  const GPTConfig config = tiny_config(data.vocab_size, 0.1);  // dropout > 0: the RNG state must be restored
  TrainOptions options = tiny_options(optimizer);
  options.sequential = sequential;

  Trainer straight(config, options, data);
  std::vector<double> straight_losses;
  for (int i = 0; i < 8; ++i) straight_losses.push_back(straight.train_step().loss);

  const std::string path = temp_path("resume_" + optimizer);
  std::vector<double> resumed_losses;
  {
    Trainer first(config, options, data);
    for (int i = 0; i < 4; ++i) resumed_losses.push_back(first.train_step().loss);
    first.evaluate();  // an evaluation in between must not disturb anything
    first.save_checkpoint(path);
  }
  Trainer second(config, options, data);
  second.load_checkpoint(load_safetensors(path));
  EXPECT_EQ(second.step(), 4);
  for (int i = 0; i < 4; ++i) resumed_losses.push_back(second.train_step().loss);
  std::filesystem::remove(path);

  for (int i = 0; i < 8; ++i) EXPECT_EQ(straight_losses[i], resumed_losses[i]) << "step " << i;
  const StateDict a = straight.checkpoint(), b = second.checkpoint();
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (const auto& [name, t] : a.tensors) {
    ASSERT_TRUE(b.tensors.count(name)) << name;
    EXPECT_TRUE(bit_equal(t, b.tensors.at(name))) << name;
  }
  EXPECT_EQ(a.metadata, b.metadata);
  // The dropout streams really advanced (so the comparison above covered them).
  EXPECT_NE(a.metadata.at("rng.transformer.drop.rng.offset"), "0");
}

}  // namespace

TEST(TrainGPT, ResumedAdamWRunReproducesTheUninterruptedRunBitForBit) { expect_resume_is_bit_exact("adamw", false); }
TEST(TrainGPT, ResumedSGDSequentialRunReproducesTheUninterruptedRunBitForBit) {
  expect_resume_is_bit_exact("sgd", true);
}
TEST(TrainGPT, ResumedAdamRunReproducesTheUninterruptedRunBitForBit) { expect_resume_is_bit_exact("adam", false); }

TEST(TrainGPT, SequentialBatchesFollowTheDocumentedFormula) {
  const TokenData data = char_tokens(sample_text());
  TrainOptions options = tiny_options("adamw");
  options.sequential = true;
  Trainer trainer(tiny_config(data.vocab_size, 0), options, data);
  const int64_t B = options.batch, T = 8, range = data.n_train() - T - 1;
  for (int64_t s : {0, 1, 5, 1000}) {
    const auto [x, y] = trainer.batch(s);
    const std::vector<int64_t> xs = x.to_vector<int64_t>(), ys = y.to_vector<int64_t>();
    for (int64_t i = 0; i < B; ++i) {
      const int64_t start = ((s * B + i) * T) % range;
      for (int64_t t = 0; t < T; ++t) {
        EXPECT_EQ(xs[i * T + t], data.tokens[start + t]);
        EXPECT_EQ(ys[i * T + t], data.tokens[start + t + 1]);
      }
    }
  }
}

TEST(TrainGPT, RandomBatchesDependOnlyOnSeedAndStepAndStayInTheTrainingSplit) {
  const TokenData data = char_tokens(sample_text());
  const TrainOptions options = tiny_options("adamw");
  Trainer a(tiny_config(data.vocab_size, 0), options, data);
  Trainer b(tiny_config(data.vocab_size, 0), options, data);
  b.train_step();  // b's own progress does not change what batch(s) is
  EXPECT_TRUE(bit_equal(a.batch(3).first, b.batch(3).first));
  EXPECT_FALSE(bit_equal(a.batch(3).first, a.batch(4).first));
  TrainOptions other = options;
  other.seed = 8;
  Trainer c(tiny_config(data.vocab_size, 0), other, data);
  EXPECT_FALSE(bit_equal(a.batch(3).first, c.batch(3).first));
  // Targets are inputs shifted by one, within the training split.
  const auto [x, y] = a.batch(2);
  const std::vector<int64_t> xs = x.to_vector<int64_t>(), ys = y.to_vector<int64_t>();
  for (int64_t i = 0; i < options.batch; ++i)
    for (int64_t t = 0; t + 1 < 8; ++t) EXPECT_EQ(ys[i * 8 + t], xs[i * 8 + t + 1]);
}

TEST(TrainGPT, EvaluateIsTheMeanLossOverNonOverlappingValidationWindows) {
  const TokenData data = char_tokens(sample_text());
  const GPTConfig config = tiny_config(data.vocab_size, 0.1);
  Trainer trainer(config, tiny_options("adamw"), data);
  const double val = trainer.evaluate();
  // Reference: one window at a time, straight through the model.
  const int64_t T = 8, windows = (data.n_val() - 1) / T;
  double sum = 0;
  {
    NoGradGuard no_grad;
    trainer.model().eval();
    for (int64_t k = 0; k < windows; ++k) {
      std::vector<int64_t> x, y;
      for (int64_t t = 0; t < T; ++t) {
        x.push_back(data.tokens[data.n_train() + k * T + t]);
        y.push_back(data.tokens[data.n_train() + k * T + t + 1]);
      }
      sum += trainer.model().forward(Tensor::from_vector(x, {1, T}), Tensor::from_vector(y, {1, T})).loss.item();
    }
    trainer.model().train();
  }
  // Batched vs one-at-a-time differ only by f32 summation order inside the kernels.
  EXPECT_NEAR(val, sum / double(windows), 1e-5);
  EXPECT_GT(val, 0.5 * std::log(double(data.vocab_size)));
}

TEST(TrainGPT, LossFallsOnStructuredText) {
  const TokenData data = char_tokens(sample_text());
  TrainOptions options = tiny_options("adamw");
  options.steps = 60;
  options.lr = 1e-2;
  Trainer trainer(tiny_config(data.vocab_size, 0), options, data);
  const double before = trainer.evaluate();
  for (int i = 0; i < 60; ++i) trainer.train_step();
  const double after = trainer.evaluate();
  EXPECT_LT(after, before - 0.5) << before << " -> " << after;
}

TEST(TrainGPT, WeightDecayGoesToMatricesAndEmbeddingsOnly) {
  const TokenData data = char_tokens(sample_text());
  Trainer trainer(tiny_config(data.vocab_size, 0), tiny_options("adamw"), data);
  const auto& groups = trainer.optimizer().param_groups();
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0].weight_decay, 0.1);
  EXPECT_EQ(groups[1].weight_decay, 0.0);
  for (const Tensor& p : groups[0].params) EXPECT_GE(p.dim(), 2);
  for (const Tensor& p : groups[1].params) EXPECT_LT(p.dim(), 2);
  EXPECT_EQ(groups[0].params.size() + groups[1].params.size(), trainer.model().parameters().size());
}

TEST(TrainGPT, CheckpointWithOtherOptionsIsRejectedNamingTheOption) {
  const TokenData data = char_tokens(sample_text());
  const GPTConfig config = tiny_config(data.vocab_size, 0);
  Trainer a(config, tiny_options("adamw"), data);
  a.train_step();
  const StateDict state = a.checkpoint();
  TrainOptions other = tiny_options("adamw");
  other.lr = 1e-3;
  Trainer b(config, other, data);
  EXPECT_ERROR_MENTIONS(b.load_checkpoint(state), "lr");
  GPTConfig wider = config;
  wider.n_embd = 32;
  Trainer c(wider, tiny_options("adamw"), data);
  EXPECT_ERROR_MENTIONS(c.load_checkpoint(state), "n_embd");
  // A weights-only dict has no optimizer state.
  StateDict weights = model_part(state);
  for (auto it = weights.metadata.begin(); it != weights.metadata.end();)
    it = it->first.rfind("optimizer.", 0) == 0 ? weights.metadata.erase(it) : std::next(it);
  Trainer d(config, tiny_options("adamw"), data);
  EXPECT_ERROR_MENTIONS(d.load_checkpoint(weights), "optimizer");
  EXPECT_EQ(d.step(), 0);
}

TEST(TrainGPT, BadOptionsAreErrorsNamingTheOption) {
  const TokenData data = char_tokens(sample_text());
  const GPTConfig config = tiny_config(data.vocab_size, 0);
  TrainOptions o = tiny_options("adamw");
  o.optimizer = "lion";
  EXPECT_ERROR_MENTIONS(Trainer(config, o, data), "--optimizer");
  o = tiny_options("adamw");
  o.schedule = "linear";
  EXPECT_ERROR_MENTIONS(Trainer(config, o, data), "--schedule");
  o = tiny_options("adamw");
  o.min_lr = 1.0;
  EXPECT_ERROR_MENTIONS(Trainer(config, o, data), "--min-lr");
  EXPECT_ERROR_MENTIONS(load_token_file("/nonexistent/file.txt"), "/nonexistent/file.txt");
}

TEST(TrainGPT, VocabMetadataRoundTripsEveryByte) {
  std::vector<uint8_t> vocab;
  for (int b = 0; b < 256; ++b) vocab.push_back(static_cast<uint8_t>(b));
  EXPECT_EQ(vocab_from_metadata(vocab_to_metadata(vocab)), vocab);
  EXPECT_ERROR_MENTIONS(vocab_from_metadata("[1, 300]"), "300");
}
