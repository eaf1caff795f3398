#pragma once
// The four autograd-aware region ops of Megatron-LM's tensor parallelism, over a tensor-parallel group
// (forward / backward):
//
//   copy_to_tp_region      identity                      / all-reduce (sum) of the gradient
//   reduce_from_tp_region  all-reduce (sum)              / identity
//   scatter_to_tp_region   keep this rank's chunk of the / all-gather the gradient along the last dim
//                          last dim
//   gather_from_tp_region  all-gather along the last dim / keep this rank's chunk of the gradient
//
// Each is recorded on the tape (record_backward) when its input requires grad; the collectives run in the
// input's dtype (Communicator reduces fp16/bf16 in fp32 with one rounding). Every rank of the group must call
// the same op on a tensor of the same shape and dtype (the Communicator checks dtype and size). With a group of
// one rank every op is the identity (no communication).
//
// Chunks along the last dim are contiguous: rank r holds elements [r * n/tp, (r+1) * n/tp) of a size-n dim.
#include "dist/communicator.h"
#include "tensor/tensor.h"

namespace mixtape::dist {

Tensor copy_to_tp_region(const Tensor& x, const Communicator& tp);
Tensor reduce_from_tp_region(const Tensor& x, const Communicator& tp);
// Error unless x's last dim is divisible by the group size.
Tensor scatter_to_tp_region(const Tensor& x, const Communicator& tp);
Tensor gather_from_tp_region(const Tensor& x, const Communicator& tp);

// Not recorded on the tape (plain collectives on data): every rank's x [..., k] side by side along the last
// dim in rank order -> [..., tp * k]; and this rank's chunk of the last dim (a contiguous copy).
Tensor all_gather_last_dim(const Tensor& x, const Communicator& tp);
Tensor chunk_last_dim(const Tensor& x, const Communicator& tp, const char* op);

}  // namespace mixtape::dist
