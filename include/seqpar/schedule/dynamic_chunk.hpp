// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// `schedule::DynamicChunk`: DPP's workload-balanced chunking (InfiniPipe / Concertina, Alg. 1 of "Efficient
/// Long-Context LLM Training with Dynamic Pipeline Parallelism"). A batch becomes an ordered list of chunks:
///  - split chunks: every long document is cut by one slicing mesh into slices of equal *cost*
///    (causal attention makes later positions dearer, so later slices are shorter);
///  - batched chunks: short documents packed best-fit-decreasing under the token capacity and the
///    time target;
///  - hybrid chunks: a long document's tail slice (what remains after its last mesh cut) plus short
///    documents packed with it.
/// The mesh comes from the longest document: K slices of equal cost c(L) / K, whose cost is the time
/// target T_t. Because the cost of a slice depends only on its positions, the same mesh gives every
/// long document equal-cost slices and a cheaper tail. A slice's queries attend to its document's
/// earlier tokens too: the chunk names them as its prefix (carried from earlier chunks by
/// `ChunkedAttention`, never recomputed). Chunks are cut once per batch for every layer, like a
/// placement: a chunk's prefix is the whole of its document before it, and each layer's carry cuts it to
/// what that layer's mask sees (the last w - 1 tokens under a window of w: ChunkedAttention::begin's
/// mask). The cost model counts the pairs of the model's mask mix (`ChunkCost::masks`: a row of a
/// window-w layer sees min(i + 1, w) keys), so for an all-window model past the first w positions the
/// mesh's slices are of equal length. Chunks are ordered so that a document's slices
/// run in order and back to back: per long document (longest first) its split chunks, then the hybrid
/// chunk of its tail; then the batched chunks by cost.
///
/// Cost model (`ChunkCost`): time of document positions [a, b) = per_token * (b - a) +
/// per_pair * ((query, key) pairs of those rows, the layer-weighted mean over the model's mask mix) —
/// GEMMs per token, attention per pair, in any unit (e.g. seconds from `replay::`'s hardware profile,
/// or per_pair = 1 and per_token = 6 x hidden, the FLOP ratio of a transformer layer's GEMMs to its
/// attention).
///
/// @code
/// schedule::DynamicChunk sched{{.token_capacity = 16384}};          // K: the fewest slices that fit
/// for (const schedule::Chunk& c : sched.chunks(batch)) { ... }      // split, hybrid, batched
/// @endcode

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "seqpar/core/attention_mask.hpp"
#include "seqpar/core/chunk.hpp"
#include "seqpar/core/document_batch.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/hash.hpp"
#include "seqpar/core/range.hpp"
#include "seqpar/schedule/static.hpp"

namespace seqpar::schedule {

/// Linear cost of document positions: GEMMs per token plus attention per visible (query, key) pair.
struct ChunkCost {
  double per_token = 0.0;
  double per_pair = 1.0;
  /// The model's attention masks with their layer counts (empty: every layer causal): a row's pairs are
  /// the layer-weighted mean over them (row i of a window-w layer sees min(i + 1, w) keys).
  MaskMix masks{};

