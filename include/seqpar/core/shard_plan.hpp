// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "seqpar/core/attention_mask.hpp"
#include "seqpar/core/attn_slice.hpp"
#include "seqpar/core/document_batch.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/topology.hpp"

namespace seqpar {

/// max/mean ratios of a plan: 1.0 is perfect balance.
struct Balance {
  double token_imbalance = 1.0;    ///< max over ranks of owned tokens / mean
  double compute_imbalance = 1.0;  ///< max over ranks of slice area / mean
  std::int64_t max_tokens = 0;
  std::int64_t max_area = 0;
};

/// Who holds which tokens of a batch: made once per batch by a partitioner (balanced for the model's
/// mask mix) and kept for every layer, whatever mask each layer's call uses. The model's activations
/// follow it: rank r's local rows are the concatenation of owned[r], in order.
///  - owned[r]: ordered global token ranges;
///  - groups: disjoint ordered rank lists that cover the world (BASP groups; one group of every rank
///    otherwise). A group attends only to its own tokens; communicators run inside each group.
struct Placement {
  Topology topology;
  std::vector<std::vector<Range>> owned;
  std::vector<std::vector<int>> groups;
  /// DocumentBatch::fingerprint() of the batch placed (set by Strategy::place, hence by every
  /// DistributedAttention plan); 0 = not known (a hand-built plan or a partitioner called directly),
  /// then not checked. train::token_meta refuses a placement whose fingerprint is not its batch's.
  std::uint64_t batch_fingerprint = 0;

  [[nodiscard]] int world_size() const noexcept { return static_cast<int>(owned.size()); }

  [[nodiscard]] std::int64_t local_tokens(int rank) const noexcept {
    std::int64_t n = 0;
    for (const Range& r : owned[static_cast<std::size_t>(rank)]) n += r.size();
    return n;
  }

  /// The group rank belongs to (index into groups).
  [[nodiscard]] int group_of(int rank) const noexcept {
    for (std::size_t g = 0; g < groups.size(); ++g)
      if (std::find(groups[g].begin(), groups[g].end(), rank) != groups[g].end()) return static_cast<int>(g);
    return -1;
  }

  /// The placement part of a plan.
  [[nodiscard]] const Placement& placement() const noexcept { return *this; }

  /// Checks the invariants every partitioner keeps; throws std::logic_error naming the broken one:
  /// every token owned exactly once and groups a partition of the ranks.
  void check_invariants(const DocumentBatch& batch) const {
    const auto fail = [](const std::string& what) { throw std::logic_error("Placement: " + what); };
    if (world_size() != topology.world_size)
      fail("owned sized " + std::to_string(owned.size()) + " for world size " + std::to_string(topology.world_size));
    std::vector<Range> all;
    for (const auto& rs : owned)
      for (const Range& r : rs)
        if (!r.empty()) all.push_back(r);
    std::sort(all.begin(), all.end(), [](Range a, Range b) { return a.begin < b.begin; });
    std::int64_t next = 0;
    for (const Range& r : all) {
      if (r.begin != next) fail("token " + std::to_string(std::min(next, r.begin)) + " owned zero or two times");
      next = r.end;
    }
    if (next != batch.total_tokens()) fail("tokens from " + std::to_string(next) + " are not owned");
    std::vector<int> seen(static_cast<std::size_t>(world_size()), 0);
    for (const auto& g : groups)
      for (int r : g) {
        if (r < 0 || r >= world_size()) fail("group member " + std::to_string(r) + " out of range");
        ++seen[static_cast<std::size_t>(r)];
      }
    for (int r = 0; r < world_size(); ++r)
      if (seen[static_cast<std::size_t>(r)] != 1) fail("rank " + std::to_string(r) + " is not in exactly one group");
  }

