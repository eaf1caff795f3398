#pragma once
// NCCL for CUDA tensors: what dist/communicator.cpp runs when a group's tensors are on GPUs. This header has
// no NCCL, CUDA or MPI types in it; the Communicator creates the NCCL communicators (the unique id travels
// over the group's MPI communicator) and decides, for all ranks of a group at once, whether CUDA tensors go
// over NCCL or through the host over MPI:
// - NCCL when mixtape was built with it (MIXTAPE_WITH_NCCL: CUDA + MPI + nccl.h/libnccl found), every rank
//   of the group holds a different GPU, and MIXTAPE_NCCL is not "0" on any rank;
// - the host path otherwise. NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so a job with more
//   ranks than GPUs on a machine (the 4-rank tests on a one-GPU machine) keeps the host path.
//
// Numerics: NCCL reduces fp16/bf16 in their own type (as PyTorch does), step by step along its ring or tree,
// so a 16-bit sum over n ranks can differ from the host path's (widened to fp32, rounded once) by a few ulp.
// fp32/fp64/int32/int64 sums may differ from MPI's in the order of the additions (NCCL's is fixed for a given
// group and size).
//
// Collectives and transfers run on the tensor's CUDA backend stream (cuda::backend(index).stream()), so they
// are ordered with the kernels that produce and consume the tensors, and return before the data has moved
// (reading the tensor on the host synchronizes, as for any kernel's output). The non-blocking all-reduce
// (Communicator::all_reduce_start) runs on the communicator's own stream instead, after the work queued on the
// backend stream so far, so kernels queued after it overlap with it; wait_event() then makes the backend stream
// wait for it. Every other operation on the same communicator first makes the backend stream wait for the
// communicator's stream, so the two never run one communicator's operations out of order.
#include <array>
#include <string>

#include "dist/communicator.h"
#include "tensor/tensor.h"

namespace mixtape::dist::nccl {

// Whether this build has NCCL (MIXTAPE_WITH_NCCL).
bool built();
// The linked library's version ("2.28.9"), or "none".
std::string version();

// Testing aid: while on, a Communicator of one rank also runs its CUDA collectives through NCCL (a one-rank
// NCCL communicator), so a machine with one GPU exercises the NCCL calls. Off by default (one rank needs no
// communication). Every rank must set it alike. No effect without NCCL.
void set_single_rank_groups(bool enabled);
bool single_rank_groups();

constexpr size_t kUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
using UniqueId = std::array<char, kUniqueIdBytes>;
UniqueId unique_id();  // ncclGetUniqueId

// "host/pci-bus-id" of a CUDA device: two ranks with the same identity share a GPU.
std::string gpu_identity(int device);

// One ncclComm_t on one device. Created by every rank of the group at once (ncclCommInitRank blocks until
// all have joined). Destroyed when the owner is, or at exit (whichever comes first): the device's stream is
// waited for, then ncclCommAbort frees the local resources without waiting for the peers (ncclCommDestroy
// would wait until every rank destroys theirs, which hangs when ranks drop groups in different orders).
class Comm {
 public:
  // `label` names the group in error messages ("tensor-parallel group (rank 1 of 2)").
  Comm(const UniqueId& id, int nranks, int rank, int device, std::string label);
  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  int device() const { return device_; }

  // All tensors contiguous, on this communicator's device, of the same dtype; sizes as for Communicator.
  void all_reduce(const Tensor& tensor, Reduction op);              // in place
  void all_gather(const Tensor& input, const Tensor& output);       // output: nranks * input.numel()
  void reduce_scatter(const Tensor& input, const Tensor& output, Reduction op);  // output: input / nranks
  void broadcast(const Tensor& tensor, int root);                   // in place
  void send(const Tensor& tensor, int peer);
  void recv(const Tensor& tensor, int peer);
  // In place, on this communicator's stream (see above). Returns the event (a cudaEvent_t) that marks its end:
  // hand it to event_done (poll) and then to wait_event, exactly once.
  void* all_reduce_async(const Tensor& tensor, Reduction op);
  // Whether the event's work has finished (cudaEventQuery), without waiting.
  static bool event_done(void* event, int device);
  // The device's backend stream waits for the event (kernels queued after it see the result); frees the event.
  static void wait_event(void* event, int device);

  void release();  // waits for the stream, aborts the communicator; idempotent

 private:
  void check_tensor(const Tensor& t, const char* op) const;
  void after_async();  // the backend stream waits for the communicator's stream (if it was used since)

  void* comm_ = nullptr;  // ncclComm_t
  void* side_ = nullptr;  // cudaStream_t of all_reduce_async, made at its first use
  bool side_busy_ = false;  // work was queued on side_ since the backend stream last waited for it
  int device_ = -1;
  std::string label_;
};

}  // namespace mixtape::dist::nccl
