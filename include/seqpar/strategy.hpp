// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "seqpar/comm/communicator.hpp"
#include "seqpar/comm/program.hpp"
#include "seqpar/core/attention_mask.hpp"
#include "seqpar/core/attention_shape.hpp"
#include "seqpar/core/document_batch.hpp"
#include "seqpar/core/shard_plan.hpp"
#include "seqpar/core/status.hpp"
#include "seqpar/core/topology.hpp"
#include "seqpar/partition/partitioner.hpp"
#include "seqpar/runtime/argument_word.hpp"
#include "seqpar/runtime/step_order.hpp"

namespace seqpar {

namespace detail {
// The third slot of Strategy takes a step-order policy only. (It took schedule::Static, a batch-level
// scheduler, until the per-layer Strategy stopped depending on schedule/.)
template <class X>
struct step_order_for {
  static_assert(
      !requires(const X& x, const DocumentBatch& batch) { x.chunks(batch); },
      "Strategy<P, C, Order>: a batch-level scheduler (schedule::Static, schedule::DynamicChunk) is not a "
      "step order; write runtime::StaticOrder (or leave the slot out), and run schedulers above "
      "DistributedAttention");
  static_assert(runtime::StepOrder<X>,
                "Strategy<P, C, Order>: Order must be a step-order policy (runtime::StaticOrder); batch-level "
                "schedulers such as schedule::DynamicChunk sit above DistributedAttention, not inside a Strategy");
  using type = X;
};

/// Whether a policy's Arguments name their own fields for the cross-rank agreement.
struct AnyArgumentVisitor {
  template <class V>
  void operator()(const char*, const V&) const {}
};
template <class A>
inline constexpr bool kNamesItsArguments = requires(const A& a) {
  a.for_each_argument(AnyArgumentVisitor{});
};

template <class A>
inline constexpr bool kArgumentsNamed = [] {
  static_assert(kNamesItsArguments<A>,
                "a policy's Arguments must name their fields for the cross-rank agreement: give the struct a member "
                "`template <class Fn> void for_each_argument(Fn&& fn) const` that calls fn(\"field\", field) for "
                "every field (an empty body when it has none)");
  return kNamesItsArguments<A>;
}();

/// Calls fn(runtime::ArgumentWord) for every field that a policy's Arguments name in their
/// for_each_argument, the name prefixed ("comm." + "sharding_aware"); a field that is itself a
/// policy's Arguments (BatchAware's inner, Hierarchical's outer) is walked with its own prefix.
template <class A, class Fn>
void for_each_policy_argument(const A& a, const std::string& prefix, Fn& fn) {
  static_assert(kArgumentsNamed<A>);
  a.for_each_argument([&](const char* name, const auto& value) {
    if constexpr (std::is_aggregate_v<std::remove_cvref_t<decltype(value)>>)
      for_each_policy_argument(value, prefix + name + ".", fn);
    else
      fn(runtime::argument_word(prefix + name, value));
  });
}
}  // namespace detail

/// The composition point: a partitioner (who owns which tokens) and a communicator (what moves where),
/// chosen at compile time, plus the order the executor runs a rank's steps in (static: as compiled).
/// Tunables are values in `Arguments`. Every layer answers the same protocol: `can_implement(args, ...)
/// -> Status`, then the work: `place` (once per batch, for the model's mask mix), `plan` (a placement
/// sliced for one call's mask) and `compile` (this rank's programs of a plan).
///
/// @code
/// using Ulysses = seqpar::Strategy<partition::Uniform, comm::AllToAll>;
/// seqpar::DistributedAttention<Ulysses, attention::CpuFlash<float>> attn(transport, shape);
/// attn.forward(batch, q, k, v, o, lse);
/// @endcode
template <partition::Partitioner P, comm::Communicator C, class Order = runtime::StaticOrder>
struct Strategy {
  using partitioner_type = P;
  using communicator_type = C;
  using step_order_type = typename detail::step_order_for<Order>::type;
  static_assert(detail::kArgumentsNamed<typename P::Arguments> && detail::kArgumentsNamed<typename C::Arguments> &&
                detail::kArgumentsNamed<typename step_order_type::Arguments>);

  struct Arguments {
    typename P::Arguments partition{};
    typename C::Arguments comm{};
    typename step_order_type::Arguments order{};
    int ranks_per_node = 0;  ///< 0: every rank on one node
    /// The model's attention masks with their layer counts: what the one placement of each batch is
    /// balanced for (empty: every layer causal). A call may use any mask; the mix only steers balance.
    MaskMix masks{};
  };

