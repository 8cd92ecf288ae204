// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// `train::run_pipelined_step`: one training step of any model the way DPP runs it (InfiniPipe:
/// "Efficient Long-Context LLM Training with Dynamic Pipeline Parallelism"), the model given as one
/// `train::PipelineStage` per rank. The batch is cut into chunks (`schedule::DynamicChunk`), the chunks
/// grouped into 1F1B pipelines run one after another (`schedule::group_pipelines`), the layers split over
/// pipeline stages, each stage a group of ranks that runs every chunk's attention with a seqpar strategy
/// (`runtime::ChunkedAttention` per layer: a split document's later slices read the K/V its earlier
/// slices left on the ranks), activations and their gradients sent between neighbouring stages, and each
/// chunk's layers checkpointed on each stage as the schedule's diagonal decisions say (a checkpointed
/// layer keeps what it needs to run again and is recomputed right before its backward).
///
/// Ranks: world rank r is stage r / A and attention rank r % A, A = world size / stages
/// (`train::pipeline_layout`). Attention rank a of every stage holds the same rows of each chunk (the
/// stages run the same strategy on the same chunks), so a stage's activation rows go to the rank with
/// the same attention rank in the next stage, and each stage maps a chunk's rows one to one.
///
/// Communication: per chunk, rows x width values of the stage's output to the next stage and as many
/// of its gradient back (point to point, overlapped with the next operation), plus each layer's
/// attention (the strategy's and the carry's messages, ChunkedAttention). Memory: the stage's
/// `ChunkState`s of the chunks in flight (at most the pipeline's window), the ChunkedAttention carry,
/// and the last stage's loss gradients between a chunk's forward and its backward.
///
/// Checks before any message of the step: the batch, the schedule against the plan
/// (`schedule::validate_schedule`), the stage against the memory model and the chunks (its layer count,
/// one output row per input row, widths), then one agreement (an all_gather of a small record) in which
/// every rank learns whether a peer refused and whether each stage's input width is its predecessor's
/// output width. A refusal is a std::invalid_argument naming the argument on the rank that made it and
/// `seqpar::Error(Errc::kPeerFailed)` naming that rank on the others; nothing else is sent.

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "seqpar/attention/kernel.hpp"
#include "seqpar/core/attention_shape.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/range.hpp"
#include "seqpar/core/tensor.hpp"
#include "seqpar/core/transport.hpp"
#include "seqpar/distributed_attention.hpp"
#include "seqpar/runtime/agreement.hpp"
#include "seqpar/runtime/chunked_attention.hpp"
#include "seqpar/schedule/dynamic_chunk.hpp"
#include "seqpar/schedule/pipeline.hpp"
#include "seqpar/train/token_batch.hpp"
#include "seqpar/train/token_meta.hpp"

