// fp8 and block-scaled GEMMs on CUDA: quantize_for_gemm's two passes over the data and scaled_matmul
// (tensor/quantize.h, the contract in tensor/backend.h).
//
// Quantization: one warp per run of a row along a block column finds its max |x| (NaN-aware; max is exact in
// any order, so the CPU's and the GPU's agree bit for bit); the host combines the runs into block and tensor
// amaxes and picks every scale by tensor/scale_rules.h, exactly as for a CPU tensor; the encode kernel then
// applies the same per-value rule (encode_nearest / encode_stochastic, the same Philox draws) and writes bf16,
// f32, or, for a tensorwise operand, the fp8 codes themselves.
//
// GEMM (out = a [M, K] @ b [N, K]^T in f32, both operands K-contiguous: cuBLASLt's "TN"):
//   - fp8 codes on both sides (tensorwise fp8 / fp8_delayed), sm_89 or newer, not E5M2 x E5M2, M, N and K
//     multiples of 16: cuBLASLt's fp8 matmul on the tensor cores, the decode scales as its A / B scale
//     pointers, f32 out. The fp8 MMA accumulates in its own precision and cuBLASLt promotes the partial sums
//     to fp32 (CUBLASLT_MATMUL_DESC_FAST_ACCUM left off), so results differ from the CPU's fp32 sums by
//     summation error only;
//   - everything else is exact emulation: codes widened to bf16 code values (exact), bf16 x bf16 -> f32 or
//     f32 x f32 -> f32 with CUBLAS_COMPUTE_32F (never TF32), then the row / column / tensor scales, or the
//     fp8_block K blocks scaled and summed in fp32, in the CPU's order (tensor/quantize.cpp).
#include <cuda_runtime.h>

#include <atomic>
#include <cfloat>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "tensor/cuda/common.cuh"
#include "tensor/cuda/cuda_backend.h"
#include "tensor/minifloat.h"
#include "tensor/random.h"
#include "tensor/scale_rules.h"

