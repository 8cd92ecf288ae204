// SPDX-License-Identifier: Apache-2.0
// 02: Ring attention over zigzag (head-tail) shards, plain and sharding-aware, on 8 in-process ranks.
//
// Ring attention (Liu, Zaharia & Abbeel, "Ring Attention with Blockwise Transformers", 2023) leaves
// every rank's queries in place and passes KV blocks around the ring in P-1 steps, merging partial
// (O, LSE) in fp32. Zigzag sharding (Megatron-LM context parallelism, Llama 3) cuts the sequence into
// 2P chunks and gives rank r chunks r and 2P-1-r, so that on a causal sequence every rank gets the
// same work (on packed documents, roughly).
// Sharding-aware KV (FlashCP; HSAP's sequence-aware P2P) sends a peer only the KV rows its slices
// read: with packed documents, most pairs of ranks exchange nothing.
// One sequence of packed lognormal documents runs both ways; the example prints tokens and bytes per
// rank, checks that both give the same O, LSE, dQ, dK, dV, and checks them against the fp64 reference
// (--smoke: the whole batch; full size: O, LSE and dQ on sampled query rows).
//   usage: 02_ring_zigzag [--smoke] [--tokens T] [--threads K]
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
using ZigzagRing = Strategy<partition::Zigzag, comm::Ring>;
constexpr int kRanks = 8;

int main(int argc, char** argv) {
  Options opt{.tokens = 16384};
  if (!parse_options(argc, argv, opt, 2048)) return 2;
  // One sequence packed with lognormal documents (median tokens/16), fixed seed.
  std::mt19937 rng(2026);
  const DocumentBatch batch(lognormal_sequences(rng, 1, opt.tokens, double(opt.tokens) / 16));
  const AttentionShape shape{8, 2, 64};  // GQA 8:2, head_dim 64
  const std::int64_t n = batch.total_tokens();
  Tensors<float> plain(n, shape), aware(n, shape);
  plain.randomize_inputs(rng);
  aware.copy_inputs(plain);
  std::printf(
      "seqpar 02: zigzag ring attention on %d in-process ranks, 1 sequence x %lld tokens, %zu documents, "
      "heads %d:%d, d %d\n",
      kRanks, static_cast<long long>(n), batch.documents().size(), shape.heads_q, shape.heads_kv, shape.head_dim);

  // What every rank runs (run_engine makes it on the rank's transport): the strategy's DistributedAttention,
  // with CpuFlash as the kernel.
  const auto zigzag_ring = [&](ZigzagRing::Arguments args) {
    return [&, args](auto& transport) {
      return std::make_unique<DistributedAttention<ZigzagRing, attention::CpuFlash<float>>>(
          transport, shape, args, attention::CpuFlash<float>({.threads = opt.threads}));
    };
  };
  const auto t0 = std::chrono::steady_clock::now();
  const auto by_plain = run_engine(batch, shape, plain, kRanks, 0, zigzag_ring({}));
  ZigzagRing::Arguments args;
  args.comm.sharding_aware = true;  // send each peer only the KV rows its slices read
  const auto by_aware = run_engine(batch, shape, aware, kRanks, 0, zigzag_ring(args));
  const double wall_ms = ms_since(t0);

  std::printf("%4s %7s %14s %14s %14s %14s\n", "rank", "tokens", "fwd B plain", "fwd B aware", "bwd B plain",
              "bwd B aware");
  double total[4] = {};
  for (int r = 0; r < kRanks; ++r) {
    const RankStats &p = by_plain[std::size_t(r)], &a = by_aware[std::size_t(r)];
    const std::uint64_t b[4] = {p.forward_bytes, a.forward_bytes, p.backward_bytes, a.backward_bytes};
    std::printf("%4d %7lld %14llu %14llu %14llu %14llu\n", r, static_cast<long long>(p.tokens),
                static_cast<unsigned long long>(b[0]), static_cast<unsigned long long>(b[1]),
                static_cast<unsigned long long>(b[2]), static_cast<unsigned long long>(b[3]));
    for (int i = 0; i < 4; ++i) total[i] += mib(b[i]);
  }
  std::printf(
      "all ranks, plain -> sharding-aware: forward %.2f -> %.2f MiB, backward %.2f -> %.2f MiB; "
      "both runs %.0f ms\n",
      total[0], total[1], total[2], total[3], wall_ms);

  // fp64 reference: the whole batch under --smoke, else 256 sampled query rows (O, LSE, dQ; every head).
  const std::vector<bool> checked = checked_rows(n, opt.smoke, rng);
  const Tensors<double> ref = reference(batch, shape, plain, checked);
  const std::vector<bool> all(checked.size(), true);
  double same = 0;  // plain vs sharding-aware, every output of every token
  for (auto [a, b] :
       {std::pair{&plain.o, &aware.o}, {&plain.dq, &aware.dq}, {&plain.dk, &aware.dk}, {&plain.dv, &aware.dv}})
    same = std::max(same, rel_error(*a, *b, all));
  same = std::max(same, rel_error(plain.lse, aware.lse, all, true));
  std::printf("plain vs sharding-aware: max |difference| / max |value| %.2e over O, LSE, dQ, dK, dV\n", same);
  const Errors err = check(ref, aware, checked, opt.smoke);
  const bool ok = err.ok() && same < 1e-5;
  std::printf("%s\n", ok ? "OK" : "FAILED: error above tolerance");
  return ok ? 0 : 1;
}
