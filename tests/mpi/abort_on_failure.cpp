// SPDX-License-Identifier: Apache-2.0
// Rank 1 throws inside run_or_abort while rank 0 waits for it: the job must end (non-zero exit)
// with "seqpar: rank 1 failed: ..." on stderr instead of rank 0 hanging. Run by
// tests/mpi/expect_abort.cmake, which checks both.
#include <seqpar/backend/mpi.hpp>

#include <cstddef>
#include <stdexcept>
#include <vector>

int main(int argc, char** argv) {
  seqpar::backend::mpi::Environment env(argc, argv);
  return seqpar::backend::mpi::run_or_abort(MPI_COMM_WORLD, [](seqpar::backend::mpi::Transport& t) {
    std::vector<std::byte> b(16);
    if (t.rank() == 1) throw std::runtime_error("injected failure mid-run");
    t.recv(b, 1, 0);  // never satisfied: rank 1 failed; MPI_Abort ends this rank
    return 0;
  });
}
