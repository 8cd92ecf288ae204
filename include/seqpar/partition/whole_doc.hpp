// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "seqpar/partition/partitioner.hpp"
#include "seqpar/partition/zigzag.hpp"

namespace seqpar::partition {
namespace detail {

/// Planning cost of a whole document of s tokens: its visible pairs per layer under the model's mask
/// mix (s(s+1)/2 for causal layers, fewer for sliding-window ones: MaskMix::document_area), plus
/// linear_weight per token (the per-token work of the layer that does not grow with context, in units
/// of pairs).
[[nodiscard]] inline double document_cost(std::int64_t s, double linear_weight, const MaskMix& mix = {}) {
  return mix.document_area(s) + linear_weight * static_cast<double>(s);
}

/// Token capacity per rank: ceil(capacity_factor * T / P), never below ceil(T / P).
[[nodiscard]] inline std::int64_t token_capacity(std::int64_t total, int ranks, double capacity_factor) {
  const std::int64_t even = (total + ranks - 1) / ranks;
  const auto scaled =
      static_cast<std::int64_t>(std::ceil(capacity_factor * static_cast<double>(total) / static_cast<double>(ranks)));
  return std::max(even, scaled);
}

/// Items of equal length and cost are interchangeable for every balance figure: this gives each rank
/// its share of them as one run in item order, lowest rank first (the same per-rank multiset of items,
/// so the same tokens and load everywhere). LPT deals equal items round-robin, which left a million
/// one-token documents as a million single-token ranges and slices; in runs, adjacent documents stay
/// on one rank and merge into one owned range and a few slices. `order` lists the items with equal
/// ones adjacent and in ascending index among themselves (what pack_whole's stable sorts give).
inline void keep_equal_items_together(const std::vector<std::int64_t>& lengths, const std::vector<double>& costs,
                                      const std::vector<std::size_t>& order, std::vector<int>& where) {
  std::vector<std::int64_t> count(
      where.empty() ? 0 : static_cast<std::size_t>(*std::max_element(where.begin(), where.end())) + 1, 0);
  const auto same = [&](std::size_t a, std::size_t b) { return lengths[a] == lengths[b] && costs[a] == costs[b]; };
  for (std::size_t a = 0; a < order.size();) {
    std::size_t b = a + 1;
    while (b < order.size() && same(order[a], order[b])) ++b;
    for (std::size_t i = a; i < b; ++i) ++count[static_cast<std::size_t>(where[order[i]])];
    std::size_t r = 0;  // counting sort of the group's ranks, handed out in item order
    for (std::size_t i = a; i < b; ++i) {
      while (count[r] == 0) ++r;
      where[order[i]] = static_cast<int>(r);
      --count[r];
    }
    a = b;
  }
}

/// Places whole items (length, cost) onto `ranks`, each already holding `tokens[r]` tokens and
/// `load[r]` cost, so that no rank exceeds `capacity` tokens. Returns the rank of each item, or
/// nothing when it found no placement.
/// First LPT on cost (largest first, onto the least-loaded rank that still has room), which is
/// within 4/3 of the optimal makespan when the capacity does not bind; if the capacity blocks it,
/// a second pass places items by tokens (largest first onto the emptiest rank), which fits whenever
/// the largest item fits in the room left after an even spread. Equal items end up in runs
/// (keep_equal_items_together).
[[nodiscard]] inline std::optional<std::vector<int>> pack_whole(const std::vector<std::int64_t>& lengths,
                                                                const std::vector<double>& costs,
                                                                std::vector<std::int64_t> tokens,
                                                                std::vector<double> load, std::int64_t capacity) {
  const std::size_t n = lengths.size();
  const auto ranks = tokens.size();
  std::vector<std::size_t> order(n);
  for (std::size_t i = 0; i < n; ++i) order[i] = i;
  std::vector<int> where(n, -1);
  {
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return costs[a] != costs[b] ? costs[a] > costs[b] : lengths[a] > lengths[b];
    });
    auto t = tokens;
    auto l = load;
    bool ok = true;
    for (std::size_t i : order) {
      int best = -1;
      for (std::size_t r = 0; r < ranks; ++r) {
        if (t[r] + lengths[i] > capacity) continue;
        if (best < 0 || l[r] < l[static_cast<std::size_t>(best)] ||
            (l[r] == l[static_cast<std::size_t>(best)] && t[r] < t[static_cast<std::size_t>(best)]))
          best = static_cast<int>(r);
      }
      if (best < 0) {
        ok = false;
        break;
      }
      where[i] = best;
      t[static_cast<std::size_t>(best)] += lengths[i];
      l[static_cast<std::size_t>(best)] += costs[i];
    }
    if (ok) {
      keep_equal_items_together(lengths, costs, order, where);
      return where;
    }
  }
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return lengths[a] > lengths[b]; });
  for (std::size_t i : order) {
    const auto it = std::min_element(tokens.begin(), tokens.end());
    if (*it + lengths[i] > capacity) return std::nullopt;
    *it += lengths[i];
    where[i] = static_cast<int>(it - tokens.begin());
  }
  keep_equal_items_together(lengths, costs, order, where);
  return where;
}

}  // namespace detail

