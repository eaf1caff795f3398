// Uses the installed headers and library: prints the sum of a bf16 tensor computed through mixtape.
#include <iostream>

#include "tensor/ops.h"
#include "tensor/tensor.h"

int main() {
  using namespace mixtape;
  const Tensor x = Tensor::arange(0, 4, 1, DType::BF16);
  const Tensor y = Tensor::from_vector(std::vector<float>{1, 2, 3, 4}, {4}).to(DType::BF16);
  std::cout << "consumer: " << (x.to(DType::F32) + y.to(DType::F32)).to_vector<float>()[3] << "\n";  // 3 + 4
  return 0;
}
