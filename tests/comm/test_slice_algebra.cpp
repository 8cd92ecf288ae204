// SPDX-License-Identifier: Apache-2.0
// The slice algebra every communicator builds its programs from (seqpar/core/slice_algebra.hpp):
// clip_slice, localize, waves and keys_needed, checked pair by pair against the mask definition on
// seeded random slices (full, causal and sliding-window masks, diagonals anywhere), plus hand examples.
#include <doctest/doctest.h>

#include <seqpar/core/slice_algebra.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <tuple>
#include <vector>

#include "comm/brute_force.hpp"

using namespace seqpar;
using test::Pair;

namespace {

// Brute-force keys_needed: walk the buffer concat(available) row by row; a row is needed when some
// slice sees its token from some query; maximal runs of needed rows holding consecutive tokens are
// the answer (one piece to send per run).
std::vector<Range> expected_keys(const std::vector<AttnSlice>& slices, const std::vector<Range>& available) {
  std::vector<Range> out;
  std::int64_t prev = -2;  // token of the previous row, if it was needed
  for (const std::int64_t j : test::tokens_of(available)) {
    bool needed = false;
    for (const AttnSlice& s : slices)
      for (std::int64_t i = s.q_range.begin; i < s.q_range.end && !needed; ++i) needed = test::sees(s, i, j);
    if (needed && prev == j - 1)
      out.back().end = j + 1;
    else if (needed)
      out.push_back({j, j + 1});
    prev = needed ? j : -2;
  }
  return out;
}

// Largest number of slices whose query ranges share a row: the fewest waves possible.
std::size_t max_depth(const std::vector<AttnSlice>& slices, std::int64_t rows) {
  std::size_t best = 0;
  for (std::int64_t i = 0; i < rows; ++i)
    best = std::max<std::size_t>(
        best, static_cast<std::size_t>(std::count_if(slices.begin(), slices.end(),
                                                     [&](const AttnSlice& s) { return s.q_range.contains(i); })));
  return best;
}

bool same_slices(std::vector<AttnSlice> a, std::vector<AttnSlice> b) {
  const auto key = [](const AttnSlice& s) {
    return std::tuple(s.q_range.begin, s.q_range.end, s.k_range.begin, s.k_range.end, static_cast<int>(s.mask.kind),
                      s.mask.causal_offset, s.mask.window);
  };
  const auto less = [&](const AttnSlice& x, const AttnSlice& y) { return key(x) < key(y); };
  std::sort(a.begin(), a.end(), less);
  std::sort(b.begin(), b.end(), less);
  return a == b;
}

}  // namespace

