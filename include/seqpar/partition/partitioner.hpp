// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <concepts>
#include <string>

#include "seqpar/core/attention_mask.hpp"
#include "seqpar/core/document_batch.hpp"
#include "seqpar/core/shard_plan.hpp"
#include "seqpar/core/status.hpp"
#include "seqpar/core/topology.hpp"

namespace seqpar::partition {

/// Opt-in tag of partitioners.
struct partitioner_tag {};

/// A partitioner decides which rank holds which tokens of a batch (its Placement), once per batch for
/// every layer, balanced for the model's mask mix (the layer-weighted work of its masks). It depends
/// only on the document lengths and the mix, never on tensor values or on the mask of one call: the
/// slices a call's mask asks of the placement are derived from it (`seqpar::slice`). `plan(batch,
/// topology, mask)` is the placement balanced for that one mask, sliced for it.
template <class P>
concept Partitioner = std::derived_from<typename P::policy_category, partitioner_tag> &&
    requires(const P& p, const DocumentBatch& b, const Topology& t, const MaskMix& mix, AttentionMask m) {
  typename P::Arguments;
  { p.place(b, t, mix) } -> std::same_as<Placement>;
  { p.plan(b, t, m) } -> std::same_as<ShardPlan>;
  { p.can_implement(b, t, mix) } -> std::same_as<Status>;
};

}  // namespace seqpar::partition
