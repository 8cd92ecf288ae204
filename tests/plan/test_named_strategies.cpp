// SPDX-License-Identifier: Apache-2.0
// The named strategies' table (plan/named_strategies.hpp), the one registry the planner's candidates and
// the torch op read: what would drift if an entry were edited on one side only.
#include <doctest/doctest.h>

#include <seqpar/plan/candidates.hpp>
#include <seqpar/plan/named_strategies.hpp>
#include <seqpar/replay/hardware.hpp>
#include <seqpar/seqpar.hpp>

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

using namespace seqpar;

namespace {

/// The argument words of strategy arguments `a` (what ranks compare), by name.
template <class S>
std::vector<runtime::ArgumentWord> words_of(const typename S::Arguments& a) {
  std::vector<runtime::ArgumentWord> out;
  S::for_each_argument(a, [&](runtime::ArgumentWord w) { out.push_back(std::move(w)); });
  return out;
}

bool ends_with(std::string_view s, std::string_view tail) {
  return s.size() >= tail.size() && s.substr(s.size() - tail.size()) == tail;
}

/// The words of `a` whose name ends with `tail` ("capacity_factor", ".cost (set)", "sharding_aware").
template <class S>
std::vector<runtime::ArgumentWord> words_ending(const typename S::Arguments& a, std::string_view tail) {
  std::vector<runtime::ArgumentWord> out;
  for (runtime::ArgumentWord& w : words_of<S>(a))
    if (ends_with(w.name, tail)) out.push_back(std::move(w));
  return out;
}

std::string message_of(const auto& fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(no exception)";
}

}  // namespace

