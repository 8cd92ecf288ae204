// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "seqpar/partition/partitioner.hpp"
#include "seqpar/partition/uniform.hpp"
#include "seqpar/partition/zigzag.hpp"

namespace seqpar::partition {

/// One BASP group: ranks [first_rank, first_rank + size) and the sequences (ascending) they own.
struct SequenceGroup {
  int first_rank = 0;
  int size = 0;
  std::vector<int> sequences;
  friend bool operator==(const SequenceGroup&, const SequenceGroup&) = default;
};

/// A partitioner that can be built from its Arguments (every partitioner of this layer can).
template <class P>
concept PartitionerFromArguments = Partitioner<P> && requires(const typename P::Arguments& a) {
  P{a};
};

/// Batch-aware sequence parallelism (BASP): the world is cut into disjoint groups of consecutive
/// ranks, each group owns whole sequences of the batch and runs `Inner` on them alone (Inner plans
/// the sub-batch of its sequences on a sub-topology of the group's size; the result is mapped back
/// to global ranks and token indices, slices and Inner's own groups included). Attention and its
/// communication stay inside a group: a group's collectives have K-1 peers instead of N-1, and a
/// group that fits in a node never touches the inter-node links.
///
/// Group sizing (N ranks, B sequences):
///  - group_size = k > 0: N/k groups of k ranks (k must divide N, and N/k <= B); sequences are dealt
///    to groups LPT by cost when there are more sequences than groups.
///  - automatic, B <= N: one group per sequence. When N % B == 0 and all sequences have the same
///    token count (and equal_groups_when_divisible), every group has K = N/B ranks: the paper's BASP,
///    equal memory per rank. Otherwise ranks go to sequences by cost (>= 1 each, then each further rank
///    to the group with the largest cost per rank), which minimises max_g cost_g / size_g exactly.
///  - automatic, B > N: N groups of one rank; sequences are LPT-packed onto them by cost.
///  Sequence cost = its document-causal area + linear_weight * tokens.
///  With respect_nodes, the groups are laid out along the ranks so that fewer of them straddle a node
///  boundary when their sizes allow (the given order is kept unless reordering strictly helps).
///  Inner's sub-topology has ranks_per_node = min(k, ranks_per_node) (exact when the group starts on
///  a node boundary or lies within one node).
///
/// Balance: within a group, whatever Inner gives; across groups, the sizing above. Communication:
/// Inner's, confined to the group. From BASP (Ghimire & Calhoun); non-divisible N, unequal sequences
/// and B > N go beyond the paper, which requires N = K * B.
///
/// @code
/// using Basp = partition::BatchAware<partition::Uniform>;            // Ulysses inside each group
/// auto plan = Basp{}.plan(DocumentBatch({{16384}, {16384}}), Topology{8, 4});  // groups {0..3}, {4..7}
/// @endcode
template <class Inner>
struct BatchAware {
  static_assert(PartitionerFromArguments<Inner>,
                "BatchAware<Inner>: Inner must be a Partitioner constructible as Inner{Inner::Arguments}");
  using policy_category = partitioner_tag;
  struct Arguments {
    int group_size = 0;                       ///< ranks per group; 0 = automatic (see above)
    double linear_weight = 0.0;               ///< per-token term of a sequence's cost, in attention pairs
    bool equal_groups_when_divisible = true;  ///< N % B == 0 and equal sequence lengths -> K = N/B each
    bool respect_nodes = true;                ///< lay groups out to avoid straddling node boundaries
    typename Inner::Arguments inner{};        ///< Arguments of the partitioner run inside each group
    /// fn(name, value) for each field, compared across ranks (Strategy::for_each_argument); `inner` names its own.
    template <class Fn>
    void for_each_argument(Fn&& fn) const {
      fn("group_size", group_size);
      fn("linear_weight", linear_weight);
      fn("equal_groups_when_divisible", equal_groups_when_divisible);
      fn("respect_nodes", respect_nodes);
      fn("inner", inner);
    }
  };
  Arguments args;

  /// The groups this policy would form, in rank order. Throws std::invalid_argument when impossible.
  [[nodiscard]] std::vector<SequenceGroup> layout(const DocumentBatch& batch, const Topology& topo,
                                                  const MaskMix& mix = {}) const {
    std::string why;
    auto groups = layout_or(batch, topo, mix, &why);
    if (!groups) throw std::invalid_argument("partition::BatchAware: " + why);
    return std::move(*groups);
  }

  [[nodiscard]] Status can_implement(const DocumentBatch& batch, const Topology& topo, const MaskMix& mix = {}) const {
    std::string why;
    const auto groups = layout_or(batch, topo, mix, &why);
    if (!groups) return Status::refuse(why);
    const Inner inner{args.inner};
    for (std::size_t g = 0; g < groups->size(); ++g) {
      const SequenceGroup& sg = (*groups)[g];
      const Status st = inner.can_implement(sub_batch(batch, sg), sub_topology(sg, topo), mix);
      if (!st) return Status::refuse(describe(g, sg) + ": " + st.reason);
    }
    return Status::success();
  }

