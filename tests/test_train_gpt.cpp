// The GPT trainer's core (train/training.h): batches, evaluation, and resumption that is bit-exact.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <map>
#include <string>
#include <unistd.h>

#include "autograd/autograd.h"
#include "train/training.h"
#include "io/safetensors.h"
#include "tensor/random.h"
#include "test_util.h"

using namespace mixtape;

namespace {

// A small deterministic text with some structure (so the loss can fall).
std::string sample_text() { return mixtape::testing::word_text(3000); }

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

void expect_resume_is_bit_exact(const std::string& optimizer, bool sequential, const AmpConfig& amp = {}) {
  const TokenData data = char_tokens(sample_text());
  const GPTConfig config = tiny_config(data.vocab_size, 0.1);  // dropout > 0: the RNG state must be restored
  TrainOptions options = tiny_options(optimizer);
  options.sequential = sequential;
  options.amp = amp;

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
    EXPECT_TRUE(mixtape::testing::bit_equal(t, b.tensors.at(name))) << name;
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

// Mixed precision: the fp32 masters and the scaler state (scale, growth and hysteresis trackers) are in the
// checkpoint, so a resumed run is bit-exact too. The scalers start high enough to overflow and back off, and
// grow every 2 clean steps, so their trackers are mid-way at the save.
TEST(TrainGPT, ResumedMixedPrecisionRunsReproduceTheUninterruptedRunBitForBit) {
  expect_resume_is_bit_exact("adamw", false,
                             AmpConfig::from_json(R"({"initial_scale":1e30,"max_scale":1e30,"growth_interval":2})",
                                                  "fp16_naive"));
  expect_resume_is_bit_exact("adamw", false, AmpConfig::from_json(R"({"init_scale":1e9,"growth_interval":3})", "fp16"));
  expect_resume_is_bit_exact("adam", false, AmpConfig::parse("fp16_apex:O2"));
  expect_resume_is_bit_exact("sgd", false, AmpConfig::parse("bf16_naive"));
  expect_resume_is_bit_exact("adamw", false, AmpConfig::parse("bf16"));
}

TEST(TrainGPT, MixedPrecisionCheckpointHoldsFp32WeightsMastersAndScalerState) {
  const TokenData data = char_tokens(sample_text());
  const GPTConfig config = tiny_config(data.vocab_size, 0);
  TrainOptions options = tiny_options("adamw");
  options.amp = AmpConfig::parse("fp16_naive");
  Trainer trainer(config, options, data);
  for (int i = 0; i < 3; ++i) trainer.train_step();
  const StateDict state = trainer.checkpoint();
  EXPECT_EQ(state.tensors.at("transformer.wte.weight").dtype(), DType::F32);  // generate / --init read it
  EXPECT_EQ(trainer.model().named_parameters()[0].second.dtype(), DType::F16);
  EXPECT_EQ(state.tensors.at("optimizer.master.0").dtype(), DType::F32);
  EXPECT_EQ(state.metadata.at("optimizer.scaler.0.type"), "DynamicLossScaler");
  EXPECT_EQ(state.metadata.at("train.precision"), "fp16_naive");
  // The saved weights are the model's fp16 values, exactly.
  EXPECT_EQ(state.tensors.at("transformer.wte.weight").to(DType::F16).to_vector<float>(),
            trainer.model().named_parameters()[0].second.to_vector<float>());
  // Another precision mode is another trajectory: refused, naming the option.
  TrainOptions fp32 = tiny_options("adamw");
  Trainer other(config, fp32, data);
  EXPECT_ERROR_MENTIONS(other.load_checkpoint(state), "precision");
  // But its weights load anywhere (a weights file is fp32).
  other.load_weights(state);
}

// --init in a mode with fp32 master weights: the masters must take the loaded weights, or the first step would
// write the initial weights' masters (plus an update) back over the loaded model.
TEST(TrainGPT, LoadedWeightsReachTheMasterWeightsOfACastModel) {
  const TokenData data = char_tokens(sample_text());
  // Loss scales that do not overflow on the first step (the step must move the weights).
  const std::pair<const char*, const char*> modes[] = {{"fp16_naive", R"({"initial_scale":1024})"},
                                                       {"fp16_apex:O2", R"({"max_loss_scale":1024})"},
                                                       {"bf16_naive", R"({"initial_scale":1})"}};
  for (const auto& [mode, json] : modes) {
    TrainOptions options = tiny_options("adamw");
    options.amp = AmpConfig::from_json(json, mode);
    Trainer source(tiny_config(data.vocab_size, 0), options, data);
    for (int i = 0; i < 3; ++i) source.train_step();
    TrainOptions other = options;
    other.seed = options.seed + 1;  // other initial weights, same batches below
    Trainer a(tiny_config(data.vocab_size, 0), other, data), b(tiny_config(data.vocab_size, 0), other, data);
    a.load_weights(source.checkpoint());
    b.load_weights(source.checkpoint());
    a.train_step();
    const StateDict after = a.model().state_dict();
    const StateDict loaded = b.model().state_dict();
    // One small step away from the loaded weights, not from the seed's.
    double moved = 0;
    for (const auto& [name, t] : after.tensors) {
      const std::vector<double> x = t.to_vector<double>(), y = loaded.tensors.at(name).to_vector<double>();
      for (size_t i = 0; i < x.size(); ++i) moved = std::max(moved, std::abs(x[i] - y[i]));
    }
    EXPECT_LT(moved, 0.02) << mode;  // lr 3e-3 at warmup: an AdamW step moves a weight by about that
    EXPECT_GT(moved, 0.0) << mode;
  }
}

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
  EXPECT_TRUE(mixtape::testing::bit_equal(a.batch(3).first, b.batch(3).first));
  EXPECT_FALSE(mixtape::testing::bit_equal(a.batch(3).first, a.batch(4).first));
  TrainOptions other = options;
  other.seed = 8;
  Trainer c(tiny_config(data.vocab_size, 0), other, data);
  EXPECT_FALSE(mixtape::testing::bit_equal(a.batch(3).first, c.batch(3).first));
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

TEST(TrainGPT, StepStatsTimeTheForwardBackwardAndOptimizerPhasesWithinTheStep) {
  const TokenData data = char_tokens(sample_text());
  Trainer trainer(tiny_config(data.vocab_size, 0), tiny_options("adamw"), data);
  trainer.train_step();  // warm-up
  for (int i = 0; i < 3; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const StepStats s = trainer.train_step();
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_GT(s.forward_seconds, 0.0);
    EXPECT_GT(s.backward_seconds, 0.0);
    EXPECT_GT(s.optimizer_seconds, 0.0);
    EXPECT_LE(s.forward_seconds + s.backward_seconds + s.optimizer_seconds, wall);
  }
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
  // An optimizer state the optimizer rejects (after the model has taken the weights): the model gets its own
  // weights back, and training goes on from them.
  StateDict corrupt = state;
  for (auto& [key, t] : corrupt.tensors)
    if (key.rfind("optimizer.state.", 0) == 0 && key.find("exp_avg_sq") != std::string::npos) {
      t = t.reshape({-1}).narrow(0, 0, 1).contiguous();
      break;
    }
  Trainer e(config, tiny_options("adamw"), data);
  const StateDict before = e.model().state_dict();
  std::map<std::string, std::vector<double>> values;
  for (const auto& [name, t] : before.tensors) values[name] = t.to_vector<double>();
  EXPECT_ERROR_MENTIONS(e.load_checkpoint(corrupt), "exp_avg_sq");
  for (const auto& [name, t] : e.model().state_dict().tensors)
    EXPECT_EQ(t.to_vector<double>(), values[name]) << name;
  EXPECT_EQ(e.step(), 0);
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

// ---- sample_tokens ----

namespace {

// The logits of the last position for a window of ids (the model in eval mode, no gradients).
std::vector<double> last_logits(GPT& model, const std::vector<int64_t>& ids) {
  NoGradGuard no_grad;
  const int64_t T = std::min<int64_t>(static_cast<int64_t>(ids.size()), model.config().block_size);
  const std::vector<int64_t> window(ids.end() - T, ids.end());
  const Tensor logits = model.forward(Tensor::from_vector(window, {1, T})).logits;  // [1, T, V]
  return logits.select(1, T - 1).select(0, 0).to_vector<double>();
}

// A model with some training, so its next-token distributions are far from uniform yet not one-hot.
struct TrainedModel {
  TokenData data = char_tokens(sample_text());
  std::unique_ptr<Trainer> trainer;
  TrainedModel() {
    TrainOptions options = tiny_options("adamw");
    options.steps = 30;
    options.lr = 1e-2;
    trainer = std::make_unique<Trainer>(tiny_config(data.vocab_size, 0.1), options, data);
    for (int i = 0; i < 30; ++i) trainer->train_step();
  }
  GPT& model() { return trainer->model(); }
};

}  // namespace

TEST(TrainGPT, SampleWithTopKOneIsGreedyArgmaxWhateverTheSeed) {
  TrainedModel m;
  GPT& model = m.model();
  // A prompt longer than the block (8): only the last 8 tokens are the window.
  const std::vector<int64_t> prompt(m.data.tokens.begin(), m.data.tokens.begin() + 11);
  std::vector<int64_t> greedy = prompt;
  model.eval();
  for (int i = 0; i < 12; ++i) {
    const std::vector<double> z = last_logits(model, greedy);
    greedy.push_back(std::max_element(z.begin(), z.end()) - z.begin());
  }
  const std::vector<int64_t> expected(greedy.begin() + 11, greedy.end());
  for (uint64_t seed : {1u, 2u, 99u})
    for (double temperature : {0.1, 1.0, 5.0})
      EXPECT_EQ(sample_tokens(model, prompt, 12, temperature, 1, seed), expected)
          << "seed " << seed << ", temperature " << temperature;
}

TEST(TrainGPT, SampleAtAVanishingTemperatureIsGreedyAndAtAHugeOneIsAValidToken) {
  // z / temperature overflowed to inf for a temperature near the smallest double, and inf - inf made every
  // probability NaN: the sampler returned the last token of the vocabulary. The limit is the argmax.
  TrainedModel m;
  GPT& model = m.model();
  model.eval();
  const std::vector<int64_t> prompt(m.data.tokens.begin(), m.data.tokens.begin() + 5);
  const std::vector<double> z = last_logits(model, prompt);
  const int64_t argmax = std::max_element(z.begin(), z.end()) - z.begin();
  ASSERT_NE(argmax, m.data.vocab_size - 1);  // else a sampler that returns the last token would pass unnoticed
  for (uint64_t seed : {1u, 2u, 3u})
    for (double temperature : {1e-310, 1e-300, 1e-30})
      EXPECT_EQ(sample_tokens(model, prompt, 1, temperature, 0, seed)[0], argmax)
          << "seed " << seed << ", temperature " << temperature;
  // A huge temperature is uniform over the vocabulary: every draw is some token, and they vary.
  std::set<int64_t> drawn;
  for (uint64_t seed = 0; seed < 16; ++seed) {
    const int64_t t = sample_tokens(model, prompt, 1, 1e308, 0, seed)[0];
    EXPECT_GE(t, 0);
    EXPECT_LT(t, m.data.vocab_size);
    drawn.insert(t);
  }
  EXPECT_GE(drawn.size(), 4u);
}

TEST(TrainGPT, SampleIsReproducibleForASeedAndDiffersAcrossSeeds) {
  TrainedModel m;
  const int64_t newline = default_start_token(m.data.vocab);
  ASSERT_EQ(m.data.vocab[newline], '\n');
  const auto a = sample_tokens(m.model(), {newline}, 40, 1.0, 0, 5);
  const auto b = sample_tokens(m.model(), {newline}, 40, 1.0, 0, 5);
  const auto c = sample_tokens(m.model(), {newline}, 40, 1.0, 0, 6);
  ASSERT_EQ(a.size(), 40u);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  for (int64_t t : a) {
    EXPECT_GE(t, 0);
    EXPECT_LT(t, m.data.vocab_size);
  }
  // The callback sees every new token, in order.
  std::vector<int64_t> streamed;
  const auto d =
      sample_tokens(m.model(), {newline}, 40, 1.0, 0, 5, [&](int64_t t) { streamed.push_back(t); });
  EXPECT_EQ(streamed, a);
  EXPECT_EQ(d, a);
}

TEST(TrainGPT, SampleDrawsTokenIFromTheTopKSoftmaxAtThePhiloxUniformOfI) {
  // An independent reading of the documented rule for the first new token: keep the k largest logits,
  // softmax(z / temperature) over them, the first token whose cumulative probability exceeds u.
  TrainedModel m;
  GPT& model = m.model();
  model.eval();
  const std::vector<int64_t> prompt(m.data.tokens.begin() + 3, m.data.tokens.begin() + 9);
  const std::vector<double> z = last_logits(model, prompt);
  const double temperature = 1.5;
  const int64_t k = 4;
  std::vector<int64_t> order(z.size());
  for (size_t v = 0; v < z.size(); ++v) order[v] = static_cast<int64_t>(v);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return z[a] > z[b]; });
  std::vector<double> p(z.size(), 0.0);
  double sum = 0;
  for (int64_t j = 0; j < k; ++j) sum += p[order[j]] = std::exp((z[order[j]] - z[order[0]]) / temperature);
  std::set<int64_t> drawn;
  for (uint64_t seed = 0; seed < 24; ++seed) {
    const auto bits = philox4x32(0, 0, seed);
    const double u = uniform_double_from_bits(bits[0], bits[1]);
    int64_t expected = -1;
    double cdf = 0;
    for (size_t v = 0; v < p.size() && expected < 0; ++v)
      if (p[v] > 0 && (cdf += p[v] / sum) > u) expected = static_cast<int64_t>(v);
    const int64_t got = sample_tokens(model, prompt, 1, temperature, k, seed)[0];
    EXPECT_EQ(got, expected) << "seed " << seed << " u " << u;
    drawn.insert(got);
  }
  // The draws really vary over the top k (so the comparison covers more than the argmax).
  EXPECT_GE(drawn.size(), 2u);
  EXPECT_LE(drawn.size(), static_cast<size_t>(k));
}

TEST(TrainGPT, SampleRunsInEvalModeAndRestoresTheModelsMode) {
  // With dropout 0.1, a sample drawn in training mode would depend on the dropout stream; the sampler
  // switches to eval mode, so the result is the same from either mode, and the mode is given back.
  TrainedModel m;
  GPT& model = m.model();
  model.train();
  const auto from_train = sample_tokens(model, {0}, 20, 1.0, 0, 3);
  EXPECT_TRUE(model.is_training());
  model.eval();
  const auto from_eval = sample_tokens(model, {0}, 20, 1.0, 0, 3);
  EXPECT_FALSE(model.is_training());
  EXPECT_EQ(from_train, from_eval);
  // An error leaves the mode restored too.
  model.train();
  EXPECT_ERROR_MENTIONS(sample_tokens(model, {0}, 2, 1.0, 0, 3, [](int64_t) { fail("stop"); }), "stop");
  EXPECT_TRUE(model.is_training());
}

TEST(TrainGPT, SampleOfAHugeCountDrawsRatherThanFailingToReserveIt) {
  // --sample / generate --tokens of 2^62 failed at once with "vector::reserve" (10^11: bad_alloc), naming
  // nothing; the sampler now draws, here until the callback stops it at the third token.
  TrainedModel m;
  int drawn = 0;
  EXPECT_ERROR_MENTIONS(sample_tokens(m.model(), {0}, int64_t{1} << 62, 1.0, 0, 3,
                                      [&](int64_t) {
                                        if (++drawn == 3) fail("stop");
                                      }),
                        "stop");
  EXPECT_EQ(drawn, 3);
}

TEST(TrainGPT, SampleRejectsBadArgumentsNamingThem) {
  const TokenData data = char_tokens(sample_text());
  GPT model(tiny_config(data.vocab_size, 0), 1);
  EXPECT_ERROR_MENTIONS(sample_tokens(model, {}, 3, 1.0, 0, 1), "empty");
  EXPECT_ERROR_MENTIONS(sample_tokens(model, {data.vocab_size}, 3, 1.0, 0, 1),
                        "token " + std::to_string(data.vocab_size));
  EXPECT_ERROR_MENTIONS(sample_tokens(model, {-1}, 3, 1.0, 0, 1), "-1");
  EXPECT_ERROR_MENTIONS(sample_tokens(model, {0}, 3, 0.0, 0, 1), "temperature");
  EXPECT_ERROR_MENTIONS(sample_tokens(model, {0}, 3, INFINITY, 0, 1), "temperature");
  EXPECT_ERROR_MENTIONS(sample_tokens(model, {0}, 3, 1.0, -2, 1), "top_k");
  EXPECT_ERROR_MENTIONS(sample_tokens(model, {0}, -1, 1.0, 0, 1), "-1");
  EXPECT_TRUE(sample_tokens(model, {0}, 0, 1.0, 0, 1).empty());
}

TEST(TrainGPT, DefaultStartTokenIsTheNewlineOfTheVocabularyElseZero) {
  EXPECT_EQ(default_start_token({' ', '\n', 'a'}), 1);  // not sorted on purpose: the position is the id
  EXPECT_EQ(default_start_token({'\n', 'a'}), 0);
  EXPECT_EQ(default_start_token({'a', 'b', '\n'}), 2);
  EXPECT_EQ(default_start_token({'a', 'b'}), 0);
  EXPECT_EQ(default_start_token({}), 0);
}

// ---- token files ----

namespace {

std::string write_temp_file(const std::string& name, const std::string& bytes) {
  const std::string path =
      (std::filesystem::temp_directory_path() / (std::to_string(getpid()) + "_" + name)).string();
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return path;
}

}  // namespace

TEST(TrainGPT, BinTokenFileIsLittleEndianUint16) {
  // ids 0x0201 = 513, 3, 0xFFFF = 65535, 0x0100 = 256
  const std::string bytes("\x01\x02\x03\x00\xff\xff\x00\x01", 8);
  const std::string path = write_temp_file("tokens.bin", bytes);
  const TokenData data = load_token_file(path, 65536);
  std::filesystem::remove(path);
  EXPECT_EQ(data.tokens, (std::vector<int32_t>{513, 3, 65535, 256}));
  EXPECT_EQ(data.vocab_size, 65536);
  EXPECT_TRUE(data.vocab.empty());
}

TEST(TrainGPT, BinTokenFileErrorsNameTheProblem) {
  const std::string odd = write_temp_file("odd.bin", std::string("\x01\x00\x02", 3));
  EXPECT_ERROR_MENTIONS(load_token_file(odd, 50), "odd byte count (3)");
  std::filesystem::remove(odd);

  // ids 1, 49, 50
  const std::string big = write_temp_file("big.bin", std::string("\x01\x00\x31\x00\x32\x00", 6));
  EXPECT_NO_THROW(load_token_file(big, 51));
  EXPECT_ERROR_MENTIONS(load_token_file(big, 50), "token 2 of");
  EXPECT_ERROR_MENTIONS(load_token_file(big, 50), "is 50, not below --vocab-size 50");
  EXPECT_ERROR_MENTIONS(load_token_file(big), "--vocab-size");        // missing
  EXPECT_ERROR_MENTIONS(load_token_file(big, 70000), "--vocab-size");  // over uint16's range
  std::filesystem::remove(big);

  const std::string text = write_temp_file("chars.txt", "abca");
  EXPECT_ERROR_MENTIONS(load_token_file(text, 10), "--vocab-size applies to .bin");
  const TokenData chars = load_token_file(text);
  std::filesystem::remove(text);
  EXPECT_EQ(chars.vocab, (std::vector<uint8_t>{'a', 'b', 'c'}));
  EXPECT_EQ(chars.tokens, (std::vector<int32_t>{0, 1, 2, 0}));
  // Any name not ending in .bin is text, with or without an extension.
  const std::string plain = write_temp_file("fortunes", "ba");
  const TokenData plain_chars = load_token_file(plain);
  std::filesystem::remove(plain);
  EXPECT_EQ(plain_chars.vocab, (std::vector<uint8_t>{'a', 'b'}));
  EXPECT_EQ(plain_chars.tokens, (std::vector<int32_t>{1, 0}));
}

// ---- files with bad contents: each an Error naming the file or entry, before anything is built or changed ----

TEST(TrainGPT, LoadModelFileChecksTheTensorsAgainstTheConfigBeforeBuildingTheModel) {
  const TokenData data = char_tokens(sample_text());
  const GPTConfig config = tiny_config(data.vocab_size, 0);
  StateDict weights = GPT(config, 1).state_dict();
  config.to_metadata(weights.metadata);
  const std::string path = temp_path("model_file");
  auto saved_with = [&](const std::string& key, const std::string& value) {
    StateDict state = weights;
    state.metadata[key] = value;
    save_safetensors(path, state);
    return path;
  };
  EXPECT_NO_THROW(load_model_file(saved_with("n_layer", "2")));
  // The metadata says 1000 layers, the file holds 2 blocks: no 1000-layer model is built to find that out.
  EXPECT_ERROR_MENTIONS(load_model_file(saved_with("n_layer", "1000")), path, "n_layer = 1000", "holds 2 blocks");
  EXPECT_ERROR_MENTIONS(load_model_file(saved_with("block_size", "8388608")), path,
                        "'transformer.wpe.weight' is [8,16]", "expects [8388608,16]");
  EXPECT_ERROR_MENTIONS(load_model_file(saved_with("norm_eps", "inf")), "norm_eps", "finite");
  EXPECT_ERROR_MENTIONS(load_model_file(saved_with("vocab", "[1, 2")), path, "metadata entry 'vocab'", "json");
  // A character list shorter than vocab_size would leave sampled ids without a character (generate failed
  // part-way through its output, depending on the seed).
  EXPECT_ERROR_MENTIONS(load_model_file(saved_with("vocab", "[97, 98]")), path, "'vocab' lists 2 characters",
                        "vocab_size is " + std::to_string(config.vocab_size));
  // Weights saved in 16 bits read in the model's fp32, as train_gpt --init reads them.
  {
    StateDict half = weights;
    for (auto& [name, t] : half.tensors) t = t.to(DType::F16);
    save_safetensors(path, half);
    const std::unique_ptr<GPT> model = load_model_file(path);
    const Tensor wte = model->state_dict().tensors.at("transformer.wte.weight");
    EXPECT_EQ(wte.dtype(), DType::F32);
    EXPECT_EQ(wte.to_vector<double>(), half.tensors.at("transformer.wte.weight").to_vector<double>());
  }
  // Weights that are not finite (generate would print garbage).
  for (const Tensor& bad : {Tensor::full({8, 16}, NAN), Tensor::full({8, 16}, INFINITY)}) {
    StateDict state = weights;
    state.tensors.at("transformer.wpe.weight") = bad;
    save_safetensors(path, state);
    EXPECT_ERROR_MENTIONS(load_model_file(path), path, "'transformer.wpe.weight' must be finite in the model's f32",
                          std::isnan(bad.to_vector<double>()[0]) ? "element 0 is nan" : "element 0 is inf");
  }
  std::filesystem::remove(path);
}

TEST(TrainGPT, ABatchOfMoreThan2To32TokensIsAnErrorNamingTrainBatch) {
  const TokenData data = char_tokens(sample_text());
  const GPTConfig config = tiny_config(data.vocab_size, 0);
  auto metadata = tiny_options("adamw").to_metadata();
  metadata["train.batch"] = "4611686018427387904";  // 2^62 rows x 8 tokens overflowed int64
  EXPECT_ERROR_MENTIONS(TrainOptions::from_metadata(metadata), "train.batch", "4611686018427387904");
  TrainOptions options = tiny_options("adamw");
  options.batch = int64_t{1} << 30;  // x block 8 = 2^33 tokens
  EXPECT_ERROR_MENTIONS(Trainer(config, options, data), "train.batch", "1073741824 x block 8", "2^32");
  EXPECT_ERROR_MENTIONS(training_batch(data, options, 8, 1, 0), "train.batch");
}

TEST(TrainGPT, SequentialBatchesOfHugeStepsFollowTheDocumentedFormulaWithoutOverflow) {
  const TokenData data = char_tokens(sample_text());
  TrainOptions options = tiny_options("adamw");
  options.sequential = true;
  const int64_t B = options.batch, T = 8, range = data.n_train() - T - 1;
  for (int64_t s : {INT64_MAX, INT64_MAX / 3, (int64_t{1} << 53) + 1}) {
    const std::vector<int64_t> xs = training_batch(data, options, T, 1, s).first.to_vector<int64_t>();
    for (int64_t i = 0; i < B; ++i) {
      // ((s * B + i) * T) mod range, exactly: s * B * T < 2^68 fits in 128 bits.
      using u128 = unsigned __int128;
      const auto start = static_cast<int64_t>(((u128(s) * u128(B) + u128(i)) * u128(T)) % u128(range));
      for (int64_t t = 0; t < T; ++t) EXPECT_EQ(xs[i * T + t], data.tokens[start + t]) << "step " << s;
    }
  }
  EXPECT_ERROR_MENTIONS(training_batch(data, options, T, 1, -1), "step -1");
}

namespace {

// Loads each corrupt checkpoint into one trainer and checks that every load is an Error mentioning its parts
// and that the trainer is left as it was (weights, optimizer state and step).
void expect_rejected_changing_nothing(Trainer& trainer,
                                      const std::vector<std::pair<StateDict, std::vector<std::string>>>& cases) {
  const StateDict before = trainer.checkpoint();
  for (const auto& [state, parts] : cases) {
    try {
      trainer.load_checkpoint(state);
      ADD_FAILURE() << "loaded a checkpoint that should fail with " << parts.front();
    } catch (const Error& e) {
      const std::string message = e.what();
      for (const std::string& part : parts)
        EXPECT_NE(message.find(part), std::string::npos) << message << "\nlacks: " << part;
    }
  }
  const StateDict after = trainer.checkpoint();
  for (const auto& [name, t] : before.tensors) EXPECT_TRUE(mixtape::testing::bit_equal(t, after.tensors.at(name))) << name;
  EXPECT_EQ(before.metadata, after.metadata);
}

}  // namespace

TEST(TrainGPT, ACheckpointWithNonFiniteOrImpossibleValuesIsRejectedAndChangesNothing) {
  const TokenData data = char_tokens(sample_text());
  const GPTConfig config = tiny_config(data.vocab_size, 0);
  const TrainOptions options = tiny_options("adamw");
  Trainer a(config, options, data);
  a.train_step();
  const StateDict good = a.checkpoint();
  auto changed = [&](const std::function<void(StateDict&)>& change) {
    StateDict state = good;
    for (auto& [name, t] : state.tensors) t = t.clone();  // a copy of a StateDict shares its tensors
    change(state);
    return state;
  };
  const std::string sq = "optimizer.state.0.exp_avg_sq";
  ASSERT_TRUE(good.tensors.count(sq));
  Trainer b(config, options, data);
  expect_rejected_changing_nothing(
      b, {{changed([](StateDict& s) { s.tensors.at("transformer.wte.weight").fill_(NAN); }),
           {"tensor 'transformer.wte.weight'", "must be finite", "element 0 is nan"}},
          // An f64 value beyond f32's range is inf once converted to the model's dtype.
          {changed([](StateDict& s) {
             Tensor& w = s.tensors.at("transformer.wpe.weight");
             w = Tensor::full(w.shape(), 1e300, DType::F64);
           }),
           {"tensor 'transformer.wpe.weight' (f64[8,16]) must be finite in the model's f32", "element 0 is inf"}},
          {changed([&](StateDict& s) { s.tensors.at(sq).fill_(-1.0); }),
           {"tensor '" + sq + "'", "must be finite and >= 0", "element 0 is -1"}},
          {changed([](StateDict& s) { s.tensors.at("optimizer.state.1.exp_avg").fill_(INFINITY); }),
           {"tensor 'optimizer.state.1.exp_avg'", "must be finite", "inf"}},
          {changed([](StateDict& s) { s.metadata.at("optimizer.state.0.step") = "9223372036854775807"; }),
           {"'optimizer.state.0.step' is 9223372036854775807", "[1, step 1]"}},
          // The optimizer steps once per training step at most; skipped steps are steps too.
          {changed([](StateDict& s) { s.metadata.at("optimizer.state.0.step") = std::to_string(2); }),
           {"'optimizer.state.0.step' is 2", "[1, step 1]"}},
          {changed([](StateDict& s) { s.metadata.at("optimizer.amp.skipped_steps") = std::to_string(99); }),
           {"'optimizer.amp.skipped_steps' is 99", "[0, step 1]"}},
          {changed([](StateDict& s) { s.metadata.at("step") = "9223372036854775807"; }),
           {"step 9223372036854775807", "[0, 2^53]"}},
          {changed([](StateDict& s) { s.metadata.at("data.position") = std::to_string(7); }),
           {"data.position 7 differs from step 1"}},
          {changed([](StateDict& s) { s.metadata.erase("data.position"); }),
           {"metadata entry 'data.position' is missing"}}});
  EXPECT_EQ(b.step(), 0);
  b.load_checkpoint(good);  // and the good one loads
  EXPECT_EQ(b.step(), 1);

  // fp16 model with fp32 masters: a master must be finite, and a weight finite in fp16 (70000 is not).
  TrainOptions fp16 = options;
  fp16.amp = AmpConfig::parse("fp16_naive");
  Trainer c(config, fp16, data);
  c.train_step();
  const StateDict good16 = c.checkpoint();
  ASSERT_TRUE(good16.tensors.count("optimizer.master.0"));
  StateDict nan_master = good16, big = good16;
  nan_master.tensors.at("optimizer.master.0") = Tensor::full(good16.tensors.at("optimizer.master.0").shape(), NAN);
  big.tensors.at("transformer.wte.weight") = Tensor::full(good16.tensors.at("transformer.wte.weight").shape(), 7e4);
  Trainer d(config, fp16, data);
  expect_rejected_changing_nothing(
      d, {{nan_master, {"tensor 'optimizer.master.0'", "must be finite", "nan"}},
          {big, {"tensor 'transformer.wte.weight' (f32[", "must be finite in the model's f16", "element 0 is inf"}}});
  EXPECT_ERROR_MENTIONS(d.load_weights(big), "load_weights: tensor 'transformer.wte.weight'", "f16");
}

TEST(TrainGPT, MissingOrMalformedMetadataIsAnErrorNamingTheEntry) {
  const TokenData data = char_tokens(sample_text());
  const GPTConfig config = tiny_config(data.vocab_size, 0);
  const TrainOptions options = tiny_options("adamw");
  Trainer a(config, options, data);
  a.train_step();
  const StateDict good = a.checkpoint();
  Trainer b(config, options, data);
  // Each entry is looked up before the message is built: a missing one is an Error naming it, never
  // std::out_of_range.
  for (const char* key : {"n_layer", "norm_eps", "train.lr", "train.sequential", "train.amp_config"}) {
    StateDict state = good;
    state.metadata.erase(key);
    EXPECT_ERROR_MENTIONS(b.load_checkpoint(state), std::string("metadata entry '") + key + "' is missing");
  }
  StateDict state = good;
  state.metadata.at("vocab") = "{}";
  EXPECT_ERROR_MENTIONS(b.load_checkpoint(state), "training checkpoint: metadata entry 'vocab': json");
  state = good;
  state.metadata.at("train.amp_config") = R"({"mixed_precision":"fp32",})";
  EXPECT_ERROR_MENTIONS(b.load_checkpoint(state), "training checkpoint: metadata entry 'train.amp_config': json");
  EXPECT_ERROR_MENTIONS(TrainOptions::from_metadata(state.metadata),
                        "training checkpoint: metadata entry 'train.amp_config': json");
  EXPECT_EQ(b.step(), 0);
}

TEST(TrainGPT, ADirectoryOrADeviceIsNotATokenFile) {
  const std::string directory = std::filesystem::temp_directory_path().string();
  EXPECT_ERROR_MENTIONS(load_token_file(directory), "'" + directory + "'", "is a directory");
  // /dev/zero never ends: it was read until memory ran out. /dev/null read as an empty data set.
  EXPECT_ERROR_MENTIONS(load_token_file("/dev/zero"), "train_gpt: data file '/dev/zero' is a device",
                        "expected a regular file (or a pipe)");
  EXPECT_ERROR_MENTIONS(load_token_file("/dev/null"), "'/dev/null' is a device");
  EXPECT_ERROR_MENTIONS(load_token_file("/no/such/file"), "'/no/such/file' cannot be opened");
}

// ---- what a checkpoint says is read as values and checked with the command line's rules ----

TEST(TrainGPT, AVocabularyIsANonEmptyAscendingSetOfBytesOfTheModelsSize) {
  EXPECT_EQ(vocab_from_metadata("[10, 32, 97]"), (std::vector<uint8_t>{10, 32, 97}));
  EXPECT_ERROR_MENTIONS(vocab_from_metadata("[]"), "the list is empty");
  EXPECT_ERROR_MENTIONS(vocab_from_metadata("[97, 97, 98]"), "entry 1 is 97, the same byte as entry 0");
  EXPECT_ERROR_MENTIONS(vocab_from_metadata("[98, 97]"), "entry 1 is 97, below entry 0 (98)", "ascending");
  const std::map<std::string, std::string> metadata = {{"vocab", "[10, 32, 97]"}};
  EXPECT_EQ(metadata_vocab(metadata, "f", 3).size(), 3u);
  EXPECT_ERROR_MENTIONS(metadata_vocab(metadata, "f", 4), "f: metadata entry 'vocab' lists 3 characters",
                        "vocab_size is 4");
  EXPECT_TRUE(metadata_vocab({}, "f", 4).empty());  // a token model has none
}

TEST(TrainGPT, ACorruptVocabularyIsRefusedWhereverAFileIsRead) {
  const TokenData data = char_tokens(sample_text());
  const GPTConfig config = tiny_config(data.vocab_size, 0);
  Trainer a(config, tiny_options("adamw"), data);
  a.train_step();
  const StateDict good = a.checkpoint();
  std::vector<uint8_t> reversed = data.vocab;
  std::reverse(reversed.begin(), reversed.end());
  const std::vector<uint8_t> same(data.vocab.size(), 'a');
  const std::string path = temp_path("corrupt_vocab");
  for (const auto& [vocab, part] :
       std::vector<std::pair<std::string, std::string>>{{"[]", "the list is empty"},
                                                        {vocab_to_metadata(same), "the same byte as entry 0"},
                                                        {vocab_to_metadata(reversed), "ascending order"}}) {
    StateDict state = good;
    state.metadata.at("vocab") = vocab;
    save_safetensors(path, state);
    EXPECT_ERROR_MENTIONS(load_model_file(path), "load_model_file: '" + path + "'", "metadata entry 'vocab'", part);
    Trainer b(config, tiny_options("adamw"), data);
    EXPECT_ERROR_MENTIONS(b.load_checkpoint(state), "training checkpoint: metadata entry 'vocab'", part);
  }
  std::filesystem::remove(path);
}

TEST(TrainGPT, AResumedOptimizerTakesOnlyTheSettingsTheOptionsMake) {
  const TokenData data = char_tokens(sample_text());
  const GPTConfig config = tiny_config(data.vocab_size, 0);
  struct Case {
    std::string optimizer, key, value, expected;
  };
  for (const Case& c : std::vector<Case>{{"adamw", "optimizer.param_groups.0.weight_decay", "1e308", "0.1"},
                                         {"adamw", "optimizer.param_groups.1.weight_decay", "0.1", "0"},
                                         {"adamw", "optimizer.beta1", "0.5", "0.9"},
                                         {"adam", "optimizer.beta2", "0.5", "0.99"},
                                         {"adamw", "optimizer.eps", "0", "1e-08"},
                                         {"adamw", "optimizer.type", "Adam", "AdamW"},
                                         {"sgd", "optimizer.momentum", "1", "0.9"},
                                         {"sgd", "optimizer.dampening", "0.5", "0"},
                                         {"sgd", "optimizer.nesterov", "true", "false"}}) {
    Trainer a(config, tiny_options(c.optimizer), data);
    a.train_step();
    StateDict state = a.checkpoint();
    ASSERT_TRUE(state.metadata.count(c.key)) << c.key;
    state.metadata[c.key] = c.value;
    Trainer b(config, tiny_options(c.optimizer), data);
    EXPECT_ERROR_MENTIONS(b.load_checkpoint(state), "metadata entry '" + c.key + "' is " + c.value,
                          "expected " + c.expected);
    EXPECT_EQ(b.step(), 0);
  }
  // The same value written otherwise is the same setting.
  Trainer a(config, tiny_options("adamw"), data);
  a.train_step();
  StateDict state = a.checkpoint();
  state.metadata.at("optimizer.beta1") = "9e-1";
  state.metadata.at("optimizer.eps") = "0.00000001";
  Trainer b(config, tiny_options("adamw"), data);
  b.load_checkpoint(state);
  EXPECT_EQ(b.step(), 1);
}

TEST(TrainGPT, WeightDecayTimesTheLearningRateIsAtMostOneOnTheCommandLineAndInACheckpoint) {
  const TokenData data = char_tokens(sample_text());
  const GPTConfig config = tiny_config(data.vocab_size, 0);
  TrainOptions o = tiny_options("adamw");
  o.weight_decay = 1e308;  // finite, and AdamW's factor 1 - lr x weight_decay is -3e305
  EXPECT_ERROR_MENTIONS(o.validate(), "--weight-decay x --lr must be at most 1", "1e+308 x 0.003");
  o.weight_decay = 1 / o.lr;  // a factor of 0 is the edge
  EXPECT_NO_THROW(o.validate());
  o.optimizer = "sgd";
  o.weight_decay = 1e308;
  EXPECT_ERROR_MENTIONS(o.validate(), "--weight-decay x --lr must be at most 1", "step of sgd");
  // Adam decays through the gradient, which its update normalises: the bound is not Adam's.
  o.optimizer = "adam";
  EXPECT_NO_THROW(o.validate());
  Trainer a(config, tiny_options("adamw"), data);
  a.train_step();
  StateDict state = a.checkpoint();
  state.metadata.at("train.weight_decay") = "1e308";
  state.metadata.at("optimizer.param_groups.0.weight_decay") = "1e308";
  Trainer b(config, tiny_options("adamw"), data);
  EXPECT_ERROR_MENTIONS(b.load_checkpoint(state), "training checkpoint", "--weight-decay x --lr must be at most 1");
  EXPECT_ERROR_MENTIONS(TrainOptions::from_metadata(state.metadata), "--weight-decay x --lr");
}

TEST(TrainGPT, CheckpointSettingsCompareAsValuesNotAsText) {
  const TokenData data = char_tokens(sample_text());
  GPTConfig config = tiny_config(data.vocab_size, 0.99);
  config.norm_eps = 1e30;
  Trainer a(config, tiny_options("adamw"), data);
  a.train_step();
  StateDict state = a.checkpoint();
  state.metadata.at("dropout") = "0.98999999999999999";
  state.metadata.at("norm_eps") = "1e30";
  state.metadata.at("bias") = "1";
  state.metadata.at("n_layer") = "02";
  state.metadata.at("train.lr") = "3e-3";
  state.metadata.at("train.batch") = "04";
  Trainer b(config, tiny_options("adamw"), data);
  b.load_checkpoint(state);
  EXPECT_EQ(b.step(), 1);
  // Another value still differs, and the message shows it as the file has it.
  state.metadata.at("dropout") = "0.5";
  Trainer c(config, tiny_options("adamw"), data);
  EXPECT_ERROR_MENTIONS(c.load_checkpoint(state), "model option 'dropout' is 0.5 in the checkpoint");
}

TEST(TrainGPT, OptimizerErrorsNameTheEntryAsTheCheckpointDoes) {
  const TokenData data = char_tokens(sample_text());
  const GPTConfig config = tiny_config(data.vocab_size, 0);
  Trainer a(config, tiny_options("adamw"), data);
  a.train_step();
  StateDict state = a.checkpoint();
  state.tensors["optimizer.s4ate.13.exp_avg"] = state.tensors.at("optimizer.state.13.exp_avg");
  state.tensors.erase("optimizer.state.13.exp_avg");
  Trainer b(config, tiny_options("adamw"), data);
  EXPECT_ERROR_MENTIONS(b.load_checkpoint(state), "unexpected tensor entry 'optimizer.s4ate.13.exp_avg'");
  EXPECT_EQ(optimizer_error_in_file_keys("X: entry 'state.1.step' is 0; missing tensor entry 'master.2'"),
            "X: entry 'optimizer.state.1.step' is 0; missing tensor entry 'optimizer.master.2'");
}

// A loss scale saved in a checkpoint is checked by the scaler that reads it (a usable fp32 scale); the
// trainer's error names its entry as the file holds it.
TEST(TrainGPT, ALossScaleInACheckpointIsNamedByItsEntryInTheFile) {
  const TokenData data = char_tokens(sample_text());
  const GPTConfig config = tiny_config(data.vocab_size, 0);
  TrainOptions options = tiny_options("adamw");
  options.amp = AmpConfig::parse("fp16");
  Trainer a(config, options, data);
  a.train_step();
  StateDict state = a.checkpoint();
  ASSERT_TRUE(state.metadata.count("optimizer.scaler.0.scale"));
  state.metadata["optimizer.scaler.0.scale"] = "1e-45";
  Trainer b(config, options, data);
  EXPECT_ERROR_MENTIONS(b.load_checkpoint(state), "training checkpoint: GradScaler.load_state_dict: ",
                        "entry 'optimizer.scaler.0.scale' 1e-45 is not a usable loss scale");
}

TEST(TrainGPT, ValuesFromAFileAreEchoedPrintableAndErrorsSayWhatMustHold) {
  const TokenData data = char_tokens(sample_text());
  const GPTConfig config = tiny_config(data.vocab_size, 0);
  Trainer a(config, tiny_options("adamw"), data);
  a.train_step();
  const StateDict good = a.checkpoint();
  StateDict state = good;
  state.metadata.at("train.precision") = std::string("fp\n3\0" "2\xc3", 7);
  Trainer b(config, tiny_options("adamw"), data);
  EXPECT_ERROR_MENTIONS(b.load_checkpoint(state), "option 'precision' is fp\\n3\\02\\xc3 in the checkpoint");
  state = good;
  for (auto& [name, t] : state.tensors) t = t.clone();
  Tensor& sq = state.tensors.at("optimizer.state.0.exp_avg_sq");
  sq.fill_(-1.0);
  EXPECT_ERROR_MENTIONS(b.load_checkpoint(state), "must be finite and >= 0, but element 0 is -1");
  // generate's reader names the file in a config error, with the value made printable.
  StateDict weights = model_part(good);
  weights.metadata.at("n_layer") = std::string("a\nb\0c", 5);
  const std::string path = temp_path("bad_config");
  save_safetensors(path, weights);
  EXPECT_ERROR_MENTIONS(load_model_file(path), "load_model_file: '" + path + "'", "'n_layer' = 'a\\nb\\0c'");
  std::filesystem::remove(path);
}

TEST(TrainGPT, OptimizerStateEntriesNameAParameterAndABufferTheOptimizerKeeps) {
  const TokenData data = char_tokens(sample_text());
  const GPTConfig config = tiny_config(data.vocab_size, 0);
  Trainer a(config, tiny_options("adamw"), data);
  a.train_step();
  const StateDict good = a.checkpoint();
  const Tensor moment = good.tensors.at("optimizer.state.0.exp_avg");
  auto with_tensor = [&](const std::string& name) {
    StateDict state = good;
    state.tensors[name] = moment;
    return state;
  };
  Trainer b(config, tiny_options("adamw"), data);
  EXPECT_ERROR_MENTIONS(b.load_checkpoint(with_tensor("optimizer.state.0.momentum_buffer")),
                        "tensor 'optimizer.state.0.momentum_buffer'", "keeps the state tensors exp_avg, exp_avg_sq",
                        "not 'momentum_buffer'");
  EXPECT_ERROR_MENTIONS(b.load_checkpoint(with_tensor("optimizer.state.999.exp_avg")),
                        "tensor 'optimizer.state.999.exp_avg' names no parameter",
                        "i < " + std::to_string(a.model().parameters().size()));
  EXPECT_ERROR_MENTIONS(b.load_checkpoint(with_tensor("optimizer.state.00.exp_avg")),
                        "'optimizer.state.00.exp_avg' names no parameter");
  StateDict state = good;
  state.metadata["optimizer.state.0.count"] = "1";
  EXPECT_ERROR_MENTIONS(b.load_checkpoint(state), "metadata entry 'optimizer.state.0.count'",
                        "a step count (.step)");
  EXPECT_EQ(b.step(), 0);
  // SGD without momentum keeps no state at all: its checkpoint loads.
  TrainOptions plain = tiny_options("sgd");
  plain.momentum = 0;
  Trainer c(config, plain, data);
  c.train_step();
  Trainer d(config, plain, data);
  d.load_checkpoint(c.checkpoint());
  EXPECT_EQ(d.step(), 1);
}
