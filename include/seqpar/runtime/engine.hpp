// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <future>
#include <list>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "seqpar/attention/kernel.hpp"
#include "seqpar/comm/program.hpp"
#include "seqpar/core/aligned_bytes.hpp"
#include "seqpar/core/document_batch.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/shard_plan.hpp"
#include "seqpar/core/status.hpp"
#include "seqpar/core/transport.hpp"
#include "seqpar/core/view_checks.hpp"
#include "seqpar/runtime/any_transport.hpp"
#include "seqpar/runtime/argument_word.hpp"
#include "seqpar/runtime/executor.hpp"
#include "seqpar/runtime/sink_epilogue.hpp"

namespace seqpar::runtime {

/// Everything of DistributedAttention that does not depend on the strategy: the plan/program cache
/// (each entry holds its programs lowered for the executor), the level transports, the execution
/// context, input checks and the executor call. Instantiated once per kernel, however many strategies
/// a program compiles in; the strategy contributes only `compile` (plan + programs).
///
/// Steady state allocates nothing: a call on a cached batch finds its entry without building a key,
/// agrees with its peers through a fixed-size all_gather, and runs lowered programs in a workspace
/// that grows only on a cache miss (or is the caller's).
///
/// Memory is bounded however many batch shapes a run sees: at most kCacheEntries compiled batches
/// (least recently used evicted) and at most kGroupingEntries groupings (a plan's rank groups, with
/// the sub-communicators split for them: the group and the hierarchical levels; BASP makes a new
/// grouping for most batches, each holding its transports' buffers). A grouping is touched by every
/// call after the ranks agree, so its recency, and hence which one is evicted and when it is split
/// again, is the same on every rank: the splits are collective and stay matched.
///
/// Order of a call: every local check first (the batch, the tensor views' extents, strides and
/// aliasing, the strategy's refusal of the batch, the kernel's `can_implement` of the engine's shape
/// and of every head group the program computes), then one all_gather in which the ranks compare
/// what they are about to do and whether each accepted its arguments, then the program. A rank
/// with a bad argument throws its std::invalid_argument and its peers seqpar::Error
/// (Errc::kPeerFailed) naming it, all without waiting on a timeout. The accessors (plan,
/// local_tokens, owned_ranges, workspace_bytes, program) are local: they plan, never communicate.
/// One object serves one rank's thread: a second thread calling into it while a call is in
/// progress gets std::logic_error.
///
/// A fresh batch (every training step brings a new document mix) costs its first call the planning
/// (partitioner, the communicator's compile: up to tens of ms for Hybrid at 1M tokens on 64 ranks,
/// bench/plan_scale) before the first exchange. `plan_ahead(next_batch)` does that part on a
/// background thread while the current step runs; the first call with that batch takes its result
/// (waiting for it if needed) and only lowers it.
template <attention::AttentionKernel Kernel>
class AttentionEngine {
 public:
  using value_type = typename Kernel::value_type;
  using accum_type = typename Kernel::accum_type;
  using exec_type = typename Kernel::exec_type;
  using Executor = runtime::Executor<Kernel, AnyTransport>;

  AttentionEngine(const AttentionEngine&) = delete;
  AttentionEngine& operator=(const AttentionEngine&) = delete;
  virtual ~AttentionEngine() = default;

  [[nodiscard]] const Topology& topology() const noexcept { return topology_; }
  [[nodiscard]] const AttentionShape& shape() const noexcept { return shape_; }
  [[nodiscard]] int rank() const { return world_.rank(); }

  /// Most compiled batches kept (plans, programs, lowered executors).
  static constexpr std::size_t kCacheEntries = 8;
  /// Most groupings kept with their split transports.
  static constexpr std::size_t kGroupingEntries = 8;
  struct CacheSizes {
    std::size_t batches = 0;     ///< <= kCacheEntries
    std::size_t groupings = 0;   ///< <= kGroupingEntries
    std::size_t transports = 0;  ///< split transports held (group and levels of every grouping)
  };
  /// What the caches hold now (for tests and monitoring). Local.
  [[nodiscard]] CacheSizes cache_sizes() const noexcept {
    CacheSizes c{cache_.size(), groupings_.size(), 0};
    for (const Grouping& g : groupings_) c.transports += (g.group ? 1 : 0) + g.levels.size();
    return c;
  }

  /// Plans `batch` (the partitioner and this rank's programs: local, never communicates) on a
  /// background thread, for the first call with it to find ready: call it with the next step's batch as
  /// soon as the data loader has it. At most one batch is planned ahead: a second plan_ahead with
  /// another batch waits for the first and drops it. A batch already cached or already under way is
  /// left alone. An error of the planning (a strategy that refuses the batch) is raised by the call
  /// that uses it, as if it had planned there.
  ///
  /// @code
  /// attn.plan_ahead(next_batch);           // before this step's layers
  /// for (auto& layer : layers) layer.forward(batch, ...);   // meanwhile next_batch is planned
  /// @endcode
  void plan_ahead(const DocumentBatch& batch) {
    const Guard guard(*this, "plan_ahead");
    std::vector<std::int64_t> key = key_of(batch);
    for (const Entry& e : cache_)
      if (e.key == key) return;
    if (ahead_ && ahead_->key == key) return;
    drop_ahead();
    ahead_.emplace();
    ahead_->key = std::move(key);
    // The thread reads only what compile() reads: the shape, the topology, this rank, the strategy's
    // arguments (immutable after construction); derived engines wait for it in their destructors.
    ahead_->result = std::async(std::launch::async, [this, batch] {
      Planned p;
      compile(batch, p.plan, p.program);
      return p;
    });
  }
  /// Whether `batch` is being (or has been) planned ahead and not yet used. Local.
  [[nodiscard]] bool planning_ahead(const DocumentBatch& batch) const { return ahead_ && matches(ahead_->key, batch); }

