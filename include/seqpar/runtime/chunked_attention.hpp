// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// `runtime::ChunkedAttention`: runs a batch chunk by chunk (a scheduler's chunks, e.g.
/// DynamicChunk's) over any strategy, exactly. A chunk's own attention is the strategy's (the chunk
/// batch is planned and run like any batch); a piece with a prefix (a split document's later slice)
/// also attends, with a full mask, to its document's earlier tokens, which earlier chunks left on the
/// ranks that held them (the *carry*: K/V rows kept after their chunk's forward, not recomputed).
/// With a sliding window (the chunk batches' `window()`, e.g. DynamicChunk of `batch.with_window(w)`),
/// the chunk's own attention is the strategy's windowed attention and the prefix term sees only the
/// keys inside each query's window: the carry keeps and moves at most the w - 1 rows before each piece.
/// The carry moves as `comm::Program`s (comm::ChunkCarry) compiled once per chunk plan and run by
/// the same `runtime::Executor` as the strategy's programs, on the same transport and execution
/// context: the transports count their bytes against what the programs declare, a failure names the
/// chunk and the step, steady-state calls allocate nothing, and the replay prices what runs.
/// Backward runs the chunks in reverse: the strategy's gradients, plus the prefix term's dQ, and its
/// dK/dV sent back to the ranks that hold the prefix rows, accumulated there and added to those rows'
/// gradients when their own chunk's backward runs. The result is attention over the whole batch.
///
/// Every rank calls `begin` with the same chunks, then `forward(c)` and `backward(c)` in the same
/// order: a chunk's forward after the forwards of the chunks its prefixes read, its backward after its
/// forward and after the backwards of the chunks that read it (a split document goes backward last
/// slice first; 1F1B interleaves the rest, schedule/pipeline.hpp), with the chunk's local rows
/// (`owned_global(c)`: the global tokens of the batch they hold, in row order). The carry lives in
/// the execution context's memory (host, or the GPU for CudaExec) and holds the K/V of the prefix rows
/// this rank owns. The last chunk plan stays compiled: `begin` with the same chunks recompiles nothing.
///
/// @code
/// DistributedAttention<Strategy<Zigzag, Ring>, attention::CpuFlash<float>> attn(t, shape);
/// runtime::ChunkedAttention<attention::CpuFlash<float>> chunked(attn, t);
/// chunked.begin(schedule::DynamicChunk{{.token_capacity = 4096}}.chunks(batch));
/// for (int c = 0; c < chunked.num_chunks(); ++c) chunked.forward(c, q[c], k[c], v[c], o[c], lse[c]);
/// for (int c = chunked.num_chunks() - 1; c >= 0; --c) chunked.backward(c, ...);
/// @endcode

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "seqpar/attention/kernel.hpp"
#include "seqpar/comm/chunk_carry.hpp"
#include "seqpar/comm/program.hpp"
#include "seqpar/core/chunk.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/range.hpp"
#include "seqpar/core/status.hpp"
#include "seqpar/core/tensor.hpp"
#include "seqpar/runtime/any_transport.hpp"
#include "seqpar/runtime/data_ops.hpp"
#include "seqpar/runtime/engine.hpp"
#include "seqpar/runtime/executor.hpp"
#include "seqpar/runtime/sink_epilogue.hpp"

namespace seqpar::runtime {

template <attention::AttentionKernel Kernel>
class ChunkedAttention {
 public:
  using value_type = typename Kernel::value_type;
  using accum_type = typename Kernel::accum_type;
  using exec_type = typename Kernel::exec_type;
  using T = value_type;
  using A = accum_type;

  /// `attention` runs each chunk; `transport` is the world it runs on (the same ranks); `kernel`
  /// computes the prefix terms on this rank, on the attention's execution context.
  template <Transport Tr>
  ChunkedAttention(AttentionEngine<Kernel>& attention, Tr& transport, Kernel kernel = {})
      : attention_(attention), world_(transport), kernel_(std::move(kernel)) {
    seqpar::detail::require(
        world_.size() == attention_.topology().world_size, "ChunkedAttention", "transport.size()", world_.size(),
        "must equal the attention's world size " + std::to_string(attention_.topology().world_size));
  }

