// Booster (amp/booster.h): what each precision mode does to the model, the optimizer and the forward, and
// that every mode trains.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <span>
#include <string>

#include "amp/autocast.h"
#include "autograd/autograd.h"
#include "amp/booster.h"
#include "nn/gpt.h"
#include "nn/layers.h"
#include "optim/adam.h"
#include "optim/sgd.h"
#include "tensor/ops.h"
#include "tensor/precision.h"
#include "test_util.h"

using namespace mixtape;

namespace {

GPTConfig tiny_config() {
  GPTConfig config;
  config.n_layer = 1;
  config.n_head = 2;
  config.n_embd = 16;
  config.block_size = 8;
  config.vocab_size = 11;
  return config;
}

std::unique_ptr<Optimizer> adamw_on(Module& model, double lr) {
  return std::make_unique<AdamW>(std::vector<ParamGroup>{{model.parameters(), lr, 0.0}}, AdamOptions{});
}

std::map<std::string, DType> param_dtypes(const Module& model) {
  std::map<std::string, DType> out;
  for (const auto& [name, p] : model.named_parameters()) out[name] = p.dtype();
  return out;
}

bool is_norm(const std::string& name) { return name.find(".ln_") != std::string::npos; }

std::pair<Tensor, Tensor> fixed_batch() {
  std::vector<int64_t> x(16), y(16);
  for (int i = 0; i < 16; ++i) x[i] = (i * 7 + 3) % 11, y[i] = (i * 5 + 1) % 11;
  return {Tensor::from_vector(x, {2, 8}), Tensor::from_vector(y, {2, 8})};
}

// One training step of a Linear(4, 2) without bias through `booster`: loss = sum(model(x)) * factor for each
// loss id in `factors` (INFINITY overflows that loss's gradients). The gradients are factor * (1.5, 0, -0.25,
// 2.75) / 64 per output row: scaled by up to 2^17 they stay finite in fp16.
StepResult linear_step(Booster& booster, MixedPrecisionOptimizer& optimizer, Linear& model,
                       const std::vector<double>& factors) {
  const std::vector<float> values = {0.5f, -1, 0.25f, 2, 1, 1, -0.5f, 0.75f};
  const Tensor x = div(Tensor::from_vector(values, {2, 4}), 64.0);
  optimizer.zero_grad();
  for (size_t id = 0; id < factors.size(); ++id) {
    const double factor = factors[id];
    const Tensor loss = booster.forward(
        [&](const std::vector<Tensor>& in) {
          // The loss in fp32, as losses are: the fp16 output receives S * factor, not S.
          return std::vector<Tensor>{mul(sum(model(in[0]).to(DType::F32)), factor)};
        },
        {x})[0];
    booster.backward(loss, optimizer, static_cast<int>(id));
  }
  return booster.step(optimizer);
}

// A clean factor for Apex's scales (up to 2^17): the loss's own gradient, S * factor, reaches the fp16 sum
// and must stay below fp16's 65504.
constexpr double kClean = 1.0 / 64;

// The scaler's growth_tracker set to `count` clean steps (through its checkpoint state).
void set_clean_steps(LossScaler& scaler, int64_t count) {
  std::map<std::string, std::string> state = scaler.state_dict();
  state["growth_tracker"] = std::to_string(count);
  scaler.load_state_dict(state);
}

}  // namespace

TEST(Booster, EachModeLeavesParametersInItsDtype) {
  // mode -> (dtype of norm parameters, dtype of the others). O2 casts LayerNorm with the model, as Apex's
  // convert_network does (its keep_batchnorm_fp32 keeps BatchNorm only).
  const std::vector<std::tuple<std::string, DType, DType>> expected = {
      {"fp32", DType::F32, DType::F32},          {"tf32", DType::F32, DType::F32},
      {"fp16", DType::F32, DType::F32},          {"bf16", DType::F32, DType::F32},
      {"fp16_apex:O0", DType::F32, DType::F32},  {"fp16_apex:O1", DType::F32, DType::F32},
      {"fp16_apex:O2", DType::F16, DType::F16},  {"fp16_apex:O3", DType::F16, DType::F16},
      {"fp16_naive", DType::F16, DType::F16},    {"bf16_naive", DType::BF16, DType::BF16}};
  for (const auto& [mode, norm_dtype, other_dtype] : expected) {
    AllowTf32Guard restore(false);
    GPT model(tiny_config(), 1);
    Booster booster(AmpConfig::parse(mode));
    auto optimizer = booster.boost(model, adamw_on(model, 1e-3));
    for (const auto& [name, dtype] : param_dtypes(model))
      EXPECT_EQ(dtype, is_norm(name) ? norm_dtype : other_dtype) << mode << " " << name;
    EXPECT_EQ(allow_tf32(), mode == "tf32") << mode;
    // The optimizer works on the model's current parameters (conversion made new leaves) or their masters.
    const std::vector<Tensor> model_params = optimizer->model_params();
    const std::vector<Tensor> now = model.parameters();
    ASSERT_EQ(model_params.size(), now.size());
    for (size_t i = 0; i < now.size(); ++i) EXPECT_EQ(model_params[i].impl_ptr(), now[i].impl_ptr()) << mode;
    const bool masters = mode == "fp16_apex:O2" || mode == "fp16_naive" || mode == "bf16_naive";
    for (const Tensor& master : optimizer->master_params())
      EXPECT_EQ(master.dtype(), masters ? DType::F32 : master.dtype());
    for (size_t i = 0; i < now.size(); ++i)
      if (masters && now[i].dtype() != DType::F32) {
        EXPECT_NE(optimizer->master_params()[i].impl_ptr(), now[i].impl_ptr());
        EXPECT_EQ(optimizer->master_params()[i].to(now[i].dtype()).to_vector<float>(), now[i].to_vector<float>());
      }
  }
}

