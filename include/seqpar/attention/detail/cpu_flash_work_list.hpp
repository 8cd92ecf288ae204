// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// CpuFlash's work lists: the forward's query tiles (largest first) and the backward's key tiles, each with its
/// visible area as cost, and how the backward deals its key tiles to lanes.
///
/// Why lanes: the backward is deterministic with no atomics. A head's key tiles are dealt to `max(4, threads)`
/// lanes (contiguous runs of about equal cost), a lane owns its tiles' fp32 dK/dV and its own fp32 dQ buffer (over
/// the query rows its tiles reach), threads take whole lanes, and the lane buffers are summed in lane order, so the
/// bits depend on the Arguments (and not on the thread count of the executing context up to 4).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>

#include "seqpar/attention/detail/cpu_flash_visibility.hpp"
#include "seqpar/attention/detail/flash_tiles.hpp"
#include "seqpar/core/attn_slice.hpp"
#include "seqpar/core/range.hpp"

namespace seqpar::attention::detail {

/// A work unit: rows [row0, row1) of slice `slice` (slice-relative), or key rows [row0, row1) of the
/// buffer when slice < 0 (backward; there `slice` then holds the lane). Query tiles are sorted by cost, largest
/// first; key tiles stay in key order.
struct WorkTile {
  std::int64_t cost;
  std::int64_t row0;
  std::int64_t row1;
  std::int64_t slice;
};

inline void sort_tiles(WorkTile* tiles, std::int64_t n) noexcept {
  std::sort(tiles, tiles + n, [](const WorkTile& a, const WorkTile& b) {
    if (a.cost != b.cost) return a.cost > b.cost;
    if (a.slice != b.slice) return a.slice < b.slice;
    return a.row0 < b.row0;
  });
}

/// Query tiles of `q_tile_rows` rows of every slice with their visible area; returns the count.
inline std::int64_t query_tiles(std::span<const AttnSlice> slices, std::int64_t q_tile_rows, WorkTile* tiles) noexcept {
  const std::int64_t br = q_tile_rows;
  std::int64_t n = 0;
  for (std::size_t s = 0; s < slices.size(); ++s) {
    const AttnSlice& sl = slices[s];
    const std::int64_t len = sl.q_range.size(), klen = sl.k_range.size();
    for (std::int64_t r0 = 0; r0 < len; r0 += br) {
      const std::int64_t r1 = std::min(len, r0 + br);
      std::int64_t cost = 0;
      for (std::int64_t r = r0; r < r1; ++r) cost += sl.mask.visible_keys(r, klen).size();
      if (cost > 0) tiles[n++] = {cost, r0, r1, static_cast<std::int64_t>(s)};
    }
  }
  sort_tiles(tiles, n);
  return n;
}

/// Key tiles of the KV buffer with the work of the slices that read them, in key order; returns the count.
/// A tile's cost is its visible (query, key) pairs, summed per key (the bounding rectangle of the rows that see
/// the tile counted a causal diagonal's masked half too, and lanes dealt by it ran up to 30% apart).
inline std::int64_t key_tiles(std::span<const AttnSlice> slices, std::int64_t k_rows, WorkTile* tiles) noexcept {
  std::int64_t n = 0;
  for (std::int64_t t0 = 0; t0 < k_rows; t0 += kKeyTile) {
    const Range tile{t0, std::min(k_rows, t0 + kKeyTile)};
    std::int64_t cost = 0;
    for (const AttnSlice& sl : slices) {
      const Range kr = intersect(sl.k_range, tile);
      for (std::int64_t j = kr.begin - sl.k_range.begin; j < kr.end - sl.k_range.begin; ++j)
        cost += rows_seeing(sl, j, j + 1).size();
    }
    if (cost > 0) tiles[n++] = {cost, tile.begin, tile.end, -1};
  }
  return n;
}

/// Deals key tiles (in key order) to lanes as contiguous runs of about equal cost: tile t goes to lane
/// floor(lanes * (cost before t + half its own) / total), stored in the tile's `slice` field. Contiguous runs keep a
/// lane's query rows together (a short document's rows meet one lane, and only those lanes' dQ rows are summed);
/// the split is off from equal by at most half a tile's cost per lane.
/// `order` receives the lanes by decreasing cost: threads take them in that order (largest first), which
/// pairs a heavy lane with a light one when there are fewer threads than lanes (the bits do not depend on it).
inline void deal_lanes(WorkTile* tiles, std::int64_t n, int n_lanes, int* order) noexcept {
  double total = 0;
  for (std::int64_t t = 0; t < n; ++t) total += double(tiles[t].cost);
  double before = 0;
  double lane_cost[1024] = {};
  for (std::int64_t t = 0; t < n; ++t) {
    const double mid = before + 0.5 * double(tiles[t].cost);
    tiles[t].slice = std::clamp(static_cast<std::int64_t>(double(n_lanes) * mid / total), std::int64_t{0},
                                std::int64_t{n_lanes - 1});
    before += double(tiles[t].cost);
    lane_cost[tiles[t].slice] += double(tiles[t].cost);
  }
  std::iota(order, order + n_lanes, 0);
  std::sort(order, order + n_lanes, [&](int a, int b) {  // not stable_sort: it allocates
    return lane_cost[a] != lane_cost[b] ? lane_cost[a] > lane_cost[b] : a < b;
  });
}

/// reach[lane] = the hull of the buffer's query rows that lane's key tiles reach (the rows its dQ buffer holds),
/// for every lane in one pass over the tiles.
inline void lane_reach(std::span<const AttnSlice> slices, const WorkTile* tiles, std::int64_t n, int n_lanes,
                       Range* reach) noexcept {
  std::fill_n(reach, n_lanes, Range{0, 0});
  for (std::int64_t t = 0; t < n; ++t) {
    Range& r = reach[tiles[t].slice];
    for (const AttnSlice& sl : slices) {
      const Range kr = intersect(sl.k_range, {tiles[t].row0, tiles[t].row1});
      if (kr.empty()) continue;
      const Range rows = rows_seeing(sl, kr.begin - sl.k_range.begin, kr.end - sl.k_range.begin);
      if (rows.empty()) continue;
      const Range abs{sl.q_range.begin + rows.begin, sl.q_range.begin + rows.end};
      r = r.empty() ? abs : Range{std::min(r.begin, abs.begin), std::max(r.end, abs.end)};
    }
  }
}

}  // namespace seqpar::attention::detail
