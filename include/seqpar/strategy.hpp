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
#include <vector>

#include "seqpar/attention/kernel.hpp"
#include "seqpar/comm/communicator.hpp"
#include "seqpar/comm/executor.hpp"
#include "seqpar/core/aligned_bytes.hpp"
#include "seqpar/core/any_transport.hpp"
#include "seqpar/core/document_batch.hpp"
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
template <class StrategyT, attention::AttentionKernel Kernel>
class DistributedAttention {
 public:
  using strategy_type = StrategyT;
  using value_type = typename Kernel::value_type;
  using accum_type = typename Kernel::accum_type;
  using Arguments = typename StrategyT::Arguments;
  using Executor = comm::Executor<Kernel>;

  template <Transport Tr>
  DistributedAttention(Tr& transport, const AttentionShape& shape, Arguments args = {}, Kernel kernel = {})
      : world_(transport), shape_(shape), args_(args), kernel_(std::move(kernel)) {
    shape_.validate("DistributedAttention");
    detail::require(args_.ranks_per_node >= 0, "DistributedAttention", "args.ranks_per_node", args_.ranks_per_node,
                    "must be >= 0 (0 = one node)");
    topology_ = Topology{world_.size(), args_.ranks_per_node == 0 ? world_.size() : args_.ranks_per_node};
  }

  [[nodiscard]] const Topology& topology() const noexcept { return topology_; }
  [[nodiscard]] const AttentionShape& shape() const noexcept { return shape_; }
  [[nodiscard]] int rank() const { return world_.rank(); }

  /// The plan of `batch` (cached).
  [[nodiscard]] const ShardPlan& plan(const DocumentBatch& batch) { return entry(batch).plan; }
  /// This rank's compiled programs for `batch` (cached).
  [[nodiscard]] const comm::CompiledAttention& program(const DocumentBatch& batch) { return entry(batch).program; }
  /// Global token ranges this rank's local rows hold, in order.
  [[nodiscard]] const std::vector<Range>& owned_ranges(const DocumentBatch& batch) {
    return plan(batch).owned[static_cast<std::size_t>(rank())];
  }
  [[nodiscard]] std::int64_t local_tokens(const DocumentBatch& batch) { return plan(batch).local_tokens(rank()); }
  /// Bytes the transport counted for this rank during the last forward or backward call.
  [[nodiscard]] std::uint64_t last_bytes_sent() const noexcept { return last_bytes_sent_; }

  /// O and LSE of the rank's local queries. q: (local, Hq, d); k, v: (local, Hkv, d); o like q;
  /// lse: (Hq, local).
  void forward(const DocumentBatch& batch, ThdView<const value_type> q, ThdView<const value_type> k,
               ThdView<const value_type> v, ThdView<value_type> o, LseView<accum_type> lse) {
    Entry& e = entry(batch);
    const std::int64_t n = e.plan.local_tokens(rank());
    constexpr const char* where = "DistributedAttention::forward";
    detail::check_view(q, where, "q", n, shape_.heads_q, shape_.head_dim);
    detail::check_view(k, where, "k", n, shape_.heads_kv, shape_.head_dim);
    detail::check_view(v, where, "v", n, shape_.heads_kv, shape_.head_dim);
    detail::check_view(o, where, "o", n, shape_.heads_q, shape_.head_dim);
    detail::check_view(lse, where, "lse", shape_.heads_q, n);
    typename Executor::Buffers b;
    b.thd[idx(comm::BufferId::kQ)] = mut(q);
    b.thd[idx(comm::BufferId::kK)] = mut(k);
    b.thd[idx(comm::BufferId::kV)] = mut(v);
    b.thd[idx(comm::BufferId::kO)] = o;
    b.lse[idx(comm::BufferId::kLse)] = lse;
    run(e, e.program.forward, b);
  }

  /// dQ, dK, dV of the rank's local tokens (overwritten), from the forward's O and LSE and dO.
  void backward(const DocumentBatch& batch, ThdView<const value_type> q, ThdView<const value_type> k,
                ThdView<const value_type> v, ThdView<const value_type> o, LseView<const accum_type> lse,
                ThdView<const value_type> dout, ThdView<value_type> dq, ThdView<value_type> dk,
                ThdView<value_type> dv) {
    Entry& e = entry(batch);
    const std::int64_t n = e.plan.local_tokens(rank());
    constexpr const char* where = "DistributedAttention::backward";
    detail::check_view(q, where, "q", n, shape_.heads_q, shape_.head_dim);
    detail::check_view(k, where, "k", n, shape_.heads_kv, shape_.head_dim);
    detail::check_view(v, where, "v", n, shape_.heads_kv, shape_.head_dim);
    detail::check_view(o, where, "o", n, shape_.heads_q, shape_.head_dim);
    detail::check_view(lse, where, "lse", shape_.heads_q, n);
    detail::check_view(dout, where, "dout", n, shape_.heads_q, shape_.head_dim);
    detail::check_view(dq, where, "dq", n, shape_.heads_q, shape_.head_dim);
    detail::check_view(dk, where, "dk", n, shape_.heads_kv, shape_.head_dim);
    detail::check_view(dv, where, "dv", n, shape_.heads_kv, shape_.head_dim);
    typename Executor::Buffers b;
    b.thd[idx(comm::BufferId::kQ)] = mut(q);
    b.thd[idx(comm::BufferId::kK)] = mut(k);
    b.thd[idx(comm::BufferId::kV)] = mut(v);
    b.thd[idx(comm::BufferId::kO)] = mut(o);
    b.lse[idx(comm::BufferId::kLse)] = {const_cast<accum_type*>(lse.data), lse.heads, lse.tokens, lse.head_stride};
    b.thd[idx(comm::BufferId::kDout)] = mut(dout);
    b.thd[idx(comm::BufferId::kDq)] = dq;
    b.thd[idx(comm::BufferId::kDk)] = dk;
    b.thd[idx(comm::BufferId::kDv)] = dv;
    run(e, e.program.backward, b);
  }

