// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// Algebra of attention slices in global and local token indices: clip a slice to query and key
/// ranges, localize global slices into a buffer's rows, group slices into kernel calls (waves), and
/// find the keys a slice list reads. Every communicator builds its programs from these.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "seqpar/core/attn_slice.hpp"
#include "seqpar/core/range.hpp"
#include "seqpar/core/range_set.hpp"
#include "seqpar/core/row_map.hpp"

namespace seqpar {

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
      // Rows whose window has moved past the last key see nothing: row r's first key is
      // r + offset - window + 1, so rows r <= k.size() - 2 - offset + window keep one.
      const std::int64_t rows = k.size() - 1 - m.causal_offset + m.window;
      if (rows <= 0) return {};
      if (rows < q.size()) q.end = q.begin + rows;
    }
  }
  if (k.empty()) return {};
  return {q, k, m};
}

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
      if (!out.empty() && last == prev_nonempty && out.back().end == r.begin)
        out.back().end = r.end;
      else
        out.push_back(r);
      last = a;
    }
    prev_nonempty = a;
  }
  return out;
}

}  // namespace seqpar
