// Each precision mode behaves by default as the framework it is named after, and mixtape's own choices are
// named options (amp/config.h):
//   keep_norms_fp32      Apex O2 / O3: LayerNorm / RMSNorm in fp32 (Apex's keep_batchnorm_fp32 keeps BatchNorm
//                        only, so by default the norms are cast with the model)
//   lr_schedule_on_skip  every mode: "advance" (the schedule follows the iteration) or "hold" (it follows the
//                        applied updates); "hold" by default in the naive modes, "advance" elsewhere
//   loss_scaler          the naive modes: "dynamic" (default) or "none" (a loss scale of 1; bf16_naive only)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <unistd.h>
#include <vector>

#include "amp/booster.h"
#include "amp/config.h"
#include "io/json.h"
#include "io/safetensors.h"
#include "nn/gpt.h"
#include "optim/adam.h"
#include "train/training.h"
#include "test_util.h"

using namespace mixtape;

namespace {

// A small deterministic text with some structure (so the loss can fall).
std::string sample_text() { return mixtape::testing::word_text(1500); }

GPTConfig tiny_config(int64_t vocab) {
  GPTConfig c;
  c.n_layer = 1;
  c.n_head = 2;
  c.n_embd = 16;
  c.block_size = 8;
  c.vocab_size = vocab;
  c.dropout = 0;
  return c;
}

// A warm-up and cosine schedule, so that every schedule position has its own learning rate.
TrainOptions options_for(const AmpConfig& amp, int64_t steps) {
  TrainOptions o;
  o.batch = 2;
  o.steps = steps;
  o.lr = 3e-3;
  o.min_lr = 3e-4;
  o.warmup = 4;
  o.optimizer = "adamw";
  o.seed = 7;
  o.amp = amp;
  return o;
}

std::vector<StepStats> run_steps(Trainer& trainer, int64_t n) {
  std::vector<StepStats> stats;
  for (int64_t i = 0; i < n; ++i) stats.push_back(trainer.train_step());
  return stats;
}

std::map<std::string, DType> norm_and_other_dtypes(const Module& model) {
  std::map<std::string, DType> out;
  for (const auto& [name, p] : model.named_parameters()) out[name] = p.dtype();
  return out;
}

bool is_norm(const std::string& name) { return name.find(".ln_") != std::string::npos; }

// The GPT's parameter dtypes after boosting it in `mode` with the JSON options `json`.
std::map<std::string, DType> boosted_dtypes(const std::string& mode, const std::string& json) {
  GPT model(tiny_config(11), 1);
  Booster booster(AmpConfig::from_json(json, mode));
  booster.boost(model, std::make_unique<AdamW>(std::vector<ParamGroup>{{model.parameters(), 1e-3, 0.0}},
                                                AdamOptions{}));
  return norm_and_other_dtypes(model);
}

std::string option_of(const AmpConfig& config, const std::string& key) {
  const Json written = json::parse(config.to_json());
  const Json* value = json::find(written, key);
  return value ? json::dump(*value) : "(absent)";
}

}  // namespace

// ---- Apex O2 / O3: keep_batchnorm_fp32 keeps BatchNorm only; keep_norms_fp32 keeps the norm layers ----

TEST(AmpFidelity, ApexO2CastsLayerNormWithTheModelAsApexConvertNetworkDoes) {
  for (const auto& [name, dtype] : boosted_dtypes("fp16_apex:O2", "{}")) EXPECT_EQ(dtype, DType::F16) << name;
  // keep_batchnorm_fp32 true, given explicitly, keeps no LayerNorm either.
  for (const auto& [name, dtype] : boosted_dtypes("fp16_apex:O2", R"({"keep_batchnorm_fp32": true})"))
    EXPECT_EQ(dtype, DType::F16) << name;
}

TEST(AmpFidelity, KeepNormsFp32KeepsTheNormLayersFp32InACastModel) {
  for (const std::string mode : {"fp16_apex:O2", "fp16_apex:O3"}) {
    size_t norms = 0;
    for (const auto& [name, dtype] : boosted_dtypes(mode, R"({"keep_norms_fp32": true})")) {
      EXPECT_EQ(dtype, is_norm(name) ? DType::F32 : DType::F16) << mode << " " << name;
      norms += is_norm(name);
    }
    EXPECT_GT(norms, 0u);
  }
  // On a model left fp32 it keeps nothing and changes nothing, as master_weights there.
  for (const auto& [name, dtype] : boosted_dtypes("fp16_apex:O0", R"({"keep_norms_fp32": true})"))
    EXPECT_EQ(dtype, DType::F32) << name;
}

