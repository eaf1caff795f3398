// Uses the installed headers and libraries: prints the sum of a bf16 tensor computed through mixtape, the
// vocabulary size of a text tokenised by the training library (mixtape::training), and the signature of a PNG
// file it encodes (through cairo, which a static mixtape::training brings to the link).
#include <iostream>

#include "tensor/ops.h"
#include "tensor/tensor.h"
#include "train/plot.h"
#include "train/training.h"

int main() {
  using namespace mixtape;
  const Tensor x = Tensor::arange(0, 4, 1, DType::BF16);
  const Tensor y = Tensor::from_vector(std::vector<float>{1, 2, 3, 4}, {4}).to(DType::BF16);
  std::cout << "consumer: " << (x.to(DType::F32) + y.to(DType::F32)).to_vector<float>()[3]  // 3 + 4
            << ", vocab " << char_tokens("banana").vocab_size                                 // a, b, n
            << ", " << plot::encode_png(plot::Image(2, 2, plot::Rgb{})).substr(1, 3) << "\n";  // "PNG"
  return 0;
}
