// SPDX-License-Identifier: Apache-2.0
// The CPU side of attention::CudnnSdpa (kernels/seqpar/gpu/detail/sdpa_items.hpp): slice tables become
// cuDNN ragged batch items whose masks (none, or bottom-right causal, with a left bound for sliding
// windows) cover exactly the visible pairs of the slices, once each; backward runs are key-disjoint;
// every run's padded statistics stay within the workspace's bound; an inexpressible sliding window is
// refused by name. Brute force over random slices: every (query, key) pair of every slice is checked.
// And the head sizes CudnnSdpa accepts per compute capability (cudnn_sdpa_shape_status: MLA's 192/128
// from sm_90 on, other unequal pairs never), which needs no device.
#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "seqpar/core/attention_shape.hpp"
#include "seqpar/core/attn_slice.hpp"
#include "seqpar/gpu/cudnn_sdpa.hpp"
#include "seqpar/gpu/detail/sdpa_items.hpp"

namespace seqpar::test {
namespace {

using gpu::detail::SdpaItem;
using gpu::detail::SdpaMask;

// Does item row i (item-relative) see item key j, under cuDNN's bottom-right mask?
bool item_sees(const SdpaItem& it, std::int64_t i, std::int64_t j) {
  if (j < 0 || j >= it.k_len || i < 0 || i >= it.q_len) return false;
  if (it.mask == SdpaMask::kFull) return true;
  const std::int64_t diag = i + it.k_len - it.q_len;  // bottom-right alignment
  if (j > diag) return false;
  return it.mask == SdpaMask::kCausal || j > diag - it.window;
}

// A run's item tables (sdpa_run_tables): the real items in order, then zero-length padding items at the
// run's end (the query offsets never decrease), a power-of-two count when padding, prefix sums of the
// real lengths.
void check_tables(const gpu::detail::SdpaRun& run, const gpu::detail::SdpaRunTables& t, bool pad) {
  const auto n = static_cast<std::int64_t>(run.items.size());
  if (pad) {
    CHECK(t.padded >= n);
    CHECK(t.padded >= 2);
    CHECK((t.padded & (t.padded - 1)) == 0);
    CHECK(t.padded < 2 * std::max<std::int64_t>(n, 2));
  } else {
    CHECK(t.padded == n);
  }
  const auto m = static_cast<std::size_t>(t.padded);
  REQUIRE(t.q_tokens.size() == m + 1);
  REQUIRE(t.k_tokens.size() == m + 1);
  REQUIRE(t.q_lens.size() == m);
  REQUIRE(t.k_lens.size() == m);
  REQUIRE(t.rows_q.size() == m + 1);
  REQUIRE(t.rows_k.size() == m + 1);
  std::int64_t rq = 0, rk = 0;
  for (std::size_t b = 0; b < m; ++b) {
    CHECK(t.rows_q[b] == rq);
    CHECK(t.rows_k[b] == rk);
    if (b < run.items.size()) {
      const SdpaItem& it = run.items[b];
      CHECK(t.q_tokens[b] == it.q_begin);
      CHECK(t.k_tokens[b] == it.k_begin);
      CHECK(t.q_lens[b] == it.q_len);
      CHECK(t.k_lens[b] == it.k_len);
    } else {
      CHECK(t.q_lens[b] == 0);
      CHECK(t.k_lens[b] == 0);
    }
    CHECK(t.q_tokens[b] <= t.q_tokens[b + 1]);  // monotone query offsets, padding included
    rq += t.q_lens[b];
    rk += t.k_lens[b];
  }
  CHECK(t.rows_q[m] == rq);
  CHECK(t.rows_k[m] == rk);
}

// Every pair of the buffers (query row, key row) the slices make visible, against the items'.
void check_cover(const std::vector<AttnSlice>& slices, std::int64_t q_rows, std::int64_t k_rows) {
  const auto items = gpu::detail::sdpa_items(slices, "test");
  std::map<std::pair<std::int64_t, std::int64_t>, int> want, got;
  for (const AttnSlice& s : slices)
    for (std::int64_t i = 0; i < s.q_range.size(); ++i) {
      const Range vis = s.mask.visible_keys(i, s.k_range.size());
      for (std::int64_t j = vis.begin; j < vis.end; ++j) ++want[{s.q_range.begin + i, s.k_range.begin + j}];
    }
  for (const SdpaItem& it : items) {
    CHECK(it.q_begin >= 0);
    CHECK(it.q_begin + it.q_len <= q_rows);
    CHECK(it.k_begin >= 0);
    CHECK(it.k_begin + it.k_len <= k_rows);
    CHECK(it.q_len > 0);
    CHECK(it.k_len > 0);
    for (std::int64_t i = 0; i < it.q_len; ++i)
      for (std::int64_t j = 0; j < it.k_len; ++j)
        if (item_sees(it, i, j)) ++got[{it.q_begin + i, it.k_begin + j}];
  }
  CHECK(got == want);
  // Items of one call never share a query row (the forward writes O and LSE of each row once).
  std::vector<int> rows(static_cast<std::size_t>(q_rows), 0);
  for (const SdpaItem& it : items)
    for (std::int64_t i = 0; i < it.q_len; ++i) ++rows[static_cast<std::size_t>(it.q_begin + i)];
  for (int r : rows) CHECK(r <= 1);

  for (bool backward : {false, true}) {
    const auto runs = gpu::detail::sdpa_runs(items, q_rows, backward);
    std::size_t n = 0;
    for (const auto& run : runs) {
      n += run.items.size();
      std::int64_t longest = 0;
      for (const SdpaItem& it : run.items) {
        CHECK(it.mask == run.mask);
        CHECK(it.window == run.window);
        CHECK(it.q_len <= run.max_q);
        CHECK(it.k_len <= run.max_k);
        longest = std::max(longest, it.q_len);
      }
      CHECK(longest == run.max_q);
      CHECK(static_cast<std::int64_t>(run.items.size()) * run.max_q <= gpu::detail::sdpa_stats_rows_bound(q_rows));
      // A3: a run's items in increasing first query row (query-disjoint, so strictly), its Q/O/dO/dQ
      // ragged offsets increasing as in a packed batch.
      for (std::size_t a = 1; a < run.items.size(); ++a)
        CHECK(run.items[a - 1].q_begin + run.items[a - 1].q_len <= run.items[a].q_begin);
      // B4: a window left in a run cuts some row of its item (it is below the item's s_kv).
      if (run.mask == SdpaMask::kWindow)
        for (const SdpaItem& it : run.items) CHECK(it.window < it.k_len);
      // C1: the tables a graph reads, padded and not: the statistics (bucketed items x bucketed longest
      // query per head, un-ragged) stay within the workspace's bound.
      for (const bool pad : {false, true}) {
        const auto t = gpu::detail::sdpa_run_tables(run, pad);
        check_tables(run, t, pad);
        CHECK(t.padded * gpu::detail::sdpa_bucket(run.max_q) <= gpu::detail::sdpa_graph_stats_rows_bound(q_rows));
      }
      if (backward)  // cuDNN writes dK/dV: one run never holds two items with a common key
        for (std::size_t a = 0; a < run.items.size(); ++a)
          for (std::size_t b = a + 1; b < run.items.size(); ++b) {
            const SdpaItem &x = run.items[a], &y = run.items[b];
            CHECK((x.k_begin + x.k_len <= y.k_begin || y.k_begin + y.k_len <= x.k_begin));
          }
    }
    CHECK(n == items.size());
  }
}

TEST_SUITE("cuda_host") {
  TEST_CASE("CudnnSdpa items: hand-made slices of every mask and offset cover exactly the visible pairs") {
    // Document-causal diagonal blocks, a causal slice whose keys end before its last row's diagonal
    // (a full tail), a negative offset (empty first rows), keys past the diagonal (trimmed), a full
    // slice, sliding windows inside their keys, and slices sharing keys.
    check_cover({{{0, 8}, {0, 8}, Mask::causal()},
                 {{8, 20}, {8, 20}, Mask::causal()},
                 {{20, 30}, {0, 6}, Mask::causal(3)},
                 {{30, 40}, {0, 40}, Mask::causal(-4)},
                 {{40, 45}, {10, 40}, Mask::causal(2)},
                 {{45, 50}, {20, 30}, Mask::full()},
                 {{50, 60}, {0, 12}, Mask::sliding_window(3, 2)},
                 {{60, 64}, {0, 12}, Mask::sliding_window(1)}},
                64, 40);
  }

  TEST_CASE("CudnnSdpa items: random slice tables (every mask, offsets of both signs, shared keys)") {
    std::mt19937_64 rng(20261204);
    for (int trial = 0; trial < 300; ++trial) {
      const std::int64_t q_rows = 1 + static_cast<std::int64_t>(rng() % 60),
                         k_rows = 1 + static_cast<std::int64_t>(rng() % 60);
      std::vector<AttnSlice> slices;
      std::int64_t q = 0;
      while (q < q_rows) {
        const std::int64_t len = std::min<std::int64_t>(q_rows - q, 1 + static_cast<std::int64_t>(rng() % 12));
        const std::int64_t kb = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(k_rows));
        const std::int64_t ke = kb + static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(k_rows - kb + 1));
        const std::int64_t offset = static_cast<std::int64_t>(rng() % 21) - 8;
        Mask m = Mask::full();
        switch (rng() % 3) {
          case 0:
            m = Mask::full();
            break;
          case 1:
            m = Mask::causal(offset);
            break;
          default: {
            // A window that cuDNN can say: the keys reach past the last row's diagonal (or it sees
            // nothing there), so no row's window is cut by the last key.
            // One in four: a window that cuts nothing (B4), up to INT64_MAX.
            const std::int64_t w = rng() % 4 == 0 ? std::numeric_limits<std::int64_t>::max() - (rng() % 2)
                                                  : 1 + static_cast<std::int64_t>(rng() % 6);
            m = Mask::sliding_window(w, offset);
            break;
          }
        }
        AttnSlice s{{q, q + len}, {kb, ke}, m};
        bool expressible = true;
        try {
          (void)gpu::detail::sdpa_items(std::vector<AttnSlice>{s}, "test");
        } catch (const std::invalid_argument&) {
          expressible = false;
        }
        if (expressible) slices.push_back(s);
        q += len;
      }
      CAPTURE(trial);
      check_cover(slices, q_rows, k_rows);
    }
  }

