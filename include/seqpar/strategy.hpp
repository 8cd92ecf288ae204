// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <bit>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "seqpar/comm/communicator.hpp"
#include "seqpar/comm/program.hpp"
#include "seqpar/core/attention_shape.hpp"
#include "seqpar/core/document_batch.hpp"
#include "seqpar/core/shard_plan.hpp"
#include "seqpar/core/status.hpp"
#include "seqpar/core/topology.hpp"
#include "seqpar/partition/partitioner.hpp"
#include "seqpar/runtime/step_order.hpp"
#include "seqpar/schedule/static.hpp"

namespace seqpar {

namespace detail {
// The third slot of Strategy takes a step-order policy. It used to take a scheduler; schedule::Static
// is still accepted there (it meant "the compiled order") so that existing code keeps compiling.
template <class X>
struct step_order_for {
  static_assert(runtime::StepOrder<X> || std::is_same_v<X, schedule::Static>,
                "Strategy<P, C, Order>: Order must be a step-order policy (runtime::StaticOrder); batch-level "
                "schedulers such as schedule::DynamicChunk sit above DistributedAttention, not inside a Strategy");
  using type = std::conditional_t<runtime::StepOrder<X>, X, runtime::StaticOrder>;
};

/// A policy argument as one comparable word: integers and bools as is, doubles by their bits, an
/// optional as its value or a marker, a function by whether it is set (its behaviour cannot be
/// compared across ranks).
struct ArgumentValue {
  std::uint64_t word = 0;
  bool is_double = false;
};
template <class V>
[[nodiscard]] ArgumentValue argument_value(const V& v) {
  if constexpr (std::is_same_v<V, bool> || std::is_integral_v<V> || std::is_enum_v<V>)
    return {static_cast<std::uint64_t>(v), false};
  else if constexpr (std::is_floating_point_v<V>)
    return {std::bit_cast<std::uint64_t>(static_cast<double>(v)), true};
  else if constexpr (requires {
                       v.has_value();
                       *v;
                     })
    return v.has_value() ? argument_value(*v) : ArgumentValue{0x8000000000000000ull, false};
  else
    return {static_cast<std::uint64_t>(static_cast<bool>(v)), false};
}

/// Calls fn(name, ArgumentValue) for every argument of a policy's Arguments that changes what the
/// policy plans or compiles: the fields of seqpar's partitioners and communicators, by name, and
/// nested Arguments (BatchAware's inner, Hierarchical's outer) with a prefix. A new policy whose
/// Arguments have fields of other names lists them itself with a member
/// `void for_each_argument(auto&& fn) const` calling fn(name, value) for each.
template <class A, class Fn>
void for_each_policy_argument(const A& a, const std::string& prefix, Fn& fn) {
  const auto field = [&](const char* name, const auto& value) { fn(prefix + name, argument_value(value)); };
  if constexpr (requires { a.for_each_argument(field); }) a.for_each_argument(field);
  if constexpr (requires { a.sharding_aware; }) field("sharding_aware", a.sharding_aware);
  if constexpr (requires { a.inner_size; }) field("inner_size", a.inner_size);
  if constexpr (requires { a.group_size; }) field("group_size", a.group_size);
  if constexpr (requires { a.equal_groups_when_divisible; })
    field("equal_groups_when_divisible", a.equal_groups_when_divisible);
  if constexpr (requires { a.respect_nodes; }) field("respect_nodes", a.respect_nodes);
  if constexpr (requires { a.capacity_factor; }) field("capacity_factor", a.capacity_factor);
  if constexpr (requires { a.linear_weight; }) field("linear_weight", a.linear_weight);
  if constexpr (requires { a.compute_weight; }) field("compute_weight", a.compute_weight);
  if constexpr (requires { a.comm_weight; }) field("comm_weight", a.comm_weight);
  if constexpr (requires { a.overlap; }) field("overlap", a.overlap);
  if constexpr (requires { a.tolerance; }) field("tolerance", a.tolerance);
  if constexpr (requires { a.threshold; }) field("threshold", a.threshold);
  if constexpr (requires { a.max_candidates; }) field("max_candidates", a.max_candidates);
  if constexpr (requires { a.cost; }) field("cost (set)", a.cost);
  if constexpr (requires { a.inner; }) for_each_policy_argument(a.inner, prefix + "inner.", fn);
  if constexpr (requires { a.outer; }) for_each_policy_argument(a.outer, prefix + "outer.", fn);
}
}  // namespace detail

/// The composition point: a partitioner (who owns which tokens) and a communicator (what moves where),
/// chosen at compile time, plus the order the executor runs a rank's steps in (static: as compiled).
/// Tunables are values in `Arguments`. Every layer answers the same protocol: `can_implement(args, ...)
/// -> Status`, then the work (`plan`, `compile`).
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

