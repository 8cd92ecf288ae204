// SPDX-License-Identifier: Apache-2.0
#include <doctest/doctest.h>

#include "support/expect_error.hpp"
#include "train/plans.hpp"

#include <seqpar/train/shard.hpp>

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

using namespace seqpar;

namespace {

// Values that name their element: token t, head h, lane x -> t * 100 + h * 10 + x (exact in float).
ThdTensor<double> coded(std::int64_t n, int heads, int dim) {
  ThdTensor<double> g(n, heads, dim);
  for (std::int64_t t = 0; t < n; ++t)
    for (int h = 0; h < heads; ++h)
      for (int x = 0; x < dim; ++x) g.view()(t, h, x) = double(t * 100 + h * 10 + x);
  return g;
}

// The global tokens of rank r's local rows, in order (the plan's owned ranges, concatenated).
std::vector<std::int64_t> tokens_of(const ShardPlan& plan, int r) {
  std::vector<std::int64_t> out;
  for (const Range& g : plan.owned[std::size_t(r)])
    for (std::int64_t t = g.begin; t < g.end; ++t) out.push_back(t);
  return out;
}

}  // namespace

TEST_SUITE("train") {
  TEST_CASE("shard and unshard_local round-trip every partitioner on 1-8 ranks (fp64 <-> fp32, strided heads)") {
    int plans = 0;
    test::for_each_plan([&](const std::string& name, const DocumentBatch& batch, const ShardPlan& plan) {
      INFO(name);
      ++plans;
      const std::int64_t n = batch.total_tokens();
      const ThdTensor<double> g = coded(n, 3, 4);
      ThdTensor<double> back(n, 2, 4);  // heads 1..2 of g come back here
      std::vector<int> seen(std::size_t(n), 0);
      for (int r = 0; r < plan.world_size(); ++r) {
        const auto tokens = tokens_of(plan, r);
        ThdTensor<float> l(plan.local_tokens(r), 2, 4);
        train::shard(plan, r, g.view().heads_slice(1, 2), l.view());  // strided global, converting
        bool rows_ok = true;
        for (std::size_t i = 0; i < tokens.size(); ++i) {
          ++seen[std::size_t(tokens[i])];
          for (int h = 0; h < 2; ++h)
            for (int x = 0; x < 4; ++x)
              rows_ok = rows_ok && l.view()(std::int64_t(i), h, x) == float(tokens[i] * 100 + (h + 1) * 10 + x);
        }
        CHECK(rows_ok);
        train::unshard_local(plan, r, l.view(), back.view());
      }
      CHECK(std::all_of(seen.begin(), seen.end(), [](int s) { return s == 1; }));
      bool back_ok = true;
      for (std::int64_t t = 0; t < n; ++t)
        for (int h = 0; h < 2; ++h)
          for (int x = 0; x < 4; ++x) back_ok = back_ok && back.view()(t, h, x) == g.view()(t, h + 1, x);
      CHECK(back_ok);
    });
    CHECK(plans > 150);  // every partitioner, most batches and world sizes
  }

  TEST_CASE("unshard gathers THD, LSE and per-token values on every rank over the in-process transport") {
    test::for_each_plan([&](const std::string& name, const DocumentBatch& batch, const ShardPlan& plan) {
      INFO(name);
      const std::int64_t n = batch.total_tokens();
      const ThdTensor<double> g64 = coded(n, 3, 5);
      ThdTensor<float> g(n, 3, 5);
      std::copy(g64.storage.begin(), g64.storage.end(), g.storage.begin());
      LseTensor<float> lse(3, n);
      for (int h = 0; h < 3; ++h)
        for (std::int64_t t = 0; t < n; ++t) lse.view()(h, t) = float(h * 1000 + t);
      std::vector<std::int32_t> ids(static_cast<std::size_t>(n));
      for (std::int64_t t = 0; t < n; ++t) ids[std::size_t(t)] = std::int32_t(7 * t + 3);
      std::atomic<int> bad{0};
      backend::inproc::World(plan.world_size()).run([&](backend::inproc::Transport& t) {
        const int r = t.rank();
        const std::int64_t local = plan.local_tokens(r);
        // THD: a local view with padding between tokens (heads 0..2 of a 4-head buffer).
        ThdTensor<float> padded(local, 4, 5);
        const ThdView<float> l = padded.view().heads_slice(0, 3);
        train::shard(plan, r, g.view(), l);
        ThdTensor<float> got(n, 3, 5);
        train::unshard(t, plan, ThdView<const float>(l), got.view());
        if (got.storage != g.storage) ++bad;
        // LSE (heads, tokens).
        LseTensor<float> llse(3, local), glse(3, n);
        train::shard(plan, r, lse.view(), llse.view());
        train::unshard(t, plan, std::as_const(llse).view(), glse.view());
        if (glse.storage != lse.storage) ++bad;
        // One value per token.
        std::vector<std::int32_t> lids(static_cast<std::size_t>(local)), gids(static_cast<std::size_t>(n));
        train::shard(plan, r, std::span<const std::int32_t>(ids), std::span(lids));
        train::unshard(t, plan, std::span<const std::int32_t>(lids), std::span(gids));
        if (gids != ids) ++bad;
      });
      CHECK(bad == 0);
    });
  }

  TEST_CASE("shard and unshard reject views and transports that do not fit the plan") {
    const DocumentBatch batch({{10, 6}});
    const ShardPlan plan = partition::Zigzag{}.plan(batch, Topology{2, 2});
    ThdTensor<float> g(16, 2, 4), l(plan.local_tokens(0), 2, 4), wrong(plan.local_tokens(0) + 1, 2, 4);
    ThdTensor<float> heads3(plan.local_tokens(0), 3, 4);
    CHECK(test::invalid_message([&] {
            train::shard(plan, 0, g.view(), wrong.view());
          }).find("train::shard: local.tokens = 9") != std::string::npos);
    CHECK(test::invalid_message([&] { train::shard(plan, 0, g.view(), heads3.view()); }).find("heads") !=
          std::string::npos);
    CHECK(test::invalid_message([&] {
            train::shard(plan, 2, g.view(), l.view());
          }).find("train::shard: rank = 2: must be in [0, 2)") != std::string::npos);
    CHECK(test::invalid_message([&] { train::unshard_local(plan, -1, l.view(), g.view()); }).find("rank = -1") !=
          std::string::npos);
    ThdTensor<float> short_global(15, 2, 4);
    CHECK(test::invalid_message([&] {
            train::shard(plan, 0, short_global.view(), l.view());
          }).find("global.tokens = 15") != std::string::npos);
    std::string message;
    backend::inproc::World(3).run([&](backend::inproc::Transport& t) {
      const std::string m = test::invalid_message([&] { train::unshard(t, plan, std::as_const(l).view(), g.view()); });
      if (t.rank() == 0) message = m;
    });
    CHECK(message.find("train::unshard: transport.size() = 3: must equal the plan's world size 2") !=
          std::string::npos);
  }
}
