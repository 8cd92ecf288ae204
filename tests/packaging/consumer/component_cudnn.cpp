// seqpar::cudnn from an installed tree: cuDNN's SDPA behind the kernel protocol (declaration).
#include <seqpar/gpu/cudnn_sdpa.hpp>

int main() {
  static_assert(sizeof(seqpar::attention::CudnnSdpa<__half>) > 0);
  return 0;
}
