// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// The planner's candidates: strategies by name, type-erased for tools that choose at run time. The
// standard ones are the named strategies' table (plan/named_strategies.hpp), one candidate per entry.
#pragma once

#include <functional>
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
#include "seqpar/plan/named_strategies.hpp"
#include "seqpar/plan/planning_budget.hpp"
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

/// The candidate of named strategy E (plan/named_strategies.hpp): its Arguments from the table for the
/// compile's topology, mask mix and shape, its Hybrid placements priced on `hardware` (the proxy without
/// one), its planning budget checked on each placement.
template <class E>
[[nodiscard]] Candidate named_candidate(std::optional<replay::HardwareProfile> hardware, double per_token) {
  return {std::string(E::name), std::string(E::description),
          [hw = std::move(hardware), per_token](const DocumentBatch& batch, const AttentionShape& shape,
                                                const Topology& topo, const MaskMix& mix, AttentionMask mask) {
            NamedStrategyOptions options;
            options.ranks_per_node = topo.ranks_per_node;
            options.masks = mix;
            options.hardware = hw;
            options.gemm_seconds_per_token = per_token;
            return compile_candidate<typename E::strategy>(named_arguments<E>(options, shape), batch, shape, topo, mask,
                                                           [&](const Placement& p) { return E::budget(batch, p); });
          }};
}

/// Every composition seqpar ships, with the arguments a user would start from: one candidate per entry
/// of plan::NamedStrategies, in its order. Hybrid placements are chosen with the cost model of
/// `hardware` (hybrid_model_cost) when one is given, else with the proxy; with `model`, the placement
/// also weighs the GEMM time of the tokens each rank owns (training).
[[nodiscard]] inline std::vector<Candidate> standard_candidates(
    std::optional<replay::HardwareProfile> hardware = std::nullopt, std::optional<ModelShape> model = std::nullopt) {
  const double per_token = hardware && model ? layer_gemm_seconds_per_token(*hardware, *model) : 0.0;
  std::vector<Candidate> c;
  c.reserve(kNamedStrategyCount);
  for_each_named_strategy([&]<class E>() { c.push_back(named_candidate<E>(hardware, per_token)); });
  return c;
}

}  // namespace seqpar::plan
