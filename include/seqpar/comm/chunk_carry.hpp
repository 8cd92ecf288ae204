// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// `comm::ChunkCarry`: compiles the programs that carry a split document's K/V prefix between the
/// chunks of a chunked run (DPP, "Efficient Long-Context LLM Training with Dynamic Pipeline
/// Parallelism": a document's later slice attends to its earlier slices' K/V, kept from their forward,
/// never recomputed). They are `comm::Program`s like a communicator's, so the executor runs them on
/// any transport and execution context, the transports count their bytes against what they declare,
/// and the replay prices them.
///
/// The carry is, on each rank, the prefix rows (rows some later piece reads as prefix) of the chunks
/// it held, in global order (`carry_rows(rank)` rows of kKCarry, kVCarry, kDkCarry, kDvCarry). Per chunk:
///  - forward: keep the chunk's own carry rows (a local copy kK/kV -> kKCarry/kVCarry); if the chunk
///    has prefixes, one all_to_all_v in which every holder sends a rank exactly the prefix rows of the
///    pieces whose queries that rank holds (into kKPrefix/kVPrefix, piece by piece in global order),
///    then attention of those queries over their whole prefix (full mask), merged into (O, LSE);
///  - recompute: the same without the keep (the rows are in the carry already);
///  - backward: the same exchange, the prefix term's dQ added to dQ and its dK/dV sent back to the
///    holders and added to their carry gradients (in peer order: deterministic), then the carry
///    gradients of the chunk's own rows (returned by later chunks) added to dK/dV.
/// `clear` zeroes the carry gradients (once per batch). Volume per chunk: each prefix row travels once
/// to each rank holding queries of its piece (K and V forward; K, V back, dK, dV back in backward).
///
/// Sliding windows (the carry's mask has a window w > 0): a query sees only the w - 1 keys before
/// it, so a prefix is cut to the last w - 1 tokens before its piece (a longer one given is cut here; for
/// w = 1 none is left), and the carry holds at most w - 1 rows per piece boundary. A rank receives only
/// the suffix of a prefix that its queries of the piece reach (from its first such query - w + 1),
/// nothing when they all sit w - 1 or more past the piece's start, and the prefix slices are
/// causal-with-offset sliding windows over exactly those keys, their queries cut to the rows that see
/// one (slice-relative, like every AttnSlice: offset = query's first global row - key's first).
///
/// @code
/// comm::ChunkCarry carry(chunks, owned, shape, mask); // owned[c][r]: chunk c's global rows on rank r
/// comm::Program fwd = carry.forward(c, rank, true);  // run by runtime::Executor, replayed by replay::
/// @endcode

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "seqpar/comm/program.hpp"
#include "seqpar/core/attention_mask.hpp"
#include "seqpar/core/attention_shape.hpp"
#include "seqpar/core/attn_slice.hpp"
#include "seqpar/core/chunk.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/range.hpp"
#include "seqpar/core/range_set.hpp"

