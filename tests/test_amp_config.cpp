// AmpConfig (amp/config.h): the modes, their published defaults, Apex's property table and its refusals,
// JSON round trips and the errors for every invalid value.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

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
    EXPECT_FALSE(c.naive.verbose);  // Colossal-AI's DynamicGradScaler(verbose=False)
    EXPECT_FALSE(c.naive.accumulate_allreduce_grads_in_fp32);  // the model's dtype, as in Colossal-AI
    EXPECT_FALSE(c.fp32_grads());
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
  // What Apex accepts: O2 without the model cast (its master_weights then have nothing to keep), and O0
  // with master_weights.
  const AmpConfig uncast = AmpConfig::from_json(R"({"cast_model_type":false})", "fp16_apex:O2");
  EXPECT_TRUE(uncast.apex.master_weights);
  EXPECT_FALSE(uncast.model_dtype());
  EXPECT_TRUE(AmpConfig::from_json(R"({"master_weights":true})", "fp16_apex:O0").apex.master_weights);
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"patch_torch_functions":true})", "fp16_apex:O2"),
                        "patch_torch_functions", "O1");
  EXPECT_ERROR_MENTIONS(AmpConfig::parse("fp16_apex:O4"), "opt_level", "O4", "O0, O1, O2 or O3");
  EXPECT_ERROR_MENTIONS(AmpConfig::parse("fp16_apex:02"), "02", "the letter O");
  EXPECT_ERROR_MENTIONS(AmpConfig::parse("fp16:O2"), "only fp16_apex");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"loss_scale":"static"})", "fp16_apex:O2"), "loss_scale",
                        "dynamic");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"loss_scale":0})", "fp16_apex:O2"), "loss_scale");
  // Beyond fp32, where the loss is multiplied by it: every step would be skipped (Apex runs so silently).
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"loss_scale":1e39})", "fp16_apex:O2"), "loss_scale 1e+39",
                        "is not a usable loss scale");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"max_loss_scale":1e300})", "fp16_apex:O2"), "max_loss_scale",
                        "is not a usable loss scale");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"num_losses":0})", "fp16_apex:O2"), "num_losses");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"verbosity":3})", "fp16_apex:O2"), "verbosity");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"min_loss_scale":1e9})", "fp16_apex:O2"), "min_loss_scale",
                        "max_loss_scale");
}

TEST(AmpConfig, ApexNullIsNoOverrideAndKeepsTheOptLevelsValue) {
  // amp.initialize applies a property only when its kwarg is not None.
  const AmpConfig o2 = AmpConfig::from_json(
      R"({"keep_batchnorm_fp32": null, "master_weights": null, "cast_model_type": null})", "fp16_apex:O2");
  EXPECT_EQ(o2.apex.keep_batchnorm_fp32, true);
  EXPECT_TRUE(o2.apex.master_weights);
  EXPECT_EQ(o2.apex.cast_model_type, DType::F16);
  const AmpConfig o3 = AmpConfig::from_json(R"({"keep_batchnorm_fp32":null,"patch_torch_functions":null,
      "loss_scale":null,"cast_model_outputs":null,"min_loss_scale":null})", "fp16_apex:O3");
  EXPECT_EQ(o3.apex.keep_batchnorm_fp32, false);
  EXPECT_FALSE(o3.apex.patch_torch_functions);
  EXPECT_EQ(o3.apex.loss_scale, 1.0);
  EXPECT_FALSE(o3.apex.cast_model_outputs.has_value());
  EXPECT_FALSE(o3.apex.min_loss_scale.has_value());
  // The same nulls are no override for O1 either, so not a refused override.
  const AmpConfig o1 = AmpConfig::from_json(
      R"({"keep_batchnorm_fp32": null, "master_weights": null, "cast_model_type": null})", "fp16_apex:O1");
  EXPECT_FALSE(o1.apex.cast_model_type.has_value());
  EXPECT_FALSE(o1.apex.keep_batchnorm_fp32.has_value());
  EXPECT_FALSE(o1.apex.master_weights);
  // Properties Apex passes on as they are still need a value.
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"num_losses":null})", "fp16_apex:O2"), "num_losses", "null");
}