  [[nodiscard]] Placement place(const DocumentBatch& batch, const Topology& topo, const MaskMix& mix = {}) const {
    topo.validate("partition::BatchAware");
    const auto groups = layout(batch, topo, mix);
    const Inner inner{args.inner};
    Placement p;
    p.topology = topo;
    p.owned.resize(static_cast<std::size_t>(topo.world_size));
    for (std::size_t g = 0; g < groups.size(); ++g) {
      const SequenceGroup& sg = groups[g];
      const DocumentBatch sub = sub_batch(batch, sg);
      const Topology st = sub_topology(sg, topo);
      if (const Status ok = inner.can_implement(sub, st, mix); !ok)
        throw std::invalid_argument("partition::BatchAware: " + describe(g, sg) + ": " + ok.reason);
      const Placement sp = inner.place(sub, st, mix);
      if (sp.world_size() != sg.size)
        throw std::logic_error("partition::BatchAware: Inner returned a placement for the wrong number of ranks");
      // Sub-batch sequence j starts at sub.sequence(j).begin; in the batch it starts at
      // batch.sequence(sg.sequences[j]).begin.
      const auto delta = [&](int j) {
        return batch.sequence(sg.sequences[static_cast<std::size_t>(j)]).begin - sub.sequence(j).begin;
      };
      for (int i = 0; i < sg.size; ++i) {
        const auto r = static_cast<std::size_t>(sg.first_rank + i);
        for (const Range& piece : sp.owned[static_cast<std::size_t>(i)]) {
          // A piece may run across sub-sequence boundaries, which are not adjacent globally.
          for (int j = 0; j < sub.num_sequences(); ++j) {
            const Range part = intersect(piece, sub.sequence(j));
            if (!part.empty()) append_range(p.owned[r], part.shifted(delta(j)));
          }
        }
      }
      for (const auto& ig : sp.groups) {
        std::vector<int> mapped;
        mapped.reserve(ig.size());
        for (int i : ig) mapped.push_back(sg.first_rank + i);
        p.groups.push_back(std::move(mapped));
      }
    }
    return p;
  }
  [[nodiscard]] ShardPlan plan(const DocumentBatch& batch, const Topology& topo, AttentionMask mask = {}) const {
    return slice(place(batch, topo, MaskMix::only(mask)), batch, mask);
  }

 private:
  [[nodiscard]] static DocumentBatch sub_batch(const DocumentBatch& batch, const SequenceGroup& sg) {
    std::vector<std::vector<std::int64_t>> seqs;
    seqs.reserve(sg.sequences.size());
    for (int b : sg.sequences) {
      auto& lengths = seqs.emplace_back();
      for (const Document& d : batch.documents_of(b)) lengths.push_back(d.tokens.size());
    }
    return DocumentBatch(seqs);
  }

  [[nodiscard]] static Topology sub_topology(const SequenceGroup& sg, const Topology& topo) {
    return {sg.size, std::min(sg.size, topo.ranks_per_node)};
  }

  [[nodiscard]] static std::string describe(std::size_t g, const SequenceGroup& sg) {
    return "group " + std::to_string(g) + " (ranks " + std::to_string(sg.first_rank) + ".." +
           std::to_string(sg.first_rank + sg.size - 1) + ")";
  }

