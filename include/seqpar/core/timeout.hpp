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

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "seqpar/core/error.hpp"

namespace seqpar::detail {

inline constexpr std::chrono::milliseconds kDefaultTimeout{std::chrono::minutes{10}};

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
