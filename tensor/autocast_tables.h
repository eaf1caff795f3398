#pragma once
// The autocast policy tables, one per framework whose autocast mixtape reproduces: which of mixtape's ops
// run in the lower-precision dtype, which in fp32, which promote to their widest floating input, and which
// are in none of the framework's lists. Each row names the list it comes from, so a table reads against its
// source file line by line.
//
// Layering: tensor/ sits below amp/ and the op front ends read these tables (by AutocastOp constant, through
// the thread-local policy of tensor/autocast_state.h), so they live here; amp/precision_mode.h names each
// precision mode's table and amp/policy.h prints them. Constexpr and free of tensors, so a mode table can
// point at them.
#include <array>
#include <cstddef>

#include "tensor/autocast_op.h"

namespace mixtape {

struct AutocastTableEntry {
  AutocastOp op;
  const char* name;       // the front end's name in ops.h
  OpPolicy policy;
  const char* listed_as;  // the framework's list (or policy) the class comes from, or "not listed"
  const char* note;       // what else it covers, or ""
};

using AutocastOpRows = std::array<AutocastTableEntry, static_cast<size_t>(AutocastOp::Count)>;

struct AutocastPolicyTable {
  const char* framework;        // "PyTorch AMP (torch.autocast)"
  const char* source;           // the file(s) the rows are read from
  const char* lower_precision;  // what LowerPrecision means under this framework: "the autocast dtype (f16/bf16)"
  AutocastOpRows rows;          // in AutocastOp order (checked below)
};

// PyTorch's CUDA autocast (used on every device, so a CPU run computes what a GPU run does), read from
// aten/src/ATen/autocast_mode.h (the AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE,
// AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE (fp32_append_dtype) and AT_FORALL_PROMOTE lists, which
// autocast_mode.cpp registers for AutocastCUDA), PyTorch 2.x main: rms_norm is in AT_FORALL_FP32 there (the
// 2.x releases before it joined leave rms_norm unlisted). None of mixtape's ops is in the promote list:
// add/sub/mul/div/cat/stack/where are in no list, and their mixed floating inputs meet in the widest by
// PyTorch's own type promotion; mean and var are in no list either and run in their input's dtype. Of
// mixtape's other ops (gelu, relu, silu, tanh, sigmoid, sqrt, abs, neg, embedding, dropout, max, ...) none
// is listed by PyTorch or Apex (softplus is, in both; mixtape has none).
inline constexpr AutocastPolicyTable kPytorchAutocastPolicy{
    "PyTorch AMP (torch.autocast, CUDA lists)",
    "aten/src/ATen/autocast_mode.h + autocast_mode.cpp (PyTorch 2.x)",
    "autocast dtype (f16/bf16)",
    {{
        {AutocastOp::Matmul, "matmul", OpPolicy::LowerPrecision, "lower_precision_fp", "also bmm: matmul with batch dims"},
        {AutocastOp::Linear, "linear", OpPolicy::LowerPrecision, "lower_precision_fp", ""},
        {AutocastOp::ScaledDotProductAttention, "scaled_dot_product_attention", OpPolicy::LowerPrecision,
         "lower_precision_fp", ""},
        {AutocastOp::CausalSelfAttention, "causal_self_attention", OpPolicy::LowerPrecision, "lower_precision_fp",
         "nanoGPT's attention: scaled_dot_product_attention"},
        {AutocastOp::Softmax, "softmax", OpPolicy::Fp32, "fp32_set_opt_dtype", ""},
        {AutocastOp::LogSoftmax, "log_softmax", OpPolicy::Fp32, "fp32_set_opt_dtype", ""},
        {AutocastOp::SoftmaxCrossEntropy, "softmax_cross_entropy", OpPolicy::Fp32, "fp32 (nll_loss)",
         "cross_entropy: log_softmax then nll_loss; targets stay"},
        {AutocastOp::LayerNorm, "layer_norm", OpPolicy::Fp32, "fp32", ""},
        {AutocastOp::RMSNorm, "rms_norm", OpPolicy::Fp32, "fp32", ""},
        {AutocastOp::Exp, "exp", OpPolicy::Fp32, "fp32", ""},
        {AutocastOp::Log, "log", OpPolicy::Fp32, "fp32", ""},
        {AutocastOp::Rsqrt, "rsqrt", OpPolicy::Fp32, "fp32", ""},
        {AutocastOp::Pow, "pow", OpPolicy::Fp32, "fp32", "tensor and scalar exponents"},
        {AutocastOp::Sum, "sum", OpPolicy::Fp32, "fp32_set_opt_dtype", ""},
        {AutocastOp::Mean, "mean", OpPolicy::Unlisted, "not listed", ""},
        {AutocastOp::Norm, "norm", OpPolicy::Fp32, "fp32_append_dtype", "p-norm, p > 0 or inf"},
        {AutocastOp::Var, "var", OpPolicy::Unlisted, "not listed", ""},
        {AutocastOp::Add, "add", OpPolicy::Unlisted, "not listed", "tensor-tensor form"},
        {AutocastOp::Sub, "sub", OpPolicy::Unlisted, "not listed", "tensor-tensor form"},
        {AutocastOp::Mul, "mul", OpPolicy::Unlisted, "not listed", "tensor-tensor form"},
        {AutocastOp::Div, "div", OpPolicy::Unlisted, "not listed", "tensor-tensor form"},
        {AutocastOp::Cat, "cat", OpPolicy::Unlisted, "not listed", ""},
        {AutocastOp::Stack, "stack", OpPolicy::Unlisted, "not listed", ""},
        {AutocastOp::Where, "where", OpPolicy::Unlisted, "not listed", "a and b; the condition is never cast"},
    }}};

// NVIDIA Apex amp at O1 (patch_torch_functions: Apex wraps torch, torch.Tensor and torch.nn.functional),
// read from apex/amp/lists/functional_overrides.py, torch_overrides.py and tensor_overrides.py: FP16_FUNCS run
// in f16, FP32_FUNCS in f32, CASTS and SEQUENCE_CASTS in the widest floating input. mean is not cast: its
// FP32_FUNCS entry is commented out and appended only for torch < 1.1. sub is in tensor_overrides' CASTS
// (__sub__, __rsub__, __isub__: the `a - b` form models use). gelu is in no list.
inline constexpr AutocastPolicyTable kApexO1AutocastPolicy{
    "NVIDIA Apex amp O1 (patch_torch_functions)",
    "apex/amp/lists/functional_overrides.py, torch_overrides.py, tensor_overrides.py",
    "f16",
    {{
        {AutocastOp::Matmul, "matmul", OpPolicy::LowerPrecision, "torch FP16_FUNCS", "also bmm (FP16_FUNCS on CUDA >= 9.1)"},
        {AutocastOp::Linear, "linear", OpPolicy::LowerPrecision, "functional FP16_FUNCS", ""},
        {AutocastOp::ScaledDotProductAttention, "scaled_dot_product_attention", OpPolicy::Unlisted, "not listed",
         ""},
        {AutocastOp::CausalSelfAttention, "causal_self_attention", OpPolicy::Unlisted, "not listed",
         "scaled_dot_product_attention"},
        {AutocastOp::Softmax, "softmax", OpPolicy::Fp32, "functional FP32_FUNCS", ""},
        {AutocastOp::LogSoftmax, "log_softmax", OpPolicy::Fp32, "functional FP32_FUNCS", ""},
        {AutocastOp::SoftmaxCrossEntropy, "softmax_cross_entropy", OpPolicy::Fp32, "functional FP32_FUNCS",
         "cross_entropy; targets stay"},
        {AutocastOp::LayerNorm, "layer_norm", OpPolicy::Fp32, "functional FP32_FUNCS", ""},
        {AutocastOp::RMSNorm, "rms_norm", OpPolicy::Unlisted, "not listed", ""},
        {AutocastOp::Exp, "exp", OpPolicy::Fp32, "torch FP32_FUNCS", ""},
        {AutocastOp::Log, "log", OpPolicy::Fp32, "torch FP32_FUNCS", ""},
        {AutocastOp::Rsqrt, "rsqrt", OpPolicy::Fp32, "torch FP32_FUNCS", ""},
        {AutocastOp::Pow, "pow", OpPolicy::Fp32, "torch FP32_FUNCS", "tensor and scalar exponents"},
        {AutocastOp::Sum, "sum", OpPolicy::Fp32, "torch FP32_FUNCS", ""},
        {AutocastOp::Mean, "mean", OpPolicy::Unlisted, "not listed", "FP32_FUNCS only for torch < 1.1"},
        {AutocastOp::Norm, "norm", OpPolicy::Fp32, "torch FP32_FUNCS", "p-norm, p > 0 or inf"},
        {AutocastOp::Var, "var", OpPolicy::Fp32, "torch FP32_FUNCS", ""},
        {AutocastOp::Add, "add", OpPolicy::Promote, "torch CASTS", "tensor-tensor form"},
        {AutocastOp::Sub, "sub", OpPolicy::Promote, "tensor CASTS (__sub__)", "tensor-tensor form"},
        {AutocastOp::Mul, "mul", OpPolicy::Promote, "torch CASTS", "tensor-tensor form"},
        {AutocastOp::Div, "div", OpPolicy::Promote, "torch CASTS", "tensor-tensor form"},
        {AutocastOp::Cat, "cat", OpPolicy::Promote, "SEQUENCE_CASTS", ""},
        {AutocastOp::Stack, "stack", OpPolicy::Promote, "SEQUENCE_CASTS", ""},
        {AutocastOp::Where, "where", OpPolicy::Unlisted, "not listed", "a and b; the condition is never cast"},
    }}};

constexpr bool rows_in_op_order(const AutocastPolicyTable& table) {
  for (size_t i = 0; i < table.rows.size(); ++i)
    if (static_cast<size_t>(table.rows[i].op) != i) return false;
  return true;
}
static_assert(rows_in_op_order(kPytorchAutocastPolicy), "kPytorchAutocastPolicy rows must follow AutocastOp order");
static_assert(rows_in_op_order(kApexO1AutocastPolicy), "kApexO1AutocastPolicy rows must follow AutocastOp order");

constexpr bool same_text(const char* a, const char* b) {
  while (*a != '\0' && *a == *b) ++a, ++b;
  return *a == *b;
}
constexpr bool tables_name_ops_alike(const AutocastPolicyTable& a, const AutocastPolicyTable& b) {
  for (size_t i = 0; i < a.rows.size(); ++i)
    if (!same_text(a.rows[i].name, b.rows[i].name)) return false;
  return true;
}
static_assert(tables_name_ops_alike(kPytorchAutocastPolicy, kApexO1AutocastPolicy),
              "the autocast tables name an op differently");

// The front end's name of `op` (the same in every table, checked above).
constexpr const char* autocast_op_name(AutocastOp op) {
  return kPytorchAutocastPolicy.rows[static_cast<size_t>(op)].name;
}
constexpr OpPolicy policy_of(const AutocastPolicyTable& table, AutocastOp op) {
  return table.rows[static_cast<size_t>(op)].policy;
}

}  // namespace mixtape
