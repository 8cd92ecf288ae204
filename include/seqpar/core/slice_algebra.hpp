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
#include <utility>
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
      const std::int64_t lo = std::max<std::int64_t>(0, detail::sub_sat(m.causal_offset + 1, m.window));
      if (lo >= k.size()) return {};
      k.begin += lo;
      m.causal_offset -= lo;
      // Rows whose window has moved past the last key see nothing: row r's first key is
      // r + offset - window + 1, so rows r <= k.size() - 2 - offset + window keep one.
      const std::int64_t rows = detail::add_sat(k.size() - 1 - m.causal_offset, m.window);  // INT64_MAX: every row
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
  if (q_map.global.empty() || k_map.global.empty()) return out;  // e.g. a ring step that received nothing
  const DisjointRangeIndex q_index(q_map.global), k_index(k_map.global);
  std::vector<std::size_t> qs, ks;
  std::size_t q_hint = 0, k_hint = 0;
  for (const AttnSlice& s : global) {
    q_index.overlapping(s.q_range, qs, q_hint);
    if (qs.empty()) continue;
    k_index.overlapping(s.k_range, ks, k_hint);
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
/// Diagonal slices that continue one another in query order are merged first (append_slice): the
/// same visible pairs in fewer, longer slices (one-token documents cost one kernel row each, not one
/// slice each).
[[nodiscard]] inline std::vector<std::vector<AttnSlice>> waves(std::vector<AttnSlice> slices) {
  const auto by_rows = [](const AttnSlice& a, const AttnSlice& b) {
    return a.q_range.begin != b.q_range.begin ? a.q_range.begin < b.q_range.begin : a.k_range.begin < b.k_range.begin;
  };
  if (!std::is_sorted(slices.begin(), slices.end(), by_rows)) std::sort(slices.begin(), slices.end(), by_rows);
  std::vector<AttnSlice> merged;
  merged.reserve(slices.size());
  for (const AttnSlice& s : slices) append_slice(merged, s);
  std::vector<std::vector<AttnSlice>> out;
  std::vector<std::int64_t> wave_end;
  for (const AttnSlice& s : merged) {
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
  // One flat (available range, keys read inside it) entry per hit: a list per available range cost
  // every call O(available) allocations, and a ring over a million Per-Doc pieces asks ~100 times per
  // rank, mostly for ranges nobody reads.
  std::vector<std::pair<std::size_t, Range>> need;
  const DisjointRangeIndex index(available);
  std::vector<std::size_t> hits;
  std::size_t hint = 0;
  for (const AttnSlice& s : slices) {
    index.overlapping(s.k_range, hits, hint);
    for (std::size_t a : hits) {
      const AttnSlice c = clip_slice(s, s.q_range, available[a]);
      if (!c.q_range.empty()) need.emplace_back(a, c.k_range);
    }
  }
  std::sort(need.begin(), need.end(), [](const auto& x, const auto& y) {
    return x.first != y.first ? x.first < y.first : x.second.begin < y.second.begin;
  });
  std::vector<Range> out;
  std::size_t last = available.size();  // available range of out.back()
  for (std::size_t i = 0; i < need.size();) {
    const std::size_t a = need[i].first;
    // out.back() runs on into range a only when every available range between them is empty.
    bool follows = !out.empty();
    for (std::size_t b = last + 1; follows && b < a; ++b) follows = available[b].empty();
    for (; i < need.size() && need[i].first == a; ++i) {
      const Range r = need[i].second;
      if (!out.empty() && last == a && r.begin <= out.back().end) {  // merge inside range a
        out.back().end = std::max(out.back().end, r.end);
      } else if (!out.empty() && last != a && follows && out.back().end == r.begin) {  // coalesce along the buffer
        out.back().end = r.end;
        last = a;
      } else {
        out.push_back(r);
        last = a;
      }
    }
  }
  return out;
}

}  // namespace seqpar
