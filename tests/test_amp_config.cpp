// AmpConfig (amp/config.h): the modes, their published defaults, Apex's property table and its refusals,
// JSON round trips and the errors for every invalid value.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <sstream>
#include <string>

#include "amp/config.h"
#include "amp/policy.h"
#include "test_util.h"

using namespace mixtape;

TEST(AmpConfig, TorchAmpModesHaveGradScalerDefaultsAndBf16HasNoScaler) {
  // torch.cuda.amp.GradScaler(init_scale=2.**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000).
  const AmpConfig fp16 = AmpConfig::parse("fp16");
  EXPECT_EQ(fp16.grad_scaler.init_scale, 65536.0);
  EXPECT_EQ(fp16.grad_scaler.growth_factor, 2.0);
  EXPECT_EQ(fp16.grad_scaler.backoff_factor, 0.5);
  EXPECT_EQ(fp16.grad_scaler.growth_interval, 2000);
  EXPECT_TRUE(fp16.grad_scaler.enabled);
  EXPECT_EQ(fp16.autocast_dtype(), DType::F16);
  EXPECT_FALSE(fp16.model_dtype().has_value());
  const AmpConfig bf16 = AmpConfig::parse("bf16");
  EXPECT_FALSE(bf16.grad_scaler.enabled);
  EXPECT_EQ(bf16.autocast_dtype(), DType::BF16);
  EXPECT_FALSE(AmpConfig::parse("fp32").autocast_dtype().has_value());
  EXPECT_FALSE(AmpConfig::parse("tf32").autocast_dtype().has_value());
}

TEST(AmpConfig, NaiveModesHaveTheHysteresisScalerDefaults) {
  // Colossal-AI naive AMP / Megatron DynamicGradScaler: 2^32, min 1, max 2^32, x2, x0.5, 1000, hysteresis 2.
  for (const char* mode : {"fp16_naive", "bf16_naive"}) {
    const AmpConfig c = AmpConfig::parse(mode);
    EXPECT_EQ(c.naive.scaler.initial_scale, 4294967296.0);
    EXPECT_EQ(c.naive.scaler.min_scale, 1.0);
    EXPECT_EQ(c.naive.scaler.max_scale, 4294967296.0);
    EXPECT_EQ(c.naive.scaler.growth_factor, 2.0);
    EXPECT_EQ(c.naive.scaler.backoff_factor, 0.5);
    EXPECT_EQ(c.naive.scaler.growth_interval, 1000);
    EXPECT_EQ(c.naive.scaler.hysteresis, 2);
    EXPECT_EQ(c.naive.clip_grad, 0.0);
    EXPECT_FALSE(c.naive.log_num_zeros_in_grad);
    EXPECT_TRUE(c.naive.output_to_fp32);
    EXPECT_FALSE(c.autocast_dtype().has_value());
  }
  EXPECT_EQ(AmpConfig::parse("fp16_naive").model_dtype(), DType::F16);
  EXPECT_EQ(AmpConfig::parse("bf16_naive").model_dtype(), DType::BF16);
}

