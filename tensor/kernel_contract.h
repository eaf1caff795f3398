#pragma once
// The argument contract of the kernels (tensor/backend.h): what Backend's public entry points check before any
// device's kernel runs. Most of it is private to kernel_contract.cpp; here is what other code shares.
#include "tensor/tensor.h"

namespace mixtape {

// The dtype of the statistics a fused kernel saves or returns (layer_norm's mean and rstd, the log-sum-exp of
// cross-entropy and attention, the loss): f32, or f64 for f64 inputs, so that the reference dtype keeps full
// precision. Either way it is the accumulation type acc_t of the input dtype.
inline DType stats_dtype(DType x) { return x == DType::F64 ? DType::F64 : DType::F32; }

// Backend::matmul's contract (the CUDA GELU epilogue, cuda::matmul_bias_gelu, shares it): a, b and out with the
// same number (>= 2) of dims and one dtype, bias undefined or a contiguous [N] of that dtype, out contiguous
// when it has elements. Messages name the device kind of out ("cpu matmul: ...", "cuda matmul: ...").
void check_matmul(const Tensor& a, const Tensor& b, const Tensor& out, const Tensor& bias);

}  // namespace mixtape
