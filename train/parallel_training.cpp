#include "train/parallel_training.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>

#include "autograd/autograd.h"
#include "dist/data_parallel.h"
#include "dist/pipeline.h"
#include "dist/process_group.h"
#include "dist/tensor_parallel.h"
#include "dist/tp_ops.h"
#include "dist/zero.h"
#include "io/safetensors.h"
#include "tensor/autograd_node.h"
#include "tensor/error.h"
#include "tensor/ops.h"

namespace mixtape {

using dist::Communicator;
using dist::Reduction;

void ParallelOptions::validate(int world_size) const {
  check(tp >= 1 && pp >= 1 && dp >= 1, "train_gpt: --tp, --pp and --dp must be >= 1, got ", tp, ", ", pp, ", ", dp);
  check(tp * pp * dp == world_size, "train_gpt: --tp ", tp, " x --pp ", pp, " x --dp ", dp, " = ", tp * pp * dp,
        " processes, but the job has ", world_size, " (run it with mpirun -np ", tp * pp * dp, ")");
  check(zero == 0 || zero == 1, "train_gpt: --zero must be 0 or 1 (ZeRO stage 1), got ", zero);
  check(micro_batches >= 1, "train_gpt: --micro-batches must be >= 1, got ", micro_batches);
  check(pp_schedule == "1f1b" || pp_schedule == "gpipe", "train_gpt: --pp-schedule must be 1f1b or gpipe, got '",
        pp_schedule, "'");
  check(bucket_mb >= 0 && std::isfinite(bucket_mb), "train_gpt: --bucket-mb must be a finite number >= 0, got ",
        bucket_mb);
}

namespace {

// ---- a StateDict between two ranks: a manifest (names, dtypes, shapes, metadata) as bytes, then the tensors ----

void put_u64(std::string& out, uint64_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof(v)); }
void put_string(std::string& out, const std::string& s) {
  put_u64(out, s.size());
  out += s;
}
uint64_t get_u64(const std::string& in, size_t& at) {
  check(at + sizeof(uint64_t) <= in.size(), "parallel checkpoint: a truncated state message");
  uint64_t v;
  std::memcpy(&v, in.data() + at, sizeof(v));
  at += sizeof(v);
  return v;
}
std::string get_string(const std::string& in, size_t& at) {
  const uint64_t n = get_u64(in, at);
  check(at + n <= in.size(), "parallel checkpoint: a truncated state message");
  std::string s = in.substr(at, n);
  at += n;
  return s;
}

void send_bytes(const std::string& bytes, const Communicator& c, int dest) {
  const int64_t n = static_cast<int64_t>(bytes.size());
  std::vector<int64_t> words(static_cast<size_t>((n + 7) / 8), 0);
  std::memcpy(words.data(), bytes.data(), bytes.size());
  c.send(Tensor::from_vector(std::vector<int64_t>{n}, {1}), dest);
  if (n > 0) c.send(Tensor::from_vector(words, {static_cast<int64_t>(words.size())}), dest);
}

std::string recv_bytes(const Communicator& c, int source) {
  Tensor size = Tensor::empty({1}, DType::I64);
  c.recv(size, source);
  const int64_t n = size.to_vector<int64_t>()[0];
  std::string bytes(static_cast<size_t>(n), '\0');
  if (n > 0) {
    Tensor words = Tensor::empty({(n + 7) / 8}, DType::I64);
    c.recv(words, source);
    std::memcpy(bytes.data(), words.data_ptr(), static_cast<size_t>(n));
  }
  return bytes;
}

void send_state(const StateDict& state, const Communicator& c, int dest) {
  std::string manifest;
  put_u64(manifest, state.metadata.size());
  for (const auto& [key, value] : state.metadata) {
    put_string(manifest, key);
    put_string(manifest, value);
  }
  put_u64(manifest, state.tensors.size());
  for (const auto& [name, t] : state.tensors) {
    put_string(manifest, name);
    put_u64(manifest, static_cast<uint64_t>(t.dtype()));
    put_u64(manifest, static_cast<uint64_t>(t.dim()));
    for (int64_t d = 0; d < t.dim(); ++d) put_u64(manifest, static_cast<uint64_t>(t.size(d)));
  }
  send_bytes(manifest, c, dest);
  for (const auto& [name, t] : state.tensors) c.send(t.to(Device::cpu()).contiguous(), dest);
}

StateDict recv_state(const Communicator& c, int source) {
  const std::string manifest = recv_bytes(c, source);
  size_t at = 0;
  StateDict state;
  for (uint64_t i = 0, n = get_u64(manifest, at); i < n; ++i) {
    std::string key = get_string(manifest, at);
    state.metadata[key] = get_string(manifest, at);
  }
  std::vector<std::string> names;
  for (uint64_t i = 0, n = get_u64(manifest, at); i < n; ++i) {
    std::string name = get_string(manifest, at);
    const DType dtype = static_cast<DType>(get_u64(manifest, at));
    Shape shape(get_u64(manifest, at));
    for (auto& d : shape) d = static_cast<int64_t>(get_u64(manifest, at));
    state.tensors[name] = Tensor::empty(shape, dtype);
    names.push_back(name);
  }
  for (const std::string& name : names) c.recv(state.tensors[name], source);
  return state;
}

// "state.<i>.<rest>" -> (i, rest); nullopt for other keys.
std::optional<std::pair<size_t, std::string>> split_state_key(const std::string& key) {
  if (key.rfind("state.", 0) != 0) return std::nullopt;
  const size_t dot = key.find('.', 6);
  if (dot == std::string::npos || dot == 6) return std::nullopt;
  const std::optional<size_t> index = number_from_text<size_t>(std::string_view(key).substr(6, dot - 6));
  if (!index) return std::nullopt;  // not digits, or beyond size_t
  return std::make_pair(*index, key.substr(dot + 1));
}

// The parameter name inside a named optimizer key: "state.<name>.<buffer>" (buffer after the last dot) or
// "master.<name>"; empty otherwise.
std::string parameter_of(const std::string& key) {
  if (key.rfind("master.", 0) == 0) return key.substr(7);
  if (key.rfind("state.", 0) == 0) {
    const size_t dot = key.rfind('.');
    return dot > 6 ? key.substr(6, dot - 6) : std::string();
  }
  return {};
}

// A container module (register_module is public on Module; this names the intent).
std::shared_ptr<Module> container() { return std::make_shared<Module>(); }

}  // namespace

