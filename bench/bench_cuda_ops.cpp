// bench_cuda_ops: mixtape's CUDA kernels beside the baseline each should approach, in one binary, then a
// summary table (the GPU counterpart of bench_ops).
//
//   ./build/bench/bench_cuda_ops                                  # every row, then the table
//   ./build/bench/bench_cuda_ops --benchmark_filter='gemm_bf16'   # Google Benchmark flags work as usual
//
// GEMM rows: mixtape's matmul / linear vs cuBLAS called directly (cublasGemmEx, the same operand layout and
// dtypes, alpha 1, beta 0, CUBLAS_GEMM_DEFAULT, default math mode, on this program's own stream); rate =
// 2*M*N*K FLOP per call, target ratio >= 0.9.
//   dtypes: f32 (no TF32: CUBLAS_COMPUTE_32F; mixtape with allow_tf32 off), tf32 (f32 storage,
//   CUBLAS_COMPUTE_32F_FAST_TF32; mixtape with allow_tf32 on), bf16 and f16 (16-bit A, B and C,
//   CUBLAS_COMPUTE_32F: fp32 accumulation, as mixtape's contract).
//   shapes (M x K x N): 4096 x 4096 x 4096 as matmul(a [M,K], b [K,N]); GPT-2 small's forward linears at
//   8192 tokens (batch 8 x block 1024) as linear(x [M,K], w [N,K]) = x w^T: qkv 768 -> 2304, attention
//   projection 768 -> 768, MLP up 768 -> 3072, MLP down 3072 -> 768, the tied vocabulary head 768 -> 50304;
//   and the backward GEMMs of the MLP up layer and the vocabulary head: dgrad dX = dY W as matmul(dY, W)
//   (8192 x 3072 x 768, 8192 x 50304 x 768) and wgrad dW = dY^T X as matmul(dY.mT(), X) with dY stored
//   [tokens, out] (3072 x 8192 x 768, 50304 x 8192 x 768): a transposed operand, as autograd produces it.
// Memory-bound rows: mixtape's op vs cudaMemcpyAsync device-to-device moving the same bytes (a copy of X
// bytes moves 2X: it reads X and writes X); rate = bytes moved per second, target ratio >= 0.8. Bytes
// counted per op (the compulsory traffic: each input read once, each output written once; [C] weights and
// per-row statistics, < 0.3 %, not counted):
//   add            16M elements, f32 and bf16: read a, b, write out          = 3 * n * size
//   gelu (erf)     16M elements, f32 and bf16: read x, write out             = 2 * n * size
//   layer_norm     [16384, 768] (GPT-2 small's B*T x C), f32 and bf16, with weight and bias: read x, write out
//   softmax        [16384, 1024] f32 over the last dim: read x, write out
//   cross-entropy  forward, logits [8192, 50304] f32 (GPT-2's vocabulary head), i64 targets: the logits read
//                  once (an implementation that reads them twice, max then sum, reaches at most ~0.5)
//   adam_step      one AdamW optimizer step (lr 1e-4, weight decay 0.1) over GPT-2 small's 148 parameter
//                  tensors (124M f32 elements, gradients set): read p, g, m, v, write p, m, v = 28 bytes per
//                  element (the per-step host work of Optimizer::step included)
//   cast           x.to(bf16) of 16M f32 elements: read 4, write 2 bytes per element
//
// Timing: every benchmark runs a fixed 20 iterations (Google Benchmark's manual time), each timing 10
// back-to-back calls between two CUDA events (mixtape's side: DeviceTimer on mixtape's stream; the baselines:
// events on this program's stream), so the host's launch overhead overlaps the device work as in a real
// step; a call's time = the iteration's / 10. Each side is warmed up first (cuBLAS heuristics, mixtape's
// caching allocator). The table compares the median per-call time of each side over all iterations and
// repetitions. Inputs are made on the CPU and copied to the GPU, so the baselines run even when a mixtape
// kernel is missing; an op that throws is reported as SKIP.
//
// Without a CUDA device the program prints why and exits with status 77.
#include <benchmark/benchmark.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "optim/adam.h"
#include "tensor/backend.h"
#include "tensor/ops.h"
#include "tensor/precision.h"
#include "tensor/timer.h"

using namespace mixtape;

