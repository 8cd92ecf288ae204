// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "seqpar/core/error.hpp"
#include "seqpar/core/topology.hpp"
#include "seqpar/plan/model_shape.hpp"
#include "seqpar/replay/costs.hpp"
#include "seqpar/replay/predict.hpp"
#include "seqpar/replay/simulator.hpp"

namespace seqpar::plan {

struct TrainingOptions {
  ModelShape model;
  int zero_ranks = 0;         ///< ZeRO-3 over this many consecutive ranks (0 = the whole world, 1 = no sharding)
  bool checkpointing = true;  ///< full activation recompute of every layer in backward
  int micro_batches = 1;      ///< gradient accumulation: forward+backward repeats, parameter gathers too
  bool zero_prefetch = true;  ///< the next layer's parameter all-gather overlaps this layer's compute
};

/// One rank's share of a simulated training step (seconds unless named otherwise).
struct StepRank {
  double end_s = 0;
  double gemm_s = 0;          ///< projections, MLP, embedding and LM head (roofline)
  double attention_s = 0;     ///< attention kernels and the programs' local copies
  double comm_s = 0;          ///< attention transfers + ZeRO-3 collectives (busy time)
  double exposed_comm_s = 0;  ///< time blocked on either
  double bubble_s = 0;        ///< idle at the end of the step, waiting for the slowest rank
  double peak_memory_bytes = 0;
  std::int64_t tokens = 0;                         ///< tokens this rank owns (its GEMM rows)
  std::uint64_t bytes_intra = 0, bytes_inter = 0;  ///< attention bytes sent in the step
};

struct StepReport {
  double step_s = 0, tokens_per_s = 0;
  double attention_fwd_s = 0, attention_bwd_s = 0;  ///< one layer, replay time from a common start
  double attention_comm_s = 0;  ///< one layer fwd+bwd: max over ranks of the attention programs' transfer time
  /// attention_comm_s plus the programs' local copies (packing and unpacking around the exchanges, the
  /// permutes of a Ulysses all-to-all; zero fills and merges where the program has them), slowest rank:
  /// what a framework's timer around its all-to-all function sees (DeepSpeed-Ulysses permutes inside it).
  double attention_comm_copy_s = 0;
  double zero_s = 0, zero_exposed_s = 0;  ///< ZeRO-3 collectives of the step, and the part compute does not hide
  double error_bound_s = 0;               ///< step_s is exact within this (layers replayed from a nearby earlier run)
  std::vector<StepRank> ranks;
  replay::Trace trace;

  [[nodiscard]] double max_peak_memory_bytes() const noexcept {
    return replay::report_detail::max_over(ranks, [](const StepRank& r) { return r.peak_memory_bytes; });
  }
};

/// Forward GEMM seconds of one layer of `model` over `tokens` rows on one rank of `hw` (roofline: FLOPs at
/// the GEMM rate, or the weights and activations through HBM): the QKV projection, and the rest (output
/// projection and SwiGLU MLP). Backward is twice each.
struct LayerGemmSeconds {
  double qkv = 0, rest = 0;
  [[nodiscard]] double total() const noexcept { return qkv + rest; }
};

[[nodiscard]] inline LayerGemmSeconds layer_gemm_seconds(const replay::HardwareProfile& hw, const ModelShape& model,
                                                         double tokens, double value_bytes) noexcept {
  if (tokens <= 0) return {};
  const double h = model.hidden;
  const ModelShape::AttentionWidths w = model.attention_widths();
  const double qkv = w.q + w.k + w.v;
  const double qkv_flops = 2.0 * tokens * h * qkv, qkv_bytes = value_bytes * (h * qkv + tokens * (h + qkv));
  const double rest_flops = 2.0 * tokens * (w.o * h + 3.0 * h * model.ffn);
  const double rest_bytes = value_bytes * (w.o * h + 3.0 * h * model.ffn + tokens * (w.o + 3 * h + 3.0 * model.ffn));
  return {replay::gemm_seconds(hw, qkv_flops, qkv_bytes), replay::gemm_seconds(hw, rest_flops, rest_bytes)};
}

/// Forward seconds of the LM head (hidden x vocab GEMM) over `tokens` rows on one rank; backward is twice.
[[nodiscard]] inline double lm_head_seconds(const replay::HardwareProfile& hw, const ModelShape& model, double tokens,
                                            double value_bytes) noexcept {
  if (tokens <= 0) return 0.0;
  const double h = model.hidden, v = model.vocab;
  return replay::gemm_seconds(hw, 2.0 * tokens * h * v, value_bytes * (v * h + tokens * v));
}

namespace step_detail {

/// A replay::Replay that remembers its last few runs: layers repeat the same program from start times that differ
/// only by a common shift once the ranks have settled (or alternate between a few such patterns, when
/// ZeRO-3 gathers re-align the ranks on some layers), so most layers cost a comparison, not a replay.
/// A replay is shift-invariant, and its end times move by at most max |change of a start time| (a max-plus
/// system: 1-Lipschitz in the starts), so reusing a run whose offsets agree within kTolerance errs by at
/// most kTolerance per layer (0.1 us: < 10 us over a 64-layer step). Where offsets keep drifting (a plain
/// ring whose skew travels around), replays stop after kMaxReplays and the nearest run is reused; the
/// gaps are summed into error_bound_s, which the step report carries: the answer is within it.
class ShiftCachedReplay {
 public:
  ShiftCachedReplay(std::span<const comm::Program> programs, const Topology& topo, const AttentionShape& shape,
                    const replay::SimulationOptions& options)
      : replay_(programs, topo, shape, options) {}

