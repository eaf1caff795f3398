#pragma once
// Finite-difference gradient check in f64: the reference every op's backward is tested against.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace mixtape {

struct GradcheckOptions {
  double eps = 1e-6;  // central-difference step
  double atol = 1e-6;
  double rtol = 1e-4;
  uint64_t seed = 1234;  // for the random projection of the output
};

struct GradcheckResult {
  bool ok = true;
  double max_abs_error = 0;
  std::string message;  // the worst mismatches, naming input and element
};

// Checks the gradients of f at `inputs`: floating inputs are copied to f64 leaves that require grad
// (integer inputs are passed through). The output y is projected on a fixed random r, and for every input
// element the backward of <r, y> is compared with the central difference (<r,f(x+e)> - <r,f(x-e)>) / 2e.
GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                          const std::vector<Tensor>& inputs, const GradcheckOptions& options = {});

}  // namespace mixtape
