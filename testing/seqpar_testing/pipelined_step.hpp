// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// `testing::TinyStage<T>`: the layers of a `TinyTransformer` that one pipeline stage runs, as a
/// `train::PipelineStage` (`train::run_pipelined_step` runs it: DPP's chunks, 1F1B and checkpointing),
/// and `busiest_rank_tokens` / `busiest_share`, the rows a memory model should plan each rank with.
///
/// Stage s of d_p runs layers [s L / d_p, (s + 1) L / d_p); the first stage also embeds the tokens and
/// the last one runs the head (final norm, tied logits, cross-entropy). A chunk's state is one
/// `TinyTransformer::LayerCache` per layer (`held_bytes`: what the memory model calls a layer's
/// activations, or its input when checkpointed). The stage accumulates the gradient of the whole
/// model's flat parameter vector (`grads()`: zero outside its layers, the embedding and the head), so
/// that the sum over all ranks is the step's gradient.
///
/// @code
/// const auto layout = train::pipeline_layout(world.size(), world.rank(), stages);
/// testing::TinyStage<double> stage(model, layout.stage, stages);
/// auto r = train::run_pipelined_step<Strategy<partition::Hybrid, comm::Ring>>(world, stage, batch, plan,
///                                                                               schedule, memory_model, args,
///                                                                               make_kernel);
/// // stage.grads(): this rank's share of the gradient of the mean loss
/// @endcode

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
#include "seqpar/train/pipelined_step.hpp"
#include "seqpar/train/token_batch.hpp"
#include "seqpar_testing/tiny_transformer.hpp"