namespace {

constexpr double kGemmTarget = 0.9;       // mixtape GEMM >= 0.9x cuBLAS
constexpr double kBandwidthTarget = 0.8;  // memory-bound ops >= 0.8x cudaMemcpy bandwidth
constexpr int kIterations = 20;           // timed iterations per benchmark (per repetition)
constexpr int kCallsPerIteration = 10;    // calls between the two events of one iteration
constexpr int kWarmupCalls = 3;

const Device kDevice = Device{Device::Type::CUDA, 0};

// ---- checked CUDA / cuBLAS calls ---------------------------------------------------------------------------

void cuda_check(cudaError_t status, const char* call) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string(call) + " failed: " + cudaGetErrorString(status));
}
void cublas_check(cublasStatus_t status, const char* call) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string(call) + " failed: cuBLAS status " + std::to_string(int(status)));
}
#define CUDA_CHECK(call) cuda_check((call), #call)
#define CUBLAS_CHECK(call) cublas_check((call), #call)

// This program's own stream and cuBLAS handle for the baselines (device 0).
struct Baseline {
  cudaStream_t stream = nullptr;
  cublasHandle_t handle = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  Baseline() {
    CUDA_CHECK(cudaSetDevice(kDevice.index));
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    CUBLAS_CHECK(cublasCreate(&handle));
    CUBLAS_CHECK(cublasSetStream(handle, stream));
    CUBLAS_CHECK(cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH));  // TF32 only where the compute type asks
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));
  }
};
Baseline& baseline() {
  static Baseline b;  // created on first use, never destroyed (the driver may be gone at exit)
  return b;
}

// ---- samples and rows of the summary ----------------------------------------------------------------------

struct Samples {
  std::vector<double> seconds;  // per call
  std::string error;
};
std::map<std::string, Samples>& samples() {
  static std::map<std::string, Samples> s;
  return s;
}

struct Comparison {
  std::string label, mixtape, baseline;
  double work;  // FLOP or bytes per call
  bool flops;   // work is FLOP (else bytes)
  double target;
};
std::vector<Comparison>& comparisons() {
  static std::vector<Comparison> rows;
  return rows;
}

// Runs `call` kWarmupCalls times, then kIterations x kCallsPerIteration timed calls (the benchmark's fixed
// iteration count), each iteration timed by events on the side's stream (mixtape's or the baseline's); the
// per-call times go to samples()[key] (key = the benchmark's name). `work` (FLOP or bytes per call) sets the
// console's rate counter.
void timed(benchmark::State& state, const std::string& key, const std::function<void()>& call, bool mixtape_side,
           double work, bool flops) {
  Samples& mine = samples()[key];
  try {
    for (int i = 0; i < kWarmupCalls; ++i) call();
    if (mixtape_side) synchronize(kDevice);
    else CUDA_CHECK(cudaStreamSynchronize(baseline().stream));
  } catch (const std::exception& e) {
    mine.error = e.what();
    state.SkipWithError(e.what());
    return;
  }
  DeviceTimer timer(kDevice);
  Baseline& b = baseline();
  for (auto _ : state) {
    double seconds = 0;
    if (mixtape_side) {
      timer.start();
      for (int i = 0; i < kCallsPerIteration; ++i) call();
      timer.stop();
      seconds = timer.seconds();
    } else {
      CUDA_CHECK(cudaEventRecord(b.start, b.stream));
      for (int i = 0; i < kCallsPerIteration; ++i) call();
      CUDA_CHECK(cudaEventRecord(b.stop, b.stream));
      CUDA_CHECK(cudaEventSynchronize(b.stop));
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, b.start, b.stop));
      seconds = ms * 1e-3;
    }
    state.SetIterationTime(seconds);
    mine.seconds.push_back(seconds / kCallsPerIteration);
  }
  state.counters[flops ? "FLOP/s" : "bytes/s"] =
      benchmark::Counter(work * kCallsPerIteration, benchmark::Counter::kIsIterationInvariantRate);
}

// Runs body(state), turning an exception (a missing kernel, a failed CUDA call in setup) into a skipped row.
template <class Body>
void guarded(benchmark::State& state, const std::string& key, Body&& body) {
  try {
    body();
  } catch (const std::exception& e) {
    samples()[key].error = e.what();
    state.SkipWithError(e.what());
  }
}

// A tensor of uniform [0, 1) values made on the CPU and copied to the GPU (so it exists even when mixtape's
// CUDA random kernels do not).
Tensor gpu_rand(const Shape& shape, uint64_t seed, DType dtype) {
  return Tensor::rand(shape, seed, dtype).to(kDevice);
}

