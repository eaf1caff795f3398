#include "amp/config.h"

#include <cmath>
#include <cstdlib>
#include <map>
#include <set>

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
  fail(who, ": ", key, " must be \"fp32\", \"fp16\" or \"bf16\", got \"", name, "\"");
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

ApexProperties ApexProperties::for_opt_level(const std::string& opt_level) {
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
    p.cast_model_type = DType::F16;
    p.patch_torch_functions = false;
    p.keep_batchnorm_fp32 = true;
    p.master_weights = true;
  } else if (opt_level == "O3") {
    p.cast_model_type = DType::F16;
    p.patch_torch_functions = false;
    p.keep_batchnorm_fp32 = false;
    p.master_weights = false;
    p.loss_scale = 1.0;
  } else {
    fail("AmpConfig fp16_apex: unknown opt_level \"", opt_level, "\" (expected O0, O1, O2 or O3; the letter O, "
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
  check(mode.has_value(), "AmpConfig: unknown mixed_precision \"", name, "\" (expected one of ", join(modes()),
        ")");
  config.mode = *mode;
  const bool apex = config.family() == ModeFamily::Apex;
  if (colon != std::string_view::npos) {
    check(apex, "AmpConfig: \"", text, "\": only fp16_apex takes an opt level after a colon (fp16_apex:O0 .. ",
          "fp16_apex:O3)");
    config.apex = ApexProperties::for_opt_level(std::string(text.substr(colon + 1)));
  } else if (apex) {
    config.apex = ApexProperties::for_opt_level("O1");  // amp.initialize's default opt_level
  }
  if (config.family() == ModeFamily::PytorchAmp) config.grad_scaler.enabled = config.row().scaler_enabled;
  config.validate();
  return config;
}

AmpConfig AmpConfig::from_json(std::string_view text, std::optional<std::string_view> mode) {
  const Json root = json::parse(text);
  check(root.is_object(), "AmpConfig: the JSON config must be an object, got ", json::kind_name(root));
  std::string name;
  if (const Json* given = json::find(root, "mixed_precision")) {
    check(given->is_string(), "AmpConfig: mixed_precision must be a string, got ", json::kind_name(*given));
    name = json::as_string(*given);
    check(!mode || *mode == name || mode->substr(0, mode->find(':')) == name, "AmpConfig: the config says "
          "mixed_precision \"", name, "\" but \"", *mode, "\" was asked for");
    if (mode) name = std::string(*mode);  // keeps the opt level of "fp16_apex:O2"
  } else {
    check(mode.has_value(), "AmpConfig: the JSON config has no \"mixed_precision\" (one of ", join(modes()), ")");
    name = std::string(*mode);
  }
  AmpConfig config = parse(name);
  const std::string m(config.row().name);
  const std::string who = "AmpConfig " + m;
  const std::span<const std::string_view> allowed = config.row().option_keys;
  // Every key is an option of the mode before any value is read: {"opt_level": 5} for fp16 is an unknown
  // option, not a badly typed opt level.
  for (const auto& [key, value] : json::as_object(root)) {
    if (key == "mixed_precision") continue;
    bool known = false;
    for (const auto& k : allowed) known = known || k == key;
    check(known, who, ": unknown option \"", key, "\" (", m, " takes ",
          allowed.empty() ? std::string("no options") : join(allowed), ")");
  }
  // The opt level may come from "fp16_apex:O2" or from the object; the object's wins if both agree.
  if (const Json* level = json::find(root, "opt_level")) {
    check(level->is_string(), who, ": opt_level must be a string like \"O2\", got ",
          json::kind_name(*level));
    const std::string& opt_level = json::as_string(*level);
    check(name.find(':') == std::string::npos || name.substr(name.find(':') + 1) == opt_level, who,
          ": opt_level \"", opt_level, "\" differs from the mode \"", name, "\"");
    config.apex = ApexProperties::for_opt_level(opt_level);
  }

  auto number = [&](const Json& v, const std::string& key) {
    check(v.is_number(), who, ": ", key, " must be a number, got ", json::kind_name(v));
    return json::as_number(v);
  };
  auto integer = [&](const Json& v, const std::string& key) {
    if (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>() && std::abs(v.get<double>()) < 9.0e18)
      return static_cast<int64_t>(v.get<double>());  // 1e3 written as a float
    check(v.is_number_integer(), who, ": ", key, " must be an integer, got ", json::kind_name(v));
    return json::as_integer(v);
  };
  auto boolean = [&](const Json& v, const std::string& key) {
    check(v.is_boolean(), who, ": ", key, " must be true or false, got ", json::kind_name(v));
    return json::as_bool(v);
  };
  auto dtype = [&](const Json& v, const std::string& key) -> DType {
    check(v.is_string(), who, ": ", key, " must be \"fp32\", \"fp16\", \"bf16\" or null, got ",
          json::kind_name(v));
    return *dtype_from_name(who, key, json::as_string(v));
  };

  bool scale_bounds_given = false;  // min_loss_scale / max_loss_scale: checked against loss_scale at the end
  for (const auto& [key, value] : json::as_object(root)) {
    if (key == "mixed_precision") continue;
    if (config.family() == ModeFamily::PytorchAmp) {
      GradScalerOptions& g = config.grad_scaler;
      if (key == "init_scale") g.init_scale = number(value, key);
      else if (key == "growth_factor") g.growth_factor = number(value, key);
      else if (key == "backoff_factor") g.backoff_factor = number(value, key);
      else if (key == "growth_interval") g.growth_interval = integer(value, key);
      else if (key == "enabled") g.enabled = boolean(value, key);
    } else if (config.family() == ModeFamily::Apex) {
      ApexProperties& a = config.apex;
      // amp.initialize applies only the properties that are not None: null keeps the opt level's value.
      if (key == "opt_level" || (value.is_null() && key != "num_losses" && key != "verbosity" &&
                                 key != "max_loss_scale"))
        continue;
      const bool o1 = a.opt_level == "O1";
      if (key == "cast_model_type") {
        if (value.is_boolean()) {  // Apex's False: the model is not cast
          check(!json::as_bool(value), who, ": cast_model_type must be \"fp32\", \"fp16\", \"bf16\", false or "
                "null, got true");
          a.cast_model_type.reset();
        } else {
          a.cast_model_type = dtype(value, key);
        }
        // Apex's Properties.__setattr__ (warn_or_err raises without hard_override).
        check(!o1 || a.cast_model_type.value_or(DType::F32) == DType::F32, who, ": O1 inserts casts around "
              "ops rather than casting the model weights, so with O1 the weights must stay fp32: "
              "cast_model_type must be unset or \"fp32\", got \"", value.is_string() ? json::as_string(value) : "",
              "\"; use O2 or O3 to cast the model");
      } else if (key == "patch_torch_functions") {
        a.patch_torch_functions = boolean(value, key);
        check(!a.patch_torch_functions || o1, who, ": patch_torch_functions=true is only for opt_level O1 "
              "(it is ", a.opt_level, ")");
      } else if (key == "keep_batchnorm_fp32") {
        check(!o1, who, ": with O1 the norm ops already run in fp32, so keep_batchnorm_fp32 must be unset "
              "(null)");
        if (value.is_string()) {  // Apex accepts the strings "True"/"False" too
          check(json::as_string(value) == "True" || json::as_string(value) == "False", who,
                ": keep_batchnorm_fp32 must be true, false, \"True\", \"False\" or null, got \"",
                json::as_string(value), "\"");
          a.keep_batchnorm_fp32 = json::as_string(value) == "True";
        } else {
          a.keep_batchnorm_fp32 = boolean(value, key);
        }
      } else if (key == "master_weights") {
        check(!o1, who, ": master_weights makes no sense with O1: its model weights are fp32 already (leave "
              "it unset)");
        a.master_weights = boolean(value, key);
      } else if (key == "loss_scale") {
        if (value.is_string()) {
          // "dynamic", or a number in a string: Apex converts any other value with float().
          const std::optional<double> parsed = number_from_text(json::as_string(value));
          check(json::as_string(value) == "dynamic" || parsed, who, ": loss_scale must be a number, a numeric "
                "string like \"128.0\" or \"dynamic\", got \"", json::as_string(value), "\"");
          a.loss_scale = parsed;
        } else {
          a.loss_scale = number(value, key);
        }
      } else if (key == "cast_model_outputs") {
        a.cast_model_outputs = dtype(value, key);
      } else if (key == "num_losses") {
        a.num_losses = integer(value, key);
      } else if (key == "verbosity") {
        a.verbosity = integer(value, key);
      } else if (key == "min_loss_scale") {
        a.min_loss_scale = number(value, key);
        scale_bounds_given = true;
      } else if (key == "max_loss_scale") {
        a.max_loss_scale = number(value, key);
        scale_bounds_given = true;
      }
    } else if (config.is_naive()) {
      NaiveAmpOptions& n = config.naive;
      if (key == "clip_grad") n.clip_grad = number(value, key);
      else if (key == "log_num_zeros_in_grad") n.log_num_zeros_in_grad = boolean(value, key);
      else if (key == "initial_scale") n.scaler.initial_scale = number(value, key);
      else if (key == "min_scale") n.scaler.min_scale = number(value, key);
      else if (key == "max_scale") n.scaler.max_scale = number(value, key);
      else if (key == "growth_factor") n.scaler.growth_factor = number(value, key);
      else if (key == "backoff_factor") n.scaler.backoff_factor = number(value, key);
      else if (key == "growth_interval") n.scaler.growth_interval = integer(value, key);
      else if (key == "hysteresis") n.scaler.hysteresis = integer(value, key);
      else if (key == "verbose") n.verbose = boolean(value, key);
      else if (key == "output_to_fp32") n.output_to_fp32 = boolean(value, key);
      else if (key == "accumulate_allreduce_grads_in_fp32")
        n.accumulate_allreduce_grads_in_fp32 = boolean(value, key);
    }
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
  check(!a.loss_scale || (std::isfinite(*a.loss_scale) && *a.loss_scale > 0), who,
        ": loss_scale must be \"dynamic\" or a finite number > 0, got ", a.loss_scale.value_or(0));
  check(a.num_losses >= 1 && a.num_losses <= ApexProperties::kMaxNumLosses, who,
        ": num_losses must be in [1, ", ApexProperties::kMaxNumLosses, "] (one loss scaler per loss), got ",
        a.num_losses);
  check(a.verbosity >= 0 && a.verbosity <= 2, who, ": verbosity must be 0 (silent), 1 (each skipped step) "
        "or 2 (also each scale growth), got ", a.verbosity);
  check(std::isfinite(a.max_loss_scale) && a.max_loss_scale > 0, who,
        ": max_loss_scale must be finite and > 0, got ", a.max_loss_scale);
  if (a.min_loss_scale)
    check(std::isfinite(*a.min_loss_scale) && *a.min_loss_scale > 0 && *a.min_loss_scale <= a.max_loss_scale,
          who, ": min_loss_scale must be in (0, max_loss_scale = ", a.max_loss_scale, "], got ",
          *a.min_loss_scale);
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

}  // namespace

void AmpConfig::validate() const {
  check(static_cast<size_t>(mode) < kPrecisionModes.size(), "AmpConfig: unknown mixed_precision (PrecisionMode ",
        static_cast<int>(mode), "; expected one of ", join(modes()), ")");
  const std::string who = "AmpConfig " + std::string(row().name);
  switch (family()) {
    case ModeFamily::Plain:
      break;
    case ModeFamily::PytorchAmp:
      // Checked on or off: an invalid option is wrong whether or not the scaler runs (bf16 may switch it on).
      with_context(who + " (GradScaler options)", [&] { GradScaler check_options(grad_scaler); });
      break;
    case ModeFamily::Apex:
      validate_apex(who, apex);
      break;
    case ModeFamily::Naive:
      check(std::isfinite(naive.clip_grad) && naive.clip_grad >= 0, who,
            ": clip_grad must be finite and >= 0 (0 = off), got ", naive.clip_grad);
      with_context(who + " (loss scaler options)", [&] { DynamicLossScaler check_options(naive.scaler); });
      break;
  }
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
  if (is_naive()) return naive.accumulate_allreduce_grads_in_fp32;
  const std::optional<DType> cast = model_dtype();
  return family() == ModeFamily::Apex && apex.master_weights && cast && is_low_precision(*cast);
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

std::string AmpConfig::to_json() const {
  Json o = Json::object({{"mixed_precision", std::string(row().name)}});
  auto num = [](double v) { return Json(v); };
  if (family() == ModeFamily::PytorchAmp) {
    o.emplace("init_scale", num(grad_scaler.init_scale));
    o.emplace("growth_factor", num(grad_scaler.growth_factor));
    o.emplace("backoff_factor", num(grad_scaler.backoff_factor));
    o.emplace("growth_interval", grad_scaler.growth_interval);
    o.emplace("enabled", grad_scaler.enabled);
  } else if (family() == ModeFamily::Apex) {
    const ApexProperties& a = apex;
    auto opt_dtype = [](const std::optional<DType>& d) { return d ? Json(dtype_text(*d)) : Json(); };
    o.emplace("opt_level", a.opt_level);
    // null reads back as "the opt level's value", so an unset property that the opt level sets is written
    // as Apex's False (the same behaviour: no cast, no fp32 norms).
    const ApexProperties level = ApexProperties::for_opt_level(a.opt_level);
    if (a.opt_level != "O1") {
      o.emplace("cast_model_type", a.cast_model_type ? Json(dtype_text(*a.cast_model_type))
                                        : level.cast_model_type ? Json(false) : Json());
      o.emplace("keep_batchnorm_fp32", a.keep_batchnorm_fp32 ? Json(*a.keep_batchnorm_fp32)
                                            : level.keep_batchnorm_fp32 ? Json(false) : Json());
      o.emplace("master_weights", a.master_weights);
    } else if (a.cast_model_type) {
      o.emplace("cast_model_type", dtype_text(*a.cast_model_type));  // "fp32", the one O1 allows
    }
    o.emplace("patch_torch_functions", a.patch_torch_functions);
    o.emplace("loss_scale", a.loss_scale ? num(*a.loss_scale) : Json("dynamic"));
    o.emplace("cast_model_outputs", opt_dtype(a.cast_model_outputs));
    o.emplace("num_losses", a.num_losses);
    o.emplace("verbosity", a.verbosity);
    if (!a.loss_scale) {  // the bounds of dynamic scaling; an error with a static scale
      o.emplace("min_loss_scale", a.min_loss_scale ? num(*a.min_loss_scale) : Json());
      o.emplace("max_loss_scale", num(a.max_loss_scale));
    }
  } else if (is_naive()) {
    o.emplace("clip_grad", num(naive.clip_grad));
    o.emplace("log_num_zeros_in_grad", naive.log_num_zeros_in_grad);
    o.emplace("initial_scale", num(naive.scaler.initial_scale));
    o.emplace("min_scale", num(naive.scaler.min_scale));
    o.emplace("growth_factor", num(naive.scaler.growth_factor));
    o.emplace("backoff_factor", num(naive.scaler.backoff_factor));
    o.emplace("growth_interval", naive.scaler.growth_interval);
    o.emplace("hysteresis", naive.scaler.hysteresis);
    o.emplace("max_scale", num(naive.scaler.max_scale));
    o.emplace("verbose", naive.verbose);
    o.emplace("output_to_fp32", naive.output_to_fp32);
    o.emplace("accumulate_allreduce_grads_in_fp32", naive.accumulate_allreduce_grads_in_fp32);
  }
  return json::dump(o);
}

}  // namespace mixtape
