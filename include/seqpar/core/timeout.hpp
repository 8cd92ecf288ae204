// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// The transports' default bound on one wait. 30 s: long enough for a peer still finishing a large
/// kernel call or a data-loading hiccup, short enough that a dead or stuck rank stops a training job
/// in seconds rather than minutes. The environment variable SEQPAR_TIMEOUT_S (seconds, > 0, may be
/// fractional) overrides it for every transport created without an explicit Options::timeout.

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "seqpar/core/error.hpp"

namespace seqpar::detail {

inline constexpr std::chrono::milliseconds kDefaultTimeout{std::chrono::seconds{30}};

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