  /// Calls fn(runtime::ArgumentWord) for every argument that changes the plan or the programs
  /// ("partition.group_size", "comm.sharding_aware", "comm.outer.sharding_aware", ...), as each
  /// policy's Arguments name them (`for_each_argument`): DistributedAttention compares them across
  /// ranks so that a disagreement is an Errc::kMismatch naming the argument. (The mask mix is compared
  /// by its fingerprint in the call's agreement.)
  template <class Fn>
  static void for_each_argument(const Arguments& args, Fn&& fn) {
    detail::for_each_policy_argument(args.partition, "partition.", fn);
    detail::for_each_policy_argument(args.comm, "comm.", fn);
    detail::for_each_policy_argument(args.order, "order.", fn);
  }

  /// A placement, or why there is none.
  struct Placed {
    Status status = Status::success();
    const char* refused_by = "";  ///< "partitioner refuses the batch"
    Placement placement;
  };

  /// Where the tokens of `batch` live, once for every layer: the partitioner's placement balanced for
  /// `args.masks` (its refusal otherwise). The first half of the one place a strategy plans.
  [[nodiscard]] static Placed place(const Arguments& args, const DocumentBatch& batch, const Topology& topology) {
    Placed out;
    if (batch.num_sequences() < 1) {
      out.status = Status::refuse("batch: a default-constructed DocumentBatch{} has no sequences");
      out.refused_by = "partitioner refuses the batch";
      return out;
    }
    const P partitioner{args.partition};
    if (out.status = partitioner.can_implement(batch, topology, args.masks); !out.status) {
      out.refused_by = "partitioner refuses the batch";
      return out;
    }
    out.placement = partitioner.place(batch, topology, args.masks);
    out.placement.batch_fingerprint = batch.fingerprint();
    return out;
  }

  /// A plan, or why there is none (and which layer refused).
  struct Planned {
    Status status = Status::success();
    const char* refused_by = "";  ///< "partitioner refuses the batch" or "communicator refuses the plan"
    ShardPlan plan;
  };

  /// The plan of one mask over a placement: its slices, and the communicator's refusal of them. The
  /// second half of the one place a strategy plans.
  [[nodiscard]] static Planned plan(const Arguments& args, const Placement& placement, const DocumentBatch& batch,
                                    AttentionMask mask, const AttentionShape& shape) {
    Planned out;
    out.plan = slice(placement, batch, mask);
    if (out.status = C{args.comm}.can_implement(out.plan, shape); !out.status)
      out.refused_by = "communicator refuses the plan";
    return out;
  }

  /// Both halves: `batch` placed (for args.masks) and sliced for `mask`.
  [[nodiscard]] static Planned plan(const Arguments& args, const DocumentBatch& batch, const AttentionShape& shape,
                                    const Topology& topology, AttentionMask mask = {}) {
    Placed placed = place(args, batch, topology);
    if (!placed.status) return {std::move(placed.status), placed.refused_by, {}};
    return plan(args, placed.placement, batch, mask, shape);
  }

  /// Whether this strategy can run `batch` under `mask` with `shape` on `topology`, and why not. Plans
  /// the batch: callers that go on to compile should call `plan` (or `compile`) once instead.
  [[nodiscard]] static Status can_implement(const Arguments& args, const DocumentBatch& batch,
                                            const AttentionShape& shape, const Topology& topology,
                                            AttentionMask mask = {}) {
    return plan(args, batch, shape, topology, mask).status;
  }

  /// Rank `rank`'s forward and backward programs of an accepted plan, in the step order.
  [[nodiscard]] static comm::CompiledAttention compile(const Arguments& args, const ShardPlan& plan,
                                                       const AttentionShape& shape, int rank) {
    comm::CompiledAttention program = C{args.comm}.compile(plan, shape, rank);
    step_order_type{args.order}.order(program);
    return program;
  }

  /// Everything one rank runs for `batch` under `mask`: its plan (status false with the reason when
  /// refused) and programs. DistributedAttention and plan::compile_all both come through here.
  struct Compiled {
    Status status = Status::success();
    const char* refused_by = "";
    ShardPlan plan;
    comm::CompiledAttention program;
  };
  [[nodiscard]] static Compiled compile(const Arguments& args, const Placement& placement, const DocumentBatch& batch,
                                        AttentionMask mask, const AttentionShape& shape, int rank) {
    Planned p = plan(args, placement, batch, mask, shape);
    Compiled out{std::move(p.status), p.refused_by, std::move(p.plan), {}};
    if (out.status) out.program = compile(args, out.plan, shape, rank);
    return out;
  }
  [[nodiscard]] static Compiled compile(const Arguments& args, const DocumentBatch& batch, const AttentionShape& shape,
                                        const Topology& topology, int rank, AttentionMask mask = {}) {
    Placed placed = place(args, batch, topology);
    if (!placed.status) return {std::move(placed.status), placed.refused_by, {}, {}};
    return compile(args, placed.placement, batch, mask, shape, rank);
  }
};

}  // namespace seqpar
