// SPDX-License-Identifier: Apache-2.0
// seqpar-plan's default mode: every candidate strategy compiled for every rank and replayed on the profile
// (a training step with plan::simulate_step, or one attention layer with --attention-only), the table and
// the pick: the fastest that can run the batch and fits in memory.
#include <seqpar/plan/candidates.hpp>
#include <seqpar/plan/step.hpp>
#include <seqpar/replay/predict.hpp>
#include <seqpar/version.hpp>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "modes.hpp"
#include "support/json.hpp"

namespace seqpar::tools {
namespace {

// ---- evaluation --------------------------------------------------------------------------------------

struct Row {
  enum class State { kOk, kRefused, kFailed };
  std::string name, description;
  State state = State::kOk;
  std::string reason;  ///< refusal or failure
  double time_s = 0, tokens_per_s = 0, attention_fwd_s = 0, attention_bwd_s = 0;
  std::uint64_t bytes_intra = 0, bytes_inter = 0;  ///< max over ranks
  double imbalance = 1, memory_bytes = 0, exposed_s = 0;
  bool fits = false;
};

/// Memory of one attention layer's forward + backward on a rank: Q, dQ (Hq x d_qk), O, dO (Hq x d_v), K, dK
/// (Hkv x d_qk), V, dV (Hkv x d_v) and fp32 LSE of its tokens, plus the larger of its programs' staging
/// buffers.
double attention_memory_bytes(const AttentionShape& shape, double value_bytes, std::int64_t tokens,
                              double staging_bytes) {
  const double per_token =
      2.0 * value_bytes * static_cast<double>(shape.heads_q + shape.heads_kv) * (shape.qk_dim() + shape.v_dim()) +
      4.0 * shape.heads_q;
  return static_cast<double>(tokens) * per_token + staging_bytes;
}

/// Compiles and simulates one candidate. With `trace`, the simulation keeps the events and moves them there.
/// `phase` is told when compiling ends and simulating starts (the progress line).
Row evaluate(const plan::Candidate& candidate, const Problem& p, const replay::SimulationOptions& sim,
             replay::Trace* trace, const std::function<void(const char*)>& phase) {
  Row row;
  row.name = candidate.name;
  row.description = candidate.description;
  phase("compiling");
  const replay::CompiledStrategy compiled = candidate.compile(p.batch, p.shape, p.topology, p.masks, p.mask);
  if (!compiled.status) {
    row.state = Row::State::kRefused;
    row.reason = compiled.status.reason;
    return row;
  }
  phase("simulating");
  const auto n = static_cast<std::size_t>(p.topology.world_size);
  double compute_max = 0, compute_sum = 0;
  const auto add_compute = [&](double c) {
    compute_max = std::max(compute_max, c);
    compute_sum += c;
  };
  if (p.attention_only) {
    replay::AttentionPrediction pred = replay::predict(compiled, p.topology, p.shape, sim);
    row.time_s = pred.time_s();
    row.attention_fwd_s = pred.forward.time_s;
    row.attention_bwd_s = pred.backward.time_s;
    const double vb = sim.value_bytes > 0 ? sim.value_bytes : p.hardware.value_bytes;
    for (std::size_t r = 0; r < n; ++r) {
      const replay::RankTiming& f = pred.forward.ranks[r];
      const replay::RankTiming& b = pred.backward.ranks[r];
      row.bytes_intra = std::max(row.bytes_intra, f.bytes_intra + b.bytes_intra);
      row.bytes_inter = std::max(row.bytes_inter, f.bytes_inter + b.bytes_inter);
      row.exposed_s = std::max(row.exposed_s, f.exposed_comm_s + b.exposed_comm_s);
      add_compute(f.compute_s + b.compute_s);
      row.memory_bytes = std::max(row.memory_bytes,
                                  attention_memory_bytes(p.shape, vb, compiled.plan.local_tokens(static_cast<int>(r)),
                                                         std::max(f.staging_bytes, b.staging_bytes)));
    }
    if (trace != nullptr) {
      *trace = std::move(pred.forward.trace);
      trace->append(pred.backward.trace);  // the backward replay already starts where the forward ended
    }
  } else {
    plan::StepReport step = plan::simulate_step(compiled, p.topology, p.training, sim);
    row.time_s = step.step_s;
    row.tokens_per_s = step.tokens_per_s;
    row.attention_fwd_s = step.attention_fwd_s;
    row.attention_bwd_s = step.attention_bwd_s;
    for (const plan::StepRank& r : step.ranks) {
      row.bytes_intra = std::max(row.bytes_intra, r.bytes_intra);
      row.bytes_inter = std::max(row.bytes_inter, r.bytes_inter);
      row.exposed_s = std::max(row.exposed_s, r.exposed_comm_s);
      add_compute(r.gemm_s + r.attention_s);
    }
    row.memory_bytes = step.max_peak_memory_bytes();
    if (trace != nullptr) *trace = std::move(step.trace);
  }
  row.imbalance = compute_sum > 0 ? compute_max * static_cast<double>(n) / compute_sum : 1.0;
  row.fits = row.memory_bytes <= p.hardware.memory_bytes;
  return row;
}

/// "[k/n] ..." on stderr while the candidates are simulated, rewritten in place; only on a terminal.
class Progress {
 public:
  explicit Progress(bool enabled) : enabled_(enabled) {}
  void show(std::size_t k, std::size_t n, const std::string& what) const {
    if (enabled_) std::fprintf(stderr, "\r\033[K[%zu/%zu] %s", k, n, what.c_str());
  }
  void clear() const {
    if (enabled_) std::fprintf(stderr, "\r\033[K");
  }