  /// Causal pairs of the rows [a, b) of a document: row i sees i + 1 keys.
  [[nodiscard]] static constexpr double pairs(std::int64_t a, std::int64_t b) noexcept {
    const auto tri = [](std::int64_t n) { return 0.5 * static_cast<double>(n) * static_cast<double>(n + 1); };
    return tri(b) - tri(a);
  }
  /// Pairs of the rows [a, b) under a sliding window of `w` keys (0: causal): row i sees min(i + 1, w).
  [[nodiscard]] static constexpr double pairs(std::int64_t a, std::int64_t b, std::int64_t w) noexcept {
    if (w <= 0) return pairs(a, b);
    const auto upto = [w](std::int64_t n) {  // rows [0, n)
      return n <= w ? pairs(0, n) : pairs(0, w) + static_cast<double>(n - w) * static_cast<double>(w);
    };
    return upto(b) - upto(a);
  }
  /// Cost of the rows [a, b) of one document.
  [[nodiscard]] double of(std::int64_t a, std::int64_t b) const {
    return per_token * static_cast<double>(b - a) +
           per_pair * masks.mean([a, b](AttentionMask m) { return pairs(a, b, m.window); });
  }
  /// The smallest x in [0, limit] with of(0, x) >= target (limit when none): bisection, since of(0, x) is
  /// non-decreasing in x for any mix (O(log limit) evaluations).
  [[nodiscard]] std::int64_t position_of(double target, std::int64_t limit) const {
    if (target <= 0) return 0;
    std::int64_t lo = 0, hi = limit;  // of(0, hi) >= target or hi == limit
    while (lo < hi) {
      const std::int64_t mid = lo + (hi - lo) / 2;
      if (of(0, mid) >= target)
        hi = mid;
      else
        lo = mid + 1;
    }
    return lo;
  }
  void validate(const char* where) const {
    masks.validate(where, "args.cost.masks");
    seqpar::detail::require(std::isfinite(per_token) && per_token >= 0, where, "args.cost.per_token", per_token,
                            "must be finite and >= 0");
    seqpar::detail::require(std::isfinite(per_pair) && per_pair >= 0 && per_pair + per_token > 0, where,
                            "args.cost.per_pair", per_pair, "must be finite and >= 0, and per_pair + per_token > 0");
  }
};

/// A piece of one document inside a chunk: document index (in the batch), rows [begin, end) of it.
struct ChunkPiece {
  int document = 0;
  std::int64_t begin = 0;
  std::int64_t end = 0;
};

/// The chunk plan with what it was made from (for tools, tests and the pipeline scheduler).
struct ChunkPlan {
  std::vector<Chunk> chunks;
  std::vector<std::vector<ChunkPiece>> pieces;  ///< per chunk, in the chunk's token order
  std::vector<std::int64_t> mesh;               ///< cut positions b_1 < ... < b_K = longest length
  double time_target = 0;                       ///< T_t after any loosening
  int slices = 0;                               ///< K
  /// DocumentBatch::fingerprint() of the batch chunked (0: not known, a hand-made plan): a plan kept from
  /// another batch of the same token count is refused where it is run (train::run_pipelined_step).
  std::uint64_t batch_fingerprint = 0;

  /// What every rank must hold alike to run the plan together (Hash64 of the batch's fingerprint and every
  /// chunk's ranges, prefixes and batch): compared in the step's agreement.
  [[nodiscard]] std::uint64_t fingerprint() const noexcept {
    return Hash64{}.add(batch_fingerprint).add(chunks_fingerprint(chunks)).value();
  }
};

struct DynamicChunk {
  using policy_category = scheduler_tag;
  /// Most slices one document is cut into (K, given or automatic). An equal-cost mesh needs about
  /// (longest / token_capacity)^2 slices (its first slice has longest / sqrt(K) tokens), whose last
  /// slices are a few tokens long, and everything downstream (the carry, the pipeline's backward order)
  /// grows with the chunk count; beyond this limit `plan` refuses, naming the capacity that would fit.
  static constexpr int kMaxSlices = 8192;
  struct Arguments {
    /// Most tokens in one chunk (DPP's T_m, the memory cap), >= 1.
    std::int64_t token_capacity = 0;
    /// Most cost in one chunk (T_t); 0: the cost of one mesh slice, c(longest) / slices.
    double time_target = 0;
    /// Slices of the longest document (K), at most kMaxSlices; 0: the fewest whose slices fit
    /// token_capacity (refused when that is more than kMaxSlices).
    int slices = 0;
    ChunkCost cost{};
  };
  Arguments args;

  [[nodiscard]] std::vector<Chunk> chunks(const DocumentBatch& batch) const { return plan(batch).chunks; }