  friend bool operator==(const Placement& a, const Placement& b) {
    return a.topology.world_size == b.topology.world_size && a.topology.ranks_per_node == b.topology.ranks_per_node &&
           a.owned == b.owned && a.groups == b.groups && a.batch_fingerprint == b.batch_fingerprint;
  }
};

/// A placement and the attention one mask asks of it: slices[r] is rank r's work in *global* token
/// indices, q_ranges inside owned[r], k_ranges anywhere (communicators turn them into local rows after
/// moving KV). Derived from the placement (`slice`), never the other way round: a full and a window
/// layer of one batch have two ShardPlans over one Placement.
struct ShardPlan : Placement {
  std::vector<std::vector<AttnSlice>> slices;
  /// The mask the slices are for.
  AttentionMask mask;

  [[nodiscard]] Balance balance() const {
    Balance b;
    const auto n = static_cast<double>(owned.size());
    double tok_sum = 0, area_sum = 0;
    for (int r = 0; r < world_size(); ++r) {
      const std::int64_t t = local_tokens(r);
      const std::int64_t a = total_area(slices[static_cast<std::size_t>(r)]);
      b.max_tokens = std::max(b.max_tokens, t);
      b.max_area = std::max(b.max_area, a);
      tok_sum += static_cast<double>(t);
      area_sum += static_cast<double>(a);
    }
    b.token_imbalance = tok_sum > 0 ? static_cast<double>(b.max_tokens) / (tok_sum / n) : 1.0;
    b.compute_imbalance = area_sum > 0 ? static_cast<double>(b.max_area) / (area_sum / n) : 1.0;
    return b;
  }

