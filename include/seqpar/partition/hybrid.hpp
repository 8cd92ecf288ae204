// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "seqpar/partition/partitioner.hpp"
#include "seqpar/partition/per_doc.hpp"
#include "seqpar/partition/whole_doc.hpp"
#include "seqpar/partition/zigzag.hpp"

namespace seqpar::partition {

/// KV tokens rank `rank` must receive to run its slices: the union of its slices' k_ranges minus the
/// tokens it owns (sharding-aware communication: a rank receives only the keys its slices read).
[[nodiscard]] inline std::int64_t received_kv_tokens(const ShardPlan& plan, int rank) {
  const auto by_begin = [](Range a, Range b) { return a.begin < b.begin; };
  std::vector<Range> need;
  for (const AttnSlice& s : plan.slices[static_cast<std::size_t>(rank)])
    if (!s.k_range.empty()) need.push_back(s.k_range);
  std::sort(need.begin(), need.end(), by_begin);
  std::vector<Range> own(plan.owned[static_cast<std::size_t>(rank)].begin(),
                         plan.owned[static_cast<std::size_t>(rank)].end());
  std::sort(own.begin(), own.end(), by_begin);
  std::int64_t needed = 0, have = 0, covered_to = std::numeric_limits<std::int64_t>::min();
  std::size_t j = 0;
  for (const Range& k : need) {
    // Walk the part of k not already counted.
    const Range fresh{std::max(k.begin, covered_to), k.end};
    if (fresh.empty()) continue;
    covered_to = fresh.end;
    needed += fresh.size();
    while (j < own.size() && own[j].end <= fresh.begin) ++j;
    for (std::size_t i = j; i < own.size() && own[i].begin < fresh.end; ++i) have += intersect(own[i], fresh).size();
  }
  return needed - have;
}

/// What a Hybrid cost function sees of one candidate placement under one mask of the model's mix (a
/// candidate is scored under every mask of the mix, weighted by its layers). Spans are indexed by rank.
struct HybridCandidate {
  const DocumentBatch& batch;
  const ShardPlan& plan;                 ///< the candidate placement, sliced for one mask of the mix (plan.mask)
  std::int64_t threshold;                ///< documents longer than this are Per-Doc
  std::span<const std::int64_t> tokens;  ///< owned tokens per rank
  std::span<const std::int64_t> area;    ///< attention pairs per rank (slice area)
  std::span<const std::int64_t> received_kv_tokens;  ///< KV tokens each rank must receive
};

/// Replaceable cost of a candidate plan (lower is better): the seam where a real cost model plugs in.
using HybridCostFunction = std::function<double(const HybridCandidate&)>;

/// The default proxy: the slowest rank's time, where rank r's time is its compute plus the part of its
/// KV traffic that its compute cannot hide:
///   compute_r = compute_weight * area_r,  comm_r = comm_weight * received_kv_tokens_r,
///   time_r = compute_r + max(0, comm_r - overlap * compute_r),   cost = max_r time_r.
/// overlap = 0 is fully exposed communication; overlap = 1 hides traffic up to the compute time.
[[nodiscard]] inline double hybrid_proxy_cost(const HybridCandidate& c, double compute_weight, double comm_weight,
                                              double overlap) {
  double worst = 0.0;
  for (std::size_t r = 0; r < c.area.size(); ++r) {
    const double compute = compute_weight * static_cast<double>(c.area[r]);
    const double comm = comm_weight * static_cast<double>(c.received_kv_tokens[r]);
    worst = std::max(worst, compute + std::max(0.0, comm - overlap * compute));
  }
  return worst;
}

/// A Hybrid placement together with the choice that produced it.
struct HybridReport {
  /// The chosen placement, sliced for the first mask of the mix it was balanced for (the only one when
  /// planned for one mask); tokens, area and received_kv_tokens are this plan's.
  ShardPlan plan;
  std::int64_t threshold = 0;    ///< chosen: documents longer than this were cut Per-Doc
  double cost = 0.0;             ///< cost of the chosen candidate: the cost function's, layer-weighted over the mix
  int per_doc_documents = 0;     ///< how many documents were cut Per-Doc
  int candidates_evaluated = 0;  ///< feasible thresholds the sweep costed
  std::vector<std::int64_t> tokens, area, received_kv_tokens;  ///< per rank, of the chosen plan
};

/// FlashCP-style hybrid sharding: documents longer than a threshold tau are cut Per-Doc (2P head-tail
/// chunks across all ranks, balanced by construction but needing KV from every rank), the others stay
/// whole and are LPT-packed by cost s(s+1)/2 + linear_weight*s onto the ranks on top of the Per-Doc
/// load, within ceil(capacity_factor*T/P) tokens per rank (no KV traffic for them).
/// tau is swept over 0 and the distinct document lengths (at most max_candidates of them, log-spaced;
/// or fixed by `threshold`); each candidate
/// plan is scored by `cost` (default: hybrid_proxy_cost with compute_weight per attention pair,
/// comm_weight per received KV token (sharding-aware) and `overlap`), and among the candidates within
/// (1 + tolerance) of the cheapest the largest tau wins (fewer split documents: less traffic, larger
/// kernel tiles for the same modelled time). `plan_with_report` returns tau, its cost and per-rank
/// figures; a real cost model replaces the proxy through `cost`.
///
/// Balance: tau = 0 is exactly PerDoc, so the chosen plan costs at most (1 + tolerance) times PerDoc's
/// under the same cost function; a single document is Per-Doc (= Zigzag) unless it fits a rank whole.
/// Token counts <= capacity. On 128K-token lognormal mixes (median 1-4K) at P = 8 the default proxy
/// gives compute imbalance <= ~1.01 while splitting only the longest documents.
/// Default weights: one received KV token costs as much as 256 attention pairs (bf16, Hq=32, Hkv=8,
/// d=128: 4*d*Hq FLOPs per pair at ~400 TFLOP/s vs 4*Hkv*d bytes per KV token at ~400 GB/s), and KV
/// traffic up to half a rank's compute hides behind it (prefetch of the next chunk's KV).
///
/// Communication: only Per-Doc documents move KV (rank r reads chunks 0..2P-1-r of each).
/// Cost of planning: O(L * (D*P + pieces log pieces)) for L distinct lengths and D documents.
/// From FlashCP (Whole-Doc for short documents, Per-Doc with sharding-aware KV for long ones).
///
/// @code
/// partition::Hybrid h{{.comm_weight = 128.0}};
/// auto report = h.plan_with_report(batch, Topology{8, 8});   // report.threshold, report.plan
/// @endcode
struct Hybrid {
  using policy_category = partitioner_tag;
  struct Arguments {
    double capacity_factor = 1.25;            ///< per-rank token capacity = capacity_factor * T / P (>= 1)
    double linear_weight = 0.0;               ///< per-token cost added to s(s+1)/2 when packing whole documents
    double compute_weight = 1.0;              ///< proxy cost of one attention pair
    double comm_weight = 256.0;               ///< proxy cost of one received KV token
    double overlap = 0.5;                     ///< proxy: fraction of a rank's compute that hides its KV traffic
    double tolerance = 0.01;                  ///< prefer the largest tau within (1 + tolerance) of the best cost
    std::optional<std::int64_t> threshold{};  ///< fixed tau (>= 0); empty = sweep
    int max_candidates = 64;                  ///< sweep at most this many thresholds (0 and log-spaced lengths)
    HybridCostFunction cost{};                ///< empty = hybrid_proxy_cost(compute_weight, comm_weight, overlap)
    /// fn(name, value) for each field, compared across ranks (Strategy::for_each_argument); `cost` by whether it is
    /// set.
    template <class Fn>
    void for_each_argument(Fn&& fn) const {
      fn("capacity_factor", capacity_factor);
      fn("linear_weight", linear_weight);
      fn("compute_weight", compute_weight);
      fn("comm_weight", comm_weight);
      fn("overlap", overlap);
      fn("tolerance", tolerance);
      fn("threshold", threshold);
      fn("max_candidates", max_candidates);
      fn("cost (set)", cost);
    }
  };
  Arguments args;