// ---- the stage: this rank's part of the ParallelGPT, under nanoGPT names ----

// The weights of the tensor-parallel Linear layers under `module`, by parameter name (the fp8 modes cover them
// as they cover nn::Linear).
void collect_parallel_linear_weights(Module& module, const std::string& prefix,
                                     std::vector<std::pair<std::string, Tensor>>& out) {
  for (const auto& [name, child] : module.named_children()) {
    const std::string path = prefix.empty() ? name : prefix + "." + name;
    if (auto* column = dynamic_cast<dist::ColumnParallelLinear*>(child)) out.push_back({path + ".weight", column->weight});
    if (auto* row = dynamic_cast<dist::RowParallelLinear*>(child)) out.push_back({path + ".weight", row->weight});
    collect_parallel_linear_weights(*child, path, out);
  }
}

// The weight names of the row- and column-parallel layers (their K splits over tp: LowPrecisionContext::set_k_split).
void collect_parallel_linear_names(Module& module, const std::string& prefix, std::vector<std::string>& rows,
                                   std::vector<std::string>& columns) {
  for (const auto& [name, child] : module.named_children()) {
    const std::string path = prefix.empty() ? name : prefix + "." + name;
    if (dynamic_cast<dist::ColumnParallelLinear*>(child)) columns.push_back(path + ".weight");
    if (dynamic_cast<dist::RowParallelLinear*>(child)) rows.push_back(path + ".weight");
    collect_parallel_linear_names(*child, path, rows, columns);
  }
}

std::vector<std::pair<std::string, Tensor>> parallel_linear_weights(Module& module) {
  std::vector<std::pair<std::string, Tensor>> out;
  collect_parallel_linear_weights(module, "", out);
  return out;
}

class GPTStage : public Module, public dist::PipelineStage {
 public:
  GPTStage(dist::ParallelGPT& gpt, int stage, int num_stages, Booster& booster)
      : gpt_(gpt), stage_(stage), num_stages_(num_stages), booster_(booster) {
    const int64_t L = gpt.config().n_layer;
    // Stage s: an equal share of the blocks, the first L mod P stages one more.
    const int64_t base = L / num_stages, extra = L % num_stages;
    first_layer_ = stage * base + std::min<int64_t>(stage, extra);
    end_layer_ = first_layer_ + base + (stage < extra ? 1 : 0);
    const bool first = stage == 0, last = stage == num_stages - 1;
    auto transformer = register_module("transformer", container());
    if (first || (last && !gpt.lm_head)) transformer->register_module("wte", gpt.wte);
    if (first) {
      transformer->register_module("wpe", gpt.wpe);
      transformer->register_module("drop", gpt.drop);
    }
    auto h = transformer->register_module("h", container());
    size_t i = 0;
    for (const auto& block : *gpt.h) {
      if (static_cast<int64_t>(i) >= first_layer_ && static_cast<int64_t>(i) < end_layer_)
        h->register_module(std::to_string(i), block);
      ++i;
    }
    if (last) {
      transformer->register_module("ln_f", gpt.ln_f);
      if (gpt.lm_head) register_module("lm_head", gpt.lm_head);
    }
  }

  // The targets of the micro-batches that forward() is about to see (read on the last stage).
  void set_targets(std::vector<Tensor> targets) { targets_ = std::move(targets); }

  Tensor forward(const Tensor& input, int64_t micro_batch) override {
    return booster_.forward([&](const std::vector<Tensor>& in) { return std::vector<Tensor>{run(in[0], micro_batch)}; },
                            {input})[0];
  }

  bool is_first() const { return stage_ == 0; }
  bool is_last() const { return stage_ == num_stages_ - 1; }

 private:
  Tensor run(const Tensor& input, int64_t micro_batch) {
    Tensor x = is_first() ? gpt_.embed(input) : input;
    for (int64_t i = first_layer_; i < end_layer_; ++i) x = (*gpt_.h)[static_cast<size_t>(i)](x);
    if (!is_last()) return x;
    return gpt_.head(x, targets_.at(static_cast<size_t>(micro_batch))).loss;
  }

