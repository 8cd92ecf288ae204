// seqpar::nccl from an installed tree: the NCCL transport's header, NCCL's and CUDA's.
#include <seqpar/backend/nccl.hpp>

int main() {
  static_assert(seqpar::Transport<seqpar::backend::nccl::Transport>);
  return 0;
}
