// seqpar::kokkos from an installed tree: KokkosFlash on the host execution space.
#include <seqpar/kokkos.hpp>

int main() {
  static_assert(
      seqpar::attention::AttentionKernel<seqpar::attention::KokkosFlash<Kokkos::DefaultHostExecutionSpace, double>>);
  return 0;
}
