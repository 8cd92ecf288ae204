// SPDX-License-Identifier: Apache-2.0
// Brute-force models of the range and slice algebra (seqpar/core/{range_set,row_map,slice_algebra}.hpp)
// for the property tests of tests/comm: token-by-token, pair-by-pair, straight from the definitions,
// sharing no code with the library beyond Range and AttnSlice themselves. Plus seeded generators of
// small random inputs.
#pragma once

#include <seqpar/core/attn_slice.hpp>
#include <seqpar/core/range.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

namespace seqpar::test {

using Pair = std::pair<std::int64_t, std::int64_t>;  // (query token, key token)

/// Whether query i sees key j under slice s, from the mask definition (MaskKind's comments): row
/// qi = i - q.begin sees key kj = j - k.begin iff kj <= qi + causal_offset, and with a sliding
/// window also kj > qi + causal_offset - window; a full mask sees every key.
inline bool sees(const AttnSlice& s, std::int64_t i, std::int64_t j) {
  if (i < s.q_range.begin || i >= s.q_range.end || j < s.k_range.begin || j >= s.k_range.end) return false;
  const std::int64_t qi = i - s.q_range.begin, kj = j - s.k_range.begin, diag = qi + s.mask.causal_offset;
  switch (s.mask.kind) {
    case MaskKind::kFull:
      return true;
    case MaskKind::kCausal:
      return kj <= diag;
    case MaskKind::kSlidingWindow:
      return kj <= diag && kj > diag - s.mask.window;
  }
  return false;
}

/// Visible (query, key) pairs of s whose query lies in q and key in k, in order.
inline std::vector<Pair> pairs(const AttnSlice& s, Range q = {INT64_MIN, INT64_MAX}, Range k = {INT64_MIN, INT64_MAX}) {
  std::vector<Pair> out;
  for (std::int64_t i = std::max(s.q_range.begin, q.begin); i < std::min(s.q_range.end, q.end); ++i)
    for (std::int64_t j = std::max(s.k_range.begin, k.begin); j < std::min(s.k_range.end, k.end); ++j)
      if (sees(s, i, j)) out.emplace_back(i, j);
  return out;
}

/// Sorted multiset of the visible pairs of all slices (a pair twice means it is computed twice).
inline std::vector<Pair> pair_multiset(const std::vector<AttnSlice>& slices) {
  std::vector<Pair> out;
  for (const AttnSlice& s : slices) {
    const auto p = pairs(s);
    out.insert(out.end(), p.begin(), p.end());
  }
  std::sort(out.begin(), out.end());
  return out;
}

/// The tokens of a range list, in list order: also the row -> token table of a buffer that holds the
/// ranges back to back.
inline std::vector<std::int64_t> tokens_of(const std::vector<Range>& ranges) {
  std::vector<std::int64_t> out;
  for (const Range& r : ranges)
    for (std::int64_t t = r.begin; t < r.end; ++t) out.push_back(t);
  return out;
}

/// Which tokens of [0, n) a range list (possibly overlapping) covers.
inline std::vector<bool> cover(const std::vector<Range>& ranges, std::int64_t n) {
  std::vector<bool> out(static_cast<std::size_t>(n), false);
  for (const Range& r : ranges)
    for (std::int64_t t = std::max<std::int64_t>(r.begin, 0); t < std::min(r.end, n); ++t)
      out[static_cast<std::size_t>(t)] = true;
  return out;
}

inline std::int64_t uniform(std::mt19937& rng, std::int64_t lo, std::int64_t hi) {  // [lo, hi]
  return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
}

/// A random sub-range of [0, n), possibly empty.
inline Range random_range(std::mt19937& rng, std::int64_t n, bool allow_empty = true) {
  std::int64_t a = uniform(rng, 0, n), b = uniform(rng, 0, n);
  if (a > b) std::swap(a, b);
  if (!allow_empty && a == b) {
    if (b < n)
      ++b;
    else
      --a;
  }
  return {a, b};
}

/// [0, n) cut at random points into consecutive pieces (1 to max_len tokens each).
inline std::vector<Range> random_cuts(std::mt19937& rng, std::int64_t n, std::int64_t max_len) {
  std::vector<Range> out;
  for (std::int64_t at = 0; at < n;) {
    const std::int64_t len = std::min(n - at, uniform(rng, 1, max_len));
    out.push_back({at, at + len});
    at += len;
  }
  return out;
}

/// Disjoint ranges inside [0, n): a random subset of random cuts, in sorted or shuffled order, with
/// empty ranges sprinkled in when allowed (the shapes of a rank's owned tokens and of ring blocks).
inline std::vector<Range> random_disjoint(std::mt19937& rng, std::int64_t n, bool shuffled, bool with_empty) {
  std::vector<Range> out;
  for (const Range& r : random_cuts(rng, n, 1 + n / 3))
    if (rng() % 4 != 0) out.push_back(r);
  if (shuffled) std::shuffle(out.begin(), out.end(), rng);
  if (with_empty)
    for (int e = static_cast<int>(rng() % 3); e > 0; --e) {
      const std::int64_t at = uniform(rng, 0, n);
      out.insert(out.begin() + static_cast<std::ptrdiff_t>(uniform(rng, 0, static_cast<std::int64_t>(out.size()))),
                 Range{at, at});
    }
  return out;
}

/// A random mask: full, causal or sliding window, with a diagonal anywhere from well before the keys
/// to well past them.
inline Mask random_mask(std::mt19937& rng, std::int64_t q_len, std::int64_t k_len) {
  const std::int64_t offset = uniform(rng, -q_len - 2, k_len + 2);
  switch (rng() % 5) {
    case 0:
      return Mask::full();
    case 1:
    case 2:
      return Mask::causal(offset);
    default:
      return Mask::sliding_window(uniform(rng, 1, 6), offset);
  }
}

/// A random slice over tokens [0, n) with non-empty query and key ranges.
inline AttnSlice random_slice(std::mt19937& rng, std::int64_t n) {
  const Range q = random_range(rng, n, false), k = random_range(rng, n, false);
  return {q, k, random_mask(rng, q.size(), k.size())};
}

/// The global pairs, sorted, of local slices over a query buffer and a key buffer (row -> token tables).
inline std::vector<Pair> global_pairs(const std::vector<AttnSlice>& local, const std::vector<std::int64_t>& q_rows,
                                      const std::vector<std::int64_t>& k_rows) {
  std::vector<Pair> out;
  for (const AttnSlice& s : local)
    for (const auto& [i, j] : pairs(s))
      out.emplace_back(q_rows.at(static_cast<std::size_t>(i)), k_rows.at(static_cast<std::size_t>(j)));
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace seqpar::test
