#pragma once
// A Communicator is one process group: collectives and point-to-point transfers on Tensors among its ranks.
// CPU tensors go over MPI. fp16/bf16 reductions run in fp32 on that path (each rank's values widened,
// reduced, rounded once), so a 16-bit all-reduce loses no more than one rounding. CUDA tensors go over NCCL
// when every rank of the group holds its own GPU (dist/nccl.h: queued on the tensor's stream; fp16/bf16
// reduced in their own type, as PyTorch does, so a 16-bit sum can differ from the MPI path's by a few ulp);
// otherwise (no NCCL in the build, ranks sharing a GPU, MIXTAPE_NCCL=0, or a group mixing CPU and CUDA
// tensors) they travel through the host (copied to CPU, reduced as above, copied back).
//
// Every rank of the group must make the same calls in the same order with tensors of the same shape and
// dtype. Each tensor collective first compares (dtype, numel) across the group in one small all-reduce, so a
// mismatch is an Error on every rank naming both sides, never a silent mix of unrelated bytes; a recv checks
// the size of what arrived. Tensors must be contiguous. The two ends of a send/recv hold tensors on the same
// kind of device: for CUDA tensors they first exchange (direction, dtype, size, tag), a mismatch being an
// Error on both; tags 32766 and 32767 are reserved.
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace mixtape::dist {

enum class Reduction { Sum, Max };

// A collective in flight (Communicator::all_reduce_start). The tensor holds the result once wait() returns (or
// test() returned true); until then it must be neither read nor written. test() moves the collective on without
// blocking and says whether it is complete: MPI advances a non-blocking collective only inside MPI calls, so a
// caller that overlaps it with work polls it between pieces of that work. Over NCCL it runs on the group's own
// stream (dist/nccl.h), overlapping the kernels queued after it; wait() then returns at once, having made the
// tensor's stream wait for it. Destroying one still in flight waits for it (errors there are lost: call wait()).
class PendingCollective {
 public:
  PendingCollective();  // nothing in flight
  PendingCollective(PendingCollective&&) noexcept;
  PendingCollective& operator=(PendingCollective&&) noexcept;
  ~PendingCollective();

  bool test();
  void wait();
  bool in_flight() const { return state_ != nullptr; }

  struct State;  // dist/communicator.cpp

 private:
  friend class Communicator;
  explicit PendingCollective(std::unique_ptr<State> state);
  void complete();  // the result into the tensor; state_ released
  std::unique_ptr<State> state_;
};

class Communicator {
 public:
  // Every rank of the job (MPI_COMM_WORLD). dist::init must have run.
  static Communicator world();

  // The group of the ranks that pass the same color, ordered by key (MPI_Comm_split); every rank of this
  // group must call it. `name` is used in error messages ("tensor-parallel group").
  Communicator split(int color, int key, std::string name) const;

  int rank() const;
  int size() const;
  const std::string& name() const;

  // In place: every rank ends with the elementwise reduction over the group.
  void all_reduce(const Tensor& tensor, Reduction op) const;
  void all_reduce(std::span<double> values, Reduction op) const;
  // Non-blocking all_reduce: returns once the collective is under way (the agreement check above still runs
  // first, blocking). Collectives of one group, blocking or not, must still be started in the same order on
  // every rank; several may be in flight at once.
  PendingCollective all_reduce_start(const Tensor& tensor, Reduction op) const;
  // Rank i's tensor becomes chunk i (along dim 0) of the result on every rank: [size * d0, ...].
  Tensor all_gather(const Tensor& tensor) const;
  // The reduction over the group of `tensor` (dim 0 divisible by size), of which this rank keeps chunk
  // rank() along dim 0.
  Tensor reduce_scatter(const Tensor& tensor, Reduction op) const;
  // Chunk j (along dim 0, divisible by size) of this rank's tensor goes to rank j, and chunk i of the result
  // came from rank i: the transpose of the [rank, chunk] grid (MPI_Alltoall). No reduction: any dtype moves as
  // its bits. CUDA tensors travel through the host.
  Tensor all_to_all(const Tensor& tensor) const;
  // Rank root's tensor replaces everyone's, in place.
  void broadcast(const Tensor& tensor, int root) const;
  // Blocking point-to-point: recv fills `tensor` (shape and dtype must match the sender's). Over NCCL the
  // transfer is queued on the tensor's stream instead (ordered with its kernels), and a send and its recv must
  // not wait on each other's other transfers in a cycle (post them in matching order on both ends).
  void send(const Tensor& tensor, int dest, int tag = 0) const;
  void recv(const Tensor& tensor, int source, int tag = 0) const;
  void barrier() const;

  // How this group moves CUDA tensors: "nccl", "host: <why>", "undecided" before its first collective on CUDA
  // tensors, or "none: ..." for a group of one rank, which never needs to decide.
  std::string cuda_transport() const;

  struct Impl;  // dist/communicator.cpp

 private:
  explicit Communicator(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

}  // namespace mixtape::dist
