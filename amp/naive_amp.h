#pragma once
// NaiveAMPModel (InternEvo's NaiveAMPModel, Colossal-AI's naive AMP): the whole model is converted to the
// low dtype, except submodules marked with set_fp32(), which keep fp32 parameters and run in fp32 (their
// float inputs are cast to fp32 and their float outputs back to the low dtype, through UnaryModule's
// forward hooks). Float inputs of the wrapped forward are cast to the low dtype; with output_to_fp32 its
// float outputs are cast back to fp32. Integer tensors (token ids) are never cast.
//
// dtype "tf32" keeps fp32 storage and turns on tf32 matmuls (set_allow_tf32(true), process-wide, as
// InternEvo sets torch.backends.cuda.matmul.allow_tf32).
//
// sync_buffer: at each forward in training mode, every floating buffer is broadcast from rank 0 of the
// process group (InternEvo syncs buffers across the data-parallel group); without a group it does nothing.
//
// Gradients: backward runs through the casts, so fp16/bf16 parameters get fp16/bf16 gradients and fp32
// (set_fp32) parameters fp32 gradients; train with MixedPrecisionOptimizer (fp32 masters).
#include <functional>
#include <string>
#include <vector>

#include "amp/process_group.h"
#include "nn/module.h"
#include "tensor/tensor.h"

namespace mixtape {

struct NaiveAMPOptions {
  std::string dtype = "fp16";  // "fp16" | "bf16" | "tf32"
  bool output_to_fp32 = true;
  bool sync_buffer = true;
  ProcessGroup* group = nullptr;  // data-parallel group for sync_buffer
  // Submodules to set_fp32 at construction, keeping their original fp32 values (set_fp32 after construction
  // converts back from the low dtype, so values the low dtype cannot hold stay rounded, as in InternEvo).
  std::vector<UnaryModule*> fp32_modules = {};
};

class NaiveAMPModel {
 public:
  // Converts `model` in place (it must outlive the wrapper). Error on an unknown dtype.
  NaiveAMPModel(Module& model, NaiveAMPOptions options = {});

  // Marks `module` (a submodule of the wrapped model, or the model itself) to keep fp32 parameters and
  // compute in fp32; Error if it is not in the model. Its parameters become new leaves: build the optimizer
  // after the set_fp32 calls. The hooks stay on the module after the wrapper is gone.
  void set_fp32(UnaryModule& module);

  // Runs `forward` on `inputs` with floating inputs cast to the low dtype, after sync_buffers(); floating
  // outputs are cast to fp32 when output_to_fp32.
  std::vector<Tensor> forward(const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& forward,
                              const std::vector<Tensor>& inputs);
  // The same for a wrapped UnaryModule (Error if the model is not one).
  Tensor operator()(const Tensor& x);

  // Broadcast of floating buffers from rank 0 when sync_buffer and a group of more than one rank are set.
  void sync_buffers();

  Module& model() { return model_; }
  DType dtype() const { return dtype_; }  // F16, BF16, or F32 for "tf32"
  const NaiveAMPOptions& options() const { return options_; }

 private:
  Module& model_;
  NaiveAMPOptions options_;
  DType dtype_;
};

}  // namespace mixtape
