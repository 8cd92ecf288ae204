// SPDX-License-Identifier: Apache-2.0
// Main of the CUDA test executables: without a usable CUDA device (no driver, no GPU) they report
// skipped to CTest (exit 77, SKIP_RETURN_CODE) instead of failing; with one they run doctest.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

#include "seqpar/gpu/check.hpp"

int main(int argc, char** argv) {
  if (seqpar::gpu::device_count() == 0) {
    std::printf("no CUDA device (or driver) on this machine: the CUDA tests are skipped\n");
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
