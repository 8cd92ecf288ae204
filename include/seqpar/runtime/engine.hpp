// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "seqpar/attention/kernel.hpp"
#include "seqpar/comm/program.hpp"
#include "seqpar/core/attention_mask.hpp"
#include "seqpar/core/document_batch.hpp"
#include "seqpar/core/element_code.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/hash.hpp"
#include "seqpar/core/shard_plan.hpp"
#include "seqpar/core/status.hpp"
#include "seqpar/core/transport.hpp"
#include "seqpar/runtime/agreement.hpp"
#include "seqpar/runtime/any_transport.hpp"
#include "seqpar/runtime/call_checks.hpp"
#include "seqpar/runtime/data_ops.hpp"
#include "seqpar/runtime/executor.hpp"
#include "seqpar/runtime/layer_order.hpp"
#include "seqpar/runtime/level_transports.hpp"
#include "seqpar/runtime/plan_cache.hpp"
#include "seqpar/runtime/sink_epilogue.hpp"

namespace seqpar::runtime {

/// Everything of DistributedAttention that does not depend on the strategy: the two calls, over the
/// plan cache (placements per batch, lowered programs per (batch, mask): runtime/plan_cache.hpp), the
/// one agreement (runtime/agreement.hpp), the call checks (runtime/call_checks.hpp) and the level
/// transports (runtime/level_transports.hpp). Instantiated once per kernel, however many strategies a
/// program compiles in; the strategy contributes only a PlanCompiler (place, compile).
///
/// Placement once per batch, mask per call: where a batch's tokens live (`owned_ranges(batch)`) is made
/// once, balanced for the model's mask mix, and does not depend on the mask of any call; each call
/// passes its layer's AttentionMask (causal by default), so a full and a window layer of one model run
/// on the same rows with plans that differ only in their slices.
///
/// Steady state allocates nothing: a call on a cached (batch, mask) finds its entry without building a
/// key, agrees with its peers through one fixed-size all_gather, and runs lowered programs in a workspace
/// that grows only on a cache miss (or is the caller's).
///
/// Order of a call: every local check first (the batch, the mask, the tensor views' extents, strides and
/// aliasing, the strategy's refusal of the batch, the kernel's `can_implement` of the engine's shape and
/// of every head group the program computes), then the agreement, in which the ranks compare what they
/// are about to do and whether each accepted its arguments, then the program. A rank with a bad argument
/// throws its std::invalid_argument and its peers seqpar::Error (Errc::kPeerFailed) naming it, all without
/// waiting on a timeout. The accessors (placement, plan, local_tokens, owned_ranges, workspace_bytes,
/// program) are local: they plan, never communicate. One object serves one rank's thread: a second thread
/// calling into it while a call is in progress gets std::logic_error.
///
/// A fresh batch (every training step brings a new document mix) costs its first call the planning
/// (partitioner, the communicator's compile: up to tens of ms for Hybrid at 1M tokens on 64 ranks,
/// bench/plan_scale) before the first exchange. `plan_ahead(next_batch)` does that part, for every mask of
/// the mix, on a background thread while the current step runs.
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
  /// The model's mask mix the placements are balanced for.
  [[nodiscard]] const MaskMix& masks() const noexcept { return cache_.compiler().masks(); }

  struct Cached;
  /// Most (batch, mask) plans kept, lowered.
  static constexpr std::size_t kCacheEntries = PlanCache<Cached>::kEntries;
  /// Most batch placements kept.
  static constexpr std::size_t kPlacementEntries = PlanCache<Cached>::kPlacements;
  /// Most groupings kept with their split transports.
  static constexpr std::size_t kGroupingEntries = LevelTransports::kGroupingEntries;
  /// Forwards remembered for backward's check of its O and LSE.
  static constexpr std::size_t kForwardRecords = CallChecks<value_type, accum_type, exec_type>::kForwardRecords;
  struct CacheSizes {
    std::size_t batches = 0;     ///< (batch, mask) plans, <= kCacheEntries
    std::size_t placements = 0;  ///< <= kPlacementEntries
    std::size_t groupings = 0;   ///< <= kGroupingEntries
    std::size_t transports = 0;  ///< split transports held (group and levels of every grouping)
  };
  /// What the caches hold now (for tests and monitoring). Local.
  [[nodiscard]] CacheSizes cache_sizes() const noexcept {
    return {cache_.entries(), cache_.placements(), levels_.groupings(), levels_.transports()};
  }

