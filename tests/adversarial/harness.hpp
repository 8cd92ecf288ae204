// SPDX-License-Identifier: Apache-2.0
// Adversarial tests' driver: an in-process world that records each rank's error and how long the
// world took, and a run of any strategy over global tensors the test fills (NaN, Inf, ...) that
// returns the gathered global results.
#pragma once

#include <seqpar/seqpar.hpp>
#include <seqpar/train/shard.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
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
using Global = AttentionTensors<double>;

/// Builds one rank's attention engine over `Kernel` (the fp64 reference unless a test names another).
template <class Kernel = attention::Reference<double>>
using FactoryOf = std::function<std::unique_ptr<runtime::AttentionEngine<Kernel>>(backend::inproc::Transport&)>;
using Factory = FactoryOf<>;

/// The fp64 reference over the whole batch: fills g.o, g.lse, g.dq, g.dk, g.dv from g.q, g.k, g.v, g.dout.
inline void reference(const DocumentBatch& batch, const AttentionShape& shape, Global& g) {
  const attention::Reference<double> ref;
  const auto slices = batch.document_causal_slices();
  ref.forward(shape, g.q.view(), g.k.view(), g.v.view(), slices, g.o.view(), g.lse.view());
  ref.backward(shape, g.q.view(), g.k.view(), g.v.view(), g.o.view(), g.lse.view(), g.dout.view(), slices, g.dq.view(),
               g.dk.view(), g.dv.view());
}

/// Runs the attention `make` builds on `world` ranks over g's inputs; fills g's outputs from the ranks.
template <class Kernel>
void distributed(const DocumentBatch& batch, const AttentionShape& shape, int world, const FactoryOf<Kernel>& make,
                 Global& g) {
  std::mutex mu;
  backend::inproc::World(world).run([&](backend::inproc::Transport& t) {
    const auto attn = make(t);
    const ShardPlan& plan = attn->plan(batch);
    const int rank = t.rank();
    Global l(attn->local_tokens(batch), shape);  // this rank's rows, in plan order
    train::shard(plan, rank, g.q.view(), l.q.view()), train::shard(plan, rank, g.k.view(), l.k.view());
    train::shard(plan, rank, g.v.view(), l.v.view()), train::shard(plan, rank, g.dout.view(), l.dout.view());
    attn->forward(batch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view());
    attn->backward(batch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view(), l.dout.view(), l.dq.view(),
                   l.dk.view(), l.dv.view());
    std::lock_guard lock(mu);  // ranks own disjoint tokens, so they write disjoint rows
    for (auto [from, to] : {std::pair{&l.o, &g.o}, {&l.dq, &g.dq}, {&l.dk, &g.dk}, {&l.dv, &g.dv}})
      train::unshard_local(plan, rank, from->view(), to->view());
    train::unshard_local(plan, rank, l.lse.view(), g.lse.view());
  });
}

template <class StrategyT, class Kernel = attention::Reference<double>>
FactoryOf<Kernel> factory(const AttentionShape& shape, typename StrategyT::Arguments args = {}) {
  return [shape, args](backend::inproc::Transport& t) {
    return std::unique_ptr<runtime::AttentionEngine<Kernel>>(
        std::make_unique<DistributedAttention<StrategyT, Kernel>>(t, shape, args));
  };
}

}  // namespace seqpar::test