  /// The plan of `batch` (cached).
  [[nodiscard]] const ShardPlan& plan(const DocumentBatch& batch) {
    const Guard guard(*this, "plan");
    return entry(batch).plan;
  }
  /// This rank's compiled programs for `batch` (cached).
  [[nodiscard]] const comm::CompiledAttention& program(const DocumentBatch& batch) {
    const Guard guard(*this, "program");
    return entry(batch).program;
  }
  /// Global token ranges this rank's local rows hold, in order. Local (plans, never communicates).
  [[nodiscard]] const std::vector<Range>& owned_ranges(const DocumentBatch& batch) {
    return plan(batch).owned[static_cast<std::size_t>(rank())];
  }
  /// Rows of this rank's local tensors for `batch`. Local (plans, never communicates).
  [[nodiscard]] std::int64_t local_tokens(const DocumentBatch& batch) { return plan(batch).local_tokens(rank()); }
  /// Workspace a forward or backward of `batch` needs when the caller provides it (plans on a miss).
  [[nodiscard]] std::size_t workspace_bytes(const DocumentBatch& batch) {
    const Guard guard(*this, "workspace_bytes");
    const Entry& e = entry(batch);
    return std::max(e.forward.workspace_bytes(), e.backward.workspace_bytes());
  }
  /// The execution context every call runs on (the kernel's own unless one was given).
  [[nodiscard]] const exec_type& exec() const noexcept { return exec_; }
  /// Bytes the transports counted for this rank during the last forward or backward call.
  [[nodiscard]] std::uint64_t last_bytes_sent() const noexcept { return last_bytes_sent_; }

  /// O and LSE of the rank's local queries. q: (local, Hq, d); k, v: (local, Hkv, d); o like q;
  /// lse: (Hq, local).
  /// With `workspace` (at least workspace_bytes(batch), in the context's memory) the call uses the
  /// caller's memory instead of the engine's.
  void forward(const DocumentBatch& batch, ThdView<const value_type> q, ThdView<const value_type> k,
               ThdView<const value_type> v, ThdView<value_type> o, LseView<accum_type> lse,
               std::span<std::byte> workspace = {}) {
    forward_call(batch, q, k, v, o, lse, nullptr, workspace);
  }

  /// The forward with attention sinks (attention/sinks.hpp, gpt-oss): `sinks`, one logit per query head
  /// in the context's memory, joins the softmax of every row once, after the rows are merged (however
  /// the strategy split them); o and lse are the rows with the sinks, as `backward` takes them.
  void forward(const DocumentBatch& batch, ThdView<const value_type> q, ThdView<const value_type> k,
               ThdView<const value_type> v, ThdView<value_type> o, LseView<accum_type> lse,
               std::span<const accum_type> sinks, std::span<std::byte> workspace = {}) {
    const SinkCall call{sinks, {}};
    forward_call(batch, q, k, v, o, lse, &call, workspace);
  }

  /// dQ, dK, dV of the rank's local tokens (overwritten), from the forward's O and LSE and dO.
  ///
  /// O and LSE must be what a forward of `batch` wrote. The engine remembers its last kForwardRecords
  /// forwards (where each wrote O and LSE, the batch's fingerprint, and a few of the values it wrote)
  /// and refuses, as a bad argument naming `o` or `lse`, memory that still holds the output of a
  /// forward of another batch (a stale buffer of an earlier step). Memory the engine did not write, or
  /// that was overwritten since (copied, offloaded and brought back, recycled by an allocator), cannot
  /// be told apart and is taken as given; so are O and LSE on a stream-ordered (device) context, whose
  /// values the host cannot sample without a synchronizing copy. Layers interleave freely (forward of
  /// layers 1..L, then backward of L..1): each forward has its own record.
  void backward(const DocumentBatch& batch, ThdView<const value_type> q, ThdView<const value_type> k,
                ThdView<const value_type> v, ThdView<const value_type> o, LseView<const accum_type> lse,
                ThdView<const value_type> dout, ThdView<value_type> dq, ThdView<value_type> dk, ThdView<value_type> dv,
                std::span<std::byte> workspace = {}) {
    backward_call(batch, q, k, v, o, lse, dout, dq, dk, dv, nullptr, workspace);
  }

