// SPDX-License-Identifier: Apache-2.0
// 10: a DPP training step end to end: a TinyTransformer (8 layers) on 4 pipeline stages x 2 attention
// ranks (8 in-process ranks), the batch cut by schedule::DynamicChunk, the chunks grouped into 1F1B
// pipelines by schedule::group_pipelines under a per-stage memory cap (which makes it checkpoint
// some chunks' layers on some stages), and each stage's attention run by Hybrid x sharding-aware
// Ring through runtime::ChunkedAttention (train::run_pipelined_step, the model's stages given as
// testing::TinyStage, a train::PipelineStage: a model of one's own runs the same way).
//
// It prints the plan, then per stage the activation memory: what the planner predicted (the busiest
// rank's peak under the schedule's decisions: a row's bytes times the largest share of a chunk a rank
// holds), what the memory model gives for each
// rank's actual rows, what each rank measured (bytes of the layer activations it held right after
// every forward: the quantity DPP's checkpointing bounds), and what the model leaves out (the
// attention's K/V carry for later slices, the last stage's loss gradients between a chunk's forward
// and backward, a recomputed layer's activations). Then the check: loss and every parameter's
// gradient (summed over ranks) against a single-device step over the whole batch; exit 1 above 1e-9,
// if any rank's measured bytes differ from the memory model for its rows, or if any rank's measured bytes
// exceed its cap (the planner plans with the busiest rank's rows of each chunk, so none should).
//   usage: 10_dpp_pipeline [--smoke] [--tokens T] [--threads K]
#include "example_support.hpp"

#include <seqpar/train/pipelined_step.hpp>
#include <seqpar_testing/pipelined_step.hpp>
#include <seqpar_testing/reference_step.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <random>
#include <vector>

using namespace seqpar;
using namespace seqpar::examples;
using HybridRing = Strategy<partition::Hybrid, comm::Ring>;
using Kernel = attention::CpuFlash<double>;
constexpr int kStages = 4, kAttention = 2;

