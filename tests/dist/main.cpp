// The MPI test binary: run under `mpiexec -np 4 --oversubscribe` (CTest's dist_mpi4). Every rank runs every
// test; rank 0 prints. A test fails the job when it fails on any rank.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>

#include "dist/world.h"

namespace {

// On ranks other than 0: only failed assertions, each tagged with the rank and the test.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestStart(const ::testing::TestInfo& info) override { test_ = &info; }
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    const ::testing::TestInfo* test = test_;
    std::fprintf(stderr, "rank %d: %s.%s: %s:%d: %s\n", rank_, test ? test->test_suite_name() : "?",
                 test ? test->name() : "?", result.file_name() ? result.file_name() : "?", result.line_number(),
                 result.summary());
  }

 private:
  int rank_;
  const ::testing::TestInfo* test_ = nullptr;
};

}  // namespace

int main(int argc, char** argv) {
  const mixtape::dist::World& world = mixtape::dist::init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  if (world.rank != 0) {
    // Other ranks report only their failures (with their rank), not the whole log.
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(world.rank));
  }
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (failed) std::fprintf(stderr, "rank %d of %d: some tests failed on this rank\n", world.rank, world.size);
  return any_failed;
}
