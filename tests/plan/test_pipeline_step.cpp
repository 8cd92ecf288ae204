// SPDX-License-Identifier: Apache-2.0
// DPP's training step on the cost model (plan::simulate_pipeline_step) against hand-computed 1F1B
// schedules, and the directions it must move in.
#include <doctest/doctest.h>

#include "support/expect_error.hpp"

#include <seqpar/plan/pipeline_step.hpp>
#include <seqpar/plan/workloads.hpp>

#include <numeric>
#include <string>
#include <vector>

using namespace seqpar;
using seqpar::test::invalid_message;

namespace {

// Round numbers: 1 TFLOP/s for everything, free copies and launches, every tile exact, one rank a node.
replay::HardwareProfile round_profile() {
  replay::HardwareProfile p;
  p.name = "round";
  p.peak_flops = 1e12;
  p.gemm_efficiency = 1.0;
  p.attention_efficiency = 1.0;
  p.attention_backward_factor = 1.0;
  p.kernel_launch = 0;
  p.hbm_bandwidth = 1e30;
  p.intra = {1e30, 0};
  p.inter = {1e30, 0};
  p.ranks_per_node = 1;
  p.nics_per_node = 1;
  p.memory_bytes = 1e15;
  p.value_bytes = 2;
  return p;
}

// No LM head (vocab 0): every stage does the same work.
plan::ModelShape tiny(int layers = 4) {
  return {"tiny", layers, 64, 4, 4, 16, 128, 0, false};
}

plan::PipelineStepOptions options(int stages, int layers = 4) {
  plan::PipelineStepOptions o;
  o.model = tiny(layers);
  o.hardware = round_profile();
  o.stages = stages;
  o.sp_ranks = 1;
  o.memory_reserve = 0;
  return o;
}

// `n` documents of `length` tokens, each its own (batched) chunk.
schedule::ChunkPlan equal_chunks(int n, std::int64_t length) {
  const DocumentBatch batch(std::vector<std::vector<std::int64_t>>(static_cast<std::size_t>(n), {length}));
  schedule::ChunkPlan plan = schedule::DynamicChunk{{.token_capacity = length}}.plan(batch);
  REQUIRE(plan.chunks.size() == static_cast<std::size_t>(n));
  return plan;
}

// One pipeline over every chunk in plan order, with checkpointing `diagonals` (empty: none).
schedule::PipelineSchedule one_pipeline(const schedule::ChunkPlan& plan, const plan::PipelineStepOptions& o,
                                        std::vector<int> diagonals = {}) {
  schedule::PipelineSchedule s;
  s.pipelines.resize(1);
  schedule::Pipeline& p = s.pipelines[0];
  schedule::CheckpointProblem prob{{}, plan::pipeline_model(o), {}};
  for (std::size_t c = 0; c < plan.chunks.size(); ++c) {
    p.chunks.push_back(static_cast<int>(c));
    prob.tokens.push_back(plan.chunks[c].batch.total_tokens());
  }
  p.backward_order = schedule::backward_order(plan, p.chunks);
  prob.backward_order = p.backward_order;
  if (diagonals.empty()) diagonals.assign(static_cast<std::size_t>(prob.diagonals()), 0);
  p.checkpointing = schedule::evaluate(prob, std::move(diagonals), "test");
  return s;
}

// Forward seconds of one layer over one document of `t` tokens on the round profile (one rank).
double layer_forward(const plan::ModelShape& m, std::int64_t t) {
  const double pairs = 0.5 * static_cast<double>(t) * static_cast<double>(t + 1);
  return (m.layer_gemm_flops_per_token() * static_cast<double>(t) + 4.0 * m.head_dim * m.heads_q * pairs) / 1e12;
}
double layer_backward(const plan::ModelShape& m, std::int64_t t) {
  const double pairs = 0.5 * static_cast<double>(t) * static_cast<double>(t + 1);
  return (2.0 * m.layer_gemm_flops_per_token() * static_cast<double>(t) + 10.0 * m.head_dim * m.heads_q * pairs) / 1e12;
}

}  // namespace

