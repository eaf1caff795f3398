#pragma once
// Megatron-LM's tensor-parallel layers, each built FROM the full single-process module: every rank keeps an
// exact slice of the full weights (rank r of a group of tp holds chunk r), so a tensor-parallel forward and
// backward equal the single-process ones up to the order of the sums the collectives perform.
//
//   ColumnParallelLinear   weight rows    [out/tp, in], bias [out/tp]; output [.., out/tp] (or gathered)
//   RowParallelLinear      weight columns [out, in/tp], bias [out] replicated, added once after the reduce
//   ParallelMLP            c_fc column-parallel -> activation -> c_proj row-parallel (no gather between)
//   ParallelCausalSelfAttention  n_head/tp heads per rank: c_attn's q, k and v rows sliced per head group,
//                          c_proj row-parallel
//   VocabParallelEmbedding rows [vocab/tp] per rank; ids outside the rank's range give zero rows, then summed
//   vocab_parallel_cross_entropy  the loss of logits split over the vocabulary without gathering them
//
// Parameters keep the full module's names ("weight", "bias", "c_attn.weight", ...) so a sharded state dict has
// the single-process layout's names with shard shapes. gather_full(full) writes the shards back into the full
// module's tensors on every rank (a collective: every rank of the group must call it); load_full(full) slices
// the full module's current values into the shards again (no communication).
//
// A size that the group does not divide (out_features, in_features, n_head, vocabulary) is an Error naming the
// sizes and the group. Dtypes: whatever the shards' dtype is (f32, f16, bf16, f64; convert with Module::to).
#include <cstdint>
#include <memory>

#include "dist/communicator.h"
#include "nn/attention.h"
#include "nn/gpt.h"
#include "nn/layers.h"

namespace mixtape::dist {

class ColumnParallelLinear : public UnaryModule {
 public:
  // `blocks` > 1 treats full's output rows as that many equal blocks, each split over tp, and keeps this rank's
  // chunk of each block side by side (c_attn's q | k | v: blocks = 3; SwiGLU's gate | value: blocks = 2).
  // gather_output (blocks = 1 only) all-gathers the output to [.., out] on every rank.
  ColumnParallelLinear(const Linear& full, Communicator tp, bool gather_output, int64_t blocks = 1);
  Tensor forward(const Tensor& x) override;  // x [.., in] replicated -> [.., out/tp] (or [.., out])
  void gather_full(Linear& full) const;
  void load_full(const Linear& full);

  int64_t in_features, out_features;  // the full sizes
  bool gather_output;
  int64_t blocks;
  Communicator tp;
  Tensor weight;  // [out/tp, in]
  Tensor bias;    // [out/tp] or undefined
};

class RowParallelLinear : public UnaryModule {
 public:
  // input_is_parallel: x is already this rank's chunk [.., in/tp] (after a ColumnParallelLinear); otherwise x
  // is the full [.., in] and is scattered first.
  RowParallelLinear(const Linear& full, Communicator tp, bool input_is_parallel);
  Tensor forward(const Tensor& x) override;  // -> [.., out] replicated
  void gather_full(Linear& full) const;
  void load_full(const Linear& full);

  int64_t in_features, out_features;
  bool input_is_parallel;
  Communicator tp;
  Tensor weight;  // [out, in/tp]
  Tensor bias;    // [out], replicated
};

class ParallelMLP : public UnaryModule {
 public:
  // Dropout after c_proj keeps full's p and random stream (the same on every rank: its input is replicated).
  ParallelMLP(const MLP& full, Communicator tp);
  Tensor forward(const Tensor& x) override;
  void gather_full(MLP& full) const;
  void load_full(const MLP& full);

  Activation activation;
  std::shared_ptr<ColumnParallelLinear> c_fc;
  std::shared_ptr<RowParallelLinear> c_proj;
  std::shared_ptr<Dropout> dropout;
};

class ParallelCausalSelfAttention : public UnaryModule {
 public:
  ParallelCausalSelfAttention(const CausalSelfAttention& full, Communicator tp);
  Tensor forward(const Tensor& x) override;  // x [B, T, C] replicated -> [B, T, C] replicated
  void gather_full(CausalSelfAttention& full) const;
  void load_full(const CausalSelfAttention& full);

