// SPDX-License-Identifier: Apache-2.0
// Adversarial tests' driver: an in-process world that records each rank's error and how long the
// world took, and a run of any strategy over global tensors the test fills (NaN, Inf, ...) that
// returns the gathered global results.
#pragma once

#include <seqpar/seqpar.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace seqpar::test {

struct WorldOutcome {
  std::vector<std::string> errors;  ///< each rank's what() ("" if it returned)
  std::vector<int> codes;           ///< each rank's seqpar::Errc (0: none or not a seqpar::Error)
  std::vector<bool> invalid;        ///< each rank threw std::invalid_argument
  std::string root;                 ///< what World::run rethrew
  std::chrono::steady_clock::duration took{};
};

/// Runs body(rank, transport) on n in-process ranks with the given timeout.
template <class Body>
WorldOutcome run_world(int n, Body body, std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  WorldOutcome out;
  out.errors.resize(static_cast<std::size_t>(n));
  out.codes.resize(static_cast<std::size_t>(n));
  out.invalid.resize(static_cast<std::size_t>(n));
  std::mutex mu;
  const auto start = std::chrono::steady_clock::now();
  try {
    backend::inproc::World(n, {.timeout = timeout}).run([&](backend::inproc::Transport& t) {
      const auto r = static_cast<std::size_t>(t.rank());
      try {
        body(t.rank(), t);
      } catch (const Error& e) {
        std::lock_guard lock(mu);
        out.errors[r] = e.what();
        out.codes[r] = static_cast<int>(e.errc());
        throw;
      } catch (const std::invalid_argument& e) {
        std::lock_guard lock(mu);
        out.errors[r] = e.what();
        out.invalid[r] = true;
        throw;
      } catch (const std::exception& e) {
        std::lock_guard lock(mu);
        out.errors[r] = e.what();
        throw;
      }
    });
  } catch (const std::exception& e) {
    out.root = e.what();
  }
  out.took = std::chrono::steady_clock::now() - start;
  return out;
}

inline bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

/// Global (unsharded) tensors of one forward + backward.
struct Global {
  ThdTensor<double> q, k, v, dout, o, dq, dk, dv;
  LseTensor<double> lse;
  Global(std::int64_t n, const AttentionShape& s)
      : q(n, s.heads_q, s.head_dim),
        k(n, s.heads_kv, s.head_dim),
        v(n, s.heads_kv, s.head_dim),
        dout(n, s.heads_q, s.head_dim),
        o(n, s.heads_q, s.head_dim),
        dq(n, s.heads_q, s.head_dim),
        dk(n, s.heads_kv, s.head_dim),
        dv(n, s.heads_kv, s.head_dim),
        lse(s.heads_q, n) {}
};

using Factory =
    std::function<std::unique_ptr<runtime::AttentionEngine<attention::Reference<double>>>(backend::inproc::Transport&)>;

/// The fp64 reference over the whole batch: fills g.o, g.lse, g.dq, g.dk, g.dv from g.q, g.k, g.v, g.dout.
inline void reference(const DocumentBatch& batch, const AttentionShape& shape, Global& g) {
  const attention::Reference<double> ref;
  const auto slices = batch.document_causal_slices();
  ref.forward(shape, g.q.view(), g.k.view(), g.v.view(), slices, g.o.view(), g.lse.view());
  ref.backward(shape, g.q.view(), g.k.view(), g.v.view(), g.o.view(), g.lse.view(), g.dout.view(), slices, g.dq.view(),
               g.dk.view(), g.dv.view());
}

/// Runs the attention `make` builds on `world` ranks over g's inputs; fills g's outputs from the ranks.
inline void distributed(const DocumentBatch& batch, const AttentionShape& shape, int world, const Factory& make,
                        Global& g) {
  std::mutex mu;
  backend::inproc::World(world).run([&](backend::inproc::Transport& t) {
    const auto attn = make(t);
    const auto& owned = attn->owned_ranges(batch);
    const std::int64_t n = attn->local_tokens(batch);
    // Moves rows between the global tensor and the local shard (the owned ranges, in order).
    const auto copy = [&](ThdTensor<double>& global, ThdTensor<double>& local, bool to_local) {
      std::int64_t row = 0;
      for (const Range& r : owned)
        for (std::int64_t tok = r.begin; tok < r.end; ++tok, ++row)
          for (int h = 0; h < global.heads; ++h)
            for (int x = 0; x < global.head_dim; ++x)
              (to_local ? local.view()(row, h, x) : global.view()(tok, h, x)) =
                  to_local ? global.view()(tok, h, x) : local.view()(row, h, x);
    };
    ThdTensor<double> q(n, shape.heads_q, shape.head_dim), k(n, shape.heads_kv, shape.head_dim),
        v(n, shape.heads_kv, shape.head_dim), dout(n, shape.heads_q, shape.head_dim),
        o(n, shape.heads_q, shape.head_dim), dq(n, shape.heads_q, shape.head_dim),
        dk(n, shape.heads_kv, shape.head_dim), dv(n, shape.heads_kv, shape.head_dim);
    LseTensor<double> lse(shape.heads_q, n);
    copy(g.q, q, true), copy(g.k, k, true), copy(g.v, v, true), copy(g.dout, dout, true);
    attn->forward(batch, q.view(), k.view(), v.view(), o.view(), lse.view());
    attn->backward(batch, q.view(), k.view(), v.view(), o.view(), lse.view(), dout.view(), dq.view(), dk.view(),
                   dv.view());
    std::lock_guard lock(mu);
    copy(g.o, o, false), copy(g.dq, dq, false), copy(g.dk, dk, false), copy(g.dv, dv, false);
    std::int64_t row = 0;
    for (const Range& r : owned)
      for (std::int64_t tok = r.begin; tok < r.end; ++tok, ++row)
        for (int h = 0; h < shape.heads_q; ++h) g.lse.view()(h, tok) = lse.view()(h, row);
  });
}

template <class StrategyT>
Factory factory(const AttentionShape& shape, typename StrategyT::Arguments args = {}) {
  return [shape, args](backend::inproc::Transport& t) {
    return std::unique_ptr<runtime::AttentionEngine<attention::Reference<double>>>(
        std::make_unique<DistributedAttention<StrategyT, attention::Reference<double>>>(t, shape, args));
  };
}

}  // namespace seqpar::test