  /// Starts a batch. Every rank passes the same chunks (checked), in the order they will run. Local
  /// checks first; a rank that refuses its chunks makes its peers fail with Errc::kPeerFailed.
  void begin(std::vector<Chunk> chunks) {
    constexpr const char* where = "ChunkedAttention::begin";
    const std::uint64_t fingerprint = fingerprint_of(chunks);
    std::exception_ptr refused;
    try {  // every local check, and the compilation on a new chunk plan, before the first message
      for (std::size_t c = 0; c < chunks.size(); ++c)
        if (chunks[c].prefix.size() != chunks[c].tokens.size())  // (no message built on the good path)
          seqpar::detail::throw_invalid(where, "chunks[" + std::to_string(c) + "].prefix.size()",
                                        chunks[c].prefix.size(),
                                        "must equal tokens.size() = " + std::to_string(chunks[c].tokens.size()));
      if (!plan_ || !same_chunks(chunks, chunks_)) compile(std::move(chunks));
    } catch (const std::exception&) {
      refused = std::current_exception();
      plan_.reset();
      chunks_.clear();
      programs_.clear();
    }
    fingerprint_ = fingerprint;
    agree(where, fingerprint, -1, -1, false, refused);
    std::fill(forward_done_.begin(), forward_done_.end(), false);
    std::fill(backward_done_.begin(), backward_done_.end(), false);
    run(-1, "clear", clear_, bind_carry({}));
  }

  [[nodiscard]] int num_chunks() const noexcept { return static_cast<int>(chunks_.size()); }
  [[nodiscard]] const Chunk& chunk(int c) const { return chunks_.at(static_cast<std::size_t>(c)); }
  /// Rows this rank holds of chunk c.
  [[nodiscard]] std::int64_t local_tokens(int c) const { return carry().local_tokens(c, world_.rank()); }
  /// Global tokens of the batch this rank's rows of chunk c hold, in row order.
  [[nodiscard]] const std::vector<Range>& owned_global(int c) const { return carry().owned(c, world_.rank()); }
  /// Rows of prefix K/V this rank keeps for later chunks.
  [[nodiscard]] std::int64_t carry_rows() const noexcept { return plan_ ? plan_->carry_rows(world_.rank()) : 0; }
  /// The compiled carry of the current chunks (every rank's programs; for the replay and tests).
  [[nodiscard]] const comm::ChunkCarry& carry() const {
    if (!plan_) throw std::logic_error("ChunkedAttention: call begin first");
    return *plan_;
  }
  /// This rank's prefix programs of chunk c (forward, recompute, backward).
  [[nodiscard]] const comm::Program& program(int c, int pass) const {
    const Programs& p = programs_.at(static_cast<std::size_t>(c));
    return pass == 0 ? p.forward : pass == 1 ? p.recompute : p.backward;
  }
  /// Bytes the transport counted for this rank during the last call's prefix program.
  [[nodiscard]] std::uint64_t last_bytes_sent() const noexcept { return last_bytes_sent_; }

  void forward(int c, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v, ThdView<T> o, LseView<A> lse) {
    forward_call(c, q, k, v, o, lse, nullptr);
  }
  /// With attention sinks (attention/sinks.hpp): applied to the chunk's rows once they hold every key
  /// (after the prefix merge), as DistributedAttention does for a whole batch.
  void forward(int c, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v, ThdView<T> o, LseView<A> lse,
               std::span<const A> sinks) {
    forward_call(c, q, k, v, o, lse, &sinks);
  }

  /// Chunk c's forward again, for activation checkpointing (a pipeline stage recomputes a layer
  /// before its backward): the same (O, LSE) bit for bit, collective like `forward`. Allowed after
  /// the chunk's forward and before its backward. The prefix K/V it reads is still in the carry (a
  /// chunk that reads it goes backward first, and the carry lives until the next `begin`); the chunk's
  /// own K/V rows are kept already and are not copied again.
  void recompute(int c, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v, ThdView<T> o, LseView<A> lse) {
    recompute_call(c, q, k, v, o, lse, nullptr);
  }
  void recompute(int c, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v, ThdView<T> o, LseView<A> lse,
                 std::span<const A> sinks) {
    recompute_call(c, q, k, v, o, lse, &sinks);
  }