  dist::ParallelGPT& gpt_;
  int stage_, num_stages_;
  Booster& booster_;
  int64_t first_layer_ = 0, end_layer_ = 0;
  std::vector<Tensor> targets_;
};

// ---- the trainer ----

struct ParallelTrainer::Impl {
  GPTConfig config;
  TrainOptions options;
  ParallelOptions parallel;
  const TokenData& data;
  dist::ParallelGroups groups;
  Communicator embedding;  // first and last stage (tied wte)
  std::unique_ptr<GPT> full;
  std::unique_ptr<dist::ParallelGPT> gpt;
  Booster booster;
  std::unique_ptr<GPTStage> stage;
  std::map<std::string, dist::ShardSpec> specs;  // of the tensor-parallel parameters, by name
  std::vector<std::string> local_order;          // the optimizer's parameters (names), this rank
  std::vector<std::string> full_order;           // the single-process optimizer's parameters (names)
  // Outlive the optimizer, NaiveAMPModel and the fp8 scaling state using them.
  std::unique_ptr<dist::CommunicatorGroup> mp_group, dp_group, stage_group, tp_group;
  std::unique_ptr<MixedPrecisionOptimizer> mpo;
  std::unique_ptr<dist::ZeroOptimizer> zero;
  std::unique_ptr<dist::GradientReducer> reducer;
  std::unique_ptr<dist::PipelineSchedule> schedule;
  std::unique_ptr<LRSchedule> lr_schedule;
  uint64_t data_seed = 0;
  // Gradient elements of tensor-parallel padding (a split dim that tp does not divide) over the model-parallel
  // group, counted once each: they are always 0, and one process does not have them, so StepStats::num_zeros
  // leaves them out.
  int64_t padding_elements = 0;

  Impl(const GPTConfig& c, const TrainOptions& o, const ParallelOptions& p, const TokenData& d,
       const Communicator& world)
      : config(c), options(o), parallel(p), data(d),
        groups(dist::make_groups({p.tp, p.pp, p.dp}, world)), embedding(dist::make_embedding_group(groups.pp)),
        booster(o.amp) {}

  Optimizer& optimizer() { return zero ? zero->optimizer() : mpo->optimizer(); }
  Tensor param(const std::string& name) const {
    for (const auto& [n, p] : stage->named_parameters())
      if (n == name) return p;
    fail("ParallelTrainer: this rank holds no parameter '", name, "'");
  }
  // This rank's slice of a full tensor of parameter `name` (as is when it is replicated over tp).
  Tensor slice(const std::string& name, const Tensor& full_value) const {
    const auto it = specs.find(name);
    return it == specs.end() ? full_value : dist::shard_of(full_value, it->second, groups.tp_rank, groups.layout.tp);
  }
  // A key of this rank's optimizer dict ("state.<j>.<buffer>", "master.<j>": j counts in local_order) as the
  // checkpoint names it (j becomes the parameter's index in full_order); any other key as it is.
  std::string file_key_of_local(const std::string& key) const {
    std::optional<size_t> j;
    std::string rest;
    if (auto s = split_state_key(key)) {
      j = s->first;
      rest = "." + s->second;
    } else if (key.rfind("master.", 0) == 0) {
      j = number_from_text<size_t>(std::string_view(key).substr(7));
    }
    if (!j || *j >= local_order.size()) return key;
    const auto i = std::find(full_order.begin(), full_order.end(), local_order[*j]) - full_order.begin();
    return (rest.empty() ? "master." : "state.") + std::to_string(i) + rest;
  }
  StateDict local_named_state();
  void load_named(const StateDict& state, bool with_optimizer);
};

