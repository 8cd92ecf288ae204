// SPDX-License-Identifier: Apache-2.0
// 04: FlashCP-style hybrid sharding with sharding-aware ring attention, on 8 in-process ranks.
//
// FlashCP keeps short documents whole on one rank (Whole-Doc: no KV traffic at all) and cuts only the
// long ones head-tail across every rank (Per-Doc: balanced, KV from every rank); the threshold tau is
// chosen by sweeping the document lengths under a cost proxy (compute per attention pair vs received
// KV tokens). The ring then sends each peer only the KV rows its slices read (sharding-aware), so only
// the split documents move KV. On a packed lognormal mix with a few long documents the example
// prints tau, the compute balance of the plan (max / mean attention pairs per rank), tokens, pairs and
// bytes per rank, and compares with zigzag ring attention (sequence cut head-tail, same sharding-aware
// ring) on the same batch. Forward and backward are checked against the fp64 reference (--smoke: the
// whole batch; full size: O, LSE and dQ on sampled query rows).
//   usage: 04_flashcp_hybrid [--smoke] [--tokens T] [--threads K]
#include "example_support.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <random>
#include <utility>
#include <vector>

using namespace seqpar;
using namespace seqpar::examples;
using HybridRing = Strategy<partition::Hybrid, comm::Ring>;
using ZigzagRing = Strategy<partition::Zigzag, comm::Ring>;
constexpr int kRanks = 8;

int main(int argc, char** argv) {
  Options opt{.tokens = 16384};
  if (!parse_options(argc, argv, opt, 2048)) return 2;
  // One sequence: three long documents (T/4, T/8, T/8) among lognormal short ones (median T/64, at
  // most T/16), in shuffled order, fixed seed.
  const std::int64_t tokens = opt.tokens;
  std::mt19937 rng(2026);
  std::vector<std::int64_t> docs{tokens / 4, tokens / 8, tokens / 8};
  const auto shorts =
      lognormal_sequences(rng, 1, tokens - tokens / 4 - 2 * (tokens / 8), double(tokens) / 64, tokens / 16).front();
  docs.insert(docs.end(), shorts.begin(), shorts.end());
  std::shuffle(docs.begin(), docs.end(), rng);
  const DocumentBatch batch = DocumentBatch::single(docs);
  const AttentionShape shape{8, 2, 64};  // GQA 8:2, head_dim 64
  const std::int64_t n = batch.total_tokens();
  Tensors<float> hybrid(n, shape), zigzag(n, shape);
  hybrid.randomize_inputs(rng);
  zigzag.copy_inputs(hybrid);
  std::printf(
      "seqpar 04: FlashCP hybrid + sharding-aware ring on %d in-process ranks, 1 sequence x %lld tokens, "
      "%zu documents (longest %lld), heads %d:%d, d %d\n",
      kRanks, static_cast<long long>(n), docs.size(), static_cast<long long>(tokens / 4), shape.heads_q, shape.heads_kv,
      shape.head_dim);

  // The plans every rank's DistributedAttention compiles; Hybrid's report says which tau it chose.
  const Topology topology{kRanks, kRanks};
  const partition::HybridReport report = partition::Hybrid{}.plan_with_report(batch, topology);
  const ShardPlan zplan = partition::Zigzag{}.plan(batch, topology);
  const Balance hb = report.plan.balance(), zb = zplan.balance();
  std::printf(
      "hybrid: tau = %lld (%d of %zu documents cut per-doc, %d thresholds costed); compute imbalance %.3f, "
      "tokens %.3f\nzigzag: compute imbalance %.3f, tokens %.3f\n",
      static_cast<long long>(report.threshold), report.per_doc_documents, docs.size(), report.candidates_evaluated,
      hb.compute_imbalance, hb.token_imbalance, zb.compute_imbalance, zb.token_imbalance);

  HybridRing::Arguments hargs;
  hargs.comm.sharding_aware = true;
  ZigzagRing::Arguments zargs;
  zargs.comm.sharding_aware = true;
  // What every rank runs (run_engine makes it on the rank's transport): the strategy's DistributedAttention
  // with its arguments, CpuFlash as the kernel.
  const auto engine_of = [&]<class S>(S, typename S::Arguments args) {
    return [&, args](auto& transport) {
      return std::make_unique<DistributedAttention<S, attention::CpuFlash<float>>>(
          transport, shape, args, attention::CpuFlash<float>({.threads = opt.threads}));
    };
  };
  auto t0 = std::chrono::steady_clock::now();
  const auto by_hybrid = run_engine(batch, shape, hybrid, kRanks, 0, engine_of(HybridRing{}, hargs));
  const double hybrid_ms = ms_since(t0);
  t0 = std::chrono::steady_clock::now();
  const auto by_zigzag = run_engine(batch, shape, zigzag, kRanks, 0, engine_of(ZigzagRing{}, zargs));
  const double zigzag_ms = ms_since(t0);

  std::printf("%4s | %-40s | %s\n", "", "hybrid, sharding-aware ring", "zigzag, sharding-aware ring");
  std::printf("%4s | %6s %9s %11s %11s | %6s %9s %11s %11s\n", "rank", "tokens", "pairs", "fwd B", "bwd B", "tokens",
              "pairs", "fwd B", "bwd B");
  double total[4] = {};
  for (int r = 0; r < kRanks; ++r) {
    const auto i = std::size_t(r);
    const RankStats &h = by_hybrid[i], &z = by_zigzag[i];
    std::printf("%4d | %6lld %9lld %11llu %11llu | %6lld %9lld %11llu %11llu\n", r, static_cast<long long>(h.tokens),
                static_cast<long long>(total_area(report.plan.slices[i])),
                static_cast<unsigned long long>(h.forward_bytes), static_cast<unsigned long long>(h.backward_bytes),
                static_cast<long long>(z.tokens), static_cast<long long>(total_area(zplan.slices[i])),
                static_cast<unsigned long long>(z.forward_bytes), static_cast<unsigned long long>(z.backward_bytes));
    total[0] += mib(h.forward_bytes), total[1] += mib(h.backward_bytes);
    total[2] += mib(z.forward_bytes), total[3] += mib(z.backward_bytes);
  }
  // Plain zigzag ring (whole KV blocks): what its compiled programs declare, without running it.
  double plain = 0;
  for (int r = 0; r < kRanks; ++r)
    plain += mib(comm::Ring{}.compile(zplan, shape, r).forward.bytes_sent(sizeof(float), sizeof(float)));
  std::printf(
      "all ranks, MiB forward / backward: hybrid %.2f / %.2f (%.0f ms), zigzag %.2f / %.2f (%.0f ms); "
      "plain zigzag ring forward: %.2f\n",
      total[0], total[1], hybrid_ms, total[2], total[3], zigzag_ms, plain);

  // fp64 reference: the whole batch under --smoke, else 256 sampled query rows (O, LSE, dQ; every head).
  const std::vector<bool> checked = checked_rows(n, opt.smoke, rng);
  const Tensors<double> ref = reference(batch, shape, hybrid, checked);
  bool ok = true;
  for (auto [name, got] : {std::pair{"hybrid", &hybrid}, {"zigzag", &zigzag}}) {
    std::printf("%-6s ", name);
    ok = check(ref, *got, checked, opt.smoke).ok() && ok;
  }
  std::printf("%s\n", ok ? "OK" : "FAILED: error above tolerance");
  return ok ? 0 : 1;
}
