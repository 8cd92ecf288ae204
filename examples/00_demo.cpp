// SPDX-License-Identifier: Apache-2.0
// 00: the demo (`make demo`): what seqpar is for, on one long-tail packed batch, in under a minute.
//
// Two sequences of packed documents, each with one long document among many short ones (the long tail
// of real pre-training data), on 8 in-process ranks in 2 nodes of 4. Four ways to run the same exact
// attention:
//  - zigzag ring: Megatron / TransformerEngine context parallelism, the baseline: every sequence cut
//    head-tail over all 8 ranks, whole KV blocks around a ring that crosses nodes;
//  - FlashCP: short documents kept whole on one rank, only long ones cut, and a sharding-aware ring that
//    sends a peer only the KV rows its documents read;
//  - BASP: disjoint groups of 4 ranks (one node each) own whole sequences; Ulysses all-to-all inside a
//    group, so nothing crosses nodes;
//  - the planner: plan::SelectedAttention predicts every candidate on a GPU profile (H100 SXM) and runs
//    the fastest for this batch, the same choice on every rank without talking.
// Each runs forward and backward for real on CpuFlash (fp32) and is checked against fp64 attention over
// the whole unsharded batch. The table: tokens per rank (largest), compute imbalance (the busiest rank's
// attention pairs over the mean), bytes moved inside and between nodes (forward + backward, all ranks), one layer's
// attention forward + backward simulated on the H100 profile, and the error. In-process timings say
// nothing about speed (threads on one CPU), so none are printed: the simulated column is the cost model's.
//   usage: 00_demo [--smoke] [--tokens T] [--threads K]   (T tokens per sequence; default 8192)
#include "example_support.hpp"

#include <seqpar/plan/compile_all.hpp>
#include <seqpar/plan/selected_attention.hpp>
#include <seqpar/replay/hardware.hpp>
#include <seqpar/replay/predict.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

using namespace seqpar;
using namespace seqpar::examples;
using ZigzagRing = Strategy<partition::Zigzag, comm::Ring>;
using FlashCp = Strategy<partition::Hybrid, comm::Ring>;
using Basp = Strategy<partition::BatchAware<partition::Uniform>, comm::AllToAll>;
using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
using Usp = Strategy<partition::Zigzag, comm::Hierarchical<comm::AllToAll, comm::Ring>>;
using Kernel = attention::CpuFlash<float>;
using Planner = plan::SelectedAttention<Kernel, ZigzagRing, FlashCp, Basp, Ulysses, Usp>;
constexpr int kRanks = 8, kRanksPerNode = 4;

