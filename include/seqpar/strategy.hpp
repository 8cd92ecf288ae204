// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <typeinfo>
#include <vector>

#include "seqpar/attention/kernel.hpp"
#include "seqpar/comm/communicator.hpp"
#include "seqpar/core/document_batch.hpp"
#include "seqpar/detail/attention_engine.hpp"
#include "seqpar/core/shard_plan.hpp"
#include "seqpar/partition/partitioner.hpp"
#include "seqpar/schedule/static.hpp"

namespace seqpar {

/// The composition point: a partitioner (who owns which tokens), a communicator (what moves where)
/// and a scheduler (in what order), chosen at compile time. Tunables are values in `Arguments`.
///
/// @code
/// using Ulysses = seqpar::Strategy<partition::Uniform, comm::AllToAll, schedule::Static>;
/// seqpar::DistributedAttention<Ulysses, attention::CpuFlash<float>> attn(transport, shape);
/// attn.forward(batch, q, k, v, o, lse);
/// @endcode
template <partition::Partitioner P, comm::Communicator C, schedule::Scheduler S = schedule::Static>
struct Strategy {
  using partitioner_type = P;
  using communicator_type = C;
  using scheduler_type = S;

  struct Arguments {
    typename P::Arguments partition{};
    typename C::Arguments comm{};
    typename S::Arguments schedule{};
    int ranks_per_node = 0;  ///< 0: every rank on one node
  };

  /// Whether this strategy can run `batch` with `shape` on `topology`, and why not.
  [[nodiscard]] static Status can_implement(const Arguments& args, const DocumentBatch& batch,
                                            const AttentionShape& shape, const Topology& topology) {
    const P partitioner{args.partition};
    if (Status s = partitioner.can_implement(batch, topology); !s) return s;
    return C{args.comm}.can_implement(partitioner.plan(batch, topology), shape);
  }
};

/// Exact distributed attention of one layer over packed documents, with the strategy's policies,
/// the kernel's arithmetic, over any transport. Tensors are the rank's local shard: `local_tokens`
/// rows in the plan's token order (`owned_ranges(batch)` says which global tokens those are).
/// Plans and programs are compiled once per batch shape and cached; the workspace grows only on a
/// cache miss, so steady-state calls allocate nothing beyond the transport's own buffers.
/// Every rank of the transport must make the same calls with the same batch.
/// The strategy-independent machinery (cache, transports, executor) lives in
/// detail::AttentionEngine<Kernel>, shared by every strategy compiled in with the same kernel.
template <class StrategyT, attention::AttentionKernel Kernel>
class DistributedAttention final : public detail::AttentionEngine<Kernel> {
 public:
  using strategy_type = StrategyT;
  using Arguments = typename StrategyT::Arguments;

  template <Transport Tr>
  DistributedAttention(Tr& transport, const AttentionShape& shape, Arguments args = {}, Kernel kernel = {})
      : detail::AttentionEngine<Kernel>(transport, shape, args.ranks_per_node, std::move(kernel)), args_(args) {}

 private:
  [[nodiscard]] std::uint64_t strategy_signature() const override {
    const std::string name = typeid(StrategyT).name();
    std::uint64_t h = 14695981039346656037ull;
    for (char c : name) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    return h ^ static_cast<std::uint64_t>(args_.ranks_per_node) * 0x9e3779b97f4a7c15ull;
  }

  void compile(const DocumentBatch& batch, ShardPlan& plan, comm::CompiledAttention& program) const override {
    const typename StrategyT::partitioner_type partitioner{args_.partition};
    const typename StrategyT::communicator_type communicator{args_.comm};
    const typename StrategyT::scheduler_type scheduler{args_.schedule};
    const Topology& topo = this->topology();
    if (Status s = partitioner.can_implement(batch, topo); !s)
      throw std::invalid_argument("DistributedAttention: partitioner refuses the batch: " + s.reason);
    plan = partitioner.plan(batch, topo);
    if (Status s = communicator.can_implement(plan, this->shape()); !s)
      throw std::invalid_argument("DistributedAttention: communicator refuses the plan: " + s.reason);
    program = communicator.compile(plan, this->shape(), this->rank());
    scheduler.schedule(program);
  }

  Arguments args_;
};

}  // namespace seqpar
