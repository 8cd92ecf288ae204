// SPDX-License-Identifier: Apache-2.0
// replay --paper dpp: DPP (InfiniPipe's dynamic pipeline parallelism) against FlexSP-, DeepSpeed-, Megatron-
// and Seq1F1B-like baselines, and its ablations.
#include <seqpar/plan/model_shape.hpp>
#include <seqpar/plan/pipeline_step.hpp>
#include <seqpar/plan/stage_memory.hpp>
#include <seqpar/plan/workloads.hpp>
#include <seqpar/replay/hardware.hpp>
#include <seqpar/seqpar.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "replay.hpp"
#include "support/dpp_baselines.hpp"

namespace seqpar::bench::papers {
namespace {

// ---------------------------------------------------------------------------------------------------------
// DPP (InfiniPipe / Concertina, seeds.md section 4): a training step of 512 sequences on 4 nodes x 8
// A800-80GB (replay::profiles::a800_80gb(): NVLink 400 GB/s bidirectional, one 400 Gb/s IB NIC a node),
// LLaMA 7B / 13B / 30B, CommonCrawl- and GitHub-like lengths (plan/workloads.hpp) truncated at 48K or 96K.
// DPP: Ulysses d_s = 8 inside a node x pipeline d_p = 4 across nodes, ZeRO-3 inside a stage;
// schedule::DynamicChunk's workload-balanced chunks (costs from plan::chunk_cost), schedule::group_pipelines
// with the greedy checkpointing solver, stepped by plan::simulate_pipeline_step. The chunk token capacity (the paper's
// outer solver tunes the slice count K) is swept, and the fastest plan whose executed memory fits is kept.
// Baselines, with the paper's tuned settings [R]: FlexSP-like (heterogeneous Ulysses groups) and
// DeepSpeed-like (Ulysses 16 for 7B, 32 otherwise), both ZeRO-3 over 32 ranks, 36 checkpointed layers for
// 30B and none otherwise; Megatron-like TP 8 x CP 2 (7B) or 4, ZeRO-1 over the rest, 10 / 20 / 55
// checkpointed layers (bench/support/dpp_baselines.hpp); Seq1F1B-like: the same pipelines over fixed-size
// chunks (equal-length slices, sequences packed by tokens), one 1F1B pipeline, one checkpointing setting
// for every chunk and stage (the fewest layers that fit), capacity swept too.
// Ablations (the paper: 13B, 64K [R]): DPP without balanced chunking (fixed-size chunks, DPP's grouping
// and checkpointing), without checkpointing, with full checkpointing.
// ---------------------------------------------------------------------------------------------------------

enum class DppVariant { kDpp, kNoBalance, kNoCheckpointing, kFullCheckpointing, kSeq1F1B };

struct DppRun {
  bool ok = false;
  std::string reason;
  plan::PipelineStepReport rep;
  plan::PipelineStepOptions options;  ///< with the kept plan's bounds (plan::with_chunks)
  std::int64_t capacity = 0;
  int slices = 0;
};

/// Checkpointing every chunk and stage the same `layers` (no search).
schedule::CheckpointSolver uniform_checkpointing(int layers) {
  return [layers](const schedule::CheckpointProblem& prob) {
    return schedule::evaluate(prob, std::vector<int>(static_cast<std::size_t>(prob.diagonals()), layers), "uniform");
  };
}

DppRun run_dpp_variant(const DocumentBatch& batch, const plan::PipelineStepOptions& opt, DppVariant v,
                       const std::vector<std::int64_t>& capacities) {
  const schedule::ChunkCost real = plan::chunk_cost(opt);
  const bool fixed_size = v == DppVariant::kNoBalance || v == DppVariant::kSeq1F1B;
  DppRun best;
  std::string last_reason = "no capacity tried";
  for (const std::int64_t cap : capacities) {
    schedule::DynamicChunk::Arguments a;
    a.token_capacity = cap;
    a.cost = real;
    if (fixed_size) {  // cost = tokens: equal-length slices, buckets filled by tokens up to the capacity
      a.cost = {1.0, 0.0};
      a.time_target = static_cast<double>(cap);
    }
    schedule::ChunkPlan chunks = schedule::DynamicChunk{a}.plan(batch);
    if (fixed_size)  // the pipeline scheduler still sees seconds
      for (std::size_t c = 0; c < chunks.chunks.size(); ++c) {
        double cost = 0;
        for (const schedule::ChunkPiece& p : chunks.pieces[c]) cost += real.of(p.begin, p.end);
        chunks.chunks[c].cost = cost;
      }
    // The memory model with this plan's bounds: its largest chunk and prefix set the transient terms,
    // its busiest Ulysses rank the activations' share (plan::stage_memory).
    const plan::PipelineStepOptions o = plan::with_chunks(opt, chunks);
    const schedule::PipelineModel pm = plan::pipeline_model(o);
    const auto try_schedule = [&](const schedule::PipelineSchedule& sched) {
      plan::PipelineStepReport rep = plan::simulate_pipeline_step(chunks, sched, o);
      if (!rep.fits_memory) {
        last_reason = "capacity " + std::to_string(cap) + ": executed peak " +
                      fmt("%.1f", rep.max_peak_memory_bytes() / replay::profiles::kGB) + " GB over the cap " +
                      fmt("%.1f", rep.memory_cap_bytes / replay::profiles::kGB) + " GB";
        return false;
      }
      if (!best.ok || rep.step_s < best.rep.step_s) {
        best.ok = true;
        best.rep = std::move(rep);
        best.options = o;
        best.capacity = cap;
        best.slices = chunks.slices;
      }
      return true;
    };
    try {
      if (v == DppVariant::kSeq1F1B) {
        // One 1F1B pipeline over every chunk, the fewest uniformly checkpointed layers that fit.
        schedule::PipelineSchedule sched;
        sched.pipelines.resize(1);
        schedule::CheckpointProblem prob{{}, pm, {}};
        for (std::size_t c = 0; c < chunks.chunks.size(); ++c) {
          sched.pipelines[0].chunks.push_back(static_cast<int>(c));
          prob.tokens.push_back(chunks.chunks[c].batch.total_tokens());
        }
        sched.pipelines[0].backward_order = schedule::backward_order(chunks, sched.pipelines[0].chunks);
        prob.backward_order = sched.pipelines[0].backward_order;
        for (int k = 0; k <= pm.layers_per_stage; ++k) {
          sched.pipelines[0].checkpointing = uniform_checkpointing(k)(prob);
          if (sched.pipelines[0].checkpointing.feasible) break;
        }
        (void)try_schedule(sched);
        continue;
      }
      schedule::CheckpointSolver solver = schedule::solve_checkpointing;
      if (v == DppVariant::kNoCheckpointing) solver = uniform_checkpointing(0);
      if (v == DppVariant::kFullCheckpointing) solver = uniform_checkpointing(pm.layers_per_stage);
      (void)try_schedule(schedule::group_pipelines(chunks, pm, solver));
    } catch (const std::invalid_argument& e) {
      last_reason = "capacity " + std::to_string(cap) + ": " + e.what();
    }
  }
  if (!best.ok) best.reason = last_reason;
  return best;
}

void print_terms(const plan::MemoryBreakdown& m, double cap, const char* indent) {
  for (const plan::MemoryTerm& t : m.terms)
    std::printf("%s%-58s %8.2f GB\n", indent, t.name.c_str(), t.bytes / replay::profiles::kGB);
  std::printf("%s%-58s %8.2f GB (cap %.2f GB)\n", indent, "total", m.total() / replay::profiles::kGB,
              cap / replay::profiles::kGB);
}

/// --explain: the memory of every stage of a DPP run at its executed peak, term by term.
void explain_run(const std::string& label, const DppRun& r) {
  if (!r.ok) return;
  const schedule::PipelineModel pm = plan::pipeline_model(r.options);
  std::printf("  %s memory per rank (largest chunk %lld tokens, largest prefix %lld, busiest rank x%.4f):\n",
              label.c_str(), static_cast<long long>(r.options.chunk_tokens),
              static_cast<long long>(r.options.carry_tokens), r.options.rank_imbalance);
  for (std::size_t p = 0; p < r.rep.stages.size(); ++p) {
    const double acts = r.rep.stages[p].peak_memory_bytes - pm.static_bytes;
    std::printf("    stage %zu (executed peak %.2f GB; planned %.2f GB):\n", p,
                r.rep.stages[p].peak_memory_bytes / replay::profiles::kGB,
                r.rep.stages[p].planned_peak_memory_bytes / replay::profiles::kGB);
    print_terms(plan::stage_memory(r.options, static_cast<int>(p), acts), pm.memory_cap, "      ");
  }
}

struct DppWorkload {
  plan::ModelShape model;
  std::string mix;
  std::int64_t context;
  bool ablation = false;  ///< run the ablated variants (the paper's 13B, 64K)
};

std::string dpp_workload_name(const DppWorkload& w) {
  std::string m = w.model.name.substr(w.model.name.find('-') + 1);
  return w.model.name.substr(0, w.model.name.find('-')) + "-" + m + " " + w.mix + " " +
         std::to_string(w.context / 1024) + "K";
}

}  // namespace

void run_dpp(bool smoke, Results& out, bool explain) {
  const replay::HardwareProfile hw = replay::profiles::a800_80gb();
  const int sequences = smoke ? 64 : 512;
  std::vector<DppWorkload> ws;
  if (smoke) {
    ws = {{plan::models::llama_7b(), "commoncrawl", 16384, true}};
  } else {
    for (const std::int64_t ctx : {49152, 98304})
      for (const char* mix : {"commoncrawl", "github"})
        for (const auto& m : {plan::models::llama_7b(), plan::models::llama_13b(), plan::models::llama_30b()})
          ws.push_back({m, mix, ctx, false});
    for (const char* mix : {"commoncrawl", "github"}) ws.push_back({plan::models::llama_13b(), mix, 65536, true});
  }
  std::printf("\n== DPP (4 nodes x 8 %s, %d sequences a step; training step) ==\n", hw.name.c_str(), sequences);
  std::printf("%-28s %-18s %9s %9s %9s %-16s %s\n", "workload", "strategy", "step s", "speedup", "paper", "baseline",
              "notes");
  for (const DppWorkload& w : ws) {
    const std::string wname = dpp_workload_name(w);
    const auto lengths = plan::workloads::sample_sequences(w.mix, sequences, w.context, 512);
    std::vector<std::vector<std::int64_t>> seqs;
    for (std::int64_t l : lengths) seqs.push_back({l});
    const DocumentBatch batch(seqs);
    plan::PipelineStepOptions opt;
    opt.model = w.model;
    opt.hardware = hw;
    opt.stages = 4;
    opt.sp_ranks = 8;
    std::vector<std::int64_t> caps;
    for (const std::int64_t c : {4096, 8192, 12288, 16384, 24576, 32768, 49152})
      if (c <= w.context && (!smoke || c <= 8192)) caps.push_back(c);
    const bool b7 = w.model.layers == 32, b30 = w.model.layers == 60;
    const DppRun dpp = run_dpp_variant(batch, opt, DppVariant::kDpp, caps);

    const auto dpp_notes = [&](const DppRun& r) {
      if (!r.ok) return r.reason;
      const plan::PipelineStepReport& p = r.rep;
      return "capacity " + std::to_string(r.capacity / 1024) + "K, K " + std::to_string(r.slices) + ", " +
             std::to_string(p.chunks) + " chunks in " + std::to_string(p.pipelines) + " pipeline(s), bubble " +
             fmt("%.0f", 100 * p.bubble_s / p.step_s) + "%, P2P " + fmt("%.1f", 100 * p.p2p_s / p.step_s) +
             "%, recompute " + fmt("%.1f", 100 * p.recompute_s / p.step_s) + "%, all-to-all " +
             fmt("%.1f", 100 * p.all_to_all_s / p.step_s) + "%, ZeRO exposed " +
             fmt("%.1f", 100 * p.zero_exposed_s / p.step_s) + "%, peak " +
             fmt("%.1f", p.max_peak_memory_bytes() / replay::profiles::kGB) + " GB";
    };
    const auto baseline_notes = [](const bench::dpp::BaselineStep& b) {
      if (!b.feasible) return b.reason;
      return std::to_string(b.micro_batches) + " micro-batches, " + b.layout + ", compute " +
             fmt("%.0f", 100 * b.compute_s / b.step_s) + "%, comm " + fmt("%.0f", 100 * b.all_to_all_s / b.step_s) +
             "%, ZeRO exposed " + fmt("%.0f", 100 * b.zero_exposed_s / b.step_s) + "%, imbalance " +
             fmt("%.2f", b.imbalance);
    };
    std::string mine;  // DPP's own breakdown, carried by every record of the workload
    const auto add = [&](const std::string& strategy, const std::string& type, const std::string& baseline,
                         double strategy_s, double baseline_s, double paper, const std::string& paper_text, bool bound,
                         bool refused, const std::string& notes) {
      Record r;
      r.paper = "DPP";
      r.workload = wname;
      r.strategy = strategy;
      r.type = type;
      r.baseline = baseline;
      r.metric = "training step";
      r.paper_speedup = paper;
      r.paper_figure = paper_text;
      r.paper_bound = bound;
      r.notes = mine.empty() || refused ? notes : mine + "; " + notes;
      if (refused) {
        r.refused = true;
        r.reason = notes;
        std::printf("%-28s %-18s refused: %s\n", wname.c_str(), strategy.c_str(), notes.c_str());
        out.records.push_back(r);
        return;
      }
      r.predicted_s = strategy_s;
      r.baseline_s = baseline_s;
      r.speedup = baseline_s / strategy_s;
      std::printf("%-28s %-18s %9.2f %9s %9s %-16s %s\n", wname.c_str(), strategy.c_str(), strategy_s,
                  fmt("%.2fx", r.speedup).c_str(), paper_text.c_str(), baseline.c_str(), notes.c_str());
      out.records.push_back(r);
    };
    const std::string dpp_type =
        "schedule::DynamicChunk + group_pipelines (d_p 4) over Ulysses d_s 8, ZeRO-3 in a stage";
    if (!dpp.ok) {
      add("dpp", dpp_type, "-", kNaN, kNaN, kNaN, "", false, true, dpp.reason);
      continue;
    }
    const double t = dpp.rep.step_s;
    mine = "dpp: " + dpp_notes(dpp);
    std::printf("%-28s %-18s %9.2f %9s %9s %-16s %s\n", wname.c_str(), "dpp", t, "", "", "", dpp_notes(dpp).c_str());
    if (explain) {
      std::printf("  one layer's activations per token (%s, bf16, fp32 statistics; Korthikanti et al. 2022):\n",
                  w.model.name.c_str());
      for (const auto& term : w.model.layer_activation_terms(hw.value_bytes))
        std::printf("    %-58s %10.0f B\n", term.name, term.bytes_per_token);
      std::printf("    %-58s %10.0f B\n", "total", w.model.layer_activation_bytes_per_token(hw.value_bytes));
      explain_run("dpp", dpp);
    }

    if (!w.ablation) {
      // FlexSP: "1.31x to 1.69x on CommonCrawl, 48K, growing with model size" [R]; the endpoints are 7B and
      // 30B [I]; 13B's 1.52x is the case study's (13B, GBS 512) [R], its dataset and context assumed [I].
      const bench::dpp::UlyssesZero3 flexsp{w.model, hw, 32, b30 ? 36 : 0, opt.memory_reserve, {}};
      const bench::dpp::BaselineStep fx = flexsp.step(lengths);
      double paper_fx = 1.69;
      std::string paper_fx_text = "up to 1.69x [R]";
      bool fx_bound = true;
      if (w.mix == "commoncrawl" && w.context == 49152) {
        fx_bound = false;
        paper_fx = b7 ? 1.31 : b30 ? 1.69 : 1.52;
        paper_fx_text = b7 ? "1.31x [R, 7B: I]" : b30 ? "1.69x [R, 30B: I]" : "1.52x [R case study]";
      }
      add("dpp", dpp_type, "flexsp", t, fx.step_s, paper_fx, paper_fx_text, fx_bound, false,
          "flexsp: " + baseline_notes(fx));
      // The same FlexSP with its ZeRO-3 collectives exposed, as the paper's case study measures them [R];
      // reported beside the overlapped row, which bounds FlexSP from the other side.
      bench::dpp::UlyssesZero3 flexsp_exposed = flexsp;
      flexsp_exposed.zero_overlap = false;
      const bench::dpp::BaselineStep fxe = flexsp_exposed.step(lengths);
      add("dpp", dpp_type, "flexsp-zero-exposed", t, fxe.step_s, paper_fx, paper_fx_text, fx_bound, !fxe.feasible,
          fxe.feasible ? "flexsp, ZeRO-3 not overlapped: " + baseline_notes(fxe) : fxe.reason);
      // Why DPP does not beat FlexSP where it does not: the numbers that decide it, not a verdict.
      if (fx.feasible && fx.step_s < t)
        std::printf(
            "  why (dpp vs flexsp below 1): FlexSP's ZeRO-3 traffic hides under its compute in this model "
            "(exposed %.0f%% of its step, all-to-all %.0f%%), while DPP pays a %.0f%% bubble; with ZeRO-3 "
            "not overlapped (the paper measures FlexSP's ZeRO + all-to-all at up to 3.2x DPP's) FlexSP "
            "takes %.2f s\n",
            100 * fx.zero_exposed_s / fx.step_s, 100 * fx.all_to_all_s / fx.step_s, 100 * dpp.rep.bubble_s / t,
            fxe.feasible ? fxe.step_s : kNaN);
      const bench::dpp::UlyssesZero3 deepspeed{
          w.model, hw, 32, b30 ? 36 : 0, opt.memory_reserve, b7 ? std::vector<int>{16, 16} : std::vector<int>{32}};
      const bench::dpp::BaselineStep ds = deepspeed.step(lengths);
      if (ds.feasible)
        add("dpp", dpp_type, "deepspeed-ulysses", t, ds.step_s, 2.07, "up to 2.07x [R]", true, false,
            "deepspeed: " + baseline_notes(ds));
      else
        add("deepspeed-ulysses", "Ulysses + ZeRO-3", "-", kNaN, kNaN, kNaN, "", false, true, ds.reason);
      const int mg_paper = b7 ? 10 : b30 ? 55 : 20;
      const bench::dpp::MegatronCp megatron{w.model, hw, 32, 8, b7 ? 2 : 4, mg_paper, w.context, opt.memory_reserve};
      const bench::dpp::BaselineStep mg = megatron.step(lengths);
      // The paper's tuned setting runs; the memory model says how many layers the memory needs.
      const int mg_needed = megatron.checkpoint_layers_needed();
      const std::string mg_memory = "memory model: " +
                                    (mg_needed < 0 ? std::string("no checkpointing fits")
                                                   : std::to_string(mg_needed) + " checkpointed layers needed") +
                                    " (paper ran " + std::to_string(mg_paper) + ")";
      add("dpp", dpp_type, "megatron-cp", t, mg.step_s, 2.60, "up to 2.60x [R]", true, !mg.feasible,
          mg.feasible ? "megatron: " + baseline_notes(mg) + ", " + mg_memory : mg.reason);
      if (explain) {
        std::printf("  megatron-cp memory per rank with the paper's %d checkpointed layers (%s):\n", mg_paper,
                    mg_memory.c_str());
        print_terms(megatron.memory(mg_paper), megatron.memory_cap(), "    ");
        if (mg_needed >= 0 && mg_needed != mg_paper) {
          std::printf("  megatron-cp with the %d layers the memory model needs:\n", mg_needed);
          print_terms(megatron.memory(mg_needed), megatron.memory_cap(), "    ");
        }
        // DeepSpeed-like: the checkpointing the paper tuned trades micro-batches (ZeRO-3 gathers) against
        // recomputation; the sweep says which setting the replay finds fastest.
        for (const bool overlap : {true, false}) {
          std::string sweep;
          int fastest = -1;
          double fastest_s = 0;
          for (int k = 0; k <= w.model.layers; k += w.model.layers / 10) {
            bench::dpp::UlyssesZero3 d = deepspeed;
            d.checkpoint_layers = k;
            d.zero_overlap = overlap;
            const bench::dpp::BaselineStep b = d.step(lengths);
            sweep += (sweep.empty() ? "" : ", ") + std::to_string(k) + ": " +
                     (b.feasible ? fmt("%.2f s", b.step_s) + " (" + std::to_string(b.micro_batches) + " mb)"
                                 : std::string("does not fit"));
            if (b.feasible && (fastest < 0 || b.step_s < fastest_s)) fastest = k, fastest_s = b.step_s;
          }
          std::printf("  deepspeed-ulysses step by checkpointed layers, ZeRO-3 %s (paper ran %d): %s; fastest %d\n",
                      overlap ? "overlapped" : "not overlapped", b30 ? 36 : 0, sweep.c_str(), fastest);
        }
        std::printf("  deepspeed-ulysses memory per rank at its capacity (%.0f rows, %d checkpointed layers):\n",
                    deepspeed.rank_capacity(), deepspeed.checkpoint_layers);
        print_terms(deepspeed.memory(deepspeed.rank_capacity(), deepspeed.rank_capacity()),
                    hw.memory_bytes * (1.0 - opt.memory_reserve), "    ");
      }
      const DppRun seq1f1b = run_dpp_variant(batch, opt, DppVariant::kSeq1F1B, caps);
      const bool ctx48 = w.context == 49152;
      if (explain) explain_run("seq1f1b", seq1f1b);
      if (seq1f1b.ok)
        add("dpp", dpp_type, "seq1f1b", t, seq1f1b.rep.step_s, ctx48 ? 1.27 : 1.40,
            ctx48 ? "up to 1.27x [R]" : "up to 1.40x [R]", true, false, "seq1f1b: " + dpp_notes(seq1f1b));
      else
        add("seq1f1b", "fixed-size chunks, one 1F1B pipeline, uniform checkpointing", "-", kNaN, kNaN, kNaN, "", false,
            true, seq1f1b.reason);
    } else {
      // Ablations: Fig. 10 labels 1.14-1.28x (which bar carries which label is not recoverable) [R].
      for (const auto& [variant, name] :
           {std::pair{DppVariant::kNoBalance, "dpp-no-balance"}, std::pair{DppVariant::kNoCheckpointing, "dpp-no-ckpt"},
            std::pair{DppVariant::kFullCheckpointing, "dpp-full-ckpt"}}) {
        const DppRun r = run_dpp_variant(batch, opt, variant, caps);
        if (!r.ok) {
          add(name, "DPP ablation", "-", kNaN, kNaN, kNaN, "", false, true, r.reason);
          continue;
        }
        add("dpp", dpp_type, name, t, r.rep.step_s, 1.21, "1.14-1.28x [R]", false, false,
            std::string(name) + ": " + dpp_notes(r));
        if (variant == DppVariant::kNoCheckpointing && dpp.rep.layers_recomputed == 0)
          std::printf(
              "  why (dpp-no-ckpt at 1.00x): DPP's fastest plan checkpoints nothing: its executed peak is "
              "%.1f GB of the %.1f GB cap, so removing checkpointing removes nothing\n",
              dpp.rep.max_peak_memory_bytes() / replay::profiles::kGB,
              dpp.rep.memory_cap_bytes / replay::profiles::kGB);
        if (variant == DppVariant::kNoBalance && r.rep.step_s < 1.14 * t)
          std::printf(
              "  why (dpp-no-balance below the paper's 1.14x): fixed-size chunks leave a %.0f%% bubble and %.0f%% "
              "recomputation against DPP's %.0f%% and %.0f%%: balance only moves the bubble when memory does not "
              "force recomputation\n",
              100 * r.rep.bubble_s / r.rep.step_s, 100 * r.rep.recompute_s / r.rep.step_s, 100 * dpp.rep.bubble_s / t,
              100 * dpp.rep.recompute_s / t);
      }
    }
  }
}

}  // namespace seqpar::bench::papers
