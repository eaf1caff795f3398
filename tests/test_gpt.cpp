// nn/gpt: nanoGPT's parameter names and count, its initialisation, the initial loss, learning (a tiny model
// overfits a fixed batch with plain SGD), bit-exact checkpoint round trips through safetensors, and errors.
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "nn/gpt.h"
#include "io/safetensors.h"
#include "tensor/autograd_node.h"
#include "tensor/ops.h"
#include "tests/test_util.h"

namespace mixtape {
namespace {

GPTConfig tiny_config() {
  GPTConfig config;
  config.n_layer = 2;
  config.n_head = 2;
  config.n_embd = 32;
  config.block_size = 16;
  config.vocab_size = 11;
  return config;
}

std::vector<std::string> parameter_names(const Module& model) {
  std::vector<std::string> names;
  for (const auto& entry : model.named_parameters()) names.push_back(entry.first);
  return names;
}

// nanoGPT's model.named_parameters() for n_layer = 2, bias = True, tied embeddings (lm_head.weight is the same
// Parameter as transformer.wte.weight, so PyTorch lists it once).
const std::vector<std::string> kNanoGPTNames = {
    "transformer.wte.weight",           "transformer.wpe.weight",
    "transformer.h.0.ln_1.weight",      "transformer.h.0.ln_1.bias",
    "transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_attn.bias",
    "transformer.h.0.attn.c_proj.weight", "transformer.h.0.attn.c_proj.bias",
    "transformer.h.0.ln_2.weight",      "transformer.h.0.ln_2.bias",
    "transformer.h.0.mlp.c_fc.weight",  "transformer.h.0.mlp.c_fc.bias",
    "transformer.h.0.mlp.c_proj.weight", "transformer.h.0.mlp.c_proj.bias",
    "transformer.h.1.ln_1.weight",      "transformer.h.1.ln_1.bias",
    "transformer.h.1.attn.c_attn.weight", "transformer.h.1.attn.c_attn.bias",
    "transformer.h.1.attn.c_proj.weight", "transformer.h.1.attn.c_proj.bias",
    "transformer.h.1.ln_2.weight",      "transformer.h.1.ln_2.bias",
    "transformer.h.1.mlp.c_fc.weight",  "transformer.h.1.mlp.c_fc.bias",
    "transformer.h.1.mlp.c_proj.weight", "transformer.h.1.mlp.c_proj.bias",
    "transformer.ln_f.weight",          "transformer.ln_f.bias"};

TEST(GPT, ParameterNamesMatchNanoGPTExactly) {
  GPT model(tiny_config());
  EXPECT_EQ(parameter_names(model), kNanoGPTNames);
  std::vector<std::string> state_names;
  for (const auto& entry : model.state_dict().tensors) state_names.push_back(entry.first);
  std::vector<std::string> sorted = kNanoGPTNames;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(state_names, sorted);  // no lm_head.weight when tied

  GPTConfig untied = tiny_config();
  untied.tie_embeddings = false;
  untied.bias = false;
  untied.norm = NormKind::RMSNorm;
  GPT other(untied);
  const std::vector<std::string> names = parameter_names(other);
  EXPECT_EQ(names.back(), "lm_head.weight");
  for (const std::string& name : names) EXPECT_EQ(name.find("bias"), std::string::npos) << name;
  EXPECT_EQ(names.size(), 2u + 2 * 6 + 1 + 1);
}

TEST(GPT, ParameterCountEqualsTheFormula) {
  for (bool tied : {true, false})
    for (bool bias : {true, false}) {
      GPTConfig config = tiny_config();
      config.tie_embeddings = tied;
      config.bias = bias;
      GPT model(config);
      const int64_t C = config.n_embd, V = config.vocab_size, L = config.n_layer, P = config.block_size;
      const int64_t b = bias ? 1 : 0;
      const int64_t per_block = (C + b * C)                   // ln_1
                                + (3 * C * C + b * 3 * C)      // c_attn
                                + (C * C + b * C)              // attn.c_proj
                                + (C + b * C)                  // ln_2
                                + (4 * C * C + b * 4 * C)      // c_fc
                                + (4 * C * C + b * C);         // mlp.c_proj
      const int64_t expected = V * C + P * C + L * per_block + (C + b * C) + (tied ? 0 : V * C);
      EXPECT_EQ(model.num_parameters(), expected) << "tied " << tied << " bias " << bias;
    }
}

// Sample standard deviation of a parameter's values.
double stddev(const Tensor& t) {
  const std::vector<double> v = t.to_vector<double>();
  double mean = 0, sq = 0;
  for (double x : v) mean += x / v.size();
  for (double x : v) sq += (x - mean) * (x - mean) / v.size();
  return std::sqrt(sq);
}

TEST(GPT, InitialisesLikeNanoGPTAndDeterministicallyFromTheSeed) {
  GPTConfig config = tiny_config();
  config.n_layer = 8;  // residual scale 0.02 / sqrt(16) = 0.005
  config.n_embd = 64;
  GPT model(config, 3), same(config, 3), other(config, 4);
  for (const auto& [name, p] : model.named_parameters()) {
    const std::vector<double> values = p.to_vector<double>();
    if (p.dim() == 2) {
      const double expected = name.ends_with("c_proj.weight") ? 0.005 : 0.02;
      // >= 4096 samples: the sample std is within ~2.2% (1 sigma) of the true one; allow 10%.
      EXPECT_NEAR(stddev(p), expected, 0.1 * expected) << name;
    } else {
      const double expected = name.ends_with(".bias") ? 0.0 : 1.0;
      for (double v : values) ASSERT_EQ(v, expected) << name;
    }
  }
  const auto a = model.named_parameters(), b = same.named_parameters(), c = other.named_parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].second.to_vector<double>(), b[i].second.to_vector<double>()) << a[i].first;
    if (a[i].second.dim() == 2) {
      EXPECT_NE(a[i].second.to_vector<double>(), c[i].second.to_vector<double>());
    }
  }
  // Distinct parameters draw distinct streams (c_attn of layer 0 and layer 1 differ).
  EXPECT_NE(model.h->operator[](0).attn->c_attn->weight.to_vector<double>(),
            model.h->operator[](1).attn->c_attn->weight.to_vector<double>());
}

