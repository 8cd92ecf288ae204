// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// `plan::MemoryBreakdown`: one rank's memory as named terms, and the terms of a rank of a DPP stage
/// (`stage_memory`) and of model states under a ZeRO stage (`add_model_states`), so that every number
/// the pipeline planner compares with the cap can be printed and checked term by term.
///
/// Model states in mixed precision with Adam (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
/// Toward Training Trillion Parameter Models", section 3.1): 2 bytes of bf16 weights and 2 of bf16
/// gradients a parameter, 12 of optimizer state (fp32 master weights, Adam's m and v); ZeRO stage 1
/// shards the optimizer state over the data-parallel ranks, stage 2 the gradients too, stage 3 the
/// weights too (section 5). Megatron-LM keeps its gradients in fp32 (`grad_bytes` = 4): its
/// distributed optimizer's table (docs, "Distributed Optimizer") gives 6 + 12 / d bytes a parameter for
/// bf16 weights with fp32 gradients.
///
/// @code
/// plan::MemoryBreakdown m;
/// plan::add_model_states(m, 7e9 / 8, plan::ZeroStage::kOptimizer, 2, 4.0);   // Megatron TP 8, DP 2
/// m.add("activations", 12e9);
/// double bytes = m.total();
/// @endcode

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "seqpar/core/error.hpp"
#include "seqpar/plan/model_shape.hpp"
#include "seqpar/plan/pipeline_step_options.hpp"
#include "seqpar/schedule/dynamic_chunk.hpp"

namespace seqpar::plan {

/// What ZeRO shards over the data-parallel (or stage) ranks.
enum class ZeroStage : int { kNone = 0, kOptimizer = 1, kGradients = 2, kParameters = 3 };

/// One named term of a rank's memory.
struct MemoryTerm {
  std::string name;
  double bytes = 0;
};

/// A rank's memory, term by term.
struct MemoryBreakdown {
  std::vector<MemoryTerm> terms;