namespace mixtape::cuda {

namespace {

bool is_fp8(DType dtype) { return dtype == DType::F8E4M3 || dtype == DType::F8E5M2; }

// A host vector on the device (the scales a kernel reads).
Tensor to_device(const std::vector<float>& values, Device device) {
  return Tensor::from_vector(values, {static_cast<int64_t>(values.size())}).to(device);
}

// ---- quantization ------------------------------------------------------------------------------------------

// out[s] = max |x| over run s = (r, j): x[r, j * bc .. min((j + 1) * bc, C)), NaN when the run holds Inf or NaN.
// One warp per run, lanes striding along the row (coalesced).
__global__ void row_amax_kernel(const float* __restrict__ x, int64_t R, int64_t C, int64_t bc, int64_t grid_cols,
                                float* __restrict__ out) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  for (int64_t s = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; s < R * grid_cols;
       s += warps) {
    const int64_t r = s / grid_cols, j = s % grid_cols;
    const float* p = x + r * C + j * bc;
    const int64_t n = C - j * bc < bc ? C - j * bc : bc;
    float m = 0;
    unsigned not_finite = 0;
    for (int64_t i = lane; i < n; i += 32) {
      const float a = fabsf(p[i]);
      not_finite |= !(a <= FLT_MAX);
      m = fmaxf(m, a);
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      not_finite |= __shfl_xor_sync(0xffffffffu, not_finite, o);
    }
    if (lane == 0) out[s] = not_finite ? quiet_nan() : m;
  }
}

enum class ValuesForm : int { Bf16, F32, Codes };

struct EncodeArgs {
  const float* x;
  int64_t R, C, br, bc, grid_cols, blocks;
  // encode[blocks], multiplier[blocks], decode[blocks] on the device; null for one block (a tensorwise
  // operand), whose three scales travel in `single` with the launch instead of a copy the host waits for.
  const float* scales;
  float single[3];
  MinifloatFormat format;
  float fmax;
  bool stochastic;
  uint64_t seed, offset, stream;
  void* values;
  unsigned long long* counts;  // saturated, flushed
};

// Element i of x encoded by its block's scales (tensor/scale_rules.h), stored as kForm; the counts of its
// block's kind (saturated where the block has a scale, flushed where it is not NaN) summed per warp.
template <ValuesForm kForm>
__global__ void encode_kernel(EncodeArgs args) {
  const FormatRounding round(args.format);
  const bool one_block = args.scales == nullptr;
  const float* encode = one_block ? args.single : args.scales;
  const float* multiplier = one_block ? args.single + 1 : args.scales + args.blocks;
  const float* decode = one_block ? args.single + 2 : args.scales + 2 * args.blocks;
  unsigned long long saturated = 0, flushed = 0;
  const int64_t total = args.R * args.C;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t r = i / args.C, c = i - r * args.C;
    const int64_t b = one_block ? 0 : r / args.br * args.grid_cols + c / args.bc;
    const float e = encode[b], mult = multiplier[b];
    const EncodedValue v =
        args.stochastic
            ? encode_stochastic(args.x[i], e, args.format, round, args.fmax,
                                philox4x32(args.offset + static_cast<uint64_t>(i), args.stream, args.seed)[0])
            : encode_nearest(args.x[i], e, round, args.fmax);
    saturated += e != 0 && v.saturated;
    flushed += !isnan(decode[b]) && v.flushed;
    const float stored = __fmul_rn(v.value, mult);
    if constexpr (kForm == ValuesForm::Bf16) {
      static_cast<uint16_t*>(args.values)[i] = static_cast<uint16_t>(__float_as_uint(stored) >> 16);  // exact
    } else if constexpr (kForm == ValuesForm::F32) {
      static_cast<float*>(args.values)[i] = stored;
    } else {  // the code of the (on-grid) value; a NaN block's codes are NaN, so its products are too
      const uint32_t code = isnan(mult) ? args.format.nan_code()
                                        : float_to_minifloat(v.value, args.format, FormatOverflow::Saturate);
      static_cast<uint8_t*>(args.values)[i] = static_cast<uint8_t>(code);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    saturated += __shfl_down_sync(0xffffffffu, saturated, o);
    flushed += __shfl_down_sync(0xffffffffu, flushed, o);
  }
  if (threadIdx.x % 32 == 0 && (saturated | flushed) != 0) {
    atomicAdd(args.counts, saturated);
    atomicAdd(args.counts + 1, flushed);
  }
}

// out (bf16 bits) [i] = the value of fp8 code [i]: exact (at most 4 significant bits, exponents within bf16's).
__global__ void decode_codes_kernel(const uint8_t* __restrict__ codes, int64_t n, MinifloatFormat format,
                                    uint16_t* __restrict__ out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)
    out[i] = static_cast<uint16_t>(__float_as_uint(minifloat_to_float(codes[i], format)) >> 16);
}

// ---- GEMM epilogues, in the CPU's order of roundings -------------------------------------------------------

// out[m, n] *= row[m] * col[n] * tensor (a null row / col reads 1).
__global__ void scale_rows_cols_kernel(float* __restrict__ out, int64_t M, int64_t N, const float* __restrict__ row,
                                       const float* __restrict__ col, float tensor) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < M * N;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t m = i / N, n = i - m * N;
    const float scale = __fmul_rn(__fmul_rn(row ? row[m] : 1.0f, col ? col[n] : 1.0f), tensor);
    out[i] = __fmul_rn(out[i], scale);
  }
}

// out[m, n] (= or +=) partial[m, n] * (ka[m, j] * kb[n, j]): K block j of an fp8_block product.
__global__ void add_scaled_block_kernel(float* __restrict__ out, const float* __restrict__ partial, int64_t M,
                                        int64_t N, const float* __restrict__ ka, const float* __restrict__ kb,
                                        int64_t blocks, int64_t j) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < M * N;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t m = i / N, n = i - m * N;
    const float scaled = __fmul_rn(partial[i], __fmul_rn(ka[m * blocks + j], kb[n * blocks + j]));
    out[i] = j == 0 ? scaled : __fadd_rn(out[i], scaled);
  }
}

// out[0] = a, out[1] = b: the fp8 GEMM's scales written by a launch (its arguments travel with it), not copied
// from the host (which would wait for the stream).
__global__ void set_two_kernel(float* out, float a, float b) {
  out[0] = a;
  out[1] = b;
}