  void backward(int c, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v, ThdView<const T> o,
                LseView<const A> lse, ThdView<const T> dout, ThdView<T> dq, ThdView<T> dk, ThdView<T> dv) {
    backward_call(c, q, k, v, o, lse, dout, dq, dk, dv, nullptr, {});
  }
  /// With attention sinks: o and lse as the sinks' forward left them; `dsinks` (Hq values in the
  /// context's memory) overwritten with the sinks' gradient over this chunk's rows on every rank.
  void backward(int c, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v, ThdView<const T> o,
                LseView<const A> lse, ThdView<const T> dout, ThdView<T> dq, ThdView<T> dk, ThdView<T> dv,
                std::span<const A> sinks, std::span<A> dsinks) {
    backward_call(c, q, k, v, o, lse, dout, dq, dk, dv, &sinks, dsinks);
  }

 private:
  void forward_call(int c, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v, ThdView<T> o, LseView<A> lse,
                    const std::span<const A>* sinks) {
    constexpr const char* where = "ChunkedAttention::forward";
    std::exception_ptr refused;
    try {  // local checks; then every rank compares what it is about to run
      check_chunk(c, where);
      seqpar::detail::require(!forward_done_[static_cast<std::size_t>(c)], where, "c", c, "ran forward already");
      for (int e : carry().reads(c))
        if (e != c && !forward_done_[static_cast<std::size_t>(e)])  // (messages built only when thrown)
          seqpar::detail::throw_invalid(
              where, "c", c, "reads the prefix rows of chunk " + std::to_string(e) + ", whose forward has not run");
      if (sinks != nullptr) SinkEpilogue<exec_type>::check(where, *sinks, attention_.shape().heads_q);
    } catch (const std::exception&) {
      refused = std::current_exception();
    }
    agree(where, fingerprint_, c, 0, sinks != nullptr, refused);
    run_forward(c, q, k, v, o, lse, true, sinks);
  }

  void recompute_call(int c, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v, ThdView<T> o, LseView<A> lse,
                      const std::span<const A>* sinks) {
    constexpr const char* where = "ChunkedAttention::recompute";
    std::exception_ptr refused;
    try {
      check_chunk(c, where);
      const auto ci = static_cast<std::size_t>(c);
      seqpar::detail::require(forward_done_[ci] && !backward_done_[ci], where, "c", c,
                              backward_done_[ci] ? "ran backward already" : "has not run forward");
      if (sinks != nullptr) SinkEpilogue<exec_type>::check(where, *sinks, attention_.shape().heads_q);
    } catch (const std::exception&) {
      refused = std::current_exception();
    }
    agree(where, fingerprint_, c, 1, sinks != nullptr, refused);
    run_forward(c, q, k, v, o, lse, false, sinks);
  }