ParallelTrainer::ParallelTrainer(const GPTConfig& config, const TrainOptions& options, const ParallelOptions& parallel,
                                 const TokenData& data, const Communicator& world) {
  config.validate();
  options.validate();
  parallel.validate(world.size());
  check(data.vocab_size <= config.vocab_size, "train_gpt: the data has ", data.vocab_size,
        " token ids but the model's vocab_size is ", config.vocab_size);
  check(data.n_train() > config.block_size + 1, "train_gpt: the training split (", data.n_train(),
        " tokens) is shorter than block + 2 = ", config.block_size + 2);
  check(parallel.pp <= config.n_layer, "train_gpt: --pp ", parallel.pp, " is more pipeline stages than the model's ",
        config.n_layer, " layers");
  check_tokens_per_step(options, config.block_size);
  const int64_t per_step = parallel.dp * parallel.micro_batches;
  check(options.batch % per_step == 0, "train_gpt: --batch ", options.batch, " must be divisible by --dp ", parallel.dp,
        " x --micro-batches ", parallel.micro_batches, " = ", per_step, " (equal micro-batches on every rank)");
  impl_ = std::make_unique<Impl>(config, options, parallel, data, world);
  Impl& m = *impl_;

  // Every rank: the full model from the seed (on the CPU), then its tensor-parallel split and its stage.
  m.full = std::make_unique<GPT>(config, options.seed);
  m.full_order = optimizer_order(*m.full);
  m.gpt = std::make_unique<dist::ParallelGPT>(*m.full, m.groups.tp);
  m.specs = dist::shard_specs(*m.gpt);
  m.stage = std::make_unique<GPTStage>(*m.gpt, m.groups.pp_rank, parallel.pp, m.booster);
  m.stage->to(options.device);
  m.stage->train();
  m.local_order = optimizer_order(*m.stage);

  // Each parameter counts once in the gradient norm over the model-parallel group.
  std::vector<bool> count_in_norm;
  for (const std::string& name : m.local_order) {
    bool counted = m.specs.count(name) || m.groups.tp_rank == 0;
    if (name == "transformer.wte.weight" && !m.stage->is_first()) counted = false;  // the tied copy
    count_in_norm.push_back(counted);
  }

  m.mp_group = std::make_unique<dist::CommunicatorGroup>(m.groups.model_parallel);
  if (options.amp.is_naive() && options.amp.naive.log_num_zeros_in_grad) {  // the only user of the count
    std::vector<double> padding = {0.0};
    for (size_t i = 0; i < m.local_order.size(); ++i) {
      const auto spec = m.specs.find(m.local_order[i]);
      if (spec == m.specs.end() || !count_in_norm[i]) continue;
      const dist::ShardSpec& s = spec->second;
      const Tensor p = m.param(m.local_order[i]);
      const int64_t slots = s.blocks * dist::shard_range(s, m.groups.tp_rank, parallel.tp).padding();
      padding[0] += static_cast<double>(slots * (p.numel() / p.size(s.dim)));
    }
    m.mp_group->all_reduce_sum(padding);
    m.padding_elements = static_cast<int64_t>(padding[0]);
  }
  m.dp_group = std::make_unique<dist::CommunicatorGroup>(m.groups.dp);
  BoostOptions boost;
  boost.clip_grad = options.grad_clip;
  boost.data_parallel_group = m.dp_group.get();    // NaiveAMPModel's buffer sync over the replicas
  boost.model_parallel_group = m.mp_group.get();   // found_inf and the grad norm over the model's parts
  if (options.amp.quantizes_gemms()) {  // the fp8 GEMMs cover the tensor-parallel layers and agree on scales
    m.stage_group = std::make_unique<dist::CommunicatorGroup>(m.groups.stage);
    m.tp_group = std::make_unique<dist::CommunicatorGroup>(m.groups.tp);
    boost.amax_group = m.stage_group.get();
    boost.amax_group_in_eval = m.tp_group.get();
    boost.linear_weights = parallel_linear_weights(*m.stage);
    boost.tensor_parallel_group = m.tp_group.get();
    collect_parallel_linear_names(*m.stage, "", boost.row_parallel_weights, boost.column_parallel_weights);
  }
  boost.print_verbose = m.groups.world.rank() == 0;  // every rank takes the same steps: one prints them
  BoostedParts parts = m.booster.boost_parts(*m.stage, make_optimizer(options, *m.stage), boost);
  parts.options.count_in_norm = count_in_norm;
  if (parallel.zero == 1) {
    dist::ZeroOptions zo;
    zo.clip_grad = parts.options.clip_grad;
    zo.model_parallel = m.mp_group.get();
    zo.count_in_norm = count_in_norm;
    zo.log_num_zeros_in_grad = parts.options.log_num_zeros_in_grad;
    zo.master_weights = parts.options.master_weights;  // false: Apex O3 (its fp16 parameters are sharded)
    zo.fp8_all_gather = options.amp.fp8_communication;
    m.zero = std::make_unique<dist::ZeroOptimizer>(std::move(parts.optimizer), std::move(parts.scalers),
                                                   m.groups.dp, zo);
  } else {
    m.mpo = std::make_unique<MixedPrecisionOptimizer>(std::move(parts.optimizer), std::move(parts.scalers),
                                                      std::move(parts.options));
    if (parallel.dp > 1)
      m.reducer = std::make_unique<dist::GradientReducer>(m.groups.dp, m.stage->parameters(),
                                                          static_cast<int64_t>(parallel.bucket_mb * 1024 * 1024),
                                                          options.amp.fp8_communication);
  }

  dist::PipelineOptions po;
  po.schedule =
      parallel.pp_schedule == "gpipe" ? dist::PipelineScheduleKind::GPipe : dist::PipelineScheduleKind::OneFOneB;
  po.device = options.device;
  po.scale_loss = [this](const Tensor& loss) {
    return impl_->zero ? impl_->zero->scale_loss(loss) : impl_->mpo->scale_loss(loss);
  };
  m.schedule = std::make_unique<dist::PipelineSchedule>(m.groups.pp, po);
  m.lr_schedule = make_schedule(options);
  m.data_seed = data_seed_of(options);
}

ParallelTrainer::~ParallelTrainer() = default;

const dist::ParallelGroups& ParallelTrainer::groups() const { return impl_->groups; }
Module& ParallelTrainer::stage_module() { return *impl_->stage; }
int64_t ParallelTrainer::skipped_steps() const {
  return impl_->zero ? impl_->zero->skipped_steps() : impl_->mpo->skipped_steps();
}
int64_t ParallelTrainer::buckets_overlapped() const {
  return impl_->reducer ? impl_->reducer->buckets_reduced_in_backward() : 0;
}

double ParallelTrainer::loss_scale() const {
  return impl_->zero ? impl_->zero->loss_scale() : impl_->mpo->loss_scale();
}

