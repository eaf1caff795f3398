#pragma once
// The autocast policy tables, printed: one per framework (tensor/autocast_tables.h: PyTorch AMP's, Apex
// O1's), each precision mode naming its own (PrecisionModeRow::autocast_policy). The tables live in tensor/
// because the op front ends read them; this header looks ops up in them and prints them, it keeps no copy.
// Ops in no table run in their inputs' dtype under every policy.
#include <optional>
#include <ostream>
#include <string>
#include <string_view>

#include "amp/config.h"
#include "amp/precision_mode.h"
#include "tensor/autocast_tables.h"

namespace mixtape {

// The class of the op named `name` (as in ops.h) in `table`, or nullopt when the op has no row.
std::optional<OpPolicy> autocast_policy(const AutocastPolicyTable& table, std::string_view name);

// `table` as a Markdown table (docs/amp.md shows PyTorch's): one row per op, grouped by class (lower
// precision, fp32, promote, not listed), in table order within a group, then a line on what is never cast.
std::string autocast_policy_table_markdown(const AutocastPolicyTable& table);

// A mode's autocast policy: a heading naming the mode, its framework and the source lists, then its table;
// for a mode that autocasts nothing, one line saying so and what the mode casts instead. The AmpConfig form
// tells Apex's opt levels apart (only O1 autocasts); the PrecisionMode form is the mode's default options.
std::string autocast_policy_text(const AmpConfig& config);
void print_autocast_policy_table(std::ostream& out, const AmpConfig& config);
void print_autocast_policy_table(std::ostream& out, PrecisionMode mode);

}  // namespace mixtape
