// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// The argument checks every transport (inproc, MPI, c10d) runs on a collective before any message, in
/// one place so that their messages match: equal blocks, counts of a variable collective, and in-place
/// buffers.

#include <cstddef>
#include <functional>
#include <numeric>
#include <span>
#include <string>
#include <string_view>

#include "seqpar/core/error.hpp"

namespace seqpar::detail {

/// `counts` has one entry per rank of a group of `size` and they add up to `buffer_size`, the size of
/// the buffer named `buffer` ("s.size()"); std::invalid_argument naming `name` otherwise.
inline void require_counts(std::string_view where, std::string_view name, std::span<const std::size_t> counts,
                           std::string_view buffer, std::size_t buffer_size, int size) {
  // if + throw, not require(): its message arguments would be built (allocated) on every call, and the
  // in-process transport runs this on the steady-state path, which allocates nothing.
  if (counts.size() != static_cast<std::size_t>(size))
    throw_invalid(where, std::string(name) + ".size()", counts.size(), "must equal size() = " + std::to_string(size));
  const std::size_t sum = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
  if (sum != buffer_size)
    throw_invalid(where, "sum(" + std::string(name) + ")", sum,
                  "must equal " + std::string(buffer) + " = " + std::to_string(buffer_size));
}

/// An all_to_all's equal blocks: `r` as large as `s`, and `s` a whole number of blocks for a group of
/// `size` ranks (if + throw: nothing is built unless it throws).
inline void require_equal_blocks(std::string_view where, std::size_t s_size, std::size_t r_size, int size) {
  if (r_size != s_size) throw_invalid(where, "r.size()", r_size, "must equal s.size() = " + std::to_string(s_size));
  if (s_size % static_cast<std::size_t>(size) != 0)
    throw_invalid(where, "s.size()", s_size, "must be a multiple of size() = " + std::to_string(size));
}

/// The send buffer `s` and the receive buffer `r` of a collective do not overlap (in-place collectives
/// are not supported).
inline void require_disjoint(std::string_view where, std::span<const std::byte> s, std::span<std::byte> r) {
  if (s.empty() || r.empty()) return;
  const std::less<const std::byte*> before;
  const bool overlap = before(s.data(), r.data() + r.size()) && before(r.data(), s.data() + s.size());
  require(!overlap, where, "r", "<buffer>", "overlaps s (in-place collectives are not supported)");
}

}  // namespace seqpar::detail