// How many products ran on the fp8 tensor cores (fp8_tensor_core_gemms()).
std::atomic<int64_t> fp8_gemms{0};

// ---- cuBLASLt: out [M, N] (f32, row-major) = a [M, K] @ b [N, K]^T, rows of a and b K-contiguous ------------
// In cuBLASLt's column-major terms out^T [N, M] = b [N, K] * a^T: its A is our b (stored K x N, ld ldb, read
// transposed), its B our a (stored K x M, ld lda), D out^T with ld N: the "TN" layout fp8 requires.

struct GemmKey {
  cudaDataType_t a_type = CUDA_R_32F, b_type = CUDA_R_32F;
  int64_t M = 0, N = 0, K = 0, lda = 0, ldb = 0;
  uint32_t a_align = 0, b_align = 0, d_align = 0;
  int device = 0;
  std::vector<int64_t> words() const {
    return {a_type, b_type, M, N, K, lda, ldb, a_align, b_align, d_align, device};
  }
};


struct GemmPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool found = false;  // false: cuBLASLt has no algorithm for this key (the caller emulates or fails)
  // Guards found, and the scale pointers in desc between setting them and the call that reads them.
  std::mutex mutex;
  GemmPlan() = default;
  GemmPlan(const GemmPlan&) = delete;
  GemmPlan& operator=(const GemmPlan&) = delete;
  ~GemmPlan() {  // host-side frees only
    if (desc) (void)cublasLtMatmulDescDestroy(desc);
    if (a) (void)cublasLtMatrixLayoutDestroy(a);
    if (b) (void)cublasLtMatrixLayoutDestroy(b);
    if (d) (void)cublasLtMatrixLayoutDestroy(d);
  }
};

uint32_t alignment_of(const void* ptr) {
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  uint32_t alignment = 1;
  while (alignment < 256 && address % (alignment * 2) == 0) alignment *= 2;
  return alignment;
}

std::unique_ptr<GemmPlan> make_gemm_plan(cublasLtHandle_t handle, const GemmKey& key) {
  auto plan = std::make_unique<GemmPlan>();
  const bool fp8 = key.a_type == CUDA_R_8F_E4M3 || key.a_type == CUDA_R_8F_E5M2;
  MIXTAPE_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));  // never TF32
  const int32_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  MIXTAPE_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
  MIXTAPE_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
  if (fp8) {  // partial sums promoted to fp32 (the accurate mode; 1 would keep them in the MMA's accumulator)
    const int8_t fast_accum = 0;
    MIXTAPE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_accum,
                                                        sizeof(fast_accum)));
  }
  // cuBLASLt's A: our b, K x N; its B: our a, K x M; D: N x M.
  MIXTAPE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->a, key.b_type, static_cast<uint64_t>(key.K),
                                                  static_cast<uint64_t>(key.N), key.ldb));
  MIXTAPE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->b, key.a_type, static_cast<uint64_t>(key.K),
                                                  static_cast<uint64_t>(key.M), key.lda));
  MIXTAPE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->d, CUDA_R_32F, static_cast<uint64_t>(key.N),
                                                  static_cast<uint64_t>(key.M), key.N));

  // cuBLASLt's A is our b and its B our a; split-K keeps its partial sums in fp32.
  cublasLtMatmulHeuristicResult_t result{};
  int count = 0;
  const cublasStatus_t status = lt_heuristic(handle, plan->desc, plan->a, plan->b, plan->d, key.b_align, key.a_align,
                                             key.d_align, CudaBackend::kWorkspaceBytes, &result, &count);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED || (fp8 && status == CUBLAS_STATUS_INVALID_VALUE)) return plan;
  check_cublas(status, "cublasLtMatmulAlgoGetHeuristic(...)", __FILE__, __LINE__);
  if (count >= 1 && result.state == CUBLAS_STATUS_SUCCESS) {
    plan->algo = result.algo;
    plan->found = true;
  }
  return plan;
}

std::shared_ptr<GemmPlan> gemm_plan_for(cublasLtHandle_t handle, const GemmKey& key) {
  return cached_plan<GemmPlan>(key.words(), [&] { return make_gemm_plan(handle, key); });
}

