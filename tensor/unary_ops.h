#pragma once
// The unary ops and their one table of traits: the front-end name, what the derivative is computed from,
// and the op's autocast class. The table's readers: the op front end (tensor/ops_elementwise.cpp: every
// column) and the kernel contract (tensor/kernel_contract.cpp: the derivative column, to pick x or y for
// unary_backward). The backends' kernels (tensor/cpu/elementwise.cpp, tensor/cuda/elementwise.cu) read no
// row: they switch on UnaryOp, with a static_assert on UnaryOp::Count, so a new op fails to build there until
// it has its cases. Constexpr and free of the standard library, so .cu files include it too (through
// tensor/backend.h). A new UnaryOp fails to build until its row exists (static_assert below).
#include <cstddef>
#include <cstdint>

#include "tensor/autocast_op.h"

namespace mixtape {

enum class UnaryOp : uint8_t {
  Neg, Exp, Log, Sqrt, Rsqrt, Tanh, Sigmoid, Relu, GeluErf, GeluTanh, Silu, Abs,
  PowScalar,  // x ^ scalar
  Count
};

// What unary_backward reads besides the output gradient: the input x, or the output y = op(x) for the ops
// whose derivative is cheapest in terms of y (exp' = y, sqrt' = 1 / (2y), rsqrt' = -y^3 / 2, tanh' = 1 - y^2,
// sigmoid' = y (1 - y)). The forward saves only that one tensor for the backward.
enum class UnaryDerivative : uint8_t { FromInput, FromOutput };

// The autocast class of an op that no framework's autocast lists (no row in tensor/autocast_tables.h): it runs
// in its input's dtype under every autocast policy.
inline constexpr AutocastOp kNoAutocast = AutocastOp::Count;

struct UnaryOpTraits {
  UnaryOp op;
  const char* name;  // the front end's name in ops.h (its error messages and tape nodes)
  UnaryDerivative derivative;
  AutocastOp autocast;  // the autocast tables' row the front end casts by, or kNoAutocast
};

// In UnaryOp order (checked below). Neg's backward is neg(g) in the front end; its kernel reads x.
inline constexpr UnaryOpTraits kUnaryOps[] = {
    {UnaryOp::Neg, "neg", UnaryDerivative::FromInput, kNoAutocast},
    {UnaryOp::Exp, "exp", UnaryDerivative::FromOutput, AutocastOp::Exp},
    {UnaryOp::Log, "log", UnaryDerivative::FromInput, AutocastOp::Log},
    {UnaryOp::Sqrt, "sqrt", UnaryDerivative::FromOutput, kNoAutocast},
    {UnaryOp::Rsqrt, "rsqrt", UnaryDerivative::FromOutput, AutocastOp::Rsqrt},
    {UnaryOp::Tanh, "tanh", UnaryDerivative::FromOutput, kNoAutocast},
    {UnaryOp::Sigmoid, "sigmoid", UnaryDerivative::FromOutput, kNoAutocast},
    {UnaryOp::Relu, "relu", UnaryDerivative::FromInput, kNoAutocast},
    {UnaryOp::GeluErf, "gelu", UnaryDerivative::FromInput, kNoAutocast},
    {UnaryOp::GeluTanh, "gelu", UnaryDerivative::FromInput, kNoAutocast},
    {UnaryOp::Silu, "silu", UnaryDerivative::FromInput, kNoAutocast},
    {UnaryOp::Abs, "abs", UnaryDerivative::FromInput, kNoAutocast},
    {UnaryOp::PowScalar, "pow", UnaryDerivative::FromInput, AutocastOp::Pow},
};
static_assert(sizeof(kUnaryOps) / sizeof(kUnaryOps[0]) == static_cast<size_t>(UnaryOp::Count),
              "kUnaryOps needs one row per UnaryOp");

constexpr bool unary_table_in_order() {
  for (size_t i = 0; i < static_cast<size_t>(UnaryOp::Count); ++i)
    if (static_cast<size_t>(kUnaryOps[i].op) != i) return false;
  return true;
}
static_assert(unary_table_in_order(), "kUnaryOps rows must follow UnaryOp order");

constexpr const UnaryOpTraits& unary_traits(UnaryOp op) { return kUnaryOps[static_cast<size_t>(op)]; }
constexpr bool derivative_from_output(UnaryOp op) {
  return unary_traits(op).derivative == UnaryDerivative::FromOutput;
}

}  // namespace mixtape