  /// Places `batch` and compiles this rank's programs for every mask of the mix (local, never
  /// communicates) on a background thread, for the first call with it to find ready: call it with the
  /// next step's batch as soon as the data loader has it. At most one batch is planned ahead. An error
  /// of the planning (a strategy that refuses the batch) is raised by the call that uses it.
  ///
  /// @code
  /// attn.plan_ahead(next_batch);           // before this step's layers
  /// for (auto& layer : layers) layer.forward(batch, ...);   // meanwhile next_batch is planned
  /// @endcode
  void plan_ahead(const DocumentBatch& batch) {
    const Guard guard(*this, "plan_ahead");
    cache_.plan_ahead(batch);
  }
  /// Whether `batch` is being (or has been) planned ahead and not yet used. Local.
  [[nodiscard]] bool planning_ahead(const DocumentBatch& batch) const { return cache_.planning_ahead(batch); }

  /// Where `batch`'s tokens live (cached): the same for every mask.
  [[nodiscard]] const Placement& placement(const DocumentBatch& batch) {
    const Guard guard(*this, "placement");
    return checked_placement("DistributedAttention::placement", batch);
  }
  /// The plan of `batch` under `mask` (cached): the placement and this mask's slices.
  [[nodiscard]] const ShardPlan& plan(const DocumentBatch& batch, AttentionMask mask = {}) {
    const Guard guard(*this, "plan");
    return checked_entry("DistributedAttention::plan", batch, mask).plan;
  }
  /// This rank's compiled programs for `batch` under `mask` (cached).
  [[nodiscard]] const comm::CompiledAttention& program(const DocumentBatch& batch, AttentionMask mask = {}) {
    const Guard guard(*this, "program");
    return checked_entry("DistributedAttention::program", batch, mask).program;
  }
  /// Global token ranges this rank's local rows hold, in order: the same for every layer, whatever its
  /// mask. Local (places, never communicates).
  [[nodiscard]] const std::vector<Range>& owned_ranges(const DocumentBatch& batch) {
    return placement(batch).owned[static_cast<std::size_t>(rank())];
  }
  /// Rows of this rank's local tensors for `batch`. Local (places, never communicates).
  [[nodiscard]] std::int64_t local_tokens(const DocumentBatch& batch) { return placement(batch).local_tokens(rank()); }
  /// Workspace a forward or backward of `batch` under `mask` needs when the caller provides it.
  [[nodiscard]] std::size_t workspace_bytes(const DocumentBatch& batch, AttentionMask mask = {}) {
    const Guard guard(*this, "workspace_bytes");
    const Cached& e = checked_entry("DistributedAttention::workspace_bytes", batch, mask);
    return std::max(e.forward.workspace_bytes(), e.backward.workspace_bytes());
  }
  /// The execution context every call runs on (the kernel's own unless one was given).
  [[nodiscard]] const exec_type& exec() const noexcept { return exec_; }
  /// Which layer this object's calls are for, compared across ranks in every call's agreement (two
  /// layers called in different orders on two ranks are Errc::kMismatch naming this word): by default
  /// the order in which this rank made its attention objects on the transport (runtime/layer_order.hpp),
  /// which an SPMD program makes alike on every rank. `set_layer` names it explicitly instead (any
  /// number the ranks agree on: a model's layer index; a binding whose layers hold transports of their
  /// own). Local.
  ///
  /// What it cannot tell: one object serving several layers of a model (one mask, shape and strategy)
  /// called for them in different orders on two ranks; and a layer's own calls are not counted (a call
  /// skipped on one rank pairs its peers' next call of the same layer with another, which the batch or
  /// the pass then tells apart, or waits for the timeout).
  [[nodiscard]] std::uint64_t layer() const noexcept { return layer_; }
  void set_layer(std::uint64_t layer) noexcept { layer_ = layer; }
  /// Bytes the transports counted for this rank during the last forward or backward call.
  [[nodiscard]] std::uint64_t last_bytes_sent() const noexcept { return last_bytes_sent_; }

