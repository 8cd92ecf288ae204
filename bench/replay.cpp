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
//   replay [--smoke] [--paper NAME] [--json FILE] [--markdown FILE] [--svg-dir DIR]
//   --smoke      a tiny subset (a few seconds; CTest runs it)
//   --paper      only this paper's replay (BASP, HSAP, FlashCP or DPP; case-insensitive)
//   --json       one record per (paper, workload, strategy, baseline)
//   --markdown   the tables as markdown (default: next to --json, .md)
//   --svg-dir    one grouped bar chart per paper: seqpar's speedup next to the paper's, per workload
#include <seqpar/plan/candidates.hpp>
#include <seqpar/plan/hybrid_cost.hpp>
#include <seqpar/plan/pipeline_step.hpp>
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

#include "support/dpp_baselines.hpp"
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
  double a2a_copy_s = kNaN, a2a_copy_speedup = kNaN;  ///< the same with the programs' permute copies
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
// Cluster [R]: 2 nodes x 4 A100-40GB, "NVLink" inside, 400 Gb/s InfiniBand across; ZeRO-3 over the 8 GPUs,
// mixed precision (BASP paper, seeds.md section 1). The node's layout is not given: the main rows read it
// as replay::profiles::a100_40gb() (HGX A100 4-GPU, all four on NVLink, one 400 Gb/s port per node) [I];
// the layout table replays Ulysses and BASP under the other readings (basp_layouts()).
// [I] Inputs are "synthetic/benchmark" [S]: each sequence one document of S tokens (causal mask).
// [I] Activation checkpointing on: without it Llama-3.1-8B at 4K tokens per GPU does not fit 40 GB
//     next to its ZeRO-3 states (the simulator's memory estimate is printed).
// ---------------------------------------------------------------------------------------------------------
/// The all-to-all share of the step as BASP reports it (~34% for Ulysses [R]): every layer runs the
/// attention programs forward, again in the recompute, and backward; attention_comm_s is one layer's
/// forward + backward transfer time.
double a2a_share(const plan::StepReport& rep, const replay::ModelShape& model) {
  const double fwd_fraction = 0.5;  // [I] a forward program moves about as much as a backward one
  return rep.attention_comm_s * (1.0 + fwd_fraction) * model.layers / rep.step_s;
}

struct BaspWorkload {
  std::string name;
  replay::ModelShape model;
  std::int64_t seq;
  int batch;
  double paper_e2e;
  std::string paper_e2e_text;
  double paper_a2a;
  std::string paper_a2a_text;
  std::string paper_share = "-";  ///< the all-to-all share of the step, Ulysses -> BASP [S]
};

/// BASP vs Ulysses under one reading of the paper's node (replay::profiles: a100_40gb and its variants).
struct LayoutRow {
  std::string layout, description, workload;
  bool is_default = false;
  double step_speedup = kNaN, paper_step = kNaN;
  double a2a_speedup = kNaN, a2a_copy_speedup = kNaN, paper_a2a = kNaN;
  double ulysses_a2a_s = kNaN, basp_a2a_s = kNaN;
  double ulysses_share = kNaN, basp_share = kNaN;  ///< all-to-all share of the step, as Record::a2a_share
  std::string paper_share;                         ///< the paper's shares, Ulysses -> BASP, when it gives them
};
std::vector<LayoutRow> g_layouts;

/// The readings of "2 nodes x 4 A100-40GB, NVLink, 400 Gb/s InfiniBand" (hardware.hpp cites each link);
/// the first is the main rows' profile.
std::vector<std::pair<replay::HardwareProfile, std::string>> basp_layouts() {
  return {{replay::profiles::a100_40gb(), "HGX 4-GPU, all on NVLink, 1 NIC a node (default)"},
          {replay::profiles::a100_40gb_nic_per_gpu(), "HGX 4-GPU, all on NVLink, 1 NIC a GPU"},
          {replay::profiles::a100_40gb_pcie_pairs(), "PCIe cards, NVLink pairs, 1 NIC a node"},
          {replay::profiles::a100_40gb_pcie_pairs_nic_per_gpu(), "PCIe cards, NVLink pairs, 1 NIC a GPU"}};
}