TEST(Booster, ScalersFollowTheMode) {
  struct Case {
    std::string mode;
    std::string scaler;
    double scale;
  };
  for (const Case& c : std::vector<Case>{{"fp32", "StaticLossScaler", 1},
                                         {"fp16", "GradScaler", 65536},
                                         {"bf16", "StaticLossScaler", 1},
                                         {"fp16_apex:O1", "DynamicLossScaler", 65536},
                                         {"fp16_apex:O2", "DynamicLossScaler", 65536},
                                         {"fp16_apex:O3", "StaticLossScaler", 1},
                                         {"fp16_naive", "DynamicLossScaler", 4294967296.0}}) {
    GPT model(tiny_config(), 1);
    Booster booster(AmpConfig::parse(c.mode));
    auto optimizer = booster.boost(model, adamw_on(model, 1e-3));
    EXPECT_STREQ(optimizer->scaler().name(), c.scaler.c_str()) << c.mode;
    EXPECT_EQ(optimizer->loss_scale(), c.scale) << c.mode;
  }
  GPT model(tiny_config(), 1);
  Booster apex(AmpConfig::from_json(R"({"num_losses":3,"max_loss_scale":4096})", "fp16_apex:O2"));
  auto optimizer = apex.boost(model, adamw_on(model, 1e-3));
  EXPECT_EQ(optimizer->num_losses(), 3);
  EXPECT_EQ(optimizer->loss_scale(2), 4096.0);  // Apex: min(init 2^16, max_loss_scale)
}

TEST(Booster, ForwardRunsUnderTheModesCasts) {
  const auto [x, y] = fixed_batch();
  struct Case {
    std::string mode;
    DType logits;  // inside the forward
    DType output;  // what the booster hands back
  };
  for (const Case& c : std::vector<Case>{{"fp32", DType::F32, DType::F32},
                                         {"fp16", DType::F16, DType::F16},
                                         {"bf16", DType::BF16, DType::BF16},
                                         {"fp16_apex:O2", DType::F16, DType::F32},
                                         {"fp16_naive", DType::F16, DType::F32},
                                         {"bf16_naive", DType::BF16, DType::F32}}) {
    GPT model(tiny_config(), 1);
    Booster booster(AmpConfig::parse(c.mode));
    auto optimizer = booster.boost(model, adamw_on(model, 1e-3));
    DType inside = DType::F64;
    const std::vector<Tensor> out = booster.forward(
        [&](const std::vector<Tensor>& in) {
          Tensor logits = model.forward(in[0]).logits;
          inside = logits.dtype();
          return std::vector<Tensor>{logits};
        },
        {x});
    EXPECT_EQ(inside, c.logits) << c.mode;
    EXPECT_EQ(out[0].dtype(), c.output) << c.mode;
    EXPECT_FALSE(Autocast::enabled()) << "the autocast scope ends with the forward";
  }
}

TEST(Booster, EveryModeTrainsATinyGPT) {
  const auto [x, y] = fixed_batch();
  // The last mode is O2 with the model left fp32 (Apex accepts it; master_weights then keep nothing).
  for (const std::string mode : {"fp32", "tf32", "fp16", "bf16", "fp16_apex:O0", "fp16_apex:O1", "fp16_apex:O2",
                                 "fp16_apex:O3", "fp16_naive", "bf16_naive", "fp16_apex:O2 uncast"}) {
    AllowTf32Guard restore(false);
    GPT model(tiny_config(), 7);
    // A small initial scale for the naive scaler: 2^32 would overflow (and skip) the first steps.
    Booster booster(mode == "fp16_naive" || mode == "bf16_naive"
                        ? AmpConfig::from_json(R"({"initial_scale":1024})", mode)
                    : mode == "fp16_apex:O2 uncast"
                        ? AmpConfig::from_json(R"({"cast_model_type":false})", "fp16_apex:O2")
                        : AmpConfig::parse(mode));
    auto optimizer = booster.boost(model, adamw_on(model, 1e-2));
    if (mode == "fp16_apex:O2 uncast") {
      for (const auto& [name, dtype] : param_dtypes(model)) EXPECT_EQ(dtype, DType::F32) << name;
    }
    double first = 0, last = 0;
    for (int step = 0; step < 40; ++step) {
      optimizer->zero_grad();
      const Tensor loss = booster.forward(
          [&](const std::vector<Tensor>& in) { return std::vector<Tensor>{model.forward(in[0], in[1]).loss}; },
          {x, y})[0];
      EXPECT_EQ(loss.dtype(), DType::F32) << mode;
      (step == 0 ? first : last) = loss.item();
      booster.backward(loss, *optimizer);
      booster.step(*optimizer);
    }
    EXPECT_LT(last, 0.6 * first) << mode << ": " << first << " -> " << last;
    EXPECT_EQ(optimizer->skipped_steps(), 0) << mode;
  }
}