TEST(AmpConfig, ApexAcceptsWhatApexAccepts) {
  // Apex refuses a cast_model_type with O1 only if it is not torch.float32; false (Apex's False) is no cast.
  const AmpConfig o1 = AmpConfig::from_json(R"({"cast_model_type":"fp32"})", "fp16_apex:O1");
  EXPECT_EQ(o1.apex.cast_model_type, DType::F32);
  EXPECT_EQ(o1.model_dtype(), DType::F32);
  EXPECT_EQ(o1.autocast_dtype(), DType::F16);
  EXPECT_FALSE(AmpConfig::from_json(R"({"cast_model_type":false})", "fp16_apex:O1").apex.cast_model_type);
  EXPECT_FALSE(AmpConfig::from_json(R"({"cast_model_type":false})", "fp16_apex:O3").model_dtype());
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"cast_model_type":"bf16"})", "fp16_apex:O1"), "O1",
                        "cast_model_type", "\"bf16\"");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"cast_model_type":true})", "fp16_apex:O2"),
                        "cast_model_type", "true");
  // loss_scale: Apex's float(value) of anything but "dynamic".
  EXPECT_EQ(AmpConfig::from_json(R"({"loss_scale":"128.0"})", "fp16_apex:O2").apex.loss_scale, 128.0);
  EXPECT_EQ(AmpConfig::from_json(R"({"loss_scale":" 1e3 "})", "fp16_apex:O1").apex.loss_scale, 1000.0);
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"loss_scale":"128x"})", "fp16_apex:O2"), "loss_scale",
                        "\"128x\"", "numeric string");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"loss_scale":"0x10"})", "fp16_apex:O2"), "loss_scale");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"loss_scale":"inf"})", "fp16_apex:O2"), "loss_scale",
                        "finite");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"loss_scale":""})", "fp16_apex:O2"), "loss_scale");
  // verbosity 0-2 (Apex's range; 2 is Apex's most verbose level, whose meaning here is our own), nothing
  // above or below.
  EXPECT_EQ(AmpConfig::from_json(R"({"verbosity":2})", "fp16_apex:O2").apex.verbosity, 2);
  EXPECT_EQ(AmpConfig::from_json(R"({"verbosity":0})", "fp16_apex:O2").apex.verbosity, 0);
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"verbosity":-1})", "fp16_apex:O2"), "verbosity", "-1", "0",
                        "2");
}

TEST(AmpConfig, ApexO0IsFp32) {
  for (const char* dtype : {"fp16", "bf16"}) {
    EXPECT_ERROR_MENTIONS(AmpConfig::from_json(std::string(R"({"cast_model_type":")") + dtype + "\"}",
                                               "fp16_apex:O0"),
                          "O0", "cast_model_type", std::string("\"") + dtype + "\"", "fp32");
  }
  EXPECT_EQ(AmpConfig::from_json(R"({"cast_model_type":"fp32"})", "fp16_apex:O0").model_dtype(), DType::F32);
  // false: no cast at all, as Apex installs no input/output casters without a cast_model_type (an f64 input
  // stays f64).
  const AmpConfig unset = AmpConfig::from_json(R"({"cast_model_type":false})", "fp16_apex:O0");
  EXPECT_FALSE(unset.apex.cast_model_type.has_value());
  EXPECT_FALSE(unset.model_dtype().has_value());
}

TEST(AmpConfig, ApexNumLossesHasAnUpperBound) {
  EXPECT_EQ(AmpConfig::from_json(R"({"num_losses":1024})", "fp16_apex:O2").apex.num_losses, 1024);
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"num_losses":1025})", "fp16_apex:O2"), "num_losses", "1025",
                        "1024");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"num_losses":1e12})", "fp16_apex:O2"), "num_losses");
}