namespace seqpar::comm {

class ChunkCarry {
 public:
  /// Chunks run in the given order; `owned[c][r]` are the global rows of chunk c that rank r holds,
  /// in its local row order (from the strategy's placement of the chunk batch); `mask` is the layer's
  /// (the chunks are the same for every layer; what the carry keeps and moves follows the mask). Throws
  /// std::invalid_argument naming the chunk and piece when a chunk's prefixes are malformed or read
  /// rows no chunk holds.
  ChunkCarry(std::span<const Chunk> chunks, std::vector<std::vector<std::vector<Range>>> owned,
             const AttentionShape& shape, AttentionMask mask = {})
      : owned_(std::move(owned)), shape_(shape) {
    constexpr const char* where = "comm::ChunkCarry";
    seqpar::detail::require(owned_.size() == chunks.size(), where, "owned.size()", owned_.size(),
                            "must equal chunks.size() = " + std::to_string(chunks.size()));
    ranks_ = owned_.empty() ? 0 : static_cast<int>(owned_.front().size());
    tokens_.resize(chunks.size());
    prefix_.resize(chunks.size());
    mask.validate(where);
    std::vector<Range> all_tokens;
    std::int64_t reach = 0;  // the most keys a query of a piece can see: its prefix and the piece
    for (std::size_t c = 0; c < chunks.size(); ++c) {
      const Chunk& ch = chunks[c];
      const std::string at = "chunks[" + std::to_string(c) + "]";
      seqpar::detail::require(ch.prefix.size() == ch.tokens.size(), where, at + ".prefix.size()", ch.prefix.size(),
                              "must equal tokens.size() = " + std::to_string(ch.tokens.size()));
      seqpar::detail::require(static_cast<int>(owned_[c].size()) == ranks_, where,
                              "owned[" + std::to_string(c) + "].size()", owned_[c].size(),
                              "must equal the world size " + std::to_string(ranks_));
      for (std::size_t i = 0; i < ch.tokens.size(); ++i) {
        const Range t = ch.tokens[i], p = ch.prefix[i];
        seqpar::detail::require(t.begin >= 0 && t.begin <= t.end, where, at + ".tokens[" + std::to_string(i) + "]",
                                to_string(t), "is not a range of tokens");
        seqpar::detail::require(p.empty() || (p.begin >= 0 && p.end == t.begin), where,
                                at + ".prefix[" + std::to_string(i) + "]", to_string(p),
                                "must be empty or end where the piece begins (" + std::to_string(t.begin) + ")");
        all_tokens.push_back(t);
      }
      tokens_[c] = ch.tokens;
      prefix_[c] = ch.prefix;
      for (std::size_t i = 0; i < ch.tokens.size(); ++i)
        reach = std::max(reach, ch.prefix[i].size() + ch.tokens[i].size());
    }
    // A window no piece's queries can reach the end of (INT64_MAX, "no window", or just longer than every
    // piece with its prefix) is no window: the carry's masks and bounds never hold one past the int64 range.
    window_ = mask.window >= reach ? 0 : mask.window;
    // With a window, keys before the piece's first query's window are read by no query: not carried.
    for (auto& prefixes : prefix_)
      for (Range& p : prefixes) p = visible_prefix(p, window_);
    // Every prefix row must be a token of this chunk or of a chunk before it (chunks run in the given
    // order): else its queries would attend to rows no rank holds, or to rows whose forward runs
    // later (the order checks of forward/backward could then never be satisfied).
    const std::vector<Range> held_anywhere = merge_ranges(all_tokens);
    std::vector<Range> held_so_far;
    for (std::size_t c = 0; c < chunks.size(); ++c) {
      held_so_far.insert(held_so_far.end(), tokens_[c].begin(), tokens_[c].end());
      held_so_far = merge_ranges(std::move(held_so_far));
      for (std::size_t i = 0; i < prefix_[c].size(); ++i)
        if (!prefix_[c][i].empty()) {
          const std::string name = "chunks[" + std::to_string(c) + "].prefix[" + std::to_string(i) + "]";
          seqpar::detail::require(covered(held_anywhere, prefix_[c][i]), where, name, to_string(prefix_[c][i]),
                                  "reads tokens that no chunk holds");
          seqpar::detail::require(covered(held_so_far, prefix_[c][i]), where, name, to_string(prefix_[c][i]),
                                  "reads tokens that only a later chunk holds (a prefix must come from the chunks "
                                  "before it)");
        }
    }
    // The carry: prefix rows of later pieces, as disjoint global ranges; which of them each rank holds.
    std::vector<Range> carry;
    for (const auto& pre : prefix_)
      for (const Range& p : pre)
        if (!p.empty()) carry.push_back(p);
    const std::vector<Range> carried = merge_ranges(std::move(carry));
    held_.assign(static_cast<std::size_t>(ranks_), {});
    for (std::size_t c = 0; c < chunks.size(); ++c)
      for (int r = 0; r < ranks_; ++r)
        for (const Range& g : owned_[c][static_cast<std::size_t>(r)])
          for (const Range& x : carried)
            if (const Range i = intersect(g, x); !i.empty()) held_[static_cast<std::size_t>(r)].push_back(i);
    slots_.assign(static_cast<std::size_t>(ranks_), {});
    carry_rows_.assign(static_cast<std::size_t>(ranks_), 0);
    for (int r = 0; r < ranks_; ++r) {
      auto& h = held_[static_cast<std::size_t>(r)];
      h = merge_ranges(std::move(h));
      std::int64_t row = 0;
      for (const Range& x : h) {
        slots_[static_cast<std::size_t>(r)].push_back(row);
        row += x.size();
      }
      carry_rows_[static_cast<std::size_t>(r)] = row;
    }
    // Order constraints: chunk c reads the rows of the chunks its prefixes cover.
    reads_.assign(chunks.size(), {});
    for (std::size_t c = 0; c < chunks.size(); ++c)
      for (std::size_t e = 0; e < chunks.size(); ++e) {
        bool reads = false;
        for (const Range& pre : prefix_[c])
          for (const Range& t : tokens_[e]) reads = reads || !intersect(pre, t).empty();
        if (reads) reads_[c].push_back(static_cast<int>(e));
      }
  }

