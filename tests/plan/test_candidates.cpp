// SPDX-License-Identifier: Apache-2.0
// The planner's candidates: a Hybrid candidate sweeps its thresholds once, through the same place / plan
// pair as Strategy (no fork of its own), and its planning budget sees the threshold the sweep chose.
#include <doctest/doctest.h>

#include <seqpar/plan/candidates.hpp>
#include <seqpar/plan/compile_all.hpp>
#include <seqpar/seqpar.hpp>

#include <cstddef>

using namespace seqpar;

TEST_SUITE("plan") {
  TEST_CASE("a Hybrid candidate costs each threshold once and compiles the placement of that sweep") {
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
    using S = Strategy<partition::Hybrid, comm::Ring>;
    std::int64_t threshold = -1;
    const replay::CompiledStrategy compiled =
        plan::compile_candidate<S>(a, batch, shape, topo, AttentionMask::causal(), [&](const Placement& p) {
          threshold = plan::split_threshold(p, batch);
          return Status::success();
        });
    REQUIRE(compiled.status);
    const int sweep = calls;
    const partition::HybridReport report = partition::Hybrid{a.partition}.plan_with_report(batch, topo);
    CHECK(report.candidates_evaluated >= 3);
    CHECK(sweep == report.candidates_evaluated);
    CHECK(calls == 2 * sweep);
    CHECK(compiled.plan.owned == report.plan.owned);
    // The budget check saw the sweep's choice: the same documents split, hence the same slice estimate.
    CHECK(threshold >= report.threshold);
    CHECK(plan::per_doc_slices(batch, topo.world_size, threshold) ==
          plan::per_doc_slices(batch, topo.world_size, report.threshold));
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
