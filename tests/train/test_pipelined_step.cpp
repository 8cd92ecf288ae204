// SPDX-License-Identifier: Apache-2.0
// DPP end to end (issue 12, item 4): train::run_pipelined_step runs a TinyTransformer step (its stages as
// testing::TinyStage, a train::PipelineStage) with the
// DynamicChunk plan (split, batched and hybrid chunks; later slices read their document's earlier
// K/V), the 1F1B pipelines of group_pipelines, and the schedule's checkpointing, on in-process ranks
// = pipeline stages x an attention group running a seqpar strategy. The loss and every parameter's
// gradient (summed over ranks) must equal a single-device full-batch step (fp64 reference attention)
// at 1e-9, and each rank's activation bytes right after every forward must equal the memory model's.
#include <doctest/doctest.h>

#include <seqpar/attention/cpu_flash.hpp>
#include <seqpar/backend/inproc/world.hpp>
#include <seqpar/plan/model_shape.hpp>
#include <seqpar/seqpar.hpp>
#include <seqpar/train/pipelined_step.hpp>
#include <seqpar_testing/pipelined_step.hpp>
#include <seqpar_testing/reference_step.hpp>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <random>
#include <string>
#include <vector>

using namespace seqpar;
using Model = testing::TinyTransformer<double>;
using Kernel = attention::CpuFlash<double>;

namespace {

// A long-tail batch: two sequences, a long document in each among short ones; random token ids.
train::TokenBatch make_batch(std::mt19937_64& rng, int vocab, std::int64_t long_len) {
  std::vector<std::vector<std::int64_t>> seqs(2);
  seqs[0] = {long_len};
  seqs[1] = {long_len / 2 + 7};
  for (auto& s : seqs)
    for (int i = 0; i < 5; ++i) s.push_back(2 + static_cast<std::int64_t>(rng() % 23));
  std::shuffle(seqs[0].begin(), seqs[0].end(), rng);
  std::shuffle(seqs[1].begin(), seqs[1].end(), rng);
  train::TokenBatch b{DocumentBatch(seqs), {}};
  for (std::int64_t i = 0; i < b.documents.total_tokens(); ++i)
    b.tokens.push_back(static_cast<int>(rng() % static_cast<std::uint64_t>(vocab)));
  return b;
}

struct Layout {
  int stages, attention;
};

template <class S>
void check_pipelined(const std::string& name, Layout layout, typename S::Arguments args, std::uint64_t seed) {
  CAPTURE(name);
  CAPTURE(layout.stages);
  CAPTURE(layout.attention);
  std::mt19937_64 rng(seed);
  const int layers = layout.stages * 2;
  Model model({.vocab = 17, .dim = 8, .layers = layers, .heads_q = 4, .heads_kv = 2, .head_dim = 4, .ffn = 12});
  model.init(seed);
  const train::TokenBatch batch = make_batch(rng, 17, 96 + static_cast<std::int64_t>(rng() % 40));

  // DPP's plan: chunks of at most 40 tokens (the long documents split 3-4 ways, later slices shorter).
  schedule::DynamicChunk chunker;
  chunker.args.token_capacity = 40;
  chunker.args.cost = {.per_token = 6.0 * 8, .per_pair = 1.0};
  const schedule::ChunkPlan plan = chunker.plan(batch.documents);
  bool split = false;
  for (const auto& ch : plan.chunks)
    for (const Range& p : ch.prefix) split = split || !p.empty();
  REQUIRE(split);
  // Memory: the cap at 60% of the largest stage peak without checkpointing, so the schedule
  // checkpoints some chunks' layers on some stages.
  // The model plans each rank: a row's bytes times the busiest rank's share of a chunk (issue 28 item 6).
  const double share = testing::busiest_share(
      plan,
      testing::busiest_rank_tokens<S>(model, plan, layout.attention, args, [] { return Kernel({.threads = 1}); }));
  schedule::PipelineModel pm{
      .stages = layout.stages,
      .layers_per_stage = 2,
      .static_bytes = 0,
      .memory_cap = 1,
      .activation_bytes_per_token = static_cast<double>(model.activation_values_per_row() * 8) * share,
      .kept_bytes_per_token = 8.0 * 8 * share,
      .seconds_per_cost = 1e-9};
  {
    schedule::PipelineModel roomy = pm;
    roomy.memory_cap = 1e30;
    double peak = 0;
    for (const auto& p : schedule::group_pipelines(plan, roomy).pipelines)
      for (double b : p.checkpointing.peak_bytes) peak = std::max(peak, b);
    pm.memory_cap = 0.6 * peak;
  }
  const schedule::PipelineSchedule sched = schedule::group_pipelines(plan, pm);

  const auto want = testing::single_device_step(model, batch);
  const double want_loss = want.loss;
  const std::vector<double>& want_grads = want.grads;

  std::vector<double> grads(model.num_params(), 0.0);
  double loss_sum = 0;
  long long recomputed = 0;
  std::int64_t label_tokens = 0;
  std::vector<std::string> memory_mismatch;
  std::mutex mu;
  backend::inproc::World(layout.stages * layout.attention).run([&](backend::inproc::Transport& t) {
    testing::TinyStage<double> stage(model, train::pipeline_layout(t.size(), t.rank(), layout.stages).stage,
                                     layout.stages);
    const auto r =
        train::run_pipelined_step<S>(t, stage, batch, plan, sched, pm, args, [] { return Kernel({.threads = 1}); });
    const std::lock_guard lock(mu);
    for (std::size_t i = 0; i < grads.size(); ++i) grads[i] += stage.grads()[i];
    loss_sum += r.loss_sum;
    recomputed += r.layers_recomputed;
    label_tokens = r.label_tokens;
    if (static_cast<double>(r.peak_activation_bytes) > pm.memory_cap)
      memory_mismatch.push_back("rank " + std::to_string(t.rank()) + ": measured " +
                                std::to_string(r.peak_activation_bytes) + " over the cap " +
                                std::to_string(pm.memory_cap));
    if (static_cast<double>(r.peak_activation_bytes) != r.predicted_peak_bytes)
      memory_mismatch.push_back("rank " + std::to_string(t.rank()) + ": measured " +
                                std::to_string(r.peak_activation_bytes) + " predicted " +
                                std::to_string(r.predicted_peak_bytes));
  });
  CHECK(recomputed > 0);  // the checkpointing path ran
  CHECK(memory_mismatch.empty());
  for (const auto& m : memory_mismatch) MESSAGE(m);
  const double loss = loss_sum / static_cast<double>(label_tokens);
  CHECK(std::abs(loss - want_loss) <= 1e-9 * std::abs(want_loss));
  for (const Model::Block& blk : model.blocks()) {
    double scale = 0, err = 0;
    for (std::size_t i = blk.offset; i < blk.offset + blk.size; ++i) {
      scale = std::max(scale, std::abs(want_grads[i]));
      err = std::max(err, std::abs(grads[i] - want_grads[i]));
    }
    CAPTURE(blk.name);
    CHECK(scale > 0);
    CHECK(err <= 1e-9 * scale);
  }
}

}  // namespace

