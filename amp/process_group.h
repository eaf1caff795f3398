#pragma once
// The one thing amp/ needs from a process group: all-reduces of a few numbers, and of NaiveAMPModel's
// buffers. amp/ sits below dist/, so the interface is declared here and dist/ implements it over MPI/NCCL
// communicators (the tensor-parallel group for the norm, the model-parallel group for found_inf, as
// Megatron-LM does; the data-parallel group for the buffers). amp/ never knows which ranks are in it.
// Without a group (nullptr) every reduction is local.
#include <span>
#include <string>

#include "tensor/tensor.h"

namespace mixtape {

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  virtual std::string name() const = 0;  // for error messages ("tensor-parallel group of 4")
  virtual int size() const = 0;
  // In place, across every rank of the group; every rank must call with the same length.
  virtual void all_reduce_max(std::span<double> values) = 0;  // found_inf (0 or 1)
  virtual void all_reduce_sum(std::span<double> values) = 0;  // squared gradient norms, zero counts
  // The elementwise sum over the group, in place (NaiveAMPModel's sync_buffer averages its buffers with it,
  // as InternEvo does). `tensor` is contiguous, of the same shape and dtype on every rank.
  virtual void all_reduce_sum(const Tensor& tensor) = 0;
};

}  // namespace mixtape