TEST(AmpFidelity, AnO2ModelWithFp16LayerNormTrains) {
  const TokenData data = char_tokens(sample_text());
  Trainer trainer(tiny_config(data.vocab_size), options_for(AmpConfig::parse("fp16_apex:O2"), 6), data);
  const Tensor ln_before = trainer.model().named_parameters()[2].second.clone();
  const std::string ln_name = trainer.model().named_parameters()[2].first;
  ASSERT_TRUE(is_norm(ln_name)) << ln_name;
  int applied = 0;
  for (const StepStats& s : run_steps(trainer, 6)) {
    EXPECT_TRUE(std::isfinite(s.loss)) << s.step;
    applied += !s.skipped;
  }
  EXPECT_GT(applied, 0);
  const Tensor ln_after = trainer.model().named_parameters()[2].second;
  EXPECT_EQ(ln_after.dtype(), DType::F16);
  EXPECT_FALSE(mixtape::testing::bit_equal(ln_before, ln_after)) << ln_name << " did not move";
}

// ---- lr_schedule_on_skip ----

// fp16_naive starts at a loss scale of 2^32, so its first steps overflow and are skipped while the scale
// walks down (17 steps with this model). With "hold" the step after k skipped ones uses the schedule's learning rate of position
// (step - k): the first applied update gets the step-0 learning rate.
TEST(AmpFidelity, HoldGivesTheFirstAppliedUpdateTheScheduleStepZeroLearningRate) {
  const TokenData data = char_tokens(sample_text());
  const TrainOptions options =
      options_for(AmpConfig::from_json(R"({"lr_schedule_on_skip": "hold"})", "fp16_naive"), 21);
  const std::unique_ptr<LRSchedule> schedule = make_schedule(options);
  Trainer trainer(tiny_config(data.vocab_size), options, data);
  const std::vector<StepStats> stats = run_steps(trainer, 21);
  int64_t skipped = 0;
  int64_t first_applied = -1;
  for (const StepStats& s : stats) {
    EXPECT_EQ(s.lr, schedule->lr_at(s.step - skipped)) << "step " << s.step << " after " << skipped << " skipped";
    if (!s.skipped && first_applied < 0) first_applied = s.step;
    skipped += s.skipped;
  }
  ASSERT_GT(first_applied, 0) << "fp16_naive should skip its first steps";
  EXPECT_EQ(stats[static_cast<size_t>(first_applied)].lr, schedule->lr_at(0));
  const auto applied = std::count_if(stats.begin(), stats.end(), [](const StepStats& s) { return !s.skipped; });
  EXPECT_GE(applied, 2) << "the test needs applied updates after the first";
}

TEST(AmpFidelity, AdvanceFollowsTheIterationWhateverIsSkipped) {
  const TokenData data = char_tokens(sample_text());
  for (const std::string mode : {"fp16_naive", "fp16"}) {
    const int64_t steps = mode == "fp16_naive" ? 20 : 6;  // past fp16_naive's skipped steps
    const TrainOptions options =
        options_for(AmpConfig::from_json(R"({"lr_schedule_on_skip": "advance"})", mode), steps);
    const std::unique_ptr<LRSchedule> schedule = make_schedule(options);
    Trainer trainer(tiny_config(data.vocab_size), options, data);
    int64_t skipped = 0;
    for (const StepStats& s : run_steps(trainer, steps)) {
      EXPECT_EQ(s.lr, schedule->lr_at(s.step)) << mode << " step " << s.step;
      skipped += s.skipped;
    }
    if (mode == "fp16_naive") {
      EXPECT_GT(skipped, 0);
    }
  }
}

TEST(AmpFidelity, EachFamilyHasItsFrameworksScheduleOnSkipByDefault) {
  const std::map<std::string, std::string> expected = {
      {"fp32", "\"advance\""},         {"tf32", "\"advance\""},       {"fp16", "\"advance\""},
      {"bf16", "\"advance\""},         {"fp16_apex:O1", "\"advance\""}, {"fp16_apex:O2", "\"advance\""},
      {"fp16_naive", "\"hold\""},      {"bf16_naive", "\"hold\""}};
  for (const auto& [mode, value] : expected)
    EXPECT_EQ(option_of(AmpConfig::parse(mode), "lr_schedule_on_skip"), value) << mode;
  // fp16_naive's default trains as "hold": the same learning rates, step by step.
  const TokenData data = char_tokens(sample_text());
  Trainer by_default(tiny_config(data.vocab_size), options_for(AmpConfig::parse("fp16_naive"), 20), data);
  Trainer hold(tiny_config(data.vocab_size),
               options_for(AmpConfig::from_json(R"({"lr_schedule_on_skip": "hold"})", "fp16_naive"), 20), data);
  const std::vector<StepStats> a = run_steps(by_default, 20), b = run_steps(hold, 20);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].lr, b[i].lr) << i;
  EXPECT_NE(a.back().lr, make_schedule(by_default.options())->lr_at(19));
}