TEST(AmpConfig, ApexOptLevelsFollowApexPropertyTable) {
  // apex/amp/frontend.py O0..O3 (None shown as nullopt).
  const ApexProperties o0 = ApexProperties::for_opt_level("O0");
  EXPECT_EQ(o0.cast_model_type, DType::F32);
  EXPECT_FALSE(o0.patch_torch_functions);
  EXPECT_FALSE(o0.keep_batchnorm_fp32.has_value());
  EXPECT_FALSE(o0.master_weights);
  EXPECT_EQ(o0.loss_scale, 1.0);
  const ApexProperties o1 = ApexProperties::for_opt_level("O1");
  EXPECT_FALSE(o1.cast_model_type.has_value());
  EXPECT_TRUE(o1.patch_torch_functions);
  EXPECT_FALSE(o1.keep_batchnorm_fp32.has_value());
  EXPECT_FALSE(o1.loss_scale.has_value());  // "dynamic"
  const ApexProperties o2 = ApexProperties::for_opt_level("O2");
  EXPECT_EQ(o2.cast_model_type, DType::F16);
  EXPECT_FALSE(o2.patch_torch_functions);
  EXPECT_EQ(o2.keep_batchnorm_fp32, true);
  EXPECT_TRUE(o2.master_weights);
  EXPECT_FALSE(o2.loss_scale.has_value());
  const ApexProperties o3 = ApexProperties::for_opt_level("O3");
  EXPECT_EQ(o3.cast_model_type, DType::F16);
  EXPECT_EQ(o3.keep_batchnorm_fp32, false);
  EXPECT_FALSE(o3.master_weights);
  EXPECT_EQ(o3.loss_scale, 1.0);
  for (const ApexProperties& p : {o0, o1, o2, o3}) {
    EXPECT_EQ(p.num_losses, 1);
    EXPECT_EQ(p.verbosity, 1);
    EXPECT_FALSE(p.min_loss_scale.has_value());
    EXPECT_EQ(p.max_loss_scale, 16777216.0);  // 2^24
    EXPECT_FALSE(p.cast_model_outputs.has_value());
  }
  EXPECT_EQ(AmpConfig::parse("fp16_apex:O2").apex.opt_level, "O2");
  EXPECT_EQ(AmpConfig::parse("fp16_apex").apex.opt_level, "O1");  // amp.initialize's default
  EXPECT_EQ(AmpConfig::parse("fp16_apex:O1").autocast_dtype(), DType::F16);
  EXPECT_EQ(AmpConfig::parse("fp16_apex:O2").model_dtype(), DType::F16);
  EXPECT_EQ(AmpConfig::parse("fp16_apex:O3").name(), "fp16_apex:O3");
}

TEST(AmpConfig, ApexRefusesWhatApexRefuses) {
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"mixed_precision":"fp16_apex","opt_level":"O1",
                                                 "cast_model_type":"fp16"})"),
                        "O1", "cast_model_type");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"keep_batchnorm_fp32":true})", "fp16_apex:O1"), "O1",
                        "keep_batchnorm_fp32");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"master_weights":true})", "fp16_apex:O1"), "master_weights");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"patch_torch_functions":true})", "fp16_apex:O2"),
                        "patch_torch_functions", "O1");
  EXPECT_ERROR_MENTIONS(AmpConfig::parse("fp16_apex:O4"), "opt_level", "O4", "O0, O1, O2 or O3");
  EXPECT_ERROR_MENTIONS(AmpConfig::parse("fp16_apex:02"), "02", "the letter O");
  EXPECT_ERROR_MENTIONS(AmpConfig::parse("fp16:O2"), "only fp16_apex");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"loss_scale":"static"})", "fp16_apex:O2"), "loss_scale",
                        "dynamic");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"loss_scale":0})", "fp16_apex:O2"), "loss_scale");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"num_losses":0})", "fp16_apex:O2"), "num_losses");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"verbosity":3})", "fp16_apex:O2"), "verbosity");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"min_loss_scale":1e9})", "fp16_apex:O2"), "min_loss_scale",
                        "max_loss_scale");
}

TEST(AmpConfig, ApexPropertiesCanBeOverriddenAsInAmpInitialize) {
  const AmpConfig c = AmpConfig::from_json(
      R"({"mixed_precision":"fp16_apex","opt_level":"O2","loss_scale":128,"keep_batchnorm_fp32":"False",
          "num_losses":2,"max_loss_scale":65536,"min_loss_scale":0.25,"cast_model_outputs":"fp16"})");
  EXPECT_EQ(c.apex.opt_level, "O2");
  EXPECT_EQ(c.apex.loss_scale, 128.0);
  EXPECT_EQ(c.apex.keep_batchnorm_fp32, false);
  EXPECT_EQ(c.apex.num_losses, 2);
  EXPECT_EQ(c.apex.max_loss_scale, 65536.0);
  EXPECT_EQ(c.apex.min_loss_scale, 0.25);
  EXPECT_EQ(c.apex.cast_model_outputs, DType::F16);
  EXPECT_TRUE(c.apex.master_weights);  // untouched properties keep O2's values
  const AmpConfig dynamic = AmpConfig::from_json(R"({"loss_scale":"dynamic"})", "fp16_apex:O3");
  EXPECT_FALSE(dynamic.apex.loss_scale.has_value());
}

