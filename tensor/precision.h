#pragma once
// Process-wide numerics switches of the backends, like PyTorch's torch.backends.cuda.matmul.allow_tf32.
//
// allow_tf32: f32 matmuls (and linear) round their inputs to tf32 (10 mantissa bits, round to nearest even)
// and accumulate in f32, as NVIDIA tensor cores do in TF32 mode. The CPU backend does exactly that rounding
// too, so tf32's numerics can be studied on any machine; a CUDA backend maps it to cuBLAS's TF32 compute
// type. Off by default (PyTorch's default for matmuls since 1.12). Applies to the forward and the backward
// matmuls alike; f16/bf16/f64 matmuls and the fused attention kernels are not affected.
//
// This is the one piece of global (not thread-local) mutable state besides the backend registry: like
// PyTorch's flag, it describes the process's choice of hardware mode, and it is read once per matmul.
#include <atomic>

namespace mixtape {

void set_allow_tf32(bool allow);
bool allow_tf32();

// Sets allow_tf32 for a scope and restores the previous value.
class AllowTf32Guard {
 public:
  explicit AllowTf32Guard(bool allow) : previous_(allow_tf32()) { set_allow_tf32(allow); }
  ~AllowTf32Guard() { set_allow_tf32(previous_); }
  AllowTf32Guard(const AllowTf32Guard&) = delete;
  AllowTf32Guard& operator=(const AllowTf32Guard&) = delete;

 private:
  bool previous_;
};

}  // namespace mixtape
