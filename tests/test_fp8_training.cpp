// The fp8 and block-scaled modes in training: every mode trains, resumes bit for bit (delayed scaling's history
// and NVFP4's random stream included), leaves the excluded modules in bf16, and its checkpoints load anywhere.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <unistd.h>
#include <vector>

#include "amp/booster.h"
#include "amp/config.h"
#include "io/safetensors.h"
#include "nn/gpt.h"
#include "optim/adam.h"
#include "train/training.h"
#include "test_util.h"

using namespace mixtape;

namespace {

const std::vector<std::string> kFp8Modes = {"fp8", "fp8_delayed", "fp8_rowwise", "fp8_block", "mxfp8", "nvfp4"};

GPTConfig tiny_config(int64_t vocab, bool tied = true) {
  GPTConfig c;
  c.n_layer = 1;
  c.n_head = 2;
  c.n_embd = 32;
  c.block_size = 16;
  c.vocab_size = vocab;
  c.dropout = 0;
  c.tie_embeddings = tied;
  return c;
}

TrainOptions options_for(const AmpConfig& amp, int64_t steps) {
  TrainOptions o;
  o.batch = 4;
  o.steps = steps;
  o.lr = 3e-3;
  o.min_lr = 3e-4;
  o.warmup = 4;
  o.optimizer = "adamw";
  o.seed = 7;
  o.amp = amp;
  return o;
}

// A small block size so that the blocks of fp8_block are several per tensor at this width.
AmpConfig mode_config(const std::string& mode) {
  return mode == "fp8_block" ? AmpConfig::from_json(R"({"block_size": 16})", mode) : AmpConfig::parse(mode);
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / (name + "." + std::to_string(getpid()) + ".safetensors")).string();
}

TEST(Fp8Training, EveryModeLowersTheLossWithoutSkippingAStep) {
  const TokenData data = char_tokens(mixtape::testing::word_text(3000));
  for (const std::string& mode : kFp8Modes) {
    Trainer trainer(tiny_config(data.vocab_size), options_for(mode_config(mode), 40), data);
    double first = 0, last = 0;
    for (int i = 0; i < 40; ++i) {
      const StepStats s = trainer.train_step();
      ASSERT_TRUE(std::isfinite(s.loss)) << mode << " step " << i;
      EXPECT_FALSE(s.skipped) << mode << " step " << i;
      (i == 0 ? first : last) = s.loss;
    }
    EXPECT_LT(last, first - 0.5) << mode;
    // Every Linear's GEMMs were quantized: activations, weights and gradients all counted.
    const auto& counts = trainer.booster().low_precision()->counts();
    for (const QuantizationCounts& c : counts) EXPECT_GT(c.values, 0) << mode;
  }
}

// accumulator_bits acts in training: 8 bits give other losses than fp32 sums, and still train.
TEST(Fp8Training, ANarrowAccumulatorChangesTheRunAndStillTrains) {
  const TokenData data = char_tokens(mixtape::testing::word_text(3000));
  auto losses = [&](const std::string& json) {
    Trainer trainer(tiny_config(data.vocab_size), options_for(AmpConfig::from_json(json, "fp8_block"), 20), data);
    std::vector<double> out;
    for (int i = 0; i < 20; ++i) out.push_back(trainer.train_step().loss);
    return out;
  };
  const std::vector<double> fp32 = losses(R"({"block_size": 16})"), narrow = losses(R"({"block_size": 16, "accumulator_bits": 8})");
  EXPECT_NE(fp32, narrow);
  EXPECT_LT(narrow.back(), narrow.front() - 0.3);
}