StepStats ParallelTrainer::train_step() {
  Impl& m = *impl_;
  StepStats stats;
  stats.step = step_;
  m.stage->train();
  const auto [x, y] = training_batch(m.data, m.options, m.config.block_size, m.data_seed, step_);
  const int64_t local = m.options.batch / m.parallel.dp;
  const int64_t M = m.parallel.micro_batches;
  const Tensor lx = x.narrow(0, m.groups.dp_rank * local, local).to(m.options.device);
  const Tensor ly = y.narrow(0, m.groups.dp_rank * local, local).to(m.options.device);
  if (m.zero) m.zero->zero_grad();
  else m.mpo->zero_grad();
  stats.loss_scale = loss_scale();
  m.stage->set_targets(dist::split_micro_batches(ly, M));
  // Dropout: every dropout of the GPT draws one number per element of a [rows, T, C] activation, in row order. A
  // pipeline's micro-batches already draw in row order; data-parallel rank d starts where the single process
  // would reach its first row, and after the step every rank is where the single process ends. So the masks are
  // the single process's at every layout.
  const uint64_t per_row = static_cast<uint64_t>(m.config.block_size * m.config.n_embd);
  std::vector<std::pair<Generator*, uint64_t>> streams;
  if (m.config.dropout > 0)
    for (const auto& [name, gen] : m.stage->named_generators()) {
      streams.emplace_back(gen, gen->offset);
      gen->offset += static_cast<uint64_t>(m.groups.dp_rank * local) * per_row;
    }
  // The dp all-reduce overlaps the backward unless the gradient hook must see the local gradients first.
  const bool overlap = m.reducer && !gradient_hook;
  if (overlap) m.reducer->begin(static_cast<int>(M));
  double local_loss = 0;
  try {
    local_loss = m.schedule->run(*m.stage, dist::split_micro_batches(lx, M));
  } catch (...) {
    if (overlap) m.reducer->abandon();
    throw;
  }
  if (overlap) m.reducer->finish();
  for (auto& [gen, base] : streams) {
    const uint64_t drawn = gen->offset - base - static_cast<uint64_t>(m.groups.dp_rank * local) * per_row;
    check(drawn == static_cast<uint64_t>(local) * per_row, "ParallelTrainer: a dropout stream drew ", drawn,
          " numbers for ", local, " rows, expected ", static_cast<uint64_t>(local) * per_row);
    gen->offset = base + static_cast<uint64_t>(m.options.batch) * per_row;
  }
  std::vector<double> loss = {local_loss};
  m.groups.dp.all_reduce(loss, Reduction::Sum);
  stats.loss = loss[0] / m.parallel.dp;  // equal local batches: the mean over the global batch
  if (gradient_hook) gradient_hook(step_, *m.stage);

  if (!m.gpt->lm_head && m.parallel.pp > 1 && (m.stage->is_first() || m.stage->is_last()))
    dist::all_reduce_tied_gradients(m.param("transformer.wte.weight"), m.embedding);
  if (m.reducer && !overlap) m.reducer->reduce();
  // The skipped count is the same on every rank: the skip decision is all-reduced over the model.
  const int64_t skipped = m.zero ? m.zero->skipped_steps() : m.mpo->skipped_steps();
  stats.lr = apply_schedule(m.optimizer(), *m.lr_schedule, m.options.amp.schedule_position(step_, skipped));
  // Through the booster either way: it prints the mode's verbose lines (on world rank 0 only).
  StepResult result;
  if (m.zero) {
    std::vector<const LossScaler*> scalers;
    for (int k = 0; k < m.zero->num_losses(); ++k) scalers.push_back(&m.zero->scaler(k));
    result = m.booster.step([&m] { return m.zero->step(); }, scalers);
  } else {
    result = m.booster.step(*m.mpo);
  }
  stats.grad_norm = result.grad_norm;
  stats.skipped = result.skipped;
  stats.num_zeros = result.num_zeros < 0 ? -1 : result.num_zeros - m.padding_elements;
  if (m.zero) m.zero->zero_grad();
  else m.mpo->zero_grad();
  ++step_;
  return stats;
}

double ParallelTrainer::evaluate() {
  Impl& m = *impl_;
  const int64_t T = m.config.block_size;
  const int64_t base = m.data.n_train();
  const int64_t windows = (m.data.n_val() - 1) / T;
  check(windows > 0, "train_gpt: the validation split (", m.data.n_val(), " tokens) is shorter than block + 1 = ",
        T + 1);
  // Trainer::evaluate's batches of `batch` windows; batch k goes to data-parallel replica k mod dp, where it is one
  // micro-batch of the pipeline.
  std::vector<Tensor> inputs, targets;
  std::vector<int64_t> rows_of;
  int64_t k = 0;
  for (int64_t k0 = 0; k0 < windows; k0 += m.options.batch, ++k) {
    if (k % m.parallel.dp != m.groups.dp_rank) continue;
    const int64_t rows = std::min(m.options.batch, windows - k0);
    std::vector<int64_t> xs(static_cast<size_t>(rows * T)), ys(static_cast<size_t>(rows * T));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t t = 0; t < T; ++t) {
        xs[r * T + t] = m.data.tokens[base + (k0 + r) * T + t];
        ys[r * T + t] = m.data.tokens[base + (k0 + r) * T + t + 1];
      }
    inputs.push_back(Tensor::from_vector(xs, {rows, T}).to(m.options.device));
    targets.push_back(Tensor::from_vector(ys, {rows, T}).to(m.options.device));
    rows_of.push_back(rows);
  }
  m.stage->eval();
  m.stage->set_targets(targets);
  const std::vector<double> losses = m.schedule->forward_only(*m.stage, inputs);
  m.stage->train();
  std::vector<double> total = {0.0};
  for (size_t i = 0; i < losses.size(); ++i) total[0] += losses[i] * static_cast<double>(rows_of[i]);
  m.groups.dp.all_reduce(total, Reduction::Sum);
  return total[0] / static_cast<double>(windows);
}