TEST(AmpConfig, DynamicScaleBoundsWithAStaticLossScaleAreAnError) {
  // O0 and O3 are static (1.0), as is any numeric loss_scale: nothing would ever read the bounds.
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"max_loss_scale":1024})", "fp16_apex:O3"), "max_loss_scale",
                        "only with loss_scale \"dynamic\"", "O3");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"min_loss_scale":1})", "fp16_apex:O0"), "min_loss_scale",
                        "dynamic");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"loss_scale":128,"min_loss_scale":1})", "fp16_apex:O2"),
                        "min_loss_scale", "static loss_scale 128");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"max_loss_scale":16777216})", "fp16_apex:O3"),
                        "max_loss_scale");
  // With loss_scale "dynamic" they apply, whatever the order of the keys.
  const AmpConfig dynamic = AmpConfig::from_json(
      R"({"max_loss_scale":1024,"loss_scale":"dynamic","min_loss_scale":2})", "fp16_apex:O3");
  EXPECT_EQ(dynamic.apex.max_loss_scale, 1024.0);
  EXPECT_EQ(dynamic.apex.min_loss_scale, 2.0);
  // Set in code: validate() says so too.
  AmpConfig code = AmpConfig::parse("fp16_apex:O0");
  code.apex.max_loss_scale = 4096;
  EXPECT_ERROR_MENTIONS(code.validate(), "max_loss_scale", "dynamic");
  code.apex.max_loss_scale = ApexProperties::kDefaultMaxLossScale;
  code.apex.min_loss_scale = 4;
  EXPECT_ERROR_MENTIONS(code.validate(), "min_loss_scale", "dynamic");
}

TEST(AmpConfig, AMinLossScaleAboveTheInitialScaleIsAcceptedOrAnErrorNamingIt) {
  // Apex starts at min(2^16, max_loss_scale): a floor above that is either accepted (current Apex starts
  // below it) or refused naming min_loss_scale, never with the scaler's internal option names alone.
  try {
    const AmpConfig c = AmpConfig::from_json(R"({"min_loss_scale":131072})", "fp16_apex:O2");
    EXPECT_EQ(c.apex.min_loss_scale, 131072.0);
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("min_loss_scale"), std::string::npos) << error.what();
    EXPECT_NE(std::string(error.what()).find("AmpConfig fp16_apex"), std::string::npos) << error.what();
  }
}

TEST(AmpConfig, ApexPropertiesCanBeOverriddenAsInAmpInitialize) {
  const AmpConfig c = AmpConfig::from_json(
      R"({"mixed_precision":"fp16_apex","opt_level":"O2","loss_scale":128,"keep_batchnorm_fp32":"False",
          "num_losses":2,"cast_model_outputs":"fp16"})");
  EXPECT_EQ(c.apex.opt_level, "O2");
  EXPECT_EQ(c.apex.loss_scale, 128.0);
  EXPECT_EQ(c.apex.keep_batchnorm_fp32, false);
  EXPECT_EQ(c.apex.num_losses, 2);
  EXPECT_EQ(c.apex.cast_model_outputs, DType::F16);
  EXPECT_TRUE(c.apex.master_weights);  // untouched properties keep O2's values
  const AmpConfig bounds =
      AmpConfig::from_json(R"({"max_loss_scale":65536,"min_loss_scale":0.25})", "fp16_apex:O2");
  EXPECT_EQ(bounds.apex.max_loss_scale, 65536.0);
  EXPECT_EQ(bounds.apex.min_loss_scale, 0.25);
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

TEST(AmpConfig, GradScalerOptionsAreCheckedWhetherOrNotTheScalerIsOn) {
  // An invalid value is wrong even while the scaler is off (bf16's default, or enabled false).
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"growth_factor":0.9})", "bf16"), "AmpConfig bf16",
                        "growth_factor", "0.9");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"enabled":false,"backoff_factor":2})", "fp16"),
                        "AmpConfig fp16", "backoff_factor");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"enabled":false,"growth_interval":0})", "fp16"),
                        "growth_interval");
  AmpConfig config = AmpConfig::parse("bf16");
  config.grad_scaler.init_scale = -1;
  EXPECT_ERROR_MENTIONS(config.validate(), "init_scale", "-1");
  EXPECT_NO_THROW(AmpConfig::from_json(R"({"enabled":false,"init_scale":1024})", "fp16"));
}

