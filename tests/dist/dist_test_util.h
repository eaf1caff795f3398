#pragma once
// Helpers shared by the distributed tests (tests/dist/).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace mixtape::testing {

// |a - b| <= tol * max(|b|, floor) elementwise; reports the first three differences.
inline void expect_close(const std::vector<double>& a, const std::vector<double>& b, double tol, double floor,
                         const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  int reported = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const bool ok = std::abs(a[i] - b[i]) <= tol * std::max(std::abs(b[i]), floor);
    if (!ok && reported++ < 3) ADD_FAILURE() << what << "[" << i << "]: " << a[i] << " vs " << b[i];
  }
}

}  // namespace mixtape::testing
