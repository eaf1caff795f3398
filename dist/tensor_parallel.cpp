#include "dist/tensor_parallel.h"

#include <cmath>
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

// This rank's rows of `full` along `dim`: the dim is `blocks` equal blocks, each split over tp; chunk rank of each
// block, side by side. A fresh contiguous tensor without history.
Tensor shard(const Tensor& full, int64_t dim, int64_t blocks, const Communicator& tp) {
  NoGradGuard no_grad;
  const Tensor d = full.detach();
  const int64_t block = d.size(dim) / blocks, chunk = block / tp.size();
  std::vector<Tensor> pieces;
  for (int64_t b = 0; b < blocks; ++b) pieces.push_back(d.narrow(dim, b * block + tp.rank() * chunk, chunk));
  return (pieces.size() == 1 ? pieces[0] : cat(pieces, dim)).contiguous().clone().detach();
}

// The inverse of shard() over the group: every rank's shard put back into the full layout (dim 0 or the last dim).
Tensor unshard(const Tensor& local, int64_t dim, int64_t blocks, const Communicator& tp) {
  NoGradGuard no_grad;
  const Tensor d = local.detach().contiguous();
  const bool last = dim != 0;
  const Tensor gathered = last ? all_gather_last_dim(d, tp) : tp.all_gather(d);  // rank-major
  if (blocks == 1) return gathered;
  const int64_t chunk = d.size(dim) / blocks;
  std::vector<Tensor> pieces;
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t i = 0; i < tp.size(); ++i) pieces.push_back(gathered.narrow(dim, i * blocks * chunk + b * chunk, chunk));
  return cat(pieces, dim).contiguous();
}

void assign(Tensor& target, const Tensor& value) {
  NoGradGuard no_grad;
  target.copy_(value);
}

Tensor fresh(const Tensor& t) {
  NoGradGuard no_grad;
  return t.detach().contiguous().clone().detach();
}

}  // namespace

// ---- ColumnParallelLinear ----

ColumnParallelLinear::ColumnParallelLinear(const Linear& full, Communicator tp_, bool gather_output_, int64_t blocks_)
    : in_features(full.in_features()), out_features(full.out_features()), gather_output(gather_output_),
      blocks(blocks_), tp(std::move(tp_)) {
  check(blocks >= 1 && out_features % blocks == 0, "ColumnParallelLinear: out_features (", out_features,
        ") must be a multiple of blocks (", blocks, ")");
  check(!(gather_output && blocks > 1), "ColumnParallelLinear: gather_output needs blocks = 1, got ", blocks);
  check_divisible("ColumnParallelLinear", blocks > 1 ? "out_features / blocks" : "out_features",
                  out_features / blocks, tp);
  weight = shard(full.weight, 0, blocks, tp);
  register_parameter("weight", weight);
  if (full.bias.defined()) {
    bias = shard(full.bias, 0, blocks, tp);
    register_parameter("bias", bias);
  }
}

Tensor ColumnParallelLinear::forward(const Tensor& x) {
  if (!x.defined() || x.dim() < 1 || x.size(-1) != in_features) [[unlikely]]
    fail("ColumnParallelLinear: expected input [..., ", in_features, "], got ",
         x.defined() ? x.description() : std::string("undefined"), " (weight shard ", weight.description(), ")");
  const Tensor y = linear(copy_to_tp_region(x, tp), weight, bias);
  return gather_output ? gather_from_tp_region(y, tp) : y;
}

void ColumnParallelLinear::gather_full(Linear& full) const {
  check(full.in_features() == in_features && full.out_features() == out_features,
        "ColumnParallelLinear::gather_full: full Linear is [", full.out_features(), ", ", full.in_features(),
        "], expected [", out_features, ", ", in_features, "]");
  assign(full.weight, unshard(weight, 0, blocks, tp));
  if (bias.defined() && full.bias.defined()) assign(full.bias, unshard(bias, 0, blocks, tp));
}