  [[nodiscard]] Status can_implement(const DocumentBatch& batch, const Topology& topo, const MaskMix& mix = {}) const {
    if (topo.world_size < 1 || topo.ranks_per_node < 1)
      return Status::refuse("world_size and ranks_per_node must be >= 1");
    if (auto why = check_arguments(); !why.empty()) return Status::refuse(why);
    if (args.threshold && !candidate(batch, topo, *args.threshold, mix))
      return Status::refuse(
          "threshold = " + std::to_string(*args.threshold) +
          ": the whole documents do not fit the per-rank capacity of " +
          std::to_string(detail::token_capacity(batch.total_tokens(), topo.world_size, args.capacity_factor)) +
          " tokens; lower the threshold or raise capacity_factor");
    return Status::success();
  }

  /// The placement of the threshold the sweep chooses (no report: the engine slices it per mask).
  [[nodiscard]] Placement place(const DocumentBatch& batch, const Topology& topo, const MaskMix& mix = {}) const {
    return std::move(*candidate(batch, topo, sweep(batch, topo, mix).chosen, mix));
  }
  [[nodiscard]] ShardPlan plan(const DocumentBatch& batch, const Topology& topo, AttentionMask mask = {}) const {
    return plan_with_report(batch, topo, MaskMix::only(mask)).plan;
  }