  TEST_CASE("CudnnSdpa items: a window that cuts no row is the causal mask, up to INT64_MAX (B4)") {
    constexpr std::int64_t kHuge = std::numeric_limits<std::int64_t>::max();
    // Windows at, just below and far above the item's s_kv, with and without a full tail, offsets of both
    // signs: the cover is exact and windows that cut nothing leave no window item.
    for (const std::int64_t offset : {-3, 0, 2, 7})
      for (const std::int64_t w : {std::int64_t{1}, std::int64_t{9}, std::int64_t{10}, std::int64_t{11},
                                   std::int64_t{40}, std::int64_t{1} << 31, kHuge - 1, kHuge}) {
        CAPTURE(offset);
        CAPTURE(w);
        const std::vector<AttnSlice> inside{{{0, 10}, {0, 40}, Mask::sliding_window(w, offset)}};
        check_cover(inside, 10, 40);
        for (const SdpaItem& it : gpu::detail::sdpa_items(inside, "test")) {
          CHECK(it.mask != SdpaMask::kFull);  // the keys reach past every row's diagonal: no full tail
          CHECK((it.mask == SdpaMask::kWindow) == (w < it.k_len));
        }
        // Keys that end before the last rows' diagonal: a huge window is causal with a full tail.
        const std::vector<AttnSlice> tail{{{0, 10}, {0, 6}, Mask::sliding_window(w, offset)}};
        bool expressible = true;
        try {
          (void)gpu::detail::sdpa_items(tail, "test");
        } catch (const std::invalid_argument&) {
          expressible = false;
        }
        if (w >= 10 + offset + 6) CHECK(expressible);  // no row is cut: causal plus a full tail
        if (expressible) check_cover(tail, 10, 6);
      }
    // A window slice and a causal one that it equals merge into one run.
    const std::vector<AttnSlice> both{{{0, 10}, {0, 10}, Mask::causal()},
                                      {{10, 20}, {10, 20}, Mask::sliding_window(kHuge)}};
    const auto runs = gpu::detail::sdpa_runs(gpu::detail::sdpa_items(both, "test"), 20, false);
    REQUIRE(runs.size() == 1);
    CHECK(runs[0].mask == SdpaMask::kCausal);
    CHECK(runs[0].items.size() == 2);
  }