  /// Rows of the chunk batch (a plan's `owned` ranges, in chunk-batch coordinates) as global ranges of
  /// the scheduled batch: the chunk's token ranges, concatenated, are the chunk batch's rows.
  [[nodiscard]] static std::vector<Range> to_global(const Chunk& chunk, const std::vector<Range>& local) {
    std::vector<Range> out;
    for (const Range& r : local) {
      std::int64_t at = 0;
      for (const Range& t : chunk.tokens) {
        if (const Range i = intersect(r, {at, at + t.size()}); !i.empty())
          out.push_back({t.begin + (i.begin - at), t.begin + (i.end - at)});
        at += t.size();
      }
    }
    return out;
  }

  [[nodiscard]] int world_size() const noexcept { return ranks_; }
  /// The carry's sliding window (0: none, also for a window longer than every piece with its prefix).
  [[nodiscard]] std::int64_t window() const noexcept { return window_; }
  /// Piece i of chunk c's prefix as the carry uses it (with a window, cut to its last window - 1 rows).
  [[nodiscard]] Range prefix(int c, std::size_t i) const { return prefix_.at(static_cast<std::size_t>(c)).at(i); }
  [[nodiscard]] int num_chunks() const noexcept { return static_cast<int>(tokens_.size()); }
  /// Global rows of chunk c on `rank`, in its local row order.
  [[nodiscard]] const std::vector<Range>& owned(int c, int rank) const {
    return owned_.at(static_cast<std::size_t>(c)).at(static_cast<std::size_t>(rank));
  }
  [[nodiscard]] std::int64_t local_tokens(int c, int rank) const {
    std::int64_t n = 0;
    for (const Range& r : owned(c, rank)) n += r.size();
    return n;
  }
  /// Rows of the carry buffers on `rank`.
  [[nodiscard]] std::int64_t carry_rows(int rank) const { return carry_rows_.at(static_cast<std::size_t>(rank)); }
  /// Chunks whose tokens chunk c's prefixes cover (their forward must run before c's, their backward after).
  [[nodiscard]] const std::vector<int>& reads(int c) const { return reads_.at(static_cast<std::size_t>(c)); }
  /// Whether chunk c has a prefix (its prefix programs are collective over the world).
  [[nodiscard]] bool has_prefix(int c) const {
    for (const Range& p : prefix_.at(static_cast<std::size_t>(c)))
      if (!p.empty()) return true;
    return false;
  }

  /// Zeroes `rank`'s carry gradients: run once per batch, before any backward.
  [[nodiscard]] Program clear(int rank) const {
    Program p = base(-1, rank);
    if (carry_rows(rank) > 0) p.steps.push_back(ZeroStep{{BufferId::kDkCarry, BufferId::kDvCarry}});
    return p;
  }

