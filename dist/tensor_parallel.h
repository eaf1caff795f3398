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
//   VocabParallelEmbedding rows [ceil(vocab/tp)] per rank; ids outside the rank's range give zero rows, then
//                          summed
//   vocab_parallel_cross_entropy  the loss of logits split over the vocabulary without gathering them
//
// Parameters keep the full module's names ("weight", "bias", "c_attn.weight", ...) so a sharded state dict has
// the single-process layout's names with shard shapes. gather_full(full) writes the shards back into the full
// module's tensors on every rank (a collective: every rank of the group must call it); load_full(full) slices
// the full module's current values into the shards again (no communication).
//
// A size that the group does not divide (out_features, in_features, n_head) is an Error naming the sizes and the
// group, except over the vocabulary (VocabParallelEmbedding, ParallelGPT's lm_head: ColumnParallelLinear with
// pad), which is PADDED: every rank holds chunk = ceil(V / tp) rows (equal shard shapes on every rank, as
// all_gather and ZeRO need); rank r's real rows are [min(V, r chunk), min(V, (r+1) chunk)) of the full V and
// the rest of its chunk are padding rows. Padding rows are zero at construction and stay exactly zero: nothing
// reads them into the loss (an embedding id is always < V; the logits columns they produce are excluded by
// vocab_parallel_cross_entropy), so their gradient is exactly 0, AdamW's update and weight decay of 0 are 0,
// and they add nothing to a gradient norm. gather_full / gather_shards drop them (the full module keeps its V
// rows), load_full / shard_of write zeros there. A rank may hold no real rows at all (V = 9 over tp 4: chunks of
// 3, rank 3 all padding); that works too. Without padding (V divisible by tp) nothing changes.
//
// Dtypes: whatever the shards' dtype is (f32, f16, bf16, f64; convert with Module::to).
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "dist/communicator.h"
#include "nn/attention.h"
#include "nn/gpt.h"
#include "nn/layers.h"

namespace mixtape::dist {

// How one tensor-parallel parameter (and so any tensor of its shape: a gradient, Adam's exp_avg / exp_avg_sq,
// an fp32 master weight) is split over the group of tp ranks. The full tensor's `dim` (of size full_size) is
// `blocks` equal blocks of block = full_size / blocks; each block is cut into tp chunks of
// chunk = ceil(block / tp), rank r taking [min(block, r chunk), min(block, (r+1) chunk)) of every block, padded
// with zeros to chunk, its blocks side by side: a shard of size blocks * chunk along dim, the same on every rank.
//   ColumnParallelLinear weight / bias  {0, blocks, out_features}   (c_attn q | k | v: blocks 3, SwiGLU: 2)
//   RowParallelLinear weight            {1, 1, in_features}         (its bias is replicated)
//   VocabParallelEmbedding weight       {0, 1, vocabulary}          (padded when tp does not divide it)
//   ParallelGPT logits                  {2, 1, vocabulary}          (ParallelGPT::logits_spec())
struct ShardSpec {
  int64_t dim = 0;        // the dimension split over the group
  int64_t blocks = 1;     // the full tensor's `dim` is `blocks` equal blocks, each split over tp (c_attn: q|k|v = 3)
  int64_t full_size = 0;  // the full (unpadded) size along dim; the shard may hold padding (see above)
  bool operator==(const ShardSpec&) const = default;
};

// For every tensor-parallel parameter below root (ColumnParallelLinear weight/bias, RowParallelLinear weight,
// VocabParallelEmbedding weight), its dotted name as root.named_parameters() spells it -> its spec. Replicated
// parameters are absent.
std::map<std::string, ShardSpec> shard_specs(const Module& root);
// Where rank `rank` (of `size`)'s shard sits in each block of spec.dim: it holds [begin, end) of the block
// (empty when begin == end) followed by chunk - (end - begin) padding slots.
struct ShardRange {
  int64_t begin = 0, end = 0, chunk = 0;
  int64_t padding() const { return chunk - (end - begin); }
};
ShardRange shard_range(const ShardSpec& spec, int rank, int size);
// The full tensor from every rank's shard: a collective over tp (every rank calls it with a shard of the same
// shape and dtype); any dtype, any device, the shard contiguous or not. Padding is dropped. Returns a new
// contiguous tensor without history, in the shard's dtype, on every rank. Error unless the shard's size along
// spec.dim is blocks * ceil(full_size / blocks / tp).
Tensor gather_shards(const Tensor& shard, const ShardSpec& spec, const Communicator& tp);
// Rank `rank` (of `size`)'s shard of `full` (full.size(spec.dim) == spec.full_size), padding zero: a new
// contiguous tensor without history in full's dtype and on its device. No communication.
Tensor shard_of(const Tensor& full, const ShardSpec& spec, int rank, int size);

class ColumnParallelLinear : public UnaryModule {
 public:
  // `blocks` > 1 treats full's output rows as that many equal blocks, each split over tp, and keeps this rank's
  // chunk of each block side by side (c_attn's q | k | v: blocks = 3; SwiGLU's gate | value: blocks = 2).
  // gather_output (blocks = 1 only) all-gathers the output to [.., out] on every rank.
  // pad: out / blocks need not be divisible by tp; each rank holds ceil(out / blocks / tp) rows per block, the
  // ones past the block's end zero padding (weight and bias) whose output columns are 0 (with gather_output
  // they are dropped). Without pad a size tp does not divide is an Error.
  ColumnParallelLinear(const Linear& full, Communicator tp, bool gather_output, int64_t blocks = 1,
                       bool pad = false);
  Tensor forward(const Tensor& x) override;  // x [.., in] replicated -> [.., out/tp] (or [.., out])
  void gather_full(Linear& full) const;
  void load_full(const Linear& full);
  ShardSpec shard_spec() const { return {0, blocks, out_features}; }  // of weight and bias

