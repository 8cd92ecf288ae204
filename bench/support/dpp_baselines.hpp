// SPDX-License-Identifier: Apache-2.0
// The baselines of DPP's paper (InfiniPipe / Concertina, research/seeds.md section 4) as closed-form step
// models on seqpar's cost model, for bench/replay: FlexSP-like heterogeneous Ulysses groups, DeepSpeed-like
// static Ulysses, both with ZeRO-3 over the whole cluster, and Megatron-like TP x CP. Each prices its
// layers with the same pieces as plan::simulate_pipeline_step (plan::ulysses_layer, replay/costs.hpp) so
// that the comparisons differ in the parallel layout, not in the kernels' model. What the paper leaves out
// is marked [I] where it is assumed.
#pragma once

#include <seqpar/plan/model_shape.hpp>
#include <seqpar/plan/pipeline_step.hpp>
#include <seqpar/plan/stage_memory.hpp>
#include <seqpar/plan/step.hpp>
#include <seqpar/replay/costs.hpp>
#include <seqpar/replay/hardware.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

namespace seqpar::bench::dpp {

/// One baseline's predicted step.
struct BaselineStep {
  bool feasible = true;
  std::string reason;  ///< when not feasible
  double step_s = 0;
  double compute_s = 0;       ///< GEMMs + attention kernels (the slowest group's, summed over micro-batches)
  double all_to_all_s = 0;    ///< Ulysses exchanges (or TP collectives and exposed CP ring traffic)
  double zero_exposed_s = 0;  ///< ZeRO-3 (or DP) traffic compute did not hide
  double imbalance = 1;       ///< slowest group's busy time / mean group busy time (time-weighted)
  int micro_batches = 0;
  std::string layout;  ///< e.g. the group sizes used
};

inline BaselineStep infeasible(std::string reason) {
  BaselineStep b;
  b.feasible = false;
  b.reason = std::move(reason);
  return b;
}

/// The causal attention of whole documents (one call).
inline std::vector<AttnSlice> causal_slices(const std::vector<std::int64_t>& lengths) {
  std::vector<AttnSlice> out;
  out.reserve(lengths.size());
  for (std::int64_t l : lengths) out.push_back({{0, l}, {0, l}, Mask::causal()});
  return out;
}

/// Ulysses with ZeRO-3 over the whole cluster of `world` ranks.
///  - FlexSP-like (FlexSP, arXiv 2412.01523): every micro-batch splits the cluster into Ulysses groups of
///    power-of-two sizes (the sizes sum to the cluster; a group of up to a node's ranks stays inside it),
///    each running whole sequences; sequences go to groups longest first, each to the group that finishes
///    it earliest among those with memory for it (LPT), over every partition of the cluster into such
///    groups, and the partition whose slowest group is fastest is kept. FlexSP solves this as a MILP; the
///    search here is exhaustive over partitions and greedy inside one [I].
///  - DeepSpeed-like: `fixed_groups` (e.g. {16, 16} or {32}), sequences packed by LPT over the groups.
/// Micro-batches: as few as memory allows (activation tokens per rank under the checkpointing setting),
/// sequences dealt to them longest first onto the lightest. ZeRO-3: per micro-batch, each layer's
/// parameters gathered in forward, gathered and their gradients reduce-scattered in backward, over all
/// ranks (inter-node ring); the collectives hide under compute, not under an all-to-all that crosses nodes
/// (the same NICs); every layer waits for its collective, so the slowest group sets each layer's pace.
struct UlyssesZero3 {
  plan::ModelShape model;
  replay::HardwareProfile hw;
  int world = 32;
  int checkpoint_layers = 0;  ///< layers recomputed in backward (the paper's tuned setting)
  double memory_reserve = 0.1;
  std::vector<int> fixed_groups;  ///< DeepSpeed-like when not empty
  /// false: no ZeRO-3 collective overlaps a layer's compute or all-to-all (each layer waits for its
  /// gather, its backward for the gradient's reduce-scatter too). DPP's paper measures FlexSP's ZeRO and
  /// all-to-all time at up to 3.2x DPP's 17% of a step (its 13B case study [R]), which the overlapped
  /// model (true) cannot produce on this profile; the two bracket FlexSP between a perfect prefetch and
  /// none.
  bool zero_overlap = true;