void run_basp() {
  const replay::HardwareProfile hw = replay::profiles::a100_40gb();
  const Topology topo{8, 4};
  replay::SimulationOptions sim;
  sim.hardware = hw;
  std::vector<BaspWorkload> ws = {
      {"W1 llama-3.1-8b 16K B=2", replay::models::llama31_8b(), 16384, 2, 1.21, "1.21x [R]", kNaN,
       "2.23-3.10x over models [R]"},
      {"W2 qwen1.5-1.8b 16K B=2", replay::models::qwen15_1_8b(), 16384, 2, 1.315, "1.31-1.32x [R]", 3.10, "3.10x [S]",
       "37.7->16%"},
      {"W3 llama-3.2-1b 8K B=8", replay::models::llama32_1b(), 8192, 8, 1.25, "~1.25x [R]", 85.0, "~85x [R]"},
      {"W4 llama-3.2-3b 32K B=2", replay::models::llama32_3b(), 32768, 2, 1.0 / (1.0 - 0.259),
       "-25.9% step time = 1.35x [R]", kNaN, "-"},
      {"W5 llama-3.2-1b 16K B=2", replay::models::llama32_1b(), 16384, 2, kNaN, "-", 2.45, "2.45x [S]", "33.5->13.4%"},
  };
  if (g_smoke)
    ws = {{"W2 qwen1.5-1.8b 4K B=2 (smoke)", replay::models::qwen15_1_8b(), 4096, 2, 1.315, "1.31-1.32x [R]", 3.10,
           "3.10x [S]", "37.7->16%"}};

  using comm::AllToAll, comm::Ring;
  using partition::BatchAware, partition::Uniform, partition::Zigzag, partition::Hybrid;
  using Hier = comm::Hierarchical<AllToAll, Ring>;
  std::printf("\n== BASP (2 nodes x 4 %s, ZeRO-3 over 8, checkpointing; training step) ==\n", hw.name.c_str());
  std::printf("%-26s %-26s %9s %9s %9s %8s %8s %8s %7s %9s %-30s\n", "workload", "strategy", "step ms", "speedup",
              "paper", "a2a ms", "a2a x", "+copy x", "a2a %", "mem GiB", "paper a2a");
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
    std::vector<replay::CompiledStrategy> compiled;  // Ulysses and BASP, replayed again per layout below
    for (const plan::Candidate& e : entries) {
      Run run;
      replay::CompiledStrategy c = e.compile(batch, shape, topo);
      run.ok = static_cast<bool>(c.status);
      run.reason = c.status.reason;
      if (run.ok) run.rep = plan::simulate_step(c, topo, train, sim);
      runs.push_back(std::move(run));
      if (compiled.size() < 2) compiled.push_back(std::move(c));
    }
    if (runs[0].ok && runs[1].ok)
      for (const auto& [layout, description] : basp_layouts()) {
        replay::SimulationOptions lo;
        lo.hardware = layout;
        const plan::StepReport u = plan::simulate_step(compiled[0], topo, train, lo);
        const plan::StepReport b = plan::simulate_step(compiled[1], topo, train, lo);
        LayoutRow row;
        row.layout = layout.name;
        row.description = description;
        row.workload = w.name;
        row.is_default = layout.name == hw.name;
        row.step_speedup = u.step_s / b.step_s;
        row.paper_step = w.paper_e2e;
        row.ulysses_a2a_s = u.attention_comm_s;
        row.basp_a2a_s = b.attention_comm_s;
        row.a2a_speedup = ratio(u.attention_comm_s, b.attention_comm_s);
        row.a2a_copy_speedup =
            b.attention_comm_s > 0 ? ratio(u.attention_comm_copy_s, b.attention_comm_copy_s) : row.a2a_speedup;
        row.paper_a2a = w.paper_a2a;
        row.ulysses_share = a2a_share(u, w.model);
        row.basp_share = a2a_share(b, w.model);
        row.paper_share = w.paper_share;
        g_layouts.push_back(row);
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
      r.a2a_copy_s = rep.attention_comm_copy_s;
      r.a2a_copy_speedup = rep.attention_comm_s > 0 ? ratio(base.attention_comm_copy_s, rep.attention_comm_copy_s)
                                                    : r.a2a_speedup;  // no all-to-all left: its copies are not one
      r.a2a_share = a2a_share(rep, w.model);
      if (i == 1) {
        r.paper_speedup = w.paper_e2e;
        r.paper_figure = w.paper_e2e_text;
        r.paper_a2a_speedup = w.paper_a2a;
      }
      r.notes = "peak memory " + fmt("%.1f", rep.max_peak_memory_bytes() / replay::profiles::kGiB) + " GiB of 40";
      std::printf("%-26s %-26s %9.1f %9s %9s %8.2f %8s %8s %6.1f%% %9.1f %-30s\n", w.name.c_str(), r.strategy.c_str(),
                  rep.step_s * 1e3, fmt("%.2fx", r.speedup).c_str(), i == 1 ? w.paper_e2e_text.c_str() : "",
                  rep.attention_comm_s * 1e3, fmt("%.2fx", r.a2a_speedup).c_str(),
                  fmt("%.2fx", r.a2a_copy_speedup).c_str(), 100.0 * r.a2a_share,
                  rep.max_peak_memory_bytes() / replay::profiles::kGiB, i == 1 ? w.paper_a2a_text.c_str() : "");
      g_records.push_back(r);
    }
  }
  std::printf(
      "\n-- BASP vs Ulysses under each reading of the paper's node (its layout is not given; hardware.hpp "
      "cites each link) --\n");
  std::printf("%-34s %-48s %-26s %7s %7s %8s %7s %7s %9s %13s %12s\n", "layout", "", "workload", "step x", "paper",
              "a2a x", "+copy x", "paper", "uly a2a ms", "a2a % uly->basp", "paper a2a %");
  for (const LayoutRow& l : g_layouts)
    std::printf("%-34s %-48s %-26s %7s %7s %8s %7s %7s %9.2f %6.1f->%5.1f%% %12s\n", l.layout.c_str(),
                l.description.c_str(), l.workload.c_str(), fmt("%.2fx", l.step_speedup).c_str(),
                fmt("%.2fx", l.paper_step).c_str(), fmt("%.2fx", l.a2a_speedup).c_str(),
                fmt("%.2fx", l.a2a_copy_speedup).c_str(), fmt("%.2fx", l.paper_a2a).c_str(), l.ulysses_a2a_s * 1e3,
                100 * l.ulysses_share, 100 * l.basp_share, l.paper_share.c_str());
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
    std::string mine;  // DPP's own breakdown, carried by every record of the workload
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
  const schedule::PipelineModel pm = plan::pipeline_model(opt);
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
    const auto try_schedule = [&](const schedule::PipelineSchedule& sched) {
      plan::PipelineStepReport rep = plan::simulate_pipeline_step(chunks, sched, opt);
      if (!rep.fits_memory) {
        last_reason = "capacity " + std::to_string(cap) + ": executed peak " +
                      fmt("%.1f", rep.max_peak_memory_bytes() / replay::profiles::kGB) + " GB over the cap " +
                      fmt("%.1f", rep.memory_cap_bytes / replay::profiles::kGB) + " GB";
        return false;
      }
      if (!best.ok || rep.step_s < best.rep.step_s) {
        best.ok = true;
        best.rep = std::move(rep);
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

struct DppWorkload {
  replay::ModelShape model;
  std::string mix;
  std::int64_t context;
  bool ablation = false;  ///< run the ablated variants (the paper's 13B, 64K)
};

std::string dpp_workload_name(const DppWorkload& w) {
  std::string m = w.model.name.substr(w.model.name.find('-') + 1);
  return w.model.name.substr(0, w.model.name.find('-')) + "-" + m + " " + w.mix + " " +
         std::to_string(w.context / 1024) + "K";
}

void run_dpp() {
  const replay::HardwareProfile hw = replay::profiles::a800_80gb();
  const int sequences = g_smoke ? 64 : 512;
  std::vector<DppWorkload> ws;
  if (g_smoke) {
    ws = {{replay::models::llama_7b(), "commoncrawl", 16384, true}};
  } else {
    for (const std::int64_t ctx : {49152, 98304})
      for (const char* mix : {"commoncrawl", "github"})
        for (const auto& m : {replay::models::llama_7b(), replay::models::llama_13b(), replay::models::llama_30b()})
          ws.push_back({m, mix, ctx, false});
    for (const char* mix : {"commoncrawl", "github"}) ws.push_back({replay::models::llama_13b(), mix, 65536, true});
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
      if (c <= w.context && (!g_smoke || c <= 8192)) caps.push_back(c);
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
        g_records.push_back(r);
        return;
      }
      r.predicted_s = strategy_s;
      r.baseline_s = baseline_s;
      r.speedup = baseline_s / strategy_s;
      std::printf("%-28s %-18s %9.2f %9s %9s %-16s %s\n", wname.c_str(), strategy.c_str(), strategy_s,
                  fmt("%.2fx", r.speedup).c_str(), paper_text.c_str(), baseline.c_str(), notes.c_str());
      g_records.push_back(r);
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
      const bench::dpp::UlyssesZero3 deepspeed{
          w.model, hw, 32, b30 ? 36 : 0, opt.memory_reserve, b7 ? std::vector<int>{16, 16} : std::vector<int>{32}};
      const bench::dpp::BaselineStep ds = deepspeed.step(lengths);
      if (ds.feasible)
        add("dpp", dpp_type, "deepspeed-ulysses", t, ds.step_s, 2.07, "up to 2.07x [R]", true, false,
            "deepspeed: " + baseline_notes(ds));
      else
        add("deepspeed-ulysses", "Ulysses + ZeRO-3", "-", kNaN, kNaN, kNaN, "", false, true, ds.reason);
      const bench::dpp::MegatronCp megatron{w.model, hw, 32, 8, b7 ? 2 : 4, b7 ? 10 : b30 ? 55 : 20, w.context};
      const bench::dpp::BaselineStep mg = megatron.step(lengths);
      add("dpp", dpp_type, "megatron-cp", t, mg.step_s, 2.60, "up to 2.60x [R]", true, !mg.feasible,
          mg.feasible ? "megatron: " + baseline_notes(mg) : mg.reason);
      const DppRun seq1f1b = run_dpp_variant(batch, opt, DppVariant::kSeq1F1B, caps);
      const bool ctx48 = w.context == 49152;
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
        if (r.ok)
          add("dpp", dpp_type, name, t, r.rep.step_s, 1.21, "1.14-1.28x [R]", false, false,
              std::string(name) + ": " + dpp_notes(r));
        else
          add(name, "DPP ablation", "-", kNaN, kNaN, kNaN, "", false, true, r.reason);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Summary: direction and size against the papers, and the best composition per workload.
// ---------------------------------------------------------------------------------------------------------

/// The factors we claim; kClaimText below says why.
constexpr double kClaimedFactor = 2.0;
constexpr double kA2AFactor = 2.0;
constexpr double kFlashCpFloor = 0.95;  ///< FlashCP never below this fraction of the best baseline (issue 16)

struct Verdict {
  std::string paper, workload, comparison;
  double seqpar = kNaN, paper_value = kNaN;
  bool bound = false;
  bool direction_ok = false, size_ok = false;
  bool claimed = true;  ///< counted in the claim (false: reported only)
  double factor = kClaimedFactor;
  bool floor = false;  ///< a lower bound (paper_value is the floor), not a ratio to the paper
};

std::vector<Verdict> verdicts() {
  std::vector<Verdict> out;
  // FlashCP: the paper's "up to" is compared with seqpar's best speedup over the mixes; the single
  // document with every single-document row.
  double flash_best = 0, flash_worst = std::numeric_limits<double>::infinity();
  std::string flash_best_w, flash_worst_w;
  std::map<std::string, std::pair<double, std::string>> per_mix;  // mix -> best speedup, its workload
  // DPP's "up to" figures: per baseline (Seq1F1B per context), the best speedup over the workloads.
  std::map<std::string, std::tuple<double, std::string, double>> dpp_best;  // -> speedup, workload, paper
  for (const Record& r : g_records) {
    if (r.paper == "FlashCP" && r.strategy == "flashcp-hybrid" && !r.refused && r.speedup < flash_worst)
      flash_worst = r.speedup, flash_worst_w = r.workload;
    if (std::isnan(r.paper_speedup) || r.refused) continue;
    if (r.paper == "DPP" && (r.paper_bound || r.baseline == "flexsp")) {
      const std::string context = r.workload.substr(r.workload.rfind(' ') + 1);
      const std::string key = r.baseline == "seq1f1b" ? "seq1f1b at " + context : r.baseline;
      auto& b = dpp_best[key];
      if (r.speedup > std::get<0>(b)) b = {r.speedup, r.workload, r.baseline == "flexsp" ? 1.69 : r.paper_speedup};
      if (r.paper_bound) continue;
    }
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
  for (const auto& [key, best] : dpp_best) {
    const auto& [speedup, workload, paper] = best;
    Verdict v{"DPP", "best over workloads (" + workload + ")", "dpp vs " + key, speedup, paper, true};
    v.direction_ok = speedup > 1.0;
    v.size_ok = speedup / paper <= kClaimedFactor && paper / speedup <= kClaimedFactor;
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
  if (std::isfinite(flash_worst)) {
    Verdict v{"FlashCP", "worst of all (" + flash_worst_w + ")", "flashcp-hybrid vs best baseline, floor", flash_worst,
              kFlashCpFloor};
    v.floor = true;
    v.direction_ok = flash_worst >= kFlashCpFloor;
    v.size_ok = v.direction_ok;
    out.push_back(v);
  }
  // BASP all-to-all speedups: the transfers alone (reported), and with the permute copies around them,
  // which DeepSpeed-Ulysses' all-to-all function runs inside it [I: what the paper's timer covers] (claimed).
  for (const Record& r : g_records)
    if (r.paper == "BASP" && !std::isnan(r.paper_a2a_speedup) && !r.refused)
      for (const bool copies : {false, true}) {
        const double x = copies ? r.a2a_copy_speedup : r.a2a_speedup;
        Verdict v{r.paper, r.workload,
                  copies ? "all-to-all + permutes basp vs ulysses" : "all-to-all transfers basp vs ulysses", x,
                  r.paper_a2a_speedup};
        v.direction_ok = x > 1.0;
        v.factor = kA2AFactor;
        v.claimed = copies;  // the transfers alone are reported; with the permutes, claimed (and missed: kClaimText)
        // B = 8: no all-to-all is left at all (K = 1), so the ratio is infinite; the paper's ~85x is the
        // residue of its implementation. Direction only.
        v.size_ok = std::isinf(x) || (x / r.paper_a2a_speedup <= kA2AFactor && r.paper_a2a_speedup / x <= kA2AFactor);
        out.push_back(v);
      }
  return out;
}

/// Whether `x` lies within `factor` of `paper` either way.
bool within(double x, double paper, double factor) {
  return x / paper <= factor && paper / x <= factor;
}

/// BASP by node layout: per layout, its all-to-all (+ permutes) against the paper's on the workloads with a
/// figure, how many step gains land within 2x, and BASP's all-to-all share of its step against the paper's
/// [S]. Reported, not claimed: the claim is the default layout's (the rows above). The last lines say
/// under which layouts each holds.
std::string layout_summary() {
  if (g_layouts.empty()) return "";
  std::string out =
      "BASP by node layout (reported, not claimed; the claim above is the default layout's): all-to-all +\n"
      "permutes vs the paper's, step gains within 2x, BASP's all-to-all share of its step vs the paper's [S]\n";
  char buf[512];
  std::snprintf(buf, sizeof buf, "%-34s %-40s %-14s %-15s %s\n", "layout", "a2a+copy x seqpar (paper)", "a2a within 2x",
                "step within 2x", "basp a2a % seqpar (paper)");
  out += buf;
  std::vector<std::string> a2a_holds, share_holds;
  std::vector<std::string> order;
  for (const LayoutRow& l : g_layouts)
    if (std::find(order.begin(), order.end(), l.layout) == order.end()) order.push_back(l.layout);
  for (const std::string& name : order) {
    std::string a2a, shares;
    int a2a_n = 0, a2a_ok = 0, step_n = 0, step_ok = 0, share_n = 0, share_ok = 0;
    bool is_default = false;
    for (const LayoutRow& l : g_layouts) {
      if (l.layout != name) continue;
      is_default = l.is_default;
      const std::string w = l.workload.substr(0, l.workload.find(' '));
      if (!std::isnan(l.paper_step)) {
        ++step_n;
        step_ok += within(l.step_speedup, l.paper_step, kClaimedFactor) ? 1 : 0;
      }
      if (!std::isnan(l.paper_a2a) && std::isfinite(l.a2a_copy_speedup)) {
        ++a2a_n;
        a2a_ok += within(l.a2a_copy_speedup, l.paper_a2a, kA2AFactor) ? 1 : 0;
        a2a += (a2a.empty() ? "" : ", ") + w + " " + fmt("%.2f", l.a2a_copy_speedup) + " (" + fmt("%.2f", l.paper_a2a) +
               ")";
      }
      if (l.paper_share != "-") {
        // The paper's shares read "Ulysses->BASP%"; BASP's is the one after the arrow.
        const double paper_basp = std::stod(l.paper_share.substr(l.paper_share.find('>') + 1)) / 100;
        ++share_n;
        share_ok += within(l.basp_share, paper_basp, kClaimedFactor) ? 1 : 0;
        shares +=
            (shares.empty() ? "" : ", ") + fmt("%.1f", 100 * l.basp_share) + " (" + fmt("%.1f", 100 * paper_basp) + ")";
      }
    }
    std::snprintf(buf, sizeof buf, "%-34s %-40s %-14s %-15s %s\n", (name + (is_default ? " (default)" : "")).c_str(),
                  a2a.c_str(), (std::to_string(a2a_ok) + " of " + std::to_string(a2a_n)).c_str(),
                  (std::to_string(step_ok) + " of " + std::to_string(step_n)).c_str(), shares.c_str());
    out += buf;
    if (a2a_n > 0 && a2a_ok == a2a_n && step_ok == step_n) a2a_holds.push_back(name);
    if (share_n > 0 && share_ok == share_n) share_holds.push_back(name);
  }
  const auto list = [](const std::vector<std::string>& v) {
    std::string s;
    for (const std::string& x : v) s += (s.empty() ? "" : ", ") + x;
    return s.empty() ? std::string("none") : s;
  };
  out += "all-to-all within 2x and every step gain within 2x under: " + list(a2a_holds) + "\n";
  out += "BASP's all-to-all share within 2x of the paper's under: " + list(share_holds) + "\n";
  return out;
}

const char* kClaimText =
    "Claim (issue 16): every comparison goes the paper's way; headline speedups (training step, tokens/s,\n"
    "attention layer) land within 2x of the paper's figure, BASP's all-to-all ratio within 2x, and FlashCP is\n"
    "never below 0.95x of the best baseline. The model prices what a real NCCL call pays besides bandwidth: a\n"
    "fixed cost per call and per peer, and a launch gap per copy kernel (hardware.hpp cites them); HSAP's model\n"
    "and GPUs are unknown (Llama-3.1-8B on H100 assumed); FlashCP's length mixes are unpublished, and 64-token\n"
    "Per-Doc chunks of 1K documents are priced by an efficiency curve extrapolated below FA3's 512-token anchor.\n"
    "BASP's all-to-all: the paper gives 2 nodes x 4 A100-40GB, \"NVLink\" and 400 Gb/s InfiniBand, not the node's\n"
    "layout. The rows above read it as an HGX A100 4-GPU node (all four GPUs on NVLink, NCCL ~230 GB/s each)\n"
    "with one 400 Gb/s port a node: there a GPU's quarter of the NIC against its NVLink keeps the ~11x\n"
    "bandwidth-time gap (anchors-hw.md 1.5), ~7x with the fixed costs and the permute copies (which\n"
    "DeepSpeed-Ulysses runs inside its all-to-all function, and which the paper's timer covers [I]), where the\n"
    "paper measures 2.45-3.10x [S]: missed under that reading. The layout table replays Ulysses and BASP on\n"
    "the other readings (hardware.hpp cites each link): the assumption that explains the gap is the node's\n"
    "fabric. A100-40GB PCIe cards in NVLink-bridged pairs put 2 of BASP's 3 peers across PCIe (NCCL ~20 GB/s),\n"
    "which brings the ratio within 2x and leaves BASP's all-to-all a share of its step within 2x of the\n"
    "13.4-16% the paper reports [S]; one NIC a GPU also brings the ratio within 2x, but keeps BASP's\n"
    "all-to-all on NVLink at a few percent of its step. See the lines after the table.\n"
    "padding-32k (every document its own 32K row) is reported, not claimed: HSAP's +180% fits padding to the\n"
    "longest document of a batch. DPP's baselines are closed-form step models on the same kernel and link costs\n"
    "(bench/support/dpp_baselines.hpp), not seqpar programs; they hide ZeRO-3 traffic under compute on its own\n"
    "stream, and activations are ModelShape's estimate, under which 80 GB rarely binds. The paper measures\n"
    "FlexSP's exposed ZeRO and all-to-all at up to 3.2x DPP's and makes Seq1F1B and the no-checkpointing\n"
    "ablation pay for memory: where the model sees neither, it gives DPP less than the paper does.\n";

std::string verdict_text(const Verdict& v) {
  if (v.floor) return v.direction_ok ? "at or above the floor" : "BELOW THE FLOOR";
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
                (std::string(v.floor   ? ">="
                             : v.bound ? "<="
                                       : "") +
                 fmt("%.2fx", v.paper_value))
                    .c_str(),
                fmt("%.2f", v.seqpar / v.paper_value).c_str(), verdict_text(v).c_str());
    if (v.claimed) {
      ++claimed;
      held += v.direction_ok && v.size_ok ? 1 : 0;
    }
  }
  std::printf("claim holds for %d of %d claimed comparisons\n", held, claimed);
  std::printf("\n%s", layout_summary().c_str());
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
  if (const std::string layouts = layout_summary(); !layouts.empty())
    std::fprintf(f, "```\n%s```\n\n", layouts.c_str());
  std::fprintf(
      f,
      "| paper | workload | comparison | seqpar | paper | seqpar/paper | verdict |\n|---|---|---|---|---|---|---|\n");
  for (const Verdict& v : vs)
    std::fprintf(f, "| %s | %s | %s | %s | %s%s | %s | %s |\n", v.paper.c_str(), v.workload.c_str(),
                 v.comparison.c_str(), fmt("%.2fx", v.seqpar).c_str(),
                 v.floor   ? ">= "
                 : v.bound ? "<= "
                           : "",
                 fmt("%.2fx", v.paper_value).c_str(), fmt("%.2f", v.seqpar / v.paper_value).c_str(),
                 verdict_text(v).c_str());
  for (const char* paper : {"BASP", "HSAP", "FlashCP", "DPP"}) {
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
  for (const char* paper : {"BASP", "HSAP", "FlashCP", "DPP"}) {
    std::vector<std::tuple<std::string, double, double, bool>> groups;
    std::string title;
    for (const Record& r : g_records) {
      if (r.paper != paper || r.refused || std::isnan(r.paper_speedup)) continue;
      std::string label = r.workload;
      if (r.paper == std::string("HSAP") || r.paper == std::string("DPP")) label += " vs " + r.baseline;
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
    } else if (std::string(paper) == "DPP") {
      title = "DPP: training step speedup (4 x 8 A800, 512 sequences)";
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
  std::string json, markdown, svg_dir, only;
  const auto lower = [](std::string x) {
    std::transform(x.begin(), x.end(), x.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    return x;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--smoke")
      g_smoke = true;
    else if (a == "--json" && i + 1 < argc)
      json = argv[++i];
    else if (a == "--markdown" && i + 1 < argc)
      markdown = argv[++i];
    else if (a == "--paper" && i + 1 < argc)
      only = lower(argv[++i]);
    else if (a == "--svg-dir" && i + 1 < argc)
      svg_dir = argv[++i];
    else {
      std::fprintf(stderr, "usage: %s [--smoke] [--paper NAME] [--json FILE] [--markdown FILE] [--svg-dir DIR]\n",
                   argv[0]);
      return 2;
    }
  }
  if (markdown.empty() && !json.empty()) {
    const auto dot = json.rfind('.');
    markdown =
        (dot == std::string::npos || json.find('/', dot) != std::string::npos ? json : json.substr(0, dot)) + ".md";
  }
  const auto t0 = std::chrono::steady_clock::now();
  const auto wanted = [&](const char* paper) { return only.empty() || only == lower(paper); };
  if (!(wanted("BASP") || wanted("HSAP") || wanted("FlashCP") || wanted("DPP"))) {
    std::fprintf(stderr, "--paper %s: not one of BASP, HSAP, FlashCP, DPP\n", only.c_str());
    return 2;
  }
  if (wanted("BASP")) run_basp();
  if (wanted("HSAP")) run_hsap();
  if (wanted("FlashCP")) run_flashcp();
  if (wanted("DPP")) run_dpp();
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
      j.add("a2a_with_copies_s", r.a2a_copy_s).add("a2a_with_copies_speedup", r.a2a_copy_speedup);
      j.add("a2a_share_of_step", r.a2a_share).add("smoke", g_smoke).add("notes", r.notes);
      records.push_back(j);
    }
    // BASP by node layout (LayoutRow): Ulysses and BASP replayed on each reading of the paper's node.
    for (const LayoutRow& l : g_layouts) {
      bench::JsonRecord j;
      j.add("paper", "BASP").add("workload", l.workload).add("strategy", "basp").add("baseline", "ulysses");
      j.add("metric", "node layout").add("layout", l.layout).add("layout_description", l.description);
      j.add("default_layout", l.is_default).add("step_speedup", l.step_speedup).add("paper_speedup", l.paper_step);
      j.add("a2a_speedup", l.a2a_speedup).add("a2a_with_copies_speedup", l.a2a_copy_speedup);
      j.add("paper_a2a_speedup", l.paper_a2a).add("ulysses_a2a_s", l.ulysses_a2a_s).add("basp_a2a_s", l.basp_a2a_s);
      j.add("ulysses_a2a_share_of_step", l.ulysses_share).add("basp_a2a_share_of_step", l.basp_share);
      j.add("paper_a2a_share", l.paper_share);
      j.add("a2a_within_2x", !std::isnan(l.paper_a2a) && std::isfinite(l.a2a_copy_speedup) &&
                                 within(l.a2a_copy_speedup, l.paper_a2a, kA2AFactor));
      j.add("smoke", g_smoke);
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
