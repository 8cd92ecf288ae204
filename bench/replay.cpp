// SPDX-License-Identifier: Apache-2.0
// replay: the headline results of BASP, HSAP and FlashCP, replayed with seqpar's own compiled programs on
// the cost model (include/seqpar/replay, include/seqpar/plan), printed next to the papers' figures.
//
// Every paper figure comes from research/seeds.md ([R] read in a stored source, [S] a third-party summary);
// every workload detail the papers do not give is an assumption marked [I] where it is made. The cost model
// is an alpha-beta network and roofline compute model (hardware.hpp cites its constants), so the replay
// checks the direction and the rough size of each result, not its exact value: the size is judged by the
// ratio seqpar speedup / paper speedup, and the factor we claim is printed at the end with its reasons.
//
// What each strategy is here: the very Strategy<Partitioner, Communicator> types a user would run, compiled
// for every rank (plan::compile_all) and replayed (replay::predict for one attention layer, plan::simulate_step
// for a training step), baselines included (Llama 3's all-gather CP is Strategy<Zigzag, AllGather>).
//
//   replay [--smoke] [--json FILE] [--markdown FILE] [--svg-dir DIR]
//   --smoke      a tiny subset (a few seconds; CTest runs it)
//   --json       one record per (paper, workload, strategy, baseline)
//   --markdown   the tables as markdown (default: next to --json, .md)
//   --svg-dir    one grouped bar chart per paper: seqpar's speedup next to the paper's, per workload
#include <seqpar/plan/candidates.hpp>
#include <seqpar/plan/hybrid_cost.hpp>
#include <seqpar/plan/step.hpp>
#include <seqpar/plan/workloads.hpp>
#include <seqpar/replay/costs.hpp>
#include <seqpar/replay/hardware.hpp>
#include <seqpar/replay/model_shape.hpp>
#include <seqpar/replay/predict.hpp>
#include <seqpar/seqpar.hpp>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "support/json.hpp"

using namespace seqpar;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

/// One compared pair (or one strategy of a workload against the workload's baseline).
struct Record {
  std::string paper, workload, strategy, baseline, metric;
  std::string type;           ///< Strategy<...>
  double predicted_s = kNaN;  ///< step (BASP, HSAP per packed sequence) or attention layer (FlashCP) seconds
  double baseline_s = kNaN;
  double speedup = kNaN;        ///< baseline_s / predicted_s (HSAP: throughput ratio)
  double paper_speedup = kNaN;  ///< the paper's figure for this comparison, when it has one
  std::string paper_figure;     ///< as the paper states it, with its source tag
  bool paper_bound = false;     ///< the paper gives "up to" this figure, not this workload's value
  bool beyond = false;          ///< a composition beyond the paper's
  bool refused = false;
  std::string reason;
  double a2a_s = kNaN, a2a_speedup = kNaN, paper_a2a_speedup = kNaN, a2a_share = kNaN;
  std::string notes;
};

std::vector<Record> g_records;
bool g_smoke = false;

