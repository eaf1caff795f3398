#pragma once
// Helpers shared by the test files: reference comparisons in f64 and ulp distances in 16-bit dtypes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "tensor/cpu/attention_bf16.h"
#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/gemm16.h"
#include "tensor/quantize.h"
#include "tensor/tensor.h"

namespace mixtape::testing {

// Quantization options of one layout: the element format, the block shape (0: the whole dim) and the scale rule.
inline QuantizeOptions quantize_options(DType format, int64_t block_rows, int64_t block_cols,
                                        BlockScale scale = BlockScale::Fp32) {
  QuantizeOptions o;
  o.format = format;
  o.block_rows = block_rows;
  o.block_cols = block_cols;
  o.scale = scale;
  return o;
}

// A process-wide kernel choice made for a scope and restored after it: kSet makes the choice and returns the
// previous one.
template <class Choice, Choice (*kSet)(Choice)>
struct ScopedChoice {
  explicit ScopedChoice(Choice choice) : saved(kSet(choice)) {}
  ~ScopedChoice() { kSet(saved); }
  ScopedChoice(const ScopedChoice&) = delete;
  ScopedChoice& operator=(const ScopedChoice&) = delete;
  Choice saved;
};

// The gemm16 kernel a scope asks for (Gemm16Isa::None: 16-bit products go through the f32 GEMM), so that a
// test runs on each route this build has.
using Gemm16Setting = ScopedChoice<cpu::Gemm16Isa, cpu::set_gemm16_isa>;

// The route of bf16 products a scope asks for (tensor/cpu/matmul.cpp, "bf16 products").
using Bf16GemmSetting = ScopedChoice<cpu::Bf16Gemm, cpu::set_bf16_gemm>;

// The routes of bf16 products this CPU has: oneDNN's bf16 GEMM where oneDNN has one, and f32 FMAs.
inline std::vector<cpu::Bf16Gemm> bf16_gemm_routes() {
  std::vector<cpu::Bf16Gemm> routes;
  if (cpu::onednn_has_bf16_gemm()) routes.push_back(cpu::Bf16Gemm::Onednn);
  routes.push_back(cpu::Bf16Gemm::F32);
  return routes;
}

// The routes of 16-bit products this build has: gemm16's kernels, widest first, then None.
inline std::vector<cpu::Gemm16Isa> gemm16_routes() {
  std::vector<cpu::Gemm16Isa> routes = cpu::gemm16_kernels();
  routes.push_back(cpu::Gemm16Isa::None);
  return routes;
}

// The f64 value `reference` rounded to `dtype` (nearest even), back in f64: what a correctly rounded
// f16/bf16/f32 kernel would store.
inline double round_to(DType dtype, double reference) {
  switch (dtype) {
    case DType::F16: return static_cast<float>(Half(reference));
    case DType::BF16: return static_cast<float>(BFloat16(reference));
    case DType::F32: return static_cast<float>(reference);
    default: return reference;
  }
}

// Distance in units in the last place of `dtype` between two values representable in it (ordered-bits
// difference; +0 and -0 are 0 apart; NaN is infinitely far from anything but NaN).
inline double ulp_distance(DType dtype, double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b) ? 0 : INFINITY;
  auto ordered = [dtype](double v) -> int64_t {
    int64_t bits;
    switch (dtype) {
      case DType::F16: bits = Half(v).bits; return bits & 0x8000 ? -(bits & 0x7fff) : bits;
      case DType::BF16: bits = BFloat16(v).bits; return bits & 0x8000 ? -(bits & 0x7fff) : bits;
      case DType::F32: {
        const int32_t b32 = std::bit_cast<int32_t>(static_cast<float>(v));
        return b32 < 0 ? -static_cast<int64_t>(b32 & 0x7fffffff) : b32;
      }
      default: {
        const int64_t b64 = std::bit_cast<int64_t>(v);
        return b64 < 0 ? -(b64 & 0x7fffffffffffffffLL) : b64;
      }
    }
  };
  return std::abs(static_cast<double>(ordered(a) - ordered(b)));
}

inline const std::vector<DType> kFloatDtypes = {DType::F32, DType::F16, DType::BF16, DType::F64};

// Values drawn uniformly from [low, high) and rounded to dtype: the tensor holds exactly what a reference
// reads back with to_vector<double>().
inline Tensor uniform_tensor(const Shape& shape, uint64_t seed, double low, double high, DType dtype) {
  std::vector<double> values = Tensor::rand(shape, seed, DType::F64).to_vector<double>();
  for (double& v : values) v = low + (high - low) * v;
  return Tensor::from_vector(values, shape, dtype);
}