  /// Chunk c's prefix forward on `rank`, run after the strategy's forward of the chunk: with `keep`,
  /// first the chunk's own carry rows into the carry (`keep = false`: a recompute).
  [[nodiscard]] Program forward(int c, int rank, bool keep) const {
    Program p = base(c, rank);
    if (keep) {
      const Kept k = kept(c, rank);
      if (!k.local.empty())
        p.steps.push_back(CopyStep{{LocalMove{BufferId::kK, BufferId::kKCarry, false, k.local, k.carry},
                                    LocalMove{BufferId::kV, BufferId::kVCarry, false, k.local, k.carry}}});
    }
    if (!has_prefix(c)) return p;
    const Fetch f = fetch(c, rank);
    add_prefix_staging(p, f, false);
    p.steps.push_back(f.exchange);
    if (!f.slices.empty()) {
      p.staging.push_back({BufferId::kOPart, p.local_tokens, shape_.heads_q});
      p.staging.push_back({BufferId::kLsePart, p.local_tokens, shape_.heads_q});
      ComputeStep cs;
      cs.merge = true;
      cs.k = BufferId::kKPrefix;
      cs.v = BufferId::kVPrefix;
      cs.waves = {f.slices};
      cs.head_groups = {all_heads()};
      p.steps.push_back(std::move(cs));
    }
    return p;
  }

  /// Chunk c's prefix backward on `rank`, run after the strategy's backward of the chunk (which wrote
  /// dQ, dK, dV): adds the prefix term's dQ, returns its dK/dV to the holders, and adds the carry
  /// gradients of the chunk's own rows to dK/dV.
  [[nodiscard]] Program backward(int c, int rank) const {
    Program p = base(c, rank);
    if (has_prefix(c)) {
      const Fetch f = fetch(c, rank);
      add_prefix_staging(p, f, true);
      p.steps.push_back(f.exchange);
      if (f.rows > 0) p.steps.push_back(ZeroStep{{BufferId::kDkPrefix, BufferId::kDvPrefix}});
      if (!f.slices.empty()) {
        ComputeStep cs;
        cs.backward = true;
        cs.k = BufferId::kKPrefix;
        cs.v = BufferId::kVPrefix;
        cs.dk = BufferId::kDkPrefix;
        cs.dv = BufferId::kDvPrefix;
        cs.waves = {f.slices};
        cs.head_groups = {all_heads()};
        p.steps.push_back(std::move(cs));
      }
      // The gradients go back the way the rows came, and are added where the rows are kept.
      ExchangeStep back{Level::kGroup, rank, {}};
      for (const Move& m : f.exchange.moves) {
        const bool is_k = m.src == BufferId::kKCarry;
        back.moves.push_back(Move{is_k ? BufferId::kDkPrefix : BufferId::kDvPrefix,
                                  is_k ? BufferId::kDkCarry : BufferId::kDvCarry, true, m.recv, m.send});
      }
      p.steps.push_back(std::move(back));
    }
    const Kept k = kept(c, rank);
    if (!k.local.empty())
      p.steps.push_back(CopyStep{{LocalMove{BufferId::kDkCarry, BufferId::kDk, true, k.carry, k.local},
                                  LocalMove{BufferId::kDvCarry, BufferId::kDv, true, k.carry, k.local}}});
    return p;
  }

 private:
  // Chunk c's carry rows on a rank: pieces of its local rows and the carry rows they are kept in.
  struct Kept {
    std::vector<Piece> local, carry;
  };
  // The prefix exchange of chunk c on a rank, the rows it gathers and the slices over them.
  struct Fetch {
    ExchangeStep exchange;
    std::int64_t rows = 0;
    std::vector<AttnSlice> slices;
  };

