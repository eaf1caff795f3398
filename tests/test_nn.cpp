// nn/module, nn/layers, nn/attention: registration and naming, state dicts and strict loading, dtype
// conversion, train/eval, Linear against a plain-double reference and finite differences, and attention against
// a naive composition with the same weights.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "autograd/gradcheck.h"
#include "nn/attention.h"
#include "nn/layers.h"
#include "nn/module.h"
#include "tensor/ops.h"
#include "tests/test_util.h"

namespace mixtape {
namespace {

using testing::all_close;
using testing::uniform_tensor;

// Two levels of children plus a buffer: the naming cases in one small tree.
class TwoLayer : public Module {
 public:
  TwoLayer() {
    fc1 = register_module("fc1", std::make_shared<Linear>(3, 4, true, 1));
    norm = register_module("norm", std::make_shared<LayerNorm>(4));
    fc2 = register_module("fc2", std::make_shared<Linear>(4, 2, false, 3));
    steps = Tensor::zeros({1}, DType::I64);
    register_buffer("steps", steps);
    scale = Tensor::ones({2});
    register_parameter("scale", scale);
  }
  std::shared_ptr<Linear> fc1;
  std::shared_ptr<LayerNorm> norm;
  std::shared_ptr<Linear> fc2;
  Tensor steps;
  Tensor scale;
};

std::vector<std::string> names_of(const std::vector<std::pair<std::string, Tensor>>& entries) {
  std::vector<std::string> names;
  for (const auto& entry : entries) names.push_back(entry.first);
  return names;
}

TEST(Module, NamesOwnParametersFirstThenChildrenInRegistrationOrder) {
  TwoLayer model;
  EXPECT_EQ(names_of(model.named_parameters()),
            (std::vector<std::string>{"scale", "fc1.weight", "fc1.bias", "norm.weight", "norm.bias", "fc2.weight"}));
  EXPECT_EQ(names_of(model.named_buffers()), std::vector<std::string>{"steps"});
  EXPECT_EQ(model.num_parameters(), 2 + 12 + 4 + 4 + 4 + 8);
  for (const Tensor& p : model.parameters()) EXPECT_TRUE(p.requires_grad());
  EXPECT_TRUE(model.named_parameters()[1].second.same(model.fc1->weight));  // handles, not copies
}

TEST(Module, RejectsDuplicateAndDottedNames) {
  TwoLayer model;
  Tensor extra = Tensor::zeros({1});
  EXPECT_ERROR_MENTIONS(model.register_parameter("scale", extra), "scale", "already registered");
  EXPECT_ERROR_MENTIONS(model.register_parameter("a.b", extra), "a.b");
  EXPECT_ERROR_MENTIONS(model.register_module("fc1", std::make_shared<Linear>(1, 1)), "fc1", "already registered");
}

TEST(Module, StateDictRoundTripsIntoAFreshModel) {
  TwoLayer source, target;
  {
    NoGradGuard no_grad;
    source.scale.fill_(3.5);
    source.steps.fill_(7);
  }
  const StateDict state = source.state_dict();
  EXPECT_EQ(state.tensors.size(), 7u);
  EXPECT_FALSE(state.tensors.at("fc1.weight").requires_grad());
  EXPECT_NE(target.scale.to_vector<double>(), source.scale.to_vector<double>());
  target.load_state_dict(state);
  for (const auto& [name, tensor] : target.state_dict().tensors)
    EXPECT_EQ(tensor.to_vector<double>(), state.tensors.at(name).to_vector<double>()) << name;
  EXPECT_TRUE(target.fc1->weight.is_leaf());
  EXPECT_TRUE(target.fc1->weight.requires_grad());
  EXPECT_EQ(target.steps.to_vector<int64_t>(), std::vector<int64_t>{7});
}

TEST(Module, StrictLoadNamesMissingUnexpectedMisShapedAndMisTypedEntries) {
  TwoLayer model;
  const StateDict good = model.state_dict();

  StateDict missing = good;
  missing.tensors.erase("norm.bias");
  EXPECT_ERROR_MENTIONS(model.load_state_dict(missing), "missing", "norm.bias", "f32[4]");
  missing.tensors["fc1.bias"] = Tensor::full({4}, 0.25);
  model.load_state_dict(missing, /*strict=*/false);  // non-strict keeps the missing entry's value
  EXPECT_EQ(model.fc1->bias.to_vector<double>(), std::vector<double>(4, 0.25));
  EXPECT_EQ(model.norm->bias.to_vector<double>(), std::vector<double>(4, 0.0));

  StateDict unexpected = good;
  unexpected.tensors["fc3.weight"] = Tensor::zeros({2, 2});
  EXPECT_ERROR_MENTIONS(model.load_state_dict(unexpected), "unexpected", "fc3.weight", "f32[2,2]");
  model.load_state_dict(unexpected, /*strict=*/false);  // non-strict ignores extras

  StateDict shape = good;
  shape.tensors["fc1.weight"] = Tensor::zeros({3, 4});
  EXPECT_ERROR_MENTIONS(model.load_state_dict(shape), "fc1.weight", "f32[3,4]", "f32[4,3]");
  EXPECT_ERROR_MENTIONS(model.load_state_dict(shape, false), "fc1.weight", "f32[3,4]", "f32[4,3]");

  StateDict dtype = good;
  dtype.tensors["scale"] = Tensor::ones({2}, DType::F16);
  EXPECT_ERROR_MENTIONS(model.load_state_dict(dtype), "scale", "f16[2]", "f32[2]");
}

TEST(Module, FailedLoadLeavesEveryParameterUnchanged) {
  TwoLayer model;
  const std::vector<double> before = model.fc1->weight.to_vector<double>();
  StateDict bad = model.state_dict();
  bad.tensors["fc1.weight"] = Tensor::zeros({4, 3});  // fine, but copied only if all of the rest is fine
  bad.tensors["scale"] = Tensor::zeros({3});
  EXPECT_THROW(model.load_state_dict(bad), Error);
  EXPECT_EQ(model.fc1->weight.to_vector<double>(), before);
}

TEST(Module, ToDtypeConvertsFloatingParametersAndBuffersKeepingLeavesThatRequireGrad) {
  TwoLayer model;
  Tensor stats = Tensor::full({3}, 0.1);
  model.register_buffer("stats", stats);
  const std::vector<double> weight = model.fc1->weight.to_vector<double>();
  model.to(DType::BF16);
  for (const auto& [name, p] : model.named_parameters()) {
    EXPECT_EQ(p.dtype(), DType::BF16) << name;
    EXPECT_TRUE(p.is_leaf() && p.requires_grad()) << name;
  }
  EXPECT_EQ(model.fc1->weight.dtype(), DType::BF16);  // the member itself was replaced
  EXPECT_EQ(stats.dtype(), DType::BF16);
  EXPECT_EQ(model.steps.dtype(), DType::I64);  // integer buffers stay
  const std::vector<double> rounded = model.fc1->weight.to_vector<double>();
  for (size_t i = 0; i < weight.size(); ++i) EXPECT_EQ(rounded[i], testing::round_to(DType::BF16, weight[i]));
  // The converted model trains: gradients reach the new leaves.
  const Tensor y = model.fc2->forward(model.norm->forward(model.fc1->forward(Tensor::ones({2, 3}, DType::BF16))));
  backward(sum(y).to(DType::F32));
  EXPECT_TRUE(model.fc1->weight.grad().defined());
  model.zero_grad();
  EXPECT_FALSE(model.fc1->weight.grad().defined());
}

// A gradient dtype chosen with set_grad_dtype survives the conversion to new leaves (it is dropped only where
// it becomes the parameter's own dtype).
TEST(Module, ToKeepsAChosenGradientDtype) {
  Linear layer(3, 2, true, 5);
  layer.to(DType::BF16);
  layer.weight.set_grad_dtype(DType::F32);
  layer.to(DType::F16);
  EXPECT_EQ(layer.weight.dtype(), DType::F16);
  EXPECT_EQ(layer.weight.grad_dtype(), DType::F32);
  EXPECT_EQ(layer.bias.grad_dtype(), DType::F16);  // never chosen: its own
  layer.to(Device::cpu());
  EXPECT_EQ(layer.weight.grad_dtype(), DType::F32);
  layer.to(DType::F32);
  layer.to(DType::BF16);
  EXPECT_EQ(layer.weight.grad_dtype(), DType::BF16);  // F32 became its own dtype, so nothing was kept
}

TEST(Module, TrainAndEvalSwitchDropoutRecursively) {
  TwoLayer parent;
  auto drop = parent.register_module("drop", std::make_shared<Dropout>(0.5, 42));
  const Tensor x = Tensor::ones({1000});
  EXPECT_TRUE(drop->is_training());
  const std::vector<double> trained = drop->forward(x).to_vector<double>();
  int zeros = 0;
  for (double v : trained) {
    EXPECT_TRUE(v == 0 || v == 2) << v;
    zeros += v == 0;
  }
  EXPECT_GT(zeros, 400);
  EXPECT_LT(zeros, 600);
  EXPECT_EQ(drop->generator().offset, 1000u);
  parent.eval();
  EXPECT_FALSE(drop->is_training());
  EXPECT_EQ(drop->forward(x).to_vector<double>(), x.to_vector<double>());
  EXPECT_EQ(drop->generator().offset, 1000u);  // eval draws nothing
  parent.train();
  EXPECT_TRUE(drop->is_training());
  EXPECT_NE(drop->forward(x).to_vector<double>(), trained);  // the stream moved on
  ASSERT_EQ(parent.named_generators().size(), 1u);
  EXPECT_EQ(parent.named_generators()[0].first, "drop.rng");
  EXPECT_EQ(parent.named_generators()[0].second, &drop->generator());
}

TEST(DropoutModule, SameGeneratorStateGivesSameMask) {
  Dropout a(0.3, 7), b(0.3, 7);
  const Tensor x = Tensor::ones({64});
  a.forward(x);
  b.generator().offset = a.generator().offset;  // restoring (seed, offset) resumes the stream exactly
  EXPECT_EQ(a.forward(x).to_vector<double>(), b.forward(x).to_vector<double>());
  EXPECT_ERROR_MENTIONS(Dropout(1.0), "Dropout", "[0, 1)");
}

// y[n, o] = sum_i x[n, i] w[o, i] + b[o], in plain double.
std::vector<double> linear_reference(const std::vector<double>& x, const std::vector<double>& w,
                                     const std::vector<double>& b, int64_t rows, int64_t in, int64_t out) {
  std::vector<double> y(rows * out);
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t o = 0; o < out; ++o) {
      double acc = b.empty() ? 0 : b[o];
      for (int64_t i = 0; i < in; ++i) acc += x[n * in + i] * w[o * in + i];
      y[n * out + o] = acc;
    }
  return y;
}

TEST(Linear, MatchesPlainDoubleReferenceWithAndWithoutBias) {
  for (bool bias : {true, false}) {
    Linear layer(5, 3, bias, 11);
    EXPECT_EQ(layer.weight.shape(), (Shape{3, 5}));
    EXPECT_EQ(layer.bias.defined(), bias);
    for (double w : layer.weight.to_vector<double>()) EXPECT_LE(std::abs(w), 1 / std::sqrt(5.0));
    const Tensor x = uniform_tensor({2, 4, 5}, 3, -1, 1, DType::F32);
    const Tensor y = layer.forward(x);
    EXPECT_EQ(y.shape(), (Shape{2, 4, 3}));
    const std::vector<double> reference =
        linear_reference(x.to_vector<double>(), layer.weight.to_vector<double>(),
                         bias ? layer.bias.to_vector<double>() : std::vector<double>{}, 8, 5, 3);
    // f32 sums of 5 products of magnitude <= 1: a few ulps of the largest term.
    EXPECT_TRUE(all_close(y, Tensor::from_vector(reference, {2, 4, 3}), 1e-6, 1e-6));
  }
  Linear layer(5, 3);
  EXPECT_ERROR_MENTIONS(layer.forward(Tensor::zeros({2, 4})), "Linear", "f32[2,4]", "5");
}

TEST(Linear, GradientsMatchFiniteDifferencesInF64) {
  Linear layer(4, 3, true, 5);
  layer.to(DType::F64);
  const Tensor x = uniform_tensor({2, 4}, 9, -1, 1, DType::F64);
  // gradcheck differentiates its inputs: feed the layer's weight and bias in as inputs.
  const GradcheckResult result = gradcheck(
      [&layer](const std::vector<Tensor>& in) {
        layer.weight = in[1];
        layer.bias = in[2];
        return layer.forward(in[0]);
      },
      {x, layer.weight.detach(), layer.bias.detach()});
  EXPECT_TRUE(result.ok) << result.message;
  // And the tape reaches the layer's own leaves.
  Linear fresh(4, 3, true, 5);
  fresh.to(DType::F64);
  backward(sum(fresh.forward(x)));
  // d sum(x W^T + b) / dW[o, i] = sum_n x[n, i]; / db[o] = rows.
  const std::vector<double> xs = x.to_vector<double>(), gw = fresh.weight.grad().to_vector<double>();
  for (int64_t o = 0; o < 3; ++o)
    for (int64_t i = 0; i < 4; ++i) EXPECT_NEAR(gw[o * 4 + i], xs[i] + xs[4 + i], 1e-12);
  EXPECT_EQ(fresh.bias.grad().to_vector<double>(), (std::vector<double>{2, 2, 2}));
}

TEST(EmbeddingModule, LooksUpRowsOfItsWeight) {
  Embedding table(6, 3, 2);
  const Tensor rows = table.forward(Tensor::from_vector(std::vector<int64_t>{5, 0, 5}, {3}));
  const std::vector<double> w = table.weight.to_vector<double>(), got = rows.to_vector<double>();
  for (int64_t c = 0; c < 3; ++c) {
    EXPECT_EQ(got[c], w[15 + c]);
    EXPECT_EQ(got[3 + c], w[c]);
    EXPECT_EQ(got[6 + c], w[15 + c]);
  }
}

TEST(NormModules, LayerNormAndRMSNormStartAsPlainNormalisation) {
  const Tensor x = uniform_tensor({3, 8}, 4, -2, 2, DType::F64);
  LayerNorm ln(8, true, 1e-5);
  RMSNorm rms(8, 1e-5);
  LayerNorm ln_no_bias(8, false);
  EXPECT_EQ(names_of(ln_no_bias.named_parameters()), std::vector<std::string>{"weight"});
  EXPECT_EQ(names_of(rms.named_parameters()), std::vector<std::string>{"weight"});
  ln.to(DType::F64);
  rms.to(DType::F64);
  const std::vector<double> xs = x.to_vector<double>();
  std::vector<double> ln_ref(24), rms_ref(24);
  for (int r = 0; r < 3; ++r) {
    double mean = 0, sq = 0, var = 0;
    for (int c = 0; c < 8; ++c) mean += xs[r * 8 + c] / 8, sq += xs[r * 8 + c] * xs[r * 8 + c] / 8;
    for (int c = 0; c < 8; ++c) var += (xs[r * 8 + c] - mean) * (xs[r * 8 + c] - mean) / 8;
    for (int c = 0; c < 8; ++c) {
      ln_ref[r * 8 + c] = (xs[r * 8 + c] - mean) / std::sqrt(var + 1e-5);
      rms_ref[r * 8 + c] = xs[r * 8 + c] / std::sqrt(sq + 1e-5);
    }
  }
  EXPECT_TRUE(all_close(ln.forward(x), Tensor::from_vector(ln_ref, {3, 8}), 1e-12, 1e-12));
  EXPECT_TRUE(all_close(rms.forward(x), Tensor::from_vector(rms_ref, {3, 8}), 1e-12, 1e-12));
}

TEST(GELUModule, ExactAndTanhFormsFollowTheirFormulas) {
  const Tensor x = Tensor::from_vector(std::vector<double>{-2, -0.5, 0, 0.7, 3}, {5});
  const std::vector<double> exact = GELU().forward(x).to_vector<double>();
  const std::vector<double> approx = GELU(GeluApproximation::Tanh).forward(x).to_vector<double>();
  const std::vector<double> xs = x.to_vector<double>();
  for (size_t i = 0; i < xs.size(); ++i) {
    const double v = xs[i];
    EXPECT_NEAR(exact[i], 0.5 * v * (1 + std::erf(v / std::sqrt(2.0))), 1e-14);
    EXPECT_NEAR(approx[i], 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v))), 1e-14);
  }
}