// Expects every element of `actual` (any dtype) within `max_ulp` ulps (in actual's dtype) of the f64
// `reference` rounded to that dtype. Reports the first few offenders.
inline ::testing::AssertionResult within_ulp(const Tensor& actual, const Tensor& reference, double max_ulp) {
  if (actual.shape() != reference.shape())
    return ::testing::AssertionFailure() << "shape " << actual.description() << " vs " << reference.description();
  const std::vector<double> got = actual.to_vector<double>(), want = reference.to_vector<double>();
  int bad = 0;
  std::string report;
  for (size_t i = 0; i < got.size(); ++i) {
    const double expected = round_to(actual.dtype(), want[i]);
    const double distance = ulp_distance(actual.dtype(), got[i], expected);
    if (distance > max_ulp) {
      if (bad++ < 5)
        report += "element " + std::to_string(i) + ": got " + std::to_string(got[i]) + ", reference " +
                  std::to_string(want[i]) + " (" + std::to_string(distance) + " ulp)\n";
    }
  }
  if (bad) return ::testing::AssertionFailure() << bad << " elements beyond " << max_ulp << " ulp\n" << report;
  return ::testing::AssertionSuccess();
}

// Expects |actual - reference| <= atol + rtol * |reference| elementwise.
inline ::testing::AssertionResult all_close(const Tensor& actual, const Tensor& reference, double atol, double rtol) {
  if (actual.shape() != reference.shape())
    return ::testing::AssertionFailure() << "shape " << actual.description() << " vs " << reference.description();
  const std::vector<double> got = actual.to_vector<double>(), want = reference.to_vector<double>();
  int bad = 0;
  std::string report;
  for (size_t i = 0; i < got.size(); ++i) {
    const double error = std::abs(got[i] - want[i]);
    if (!(error <= atol + rtol * std::abs(want[i])) && !(std::isnan(got[i]) && std::isnan(want[i]))) {
      if (bad++ < 5)
        report += "element " + std::to_string(i) + ": got " + std::to_string(got[i]) + ", reference " +
                  std::to_string(want[i]) + "\n";
    }
  }
  if (bad) return ::testing::AssertionFailure() << bad << " elements differ\n" << report;
  return ::testing::AssertionSuccess();
}

// Expects `statement` to throw mixtape::Error whose message contains every one of `parts`.
#define EXPECT_ERROR_MENTIONS(statement, ...) \
  EXPECT_ERROR_MENTIONS_ALL(statement, (std::vector<std::string>{__VA_ARGS__}))

// The same with the parts in a container of strings (built by the test).
#define EXPECT_ERROR_MENTIONS_ALL(statement, parts)                                             \
  do {                                                                                          \
    try {                                                                                       \
      statement;                                                                                \
      ADD_FAILURE() << "expected mixtape::Error from: " #statement;                             \
    } catch (const ::mixtape::Error& error) {                                                   \
      const std::string message = error.what();                                                 \
      for (const std::string& part : parts)                                                     \
        EXPECT_NE(message.find(part), std::string::npos) << "message: " << message << "\nlacks: " << part; \
    }                                                                                           \
  } while (0)

// Makes `kernel` serve the CPU's bf16 attention for a scope, restoring the previous choice after.
using Bf16AttentionKernelScope = ScopedChoice<cpu::Bf16AttentionKernel, cpu::set_bf16_attention_kernel>;

// The portable kernel serves bf16 for a scope, also on a CPU with AMX or AVX512-BF16.
struct PortableAttention : Bf16AttentionKernelScope {
  PortableAttention() : Bf16AttentionKernelScope(cpu::Bf16AttentionKernel::Portable) {}
};

// The most bytes the CPU allocator holds beyond what was live when `fn` started, at any moment during it.
// The allocator's peak only grows, so first a ballast tensor (never touched, so never paged in) lifts the
// live bytes to the current peak; after that, the peak rises by exactly the extra bytes fn needs.
inline size_t peak_extra_bytes(const std::function<void()>& fn) {
  cpu::CachingAllocator& allocator = cpu::cpu_backend().caching_allocator();
  const cpu::CachingAllocator::Stats before = allocator.stats();
  const size_t gap =
      before.peak_allocated_bytes - before.allocated_bytes;  // a multiple of 512 (rounded sizes)
  const Tensor ballast = gap > 0 ? Tensor::empty({static_cast<int64_t>(gap / 4)}) : Tensor();
  const size_t peak = allocator.stats().peak_allocated_bytes;
  EXPECT_EQ(allocator.stats().allocated_bytes, peak);
  fn();
  return allocator.stats().peak_allocated_bytes - peak;
}

// Whether two tensors hold the same bits (shape, dtype and every element): the resume tests' equality.
inline bool bit_equal(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  const Tensor ac = a.contiguous(), bc = b.contiguous();
  return std::memcmp(ac.data_ptr(), bc.data_ptr(), storage_bytes(a.dtype(), a.numel())) == 0;
}

// A deterministic text of `words` words from a small vocabulary (LCG-drawn), with enough structure for a
// tiny model's loss to fall: the training tests' data.
inline std::string word_text(int words) {
  std::string text;
  const char* vocabulary[] = {"the ", "cat ", "sat ", "on ", "a ", "mat.\n", "dog ", "ran "};
  uint64_t state = 12345;
  for (int i = 0; i < words; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    text += vocabulary[(state >> 33) % 8];
  }
  return text;
}

}  // namespace mixtape::testing
