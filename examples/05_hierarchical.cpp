// SPDX-License-Identifier: Apache-2.0
// 05: Two-level sequence parallelism: all-to-all inside a node, sharding-aware ring across nodes.
//
// USP (Fang & Zhao, "USP: A Unified Sequence Parallelism Approach", 2024), LoongTrain and HSAP combine
// DeepSpeed-Ulysses inside a node (an all-to-all from sequence- to head-sharding over fast links) with
// ring attention across nodes (KV of the node's heads passed between ranks holding the same heads;
// here sharding-aware: only the KV rows a peer's slices read). The degree is no longer capped by the
// head count: 8 in-process ranks, 4 per node, run a model with only 4 query heads, which plain
// Ulysses over 8 ranks refuses (the example prints why). Zigzag sharding balances the causal work.
// The example prints tokens, bytes and inter-node bytes per rank (from the compiled programs' bytes
// per destination) and checks forward and backward against the fp64 reference (--smoke: the whole
// batch; full size: O, LSE and dQ on sampled query rows). It also prints what a flat sharding-aware
// zigzag ring would send across nodes: with GQA (2 KV heads, 4 ranks per node) the ranks of a node each
// ship their copy of a shared KV head over the outer ring, so on this batch the flat ring sends half
// the hierarchical inter-node bytes (the same at Hkv = 4), but in 7 ring steps instead of 1.
//   usage: 05_hierarchical [--smoke] [--tokens T] [--threads K]
#include "example_support.hpp"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

using namespace seqpar;
using namespace seqpar::examples;
using Usp = Strategy<partition::Zigzag, comm::Hierarchical<comm::AllToAll, comm::Ring>>;
using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
constexpr int kRanks = 8, kRanksPerNode = 4;

int main(int argc, char** argv) {
  Options opt{.tokens = 16384};
  if (!parse_options(argc, argv, opt, 2048)) return 2;
  // One sequence packed with lognormal documents (median tokens/16), fixed seed.
  std::mt19937 rng(2026);
  const DocumentBatch batch(lognormal_sequences(rng, 1, opt.tokens, double(opt.tokens) / 16));
  const AttentionShape shape{4, 2, 64};  // 4 query heads (GQA 4:2), head_dim 64: fewer heads than ranks
  const std::int64_t n = batch.total_tokens();
  Tensors<float> io(n, shape);
  io.randomize_inputs(rng);
  std::printf(
      "seqpar 05: hierarchical (all-to-all of 4 in a node, ring of 2 across nodes) on %d in-process ranks, "
      "1 sequence x %lld tokens, %zu documents, heads %d:%d, d %d\n",
      kRanks, static_cast<long long>(n), batch.documents().size(), shape.heads_q, shape.heads_kv, shape.head_dim);

  const Topology topology{kRanks, kRanksPerNode};
  Usp::Arguments args;
  args.comm.inner_size = kRanksPerNode;   // all-to-all over the 4 ranks of a node
  args.comm.outer.sharding_aware = true;  // ring of 2 across nodes: only the KV rows a peer reads
  const Status plain = Ulysses::can_implement({}, batch, shape, topology);
  const Status usp = Usp::can_implement(args, batch, shape, topology);
  std::printf("plain Ulysses over %d ranks: %s\nhierarchical: %s\n", kRanks,
              plain ? "accepted" : ("refused: " + plain.reason).c_str(), usp ? "accepted" : usp.reason.c_str());
  if (plain || !usp) {
    std::printf("FAILED: expected plain Ulysses refused and the hierarchical strategy accepted\n");
    return 1;
  }

  // What every rank runs (run_engine makes it on the rank's transport): the hierarchical strategy's
  // DistributedAttention, told how many ranks share a node, with CpuFlash as the kernel.
  args.ranks_per_node = kRanksPerNode;
  const auto t0 = std::chrono::steady_clock::now();
  const auto stats = run_engine(batch, shape, io, kRanks, kRanksPerNode, [&](auto& transport) {
    return std::make_unique<DistributedAttention<Usp, attention::CpuFlash<float>>>(
        transport, shape, args, attention::CpuFlash<float>({.threads = opt.threads}));
  });
  const double wall_ms = ms_since(t0);
  std::printf("%4s %4s %7s %11s %11s %11s\n", "rank", "node", "tokens", "fwd B", "bwd B", "inter-node");
  double total[3] = {};
  for (int r = 0; r < kRanks; ++r) {
    const RankStats& s = stats[std::size_t(r)];
    std::printf("%4d %4d %7lld %11llu %11llu %11llu\n", r, topology.node_of(r), static_cast<long long>(s.tokens),
                static_cast<unsigned long long>(s.forward_bytes), static_cast<unsigned long long>(s.backward_bytes),
                static_cast<unsigned long long>(s.inter_node_bytes));
    total[0] += mib(s.forward_bytes), total[1] += mib(s.backward_bytes), total[2] += mib(s.inter_node_bytes);
  }
  // A flat sharding-aware zigzag ring over all 8 ranks (also works with 4 heads): what its compiled
  // programs would send across nodes, without running it.
  double flat = 0;
  const ShardPlan zplan = partition::Zigzag{}.plan(batch, topology);
  for (int r = 0; r < kRanks; ++r) {
    const comm::CompiledAttention p = comm::Ring{{.sharding_aware = true}}.compile(zplan, shape, r);
    flat += mib(inter_node_bytes(p.forward, r, kRanks, kRanksPerNode) +
                inter_node_bytes(p.backward, r, kRanks, kRanksPerNode));
  }
  std::printf(
      "all ranks, MiB forward / backward / inter-node: %.2f / %.2f / %.2f (%.0f ms); flat sharding-aware "
      "zigzag ring, inter-node: %.2f\n",
      total[0], total[1], total[2], wall_ms, flat);

  // fp64 reference: the whole batch under --smoke, else 256 sampled query rows (O, LSE, dQ; every head).
  const std::vector<bool> checked = checked_rows(n, opt.smoke, rng);
  const bool ok = check(reference(batch, shape, io, checked), io, checked, opt.smoke).ok();
  std::printf("%s\n", ok ? "OK" : "FAILED: error above tolerance");
  return ok ? 0 : 1;
}
