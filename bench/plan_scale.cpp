// SPDX-License-Identifier: Apache-2.0
// plan_scale: how long the cost model takes to plan big. For each rank count and strategy, the wall time
// to compile every rank's programs (the planner's view: all ranks) and to simulate one training step of
// Llama-3.1-8B on H100 nodes of 8, over a 1M-token batch of lognormal documents (median 2K). The issue's
// goal: 1024 ranks and a 1M-token batch simulated in under 10 s on this machine (2 cores).
//
// Then DPP's planning (issue 12): a global batch of 512 sequences (one document each, lengths from the
// CommonCrawl-like and the long-tail mixes of plan::workloads, truncated at the context, 48K and 96K)
// for LLaMA-7B on 32 pipeline stages, one GPU each, of A800-80GB (DPP's GPU; memory to spare) and of
// A100-40GB (checkpointing binds), with plan::pipeline_model and plan::chunk_cost (the scheduler's
// model of plan::simulate_pipeline_step): chunked by DynamicChunk under an 8K-token capacity, grouped
// into 1F1B pipelines by DPP's dynamic program (its checkpointing solves by the greedy) and, for the
// glpk rows, the chosen pipelines' checkpointing solved again by the MILP (2% gap, a time limit per
// pipeline, the greedy as first incumbent). The wall time of each phase: chunking, the grouping's own
// work, the checkpointing solves. Goal: under 2 s on this machine. --dpp-every-unit lets the grouping
// cut between any two sequences (GroupBoundaries::kEveryUnit) instead of between chunk-count classes.
//
// Then planning at extreme document counts (issue 13): COUNTxLEN documents of LEN tokens (default
// 100000x1, 1000000x1 and, for comparison, the 1M tokens as 10000x100) in 8 packed sequences on 8 ranks
// (nodes of 8), every standard candidate compiled for all ranks. Each case runs in a child process
// (fork), so its wall time and peak memory are its own: the peak RSS the child added over what it
// inherited (getrusage's ru_maxrss minus the resident set at fork) and the peak of live heap bytes
// (operator new/delete counted here), and its CPU seconds beside the wall time (on a shared machine the wall
// time is mostly waiting). Goal: under 2 CPU seconds and 500 MiB for every strategy.
//
// Then the cost of a fresh batch on one rank (issue 28): every training step brings a new document mix,
// so DistributedAttention misses its cache once per step and, on its first layer, plans (partitioner),
// compiles this rank's programs and lowers them (runtime::Executor) before the first exchange. Measured
// on this machine per strategy for 32K-1M tokens (8 lognormal sequences) on 8 and 64 ranks (nodes of 8),
// beside the simulated attention of one step of Llama-3.1-8B on H100 (32 layers, forward + backward).
// Goal: the miss costs at most 5% of that step's attention. With DistributedAttention::plan_ahead the
// planning overlaps the previous step and the call pays only the lowering (its own column). (The ranks'
// agreement on the call, one small all_gather, is a collective: not measured here.)
//   plan_scale [--smoke] [--json FILE] [--tokens N] [--ranks a,b,c] [--strategies a,b]
//              [--fresh-only | --no-fresh] [--dpp-only | --no-dpp | --many-docs-only | --no-many-docs] [--many-docs
//              COUNTxLEN,...]
//              [--many-docs-ranks N] [--many-docs-sequences N] [--dpp-sequences N] [--dpp-stages N]
//              [--dpp-contexts a,b] [--dpp-distributions a,b] [--dpp-chunk-tokens T] [--dpp-solvers greedy,glpk]
//              [--dpp-model NAME] [--dpp-hardware a,b] [--dpp-milp-seconds S] [--dpp-every-unit]
#include <seqpar/plan/candidates.hpp>
#include <seqpar/plan/compile_all.hpp>
#include <seqpar/plan/pipeline_step.hpp>
#include <seqpar/plan/step.hpp>
#include <seqpar/plan/workloads.hpp>
#include <seqpar/replay/predict.hpp>
#include <seqpar/runtime/any_transport.hpp>
#include <seqpar/runtime/executor.hpp>
#include <seqpar/schedule/dynamic_chunk.hpp>
#include <seqpar/schedule/pipeline.hpp>
#include <seqpar/seqpar.hpp>

