// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "seqpar/comm/all_gather.hpp"
#include "seqpar/comm/all_to_all.hpp"
#include "seqpar/comm/hierarchical.hpp"
#include "seqpar/comm/ring.hpp"
#include "seqpar/partition/batch_aware.hpp"
#include "seqpar/partition/hybrid.hpp"
#include "seqpar/partition/per_doc.hpp"
#include "seqpar/partition/uniform.hpp"
#include "seqpar/partition/whole_doc.hpp"
#include "seqpar/partition/zigzag.hpp"
#include "seqpar/plan/compile_all.hpp"
#include "seqpar/plan/hybrid_cost.hpp"
#include "seqpar/plan/model_shape.hpp"
#include "seqpar/strategy.hpp"

namespace seqpar::plan {

/// What a candidate compiles: a batch placed for the model's mask mix, sliced for one call's mask.
using CandidateCompile = std::function<replay::CompiledStrategy(const DocumentBatch&, const AttentionShape&,
                                                                const Topology&, const MaskMix&, AttentionMask)>;

/// A strategy the planner can compile for any batch, by name: the type-erased face of Strategy<P, C, S>
/// for tools that choose at run time (seqpar-plan, the replays). `compile(batch, shape, topology, mix,
/// mask)` places the batch for `mix` (Strategy::place) and compiles every rank's programs of `mask`
/// (Strategy::plan + compile): the same pair DistributedAttention runs.
struct Candidate {
  std::string name;
  std::string description;  ///< the Strategy<...> it is
  CandidateCompile compile_masked;