TEST(GPT, InitialLossOnRandomTargetsIsCloseToLogVocab) {
  GPTConfig config = tiny_config();
  config.vocab_size = 97;
  GPT model(config, 1);
  const Tensor idx = Tensor::randint(0, 97, {4, 16}, 5);
  const Tensor targets = Tensor::randint(0, 97, {4, 16}, 6);
  const GPTOutput out = model.forward(idx, targets);
  EXPECT_EQ(out.logits.shape(), (Shape{4, 16, 97}));
  EXPECT_NEAR(out.loss.item(), std::log(97.0), 0.1);
  EXPECT_FALSE(model.forward(idx).loss.defined());
}

TEST(GPT, IgnoresTargetsOfMinusOneLikeNanoGPT) {
  GPT model(tiny_config(), 2);
  const Tensor idx = Tensor::randint(0, 11, {1, 4}, 1);
  const Tensor all = Tensor::from_vector(std::vector<int64_t>{3, 4, 5, 6}, {1, 4});
  const Tensor some = Tensor::from_vector(std::vector<int64_t>{3, -1, -1, 6}, {1, 4});
  const GPTOutput full = model.forward(idx, all), partial = model.forward(idx, some);
  const std::vector<double> logits = full.logits.to_vector<double>();
  // Reference: the mean of -log softmax at rows 0 and 3, in double.
  auto row_loss = [&](int row, int target) {
    double top = -INFINITY, total = 0;
    for (int v = 0; v < 11; ++v) top = std::max(top, logits[row * 11 + v]);
    for (int v = 0; v < 11; ++v) total += std::exp(logits[row * 11 + v] - top);
    return std::log(total) + top - logits[row * 11 + target];
  };
  EXPECT_NEAR(partial.loss.item(), (row_loss(0, 3) + row_loss(3, 6)) / 2, 1e-5);
}

TEST(GPT, TinyModelOverfitsAFixedBatchWithPlainSGD) {
  GPT model(tiny_config(), 7);
  const Tensor idx = Tensor::randint(0, 11, {4, 16}, 11);
  const Tensor targets = Tensor::randint(0, 11, {4, 16}, 12);
  const double lr = 0.5;
  double initial = 0, last = 0;
  int steps = 0;
  for (; steps < 200; ++steps) {
    model.zero_grad();
    const Tensor loss = model.forward(idx, targets).loss;
    last = loss.item();
    if (steps == 0) initial = last;
    if (last < 0.5 * initial) break;
    backward(loss);
    NoGradGuard no_grad;
    for (Tensor p : model.parameters()) p.add_(p.grad(), -lr);
  }
  EXPECT_LT(last, 0.5 * initial) << "initial " << initial << " after " << steps << " steps";
}