namespace seqpar::train {

/// Where a rank sits in a pipeline of `stages` stages over `world_size` ranks.
struct PipelineLayout {
  int stage = 0;           ///< rank / group
  int attention_rank = 0;  ///< rank % group: its rank in the stage's attention group
  int group = 1;           ///< ranks per stage = world_size / stages
  int stages = 1;
  [[nodiscard]] bool first() const noexcept { return stage == 0; }
  [[nodiscard]] bool last() const noexcept { return stage == stages - 1; }
};

[[nodiscard]] inline PipelineLayout pipeline_layout(int world_size, int rank, int stages) {
  constexpr const char* where = "train::pipeline_layout";
  seqpar::detail::require(stages >= 1 && world_size >= 1 && world_size % stages == 0, where, "stages", stages,
                          "must be >= 1 and divide the world size " + std::to_string(world_size));
  seqpar::detail::require(rank >= 0 && rank < world_size, where, "rank", rank,
                          "must be in [0, " + std::to_string(world_size) + ")");
  const int group = world_size / stages;
  return {rank / group, rank % group, group, stages};
}

/// The rows of one chunk a rank holds (`runtime::ChunkedAttention::owned_global(c)`, in row order) and
/// what a model needs of them: RoPE positions and document boundaries (`meta`), token ids, labels.
struct ChunkRows {
  int chunk = 0;            ///< index into the chunk plan
  TokenMeta meta;           ///< position, document, global_index, cu_seqlens of each row
  std::vector<int> tokens;  ///< token id of each row
  std::vector<int> labels;  ///< next-token label of each row, -1 at a document's last token
  [[nodiscard]] std::int64_t rows() const noexcept { return meta.rows(); }
  [[nodiscard]] std::span<const std::int64_t> positions() const noexcept { return meta.position; }
};

/// Chunk `chunk`'s rows listed by their global ranges (`owned_global(c)`) of `batch`.
[[nodiscard]] inline ChunkRows chunk_rows(const TokenBatch& batch, int chunk, std::span<const Range> rows) {
  ChunkRows r;
  r.chunk = chunk;
  r.meta = token_meta(batch.documents, rows);
  r.tokens.reserve(r.meta.global_index.size());
  for (const std::int64_t t : r.meta.global_index) r.tokens.push_back(batch.tokens[static_cast<std::size_t>(t)]);
  r.labels = labels(r.meta, std::span<const int>(batch.tokens), -1);
  return r;
}

/// A tensor sent between stages: `rows` rows of `width` values (row-major).
struct ActivationShape {
  std::int64_t rows = 0;
  std::int64_t width = 0;
};

/// Bytes per row of one layer of the stage, as DPP's memory model counts them
/// (`schedule::PipelineModel::activation_bytes_per_token` and `kept_bytes_per_token`).
struct LayerBytes {
  double activations_per_row = 0;  ///< a layer that is not checkpointed
  double kept_per_row = 0;         ///< a checkpointed layer (what it keeps to run again)
};

namespace detail_stage {

// The runner's per-layer ChunkedAttentions behind one kernel-independent interface (a handle the
// stage's code can name without the kernel type).
template <class T, class A>
class LayerAttention {
 public:
  LayerAttention() = default;
  LayerAttention(const LayerAttention&) = delete;
  LayerAttention& operator=(const LayerAttention&) = delete;
  [[nodiscard]] virtual int layers() const noexcept = 0;
  virtual void forward(int layer, int chunk, bool recompute, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v,
                       ThdView<T> o, LseView<A> lse) = 0;
  virtual void backward(int layer, int chunk, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v,
                        ThdView<const T> o, LseView<const A> lse, ThdView<const T> dout, ThdView<T> dq, ThdView<T> dk,
                        ThdView<T> dv) = 0;

 protected:
  ~LayerAttention() = default;
};

}  // namespace detail_stage

/// The attention of one chunk on one stage, as the stage's layers call it: layer `layer` (of the
/// stage, from 0) runs its (q, k, v) rows, the chunk's rows on this rank, through the stage's
/// `runtime::ChunkedAttention` of that layer. In `PipelineStage::recompute` the same `forward` call
/// runs `ChunkedAttention::recompute` (the same O and LSE, bit for bit), so a stage recomputes a layer
/// with its forward code. Views are dense THD over the chunk rows: (rows, heads, head_dim).
template <class T, class A = T>
class StageAttention {
 public:
  StageAttention(detail_stage::LayerAttention<T, A>& layers, int chunk, bool recompute) noexcept
      : layers_(&layers), chunk_(chunk), recompute_(recompute) {}
  [[nodiscard]] int chunk() const noexcept { return chunk_; }
  [[nodiscard]] bool recomputing() const noexcept { return recompute_; }

  void forward(int layer, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v, ThdView<T> o,
               LseView<A> lse) const {
    check(layer, "train::StageAttention::forward");
    layers_->forward(layer, chunk_, recompute_, q, k, v, o, lse);
  }
  /// dq, dk, dv are accumulated (+=) as the kernels do: zero them first.
  void backward(int layer, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v, ThdView<const T> o,
                LseView<const A> lse, ThdView<const T> dout, ThdView<T> dq, ThdView<T> dk, ThdView<T> dv) const {
    check(layer, "train::StageAttention::backward");
    layers_->backward(layer, chunk_, q, k, v, o, lse, dout, dq, dk, dv);
  }

