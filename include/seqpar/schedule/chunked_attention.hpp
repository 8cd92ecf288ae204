// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// `schedule::ChunkedAttention`: runs a batch chunk by chunk (a scheduler's chunks, e.g.
/// DynamicChunk's) over any strategy, exactly. A chunk's own attention is the strategy's (the chunk
/// batch is planned and run like any batch); a piece with a prefix (a split document's later slice)
/// also attends, with a full mask, to its document's earlier tokens, which earlier chunks left on the
/// ranks that held them (the *carry*: K/V rows kept after their chunk's forward, not recomputed).
/// Each rank fetches only the prefix rows of the pieces whose queries it holds (one all_to_all_v per
/// chunk with prefixes, every rank sending a peer only the rows that peer reads), computes the prefix
/// term with its kernel and merges it into the strategy's (O, LSE) (attention/merge.hpp).
/// Backward runs the chunks in reverse: the strategy's gradients, plus the prefix term's dQ, and its
/// dK/dV sent back to the ranks that hold the prefix rows, accumulated there and added to those rows'
/// gradients when their own chunk's backward runs. The result is attention over the whole batch.
///
/// Every rank calls `begin` with the same chunks, then `forward(c)` and `backward(c)` in the same
/// order: a chunk's forward after the forwards of the chunks its prefixes read, its backward after its
/// forward and after the backwards of the chunks that read it (a split document goes backward last
/// slice first; 1F1B interleaves the rest, schedule/pipeline.hpp), with the chunk's local rows (`owned_global(c)`: the
/// global tokens of the batch they hold, in row order). Host memory (CPU kernels); the carry holds the K/V of the
/// prefix rows this rank owns.
///
/// @code
/// DistributedAttention<Strategy<Zigzag, Ring>, attention::CpuFlash<float>> attn(t, shape);
/// schedule::ChunkedAttention<attention::CpuFlash<float>> chunked(attn, t);
/// chunked.begin(schedule::DynamicChunk{{.token_capacity = 4096}}.chunks(batch));
/// for (int c = 0; c < chunked.num_chunks(); ++c) chunked.forward(c, q[c], k[c], v[c], o[c], lse[c]);
/// for (int c = chunked.num_chunks() - 1; c >= 0; --c) chunked.backward(c, ...);
/// @endcode

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "seqpar/attention/kernel.hpp"
#include "seqpar/attention/merge.hpp"
#include "seqpar/core/aligned_bytes.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/range.hpp"
#include "seqpar/core/range_set.hpp"
#include "seqpar/core/tensor.hpp"
#include "seqpar/runtime/any_transport.hpp"
#include "seqpar/runtime/engine.hpp"
#include "seqpar/schedule/static.hpp"

namespace seqpar::schedule {

template <attention::AttentionKernel Kernel>
class ChunkedAttention {
 public:
  using value_type = typename Kernel::value_type;
  using accum_type = typename Kernel::accum_type;
  using T = value_type;
  using A = accum_type;

  /// `attention` runs each chunk; `transport` is the world it runs on (the same ranks); `kernel`
  /// computes the prefix terms on this rank.
  template <Transport Tr>
  ChunkedAttention(runtime::AttentionEngine<Kernel>& attention, Tr& transport, Kernel kernel = {})
      : attention_(attention), world_(transport), kernel_(std::move(kernel)) {}