// ---- GEMM -------------------------------------------------------------------------------------------------

enum class GemmType { F32, TF32, BF16, F16 };
const char* name(GemmType t) {
  return t == GemmType::F32 ? "f32" : t == GemmType::TF32 ? "tf32" : t == GemmType::BF16 ? "bf16" : "f16";
}
DType storage(GemmType t) { return t == GemmType::BF16 ? DType::BF16 : t == GemmType::F16 ? DType::F16 : DType::F32; }
cudaDataType_t cuda_type(GemmType t) {
  return t == GemmType::BF16 ? CUDA_R_16BF : t == GemmType::F16 ? CUDA_R_16F : CUDA_R_32F;
}

// How out [M,N] is formed from the stored operands.
enum class GemmForm {
  Matmul,      // matmul(a, b): a [M,K], b [K,N]
  Linear,      // linear(x, w) = x w^T: a = x [M,K], b = w [N,K] (a forward layer)
  TransposedA  // matmul(a.mT(), b): a [K,M] seen transposed, b [K,N] (a weight gradient dY^T X)
};
struct GemmShape {
  int64_t M, K, N;
  GemmForm form;
  const char* what;
};
const GemmShape kGemmShapes[] = {
    {4096, 4096, 4096, GemmForm::Matmul, "square"},
    {8192, 768, 2304, GemmForm::Linear, "GPT-2 qkv"},
    {8192, 768, 768, GemmForm::Linear, "GPT-2 attn proj"},
    {8192, 768, 3072, GemmForm::Linear, "GPT-2 mlp up"},
    {8192, 3072, 768, GemmForm::Linear, "GPT-2 mlp down"},
    {8192, 768, 50304, GemmForm::Linear, "GPT-2 vocab head"},
    {8192, 3072, 768, GemmForm::Matmul, "GPT-2 mlp up dgrad"},
    {3072, 8192, 768, GemmForm::TransposedA, "GPT-2 mlp up wgrad"},
    {8192, 50304, 768, GemmForm::Matmul, "GPT-2 vocab head dgrad"},
    {50304, 8192, 768, GemmForm::TransposedA, "GPT-2 vocab head wgrad"},
};

std::string shape_name(const GemmShape& s) {
  return std::to_string(s.M) + "x" + std::to_string(s.K) + "x" + std::to_string(s.N);
}

struct GemmOperands {
  Tensor a, b;  // as stored (see GemmForm)
};
// The operands of a (shape, dtype), made once for both sides of a comparison (the mixtape and cuBLAS rows
// run one after the other): the last pair made is kept, until release_gemm_operands() (main calls it before
// exit: device tensors must go before the CUDA backend's registry is destroyed).
std::string cached_key;
GemmOperands cached;
void release_gemm_operands() {
  cached = {};
  cached_key.clear();
}
GemmOperands gemm_operands(const GemmShape& s, GemmType t) {
  const std::string key = shape_name(s) + "/" + std::to_string(int(s.form)) + "/" + name(t);
  if (key == cached_key) return cached;
  cached = {};  // frees the previous pair first
  cached_key.clear();
  const DType dtype = storage(t);
  // Values in [-0.5, 0.5) scaled by 1/sqrt(K / 1024): sums of K products stay O(10), far from f16's range.
  const double scale = 1.0 / std::sqrt(std::max(1.0, double(s.K) / 1024));
  auto make = [&](const Shape& shape, uint64_t seed) {
    return mul(sub(Tensor::rand(shape, seed, dtype), 0.5), scale).to(kDevice);
  };
  const Shape a_shape = s.form == GemmForm::TransposedA ? Shape{s.K, s.M} : Shape{s.M, s.K};
  const Shape b_shape = s.form == GemmForm::Linear ? Shape{s.N, s.K} : Shape{s.K, s.N};
  cached = {make(a_shape, 1), make(b_shape, 2)};
  cached_key = key;
  return cached;
}

void gemm_mixtape(benchmark::State& state, std::string key, GemmShape s, GemmType t) {
  guarded(state, key, [&] {
    const GemmOperands in = gemm_operands(s, t);
    const AllowTf32Guard tf32(t == GemmType::TF32);
    timed(
        state, key,
        [&] {
          const Tensor out = s.form == GemmForm::Linear        ? linear(in.a, in.b)
                             : s.form == GemmForm::TransposedA ? matmul(in.a.mT(), in.b)
                                                               : matmul(in.a, in.b);
          benchmark::DoNotOptimize(out.data_ptr());
        },
        true, 2.0 * double(s.M) * double(s.K) * double(s.N), true);
  });
}