  void add(std::string name, double bytes) { terms.push_back({std::move(name), bytes}); }
  [[nodiscard]] double total() const noexcept {
    double b = 0;
    for (const MemoryTerm& t : terms) b += t.bytes;
    return b;
  }
  /// The term named `name` (0 when absent).
  [[nodiscard]] double of(const std::string& name) const noexcept {
    for (const MemoryTerm& t : terms)
      if (t.name == name) return t.bytes;
    return 0;
  }
};

/// Adds the states of `params` parameters held by one rank under `stage` sharded over `ranks`:
/// "weights", "gradients", "optimizer state" (see the file comment for the bytes).
inline void add_model_states(MemoryBreakdown& m, double params, ZeroStage stage, int ranks, double grad_bytes = 2.0) {
  constexpr const char* where = "plan::add_model_states";
  detail::require(params >= 0, where, "params", params, "must be >= 0");
  detail::require(ranks >= 1, where, "ranks", ranks, "must be >= 1");
  detail::require(grad_bytes > 0, where, "grad_bytes", grad_bytes, "must be > 0");
  const double n = ranks;
  const int s = static_cast<int>(stage);
  m.add("weights (bf16)", 2.0 * params / (s >= 3 ? n : 1.0));
  m.add(grad_bytes == 2.0 ? "gradients (bf16)" : "gradients (fp32)", grad_bytes * params / (s >= 2 ? n : 1.0));
  m.add("optimizer state (fp32 master, Adam m, v)", 12.0 * params / (s >= 1 ? n : 1.0));
}

/// The bounds of a chunk plan that the transient terms of `stage_memory` need, and the rank imbalance
/// of its Ulysses partition: a stage's d_s ranks each hold ceil(t / d_s) rows of a chunk of t tokens at
/// most (partition::Uniform), so planning with t / d_s would let the busiest rank exceed the cap.
inline PipelineStepOptions with_chunks(PipelineStepOptions options, const schedule::ChunkPlan& plan) {
  options.validate("plan::with_chunks");
  const std::int64_t g = options.sp_ranks;
  options.chunk_tokens = 0;
  options.carry_tokens = 0;
  options.rank_imbalance = 1.0;
  for (const schedule::Chunk& c : plan.chunks) {
    const std::int64_t t = c.batch.total_tokens();
    options.chunk_tokens = std::max(options.chunk_tokens, t);
    std::int64_t prefix = 0;
    for (const Range& r : c.prefix) prefix += visible_prefix(r, options.mask.window).size();  // the layer's carry
    options.carry_tokens = std::max(options.carry_tokens, prefix);
    if (t > 0)
      options.rank_imbalance =
          std::max(options.rank_imbalance, static_cast<double>((t + g - 1) / g * g) / static_cast<double>(t));
  }
  return options;
}

/// One rank of stage `stage` of `options` holding `activations` bytes of the chunks in flight (layer
/// activations, checkpointed layers' inputs; plan::simulate_pipeline_step's executed peak less the
/// static bytes): the terms the planner adds up (pipeline_model's static bytes are the largest stage's
/// terms other than the activations).
///  - model states under ZeRO-3 over the stage's zero() ranks (add_model_states), and the bf16 layers
///    a ZeRO-3 rank holds gathered: the one running and the one prefetched (plus the LM head or the
///    embedding on the last and first stage);
///  - the working set of one layer's backward on the largest chunk: its recomputed activations (or, not
///    checkpointed, the gradients of as many tensors), ceil(chunk_tokens / d_s) rows;
///  - the last stage's logits and loss: bf16 logits of the rank's rows, the gradient written in place
///    (the fused in-place cross-entropy InfiniPipe takes from Megatron-LM), an fp32 loss and
///    log-sum-exp per row;
///  - the K/V carry of split documents (comm::ChunkCarry): a later slice's prefix rows' K and V and their
///    gradients, per layer of the stage, ceil(carry_tokens / d_s) rows (under a layer mask with a sliding
///    window w the carry keeps only the w - 1 tokens before each piece, so the term follows the window);
///  - communication buffers: the Ulysses all-to-all's send and receive of Q, K, V, and the P2P buffers
///    of the activation received and the gradient sent (two on inner stages, one on the end stages).
[[nodiscard]] inline MemoryBreakdown stage_memory(const PipelineStepOptions& options, int stage, double activations) {
  constexpr const char* where = "plan::stage_memory";
  options.validate(where);
  detail::require(stage >= 0 && stage < options.stages, where, "stage", stage,
                  "must be in [0, stages = " + std::to_string(options.stages) + ")");
  const ModelShape& m = options.model;
  const double vb = options.value_bytes(), g = options.sp_ranks;
  const ModelShape::AttentionWidths w = m.attention_widths();
  const double table = static_cast<double>(m.vocab) * m.hidden;
  const bool first = stage == 0, last = stage == options.stages - 1;
  const double rows = std::ceil(static_cast<double>(options.chunk_tokens) / g);
  const double carry_rows = std::ceil(static_cast<double>(options.carry_tokens) / g);
  MemoryBreakdown out;
  add_model_states(out, pipeline_detail::stage_params(options, stage),
                   options.zero() > 1 ? ZeroStage::kParameters : ZeroStage::kNone, options.zero());
  if (options.zero() > 1)
    out.add("ZeRO-3 gathered layers (running + prefetched)",
            2.0 * 2.0 * m.layer_params() + ((first || last) ? 2.0 * table : 0.0));
  out.add("activations of the chunks in flight", activations);
  out.add("one layer's backward working set", rows * m.layer_activation_bytes_per_token(vb));
  if (last) out.add("logits and loss (fused in-place cross-entropy)", rows * (m.vocab * vb + 8.0));
  out.add("K/V carry of split documents", carry_rows * 2.0 * (w.k + w.v) * vb * options.layers_per_stage());
  out.add("all-to-all buffers (send + receive)", 2.0 * rows * (w.q + w.k + w.v) * vb);
  out.add("P2P buffers", ((first ? 0.0 : 1.0) + (last ? 0.0 : 1.0)) * rows * m.hidden * vb);
  return out;
}

}  // namespace seqpar::plan