  /// The backward with attention sinks: o and lse as the sinks' forward returned them; `dsinks` (Hq
  /// values in the context's memory) is overwritten with the sinks' gradient summed over every rank.
  void backward(const DocumentBatch& batch, ThdView<const value_type> q, ThdView<const value_type> k,
                ThdView<const value_type> v, ThdView<const value_type> o, LseView<const accum_type> lse,
                ThdView<const value_type> dout, ThdView<value_type> dq, ThdView<value_type> dk, ThdView<value_type> dv,
                std::span<const accum_type> sinks, std::span<accum_type> dsinks, std::span<std::byte> workspace = {}) {
    const SinkCall call{sinks, dsinks};
    backward_call(batch, q, k, v, o, lse, dout, dq, dk, dv, &call, workspace);
  }

 private:
  struct SinkCall {
    std::span<const accum_type> sinks;
    std::span<accum_type> dsinks;
  };

  void forward_call(const DocumentBatch& batch, ThdView<const value_type> q, ThdView<const value_type> k,
                    ThdView<const value_type> v, ThdView<value_type> o, LseView<accum_type> lse, const SinkCall* sinks,
                    std::span<std::byte> workspace) {
    constexpr const char* where = "DistributedAttention::forward";
    const Guard guard(*this, "forward");
    Entry* found = nullptr;
    std::exception_ptr refused;
    try {  // every local check before the first message
      found = &checked_entry(where, batch);
      require_kernel(where, found->forward_kernel);
      const std::int64_t n = found->plan.local_tokens(rank());
      check_forward_views(where, n, q, k, v, o, lse);
      check_not_input(where, "o", o, q, k, v);
      check_not_input(where, "lse", lse, q, k, v);
      seqpar::detail::check_disjoint(where, "lse", lse, "o", o);
      check_workspace(where, workspace, found->forward.workspace_bytes(), q, k, v, o, lse);
      if (sinks != nullptr) SinkEpilogue<exec_type>::check(where, sinks->sinks, shape_.heads_q);
    } catch (const std::exception&) {
      refused = std::current_exception();
    }
    agree(batch, 0, sinks != nullptr, refused);
    Entry& e = connect(*found);
    typename Executor::Buffers b;
    b.thd[idx(comm::BufferId::kQ)] = mut(q);
    b.thd[idx(comm::BufferId::kK)] = mut(k);
    b.thd[idx(comm::BufferId::kV)] = mut(v);
    b.thd[idx(comm::BufferId::kO)] = o;
    b.lse[idx(comm::BufferId::kLse)] = lse;
    run(e, e.forward, b, workspace);
    if (sinks != nullptr) SinkEpilogue<exec_type>::forward(exec_, o, lse, sinks->sinks);
    remember_forward(batch, o, lse);  // what backward will be handed: the rows with the sinks
  }

  void backward_call(const DocumentBatch& batch, ThdView<const value_type> q, ThdView<const value_type> k,
                     ThdView<const value_type> v, ThdView<const value_type> o, LseView<const accum_type> lse,
                     ThdView<const value_type> dout, ThdView<value_type> dq, ThdView<value_type> dk,
                     ThdView<value_type> dv, const SinkCall* sinks, std::span<std::byte> workspace) {
    constexpr const char* where = "DistributedAttention::backward";
    const Guard guard(*this, "backward");
    Entry* found = nullptr;
    std::exception_ptr refused;
    try {  // every local check before the first message
      found = &checked_entry(where, batch);
      require_kernel(where, found->backward_kernel);
      const std::int64_t n = found->plan.local_tokens(rank());
      check_forward_views(where, n, q, k, v, o, lse);
      seqpar::detail::check_view(dout, where, "dout", n, shape_.heads_q, shape_.v_dim());
      seqpar::detail::check_view(dq, where, "dq", n, shape_.heads_q, shape_.qk_dim());
      seqpar::detail::check_view(dk, where, "dk", n, shape_.heads_kv, shape_.qk_dim());
      seqpar::detail::check_view(dv, where, "dv", n, shape_.heads_kv, shape_.v_dim());
      // dq, dk, dv are written while every input (and one another) is still read.
      const char* const outs[] = {"dq", "dk", "dv"};
      const ThdView<value_type> out_views[] = {dq, dk, dv};
      for (std::size_t i = 0; i < 3; ++i) {
        check_not_input(where, outs[i], out_views[i], q, k, v);
        for (std::size_t j = 0; j < i; ++j)
          seqpar::detail::check_disjoint(where, outs[i], out_views[i], outs[j], out_views[j]);
        seqpar::detail::check_disjoint(where, outs[i], out_views[i], "o", o);
        seqpar::detail::check_disjoint(where, outs[i], out_views[i], "dout", dout);
        seqpar::detail::check_disjoint(where, outs[i], out_views[i], "lse", lse);
      }
      check_workspace(where, workspace, found->backward.workspace_bytes(), q, k, v, o, lse, dout, dq, dk, dv);
      if (sinks != nullptr) SinkEpilogue<exec_type>::check(where, sinks->sinks, shape_.heads_q, sinks->dsinks, true);
      check_forward_of(where, batch, o, lse);
    } catch (const std::exception&) {
      refused = std::current_exception();
    }
    agree(batch, 1, sinks != nullptr, refused);
    Entry& e = connect(*found);
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
    run(e, e.backward, b, workspace);
    if (sinks != nullptr) sink_epilogue_.backward(exec_, world_, dout, o, lse, sinks->sinks, sinks->dsinks);
  }

