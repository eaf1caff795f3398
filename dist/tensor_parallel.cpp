#include "dist/tensor_parallel.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "dist/tp_ops.h"
#include "tensor/autocast_state.h"
#include "tensor/autograd_node.h"
#include "tensor/error.h"
#include "tensor/ops.h"

namespace mixtape::dist {

namespace {

void check_divisible(const char* what, const char* size_name, int64_t size, const Communicator& tp) {
  if (size % tp.size() != 0) [[unlikely]]
    fail(what, ": ", size_name, " (", size, ") is not divisible by the ", tp.name(), " size ", tp.size(),
         " (rank ", tp.rank(), ")");
}

void assign(Tensor& target, const Tensor& value) {
  NoGradGuard no_grad;
  target.copy_(value);
}

Tensor fresh(const Tensor& t) {
  NoGradGuard no_grad;
  return t.detach().contiguous().clone().detach();
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// spec.dim of a tensor of `rank` dims, made non-negative; checks the spec.
int64_t checked_dim(const char* op, const ShardSpec& spec, const Tensor& t, int size) {
  if (!t.defined()) [[unlikely]]
    fail(op, ": the tensor is undefined");
  const int64_t dim = spec.dim < 0 ? spec.dim + t.dim() : spec.dim;
  if (dim < 0 || dim >= t.dim()) [[unlikely]]
    fail(op, ": spec dim ", spec.dim, " is out of range for ", t.description());
  if (spec.blocks < 1 || spec.full_size < 0 || spec.full_size % spec.blocks != 0) [[unlikely]]
    fail(op, ": spec full_size (", spec.full_size, ") must be a non-negative multiple of blocks (", spec.blocks,
         ")");
  if (size < 1) [[unlikely]]
    fail(op, ": group size must be >= 1, got ", size);
  return dim;
}

}  // namespace

// ---- ShardSpec: the one slicing rule ----

ShardRange shard_range(const ShardSpec& spec, int rank, int size) {
  const int64_t block = spec.full_size / spec.blocks, chunk = ceil_div(block, size);
  return {std::min(block, rank * chunk), std::min(block, (rank + 1) * chunk), chunk};
}

Tensor shard_of(const Tensor& full, const ShardSpec& spec, int rank, int size) {
  const int64_t dim = checked_dim("shard_of", spec, full, size);
  if (rank < 0 || rank >= size) [[unlikely]]
    fail("shard_of: rank ", rank, " is out of range for a group of ", size);
  if (full.size(dim) != spec.full_size) [[unlikely]]
    fail("shard_of: ", full.description(), " has size ", full.size(dim), " along dim ", dim,
         ", expected the spec's full_size ", spec.full_size, " (blocks ", spec.blocks, ")");
  NoGradGuard no_grad;
  const Tensor d = full.detach();
  const int64_t block = spec.full_size / spec.blocks;
  const auto [begin, end, chunk] = shard_range(spec, rank, size);
  Shape pad_shape = d.shape();
  pad_shape[static_cast<size_t>(dim)] = chunk - (end - begin);
  std::vector<Tensor> pieces;
  for (int64_t b = 0; b < spec.blocks; ++b) {
    if (end > begin) pieces.push_back(d.narrow(dim, b * block + begin, end - begin));
    if (chunk > end - begin) pieces.push_back(Tensor::zeros(pad_shape, d.dtype(), d.device()));
  }
  if (pieces.empty()) {  // chunk 0: an empty shard
    pad_shape[static_cast<size_t>(dim)] = 0;
    return Tensor::zeros(pad_shape, d.dtype(), d.device());
  }
  return (pieces.size() == 1 ? pieces[0] : cat(pieces, dim)).contiguous().clone().detach();
}

Tensor gather_shards(const Tensor& shard, const ShardSpec& spec, const Communicator& tp) {
  const int size = tp.size();
  const int64_t dim = checked_dim("gather_shards", spec, shard, size);
  const int64_t block = spec.full_size / spec.blocks, chunk = ceil_div(block, size);
  if (shard.size(dim) != spec.blocks * chunk) [[unlikely]]
    fail("gather_shards: shard ", shard.description(), " has size ", shard.size(dim), " along dim ", dim,
         ", expected blocks (", spec.blocks, ") x ceil(full_size (", spec.full_size, ") / blocks / ", tp.name(),
         " size ", size, ") = ", spec.blocks * chunk, " (rank ", tp.rank(), ")");
  NoGradGuard no_grad;
  // Gather along dim 0 (the Communicator's layout: rank-major chunks), the split dim moved there and back.
  const Tensor local = (dim == 0 ? shard.detach() : shard.detach().transpose(0, dim)).contiguous();
  const Tensor gathered = size == 1 ? local : tp.all_gather(local);  // [size * blocks * chunk, ...]
  std::vector<Tensor> pieces;
  for (int64_t b = 0; b < spec.blocks; ++b)
    for (int64_t i = 0; i < size; ++i) {
      const ShardRange range = shard_range(spec, i, size);
      if (range.end > range.begin)
        pieces.push_back(gathered.narrow(0, (i * spec.blocks + b) * chunk, range.end - range.begin));
    }
  Tensor full;
  if (pieces.empty()) {
    Shape empty = gathered.shape();
    empty[0] = 0;
    full = Tensor::zeros(empty, shard.dtype(), shard.device());
  } else {
    full = pieces.size() == 1 ? pieces[0] : cat(pieces, 0);
  }
  return (dim == 0 ? full : full.transpose(0, dim)).contiguous().clone().detach();
}

// ---- ColumnParallelLinear ----

ColumnParallelLinear::ColumnParallelLinear(const Linear& full, Communicator tp_, bool gather_output_, int64_t blocks_,
                                           bool pad_)
    : in_features(full.in_features()), out_features(full.out_features()), gather_output(gather_output_),
      blocks(blocks_), pad(pad_), tp(std::move(tp_)) {
  check(blocks >= 1 && out_features % blocks == 0, "ColumnParallelLinear: out_features (", out_features,
        ") must be a multiple of blocks (", blocks, ")");
  check(!(gather_output && blocks > 1), "ColumnParallelLinear: gather_output needs blocks = 1, got ", blocks);
  if (!pad)
    check_divisible("ColumnParallelLinear", blocks > 1 ? "out_features / blocks" : "out_features",
                    out_features / blocks, tp);
  weight = shard_of(full.weight, shard_spec(), tp.rank(), tp.size());
  register_parameter("weight", weight);
  if (full.bias.defined()) {
    bias = shard_of(full.bias, shard_spec(), tp.rank(), tp.size());
    register_parameter("bias", bias);
  }
}

Tensor ColumnParallelLinear::forward(const Tensor& x) {
  if (!x.defined() || x.dim() < 1 || x.size(-1) != in_features) [[unlikely]]
    fail("ColumnParallelLinear: expected input [..., ", in_features, "], got ",
         x.defined() ? x.description() : std::string("undefined"), " (weight shard ", weight.description(), ")");
  const Tensor y = linear(copy_to_tp_region(x, tp), weight, bias);
  if (!gather_output) return y;
  // blocks = 1: the padded layout is the full one followed by the padding columns.
  const Tensor gathered = gather_from_tp_region(y, tp);
  return gathered.size(-1) == out_features ? gathered : gathered.narrow(-1, 0, out_features);
}

void ColumnParallelLinear::gather_full(Linear& full) const {
  check(full.in_features() == in_features && full.out_features() == out_features,
        "ColumnParallelLinear::gather_full: full Linear is [", full.out_features(), ", ", full.in_features(),
        "], expected [", out_features, ", ", in_features, "]");
  assign(full.weight, gather_shards(weight, shard_spec(), tp));
  if (bias.defined() && full.bias.defined()) assign(full.bias, gather_shards(bias, shard_spec(), tp));
}

void ColumnParallelLinear::load_full(const Linear& full) {
  assign(weight, shard_of(full.weight, shard_spec(), tp.rank(), tp.size()));
  if (bias.defined() && full.bias.defined()) assign(bias, shard_of(full.bias, shard_spec(), tp.rank(), tp.size()));
}

// ---- RowParallelLinear ----

RowParallelLinear::RowParallelLinear(const Linear& full, Communicator tp_, bool input_is_parallel_)
    : in_features(full.in_features()), out_features(full.out_features()), input_is_parallel(input_is_parallel_),
      tp(std::move(tp_)) {
  check_divisible("RowParallelLinear", "in_features", in_features, tp);
  weight = shard_of(full.weight, shard_spec(), tp.rank(), tp.size());
  register_parameter("weight", weight);
  if (full.bias.defined()) {
    bias = fresh(full.bias);
    register_parameter("bias", bias);
  }
}

Tensor RowParallelLinear::forward(const Tensor& x) {
  const int64_t expected = input_is_parallel ? in_features / tp.size() : in_features;
  if (!x.defined() || x.dim() < 1 || x.size(-1) != expected) [[unlikely]]
    fail("RowParallelLinear: expected input [..., ", expected, "] (", input_is_parallel ? "this rank's chunk" : "full",
         "), got ", x.defined() ? x.description() : std::string("undefined"), " (weight shard ", weight.description(),
         ")");
  const Tensor x_local = input_is_parallel ? x : scatter_to_tp_region(x, tp);
  // The bias is added once, after the partial products are summed (adding it on every rank would count it tp
  // times).
  Tensor y = reduce_from_tp_region(linear(x_local, weight), tp);
  if (!bias.defined()) return y;
  // Under autocast, linear's output is in the autocast dtype and the full Linear adds its bias in that dtype
  // too: cast the (fp32 master) bias the same way rather than let add promote the output to fp32.
  return add(y, autocast_enabled() && bias.dtype() != y.dtype() ? bias.to(y.dtype()) : bias);
}

void RowParallelLinear::gather_full(Linear& full) const {
  check(full.in_features() == in_features && full.out_features() == out_features,
        "RowParallelLinear::gather_full: full Linear is [", full.out_features(), ", ", full.in_features(),
        "], expected [", out_features, ", ", in_features, "]");
  assign(full.weight, gather_shards(weight, shard_spec(), tp));
  if (bias.defined() && full.bias.defined()) assign(full.bias, bias);
}

void RowParallelLinear::load_full(const Linear& full) {
  assign(weight, shard_of(full.weight, shard_spec(), tp.rank(), tp.size()));
  if (bias.defined() && full.bias.defined()) assign(bias, full.bias);
}

// ---- ParallelMLP ----

ParallelMLP::ParallelMLP(const MLP& full, Communicator tp) : activation(full.activation) {
  const int64_t blocks = activation == Activation::SwiGLU ? 2 : 1;
  c_fc = register_module("c_fc", std::make_shared<ColumnParallelLinear>(*full.c_fc, tp, false, blocks));
  c_proj = register_module("c_proj", std::make_shared<RowParallelLinear>(*full.c_proj, tp, true));
  dropout = register_module("dropout", std::make_shared<Dropout>(full.dropout->p));
  dropout->generator() = full.dropout->generator();
}

Tensor ParallelMLP::forward(const Tensor& x) {
  Tensor hidden = (*c_fc)(x);
  switch (activation) {
    case Activation::Gelu: hidden = gelu(hidden, GeluApproximation::None); break;
    case Activation::GeluTanh: hidden = gelu(hidden, GeluApproximation::Tanh); break;
    case Activation::SwiGLU: {
      const std::vector<Tensor> gate_value = split(hidden, hidden.size(-1) / 2, -1);
      hidden = mul(silu(gate_value[0]), gate_value[1]);
      break;
    }
  }
  return (*dropout)((*c_proj)(hidden));
}

void ParallelMLP::gather_full(MLP& full) const {
  c_fc->gather_full(*full.c_fc);
  c_proj->gather_full(*full.c_proj);
}

void ParallelMLP::load_full(const MLP& full) {
  c_fc->load_full(*full.c_fc);
  c_proj->load_full(*full.c_proj);
}

// ---- ParallelCausalSelfAttention ----

ParallelCausalSelfAttention::ParallelCausalSelfAttention(const CausalSelfAttention& full, Communicator tp)
    : n_embd(full.n_embd), n_head(full.n_head) {
  check_divisible("ParallelCausalSelfAttention", "n_head", n_head, tp);
  local_heads = n_head / tp.size();
  // c_attn's rows are q | k | v, each [C] = n_head heads of D: rank r's heads are rows [r C/tp, (r+1) C/tp) of
  // each third, so blocks = 3 keeps them as a local q | k | v of local_heads heads.
  c_attn = register_module("c_attn", std::make_shared<ColumnParallelLinear>(*full.c_attn, tp, false, 3));
  c_proj = register_module("c_proj", std::make_shared<RowParallelLinear>(*full.c_proj, tp, true));
  resid_dropout = register_module("resid_dropout", std::make_shared<Dropout>(full.resid_dropout->p));
  resid_dropout->generator() = full.resid_dropout->generator();
}

Tensor ParallelCausalSelfAttention::forward(const Tensor& x) {
  if (!x.defined() || x.dim() != 3 || x.size(2) != n_embd) [[unlikely]]
    fail("ParallelCausalSelfAttention: expected x [B, T, ", n_embd, "], got ",
         x.defined() ? x.description() : std::string("undefined"));
  const Tensor y = causal_self_attention((*c_attn)(x), local_heads);  // [B, T, C/tp]: this rank's heads
  return (*resid_dropout)((*c_proj)(y));
}

void ParallelCausalSelfAttention::gather_full(CausalSelfAttention& full) const {
  c_attn->gather_full(*full.c_attn);
  c_proj->gather_full(*full.c_proj);
}

void ParallelCausalSelfAttention::load_full(const CausalSelfAttention& full) {
  c_attn->load_full(*full.c_attn);
  c_proj->load_full(*full.c_proj);
}

// ---- VocabParallelEmbedding ----

VocabParallelEmbedding::VocabParallelEmbedding(const Embedding& full, Communicator tp_)
    : num_embeddings(full.weight.size(0)), embedding_dim(full.weight.size(1)), tp(std::move(tp_)) {
  // Padded when tp does not divide the vocabulary (the rule of ShardSpec, as shard_of slices).
  per_rank = ceil_div(num_embeddings, tp.size());
  vocab_start = std::min(num_embeddings, tp.rank() * per_rank);
  vocab_end = std::min(num_embeddings, (tp.rank() + 1) * per_rank);
  weight = shard_of(full.weight, shard_spec(), tp.rank(), tp.size());
  register_parameter("weight", weight);
}

Tensor VocabParallelEmbedding::forward(const Tensor& indices) {
  if (!indices.defined() || (indices.dtype() != DType::I32 && indices.dtype() != DType::I64)) [[unlikely]]
    fail("VocabParallelEmbedding: indices must be i32 or i64, got ",
         indices.defined() ? indices.description() : std::string("undefined"));
  const std::vector<int64_t> ids = indices.to(Device::cpu()).to_vector<int64_t>();
  std::vector<int64_t> local(ids.size());
  std::vector<double> keep(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= num_embeddings) [[unlikely]]
      fail("VocabParallelEmbedding: index ", ids[i], " (at position ", i, ") is out of range for a vocabulary of ",
           num_embeddings);
    const bool mine = ids[i] >= vocab_start && ids[i] < vocab_end;
    local[i] = mine ? ids[i] - vocab_start : 0;
    keep[i] = mine ? 1.0 : 0.0;
  }
  Shape mask_shape = indices.shape();
  mask_shape.push_back(1);
  const Tensor local_ids = Tensor::from_vector(local, indices.shape()).to(weight.device());
  const Tensor mask = Tensor::from_vector(keep, mask_shape, weight.dtype()).to(weight.device());
  // Rows this rank does not hold are zeroed (their gradient too); the sum over the group fills them in. No id
  // maps to a padding row except the placeholder 0 of a rank with no real rows, masked like every other.
  return reduce_from_tp_region(mul(embedding(weight, local_ids), mask), tp);
}

void VocabParallelEmbedding::gather_full(Embedding& full) const {
  check(full.weight.size(0) == num_embeddings && full.weight.size(1) == embedding_dim,
        "VocabParallelEmbedding::gather_full: full weight ", full.weight.described(), ", expected [",
        num_embeddings, ", ", embedding_dim, "]");
  assign(full.weight, gather_shards(weight, shard_spec(), tp));
}

void VocabParallelEmbedding::load_full(const Embedding& full) {
  assign(weight, shard_of(full.weight, shard_spec(), tp.rank(), tp.size()));
}

// ---- ParallelBlock, ParallelGPT ----

namespace {

// `copy` (a fresh module of full's structure) takes full's dtype and values: a replicated module.
template <class M>
std::shared_ptr<M> replicate(std::shared_ptr<M> copy, const Module& full) {
  const std::vector<Tensor> parameters = full.parameters();
  if (!parameters.empty()) copy->to(parameters.front().dtype());
  copy->load_state_dict(full.state_dict());
  return copy;
}

}  // namespace

ParallelBlock::ParallelBlock(const Block& full, const GPTConfig& config, Communicator tp) {
  ln_1 = register_module("ln_1", replicate(make_norm(config), *full.ln_1));
  attn = register_module("attn", std::make_shared<ParallelCausalSelfAttention>(*full.attn, tp));
  ln_2 = register_module("ln_2", replicate(make_norm(config), *full.ln_2));
  mlp = register_module("mlp", std::make_shared<ParallelMLP>(*full.mlp, tp));
}

Tensor ParallelBlock::forward(const Tensor& x) {
  const Tensor after_attention = add(x, (*attn)((*ln_1)(x)));
  return add(after_attention, (*mlp)((*ln_2)(after_attention)));
}

void ParallelBlock::gather_full(Block& full) const {
  full.ln_1->load_state_dict(ln_1->state_dict());
  attn->gather_full(*full.attn);
  full.ln_2->load_state_dict(ln_2->state_dict());
  mlp->gather_full(*full.mlp);
}

void ParallelBlock::load_full(const Block& full) {
  ln_1->load_state_dict(full.ln_1->state_dict());
  attn->load_full(*full.attn);
  ln_2->load_state_dict(full.ln_2->state_dict());
  mlp->load_full(*full.mlp);
}

ParallelGPT::ParallelGPT(const GPT& full, Communicator tp_) : tp(std::move(tp_)), config_(full.config()) {
  transformer = register_module("transformer", std::make_shared<Module>());
  wte = transformer->register_module("wte", std::make_shared<VocabParallelEmbedding>(*full.wte, tp));
  wpe = transformer->register_module(
      "wpe", replicate(std::make_shared<Embedding>(config_.block_size, config_.n_embd), *full.wpe));
  drop = transformer->register_module("drop", std::make_shared<Dropout>(full.drop->p));
  drop->generator() = full.drop->generator();
  h = transformer->register_module("h", std::make_shared<ModuleList<ParallelBlock>>());
  for (const auto& block : *full.h) h->push_back(std::make_shared<ParallelBlock>(*block, config_, tp));
  ln_f = transformer->register_module("ln_f", replicate(make_norm(config_), *full.ln_f));
  if (full.lm_head)
    lm_head = register_module("lm_head", std::make_shared<ColumnParallelLinear>(*full.lm_head, tp, false, 1, true));
}

ParallelGPTOutput ParallelGPT::forward(const Tensor& idx, const Tensor& targets) {
  Tensor x = embed(idx);
  for (const auto& block : *h) x = (*block)(x);
  if (targets.defined())
    check(targets.shape() == idx.shape(), "ParallelGPT: targets ", targets.described(), " must have idx's shape ",
          idx.described());
  return head(x, targets);
}

Tensor ParallelGPT::embed(const Tensor& idx) {
  check(idx.defined() && idx.dim() == 2 && (idx.dtype() == DType::I64 || idx.dtype() == DType::I32),
        "ParallelGPT: expected idx [B, T] of i32/i64, got ", idx.described());
  const int64_t T = idx.size(1);
  check(T <= config_.block_size, "ParallelGPT: cannot forward a sequence of length ", T, " (idx ", idx.described(),
        "): block_size is only ", config_.block_size);
  const Tensor positions = Tensor::arange(0, static_cast<double>(T), 1, DType::I64, idx.device());
  return (*drop)(add((*wte)(idx), (*wpe)(positions)));
}

ParallelGPTOutput ParallelGPT::head(const Tensor& x_in, const Tensor& targets) {
  check(x_in.defined() && x_in.dim() == 3, "ParallelGPT::head: expected x [B, T, C], got ", x_in.described());
  const int64_t B = x_in.size(0), T = x_in.size(1);
  const Tensor x = (*ln_f)(x_in);
  ParallelGPTOutput output;
  // Tied: this rank's logits come from its wte rows; copy_to_tp_region sums x's gradient over the group. Padding
  // rows of wte / lm_head (zero) give padding columns of 0, which the loss ignores: their gradient is 0, and so
  // is what they pass back to the padding rows and to x.
  output.logits = lm_head ? (*lm_head)(x) : matmul(copy_to_tp_region(x, tp), wte->weight.mT());
  if (targets.defined()) {
    check(targets.dim() == 2 && targets.size(0) == B && targets.size(1) == T, "ParallelGPT: targets ",
          targets.described(), " must be [", B, ", ", T, "]");
    const int64_t v = output.logits.size(-1);
    output.loss = vocab_parallel_cross_entropy(output.logits.reshape({B * T, v}), targets.reshape({B * T}), tp, -1,
                                               config_.vocab_size);
  }
  return output;
}

void ParallelGPT::gather_full(GPT& full) const {
  wte->gather_full(*full.wte);
  full.wpe->load_state_dict(wpe->state_dict());
  check(full.h->size() == h->size(), "ParallelGPT::gather_full: full GPT has ", full.h->size(), " layers, expected ",
        h->size());
  for (size_t i = 0; i < h->size(); ++i) (*h)[i].gather_full((*full.h)[i]);
  full.ln_f->load_state_dict(ln_f->state_dict());
  if (lm_head && full.lm_head) lm_head->gather_full(*full.lm_head);
}

void ParallelGPT::load_full(const GPT& full) {
  wte->load_full(*full.wte);
  wpe->load_state_dict(full.wpe->state_dict());
  check(full.h->size() == h->size(), "ParallelGPT::load_full: full GPT has ", full.h->size(), " layers, expected ",
        h->size());
  for (size_t i = 0; i < h->size(); ++i) (*h)[i].load_full((*full.h)[i]);
  ln_f->load_state_dict(full.ln_f->state_dict());
  if (lm_head && full.lm_head) lm_head->load_full(*full.lm_head);
}

namespace {

using SplitParameter = std::tuple<std::string, Tensor, ShardSpec>;

// Every tensor-parallel parameter below `module` with its name (as named_parameters spells it) and spec.
void collect_tp_parameters(const Module& module, const std::string& prefix, std::vector<SplitParameter>& out) {
  if (const auto* column = dynamic_cast<const ColumnParallelLinear*>(&module)) {
    out.emplace_back(prefix + "weight", column->weight, column->shard_spec());
    if (column->bias.defined()) out.emplace_back(prefix + "bias", column->bias, column->shard_spec());
  } else if (const auto* row = dynamic_cast<const RowParallelLinear*>(&module)) {
    out.emplace_back(prefix + "weight", row->weight, row->shard_spec());
  } else if (const auto* embedding = dynamic_cast<const VocabParallelEmbedding*>(&module)) {
    out.emplace_back(prefix + "weight", embedding->weight, embedding->shard_spec());
  }
  for (const auto& [name, child] : module.named_children()) collect_tp_parameters(*child, prefix + name + ".", out);
}

}  // namespace

std::map<std::string, ShardSpec> shard_specs(const Module& root) {
  std::vector<SplitParameter> split;
  collect_tp_parameters(root, "", split);
  std::map<std::string, ShardSpec> out;
  for (const auto& [name, tensor, spec] : split) out[name] = spec;
  return out;
}

std::vector<Tensor> tensor_parallel_parameters(const Module& root) {
  std::vector<SplitParameter> split;
  collect_tp_parameters(root, "", split);
  std::vector<Tensor> out;
  for (const auto& [name, tensor, spec] : split) out.push_back(tensor);
  return out;
}

bool is_tensor_parallel_parameter(const Module& root, const Tensor& parameter) {
  for (const Tensor& t : tensor_parallel_parameters(root))
    if (t.impl_ptr() == parameter.impl_ptr()) return true;
  return false;
}

// ---- vocab_parallel_cross_entropy ----

Tensor vocab_parallel_cross_entropy(const Tensor& logits, const Tensor& targets, const Communicator& tp,
                                    int64_t ignore_index, int64_t vocab_size) {
  if (!logits.defined() || logits.dim() < 1 || !is_floating(logits.dtype())) [[unlikely]]
    fail("vocab_parallel_cross_entropy: logits must be a floating [..., V/tp] tensor, got ",
         logits.defined() ? logits.description() : std::string("undefined"));
  if (!targets.defined() || (targets.dtype() != DType::I32 && targets.dtype() != DType::I64)) [[unlikely]]
    fail("vocab_parallel_cross_entropy: targets must be i32 or i64, got ",
         targets.defined() ? targets.description() : std::string("undefined"));
  Shape rows_shape = logits.shape();
  rows_shape.pop_back();
  if (targets.shape() != rows_shape) [[unlikely]]
    fail("vocab_parallel_cross_entropy: targets ", targets.description(), " must have logits ",
         logits.description(), "'s shape without the last dim");
  const int64_t v = logits.size(-1), start = tp.rank() * v;
  const int64_t vocab = vocab_size < 0 ? v * tp.size() : vocab_size;
  if (vocab > v * tp.size()) [[unlikely]]
    fail("vocab_parallel_cross_entropy: vocab_size (", vocab, ") is more than the ", tp.name(), " size ", tp.size(),
         " times the shard width ", v, " (logits ", logits.description(), ", rank ", tp.rank(), ")");
  // This rank's real columns [0, real) of its shard; the rest (if any) are padding and take no part.
  const int64_t real = std::clamp(vocab - start, int64_t{0}, v);
  const int64_t n = v == 0 ? 0 : logits.numel() / v;
  const DType compute = logits.dtype() == DType::F64 ? DType::F64 : DType::F32;
  const Device device = logits.device();

  const std::vector<int64_t> t = targets.to(Device::cpu()).to_vector<int64_t>();
  std::vector<double> onehot(static_cast<size_t>(n * real), 0.0), valid(static_cast<size_t>(n), 0.0);
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t target = t[static_cast<size_t>(i)];
    if (target == ignore_index) continue;
    if (target < 0 || target >= vocab) [[unlikely]]
      fail("vocab_parallel_cross_entropy: target ", target, " (row ", i, ") is out of range for a vocabulary of ",
           vocab, " (", v, " per rank of the ", tp.name(), ")");
    valid[static_cast<size_t>(i)] = 1.0;
    ++count;
    if (target >= start && target < start + real) onehot[static_cast<size_t>(i * real + target - start)] = 1.0;
  }

