// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <concepts>
#include <string>

#include "seqpar/core/document_batch.hpp"
#include "seqpar/core/shard_plan.hpp"
#include "seqpar/core/status.hpp"
#include "seqpar/core/topology.hpp"

namespace seqpar::partition {

/// Opt-in tag of partitioners.
struct partitioner_tag {};

/// A partitioner decides which rank owns which tokens of a batch, and the attention slices each
/// rank's queries need. It depends only on the document lengths, never on tensor values.
template <class P>
concept Partitioner = std::derived_from<typename P::policy_category, partitioner_tag> &&
    requires(const P& p, const DocumentBatch& b, const Topology& t) {
  typename P::Arguments;
  { p.plan(b, t) } -> std::same_as<ShardPlan>;
  { p.can_implement(b, t) } -> std::same_as<Status>;
};

}  // namespace seqpar::partition
