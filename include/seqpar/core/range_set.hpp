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
    const auto by_begin = [&](std::size_t a, std::size_t b) { return ranges[a].begin < ranges[b].begin; };
    sorted_ = std::is_sorted(order_.begin(), order_.end(), by_begin);  // owned ranges and RowMaps mostly are
    if (!sorted_) std::sort(order_.begin(), order_.end(), by_begin);
  }
  /// Indices (ascending) of the non-empty ranges that overlap `r`.
  void overlapping(Range r, std::vector<std::size_t>& out) const {
    std::size_t hint = 0;
    overlapping(r, out, hint);
  }

  /// The same, starting the search at `hint` (in/out: where the last query's hits began). Callers
  /// whose queries mostly ascend (a rank's slices in token order) pay O(1) per query instead of a
  /// binary search over the whole index: a ring over a million one-token Per-Doc pieces asks ~10^7
  /// times.
  void overlapping(Range r, std::vector<std::size_t>& out, std::size_t& hint) const {
    out.clear();
    if (r.empty()) return;
    const auto& rs = *ranges_;
    // Disjoint and sorted by begin, so also sorted by end: the ranges before r are a prefix.
    const auto before = [&](std::size_t i) { return rs[i].end <= r.begin; };
    const std::size_t n = order_.size();
    std::size_t first = std::min(hint, n);
    if (first < n && before(order_[first])) {
      // Gallop forward from the hint, then search the last stride.
      std::size_t lo = first, stride = 1;
      while (lo + stride < n && before(order_[lo + stride])) lo += stride, stride *= 2;
      const auto hi = std::min(n, lo + stride);
      first = static_cast<std::size_t>(std::partition_point(order_.begin() + static_cast<std::ptrdiff_t>(lo) + 1,
                                                            order_.begin() + static_cast<std::ptrdiff_t>(hi), before) -
                                       order_.begin());
    } else if (first > 0 && !before(order_[first - 1])) {
      first = static_cast<std::size_t>(
          std::partition_point(order_.begin(), order_.begin() + static_cast<std::ptrdiff_t>(first), before) -
          order_.begin());
    }
    hint = first;
    for (std::size_t p = first; p < n && rs[order_[p]].begin < r.end; ++p) out.push_back(order_[p]);
    if (!sorted_) std::sort(out.begin(), out.end());
  }

 private:
  const std::vector<Range>* ranges_;
  std::vector<std::size_t> order_;
  bool sorted_ = true;  ///< order_ is ascending: hits come out in index order
};

}  // namespace seqpar