  void backward_call(int c, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v, ThdView<const T> o,
                     LseView<const A> lse, ThdView<const T> dout, ThdView<T> dq, ThdView<T> dk, ThdView<T> dv,
                     const std::span<const A>* sinks, std::span<A> dsinks) {
    constexpr const char* where = "ChunkedAttention::backward";
    std::exception_ptr refused;
    try {
      check_chunk(c, where);
      const auto ci = static_cast<std::size_t>(c);
      seqpar::detail::require(forward_done_[ci] && !backward_done_[ci], where, "c", c,
                              backward_done_[ci] ? "ran backward already" : "has not run forward");
      // Every chunk that reads this chunk's rows as prefix sends their gradients back in its backward.
      for (int e = 0; e < num_chunks(); ++e)
        if (e != c)
          for (int r : carry().reads(e))
            if (r == c && !backward_done_[static_cast<std::size_t>(e)])
              seqpar::detail::throw_invalid(where, "c", c,
                                            "chunk " + std::to_string(e) +
                                                " reads its rows as prefix and must run backward first (a split "
                                                "document goes backward last slice first)");
      if (sinks != nullptr) SinkEpilogue<exec_type>::check(where, *sinks, attention_.shape().heads_q, dsinks, true);
    } catch (const std::exception&) {
      refused = std::current_exception();
    }
    agree(where, fingerprint_, c, 2, sinks != nullptr, refused);
    const auto ci = static_cast<std::size_t>(c);
    attention_.backward(chunks_[ci].batch, q, k, v, o, lse, dout, dq, dk, dv);
    backward_done_[ci] = true;
    Buffers b = bind_carry({});
    b.thd[idx(BufferId::kQ)] = mut(q);
    b.thd[idx(BufferId::kK)] = mut(k);
    b.thd[idx(BufferId::kV)] = mut(v);
    b.thd[idx(BufferId::kO)] = mut(o);
    b.lse[idx(BufferId::kLse)] = {const_cast<A*>(lse.data), lse.heads, lse.tokens, lse.head_stride};
    b.thd[idx(BufferId::kDout)] = mut(dout);
    b.thd[idx(BufferId::kDq)] = dq;
    b.thd[idx(BufferId::kDk)] = dk;
    b.thd[idx(BufferId::kDv)] = dv;
    run(c, "prefix backward", programs_[ci].bwd, b);
    if (sinks != nullptr) sink_epilogue_.backward(attention_.exec(), world_, dout, o, lse, *sinks, dsinks);
  }

  using BufferId = comm::BufferId;
  using Exec = Executor<Kernel, AnyTransport>;
  using Buffers = typename Exec::Buffers;
  using Ops = DataOps<exec_type>;

  // One chunk's prefix programs and their lowered forms.
  struct Programs {
    comm::Program forward, recompute, backward;
    Exec fwd, rec, bwd;
  };

  static constexpr std::size_t idx(BufferId b) noexcept { return static_cast<std::size_t>(b); }
  static ThdView<T> mut(ThdView<const T> v) noexcept {
    return {const_cast<T*>(v.data), v.tokens, v.heads, v.head_dim, v.token_stride, v.head_stride};
  }

  void check_chunk(int c, const char* where) const {
    if (c < 0 || c >= num_chunks())
      seqpar::detail::throw_invalid(where, "c", c,
                                    "must be in [0, num_chunks()) = [0, " + std::to_string(num_chunks()) + ")");
  }

  // The strategy's forward of chunk c, then its prefix program (keep, exchange, merge).
  void run_forward(int c, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v, ThdView<T> o, LseView<A> lse,
                   bool keep, const std::span<const A>* sinks) {
    const auto ci = static_cast<std::size_t>(c);
    attention_.forward(chunks_[ci].batch, q, k, v, o, lse);
    forward_done_[ci] = true;
    Buffers b = bind_carry({});
    b.thd[idx(BufferId::kQ)] = mut(q);
    b.thd[idx(BufferId::kK)] = mut(k);
    b.thd[idx(BufferId::kV)] = mut(v);
    b.thd[idx(BufferId::kO)] = o;
    b.lse[idx(BufferId::kLse)] = lse;
    run(c, keep ? "prefix forward" : "prefix recompute", keep ? programs_[ci].fwd : programs_[ci].rec, b);
    if (sinks != nullptr) SinkEpilogue<exec_type>::forward(attention_.exec(), o, lse, *sinks);
  }

  Buffers bind_carry(Buffers b) {
    const AttentionShape& s = attention_.shape();
    const std::int64_t rows = carry_rows();
    const comm::HeadWidths widths{s.qk_dim(), s.v_dim()};
    for (int i = 0; i < 4; ++i) {  // kKCarry, kVCarry, kDkCarry, kDvCarry
      const auto id = static_cast<BufferId>(static_cast<int>(BufferId::kKCarry) + i);
      b.thd[idx(id)] = ThdView<T>::dense(
          reinterpret_cast<T*>(carry_mem_.span().data() + static_cast<std::size_t>(i) * carry_stride_), rows,
          s.heads_kv, widths.of(id));
    }
    return b;
  }