  int64_t in_features, out_features;  // the full sizes
  bool gather_output;
  int64_t blocks;
  bool pad;
  Communicator tp;
  Tensor weight;  // [out/tp, in] (padded: [blocks ceil(out / blocks / tp), in])
  Tensor bias;    // [out/tp] (padded likewise) or undefined
};

class RowParallelLinear : public UnaryModule {
 public:
  // input_is_parallel: x is already this rank's chunk [.., in/tp] (after a ColumnParallelLinear); otherwise x
  // is the full [.., in] and is scattered first.
  RowParallelLinear(const Linear& full, Communicator tp, bool input_is_parallel);
  Tensor forward(const Tensor& x) override;  // -> [.., out] replicated
  void gather_full(Linear& full) const;
  void load_full(const Linear& full);
  ShardSpec shard_spec() const { return {1, 1, in_features}; }  // of weight

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
  ShardSpec shard_spec() const { return {0, 1, num_embeddings}; }

  int64_t num_embeddings, embedding_dim;  // the full sizes
  int64_t per_rank;                       // ceil(vocab / tp): the rows every rank holds
  // This rank's real rows [vocab_start, vocab_end) of the full vocabulary are its local rows
  // [0, vocab_end - vocab_start); local rows [vocab_end - vocab_start, per_rank) are zero padding.
  int64_t vocab_start, vocab_end;
  Communicator tp;
  Tensor weight;  // [per_rank, C]
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
  // This rank's shard [B, T, chunk], chunk = ceil(V / tp): columns [r chunk, (r+1) chunk) of the full logits,
  // where those that are >= V (only when tp does not divide V) are padding columns holding 0 that are NOT
  // logits: pass vocab_size V to vocab_parallel_cross_entropy (which then ignores them), and use
  // gather_shards(logits, model.logits_spec(), tp) for the full [B, T, V] logits.
  Tensor logits;
  Tensor loss;    // 0-d, the full model's loss (vocab_parallel_cross_entropy, targets -1 ignored); or undefined
};

// nn::GPT split over a tensor-parallel group, under the same parameter names (shard shapes): wte vocab-parallel,
// wpe, ln_* and the dropout streams replicated, blocks parallel, lm_head column-parallel without gather (or, with
// tied embeddings, the logits from this rank's wte rows: x @ wte_shard^T after copy_to_tp_region). Any
// vocabulary size works: wte and lm_head are padded to ceil(V / tp) rows per rank (see the top of this file), so
// the model is the same at every tp (gather_full gives a GPT with a [V, C] wte).
class ParallelGPT : public Module {
 public:
  ParallelGPT(const GPT& full, Communicator tp);
  ParallelGPTOutput forward(const Tensor& idx, const Tensor& targets = Tensor());
  // forward's pieces, for a pipeline stage that runs only some of them: the embeddings of idx [B, T] (after drop),
  // and from the last block's output x [B, T, C] (before ln_f) the logits shard and, with targets, the loss.
  Tensor embed(const Tensor& idx);
  ParallelGPTOutput head(const Tensor& x, const Tensor& targets = Tensor());
  void gather_full(GPT& full) const;  // collective over the group
  void load_full(const GPT& full);
  const GPTConfig& config() const { return config_; }
  ShardSpec logits_spec() const { return {2, 1, config_.vocab_size}; }  // of ParallelGPTOutput::logits

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
// logits [..., w] and the full targets [...] (replicated). The shard is columns [rank w, (rank+1) w) of the
// full logits [..., vocab_size] padded to the width w of every rank: vocab_size (default w tp: no padding) may
// be less than w tp, and then the shard's columns >= vocab_size - rank w (all of them on a rank past the
// vocabulary) are padding, ignored whatever they hold (their gradient is exactly 0). ParallelGPT's padded
// logits: w = ceil(V / tp), vocab_size = V. Equals softmax_cross_entropy of the full logits: the row max is
// all-reduced (MAX), the sum of exponentials and the target logit (SUM). Computed in fp32 (f64 for f64 logits);
// returns a 0-d f32 (f64). Backward: (softmax - onehot) / count on this rank's real columns, in the logits'
// dtype. Error if vocab_size > w tp, or a target is outside [0, vocab_size) and not ignore_index.
Tensor vocab_parallel_cross_entropy(const Tensor& logits, const Tensor& targets, const Communicator& tp,
                                    int64_t ignore_index = -100, int64_t vocab_size = -1);

}  // namespace mixtape::dist