int main(int argc, char** argv) {
  Options opt{.tokens = 2048};
  if (!parse_options(argc, argv, opt, 512)) return 2;
  const std::int64_t t = opt.tokens;
  // Two sequences of T/2 tokens: a document of T/4 (and one of 3T/16) among lognormal short ones.
  std::mt19937 rng(2028);
  std::vector<std::vector<std::int64_t>> seqs;
  for (std::int64_t longest : {t / 4, 3 * t / 16})
    seqs.push_back(long_tail_sequence(rng, t / 2, {longest}, double(t) / 128, t / 32));
  train::TokenBatch batch{DocumentBatch(seqs), {}};
  const testing::TinyConfig cfg{
      .vocab = 64, .dim = 32, .layers = 8, .heads_q = 4, .heads_kv = 2, .head_dim = 8, .ffn = 64};
  for (std::int64_t i = 0; i < batch.documents.total_tokens(); ++i)
    batch.tokens.push_back(static_cast<int>(rng() % static_cast<unsigned>(cfg.vocab)));
  testing::TinyTransformer<double> model(cfg);
  model.init(42);

  schedule::DynamicChunk chunker;
  chunker.args.token_capacity = t / 8;
  chunker.args.cost = {.per_token = 6.0 * cfg.dim, .per_pair = 1.0};
  const schedule::ChunkPlan plan = chunker.plan(batch.documents);
  // The memory model plans each rank of a stage: a row's bytes times the busiest rank's share of a chunk
  // (Hybrid's partition is uneven, so tokens / 2 would let one rank exceed the cap the plan fits).
  HybridRing::Arguments args;
  args.comm.sharding_aware = true;
  const auto make_kernel = [&] { return Kernel({.threads = opt.threads}); };
  const double share = testing::busiest_share(
      plan, testing::busiest_rank_tokens<HybridRing>(model, plan, kAttention, args, make_kernel));
  schedule::PipelineModel pm{
      .stages = kStages,
      .layers_per_stage = cfg.layers / kStages,
      .static_bytes = 0,
      .memory_cap = 1e30,
      .activation_bytes_per_token = double(model.activation_values_per_row() * sizeof(double)) * share,
      .kept_bytes_per_token = double(cfg.dim * sizeof(double)) * share,
      .seconds_per_cost = 1e-9};
  // The cap per rank: 60% of the largest stage peak without checkpointing.
  double roomy = 0;
  for (const auto& p : schedule::group_pipelines(plan, pm).pipelines)
    for (double b : p.checkpointing.peak_bytes) roomy = std::max(roomy, b);
  pm.memory_cap = 0.6 * roomy;
  const schedule::PipelineSchedule sched = schedule::group_pipelines(plan, pm);

  int split = 0;
  for (const auto& ch : plan.chunks) split += ch.kind == schedule::ChunkKind::kSplit ? 1 : 0;
  long long planned_recompute = 0;
  for (const auto& p : sched.pipelines) planned_recompute += p.checkpointing.layers_recomputed;
  std::printf(
      "seqpar 10: a DPP step of a %d-layer TinyTransformer (dim %d, heads %d:%d, d %d, fp64) on %d stages x %d "
      "attention ranks, Hybrid x sharding-aware Ring\n",
      cfg.layers, cfg.dim, cfg.heads_q, cfg.heads_kv, cfg.head_dim, kStages, kAttention);
  std::printf(
      "batch: %lld tokens, %zu documents; %zu chunks (%d split), %zu pipelines; cap %.1f KiB per rank (60%% of the "
      "peak without checkpointing; planned with the busiest rank's share of a chunk, %.3f); %lld layers "
      "checkpointed (sum over diagonals)\n",
      static_cast<long long>(batch.documents.total_tokens()), batch.documents.documents().size(), plan.chunks.size(),
      split, sched.pipelines.size(), pm.memory_cap / 1024, share, planned_recompute);

  const auto want = testing::single_device_step(model, batch);

  std::vector<double> grads(model.num_params(), 0.0);
  std::vector<train::PipelinedStepResult<double>> results(kStages * kAttention);
  double loss_sum = 0;
  std::mutex mu;
  const auto start = std::chrono::steady_clock::now();
  backend::inproc::World(kStages * kAttention).run([&](backend::inproc::Transport& tr) {
    testing::TinyStage<double> stage(model, train::pipeline_layout(tr.size(), tr.rank(), kStages).stage, kStages);
    auto r = train::run_pipelined_step<HybridRing>(tr, stage, batch, plan, sched, pm, args, make_kernel);
    const std::lock_guard lock(mu);
    for (std::size_t i = 0; i < grads.size(); ++i) grads[i] += stage.grads()[i];
    loss_sum += r.loss_sum;
    results[static_cast<std::size_t>(tr.rank())] = std::move(r);
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  std::printf("\nactivation memory per rank, KiB (max over the stage's ranks; planner = the busiest rank's peak):\n");
  std::printf("%5s %10s %10s %10s %9s %10s %12s %10s\n", "stage", "planner", "model", "measured", "planner", "carry",
              "+loss grads", "layers");
  std::printf("%5s %10s %10s %10s %9s %10s %12s %10s\n", "", "", "(rows)", "", "error", "", "+recompute", "recomputed");
  bool memory_ok = true, over_cap = false;
  for (int s = 0; s < kStages; ++s) {
    double planner = 0, model_b = 0, measured = 0, carry = 0, extras = 0;
    long long recomputed = 0;
    for (const auto& p : sched.pipelines)
      planner = std::max(planner, p.checkpointing.peak_bytes[static_cast<std::size_t>(s)]);
    for (int a = 0; a < kAttention; ++a) {
      const auto& r = results[static_cast<std::size_t>(s * kAttention + a)];
      model_b = std::max(model_b, r.predicted_peak_bytes);
      measured = std::max(measured, double(r.peak_activation_bytes));
      carry = std::max(carry, double(r.carry_bytes));
      extras = std::max(extras, double(r.peak_bytes_with_extras));
      recomputed = std::max(recomputed, r.layers_recomputed);
      memory_ok = memory_ok && double(r.peak_activation_bytes) == r.predicted_peak_bytes;
      if (double(r.peak_activation_bytes) > pm.memory_cap) {
        over_cap = true;
        std::printf("rank %d (stage %d): measured %.1f KiB of activations, over its cap %.1f KiB\n", s * kAttention + a,
                    s, double(r.peak_activation_bytes) / 1024, pm.memory_cap / 1024);
      }
    }
    std::printf("%5d %10.1f %10.1f %10.1f %8.1f%% %10.1f %12.1f %10lld\n", s, planner / 1024, model_b / 1024,
                measured / 1024, 100.0 * (planner - measured) / measured, carry / 1024, extras / 1024, recomputed);
  }

  const double loss = loss_sum / static_cast<double>(batch.label_tokens());
  double err = std::abs(loss - want.loss) / std::abs(want.loss);
  for (const auto& blk : model.blocks()) {
    double scale = 0, e = 0;
    for (std::size_t i = blk.offset; i < blk.offset + blk.size; ++i) {
      scale = std::max(scale, std::abs(want.grads[i]));
      e = std::max(e, std::abs(grads[i] - want.grads[i]));
    }
    err = std::max(err, scale > 0 ? e / scale : e);
  }
  std::printf(
      "\nloss %.12f (single device %.12f); max over loss and every parameter block of max |err| / max |ref|: %.2e\n",
      loss, want.loss, err);
  std::printf(
      "pipelined step: %.3f s wall on %d in-process ranks (this machine's cores are shared; not a speed claim)\n",
      seconds, kStages * kAttention);
  const bool ok = err <= 1e-9 && memory_ok && !over_cap;
  std::printf("%s\n", ok           ? "OK"
                      : over_cap   ? "FAILED: a rank's measured activations exceed its cap"
                      : !memory_ok ? "FAILED: measured bytes differ from the model"
                                   : "FAILED: error above 1e-9");
  return ok ? 0 : 1;
}