TEST_SUITE("train") {
  TEST_CASE("memory model: a TinyTransformer layer's cache is ModelShape's activation terms, row for row") {
    // The tiny model keeps its statistics (LSE, inverse RMS) in T, so both byte sizes are sizeof(T).
    const testing::TinyConfig cfg{
        .vocab = 17, .dim = 8, .layers = 2, .heads_q = 4, .heads_kv = 2, .head_dim = 4, .ffn = 12};
    Model model(cfg);
    model.init(7);
    const plan::ModelShape shape{"tiny",       cfg.layers, cfg.dim,   cfg.heads_q, cfg.heads_kv,
                                 cfg.head_dim, cfg.ffn,    cfg.vocab, true};
    CHECK(shape.layer_activation_bytes_per_token(8.0, 8.0) ==
          static_cast<double>(model.activation_values_per_row() * 8));
    for (const std::size_t n : {1U, 5U, 33U}) {
      CAPTURE(n);
      std::vector<double> x(n * 8), out(n * 8);
      for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37 * static_cast<double>(i));
      std::vector<std::int64_t> pos(n);
      for (std::size_t i = 0; i < n; ++i) pos[i] = static_cast<std::int64_t>(i);
      Model::LayerCache cache;
      model.layer_forward(
          1, x, pos, [](auto, auto, auto, auto, auto) {}, cache, out);
      CHECK(static_cast<double>(cache.bytes()) ==
            static_cast<double>(n) * shape.layer_activation_bytes_per_token(8.0, 8.0));
      cache.checkpoint();
      CHECK(static_cast<double>(cache.bytes()) == static_cast<double>(n) * cfg.dim * 8.0);
    }
  }

  TEST_CASE("pipelined DPP step: loss and every gradient equal the single-device step, memory as modelled") {
    using HybridRing = Strategy<partition::Hybrid, comm::Ring>;
    using ZigzagRing = Strategy<partition::Zigzag, comm::Ring>;
    using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
    HybridRing::Arguments aware;
    aware.comm.sharding_aware = true;
    std::uint64_t seed = 100;
    for (Layout layout : {Layout{1, 1}, Layout{2, 1}, Layout{4, 1}, Layout{2, 2}, Layout{3, 2}, Layout{2, 3}})
      check_pipelined<HybridRing>("Hybrid x Ring(sharding-aware)", layout, aware, ++seed);
    for (Layout layout : {Layout{2, 2}, Layout{2, 4}}) check_pipelined<ZigzagRing>("Zigzag x Ring", layout, {}, ++seed);
    for (Layout layout : {Layout{2, 2}, Layout{3, 1}})
      check_pipelined<Ulysses>("Uniform x AllToAll", layout, {}, ++seed);
  }
}