// Naive causal attention in plain double with c_attn / c_proj weights read from the module.
std::vector<double> naive_attention(const std::vector<double>& x, const CausalSelfAttention& attn, int64_t B,
                                    int64_t T) {
  const int64_t C = attn.n_embd, H = attn.n_head, D = C / H;
  const std::vector<double> wa = attn.c_attn->weight.to_vector<double>(), ba = attn.c_attn->bias.to_vector<double>();
  const std::vector<double> wp = attn.c_proj->weight.to_vector<double>(), bp = attn.c_proj->bias.to_vector<double>();
  const std::vector<double> qkv = linear_reference(x, wa, ba, B * T, C, 3 * C);
  std::vector<double> merged(B * T * C);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        auto at = [&](int64_t which, int64_t s, int64_t d) { return qkv[(b * T + s) * 3 * C + which * C + h * D + d]; };
        std::vector<double> score(t + 1);
        double top = -INFINITY, total = 0;
        for (int64_t s = 0; s <= t; ++s) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += at(0, t, d) * at(1, s, d);
          score[s] = dot / std::sqrt(static_cast<double>(D));
          top = std::max(top, score[s]);
        }
        for (int64_t s = 0; s <= t; ++s) total += score[s] = std::exp(score[s] - top);
        for (int64_t d = 0; d < D; ++d) {
          double acc = 0;
          for (int64_t s = 0; s <= t; ++s) acc += score[s] / total * at(2, s, d);
          merged[(b * T + t) * C + h * D + d] = acc;
        }
      }
  return linear_reference(merged, wp, bp, B * T, C, C);
}

