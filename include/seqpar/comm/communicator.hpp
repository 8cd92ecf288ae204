// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <concepts>
#include <vector>

#include "seqpar/comm/program.hpp"
#include "seqpar/core/attention_shape.hpp"
#include "seqpar/core/shard_plan.hpp"
#include "seqpar/core/status.hpp"

namespace seqpar::comm {

/// The plan group `rank` belongs to, and its position in it: where every communicator starts.
struct GroupPosition {
  const std::vector<int>& members;
  int me = 0;
};

[[nodiscard]] inline GroupPosition group_position(const ShardPlan& plan, int rank, const char* where) {
  const int gi = plan.group_of(rank);
  seqpar::detail::require(gi >= 0, where, "rank", rank, "is in no group of the plan");
  const std::vector<int>& members = plan.groups[static_cast<std::size_t>(gi)];
  return {members, static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin())};
}

/// A program with this rank's identity, shape and local token count filled in, no steps yet.
[[nodiscard]] inline Program empty_program(const ShardPlan& plan, const AttentionShape& shape, int rank) {
  Program p;
  p.rank = rank;
  p.head_dim = shape.qk_dim();
  p.head_dim_v = shape.v_dim();
  p.softmax_scale = shape.scale();
  p.local_tokens = plan.local_tokens(rank);
  return p;
}

/// Opt-in tag of communicators.
struct communicator_tag {};

/// A communicator compiles a plan into each rank's forward and backward programs: which pieces of
/// which tensors move where, and which attention each rank computes on what it then holds. It never
/// touches data: the executor runs the programs, the simulator replays them.
template <class C>
concept Communicator = std::derived_from<typename C::policy_category, communicator_tag> &&
    requires(const C& c, const ShardPlan& plan, const AttentionShape& shape, int rank) {
  typename C::Arguments;
  { c.can_implement(plan, shape) } -> std::same_as<Status>;
  { c.compile(plan, shape, rank) } -> std::same_as<CompiledAttention>;
};

}  // namespace seqpar::comm
