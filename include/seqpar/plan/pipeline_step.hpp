// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// A training step of DPP (InfiniPipe / Concertina: "Efficient Long-Context LLM Training with Dynamic Pipeline
/// Parallelism") on the cost
/// model: a chunk plan (`schedule::DynamicChunk`) run as 1F1B pipelines (`schedule::group_pipelines`)
/// over d_p stages, each stage a group of d_s ranks running Ulysses sequence parallelism with ZeRO-3
/// inside the stage (the paper: d_s = 8 inside a node, d_p = 4 across nodes, FSDP per stage).
///
/// Per chunk and stage, on one rank of the stage (replay/costs.hpp), each of its L / d_p layers:
///   forward  = all-to-all (Q, K, V in; O out) + max(GEMMs + attention, ZeRO gather of the layer)
///   backward = all-to-all + max(2 x GEMMs + attention backward, ZeRO gather + gradient reduce-scatter);
///              a checkpointed layer first runs its forward again (its all-to-all and compute).
/// GEMMs are priced per token (roofline over the rank's T / d_s rows), attention per tile over the
/// chunk's pieces with ceil(Hq / d_s) heads per rank (Ulysses with uneven heads: the busiest rank). A
/// piece with a prefix (a split document's later slice) also attends to its prefix as
/// runtime::ChunkedAttention runs it: the carry's programs (comm::ChunkCarry: the prefix rows sent to the
/// ranks holding the piece's queries, a full-mask call there, merged; in backward the dK/dV sent back)
/// are compiled for the stage's group and replayed (replay::Replay), not priced by a formula.
/// ZeRO collectives run on their own stream and hide under compute, not under the all-to-all (both use
/// NVLink). The last stage adds the LM head (its weights gathered like a layer's).
/// Between stages a forward sends chunk_tokens x hidden activations (value bytes) and a backward their
/// gradients, one transfer per boundary and direction at a time, over the nodes' NICs when the stages sit
/// on different nodes (NVLink otherwise).
/// The step: every stage runs its ops in the pipeline's 1F1B order (schedule::one_f_one_b over the
/// pipeline's backward order: a split document goes backward last slice first), an op starting when its
/// stage is free and its input has arrived; pipelines run one after another with a barrier between them
/// (DPP does not overlap them); then the optimizer (Adam over the stage's ZeRO shard, bound by HBM). A
/// stage's bubble is what is left: its idle time, waits for P2P included.
/// Memory is tracked along the executed order: the static terms of plan::stage_memory (model states,
/// gathered layers and, with the plan's bounds from plan::with_chunks, the transients of the largest
/// chunk) + the activations of the chunks in flight on the stage's busiest rank (a checkpointed layer
/// keeps only its input), compared with the cap; beside it, the peak the checkpointing plan predicted.
/// Not modelled: ZeRO / all-to-all contention beyond the rule above, the embedding's gather, kernel
/// efficiency of short GEMMs beyond the roofline, overlap of consecutive pipelines.
///
/// @code
/// plan::PipelineStepOptions opt{.model = models::llama_13b(), .hardware = replay::profiles::a800_80gb(),
///                               .stages = 4, .sp_ranks = 8};
/// auto chunks = schedule::DynamicChunk{{.token_capacity = 16384, .cost = plan::chunk_cost(opt)}}.plan(batch);
/// auto pipes = schedule::group_pipelines(chunks, plan::pipeline_model(opt));
/// plan::PipelineStepReport rep = plan::simulate_pipeline_step(chunks, pipes, opt);   // rep.step_s, rep.bubble_s
/// @endcode

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "seqpar/comm/all_to_all.hpp"
#include "seqpar/comm/chunk_carry.hpp"
#include "seqpar/core/attn_slice.hpp"
#include "seqpar/core/chunk.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/topology.hpp"
#include "seqpar/partition/uniform.hpp"
#include "seqpar/plan/model_shape.hpp"
#include "seqpar/plan/pipeline_step_options.hpp"
#include "seqpar/plan/stage_memory.hpp"
#include "seqpar/plan/step.hpp"
#include "seqpar/replay/costs.hpp"
#include "seqpar/replay/hardware.hpp"
#include "seqpar/replay/simulator.hpp"
#include "seqpar/schedule/dynamic_chunk.hpp"
#include "seqpar/schedule/pipeline.hpp"
#include "seqpar/strategy.hpp"