#if defined(SEQPAR_ENABLE_GLPK)
#include <seqpar/schedule/checkpoint_milp.hpp>
#endif

#include <malloc.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <sstream>
#include <string>
#include <vector>

#include "support/json.hpp"

// Live heap bytes and their peak, for the many-documents cases (each case resets the peak in its own
// child process). malloc_usable_size counts what the allocator really handed out.
namespace {
std::atomic<std::int64_t> g_heap_live{0}, g_heap_peak{0};
void* counted_alloc(std::size_t n) {
  void* p = std::malloc(n == 0 ? 1 : n);
  if (p == nullptr) throw std::bad_alloc();
  const auto live = g_heap_live.fetch_add(static_cast<std::int64_t>(malloc_usable_size(p))) +
                    static_cast<std::int64_t>(malloc_usable_size(p));
  for (std::int64_t peak = g_heap_peak.load(); live > peak && !g_heap_peak.compare_exchange_weak(peak, live);) {
  }
  return p;
}
void counted_free(void* p) noexcept {
  if (p == nullptr) return;
  g_heap_live.fetch_sub(static_cast<std::int64_t>(malloc_usable_size(p)));
  std::free(p);
}
}  // namespace
void* operator new(std::size_t n) {
  return counted_alloc(n);
}
void* operator new[](std::size_t n) {
  return counted_alloc(n);
}
void operator delete(void* p) noexcept {
  counted_free(p);
}
void operator delete[](void* p) noexcept {
  counted_free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  counted_free(p);
}
void operator delete[](void* p, std::size_t) noexcept {
  counted_free(p);
}

using namespace seqpar;

