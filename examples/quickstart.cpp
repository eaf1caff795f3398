// quickstart: the smallest complete training loop. A character-level GPT learns a repeated sentence for 200
// steps under PyTorch-style fp16 AMP (autocast, a GradScaler, fp32 parameters) and prints its loss falling.
// The README quotes the lines between the [readme] markers; the readme_commands test checks the quote.
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "amp/booster.h"
#include "nn/gpt.h"
#include "optim/adam.h"
#include "train/training.h"

using namespace mixtape;

int main() {
  std::string text;
  for (int i = 0; i < 64; ++i) text += "To be, or not to be, that is the question. ";
  const TokenData data = char_tokens(text);  // vocabulary: the sorted set of the text's bytes
  constexpr int64_t kBatch = 8, kBlock = 32;
  // Rows of kBlock tokens from pseudo-random offsets, and the same rows shifted by one as targets.
  auto batch = [&](int64_t step) {
    std::vector<int64_t> x, y;
    for (int64_t row = 0; row < kBatch; ++row) {
      const int64_t start = (step * 7919 + row * 104729) % (static_cast<int64_t>(data.tokens.size()) - kBlock - 1);
      for (int64_t t = 0; t < kBlock; ++t) {
        x.push_back(data.tokens[start + t]);
        y.push_back(data.tokens[start + t + 1]);
      }
    }
    return std::pair{Tensor::from_vector(x, {kBatch, kBlock}), Tensor::from_vector(y, {kBatch, kBlock})};
  };

  // [readme]
  GPT model(GPTConfig{.n_layer = 2, .n_head = 2, .n_embd = 64, .block_size = 32, .vocab_size = data.vocab_size});
  Booster booster(AmpConfig::parse("fp16"));  // PyTorch AMP: autocast to fp16, GradScaler, fp32 weights
  auto optimizer = booster.boost(model, std::make_unique<AdamW>(
      std::vector<ParamGroup>{{model.parameters(), 3e-3, 0.0}}, AdamOptions{}));
  for (int64_t step = 0; step < 200; ++step) {
    const auto [x, y] = batch(step);
    optimizer->zero_grad();
    const Tensor loss = booster.forward([&](const std::vector<Tensor>& in) {
      return std::vector<Tensor>{model.forward(in[0], in[1]).loss}; }, {x, y})[0];
    booster.backward(loss, *optimizer);             // backward of loss x scale
    const StepResult r = booster.step(*optimizer);  // unscale, inf/NaN check, step or skip
    if (step % 50 == 0 || step == 199)
      std::printf("step %3lld  loss %.3f  scale %g\n", static_cast<long long>(step), loss.item(), r.loss_scale);
  }
  // [/readme]
  return 0;
}