TEST(Booster, ApexCastsInputsToTheCastModelTypeAndOutputsToCastModelOutputsAtAnyOptLevel) {
  // Apex's _initialize: with a cast_model_type every floating input is cast to it (O0: fp32) and every
  // floating output to cast_model_outputs (fp32 if unset); without one, outputs to cast_model_outputs if set.
  // Each cast applies even where it changes nothing in the model: O2 with "fp16" casts an fp32 loss to fp16.
  const Tensor ids = Tensor::from_vector(std::vector<int64_t>{1, 2}, {2});
  struct Case {
    std::string mode;
    std::string json;
    DType input;   // what an f64 and an f16 input become inside the forward
    DType output;  // what an f32, an f64 and a bf16 output become
  };
  const std::vector<Case> cases = {
      {"fp16_apex:O0", "{}", DType::F32, DType::F32},
      {"fp16_apex:O0", R"({"cast_model_outputs":"bf16"})", DType::F32, DType::BF16},
      {"fp16_apex:O2", "{}", DType::F16, DType::F32},
      {"fp16_apex:O2", R"({"cast_model_outputs":"fp16"})", DType::F16, DType::F16},
      {"fp16_apex:O3", R"({"cast_model_outputs":"fp32"})", DType::F16, DType::F32},
      {"fp16_apex:O1", R"({"cast_model_type":"fp32"})", DType::F32, DType::F32}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.mode + " " + c.json);
    Linear model(4, 2, true, 3);
    Booster booster(AmpConfig::from_json(c.json, c.mode));
    auto optimizer = booster.boost(model, adamw_on(model, 1e-3));
    std::vector<Tensor> seen;
    const std::vector<Tensor> out = booster.forward(
        [&](const std::vector<Tensor>& in) {
          seen = in;
          return std::vector<Tensor>{Tensor::ones({2}, DType::F32), Tensor::ones({2}, DType::F64),
                                     Tensor::ones({2}, DType::BF16), in[2]};
        },
        {Tensor::ones({2}, DType::F64), Tensor::ones({2}, DType::F16), ids});
    ASSERT_EQ(seen.size(), 3u);
    EXPECT_EQ(seen[0].dtype(), c.input);
    EXPECT_EQ(seen[1].dtype(), c.input);
    EXPECT_TRUE(seen[2].same(ids));  // integers are never cast
    ASSERT_EQ(out.size(), 4u);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(out[i].dtype(), c.output) << i;
    EXPECT_TRUE(out[3].same(ids));
  }
  // O1 without a cast_model_type: inputs as given, outputs cast only when cast_model_outputs is set.
  Linear model(4, 2, true, 3);
  Booster o1(AmpConfig::from_json(R"({"cast_model_outputs":"bf16"})", "fp16_apex:O1"));
  auto optimizer = o1.boost(model, adamw_on(model, 1e-3));
  DType input = DType::I32;
  const std::vector<Tensor> out = o1.forward(
      [&](const std::vector<Tensor>& in) {
        input = in[0].dtype();
        return std::vector<Tensor>{Tensor::ones({2}, DType::F32)};
      },
      {Tensor::ones({2}, DType::F64)});
  EXPECT_EQ(input, DType::F64);
  EXPECT_EQ(out[0].dtype(), DType::BF16);
}

TEST(Booster, KeepBatchnormFp32FalseLeavesTheNormsInFp16) {
  GPT model(tiny_config(), 1);
  Booster booster(AmpConfig::from_json(R"({"keep_batchnorm_fp32":false})", "fp16_apex:O2"));
  auto optimizer = booster.boost(model, adamw_on(model, 1e-3));
  for (const auto& [name, dtype] : param_dtypes(model)) EXPECT_EQ(dtype, DType::F16) << name;
  for (const Tensor& master : optimizer->master_params()) EXPECT_EQ(master.dtype(), DType::F32);
}

TEST(Booster, Fp32ModulesComeThroughBoostOptionsAndTrain) {
  const auto [x, y] = fixed_batch();
  struct Case {
    std::string mode;
    std::string json;
    bool blocks_norms_fp32;  // ln_1 / ln_2 (ln_f is always asked for)
  };
  for (const Case& c : std::vector<Case>{{"fp16_naive", R"({"initial_scale":1024})", false},
                                         {"bf16_naive", "{}", false},
                                         {"fp16_apex:O2", R"({"keep_batchnorm_fp32":false})", false},
                                         {"fp16_apex:O2", R"({"keep_norms_fp32":true})", true}}) {
    // keep_norms_fp32's norms are merged with fp32_modules, each once.
    SCOPED_TRACE(c.mode + " " + c.json);
    GPT model(tiny_config(), 1);
    Booster booster(AmpConfig::from_json(c.json, c.mode));
    auto optimizer =
        booster.boost(model, adamw_on(model, 1e-2), BoostOptions{.fp32_modules = {model.ln_f.get()}});
    const DType low = c.mode == "bf16_naive" ? DType::BF16 : DType::F16;
    for (const auto& [name, dtype] : param_dtypes(model)) {
      const bool fp32 = name.find("ln_f") != std::string::npos || (c.blocks_norms_fp32 && is_norm(name));
      EXPECT_EQ(dtype, fp32 ? DType::F32 : low) << name;
    }
    // The optimizer holds ln_f's fp32 parameters: a step moves them.
    const std::vector<double> before = model.ln_f->named_parameters()[0].second.to_vector<double>();
    optimizer->zero_grad();
    const Tensor loss = booster.forward(
        [&](const std::vector<Tensor>& in) { return std::vector<Tensor>{model.forward(in[0], in[1]).loss}; },
        {x, y})[0];
    booster.backward(loss, *optimizer);
    EXPECT_FALSE(booster.step(*optimizer).skipped);
    EXPECT_NE(model.ln_f->named_parameters()[0].second.to_vector<double>(), before);
  }
  GPT model(tiny_config(), 1), stranger(tiny_config(), 1);
  Booster booster(AmpConfig::parse("fp16_naive"));
  const BoostOptions options{.fp32_modules = {stranger.ln_f.get()}};
  EXPECT_ERROR_MENTIONS(booster.boost(model, adamw_on(model, 1e-3), options), "fp32_modules",
                        "not a submodule");
}