  int64_t n_embd, n_head, local_heads;
  std::shared_ptr<ColumnParallelLinear> c_attn;  // [3C/tp, C]: this rank's q, k, v rows
  std::shared_ptr<RowParallelLinear> c_proj;     // [C, C/tp]
  std::shared_ptr<Dropout> resid_dropout;
};

class VocabParallelEmbedding : public Module {
 public:
  VocabParallelEmbedding(const Embedding& full, Communicator tp);
  Tensor forward(const Tensor& indices);  // i32/i64 [...] in [0, vocab) -> [..., C] replicated
  Tensor operator()(const Tensor& indices) { return forward(indices); }
  void gather_full(Embedding& full) const;
  void load_full(const Embedding& full);

  int64_t num_embeddings, embedding_dim;  // the full sizes
  int64_t vocab_start, vocab_end;         // this rank's rows [vocab_start, vocab_end)
  Communicator tp;
  Tensor weight;  // [vocab/tp, C]
};

// A GPT block with its attention and MLP tensor-parallel; ln_1 and ln_2 replicated (copies of full's).
class ParallelBlock : public UnaryModule {
 public:
  ParallelBlock(const Block& full, const GPTConfig& config, Communicator tp);
  Tensor forward(const Tensor& x) override;
  void gather_full(Block& full) const;
  void load_full(const Block& full);

  std::shared_ptr<UnaryModule> ln_1;
  std::shared_ptr<ParallelCausalSelfAttention> attn;
  std::shared_ptr<UnaryModule> ln_2;
  std::shared_ptr<ParallelMLP> mlp;
};

struct ParallelGPTOutput {
  Tensor logits;  // this rank's shard [B, T, V/tp] (columns [rank V/tp, (rank+1) V/tp) of the full logits)
  Tensor loss;    // 0-d, the full model's loss (vocab_parallel_cross_entropy, targets -1 ignored); or undefined
};

// nn::GPT split over a tensor-parallel group, under the same parameter names (shard shapes): wte vocab-parallel,
// wpe, ln_* and the dropout streams replicated, blocks parallel, lm_head column-parallel without gather (or, with
// tied embeddings, the logits from this rank's wte rows: x @ wte_shard^T after copy_to_tp_region).
class ParallelGPT : public Module {
 public:
  ParallelGPT(const GPT& full, Communicator tp);
  ParallelGPTOutput forward(const Tensor& idx, const Tensor& targets = Tensor());
  void gather_full(GPT& full) const;  // collective over the group
  void load_full(const GPT& full);
  const GPTConfig& config() const { return config_; }

  Communicator tp;
  std::shared_ptr<Module> transformer;
  std::shared_ptr<VocabParallelEmbedding> wte;
  std::shared_ptr<Embedding> wpe;
  std::shared_ptr<Dropout> drop;
  std::shared_ptr<ModuleList<ParallelBlock>> h;
  std::shared_ptr<UnaryModule> ln_f;
  std::shared_ptr<ColumnParallelLinear> lm_head;  // null when tied

 private:
  GPTConfig config_;
};

// The parameters under `root` that are split over the tensor-parallel group (the weights and biases of
// ColumnParallelLinear, the weights of RowParallelLinear and VocabParallelEmbedding). Every other parameter is
// replicated on the group's ranks (with equal gradients): a gradient norm over the model-parallel group must sum
// the squares of these over the group but count the replicated ones once.
std::vector<Tensor> tensor_parallel_parameters(const Module& root);
bool is_tensor_parallel_parameter(const Module& root, const Tensor& parameter);

// Mean over the rows whose target != ignore_index of -log softmax(full logits)[target], from this rank's shard
// logits [..., V/tp] (columns [rank V/tp, (rank+1) V/tp) of the full [..., V]) and the full targets [...]
// (replicated). Equals softmax_cross_entropy of the full logits: the row max is all-reduced (MAX), the sum of
// exponentials and the target logit (SUM). Computed in fp32 (f64 for f64 logits); returns a 0-d f32 (f64).
// Backward: (softmax - onehot) / count on this rank's shard, in the logits' dtype.
Tensor vocab_parallel_cross_entropy(const Tensor& logits, const Tensor& targets, const Communicator& tp,
                                    int64_t ignore_index = -100);

}  // namespace mixtape::dist