 private:
  struct Entry {
    std::vector<std::int64_t> key;
    ShardPlan plan;
    comm::CompiledAttention program;
    AnyTransport* group = nullptr;
    AnyTransport* inner = nullptr;  // hierarchical communicators: ranks of a node inside the group
    AnyTransport* outer = nullptr;  // and the ranks at the same position of every node
  };
  static constexpr std::size_t kCacheEntries = 8;
  static constexpr std::size_t idx(comm::BufferId b) noexcept { return static_cast<std::size_t>(b); }

  // Sources are read, never written, by the programs; the executor's buffer table is uniform.
  static ThdView<value_type> mut(ThdView<const value_type> v) noexcept {
    return {const_cast<value_type*>(v.data), v.tokens, v.heads, v.head_dim, v.token_stride, v.head_stride};
  }

  static std::vector<std::int64_t> key_of(const DocumentBatch& batch) {
    std::vector<std::int64_t> key(batch.cu_seqlens().begin(), batch.cu_seqlens().end());
    key.push_back(-1);
    for (int b = 0; b <= batch.num_sequences(); ++b) key.push_back(b < batch.num_sequences() ? batch.sequence(b).begin
                                                                                              : batch.total_tokens());
    return key;
  }

  Entry& entry(const DocumentBatch& batch) {
    std::vector<std::int64_t> key = key_of(batch);
    for (auto it = cache_.begin(); it != cache_.end(); ++it)
      if (it->key == key) {
        cache_.splice(cache_.begin(), cache_, it);  // most recently used first
        return cache_.front();
      }
    const typename StrategyT::partitioner_type partitioner{args_.partition};
    const typename StrategyT::communicator_type communicator{args_.comm};
    const typename StrategyT::scheduler_type scheduler{args_.schedule};
    if (Status s = partitioner.can_implement(batch, topology_); !s)
      throw std::invalid_argument("DistributedAttention: partitioner refuses the batch: " + s.reason);
    Entry e;
    e.key = std::move(key);
    e.plan = partitioner.plan(batch, topology_);
    if (Status s = communicator.can_implement(e.plan, shape_); !s)
      throw std::invalid_argument("DistributedAttention: communicator refuses the plan: " + s.reason);
    e.program = communicator.compile(e.plan, shape_, rank());
    scheduler.schedule(e.program);
    e.group = &group_transport(e.plan);
    e.inner = level_transport(e.program.forward.splits[static_cast<std::size_t>(comm::Level::kInner)]);
    e.outer = level_transport(e.program.forward.splits[static_cast<std::size_t>(comm::Level::kOuter)]);
    cache_.push_front(std::move(e));
    if (cache_.size() > kCacheEntries) cache_.pop_back();
    return cache_.front();
  }

  // The plan's groups as sub-communicators, split once per distinct grouping (a collective call:
  // every rank reaches it on the same batch).
  AnyTransport& group_transport(const ShardPlan& plan) {
    const int me = rank();
    const int gi = plan.group_of(me);
    const auto& members = plan.groups[static_cast<std::size_t>(gi)];
    bool identity = static_cast<int>(members.size()) == world_.size();
    for (std::size_t i = 0; identity && i < members.size(); ++i) identity = members[i] == static_cast<int>(i);
    if (identity) return world_;
    std::vector<int> signature;
    for (const auto& g : plan.groups) {
      signature.insert(signature.end(), g.begin(), g.end());
      signature.push_back(-1);
    }
    auto it = groups_.find(signature);
    if (it == groups_.end()) {
      const int key = static_cast<int>(std::find(members.begin(), members.end(), me) - members.begin());
      it = groups_.emplace(signature, std::make_unique<AnyTransport>(world_.split(gi, key))).first;
    }
    return *it->second;
  }

  // A communicator's inner/outer level as a split of the world (collective; cached per color/key).
  AnyTransport* level_transport(const comm::Program::LevelSplit& split) {
    if (split.color < 0) return nullptr;
    const std::vector<int> signature{-2, split.color, split.key};
    auto it = groups_.find(signature);
    if (it == groups_.end())
      it = groups_.emplace(signature, std::make_unique<AnyTransport>(world_.split(split.color, split.key))).first;
    return it->second.get();
  }

  void run(Entry& e, const comm::Program& program, typename Executor::Buffers& b) {
    const std::size_t need = Executor::workspace_bytes(program, kernel_);
    if (workspace_.size() < need) workspace_ = detail::AlignedBytes(need);  // only on a cache miss
    const typename Executor::template Levels<AnyTransport> levels{e.group, e.inner, e.outer};
    const auto sent = [&] {
      std::uint64_t total = 0;
      for (std::size_t i = 0; i < levels.size(); ++i)
        if (levels[i] != nullptr && std::find(levels.begin(), levels.begin() + static_cast<std::ptrdiff_t>(i),
                                              levels[i]) == levels.begin() + static_cast<std::ptrdiff_t>(i))
          total += levels[i]->counters().bytes_sent;
      return total;
    };
    const std::uint64_t before = sent();
    Executor::run(program, levels, kernel_, b, workspace_.span());
    last_bytes_sent_ = sent() - before;
  }

  AnyTransport world_;
  AttentionShape shape_;
  Arguments args_;
  Kernel kernel_;
  Topology topology_;
  std::list<Entry> cache_;
  std::map<std::vector<int>, std::unique_ptr<AnyTransport>> groups_;
  detail::AlignedBytes workspace_;
  std::uint64_t last_bytes_sent_ = 0;
};

}  // namespace seqpar
