// SPDX-License-Identifier: Apache-2.0
// DPP's pipeline scheduling (schedule/pipeline.hpp): the 1F1B order and its memory windows, the
// diagonal-constrained checkpointing (greedy, and GLPK's MILP when built) against a brute-force
// optimum on small instances with every memory constraint checked, and the grouping of sequences
// into pipelines.
#include <doctest/doctest.h>

#include <seqpar/schedule/dynamic_chunk.hpp>
#include <seqpar/schedule/pipeline.hpp>

#include <algorithm>
#include <functional>
#include <numeric>
#include <random>
#include <set>

#if defined(SEQPAR_ENABLE_GLPK)
#include <seqpar/schedule/checkpoint_milp.hpp>
#endif

using namespace seqpar;
using schedule::CheckpointProblem;

namespace {

// The optimum by enumeration of every diagonal vector (small instances only).
schedule::CheckpointPlan brute_force(const CheckpointProblem& prob) {
  const int m = prob.diagonals(), top = prob.model.layers_per_stage;
  std::vector<int> c(static_cast<std::size_t>(m), 0), best;
  long long best_sum = -1;
  const std::function<void(int)> go = [&](int j) {
    if (j == m) {
      const auto plan = schedule::evaluate(prob, c, "brute force");
      if (plan.feasible && (best_sum < 0 || plan.layers_recomputed < best_sum)) {
        best_sum = plan.layers_recomputed;
        best = c;
      }
      return;
    }
    for (int v = 0; v <= top; ++v) {
      c[static_cast<std::size_t>(j)] = v;
      go(j + 1);
    }
  };
  go(0);
  if (best_sum < 0) return schedule::evaluate(prob, std::vector<int>(static_cast<std::size_t>(m), top), "brute force");
  return schedule::evaluate(prob, best, "brute force");
}

CheckpointProblem random_problem(std::mt19937& rng) {
  CheckpointProblem p;
  p.model.stages = 1 + static_cast<int>(rng() % 3);
  const int n = 1 + static_cast<int>(rng() % 6);
  p.model.layers_per_stage = 1 + static_cast<int>(rng() % (n > 4 ? 2 : 3));  // enumeration stays small
  for (int k = 0; k < n; ++k) p.tokens.push_back(1 + static_cast<std::int64_t>(rng() % 100));
  p.model.activation_bytes_per_token = 10;
  p.model.kept_bytes_per_token = 2;
  p.model.static_bytes = 100;
  // Between "nothing fits" and "everything fits".
  const double full = 100 + 10.0 * 100 * p.model.layers_per_stage * p.model.stages;
  p.model.memory_cap = 100 + std::uniform_real_distribution<double>(0.1, 1.0)(rng) * full;
  return p;
}

}  // namespace