  /// The placement's invariants, then: slices inside owned tokens, and the slice areas adding up to the
  /// batch's attention area under the plan's mask.
  void check_invariants(const DocumentBatch& batch) const {
    const auto fail = [](const std::string& what) { throw std::logic_error("ShardPlan: " + what); };
    if (slices.size() != owned.size())
      fail("owned/slices sized " + std::to_string(owned.size()) + "/" + std::to_string(slices.size()));
    Placement::check_invariants(batch);
    std::int64_t area = 0;
    for (int r = 0; r < world_size(); ++r)
      for (const AttnSlice& s : slices[static_cast<std::size_t>(r)]) {
        const auto& rs = owned[static_cast<std::size_t>(r)];
        const bool inside = std::any_of(rs.begin(), rs.end(),
                                        [&](Range o) { return s.q_range.begin >= o.begin && s.q_range.end <= o.end; });
        if (!inside) fail("rank " + std::to_string(r) + " has a slice whose queries it does not own");
        area += s.area();
      }
    if (area != batch.attention_area(mask))
      fail("slice area " + std::to_string(area) + " != the batch's attention area " +
           std::to_string(batch.attention_area(mask)) + " under " + mask.to_string());
  }
};

namespace detail {

/// The slice of the query rows `q` of document `doc` (q inside doc.tokens): causal over the document's
/// prefix, aligned at q's offset. With a window w its keys start w - 1 tokens before q (or at the
/// document's start): keys further back are in no query's window, so no communicator fetches them and no
/// kernel reads them. The window binds only where q's last row sees less than its whole prefix;
/// otherwise the causal mask is the same pairs and keeps the kernels' causal path (and diagonal-run
/// merging).
[[nodiscard]] inline AttnSlice document_slice(const Document& doc, Range q, std::int64_t window) noexcept {
  if (window > 0 && q.end - window > doc.tokens.begin) {
    const std::int64_t first_key = std::max(doc.tokens.begin, q.begin - window + 1);
    return {q, {first_key, q.end}, Mask::sliding_window(window, q.begin - first_key)};
  }
  return {q, {doc.tokens.begin, q.end}, Mask::causal(q.begin - doc.tokens.begin)};
}

/// The visible (query, key) pairs of the document-causal attention of the query tokens `owned` (global
/// ranges) under `mask`: the total area of document_causal_slices_for(owned, batch, mask), without
/// building the slice list (Hybrid's threshold sweep sums it for every candidate). O(pieces x log
/// documents), no allocation.
[[nodiscard]] inline std::int64_t document_causal_area_for(const std::vector<Range>& owned, const DocumentBatch& batch,
                                                           AttentionMask mask = {}) {
  const auto docs = batch.documents();
  std::int64_t area = 0;
  for (const Range& piece : owned) {
    if (piece.empty()) continue;
    auto it = std::upper_bound(docs.begin(), docs.end(), piece.begin,
                               [](std::int64_t t, const Document& d) { return t < d.tokens.end; });
    for (; it != docs.end() && it->tokens.begin < piece.end; ++it) {
      const Range q = intersect(piece, it->tokens);
      if (!q.empty()) area += document_slice(*it, q, mask.window).area();
    }
  }
  return area;
}

/// Document-causal slices of the query tokens `owned` (global ranges) under `mask`: each piece of a document gets
/// one causal slice over the document's prefix up to the piece's end, aligned at the piece's offset.
/// With a window w the slice's keys start w - 1 tokens before the piece (or at the document's start):
/// keys further back are in no query's window, so no communicator fetches them and no kernel reads them.
/// Consecutive one-token documents of one sequence inside one owned range are one diagonal slice
/// (append_slice): the same pairs, but a million of them are not a million slices.
[[nodiscard]] inline std::vector<AttnSlice> document_causal_slices_for(const std::vector<Range>& owned,
                                                                       const DocumentBatch& batch,
                                                                       AttentionMask mask = {}) {
  std::vector<AttnSlice> out;
  const std::int64_t w = mask.window;
  const auto docs = batch.documents();
  const auto ends_after = [](std::int64_t t, const Document& d) { return t < d.tokens.end; };
  auto cursor = docs.begin();  // the last document the previous piece touched: pieces mostly ascend
  for (const Range& piece : owned) {
    if (piece.empty()) continue;
    // First document that ends after piece.begin: galloping from the cursor, O(log gap) per piece
    // (a binary search over all documents per piece was most of planning a million Per-Doc pieces).
    if (cursor != docs.begin() && std::prev(cursor)->tokens.end > piece.begin) cursor = docs.begin();
    auto it = cursor;
    for (std::ptrdiff_t stride = 1; it != docs.end() && it->tokens.end <= piece.begin; stride *= 2) {
      const auto hi = docs.end() - it > stride ? it + stride : docs.end();
      if (hi == docs.end() || hi->tokens.end > piece.begin) {
        it = std::upper_bound(it, hi, piece.begin, ends_after);
        break;
      }
      it = hi;
    }
    cursor = it;
    int run_sequence = -1;  // sequence of the diagonal run out.back() may continue
    for (; it != docs.end() && it->tokens.begin < piece.end; ++it) {
      cursor = it;
      const Range q = intersect(piece, it->tokens);
      if (q.empty()) continue;
      const AttnSlice s = document_slice(*it, q, w);
      if (it->sequence == run_sequence)
        append_slice(out, s);  // BatchAware requires that no slice crosses sequences
      else
        out.push_back(s);
      run_sequence = it->sequence;
    }
  }
  return out;
}

}  // namespace detail

/// The plan of one mask over a placement: every rank's document-causal slices of its owned tokens under
/// `mask`. What every partitioner's plan is (their slices are their placement's document-causal
/// attention), so a placement made once per batch serves every mask. O(pieces x log documents).
[[nodiscard]] inline ShardPlan slice(Placement placement, const DocumentBatch& batch, AttentionMask mask) {
  ShardPlan p;
  static_cast<Placement&>(p) = std::move(placement);
  p.mask = mask;
  p.slices.resize(p.owned.size());
  for (std::size_t r = 0; r < p.owned.size(); ++r)
    p.slices[r] = detail::document_causal_slices_for(p.owned[r], batch, mask);
  return p;
}

}  // namespace seqpar
