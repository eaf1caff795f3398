#include "io/state_dict.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace mixtape {

std::string first_bad_value(const Tensor& t, bool non_negative) {
  if (!t.defined() || !is_floating(t.dtype())) return {};
  const Tensor flat = t.reshape({-1});
  const int64_t n = flat.numel();
  constexpr int64_t kChunk = int64_t{1} << 20;  // 8 MiB of doubles at a time
  for (int64_t start = 0; start < n; start += kChunk) {
    const int64_t length = std::min(kChunk, n - start);
    const std::vector<double> values = flat.narrow(0, start, length).to_vector<double>();
    for (int64_t k = 0; k < length; ++k) {
      const double v = values[static_cast<size_t>(k)];
      if (!std::isfinite(v) || (non_negative && v < 0))
        return "element " + std::to_string(start + k) + " is " + exact_number_text(v);
    }
  }
  return {};
}

}  // namespace mixtape
