// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// `testing::run_pipelined_step`: one training step of a `TinyTransformer` the way DPP runs it
/// (InfiniPipe: "Efficient Long-Context LLM Training with Dynamic Pipeline Parallelism"): the batch cut into
/// chunks (`schedule::DynamicChunk`),
/// the chunks grouped into 1F1B pipelines run one after another (`schedule::group_pipelines`), the
/// layers split over pipeline stages, each stage a group of ranks that runs every chunk's attention
/// with a seqpar strategy (`runtime::ChunkedAttention` per layer: a split document's later slices
/// read the K/V its earlier slices left on the ranks), activations and their gradients sent between
/// neighbouring stages, and each chunk's layers checkpointed on each stage as the schedule's
/// diagonal decisions say (a checkpointed layer keeps its input and is recomputed before its
/// backward). The sum over all ranks of the returned gradients is the step's gradient, and the loss
/// the single-device loss, exactly up to rounding.
///
/// Ranks: world rank r is stage r / A and attention rank r % A, A = world size / stages; stage s
/// runs layers [s L / d_p, (s + 1) L / d_p). Every rank calls with the same arguments.
///
/// Memory: each rank measures the bytes of the layer activations it holds (TinyTransformer's
/// LayerCache: what the memory model calls a layer's activations, or its input when checkpointed)
/// right after every forward, the quantity DPP's checkpointing bounds, and the memory model's value
/// for the same rows (the schedule's decisions, this rank's token counts): the two must agree. It
/// also reports what the model leaves out: the attention carry and the loss gradient the last stage
/// holds between a chunk's forward and its backward, and the transient of a recomputed layer.

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "seqpar/attention/kernel.hpp"
#include "seqpar/backend/inproc/world.hpp"
#include "seqpar/core/document_batch.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/range.hpp"
#include "seqpar/core/transport.hpp"
#include "seqpar/distributed_attention.hpp"
#include "seqpar/runtime/chunked_attention.hpp"
#include "seqpar/schedule/dynamic_chunk.hpp"
#include "seqpar/schedule/pipeline.hpp"
#include "seqpar/train/token_batch.hpp"
#include "seqpar_testing/tiny_transformer.hpp"