TEST(Booster, SetFp32AfterBoostIsAnErrorNamingTheModuleAndTheFix) {
  for (const std::string mode : {"fp16_naive", "bf16_naive", "fp16_apex:O2", "fp16_apex:O3"}) {
    GPT model(tiny_config(), 1);
    Booster booster(AmpConfig::parse(mode));
    auto optimizer = booster.boost(model, adamw_on(model, 1e-3));
    ASSERT_NE(booster.naive_model(), nullptr) << mode;
    EXPECT_TRUE(booster.naive_model()->sealed()) << mode;
    EXPECT_ERROR_MENTIONS(booster.naive_model()->set_fp32(*model.ln_f), "set_fp32", "'transformer.ln_f'",
                          "optimizer", "before boost", "BoostOptions::fp32_modules");
  }
}

TEST(Booster, ApexDynamicScalerHasApexWindowAndTheConfigsBounds) {
  Linear model(4, 2, false, 3);
  Booster booster(AmpConfig::from_json(R"({"min_loss_scale":0.25,"max_loss_scale":131072})", "fp16_apex:O2"));
  auto optimizer = booster.boost(model, adamw_on(model, 1e-3));
  const auto* scaler = dynamic_cast<const DynamicLossScaler*>(&optimizer->scaler());
  ASSERT_NE(scaler, nullptr);
  EXPECT_EQ(scaler->options().growth_interval, 2000);  // Apex's scale_window
  EXPECT_EQ(scaler->options().hysteresis, 1);
  EXPECT_EQ(scaler->options().min_scale, 0.25);
  EXPECT_EQ(scaler->options().max_scale, 131072.0);
  EXPECT_EQ(optimizer->loss_scale(), 65536.0);
  // The 2000th clean step doubles the scale, the 1999th does not; the next doubling stops at max_loss_scale.
  set_clean_steps(optimizer->scaler(), 1998);
  EXPECT_FALSE(linear_step(booster, *optimizer, model, {kClean}).skipped);
  EXPECT_EQ(optimizer->loss_scale(), 65536.0);
  EXPECT_FALSE(linear_step(booster, *optimizer, model, {kClean}).skipped);
  EXPECT_EQ(optimizer->loss_scale(), 131072.0);
  set_clean_steps(optimizer->scaler(), 1999);
  linear_step(booster, *optimizer, model, {kClean});
  EXPECT_EQ(optimizer->loss_scale(), 131072.0);
  // Each overflow halves it, down to min_loss_scale and not below.
  std::map<std::string, std::string> state = optimizer->scaler().state_dict();
  state["scale"] = "1";
  optimizer->scaler().load_state_dict(state);
  for (double expected : {0.5, 0.25, 0.25}) {
    EXPECT_TRUE(linear_step(booster, *optimizer, model, {INFINITY}).skipped);
    EXPECT_EQ(optimizer->loss_scale(), expected);
  }
}

TEST(Booster, NaiveClipGradComesFromTheConfigOverTheBoostOptions) {
  for (const auto& [json, expected] : std::vector<std::pair<std::string, double>>{
           {R"({"clip_grad":0.5,"initial_scale":64})", 0.5}, {R"({"initial_scale":64})", 100.0}}) {
    Linear model(4, 2, false, 3);
    Booster booster(AmpConfig::from_json(json, "fp16_naive"));
    auto optimizer = booster.boost(model, adamw_on(model, 1e-3), BoostOptions{.clip_grad = 100.0});
    EXPECT_EQ(optimizer->options().clip_grad, expected) << json;
    const StepResult result = linear_step(booster, *optimizer, model, {100.0});
    ASSERT_FALSE(result.skipped);
    ASSERT_GT(result.grad_norm, 1.0);  // so that clip_grad 0.5 has work to do
    double norm_sq = 0;
    for (const Tensor& master : optimizer->master_params())
      for (double g : master.grad().to_vector<double>()) norm_sq += g * g;
    if (expected == 0.5) EXPECT_NEAR(std::sqrt(norm_sq), 0.5, 1e-4) << json;
    else EXPECT_NEAR(std::sqrt(norm_sq), result.grad_norm, 1e-4 * result.grad_norm) << json;
  }
}

TEST(Booster, NaiveVerbosePrintsColossalAIsLineAtEachGrowthAndBackoff) {
  for (bool verbose : {true, false}) {
    Linear model(4, 2, false, 3);
    const std::string json = std::string(R"({"initial_scale":1024,"growth_interval":2,"verbose":)") +
                             (verbose ? "true" : "false") + "}";
    Booster booster(AmpConfig::from_json(json, "fp16_naive"));
    auto optimizer = booster.boost(model, adamw_on(model, 1e-3));
    ::testing::internal::CaptureStderr();
    linear_step(booster, *optimizer, model, {1.0});
    linear_step(booster, *optimizer, model, {1.0});       // 2 clean steps: x2
    linear_step(booster, *optimizer, model, {INFINITY});  // hysteresis 2: skipped, the scale kept
    linear_step(booster, *optimizer, model, {INFINITY});  // backoff
    linear_step(booster, *optimizer, model, {INFINITY});  // and again, until a growth refills the hysteresis
    const std::string printed = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(optimizer->loss_scale(), 512.0);
    EXPECT_EQ(printed, verbose ? "No overflow for consecutive 2 steps, the loss scale is adjusted to 2048\n"
                                 "Overflow occurs, the loss scale is adjusted to 1024\n"
                                 "Overflow occurs, the loss scale is adjusted to 512\n"
                               : "");
  }
}

