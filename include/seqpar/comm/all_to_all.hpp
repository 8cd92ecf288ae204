// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "seqpar/comm/communicator.hpp"
#include "seqpar/comm/detail/a2a_builder.hpp"
#include "seqpar/comm/detail/head_split.hpp"
#include "seqpar/core/slice_algebra.hpp"

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
/// using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
/// @endcode
struct AllToAll {
  using policy_category = communicator_tag;
  struct Arguments {
    /// No field: nothing for ranks to agree on (see Strategy::for_each_argument).
    template <class Fn>
    void for_each_argument(Fn&&) const {}
  };
  Arguments args;

  [[nodiscard]] Status can_implement(const ShardPlan& plan, const AttentionShape& shape) const {
    for (const auto& g : plan.groups)
      if (static_cast<int>(g.size()) > shape.heads_q)
        return Status::refuse("AllToAll: a group of " + std::to_string(g.size()) +
                              " ranks needs at least as many "
                              "query heads, but heads_q = " +
                              std::to_string(shape.heads_q) + " (use Ring or Hierarchical for a larger degree)");
    return Status::success();
  }

  [[nodiscard]] CompiledAttention compile(const ShardPlan& plan, const AttentionShape& shape, int rank) const {
    shape.validate("comm::AllToAll");
    const GroupPosition group = group_position(plan, rank, "comm::AllToAll::compile");
    const std::vector<int>& members = group.members;
    detail::A2ASpec spec;
    spec.level = Level::kGroup;
    spec.me = group.me;
    std::vector<AttnSlice> slices;
    for (int m : members) {
      spec.tokens.push_back(plan.owned[static_cast<std::size_t>(m)]);
      const auto& s = plan.slices[static_cast<std::size_t>(m)];
      slices.insert(slices.end(), s.begin(), s.end());
    }
    spec.heads = detail::assign_heads(shape, spec.size());

    Program p = empty_program(plan, shape, rank);
    p.level_members[static_cast<std::size_t>(Level::kGroup)] = members;
    CompiledAttention out{p, p};
    // Every rank computes all of the group's queries for its heads, on whole documents.
    const RowMap map = RowMap::concat(spec.gathered());
    append_head_sharded(
        out, spec, waves(localize(slices, map, map)),
        [](Program&, ComputeStep c) { return std::vector<Step>{std::move(c)}; }, shape);
    return out;
  }

  /// seq -> heads all-to-all, the head-sharded steps `middle` makes of a compute step, heads -> seq.
  /// Shared with Hierarchical, whose middle is a ring across nodes.
  template <class Middle>
  static void append_head_sharded(CompiledAttention& out, const detail::A2ASpec& spec,
                                  std::vector<std::vector<AttnSlice>> waves, Middle&& middle,
                                  const AttentionShape& shape) {
    const Range my_q = spec.heads.q[static_cast<std::size_t>(spec.me)];
    const Range my_kv = spec.heads.kv[static_cast<std::size_t>(spec.me)];
    const int nq = static_cast<int>(my_q.size()), nkv = static_cast<int>(my_kv.size());
    std::int64_t rows = 0;
    for (const Range& r : spec.gathered()) rows += r.size();
    const auto lvl = spec.level;
    const int self = spec.me;

    Program& fwd = out.forward;
    fwd.staging.insert(fwd.staging.end(), {{BufferId::kQHeads, rows, nq},
                                           {BufferId::kKHeads, rows, nkv},
                                           {BufferId::kVHeads, rows, nkv},
                                           {BufferId::kOHeads, rows, nq},
                                           {BufferId::kLseHeads, rows, nq}});
    fwd.steps.push_back(ExchangeStep{
        lvl,
        self,
        {spec.to_heads(BufferId::kQ, BufferId::kQHeads, false), spec.to_heads(BufferId::kK, BufferId::kKHeads, true),
         spec.to_heads(BufferId::kV, BufferId::kVHeads, true)}});
    ComputeStep c;
    c.q = BufferId::kQHeads, c.k = BufferId::kKHeads, c.v = BufferId::kVHeads;
    c.o = BufferId::kOHeads, c.lse = BufferId::kLseHeads;
    c.dout = BufferId::kDoutHeads, c.dq = BufferId::kDqHeads, c.dk = BufferId::kDkHeads, c.dv = BufferId::kDvHeads;
    c.waves = std::move(waves);
    c.head_groups = detail::head_groups(my_q, my_kv, shape.group_size());
    if (c.waves.size() > 1)
      fwd.staging.insert(fwd.staging.end(), {{BufferId::kOPart, rows, nq}, {BufferId::kLsePart, rows, nq}});
    for (Step& s : middle(fwd, c)) fwd.steps.push_back(std::move(s));
    fwd.steps.push_back(ExchangeStep{lvl,
                                     self,
                                     {spec.to_seq(BufferId::kOHeads, BufferId::kO, false, false),
                                      spec.to_seq(BufferId::kLseHeads, BufferId::kLse, false, false)}});

    Program& bwd = out.backward;
    bwd.staging.insert(bwd.staging.end(), {{BufferId::kQHeads, rows, nq},
                                           {BufferId::kKHeads, rows, nkv},
                                           {BufferId::kVHeads, rows, nkv},
                                           {BufferId::kOHeads, rows, nq},
                                           {BufferId::kLseHeads, rows, nq},
                                           {BufferId::kDoutHeads, rows, nq},
                                           {BufferId::kDqHeads, rows, nq},
                                           {BufferId::kDkHeads, rows, nkv},
                                           {BufferId::kDvHeads, rows, nkv}});
    bwd.steps.push_back(ExchangeStep{
        lvl,
        self,
        {spec.to_heads(BufferId::kQ, BufferId::kQHeads, false), spec.to_heads(BufferId::kK, BufferId::kKHeads, true),
         spec.to_heads(BufferId::kV, BufferId::kVHeads, true), spec.to_heads(BufferId::kO, BufferId::kOHeads, false),
         spec.to_heads(BufferId::kDout, BufferId::kDoutHeads, false),
         spec.to_heads(BufferId::kLse, BufferId::kLseHeads, false)}});
    c.backward = true;
    std::vector<Step> middle_bwd = middle(bwd, c);
    if (!middle_bwd.empty() && std::holds_alternative<ComputeStep>(middle_bwd.front()))
      bwd.steps.push_back(ZeroStep{{BufferId::kDqHeads, BufferId::kDkHeads, BufferId::kDvHeads}});
    for (Step& s : middle_bwd) bwd.steps.push_back(std::move(s));
    const bool replicated = spec.heads.kv_replicated;
    if (replicated) bwd.steps.push_back(ZeroStep{{BufferId::kDk, BufferId::kDv}});
    bwd.steps.push_back(ExchangeStep{lvl,
                                     self,
                                     {spec.to_seq(BufferId::kDqHeads, BufferId::kDq, false, false),
                                      spec.to_seq(BufferId::kDkHeads, BufferId::kDk, true, replicated),
                                      spec.to_seq(BufferId::kDvHeads, BufferId::kDv, true, replicated)}});
  }
};

static_assert(Communicator<AllToAll>);

}  // namespace seqpar::comm