  [[nodiscard]] HybridReport plan_with_report(const DocumentBatch& batch, const Topology& topo,
                                              const MaskMix& mix = {}) const {
    const Sweep s = sweep(batch, topo, mix);
    // The chosen plan is rebuilt (cheap) but not costed again: a simulated cost is the expensive part.
    HybridReport best =
        measure(batch, slice(std::move(*candidate(batch, topo, s.chosen, mix)), batch, mix.masks().front()), s.chosen);
    best.cost = s.cost;
    best.candidates_evaluated = s.evaluated;
    return best;
  }

 private:
  struct Sweep {
    std::int64_t chosen = 0;
    double cost = 0;
    int evaluated = 0;
  };
  // The threshold sweep: every candidate costed once under the mix, the largest tau within the tolerance
  // of the cheapest chosen.
  [[nodiscard]] Sweep sweep(const DocumentBatch& batch, const Topology& topo, const MaskMix& mix) const {
    topo.validate("partition::Hybrid");
    if (const Status st = can_implement(batch, topo, mix); !st)
      throw std::invalid_argument("partition::Hybrid: " + st.reason);
    std::vector<std::int64_t> taus;
    if (args.threshold) {
      taus.push_back(*args.threshold);
    } else {
      taus.push_back(0);
      for (const Document& d : batch.documents()) taus.push_back(d.tokens.size());
      std::sort(taus.begin(), taus.end());
      taus.erase(std::unique(taus.begin(), taus.end()), taus.end());
      taus = thin_out(std::move(taus));
    }
    std::vector<std::pair<std::int64_t, double>> costed;  // feasible (tau, cost), ascending tau
    double lowest = std::numeric_limits<double>::infinity();
    for (const std::int64_t tau : taus) {
      auto p = candidate(batch, topo, tau, mix);
      if (!p) continue;
      costed.emplace_back(tau, score(batch, *p, tau, mix));
      lowest = std::min(lowest, costed.back().second);
    }
    if (costed.empty()) throw std::logic_error("partition::Hybrid: no feasible threshold (tau = 0 always is)");
    Sweep out{costed.front().first, costed.front().second, static_cast<int>(costed.size())};
    for (const auto& [tau, c] : costed)
      if (c <= lowest * (1.0 + args.tolerance)) out.chosen = tau, out.cost = c;
    return out;
  }

  [[nodiscard]] std::string check_arguments() const {
    const auto bad = [](double v) { return !(v >= 0.0) || !std::isfinite(v); };
    if (!(args.capacity_factor >= 1.0) || !std::isfinite(args.capacity_factor))
      return "capacity_factor = " + std::to_string(args.capacity_factor) + " must be finite and >= 1";
    if (bad(args.linear_weight))
      return "linear_weight = " + std::to_string(args.linear_weight) + " must be finite and >= 0";
    if (bad(args.compute_weight))
      return "compute_weight = " + std::to_string(args.compute_weight) + " must be finite and >= 0";
    if (bad(args.comm_weight)) return "comm_weight = " + std::to_string(args.comm_weight) + " must be finite and >= 0";
    if (bad(args.overlap) || args.overlap > 1.0)
      return "overlap = " + std::to_string(args.overlap) + " must be in [0, 1]";
    if (bad(args.tolerance)) return "tolerance = " + std::to_string(args.tolerance) + " must be finite and >= 0";
    if (args.threshold && *args.threshold < 0)
      return "threshold = " + std::to_string(*args.threshold) + " must be >= 0";
    if (args.max_candidates < 2) return "max_candidates = " + std::to_string(args.max_candidates) + " must be >= 2";
    return {};
  }

  // At most max_candidates thresholds: 0, the largest length, and lengths spaced evenly in log(length)
  // between (each candidate plans the whole batch: a 1M-token batch has hundreds of distinct lengths).
  [[nodiscard]] std::vector<std::int64_t> thin_out(std::vector<std::int64_t> taus) const {
    if (static_cast<int>(taus.size()) <= args.max_candidates) return taus;
    std::vector<std::int64_t> out{taus.front(), taus.back()};
    const double lo = std::log(static_cast<double>(std::max<std::int64_t>(1, taus[1]))),
                 hi = std::log(static_cast<double>(taus.back()));
    const int slots = args.max_candidates - 2;
    for (int i = 0; i < slots; ++i) {
      const double target = std::exp(lo + (hi - lo) * i / std::max(1, slots - 1));
      // The largest distinct length not above the target (thresholds between lengths plan the same).
      auto it = std::upper_bound(taus.begin() + 1, taus.end(), static_cast<std::int64_t>(target));
      out.push_back(*(it == taus.begin() + 1 ? it : it - 1));
    }
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    return out;
  }

