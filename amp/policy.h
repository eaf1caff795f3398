#pragma once
// The autocast policy table: which ops run in the autocast dtype, which in fp32 and which promote to their
// widest floating input. The table itself is kAutocastTable in tensor/autocast_state.h (the op front ends,
// below amp/, read it by AutocastOp constant); this header exposes and prints that one table, it keeps no
// copy. Ops not in the table run in their inputs' dtype.
#include <optional>
#include <ostream>
#include <string>
#include <string_view>

#include "tensor/autocast_state.h"

namespace mixtape {

// The policy of the op named `name` (as in ops.h), or nullopt when the op is not in the table.
std::optional<OpPolicy> autocast_policy(std::string_view name);

// The table as a Markdown table (for docs/amp.md): one row per op, grouped by policy, in table order.
std::string autocast_policy_table_markdown();
void print_autocast_policy_table(std::ostream& out);

}  // namespace mixtape