std::string fmt(const char* f, double v) {
  if (std::isnan(v)) return "-";
  if (std::isinf(v)) return "inf";
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

double ratio(double a, double b) {
  return b > 0 ? a / b : (a > 0 ? std::numeric_limits<double>::infinity() : kNaN);
}

// ---------------------------------------------------------------------------------------------------------
// BASP: batch-aware groups vs Ulysses over all 8 GPUs, end-to-end training step and all-to-all time.
// Cluster [R]: 2 nodes x 4 A100-40GB, NVLink inside, one 400 Gb/s IB NIC per node; ZeRO-3 over the 8 GPUs,
// mixed precision (BASP paper, seeds.md section 1). Profile: replay::profiles::a100_40gb().
// [I] Inputs are "synthetic/benchmark" [S]: each sequence one document of S tokens (causal mask).
// [I] Activation checkpointing on: without it Llama-3.1-8B at 4K tokens per GPU does not fit 40 GB
//     next to its ZeRO-3 states (the simulator's memory estimate is printed).
// ---------------------------------------------------------------------------------------------------------
struct BaspWorkload {
  std::string name;
  replay::ModelShape model;
  std::int64_t seq;
  int batch;
  double paper_e2e;
  std::string paper_e2e_text;
  double paper_a2a;
  std::string paper_a2a_text;
};

void run_basp() {
  const replay::HardwareProfile hw = replay::profiles::a100_40gb();
  const Topology topo{8, 4};
  replay::SimulationOptions sim;
  sim.hardware = hw;
  std::vector<BaspWorkload> ws = {
      {"W1 llama-3.1-8b 16K B=2", replay::models::llama31_8b(), 16384, 2, 1.21, "1.21x [R]", kNaN,
       "2.23-3.10x over models [R]"},
      {"W2 qwen1.5-1.8b 16K B=2", replay::models::qwen15_1_8b(), 16384, 2, 1.315, "1.31-1.32x [R]", 3.10, "3.10x [S]"},
      {"W3 llama-3.2-1b 8K B=8", replay::models::llama32_1b(), 8192, 8, 1.25, "~1.25x [R]", 85.0, "~85x [R]"},
      {"W4 llama-3.2-3b 32K B=2", replay::models::llama32_3b(), 32768, 2, 1.0 / (1.0 - 0.259),
       "-25.9% step time = 1.35x [R]", kNaN, "-"},
      {"W5 llama-3.2-1b 16K B=2", replay::models::llama32_1b(), 16384, 2, kNaN, "-", 2.45, "2.45x [S]"},
  };
  if (g_smoke)
    ws = {{"W2 qwen1.5-1.8b 4K B=2 (smoke)", replay::models::qwen15_1_8b(), 4096, 2, 1.315, "1.31-1.32x [R]", 3.10,
           "3.10x [S]"}};

  using comm::AllToAll, comm::Ring;
  using partition::BatchAware, partition::Uniform, partition::Zigzag, partition::Hybrid;
  using Hier = comm::Hierarchical<AllToAll, Ring>;
  std::printf("\n== BASP (2 nodes x 4 %s, ZeRO-3 over 8, checkpointing; training step) ==\n", hw.name.c_str());
  std::printf("%-26s %-26s %9s %9s %9s %8s %8s %7s %9s %-30s\n", "workload", "strategy", "step ms", "speedup", "paper",
              "a2a ms", "a2a x", "a2a %", "mem GiB", "paper a2a");
  for (const BaspWorkload& w : ws) {
    const DocumentBatch batch(std::vector<std::vector<std::int64_t>>(static_cast<std::size_t>(w.batch), {w.seq}));
    const AttentionShape shape = w.model.attention();
    plan::TrainingOptions train;
    train.model = w.model;
    train.zero_ranks = 8;
    train.checkpointing = true;
    // BASP: K = N / B ranks per sequence (K = 4 for B = 2; K = 1 for B = 8, where the paper's "~85x
    // faster all-to-all" is this degenerate case with no all-to-all left, seeds.md section 1 [I]).
    Strategy<BatchAware<Uniform>, AllToAll>::Arguments basp;
    basp.partition.group_size = topo.world_size / w.batch;
    Strategy<BatchAware<Zigzag>, Ring>::Arguments basp_ring;
    basp_ring.partition.group_size = topo.world_size / w.batch;
    basp_ring.comm.sharding_aware = true;
    Strategy<BatchAware<Hybrid>, Hier>::Arguments basp_hybrid;
    basp_hybrid.partition.group_size = topo.world_size / w.batch;
    basp_hybrid.partition.inner.cost =
        plan::hybrid_model_cost(hw, shape, plan::layer_gemm_seconds_per_token(hw, w.model));
    basp_hybrid.comm.outer.sharding_aware = true;
    Strategy<Zigzag, Hier>::Arguments usp;
    usp.comm.outer.sharding_aware = true;
    const std::vector<plan::Candidate> entries = {
        plan::make_candidate<Strategy<Uniform, AllToAll>>("ulysses", "Strategy<Uniform, AllToAll>"),
        plan::make_candidate<Strategy<BatchAware<Uniform>, AllToAll>>("basp", "Strategy<BatchAware<Uniform>, AllToAll>",
                                                                      basp),
        plan::make_candidate<Strategy<Zigzag, Hier>>("usp-zigzag",
                                                     "Strategy<Zigzag, Hierarchical<AllToAll, Ring{aware}>>", usp),
        plan::make_candidate<Strategy<BatchAware<Zigzag>, Ring>>(
            "basp-zigzag-ring", "Strategy<BatchAware<Zigzag>, Ring{aware}>", basp_ring),
        plan::make_candidate<Strategy<BatchAware<Hybrid>, Hier>>(
            "basp-hybrid-hier", "Strategy<BatchAware<Hybrid>, Hierarchical<AllToAll, Ring{aware}>>", basp_hybrid),
    };
    struct Run {
      plan::StepReport rep;
      bool ok = false;
      std::string reason;
    };
    std::vector<Run> runs;
    for (const plan::Candidate& e : entries) {
      Run run;
      const replay::CompiledStrategy c = e.compile(batch, shape, topo);
      run.ok = static_cast<bool>(c.status);
      run.reason = c.status.reason;
      if (run.ok) run.rep = plan::simulate_step(c, topo, train, sim);
      runs.push_back(std::move(run));
    }
    const plan::StepReport& base = runs[0].rep;
    for (std::size_t i = 0; i < entries.size(); ++i) {
      Record r;
      r.paper = "BASP";
      r.workload = w.name;
      r.strategy = entries[i].name;
      r.type = entries[i].description;
      r.baseline = "ulysses";
      r.metric = "training step";
      r.beyond = i >= 2;
      if (!runs[i].ok) {
        r.refused = true;
        r.reason = runs[i].reason;
        std::printf("%-26s %-26s refused: %s\n", w.name.c_str(), r.strategy.c_str(), r.reason.c_str());
        g_records.push_back(r);
        continue;
      }
      const plan::StepReport& rep = runs[i].rep;
      r.predicted_s = rep.step_s;
      r.baseline_s = base.step_s;
      r.speedup = base.step_s / rep.step_s;
      r.a2a_s = rep.attention_comm_s;
      r.a2a_speedup = ratio(base.attention_comm_s, rep.attention_comm_s);
      // The all-to-all share of the step as BASP reports it (~34% for Ulysses [R]): every layer runs the
      // attention programs forward, again in the recompute, and backward; attention_comm_s is one layer's
      // forward + backward transfer time.
      const double fwd_fraction = 0.5;  // [I] a forward program moves about as much as a backward one
      r.a2a_share = rep.attention_comm_s * (1.0 + fwd_fraction) * w.model.layers / rep.step_s;
      if (i == 1) {
        r.paper_speedup = w.paper_e2e;
        r.paper_figure = w.paper_e2e_text;
        r.paper_a2a_speedup = w.paper_a2a;
      }
      r.notes = "peak memory " + fmt("%.1f", rep.max_peak_memory_bytes() / replay::profiles::kGiB) + " GiB of 40";
      std::printf("%-26s %-26s %9.1f %9s %9s %8.2f %8s %6.1f%% %9.1f %-30s\n", w.name.c_str(), r.strategy.c_str(),
                  rep.step_s * 1e3, fmt("%.2fx", r.speedup).c_str(), i == 1 ? w.paper_e2e_text.c_str() : "",
                  rep.attention_comm_s * 1e3, fmt("%.2fx", r.a2a_speedup).c_str(), 100.0 * r.a2a_share,
                  rep.max_peak_memory_bytes() / replay::profiles::kGiB, i == 1 ? w.paper_a2a_text.c_str() : "");
      g_records.push_back(r);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// HSAP: sequence-aware ring inside a two-level (all-to-all in node x ring across nodes) layout vs naive
// packing (the same tokens under one causal mask: documents attend across their boundaries, as packing
// without a document mask does) and vs padding.
// [I] Hardware not given by the paper: 2 nodes x 8 H100-SXM (replay::profiles::h100_sxm()): IntraSP = 8
//     all-to-all over NVLink, InterSP = 2 ring across nodes.
// [I] Model not given: Llama-3.1-8B, ZeRO-3 over the 16 GPUs, checkpointing. Only ratios are compared.
// [I] Packed sequences of 32K tokens drawn from the fineweb and ultrachat mixes (plan/workloads.hpp);
//     throughput = useful (document) tokens per second, summed over several drawn sequences.
// Padding, two readings: "padding-32k" pads every document to its own 32K sequence (the brief's reading);
// "padding-longest" pads the documents of a packed sequence to the longest of them, one row each (what a
// padded data collator does; our reading of the paper's "padded batching" [I]).
// ---------------------------------------------------------------------------------------------------------
void run_hsap() {
  const replay::HardwareProfile hw = replay::profiles::h100_sxm();
  const Topology topo{g_smoke ? 8 : 16, 8};
  replay::SimulationOptions sim;
  sim.hardware = hw;
  const replay::ModelShape model = g_smoke ? replay::models::llama32_1b() : replay::models::llama31_8b();
  const AttentionShape shape = model.attention();
  plan::TrainingOptions train;
  train.model = model;
  train.zero_ranks = 0;
  train.checkpointing = true;
  const std::int64_t seq = g_smoke ? 8192 : 32768;
  const int draws = g_smoke ? 1 : 4;

  using comm::AllToAll, comm::Ring;
  using partition::Uniform, partition::Zigzag, partition::Hybrid;
  using Hier = comm::Hierarchical<AllToAll, Ring>;
  Strategy<Uniform, Hier>::Arguments hsap;
  hsap.comm.inner_size = 8;
  hsap.comm.outer.sharding_aware = true;
  Strategy<Zigzag, Hier>::Arguments zz_hier = {.comm = hsap.comm};
  Strategy<Hybrid, Hier>::Arguments hybrid_hier = {
      .partition = {.cost = plan::hybrid_model_cost(hw, shape, plan::layer_gemm_seconds_per_token(hw, model))},
      .comm = hsap.comm};
  Strategy<Uniform, Hier>::Arguments plain_hier;
  plain_hier.comm.inner_size = 8;
  const plan::Candidate hsap_e = plan::make_candidate<Strategy<Uniform, Hier>>(
      "hsap", "Strategy<Uniform, Hierarchical<AllToAll, Ring{aware}>>", hsap);
  const plan::Candidate naive_ring =
      plan::make_candidate<Strategy<Uniform, Ring>>("native-packing-ring", "Strategy<Uniform, Ring>, one causal mask");
  const plan::Candidate naive_hier = plan::make_candidate<Strategy<Uniform, Hier>>(
      "native-packing-hier", "Strategy<Uniform, Hierarchical<AllToAll, Ring>>, one causal mask", plain_hier);
  const plan::Candidate naive_zigzag =
      plan::make_candidate<Strategy<Zigzag, Ring>>("native-packing-zigzag", "Strategy<Zigzag, Ring>, one causal mask");
  const std::vector<plan::Candidate> beyond = {
      plan::make_candidate<Strategy<Zigzag, Hier>>("zigzag-hier-aware",
                                                   "Strategy<Zigzag, Hierarchical<AllToAll, Ring{aware}>>", zz_hier),
      plan::make_candidate<Strategy<Hybrid, Hier>>(
          "hybrid-hier-aware", "Strategy<Hybrid, Hierarchical<AllToAll, Ring{aware}>>", hybrid_hier),
      plan::make_candidate<Strategy<Uniform, AllToAll>>("ulysses-16", "Strategy<Uniform, AllToAll> over 16 ranks"),
  };

  std::printf("\n== HSAP (%d x %s, %s, ZeRO-3 over %d, packed %lldK sequences; tokens/s ratio) ==\n", topo.world_size,
              hw.name.c_str(), model.name.c_str(), topo.world_size, static_cast<long long>(seq / 1024));
  std::printf("%-10s %-22s %-22s %11s %9s %9s  %s\n", "workload", "strategy", "baseline", "tokens/s", "speedup",
              "paper", "notes");
  for (const std::string mix : {"fineweb", "ultrachat"}) {
    // Time of each strategy over the drawn sequences (seconds), and the useful tokens.
    std::map<std::string, double> time;
    std::map<std::string, std::string> refused;
    double useful = 0;
    int docs_total = 0;
    const auto step = [&](const plan::Candidate& e, const DocumentBatch& b) {
      const replay::CompiledStrategy c = e.compile(b, shape, topo);
      if (!c.status) {
        refused[e.name] = c.status.reason;
        return kNaN;
      }
      return plan::simulate_step(c, topo, train, sim).step_s;
    };
    const DocumentBatch padded_32k = DocumentBatch::single({seq});
    const double pad_step = step(hsap_e, padded_32k);
    for (int d = 0; d < draws; ++d) {
      const auto lengths = plan::workloads::sample_lengths(mix, seq, 1000 + static_cast<std::uint64_t>(d));
      const DocumentBatch packed = DocumentBatch::single(lengths);
      const DocumentBatch one_mask = DocumentBatch::single({seq});
      useful += static_cast<double>(seq);
      docs_total += static_cast<int>(lengths.size());
      time["hsap"] += step(hsap_e, packed);
      time["native-packing-ring"] += step(naive_ring, one_mask);
      time["native-packing-hier"] += step(naive_hier, one_mask);
      time["native-packing-zigzag"] += step(naive_zigzag, one_mask);
      for (const plan::Candidate& e : beyond) time[e.name] += step(e, packed);
      time["padding-32k"] += pad_step * static_cast<double>(lengths.size());
      const std::int64_t longest = *std::max_element(lengths.begin(), lengths.end());
      time["padding-longest"] +=
          step(hsap_e, DocumentBatch(std::vector<std::vector<std::int64_t>>(lengths.size(), {longest})));
    }
    const auto add = [&](const std::string& strategy, const std::string& type, const std::string& baseline,
                         double paper, const std::string& paper_text, bool is_beyond, const std::string& notes) {
      Record r;
      r.paper = "HSAP";
      r.workload = mix + " " + std::to_string(seq / 1024) + "K";
      r.strategy = strategy;
      r.type = type;
      r.baseline = baseline;
      r.metric = "training tokens/s";
      r.beyond = is_beyond;
      r.paper_speedup = paper;
      r.paper_figure = paper_text;
      r.notes = notes;
      if (refused.count(strategy)) {
        r.refused = true;
        r.reason = refused[strategy];
        std::printf("%-10s %-22s refused: %s\n", mix.c_str(), strategy.c_str(), r.reason.c_str());
        g_records.push_back(r);
        return;
      }
      r.predicted_s = time[strategy] / draws;  // per packed sequence
      r.baseline_s = time[baseline] / draws;
      r.speedup = time[baseline] / time[strategy];
      std::printf("%-10s %-22s %-22s %11.0f %9s %9s  %s\n", mix.c_str(), strategy.c_str(), baseline.c_str(),
                  useful / time[strategy], fmt("%.2fx", r.speedup).c_str(), paper_text.c_str(), notes.c_str());
      g_records.push_back(r);
    };
    const std::string avg_docs =
        "avg " + fmt("%.1f", static_cast<double>(docs_total) / draws) + " documents per sequence";
    add("hsap", hsap_e.description, "native-packing-ring", 1.42, "+42% = 1.42x [S]", false, avg_docs);
    add("hsap", hsap_e.description, "native-packing-hier", 1.42, "+42% = 1.42x [S]", false,
        "baseline on HSAP's own layout");
    add("hsap", hsap_e.description, "native-packing-zigzag", 1.42, "+42% = 1.42x [S]", false,
        "load-balanced ring baseline");
    add("hsap", hsap_e.description, "padding-longest", 2.80, "+180% = 2.80x [S]", false,
        "padding to the longest document [I]");
    add("hsap", hsap_e.description, "padding-32k", 2.80, "+180% = 2.80x [S]", false,
        "every document padded to 32K (brief)");
    for (const plan::Candidate& e : beyond) add(e.name, e.description, "hsap", kNaN, "", true, "beyond: vs HSAP");
  }
}

// ---------------------------------------------------------------------------------------------------------
// FlashCP: attention-only layer time (forward + backward), 128K packed tokens, one node of 8 H100-SXM
// (replay::profiles::h100_sxm()), d = 128, Hq in {8, 16, 32, 64}, Hkv = Hq or 8 (FlashCP sections 4.1-4.2 [R]).
// Length mixes [I]: WLB-LLM-like long tail, Pile, RedPajama (plan/workloads.hpp), and one 128K document.
// Paper [R]: up to 1.63x over the best baseline (ring, zigzag ring, Llama3 all-gather, Per-Doc); ~1x for a
// single document is our reading of "gains smallest when compute-bound" (seeds.md) [I].
// ---------------------------------------------------------------------------------------------------------

void run_flashcp() {
  const replay::HardwareProfile hw = replay::profiles::h100_sxm();
  const Topology topo{8, 8};
  replay::SimulationOptions sim;
  sim.hardware = hw;
  const std::int64_t tokens = g_smoke ? 16384 : 131072;
  std::vector<std::pair<int, int>> heads;  // (Hq, Hkv)
  for (const int hq : {8, 16, 32, 64})
    for (const int hkv : {hq, 8})
      if (heads.empty() || heads.back() != std::pair{hq, hkv}) heads.emplace_back(hq, hkv);
  std::vector<std::string> mixes = {"longtail", "pile", "redpajama", "single"};
  if (g_smoke) heads = {{32, 8}}, mixes = {"longtail", "single"};

  using comm::AllGather, comm::AllToAll, comm::Ring;
  using partition::Uniform, partition::Zigzag, partition::PerDoc, partition::Hybrid, partition::WholeDoc;
  std::printf("\n== FlashCP (8 x %s, one node, %lldK packed tokens, d 128; attention layer fwd+bwd) ==\n",
              hw.name.c_str(), static_cast<long long>(tokens / 1024));
  std::printf("%-24s %8s %8s %8s %8s %8s | %8s %9s %-14s | %8s %8s %8s\n", "workload", "ring", "zigzag", "llama3",
              "per-doc", "flashcp", "speedup", "paper", "best baseline", "ulysses", "wholedoc", "zz-aware");
  for (const std::string& mix : mixes) {
    const DocumentBatch batch = DocumentBatch::single(plan::workloads::sample_lengths(mix, tokens, 2026));
    for (const auto& [hq, hkv] : heads) {
      const AttentionShape shape{hq, hkv, 128};
      Strategy<Zigzag, Ring>::Arguments aware;
      aware.comm.sharding_aware = true;
      // FlashCP: Hybrid placement with sharding-aware (selective) KV exchange over an all-gather, its
      // planner costed by simulating that exchange; the same placement over a sharding-aware ring is "beyond".
      const std::vector<plan::Candidate> baselines = {
          plan::make_candidate<Strategy<Uniform, Ring>>("ring", "Strategy<Uniform, Ring>"),
          plan::make_candidate<Strategy<Zigzag, Ring>>("zigzag-ring", "Strategy<Zigzag, Ring>"),
          plan::make_candidate<Strategy<Zigzag, AllGather>>("llama3-allgather",
                                                            "Strategy<Zigzag, AllGather> (Llama 3 CP)"),
          plan::make_candidate<Strategy<PerDoc, AllGather>>("per-doc", "Strategy<PerDoc, AllGather> (WLB-LLM)"),
      };
      const plan::Candidate method =
          plan::hybrid_candidate<AllGather>("flashcp-hybrid", "Strategy<Hybrid, AllGather{aware}>", hw, 0.0);
      const std::vector<plan::Candidate> beyond = {
          plan::make_candidate<Strategy<Uniform, AllToAll>>("ulysses", "Strategy<Uniform, AllToAll>"),
          plan::make_candidate<Strategy<WholeDoc, Ring>>("whole-doc", "Strategy<WholeDoc, Ring{aware}>",
                                                         {.comm = aware.comm}),
          plan::make_candidate<Strategy<Zigzag, Ring>>("zigzag-ring-aware", "Strategy<Zigzag, Ring{aware}>", aware),
          plan::hybrid_candidate<Ring>("hybrid-ring-aware", "Strategy<Hybrid, Ring{aware}>", hw, 0.0),
      };
      const std::string wname = mix + " Hq" + std::to_string(hq) + "/Hkv" + std::to_string(hkv);
      std::map<std::string, double> t;
      std::map<std::string, std::string> why;
      const auto time_of = [&](const plan::Candidate& e) {
        const replay::CompiledStrategy c = e.compile(batch, shape, topo);
        if (!c.status) {
          why[e.name] = c.status.reason;
          return kNaN;
        }
        return replay::predict(c, topo, shape, sim).time_s();
      };
      for (const plan::Candidate& e : baselines) t[e.name] = time_of(e);
      t[method.name] = time_of(method);
      for (const plan::Candidate& e : beyond) t[e.name] = time_of(e);
      std::string best;  // the fastest baseline that ran
      for (const std::string b : {"ring", "zigzag-ring", "llama3-allgather", "per-doc"})
        if (!std::isnan(t[b]) && (best.empty() || t[b] < t[best])) best = b;
      const bool single = mix == "single";
      const auto add = [&](const std::string& name, const std::string& type, bool is_beyond) {
        Record r;
        r.paper = "FlashCP";
        r.workload = wname;
        r.strategy = name;
        r.type = type;
        r.baseline = best;
        r.metric = "attention layer fwd+bwd";
        r.beyond = is_beyond;
        if (why.count(name)) {
          r.refused = true;
          r.reason = why[name];
          g_records.push_back(r);
          return;
        }
        r.predicted_s = t[name];
        r.baseline_s = t[best];
        r.speedup = t[best] / t[name];
        if (name == method.name) {
          r.paper_speedup = single ? 1.0 : 1.63;
          r.paper_bound = !single;
          r.paper_figure = single ? "~1x [I from R]" : "up to 1.63x [R]";
        }
        g_records.push_back(r);
      };
      for (const plan::Candidate& e : baselines) add(e.name, e.description, false);
      add(method.name, method.description, false);
      for (const plan::Candidate& e : beyond) add(e.name, e.description, true);
      const auto ms = [&](const std::string& n) { return fmt("%.2f", t[n] * 1e3); };
      std::printf("%-24s %8s %8s %8s %8s %8s | %8s %9s %-14s | %8s %8s %8s\n", wname.c_str(), ms("ring").c_str(),
                  ms("zigzag-ring").c_str(), ms("llama3-allgather").c_str(), ms("per-doc").c_str(),
                  ms(method.name).c_str(), fmt("%.2fx", t[best] / t[method.name]).c_str(), single ? "~1x" : "<=1.63x",
                  best.c_str(), ms("ulysses").c_str(), ms("whole-doc").c_str(), ms("zigzag-ring-aware").c_str());
      for (const auto& [name, reason] : why) std::printf("    %s refused: %s\n", name.c_str(), reason.c_str());
    }
  }
  std::printf(
      "(times in ms; llama3 = Strategy<Zigzag, AllGather>, per-doc = Strategy<PerDoc, AllGather>, "
      "flashcp = Strategy<Hybrid, AllGather{aware}>)\n");
}

// ---------------------------------------------------------------------------------------------------------
// Summary: direction and size against the papers, and the best composition per workload.
// ---------------------------------------------------------------------------------------------------------

/// The factors we claim; kClaimText below says why.
constexpr double kClaimedFactor = 1.7;
constexpr double kA2AFactor = 5.0;

struct Verdict {
  std::string paper, workload, comparison;
  double seqpar = kNaN, paper_value = kNaN;
  bool bound = false;
  bool direction_ok = false, size_ok = false;
  bool claimed = true;  ///< counted in the claim (false: reported only)
  double factor = kClaimedFactor;
};

std::vector<Verdict> verdicts() {
  std::vector<Verdict> out;
  // FlashCP: the paper's "up to" is compared with seqpar's best speedup over the mixes; the single
  // document with every single-document row.
  double flash_best = 0;
  std::string flash_best_w;
  std::map<std::string, std::pair<double, std::string>> per_mix;  // mix -> best speedup, its workload
  for (const Record& r : g_records) {
    if (std::isnan(r.paper_speedup) || r.refused) continue;
    if (r.paper == "FlashCP" && r.paper_bound) {
      if (r.speedup > flash_best) flash_best = r.speedup, flash_best_w = r.workload;
      auto& m = per_mix[r.workload.substr(0, r.workload.find(' '))];
      if (r.speedup > m.first) m = {r.speedup, r.workload};
      continue;
    }
    Verdict v{r.paper, r.workload, r.strategy + " vs " + r.baseline, r.speedup, r.paper_speedup};
    v.direction_ok = (r.paper_speedup > 1.02) ? r.speedup > 1.0 : std::abs(r.speedup - 1.0) < 0.1;
    v.size_ok = r.speedup / r.paper_speedup <= kClaimedFactor && r.paper_speedup / r.speedup <= kClaimedFactor;
    v.claimed = r.baseline != "padding-32k";
    out.push_back(v);
  }
  if (flash_best > 0) {
    Verdict v{"FlashCP", "best over mixes (" + flash_best_w + ")", "flashcp-hybrid vs best baseline", flash_best, 1.63,
              true};
    v.direction_ok = flash_best > 1.0;
    v.size_ok = flash_best / 1.63 <= kClaimedFactor && 1.63 / flash_best <= kClaimedFactor;
    out.push_back(v);
    // Per mix, for the reader: the paper's bound is over all its settings, so these are not claims.
    for (const auto& [mix, best] : per_mix) {
      Verdict m{
          "FlashCP", "best of " + mix + " (" + best.second + ")", "flashcp-hybrid vs best baseline", best.first, 1.63,
          true};
      // Strict: a mix where Hybrid does not beat the best baseline says so.
      m.direction_ok = best.first > 1.0;
      m.size_ok = best.first <= 1.63 * kClaimedFactor;
      m.claimed = false;
      out.push_back(m);
    }
  }
  // BASP all-to-all speedups.
  for (const Record& r : g_records)
    if (r.paper == "BASP" && !std::isnan(r.paper_a2a_speedup) && !r.refused) {
      Verdict v{r.paper, r.workload, "all-to-all time basp vs ulysses", r.a2a_speedup, r.paper_a2a_speedup};
      v.direction_ok = r.a2a_speedup > 1.0;
      v.factor = kA2AFactor;
      // B = 8: no all-to-all is left at all (K = 1), so the ratio is infinite; the paper's ~85x is the
      // residue of its implementation. Direction only.
      v.size_ok = std::isinf(r.a2a_speedup) || (r.a2a_speedup / r.paper_a2a_speedup <= kA2AFactor &&
                                                r.paper_a2a_speedup / r.a2a_speedup <= kA2AFactor);
      out.push_back(v);
    }
  return out;
}

const char* kClaimText =
    "Claim: every comparison goes the paper's way; headline speedups (training step, tokens/s, attention layer)\n"
    "land within 1.7x of the paper's figure, all-to-all time ratios within 5x. Why these factors: the model has\n"
    "no kernel, NCCL or framework overheads beyond alpha, so it misjudges the share of the step the optimised\n"
    "part takes; HSAP's model and GPUs are unknown (Llama-3.1-8B on H100 assumed); FlashCP's length mixes are\n"
    "unpublished, and 64-token Per-Doc chunks of 1K documents are priced by an efficiency curve extrapolated\n"
    "below FA3's 512-token anchor. BASP's all-to-all: the model reproduces the ~11x bandwidth-time gap of IB vs\n"
    "NVLink (anchors-hw.md 1.5), the paper measures 2.2-3.1x: its all-to-all carries fixed costs the model lacks.\n"
    "padding-32k (every document its own 32K row) is reported, not claimed: HSAP's +180% fits padding to the\n"
    "longest document of a batch.\n";

std::string verdict_text(const Verdict& v) {
  std::string s = v.direction_ok ? "direction ok" : "DIRECTION WRONG";
  if (std::isinf(v.seqpar)) return s + ", no all-to-all left (K = 1)";
  s += v.size_ok ? ", within " + fmt("%.1fx", v.factor) : ", outside " + fmt("%.1fx", v.factor);
  if (!v.claimed) s += " (reported, not claimed)";
  return s;
}

void print_summary(const std::vector<Verdict>& vs) {
  std::printf("\n== paper vs seqpar ==\n%s", kClaimText);
  std::printf("%-8s %-36s %-42s %9s %9s %7s %s\n", "paper", "workload", "comparison", "seqpar", "paper", "ratio",
              "verdict");
  int claimed = 0, held = 0;
  for (const Verdict& v : vs) {
    std::printf("%-8s %-36s %-42s %9s %9s %7s %s\n", v.paper.c_str(), v.workload.c_str(), v.comparison.c_str(),
                fmt("%.2fx", v.seqpar).c_str(),
                (std::string(v.bound ? "<=" : "") + fmt("%.2fx", v.paper_value)).c_str(),
                fmt("%.2f", v.seqpar / v.paper_value).c_str(), verdict_text(v).c_str());
    if (v.claimed) {
      ++claimed;
      held += v.direction_ok && v.size_ok ? 1 : 0;
    }
  }
  std::printf("claim holds for %d of %d claimed comparisons\n", held, claimed);
  // Best composition per workload (every strategy seqpar ran there, paper's or beyond).
  std::printf("\n== best composition seqpar builds per workload ==\n");
  std::map<std::pair<std::string, std::string>, const Record*> best;
  for (const Record& r : g_records) {
    if (r.refused || std::isnan(r.predicted_s) || r.strategy.rfind("padding", 0) == 0) continue;
    if (r.paper == "HSAP" && r.baseline != "hsap" && r.strategy != "hsap") continue;
    auto& b = best[{r.paper, r.workload}];
    if (b == nullptr || r.predicted_s < b->predicted_s) b = &r;
  }
  for (const auto& [key, r] : best)
    std::printf("%-8s %-36s %-22s %s\n", key.first.c_str(), key.second.c_str(), r->strategy.c_str(), r->type.c_str());
}

// ---------------------------------------------------------------------------------------------------------
// Output files.
// ---------------------------------------------------------------------------------------------------------
bool write_markdown(const std::string& path, const std::vector<Verdict>& vs) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    return false;
  }
  std::fprintf(f,
               "# Paper replays on the seqpar cost model\n\nGenerated by `bench/replay`. Speedup = baseline time / "
               "strategy time (HSAP: useful tokens/s ratio). Paper figures: research/seeds.md ([R] read, [S] "
               "summary, [I] inference).\n\n");
  std::fprintf(f, "## Paper vs seqpar\n\n%s\n", kClaimText);
  std::fprintf(
      f,
      "| paper | workload | comparison | seqpar | paper | seqpar/paper | verdict |\n|---|---|---|---|---|---|---|\n");
  for (const Verdict& v : vs)
    std::fprintf(f, "| %s | %s | %s | %s | %s%s | %s | %s |\n", v.paper.c_str(), v.workload.c_str(),
                 v.comparison.c_str(), fmt("%.2fx", v.seqpar).c_str(), v.bound ? "<= " : "",
                 fmt("%.2fx", v.paper_value).c_str(), fmt("%.2f", v.seqpar / v.paper_value).c_str(),
                 verdict_text(v).c_str());
  for (const char* paper : {"BASP", "HSAP", "FlashCP"}) {
    std::fprintf(
        f,
        "\n## %s\n\n| workload | strategy | baseline | predicted s | speedup | paper | all-to-all x | notes |\n"
        "|---|---|---|---|---|---|---|---|\n",
        paper);
    for (const Record& r : g_records) {
      if (r.paper != paper) continue;
      if (r.refused) {
        std::fprintf(f, "| %s | %s | %s | refused | | | | %s |\n", r.workload.c_str(), r.strategy.c_str(),
                     r.baseline.c_str(), r.reason.c_str());
        continue;
      }
      std::fprintf(f, "| %s | %s%s | %s | %s | %s | %s | %s | %s |\n", r.workload.c_str(), r.strategy.c_str(),
                   r.beyond ? " (beyond)" : "", r.baseline.c_str(), fmt("%.4g", r.predicted_s).c_str(),
                   fmt("%.2fx", r.speedup).c_str(), r.paper_figure.c_str(), fmt("%.2fx", r.a2a_speedup).c_str(),
                   r.notes.c_str());
    }
  }
  return std::fclose(f) == 0;
}

std::string xml_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '<')
      o += "&lt;";
    else if (c == '>')
      o += "&gt;";
    else if (c == '&')
      o += "&amp;";
    else
      o += c;
  }
  return o;
}