TEST(AmpConfig, UnknownModesKeysAndTypesAreErrorsNamingThem) {
  EXPECT_ERROR_MENTIONS(AmpConfig::parse("fp6"), "unknown mixed_precision", "fp6", "fp16_naive", "nvfp4");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"hysteresis":2})", "fp16"), "unknown option", "hysteresis",
                        "init_scale");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"init_scale":2})", "fp32"), "fp32 takes no options");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"enabled":"yes"})", "fp16"), "enabled", "true or false");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"growth_interval":1.5})", "fp16"), "growth_interval", "integer");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"mixed_precision":"bf16"})", "fp16"), "bf16", "fp16");
  // Every key is checked against the mode before any value is read.
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"opt_level":5})", "fp16"), "AmpConfig fp16",
                        "unknown option", "opt_level", "init_scale");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"opt_level":"O2"})", "bf16_naive"), "unknown option",
                        "opt_level");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"opt_level":5})", "fp16_apex"), "opt_level", "string");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"init_scale":2})"), "no \"mixed_precision\"");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json("[1]"), "object");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json("{"), "json");
}

TEST(AmpConfig, JsonRoundTripsEveryModeWithItsOptions) {
  std::vector<AmpConfig> configs;
  for (const std::string& mode : AmpConfig::modes()) configs.push_back(AmpConfig::parse(mode));
  for (const char* level : {"fp16_apex:O0", "fp16_apex:O2", "fp16_apex:O3"}) configs.push_back(AmpConfig::parse(level));
  const size_t naive_index = configs.size();
  configs.push_back(AmpConfig::from_json(R"({"hysteresis":5,"initial_scale":1024,"verbose":true,)"
                                         R"("clip_grad":0.5,"accumulate_allreduce_grads_in_fp32":true})",
                                         "fp16_naive"));
  configs.push_back(AmpConfig::from_json(R"({"enabled":true,"init_scale":256})", "bf16"));
  configs.push_back(AmpConfig::from_json(R"({"cast_model_type":"fp32","verbosity":2})", "fp16_apex:O1"));
  configs.push_back(AmpConfig::from_json(
      R"({"cast_model_type":false,"min_loss_scale":4,"loss_scale":"dynamic"})", "fp16_apex:O3"));
  for (const AmpConfig& c : configs) {
    const std::string text = c.to_json();
    const AmpConfig back = AmpConfig::from_json(text);
    EXPECT_EQ(back.to_json(), text);
    EXPECT_EQ(back.name(), c.name());
  }
  const AmpConfig naive = AmpConfig::from_json(configs[naive_index].to_json());
  EXPECT_EQ(naive.naive.scaler.hysteresis, 5);
  EXPECT_EQ(naive.naive.scaler.initial_scale, 1024.0);
  EXPECT_TRUE(naive.naive.verbose);
  EXPECT_EQ(naive.naive.clip_grad, 0.5);
  EXPECT_TRUE(naive.naive.accumulate_allreduce_grads_in_fp32);
  EXPECT_TRUE(naive.fp32_grads());
  // Apex: fp32 gradients wherever a 16-bit model keeps master weights (amp/config.h).
  EXPECT_TRUE(AmpConfig::parse("fp16_apex:O2").fp32_grads());
  EXPECT_FALSE(AmpConfig::parse("fp16_apex:O3").fp32_grads());
  EXPECT_FALSE(AmpConfig::from_json(R"({"master_weights":true})", "fp16_apex:O0").fp32_grads());  // fp32
  EXPECT_FALSE(AmpConfig::from_json(R"({"cast_model_type":false})", "fp16_apex:O2").fp32_grads());
  // Unset properties that the opt level sets come back unset in behaviour (null would mean "O2's value").
  AmpConfig o2 = AmpConfig::parse("fp16_apex:O2");
  o2.apex.keep_batchnorm_fp32.reset();
  EXPECT_EQ(AmpConfig::from_json(o2.to_json()).apex.keep_batchnorm_fp32.value_or(false), false);
  AmpConfig o3 = AmpConfig::parse("fp16_apex:O3");
  o3.apex.cast_model_type.reset();
  EXPECT_FALSE(AmpConfig::from_json(o3.to_json()).apex.cast_model_type.has_value());
  EXPECT_EQ(AmpConfig::from_json(configs[naive_index + 2].to_json()).apex.cast_model_type, DType::F32);
}

