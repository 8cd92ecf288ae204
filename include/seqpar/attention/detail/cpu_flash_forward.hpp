// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// CpuFlash's forward pass (FlashAttention-2, Dao 2023): O and LSE of every query row of the slices, with tile
/// policy `Tiles` (detail/tile_dispatch.hpp picks it from the instruction set).
///
/// One KV head at a time: its K^T and V are packed once into the micro-kernel's B panels for every 128-key tile of
/// the buffer (K^T by 8 x 8 transposes); then per work item (query head of the group, query tile of `q_tile` rows)
/// the Q tile is packed pre-scaled by softmax_scale * log2(e), and for each 128-key tile the rows see and each score
/// block of 48 query rows the scores S = Q K^T come from a broadcast-FMA micro-kernel (6 rows x 64 keys in 24 zmm,
/// 6 x 16 in 12 ymm on AVX2; the 48 rows share each K^T panel from L1; only the 16-key vectors holding a register
/// block's visible keys), an online softmax in base 2 updates the running max / sum (lazily: the output rows are
/// rescaled only when a row's max grows by more than 2^8) and P V accumulates into an fp32 output tile. Tiles and row
/// blocks that the mask hides are skipped; only blocks that a mask edge crosses are masked element-wise. A tile whose
/// V holds a NaN or infinity is multiplied over each row's exact visible keys, so a non-finite value stays in the
/// rows that read it. Work items run largest-first (by visible area) on the execution context's thread pool.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numbers>
#include <span>

#include "seqpar/attention/detail/cpu_flash_blocking.hpp"
#include "seqpar/attention/detail/cpu_flash_packing.hpp"
#include "seqpar/attention/detail/cpu_flash_visibility.hpp"
#include "seqpar/attention/detail/cpu_flash_work_list.hpp"
#include "seqpar/attention/detail/cpu_flash_workspace.hpp"
#include "seqpar/attention/detail/flash_tiles.hpp"
#include "seqpar/attention/detail/flash_tiles_avx512bf16.hpp"
#include "seqpar/core/attention_shape.hpp"
#include "seqpar/core/attn_slice.hpp"
#include "seqpar/core/host_exec.hpp"
#include "seqpar/core/range.hpp"
#include "seqpar/core/tensor.hpp"