TEST_SUITE("plan") {
  TEST_CASE("pipeline step: equal chunks run 1F1B in (n + d_p - 1)(F + B), a bubble of (d_p - 1)(F + B) a stage") {
    const std::int64_t t = 1000;
    for (const auto& [n, d] : {std::pair{2, 2}, std::pair{5, 2}, std::pair{5, 4}, std::pair{8, 4}, std::pair{3, 1}}) {
      CAPTURE(n);
      CAPTURE(d);
      const plan::PipelineStepOptions o = options(d);
      const schedule::ChunkPlan plan = equal_chunks(n, t);
      const plan::PipelineStepReport rep = plan::simulate_pipeline_step(plan, one_pipeline(plan, o), o);
      const int lps = o.layers_per_stage();
      const double f = lps * layer_forward(o.model, t), b = lps * layer_backward(o.model, t);
      CHECK(rep.step_s == doctest::Approx((n + d - 1) * (f + b)).epsilon(1e-12));
      for (const plan::PipelineStageReport& st : rep.stages) {
        CHECK(st.busy_s == doctest::Approx(n * (f + b)).epsilon(1e-12));
        CHECK(st.idle_s == doctest::Approx((d - 1) * (f + b)).epsilon(1e-9));
      }
      CHECK(rep.bubble_s == doctest::Approx((d - 1) * (f + b)).epsilon(1e-9));
      CHECK(rep.recompute_s == 0);
      CHECK(rep.tokens == n * t);
      CHECK(rep.tokens_per_s == doctest::Approx(n * t / rep.step_s));
    }
  }

  TEST_CASE("pipeline step: P2P between two nodes adds one transfer each way to the 1F1B critical path") {
    plan::PipelineStepOptions o = options(2);
    o.hardware.inter = {1e9, 2e-6};  // 1 GB/s, 2 us
    const std::int64_t t = 1000;
    const schedule::ChunkPlan plan = equal_chunks(2, t);
    const plan::PipelineStepReport rep = plan::simulate_pipeline_step(plan, one_pipeline(plan, o), o);
    const double f = 2 * layer_forward(o.model, t), b = 2 * layer_backward(o.model, t);
    const double p2p = 2e-6 + static_cast<double>(t) * o.model.hidden * 2 / 1e9;  // chunk_tokens x hidden x 2 B
    REQUIRE(p2p < f);
    // S0: F0 F1 . . B0 B1; S1 waits one transfer for F0, S0 one transfer for B1 (hand-drawn timeline).
    CHECK(rep.step_s == doctest::Approx(3 * (f + b) + 2 * p2p).epsilon(1e-12));
    CHECK(rep.p2p_s == doctest::Approx(4 * p2p).epsilon(1e-12));  // 2 forward + 2 backward transfers
    // The same stages on one node's NVLink (ranks_per_node 2): no inter-node transfer.
    o.hardware.ranks_per_node = 2;
    o.hardware.intra = {1e30, 0};
    CHECK(plan::simulate_pipeline_step(plan, one_pipeline(plan, o), o).step_s ==
          doctest::Approx(3 * (f + b)).epsilon(1e-12));
  }

  TEST_CASE("pipeline step: recomputation adds F-hat x sum C (the propagated bubble of DPP's diagonals)") {
    const std::int64_t t = 1000;
    for (const auto& [n, d] : {std::pair{2, 2}, std::pair{3, 2}, std::pair{6, 4}}) {
      CAPTURE(n);
      CAPTURE(d);
      const plan::PipelineStepOptions o = options(d, 8);
      const schedule::ChunkPlan plan = equal_chunks(n, t);
      const double base = plan::simulate_pipeline_step(plan, one_pipeline(plan, o), o).step_s;
      const double f_hat = layer_forward(o.model, t);
      const int lps = o.layers_per_stage();
      // Every single diagonal, then a mixed pattern: each checkpointed layer on the diagonals costs one
      // layer's forward once, however many stages share the diagonal.
      const int m = n + d - 1;
      for (int j = 0; j < m; ++j) {
        CAPTURE(j);
        std::vector<int> c(static_cast<std::size_t>(m), 0);
        c[static_cast<std::size_t>(j)] = 1 + j % lps;
        const plan::PipelineStepReport rep = plan::simulate_pipeline_step(plan, one_pipeline(plan, o, c), o);
        CHECK(rep.step_s == doctest::Approx(base + f_hat * c[static_cast<std::size_t>(j)]).epsilon(1e-12));
      }
      std::vector<int> c(static_cast<std::size_t>(m));
      for (int j = 0; j < m; ++j) c[static_cast<std::size_t>(j)] = (3 * j + 1) % (lps + 1);
      const int sum = std::accumulate(c.begin(), c.end(), 0);
      const plan::PipelineStepReport rep = plan::simulate_pipeline_step(plan, one_pipeline(plan, o, c), o);
      CHECK(rep.step_s == doctest::Approx(base + f_hat * sum).epsilon(1e-12));
      CHECK(rep.layers_recomputed == sum);
      // Each stage recomputes the layers of the diagonals its chunks lie on.
      for (int p = 0; p < d; ++p) {
        double layers = 0;
        for (int k = 0; k < n; ++k) layers += c[static_cast<std::size_t>(k + d - 1 - p)];
        CHECK(rep.stages[static_cast<std::size_t>(p)].recompute_s == doctest::Approx(layers * f_hat).epsilon(1e-12));
      }
    }
  }

  TEST_CASE("pipeline step: more stages over the same chunks leave more bubble") {
    const schedule::ChunkPlan plan = equal_chunks(8, 2000);
    double last_bubble = 0, last_fraction = 0;
    for (const int d : {1, 2, 4, 8}) {
      CAPTURE(d);
      const plan::PipelineStepOptions o = options(d, 8);
      const plan::PipelineStepReport rep = plan::simulate_pipeline_step(plan, one_pipeline(plan, o), o);
      if (d == 1) CHECK(rep.bubble_s == doctest::Approx(0).epsilon(1e-12));
      if (d > 1) {
        CHECK(rep.bubble_s > last_bubble);
        CHECK(rep.bubble_s / rep.step_s > last_fraction);
      }
      last_bubble = rep.bubble_s;
      last_fraction = rep.bubble_s / rep.step_s;
    }
  }

  TEST_CASE("pipeline step: a tighter memory cap checkpoints more and costs more; the executed memory is the plan's") {
    // Long documents split into slices (backward last slice first) and short ones packed.
    std::vector<std::vector<std::int64_t>> seqs;
    for (const std::int64_t l : plan::workloads::sample_sequences("github", 48, 16384, 3)) seqs.push_back({l});
    seqs.push_back({16384});
    seqs.push_back({12000});
    const DocumentBatch batch(seqs);
    plan::PipelineStepOptions o = options(4, 8);
    o.hardware.inter = {1e9, 2e-6};
    const schedule::ChunkPlan plan =
        schedule::DynamicChunk{{.token_capacity = 4096, .cost = plan::chunk_cost(o)}}.plan(batch);
    REQUIRE(plan.slices > 1);
    const schedule::PipelineModel loose = plan::pipeline_model(o);
    // One 1F1B pipeline over every chunk, checkpointed by the greedy under a shrinking cap.
    schedule::PipelineSchedule sched = one_pipeline(plan, o);
    schedule::CheckpointProblem prob{{}, loose, sched.pipelines[0].backward_order};
    for (const schedule::Chunk& c : plan.chunks) prob.tokens.push_back(c.batch.total_tokens());
    const plan::PipelineStepReport free_rep = plan::simulate_pipeline_step(plan, sched, o);
    CHECK(free_rep.recompute_s == 0);
    CHECK(free_rep.fits_memory);
    double last_recompute = 0, last_step = free_rep.step_s;
    for (const double fraction : {0.8, 0.6, 0.4, 0.2}) {
      CAPTURE(fraction);
      // The cap: the states plus a fraction of the unconstrained peak activations.
      plan::PipelineStepOptions tight = o;
      tight.memory_reserve =
          1.0 - (loose.static_bytes + fraction * (free_rep.max_peak_memory_bytes() - loose.static_bytes)) /
                    o.hardware.memory_bytes;
      prob.model = plan::pipeline_model(tight);
      sched.pipelines[0].checkpointing = schedule::solve_checkpointing(prob);
      REQUIRE(sched.pipelines[0].checkpointing.feasible);
      const plan::PipelineStepReport rep = plan::simulate_pipeline_step(plan, sched, tight);
      CHECK(rep.fits_memory);
      CHECK(rep.max_peak_memory_bytes() <= rep.memory_cap_bytes * (1 + 1e-12));
      CHECK(rep.recompute_s > last_recompute);
      CHECK(rep.step_s > last_step);
      // The simulator walks the schedule's own 1F1B order: its peaks are the checkpointing plan's.
      for (const plan::PipelineStageReport& st : rep.stages)
        CHECK(st.peak_memory_bytes == doctest::Approx(st.planned_peak_memory_bytes).epsilon(1e-12));
      last_recompute = rep.recompute_s;
      last_step = rep.step_s;
      // DPP's grouping under the same cap fits too, and walks into the same memory it planned.
      const plan::PipelineStepReport grouped =
          plan::simulate_pipeline_step(plan, schedule::group_pipelines(plan, prob.model), tight);
      CHECK(grouped.fits_memory);
      for (const plan::PipelineStageReport& st : grouped.stages)
        CHECK(st.peak_memory_bytes == doctest::Approx(st.planned_peak_memory_bytes).epsilon(1e-12));
    }
  }

  TEST_CASE("pipeline step: a split document's slice attends to its prefix; costs per token and per pair") {
    const DocumentBatch batch({{3000}, {500}});
    const plan::PipelineStepOptions o = options(2);
    const schedule::ChunkPlan plan = schedule::DynamicChunk{{.token_capacity = 1500}}.plan(batch);
    for (std::size_t c = 0; c < plan.chunks.size(); ++c) {
      const auto slices = plan::chunk_slices(plan, static_cast<int>(c));
      double pairs = 0;
      for (const schedule::ChunkPiece& p : plan.pieces[c]) pairs += schedule::ChunkCost::pairs(p.begin, p.end);
      CHECK(static_cast<double>(total_area(slices)) == pairs);
    }
    // With a sliding window the slices narrow with it (the prefix cut to the w - 1 keys before a slice)
    // and cover the windowed batch's pairs exactly; the stage memory's carry term follows the window.
    const double full_carry = plan::stage_memory(plan::with_chunks(o, plan), 0, 0.0).of("K/V carry of split documents");
    for (const std::int64_t w : {1, 64, 2000, 5000}) {
      CAPTURE(w);
      const AttentionMask mask{w};
      schedule::DynamicChunk chunker{{.token_capacity = 1500}};
      chunker.args.cost.masks = MaskMix::only(mask);
      const schedule::ChunkPlan wplan = chunker.plan(batch);
      std::int64_t area = 0;
      for (std::size_t c = 0; c < wplan.chunks.size(); ++c)
        area += total_area(plan::chunk_slices(wplan, static_cast<int>(c), mask));
      CHECK(area == batch.attention_area(mask));
      plan::PipelineStepOptions windowed_options = o;
      windowed_options.mask = mask;
      const plan::PipelineStepOptions wo = plan::with_chunks(windowed_options, wplan);
      CHECK(wo.carry_tokens <= std::max<std::int64_t>(w - 1, 0));  // one split document: one prefix per chunk
      const double carry = plan::stage_memory(wo, 0, 0.0).of("K/V carry of split documents");
      if (w < 1500) CHECK(carry < full_carry);
      if (w == 1) CHECK(carry == 0);
    }
    // chunk_cost prices a layer's forward on one rank: GEMMs per token, attention per pair.
    const schedule::ChunkCost cost = plan::chunk_cost(o);
    CHECK(cost.per_token == doctest::Approx(o.model.layer_gemm_flops_per_token() / 1e12));
    CHECK(cost.per_pair == doctest::Approx(4.0 * o.model.head_dim * o.model.heads_q / 1e12));
    // Ulysses over 4 ranks: a quarter of the GEMMs and of the heads, plus the all-to-all's bandwidth.
    plan::PipelineStepOptions u = o;
    u.sp_ranks = 4;
    u.hardware.ranks_per_node = 4;
    u.hardware.intra = {1e9, 0};
    const schedule::ChunkCost uc = plan::chunk_cost(u);
    CHECK(uc.per_pair == doctest::Approx(cost.per_pair / 4));
    const double a2a_per_token = (2.0 * 64 + 2.0 * 64) * 2 / 4 * 3.0 / 4 / 1e9;  // (2 Hq d + 2 Hkv d) 2 B / 4 x 3/4
    CHECK(uc.per_token == doctest::Approx(cost.per_token / 4 + a2a_per_token).epsilon(1e-9));
    // Value heads of 16 under query/key heads of 24 (MLA-shaped): 2 (24 + 16) FLOPs per pair and head, and
    // the all-to-alls move Q, K (4 x 24 each), V and O (4 x 16 each).
    plan::PipelineStepOptions mla = u;
    mla.model.head_dim = 24;
    mla.model.head_dim_v = 16;
    const schedule::ChunkCost mc = plan::chunk_cost(mla);
    CHECK(mc.per_pair == doctest::Approx(2.0 * (24 + 16) * 4 / 4 / 1e12));
    const double mla_a2a = (4.0 * 24 + 4.0 * 24 + 4.0 * 16 + 4.0 * 16) * 2 / 4 * 3.0 / 4 / 1e9;
    CHECK(mc.per_token == doctest::Approx(mla.model.layer_gemm_flops_per_token() / 1e12 / 4 + mla_a2a).epsilon(1e-9));
  }

  TEST_CASE("pipeline step: the prefix term is the replay of the carry's programs on the stage's group") {
    const DocumentBatch batch({{3000}, {500}});
    std::vector<plan::PrefixSeconds> one_rank;
    for (int g : {1, 4}) {
      CAPTURE(g);
      plan::PipelineStepOptions o = options(2);
      o.sp_ranks = g;
      o.hardware.ranks_per_node = 4;
      const schedule::ChunkPlan plan = schedule::DynamicChunk{{.token_capacity = 1000}}.plan(batch);
      const std::vector<plan::PrefixSeconds> prefix = plan::prefix_seconds(plan, o);
      REQUIRE(prefix.size() == plan.chunks.size());
      int with_prefix = 0;
      for (std::size_t c = 0; c < plan.chunks.size(); ++c) {
        bool has = false;
        for (const Range& p : plan.chunks[c].prefix) has = has || !p.empty();
        with_prefix += has ? 1 : 0;
        CHECK((prefix[c].forward > 0) == has);  // priced exactly where a carry program runs
        CHECK((prefix[c].backward > 0) == has);
        if (has) CHECK(prefix[c].backward > prefix[c].forward);  // 2.5x the FLOPs, and the dK/dV sent back
      }
      CHECK(with_prefix >= 2);
      // Four ranks share each prefix term's queries: each term takes less time than on one.
      if (g == 1)
        one_rank = prefix;
      else
        for (std::size_t c = 0; c < prefix.size(); ++c)
          if (prefix[c].forward > 0) CHECK(prefix[c].forward < one_rank[c].forward);
    }
  }

  TEST_CASE("pipeline step: schedules that do not cover the plan are named") {
    const plan::PipelineStepOptions o = options(2);
    const schedule::ChunkPlan plan = equal_chunks(3, 100);
    schedule::PipelineSchedule s = one_pipeline(plan, o);
    s.pipelines.push_back(s.pipelines[0]);  // every chunk twice
    std::string m = invalid_message([&] { (void)plan::simulate_pipeline_step(plan, s, o); });
    CHECK(m.find("exactly one pipeline") != std::string::npos);
    s = one_pipeline(plan, o);
    s.pipelines[0].checkpointing.diagonals.pop_back();
    m = invalid_message([&] { (void)plan::simulate_pipeline_step(plan, s, o); });
    CHECK(m.find("diagonals.size()") != std::string::npos);
    s = one_pipeline(plan, o);
    s.pipelines[0].backward_order = {0, 0, 1};
    m = invalid_message([&] { (void)plan::simulate_pipeline_step(plan, s, o); });
    CHECK(m.find("permutation") != std::string::npos);
    plan::PipelineStepOptions bad = o;
    bad.stages = 3;  // 4 layers
    m = invalid_message([&] { (void)plan::simulate_pipeline_step(plan, s, bad); });
    CHECK(m.find("options.stages = 3") != std::string::npos);
  }
}
