#pragma once
// The names autocast knows ops by: each op's policy class and the AutocastOp constants that front ends (and
// the unary-op table, tensor/unary_ops.h) name. Enums only, so that .cu files can include it; the policy
// tables themselves (one per framework) are tensor/autocast_tables.h.
#include <cstdint>

namespace mixtape {

enum class OpPolicy : uint8_t {
  LowerPrecision,  // f32/f16/bf16 inputs run in the autocast dtype (matmul-like: tensor cores, fp32 accumulate)
  Fp32,            // f16/bf16 inputs are widened to f32, so the output is f32 (range-hungry: exp, sums, softmax)
  Promote,         // all floating inputs go to the widest of them (promote()): no mixed-dtype kernel calls
  Unlisted,        // in none of the framework's autocast lists: the op runs in its inputs' dtype; mixed floating
                   // inputs still meet in the widest of them, as outside autocast (type promotion, not autocast)
};
// f64 inputs are never cast (f64 is the reference dtype); integer inputs (targets, indices, masks) never.

enum class AutocastOp : uint8_t {
  Matmul, Linear, ScaledDotProductAttention, CausalSelfAttention,
  Softmax, LogSoftmax, SoftmaxCrossEntropy, LayerNorm, RMSNorm, Exp, Log, Rsqrt, Pow, Sum, Mean, Norm,
  Var,
  Add, Sub, Mul, Div, Cat, Stack, Where,
  Count
};

}  // namespace mixtape
