// gemm16 (tensor/cpu/gemm16.cpp): the CPU's own GEMM on fp16 and bf16 operands, on every kernel this build
// has (AVX-512 and AVX2 on an AVX-512 machine; the AVX2 kernel alone on an AVX2 one).
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "tensor/backend.h"
#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/gemm16.h"
#include "tensor/ops.h"
#include "test_util.h"

using namespace mixtape;
using mixtape::testing::Gemm16Setting;

namespace {

std::vector<cpu::Gemm16Isa> kernels() { return cpu::gemm16_kernels(); }

template <class T>
const char* name_of() {
  return std::is_same_v<T, Half> ? "f16" : "bf16";
}

// A matrix of 16-bit values stored row- or column-major with a padded leading dimension.
template <class T>
struct Stored {
  std::vector<T> data;
  cpu::Matrix16<T> view;
};

template <class T>
Stored<T> store(const std::vector<float>& values, int64_t rows, int64_t cols, bool row_major, int64_t pad) {
  Stored<T> s;
  const int64_t ld = (row_major ? cols : rows) + pad;
  s.data.assign(static_cast<size_t>(ld * (row_major ? rows : cols)), T(-7.0f));  // padding never read
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      s.data[static_cast<size_t>(row_major ? i * ld + j : j * ld + i)] = T(values[static_cast<size_t>(i * cols + j)]);
  s.view = row_major ? cpu::Matrix16<T>{s.data.data(), ld, 1} : cpu::Matrix16<T>{s.data.data(), 1, ld};
  return s;
}

// Values in [-2, 2) that T holds exactly.
template <class T>
std::vector<float> random_values(int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = static_cast<float>(T(dist(gen)));
  return v;
}

// What the kernel promises: per output, the K products summed in float, in order of k (one FMA each), then
// the bias added and the sum rounded to T once.
template <class T>
uint16_t reference(const std::vector<float>& a, const std::vector<float>& b, const std::vector<float>* bias,
                   int64_t K, int64_t N, int64_t m, int64_t n) {
  float sum = 0.0f;
  for (int64_t k = 0; k < K; ++k)
    sum = std::fma(a[static_cast<size_t>(m * K + k)], b[static_cast<size_t>(k * N + n)], sum);
  if (bias) sum += (*bias)[static_cast<size_t>(n)];
  return T(sum).bits;
}

template <class T>
bool same(uint16_t got, uint16_t want) {
  const auto is_nan = [](uint16_t bits) {
    return std::is_same_v<T, Half> ? (bits & 0x7c00) == 0x7c00 && (bits & 0x03ff) != 0
                                   : (bits & 0x7f80) == 0x7f80 && (bits & 0x007f) != 0;
  };
  return is_nan(got) || is_nan(want) ? is_nan(got) == is_nan(want) : got == want;
}

struct ThreadCount {
  explicit ThreadCount(int threads) : saved(omp_get_max_threads()) { omp_set_num_threads(threads); }
  ~ThreadCount() { omp_set_num_threads(saved); }
  int saved;
};

template <class T>
void check_against_the_in_order_sum(cpu::Gemm16Isa isa) {
  // Shapes around both kernels' register tiles (one element, partial tiles on both sides, whole tiles, several
  // threads' shares), every layout of A and B with padded leading dims, with and without a bias, the output rows
  // padded too: the padding must stay untouched. N = 1, 33, 65, 100, 290 and 35 end in a sliver of 1, 1, 1, 4, 2
  // and 3 columns (on both kernels' slivers, 32 and 16 wide), which a transposed A multiplies with the vectors
  // along its rows (narrow_tiles), in groups of up to four tiles: the small (one-thread) products of 13, 25, 30,
  // 10 and 50 rows give AVX-512 groups of 2, 3, 3, 1 and 4 + 1 tiles, AVX2 3, 4 + 1, 4 + 1, 2 and 4 + 4 + 1,
  // partial last tiles among them. One variant plants inf and NaN, one overflows: a float sum above T's largest
  // value rounds to inf only at the end (bf16: 3e38 twice).
  struct Shape3 {
    int64_t M, K, N;
  };
  const Shape3 shapes[] = {{1, 1, 1},       {5, 3, 7},       {12, 16, 32},   {13, 17, 33},
                           {25, 40, 65},    {70, 300, 100},  {130, 257, 45}, {7, 9, 8},
                           {30, 37, 290},   {10, 20, 35},    {50, 20, 35}};
  // big * big * 2 overflows T, one product does not; a value T holds exactly, as all inputs are.
  const float big = static_cast<float>(T(std::is_same_v<T, Half> ? 255.0f : 1.5e19f));
  uint32_t seed = 1;
  for (const Shape3& s : shapes) {
    for (int variant = 0; variant < 3; ++variant) {
      SCOPED_TRACE(std::string(name_of<T>()) + " " + cpu::gemm16_isa_name(isa) + " " + std::to_string(s.M) + "x" +
                   std::to_string(s.K) + "x" + std::to_string(s.N) + " variant " + std::to_string(variant));
      std::vector<float> a = random_values<T>(s.M * s.K, seed++), b = random_values<T>(s.K * s.N, seed++);
      std::vector<float> bias = random_values<T>(s.N, seed++);
      if (variant == 1) {  // specials
        a[0] = std::numeric_limits<float>::infinity();
        b[static_cast<size_t>(s.K * s.N - 1)] = std::numeric_limits<float>::quiet_NaN();
      } else if (variant == 2) {  // row 0 of A and column 0 of B all big
        for (int64_t k = 0; k < s.K; ++k) a[static_cast<size_t>(k)] = b[static_cast<size_t>(k * s.N)] = big;
      }
      for (bool a_rows : {true, false}) {
        for (bool b_rows : {true, false}) {
          for (bool with_bias : {false, true}) {
            const Stored<T> sa = store<T>(a, s.M, s.K, a_rows, 3), sb = store<T>(b, s.K, s.N, b_rows, 5);
            std::vector<T> bias_t;
            for (float x : bias) bias_t.push_back(T(x));
            const int64_t ldo = s.N + 2;
            const T sentinel = T::from_bits(0x1234);
            std::vector<T> out(static_cast<size_t>(s.M * ldo), sentinel);
            cpu::gemm16(s.M, s.K, s.N, sa.view, sb.view, with_bias ? bias_t.data() : nullptr, out.data(), ldo);
            int wrong = 0;
            for (int64_t m = 0; m < s.M; ++m) {
              for (int64_t n = 0; n < ldo; ++n) {
                const uint16_t got = out[static_cast<size_t>(m * ldo + n)].bits;
                const uint16_t want =
                    n < s.N ? reference<T>(a, b, with_bias ? &bias : nullptr, s.K, s.N, m, n) : sentinel.bits;
                if (!same<T>(got, want) && ++wrong <= 3)
                  ADD_FAILURE() << "A " << (a_rows ? "row" : "column") << "-major, B " << (b_rows ? "row" : "column")
                                << "-major, bias " << with_bias << ": out(" << m << ", " << n << ") = 0x" << std::hex
                                << got << ", want 0x" << want << std::dec;
              }
            }
            EXPECT_EQ(wrong, 0);
            if (variant == 2 && s.K >= 2) {
              EXPECT_TRUE(std::isinf(static_cast<float>(out[0])));
            }
          }
        }
      }
    }
  }
}

template <class T>
void check_thread_counts(cpu::Gemm16Isa isa) {
  // Threads split A's tiles (or, for a short A, B's slivers); each output is still one float sum in order of
  // k, so the split must not show. Shapes: many tiles, fewer tiles than threads; A in either layout; a last
  // sliver of 4 columns (N = 196) for narrow_tiles; B column-major (widened sliver by sliver) and, once,
  // row-major (row by row).
  for (auto [M, K, N, a_rows, b_rows] :
       {std::tuple<int64_t, int64_t, int64_t, bool, bool>{300, 520, 200, false, false},
        {5, 600, 700, false, false}, {300, 520, 300, true, false}, {5, 600, 700, true, false},
        {300, 520, 196, false, false}, {5, 600, 700, false, true}}) {
    SCOPED_TRACE(std::string(name_of<T>()) + " " + cpu::gemm16_isa_name(isa) + " M " + std::to_string(M) + " N " +
                 std::to_string(N) + (a_rows ? " A rows" : " A columns") + (b_rows ? ", B rows" : ", B columns"));
    const std::vector<float> a = random_values<T>(M * K, 11), b = random_values<T>(K * N, 12);
    const Stored<T> sa = store<T>(a, M, K, a_rows, 0), sb = store<T>(b, K, N, b_rows, 1);
    std::vector<std::vector<T>> outs;
    for (int threads : {1, 2, 3}) {
      const ThreadCount scope(threads);
      outs.emplace_back(static_cast<size_t>(M * N));
      cpu::gemm16(M, K, N, sa.view, sb.view, static_cast<const T*>(nullptr), outs.back().data(), N);
    }
    for (size_t i = 1; i < outs.size(); ++i)
      EXPECT_EQ(std::memcmp(outs[0].data(), outs[i].data(), outs[0].size() * sizeof(T)), 0) << "run " << i;
    EXPECT_EQ(outs[0][5].bits, reference<T>(a, b, nullptr, K, N, 0, 5));
    EXPECT_EQ(outs[0][static_cast<size_t>(M * N - 1)].bits, reference<T>(a, b, nullptr, K, N, M - 1, N - 1));
  }
}

// A whole tile's outputs are rounded from the kernel's registers (a partial tile's through a buffer): one
// 12 x 32 product with K = 1 (a whole tile for both kernels: one of AVX-512's, four of AVX2's 6 x 16), each
// output a(m) b(n) + bias(n), with a, b and the bias chosen so that the float sums are ties (to even, up and
// down), subnormal in T, round past T's largest value to inf, or are inf, NaN and signed zeros.
template <class T>
void check_rounding_of_whole_tiles(cpu::Gemm16Isa isa) {
  constexpr bool kHalf = std::is_same_v<T, Half>;
  constexpr int64_t M = 12, N = 32;
  const int p = kHalf ? 11 : 8;                                  // significant bits of T
  const float tiny = std::ldexp(1.0f, kHalf ? -24 : -133);        // T's smallest subnormal
  const float largest = static_cast<float>(T::from_bits(kHalf ? 0x7bff : 0x7f7f));
  const float half_ulp_1 = std::ldexp(1.0f, -p), half_ulp_max = std::ldexp(1.0f, (kHalf ? 15 : 127) - p);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> a = {1, 0.5f, -0.5f, 2, 0.75f, -1, 0.25f, 1.5f, 3, -0.75f, 0.125f, -2};
  std::vector<float> b = {1, 1 + 2 * half_ulp_1, -1, 1, 3 * tiny, 5 * tiny, 7 * tiny, tiny, largest, largest,
                          -largest, 0, -0.0f, -0.0f, inf, nan, 1, 4 * tiny};
  std::vector<float> bias = {half_ulp_1, half_ulp_1, -half_ulp_1, 1.5f * half_ulp_1, 0, tiny, -tiny, 0,
                             half_ulp_max, -half_ulp_max, -half_ulp_max, -0.0f, -0.0f, 0, -inf, 1, inf, -tiny};
  const std::vector<float> fill_b = random_values<T>(N, 31), fill_bias = random_values<T>(N, 32);
  for (int64_t n = static_cast<int64_t>(b.size()); n < N; ++n) {
    b.push_back(fill_b[static_cast<size_t>(n)]);
    bias.push_back(fill_bias[static_cast<size_t>(n)]);
  }
  for (float x : b) ASSERT_TRUE(std::isnan(x) || static_cast<float>(T(x)) == x) << x << " is not a " << name_of<T>();
  for (float x : bias) ASSERT_TRUE(static_cast<float>(T(x)) == x) << x << " is not a " << name_of<T>();
  std::vector<T> bias_t;
  for (float x : bias) bias_t.push_back(T(x));
  for (bool a_rows : {true, false}) {
    SCOPED_TRACE(std::string(name_of<T>()) + " " + cpu::gemm16_isa_name(isa) + (a_rows ? " A rows" : " A columns"));
    const Stored<T> sa = store<T>(a, M, 1, a_rows, 0), sb = store<T>(b, 1, N, true, 0);
    std::vector<T> out(static_cast<size_t>(M * N));
    cpu::gemm16(M, 1, N, sa.view, sb.view, bias_t.data(), out.data(), N);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        const uint16_t got = out[static_cast<size_t>(m * N + n)].bits;
        const uint16_t want = reference<T>(a, b, &bias, 1, N, m, n);
        EXPECT_TRUE(same<T>(got, want)) << "out(" << m << ", " << n << ") = 0x" << std::hex << got << ", want 0x"
                                        << want << std::dec << " (a " << a[m] << ", b " << b[n] << ", bias "
                                        << bias[n] << ")";
      }
    // The planted cases hit what they aim at: a tie kept even, one rounded up to even, an overflow to inf.
    EXPECT_EQ(static_cast<float>(out[0]), 1.0f);
    EXPECT_EQ(static_cast<float>(out[1]), 1 + 4 * half_ulp_1);
    EXPECT_TRUE(std::isinf(static_cast<float>(out[8])));
  }
}

}  // namespace