  /// O and LSE of the rank's local queries under `mask`. q: (local, Hq, d); k, v: (local, Hkv, d);
  /// o like q (d_v wide); lse: (Hq, local). With `workspace` (at least workspace_bytes(batch, mask), in the
  /// context's memory) the call uses the caller's memory instead of the engine's.
  void forward(const DocumentBatch& batch, AttentionMask mask, ThdView<const value_type> q, ThdView<const value_type> k,
               ThdView<const value_type> v, ThdView<value_type> o, LseView<accum_type> lse,
               std::span<std::byte> workspace = {}) {
    forward_call(batch, mask, q, k, v, o, lse, nullptr, workspace);
  }
  /// The causal forward.
  void forward(const DocumentBatch& batch, ThdView<const value_type> q, ThdView<const value_type> k,
               ThdView<const value_type> v, ThdView<value_type> o, LseView<accum_type> lse,
               std::span<std::byte> workspace = {}) {
    forward_call(batch, {}, q, k, v, o, lse, nullptr, workspace);
  }

  /// The forward with attention sinks (attention/sinks.hpp, gpt-oss): `sinks`, one logit per query head
  /// in the context's memory, the same on every rank (compared in the agreement on host contexts), joins
  /// the softmax of every row once, after the rows are merged (however the strategy split them); o and
  /// lse are the rows with the sinks, as `backward` takes them.
  void forward(const DocumentBatch& batch, AttentionMask mask, ThdView<const value_type> q, ThdView<const value_type> k,
               ThdView<const value_type> v, ThdView<value_type> o, LseView<accum_type> lse,
               std::span<const accum_type> sinks, std::span<std::byte> workspace = {}) {
    const SinkCall call{sinks, {}};
    forward_call(batch, mask, q, k, v, o, lse, &call, workspace);
  }
  void forward(const DocumentBatch& batch, ThdView<const value_type> q, ThdView<const value_type> k,
               ThdView<const value_type> v, ThdView<value_type> o, LseView<accum_type> lse,
               std::span<const accum_type> sinks, std::span<std::byte> workspace = {}) {
    const SinkCall call{sinks, {}};
    forward_call(batch, {}, q, k, v, o, lse, &call, workspace);
  }

  /// dQ, dK, dV of the rank's local tokens (overwritten), from the forward's O and LSE and dO, under the
  /// mask of that forward.
  ///
  /// O and LSE must be what a forward of `batch` under `mask` wrote. The engine remembers its last
  /// kForwardRecords forwards and refuses, as a bad argument naming `o` or `lse`, memory that still holds
  /// the output of a forward of another batch or another mask (runtime/call_checks.hpp). Layers interleave
  /// freely (forward of layers 1..L, then backward of L..1): each forward has its own record.
  void backward(const DocumentBatch& batch, AttentionMask mask, ThdView<const value_type> q,
                ThdView<const value_type> k, ThdView<const value_type> v, ThdView<const value_type> o,
                LseView<const accum_type> lse, ThdView<const value_type> dout, ThdView<value_type> dq,
                ThdView<value_type> dk, ThdView<value_type> dv, std::span<std::byte> workspace = {}) {
    backward_call(batch, mask, q, k, v, o, lse, dout, dq, dk, dv, nullptr, workspace);
  }
  /// The causal backward.
  void backward(const DocumentBatch& batch, ThdView<const value_type> q, ThdView<const value_type> k,
                ThdView<const value_type> v, ThdView<const value_type> o, LseView<const accum_type> lse,
                ThdView<const value_type> dout, ThdView<value_type> dq, ThdView<value_type> dk, ThdView<value_type> dv,
                std::span<std::byte> workspace = {}) {
    backward_call(batch, {}, q, k, v, o, lse, dout, dq, dk, dv, nullptr, workspace);
  }

