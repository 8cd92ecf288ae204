// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <utility>

#include "seqpar/comm/program.hpp"
#include "seqpar/core/attention_shape.hpp"
#include "seqpar/core/document_batch.hpp"
#include "seqpar/core/topology.hpp"
#include "seqpar/replay/predict.hpp"
#include "seqpar/replay/simulator.hpp"

// Planning-side glue between a Strategy and the replay: the replay knows programs, not strategies.
namespace seqpar::plan {

/// The programs of all ranks for a plan `S::plan` already made: planned once, compiled per rank. A
/// refused plan comes back as its status and reason.
template <class S>
[[nodiscard]] replay::CompiledStrategy compile_all(const typename S::Arguments& args, typename S::Planned planned,
                                                   const AttentionShape& shape, const Topology& topology) {
  replay::CompiledStrategy out;
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

/// Plans `batch` with strategy `S` on `topology` and compiles the programs of all ranks. A strategy that
/// cannot implement the batch comes back with status false and its reason (nothing thrown).
template <class S>
[[nodiscard]] replay::CompiledStrategy compile_all(const typename S::Arguments& args, const DocumentBatch& batch,
                                                   const AttentionShape& shape, const Topology& topology,
                                                   AttentionMask mask = {}) {
  return compile_all<S>(args, S::plan(args, batch, shape, topology, mask), shape, topology);
}

/// compile_all + replay::predict in one call.
template <class S>
[[nodiscard]] replay::AttentionPrediction predict(const typename S::Arguments& args, const DocumentBatch& batch,
                                                  const AttentionShape& shape, const Topology& topology,
                                                  const replay::SimulationOptions& options) {
  return replay::predict(compile_all<S>(args, batch, shape, topology), topology, shape, options);
}

}  // namespace seqpar::plan