TEST(Fp8Training, AResumedRunEqualsTheUninterruptedOneInEveryMode) {
  const TokenData data = char_tokens(mixtape::testing::word_text(3000));
  for (const std::string& mode : kFp8Modes) {
    SCOPED_TRACE(mode);
    const TrainOptions options = options_for(mode_config(mode), 8);
    const GPTConfig config = tiny_config(data.vocab_size);
    Trainer whole(config, options, data);
    std::vector<double> expected;
    for (int i = 0; i < 8; ++i) expected.push_back(whole.train_step().loss);

    const std::string path = temp_path("fp8_resume_" + mode);
    std::vector<double> got;
    {
      Trainer first(config, options, data);
      for (int i = 0; i < 4; ++i) got.push_back(first.train_step().loss);
      first.save_checkpoint(path);
    }
    Trainer resumed(config, options, data);
    resumed.load_checkpoint(load_safetensors(path));
    std::filesystem::remove(path);
    for (int i = 0; i < 4; ++i) got.push_back(resumed.train_step().loss);
    for (size_t i = 0; i < expected.size(); ++i) EXPECT_EQ(std::memcmp(&got[i], &expected[i], sizeof(double)), 0) << i;
    const auto a = whole.model().named_parameters(), b = resumed.model().named_parameters();
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(mixtape::testing::bit_equal(a[i].second, b[i].second)) << a[i].first;
    const auto sa = whole.booster().low_precision()->scaling_state(), sb = resumed.booster().low_precision()->scaling_state();
    for (const auto& [name, s] : sa) {
      EXPECT_EQ(s.scale, sb.at(name).scale) << name;
      EXPECT_EQ(s.history, sb.at(name).history) << name;
    }
    EXPECT_EQ(whole.booster().low_precision()->steps(), resumed.booster().low_precision()->steps());
  }
}

TEST(Fp8Training, DelayedScalingStateIsInTheCheckpointAndCheckedOnLoad) {
  const TokenData data = char_tokens(mixtape::testing::word_text(1000));
  const TrainOptions options = options_for(AmpConfig::from_json(R"({"amax_history_len": 16})", "fp8_delayed"), 4);
  Trainer trainer(tiny_config(data.vocab_size), options, data);
  for (int i = 0; i < 3; ++i) trainer.train_step();
  StateDict state = trainer.checkpoint();
  const std::string key = "amp_scaling.transformer.h.0.attn.c_attn.weight.activation";
  ASSERT_TRUE(state.tensors.count(key + ".amax_history"));
  EXPECT_EQ(state.tensors.at(key + ".amax_history").shape(), (Shape{16}));
  // After 3 steps the scale is 448 / (the largest amax of the history), which the file holds.
  const std::vector<float> history = state.tensors.at(key + ".amax_history").to_vector<float>();
  EXPECT_EQ(history[0], 0.0f);  // the next step's slot
  float amax = 0;
  for (float a : history) amax = std::max(amax, a);
  EXPECT_EQ(state.tensors.at(key + ".scale").item(), 448.0f / amax);

  // A history of another length is refused, and the trainer keeps its own state.
  const auto before = trainer.booster().low_precision()->scaling_state();
  const Tensor weight_before = trainer.model().named_parameters()[2].second.clone();
  StateDict bad = state;
  bad.tensors[key + ".amax_history"] = Tensor::zeros({8});
  EXPECT_ERROR_MENTIONS(trainer.load_checkpoint(bad), "amax history of 8", "amax_history_len is 16");
  EXPECT_EQ(trainer.booster().low_precision()->scaling_state().at("transformer.h.0.attn.c_attn.weight.activation").history,
            before.at("transformer.h.0.attn.c_attn.weight.activation").history);
  EXPECT_TRUE(mixtape::testing::bit_equal(trainer.model().named_parameters()[2].second, weight_before));
  bad = state;
  bad.tensors.erase(key + ".scale");
  EXPECT_ERROR_MENTIONS(trainer.load_checkpoint(bad), key + ".scale");
}

TEST(Fp8Training, AnFp8CheckpointsWeightsLoadInAnyMode) {
  const TokenData data = char_tokens(mixtape::testing::word_text(1000));
  Trainer fp8(tiny_config(data.vocab_size), options_for(AmpConfig::parse("fp8_delayed"), 3), data);
  for (int i = 0; i < 3; ++i) fp8.train_step();
  const StateDict state = fp8.checkpoint();
  for (const auto& [name, t] : model_part(state).tensors) EXPECT_EQ(t.dtype(), DType::F32) << name;
  for (const std::string mode : {"bf16", "fp32", "nvfp4"}) {
    Trainer other(tiny_config(data.vocab_size), options_for(AmpConfig::parse(mode), 3), data);
    other.load_weights(state);
    const auto a = fp8.model().named_parameters(), b = other.model().named_parameters();
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(mixtape::testing::bit_equal(a[i].second, b[i].second)) << mode << " " << a[i].first;
  }
}