  // Runs one lowered program on the world; a failure names the chunk and the pass (the executor adds
  // the rank and the step).
  void run(int c, const char* pass, Exec& ex, const Buffers& b) {
    last_bytes_sent_ = 0;
    if (ex.lowered().ops.empty()) return;
    const std::uint64_t before = world_.counters().bytes_sent;
    const typename Exec::Levels levels{&world_, nullptr, nullptr};
    try {
      ex.run(levels, kernel_, attention_.exec(), b, workspace_.span());
    } catch (const Error& e) {
      throw Error(e.code(), "ChunkedAttention: chunk " + std::to_string(c) + " (" + pass + "): " + e.detail());
    }
    last_bytes_sent_ = world_.counters().bytes_sent - before;
  }

  // Plans every chunk with the strategy (local), compiles and lowers every prefix program, and sizes
  // the carry and the workspace: the only place that allocates.
  void compile(std::vector<Chunk> chunks) {
    const int ranks = world_.size(), me = world_.rank();
    std::vector<std::vector<std::vector<Range>>> owned(chunks.size());
    for (std::size_t c = 0; c < chunks.size(); ++c) {
      const ShardPlan& plan = attention_.plan(chunks[c].batch);
      for (int r = 0; r < ranks; ++r)
        owned[c].push_back(comm::ChunkCarry::to_global(chunks[c], plan.owned[static_cast<std::size_t>(r)]));
    }
    plan_.reset();
    chunks_.clear();
    plan_ = std::make_unique<comm::ChunkCarry>(chunks, std::move(owned), attention_.shape());
    chunks_ = std::move(chunks);
    programs_ = std::vector<Programs>(chunks_.size());
    std::size_t need = 0;
    const auto lower = [&](Exec& ex, const comm::Program& p) {
      ex.initialize(p, kernel_);
      need = std::max(need, ex.workspace_bytes());
      // The prefix calls' shapes (all heads, the attention's scale), asked before any message.
      if (Status s = ex.can_implement(kernel_, attention_.exec()); !s)
        throw std::invalid_argument("ChunkedAttention::begin: the kernel cannot run a prefix term: " + s.reason);
    };
    for (int c = 0; c < num_chunks(); ++c) {
      Programs& p = programs_[static_cast<std::size_t>(c)];
      p.forward = plan_->forward(c, me, true);
      p.recompute = plan_->forward(c, me, false);
      p.backward = plan_->backward(c, me);
      lower(p.fwd, p.forward);
      lower(p.rec, p.recompute);
      lower(p.bwd, p.backward);
    }
    lower(clear_, plan_->clear(me));
    if (workspace_.size() < need) workspace_ = Ops::allocate(attention_.exec(), need);
    const AttentionShape& s = attention_.shape();
    const auto bytes = static_cast<std::size_t>(carry_rows()) * static_cast<std::size_t>(s.heads_kv) *
                       static_cast<std::size_t>(std::max(s.qk_dim(), s.v_dim())) * sizeof(T);  // K or V rows
    carry_stride_ = (bytes + 63) / 64 * 64;
    if (carry_mem_.size() < 4 * carry_stride_) carry_mem_ = Ops::allocate(attention_.exec(), 4 * carry_stride_);
    forward_done_.assign(chunks_.size(), false);
    backward_done_.assign(chunks_.size(), false);
  }

  static bool same_chunks(const std::vector<Chunk>& a, const std::vector<Chunk>& b) {
    if (a.size() != b.size()) return false;
    for (std::size_t c = 0; c < a.size(); ++c) {
      const DocumentBatch &x = a[c].batch, &y = b[c].batch;
      if (a[c].tokens != b[c].tokens || a[c].prefix != b[c].prefix || x.num_sequences() != y.num_sequences() ||
          x.window() != y.window() || !std::ranges::equal(x.cu_seqlens(), y.cu_seqlens()))
        return false;
      for (int s = 0; s < x.num_sequences(); ++s)
        if (x.sequence(s).begin != y.sequence(s).begin) return false;
    }
    return true;
  }

  // What every rank is about to run, compared before anything else: a fingerprint of the chunks'
  // ranges, the chunk and the pass of the call (-1 in begin), and whether this rank accepted its
  // arguments (else the start of its reason). Per call, it catches ranks that run different chunks of
  // the same shape, which the strategy's own agreement (on the chunk batch's shape) cannot tell apart.
  struct Signature {
    std::uint64_t chunks = 0;
    std::int32_t chunk = 0, pass = 0, sinks = 0;
    std::int32_t refused = 0;
    char reason[200] = {};
  };