  // Deals sequences onto `groups` bins, costliest first onto the least-loaded (LPT).
  [[nodiscard]] static std::vector<std::vector<int>> deal(const std::vector<double>& cost, int groups) {
    std::vector<int> order(cost.size());
    for (std::size_t b = 0; b < cost.size(); ++b) order[b] = static_cast<int>(b);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return cost[static_cast<std::size_t>(a)] > cost[static_cast<std::size_t>(b)];
    });
    std::vector<std::vector<int>> out(static_cast<std::size_t>(groups));
    std::vector<double> load(static_cast<std::size_t>(groups), 0.0);
    for (int b : order) {
      const auto g = static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin());
      out[g].push_back(b);
      load[g] += cost[static_cast<std::size_t>(b)];
    }
    for (auto& s : out) std::sort(s.begin(), s.end());
    return out;
  }

  // Groups that span a node boundary without covering whole nodes (a group inside one node, or one
  // made of whole nodes, is fine).
  [[nodiscard]] static int straddles(const std::vector<int>& sizes, const std::vector<std::size_t>& order, int rpn) {
    int count = 0, at = 0;
    for (std::size_t g : order) {
      const bool one_node = at / rpn == (at + sizes[g] - 1) / rpn;
      const bool whole_nodes = at % rpn == 0 && sizes[g] % rpn == 0;
      count += one_node || whole_nodes ? 0 : 1;
      at += sizes[g];
    }
    return count;
  }

  // Best-fit walk along the ranks: fill each node's remaining room with the largest group that fits;
  // if none fits, take one that ends on a node boundary, else the largest.
  [[nodiscard]] static std::vector<std::size_t> node_order(const std::vector<int>& sizes, int rpn) {
    std::vector<std::size_t> left(sizes.size()), order;
    for (std::size_t g = 0; g < sizes.size(); ++g) left[g] = g;
    int at = 0;
    while (!left.empty()) {
      const int room = rpn - at % rpn;
      std::optional<std::size_t> pick;
      for (std::size_t i = 0; i < left.size(); ++i)
        if (sizes[left[i]] <= room && (!pick || sizes[left[i]] > sizes[left[*pick]])) pick = i;
      if (!pick)
        for (std::size_t i = 0; i < left.size(); ++i)
          if ((sizes[left[i]] - room) % rpn == 0) {
            pick = i;
            break;
          }
      if (!pick)
        for (std::size_t i = 0; i < left.size(); ++i)
          if (!pick || sizes[left[i]] > sizes[left[*pick]]) pick = i;
      order.push_back(left[*pick]);
      at += sizes[left[*pick]];
      left.erase(left.begin() + static_cast<std::ptrdiff_t>(*pick));
    }
    return order;
  }

  [[nodiscard]] std::optional<std::vector<SequenceGroup>> layout_or(const DocumentBatch& batch, const Topology& topo,
                                                                    const MaskMix& mix, std::string* why) const {
    if (topo.world_size < 1 || topo.ranks_per_node < 1) {
      *why = "world_size and ranks_per_node must be >= 1";
      return std::nullopt;
    }
    if (args.group_size < 0) {
      *why = "group_size = " + std::to_string(args.group_size) + " must be >= 0 (0 = automatic)";
      return std::nullopt;
    }
    if (!(args.linear_weight >= 0.0) || !std::isfinite(args.linear_weight)) {
      *why = "linear_weight = " + std::to_string(args.linear_weight) + " must be finite and >= 0";
      return std::nullopt;
    }
    const int n = topo.world_size;
    const int b = batch.num_sequences();
    std::vector<double> cost(static_cast<std::size_t>(b));
    std::vector<std::int64_t> tokens(static_cast<std::size_t>(b));
    for (int s = 0; s < b; ++s) {
      double area = 0;  // the mix's layer-weighted pairs: a window makes a long document linear, not quadratic
      for (const Document& d : batch.documents_of(s)) area += mix.document_area(d.tokens.size());
      tokens[static_cast<std::size_t>(s)] = batch.sequence(s).size();
      cost[static_cast<std::size_t>(s)] = area + args.linear_weight * static_cast<double>(batch.sequence(s).size());
    }
    std::vector<int> sizes;
    std::vector<std::vector<int>> seqs;
    if (args.group_size > 0) {
      const int k = args.group_size;
      if (n % k != 0) {
        *why = "group_size = " + std::to_string(k) + " does not divide world_size = " + std::to_string(n);
        return std::nullopt;
      }
      if (n / k > b) {
        *why = "group_size = " + std::to_string(k) + " makes " + std::to_string(n / k) + " groups for only " +
               std::to_string(b) +
               " sequences (a group would own nothing); use group_size >= " + std::to_string((n + b - 1) / b) +
               " dividing " + std::to_string(n);
        return std::nullopt;
      }
      sizes.assign(static_cast<std::size_t>(n / k), k);
      seqs = deal(cost, n / k);
      if (n / k == b)
        for (int s = 0; s < b; ++s) seqs[static_cast<std::size_t>(s)] = {s};
    } else if (b <= n) {
      for (int s = 0; s < b; ++s) seqs.push_back({s});
      const bool equal = std::all_of(tokens.begin(), tokens.end(), [&](std::int64_t t) { return t == tokens[0]; });
      if (args.equal_groups_when_divisible && n % b == 0 && equal) {
        sizes.assign(static_cast<std::size_t>(b), n / b);
      } else {
        sizes.assign(static_cast<std::size_t>(b), 1);
        for (int extra = n - b; extra > 0; --extra) {
          std::size_t best = 0;
          for (std::size_t g = 1; g < sizes.size(); ++g)
            if (cost[g] / sizes[g] > cost[best] / sizes[best]) best = g;
          ++sizes[best];
        }
      }
    } else {
      sizes.assign(static_cast<std::size_t>(n), 1);
      seqs = deal(cost, n);
    }
    std::vector<std::size_t> order(sizes.size());
    for (std::size_t g = 0; g < order.size(); ++g) order[g] = g;
    if (args.respect_nodes && topo.ranks_per_node < n) {
      auto better = node_order(sizes, topo.ranks_per_node);
      if (straddles(sizes, better, topo.ranks_per_node) < straddles(sizes, order, topo.ranks_per_node))
        order = std::move(better);
    }
    std::vector<SequenceGroup> out;
    int at = 0;
    for (std::size_t g : order) {
      out.push_back({at, sizes[g], seqs[g]});
      at += sizes[g];
    }
    return out;
  }
};

static_assert(Partitioner<BatchAware<Uniform>>);

}  // namespace seqpar::partition
