// CUDA matmul through cuBLASLt: out[..., M, N] = a[..., M, K] @ b[..., K, N] (+ bias[N]).
//
// Numerics (the CPU's contract, tensor/cpu/matmul.cpp):
//   f32       CUBLAS_COMPUTE_32F, or CUBLAS_COMPUTE_32F_FAST_TF32 while allow_tf32() is on (tensor/precision.h,
//             the same switch the CPU reads): tensor cores take tf32 inputs and accumulate in f32;
//   f16/bf16  CUBLAS_COMPUTE_32F with float scale: products accumulate in f32 and are rounded once into out;
//   f64       CUBLAS_COMPUTE_64F.
// Split-K algorithms are restricted to CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE (partial sums kept in the compute
// type, reduced in a separate step): the "in place" and "output type" schemes would round f16/bf16 partial sums
// into the output type, i.e. more than one rounding.
// The bias joins the accumulator through CUBLASLT_EPILOGUE_BIAS, before the one rounding into out. cuBLASLt reads
// the bias in the output type (CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE's default for non-fp8/non-int8 products),
// which is a's dtype here, so it is passed as is. Where no algorithm offers the epilogue (possibly f64), out is
// first filled with the bias rows and the product runs with C = out and beta = 1: D = acc + 1 * bias, the same
// value before the same one rounding.
//
// Layouts (cuBLASLt is column-major): a row-major out [M, N] is a column-major [N, M], so the product is issued
// as out^T = b^T a^T: cuBLASLt's A is our b, its B is our a, its D is out with ld = N; the bias then runs along
// D's rows (length N), as the epilogue requires. An operand whose columns are unit-stride (row-major) is a
// column-major matrix of its transpose and goes in with CUBLAS_OP_N; one whose rows are unit-stride (a
// transposed view, e.g. a linear layer's W^T) goes in with CUBLAS_OP_T. Both cost no copy. Batch dims are
// simplified as on the CPU, by the same simplify_matmul (tensor/kernel_geometry.h: size-1 dims dropped, dims
// every operand steps through as one merged, and a batch over a shared b folded into M: x [B, T, C] @ W [C, N]
// is one [B*T, C] GEMM); one remaining batch dim becomes cuBLASLt's strided batch, with batch stride 0 for a
// broadcast operand. Only what cuBLASLt cannot express is copied to a contiguous buffer first: more than one
// unmergeable batch dim (both operands are then materialised over the full batch), or a matrix with neither
// dim unit-stride (or overlapping rows/columns).
//
// Plans (descriptors plus the algorithm from one cublasLtMatmulAlgoGetHeuristic call) are cached per geometry,
// dtype, epilogue, tf32 mode, pointer alignment and device, so a training loop asks the heuristic once per shape.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "tensor/cuda/common.cuh"
#include "tensor/cuda/cuda_backend.h"
#include "tensor/kernel_contract.h"
#include "tensor/kernel_geometry.h"
#include "tensor/precision.h"

