// The kernel contract (tensor/backend.h, tensor/kernel_contract.cpp) and the unary-op table
// (tensor/unary_ops.h): arguments are checked by Backend's entry points before any device's kernel runs, and
// each unary op's backward reads exactly the tensor its row names. References: central finite differences
// in f64, and the messages the contract promises.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "tensor/autocast_state.h"
#include "tensor/backend.h"
#include "tensor/kernel_contract.h"
#include "tensor/ops.h"
#include "tensor/unary_ops.h"
#include "test_util.h"

using namespace mixtape;
using mixtape::testing::all_close;
using mixtape::testing::uniform_tensor;

namespace {

constexpr double kExponent = 2.5;  // PowScalar's scalar

Tensor apply_unary(UnaryOp op, const Tensor& x) {
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  backend_of(x).unary(op, x, out, kExponent);
  return out;
}

TEST(UnaryOpTable, EachBackwardNeedsOnlyTheTensorItsRowNamesAndMatchesFiniteDifferences) {
  // x in [0.5, 2]: inside every op's domain (log, sqrt, rsqrt, x^2.5) and away from relu's and abs's kink.
  const Tensor x = uniform_tensor({64}, 7, 0.5, 2.0, DType::F64);
  const Tensor g = Tensor::ones({64}, DType::F64);
  const double h = 1e-6;
  for (const UnaryOpTraits& row : kUnaryOps) {
    SCOPED_TRACE(std::string(row.name) + " (UnaryOp " + std::to_string(static_cast<int>(row.op)) + ")");
    const Tensor y = apply_unary(row.op, x);
    const bool from_output = row.derivative == UnaryDerivative::FromOutput;
    Tensor grad = Tensor::empty({64}, DType::F64);
    backend_of(x).unary_backward(row.op, from_output ? Tensor() : x, from_output ? y : Tensor(), g, grad,
                                 kExponent);
    const Tensor above = apply_unary(row.op, add(x, h)), below = apply_unary(row.op, sub(x, h));
    const Tensor slope = div(sub(above, below), 2 * h);
    EXPECT_TRUE(all_close(grad, slope, 1e-7, 1e-6));
  }
}

TEST(UnaryOpTable, BackwardWithoutTheNamedTensorSaysWhichOneItNeeds) {
  const Tensor x = uniform_tensor({8}, 8, 0.5, 2.0, DType::F32);
  const Tensor g = Tensor::ones({8}), grad = Tensor::empty({8});
  Backend& backend = backend_of(x);
  EXPECT_ERROR_MENTIONS(backend.unary_backward(UnaryOp::Exp, x, Tensor(), g, grad, 0),
                        "unary_backward: the op needs its output but got none");
  EXPECT_ERROR_MENTIONS(backend.unary_backward(UnaryOp::Log, Tensor(), apply_unary(UnaryOp::Log, x), g, grad, 0),
                        "unary_backward: the op needs its input but got none");
}

TEST(UnaryOpTable, FrontEndNamesAndAutocastClassesComeFromTheRows) {
  // Under an f16 scope: exp's and pow's class (Fp32) widens an f16 input to f32; sqrt has none and runs in
  // its input's dtype.
  const Tensor x16 = uniform_tensor({4}, 9, 0.5, 2.0, DType::F16);
  {
    AutocastScope scope(DType::F16);
    EXPECT_EQ(exp(x16).dtype(), DType::F32);
    EXPECT_EQ(sqrt(x16).dtype(), DType::F16);
    EXPECT_EQ(pow(x16, 2.0).dtype(), DType::F32);
  }
  EXPECT_ERROR_MENTIONS(gelu(Tensor::zeros({2}, DType::I32)), "gelu: expected a floating tensor");
  EXPECT_ERROR_MENTIONS(pow(Tensor::zeros({2}, DType::I64), 2.0), "pow: expected a floating tensor");
}

TEST(KernelContract, StatisticsAreF32AndF64ForF64Inputs) {
  EXPECT_EQ(stats_dtype(DType::F32), DType::F32);
  EXPECT_EQ(stats_dtype(DType::F16), DType::F32);
  EXPECT_EQ(stats_dtype(DType::BF16), DType::F32);
  EXPECT_EQ(stats_dtype(DType::F64), DType::F64);
  // A kernel takes its statistics in that dtype and no other.
  Backend& backend = backend_for(Device::cpu());
  const Tensor x = uniform_tensor({3, 5}, 10, -1, 1, DType::BF16);
  const Tensor out = Tensor::empty({3, 5}, DType::BF16);
  EXPECT_NO_THROW(backend.rms_norm(x, Tensor(), 1e-5, out, Tensor::empty({3}, DType::F32)));
  EXPECT_ERROR_MENTIONS(backend.rms_norm(x, Tensor(), 1e-5, out, Tensor::empty({3}, DType::BF16)),
                        "rms_norm: rstd must be contiguous f32[3]");
}

// The CPU, and the first GPU where there is one (without a GPU the CUDA half is not run).
std::vector<Device> devices_under_test() {
  std::vector<Device> devices{Device::cpu()};
  if (cuda_device_count() > 0) devices.push_back(Device::cuda(0));
  return devices;
}

TEST(KernelContract, EveryBackendRejectsTheSameArgumentsWithTheSameMessage) {
  // The entry points check before the device's kernel runs, so every backend gives the same message (matmul's
  // and embedding's name the device kind they ran on).
  for (const Device device : devices_under_test()) {
    const std::string kind = device.is_cuda() ? "cuda" : "cpu";
    SCOPED_TRACE(kind);
    Backend& backend = backend_for(device);
    const Tensor x = uniform_tensor({4, 6}, 11, -1, 1, DType::F32).to(device);
    const Tensor grad_x = Tensor::empty({4, 6}, DType::F32, device);
    EXPECT_ERROR_MENTIONS(
        backend.layer_norm_backward(x, x, Tensor(), Tensor(), Tensor(), grad_x, Tensor(), Tensor()),
        "layer_norm_backward: mean and rstd are required");
    EXPECT_ERROR_MENTIONS(backend.rms_norm_backward(x, x, Tensor(), Tensor(), grad_x, Tensor()),
                          "rms_norm_backward: rstd is required");
    EXPECT_ERROR_MENTIONS(backend.matmul(x, x, Tensor::empty({4, 4, 1}, DType::F32, device), Tensor()),
                          kind + " matmul: operands", "must have the same number (>= 2) of dims");
    EXPECT_ERROR_MENTIONS(backend.embedding(Tensor::zeros({6}, DType::F32, device),
                                            Tensor::zeros({4}, DType::I64, device), grad_x),
                          kind + " embedding: expected indices [n] and a contiguous out [n, C]");
    EXPECT_ERROR_MENTIONS(backend.where(Tensor::ones({4, 6}, DType::F32, device), x, x.to(DType::F64), grad_x),
                          "where:", "must have the dtype of");
    // An f64 input for an f32 output is a mixed read that no backend offers.
    EXPECT_ERROR_MENTIONS(backend.binary(BinaryOp::Add, x.to(DType::F64), x, grad_x), "binary: inputs",
                          "expected the output's dtype, or f32, f16 or bf16 inputs for an f32 output");
    EXPECT_ERROR_MENTIONS(backend.binary_scalar(BinaryOp::Eq, x, 1.0, false, grad_x),
                          "binary_scalar: unknown op " + std::to_string(static_cast<int>(BinaryOp::Eq)));
    EXPECT_ERROR_MENTIONS(backend.softmax_cross_entropy(x, Tensor::zeros({3}, DType::I64, device), -100,
                                                        Tensor::empty({}, DType::F32, device),
                                                        Tensor::empty({4}, DType::F32, device)),
                          "softmax_cross_entropy: targets must be contiguous i32/i64 [4]");
    EXPECT_ERROR_MENTIONS(backend.matmul(x, x.mT(), Tensor::empty({4, 4}, DType::F32, device).mT(), Tensor()),
                          kind + " matmul: output", "must be contiguous");
  }
}

}  // namespace
