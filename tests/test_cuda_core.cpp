// The CUDA backend's core: device discovery and its errors, copies between host and GPU, the caching
// allocator's statistics, and training on a GPU against the CPU. The no-GPU tests run everywhere; the GPU
// tests skip with a visible message where there is none.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "cuda_test_util.h"
#include "train/training.h"
#include "io/safetensors.h"
#include "tensor/backend.h"
#include "tensor/ops.h"
#include "tensor/timer.h"
#include "test_util.h"

using namespace mixtape;
using mixtape::testing::cuda0;

namespace {

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Device, ParseNamesCpuCudaAndCudaN) {
  EXPECT_EQ(Device::parse("cpu"), Device::cpu());
  EXPECT_ERROR_MENTIONS(Device::parse("gpu"), "'gpu' is not a device (expected cpu, cuda or cuda:N)");
  EXPECT_ERROR_MENTIONS(Device::parse("cuda:x"), "'cuda:x' is not a device");
  EXPECT_ERROR_MENTIONS(Device::parse("cuda:"), "'cuda:' is not a device");
}

TEST(Device, NoGpuGivesAClearErrorAndTheCpuKeepsWorking) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "this machine has a GPU: the no-GPU path is not testable here";
  const std::string message = error_of([] { (void)Device::cuda(0); });
  ASSERT_FALSE(message.empty());
  EXPECT_NE(message.find("Device::cuda(0)"), std::string::npos) << message;
  // Either the build has no CUDA, or the machine has no GPU/driver: both say so.
  EXPECT_TRUE(message.find("no CUDA backend") != std::string::npos ||
              message.find("no usable GPU") != std::string::npos ||
              message.find("no CUDA GPU") != std::string::npos)
      << message;
  EXPECT_ERROR_MENTIONS(Device::parse("cuda:1"), "Device::cuda(1)");
  // The CPU path is untouched by the failed probe.
  const Tensor a = Tensor::from_vector(std::vector<float>{1, 2, 3}, {3});
  EXPECT_EQ((a * a).to_vector<float>(), (std::vector<float>{1, 4, 9}));
  EXPECT_EQ(memory_stats(Device::cpu()).allocated_bytes > 0, true);
}

TEST(CudaCore, DeviceIndexOutOfRangeNamesTheCount) {
  MIXTAPE_REQUIRE_CUDA();
  const int count = cuda_device_count();
  EXPECT_ERROR_MENTIONS(Device::cuda(count), "CUDA GPU(s)");
  EXPECT_ERROR_MENTIONS(Device::cuda(-1), "Device::cuda(-1)");
}

TEST(CudaCore, CopiesToTheGpuAndBackAreBitExactInEveryDtype) {
  MIXTAPE_REQUIRE_CUDA();
  for (DType dtype : {DType::F32, DType::F16, DType::BF16, DType::F64}) {
    const Tensor x = Tensor::randn({5, 7}, 11, dtype);
    const Tensor back = x.to(cuda0()).to(Device::cpu());
    EXPECT_EQ(back.dtype(), dtype);
    EXPECT_EQ(back.to_vector<double>(), x.to_vector<double>()) << dtype_name(dtype);
    // A strided (transposed) source arrives with its logical layout.
    EXPECT_EQ(x.mT().to(cuda0()).to_vector<double>(), x.mT().contiguous().to_vector<double>());
  }
  const Tensor ids = Tensor::from_vector(std::vector<int64_t>{3, -1, 7}, {3});
  EXPECT_EQ(ids.to(cuda0()).to_vector<int64_t>(), (std::vector<int64_t>{3, -1, 7}));
  // copy_ across devices converts on the destination.
  Tensor dst = Tensor::zeros({3}, DType::F16, cuda0());
  dst.copy_(Tensor::from_vector(std::vector<float>{1, 2.5f, -3}, {3}));
  EXPECT_EQ(dst.to_vector<float>(), (std::vector<float>{1, 2.5f, -3}));
}

TEST(CudaCore, GradientsFlowBackAcrossDevices) {
  MIXTAPE_REQUIRE_CUDA();
  const Tensor x = Tensor::from_vector(std::vector<float>{1, 2, 3}, {3}).requires_grad_();
  const Tensor y = sum(x.to(cuda0()) * x.to(cuda0()));
  backward(y);
  ASSERT_TRUE(x.grad().defined());
  EXPECT_TRUE(x.grad().device().is_cpu());
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{2, 4, 6}));
}

