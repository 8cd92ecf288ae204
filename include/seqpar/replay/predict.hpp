// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <string>
#include <vector>

#include "seqpar/comm/program.hpp"
#include "seqpar/core/attention_shape.hpp"
#include "seqpar/core/document_batch.hpp"
#include "seqpar/core/shard_plan.hpp"
#include "seqpar/core/status.hpp"
#include "seqpar/core/topology.hpp"
#include "seqpar/cost/simulator.hpp"

namespace seqpar::cost {

/// Every rank's programs of a strategy for one batch: what the ranks would each compile, in one place.
struct CompiledStrategy {
  Status status = Status::success();  ///< refusal (partitioner or communicator) and its reason
  ShardPlan plan;
  std::vector<comm::Program> forward, backward;  ///< indexed by world rank
};

/// Plans `batch` with strategy `S` on `topology` and compiles the programs of all ranks. A strategy that
/// cannot implement the batch comes back with status false and its reason (nothing thrown).
template <class S>
[[nodiscard]] CompiledStrategy compile_all(const typename S::Arguments& args, const DocumentBatch& batch,
                                           const AttentionShape& shape, const Topology& topology) {
  CompiledStrategy out;
  typename S::Planned planned = S::plan(args, batch, shape, topology);  // planned once for every rank
  out.status = std::move(planned.status);
  if (!out.status) return out;
  out.plan = std::move(planned.plan);
  out.forward.reserve(static_cast<std::size_t>(topology.world_size));
  out.backward.reserve(static_cast<std::size_t>(topology.world_size));
  for (int r = 0; r < topology.world_size; ++r) {
    comm::CompiledAttention c = S::compile(args, out.plan, shape, r);
    out.forward.push_back(std::move(c.forward));
    out.backward.push_back(std::move(c.backward));
  }
  return out;
}

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

/// compile_all + predict in one call.
template <class S>
[[nodiscard]] AttentionPrediction predict(const typename S::Arguments& args, const DocumentBatch& batch,
                                          const AttentionShape& shape, const Topology& topology,
                                          const SimulationOptions& options) {
  return predict(compile_all<S>(args, batch, shape, topology), topology, shape, options);
}

}  // namespace seqpar::cost