namespace mixtape::cuda {

namespace {

// ---- cuBLASLt operands ------------------------------------------------------------------------------------

// A matrix as cuBLASLt sees it: the stored column-major matrix (rows x cols, leading dimension ld) and whether
// the product reads it transposed.
struct LtMatrix {
  bool transpose = false;
  int64_t rows = 0, cols = 0, ld = 0;
  bool ok = false;  // false: cuBLASLt cannot read this layout (the operand is copied first)
};

// The matrix X (R x C in the column-major product) whose element (r, c) lies at r * r_stride + c * c_stride.
// Unit-stride rows of X: a column-major R x C matrix with ld = c_stride. Unit-stride columns: the transpose of
// a column-major C x R matrix with ld = r_stride. The leading dimension must keep rows (columns) apart.
LtMatrix lt_matrix(int64_t R, int64_t C, int64_t r_stride, int64_t c_stride) {
  LtMatrix m;
  if (r_stride == 1 && c_stride >= std::max<int64_t>(R, 1)) {
    m.transpose = false;
    m.rows = R;
    m.cols = C;
    m.ld = c_stride;
    m.ok = true;
  } else if (c_stride == 1 && r_stride >= std::max<int64_t>(C, 1)) {
    m.transpose = true;
    m.rows = C;
    m.cols = R;
    m.ld = r_stride;
    m.ok = true;
  }
  return m;
}

// out^T [N, M] = b^T [N, K] * a^T [K, M] in column-major terms. b^T's element (n, k) is b[k, n]; a^T's element
// (k, m) is a[m, k]; out^T's element (n, m) is out[m, n].
LtMatrix lt_of_b(const MatmulGeometry& g) { return lt_matrix(g.N, g.K, g.b.col_stride, g.b.row_stride); }
LtMatrix lt_of_a(const MatmulGeometry& g) { return lt_matrix(g.K, g.M, g.a.col_stride, g.a.row_stride); }
LtMatrix lt_of_out(const MatmulGeometry& g) {
  return lt_matrix(g.N, g.M, g.out.col_stride, g.out.row_stride);
}

// A contiguous copy of operand t ([..., rows, cols] under out's batch dims) with every batch dim at out's size:
// broadcast (stride-0 or size-1) dims are repeated, so the copy has ordinary strides everywhere.
Tensor materialize(Backend& backend, const Tensor& t, const Tensor& out) {
  Shape shape = out.shape();
  shape[shape.size() - 2] = t.size(-2);
  shape[shape.size() - 1] = t.size(-1);
  Strides strides = t.strides();
  for (size_t d = 0; d + 2 < shape.size(); ++d)
    if (t.shape()[d] != shape[d]) strides[d] = 0;
  const Tensor view = make_view(t, shape, strides, t.offset());
  Tensor packed = Tensor::empty(shape, t.dtype(), t.device());
  backend.copy(view, packed);
  return packed;
}

// ---- epilogues and types ----------------------------------------------------------------------------------

enum class Epilogue : uint8_t { None, Bias, Gelu, GeluBias };

cublasLtEpilogue_t lt_epilogue(Epilogue e) {
  switch (e) {
    case Epilogue::Bias: return CUBLASLT_EPILOGUE_BIAS;
    case Epilogue::Gelu: return CUBLASLT_EPILOGUE_GELU;
    case Epilogue::GeluBias: return CUBLASLT_EPILOGUE_GELU_BIAS;
    default: return CUBLASLT_EPILOGUE_DEFAULT;
  }
}

const char* epilogue_name(Epilogue e) {
  switch (e) {
    case Epilogue::Bias: return "bias";
    case Epilogue::Gelu: return "gelu";
    case Epilogue::GeluBias: return "bias+gelu";
    default: return "none";
  }
}

cudaDataType_t lt_type(DType dtype) {
  switch (dtype) {
    case DType::F32: return CUDA_R_32F;
    case DType::F16: return CUDA_R_16F;
    case DType::BF16: return CUDA_R_16BF;
    case DType::F64: return CUDA_R_64F;
    default: fail("cuda matmul: dtype ", dtype_name(dtype), " is not supported (expected f32, f16, bf16 or f64)");
  }
}

// The largest power of two (at most 256) dividing the address: the heuristic must only pick kernels whose
// vector loads this pointer allows (its default assumes 256-byte alignment, which views with offsets break).
uint32_t alignment_of(const void* ptr) {
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  uint32_t alignment = 1;
  while (alignment < 256 && address % (alignment * 2) == 0) alignment *= 2;
  return alignment;
}

// The alignment every batch step keeps: that of the step in bytes (256 for no step, a broadcast or one entry).
uint32_t batch_alignment(int64_t batch_stride, size_t element_size) {
  if (batch_stride == 0) return 256;
  return alignment_of(reinterpret_cast<const void*>(static_cast<uintptr_t>(batch_stride) * element_size));
}

// ---- plans ------------------------------------------------------------------------------------------------

// Everything the descriptors and the algorithm depend on.
struct PlanKey {
  DType dtype = DType::F32;
  Epilogue epilogue = Epilogue::None;
  bool tf32 = false;
  int device = 0;
  int64_t M = 0, N = 0, K = 0, batch = 1;
  LtMatrix a, b, d;  // cuBLASLt's A (our b), B (our a), C = D (out)
  int64_t a_batch_stride = 0, b_batch_stride = 0, d_batch_stride = 0;
  uint32_t a_align = 0, b_align = 0, d_align = 0, bias_align = 0;