cudaDataType_t lt_type_of(DType dtype) {
  switch (dtype) {
    case DType::F32: return CUDA_R_32F;
    case DType::BF16: return CUDA_R_16BF;
    case DType::F8E4M3: return CUDA_R_8F_E4M3;
    case DType::F8E5M2: return CUDA_R_8F_E5M2;
    default: fail("scaled_matmul: operand dtype ", dtype_name(dtype), " on CUDA (expected bf16, f32 or fp8 codes)");
  }
}

// out = a[:, k0 : k0 + n_k] @ b[:, k0 : k0 + n_k]^T (a, b contiguous [*, K] of one dtype); fp8 operands with their
// decode scales on the device (a_scale, b_scale). Returns false where cuBLASLt has no algorithm (fp8 only:
// other types always have one, and its absence is an Error).
bool lt_gemm(CudaBackend& backend, const Tensor& a, const Tensor& b, int64_t k0, int64_t n_k, const Tensor& out,
             const float* a_scale = nullptr, const float* b_scale = nullptr) {
  const int64_t M = a.size(0), N = b.size(0), K = a.size(1);
  const size_t element = dtype_size(a.dtype());
  const void* a_ptr = static_cast<const char*>(a.data_ptr()) + k0 * static_cast<int64_t>(element);
  const void* b_ptr = static_cast<const char*>(b.data_ptr()) + k0 * static_cast<int64_t>(element);
  GemmKey key;
  key.a_type = lt_type_of(a.dtype());
  key.b_type = lt_type_of(b.dtype());
  key.M = M;
  key.N = N;
  key.K = n_k;
  key.lda = K;
  key.ldb = K;
  key.a_align = alignment_of(a_ptr);
  key.b_align = alignment_of(b_ptr);
  key.d_align = alignment_of(out.data_ptr());
  key.device = backend.device();
  check(std::max({M, N, K}) <= INT32_MAX, "scaled_matmul: ", a.described(), " @ ", b.described(),
        "^T exceeds cuBLASLt's 32-bit dims");
  const auto handle = static_cast<cublasLtHandle_t>(backend.cublaslt_handle());
  const std::shared_ptr<GemmPlan> plan = gemm_plan_for(handle, key);
  const bool fp8 = a_scale != nullptr;
  std::lock_guard lock(plan->mutex);
  if (!plan->found) {
    if (fp8) return false;
    fail("scaled_matmul: cuBLASLt has no algorithm for ", a.described(), " @ ", b.described(), "^T (K ", k0, "..",
         k0 + n_k, ")");
  }
  const float alpha = 1, beta = 0;
  if (fp8) {  // cuBLASLt's A is our b
    MIXTAPE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &b_scale,
                                                        sizeof(b_scale)));
    MIXTAPE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &a_scale,
                                                        sizeof(a_scale)));
  }
  const cublasStatus_t status =
      cublasLtMatmul(handle, plan->desc, &alpha, b_ptr, plan->a, a_ptr, plan->b, &beta, out.data_ptr(), plan->d,
                     out.data_ptr(), plan->d, &plan->algo, backend.workspace(), CudaBackend::kWorkspaceBytes,
                     backend.stream());
  // An fp8 product cuBLASLt refuses at launch (a type or layout rule its heuristic let through) is emulated
  // instead, from then on for this shape; any other failure is an Error.
  if (fp8 && status != CUBLAS_STATUS_SUCCESS) {
    plan->found = false;
    return false;
  }
  check_cublas(status, "cublasLtMatmul(...)", __FILE__, __LINE__);
  if (fp8) fp8_gemms.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// Whether this device's fp8 tensor cores can take the product: sm_89 or newer, not E5M2 x E5M2 (cuBLASLt has
// no such kernel), dims multiples of 16 and 16-byte aligned operands (cuBLASLt's fp8 requirements).
bool fp8_gemm_possible(int device, const Tensor& a, const Tensor& b) {
  if (compute_capability(device) < 89) return false;
  if (a.dtype() == DType::F8E5M2 && b.dtype() == DType::F8E5M2) return false;
  const int64_t M = a.size(0), N = b.size(0), K = a.size(1);
  return M % 16 == 0 && N % 16 == 0 && K % 16 == 0 && alignment_of(a.data_ptr()) >= 16 &&
         alignment_of(b.data_ptr()) >= 16;
}

