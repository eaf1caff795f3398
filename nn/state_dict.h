#pragma once
// Named tensors plus string metadata: what a safetensors file holds, and what modules, optimizers and
// loss scalers save and load. Names use nanoGPT's dotted state-dict paths ("transformer.h.0.ln_1.weight").
#include <map>
#include <string>

#include "tensor/tensor.h"

namespace mixtape {

struct StateDict {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> metadata;  // scalars are stored as their decimal text
};

}  // namespace mixtape
