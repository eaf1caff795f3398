// amp/naive_amp: the model-level wrapper (InternEvo's NaiveAMPModel) and the UnaryModule forward hooks it is
// built on. Parameters end in the low dtype except set_fp32 islands; an island computes in fp32 and hands the
// low dtype back; fp32 inputs and fp16/bf16 outputs are cast at the boundary (f64 and integers never);
// gradients arrive in each parameter's dtype; "tf32" keeps fp32 and turns tf32 matmuls on; buffers are
// averaged over the group in training mode and at the first eval forward after training.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "amp/naive_amp.h"
#include "autograd/autograd.h"
#include "nn/gpt.h"
#include "nn/layers.h"
#include "tensor/autograd_node.h"
#include "tensor/ops.h"
#include "tensor/precision.h"
#include "tests/test_util.h"

namespace mixtape {
namespace {

using testing::all_close;
using testing::uniform_tensor;

const std::vector<DType> kLowDtypes = {DType::F16, DType::BF16};
const char* low_name(DType dtype) { return dtype == DType::F16 ? "fp16" : "bf16"; }

GPTConfig tiny_gpt_config(NormKind norm = NormKind::LayerNorm) {
  GPTConfig config;
  config.n_layer = 2;
  config.n_embd = 32;
  config.n_head = 2;
  config.vocab_size = 16;
  config.block_size = 8;
  config.norm = norm;
  return config;
}

// Marks every norm of the GPT as an fp32 island (what InternEvo does for its norms).
void set_norms_fp32(NaiveAMPModel& amp, GPT& gpt) {
  for (const auto& block : *gpt.h) {
    amp.set_fp32(*block->ln_1);
    amp.set_fp32(*block->ln_2);
  }
  amp.set_fp32(*gpt.ln_f);
}

bool is_norm_parameter(const std::string& name) { return name.find("ln_") != std::string::npos; }

// Records the dtype of every input it sees and returns 2x (computed in that dtype).
class DtypeRecorder : public UnaryModule {
 public:
  Tensor forward(const Tensor& x) override {
    seen.push_back(x.dtype());
    return mul(x, 2.0);
  }
  std::vector<DType> seen;
};

// fc -> island -> plain -> fc2, calling children through operator() as nn/ does.
class IslandModel : public UnaryModule {
 public:
  IslandModel() {
    fc = register_module("fc", std::make_shared<Linear>(4, 3, true, 11));
    island = register_module("island", std::make_shared<DtypeRecorder>());
    plain = register_module("plain", std::make_shared<DtypeRecorder>());
    fc2 = register_module("fc2", std::make_shared<Linear>(3, 2, true, 13));
  }
  Tensor forward(const Tensor& x) override { return (*fc2)((*plain)((*island)((*fc)(x)))); }
  std::shared_ptr<Linear> fc;
  std::shared_ptr<DtypeRecorder> island;
  std::shared_ptr<DtypeRecorder> plain;
  std::shared_ptr<Linear> fc2;
};

// Linear -> gelu -> Linear.
class TwoLayerMLP : public UnaryModule {
 public:
  TwoLayerMLP() {
    fc1 = register_module("fc1", std::make_shared<Linear>(8, 16, true, 21));
    fc2 = register_module("fc2", std::make_shared<Linear>(16, 4, true, 23));
  }
  Tensor forward(const Tensor& x) override { return (*fc2)(gelu((*fc1)(x))); }
  std::shared_ptr<Linear> fc1;
  std::shared_ptr<Linear> fc2;
};

// A floating buffer (a running statistic) and an integer one (a step count).
class BufferedModule : public UnaryModule {
 public:
  BufferedModule() {
    running = Tensor::zeros({3});
    register_buffer("running", running);
    steps = Tensor::zeros({1}, DType::I64);
    register_buffer("steps", steps);
  }
  Tensor forward(const Tensor& x) override { return x; }
  Tensor running;
  Tensor steps;
};

// A group of `size` ranks in which every other rank holds `others` in each buffer element: its all-reduce
// SUM adds what the other ranks contribute after dividing by the group size, (size - 1) * others / size, as
// the real collective would.
class FakeGroup : public ProcessGroup {
 public:
  explicit FakeGroup(int size, double others) : size_(size), others_(others) {}
  std::string name() const override { return "fake group"; }
  int size() const override { return size_; }
  void all_reduce_max(std::span<double>) override {}
  void all_reduce_sum(std::span<double>) override {}
  void all_reduce_sum(const Tensor& tensor) override {
    EXPECT_TRUE(tensor.is_contiguous());
    reduced_dtypes.push_back(tensor.dtype());
    Tensor target = tensor;
    target.copy_(add(tensor, (size_ - 1) * others_ / size_));
  }
  std::vector<DType> reduced_dtypes;