void gemm_cublas(benchmark::State& state, std::string key, GemmShape s, GemmType t) {
  guarded(state, key, [&] {
    const GemmOperands in = gemm_operands(s, t);
    const Tensor out = Tensor::empty({s.M, s.N}, storage(t), kDevice);
    Baseline& b = baseline();
    const cudaDataType_t type = cuda_type(t);
    const cublasComputeType_t compute = t == GemmType::TF32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    const float alpha = 1, beta = 0;
    const int M = int(s.M), N = int(s.N), K = int(s.K);
    // Row-major C [M,N] is column-major C^T [N,M] (ld N), and C^T = op(b) op(a) in column-major terms (m = N,
    // n = M, k = K), first operand b:
    //   Matmul:      b [K,N] is column-major N x K (ld N): no transpose; a [M,K] is column-major K x M (ld K).
    //   Linear:      w [N,K] is column-major K x N (ld K): transposed; a as Matmul.
    //   TransposedA: b as Matmul; a [K,M] is column-major M x K (ld M): transposed.
    const cublasOperation_t op_b = s.form == GemmForm::Linear ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_a = s.form == GemmForm::TransposedA ? CUBLAS_OP_T : CUBLAS_OP_N;
    const int ld_b = s.form == GemmForm::Linear ? K : N;
    const int ld_a = s.form == GemmForm::TransposedA ? M : K;
    synchronize(kDevice);  // the operands were copied on mixtape's stream
    timed(
        state, key,
        [&] {
          CUBLAS_CHECK(cublasGemmEx(b.handle, op_b, op_a, N, M, K, &alpha, in.b.data_ptr(), type, ld_b,
                                    in.a.data_ptr(), type, ld_a, &beta, out.data_ptr(), type, N, compute,
                                    CUBLAS_GEMM_DEFAULT));
        },
        false, 2.0 * double(s.M) * double(s.K) * double(s.N), true);
  });
}

// ---- memory-bound ops -------------------------------------------------------------------------------------

constexpr int64_t kElements = int64_t{16} << 20;  // 16M
constexpr int64_t kNormRows = 16384, kNormCols = 768;
constexpr int64_t kSoftmaxRows = 16384, kSoftmaxCols = 1024;
constexpr int64_t kCeRows = 8192, kCeVocab = 50304;

