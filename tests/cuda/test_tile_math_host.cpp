// SPDX-License-Identifier: Apache-2.0
// The CPU side of the CUDA kernels' index arithmetic (kernels/seqpar/gpu/detail/tile_math.hpp), which
// the device code shares: checked against brute force over Mask::visible_keys on random slices.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "seqpar/gpu/detail/tile_math.hpp"

namespace {

using seqpar::AttnSlice;
using seqpar::Mask;
namespace cd = seqpar::gpu::detail;

AttnSlice random_slice(std::mt19937& rng, std::int64_t q_begin) {
  std::uniform_int_distribution<std::int64_t> len(0, 150), off(-40, 160), win(1, 70);
  std::uniform_int_distribution<int> kind(0, 2);
  const std::int64_t q = len(rng), k = len(rng);
  Mask m = Mask::full();
  if (kind(rng) == 1) m = Mask::causal(off(rng));
  if (kind(rng) == 2) m = Mask::sliding_window(win(rng), off(rng));
  return {{q_begin, q_begin + q}, {0, k}, m};
}

}  // namespace

TEST_SUITE("cuda_host") {
  TEST_CASE("keys_of_rows and rows_of_keys agree with visible_keys row by row") {
    std::mt19937 rng(7);
    for (int trial = 0; trial < 400; ++trial) {
      const AttnSlice s = random_slice(rng, 0);
      const std::int64_t q_len = s.q_range.size(), k_len = s.k_range.size();
      for (int rows : {1, 16, 64}) {
        for (std::int64_t r0 = 0; r0 < q_len; r0 += rows) {
          const std::int64_t r1 = std::min(q_len, r0 + rows);
          std::int64_t lo = k_len, hi = 0;
          for (std::int64_t qi = r0; qi < r1; ++qi) {
            const auto v = s.mask.visible_keys(qi, k_len);
            if (v.empty()) continue;
            lo = std::min(lo, v.begin);
            hi = std::max(hi, v.end);
          }
          const auto span = cd::keys_of_rows(s, r0, r1);
          // The span may be wider than the union only where it is empty.
          if (hi > lo) {
            CHECK(span.begin <= lo);
            CHECK(span.end >= hi);
            for (std::int64_t kj = span.begin; kj < span.end; ++kj) {
              bool seen = false;
              for (std::int64_t qi = r0; qi < r1 && !seen; ++qi) {
                const auto v = s.mask.visible_keys(qi, k_len);
                seen = kj >= v.begin && kj < v.end;
              }
              CHECK_MESSAGE(seen, "key " << kj << " of " << s << " rows [" << r0 << ", " << r1 << ")");
            }
          } else {
            CHECK(span.end <= span.begin);
          }
        }
      }
      for (int keys : {1, 32, 64}) {
        for (std::int64_t c0 = 0; c0 < k_len; c0 += keys) {
          const std::int64_t c1 = std::min(k_len, c0 + keys);
          const auto rows = cd::rows_of_keys(s, c0, c1);
          for (std::int64_t qi = 0; qi < q_len; ++qi) {
            const auto v = s.mask.visible_keys(qi, k_len);
            const bool sees = std::max(v.begin, c0) < std::min(v.end, c1);
            if (sees) CHECK_MESSAGE((qi >= rows.begin && qi < rows.end), "row " << qi << " of " << s);
          }
        }
      }
    }
  }

  TEST_CASE("the reference tile table covers every query row once, longest first, within max_tiles") {
    std::mt19937 rng(11);
    for (int trial = 0; trial < 100; ++trial) {
      std::vector<AttnSlice> slices;
      std::int64_t at = 0;
      const int n = std::uniform_int_distribution<int>(1, 12)(rng);
      for (int i = 0; i < n; ++i) {
        AttnSlice s = random_slice(rng, at);
        at = s.q_range.end + std::uniform_int_distribution<std::int64_t>(0, 5)(rng);
        if (!s.q_range.empty()) slices.push_back(s);
      }
      for (int rows : {32, 64}) {
        const auto table = cd::tile_table_reference(slices, rows);
        CHECK(static_cast<std::int64_t>(table.size()) <=
              cd::max_tiles(at, static_cast<std::int64_t>(slices.size()), rows));
        std::vector<int> covered(static_cast<std::size_t>(at), 0);
        for (std::size_t i = 0; i < table.size(); ++i) {
          if (i > 0) CHECK(table[i - 1].cost >= table[i].cost);
          CHECK(table[i].cost >= 1);
          const AttnSlice& s = slices[static_cast<std::size_t>(cd::tile_slice(table[i].tile))];
          const std::int64_t r0 = cd::tile_index(table[i].tile) * rows;
          for (std::int64_t r = r0; r < std::min(r0 + rows, s.q_range.size()); ++r)
            ++covered[static_cast<std::size_t>(s.q_range.begin + r)];
        }
        for (const AttnSlice& s : slices)
          for (std::int64_t r = s.q_range.begin; r < s.q_range.end; ++r)
            CHECK(covered[static_cast<std::size_t>(r)] == 1);
      }
    }
  }

  TEST_CASE("a prepared call's block holds its slices, the reference tile table and its length") {
    std::mt19937 rng(5);
    for (int trial = 0; trial < 50; ++trial) {
      std::vector<AttnSlice> slices;
      std::int64_t at = 0;
      const int n = std::uniform_int_distribution<int>(0, 9)(rng);
      for (int i = 0; i < n; ++i) {
        const AttnSlice s = random_slice(rng, at);
        at = s.q_range.end;
        slices.push_back(s);  // slices without query rows too: they have no tiles
      }
      for (int rows : {32, 64}) {
        const cd::PreparedBlock block = cd::prepared_block(slices, rows);
        const auto want = cd::tile_table_reference(slices, rows);
        const cd::PreparedLayout layout(slices.size(), want.size());
        REQUIRE(block.num_tiles == want.size());
        REQUIRE(block.bytes.size() == layout.bytes);
        CHECK(layout.tiles % 256 == 0);
        CHECK(layout.length % 256 == 0);
        CHECK(layout.tiles >= slices.size() * sizeof(AttnSlice));
        CHECK(layout.length >= layout.tiles + want.size() * sizeof(std::uint64_t));
        for (std::size_t i = 0; i < slices.size(); ++i) {
          AttnSlice got;
          std::memcpy(&got, block.bytes.data() + layout.slices + i * sizeof(AttnSlice), sizeof(AttnSlice));
          CHECK(got == slices[i]);
        }
        for (std::size_t i = 0; i < want.size(); ++i) {
          std::uint64_t tile = 0;
          std::memcpy(&tile, block.bytes.data() + layout.tiles + i * sizeof(std::uint64_t), sizeof(tile));
          CHECK(tile == want[i].tile);
        }
        unsigned length = 0;
        std::memcpy(&length, block.bytes.data() + layout.length, sizeof(length));
        CHECK(length == want.size());
      }
    }
  }
}