TEST(GPT, SafetensorsRoundTripGivesBitIdenticalLogits) {
  for (bool tied : {true, false}) {
    GPTConfig config = tiny_config();
    config.tie_embeddings = tied;
    config.activation = tied ? Activation::Gelu : Activation::SwiGLU;
    config.norm = tied ? NormKind::LayerNorm : NormKind::RMSNorm;
    GPT model(config, 21);
    if (!tied) {  // SwiGLU: c_fc holds the gate and value halves, c_proj maps the 4C hidden state back
      EXPECT_EQ(model.h->operator[](0).mlp->c_fc->weight.shape(), (Shape{2 * 4 * 32, 32}));
      EXPECT_EQ(model.h->operator[](0).mlp->c_proj->weight.shape(), (Shape{32, 4 * 32}));
      EXPECT_EQ(model.lm_head->weight.shape(), (Shape{11, 32}));
    }
    StateDict state = model.state_dict();
    config.to_metadata(state.metadata);
    const std::string path = ::testing::TempDir() + "mixtape_gpt_roundtrip.safetensors";
    save_safetensors(path, state);
    const StateDict loaded = load_safetensors(path);
    std::remove(path.c_str());

    GPT fresh(GPTConfig::from_metadata(loaded.metadata), 99);
    EXPECT_EQ(fresh.config().activation, config.activation);
    EXPECT_EQ(fresh.config().tie_embeddings, tied);
    const Tensor idx = Tensor::randint(0, 11, {2, 16}, 3);
    EXPECT_NE(fresh.forward(idx).logits.to_vector<double>(), model.forward(idx).logits.to_vector<double>());
    fresh.load_state_dict(loaded);
    EXPECT_EQ(fresh.forward(idx).logits.to_vector<double>(), model.forward(idx).logits.to_vector<double>())
        << "tied " << tied;
  }
}

TEST(GPT, SixteenBitModelRunsAndItsTiedHeadStaysTheEmbedding) {
  GPT model(tiny_config(), 4);
  model.to(DType::BF16);
  EXPECT_EQ(model.wte->weight.dtype(), DType::BF16);
  const GPTOutput out = model.forward(Tensor::randint(0, 11, {2, 8}, 1), Tensor::randint(0, 11, {2, 8}, 2));
  EXPECT_EQ(out.logits.dtype(), DType::BF16);
  EXPECT_NEAR(out.loss.item(), std::log(11.0), 0.2);
  backward(out.loss);
  EXPECT_TRUE(model.wte->weight.grad().defined());  // reached through both the lookup and the head
}

TEST(GPT, DropoutActsOnlyInTrainingAndItsStreamsAreNamedForCheckpoints) {
  GPTConfig config = tiny_config();
  config.dropout = 0.2;
  GPT model(config, 5);
  const Tensor idx = Tensor::randint(0, 11, {2, 8}, 1);
  EXPECT_NE(model.forward(idx).logits.to_vector<double>(), model.forward(idx).logits.to_vector<double>());
  const auto generators = model.named_generators();
  ASSERT_EQ(generators.size(), 1u + 2 * 2);
  EXPECT_EQ(generators[0].first, "transformer.drop.rng");
  EXPECT_EQ(generators[1].first, "transformer.h.0.attn.resid_dropout.rng");
  EXPECT_EQ(generators[2].first, "transformer.h.0.mlp.dropout.rng");
  EXPECT_GT(generators[0].second->offset, 0u);
  for (size_t i = 1; i < generators.size(); ++i) EXPECT_NE(generators[i].second->seed, generators[0].second->seed);
  model.eval();
  EXPECT_EQ(model.forward(idx).logits.to_vector<double>(), model.forward(idx).logits.to_vector<double>());
}

TEST(GPT, RejectsBadConfigurationsAndInputs) {
  GPTConfig config = tiny_config();
  config.n_embd = 30;
  config.n_head = 4;
  EXPECT_ERROR_MENTIONS(GPT{config}, "n_embd (30)", "n_head (4)");
  config = tiny_config();
  config.n_layer = 0;
  EXPECT_ERROR_MENTIONS(GPT{config}, "n_layer", "positive");
  config = tiny_config();
  config.dropout = 1.5;
  EXPECT_ERROR_MENTIONS(config.validate(), "dropout");
  EXPECT_ERROR_MENTIONS(GPTConfig::from_metadata({{"norm", "batchnorm"}}), "norm", "batchnorm");
  EXPECT_ERROR_MENTIONS(GPTConfig::from_metadata({{"n_layer", "2x"}}), "n_layer", "2x");
  // The whole text as written: std::stoll would have read " 16" and "+16" as 16.
  for (const char* text : {" 16", "+16", "16 ", "0x10", ""})
    EXPECT_ERROR_MENTIONS(GPTConfig::from_metadata({{"n_embd", text}}), "n_embd", "is not an integer");
  EXPECT_ERROR_MENTIONS(GPTConfig::from_metadata({{"dropout", " 0.1"}}), "dropout", "is not a number");

  GPT model(tiny_config());
  EXPECT_ERROR_MENTIONS(model.forward(Tensor::zeros({1, 17}, DType::I64)), "GPT", "17", "block_size", "16");
  EXPECT_ERROR_MENTIONS(model.forward(Tensor::zeros({1, 4})), "GPT", "f32[1,4]");
  EXPECT_ERROR_MENTIONS(model.forward(Tensor::zeros({1, 4}, DType::I64), Tensor::zeros({1, 3}, DType::I64)),
                        "targets", "i64[1,3]");
}

