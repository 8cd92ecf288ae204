// SPDX-License-Identifier: Apache-2.0
// seqpar-plan --pipeline-stages N: DPP's pipeline plan (DynamicChunk's chunk plan, the 1F1B pipelines of
// DPP's grouping and their checkpointing: GLPK's MILP when built with seqpar::glpk, else the greedy), on N
// stages of ranks / N ranks each.
#include <seqpar/plan/pipeline_step.hpp>
#include <seqpar/plan/stage_memory.hpp>
#include <seqpar/schedule/dynamic_chunk.hpp>
#include <seqpar/schedule/pipeline.hpp>

#if defined(SEQPAR_ENABLE_GLPK)
#include <seqpar/schedule/checkpoint_milp.hpp>
#endif

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "modes.hpp"
#include "support/json.hpp"

namespace seqpar::tools {

/// Pipeline options against the rest of the command line (before anything is computed).
void check_pipeline_options(const Options& o) {
  if (!o.pipeline_stages) {
    for (const auto& [given, name] : {std::pair{o.chunk_tokens.has_value(), "--chunk-tokens"},
                                      std::pair{o.chunk_slices.has_value(), "--chunk-slices"},
                                      std::pair{o.checkpoint_solver.has_value(), "--checkpoint-solver"},
                                      std::pair{o.milp_seconds.has_value(), "--milp-seconds"}})
      if (given) usage_error(std::string(name) + " goes with --pipeline-stages");
    return;
  }
  for (const auto& [given, name] :
       {std::pair{o.attention_only, "--attention-only"}, std::pair{o.strategies.has_value(), "--strategies"},
        std::pair{o.trace.has_value(), "--trace"}, std::pair{o.micro_batches.has_value(), "--micro-batches"},
        std::pair{o.no_checkpointing, "--no-checkpointing"}, std::pair{o.no_zero_prefetch, "--no-zero-prefetch"},
        std::pair{o.quiet, "--quiet"}})
    if (given) usage_error(std::string(name) + " does not apply to --pipeline-stages (a DPP plan of a training step)");
  if (o.ranks && *o.ranks % *o.pipeline_stages != 0)
    usage_error("--pipeline-stages " + std::to_string(*o.pipeline_stages) + " does not divide --ranks " +
                std::to_string(*o.ranks));
  const std::string solver = o.checkpoint_solver.value_or("auto");
  if (solver != "auto" && solver != "greedy" && solver != "glpk")
    usage_error("--checkpoint-solver: '" + solver + "' is not a solver (auto, greedy, glpk)");
#if !defined(SEQPAR_ENABLE_GLPK)
  if (solver == "glpk")
    usage_error("--checkpoint-solver glpk: this seqpar-plan is built without seqpar::glpk (libglpk-dev)");
#endif
  if (o.milp_seconds && solver == "greedy") usage_error("--milp-seconds goes with the glpk solver");
}

namespace {

/// The default token capacity: the largest multiple of 1024 (at least 1024) for which stage 0's 1F1B
/// window of d_p chunks fits the cap with every layer checkpointed, and which still cuts the batch into
/// at least 4 d_p chunks (1F1B's bubble, (d_p - 1) / (n + d_p - 1), then stays under 20%).
std::int64_t default_chunk_tokens(const schedule::PipelineModel& m, std::int64_t total_tokens) {
  const double per_token = m.kept_bytes_per_token * m.layers_per_stage * m.stages;
  const double room = m.memory_cap - m.static_bytes;
  const double fits = per_token > 0 ? std::max(0.0, room / per_token) : std::numeric_limits<double>::infinity();
  const double t = std::min(fits, static_cast<double>(total_tokens) / (4.0 * m.stages));
  return std::max<std::int64_t>(1024, static_cast<std::int64_t>(t) / 1024 * 1024);
}

/// "0-5, 9, 12-20" (sorted ids).
std::string id_ranges(const std::vector<int>& ids) {
  std::string out;
  for (std::size_t i = 0; i < ids.size();) {
    std::size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    out += (out.empty() ? "" : ", ") + std::to_string(ids[i]) + (j > i ? "-" + std::to_string(ids[j]) : "");
    i = j + 1;
  }
  return out;
}

/// "0 x12, 2 x3, 1 x8": a run-length view of the decisions per diagonal.
std::string run_lengths(const std::vector<int>& values) {
  std::string out;
  for (std::size_t i = 0; i < values.size();) {
    std::size_t j = i;
    while (j < values.size() && values[j] == values[i]) ++j;
    out += (out.empty() ? "" : ", ") + std::to_string(values[i]) + " x" + std::to_string(j - i);
    i = j;
  }
  return out;
}

/// One stage's 1F1B order, chunks named by their plan ids: "F0 F1 | F2 B1 F3 B0 ... | B5 B4" (warm-up
/// forwards | steady phase | drain backwards); a long steady phase keeps its first and last 4 ops.
std::string stage_order(const std::vector<schedule::StageOp>& ops, const std::vector<int>& ids) {
  const auto name = [&](const schedule::StageOp& op) {
    return std::string(op.backward ? "B" : "F") + std::to_string(ids[static_cast<std::size_t>(op.chunk)]);
  };
  std::size_t first_b = ops.size(), last_f = 0;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].backward && first_b == ops.size()) first_b = i;
    if (!ops[i].backward) last_f = i;
  }
  const auto join_ops = [&](std::size_t from, std::size_t to) {  // [from, to)
    if (from == to) return std::string("-");
    std::string s;
    if (to - from > 9) {
      for (std::size_t i = from; i < from + 4; ++i) s += (s.empty() ? "" : " ") + name(ops[i]);
      s += " ...(" + std::to_string(to - from - 8) + ")...";
      for (std::size_t i = to - 4; i < to; ++i) s += " " + name(ops[i]);
      return s;
    }
    for (std::size_t i = from; i < to; ++i) s += (s.empty() ? "" : " ") + name(ops[i]);
    return s;
  };
  // Warm-up: the forwards before the first backward, less the one the steady phase starts with.
  const std::size_t warm = first_b == 0 ? 0 : first_b - 1, drain = std::max(last_f + 1, first_b);
  return join_ops(0, warm) + " | " + join_ops(warm, drain) + " | " + join_ops(drain, ops.size());
}

}  // namespace