// A hold run saved while its scale still walks down and resumed equals the uninterrupted run: the schedule's
// position comes back from the step and the optimizer's amp.skipped_steps.
TEST(AmpFidelity, AResumedHoldRunEqualsTheUninterruptedOne) {
  const TokenData data = char_tokens(sample_text());
  const TrainOptions options =
      options_for(AmpConfig::from_json(R"({"lr_schedule_on_skip": "hold"})", "fp16_naive"), 20);
  const GPTConfig config = tiny_config(data.vocab_size);
  Trainer whole(config, options, data);
  const std::vector<StepStats> expected = run_steps(whole, 20);

  const std::string path = (std::filesystem::temp_directory_path() /
                            ("amp_fidelity_hold." + std::to_string(getpid()) + ".safetensors")).string();
  std::vector<StepStats> got;
  {
    Trainer first(config, options, data);
    got = run_steps(first, 10);
    first.save_checkpoint(path);
  }
  Trainer resumed(config, options, data);
  resumed.load_checkpoint(load_safetensors(path));
  std::filesystem::remove(path);
  for (const StepStats& s : run_steps(resumed, 10)) got.push_back(s);

  int64_t skipped_before_save = 0;
  for (size_t i = 0; i < 10; ++i) skipped_before_save += expected[i].skipped;
  ASSERT_GT(skipped_before_save, 0) << "the checkpoint should hold skipped steps";
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(std::memcmp(&got[i].loss, &expected[i].loss, sizeof(double)), 0) << i;
    EXPECT_EQ(got[i].lr, expected[i].lr) << i;
    EXPECT_EQ(got[i].skipped, expected[i].skipped) << i;
    EXPECT_EQ(got[i].loss_scale, expected[i].loss_scale) << i;
  }
  const auto a = whole.model().named_parameters(), b = resumed.model().named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(mixtape::testing::bit_equal(a[i].second, b[i].second)) << a[i].first;
}

// ---- the naive modes' loss_scaler ----

TEST(AmpFidelity, Bf16NaiveWithoutALossScalerNeverSkipsAndLogsScaleOne) {
  const TokenData data = char_tokens(sample_text());
  Trainer none(tiny_config(data.vocab_size),
               options_for(AmpConfig::from_json(R"({"loss_scaler": "none"})", "bf16_naive"), 6), data);
  for (const StepStats& s : run_steps(none, 6)) {
    EXPECT_FALSE(s.skipped) << s.step;
    EXPECT_EQ(s.loss_scale, 1.0) << s.step;
    EXPECT_TRUE(std::isfinite(s.loss)) << s.step;
  }
  // The default keeps InternEvo's dynamic scaler, which starts at 2^32.
  Trainer dynamic(tiny_config(data.vocab_size), options_for(AmpConfig::parse("bf16_naive"), 6), data);
  EXPECT_EQ(dynamic.train_step().loss_scale, 4294967296.0);
  EXPECT_EQ(option_of(AmpConfig::parse("bf16_naive"), "loss_scaler"), "\"dynamic\"");
  EXPECT_EQ(option_of(AmpConfig::parse("fp16_naive"), "loss_scaler"), "\"dynamic\"");
}

// ---- the options' text forms, what a resumed run may not change, and bad values ----

TEST(AmpFidelity, TheOptionsRoundTripAndAreTrainingDifferences) {
  struct Case {
    std::string mode, json, key, value, other_value;
  };
  for (const Case& c : std::vector<Case>{
           {"fp16_apex:O2", R"({"keep_norms_fp32": true})", "keep_norms_fp32", "true", "false"},
           {"fp16_apex:O3", R"({"keep_norms_fp32": true})", "keep_norms_fp32", "true", "false"},
           {"bf16_naive", R"({"loss_scaler": "none"})", "loss_scaler", "\"none\"", "\"dynamic\""},
           {"fp16_naive", R"({"lr_schedule_on_skip": "advance"})", "lr_schedule_on_skip", "\"advance\"",
            "\"hold\""},
           {"fp32", R"({"lr_schedule_on_skip": "hold"})", "lr_schedule_on_skip", "\"hold\"", "\"advance\""},
           {"tf32", R"({"lr_schedule_on_skip": "hold"})", "lr_schedule_on_skip", "\"hold\"", "\"advance\""},
           {"bf16", R"({"lr_schedule_on_skip": "hold"})", "lr_schedule_on_skip", "\"hold\"", "\"advance\""},
           {"fp16_apex:O1", R"({"lr_schedule_on_skip": "hold"})", "lr_schedule_on_skip", "\"hold\"",
            "\"advance\""}}) {
    SCOPED_TRACE(c.mode + " " + c.json);
    const AmpConfig config = AmpConfig::from_json(c.json, c.mode);
    EXPECT_EQ(option_of(config, c.key), c.value);
    const AmpConfig back = AmpConfig::from_json(config.to_json());
    EXPECT_EQ(back.to_json(), config.to_json());
    EXPECT_EQ(back.training_differences(config), "");
    const AmpConfig by_default = AmpConfig::parse(c.mode);
    EXPECT_EQ(option_of(by_default, c.key), c.other_value);
    EXPECT_EQ(config.training_differences(by_default, "the checkpoint's"),
              c.key + " " + c.value + " (the checkpoint's " + c.other_value + ")");
  }
}