  /// Starts a batch. Every rank passes the same chunks (checked), in the order they will run.
  void begin(std::vector<Chunk> chunks) {
    constexpr const char* where = "ChunkedAttention::begin";
    for (std::size_t c = 0; c < chunks.size(); ++c)
      seqpar::detail::require(chunks[c].prefix.size() == chunks[c].tokens.size(), where,
                              "chunks[" + std::to_string(c) + "].prefix.size()", chunks[c].prefix.size(),
                              "must equal tokens.size() = " + std::to_string(chunks[c].tokens.size()));
    agree(chunks);
    chunks_ = std::move(chunks);
    const int ranks = world_.size();
    // Global rows of every rank for every chunk, in local row order (collective on a new chunk batch
    // for batch-aware strategies: every rank plans every chunk here, in the same order).
    owned_.assign(chunks_.size(), {});
    for (std::size_t c = 0; c < chunks_.size(); ++c) {
      const ShardPlan& plan = attention_.plan(chunks_[c].batch);
      for (int r = 0; r < ranks; ++r)
        owned_[c].push_back(to_global(chunks_[c], plan.owned[static_cast<std::size_t>(r)]));
    }
    // The carry: prefix rows of later pieces, as disjoint global ranges.
    std::vector<Range> carry;
    for (const Chunk& ch : chunks_)
      for (const Range& p : ch.prefix)
        if (!p.empty()) carry.push_back(p);
    carry_ = merge_ranges(std::move(carry));
    // Which carry rows each rank holds (the chunk that owned them left them there).
    held_.assign(static_cast<std::size_t>(ranks), {});
    for (std::size_t c = 0; c < chunks_.size(); ++c)
      for (int r = 0; r < ranks; ++r)
        for (const Range& g : owned_[c][static_cast<std::size_t>(r)])
          for (const Range& x : carry_) {
            const Range i{std::max(g.begin, x.begin), std::min(g.end, x.end)};
            if (!i.empty()) held_[static_cast<std::size_t>(r)].push_back(i);
          }
    for (auto& h : held_) h = merge_ranges(std::move(h));
    // Order constraints: chunk c reads the prefix rows of the chunks it depends on.
    reads_.assign(chunks_.size(), {});
    for (std::size_t c = 0; c < chunks_.size(); ++c)
      for (std::size_t e = 0; e < chunks_.size(); ++e) {
        bool reads = false;
        for (const Range& pre : chunks_[c].prefix)
          for (const Range& t : chunks_[e].tokens)
            reads = reads || std::max(pre.begin, t.begin) < std::min(pre.end, t.end);
        if (reads) reads_[c].push_back(static_cast<int>(e));
      }
    forward_done_.assign(chunks_.size(), false);
    backward_done_.assign(chunks_.size(), false);
    // This rank's carry slots: one row per held prefix row.
    slots_.clear();
    std::int64_t rows = 0;
    for (const Range& h : held_[static_cast<std::size_t>(world_.rank())]) {
      slots_.push_back({h, rows});
      rows += h.size();
    }
    const AttentionShape& s = attention_.shape();
    carry_k_ = ThdTensor<T>(rows, s.heads_kv, s.head_dim);
    carry_v_ = ThdTensor<T>(rows, s.heads_kv, s.head_dim);
    carry_dk_ = ThdTensor<T>(rows, s.heads_kv, s.head_dim);
    carry_dv_ = ThdTensor<T>(rows, s.heads_kv, s.head_dim);
  }

  [[nodiscard]] int num_chunks() const noexcept { return static_cast<int>(chunks_.size()); }
  [[nodiscard]] const Chunk& chunk(int c) const { return chunks_.at(static_cast<std::size_t>(c)); }
  /// Rows this rank holds of chunk c.
  [[nodiscard]] std::int64_t local_tokens(int c) const {
    std::int64_t n = 0;
    for (const Range& r : owned_global(c)) n += r.size();
    return n;
  }
  /// Global tokens of the batch this rank's rows of chunk c hold, in row order.
  [[nodiscard]] const std::vector<Range>& owned_global(int c) const {
    return owned_.at(static_cast<std::size_t>(c)).at(static_cast<std::size_t>(world_.rank()));
  }
  /// Rows of prefix K/V this rank keeps for later chunks.
  [[nodiscard]] std::int64_t carry_rows() const noexcept { return carry_k_.tokens; }

  void forward(int c, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v, ThdView<T> o, LseView<A> lse) {
    constexpr const char* where = "ChunkedAttention::forward";
    check_chunk(c, where);
    seqpar::detail::require(!forward_done_[static_cast<std::size_t>(c)], where, "c", c, "ran forward already");
    for (int e : reads_[static_cast<std::size_t>(c)])
      seqpar::detail::require(forward_done_[static_cast<std::size_t>(e)], where, "c", c,
                              "reads the prefix rows of chunk " + std::to_string(e) + ", whose forward has not run");
    run_forward(c, q, k, v, o, lse);
  }