  TEST_CASE("CudnnSdpa items: runs sorted by first query row, padded tables (A3, C1)") {
    // Items of very different lengths (the run used to be sorted longest first), a one-row document
    // between long ones, and a short slice at the end of a long buffer.
    const std::vector<AttnSlice> s{{{0, 3}, {0, 3}, Mask::causal()},
                                   {{3, 40}, {3, 40}, Mask::causal()},
                                   {{40, 41}, {40, 41}, Mask::causal()},
                                   {{41, 90}, {41, 90}, Mask::causal()},
                                   {{990, 1000}, {990, 1000}, Mask::causal()}};
    check_cover(s, 1000, 1000);
    const auto runs = gpu::detail::sdpa_runs(gpu::detail::sdpa_items(s, "test"), 1000, true);
    REQUIRE(runs.size() == 1);
    REQUIRE(runs[0].items.size() == 5);
    const auto t = gpu::detail::sdpa_run_tables(runs[0], true);
    CHECK(t.padded == 8);
    CHECK(t.q_tokens == std::vector<std::int64_t>{0, 3, 40, 41, 990, 1000, 1000, 1000, 1000});
    CHECK(t.q_lens == std::vector<std::int32_t>{3, 37, 1, 49, 10, 0, 0, 0});
    CHECK(t.rows_q == std::vector<std::int64_t>{0, 3, 40, 41, 90, 100, 100, 100, 100});
    CHECK(gpu::detail::sdpa_bucket(1) == 2);
    CHECK(gpu::detail::sdpa_bucket(2) == 2);
    CHECK(gpu::detail::sdpa_bucket(3) == 4);
    CHECK(gpu::detail::sdpa_bucket(4096) == 4096);
    CHECK(gpu::detail::sdpa_bucket(4097) == 8192);
  }

