// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <cstdint>
#include <ostream>

namespace seqpar {

/// Half-open index range [begin, end) over tokens (or heads).
struct Range {
  std::int64_t begin = 0;
  std::int64_t end = 0;

  [[nodiscard]] constexpr std::int64_t size() const noexcept { return end - begin; }
  [[nodiscard]] constexpr bool empty() const noexcept { return end <= begin; }
  [[nodiscard]] constexpr bool contains(std::int64_t i) const noexcept { return i >= begin && i < end; }
  [[nodiscard]] constexpr Range shifted(std::int64_t by) const noexcept { return {begin + by, end + by}; }
  friend constexpr bool operator==(const Range&, const Range&) = default;
};

[[nodiscard]] constexpr Range intersect(Range a, Range b) noexcept {
  const std::int64_t lo = std::max(a.begin, b.begin);
  const std::int64_t hi = std::min(a.end, b.end);
  return hi > lo ? Range{lo, hi} : Range{lo, lo};
}

inline std::ostream& operator<<(std::ostream& os, const Range& r) {
  return os << '[' << r.begin << ", " << r.end << ')';
}

}  // namespace seqpar