void ColumnParallelLinear::load_full(const Linear& full) {
  assign(weight, shard(full.weight, 0, blocks, tp));
  if (bias.defined() && full.bias.defined()) assign(bias, shard(full.bias, 0, blocks, tp));
}

// ---- RowParallelLinear ----

RowParallelLinear::RowParallelLinear(const Linear& full, Communicator tp_, bool input_is_parallel_)
    : in_features(full.in_features()), out_features(full.out_features()), input_is_parallel(input_is_parallel_),
      tp(std::move(tp_)) {
  check_divisible("RowParallelLinear", "in_features", in_features, tp);
  weight = shard(full.weight, 1, 1, tp);
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
  assign(full.weight, unshard(weight, 1, 1, tp));
  if (bias.defined() && full.bias.defined()) assign(full.bias, bias);
}

void RowParallelLinear::load_full(const Linear& full) {
  assign(weight, shard(full.weight, 1, 1, tp));
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
  check_divisible("VocabParallelEmbedding", "num_embeddings (vocabulary)", num_embeddings, tp);
  const int64_t per_rank = num_embeddings / tp.size();
  vocab_start = tp.rank() * per_rank;
  vocab_end = vocab_start + per_rank;
  weight = shard(full.weight, 0, 1, tp);
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
  // Rows this rank does not hold are zeroed (their gradient too); the sum over the group fills them in.
  return reduce_from_tp_region(mul(embedding(weight, local_ids), mask), tp);
}

void VocabParallelEmbedding::gather_full(Embedding& full) const {
  check(full.weight.size(0) == num_embeddings && full.weight.size(1) == embedding_dim,
        "VocabParallelEmbedding::gather_full: full weight ", full.weight.description(), ", expected [",
        num_embeddings, ", ", embedding_dim, "]");
  assign(full.weight, unshard(weight, 0, 1, tp));
}

void VocabParallelEmbedding::load_full(const Embedding& full) { assign(weight, shard(full.weight, 0, 1, tp)); }

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
    lm_head = register_module("lm_head", std::make_shared<ColumnParallelLinear>(*full.lm_head, tp, false));
}