TEST(GPT, ConfigRejectsANonFiniteNormEpsAndAWidthWhoseLayersOverflow) {
  // norm_eps = inf was accepted and only failed at the first forward.
  EXPECT_ERROR_MENTIONS(GPTConfig::from_metadata({{"norm_eps", "inf"}}), "norm_eps", "finite", "inf");
  EXPECT_ERROR_MENTIONS(GPTConfig::from_metadata({{"norm_eps", "nan"}}), "norm_eps");
  // 8 * n_embd (a SwiGLU c_fc) must stay an int64.
  EXPECT_ERROR_MENTIONS(GPTConfig::from_metadata({{"n_embd", "4611686018427387904"}, {"n_head", "1"}}), "n_embd",
                        "2^60", "4611686018427387904");
  // A model of more than 2^40 parameters is refused before its first layer is allocated (a config of 2^62
  // layers would otherwise allocate layer after layer until memory ran out).
  GPTConfig huge = tiny_config();
  huge.n_layer = int64_t{1} << 62;
  EXPECT_ERROR_MENTIONS(GPT{huge}, "GPT", "4611686018427387904 layers of width 32", "2^40");
  huge = tiny_config();
  huge.n_embd = 100000000;
  huge.n_head = 1;
  EXPECT_ERROR_MENTIONS(GPT{huge}, "GPT", "layers of width 100000000", "2^40");
}

// The reference is the model itself: its named_parameters, in order, for every option that changes the list.
TEST(GPT, ParameterShapesAreThoseOfTheBuiltModelForEveryOption) {
  std::vector<GPTConfig> configs(5, tiny_config());
  configs[1].bias = false;
  configs[2].norm = NormKind::RMSNorm;
  configs[3].activation = Activation::SwiGLU;
  configs[4].tie_embeddings = false;
  configs[4].n_layer = 3;
  for (const GPTConfig& config : configs) {
    std::vector<std::pair<std::string, Shape>> built;
    for (const auto& [name, p] : GPT(config).named_parameters()) built.emplace_back(name, p.shape());
    EXPECT_EQ(gpt_parameter_shapes(config), built);
  }
}

TEST(GPT, CheckShapesRejectsAConfigThatDisagreesWithTheTensorsWithoutBuildingIt) {
  const GPTConfig config = tiny_config();
  const StateDict state = GPT(config).state_dict();
  EXPECT_NO_THROW(check_gpt_shapes(config, state.tensors, "file.safetensors"));
  // A billion layers beside two blocks: the layer count is compared first (no list of 12e9 names is made).
  GPTConfig other = config;
  other.n_layer = 1000000000;
  EXPECT_ERROR_MENTIONS(check_gpt_shapes(other, state.tensors, "file.safetensors"), "file.safetensors",
                        "n_layer = 1000000000", "holds 2 blocks");
  other = config;
  other.block_size = 8388608;
  EXPECT_ERROR_MENTIONS(check_gpt_shapes(other, state.tensors, "f"),
                        "f: tensor 'transformer.wpe.weight' is [16,32]", "expects [8388608,32]");
  other = config;
  other.n_embd = 64;
  EXPECT_ERROR_MENTIONS(check_gpt_shapes(other, state.tensors, "f"), "'transformer.wte.weight' is [11,32]",
                        "expects [11,64]");
  other = config;
  other.tie_embeddings = false;
  EXPECT_ERROR_MENTIONS(check_gpt_shapes(other, state.tensors, "f"), "missing tensor 'lm_head.weight'");
  other = config;
  other.bias = false;
  EXPECT_ERROR_MENTIONS(check_gpt_shapes(other, state.tensors, "f"), "unexpected tensor", ".bias'");
}

}  // namespace
}  // namespace mixtape