TEST_SUITE("comm") {
  TEST_CASE("clip_slice: hand examples") {
    // A causal document [0, 10) cut at token 4: the lower-right block [4, 10) x [0, 4) is full in
    // substance (every key precedes every query) and keeps a causal mask with offset 4.
    const AttnSlice doc{{0, 10}, {0, 10}, Mask::causal()};
    const AttnSlice lower = clip_slice(doc, {4, 10}, {0, 4});
    CHECK(lower == AttnSlice{{4, 10}, {0, 4}, Mask::causal(4)});
    // The upper-right block is the causal future: nothing.
    CHECK(clip_slice(doc, {0, 4}, {4, 10}).q_range.empty());
    // The diagonal block [4, 10) x [4, 10) is causal with offset 0.
    CHECK(clip_slice(doc, {4, 10}, {4, 10}) == AttnSlice{{4, 10}, {4, 10}, Mask::causal()});
    // Keys [2, 8) for queries [0, 10): query rows 0 and 1 see none of them and are trimmed.
    CHECK(clip_slice(doc, {0, 10}, {2, 8}) == AttnSlice{{2, 10}, {2, 8}, Mask::causal()});
    // Queries [0, 3) read keys up to 2 only: keys [3, 10) are trimmed.
    CHECK(clip_slice(doc, {0, 3}, {0, 10}) == AttnSlice{{0, 3}, {0, 3}, Mask::causal()});
    // A window of 3: queries [6, 8) read keys [4, 8); keys before 4 are trimmed, the mask realigned.
    const AttnSlice window{{0, 10}, {0, 10}, Mask::sliding_window(3)};
    CHECK(clip_slice(window, {6, 8}, {0, 10}) == AttnSlice{{6, 8}, {4, 8}, Mask::sliding_window(3, 2)});
    // Full masks clip to the intersection (their causal_offset means nothing).
    const AttnSlice full = clip_slice({{0, 5}, {5, 9}, Mask::full()}, {2, 7}, {0, 6});
    CHECK(full.q_range == Range{2, 5});
    CHECK(full.k_range == Range{5, 6});
    CHECK(full.mask.kind == MaskKind::kFull);
  }

  TEST_CASE("clip_slice (property): exactly the visible pairs inside the box, on tight ranges") {
    std::mt19937 rng(1234);
    int nonempty = 0, empty = 0;
    for (int iter = 0; iter < 20000; ++iter) {
      const std::int64_t n = test::uniform(rng, 1, 24);
      const AttnSlice s = test::random_slice(rng, n);
      const Range q = test::random_range(rng, n), k = test::random_range(rng, n);
      INFO("iteration " << iter << ": clip_slice(" << s << ", " << q << ", " << k << ")");
      const AttnSlice c = clip_slice(s, q, k);
      const std::vector<Pair> want = test::pairs(s, q, k);
      if (want.empty()) {
        ++empty;
        CHECK(c.q_range.empty());
        continue;
      }
      ++nonempty;
      INFO("clipped to " << c);
      CHECK(test::pairs(c) == want);
      // Inside the box and the slice.
      CHECK(intersect(c.q_range, intersect(s.q_range, q)) == c.q_range);
      CHECK(intersect(c.k_range, intersect(s.k_range, k)) == c.k_range);
      // Tight: the key range is exactly the keys seen, the first query row sees a key.
      std::int64_t k_lo = INT64_MAX, k_hi = INT64_MIN, q_lo = INT64_MAX;
      for (const auto& [i, j] : want) k_lo = std::min(k_lo, j), k_hi = std::max(k_hi, j + 1), q_lo = std::min(q_lo, i);
      CHECK(c.k_range == Range{k_lo, k_hi});
      CHECK(c.q_range.begin == q_lo);
      // The closed-form area counts the same pairs.
      CHECK(c.area() == static_cast<std::int64_t>(want.size()));
    }
    CHECK(nonempty > 3000);
    CHECK(empty > 1000);
  }

  // Found by this test: clip_slice used to keep the trailing rows of a sliding window that had moved
  // past k.end (no partitioner makes sliding-window slices today, so no result was wrong; the dead
  // rows cost kernel rows and could force extra waves).
  TEST_CASE("clip_slice trims every query row that sees no key") {
    // Window 2 over keys [0, 3): rows 4..9 see no key, yet the clipped slice keeps q [0, 10).
    CHECK(clip_slice({{0, 10}, {0, 10}, Mask::sliding_window(2)}, {0, 10}, {0, 3}).q_range == Range{0, 4});
    std::mt19937 rng(1234);
    int dead_rows = 0;
    for (int iter = 0; iter < 20000; ++iter) {
      const std::int64_t n = test::uniform(rng, 1, 24);
      const AttnSlice s = test::random_slice(rng, n);
      const Range q = test::random_range(rng, n), k = test::random_range(rng, n);
      const AttnSlice c = clip_slice(s, q, k);
      for (std::int64_t i = c.q_range.begin; i < c.q_range.end; ++i) {
        bool sees_a_key = false;
        for (std::int64_t j = c.k_range.begin; j < c.k_range.end; ++j) sees_a_key = sees_a_key || test::sees(c, i, j);
        if (!sees_a_key && dead_rows++ == 0)
          MESSAGE("first: clip_slice(" << s << ", " << q << ", " << k << ") = " << c);
      }
    }
    CHECK(dead_rows == 0);
  }

  TEST_CASE("localize (property): every visible pair of the mapped tokens, once, in local rows of one piece each") {
    std::mt19937 rng(99);
    int checked = 0;
    for (int iter = 0; iter < 2000; ++iter) {
      const std::int64_t n = test::uniform(rng, 1, 30);
      const std::vector<Range> q_ranges = test::random_disjoint(rng, n, iter % 2 == 1, true);
      const std::vector<Range> k_ranges = test::random_disjoint(rng, n, iter % 3 == 1, true);
      std::vector<AttnSlice> global;
      for (int i = static_cast<int>(test::uniform(rng, 0, 4)); i > 0; --i) global.push_back(test::random_slice(rng, n));
      INFO("iteration " << iter);
      const RowMap q_map = RowMap::concat(q_ranges), k_map = RowMap::concat(k_ranges);
      const std::vector<std::int64_t> q_rows = test::tokens_of(q_ranges), k_rows = test::tokens_of(k_ranges);
      const std::vector<AttnSlice> local = localize(global, q_map, k_map);

      // Pairs: global pairs whose query is a row of q_map and key a row of k_map, each once.
      const std::vector<bool> has_q = test::cover(q_ranges, n), has_k = test::cover(k_ranges, n);
      std::vector<Pair> want;
      for (const auto& [i, j] : test::pair_multiset(global))
        if (has_q[static_cast<std::size_t>(i)] && has_k[static_cast<std::size_t>(j)]) want.emplace_back(i, j);
      CHECK(test::global_pairs(local, q_rows, k_rows) == want);
      checked += !want.empty();

      // Each local slice lies inside one piece of each map, and is non-empty.
      for (const AttnSlice& s : local) {
        CHECK(s.area() > 0);
        const auto inside_one = [](const RowMap& m, Range rows) {
          for (std::size_t i = 0; i < m.global.size(); ++i)
            if (rows.begin >= m.local[i] && rows.end <= m.local[i] + m.global[i].size()) return true;
          return false;
        };
        CHECK(inside_one(q_map, s.q_range));
        CHECK(inside_one(k_map, s.k_range));
      }
      // Output order is by slice: localizing slice by slice gives the same list.
      std::vector<AttnSlice> by_slice;
      for (const AttnSlice& g : global) {
        const auto part = localize({g}, q_map, k_map);
        by_slice.insert(by_slice.end(), part.begin(), part.end());
      }
      CHECK(by_slice == local);
    }
    CHECK(checked > 700);
  }

  TEST_CASE("waves: disjoint query ranges per wave, every slice (or its merged run) once, the fewest waves") {
    // Hand example: three slices over rows [0, 4) need three waves; [4, 6) joins the first.
    const std::vector<AttnSlice> hand{{{0, 4}, {0, 4}, Mask::causal()},
                                      {{0, 4}, {4, 8}, Mask::full()},
                                      {{2, 3}, {8, 9}, Mask::full()},
                                      {{4, 6}, {0, 2}, Mask::full()}};
    const auto w = waves(hand);
    REQUIRE(w.size() == 3);
    CHECK(w[0].size() == 2);

    std::mt19937 rng(5);
    for (int iter = 0; iter < 3000; ++iter) {
      const std::int64_t rows = test::uniform(rng, 1, 30);
      std::vector<AttnSlice> slices;
      for (int i = static_cast<int>(test::uniform(rng, 0, 12)); i > 0; --i)
        slices.push_back(test::random_slice(rng, rows));
      INFO("iteration " << iter << ": " << slices.size() << " slices over " << rows << " rows");
      const auto out = waves(slices);
      std::vector<AttnSlice> all;
      for (const auto& wave : out) {
        CHECK_FALSE(wave.empty());
        CHECK_NOTHROW(validate_slices(wave, rows, rows, "waves"));  // disjoint query ranges, in bounds
        all.insert(all.end(), wave.begin(), wave.end());
      }
      // Every slice exactly once, except runs of diagonal slices, which waves merges (append_slice):
      // the same visible pairs either way.
      CHECK(test::pair_multiset(all) == test::pair_multiset(slices));
      if (all.size() == slices.size()) CHECK(same_slices(all, slices));
      CHECK(out.size() == max_depth(slices, rows));
    }
  }

  TEST_CASE("append_slice: diagonal slices that continue each other become one sliding window of one key") {
    std::vector<AttnSlice> list;
    append_slice(list, {{0, 1}, {0, 1}, Mask::causal()});           // a one-token document
    append_slice(list, {{1, 2}, {1, 2}, Mask::causal()});           // the next one: merged
    append_slice(list, {{2, 4}, {2, 4}, Mask::sliding_window(1)});  // a merged run continues it
    append_slice(list, {{4, 5}, {9, 10}, Mask::full()});            // keys elsewhere: a new slice
    append_slice(list, {{5, 6}, {10, 11}, Mask::causal(3)});        // 1x1, its pair visible: merged
    append_slice(list, {{6, 8}, {11, 13}, Mask::causal()});         // not diagonal (row 1 sees two keys)
    append_slice(list, {{8, 9}, {13, 14}, Mask::causal(-1)});       // sees nothing: not diagonal either
    CHECK(list == std::vector<AttnSlice>{{{0, 4}, {0, 4}, Mask::sliding_window(1)},
                                         {{4, 6}, {9, 11}, Mask::sliding_window(1)},
                                         {{6, 8}, {11, 13}, Mask::causal()},
                                         {{8, 9}, {13, 14}, Mask::causal(-1)}});

    // Property: the same visible pairs, and nothing left that could merge.
    std::mt19937 rng(77);
    int merges = 0;
    for (int iter = 0; iter < 3000; ++iter) {
      std::vector<AttnSlice> in;
      std::int64_t q = test::uniform(rng, 0, 5), k = test::uniform(rng, 0, 5);
      for (int i = static_cast<int>(test::uniform(rng, 1, 12)); i > 0; --i) {
        const std::int64_t len = rng() % 3 == 0 ? test::uniform(rng, 1, 4) : 1;
        const Mask m = rng() % 2 ? test::random_mask(rng, len, len) : Mask::sliding_window(1);
        in.push_back({{q, q + len}, {k, k + len}, m});
        q += len + (rng() % 4 == 0 ? 1 : 0);  // mostly continuing, sometimes not
        k += len + (rng() % 4 == 0 ? 1 : 0);
      }
      std::vector<AttnSlice> out;
      for (const AttnSlice& s : in) append_slice(out, s);
      INFO("iteration " << iter);
      CHECK(test::pair_multiset(out) == test::pair_multiset(in));
      for (std::size_t i = 1; i < out.size(); ++i)
        CHECK_FALSE((is_diagonal(out[i - 1]) && is_diagonal(out[i]) && out[i - 1].q_range.end == out[i].q_range.begin &&
                     out[i - 1].k_range.end == out[i].k_range.begin));
      merges += static_cast<int>(in.size() - out.size());
    }
    CHECK(merges > 3000);
  }

  TEST_CASE("waves: a run of one-token documents is one slice of one wave, the same pairs") {
    std::vector<AttnSlice> docs;
    for (std::int64_t t = 0; t < 1000; ++t) docs.push_back({{t, t + 1}, {t, t + 1}, Mask::causal()});
    std::shuffle(docs.begin(), docs.end(), std::mt19937(3));  // waves sorts by query row first
    const auto w = waves(docs);
    REQUIRE(w.size() == 1);
    CHECK(w[0] == std::vector<AttnSlice>{{{0, 1000}, {0, 1000}, Mask::sliding_window(1)}});
    // Mixed with other slices over the same rows: every pair kept, query ranges disjoint per wave.
    std::mt19937 rng(8);
    for (int iter = 0; iter < 500; ++iter) {
      std::vector<AttnSlice> slices;
      for (std::int64_t t = 0; t < 30; ++t)
        if (rng() % 3 != 0) slices.push_back({{t, t + 1}, {t, t + 1}, Mask::causal()});
      for (int i = static_cast<int>(test::uniform(rng, 0, 4)); i > 0; --i)
        slices.push_back(test::random_slice(rng, 30));
      std::vector<AttnSlice> all;
      for (const auto& wave : waves(slices)) {
        CHECK_NOTHROW(validate_slices(wave, 30, 30, "waves"));
        all.insert(all.end(), wave.begin(), wave.end());
      }
      CHECK(test::pair_multiset(all) == test::pair_multiset(slices));
      CHECK(all.size() < slices.size());
    }
  }

  TEST_CASE("keys_needed: hand examples") {
    // One causal document [0, 12); queries [8, 10) read keys [0, 10). Available in buffer order
    // [4, 6) [6, 8) [0, 2) [2, 4) [8, 12): [4, 8) and [0, 4) are one piece each, [8, 10) another
    // (not adjacent to [2, 4) in the buffer: [8, 12) follows it in the list but not in tokens).
    const std::vector<AttnSlice> q8{{{8, 10}, {0, 12}, Mask::causal(8)}};
    CHECK(keys_needed(q8, {{4, 6}, {6, 8}, {0, 2}, {2, 4}, {8, 12}}) == std::vector<Range>{{4, 8}, {0, 4}, {8, 10}});
    // Empty available ranges in between do not stop coalescing, absent ones do.
    CHECK(keys_needed(q8, {{0, 2}, {5, 5}, {2, 3}}) == std::vector<Range>{{0, 3}});
    CHECK(keys_needed(q8, {{0, 2}, {12, 14}, {2, 3}}) == std::vector<Range>{{0, 2}, {2, 3}});
    // Nothing of the causal future.
    CHECK(keys_needed(q8, {{10, 12}}).empty());
    // A window of 2 reads keys [7, 10) only.
    CHECK(keys_needed({{{8, 10}, {0, 12}, Mask::sliding_window(2, 8)}}, {{0, 12}}) == std::vector<Range>{{7, 10}});
  }

  TEST_CASE("keys_needed (property): exactly the keys read, coalesced along the buffer, nothing outside available") {
    std::mt19937 rng(4242);
    int nonempty = 0;
    for (int iter = 0; iter < 5000; ++iter) {
      const std::int64_t n = test::uniform(rng, 1, 30);
      const std::vector<Range> available = test::random_disjoint(rng, n, iter % 4 != 0, true);
      std::vector<AttnSlice> slices;
      for (int i = static_cast<int>(test::uniform(rng, 0, 5)); i > 0; --i) slices.push_back(test::random_slice(rng, n));
      INFO("iteration " << iter);
      const std::vector<Range> got = keys_needed(slices, available);
      CHECK(got == expected_keys(slices, available));
      nonempty += !got.empty();
      // Every result is one piece of the available buffer (what ring_kv_post relies on).
      const RowMap m = RowMap::concat(available);
      for (const Range& r : got) CHECK_FALSE(m.to_local(r).empty());
    }
    CHECK(nonempty > 1500);
  }
}