TEST(Gemm16, WholeTilesRoundTiesSubnormalsAndOverflowsAsConvertDoes) {
  if (kernels().empty()) GTEST_SKIP() << "no AVX2 or AVX-512 here: 16-bit products go through the f32 GEMM";
  for (cpu::Gemm16Isa isa : kernels()) {
    const Gemm16Setting setting(isa);
    check_rounding_of_whole_tiles<Half>(isa);
    check_rounding_of_whole_tiles<BFloat16>(isa);
  }
}

TEST(Gemm16, EveryOutputIsTheInOrderFloatSumRoundedOnce) {
  if (kernels().empty()) GTEST_SKIP() << "no AVX2 or AVX-512 here: 16-bit products go through the f32 GEMM";
  for (cpu::Gemm16Isa isa : kernels()) {
    const Gemm16Setting setting(isa);
    check_against_the_in_order_sum<Half>(isa);
    check_against_the_in_order_sum<BFloat16>(isa);
  }
}

TEST(Gemm16, GivesTheSameBitsOnAnyThreadCount) {
  if (kernels().empty()) GTEST_SKIP() << "no AVX2 or AVX-512 here";
  for (cpu::Gemm16Isa isa : kernels()) {
    const Gemm16Setting setting(isa);
    check_thread_counts<Half>(isa);
    check_thread_counts<BFloat16>(isa);
  }
}