// cudaMalloc'd bytes, freed on scope exit (the baselines do not go through mixtape's allocator).
struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) { CUDA_CHECK(cudaMalloc(&ptr, bytes)); }
  ~DeviceBuffer() { (void)cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

// A device-to-device copy of `bytes` bytes on the baseline stream (moves 2 * bytes).
void memcpy_baseline(benchmark::State& state, std::string key, int64_t bytes) {
  guarded(state, key, [&] {
    const DeviceBuffer src{static_cast<size_t>(bytes)}, dst{static_cast<size_t>(bytes)};
    CUDA_CHECK(cudaMemsetAsync(src.ptr, 1, size_t(bytes), baseline().stream));
    timed(
        state, key,
        [&] {
          CUDA_CHECK(
              cudaMemcpyAsync(dst.ptr, src.ptr, size_t(bytes), cudaMemcpyDeviceToDevice, baseline().stream));
        },
        false, 2.0 * double(bytes), false);
  });
}

// The mixtape rows: setup returns the call to time.
using Setup = std::function<std::function<void()>()>;

void mixtape_op(benchmark::State& state, std::string key, Setup setup, double bytes) {
  guarded(state, key, [&] {
    const std::function<void()> call = setup();
    timed(state, key, call, true, bytes, false);
  });
}

struct MemoryRow {
  std::string name, label;
  double bytes;  // moved per call (the baseline copies half of it)
  Setup setup;
};

std::vector<MemoryRow> memory_rows() {
  std::vector<MemoryRow> rows;
  for (DType dtype : {DType::F32, DType::BF16}) {
    const double size = double(dtype_size(dtype));
    const std::string d = dtype_name(dtype);
    rows.push_back({"add_" + d + "/16M", "add " + d + " 16M (3 x n)", 3 * double(kElements) * size, [dtype] {
                      const Tensor a = gpu_rand({kElements}, 3, dtype), b = gpu_rand({kElements}, 4, dtype);
                      return std::function<void()>([a, b] { benchmark::DoNotOptimize(add(a, b).data_ptr()); });
                    }});
    rows.push_back({"gelu_" + d + "/16M", "gelu " + d + " 16M (2 x n)", 2 * double(kElements) * size, [dtype] {
                      const Tensor x = gpu_rand({kElements}, 5, dtype);
                      return std::function<void()>([x] { benchmark::DoNotOptimize(gelu(x).data_ptr()); });
                    }});
    rows.push_back({"layer_norm_" + d + "/16384x768", "layer_norm " + d + " [16384,768] (2 x n)",
                    2 * double(kNormRows * kNormCols) * size, [dtype] {
                      const Tensor x = gpu_rand({kNormRows, kNormCols}, 6, dtype);
                      const Tensor w = gpu_rand({kNormCols}, 7, dtype), b = gpu_rand({kNormCols}, 8, dtype);
                      return std::function<void()>(
                          [x, w, b] { benchmark::DoNotOptimize(layer_norm(x, w, b).out.data_ptr()); });
                    }});
  }
  rows.push_back({"softmax_f32/16384x1024", "softmax f32 [16384,1024] (2 x n)",
                  2 * double(kSoftmaxRows * kSoftmaxCols) * 4, [] {
                    const Tensor x = gpu_rand({kSoftmaxRows, kSoftmaxCols}, 9, DType::F32);
                    return std::function<void()>([x] { benchmark::DoNotOptimize(softmax(x, -1).data_ptr()); });
                  }});
  rows.push_back({"cross_entropy_f32/8192x50304", "cross-entropy fwd f32 [8192,50304] (1 x n)",
                  double(kCeRows * kCeVocab) * 4, [] {
                    const Tensor logits = gpu_rand({kCeRows, kCeVocab}, 10, DType::F32);
                    const Tensor targets = Tensor::randint(0, kCeVocab, {kCeRows}, 11, DType::I64).to(kDevice);
                    return std::function<void()>([logits, targets] {
                      benchmark::DoNotOptimize(softmax_cross_entropy(logits, targets).data_ptr());
                    });
                  }});
  // GPT-2 small's parameters (nanoGPT's shapes, tied head), f32.
  std::vector<Shape> shapes = {{50304, 768}, {1024, 768}};
  for (int layer = 0; layer < 12; ++layer) {
    for (const Shape& s : std::vector<Shape>{{768}, {768}, {2304, 768}, {2304}, {768, 768}, {768}, {768}, {768},
                                             {3072, 768}, {3072}, {768, 3072}, {768}})
      shapes.push_back(s);
  }
  shapes.push_back({768});
  shapes.push_back({768});
  double params = 0;
  for (const Shape& s : shapes) params += double(shape_numel(s));
  rows.push_back({"adam_step_f32/gpt2_124M", "AdamW step f32 GPT-2 124M (28 B/param)", 28 * params, [shapes] {
                    std::vector<Tensor> ps;
                    uint64_t seed = 100;
                    for (const Shape& s : shapes) {
                      Tensor p = gpu_rand(s, seed++, DType::F32);
                      p.requires_grad_();
                      p.set_grad(gpu_rand(s, seed++, DType::F32));
                      ps.push_back(p);
                    }
                    auto optimizer = std::make_shared<AdamW>(ps, 1e-4, 0.1);
                    return std::function<void()>([optimizer] { optimizer->step(); });
                  }});
  rows.push_back({"cast_f32_bf16/16M", "cast f32->bf16 16M (4 + 2 B/elem)", 6 * double(kElements), [] {
                    const Tensor x = gpu_rand({kElements}, 12, DType::F32);
                    return std::function<void()>([x] { benchmark::DoNotOptimize(x.to(DType::BF16).data_ptr()); });
                  }});
  return rows;
}

// ---- registration -----------------------------------------------------------------------------------------

void configure(benchmark::internal::Benchmark* b) {
  b->UseManualTime()->Iterations(kIterations)->Unit(benchmark::kMicrosecond);
}

void register_benchmarks() {
  for (GemmType t : {GemmType::F32, GemmType::TF32, GemmType::BF16, GemmType::F16}) {
    for (const GemmShape& s : kGemmShapes) {
      const std::string base = std::string("gemm_") + name(t) + "/" + shape_name(s);
      configure(benchmark::RegisterBenchmark((base + "/mixtape").c_str(), gemm_mixtape, base + "/mixtape", s, t));
      configure(benchmark::RegisterBenchmark((base + "/cublas").c_str(), gemm_cublas, base + "/cublas", s, t));
      comparisons().push_back({std::string("gemm ") + name(t) + " " + shape_name(s) + " (" + s.what + ")",
                               base + "/mixtape", base + "/cublas", 2.0 * double(s.M) * double(s.K) * double(s.N),
                               true, kGemmTarget});
    }
  }
  for (const MemoryRow& row : memory_rows()) {
    configure(benchmark::RegisterBenchmark((row.name + "/mixtape").c_str(), mixtape_op, row.name + "/mixtape",
                                           row.setup, row.bytes));
    configure(benchmark::RegisterBenchmark((row.name + "/memcpy").c_str(), memcpy_baseline, row.name + "/memcpy",
                                           int64_t(row.bytes / 2)));
    comparisons().push_back(
        {row.label, row.name + "/mixtape", row.name + "/memcpy", row.bytes, false, kBandwidthTarget});
  }
}

// ---- summary ----------------------------------------------------------------------------------------------

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

void print_summary() {
  std::printf("\n%-52s %10s %10s %10s %10s %8s %7s  %s\n", "comparison (median call)", "mixtape", "baseline",
              "mixtape", "baseline", "ratio", "target", "result");
  std::printf("%-52s %10s %10s %10s %10s\n", "", "us/call", "us/call", "rate", "rate");
  std::printf("%s\n", std::string(124, '-').c_str());
  int pass = 0, fail = 0, skip = 0;
  for (const Comparison& row : comparisons()) {
    auto it_mine = samples().find(row.mixtape), it_base = samples().find(row.baseline);
    if (it_mine == samples().end() || it_base == samples().end()) continue;  // filtered out
    const Samples &mine = it_mine->second, &base = it_base->second;
    if (!mine.error.empty() || !base.error.empty() || mine.seconds.empty() || base.seconds.empty()) {
      const std::string error = !mine.error.empty() ? "mixtape: " + mine.error
                                : !base.error.empty() ? "baseline: " + base.error
                                                      : std::string("no samples");
      std::printf("%-52s %10s %10s %10s %10s %8s %6.2fx  SKIP (%s)\n", row.label.c_str(), "-", "-", "-", "-", "-",
                  row.target, error.substr(0, 80).c_str());
      ++skip;
      continue;
    }
    const double t_mine = median(mine.seconds), t_base = median(base.seconds);
    const double ratio = t_base / t_mine;  // = mixtape rate / baseline rate (same work per call)
    const bool ok = ratio >= row.target;
    (ok ? pass : fail)++;
    const double scale = row.flops ? 1e12 : 1e9;
    const char* unit = row.flops ? "TFLOP/s" : "GB/s";
    char rate_mine[32], rate_base[32];
    std::snprintf(rate_mine, sizeof(rate_mine), "%.1f", row.work / t_mine / scale);
    std::snprintf(rate_base, sizeof(rate_base), "%.1f", row.work / t_base / scale);
    std::printf("%-52s %10.1f %10.1f %10s %10s %7.3fx %6.2fx  %s (%s)\n", row.label.c_str(), t_mine * 1e6,
                t_base * 1e6, rate_mine, rate_base, ratio, row.target, ok ? "PASS" : "FAIL", unit);
  }
  std::printf("(ratio = baseline time / mixtape time = mixtape rate / baseline rate; GEMM rates in TFLOP/s of "
              "2*M*N*K, memory rates in GB/s of the bytes defined in bench_cuda_ops.cpp; baselines: cuBLAS "
              "cublasGemmEx, cudaMemcpyAsync device-to-device)\n");
  std::printf("%d pass, %d fail, %d skipped\n", pass, fail, skip);
}

}  // namespace

int main(int argc, char** argv) {
  if (cuda_device_count() == 0) {
    std::printf("bench_cuda_ops: SKIPPED: no CUDA device (bench_ops is the CPU benchmark)\n");
    return 77;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  try {
    std::printf("bench_cuda_ops on %s\n", cuda_device_name(kDevice.index).c_str());
    register_benchmarks();
    benchmark::RunSpecifiedBenchmarks();
    release_gemm_operands();
    print_summary();
  } catch (const std::exception& e) {
    release_gemm_operands();
    std::fprintf(stderr, "bench_cuda_ops: %s\n", e.what());
    return 1;
  }
  benchmark::Shutdown();
  return 0;
}
