// gemm_f16 (tensor/cpu/gemm_f16.cpp): the CPU's own fp16 GEMM, where it has one.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "tensor/backend.h"
#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/gemm_f16.h"
#include "tensor/ops.h"

using namespace mixtape;

namespace {

// A matrix of fp16 values stored row- or column-major with a padded leading dimension.
struct Stored {
  std::vector<Half> data;
  cpu::F16Matrix view;
};

Stored store(const std::vector<float>& values, int64_t rows, int64_t cols, bool row_major, int64_t pad) {
  Stored s;
  const int64_t ld = (row_major ? cols : rows) + pad;
  s.data.assign(static_cast<size_t>(ld * (row_major ? rows : cols)), Half(-7.0f));  // padding never read
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      s.data[static_cast<size_t>(row_major ? i * ld + j : j * ld + i)] = Half(values[static_cast<size_t>(i * cols + j)]);
  s.view = row_major ? cpu::F16Matrix{s.data.data(), ld, 1} : cpu::F16Matrix{s.data.data(), 1, ld};
  return s;
}

std::vector<float> random_halves(int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = static_cast<float>(Half(dist(gen)));
  return v;
}

// What the kernel promises: per output, the K products summed in float, in order of k (one FMA each), then
// the bias added and the sum rounded to fp16 once.
uint16_t reference(const std::vector<float>& a, const std::vector<float>& b, const std::vector<float>* bias,
                   int64_t K, int64_t N, int64_t m, int64_t n) {
  float sum = 0.0f;
  for (int64_t k = 0; k < K; ++k)
    sum = std::fma(a[static_cast<size_t>(m * K + k)], b[static_cast<size_t>(k * N + n)], sum);
  if (bias) sum += (*bias)[static_cast<size_t>(n)];
  return Half(sum).bits;
}

bool same(uint16_t got, uint16_t want) {
  const bool got_nan = (got & 0x7c00) == 0x7c00 && (got & 0x03ff) != 0;
  const bool want_nan = (want & 0x7c00) == 0x7c00 && (want & 0x03ff) != 0;
  return got_nan || want_nan ? got_nan == want_nan : got == want;
}

struct ThreadCount {
  explicit ThreadCount(int threads) : saved(omp_get_max_threads()) { omp_set_num_threads(threads); }
  ~ThreadCount() { omp_set_num_threads(saved); }
  int saved;
};

}  // namespace

