// The precision-mode table (amp/precision_mode.h): the names users type, and that each row's columns are what
// AmpConfig accepts and what Booster does with a model.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "amp/booster.h"
#include "amp/precision_mode.h"
#include "io/json.h"
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
  // README.md, docs/amp.md and amp/config.h list these modes, in this order; a renamed or reordered row must change them too.
  EXPECT_EQ(precision_mode_names(),
            (std::vector<std::string>{"fp32", "tf32", "fp16", "bf16", "fp16_apex", "fp16_naive", "bf16_naive", "fp8",
                                      "fp8_delayed", "fp8_rowwise", "fp8_block", "mxfp8", "nvfp4"}));
  EXPECT_EQ(precision_mode_names(kApexOptLevels),
            (std::vector<std::string>{"fp32", "tf32", "fp16", "bf16", "fp16_apex:O0", "fp16_apex:O1",
                                      "fp16_apex:O2", "fp16_apex:O3", "fp16_naive", "bf16_naive", "fp8",
                                      "fp8_delayed", "fp8_rowwise", "fp8_block", "mxfp8", "nvfp4"}));
  EXPECT_EQ(precision_mode_list("|"), "fp32|tf32|fp16|bf16|fp16_apex[:O0..O3]|fp16_naive|bf16_naive|fp8|"
                                      "fp8_delayed|fp8_rowwise|fp8_block|mxfp8|nvfp4");
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

// Each row's option keys and the keys every mode takes (kCommonAmpKeys) are the options to_json writes for
// that mode (Apex writes some only at some opt levels, so its keys are the union over O0..O3): the table and
// the writer list the same options.
TEST(PrecisionMode, TheOptionKeysAreTheOptionsToJsonWrites) {
  for (const PrecisionModeRow& row : kPrecisionModes) {
    SCOPED_TRACE(std::string(row.name));
    std::set<std::string> written;
    std::vector<std::string> names{std::string(row.name)};
    if (row.family == ModeFamily::Apex) {
      names.clear();
      for (std::string_view level : kApexOptLevels) names.push_back(std::string(row.name) + ":" + std::string(level));
    }
    for (const std::string& name : names) {
      const Json config = json::parse(AmpConfig::parse(name).to_json());
      for (const auto& [key, value] : json::as_object(config))
        if (key != "mixed_precision") written.insert(key);
    }
    std::set<std::string> expected(row.option_keys.begin(), row.option_keys.end());
    expected.insert(kCommonAmpKeys.begin(), kCommonAmpKeys.end());
    EXPECT_EQ(written, expected);
  }
}

// What Booster builds for each mode, as amp/config.h and docs/amp.md describe it: the parameters' dtype
// after boost(), the autocast dtype of the forward, the tf32 switch, the loss scaler and its first scale,
// and the master weights. One expectation per name users type, every mode of the table included.
TEST(PrecisionMode, BoosterDoesWhatEachModeIsDocumentedToDo) {
  enum class Scaler { Static, Grad, Dynamic };
  struct Expected {
    std::string name;
    DType params;
    std::optional<DType> autocast;
    bool tf32;
    Scaler scaler;
    double scale;
    bool master_weights;
  };
  const double two_32 = 4294967296.0;
  const std::vector<Expected> expected = {
      {"fp32", DType::F32, std::nullopt, false, Scaler::Static, 1, true},
      {"tf32", DType::F32, std::nullopt, true, Scaler::Static, 1, true},
      {"fp16", DType::F32, DType::F16, false, Scaler::Grad, 65536, true},
      {"bf16", DType::F32, DType::BF16, false, Scaler::Static, 1, true},  // GradScaler off by default
      {"fp16_apex:O0", DType::F32, std::nullopt, false, Scaler::Static, 1, false},
      {"fp16_apex:O1", DType::F32, DType::F16, false, Scaler::Dynamic, 65536, false},
      {"fp16_apex:O2", DType::F16, std::nullopt, false, Scaler::Dynamic, 65536, true},
      {"fp16_apex:O3", DType::F16, std::nullopt, false, Scaler::Static, 1, false},
      {"fp16_naive", DType::F16, std::nullopt, false, Scaler::Dynamic, two_32, true},
      {"bf16_naive", DType::BF16, std::nullopt, false, Scaler::Dynamic, two_32, true},
      // fp8 inside bf16 autocast, as Transformer Engine runs it: fp32 parameters, no loss scaling.
      {"fp8", DType::F32, DType::BF16, false, Scaler::Static, 1, true},
      {"fp8_delayed", DType::F32, DType::BF16, false, Scaler::Static, 1, true},
      {"fp8_rowwise", DType::F32, DType::BF16, false, Scaler::Static, 1, true},
      {"fp8_block", DType::F32, DType::BF16, false, Scaler::Static, 1, true},
      {"mxfp8", DType::F32, DType::BF16, false, Scaler::Static, 1, true},
      {"nvfp4", DType::F32, DType::BF16, false, Scaler::Static, 1, true},
  };
  std::vector<std::string> names;
  for (const Expected& e : expected) names.push_back(e.name);
  ASSERT_EQ(names, precision_mode_names(kApexOptLevels)) << "every mode of the table has its expectation here";
  for (const Expected& e : expected) {
    SCOPED_TRACE(e.name);
    set_allow_tf32(false);
    Boosted boosted(AmpConfig::parse(e.name));
    EXPECT_EQ(boosted.model.weight.dtype(), e.params);
    EXPECT_EQ(boosted.booster.config().autocast_dtype(), e.autocast);
    EXPECT_EQ(allow_tf32(), e.tf32);
    const LossScaler& scaler = boosted.optimizer->scaler();
    switch (e.scaler) {
      case Scaler::Static:
        EXPECT_NE(dynamic_cast<const StaticLossScaler*>(&scaler), nullptr);
        break;
      case Scaler::Grad:
        EXPECT_NE(dynamic_cast<const GradScaler*>(&scaler), nullptr);
        break;
      case Scaler::Dynamic:
        EXPECT_NE(dynamic_cast<const DynamicLossScaler*>(&scaler), nullptr);
        break;
    }
    EXPECT_EQ(scaler.scale(), e.scale);
    EXPECT_EQ(boosted.optimizer->options().master_weights, e.master_weights);
    // The fp8 / block-scaled modes quantize the Linear's GEMMs; no other mode has a GEMM recipe.
    const bool quantized = e.name.starts_with("fp8") || e.name == "mxfp8" || e.name == "nvfp4";
    ASSERT_EQ(boosted.booster.low_precision() != nullptr, quantized);
    if (quantized) {
      EXPECT_TRUE(boosted.booster.low_precision()->covers(boosted.model.weight));
    }
  }
  set_allow_tf32(false);
}