namespace {

// One attention layer's forward + backward replayed on the profile: its time, and the compute imbalance
// as the executor would run it (the largest rank's (query, key) pairs over all heads, over the mean; an
// all-to-all strategy computes on heads, not on the tokens it owns, so the plan's own balance misleads).
struct Prediction {
  double ms = 0, imbalance = 1;
};
Prediction summarize(const replay::AttentionPrediction& p) {
  Prediction out{p.time_s() * 1e3, 1};
  double most = 0, sum = 0;
  for (std::size_t r = 0; r < p.forward.ranks.size(); ++r) {
    const double pairs = double(p.forward.ranks[r].head_pairs + p.backward.ranks[r].head_pairs);
    most = std::max(most, pairs);
    sum += pairs;
  }
  if (sum > 0) out.imbalance = most * double(p.forward.ranks.size()) / sum;
  return out;
}

struct Row {
  std::string name, what;
  std::int64_t max_tokens = 0;
  double imbalance = 1;
  double intra_mib = 0, inter_mib = 0;
  double simulated_ms = 0;
  double error = 0;
  bool ok = false;
};

// The table's row for a run: per-rank stats summed, the plan's balance, the prediction and the error.
Row summarize(std::string name, std::string what, const std::vector<RankStats>& stats, const Prediction& predicted,
              const Tensors<double>& ref, const Tensors<float>& got, const std::vector<bool>& checked) {
  Row row{std::move(name), std::move(what)};
  std::uint64_t all = 0, inter = 0;
  for (const RankStats& s : stats) {
    row.max_tokens = std::max(row.max_tokens, s.tokens);
    all += s.forward_bytes + s.backward_bytes;
    inter += s.inter_node_bytes;
  }
  row.imbalance = predicted.imbalance;
  row.intra_mib = mib(all - std::min(all, inter));
  row.inter_mib = mib(inter);
  row.simulated_ms = predicted.ms;
  std::printf("  %-12s ", row.name.c_str());
  const Errors e = check(ref, got, checked, /*smoke=*/true);
  row.error = std::max({e.o, e.lse, e.dq, e.dk, e.dv});
  row.ok = e.ok();
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt{.tokens = 8192};
  if (!parse_options(argc, argv, opt, 2048)) return 2;
  // Two sequences of T tokens: one long document (T/2, T/4) each among lognormal short ones (median
  // T/64, at most T/16), shuffled; fixed seed.
  const std::int64_t t = opt.tokens;
  std::mt19937 rng(2026);
  const DocumentBatch batch({long_tail_sequence(rng, t, {t / 2}, double(t) / 64, t / 16),
                             long_tail_sequence(rng, t, {t / 4}, double(t) / 64, t / 16)});
  const AttentionShape shape{8, 2, 64};  // GQA 8:2, head_dim 64
  const Topology topology{kRanks, kRanksPerNode};
  const std::int64_t n = batch.total_tokens();
  std::printf(
      "seqpar demo: %d sequences x %lld tokens, %zu documents (longest %lld), heads %d:%d, d %d, on %d in-process "
      "ranks in %d nodes of %d\n\n",
      batch.num_sequences(), static_cast<long long>(t), batch.documents().size(), static_cast<long long>(t / 2),
      shape.heads_q, shape.heads_kv, shape.head_dim, kRanks, topology.num_nodes(), kRanksPerNode);

  replay::SimulationOptions sim;
  sim.hardware = replay::profiles::h100_sxm();
  const auto predicted = [&]<class S>(const typename S::Arguments& args) {
    typename S::Arguments a = args;
    a.ranks_per_node = kRanksPerNode;
    return summarize(replay::predict(plan::compile_all<S>(a, batch, shape, topology), topology, shape, sim));
  };

  Tensors<float> inputs(n, shape);
  inputs.randomize_inputs(rng);
  const std::vector<bool> every_row(static_cast<std::size_t>(n), true);
  const Tensors<double> ref = reference(batch, shape, inputs, every_row);
  std::printf("error vs fp64 over the whole batch (forward and backward):\n");

  std::vector<Row> rows;
  const auto run_strategy = [&]<class S>(const char* name, const char* what, typename S::Arguments args) {
    Tensors<float> io(n, shape);
    io.copy_inputs(inputs);
    args.ranks_per_node = kRanksPerNode;
    const auto stats = run_engine(batch, shape, io, kRanks, kRanksPerNode, [&](auto& transport) {
      return std::make_unique<DistributedAttention<S, Kernel>>(transport, shape, args,
                                                               Kernel({.threads = opt.threads}));
    });
    rows.push_back(summarize(name, what, stats, predicted.template operator()<S>(args), ref, io, every_row));
  };
  run_strategy.operator()<ZigzagRing>("zigzag-ring", "Megatron/TE context parallel (baseline)", {});
  FlashCp::Arguments flashcp;
  flashcp.comm.sharding_aware = true;
  run_strategy.operator()<FlashCp>("hybrid-aware", "Hybrid + sharding-aware ring (FlashCP)", flashcp);
  run_strategy.operator()<Basp>("basp", "BatchAware<Uniform> + all-to-all (BASP)", {});

  // The planner: every candidate simulated on the profile, the fastest run; its choice is the same on
  // every rank (the simulation is deterministic), so rank 0's is the world's.
  Planner::Arguments pargs;
  pargs.names = {"zigzag-ring", "hybrid-aware", "basp", "ulysses", "hierarchical"};  // seqpar-plan's names
  std::get<1>(pargs.strategies).comm.sharding_aware = true;
  std::get<4>(pargs.strategies).comm.outer.sharding_aware = true;
  pargs.simulation = sim;
  pargs.ranks_per_node = kRanksPerNode;
  Planner::Choice choice;
  std::mutex mu;
  Tensors<float> io(n, shape);
  io.copy_inputs(inputs);
  const auto stats = run_engine(
      batch, shape, io, kRanks, kRanksPerNode,
      [&](auto& transport) {
        return std::make_unique<Planner>(transport, shape, pargs, Kernel({.threads = opt.threads}));
      },
      [&](Planner& attn, int rank) {
        if (rank != 0) return;
        const std::lock_guard lock(mu);
        choice = attn.choice(batch);
      });
  // The chosen candidate's replay, for its imbalance (its time is the planner's own prediction).
  const Prediction chosen = [&] {
    switch (choice.index) {
      case 0:
        return predicted.operator()<ZigzagRing>(std::get<0>(pargs.strategies));
      case 1:
        return predicted.operator()<FlashCp>(std::get<1>(pargs.strategies));
      case 2:
        return predicted.operator()<Basp>(std::get<2>(pargs.strategies));
      case 3:
        return predicted.operator()<Ulysses>(std::get<3>(pargs.strategies));
      default:
        return predicted.operator()<Usp>(std::get<4>(pargs.strategies));
    }
  }();
  rows.push_back(summarize("planner", "SelectedAttention's pick: " + choice.name, stats,
                           {choice.predicted_s * 1e3, chosen.imbalance}, ref, io, every_row));

  std::printf("\n%-12s %-42s %10s %9s %10s %10s %12s %9s\n", "strategy", "what", "max tokens", "imbalance", "intra MiB",
              "inter MiB", "H100 ms", "error");
  bool ok = true;
  for (const Row& r : rows) {
    std::printf("%-12s %-42s %10lld %9.3f %10.2f %10.2f %12.3f %9.1e%s\n", r.name.c_str(), r.what.c_str(),
                static_cast<long long>(r.max_tokens), r.imbalance, r.intra_mib, r.inter_mib, r.simulated_ms, r.error,
                r.ok ? "" : "  FAILED");
    ok = ok && r.ok;
  }
  std::printf("\nthe planner's predictions (one attention layer, forward + backward, %s):", sim.hardware.name.c_str());
  for (std::size_t i = 0; i < Planner::kCount; ++i)
    std::printf(" %s %.3f ms%s", pargs.names[i].c_str(), choice.predictions[i] * 1e3,
                i + 1 < Planner::kCount ? "," : "\n");
  std::printf(
      "bytes: what each rank's transport sent (fp32 here), split by whether the peer is on another node; H100 "
      "ms: the\ncost model's replay of the same programs on an H100 SXM profile (bf16); in-process wall times "
      "are not speed\nand are not shown.\n%s\n",
      ok ? "OK" : "FAILED: error above tolerance");
  return ok ? 0 : 1;
}
