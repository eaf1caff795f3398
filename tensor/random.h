#pragma once
// Counter-based random numbers (Philox4x32-10, Salmon et al., SC'11). A draw is a pure function of
// (key = seed, counter = offset + element index), so results do not depend on the thread count or device,
// and a Generator's whole state is two integers (easy to checkpoint).
#include <array>
#include <cstdint>

// The draw functions compile for the device too (tensor/cuda/), so a GPU draws the very same bits.
#if defined(__CUDACC__)
#define MIXTAPE_HOST_DEVICE __host__ __device__
#else
#define MIXTAPE_HOST_DEVICE
#endif

namespace mixtape {

// Philox4x32's 10 rounds on the counter's 32-bit words c0..c3 (c0 lowest) in place, under the key k0, k1: the
// four outputs. Words in and out, so that a loop over counters vectorises.
MIXTAPE_HOST_DEVICE inline void philox4x32_rounds(uint32_t& c0, uint32_t& c1, uint32_t& c2, uint32_t& c3, uint32_t k0,
                                                  uint32_t k1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kMul0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kMul1) * c2;
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    c1 = static_cast<uint32_t>(p1);
    c3 = static_cast<uint32_t>(p0);
    c0 = n0;
    c2 = n2;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
}

// Philox4x32 with 10 rounds: four 32-bit outputs for a 128-bit counter and 64-bit key.
MIXTAPE_HOST_DEVICE inline std::array<uint32_t, 4> philox4x32(uint64_t counter_low, uint64_t counter_high,
                                                              uint64_t key) {
  uint32_t c0 = static_cast<uint32_t>(counter_low), c1 = static_cast<uint32_t>(counter_low >> 32);
  uint32_t c2 = static_cast<uint32_t>(counter_high), c3 = static_cast<uint32_t>(counter_high >> 32);
  philox4x32_rounds(c0, c1, c2, c3, static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32));
  return {c0, c1, c2, c3};
}

// Uniform float in [0, 1) from 24 random bits (every value exactly representable).
MIXTAPE_HOST_DEVICE inline float uniform_from_bits(uint32_t bits) { return static_cast<float>(bits >> 8) * 0x1p-24f; }
// Uniform double in [0, 1) from 53 random bits.
MIXTAPE_HOST_DEVICE inline double uniform_double_from_bits(uint32_t high, uint32_t low) {
  return static_cast<double>(((static_cast<uint64_t>(high) << 32 | low) >> 11)) * 0x1p-53;
}

// The state of a random stream: every draw of n elements uses counters [offset, offset + n) and advances
// offset by n. Ops that take a Generator (dropout, rand*) are reproducible from (seed, offset).
struct Generator {
  uint64_t seed = 0;
  uint64_t offset = 0;
  explicit Generator(uint64_t seed_ = 0) : seed(seed_) {}
  uint64_t advance(uint64_t n) {  // returns the offset to use for a draw of n elements
    const uint64_t start = offset;
    offset += n;
    return start;
  }
};

}  // namespace mixtape
