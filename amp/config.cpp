#include "amp/config.h"

#include <cmath>
#include <map>

#include "nn/json.h"
#include "tensor/error.h"

namespace mixtape {

namespace {

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : ", ") + item;
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

// The options each mode accepts in JSON (besides "mixed_precision").
const std::vector<std::string>& keys_of(const std::string& mode) {
  static const std::map<std::string, std::vector<std::string>> keys = {
      {"fp32", {}},
      {"tf32", {}},
      {"fp16", {"init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled"}},
      {"bf16", {"init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled"}},
      {"fp16_apex",
       {"opt_level", "cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32", "master_weights",
        "loss_scale", "cast_model_outputs", "num_losses", "verbosity", "min_loss_scale", "max_loss_scale"}},
      {"fp16_naive",
       {"clip_grad", "log_num_zeros_in_grad", "initial_scale", "min_scale", "growth_factor", "backoff_factor",
        "growth_interval", "hysteresis", "max_scale", "verbose", "output_to_fp32"}},
  };
  const auto found = keys.find(mode == "bf16_naive" ? "fp16_naive" : mode);
  check(found != keys.end(), "AmpConfig: unknown mixed_precision \"", mode, "\" (expected one of ",
        join(AmpConfig::modes()), ")");
  return found->second;
}

// Apex's Properties.__setattr__ checks (warn_or_err raises without hard_override).
void check_apex_override(const std::string& opt_level, const std::string& key, bool is_set_to_something) {
  const char* who = "AmpConfig fp16_apex";
  if (opt_level == "O1" && is_set_to_something) {
    check(key != "cast_model_type", who, ": O1 inserts casts around ops rather than casting the model "
          "weights, so with O1 the weights must stay fp32 (cast_model_type must be unset); use O2 or O3 to "
          "cast the model");
    check(key != "keep_batchnorm_fp32", who, ": with O1 the norm ops already run in fp32, so "
          "keep_batchnorm_fp32 must be unset");
    check(key != "master_weights", who, ": master_weights makes no sense with O1: its model weights are "
          "fp32 already");
  }
}

}  // namespace

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
  static const std::vector<std::string> names = {"fp32", "tf32", "fp16", "bf16", "fp16_apex", "fp16_naive",
                                                 "bf16_naive"};
  return names;
}

AmpConfig AmpConfig::parse(std::string_view text) {
  AmpConfig config;
  const size_t colon = text.find(':');
  config.mixed_precision = std::string(text.substr(0, colon));
  keys_of(config.mixed_precision);  // unknown mode -> Error listing the modes
  if (colon != std::string_view::npos) {
    check(config.mixed_precision == "fp16_apex", "AmpConfig: \"", text, "\": only fp16_apex takes an ",
          "opt level after a colon (fp16_apex:O0 .. fp16_apex:O3)");
    config.apex = ApexProperties::for_opt_level(std::string(text.substr(colon + 1)));
  } else if (config.mixed_precision == "fp16_apex") {
    config.apex = ApexProperties::for_opt_level("O1");  // amp.initialize's default opt_level
  }
  if (config.mixed_precision == "bf16") config.grad_scaler.enabled = false;
  config.validate();
  return config;
}

