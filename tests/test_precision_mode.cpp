// The precision-mode table (amp/precision_mode.h): the names users type, and that each row's columns are what
// AmpConfig accepts and what Booster does with a model.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "amp/booster.h"
#include "amp/precision_mode.h"
#include "nn/layers.h"
#include "optim/adam.h"
#include "tensor/precision.h"
#include "test_util.h"

using namespace mixtape;

namespace {

// Boosts a one-layer model in `mode` and returns it with its optimizer (the parameters as the mode left them).
struct Boosted {
  Linear model{4, 3, true, 1};
  Booster booster;
  std::unique_ptr<MixedPrecisionOptimizer> optimizer;
  explicit Boosted(const AmpConfig& config) : booster(config) {
    auto adamw = std::make_unique<AdamW>(std::vector<ParamGroup>{{model.parameters(), 1e-3, 0.0}}, AdamOptions{});
    optimizer = booster.boost(model, std::move(adamw));
  }
};

}  // namespace

TEST(PrecisionMode, TheNamesAreTheOnesTheDocumentationLists) {
  // README and amp/config.h list these modes, in this order; a renamed or reordered row must change them too.
  EXPECT_EQ(precision_mode_names(), (std::vector<std::string>{"fp32", "tf32", "fp16", "bf16", "fp16_apex",
                                                              "fp16_naive", "bf16_naive"}));
  EXPECT_EQ(precision_mode_names(kApexOptLevels),
            (std::vector<std::string>{"fp32", "tf32", "fp16", "bf16", "fp16_apex:O0", "fp16_apex:O1",
                                      "fp16_apex:O2", "fp16_apex:O3", "fp16_naive", "bf16_naive"}));
  EXPECT_EQ(precision_mode_list("|"), "fp32|tf32|fp16|bf16|fp16_apex[:O0..O3]|fp16_naive|bf16_naive");
  EXPECT_EQ(AmpConfig::modes(), precision_mode_names());
}

TEST(PrecisionMode, EveryRowParsesToItselfAndUnknownNamesAreNot) {
  std::set<std::string_view> seen;
  for (const PrecisionModeRow& row : kPrecisionModes) {
    EXPECT_TRUE(seen.insert(row.name).second) << row.name << " is in the table twice";
    ASSERT_EQ(find_precision_mode(row.name), row.mode);
    const AmpConfig config = AmpConfig::parse(row.name);
    EXPECT_EQ(config.mode, row.mode);
    EXPECT_EQ(&config.row(), &row);
    EXPECT_EQ(config.name(), row.family == ModeFamily::Apex ? std::string(row.name) + ":O1" : std::string(row.name));
  }
  for (const char* name : {"", "FP16", "fp16 ", "fp64", "fp16_apex:O1", "apex"})
    EXPECT_FALSE(find_precision_mode(name).has_value()) << name;
}

// A key outside a row's option_keys is "unknown" for that mode, and every key in it is known (its value
// may still be refused: null is the wrong type for most options, which is a different error).
TEST(PrecisionMode, TheOptionKeysAreExactlyWhatTheJsonFormAccepts) {
  std::set<std::string_view> every_key;
  for (const PrecisionModeRow& row : kPrecisionModes) every_key.insert(row.option_keys.begin(), row.option_keys.end());
  // 5 GradScaler + 11 Apex + 12 naive keys; growth_factor, backoff_factor and growth_interval are in two lists.
  EXPECT_EQ(every_key.size(), 25u);
  for (const PrecisionModeRow& row : kPrecisionModes)
    for (std::string_view key : every_key) {
      const bool listed = std::find(row.option_keys.begin(), row.option_keys.end(), key) != row.option_keys.end();
      const std::string json = "{\"mixed_precision\": \"" + std::string(row.name) + "\", \"" + std::string(key) +
                               "\": null}";
      std::string error;
      try {
        AmpConfig::from_json(json);
      } catch (const Error& e) {
        error = e.what();
      }
      EXPECT_EQ(error.find("unknown option") == std::string::npos, listed) << json << " -> " << error;
    }
}

// The columns Booster reads, checked on what it builds: the parameters' dtype after boost(), the scaler's
// kind, the autocast dtype of the forward and the tf32 switch.
TEST(PrecisionMode, BoosterDoesWhatTheRowSays) {
  for (const PrecisionModeRow& row : kPrecisionModes) {
    SCOPED_TRACE(std::string(row.name));
    set_allow_tf32(false);
    Boosted boosted(AmpConfig::parse(row.name));  // Apex at its default opt level, O1: autocast
    const bool model_cast = row.cast == ModeCast::WholeModel;
    EXPECT_EQ(boosted.model.weight.dtype(), model_cast ? row.compute_dtype : DType::F32);
    const bool autocast = row.cast == ModeCast::Autocast || row.cast == ModeCast::ByOptLevel;
    EXPECT_EQ(boosted.booster.config().autocast_dtype(), autocast ? std::optional(row.compute_dtype) : std::nullopt);
    EXPECT_EQ(allow_tf32(), row.tf32_matmuls);
    const LossScaler& scaler = boosted.optimizer->scaler();
    switch (row.scaler) {
      case ScalerKind::Static:
        EXPECT_NE(dynamic_cast<const StaticLossScaler*>(&scaler), nullptr);
        break;
      case ScalerKind::GradScaler:
        if (row.scaler_enabled) EXPECT_NE(dynamic_cast<const GradScaler*>(&scaler), nullptr);
        else EXPECT_NE(dynamic_cast<const StaticLossScaler*>(&scaler), nullptr);
        break;
      case ScalerKind::Apex:  // O1: dynamic, from 2^16
      case ScalerKind::Hysteresis:
        ASSERT_NE(dynamic_cast<const DynamicLossScaler*>(&scaler), nullptr);
        EXPECT_EQ(scaler.scale(), row.scaler == ScalerKind::Apex ? 65536.0 : 4294967296.0);
        break;
    }
  }
  set_allow_tf32(false);
}
