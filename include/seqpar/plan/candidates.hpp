// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
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
#include "seqpar/strategy.hpp"

namespace seqpar::plan {

/// A strategy the planner can compile for any batch, by name: the type-erased face of Strategy<P, C, S>
/// for tools that choose at run time (seqpar-plan, the replays).
struct Candidate {
  std::string name;
  std::string description;  ///< the Strategy<...> it is
  std::function<replay::CompiledStrategy(const DocumentBatch&, const AttentionShape&, const Topology&)> compile;
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

/// A candidate for strategy S with fixed arguments.
template <class S>
[[nodiscard]] Candidate make_candidate(std::string name, std::string description, typename S::Arguments args = {}) {
  return {std::move(name), std::move(description),
          [args](const DocumentBatch& batch, const AttentionShape& shape, const Topology& topo) {
            typename S::Arguments a = args;
            a.ranks_per_node = topo.ranks_per_node;
            return compile_all<S>(a, batch, shape, topo);
          }};
}

/// Strategy<Hybrid, Communicator> compiled for every rank with `args`, refused when Per-Doc's pieces
/// would exceed the planning budget. The threshold sweep runs once: its plan is checked against the
/// budget and the communicator, then compiled per rank (each threshold costed once, whatever the cost
/// function: a simulated one replays every candidate's layer).
template <class Communicator>
[[nodiscard]] replay::CompiledStrategy compile_hybrid(
    const typename Strategy<partition::Hybrid, Communicator>::Arguments& args, const DocumentBatch& batch,
    const AttentionShape& shape, const Topology& topo) {
  using S = Strategy<partition::Hybrid, Communicator>;
  typename S::Planned planned;
  const partition::Hybrid partitioner{args.partition};
  if (planned.status = partitioner.can_implement(batch, topo); planned.status) {
    partition::HybridReport report = partitioner.plan_with_report(batch, topo);
    planned.status = check_split_budget(batch, topo.world_size, report.threshold);
    if (planned.status) {
      planned.plan = std::move(report.plan);
      planned.status = Communicator{args.comm}.can_implement(planned.plan, shape);
    }
  }
  return compile_all<S>(args, std::move(planned), shape, topo);
}

/// Strategy<Hybrid, Communicator{sharding_aware}> with its threshold chosen by hybrid_model_cost on
/// `hardware` (the proxy without one), refused when Per-Doc's pieces would exceed the planning budget.
template <class Communicator>
[[nodiscard]] Candidate hybrid_candidate(std::string name, std::string description,
                                         std::optional<replay::HardwareProfile> hardware, double per_token) {
  return {std::move(name), std::move(description),
          [hw = std::move(hardware), per_token](const DocumentBatch& batch, const AttentionShape& shape,
                                                const Topology& topo) {
            typename Strategy<partition::Hybrid, Communicator>::Arguments a;
            a.comm.sharding_aware = true;
            a.ranks_per_node = topo.ranks_per_node;
            if (hw) a.partition.cost = hybrid_model_cost<Communicator>(*hw, shape, per_token);
            return compile_hybrid<Communicator>(a, batch, shape, topo);
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
    Candidate cand = make_candidate<Strategy<PerDoc, Ring>>(
        "per-doc-aware", "Strategy<PerDoc, Ring{sharding_aware}> (FlashCP Per-Doc)", a);
    cand.compile = [inner = std::move(cand.compile)](const DocumentBatch& batch, const AttentionShape& shape,
                                                     const Topology& topo) {
      replay::CompiledStrategy out;
      out.status = check_split_budget(batch, topo.world_size);
      return out.status ? inner(batch, shape, topo) : out;
    };
    c.push_back(std::move(cand));
  }
  {
    Candidate cand =
        make_candidate<Strategy<Zigzag, AllGather>>("allgather", "Strategy<Zigzag, AllGather> (Llama 3 CP)");
    cand.compile = [inner = std::move(cand.compile)](const DocumentBatch& batch, const AttentionShape& shape,
                                                     const Topology& topo) {
      replay::CompiledStrategy out;
      out.status = check_gather_budget(batch.num_sequences(), topo.world_size);
      return out.status ? inner(batch, shape, topo) : out;
    };
    c.push_back(std::move(cand));
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
    cand.compile = [hw = hardware, per_token](const DocumentBatch& batch, const AttentionShape& shape,
                                              const Topology& topo) {
      S::Arguments a;
      a.comm.outer.sharding_aware = true;
      a.ranks_per_node = topo.ranks_per_node;
      if (hw) a.partition.inner.cost = hybrid_model_cost(*hw, shape, per_token);
      return compile_all<S>(a, batch, shape, topo);
    };
    c.push_back(std::move(cand));
  }
  return c;
}

}  // namespace seqpar::plan
