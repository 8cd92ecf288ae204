// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "seqpar/core/range_set.hpp"
#include "seqpar/partition/partitioner.hpp"

namespace seqpar::partition {
namespace detail {

/// The refusal every topology-only partitioner shares.
[[nodiscard]] inline Status topology_status(const Topology& topo) {
  if (topo.world_size < 1) return Status::refuse("world_size must be >= 1");
  if (topo.ranks_per_node < 1) return Status::refuse("ranks_per_node must be >= 1");
  return Status::success();
}

// Code in seqpar::partition that names `detail::x` must keep finding seqpar::detail's helpers
// (document_causal_slices_for, require) now that this namespace exists: qualified lookup follows
// this using-directive when a name is not declared here.
using namespace seqpar::detail;

/// Head-tail ("zigzag") cut of `span` over `n` ranks: the span is cut into 2n consecutive chunks and
/// rank r receives chunks r and 2n-1-r, appended to owned[r] in that (ascending) order.
/// Every chunk has floor(len/2n) tokens; the len % 2n remainder tokens go one per rank to ranks
/// cursor, cursor+1, ... (mod n), and `cursor` moves past them, so over many spans the remainder is
/// spread round-robin and per-rank token counts never differ by more than one. A rank receiving one
/// extra token puts it in its front chunk, a rank receiving two (only when len % 2n > n) in both.
/// Spans shorter than 2n leave some ranks without tokens of this span; nothing is padded.
inline void zigzag_cut(Range span, int n, std::int64_t& cursor, std::vector<std::vector<Range>>& owned) {
  const auto chunks = static_cast<std::int64_t>(2 * n);
  const std::int64_t base = span.size() / chunks;
  const std::int64_t rem = span.size() % chunks;
  // Remainder tokens rank `rank` receives: the i in [0, rem) with (cursor + i) % n == rank (rem < 2n),
  // counted without a per-span table (Per-Doc cuts every document: a million of them at one token).
  const std::int64_t first = cursor;
  const auto extra = [&](int rank) {
    const std::int64_t d = ((rank - first) % n + n) % n;
    return (d < rem ? 1 : 0) + (d + n < rem ? 1 : 0);
  };
  cursor = (cursor + rem) % n;
  std::int64_t at = span.begin;
  for (int c = 0; c < 2 * n; ++c) {
    const bool front = c < n;
    const int rank = front ? c : 2 * n - 1 - c;
    const int e = extra(rank);
    const std::int64_t len = base + ((front ? e >= 1 : e == 2) ? 1 : 0);
    append_range(owned[static_cast<std::size_t>(rank)], {at, at + len});
    at += len;
  }
}

/// The windows of a mask mix, sorted and distinct, and whether it has a causal (unwindowed) mask: what
/// mix_cut needs of the mix, made once per placement (not per document: a million one-token documents).
struct MixWindows {
  std::vector<std::int64_t> windows;
  bool causal = false;
  explicit MixWindows(const MaskMix& mix) {
    for (const AttentionMask& m : mix.masks()) {
      if (m.window > 0)
        windows.push_back(m.window);
      else
        causal = true;
    }
    std::sort(windows.begin(), windows.end());
    windows.erase(std::unique(windows.begin(), windows.end()), windows.end());
  }
};

/// Per-Doc cut of one document balanced for a mask mix. Row i of a document costs, per layer of the
/// mix, min(i + 1, w) pairs for each window w (i + 1 without one): between two consecutive windows of the
/// mix the row cost is affine in i (a constant from the windows already passed plus a slope from the
/// masks still growing). The head-tail pairing balances any affine cost exactly (the pair sums are
/// equal), so the document is cut at the mix's windows and each region zigzag; a region where every
/// mask has stopped growing (past the longest window of an all-window mix) costs the same per row and
/// is cut into n contiguous equal pieces (head-tail would hand rank n-1 two full chunks and rank 0 a ramp
/// chunk there: 1.18x on a 128K mix at w = 4K). One region for an all-causal mix: the zigzag cut. All
/// regions deal their remainders from the same cursor, so per-rank token counts differ by at most one.
inline void mix_cut(Range span, int n, const MixWindows& mix, std::int64_t& cursor,
                    std::vector<std::vector<Range>>& owned) {
  std::int64_t at = span.begin;
  bool cut = false;
  for (const std::int64_t w : mix.windows) {  // the windows inside the document, ascending
    if (w >= span.size()) break;
    zigzag_cut({at, span.begin + w}, n, cursor, owned);
    at = span.begin + w;
    cut = true;
  }
  if (at == span.end) return;
  const bool grows_to_the_end = mix.causal || !cut || mix.windows.back() >= span.size();
  if (grows_to_the_end) {
    zigzag_cut({at, span.end}, n, cursor, owned);
    return;
  }
  const std::int64_t band = span.end - at, base = band / n, rem = band % n;
  for (int rank = 0; rank < n; ++rank) {
    const std::int64_t len = base + ((((rank - cursor) % n + n) % n) < rem ? 1 : 0);
    append_range(owned[static_cast<std::size_t>(rank)], {at, at + len});
    at += len;
  }
  cursor = (cursor + rem) % n;
}

/// One group of all ranks.
inline void finish_single_group(Placement& p) {
  p.groups.assign(1, std::vector<int>(p.owned.size()));
  for (std::size_t r = 0; r < p.owned.size(); ++r) p.groups[0][r] = static_cast<int>(r);
}

}  // namespace detail

/// Head-tail ("zigzag") sharding of every sequence, as Megatron-LM context parallelism and
/// Transformer Engine's THD path do per sequence: sequence b is cut into 2P chunks and rank r owns
/// chunks r and 2P-1-r of it, so each rank holds an early (cheap) and a late (expensive) part of the
/// causal triangle. Uneven lengths are never padded: each chunk has floor(S_b/2P) tokens and the
/// S_b % 2P remainder tokens are dealt one per rank round-robin with a cursor that carries over from
/// one sequence to the next (sequences shorter than 2P leave some ranks without tokens of them).
///
/// Balance: per-rank token counts differ by at most one over the whole batch (max = ceil(T/P)).
/// For a sequence that is one document the causal work is balanced up to the remainder: each rank's
/// area is within 4S + 4P pairs of every other's, i.e. compute imbalance <= 1 + 4P(S + P)/area.
/// Zigzag ignores document boundaries, so a sequence packed with many documents is not balanced
/// (use PerDoc or Hybrid for that).
///
/// Communication: ring attention passes every chunk to every rank of the group (P-1 KV blocks per
/// rank per step pair, half of them fully masked and skipped); the all-gather variant moves
/// (P-1)/P of the sequence's KV to each rank. Memory: ceil(T/P) tokens per rank.
///
/// @code
/// auto plan = partition::Zigzag{}.plan(DocumentBatch::single({10}), Topology{2, 2});
/// // plan.owned[0] == {[0, 3), [8, 10)}, plan.owned[1] == {[3, 8)}
/// @endcode
struct Zigzag {
  using policy_category = partitioner_tag;
  struct Arguments {
    /// No field: nothing for ranks to agree on (see Strategy::for_each_argument).
    template <class Fn>
    void for_each_argument(Fn&&) const {}
  };
  Arguments args;

  [[nodiscard]] Status can_implement(const DocumentBatch&, const Topology& topo, const MaskMix& = {}) const {
    return detail::topology_status(topo);
  }

  /// The head-tail cut of every sequence whatever the masks (it ignores documents, hence windows too).
  [[nodiscard]] Placement place(const DocumentBatch& batch, const Topology& topo, const MaskMix& = {}) const {
    topo.validate("partition::Zigzag");
    Placement p;
    p.topology = topo;
    p.owned.resize(static_cast<std::size_t>(topo.world_size));
    std::int64_t cursor = 0;
    for (int b = 0; b < batch.num_sequences(); ++b)
      detail::zigzag_cut(batch.sequence(b), topo.world_size, cursor, p.owned);
    detail::finish_single_group(p);
    return p;
  }
  [[nodiscard]] ShardPlan plan(const DocumentBatch& batch, const Topology& topo, AttentionMask mask = {}) const {
    return slice(place(batch, topo, MaskMix::only(mask)), batch, mask);
  }
};

static_assert(Partitioner<Zigzag>);

}  // namespace seqpar::partition