namespace seqpar::plan {

/// Seconds of one transformer layer on one rank of a Ulysses group running a batch of document pieces.
struct UlyssesLayer {
  double gemm = 0;                ///< forward projections and MLP over the rank's tokens / ranks rows
  double attention = 0;           ///< forward kernel, ceil(Hq / ranks) heads over all the pieces
  double attention_backward = 0;  ///< backward kernel
  double all_to_all = 0;          ///< forward exchanges (Q, K, V to heads; O back); backward moves as much
  double prefix = 0;              ///< the prefix term's forward (replayed carry program: exchange, call, merge)
  double prefix_backward = 0;     ///< its backward (exchange, call, dK/dV returned, carry gradients added)

  [[nodiscard]] double forward_compute() const noexcept { return gemm + attention + prefix; }
  [[nodiscard]] double backward_compute() const noexcept { return 2.0 * gemm + attention_backward + prefix_backward; }
};

/// One layer over `slices` (the pieces' attention, document coordinates) and `tokens` rows in all, on a
/// Ulysses group of `group.world_size` ranks (all-to-alls cross nodes when it spans more than one).
[[nodiscard]] inline UlyssesLayer ulysses_layer(const replay::HardwareProfile& hw, const ModelShape& model,
                                                const Topology& group, std::span<const AttnSlice> slices,
                                                std::int64_t tokens) {
  const int g = group.world_size;
  const double vb = hw.value_bytes;
  const double per_rank = static_cast<double>(tokens) / g;
  const int heads = (model.heads_q + g - 1) / g;
  const ModelShape::AttentionWidths w = model.attention_widths();
  const int dv = model.attention().v_dim();
  UlyssesLayer l;
  l.gemm = layer_gemm_seconds(hw, model, per_rank, vb).total();
  if (tokens > 0) {
    l.attention = replay::attention_seconds(hw, slices, heads, model.head_dim, false, dv);
    l.attention_backward = replay::attention_seconds(hw, slices, heads, model.head_dim, true, dv);
  }
  l.all_to_all = replay::all_to_all_seconds(hw, group, g, per_rank * (w.q + w.k + w.v) * vb) +
                 replay::all_to_all_seconds(hw, group, g, per_rank * w.o * vb);
  return l;
}

/// The slices of chunk `c`'s pieces over their own rows under the layer's `mask` (what the strategy runs;
/// the prefix term is the carry's, prefix_seconds).
[[nodiscard]] inline std::vector<AttnSlice> chunk_own_slices(const schedule::ChunkPlan& plan, int c,
                                                             AttentionMask mask = {}) {
  const std::int64_t w = mask.window;
  std::vector<AttnSlice> out;
  for (const schedule::ChunkPiece& p : plan.pieces[static_cast<std::size_t>(c)])
    out.push_back({{p.begin, p.end}, {p.begin, p.end}, w > 0 ? Mask::sliding_window(w) : Mask::causal()});
  return out;
}

/// The attention of chunk `c` of `plan`, as ChunkedAttention computes it, in document rows: per piece a
/// causal slice over its own rows and, when it has a prefix, a full slice over the prefix keys; under a
/// layer mask with a sliding window w, sliding-window slices, the prefix cut to the w - 1 keys before the piece.
[[nodiscard]] inline std::vector<AttnSlice> chunk_slices(const schedule::ChunkPlan& plan, int c,
                                                         AttentionMask mask = {}) {
  const std::int64_t w = mask.window;
  std::vector<AttnSlice> out;
  for (const schedule::ChunkPiece& p : plan.pieces[static_cast<std::size_t>(c)]) {
    out.push_back({{p.begin, p.end}, {p.begin, p.end}, w > 0 ? Mask::sliding_window(w) : Mask::causal()});
    if (const Range keys = visible_prefix({0, p.begin}, w); !keys.empty())
      out.push_back({{p.begin, p.end}, keys, w > 0 ? Mask::sliding_window(w, p.begin - keys.begin) : Mask::full()});
  }
  return out;
}

/// Seconds of one layer's prefix term per chunk (0 for chunks without a prefix), forward and backward.
struct PrefixSeconds {
  double forward = 0, backward = 0;
};

/// The prefix terms of `plan`'s chunks on one stage of `options` as runtime::ChunkedAttention runs them:
/// every chunk planned by the stage's Ulysses strategy on its d_s ranks, the carry's programs compiled
/// for every rank (comm::ChunkCarry), each chunk's forward and backward prefix programs replayed on the
/// stage's group (the slowest rank's time).
[[nodiscard]] inline std::vector<PrefixSeconds> prefix_seconds(const schedule::ChunkPlan& plan,
                                                               const PipelineStepOptions& options) {
  using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
  const int g = options.sp_ranks;
  const Topology group{g, std::min(g, options.hardware.ranks_per_node)};
  const AttentionShape shape = options.model.attention();
  std::vector<PrefixSeconds> out(plan.chunks.size());
  bool any = false;
  for (std::size_t c = 0; c < plan.chunks.size(); ++c)
    for (const Range& p : plan.chunks[c].prefix) any = any || !p.empty();
  if (!any) return out;
  std::vector<std::vector<std::vector<Range>>> owned;
  for (const Chunk& ch : plan.chunks) {
    const auto planned = Ulysses::plan({}, ch.batch, shape, group);
    if (!planned.status)
      throw std::invalid_argument("plan::prefix_seconds: the stage's Ulysses refuses a chunk: " +
                                  planned.status.reason);
    owned.emplace_back();
    for (int r = 0; r < g; ++r)
      owned.back().push_back(comm::ChunkCarry::to_global(ch, planned.plan.owned[static_cast<std::size_t>(r)]));
  }
  const comm::ChunkCarry carry(plan.chunks, std::move(owned), shape, options.mask);
  replay::SimulationOptions sim;
  sim.hardware = options.hardware;
  for (int c = 0; c < carry.num_chunks(); ++c) {
    if (!carry.has_prefix(c)) continue;
    std::vector<comm::Program> fwd, bwd;
    for (int r = 0; r < g; ++r) {
      fwd.push_back(carry.forward(c, r, true));
      bwd.push_back(carry.backward(c, r));
    }
    out[static_cast<std::size_t>(c)] = {replay::Replay(fwd, group, shape, sim).run({}, false).time_s,
                                        replay::Replay(bwd, group, shape, sim).run({}, false).time_s};
  }
  return out;
}

/// DynamicChunk's cost model for `options`: seconds of one layer's forward on one rank of a stage, per
/// token (GEMMs and the all-to-all's bandwidth) and per causal (query, key) pair (attention at the
/// profile's long-tile rate). Tiles are priced exactly by the step simulation, not here.
[[nodiscard]] inline schedule::ChunkCost chunk_cost(const PipelineStepOptions& options) {
  options.validate("plan::chunk_cost");
  const replay::HardwareProfile& hw = options.hardware;
  const ModelShape& m = options.model;
  const int g = options.sp_ranks;
  const Topology group{g, hw.ranks_per_node};
  const ModelShape::AttentionWidths w = m.attention_widths();
  constexpr double kTokens = 1 << 20;  // the all-to-alls' latency amortised away
  const double a2a = replay::all_to_all_seconds(hw, group, g, kTokens / g * (w.q + w.k + w.v + w.o) * hw.value_bytes);
  const int heads = (m.heads_q + g - 1) / g;
  return {m.layer_gemm_flops_per_token() / g / hw.gemm_rate() + a2a / kTokens,
          replay::attention_flops(heads, m.head_dim, false, m.attention().v_dim()) /
              (hw.peak_flops * hw.attention_efficiency),
          MaskMix::only(options.mask)};
}

/// The pipeline scheduler's model of `options` (schedule::PipelineModel): per rank of a stage, static
/// bytes = the largest stage's plan::stage_memory without its in-flight activations (ZeRO-sharded model
/// states, gathered layers, and, when options carry the chunk plan's bounds (plan::with_chunks), one
/// layer's backward working set, logits and loss, the K/V carry and communication buffers); activations
/// per token and layer (ModelShape::layer_activation_bytes_per_token) over the d_s Ulysses ranks times
/// options.rank_imbalance (the busiest rank's share); a checkpointed layer keeps its input; the cap is
/// the rank's memory less the reserve; chunk costs in seconds (chunk_cost).
[[nodiscard]] inline schedule::PipelineModel pipeline_model(const PipelineStepOptions& options) {
  options.validate("plan::pipeline_model");
  const ModelShape& m = options.model;
  double fixed = 0;
  for (int p = 0; p < options.stages; ++p) fixed = std::max(fixed, stage_memory(options, p, 0.0).total());
  const double share = options.rank_imbalance / options.sp_ranks;
  schedule::PipelineModel pm;
  pm.stages = options.stages;
  pm.layers_per_stage = options.layers_per_stage();
  pm.static_bytes = fixed;
  pm.memory_cap = options.hardware.memory_bytes * (1.0 - options.memory_reserve);
  pm.activation_bytes_per_token = m.layer_activation_bytes_per_token(options.value_bytes()) * share;
  pm.kept_bytes_per_token = static_cast<double>(m.hidden) * options.value_bytes() * share;
  pm.seconds_per_cost = 1.0;
  return pm;
}

/// One stage's share of a simulated DPP step (seconds unless named otherwise).
struct PipelineStageReport {
  double busy_s = 0;          ///< its forward and backward ops (recomputation and exposed communication in them)
  double idle_s = 0;          ///< step - busy - optimizer: bubbles, waits for P2P included
  double recompute_s = 0;     ///< what checkpointed layers added to the backward ops
  double all_to_all_s = 0;    ///< Ulysses exchanges (forward, backward, recomputation)
  double zero_s = 0;          ///< ZeRO-3 collectives issued (busy time on their stream)
  double zero_exposed_s = 0;  ///< the part compute did not hide
  double optimizer_s = 0;
  double peak_memory_bytes = 0;          ///< along the executed order
  double planned_peak_memory_bytes = 0;  ///< the checkpointing plans' prediction (their 1F1B windows)
};

struct PipelineStepReport {
  double step_s = 0, tokens_per_s = 0;
  double bubble_s = 0;        ///< mean idle time over stages
  double p2p_s = 0;           ///< busiest stage boundary: transfer time, both directions
  double recompute_s = 0;     ///< mean over stages
  double all_to_all_s = 0;    ///< mean over stages
  double zero_exposed_s = 0;  ///< mean over stages
  double memory_cap_bytes = 0;
  bool fits_memory = true;  ///< every stage's executed peak within the cap
  int pipelines = 0, chunks = 0;
  std::int64_t tokens = 0;
  long long layers_recomputed = 0;  ///< sum over pipelines of their checkpointing objective (sum C)
  std::vector<PipelineStageReport> stages;

