// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// How a slice table becomes cuDNN's ragged SDPA batches (attention::CudnnSdpa): host-side, plain C++.
///
/// cuDNN's fused attention over a ragged (THD) batch takes, per batch item, a query and a key range
/// (ragged offsets and sequence lengths) and ONE mask for the whole graph: none, causal aligned to the
/// bottom-right corner (row i sees key j <= i + s_kv - s_q), or that band with a left bound w (sliding
/// window: j > i + s_kv - s_q - w). Bottom-right alignment makes the diagonal offset a per-item
/// quantity, so any slice whose diagonal is `causal_offset` maps exactly once its rows and keys are
/// trimmed so that s_kv - s_q equals the offset. The trimming is FlashAttention's varlen mapping
/// (attention::detail::varlen_items: one lowering for both); sdpa_items names its masks as cuDNN's:
///  - rows before the first visible key (offset < 0) see nothing: they stay empty (O = 0, LSE = -inf);
///  - causal: rows whose diagonal stays inside the keys form a causal item with s_kv = s_q + offset;
///    the rows after them see every key and form a full (unmasked) item;
///  - sliding window: the same causal part, with the window as the graph's left bound; rows whose
///    window reaches past the last key would need a band cut on the right, which cuDNN cannot say:
///    such a slice is refused by name (CudaFlash and the CPU kernels compute it).
/// Items are grouped into runs (one graph execution each) by mask class and window. A backward run
/// also needs key-disjoint items (cuDNN writes dK/dV, it does not add), so backward runs are split
/// into waves whose key ranges do not overlap; and every run is cut so that its padded statistics
/// (items x longest query) stay within twice the query rows, which bounds the workspace. A run's items
/// are then sorted by first query row, and its tables (sdpa_run_tables) padded to a power-of-two count
/// (issue 38, A3 and C1).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "seqpar/attention/detail/varlen_calls.hpp"
#include "seqpar/core/attn_slice.hpp"

