// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "seqpar/comm/communicator.hpp"
#include "seqpar/comm/detail/head_split.hpp"
#include "seqpar/comm/detail/ring_builder.hpp"

namespace seqpar::comm {

/// Ring attention (context parallelism): queries stay where the plan put them; KV blocks travel
/// around the group in P-1 steps, each rank merging its partial (O, LSE) in fp32. The next transfer
/// is posted before the current compute (double buffering), and steps whose slices are fully masked
/// (other documents, the causal future) skip the compute.
///
/// `Arguments::sharding_aware` (HSAP's sequence-aware P2P, FlashCP's sharding-aware KV, MagiAttention's
/// GroupCast): instead of forwarding whole blocks, at step s rank r sends rank r+s exactly the KV rows
/// that r+s's slices read, and nothing when they read none; with packed documents most pairs of
/// ranks then exchange nothing.
///
/// Volume per rank and layer (forward): plain, (P-1)/P of all of the group's K and V; sharding-aware,
/// the KV its queries read from other ranks. Backward: the same KV again, and each received block's
/// dK, dV straight back to the block's owner, who adds them in step order (deterministic).
/// Memory: two KV slots of the largest block, plus a partial (O, LSE) of the local queries.
/// Works with any partitioner, any head count (heads are not sharded).
///
/// @code
/// using ZigzagRing = Strategy<partition::Zigzag, comm::Ring>;
/// ZigzagRing::Arguments args;  args.comm.sharding_aware = true;
/// @endcode
struct Ring {
  using policy_category = communicator_tag;
  struct Arguments {
    bool sharding_aware = false;
    /// fn(name, value) for each field, compared across ranks (Strategy::for_each_argument).
    template <class Fn>
    void for_each_argument(Fn&& fn) const {
      fn("sharding_aware", sharding_aware);
    }
  };
  Arguments args;

  [[nodiscard]] Status can_implement(const ShardPlan&, const AttentionShape&) const { return Status::success(); }

  [[nodiscard]] CompiledAttention compile(const ShardPlan& plan, const AttentionShape& shape, int rank) const {
    shape.validate("comm::Ring");
    const GroupPosition group = group_position(plan, rank, "comm::Ring::compile");
    const std::vector<int>& members = group.members;
    detail::RingSpec spec;
    spec.level = Level::kGroup;
    spec.me = group.me;
    for (int m : members) {
      spec.token_views.push_back(&plan.owned[static_cast<std::size_t>(m)]);
      spec.slice_views.push_back(&plan.slices[static_cast<std::size_t>(m)]);
    }
    spec.sharding_aware = args.sharding_aware;
    spec.q_heads = shape.heads_q;
    spec.kv_heads = shape.heads_kv;
    spec.head_groups = {HeadGroup{{0, shape.heads_q}, {0, shape.heads_kv}}};

    const auto base = [&] {
      Program p = empty_program(plan, shape, rank);
      p.level_members[static_cast<std::size_t>(Level::kGroup)] = members;
      return p;
    };
    CompiledAttention out{base(), base()};
    const detail::RingSchedule sched(spec);
    detail::add_ring_staging(out.forward, sched, false);
    detail::append_ring_forward(out.forward, sched);
    detail::add_ring_staging(out.backward, sched, true);
    detail::append_ring_backward(out.backward, sched);
    return out;
  }
};

static_assert(Communicator<Ring>);

}  // namespace seqpar::comm
