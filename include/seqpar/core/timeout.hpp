// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// The transports' default bound on one wait: 10 minutes, PyTorch's default for an NCCL process group
/// (torch.distributed.init_process_group: "10 minutes for NCCL and 30 minutes for other backends"). A
/// healthy job's first step may spend minutes before its first collective (compilation, checkpoint
/// loading, a slow data loader; 30 s, the earlier default, aborted such a job, issue 28); a rank that
/// fails is reported to its peers at once (kPeerFailed, run_or_abort), so the bound only matters for a
/// rank that is stuck or gone without a word. SEQPAR_TIMEOUT_S (seconds, > 0, may be fractional)
/// overrides it for every transport created without an explicit Options::timeout.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "seqpar/core/error.hpp"

namespace seqpar::detail {

inline constexpr std::chrono::milliseconds kDefaultTimeout{std::chrono::minutes{10}};

/// The longest wait any transport makes: 100 years, "wait forever" in practice. A longer timeout
/// (`std::chrono::milliseconds::max()`, `hours(1'000'000'000)`, a Python timeout_s of inf or 1e300) is
/// clamped to it: a deadline is `steady_clock::now() + timeout` in the clock's nanoseconds, which a timeout
/// of more than ~292 years overflows to a deadline in the past (every wait then timed out at once).
inline constexpr std::chrono::milliseconds kLongestTimeout =
    std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::years{100});

/// A transport's `timeout` as it waits: > 0 (std::invalid_argument naming `name` and its value
/// otherwise), longer ones clamped to kLongestTimeout.
[[nodiscard]] inline std::chrono::milliseconds checked_timeout(std::string_view where, std::string_view name,
                                                               std::chrono::milliseconds timeout) {
  require(timeout.count() > 0, where, name, std::to_string(timeout.count()) + " ms", "must be > 0");
  return std::min(timeout, kLongestTimeout);
}

/// A timeout given in seconds (the Python layer's timeout_s): NaN, 0 and negative values are refused
/// (std::invalid_argument naming `name` and its value); +inf and anything past kLongestTimeout (1e300)
/// wait kLongestTimeout, forever in practice; otherwise the seconds rounded up to whole milliseconds
/// (a converted inf or 1e300 was a negative int64, UB and a wait that timed out at once).
[[nodiscard]] inline std::chrono::milliseconds timeout_from_seconds(std::string_view where, std::string_view name,
                                                                    double seconds) {
  require(seconds > 0, where, name, seconds,  // NaN fails it too
          "must be a positive number of seconds (inf, or anything past 100 years, waits 100 years: no bound in "
          "practice)");
  if (!(seconds * 1000.0 < static_cast<double>(kLongestTimeout.count()))) return kLongestTimeout;
  return std::chrono::milliseconds{static_cast<std::int64_t>(std::ceil(seconds * 1000.0))};
}

/// kDefaultTimeout, or SEQPAR_TIMEOUT_S when set (std::invalid_argument naming it when malformed).
[[nodiscard]] inline std::chrono::milliseconds default_timeout() {
  const char* env = std::getenv("SEQPAR_TIMEOUT_S");  // NOLINT(concurrency-mt-unsafe): read only
  if (env == nullptr || *env == '\0') return kDefaultTimeout;
  char* end = nullptr;
  const double seconds = std::strtod(env, &end);
  require(end != env && *end == '\0' && std::isfinite(seconds) && seconds > 0 && seconds < 1e9, "seqpar",
          "SEQPAR_TIMEOUT_S", std::string(env), "must be a positive number of seconds");
  return std::chrono::milliseconds{static_cast<std::int64_t>(std::ceil(seconds * 1000.0))};
}

}  // namespace seqpar::detail
