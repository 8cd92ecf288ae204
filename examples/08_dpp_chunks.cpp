// SPDX-License-Identifier: Apache-2.0
// 08: DPP's dynamic chunking (schedule::DynamicChunk) run exactly, chunk by chunk, on 4 in-process
// ranks with FlashCP-style hybrid sharding and sharding-aware ring attention underneath.
//
// A long-tail batch (two sequences; a few long documents among lognormal short ones) is cut by
// DynamicChunk into split chunks (equal-cost slices of the long documents: later slices are shorter,
// causal attention makes them dearer), batched chunks (short documents packed best-fit-decreasing) and
// hybrid chunks (a long document's tail plus short documents). ChunkedAttention runs the chunks in
// order over the strategy: a later slice's queries also read the K/V of its document's earlier slices,
// kept on the ranks that computed them (the carry) and fetched for the ranks holding those queries;
// backward runs the chunks in reverse and sends the prefix's dK/dV back to the ranks that keep it.
//
// It prints the chunk plan, the attention working set per rank chunked vs unchunked, and the check
// against the fp64 reference over the whole batch (O, LSE, dQ, dK, dV; fp64 CpuFlash, exit 1 above
// 1e-9). The working set is counted in bytes, max over ranks: for the unchunked batch, the rank's rows
// of Q, K, V, O, dO, dQ, dK, dV and LSE of the whole batch; chunked, the same tensors for the rows of
// one chunk (the largest), plus the prefix K/V rows the rank gathers for it and their dK/dV, plus the
// carry (K, V, dK, dV of the prefix rows the rank keeps for later chunks). It is what a pipeline stage
// needs per chunk in flight; this example keeps every chunk's tensors to check them all.
//   usage: 08_dpp_chunks [--smoke] [--tokens T] [--threads K]
#include "example_support.hpp"

#include <seqpar/runtime/chunked_attention.hpp>
#include <seqpar/schedule/dynamic_chunk.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <vector>

using namespace seqpar;
using namespace seqpar::examples;
using HybridRing = Strategy<partition::Hybrid, comm::Ring>;
using Kernel = attention::CpuFlash<double>;
constexpr int kRanks = 4;

namespace {

// Bytes of a rank's rows of Q, K, V, O, dO, dQ, dK, dV (fp64) and LSE for `rows` tokens.
double rows_bytes(const AttentionShape& s, std::int64_t rows) {
  const double per_row = 8.0 * (4.0 * s.heads_q * s.head_dim + 4.0 * s.heads_kv * s.head_dim + s.heads_q);
  return per_row * static_cast<double>(rows);
}
// Bytes of K, V and their gradients for `rows` prefix rows.
double kv_bytes(const AttentionShape& s, std::int64_t rows) {
  return 8.0 * 2.0 * s.heads_kv * (s.qk_dim() + s.v_dim()) * static_cast<double>(rows);  // K, dK; V, dV
}

double max_rel(const std::vector<double>& got, const std::vector<double>& want) {
  double scale = 0, err = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    scale = std::max(scale, std::abs(want[i]));
    err = std::max(err, std::abs(got[i] - want[i]));
  }
  return scale > 0 ? err / scale : err;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt{.tokens = 8192};
  if (!parse_options(argc, argv, opt, 2048)) return 2;
  // Two sequences of T/2 tokens: the first holds documents of T/4 and T/8, the second one of 3T/16,
  // each among lognormal short documents (median T/128, at most T/32), shuffled, fixed seed.
  const std::int64_t t = opt.tokens;
  std::mt19937 rng(2027);
  std::vector<std::vector<std::int64_t>> seqs;
  for (const std::vector<std::int64_t>& longs : {std::vector<std::int64_t>{t / 4, t / 8}, {3 * t / 16}})
    seqs.push_back(long_tail_sequence(rng, t / 2, longs, double(t) / 128, t / 32));
  const DocumentBatch batch(seqs);
  const AttentionShape shape{4, 2, 64};  // GQA 4:2, head_dim 64
  const std::int64_t n = batch.total_tokens();