  /// Chunk c's forward again, for activation checkpointing (a pipeline stage recomputes a layer
  /// before its backward): the same (O, LSE) bit for bit, collective like `forward`. Allowed after
  /// the chunk's forward and before its backward. The prefix K/V it reads is still in the carry (a
  /// chunk that reads it goes backward first, and the carry lives until the next `begin`); the chunk's
  /// own K/V rows are kept again, unchanged.
  void recompute(int c, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v, ThdView<T> o, LseView<A> lse) {
    constexpr const char* where = "ChunkedAttention::recompute";
    check_chunk(c, where);
    const auto ci = static_cast<std::size_t>(c);
    seqpar::detail::require(forward_done_[ci] && !backward_done_[ci], where, "c", c,
                            backward_done_[ci] ? "ran backward already" : "has not run forward");
    run_forward(c, q, k, v, o, lse);
  }
  void backward(int c, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v, ThdView<const T> o,
                LseView<const A> lse, ThdView<const T> dout, ThdView<T> dq, ThdView<T> dk, ThdView<T> dv) {
    constexpr const char* where = "ChunkedAttention::backward";
    check_chunk(c, where);
    const auto ci = static_cast<std::size_t>(c);
    seqpar::detail::require(forward_done_[ci] && !backward_done_[ci], where, "c", c,
                            backward_done_[ci] ? "ran backward already" : "has not run forward");
    // Every chunk that reads this chunk's rows as prefix sends their gradients back in its backward.
    for (std::size_t e = 0; e < chunks_.size(); ++e)
      for (int r : reads_[e])
        if (r == c)
          seqpar::detail::require(backward_done_[e], where, "c", c,
                                  "chunk " + std::to_string(e) +
                                      " reads its rows as prefix and must run backward first (a split document "
                                      "goes backward last slice first)");
    const Chunk& ch = chunks_[ci];
    attention_.backward(ch.batch, q, k, v, o, lse, dout, dq, dk, dv);
    backward_done_[ci] = true;
    Prefix p = fetch(c);
    if (p.exchanged) {  // collective: also on ranks that hold none of the chunk's prefixed queries
      const AttentionShape& s = attention_.shape();
      ThdTensor<T> dk_pref(p.k.tokens, s.heads_kv, s.head_dim), dv_pref(p.k.tokens, s.heads_kv, s.head_dim);
      if (!p.slices.empty())
        kernel_.backward(kernel_.exec(), s, q, p.k.view(), p.v.view(), o, lse, dout, p.slices, dq, dk_pref.view(),
                         dv_pref.view(), workspace(q.tokens, p.k.tokens));
      give_back(p, dk_pref, dv_pref);
    }
    // Gradients later chunks sent for this chunk's prefix rows.
    add_kept(c, carry_dk_.view(), dk);
    add_kept(c, carry_dv_.view(), dv);
  }

 private:
  // The strategy's forward of chunk c, its own K/V rows kept for later chunks, and the prefix term merged in.
  void run_forward(int c, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v, ThdView<T> o, LseView<A> lse) {
    const Chunk& ch = chunks_[static_cast<std::size_t>(c)];
    attention_.forward(ch.batch, q, k, v, o, lse);
    keep(c, k, carry_k_.view());
    keep(c, v, carry_v_.view());
    forward_done_[static_cast<std::size_t>(c)] = true;
    Prefix p = fetch(c);
    if (p.slices.empty()) return;
    const AttentionShape& s = attention_.shape();
    ThdTensor<T> o_part(q.tokens, s.heads_q, s.head_dim);
    LseTensor<A> lse_part(s.heads_q, q.tokens);
    kernel_.forward(kernel_.exec(), s, q, p.k.view(), p.v.view(), p.slices, o_part.view(), lse_part.view(),
                    workspace(q.tokens, p.k.tokens));
    for (const AttnSlice& sl : p.slices) {
      const std::int64_t r0 = sl.q_range.begin, n = sl.q_range.size();
      attention::merge_into(o.tokens_slice(r0, n), lse.tokens_slice(r0, n),
                            ThdView<const T>(o_part.view().tokens_slice(r0, n)),
                            LseView<const A>(lse_part.view().tokens_slice(r0, n)));
    }
  }

  struct Slot {
    Range global;
    std::int64_t row;
  };

  void check_chunk(int c, const char* where) const {
    if (c < 0 || c >= num_chunks())
      seqpar::detail::throw_invalid(where, "c", c,
                                    "must be in [0, num_chunks()) = [0, " + std::to_string(num_chunks()) + ")");
  }
  // The prefix rows this rank gathered for chunk c: K, V in piece-contiguous blocks, the slices over
  // them, and how the rows came (to send gradients back the same way).
  struct Prefix {
    ThdTensor<T> k, v;
    std::vector<AttnSlice> slices;
    std::vector<std::vector<Range>> from;  ///< per peer: global rows received, in message order
    std::vector<std::vector<Range>> to;    ///< per peer: global rows sent, in message order
    std::vector<std::int64_t> place;       ///< message row (all peers, in order) -> row of k, v
    bool exchanged = false;                ///< the chunk has prefixes: every rank took part
  };