namespace seqpar::gpu::detail {

/// The mask of a cuDNN run: none, bottom-right causal, or bottom-right causal with a left bound.
enum class SdpaMask : std::uint8_t { kFull, kCausal, kWindow };

/// One batch item: query rows [q_begin, q_begin + q_len) and keys [k_begin, k_begin + k_len) of the
/// call's buffers, under the run's mask (bottom-right aligned: the diagonal offset is k_len - q_len).
struct SdpaItem {
  std::int64_t q_begin = 0, q_len = 0, k_begin = 0, k_len = 0;
  SdpaMask mask = SdpaMask::kFull;
  std::int64_t window = 0;  ///< kWindow only
  std::size_t slice = 0;    ///< the slice it came from (errors and tests)
};

/// One graph execution: items of one mask (and window) that cuDNN runs as one ragged batch.
struct SdpaRun {
  SdpaMask mask = SdpaMask::kFull;
  std::int64_t window = 0;
  std::vector<SdpaItem> items;
  std::int64_t max_q = 0, max_k = 0;  ///< the graph's S_q and S_kv (longest item)
};

/// The items of `slices`, every visible (query, key) pair in exactly one item and no other pair; the
/// rows of no item are empty. Throws std::invalid_argument (naming the slice) for a sliding window
/// whose rows reach past the slice's last key.
///
/// Which rows and keys each item covers, and its diagonal, are decided in one place: the varlen mapping
/// (attention::detail::varlen_items, include/seqpar/attention/detail/varlen_calls.hpp) whose items are
/// bottom-right aligned as cuDNN's. This only says each of its masks as cuDNN's one-mask-per-graph:
///  - no bound: kFull; causal with no left bound: kCausal;
///  - causal with left bound L: the window L + 1 (FA's L counts the keys before the diagonal), which cuts
///    some row only when L + 1 < s_kv (issue 38, B4: the last row sees keys from s_kv - 1 - L); one that
///    cuts nothing is kCausal. It merges such items into the causal runs and keeps windows of 2^31 and
///    more (a "no window" sentinel) out of cuDNN's int band bound: a window left in an item is below its
///    s_kv, which fits in int32 (the calls check their buffers);
///  - a left bound with no right bound: the rows of a window slice past the last key's diagonal, whose
///    bands the slice's end cuts on the right. cuDNN cannot say that: refused by name, unless the item
///    is the whole rest of the slice from its first key on and its bound cuts nothing (every row past
///    the diagonal sees every key, window >= rows + offset): then it is kFull.
[[nodiscard]] inline std::vector<SdpaItem> sdpa_items(std::span<const AttnSlice> slices, const char* where) {
  const std::vector<attention::detail::VarlenItem> varlen = attention::detail::varlen_items(slices);
  std::vector<SdpaItem> items;
  items.reserve(varlen.size());
  for (const attention::detail::VarlenItem& v : varlen) {
    SdpaItem it{v.q_begin, v.q_len, v.k_begin, v.k_len, SdpaMask::kFull, 0, v.slice};
    if (v.mask.right == 0) {
      const bool cuts = v.mask.left >= 0 && v.mask.left + 1 < v.k_len;
      it.mask = cuts ? SdpaMask::kWindow : SdpaMask::kCausal;
      it.window = cuts ? v.mask.left + 1 : 0;
    } else if (v.mask.left >= 0) {
      const AttnSlice& s = slices[v.slice];
      // In slice terms: refused exactly when the slice's last row does not see its first key (window <
      // rows + offset), as before this mapping was shared. That also refuses the two remainders whose
      // bound cuts nothing but whose rows are not all of the slice's rest from key 0 (one row, or one key
      // with rows after it that see none): exact as kFull items, left refused to keep the contract.
      const bool whole_rest = v.k_begin == s.k_range.begin && v.q_begin + v.q_len == s.q_range.end;
      if (!whole_rest || v.mask.left + 1 < v.k_len)
        throw std::invalid_argument(
            std::string(where) + ": slices[" + std::to_string(v.slice) + "] (q " + std::to_string(s.q_range.begin) +
            ".." + std::to_string(s.q_range.end) + ", k " + std::to_string(s.k_range.begin) + ".." +
            std::to_string(s.k_range.end) + ", sliding window " + std::to_string(s.mask.window) + ", offset " +
            std::to_string(s.mask.causal_offset) +
            "): rows whose window reaches past the slice's last key need a band cut on the right, which cuDNN's "
            "SDPA cannot express; pass keys up to the last row's diagonal, or use CudaFlash");
    }
    items.push_back(it);
  }
  return items;
}

/// Runs of `items`: grouped by mask and window; with `key_disjoint` (backward) split into waves whose
/// key ranges do not overlap; each cut so that items x longest query <= 2 * max(q_rows, longest); each
/// run's items sorted by first query row (issue 38, A3: its Q, O, dO and dQ ragged offsets increase,
/// as in the packed batches every other cuDNN user passes; items are query-disjoint, so they are
/// strictly increasing).
[[nodiscard]] inline std::vector<SdpaRun> sdpa_runs(std::vector<SdpaItem> items, std::int64_t q_rows,
                                                    bool key_disjoint) {
  std::sort(items.begin(), items.end(), [](const SdpaItem& a, const SdpaItem& b) {
    if (a.mask != b.mask) return a.mask < b.mask;
    if (a.window != b.window) return a.window < b.window;
    return a.k_begin < b.k_begin;
  });
  std::vector<SdpaRun> runs;
  for (std::size_t first = 0; first < items.size();) {
    std::size_t last = first;
    while (last < items.size() && items[last].mask == items[first].mask && items[last].window == items[first].window)
      ++last;
    // Waves (interval colouring, greedy by key begin: optimal for intervals).
    std::vector<std::vector<SdpaItem>> waves;
    std::vector<std::int64_t> wave_end;
    for (std::size_t i = first; i < last; ++i) {
      const SdpaItem& it = items[i];
      std::size_t w = 0;
      if (key_disjoint)
        while (w < waves.size() && wave_end[w] > it.k_begin) ++w;
      if (w == waves.size()) {
        waves.emplace_back();
        wave_end.push_back(0);
      }
      waves[w].push_back(it);
      wave_end[w] = std::max(wave_end[w], it.k_begin + it.k_len);
    }
    for (auto& wave : waves) {
      // Longest query first, then cut where the padding would exceed the bound.
      std::stable_sort(wave.begin(), wave.end(),
                       [](const SdpaItem& a, const SdpaItem& b) { return a.q_len > b.q_len; });
      for (std::size_t b = 0; b < wave.size();) {
        SdpaRun run{wave[b].mask, wave[b].window, {}, wave[b].q_len, 0};
        const std::int64_t cap = 2 * std::max(q_rows, run.max_q);
        std::size_t e = b;
        while (e < wave.size() && static_cast<std::int64_t>(e - b + 1) * run.max_q <= cap) {
          run.items.push_back(wave[e]);
          run.max_k = std::max(run.max_k, wave[e].k_len);
          ++e;
        }
        std::sort(run.items.begin(), run.items.end(),
                  [](const SdpaItem& x, const SdpaItem& y) { return x.q_begin < y.q_begin; });
        runs.push_back(std::move(run));
        b = e;
      }
    }
    first = last;
  }
  return runs;
}

/// Floats of padded statistics a run needs per head (items x longest query): at most this bound.
[[nodiscard]] constexpr std::int64_t sdpa_stats_rows_bound(std::int64_t q_rows) noexcept {
  return 2 * q_rows;
}

/// A graph's S_q / S_kv for a longest item of n rows, and its batch size for n items: the next power of
/// two, at least 2, so that a training run's changing document mixes reuse a few graphs (issue 38, C1).
/// At least 2: cudnn-frontend's backward refuses S_q = S_kv = 1 (scaled_dot_product_flash_attention.h,
/// 1.32), which a run of one-token items would ask for; the padding mask carries the true lengths.
[[nodiscard]] constexpr std::int64_t sdpa_bucket(std::int64_t n) noexcept {
  std::int64_t b = 2;
  while (b < n) b *= 2;
  return b;
}

/// Floats of padded statistics per head of a run as a graph sees it, (bucketed items) x (bucketed
/// longest query): each bucket at most doubles, so at most 4 x sdpa_stats_rows_bound (8 q_rows, at least
/// 8 for the 2 x 2 of a one-row call).
[[nodiscard]] constexpr std::int64_t sdpa_graph_stats_rows_bound(std::int64_t q_rows) noexcept {
  return 4 * sdpa_stats_rows_bound(q_rows < 1 ? 1 : q_rows);
}

/// A run's item tables as a graph reads them (uploaded by CudnnSdpa::prepare): `padded` entries (the
/// item count bucketed with sdpa_bucket when padding, else the item count) of first query and key
/// token and lengths, then one end entry. Padding items have q_len = k_len = 0 and sit at the end of
/// the run's rows. Zero-length padding is how TransformerEngine pads its THD batch to max_b (the
/// 2026-12-06 static review; not checked on a GPU here): cudnn-frontend #943's NaN rows come from
/// seq_len_kv = 0 with seq_len_q > 0 (cuDNN 9.22-9.24), which a padding item never has, as it has no
/// row. CudnnSdpa::Arguments::pad_items turns it off should a device run show otherwise. At the end of
/// the run's rows, the query offsets stay increasing. `rows_q` / `rows_k`: prefix sums of the real
/// items' query and key lengths (padded + 1 entries), the row ranges the backward zeroes and adds
/// (a backward run is key-disjoint, so each key row is in at most one item).
struct SdpaRunTables {
  std::int64_t padded = 0;
  std::vector<std::int64_t> q_tokens, k_tokens;  ///< padded + 1
  std::vector<std::int32_t> q_lens, k_lens;      ///< padded
  std::vector<std::int64_t> rows_q, rows_k;      ///< padded + 1
};

[[nodiscard]] inline SdpaRunTables sdpa_run_tables(const SdpaRun& run, bool pad_items) {
  SdpaRunTables t;
  const auto n = static_cast<std::int64_t>(run.items.size());
  t.padded = pad_items ? sdpa_bucket(n) : n;
  const auto m = static_cast<std::size_t>(t.padded);
  t.q_tokens.assign(m + 1, 0);
  t.k_tokens.assign(m + 1, 0);
  t.q_lens.assign(m, 0);
  t.k_lens.assign(m, 0);
  t.rows_q.assign(m + 1, 0);
  t.rows_k.assign(m + 1, 0);
  std::int64_t q_end = 0, k_end = 0;
  for (std::size_t b = 0; b < run.items.size(); ++b) {
    const SdpaItem& it = run.items[b];
    t.q_tokens[b] = it.q_begin;
    t.k_tokens[b] = it.k_begin;
    // int32 lengths: the call checks that its buffers hold fewer than 2^31 elements (ragged offsets).
    t.q_lens[b] = static_cast<std::int32_t>(it.q_len);
    t.k_lens[b] = static_cast<std::int32_t>(it.k_len);
    q_end = std::max(q_end, it.q_begin + it.q_len);
    k_end = std::max(k_end, it.k_begin + it.k_len);
    t.rows_q[b + 1] = t.rows_q[b] + it.q_len;
    t.rows_k[b + 1] = t.rows_k[b] + it.k_len;
  }
  for (std::size_t b = run.items.size(); b <= m; ++b) {  // the padding items and the end entry
    t.q_tokens[b] = q_end;
    t.k_tokens[b] = k_end;
    t.rows_q[b] = t.rows_q[run.items.size()];
    t.rows_k[b] = t.rows_k[run.items.size()];
  }
  return t;
}

}  // namespace seqpar::gpu::detail