  // Chunks of at most T/8 tokens; cost per token = 6 x hidden per causal pair (a layer's GEMMs vs its
  // attention, in FLOPs), so the mesh balances a whole layer's time, not attention alone.
  schedule::DynamicChunk chunker;
  chunker.args.token_capacity = t / 8;
  chunker.args.cost = {.per_token = 6.0 * shape.heads_q * shape.head_dim, .per_pair = 1.0};
  const schedule::ChunkPlan plan = chunker.plan(batch);
  std::printf(
      "seqpar 08: DPP chunks over hybrid + sharding-aware ring on %d in-process ranks, %d sequences, %lld tokens, "
      "%zu documents, heads %d:%d, d %d, fp64\n",
      kRanks, batch.num_sequences(), static_cast<long long>(n), batch.documents().size(), shape.heads_q, shape.heads_kv,
      shape.head_dim);
  std::printf("DynamicChunk: capacity %lld tokens, %d slices of the longest document (mesh",
              static_cast<long long>(chunker.args.token_capacity), plan.slices);
  for (std::int64_t cut : plan.mesh) std::printf(" %lld", static_cast<long long>(cut));
  std::printf("), time target %.3g; %zu chunks\n", plan.time_target, plan.chunks.size());
  std::printf("%5s %-8s %7s %7s %10s %7s  %s\n", "chunk", "kind", "pieces", "tokens", "cost", "prefix",
              "pieces (document: rows)");
  for (std::size_t c = 0; c < plan.chunks.size(); ++c) {
    const schedule::Chunk& ch = plan.chunks[c];
    std::int64_t prefix = 0;
    for (const Range& p : ch.prefix) prefix += p.size();
    std::string pieces;
    for (std::size_t i = 0; i < plan.pieces[c].size() && i < 4; ++i) {
      const schedule::ChunkPiece& p = plan.pieces[c][i];
      pieces +=
          (i ? ", " : "") + std::to_string(p.document) + ": " + std::to_string(p.begin) + "-" + std::to_string(p.end);
    }
    if (plan.pieces[c].size() > 4) pieces += ", ...";
    std::printf("%5zu %-8s %7zu %7lld %10.3g %7lld  %s\n", c, schedule::kind_name(ch.kind), ch.tokens.size(),
                static_cast<long long>(ch.batch.total_tokens()), ch.cost, static_cast<long long>(prefix),
                pieces.c_str());
  }

  // Whole-batch inputs and the fp64 reference.
  Tensors<double> io(n, shape);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (auto* x : {&io.q, &io.k, &io.v, &io.dout})
    for (double& e : x->storage) e = normal(rng);
  Tensors<double> ref(n, shape);
  const attention::Reference<double> reference;
  const auto slices = batch.document_causal_slices();
  reference.forward(shape, io.q.view(), io.k.view(), io.v.view(), slices, ref.o.view(), ref.lse.view());
  reference.backward(shape, io.q.view(), io.k.view(), io.v.view(), ref.o.view(), ref.lse.view(), io.dout.view(), slices,
                     ref.dq.view(), ref.dk.view(), ref.dv.view());