  // Chunk-batch token ranges -> global ranges of the scheduled batch (the chunk's tokens, concatenated).
  static std::vector<Range> to_global(const Chunk& ch, const std::vector<Range>& local) {
    std::vector<Range> out;
    for (const Range& r : local) {
      std::int64_t at = 0;
      for (const Range& t : ch.tokens) {
        const Range i{std::max(r.begin, at), std::min(r.end, at + t.size())};
        if (!i.empty()) out.push_back({t.begin + (i.begin - at), t.begin + (i.end - at)});
        at += t.size();
      }
    }
    return out;
  }

  // The carry row of global token g on this rank (-1 when not kept here).
  [[nodiscard]] std::int64_t slot_of(std::int64_t g) const {
    auto it = std::upper_bound(slots_.begin(), slots_.end(), g,
                               [](std::int64_t x, const Slot& s) { return x < s.global.begin; });
    if (it == slots_.begin()) return -1;
    --it;
    return g < it->global.end ? it->row + (g - it->global.begin) : -1;
  }

  static void copy_row(ThdView<const T> from, std::int64_t i, ThdView<T> to, std::int64_t j) {
    for (int h = 0; h < from.heads; ++h) std::copy_n(from.row(i, h), from.head_dim, to.row(j, h));
  }
  static void add_row(ThdView<const T> from, std::int64_t i, ThdView<T> to, std::int64_t j) {
    for (int h = 0; h < from.heads; ++h) {
      const T* a = from.row(i, h);
      T* b = to.row(j, h);
      for (int x = 0; x < from.head_dim; ++x) b[x] += a[x];
    }
  }

  // Calls fn(local row, global token) for this rank's rows of chunk c.
  template <class Fn>
  void for_each_row(int c, Fn&& fn) const {
    std::int64_t row = 0;
    for (const Range& g : owned_global(c))
      for (std::int64_t t = g.begin; t < g.end; ++t, ++row) fn(row, t);
  }

  void keep(int c, ThdView<const T> local, ThdView<T> carry) {
    for_each_row(c, [&](std::int64_t row, std::int64_t g) {
      const std::int64_t s = slot_of(g);
      if (s >= 0) copy_row(local, row, carry, s);
    });
  }
  void add_kept(int c, ThdView<T> carry, ThdView<T> local) {
    for_each_row(c, [&](std::int64_t row, std::int64_t g) {
      const std::int64_t s = slot_of(g);
      if (s >= 0) add_row(ThdView<const T>(carry), s, local, row);
    });
  }

  std::span<std::byte> workspace(std::int64_t q_rows, std::int64_t k_rows) {
    const std::size_t need = kernel_.workspace_bytes(attention_.shape(), q_rows, k_rows);
    if (workspace_.size() < need) workspace_ = seqpar::detail::AlignedBytes(need);
    return workspace_.span();
  }