namespace seqpar::attention::detail {

/// Query rows `tile` of slice `sl` for query head h, against the KV head's packed tiles in w (k_pack, v_pack,
/// v_finite): the buffer's 128-key tiles that the rows see, each restricted to the slice's visible keys.
template <class Tiles, class T, class A>
inline void cpu_flash_forward_tile(const FlashBlocking& blocking, const AttentionShape& shape, ThdView<const T> q,
                                   std::int64_t k_rows, const WorkspaceRegions<A>& w, const AttnSlice& sl,
                                   const WorkTile& tile, int h, ThdView<T> o, LseView<A> lse, A* ws) noexcept {
  constexpr int kP = Tiles::kPanel;
  constexpr int kKT = kKeyTile, kRB = kRowBlock, kSB = kScoreBlock;
  constexpr A kLog2e = std::numbers::log2e_v<A>;
  constexpr A kLn2 = std::numbers::ln2_v<A>;
  const int d = shape.qk_dim(), dv = shape.v_dim();  // Q K^T over d, P V over dv
  const int n = static_cast<int>(tile.row1 - tile.row0);
  const std::int64_t br = blocking.q_tile_rows;
  const std::int64_t dm = std::max(d, dv);  // the layout's width
  A* qs = ws;
  A* acc = qs + round16(br * dm);
  A* s = acc + round16(br * dm);
  A* m = s + round16(kSB * kKT);
  A* l = m + round16(br);
  const std::int64_t i0 = sl.q_range.begin + tile.row0;
  const A c = A(shape.scale()) * kLog2e;                                // log2-domain scores: S = c Q K^T
  pack_rows<Tiles>(q, i0, n, h, d, kBf16Scores<Tiles> ? A(1) : c, qs);  // c in the product (cpu_flash_backward)
  std::fill_n(acc, static_cast<std::size_t>(n) * static_cast<std::size_t>(dv), A(0));
  std::fill_n(m, n, -std::numeric_limits<A>::infinity());
  std::fill_n(l, n, A(0));

  const Range keys = key_span(sl, tile.row0, tile.row1);  // slice-relative
  const std::int64_t ks = sl.k_range.begin;
  int lo[kSB], hi[kSB];
  for (std::int64_t t = (ks + keys.begin) / kKT; t * kKT < ks + keys.end; ++t) {
    const std::int64_t kt0 = t * kKT - ks;  // slice-relative key of tile column 0 (may be negative)
    const int nk = static_cast<int>(std::min<std::int64_t>(kKT, k_rows - t * kKT));
    const A* kt = w.k_pack + t * tile_elems<kP>(d);
    const A* vp = w.v_pack + t * tile_elems<kP>(dv);
    const bool v_finite = w.v_finite[t] != 0;
    for (int g0 = 0; g0 < n; g0 += kSB) {
      int rows = std::min(kSB, n - g0);
      if (!tile_columns(sl, tile.row0 + g0, rows, kt0, nk, keys.begin, keys.end, lo, hi)) continue;
      // Masks are monotone in the row: the rows that see a key of this tile are one run [ra, rb).
      int ra = 0;
      while (lo[ra] >= hi[ra]) ++ra;
      while (lo[rows - 1] >= hi[rows - 1]) --rows;
      const int nr = rows - ra;
      // Per register block of 6 rows, only the keys its rows see: S over the 16-key panels that hold them
      // (the other columns of s stay stale and are masked by selection in softmax_row), P V over exactly them.
      // Every row in [ra, rows) sees the tile and the visible ranges move right with the row, so a block's
      // keys run from its first row's lo to its last row's hi.
      int col_lo[kSB / kRB], col_hi[kSB / kRB], k_lo[kSB / kRB], k_hi[kSB / kRB];
      for (int i = 0, rb = 0; i < nr; i += kRB, ++rb) {
        k_lo[rb] = lo[ra + i];
        k_hi[rb] = hi[std::min(rows, ra + i + kRB) - 1];
        col_lo[rb] = k_lo[rb] / kColumnGrain * kColumnGrain;
        col_hi[rb] = std::min(kKT, (k_hi[rb] + kColumnGrain - 1) / kColumnGrain * kColumnGrain);
      }
      if constexpr (kBf16Scores<Tiles>)
        Tiles::gemm_pairs(nr, kKT, d, qs + (g0 + ra) * d, d, 1, key_pairs(kt), pair_panel<kP>(d), s + ra * kKT, kKT,
                          false, c, {col_lo, col_hi, nullptr, nullptr});
      else
        Tiles::gemm(nr, kKT, d, qs + (g0 + ra) * d, d, 1, kt, kP, std::int64_t{d} * kP, s + ra * kKT, kKT, false,
                    {col_lo, col_hi, nullptr, nullptr});
      for (int r = ra; r < rows; ++r) {
        A* sr = s + r * kKT;
        if (lo[r] >= hi[r]) {
          std::fill_n(sr, kKT, A(0));
          continue;
        }
        const A alpha = Tiles::softmax_row(sr, lo[r], hi[r], m[g0 + r], l[g0 + r]);
        if (alpha != A(1)) Tiles::scale_row(acc + (g0 + r) * dv, dv, alpha);
      }
      if (v_finite) {
        // bf16 products: P rounded to bf16 (flash_tiles_avx512bf16.hpp); a block's key range widened to whole pairs
        // meets P = 0 (selected) and finite V, or the pack's zero rows past the tile's end
        if constexpr (kBf16Scores<Tiles>)
          Tiles::gemm_pairs(nr, dv, kKT, s + ra * kKT, kKT, 1, key_pairs(vp), kRowPanel<kP> / 2, acc + (g0 + ra) * dv,
                            dv, true, A(1), {nullptr, nullptr, k_lo, k_hi});
        else
          Tiles::gemm(nr, dv, kKT, s + ra * kKT, kKT, 1, vp, kP, kRowPanel<kP>, acc + (g0 + ra) * dv, dv, true,
                      {nullptr, nullptr, k_lo, k_hi});
      } else {  // exact per-row key ranges: a masked P is 0, but 0 * (NaN or inf in V) is not
        for (int r = ra; r < rows; ++r) {
          if (lo[r] >= hi[r]) continue;
          if constexpr (kBf16Scores<Tiles>)  // the same sums as the block form's, bit for bit
            Tiles::gemm_pairs(1, dv, kKT, s + r * kKT, kKT, 1, key_pairs(vp), kRowPanel<kP> / 2, acc + (g0 + r) * dv,
                              dv, true, A(1), {nullptr, nullptr, &lo[r], &hi[r]}, true);
          else
            Tiles::gemm(1, dv, hi[r] - lo[r], s + r * kKT + lo[r], kKT, 1, vp + lo[r] * kP, kP, kRowPanel<kP>,
                        acc + (g0 + r) * dv, dv, true);
        }
      }
    }
  }
  for (int r = 0; r < n; ++r) {
    if (r + kAhead < n) prefetch_row(o.row(i0 + r + kAhead, h), dv, true);
    if (l[r] == A(0)) {  // fully masked row: O = 0, LSE = -inf from the prefill
      std::fill_n(o.row(i0 + r, h), dv, T(0));
      continue;
    }
    Tiles::store_scaled(o.row(i0 + r, h), acc + r * dv, dv, A(1) / l[r]);
    lse(h, i0 + r) = (m[r] + std::log2(l[r])) * kLn2;
  }
}

/// The forward pass on `exec` (checked by CpuFlash::forward): o and lse of every row, O = 0 and LSE = -inf for the
/// rows no slice covers.
template <class Tiles, class T, class A>
inline void cpu_flash_forward(const HostExec& exec, const FlashBlocking& blocking, const AttentionShape& shape,
                              ThdView<const T> q, ThdView<const T> k, ThdView<const T> v,
                              std::span<const AttnSlice> slices, ThdView<T> o, LseView<A> lse,
                              std::span<std::byte> workspace) {
  constexpr int kP = Tiles::kPanel;
  constexpr int kKT = kKeyTile;

  const WorkspaceRegions<A> w = carve_workspace<A>(blocking, shape, q.tokens, k.tokens, workspace);
  const std::int64_t n_tiles = query_tiles(slices, blocking.q_tile_rows, w.tiles);
  for (int h = 0; h < shape.heads_q; ++h)
    for (std::int64_t t = 0; t < q.tokens; ++t) lse(h, t) = -std::numeric_limits<A>::infinity();
  // O = 0 only on the rows no work item writes (cpu_flash_forward_tile writes every row of its tile, zeros for a row
  // that sees no key): zeroing all of O first wrote it twice, serially, heads * tokens * v_dim values per call (16 MiB
  // at 4K, 8 heads, d 128). The work items' rows, sorted by their first row (in the backward's query-tile list, unused
  // here), leave gaps: those rows are zeroed.
  {
    WorkTile* by_row = w.qtiles;
    for (std::int64_t i = 0; i < n_tiles; ++i) {
      const WorkTile& tile = w.tiles[i];
      const std::int64_t b = slices[static_cast<std::size_t>(tile.slice)].q_range.begin;
      by_row[i] = {0, b + tile.row0, b + tile.row1, tile.slice};
    }
    std::sort(by_row, by_row + n_tiles, [](const WorkTile& a, const WorkTile& b) { return a.row0 < b.row0; });
    std::int64_t at = 0;  // rows before `at` are written by an item or zeroed
    for (std::int64_t i = 0; i <= n_tiles; ++i) {
      const std::int64_t next = i < n_tiles ? by_row[i].row0 : q.tokens;
      for (std::int64_t t = at; t < next; ++t)
        for (int h = 0; h < shape.heads_q; ++h) std::fill_n(o.row(t, h), shape.v_dim(), T(0));
      if (i < n_tiles) at = std::max(at, by_row[i].row1);
    }
  }
  const std::int64_t n_kt = (k.tokens + kKT - 1) / kKT;
  const int group = shape.group_size();
  // One KV head at a time: its K^T and V are packed once into micro-kernel panels for every 128-key tile of
  // the buffer (packing them per query tile re-read the strided K/V rows from memory once per query tile:
  // ~8% of the forward at 4K, d 128), then the query tiles of the group's query heads read them.
  for (int hk = 0; hk < shape.heads_kv; ++hk) {
    {
      std::atomic<std::int64_t> next{0};
      auto body = [&](int) {
        for (std::int64_t t = next.fetch_add(1, std::memory_order_relaxed); t < n_kt;
             t = next.fetch_add(1, std::memory_order_relaxed)) {
          const int nk = static_cast<int>(std::min<std::int64_t>(kKT, k.tokens - t * kKT));
          A* kt = w.k_pack + t * tile_elems<kP>(shape.qk_dim());
          A* vp = w.v_pack + t * tile_elems<kP>(shape.v_dim());
          pack_keys<Tiles>(k, t * kKT, nk, hk, shape.qk_dim(), kt, nullptr);
          pack_panels<Tiles>(v, t * kKT, nk, hk, shape.v_dim(), vp);
          w.v_finite[t] = panels_finite<Tiles>(vp, 0, nk, shape.v_dim()) ? 1 : 0;
          // bf16 products: V as pairs of key rows instead (P V by gemm_pairs)
          if constexpr (kBf16Scores<Tiles>) pack_row_pairs<Tiles>(v, t * kKT, nk, hk, shape.v_dim(), key_pairs(vp));
        }
      };
      exec.parallel(body);
    }
    const std::int64_t total = n_tiles * group;
    std::atomic<std::int64_t> next{0};
    auto body = [&](int thread) {
      A* ws = w.thread(thread);
      for (std::int64_t idx = next.fetch_add(1, std::memory_order_relaxed); idx < total;
           idx = next.fetch_add(1, std::memory_order_relaxed)) {
        const WorkTile& tile = w.tiles[idx / group];
        cpu_flash_forward_tile<Tiles>(blocking, shape, q, k.tokens, w, slices[static_cast<std::size_t>(tile.slice)],
                                      tile, hk * group + static_cast<int>(idx % group), o, lse, ws);
      }
    };
    exec.parallel(body);
  }
}

}  // namespace seqpar::attention::detail
