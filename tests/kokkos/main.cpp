// SPDX-License-Identifier: Apache-2.0
// Main of the Kokkos test executable: Kokkos is initialized once for the whole run (ScopeGuard) and
// finalized after every test case has returned (and destroyed its Views).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <Kokkos_Core.hpp>

int main(int argc, char** argv) {
  const Kokkos::ScopeGuard kokkos(argc, argv);
  doctest::Context context(argc, argv);
  return context.run();
}
