// Printing and lookup over kAutocastTable (tensor/autocast_state.h), the single source of the policies.
#include "amp/policy.h"

#include <sstream>

namespace mixtape {

std::optional<OpPolicy> autocast_policy(std::string_view name) {
  for (const AutocastTableEntry& entry : kAutocastTable)
    if (name == entry.name) return entry.policy;
  return std::nullopt;
}

std::string autocast_policy_table_markdown() {
  std::ostringstream out;
  out << "| op | runs in | note |\n|---|---|---|\n";
  // Grouped by policy so docs/amp.md reads as three lists; within a group, table order.
  for (OpPolicy policy : {OpPolicy::LowerPrecision, OpPolicy::Fp32, OpPolicy::Promote}) {
    for (const AutocastTableEntry& entry : kAutocastTable) {
      if (entry.policy != policy) continue;
      const char* runs_in = policy == OpPolicy::LowerPrecision ? "autocast dtype (f16/bf16)"
                            : policy == OpPolicy::Fp32         ? "f32"
                                                               : "widest floating input";
      out << "| `" << entry.name << "` | " << runs_in << " | " << entry.note << " |\n";
    }
  }
  out << "\nOps not listed run in their inputs' dtype. f64 and integer inputs are never cast.\n";
  return out.str();
}

void print_autocast_policy_table(std::ostream& out) { out << autocast_policy_table_markdown(); }

}  // namespace mixtape
