// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include "seqpar/comm/all_to_all.hpp"
#include "seqpar/comm/communicator.hpp"
#include "seqpar/comm/detail/ring_builder.hpp"
#include "seqpar/comm/ring.hpp"

namespace seqpar::comm {

/// Two-level sequence parallelism (USP, LoongTrain, HSAP): inside each group of `inner_size`
/// consecutive ranks (a node: fast links) an all-to-all shards heads; across the groups a ring
/// (optionally sharding-aware, HSAP's sequence-aware P2P) passes KV between ranks that hold the same
/// heads. The total degree is no longer capped by the head count, and the slow links carry only
/// ring traffic of 1/inner_size of the heads.
///
/// Volume per rank and layer (forward): the all-to-all of Q, K, V, O inside the node, plus the ring's
/// KV of its heads across nodes. Memory: the head-sharded copies (inner group's tokens x local heads)
/// and two KV slots of one node's tokens.
/// Requirements: inner_size divides every group's size and is at most heads_q (can_implement says).
///
/// @code
/// using Usp = Strategy<partition::Zigzag, comm::Hierarchical<comm::AllToAll, comm::Ring>>;
/// Usp::Arguments args;  args.comm.inner_size = 4;  args.comm.outer.sharding_aware = true;
/// @endcode
template <class Inner, class Outer>
struct Hierarchical {
  static_assert(std::is_same_v<Inner, AllToAll> && std::is_same_v<Outer, Ring>,
                "Hierarchical is implemented as Hierarchical<AllToAll, Ring>: all-to-all inside a node, "
                "ring across nodes");
  using policy_category = communicator_tag;
  struct Arguments {
    int inner_size = 0;  ///< ranks per inner group; 0: the largest divisor of the group size that fits
                         ///< a node and the head count
    typename Outer::Arguments outer{};
    /// fn(name, value) for each field, compared across ranks (Strategy::for_each_argument); `outer` names its own.
    template <class Fn>
    void for_each_argument(Fn&& fn) const {
      fn("inner_size", inner_size);
      fn("outer", outer);
    }
  };
  Arguments args;

  /// Inner degree used for a group of k ranks, or 0 if none works.
  [[nodiscard]] int inner_size_for(int k, const Topology& topo, const AttentionShape& shape) const {
    if (args.inner_size < 0) return 0;  // only 0 means automatic
    if (args.inner_size > 0)
      return (k % args.inner_size == 0 && args.inner_size <= shape.heads_q) ? args.inner_size : 0;
    for (int d = std::min({k, topo.ranks_per_node, shape.heads_q}); d >= 1; --d)
      if (k % d == 0) return d;
    return 0;
  }

  [[nodiscard]] Status can_implement(const ShardPlan& plan, const AttentionShape& shape) const {
    if (args.inner_size < 0)
      return Status::refuse("Hierarchical: inner_size = " + std::to_string(args.inner_size) +
                            ": must be >= 1, or 0 for automatic");
    for (const auto& g : plan.groups) {
      const int k = static_cast<int>(g.size());
      if (inner_size_for(k, plan.topology, shape) == 0)
        return Status::refuse("Hierarchical: inner_size = " + std::to_string(args.inner_size) +
                              " must divide the group size " + std::to_string(k) +
                              " and be <= heads_q = " + std::to_string(shape.heads_q));
    }
    return Status::success();
  }

  [[nodiscard]] CompiledAttention compile(const ShardPlan& plan, const AttentionShape& shape, int rank) const {
    shape.validate("comm::Hierarchical");
    const GroupPosition group = group_position(plan, rank, "comm::Hierarchical::compile");
    const std::vector<int>& members = group.members;
    const int k = static_cast<int>(members.size());
    const int inner = inner_size_for(k, plan.topology, shape);
    seqpar::detail::require(inner > 0, "comm::Hierarchical::compile", "args.inner_size", args.inner_size,
                            "does not divide the group size " + std::to_string(k) + " (see can_implement)");
    const int pos = group.me;
    const int outer = k / inner, i = pos % inner, j = pos / inner;
    const auto member = [&](int jj, int ii) { return members[static_cast<std::size_t>(jj * inner + ii)]; };

    detail::A2ASpec a2a;
    a2a.level = Level::kInner;
    a2a.me = i;
    for (int ii = 0; ii < inner; ++ii) a2a.tokens.push_back(plan.owned[static_cast<std::size_t>(member(j, ii))]);
    a2a.heads = detail::assign_heads(shape, inner);
    const Range my_q = a2a.heads.q[static_cast<std::size_t>(i)], my_kv = a2a.heads.kv[static_cast<std::size_t>(i)];

    detail::RingSpec ring;
    ring.level = Level::kOuter;
    ring.me = j;
    for (int jj = 0; jj < outer; ++jj) {
      std::vector<Range> toks;
      std::vector<AttnSlice> sl;
      for (int ii = 0; ii < inner; ++ii) {
        const auto& o = plan.owned[static_cast<std::size_t>(member(jj, ii))];
        const auto& s = plan.slices[static_cast<std::size_t>(member(jj, ii))];
        toks.insert(toks.end(), o.begin(), o.end());
        sl.insert(sl.end(), s.begin(), s.end());
      }
      // The rows of member jj's head-sharded buffers: the layout its all-to-all writes (A2ASpec::gathered).
      ring.tokens.push_back(in_token_order(std::move(toks)));
      ring.slices.push_back(std::move(sl));
    }
    ring.sharding_aware = args.outer.sharding_aware;
    ring.q = BufferId::kQHeads, ring.k = BufferId::kKHeads, ring.v = BufferId::kVHeads;
    ring.o = BufferId::kOHeads, ring.lse = BufferId::kLseHeads, ring.dout = BufferId::kDoutHeads;
    ring.dq = BufferId::kDqHeads, ring.dk = BufferId::kDkHeads, ring.dv = BufferId::kDvHeads;
    ring.q_heads = static_cast<int>(my_q.size());
    ring.kv_heads = static_cast<int>(my_kv.size());
    ring.head_groups = detail::head_groups(my_q, my_kv, shape.group_size());

    Program p = empty_program(plan, shape, rank);
    // World-unique colors: inner groups by their first rank (even), outer rings by theirs (odd).
    p.splits[static_cast<std::size_t>(Level::kInner)] = {2 * member(j, 0), i};
    p.splits[static_cast<std::size_t>(Level::kOuter)] = {2 * member(0, i) + 1, j};
    for (int ii = 0; ii < inner; ++ii)
      p.level_members[static_cast<std::size_t>(Level::kInner)].push_back(member(j, ii));
    for (int jj = 0; jj < outer; ++jj)
      p.level_members[static_cast<std::size_t>(Level::kOuter)].push_back(member(jj, i));
    CompiledAttention out{p, p};
    const detail::RingSchedule sched(ring);
    AllToAll::append_head_sharded(
        out, a2a, {},
        [&](Program& prog, const ComputeStep& c) {
          Program tmp;
          detail::add_ring_staging(tmp, sched, c.backward);
          if (c.backward)
            detail::append_ring_backward(tmp, sched);
          else
            detail::append_ring_forward(tmp, sched);
          prog.staging.insert(prog.staging.end(), tmp.staging.begin(), tmp.staging.end());
          return std::move(tmp.steps);
        },
        shape);
    return out;
  }
};

static_assert(Communicator<Hierarchical<AllToAll, Ring>>);

}  // namespace seqpar::comm