  std::vector<int64_t> words() const {
    return {static_cast<int64_t>(dtype), static_cast<int64_t>(epilogue), tf32, device, M, N, K, batch,
            a.transpose, a.rows, a.cols, a.ld, b.transpose, b.rows, b.cols, b.ld, d.rows, d.cols, d.ld,
            a_batch_stride, b_batch_stride, d_batch_stride, a_align, b_align, d_align, bias_align};
  }
  std::string describe() const {
    auto matrix = [](const char* name, int64_t rows, int64_t cols, bool transposed) {
      return std::string(name) + "[" + std::to_string(rows) + ", " + std::to_string(cols) + "]" +
             (transposed ? " (a transposed view)" : "");
    };
    // key.b is cuBLASLt's B, i.e. our a; key.a is our b.
    return std::string(dtype_name(dtype)) + " batch " + std::to_string(batch) + ": " + matrix("a", M, K, b.transpose) +
           " @ " + matrix("b", K, N, a.transpose) + " (epilogue " + epilogue_name(epilogue) + (tf32 ? ", tf32" : "") +
           ")";
  }
};


struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;  // C shares d
  cublasLtMatmulAlgo_t algo{};
  size_t workspace_bytes = 0;
  // The epilogue had no algorithm: out is prefilled with the bias rows and the product adds onto it (beta 1).
  bool bias_via_beta = false;
  // Guards the bias pointer in desc between setting it and the cublasLtMatmul call that reads it.
  std::mutex mutex;

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {  // host-side frees only; failures at process exit are ignored
    if (desc) (void)cublasLtMatmulDescDestroy(desc);
    if (a) (void)cublasLtMatrixLayoutDestroy(a);
    if (b) (void)cublasLtMatrixLayoutDestroy(b);
    if (d) (void)cublasLtMatrixLayoutDestroy(d);
  }
};

cublasLtMatrixLayout_t make_layout(cudaDataType_t type, const LtMatrix& m, int64_t batch, int64_t batch_stride) {
  cublasLtMatrixLayout_t layout = nullptr;
  MIXTAPE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout, type, static_cast<uint64_t>(m.rows),
                                                  static_cast<uint64_t>(m.cols), m.ld));
  if (batch > 1) {
    const int32_t count = static_cast<int32_t>(batch);
    MIXTAPE_CUBLAS_CHECK(
        cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
    MIXTAPE_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                          &batch_stride, sizeof(batch_stride)));
  }
  return layout;
}

// Creates the matmul descriptor for `epilogue` into plan.desc (replacing any previous one).
void make_desc(Plan& plan, const PlanKey& key, Epilogue epilogue, const void* bias) {
  if (plan.desc) {
    MIXTAPE_CUBLAS_CHECK(cublasLtMatmulDescDestroy(plan.desc));
    plan.desc = nullptr;
  }
  const cublasComputeType_t compute = key.dtype == DType::F64 ? CUBLAS_COMPUTE_64F
                                      : key.tf32              ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                              : CUBLAS_COMPUTE_32F;
  const cudaDataType_t scale = key.dtype == DType::F64 ? CUDA_R_64F : CUDA_R_32F;
  MIXTAPE_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan.desc, compute, scale));
  const int32_t trans_a = key.a.transpose ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int32_t trans_b = key.b.transpose ? CUBLAS_OP_T : CUBLAS_OP_N;
  MIXTAPE_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
  MIXTAPE_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
  const uint32_t lt_epi = lt_epilogue(epilogue);
  MIXTAPE_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &lt_epi, sizeof(lt_epi)));
  if (epilogue == Epilogue::Bias || epilogue == Epilogue::GeluBias) {
    // The bias in the output dtype (cuBLASLt's default for these types, stated here rather than assumed).
    const int32_t bias_type = lt_type(key.dtype);
    MIXTAPE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                        &bias_type, sizeof(bias_type)));
    // The heuristic reads the pointer's alignment; every call sets its own pointer again.
    MIXTAPE_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
    // One bias for every batch entry.
    const int64_t bias_batch_stride = 0;
    MIXTAPE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE,
                                                        &bias_batch_stride, sizeof(bias_batch_stride)));
  }
}