TEST(AmpConfig, ModeFromTheCommandLineAndTheFileMustAgree) {
  const AmpConfig c = AmpConfig::from_json(R"({"mixed_precision":"fp16_apex","max_loss_scale":1024})", "fp16_apex:O2");
  EXPECT_EQ(c.apex.opt_level, "O2");  // the opt level of --precision is kept
  EXPECT_EQ(c.apex.max_loss_scale, 1024.0);
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(R"({"opt_level":"O3"})", "fp16_apex:O2"), "O3", "O2");
}

// The PyTorch AMP policy table of docs/amp.md is the printed one (so the documentation cannot drift from
// kPytorchAutocastPolicy).
TEST(AutocastPolicy, DocsShowThePrintedTable) {
  std::ifstream file(std::string(MIXTAPE_SOURCE_DIR) + "/docs/amp.md");
  ASSERT_TRUE(file.good());
  std::stringstream text;
  text << file.rdbuf();
  for (const AutocastPolicyTable* policy : {&kPytorchAutocastPolicy, &kApexO1AutocastPolicy}) {
    const std::string table = autocast_policy_table_markdown(*policy);
    ASSERT_FALSE(table.empty());
    EXPECT_NE(text.str().find(table), std::string::npos) << "docs/amp.md lacks " << policy->framework << "'s table:\n"
                                                         << table;
  }
}

TEST(AmpConfig, TrainingDifferencesNameWhatChangesTrainingAndIgnoreWhatOnlyPrints) {
  const AmpConfig naive = AmpConfig::parse("fp16_naive");
  EXPECT_EQ(naive.training_differences(naive), "");
  // verbose and log_num_zeros_in_grad (naive) and verbosity (Apex) change only what is printed.
  EXPECT_EQ(AmpConfig::from_json(R"({"verbose":true,"log_num_zeros_in_grad":true})", "fp16_naive")
                .training_differences(naive),
            "");
  EXPECT_EQ(AmpConfig::from_json(R"({"verbosity":0})", "fp16_apex:O2")
                .training_differences(AmpConfig::parse("fp16_apex:O2")),
            "");
  EXPECT_EQ(AmpConfig::from_json(R"({"hysteresis":3,"growth_interval":10,"verbose":true})", "fp16_naive")
                .training_differences(naive, "the checkpoint's"),
            "growth_interval 10 (the checkpoint's 1000), hysteresis 3 (the checkpoint's 2)");
  // Where the micro-batches' gradients add up changes the training.
  EXPECT_EQ(AmpConfig::from_json(R"({"accumulate_allreduce_grads_in_fp32":true})", "bf16_naive")
                .training_differences(AmpConfig::parse("bf16_naive"), "the checkpoint's"),
            "accumulate_allreduce_grads_in_fp32 true (the checkpoint's false)");
  // Another mode or opt level is one difference.
  EXPECT_EQ(AmpConfig::parse("bf16_naive").training_differences(naive, "the checkpoint's"),
            "mode bf16_naive (the checkpoint's fp16_naive)");
  EXPECT_EQ(AmpConfig::parse("fp16_apex:O1").training_differences(AmpConfig::parse("fp16_apex:O2")),
            "mode fp16_apex:O1 (the other's fp16_apex:O2)");
  // An option only one side writes (Apex's loss-scale bounds exist with a dynamic scale only).
  EXPECT_EQ(AmpConfig::from_json(R"({"loss_scale":128})", "fp16_apex:O2")
                .training_differences(AmpConfig::parse("fp16_apex:O2"), "the checkpoint's"),
            "loss_scale 128 (the checkpoint's \"dynamic\"), min_loss_scale (not an option of fp16_apex:O2) "
            "(the checkpoint's null), max_loss_scale (not an option of fp16_apex:O2) (the checkpoint's "
            "16777216)");
}