  [[nodiscard]] static bool covered(const std::vector<Range>& merged, const Range& r) {
    for (const Range& m : merged)
      if (m.begin <= r.begin && r.end <= m.end) return true;
    return false;
  }
  [[nodiscard]] static std::string to_string(const Range& r) {
    return "[" + std::to_string(r.begin) + ", " + std::to_string(r.end) + ")";
  }
  [[nodiscard]] HeadGroup all_heads() const noexcept { return {{0, shape_.heads_q}, {0, shape_.heads_kv}}; }
  [[nodiscard]] Piece kv_rows(std::int64_t first, std::int64_t n) const noexcept {
    return {{first, first + n}, {0, shape_.heads_kv}};
  }

  [[nodiscard]] Program base(int c, int rank) const {
    Program p;
    p.rank = rank;
    p.head_dim = shape_.qk_dim();
    p.head_dim_v = shape_.v_dim();
    p.softmax_scale = shape_.scale();
    p.local_tokens = c < 0 ? 0 : local_tokens(c, rank);
    p.carry_rows = carry_rows(rank);
    auto& members = p.level_members[static_cast<std::size_t>(Level::kGroup)];
    members.resize(static_cast<std::size_t>(ranks_));
    std::iota(members.begin(), members.end(), 0);
    return p;
  }

  // The carry row of global token g held by `rank` (g must be held there).
  [[nodiscard]] std::int64_t slot_of(int rank, std::int64_t g) const {
    const auto& h = held_[static_cast<std::size_t>(rank)];
    const auto it = std::upper_bound(h.begin(), h.end(), g, [](std::int64_t x, const Range& r) { return x < r.begin; });
    const auto i = static_cast<std::size_t>(it - h.begin()) - 1;
    return slots_[static_cast<std::size_t>(rank)][i] + (g - h[i].begin);
  }

  [[nodiscard]] Kept kept(int c, int rank) const {
    Kept k;
    std::int64_t row = 0;
    for (const Range& g : owned(c, rank)) {
      for (const Range& h : held_[static_cast<std::size_t>(rank)])
        if (const Range i = intersect(g, h); !i.empty()) {
          k.local.push_back(kv_rows(row + (i.begin - g.begin), i.size()));
          k.carry.push_back(kv_rows(slot_of(rank, i.begin), i.size()));
        }
      row += g.size();
    }
    return k;
  }

  // The rows of piece i of chunk c's prefix that rank s's queries read: the whole prefix when s holds
  // a query of the piece; with a window, from s's first query of the piece - (window - 1) (a suffix of
  // the prefix, empty when that query sits window - 1 or more past the piece's start).
  [[nodiscard]] Range wanted(int c, std::size_t i, int s) const {
    const Range t = tokens_[static_cast<std::size_t>(c)][i], pre = prefix_[static_cast<std::size_t>(c)][i];
    if (pre.empty()) return {pre.end, pre.end};
    std::int64_t first = t.end;
    for (const Range& g : owned(c, s))
      if (const Range x = intersect(g, t); !x.empty()) first = std::min(first, x.begin);
    if (first == t.end) return {pre.end, pre.end};
    if (window_ == 0) return pre;
    return {std::clamp(first - (window_ - 1), pre.begin, pre.end), pre.end};
  }

  // Pieces of chunk c whose prefix rank s's queries read, and the rows they read (wanted).
  [[nodiscard]] std::vector<std::pair<std::size_t, Range>> needs(int c, int s) const {
    std::vector<std::pair<std::size_t, Range>> out;
    for (std::size_t i = 0; i < tokens_[static_cast<std::size_t>(c)].size(); ++i)
      if (const Range w = wanted(c, i, s); !w.empty()) out.emplace_back(i, w);
    return out;
  }

