// Booster (amp/booster.h): what each precision mode does to the model, the optimizer and the forward, and
// that every mode trains.
#include <gtest/gtest.h>

#include <map>

#include "amp/autocast.h"
#include "amp/booster.h"
#include "nn/gpt.h"
#include "optim/adam.h"
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

}  // namespace

TEST(Booster, EachModeLeavesParametersInItsDtype) {
  // mode -> (dtype of norm parameters, dtype of the others)
  const std::vector<std::tuple<std::string, DType, DType>> expected = {
      {"fp32", DType::F32, DType::F32},          {"tf32", DType::F32, DType::F32},
      {"fp16", DType::F32, DType::F32},          {"bf16", DType::F32, DType::F32},
      {"fp16_apex:O0", DType::F32, DType::F32},  {"fp16_apex:O1", DType::F32, DType::F32},
      {"fp16_apex:O2", DType::F32, DType::F16},  {"fp16_apex:O3", DType::F16, DType::F16},
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
  for (const std::string mode : {"fp32", "tf32", "fp16", "bf16", "fp16_apex:O0", "fp16_apex:O1", "fp16_apex:O2",
                                 "fp16_apex:O3", "fp16_naive", "bf16_naive"}) {
    AllowTf32Guard restore(false);
    GPT model(tiny_config(), 7);
    // A small initial scale for the naive scaler: 2^32 would overflow (and skip) the first steps.
    Booster booster(mode == "fp16_naive" || mode == "bf16_naive"
                        ? AmpConfig::from_json(R"({"initial_scale":1024})", mode)
                        : AmpConfig::parse(mode));
    auto optimizer = booster.boost(model, adamw_on(model, 1e-2));
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

TEST(Booster, MisuseIsAnError) {
  GPT model(tiny_config(), 1);
  Booster booster(AmpConfig::parse("bf16"));
  EXPECT_ERROR_MENTIONS(booster.forward([](const std::vector<Tensor>& in) { return in; }, {}), "boost");
  auto optimizer = booster.boost(model, adamw_on(model, 1e-3));
  GPT other(tiny_config(), 1);
  EXPECT_ERROR_MENTIONS(booster.boost(other, adamw_on(other, 1e-3)), "already");
  EXPECT_ERROR_MENTIONS(Booster(AmpConfig{"fp64"}), "unknown mixed_precision", "fp64");
}