// fp8 codes as bf16 code values (exact), for the emulated product.
Tensor decode_codes(CudaBackend& backend, const Tensor& codes) {
  Tensor out = Tensor::empty(codes.shape(), DType::BF16, codes.device());
  const int64_t n = codes.numel();
  if (n == 0) return out;
  decode_codes_kernel<<<blocks_for(n), kThreads, 0, backend.stream()>>>(
      static_cast<const uint8_t*>(codes.data_ptr()), n, element_format(codes.dtype()),
      static_cast<uint16_t*>(out.data_ptr()));
  MIXTAPE_KERNEL_CHECK();
  return out;
}

}  // namespace

int compute_capability(int device) {
  int major = 0, minor = 0;
  MIXTAPE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  MIXTAPE_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return major * 10 + minor;
}

int64_t fp8_tensor_core_gemms() { return fp8_gemms.load(std::memory_order_relaxed); }

std::vector<float> CudaBackend::quantize_row_amax_kernel(const Tensor& x, int64_t block_cols) {
  const int64_t R = x.size(0), C = x.size(1), grid_cols = (C + block_cols - 1) / block_cols;
  const int64_t runs = R * grid_cols;
  if (runs == 0) return {};
  Tensor out = Tensor::empty({runs}, DType::F32, x.device());
  row_amax_kernel<<<blocks_for(runs * 32), kThreads, 0, stream()>>>(static_cast<const float*>(x.data_ptr()), R, C,
                                                                    block_cols, grid_cols,
                                                                    static_cast<float*>(out.data_ptr()));
  MIXTAPE_KERNEL_CHECK();
  return out.to(Device::cpu()).to_vector<float>();
}

EncodeCounts CudaBackend::quantize_encode_kernel(const Tensor& x, const BlockEncodePlan& plan, const Tensor& values) {
  const DType form_dtype = values.dtype();
  check(form_dtype == DType::BF16 || form_dtype == DType::F32 || (is_fp8(form_dtype) && form_dtype == plan.format),
        "quantize_for_gemm: values ", values.described(), " on CUDA: expected bf16, f32 or the codes of ",
        dtype_name(plan.format));
  const int64_t total = x.numel();
  if (total == 0) return {};
  const bool one_block = plan.encode.size() == 1;
  Tensor device_scales;
  if (!one_block) {
    std::vector<float> scales = plan.encode;
    scales.insert(scales.end(), plan.multiplier.begin(), plan.multiplier.end());
    scales.insert(scales.end(), plan.decode.begin(), plan.decode.end());
    device_scales = to_device(scales, x.device());
  }
  Tensor counts = Tensor::empty({2}, DType::I64, x.device());
  MIXTAPE_CUDA_CHECK(cudaMemsetAsync(counts.data_ptr(), 0, 2 * sizeof(int64_t), stream()));

  EncodeArgs args{};
  args.x = static_cast<const float*>(x.data_ptr());
  args.R = x.size(0);
  args.C = x.size(1);
  args.br = plan.block_rows;
  args.bc = plan.block_cols;
  args.grid_cols = plan.grid_cols;
  args.blocks = static_cast<int64_t>(plan.encode.size());
  args.scales = one_block ? nullptr : static_cast<const float*>(device_scales.data_ptr());
  if (one_block) {
    args.single[0] = plan.encode[0];
    args.single[1] = plan.multiplier[0];
    args.single[2] = plan.decode[0];
  }
  args.format = element_format(plan.format);
  args.fmax = plan.format == DType::F8E4M3 ? kE4M3Max : plan.format == DType::F8E5M2 ? kE5M2Max : kE2M1Max;
  args.stochastic = plan.stochastic_seed.has_value();
  args.seed = plan.stochastic_seed.value_or(0);
  args.offset = plan.stochastic_offset;
  args.stream = plan.stochastic_stream;
  args.values = values.data_ptr();
  args.counts = static_cast<unsigned long long*>(counts.data_ptr());
  const unsigned grid = blocks_for(total);
  if (form_dtype == DType::BF16) encode_kernel<ValuesForm::Bf16><<<grid, kThreads, 0, stream()>>>(args);
  else if (form_dtype == DType::F32) encode_kernel<ValuesForm::F32><<<grid, kThreads, 0, stream()>>>(args);
  else encode_kernel<ValuesForm::Codes><<<grid, kThreads, 0, stream()>>>(args);
  MIXTAPE_KERNEL_CHECK();
  const std::vector<int64_t> host = counts.to(Device::cpu()).to_vector<int64_t>();
  return {host[0], host[1]};
}