// validate() (Booster(AmpConfig) from C++) refuses what the JSON form refuses: a cast_model_type other than
// fp32/fp16/bf16 would cast the model to fp16 while inputs went to that dtype, a cast_model_outputs of an
// integer dtype would turn the loss into integers, and O1 refuses keep_batchnorm_fp32 as Apex does.
TEST(AmpConfig, ValidateRefusesDtypesAndOverridesTheJsonFormRefuses) {
  AmpConfig c = AmpConfig::parse("fp16_apex:O2");
  c.apex.cast_model_type = DType::F64;
  EXPECT_ERROR_MENTIONS(c.validate(), "cast_model_type must be fp32, fp16 or bf16", "f64");
  c = AmpConfig::parse("fp16_apex:O2");
  c.apex.cast_model_outputs = DType::I64;
  EXPECT_ERROR_MENTIONS(c.validate(), "cast_model_outputs must be fp32, fp16 or bf16", "i64");
  c = AmpConfig::parse("fp16_apex:O1");
  c.apex.keep_batchnorm_fp32 = false;
  EXPECT_ERROR_MENTIONS(c.validate(), "O1", "keep_batchnorm_fp32 must be unset");
  c = AmpConfig::parse("fp16_apex:O2");
  c.apex.cast_model_type = DType::BF16;
  c.apex.cast_model_outputs = DType::F16;
  c.validate();  // accepted
}

// ---- every option that sets a loss scale is a usable scale ----
// The loss is multiplied by the scale and the gradients by its reciprocal in fp32: the smallest usable scale
// is the smallest float whose fp32 reciprocal is finite, 2^-128 + 2^-149 (1/2^-128 = 2^128 overflows), the
// largest FLT_MAX. Their shortest decimal texts, and the float just below the smallest (2^-128):
namespace {
constexpr const char* kLowest = "2.938737278354183e-39";
constexpr const char* kBelowLowest = "2.938735877055719e-39";
constexpr const char* kFltMax = "3.4028234663852886e+38";
constexpr const char* kAboveFp32 = "3.4028235677973366e+38";  // 2^128 - 2^103: rounds to inf in fp32

// `fields` with each "%" replaced by `value`, as a JSON object's body.
std::string with(const std::string& fields, const std::string& value) {
  std::string out = "{" + fields + "}";
  for (size_t at = out.find('%'); at != std::string::npos; at = out.find('%', at + value.size()))
    out.replace(at, 1, value);
  return out;
}

struct ScaleOption {
  std::string mode;    // the --precision
  std::string key;     // the option named in the error
  std::string fields;  // the JSON options, "%" the scale under test
};

const std::vector<ScaleOption>& scale_options() {
  static const std::vector<ScaleOption> options = {
      {"fp16", "init_scale", R"("init_scale": %)"},
      {"bf16", "init_scale", R"("init_scale": %)"},  // checked with the GradScaler off too
      {"fp16_apex:O3", "loss_scale", R"("loss_scale": %)"},
      {"fp16_apex:O2", "loss_scale", R"("loss_scale": "%")"},  // Apex's float() of a string
      {"fp16_apex:O2", "min_loss_scale", R"("min_loss_scale": %, "max_loss_scale": 16777216)"},
      {"fp16_apex:O2", "max_loss_scale", R"("max_loss_scale": %)"},
      {"fp16_naive", "initial_scale", R"("initial_scale": %, "min_scale": 2.938737278354183e-39)"},
      {"fp16_naive", "min_scale", R"("initial_scale": 1, "min_scale": %)"},
      {"bf16_naive", "max_scale", R"("initial_scale": 2.938737278354183e-39, "min_scale": 2.938737278354183e-39,
                                     "max_scale": %)"},
  };
  return options;
}
}  // namespace

