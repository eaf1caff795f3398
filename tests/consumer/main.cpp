// Uses the installed headers and libraries: prints the sum of a bf16 tensor computed through mixtape, and the
// vocabulary size of a text tokenised by the training library (mixtape::training).
#include <iostream>

#include "tensor/ops.h"
#include "tensor/tensor.h"
#include "train/training.h"

int main() {
  using namespace mixtape;
  const Tensor x = Tensor::arange(0, 4, 1, DType::BF16);
  const Tensor y = Tensor::from_vector(std::vector<float>{1, 2, 3, 4}, {4}).to(DType::BF16);
  std::cout << "consumer: " << (x.to(DType::F32) + y.to(DType::F32)).to_vector<float>()[3]  // 3 + 4
            << ", vocab " << char_tokens("banana").vocab_size << "\n";                       // a, b, n
  return 0;
}