  /// The backward with attention sinks: o and lse as the sinks' forward returned them; `dsinks` (Hq
  /// values in the context's memory) is overwritten with the sinks' gradient summed over every rank.
  /// dsinks is an output like dq: sharing memory with any input or output is refused, naming both; so is
  /// sinks inside dq, dk or dv (and, forward, inside o or lse).
  ///
  /// Sinks on one pass only: the backward without sinks after a forward with them is meaningful (the
  /// kernels' backward of the sink-applied O and LSE gives dQ, dK, dV exactly, the sinks held constant:
  /// frozen sinks) and is accepted; a backward with sinks after a forward of the batch and mask without
  /// them is refused, naming `sinks` (O and LSE lack the sinks' term: dsinks would be the gradient of a
  /// softmax that never ran).
  void backward(const DocumentBatch& batch, AttentionMask mask, ThdView<const value_type> q,
                ThdView<const value_type> k, ThdView<const value_type> v, ThdView<const value_type> o,
                LseView<const accum_type> lse, ThdView<const value_type> dout, ThdView<value_type> dq,
                ThdView<value_type> dk, ThdView<value_type> dv, std::span<const accum_type> sinks,
                std::span<accum_type> dsinks, std::span<std::byte> workspace = {}) {
    const SinkCall call{sinks, dsinks};
    backward_call(batch, mask, q, k, v, o, lse, dout, dq, dk, dv, &call, workspace);
  }
  void backward(const DocumentBatch& batch, ThdView<const value_type> q, ThdView<const value_type> k,
                ThdView<const value_type> v, ThdView<const value_type> o, LseView<const accum_type> lse,
                ThdView<const value_type> dout, ThdView<value_type> dq, ThdView<value_type> dk, ThdView<value_type> dv,
                std::span<const accum_type> sinks, std::span<accum_type> dsinks, std::span<std::byte> workspace = {}) {
    const SinkCall call{sinks, dsinks};
    backward_call(batch, {}, q, k, v, o, lse, dout, dq, dk, dv, &call, workspace);
  }

  /// What a caller above the engine (ChunkedAttention) adds to a call's one agreement: its own words
  /// (first, so that a disagreement on them is named before the engine's) and its own local refusal.
  /// No allocation: a function pointer and its context.
  struct CallExtension {
    void (*add_words)(const void* context, Agreement& agreement) = nullptr;
    const void* context = nullptr;
    std::exception_ptr refused;
  };

  /// One (batch, mask) plan of the cache, lowered for the executor.
  struct Cached {
    std::vector<std::int64_t> key;
    AttentionMask mask;
    ShardPlan plan;
    comm::CompiledAttention program;
    Executor forward, backward;              // the programs, lowered
    Status forward_kernel, backward_kernel;  // the kernel's can_implement of each (local, once per entry)
    std::vector<int> grouping;               // the placement's groups, flattened: its LevelTransports key
    LevelTransports::Levels levels;          // set by connect (a collective step: after the agreement)
  };

 protected:
  /// `compiler` places and compiles for the strategy (held shared: plan_ahead's thread holds it too).
  template <Transport Tr>
  AttentionEngine(Tr& transport, const AttentionShape& shape, int ranks_per_node,
                  std::shared_ptr<const PlanCompiler> compiler, Kernel kernel)
      : world_(transport),
        shape_(validated(shape)),
        kernel_(std::move(kernel)),
        exec_(kernel_.exec()),
        topology_(topology_of(world_.size(), ranks_per_node)),
        cache_(std::move(compiler), shape_, topology_, world_.rank()),
        levels_(world_),
        order_(&transport),
        layer_(order_.index()) {
    static_assert(!StreamOrderedTransport<Tr> || StreamOrderedExec<exec_type>,
                  "DistributedAttention: a stream-ordered transport (NCCL) enqueues its transfers on the kernel's "
                  "streams, so it needs a kernel whose exec_type is a StreamOrderedExec (attention::CudaFlash on "
                  "gpu::CudaExec); with a host kernel use a host transport (in-process or MPI)");
  }