/// Whole-document placement: no document is split; documents are bin-packed onto ranks by their
/// cost s(s+1)/2 + linear_weight * s, longest (costliest) first onto the least-loaded rank (LPT),
/// subject to a token capacity of ceil(capacity_factor * T / P) per rank. Each rank's owned ranges
/// are its documents in global order (adjacent ones merged).
///
/// Balance: token counts <= capacity always. When the capacity does not bind, LPT keeps the max
/// per-rank cost within 4/3 of optimal and within (mean + largest document cost); a document whose
/// own cost exceeds the mean cannot be balanced at all (Hybrid splits such documents).
/// `linear_weight` is the per-token cost of the work that does not grow with context (projections,
/// MLP, kernel row overhead) in units of attention pairs; 0 balances attention only.
///
/// Communication: none for attention: every document's KV is already local (the attention step of a
/// Whole-Doc plan needs no ring or all-gather). Memory: <= capacity tokens per rank.
/// Refuses (can_implement) a document longer than the capacity, a capacity_factor below 1, or a mix
/// that both packing passes fail to fit. From FlashCP's Whole-Doc sharding.
///
/// @code
/// partition::WholeDoc wd{{.capacity_factor = 1.5}};
/// if (auto st = wd.can_implement(batch, topo); !st) throw std::runtime_error(st.reason);
/// auto plan = wd.plan(batch, topo);
/// @endcode
struct WholeDoc {
  using policy_category = partitioner_tag;
  struct Arguments {
    double capacity_factor = 1.25;  ///< per-rank token capacity = capacity_factor * T / P (>= 1)
    double linear_weight = 0.0;     ///< cost per token, in attention pairs, added to s(s+1)/2 (>= 0)
    /// fn(name, value) for each field, compared across ranks (Strategy::for_each_argument).
    template <class Fn>
    void for_each_argument(Fn&& fn) const {
      fn("capacity_factor", capacity_factor);
      fn("linear_weight", linear_weight);
    }
  };
  Arguments args;

  [[nodiscard]] std::int64_t capacity(const DocumentBatch& batch, const Topology& topo) const {
    return detail::token_capacity(batch.total_tokens(), topo.world_size, args.capacity_factor);
  }

  [[nodiscard]] Status can_implement(const DocumentBatch& batch, const Topology& topo, const MaskMix& mix = {}) const {
    std::string why;
    (void)ranks_of_documents(batch, topo, mix, &why);
    return why.empty() ? Status::success() : Status::refuse(why);
  }

  /// Whole documents packed under the capacity, balanced for the mix's layer-weighted work.
  [[nodiscard]] Placement place(const DocumentBatch& batch, const Topology& topo, const MaskMix& mix = {}) const {
    topo.validate("partition::WholeDoc");
    std::string why;
    const auto where = ranks_of_documents(batch, topo, mix, &why);
    if (!where) throw std::invalid_argument("partition::WholeDoc: " + why);
    Placement p;
    p.topology = topo;
    p.owned.resize(static_cast<std::size_t>(topo.world_size));
    const auto docs = batch.documents();
    for (std::size_t i = 0; i < docs.size(); ++i)
      append_range(p.owned[static_cast<std::size_t>((*where)[i])], docs[i].tokens);
    detail::finish_single_group(p);
    return p;
  }
  [[nodiscard]] ShardPlan plan(const DocumentBatch& batch, const Topology& topo, AttentionMask mask = {}) const {
    return slice(place(batch, topo, MaskMix::only(mask)), batch, mask);
  }

 private:
  // Rank of every document, or nothing with the reason in *why.
  [[nodiscard]] std::optional<std::vector<int>> ranks_of_documents(const DocumentBatch& batch, const Topology& topo,
                                                                   const MaskMix& mix, std::string* why) const {
    if (topo.world_size < 1 || topo.ranks_per_node < 1) {
      *why = "world_size and ranks_per_node must be >= 1";
      return std::nullopt;
    }
    if (!(args.capacity_factor >= 1.0) || !std::isfinite(args.capacity_factor)) {
      *why = "capacity_factor = " + std::to_string(args.capacity_factor) + " must be finite and >= 1";
      return std::nullopt;
    }
    if (!(args.linear_weight >= 0.0) || !std::isfinite(args.linear_weight)) {
      *why = "linear_weight = " + std::to_string(args.linear_weight) + " must be finite and >= 0";
      return std::nullopt;
    }
    const std::int64_t cap = capacity(batch, topo);
    const auto docs = batch.documents();
    std::vector<std::int64_t> lengths(docs.size());
    std::vector<double> costs(docs.size());
    for (std::size_t i = 0; i < docs.size(); ++i) {
      lengths[i] = docs[i].tokens.size();
      costs[i] = detail::document_cost(lengths[i], args.linear_weight, mix);
      if (lengths[i] > cap) {
        *why = "document " + std::to_string(i) + " has " + std::to_string(lengths[i]) +
               " tokens, more than the per-rank capacity of " + std::to_string(cap) +
               " tokens; raise capacity_factor or split long documents (PerDoc, Hybrid)";
        return std::nullopt;
      }
    }
    const auto n = static_cast<std::size_t>(topo.world_size);
    auto where = detail::pack_whole(lengths, costs, std::vector<std::int64_t>(n, 0), std::vector<double>(n, 0.0), cap);
    if (!where)
      *why = "no placement of whole documents fits the per-rank capacity of " + std::to_string(cap) +
             " tokens; raise capacity_factor";
    return where;
  }
};

static_assert(Partitioner<WholeDoc>);

}  // namespace seqpar::partition