TEST(Booster, PrintVerboseFalseSilencesTheLinesAndStepReportsForAnotherWrappersScalers) {
  // A process that is not the one to print (BoostOptions::print_verbose false: ranks other than 0) says
  // nothing.
  {
    Linear model(4, 2, false, 3);
    const AmpConfig config =
        AmpConfig::from_json(R"({"initial_scale":1024,"hysteresis":1,"verbose":true})", "fp16_naive");
    Booster booster(config);
    auto optimizer = booster.boost(model, adamw_on(model, 1e-3), {.print_verbose = false});
    ::testing::internal::CaptureStderr();
    linear_step(booster, *optimizer, model, {INFINITY});  // a backoff to 512
    EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
    EXPECT_EQ(optimizer->loss_scale(), 512.0);
  }
  // step(function, scalers): what dist::ZeroOptimizer's step goes through; the lines follow the given
  // scalers.
  Linear model(4, 2, false, 3);
  Booster booster(AmpConfig::from_json(R"({"initial_scale":1024,"hysteresis":1,"verbose":true})",
                                       "fp16_naive"));
  auto optimizer = booster.boost(model, adamw_on(model, 1e-3));
  DynamicLossScaler scaler(DynamicLossScalerOptions{.initial_scale = 64, .hysteresis = 1});
  ::testing::internal::CaptureStderr();
  const StepResult result = booster.step(
      [&] {
        scaler.update(true);  // this wrapper's step found an overflow
        return StepResult{.skipped = true};
      },
      {&scaler});
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "Overflow occurs, the loss scale is adjusted to 32\n");
  EXPECT_TRUE(result.skipped);
}

TEST(Booster, ApexVerbosityPrintsApexsOverflowLineOnEverySkippedStep) {
  {  // verbosity 1 (the default): each skipped step, at the min_loss_scale floor too; no growth lines
    Linear model(4, 2, false, 3);
    Booster booster(AmpConfig::from_json(R"({"min_loss_scale":32768})", "fp16_apex:O2"));
    auto optimizer = booster.boost(model, adamw_on(model, 1e-3));
    ::testing::internal::CaptureStderr();
    linear_step(booster, *optimizer, model, {INFINITY});
    linear_step(booster, *optimizer, model, {INFINITY});
    set_clean_steps(optimizer->scaler(), 1999);
    linear_step(booster, *optimizer, model, {kClean});
    EXPECT_EQ(::testing::internal::GetCapturedStderr(),
              "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768\n"
              "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768\n");
    EXPECT_EQ(optimizer->loss_scale(), 65536.0);
  }
  {  // two losses, the second overflows: only its scaler is named
    Linear model(4, 2, false, 3);
    Booster booster(AmpConfig::from_json(R"({"num_losses":2})", "fp16_apex:O2"));
    auto optimizer = booster.boost(model, adamw_on(model, 1e-3));
    ::testing::internal::CaptureStderr();
    EXPECT_TRUE(linear_step(booster, *optimizer, model, {kClean, INFINITY}).skipped);
    EXPECT_EQ(::testing::internal::GetCapturedStderr(),
              "Gradient overflow.  Skipping step, loss scaler 1 reducing loss scale to 32768\n");
    // Then only loss 0, overflowing: loss 1 sat the step out, so its scaler (not updated) says nothing,
    // though its latest update was an overflow.
    ::testing::internal::CaptureStderr();
    EXPECT_TRUE(linear_step(booster, *optimizer, model, {INFINITY}).skipped);
    EXPECT_EQ(::testing::internal::GetCapturedStderr(),
              "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768\n");
    EXPECT_EQ(optimizer->loss_scale(1), 32768.0);
  }
  {  // verbosity 2 adds each growth; verbosity 0 prints nothing
    for (int verbosity : {2, 0}) {
      Linear model(4, 2, false, 3);
      const std::string json = "{\"verbosity\":" + std::to_string(verbosity) + "}";
      Booster booster(AmpConfig::from_json(json, "fp16_apex:O2"));
      auto optimizer = booster.boost(model, adamw_on(model, 1e-3));
      ::testing::internal::CaptureStderr();
      set_clean_steps(optimizer->scaler(), 1999);
      linear_step(booster, *optimizer, model, {kClean});
      linear_step(booster, *optimizer, model, {INFINITY});
      const std::string expected =
          "No overflow for 2000 consecutive steps, loss scaler 0 increasing loss scale to 131072\n"
          "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 65536\n";
      EXPECT_EQ(::testing::internal::GetCapturedStderr(), verbosity == 2 ? expected : "");
    }
  }
  {  // a static scale skips too (unlike Apex), and says so
    Linear model(4, 2, false, 3);
    Booster booster(AmpConfig::parse("fp16_apex:O3"));
    auto optimizer = booster.boost(model, adamw_on(model, 1e-3));
    ::testing::internal::CaptureStderr();
    EXPECT_TRUE(linear_step(booster, *optimizer, model, {INFINITY}).skipped);
    const std::string printed = ::testing::internal::GetCapturedStderr();
    EXPECT_NE(printed.find("Gradient overflow.  Skipping step"), std::string::npos) << printed;
    EXPECT_NE(printed.find("static loss scale 1"), std::string::npos) << printed;
  }
}

TEST(Booster, MisuseIsAnError) {
  GPT model(tiny_config(), 1);
  Booster booster(AmpConfig::parse("bf16"));
  EXPECT_ERROR_MENTIONS(booster.forward([](const std::vector<Tensor>& in) { return in; }, {}), "boost");
  auto optimizer = booster.boost(model, adamw_on(model, 1e-3));
  GPT other(tiny_config(), 1);
  EXPECT_ERROR_MENTIONS(booster.boost(other, adamw_on(other, 1e-3)), "already");
  AmpConfig unknown;
  unknown.mode = PrecisionMode::Count;  // no row: a value cast from outside the enum's range
  EXPECT_ERROR_MENTIONS(Booster{unknown}, "unknown mixed_precision", "fp16_naive");
}

