// SPDX-License-Identifier: Apache-2.0
// The fuzz targets' shared driver: `--seconds S --seed N`, then one random case per seed (seed, seed + 1,
// ...) until the time is up. A case fails by throwing; its seed is printed so that it can be replayed.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <random>
#include <string>

namespace seqpar::test {

struct FuzzRun {
  double seconds = 10;
  std::uint32_t seed = 0;
  long cases = 0;  ///< cases that passed
  int status = 0;  ///< process exit status: 0 all passed, 1 a case failed, 2 bad arguments
};

/// Runs `one_case(rng)` with rng seeded by each seed in turn until `--seconds` have passed.
template <class Case>
FuzzRun run_fuzz(int argc, char** argv, Case&& one_case) {
  FuzzRun run;
  run.seed = std::random_device{}();
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--seconds" && i + 1 < argc)
      run.seconds = std::stod(argv[++i]);
    else if (a == "--seed" && i + 1 < argc)
      run.seed = static_cast<std::uint32_t>(std::stoul(argv[++i]));
    else {
      std::fprintf(stderr, "usage: %s [--seconds S] [--seed N]\n", argv[0]);
      run.status = 2;
      return run;
    }
  }
  const auto stop = std::chrono::steady_clock::now() + std::chrono::duration<double>(run.seconds);
  for (std::uint32_t s = run.seed; std::chrono::steady_clock::now() <= stop; ++s) {
    std::mt19937 rng(s);
    try {
      one_case(rng);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "FAILED at seed %u: %s\n", s, e.what());
      run.status = 1;
      return run;
    }
    ++run.cases;
  }
  return run;
}

}  // namespace seqpar::test