  struct Arguments {
    typename P::Arguments partition{};
    typename C::Arguments comm{};
    typename step_order_type::Arguments order{};
    int ranks_per_node = 0;  ///< 0: every rank on one node
  };

  /// Calls fn(name, detail::ArgumentValue) for every argument that changes the plan or the programs
  /// ("partition.group_size", "comm.sharding_aware", "comm.inner_size", ...): DistributedAttention
  /// compares them across ranks so that a disagreement is an Errc::kMismatch naming the argument.
  template <class Fn>
  static void for_each_argument(const Arguments& args, Fn&& fn) {
    detail::for_each_policy_argument(args.partition, "partition.", fn);
    detail::for_each_policy_argument(args.comm, "comm.", fn);
    detail::for_each_policy_argument(args.order, "order.", fn);
  }

  /// A plan, or why there is none (and which layer refused).
  struct Planned {
    Status status = Status::success();
    const char* refused_by = "";  ///< "partitioner refuses the batch" or "communicator refuses the plan"
    ShardPlan plan;
  };

  /// Plans `batch`: the partitioner's refusal, its plan, the communicator's refusal of that plan.
  /// The one place a strategy plans; `can_implement` and `compile` go through it.
  [[nodiscard]] static Planned plan(const Arguments& args, const DocumentBatch& batch, const AttentionShape& shape,
                                    const Topology& topology) {
    Planned out;
    if (batch.num_sequences() < 1) {
      out.status = Status::refuse("batch: a default-constructed DocumentBatch{} has no sequences");
      out.refused_by = "partitioner refuses the batch";
      return out;
    }
    const P partitioner{args.partition};
    if (out.status = partitioner.can_implement(batch, topology); !out.status) {
      out.refused_by = "partitioner refuses the batch";
      return out;
    }
    out.plan = partitioner.plan(batch, topology);
    if (out.status = C{args.comm}.can_implement(out.plan, shape); !out.status)
      out.refused_by = "communicator refuses the plan";
    return out;
  }

  /// Whether this strategy can run `batch` with `shape` on `topology`, and why not. Plans the batch:
  /// callers that go on to compile should call `plan` (or `compile`) once instead.
  [[nodiscard]] static Status can_implement(const Arguments& args, const DocumentBatch& batch,
                                            const AttentionShape& shape, const Topology& topology) {
    return plan(args, batch, shape, topology).status;
  }

  /// Rank `rank`'s forward and backward programs of an accepted plan, in the step order.
  [[nodiscard]] static comm::CompiledAttention compile(const Arguments& args, const ShardPlan& plan,
                                                       const AttentionShape& shape, int rank) {
    comm::CompiledAttention program = C{args.comm}.compile(plan, shape, rank);
    step_order_type{args.order}.order(program);
    return program;
  }

  /// Everything one rank runs for `batch`: its plan (status false with the reason when refused) and
  /// programs. DistributedAttention and plan::compile_all both come through here.
  struct Compiled {
    Status status = Status::success();
    const char* refused_by = "";
    ShardPlan plan;
    comm::CompiledAttention program;
  };
  [[nodiscard]] static Compiled compile(const Arguments& args, const DocumentBatch& batch, const AttentionShape& shape,
                                        const Topology& topology, int rank) {
    Planned p = plan(args, batch, shape, topology);
    Compiled out{std::move(p.status), p.refused_by, std::move(p.plan), {}};
    if (out.status) out.program = compile(args, out.plan, shape, rank);
    return out;
  }
};

}  // namespace seqpar