// ---- checkpoints ----

// This rank's model and optimizer state under parameter names, gathered over tp (and, by ZeRO's state_dict, over
// dp): "<name>" model values; "optimizer.state.<name>.<buffer>", "optimizer.master.<name>"; metadata
// "optimizer.state.<name>.step", every other optimizer entry as "optimizer.<key>", and "rng.<generator>.*".
StateDict ParallelTrainer::Impl::local_named_state() {
  StateDict named;
  for (const auto& [name, p] : stage->named_parameters()) named.tensors[name] = p.detach();
  if (zero && zero->publishes_fp8()) {
    // The model holds the fp8 round trip of the masters: the checkpoint keeps the masters themselves, and
    // loading publishes them through fp8 again (dist/zero.h), so a resumed run sees what this one sees.
    const std::vector<Tensor> params = zero->model_params(), masters = zero->master_values();
    std::map<const void*, Tensor> master_of;
    for (size_t i = 0; i < params.size(); ++i) master_of[params[i].impl_ptr().get()] = masters[i];
    for (const auto& [name, p] : stage->named_parameters())
      named.tensors[name] = master_of.at(p.impl_ptr().get()).to(p.dtype());
  }
  // The fp8 modes' scaling state, under the full model's names: the stage's tp and dp ranks hold the same one
  // (their amaxes are reduced), so the first rank's is every rank's.
  booster.save_scaling_state(named);
  const StateDict opt = zero ? zero->state_dict() : mpo->state_dict();
  for (const auto& [key, t] : opt.tensors) {
    if (auto s = split_state_key(key)) {
      named.tensors["optimizer.state." + local_order.at(s->first) + "." + s->second] = t;
    } else if (key.rfind("master.", 0) == 0) {
      named.tensors["optimizer.master." + local_order.at(std::stoull(key.substr(7)))] = t;
    } else {
      named.tensors["optimizer." + key] = t;
    }
  }
  for (const auto& [key, value] : opt.metadata) {
    if (auto s = split_state_key(key))
      named.metadata["optimizer.state." + local_order.at(s->first) + "." + s->second] = value;
    else named.metadata["optimizer." + key] = value;
  }
  for (const auto& [name, gen] : stage->named_generators()) {
    named.metadata["rng." + name + ".seed"] = std::to_string(gen->seed);
    named.metadata["rng." + name + ".offset"] = std::to_string(gen->offset);
  }
  // Over tp: every rank of the group holds the same names (one stage), so the collectives pair up in map order.
  for (auto& [key, t] : named.tensors) {
    const std::string name = key.rfind("optimizer.", 0) == 0 ? parameter_of(key.substr(10)) : key;
    const auto it = specs.find(name);
    if (it != specs.end()) t = dist::gather_shards(t, it->second, groups.tp);
  }
  return named;
}