 protected:
  /// Identifies the strategy type and its arguments' effect across ranks (ranks must agree on it).
  [[nodiscard]] virtual std::uint64_t strategy_signature() const = 0;

  /// The strategy's arguments (runtime::ArgumentWord), compared one by one so that a disagreement names
  /// the argument. The first kArgumentWords are compared by name; the rest (if any) by a hash of them.
  [[nodiscard]] virtual std::span<const ArgumentWord> argument_words() const { return {}; }
  static constexpr std::size_t kArgumentWords = 24;

 public:
  /// Forwards remembered for backward's check of its O and LSE (per object: one object serving every
  /// layer checks the last kForwardRecords layers' forwards).
  static constexpr std::size_t kForwardRecords = 64;

 protected:
  /// The strategy's part: plan `batch` on topology() and compile this rank's programs. Throws
  /// std::invalid_argument (naming the refusal) when the strategy cannot implement the batch.
  virtual void compile(const DocumentBatch& batch, ShardPlan& plan, comm::CompiledAttention& program) const = 0;

  template <Transport Tr>
  AttentionEngine(Tr& transport, const AttentionShape& shape, int ranks_per_node, Kernel kernel)
      : world_(transport), shape_(shape), kernel_(std::move(kernel)), exec_(kernel_.exec()) {
    static_assert(!StreamOrderedTransport<Tr> || StreamOrderedExec<exec_type>,
                  "DistributedAttention: a stream-ordered transport (NCCL) enqueues its transfers on the kernel's "
                  "streams, so it needs a kernel whose exec_type is a StreamOrderedExec (attention::CudaFlash on "
                  "gpu::CudaExec); with a host kernel use a host transport (in-process or MPI)");
    shape_.validate("DistributedAttention");
    seqpar::detail::require(ranks_per_node >= 0, "DistributedAttention", "args.ranks_per_node", ranks_per_node,
                            "must be >= 0 (0 = one node)");
    topology_ = Topology{world_.size(), ranks_per_node == 0 ? world_.size() : ranks_per_node};
  }

 private:
  // The views both passes take: q, k, v, o of n local rows, lse (Hq, n).
  template <class O, class L>
  void check_forward_views(const char* where, std::int64_t n, ThdView<const value_type> q, ThdView<const value_type> k,
                           ThdView<const value_type> v, const O& o, const L& lse) const {
    seqpar::detail::check_view(q, where, "q", n, shape_.heads_q, shape_.qk_dim());
    seqpar::detail::check_view(k, where, "k", n, shape_.heads_kv, shape_.qk_dim());
    seqpar::detail::check_view(v, where, "v", n, shape_.heads_kv, shape_.v_dim());
    seqpar::detail::check_view(o, where, "o", n, shape_.heads_q, shape_.v_dim());
    seqpar::detail::check_view(lse, where, "lse", shape_.heads_q, n);
  }

  // A caller's workspace: large enough, and sharing memory with no tensor (the program writes it).
  template <class... Views>
  static void check_workspace(const char* where, std::span<std::byte> workspace, std::size_t need,
                              const Views&... views) {
    if (workspace.data() == nullptr) return;  // the engine's own
    seqpar::detail::require(workspace.size() >= need, where, "workspace.size()", workspace.size(),
                            "need at least workspace_bytes(batch) = " + std::to_string(need));
    const char* const names[] = {"q", "k", "v", "o", "lse", "dout", "dq", "dk", "dv"};
    std::size_t i = 0;
    (seqpar::detail::check_disjoint(where, "workspace", workspace, names[i++], views), ...);
  }

  // Where the last forwards wrote O and LSE, for backward's check that they are a forward of its batch
  // (a fixed ring: recording and checking allocate nothing). The samples tell memory that still holds
  // a forward's output from memory overwritten since (a copy of another forward's output, a buffer an
  // allocator recycled), which must not be refused.
  struct ForwardRecord {
    const void* o = nullptr;
    const void* lse = nullptr;
    std::int64_t rows = 0;
    std::uint64_t batch = 0;  // DocumentBatch::fingerprint(); 0: empty slot
    std::array<std::byte, 3 * sizeof(value_type)> o_samples{};
    std::array<std::byte, 3 * sizeof(accum_type)> lse_samples{};
  };

  template <class V>
  static std::array<std::byte, 3 * sizeof(std::remove_const_t<V>)> sample(const ThdView<V>& o) noexcept {
    std::array<std::byte, 3 * sizeof(std::remove_const_t<V>)> out{};
    const std::int64_t n = o.tokens;
    const V* at[3] = {o.row(0, 0), o.row(n / 2, o.heads / 2) + o.head_dim / 2,
                      o.row(n - 1, o.heads - 1) + o.head_dim - 1};
    for (std::size_t i = 0; i < 3; ++i) std::memcpy(out.data() + i * sizeof(V), at[i], sizeof(V));
    return out;
  }
  template <class V>
  static std::array<std::byte, 3 * sizeof(std::remove_const_t<V>)> sample(const LseView<V>& lse) noexcept {
    std::array<std::byte, 3 * sizeof(std::remove_const_t<V>)> out{};
    const std::int64_t n = lse.tokens;
    const V* at[3] = {&lse(0, 0), &lse(lse.heads / 2, n / 2), &lse(lse.heads - 1, n - 1)};
    for (std::size_t i = 0; i < 3; ++i) std::memcpy(out.data() + i * sizeof(V), at[i], sizeof(V));
    return out;
  }