TEST(CausalSelfAttention, MatchesNaiveCompositionWithTheSameWeights) {
  CausalSelfAttention attn(12, 3, true, 0.0, 21);
  EXPECT_EQ(names_of(attn.named_parameters()),
            (std::vector<std::string>{"c_attn.weight", "c_attn.bias", "c_proj.weight", "c_proj.bias"}));
  EXPECT_EQ(attn.c_attn->weight.shape(), (Shape{36, 12}));
  attn.to(DType::F64);
  const Tensor x = uniform_tensor({2, 7, 12}, 8, -1, 1, DType::F64);
  const Tensor y = attn.forward(x);
  EXPECT_TRUE(all_close(y, Tensor::from_vector(naive_attention(x.to_vector<double>(), attn, 2, 7), {2, 7, 12}),
                        1e-12, 1e-12));
  // Causality: changing the last token leaves earlier outputs unchanged.
  std::vector<double> changed = x.to_vector<double>();
  for (int c = 0; c < 12; ++c) changed[6 * 12 + c] += 1;
  const std::vector<double> y2 = attn.forward(Tensor::from_vector(changed, {2, 7, 12})).to_vector<double>();
  const std::vector<double> y1 = y.to_vector<double>();
  for (int i = 0; i < 6 * 12; ++i) EXPECT_EQ(y1[i], y2[i]);
  EXPECT_ERROR_MENTIONS(CausalSelfAttention(10, 3), "n_embd (10)", "n_head (3)");
  EXPECT_ERROR_MENTIONS(attn.forward(Tensor::zeros({2, 7, 10}, DType::F64)), "CausalSelfAttention", "f64[2,7,10]");
}

TEST(CausalSelfAttention, GradientsMatchFiniteDifferencesInF64) {
  CausalSelfAttention attn(4, 2, true, 0.0, 3);
  attn.to(DType::F64);
  const Tensor x = uniform_tensor({1, 3, 4}, 5, -1, 1, DType::F64);
  const GradcheckResult result = gradcheck(
      [&attn](const std::vector<Tensor>& in) {
        attn.c_attn->weight = in[1];
        attn.c_proj->weight = in[2];
        return attn.forward(in[0]);
      },
      {x, attn.c_attn->weight.detach(), attn.c_proj->weight.detach()});
  EXPECT_TRUE(result.ok) << result.message;
}

}  // namespace
}  // namespace mixtape