  static std::uint64_t fingerprint_of(const std::vector<Chunk>& chunks) noexcept {
    std::uint64_t h = 1469598103934665603ull;
    const auto mix = [&](std::int64_t x) { h = (h ^ static_cast<std::uint64_t>(x)) * 1099511628211ull; };
    mix(static_cast<std::int64_t>(chunks.size()));
    for (const Chunk& c : chunks) {
      for (const Range& r : c.tokens) mix(r.begin), mix(r.end);
      mix(-1);
      for (const Range& r : c.prefix) mix(r.begin), mix(r.end);
      mix(-2);
      mix(c.batch.window());  // the same ranges under another window are other programs
    }
    return h;
  }

  void agree(const char* where, std::uint64_t fingerprint, int chunk, int pass, bool sinks,
             const std::exception_ptr& refused) {
    Signature mine;
    mine.chunks = fingerprint;
    mine.chunk = chunk;
    mine.pass = pass;
    mine.sinks = sinks ? 1 : 0;
    if (refused) {
      mine.refused = 1;
      try {
        std::rethrow_exception(refused);
      } catch (const std::exception& e) {
        std::strncpy(mine.reason, e.what(), sizeof(mine.reason) - 1);
      }
    }
    signatures_.resize(static_cast<std::size_t>(world_.size()));
    world_.all_gather(std::as_bytes(std::span(&mine, 1)), std::as_writable_bytes(std::span(signatures_)));
    if (refused) std::rethrow_exception(refused);
    const auto call = [](int c, int p) {
      return p < 0 ? std::string("begin")
                   : "chunk " + std::to_string(c) + " (" +
                         (p == 0   ? "forward"
                          : p == 1 ? "recompute"
                                   : "backward") +
                         ")";
    };
    for (int r = 0; r < world_.size(); ++r) {
      const Signature& other = signatures_[static_cast<std::size_t>(r)];
      if (other.refused != 0)
        throw Error(Errc::kPeerFailed, std::string(where) + ": rank " + std::to_string(r) + " refused its " +
                                           (chunk < 0 ? "chunks: " : "call: ") +
                                           std::string(other.reason, strnlen(other.reason, sizeof(other.reason))));
      if (other.chunks != mine.chunks)
        throw Error(Errc::kMismatch, std::string(where) + ": rank " + std::to_string(world_.rank()) + " and rank " +
                                         std::to_string(r) + " were given different chunks");
      if (other.chunk != mine.chunk || other.pass != mine.pass)
        throw Error(Errc::kMismatch, std::string(where) + ": rank " + std::to_string(world_.rank()) + " runs " +
                                         call(mine.chunk, mine.pass) + " and rank " + std::to_string(r) + " " +
                                         call(other.chunk, other.pass) +
                                         ": every rank must make the same calls in the same order");
      if (other.sinks != mine.sinks)
        throw Error(Errc::kMismatch, std::string(where) + ": rank " + std::to_string(world_.rank()) +
                                         (mine.sinks != 0 ? " passes" : " does not pass") +
                                         " attention sinks and rank " + std::to_string(r) +
                                         (other.sinks != 0 ? " does" : " does not"));
    }
  }

  AttentionEngine<Kernel>& attention_;
  AnyTransport world_;
  Kernel kernel_;
  std::vector<Chunk> chunks_;
  std::uint64_t fingerprint_ = 0;  // of chunks_, compared on every call
  std::unique_ptr<comm::ChunkCarry> plan_;
  std::vector<Programs> programs_;
  Exec clear_;
  typename Ops::Workspace workspace_, carry_mem_;  // in the execution context's memory
  SinkEpilogue<exec_type> sink_epilogue_;
  std::size_t carry_stride_ = 0;  // bytes of each of the four carry tensors (64-aligned)
  std::vector<Signature> signatures_;
  std::vector<bool> forward_done_, backward_done_;
  std::uint64_t last_bytes_sent_ = 0;
};

}  // namespace seqpar::runtime