  /// The replay from `start`, as a report relative to `shift` (its earliest start). After kMaxReplays
  /// distinct replays, the closest remembered one is reused and its distance added to error_bound_s.
  const replay::SimulationReport& run(std::span<const double> start, double& shift) {
    const double origin = *std::min_element(start.begin(), start.end());
    shift = origin;
    Entry* closest = nullptr;
    double closest_gap = std::numeric_limits<double>::infinity();
    for (Entry& e : entries_) {
      double gap = 0;
      for (std::size_t i = 0; i < start.size() && gap < closest_gap; ++i)
        gap = std::max(gap, std::abs((start[i] - origin) - e.offsets[i]));
      if (gap < closest_gap) closest_gap = gap, closest = &e;
    }
    if (closest != nullptr && (closest_gap <= kTolerance || replays_ >= kMaxReplays)) {
      if (closest_gap > kTolerance) error_bound_s += closest_gap;
      return closest->report;
    }
    Entry e;
    e.offsets.resize(start.size());
    for (std::size_t i = 0; i < start.size(); ++i) e.offsets[i] = start[i] - origin;
    e.report = replay_.run(e.offsets);
    ++replays_;
    if (entries_.size() == kEntries) entries_.erase(entries_.begin());
    entries_.push_back(std::move(e));
    return entries_.back().report;
  }

  [[nodiscard]] const replay::Replay& replay() const noexcept { return replay_; }
  double error_bound_s = 0;  ///< sum of the offset gaps of approximate reuses