int run_pipeline(const Options& o, const Problem& p) {
  const int stages = *o.pipeline_stages;
  plan::PipelineStepOptions opt;
  opt.model = *p.model;
  opt.hardware = p.hardware;
  opt.stages = stages;
  opt.sp_ranks = p.topology.world_size / stages;
  opt.zero_ranks = o.zero.value_or(0);
  opt.mask = p.mask;
  if (opt.zero_ranks > opt.sp_ranks)
    usage_error("--zero " + std::to_string(opt.zero_ranks) + " is more than the " + std::to_string(opt.sp_ranks) +
                " ranks of a stage");
  opt.validate("seqpar-plan --pipeline-stages");
  schedule::DynamicChunk chunker;
  chunker.args.cost = plan::chunk_cost(opt);
  chunker.args.token_capacity =
      o.chunk_tokens.value_or(default_chunk_tokens(plan::pipeline_model(opt), p.batch.total_tokens()));
  chunker.args.slices = o.chunk_slices.value_or(0);
  const schedule::ChunkPlan plan = chunker.plan(p.batch);
  // The grouping's dynamic program and the step simulation grow faster than linearly in the chunks
  // (372 chunks: 4.5 s; 1500: over a minute and growing memory on 2 cores): refuse rather than run
  // for unbounded time and memory.
  constexpr std::size_t kMaxChunks = 1024;
  if (plan.chunks.size() > kMaxChunks)
    usage_error("--chunk-tokens " + std::to_string(chunker.args.token_capacity) + " cuts the batch into " +
                std::to_string(plan.chunks.size()) + " chunks; seqpar-plan plans at most " +
                std::to_string(kMaxChunks) + " (use a larger --chunk-tokens)");
  // The memory model with the plan's bounds: its largest chunk and prefix set the transient terms of
  // plan::stage_memory, its busiest Ulysses rank the activations' share.
  opt = plan::with_chunks(opt, plan);
  const schedule::PipelineModel pm = plan::pipeline_model(opt);

  std::string solver = o.checkpoint_solver.value_or("auto");
#if defined(SEQPAR_ENABLE_GLPK)
  if (solver == "auto") solver = "glpk";
#else
  if (solver == "auto") solver = "greedy";
#endif
  const double milp_seconds = o.milp_seconds.value_or(10.0);
  char solver_note[256];
  if (solver == "glpk")
    std::snprintf(solver_note, sizeof solver_note,
                  "glpk's MILP on each pipeline the grouping chose (2%% gap, at most %g s each; the greedy's "
                  "decisions as first incumbent), the greedy inside the grouping",
                  milp_seconds);
  else
    std::snprintf(solver_note, sizeof solver_note, "greedy%s",
                  o.checkpoint_solver ? "" : " (seqpar-plan is built without seqpar::glpk)");

  // The plan.
  const Topology& t = p.topology;
  std::printf("%s: DPP pipeline of %s on %d x %s (%d node%s of %d): %d stage%s x %d rank%s (Ulysses, ZeRO-3 over %d)\n",
              kTool, opt.model.name.c_str(), t.world_size, p.hardware.name.c_str(), t.num_nodes(),
              t.num_nodes() == 1 ? "" : "s", t.ranks_per_node, stages, stages == 1 ? "" : "s", opt.sp_ranks,
              opt.sp_ranks == 1 ? "" : "s", opt.zero());
  std::printf("  batch: %s\n", describe_batch(p).c_str());
  std::printf("  %s\n", describe_elements(p).c_str());
  int kinds[4] = {};
  for (const schedule::Chunk& c : plan.chunks) ++kinds[static_cast<int>(c.kind)];
  std::string mesh;
  for (std::int64_t cut : plan.mesh) mesh += (mesh.empty() ? "" : " ") + std::to_string(cut);
  std::printf(
      "  chunking: capacity %lld tokens%s, %d slice%s of the longest document (mesh %s), time target %.3f ms "
      "per layer; %zu chunks: %d split, %d hybrid, %d batched\n",
      static_cast<long long>(chunker.args.token_capacity), o.chunk_tokens ? "" : " (default)", plan.slices,
      plan.slices == 1 ? "" : "s", mesh.c_str(), plan.time_target * 1e3, plan.chunks.size(),
      kinds[static_cast<int>(schedule::ChunkKind::kSplit)], kinds[static_cast<int>(schedule::ChunkKind::kHybrid)],
      kinds[static_cast<int>(schedule::ChunkKind::kBatched)]);
  std::printf(
      "  memory per rank of a stage: %s static, %.1f KiB of activations per token and layer (%.1f KiB kept by a "
      "checkpointed layer), %d layers per stage, cap %s\n",
      format_gib(pm.static_bytes).c_str(), pm.activation_bytes_per_token / 1024, pm.kept_bytes_per_token / 1024,
      pm.layers_per_stage, format_gib(pm.memory_cap).c_str());
  std::printf("  checkpointing solver: %s\n", solver_note);

  std::printf("\n  %5s %-8s %6s %7s %12s %7s  %s\n", "chunk", "kind", "pieces", "tokens", "fwd ms/layer", "prefix",
              "pieces (document: rows)");
  for (std::size_t c = 0; c < plan.chunks.size(); ++c) {
    const schedule::Chunk& ch = plan.chunks[c];
    std::int64_t prefix = 0;
    for (const Range& r : ch.prefix) prefix += r.size();
    std::string pieces;
    for (std::size_t i = 0; i < plan.pieces[c].size() && i < 3; ++i) {
      const schedule::ChunkPiece& pc = plan.pieces[c][i];
      pieces += (i ? ", " : "") + std::to_string(pc.document) + ": " + std::to_string(pc.begin) + "-" +
                std::to_string(pc.end);
    }
    if (plan.pieces[c].size() > 3) pieces += ", ...";
    std::printf("  %5zu %-8s %6zu %7lld %12.3f %7lld  %s\n", c, schedule::kind_name(ch.kind), ch.tokens.size(),
                static_cast<long long>(ch.batch.total_tokens()), ch.cost * 1e3, static_cast<long long>(prefix),
                pieces.c_str());
  }

  schedule::PipelineSchedule sched;
  try {
    sched = schedule::group_pipelines(plan, pm);
  } catch (const std::invalid_argument& e) {
    std::printf("\nno pick: %s\n", one_line(e.what()).c_str());
    std::fflush(stdout);
    std::fprintf(stderr,
                 "%s: no pick: the chunks do not fit in %s per rank even with every layer checkpointed (try a "
                 "smaller --chunk-tokens or more --pipeline-stages)\n",
                 kTool, format_gib(pm.memory_cap).c_str());
    return 1;
  }
#if defined(SEQPAR_ENABLE_GLPK)
  if (solver == "glpk")
    schedule::refine_checkpointing(plan, pm, sched,
                                   schedule::milp_solver({.relative_gap = 0.02, .time_limit_s = milp_seconds}));
#endif

  long long recomputed = 0;
  for (std::size_t i = 0; i < sched.pipelines.size(); ++i) {
    const schedule::Pipeline& pipe = sched.pipelines[i];
    const schedule::CheckpointPlan& ck = pipe.checkpointing;
    recomputed += ck.layers_recomputed;
    std::vector<int> sorted = pipe.chunks;
    std::sort(sorted.begin(), sorted.end());
    std::printf("\n  pipeline %zu of %zu: %zu chunks (%s), DPP time %.3f ms, %lld layer%s recomputed (%s)\n", i + 1,
                sched.pipelines.size(), pipe.chunks.size(), id_ranges(sorted).c_str(), pipe.seconds * 1e3,
                ck.layers_recomputed, ck.layers_recomputed == 1 ? "" : "s", ck.solver.c_str());
    std::printf("    1F1B per stage (F/B + chunk; warm-up | steady | drain):\n");
    const auto order = schedule::one_f_one_b(pipe.backward_order, stages);
    for (int s = 0; s < stages; ++s)
      std::printf("      stage %d: %s\n", s, stage_order(order[static_cast<std::size_t>(s)], pipe.chunks).c_str());
    std::printf("    checkpointed layers per diagonal (%zu = chunks + stages - 1): %s\n", ck.diagonals.size(),
                run_lengths(ck.diagonals).c_str());
    std::string peaks;
    for (double b : ck.peak_bytes) {
      char cell[32];
      std::snprintf(cell, sizeof cell, "%s%.2f", peaks.empty() ? "" : " ", gib(b));
      peaks += cell;
    }
    std::printf("    peak GiB per stage (cap %.2f): %s\n", gib(pm.memory_cap), peaks.c_str());
  }
  std::printf(
      "\n* %zu pipeline%s, %zu chunk%s, %lld layer%s recomputed; the scheduler's estimate %.3f ms (its planning "
      "proxy: chunk costs on the pipeline model, no optimizer; not comparable with the strategy table)\n",
      sched.pipelines.size(), sched.pipelines.size() == 1 ? "" : "s", plan.chunks.size(),
      plan.chunks.size() == 1 ? "" : "s", recomputed, recomputed == 1 ? "" : "s", sched.seconds * 1e3);
  // The same step replayed as the strategy table replays a training step (plan::simulate_step: every
  // rank's compiled programs, ZeRO-3, the optimizer): this one compares with `step ms` of a run without
  // --pipeline-stages on the same model, batch, ranks, profile and --dtype.
  const plan::PipelineStepReport step = plan::simulate_pipeline_step(plan, sched, opt);
  std::printf(
      "  DPP training step, replayed: %.3f ms (%.0f tokens/s; bubble %.3f ms, recompute %.3f ms per stage%s): "
      "compares with 'step ms' of the strategy table (seqpar-plan without --pipeline-stages, same options)\n",
      step.step_s * 1e3, step.tokens_per_s, step.bubble_s * 1e3, step.recompute_s * 1e3,
      step.fits_memory ? "" : "; OVER the memory cap when executed");
  // Every term of each stage's memory at its executed peak (plan::stage_memory).
  std::printf(
      "  memory per rank at each stage's executed peak (largest chunk %lld tokens, largest prefix %lld, "
      "busiest rank x%.4f), GiB:\n",
      static_cast<long long>(opt.chunk_tokens), static_cast<long long>(opt.carry_tokens), opt.rank_imbalance);
  for (int s = 0; s < stages; ++s) {
    const plan::PipelineStageReport& st = step.stages[static_cast<std::size_t>(s)];
    const plan::MemoryBreakdown mb = plan::stage_memory(opt, s, st.peak_memory_bytes - pm.static_bytes);
    std::printf("    stage %d:", s);
    for (const plan::MemoryTerm& term : mb.terms) std::printf(" %s %.3f;", term.name.c_str(), gib(term.bytes));
    std::printf(" total %.3f (cap %.2f)\n", gib(mb.total()), gib(pm.memory_cap));
  }
  std::fflush(stdout);

  if (o.json) {
    bench::JsonRecord head;
    head.add("tool", kTool)
        .add("mode", "pipeline")
        .add("profile", p.hardware.name)
        .add("ranks", t.world_size)
        .add("ranks_per_node", t.ranks_per_node)
        .add("model", opt.model.name)
        .add("stages", stages)
        .add("ranks_per_stage", opt.sp_ranks)
        .add("zero_ranks", opt.zero())
        .add("tokens", p.batch.total_tokens())
        .add("documents", p.documents)
        .add("longest_document", p.longest_document)
        .add("lengths_source", p.lengths_source)
        .add("token_capacity", chunker.args.token_capacity)
        .add("slices", plan.slices)
        .add("time_target_s", plan.time_target)
        .add("static_bytes", pm.static_bytes)
        .add("activation_bytes_per_token", pm.activation_bytes_per_token)
        .add("kept_bytes_per_token", pm.kept_bytes_per_token)
        .add("layers_per_stage", pm.layers_per_stage)
        .add("memory_cap_bytes", pm.memory_cap)
        .add("solver", solver)
        .add("predicted_s", sched.seconds)
        .add("replayed_step_s", step.step_s)
        .add("replayed_fits_memory", step.fits_memory)
        .add("dtype", p.dtype)
        .add("value_bytes", p.hardware.value_bytes)
        .add("layers_recomputed", recomputed);
    std::string out = "{\n  \"plan\": " + head.str() + ",\n  \"chunks\": [";
    for (std::size_t c = 0; c < plan.chunks.size(); ++c) {
      const schedule::Chunk& ch = plan.chunks[c];
      std::int64_t prefix = 0;
      for (const Range& r : ch.prefix) prefix += r.size();
      bench::JsonRecord rec;
      rec.add("chunk", static_cast<std::int64_t>(c))
          .add("kind", schedule::kind_name(ch.kind))
          .add("pieces", static_cast<std::int64_t>(ch.tokens.size()))
          .add("tokens", ch.batch.total_tokens())
          .add("forward_s_per_layer", ch.cost)
          .add("prefix_tokens", prefix);
      out += (c ? ",\n    " : "\n    ") + rec.str();
    }
    out += "\n  ],\n  \"pipelines\": [";
    for (std::size_t i = 0; i < sched.pipelines.size(); ++i) {
      const schedule::Pipeline& pipe = sched.pipelines[i];
      const auto list = [](const auto& v) {
        std::string s = "[";
        for (std::size_t k = 0; k < v.size(); ++k) {
          std::ostringstream x;
          x.precision(6);
          x << v[k];
          s += (k ? ", " : "") + x.str();
        }
        return s + "]";
      };
      bench::JsonRecord rec;
      rec.add("seconds", pipe.seconds)
          .add("layers_recomputed", pipe.checkpointing.layers_recomputed)
          .add("solver", pipe.checkpointing.solver)
          .add("feasible", pipe.checkpointing.feasible);
      std::string r = rec.str();
      r.pop_back();  // the lists go inside the record
      r += ", \"chunks\": " + list(pipe.chunks) + ", \"backward_order\": " + list(pipe.backward_order) +
           ", \"diagonals\": " + list(pipe.checkpointing.diagonals) +
           ", \"peak_bytes\": " + list(pipe.checkpointing.peak_bytes) + "}";
      out += (i ? ",\n    " : "\n    ") + r;
    }
    write_file(*o.json, out + "\n  ]\n}\n", "--json");
  }
  return 0;
}

}  // namespace seqpar::tools
