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
  check(x.defined() && x.dim() == 3 && x.size(2) == n_embd, "CausalSelfAttention: expected x [B, T, ", n_embd,
        "], got ", x.defined() ? x.description() : std::string("undefined"));
  const int64_t B = x.size(0), T = x.size(1), C = n_embd, H = n_head, D = C / H;
  // [B, T, 3C] -> three [B, T, C] views -> [B, T, H, D] -> [B, H, T, D] (strided views; the attention kernel
  // reads any strides, so no copies here).
  const std::vector<Tensor> qkv = split(c_attn->forward(x), C, 2);
  auto heads = [&](const Tensor& t) { return t.view({B, T, H, D}).transpose(1, 2); };
  const Tensor y = scaled_dot_product_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]));
  // [B, H, T, D] -> [B, T, H, D] -> [B, T, C] (one copy to make the heads adjacent again).
  const Tensor merged = y.transpose(1, 2).reshape({B, T, C});
  return resid_dropout->forward(c_proj->forward(merged));
}

}  // namespace mixtape