// Asks the heuristic for one algorithm for plan's current descriptors; false when it has none.
bool find_algo(cublasLtHandle_t handle, Plan& plan, const PlanKey& key) {
  // Split-K keeps its partial sums in the compute type: one rounding into f16/bf16 outputs.
  cublasLtMatmulHeuristicResult_t result{};
  int count = 0;
  const cublasStatus_t status = lt_heuristic(handle, plan.desc, plan.a, plan.b, plan.d, key.a_align, key.b_align,
                                             key.d_align, CudaBackend::kWorkspaceBytes, &result, &count);
  // NOT_SUPPORTED: no heuristic for this configuration, an answer like count == 0. With an epilogue, an
  // INVALID_VALUE can also mean "this epilogue with these types" (not documented per type): the caller then
  // retries without it. Anything else is an error.
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) return false;
  if (status == CUBLAS_STATUS_INVALID_VALUE && key.epilogue != Epilogue::None && !plan.bias_via_beta) return false;
  check_cublas(status, "cublasLtMatmulAlgoGetHeuristic(...)", __FILE__, __LINE__);
  if (count < 1 || result.state != CUBLAS_STATUS_SUCCESS) return false;
  plan.algo = result.algo;
  plan.workspace_bytes = result.workspaceSize;
  return true;
}

std::unique_ptr<Plan> make_plan(cublasLtHandle_t handle, const PlanKey& key, const void* bias) {
  auto plan = std::make_unique<Plan>();
  const cudaDataType_t type = lt_type(key.dtype);
  plan->a = make_layout(type, key.a, key.batch, key.a_batch_stride);
  plan->b = make_layout(type, key.b, key.batch, key.b_batch_stride);
  plan->d = make_layout(type, key.d, key.batch, key.d_batch_stride);
  make_desc(*plan, key, key.epilogue, bias);
  if (find_algo(handle, *plan, key)) return plan;
  if (key.epilogue == Epilogue::Bias) {  // no algorithm with the epilogue: bias through C and beta = 1
    make_desc(*plan, key, Epilogue::None, nullptr);
    plan->bias_via_beta = true;
    if (find_algo(handle, *plan, key)) return plan;
  }
  fail("cuda matmul: cuBLASLt's heuristic has no algorithm for ", key.describe(), "; cuBLASLt operands: A ",
       key.a.rows, "x", key.a.cols, " ld ", key.a.ld, key.a.transpose ? " (T)" : "", ", B ", key.b.rows, "x",
       key.b.cols, " ld ", key.b.ld, key.b.transpose ? " (T)" : "", ", D ", key.d.rows, "x", key.d.cols, " ld ",
       key.d.ld, ", batch strides ", key.a_batch_stride, "/", key.b_batch_stride, "/", key.d_batch_stride,
       ", alignments ", key.a_align, "/", key.b_align, "/", key.d_align, " bytes");
}

// The plan for a key, built on first use (cached_plan, common.cuh).
std::shared_ptr<Plan> plan_for(cublasLtHandle_t handle, const PlanKey& key, const void* bias) {
  return cached_plan<Plan>(key.words(), [&] { return make_plan(handle, key, bias); });
}

// ---- kernels ----------------------------------------------------------------------------------------------

// out (contiguous, rows of n) [i] = bias[i % n], or 0 without a bias: the K == 0 product, and the C operand of
// the bias-through-beta path.
template <class D>
__global__ void fill_rows_kernel(D* __restrict__ out, const D* __restrict__ bias, int64_t total, int64_t n) {
  const D zero = store<D>(device_acc_t<D>(0));
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)
    out[i] = bias ? bias[i % n] : zero;
}

