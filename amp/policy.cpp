// Lookup in and printing of the autocast policy tables (tensor/autocast_tables.h), the single source of the
// classes: each precision mode names its table in kPrecisionModes.
#include "amp/policy.h"

#include <sstream>

namespace mixtape {

std::optional<OpPolicy> autocast_policy(const AutocastPolicyTable& table, std::string_view name) {
  for (const AutocastTableEntry& entry : table.rows)
    if (name == entry.name) return entry.policy;
  return std::nullopt;
}

namespace {

std::string_view runs_in(const AutocastPolicyTable& table, OpPolicy policy) {
  switch (policy) {
    case OpPolicy::LowerPrecision: return table.lower_precision;
    case OpPolicy::Fp32: return "f32";
    case OpPolicy::Promote: return "widest floating input";
    case OpPolicy::Unlisted: return "its inputs' dtype (mixed: the widest, by type promotion)";
  }
  return "?";
}

// What a mode that autocasts nothing does instead, after "<mode> casts no ops: no autocast; ".
std::string instead_of_autocast(const AmpConfig& config) {
  const PrecisionModeRow& row = config.row();
  if (const std::optional<DType> model = config.model_dtype()) {
    std::string text = "the whole model is cast to " + std::string(dtype_name(*model));
    if (row.family == ModeFamily::Apex) text += " (Apex " + config.apex.opt_level + ": patch_torch_functions off)";
    return text;
  }
  if (row.tf32_matmuls) return "every op runs in f32, matmul inputs rounded to tf32";
  return "every op runs in f32";
}

}  // namespace

std::string autocast_policy_table_markdown(const AutocastPolicyTable& table) {
  std::ostringstream out;
  out << "| op | runs in | listed as | note |\n|---|---|---|---|\n";
  // Grouped by class so the table reads as the framework's lists; within a group, table order.
  for (OpPolicy policy : {OpPolicy::LowerPrecision, OpPolicy::Fp32, OpPolicy::Promote, OpPolicy::Unlisted})
    for (const AutocastTableEntry& entry : table.rows)
      if (entry.policy == policy)
        out << "| `" << entry.name << "` | " << runs_in(table, policy) << " | " << entry.listed_as << " | "
            << entry.note << " |\n";
  out << "\nf64 and integer inputs are never cast. Ops with no row run in their inputs' dtype.\n";
  return out.str();
}

std::string autocast_policy_text(const AmpConfig& config) {
  const std::string mode = config.name();
  if (!config.autocast_dtype()) return mode + " casts no ops: no autocast; " + instead_of_autocast(config) + "\n";
  const AutocastPolicyTable& table = *config.row().autocast_policy;
  return "Autocast policy of " + mode + ": " + table.framework + ", from " + table.source + "\n\n" +
         autocast_policy_table_markdown(table);
}

void print_autocast_policy_table(std::ostream& out, const AmpConfig& config) {
  out << autocast_policy_text(config);
}

void print_autocast_policy_table(std::ostream& out, PrecisionMode mode) {
  print_autocast_policy_table(out, AmpConfig::parse(mode_row(mode).name));
}

}  // namespace mixtape
