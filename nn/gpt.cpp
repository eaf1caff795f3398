#include "nn/gpt.h"

#include <charconv>
#include <cmath>
#include <cstdint>
#include <set>
#include <sstream>
#include <string>

#include "io/state_dict.h"
#include "tensor/autograd_node.h"
#include "tensor/error.h"

namespace mixtape {

namespace {

// SplitMix64's finaliser: well-spread seeds for neighbouring inputs.
uint64_t mix_seed(uint64_t seed, uint64_t index) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ULL * (index + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

const char* to_string(NormKind norm) { return norm == NormKind::LayerNorm ? "layernorm" : "rmsnorm"; }

const char* to_string(Activation activation) {
  switch (activation) {
    case Activation::Gelu: return "gelu";
    case Activation::GeluTanh: return "gelu_tanh";
    case Activation::SwiGLU: return "swiglu";
  }
  return "?";
}

void GPTConfig::validate() const {
  check(n_layer > 0, "GPTConfig: n_layer must be positive, got ", n_layer);
  check(n_head > 0, "GPTConfig: n_head must be positive, got ", n_head);
  check(n_embd > 0, "GPTConfig: n_embd must be positive, got ", n_embd);
  // A SwiGLU c_fc has 8 * n_embd rows: keep every layer size an int64.
  check(n_embd < (int64_t{1} << 60), "GPTConfig: n_embd must be below 2^60, got ", n_embd);
  check(block_size > 0, "GPTConfig: block_size must be positive, got ", block_size);
  check(vocab_size > 0, "GPTConfig: vocab_size must be positive, got ", vocab_size);
  check(n_embd % n_head == 0, "GPTConfig: n_embd (", n_embd, ") must be divisible by n_head (", n_head, ")");
  check(dropout >= 0 && dropout < 1, "GPTConfig: dropout must be in [0, 1), got ", dropout);
  check(std::isfinite(norm_eps) && norm_eps > 0, "GPTConfig: norm_eps must be positive and finite, got ", norm_eps);
}

void GPTConfig::to_metadata(std::map<std::string, std::string>& metadata) const {
  auto number = [](double value) {
    std::ostringstream text;
    text.precision(17);
    text << value;
    return text.str();
  };
  metadata["n_layer"] = std::to_string(n_layer);
  metadata["n_head"] = std::to_string(n_head);
  metadata["n_embd"] = std::to_string(n_embd);
  metadata["block_size"] = std::to_string(block_size);
  metadata["vocab_size"] = std::to_string(vocab_size);
  metadata["bias"] = bias ? "true" : "false";
  metadata["dropout"] = number(dropout);
  metadata["tie_embeddings"] = tie_embeddings ? "true" : "false";
  metadata["norm"] = to_string(norm);
  metadata["activation"] = to_string(activation);
  metadata["norm_eps"] = number(norm_eps);
}

GPTConfig GPTConfig::from_metadata(const std::map<std::string, std::string>& metadata) {
  GPTConfig config;
  auto get = [&metadata](const char* key) -> const std::string* {
    auto it = metadata.find(key);
    return it == metadata.end() ? nullptr : &it->second;
  };
  auto bad = [](const char* key, const std::string& value, const char* expected) {
    fail("GPTConfig: metadata '", key, "' = '", echo(value), "' is not ", expected);
  };
  // The whole text, as written (number_from_text: no leading space or '+', unlike std::stoll), or an error.
  auto integer = [&](const char* key, int64_t& field) {
    if (const std::string* value = get(key)) {
      const std::optional<int64_t> read = number_from_text<int64_t>(*value);
      if (!read) bad(key, *value, "an integer");
      field = *read;
    }
  };
  auto real = [&](const char* key, double& field) {
    if (const std::string* value = get(key)) {
      const std::optional<double> read = number_from_text<double>(*value);
      if (!read) bad(key, *value, "a number");
      field = *read;
    }
  };
  auto boolean = [&](const char* key, bool& field) {
    if (const std::string* value = get(key)) {
      if (*value == "true" || *value == "True" || *value == "1") field = true;
      else if (*value == "false" || *value == "False" || *value == "0") field = false;
      else bad(key, *value, "true or false");
    }
  };
  integer("n_layer", config.n_layer);
  integer("n_head", config.n_head);
  integer("n_embd", config.n_embd);
  integer("block_size", config.block_size);
  integer("vocab_size", config.vocab_size);
  boolean("bias", config.bias);
  real("dropout", config.dropout);
  boolean("tie_embeddings", config.tie_embeddings);
  real("norm_eps", config.norm_eps);
  if (const std::string* value = get("norm")) {
    if (*value == "layernorm") config.norm = NormKind::LayerNorm;
    else if (*value == "rmsnorm") config.norm = NormKind::RMSNorm;
    else bad("norm", *value, "layernorm or rmsnorm");
  }
  if (const std::string* value = get("activation")) {
    if (*value == "gelu") config.activation = Activation::Gelu;
    else if (*value == "gelu_tanh") config.activation = Activation::GeluTanh;
    else if (*value == "swiglu") config.activation = Activation::SwiGLU;
    else bad("activation", *value, "gelu, gelu_tanh or swiglu");
  }
  config.validate();
  return config;
}

std::vector<std::pair<std::string, Shape>> gpt_parameter_shapes(const GPTConfig& config) {
  config.validate();
  const int64_t C = config.n_embd, V = config.vocab_size, hidden = 4 * C;
  std::vector<std::pair<std::string, Shape>> shapes;
  auto linear = [&](const std::string& name, int64_t in, int64_t out, bool bias) {
    shapes.emplace_back(name + ".weight", Shape{out, in});
    if (bias) shapes.emplace_back(name + ".bias", Shape{out});
  };
  auto norm = [&](const std::string& name) {
    shapes.emplace_back(name + ".weight", Shape{C});
    if (config.norm == NormKind::LayerNorm && config.bias) shapes.emplace_back(name + ".bias", Shape{C});
  };
  shapes.emplace_back("transformer.wte.weight", Shape{V, C});
  shapes.emplace_back("transformer.wpe.weight", Shape{config.block_size, C});
  for (int64_t layer = 0; layer < config.n_layer; ++layer) {
    const std::string block = "transformer.h." + std::to_string(layer) + ".";
    norm(block + "ln_1");
    linear(block + "attn.c_attn", C, 3 * C, config.bias);
    linear(block + "attn.c_proj", C, C, config.bias);
    norm(block + "ln_2");
    linear(block + "mlp.c_fc", C, config.activation == Activation::SwiGLU ? 2 * hidden : hidden, config.bias);
    linear(block + "mlp.c_proj", hidden, C, config.bias);
  }
  norm("transformer.ln_f");
  if (!config.tie_embeddings) linear("lm_head", C, V, false);
  return shapes;
}

void check_gpt_shapes(const GPTConfig& config, const std::map<std::string, Tensor>& tensors,
                      const std::string& what) {
  config.validate();
  std::ostringstream described;
  described << "n_layer " << config.n_layer << ", n_embd " << config.n_embd << ", block_size " << config.block_size
            << ", vocab_size " << config.vocab_size;
  const std::string config_text = described.str();
  // The layer count first: listing the expected parameters takes memory in proportion to n_layer, and the
  // file's own blocks are bounded by its size.
  std::set<int64_t> blocks;
  const std::string prefix = "transformer.h.";
  for (const auto& [name, t] : tensors) {
    if (name.rfind(prefix, 0) != 0) continue;
    int64_t index = 0;
    const char* first = name.data() + prefix.size();
    const auto [end, ec] = std::from_chars(first, name.data() + name.size(), index);
    if (ec == std::errc() && end != first && *end == '.') blocks.insert(index);
  }
  check(static_cast<int64_t>(blocks.size()) == config.n_layer, what, ": the config says n_layer = ", config.n_layer,
        " but the file holds ", blocks.size(), " blocks (transformer.h.<i>.*)");
  const std::vector<std::pair<std::string, Shape>> expected = gpt_parameter_shapes(config);
  std::set<std::string> names;
  for (const auto& [name, shape] : expected) {
    names.insert(name);
    const auto found = tensors.find(name);
    check(found != tensors.end() && found->second.defined(), what, ": missing tensor '", name, "' (expected ",
          shape_text(shape), " for the config ", config_text, ")");
    check(found->second.shape() == shape, what, ": tensor '", name, "' is ", shape_text(found->second.shape()),
          " but the config (", config_text, ") expects ", shape_text(shape));
  }
  for (const auto& [name, t] : tensors)
    check(names.count(name) == 1, what, ": unexpected tensor '", name, "' (not a parameter of a GPT with ",
          config_text, ")");
}

std::shared_ptr<UnaryModule> make_norm(const GPTConfig& config) {
  if (config.norm == NormKind::RMSNorm) return std::make_shared<RMSNorm>(config.n_embd, config.norm_eps);
  return std::make_shared<LayerNorm>(config.n_embd, config.bias, config.norm_eps);
}

MLP::MLP(const GPTConfig& config, uint64_t seed) : activation(config.activation) {
  const int64_t C = config.n_embd, hidden = 4 * C;
  const int64_t fc_out = activation == Activation::SwiGLU ? 2 * hidden : hidden;
  c_fc = register_module("c_fc", std::make_shared<Linear>(C, fc_out, config.bias, seed));
  c_proj = register_module("c_proj", std::make_shared<Linear>(hidden, C, config.bias, seed + 2));
  dropout = register_module("dropout", std::make_shared<Dropout>(config.dropout, seed + 4));
}

Tensor MLP::forward(const Tensor& x) {
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

Block::Block(const GPTConfig& config, uint64_t seed) {
  ln_1 = register_module("ln_1", make_norm(config));
  attn = register_module("attn", std::make_shared<CausalSelfAttention>(config.n_embd, config.n_head, config.bias,
                                                                       config.dropout, seed));
  ln_2 = register_module("ln_2", make_norm(config));
  mlp = register_module("mlp", std::make_shared<MLP>(config, seed + 8));
}

Tensor Block::forward(const Tensor& x) {
  const Tensor after_attention = add(x, (*attn)((*ln_1)(x)));
  return add(after_attention, (*mlp)((*ln_2)(after_attention)));
}

GPT::GPT(const GPTConfig& config, uint64_t seed) : config_(config) {
  config.validate();
  // The parameters, roughly (12 C^2 a layer, the embeddings; in double: the counts may not fit int64), bounded
  // at 2^40 (4 TiB in fp32): a model beyond any machine fails here, not after minutes of allocating layers.
  // (Not in validate(): check_gpt_shapes compares a file's config with its tensors whatever its size.)
  const double C = static_cast<double>(config.n_embd);
  const double parameters = static_cast<double>(config.n_layer) * 12 * C * C +
                            (static_cast<double>(config.vocab_size) + static_cast<double>(config.block_size)) * C;
  check(parameters < 0x1p40, "GPT: ", config.n_layer, " layers of width ", config.n_embd, " (vocab ",
        config.vocab_size, ", block ", config.block_size, ") make about ", parameters,
        " parameters, more than the 2^40 this engine builds");
  // Dropout streams: a distinct seed per layer, mixed from `seed` (weights are re-drawn by init_weights below).
  const uint64_t stream_base = mix_seed(seed, 0xD209);
  transformer = register_module("transformer", std::make_shared<Module>());
  wte = transformer->register_module("wte", std::make_shared<Embedding>(config.vocab_size, config.n_embd));
  wpe = transformer->register_module("wpe", std::make_shared<Embedding>(config.block_size, config.n_embd));
  drop = transformer->register_module("drop", std::make_shared<Dropout>(config.dropout, stream_base));
  h = transformer->register_module("h", std::make_shared<ModuleList<Block>>());
  for (int64_t layer = 0; layer < config.n_layer; ++layer)
    h->push_back(std::make_shared<Block>(config, stream_base + 16 * static_cast<uint64_t>(layer + 1)));
  ln_f = transformer->register_module("ln_f", make_norm(config));
  if (!config.tie_embeddings)
    lm_head = register_module("lm_head", std::make_shared<Linear>(config.n_embd, config.vocab_size, false));
  init_weights(seed);
}

void GPT::init_weights(uint64_t seed) {
  NoGradGuard no_grad;
  const double std_weight = 0.02;
  const double std_residual = 0.02 / std::sqrt(2.0 * static_cast<double>(config_.n_layer));
  uint64_t index = 0;
  for (const auto& [name, parameter] : named_parameters()) {
    Tensor target = parameter;  // a handle: fills write into the module's tensor
    const uint64_t parameter_seed = mix_seed(seed, index++);
    if (target.dim() == 2) {
      const double std_dev = ends_with(name, "c_proj.weight") ? std_residual : std_weight;
      target.copy_(Tensor::randn(target.shape(), parameter_seed, DType::F64, target.device()) * std_dev);
    } else if (ends_with(name, ".bias")) {
      target.zero_();
    } else {
      target.fill_(1.0);  // norm weights
    }
  }
}

GPTOutput GPT::forward(const Tensor& idx, const Tensor& targets) {
  check(idx.defined() && idx.dim() == 2 && (idx.dtype() == DType::I64 || idx.dtype() == DType::I32),
        "GPT: expected idx [B, T] of i32/i64, got ", idx.described());
  const int64_t B = idx.size(0), T = idx.size(1), V = config_.vocab_size;
  check(T <= config_.block_size, "GPT: cannot forward a sequence of length ", T, " (idx ", idx.described(),
        "): block_size is only ", config_.block_size);
  const Tensor positions = Tensor::arange(0, static_cast<double>(T), 1, DType::I64, idx.device());
  Tensor x = (*drop)(add((*wte)(idx), (*wpe)(positions)));  // [B, T, C] + [T, C]
  for (const auto& block : *h) x = (*block)(x);
  x = (*ln_f)(x);
  GPTOutput output;
  // Tied: linear reads wte [V, C] in place (the GEMM transposes it), so autocast casts the leaf (contiguous, cached)
  // rather than a transposed view, and its gradient arrives in wte's own layout.
  output.logits = lm_head ? (*lm_head)(x) : linear(x, wte->weight);
  if (targets.defined()) {
    check(targets.shape() == idx.shape(), "GPT: targets ", targets.described(), " must have idx's shape ",
          idx.described());
    output.loss = softmax_cross_entropy(output.logits.view({B * T, V}), targets.reshape({B * T}), -1);
  }
  return output;
}

}  // namespace mixtape
