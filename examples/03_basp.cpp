// SPDX-License-Identifier: Apache-2.0
// 03: Batch-aware sequence parallelism (BASP): Ulysses inside node-sized groups, one sequence each.
//
// BASP (Ghimire & Calhoun) cuts the world into disjoint groups of consecutive ranks, each owning whole
// sequences of the batch; attention and its communication stay inside a group. Here B = 2 sequences
// run on 8 in-process ranks, 4 per node: two groups of 4, each running DeepSpeed-Ulysses (Jacobs et
// al., 2023: all-to-all from sequence- to head-sharding and back) on its own sequence. A group that
// fits a node never touches the inter-node links; the example prints the groups, tokens and bytes
// per rank, derives each rank's inter-node bytes from its compiled programs (bytes per destination,
// node = rank / 4) and fails if BASP declares any, and compares with plain Ulysses over all 8 ranks on
// the same batch. Forward and backward are checked against the fp64 reference (--smoke: the whole
// batch; full size: O, LSE and dQ on sampled query rows).
//   usage: 03_basp [--smoke] [--tokens T] [--threads K]   (T tokens per sequence)
#include "example_support.hpp"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <random>
#include <utility>
#include <vector>

using namespace seqpar;
using namespace seqpar::examples;
using Basp = Strategy<partition::BatchAware<partition::Uniform>, comm::AllToAll>;
using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
constexpr int kRanks = 8, kRanksPerNode = 4;

int main(int argc, char** argv) {
  Options opt{.tokens = 8192};
  if (!parse_options(argc, argv, opt, 1024)) return 2;
  // Two sequences of `tokens` each, packed with lognormal documents (median tokens/8), fixed seed.
  std::mt19937 rng(2026);
  const DocumentBatch batch(lognormal_sequences(rng, 2, opt.tokens, double(opt.tokens) / 8));
  const AttentionShape shape{8, 2, 64};  // GQA 8:2, head_dim 64
  const std::int64_t n = batch.total_tokens();
  Tensors<float> basp(n, shape), ulysses(n, shape);
  basp.randomize_inputs(rng);
  ulysses.copy_inputs(basp);
  std::printf(
      "seqpar 03: BASP on %d in-process ranks (%d per node), %d sequences x %lld tokens, %zu documents, "
      "heads %d:%d, d %d\n",
      kRanks, kRanksPerNode, batch.num_sequences(), static_cast<long long>(opt.tokens), batch.documents().size(),
      shape.heads_q, shape.heads_kv, shape.head_dim);
  // The groups the partitioner forms (the same plan every rank's DistributedAttention compiles).
  const Topology topology{kRanks, kRanksPerNode};
  const ShardPlan plan = Basp::partitioner_type{}.plan(batch, topology);
  const auto layout = Basp::partitioner_type{}.layout(batch, topology);
  for (std::size_t g = 0; g < plan.groups.size(); ++g)
    std::printf("group %zu: ranks %d..%d (node %d), sequence %d\n", g, plan.groups[g].front(), plan.groups[g].back(),
                topology.node_of(plan.groups[g].front()), layout[g].sequences.front());

  // What every rank runs (run_engine makes it on the rank's transport): strategy S's DistributedAttention,
  // told how many ranks share a node, with CpuFlash as the kernel.
  const auto engine_of = [&]<class S>(S) {
    return [&](auto& transport) {
      typename S::Arguments args;
      args.ranks_per_node = kRanksPerNode;
      return std::make_unique<DistributedAttention<S, attention::CpuFlash<float>>>(
          transport, shape, args, attention::CpuFlash<float>({.threads = opt.threads}));
    };
  };
  auto t0 = std::chrono::steady_clock::now();
  const auto by_basp = run_engine(batch, shape, basp, kRanks, kRanksPerNode, engine_of(Basp{}));
  const double basp_ms = ms_since(t0);
  t0 = std::chrono::steady_clock::now();
  const auto by_ulysses = run_engine(batch, shape, ulysses, kRanks, kRanksPerNode, engine_of(Ulysses{}));
  const double ulysses_ms = ms_since(t0);

  std::printf("%4s %7s | %-32s | %s\n", "", "", "BASP (2 groups of 4)", "Ulysses (8 ranks)");
  std::printf("%4s %7s | %10s %10s %10s | %10s %10s %10s\n", "rank", "tokens", "fwd B", "bwd B", "inter-node", "fwd B",
              "bwd B", "inter-node");
  double total[6] = {};
  for (int r = 0; r < kRanks; ++r) {
    const RankStats &b = by_basp[std::size_t(r)], &u = by_ulysses[std::size_t(r)];
    const std::uint64_t v[6] = {b.forward_bytes, b.backward_bytes, b.inter_node_bytes,
                                u.forward_bytes, u.backward_bytes, u.inter_node_bytes};
    std::printf("%4d %7lld | %10llu %10llu %10llu | %10llu %10llu %10llu\n", r, static_cast<long long>(b.tokens),
                static_cast<unsigned long long>(v[0]), static_cast<unsigned long long>(v[1]),
                static_cast<unsigned long long>(v[2]), static_cast<unsigned long long>(v[3]),
                static_cast<unsigned long long>(v[4]), static_cast<unsigned long long>(v[5]));
    for (int i = 0; i < 6; ++i) total[i] += mib(v[i]);
  }
  std::printf(
      "all ranks, MiB forward / backward / inter-node: BASP %.2f / %.2f / %.2f (%.0f ms), "
      "Ulysses %.2f / %.2f / %.2f (%.0f ms)\n",
      total[0], total[1], total[2], basp_ms, total[3], total[4], total[5], ulysses_ms);

  // fp64 reference: the whole batch under --smoke, else 256 sampled query rows (O, LSE, dQ; every head).
  const std::vector<bool> checked = checked_rows(n, opt.smoke, rng);
  const Tensors<double> ref = reference(batch, shape, basp, checked);
  bool accurate = true;
  for (auto [name, got] : {std::pair{"BASP", &basp}, {"Ulysses", &ulysses}}) {
    std::printf("%-7s ", name);
    accurate = check(ref, *got, checked, opt.smoke).ok() && accurate;
  }
  const bool ok = total[2] == 0 && accurate;
  const char* failure = total[2] != 0 ? "FAILED: BASP declares inter-node bytes" : "FAILED: error above tolerance";
  std::printf("%s\n", ok ? "OK" : failure);
  return ok ? 0 : 1;
}