  Tensor loss, probs, onehot_t, valid_t;
  {
    NoGradGuard no_grad;
    Tensor l = logits.detach().to(compute).reshape({n, v});
    if (real < v) l = l.narrow(1, 0, real);  // padding columns: whatever they hold is never read
    onehot_t = Tensor::from_vector(onehot, {n, real}, compute).to(device);
    valid_t = Tensor::from_vector(valid, {n, 1}, compute).to(device);
    // A rank with no real columns contributes the identities of the reductions: -inf to the MAX, 0 to the SUMs.
    Tensor row_max = real > 0 ? max(l, {1}, true).contiguous()
                              : Tensor::full({n, 1}, -std::numeric_limits<double>::infinity(), compute, device);
    tp.all_reduce(row_max, Reduction::Max);
    const Tensor shifted = sub(l, row_max);
    const Tensor e = exp(shifted);
    Tensor sum_exp = real > 0 ? sum(e, {1}, true).contiguous() : Tensor::zeros({n, 1}, compute, device);
    tp.all_reduce(sum_exp, Reduction::Sum);
    Tensor target_logit =
        real > 0 ? sum(mul(shifted, onehot_t), {1}, true).contiguous() : Tensor::zeros({n, 1}, compute, device);
    tp.all_reduce(target_logit, Reduction::Sum);
    const Tensor row_loss = mul(sub(log(sum_exp), target_logit), valid_t);
    loss = count > 0 ? div(sum(row_loss), static_cast<double>(count)) : Tensor::scalar(0.0, compute, device);
    loss = loss.contiguous().clone().detach();
    probs = div(e, sum_exp).detach();  // [n, real]
  }
  const Shape shape = logits.shape();
  const DType dtype = logits.dtype();
  record_backward("vocab_parallel_cross_entropy", {logits}, loss,
                  [probs, onehot_t, valid_t, count, shape, dtype, n, v, real](const Tensor& g) {
                    if (count == 0 || real == 0) return Grads{Tensor::zeros(shape, dtype, g.device())};
                    const Tensor scale = div(g.to(probs.dtype()), static_cast<double>(count));
                    Tensor grad = mul(mul(sub(probs, onehot_t), valid_t), scale).to(dtype);
                    // The padding columns' gradient: exactly 0.
                    if (real < v) grad = cat({grad, Tensor::zeros({n, v - real}, dtype, g.device())}, 1);
                    return Grads{grad.reshape(shape).contiguous()};
                  });
  return loss;
}

}  // namespace mixtape::dist
