// The per-device backend registry: the CPU backend always, CUDA backends when built with them.
#include "tensor/backend.h"

#include <atomic>

#include "tensor/cpu/cpu_backend.h"

namespace mixtape {

#ifdef MIXTAPE_WITH_CUDA
namespace cuda {
class CudaBackend;
CudaBackend& backend(int index);  // tensor/cuda/cuda_backend.cu
Backend& as_backend(CudaBackend& backend);
}  // namespace cuda
#endif

Backend& backend_for(Device device) {
  if (device.is_cpu()) return cpu::cpu_backend();
#ifdef MIXTAPE_WITH_CUDA
  return cuda::as_backend(cuda::backend(device.index));
#else
  not_supported("backend for ", device, ": this build of mixtape has no CUDA backend");
#endif
}

// ---- the fp8 / block-scaled entry points: the contract of tensor/backend.h, then the device's kernel ----

namespace {

void check_quantize_input(const Tensor& x, const char* what) {
  const bool dtype = x.defined() && (x.dtype() == DType::F32 || (x.dtype() == DType::BF16 && x.device().is_cpu()));
  check(dtype && x.dim() == 2 && x.is_contiguous(), "quantize_for_gemm: ", what,
        ": expected a contiguous f32 [R, C] tensor (or bf16 on the CPU), got ", x.described());
}

}  // namespace

std::vector<float> Backend::quantize_row_amax(const Tensor& x, int64_t block_cols) {
  check_quantize_input(x, "row amax");
  check(block_cols >= 1, "quantize_for_gemm: row amax: block_cols ", block_cols, " must be >= 1");
  return quantize_row_amax_kernel(x, block_cols);
}

EncodeCounts Backend::quantize_encode(const Tensor& x, const BlockEncodePlan& plan, const Tensor& values) {
  check_quantize_input(x, "encode");
  check(values.defined() && values.shape() == x.shape() && values.device() == x.device() && values.is_contiguous(),
        "quantize_for_gemm: encode: values ", values.described(), " must be contiguous, shaped and placed as ",
        x.described());
  const int64_t grid_rows = plan.block_rows >= 1 ? (x.size(0) + plan.block_rows - 1) / plan.block_rows : 0;
  const size_t blocks = static_cast<size_t>(grid_rows * plan.grid_cols);
  check(plan.block_rows >= 1 && plan.block_cols >= 1 &&
            plan.grid_cols == (x.size(1) + plan.block_cols - 1) / plan.block_cols && plan.encode.size() == blocks &&
            plan.decode.size() == blocks && plan.multiplier.size() == blocks,
        "quantize_for_gemm: encode: the plan's blocks [", plan.block_rows, ", ", plan.block_cols, "] (",
        plan.encode.size(), " scales) do not tile ", x.described());
  return quantize_encode_kernel(x, plan, values);
}

void Backend::scaled_gemm(const GemmOperand& a, const GemmOperand& b, int accumulator_bits, const Tensor& out) {
  const Tensor &va = a.values, &vb = b.values;
  check(va.dim() == 2 && vb.dim() == 2 && va.size(1) == vb.size(1) && out.dtype() == DType::F32 &&
            out.is_contiguous() && out.shape() == Shape{va.size(0), vb.size(0)} && va.device() == out.device() &&
            vb.device() == out.device(),
        "scaled_matmul: a ", va.described(), " @ b ", vb.described(), "^T into ", out.described(),
        ": expected a [M, K], b [N, K] and a contiguous f32 out [M, N] on one device");
  // The CPU's quantize_for_gemm leaves the values of a transposed input in its memory order (a column-major
  // view, which its GEMM reads as it is); other devices' values are contiguous.
  const auto laid_out = [&](const Tensor& v) { return v.is_contiguous() || (out.device().is_cpu() && v.mT().is_contiguous()); };
  check(laid_out(va) && laid_out(vb), "scaled_matmul: the operands' values must be contiguous",
        out.device().is_cpu() ? " or column-major" : "", ", got ", va.described(), " and ", vb.described());
  check((a.row_scale.empty() || a.row_scale.size() == static_cast<size_t>(va.size(0))) &&
            (b.row_scale.empty() || b.row_scale.size() == static_cast<size_t>(vb.size(0))),
        "scaled_matmul: row scales of ", a.row_scale.size(), " and ", b.row_scale.size(), " entries for ",
        va.described(), " and ", vb.described());
  if (a.k_block > 0) {
    const size_t blocks = static_cast<size_t>((va.size(1) + a.k_block - 1) / a.k_block);
    check(a.k_scales.size() == blocks * static_cast<size_t>(va.size(0)) &&
              b.k_scales.size() == blocks * static_cast<size_t>(vb.size(0)),
          "scaled_matmul: k_scales of ", a.k_scales.size(), " and ", b.k_scales.size(), " entries for ", blocks,
          " blocks of ", a.k_block, " along K");
  }
  if (out.numel() == 0) return;
  scaled_gemm_kernel(a, b, accumulator_bits, out);
}

namespace {
std::atomic<CudaAttentionKernel> attention_kernel{CudaAttentionKernel::TensorCores};
}  // namespace
CudaAttentionKernel set_cuda_attention_kernel(CudaAttentionKernel kernel) { return attention_kernel.exchange(kernel); }
CudaAttentionKernel cuda_attention_kernel() { return attention_kernel.load(); }

#ifndef MIXTAPE_WITH_CUDA
int cuda_device_count() { return 0; }
void set_cuda_allocation_poisoning(bool) {}
std::string cuda_device_name(int index) {
  not_supported("cuda_device_name(", index, "): this build of mixtape has no CUDA backend");
}

void copy_between_devices(const Tensor& src, const Tensor& dst) {
  not_supported("copy from ", src.device(), " to ", dst.device(), ": this build of mixtape has no CUDA backend");
}
#endif

}  // namespace mixtape