// An optimizer that already stepped is refused in every mode, before the model changes: in the modes that
// convert the model (O2, O3, naive) its state would stay keyed to the fp32 tensors the conversion replaced,
// and training would go on with fresh moments and step counts. Apex moves that state to the masters; we
// refuse it, as the wrapper does in the modes that keep the parameters (fp16, O0).
TEST(Booster, AnOptimizerThatAlreadySteppedIsRefusedBeforeTheModelChanges) {
  for (const char* mode : {"fp16", "fp16_apex:O0", "fp16_apex:O2", "fp16_apex:O3", "fp16_naive", "bf16_naive"}) {
    SCOPED_TRACE(mode);
    GPT model(tiny_config(), 1);
    auto adamw = adamw_on(model, 1e-3);
    const auto [x, y] = fixed_batch();
    backward(model.forward(x, y).loss);
    adamw->step();
    Booster booster(AmpConfig::parse(mode));
    EXPECT_ERROR_MENTIONS(booster.boost(model, std::move(adamw)), "AdamW already has state for parameter",
                          "boost the model before training it");
    for (const auto& [name, dtype] : param_dtypes(model)) EXPECT_EQ(dtype, DType::F32) << name;
    // Nothing was boosted: a fresh optimizer can be.
    const auto optimizer = booster.boost(model, adamw_on(model, 1e-3));
    EXPECT_NE(optimizer, nullptr);
  }
}

// An optimizer built on another model's parameters (or holding any tensor that is not one of the model's) is
// refused in every mode before the model changes. In the modes that convert the model it would go on stepping
// the old tensors while the converted model never moved; elsewhere it would train outside the mode's casts.
// A subset of the model's parameters (some frozen) is fine.
TEST(Booster, AnOptimizerOnAnotherModelsParametersIsRefusedBeforeTheModelChanges) {
  for (const char* mode : {"fp32", "bf16", "fp16_apex:O2", "fp16_naive"}) {
    SCOPED_TRACE(mode);
    GPT model(tiny_config(), 1), other(tiny_config(), 1);
    // A small initial scale for the naive scaler: 2^32 would overflow the first step.
    Booster booster(std::string(mode) == "fp16_naive" ? AmpConfig::from_json(R"({"initial_scale":1024})", mode)
                                                      : AmpConfig::parse(mode));
    std::vector<Tensor> mixed = model.parameters();
    mixed.erase(mixed.begin());
    mixed.push_back(other.parameters()[2]);
    auto adamw = std::make_unique<AdamW>(std::vector<ParamGroup>{{{model.parameters()[0]}, 1e-3, 0.0},
                                                                 {mixed, 1e-3, 0.0}}, AdamOptions{});
    EXPECT_ERROR_MENTIONS(booster.boost(model, std::move(adamw)), "AdamW's parameter " +
                          std::to_string(mixed.size() - 1) + " of group 1", "is not a parameter of the model");
    EXPECT_ERROR_MENTIONS(booster.boost(model, adamw_on(other, 1e-3)), "parameter 0 of group 0",
                          "not a parameter of the model");
    for (const auto& [name, dtype] : param_dtypes(model)) EXPECT_EQ(dtype, DType::F32) << name;
    // A subset trains; the left-out parameters are frozen.
    std::vector<Tensor> some = model.parameters();
    const std::vector<float> frozen_before = some.back().to_vector<float>();
    some.pop_back();
    auto optimizer = booster.boost(
        model, std::make_unique<AdamW>(std::vector<ParamGroup>{{some, 1e-2, 0.0}}, AdamOptions{}));
    const std::vector<float> first_before = model.parameters()[0].to_vector<float>();
    const auto [x, y] = fixed_batch();
    optimizer->zero_grad();
    booster.backward(booster.forward([&](const std::vector<Tensor>& in) {
      return std::vector<Tensor>{model.forward(in[0], in[1]).loss}; }, {x, y})[0], *optimizer);
    EXPECT_FALSE(booster.step(*optimizer).skipped);
    EXPECT_NE(model.parameters()[0].to_vector<float>(), first_before);
    EXPECT_EQ(model.parameters().back().to_vector<float>(), frozen_before);
  }
}

// Invalid BoostOptions are an error before the model is converted: the booster and model stay usable.
TEST(Booster, InvalidOptionsLeaveTheModelAndTheBoosterUntouched) {
  GPT model(tiny_config(), 1);
  Booster booster(AmpConfig::parse("fp16_naive"));
  EXPECT_ERROR_MENTIONS(booster.boost(model, adamw_on(model, 1e-3), BoostOptions{.clip_grad = -1}),
                        "clip_grad must be finite and >= 0", "-1");
  for (const auto& [name, dtype] : param_dtypes(model)) EXPECT_EQ(dtype, DType::F32) << name;
  const auto optimizer = booster.boost(model, adamw_on(model, 1e-3), BoostOptions{.clip_grad = 1});
  for (const auto& [name, dtype] : param_dtypes(model)) EXPECT_EQ(dtype, DType::F16) << name;
}