namespace {

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  for (std::string x; std::getline(ss, x, ',');) out.push_back(x);
  return out;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct DppCase {
  int sequences = 512;
  int stages = 32;
  std::vector<std::int64_t> contexts{49152, 98304};
  std::int64_t chunk_tokens = 8192;
  std::vector<std::string> solvers{"greedy", "glpk"};
  std::vector<std::string> distributions{"commoncrawl", "longtail"};
  double milp_seconds = 1.0;       ///< GLPK's time limit per pipeline
  std::string model = "llama-7b";  ///< its layers a multiple of the stages
  /// DPP's A800 (memory to spare at 32 stages of LLaMA-7B), and the A100-40GB, where checkpointing binds.
  std::vector<std::string> hardware{"a800-80gb", "a100-40gb"};
  bool every_unit = false;  ///< cut pipelines between any two sequences, not only between chunk-count classes
};

// DPP planning of `c` on `hardware` for each mix, context and solver: one table row and one JSON
// record per run.
void run_dpp(const DppCase& c, const std::string& hardware, std::vector<bench::JsonRecord>& records) {
  // The pipeline scheduler's model of plan::simulate_pipeline_step: Ulysses over sp_ranks inside a stage
  // (1 here: a stage is one GPU), ZeRO-3 inside the stage, a 10% memory reserve.
  plan::PipelineStepOptions opt;
  opt.model = plan::models::by_name(c.model);
  opt.hardware = replay::profiles::by_name(hardware);
  opt.stages = c.stages;
  opt.sp_ranks = 1;
  const schedule::PipelineModel pm = plan::pipeline_model(opt);
  const schedule::ChunkCost cost = plan::chunk_cost(opt);
  std::printf(
      "\nDPP planning: %d sequences (one document each, truncated at the context), %s on %d stages of %s\n"
      "(%d layer%s per stage; per stage %.1f GiB static, %.0f KiB activations per token, cap %.1f GiB), chunk "
      "capacity %lld tokens\n",
      c.sequences, opt.model.name.c_str(), c.stages, opt.hardware.name.c_str(), pm.layers_per_stage,
      pm.layers_per_stage == 1 ? "" : "s", pm.static_bytes / replay::profiles::kGiB,
      pm.activation_bytes_per_token * pm.layers_per_stage / 1024, pm.memory_cap / replay::profiles::kGiB,
      static_cast<long long>(c.chunk_tokens));
  std::printf("%-12s %8s %9s %8s %-7s %7s %4s %6s %9s %9s %9s %7s %9s %9s %7s %11s  %s\n", "mix", "context", "tokens",
              "longest", "solver", "chunks", "K", "units", "chunk s", "group s", "ckpt s", "solves", "total s",
              "pipelines", "recomp", "goal", "decided by");
  for (const std::string& mix : c.distributions)
    for (const std::int64_t context : c.contexts) {
      // The first `sequences` draws of the mix, truncated at the context.
      std::vector<std::int64_t> draws = plan::workloads::sample_lengths(mix, std::int64_t{c.sequences} * 131072, 2509u);
      draws.resize(static_cast<std::size_t>(c.sequences));
      std::vector<std::vector<std::int64_t>> seqs;
      for (std::int64_t& len : draws) seqs.push_back({len = std::min(len, context)});
      const DocumentBatch batch(seqs);
      const std::int64_t longest = *std::max_element(draws.begin(), draws.end());
      char head[96];
      std::snprintf(head, sizeof head, "%-12s %8lld %9lld %8lld", mix.c_str(), static_cast<long long>(context),
                    static_cast<long long>(batch.total_tokens()), static_cast<long long>(longest));
      for (const std::string& solver_name : c.solvers) {
#if !defined(SEQPAR_ENABLE_GLPK)
        if (solver_name == "glpk") {
          std::printf("%s %-7s not built (configure with seqpar::glpk: libglpk-dev)\n", head, "glpk");
          continue;
        }
#endif
        // The grouping's dynamic program solves with the greedy; the glpk rows then solve the chosen
        // pipelines again with the MILP (DPP's 2% gap, a time limit, the greedy as first incumbent).
        int solves = 0;
        double solve_s = 0;
        const auto timed = [&](const schedule::CheckpointSolver& solver) {
          return schedule::CheckpointSolver([&, solver](const schedule::CheckpointProblem& prob) {
            const auto t0 = std::chrono::steady_clock::now();
            schedule::CheckpointPlan plan = solver(prob);
            solve_s += seconds_since(t0);
            ++solves;
            return plan;
          });
        };
        const auto t0 = std::chrono::steady_clock::now();
        const schedule::DynamicChunk chunker{
            {.token_capacity = c.chunk_tokens, .time_target = 0, .slices = 0, .cost = cost}};
        const schedule::ChunkPlan plan = chunker.plan(batch);
        const double chunk_s = seconds_since(t0);
        const auto t1 = std::chrono::steady_clock::now();
        const std::size_t units = schedule::sequence_units(plan).size();
        bench::JsonRecord r;
        r.add("case", "dpp")
            .add("distribution", mix)
            .add("sequences", c.sequences)
            .add("stages", c.stages)
            .add("context", context)
            .add("tokens", batch.total_tokens())
            .add("longest", longest)
            .add("model", opt.model.name)
            .add("hardware", opt.hardware.name)
            .add("chunk_tokens", c.chunk_tokens)
            .add("solver", solver_name)
            .add("boundaries", c.every_unit ? "every unit" : "chunk count")
            .add("chunks", static_cast<std::int64_t>(plan.chunks.size()))
            .add("slices", plan.slices)
            .add("units", static_cast<std::int64_t>(units));
        try {
          schedule::PipelineSchedule sched =
              schedule::group_pipelines(plan, pm, timed(schedule::solve_checkpointing),
                                        {.boundaries = c.every_unit ? schedule::GroupBoundaries::kEveryUnit
                                                                    : schedule::GroupBoundaries::kChunkCount});
          long long greedy_recomputed = 0;
          for (const schedule::Pipeline& p : sched.pipelines) greedy_recomputed += p.checkpointing.layers_recomputed;
#if defined(SEQPAR_ENABLE_GLPK)
          if (solver_name == "glpk")
            schedule::refine_checkpointing(
                plan, pm, sched, timed(schedule::milp_solver({.relative_gap = 0.02, .time_limit_s = c.milp_seconds})));
#endif
          const double group_total_s = seconds_since(t1);
          const double total = chunk_s + group_total_s;
          long long recomputed = 0;
          std::string final_solver;
          for (const schedule::Pipeline& p : sched.pipelines) {
            recomputed += p.checkpointing.layers_recomputed;
            if (final_solver.find(p.checkpointing.solver) == std::string::npos)
              final_solver += (final_solver.empty() ? "" : ", ") + p.checkpointing.solver;
          }
          std::printf("%s %-7s %7zu %4d %6zu %9.3f %9.3f %9.3f %7d %9.3f %9zu %7lld %11s  %s\n", head,
                      solver_name.c_str(), plan.chunks.size(), plan.slices, units, chunk_s, group_total_s - solve_s,
                      solve_s, solves, total, sched.pipelines.size(), recomputed, total < 2 ? "met (<2 s)" : "NOT met",
                      final_solver.c_str());
          std::fflush(stdout);
          records.push_back(r.add("chunk_s", chunk_s)
                                .add("group_s", group_total_s - solve_s)
                                .add("checkpoint_s", solve_s)
                                .add("checkpoint_solves", solves)
                                .add("total_s", total)
                                .add("pipelines", static_cast<std::int64_t>(sched.pipelines.size()))
                                .add("layers_recomputed", recomputed)
                                .add("layers_recomputed_greedy", greedy_recomputed)
                                .add("final_solver", final_solver)
                                .add("predicted_s", sched.seconds)
                                .add("goal_met", total < 2));
        } catch (const std::invalid_argument& e) {
          std::printf("%s %-7s infeasible: %s\n", head, solver_name.c_str(), e.what());
          records.push_back(r.add("infeasible", true).add("reason", e.what()));
        }
      }
    }
}

/// Planning at extreme document counts: `count` documents of `length` tokens each.
struct ManyDocsCase {
  std::int64_t count = 0;
  std::int64_t length = 1;
};

struct ManyDocs {
  std::vector<ManyDocsCase> cases{{100000, 1}, {1000000, 1}, {10000, 100}};
  int ranks = 8;
  int sequences = 8;
};

// What a child reports back through its pipe.
struct ChildResult {
  bool ok = false;
  bool refused = false;
  double compile_s = 0;
  double cpu_s = 0;              ///< user + system CPU seconds of the child (wall time also counts a busy machine)
  std::int64_t heap_peak = 0;    ///< peak live heap bytes over the case (above what was live at fork)
  std::int64_t rss_at_fork = 0;  ///< bytes resident when the child started
  std::int64_t rss_peak = 0;     ///< ru_maxrss of the child, bytes
  std::int64_t steps = 0;        ///< program steps over all ranks, forward + backward
  std::int64_t slices = 0;       ///< attention slices over all ranks' compute steps
  char reason[256] = {};
};

std::int64_t resident_bytes() {
  long pages = 0, resident = 0;
  if (std::FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return static_cast<std::int64_t>(resident) * sysconf(_SC_PAGESIZE);
}

// Compiles candidate `c` for every rank in a child process and returns its measurements.
ChildResult run_in_child(const plan::Candidate& c, const DocumentBatch& batch, const AttentionShape& shape,
                         const Topology& topo) {
  int fds[2];
  ChildResult res;
  if (pipe(fds) != 0) {
    std::snprintf(res.reason, sizeof res.reason, "pipe failed");
    return res;
  }
  std::fflush(stdout);
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    ChildResult out;
    out.rss_at_fork = resident_bytes();
    const std::int64_t live0 = g_heap_live.load();
    g_heap_peak.store(live0);
    try {
      const auto t0 = std::chrono::steady_clock::now();
      const replay::CompiledStrategy compiled = c.compile(batch, shape, topo);
      out.compile_s = seconds_since(t0);
      out.refused = !compiled.status;
      if (out.refused) std::snprintf(out.reason, sizeof out.reason, "%s", compiled.status.reason.c_str());
      for (const auto* programs : {&compiled.forward, &compiled.backward})
        for (const comm::Program& p : *programs) {
          out.steps += static_cast<std::int64_t>(p.steps.size());
          for (const comm::Step& step : p.steps)
            if (const auto* cs = std::get_if<comm::ComputeStep>(&step))
              for (const auto& w : cs->waves) out.slices += static_cast<std::int64_t>(w.size());
        }
      out.ok = true;
    } catch (const std::exception& e) {
      std::snprintf(out.reason, sizeof out.reason, "threw: %s", e.what());
    }
    out.heap_peak = g_heap_peak.load() - live0;
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    out.rss_peak = static_cast<std::int64_t>(ru.ru_maxrss) * 1024;
    out.cpu_s = static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
                1e-6 * static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
    const ssize_t written = write(fds[1], &out, sizeof out);
    _exit(written == static_cast<ssize_t>(sizeof out) ? 0 : 1);
  }
  close(fds[1]);
  if (pid < 0) {
    close(fds[0]);
    std::snprintf(res.reason, sizeof res.reason, "fork failed");
    return res;
  }
  const ssize_t got = read(fds[0], &res, sizeof res);
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (got != static_cast<ssize_t>(sizeof res)) {
    res = {};
    std::snprintf(res.reason, sizeof res.reason, "child died (status %d)", status);
  }
  return res;
}

void run_many_docs(const ManyDocs& md, const std::vector<std::string>& wanted, bool all_strategies,
                   std::vector<bench::JsonRecord>& records) {
  const plan::ModelShape model = plan::models::llama31_8b();
  const replay::HardwareProfile hw = replay::profiles::h100_sxm();
  const Topology topo{md.ranks, std::min(md.ranks, 8)};
  constexpr double kMiB = 1024.0 * 1024.0;
  std::printf(
      "\nPlanning at extreme document counts: %d packed sequences on %d ranks, %s; every rank's programs "
      "compiled, each case in its own process\n",
      md.sequences, md.ranks, model.name.c_str());
  std::printf("%9s %5s  %-26s %9s %7s %10s %10s %10s %10s %11s\n", "documents", "len", "strategy", "compile s", "cpu s",
              "+RSS MiB", "heap MiB", "steps", "slices", "goal");
  for (const ManyDocsCase& mc : md.cases) {
    std::vector<std::vector<std::int64_t>> seqs(static_cast<std::size_t>(md.sequences));
    for (std::int64_t d = 0; d < mc.count; ++d) seqs[static_cast<std::size_t>(d % md.sequences)].push_back(mc.length);
    std::erase_if(seqs, [](const auto& s) { return s.empty(); });
    const DocumentBatch batch(seqs);
    seqs = {};
    malloc_trim(0);
    for (const plan::Candidate& c : plan::standard_candidates(hw, model)) {
      if (!all_strategies && std::find(wanted.begin(), wanted.end(), c.name) == wanted.end()) continue;
      const ChildResult res = run_in_child(c, batch, model.attention(), topo);
      bench::JsonRecord r;
      r.add("case", "many_documents")
          .add("documents", mc.count)
          .add("document_tokens", mc.length)
          .add("sequences", md.sequences)
          .add("ranks", md.ranks)
          .add("strategy", c.name);
      if (!res.ok || res.refused) {
        std::printf("%9lld %5lld  %-26s %s: %s\n", static_cast<long long>(mc.count), static_cast<long long>(mc.length),
                    c.name.c_str(), res.ok ? "refused" : "failed", res.reason);
        records.push_back(r.add("refused", res.refused).add("failed", !res.ok).add("reason", res.reason));
        continue;
      }
      const double rss_mib = static_cast<double>(std::max<std::int64_t>(0, res.rss_peak - res.rss_at_fork)) / kMiB;
      const double heap_mib = static_cast<double>(res.heap_peak) / kMiB;
      const bool met = res.cpu_s < 2 && rss_mib < 500;  // CPU seconds: wall time counts the other jobs here
      std::printf("%9lld %5lld  %-26s %9.3f %7.3f %10.1f %10.1f %10lld %10lld %11s\n", static_cast<long long>(mc.count),
                  static_cast<long long>(mc.length), c.name.c_str(), res.compile_s, res.cpu_s, rss_mib, heap_mib,
                  static_cast<long long>(res.steps), static_cast<long long>(res.slices), met ? "met" : "NOT met");
      std::fflush(stdout);
      records.push_back(r.add("refused", false)
                            .add("failed", false)
                            .add("compile_s", res.compile_s)
                            .add("cpu_s", res.cpu_s)
                            .add("peak_rss_added_mib", rss_mib)
                            .add("peak_heap_mib", heap_mib)
                            .add("steps", res.steps)
                            .add("slices", res.slices)
                            .add("goal_met", met));
    }
  }
}

// One rank's cache miss for strategy S (its arguments `args`) on `batch`: plan + compile of rank
// `rank`'s programs + lowering both, in seconds; and the simulated attention of one layer on `sim`.
struct FreshCost {
  bool refused = false;
  std::string reason;
  double miss_s = 0, lower_s = 0, layer_attention_s = 0;  ///< lower_s: what is left with plan_ahead
};
template <class S>
FreshCost fresh_cost(typename S::Arguments args, const DocumentBatch& batch, const AttentionShape& shape,
                     const Topology& topo, const replay::SimulationOptions& sim) {
  using Kernel = attention::CpuFlash<float>;
  args.ranks_per_node = topo.ranks_per_node;
  FreshCost out;
  const Kernel kernel;
  // The slowest of the first and the last rank (ranks differ in what they hold; both are cheap to time).
  for (const int rank : {0, topo.world_size - 1}) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto compiled = S::compile(args, batch, shape, topo, rank);
    if (!compiled.status) {
      out.refused = true;
      out.reason = compiled.status.reason;
      return out;
    }
    const auto t1 = std::chrono::steady_clock::now();
    runtime::Executor<Kernel, runtime::AnyTransport> forward, backward;
    forward.initialize(compiled.program.forward, kernel);
    backward.initialize(compiled.program.backward, kernel);
    out.miss_s = std::max(out.miss_s, seconds_since(t0));
    out.lower_s = std::max(out.lower_s, seconds_since(t1));
  }
  out.layer_attention_s = replay::predict(plan::compile_all<S>(args, batch, shape, topo), topo, shape, sim).time_s();
  return out;
}