 private:
  bool enabled_;
};

// ---- output ------------------------------------------------------------------------------------------

double mib(std::uint64_t bytes) {
  return static_cast<double>(bytes) / (1024.0 * 1024.0);
}

/// One line on why `pick` beats the runner-up (the next fastest that runs and fits): which term of the
/// replay decides. A row's time splits into exposed communication (the slowest rank's waits on
/// transfers and collectives) and the rest (compute and copies, where the imbalance shows); the term
/// whose difference is larger decides, and inter-node bytes are named when they differ by 2x or more.
std::string why_it_wins(const std::vector<Row>& rows, std::size_t pick) {
  std::optional<std::size_t> second;
  for (std::size_t i = 0; i < rows.size(); ++i)
    if (i != pick && rows[i].state == Row::State::kOk && rows[i].fits &&
        (!second || rows[i].time_s < rows[*second].time_s))
      second = i;
  if (!second) return "why: it is the only strategy that runs the batch and fits";
  const Row &a = rows[pick], &b = rows[*second];
  const double exposed = b.exposed_s - a.exposed_s;
  const double rest = (b.time_s - b.exposed_s) - (a.time_s - a.exposed_s);
  char line[512];
  std::snprintf(line, sizeof line, "why: %.3f ms ahead of %s, ", (b.time_s - a.time_s) * 1e3, b.name.c_str());
  std::string why = line;
  const auto delta = [](double d) {  // "12.345 ms less" / "1.234 ms more" for the pick
    char text[64];
    std::snprintf(text, sizeof text, "%.3f ms %s", std::abs(d) * 1e3, d >= 0 ? "less" : "more");
    return std::string(text);
  };
  char terms[2][256];
  std::snprintf(terms[0], sizeof terms[0], "exposed communication %.3f vs %.3f ms (%s)", a.exposed_s * 1e3,
                b.exposed_s * 1e3, delta(exposed).c_str());
  std::snprintf(terms[1], sizeof terms[1], "compute and copies %s (compute imbalance %.3f vs %.3f)",
                delta(rest).c_str(), a.imbalance, b.imbalance);
  const bool comm_decides = exposed >= rest;
  std::snprintf(line, sizeof line, "decided by %s; then %s", terms[comm_decides ? 0 : 1], terms[comm_decides ? 1 : 0]);
  why += line;
  const double ia = mib(a.bytes_inter), ib = mib(b.bytes_inter);
  if (ib >= 2 * ia + 1e-9 || ia >= 2 * ib + 1e-9) {
    std::snprintf(line, sizeof line, "; inter-node %.1f vs %.1f MiB per rank", ia, ib);
    why += line;
  }
  return why;
}

void print_table(const Problem& p, const std::vector<Row>& rows, std::optional<std::size_t> pick) {
  const Topology& t = p.topology;
  const std::string what = p.attention_only
                               ? "one attention layer (fwd+bwd), heads " + std::to_string(p.shape.heads_q) + ":" +
                                     std::to_string(p.shape.heads_kv) + " x " + std::to_string(p.shape.head_dim) +
                                     (p.shape.split_dims() ? " (values " + std::to_string(p.shape.v_dim()) + ")" : "")
                               : "training step of " + p.model->name;
  std::printf("%s: %s on %d x %s (%d node%s of %d)\n", kTool, what.c_str(), t.world_size, p.hardware.name.c_str(),
              t.num_nodes(), t.num_nodes() == 1 ? "" : "s", t.ranks_per_node);
  std::printf("  batch: %s\n", describe_batch(p).c_str());
  std::printf("  %s\n", describe_elements(p).c_str());
  if (!p.attention_only) {
    const int zero = p.training.zero_ranks == 0 ? t.world_size : p.training.zero_ranks;
    std::printf("  %s, %s, %d micro-batch%s\n",
                zero == 1 ? "no ZeRO-3 sharding" : ("ZeRO-3 over " + std::to_string(zero) + " ranks").c_str(),
                p.training.checkpointing ? "activation checkpointing" : "no checkpointing", p.training.micro_batches,
                p.training.micro_batches == 1 ? "" : "es");
  }
  int width = 8;
  for (const Row& r : rows) width = std::max(width, static_cast<int>(r.name.size()));
  // The tokens/s column only exists for a training step.
  const std::string tokens_header = p.attention_only ? "" : " " + std::string(12 - 8, ' ') + "tokens/s";
  std::printf("\n  %-*s %12s%s %10s %10s %10s %10s %11s\n", width, "strategy",
              p.attention_only ? "fwd+bwd ms" : "step ms", tokens_header.c_str(), "intra MiB", "inter MiB", "imbalance",
              "peak GiB", "exposed ms");
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    const char mark = pick && *pick == i ? '*' : ' ';
    if (r.state != Row::State::kOk) {
      std::printf("%c %-*s %s: %s\n", mark, width, r.name.c_str(),
                  r.state == Row::State::kRefused ? "refused" : "failed", r.reason.c_str());
      continue;
    }
    char tokens[32] = "";
    if (!p.attention_only) std::snprintf(tokens, sizeof tokens, " %12.0f", r.tokens_per_s);
    char memory[32];
    std::snprintf(memory, sizeof memory, "%.2f%s", gib(r.memory_bytes), r.fits ? " " : "!");
    std::printf("%c %-*s %12.3f%s %10.1f %10.1f %10.3f %10s %11.3f\n", mark, width, r.name.c_str(), r.time_s * 1e3,
                tokens, mib(r.bytes_intra), mib(r.bytes_inter), r.imbalance, memory, r.exposed_s * 1e3);
  }
  std::printf("\n");
  const bool over =
      std::any_of(rows.begin(), rows.end(), [](const Row& r) { return r.state == Row::State::kOk && !r.fits; });
  if (!pick)
    std::printf("no pick: %s\n", over ? ("every strategy that runs the batch needs more than the profile's " +
                                         format_gib(p.hardware.memory_bytes) + " per rank ('!')")
                                            .c_str()
                                      : "no strategy can run the batch");
  else {
    std::printf("* %s: the fastest of the strategies that run the batch and fit in %s per rank%s\n",
                rows[*pick].name.c_str(), format_gib(p.hardware.memory_bytes).c_str(), over ? " ('!': over it)" : "");
    std::printf("  %s\n", why_it_wins(rows, *pick).c_str());
  }
}

std::string json_text(const Problem& p, const std::vector<Row>& rows, std::optional<std::size_t> pick) {
  bench::JsonRecord plan;
  plan.add("tool", kTool)
      .add("version", std::to_string(SEQPAR_VERSION_MAJOR) + "." + std::to_string(SEQPAR_VERSION_MINOR) + "." +
                          std::to_string(SEQPAR_VERSION_PATCH))
      .add("mode", p.attention_only ? "attention" : "step")
      .add("profile", p.hardware.name)
      .add("memory_bytes", std::llround(p.hardware.memory_bytes))
      .add("ranks", p.topology.world_size)
      .add("ranks_per_node", p.topology.ranks_per_node)
      .add("model", p.model ? p.model->name : std::string())
      .add("heads_q", p.shape.heads_q)
      .add("heads_kv", p.shape.heads_kv)
      .add("head_dim", p.shape.head_dim)
      .add("head_dim_v", p.shape.v_dim())
      .add("tokens", p.batch.total_tokens())
      .add("sequences", p.batch.num_sequences())
      .add("documents", p.documents)
      .add("documents_after_packing", static_cast<std::int64_t>(p.batch.documents().size()))
      .add("longest_document", p.longest_document)
      .add("lengths_source", p.lengths_source)
      .add("window", p.mask.window);
  if (!p.attention_only)
    plan.add("zero_ranks", p.training.zero_ranks == 0 ? p.topology.world_size : p.training.zero_ranks)
        .add("checkpointing", p.training.checkpointing)
        .add("zero_prefetch", p.training.zero_prefetch)
        .add("micro_batches", p.training.micro_batches);
  plan.add("dtype", p.dtype).add("value_bytes", p.hardware.value_bytes);
  plan.add("pick", pick ? rows[*pick].name : std::string());
  if (pick) plan.add("why", why_it_wins(rows, *pick));
  std::string out = "{\n  \"plan\": " + plan.str() + ",\n  \"candidates\": [";
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    bench::JsonRecord rec;
    rec.add("name", r.name)
        .add("description", r.description)
        .add("status", r.state == Row::State::kOk        ? "ok"
                       : r.state == Row::State::kRefused ? "refused"
                                                         : "failed")
        .add("reason", r.reason)
        .add("picked", pick && *pick == i);
    if (r.state == Row::State::kOk) {
      rec.add(p.attention_only ? "attention_s" : "step_s", r.time_s);
      if (!p.attention_only) rec.add("tokens_per_s", r.tokens_per_s);
      rec.add("attention_fwd_s", r.attention_fwd_s)
          .add("attention_bwd_s", r.attention_bwd_s)
          .add("bytes_intra_max", r.bytes_intra)
          .add("bytes_inter_max", r.bytes_inter)
          .add("compute_imbalance", r.imbalance)
          .add("peak_memory_bytes", std::llround(r.memory_bytes))
          .add("fits_memory", r.fits)
          .add("exposed_comm_s", r.exposed_s);
    }
    out += (i ? ",\n    " : "\n    ") + rec.str();
  }
  return out + "\n  ]\n}\n";
}

}  // namespace