void CudaBackend::scaled_gemm_kernel(const GemmOperand& a, const GemmOperand& b, int accumulator_bits,
                                     const Tensor& out) {
  check(accumulator_bits == 0, "scaled_matmul: not supported: accumulator_bits ", accumulator_bits,
        " on CUDA (the tensor cores accumulate as they do; the narrow-accumulator model runs on the CPU)");
  const int64_t M = out.size(0), N = out.size(1), K = a.values.size(1);
  const Device device = out.device();
  if (K == 0) MIXTAPE_CUDA_CHECK(cudaMemsetAsync(out.data_ptr(), 0, static_cast<size_t>(M * N) * sizeof(float), stream()));

  // Tensorwise fp8 on the fp8 tensor cores: D = scale_a * scale_b * (A @ B), the decode scales as pointers.
  const bool codes_a = is_fp8(a.values.dtype()), codes_b = is_fp8(b.values.dtype());
  if (K > 0 && codes_a && codes_b && fp8_gemm_possible(device_, a.values, b.values)) {
    const Tensor decode_scales = Tensor::empty({2}, DType::F32, device);
    float* scale_ptr = static_cast<float*>(decode_scales.data_ptr());
    set_two_kernel<<<1, 1, 0, stream()>>>(scale_ptr, a.row_scale.front() * a.tensor_scale,
                                          b.row_scale.front() * b.tensor_scale);
    MIXTAPE_KERNEL_CHECK();
    if (lt_gemm(*this, a.values, b.values, 0, K, out, scale_ptr, scale_ptr + 1)) return;
  }

  // Exact emulation: code values (or dequantized values) in, fp32 sums, the scales after in the CPU's order.
  Tensor va = codes_a ? decode_codes(*this, a.values) : a.values;
  Tensor vb = codes_b ? decode_codes(*this, b.values) : b.values;
  const unsigned grid = blocks_for(M * N);
  if (a.k_block > 0) {
    const int64_t kb = a.k_block, blocks = (K + kb - 1) / kb;
    const Tensor partial = Tensor::empty({M, N}, DType::F32, device);
    const Tensor ka = to_device(a.k_scales, device), kbs = to_device(b.k_scales, device);
    for (int64_t j = 0; j < blocks; ++j) {
      const int64_t k0 = j * kb, n_k = std::min(kb, K - k0);
      lt_gemm(*this, va, vb, k0, n_k, partial);
      add_scaled_block_kernel<<<grid, kThreads, 0, stream()>>>(
          static_cast<float*>(out.data_ptr()), static_cast<const float*>(partial.data_ptr()), M, N,
          static_cast<const float*>(ka.data_ptr()), static_cast<const float*>(kbs.data_ptr()), blocks, j);
      MIXTAPE_KERNEL_CHECK();
    }
    return;
  }
  if (va.dtype() != vb.dtype()) {  // one operand f32: the other's exact bf16 values widen exactly
    va = va.to(DType::F32).contiguous();
    vb = vb.to(DType::F32).contiguous();
  }
  if (K > 0) lt_gemm(*this, va, vb, 0, K, out);
  const float tensor = a.tensor_scale * b.tensor_scale;
  if (a.row_scale.empty() && b.row_scale.empty() && tensor == 1) return;
  const Tensor rows = a.row_scale.empty() ? Tensor() : to_device(a.row_scale, device);
  const Tensor cols = b.row_scale.empty() ? Tensor() : to_device(b.row_scale, device);
  scale_rows_cols_kernel<<<grid, kThreads, 0, stream()>>>(
      static_cast<float*>(out.data_ptr()), M, N, rows.defined() ? static_cast<const float*>(rows.data_ptr()) : nullptr,
      cols.defined() ? static_cast<const float*>(cols.data_ptr()) : nullptr, tensor);
  MIXTAPE_KERNEL_CHECK();
}

}  // namespace mixtape::cuda
