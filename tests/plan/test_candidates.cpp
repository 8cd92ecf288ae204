// SPDX-License-Identifier: Apache-2.0
// The planner's candidates: a Hybrid candidate sweeps its thresholds once.
#include <doctest/doctest.h>

#include <seqpar/plan/candidates.hpp>
#include <seqpar/plan/compile_all.hpp>
#include <seqpar/seqpar.hpp>

#include <cstddef>

using namespace seqpar;

TEST_SUITE("plan") {
  TEST_CASE("compile_hybrid costs each threshold once and compiles the plan of that sweep") {
    // A simulated cost (hybrid_model_cost) replays a layer per call: the sweep used to run three times.
    int calls = 0;
    Strategy<partition::Hybrid, comm::Ring>::Arguments a;
    a.comm.sharding_aware = true;
    a.partition.cost = [&calls](const partition::HybridCandidate& c) {
      ++calls;
      return partition::hybrid_proxy_cost(c, 1.0, 256.0, 0.5);
    };
    const DocumentBatch batch({{4096, 64, 128, 1024, 32, 512, 256}});
    const Topology topo{4, 4};
    const AttentionShape shape{4, 2, 16};
    const replay::CompiledStrategy compiled = plan::compile_hybrid<comm::Ring>(a, batch, shape, topo);
    REQUIRE(compiled.status);
    const int sweep = calls;
    const partition::HybridReport report = partition::Hybrid{a.partition}.plan_with_report(batch, topo);
    CHECK(report.candidates_evaluated >= 3);
    CHECK(sweep == report.candidates_evaluated);
    CHECK(calls == 2 * sweep);
    CHECK(compiled.plan.owned == report.plan.owned);
    CHECK(compiled.forward.size() == static_cast<std::size_t>(topo.world_size));
    CHECK(compiled.backward.size() == static_cast<std::size_t>(topo.world_size));
    // The same programs as planning through the Strategy.
    const replay::CompiledStrategy direct =
        plan::compile_all<Strategy<partition::Hybrid, comm::Ring>>(a, batch, shape, topo);
    REQUIRE(direct.status);
    CHECK(direct.plan.owned == compiled.plan.owned);
    CHECK(calls == 3 * sweep);
  }
}