// The fresh-batch table: per token count, rank count and strategy, one rank's miss beside one step's
// simulated attention.
void run_fresh(const std::vector<std::int64_t>& token_counts, const std::vector<int>& rank_counts,
               std::vector<bench::JsonRecord>& records) {
  using namespace partition;
  using comm::AllToAll, comm::Ring;
  const plan::ModelShape model = plan::models::llama31_8b();
  const AttentionShape shape = model.attention();
  replay::SimulationOptions sim;
  sim.hardware = replay::profiles::h100_sxm();
  std::printf(
      "\nfresh batch, one rank's cache miss (plan + compile + lower, this machine) vs one step's attention "
      "(%s, %d layers, fwd + bwd, simulated on %s)\n",
      model.name.c_str(), model.layers, sim.hardware.name.c_str());
  std::printf("%8s %6s  %-20s %10s %14s %10s %10s %14s %10s\n", "tokens", "ranks", "strategy", "miss ms",
              "step attn ms", "miss/step", "goal <=5%", "plan_ahead ms", "ahead/step");
  for (const std::int64_t tokens : token_counts)
    for (const int p : rank_counts) {
      std::vector<std::vector<std::int64_t>> seqs;
      for (int b = 0; b < 8; ++b) seqs.push_back(plan::workloads::sample_lengths("lognormal", tokens / 8, 2000u + b));
      const DocumentBatch batch(seqs);
      const Topology topo{p, 8};
      const auto row = [&](const char* name, const FreshCost& c) {
        bench::JsonRecord r;
        r.add("section", "fresh_batch").add("tokens", tokens).add("ranks", p).add("strategy", name);
        if (c.refused) {
          std::printf("%8lld %6d  %-20s refused: %s\n", static_cast<long long>(tokens), p, name, c.reason.c_str());
          records.push_back(r.add("refused", true).add("reason", c.reason));
          return;
        }
        const double step_s = c.layer_attention_s * model.layers;
        const double ratio = c.miss_s / step_s;
        // With plan_ahead (DistributedAttention::plan_ahead) the planning runs during the previous step;
        // the call itself still lowers the programs.
        std::printf("%8lld %6d  %-20s %10.2f %14.2f %9.1f%% %10s %14.2f %9.2f%%\n", static_cast<long long>(tokens), p,
                    name, c.miss_s * 1e3, step_s * 1e3, 100 * ratio, ratio <= 0.05 ? "met" : "NOT met", c.lower_s * 1e3,
                    100 * c.lower_s / step_s);
        records.push_back(r.add("refused", false)
                              .add("miss_s", c.miss_s)
                              .add("plan_ahead_foreground_s", c.lower_s)
                              .add("step_attention_s", step_s)
                              .add("miss_over_step", ratio));
      };
      Strategy<Zigzag, Ring>::Arguments zigzag;
      zigzag.comm.sharding_aware = true;
      row("zigzag-ring-aware", fresh_cost<Strategy<Zigzag, Ring>>(zigzag, batch, shape, topo, sim));
      Strategy<Hybrid, Ring>::Arguments hybrid;
      hybrid.comm.sharding_aware = true;
      row("hybrid-aware", fresh_cost<Strategy<Hybrid, Ring>>(hybrid, batch, shape, topo, sim));
      row("ulysses", fresh_cost<Strategy<Uniform, AllToAll>>({}, batch, shape, topo, sim));
      row("basp", fresh_cost<Strategy<BatchAware<Uniform>, AllToAll>>({}, batch, shape, topo, sim));
      using Hier = comm::Hierarchical<AllToAll, Ring>;
      Strategy<Zigzag, Hier>::Arguments hier;
      hier.comm.outer.sharding_aware = true;
      row("hierarchical", fresh_cost<Strategy<Zigzag, Hier>>(hier, batch, shape, topo, sim));
    }
}

}  // namespace

