// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <utility>
#include <vector>

#include "seqpar/comm/communicator.hpp"
#include "seqpar/core/slice_algebra.hpp"

namespace seqpar::comm {

/// All-gather context parallelism (the Llama 3 report's context parallelism, arXiv 2407.21783):
/// queries stay where the plan put them; the group's K and V are gathered, then each rank attends its
/// queries with no pipeline of per-step partial results. Backward gathers K, V again and returns each
/// gathered row's dK, dV to its owner, where they are summed (peer order: deterministic).
///
/// Overlapped (issue 16): the gather is one grouped post of non-blocking transfers (a send and a receive
/// per peer, the bytes an all-gather moves), and while it flies the rank attends its queries to its own
/// KV rows (local rows first, as the ring's step 0); then it waits and attends to all the gathered rows in
/// one kernel call, merged into O, LSE in fp32. Backward likewise: the local part of the gradient runs
/// under the gather, the gathered part after it, and the dK, dV return is a second grouped post whose
/// receives add into the owner's dK, dV in peer order. Before, one blocking all-to-all gathered
/// everything first, and on a single long document (FlashCP) the layer paid the whole gather exposed:
/// 0.91x of the best baseline where the ring, which overlaps, was faster.
///
/// `Arguments::sharding_aware` (FlashCP's sharding-aware communication): each rank
/// receives from each peer exactly the KV rows its slices read (keys_needed), so a rank
/// whose documents are all local receives nothing. Plain, every rank gathers every peer's rows.
///
/// Why beside Ring: a ring cuts a query's keys into one slice per KV owner and pays P - 1 latencies in
/// sequence; the gather pays one grouped call and computes the remote keys in one kernel call. With GQA
/// (few KV heads) the gathered bytes are small and this wins; with many KV heads and long documents the
/// ring hides more of its traffic (every step's transfer behind the previous step's compute, where the
/// gather hides it behind the local part only) and wins (bench/replay, FlashCP).
///
/// Volume per rank and layer (forward): plain, the group's K and V minus its own; sharding-aware, the
/// KV its queries read from other ranks. Backward: the same, plus as many dK, dV bytes back.
/// Memory: the gathered K, V of the other ranks' rows this rank reads (and their dK, dV in backward),
/// and a partial (O, LSE) of the local queries.
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
    /// fn(name, value) for each field, compared across ranks (Strategy::for_each_argument).
    template <class Fn>
    void for_each_argument(Fn&& fn) const {
      fn("sharding_aware", sharding_aware);
    }
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
      std::vector<Range> r =
          args.sharding_aware ? keys_needed(slices(reader), tokens(owner)) : RowMap::concat(tokens(owner)).global;
      std::erase_if(r, [](const Range& x) { return x.empty(); });
      return r;
    };
    // in[i]: what I gather from peer i; out[i]: what peer i gathers from me (none from myself: my own
    // rows are read where they are).
    std::vector<std::vector<Range>> in(k), out(k);
    std::vector<Range> all;
    for (std::size_t i = 0; i < k; ++i) {
      if (i == me) continue;
      in[i] = gathered_from(me, i);
      out[i] = gathered_from(i, me);
      all.insert(all.end(), in[i].begin(), in[i].end());
    }
    const RowMap gathered = RowMap::concat(in_token_order(std::move(all)));
    const RowMap mine = RowMap::concat(tokens(me));
    const Range kv_heads{0, shape.heads_kv};
    // Pieces of buffers a, b (heads [0, kv_heads)) covering `ranges`, located through `map`.
    const auto pieces = [&](const std::vector<Range>& ranges, const RowMap& map, BufferId a, BufferId b) {
      std::vector<BufferPiece> ps;
      for (BufferId buf : {a, b}) {
        std::size_t hint = 0;
        for (const Range& r : ranges) ps.push_back({buf, {map.to_local(r, hint), kv_heads}});
      }
      return ps;
    };
    // The grouped post of one direction: `gather` sends my rows to their readers and receives the
    // gathered rows; the gradient return sends the gathered rows' gradients back and adds what comes in.
    const auto grouped = [&](int slot, int tag, bool gather, BufferId mine_a, BufferId mine_b, BufferId far_a,
                             BufferId far_b) {
      PostStep post{Level::kGroup, slot, tag, !gather, {}, {}};
      for (std::size_t i = 0; i < k; ++i) {
        if (!out[i].empty()) {
          auto ps = pieces(out[i], mine, mine_a, mine_b);
          (gather ? post.sends : post.recvs).push_back({static_cast<int>(i), std::move(ps)});
        }
        if (!in[i].empty()) {
          auto ps = pieces(in[i], gathered, far_a, far_b);
          (gather ? post.recvs : post.sends).push_back({static_cast<int>(i), std::move(ps)});
        }
      }
      return post;
    };
    const PostStep kv_post = grouped(0, 0, true, BufferId::kK, BufferId::kV, BufferId::kKGather, BufferId::kVGather);
    const bool talks = !kv_post.sends.empty() || !kv_post.recvs.empty();

    const std::vector<AttnSlice>& my_slices = plan.slices[static_cast<std::size_t>(rank)];
    ComputeStep local;
    local.waves = waves(localize(my_slices, mine, mine));
    local.head_groups = {HeadGroup{{0, shape.heads_q}, kv_heads}};
    ComputeStep remote = local;
    remote.merge = true;
    remote.k = BufferId::kKGather, remote.v = BufferId::kVGather;
    remote.dk = BufferId::kDkGather, remote.dv = BufferId::kDvGather;
    remote.waves =
        gathered.rows > 0 ? waves(localize(my_slices, mine, gathered)) : std::vector<std::vector<AttnSlice>>{};

    const auto base = [&] {
      Program p = empty_program(plan, shape, rank);
      p.level_members[static_cast<std::size_t>(Level::kGroup)] = members;
      if (gathered.rows > 0) {
        p.staging.push_back({BufferId::kKGather, gathered.rows, shape.heads_kv});
        p.staging.push_back({BufferId::kVGather, gathered.rows, shape.heads_kv});
      }
      return p;
    };
    CompiledAttention compiled{base(), base()};

    // Forward: post the gather, attend to the local rows while it flies (this writes O, LSE), wait, then
    // merge the attention to the gathered rows.
    Program& fwd = compiled.forward;
    if (local.waves.size() > 1 || !remote.waves.empty())
      fwd.staging.insert(fwd.staging.end(), {{BufferId::kOPart, mine.rows, shape.heads_q},
                                             {BufferId::kLsePart, mine.rows, shape.heads_q}});
    if (talks) fwd.steps.push_back(kv_post);
    fwd.steps.push_back(local);
    if (talks) fwd.steps.push_back(WaitStep{0});
    if (!remote.waves.empty()) fwd.steps.push_back(remote);

    // Backward: the same gather under the local gradient (which adds into the caller's dK, dV); the
    // gathered rows' gradients go back to their owners, who add them in peer order.
    Program& bwd = compiled.backward;
    if (gathered.rows > 0) {
      bwd.staging.push_back({BufferId::kDkGather, gathered.rows, shape.heads_kv});
      bwd.staging.push_back({BufferId::kDvGather, gathered.rows, shape.heads_kv});
    }
    std::vector<BufferId> zero = {BufferId::kDq, BufferId::kDk, BufferId::kDv};
    if (gathered.rows > 0) zero.insert(zero.end(), {BufferId::kDkGather, BufferId::kDvGather});
    bwd.steps.push_back(ZeroStep{std::move(zero)});
    if (talks) bwd.steps.push_back(kv_post);
    local.backward = remote.backward = true;
    if (!local.waves.empty()) bwd.steps.push_back(std::move(local));
    if (talks) bwd.steps.push_back(WaitStep{0});
    if (!remote.waves.empty()) bwd.steps.push_back(std::move(remote));
    if (talks) {
      bwd.steps.push_back(grouped(1, 1, false, BufferId::kDk, BufferId::kDv, BufferId::kDkGather, BufferId::kDvGather));
      bwd.steps.push_back(WaitStep{1});
    }
    return compiled;
  }
};

static_assert(Communicator<AllGather>);

}  // namespace seqpar::comm
