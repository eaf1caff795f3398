// Each precision-mode family's autocast policy: PyTorch AMP (fp16, bf16) casts by PyTorch's CUDA autocast
// lists, Apex O1 by Apex's override lists, the naive and plain modes autocast nothing. The expected classes
// below are data read from the frameworks' source files, not from mixtape's tables.
#include <gtest/gtest.h>

#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "amp/autocast.h"
#include "amp/booster.h"
#include "amp/policy.h"
#include "nn/layers.h"
#include "optim/adam.h"
#include "tensor/ops.h"
#include "tensor/precision.h"
#include "tests/test_util.h"

namespace mixtape {
namespace {

struct Listed {
  OpPolicy policy;
  std::string list;  // the source's list, as the table's "listed as" column names it
};
using Expected = std::map<std::string, Listed>;

// PyTorch's CUDA autocast: aten/src/ATen/autocast_mode.h (PyTorch 2.x main), its op lists
// AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE,
// AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE (norm: fp32_append_dtype) and AT_FORALL_PROMOTE, which
// aten/src/ATen/autocast_mode.cpp registers for AutocastCUDA.
//   lower_precision_fp: matmul, bmm, linear, scaled_dot_product_attention (nanoGPT's causal attention is sdpa)
//   fp32: exp, log, rsqrt, pow (Tensor_Scalar, Tensor_Tensor, Scalar), layer_norm, rms_norm (main; absent
//         from the earlier 2.x releases), nll_loss (cross_entropy = log_softmax + nll_loss)
//   fp32_set_opt_dtype: softmax, log_softmax, sum;  fp32_append_dtype: norm
//   promote: addcdiv, addcmul, atan2, bilinear, cross, dot, vdot, grid_sampler, index_put, tensordot,
//            scatter_add (none of them a mixtape op)
//   in no list: mean, var, add, sub, mul, div, cat, stack, where
const Expected kPytorchLists = {
    {"matmul", {OpPolicy::LowerPrecision, "lower_precision_fp"}},
    {"linear", {OpPolicy::LowerPrecision, "lower_precision_fp"}},
    {"scaled_dot_product_attention", {OpPolicy::LowerPrecision, "lower_precision_fp"}},
    {"causal_self_attention", {OpPolicy::LowerPrecision, "lower_precision_fp"}},
    {"softmax", {OpPolicy::Fp32, "fp32_set_opt_dtype"}},
    {"log_softmax", {OpPolicy::Fp32, "fp32_set_opt_dtype"}},
    {"softmax_cross_entropy", {OpPolicy::Fp32, "fp32 (nll_loss)"}},
    {"layer_norm", {OpPolicy::Fp32, "fp32"}},
    {"rms_norm", {OpPolicy::Fp32, "fp32"}},
    {"exp", {OpPolicy::Fp32, "fp32"}},
    {"log", {OpPolicy::Fp32, "fp32"}},
    {"rsqrt", {OpPolicy::Fp32, "fp32"}},
    {"pow", {OpPolicy::Fp32, "fp32"}},
    {"sum", {OpPolicy::Fp32, "fp32_set_opt_dtype"}},
    {"norm", {OpPolicy::Fp32, "fp32_append_dtype"}},
    {"mean", {OpPolicy::Unlisted, "not listed"}},
    {"var", {OpPolicy::Unlisted, "not listed"}},
    {"add", {OpPolicy::Unlisted, "not listed"}},
    {"sub", {OpPolicy::Unlisted, "not listed"}},
    {"mul", {OpPolicy::Unlisted, "not listed"}},
    {"div", {OpPolicy::Unlisted, "not listed"}},
    {"cat", {OpPolicy::Unlisted, "not listed"}},
    {"stack", {OpPolicy::Unlisted, "not listed"}},
    {"where", {OpPolicy::Unlisted, "not listed"}},
};

// NVIDIA Apex amp O1 (NVIDIA/apex master): apex/amp/lists/functional_overrides.py (torch.nn.functional),
// torch_overrides.py (torch) and tensor_overrides.py (torch.Tensor).
//   functional FP16_FUNCS: linear;  functional FP32_FUNCS: softmax, log_softmax, layer_norm, cross_entropy
//   torch FP16_FUNCS: matmul (bmm too, CUDA >= 9.1);  torch FP32_FUNCS: exp, log, rsqrt, pow, sum, norm, var
//     ('mean' is commented out there: appended only for torch < 1.1)
//   torch CASTS: add, div, mul;  tensor CASTS: __sub__, __rsub__, __isub__ (and the other operators)
//   torch SEQUENCE_CASTS: cat, stack
//   in no list: scaled_dot_product_attention, rms_norm, where, mean, gelu
const Expected kApexO1Lists = {
    {"matmul", {OpPolicy::LowerPrecision, "torch FP16_FUNCS"}},
    {"linear", {OpPolicy::LowerPrecision, "functional FP16_FUNCS"}},
    {"scaled_dot_product_attention", {OpPolicy::Unlisted, "not listed"}},
    {"causal_self_attention", {OpPolicy::Unlisted, "not listed"}},
    {"softmax", {OpPolicy::Fp32, "functional FP32_FUNCS"}},
    {"log_softmax", {OpPolicy::Fp32, "functional FP32_FUNCS"}},
    {"softmax_cross_entropy", {OpPolicy::Fp32, "functional FP32_FUNCS"}},
    {"layer_norm", {OpPolicy::Fp32, "functional FP32_FUNCS"}},
    {"rms_norm", {OpPolicy::Unlisted, "not listed"}},
    {"exp", {OpPolicy::Fp32, "torch FP32_FUNCS"}},
    {"log", {OpPolicy::Fp32, "torch FP32_FUNCS"}},
    {"rsqrt", {OpPolicy::Fp32, "torch FP32_FUNCS"}},
    {"pow", {OpPolicy::Fp32, "torch FP32_FUNCS"}},
    {"sum", {OpPolicy::Fp32, "torch FP32_FUNCS"}},
    {"mean", {OpPolicy::Unlisted, "not listed"}},
    {"norm", {OpPolicy::Fp32, "torch FP32_FUNCS"}},
    {"var", {OpPolicy::Fp32, "torch FP32_FUNCS"}},
    {"add", {OpPolicy::Promote, "torch CASTS"}},
    {"sub", {OpPolicy::Promote, "tensor CASTS (__sub__)"}},
    {"mul", {OpPolicy::Promote, "torch CASTS"}},
    {"div", {OpPolicy::Promote, "torch CASTS"}},
    {"cat", {OpPolicy::Promote, "SEQUENCE_CASTS"}},
    {"stack", {OpPolicy::Promote, "SEQUENCE_CASTS"}},
    {"where", {OpPolicy::Unlisted, "not listed"}},
};

void expect_table_is(const AutocastPolicyTable& table, const Expected& expected) {
  EXPECT_EQ(table.rows.size(), expected.size()) << "every mixtape op that autocast casts has an expected class";
  for (const AutocastTableEntry& row : table.rows) {
    const auto found = expected.find(row.name);
    ASSERT_NE(found, expected.end()) << row.name << " has no expected class from the source";
    EXPECT_EQ(policy_name(row.policy), policy_name(found->second.policy)) << row.name;
    EXPECT_EQ(row.listed_as, found->second.list) << row.name;
    EXPECT_EQ(autocast_policy(table, row.name), found->second.policy) << row.name;
  }
  EXPECT_EQ(autocast_policy(table, "gelu"), std::nullopt);  // gelu is in neither framework's lists
}

TEST(AutocastPolicy, PytorchAmpCastsByPytorchsCudaLists) { expect_table_is(kPytorchAutocastPolicy, kPytorchLists); }

TEST(AutocastPolicy, ApexO1CastsByApexsOverrideLists) { expect_table_is(kApexO1AutocastPolicy, kApexO1Lists); }

TEST(AutocastPolicy, EachModeNamesItsFamilysTable) {
  for (const char* mode : {"fp16", "bf16"})
    EXPECT_EQ(AmpConfig::parse(mode).row().autocast_policy, &kPytorchAutocastPolicy) << mode;
  EXPECT_EQ(AmpConfig::parse("fp16_apex").row().autocast_policy, &kApexO1AutocastPolicy);
  for (const char* mode : {"fp32", "tf32", "fp16_naive", "bf16_naive"})
    EXPECT_EQ(AmpConfig::parse(mode).row().autocast_policy, nullptr) << mode;
}

// ---- what the ops return under each table ----

TEST(AutocastPolicy, MeanAndVarRunInTheirInputDtypeUnderPytorchsTable) {
  // PyTorch lists neither: torch.mean / torch.var under autocast return the input's dtype.
  for (DType low : {DType::F16, DType::BF16}) {
    Autocast guard(low);
    for (DType in : {DType::F32, low}) {
      const Tensor x = Tensor::randn({3, 8}, 1, in);
      EXPECT_EQ(mean(x, {1}).dtype(), in) << dtype_name(low) << " " << dtype_name(in);
      EXPECT_EQ(var(x, {1}).dtype(), in) << dtype_name(low) << " " << dtype_name(in);
    }
    // sum is listed (fp32_set_opt_dtype): f32 whatever the input.
    EXPECT_EQ(sum(Tensor::randn({3, 8}, 2, low)).dtype(), DType::F32);
  }
}

TEST(AutocastPolicy, ApexO1CastsByItsOwnLists) {
  Autocast guard(DType::F16, kApexO1AutocastPolicy);
  EXPECT_EQ(&Autocast::table(), &kApexO1AutocastPolicy);
  const Tensor h = Tensor::randn({3, 8}, 3, DType::F16), f = Tensor::randn({3, 8}, 4);
  EXPECT_EQ(var(h, {1}).dtype(), DType::F32);   // torch FP32_FUNCS
  EXPECT_EQ(sum(h).dtype(), DType::F32);        // torch FP32_FUNCS
  EXPECT_EQ(mean(h, {1}).dtype(), DType::F16);  // not listed (torch >= 1.1)
  EXPECT_EQ(mean(f, {1}).dtype(), DType::F32);
  EXPECT_EQ(gelu(h).dtype(), DType::F16);       // not listed
  EXPECT_EQ(rms_norm(h, Tensor::ones({8}, DType::F16)).out.dtype(), DType::F16);  // not listed
  EXPECT_EQ(layer_norm(h, Tensor::ones({8}), Tensor::zeros({8})).out.dtype(), DType::F32);
  EXPECT_EQ(matmul(f, Tensor::randn({8, 2}, 5)).dtype(), DType::F16);  // FP16_FUNCS
  EXPECT_EQ(add(h, f).dtype(), DType::F32);                            // CASTS: the widest
  EXPECT_EQ(cat({h, f}, 0).dtype(), DType::F32);                       // SEQUENCE_CASTS
  // scaled_dot_product_attention is in no Apex list: f32 inputs stay f32 (PyTorch's table gives f16).
  const Tensor q = Tensor::randn({1, 2, 4, 8}, 6);
  EXPECT_EQ(scaled_dot_product_attention(q, q, q).dtype(), DType::F32);
  {
    Autocast pytorch(DType::F16);
    EXPECT_EQ(&Autocast::table(), &kPytorchAutocastPolicy);
    EXPECT_EQ(scaled_dot_product_attention(q, q, q).dtype(), DType::F16);
    EXPECT_EQ(var(h, {1}).dtype(), DType::F16);
  }
  EXPECT_EQ(&Autocast::table(), &kApexO1AutocastPolicy) << "a scope restores the table it found";
}

TEST(AutocastPolicy, TheCastCacheServesEveryTableTheSameCast) {
  // A weight cast to f16 under one table is the same f16 tensor under the other: the cache is keyed by the
  // weight and the target dtype, and a cast made for one dtype is never returned for another.
  Tensor w = Tensor::randn({8, 2}, 7);
  w.requires_grad_();
  const Tensor x = Tensor::randn({3, 8}, 8);
  Autocast outer(DType::F16);
  const Tensor a = matmul(x, w);
  const uint64_t casts = autocast_cast_count();
  {
    Autocast apex(DType::F16, kApexO1AutocastPolicy);
    EXPECT_EQ(matmul(x, w).dtype(), DType::F16);
    {
      Autocast bf16(DType::BF16);
      EXPECT_EQ(matmul(x, w).dtype(), DType::BF16);
    }
  }
  EXPECT_EQ(a.dtype(), DType::F16);
  // x is cast each time (not a leaf that requires grad); w once to f16 (shared) and once to bf16.
  EXPECT_EQ(autocast_cast_count() - casts, 3u);
}

// ---- Booster opens each mode's scope with its table ----

struct Probe {
  bool enabled = false;
  const AutocastPolicyTable* table = nullptr;
  DType mean_of_f16 = DType::F64;
  DType matmul_of_f32 = DType::F64;
  uint64_t casts = 0;
};

Probe probe_forward(const std::string& mode) {
  AllowTf32Guard restore_tf32(allow_tf32());  // boosting tf32 turns the process-wide switch on
  Linear model(4, 3, true, 1);
  Booster booster(AmpConfig::parse(mode));
  auto optimizer = booster.boost(
      model, std::make_unique<AdamW>(std::vector<ParamGroup>{{model.parameters(), 1e-3, 0.0}}, AdamOptions{}));
  Probe probe;
  booster.forward(
      [&](const std::vector<Tensor>& in) {
        probe.enabled = Autocast::enabled();
        if (probe.enabled) probe.table = &Autocast::table();
        const uint64_t before = autocast_cast_count();
        probe.mean_of_f16 = mean(Tensor::randn({2, 4}, 9, DType::F16), {1}).dtype();
        probe.matmul_of_f32 = matmul(Tensor::randn({2, 4}, 10), Tensor::randn({4, 3}, 11)).dtype();
        probe.casts = autocast_cast_count() - before;
        return std::vector<Tensor>{model(in[0])};
      },
      {Tensor::randn({2, 4}, 12)});
  return probe;
}

TEST(Booster, ForwardAutocastsByTheModesOwnTable) {
  for (const char* mode : {"fp16", "bf16"}) {
    const Probe p = probe_forward(mode);
    EXPECT_TRUE(p.enabled) << mode;
    EXPECT_EQ(p.table, &kPytorchAutocastPolicy) << mode;
    EXPECT_EQ(p.mean_of_f16, DType::F16) << mode;  // not in PyTorch's lists
  }
  const Probe apex = probe_forward("fp16_apex:O1");
  EXPECT_TRUE(apex.enabled);
  EXPECT_EQ(apex.table, &kApexO1AutocastPolicy);
  EXPECT_EQ(apex.matmul_of_f32, DType::F16);
}

TEST(Booster, NaiveAndPlainModesOpenNoAutocastScope) {
  // The naive modes cast the whole model; inside their forward an op's inputs are not cast.
  for (const char* mode : {"fp16_naive", "bf16_naive", "fp32", "tf32", "fp16_apex:O2"}) {
    const Probe p = probe_forward(mode);
    EXPECT_FALSE(p.enabled) << mode;
    EXPECT_EQ(p.matmul_of_f32, DType::F32) << mode;
    EXPECT_EQ(p.mean_of_f16, DType::F16) << mode;
    EXPECT_EQ(p.casts, 0u) << mode;
  }
}

// ---- the printed tables ----

std::string printed(PrecisionMode mode) {
  std::ostringstream out;
  print_autocast_policy_table(out, mode);
  return out.str();
}

TEST(AutocastPolicyTable, PrintsEachModesTableOrWhatItDoesInstead) {
  const std::string fp16 = printed(PrecisionMode::Fp16);
  EXPECT_EQ(fp16.rfind("Autocast policy of fp16: PyTorch AMP", 0), 0u) << fp16;
  EXPECT_NE(fp16.find(autocast_policy_table_markdown(kPytorchAutocastPolicy)), std::string::npos);
  EXPECT_NE(fp16.find("| `mean` | its inputs' dtype (mixed: the widest, by type promotion) | not listed |"),
            std::string::npos) << fp16;
  EXPECT_NE(fp16.find("| `sum` | f32 | fp32_set_opt_dtype |"), std::string::npos) << fp16;
  const std::string apex = printed(PrecisionMode::Fp16Apex);
  EXPECT_EQ(apex.rfind("Autocast policy of fp16_apex:O1: NVIDIA Apex amp O1", 0), 0u) << apex;
  EXPECT_NE(apex.find("| `var` | f32 | torch FP32_FUNCS |"), std::string::npos) << apex;
  EXPECT_NE(apex.find("| `cat` | widest floating input | SEQUENCE_CASTS |"), std::string::npos) << apex;
  EXPECT_EQ(printed(PrecisionMode::Fp32), "fp32 casts no ops: no autocast; every op runs in f32\n");
  EXPECT_EQ(printed(PrecisionMode::Tf32),
            "tf32 casts no ops: no autocast; every op runs in f32, matmul inputs rounded to tf32\n");
  EXPECT_EQ(printed(PrecisionMode::Fp16Naive), "fp16_naive casts no ops: no autocast; the whole model is cast to f16\n");
  EXPECT_EQ(printed(PrecisionMode::Bf16Naive),
            "bf16_naive casts no ops: no autocast; the whole model is cast to bf16\n");
  std::ostringstream o2;
  print_autocast_policy_table(o2, AmpConfig::parse("fp16_apex:O2"));
  EXPECT_EQ(o2.str(),
            "fp16_apex:O2 casts no ops: no autocast; the whole model is cast to f16 (Apex O2: patch_torch_functions "
            "off)\n");
}

}  // namespace
}  // namespace mixtape
