// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// Which query rows of a slice see which of its keys, in the shapes CpuFlash's passes ask for: the rows that see a
/// run of keys (`rows_seeing`), the keys a run of rows sees (`key_span`), and the visible columns of a key tile per
/// row of a score block (`tile_columns`). All three lean on one property of every mask (full, causal, sliding
/// window): both ends of a row's visible key range never decrease from one row to the next.

#include <algorithm>
#include <cstdint>

#include "seqpar/core/attn_slice.hpp"
#include "seqpar/core/detail/saturating.hpp"
#include "seqpar/core/range.hpp"

namespace seqpar::attention::detail {

/// Slice-relative query rows that see at least one of the slice-relative keys [k0, k1) (k0 < k1).
inline Range rows_seeing(const AttnSlice& sl, std::int64_t k0, std::int64_t k1) noexcept {
  const std::int64_t len = sl.q_range.size();
  const Mask& m = sl.mask;
  if (m.kind == MaskKind::kFull) return {0, len};
  const std::int64_t lo = std::clamp<std::int64_t>(k0 - m.causal_offset, 0, len);
  const std::int64_t hi =
      m.kind == MaskKind::kSlidingWindow
          ? std::clamp<std::int64_t>(seqpar::detail::add_sat(k1 - 1 - m.causal_offset, m.window), lo, len)
          : len;
  return {lo, hi};
}

/// Keys (slice-relative) visible to any of the rows [r0, r1): masks are monotone in the row.
inline Range key_span(const AttnSlice& sl, std::int64_t r0, std::int64_t r1) noexcept {
  const std::int64_t klen = sl.k_range.size();
  return {sl.mask.visible_keys(r0, klen).begin, sl.mask.visible_keys(r1 - 1, klen).end};
}

/// Visible tile columns [lo, hi) of rows first.. (slice-relative) for the slice-relative key tile
/// [kt0, kt0 + nk) restricted to slice-relative keys [kmin, kmax). Returns false if all are empty.
inline bool tile_columns(const AttnSlice& sl, std::int64_t first, int rows, std::int64_t kt0, int nk, std::int64_t kmin,
                         std::int64_t kmax, int* lo, int* hi) noexcept {
  const std::int64_t klen = sl.k_range.size();
  // Masks are monotone in the row (both ends of the visible range never decrease), so when the first row
  // sees to the tile's end and the last row from its start, every row sees the whole tile: most blocks
  // of a long causal slice, decided in two mask evaluations instead of one per row.
  const std::int64_t t0 = std::max(kt0, kmin), t1 = std::min(kt0 + nk, kmax);
  if (t0 < t1 && sl.mask.visible_keys(first, klen).end >= t1 &&
      sl.mask.visible_keys(first + rows - 1, klen).begin <= t0) {
    std::fill_n(lo, rows, static_cast<int>(t0 - kt0));
    std::fill_n(hi, rows, static_cast<int>(t1 - kt0));
    return true;
  }
  bool any = false;
  for (int r = 0; r < rows; ++r) {
    const Range vis = intersect(sl.mask.visible_keys(first + r, klen), {kmin, kmax});
    lo[r] = static_cast<int>(std::clamp<std::int64_t>(vis.begin - kt0, 0, nk));
    hi[r] = static_cast<int>(std::clamp<std::int64_t>(vis.end - kt0, 0, nk));
    any |= lo[r] < hi[r];
  }
  return any;
}

}  // namespace seqpar::attention::detail
