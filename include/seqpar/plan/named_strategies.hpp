// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// The named strategies: the one table of the compositions users pick by name ("ulysses", "hybrid-aware",
// ...), read by the planner's candidates (plan/candidates.hpp: seqpar-plan, bench/plan_scale) and by the torch
// op (python/src/engines.hpp).
#pragma once

#include <array>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>

#include "seqpar/comm/all_gather.hpp"
#include "seqpar/comm/all_to_all.hpp"
#include "seqpar/comm/hierarchical.hpp"
#include "seqpar/comm/ring.hpp"
#include "seqpar/core/attention_shape.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/partition/batch_aware.hpp"
#include "seqpar/partition/hybrid.hpp"
#include "seqpar/partition/per_doc.hpp"
#include "seqpar/partition/uniform.hpp"
#include "seqpar/partition/whole_doc.hpp"
#include "seqpar/partition/zigzag.hpp"
#include "seqpar/plan/hybrid_cost.hpp"
#include "seqpar/plan/planning_budget.hpp"
#include "seqpar/replay/hardware.hpp"
#include "seqpar/strategy.hpp"

namespace seqpar::plan {

/// What a named strategy's Arguments are made from (named_arguments): the same options for every name,
/// each strategy taking the ones that apply to it.
struct NamedStrategyOptions {
  int ranks_per_node = 0;  ///< Strategy::Arguments::ranks_per_node (0: every rank on one node)
  MaskMix masks{};         ///< the model's mask mix the placement is balanced for (empty: every layer causal)
  /// Hybrid placements (partition::Hybrid's cost): the layer simulated on this hardware (hybrid_model_cost);
  /// none: the partitioner's proxy (hybrid_proxy_cost), which needs no profile.
  std::optional<replay::HardwareProfile> hardware{};
  /// With `hardware`: one layer's GEMM seconds (forward + backward) per token a rank owns (training; 0:
  /// attention alone). See layer_gemm_seconds_per_token (plan/candidates.hpp).
  double gemm_seconds_per_token = 0.0;
  /// The per-rank token capacity, capacity_factor x tokens / ranks, of the strategies with one (whole-doc
  /// and the hybrid strategies); 0: the partitioner's default (1.25). Refused for the others.
  double capacity_factor = 0.0;
  /// Who asks, as refusals name it (the torch op: "seqpar.torch.DistributedAttention").
  std::string_view caller = "seqpar::plan::named_arguments";
};

/// Refuses a capacity_factor (not 0) for a strategy without a token capacity, or one below 1 or not
/// finite. Public so that a caller's own extra names ("auto" in the torch op) refuse it the same way.
inline void check_capacity_factor(std::string_view name, bool has_capacity, double capacity_factor,
                                  std::string_view caller) {
  if (capacity_factor == 0.0) return;
  if (!has_capacity)
    seqpar::detail::throw_invalid(caller, "capacity_factor", capacity_factor,
                                  "applies to whole-doc and the hybrid strategies (their per-rank token capacity), "
                                  "not strategy '" +
                                      std::string(name) + "'");
  if (!(std::isfinite(capacity_factor) && capacity_factor >= 1.0))
    seqpar::detail::throw_invalid(caller, "capacity_factor", capacity_factor,
                                  "must be finite and >= 1 (a rank holds up to capacity_factor x tokens / ranks)");
}

/// Hybrid's cost function for `options`: hybrid_model_cost with the exchange of `Communicator` on the
/// options' hardware; empty (partition::Hybrid's proxy) without one.
template <class Communicator>
[[nodiscard]] partition::HybridCostFunction named_hybrid_cost(const NamedStrategyOptions& options,
                                                              const AttentionShape& shape) {
  if (!options.hardware) return {};
  return hybrid_model_cost<Communicator>(*options.hardware, shape, options.gemm_seconds_per_token);
}

/// The entries of the table, one struct per name. Each has:
///   `strategy`, the Strategy<Partitioner, Communicator> it runs, and its `Arguments`;
///   `name` (what users type) and `description` (what seqpar-plan prints);
///   `configure(args, options, shape)`, setting the arguments that differ from the defaults;
///   `capacity_factor(args)` -> double&, only where the partitioner has a token capacity;
///   `budget(batch, placement)`, the planning budget (planning_budget.hpp) tools that compile every rank's
///   programs check on each placement (Status::success() where there is none).
namespace named {

/// What entries share: nothing to configure and no planning budget (an entry defines its own to differ).
template <class S>
struct Entry {
  using strategy = S;
  using Arguments = typename S::Arguments;
  static void configure(Arguments&, const NamedStrategyOptions&, const AttentionShape&) {}
  [[nodiscard]] static Status budget(const DocumentBatch&, const Placement&) { return Status::success(); }
};

using Hier = comm::Hierarchical<comm::AllToAll, comm::Ring>;

struct Ulysses : Entry<Strategy<partition::Uniform, comm::AllToAll>> {
  static constexpr std::string_view name = "ulysses";
  static constexpr std::string_view description = "Strategy<Uniform, AllToAll> (DeepSpeed-Ulysses)";
};

struct Ring : Entry<Strategy<partition::Uniform, comm::Ring>> {
  static constexpr std::string_view name = "ring";
  static constexpr std::string_view description = "Strategy<Uniform, Ring> (ring attention)";
};

struct ZigzagRing : Entry<Strategy<partition::Zigzag, comm::Ring>> {
  static constexpr std::string_view name = "zigzag-ring";
  static constexpr std::string_view description = "Strategy<Zigzag, Ring> (Megatron/TE context parallel)";
};

struct ZigzagRingAware : Entry<Strategy<partition::Zigzag, comm::Ring>> {
  static constexpr std::string_view name = "zigzag-ring-aware";
  static constexpr std::string_view description = "Strategy<Zigzag, Ring{sharding_aware}>";
  static void configure(Arguments& a, const NamedStrategyOptions&, const AttentionShape&) {
    a.comm.sharding_aware = true;
  }
};

struct PerDocAware : Entry<Strategy<partition::PerDoc, comm::Ring>> {
  static constexpr std::string_view name = "per-doc-aware";
  static constexpr std::string_view description = "Strategy<PerDoc, Ring{sharding_aware}> (FlashCP Per-Doc)";
  static void configure(Arguments& a, const NamedStrategyOptions&, const AttentionShape&) {
    a.comm.sharding_aware = true;
  }
  [[nodiscard]] static Status budget(const DocumentBatch& batch, const Placement& p) {
    return check_split_budget(batch, p.world_size());
  }
};

struct AllGather : Entry<Strategy<partition::Zigzag, comm::AllGather>> {
  static constexpr std::string_view name = "allgather";
  static constexpr std::string_view description = "Strategy<Zigzag, AllGather> (Llama 3 CP)";
  [[nodiscard]] static Status budget(const DocumentBatch& batch, const Placement& p) {
    return check_gather_budget(batch.num_sequences(), p.world_size());
  }
};

struct WholeDoc : Entry<Strategy<partition::WholeDoc, comm::Ring>> {
  static constexpr std::string_view name = "whole-doc";
  static constexpr std::string_view description = "Strategy<WholeDoc, Ring{sharding_aware}> (FlashCP Whole-Doc)";
  static void configure(Arguments& a, const NamedStrategyOptions&, const AttentionShape&) {
    a.comm.sharding_aware = true;
  }
  static double& capacity_factor(Arguments& a) { return a.partition.capacity_factor; }
};

/// Hybrid cuts the documents longer than its threshold, Per-Doc style: the split budget, for the
/// threshold the sweep chose.
template <class S, class CostCommunicator>
struct HybridEntry : Entry<S> {
  using typename Entry<S>::Arguments;
  static void configure(Arguments& a, const NamedStrategyOptions& o, const AttentionShape& shape) {
    a.comm.sharding_aware = true;
    a.partition.cost = named_hybrid_cost<CostCommunicator>(o, shape);
  }
  static double& capacity_factor(Arguments& a) { return a.partition.capacity_factor; }
  [[nodiscard]] static Status budget(const DocumentBatch& batch, const Placement& p) {
    return check_split_budget(batch, p.world_size(), split_threshold(p, batch));
  }
};

struct HybridAware : HybridEntry<Strategy<partition::Hybrid, comm::Ring>, comm::Ring> {
  static constexpr std::string_view name = "hybrid-aware";
  static constexpr std::string_view description =
      "Strategy<Hybrid, Ring{sharding_aware}> (FlashCP placement, ring exchange)";
};

struct HybridAllGatherAware : HybridEntry<Strategy<partition::Hybrid, comm::AllGather>, comm::AllGather> {
  static constexpr std::string_view name = "hybrid-allgather-aware";
  static constexpr std::string_view description = "Strategy<Hybrid, AllGather{sharding_aware}> (FlashCP)";
};

struct Hierarchical : Entry<Strategy<partition::Zigzag, Hier>> {
  static constexpr std::string_view name = "hierarchical";
  static constexpr std::string_view description =
      "Strategy<Zigzag, Hierarchical<AllToAll, Ring{sharding_aware}>> (USP / HSAP)";
  static void configure(Arguments& a, const NamedStrategyOptions&, const AttentionShape&) {
    a.comm.outer.sharding_aware = true;
  }
};

struct Basp : Entry<Strategy<partition::BatchAware<partition::Uniform>, comm::AllToAll>> {
  static constexpr std::string_view name = "basp";
  static constexpr std::string_view description = "Strategy<BatchAware<Uniform>, AllToAll> (BASP)";
};

/// No planning budget: BatchAware confines each Hybrid to its group, whose ring is short.
struct BaspHybridHierarchical : Entry<Strategy<partition::BatchAware<partition::Hybrid>, Hier>> {
  static constexpr std::string_view name = "basp-hybrid-hierarchical";
  static constexpr std::string_view description =
      "Strategy<BatchAware<Hybrid>, Hierarchical<AllToAll, Ring{sharding_aware}>>";
  static void configure(Arguments& a, const NamedStrategyOptions& o, const AttentionShape& shape) {
    a.comm.outer.sharding_aware = true;
    // The group's flat ring exchange simulated (hybrid_model_cost says why this approximates).
    a.partition.inner.cost = named_hybrid_cost<comm::Ring>(o, shape);
  }
  static double& capacity_factor(Arguments& a) { return a.partition.inner.capacity_factor; }
};

}  // namespace named

/// Every named strategy, in the order seqpar-plan lists them. Adding a name: its entry above and its
/// place here; plan::standard_candidates (seqpar-plan, bench/plan_scale) and the torch op then know it, and
/// tests/plan/test_named_strategies.cpp checks it against its description and its partitioner.
///
/// @code
/// plan::NamedStrategyOptions options{.ranks_per_node = 8, .masks = mix};
/// plan::visit_named_strategy(name, [&]<class E>() {  // the static type of a run-time name
///   DistributedAttention<typename E::strategy, Kernel> attn(transport, shape,
///                                                           plan::named_arguments<E>(options, shape));
/// });
/// @endcode
using NamedStrategies =
    std::tuple<named::Ulysses, named::Ring, named::ZigzagRing, named::ZigzagRingAware, named::PerDocAware,
               named::AllGather, named::WholeDoc, named::HybridAware, named::HybridAllGatherAware, named::Hierarchical,
               named::Basp, named::BaspHybridHierarchical>;

inline constexpr std::size_t kNamedStrategyCount = std::tuple_size_v<NamedStrategies>;

/// Whether entry E has a per-rank token capacity (capacity_factor applies to it).
template <class E>
concept NamedWithCapacity = requires(typename E::Arguments& a) {
  { E::capacity_factor(a) } -> std::same_as<double&>;
};

/// Calls `f.template operator()<E>()` for every entry E of NamedStrategies, in order: a run-time name
/// reaches its static Strategy type through it.
///
///   plan::for_each_named_strategy([&]<class E>() { names.push_back(std::string(E::name)); });
template <class F>
constexpr void for_each_named_strategy(F&& f) {
  [&]<class... E>(std::tuple<E...>*) { (f.template operator()<E>(), ...); }(static_cast<NamedStrategies*>(nullptr));
}

/// Calls `f.template operator()<E>()` for the entry named `name`; false (f not called) for no such name.
template <class F>
bool visit_named_strategy(std::string_view name, F&& f) {
  bool found = false;
  for_each_named_strategy([&]<class E>() {
    if (!found && E::name == name) {
      found = true;
      f.template operator()<E>();
    }
  });
  return found;
}

/// The names of the table, in order.
inline constexpr std::array<std::string_view, kNamedStrategyCount> kNamedStrategyNames = [] {
  std::array<std::string_view, kNamedStrategyCount> names{};
  std::size_t i = 0;
  for_each_named_strategy([&]<class E>() { names[i++] = E::name; });
  return names;
}();

/// Entry E's Arguments for `options` (the call's `shape` prices Hybrid placements on a hardware profile).
/// Throws std::invalid_argument naming options.caller for a capacity_factor E has no use for, or below 1.
template <class E>
[[nodiscard]] typename E::Arguments named_arguments(const NamedStrategyOptions& options, const AttentionShape& shape) {
  check_capacity_factor(E::name, NamedWithCapacity<E>, options.capacity_factor, options.caller);
  typename E::Arguments a{};
  E::configure(a, options, shape);
  if constexpr (NamedWithCapacity<E>)
    if (options.capacity_factor != 0.0) E::capacity_factor(a) = options.capacity_factor;
  a.ranks_per_node = options.ranks_per_node;
  a.masks = options.masks;
  return a;
}

}  // namespace seqpar::plan
