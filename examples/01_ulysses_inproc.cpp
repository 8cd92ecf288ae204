// SPDX-License-Identifier: Apache-2.0
// 01: DeepSpeed-Ulysses over 8 in-process ranks on a packed long-context batch.
//
// Two sequences of 16K tokens, each packed with documents of lognormal lengths (no attention across
// documents). Every rank holds 1/8 of the tokens; an all-to-all turns that into 1/8 of the heads over
// all tokens, the CPU flash kernel runs, and O/LSE come back to the token owners. The result is
// checked against the fp64 reference on sampled query rows (the full reference would take minutes).
//   usage: 01_ulysses_inproc [--smoke] [--ranks N] [--tokens T] [--threads K]
#include "example_support.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <random>
#include <string>
#include <vector>

using namespace seqpar;
using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;

int main(int argc, char** argv) {
  int ranks = 8, kernel_threads = 1;
  std::int64_t tokens = 16384;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--smoke")
      tokens = 2048;
    else if (a == "--ranks" && i + 1 < argc)
      ranks = std::stoi(argv[++i]);
    else if (a == "--tokens" && i + 1 < argc)
      tokens = std::stoll(argv[++i]);
    else if (a == "--threads" && i + 1 < argc)
      kernel_threads = std::stoi(argv[++i]);
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }

  // The packed batch: lognormal document lengths (median 1K tokens), fixed seed.
  std::mt19937 rng(2026);
  const DocumentBatch batch(examples::lognormal_sequences(rng, 2, tokens, 1024.0));
  const AttentionShape shape{16, 4, 64};  // GQA 16:4, head_dim 64
  const std::int64_t n = batch.total_tokens();

  ThdTensor<float> q(n, shape.heads_q, shape.head_dim), k(n, shape.heads_kv, shape.head_dim),
      v(n, shape.heads_kv, shape.head_dim), o(n, shape.heads_q, shape.head_dim);
  LseTensor<float> lse(shape.heads_q, n);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (auto* t : {&q, &k, &v})
    for (auto& x : t->storage) x = normal(rng);

  std::printf(
      "seqpar 01: Ulysses on %d in-process ranks, %d sequences x %lld tokens, %zu documents, "
      "heads %d:%d, d %d\n",
      ranks, batch.num_sequences(), static_cast<long long>(tokens), batch.documents().size(), shape.heads_q,
      shape.heads_kv, shape.head_dim);
  std::printf("%6s %10s %14s %14s\n", "rank", "tokens", "bytes sent", "forward ms");

  std::mutex mu;
  double slowest_ms = 0;
  std::uint64_t total_bytes = 0;
  const auto t0 = std::chrono::steady_clock::now();
  backend::inproc::World(ranks).run([&](auto& transport) {
    DistributedAttention<Ulysses, attention::CpuFlash<float>> attn(
        transport, shape, {}, attention::CpuFlash<float>({.threads = kernel_threads}));
    const auto& owned = attn.owned_ranges(batch);  // Uniform: one contiguous range per rank
    const Range mine = owned.front();
    const auto local = [&](auto& t) { return t.view().tokens_slice(mine.begin, mine.size()); };
    const auto lse_local = lse.view().tokens_slice(mine.begin, mine.size());
    const auto start = std::chrono::steady_clock::now();
    attn.forward(batch, local(q), local(k), local(v), local(o), lse_local);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    std::lock_guard lock(mu);
    std::printf("%6d %10lld %14llu %14.1f\n", transport.rank(), static_cast<long long>(mine.size()),
                static_cast<unsigned long long>(attn.last_bytes_sent()), ms);
    slowest_ms = std::max(slowest_ms, ms);
    total_bytes += attn.last_bytes_sent();
  });
  const double wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();

  // fp64 reference on 256 sampled query rows (every head): one slice per row over its document prefix.
  std::vector<AttnSlice> sampled;
  std::uniform_int_distribution<std::int64_t> pick(0, n - 1);
  std::vector<std::int64_t> rows;
  for (int i = 0; i < 256; ++i) rows.push_back(pick(rng));
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  for (std::int64_t row : rows)
    for (const Document& d : batch.documents())
      if (d.tokens.contains(row))
        sampled.push_back({{row, row + 1}, {d.tokens.begin, row + 1}, Mask::causal(row - d.tokens.begin)});
  ThdTensor<double> qd(n, shape.heads_q, shape.head_dim), kd(n, shape.heads_kv, shape.head_dim),
      vd(n, shape.heads_kv, shape.head_dim), od(n, shape.heads_q, shape.head_dim);
  LseTensor<double> lsed(shape.heads_q, n);
  std::copy(q.storage.begin(), q.storage.end(), qd.storage.begin());
  std::copy(k.storage.begin(), k.storage.end(), kd.storage.begin());
  std::copy(v.storage.begin(), v.storage.end(), vd.storage.begin());
  attention::Reference<double>{}.forward(shape, qd.view(), kd.view(), vd.view(), sampled, od.view(), lsed.view());
  double err_o = 0, err_lse = 0, scale = 0;
  for (std::int64_t row : rows)
    for (int h = 0; h < shape.heads_q; ++h) {
      for (int x = 0; x < shape.head_dim; ++x) {
        scale = std::max(scale, std::abs(od.view()(row, h, x)));
        err_o = std::max(err_o, std::abs(od.view()(row, h, x) - double(o.view()(row, h, x))));
      }
      err_lse = std::max(err_lse, std::abs(lsed.view()(h, row) - double(lse.view()(h, row))) /
                                      std::max(1.0, std::abs(lsed.view()(h, row))));
    }
  const double rel_o = err_o / scale;
  // fp32 storage and accumulation: 1e-5 relative to the output scale (research: TE uses this for fp32).
  const bool ok = rel_o < 1e-5 && err_lse < 1e-5;
  std::printf("bytes sent, all ranks: %.2f MiB; slowest rank forward %.1f ms; world wall time %.1f ms\n",
              static_cast<double>(total_bytes) / (1 << 20), slowest_ms, wall_ms);
  std::printf("max error vs fp64 reference on %zu sampled rows: O %.2e (relative to max |O|), LSE %.2e\n", rows.size(),
              rel_o, err_lse);
  std::printf("%s\n", ok ? "OK" : "FAILED: error above tolerance 1e-5");
  return ok ? 0 : 1;
}
