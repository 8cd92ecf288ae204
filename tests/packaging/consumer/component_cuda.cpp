// seqpar::cuda from an installed tree: the host side of the CUDA path (the execution context).
#include <seqpar/gpu/exec.hpp>

int main() {
  static_assert(sizeof(seqpar::gpu::CudaExec) > 0);
  return 0;
}