 private:
  void check(int layer, const char* where) const {
    if (layer < 0 || layer >= layers_->layers())
      seqpar::detail::throw_invalid(where, "layer", layer,
                                    "must be a layer of the stage, in [0, " + std::to_string(layers_->layers()) + ")");
  }
  detail_stage::LayerAttention<T, A>* layers_;
  int chunk_;
  bool recompute_;
};

/// Opt-in tag of pipeline stages.
struct pipeline_stage_tag {};

/// One pipeline stage of a model on one rank: the stage's layers over the rows of one chunk this rank
/// holds, for `run_pipelined_step`. Rows are independent except in the attention, which the stage runs
/// through the `StageAttention` it is given, so a stage sees only its rows of each chunk. A stage
/// declares `stage_category = pipeline_stage_tag`, `value_type` (its activations, the kernel's
/// value_type), `accum_type` (the kernel's LSE type) and `ChunkState` (what it keeps of one chunk
/// between the chunk's forward and its backward; default-constructible, movable), and answers:
///  - `layers()`: its layer count (the memory model's layers_per_stage);
///  - `attention_shape()`: the heads and head dim of its layers' attention (one shape per stage);
///  - `input_shape(n)`, `output_shape(n)`: the tensors it receives from the previous stage (its
///    gradient goes back) and sends to the next one (the last stage passes it to `loss`), for a chunk
///    of n rows: n rows each (a stage maps rows one to one), of a width that depends on nothing else;
///    the first stage receives nothing (`in` is empty) and starts from `rows.tokens`;
///  - `layer_bytes()`: one layer's bytes per row, kept whole and checkpointed (the memory model's);
///  - `held_bytes(state)`: the bytes of activations `state` keeps (measured against the model);
///  - `forward(rows, in, checkpointed, attention, state, out)`: every layer of the stage on the rows;
///    layers [0, checkpointed) keep only what they need to run again (`layer_bytes().kept_per_row`),
///    the others everything their backward needs;
///  - `recompute(rows, layer, attention, state)`: a checkpointed layer's activations again, called
///    right before that layer's backward (its attention call runs ChunkedAttention::recompute);
///  - `backward(rows, layer, dout, attention, state, din)`: one layer's backward, called for
///    layer = layers() - 1 down to 0. `dout` (rows x output width) is the gradient of the stage's
///    output, read at its last layer; `din` (rows x input width, empty on the first stage) receives the
///    gradient of its input at layer 0; the stage keeps the gradient between its layers in `state` and
///    accumulates its parameters' gradients itself;
///  - `loss(rows, out, scale, dout)` (called on the last stage only): the sum of the rows' losses of
///    the stage's output `out`; writes dout = scale x d(sum)/d(out) and adds scale x the gradients of
///    the parameters it uses (scale: 1 / labelled tokens of the batch, for a mean loss).
/// The runner calls every method of a chunk with the same `rows` and `state`, in the schedule's
/// order; a stage's attention calls must be the same on every rank of its group (every layer, once).
///
/// @code
/// struct MyStage {
///   using stage_category = train::pipeline_stage_tag;
///   using value_type = double;
///   using accum_type = double;
///   struct ChunkState { std::vector<MyLayerCache> layers; std::vector<double> grad; };
///   int layers() const;
///   train::ActivationShape input_shape(std::int64_t n) const { return {n, dim}; }
///   ...  // output_shape, layer_bytes, held_bytes, forward, recompute, backward, loss
/// };
/// static_assert(train::PipelineStage<MyStage>);
/// const auto layout = train::pipeline_layout(world.size(), world.rank(), stages);
/// MyStage stage(model, layout.stage);  // this rank's layers
/// auto r = train::run_pipelined_step<Strategy<partition::Hybrid, comm::Ring>>(
///     world, stage, batch, plan, schedule, memory_model, args, [] { return attention::CpuFlash<double>{}; });
/// @endcode
template <class S>
concept PipelineStage = std::derived_from<typename S::stage_category, pipeline_stage_tag> &&
    std::default_initializable<typename S::ChunkState> && std::movable<typename S::ChunkState> &&
    requires(S& s, const S& cs, typename S::ChunkState& state, const typename S::ChunkState& cstate,
             const ChunkRows& rows, std::int64_t n, int layer,
             const StageAttention<typename S::value_type, typename S::accum_type>& attention,
             std::span<const typename S::value_type> in, std::span<typename S::value_type> out,
             typename S::value_type scale) {
  { cs.layers() } -> std::convertible_to<int>;
  { cs.attention_shape() } -> std::convertible_to<AttentionShape>;
  { cs.input_shape(n) } -> std::same_as<ActivationShape>;
  { cs.output_shape(n) } -> std::same_as<ActivationShape>;
  { cs.layer_bytes() } -> std::same_as<LayerBytes>;
  { cs.held_bytes(cstate) } -> std::convertible_to<std::size_t>;
  s.forward(rows, in, layer, attention, state, out);
  s.recompute(rows, layer, attention, state);
  s.backward(rows, layer, in, attention, state, out);
  { s.loss(rows, in, scale, out) } -> std::convertible_to<typename S::value_type>;
};

/// What one rank computed in a pipelined step (the parameters' gradients are the stage's own).
template <class T>
struct PipelinedStepResult {
  int stage = 0;
  int attention_rank = 0;
  T loss_sum = 0;                          ///< sum of the token losses of this rank's rows (last stage only)
  std::int64_t label_tokens = 0;           ///< tokens with a next-token label in the whole batch
  std::size_t peak_activation_bytes = 0;   ///< held_bytes of the chunks in flight right after a forward, max
  double predicted_peak_bytes = 0;         ///< the memory model's value for this rank's rows
  std::size_t peak_bytes_with_extras = 0;  ///< max at any time of activations + recomputed layer + loss grads
  std::size_t carry_bytes = 0;      ///< K, dK (qk_dim wide), V, dV (v_dim) of the carried prefix rows, all layers
  long long layers_recomputed = 0;  ///< layers this rank ran forward twice
};

namespace detail_stage {

template <class Kernel>
class ChunkedLayers final : public LayerAttention<typename Kernel::value_type, typename Kernel::accum_type> {
  using T = typename Kernel::value_type;
  using A = typename Kernel::accum_type;