ParallelGPTOutput ParallelGPT::forward(const Tensor& idx, const Tensor& targets) {
  check(idx.defined() && idx.dim() == 2 && (idx.dtype() == DType::I64 || idx.dtype() == DType::I32),
        "ParallelGPT: expected idx [B, T] of i32/i64, got ", idx.defined() ? idx.description() : std::string("undefined"));
  const int64_t B = idx.size(0), T = idx.size(1);
  check(T <= config_.block_size, "ParallelGPT: cannot forward a sequence of length ", T, " (idx ", idx.description(),
        "): block_size is only ", config_.block_size);
  const Tensor positions = Tensor::arange(0, static_cast<double>(T), 1, DType::I64, idx.device());
  Tensor x = (*drop)(add((*wte)(idx), (*wpe)(positions)));
  for (const auto& block : *h) x = (*block)(x);
  x = (*ln_f)(x);
  ParallelGPTOutput output;
  // Tied: this rank's logits come from its wte rows; copy_to_tp_region sums x's gradient over the group.
  output.logits = lm_head ? (*lm_head)(x) : matmul(copy_to_tp_region(x, tp), wte->weight.mT());
  if (targets.defined()) {
    check(targets.shape() == idx.shape(), "ParallelGPT: targets ", targets.description(), " must have idx's shape ",
          idx.description());
    const int64_t v = output.logits.size(-1);
    output.loss = vocab_parallel_cross_entropy(output.logits.reshape({B * T, v}), targets.reshape({B * T}), tp, -1);
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

void collect_tp_parameters(const Module& module, std::vector<Tensor>& out) {
  if (const auto* column = dynamic_cast<const ColumnParallelLinear*>(&module)) {
    out.push_back(column->weight);
    if (column->bias.defined()) out.push_back(column->bias);
  } else if (const auto* row = dynamic_cast<const RowParallelLinear*>(&module)) {
    out.push_back(row->weight);
  } else if (const auto* embedding = dynamic_cast<const VocabParallelEmbedding*>(&module)) {
    out.push_back(embedding->weight);
  }
  for (const auto& [name, child] : module.named_children()) collect_tp_parameters(*child, out);
}

}  // namespace

std::vector<Tensor> tensor_parallel_parameters(const Module& root) {
  std::vector<Tensor> out;
  collect_tp_parameters(root, out);
  return out;
}

bool is_tensor_parallel_parameter(const Module& root, const Tensor& parameter) {
  for (const Tensor& t : tensor_parallel_parameters(root))
    if (t.impl_ptr() == parameter.impl_ptr()) return true;
  return false;
}

// ---- vocab_parallel_cross_entropy ----

Tensor vocab_parallel_cross_entropy(const Tensor& logits, const Tensor& targets, const Communicator& tp,
                                    int64_t ignore_index) {
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
  const int64_t v = logits.size(-1), vocab = v * tp.size(), start = tp.rank() * v;
  const int64_t n = v == 0 ? 0 : logits.numel() / v;
  const DType compute = logits.dtype() == DType::F64 ? DType::F64 : DType::F32;
  const Device device = logits.device();

  const std::vector<int64_t> t = targets.to(Device::cpu()).to_vector<int64_t>();
  std::vector<double> onehot(static_cast<size_t>(n * v), 0.0), valid(static_cast<size_t>(n), 0.0);
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t target = t[static_cast<size_t>(i)];
    if (target == ignore_index) continue;
    if (target < 0 || target >= vocab) [[unlikely]]
      fail("vocab_parallel_cross_entropy: target ", target, " (row ", i, ") is out of range for a vocabulary of ",
           vocab, " (", v, " per rank of the ", tp.name(), ")");
    valid[static_cast<size_t>(i)] = 1.0;
    ++count;
    if (target >= start && target < start + v) onehot[static_cast<size_t>(i * v + target - start)] = 1.0;
  }

  Tensor loss, probs, onehot_t, valid_t;
  {
    NoGradGuard no_grad;
    const Tensor l = logits.detach().to(compute).reshape({n, v});
    Tensor row_max = max(l, {1}, true).contiguous();  // [n, 1]
    tp.all_reduce(row_max, Reduction::Max);
    const Tensor shifted = sub(l, row_max);
    const Tensor e = exp(shifted);
    Tensor sum_exp = sum(e, {1}, true).contiguous();
    tp.all_reduce(sum_exp, Reduction::Sum);
    onehot_t = Tensor::from_vector(onehot, {n, v}, compute).to(device);
    valid_t = Tensor::from_vector(valid, {n, 1}, compute).to(device);
    Tensor target_logit = sum(mul(shifted, onehot_t), {1}, true).contiguous();
    tp.all_reduce(target_logit, Reduction::Sum);
    const Tensor row_loss = mul(sub(log(sum_exp), target_logit), valid_t);
    loss = count > 0 ? div(sum(row_loss), static_cast<double>(count)) : Tensor::scalar(0.0, compute, device);
    loss = loss.contiguous().clone().detach();
    probs = div(e, sum_exp).detach();
  }
  const Shape shape = logits.shape();
  const DType dtype = logits.dtype();
  record_backward("vocab_parallel_cross_entropy", {logits}, loss,
                  [probs, onehot_t, valid_t, count, shape, dtype](const Tensor& g) {
                    if (count == 0) return Grads{Tensor::zeros(shape, dtype, g.device())};
                    const Tensor scale = div(g.to(probs.dtype()), static_cast<double>(count));
                    const Tensor grad = mul(mul(sub(probs, onehot_t), valid_t), scale);
                    return Grads{grad.to(dtype).reshape(shape).contiguous()};
                  });
  return loss;
}

}  // namespace mixtape::dist
