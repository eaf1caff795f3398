#pragma once
// A check that runs on each device (tests/test_autocast.cpp on the CPU, tests/test_cuda_norm.cpp on CUDA).
#include <gtest/gtest.h>

#include <tuple>
#include <vector>

#include "amp/autocast.h"
#include "autograd/autograd.h"
#include "tensor/autocast_state.h"
#include "tensor/ops.h"
#include "tests/test_util.h"

namespace mixtape::testing {

// Under autocast, softmax_cross_entropy reads f16/bf16 logits in place rather than widening them (its Fp32
// policy): the loss and the logits' gradient must be bit for bit those of the explicitly widened logits, with
// nothing cast. Vocabularies of 1 to GPT-2's 50304 (rows serial and split over threads or blocks), logits in
// [-30, 30] (probabilities near 1 and far below f16's range), rows ignored (target 0 is the ignore_index).
inline void expect_cross_entropy_reads_sixteen_bit_logits_in_place(Device device) {
  uint64_t seed = 700;
  for (DType low : {DType::F16, DType::BF16})
    for (const auto& [N, V] : {std::tuple<int64_t, int64_t>{3, 1}, {5, 7}, {64, 65}, {96, 1000}, {4, 50304}}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(low) << " [" << N << ", " << V << "]");
      const Tensor targets = Tensor::randint(0, V, {N}, ++seed).to(device);
      Tensor x = uniform_tensor({N, V}, ++seed, -30, 30, low).to(device).detach().requires_grad_();
      Tensor x_widened = x.detach().requires_grad_();
      const uint64_t casts = autocast_cast_count();
      Tensor loss;
      {
        Autocast guard(low);
        loss = softmax_cross_entropy(x, targets, 0);
      }
      EXPECT_EQ(autocast_cast_count(), casts);
      const Tensor expected = softmax_cross_entropy(x_widened.to(DType::F32), targets, 0);
      ASSERT_EQ(loss.dtype(), DType::F32);
      EXPECT_EQ(loss.to(Device::cpu()).to_vector<float>(), expected.to(Device::cpu()).to_vector<float>());
      const Tensor g = Tensor::full({}, 0.75).to(device);
      backward({loss}, {g});
      backward({expected}, {g});
      ASSERT_EQ(x.grad().dtype(), low);
      const std::vector<float> got = x.grad().to(Device::cpu()).to_vector<float>();
      const std::vector<float> want = x_widened.grad().to(Device::cpu()).to_vector<float>();
      const std::vector<int64_t> t = targets.to(Device::cpu()).to_vector<int64_t>();
      int64_t differ = 0, first = -1;
      for (size_t e = 0; e < got.size(); ++e)
        if (got[e] != want[e]) {
          if (first < 0) first = static_cast<int64_t>(e);
          ++differ;
        }
      if (differ > 0)
        ADD_FAILURE() << differ << " gradient elements differ; the first at [" << first / V << ", " << first % V
                      << "]: " << got[first] << " against " << want[first] << " (that row's target: " << t[first / V]
                      << ")";
    }
}

}  // namespace mixtape::testing