// Five micro-batches (backward calls) before one step, on a Linear(1, 1) without bias: micro-batch m's loss
// is the weight times a_m, so the weight's gradient is S * a_m, with a = (big, small, small, small, small).
// The small parts are a quarter of the 16-bit ulp of S * big (bf16 keeps 8 significant bits, fp16 11), so
// a 16-bit sum rounds each of them away (to nearest even) and stays S * big, while an fp32 sum keeps them:
// S * (big + 4 small), exact in fp32. The master gradient after the step is the sum unscaled (S is a power of
// two): big + 4 small where the gradients accumulate in fp32, big where they stay 16-bit.
//   bf16, S = 2^32 (naive's initial_scale): big 1, small 2^-9: S big = 2^32, ulp 2^25, S small = 2^23.
//   fp16, S = 2^15 (the output's gradient S must stay below fp16's 65504; O3's static S = 1 works alike):
//   big 2^-4, small 2^-16: S big = 2048, ulp 2, S small = 0.5.
TEST(Booster, MicroBatchGradientsAddUpInFp32WithApexMasterWeightsOrAccumulateAllreduceGradsInFp32) {
  struct Case {
    const char* mode;
    const char* json;
    bool fp32_grads;
  };
  const Case cases[] = {
      {"bf16_naive", "{}", false},  // Colossal-AI's and InternEvo's default
      {"bf16_naive", R"({"accumulate_allreduce_grads_in_fp32": true})", true},
      {"fp16_naive", R"({"initial_scale": 32768})", false},
      {"fp16_naive", R"({"initial_scale": 32768, "accumulate_allreduce_grads_in_fp32": true})", true},
      {"fp16_apex:O2", R"({"max_loss_scale": 32768})", true},  // master weights: Apex's per-backward unscale
      {"fp16_apex:O3", "{}", false},                        // no master weights: Apex steps the fp16 grads
      {"fp16_apex:O3", R"({"master_weights": true})", true},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.mode) + " " + c.json);
    const AmpConfig config = AmpConfig::from_json(c.json, c.mode);
    EXPECT_EQ(config.fp32_grads(), c.fp32_grads);
    const bool bf16 = *config.model_dtype() == DType::BF16;
    const double big = bf16 ? 1.0 : 1.0 / 16, small = bf16 ? std::ldexp(1.0, -9) : std::ldexp(1.0, -16);
    Linear model(1, 1, false, 3);
    Booster booster(config);
    auto optimizer = booster.boost(model, std::make_unique<SGD>(model.parameters(), 0.0));
    EXPECT_EQ(model.weight.grad_dtype(), c.fp32_grads ? DType::F32 : *config.model_dtype());
    for (double a : {big, small, small, small, small}) {
      const Tensor loss = booster.forward(
          [&](const std::vector<Tensor>& in) {
            return std::vector<Tensor>{sum(model(in[0]).to(DType::F32))};
          },
          {Tensor::full({1, 1}, a)})[0];
      booster.backward(loss, *optimizer);
    }
    const double scale = optimizer->loss_scale();
    EXPECT_EQ(scale, bf16 ? std::ldexp(1.0, 32) : config.apex.loss_scale.value_or(32768.0));
    const Tensor model_grad = model.weight.grad();
    EXPECT_EQ(model_grad.dtype(), c.fp32_grads ? DType::F32 : *config.model_dtype());
    const double expected = c.fp32_grads ? big + 4 * small : big;
    EXPECT_EQ(model_grad.item(), expected * scale);
    ASSERT_FALSE(booster.step(*optimizer).skipped);
    EXPECT_EQ(optimizer->master_params()[0].grad().item(), expected);
  }
  // The fp32 gradient goes on leaves without one: a 16-bit parameter that already has a gradient is refused,
  // before the model changes.
  Linear model(1, 1, false, 3);
  model.to(DType::BF16);
  model.weight.set_grad(Tensor::ones({1, 1}, DType::BF16));
  Booster booster(AmpConfig::from_json(R"({"accumulate_allreduce_grads_in_fp32": true})", "bf16_naive"));
  EXPECT_ERROR_MENTIONS(booster.boost(model, std::make_unique<SGD>(model.parameters(), 0.1)),
                        "parameter weight", "already has a gradient", "zero_grad");
  EXPECT_EQ(model.weight.grad_dtype(), DType::BF16);
}

namespace {

// Records which all-reduces reach it: a group of 2 whose other rank holds the same values.
class RecordingGroup : public ProcessGroup {
 public:
  int max_calls = 0, sum_calls = 0, buffer_calls = 0;
  std::string name() const override { return "recording group of 2"; }
  int size() const override { return 2; }
  void all_reduce_max(std::span<double>) override { ++max_calls; }
  void all_reduce_sum(std::span<double> values) override {
    ++sum_calls;
    for (double& v : values) v *= 2;
  }
  void all_reduce_sum(const Tensor& t) override {
    ++buffer_calls;
    NoGradGuard no_grad;
    Tensor shared = t;  // the same storage
    shared.mul_(2.0);
  }
};

// A module with a floating buffer, for the naive modes' buffer averaging.
class BufferedLinear : public UnaryModule {
 public:
  BufferedLinear() {
    linear = register_module("linear", std::make_shared<Linear>(2, 1, false, 7));
    running = Tensor::full({1}, 3.0);
    register_buffer("running", running);
  }
  Tensor forward(const Tensor& x) override { return (*linear)(x); }
  std::shared_ptr<Linear> linear;
  Tensor running;
};

}  // namespace