 private:
  struct Entry {
    std::vector<double> offsets;
    replay::SimulationReport report;
  };
  static constexpr std::size_t kEntries = 8;
  static constexpr double kTolerance = 1e-7;
  static constexpr int kMaxReplays = 16;
  replay::Replay replay_;
  int replays_ = 0;
  std::vector<Entry> entries_;
};

}  // namespace step_detail

/// One training step of `options.model` (micro_batches x (forward + backward) over all layers, then the
/// optimizer) with every attention layer running `attention`, the programs of compile_all() compiled for
/// `options.model.attention()`.
/// Per rank and layer: QKV projection, the attention program (replayed: transfers overlap compute as the
/// program allows), output projection and SwiGLU MLP on the rank's own tokens (roofline GEMMs); backward
/// = recompute of the forward (with checkpointing) + 2x the GEMMs + the attention backward program.
/// ZeRO-3 (ZeRO, arXiv 1910.02054; 3 x params of traffic per step): a parameter all-gather per layer in
/// forward and again in backward, a gradient reduce-scatter per layer in backward, ring collectives on a
/// separate stream; with zero_prefetch the gather of the next layer runs during this layer's compute.
/// Not modelled: contention between ZeRO traffic and attention traffic on the same links, pipeline
/// parallelism, tensor parallelism, fp32 loss-scaling work.
/// Memory per rank: ZeRO-sharded states (16 bytes per parameter: bf16 weight and gradient, fp32 master,
/// Adam m and v), two gathered layers, activations (layer inputs only with checkpointing, plus one layer's
/// working set), the attention program's staging buffers, fp32 logits of the rank's tokens.
[[nodiscard]] inline StepReport simulate_step(const replay::CompiledStrategy& attention, const Topology& topology,
                                              const TrainingOptions& options, const replay::SimulationOptions& sim) {
  constexpr const char* where = "plan::simulate_step";
  topology.validate(where);
  options.model.validate(where);
  sim.hardware.validate(where);
  detail::require(static_cast<bool>(attention.status), where, "attention.status", attention.status.reason,
                  "the strategy refused the batch");
  detail::require(static_cast<int>(attention.forward.size()) == topology.world_size, where, "attention.forward.size()",
                  attention.forward.size(), "must equal topology.world_size = " + std::to_string(topology.world_size));
  detail::require(options.micro_batches >= 1, where, "options.micro_batches", options.micro_batches, "must be >= 1");
  detail::require(options.zero_ranks >= 0 && options.zero_ranks <= topology.world_size, where, "options.zero_ranks",
                  options.zero_ranks, "must be in [0, world_size]");
  const int n = topology.world_size;
  const ModelShape& m = options.model;
  const AttentionShape shape = m.attention();
  for (const comm::Program& p : attention.forward) {
    detail::require(p.head_dim == m.head_dim, where, "attention (head_dim of the programs)", p.head_dim,
                    "must equal the model's head_dim = " + std::to_string(m.head_dim));
    detail::require(p.widths().v == shape.v_dim(), where, "attention (head_dim_v of the programs)", p.widths().v,
                    "must equal the model's value head size = " + std::to_string(shape.v_dim()));
  }
  const replay::HardwareProfile& hw = sim.hardware;
  const double vb = sim.value_bytes > 0 ? sim.value_bytes : hw.value_bytes;
  const int zero = options.zero_ranks == 0 ? n : options.zero_ranks;
  const auto un = static_cast<std::size_t>(n);

  step_detail::ShiftCachedReplay fwd(attention.forward, topology, shape, sim),
      bwd(attention.backward, topology, shape, sim);

  // Per-rank GEMM times of one layer (forward), split around attention.
  const double h = m.hidden;
  std::vector<double> pre(un), post(un), head_fwd(un);
  StepReport rep;
  rep.ranks.resize(un);
  rep.trace.topology = topology;
  for (int r = 0; r < n; ++r) {
    const auto tok = static_cast<double>(attention.plan.local_tokens(r));
    rep.ranks[static_cast<std::size_t>(r)].tokens = attention.plan.local_tokens(r);
    const LayerGemmSeconds gemm = layer_gemm_seconds(hw, m, tok, vb);
    pre[static_cast<std::size_t>(r)] = gemm.qkv;
    post[static_cast<std::size_t>(r)] = gemm.rest;
    head_fwd[static_cast<std::size_t>(r)] = lm_head_seconds(hw, m, tok, vb);
  }
  // ZeRO-3 collectives of one layer over `zero` ranks (groups of consecutive ranks).
  const double layer_bytes = 2.0 * m.layer_params();  // bf16 parameters and gradients
  const double gather_s = zero > 1 ? replay::ring_collective_seconds(hw, topology, zero, layer_bytes) : 0.0;
  const double embed_gather_s =
      zero > 1 ? replay::ring_collective_seconds(hw, topology, zero, 2.0 * m.embedding_params()) : 0.0;

  std::vector<double> t(un, 0.0), zstream(un, 0.0);
  const auto group_max = [&](std::vector<double>& v) {  // collectives start when their last member is there
    for (int g = 0; g < n; g += zero) {
      const auto b = static_cast<std::ptrdiff_t>(g), e = static_cast<std::ptrdiff_t>(std::min(n, g + zero));
      const double mx = *std::max_element(v.begin() + b, v.begin() + e);
      std::fill(v.begin() + b, v.begin() + e, mx);
    }
  };
  // Issues a collective of `seconds` on the ZeRO stream no earlier than `issue`; returns its end per rank.
  const auto zero_collective = [&](const std::vector<double>& issue, double seconds, const char* label) {
    std::vector<double> start(un);
    for (std::size_t r = 0; r < un; ++r) start[r] = std::max(zstream[r], issue[r]);
    group_max(start);
    for (std::size_t r = 0; r < un; ++r) {
      zstream[r] = start[r] + seconds;
      rep.ranks[r].comm_s += seconds;
      if (sim.trace && static_cast<int>(r) < sim.trace_max_ranks && seconds > 0)
        rep.trace.events.push_back({static_cast<int>(r), 1, label, start[r], seconds, 0});
    }
    rep.zero_s += seconds;
    return zstream;
  };
  const auto compute = [&](std::vector<double>& now, const std::vector<double>& secs, double scale, const char* label,
                           double StepRank::*field) {
    for (std::size_t r = 0; r < un; ++r) {
      const double s = secs[r] * scale;
      if (sim.trace && static_cast<int>(r) < sim.trace_max_ranks && s > 0)
        rep.trace.events.push_back({static_cast<int>(r), 0, label, now[r], s, 0});
      now[r] += s;
      rep.ranks[r].*field += s;
    }
  };
  std::vector<double> zero_wait(un, 0.0);
  const auto wait_for = [&](std::vector<double>& now, const std::vector<double>& ready) {
    for (std::size_t r = 0; r < un; ++r)
      if (ready[r] > now[r]) {
        rep.ranks[r].exposed_comm_s += ready[r] - now[r];
        zero_wait[r] += ready[r] - now[r];
        if (sim.trace && static_cast<int>(r) < sim.trace_max_ranks)
          rep.trace.events.push_back({static_cast<int>(r), 0, "wait zero-3", now[r], ready[r] - now[r], 0});
        now[r] = ready[r];
      }
  };
  const auto attend = [&](step_detail::ShiftCachedReplay& replay, std::vector<double>& now, bool first_layer) -> void {
    double shift = 0;
    const replay::SimulationReport& a = replay.run(now, shift);
    for (std::size_t r = 0; r < un; ++r) {
      StepRank& sr = rep.ranks[r];
      const replay::RankTiming& rt = a.ranks[r];
      sr.attention_s += rt.compute_s + rt.copy_s;
      sr.comm_s += rt.comm_s;
      sr.exposed_comm_s += rt.exposed_comm_s;
      sr.bytes_intra += rt.bytes_intra;
      sr.bytes_inter += rt.bytes_inter;
      now[r] = rt.end_s + shift;
    }
    if (first_layer && sim.trace) rep.trace.append(a.trace, shift);
  };

  for (int mb = 0; mb < options.micro_batches; ++mb) {
    // Forward: embedding gather, then layer by layer (gather of layer l+1 prefetched during layer l).
    std::vector<double> ready = zero_collective(t, embed_gather_s, "all_gather embedding");
    std::vector<double> next = zero_collective(options.zero_prefetch ? t : ready, gather_s, "all_gather layer");
    wait_for(t, ready);
    for (int l = 0; l < m.layers; ++l) {
      wait_for(t, next);
      if (l + 1 < m.layers) next = zero_collective(options.zero_prefetch ? t : next, gather_s, "all_gather layer");
      compute(t, pre, 1.0, "qkv projection", &StepRank::gemm_s);
      attend(fwd, t, l == 0 && mb == 0);
      compute(t, post, 1.0, "o projection + mlp", &StepRank::gemm_s);
      if (!options.zero_prefetch && l + 1 < m.layers) next = zero_collective(t, gather_s, "all_gather layer");
    }
    compute(t, head_fwd, 3.0, "lm head fwd+bwd", &StepRank::gemm_s);
    // Backward, last layer first: gather the layer again, recompute its forward, run its backward, then
    // reduce-scatter its gradients (asynchronously).
    next = zero_collective(t, gather_s, "all_gather layer");
    for (int l = m.layers - 1; l >= 0; --l) {
      wait_for(t, next);
      if (l > 0) next = zero_collective(options.zero_prefetch ? t : next, gather_s, "all_gather layer");
      if (options.checkpointing) {
        compute(t, pre, 1.0, "recompute qkv", &StepRank::gemm_s);
        attend(fwd, t, false);
        compute(t, post, 1.0, "recompute o + mlp", &StepRank::gemm_s);
      }
      compute(t, post, 2.0, "mlp + o projection bwd", &StepRank::gemm_s);
      attend(bwd, t, l == m.layers - 1 && mb == 0);
      compute(t, pre, 2.0, "qkv projection bwd", &StepRank::gemm_s);
      if (zero > 1) zero_collective(t, gather_s, "reduce_scatter grads");
    }
  }
  if (zero > 1) wait_for(t, zero_collective(t, embed_gather_s, "reduce_scatter embedding grads"));
  wait_for(t, zstream);
  // Optimizer: Adam over this rank's 1/zero of the parameters, memory bound (read/write 16 B + grads).
  std::vector<double> opt(un, 2.0 * 18.0 * m.params() / zero / hw.hbm_bandwidth);
  compute(t, opt, 1.0, "optimizer", &StepRank::gemm_s);

  // One layer's attention from a common start (its time inside the step also holds the ranks' skew), and
  // its transfer time, slowest rank: what BASP calls the all-to-all time.
  {
    const replay::SimulationReport f = fwd.replay().run({}, false);
    const replay::SimulationReport b = bwd.replay().run({}, false);
    rep.attention_fwd_s = f.time_s;
    rep.attention_bwd_s = b.time_s;
    for (std::size_t r = 0; r < un; ++r) {
      rep.attention_comm_s = std::max(rep.attention_comm_s, f.ranks[r].comm_s + b.ranks[r].comm_s);
      rep.attention_comm_copy_s = std::max(
          rep.attention_comm_copy_s, f.ranks[r].comm_s + b.ranks[r].comm_s + f.ranks[r].copy_s + b.ranks[r].copy_s);
    }
  }

  rep.error_bound_s = fwd.error_bound_s + bwd.error_bound_s;
  const double step = *std::max_element(t.begin(), t.end());
  rep.step_s = step;
  rep.zero_exposed_s = *std::max_element(zero_wait.begin(), zero_wait.end());
  std::int64_t total_tokens = 0;
  for (int r = 0; r < n; ++r) total_tokens += attention.plan.local_tokens(r);
  rep.tokens_per_s = step > 0 ? static_cast<double>(total_tokens) * options.micro_batches / step : 0.0;

  // Memory.
  const double states = 16.0 * m.params() / zero;
  const double gathered = zero > 1 ? 2.0 * layer_bytes + 2.0 * m.embedding_params() : 0.0;
  const double act_per_token_layer = m.layer_activation_bytes_per_token(vb);
  for (int r = 0; r < n; ++r) {
    StepRank& sr = rep.ranks[static_cast<std::size_t>(r)];
    sr.end_s = t[static_cast<std::size_t>(r)];
    sr.bubble_s = step - sr.end_s;
    const auto tok = static_cast<double>(sr.tokens);
    const double acts = options.checkpointing ? m.layers * tok * h * vb + tok * act_per_token_layer
                                              : m.layers * tok * act_per_token_layer;
    double staging = 0;
    for (const auto* progs : {&attention.forward, &attention.backward}) {
      const comm::Program& p = (*progs)[static_cast<std::size_t>(r)];
      double s = 0;
      for (const comm::BufferSpec& b : p.staging)
        s += static_cast<double>(b.rows) * b.heads * (comm::is_lse(b.id) ? 4.0 : vb * p.widths().of(b.id));
      staging = std::max(staging, s);
    }
    const double logits = tok * m.vocab * 4.0;
    sr.peak_memory_bytes = states + gathered + acts + std::max(staging, logits);
  }
  return rep;
}

}  // namespace seqpar::plan
