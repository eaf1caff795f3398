#pragma once
// amp/'s ProcessGroup over a Communicator: how the mixed-precision optimizer all-reduces found_inf (MAX) and
// the gradient norm and zero count (SUM) over the model-parallel group, and how NaiveAMPModel averages its
// buffers over the data-parallel group (SUM of buffers it divided by the group size first).
#include "amp/process_group.h"
#include "dist/communicator.h"

namespace mixtape::dist {

class CommunicatorGroup final : public ProcessGroup {
 public:
  explicit CommunicatorGroup(Communicator comm) : comm_(std::move(comm)) {}
  std::string name() const override { return comm_.name() + " of " + std::to_string(comm_.size()); }
  int size() const override { return comm_.size(); }
  void all_reduce_max(std::span<double> values) override { comm_.all_reduce(values, Reduction::Max); }
  void all_reduce_sum(std::span<double> values) override { comm_.all_reduce(values, Reduction::Sum); }
  void all_reduce_sum(const Tensor& tensor) override { comm_.all_reduce(tensor, Reduction::Sum); }
  const Communicator& communicator() const { return comm_; }

 private:
  Communicator comm_;
};

}  // namespace mixtape::dist
