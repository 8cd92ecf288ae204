// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <vector>

#include "seqpar/comm/communicator.hpp"
#include "seqpar/core/slice_algebra.hpp"

namespace seqpar::comm {

/// All-gather context parallelism (the Llama 3 report's context parallelism, arXiv 2407.21783):
/// queries stay where the plan put them; one collective gathers the group's K and V, then each rank
/// attends its queries in one kernel call with no pipeline of partial results. Backward gathers K, V
/// again and returns each gathered row's dK, dV to its owner in a second collective, where they are
/// summed (peer order: deterministic).
///
/// `Arguments::sharding_aware` (FlashCP's sharding-aware communication, research/seeds.md): each rank
/// receives from each peer exactly the KV rows its slices read (keys_needed), so a rank
/// whose documents are all local receives nothing. Plain, every rank gathers every peer's rows.
///
/// Why beside Ring: a ring cuts a query's keys into one slice per KV owner and pays P - 1 latencies;
/// the gather pays one collective and computes whole documents in one call. With GQA (few KV heads)
/// the gathered bytes are small and this wins; with many KV heads and long documents the ring
/// overlaps its traffic with compute and wins (bench/replay, FlashCP).
///
/// Volume per rank and layer (forward): plain, the group's K and V minus its own; sharding-aware, the
/// KV its queries read from other ranks. Backward: the same, plus as many dK, dV bytes back.
/// Memory: the gathered K, V (and dK, dV in backward) of the rows this rank reads.
/// Works with any partitioner and head count (heads are not sharded).
///
/// @code
/// using Llama3Cp = Strategy<partition::Zigzag, comm::AllGather>;  // WLB-LLM: PerDoc x AllGather
/// using FlashCp = Strategy<partition::Hybrid, comm::AllGather>;  // args.comm.sharding_aware = true
/// @endcode
struct AllGather {
  using policy_category = communicator_tag;
  struct Arguments {
    bool sharding_aware = false;
  };
  Arguments args;

  [[nodiscard]] Status can_implement(const ShardPlan&, const AttentionShape&) const { return Status::success(); }

  [[nodiscard]] CompiledAttention compile(const ShardPlan& plan, const AttentionShape& shape, int rank) const {
    shape.validate("comm::AllGather");
    const GroupPosition group = group_position(plan, rank, "comm::AllGather::compile");
    const std::vector<int>& members = group.members;
    const auto k = members.size();
    const auto me = static_cast<std::size_t>(group.me);
    const auto tokens = [&](std::size_t i) -> const std::vector<Range>& {
      return plan.owned[static_cast<std::size_t>(members[i])];
    };
    const auto slices = [&](std::size_t i) -> const std::vector<AttnSlice>& {
      return plan.slices[static_cast<std::size_t>(members[i])];
    };
    // Global key ranges `reader` gathers from `owner`: sender and receiver compute the same list in
    // the same order, so the packed bytes need no header.
    const auto gathered_from = [&](std::size_t reader, std::size_t owner) {
      return args.sharding_aware ? keys_needed(slices(reader), tokens(owner)) : RowMap::concat(tokens(owner)).global;
    };
    std::vector<std::vector<Range>> in(k), out(k);
    std::vector<Range> all;
    for (std::size_t i = 0; i < k; ++i) {
      in[i] = gathered_from(me, i);
      out[i] = gathered_from(i, me);
      all.insert(all.end(), in[i].begin(), in[i].end());
    }
    const RowMap gathered = RowMap::concat(in_token_order(std::move(all)));
    const RowMap mine = RowMap::concat(tokens(me));
    const Range kv_heads{0, shape.heads_kv};
    std::vector<std::vector<Piece>> send(k), recv(k);
    for (std::size_t i = 0; i < k; ++i) {
      std::size_t hint = 0;
      for (const Range& r : out[i]) send[i].push_back({mine.to_local(r, hint), kv_heads});
      for (const Range& r : in[i]) recv[i].push_back({gathered.to_local_sorted(r), kv_heads});
    }
    const auto gather = [&](BufferId src, BufferId dst) { return Move{src, dst, false, send, recv}; };
    const auto give_back = [&](BufferId src, BufferId dst) { return Move{src, dst, true, recv, send}; };

    ComputeStep c;
    c.k = BufferId::kKGather, c.v = BufferId::kVGather;
    c.dk = BufferId::kDkGather, c.dv = BufferId::kDvGather;
    c.waves = waves(localize(plan.slices[static_cast<std::size_t>(rank)], mine, gathered));
    c.head_groups = {HeadGroup{{0, shape.heads_q}, kv_heads}};

    const auto base = [&] {
      Program p = empty_program(plan, shape, rank);
      p.level_members[static_cast<std::size_t>(Level::kGroup)] = members;
      p.staging.push_back({BufferId::kKGather, gathered.rows, shape.heads_kv});
      p.staging.push_back({BufferId::kVGather, gathered.rows, shape.heads_kv});
      p.steps.push_back(
          ExchangeStep{Level::kGroup,
                       group.me,
                       {gather(BufferId::kK, BufferId::kKGather), gather(BufferId::kV, BufferId::kVGather)}});
      return p;
    };
    CompiledAttention compiled{base(), base()};
    Program& fwd = compiled.forward;
    if (c.waves.size() > 1)
      fwd.staging.insert(fwd.staging.end(), {{BufferId::kOPart, mine.rows, shape.heads_q},
                                             {BufferId::kLsePart, mine.rows, shape.heads_q}});
    fwd.steps.push_back(c);

    Program& bwd = compiled.backward;
    bwd.staging.push_back({BufferId::kDkGather, gathered.rows, shape.heads_kv});
    bwd.staging.push_back({BufferId::kDvGather, gathered.rows, shape.heads_kv});
    // The kernel adds into dQ, dK, dV; the return adds the gathered gradients into the caller's dK, dV.
    bwd.steps.push_back(
        ZeroStep{{BufferId::kDq, BufferId::kDk, BufferId::kDv, BufferId::kDkGather, BufferId::kDvGather}});
    c.backward = true;
    bwd.steps.push_back(std::move(c));
    bwd.steps.push_back(
        ExchangeStep{Level::kGroup,
                     group.me,
                     {give_back(BufferId::kDkGather, BufferId::kDk), give_back(BufferId::kDvGather, BufferId::kDv)}});
    return compiled;
  }
};

static_assert(Communicator<AllGather>);

}  // namespace seqpar::comm
