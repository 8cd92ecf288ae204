// SPDX-License-Identifier: Apache-2.0
// 06: Zigzag ring attention (sharding-aware) across MPI processes.
//
// The same strategy as example 02, over seqpar::backend::mpi::Transport instead of the in-process
// world: one process per rank (mpiexec -n 4 06_mpi_ring). Every rank builds the same batch and
// inputs (fixed seed) and keeps only its shard (its owned token ranges: zigzag chunks r and 2P-1-r);
// the ring passes each peer only the KV rows its slices read. Every rank gathers O from every rank
// (train::unshard: one all_gather_v on the transport); rank 0 compares it with the fp64 reference over
// the whole batch and prints OK. run_or_abort turns an exception on any rank into "seqpar: rank R failed: ..." and
// MPI_Abort, so a failing rank ends the job instead of leaving its peers waiting.
//   usage: mpiexec -n P 06_mpi_ring [--smoke] [--tokens T]
#include <seqpar/backend/mpi.hpp>
#include <seqpar/seqpar.hpp>
#include <seqpar/train/shard.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <utility>
#include <vector>

using namespace seqpar;
using ZigzagRing = Strategy<partition::Zigzag, comm::Ring>;

int main(int argc, char** argv) {
  backend::mpi::Environment env(argc, argv);
  std::int64_t tokens = 4096;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--smoke")
      tokens = 1024;
    else if (a == "--tokens" && i + 1 < argc)
      tokens = std::stoll(argv[++i]);
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  return backend::mpi::run_or_abort(MPI_COMM_WORLD, [&](backend::mpi::Transport& t) {
    // One sequence of lognormal documents (median tokens/16) and random inputs, identical on every rank.
    std::mt19937 rng(2026);
    std::lognormal_distribution<double> doc_len(std::log(double(tokens) / 16), 1.0);
    std::vector<std::int64_t> docs;
    for (std::int64_t left = tokens; left > 0; left -= docs.back())
      docs.push_back(std::clamp<std::int64_t>(std::llround(doc_len(rng)), 1, left));
    const DocumentBatch batch = DocumentBatch::single(docs);
    const AttentionShape shape{8, 2, 64};  // GQA 8:2, head_dim 64
    const std::int64_t n = batch.total_tokens();
    ThdTensor<float> q(n, shape.heads_q, shape.head_dim), k(n, shape.heads_kv, shape.head_dim),
        v(n, shape.heads_kv, shape.head_dim);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (auto* x : {&q, &k, &v})
      for (float& e : x->storage) e = normal(rng);

    ZigzagRing::Arguments args;
    args.comm.sharding_aware = true;  // send each peer only the KV rows its slices read
    DistributedAttention<ZigzagRing, attention::CpuFlash<float>> attn(
        t, shape, args, attention::CpuFlash<float>(attention::CpuFlashArguments{}));
    const auto& plan = attn.plan(batch);
    const auto shard = [&](const ThdTensor<float>& g) {  // (local tokens, heads, d): owned rows in plan order
      ThdTensor<float> l(attn.local_tokens(batch), g.heads, g.head_dim);
      train::shard(batch, plan, t.rank(), g.view(), l.view());  // refuses a plan of another batch
      return l;
    };
    const ThdTensor<float> lq = shard(q), lk = shard(k), lv = shard(v);
    ThdTensor<float> lo(lq.tokens, shape.heads_q, shape.head_dim);
    LseTensor<float> llse(shape.heads_q, lq.tokens);
    attn.forward(batch, lq.view(), lk.view(), lv.view(), lo.view(), llse.view());
    const std::uint64_t sent = attn.last_bytes_sent();

    // Every rank's O back at its tokens (one all_gather_v over the MPI transport).
    ThdTensor<float> o(n, shape.heads_q, shape.head_dim);
    train::unshard(t, batch, plan, std::as_const(lo).view(), o.view());
    std::vector<std::uint64_t> sent_by(static_cast<std::size_t>(t.size()));
    t.all_gather(as_bytes_of(std::span<const std::uint64_t>(&sent, 1)), as_writable_bytes_of(std::span(sent_by)));
    if (t.rank() != 0) return 0;
    ThdTensor<double> dq(n, shape.heads_q, shape.head_dim), dk(n, shape.heads_kv, shape.head_dim),
        dv(n, shape.heads_kv, shape.head_dim), ref(n, shape.heads_q, shape.head_dim);
    std::copy(q.storage.begin(), q.storage.end(), dq.storage.begin());
    std::copy(k.storage.begin(), k.storage.end(), dk.storage.begin());
    std::copy(v.storage.begin(), v.storage.end(), dv.storage.begin());
    LseTensor<double> ref_lse(shape.heads_q, n);
    attention::Reference<double>().forward(shape, dq.view(), dk.view(), dv.view(), batch.document_causal_slices(),
                                           ref.view(), ref_lse.view());
    double err = 0, scale = 0;
    for (std::size_t i = 0; i < ref.storage.size(); ++i) {
      scale = std::max(scale, std::abs(ref.storage[i]));
      err = std::max(err, std::abs(ref.storage[i] - double(o.storage[i])));
    }
    std::printf(
        "seqpar 06: sharding-aware zigzag ring over MPI, %d ranks, %lld tokens, %zu documents, heads %d:%d, "
        "d %d\n",
        t.size(), static_cast<long long>(n), docs.size(), shape.heads_q, shape.heads_kv, shape.head_dim);
    for (int r = 0; r < t.size(); ++r)
      std::printf("  rank %d: %lld tokens, forward sent %llu bytes\n", r, static_cast<long long>(plan.local_tokens(r)),
                  static_cast<unsigned long long>(sent_by[std::size_t(r)]));
    std::printf("O vs fp64 reference: max |err| / max |ref| = %.2e\n", err / scale);
    const bool ok = err / scale < 1e-5;  // fp32 storage and accumulation
    std::printf("%s\n", ok ? "OK" : "FAILED: error above tolerance");
    return ok ? 0 : 1;
  });
}
