// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "seqpar/comm/communicator.hpp"
#include "seqpar/comm/detail/head_split.hpp"

namespace seqpar::comm {

/// DeepSpeed-Ulysses: inside each group of the plan, an all-to-all turns sequence-sharded Q, K, V
/// (local tokens, all heads) into head-sharded ones (all of the group's tokens, a share of the heads),
/// attention runs on whole documents locally, and a second all-to-all brings O and LSE back to the
/// owners of the tokens, in the plan's token order (so any partitioner works underneath).
///
/// Volume per rank and layer (forward): (K-1)/K of the local Q, K, V, O (and LSE); backward moves
/// Q, K, V, O, dO, LSE in and dQ, dK, dV out. GQA: KV heads move once when heads_kv >= K; below that
/// each rank receives only the KV heads its query heads read, and their gradients are summed back in
/// rank order (deterministic). Head counts need not divide K (uneven split); a group needs at least
/// as many query heads as ranks, else `can_implement` refuses (use Ring or Hierarchical).
/// Memory: the head-sharded copies, (group tokens) x (local heads) x d per tensor.
///
/// @code
/// using Ulysses = Strategy<partition::Uniform, comm::AllToAll, schedule::Static>;
/// @endcode
struct AllToAll {
  using policy_category = communicator_tag;
  struct Arguments {};
  Arguments args;

  [[nodiscard]] Status can_implement(const ShardPlan& plan, const AttentionShape& shape) const {
    for (const auto& g : plan.groups)
      if (static_cast<int>(g.size()) > shape.heads_q)
        return Status::refuse("AllToAll: a group of " + std::to_string(g.size()) + " ranks needs at least as many "
                              "query heads, but heads_q = " + std::to_string(shape.heads_q) +
                              " (use Ring or Hierarchical for a larger degree)");
    return Status::success();
  }

  [[nodiscard]] CompiledAttention compile(const ShardPlan& plan, const AttentionShape& shape, int rank) const {
    shape.validate("comm::AllToAll");
    const int gi = plan.group_of(rank);
    seqpar::detail::require(gi >= 0, "comm::AllToAll::compile", "rank", rank, "is in no group of the plan");
    const std::vector<int>& members = plan.groups[static_cast<std::size_t>(gi)];
    const int k = static_cast<int>(members.size());
    const int me = static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin());
    const detail::HeadAssignment heads = detail::assign_heads(shape, k);

    // The group's tokens are contiguous (groups own whole sequences); the head-sharded buffers hold
    // them in global order, so document slices stay contiguous whatever the partitioner did.
    std::int64_t gb = std::numeric_limits<std::int64_t>::max(), ge = 0, count = 0;
    for (int m : members)
      for (const Range& r : plan.owned[static_cast<std::size_t>(m)])
        if (!r.empty()) gb = std::min(gb, r.begin), ge = std::max(ge, r.end), count += r.size();
    if (count == 0) gb = ge = 0;
    if (ge - gb != count) throw std::logic_error("comm::AllToAll: group tokens are not contiguous");
    const std::int64_t group_tokens = ge - gb;

    // Local rows of each member's owned ranges, as pieces (rows only; heads filled in per move).
    const auto rows_of = [&](int member_rank, bool local) {
      std::vector<Range> rows;
      std::int64_t off = 0;
      for (const Range& r : plan.owned[static_cast<std::size_t>(member_rank)]) {
        if (r.empty()) continue;
        rows.push_back(local ? Range{off, off + r.size()} : r.shifted(-gb));
        off += r.size();
      }
      return rows;
    };
    const std::vector<Range> my_local = rows_of(rank, true);
    const Range my_q = heads.q[static_cast<std::size_t>(me)];
    const Range my_kv = heads.kv[static_cast<std::size_t>(me)];

    // seq -> heads: I send my local rows of peer p's heads; I receive p's rows of my heads.
    const auto to_heads = [&](BufferId src, BufferId dst, bool kv) {
      Move m{src, dst, false, {}, {}};
      m.send.resize(static_cast<std::size_t>(k));
      m.recv.resize(static_cast<std::size_t>(k));
      const Range mine = kv ? my_kv : my_q;
      for (int p = 0; p < k; ++p) {
        const Range theirs = kv ? heads.kv[static_cast<std::size_t>(p)] : heads.q[static_cast<std::size_t>(p)];
        if (!theirs.empty())
          for (const Range& rows : my_local) m.send[static_cast<std::size_t>(p)].push_back({rows, theirs});
        if (!mine.empty())
          for (const Range& rows : rows_of(members[static_cast<std::size_t>(p)], false))
            m.recv[static_cast<std::size_t>(p)].push_back({rows, {0, mine.size()}});
      }
      return m;
    };
    // heads -> seq: the mirror image.
    const auto to_seq = [&](BufferId src, BufferId dst, bool kv, bool accumulate) {
      Move there = to_heads(dst, src, kv);
      Move back{src, dst, accumulate, std::move(there.recv), std::move(there.send)};
      return back;
    };