  TEST_CASE("CudnnSdpa version gates: cuDNN and cudnn-frontend versions, device, shape, mask (B2)") {
    using attention::CudnnSdpaFeatures;
    using attention::CudnnVersions;
    const AttentionShape mha{4, 4, 128}, gqa{8, 2, 128};
    AttentionShape mla{4, 2, 192};
    mla.head_dim_v = 128;
    const CudnnSdpaFeatures none{}, causal{true, false, false}, window{true, true, false}, det{false, false, true};
    const auto gate = [](std::int64_t cudnn, int cc, const AttentionShape& shape, const CudnnSdpaFeatures& f,
                         std::int64_t frontend = 13200) {
      return attention::cudnn_sdpa_version_status(CudnnVersions{cudnn, frontend}, cc, shape, f, "CudnnSdpa");
    };
    const auto refused_as = [](const Status& s, const char* text) {
      CAPTURE(s.reason);
      return !s && s.reason.find(text) != std::string::npos;
    };
    // torch 2.11's cuDNN 9.19.0 with cudnn-frontend 1.32 runs everything on Hopper.
    for (const auto& f : {none, causal, window, det}) {
      CHECK(gate(91900, 90, mha, f));
      CHECK(gate(91900, 90, gqa, f));
      CHECK(gate(91900, 90, mla, f));
    }
    CHECK(refused_as(gate(91900, 90, mha, none, 10800), "cudnn_frontend version = 1.8.0"));
    CHECK(refused_as(gate(90000, 90, mha, none, 10800), "needs 1.9.0"));
    CHECK(refused_as(gate(80906, 90, mha, none), "cuDNN version = 8.9.6"));
    CHECK(refused_as(gate(91000, 90, mha, none), "known bugs in 9.10.0 and 9.10.1"));
    CHECK(refused_as(gate(91001, 100, mha, none), "use 9.10.2 or newer"));
    // Ragged batches before Hopper: 9.18.1.
    CHECK(refused_as(gate(91800, 80, mha, none), "ragged (THD) batches on compute capability 8.0"));
    CHECK(refused_as(gate(91800, 89, mha, none), "needs 9.18.1"));
    CHECK(gate(91801, 80, mha, causal));
    CHECK(gate(91801, 86, gqa, window));
    CHECK(gate(90000, 120, mha, none));  // sm_120 is past the ragged check's "< 9.0"
    // GQA and bottom-right masks: 9.6.0.
    CHECK(gate(90500, 90, mha, none));
    CHECK(refused_as(gate(90500, 90, gqa, none), "grouped KV heads (shape.heads_q 8 != shape.heads_kv 2)"));
    CHECK(refused_as(gate(90500, 90, mha, causal), "a bottom-right causal mask over ragged batches needs 9.6.0"));
    CHECK(gate(90600, 90, gqa, causal));
    // Sliding windows on Hopper: 9.10.2 (other devices: 9.6.0 with the bottom-right mask).
    CHECK(refused_as(gate(90900, 90, mha, window), "a sliding window (bottom-right band) on Hopper needs 9.10.2"));
    CHECK(gate(91002, 90, mha, window));
    CHECK(gate(90900, 100, mha, window));
    // 192/128 on Blackwell: 9.11.0.
    CHECK(refused_as(gate(91002, 100, mla, none), "head sizes 192/128 on Blackwell needs 9.11.0"));
    CHECK(gate(91100, 100, mla, none));
    CHECK(gate(91002, 90, mla, none));
    // cuDNN's deterministic backward: none on sm_8x / sm_12x for ragged batches; Blackwell from 9.18.0.
    CHECK(refused_as(gate(91900, 80, mha, det), "arguments.deterministic = true"));
    CHECK(refused_as(gate(91900, 120, mha, det), "SM8X and SM12X"));
    CHECK(refused_as(gate(91700, 100, mha, det), "deterministic backward on Blackwell needs 9.18.0"));
    CHECK(gate(91800, 100, mha, det));
    CHECK(gate(90600, 90, mha, det));
  }