TEST(AmpConfig, EveryScaleOptionAcceptsTheSmallestScaleWithAFiniteFp32Reciprocal) {
  ASSERT_EQ(std::stod(kLowest), std::ldexp(1.0, -128) + std::ldexp(1.0, -149));
  for (const ScaleOption& o : scale_options()) {
    SCOPED_TRACE(o.mode + " " + o.key);
    EXPECT_NO_THROW(AmpConfig::from_json(with(o.fields, kLowest), o.mode));
  }
}

TEST(AmpConfig, EveryScaleOptionRefusesTheFloatBelowItNamingTheOptionAndTheBound) {
  ASSERT_EQ(std::stod(kBelowLowest), std::ldexp(1.0, -128));
  for (const ScaleOption& o : scale_options()) {
    SCOPED_TRACE(o.mode + " " + o.key);
    for (const std::string& value : {std::string(kBelowLowest), std::string("1e-45")}) {
      const std::string family = o.mode.substr(0, o.mode.find(':'));
      EXPECT_ERROR_MENTIONS(AmpConfig::from_json(with(o.fields, value), o.mode),
                            "AmpConfig " + family + ": " + o.key + " " + value + " is not a usable loss scale",
                            "whose fp32 reciprocal is finite (>= 2.938737278354183e-39",
                            std::string("<= ") + kFltMax);
    }
  }
}

TEST(AmpConfig, ScaleOptionsAreFiniteInFp32) {
  ASSERT_EQ(std::stod(kFltMax), static_cast<double>(std::numeric_limits<float>::max()));
  ASSERT_EQ(std::stod(kAboveFp32), std::ldexp(1.0, 128) - std::ldexp(1.0, 103));
  EXPECT_NO_THROW(AmpConfig::from_json(with(R"("init_scale": %)", kFltMax), "fp16"));
  EXPECT_NO_THROW(AmpConfig::from_json(with(R"("loss_scale": %)", kFltMax), "fp16_apex:O3"));
  EXPECT_NO_THROW(AmpConfig::from_json(with(R"("max_loss_scale": %)", kFltMax), "fp16_apex:O2"));
  EXPECT_NO_THROW(AmpConfig::from_json(with(R"("initial_scale": %, "max_scale": %)", kFltMax), "fp16_naive"));
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(with(R"("init_scale": %)", kAboveFp32), "fp16"),
                        std::string("AmpConfig fp16: init_scale ") + kAboveFp32 + " is not a usable loss scale");
  EXPECT_ERROR_MENTIONS(AmpConfig::from_json(with(R"("max_scale": %)", kAboveFp32), "fp16_naive"),
                        std::string("AmpConfig fp16_naive: max_scale ") + kAboveFp32);
}

// fp8_communication is an option of every mode (Colossal-AI's Booster takes it beside any mixed_precision):
// off by default, read back by to_json, a difference a resumed run may not make, and a boolean only.
TEST(AmpConfig, Fp8CommunicationIsABooleanOptionOfEveryMode) {
  for (const std::string& mode : AmpConfig::modes()) {
    EXPECT_FALSE(AmpConfig::parse(mode).fp8_communication) << mode;
    const AmpConfig on = AmpConfig::from_json(R"({"fp8_communication": true})", mode);
    EXPECT_TRUE(on.fp8_communication) << mode;
    EXPECT_TRUE(AmpConfig::from_json(on.to_json()).fp8_communication) << mode;
    EXPECT_EQ(on.training_differences(AmpConfig::parse(mode), "the checkpoint's"),
              "fp8_communication true (the checkpoint's false)")
        << mode;
  }
  try {
    AmpConfig::from_json(R"({"fp8_communication": 1})", "bf16");
    ADD_FAILURE() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fp8_communication must be true or false, got"), std::string::npos)
        << e.what();
  }
}