 public:
  explicit ChunkedLayers(std::vector<std::unique_ptr<runtime::ChunkedAttention<Kernel>>>& layers) noexcept
      : layers_(layers) {}
  [[nodiscard]] int layers() const noexcept override { return static_cast<int>(layers_.size()); }
  void forward(int layer, int chunk, bool recompute, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v,
               ThdView<T> o, LseView<A> lse) override {
    auto& ca = *layers_[static_cast<std::size_t>(layer)];
    if (recompute)
      ca.recompute(chunk, q, k, v, o, lse);
    else
      ca.forward(chunk, q, k, v, o, lse);
  }
  void backward(int layer, int chunk, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v, ThdView<const T> o,
                LseView<const A> lse, ThdView<const T> dout, ThdView<T> dq, ThdView<T> dk, ThdView<T> dv) override {
    layers_[static_cast<std::size_t>(layer)]->backward(chunk, q, k, v, o, lse, dout, dq, dk, dv);
  }

 private:
  std::vector<std::unique_ptr<runtime::ChunkedAttention<Kernel>>>& layers_;
};

// The attention mask of the stage's layer l: the stage's `attention_mask(l)` when it declares one (a
// model mixing window and full layers), causal otherwise. Every layer runs on the same rows of a chunk.
template <class S>
AttentionMask mask_of_layer(const S& stage, int l) {
  if constexpr (requires {
                  { stage.attention_mask(l) } -> std::convertible_to<AttentionMask>;
                })
    return stage.attention_mask(l);
  else
    return {};
}

// Every local check of the stage, then the one agreement (runtime/agreement.hpp): a refusal reaches every
// rank before any other message; the chunk plan and the layer count must be the same everywhere; each
// stage's input width is compared with its predecessor's output width (exchanged, compared here).
template <class S, Transport Tr>
void agree_on_stage(Tr& world, const S& stage, const PipelineLayout& layout, const schedule::ChunkPlan& plan,
                    int layers_per_stage, const char* where) {
  std::int64_t input_width = 0, output_width = 0;
  std::exception_ptr refused;
  try {
    const int layers = stage.layers();
    seqpar::detail::require(layers == layers_per_stage, where, "stage.layers()", layers,
                            "must be memory_model.layers_per_stage = " + std::to_string(layers_per_stage));
    stage.attention_shape().validate(where);
    // A stage maps rows one to one: the next stage's attention rank holds the same rows of the chunk.
    const auto check = [&](const char* what, std::int64_t n, const ActivationShape& s, std::int64_t& width) {
      if (s.rows != n)
        seqpar::detail::throw_invalid(where, std::string("stage.") + what + "(" + std::to_string(n) + ").rows", s.rows,
                                      "must be " + std::to_string(n) +
                                          ": a stage maps a chunk's rows one to one (the next stage's attention rank "
                                          "holds the same rows)");
      if (s.width < 1 || (width != 0 && s.width != width))
        seqpar::detail::throw_invalid(where, std::string("stage.") + what + "(" + std::to_string(n) + ").width",
                                      s.width,
                                      width != 0 ? "must not depend on the rows (it was " + std::to_string(width) + ")"
                                                 : std::string("must be >= 1"));
      width = s.width;
    };
    for (const auto& chunk : plan.chunks) {
      const std::int64_t n = chunk.batch.total_tokens();
      if (!layout.first()) check("input_shape", n, stage.input_shape(n), input_width);
      check("output_shape", n, stage.output_shape(n), output_width);
    }
  } catch (const std::exception&) {
    refused = std::current_exception();
  }
  runtime::Agreement a(where, "its stage");
  a.add("the chunk plan (fingerprint)", plan.fingerprint(), runtime::Agreement::kHash);
  a.add("memory_model.layers_per_stage", std::int64_t{layers_per_stage});
  const std::size_t in = a.add_own("stage.input_shape(rows).width", input_width);
  const std::size_t out = a.add_own("stage.output_shape(rows).width", output_width);
  std::vector<runtime::Agreement::Record> records;
  a.run(world, refused, records);
  // Every rank compares the same table, so every rank throws the same error.
  for (int r = layout.group; r < world.size(); ++r) {
    const auto to = static_cast<std::int64_t>(a.record(r).value[in]);
    const auto from = static_cast<std::int64_t>(a.record(r - layout.group).value[out]);
    if (to != from)
      seqpar::detail::throw_invalid(where, "stage.input_shape(rows).width of rank " + std::to_string(r), to,
                                    "must equal the output width of rank " + std::to_string(r - layout.group) +
                                        " (the previous stage), " + std::to_string(from));
  }
}

}  // namespace detail_stage

/// Runs one step on this rank (see the file comment). `stage` is this rank's stage
/// (`pipeline_layout(world.size(), world.rank(), memory_model.stages).stage`); `memory_model` is the
/// model `schedule` was planned with (its stages and layers_per_stage must match the layout); its
/// per-token bytes are not used for `predicted_peak_bytes`, which takes the stage's `layer_bytes()`
/// and this rank's rows. `make_kernel()` returns a kernel (one for the strategy, one per layer for
/// the prefix terms) whose value_type and accum_type are the stage's. Every rank calls with the same
/// batch, plan, schedule, memory model and arguments. The sum over the ranks of the stages' parameter
/// gradients is the step's gradient, and the sum of `loss_sum` / label_tokens the single-device loss,
/// exactly up to rounding.
template <class StrategyT, PipelineStage Stage, Transport Tr, std::invocable MakeKernel>
PipelinedStepResult<typename Stage::value_type> run_pipelined_step(Tr& world, Stage& stage, const TokenBatch& batch,
                                                                   const schedule::ChunkPlan& plan,
                                                                   const schedule::PipelineSchedule& schedule,
                                                                   const schedule::PipelineModel& memory_model,
                                                                   typename StrategyT::Arguments args,
                                                                   MakeKernel make_kernel) {
  using T = typename Stage::value_type;
  using A = typename Stage::accum_type;
  using Kernel = std::invoke_result_t<MakeKernel>;
  static_assert(attention::AttentionKernel<Kernel>, "run_pipelined_step: make_kernel() must return a kernel");
  static_assert(std::is_same_v<typename Kernel::value_type, T> && std::is_same_v<typename Kernel::accum_type, A>,
                "run_pipelined_step: the kernel's value_type and accum_type must be the stage's");
  constexpr const char* where = "train::run_pipelined_step";
  const int stages = memory_model.stages;
  seqpar::detail::require(stages >= 1 && world.size() % stages == 0, where, "memory_model.stages", stages,
                          "must divide the world size " + std::to_string(world.size()));
  batch.validate(where);
  // Before any message: a schedule of another plan or stage count, or an empty one, is refused here
  // on every rank alike (each rank checks the same arguments), so no rank is left waiting.
  schedule::validate_schedule(plan, schedule, stages, memory_model.layers_per_stage, where);
  if (plan.batch_fingerprint != 0 && plan.batch_fingerprint != batch.documents.fingerprint())
    seqpar::detail::throw_invalid(where, "plan.batch_fingerprint", plan.batch_fingerprint,
                                  "is not this batch's (" + std::to_string(batch.documents.fingerprint()) +
                                      "): a chunk plan made for another batch (kept from an earlier step?); chunk "
                                      "this batch (schedule::DynamicChunk::plan(batch.documents))");
  PipelinedStepResult<T> out;
  out.label_tokens = batch.label_tokens();
  seqpar::detail::require(out.label_tokens > 0, where, "batch", "no labels", "needs a document of at least 2 tokens");
  const PipelineLayout layout = pipeline_layout(world.size(), world.rank(), stages);
  detail_stage::agree_on_stage(world, stage, layout, plan, memory_model.layers_per_stage, where);
  out.stage = layout.stage;
  out.attention_rank = layout.attention_rank;
  const int per_stage = memory_model.layers_per_stage, group = layout.group;
  const bool first = layout.first(), last = layout.last();
  const T scale = T{1} / static_cast<T>(out.label_tokens);
  const AttentionShape shape = stage.attention_shape();

  // The stage's attention group, one chunked attention per layer of the stage.
  Tr attention_world = world.split(layout.stage, layout.attention_rank);
  DistributedAttention<StrategyT, Kernel> attention(attention_world, shape, args, make_kernel());
  std::vector<std::unique_ptr<runtime::ChunkedAttention<Kernel>>> chunked;
  for (int l = 0; l < per_stage; ++l) {
    chunked.push_back(std::make_unique<runtime::ChunkedAttention<Kernel>>(attention));
    chunked.back()->begin(batch.documents, plan.chunks, detail_stage::mask_of_layer(stage, l));
  }
  // K and dK rows are qk_dim() wide, V and dV rows v_dim() (MLA: 192 and 128).
  for (const auto& ca : chunked)
    out.carry_bytes += 2 * static_cast<std::size_t>(ca->carry_rows()) * static_cast<std::size_t>(shape.heads_kv) *
                       static_cast<std::size_t>(shape.qk_dim() + shape.v_dim()) * sizeof(T);
  detail_stage::ChunkedLayers<Kernel> layer_attention(chunked);

  const int prev = world.rank() - group, next = world.rank() + group;
  const auto tag = [](int c, bool backward) { return 2 * c + (backward ? 1 : 0); };
  const auto values = [](const ActivationShape& s) {
    return static_cast<std::size_t>(s.rows) * static_cast<std::size_t>(s.width);
  };

  // In-flight state per chunk of the running pipeline.
  struct InFlight {
    ChunkRows rows;
    typename Stage::ChunkState state;
    std::vector<T> dout;   // last stage: the loss gradient of the stage's output
    int checkpointed = 0;  // the stage's first `checkpointed` layers keep only what they rerun from
  };
  std::vector<std::unique_ptr<InFlight>> flight(plan.chunks.size());
  std::deque<std::vector<T>> send_buffers;
  std::vector<typename Tr::Request> sends;
  const auto held_bytes = [&] {
    std::size_t b = 0;
    for (const auto& f : flight)
      if (f) b += static_cast<std::size_t>(stage.held_bytes(f->state));
    return b;
  };
  std::size_t stash = 0;  // loss gradients held by the last stage
  const LayerBytes layer_bytes = stage.layer_bytes();

  for (const schedule::Pipeline& pipeline : schedule.pipelines) {
    const schedule::CheckpointProblem prob = schedule::checkpoint_problem(plan, memory_model, pipeline);
    // The memory model for this rank's rows of these chunks and this stage's activation sizes.
    schedule::CheckpointProblem mine = prob;
    mine.model.static_bytes = 0;
    mine.model.activation_bytes_per_token = layer_bytes.activations_per_row;
    mine.model.kept_bytes_per_token = layer_bytes.kept_per_row;
    for (std::size_t k = 0; k < pipeline.chunks.size(); ++k)
      mine.tokens[k] = chunked.front()->local_tokens(pipeline.chunks[k]);
    const schedule::CheckpointPlan predicted = schedule::evaluate(mine, pipeline.checkpointing.diagonals, "model");
    out.predicted_peak_bytes =
        std::max(out.predicted_peak_bytes, predicted.peak_bytes[static_cast<std::size_t>(layout.stage)]);

    const auto ops = schedule::one_f_one_b(pipeline.backward_order, stages);
    for (const schedule::StageOp& op : ops[static_cast<std::size_t>(layout.stage)]) {
      const int c = pipeline.chunks[static_cast<std::size_t>(op.chunk)];
      auto& slot = flight[static_cast<std::size_t>(c)];
      if (!op.backward) {
        slot = std::make_unique<InFlight>();
        InFlight& f = *slot;
        f.rows = chunk_rows(batch, c, chunked.front()->owned_global(c));
        const std::int64_t n = f.rows.rows();
        f.checkpointed = pipeline.checkpointing.layers(prob, op.chunk, layout.stage);
        std::vector<T> in(first ? 0 : values(stage.input_shape(n))), h(values(stage.output_shape(n)));
        if (!first) world.recv(std::as_writable_bytes(std::span<T>(in)), prev, tag(c, false));
        stage.forward(f.rows, std::span<const T>(in), f.checkpointed, StageAttention<T, A>(layer_attention, c, false),
                      f.state, std::span<T>(h));
        if (last) {
          f.dout.assign(h.size(), T{0});
          out.loss_sum += stage.loss(f.rows, std::span<const T>(h), scale, std::span<T>(f.dout));
          stash += f.dout.size() * sizeof(T);
        } else {
          send_buffers.push_back(std::move(h));
          sends.push_back(world.isend(std::as_bytes(std::span<const T>(send_buffers.back())), next, tag(c, false)));
        }
        const std::size_t held = held_bytes();
        out.peak_activation_bytes = std::max(out.peak_activation_bytes, held);
        out.peak_bytes_with_extras = std::max(out.peak_bytes_with_extras, held + stash);
      } else {
        InFlight& f = *slot;
        const std::int64_t n = f.rows.rows();
        std::vector<T> dout(values(stage.output_shape(n))), din(first ? 0 : values(stage.input_shape(n)));
        if (last) {
          stash -= f.dout.size() * sizeof(T);
          dout = std::move(f.dout);
        } else {
          world.recv(std::as_writable_bytes(std::span<T>(dout)), next, tag(c, true));
        }
        for (int l = per_stage - 1; l >= 0; --l) {
          if (l < f.checkpointed) {
            stage.recompute(f.rows, l, StageAttention<T, A>(layer_attention, c, true), f.state);
            ++out.layers_recomputed;
            out.peak_bytes_with_extras = std::max(out.peak_bytes_with_extras, held_bytes() + stash);
          }
          stage.backward(f.rows, l, std::span<const T>(dout), StageAttention<T, A>(layer_attention, c, false), f.state,
                         std::span<T>(din));
        }
        if (!first) {
          send_buffers.push_back(std::move(din));
          sends.push_back(world.isend(std::as_bytes(std::span<const T>(send_buffers.back())), prev, tag(c, true)));
        }
        slot.reset();
      }
    }
  }
  for (auto& r : sends) world.wait(r);
  return out;
}

}  // namespace seqpar::train
