#pragma once
// The process's place in an MPI job: dist::init reads it from the MPI environment (mpirun / mpiexec), once.
// A program started without mpirun is a world of one. Every rank that fails ends the whole job through
// dist::abort (MPI_Abort), so no rank is left waiting in a collective for a peer that died.
#include <string>

#include "tensor/device.h"

namespace mixtape::dist {

struct World {
  int rank = 0;
  int size = 1;
  int local_rank = 0;  // among the ranks on this machine (picks the GPU)
  int local_size = 1;
};

// Initialises MPI (thread level FUNNELED: only the thread that called init talks to MPI). Safe to call more
// than once; MPI is finalised at exit. Error when mixtape was built without MPI.
const World& init(int* argc = nullptr, char*** argv = nullptr);
bool initialized();
const World& world();  // Error before init()
// This rank's device: GPU local_rank % count when the machine has GPUs (one GPU per rank), else the CPU.
Device device();

// Prints "rank R of N: <message>" to stderr and ends every rank of the job (MPI_Abort) with `code`. MPI is
// initialised first where it is not yet, so an error found before dist::init ends the job the same way
// (MPI_Init returns once every rank has called it: every rank must come to init() or abort()); after
// MPI_Finalize only this process ends (_Exit), with R and N from the launcher's environment.
[[noreturn]] void abort(const std::string& message, int code = 1);

// Runs fn; an exception on any rank, however early, becomes dist::abort with its message (the "never hang"
// rule for programs under mpirun). Ranks other than 0 wait 2 s (after initialising MPI) before reporting
// theirs, so an error that every rank meets is printed once, by rank 0, whose abort ends the others first.
// Returns fn's result. For programs started by a launcher (mpirun): otherwise abort() makes a world of one.
int run_or_abort(int (*fn)(int, char**), int argc, char** argv);

}  // namespace mixtape::dist
