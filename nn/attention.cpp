#include "nn/attention.h"

#include "tensor/error.h"

namespace mixtape {

CausalSelfAttention::CausalSelfAttention(int64_t n_embd, int64_t n_head, bool bias, double dropout, uint64_t seed)
    : n_embd(n_embd), n_head(n_head) {
  check(n_embd > 0 && n_head > 0 && n_embd % n_head == 0, "CausalSelfAttention: n_embd (", n_embd,
        ") must be a positive multiple of n_head (", n_head, ")");
  c_attn = register_module("c_attn", std::make_shared<Linear>(n_embd, 3 * n_embd, bias, seed));
  c_proj = register_module("c_proj", std::make_shared<Linear>(n_embd, n_embd, bias, seed + 2));
  resid_dropout = register_module("resid_dropout", std::make_shared<Dropout>(dropout, seed + 4));
}

Tensor CausalSelfAttention::forward(const Tensor& x) {
  // The message is built only on failure (check() would format its arguments on every call).
  if (!x.defined() || x.dim() != 3 || x.size(2) != n_embd) [[unlikely]]
    fail("CausalSelfAttention: expected x [B, T, ", n_embd, "], got ",
         x.defined() ? x.description() : std::string("undefined"));
  // c_attn gives q, k, v side by side in [B, T, 3C]; the fused op reads each head in place and returns the
  // heads merged as [B, T, C] (its backward writes one [B, T, 3C] gradient): no split, transpose or copy.
  const Tensor y = causal_self_attention((*c_attn)(x), n_head);
  return (*resid_dropout)((*c_proj)(y));
}

}  // namespace mixtape
