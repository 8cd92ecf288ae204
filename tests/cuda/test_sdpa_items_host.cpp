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
            m = Mask::sliding_window(1 + static_cast<std::int64_t>(rng() % 6), offset);
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
