#include "amp/precision_mode.h"

namespace mixtape {

std::vector<std::string> precision_mode_names(std::span<const std::string_view> apex_opt_levels) {
  std::vector<std::string> names;
  for (const PrecisionModeRow& row : kPrecisionModes) {
    if (row.family != ModeFamily::Apex || apex_opt_levels.empty()) {
      names.emplace_back(row.name);
      continue;
    }
    for (std::string_view level : apex_opt_levels) names.push_back(std::string(row.name) + ":" + std::string(level));
  }
  return names;
}

std::string precision_mode_list(std::string_view separator) {
  std::string out;
  for (const PrecisionModeRow& row : kPrecisionModes) {
    if (!out.empty()) out += separator;
    out += row.name;
    if (row.family == ModeFamily::Apex)
      out += "[:" + std::string(kApexOptLevels.front()) + ".." + std::string(kApexOptLevels.back()) + "]";
  }
  return out;
}

}  // namespace mixtape