  // Gathers the prefix rows of chunk c's pieces whose queries this rank holds. Collective over the
  // world when the chunk has a prefix (every rank computes every rank's sends from the plans).
  Prefix fetch(int c) {
    const Chunk& ch = chunks_[static_cast<std::size_t>(c)];
    Prefix p;
    bool any = false;
    for (const Range& r : ch.prefix) any = any || !r.empty();
    if (!any) return p;
    p.exchanged = true;
    const int ranks = world_.size(), me = world_.rank();
    // Pieces with a prefix whose queries rank s holds, and s's local rows of them.
    const auto needs = [&](int s) {
      std::vector<std::size_t> out;
      for (std::size_t i = 0; i < ch.tokens.size(); ++i) {
        if (ch.prefix[i].empty()) continue;
        for (const Range& g : owned_[static_cast<std::size_t>(c)][static_cast<std::size_t>(s)])
          if (std::max(g.begin, ch.tokens[i].begin) < std::min(g.end, ch.tokens[i].end)) {
            out.push_back(i);
            break;
          }
      }
      return out;
    };
    const auto rows_of = [&](int holder, const Range& prefix) {
      std::vector<Range> out;
      for (const Range& h : held_[static_cast<std::size_t>(holder)]) {
        const Range i{std::max(h.begin, prefix.begin), std::min(h.end, prefix.end)};
        if (!i.empty()) out.push_back(i);
      }
      return out;
    };
    const AttentionShape& s = attention_.shape();
    const std::size_t row_bytes =
        sizeof(T) * static_cast<std::size_t>(s.heads_kv) * static_cast<std::size_t>(s.head_dim) * 2;  // K and V
    p.to.assign(static_cast<std::size_t>(ranks), {});
    p.from.assign(static_cast<std::size_t>(ranks), {});
    std::vector<std::size_t> send_counts(static_cast<std::size_t>(ranks)), recv_counts(static_cast<std::size_t>(ranks));
    for (int peer = 0; peer < ranks; ++peer) {
      for (std::size_t i : needs(peer))
        for (const Range& r : rows_of(me, ch.prefix[i])) p.to[static_cast<std::size_t>(peer)].push_back(r);
      send_counts[static_cast<std::size_t>(peer)] = row_bytes * static_cast<std::size_t>(rows(p.to[peer]));
    }
    // What this rank receives, piece by piece, and where each row goes: pieces are contiguous in k, v.
    const std::vector<std::size_t> mine = needs(me);
    std::vector<std::int64_t> piece_at, piece_fill;
    std::int64_t total = 0;
    for (std::size_t i : mine) {
      piece_at.push_back(total);
      piece_fill.push_back(total);
      total += ch.prefix[i].size();
    }
    for (int peer = 0; peer < ranks; ++peer) {
      for (std::size_t j = 0; j < mine.size(); ++j)
        for (const Range& r : rows_of(peer, ch.prefix[mine[j]])) {
          p.from[static_cast<std::size_t>(peer)].push_back(r);
          for (std::int64_t t = 0; t < r.size(); ++t) p.place.push_back(piece_fill[j]++);
        }
      recv_counts[static_cast<std::size_t>(peer)] = row_bytes * static_cast<std::size_t>(rows(p.from[peer]));
    }
    // Pack K then V of each row from the carry, exchange, place.
    std::vector<T> send, recv;
    pack(p.to, carry_k_.view(), carry_v_.view(), send);
    recv.resize(static_cast<std::size_t>(p.place.size()) * row_bytes / sizeof(T));
    world_.all_to_all_v(std::as_bytes(std::span<const T>(send)), send_counts,
                        std::as_writable_bytes(std::span<T>(recv)), recv_counts);
    p.k = ThdTensor<T>(total, s.heads_kv, s.head_dim);
    p.v = ThdTensor<T>(total, s.heads_kv, s.head_dim);
    const std::size_t half = row_bytes / 2 / sizeof(T);
    for (std::size_t m = 0; m < p.place.size(); ++m) {
      const T* src = recv.data() + m * 2 * half;
      std::copy_n(src, half, p.k.view().row(p.place[m], 0));
      std::copy_n(src + half, half, p.v.view().row(p.place[m], 0));
    }
    // One slice per run of local rows of a piece: its queries see the whole prefix (full mask).
    for (std::size_t j = 0; j < mine.size(); ++j) {
      const Range piece = ch.tokens[mine[j]];
      const Range keys{piece_at[j], piece_at[j] + ch.prefix[mine[j]].size()};
      std::int64_t row = 0;
      for (const Range& g : owned_global(c)) {
        const Range i{std::max(g.begin, piece.begin), std::min(g.end, piece.end)};
        if (!i.empty()) p.slices.push_back({{row + (i.begin - g.begin), row + (i.end - g.begin)}, keys, Mask::full()});
        row += g.size();
      }
    }
    return p;
  }