int main(int argc, char** argv) {
  bool smoke = false, strategies = true, dpp = true, many_docs = true, strategies_given = false, fresh = true;
  std::vector<std::int64_t> fresh_tokens{32768, 131072, 1 << 20};
  std::vector<int> fresh_ranks{8, 64};
  ManyDocs many;
  std::string json;
  std::int64_t tokens = 1 << 20;
  std::vector<int> ranks{64, 256, 1024};
  std::vector<std::string> wanted{"hierarchical", "zigzag-ring-aware", "ring", "hybrid-aware",
                                  "basp-hybrid-hierarchical"};
  DppCase dpp_case;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool value = i + 1 < argc;
    if (a == "--smoke") {
      smoke = true;
    } else if (a == "--json" && value) {
      json = argv[++i];
    } else if (a == "--tokens" && value) {
      tokens = std::stoll(argv[++i]);
    } else if (a == "--ranks" && value) {
      ranks.clear();
      for (const std::string& x : split_list(argv[++i])) ranks.push_back(std::stoi(x));
    } else if (a == "--strategies" && value) {
      wanted = split_list(argv[++i]);
      strategies_given = true;
    } else if (a == "--dpp-only") {
      strategies = false, many_docs = false, fresh = false;
    } else if (a == "--fresh-only") {
      strategies = false, many_docs = false, dpp = false;
    } else if (a == "--no-fresh") {
      fresh = false;
    } else if (a == "--no-dpp") {
      dpp = false;
    } else if (a == "--many-docs-only") {
      strategies = false, dpp = false, fresh = false;
    } else if (a == "--no-many-docs") {
      many_docs = false;
    } else if (a == "--many-docs" && value) {
      many.cases.clear();
      for (const std::string& x : split_list(argv[++i])) {
        const auto at = x.find('x');
        many.cases.push_back({std::stoll(x.substr(0, at)), at == std::string::npos ? 1 : std::stoll(x.substr(at + 1))});
      }
    } else if (a == "--many-docs-ranks" && value) {
      many.ranks = std::stoi(argv[++i]);
    } else if (a == "--many-docs-sequences" && value) {
      many.sequences = std::stoi(argv[++i]);
    } else if (a == "--dpp-sequences" && value) {
      dpp_case.sequences = std::stoi(argv[++i]);
    } else if (a == "--dpp-stages" && value) {
      dpp_case.stages = std::stoi(argv[++i]);
    } else if (a == "--dpp-contexts" && value) {
      dpp_case.contexts.clear();
      for (const std::string& x : split_list(argv[++i])) dpp_case.contexts.push_back(std::stoll(x));
    } else if (a == "--dpp-chunk-tokens" && value) {
      dpp_case.chunk_tokens = std::stoll(argv[++i]);
    } else if (a == "--dpp-distributions" && value) {
      dpp_case.distributions = split_list(argv[++i]);
    } else if (a == "--dpp-every-unit") {
      dpp_case.every_unit = true;
    } else if (a == "--dpp-hardware" && value) {
      dpp_case.hardware = split_list(argv[++i]);
    } else if (a == "--dpp-model" && value) {
      dpp_case.model = argv[++i];
    } else if (a == "--dpp-milp-seconds" && value) {
      dpp_case.milp_seconds = std::stod(argv[++i]);
    } else if (a == "--dpp-solvers" && value) {
      dpp_case.solvers = split_list(argv[++i]);
    } else {
      std::fprintf(
          stderr,
          "usage: plan_scale [--smoke] [--json FILE] [--tokens N] [--ranks a,b,c] [--strategies a,b]\n"
          "                  [--fresh-only | --no-fresh] [--dpp-only | --no-dpp | --many-docs-only | --no-many-docs]\n"
          "                  [--many-docs COUNTxLEN,...] [--many-docs-ranks N] [--many-docs-sequences N]\n"
          "                  [--dpp-sequences N] [--dpp-stages N]\n"
          "                  [--dpp-contexts a,b] [--dpp-distributions a,b] [--dpp-chunk-tokens T]\n"
          "                  [--dpp-model NAME] [--dpp-hardware a,b] [--dpp-solvers greedy,glpk]\n"
          "                  [--dpp-milp-seconds S] [--dpp-every-unit]\n");
      return 2;
    }
  }
  if (smoke)
    tokens = 65536, ranks = {16}, dpp_case.sequences = 128, dpp_case.contexts = {32768},
    many.cases = {{20000, 1}, {200, 100}}, fresh_tokens = {32768}, fresh_ranks = {8};
  std::vector<bench::JsonRecord> records;
  if (strategies) {
    const plan::ModelShape model = plan::models::llama31_8b();
    replay::SimulationOptions sim;
    sim.hardware = replay::profiles::h100_sxm();
    plan::TrainingOptions training;
    training.model = model;
    // Eight packed sequences (the batch-aware candidate forms groups from them; the others see one batch).
    std::vector<std::vector<std::int64_t>> seqs;
    for (int b = 0; b < 8; ++b) seqs.push_back(plan::workloads::sample_lengths("lognormal", tokens / 8, 1000u + b));
    const DocumentBatch batch(seqs);

    std::printf("plan_scale: %lld tokens in 8 sequences, %zu documents, %s on %s nodes of 8\n",
                static_cast<long long>(tokens), batch.documents().size(), model.name.c_str(),
                sim.hardware.name.c_str());
    std::printf("%6s  %-26s %10s %10s %10s %12s %10s\n", "ranks", "strategy", "compile s", "simulate s", "total s",
                "step ms", "goal");
    for (const int p : ranks) {
      const Topology topo{p, 8};
      for (const plan::Candidate& c : plan::standard_candidates(sim.hardware, model)) {
        if (std::find(wanted.begin(), wanted.end(), c.name) == wanted.end()) continue;
        const auto t0 = std::chrono::steady_clock::now();
        const replay::CompiledStrategy compiled = c.compile(batch, model.attention(), topo);
        const auto t1 = std::chrono::steady_clock::now();
        bench::JsonRecord r;
        r.add("ranks", p).add("tokens", tokens).add("strategy", c.name);
        if (!compiled.status) {
          std::printf("%6d  %-26s refused: %s\n", p, c.name.c_str(), compiled.status.reason.c_str());
          records.push_back(r.add("refused", true).add("reason", compiled.status.reason));
          continue;
        }
        const plan::StepReport step = plan::simulate_step(compiled, topo, training, sim);
        const auto t2 = std::chrono::steady_clock::now();
        const double compile_s = std::chrono::duration<double>(t1 - t0).count();
        const double simulate_s = std::chrono::duration<double>(t2 - t1).count();
        const double total = compile_s + simulate_s;
        const char* goal = p < 1024 ? "" : (total < 10 ? "met (<10 s)" : "NOT met");
        std::printf("%6d  %-26s %10.2f %10.2f %10.2f %12.1f %10s\n", p, c.name.c_str(), compile_s, simulate_s, total,
                    step.step_s * 1e3, goal);
        records.push_back(r.add("refused", false)
                              .add("compile_s", compile_s)
                              .add("simulate_s", simulate_s)
                              .add("total_s", total)
                              .add("predicted_step_s", step.step_s)
                              .add("error_bound_s", step.error_bound_s));
      }
    }
  }
  if (fresh) run_fresh(fresh_tokens, fresh_ranks, records);
  if (many_docs) run_many_docs(many, wanted, !strategies_given, records);
  if (dpp)
    for (const std::string& hardware : dpp_case.hardware) run_dpp(dpp_case, hardware, records);
  if (!json.empty() && !bench::write_json(json, records)) return 1;
  return 0;
}