TEST(GemmF16, EveryOutputIsTheInOrderFloatSumRoundedOnce) {
  if (!cpu::gemm_f16_available()) GTEST_SKIP() << "no AVX-512 here: f16 products go through the f32 GEMM";
  // Shapes around the 12 x 32 register tile (one element, partial tiles on both sides, whole tiles, several
  // threads' shares), every layout of A and B with padded leading dims, with and without a bias, the output
  // rows padded too: the padding must stay untouched. One case plants inf and NaN, and one overflows: a
  // float sum above 65504 rounds to inf only at the end.
  struct Shape3 {
    int64_t M, K, N;
  };
  const Shape3 shapes[] = {{1, 1, 1}, {5, 3, 7}, {12, 16, 32}, {13, 17, 33}, {25, 40, 65}, {70, 300, 100},
                           {130, 257, 45}};
  uint32_t seed = 1;
  for (const Shape3& s : shapes) {
    for (int variant = 0; variant < 3; ++variant) {
      SCOPED_TRACE(std::to_string(s.M) + "x" + std::to_string(s.K) + "x" + std::to_string(s.N) + " variant " +
                   std::to_string(variant));
      std::vector<float> a = random_halves(s.M * s.K, seed++), b = random_halves(s.K * s.N, seed++);
      std::vector<float> bias = random_halves(s.N, seed++);
      if (variant == 1) {  // specials
        a[0] = std::numeric_limits<float>::infinity();
        b[static_cast<size_t>(s.K * s.N - 1)] = std::numeric_limits<float>::quiet_NaN();
      } else if (variant == 2) {  // row 0 of A and column 0 of B at 255: K * 65025 overflows fp16 for K >= 2
        for (int64_t k = 0; k < s.K; ++k) a[static_cast<size_t>(k)] = b[static_cast<size_t>(k * s.N)] = 255.0f;
      }
      for (bool a_rows : {true, false}) {
        for (bool b_rows : {true, false}) {
          for (bool with_bias : {false, true}) {
            const Stored sa = store(a, s.M, s.K, a_rows, 3), sb = store(b, s.K, s.N, b_rows, 5);
            std::vector<Half> bias_h(bias.begin(), bias.end());
            const int64_t ldo = s.N + 2;
            std::vector<Half> out(static_cast<size_t>(s.M * ldo), Half::from_bits(0x7bff));  // sentinel
            cpu::gemm_f16(s.M, s.K, s.N, sa.view, sb.view, with_bias ? bias_h.data() : nullptr, out.data(), ldo);
            int wrong = 0;
            for (int64_t m = 0; m < s.M; ++m) {
              for (int64_t n = 0; n < ldo; ++n) {
                const uint16_t got = out[static_cast<size_t>(m * ldo + n)].bits;
                const uint16_t want = n < s.N ? reference(a, b, with_bias ? &bias : nullptr, s.K, s.N, m, n) : 0x7bff;
                if (!same(got, want) && ++wrong <= 3)
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

TEST(GemmF16, GivesTheSameBitsOnAnyThreadCount) {
  if (!cpu::gemm_f16_available()) GTEST_SKIP() << "no AVX-512 here";
  // Threads split A's tiles (or, for a short A, B's slivers); each output is still one float sum in order of
  // k, so the split must not show. Shapes: many tiles, fewer tiles than threads.
  for (auto [M, K, N] : {std::tuple<int64_t, int64_t, int64_t>{300, 520, 200}, {7, 600, 700}}) {
    const std::vector<float> a = random_halves(M * K, 11), b = random_halves(K * N, 12);
    const Stored sa = store(a, M, K, false, 0), sb = store(b, K, N, false, 1);
    std::vector<std::vector<Half>> outs;
    for (int threads : {1, 2, 3}) {
      const ThreadCount scope(threads);
      outs.emplace_back(static_cast<size_t>(M * N));
      cpu::gemm_f16(M, K, N, sa.view, sb.view, nullptr, outs.back().data(), N);
    }
    for (size_t i = 1; i < outs.size(); ++i)
      EXPECT_EQ(std::memcmp(outs[0].data(), outs[i].data(), outs[0].size() * sizeof(Half)), 0) << "run " << i;
    EXPECT_EQ(outs[0][5].bits, reference(a, b, nullptr, K, N, 0, 5));
  }
}

TEST(GemmF16, MatmulAndLinearRunOnItWhereTheCpuHasIt) {
  if (!cpu::gemm_f16_available() || cpu::f16_matmul_splits())
    GTEST_SKIP() << "f16 products take another route on this CPU";
  // An fp16 matmul or linear layer gives gemm_f16's bits (the in-order float sum), in every layout of its
  // operands, and its backward multiplies the fp16 gradient in place (no widened copy).
  EXPECT_FALSE(backend_of(Tensor::zeros({1}, DType::F16)).matmul_widens(DType::F16));
  constexpr int64_t M = 40, K = 70, N = 50;
  const std::vector<float> av = random_halves(M * K, 21), bv = random_halves(K * N, 22), biasv = random_halves(N, 23);
  const Tensor a = Tensor::from_vector(std::vector<double>(av.begin(), av.end()), {M, K}, DType::F16);
  const Tensor b = Tensor::from_vector(std::vector<double>(bv.begin(), bv.end()), {K, N}, DType::F16);
  const Tensor bias = Tensor::from_vector(std::vector<double>(biasv.begin(), biasv.end()), {N}, DType::F16);
  std::vector<double> want(M * N), want_bias(M * N);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      want[static_cast<size_t>(m * N + n)] = Half::from_bits(reference(av, bv, nullptr, K, N, m, n));
      want_bias[static_cast<size_t>(m * N + n)] = Half::from_bits(reference(av, bv, &biasv, K, N, m, n));
    }
  }
  for (const Tensor& x : {a, a.mT().contiguous().mT()}) {
    for (const Tensor& y : {b, b.mT().contiguous().mT()}) {
      EXPECT_EQ(matmul(x, y).to_vector<double>(), want);
      EXPECT_EQ(linear(x, y.mT(), bias).to_vector<double>(), want_bias);
    }
  }
}

TEST(GemmF16, RefusesWhatItCannotRead) {
  std::vector<Half> data(64);
  const cpu::F16Matrix plain{data.data(), 4, 1}, strided{data.data(), 8, 2};
  EXPECT_FALSE(cpu::gemm_f16_takes(strided, plain));
  EXPECT_FALSE(cpu::gemm_f16_takes(plain, strided));
  std::vector<Half> out(16);
  try {
    cpu::gemm_f16(4, 4, 4, strided, plain, nullptr, out.data(), 4);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string message = e.what();
    if (cpu::gemm_f16_available()) {
      EXPECT_NE(message.find("unit stride"), std::string::npos) << message;
      EXPECT_NE(message.find("a strides 8, 2"), std::string::npos) << message;
    } else {
      EXPECT_NE(message.find("not supported"), std::string::npos) << message;
    }
  }
  if (cpu::gemm_f16_available()) {
    EXPECT_TRUE(cpu::gemm_f16_takes(plain, plain));
    EXPECT_THROW(cpu::gemm_f16(0, 4, 4, plain, plain, nullptr, out.data(), 4), Error);
  }
}