namespace {

// An f16 (or bf16) matmul and linear layer give gemm16's bits, the in-order float sum, in every layout of
// their operands, on each kernel, and the backward multiplies the 16-bit gradient in place. With A transposed,
// B row-major, no bias and N >= 2M >= 128 (a weight gradient's shape), the AVX-512 kernel's products run as
// out^T = B^T A^T transposed into out (tensor/cpu/matmul.cpp, transpose_wide_product): 64 x 130, on two
// threads where there are two.
template <class T>
void check_matmul_and_linear(int64_t M, int64_t K, int64_t N) {
  const DType dtype = std::is_same_v<T, Half> ? DType::F16 : DType::BF16;
  const std::vector<float> av = random_values<T>(M * K, 21), bv = random_values<T>(K * N, 22),
                           biasv = random_values<T>(N, 23);
  auto tensor = [&](const std::vector<float>& v, const Shape& shape) {
    return Tensor::from_vector(std::vector<double>(v.begin(), v.end()), shape, dtype);
  };
  const Tensor a = tensor(av, {M, K}), b = tensor(bv, {K, N}), bias = tensor(biasv, {N});
  std::vector<double> want(static_cast<size_t>(M * N)), want_bias(static_cast<size_t>(M * N));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      want[static_cast<size_t>(m * N + n)] = T::from_bits(reference<T>(av, bv, nullptr, K, N, m, n));
      want_bias[static_cast<size_t>(m * N + n)] = T::from_bits(reference<T>(av, bv, &biasv, K, N, m, n));
    }
  }
  for (cpu::Gemm16Isa isa : kernels()) {
    const Gemm16Setting setting(isa);
    SCOPED_TRACE(std::string(name_of<T>()) + " " + cpu::gemm16_isa_name(isa) + " " + std::to_string(M) + "x" +
                 std::to_string(K) + "x" + std::to_string(N));
    EXPECT_FALSE(backend_of(a).matmul_widens(dtype));
    for (const Tensor& x : {a, a.mT().contiguous().mT()}) {
      for (const Tensor& y : {b, b.mT().contiguous().mT()}) {
        EXPECT_EQ(matmul(x, y).to_vector<double>(), want);
        EXPECT_EQ(linear(x, y.mT(), bias).to_vector<double>(), want_bias);
      }
    }
  }
}

}  // namespace