 private:
  using Checks = CallChecks<value_type, accum_type, exec_type>;
  struct SinkCall {
    std::span<const accum_type> sinks;
    std::span<accum_type> dsinks;
  };
  static constexpr std::size_t idx(comm::BufferId b) noexcept { return static_cast<std::size_t>(b); }
  // Sources are read, never written, by the programs; the executor's buffer table is uniform.
  static ThdView<value_type> mut(ThdView<const value_type> v) noexcept {
    return {const_cast<value_type*>(v.data), v.tokens, v.heads, v.head_dim, v.token_stride, v.head_stride};
  }
  template <attention::AttentionKernel>
  friend class ChunkedAttention;
  /// The world the engine runs on, and its kernel (ChunkedAttention's prefix programs use both).
  [[nodiscard]] AnyTransport& world() noexcept { return world_; }
  [[nodiscard]] Kernel& kernel() noexcept { return kernel_; }

  static AttentionShape validated(const AttentionShape& shape) {
    shape.validate("DistributedAttention");
    return shape;
  }
  static Topology topology_of(int world_size, int ranks_per_node) {
    seqpar::detail::require(ranks_per_node >= 0, "DistributedAttention", "args.ranks_per_node", ranks_per_node,
                            "must be >= 0 (0 = one node)");
    return Topology{world_size, ranks_per_node == 0 ? world_size : ranks_per_node};
  }

  void forward_call(const DocumentBatch& batch, AttentionMask mask, ThdView<const value_type> q,
                    ThdView<const value_type> k, ThdView<const value_type> v, ThdView<value_type> o,
                    LseView<accum_type> lse, const SinkCall* sinks, std::span<std::byte> workspace,
                    const CallExtension* extension = nullptr) {
    constexpr const char* where = "DistributedAttention::forward";
    const Guard guard(*this, "forward");
    Cached* found = nullptr;
    std::exception_ptr refused;
    try {  // every local check before the first message
      found = &checked_entry(where, batch, mask);
      require_kernel(where, found->forward_kernel);
      const std::int64_t n = found->plan.local_tokens(rank());
      check_rows(where, batch, n, q.tokens);
      Checks::forward_views(where, shape_, n, q, k, v, o, lse);
      Checks::not_input(where, "o", o, q, k, v);
      Checks::not_input(where, "lse", lse, q, k, v);
      seqpar::detail::check_disjoint(where, "lse", lse, "o", o);
      Checks::workspace(where, workspace, found->forward.workspace_bytes(), q, k, v, o, lse);
      if (sinks != nullptr) {
        SinkEpilogue<exec_type>::check(where, sinks->sinks, shape_.heads_q);
        // The sinks are read after o and lse are written (the epilogue): an input like q, k, v.
        seqpar::detail::check_disjoint(where, "o", o, "sinks", sinks->sinks);
        seqpar::detail::check_disjoint(where, "lse", lse, "sinks", sinks->sinks);
        seqpar::detail::check_disjoint(where, "workspace", workspace, "sinks", sinks->sinks);
      }
    } catch (const std::exception&) {
      refused = std::current_exception();
    }
    agree(batch, mask, 0, sinks, refused, extension);
    Cached& e = connect(*found);
    typename Executor::Buffers b;
    b.thd[idx(comm::BufferId::kQ)] = mut(q);
    b.thd[idx(comm::BufferId::kK)] = mut(k);
    b.thd[idx(comm::BufferId::kV)] = mut(v);
    b.thd[idx(comm::BufferId::kO)] = o;
    b.lse[idx(comm::BufferId::kLse)] = lse;
    run(e, e.forward, b, workspace);
    if (sinks != nullptr) SinkEpilogue<exec_type>::forward(exec_, o, lse, sinks->sinks);
    checks_.remember_forward(batch.fingerprint(), mask, o, lse);  // what backward will be handed
    if (extension == nullptr) checks_.remember_forward_ran(batch.fingerprint(), mask, sinks != nullptr);
  }

