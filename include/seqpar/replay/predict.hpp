// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <string>
#include <vector>

#include "seqpar/comm/program.hpp"
#include "seqpar/core/attention_shape.hpp"
#include "seqpar/core/shard_plan.hpp"
#include "seqpar/core/status.hpp"
#include "seqpar/core/topology.hpp"
#include "seqpar/replay/simulator.hpp"

namespace seqpar::replay {

/// Every rank's programs of a strategy for one batch: what the ranks would each compile, in one place
/// (plan::compile_all builds one from a Strategy).
struct CompiledStrategy {
  Status status = Status::success();  ///< refusal (partitioner or communicator) and its reason
  ShardPlan plan;
  std::vector<comm::Program> forward, backward;  ///< indexed by world rank
};

/// Predicted forward and backward of one attention layer.
struct AttentionPrediction {
  Status status = Status::success();
  SimulationReport forward, backward;
  [[nodiscard]] double time_s() const noexcept { return forward.time_s + backward.time_s; }
};

/// Replays a compiled strategy's forward, then its backward from where each rank's forward ended.
[[nodiscard]] inline AttentionPrediction predict(const CompiledStrategy& compiled, const Topology& topology,
                                                 const AttentionShape& shape, const SimulationOptions& options) {
  AttentionPrediction p;
  p.status = compiled.status;
  if (!p.status) return p;
  p.forward = Replay(compiled.forward, topology, shape, options).run();
  std::vector<double> start;
  start.reserve(p.forward.ranks.size());
  const double origin = p.forward.ranks.empty() ? 0.0 : p.forward.time_s;
  // The backward of a layer starts after the whole forward in training: every rank from the same origin.
  start.assign(p.forward.ranks.size(), origin);
  p.backward = Replay(compiled.backward, topology, shape, options).run(start);
  return p;
}

}  // namespace seqpar::replay
