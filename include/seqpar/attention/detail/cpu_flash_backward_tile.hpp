// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// The unit of CpuFlash's backward pass: one key tile against one query head's rows (`cpu_flash_backward_tile`),
/// with tile policy `Tiles`. It recomputes P = exp2(S - LSE2), dP = dO V^T and dS = P * (dP - D) once per (query head,
/// key tile, query block) and uses them three times: dV += P^T dO, dK += dS^T Q, dQ += dS K (5 tile GEMMs).
///
/// Masked (query, key) pairs never enter a product: scores and dS are masked by selection, a slice touches only its
/// own keys of a tile, and a tile whose V, K, Q or dO values hold a NaN or infinity is multiplied over each row's exact
/// visible keys (`exact_key_update`, `exact_key_pairs`), so a non-finite value stays in the rows and keys that read it.

#include <algorithm>
#include <cstddef>
#include <cstdint>
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
#include "seqpar/core/range.hpp"
#include "seqpar/core/tensor.hpp"

namespace seqpar::attention::detail {

/// acc[c] += sum over the block rows r that see key c of w[r][c] * x[r] (for tile columns c in [c0, c1)):
/// the exact form of acc += W^T X, used when X holds a NaN or infinity, since a masked weight is 0 and
/// 0 * NaN is NaN. `koff` is the slice-relative key of tile column 0, `b0` the block's first slice row.
template <class Tiles, class A>
inline void exact_key_update(const AttnSlice& sl, std::int64_t koff, std::int64_t b0, int nb, int c0, int c1,
                             const A* w, const A* x, int d, A* acc) noexcept {
  for (int c = c0; c < c1; ++c) {
    const Range rows = intersect(rows_seeing(sl, koff + c, koff + c + 1), {b0, b0 + nb});
    if (rows.empty()) continue;
    const int r0 = static_cast<int>(rows.begin - b0);
    Tiles::gemm(1, d, static_cast<int>(rows.size()), w + r0 * kKeyTile + c, 1, kKeyTile, x + r0 * d, d, Tiles::kPanel,
                acc + c * d, d,
                true);  // row-major B: panel = kPanel
  }
}

/// exact_key_update for the bf16 products: x is the block's rows as pairs (gemm_pairs' B, its first pair row holding
/// the block's row -sh), the sums per key bit for bit those of the block form.
template <class Tiles, class A>
inline void exact_key_pairs(const AttnSlice& sl, std::int64_t koff, std::int64_t b0, int nb, int c0, int c1, const A* w,
                            const std::uint32_t* x, std::int64_t panel, int sh, int d, A* acc) noexcept {
  for (int c = c0; c < c1; ++c) {
    const Range rows = intersect(rows_seeing(sl, koff + c, koff + c + 1), {b0, b0 + nb});
    if (rows.empty()) continue;
    const int r0 = static_cast<int>(rows.begin - b0) + sh, r1 = static_cast<int>(rows.end - b0) + sh;
    Tiles::gemm_pairs(1, d, nb + sh, w + c, 1, kKeyTile, x, panel, acc + c * d, d, true, A(1),
                      {nullptr, nullptr, &r0, &r1}, true, sh);
  }
}

/// The current head's packed query-side rows (all q rows, indexed by buffer row) and their finiteness.
template <class A>
struct PackedQueryRows {
  const A* q;          // c Q
  const A* o;          // dO
  const A* qp;         // c Q as head-dim panels (the B operand of dK += dS^T (c Q)); Q as row pairs (bf16 products)
  const A* op;         // dO as head-dim panels (the B operand of dV += P^T dO); as row pairs (bf16 products)
  std::int64_t panel;  // distance between the panels of qp / op
  A s_scale;           // S = s_scale * (q K^T): c where q holds Q (bf16 score products), else unused
  bool q_finite, o_finite;
};

/// All of key tile `tile` of KV head h / group for query head h: S and dP per block of query rows, then
/// dV += P^T dO, dK += dS^T (c Q) into the tile's fp32 accumulators (zeroed when `first`) and
/// dQ += dS K into the lane's dQ buffer (unscaled). Each slice touches only its own keys of the tile.
template <class Tiles, class T, class A>
inline void cpu_flash_backward_tile(const FlashBlocking& blocking, const AttentionShape& shape, ThdView<const T> q,
                                    ThdView<const T> k, ThdView<const T> v, LseView<const A> lse,
                                    const PackedQueryRows<A>& packed, std::span<const AttnSlice> slices,
                                    const WorkTile& tile, int h, bool first, const A* delta, A* dk_acc, A* dv_acc,
                                    A* dq_lane, A* ws) noexcept {
  constexpr int kP = Tiles::kPanel;
  constexpr int kKT = kKeyTile, kRB = kRowBlock, kSB = kScoreBlock;
  constexpr A kLog2e = std::numbers::log2e_v<A>;
  const int d = shape.qk_dim(), d_v = shape.v_dim();  // S, dK, dQ over d; dP, dV over d_v
  const int hk = h / shape.group_size();
  const std::int64_t rq = blocking.q_block_rows;
  const int nk = static_cast<int>(tile.row1 - tile.row0);
  const std::size_t te = round16(tile_elems(std::max(d, d_v)));  // the layout's tile
  A* kt = ws;
  A* vt = kt + te;
  A* kn = vt + te;
  A* pb = kn + te;
  A* sb = pb + round16(rq * kKT);
  // Per register block of the query block: the keys (relative to the slice's first tile column c0) its dQ
  // product sums over.
  int* dq_lo = reinterpret_cast<int*>(sb + round16(rq * kKT));
  int* dq_hi = dq_lo + (rq / kRB + 1);
  A* dka = dk_acc + tile.row0 * d;
  A* dva = dv_acc + tile.row0 * d_v;
  pack_keys<Tiles>(k, tile.row0, nk, hk, d, kt, kn);
  // bf16 products: K's rows also as pairs (the B operand of dQ += dS K), after the pair K^T in kt's memory (both
  // fit: tile_elems(d) >= kKT ceil(d / 2) + (kKT / 2) ceil(d / kP) kP); kn keeps the fp32 rows for the finiteness
  // test
  std::uint32_t* k_pairs = key_pairs(kt) + std::int64_t{kKT} * ((d + 1) / 2);
  if constexpr (kBf16Scores<Tiles>) pack_row_pairs<Tiles>(k, tile.row0, nk, hk, d, k_pairs);
  pack_keys<Tiles>(v, tile.row0, nk, hk, d_v, vt, nullptr);
  if (first) {
    std::fill_n(dka, static_cast<std::size_t>(nk) * static_cast<std::size_t>(d), A(0));
    std::fill_n(dva, static_cast<std::size_t>(nk) * static_cast<std::size_t>(d_v), A(0));
  }
  int lo[kSB], hi[kSB];
  int col_lo[kSB / kRB], col_hi[kSB / kRB];
  int kv_lo[kKT / kRB + 1], kv_hi[kKT / kRB + 1];
  for (const AttnSlice& sl : slices) {
    const Range kr = intersect(sl.k_range, {tile.row0, tile.row1});
    if (kr.empty()) continue;
    const std::int64_t ks = sl.k_range.begin;
    const std::int64_t koff = tile.row0 - ks;  // slice-relative key of tile column 0
    const Range rows_all = rows_seeing(sl, kr.begin - ks, kr.end - ks);
    // Only this slice's keys of the tile [c0, c1): the other documents' keys must not meet its rows.
    const int c0 = static_cast<int>(kr.begin - tile.row0), c1 = static_cast<int>(kr.end - tile.row0);
    const bool k_finite = panels_finite<Tiles>(kn, c0, c1, d);
    // dQ's key ranges count from c0, or from tile column 0 for the bf16 pairs (whose pairs start at even columns)
    const int dq_base = kBf16Scores<Tiles> ? 0 : c0;
    for (std::int64_t b0 = rows_all.begin; b0 < rows_all.end; b0 += rq) {
      const int nb = static_cast<int>(std::min<std::int64_t>(rq, rows_all.end - b0));
      const std::int64_t i0 = sl.q_range.begin + b0;
      const A* qb = packed.q + i0 * d;
      const A* ob = packed.o + i0 * d_v;
      for (int g0 = 0; g0 < nb; g0 += kSB) {
        const int rows = std::min(kSB, nb - g0);
        A* p = pb + g0 * kKT;
        A* ds = sb + g0 * kKT;
        const bool any = tile_columns(sl, b0 + g0, rows, koff, nk, kr.begin - ks, kr.end - ks, lo, hi);
        // Per register block of 6 rows: the tile columns its rows see (S and dP over the 16-key panels that
        // hold them; dQ over exactly them). A block's rows may include rows that see none of the tile.
        for (int i = 0, rb = 0; i < rows; i += kRB, ++rb) {
          int kl = kKT, kh = 0;
          for (int r = i; r < std::min(rows, i + kRB); ++r)
            if (lo[r] < hi[r]) {
              kl = std::min(kl, lo[r]);
              kh = std::max(kh, hi[r]);
            }
          if (!any || kl >= kh) kl = kh = c0;
          col_lo[rb] = kl / kColumnGrain * kColumnGrain;
          col_hi[rb] = kl == kh ? col_lo[rb] : std::min(kKT, (kh + kColumnGrain - 1) / kColumnGrain * kColumnGrain);
          dq_lo[g0 / kRB + rb] = kl - dq_base;
          dq_hi[g0 / kRB + rb] = kh - dq_base;
        }
        if (!any) {
          std::fill_n(p, rows * kKT, A(0));
          std::fill_n(ds, rows * kKT, A(0));
          continue;
        }
        const BlockRanges cols{col_lo, col_hi, nullptr, nullptr};
        if constexpr (kBf16Scores<Tiles>) {
          Tiles::gemm_pairs(rows, kKT, d, qb + g0 * d, d, 1, key_pairs(kt), pair_panel<kP>(d), p, kKT, false,
                            packed.s_scale, cols);
          Tiles::gemm_pairs(rows, kKT, d_v, ob + g0 * d_v, d_v, 1, key_pairs(vt), pair_panel<kP>(d_v), ds, kKT, false,
                            A(1), cols);
        } else {
          Tiles::gemm(rows, kKT, d, qb + g0 * d, d, 1, kt, kP, std::int64_t{d} * kP, p, kKT, false, cols);
          Tiles::gemm(rows, kKT, d_v, ob + g0 * d_v, d_v, 1, vt, kP, std::int64_t{d_v} * kP, ds, kKT, false, cols);
        }
        for (int r = 0; r < rows; ++r) {
          const std::int64_t i = i0 + g0 + r;
          if (lo[r] >= hi[r]) {
            std::fill_n(p + r * kKT, kKT, A(0));
            std::fill_n(ds + r * kKT, kKT, A(0));
            continue;
          }
          Tiles::backward_row(p + r * kKT, ds + r * kKT, lo[r], hi[r], lse(h, i) * kLog2e, delta[h * q.tokens + i]);
        }
      }
      // Per register block of 6 keys (from c0): the block's query rows that see any of its keys. P and dS are
      // zero elsewhere, so dV and dK sum over those rows only.
      for (int j = c0, kb = 0; j < c1; j += kRB, ++kb) {
        const Range seen = intersect(rows_seeing(sl, koff + j, koff + std::min(c1, j + kRB)), {b0, b0 + nb});
        kv_lo[kb] = seen.empty() ? 0 : static_cast<int>(seen.begin - b0);
        kv_hi[kb] = seen.empty() ? 0 : static_cast<int>(seen.end - b0);
      }
      const BlockRanges key_rows{nullptr, nullptr, kv_lo, kv_hi};
      if constexpr (kBf16Scores<Tiles>) {
        // bf16 products, P and dS rounded to bf16: the pairs are the buffer's row pairs, so an odd first row i0 is
        // the second of its pair (a_shift 1: A's row before it reads as 0) and the ranges move by one; exact ends,
        // since the row beside an odd end belongs to another block, not checked finite
        const int sh = static_cast<int>(i0 % 2);
        int kv_lo_s[kKT / kRB + 1], kv_hi_s[kKT / kRB + 1];
        for (int j = c0, kb = 0; j < c1; j += kRB, ++kb) {
          kv_lo_s[kb] = kv_lo[kb] + sh;
          kv_hi_s[kb] = kv_hi[kb] + sh;
        }
        const BlockRanges pair_rows{nullptr, nullptr, kv_lo_s, kv_hi_s};
        const std::uint32_t* op = key_pairs(packed.op) + (i0 - sh) / 2 * kP;
        const std::uint32_t* qp = key_pairs(packed.qp) + (i0 - sh) / 2 * kP;
        if (packed.o_finite || Tiles::all_finite(ob, std::int64_t{nb} * d_v))  // dV += P^T dO
          Tiles::gemm_pairs(c1 - c0, d_v, nb + sh, pb + c0, 1, kKT, op, packed.panel, dva + c0 * d_v, d_v, true, A(1),
                            pair_rows, true, sh);
        else
          exact_key_pairs<Tiles>(sl, koff, b0, nb, c0, c1, pb, op, packed.panel, sh, d_v, dva);
        if (packed.q_finite || Tiles::all_finite(qb, std::int64_t{nb} * d))  // dK += dS^T Q
          Tiles::gemm_pairs(c1 - c0, d, nb + sh, sb + c0, 1, kKT, qp, packed.panel, dka + c0 * d, d, true, A(1),
                            pair_rows, true, sh);
        else
          exact_key_pairs<Tiles>(sl, koff, b0, nb, c0, c1, sb, qp, packed.panel, sh, d, dka);
      } else {
        if (packed.o_finite || Tiles::all_finite(ob, std::int64_t{nb} * d_v))  // dV += P^T dO
          Tiles::gemm(c1 - c0, d_v, nb, pb + c0, 1, kKT, packed.op + i0 * kP, kP, packed.panel, dva + c0 * d_v, d_v,
                      true, key_rows);
        else
          exact_key_update<Tiles>(sl, koff, b0, nb, c0, c1, pb, ob, d_v, dva);
        if (packed.q_finite || Tiles::all_finite(qb, std::int64_t{nb} * d))  // dK += dS^T (c Q)
          Tiles::gemm(c1 - c0, d, nb, sb + c0, 1, kKT, packed.qp + i0 * kP, kP, packed.panel, dka + c0 * d, d, true,
                      key_rows);
        else
          exact_key_update<Tiles>(sl, koff, b0, nb, c0, c1, sb, qb, d, dka);
      }
      if (k_finite) {  // dQ += dS K
        // bf16 products: dS rounded to bf16 (flash_tiles_avx512bf16.hpp); exact ends, since the key beside a block's
        // odd end may be another document's, not checked finite
        if constexpr (kBf16Scores<Tiles>)
          Tiles::gemm_pairs(nb, d, kKT, sb, kKT, 1, k_pairs, kRowPanel<kP> / 2, dq_lane + i0 * d, d, true, A(1),
                            {nullptr, nullptr, dq_lo, dq_hi}, true);
        else
          Tiles::gemm(nb, d, c1 - c0, sb + c0, kKT, 1, kn + c0 * kP, kP, kRowPanel<kP>, dq_lane + i0 * d, d, true,
                      {nullptr, nullptr, dq_lo, dq_hi});
      } else {  // exact per-row key ranges: a masked dS is 0, but 0 * (NaN or inf in K) is not
        const std::int64_t klen = sl.k_range.size();
        for (int r = 0; r < nb; ++r) {
          const Range vis = intersect(sl.mask.visible_keys(b0 + r, klen), {koff + c0, koff + c1});
          if (vis.empty()) continue;
          const int j0 = static_cast<int>(vis.begin - koff);
          if constexpr (kBf16Scores<Tiles>) {  // the same sums as the block form's, bit for bit
            const int j1 = j0 + static_cast<int>(vis.size());
            Tiles::gemm_pairs(1, d, kKT, sb + r * kKT, kKT, 1, k_pairs, kRowPanel<kP> / 2, dq_lane + (i0 + r) * d, d,
                              true, A(1), {nullptr, nullptr, &j0, &j1}, true);
          } else {
            Tiles::gemm(1, d, static_cast<int>(vis.size()), sb + r * kKT + j0, kKT, 1, kn + j0 * kP, kP, kRowPanel<kP>,
                        dq_lane + (i0 + r) * d, d, true);
          }
        }
      }
    }
  }
}

}  // namespace seqpar::attention::detail
