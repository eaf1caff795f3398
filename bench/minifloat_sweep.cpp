// Every one of the 2^32 f32 bit patterns through the E4M3, E5M2 and E2M1 encoders (tensor/minifloat.h), both
// overflow rules, against a reference built in double arithmetic from the formats' definitions alone:
//   a finite |x| rounds to the nearest multiple of the format's step at its binade, 2^(max(e, emin) - M) (ties
//   to even: std::nearbyint in the default rounding mode), which is exact in double for every float;
//   a result above the largest finite value is the largest finite value (Saturate, and E2M1 always), NaN for
//   E4M3 and Inf for E5M2 (Cast); Inf does the same; NaN is NaN (E2M1 has no NaN: skipped).
// The encoder's code is decoded (minifloat_to_float, itself checked code by code against the OCP tables in
// tests/test_minifloat.cpp) and compared with the reference value, the sign of zero included.
// The test suite sweeps a stride through the patterns and every tie; this program, too slow for the suite
// (minutes on 2 cores), sweeps them all:
//   ./build/bench/minifloat_sweep           (exit status 1 and the first mismatches if any value differs)
#include <omp.h>

#include <bit>
#include <cfenv>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>

#include "tensor/minifloat.h"

namespace {

using mixtape::FormatOverflow;
using mixtape::MinifloatFormat;

struct Case {
  const char* name;
  const MinifloatFormat& format;
  int mantissa_bits, emin;  // emin: the smallest normal exponent, 1 - bias
  double max_finite;
  double beyond_cast;       // what Cast gives above max_finite: NaN (E4M3), Inf (E5M2), max_finite (E2M1)
};

double reference(float value, const Case& c, FormatOverflow overflow) {
  const double beyond = overflow == FormatOverflow::Saturate ? c.max_finite : c.beyond_cast;
  if (std::isinf(value)) return std::copysign(beyond, value);
  const double a = std::fabs(static_cast<double>(value));
  if (a == 0) return std::copysign(0.0, value);
  int k = 0;
  std::frexp(a, &k);  // a = f 2^k, f in [0.5, 1): the binade's exponent is k - 1
  const int e = std::max(k - 1, c.emin);
  const double step = std::ldexp(1.0, e - c.mantissa_bits);
  const double rounded = std::nearbyint(a / step) * step;
  return std::copysign(rounded > c.max_finite ? beyond : rounded, value);
}

bool same(double got, double want) {
  if (std::isnan(want)) return std::isnan(got);
  return got == want && std::signbit(got) == std::signbit(want);
}

}  // namespace

int main() {
  std::fesetround(FE_TONEAREST);
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  const Case cases[] = {{"E4M3", mixtape::kE4M3, 3, -6, 448.0, nan},
                        {"E5M2", mixtape::kE5M2, 2, -14, 57344.0, inf},
                        {"E2M1", mixtape::kE2M1, 1, 0, 6.0, 6.0}};
  int64_t total_mismatches = 0;
  for (const Case& c : cases)
    for (const FormatOverflow overflow : {FormatOverflow::Cast, FormatOverflow::Saturate}) {
      const char* rule = overflow == FormatOverflow::Cast ? "cast" : "saturate";
      const auto start = std::chrono::steady_clock::now();
      int64_t mismatches = 0, checked = 0;
#pragma omp parallel for schedule(static) reduction(+ : mismatches, checked)
      for (int64_t hi = 0; hi < (int64_t{1} << 16); ++hi)
        for (uint32_t lo = 0; lo < (1u << 16); ++lo) {
          const uint32_t bits = static_cast<uint32_t>(hi) << 16 | lo;
          const float value = std::bit_cast<float>(bits);
          if (std::isnan(value) && c.mantissa_bits == 1) continue;  // no E2M1 NaN
          ++checked;
          const double want = std::isnan(value) ? nan : reference(value, c, overflow);
          const double got = mixtape::minifloat_to_float(mixtape::float_to_minifloat(value, c.format, overflow), c.format);
          if (!same(got, want)) {
            ++mismatches;
#pragma omp critical
            if (mismatches <= 3)
              std::printf("  %s %s: 0x%08" PRIx32 " (%.9g) encodes to %.9g, expected %.9g\n", c.name, rule, bits,
                          static_cast<double>(value), got, want);
          }
        }
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::printf("%s %-8s %" PRId64 " patterns, %" PRId64 " mismatches (%.1f s, %d threads)\n", c.name, rule,
                  checked, mismatches, seconds, omp_get_max_threads());
      total_mismatches += mismatches;
    }
  std::printf(total_mismatches == 0 ? "every f32 pattern encodes as the formats define\n"
                                    : "MISMATCHES: the encoder differs from the formats' definitions\n");
  return total_mismatches == 0 ? 0 : 1;
}