 private:
  int size_;
  double others_;
};

// ---------------------------------------------------------------------------------------------------------
// The hooks (nn/module.h)

TEST(UnaryModuleHooks, PreHookReplacesTheInputAndPostHookTheOutputOnlyThroughCallOperator) {
  DtypeRecorder module;
  const Tensor x = Tensor::from_vector(std::vector<float>{1, 2}, {2});
  module.set_forward_hooks([](const Tensor& in) { return add(in, 10.0); },
                           [](const Tensor& out) { return mul(out, -1.0); });
  EXPECT_TRUE(module.has_forward_hooks());
  EXPECT_EQ(module(x).to_vector<double>(), (std::vector<double>{-22, -24}));  // -(2 * (x + 10))
  EXPECT_EQ(module.forward(x).to_vector<double>(), (std::vector<double>{2, 4}));  // forward() itself: no hooks
  module.set_forward_hooks(nullptr, [](const Tensor& out) { return add(out, 1.0); });  // post only
  EXPECT_EQ(module(x).to_vector<double>(), (std::vector<double>{3, 5}));
  module.clear_forward_hooks();
  EXPECT_FALSE(module.has_forward_hooks());
  EXPECT_EQ(module(x).to_vector<double>(), (std::vector<double>{2, 4}));
}

TEST(UnaryModuleHooks, FireForEveryUnaryChildOfGPTBlockAttentionAndMLP) {
  GPT gpt(tiny_gpt_config(), 1);
  std::map<std::string, int> pre_calls, post_calls;
  std::vector<std::pair<std::string, UnaryModule*>> hooked = {
      {"drop", gpt.drop.get()},
      {"h.0", &(*gpt.h)[0]},
      {"h.1", &(*gpt.h)[1]},
      {"h.0.ln_1", (*gpt.h)[0].ln_1.get()},
      {"h.0.ln_2", (*gpt.h)[0].ln_2.get()},
      {"h.1.attn", (*gpt.h)[1].attn.get()},
      {"h.1.attn.c_attn", (*gpt.h)[1].attn->c_attn.get()},
      {"h.1.attn.c_proj", (*gpt.h)[1].attn->c_proj.get()},
      {"h.1.attn.resid_dropout", (*gpt.h)[1].attn->resid_dropout.get()},
      {"h.0.mlp", (*gpt.h)[0].mlp.get()},
      {"h.0.mlp.c_fc", (*gpt.h)[0].mlp->c_fc.get()},
      {"h.0.mlp.c_proj", (*gpt.h)[0].mlp->c_proj.get()},
      {"h.0.mlp.dropout", (*gpt.h)[0].mlp->dropout.get()},
  };
  for (auto& [name, module] : hooked) {
    const std::string key = name;
    module->set_forward_hooks([&pre_calls, key](const Tensor& x) { ++pre_calls[key]; return x; },
                              [&post_calls, key](const Tensor& y) { ++post_calls[key]; return y; });
  }
  // ln_f's post-hook zeroes its output: the logits (x @ wte^T) must then be zero, so the hook's result is used.
  gpt.ln_f->set_forward_hooks(nullptr, [](const Tensor& y) { return mul(y, 0.0); });
  const Tensor idx = Tensor::randint(0, 16, {2, 8}, 3);
  const GPTOutput out = gpt.forward(idx);
  for (const auto& [name, module] : hooked) {
    EXPECT_EQ(pre_calls[name], 1) << name;
    EXPECT_EQ(post_calls[name], 1) << name;
  }
  for (double v : out.logits.to_vector<double>()) ASSERT_EQ(v, 0.0);
}

// ---------------------------------------------------------------------------------------------------------
// NaiveAMPModel

TEST(NaiveAMPModel, ParametersEndInTheLowDtypeExceptFp32ModulesWhichStayFp32) {
  for (DType low : kLowDtypes) {
    GPT gpt(tiny_gpt_config(), 1);
    NaiveAMPModel amp(gpt, {.dtype = low_name(low)});
    EXPECT_EQ(amp.dtype(), low);
    set_norms_fp32(amp, gpt);
    for (const auto& [name, parameter] : gpt.named_parameters()) {
      EXPECT_EQ(parameter.dtype(), is_norm_parameter(name) ? DType::F32 : low) << name;
      EXPECT_TRUE(parameter.requires_grad() && parameter.is_leaf()) << name;
    }
  }
}

TEST(NaiveAMPModel, Fp32ModulesGivenAtConstructionKeepTheirExactFp32Values) {
  // 1 + 2^-12 needs 13 significant bits: bf16 (8) rounds it to 1, fp32 holds it exactly.
  const double value = 1.0 + std::ldexp(1.0, -12);
  GPT early(tiny_gpt_config(), 1), late(tiny_gpt_config(), 1);
  for (GPT* gpt : {&early, &late}) {
    NoGradGuard no_grad;
    Tensor weight = gpt->ln_f->named_parameters()[0].second;
    weight.fill_(value);
  }
  NaiveAMPModel amp_early(early, {.dtype = "bf16", .fp32_modules = {early.ln_f.get()}});
  NaiveAMPModel amp_late(late, {.dtype = "bf16"});
  amp_late.set_fp32(*late.ln_f);
  EXPECT_TRUE(early.ln_f->has_forward_hooks());
  const Tensor early_weight = early.ln_f->named_parameters()[0].second;
  const Tensor late_weight = late.ln_f->named_parameters()[0].second;
  ASSERT_EQ(early_weight.dtype(), DType::F32);
  ASSERT_EQ(late_weight.dtype(), DType::F32);
  EXPECT_TRUE(early_weight.requires_grad() && early_weight.is_leaf());
  for (double w : early_weight.to_vector<double>()) ASSERT_EQ(w, value);
  for (double w : late_weight.to_vector<double>()) ASSERT_EQ(w, 1.0);  // came back from bf16
  GPT stranger(tiny_gpt_config(), 1);
  EXPECT_ERROR_MENTIONS(NaiveAMPModel(early, {.dtype = "bf16", .fp32_modules = {stranger.ln_f.get()}}),
                        "fp32_modules", "not a submodule");
}

TEST(NaiveAMPModel, Fp32ModuleSeesFp32InputAndHandsTheLowDtypeBack) {
  for (DType low : kLowDtypes) {
    IslandModel model;
    NaiveAMPModel amp(model, {.dtype = low_name(low), .output_to_fp32 = false});
    amp.set_fp32(*model.island);
    const Tensor y = amp(uniform_tensor({5, 4}, 1, -1, 1, DType::F32));
    ASSERT_EQ(model.island->seen.size(), 1u);
    EXPECT_EQ(model.island->seen[0], DType::F32);  // the pre-hook cast fc's low-dtype output up
    ASSERT_EQ(model.plain->seen.size(), 1u);
    EXPECT_EQ(model.plain->seen[0], low);  // the post-hook cast the island's fp32 output back down
    EXPECT_EQ(y.dtype(), low);
  }
}

TEST(NaiveAMPModel, OutputToFp32CastsFloatingOutputsOnlyWhenOn) {
  for (DType low : kLowDtypes) {
    for (bool output_to_fp32 : {true, false}) {
      Linear model(4, 3, true, 5);
      NaiveAMPModel amp(model, {.dtype = low_name(low), .output_to_fp32 = output_to_fp32});
      const Tensor x = uniform_tensor({2, 4}, 2, -1, 1, DType::F32);
      EXPECT_EQ(amp(x).dtype(), output_to_fp32 ? DType::F32 : low);
      // The fp32 output is the low-dtype result widened, not recomputed: it rounds back to itself.
      const Tensor y = amp(x);
      EXPECT_EQ(y.to(low).to(DType::F32).to_vector<double>(), y.to_vector<double>());
    }
  }
}

TEST(NaiveAMPModel, IntegerAndUndefinedInputsAndOutputsPassUntouched) {
  Linear model(4, 3, true, 5);
  NaiveAMPModel amp(model, {.dtype = "bf16"});
  const Tensor ids = Tensor::from_vector(std::vector<int64_t>{3, 1, 4}, {3});
  const Tensor x = uniform_tensor({2, 4}, 2, -1, 1, DType::F32);
  std::vector<Tensor> seen;
  const std::vector<Tensor> outputs = amp.forward(
      [&seen](const std::vector<Tensor>& in) {
        seen = in;
        return std::vector<Tensor>{in[0], in[1], Tensor()};
      },
      {ids, x, Tensor()});
  ASSERT_EQ(seen.size(), 3u);
  EXPECT_TRUE(seen[0].same(ids));  // the very same handle: token ids are never cast
  EXPECT_EQ(seen[1].dtype(), DType::BF16);  // fp32 goes to the low dtype
  EXPECT_FALSE(seen[2].defined());
  EXPECT_TRUE(outputs[0].same(ids));  // output_to_fp32 leaves integer outputs alone
  EXPECT_EQ(outputs[1].dtype(), DType::F32);
  EXPECT_FALSE(outputs[2].defined());
}

TEST(NaiveAMPModel, OnlyFp32InputsNarrowAndOnlyFp16Bf16OutputsWiden) {
  // InternEvo's _convert_to_fp16 casts float32 only and _convert_to_fp32 widens float16/bfloat16 only: an f64
  // reference computation passes both ways untouched.
  Linear model(4, 3, true, 5);
  NaiveAMPModel amp(model, {.dtype = "fp16"});
  const Tensor x64 = uniform_tensor({2, 4}, 2, -1, 1, DType::F64);
  const Tensor x16 = uniform_tensor({2, 4}, 3, -1, 1, DType::BF16);
  std::vector<Tensor> seen;
  const std::vector<Tensor> outputs = amp.forward(
      [&seen](const std::vector<Tensor>& in) {
        seen = in;
        return std::vector<Tensor>{in[0], in[1], in[1].to(DType::F16), Tensor::ones({2}, DType::F32)};
      },
      {x64, x16});
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_TRUE(seen[0].same(x64));
  EXPECT_TRUE(seen[1].same(x16));  // bf16 into an fp16 model: not fp32, so not cast
  ASSERT_EQ(outputs.size(), 4u);
  EXPECT_TRUE(outputs[0].same(x64));  // f64 is not narrowed to fp32 either
  EXPECT_EQ(outputs[1].dtype(), DType::F32);
  EXPECT_EQ(outputs[2].dtype(), DType::F32);
  EXPECT_EQ(outputs[3].dtype(), DType::F32);
}

TEST(NaiveAMPModel, GPTTrainsForwardAndBackwardWithGradientsInEachParametersDtype) {
  const Tensor idx = Tensor::randint(0, 16, {2, 8}, 7);
  const Tensor targets = Tensor::randint(0, 16, {2, 8}, 8);
  for (NormKind norm : {NormKind::LayerNorm, NormKind::RMSNorm}) {
    GPT reference(tiny_gpt_config(norm), 1);
    const double reference_loss = reference.forward(idx, targets).loss.item();
    for (DType low : kLowDtypes) {
      SCOPED_TRACE(std::string(low_name(low)) + (norm == NormKind::RMSNorm ? " rmsnorm" : " layernorm"));
      GPT gpt(tiny_gpt_config(norm), 1);
      NaiveAMPModel amp(gpt, {.dtype = low_name(low)});
      set_norms_fp32(amp, gpt);
      const std::vector<Tensor> out = amp.forward(
          [&gpt](const std::vector<Tensor>& in) {
            const GPTOutput o = gpt.forward(in[0], in[1]);
            return std::vector<Tensor>{o.logits, o.loss};
          },
          {idx, targets});
      EXPECT_EQ(out[0].dtype(), DType::F32);
      EXPECT_EQ(out[0].shape(), (Shape{2, 8, 16}));
      // The loss of the same weights in fp32, to the low dtype's precision. Every activation is rounded to
      // 8 (bf16) or 11 (fp16) significant bits several times, but at nanoGPT's initialisation (std 0.02) the
      // logits are tiny and the loss (~ln(16) = 2.77, computed in fp32 from the widened logits) hardly moves:
      // measured < 0.004% in both dtypes; 0.1% leaves room for other seeds. (That the model really runs in
      // the low dtype is what the dtype checks here and the island test above establish.)
      EXPECT_NEAR(out[1].item(), reference_loss, 1e-3 * reference_loss);
      backward(out[1]);
      for (const auto& [name, parameter] : gpt.named_parameters()) {
        const Tensor grad = parameter.grad();
        ASSERT_TRUE(grad.defined()) << name;
        EXPECT_EQ(grad.dtype(), is_norm_parameter(name) ? DType::F32 : low) << name;
        EXPECT_EQ(grad.dtype(), parameter.dtype()) << name;
        double norm_sq = 0;
        for (double g : grad.to_vector<double>()) {
          ASSERT_TRUE(std::isfinite(g)) << name;
          norm_sq += g * g;
        }
        EXPECT_GT(norm_sq, 0.0) << name;  // every parameter takes part in the loss
      }
    }
  }
}

TEST(NaiveAMPModel, Bf16MlpEqualsTheSameOpsOnHandCastTensorsAndIsCloseToFp32) {
  TwoLayerMLP model;
  // Snapshot the fp32 weights before the wrapper converts the model in place.
  const Tensor w1 = model.fc1->weight.detach().clone(), b1 = model.fc1->bias.detach().clone();
  const Tensor w2 = model.fc2->weight.detach().clone(), b2 = model.fc2->bias.detach().clone();
  const Tensor x = uniform_tensor({5, 8}, 9, -2, 2, DType::F32);
  NaiveAMPModel amp(model, {.dtype = "bf16"});
  const Tensor y = amp(x);
  ASSERT_EQ(y.dtype(), DType::F32);

  // (1) The wrapper's casts, spelled out: input and weights rounded to bf16, the layers in bf16, the
  // output widened. Same ops, same inputs: bit for bit.
  const DType bf = DType::BF16;
  const Tensor by_hand =
      linear(gelu(linear(x.to(bf), w1.to(bf), b1.to(bf))), w2.to(bf), b2.to(bf)).to(DType::F32);
  EXPECT_EQ(y.to_vector<double>(), by_hand.to_vector<double>());

  // (2) Against the fp32 model computed in plain double. bf16 keeps 8 significant bits (relative rounding
  // error <= 2^-9 ~ 0.2%); x, the weights, the hidden pre-activation, the activation and the output are each
  // rounded once, and the 16-term sum of fc2 can cancel: 3% relative plus 0.02 absolute (|y| ~ 0.5) covers
  // that with margin while still catching a missing or double cast of the wrong kind (e.g. fp16 would pass,
  // a garbled layout would not).
  const std::vector<double> xs = x.to_vector<double>(), w1s = w1.to_vector<double>(), b1s = b1.to_vector<double>(),
                            w2s = w2.to_vector<double>(), b2s = b2.to_vector<double>();
  std::vector<double> expected(5 * 4);
  for (int n = 0; n < 5; ++n) {
    std::vector<double> hidden(16);
    for (int j = 0; j < 16; ++j) {
      double s = b1s[j];
      for (int k = 0; k < 8; ++k) s += xs[n * 8 + k] * w1s[j * 8 + k];
      hidden[j] = 0.5 * s * (1 + std::erf(s / std::sqrt(2.0)));
    }
    for (int o = 0; o < 4; ++o) {
      double s = b2s[o];
      for (int j = 0; j < 16; ++j) s += hidden[j] * w2s[o * 16 + j];
      expected[n * 4 + o] = s;
    }
  }
  EXPECT_TRUE(all_close(y, Tensor::from_vector(expected, {5, 4}), 0.02, 0.03));
  // ...and not equal to it: the bf16 path really rounded.
  EXPECT_NE(y.to_vector<double>(), Tensor::from_vector(expected, {5, 4}).to(DType::F32).to_vector<double>());
}

TEST(NaiveAMPModel, Tf32KeepsFp32ParametersAndTurnsOnTf32Matmuls) {
  AllowTf32Guard restore(false);  // the wrapper sets the process-wide flag; the guard puts it back
  GPT gpt(tiny_gpt_config(), 1);
  NaiveAMPModel amp(gpt, {.dtype = "tf32"});
  EXPECT_EQ(amp.dtype(), DType::F32);
  EXPECT_TRUE(allow_tf32());
  set_norms_fp32(amp, gpt);
  for (const auto& [name, parameter] : gpt.named_parameters()) EXPECT_EQ(parameter.dtype(), DType::F32) << name;
  const Tensor idx = Tensor::randint(0, 16, {2, 8}, 7);
  const std::vector<Tensor> out =
      amp.forward([&gpt](const std::vector<Tensor>& in) { return std::vector<Tensor>{gpt.forward(in[0]).logits}; },
                  {idx});
  EXPECT_EQ(out[0].dtype(), DType::F32);
}

TEST(NaiveAMPModel, SyncBuffersAveragesFloatingBuffersInFp32OverTheGroup) {
  const Tensor x = Tensor::ones({3});
  {  // training mode with a group of 4 whose other ranks hold 7: (1 + 3 * 7) / 4; the integer buffer stays
    BufferedModule model;
    FakeGroup group(4, 7.0);
    NaiveAMPModel amp(model, {.dtype = "fp16", .group = &group});
    EXPECT_EQ(model.running.dtype(), DType::F16);  // buffers are converted with the parameters
    {
      NoGradGuard no_grad;
      model.running.fill_(1.0);
    }
    amp(x);
    EXPECT_EQ(group.reduced_dtypes, std::vector<DType>{DType::F32});  // a 16-bit buffer is averaged in fp32
    EXPECT_EQ(model.running.dtype(), DType::F16);
    EXPECT_EQ(model.running.to_vector<double>(), (std::vector<double>{5.5, 5.5, 5.5}));
    EXPECT_EQ(model.steps.to_vector<int64_t>(), std::vector<int64_t>{0});
  }
  {  // an explicit sync_buffers() syncs in any mode
    BufferedModule model;
    FakeGroup group(2, 7.0);
    NaiveAMPModel amp(model, {.dtype = "bf16", .group = &group});
    model.eval();
    amp.sync_buffers();
    EXPECT_EQ(group.reduced_dtypes, std::vector<DType>{DType::F32});
    EXPECT_EQ(model.running.to_vector<double>(), (std::vector<double>{3.5, 3.5, 3.5}));
  }
  {  // no group, sync_buffer off, or a group of one: nothing to do
    BufferedModule no_group, off, single;
    FakeGroup group(2, 7.0), alone(1, 7.0);
    NaiveAMPModel amp_no_group(no_group, {.dtype = "fp16"});
    NaiveAMPModel amp_off(off, {.dtype = "fp16", .sync_buffer = false, .group = &group});
    NaiveAMPModel amp_single(single, {.dtype = "fp16", .group = &alone});
    amp_no_group(x);
    amp_off(x);
    amp_single(x);
    EXPECT_TRUE(group.reduced_dtypes.empty());
    EXPECT_TRUE(alone.reduced_dtypes.empty());
    for (BufferedModule* model : {&no_group, &off, &single})
      EXPECT_EQ(model->running.to_vector<double>(), (std::vector<double>{0, 0, 0}));
  }
}

TEST(NaiveAMPModel, SyncBuffersAtEveryTrainingForwardAndTheFirstEvalForwardAfterTraining) {
  const Tensor x = Tensor::ones({3});
  BufferedModule model;
  FakeGroup group(2, 0.0);  // the other rank holds 0: each sync halves the buffer
  NaiveAMPModel amp(model, {.dtype = "fp16", .group = &group});
  auto running = [&] { return model.running.to_vector<double>()[0]; };
  {
    NoGradGuard no_grad;
    model.running.fill_(64.0);
  }
  amp(x);
  amp(x);
  EXPECT_EQ(group.reduced_dtypes.size(), 2u);  // training: every forward
  EXPECT_EQ(running(), 16.0);
  model.eval();  // directly on the model, as the trainers do: the wrapper sees the change at forward
  amp(x);
  EXPECT_EQ(group.reduced_dtypes.size(), 3u);  // the first eval forward after training (InternEvo)
  amp(x);
  amp(x);
  EXPECT_EQ(group.reduced_dtypes.size(), 3u);  // later eval forwards: the buffers have not changed since
  EXPECT_EQ(running(), 8.0);
  model.train();
  amp(x);
  EXPECT_EQ(group.reduced_dtypes.size(), 4u);
  model.eval();
  amp(x);
  EXPECT_EQ(group.reduced_dtypes.size(), 5u);
  EXPECT_EQ(running(), 2.0);

  // A model whose first forward is in eval mode is synced then (its replicas may differ from the start).
  BufferedModule fresh;
  FakeGroup fresh_group(2, 0.0);
  NaiveAMPModel fresh_amp(fresh, {.dtype = "fp16", .group = &fresh_group});
  fresh.eval();
  fresh_amp(x);
  fresh_amp(x);
  EXPECT_EQ(fresh_group.reduced_dtypes.size(), 1u);
}

TEST(NaiveAMPModel, UnknownDtypeIsAnErrorAndLeavesTheModelUnconverted) {
  Linear model(4, 3);
  EXPECT_ERROR_MENTIONS(NaiveAMPModel(model, {.dtype = "fp8"}), "NaiveAMPModel", "'fp8'", "fp16, bf16 or tf32");
  EXPECT_ERROR_MENTIONS(NaiveAMPModel(model, {.dtype = "float8"}), "'float8'", "float16, bfloat16");
  EXPECT_ERROR_MENTIONS(NaiveAMPModel(model, {.dtype = "half"}), "'half'");
  EXPECT_EQ(model.weight.dtype(), DType::F32);
}

TEST(NaiveAMPModel, DtypeAcceptsTheFloat16AndBfloat16AliasesAsAmpConfigDoes) {
  Linear half(4, 3), brain(4, 3);
  EXPECT_EQ(NaiveAMPModel(half, {.dtype = "float16"}).dtype(), DType::F16);
  EXPECT_EQ(half.weight.dtype(), DType::F16);
  EXPECT_EQ(NaiveAMPModel(brain, {.dtype = "bfloat16"}).dtype(), DType::BF16);
  EXPECT_EQ(brain.weight.dtype(), DType::BF16);
}

TEST(NaiveAMPModel, SetFp32OnASealedWrapperIsAnErrorNamingTheModule) {
  GPT gpt(tiny_gpt_config(), 1);
  NaiveAMPModel amp(gpt, {.dtype = "fp16"});
  amp.set_fp32(*gpt.ln_f);  // before the optimizer holds the parameters: fine
  EXPECT_FALSE(amp.sealed());
  amp.seal();
  EXPECT_TRUE(amp.sealed());
  const Tensor before = (*gpt.h)[1].ln_2->named_parameters()[0].second;
  EXPECT_ERROR_MENTIONS(amp.set_fp32(*(*gpt.h)[1].ln_2), "set_fp32", "'transformer.h.1.ln_2'", "optimizer",
                        "BoostOptions::fp32_modules");
  // Nothing changed: the parameter is the same fp16 leaf, no hooks were set.
  const Tensor after = (*gpt.h)[1].ln_2->named_parameters()[0].second;
  EXPECT_TRUE(after.same(before));
  EXPECT_EQ(after.dtype(), DType::F16);
  EXPECT_FALSE((*gpt.h)[1].ln_2->has_forward_hooks());
}

TEST(NaiveAMPModel, SetFp32RejectsAModuleOutsideTheModelAndCallNeedsAUnaryModel) {
  Linear model(4, 3), stranger(4, 3);
  NaiveAMPModel amp(model, {.dtype = "fp16"});
  EXPECT_ERROR_MENTIONS(amp.set_fp32(stranger), "set_fp32", "not a submodule");
  EXPECT_FALSE(stranger.has_forward_hooks());

  GPT gpt(tiny_gpt_config(), 1);
  NaiveAMPModel gpt_amp(gpt, {.dtype = "bf16"});
  EXPECT_ERROR_MENTIONS(gpt_amp(Tensor::zeros({2, 8}, DType::I64)), "NaiveAMPModel", "UnaryModule",
                        "forward(fn, inputs)");
}

}  // namespace
}  // namespace mixtape
