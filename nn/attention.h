#pragma once
// Causal multi-head self-attention as in nanoGPT: one fused projection c_attn [3C, C] whose output rows are
// q, k, v in that order, heads [B, H, T, D] with D = C / H, causal attention merged back to [B, T, C] (the
// fused causal_self_attention op, which reads the heads in place in c_attn's output), output projection
// c_proj [C, C], and residual dropout.
//
// Dropout on the attention probabilities (nanoGPT's attn_dropout) is not applied: the fused kernel never forms
// them. With dropout = 0 (nanoGPT's default and the fine-tuning setting) the two are identical.
#include <cstdint>
#include <memory>

#include "nn/layers.h"

namespace mixtape {

class CausalSelfAttention : public UnaryModule {
 public:
  // c_attn is seeded with `seed`, c_proj with seed + 2, the dropout stream with seed + 4.
  CausalSelfAttention(int64_t n_embd, int64_t n_head, bool bias = true, double dropout = 0.0, uint64_t seed = 0);
  Tensor forward(const Tensor& x) override;  // x [B, T, C] -> [B, T, C]

  int64_t n_embd, n_head;
  std::shared_ptr<Linear> c_attn;
  std::shared_ptr<Linear> c_proj;
  std::shared_ptr<Dropout> resid_dropout;
};

}  // namespace mixtape