TEST(Fp8Training, TheVocabularyHeadStaysInBf16UnlessExcludeSaysOtherwise) {
  auto covered = [](const std::string& json) {
    GPT model(tiny_config(11, /*tied=*/false), 1);
    Booster booster(AmpConfig::from_json(json, "fp8"));
    booster.boost(model, std::make_unique<AdamW>(std::vector<ParamGroup>{{model.parameters(), 1e-3, 0.0}},
                                                  AdamOptions{}));
    std::vector<std::string> names;
    for (const auto& [name, scaling] : booster.low_precision()->scaling_state())
      if (name.ends_with(".weight.weight")) names.push_back(name.substr(0, name.size() - 7));
    return names;
  };
  const std::vector<std::string> by_default = covered("{}");
  EXPECT_EQ(by_default, (std::vector<std::string>{"transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.weight",
                                                  "transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight"}));
  // exclude by a last name ("c_proj" is every c_proj), an empty list quantizes the head too.
  EXPECT_EQ(covered(R"({"exclude": ["c_proj", "lm_head"]})"),
            (std::vector<std::string>{"transformer.h.0.attn.c_attn.weight", "transformer.h.0.mlp.c_fc.weight"}));
  EXPECT_EQ(covered(R"({"exclude": []})").size(), 5u);
  EXPECT_ERROR_MENTIONS(covered(R"({"exclude": ["lm_haed"]})"), "lm_haed", "names no Linear module");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"exclude": "lm_head"})", "fp8"), "exclude", "list");
}

TEST(Fp8Training, OptionsAreValidatedAndRoundTrip) {
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"fp8_format": "e5m2"})", "fp8"), "fp8_format", "hybrid", "e4m3");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"fp8_format": "hybrid"})", "nvfp4"), "fp8_format", "E2M1");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"amax_history_len": 0})", "fp8_delayed"), "amax_history_len", "0");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"margin": -1})", "fp8_delayed"), "margin");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"mx_scale_rounding": "up"})", "mxfp8"), "mx_scale_rounding",
                        "floor", "ceil");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"block_size": 0})", "fp8_block"), "block_size");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"accumulator_bits": 24})", "fp8"), "accumulator_bits", "0..23");
  EXPECT_EQ(AmpConfig::from_json(R"({"accumulator_bits": 14})", "fp8_block").low_precision_recipe().accumulator_bits, 14);
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"init_scale": 2})", "fp8"), "unknown option", "init_scale");
  // The defaults each mode's source has: hybrid for the tensorwise recipes, E4M3 elsewhere.
  EXPECT_EQ(AmpConfig::parse("fp8").fp8_format(), Fp8Format::Hybrid);
  EXPECT_EQ(AmpConfig::parse("fp8_delayed").fp8_format(), Fp8Format::Hybrid);
  for (const std::string mode : {"fp8_rowwise", "fp8_block", "mxfp8"})
    EXPECT_EQ(AmpConfig::parse(mode).fp8_format(), Fp8Format::E4M3) << mode;
  EXPECT_EQ(AmpConfig::parse("fp8").low_precision_recipe().gradient_format, DType::F8E5M2);
  // torchao's rowwise recipe rounds its scales to powers of two; its tensorwise default does not.
  EXPECT_TRUE(AmpConfig::parse("fp8_rowwise").low_precision_recipe().round_scales_to_power_of_2);
  EXPECT_FALSE(AmpConfig::parse("fp8").low_precision_recipe().round_scales_to_power_of_2);
  EXPECT_TRUE(AmpConfig::from_json(R"({"round_scales_to_power_of_2": true})", "fp8").low_precision_recipe()
                  .round_scales_to_power_of_2);
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"round_scales_to_power_of_2": true})", "mxfp8"),
                        "round_scales_to_power_of_2");
  EXPECT_EQ(AmpConfig::parse("nvfp4").low_precision_recipe().gradient_format, DType::F4E2M1);
  for (const std::string& mode : kFp8Modes) {
    const AmpConfig c = AmpConfig::from_json(R"({"margin": 2, "exclude": ["c_fc"]})", mode);
    EXPECT_EQ(AmpConfig::from_json(c.to_json()).to_json(), c.to_json()) << mode;
    EXPECT_EQ(c.training_differences(AmpConfig::parse(mode)),
              "margin 2 (the other's 0), exclude [\"c_fc\"] (the other's null)") << mode;
  }
}

}  // namespace