  void backward_call(const DocumentBatch& batch, AttentionMask mask, ThdView<const value_type> q,
                     ThdView<const value_type> k, ThdView<const value_type> v, ThdView<const value_type> o,
                     LseView<const accum_type> lse, ThdView<const value_type> dout, ThdView<value_type> dq,
                     ThdView<value_type> dk, ThdView<value_type> dv, const SinkCall* sinks,
                     std::span<std::byte> workspace, const CallExtension* extension = nullptr) {
    constexpr const char* where = "DistributedAttention::backward";
    const Guard guard(*this, "backward");
    Cached* found = nullptr;
    std::exception_ptr refused;
    try {  // every local check before the first message
      found = &checked_entry(where, batch, mask);
      require_kernel(where, found->backward_kernel);
      const std::int64_t n = found->plan.local_tokens(rank());
      check_rows(where, batch, n, q.tokens);
      Checks::forward_views(where, shape_, n, q, k, v, o, lse);
      seqpar::detail::check_view(dout, where, "dout", n, shape_.heads_q, shape_.v_dim());
      seqpar::detail::check_view(dq, where, "dq", n, shape_.heads_q, shape_.qk_dim());
      seqpar::detail::check_view(dk, where, "dk", n, shape_.heads_kv, shape_.qk_dim());
      seqpar::detail::check_view(dv, where, "dv", n, shape_.heads_kv, shape_.v_dim());
      // dq, dk, dv are written while every input (and one another) is still read.
      const char* const outs[] = {"dq", "dk", "dv"};
      const ThdView<value_type> out_views[] = {dq, dk, dv};
      for (std::size_t i = 0; i < 3; ++i) {
        Checks::not_input(where, outs[i], out_views[i], q, k, v);
        for (std::size_t j = 0; j < i; ++j)
          seqpar::detail::check_disjoint(where, outs[i], out_views[i], outs[j], out_views[j]);
        seqpar::detail::check_disjoint(where, outs[i], out_views[i], "o", o);
        seqpar::detail::check_disjoint(where, outs[i], out_views[i], "dout", dout);
        seqpar::detail::check_disjoint(where, outs[i], out_views[i], "lse", lse);
      }
      Checks::workspace(where, workspace, found->backward.workspace_bytes(), q, k, v, o, lse, dout, dq, dk, dv);
      if (sinks != nullptr) {
        SinkEpilogue<exec_type>::check(where, sinks->sinks, shape_.heads_q, sinks->dsinks, true);
        // dsinks is an output like dq, dk, dv (written after them, while o, lse, dout and sinks are read);
        // sinks an input they may not overwrite.
        for (std::size_t i = 0; i < 3; ++i) {
          seqpar::detail::check_disjoint(where, outs[i], out_views[i], "sinks", sinks->sinks);
          seqpar::detail::check_disjoint(where, "dsinks", sinks->dsinks, outs[i], out_views[i]);
        }
        seqpar::detail::check_disjoint_from(where, "dsinks", sinks->dsinks, "q", q, "k", k, "v", v, "o", o, "lse", lse,
                                            "dout", dout, "sinks", sinks->sinks, "workspace", workspace);
        seqpar::detail::check_disjoint(where, "workspace", workspace, "sinks", sinks->sinks);
      }
      checks_.forward_of(where, batch.fingerprint(), mask, o, lse);
      // A caller above the engine (ChunkedAttention) keeps its own order checks per chunk.
      if (extension == nullptr) checks_.forward_ran(where, batch.fingerprint(), mask, sinks != nullptr);
    } catch (const std::exception&) {
      refused = std::current_exception();
    }
    agree(batch, mask, 1, sinks, refused, extension);
    Cached& e = connect(*found);
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

  // Everything the call depends on, compared across ranks before any data moves (runtime/agreement.hpp).
  static constexpr std::size_t kArgumentWords = 24;  // compared by name; the rest by a hash of them
  void agree(const DocumentBatch& batch, AttentionMask mask, int pass, const SinkCall* sinks,
             std::exception_ptr refused, const CallExtension* extension) {
    const PlanCompiler& compiler = cache_.compiler();
    Agreement a("DistributedAttention");
    if (extension != nullptr) {
      extension->add_words(extension->context, a);
      if (extension->refused) refused = extension->refused;  // the caller's own check names its argument
    }
    a.add("the call (0 = forward, 1 = backward)", std::int64_t{pass});
    a.add("the element type (value bytes, value significand bits, accumulation bytes: BBSSAA)",
          element_code<value_type, accum_type>());
    a.add("the layer (the order this rank made its attention objects on the transport, or set_layer's)", layer_,
          Agreement::kHash);
    a.add("whether the call has attention sinks (0 = no, 1 = yes)", std::int64_t{sinks != nullptr ? 1 : 0});
    a.add("the batch's total tokens", batch.total_tokens());
    a.add("the batch's document count", static_cast<std::int64_t>(batch.documents().size()));
    a.add("the batch's document lengths (fingerprint)", batch.fingerprint(), Agreement::kHash);
    a.add("the call's mask (sliding window, 0 = causal)", mask.window);
    a.add("the mask mix the placement is balanced for (fingerprint)", compiler.masks().fingerprint(), Agreement::kHash);
    a.add("shape.heads_q", std::int64_t{shape_.heads_q});
    a.add("shape.heads_kv", std::int64_t{shape_.heads_kv});
    a.add("shape.head_dim", std::int64_t{shape_.head_dim});
    a.add("shape.head_dim_v", std::int64_t{shape_.v_dim()});
    a.add("shape.softmax_scale", shape_.scale());
    a.add("the strategy (type or ranks_per_node)", compiler.signature(), Agreement::kHash);
    const auto words = compiler.argument_words();
    Hash64 rest;
    for (std::size_t i = 0; i < words.size(); ++i) {
      if (i >= kArgumentWords) {
        rest.add(words[i].value);
        continue;
      }
      if (words[i].is_double)
        a.add(words[i].name, words[i].value, Agreement::kDouble);
      else
        a.add(words[i].name, static_cast<std::int64_t>(words[i].value));
    }
    a.add("the strategy's arguments (hash)", rest.value(), Agreement::kHash);
    a.add("the attention sinks' values (fingerprint; 0: not compared)", sinks_fingerprint(sinks, refused),
          Agreement::kHash);
    a.run(world_, refused, agreed_);
  }

  // The sinks are a replicated parameter: a copy out of sync on one rank would give that rank's rows
  // another softmax. Compared by value where the host can read them (host contexts).
  std::uint64_t sinks_fingerprint(const SinkCall* sinks, const std::exception_ptr& refused) const noexcept {
    if constexpr (exec_type::kHostSynchronous) {
      if (sinks == nullptr || refused || sinks->sinks.data() == nullptr) return 0;
      Hash64 h;
      for (const accum_type s : sinks->sinks) h.add(std::bit_cast<std::uint64_t>(static_cast<double>(s)));
      return h.value();
    } else {
      (void)sinks;
      (void)refused;
      return 0;
    }
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

  // q's rows against this rank's share of the batch, refused with the plan the rows were expected from
  // and, when a batch this object placed before gives this rank that many rows, that batch: rows laid
  // out for another batch (of the same token count, too) are the usual cause. The rows do not depend on
  // the call's mask (one placement per batch serves every layer). Builds its message only when it refuses.
  void check_rows(const char* where, const DocumentBatch& batch, std::int64_t expected, std::int64_t rows) const {
    if (rows == expected) return;
    const int me = world_.rank();
    const auto describe = [](std::uint64_t fingerprint, std::int64_t tokens, std::int64_t documents) {
      return "fingerprint " + std::to_string(fingerprint) + ": " + std::to_string(tokens) + " tokens in " +
             std::to_string(documents) + " documents";
    };
    std::string why =
        "expected " + std::to_string(expected) + ", the rows rank " + std::to_string(me) +
        " holds of this call's batch (" +
        describe(batch.fingerprint(), batch.total_tokens(), static_cast<std::int64_t>(batch.documents().size())) +
        ") as this strategy places it on " + std::to_string(world_.size()) + " ranks";
    std::string other;
    cache_.for_each_placement([&](const std::vector<std::int64_t>& key, const Placement& p) {
      if (!other.empty() || p.batch_fingerprint == batch.fingerprint() || p.world_size() <= me ||
          p.local_tokens(me) != rows)
        return;
      // key: the document offsets (documents + 1 words), -1, the sequence offsets, the total tokens.
      const auto cut = std::find(key.begin(), key.end(), std::int64_t{-1});
      other = describe(p.batch_fingerprint, key.back(), static_cast<std::int64_t>(cut - key.begin()) - 1);
    });
    if (!other.empty())
      why += "; " + std::to_string(rows) + " is what this rank holds of another batch this object placed (" + other +
             "): rows laid out for that batch? Pass the batch the rows were taken for (owned_ranges(batch))";
    else
      why += "; no batch this object placed gives this rank " + std::to_string(rows) +
             " rows: rows of another batch, strategy or world size, or not taken with owned_ranges(batch)";
    seqpar::detail::throw_invalid(where, "q.tokens", rows, why);
  }

  static void check_batch(const char* where, const DocumentBatch& batch) {
    seqpar::detail::require(batch.num_sequences() >= 1, where, "batch", "DocumentBatch{}",
                            "a default-constructed batch has no sequences (construct it from document lengths)");
  }
  const Placement& checked_placement(const char* where, const DocumentBatch& batch) {
    check_batch(where, batch);
    return cache_.placement(batch);
  }
  // The local checks of the batch and the mask, then its (local) plan and programs, lowered on a miss.
  Cached& checked_entry(const char* where, const DocumentBatch& batch, AttentionMask mask) {
    check_batch(where, batch);
    mask.validate(where);
    return cache_.entry(batch, mask, [this](Cached& e) {
      e.grouping = LevelTransports::grouping_of(e.plan);
      e.forward.initialize(e.program.forward, kernel_);
      e.backward.initialize(e.program.backward, kernel_);
      e.forward_kernel = kernel_status(e.forward);
      e.backward_kernel = kernel_status(e.backward);
    });
  }

  // The entry's level transports (splits of the world on a miss of its grouping: collective, so only
  // after the agreement, when every rank runs the same batch).
  Cached& connect(Cached& e) {
    const std::uint64_t before = e.levels.serial;
    levels_.connect(e.grouping, e.plan, e.program, e.levels);
    if (e.levels.serial == before) return e;
    // An eagerly buffering transport holds at most what one run receives: room for it now, so that
    // steady-state calls allocate nothing whatever the threads' timing.
    AnyTransport* const levels[] = {e.levels.group, e.levels.inner, e.levels.outer};
    for (std::size_t l = 0; l < comm::kNumLevels; ++l)
      if (levels[l] != nullptr)
        levels[l]->reserve_receives(std::max(e.forward.lowered().receives[l], e.backward.lowered().receives[l]),
                                    static_cast<std::size_t>(std::max(e.forward.lowered().largest_receive[l],
                                                                      e.backward.lowered().largest_receive[l])));
    return e;
  }

  void run(Cached& e, Executor& executor, typename Executor::Buffers& b, std::span<std::byte> workspace) {
    const std::size_t need = executor.workspace_bytes();
    if (workspace.data() == nullptr) {
      if (workspace_.size() < need) workspace_ = DataOps<exec_type>::allocate(exec_, need);  // only on a cache miss
      workspace = workspace_.span();
    }
    const typename Executor::Levels levels{e.levels.group, e.levels.inner, e.levels.outer};
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
  PlanCache<Cached> cache_;
  LevelTransports levels_;
  Checks checks_;
  typename DataOps<exec_type>::Workspace workspace_;  // in the context's memory
  std::uint64_t last_bytes_sent_ = 0;
  std::vector<Agreement::Record> agreed_;  // the agreement's gathered records (grown once)
  SinkEpilogue<exec_type> sink_epilogue_;  // its gather buffer, grown on the first call with sinks
  std::atomic<bool> busy_{false};
  LayerOrder order_;         // this object's place among those made on its transport (runtime/layer_order.hpp)
  std::uint64_t layer_ = 0;  // the layer word of every agreement: order_.index() unless set_layer named it
};

}  // namespace seqpar::runtime
