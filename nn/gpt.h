#pragma once
// GPT-2 as nanoGPT builds it (model.py), with nanoGPT's parameter names, layouts and initialisation, so a
// state dict moves to and from PyTorch without renaming:
//   transformer.wte.weight [V, C]          transformer.wpe.weight [block_size, C]
//   transformer.h.{i}.ln_1.weight|bias     transformer.h.{i}.attn.c_attn.weight|bias [3C, C] (q, k, v)
//   transformer.h.{i}.attn.c_proj.weight|bias [C, C]
//   transformer.h.{i}.ln_2.weight|bias     transformer.h.{i}.mlp.c_fc.weight|bias [4C, C]
//   transformer.h.{i}.mlp.c_proj.weight|bias [C, 4C]
//   transformer.ln_f.weight|bias           lm_head.weight [V, C] (only when embeddings are not tied)
// Biases are absent with bias = false; RMSNorm has only a weight.
// SwiGLU (an option, not in nanoGPT): mlp.c_fc.weight is [2*4C, C] whose first 4C output rows are the gate g
// and the next 4C the value u; the hidden state is silu(g) * u, and mlp.c_proj.weight stays [C, 4C].
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "nn/attention.h"
#include "nn/layers.h"

namespace mixtape {

enum class NormKind { LayerNorm, RMSNorm };
enum class Activation { Gelu, GeluTanh, SwiGLU };

struct GPTConfig {
  int64_t n_layer = 12;
  int64_t n_head = 12;
  int64_t n_embd = 768;
  int64_t block_size = 1024;
  int64_t vocab_size = 50304;
  bool bias = true;
  double dropout = 0.0;
  bool tie_embeddings = true;
  NormKind norm = NormKind::LayerNorm;
  Activation activation = Activation::Gelu;
  double norm_eps = 1e-5;

  // Throws Error naming the offending field: sizes positive, n_embd < 2^60 (layer sizes stay int64),
  // n_embd % n_head == 0, dropout in [0, 1), norm_eps positive and finite.
  void validate() const;
  // The fields as strings for a safetensors __metadata__ (keys "n_layer", ..., "norm" = layernorm|rmsnorm,
  // "activation" = gelu|gelu_tanh|swiglu, booleans "true"/"false"), and back. from_metadata keeps the defaults
  // of absent keys and rejects unparsable values with an Error naming the key.
  void to_metadata(std::map<std::string, std::string>& metadata) const;
  static GPTConfig from_metadata(const std::map<std::string, std::string>& metadata);
};

const char* to_string(NormKind norm);
const char* to_string(Activation activation);

// The name and shape of every parameter of GPT(config), in named_parameters order, without building it. The list
// grows with n_layer: to check a file's config against its tensors, use check_gpt_shapes.
std::vector<std::pair<std::string, Shape>> gpt_parameter_shapes(const GPTConfig& config);
// Checks that `tensors` (a weights file's model part) are exactly the parameters of GPT(config), by name and
// shape, before anything of the config's size is allocated: a file whose metadata disagrees with its tensors
// (n_layer = 1e9 beside one block, say) is an Error naming `what` and the first entry that differs. The layer
// count is compared first, so the check itself costs memory in proportion to the file only.
void check_gpt_shapes(const GPTConfig& config, const std::map<std::string, Tensor>& tensors,
                      const std::string& what);

// A norm layer of the configured kind over n_embd.
std::shared_ptr<UnaryModule> make_norm(const GPTConfig& config);

// c_fc -> activation -> c_proj -> dropout.
class MLP : public UnaryModule {
 public:
  MLP(const GPTConfig& config, uint64_t seed = 0);
  Tensor forward(const Tensor& x) override;

  Activation activation;
  std::shared_ptr<Linear> c_fc;
  std::shared_ptr<Linear> c_proj;
  std::shared_ptr<Dropout> dropout;
};

// Pre-norm residual block: x + attn(ln_1(x)), then x + mlp(ln_2(x)).
class Block : public UnaryModule {
 public:
  Block(const GPTConfig& config, uint64_t seed = 0);
  Tensor forward(const Tensor& x) override;

  std::shared_ptr<UnaryModule> ln_1;
  std::shared_ptr<CausalSelfAttention> attn;
  std::shared_ptr<UnaryModule> ln_2;
  std::shared_ptr<MLP> mlp;
};

struct GPTOutput {
  Tensor logits;  // [B, T, V]
  Tensor loss;    // 0-d mean cross-entropy over targets != -1; undefined without targets
};

class GPT : public Module {
 public:
  // Builds the model and initialises it as nanoGPT does, deterministically from `seed`: every 2-d weight
  // (Linear and Embedding) normal(0, 0.02), every c_proj.weight normal(0, 0.02 / sqrt(2 * n_layer)), every bias 0,
  // norm weights 1. Parameter i (in named_parameters order) draws from a seed mixed from (seed, i). Dropout
  // streams are seeded from `seed` too.
  explicit GPT(const GPTConfig& config, uint64_t seed = 0);

  // idx [B, T] i32/i64 with T <= block_size; targets [B, T] (entries -1 are ignored, as in nanoGPT).
  GPTOutput forward(const Tensor& idx, const Tensor& targets = Tensor());

  // Re-draws every parameter as described at the constructor.
  void init_weights(uint64_t seed);

  const GPTConfig& config() const { return config_; }

  std::shared_ptr<Module> transformer;
  std::shared_ptr<Embedding> wte;
  std::shared_ptr<Embedding> wpe;
  std::shared_ptr<Dropout> drop;
  std::shared_ptr<ModuleList<Block>> h;
  std::shared_ptr<UnaryModule> ln_f;
  std::shared_ptr<Linear> lm_head;  // null when tied: the logits then use transformer.wte.weight

 private:
  GPTConfig config_;
};

}  // namespace mixtape