  [[nodiscard]] ChunkPlan plan(const DocumentBatch& batch) const {
    constexpr const char* where = "schedule::DynamicChunk";
    seqpar::detail::require(args.token_capacity >= 1, where, "args.token_capacity", args.token_capacity,
                            "must be >= 1");
    seqpar::detail::require(args.slices >= 0 && args.slices <= kMaxSlices, where, "args.slices", args.slices,
                            "must be in [0, kMaxSlices = " + std::to_string(kMaxSlices) + "] (0 = automatic)");
    seqpar::detail::require(std::isfinite(args.time_target) && args.time_target >= 0, where, "args.time_target",
                            args.time_target, "must be finite and >= 0 (0 = one mesh slice)");
    args.cost.validate(where);
    seqpar::detail::require(batch.total_tokens() > 0, where, "batch.total_tokens()", batch.total_tokens(),
                            "an empty batch has nothing to chunk");
    const auto docs = batch.documents();
    std::int64_t longest = 0;
    for (const Document& d : docs) longest = std::max(longest, d.tokens.size());

    ChunkPlan out;
    out.batch_fingerprint = batch.fingerprint();
    out.slices = args.slices;
    if (out.slices == 0) out.slices = automatic_slices(longest, where);
    out.mesh = mesh(longest, out.slices);
    for (std::size_t i = 0; i < out.mesh.size(); ++i) {
      const std::int64_t len = out.mesh[i] - (i == 0 ? 0 : out.mesh[i - 1]);
      if (len > args.token_capacity)
        seqpar::detail::throw_invalid(where, "args.slices", args.slices,
                                      "slice " + std::to_string(i) + " of the longest document (" +
                                          std::to_string(longest) + " tokens) has " + std::to_string(len) +
                                          " tokens, more than args.token_capacity = " +
                                          std::to_string(args.token_capacity) + " (use more slices, or 0)");
    }
    const double slice_cost = args.cost.of(0, longest) / static_cast<double>(out.mesh.size());
    double target = args.time_target > 0 ? args.time_target : slice_cost;

    // Long documents: cut by the mesh. Every piece but the last is a full slice (its own chunk); the
    // last is full when the length is a mesh position, otherwise a tail that seeds a bucket.
    struct Bucket {
      std::vector<ChunkPiece> pieces;
      std::int64_t tokens = 0;
      double cost = 0;
      bool has_tail = false;
    };
    std::vector<int> order(docs.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return docs[static_cast<std::size_t>(a)].tokens.size() > docs[static_cast<std::size_t>(b)].tokens.size();
    });
    std::vector<std::vector<ChunkPiece>> split_chunks;
    std::vector<Bucket> buckets;
    std::vector<int> shorts;
    for (int di : order) {
      const std::int64_t n = docs[static_cast<std::size_t>(di)].tokens.size();
      if (n <= out.mesh.front()) {
        shorts.push_back(di);
        continue;
      }
      std::int64_t at = 0;
      for (std::int64_t cut : out.mesh) {
        if (cut > n) break;
        split_chunks.push_back({{di, at, cut}});
        at = cut;
      }
      if (at < n) buckets.push_back({{{di, at, n}}, n - at, args.cost.of(at, n), true});
    }
    // Short documents, dearest first, best fit: among the buckets with room, the one with the least
    // cost per token (the least long-document share); if none is under the time target, the target
    // is loosened to the cheapest fit (Alg. 1); if none has room, a new bucket.
    std::stable_sort(shorts.begin(), shorts.end(), [&](int a, int b) {
      return docs[static_cast<std::size_t>(a)].tokens.size() > docs[static_cast<std::size_t>(b)].tokens.size();
    });
    for (int di : shorts) {
      const std::int64_t n = docs[static_cast<std::size_t>(di)].tokens.size();
      const double c = args.cost.of(0, n);
      Bucket* best = nullptr;
      Bucket* cheapest = nullptr;
      for (Bucket& b : buckets) {
        if (b.tokens + n > args.token_capacity) continue;
        if (cheapest == nullptr || b.cost < cheapest->cost) cheapest = &b;
        if (b.cost + c > target) continue;
        const double ratio = b.cost / static_cast<double>(b.tokens);
        if (best == nullptr || ratio < best->cost / static_cast<double>(best->tokens)) best = &b;
      }
      if (best == nullptr && cheapest != nullptr && c <= target) {
        target = cheapest->cost + c;  // loosen T_t to the cheapest bucket that has room
        best = cheapest;
      }
      if (best == nullptr) {
        buckets.push_back({{}, 0, 0.0, false});
        best = &buckets.back();
      }
      best->pieces.push_back({di, 0, n});
      best->tokens += n;
      best->cost += c;
    }
    out.time_target = target;

    // Each long document's chunks run back to back (its slices, then the hybrid chunk of its tail),
    // longest document first: a pipeline can then run a document's backward (last slice first, as the
    // carried prefix requires) soon after its forward. The batched chunks follow, dearest first.
    std::vector<const Bucket*> hybrid_of(docs.size(), nullptr);
    for (const Bucket& b : buckets)
      if (b.has_tail) hybrid_of[static_cast<std::size_t>(b.pieces.front().document)] = &b;
    std::vector<const Bucket*> batched;
    for (const Bucket& b : buckets)
      if (!b.has_tail) batched.push_back(&b);
    std::stable_sort(batched.begin(), batched.end(),
                     [](const Bucket* a, const Bucket* b) { return a->cost > b->cost; });
    std::size_t next_split = 0;
    for (int di : order) {
      while (next_split < split_chunks.size() && split_chunks[next_split].front().document == di)
        add_chunk(batch, split_chunks[next_split++], ChunkKind::kSplit, out);
      if (const Bucket* b = hybrid_of[static_cast<std::size_t>(di)])
        add_chunk(batch, b->pieces, ChunkKind::kHybrid, out);
    }
    for (const Bucket* b : batched) add_chunk(batch, b->pieces, ChunkKind::kBatched, out);
    return out;
  }