TEST(AmpConfig, EveryInvalidScalerValueIsAnErrorAtConstruction) {
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"growth_factor":1})", "fp16"), "growth_factor", "> 1");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"backoff_factor":1})", "fp16"), "backoff_factor", "(0, 1)");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"backoff_factor":0})", "fp16_naive"), "backoff_factor");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"growth_interval":0})", "fp16"), "growth_interval");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"init_scale":-1})", "fp16"), "init_scale");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"hysteresis":0})", "fp16_naive"), "hysteresis", ">= 1");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"min_scale":8,"max_scale":4,"initial_scale":4})", "bf16_naive"),
                        "min_scale", "max_scale");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"growth_factor":0.5})", "fp16_naive"), "growth_factor");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"clip_grad":-1})", "fp16_naive"), "clip_grad");
  // bf16's disabled scaler is still checked when switched on.
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"enabled":true,"growth_factor":0.9})", "bf16"), "growth_factor");
}

TEST(AmpConfig, UnknownModesKeysAndTypesAreErrorsNamingThem) {
  EXPECT_ERROR_MENTIONS(AmpConfig::parse("fp8"), "unknown mixed_precision", "fp8", "fp16_naive");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"hysteresis":2})", "fp16"), "unknown option", "hysteresis",
                        "init_scale");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"init_scale":2})", "fp32"), "fp32 takes no options");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"enabled":"yes"})", "fp16"), "enabled", "true or false");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"growth_interval":1.5})", "fp16"), "growth_interval", "integer");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"mixed_precision":"bf16"})", "fp16"), "bf16", "fp16");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"init_scale":2})"), "no \"mixed_precision\"");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json("[1]"), "object");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json("{"), "json");
}

TEST(AmpConfig, JsonRoundTripsEveryModeWithItsOptions) {
  std::vector<AmpConfig> configs;
  for (const std::string& mode : AmpConfig::modes()) configs.push_back(AmpConfig::parse(mode));
  for (const char* level : {"fp16_apex:O0", "fp16_apex:O2", "fp16_apex:O3"}) configs.push_back(AmpConfig::parse(level));
  configs.push_back(AmpConfig::from_json(R"({"hysteresis":5,"initial_scale":1024,"verbose":true,"clip_grad":0.5})",
                                         "fp16_naive"));
  configs.push_back(AmpConfig::from_json(R"({"enabled":true,"init_scale":256})", "bf16"));
  for (const AmpConfig& c : configs) {
    const std::string text = c.to_json();
    const AmpConfig back = AmpConfig::from_json(text);
    EXPECT_EQ(back.to_json(), text);
    EXPECT_EQ(back.name(), c.name());
  }
  const AmpConfig naive = AmpConfig::from_json(configs[configs.size() - 2].to_json());
  EXPECT_EQ(naive.naive.scaler.hysteresis, 5);
  EXPECT_EQ(naive.naive.scaler.initial_scale, 1024.0);
  EXPECT_TRUE(naive.naive.verbose);
  EXPECT_EQ(naive.naive.clip_grad, 0.5);
}

TEST(AmpConfig, ModeFromTheCommandLineAndTheFileMustAgree) {
  const AmpConfig c = AmpConfig::from_json(R"({"mixed_precision":"fp16_apex","max_loss_scale":1024})", "fp16_apex:O2");
  EXPECT_EQ(c.apex.opt_level, "O2");  // the opt level of --precision is kept
  EXPECT_EQ(c.apex.max_loss_scale, 1024.0);
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"opt_level":"O3"})", "fp16_apex:O2"), "O3", "O2");
}

// The README's policy table is the printed one (so the documentation cannot drift from kAutocastTable).
TEST(AutocastPolicy, ReadmeShowsThePrintedTable) {
  std::ifstream file(std::string(MIXTAPE_SOURCE_DIR) + "/README.md");
  ASSERT_TRUE(file.good());
  std::stringstream text;
  text << file.rdbuf();
  const std::string table = autocast_policy_table_markdown();
  ASSERT_FALSE(table.empty());
  EXPECT_NE(text.str().find(table), std::string::npos) << "README.md lacks the table:\n" << table;
}