StateDict ParallelTrainer::checkpoint() {
  Impl& m = *impl_;
  StateDict named = m.local_named_state();
  // Over pp: tp rank 0 of dp replica 0 of each stage hands its stage's part to stage 0 (world rank 0).
  if (m.groups.tp_rank != 0 || m.groups.dp_rank != 0) return {};
  if (m.groups.pp_rank != 0) {
    send_state(named, m.groups.pp, 0);
    return {};
  }
  for (int s = 1; s < m.parallel.pp; ++s) {
    const StateDict part = recv_state(m.groups.pp, s);
    for (const auto& [key, t] : part.tensors) named.tensors.emplace(key, t);  // the tied wte: stage 0's
    for (const auto& [key, value] : part.metadata) named.metadata.emplace(key, value);
  }

  // The single-process Trainer's file.
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < m.full_order.size(); ++i) index[m.full_order[i]] = i;
  StateDict state;
  for (const auto& [name, t] : m.full->named_parameters()) {
    const auto found = named.tensors.find(name);
    check(found != named.tensors.end(), "ParallelTrainer::checkpoint: no stage holds parameter '", name, "'");
    state.tensors[name] = is_floating(found->second.dtype()) ? found->second.to(DType::F32) : found->second;
  }
  for (const auto& [key, t] : named.tensors)
    if (key.rfind(Booster::kScalingStatePrefix, 0) == 0) state.tensors[key] = t;
  for (const auto& [key, t] : named.tensors) {
    if (key.rfind("optimizer.", 0) != 0) continue;
    const std::string inner = key.substr(10);
    const std::string name = parameter_of(inner);
    if (name.empty()) {
      state.tensors[key] = t;
    } else if (inner.rfind("master.", 0) == 0) {
      state.tensors["optimizer.master." + std::to_string(index.at(name))] = t;
    } else {
      state.tensors["optimizer.state." + std::to_string(index.at(name)) + inner.substr(6 + name.size())] = t;
    }
  }
  // The full parameter counts of nanoGPT's two groups.
  int64_t decay = 0;
  for (const auto& [name, p] : m.full->named_parameters()) decay += p.dim() >= 2;
  for (const auto& [key, value] : named.metadata) {
    if (key.rfind("optimizer.state.", 0) == 0) {
      const std::string inner = key.substr(10);
      const std::string name = parameter_of(inner);
      state.metadata["optimizer.state." + std::to_string(index.at(name)) + inner.substr(6 + name.size())] = value;
    } else {
      state.metadata[key] = value;
    }
  }
  state.metadata["optimizer.param_groups.0.params"] = std::to_string(decay);
  state.metadata["optimizer.param_groups.1.params"] = std::to_string(static_cast<int64_t>(m.full_order.size()) - decay);
  m.config.to_metadata(state.metadata);
  if (!m.data.vocab.empty()) state.metadata["vocab"] = vocab_to_metadata(m.data.vocab);
  for (const auto& [key, value] : m.options.to_metadata()) state.metadata[key] = value;
  state.metadata["step"] = std::to_string(step_);
  state.metadata["data.seed"] = std::to_string(m.data_seed);
  state.metadata["data.position"] = std::to_string(step_);
  for (const auto& [name, gen] : m.full->named_generators())
    for (const char* part : {".seed", ".offset"})
      check(state.metadata.count("rng." + name + part), "ParallelTrainer::checkpoint: no stage holds generator '",
            name, "'");
  return state;
}

void ParallelTrainer::save_checkpoint(const std::string& path) {
  const StateDict state = checkpoint();
  // Rank 0 writes; a failure there is an Error on every rank (the flag travels in the barrier's place).
  std::vector<double> failed = {0.0};
  std::string message;
  if (impl_->groups.world.rank() == 0) {
    try {
      save_safetensors(path, state);
    } catch (const Error& e) {
      failed[0] = 1.0;
      message = e.what();
    }
  }
  impl_->groups.world.all_reduce(failed, Reduction::Max);
  if (failed[0] != 0.0) {
    if (!message.empty()) throw Error(message);
    fail("ParallelTrainer::save_checkpoint: rank 0 could not write '", path, "'");
  }
}

