// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// `plan::PipelineStepOptions`: the machine and the model under a DPP schedule (plan/pipeline_step.hpp),
/// and the parameters each pipeline stage holds.

#include <cstdint>
#include <string>

#include "seqpar/core/attention_mask.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/topology.hpp"
#include "seqpar/plan/model_shape.hpp"
#include "seqpar/replay/hardware.hpp"

namespace seqpar::plan {

/// The machine and the model under a DPP schedule.
struct PipelineStepOptions {
  ModelShape model;
  replay::HardwareProfile hardware;
  int stages = 1;      ///< d_p; model.layers must divide evenly
  int sp_ranks = 1;    ///< d_s: ranks per stage, Ulysses over them (stage p holds ranks [p d_s, (p+1) d_s))
  int zero_ranks = 0;  ///< ZeRO-3 over this many ranks of a stage: 0 = all sp_ranks, 1 = none
  /// Fraction of a rank's memory kept free for workspaces, the allocator and the working set of the layer
  /// in flight [I: not given by the paper].
  double memory_reserve = 0.1;
  /// Bounds of the chunk plan for the transient terms of plan::stage_memory (plan::with_chunks sets
  /// them): the largest chunk's tokens and the largest prefix of a split document's later slice; 0
  /// leaves those terms out.
  std::int64_t chunk_tokens = 0;
  std::int64_t carry_tokens = 0;
  /// The busiest rank's rows of a chunk over the mean (tokens / sp_ranks), >= 1: the planner counts
  /// every chunk's activations at this factor so that a plan that fits fits on every rank.
  double rank_imbalance = 1.0;
  /// The mask of the model's attention layers (a sliding window narrows each layer's pairs and each
  /// layer's carry to the w - 1 tokens before a piece).
  AttentionMask mask{};

  [[nodiscard]] Topology topology() const noexcept { return {stages * sp_ranks, hardware.ranks_per_node}; }
  [[nodiscard]] int layers_per_stage() const noexcept { return stages > 0 ? model.layers / stages : 0; }
  [[nodiscard]] int zero() const noexcept { return zero_ranks == 0 ? sp_ranks : zero_ranks; }
  [[nodiscard]] double value_bytes() const noexcept { return hardware.value_bytes; }

  void validate(const char* where) const {
    model.validate(where);
    hardware.validate(where);
    detail::require(stages >= 1, where, "options.stages", stages, "must be >= 1");
    detail::require(model.layers % stages == 0, where, "options.stages", stages,
                    "must divide model.layers = " + std::to_string(model.layers));
    detail::require(sp_ranks >= 1, where, "options.sp_ranks", sp_ranks, "must be >= 1");
    detail::require(zero_ranks >= 0 && zero_ranks <= sp_ranks && (zero_ranks == 0 || sp_ranks % zero_ranks == 0), where,
                    "options.zero_ranks", zero_ranks, "must be 0 or divide sp_ranks = " + std::to_string(sp_ranks));
    detail::require(memory_reserve >= 0 && memory_reserve < 1, where, "options.memory_reserve", memory_reserve,
                    "must be in [0, 1)");
    detail::require(chunk_tokens >= 0, where, "options.chunk_tokens", chunk_tokens, "must be >= 0");
    detail::require(carry_tokens >= 0, where, "options.carry_tokens", carry_tokens, "must be >= 0");
    mask.validate(where, "options.mask.window");
    detail::require(rank_imbalance >= 1 && rank_imbalance <= sp_ranks, where, "options.rank_imbalance", rank_imbalance,
                    "must be in [1, sp_ranks = " + std::to_string(sp_ranks) + "]");
  }
};

namespace pipeline_detail {
/// Parameters held by stage p (layers, plus the embedding on the first and the LM head on the last).
[[nodiscard]] inline double stage_params(const PipelineStepOptions& o, int p) {
  const ModelShape& m = o.model;
  const double table = static_cast<double>(m.vocab) * m.hidden;
  double params = o.layers_per_stage() * m.layer_params();
  if (p == 0) params += table;
  if (p == o.stages - 1 && (!m.tied_embeddings || o.stages > 1)) params += table;
  return params;
}
}  // namespace pipeline_detail

}  // namespace seqpar::plan
