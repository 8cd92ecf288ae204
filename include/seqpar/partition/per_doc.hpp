// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <cstdint>
#include <vector>

#include "seqpar/partition/partitioner.hpp"
#include "seqpar/partition/zigzag.hpp"

namespace seqpar::partition {

/// Per-document head-tail sharding (WLB-LLM's per-document context parallelism; Transformer Engine's
/// THD layout cut per document): every document of length s is cut into 2P chunks of floor(s/2P)
/// tokens and rank r owns chunks r and 2P-1-r of it. The s % 2P remainder tokens of each document
/// are dealt one per rank round-robin with a single cursor that runs across all documents of the
/// batch, so no padding is needed and documents shorter than 2P just give some ranks nothing.
/// A rank's owned ranges are its pieces in global token order.
///
/// Balance: per-rank token counts differ by at most one (max = ceil(T/P)). Every document is split
/// evenly across all ranks, so causal work is balanced for any document mix: the per-document spread
/// between ranks is at most 4s + 4P pairs, hence compute imbalance <= 1 + 4P * sum_d(s_d + P) / A
/// (A = the batch's causal area); for documents much longer than P this is close to 1.
///
/// Under a mask mix with sliding windows each document is cut at the mix's windows, every region
/// balanced for the layer-weighted work of the mix (detail::mix_cut): an all-window-w model gets a
/// triangle (its first w rows, zigzag) and a band (the rest, n contiguous equal pieces: the band's rows
/// all cost w pairs, and the head-tail pairing would leave it 1.18x imbalanced).
///
/// Communication: every rank needs KV from every rank for every document. All-gather (WLB-LLM):
/// (P-1)/P of all KV per rank; sharding-aware: rank r needs chunks 0..2P-1-r of each document only
/// (2P-2-r received chunks), about 25% less. Short documents become tiny chunks (s/2P tokens) that
/// waste kernel tiles; Hybrid keeps those whole on one rank instead.
///
/// @code
/// auto plan = partition::PerDoc{}.plan(DocumentBatch::single({8, 3}), Topology{2, 2});
/// // plan.owned[0] == {[0, 2), [6, 9), [10, 11)}, plan.owned[1] == {[2, 6), [9, 10)}
/// @endcode
struct PerDoc {
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

  [[nodiscard]] Placement place(const DocumentBatch& batch, const Topology& topo, const MaskMix& mix = {}) const {
    topo.validate("partition::PerDoc");
    Placement p;
    p.topology = topo;
    p.owned.resize(static_cast<std::size_t>(topo.world_size));
    std::int64_t cursor = 0;
    const detail::MixWindows windows(mix);
    for (const Document& d : batch.documents()) detail::mix_cut(d.tokens, topo.world_size, windows, cursor, p.owned);
    detail::finish_single_group(p);
    return p;
  }
  [[nodiscard]] ShardPlan plan(const DocumentBatch& batch, const Topology& topo, AttentionMask mask = {}) const {
    return slice(place(batch, topo, MaskMix::only(mask)), batch, mask);
  }
};

static_assert(Partitioner<PerDoc>);

}  // namespace seqpar::partition