  /// The fewest slices K whose equal-cost mesh of a `longest`-token document has a first slice (the
  /// longest in tokens) of at most token_capacity tokens. The first cut, position_of(c(L) / K), does
  /// not grow with K, so K is found by bisection on [1, kMaxSlices]: O(log kMaxSlices), each step
  /// O(1) (was a search growing K one by one, each step building a mesh: O(K^2) meshes' worth, minutes
  /// at 1M tokens). Throws std::invalid_argument when more than kMaxSlices would be needed.
  [[nodiscard]] int automatic_slices(std::int64_t longest, const char* where) const {
    const double total = args.cost.of(0, longest);
    const auto first_cut = [&](int k) {
      return k == 1 ? longest : std::max<std::int64_t>(1, args.cost.position_of(total / k, longest));
    };
    if (first_cut(kMaxSlices) > args.token_capacity) {
      // The capacity whose mesh of kMaxSlices slices fits: its first slice.
      seqpar::detail::throw_invalid(where, "args.token_capacity", args.token_capacity,
                                    "cutting the longest document (" + std::to_string(longest) +
                                        " tokens) into slices of at most that many tokens needs more than "
                                        "kMaxSlices = " +
                                        std::to_string(kMaxSlices) + " slices; use a capacity of at least " +
                                        std::to_string(first_cut(kMaxSlices)) + " tokens");
    }
    int lo = 1, hi = kMaxSlices;  // first_cut(hi) fits; find the smallest k that fits
    while (lo < hi) {
      const int mid = lo + (hi - lo) / 2;
      if (first_cut(mid) <= args.token_capacity)
        hi = mid;
      else
        lo = mid + 1;
    }
    return lo;
  }

  /// Cut positions b_1 < ... < b_K = length of K equal-cost slices of a document of `length` tokens
  /// (fewer when length < K: a slice has at least one token).
  [[nodiscard]] std::vector<std::int64_t> mesh(std::int64_t length, int slices) const {
    const double total = args.cost.of(0, length);
    std::vector<std::int64_t> cuts;
    for (int i = 1; i <= slices; ++i) {
      const std::int64_t x =
          i == slices ? length : args.cost.position_of(total * static_cast<double>(i) / slices, length);
      if (x > (cuts.empty() ? 0 : cuts.back())) cuts.push_back(x);
    }
    return cuts;
  }

  /// The prefix of the piece of document `d` starting at its row `begin`: the document's earlier tokens
  /// its queries can see under a mask of `window` keys: all of them without a window (0, what a chunk
  /// carries: each layer's carry cuts it to its mask), the last window - 1 with one.
  [[nodiscard]] static Range prefix_of(const Document& d, std::int64_t begin, std::int64_t window = 0) noexcept {
    return visible_prefix({d.tokens.begin, d.tokens.begin + begin}, window);
  }

 private:
  // A chunk batch keeps the pieces' sequences apart (one chunk sequence per original sequence,
  // in order), so that batch-aware partitioners still see sequences.
  void add_chunk(const DocumentBatch& batch, std::vector<ChunkPiece> pieces, ChunkKind kind, ChunkPlan& out) const {
    const auto docs = batch.documents();
    std::stable_sort(pieces.begin(), pieces.end(), [&](const ChunkPiece& a, const ChunkPiece& b) {
      return docs[static_cast<std::size_t>(a.document)].sequence < docs[static_cast<std::size_t>(b.document)].sequence;
    });
    std::vector<std::vector<std::int64_t>> sequences;
    int last = -1;
    Chunk c;
    c.kind = kind;
    for (const ChunkPiece& p : pieces) {
      const Document& d = docs[static_cast<std::size_t>(p.document)];
      if (d.sequence != last) sequences.emplace_back();
      last = d.sequence;
      sequences.back().push_back(p.end - p.begin);
      c.tokens.push_back({d.tokens.begin + p.begin, d.tokens.begin + p.end});
      c.prefix.push_back(prefix_of(d, p.begin));
      c.cost += args.cost.of(p.begin, p.end);
    }
    c.batch = DocumentBatch(sequences);
    out.chunks.push_back(std::move(c));
    out.pieces.push_back(std::move(pieces));
  }
};

static_assert(Scheduler<DynamicChunk>);

}  // namespace seqpar::schedule