  // Every rank: chunk by chunk forward, then backward in reverse; outputs scattered into `io`.
  HybridRing::Arguments args;
  args.comm.sharding_aware = true;
  std::vector<double> chunked_bytes(kRanks, 0.0), whole_bytes(kRanks, 0.0);
  std::vector<std::int64_t> carry_rows(kRanks, 0);
  std::mutex mu;
  backend::inproc::World(kRanks).run([&](backend::inproc::Transport& transport) {
    DistributedAttention<HybridRing, Kernel> attn(transport, shape, args, Kernel({.threads = opt.threads}));
    const std::int64_t whole_rows = attn.local_tokens(batch);  // the unchunked plan of the same strategy
    runtime::ChunkedAttention<Kernel> chunked(attn);
    chunked.begin(plan.chunks);
    const int nc = chunked.num_chunks();
    std::vector<Tensors<double>> local;
    local.reserve(static_cast<std::size_t>(nc));
    double peak = 0;
    for (int c = 0; c < nc; ++c) {
      const std::vector<Range>& owned = chunked.owned_global(c);
      Tensors<double>& l = local.emplace_back(chunked.local_tokens(c), shape);  // (local rows, heads, d)
      for (auto [from, to] : {std::pair{&io.q, &l.q}, {&io.k, &l.k}, {&io.v, &l.v}, {&io.dout, &l.dout}})
        train::shard_rows(std::span<const Range>(owned), from->view(), to->view());  // chunk c's rows here
      chunked.forward(c, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view());
      // Prefix rows this rank gathers for chunk c: the whole prefix of every piece whose queries it holds.
      const schedule::Chunk& ch = chunked.chunk(c);
      std::int64_t prefix_rows = 0;
      for (std::size_t i = 0; i < ch.tokens.size(); ++i)
        for (const Range& r : owned)
          if (std::max(r.begin, ch.tokens[i].begin) < std::min(r.end, ch.tokens[i].end)) {
            prefix_rows += ch.prefix[i].size();
            break;
          }
      peak = std::max(peak, rows_bytes(shape, l.q.tokens) + kv_bytes(shape, prefix_rows));
    }
    for (int c = nc - 1; c >= 0; --c) {
      Tensors<double>& l = local[static_cast<std::size_t>(c)];
      chunked.backward(c, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view(), l.dout.view(), l.dq.view(),
                       l.dk.view(), l.dv.view());
    }
    const std::lock_guard lock(mu);
    const auto r = static_cast<std::size_t>(transport.rank());
    carry_rows[r] = chunked.carry_rows();
    chunked_bytes[r] = peak + kv_bytes(shape, chunked.carry_rows());
    whole_bytes[r] = rows_bytes(shape, whole_rows);
    for (int c = 0; c < nc; ++c) {
      const Tensors<double>& l = local[static_cast<std::size_t>(c)];
      const std::span<const Range> rows(chunked.owned_global(c));
      for (auto [from, to] : {std::pair{&l.o, &io.o}, {&l.dq, &io.dq}, {&l.dk, &io.dk}, {&l.dv, &io.dv}})
        train::unshard_rows(rows, from->view(), to->view());
      train::unshard_rows(rows, l.lse.view(), io.lse.view());
    }
  });

  std::printf(
      "attention working set per rank, KiB (rows of Q, K, V, O, dO, dQ, dK, dV, LSE; chunked: of the\n"
      "largest chunk, plus its gathered prefix K/V and their gradients, plus the carry):\n");
  std::printf("%5s %12s %12s %12s\n", "rank", "unchunked", "chunked", "carry rows");
  for (int r = 0; r < kRanks; ++r)
    std::printf("%5d %12.1f %12.1f %12lld\n", r, whole_bytes[static_cast<std::size_t>(r)] / 1024,
                chunked_bytes[static_cast<std::size_t>(r)] / 1024,
                static_cast<long long>(carry_rows[static_cast<std::size_t>(r)]));
  const double whole_peak = *std::max_element(whole_bytes.begin(), whole_bytes.end());
  const double chunk_peak = *std::max_element(chunked_bytes.begin(), chunked_bytes.end());
  std::printf("peak over ranks: unchunked %.1f KiB, chunked %.1f KiB (%.2fx less)\n", whole_peak / 1024,
              chunk_peak / 1024, whole_peak / chunk_peak);

  const double err = std::max({max_rel(io.o.storage, ref.o.storage), max_rel(io.lse.storage, ref.lse.storage),
                               max_rel(io.dq.storage, ref.dq.storage), max_rel(io.dk.storage, ref.dk.storage),
                               max_rel(io.dv.storage, ref.dv.storage)});
  std::printf(
      "error vs fp64 reference on the whole batch, max over O, LSE, dQ, dK, dV of max |err| / max |ref|: %.2e\n", err);
  const bool ok = err <= 1e-9;
  std::printf("%s\n", ok ? "OK" : "FAILED: error above 1e-9");
  return ok ? 0 : 1;
}
