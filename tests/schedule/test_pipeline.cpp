// SPDX-License-Identifier: Apache-2.0
// DPP's pipeline scheduling (schedule/pipeline.hpp): the 1F1B order and its memory windows, the
// diagonal-constrained checkpointing (greedy, and GLPK's MILP when built) against a brute-force
// optimum on small instances with every memory constraint checked, the incremental greedy against
// the plain one, and the grouping of sequences into pipelines (its pruned dynamic program against the
// full one; the MILP refining the chosen pipelines).
#include <doctest/doctest.h>

#include <seqpar/schedule/dynamic_chunk.hpp>
#include <seqpar/schedule/pipeline.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <stdexcept>
#include <string>

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

// The greedy as first written (every window's memory recomputed per step): the reference for the
// incremental one.
std::vector<int> plain_greedy(const CheckpointProblem& prob) {
  std::vector<int> c(static_cast<std::size_t>(prob.diagonals()), 0);
  const auto windows = schedule::memory_windows(prob.order(), prob.model.stages);
  const double cap = prob.model.memory_cap;
  for (;;) {
    std::vector<double> gain(c.size(), 0.0);
    bool over = false;
    for (const auto& w : windows) {
      const double excess = prob.memory(w, c) - cap;
      if (excess <= cap * 1e-12) continue;
      over = true;
      for (int k : w.chunks) {
        const auto j = static_cast<std::size_t>(prob.diagonal(k, w.stage));
        if (c[j] < prob.model.layers_per_stage)
          gain[j] += std::min(excess, prob.model.saved_bytes(prob.tokens[static_cast<std::size_t>(k)]));
      }
    }
    if (!over) break;
    const auto best = static_cast<std::size_t>(std::max_element(gain.begin(), gain.end()) - gain.begin());
    if (gain[best] <= 0) break;
    ++c[best];
  }
  return c;
}

// Identity with a few disjoint runs reversed (split documents go backward last slice first).
std::vector<int> random_backward_order(int n, std::mt19937& rng) {
  std::vector<int> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  for (int at = 0; at < n;) {
    const int len = 1 + static_cast<int>(rng() % 6);
    const int end = std::min(n, at + len);
    if (rng() % 2 == 0) std::reverse(order.begin() + at, order.begin() + end);
    at = end;
  }
  return order;
}

// DPP's grouping by the plain dynamic program: every unit boundary, every candidate solved.
double full_dp_seconds(const schedule::ChunkPlan& plan, const schedule::PipelineModel& m) {
  const auto units = schedule::sequence_units(plan);
  const std::size_t u = units.size();
  std::vector<double> dp(u + 1, std::numeric_limits<double>::infinity());
  dp[0] = 0;
  for (std::size_t i = 1; i <= u; ++i)
    for (std::size_t k = 0; k < i; ++k) {
      schedule::Pipeline p;
      for (std::size_t x = k; x < i; ++x) p.chunks.insert(p.chunks.end(), units[x].begin(), units[x].end());
      std::sort(p.chunks.begin(), p.chunks.end());
      p.backward_order = schedule::backward_order(plan, p.chunks);
      p.checkpointing = schedule::solve_checkpointing(schedule::checkpoint_problem(plan, m, p));
      if (p.checkpointing.feasible) dp[i] = std::min(dp[i], dp[k] + schedule::pipeline_detail::seconds(plan, m, p));
    }
  return dp[u];
}