  [[nodiscard]] double token_bytes_per_rank() const {  // activation bytes of one token held by one rank
    const double vb = hw.value_bytes;
    return (model.layers - checkpoint_layers) * model.layer_activation_bytes_per_token(vb) +
           checkpoint_layers * model.hidden * vb;
  }
  /// One rank holding `rows` activation rows (its share of its group's sequences in a micro-batch),
  /// term by term: ZeRO-3 states over the world, the two gathered layers, the activations, and the
  /// transients of its largest sequence share `peak_rows` (one layer's backward working set, the
  /// all-to-all buffers, the logits and loss).
  [[nodiscard]] plan::MemoryBreakdown memory(double rows, double peak_rows) const {
    const double vb = hw.value_bytes;
    const plan::ModelShape::AttentionWidths w = model.attention_widths();
    plan::MemoryBreakdown m;
    plan::add_model_states(m, model.params(), plan::ZeroStage::kParameters, world);
    m.add("ZeRO-3 gathered layers (running + prefetched)", 2.0 * 2.0 * model.layer_params());
    m.add("activations (" + std::to_string(model.layers - checkpoint_layers) + " layers kept, " +
              std::to_string(checkpoint_layers) + " checkpointed)",
          rows * token_bytes_per_rank());
    m.add("one layer's backward working set", peak_rows * model.layer_activation_bytes_per_token(vb));
    m.add("all-to-all buffers (send + receive)", 2.0 * peak_rows * (w.q + w.k + w.v) * vb);
    m.add("logits and loss", peak_rows * (model.vocab * vb + 8.0));
    return m;
  }
  /// Tokens one rank can hold (its share of its group's sequences), the transients priced as if they
  /// were one sequence's (the most they can be).
  [[nodiscard]] double rank_capacity() const {
    const double states = memory(0.0, 0.0).total();
    const double per_row = memory(1.0, 1.0).total() - states;
    return (hw.memory_bytes * (1.0 - memory_reserve) - states) / per_row;
  }

  static void partitions(int left, int largest, std::vector<int>& cur, std::vector<std::vector<int>>& out) {
    if (left == 0) {
      out.push_back(cur);
      return;
    }
    for (int g = std::min(largest, left); g >= 1; g /= 2) {
      cur.push_back(g);
      partitions(left - g, g, cur, out);
      cur.pop_back();
    }
  }

  struct Group {
    int size = 1;
    double tokens = 0, load = 0;
    std::vector<std::int64_t> lengths;
  };