void fill_rows(CudaBackend& backend, const Tensor& out, const Tensor& bias) {
  const int64_t total = out.numel(), n = out.size(-1);
  if (total == 0) return;
  dispatch_float(out.dtype(), "cuda matmul", [&]<typename T>() {
    using D = device_t<T>;
    fill_rows_kernel<D><<<blocks_for(total), kThreads, 0, backend.stream()>>>(
        device_ptr<T>(out), bias.defined() ? device_ptr<T>(bias) : nullptr, total, n);
    MIXTAPE_KERNEL_CHECK();
  });
}

// ---- the product ------------------------------------------------------------------------------------------

void check_int32(int64_t value, const char* what, const Tensor& a, const Tensor& b) {
  if (value > INT32_MAX)
    fail("cuda matmul: ", a.description(), " x ", b.description(), ": ", what, " = ", value,
         " exceeds cuBLASLt's 32-bit limit");
}

// The product as cuBLASLt will run it: the operands (a and b themselves, or copies where cuBLASLt cannot read
// their layout) and the plan key with every layout decision. Host-side only (copies go through `backend`).
struct LtProblem {
  Tensor A, B;  // our a and b (cuBLASLt's B and A)
  PlanKey key;
};

LtProblem lower(Backend& backend, const Tensor& a, const Tensor& b, const Tensor& out, const void* bias_ptr,
                bool gelu, int device) {
  const bool has_bias = bias_ptr != nullptr;
  // Operands cuBLASLt cannot read are copied; the geometry is then recomputed from the copies.
  Tensor A = a, B = b;
  MatmulGeometry g = simplify_matmul(A, B, out);
  if (g.batch.size() > 1) {  // one strided batch dim only: materialise both over the full batch
    A = materialize(backend, a, out);
    B = materialize(backend, b, out);
    g = simplify_matmul(A, B, out);
  }
  if (!lt_of_a(g).ok) {
    A = materialize(backend, A, out);
    g = simplify_matmul(A, B, out);
  }
  if (!lt_of_b(g).ok) {
    B = materialize(backend, B, out);
    g = simplify_matmul(A, B, out);
  }
  const LtMatrix lt_a = lt_of_a(g), lt_b = lt_of_b(g), lt_out = lt_of_out(g);
  check(g.batch.size() <= 1 && lt_a.ok && lt_b.ok && lt_out.ok && !lt_out.transpose,
        "cuda matmul: internal error: no cuBLASLt layout for ", a.described(), " x ", b.described(), " -> ",
        out.described());

  PlanKey key;
  key.dtype = a.dtype();
  if (gelu) key.epilogue = has_bias ? Epilogue::GeluBias : Epilogue::Gelu;
  else key.epilogue = has_bias ? Epilogue::Bias : Epilogue::None;
  key.tf32 = a.dtype() == DType::F32 && allow_tf32();
  key.device = device;
  key.M = g.M;
  key.N = g.N;
  key.K = g.K;
  key.batch = g.batch.empty() ? 1 : g.batch[0];
  key.a = lt_b;  // cuBLASLt's A is our b (out^T = b^T a^T)
  key.b = lt_a;
  key.d = lt_out;
  if (key.batch > 1) {
    key.a_batch_stride = g.b.batch[0];
    key.b_batch_stride = g.a.batch[0];
    key.d_batch_stride = g.out.batch[0];
  }
  check_int32(key.M, "M", a, b);
  check_int32(key.N, "N", a, b);
  check_int32(key.K, "K", a, b);
  check_int32(key.batch, "batch", a, b);
  check_int32(std::max({key.a.ld, key.b.ld, key.d.ld}), "a leading dimension", a, b);
  const void* a_ptr = B.data_ptr();  // cuBLASLt's A
  const void* b_ptr = A.data_ptr();  // cuBLASLt's B
  const void* d_ptr = out.data_ptr();
  // Every batch entry's matrix must meet the alignment the algorithm is chosen for, not only the first.
  const size_t element = dtype_size(key.dtype);
  key.a_align = std::min(alignment_of(a_ptr), batch_alignment(key.a_batch_stride, element));
  key.b_align = std::min(alignment_of(b_ptr), batch_alignment(key.b_batch_stride, element));
  key.d_align = std::min(alignment_of(d_ptr), batch_alignment(key.d_batch_stride, element));
  key.bias_align = has_bias ? alignment_of(bias_ptr) : 0;
  return {A, B, key};
}