  // Sender and receiver enumerate the same pieces in the same order: for each piece the receiver
  // needs (in chunk order), the holder's rows of its prefix (in global order).
  [[nodiscard]] Fetch fetch(int c, int me) const {
    const auto& tokens = tokens_[static_cast<std::size_t>(c)];
    const auto n = static_cast<std::size_t>(ranks_);
    Fetch f;
    f.exchange = ExchangeStep{Level::kGroup, me, {}};
    Move k{BufferId::kKCarry, BufferId::kKPrefix, false, std::vector<std::vector<Piece>>(n),
           std::vector<std::vector<Piece>>(n)};
    const auto& mine_held = held_[static_cast<std::size_t>(me)];
    for (int peer = 0; peer < ranks_; ++peer)
      for (const auto& [i, pre] : needs(c, peer))
        for (const Range& h : mine_held)
          if (const Range x = intersect(h, pre); !x.empty())
            k.send[static_cast<std::size_t>(peer)].push_back(kv_rows(slot_of(me, x.begin), x.size()));
    const std::vector<std::pair<std::size_t, Range>> mine = needs(c, me);
    std::vector<std::int64_t> piece_at;
    for (const auto& [i, pre] : mine) {
      piece_at.push_back(f.rows);
      f.rows += pre.size();
    }
    for (int peer = 0; peer < ranks_; ++peer)
      for (std::size_t j = 0; j < mine.size(); ++j) {
        const Range pre = mine[j].second;
        for (const Range& h : held_[static_cast<std::size_t>(peer)])
          if (const Range x = intersect(h, pre); !x.empty())
            k.recv[static_cast<std::size_t>(peer)].push_back(kv_rows(piece_at[j] + (x.begin - pre.begin), x.size()));
      }
    Move v = k;
    v.src = BufferId::kVCarry;
    v.dst = BufferId::kVPrefix;
    f.exchange.moves = {std::move(k), std::move(v)};
    // One slice per run of local rows of a piece: without a window its queries see the whole prefix
    // (full mask); with one, the keys of their windows (sliding window, the diagonal at the run's first
    // query), the run cut to the queries that see a prefix key and the keys to the run's first window.
    for (std::size_t j = 0; j < mine.size(); ++j) {
      const Range pre = mine[j].second;  // global rows, received at kKPrefix rows piece_at[j] on
      std::int64_t row = 0;
      for (const Range& g : owned(c, me)) {
        Range x = intersect(g, tokens[mine[j].first]);
        if (window_ > 0)
          x.end = std::min(x.end, seqpar::detail::add_sat(pre.end, window_ - 1));  // no wrap at INT64_MAX
        if (!x.empty()) {
          const Range q{row + (x.begin - g.begin), row + (x.end - g.begin)};
          if (window_ == 0) {
            f.slices.push_back({q, {piece_at[j], piece_at[j] + pre.size()}, Mask::full()});
          } else {
            const std::int64_t first_key = std::max(pre.begin, x.begin - (window_ - 1));
            f.slices.push_back({q,
                                {piece_at[j] + (first_key - pre.begin), piece_at[j] + pre.size()},
                                Mask::sliding_window(window_, x.begin - first_key)});
          }
        }
        row += g.size();
      }
    }
    return f;
  }

  void add_prefix_staging(Program& p, const Fetch& f, bool gradients) const {
    if (f.rows == 0) return;
    p.staging.push_back({BufferId::kKPrefix, f.rows, shape_.heads_kv});
    p.staging.push_back({BufferId::kVPrefix, f.rows, shape_.heads_kv});
    if (!gradients) return;
    p.staging.push_back({BufferId::kDkPrefix, f.rows, shape_.heads_kv});
    p.staging.push_back({BufferId::kDvPrefix, f.rows, shape_.heads_kv});
  }

  std::vector<std::vector<std::vector<Range>>> owned_;  ///< [chunk][rank] global rows in row order
  AttentionShape shape_;
  int ranks_ = 0;
  std::int64_t window_ = 0;                          ///< the chunks' sliding window, 0: none
  std::vector<std::vector<Range>> tokens_, prefix_;  ///< [chunk] the chunks' pieces and their (cut) prefixes
  std::vector<std::vector<Range>> held_;             ///< [rank] carry rows it keeps (merged, global order)
  std::vector<std::vector<std::int64_t>> slots_;     ///< [rank] first carry row of each held_ range
  std::vector<std::int64_t> carry_rows_;             ///< [rank]
  std::vector<std::vector<int>> reads_;              ///< [chunk] chunks whose tokens its prefixes cover
};

}  // namespace seqpar::comm
