// SPDX-License-Identifier: Apache-2.0
// plan_ahead: a fresh batch planned on a background thread while the rank does other work; the first
// call with it uses that plan (bit-identical results to planning at the call), a refused batch raises at
// the call as a miss would, and an engine destroyed with a plan still running waits for it.
#include <doctest/doctest.h>

#include <seqpar/plan/selected_attention.hpp>
#include <seqpar/seqpar.hpp>

#include <cmath>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

using namespace seqpar;

namespace {

// O of a forward over rows filled from their global token index (the same rows whatever the plan).
template <class Engine>
std::vector<double> forward(Engine& attn, const DocumentBatch& batch, const AttentionShape& shape) {
  const std::int64_t n = attn.local_tokens(batch);
  const auto wq = static_cast<std::size_t>(shape.heads_q * shape.head_dim);
  const auto wk = static_cast<std::size_t>(shape.heads_kv * shape.head_dim);
  ThdTensor<double> q(n, shape.heads_q, shape.head_dim), kv(n, shape.heads_kv, shape.head_dim),
      o(n, shape.heads_q, shape.head_dim);
  LseTensor<double> lse(shape.heads_q, n);
  std::size_t at = 0;
  for (const Range& r : attn.owned_ranges(batch))
    for (std::int64_t t = r.begin; t < r.end; ++t, ++at) {
      for (std::size_t x = 0; x < wq; ++x) q.storage[at * wq + x] = std::sin(0.37 * double(t) + 0.11 * double(x));
      for (std::size_t x = 0; x < wk; ++x) kv.storage[at * wk + x] = std::cos(0.23 * double(t) + 0.07 * double(x));
    }
  attn.forward(batch, q.view(), kv.view(), kv.view(), o.view(), lse.view());
  return o.storage;
}

using Kernel = attention::Reference<double>;
using HybridRing = Strategy<partition::Hybrid, comm::Ring>;

}  // namespace

TEST_SUITE("runtime") {
  TEST_CASE("plan_ahead: the next batch planned in the background gives the same bits as planning at the call") {
    const AttentionShape shape{4, 2, 8};
    const DocumentBatch now({{40, 3, 17}, {25, 25}}), next({{7, 60, 1, 9}, {31}});
    HybridRing::Arguments args;
    args.comm.sharding_aware = true;
    std::mutex mu;
    std::vector<std::vector<double>> ahead(4), at_call(4);
    backend::inproc::World(4).run([&](backend::inproc::Transport& t) {
      DistributedAttention<HybridRing, Kernel> attn(t, shape, args), plain(t, shape, args);
      (void)forward(attn, now, shape);
      CHECK_FALSE(attn.planning_ahead(next));
      attn.plan_ahead(next);
      CHECK(attn.planning_ahead(next));
      attn.plan_ahead(next);  // already under way: left alone
      CHECK(attn.planning_ahead(next));
      attn.plan_ahead(now);  // already cached: nothing to do, next stays planned ahead
      CHECK(attn.planning_ahead(next));
      CHECK(attn.cache_sizes().batches == 1);
      (void)forward(attn, now, shape);  // the current step goes on while next is planned
      std::vector<double> o = forward(attn, next, shape);
      CHECK_FALSE(attn.planning_ahead(next));  // used
      CHECK(attn.cache_sizes().batches == 2);
      std::vector<double> p = forward(plain, next, shape);
      const std::lock_guard lock(mu);
      ahead[static_cast<std::size_t>(t.rank())] = std::move(o);
      at_call[static_cast<std::size_t>(t.rank())] = std::move(p);
    });
    for (std::size_t r = 0; r < 4; ++r) CHECK(ahead[r] == at_call[r]);
  }

  TEST_CASE("plan_ahead: a second batch replaces the first; a refused batch raises at the call that uses it") {
    const AttentionShape shape{2, 2, 4};  // AllToAll over 4 ranks needs 4 query heads: refused
    const DocumentBatch a({{12, 5}}), b({{9, 9, 2}});
    std::mutex mu;
    std::vector<std::string> errors;
    backend::inproc::World(4).run([&](backend::inproc::Transport& t) {
      DistributedAttention<Strategy<partition::Uniform, comm::AllToAll>, Kernel> attn(t, shape);
      attn.plan_ahead(a);
      attn.plan_ahead(b);  // waits for a's planning and drops it
      CHECK_FALSE(attn.planning_ahead(a));
      CHECK(attn.planning_ahead(b));
      // The communicator's refusal of b surfaces at the call that uses it, as it would on a miss (the
      // placement itself is fine: the rows are known).
      AttentionTensors<double> x(attn.local_tokens(b), shape);
      try {
        attn.forward(b, x.q.view(), x.k.view(), x.v.view(), x.o.view(), x.lse.view());
      } catch (const std::invalid_argument& e) {
        const std::lock_guard lock(mu);
        errors.push_back(e.what());
      }
      CHECK_FALSE(attn.planning_ahead(b));
      attn.plan_ahead(a);  // an engine destroyed with a plan under way waits for it
    });
    REQUIRE(errors.size() == 4);
    for (const std::string& e : errors) CHECK(e.find("heads_q") != std::string::npos);
  }

  TEST_CASE("plan_ahead through SelectedAttention: the choice made in the background is the choice used") {
    using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
    using Selected = plan::SelectedAttention<Kernel, Ulysses, HybridRing>;
    const AttentionShape shape{8, 2, 8};
    const DocumentBatch next({{300, 4, 4, 4}, {64, 200}});
    Selected::Arguments args;
    args.names = {"ulysses", "hybrid"};
    std::get<1>(args.strategies).comm.sharding_aware = true;
    args.simulation.hardware = replay::profiles::h100_sxm();
    std::mutex mu;
    std::vector<std::string> chosen_ahead, chosen_at_call;
    backend::inproc::World(4).run([&](backend::inproc::Transport& t) {
      Selected attn(t, shape, args), plain(t, shape, args);
      attn.plan_ahead(next);
      (void)forward(attn, next, shape);
      (void)forward(plain, next, shape);
      const std::lock_guard lock(mu);
      chosen_ahead.push_back(attn.choice(next).name);
      chosen_at_call.push_back(plain.choice(next).name);
    });
    CHECK(chosen_ahead == chosen_at_call);
  }
}