AmpConfig AmpConfig::from_json(std::string_view text, std::optional<std::string_view> mode) {
  const json::Value root = json::parse(text);
  check(root.is_object(), "AmpConfig: the JSON config must be an object, got ", json::kind_name(root.kind()));
  std::string name;
  if (const json::Value* given = root.find("mixed_precision")) {
    check(given->is_string(), "AmpConfig: mixed_precision must be a string, got ", json::kind_name(given->kind()));
    name = given->as_string();
    check(!mode || *mode == name || mode->substr(0, mode->find(':')) == name, "AmpConfig: the config says "
          "mixed_precision \"", name, "\" but \"", *mode, "\" was asked for");
    if (mode) name = std::string(*mode);  // keeps the opt level of "fp16_apex:O2"
  } else {
    check(mode.has_value(), "AmpConfig: the JSON config has no \"mixed_precision\" (one of ", join(modes()), ")");
    name = std::string(*mode);
  }
  // The opt level may come from "fp16_apex:O2" or from the object; the object's wins if both agree.
  std::string opt_level;
  if (const json::Value* level = root.find("opt_level")) {
    check(level->is_string(), "AmpConfig fp16_apex: opt_level must be a string like \"O2\", got ",
          json::kind_name(level->kind()));
    opt_level = level->as_string();
  }
  AmpConfig config = parse(name);
  if (config.mixed_precision == "fp16_apex" && !opt_level.empty()) {
    check(name.find(':') == std::string::npos || name.substr(name.find(':') + 1) == opt_level,
          "AmpConfig fp16_apex: opt_level \"", opt_level, "\" differs from the mode \"", name, "\"");
    config.apex = ApexProperties::for_opt_level(opt_level);
  }
  const std::string& m = config.mixed_precision;
  const std::string who = "AmpConfig " + m;
  const std::vector<std::string>& allowed = keys_of(m);

  auto number = [&](const json::Value& v, const std::string& key) {
    check(v.is_integer() || v.is_number(), who, ": ", key, " must be a number, got ", json::kind_name(v.kind()));
    return v.as_number();
  };
  auto integer = [&](const json::Value& v, const std::string& key) {
    if (v.is_number() && std::floor(v.as_number()) == v.as_number() && std::abs(v.as_number()) < 9.0e18)
      return static_cast<int64_t>(v.as_number());  // 1e3 written as a float
    check(v.is_integer(), who, ": ", key, " must be an integer, got ", json::kind_name(v.kind()));
    return v.as_integer();
  };
  auto boolean = [&](const json::Value& v, const std::string& key) {
    check(v.is_bool(), who, ": ", key, " must be true or false, got ", json::kind_name(v.kind()));
    return v.as_bool();
  };
  auto dtype = [&](const json::Value& v, const std::string& key) -> std::optional<DType> {
    if (v.is_null()) return std::nullopt;
    check(v.is_string(), who, ": ", key, " must be \"fp32\", \"fp16\", \"bf16\" or null, got ",
          json::kind_name(v.kind()));
    return dtype_from_name(who, key, v.as_string());
  };

  for (const auto& [key, value] : root.as_object()) {
    if (key == "mixed_precision") continue;
    bool known = false;
    for (const auto& k : allowed) known = known || k == key;
    check(known, who, ": unknown option \"", key, "\" (", m, " takes ",
          allowed.empty() ? std::string("no options") : join(allowed), ")");
    if (m == "fp16" || m == "bf16") {
      GradScalerOptions& g = config.grad_scaler;
      if (key == "init_scale") g.init_scale = number(value, key);
      else if (key == "growth_factor") g.growth_factor = number(value, key);
      else if (key == "backoff_factor") g.backoff_factor = number(value, key);
      else if (key == "growth_interval") g.growth_interval = integer(value, key);
      else if (key == "enabled") g.enabled = boolean(value, key);
    } else if (m == "fp16_apex") {
      ApexProperties& a = config.apex;
      check_apex_override(a.opt_level, key, !value.is_null());
      if (key == "opt_level") continue;
      else if (key == "cast_model_type") a.cast_model_type = dtype(value, key);
      else if (key == "patch_torch_functions") {
        a.patch_torch_functions = boolean(value, key);
        check(!a.patch_torch_functions || a.opt_level == "O1", who, ": patch_torch_functions=true is only "
              "for opt_level O1 (it is ", a.opt_level, ")");
      } else if (key == "keep_batchnorm_fp32") {
        if (value.is_null()) a.keep_batchnorm_fp32.reset();
        else if (value.is_string()) {  // Apex accepts the strings "True"/"False" too
          check(value.as_string() == "True" || value.as_string() == "False", who,
                ": keep_batchnorm_fp32 must be true, false, \"True\" or \"False\", got \"", value.as_string(), "\"");
          a.keep_batchnorm_fp32 = value.as_string() == "True";
        } else a.keep_batchnorm_fp32 = boolean(value, key);
      } else if (key == "master_weights") a.master_weights = value.is_null() ? false : boolean(value, key);
      else if (key == "loss_scale") {
        if (value.is_string()) {
          check(value.as_string() == "dynamic", who, ": loss_scale must be a number or \"dynamic\", got \"",
                value.as_string(), "\"");
          a.loss_scale.reset();
        } else a.loss_scale = number(value, key);
      } else if (key == "cast_model_outputs") a.cast_model_outputs = dtype(value, key);
      else if (key == "num_losses") a.num_losses = integer(value, key);
      else if (key == "verbosity") a.verbosity = integer(value, key);
      else if (key == "min_loss_scale") {
        if (value.is_null()) a.min_loss_scale.reset();
        else a.min_loss_scale = number(value, key);
      } else if (key == "max_loss_scale") a.max_loss_scale = number(value, key);
    } else {  // naive
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
    }
  }
  config.validate();
  return config;
}

