#pragma once
// NaiveAMPModel (InternEvo's NaiveAMPModel, Colossal-AI's naive AMP): the whole model is converted to the
// low dtype, except submodules marked with set_fp32(), which keep fp32 parameters and run in fp32 (their
// float inputs are cast to fp32 and their float outputs back to the low dtype, through UnaryModule's
// forward hooks). At the boundary of the wrapped forward, as InternEvo's _convert_to_fp16/_convert_to_fp32:
// fp32 inputs are cast to the low dtype, and with output_to_fp32 fp16/bf16 outputs are widened to fp32; other
// dtypes pass untouched both ways (f64 stays f64, integer token ids are never cast).
//
// dtype "tf32" keeps fp32 storage and turns on tf32 matmuls (set_allow_tf32(true), process-wide, as
// InternEvo sets torch.backends.cuda.matmul.allow_tf32).
//
// sync_buffer (InternEvo's _reduce_module_buffer): every floating buffer is averaged over the process group
// (the data-parallel group): divided by the group size, summed over the group, in fp32 for fp16/bf16 buffers
// and rounded once on the way back. It runs before each forward in training mode and before the first
// forward in eval mode after a training-mode forward (the buffers a training forward updated, such as running
// statistics, agree before evaluation; InternEvo's _first_eval_run). The transition is detected at forward,
// from the mode the model was in at the previous forward, so model().eval() / train() called directly work
// as well; a model whose first forward is in eval mode is synced then too. Without a group, or with a group
// of one, it does nothing.
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

// A floating tensor (f64 included) in `dtype` through a recorded cast, so gradients flow back in the original
// dtype; undefined and integer tensors (token ids, targets) pass through untouched. The fp32 islands' hooks
// and Booster's Apex casts (Apex's to_type) use it.
Tensor cast_floating(const Tensor& t, DType dtype);

struct NaiveAMPOptions {
  std::string dtype = "fp16";  // "fp16" (or "float16") | "bf16" (or "bfloat16") | "tf32"
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
  // compute in fp32; Error if it is not in the model, or once the wrapper is sealed. Its parameters become
  // new leaves: build the optimizer after the set_fp32 calls. The hooks stay on the module after the wrapper
  // is gone.
  void set_fp32(UnaryModule& module);
  // The parameters now belong to an optimizer (Booster.boost seals its wrapper): set_fp32 from here on would
  // make leaves the optimizer does not hold, silently freezing the module, so it is an Error instead.
  void seal() { sealed_ = true; }
  bool sealed() const { return sealed_; }

  // Runs `forward` on `inputs` with fp32 inputs cast to the low dtype, after sync_buffers() when training
  // (or at the first eval-mode forward after training: such a forward is a collective over the group, which
  // every rank runs); fp16/bf16 outputs are widened to fp32 when output_to_fp32.
  std::vector<Tensor> forward(const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& forward,
                              const std::vector<Tensor>& inputs);
  // The same for a wrapped UnaryModule (Error if the model is not one).
  Tensor operator()(const Tensor& x);

  // The average over the group of every floating buffer, when sync_buffer and a group of more than one rank
  // are set (every rank of the group must call it).
  void sync_buffers();

  Module& model() { return model_; }
  DType dtype() const { return dtype_; }  // F16, BF16, or F32 for "tf32"
  const NaiveAMPOptions& options() const { return options_; }

 private:
  Module& model_;
  NaiveAMPOptions options_;
  DType dtype_;
  bool sealed_ = false;
  bool last_forward_training_ = true;  // the model's mode at the previous forward (as if training before any)
};

}  // namespace mixtape