// Model values (and with_optimizer, the optimizer state) from a single-process file, sliced to this rank.
void ParallelTrainer::Impl::load_named(const StateDict& state, bool with_optimizer) {
  const char* what = "training checkpoint";
  std::map<std::string, Tensor> full_params;
  for (const auto& [name, p] : full->named_parameters()) full_params[name] = p;
  std::vector<std::pair<Tensor, Tensor>> copies;  // parameter <- value, done after every check passed
  // Every parameter of the full model, so that every rank finds the same fault whatever its stage.
  for (const auto& [name, param] : full_params) {
    const auto found = state.tensors.find(name);
    check(found != state.tensors.end(), what, ": missing tensor '", name, "'");
    const Tensor& file = found->second;
    check(file.defined(), what, ": tensor '", name, "' is undefined");
    check(file.shape() == param.shape(), what, ": tensor '", name, "' is ", file.described(), ", expected shape ",
          param.described());
    // As the single-process Trainer: a floating value takes the parameter's floating dtype (files hold fp32), any
    // other dtype must be the parameter's own.
    check(file.dtype() == param.dtype() || (is_floating(file.dtype()) && is_floating(param.dtype())), what,
          ": tensor '", name, "' has ", file.described(), ", expected ", param.described());
    const std::string bad = first_bad_value(file);
    check(bad.empty(), what, ": tensor '", name, "' (", file.described(), ") must be finite, but ", bad);
  }
  // This rank's parameters in their own dtypes (a 16-bit stage under naive AMP): finite there too. Only the
  // ranks holding such a parameter see an overflow in the conversion, so the ranks agree before going on.
  std::string conversion_error;
  for (const auto& [name, p] : stage->named_parameters()) {
    const Tensor& file = state.tensors.at(name);
    const Tensor value = file.dtype() == p.dtype() ? file : file.to(p.dtype());
    const std::string bad = value.dtype() == file.dtype() ? std::string() : first_bad_value(value);
    if (!bad.empty() && conversion_error.empty())
      conversion_error = std::string(what) + ": tensor '" + name + "' (" + file.description() +
                         ") must be finite in the model's " + dtype_name(value.dtype()) + ", but " + bad;
    copies.emplace_back(p, slice(name, value));
  }
  std::vector<double> failed = {conversion_error.empty() ? 0.0 : 1.0};
  groups.world.all_reduce(failed, Reduction::Max);
  if (!conversion_error.empty()) throw Error(conversion_error);
  check(failed[0] == 0.0, what, ": another rank found a tensor that is not finite in its model's dtype");
  for (const auto& [name, t] : state.tensors)
    check(name.rfind("optimizer.", 0) == 0 || full_params.count(name), what, ": unexpected tensor '", name,
          "' (not a parameter of this model)");
  StateDict local;
  if (with_optimizer) {
    std::map<std::string, size_t> local_index;
    for (size_t j = 0; j < local_order.size(); ++j) local_index[local_order[j]] = j;
    const StateDict opt = optimizer_part(state);
    for (const auto& [key, t] : opt.tensors) {
      size_t i;
      std::string rest;
      if (auto s = split_state_key(key)) {
        i = s->first;
        rest = "state.%." + s->second;
      } else if (key.rfind("master.", 0) == 0) {
        const std::string index = key.substr(7);
        const std::optional<size_t> parsed = number_from_text<size_t>(index);
        check(parsed.has_value(), what, ": tensor 'optimizer.", echo(key), "', expected master.<parameter index>");
        i = *parsed;
        rest = "master.%";
      } else {
        local.tensors[key] = t;
        continue;
      }
      check(i < full_order.size(), what, ": tensor 'optimizer.", echo(key), "' names parameter ", i, " of ",
            full_order.size());
      const Tensor& param = full_params.at(full_order[i]);
      check(t.shape() == param.shape(), what, ": tensor 'optimizer.", echo(key), "' is ", t.described(),
            ", expected the shape of parameter '", full_order[i], "', ", param.described());
      const auto j = local_index.find(full_order[i]);
      if (j == local_index.end()) continue;  // another stage's parameter
      rest.replace(rest.find('%'), 1, std::to_string(j->second));
      local.tensors[rest] = slice(full_order[i], t);
    }
    for (const auto& [key, value] : opt.metadata) {
      if (auto s = split_state_key(key)) {
        check(s->first < full_order.size(), what, ": metadata entry 'optimizer.", echo(key), "' names parameter ",
              s->first, " of ", full_order.size());
        const auto j = local_index.find(full_order[s->first]);
        if (j != local_index.end()) local.metadata["state." + std::to_string(j->second) + "." + s->second] = value;
      } else {
        local.metadata[key] = value;
      }
    }
    int64_t decay = 0;
    for (const auto& [name, p] : stage->named_parameters()) decay += p.dim() >= 2;
    local.metadata["param_groups.0.params"] = std::to_string(decay);
    local.metadata["param_groups.1.params"] = std::to_string(static_cast<int64_t>(local_order.size()) - decay);
  }
  std::vector<Tensor> old_values;  // for a rejected optimizer state: the weights go back
  {
    NoGradGuard no_grad;
    for (auto& [param, value] : copies) {
      if (with_optimizer) old_values.push_back(param.detach().clone());
      param.copy_(value);
    }
  }
  if (with_optimizer) {
    const auto restore = [&] {
      NoGradGuard no_grad;
      for (size_t k = 0; k < copies.size(); ++k) copies[k].first.copy_(old_values[k]);
    };
    try {
      if (zero) zero->load_state_dict(local);  // collective: it throws on every dp rank or on none
      else mpo->load_state_dict(local);
    } catch (const Error& error) {
      restore();
      fail(what, ": ", optimizer_error_in_file_keys(error.what(), [&](const std::string& key) {
             return "optimizer." + file_key_of_local(key);
           }));
    } catch (...) {
      restore();
      throw;
    }
  } else if (zero) {
    zero->reload_masters();
  } else {
    mpo->reload_masters();
  }
}

void ParallelTrainer::load_checkpoint(const StateDict& state) {
  Impl& m = *impl_;
  const int64_t step = validate_checkpoint(state, m.config, m.options, m.data);
  // The whole model's generator entries first: a bad one then fails on every rank, not only on the stage
  // that holds it (the others would wait in load_named's collectives).
  checkpoint_generators(state, *m.full);
  const auto generators = checkpoint_generators(state, *m.stage);
  // The fp8 modes' scaling state of this stage's layers, checked on every rank before anything changes: one
  // stage lacking its entries fails the job on every rank (the others would wait for it in a collective).
  StateDict old_scaling;
  m.booster.save_scaling_state(old_scaling);
  std::string scaling_error;
  try {
    m.booster.load_scaling_state(state);
  } catch (const Error& e) {
    scaling_error = e.what();
  }
  std::vector<double> failed = {scaling_error.empty() ? 0.0 : 1.0};
  m.groups.world.all_reduce(failed, Reduction::Max);
  if (failed[0] != 0.0) {
    if (scaling_error.empty()) m.booster.load_scaling_state(old_scaling);
    fail("training checkpoint: ", scaling_error.empty() ? std::string("another stage's fp8 scaling state was refused")
                                                       : scaling_error);
  }
  StateDict without_scaling = state;  // the fp8 scaling entries are read above; the rest names parameters
  std::erase_if(without_scaling.tensors,
                [](const auto& entry) { return entry.first.rfind(Booster::kScalingStatePrefix, 0) == 0; });
  try {
    m.load_named(without_scaling, true);
  } catch (...) {
    m.booster.load_scaling_state(old_scaling);
    throw;
  }
  for (auto& [gen, g] : generators) *gen = g;
  step_ = step;
}

void ParallelTrainer::load_weights(const StateDict& state) { impl_->load_named(model_part(state), false); }

StateDict ParallelTrainer::full_weights() { return model_part(checkpoint()); }

}  // namespace mixtape