void AmpConfig::validate() const {
  keys_of(mixed_precision);
  const std::string who = "AmpConfig " + mixed_precision;
  if (mixed_precision == "fp16" || mixed_precision == "bf16") {
    if (grad_scaler.enabled) GradScaler check_options(grad_scaler);  // throws naming the option
  } else if (mixed_precision == "fp16_apex") {
    const ApexProperties& a = apex;
    ApexProperties::for_opt_level(a.opt_level);
    check(!(a.opt_level == "O1" && a.cast_model_type), who, ": O1 keeps the model weights fp32 "
          "(cast_model_type must be unset)");
    check(!a.patch_torch_functions || a.opt_level == "O1", who, ": patch_torch_functions is only for O1");
    check(!(a.master_weights && !a.cast_model_type), who, ": master_weights needs a cast model (O2 or O3)");
    check(!a.loss_scale || (std::isfinite(*a.loss_scale) && *a.loss_scale > 0), who,
          ": loss_scale must be \"dynamic\" or a finite number > 0, got ", a.loss_scale.value_or(0));
    check(a.num_losses >= 1, who, ": num_losses must be >= 1, got ", a.num_losses);
    check(a.verbosity == 0 || a.verbosity == 1, who, ": verbosity must be 0 or 1, got ", a.verbosity);
    check(std::isfinite(a.max_loss_scale) && a.max_loss_scale > 0, who,
          ": max_loss_scale must be finite and > 0, got ", a.max_loss_scale);
    if (a.min_loss_scale)
      check(std::isfinite(*a.min_loss_scale) && *a.min_loss_scale > 0 && *a.min_loss_scale <= a.max_loss_scale,
            who, ": min_loss_scale must be in (0, max_loss_scale = ", a.max_loss_scale, "], got ",
            *a.min_loss_scale);
    check(a.cast_model_type != DType::BF16 || a.opt_level != "O0", who, ": O0 is fp32");
    if (!a.loss_scale) {
      // Apex starts dynamic scaling at 2^16, clamped to max_loss_scale.
      apex_dynamic_scaler(std::min(65536.0, a.max_loss_scale), 2000, a.min_loss_scale, a.max_loss_scale);
    }
  } else if (is_naive()) {
    check(std::isfinite(naive.clip_grad) && naive.clip_grad >= 0, who,
          ": clip_grad must be finite and >= 0 (0 = off), got ", naive.clip_grad);
    DynamicLossScaler check_options(naive.scaler);  // throws naming the option
  }
}

std::string AmpConfig::name() const {
  return mixed_precision == "fp16_apex" ? mixed_precision + ":" + apex.opt_level : mixed_precision;
}

std::optional<DType> AmpConfig::autocast_dtype() const {
  if (mixed_precision == "fp16") return DType::F16;
  if (mixed_precision == "bf16") return DType::BF16;
  if (mixed_precision == "fp16_apex" && apex.patch_torch_functions) return DType::F16;
  return std::nullopt;
}

std::optional<DType> AmpConfig::model_dtype() const {
  if (mixed_precision == "fp16_naive") return DType::F16;
  if (mixed_precision == "bf16_naive") return DType::BF16;
  if (mixed_precision == "fp16_apex") return apex.cast_model_type;
  return std::nullopt;
}

std::string AmpConfig::to_json() const {
  json::Value::Object o{{"mixed_precision", mixed_precision}};
  o.reserve(16);
  auto num = [](double v) { return json::Value(v); };
  if (mixed_precision == "fp16" || mixed_precision == "bf16") {
    o.emplace_back("init_scale", num(grad_scaler.init_scale));
    o.emplace_back("growth_factor", num(grad_scaler.growth_factor));
    o.emplace_back("backoff_factor", num(grad_scaler.backoff_factor));
    o.emplace_back("growth_interval", grad_scaler.growth_interval);
    o.emplace_back("enabled", grad_scaler.enabled);
  } else if (mixed_precision == "fp16_apex") {
    const ApexProperties& a = apex;
    auto opt_dtype = [](const std::optional<DType>& d) { return d ? json::Value(dtype_text(*d)) : json::Value(); };
    o.emplace_back("opt_level", a.opt_level);
    if (a.opt_level != "O1") {
      o.emplace_back("cast_model_type", opt_dtype(a.cast_model_type));
      o.emplace_back("keep_batchnorm_fp32",
                     a.keep_batchnorm_fp32 ? json::Value(*a.keep_batchnorm_fp32) : json::Value());
      o.emplace_back("master_weights", a.master_weights);
    }
    o.emplace_back("patch_torch_functions", a.patch_torch_functions);
    o.emplace_back("loss_scale", a.loss_scale ? num(*a.loss_scale) : json::Value("dynamic"));
    o.emplace_back("cast_model_outputs", opt_dtype(a.cast_model_outputs));
    o.emplace_back("num_losses", a.num_losses);
    o.emplace_back("verbosity", a.verbosity);
    o.emplace_back("min_loss_scale", a.min_loss_scale ? num(*a.min_loss_scale) : json::Value());
    o.emplace_back("max_loss_scale", num(a.max_loss_scale));
  } else if (is_naive()) {
    o.emplace_back("clip_grad", num(naive.clip_grad));
    o.emplace_back("log_num_zeros_in_grad", naive.log_num_zeros_in_grad);
    o.emplace_back("initial_scale", num(naive.scaler.initial_scale));
    o.emplace_back("min_scale", num(naive.scaler.min_scale));
    o.emplace_back("growth_factor", num(naive.scaler.growth_factor));
    o.emplace_back("backoff_factor", num(naive.scaler.backoff_factor));
    o.emplace_back("growth_interval", naive.scaler.growth_interval);
    o.emplace_back("hysteresis", naive.scaler.hysteresis);
    o.emplace_back("max_scale", num(naive.scaler.max_scale));
    o.emplace_back("verbose", naive.verbose);
    o.emplace_back("output_to_fp32", naive.output_to_fp32);
  }
  return json::Value(std::move(o)).dump();
}

}  // namespace mixtape
