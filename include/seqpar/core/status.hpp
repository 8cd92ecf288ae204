// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <string>
#include <utility>

namespace seqpar {

/// Result of a `can_implement` query: ok, or the reason a combination cannot work.
struct Status {
  bool ok = true;
  std::string reason;
  [[nodiscard]] static Status success() { return {}; }
  [[nodiscard]] static Status refuse(std::string why) { return {false, std::move(why)}; }
  explicit operator bool() const noexcept { return ok; }
};

}  // namespace seqpar