TEST(AmpFidelity, AResumedRunMayNotChangeTheScheduleOnSkip) {
  const TokenData data = char_tokens(sample_text());
  const GPTConfig config = tiny_config(data.vocab_size);
  Trainer saved(config, options_for(AmpConfig::parse("fp16_naive"), 4), data);
  saved.train_step();
  const StateDict state = saved.checkpoint();
  Trainer other(config,
                options_for(AmpConfig::from_json(R"({"lr_schedule_on_skip": "advance"})", "fp16_naive"), 4), data);
  EXPECT_ERROR_MENTIONS(other.load_checkpoint(state), "lr_schedule_on_skip \"advance\"",
                        "the checkpoint's \"hold\"");
}

TEST(AmpFidelity, BadValuesAreErrorsNamingTheOption) {
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"lr_schedule_on_skip": "skip"})", "fp16"), "AmpConfig fp16",
                        "lr_schedule_on_skip must be \"advance\" or \"hold\"", "got \"skip\"");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"lr_schedule_on_skip": true})", "fp32"),
                        "lr_schedule_on_skip must be \"advance\" or \"hold\"", "got bool");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"lr_schedule_on_skip": null})", "fp16_naive"),
                        "lr_schedule_on_skip must be");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"loss_scaler": "static"})", "bf16_naive"),
                        "AmpConfig bf16_naive", "loss_scaler must be \"dynamic\" or \"none\"", "got \"static\"");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"loss_scaler": "none"})", "fp16_naive"), "AmpConfig fp16_naive",
                        "loss_scaler \"none\" is for bf16_naive only", "fp16 expects a grad scaler");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"loss_scaler": "none"})", "bf16"), "unknown option \"loss_scaler\"");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"keep_norms_fp32": true})", "fp16_apex:O1"), "O1",
                        "keep_norms_fp32 must be false");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"keep_norms_fp32": "True"})", "fp16_apex:O2"),
                        "keep_norms_fp32 must be true or false");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"keep_norms_fp32": null})", "fp16_apex:O2"),
                        "keep_norms_fp32 must be true or false");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"keep_norms_fp32": true})", "fp16_naive"),
                        "unknown option \"keep_norms_fp32\"");
}

// A checkpoint whose train.amp_config lacks the options trained with the iteration-indexed schedule and, under
// Apex O2, fp32 norm layers: it reads so, and a resume with other values is refused by name.
TEST(AmpFidelity, ACheckpointWithoutTheOptionsReadsAsTheBehaviourItTrainedWith) {
  const TokenData data = char_tokens(sample_text());
  const GPTConfig config = tiny_config(data.vocab_size);
  struct Case {
    std::string mode, removed, refused_as, resumes_with;
  };
  for (const Case& c : std::vector<Case>{
           {"fp16_naive", "lr_schedule_on_skip", "lr_schedule_on_skip \"hold\" (the checkpoint's \"advance\")",
            R"({"lr_schedule_on_skip": "advance"})"},
           {"fp16_apex:O2", "keep_norms_fp32", "keep_norms_fp32 false (the checkpoint's true)",
            R"({"keep_norms_fp32": true})"}}) {
    SCOPED_TRACE(c.mode);
    Trainer saved(config, options_for(AmpConfig::from_json(c.resumes_with, c.mode), 4), data);
    saved.train_step();
    StateDict state = saved.checkpoint();
    Json amp = json::parse(state.metadata.at("train.amp_config"));
    amp.erase(c.removed);
    state.metadata["train.amp_config"] = json::dump(amp);
    Trainer by_default(config, options_for(AmpConfig::parse(c.mode), 4), data);
    EXPECT_ERROR_MENTIONS(by_default.load_checkpoint(state), "the AMP options differ in " + c.refused_as);
    Trainer same(config, options_for(AmpConfig::from_json(c.resumes_with, c.mode), 4), data);
    same.load_checkpoint(state);
    EXPECT_EQ(same.step(), 1);
  }
}
