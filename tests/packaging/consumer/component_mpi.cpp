// seqpar::mpi from an installed tree: the MPI transport's header and MPI's own.
#include <seqpar/backend/mpi.hpp>

int main() {
  static_assert(seqpar::Transport<seqpar::backend::mpi::Transport>);
  return 0;
}