TEST(CudaCore, TheAllocatorReusesFreedBlocksAndReportsPeak) {
  MIXTAPE_REQUIRE_CUDA();
  const Device gpu = cuda0();
  synchronize(gpu);
  const MemoryStats before = memory_stats(gpu);
  {
    const Tensor a = Tensor::empty({1 << 20}, DType::F32, gpu);  // 4 MiB
    const MemoryStats during = memory_stats(gpu);
    EXPECT_GE(during.allocated_bytes, before.allocated_bytes + (size_t{4} << 20));
    EXPECT_GE(during.peak_allocated_bytes, during.allocated_bytes);
  }
  const MemoryStats after = memory_stats(gpu);
  EXPECT_EQ(after.allocated_bytes, before.allocated_bytes);
  EXPECT_GE(after.cached_bytes, size_t{4} << 20);  // kept for reuse, not freed
  const Tensor again = Tensor::empty({1 << 20}, DType::F32, gpu);
  EXPECT_EQ(memory_stats(gpu).cached_bytes, after.cached_bytes - (size_t{4} << 20));  // the same block
}

TEST(CudaCore, BadDeviceIndicesAndTargetsAreErrorsNotReads) {
  MIXTAPE_REQUIRE_CUDA();
  const Tensor weight = Tensor::randn({4, 3}, 1, DType::F32, cuda0());
  const Tensor ids = Tensor::from_vector(std::vector<int64_t>{0, 9}, {2}).to(cuda0());
  EXPECT_ERROR_MENTIONS(embedding(weight, ids), "index 9 (at position 1) is out of range");
  const Tensor logits = Tensor::randn({2, 4}, 2, DType::F32, cuda0());
  EXPECT_ERROR_MENTIONS(softmax_cross_entropy(logits, ids), "target 9 at row 1 is out of range");
}

TEST(CudaCore, TimerMeasuresDeviceTime) {
  MIXTAPE_REQUIRE_CUDA();
  DeviceTimer timer(cuda0());
  const Tensor a = Tensor::randn({512, 512}, 3, DType::F32, cuda0());
  timer.start();
  const Tensor c = matmul(a, a);
  timer.stop();
  const double seconds = timer.seconds();
  EXPECT_GT(seconds, 0);
  EXPECT_LT(seconds, 10);
}

// The check: the same training on the GPU follows the CPU's loss curve (fp32, 50 steps, 1e-3).
TEST(CudaCore, TrainingOnTheGpuFollowsTheCpuLossCurve) {
  MIXTAPE_REQUIRE_CUDA();
  std::string text;
  const char* words[] = {"the ", "cat ", "sat ", "on ", "a ", "mat.\n", "dog ", "ran "};
  uint64_t state = 12345;
  for (int i = 0; i < 3000; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    text += words[(state >> 33) % 8];
  }
  const TokenData data = char_tokens(text);
  GPTConfig config;
  config.n_layer = 2;
  config.n_head = 2;
  config.n_embd = 32;
  config.block_size = 16;
  config.vocab_size = data.vocab_size;
  TrainOptions options;
  options.batch = 8;
  options.steps = 50;
  options.lr = 3e-3;
  Trainer cpu(config, options, data);
  options.device = cuda0();
  Trainer gpu(config, options, data);
  for (int step = 0; step < 50; ++step) {
    const double expected = cpu.train_step().loss;
    const double got = gpu.train_step().loss;
    EXPECT_NEAR(got, expected, 1e-3 * std::abs(expected)) << "step " << step;
  }
  // A checkpoint written from the GPU loads on the CPU trainer and evaluates alike.
  const StateDict saved = gpu.checkpoint();
  TrainOptions on_cpu = options;
  on_cpu.device = Device::cpu();
  Trainer resumed(config, on_cpu, data);
  resumed.load_checkpoint(saved);
  EXPECT_NEAR(resumed.evaluate(), gpu.evaluate(), 1e-4);
}

TEST(CudaCore, AWarmTrainingLoopAllocatesNothingNew) {
  MIXTAPE_REQUIRE_CUDA();
  const TokenData data = char_tokens(std::string(4000, 'a') + "bcdefgh");
  GPTConfig config;
  config.n_layer = 1;
  config.n_head = 2;
  config.n_embd = 32;
  config.block_size = 16;
  config.vocab_size = data.vocab_size;
  TrainOptions options;
  options.batch = 4;
  options.steps = 20;
  options.device = cuda0();
  options.amp = AmpConfig::parse("bf16");
  Trainer trainer(config, options, data);
  for (int i = 0; i < 3; ++i) trainer.train_step();
  const MemoryStats warm = memory_stats(cuda0());
  for (int i = 0; i < 5; ++i) trainer.train_step();
  const MemoryStats later = memory_stats(cuda0());
  // Reserved bytes (live + cached) stay put: every block the loop needs is in the cache.
  EXPECT_EQ(later.allocated_bytes + later.cached_bytes, warm.allocated_bytes + warm.cached_bytes);
}
