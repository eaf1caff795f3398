#include "amp/config.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <set>
#include <utility>

#include "io/json.h"
#include "tensor/error.h"

namespace mixtape {

namespace {

// The items of a list of strings (or string_views), joined by ", ".
template <class Items>
std::string join(const Items& items) {
  std::string out;
  for (const auto& item : items) (out += out.empty() ? "" : ", ") += item;
  return out;
}

std::optional<DType> dtype_from_name(const std::string& who, const std::string& key, const std::string& name) {
  if (name == "fp32" || name == "float32") return DType::F32;
  if (name == "fp16" || name == "float16") return DType::F16;
  if (name == "bf16" || name == "bfloat16") return DType::BF16;
  fail(who, ": ", key, " must be \"fp32\", \"fp16\" or \"bf16\", got \"", echo(name), "\"");
}

const char* dtype_text(DType dtype) {
  return dtype == DType::F16 ? "fp16" : dtype == DType::BF16 ? "bf16" : "fp32";
}

// Runs `build` (a scaler constructor, which validates its options); an Error it throws is rethrown with
// `context` (the mode, and what the options were for) in front.
template <class Build>
void with_context(const std::string& context, const Build& build) {
  try {
    build();
  } catch (const Error& error) {
    fail(context, ": ", error.what());
  }
}

// The shortest text that reads back as `value` (16777216, 0.25), or "unset".
std::string number_text(std::optional<double> value) { return value ? exact_number_text(*value) : "unset"; }

// Python's float() of a string (Apex's loss_scale): surrounding blanks allowed, the whole rest a number.
std::optional<double> number_from_text(const std::string& text) {
  const size_t first = text.find_first_not_of(" \t\n\r");
  if (first == std::string::npos) return std::nullopt;
  const std::string trimmed = text.substr(first, text.find_last_not_of(" \t\n\r") + 1 - first);
  if (trimmed.find_first_of("xX") != std::string::npos) return std::nullopt;  // no hex floats in Python
  char* end = nullptr;
  const double value = std::strtod(trimmed.c_str(), &end);
  if (end != trimmed.c_str() + trimmed.size()) return std::nullopt;
  return value;
}

}  // namespace

DynamicLossScaler ApexProperties::dynamic_scaler() const {
  return apex_dynamic_scaler(65536.0, 2000, min_loss_scale, max_loss_scale);
}

ApexProperties ApexProperties::for_opt_level(const std::string& opt_level, DType cast_dtype) {
  ApexProperties p;
  p.opt_level = opt_level;
  if (opt_level == "O0") {
    p.cast_model_type = DType::F32;
    p.patch_torch_functions = false;
    p.master_weights = false;
    p.loss_scale = 1.0;
  } else if (opt_level == "O1") {
    p.patch_torch_functions = true;
    p.master_weights = false;
  } else if (opt_level == "O2") {
    p.cast_model_type = cast_dtype;
    p.patch_torch_functions = false;
    p.keep_batchnorm_fp32 = true;
    p.master_weights = true;
  } else if (opt_level == "O3") {
    p.cast_model_type = cast_dtype;
    p.patch_torch_functions = false;
    p.keep_batchnorm_fp32 = false;
    p.master_weights = false;
    p.loss_scale = 1.0;
  } else {
    fail("AmpConfig fp16_apex: unknown opt_level \"", echo(opt_level), "\" (expected O0, O1, O2 or O3; the letter O, "
         "not zero)");
  }
  return p;
}

const std::vector<std::string>& AmpConfig::modes() {
  static const std::vector<std::string> names = precision_mode_names();
  return names;
}

AmpConfig AmpConfig::parse(std::string_view text) {
  AmpConfig config;
  const size_t colon = text.find(':');
  const std::string name(text.substr(0, colon));
  const std::optional<PrecisionMode> mode = find_precision_mode(name);
  if (!mode.has_value())
    fail("AmpConfig: unknown mixed_precision \"", echo(name), "\" (expected one of ", join(modes()), ")");
  config.mode = *mode;
  const bool apex = config.family() == ModeFamily::Apex;
  if (colon != std::string_view::npos) {
    if (!apex)
      fail("AmpConfig: \"", echo(text), "\": only fp16_apex takes an opt level after a colon (fp16_apex:O0 .. ",
           "fp16_apex:O3)");
    config.apex = ApexProperties::for_opt_level(std::string(text.substr(colon + 1)), config.row().compute_dtype);
  } else if (apex) {
    config.apex = ApexProperties::for_opt_level("O1", config.row().compute_dtype);  // amp.initialize's default
  }
  if (config.family() == ModeFamily::PytorchAmp) config.grad_scaler.enabled = config.row().grad_scaler_enabled;
  config.validate();
  return config;
}

namespace {

// The typed readers of option values, with errors naming the mode ("AmpConfig fp16_apex") and the key.
struct OptionReader {
  std::string who;
  double number(const Json& v, const std::string& key) const {
    check(v.is_number(), who, ": ", key, " must be a number, got ", json::kind_name(v));
    return json::as_number(v);
  }
  int64_t integer(const Json& v, const std::string& key) const {
    if (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>() && std::abs(v.get<double>()) < 9.0e18)
      return static_cast<int64_t>(v.get<double>());  // 1e3 written as a float
    check(v.is_number_integer(), who, ": ", key, " must be an integer, got ", json::kind_name(v));
    return json::as_integer(v);
  }
  bool boolean(const Json& v, const std::string& key) const {
    check(v.is_boolean(), who, ": ", key, " must be true or false, got ", json::kind_name(v));
    return json::as_bool(v);
  }
  DType dtype(const Json& v, const std::string& key) const {
    check(v.is_string(), who, ": ", key, " must be \"fp32\", \"fp16\", \"bf16\" or null, got ",
          json::kind_name(v));
    return *dtype_from_name(who, key, json::as_string(v));
  }
};

// The mode a JSON config is for: its "mixed_precision", or `mode` (train_gpt --precision) when it has none;
// both given, they must agree, and `mode` keeps its opt level ("fp16_apex:O2").
std::string mode_of(const Json& root, std::optional<std::string_view> mode) {
  const Json* given = json::find(root, "mixed_precision");
  if (!given) {
    check(mode.has_value(), "AmpConfig: the JSON config has no \"mixed_precision\" (one of ",
          join(AmpConfig::modes()), ")");
    return std::string(*mode);
  }
  check(given->is_string(), "AmpConfig: mixed_precision must be a string, got ", json::kind_name(*given));
  const std::string name = json::as_string(*given);
  if (mode && *mode != name && mode->substr(0, mode->find(':')) != name)
    fail("AmpConfig: the config says mixed_precision \"", echo(name), "\" but \"", echo(*mode), "\" was asked for");
  return mode ? std::string(*mode) : name;
}

// Every key is an option of the mode before any value is read: {"opt_level": 5} for fp16 is an unknown
// option, not a badly typed opt level.
void check_option_keys(const Json& root, const PrecisionModeRow& row, const std::string& who) {
  const std::span<const std::string_view> allowed = row.option_keys;
  for (const auto& [key, value] : json::as_object(root)) {
    if (key == "mixed_precision") continue;
    const bool known = std::find(allowed.begin(), allowed.end(), key) != allowed.end() ||
                       std::find(kCommonAmpKeys.begin(), kCommonAmpKeys.end(), key) != kCommonAmpKeys.end();
    if (!known)
      fail(who, ": unknown option \"", echo(key), "\" (", row.name, " takes ",
           allowed.empty() ? std::string("no options of its own") : join(allowed), "; every mode takes ",
           join(kCommonAmpKeys), ")");
  }
}

// The value of the word `value` among `words` (each a word and its value), else an Error naming `key` and
// listing the words.
template <class Value, size_t N>
Value word_option(const std::string& who, const std::string& key, const Json& value,
                  const std::array<std::pair<std::string_view, Value>, N>& words) {
  std::string expected;
  for (size_t i = 0; i < N; ++i) {
    expected += i == 0 ? "" : i + 1 == N ? " or " : ", ";
    expected.append(1, '"').append(words[i].first).append(1, '"');
  }
  check(value.is_string(), who, ": ", key, " must be ", expected, ", got ", json::kind_name(value));
  const std::string& text = json::as_string(value);
  for (const auto& [name, result] : words)
    if (text == name) return result;
  fail(who, ": ", key, " must be ", expected, ", got \"", echo(text), "\"");
}

constexpr std::array<std::pair<std::string_view, LrScheduleOnSkip>, 2> kScheduleOnSkipWords{
    {{"advance", LrScheduleOnSkip::Advance}, {"hold", LrScheduleOnSkip::Hold}}};
constexpr std::array<std::pair<std::string_view, NaiveLossScaler>, 2> kNaiveLossScalerWords{
    {{"dynamic", NaiveLossScaler::Dynamic}, {"none", NaiveLossScaler::None}}};

constexpr std::array<std::pair<std::string_view, Fp8Format>, 2> kFp8FormatWords{
    {{"hybrid", Fp8Format::Hybrid}, {"e4m3", Fp8Format::E4M3}}};
constexpr std::array<std::pair<std::string_view, AmaxComputeAlgo>, 2> kAmaxAlgoWords{
    {{"max", AmaxComputeAlgo::Max}, {"most_recent", AmaxComputeAlgo::MostRecent}}};
constexpr std::array<std::pair<std::string_view, BlockScale>, 2> kMxRoundingWords{
    {{"floor", BlockScale::E8M0Floor}, {"ceil", BlockScale::E8M0Ceil}}};

// The word of `value` among `words` (validate() has refused a value without one).
template <class Value, size_t N>
std::string word_of(Value value, const std::array<std::pair<std::string_view, Value>, N>& words) {
  for (const auto& [name, v] : words)
    if (v == value) return std::string(name);
  return "unknown";
}

// A list of non-empty module names (exclude).
std::vector<std::string> read_module_names(const OptionReader& read, const std::string& key, const Json& value) {
  check(value.is_array(), read.who, ": ", key, " must be a list of module names like [\"lm_head\"], got ",
        json::kind_name(value));
  std::vector<std::string> names;
  for (const Json& name : json::as_array(value)) {
    check(name.is_string() && !json::as_string(name).empty(), read.who, ": ", key,
          " must list non-empty module names, got ", json::dump(name));
    names.push_back(json::as_string(name));
  }
  return names;
}

// Each family's reader sets the option `key` from `value`, and says whether `key` is one of its options.
bool read_grad_scaler_option(const OptionReader& read, const std::string& key, const Json& value,
                             GradScalerOptions& g) {
  if (key == "init_scale") g.init_scale = read.number(value, key);
  else if (key == "growth_factor") g.growth_factor = read.number(value, key);
  else if (key == "backoff_factor") g.backoff_factor = read.number(value, key);
  else if (key == "growth_interval") g.growth_interval = read.integer(value, key);
  else if (key == "enabled") g.enabled = read.boolean(value, key);
  else return false;
  return true;
}

bool read_naive_option(const OptionReader& read, const std::string& key, const Json& value, NaiveAmpOptions& n) {
  if (key == "clip_grad") n.clip_grad = read.number(value, key);
  else if (key == "log_num_zeros_in_grad") n.log_num_zeros_in_grad = read.boolean(value, key);
  else if (key == "initial_scale") n.scaler.initial_scale = read.number(value, key);
  else if (key == "min_scale") n.scaler.min_scale = read.number(value, key);
  else if (key == "max_scale") n.scaler.max_scale = read.number(value, key);
  else if (key == "growth_factor") n.scaler.growth_factor = read.number(value, key);
  else if (key == "backoff_factor") n.scaler.backoff_factor = read.number(value, key);
  else if (key == "growth_interval") n.scaler.growth_interval = read.integer(value, key);
  else if (key == "hysteresis") n.scaler.hysteresis = read.integer(value, key);
  else if (key == "verbose") n.verbose = read.boolean(value, key);
  else if (key == "output_to_fp32") n.output_to_fp32 = read.boolean(value, key);
  else if (key == "accumulate_allreduce_grads_in_fp32") n.accumulate_allreduce_grads_in_fp32 = read.boolean(value, key);
  else if (key == "loss_scaler") n.loss_scaler = word_option(read.who, key, value, kNaiveLossScalerWords);
  else return false;
  return true;
}

bool read_low_precision_option(const OptionReader& read, const std::string& key, const Json& value,
                               LowPrecisionOptions& l) {
  if (key == "fp8_format") {
    l.fp8_format = value.is_null() ? std::nullopt : std::optional(word_option(read.who, key, value, kFp8FormatWords));
  }
  else if (key == "amax_history_len") l.amax_history_len = read.integer(value, key);
  else if (key == "amax_compute_algo") l.amax_compute_algo = word_option(read.who, key, value, kAmaxAlgoWords);
  else if (key == "margin") l.margin = read.integer(value, key);
  else if (key == "round_scales_to_power_of_2")
    l.round_scales_to_power_of_2 = value.is_null() ? std::nullopt : std::optional(read.boolean(value, key));
  else if (key == "block_size") l.block_size = read.integer(value, key);
  else if (key == "mx_block_size") l.mx_block_size = read.integer(value, key);
  else if (key == "mx_scale_rounding") l.mx_scale_rounding = word_option(read.who, key, value, kMxRoundingWords);
  else if (key == "nvfp4_block_size") l.nvfp4_block_size = read.integer(value, key);
  else if (key == "stochastic_rounding") l.stochastic_rounding = read.boolean(value, key);
  else if (key == "random_hadamard_transform") l.random_hadamard_transform = read.boolean(value, key);
  else if (key == "accumulator_bits") l.accumulator_bits = read.integer(value, key);
  else if (key == "exclude") l.exclude = value.is_null() ? std::nullopt : std::optional(read_module_names(read, key, value));
  else return false;
  return true;
}

// Apex's cast_model_type: a dtype, or Apex's False (the model is not cast).
void read_cast_model_type(const OptionReader& read, const Json& value, ApexProperties& a) {
  if (value.is_boolean()) {
    check(!json::as_bool(value), read.who, ": cast_model_type must be \"fp32\", \"fp16\", \"bf16\", false or "
          "null, got true");
    a.cast_model_type.reset();
  } else {
    a.cast_model_type = read.dtype(value, "cast_model_type");
  }
  // Apex's Properties.__setattr__ (warn_or_err raises without hard_override).
  if (a.opt_level == "O1" && a.cast_model_type.value_or(DType::F32) != DType::F32)
    fail(read.who, ": O1 inserts casts around ops rather than casting the model weights, so with O1 the weights "
         "must stay fp32: cast_model_type must be unset or \"fp32\", got \"",
         value.is_string() ? echo(json::as_string(value)) : "",
         "\"; use O2 or O3 to cast the model");
}

// Apex's keep_batchnorm_fp32: true, false, or the strings "True" / "False", which Apex accepts too.
void read_keep_batchnorm_fp32(const OptionReader& read, const Json& value, ApexProperties& a) {
  check(a.opt_level != "O1", read.who, ": with O1 the norm ops already run in fp32, so keep_batchnorm_fp32 must "
        "be unset (null)");
  if (!value.is_string()) {
    a.keep_batchnorm_fp32 = read.boolean(value, "keep_batchnorm_fp32");
    return;
  }
  const std::string& text = json::as_string(value);
  if (text != "True" && text != "False")
    fail(read.who, ": keep_batchnorm_fp32 must be true, false, \"True\", \"False\" or null, got \"", echo(text), "\"");
  a.keep_batchnorm_fp32 = text == "True";
}

// Apex's loss_scale: a number, "dynamic", or a number in a string (Apex converts it with float()).
void read_loss_scale(const OptionReader& read, const Json& value, ApexProperties& a) {
  if (!value.is_string()) {
    a.loss_scale = read.number(value, "loss_scale");
    return;
  }
  const std::optional<double> parsed = number_from_text(json::as_string(value));
  if (json::as_string(value) != "dynamic" && !parsed)
    fail(read.who, ": loss_scale must be a number, a numeric string like \"128.0\" or \"dynamic\", got \"",
         echo(json::as_string(value)), "\"");
  a.loss_scale = parsed;
}

// `scale_bounds_given` is set by min_loss_scale and max_loss_scale, which need a dynamic loss scale.
bool read_apex_option(const OptionReader& read, const std::string& key, const Json& value, ApexProperties& a,
                      bool& scale_bounds_given) {
  // The opt level is applied before the other options. amp.initialize applies only the properties that are
  // not None: null keeps the opt level's value.
  // keep_norms_fp32 is ours, with no opt-level value for a null to leave in place.
  if (key == "opt_level" || (value.is_null() && key != "num_losses" && key != "verbosity" &&
                             key != "max_loss_scale" && key != "keep_norms_fp32"))
    return true;
  if (key == "cast_model_type") {
    read_cast_model_type(read, value, a);
  } else if (key == "patch_torch_functions") {
    a.patch_torch_functions = read.boolean(value, key);
    check(!a.patch_torch_functions || a.opt_level == "O1", read.who, ": patch_torch_functions=true is only for "
          "opt_level O1 (it is ", a.opt_level, ")");
  } else if (key == "keep_batchnorm_fp32") {
    read_keep_batchnorm_fp32(read, value, a);
  } else if (key == "master_weights") {
    check(a.opt_level != "O1", read.who, ": master_weights makes no sense with O1: its model weights are fp32 "
          "already (leave it unset)");
    a.master_weights = read.boolean(value, key);
  } else if (key == "loss_scale") {
    read_loss_scale(read, value, a);
  } else if (key == "cast_model_outputs") {
    a.cast_model_outputs = read.dtype(value, key);
  } else if (key == "num_losses") {
    a.num_losses = read.integer(value, key);
  } else if (key == "verbosity") {
    a.verbosity = read.integer(value, key);
  } else if (key == "min_loss_scale") {
    a.min_loss_scale = read.number(value, key);
    scale_bounds_given = true;
  } else if (key == "max_loss_scale") {
    a.max_loss_scale = read.number(value, key);
    scale_bounds_given = true;
  } else if (key == "keep_norms_fp32") {
    a.keep_norms_fp32 = read.boolean(value, key);
  } else {
    return false;
  }
  return true;
}

}  // namespace

AmpConfig AmpConfig::from_json(std::string_view text, std::optional<std::string_view> mode) {
  const Json root = json::parse(text);
  check(root.is_object(), "AmpConfig: the JSON config must be an object, got ", json::kind_name(root));
  const std::string name = mode_of(root, mode);
  AmpConfig config = parse(name);
  const OptionReader read{"AmpConfig " + std::string(config.row().name)};
  const std::string& who = read.who;
  check_option_keys(root, config.row(), who);
  // The opt level may come from "fp16_apex:O2" or from the object; the object's wins if both agree.
  if (const Json* level = json::find(root, "opt_level")) {
    check(level->is_string(), who, ": opt_level must be a string like \"O2\", got ", json::kind_name(*level));
    const std::string& opt_level = json::as_string(*level);
    if (name.find(':') != std::string::npos && name.substr(name.find(':') + 1) != opt_level)
      fail(who, ": opt_level \"", echo(opt_level), "\" differs from the mode \"", echo(name), "\"");
    config.apex = ApexProperties::for_opt_level(opt_level, config.row().compute_dtype);
  }
  bool scale_bounds_given = false;  // min_loss_scale / max_loss_scale: checked against loss_scale below
  for (const auto& [key, value] : json::as_object(root)) {
    if (key == "mixed_precision") continue;
    if (key == "lr_schedule_on_skip") {  // kCommonAmpKeys
      config.lr_schedule_on_skip = word_option(who, key, value, kScheduleOnSkipWords);
      continue;
    }
    if (key == "fp8_communication") {
      config.fp8_communication = read.boolean(value, key);
      continue;
    }
    bool read_it = false;
    switch (config.family()) {
      case ModeFamily::Plain:  // no options of its own: check_option_keys refused every other key
        break;
      case ModeFamily::PytorchAmp:
        read_it = read_grad_scaler_option(read, key, value, config.grad_scaler);
        break;
      case ModeFamily::Apex:
        read_it = read_apex_option(read, key, value, config.apex, scale_bounds_given);
        break;
      case ModeFamily::Naive:
        read_it = read_naive_option(read, key, value, config.naive);
        break;
      case ModeFamily::LowPrecision:
        read_it = read_low_precision_option(read, key, value, config.low_precision);
        break;
    }
    // A key in the row's option_keys that its family does not read would be dropped without a word.
    if (!read_it)
      fail(who, ": option \"", echo(key), "\" is listed for the mode but has no reader (amp/config.cpp)");
  }
  // Given at all (even at the default value), a bound of dynamic scaling with a static scale is a mistake.
  check(!(scale_bounds_given && config.apex.loss_scale), who, ": min_loss_scale and max_loss_scale apply "
        "only with loss_scale \"dynamic\"; opt_level ", config.apex.opt_level, " here has the static "
        "loss_scale ", number_text(config.apex.loss_scale),
        " (remove them, or set loss_scale to \"dynamic\")");
  config.validate();
  return config;
}

namespace {

// Apex's properties against Apex's own refusals and ours (the table in amp/config.h).
void validate_apex(const std::string& who, const ApexProperties& properties) {
  const ApexProperties& a = properties;
  ApexProperties::for_opt_level(a.opt_level);
  // The dtypes the JSON form accepts: another one would be cast as if it were fp16 (or cast a loss to an
  // integer), never what was asked for.
  auto check_dtype = [&](const char* key, const std::optional<DType>& dtype) {
    check(!dtype || *dtype == DType::F32 || *dtype == DType::F16 || *dtype == DType::BF16, who, ": ", key,
          " must be fp32, fp16 or bf16 (or unset), got ", dtype_name(dtype.value_or(DType::F32)));
  };
  check_dtype("cast_model_type", a.cast_model_type);
  check_dtype("cast_model_outputs", a.cast_model_outputs);
  check(!(a.opt_level == "O1" && a.keep_batchnorm_fp32), who, ": with O1 the norm ops already run in fp32, "
        "so keep_batchnorm_fp32 must be unset (Apex refuses it too)");
  check(!(a.opt_level == "O1" && a.keep_norms_fp32), who, ": O1 does not cast the model, so there are no cast "
        "norm layers to keep: keep_norms_fp32 must be false (Apex refuses keep_batchnorm_fp32 with O1 too)");
  check(!(a.opt_level == "O1" && a.cast_model_type && *a.cast_model_type != DType::F32), who,
        ": O1 keeps the model weights fp32: cast_model_type must be unset or \"fp32\", got \"",
        dtype_text(a.cast_model_type.value_or(DType::F32)), "\"");
  check(!(a.opt_level == "O0" && a.cast_model_type && *a.cast_model_type != DType::F32), who,
        ": O0 is pure fp32: cast_model_type must be \"fp32\" (or unset), got \"",
        dtype_text(a.cast_model_type.value_or(DType::F32)), "\"; use O2 or O3 to cast the model");
  check(!a.patch_torch_functions || a.opt_level == "O1", who, ": patch_torch_functions is only for O1");
  // Apex: "It doesn't make sense to use master_weights with O1". Elsewhere master_weights on an uncast
  // model (O0, or O2 with cast_model_type false) is accepted and keeps nothing: the parameters are fp32.
  check(!(a.master_weights && a.opt_level == "O1"), who, ": O1 keeps the model weights fp32, so "
        "master_weights makes no sense there (Apex refuses it too); use O2 or O3 for fp32 master weights");
  // Every scale option is a usable scale by itself (check_loss_scale), whichever of them is in use.
  if (a.loss_scale) check_loss_scale(who, "loss_scale", *a.loss_scale);
  check(a.num_losses >= 1 && a.num_losses <= ApexProperties::kMaxNumLosses, who,
        ": num_losses must be in [1, ", ApexProperties::kMaxNumLosses, "] (one loss scaler per loss), got ",
        a.num_losses);
  check(a.verbosity >= 0 && a.verbosity <= 2, who, ": verbosity must be 0 (silent), 1 (each skipped step) "
        "or 2 (also each scale growth), got ", a.verbosity);
  check_loss_scale(who, "max_loss_scale", a.max_loss_scale);
  if (a.min_loss_scale) {
    check_loss_scale(who, "min_loss_scale", *a.min_loss_scale);
    check(*a.min_loss_scale <= a.max_loss_scale, who, ": min_loss_scale ", exact_number_text(*a.min_loss_scale),
          " must be <= max_loss_scale ", exact_number_text(a.max_loss_scale));
  }
  if (a.loss_scale) {
    check(!a.min_loss_scale && a.max_loss_scale == ApexProperties::kDefaultMaxLossScale, who,
          ": min_loss_scale and max_loss_scale apply only with loss_scale \"dynamic\"; opt_level ",
          a.opt_level, " here has the static loss_scale ", number_text(a.loss_scale),
          " (got min_loss_scale ", number_text(a.min_loss_scale), ", max_loss_scale ",
          number_text(a.max_loss_scale), ")");
    with_context(who + ": the static loss_scale", [&] { StaticLossScaler check_scale(*a.loss_scale); });
  } else {
    with_context(who + ": the dynamic loss scaler of min_loss_scale " + number_text(a.min_loss_scale) +
                     " and max_loss_scale " + number_text(a.max_loss_scale),
                 [&] { a.dynamic_scaler(); });
  }
}

void validate_low_precision(const std::string& who, ScalingRecipe scaling, const LowPrecisionOptions& l) {
  auto in_range = [&](const char* key, int64_t value, int64_t low, int64_t high) {
    check(value >= low && value <= high, who, ": ", key, " must be ", low, "..", high, ", got ", value);
  };
  in_range("amax_history_len", l.amax_history_len, 1, 1 << 20);
  in_range("margin", l.margin, 0, 64);
  in_range("block_size", l.block_size, 1, 1 << 16);
  in_range("mx_block_size", l.mx_block_size, 1, 1 << 16);
  in_range("nvfp4_block_size", l.nvfp4_block_size, 1, 1 << 16);
  in_range("accumulator_bits", l.accumulator_bits, 0, 23);
  check(!l.round_scales_to_power_of_2 || !*l.round_scales_to_power_of_2 || scaling == ScalingRecipe::CurrentTensorwise ||
            scaling == ScalingRecipe::Rowwise,
        who, ": round_scales_to_power_of_2 applies to the current-scaling fp32 scales of fp8 and fp8_rowwise only");
  check(!l.fp8_format || scaling != ScalingRecipe::Nvfp4, who, ": fp8_format does not apply: nvfp4's elements "
        "are E2M1 (fp4) in every GEMM");
  check(!l.fp8_format || *l.fp8_format == Fp8Format::Hybrid || *l.fp8_format == Fp8Format::E4M3, who,
        ": fp8_format must be \"hybrid\" or \"e4m3\"");
  check(l.amax_compute_algo == AmaxComputeAlgo::Max || l.amax_compute_algo == AmaxComputeAlgo::MostRecent, who,
        ": amax_compute_algo must be \"max\" or \"most_recent\"");
  check(l.mx_scale_rounding == BlockScale::E8M0Floor || l.mx_scale_rounding == BlockScale::E8M0Ceil, who,
        ": mx_scale_rounding must be \"floor\" or \"ceil\"");
  if (l.exclude)
    for (const std::string& name : *l.exclude) check(!name.empty(), who, ": exclude must list non-empty module names");
}

}  // namespace

void AmpConfig::validate() const {
  check(static_cast<size_t>(mode) < kPrecisionModes.size(), "AmpConfig: unknown mixed_precision (PrecisionMode ",
        static_cast<int>(mode), "; expected one of ", join(modes()), ")");
  const std::string who = "AmpConfig " + std::string(row().name);
  check(!lr_schedule_on_skip || *lr_schedule_on_skip == LrScheduleOnSkip::Advance ||
            *lr_schedule_on_skip == LrScheduleOnSkip::Hold,
        who, ": lr_schedule_on_skip must be \"advance\" or \"hold\" (LrScheduleOnSkip ",
        static_cast<int>(lr_schedule_on_skip.value_or(LrScheduleOnSkip::Advance)), ")");
  switch (family()) {
    case ModeFamily::Plain:
      break;
    case ModeFamily::PytorchAmp:
      // Checked on or off: an invalid option is wrong whether or not the scaler runs (bf16 may switch it on).
      check_loss_scale(who, "init_scale", grad_scaler.init_scale);
      with_context(who + " (GradScaler options)", [&] { GradScaler check_options(grad_scaler); });
      break;
    case ModeFamily::Apex:
      validate_apex(who, apex);
      break;
    case ModeFamily::Naive:
      check(std::isfinite(naive.clip_grad) && naive.clip_grad >= 0, who,
            ": clip_grad must be finite and >= 0 (0 = off), got ", naive.clip_grad);
      check_loss_scale(who, "initial_scale", naive.scaler.initial_scale);
      check_loss_scale(who, "min_scale", naive.scaler.min_scale);
      check_loss_scale(who, "max_scale", naive.scaler.max_scale);
      with_context(who + " (loss scaler options)", [&] { DynamicLossScaler check_options(naive.scaler); });
      check(naive.loss_scaler == NaiveLossScaler::Dynamic || naive.loss_scaler == NaiveLossScaler::None, who,
            ": loss_scaler must be \"dynamic\" or \"none\" (NaiveLossScaler ",
            static_cast<int>(naive.loss_scaler), ")");
      // Megatron-LM's Float16OptimizerWithFloat16Params: "fp16 expects a grad scaler".
      check(naive.loss_scaler == NaiveLossScaler::Dynamic || row().compute_dtype != DType::F16, who,
            ": loss_scaler \"none\" is for bf16_naive only: fp16 gradients underflow without a loss scale "
            "(Megatron-LM refuses it too: \"fp16 expects a grad scaler\"); use \"dynamic\"");
      break;
    case ModeFamily::LowPrecision:
      validate_low_precision(who, *row().gemm_scaling, low_precision);
      break;
  }
}

LrScheduleOnSkip AmpConfig::schedule_on_skip() const {
  if (lr_schedule_on_skip) return *lr_schedule_on_skip;
  switch (family()) {
    case ModeFamily::Plain:       // plain PyTorch and Colossal-AI loops step the scheduler every iteration
    case ModeFamily::PytorchAmp:
    case ModeFamily::Apex:
      return LrScheduleOnSkip::Advance;
    case ModeFamily::Naive:       // InternEvo's engine and Megatron-LM's loop step it after an update only
      return LrScheduleOnSkip::Hold;
    case ModeFamily::LowPrecision:  // Transformer Engine leaves the loop to PyTorch's: every iteration
      return LrScheduleOnSkip::Advance;
  }
  return LrScheduleOnSkip::Advance;
}

int64_t AmpConfig::schedule_position(int64_t step, int64_t skipped_steps) const {
  check(skipped_steps >= 0 && skipped_steps <= step, "AmpConfig: ", skipped_steps,
        " skipped steps before iteration ", step, ", expected a count in [0, ", step, "]");
  return schedule_on_skip() == LrScheduleOnSkip::Hold ? step - skipped_steps : step;
}

std::string AmpConfig::name() const {
  const std::string mode_name(row().name);
  return family() == ModeFamily::Apex ? mode_name + ":" + apex.opt_level : mode_name;
}

std::optional<DType> AmpConfig::autocast_dtype() const {
  switch (row().cast) {
    case ModeCast::Autocast:
      return row().compute_dtype;
    case ModeCast::ByOptLevel:  // Apex's patch_torch_functions (O1) is autocast
      return apex.patch_torch_functions ? std::optional(row().compute_dtype) : std::nullopt;
    case ModeCast::None:
    case ModeCast::WholeModel:
      return std::nullopt;
  }
  return std::nullopt;
}

std::optional<DType> AmpConfig::model_dtype() const {
  switch (row().cast) {
    case ModeCast::WholeModel:
      return row().compute_dtype;
    case ModeCast::ByOptLevel:
      return apex.cast_model_type;  // O0 with false too: Apex casts nothing
    case ModeCast::None:
    case ModeCast::Autocast:
      return std::nullopt;
  }
  return std::nullopt;
}

bool AmpConfig::fp32_grads() const {
  switch (family()) {
    case ModeFamily::Plain:
    case ModeFamily::PytorchAmp:  // the parameters are fp32, and so are their gradients
      return false;
    case ModeFamily::Apex: {
      const std::optional<DType> cast = model_dtype();
      return apex.master_weights && cast && is_low_precision(*cast);
    }
    case ModeFamily::Naive:
      return naive.accumulate_allreduce_grads_in_fp32;
    case ModeFamily::LowPrecision:  // fp32 parameters
      return false;
  }
  return false;
}

Fp8Format AmpConfig::fp8_format() const {
  check(quantizes_gemms(), "AmpConfig ", name(), ": fp8_format belongs to the fp8 and block-scaled modes");
  if (low_precision.fp8_format) return *low_precision.fp8_format;
  const ScalingRecipe scaling = *row().gemm_scaling;
  // Transformer Engine's DelayedScaling, Colossal-AI's linear_fp8 and torchao's tensorwise default to E5M2
  // gradients; torchao's rowwise, DeepSeek-V3 and TE's MXFP8BlockScaling to E4M3 everywhere.
  return scaling == ScalingRecipe::CurrentTensorwise || scaling == ScalingRecipe::DelayedTensorwise
             ? Fp8Format::Hybrid
             : Fp8Format::E4M3;
}

LowPrecisionRecipe AmpConfig::low_precision_recipe() const {
  check(quantizes_gemms(), "AmpConfig ", name(), ": not an fp8 or block-scaled mode (no GEMM recipe)");
  const LowPrecisionOptions& l = low_precision;
  LowPrecisionRecipe r;
  r.scaling = *row().gemm_scaling;
  if (r.scaling == ScalingRecipe::Nvfp4) {
    r.forward_format = r.gradient_format = DType::F4E2M1;
  } else {
    r.forward_format = DType::F8E4M3;
    r.gradient_format = fp8_format() == Fp8Format::Hybrid ? DType::F8E5M2 : DType::F8E4M3;
  }
  r.amax_history_len = l.amax_history_len;
  r.amax_compute_algo = l.amax_compute_algo;
  r.margin = l.margin;
  r.round_scales_to_power_of_2 = round_scales_to_power_of_2();
  r.block_size = l.block_size;
  r.mx_block_size = l.mx_block_size;
  r.mx_scale_rounding = l.mx_scale_rounding;
  r.nvfp4_block_size = l.nvfp4_block_size;
  r.stochastic_rounding = l.stochastic_rounding;
  r.random_hadamard_transform = l.random_hadamard_transform;
  r.accumulator_bits = static_cast<int>(l.accumulator_bits);
  return r;
}

bool AmpConfig::round_scales_to_power_of_2() const {
  check(quantizes_gemms(), "AmpConfig ", name(), ": round_scales_to_power_of_2 belongs to the fp8 modes");
  return low_precision.round_scales_to_power_of_2.value_or(*row().gemm_scaling == ScalingRecipe::Rowwise);
}

std::vector<std::string> AmpConfig::excluded_modules() const {
  return low_precision.exclude.value_or(std::vector<std::string>{"lm_head"});
}

std::string AmpConfig::training_differences(const AmpConfig& other, std::string_view other_label) const {
  static const std::set<std::string, std::less<>> printing = {"verbose", "verbosity",
                                                               "log_num_zeros_in_grad"};
  // Another mode (or Apex opt level) is one difference, not a list of options that one side lacks.
  const std::string label(other_label);
  if (name() != other.name()) return "mode " + name() + " (" + label + " " + other.name() + ")";
  const Json mine = json::parse(to_json()), theirs = json::parse(other.to_json());
  std::vector<std::string> keys;  // mine, then those only the other has (an option one side writes alone)
  for (const auto& [key, value] : json::as_object(mine)) keys.push_back(key);
  for (const auto& [key, value] : json::as_object(theirs))
    if (!json::find(mine, key)) keys.push_back(key);
  // The modes are the same here, so "not an option" names it once for both sides.
  auto text = [&](const Json* value) {
    return value ? json::dump(*value) : "(not an option of " + name() + ")";
  };
  std::vector<std::string> differences;
  for (const std::string& key : keys) {
    const Json *a = json::find(mine, key), *b = json::find(theirs, key);
    if (printing.count(key) || (a && b && json::dump(*a) == json::dump(*b))) continue;
    differences.push_back(key + " " + text(a) + " (" + label + " " + text(b) + ")");
  }
  return join(differences);
}

namespace {

// to_json's options of each family, in the order the JSON form lists them.
void write_grad_scaler_options(const GradScalerOptions& grad_scaler, Json& o) {
  auto num = [](double v) { return Json(v); };
  o.emplace("init_scale", num(grad_scaler.init_scale));
  o.emplace("growth_factor", num(grad_scaler.growth_factor));
  o.emplace("backoff_factor", num(grad_scaler.backoff_factor));
  o.emplace("growth_interval", grad_scaler.growth_interval);
  o.emplace("enabled", grad_scaler.enabled);
}

void write_apex_options(const ApexProperties& a, Json& o) {
  auto num = [](double v) { return Json(v); };
  auto opt_dtype = [](const std::optional<DType>& d) { return d ? Json(dtype_text(*d)) : Json(); };
  o.emplace("opt_level", a.opt_level);
  // null reads back as "the opt level's value", so an unset property that the opt level sets is written
  // as Apex's False (the same behaviour: no cast, no fp32 norms).
  const ApexProperties level = ApexProperties::for_opt_level(a.opt_level);
  if (a.opt_level != "O1") {
    o.emplace("cast_model_type", a.cast_model_type         ? Json(dtype_text(*a.cast_model_type))
                                 : level.cast_model_type ? Json(false)
                                                         : Json());
    o.emplace("keep_batchnorm_fp32", a.keep_batchnorm_fp32       ? Json(*a.keep_batchnorm_fp32)
                                     : level.keep_batchnorm_fp32 ? Json(false)
                                                                 : Json());
    o.emplace("master_weights", a.master_weights);
  } else if (a.cast_model_type) {
    o.emplace("cast_model_type", dtype_text(*a.cast_model_type));  // "fp32", the one O1 allows
  }
  o.emplace("patch_torch_functions", a.patch_torch_functions);
  o.emplace("loss_scale", a.loss_scale ? num(*a.loss_scale) : Json("dynamic"));
  o.emplace("cast_model_outputs", opt_dtype(a.cast_model_outputs));
  o.emplace("keep_norms_fp32", a.keep_norms_fp32);
  o.emplace("num_losses", a.num_losses);
  o.emplace("verbosity", a.verbosity);
  if (!a.loss_scale) {  // the bounds of dynamic scaling; an error with a static scale
    o.emplace("min_loss_scale", a.min_loss_scale ? num(*a.min_loss_scale) : Json());
    o.emplace("max_loss_scale", num(a.max_loss_scale));
  }
}

void write_naive_options(const NaiveAmpOptions& naive, Json& o) {
  auto num = [](double v) { return Json(v); };
  o.emplace("clip_grad", num(naive.clip_grad));
  o.emplace("log_num_zeros_in_grad", naive.log_num_zeros_in_grad);
  o.emplace("initial_scale", num(naive.scaler.initial_scale));
  o.emplace("min_scale", num(naive.scaler.min_scale));
  o.emplace("growth_factor", num(naive.scaler.growth_factor));
  o.emplace("backoff_factor", num(naive.scaler.backoff_factor));
  o.emplace("growth_interval", naive.scaler.growth_interval);
  o.emplace("hysteresis", naive.scaler.hysteresis);
  o.emplace("max_scale", num(naive.scaler.max_scale));
  o.emplace("loss_scaler", word_of(naive.loss_scaler, kNaiveLossScalerWords));
  o.emplace("verbose", naive.verbose);
  o.emplace("output_to_fp32", naive.output_to_fp32);
  o.emplace("accumulate_allreduce_grads_in_fp32", naive.accumulate_allreduce_grads_in_fp32);
}

void write_low_precision_options(const AmpConfig& c, Json& o) {
  const LowPrecisionOptions& l = c.low_precision;
  // null for nvfp4, whose elements are E2M1 whatever fp8_format says (a value there is refused).
  o.emplace("fp8_format", *c.row().gemm_scaling == ScalingRecipe::Nvfp4 ? Json()
                                                                         : Json(word_of(c.fp8_format(), kFp8FormatWords)));
  o.emplace("amax_history_len", l.amax_history_len);
  o.emplace("amax_compute_algo", word_of(l.amax_compute_algo, kAmaxAlgoWords));
  o.emplace("margin", l.margin);
  o.emplace("round_scales_to_power_of_2", c.round_scales_to_power_of_2());
  o.emplace("block_size", l.block_size);
  o.emplace("mx_block_size", l.mx_block_size);
  o.emplace("mx_scale_rounding", word_of(l.mx_scale_rounding, kMxRoundingWords));
  o.emplace("nvfp4_block_size", l.nvfp4_block_size);
  o.emplace("stochastic_rounding", l.stochastic_rounding);
  o.emplace("random_hadamard_transform", l.random_hadamard_transform);
  // null: the default ({"lm_head"}), which a model without that module accepts; a list reads back as given.
  Json exclude;
  if (l.exclude) {
    exclude = Json::array();
    for (const std::string& name : *l.exclude) exclude.push_back(name);
  }
  o.emplace("exclude", std::move(exclude));
  o.emplace("accumulator_bits", l.accumulator_bits);
}

}  // namespace

std::string AmpConfig::to_json() const {
  Json o = Json::object({{"mixed_precision", std::string(row().name)},
                         {"lr_schedule_on_skip", word_of(schedule_on_skip(), kScheduleOnSkipWords)},
                         {"fp8_communication", fp8_communication}});
  switch (family()) {
    case ModeFamily::Plain:
      break;
    case ModeFamily::PytorchAmp:
      write_grad_scaler_options(grad_scaler, o);
      break;
    case ModeFamily::Apex:
      write_apex_options(apex, o);
      break;
    case ModeFamily::Naive:
      write_naive_options(naive, o);
      break;
    case ModeFamily::LowPrecision:
      write_low_precision_options(*this, o);
      break;
  }
  return json::dump(o);
}

}  // namespace mixtape