  void remember_forward(const DocumentBatch& batch, ThdView<value_type> o, LseView<accum_type> lse) noexcept {
    if constexpr (exec_type::kHostSynchronous) {
      if (o.tokens == 0) return;
      ForwardRecord& r = forwards_[next_forward_];
      next_forward_ = (next_forward_ + 1) % kForwardRecords;
      r = {o.data, lse.data, o.tokens, batch.fingerprint(), sample(o), sample(lse)};
    }
  }

  // Refuses O or LSE that still hold what a forward of another batch wrote (most recent record first).
  void check_forward_of(const char* where, const DocumentBatch& batch, ThdView<const value_type> o,
                        LseView<const accum_type> lse) const {
    if constexpr (exec_type::kHostSynchronous) {
      if (o.tokens == 0) return;
      const std::uint64_t mine = batch.fingerprint();
      const auto o_now = sample(o);
      const auto lse_now = sample(lse);
      bool o_seen = false, lse_seen = false;
      for (std::size_t i = 0; i < kForwardRecords && !(o_seen && lse_seen); ++i) {
        const ForwardRecord& r = forwards_[(next_forward_ + kForwardRecords - 1 - i) % kForwardRecords];
        if (r.batch == 0 || r.rows != o.tokens) continue;
        const auto refuse = [&](const char* name, const void* data) {
          seqpar::detail::throw_invalid(
              where, name, data,
              "holds the output of a forward of another batch (fingerprint " + std::to_string(r.batch) +
                  ", this batch's " + std::to_string(mine) +
                  "): pass the O and LSE a forward of this batch wrote (a stale buffer of an earlier step?)");
        };
        if (!o_seen && r.o == static_cast<const void*>(o.data) && r.o_samples == o_now) {
          o_seen = true;
          if (r.batch != mine) refuse("o", o.data);
        }
        if (!lse_seen && r.lse == static_cast<const void*>(lse.data) && r.lse_samples == lse_now) {
          lse_seen = true;
          if (r.batch != mine) refuse("lse", lse.data);
        }
      }
    }
  }

  // An output (o and lse forward; dq, dk, dv backward) may not share memory with q, k or v.
  template <class Out>
  static void check_not_input(const char* where, const char* name, const Out& out, ThdView<const value_type> q,
                              ThdView<const value_type> k, ThdView<const value_type> v) {
    seqpar::detail::check_disjoint(where, name, out, "q", q);
    seqpar::detail::check_disjoint(where, name, out, "k", k);
    seqpar::detail::check_disjoint(where, name, out, "v", v);
  }

  /// What every rank is about to do, compared across ranks before any other communication, and
  /// whether this rank's own checks passed (refused != 0: `reason` holds the start of its message).
  struct CallSignature {
    std::uint64_t batch = 0, strategy = 0;
    std::int64_t tokens = 0, documents = 0;
    std::int32_t heads_q = 0, heads_kv = 0, head_dim = 0, head_dim_v = 0, pass = 0, sinks = 0;
    double scale = 0;
    std::uint64_t arguments[kArgumentWords + 1] = {};  // the last: hash of the words past kArgumentWords
    std::int32_t refused = 0;
    char reason[300] = {};
  };

  // Marks the object busy for one call: a second thread entering while a call is in progress gets
  // a clear error (it would otherwise interleave two ranks' worth of messages on one transport).
  struct Guard {
    AttentionEngine& self;
    Guard(AttentionEngine& s, const char* what) : self(s) {
      if (self.busy_.exchange(true, std::memory_order_acquire))
        throw std::logic_error(std::string("DistributedAttention::") + what +
                               ": another call on this object is in progress on another thread (one "
                               "DistributedAttention serves one rank's thread; give each thread its own)");
    }
    Guard(const Guard&) = delete;
    Guard& operator=(const Guard&) = delete;
    ~Guard() { self.busy_.store(false, std::memory_order_release); }
  };

  static std::uint64_t fnv1a(std::uint64_t h, std::int64_t x) noexcept {
    for (int i = 0; i < 8; ++i) h = (h ^ static_cast<std::uint64_t>((x >> (8 * i)) & 0xff)) * 1099511628211ull;
    return h;
  }

