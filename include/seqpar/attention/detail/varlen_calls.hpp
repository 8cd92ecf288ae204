// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// How a kernel call's slice table becomes FlashAttention-2 varlen calls (torch's
/// `aten::_flash_attention_forward` / `_flash_attention_backward` with cumulative sequence lengths):
/// host-side, plain C++, independent of where the calls run. The torch extension's flash kernel
/// (python/src/torch_flash.hpp) executes these calls on the GPU; tests/support/varlen_standin.hpp executes
/// them with an fp64 stand-in of the varlen call's documented semantics, which is how the mapping is
/// tested without a GPU (tests/attention/test_varlen_calls.cpp, tests/strategy/test_varlen_strategies.cpp).
/// It lives in include/ (not kernels/) because it is host code that both of those use, and no device code.
///
/// The varlen call's semantics (FlashAttention 2 >= 2.1, flash_attn_interface.py docstrings; torch's vendored
/// copy, aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp, mha_varlen_fwd / mha_varlen_bwd):
///  - batch item b packs query rows [cu_q[b], cu_q[b+1]) and key rows [cu_k[b], cu_k[b+1]) of the packed
///    (total, heads, head_dim) tensors; int32 offsets; max_q / max_k the longest item;
///  - item row t sees item key u iff  t + sk - sq - left <= u <= t + sk - sq + right  (sq, sk: the item's
///    lengths), i.e. BOTTOM-RIGHT aligned; a negative bound is no bound; `is_causal` sets right = 0;
///  - a bound >= max_k is replaced by "no bound" (`if (window_size_left >= max_seqlen_k) window_size_left
///    = -1`, same for right): exact only where such a bound never cuts, which this mapping guarantees;
///  - a row that sees no key gets O = 0 and LSE = +inf (FA2's softmax.h); this mapping puts no such row
///    in any call: rows of no call keep the protocol's O = 0, LSE = -inf (set by the executor of calls);
///  - LSE out: float32 (heads_q, total_q), natural log of sum exp(scale * s) (seqpar's units);
///  - GQA: heads_q a multiple of heads_kv, query head h reads kv head h / (heads_q / heads_kv); the
///    backward returns dK, dV per kv head (summed over the group), freshly written (not accumulated).
///  - The backward recomputes P = exp(scale * s - LSE) and D = rowsum(dO * O) from the O and LSE it is
///    given: seqpar's kernel protocol passes the final (merged) O and LSE of every row, so each call's
///    gradients are that block's exact share, as in ring attention (ring-flash-attn passes them the same way).
///
/// The mapping, per slice (mask relative to the slice, causal_offset o, window w; see core/attn_slice.hpp):
///  - full: one item, no bounds;
///  - causal / window: rows before the first that sees key 0 (i + o < 0) are left out. The rows whose
///    diagonal lies inside the keys form an item whose keys end at the last row's diagonal, so that
///    sk - sq = o exactly: causal (right 0), with left = w - 1 for a window (no bound once w >= sk). The rows
///    after them see every key up to the slice's last (a causal slice: a full item). For a window those
///    rows' bands are cut on the right by the slice's end, which FA says with no right bound and a left
///    bound measured from its bottom-right diagonal: keys [c, k) with c the first row's window start and
///    left = k - b - o + w - 1 (b: the end of the rows that still see a key): exact, never refused;
///  - rows whose window lies wholly before the slice's keys see nothing and are left out.
/// Items of one mask (is_causal, left, right) form one call. Backward calls are further cut into
/// key-disjoint waves (FA writes dK/dV, the caller adds them into fp32 accumulators: inside a wave no key
/// row is written twice, so the adds need no atomics and no order). Within a call items are sorted by
/// query row; contiguous buffer rows are merged into segments, so a call whose query (or key) rows are one
/// segment can be a view of the caller's buffer instead of a gather.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "seqpar/attention/kernel.hpp"
#include "seqpar/core/attn_slice.hpp"
#include "seqpar/core/error.hpp"

