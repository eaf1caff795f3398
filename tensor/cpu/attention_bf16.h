#pragma once
// Public: bench/ and tests read and set the kernel that serves bf16 attention (bf16_attention_kernel, its name).
// bf16 causal attention on the CPU's bf16 product instructions, beside the portable kernel of
// tensor/cpu/attention.cpp: AMX tiles (16 x 32 bf16 by 32 x 16 products into fp32 tile registers: Intel Xeon
// since Sapphire Rapids) or AVX512-BF16 dot products (16 fp32 lanes, each += the product of a bf16 pair: AMD
// Zen 4 and later, Intel Cooper Lake). One method and one set of numerics for both; see attention_bf16.cpp.
#include <cstdint>

#include "tensor/tensor.h"

namespace mixtape::cpu {

// Which kernel serves bf16 attention with a head dim that is a multiple of 32. Portable: the fp32 register
// tiles of attention.cpp, which serve every other call too.
enum class Bf16AttentionKernel { Portable, Avx512Bf16, Amx };

const char* bf16_attention_kernel_name(Bf16AttentionKernel kernel);

// Whether a kernel can run in this process: the library was built for a CPU with its instructions
// (-march=native on one), this CPU has them, and for AMX the OS granted the tile state (arch_prctl).
// Portable always can.
bool bf16_attention_kernel_available(Bf16AttentionKernel kernel);

// The kernel bf16 attention takes: by default automatic_bf16_attention_kernel's choice for this CPU, made once
// per process from its instructions and its measured bf16 dot-product rate, never from the thread count.
Bf16AttentionKernel bf16_attention_kernel();

// The automatic choice, from what is available and bf16_dot_rate(): Amx where available; else Avx512Bf16
// where available, unless slow_bf16_dot(dot_rate) (a core whose dot product runs at half the f32 FMA rate ran
// the attention's forward and backward faster on the portable kernel's f32 FMAs); else Portable.
Bf16AttentionKernel automatic_bf16_attention_kernel(bool amx, bool avx512_bf16, double dot_rate);

// Makes `kernel` serve every later call and returns the previous choice: tests use it to run each kernel on
// a CPU that has several. An unavailable kernel is refused with a "not supported" Error.
Bf16AttentionKernel set_bf16_attention_kernel(Bf16AttentionKernel kernel);

// The kernel a call with this dtype and head dim D goes to: bf16_attention_kernel() for bf16 with D a whole
// number of 32-wide blocks, Portable for everything else.
Bf16AttentionKernel bf16_attention_kernel_for(DType dtype, int64_t D);

// The kernels, with CpuBackend::causal_attention(_backward)'s arguments, already checked by it; `kernel` is
// Amx or Avx512Bf16, as bf16_attention_kernel_for chose it.
void bf16_causal_attention(Bf16AttentionKernel kernel, const Tensor& q, const Tensor& k, const Tensor& v,
                           double scale, const Tensor& out, const Tensor& lse);
void bf16_causal_attention_backward(Bf16AttentionKernel kernel, const Tensor& grad_out, const Tensor& q,
                                    const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                                    double scale, const Tensor& grad_q, const Tensor& grad_k, const Tensor& grad_v);

}  // namespace mixtape::cpu
