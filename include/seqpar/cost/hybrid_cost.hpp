// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>

#include "seqpar/core/attention_shape.hpp"
#include "seqpar/cost/costs.hpp"
#include "seqpar/cost/hardware.hpp"
#include "seqpar/partition/hybrid.hpp"

namespace seqpar::cost {

/// partition::Hybrid's cost function from the cost model: the slowest rank's predicted seconds of one
/// layer's attention forward + backward under a sharding-aware ring.
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
[[nodiscard]] inline partition::HybridCostFunction hybrid_model_cost(const HardwareProfile& hw,
                                                                    const AttentionShape& shape,
                                                                    double seconds_per_token = 0.0) {
  return [hw, shape, seconds_per_token](const partition::HybridCandidate& c) {
    const Topology& topo = c.plan.topology;
    const int p = topo.world_size;
    const bool spans_nodes = p > topo.ranks_per_node;
    const double link = spans_nodes ? std::min(hw.intra.bandwidth, hw.inter.bandwidth * hw.nics_per_node /
                                                                       std::max(1, std::min(p, topo.ranks_per_node)))
                                    : hw.intra.bandwidth;
    const double latency = spans_nodes ? hw.inter.latency : hw.intra.latency;
    const double kv_token_bytes = 2.0 * shape.heads_kv * shape.head_dim * hw.value_bytes;
    double worst = 0;
    for (std::size_t r = 0; r < c.area.size(); ++r) {
      const auto& slices = c.plan.slices[r];
      const double compute = attention_seconds(hw, slices, shape.heads_q, shape.head_dim, false) +
                             attention_seconds(hw, slices, shape.heads_q, shape.head_dim, true);
      const double comm = 3.0 * static_cast<double>(c.received_kv_tokens[r]) * kv_token_bytes / link;
      const double steps = std::max(1, p - 1);
      worst = std::max(worst, std::max(compute, comm) + (comm > 0 ? comm / steps + steps * latency : 0.0) +
                                  seconds_per_token * static_cast<double>(c.tokens[r]));
    }
    return worst;
  };
}

}  // namespace seqpar::cost
