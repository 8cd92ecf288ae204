// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// `runtime::ChunkedAttention`: runs a batch chunk by chunk (a scheduler's chunks, e.g.
/// DynamicChunk's) over any strategy, exactly. A chunk's own attention is the strategy's (the chunk
/// batch is planned and run like any batch); a piece with a prefix (a split document's later slice)
/// also attends, with a full mask, to its document's earlier tokens, which earlier chunks left on the
/// ranks that held them (the *carry*: K/V rows kept after their chunk's forward, not recomputed).
/// The mask is the layer's, given to `begin` (a model's window and full layers each run their own
/// ChunkedAttention over the same chunks and the same rows): under a sliding window the chunk's own
/// attention is the strategy's windowed attention and the prefix term sees only the keys inside each
/// query's window, so the carry keeps and moves at most the w - 1 rows before each piece. The chunks'
/// placements are the attention's, made once per chunk batch for its mask mix, whatever the mask.
/// The carry moves as `comm::Program`s (comm::ChunkCarry) compiled once per chunk plan and run by
/// the same `runtime::Executor` as the strategy's programs, on the same transport and execution
/// context: the transports count their bytes against what the programs declare, a failure names the
/// chunk and the step, steady-state calls allocate nothing, and the replay prices what runs.
/// Backward runs the chunks in reverse: the strategy's gradients, plus the prefix term's dQ, and its
/// dK/dV sent back to the ranks that hold the prefix rows, accumulated there and added to those rows'
/// gradients when their own chunk's backward runs. The result is attention over the whole batch.
///
/// Every rank calls `begin` with the same chunks and mask, then `forward(c)` and `backward(c)` in the same
/// order: a chunk's forward after the forwards of the chunks its prefixes read, its backward after its
/// forward and after the backwards of the chunks that read it (a split document goes backward last
/// slice first; 1F1B interleaves the rest, schedule/pipeline.hpp), with the chunk's local rows
/// (`owned_global(c)`: the global tokens of the batch they hold, in row order). The carry lives in
/// the execution context's memory (host, or the GPU for CudaExec) and holds the K/V of the prefix rows
/// this rank owns. The last chunk plan stays compiled: `begin` with the same chunks and mask recompiles
/// nothing. Each call makes one agreement (the chunk plan's fingerprint, the chunk, the pass, then the
/// attention's own words), on the attention's transport, with the attention's kernel.
///
/// @code
/// DistributedAttention<Strategy<Zigzag, Ring>, attention::CpuFlash<float>> attn(t, shape);
/// runtime::ChunkedAttention<attention::CpuFlash<float>> chunked(attn);
/// chunked.begin(schedule::DynamicChunk{{.token_capacity = 4096}}.chunks(batch), AttentionMask::sliding_window(128));
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
#include "seqpar/core/attention_mask.hpp"
#include "seqpar/core/chunk.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/hash.hpp"
#include "seqpar/core/range.hpp"
#include "seqpar/core/status.hpp"
#include "seqpar/core/tensor.hpp"
#include "seqpar/runtime/agreement.hpp"
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

  /// `attention` runs each chunk on its transport; its kernel computes the prefix terms on this rank,
  /// on its execution context.
  explicit ChunkedAttention(AttentionEngine<Kernel>& attention) : attention_(attention) {}

  /// Starts a batch under the layer's `mask`. Every rank passes the same chunks and mask (checked), in
  /// the order they will run. Local checks first; a rank that refuses its chunks makes its peers fail
  /// with Errc::kPeerFailed.
  void begin(std::vector<Chunk> chunks, AttentionMask mask = {}) { begin_checked(nullptr, std::move(chunks), mask); }

  /// `begin`, and first the check that `chunks` are pieces of `batch` (local, O(documents)): every document
  /// of a chunk's batch lies, through the chunk's token ranges, inside one document of `batch`, starting
  /// at its first token or after a prefix that holds the keys before it that `mask` sees and nothing of
  /// another document. Chunks kept from another batch (of the same token count, too) or prefixes cut for
  /// another mask (a window's, run under a causal layer) are refused by name (std::invalid_argument naming
  /// the chunk and its piece; its peers Errc::kPeerFailed), instead of attending another batch's documents.
  void begin(const DocumentBatch& batch, std::vector<Chunk> chunks, AttentionMask mask = {}) {
    begin_checked(&batch, std::move(chunks), mask);
  }

  /// The check of begin(batch, chunks, mask) alone (local). Throws std::invalid_argument naming the chunk.
  static void check_chunks_of(const char* where, const DocumentBatch& batch, std::span<const Chunk> chunks,
                              AttentionMask mask) {
    const std::span<const std::int64_t> cu = batch.cu_seqlens();
    const auto show = [](const Range& r) { return "[" + std::to_string(r.begin) + ", " + std::to_string(r.end) + ")"; };
    const auto describe = [&] {
      return " (the chunks of another batch, of fingerprint other than this batch's " +
             std::to_string(batch.fingerprint()) + "? or prefixes cut for another mask than this layer's " +
             mask.to_string() + "?)";
    };
    for (std::size_t c = 0; c < chunks.size(); ++c) {
      const Chunk& ch = chunks[c];
      const std::string at = "chunks[" + std::to_string(c) + "]";
      seqpar::detail::require(ch.prefix.size() == ch.tokens.size(), where, at + ".prefix.size()", ch.prefix.size(),
                              "must equal tokens.size() = " + std::to_string(ch.tokens.size()));
      const std::span<const std::int64_t> local = ch.batch.cu_seqlens();
      std::int64_t offset = 0;  // the chunk batch's token where range i starts
      std::size_t i = 0;
      for (std::size_t j = 0; j + 1 < local.size(); ++j) {
        const std::int64_t begin_local = local[j], end_local = local[j + 1];
        while (i < ch.tokens.size() && begin_local >= offset + ch.tokens[i].size()) offset += ch.tokens[i++].size();
        if (i == ch.tokens.size() || end_local > offset + ch.tokens[i].size())
          seqpar::detail::throw_invalid(where, at + ".batch", ch.batch.total_tokens(),
                                        "a document of the chunk's batch is not inside one of its token ranges");
        const Range g{ch.tokens[i].begin + (begin_local - offset), ch.tokens[i].begin + (end_local - offset)};
        const std::ptrdiff_t found = std::upper_bound(cu.begin(), cu.end(), g.begin) - cu.begin() - 1;
        const auto d = static_cast<std::size_t>(std::max<std::ptrdiff_t>(found, 0));
        if (found < 0 || d + 1 >= cu.size() || g.end > cu[d + 1])
          seqpar::detail::throw_invalid(where, at + ".tokens[" + std::to_string(i) + "]", show(ch.tokens[i]),
                                        "holds tokens " + show(g) +
                                            " of one document of the chunk, which cross the end of the batch's "
                                            "document " +
                                            std::to_string(d) + describe());
        const Range before{cu[d], g.begin};  // the document's keys before the piece
        const Range seen = visible_prefix(before, mask.window);
        const bool first = begin_local == offset;  // the range's own prefix belongs to its first document
        const Range p = first ? ch.prefix[i] : Range{g.begin, g.begin};
        const bool holds = seen.empty() ? p.empty() || (p.begin >= before.begin && p.end == g.begin)
                                        : p.begin <= seen.begin && p.begin >= before.begin && p.end == g.begin;
        if (!holds)
          seqpar::detail::throw_invalid(
              where, first ? at + ".prefix[" + std::to_string(i) + "]" : at + ".tokens[" + std::to_string(i) + "]",
              first ? show(p) : show(ch.tokens[i]),
              "a piece at tokens " + show(g) + " of the batch's document " + std::to_string(d) + " " +
                  show(Range{cu[d], cu[d + 1]}) + " must read the keys " + show(seen) +
                  " before it that the mask sees, and no token of another document" + describe());
      }
    }
  }

 private:
  void begin_checked(const DocumentBatch* batch, std::vector<Chunk> chunks, AttentionMask mask) {
    constexpr const char* where = "ChunkedAttention::begin";
    const std::uint64_t fingerprint = chunks_fingerprint(chunks);  // compared on every call
    std::exception_ptr refused;
    try {  // every local check, and the compilation on a new chunk plan, before the first message
      mask.validate(where);
      for (std::size_t c = 0; c < chunks.size(); ++c)
        if (chunks[c].prefix.size() != chunks[c].tokens.size())  // (no message built on the good path)
          seqpar::detail::throw_invalid(where, "chunks[" + std::to_string(c) + "].prefix.size()",
                                        chunks[c].prefix.size(),
                                        "must equal tokens.size() = " + std::to_string(chunks[c].tokens.size()));
      if (batch != nullptr) check_chunks_of(where, *batch, chunks, mask);
      if (!plan_ || !(mask == mask_) || !same_chunks(chunks, chunks_)) compile(std::move(chunks), mask);
    } catch (const std::exception&) {
      refused = std::current_exception();
      plan_.reset();
      chunks_.clear();
      programs_.clear();
    }
    fingerprint_ = fingerprint;
    Agreement a(where, "its chunks");
    a.add("the chunks (fingerprint)", fingerprint, Agreement::kHash);
    a.add("the mask (sliding window, 0 = causal)", mask.window);
    a.run(world(), refused, agreed_);
    std::fill(forward_done_.begin(), forward_done_.end(), false);
    std::fill(backward_done_.begin(), backward_done_.end(), false);
    run(-1, "clear", clear_, bind_carry({}));
  }

 public:
  [[nodiscard]] int num_chunks() const noexcept { return static_cast<int>(chunks_.size()); }
  [[nodiscard]] const Chunk& chunk(int c) const { return chunks_.at(static_cast<std::size_t>(c)); }
  /// The mask of the current chunks (the layer's).
  [[nodiscard]] AttentionMask mask() const noexcept { return mask_; }
  /// Rows this rank holds of chunk c.
  [[nodiscard]] std::int64_t local_tokens(int c) const { return carry().local_tokens(c, attention_.rank()); }
  /// Global tokens of the batch this rank's rows of chunk c hold, in row order.
  [[nodiscard]] const std::vector<Range>& owned_global(int c) const { return carry().owned(c, attention_.rank()); }
  /// Rows of prefix K/V this rank keeps for later chunks.
  [[nodiscard]] std::int64_t carry_rows() const noexcept { return plan_ ? plan_->carry_rows(attention_.rank()) : 0; }
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
  using Engine = AttentionEngine<Kernel>;
  using Extension = typename Engine::CallExtension;

  // The chunk's words of the call's one agreement: which chunk plan, which chunk, which pass, and
  // whether the chunk's rows get sinks (the engine's own words follow).
  struct CallWords {
    const ChunkedAttention* self;
    std::int64_t chunk, pass, sinks;
  };
  static void add_call_words(const void* context, Agreement& a) {
    const auto* w = static_cast<const CallWords*>(context);
    a.add("the chunks (fingerprint)", w->self->fingerprint_, Agreement::kHash);
    a.add("the chunk of the call", w->chunk);
    a.add("the pass of the call (0 = forward, 1 = recompute, 2 = backward)", w->pass);
    a.add("whether the chunk's rows get attention sinks (0 = no, 1 = yes)", w->sinks);
  }
  // The chunk batch a call names, or (when the chunk index is refused) the first one, so that the call
  // still reaches the agreement and its peers learn of the refusal instead of waiting.
  const DocumentBatch& batch_of(int c) const {
    static const DocumentBatch kNone({{1}});
    if (c >= 0 && c < num_chunks()) return chunks_[static_cast<std::size_t>(c)].batch;
    return chunks_.empty() ? kNone : chunks_.front().batch;
  }

  void forward_call(int c, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v, ThdView<T> o, LseView<A> lse,
                    const std::span<const A>* sinks) {
    constexpr const char* where = "ChunkedAttention::forward";
    std::exception_ptr refused;
    try {  // local checks; then every rank compares what it is about to run (in the attention's agreement)
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
    run_forward(c, q, k, v, o, lse, true, sinks, refused);
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
    run_forward(c, q, k, v, o, lse, false, sinks, refused);
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
    const CallWords words{this, c, 2, sinks != nullptr ? 1 : 0};
    const Extension extension{&add_call_words, &words, refused};
    attention_.backward_call(batch_of(c), mask_, q, k, v, o, lse, dout, dq, dk, dv, nullptr, {}, &extension);
    const auto ci = static_cast<std::size_t>(c);
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
    if (sinks != nullptr) sink_epilogue_.backward(attention_.exec(), world(), dout, o, lse, *sinks, dsinks);
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
  AnyTransport& world() const noexcept { return attention_.world(); }

  void check_chunk(int c, const char* where) const {
    if (c < 0 || c >= num_chunks())
      seqpar::detail::throw_invalid(where, "c", c,
                                    "must be in [0, num_chunks()) = [0, " + std::to_string(num_chunks()) + ")");
  }

  // The strategy's forward of chunk c (one agreement: the chunk's words and the attention's), then its
  // prefix program (keep, exchange, merge).
  void run_forward(int c, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v, ThdView<T> o, LseView<A> lse,
                   bool keep, const std::span<const A>* sinks, const std::exception_ptr& refused) {
    const CallWords words{this, c, keep ? 0 : 1, sinks != nullptr ? 1 : 0};
    const Extension extension{&add_call_words, &words, refused};
    attention_.forward_call(batch_of(c), mask_, q, k, v, o, lse, nullptr, {}, &extension);
    const auto ci = static_cast<std::size_t>(c);
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
    AnyTransport& w = world();
    const std::uint64_t before = w.counters().bytes_sent;
    const typename Exec::Levels levels{&w, nullptr, nullptr};
    try {
      ex.run(levels, attention_.kernel(), attention_.exec(), b, workspace_.span());
    } catch (const Error& e) {
      throw Error(e.code(), "ChunkedAttention: chunk " + std::to_string(c) + " (" + pass + "): " + e.detail());
    }
    last_bytes_sent_ = w.counters().bytes_sent - before;
  }

  // Places every chunk with the strategy (local), compiles and lowers every prefix program for the
  // mask, and sizes the carry and the workspace: the only place that allocates.
  void compile(std::vector<Chunk> chunks, AttentionMask mask) {
    const int ranks = attention_.topology().world_size, me = attention_.rank();
    std::vector<std::vector<std::vector<Range>>> owned(chunks.size());
    for (std::size_t c = 0; c < chunks.size(); ++c) {
      const Placement& placement = attention_.placement(chunks[c].batch);
      for (int r = 0; r < ranks; ++r)
        owned[c].push_back(comm::ChunkCarry::to_global(chunks[c], placement.owned[static_cast<std::size_t>(r)]));
    }
    plan_.reset();
    chunks_.clear();
    plan_ = std::make_unique<comm::ChunkCarry>(chunks, std::move(owned), attention_.shape(), mask);
    chunks_ = std::move(chunks);
    mask_ = mask;
    programs_ = std::vector<Programs>(chunks_.size());
    std::size_t need = 0;
    const auto lower = [&](Exec& ex, const comm::Program& p) {
      ex.initialize(p, attention_.kernel());
      need = std::max(need, ex.workspace_bytes());
      // The prefix calls' shapes (all heads, the attention's scale), asked before any message.
      if (Status s = ex.can_implement(attention_.kernel(), attention_.exec()); !s)
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
      if (a[c].tokens != b[c].tokens || a[c].prefix != b[c].prefix || !(x == y)) return false;
    }
    return true;
  }

  Engine& attention_;
  std::vector<Chunk> chunks_;
  AttentionMask mask_;
  std::uint64_t fingerprint_ = 0;  // of chunks_, compared on every call
  std::unique_ptr<comm::ChunkCarry> plan_;
  std::vector<Programs> programs_;
  Exec clear_;
  typename Ops::Workspace workspace_, carry_mem_;  // in the execution context's memory
  SinkEpilogue<exec_type> sink_epilogue_;
  std::size_t carry_stride_ = 0;  // bytes of each of the four carry tensors (64-aligned)
  std::vector<Agreement::Record> agreed_;
  std::vector<bool> forward_done_, backward_done_;
  std::uint64_t last_bytes_sent_ = 0;
};

}  // namespace seqpar::runtime