  // Sends the prefix rows' gradients back to the ranks that sent the rows, and adds what comes back
  // (gradients of rows this rank holds) into the carry's gradients.
  void give_back(const Prefix& p, const ThdTensor<T>& dk, const ThdTensor<T>& dv) {
    const int ranks = world_.size();
    const AttentionShape& s = attention_.shape();
    const std::size_t half = static_cast<std::size_t>(s.heads_kv) * static_cast<std::size_t>(s.head_dim);
    const std::size_t row_bytes = 2 * half * sizeof(T);
    std::vector<T> send(p.place.size() * 2 * half), recv;
    for (std::size_t m = 0; m < p.place.size(); ++m) {
      std::copy_n(dk.view().row(p.place[m], 0), half, send.data() + m * 2 * half);
      std::copy_n(dv.view().row(p.place[m], 0), half, send.data() + m * 2 * half + half);
    }
    std::vector<std::size_t> send_counts(static_cast<std::size_t>(ranks)), recv_counts(static_cast<std::size_t>(ranks));
    std::size_t back_rows = 0;
    for (int peer = 0; peer < ranks; ++peer) {
      send_counts[static_cast<std::size_t>(peer)] = row_bytes * static_cast<std::size_t>(rows(p.from[peer]));
      recv_counts[static_cast<std::size_t>(peer)] = row_bytes * static_cast<std::size_t>(rows(p.to[peer]));
      back_rows += static_cast<std::size_t>(rows(p.to[peer]));
    }
    recv.resize(back_rows * 2 * half);
    world_.all_to_all_v(std::as_bytes(std::span<const T>(send)), send_counts,
                        std::as_writable_bytes(std::span<T>(recv)), recv_counts);
    std::size_t m = 0;
    for (int peer = 0; peer < ranks; ++peer)
      for (const Range& r : p.to[static_cast<std::size_t>(peer)])
        for (std::int64_t g = r.begin; g < r.end; ++g, ++m) {
          const std::int64_t slot = slot_of(g);
          const T* src = recv.data() + m * 2 * half;
          T* k = carry_dk_.view().row(slot, 0);
          T* v = carry_dv_.view().row(slot, 0);
          for (std::size_t x = 0; x < half; ++x) {
            k[x] += src[x];
            v[x] += src[half + x];
          }
        }
  }

  static std::int64_t rows(const std::vector<Range>& rs) {
    std::int64_t n = 0;
    for (const Range& r : rs) n += r.size();
    return n;
  }

  void pack(const std::vector<std::vector<Range>>& to, ThdView<const T> k, ThdView<const T> v,
            std::vector<T>& out) const {
    const std::size_t half = static_cast<std::size_t>(k.heads) * static_cast<std::size_t>(k.head_dim);
    for (const auto& peer : to)
      for (const Range& r : peer)
        for (std::int64_t g = r.begin; g < r.end; ++g) {
          const std::int64_t slot = slot_of(g);
          out.insert(out.end(), k.row(slot, 0), k.row(slot, 0) + half);
          out.insert(out.end(), v.row(slot, 0), v.row(slot, 0) + half);
        }
  }

  // Ranks must run the same chunks: a fingerprint of every chunk's ranges, compared across the world.
  void agree(const std::vector<Chunk>& chunks) {
    std::uint64_t h = 1469598103934665603ull;
    const auto mix = [&](std::int64_t x) { h = (h ^ static_cast<std::uint64_t>(x)) * 1099511628211ull; };
    mix(static_cast<std::int64_t>(chunks.size()));
    for (const Chunk& c : chunks) {
      for (const Range& r : c.tokens) mix(r.begin), mix(r.end);
      for (const Range& r : c.prefix) mix(r.begin), mix(r.end);
    }
    std::vector<std::uint64_t> all(static_cast<std::size_t>(world_.size()));
    world_.all_gather(std::as_bytes(std::span<const std::uint64_t>(&h, 1)),
                      std::as_writable_bytes(std::span<std::uint64_t>(all)));
    for (int r = 0; r < world_.size(); ++r)
      if (all[static_cast<std::size_t>(r)] != h)
        throw Error(Errc::kMismatch, "ChunkedAttention::begin: rank " + std::to_string(world_.rank()) + " and rank " +
                                         std::to_string(r) + " were given different chunks");
  }

  runtime::AttentionEngine<Kernel>& attention_;
  runtime::AnyTransport world_;
  Kernel kernel_;
  std::vector<Chunk> chunks_;
  std::vector<std::vector<std::vector<Range>>> owned_;  ///< [chunk][rank] global rows in row order
  std::vector<Range> carry_;                            ///< every prefix row of the batch
  std::vector<std::vector<Range>> held_;                ///< [rank] prefix rows it keeps
  std::vector<Slot> slots_;                             ///< this rank's carry rows
  ThdTensor<T> carry_k_, carry_v_, carry_dk_, carry_dv_;
  seqpar::detail::AlignedBytes workspace_;
  std::vector<std::vector<int>> reads_;  ///< [chunk] chunks whose tokens its prefixes cover
  std::vector<bool> forward_done_, backward_done_;
};

}  // namespace seqpar::schedule