// A pipeline model whose memory cap needs checkpointing (or several pipelines) for `plan`: the cap
// leaves `room` of the no-checkpointing need of stage 0's fullest window.
schedule::PipelineModel tight_model(const schedule::ChunkPlan& plan, int stages, double room) {
  schedule::PipelineModel m;
  m.stages = stages;
  m.layers_per_stage = 3;
  m.static_bytes = 1e6;
  m.activation_bytes_per_token = 1000;
  m.kept_bytes_per_token = 100;
  m.seconds_per_cost = 1e-9;
  std::vector<std::int64_t> tokens;
  for (const auto& c : plan.chunks) tokens.push_back(c.batch.total_tokens());
  std::sort(tokens.rbegin(), tokens.rend());
  double window = 0;
  for (std::size_t i = 0; i < tokens.size() && i < static_cast<std::size_t>(stages); ++i)
    window += m.full_bytes(tokens[i]);
  m.memory_cap = m.static_bytes + room * window;
  return m;
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

  TEST_CASE("checkpointing: the incremental greedy takes the plain greedy's decisions (any backward order)") {
    // Integer bytes: every sum is exact in any order, so both pick the same diagonal at every step.
    std::mt19937 rng(33);
    int checkpointed = 0;
    for (int trial = 0; trial < 150; ++trial) {
      CheckpointProblem prob;
      prob.model.stages = 1 + static_cast<int>(rng() % 8);
      prob.model.layers_per_stage = 1 + static_cast<int>(rng() % 4);
      const int n = 1 + static_cast<int>(rng() % 40);
      for (int k = 0; k < n; ++k) prob.tokens.push_back(1 + static_cast<std::int64_t>(rng() % 1000));
      prob.backward_order = random_backward_order(n, rng);
      prob.model.activation_bytes_per_token = 10;
      prob.model.kept_bytes_per_token = 2;
      prob.model.static_bytes = 1000;
      prob.model.memory_cap = 1000 + static_cast<double>(rng() % 200000);
      CAPTURE(trial);
      const auto greedy = schedule::solve_checkpointing(prob);
      CHECK(greedy.diagonals == plain_greedy(prob));
      checkpointed += greedy.layers_recomputed > 0 ? 1 : 0;
      if (greedy.feasible)
        for (const auto& w : schedule::memory_windows(prob.order(), prob.model.stages))
          CHECK(prob.memory(w, greedy.diagonals) <= prob.model.memory_cap * (1 + 1e-12));
    }
    CHECK(checkpointed > 50);
  }

  TEST_CASE("grouping: the pruned DP finds the full DP's optimum; chunk-count cuts never beat it") {
    std::mt19937 rng(41);
    int several = 0;
    for (int trial = 0; trial < 40; ++trial) {
      std::vector<std::vector<std::int64_t>> seqs;
      const int b = 1 + static_cast<int>(rng() % 4);
      for (int i = 0; i < b; ++i) {
        std::vector<std::int64_t> docs;
        for (int d = 0; d < 2 + static_cast<int>(rng() % 6); ++d)
          docs.push_back(rng() % 4 == 0 ? 200 + static_cast<std::int64_t>(rng() % 600)
                                        : 1 + static_cast<std::int64_t>(rng() % 120));
        seqs.push_back(docs);
      }
      const DocumentBatch batch(seqs);
      schedule::DynamicChunk chunker{{.token_capacity = 128, .time_target = 0, .slices = 0, .cost = {24.0, 1.0}}};
      const auto plan = chunker.plan(batch);
      const int stages = 1 + static_cast<int>(rng() % 4);
      const auto m = tight_model(plan, stages, 0.3 + 0.1 * static_cast<double>(rng() % 8));
      CAPTURE(trial);
      const double full = full_dp_seconds(plan, m);
      if (!std::isfinite(full)) {
        CHECK_THROWS_AS((void)schedule::group_pipelines(plan, m), std::invalid_argument);
        continue;
      }
      const auto every = schedule::group_pipelines(plan, m, schedule::solve_checkpointing,
                                                   {.boundaries = schedule::GroupBoundaries::kEveryUnit});
      CHECK(every.seconds == doctest::Approx(full).epsilon(1e-9));
      const auto classes = schedule::group_pipelines(plan, m);
      CHECK(classes.seconds >= full * (1 - 1e-9));
      double sum = 0;
      for (const auto& p : classes.pipelines) sum += p.seconds;
      CHECK(sum == doctest::Approx(classes.seconds).epsilon(1e-12));
      // Cuts fall between units of different chunk counts (unless the fallback to every unit ran).
      const auto units = schedule::sequence_units(plan);
      std::vector<int> unit_of_chunk(plan.chunks.size());
      for (std::size_t i = 0; i < units.size(); ++i)
        for (int c : units[i]) unit_of_chunk[static_cast<std::size_t>(c)] = static_cast<int>(i);
      bool at_classes = true;
      std::size_t first = 0;
      for (const auto& p : classes.pipelines) {
        std::set<int> mine;
        for (int c : p.chunks) mine.insert(unit_of_chunk[static_cast<std::size_t>(c)]);
        CHECK(*mine.begin() == static_cast<int>(first));  // pipelines take consecutive units
        CHECK(mine.size() == static_cast<std::size_t>(*mine.rbegin() - *mine.begin() + 1));
        if (first > 0) at_classes = at_classes && units[first].size() != units[first - 1].size();
        first = static_cast<std::size_t>(*mine.rbegin()) + 1;
      }
      CHECK((at_classes || classes.seconds == doctest::Approx(every.seconds).epsilon(1e-12)));
      several += classes.pipelines.size() > 1 ? 1 : 0;
    }
    MESSAGE(several << " of 40 groupings use several pipelines");
    CHECK(several > 0);
  }

  TEST_CASE("refine_checkpointing: the chosen pipelines solved again never recompute more, and still fit") {
    const DocumentBatch batch({{900, 30, 9, 400, 77}, {5, 6, 7, 300, 12, 640}, {90, 80, 70, 500}});
    const auto plan =
        schedule::DynamicChunk{{.token_capacity = 128, .time_target = 0, .slices = 0, .cost = {24.0, 1.0}}}.plan(batch);
    const auto m = tight_model(plan, 4, 0.5);
    auto s = schedule::group_pipelines(plan, m);
    const auto greedy = s;
    // The greedy again changes nothing.
    schedule::refine_checkpointing(plan, m, s, schedule::solve_checkpointing);
    CHECK(s.seconds == doctest::Approx(greedy.seconds).epsilon(1e-12));
    for (std::size_t i = 0; i < s.pipelines.size(); ++i)
      CHECK(s.pipelines[i].checkpointing.diagonals == greedy.pipelines[i].checkpointing.diagonals);
#if defined(SEQPAR_ENABLE_GLPK)
    schedule::refine_checkpointing(plan, m, s, schedule::milp_solver({.relative_gap = 0, .time_limit_s = 5}));
    double sum = 0;
    for (std::size_t i = 0; i < s.pipelines.size(); ++i) {
      const auto& p = s.pipelines[i];
      CHECK(p.checkpointing.feasible);
      CHECK(p.checkpointing.layers_recomputed <= greedy.pipelines[i].checkpointing.layers_recomputed);
      const auto prob = schedule::checkpoint_problem(plan, m, p);
      for (const auto& w : schedule::memory_windows(prob.order(), m.stages))
        CHECK(prob.memory(w, p.checkpointing.diagonals) <= m.memory_cap * (1 + 1e-12));
      sum += p.seconds;
    }
    CHECK(sum == doctest::Approx(s.seconds).epsilon(1e-12));
    CHECK(s.seconds <= greedy.seconds * (1 + 1e-12));
#endif
  }

  TEST_CASE("the pipeline planner refuses orders that are not permutations, non-finite models, wrong decisions") {
    const auto message = [](auto&& fn) {
      try {
        fn();
      } catch (const std::invalid_argument& e) {
        return std::string(e.what());
      }
      return std::string("no exception");
    };
    // Orders: a repeat and an out-of-range chunk (each once corrupted the heap in memory_windows).
    CHECK(message([] {
            (void)schedule::one_f_one_b(std::vector<int>{0, 0, 2}, 2);
          }).find("schedule::one_f_one_b: backward_order[1] = 0: must be a permutation of [0, 3)") !=
          std::string::npos);
    CHECK(message([] {
            (void)schedule::memory_windows(std::vector<int>{0, 5}, 2);
          }).find("backward_order[1] = 5") != std::string::npos);
    CHECK(message([] { (void)schedule::one_f_one_b(3, 0); }).find("stages = 0") != std::string::npos);
    CheckpointProblem prob;
    prob.tokens = {100, 200, 300};
    prob.model = {.stages = 2,
                  .layers_per_stage = 2,
                  .static_bytes = 0,
                  .memory_cap = 5000,
                  .activation_bytes_per_token = 10,
                  .kept_bytes_per_token = 2,
                  .seconds_per_cost = 0};
    REQUIRE(schedule::solve_checkpointing(prob).feasible);
    CheckpointProblem bad = prob;
    bad.backward_order = {2, 1, 1};
    CHECK(message([&] { (void)schedule::solve_checkpointing(bad); }).find("problem.backward_order[2] = 1") !=
          std::string::npos);
    bad.backward_order = {1, 0};
    CHECK(message([&] { (void)schedule::solve_checkpointing(bad); }).find("problem.backward_order.size() = 2") !=
          std::string::npos);
    // Non-finite model values: a NaN cap once made a NaN plan "feasible".
    for (const double x : {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
      bad = prob;
      bad.model.memory_cap = x;
      CHECK(message([&] { (void)schedule::solve_checkpointing(bad); }).find("model.memory_cap") != std::string::npos);
      bad = prob;
      bad.model.activation_bytes_per_token = x;
      CHECK(message([&] { (void)schedule::solve_checkpointing(bad); }).find("must be finite") != std::string::npos);
      bad = prob;
      bad.model.static_bytes = x;
      CHECK(message([&] { (void)schedule::solve_checkpointing(bad); }).find("model.static_bytes") != std::string::npos);
    }
    // Decisions planned for 2 stages evaluated on 3 (one diagonal short) and out of range.
    const auto plan = schedule::solve_checkpointing(prob);
    bad = prob;
    bad.model.stages = 3;
    CHECK(message([&] {
            (void)schedule::evaluate(bad, plan.diagonals, "x");
          }).find("decisions.size() = 4: must be chunks + stages - 1 = 5") != std::string::npos);
    CHECK(message([&] {
            (void)schedule::evaluate(prob, {0, 3, 0, 0}, "x");
          }).find("decisions[1] = 3") != std::string::npos);
  }

  TEST_CASE("validate_schedule refuses an empty schedule, an empty pipeline and another stage count") {
    const DocumentBatch batch({{300, 50, 40, 30}});
    const auto plan =
        schedule::DynamicChunk{{.token_capacity = 100, .time_target = 0, .slices = 0, .cost = {}}}.plan(batch);
    schedule::PipelineModel m{.stages = 2,
                              .layers_per_stage = 2,
                              .static_bytes = 0,
                              .memory_cap = 1e12,
                              .activation_bytes_per_token = 10,
                              .kept_bytes_per_token = 2,
                              .seconds_per_cost = 1e-9};
    const schedule::PipelineSchedule good = schedule::group_pipelines(plan, m);
    CHECK_NOTHROW(schedule::validate_schedule(plan, good, 2, 2, "test"));
    CHECK_THROWS_WITH_AS(schedule::validate_schedule(plan, schedule::PipelineSchedule{}, 2, 2, "test"),
                         doctest::Contains("schedule.pipelines.size() = 0"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(schedule::validate_schedule(plan, good, 3, 2, "test"),
                         doctest::Contains("was the schedule planned for 3 stages?"), std::invalid_argument);
    schedule::PipelineSchedule extra = good;
    extra.pipelines.emplace_back();
    CHECK_THROWS_WITH_AS(schedule::validate_schedule(plan, extra, 2, 2, "test"),
                         doctest::Contains(".chunks.size() = 0: must be >= 1"), std::invalid_argument);
    schedule::PipelineSchedule twisted = good;
    twisted.pipelines[0].backward_order.assign(twisted.pipelines[0].chunks.size(), 0);
    if (twisted.pipelines[0].chunks.size() > 1)
      CHECK_THROWS_WITH_AS(schedule::validate_schedule(plan, twisted, 2, 2, "test"),
                           doctest::Contains("must be a permutation"), std::invalid_argument);
    CHECK_THROWS_WITH_AS((void)schedule::group_pipelines(schedule::ChunkPlan{}, m),
                         doctest::Contains("plan.chunks.size() = 0"), std::invalid_argument);
    // A schedule grouped from the plan of another batch of the same tokens and chunk count (the last
    // step's, kept by mistake): refused by name, not run with another batch's order and checkpointing.
    const DocumentBatch reordered({{300, 40, 50, 30}});
    const auto other_plan =
        schedule::DynamicChunk{{.token_capacity = 100, .time_target = 0, .slices = 0, .cost = {}}}.plan(reordered);
    REQUIRE(other_plan.chunks.size() == plan.chunks.size());
    CHECK(good.plan_fingerprint == plan.fingerprint());
    CHECK_THROWS_WITH_AS(
        schedule::validate_schedule(other_plan, good, 2, 2, "test"),
        doctest::Contains((std::string("test: schedule.plan_fingerprint = ") + std::to_string(plan.fingerprint()) +
                           ": is not this chunk plan's (" + std::to_string(other_plan.fingerprint()) +
                           ", of the batch with fingerprint " + std::to_string(reordered.fingerprint()) + ")")
                              .c_str()),
        std::invalid_argument);
    CHECK_NOTHROW(schedule::validate_schedule(other_plan, schedule::group_pipelines(other_plan, m), 2, 2, "test"));
    // A pipeline that lost a chunk: named as the missing chunk and the pipeline it was lost from, not as a
    // schedule of another stage count (its checkpointing has one diagonal too many, too).
    schedule::PipelineSchedule lost = good;
    std::size_t from = 0;
    while (from < lost.pipelines.size() && lost.pipelines[from].chunks.size() < 2) ++from;
    REQUIRE(from < lost.pipelines.size());  // 4 chunks on 2 stages: some pipeline holds two
    const int missing = lost.pipelines[from].chunks.back();
    lost.pipelines[from].chunks.pop_back();
    lost.pipelines[from].backward_order.clear();
    const std::string held = std::to_string(lost.pipelines[from].chunks.size());
    CHECK_THROWS_WITH_AS(
        schedule::validate_schedule(plan, lost, 2, 2, "test"),
        doctest::Contains(("test: schedule (pipelines of chunk " + std::to_string(missing) + ") = 0: chunk " +
                           std::to_string(missing) + " of the plan (" +
                           std::to_string(plan.chunks[static_cast<std::size_t>(missing)].batch.total_tokens()) +
                           " tokens) runs in no pipeline (schedule.pipelines[" + std::to_string(from) + "] holds " +
                           held + " chunks but its checkpointing was planned for " +
                           std::to_string(lost.pipelines[from].chunks.size() + 1) + ": the chunk was lost from it)")
                              .c_str()),
        std::invalid_argument);
  }

#if defined(SEQPAR_ENABLE_GLPK)
  TEST_CASE("MILP: a time limit beyond GLPK's int milliseconds (or infinite) is refused by name, not passed on") {
    CheckpointProblem prob;
    prob.tokens = {100, 200, 300};
    prob.model = {.stages = 2,
                  .layers_per_stage = 2,
                  .static_bytes = 0,
                  .memory_cap = 5000,
                  .activation_bytes_per_token = 10,
                  .kept_bytes_per_token = 2,
                  .seconds_per_cost = 0};
    for (const double s : {3e6, 1e300, std::numeric_limits<double>::infinity(), std::nan("")})
      CHECK_THROWS_WITH_AS((void)schedule::solve_checkpointing_milp(prob, {.time_limit_s = s}),
                           doctest::Contains("options.time_limit_s"), std::invalid_argument);
    // The largest accepted limit runs (this small problem solves long before it).
    CHECK(schedule::solve_checkpointing_milp(prob, {.time_limit_s = schedule::kMaxMilpSeconds}).feasible);
    CheckpointProblem bad = prob;
    bad.backward_order = {0, 0, 1};
    CHECK_THROWS_WITH_AS((void)schedule::solve_checkpointing_milp(bad), doctest::Contains("must be a permutation"),
                         std::invalid_argument);
  }

  TEST_CASE("MILP under a time limit: the greedy's decisions as first incumbent, never worse than them") {
    std::mt19937 rng(57);
    for (int trial = 0; trial < 6; ++trial) {
      CheckpointProblem prob;
      prob.model.stages = 8;
      prob.model.layers_per_stage = 4;
      const int n = 60;
      for (int k = 0; k < n; ++k) prob.tokens.push_back(100 + static_cast<std::int64_t>(rng() % 900));
      prob.backward_order = random_backward_order(n, rng);
      prob.model.activation_bytes_per_token = 10;
      prob.model.kept_bytes_per_token = 2;
      prob.model.static_bytes = 1000;
      prob.model.memory_cap = 71000 + 30000.0 * static_cast<double>(trial);  // full checkpointing needs <= 65000
      const auto greedy = schedule::solve_checkpointing(prob);
      REQUIRE(greedy.feasible);
      const auto bounded = schedule::solve_checkpointing_milp(prob, {.relative_gap = 0.02, .time_limit_s = 0.05});
      CAPTURE(bounded.solver);
      CHECK(bounded.feasible);
      CHECK(bounded.layers_recomputed <= greedy.layers_recomputed);
      CHECK(bounded.solver.starts_with("glpk"));
    }
    CHECK_THROWS_WITH_AS((void)schedule::solve_checkpointing_milp(CheckpointProblem{{10},
                                                                                    {.stages = 1,
                                                                                     .layers_per_stage = 1,
                                                                                     .static_bytes = 0,
                                                                                     .memory_cap = 1,
                                                                                     .activation_bytes_per_token = 1,
                                                                                     .kept_bytes_per_token = 0,
                                                                                     .seconds_per_cost = 0},
                                                                                    {}},
                                                                  {.relative_gap = -1}),
                         doctest::Contains("options.relative_gap"), std::invalid_argument);
  }
#endif
}