TEST_SUITE("schedule") {
  TEST_CASE("1F1B: every chunk forward then backward on every stage, at most d_p - p in flight") {
    for (int stages = 1; stages <= 6; ++stages)
      for (int n = 1; n <= 9; ++n) {
        const auto order = schedule::one_f_one_b(n, stages);
        REQUIRE(order.size() == static_cast<std::size_t>(stages));
        for (int p = 0; p < stages; ++p) {
          const auto& ops = order[static_cast<std::size_t>(p)];
          CHECK(ops.size() == static_cast<std::size_t>(2 * n));
          std::set<int> live;
          int next_f = 0, next_b = 0;
          for (const auto& op : ops) {
            if (op.backward) {
              CHECK(op.chunk == next_b++);
              CHECK(live.erase(op.chunk) == 1);
            } else {
              CHECK(op.chunk == next_f++);
              live.insert(op.chunk);
              CHECK(static_cast<int>(live.size()) <= stages - p);
            }
          }
          CHECK(live.empty());
        }
        for (const auto& w : schedule::memory_windows(n, stages))
          CHECK(static_cast<int>(w.chunks.size()) <= stages - w.stage);
      }
  }

  TEST_CASE("1F1B with a split document's backward last slice first: valid order, windows match a replay") {
    std::mt19937 rng(9);
    for (int trial = 0; trial < 200; ++trial) {
      const int stages = 1 + static_cast<int>(rng() % 5), n = 1 + static_cast<int>(rng() % 9);
      // Chunks [a, b) reversed: a document split into b - a slices.
      std::vector<int> order(static_cast<std::size_t>(n));
      std::iota(order.begin(), order.end(), 0);
      const int a = static_cast<int>(rng() % static_cast<unsigned>(n));
      const int b = a + 1 + static_cast<int>(rng() % static_cast<unsigned>(n - a));
      std::reverse(order.begin() + a, order.begin() + b);
      const auto ops = schedule::one_f_one_b(order, stages);
      std::size_t window = 0;
      const auto windows = schedule::memory_windows(order, stages);
      for (int p = 0; p < stages; ++p) {
        std::set<int> forwarded, live;
        std::size_t next_b = 0;
        int next_f = 0;
        for (const auto& op : ops[static_cast<std::size_t>(p)]) {
          if (op.backward) {
            CHECK(op.chunk == order[next_b++]);
            CHECK(forwarded.count(op.chunk) == 1);  // never before its forward
            live.erase(op.chunk);
          } else {
            CHECK(op.chunk == next_f++);
            forwarded.insert(op.chunk);
            live.insert(op.chunk);
            REQUIRE(window < windows.size());
            CHECK(std::set<int>(windows[window].chunks.begin(), windows[window].chunks.end()) == live);
            ++window;
          }
        }
        CHECK(next_b == order.size());
        CHECK(next_f == n);
      }
    }
  }

  TEST_CASE("checkpointing: the greedy is feasible when the optimum is, never better, and every window fits") {
    std::mt19937 rng(21);
    int feasible = 0, optimal = 0;
    for (int trial = 0; trial < 300; ++trial) {
      const CheckpointProblem prob = random_problem(rng);
      const auto best = brute_force(prob);
      const auto greedy = schedule::solve_checkpointing(prob);
      CHECK(greedy.feasible == best.feasible);
      if (!best.feasible) continue;
      ++feasible;
      CHECK(greedy.layers_recomputed >= best.layers_recomputed);
      optimal += greedy.layers_recomputed == best.layers_recomputed ? 1 : 0;
      for (const auto& w : schedule::memory_windows(prob.chunks(), prob.model.stages))
        CHECK(prob.memory(w, greedy.diagonals) <= prob.model.memory_cap * (1 + 1e-12));
#if defined(SEQPAR_ENABLE_GLPK)
      const auto milp = schedule::solve_checkpointing_milp(prob);
      CHECK(milp.feasible);
      CHECK(milp.layers_recomputed == best.layers_recomputed);
#endif
    }
    CHECK(feasible > 100);
    MESSAGE("greedy optimal on " << optimal << " of " << feasible << " feasible instances");
  }

  TEST_CASE("grouping: pipelines cover every chunk once, keep a document's chunks together and in order") {
    const DocumentBatch batch({{700, 30, 9, 400}, {5, 6, 7, 300, 12}, {90, 80, 70}});
    schedule::DynamicChunk sched{{.token_capacity = 256, .time_target = 0, .slices = 0, .cost = {24.0, 1.0}}};
    const auto plan = sched.plan(batch);
    schedule::PipelineModel m;
    m.stages = 4;
    m.layers_per_stage = 4;
    m.static_bytes = 1e6;
    m.activation_bytes_per_token = 1000;
    m.kept_bytes_per_token = 100;
    m.seconds_per_cost = 1e-9;
    for (double cap : {1e12, 3.5e6, 2.5e6}) {
      m.memory_cap = cap;
      CAPTURE(cap);
      const auto s = schedule::group_pipelines(plan, m);
      std::vector<int> seen(plan.chunks.size(), 0);
      for (const auto& p : s.pipelines) {
        CHECK(p.checkpointing.feasible);
        for (std::size_t i = 0; i < p.chunks.size(); ++i) {
          ++seen[static_cast<std::size_t>(p.chunks[i])];
          if (i > 0) CHECK(p.chunks[i - 1] < p.chunks[i]);
        }
      }
      for (int x : seen) CHECK(x == 1);
      // A document's chunks are in one pipeline.
      for (const auto& unit : schedule::sequence_units(plan)) {
        int owner = -1;
        for (int c : unit)
          for (std::size_t p = 0; p < s.pipelines.size(); ++p)
            for (int x : s.pipelines[p].chunks)
              if (x == c) {
                if (owner < 0) owner = static_cast<int>(p);
                CHECK(owner == static_cast<int>(p));
              }
      }
      if (cap == 1e12) {
        CHECK(s.pipelines.size() == 1);
        CHECK(s.pipelines[0].checkpointing.layers_recomputed == 0);
      }
    }
    m.memory_cap = 1.1e6;
    CHECK_THROWS_WITH_AS((void)schedule::group_pipelines(plan, m), doctest::Contains("model.memory_cap"),
                         std::invalid_argument);
  }
}
