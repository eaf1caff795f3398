#include "dist/groups.h"

#include "tensor/error.h"

namespace mixtape::dist {

void ParallelLayout::validate(int world_size) const {
  check(tp >= 1 && pp >= 1 && dp >= 1, "dist: parallel sizes must be >= 1, got tp ", tp, ", pp ", pp, ", dp ", dp);
  check(tp * pp * dp == world_size, "dist: tp ", tp, " x pp ", pp, " x dp ", dp, " = ", tp * pp * dp,
        " ranks, but the job has ", world_size, " (mpirun -np ", tp * pp * dp, ")");
}

ParallelGroups make_groups(const ParallelLayout& layout) { return make_groups(layout, Communicator::world()); }

ParallelGroups make_groups(const ParallelLayout& layout, const Communicator& world) {
  ParallelGroups g{layout, 0, 0, 0, world, world, world, world, world, world};
  const int rank = g.world.rank();
  layout.validate(g.world.size());
  g.tp_rank = rank % layout.tp;
  g.dp_rank = (rank / layout.tp) % layout.dp;
  g.pp_rank = rank / (layout.tp * layout.dp);
  // color: what the group's members share; key: the member's position inside it.
  g.tp = g.world.split(g.dp_rank + layout.dp * g.pp_rank, g.tp_rank, "tensor-parallel group");
  g.dp = g.world.split(g.tp_rank + layout.tp * g.pp_rank, g.dp_rank, "data-parallel group");
  g.pp = g.world.split(g.tp_rank + layout.tp * g.dp_rank, g.pp_rank, "pipeline group");
  g.model_parallel = g.world.split(g.dp_rank, g.tp_rank + layout.tp * g.pp_rank, "model-parallel group");
  g.stage = g.world.split(g.pp_rank, g.tp_rank + layout.tp * g.dp_rank, "tensor- and data-parallel group of a stage");
  return g;
}

}  // namespace mixtape::dist