/// A grouped bar chart: per workload, seqpar's speedup (filled) next to the paper's (outlined; dashed
/// when the paper gives only an upper bound). A dashed line marks 1x.
bool write_svg(const std::string& path, const std::string& title,
               const std::vector<std::tuple<std::string, double, double, bool>>& groups) {
  const double bar = 22, gap = 26, left = 60, top = 40, height = 260, bottom = 150;
  const double width = left + 20 + static_cast<double>(groups.size()) * (2 * bar + gap);
  double ymax = 1.5;
  for (const auto& [name, s, p, bound] : groups) {
    if (std::isfinite(s)) ymax = std::max(ymax, s);
    if (std::isfinite(p)) ymax = std::max(ymax, p);
  }
  ymax = std::ceil(ymax * 1.1 * 2) / 2;
  const auto y = [&](double v) { return top + height - height * std::min(v, ymax) / ymax; };
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    return false;
  }
  std::fprintf(
      f,
      R"(<svg xmlns="http://www.w3.org/2000/svg" width="%.0f" height="%.0f" font-family="sans-serif" font-size="11">)"
      "\n",
      width + 160, top + height + bottom);
  std::fprintf(f,
               R"(<rect width="100%%" height="100%%" fill="white"/><text x="%.0f" y="22" font-size="14">%s</text>)"
               "\n",
               left, xml_escape(title).c_str());
  const double step = ymax <= 4 ? 0.5 : std::ceil(ymax / 8);
  for (double v = 0; v <= ymax + 1e-9; v += step)
    std::fprintf(
        f,
        R"(<line x1="%.0f" x2="%.0f" y1="%.1f" y2="%.1f" stroke="#ddd"/><text x="%.0f" y="%.1f" text-anchor="end">%.1fx</text>)"
        "\n",
        left, width, y(v), y(v), left - 4, y(v) + 4, v);
  std::fprintf(f,
               R"(<line x1="%.0f" x2="%.0f" y1="%.1f" y2="%.1f" stroke="#555" stroke-dasharray="4 3"/>)"
               "\n",
               left, width, y(1), y(1));
  double x = left + gap / 2;
  for (const auto& [name, s, p, bound] : groups) {
    if (std::isfinite(s))
      std::fprintf(
          f,
          R"(<rect x="%.1f" y="%.1f" width="%.0f" height="%.1f" fill="#3b6fb6"/><text x="%.1f" y="%.1f" text-anchor="middle" font-size="9">%.2f</text>)"
          "\n",
          x, y(s), bar, y(0) - y(s), x + bar / 2, y(s) - 3, s);
    if (std::isfinite(p))
      std::fprintf(
          f,
          R"(<rect x="%.1f" y="%.1f" width="%.0f" height="%.1f" fill="#f4a259" fill-opacity="%s" stroke="#c0671d" %s/><text x="%.1f" y="%.1f" text-anchor="middle" font-size="9">%s%.2f</text>)"
          "\n",
          x + bar, y(p), bar, y(0) - y(p), bound ? "0.25" : "1", bound ? R"(stroke-dasharray="3 2")" : "",
          x + 1.5 * bar, y(p) - 3, bound ? "&lt;=" : "", p);
    std::fprintf(f,
                 R"svg(<text transform="translate(%.1f,%.1f) rotate(-40)" text-anchor="end">%s</text>)svg"
                 "\n",
                 x + bar, y(0) + 12, xml_escape(name).c_str());
    x += 2 * bar + gap;
  }
  std::fprintf(
      f,
      R"(<rect x="%.0f" y="%.0f" width="12" height="12" fill="#3b6fb6"/><text x="%.0f" y="%.0f">seqpar (cost model)</text>)"
      "\n",
      width + 10, top, width + 26, top + 10);
  std::fprintf(
      f,
      R"(<rect x="%.0f" y="%.0f" width="12" height="12" fill="#f4a259" stroke="#c0671d"/><text x="%.0f" y="%.0f">paper</text>)"
      "\n",
      width + 10, top + 20, width + 26, top + 30);
  std::fprintf(
      f,
      R"(<rect x="%.0f" y="%.0f" width="12" height="12" fill="#f4a259" fill-opacity="0.25" stroke="#c0671d" stroke-dasharray="3 2"/><text x="%.0f" y="%.0f">paper, "up to"</text>)"
      "\n",
      width + 10, top + 40, width + 26, top + 50);
  std::fprintf(f, "</svg>\n");
  return std::fclose(f) == 0;
}