// Arguments already keep check_matmul's contract and out has elements.
void run_matmul(CudaBackend& backend, const Tensor& a, const Tensor& b, const Tensor& out, const Tensor& bias,
                bool gelu) {
  const bool has_bias = bias.defined();
  lt_type(a.dtype());  // rejects integer dtypes before any work
  if (a.size(-1) == 0) {  // an empty sum: out = bias (or 0) in every row
    if (gelu) fail("cuda matmul_gelu: K == 0 is not supported (", a.description(), " x ", b.description(), ")");
    fill_rows(backend, out, bias);
    return;
  }

  const LtProblem problem =
      lower(backend, a, b, out, has_bias ? bias.data_ptr() : nullptr, gelu, backend.device());
  const PlanKey& key = problem.key;
  const void* a_ptr = problem.B.data_ptr();  // cuBLASLt's A
  const void* b_ptr = problem.A.data_ptr();  // cuBLASLt's B
  void* d_ptr = out.data_ptr();
  const void* bias_ptr = has_bias ? bias.data_ptr() : nullptr;

  const auto handle = static_cast<cublasLtHandle_t>(backend.cublaslt_handle());
  void* workspace = backend.workspace();
  const cudaStream_t stream = backend.stream();
  const std::shared_ptr<Plan> plan = plan_for(handle, key, bias_ptr);
  if (plan->bias_via_beta) fill_rows(backend, out, bias);  // C = bias rows, D = A B + 1 * C

  const float alpha_f = 1, beta_f = plan->bias_via_beta ? 1 : 0;
  const double alpha_d = 1, beta_d = plan->bias_via_beta ? 1 : 0;
  const bool f64 = key.dtype == DType::F64;
  const void* alpha = f64 ? static_cast<const void*>(&alpha_d) : static_cast<const void*>(&alpha_f);
  const void* beta = f64 ? static_cast<const void*>(&beta_d) : static_cast<const void*>(&beta_f);

  std::lock_guard lock(plan->mutex);
  if (has_bias && !plan->bias_via_beta)
    MIXTAPE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr,
                                                        sizeof(bias_ptr)));
  MIXTAPE_CUBLAS_CHECK(cublasLtMatmul(handle, plan->desc, alpha, a_ptr, plan->a, b_ptr, plan->b, beta, d_ptr,
                                      plan->d, d_ptr, plan->d, &plan->algo, workspace, CudaBackend::kWorkspaceBytes,
                                      stream));
}

}  // namespace

void CudaBackend::matmul_kernel(const Tensor& a, const Tensor& b, const Tensor& out, const Tensor& bias) {
  run_matmul(*this, a, b, out, bias, /*gelu=*/false);
}

// out = gelu_tanh(a @ b + bias) in one cuBLASLt call (CUBLASLT_EPILOGUE_GELU_BIAS, or CUBLASLT_EPILOGUE_GELU when
// bias is undefined), for an MLP's first linear layer; no front end calls it, because autocast rounds the product
// to 16 bits before GELU and this epilogue applies GELU before rounding. Same operand conventions as
// Backend::matmul (a, b on one CUDA device; out contiguous; bias contiguous [N] in a's dtype). cuBLASLt's GELU
// is the tanh approximation (UnaryOp::GeluTanh), applied to the f32 (f64) accumulator plus bias, then rounded
// once into out: it differs from matmul followed by unary(GeluTanh) by that skipped intermediate rounding (and by
// cuBLASLt's own tanh). Throws when no algorithm offers the epilogue (e.g. possibly f64) or when K == 0.
void matmul_bias_gelu(const Tensor& a, const Tensor& b, const Tensor& out, const Tensor& bias) {
  check_matmul(a, b, out, bias);
  if (out.numel() == 0) return;
  run_matmul(backend(out.device().index), a, b, out, bias, /*gelu=*/true);
}

}  // namespace mixtape::cuda
