#pragma once
// The tp x pp x dp grid of Megatron-LM: every rank belongs to one tensor-parallel group, one pipeline group
// and one data-parallel group, plus the model-parallel group (tp x pp: the ranks that hold one replica of the
// model between them, over which AMP agrees on found_inf and sums the gradient norm).
//
//   rank = tp_rank + tp * (dp_rank + dp * pp_rank)
//
// so tensor-parallel ranks are adjacent (on one machine: they talk the most), data-parallel ranks next, and
// pipeline stages outermost.
#include "dist/communicator.h"

namespace mixtape::dist {

struct ParallelLayout {
  int tp = 1, pp = 1, dp = 1;
  // Error naming the sizes unless each is >= 1 and tp * pp * dp == world_size.
  void validate(int world_size) const;
};

struct ParallelGroups {
  ParallelLayout layout;
  int tp_rank = 0, pp_rank = 0, dp_rank = 0;
  Communicator world, tp, pp, dp, model_parallel;
  // The tp x dp ranks of this rank's pipeline stage: every process that holds a part or a copy of its layers
  // (the fp8 modes reduce their tensorwise amaxes over it).
  Communicator stage;
};

// Splits the world into the layout's groups; every rank must call it with the same layout. `world` is the job
// (Communicator::world() by default; tests run several jobs side by side in sub-groups of the MPI world).
ParallelGroups make_groups(const ParallelLayout& layout);
ParallelGroups make_groups(const ParallelLayout& layout, const Communicator& world);

}  // namespace mixtape::dist