TEST(Gemm16, MatmulAndLinearRunOnItWhereTheCpuHasNoGemmOfItsOwn) {
  // f16 everywhere but on AMX (the bf16-parts route); bf16 on its f32 route, which is the automatic one where
  // oneDNN has no bf16 GEMM for the CPU (an AVX2 machine) or where the CPU's bf16 dot product is slow (a Xeon
  // without AMX), and which a test can ask for anywhere.
  if (kernels().empty()) GTEST_SKIP() << "no AVX2 or AVX-512 here: 16-bit products go through the f32 GEMM";
  for (auto [M, K, N] : {std::tuple<int64_t, int64_t, int64_t>{40, 70, 50}, {64, 300, 130}}) {
    if (!cpu::f16_matmul_splits()) check_matmul_and_linear<Half>(M, K, N);
    const mixtape::testing::Bf16GemmSetting f32_route(cpu::Bf16Gemm::F32);
    check_matmul_and_linear<BFloat16>(M, K, N);
  }
}

TEST(Gemm16, RefusesWhatItCannotReadOrRun) {
  std::vector<Half> data(64);
  const cpu::F16Matrix plain{data.data(), 4, 1}, strided{data.data(), 8, 2};
  EXPECT_FALSE(cpu::gemm16_takes(strided, plain));
  EXPECT_FALSE(cpu::gemm16_takes(plain, strided));
  EXPECT_TRUE(cpu::gemm16_takes(plain, plain));
  std::vector<Half> out(16);
  EXPECT_ERROR_MENTIONS(cpu::gemm16(4, 4, 4, strided, plain, static_cast<const Half*>(nullptr), out.data(), 4),
                        "gemm16 (f16)", "unit stride", "a strides 8, 2");
  EXPECT_ERROR_MENTIONS(cpu::gemm16(0, 4, 4, plain, plain, static_cast<const Half*>(nullptr), out.data(), 4),
                        "gemm16 (f16)", "M 0", "must be positive");
  {
    const Gemm16Setting off(cpu::Gemm16Isa::None);
    EXPECT_ERROR_MENTIONS(cpu::gemm16(4, 4, 4, plain, plain, static_cast<const Half*>(nullptr), out.data(), 4),
                          "not supported", "through the f32 GEMM");
  }
  if (kernels().size() < 2) {  // a kernel this build lacks cannot be chosen
    const cpu::Gemm16Isa missing = kernels().empty() ? cpu::Gemm16Isa::Avx2 : cpu::Gemm16Isa::Avx512;
    EXPECT_ERROR_MENTIONS(cpu::set_gemm16_isa(missing), "set_gemm16_isa", "not supported");
  }
}

TEST(Gemm16, TheEnvironmentVariableNamesAKernelThisBuildHas) {
  const std::vector<cpu::Gemm16Isa> built = kernels();
  const cpu::Gemm16Isa widest = built.empty() ? cpu::Gemm16Isa::None : built.front();
  EXPECT_EQ(cpu::gemm16_isa_from_env(nullptr), widest);
  EXPECT_EQ(cpu::gemm16_isa_from_env(""), widest);
  EXPECT_EQ(cpu::gemm16_isa_from_env("none"), cpu::Gemm16Isa::None);
  for (cpu::Gemm16Isa isa : built)
    EXPECT_EQ(cpu::gemm16_isa_from_env(isa == cpu::Gemm16Isa::Avx2 ? "avx2" : "avx512"), isa);
  EXPECT_ERROR_MENTIONS(cpu::gemm16_isa_from_env("AVX2"), "MIXTAPE_GEMM16=AVX2", "expected none, avx2 or avx512");
  if (built.size() < 2)
    EXPECT_ERROR_MENTIONS(cpu::gemm16_isa_from_env(built.empty() ? "avx2" : "avx512"), "not supported");
}
