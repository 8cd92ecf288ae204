// SPDX-License-Identifier: Apache-2.0
// doctest main for the MPI tests: every rank initializes MPI, runs the same test cases, and the
// process exit code is non-zero on every rank if a CHECK failed on any rank (MPI_Allreduce of the
// failure counts), so mpirun reports the failure whichever rank saw it. Only rank 0 prints the
// summary unless SEQPAR_MPI_TEST_VERBOSE is set; failures print on the rank they happen.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <seqpar/backend/mpi.hpp>

#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
  seqpar::backend::mpi::Environment env(argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  doctest::Context context;
  context.applyCommandLine(argc, argv);
  if (rank != 0 && std::getenv("SEQPAR_MPI_TEST_VERBOSE") == nullptr) {
    context.setOption("minimal", true);
    context.setOption("no-colors", true);
  }
  const int result = context.run();
  if (context.shouldExit()) return result;
  int failed = result != 0 ? 1 : 0, any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (any != 0 && rank == 0) std::fprintf(stderr, "seqpar_tests_mpi: a test failed on at least one rank\n");
  return any != 0 ? 1 : 0;
}