// The model-parallel group gets found_inf and the grad norm, the data-parallel group the naive modes'
// buffer averaging, and neither the other's: one group for both would sum the replicas' identical squared
// norms (a norm sqrt(dp) too large) or average buffers across different parts of the model.
TEST(Booster, TheModelParallelGroupReducesTheNormAndTheDataParallelGroupTheBuffers) {
  BufferedLinear model;
  RecordingGroup mp, dp;
  AmpConfig config = AmpConfig::parse("fp16_naive");
  config.naive.scaler.initial_scale = 1024;  // 2^32 would overflow fp16 and skip the step
  Booster booster(config);
  auto optimizer = booster.boost(model, std::make_unique<SGD>(model.parameters(), 0.1),
                                 {.clip_grad = 1e9, .model_parallel_group = &mp, .data_parallel_group = &dp});
  const Tensor x = Tensor::from_vector(std::vector<float>{1, 2}, {1, 2});
  const Tensor loss = booster.forward(
      [&](const std::vector<Tensor>& in) { return std::vector<Tensor>{sum(model(in[0]))}; }, {x})[0];
  booster.backward(loss, *optimizer);
  const StepResult result = booster.step(*optimizer);
  EXPECT_GE(mp.max_calls, 1);
  EXPECT_GE(mp.sum_calls, 1);
  EXPECT_EQ(mp.buffer_calls, 0);
  EXPECT_EQ(dp.buffer_calls, 1);
  EXPECT_EQ(dp.max_calls + dp.sum_calls, 0);
  // The gradient is x = (1, 2) on this rank and (1, 2) on the other: norm sqrt(2 * 5).
  EXPECT_NEAR(result.grad_norm, std::sqrt(10.0), 1e-3);
  // The buffer: summed over the 2 replicas (doubled by the fake) and divided by 2.
  EXPECT_EQ(model.running.to(DType::F32).item(), 3.0);
}

// A checkpoint's scale ("scaler.<k>.scale" in the optimizer's state) is held where it is read to what a scale
// option is: a positive scale, finite in fp32, whose fp32 reciprocal is finite. The smallest such is the
// float after 2^-128, 2^-128 + 2^-149 (1/2^-128 = 2^128 overflows fp32); 2^-128 itself is refused.
TEST(Booster, ACheckpointsLossScaleIsAUsableScaleNamedByItsEntry) {
  const double lowest = std::ldexp(1.0, -128) + std::ldexp(1.0, -149);
  ASSERT_EQ(std::stod("2.938737278354183e-39"), lowest);
  ASSERT_EQ(std::stod("2.938735877055719e-39"), std::ldexp(1.0, -128));
  for (const std::string mode : {"fp16", "fp16_apex:O2", "fp16_naive"}) {
    SCOPED_TRACE(mode);
    GPT model(tiny_config(), 1);
    // The naive rule floors at min_scale: the smallest usable scale is its floor here.
    Booster booster(mode == "fp16_naive"
                        ? AmpConfig::from_json(R"({"min_scale": 2.938737278354183e-39})", mode)
                        : AmpConfig::parse(mode));
    auto optimizer = booster.boost(model, adamw_on(model, 1e-3));
    StateDict state = optimizer->state_dict();
    ASSERT_TRUE(state.metadata.count("scaler.0.scale"));
    for (const std::string bad : {"2.938735877055719e-39", "1e-45", "3.4028235677973366e+38"}) {
      state.metadata["scaler.0.scale"] = bad;
      EXPECT_ERROR_MENTIONS(optimizer->load_state_dict(state),
                            "entry 'scaler.0.scale' " + bad + " is not a usable loss scale",
                            ">= 2.938737278354183e-39");
    }
    EXPECT_NE(optimizer->loss_scale(), lowest);
    state.metadata["scaler.0.scale"] = "2.938737278354183e-39";
    optimizer->load_state_dict(state);
    EXPECT_EQ(optimizer->loss_scale(), lowest);
  }
}

// The block-scaled modes across processes: fp8_rowwise reduces the row amaxes of a row-parallel layer's forward
// over the tensor-parallel group (its K, the input features, is split there) and of every weight gradient over
// the data-parallel group (K is the tokens); each GEMM quantizes two operands, one reduction each.
TEST(Booster, Fp8RowwiseReducesRowAmaxesOverTheGroupsThatSplitEachGemmsK) {
  for (const bool row_parallel : {true, false}) {
    SCOPED_TRACE(row_parallel ? "row-parallel" : "column-parallel");
    BufferedLinear model;
    RecordingGroup tp, dp;
    Booster booster(AmpConfig::parse("fp8_rowwise"));
    BoostOptions options;
    options.data_parallel_group = &dp;
    options.tensor_parallel_group = &tp;
    (row_parallel ? options.row_parallel_weights : options.column_parallel_weights) = {"linear.weight"};
    auto optimizer = booster.boost(model, std::make_unique<SGD>(model.parameters(), 0.1), options);
    Tensor x = Tensor::from_vector(std::vector<float>{1, 2, 3, 4}, {2, 2});
    x.requires_grad_(true);  // the input gradient's GEMM runs too
    const Tensor loss = booster.forward(
        [&](const std::vector<Tensor>& in) { return std::vector<Tensor>{sum(model(in[0]))}; }, {x})[0];
    EXPECT_EQ(tp.max_calls, row_parallel ? 2 : 0);  // a row-parallel forward's x and W
    booster.backward(loss, *optimizer);
    EXPECT_EQ(tp.max_calls, 2);  // and a column-parallel input gradient's g and Wᵀ
    EXPECT_EQ(dp.max_calls, 2);  // every weight gradient's gᵀ and xᵀ
  }
  // A split named for a layer that is not there is an error, not a silently unreduced layer.
  BufferedLinear model;
  Booster booster(AmpConfig::parse("fp8_rowwise"));
  BoostOptions options;
  options.row_parallel_weights = {"linaer.weight"};
  EXPECT_ERROR_MENTIONS(booster.boost(model, std::make_unique<SGD>(model.parameters(), 0.1), options),
                        "row_parallel_weights entry 'linaer.weight' names no Linear weight");
}