    const int nq = static_cast<int>(my_q.size()), nkv = static_cast<int>(my_kv.size());
    std::vector<AttnSlice> slices;
    for (int m : members)
      for (const AttnSlice& s : plan.slices[static_cast<std::size_t>(m)])
        slices.push_back({s.q_range.shifted(-gb), s.k_range.shifted(-gb), s.mask});
    std::sort(slices.begin(), slices.end(), [](const AttnSlice& a, const AttnSlice& b) {
      return a.q_range.begin < b.q_range.begin;
    });
    const auto groups = detail::head_groups(my_q, my_kv, shape.group_size());

    const auto base = [&] {
      Program p;
      p.rank = rank;
      p.head_dim = shape.head_dim;
      p.softmax_scale = shape.scale();
      p.local_tokens = plan.local_tokens(rank);
      return p;
    };

    CompiledAttention out;
    Program& fwd = out.forward;
    fwd = base();
    fwd.staging = {{BufferId::kQHeads, group_tokens, nq}, {BufferId::kKHeads, group_tokens, nkv},
                   {BufferId::kVHeads, group_tokens, nkv}, {BufferId::kOHeads, group_tokens, nq},
                   {BufferId::kLseHeads, group_tokens, nq}};
    fwd.steps.push_back(ExchangeStep{Level::kGroup, me,
                                     {to_heads(BufferId::kQ, BufferId::kQHeads, false),
                                      to_heads(BufferId::kK, BufferId::kKHeads, true),
                                      to_heads(BufferId::kV, BufferId::kVHeads, true)}});
    ComputeStep c;
    c.q = BufferId::kQHeads, c.k = BufferId::kKHeads, c.v = BufferId::kVHeads;
    c.o = BufferId::kOHeads, c.lse = BufferId::kLseHeads;
    c.waves = {slices};
    c.head_groups = groups;
    fwd.steps.push_back(c);
    fwd.steps.push_back(ExchangeStep{Level::kGroup, me,
                                     {to_seq(BufferId::kOHeads, BufferId::kO, false, false),
                                      to_seq(BufferId::kLseHeads, BufferId::kLse, false, false)}});

    Program& bwd = out.backward;
    bwd = base();
    bwd.staging = fwd.staging;
    bwd.staging.insert(bwd.staging.end(), {{BufferId::kDoutHeads, group_tokens, nq},
                                           {BufferId::kDqHeads, group_tokens, nq},
                                           {BufferId::kDkHeads, group_tokens, nkv},
                                           {BufferId::kDvHeads, group_tokens, nkv}});
    bwd.steps.push_back(ExchangeStep{Level::kGroup, me,
                                     {to_heads(BufferId::kQ, BufferId::kQHeads, false),
                                      to_heads(BufferId::kK, BufferId::kKHeads, true),
                                      to_heads(BufferId::kV, BufferId::kVHeads, true),
                                      to_heads(BufferId::kO, BufferId::kOHeads, false),
                                      to_heads(BufferId::kDout, BufferId::kDoutHeads, false),
                                      to_heads(BufferId::kLse, BufferId::kLseHeads, false)}});
    bwd.steps.push_back(ZeroStep{{BufferId::kDqHeads, BufferId::kDkHeads, BufferId::kDvHeads}});
    c.backward = true;
    c.dout = BufferId::kDoutHeads, c.dq = BufferId::kDqHeads, c.dk = BufferId::kDkHeads, c.dv = BufferId::kDvHeads;
    bwd.steps.push_back(c);
    if (heads.kv_replicated) bwd.steps.push_back(ZeroStep{{BufferId::kDk, BufferId::kDv}});
    bwd.steps.push_back(ExchangeStep{Level::kGroup, me,
                                     {to_seq(BufferId::kDqHeads, BufferId::kDq, false, false),
                                      to_seq(BufferId::kDkHeads, BufferId::kDk, true, heads.kv_replicated),
                                      to_seq(BufferId::kDvHeads, BufferId::kDv, true, heads.kv_replicated)}});
    return out;
  }
};

static_assert(Communicator<AllToAll>);

}  // namespace seqpar::comm
