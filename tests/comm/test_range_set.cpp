// SPDX-License-Identifier: Apache-2.0
// Ordered range lists (seqpar/core/range_set.hpp): append_range, in_token_order, merge_ranges and
// DisjointRangeIndex, against token-by-token models on seeded random lists, plus hand examples.
#include <doctest/doctest.h>

#include <seqpar/core/range_set.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "comm/brute_force.hpp"

using namespace seqpar;

TEST_SUITE("comm") {
  TEST_CASE("append_range skips empty ranges and extends the last range only when it runs on") {
    std::vector<Range> list;
    append_range(list, {3, 3});
    CHECK(list.empty());
    append_range(list, {0, 2});
    append_range(list, {2, 5});
    append_range(list, {7, 7});
    append_range(list, {6, 8});
    append_range(list, {1, 2});  // adjacent to nothing at the back: a new range, even though [1, 2) repeats
    CHECK(list == std::vector<Range>{{0, 5}, {6, 8}, {1, 2}});
  }

  TEST_CASE("append_range (property): the same tokens in the same order, in the fewest ranges") {
    std::mt19937 rng(7);
    for (int iter = 0; iter < 500; ++iter) {
      const std::int64_t n = test::uniform(rng, 1, 30);
      std::vector<Range> input;
      for (int i = static_cast<int>(test::uniform(rng, 0, 8)); i > 0; --i)
        input.push_back(rng() % 3 == 0 && !input.empty()
                            ? Range{input.back().end, input.back().end + test::uniform(rng, 0, 3)}
                            : test::random_range(rng, n));
      INFO("iteration " << iter);
      std::vector<Range> list;
      for (const Range& r : input) append_range(list, r);
      CHECK(test::tokens_of(list) == test::tokens_of(input));
      for (std::size_t i = 0; i < list.size(); ++i) {
        CHECK_FALSE(list[i].empty());
        if (i > 0) CHECK(list[i - 1].end != list[i].begin);
      }
    }
  }

  TEST_CASE("in_token_order: the non-empty ranges sorted by position, nothing else") {
    CHECK(in_token_order({{8, 9}, {4, 4}, {0, 3}, {5, 8}, {3, 2}}) == std::vector<Range>{{0, 3}, {5, 8}, {8, 9}});
    std::mt19937 rng(11);
    for (int iter = 0; iter < 300; ++iter) {
      const std::vector<Range> input = test::random_disjoint(rng, test::uniform(rng, 1, 50), true, true);
      const std::vector<Range> out = in_token_order(input);
      std::vector<Range> nonempty;
      std::copy_if(input.begin(), input.end(), std::back_inserter(nonempty), [](Range r) { return !r.empty(); });
      CHECK(std::is_permutation(out.begin(), out.end(), nonempty.begin(), nonempty.end()));
      CHECK(std::is_sorted(out.begin(), out.end(), [](Range a, Range b) { return a.begin < b.begin; }));
    }
  }

  TEST_CASE("merge_ranges: sorted union with overlapping and adjacent ranges joined") {
    CHECK(merge_ranges({{5, 7}, {0, 2}, {1, 3}, {3, 4}, {9, 9}, {6, 6}, {10, 12}}) ==
          std::vector<Range>{{0, 4}, {5, 7}, {10, 12}});
    CHECK(merge_ranges({}).empty());
    std::mt19937 rng(13);
    for (int iter = 0; iter < 500; ++iter) {
      const std::int64_t n = test::uniform(rng, 1, 40);
      std::vector<Range> input;
      for (int i = static_cast<int>(test::uniform(rng, 0, 10)); i > 0; --i) input.push_back(test::random_range(rng, n));
      INFO("iteration " << iter);
      const std::vector<Range> out = merge_ranges(input);
      CHECK(test::cover(out, n) == test::cover(input, n));
      for (std::size_t i = 0; i < out.size(); ++i) {
        CHECK_FALSE(out[i].empty());
        if (i > 0) CHECK(out[i - 1].end < out[i].begin);  // sorted, disjoint, and not even adjacent
      }
    }
  }

  TEST_CASE("DisjointRangeIndex::overlapping: exactly the non-empty ranges a query overlaps, ascending") {
    const std::vector<Range> ranges{{10, 14}, {0, 4}, {4, 4}, {20, 22}, {4, 6}};
    const DisjointRangeIndex index(ranges);
    std::vector<std::size_t> hits{99};
    index.overlapping({3, 11}, hits);
    CHECK(hits == std::vector<std::size_t>{0, 1, 4});  // not the empty [4, 4), though inside the query
    index.overlapping({14, 20}, hits);
    CHECK(hits.empty());  // touching ends do not overlap
    index.overlapping({5, 5}, hits);
    CHECK(hits.empty());
    index.overlapping({-5, 100}, hits);
    CHECK(hits == std::vector<std::size_t>{0, 1, 3, 4});

    std::mt19937 rng(17);
    int nonempty_answers = 0;
    for (int iter = 0; iter < 300; ++iter) {
      const std::int64_t n = test::uniform(rng, 1, 40);
      const std::vector<Range> list = test::random_disjoint(rng, n, true, true);
      const DisjointRangeIndex idx(list);
      INFO("iteration " << iter);
      for (std::int64_t b = -1; b <= n + 1; ++b)
        for (std::int64_t e = b; e <= n + 1; ++e) {
          std::vector<std::size_t> want;
          for (std::size_t i = 0; i < list.size(); ++i)
            if (!intersect(list[i], {b, e}).empty()) want.push_back(i);
          idx.overlapping({b, e}, hits);
          CHECK(hits == want);
          nonempty_answers += !want.empty();
        }
    }
    CHECK(nonempty_answers > 10000);
  }

  TEST_CASE("DisjointRangeIndex::overlapping with a hint: the same answers for any query order and start") {
    // The hint only says where to start looking (a cursor for ascending queries): wrong or stale
    // hints, descending queries and jumps must still give exactly the unhinted answer.
    std::mt19937 rng(23);
    std::vector<std::size_t> got, want;
    int hinted = 0;
    for (int iter = 0; iter < 400; ++iter) {
      const std::int64_t n = test::uniform(rng, 1, 60);
      const std::vector<Range> list = test::random_disjoint(rng, n, iter % 2 == 0, true);
      const DisjointRangeIndex idx(list);
      std::size_t hint = static_cast<std::size_t>(test::uniform(rng, 0, 70));
      INFO("iteration " << iter);
      for (int q = 0; q < 40; ++q) {
        Range r = test::random_range(rng, n + 2);
        r = r.shifted(-1);
        if (q % 10 == 0) hint = static_cast<std::size_t>(test::uniform(rng, 0, 70));  // arbitrary restarts
        idx.overlapping(r, want);
        idx.overlapping(r, got, hint);
        CHECK(got == want);
        hinted += !want.empty();
      }
    }
    CHECK(hinted > 4000);
  }
}