namespace seqpar::testing {

/// What one rank computed in a pipelined step.
template <class T>
struct PipelinedStepResult {
  int stage = 0;
  int attention_rank = 0;
  T loss_sum = 0;                          ///< sum of the token losses of this rank's rows (last stage only)
  std::int64_t label_tokens = 0;           ///< tokens with a next-token label in the whole batch
  std::vector<T> grads;                    ///< this rank's share of the gradient of the mean loss
  std::size_t peak_activation_bytes = 0;   ///< layer activations held right after a forward, max
  double predicted_peak_bytes = 0;         ///< the memory model's value for this rank's rows
  std::size_t peak_bytes_with_extras = 0;  ///< max at any time of activations + recomputed layer + loss grads
  std::size_t carry_bytes = 0;             ///< K, V, dK, dV of prefix rows kept by the attention, all layers
  long long layers_recomputed = 0;         ///< layers this rank ran forward twice
};

/// The rows the busiest rank of an attention group of `ranks` holds of each chunk of `plan` under
/// StrategyT, found as run_pipelined_step finds them (a DistributedAttention and a ChunkedAttention over
/// the chunks, on in-process ranks). A memory model that plans with these rows (busiest_share) fits on
/// every rank; one that plans with tokens / ranks lets a rank whose partition is uneven exceed its cap.
template <class StrategyT, class T, std::invocable MakeKernel>
std::vector<std::int64_t> busiest_rank_tokens(const TinyTransformer<T>& model, const schedule::ChunkPlan& plan,
                                              int ranks, typename StrategyT::Arguments args, MakeKernel make_kernel) {
  using Kernel = std::invoke_result_t<MakeKernel>;
  detail::require(ranks >= 1, "testing::busiest_rank_tokens", "ranks", ranks, "must be >= 1");
  std::vector<std::int64_t> out(plan.chunks.size(), 0);
  std::mutex mu;
  backend::inproc::World(ranks).run([&](backend::inproc::Transport& tr) {
    DistributedAttention<StrategyT, Kernel> attention(tr, model.config().attention_shape(), args, make_kernel());
    runtime::ChunkedAttention<Kernel> chunked(attention, tr, make_kernel());
    chunked.begin(plan.chunks);
    const std::lock_guard lock(mu);
    for (std::size_t c = 0; c < out.size(); ++c) out[c] = std::max(out[c], chunked.local_tokens(static_cast<int>(c)));
  });
  return out;
}

/// The busiest rank's share of a chunk, the largest over `plan`'s chunks: busiest rows / chunk tokens.
/// A memory model whose bytes per chunk token are a row's bytes times this share bounds every rank.
[[nodiscard]] inline double busiest_share(const schedule::ChunkPlan& plan, const std::vector<std::int64_t>& busiest) {
  detail::require(busiest.size() == plan.chunks.size(), "testing::busiest_share", "busiest.size()", busiest.size(),
                  "must be the plan's chunk count " + std::to_string(plan.chunks.size()));
  double share = 0;
  for (std::size_t c = 0; c < busiest.size(); ++c) {
    const std::int64_t t = plan.chunks[c].batch.total_tokens();
    if (t > 0) share = std::max(share, static_cast<double>(busiest[c]) / static_cast<double>(t));
  }
  return share;
}

/// Runs one step on this rank (see the file comment). `memory_model` is the model `schedule` was
/// planned with (its stages and layers_per_stage must match the layout); its per-token bytes are
/// not used for the prediction, which takes TinyTransformer's own (activation_values_per_row, dim).
/// `make_kernel()` returns a kernel (one for the strategy, one per layer for the prefix terms).
template <class StrategyT, class T, Transport Tr, std::invocable MakeKernel>
PipelinedStepResult<T> run_pipelined_step(Tr& world, const TinyTransformer<T>& model, const train::TokenBatch& batch,
                                          const schedule::ChunkPlan& plan, const schedule::PipelineSchedule& schedule,
                                          const schedule::PipelineModel& memory_model,
                                          typename StrategyT::Arguments args, MakeKernel make_kernel) {
  using Kernel = std::invoke_result_t<MakeKernel>;
  static_assert(attention::AttentionKernel<Kernel>, "run_pipelined_step: make_kernel() must return a kernel");
  static_assert(std::is_same_v<typename Kernel::value_type, T> && std::is_same_v<typename Kernel::accum_type, T>,
                "run_pipelined_step: the kernel computes in the model's type");
  constexpr const char* where = "testing::run_pipelined_step";
  const TinyConfig& cfg = model.config();
  const int stages = memory_model.stages;
  detail::require(stages >= 1 && world.size() % stages == 0, where, "memory_model.stages", stages,
                  "must divide the world size " + std::to_string(world.size()));
  detail::require(cfg.layers % stages == 0 && cfg.layers / stages == memory_model.layers_per_stage, where,
                  "memory_model.layers_per_stage", memory_model.layers_per_stage,
                  "must be model layers / stages = " + std::to_string(cfg.layers) + " / " + std::to_string(stages));
  batch.validate(where);
  // Before any message: a schedule of another plan or stage count, or an empty one, is refused here
  // on every rank alike (each rank checks the same arguments), so no rank is left waiting.
  schedule::validate_schedule(plan, schedule, stages, memory_model.layers_per_stage, where);
  const int group = world.size() / stages;
  PipelinedStepResult<T> out;
  out.stage = world.rank() / group;
  out.attention_rank = world.rank() % group;
  const int stage = out.stage, per_stage = memory_model.layers_per_stage, first_layer = stage * per_stage;
  const bool first = stage == 0, last = stage == stages - 1;
  out.grads.assign(model.num_params(), T{0});

  const std::vector<std::int64_t> positions = batch.positions();
  const std::vector<int> labels = batch.labels();
  out.label_tokens = batch.label_tokens();
  detail::require(out.label_tokens > 0, where, "batch", "no labels", "needs a document of at least 2 tokens");
  const T scale = T{1} / static_cast<T>(out.label_tokens);

  // The stage's attention group, one chunked attention per layer of the stage.
  Tr attention_world = world.split(stage, out.attention_rank);
  DistributedAttention<StrategyT, Kernel> attention(attention_world, cfg.attention_shape(), args, make_kernel());
  std::vector<std::unique_ptr<runtime::ChunkedAttention<Kernel>>> chunked;
  for (int l = 0; l < per_stage; ++l) {
    chunked.push_back(std::make_unique<runtime::ChunkedAttention<Kernel>>(attention, attention_world, make_kernel()));
    chunked.back()->begin(plan.chunks);
  }
  for (const auto& ca : chunked)
    out.carry_bytes += 4 * static_cast<std::size_t>(ca->carry_rows()) * static_cast<std::size_t>(cfg.heads_kv) *
                       static_cast<std::size_t>(cfg.head_dim) * sizeof(T);

  // This rank's rows of chunk c: global tokens, positions, tokens, labels.
  struct Rows {
    std::vector<std::int64_t> positions;
    std::vector<int> tokens, labels;
  };
  const auto rows_of = [&](int c) {
    Rows r;
    for (const Range& g : chunked.front()->owned_global(c))
      for (std::int64_t t = g.begin; t < g.end; ++t) {
        r.positions.push_back(positions[static_cast<std::size_t>(t)]);
        r.tokens.push_back(batch.tokens[static_cast<std::size_t>(t)]);
        r.labels.push_back(labels[static_cast<std::size_t>(t)]);
      }
    return r;
  };
  const auto d = static_cast<std::size_t>(cfg.dim);
  const int prev = world.rank() - group, next = world.rank() + group;
  const auto tag = [](int c, bool backward) { return 2 * c + (backward ? 1 : 0); };

  // In-flight state per chunk of the running pipeline.
  using Cache = typename TinyTransformer<T>::LayerCache;
  struct InFlight {
    Rows rows;
    std::vector<Cache> caches;  // per layer of the stage
    std::vector<T> dh;          // last stage: the loss gradient of the stage's output
    int checkpointed = 0;       // the stage's first `checkpointed` layers keep only their inputs
  };
  std::vector<std::unique_ptr<InFlight>> flight(plan.chunks.size());
  std::deque<std::vector<T>> send_buffers;
  std::vector<typename Tr::Request> sends;
  const auto held_bytes = [&] {
    std::size_t b = 0;
    for (const auto& f : flight)
      if (f)
        for (const Cache& cache : f->caches) b += cache.bytes();
    return b;
  };
  std::size_t stash = 0;  // loss gradients held by the last stage

  for (const schedule::Pipeline& pipeline : schedule.pipelines) {
    const schedule::CheckpointProblem prob = schedule::checkpoint_problem(plan, memory_model, pipeline);
    // The memory model for this rank's rows of these chunks and this model's activation sizes.
    schedule::CheckpointProblem mine = prob;
    mine.model.static_bytes = 0;
    mine.model.activation_bytes_per_token = static_cast<double>(model.activation_values_per_row() * sizeof(T));
    mine.model.kept_bytes_per_token = static_cast<double>(d * sizeof(T));
    for (std::size_t k = 0; k < pipeline.chunks.size(); ++k)
      mine.tokens[k] = chunked.front()->local_tokens(pipeline.chunks[k]);
    const schedule::CheckpointPlan predicted = schedule::evaluate(mine, pipeline.checkpointing.diagonals, "model");
    out.predicted_peak_bytes =
        std::max(out.predicted_peak_bytes, predicted.peak_bytes[static_cast<std::size_t>(stage)]);

    const auto ops = schedule::one_f_one_b(pipeline.backward_order, stages);
    for (const schedule::StageOp& op : ops[static_cast<std::size_t>(stage)]) {
      const int c = pipeline.chunks[static_cast<std::size_t>(op.chunk)];
      auto& slot = flight[static_cast<std::size_t>(c)];
      if (!op.backward) {
        slot = std::make_unique<InFlight>();
        InFlight& f = *slot;
        f.rows = rows_of(c);
        const std::size_t n = f.rows.tokens.size();
        f.checkpointed = pipeline.checkpointing.layers(prob, op.chunk, stage);
        std::vector<T> h(n * d), h_next(n * d);
        if (first)
          model.embed(f.rows.tokens, h);
        else
          world.recv(std::as_writable_bytes(std::span<T>(h)), prev, tag(c, false));
        f.caches.resize(static_cast<std::size_t>(per_stage));
        for (int l = 0; l < per_stage; ++l) {
          auto& ca = *chunked[static_cast<std::size_t>(l)];
          model.layer_forward(
              first_layer + l, h, f.rows.positions,
              [&](auto q, auto k, auto v, auto o, auto lse) { ca.forward(c, q, k, v, o, lse); },
              f.caches[static_cast<std::size_t>(l)], h_next);
          if (l < f.checkpointed) f.caches[static_cast<std::size_t>(l)].checkpoint();
          std::swap(h, h_next);
        }
        if (last) {
          f.dh.assign(n * d, T{0});
          out.loss_sum += model.head(h, f.rows.labels, scale, f.dh, out.grads);
          stash += f.dh.size() * sizeof(T);
        } else {
          send_buffers.push_back(std::move(h));
          sends.push_back(world.isend(std::as_bytes(std::span<const T>(send_buffers.back())), next, tag(c, false)));
        }
        const std::size_t held = held_bytes();
        out.peak_activation_bytes = std::max(out.peak_activation_bytes, held);
        out.peak_bytes_with_extras = std::max(out.peak_bytes_with_extras, held + stash);
      } else {
        InFlight& f = *slot;
        const std::size_t n = f.rows.tokens.size();
        std::vector<T> dh(n * d), dx(n * d);
        if (last) {
          dh = std::move(f.dh);
          stash -= dh.size() * sizeof(T);
        } else {
          world.recv(std::as_writable_bytes(std::span<T>(dh)), next, tag(c, true));
        }
        for (int l = per_stage - 1; l >= 0; --l) {
          auto& ca = *chunked[static_cast<std::size_t>(l)];
          Cache& cache = f.caches[static_cast<std::size_t>(l)];
          if (cache.checkpointed()) {
            std::vector<T> redo(n * d);
            model.layer_forward(
                first_layer + l, cache.x, f.rows.positions,
                [&](auto q, auto k, auto v, auto o, auto lse) { ca.recompute(c, q, k, v, o, lse); }, cache, redo);
            ++out.layers_recomputed;
            out.peak_bytes_with_extras = std::max(out.peak_bytes_with_extras, held_bytes() + stash);
          }
          model.layer_backward(
              first_layer + l, cache, f.rows.positions, dh,
              [&](auto q, auto k, auto v, auto o, auto lse, auto dout, auto dq, auto dk, auto dv) {
                ca.backward(c, q, k, v, o, lse, dout, dq, dk, dv);
              },
              dx, out.grads);
          cache = Cache{};
          std::swap(dh, dx);
        }
        if (first) {
          model.embed_backward(f.rows.tokens, dh, out.grads);
        } else {
          send_buffers.push_back(std::move(dh));
          sends.push_back(world.isend(std::as_bytes(std::span<const T>(send_buffers.back())), prev, tag(c, true)));
        }
        slot.reset();
      }
    }
  }
  for (auto& r : sends) world.wait(r);
  return out;
}

}  // namespace seqpar::testing