  // A cheap all_gather of a few words: a rank that passes a different batch, shape or strategy makes
  // every rank raise Errc::kMismatch naming the disagreement, instead of a hang or a wrong answer.
  void agree(const DocumentBatch& batch, int pass, bool sinks, const std::exception_ptr& refused) {
    CallSignature mine;
    mine.batch = 14695981039346656037ull;
    for_each_key_word(batch, [&](std::int64_t x) { mine.batch = fnv1a(mine.batch, x); });
    mine.strategy = strategy_signature();
    mine.tokens = batch.total_tokens();
    mine.documents = static_cast<std::int64_t>(batch.documents().size());
    mine.heads_q = shape_.heads_q, mine.heads_kv = shape_.heads_kv, mine.head_dim = shape_.head_dim;
    mine.head_dim_v = shape_.v_dim();
    mine.pass = pass;
    mine.sinks = sinks ? 1 : 0;
    mine.scale = shape_.scale();
    const auto words = argument_words();
    for (std::size_t i = 0; i < words.size(); ++i)
      mine.arguments[std::min(i, kArgumentWords)] =
          i < kArgumentWords ? words[i].value
                             : fnv1a(mine.arguments[kArgumentWords], static_cast<std::int64_t>(words[i].value));
    if (refused) {
      mine.refused = 1;
      std::string what = "unknown exception";
      try {
        std::rethrow_exception(refused);
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      std::strncpy(mine.reason, what.c_str(), sizeof(mine.reason) - 1);
    }
    const auto n = static_cast<std::size_t>(world_.size());
    signatures_.resize(n);
    world_.all_gather(std::as_bytes(std::span(&mine, 1)), std::as_writable_bytes(std::span(signatures_)));
    for (std::size_t r = 0; r < n; ++r) {
      const CallSignature& other = signatures_[r];
      const auto fail = [&](const char* what, auto a, auto b) {
        throw Error(Errc::kMismatch, "DistributedAttention: rank " + std::to_string(r) + " and rank " +
                                         std::to_string(rank()) + " disagree on " + what + ": " + std::to_string(a) +
                                         " vs " + std::to_string(b));
      };
      if (other.pass != mine.pass) fail("the call (0 = forward, 1 = backward)", other.pass, mine.pass);
      if (other.sinks != mine.sinks)
        fail("whether the call has attention sinks (0 = no, 1 = yes)", other.sinks, mine.sinks);
      if (other.tokens != mine.tokens) fail("the batch's total tokens", other.tokens, mine.tokens);
      if (other.documents != mine.documents) fail("the batch's document count", other.documents, mine.documents);
      if (other.batch != mine.batch) fail("the batch's document lengths (hash)", other.batch, mine.batch);
      if (other.heads_q != mine.heads_q) fail("shape.heads_q", other.heads_q, mine.heads_q);
      if (other.heads_kv != mine.heads_kv) fail("shape.heads_kv", other.heads_kv, mine.heads_kv);
      if (other.head_dim != mine.head_dim) fail("shape.head_dim", other.head_dim, mine.head_dim);
      if (other.head_dim_v != mine.head_dim_v) fail("shape.head_dim_v", other.head_dim_v, mine.head_dim_v);
      if (other.scale != mine.scale) fail("shape.softmax_scale", other.scale, mine.scale);
      if (other.strategy != mine.strategy) fail("the strategy (type or ranks_per_node)", other.strategy, mine.strategy);
      for (std::size_t i = 0; i < std::min(words.size(), kArgumentWords); ++i)
        if (other.arguments[i] != mine.arguments[i]) {
          const std::string what = "the strategy argument " + words[i].name;
          if (words[i].is_double)
            fail(what.c_str(), std::bit_cast<double>(other.arguments[i]), std::bit_cast<double>(mine.arguments[i]));
          fail(what.c_str(), static_cast<std::int64_t>(other.arguments[i]),
               static_cast<std::int64_t>(mine.arguments[i]));
        }
      if (other.arguments[kArgumentWords] != mine.arguments[kArgumentWords])
        fail("the strategy's arguments (hash)", other.arguments[kArgumentWords], mine.arguments[kArgumentWords]);
    }
    // Everyone agrees on the call; now whether everyone accepted its arguments.
    if (refused) std::rethrow_exception(refused);
    for (std::size_t r = 0; r < n; ++r)
      if (signatures_[r].refused != 0) {
        const std::string reason(signatures_[r].reason, strnlen(signatures_[r].reason, sizeof(mine.reason)));
        throw Error(Errc::kPeerFailed, "DistributedAttention: rank " + std::to_string(r) +
                                           " refused its arguments before any communication: " + reason);
      }
  }

  struct Entry {
    std::vector<std::int64_t> key;
    ShardPlan plan;
    comm::CompiledAttention program;
    Executor forward, backward;              // the programs, lowered
    Status forward_kernel, backward_kernel;  // the kernel's can_implement of each (local, once per entry)
    AnyTransport* group = nullptr;
    AnyTransport* inner = nullptr;  // hierarchical communicators: ranks of a node inside the group
    AnyTransport* outer = nullptr;  // and the ranks at the same position of every node
    bool connected = false;         // the three above are set (a collective step: after agree)
    std::vector<int> grouping;      // the plan's groups, flattened (-1 after each): its Grouping's key
  };
  // A plan's grouping and the sub-communicators this rank split for it.
  struct Grouping {
    std::vector<int> signature;
    std::unique_ptr<AnyTransport> group;  // null: the group is the whole world
    std::vector<std::pair<std::array<int, 3>, std::unique_ptr<AnyTransport>>> levels;  // (level, color, key)
  };
  static constexpr std::size_t idx(comm::BufferId b) noexcept { return static_cast<std::size_t>(b); }

  // Sources are read, never written, by the programs; the executor's buffer table is uniform.
  static ThdView<value_type> mut(ThdView<const value_type> v) noexcept {
    return {const_cast<value_type*>(v.data), v.tokens, v.heads, v.head_dim, v.token_stride, v.head_stride};
  }

  // The words that identify a batch shape: document boundaries, then sequence boundaries, then the
  // window (a window layer and a full layer over the same rows have different plans).
  template <class Fn>
  static void for_each_key_word(const DocumentBatch& batch, Fn&& fn) {
    for (std::int64_t x : batch.cu_seqlens()) fn(x);
    fn(-1);
    for (int b = 0; b < batch.num_sequences(); ++b) fn(batch.sequence(b).begin);
    fn(batch.total_tokens());
    fn(batch.window());
  }
  static bool matches(const std::vector<std::int64_t>& key, const DocumentBatch& batch) {
    std::size_t i = 0;
    bool same = true;
    for_each_key_word(batch, [&](std::int64_t x) {
      same = same && i < key.size() && key[i] == x;
      ++i;
    });
    return same && i == key.size();
  }

 protected:
  /// Waits for a plan_ahead still running and drops it. Derived engines call it first in their
  /// destructor: the background compile() reads their members.
  void finish_planning_ahead() noexcept { drop_ahead(); }

  /// The cached key of `batch` (for derived engines that keep per-shape state).
  static std::vector<std::int64_t> key_of(const DocumentBatch& batch) {
    std::vector<std::int64_t> key;
    for_each_key_word(batch, [&](std::int64_t x) { key.push_back(x); });
    return key;
  }

 private:
  Entry& entry(const DocumentBatch& batch) {
    for (auto it = cache_.begin(); it != cache_.end(); ++it)
      if (matches(it->key, batch)) {
        if (it != cache_.begin()) cache_.splice(cache_.begin(), cache_, it);  // most recently used first
        return cache_.front();
      }
    Entry e;
    e.key = key_of(batch);
    if (ahead_ && ahead_->key == e.key) {
      std::future<Planned> result = std::move(ahead_->result);
      ahead_.reset();
      Planned p = result.get();  // the planning's error, if any, is raised here, as a miss would
      e.plan = std::move(p.plan);
      e.program = std::move(p.program);
    } else {
      compile(batch, e.plan, e.program);
    }
    for (const auto& g : e.plan.groups) {
      e.grouping.insert(e.grouping.end(), g.begin(), g.end());
      e.grouping.push_back(-1);
    }
    e.forward.initialize(e.program.forward, kernel_);
    e.backward.initialize(e.program.backward, kernel_);
    e.forward_kernel = kernel_status(e.forward);
    e.backward_kernel = kernel_status(e.backward);
    cache_.push_front(std::move(e));
    if (cache_.size() > kCacheEntries) cache_.pop_back();
    return cache_.front();
  }

  // The kernel's answer for the engine's shape and for every kernel call of a lowered program (their
  // head groups: a strategy that splits heads calls the kernel with fewer than the engine's).
  Status kernel_status(const Executor& program) const {
    if (Status s = attention::can_implement(kernel_, exec_, shape_); !s) return s;
    return program.can_implement(kernel_, exec_);
  }

  // A kernel's refusal, as the bad argument it is (local: before agree, like every check of a call).
  static void require_kernel(const char* where, const Status& kernel) {
    if (!kernel) throw std::invalid_argument(std::string(where) + ": the kernel cannot run it: " + kernel.reason);
  }

  // The local checks of the batch, then its (local) plan and programs.
  Entry& checked_entry(const char* where, const DocumentBatch& batch) {
    seqpar::detail::require(batch.num_sequences() >= 1, where, "batch", "DocumentBatch{}",
                            "a default-constructed batch has no sequences (construct it from document lengths)");
    return entry(batch);
  }

  // The entry's level transports (splits of the world on a miss of its grouping: collective, so only
  // after agree, when every rank runs the same batch).
  Entry& connect(Entry& e) {
    Grouping& g = touch_grouping(e.grouping);  // every call, connected or not: the same LRU on every rank
    if (e.connected) return e;
    e.group = &group_transport(g, e.plan);
    e.inner = level_transport(g, e.program.forward.splits[static_cast<std::size_t>(comm::Level::kInner)], 0);
    e.outer = level_transport(g, e.program.forward.splits[static_cast<std::size_t>(comm::Level::kOuter)], 1);
    // An eagerly buffering transport holds at most what one run receives: room for it now, so that
    // steady-state calls allocate nothing whatever the threads' timing.
    AnyTransport* const levels[] = {e.group, e.inner, e.outer};
    for (std::size_t l = 0; l < comm::kNumLevels; ++l)
      if (levels[l] != nullptr)
        levels[l]->reserve_receives(std::max(e.forward.lowered().receives[l], e.backward.lowered().receives[l]),
                                    static_cast<std::size_t>(std::max(e.forward.lowered().largest_receive[l],
                                                                      e.backward.lowered().largest_receive[l])));
    e.connected = true;
    return e;
  }

  // The grouping `signature` moved to the front of the LRU (no allocation on a hit), or added; the
  // least recently used beyond kGroupingEntries is dropped with its transports, and every cached
  // entry that used them is disconnected (it splits again, collectively, on its next call).
  Grouping& touch_grouping(const std::vector<int>& signature) {
    for (auto it = groupings_.begin(); it != groupings_.end(); ++it)
      if (it->signature == signature) {
        if (it != groupings_.begin()) groupings_.splice(groupings_.begin(), groupings_, it);
        return groupings_.front();
      }
    groupings_.push_front(Grouping{signature, nullptr, {}});
    if (groupings_.size() > kGroupingEntries) {
      const Grouping& old = groupings_.back();
      const auto held = [&](const AnyTransport* t) {
        if (t == nullptr) return false;
        if (t == old.group.get()) return true;
        for (const auto& l : old.levels)
          if (t == l.second.get()) return true;
        return false;
      };
      for (Entry& e : cache_)
        if (e.connected && (held(e.group) || held(e.inner) || held(e.outer))) {
          e.connected = false;
          e.group = e.inner = e.outer = nullptr;
        }
      groupings_.pop_back();
    }
    return groupings_.front();
  }

  // The plan's group of this rank as a sub-communicator, split once per grouping while it is cached
  // (a collective call: every rank reaches it on the same batch).
  AnyTransport& group_transport(Grouping& g, const ShardPlan& plan) {
    const int me = rank();
    const int gi = plan.group_of(me);
    const auto& members = plan.groups[static_cast<std::size_t>(gi)];
    bool identity = static_cast<int>(members.size()) == world_.size();
    for (std::size_t i = 0; identity && i < members.size(); ++i) identity = members[i] == static_cast<int>(i);
    if (identity) return world_;
    if (!g.group) {
      const int key = static_cast<int>(std::find(members.begin(), members.end(), me) - members.begin());
      g.group = std::make_unique<AnyTransport>(world_.split(gi, key));
    }
    return *g.group;
  }

  // A communicator's inner/outer level as a split of the world (collective on a miss). Kept under the
  // plan's grouping as well as this rank's (color, key): the grouping is the same on every rank, so
  // every rank hits or misses together. Keyed by (color, key) alone, a rank could find its level
  // cached from an earlier batch with another grouping while a peer must split, and the two would call
  // different collectives (found running chunked batches under BatchAware x Hierarchical).
  AnyTransport* level_transport(Grouping& g, const comm::Program::LevelSplit& split, int level) {
    if (split.color < 0) return nullptr;
    const std::array<int, 3> key{level, split.color, split.key};
    for (auto& l : g.levels)
      if (l.first == key) return l.second.get();
    g.levels.emplace_back(key, std::make_unique<AnyTransport>(world_.split(split.color, split.key)));
    return g.levels.back().second.get();
  }

  void run(Entry& e, Executor& executor, typename Executor::Buffers& b, std::span<std::byte> workspace) {
    const std::size_t need = executor.workspace_bytes();
    if (workspace.data() == nullptr) {
      if (workspace_.size() < need) workspace_ = DataOps<exec_type>::allocate(exec_, need);  // only on a cache miss
      workspace = workspace_.span();
    }
    const typename Executor::Levels levels{e.group, e.inner, e.outer};
    const auto sent = [&] {
      std::uint64_t total = 0;
      for (std::size_t i = 0; i < levels.size(); ++i)
        if (levels[i] != nullptr && std::find(levels.begin(), levels.begin() + static_cast<std::ptrdiff_t>(i),
                                              levels[i]) == levels.begin() + static_cast<std::ptrdiff_t>(i))
          total += levels[i]->counters().bytes_sent;
      return total;
    };
    const std::uint64_t before = sent();
    executor.run(levels, kernel_, exec_, b, workspace);
    last_bytes_sent_ = sent() - before;
  }

  AnyTransport world_;
  AttentionShape shape_;
  Kernel kernel_;
  exec_type exec_;
  Topology topology_;
  std::list<Entry> cache_;
  // A batch planned ahead on a background thread (plan_ahead), until a call uses it.
  struct Planned {
    ShardPlan plan;
    comm::CompiledAttention program;
  };
  struct Ahead {
    std::vector<std::int64_t> key;
    std::future<Planned> result;
  };
  std::optional<Ahead> ahead_;
  void drop_ahead() noexcept {
    if (!ahead_) return;
    if (ahead_->result.valid()) ahead_->result.wait();  // its outcome, an error included, is not wanted
    ahead_.reset();
  }
  std::list<Grouping> groupings_;                     // most recently used first, at most kGroupingEntries
  typename DataOps<exec_type>::Workspace workspace_;  // in the context's memory
  std::uint64_t last_bytes_sent_ = 0;
  std::vector<CallSignature> signatures_;
  SinkEpilogue<exec_type> sink_epilogue_;  // its gather buffer, grown on the first call with sinks
  std::array<ForwardRecord, kForwardRecords> forwards_{};
  std::size_t next_forward_ = 0;  // the slot the next forward records in
  std::atomic<bool> busy_{false};
};

}  // namespace seqpar::runtime