namespace seqpar::attention::detail {

/// FA's mask of one call: a negative bound is no bound (FA's -1). `is_causal` is exactly (left < 0, right 0).
struct VarlenMask {
  std::int64_t left = -1, right = -1;
  [[nodiscard]] constexpr bool is_causal() const noexcept { return left < 0 && right == 0; }
  friend constexpr bool operator==(const VarlenMask&, const VarlenMask&) = default;
  friend constexpr auto operator<=>(const VarlenMask&, const VarlenMask&) = default;
};

/// One batch item: query rows [q_begin, q_begin + q_len) and key rows [k_begin, k_begin + k_len) of the
/// caller's buffers, under its call's mask (bottom-right aligned).
struct VarlenItem {
  std::int64_t q_begin = 0, q_len = 0, k_begin = 0, k_len = 0;
  VarlenMask mask;
  std::size_t slice = 0;  ///< the slice it came from (tests, errors)
  friend constexpr bool operator==(const VarlenItem&, const VarlenItem&) = default;
};

/// Buffer rows [begin, begin + rows): the packed tensor of a call is its segments one after the other.
struct RowSegment {
  std::int64_t begin = 0, rows = 0;
  friend constexpr bool operator==(const RowSegment&, const RowSegment&) = default;
};

/// One varlen call: what at::_flash_attention_forward / _backward take besides the tensors.
struct VarlenCall {
  VarlenMask mask;
  std::vector<VarlenItem> items;           ///< in packing order (ascending q_begin)
  std::vector<std::int32_t> cu_seqlens_q;  ///< items + 1 entries, from 0
  std::vector<std::int32_t> cu_seqlens_k;  ///< items + 1 entries, from 0
  std::int64_t max_q = 0, max_k = 0;       ///< the longest item's lengths
  std::vector<RowSegment> q_rows, k_rows;  ///< packed rows as buffer segments (contiguous runs merged)
  [[nodiscard]] std::int64_t total_q() const noexcept { return cu_seqlens_q.empty() ? 0 : cu_seqlens_q.back(); }
  [[nodiscard]] std::int64_t total_k() const noexcept { return cu_seqlens_k.empty() ? 0 : cu_seqlens_k.back(); }
  /// The packed queries are buffer rows [q_rows[0].begin, + total_q): a view, no gather.
  [[nodiscard]] bool q_contiguous() const noexcept { return q_rows.size() == 1; }
  [[nodiscard]] bool k_contiguous() const noexcept { return k_rows.size() == 1; }
};

/// The items of `slices`: every visible (query, key) pair of the slices in exactly one item, and no other
/// pair; every row of an item sees at least one key. Never refuses a well-formed slice table.
[[nodiscard]] inline std::vector<VarlenItem> varlen_items(std::span<const AttnSlice> slices) {
  std::vector<VarlenItem> items;
  items.reserve(slices.size() + slices.size() / 2);
  for (std::size_t i = 0; i < slices.size(); ++i) {
    const AttnSlice& s = slices[i];
    const std::int64_t q = s.q_range.size(), k = s.k_range.size();
    if (q <= 0 || k <= 0) continue;
    if (s.mask.kind == MaskKind::kFull) {
      items.push_back({s.q_range.begin, q, s.k_range.begin, k, {}, i});
      continue;
    }
    const bool window = s.mask.kind == MaskKind::kSlidingWindow;
    const std::int64_t o = s.mask.causal_offset, w = s.mask.window;
    // Slice-relative row i sees [max(0, i + o - w + 1), min(k, i + o + 1)) (Mask::visible_keys).
    const std::int64_t r0 = std::clamp<std::int64_t>(-o, 0, q);  // first row that sees key 0's diagonal
    // End of the rows that see any key: all of them for causal; for a window, i + o - w + 1 < k.
    const std::int64_t r_end = window ? std::clamp<std::int64_t>(seqpar::detail::add_sat(k - o, w - 1), r0, q) : q;
    if (r0 >= r_end) continue;
    // Rows [r0, r_in) keep their diagonal inside the keys (i + o < k): an item with keys [0, r_in + o).
    const std::int64_t r_in = std::clamp<std::int64_t>(k - o, r0, r_end);
    if (r_in > r0) {
      const std::int64_t sk = r_in + o;  // sk - sq = r0 + o: item row 0 (slice row r0) has its diagonal at r0 + o
      VarlenMask m{-1, 0};
      if (window && w - 1 < sk) m.left = w - 1;
      items.push_back({s.q_range.begin + r0, r_in - r0, s.k_range.begin, sk, m, i});
    }
    if (r_in == r_end) continue;
    // Rows [r_in, r_end) see up to the slice's last key.
    if (!window) {
      items.push_back({s.q_range.begin + r_in, r_end - r_in, s.k_range.begin, k, {}, i});
      continue;
    }
    // Their first key: row r_in's window start. Row i (item row t = i - r_in) must see j >= i + o - w + 1;
    // FA's bound is u >= t + sk - sq - left with u = j - c: left = k - r_end - o + w - 1 (>= 0 because row
    // r_end - 1 sees a key), no right bound (the keys end at the slice's).
    const std::int64_t c = std::max<std::int64_t>(0, seqpar::detail::sub_sat(r_in + o + 1, w));
    const std::int64_t sk = k - c;
    VarlenMask m{seqpar::detail::add_sat(k - r_end - o - 1, w), -1};  // saturated: w may be huge
    if (m.left >= sk) m.left = -1;                                    // never cuts: a full item
    items.push_back({s.q_range.begin + r_in, r_end - r_in, s.k_range.begin + c, sk, m, i});
  }
  return items;
}

namespace varlen_detail {
inline void push_rows(std::vector<RowSegment>& segs, std::int64_t begin, std::int64_t rows) {
  if (!segs.empty() && segs.back().begin + segs.back().rows == begin)
    segs.back().rows += rows;
  else
    segs.push_back({begin, rows});
}
inline std::int32_t checked_offset(std::int64_t total, const char* where, const char* what) {
  seqpar::detail::require(total <= std::numeric_limits<std::int32_t>::max(), where, what, total,
                          "exceeds FlashAttention's int32 cumulative sequence lengths; split the batch");
  return static_cast<std::int32_t>(total);
}
inline VarlenCall make_call(VarlenMask mask, std::vector<VarlenItem> items, const char* where) {
  std::sort(items.begin(), items.end(), [](const VarlenItem& a, const VarlenItem& b) { return a.q_begin < b.q_begin; });
  VarlenCall call;
  call.mask = mask;
  call.cu_seqlens_q.reserve(items.size() + 1);
  call.cu_seqlens_k.reserve(items.size() + 1);
  call.cu_seqlens_q.push_back(0);
  call.cu_seqlens_k.push_back(0);
  std::int64_t tq = 0, tk = 0;
  for (const VarlenItem& it : items) {
    tq += it.q_len;
    tk += it.k_len;
    call.cu_seqlens_q.push_back(checked_offset(tq, where, "packed query rows of a varlen call"));
    call.cu_seqlens_k.push_back(checked_offset(tk, where, "packed key rows of a varlen call"));
    call.max_q = std::max(call.max_q, it.q_len);
    call.max_k = std::max(call.max_k, it.k_len);
    push_rows(call.q_rows, it.q_begin, it.q_len);
    push_rows(call.k_rows, it.k_begin, it.k_len);
  }
  call.items = std::move(items);
  return call;
}
}  // namespace varlen_detail

/// The varlen calls of one kernel call: items grouped by mask; for the backward each group cut into waves
/// of pairwise key-disjoint items (greedy interval colouring by key begin: the fewest waves). `where`
/// names the caller in the one error (offsets past int32).
[[nodiscard]] inline std::vector<VarlenCall> varlen_calls(std::span<const AttnSlice> slices, Pass pass,
                                                          const char* where) {
  std::vector<VarlenItem> items = varlen_items(slices);
  std::stable_sort(items.begin(), items.end(), [](const VarlenItem& a, const VarlenItem& b) {
    if (a.mask != b.mask) return a.mask < b.mask;
    return a.k_begin < b.k_begin;
  });
  std::vector<VarlenCall> calls;
  for (std::size_t first = 0; first < items.size();) {
    std::size_t last = first;
    while (last < items.size() && items[last].mask == items[first].mask) ++last;
    if (pass == Pass::kForward) {
      calls.push_back(varlen_detail::make_call(
          items[first].mask,
          {items.begin() + static_cast<std::ptrdiff_t>(first), items.begin() + static_cast<std::ptrdiff_t>(last)},
          where));
    } else {
      std::vector<std::vector<VarlenItem>> waves;
      std::vector<std::int64_t> wave_end;
      for (std::size_t i = first; i < last; ++i) {
        std::size_t w = 0;
        while (w < waves.size() && wave_end[w] > items[i].k_begin) ++w;
        if (w == waves.size()) {
          waves.emplace_back();
          wave_end.push_back(0);
        }
        waves[w].push_back(items[i]);
        wave_end[w] = items[i].k_begin + items[i].k_len;  // ascending k_begin: the wave's end moves forward
      }
      for (auto& wave : waves) calls.push_back(varlen_detail::make_call(items[first].mask, std::move(wave), where));
    }
    first = last;
  }
  return calls;
}

}  // namespace seqpar::attention::detail