  TEST_CASE("CudnnSdpa items: a sliding window cut by its slice's last key is refused by name") {
    // Rows 0..9, keys 0..4, window 3: rows past key 4 still see keys 2..4, a band cut on the right.
    const std::vector<AttnSlice> s{{{0, 10}, {0, 5}, Mask::sliding_window(3)}};
    CHECK_THROWS_WITH_AS(gpu::detail::sdpa_items(s, "CudnnSdpa::prepare"),
                         doctest::Contains("CudnnSdpa::prepare: slices[0]"), std::invalid_argument);
    // The same window whose later rows see nothing (keys end long before) is fine: those rows are empty.
    const std::vector<AttnSlice> t{{{0, 10}, {0, 3}, Mask::sliding_window(1)}};
    CHECK_NOTHROW(check_cover(t, 10, 3));
  }

  TEST_CASE("CudnnSdpa head sizes: equal up to 256 anywhere, MLA's 192/128 from sm_90 on, other pairs refused") {
    const auto status = [](int d, int d_v, int cc) {
      AttentionShape s{4, 2, d};
      s.head_dim_v = d_v;
      return attention::cudnn_sdpa_shape_status(s, cc, "CudnnSdpa");
    };
    const auto refused_as = [](const Status& s, const char* name) {
      return !s && s.reason.find(name) != std::string::npos;
    };
    for (const int cc : {80, 86, 89, 90, 100, 120}) {
      CAPTURE(cc);
      CHECK(status(64, 0, cc));
      CHECK(status(128, 128, cc));  // head_dim_v = head_dim
      CHECK(status(256, 0, cc));
      CHECK(refused_as(status(60, 0, cc), "shape.head_dim = 60"));
      CHECK(refused_as(status(264, 0, cc), "shape.head_dim = 264"));
      // 192/128: from compute capability 9.0 (cuDNN's support matrix for prefill and backward).
      const Status mla = status(192, 128, cc);
      CHECK(bool(mla) == (cc >= 90));
      if (cc < 90) {
        CHECK(refused_as(mla, "CudnnSdpa: shape.head_dim_v = 128"));
        CHECK(refused_as(mla, "compute capability 9.0"));
      }
      // Other unequal pairs, on every device.
      CHECK(refused_as(status(128, 64, cc), "CudnnSdpa: shape.head_dim_v = 64"));
      CHECK(refused_as(status(64, 128, cc), "shape.head_dim_v = 128: CudnnSdpa takes head_dim_v = head_dim"));
      CHECK(refused_as(status(192, 64, cc), "shape.head_dim_v = 64"));
      CHECK(refused_as(status(192, 192 + 8, cc), "shape.head_dim_v"));
      CHECK(refused_as(status(576, 512, cc), "shape.head_dim = 576"));  // above 256 before the pair
    }
    // The shape's own checks come first; then the scale cuDNN takes in fp32.
    CHECK(refused_as(status(192, -1, 90), "head_dim_v = -1"));
    AttentionShape tiny{4, 2, 192, 1e-60};
    tiny.head_dim_v = 128;
    CHECK(refused_as(attention::cudnn_sdpa_shape_status(tiny, 90, "CudnnSdpa"), "shape.softmax_scale"));
  }
}

}  // namespace
}  // namespace seqpar::test
