// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// Algebra of ordered range lists (a rank's owned tokens, the keys a slice list reads): append with
/// coalescing, sorted union, token order, and an index of disjoint ranges for overlap queries.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "seqpar/core/range.hpp"

namespace seqpar {

/// Appends `r` to an ordered range list, skipping empty ranges and extending the last range when `r`
/// starts where it ends (the local buffer is the same either way; fewer ranges mean fewer slices).
inline void append_range(std::vector<Range>& list, Range r) {
  if (r.empty()) return;
  if (!list.empty() && list.back().end == r.begin) {
    list.back().end = r.end;
    return;
  }
  list.push_back(r);
}

/// The non-empty ranges sorted by global position: the row order of buffers that hold several owners'
/// tokens (AllToAll's head-sharded buffers, Hierarchical's ring members, AllGather's gathered KV), so
/// that a document cut across owners is one piece of the buffer and one slice for the kernel.
[[nodiscard]] inline std::vector<Range> in_token_order(std::vector<Range> v) {
  std::erase_if(v, [](const Range& r) { return r.empty(); });
  std::sort(v.begin(), v.end(), [](Range a, Range b) { return a.begin < b.begin; });
  return v;
}

/// Sorted, merged union of ranges.
[[nodiscard]] inline std::vector<Range> merge_ranges(std::vector<Range> v) {
  std::sort(v.begin(), v.end(), [](Range a, Range b) { return a.begin < b.begin; });
  std::vector<Range> out;
  for (const Range& r : v) {
    if (r.empty()) continue;
    if (!out.empty() && r.begin <= out.back().end)
      out.back().end = std::max(out.back().end, r.end);
    else
      out.push_back(r);
  }
  return out;
}

/// Finds which of a set of disjoint ranges overlap a query range, in O(log n + hits): plans with
/// thousands of pieces per rank (Per-Doc cuts at large P) made the all-pairs scans quadratic.
class DisjointRangeIndex {
 public:
  explicit DisjointRangeIndex(const std::vector<Range>& ranges) : ranges_(&ranges) {
    for (std::size_t i = 0; i < ranges.size(); ++i)
      if (!ranges[i].empty()) order_.push_back(i);
    std::sort(order_.begin(), order_.end(),
              [&](std::size_t a, std::size_t b) { return ranges[a].begin < ranges[b].begin; });
  }
  /// Indices (ascending) of the non-empty ranges that overlap `r`.
  void overlapping(Range r, std::vector<std::size_t>& out) const {
    out.clear();
    if (r.empty()) return;
    const auto& rs = *ranges_;
    // Disjoint and sorted by begin, so also sorted by end.
    auto it = std::partition_point(order_.begin(), order_.end(), [&](std::size_t i) { return rs[i].end <= r.begin; });
    for (; it != order_.end() && rs[*it].begin < r.end; ++it) out.push_back(*it);
    std::sort(out.begin(), out.end());
  }

 private:
  const std::vector<Range>* ranges_;
  std::vector<std::size_t> order_;
};

}  // namespace seqpar