int run_strategies(const Options& o, const Problem& p) {
  replay::SimulationOptions sim;
  sim.hardware = p.hardware;
  const Progress progress(!o.quiet && isatty(STDERR_FILENO) == 1);

  std::vector<Row> rows;
  std::optional<std::size_t> pick;
  for (std::size_t i = 0; i < p.candidates.size(); ++i) {
    Row row;
    try {
      row = evaluate(p.candidates[i], p, sim, nullptr, [&](const char* what) {
        progress.show(i + 1, p.candidates.size(), p.candidates[i].name + ": " + what);
      });
    } catch (const std::exception& e) {  // one strategy failing does not hide the others
      row.name = p.candidates[i].name;
      row.description = p.candidates[i].description;
      row.state = Row::State::kFailed;
      row.reason = one_line(e.what());
    }
    if (row.state == Row::State::kOk && row.fits && (!pick || row.time_s < rows[*pick].time_s)) pick = i;
    rows.push_back(std::move(row));
  }
  progress.clear();

  if (o.quiet) {
    if (pick) std::printf("%s\n", rows[*pick].name.c_str());
  } else {
    print_table(p, rows, pick);
  }
  std::fflush(stdout);
  if (o.json) write_file(*o.json, json_text(p, rows, pick), "--json");
  if (!pick) {
    double least = std::numeric_limits<double>::infinity();
    for (const Row& r : rows)
      if (r.state == Row::State::kOk) least = std::min(least, r.memory_bytes);
    std::fprintf(stderr, "%s: no pick: %s\n", kTool,
                 std::isfinite(least) ? ("the strategies that run the batch need at least " + format_gib(least) +
                                         " per rank, more than the profile's " + format_gib(p.hardware.memory_bytes))
                                            .c_str()
                                      : "no strategy can run the batch");
    return 1;
  }
  if (o.trace) {
    replay::SimulationOptions traced = sim;
    traced.trace = true;
    if (o.trace_ranks) traced.trace_max_ranks = *o.trace_ranks;
    replay::Trace trace;
    (void)evaluate(p.candidates[*pick], p, traced, &trace,
                   [&](const char* what) { progress.show(1, 1, "trace of " + rows[*pick].name + ": " + what); });
    progress.clear();
    trace.write(*o.trace);
  }
  return 0;
}

}  // namespace seqpar::tools
