#pragma once
// bf16 causal attention on AMX tiles (Intel Advanced Matrix Extensions: 16 x 32 bf16 by 32 x 16 products
// accumulated in fp32 tile registers), beside the portable kernel of tensor/cpu/attention.cpp. See
// attention_amx.cpp for the method and its numerics.
#include <cstdint>

#include "tensor/tensor.h"

namespace mixtape::cpu {

// Whether the AMX kernels can run in this process: the library was built for a CPU with AMX-BF16
// (-march=native on one), this CPU has it, and the OS granted the tile state (arch_prctl).
bool amx_attention_available();

// Whether a call with this dtype and head dim D goes to the AMX kernels: available, enabled, bf16, and D a
// whole number of 32-wide tile rows. Other calls take the portable kernel.
bool amx_attention_applies(DType dtype, int64_t D);

// Turns the AMX kernels on or off for every later call (they are on by default) and returns the previous
// setting: tests use it to run the portable kernel on a machine with AMX.
bool set_amx_attention_enabled(bool enabled);

// The kernels, with CpuBackend::causal_attention(_backward)'s arguments, already checked by it.
void amx_causal_attention(const Tensor& q, const Tensor& k, const Tensor& v, double scale, const Tensor& out,
                          const Tensor& lse);
void amx_causal_attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                                   const Tensor& out, const Tensor& lse, double scale, const Tensor& grad_q,
                                   const Tensor& grad_k, const Tensor& grad_v);

}  // namespace mixtape::cpu
