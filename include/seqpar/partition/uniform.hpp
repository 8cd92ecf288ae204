// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <vector>

#include "seqpar/partition/partitioner.hpp"

namespace seqpar::partition {

/// Contiguous sharding of the whole packed batch (all sequences back to back): rank r owns tokens
/// [r*T/P, (r+1)*T/P), the remainder spread one token each over the first ranks. No padding, no
/// divisibility requirement. Causal work is unbalanced (later ranks see longer prefixes); that is
/// what Zigzag, PerDoc and Hybrid fix. Used by DeepSpeed-Ulysses, where balance does not matter
/// because attention runs head-sharded over the whole sequence.
///
/// @code
/// auto plan = partition::Uniform{}.plan(batch, Topology{8, 4});   // plan.owned[r]: one range each
/// @endcode
struct Uniform {
  using policy_category = partitioner_tag;
  struct Arguments {
    /// No field: nothing for ranks to agree on (see Strategy::for_each_argument).
    template <class Fn>
    void for_each_argument(Fn&&) const {}
  };
  Arguments args;

  [[nodiscard]] Status can_implement(const DocumentBatch&, const Topology& topo, const MaskMix& = {}) const {
    if (topo.world_size < 1) return Status::refuse("world_size must be >= 1");
    return Status::success();
  }

  /// Equal contiguous token ranges whatever the masks (the mix changes nothing here).
  [[nodiscard]] Placement place(const DocumentBatch& batch, const Topology& topo, const MaskMix& = {}) const {
    topo.validate("partition::Uniform");
    Placement p;
    p.topology = topo;
    const auto n = static_cast<std::int64_t>(topo.world_size);
    const std::int64_t total = batch.total_tokens();
    p.owned.resize(static_cast<std::size_t>(n));
    std::int64_t begin = 0;
    for (std::int64_t r = 0; r < n; ++r) {
      const std::int64_t len = total / n + (r < total % n ? 1 : 0);
      p.owned[static_cast<std::size_t>(r)] = {Range{begin, begin + len}};
      begin += len;
    }
    p.groups.emplace_back(static_cast<std::size_t>(n));
    for (int r = 0; r < topo.world_size; ++r) p.groups[0][static_cast<std::size_t>(r)] = r;
    return p;
  }
  [[nodiscard]] ShardPlan plan(const DocumentBatch& batch, const Topology& topo, AttentionMask mask = {}) const {
    return slice(place(batch, topo, MaskMix::only(mask)), batch, mask);
  }
};

static_assert(Partitioner<Uniform>);

}  // namespace seqpar::partition