namespace seqpar::testing {

/// The rows the busiest rank of an attention group of `ranks` holds of each chunk of `plan` under
/// StrategyT, found as train::run_pipelined_step finds them (a DistributedAttention and a ChunkedAttention over
/// the chunks, on in-process ranks). A memory model that plans with these rows (busiest_share) fits on
/// every rank; one that plans with tokens / ranks lets a rank whose partition is uneven exceed its cap.
template <class StrategyT, std::invocable MakeKernel>
std::vector<std::int64_t> busiest_rank_tokens(const AttentionShape& shape, const schedule::ChunkPlan& plan, int ranks,
                                              typename StrategyT::Arguments args, MakeKernel make_kernel) {
  using Kernel = std::invoke_result_t<MakeKernel>;
  detail::require(ranks >= 1, "testing::busiest_rank_tokens", "ranks", ranks, "must be >= 1");
  std::vector<std::int64_t> out(plan.chunks.size(), 0);
  std::mutex mu;
  backend::inproc::World(ranks).run([&](backend::inproc::Transport& tr) {
    DistributedAttention<StrategyT, Kernel> attention(tr, shape, args, make_kernel());
    runtime::ChunkedAttention<Kernel> chunked(attention);
    chunked.begin(plan.chunks);
    const std::lock_guard lock(mu);
    for (std::size_t c = 0; c < out.size(); ++c) out[c] = std::max(out[c], chunked.local_tokens(static_cast<int>(c)));
  });
  return out;
}

/// The same for a TinyTransformer's attention.
template <class StrategyT, class T, std::invocable MakeKernel>
std::vector<std::int64_t> busiest_rank_tokens(const TinyTransformer<T>& model, const schedule::ChunkPlan& plan,
                                              int ranks, typename StrategyT::Arguments args, MakeKernel make_kernel) {
  return busiest_rank_tokens<StrategyT>(model.config().attention_shape(), plan, ranks, std::move(args),
                                        std::move(make_kernel));
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

/// A TinyTransformer's stage s of `stages` (see the file comment). The model must outlive the stage.
template <class T>
class TinyStage {
 public:
  using stage_category = train::pipeline_stage_tag;
  using value_type = T;
  using accum_type = T;
  using Cache = typename TinyTransformer<T>::LayerCache;
  struct ChunkState {
    std::vector<Cache> caches;  // per layer of the stage
    std::vector<T> grad;        // backward: the gradient of the next layer's input
  };

  TinyStage(const TinyTransformer<T>& model, int stage, int stages) : model_(&model), stage_(stage), stages_(stages) {
    constexpr const char* where = "testing::TinyStage";
    const int layers = model.config().layers;
    detail::require(stages >= 1 && layers % stages == 0, where, "stages", stages,
                    "must divide the model's layers " + std::to_string(layers));
    detail::require(stage >= 0 && stage < stages, where, "stage", stage,
                    "must be in [0, " + std::to_string(stages) + ")");
    grads_.assign(model.num_params(), T{0});
  }

  [[nodiscard]] int layers() const noexcept { return model_->config().layers / stages_; }
  [[nodiscard]] AttentionShape attention_shape() const noexcept { return model_->config().attention_shape(); }
  [[nodiscard]] train::ActivationShape input_shape(std::int64_t rows) const noexcept {
    return {rows, model_->config().dim};
  }
  [[nodiscard]] train::ActivationShape output_shape(std::int64_t rows) const noexcept {
    return {rows, model_->config().dim};
  }
  [[nodiscard]] train::LayerBytes layer_bytes() const noexcept {
    return {static_cast<double>(model_->activation_values_per_row() * sizeof(T)),
            static_cast<double>(static_cast<std::size_t>(model_->config().dim) * sizeof(T))};
  }
  [[nodiscard]] std::size_t held_bytes(const ChunkState& s) const noexcept {
    std::size_t b = 0;
    for (const Cache& c : s.caches) b += c.bytes();
    return b;
  }

  void forward(const train::ChunkRows& rows, std::span<const T> in, int checkpointed,
               const train::StageAttention<T>& attention, ChunkState& s, std::span<T> out) const {
    const std::size_t n = static_cast<std::size_t>(rows.rows()), d = dim();
    std::vector<T> h(n * d), h_next(n * d);
    if (stage_ == 0)
      model_->embed(rows.tokens, h);
    else
      std::copy(in.begin(), in.end(), h.begin());
    s.caches.assign(static_cast<std::size_t>(layers()), Cache{});
    for (int l = 0; l < layers(); ++l) {
      Cache& cache = s.caches[static_cast<std::size_t>(l)];
      model_->layer_forward(
          first_layer() + l, h, rows.positions(),
          [&](auto q, auto k, auto v, auto o, auto lse) { attention.forward(l, q, k, v, o, lse); }, cache, h_next);
      if (l < checkpointed) cache.checkpoint();
      std::swap(h, h_next);
    }
    std::copy(h.begin(), h.end(), out.begin());
  }

  void recompute(const train::ChunkRows& rows, int layer, const train::StageAttention<T>& attention,
                 ChunkState& s) const {
    Cache& cache = s.caches.at(static_cast<std::size_t>(layer));
    std::vector<T> redo(cache.x.size());
    model_->layer_forward(
        first_layer() + layer, cache.x, rows.positions(),
        [&](auto q, auto k, auto v, auto o, auto lse) { attention.forward(layer, q, k, v, o, lse); }, cache, redo);
  }

  void backward(const train::ChunkRows& rows, int layer, std::span<const T> dout,
                const train::StageAttention<T>& attention, ChunkState& s, std::span<T> din) {
    Cache& cache = s.caches.at(static_cast<std::size_t>(layer));
    if (layer == layers() - 1) s.grad.assign(dout.begin(), dout.end());
    std::vector<T> dx(s.grad.size());
    model_->layer_backward(
        first_layer() + layer, cache, rows.positions(), s.grad,
        [&](auto q, auto k, auto v, auto o, auto lse, auto d_o, auto dq, auto dk, auto dv) {
          attention.backward(layer, q, k, v, o, lse, d_o, dq, dk, dv);
        },
        dx, grads_);
    cache = Cache{};
    s.grad = std::move(dx);
    if (layer > 0) return;
    if (stage_ == 0)
      model_->embed_backward(rows.tokens, s.grad, grads_);
    else
      std::copy(s.grad.begin(), s.grad.end(), din.begin());
  }

  T loss(const train::ChunkRows& rows, std::span<const T> out, T scale, std::span<T> dout) {
    return model_->head(out, rows.labels, scale, dout, grads_);
  }

  /// This rank's share of the gradient (num_params(), the model's layout), accumulated over steps.
  [[nodiscard]] std::span<const T> grads() const noexcept { return grads_; }
  void zero_grads() { std::fill(grads_.begin(), grads_.end(), T{0}); }

 private:
  [[nodiscard]] std::size_t dim() const noexcept { return static_cast<std::size_t>(model_->config().dim); }
  [[nodiscard]] int first_layer() const noexcept { return stage_ * layers(); }

  const TinyTransformer<T>* model_;
  int stage_, stages_;
  std::vector<T> grads_;
};

static_assert(train::PipelineStage<TinyStage<double>>);
static_assert(train::PipelineStage<TinyStage<float>>);

}  // namespace seqpar::testing