  [[nodiscard]] double max_peak_memory_bytes() const noexcept {
    double m = 0;
    for (const PipelineStageReport& s : stages) m = std::max(m, s.peak_memory_bytes);
    return m;
  }
};

/// Simulates one training step of `schedule` (pipelines over `plan`'s chunks, each with its
/// checkpointing) on `options` (the file comment has the model). Every chunk of the plan must be in
/// exactly one pipeline; the pipelines' chunk lists are their forward order. Throws std::invalid_argument
/// naming what does not match.
[[nodiscard]] inline PipelineStepReport simulate_pipeline_step(const schedule::ChunkPlan& plan,
                                                               const schedule::PipelineSchedule& schedule,
                                                               const PipelineStepOptions& options) {
  constexpr const char* where = "plan::simulate_pipeline_step";
  options.validate(where);
  const int d = options.stages, lps = options.layers_per_stage(), g = options.sp_ranks, zero = options.zero();
  const replay::HardwareProfile& hw = options.hardware;
  const ModelShape& m = options.model;
  const double vb = options.value_bytes();
  const int total = static_cast<int>(plan.chunks.size());
  schedule::validate_schedule(plan, schedule, d, lps, where);

  const Topology topo = options.topology();
  const Topology group{g, hw.ranks_per_node};
  const Topology zero_group{zero, hw.ranks_per_node};
  const schedule::PipelineModel pm = pipeline_model(options);
  // ZeRO-3 per op: forward gathers each layer, backward gathers it again and reduce-scatters its gradient.
  const double gather = zero > 1 ? replay::ring_collective_seconds(hw, zero_group, zero, 2.0 * m.layer_params()) : 0.0;
  const double table = static_cast<double>(m.vocab) * m.hidden;
  const double head_gather = zero > 1 ? replay::ring_collective_seconds(hw, zero_group, zero, 2.0 * table) : 0.0;
  // P2P: every rank of a stage sends its tokens / d_s rows to its peer of the next stage, one call with one
  // peer (the fixed costs of HardwareProfile::fixed_comm_seconds).
  const auto p2p_seconds = [&](std::int64_t tokens, int from) {
    const double bytes = static_cast<double>(tokens) * m.hidden * vb;
    const int a = from * g, b = (from + 1) * g;
    if (topo.same_node(a, b)) {  // NVLink, or PCIe between NVLink domains (HardwareProfile::nvlink_domain)
      const replay::LinkClass& l =
          hw.same_domain(a % topo.ranks_per_node, b % topo.ranks_per_node) ? hw.intra : hw.host;
      return l.latency + hw.fixed_comm_seconds(1, 0) + bytes / g / l.bandwidth;
    }
    const int local = std::min(g, topo.ranks_per_node);
    const double nics = std::max(1.0, static_cast<double>(local) * hw.nics_per_node / topo.ranks_per_node);
    const double nodes = std::max(1.0, static_cast<double>(g) / topo.ranks_per_node);
    const double wire = bytes / (nodes * nics * hw.inter.bandwidth);
    return hw.inter.latency + hw.fixed_comm_seconds(0, 1) +
           (hw.has_host_link() ? std::max(wire, bytes / g / hw.host.bandwidth) : wire);
  };

  // Per chunk: its layer on one rank of a stage, its tokens.
  std::vector<UlyssesLayer> layer(static_cast<std::size_t>(total));
  std::vector<std::int64_t> tokens(static_cast<std::size_t>(total));
  const std::vector<PrefixSeconds> prefix = prefix_seconds(plan, options);
  for (int c = 0; c < total; ++c) {
    const auto ci = static_cast<std::size_t>(c);
    tokens[ci] = plan.chunks[ci].batch.total_tokens();
    layer[ci] = ulysses_layer(hw, m, group, chunk_own_slices(plan, c, options.mask), tokens[ci]);
    layer[ci].prefix = prefix[ci].forward;
    layer[ci].prefix_backward = prefix[ci].backward;
  }

  PipelineStepReport rep;
  rep.stages.resize(static_cast<std::size_t>(d));
  rep.memory_cap_bytes = pm.memory_cap;
  rep.pipelines = static_cast<int>(schedule.pipelines.size());
  rep.chunks = total;
  for (std::int64_t t : tokens) rep.tokens += t;
  std::vector<double> link_busy(static_cast<std::size_t>(std::max(1, d - 1)), 0.0);
  double barrier = 0;
  constexpr double kNotYet = std::numeric_limits<double>::quiet_NaN();
  for (const schedule::Pipeline& pipe : schedule.pipelines) {
    const int n = static_cast<int>(pipe.chunks.size());
    if (n == 0) continue;
    rep.layers_recomputed += pipe.checkpointing.layers_recomputed;
    schedule::CheckpointProblem prob{{}, pm, pipe.backward_order};
    for (int c : pipe.chunks) prob.tokens.push_back(tokens[static_cast<std::size_t>(c)]);
    const auto order = schedule::one_f_one_b(prob.order(), d);
    std::vector<int> ckpt(static_cast<std::size_t>(n) * d);  // layers chunk i checkpoints on stage p
    for (int i = 0; i < n; ++i)
      for (int p = 0; p < d; ++p)
        ckpt[static_cast<std::size_t>(i) * d + static_cast<std::size_t>(p)] = pipe.checkpointing.layers(prob, i, p);
    const auto at = [&](int i, int p) {
      return static_cast<std::size_t>(i) * static_cast<std::size_t>(d) + static_cast<std::size_t>(p);
    };
    std::vector<double> f_in(static_cast<std::size_t>(n) * d, kNotYet), b_in(static_cast<std::size_t>(n) * d, kNotYet);
    std::vector<double> free(static_cast<std::size_t>(d), barrier), link_f(static_cast<std::size_t>(d), barrier),
        link_b(static_cast<std::size_t>(d), barrier), in_flight(static_cast<std::size_t>(d), 0.0);
    std::vector<std::size_t> pc(static_cast<std::size_t>(d), 0);
    for (int i = 0; i < n; ++i) f_in[at(i, 0)] = barrier;
    for (std::size_t p = 0; p < rep.stages.size(); ++p)
      rep.stages[p].planned_peak_memory_bytes =
          std::max(rep.stages[p].planned_peak_memory_bytes,
                   p < pipe.checkpointing.peak_bytes.size() ? pipe.checkpointing.peak_bytes[p] : 0.0);
    for (bool progressed = true; progressed;) {
      progressed = false;
      for (int p = 0; p < d; ++p) {
        const auto up = static_cast<std::size_t>(p);
        PipelineStageReport& st = rep.stages[up];
        while (pc[up] < order[up].size()) {
          const schedule::StageOp op = order[up][pc[up]];
          const int c = pipe.chunks[static_cast<std::size_t>(op.chunk)];
          const UlyssesLayer& l = layer[static_cast<std::size_t>(c)];
          const std::int64_t t = tokens[static_cast<std::size_t>(c)];
          const double ready = op.backward ? b_in[at(op.chunk, p)] : f_in[at(op.chunk, p)];
          if (std::isnan(ready)) break;
          const bool last = p == d - 1;
          const double cf = l.forward_compute(), cb = l.backward_compute(), a2a = l.all_to_all;
          const double head_f = last ? lm_head_seconds(hw, m, static_cast<double>(t) / g, vb) : 0.0;
          double seconds = 0;
          if (!op.backward) {
            seconds = lps * (a2a + std::max(cf, gather)) + std::max(head_f, last ? head_gather : 0.0);
            st.all_to_all_s += lps * a2a;
            st.zero_s += lps * gather + (last ? head_gather : 0.0);
            st.zero_exposed_s += lps * std::max(0.0, gather - cf) + std::max(0.0, (last ? head_gather : 0.0) - head_f);
            const int k = ckpt[at(op.chunk, p)];
            in_flight[up] += pm.full_bytes(t) - pm.saved_bytes(t) * k;
            st.peak_memory_bytes = std::max(st.peak_memory_bytes, pm.static_bytes + in_flight[up]);
          } else {
            const int k = ckpt[at(op.chunk, p)];
            const double zb = 2.0 * gather;
            const double plain = a2a + std::max(cb, zb), again = 2.0 * a2a + std::max(cb + cf, zb);
            seconds = (lps - k) * plain + k * again + std::max(2.0 * head_f, last ? 2.0 * head_gather : 0.0);
            st.recompute_s += k * (again - plain);
            st.all_to_all_s += (lps + k) * a2a;
            st.zero_s += lps * zb + (last ? 2.0 * head_gather : 0.0);
            st.zero_exposed_s += (lps - k) * std::max(0.0, zb - cb) + k * std::max(0.0, zb - cb - cf) +
                                 std::max(0.0, (last ? 2.0 * head_gather : 0.0) - 2.0 * head_f);
            in_flight[up] -= pm.full_bytes(t) - pm.saved_bytes(t) * k;
          }
          const double begin = std::max(free[up], ready), end = begin + seconds;
          free[up] = end;
          st.busy_s += seconds;
          if (!op.backward && p + 1 < d) {
            const double s = std::max(end, link_f[up]), tr = p2p_seconds(t, p);
            link_f[up] = s + tr;
            link_busy[up] += tr;
            f_in[at(op.chunk, p + 1)] = s + tr;
          } else if (!op.backward) {
            b_in[at(op.chunk, p)] = end;  // the last stage turns around
          } else if (p > 0) {
            const double s = std::max(end, link_b[up - 1]), tr = p2p_seconds(t, p - 1);
            link_b[up - 1] = s + tr;
            link_busy[up - 1] += tr;
            b_in[at(op.chunk, p - 1)] = s + tr;
          }
          ++pc[up];
          progressed = true;
        }
      }
    }
    for (int p = 0; p < d; ++p)
      if (pc[static_cast<std::size_t>(p)] != order[static_cast<std::size_t>(p)].size())
        throw std::logic_error("plan::simulate_pipeline_step: the pipeline order deadlocks at stage " +
                               std::to_string(p));
    barrier = *std::max_element(free.begin(), free.end());
  }
  double optimizer = 0;
  for (int p = 0; p < d; ++p) {
    PipelineStageReport& st = rep.stages[static_cast<std::size_t>(p)];
    st.optimizer_s = 2.0 * 18.0 * pipeline_detail::stage_params(options, p) / zero / hw.hbm_bandwidth;
    optimizer = std::max(optimizer, st.optimizer_s);
    if (st.peak_memory_bytes == 0) st.peak_memory_bytes = pm.static_bytes;
  }
  rep.step_s = barrier + optimizer;
  for (PipelineStageReport& st : rep.stages) {
    st.idle_s = rep.step_s - st.busy_s - st.optimizer_s;
    rep.bubble_s += st.idle_s / d;
    rep.recompute_s += st.recompute_s / d;
    rep.all_to_all_s += st.all_to_all_s / d;
    rep.zero_exposed_s += st.zero_exposed_s / d;
    if (st.peak_memory_bytes > pm.memory_cap * (1 + 1e-12)) rep.fits_memory = false;
  }
  for (double b : link_busy) rep.p2p_s = std::max(rep.p2p_s, b);
  rep.tokens_per_s = rep.step_s > 0 ? static_cast<double>(rep.tokens) / rep.step_s : 0.0;
  return rep;
}

}  // namespace seqpar::plan
