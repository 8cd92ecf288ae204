// SPDX-License-Identifier: Apache-2.0
// The fuzz targets' shared driver: `--seconds S --seed N`, then one random case per seed (seed, seed + 1,
// ...) until the time is up. A case fails by throwing; its seed is printed so that it can be replayed,
// and `--replay A,B,...` runs exactly those seeds (the fixed regression list ctest keeps).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace seqpar::test {

struct FuzzRun {
  double seconds = 10;
  std::uint32_t seed = 0;
  std::vector<std::uint32_t> replay;  ///< exact seeds to run (then --seconds is ignored)
  long cases = 0;                     ///< cases that passed
  int status = 0;                     ///< process exit status: 0 all passed, 1 a case failed, 2 bad arguments

  /// "seeds A..B", or "replayed seeds A, B" after --replay.
  [[nodiscard]] std::string seeds() const {
    if (replay.empty())
      return "seeds " + std::to_string(seed) + ".." + std::to_string(seed + static_cast<std::uint32_t>(cases));
    std::string out = "replayed seeds";
    for (std::size_t i = 0; i < replay.size(); ++i) out += (i ? ", " : " ") + std::to_string(replay[i]);
    return out;
  }
};

namespace detail {
inline std::uint32_t parse_seed(const std::string& s) {
  std::size_t end = 0;
  unsigned long v = 0;
  try {
    v = std::stoul(s, &end);
  } catch (const std::exception&) {
    end = 0;
  }
  if (s.empty() || end != s.size() || v > 0xffffffffUL) throw std::invalid_argument("seed '" + s + "'");
  return static_cast<std::uint32_t>(v);
}
}  // namespace detail

/// Runs `one_case(rng)` with rng seeded by each seed in turn until `--seconds` have passed, or by
/// each `--replay` seed once.
template <class Case>
FuzzRun run_fuzz(int argc, char** argv, Case&& one_case) {
  FuzzRun run;
  run.seed = std::random_device{}();
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--seconds" && i + 1 < argc) {
        const std::string v = argv[++i];
        std::size_t end = 0;
        try {
          run.seconds = std::stod(v, &end);
        } catch (const std::exception&) {
          end = 0;
        }
        if (v.empty() || end != v.size() || !(run.seconds >= 0)) throw std::invalid_argument("seconds '" + v + "'");
      } else if (a == "--seed" && i + 1 < argc) {
        run.seed = detail::parse_seed(argv[++i]);
      } else if (a == "--replay" && i + 1 < argc) {
        const std::string list = argv[++i];
        for (std::size_t at = 0; at <= list.size();) {
          const std::size_t comma = std::min(list.find(',', at), list.size());
          run.replay.push_back(detail::parse_seed(list.substr(at, comma - at)));
          at = comma + 1;
        }
      } else {
        throw std::invalid_argument("argument '" + a + "'");
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: bad %s\nusage: %s [--seconds S] [--seed N] [--replay A,B,...]\n", argv[0], e.what(),
                 argv[0]);
    run.status = 2;
    return run;
  }
  const auto one = [&](std::uint32_t s) {
    std::mt19937 rng(s);
    try {
      one_case(rng);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "FAILED at seed %u: %s\n", s, e.what());
      run.status = 1;
      return false;
    }
    ++run.cases;
    return true;
  };
  if (!run.replay.empty()) {
    run.seconds = 0;
    for (const std::uint32_t s : run.replay)
      if (!one(s)) break;
    return run;
  }
  const auto stop = std::chrono::steady_clock::now() + std::chrono::duration<double>(run.seconds);
  for (std::uint32_t s = run.seed; std::chrono::steady_clock::now() <= stop; ++s)
    if (!one(s)) return run;
  return run;
}

}  // namespace seqpar::test
