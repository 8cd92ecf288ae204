// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "seqpar/core/attn_slice.hpp"
#include "seqpar/core/range.hpp"

namespace seqpar::comm::detail {

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
    if (!out.empty() && r.begin <= out.back().end) out.back().end = std::max(out.back().end, r.end);
    else out.push_back(r);
  }
  return out;
}

/// The part of a global slice whose queries lie in `q` and keys in `k`, with the mask realigned to
/// the new corners, trimmed of query rows that see no key; nullopt-like empty slice when nothing is
/// visible.
[[nodiscard]] inline AttnSlice clip_slice(const AttnSlice& s, Range q, Range k) {
  q = intersect(s.q_range, q);
  k = intersect(s.k_range, k);
  if (q.empty() || k.empty()) return {};
  Mask m = s.mask;
  m.causal_offset += (q.begin - s.q_range.begin) - (k.begin - s.k_range.begin);
  if (m.kind != MaskKind::kFull) {
    // Rows qi with qi + offset < 0 see nothing: drop them.
    const std::int64_t skip = std::max<std::int64_t>(0, -m.causal_offset);
    if (skip >= q.size()) return {};
    q.begin += skip;
    m.causal_offset += skip;
    // Keys past the last row's diagonal are never visible.
    k.end = std::min(k.end, k.begin + (q.size() - 1) + m.causal_offset + 1);
    if (m.kind == MaskKind::kSlidingWindow) {
      // Keys before the first row's window are never visible.
      const std::int64_t lo = std::max<std::int64_t>(0, m.causal_offset + 1 - m.window);
      if (lo >= k.size()) return {};
      k.begin += lo;
      m.causal_offset -= lo;
    }
  }
  if (k.empty()) return {};
  return {q, k, m};
}

/// Finds which of a set of disjoint ranges overlap a query range, in O(log n + hits): plans with
/// thousands of pieces per rank (Per-Doc cuts at large P) made the all-pairs scans quadratic.
class DisjointRangeIndex {
 public:
  explicit DisjointRangeIndex(const std::vector<Range>& ranges) : ranges_(&ranges) {
    for (std::size_t i = 0; i < ranges.size(); ++i)
      if (!ranges[i].empty()) order_.push_back(i);
    std::sort(order_.begin(), order_.end(), [&](std::size_t a, std::size_t b) { return ranges[a].begin < ranges[b].begin; });
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

/// Global slices restricted to the queries of q_map and the keys of k_map, in local rows. Output order:
/// by slice, then q piece, then k piece (the order waves are formed in).
[[nodiscard]] inline std::vector<AttnSlice> localize(const std::vector<AttnSlice>& global, const RowMap& q_map,
                                                     const RowMap& k_map) {
  std::vector<AttnSlice> out;
  const DisjointRangeIndex q_index(q_map.global), k_index(k_map.global);
  std::vector<std::size_t> qs, ks;
  for (const AttnSlice& s : global) {
    q_index.overlapping(s.q_range, qs);
    if (qs.empty()) continue;
    k_index.overlapping(s.k_range, ks);
    for (std::size_t i : qs)
      for (std::size_t j : ks) {
        const AttnSlice c = clip_slice(s, q_map.global[i], k_map.global[j]);
        if (c.q_range.empty()) continue;
        out.push_back({c.q_range.shifted(q_map.local[i] - q_map.global[i].begin),
                       c.k_range.shifted(k_map.local[j] - k_map.global[j].begin), c.mask});
      }
  }
  return out;
}

/// Slices grouped into waves whose query ranges are disjoint (one kernel call each; the partial
/// results of later waves are merged). Greedy in query order: the fewest waves for interval sets.
[[nodiscard]] inline std::vector<std::vector<AttnSlice>> waves(std::vector<AttnSlice> slices) {
  std::sort(slices.begin(), slices.end(), [](const AttnSlice& a, const AttnSlice& b) {
    return a.q_range.begin != b.q_range.begin ? a.q_range.begin < b.q_range.begin : a.k_range.begin < b.k_range.begin;
  });
  std::vector<std::vector<AttnSlice>> out;
  std::vector<std::int64_t> wave_end;
  for (const AttnSlice& s : slices) {
    std::size_t w = 0;
    while (w < out.size() && wave_end[w] > s.q_range.begin) ++w;
    if (w == out.size()) out.emplace_back(), wave_end.push_back(0);
    out[w].push_back(s);
    wave_end[w] = s.q_range.end;
  }
  return out;
}

/// The global key ranges that `slices` read inside `available` (disjoint ranges): for each available
/// range in order, the sorted, merged keys read inside it. Every result lies inside one piece of
/// RowMap::concat(available): keys that run on from one available range into the next one, adjacent
/// in the list and globally, are one range (one piece to send instead of one per range).
[[nodiscard]] inline std::vector<Range> keys_needed(const std::vector<AttnSlice>& slices,
                                                    const std::vector<Range>& available) {
  std::vector<std::vector<Range>> need(available.size());
  const DisjointRangeIndex index(available);
  std::vector<std::size_t> hits;
  for (const AttnSlice& s : slices) {
    index.overlapping(s.k_range, hits);
    for (std::size_t a : hits) {
      const AttnSlice c = clip_slice(s, s.q_range, available[a]);
      if (!c.q_range.empty()) need[a].push_back(c.k_range);
    }
  }
  std::vector<Range> out;
  std::size_t last = available.size(), prev_nonempty = available.size();  // last: available range of out.back()
  for (std::size_t a = 0; a < available.size(); ++a) {
    if (available[a].empty()) continue;
    for (const Range& r : merge_ranges(std::move(need[a]))) {
      if (!out.empty() && last == prev_nonempty && out.back().end == r.begin) out.back().end = r.end;
      else out.push_back(r);
      last = a;
    }
    prev_nonempty = a;
  }
  return out;
}

}  // namespace seqpar::comm::detail