TEST_SUITE("plan") {
  TEST_CASE("named strategies: unique names, and the planner's candidates are the table, in its order") {
    std::set<std::string_view> seen;
    for (std::string_view name : plan::kNamedStrategyNames) {
      CAPTURE(name);
      CHECK(!name.empty());
      CHECK(name != "auto");  // the torch op's own extra entry
      CHECK(seen.insert(name).second);
    }
    CHECK(seen.size() == plan::kNamedStrategyCount);

    const std::vector<plan::Candidate> candidates = plan::standard_candidates();
    REQUIRE(candidates.size() == plan::kNamedStrategyCount);
    std::size_t i = 0;
    plan::for_each_named_strategy([&]<class E>() {
      CAPTURE(E::name);
      CHECK(candidates[i].name == E::name);
      CHECK(candidates[i].description == E::description);
      CHECK(plan::kNamedStrategyNames[i] == E::name);
      ++i;
    });
    CHECK(i == plan::kNamedStrategyCount);

    // By name: every name reaches its own entry, and no other string reaches one.
    for (std::string_view name : plan::kNamedStrategyNames) {
      std::string_view reached;
      CHECK(plan::visit_named_strategy(name, [&]<class E>() { reached = E::name; }));
      CHECK(reached == name);
    }
    int calls = 0;
    CHECK_FALSE(plan::visit_named_strategy("auto", [&]<class>() { ++calls; }));
    CHECK_FALSE(plan::visit_named_strategy("Ulysses", [&]<class>() { ++calls; }));
    CHECK_FALSE(plan::visit_named_strategy("", [&]<class>() { ++calls; }));
    CHECK(calls == 0);
  }

  TEST_CASE("named strategies: capacity_factor is taken exactly where the partitioner has a token capacity") {
    const AttentionShape shape{4, 2, 16};
    plan::for_each_named_strategy([&]<class E>() {
      using S = typename E::strategy;
      CAPTURE(E::name);
      // The partitioner's own arguments say whether it has a capacity (WholeDoc, Hybrid, BatchAware<Hybrid>).
      const std::vector<runtime::ArgumentWord> defaults = words_ending<S>({}, "capacity_factor");
      CHECK(plan::NamedWithCapacity<E> == !defaults.empty());
      plan::NamedStrategyOptions options;
      options.caller = "test";
      options.capacity_factor = 2.0;
      if constexpr (plan::NamedWithCapacity<E>) {
        // The refusal for the others says "whole-doc and the hybrid strategies": keep it true.
        CHECK((E::name == "whole-doc" || E::name.find("hybrid") != std::string_view::npos));
        const auto set = words_ending<S>(plan::named_arguments<E>(options, shape), "capacity_factor");
        REQUIRE(set.size() == 1);
        CHECK(set[0].value == std::bit_cast<std::uint64_t>(2.0));
        options.capacity_factor = 0.0;  // the partitioner's default
        const auto kept = words_ending<S>(plan::named_arguments<E>(options, shape), "capacity_factor");
        REQUIRE(kept.size() == 1);
        CHECK(kept[0].value == defaults[0].value);
        for (double bad : {0.5, -1.0, std::numeric_limits<double>::infinity(), std::nan("")}) {
          options.capacity_factor = bad;
          const std::string m = message_of([&] { (void)plan::named_arguments<E>(options, shape); });
          CAPTURE(m);
          CHECK(m.find("test: capacity_factor = ") == 0);
          CHECK(m.find("must be finite and >= 1") != std::string::npos);
        }
      } else {
        const std::string m = message_of([&] { (void)plan::named_arguments<E>(options, shape); });
        CHECK(m ==
              "test: capacity_factor = 2: applies to whole-doc and the hybrid strategies (their per-rank token "
              "capacity), not strategy '" +
                  std::string(E::name) + "'");
        options.capacity_factor = 0.0;
        CHECK_NOTHROW((void)plan::named_arguments<E>(options, shape));
      }
    });
  }

  TEST_CASE("named strategies: the arguments the descriptions promise, Hybrid on the profile when one is given") {
    const AttentionShape shape{4, 2, 16};
    plan::NamedStrategyOptions plain;
    plain.ranks_per_node = 3;
    plain.masks = MaskMix{{AttentionMask::causal(), 2}, {AttentionMask::sliding_window(64), 1}};
    plan::NamedStrategyOptions profiled = plain;
    profiled.hardware = replay::profiles::h100_sxm();
    profiled.gemm_seconds_per_token = 1e-9;
    plan::for_each_named_strategy([&]<class E>() {
      using S = typename E::strategy;
      CAPTURE(E::name);
      const typename S::Arguments a = plan::named_arguments<E>(plain, shape);
      CHECK(a.ranks_per_node == 3);
      CHECK(a.masks.fingerprint() == plain.masks.fingerprint());
      // "{sharding_aware}" in the description, the flag set in the arguments (comm. or comm.outer.).
      bool aware = false;
      for (const runtime::ArgumentWord& w : words_ending<S>(a, "sharding_aware")) aware = aware || w.value != 0;
      CHECK(aware == (E::description.find("sharding_aware") != std::string_view::npos));
      // Hybrid's cost: the proxy (empty) without a profile, the simulated layer with one.
      const auto proxy = words_ending<S>(a, ".cost (set)");
      const auto model = words_ending<S>(plan::named_arguments<E>(profiled, shape), ".cost (set)");
      CHECK(proxy.size() == model.size());
      CHECK(proxy.size() == (E::description.find("Hybrid") != std::string_view::npos ? 1u : 0u));
      for (const runtime::ArgumentWord& w : proxy) CHECK(w.value == 0);
      for (const runtime::ArgumentWord& w : model) CHECK(w.value == 1);
    });
  }

  TEST_CASE("named strategies: the planning budgets are where the planner had them") {
    // 20 sequences of 100 documents of 512 tokens over 256 ranks: Per-Doc would plan ~5e8 slices, a plain
    // AllGather ~1e7 pieces, both above kMaxPlannedSlices. Only the budgets run (no programs compiled).
    const DocumentBatch batch(std::vector<std::vector<std::int64_t>>(20, std::vector<std::int64_t>(100, 512)));
    const Topology topo{256, 8};
    using Uniform = Strategy<partition::Uniform, comm::Ring>;
    const Uniform::Placed placed = Uniform::place({}, batch, topo);
    REQUIRE(placed.status);
    const std::set<std::string_view> budgeted = {"per-doc-aware", "allgather", "hybrid-aware",
                                                 "hybrid-allgather-aware"};
    plan::for_each_named_strategy([&]<class E>() {
      CAPTURE(E::name);
      const Status s = E::budget(batch, placed.placement);
      CAPTURE(s.reason);
      CHECK(!s == budgeted.contains(E::name));
      if (!s) CHECK(s.reason.find("(budget 10 M)") != std::string::npos);
    });
  }

  TEST_CASE("named strategies: every name's candidate places and compiles a packed batch on every rank") {
    const DocumentBatch batch({{300, 50, 100, 62}, {256, 200, 56}});
    const AttentionShape shape{4, 4, 16};
    const Topology topo{4, 2};
    for (const plan::Candidate& c : plan::standard_candidates()) {
      CAPTURE(c.name);
      const replay::CompiledStrategy compiled = c.compile(batch, shape, topo, {}, AttentionMask::causal());
      CAPTURE(compiled.status.reason);
      REQUIRE(compiled.status);
      CHECK(compiled.forward.size() == 4u);
      CHECK(compiled.backward.size() == 4u);
      // Every token placed once.
      REQUIRE(compiled.plan.world_size() == 4);
      std::int64_t owned = 0;
      for (const auto& ranges : compiled.plan.owned)
        for (const Range& r : ranges) owned += r.size();
      CHECK(owned == batch.total_tokens());
    }
  }
}
