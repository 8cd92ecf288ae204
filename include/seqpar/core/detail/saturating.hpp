// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// Saturating int64 addition and subtraction for window arithmetic. A sliding window may be as long as
/// INT64_MAX (a "no window" sentinel, or a window longer than any document): the bound of a row's window,
/// `row + offset + 1 - window` or `key + window - offset - 1`, then leaves the int64 range, and a wrapped
/// bound turned such a mask into one that sees nothing (issue 40). Saturated, the bound only lies further
/// outside [0, keys) than any clamp that follows it can tell apart, which is exact. constexpr, so that
/// device code compiled with --expt-relaxed-constexpr calls the same functions.

#include <cstdint>
#include <limits>

namespace seqpar::detail {

/// a + b, clamped to [INT64_MIN, INT64_MAX] instead of overflowing.
[[nodiscard]] constexpr std::int64_t add_sat(std::int64_t a, std::int64_t b) noexcept {
  if (b > 0 && a > std::numeric_limits<std::int64_t>::max() - b) return std::numeric_limits<std::int64_t>::max();
  if (b < 0 && a < std::numeric_limits<std::int64_t>::min() - b) return std::numeric_limits<std::int64_t>::min();
  return a + b;
}

/// a - b, clamped to [INT64_MIN, INT64_MAX] instead of overflowing.
[[nodiscard]] constexpr std::int64_t sub_sat(std::int64_t a, std::int64_t b) noexcept {
  if (b < 0 && a > std::numeric_limits<std::int64_t>::max() + b) return std::numeric_limits<std::int64_t>::max();
  if (b > 0 && a < std::numeric_limits<std::int64_t>::min() + b) return std::numeric_limits<std::int64_t>::min();
  return a - b;
}

}  // namespace seqpar::detail