  // The placement for one threshold, or nothing when the whole documents do not fit the capacity.
  [[nodiscard]] std::optional<Placement> candidate(const DocumentBatch& batch, const Topology& topo, std::int64_t tau,
                                                   const MaskMix& mix) const {
    const auto n = static_cast<std::size_t>(topo.world_size);
    const std::int64_t cap = detail::token_capacity(batch.total_tokens(), topo.world_size, args.capacity_factor);
    std::vector<std::vector<Range>> pieces(n);
    std::int64_t cursor = 0;
    std::vector<std::size_t> whole;
    const auto docs = batch.documents();
    const detail::MixWindows windows(mix);
    for (std::size_t i = 0; i < docs.size(); ++i) {
      if (docs[i].tokens.size() > tau)
        detail::mix_cut(docs[i].tokens, topo.world_size, windows, cursor, pieces);
      else
        whole.push_back(i);
    }
    std::vector<std::int64_t> tokens(n, 0);
    std::vector<double> load(n, 0.0);
    for (std::size_t r = 0; r < n; ++r) {
      // The pieces' pairs in closed form (building their slices per candidate was most of a sweep).
      for (const Range& q : pieces[r]) tokens[r] += q.size();
      load[r] = mix.mean([&](AttentionMask m) {
        return seqpar::detail::document_causal_area_for(pieces[r], batch, m);
      }) + args.linear_weight * static_cast<double>(tokens[r]);
    }
    std::vector<std::int64_t> lengths(whole.size());
    std::vector<double> costs(whole.size());
    for (std::size_t k = 0; k < whole.size(); ++k) {
      lengths[k] = docs[whole[k]].tokens.size();
      costs[k] = detail::document_cost(lengths[k], args.linear_weight, mix);
    }
    const auto where = detail::pack_whole(lengths, costs, tokens, load, cap);
    if (!where) return std::nullopt;
    std::vector<std::vector<Range>> all = pieces;
    for (std::size_t k = 0; k < whole.size(); ++k)
      all[static_cast<std::size_t>((*where)[k])].push_back(docs[whole[k]].tokens);
    Placement p;
    p.topology = topo;
    p.owned.resize(n);
    for (std::size_t r = 0; r < n; ++r) {
      std::sort(all[r].begin(), all[r].end(), [](Range a, Range b) { return a.begin < b.begin; });
      for (const Range& q : all[r]) append_range(p.owned[r], q);
    }
    detail::finish_single_group(p);
    return p;
  }

  // Everything of the report but its cost. Takes the plan (a copy of a million-slice plan per
  // candidate was a large part of planning one-token documents).
  [[nodiscard]] HybridReport measure(const DocumentBatch& batch, ShardPlan plan, std::int64_t tau) const {
    HybridReport r;
    r.plan = std::move(plan);
    const ShardPlan& p = r.plan;
    const auto n = static_cast<std::size_t>(p.world_size());
    r.tokens.resize(n);
    r.area.resize(n);
    r.received_kv_tokens.resize(n);
    for (std::size_t k = 0; k < n; ++k) {
      r.tokens[k] = p.local_tokens(static_cast<int>(k));
      r.area[k] = total_area(p.slices[k]);
      r.received_kv_tokens[k] = received_kv_tokens(p, static_cast<int>(k));
    }
    for (const Document& d : batch.documents()) r.per_doc_documents += d.tokens.size() > tau ? 1 : 0;
    r.threshold = tau;
    return r;
  }

  // The candidate's cost under every mask of the mix, weighted by the mask's layers.
  [[nodiscard]] double score(const DocumentBatch& batch, const Placement& p, std::int64_t tau,
                             const MaskMix& mix) const {
    return mix.mean([&](AttentionMask m) {
      const HybridReport r = measure(batch, slice(p, batch, m), tau);
      const HybridCandidate c{batch, r.plan, tau, r.tokens, r.area, r.received_kv_tokens};
      return args.cost ? args.cost(c) : hybrid_proxy_cost(c, args.compute_weight, args.comm_weight, args.overlap);
    });
  }
};

static_assert(Partitioner<Hybrid>);

}  // namespace seqpar::partition
