// SPDX-License-Identifier: Apache-2.0
// Shared test driver: runs a strategy on an in-process world and compares forward and backward with
// the fp64 reference over the whole, unsharded batch.
#pragma once

#include <seqpar/seqpar.hpp>
#include <seqpar/train/shard.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <vector>

namespace seqpar::test {

/// Random document lengths: lognormal around `median`, clipped to [1, remaining], summing to `tokens`.
inline std::vector<std::int64_t> lognormal_docs(std::int64_t tokens, double median, double sigma, std::mt19937& rng) {
  std::lognormal_distribution<double> dist(std::log(median), sigma);
  std::vector<std::int64_t> docs;
  std::int64_t left = tokens;
  while (left > 0) {
    const auto len = std::clamp<std::int64_t>(static_cast<std::int64_t>(dist(rng)), 1, left);
    docs.push_back(len);
    left -= len;
  }
  return docs;
}

/// B sequences of `tokens` each, with lognormal documents.
inline DocumentBatch random_batch(int sequences, std::int64_t tokens, double median, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<std::int64_t>> seqs;
  for (int b = 0; b < sequences; ++b) seqs.push_back(lognormal_docs(tokens, median, 1.0, rng));
  return DocumentBatch(seqs);
}

struct Errors {
  double o = 0, lse = 0, dq = 0, dk = 0, dv = 0;        ///< max abs error / max abs reference value
  bool bytes_match = true;                              ///< every rank: declared bytes == counted bytes
  std::uint64_t bytes_forward = 0, bytes_backward = 0;  ///< summed over ranks
  [[nodiscard]] double max() const { return std::max({o, lse, dq, dk, dv}); }
};

/// Makes a rank's DistributedAttention (any strategy) on its transport.
template <class Kernel>
using AttentionFactory = std::function<std::unique_ptr<runtime::AttentionEngine<Kernel>>(backend::inproc::Transport&)>;

/// Runs the attention `make` builds on `world` in-process ranks and returns the errors against the
/// reference. Strategy-independent (instantiated once per kernel, which keeps the tests quick to build).
template <class Kernel>
Errors check_attention(const DocumentBatch& batch, const AttentionShape& shape, int world,
                       const AttentionFactory<Kernel>& make, std::uint32_t seed) {
  using T = typename Kernel::value_type;
  using A = typename Kernel::accum_type;
  const std::int64_t n = batch.total_tokens();
  const int d = shape.head_dim;
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  const auto fill = [&](ThdTensor<double>& t) {
    for (auto& x : t.storage) x = static_cast<double>(static_cast<T>(normal(rng)));  // representable in T
  };
  ThdTensor<double> q(n, shape.heads_q, d), k(n, shape.heads_kv, d), v(n, shape.heads_kv, d), dout(n, shape.heads_q, d);
  fill(q), fill(k), fill(v), fill(dout);
  ThdTensor<double> o_ref(n, shape.heads_q, d), dq_ref(n, shape.heads_q, d), dk_ref(n, shape.heads_kv, d),
      dv_ref(n, shape.heads_kv, d);
  LseTensor<double> lse_ref(shape.heads_q, n);
  const attention::Reference<double> ref;
  const auto slices = batch.document_causal_slices();
  ref.forward(shape, q.view(), k.view(), v.view(), slices, o_ref.view(), lse_ref.view());
  ref.backward(shape, q.view(), k.view(), v.view(), o_ref.view(), lse_ref.view(), dout.view(), slices, dq_ref.view(),
               dk_ref.view(), dv_ref.view());

  ThdTensor<double> o_got(n, shape.heads_q, d), dq_got(n, shape.heads_q, d), dk_got(n, shape.heads_kv, d),
      dv_got(n, shape.heads_kv, d);
  LseTensor<double> lse_got(shape.heads_q, n);
  Errors err;
  std::mutex mu;
  backend::inproc::World(world).run([&](backend::inproc::Transport& transport) {
    const std::unique_ptr<runtime::AttentionEngine<Kernel>> owner = make(transport);
    runtime::AttentionEngine<Kernel>& attn = *owner;
    const ShardPlan& plan = attn.plan(batch);
    const int rank = transport.rank();
    const std::int64_t local = attn.local_tokens(batch);
    // Local shards: the owned rows, in plan order, converted to the kernel's type.
    const auto gather = [&](const ThdTensor<double>& g) {
      ThdTensor<T> l(local, g.heads, d);
      train::shard(plan, rank, g.view(), l.view());
      return l;
    };
    const auto scatter = [&](const ThdTensor<T>& l, ThdTensor<double>& g) {
      train::unshard_local(plan, rank, l.view(), g.view());
    };
    auto lq = gather(q), lk = gather(k), lv = gather(v), ldo = gather(dout);
    ThdTensor<T> lo(local, shape.heads_q, d), ldq(local, shape.heads_q, d), ldk(local, shape.heads_kv, d),
        ldv(local, shape.heads_kv, d);
    LseTensor<A> llse(shape.heads_q, local);
    attn.forward(batch, lq.view(), lk.view(), lv.view(), lo.view(), llse.view());
    const auto& prog = attn.program(batch);
    // Declared bytes (total and per destination) must equal what the transport counted.
    const auto per_peer_total = [&](const comm::Program& p) {
      std::uint64_t sum = 0;
      for (std::uint64_t b : p.bytes_to(world, sizeof(T), sizeof(A))) sum += b;
      return sum;
    };
    const bool fwd_ok = attn.last_bytes_sent() == prog.forward.bytes_sent(sizeof(T), sizeof(A)) &&
                        per_peer_total(prog.forward) == attn.last_bytes_sent();
    const std::uint64_t fwd_bytes = attn.last_bytes_sent();
    attn.backward(batch, lq.view(), lk.view(), lv.view(), lo.view(), llse.view(), ldo.view(), ldq.view(), ldk.view(),
                  ldv.view());
    const bool bwd_ok = attn.last_bytes_sent() == prog.backward.bytes_sent(sizeof(T), sizeof(A)) &&
                        per_peer_total(prog.backward) == attn.last_bytes_sent();
    std::lock_guard lock(mu);
    err.bytes_match = err.bytes_match && fwd_ok && bwd_ok;
    err.bytes_forward += fwd_bytes;
    err.bytes_backward += attn.last_bytes_sent();
    scatter(lo, o_got), scatter(ldq, dq_got), scatter(ldk, dk_got), scatter(ldv, dv_got);
    train::unshard_local(plan, rank, llse.view(), lse_got.view());
  });
  const auto rel = [](const std::vector<double>& got, const std::vector<double>& want) {
    double scale = 0, e = 0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      scale = std::max(scale, std::abs(want[i]));
      if (std::isinf(want[i]) || std::isinf(got[i])) {
        if (want[i] != got[i]) e = INFINITY;
      } else {
        e = std::max(e, std::abs(got[i] - want[i]));
      }
    }
    return scale > 0 ? e / scale : e;
  };
  err.o = rel(o_got.storage, o_ref.storage);
  err.lse = rel(lse_got.storage, lse_ref.storage);
  err.dq = rel(dq_got.storage, dq_ref.storage);
  err.dk = rel(dk_got.storage, dk_ref.storage);
  err.dv = rel(dv_got.storage, dv_ref.storage);
  return err;
}

/// Runs StrategyT with Kernel on `world` in-process ranks and returns the errors against the reference.
template <class StrategyT, class Kernel>
Errors check_strategy(const DocumentBatch& batch, const AttentionShape& shape, int world,
                      typename StrategyT::Arguments args = {}, Kernel kernel = {}, std::uint32_t seed = 7) {
  return check_attention<Kernel>(
      batch, shape, world,
      [&](backend::inproc::Transport& t) -> std::unique_ptr<runtime::AttentionEngine<Kernel>> {
        return std::make_unique<DistributedAttention<StrategyT, Kernel>>(t, shape, args, kernel);
      },
      seed);
}

}  // namespace seqpar::test