bool write_svgs(const std::string& dir) {
  bool ok = true;
  for (const char* paper : {"BASP", "HSAP", "FlashCP"}) {
    std::vector<std::tuple<std::string, double, double, bool>> groups;
    std::string title;
    for (const Record& r : g_records) {
      if (r.paper != paper || r.refused || std::isnan(r.paper_speedup)) continue;
      std::string label = r.workload;
      if (r.paper == std::string("HSAP")) label += " vs " + r.baseline;
      groups.emplace_back(label, r.speedup, r.paper_speedup, r.paper_bound);
    }
    if (std::string(paper) == "BASP") {
      title = "BASP vs Ulysses: end-to-end step speedup (2 x 4 A100-40GB)";
      // The all-to-all ratios (up to ~85x) get their own chart so that the step speedups stay readable.
      std::vector<std::tuple<std::string, double, double, bool>> a2a;
      for (const Record& r : g_records)
        if (r.paper == "BASP" && r.strategy == "basp" && !r.refused && !std::isnan(r.paper_a2a_speedup))
          a2a.emplace_back(r.workload + (std::isinf(r.a2a_speedup) ? " (seqpar: none left)" : ""),
                           std::isinf(r.a2a_speedup) ? kNaN : r.a2a_speedup, r.paper_a2a_speedup, false);
      if (!a2a.empty())
        ok = write_svg(dir + "/replay_basp_a2a.svg", "BASP vs Ulysses: all-to-all time speedup (2 x 4 A100-40GB)",
                       a2a) &&
             ok;
    } else if (std::string(paper) == "HSAP") {
      title = "HSAP: training throughput ratio (2 x 8 H100, Llama-3.1-8B assumed)";
    } else {
      title = "FlashCP hybrid vs best baseline: attention fwd+bwd (8 x H100, 128K)";
    }
    if (groups.empty()) continue;
    std::string name = paper;
    std::transform(name.begin(), name.end(), name.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    ok = write_svg(dir + "/replay_" + name + ".svg", title, groups) && ok;
  }
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::string json, markdown, svg_dir;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--smoke")
      g_smoke = true;
    else if (a == "--json" && i + 1 < argc)
      json = argv[++i];
    else if (a == "--markdown" && i + 1 < argc)
      markdown = argv[++i];
    else if (a == "--svg-dir" && i + 1 < argc)
      svg_dir = argv[++i];
    else {
      std::fprintf(stderr, "usage: %s [--smoke] [--json FILE] [--markdown FILE] [--svg-dir DIR]\n", argv[0]);
      return 2;
    }
  }
  if (markdown.empty() && !json.empty()) {
    const auto dot = json.rfind('.');
    markdown =
        (dot == std::string::npos || json.find('/', dot) != std::string::npos ? json : json.substr(0, dot)) + ".md";
  }
  const auto t0 = std::chrono::steady_clock::now();
  run_basp();
  run_hsap();
  run_flashcp();
  const std::vector<Verdict> vs = verdicts();
  print_summary(vs);
  std::printf("\nreplayed in %.1f s\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());

  bool ok = true;
  if (!json.empty()) {
    std::vector<bench::JsonRecord> records;
    for (const Record& r : g_records) {
      bench::JsonRecord j;
      j.add("paper", r.paper).add("workload", r.workload).add("strategy", r.strategy).add("type", r.type);
      j.add("baseline", r.baseline).add("metric", r.metric).add("refused", r.refused).add("reason", r.reason);
      j.add("predicted_step_s", r.predicted_s).add("baseline_step_s", r.baseline_s);
      j.add("speedup_vs_baseline", r.speedup).add("paper_speedup", r.paper_speedup);
      j.add("paper_figure", r.paper_figure).add("paper_is_upper_bound", r.paper_bound).add("beyond_paper", r.beyond);
      j.add("a2a_s", r.a2a_s).add("a2a_speedup", r.a2a_speedup).add("paper_a2a_speedup", r.paper_a2a_speedup);
      j.add("a2a_share_of_step", r.a2a_share).add("smoke", g_smoke).add("notes", r.notes);
      records.push_back(j);
    }
    ok = bench::write_json(json, records) && ok;
  }
  if (!markdown.empty()) ok = write_markdown(markdown, vs) && ok;
  if (!svg_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(svg_dir, ec);  // the charts' folder, like --json's file, is made on demand
    ok = write_svgs(svg_dir) && ok;
  }
  return ok ? 0 : 1;
}