  [[nodiscard]] BaselineStep step(const std::vector<std::int64_t>& sequences) const {
    BaselineStep out;
    const int rpn = hw.ranks_per_node;
    std::vector<std::vector<int>> configs;
    if (!fixed_groups.empty()) {
      configs.push_back(fixed_groups);
    } else {
      int largest = 1;
      while (largest * 2 <= world) largest *= 2;
      std::vector<int> cur;
      partitions(world, largest, cur, configs);
    }
    const double cap = rank_capacity();
    if (cap <= 0) return infeasible("model states alone exceed the memory");
    std::vector<std::int64_t> seqs = sequences;
    std::sort(seqs.begin(), seqs.end(), std::greater<>());
    int max_group = 0;
    for (const auto& c : configs)
      for (int g : c) max_group = std::max(max_group, g);
    if (static_cast<double>(seqs.front()) > cap * max_group)
      return infeasible("the longest sequence does not fit the largest group");
    // Per (length, group size): one layer's forward + backward (+ recompute share) seconds, the LPT key.
    std::vector<int> sizes;
    for (int g = 1; g <= world; g *= 2) sizes.push_back(g);
    const auto layer_of = [&](const std::vector<std::int64_t>& lengths, int g) {
      const auto slices = causal_slices(lengths);
      std::int64_t t = 0;
      for (std::int64_t l : lengths) t += l;
      return plan::ulysses_layer(hw, model, Topology{g, rpn}, slices, t);
    };
    const double ck = static_cast<double>(checkpoint_layers) / model.layers;
    const auto key = [&](const plan::UlyssesLayer& l) {
      return (1 + ck) * (l.forward_compute() + l.all_to_all) + l.backward_compute() + l.all_to_all;
    };
    std::vector<std::vector<double>> cost(seqs.size(), std::vector<double>(sizes.size()));
    for (std::size_t i = 0; i < seqs.size(); ++i)
      for (std::size_t k = 0; k < sizes.size(); ++k) {
        if (i > 0 && seqs[i] == seqs[i - 1]) {
          cost[i][k] = cost[i - 1][k];
          continue;
        }
        cost[i][k] = key(layer_of({seqs[i]}, sizes[k]));
      }
    const auto size_index = [&](int g) { return static_cast<std::size_t>(std::countr_zero(static_cast<unsigned>(g))); };

    const Topology cluster{world, rpn};
    const double gather = replay::ring_collective_seconds(hw, cluster, world, 2.0 * model.layer_params());
    const double head_gather =
        replay::ring_collective_seconds(hw, cluster, world, 2.0 * static_cast<double>(model.vocab) * model.hidden);
    const double total_tokens = std::accumulate(seqs.begin(), seqs.end(), 0.0);
    for (int micro = std::max(1, static_cast<int>(std::ceil(total_tokens / (cap * world)))); micro <= 4096; ++micro) {
      // Deal the sequences, longest first, each to the micro-batch with the fewest tokens.
      std::vector<std::vector<std::size_t>> batches(static_cast<std::size_t>(micro));
      std::vector<double> btok(static_cast<std::size_t>(micro), 0.0);
      for (std::size_t i = 0; i < seqs.size(); ++i) {
        const auto b = static_cast<std::size_t>(std::min_element(btok.begin(), btok.end()) - btok.begin());
        batches[b].push_back(i);
        btok[b] += static_cast<double>(seqs[i]);
      }
      BaselineStep acc;
      acc.micro_batches = micro;
      bool ok = true;
      double busy_sum = 0;  // mean busy time of a rank (idle ranks count as 0), summed over micro-batches
      for (const auto& batch : batches) {
        // Best partition: LPT inside each, keep the smallest makespan.
        double best = std::numeric_limits<double>::infinity();
        std::vector<Group> best_groups;
        for (const auto& config : configs) {
          std::vector<Group> groups;
          for (int g : config) groups.push_back({g, 0, 0, {}});
          bool fits = true;
          for (std::size_t i : batch) {
            Group* pick = nullptr;
            double pick_end = 0;
            for (Group& gr : groups) {
              if (gr.tokens + static_cast<double>(seqs[i]) > cap * gr.size) continue;
              const double end = gr.load + cost[i][size_index(gr.size)];
              if (pick == nullptr || end < pick_end) pick = &gr, pick_end = end;
            }
            if (pick == nullptr) {
              fits = false;
              break;
            }
            pick->tokens += static_cast<double>(seqs[i]);
            pick->load = pick_end;
            pick->lengths.push_back(seqs[i]);
          }
          if (!fits) continue;
          double makespan = 0;
          for (const Group& gr : groups) makespan = std::max(makespan, gr.load);
          if (makespan < best) best = makespan, best_groups = std::move(groups);
        }
        if (best_groups.empty()) {
          ok = false;
          break;
        }
        // This micro-batch, exactly: per layer the slowest group, ZeRO collectives hidden as above.
        double fwd = 0, bwd = 0, bwd_ck = 0, head = 0, compute = 0, a2a = 0, zexp_f = 0, zexp_b = 0, zexp_ck = 0;
        for (const Group& gr : best_groups) {
          if (gr.lengths.empty()) continue;
          const plan::UlyssesLayer l = layer_of(gr.lengths, gr.size);
          const bool spans = gr.size > rpn;
          const double cf = l.forward_compute(), cb = l.backward_compute(), x = l.all_to_all;
          const auto layer_time = [&](double c, double a, double z) {
            if (!zero_overlap) return c + a + z;
            return spans ? a + std::max(c, z) : std::max(c + a, z);
          };
          const double f = layer_time(cf, x, gather), b = layer_time(cb, x, 2 * gather),
                       bc = layer_time(cb + cf, 2 * x, 2 * gather);
          if (f > fwd) fwd = f, zexp_f = f - cf - x;
          if (b > bwd) bwd = b, zexp_b = b - cb - x;
          if (bc > bwd_ck) bwd_ck = bc, zexp_ck = bc - cb - cf - 2 * x;
          double t = 0;
          for (std::int64_t len : gr.lengths) t += static_cast<double>(len);
          const double hf = plan::lm_head_seconds(hw, model, t / gr.size, hw.value_bytes);
          head = std::max(head, std::max(3.0 * hf, 3.0 * head_gather));
          const double busy = model.layers * (cf + cb) + checkpoint_layers * cf;
          if (busy > compute) compute = busy, a2a = (model.layers + checkpoint_layers) * 2 * x;
          busy_sum += busy * gr.size / world;
        }
        const int plain = model.layers - checkpoint_layers;
        acc.step_s += model.layers * fwd + plain * bwd + checkpoint_layers * bwd_ck + head;
        acc.compute_s += compute;
        acc.all_to_all_s += a2a;
        acc.zero_exposed_s += model.layers * std::max(0.0, zexp_f) + plain * std::max(0.0, zexp_b) +
                              checkpoint_layers * std::max(0.0, zexp_ck);
        std::vector<int> used;
        for (const Group& gr : best_groups)
          if (!gr.lengths.empty()) used.push_back(gr.size);
        if (acc.layout.empty()) {
          acc.layout = "groups";
          for (int g : used) acc.layout += " " + std::to_string(g);
        }
      }
      if (!ok) continue;  // a micro-batch had no partition with memory for it: one more micro-batch
      acc.step_s += 2.0 * 18.0 * model.params() / world / hw.hbm_bandwidth;  // optimizer on the ZeRO shard
      acc.imbalance = busy_sum > 0 ? acc.compute_s / busy_sum : 1.0;
      acc.layout += " (first micro-batch)";
      return acc;
    }
    return infeasible("no micro-batching fits");
  }
};

/// Megatron-like: TP `tp` inside a node (Megatron sequence parallelism: all-gather and reduce-scatter
/// around attention and MLP, 4 collectives per layer each way, not overlapped), CP `cp` across nodes
/// (ring attention over document-masked packed sequences, Transformer Engine's THD layout: every
/// document cut into 2 cp zigzag pieces, each step's KV transfer overlapped with that step's attention),
/// DP the rest with ZeRO-1 (gradient reduce-scatter in fp32 and parameter all-gather once per step).
/// Sequences are packed first-fit-decreasing into micro-batches of the context length, dealt to the DP
/// ranks by LPT. Heads per TP rank: ceil(Hq / tp) (Megatron needs Hq % tp == 0; LLaMA-30B's 52 heads do
/// not split 8 ways, so the busiest rank is priced [I]).
struct MegatronCp {
  plan::ModelShape model;
  replay::HardwareProfile hw;
  int world = 32, tp = 8, cp = 4;
  int checkpoint_layers = 0;
  std::int64_t context = 49152;