  [[nodiscard]] replay::CompiledStrategy compile(const DocumentBatch& batch, const AttentionShape& shape,
                                                 const Topology& topology, const MaskMix& mix = {},
                                                 AttentionMask mask = {}) const {
    return compile_masked(batch, shape, topology, mix, mask);
  }
};

/// Per-Doc cuts every document it splits into 2P pieces, and a ring over P ranks then runs ~4 slices per
/// split document per rank per step: about 4 * D * P^2 slices in the compiled programs (per_doc_slices:
/// fewer for documents shorter than 2P). Planning tools refuse a candidate above this many (measured
/// ~200 bytes each with their pieces) instead of exhausting memory: at 256 ranks a 2M-token batch of 2K
/// documents is ~160 M slices. A trainer compiles only its own rank's program (P times less) and is
/// unaffected.
inline constexpr double kMaxPlannedSlices = 1e7;

/// Refuses Per-Doc cuts of the documents of `batch` longer than `longer_than` over `ranks` above the
/// planning budget.
[[nodiscard]] inline Status check_split_budget(const DocumentBatch& batch, int ranks, std::int64_t longer_than = 0) {
  const double slices = per_doc_slices(batch, ranks, longer_than);
  if (slices <= kMaxPlannedSlices) return Status::success();
  std::int64_t split = 0;
  for (const Document& d : batch.documents()) split += d.tokens.size() > longer_than ? 1 : 0;
  return Status::refuse(
      "Per-Doc would cut " + std::to_string(split) + " documents into up to " + std::to_string(2 * ranks) +
      " pieces each: ~" + std::to_string(static_cast<long long>(slices / 1e6)) +
      " M slices to plan across all ranks (budget " + std::to_string(static_cast<long long>(kMaxPlannedSlices / 1e6)) +
      " M); use fewer ranks per "
      "ring (Hierarchical, BatchAware) or longer documents");
}

/// Plain AllGather lists, on every rank, every peer's ranges for K and V both ways: ~8 P^2 x sequences
/// pieces over all programs with Zigzag's 2P chunks per sequence.
[[nodiscard]] inline Status check_gather_budget(int sequences, int ranks) {
  const double pieces = 8.0 * sequences * static_cast<double>(ranks) * ranks;
  if (pieces <= kMaxPlannedSlices) return Status::success();
  return Status::refuse("AllGather over " + std::to_string(ranks) + " ranks would list ~" +
                        std::to_string(static_cast<long long>(pieces / 1e6)) +
                        " M KV pieces across all ranks "
                        "(budget " +
                        std::to_string(static_cast<long long>(kMaxPlannedSlices / 1e6)) +
                        " M); gather within smaller groups (BatchAware) or use a ring");
}

/// The length below which a placement keeps every document whole: one less than its shortest document
/// held by more than one rank (Hybrid cuts every document longer than its threshold), the longest
/// document when none is split.
[[nodiscard]] inline std::int64_t split_threshold(const Placement& placement, const DocumentBatch& batch) {
  const auto docs = batch.documents();
  std::vector<int> holder(docs.size(), -1);
  std::int64_t shortest_split = std::numeric_limits<std::int64_t>::max(), longest = 0;
  for (int r = 0; r < placement.world_size(); ++r)
    for (const Range& piece : placement.owned[static_cast<std::size_t>(r)]) {
      auto it = std::upper_bound(docs.begin(), docs.end(), piece.begin,
                                 [](std::int64_t t, const Document& d) { return t < d.tokens.end; });
      for (; it != docs.end() && it->tokens.begin < piece.end; ++it) {
        int& h = holder[static_cast<std::size_t>(it - docs.begin())];
        if (h >= 0 && h != r) shortest_split = std::min(shortest_split, it->tokens.size());
        h = r;
      }
    }
  for (const Document& d : docs) longest = std::max(longest, d.tokens.size());
  return shortest_split == std::numeric_limits<std::int64_t>::max() ? longest : shortest_split - 1;
}

/// Every rank's programs of strategy S for `batch` placed for `mix` and sliced for `mask`, the
/// placement first passed to `budget` (a planning-budget refusal, Status::success() to go on).
template <class S, class Budget>
[[nodiscard]] replay::CompiledStrategy compile_candidate(const typename S::Arguments& args, const DocumentBatch& batch,
                                                         const AttentionShape& shape, const Topology& topo,
                                                         AttentionMask mask, Budget&& budget) {
  typename S::Placed placed = S::place(args, batch, topo);
  replay::CompiledStrategy refused;
  if (!placed.status) {
    refused.status = std::move(placed.status);
    return refused;
  }
  if (refused.status = budget(placed.placement); !refused.status) return refused;
  return compile_all<S>(args, S::plan(args, placed.placement, batch, mask, shape), shape, topo);
}

/// A candidate for strategy S with fixed arguments (and a planning budget checked on each placement).
template <class S>
[[nodiscard]] Candidate make_candidate(std::string name, std::string description, typename S::Arguments args = {},
                                       std::function<Status(const DocumentBatch&, const Placement&)> budget = {}) {
  return {std::move(name), std::move(description),
          [args, budget = std::move(budget)](const DocumentBatch& batch, const AttentionShape& shape,
                                             const Topology& topo, const MaskMix& mix, AttentionMask mask) {
            typename S::Arguments a = args;
            a.ranks_per_node = topo.ranks_per_node;
            a.masks = mix;
            return compile_candidate<S>(a, batch, shape, topo, mask, [&](const Placement& p) {
              return budget ? budget(batch, p) : Status::success();
            });
          }};
}

/// Strategy<Hybrid, Communicator{sharding_aware}> with its threshold chosen by hybrid_model_cost on
/// `hardware` (the proxy without one), refused when Per-Doc's pieces would exceed the planning budget.
template <class Communicator>
[[nodiscard]] Candidate hybrid_candidate(std::string name, std::string description,
                                         std::optional<replay::HardwareProfile> hardware, double per_token) {
  using S = Strategy<partition::Hybrid, Communicator>;
  return {std::move(name), std::move(description),
          [hw = std::move(hardware), per_token](const DocumentBatch& batch, const AttentionShape& shape,
                                                const Topology& topo, const MaskMix& mix, AttentionMask mask) {
            typename S::Arguments a;
            a.comm.sharding_aware = true;
            a.ranks_per_node = topo.ranks_per_node;
            a.masks = mix;
            if (hw) a.partition.cost = hybrid_model_cost<Communicator>(*hw, shape, per_token);
            return compile_candidate<S>(a, batch, shape, topo, mask, [&](const Placement& p) {
              return check_split_budget(batch, topo.world_size, split_threshold(p, batch));
            });
          }};
}

/// Seconds of one layer's GEMMs (forward + backward, with recompute) per token of `model` on `hw`.
[[nodiscard]] inline double layer_gemm_seconds_per_token(const replay::HardwareProfile& hw, const ModelShape& model,
                                                         bool checkpointing = true) {
  return (checkpointing ? 4.0 : 3.0) * model.layer_gemm_flops_per_token() / hw.gemm_rate();
}

/// Every composition seqpar ships, with the arguments a user would start from. Hybrid placements are
/// chosen with the cost model of `hardware` (hybrid_model_cost) when one is given, else with the proxy;
/// with `model`, the placement also weighs the GEMM time of the tokens each rank owns (training).
[[nodiscard]] inline std::vector<Candidate> standard_candidates(
    std::optional<replay::HardwareProfile> hardware = std::nullopt, std::optional<ModelShape> model = std::nullopt) {
  const double per_token = hardware && model ? layer_gemm_seconds_per_token(*hardware, *model) : 0.0;
  using comm::AllGather, comm::AllToAll, comm::Ring;
  using partition::BatchAware, partition::Hybrid, partition::PerDoc, partition::Uniform, partition::WholeDoc,
      partition::Zigzag;
  using Hier = comm::Hierarchical<AllToAll, Ring>;
  std::vector<Candidate> c;
  c.push_back(
      make_candidate<Strategy<Uniform, AllToAll>>("ulysses", "Strategy<Uniform, AllToAll> (DeepSpeed-Ulysses)"));
  c.push_back(make_candidate<Strategy<Uniform, Ring>>("ring", "Strategy<Uniform, Ring> (ring attention)"));
  c.push_back(
      make_candidate<Strategy<Zigzag, Ring>>("zigzag-ring", "Strategy<Zigzag, Ring> (Megatron/TE context parallel)"));
  {
    Strategy<Zigzag, Ring>::Arguments a;
    a.comm.sharding_aware = true;
    c.push_back(
        make_candidate<Strategy<Zigzag, Ring>>("zigzag-ring-aware", "Strategy<Zigzag, Ring{sharding_aware}>", a));
  }
  {
    Strategy<PerDoc, Ring>::Arguments a;
    a.comm.sharding_aware = true;
    c.push_back(make_candidate<Strategy<PerDoc, Ring>>(
        "per-doc-aware", "Strategy<PerDoc, Ring{sharding_aware}> (FlashCP Per-Doc)", a,
        [](const DocumentBatch& batch, const Placement& p) { return check_split_budget(batch, p.world_size()); }));
  }
  {
    c.push_back(make_candidate<Strategy<Zigzag, AllGather>>("allgather", "Strategy<Zigzag, AllGather> (Llama 3 CP)", {},
                                                            [](const DocumentBatch& batch, const Placement& p) {
                                                              return check_gather_budget(batch.num_sequences(),
                                                                                         p.world_size());
                                                            }));
  }
  {
    Strategy<WholeDoc, Ring>::Arguments a;
    a.comm.sharding_aware = true;
    c.push_back(make_candidate<Strategy<WholeDoc, Ring>>(
        "whole-doc", "Strategy<WholeDoc, Ring{sharding_aware}> (FlashCP Whole-Doc)", a));
  }
  c.push_back(hybrid_candidate<Ring>("hybrid-aware",
                                     "Strategy<Hybrid, Ring{sharding_aware}> (FlashCP placement, ring exchange)",
                                     hardware, per_token));
  c.push_back(hybrid_candidate<AllGather>(
      "hybrid-allgather-aware", "Strategy<Hybrid, AllGather{sharding_aware}> (FlashCP)", hardware, per_token));
  {
    Strategy<Zigzag, Hier>::Arguments a;
    a.comm.outer.sharding_aware = true;
    c.push_back(make_candidate<Strategy<Zigzag, Hier>>(
        "hierarchical", "Strategy<Zigzag, Hierarchical<AllToAll, Ring{sharding_aware}>> (USP / HSAP)", a));
  }
  c.push_back(make_candidate<Strategy<BatchAware<Uniform>, AllToAll>>(
      "basp", "Strategy<BatchAware<Uniform>, AllToAll> (BASP)"));
  {
    using S = Strategy<BatchAware<Hybrid>, Hier>;
    Candidate cand{
        "basp-hybrid-hierarchical", "Strategy<BatchAware<Hybrid>, Hierarchical<AllToAll, Ring{sharding_aware}>>", {}};
    cand.compile_masked = [hw = hardware, per_token](const DocumentBatch& batch, const AttentionShape& shape,
                                                     const Topology& topo, const MaskMix& mix, AttentionMask mask) {
      S::Arguments a;
      a.comm.outer.sharding_aware = true;
      a.ranks_per_node = topo.ranks_per_node;
      a.masks = mix;
      if (hw) a.partition.inner.cost = hybrid_model_cost(*hw, shape, per_token);
      return compile_candidate<S>(a, batch, shape, topo, mask, [](const Placement&) { return Status::success(); });
    };
    c.push_back(std::move(cand));
  }
  return c;
}

}  // namespace seqpar::plan
