// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "seqpar/comm/detail/head_split.hpp"
#include "seqpar/comm/program.hpp"
#include "seqpar/core/slice_algebra.hpp"

namespace seqpar::comm::detail {

/// A head <-> sequence all-to-all over one level: member i holds the tokens `tokens[i]` (rows of its
/// sequence-sharded buffers, in order) and computes heads `heads.q[i]` / `heads.kv[i]`. The
/// head-sharded buffers hold every member's tokens in global token order (`gathered()`).
struct A2ASpec {
  Level level = Level::kGroup;
  int me = 0;
  std::vector<std::vector<Range>> tokens;
  HeadAssignment heads;

  [[nodiscard]] int size() const noexcept { return static_cast<int>(tokens.size()); }

  /// Global ranges of the head-sharded buffers' rows, in order: sorted by global position, whoever
  /// owned them. Placing peers' rows in token order (not peer order) keeps a document that Per-Doc or
  /// zigzag cut across the group in one piece of the buffer, so it is one slice for the kernel and
  /// for a ring across groups, not one per (query piece, key piece): at 1024 ranks, Per-Doc's pieces
  /// in peer order made Hierarchical's programs 10x larger (bench/plan_scale).
  [[nodiscard]] std::vector<Range> gathered() const {
    std::vector<Range> all;
    for (const auto& t : tokens) all.insert(all.end(), t.begin(), t.end());
    return in_token_order(std::move(all));
  }

  /// seq -> heads: I send my rows of peer p's heads; I receive p's rows of my heads, placed where
  /// p's tokens sit in the gathered buffer.
  [[nodiscard]] Move to_heads(BufferId src, BufferId dst, bool kv) const {
    const auto n = static_cast<std::size_t>(size());
    Move m{src, dst, false, std::vector<std::vector<Piece>>(n), std::vector<std::vector<Piece>>(n)};
    const auto& assign = kv ? heads.kv : heads.q;
    const Range mine = assign[static_cast<std::size_t>(me)];
    const RowMap local = RowMap::concat(tokens[static_cast<std::size_t>(me)]);
    const RowMap layout = RowMap::concat(gathered());
    for (std::size_t p = 0; p < n; ++p) {
      if (!assign[p].empty())
        for (std::size_t i = 0; i < local.global.size(); ++i)
          m.send[p].push_back({{local.local[i], local.local[i] + local.global[i].size()}, assign[p]});
      if (mine.empty()) continue;
      for (const Range& r : RowMap::concat(tokens[p]).global)
        m.recv[p].push_back({layout.to_local_sorted(r), {0, mine.size()}});
    }
    return m;
  }

  /// heads -> seq: the mirror image; `accumulate` sums replicated KV heads' gradients in peer order.
  [[nodiscard]] Move to_seq(BufferId src, BufferId dst, bool kv, bool accumulate) const {
    Move there = to_heads(dst, src, kv);
    return Move{src, dst, accumulate, std::move(there.recv), std::move(there.send)};
  }
};

}  // namespace seqpar::comm::detail