  double memory_reserve = 0.1;  ///< as plan::PipelineStepOptions::memory_reserve

  /// One rank's memory with a full micro-batch (`context` tokens over cp ranks) and `k` layers
  /// checkpointed, term by term. Korthikanti et al. 2022 (section 4.2.2): with tensor and sequence
  /// parallelism every activation is split t ways; CP splits the rows cp ways. States: bf16 weights
  /// (layers / tp, the vocabulary-parallel embedding and head / tp), fp32 gradients (Megatron-LM
  /// accumulates them in fp32 under bf16), Adam sharded over DP (its distributed optimizer: ZeRO-1).
  /// Transients: one layer's backward working set, TP's all-gathered input of a GEMM, CP's KV ring
  /// buffers (send and receive), the vocabulary-parallel logits (bf16) with the fp32 cross-entropy.
  [[nodiscard]] plan::MemoryBreakdown memory(int k) const {
    const double vb = hw.value_bytes, rows = static_cast<double>(context) / cp;
    const plan::ModelShape::AttentionWidths w = model.attention_widths();
    plan::MemoryBreakdown m;
    plan::add_model_states(m, model.params() / tp, plan::ZeroStage::kOptimizer, std::max(1, world / (tp * cp)), 4.0);
    m.add("activations (" + std::to_string(model.layers - k) + " layers kept, " + std::to_string(k) + " checkpointed)",
          rows / tp * ((model.layers - k) * model.layer_activation_bytes_per_token(vb) + k * model.hidden * vb));
    m.add("one layer's backward working set", rows / tp * model.layer_activation_bytes_per_token(vb));
    m.add("TP all-gathered GEMM input", rows * model.hidden * vb);
    m.add("CP ring KV buffers (send + receive)", cp > 1 ? 2.0 * rows * (w.k + w.v) / tp * vb : 0.0);
    m.add("logits and loss (vocabulary-parallel, fp32 cross-entropy)", rows * model.vocab / tp * (vb + 4.0));
    return m;
  }
  [[nodiscard]] double memory_cap() const { return hw.memory_bytes * (1.0 - memory_reserve); }
  /// The fewest checkpointed layers whose memory fits the cap (-1 when none does).
  [[nodiscard]] int checkpoint_layers_needed() const {
    for (int k = 0; k <= model.layers; ++k)
      if (memory(k).total() <= memory_cap()) return k;
    return -1;
  }

