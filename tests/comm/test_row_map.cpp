// SPDX-License-Identifier: Apache-2.0
// RowMap (seqpar/core/row_map.hpp): where global tokens sit in a buffer made of ranges back to back.
// Property checks against a token-by-token model on seeded random range lists, plus hand examples.
#include <doctest/doctest.h>

#include <seqpar/core/row_map.hpp>

#include <cstdint>
#include <random>
#include <vector>

#include "comm/brute_force.hpp"

using namespace seqpar;

namespace {

// The brute-force answer of to_local: the rows of g's tokens if they are consecutive rows of the
// buffer in token order (g lies inside one coalesced piece), else nothing.
Range expected_local(const std::vector<std::int64_t>& row_token, Range g) {
  std::int64_t first = -1;
  for (std::size_t row = 0; row < row_token.size(); ++row)
    if (row_token[row] == g.begin) first = static_cast<std::int64_t>(row);
  if (first < 0) return {0, 0};
  for (std::int64_t t = g.begin; t < g.end; ++t) {
    const auto row = static_cast<std::size_t>(first + (t - g.begin));
    if (row >= row_token.size() || row_token[row] != t) return {0, 0};
  }
  return {first, first + g.size()};
}

// Index of the map piece whose global range contains g (g non-empty), or size() if none.
std::size_t piece_of(const RowMap& m, Range g) {
  for (std::size_t i = 0; i < m.global.size(); ++i)
    if (g.begin >= m.global[i].begin && g.end <= m.global[i].end) return i;
  return m.global.size();
}

}  // namespace

TEST_SUITE("comm") {
  TEST_CASE("RowMap::concat coalesces pieces adjacent both globally and in the buffer, and only those") {
    const RowMap m = RowMap::concat({{0, 3}, {3, 5}, {8, 10}, {10, 10}, {2, 3}, {5, 6}, {12, 12}, {6, 8}});
    CHECK(m.global == std::vector<Range>{{0, 5}, {8, 10}, {2, 3}, {5, 8}});
    CHECK(m.local == std::vector<std::int64_t>{0, 5, 7, 8});
    CHECK(m.rows == 11);
    // [5, 6) then [6, 8) coalesce across the empty range between them (it holds no rows).
    const RowMap e = RowMap::concat({{4, 4}, {}, {9, 9}});
    CHECK(e.global.empty());
    CHECK(e.local.empty());
    CHECK(e.rows == 0);
  }

  TEST_CASE("RowMap::to_local: hand examples, hits and misses") {
    const RowMap m = RowMap::concat({{10, 14}, {0, 4}, {4, 6}, {20, 22}});  // pieces [10,14)@0 [0,6)@4 [20,22)@10
    CHECK(m.to_local({11, 13}) == Range{1, 3});
    CHECK(m.to_local({2, 6}) == Range{6, 10});  // across the coalesced [0,4) [4,6)
    CHECK(m.to_local({20, 22}) == Range{10, 12});
    CHECK(m.to_local({13, 15}) == Range{0, 0});  // runs past a piece
    CHECK(m.to_local({6, 7}) == Range{0, 0});    // in no piece
    CHECK(m.to_local({5, 11}) == Range{0, 0});   // spans a gap
    std::size_t hint = 2;
    CHECK(m.to_local({1, 2}, hint) == Range{5, 6});
    CHECK(hint == 1);  // the piece that held it
    hint = 7;          // a stale hint past the end still finds the piece
    CHECK(m.to_local({21, 22}, hint) == Range{11, 12});
    CHECK(hint == 2);
    const RowMap none = RowMap::concat({});
    std::size_t h0 = 0;
    CHECK(none.to_local({0, 1}, h0) == Range{0, 0});
    CHECK(none.to_local_sorted({0, 1}) == Range{0, 0});
    // Sorted maps: one binary search.
    const RowMap sorted = RowMap::concat({{0, 4}, {4, 6}, {10, 14}, {20, 22}});
    CHECK(sorted.to_local_sorted({11, 14}) == Range{7, 10});
    CHECK(sorted.to_local_sorted({0, 6}) == Range{0, 6});
    CHECK(sorted.to_local_sorted({5, 11}) == Range{0, 0});
    CHECK(sorted.to_local_sorted({22, 23}) == Range{0, 0});
    CHECK(sorted.to_local_sorted({8, 9}) == Range{0, 0});
  }

  TEST_CASE("RowMap (property): concat, to_local with any hint and to_local_sorted agree with a row-by-row model") {
    std::mt19937 rng(20260101);
    int hits = 0, misses = 0;
    for (int iter = 0; iter < 400; ++iter) {
      const std::int64_t n = test::uniform(rng, 1, 40);
      const bool shuffled = iter % 2 == 1;
      const std::vector<Range> ranges = test::random_disjoint(rng, n, shuffled, true);
      INFO("iteration " << iter << ", " << ranges.size() << " ranges over " << n << " tokens");
      const RowMap m = RowMap::concat(ranges);
      const std::vector<std::int64_t> row_token = test::tokens_of(ranges);

      // Layout: rows back to back, pieces non-empty and maximal (no two neighbours that could be one).
      CHECK(m.rows == static_cast<std::int64_t>(row_token.size()));
      REQUIRE(m.global.size() == m.local.size());
      std::int64_t row = 0;
      for (std::size_t i = 0; i < m.global.size(); ++i) {
        CHECK_FALSE(m.global[i].empty());
        CHECK(m.local[i] == row);
        for (std::int64_t t = m.global[i].begin; t < m.global[i].end; ++t, ++row)
          CHECK(row_token[static_cast<std::size_t>(row)] == t);
        if (i > 0) CHECK(m.global[i - 1].end != m.global[i].begin);
      }
      CHECK(row == m.rows);

      // Every sub-range of [0, n + 2), hit or miss, through every hint.
      for (std::int64_t b = 0; b < n + 2; ++b)
        for (std::int64_t e = b + 1; e <= n + 2; ++e) {
          const Range g{b, e};
          const Range want = expected_local(row_token, g);
          want.empty() ? ++misses : ++hits;
          CHECK(m.to_local(g) == want);
          for (std::size_t hint = 0; hint <= m.global.size(); ++hint) {
            std::size_t h = hint;
            CHECK(m.to_local(g, h) == want);
            if (!want.empty()) CHECK(h == piece_of(m, g));
          }
          if (!shuffled) CHECK(m.to_local_sorted(g) == want);
        }

      // Walking the buffer's own pieces in order with one hint finds each where it is.
      std::size_t hint = 0;
      std::int64_t at = 0;
      for (const Range& r : ranges) {
        if (r.empty()) continue;
        CHECK(m.to_local(r, hint) == Range{at, at + r.size()});
        at += r.size();
      }
    }
    MESSAGE("RowMap: " << hits << " hits and " << misses << " misses checked");
    CHECK(hits > 1000);
    CHECK(misses > 1000);
  }
}
