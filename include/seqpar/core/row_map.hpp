// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "seqpar/core/range.hpp"

namespace seqpar {

/// Where global tokens sit in a local buffer: the buffer holds `global[i]` at rows starting at
/// `local[i]`, in order (a rank's owned ranges, or the KV pieces a ring step received).
struct RowMap {
  std::vector<Range> global;
  std::vector<std::int64_t> local;
  std::int64_t rows = 0;

  /// Buffer made of `ranges` back to back.
  /// Pieces adjacent both globally and locally are coalesced, so a document never splits needlessly.
  [[nodiscard]] static RowMap concat(const std::vector<Range>& ranges) {
    RowMap m;
    for (const Range& r : ranges) {
      if (r.empty()) continue;
      if (!m.global.empty() && m.global.back().end == r.begin) {
        m.global.back().end = r.end;
        m.rows += r.size();
        continue;
      }
      m.global.push_back(r);
      m.local.push_back(m.rows);
      m.rows += r.size();
    }
    return m;
  }
  /// Local rows of a global range that lies inside one piece of the map. `hint` (in/out) is the piece
  /// to try first and, on return, the piece that held it: callers walking ranges in buffer order pay
  /// O(1) per range instead of a scan of the map (kv_pieces over thousands of Per-Doc pieces).
  [[nodiscard]] Range to_local(Range g, std::size_t& hint) const {
    const std::size_t n = global.size();
    for (std::size_t step = 0; step < n; ++step) {
      const std::size_t i = (hint + step) % n;
      if (g.begin >= global[i].begin && g.end <= global[i].end) {
        hint = i;
        return g.shifted(local[i] - global[i].begin);
      }
    }
    return {0, 0};
  }
  [[nodiscard]] Range to_local(Range g) const {
    std::size_t hint = 0;
    return to_local(g, hint);
  }
  /// to_local for a map whose pieces are sorted by global position (concat of sorted ranges): the
  /// piece holding g is the last one starting at or before it, found by binary search.
  [[nodiscard]] Range to_local_sorted(Range g) const {
    const auto it = std::upper_bound(global.begin(), global.end(), g.begin,
                                     [](std::int64_t b, const Range& piece) { return b < piece.begin; });
    if (it == global.begin()) return {0, 0};
    const auto i = static_cast<std::size_t>(it - global.begin()) - 1;
    if (g.end > global[i].end) return {0, 0};
    return g.shifted(local[i] - global[i].begin);
  }
};

}  // namespace seqpar