  [[nodiscard]] BaselineStep step(const std::vector<std::int64_t>& sequences) const {
    BaselineStep out;
    const int dp = world / (tp * cp);
    if (dp < 1 || world % (tp * cp) != 0) return infeasible("tp x cp must divide the world");
    const double vb = hw.value_bytes;
    // Pack into bins of `context` tokens.
    std::vector<std::int64_t> seqs = sequences;
    std::sort(seqs.begin(), seqs.end(), std::greater<>());
    std::vector<std::vector<std::int64_t>> bins;
    std::vector<std::int64_t> room;
    for (std::int64_t s : seqs) {
      std::size_t b = 0;
      while (b < bins.size() && room[b] < s) ++b;
      if (b == bins.size()) bins.emplace_back(), room.push_back(context);
      bins[b].push_back(s);
      room[b] -= s;
    }
    const int heads = (model.heads_q + tp - 1) / tp;
    const plan::ModelShape::AttentionWidths w = model.attention_widths();
    const int dv = model.attention().v_dim();
    const Topology node{tp, hw.ranks_per_node};
    const auto bin_seconds = [&](const std::vector<std::int64_t>& docs, BaselineStep& acc) {
      std::int64_t s = 0;
      for (std::int64_t l : docs) s += l;
      const double rank_tokens = static_cast<double>(s) / cp;
      const double gemm = plan::layer_gemm_seconds(hw, model, rank_tokens / tp, vb).total();
      const double tp_comm = 4.0 * replay::ring_collective_seconds(hw, node, tp, rank_tokens * model.hidden * vb);
      // Zigzag: rank r holds pieces r and 2cp-1-r of every document; its slowest rank's attention.
      double attn_f = 0, attn_b = 0;
      for (int r = 0; r < cp; ++r) {
        std::vector<AttnSlice> sl;
        for (std::int64_t l : docs)
          for (const int piece : {r, 2 * cp - 1 - r}) {
            const std::int64_t b = l * piece / (2 * cp), e = l * (piece + 1) / (2 * cp);
            if (e > b) sl.push_back({{b, e}, {0, e}, Mask::causal(b)});
          }
        attn_f = std::max(attn_f, replay::attention_seconds(hw, sl, heads, model.head_dim, false, dv));
        attn_b = std::max(attn_b, replay::attention_seconds(hw, sl, heads, model.head_dim, true, dv));
      }
      // Ring: cp steps of 1/cp of the attention each; cp - 1 KV transfers (the node's tp ranks share its
      // NICs), twice the bytes backward (KV forward, dK/dV back).
      const double kv_bytes = rank_tokens * (w.k + w.v) / tp * vb;
      const double step_comm =
          cp > 1 ? hw.inter.latency + kv_bytes * tp / (hw.nics_per_node * hw.inter.bandwidth) : 0.0;
      const double ring_f = attn_f / cp + (cp - 1) * std::max(attn_f / cp, step_comm);
      const double ring_b = attn_b / cp + (cp - 1) * std::max(attn_b / cp, 2.0 * step_comm);
      const double fwd = gemm + tp_comm + ring_f, bwd = 2 * gemm + tp_comm + ring_b;
      const double head = 3.0 * plan::lm_head_seconds(hw, model, rank_tokens / tp, vb);
      acc.compute_s += model.layers * (3 * gemm + attn_f + attn_b) + checkpoint_layers * (gemm + attn_f);
      acc.all_to_all_s += (model.layers + checkpoint_layers) * tp_comm + model.layers * tp_comm +
                          model.layers * (ring_f - attn_f + ring_b - attn_b) + checkpoint_layers * (ring_f - attn_f);
      return model.layers * (fwd + bwd) + checkpoint_layers * fwd + head;
    };
    std::vector<double> rank_time(static_cast<std::size_t>(dp), 0.0);
    std::vector<BaselineStep> rank_acc(static_cast<std::size_t>(dp));
    std::vector<double> bin_time(bins.size());
    for (std::size_t b = 0; b < bins.size(); ++b) {
      BaselineStep tmp;
      bin_time[b] = bin_seconds(bins[b], tmp);
    }
    std::vector<std::size_t> order(bins.size());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return bin_time[a] > bin_time[b]; });
    for (std::size_t b : order) {
      const auto r = static_cast<std::size_t>(std::min_element(rank_time.begin(), rank_time.end()) - rank_time.begin());
      rank_time[r] += bin_seconds(bins[b], rank_acc[r]);
      ++rank_acc[r].micro_batches;
    }
    const auto slowest =
        static_cast<std::size_t>(std::max_element(rank_time.begin(), rank_time.end()) - rank_time.begin());
    out = rank_acc[slowest];
    out.step_s = rank_time[slowest];
    // ZeRO-1 over DP: reduce-scatter fp32 gradients, all-gather bf16 parameters; DP peers sit on other
    // nodes, the node's tp ranks share its NICs.
    if (dp > 1) {
      const double shard = model.params() / tp;
      const double dp_s =
          2.0 * hw.inter.latency + (dp - 1.0) / dp * shard * (4.0 + 2.0) * tp / (hw.nics_per_node * hw.inter.bandwidth);
      out.step_s += dp_s;
      out.zero_exposed_s += dp_s;
    }
    out.step_s += 2.0 * 18.0 * model.params() / tp / dp / hw.hbm_bandwidth;
    double mean = 0;
    for (double t : rank_time) mean += t / dp;
    out.imbalance = mean > 0 ? rank_time[slowest] / mean : 1.0;
    out.layout = "tp " + std::to_string(tp) + " x cp " + std::to_string(cp) + " x dp " + std::to_string(dp) + ", " +
                 std::to_string(bins.size()) + " packed " + std::to_string(context / 1024) + "K sequences";
    return out;
  }
};

}  // namespace seqpar::bench::dpp
