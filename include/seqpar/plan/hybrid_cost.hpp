// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <vector>

#include "seqpar/comm/all_gather.hpp"
#include "seqpar/comm/ring.hpp"
#include "seqpar/core/attention_shape.hpp"
#include "seqpar/partition/hybrid.hpp"
#include "seqpar/replay/costs.hpp"
#include "seqpar/replay/hardware.hpp"
#include "seqpar/replay/simulator.hpp"

namespace seqpar::plan {

/// A closed-form estimate of what hybrid_model_cost simulates, for plans too large to simulate per
/// candidate: the slowest rank's seconds of one layer's attention forward + backward under a
/// sharding-aware ring.
///   compute_r = attention_seconds of its slices, forward and backward (short documents are slower per
///               FLOP: the profile's efficiency by query length, not the proxy's flat weight per pair);
///   comm_r    = its received KV bytes x 3 (KV in forward; KV again and dK/dV back in backward) over the
///               link its ring crosses (NVLink inside a node, its share of a NIC across nodes);
///   time_r    = max(compute_r, comm_r) + comm_r / (P - 1) + (P - 1) * latency
/// The ring pipelines transfers behind compute step by step, so only one step's transfer is exposed
/// when compute dominates, and compute hides under traffic when it does not.
/// In training, the rest of the layer (projections, MLP) costs `seconds_per_token` for every token a
/// rank owns: Whole-Doc packing that balances attention but not tokens makes those GEMMs uneven, and
/// the slowest rank sets the step (pass gemm seconds per token of one layer, forward + backward).
/// It prices each rank's global slices, not the per-step pieces a ring cuts them into (one per KV
/// owner), so it underrates Per-Doc: on 128K pile-like mixes at P = 8 by about 2x (bench/replay).
[[nodiscard]] inline partition::HybridCostFunction hybrid_estimated_cost(const replay::HardwareProfile& hw,
                                                                         const AttentionShape& shape,
                                                                         double seconds_per_token = 0.0) {
  return [hw, shape, seconds_per_token](const partition::HybridCandidate& c) {
    const Topology& topo = c.plan.topology;
    const int p = topo.world_size;
    const bool spans_nodes = p > topo.ranks_per_node;
    double link = spans_nodes ? std::min(hw.intra.bandwidth, hw.inter.bandwidth * hw.nics_per_node /
                                                                 std::max(1, std::min(p, topo.ranks_per_node)))
                              : hw.intra.bandwidth;
    // A ring through PCIe (between NVLink domains, or to the NIC where modelled) runs at most at its rate.
    if (replay::spans_domains(hw, topo, p) || (spans_nodes && hw.has_host_link()))
      link = std::min(link, hw.host.bandwidth);
    // A ring step: the link's alpha and one call with one peer (HardwareProfile::fixed_comm_seconds).
    const double latency =
        spans_nodes ? hw.inter.latency + hw.fixed_comm_seconds(0, 1) : hw.intra.latency + hw.fixed_comm_seconds(1, 0);
    const double kv_token_bytes = double(shape.heads_kv) * (shape.qk_dim() + shape.v_dim()) * hw.value_bytes;  // K + V
    double worst = 0;
    for (std::size_t r = 0; r < c.area.size(); ++r) {
      const auto& slices = c.plan.slices[r];
      const double compute =
          replay::attention_seconds(hw, slices, shape.heads_q, shape.qk_dim(), false, shape.v_dim()) +
          replay::attention_seconds(hw, slices, shape.heads_q, shape.qk_dim(), true, shape.v_dim());
      const double comm = 3.0 * static_cast<double>(c.received_kv_tokens[r]) * kv_token_bytes / link;
      const double steps = std::max(1, p - 1);
      worst = std::max(worst, std::max(compute, comm) + (comm > 0 ? comm / steps + steps * latency : 0.0) +
                                  seconds_per_token * static_cast<double>(c.tokens[r]));
    }
    return worst;
  };
}

/// Plans of at most this many ranks are simulated per Hybrid candidate (P = 8: ~2 ms a candidate here);
/// larger ones fall back to hybrid_estimated_cost.
inline constexpr int kSimulatedHybridRanks = 16;

/// Slices a ring plans over all `ranks` (forward and backward) when the documents of `batch` longer
/// than `longer_than` are cut Per-Doc: a document of s tokens is m = min(s, 2P) non-empty pieces on
/// min(m, P) ranks, and a piece is one slice per rank holding keys it reads, twice: 2 m min(m, P),
/// 4 P^2 for s >= 2P. A one-token document is one piece on one rank: 2 slices, not 4 P^2.
[[nodiscard]] inline double per_doc_slices(const DocumentBatch& batch, int ranks, std::int64_t longer_than = 0) {
  double total = 0;
  for (const Document& d : batch.documents()) {
    const std::int64_t s = d.tokens.size();
    if (s <= longer_than) continue;
    const auto m = static_cast<double>(std::min<std::int64_t>(s, 2 * std::int64_t{ranks}));
    total += 2.0 * m * std::min(m, static_cast<double>(ranks));
  }
  return total;
}

/// Hybrid's sweep simulates a candidate only when Per-Doc cuts of the whole batch (its threshold-0
/// candidate, the largest) stay under this many slices; above it (10,000 documents of 100 tokens at
/// P = 8: 2.6 M) each candidate's compile and replay took seconds and GiB, and every candidate of the
/// sweep is estimated instead (one rule per batch, so the candidates stay comparable).
inline constexpr double kSimulatedHybridSlices = 1e6;

/// partition::Hybrid's cost function from the cost model: the candidate plan is compiled into the
/// programs `Communicator` (sharding-aware: comm::Ring or comm::AllGather) would run on every rank and
/// replayed on `hw`; the cost is that layer's attention forward + backward, plus `seconds_per_token`
/// for each token the busiest rank owns (training: projections and MLP). Simulating, rather than
/// estimating, sees what a ring does to split documents: each received KV piece is its own slice with
/// its own partial tiles, so many short Per-Doc pieces cost more than their FLOPs say (the estimate
/// picked thresholds whose simulated layer was 1.4x slower than Whole-Doc's on pile, Hq16/Hkv8). Under
/// Hierarchical or BatchAware the exchange simulated is the group's flat one, an approximation.
template <class Communicator = comm::Ring>
[[nodiscard]] partition::HybridCostFunction hybrid_model_cost(const replay::HardwareProfile& hw,
                                                              const AttentionShape& shape,
                                                              double seconds_per_token = 0.0) {
  const partition::HybridCostFunction estimate = hybrid_estimated_cost(hw, shape, seconds_per_token);
  return [hw, shape, seconds_per_token, estimate](const partition::HybridCandidate& c) {
    const int p = c.plan.world_size();
    if (p > kSimulatedHybridRanks || per_doc_slices(c.batch, p) > kSimulatedHybridSlices) return estimate(c);
    Communicator communicator{};
    communicator.args.sharding_aware = true;
    std::vector<comm::Program> fwd, bwd;
    fwd.reserve(static_cast<std::size_t>(p));
    bwd.reserve(static_cast<std::size_t>(p));
    for (int r = 0; r < p; ++r) {
      comm::CompiledAttention a = communicator.compile(c.plan, shape, r);
      fwd.push_back(std::move(a.forward));
      bwd.push_back(std::move(a.backward));
    }
    replay::SimulationOptions sim;
    sim.hardware = hw;
    const double attention = replay::Replay(fwd, c.plan.topology, shape, sim).run().time_s +
                             replay::Replay(bwd, c.plan.topology, shape, sim).run().time_s;
    const std::int64_t most = c.tokens.empty() ? 0 : *std::max_element(c.tokens.begin(), c.tokens.end());
    return attention + seconds_per_token * static_cast<double>(most);
  };
}

}  // namespace seqpar::plan
