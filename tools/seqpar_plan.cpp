// SPDX-License-Identifier: Apache-2.0
// seqpar-plan: which sequence-parallel strategy to run, as seqpar's cost model predicts it.
//
// For a hardware profile and a rank count, a model shape and a batch of document lengths, it compiles
// every candidate strategy's per-rank programs (plan::standard_candidates), replays them on the profile
// (a whole training step with plan::simulate_step, or one attention layer with --attention-only) and
// prints, per strategy, the predicted time, the attention bytes per rank, the compute imbalance and the
// peak memory. The pick is the fastest strategy that can run the batch and fits in memory.
// With --pipeline-stages N it plans DPP's pipeline instead (run_pipeline): DynamicChunk's chunk plan,
// the 1F1B pipelines of DPP's grouping and their checkpointing (GLPK's MILP when built with
// seqpar::glpk, else the greedy), on N stages of ranks / N ranks each.
// `seqpar-plan --help` lists every option; the option table below is the single source of it.
#include <seqpar/plan/candidates.hpp>
#include <seqpar/plan/pipeline_step.hpp>
#include <seqpar/plan/step.hpp>
#include <seqpar/plan/workloads.hpp>
#include <seqpar/replay/hardware.hpp>
#include <seqpar/replay/model_shape.hpp>
#include <seqpar/replay/predict.hpp>
#include <seqpar/replay/profile_json.hpp>
#include <seqpar/schedule/dynamic_chunk.hpp>
#include <seqpar/schedule/pipeline.hpp>
#include <seqpar/version.hpp>

#if defined(SEQPAR_ENABLE_GLPK)
#include <seqpar/schedule/checkpoint_milp.hpp>
#endif

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "support/json.hpp"

namespace {

using namespace seqpar;

constexpr const char* kTool = "seqpar-plan";
constexpr int kMaxRanks = 1 << 16;  // the replay keeps per-rank state; beyond this it is a typo

/// A bad command line. main() prints it on one line, with a pointer to --help, and exits with 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

[[noreturn]] void usage_error(const std::string& what) {
  throw UsageError(what);
}

std::string one_line(std::string s) {
  std::replace_if(
      s.begin(), s.end(), [](char c) { return c == '\n' || c == '\r'; }, ' ');
  return s;
}

std::string join(const std::vector<std::string>& items, const char* sep = ", ") {
  std::string out;
  for (const std::string& s : items) out += (out.empty() ? "" : sep) + s;
  return out;
}

std::vector<std::string> split(std::string_view text, char sep) {
  std::vector<std::string> out;
  for (std::size_t begin = 0;;) {
    const std::size_t end = text.find(sep, begin);
    out.emplace_back(text.substr(begin, end == std::string_view::npos ? std::string_view::npos : end - begin));
    if (end == std::string_view::npos) return out;
    begin = end + 1;
  }
}

std::string_view trim(std::string_view s) {
  const auto blank = [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; };
  while (!s.empty() && blank(s.front())) s.remove_prefix(1);
  while (!s.empty() && blank(s.back())) s.remove_suffix(1);
  return s;
}

/// `text`, all of it, as an integer in [lo, hi]; otherwise a usage error that starts with `what`.
template <class Int>
Int parse_integer(const std::string& what, std::string_view text, Int lo, Int hi) {
  Int v{};
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec == std::errc::invalid_argument || end != text.data() + text.size())
    usage_error(what + ": '" + std::string(text) + "' is not " +
                (std::is_signed_v<Int> ? "an integer" : "a non-negative integer"));
  if (ec == std::errc::result_out_of_range || v < lo || v > hi)
    usage_error(what + ": " + std::string(text) + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                "]");
  return v;
}

/// `text`, all of it, as a finite number >= lo; otherwise a usage error that starts with `what`.
double parse_number(const std::string& what, std::string_view text, double lo) {
  double v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size() || !std::isfinite(v))
    usage_error(what + ": '" + std::string(text) + "' is not a number");
  if (v < lo) usage_error(what + ": " + std::string(text) + " must be >= " + std::to_string(lo));
  return v;
}

std::int64_t parse_length(const std::string& what, std::string_view text) {
  return parse_integer<std::int64_t>(what, text, 1, DocumentBatch::kMaxTokens);
}

// ---- the command line --------------------------------------------------------------------------------

struct Options {
  std::optional<std::string> profile, profile_file;
  std::optional<int> ranks, ranks_per_node;
  std::optional<std::string> model;
  bool attention_only = false;
  std::optional<int> heads_q, heads_kv, head_dim;
  std::optional<std::string> lengths, lengths_file, distribution;
  std::optional<std::int64_t> tokens;
  std::optional<std::uint64_t> seed;
  std::optional<int> sequences;
  std::optional<std::int64_t> sequence_tokens;
  std::optional<std::string> strategies;
  std::optional<int> zero, micro_batches;
  bool no_checkpointing = false, no_zero_prefetch = false;
  std::optional<std::string> trace, json;
  std::optional<int> trace_ranks;
  std::optional<int> pipeline_stages, chunk_slices;
  std::optional<std::int64_t> chunk_tokens;
  std::optional<std::string> checkpoint_solver;
  std::optional<double> milp_seconds;
  bool quiet = false, list = false, help = false, version = false;
};

/// One option: its spelling, the placeholder of its value (empty for a flag), its --help text, and what
/// it does to Options. --help is printed from this table, so it cannot miss an option.
struct OptionSpec {
  const char* group;
  const char* name;
  const char* metavar;
  const char* help;
  std::function<void(Options&, const std::string& name, const std::string& value)> apply;
};

int as_int(const std::string& name, const std::string& v, int lo, int hi = std::numeric_limits<int>::max()) {
  return parse_integer<int>(name, v, lo, hi);
}

const std::vector<OptionSpec>& option_table() {
  using S = std::string;
  static const std::vector<OptionSpec> table = {
      {"Hardware and topology", "--profile", "NAME",
       "named hardware profile (see the list below); sets the per-rank memory, the links and the default "
       "--ranks-per-node",
       [](Options& o, const S&, const S& v) { o.profile = v; }},
      {"Hardware and topology", "--profile-file", "FILE",
       "hardware profile as JSON (replay::load_profile: the flat object bench/calibrate writes)",
       [](Options& o, const S&, const S& v) { o.profile_file = v; }},
      {"Hardware and topology", "--ranks", "N", "number of ranks (GPUs) the batch is split over, 1..65536 (required)",
       [](Options& o, const S& n, const S& v) { o.ranks = as_int(n, v, 1, kMaxRanks); }},
      {"Hardware and topology", "--ranks-per-node", "N",
       "ranks sharing a node's fast links (default: the profile's); the last node may be partly filled",
       [](Options& o, const S& n, const S& v) { o.ranks_per_node = as_int(n, v, 1, kMaxRanks); }},

      {"Model", "--model", "NAME",
       "model whose training step is simulated (see the list below): layers, GEMMs, ZeRO-3, memory",
       [](Options& o, const S&, const S& v) { o.model = v; }},
      {"Model", "--attention-only", "",
       "predict one attention layer's forward + backward instead of a training step; the shape comes from "
       "--model or from --heads-q/--heads-kv/--head-dim",
       [](Options& o, const S&, const S&) { o.attention_only = true; }},
      {"Model", "--heads-q", "H", "query heads (with --attention-only and no --model)",
       [](Options& o, const S& n, const S& v) { o.heads_q = as_int(n, v, 1); }},
      {"Model", "--heads-kv", "H", "key/value heads, dividing --heads-q (with --attention-only and no --model)",
       [](Options& o, const S& n, const S& v) { o.heads_kv = as_int(n, v, 1); }},
      {"Model", "--head-dim", "D", "head dimension, 1..1024 (with --attention-only and no --model)",
       [](Options& o, const S& n, const S& v) { o.head_dim = as_int(n, v, 1, 1024); }},

      {"Documents (exactly one of --lengths, --lengths-file, --distribution)", "--lengths", "L,L,...",
       "document lengths in tokens, comma-separated positive integers",
       [](Options& o, const S&, const S& v) { o.lengths = v; }},
      {"Documents (exactly one of --lengths, --lengths-file, --distribution)", "--lengths-file", "FILE",
       "document lengths, one per line; '#' starts a comment, blank lines are skipped; '-' reads stdin",
       [](Options& o, const S&, const S& v) { o.lengths_file = v; }},
      {"Documents (exactly one of --lengths, --lengths-file, --distribution)", "--distribution", "NAME",
       "draw the lengths from a named distribution (see the list below) until --tokens are reached",
       [](Options& o, const S&, const S& v) { o.distribution = v; }},
      {"Documents (exactly one of --lengths, --lengths-file, --distribution)", "--tokens", "T",
       "total tokens drawn with --distribution (required with it)",
       [](Options& o, const S& n, const S& v) { o.tokens = parse_length(n, v); }},
      {"Documents (exactly one of --lengths, --lengths-file, --distribution)", "--seed", "S",
       "seed of --distribution (default 0; the same seed gives the same lengths)",
       [](Options& o, const S& n, const S& v) {
         o.seed = parse_integer<std::uint64_t>(n, v, 0, std::numeric_limits<std::uint64_t>::max());
       }},
      {"Documents (exactly one of --lengths, --lengths-file, --distribution)", "--sequence-tokens", "S",
       "pack the documents, in order, into sequences of S tokens (the last may be shorter); a document "
       "crossing a boundary is cut in two, as a packing data loader cuts it (default: one sequence)",
       [](Options& o, const S& n, const S& v) { o.sequence_tokens = parse_length(n, v); }},
      {"Documents (exactly one of --lengths, --lengths-file, --distribution)", "--sequences", "B",
       "pack into B sequences: --sequence-tokens ceil(total / B)",
       [](Options& o, const S& n, const S& v) { o.sequences = as_int(n, v, 1, 1 << 20); }},

      {"Strategies and training step", "--strategies", "A,B,...",
       "candidates to compare, comma-separated names (default: all of the list below)",
       [](Options& o, const S&, const S& v) { o.strategies = v; }},
      {"Strategies and training step", "--zero", "N",
       "ZeRO-3 over groups of N consecutive ranks; 0 = all ranks (default), 1 = no sharding",
       [](Options& o, const S& n, const S& v) { o.zero = as_int(n, v, 0, kMaxRanks); }},
      {"Strategies and training step", "--no-checkpointing", "",
       "keep every layer's activations (default: full recompute of each layer in backward)",
       [](Options& o, const S&, const S&) { o.no_checkpointing = true; }},
      {"Strategies and training step", "--no-zero-prefetch", "",
       "do not overlap the next layer's parameter all-gather with this layer's compute",
       [](Options& o, const S&, const S&) { o.no_zero_prefetch = true; }},
      {"Strategies and training step", "--micro-batches", "N",
       "gradient-accumulation steps, each a forward + backward of the whole batch (default 1)",
       [](Options& o, const S& n, const S& v) { o.micro_batches = as_int(n, v, 1, 1 << 16); }},

      {"Pipeline (DPP)", "--pipeline-stages", "N",
       "plan DPP's pipeline instead of comparing strategies: N stages of --ranks / N ranks each (Ulysses and "
       "ZeRO-3 inside a stage; N must divide --ranks and the model's layers); prints DynamicChunk's chunk "
       "plan, the 1F1B pipelines of DPP's grouping, each stage's order and the checkpointing decisions",
       [](Options& o, const S& n, const S& v) { o.pipeline_stages = as_int(n, v, 1, kMaxRanks); }},
      {"Pipeline (DPP)", "--chunk-tokens", "T",
       "DynamicChunk's token capacity per chunk (default: the largest multiple of 1024, at least 1024, for "
       "which stage 0's 1F1B window of N chunks fits with every layer checkpointed and the batch makes at "
       "least 4 N chunks)",
       [](Options& o, const S& n, const S& v) { o.chunk_tokens = parse_length(n, v); }},
      {"Pipeline (DPP)", "--chunk-slices", "K",
       "slices of the longest document (default 0: the fewest whose first slice fits --chunk-tokens)",
       [](Options& o, const S& n, const S& v) { o.chunk_slices = as_int(n, v, 0, 1 << 16); }},
      {"Pipeline (DPP)", "--checkpoint-solver", "NAME",
       "auto (default: glpk when seqpar-plan is built with seqpar::glpk, else greedy), greedy, or glpk: the "
       "grouping runs the greedy, then glpk solves each chosen pipeline's checkpointing again (DPP's 2% gap, "
       "the greedy as first incumbent)",
       [](Options& o, const S&, const S& v) { o.checkpoint_solver = v; }},
      {"Pipeline (DPP)", "--milp-seconds", "S", "GLPK's time limit per pipeline, seconds (default 10)",
       [](Options& o, const S& n, const S& v) { o.milp_seconds = parse_number(n, v, 0.001); }},

      {"Output", "--trace", "FILE",
       "write the picked strategy's simulated timeline as Chrome/Perfetto trace JSON (ui.perfetto.dev): "
       "in a training step every layer's GEMMs and ZeRO-3 collectives, and the attention programs of one "
       "layer's forward and backward",
       [](Options& o, const S&, const S& v) { o.trace = v; }},
      {"Output", "--trace-ranks", "N", "ranks kept in the trace: 0..N-1 (default 64)",
       [](Options& o, const S& n, const S& v) { o.trace_ranks = as_int(n, v, 1, kMaxRanks); }},
      {"Output", "--json", "FILE", "write the inputs and every candidate's figures as JSON",
       [](Options& o, const S&, const S& v) { o.json = v; }},
      {"Output", "--quiet", "", "print only the picked strategy's name (nothing when none is picked) and no progress",
       [](Options& o, const S&, const S&) { o.quiet = true; }},
      {"Output", "--list", "", "list the profiles, models, distributions and strategies, then exit",
       [](Options& o, const S&, const S&) { o.list = true; }},
      {"Output", "--version", "", "print the version and exit",
       [](Options& o, const S&, const S&) { o.version = true; }},
      {"Output", "--help", "", "this help (also -h)", [](Options& o, const S&, const S&) { o.help = true; }},
  };
  return table;
}

Options parse_command_line(int argc, char** argv) {
  Options o;
  std::set<std::string> seen;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::optional<std::string> attached;  // --name=value
    if (arg == "-h") {
      arg = "--help";
    } else if (arg.starts_with("--")) {
      if (const auto eq = arg.find('='); eq != std::string::npos) {
        attached = arg.substr(eq + 1);
        arg.resize(eq);
      }
    } else if (arg.starts_with("-")) {
      usage_error("unknown option '" + arg + "'");
    } else {
      usage_error("unexpected argument '" + arg + "'");
    }
    const auto& table = option_table();
    const auto spec = std::find_if(table.begin(), table.end(), [&](const OptionSpec& s) { return arg == s.name; });
    if (spec == table.end()) usage_error("unknown option '" + arg + "'");
    if (!seen.insert(arg).second) usage_error(arg + " is given twice");
    std::string value;
    if (*spec->metavar != '\0') {
      if (attached) {
        value = *attached;
      } else if (i + 1 < argc && !std::string_view(argv[i + 1]).starts_with("--")) {
        value = argv[++i];
      } else {
        usage_error(arg + " needs a value (" + spec->metavar + ")");
      }
      if (value.empty()) usage_error(arg + ": the value is empty");
    } else if (attached) {
      usage_error(arg + " takes no value");
    }
    spec->apply(o, arg, value);
  }
  return o;
}

constexpr std::size_t kHelpIndent = 26, kHelpWidth = 100;

/// `left` padded to `indent` columns, then `text` wrapped at kHelpWidth with continuation lines indented.
std::string wrap(std::string left, const std::string& text, std::size_t indent) {
  left.resize(std::max(left.size(), indent), ' ');
  std::string out, line = left;
  for (const std::string& word : split(text, ' ')) {
    if (line.size() > indent && line.size() + 1 + word.size() > kHelpWidth) {
      out += line + "\n";
      line = std::string(indent, ' ');
    }
    line += (line.size() > indent ? " " : "") + word;
  }
  return out + line + "\n";
}

void print_help(std::FILE* out) {
  std::fprintf(out,
               "usage: %s (--profile NAME | --profile-file FILE) --ranks N\n"
               "                   (--model NAME | --attention-only (--model NAME | --heads-q H --heads-kv H "
               "--head-dim D))\n"
               "                   (--lengths L,L,... | --lengths-file FILE | --distribution NAME --tokens T) "
               "[options]\n\n"
               "Predicts with seqpar's cost model what each sequence-parallel strategy costs on a machine, for a\n"
               "model and a batch of packed documents. Every candidate's per-rank programs are compiled and\n"
               "replayed on the hardware profile: a whole training step (forward, recompute, backward and\n"
               "optimizer of every layer, ZeRO-3 collectives), or with --attention-only one attention layer's\n"
               "forward + backward. The pick (*) is the fastest strategy that can run the batch and fits in the\n"
               "profile's memory per rank.\n",
               kTool);
  const char* group = "";
  for (const OptionSpec& s : option_table()) {
    if (std::string_view(group) != s.group) {
      group = s.group;
      std::fprintf(out, "\n%s:\n", group);
    }
    std::string left = std::string("  ") + s.name + (*s.metavar ? std::string(" ") + s.metavar : "");
    if (left.size() + 1 >= kHelpIndent) {
      std::fprintf(out, "%s\n", left.c_str());
      left.clear();
    }
    std::fprintf(out, "%s", wrap(left, s.help, kHelpIndent).c_str());
  }
  std::vector<std::string> models, strategies;
  for (const replay::ModelShape& m : replay::models::all()) models.push_back(m.name);
  for (const plan::Candidate& c : plan::standard_candidates()) strategies.push_back(c.name);
  std::fprintf(out, "\nNames (--list shows them with details):\n%s%s%s%s",
               wrap("  profiles", join(replay::profiles::names()), 17).c_str(),
               wrap("  models", join(models), 17).c_str(),
               wrap("  distributions", join(plan::workloads::distribution_names()), 17).c_str(),
               wrap("  strategies", join(strategies), 17).c_str());
  std::fprintf(out,
               "\nOutput: one row per strategy, the pick marked '*':\n"
               "  step ms        predicted training step (--attention-only: 'fwd+bwd ms', one attention layer)\n"
               "  tokens/s       tokens of the batch x micro-batches per second of step (training step only)\n"
               "  intra/inter    attention bytes a rank sends inside its node / to other nodes, MiB, max over\n"
               "                 ranks (in the whole step, or in the layer's forward + backward)\n"
               "  imbalance      max / mean over ranks of compute time (GEMMs and attention kernels)\n"
               "  peak GiB       peak memory of the most loaded rank, '!' when over the profile's memory\n"
               "                 (--attention-only: Q, K, V, O, dO, dQ, dK, dV, LSE of its tokens + staging)\n"
               "  exposed ms     max over ranks of the time a rank is blocked on communication (attention\n"
               "                 transfers, and in a training step ZeRO-3 collectives compute does not hide)\n"
               "Strategies that cannot run the batch are listed with the reason. On a terminal, stderr shows\n"
               "progress while the candidates are simulated.\n"
               "With --pipeline-stages: the chunk plan (kind, pieces, tokens, forward ms of one layer, prefix\n"
               "tokens carried), then per 1F1B pipeline its chunks, each stage's order (F/B and the chunk),\n"
               "the checkpointed layers per schedule diagonal and each stage's predicted peak memory.\n"
               "\nExit status: 0 a strategy (with --pipeline-stages: a pipeline plan) was picked; 1 none can run\n"
               "or fits in memory, or a file could not be written; 2 bad arguments (a one-line message on stderr).\n"
               "\nExamples:\n"
               "  %s --profile h100-sxm --ranks 16 --model llama-3.1-8b --distribution pile --tokens 262144 \\\n"
               "              --sequences 2 --seed 7 --json plan.json --trace pick.json\n"
               "  %s --profile a100-40gb --ranks 8 --attention-only --heads-q 32 --heads-kv 8 --head-dim 128 \\\n"
               "              --lengths 32768,16384,8192,8192,4096\n"
               "  %s --profile a100-40gb --ranks 8 --model llama-13b --pipeline-stages 4 --distribution longtail \\\n"
               "              --tokens 131072 --seed 1 --sequence-tokens 65536\n",
               kTool, kTool, kTool);
}

void print_list() {
  std::printf("profiles:\n");
  int width = 0;
  for (const std::string& name : replay::profiles::names()) width = std::max(width, static_cast<int>(name.size()));
  for (const std::string& name : replay::profiles::names()) {
    const replay::HardwareProfile p = replay::profiles::by_name(name);
    std::printf("  %-*s %4.0f TFLOP/s, %5.1f GiB, %d per node, intra %.0f GB/s, inter %.0f GB/s x %d NICs/node\n",
                width, p.name.c_str(), p.peak_flops / 1e12, p.memory_bytes / replay::profiles::kGiB, p.ranks_per_node,
                p.intra.bandwidth / 1e9, p.inter.bandwidth / 1e9, p.nics_per_node);
  }
  std::printf("models:\n");
  for (const replay::ModelShape& m : replay::models::all())
    std::printf("  %-14s %5.2fB params, %2d layers, hidden %5d, heads %2d:%2d x %3d, ffn %5d, vocab %d\n",
                m.name.c_str(), m.params() / 1e9, m.layers, m.hidden, m.heads_q, m.heads_kv, m.head_dim, m.ffn,
                m.vocab);
  std::printf("distributions:\n  %s\n", join(plan::workloads::distribution_names()).c_str());
  std::printf("strategies:\n");
  for (const plan::Candidate& c : plan::standard_candidates())
    std::printf("  %-26s %s\n", c.name.c_str(), c.description.c_str());
}

// ---- from options to a problem -----------------------------------------------------------------------

/// Everything a candidate is evaluated on, checked.
struct Problem {
  replay::HardwareProfile hardware;
  Topology topology;
  std::optional<replay::ModelShape> model;  ///< empty with --attention-only and explicit heads
  bool attention_only = false;
  AttentionShape shape;
  DocumentBatch batch;
  std::int64_t longest_document = 0;
  std::int64_t documents = 0;  ///< before packing (packing cuts documents that cross a sequence boundary)
  std::string lengths_source;
  plan::TrainingOptions training;
  std::vector<plan::Candidate> candidates;
};

std::vector<std::int64_t> lengths_from_list(const std::string& list) {
  std::vector<std::int64_t> out;
  const std::vector<std::string> items = split(list, ',');
  for (std::size_t i = 0; i < items.size(); ++i) {
    const std::string_view item = trim(items[i]);
    if (item.empty()) usage_error("--lengths: item " + std::to_string(i + 1) + " is empty");
    out.push_back(parse_length("--lengths: item " + std::to_string(i + 1), item));
  }
  return out;
}

std::vector<std::int64_t> lengths_from_stream(std::istream& in, const std::string& path) {
  std::vector<std::int64_t> out;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    std::string_view text(line);
    if (const auto hash = text.find('#'); hash != std::string_view::npos) text = text.substr(0, hash);
    text = trim(text);
    if (text.empty()) continue;
    out.push_back(parse_length("--lengths-file " + path + ":" + std::to_string(number), text));
  }
  if (in.bad()) usage_error("--lengths-file: cannot read '" + path + "'");
  if (out.empty()) usage_error("--lengths-file: '" + path + "' holds no lengths");
  return out;
}

std::vector<std::int64_t> lengths_from_file(const std::string& path) {
  if (path == "-") return lengths_from_stream(std::cin, "-");
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) usage_error("--lengths-file: '" + path + "' is a directory");
  std::ifstream in(path);
  if (!in) usage_error("--lengths-file: cannot open '" + path + "'");
  return lengths_from_stream(in, path);
}

/// Concatenates the documents and cuts the stream into sequences of `sequence_tokens` (a document crossing
/// a boundary is cut in two), as a packing data loader does.
std::vector<std::vector<std::int64_t>> pack(const std::vector<std::int64_t>& lengths, std::int64_t sequence_tokens) {
  std::vector<std::vector<std::int64_t>> sequences(1);
  std::int64_t room = sequence_tokens;
  for (std::int64_t left : lengths) {
    while (left > 0) {
      if (room == 0) {
        sequences.emplace_back();
        room = sequence_tokens;
      }
      const std::int64_t take = std::min(left, room);
      sequences.back().push_back(take);
      room -= take;
      left -= take;
    }
  }
  return sequences;
}

Problem make_problem(const Options& o) {
  Problem p;
  // Hardware and topology.
  if (o.profile && o.profile_file) usage_error("--profile and --profile-file exclude each other");
  if (!o.profile && !o.profile_file) usage_error("no hardware: give --profile NAME or --profile-file FILE");
  p.hardware = o.profile ? replay::profiles::by_name(*o.profile) : replay::load_profile(*o.profile_file);
  if (!o.ranks) usage_error("--ranks N is required");
  p.topology = {*o.ranks, o.ranks_per_node.value_or(p.hardware.ranks_per_node)};
  p.hardware.ranks_per_node = p.topology.ranks_per_node;
  p.topology.validate("seqpar-plan");
  p.hardware.validate("seqpar-plan: profile");

  // Model and attention shape.
  p.attention_only = o.attention_only;
  const bool heads = o.heads_q || o.heads_kv || o.head_dim;
  if (heads && !o.attention_only) usage_error("--heads-q/--heads-kv/--head-dim need --attention-only");
  if (heads && o.model) usage_error("--heads-q/--heads-kv/--head-dim exclude --model (the model fixes its heads)");
  if (o.model) {
    p.model = replay::models::by_name(*o.model);
    p.shape = p.model->attention();
  } else if (o.attention_only) {
    if (!o.heads_q || !o.heads_kv || !o.head_dim)
      usage_error("--attention-only without --model needs --heads-q, --heads-kv and --head-dim");
    p.shape = AttentionShape{*o.heads_q, *o.heads_kv, *o.head_dim, 0.0};
  } else {
    usage_error("no model: give --model NAME, or --attention-only with --heads-q/--heads-kv/--head-dim");
  }
  p.shape.validate("seqpar-plan");

  // Training options: only a training step has them.
  if (o.attention_only) {
    for (const auto& [given, name] :
         {std::pair{o.zero.has_value(), "--zero"}, std::pair{o.micro_batches.has_value(), "--micro-batches"},
          std::pair{o.no_checkpointing, "--no-checkpointing"}, std::pair{o.no_zero_prefetch, "--no-zero-prefetch"}})
      if (given) usage_error(std::string(name) + " applies to a training step, not to --attention-only");
  } else {
    p.training.model = *p.model;
    p.training.zero_ranks = o.zero.value_or(0);
    if (p.training.zero_ranks > p.topology.world_size)
      usage_error("--zero " + std::to_string(p.training.zero_ranks) + " is more than --ranks " +
                  std::to_string(p.topology.world_size));
    p.training.checkpointing = !o.no_checkpointing;
    p.training.zero_prefetch = !o.no_zero_prefetch;
    p.training.micro_batches = o.micro_batches.value_or(1);
  }

  // Documents.
  const int sources = static_cast<int>(o.lengths.has_value()) + static_cast<int>(o.lengths_file.has_value()) +
                      static_cast<int>(o.distribution.has_value());
  if (sources == 0) usage_error("no documents: give --lengths, --lengths-file or --distribution");
  if (sources > 1) usage_error("--lengths, --lengths-file and --distribution exclude each other");
  if (!o.distribution && (o.tokens || o.seed)) usage_error("--tokens and --seed go with --distribution");
  std::vector<std::int64_t> lengths;
  if (o.lengths) {
    lengths = lengths_from_list(*o.lengths);
    p.lengths_source = "--lengths";
  } else if (o.lengths_file) {
    lengths = lengths_from_file(*o.lengths_file);
    p.lengths_source = *o.lengths_file;
  } else {
    if (!o.tokens) usage_error("--distribution needs --tokens T");
    lengths = plan::workloads::sample_lengths(*o.distribution, *o.tokens, o.seed.value_or(0));
    p.lengths_source = *o.distribution + " (seed " + std::to_string(o.seed.value_or(0)) + ")";
  }
  std::int64_t total = 0;
  for (std::int64_t len : lengths) {
    if (len > DocumentBatch::kMaxTokens - total)
      usage_error("the documents hold more than " + std::to_string(DocumentBatch::kMaxTokens) + " tokens");
    total += len;
    p.longest_document = std::max(p.longest_document, len);
  }
  if (o.sequences && o.sequence_tokens) usage_error("--sequences and --sequence-tokens exclude each other");
  if (o.sequences && *o.sequences > total)
    usage_error("--sequences " + std::to_string(*o.sequences) + " is more than the " + std::to_string(total) +
                " tokens");
  const std::int64_t sequence_tokens = o.sequence_tokens ? *o.sequence_tokens
                                       : o.sequences     ? (total + *o.sequences - 1) / *o.sequences
                                                         : total;
  p.batch = DocumentBatch(pack(lengths, sequence_tokens));
  p.documents = static_cast<std::int64_t>(lengths.size());

  // Candidates.
  p.candidates = plan::standard_candidates(p.hardware);
  if (o.strategies) {
    std::vector<plan::Candidate> chosen;
    std::vector<std::string> known;
    for (const plan::Candidate& c : p.candidates) known.push_back(c.name);
    for (const std::string& item : split(*o.strategies, ',')) {
      const std::string name(trim(item));
      if (name.empty()) usage_error("--strategies: an empty name");
      const auto it = std::find_if(p.candidates.begin(), p.candidates.end(),
                                   [&](const plan::Candidate& c) { return c.name == name; });
      if (it == p.candidates.end()) usage_error("--strategies: '" + name + "' is not a strategy (" + join(known) + ")");
      if (std::any_of(chosen.begin(), chosen.end(), [&](const plan::Candidate& c) { return c.name == name; }))
        usage_error("--strategies: '" + name + "' is listed twice");
      chosen.push_back(*it);
    }
    p.candidates = std::move(chosen);
  }
  if (o.trace_ranks && !o.trace) usage_error("--trace-ranks goes with --trace");
  // An output path whose folder is missing is a typo: say so now, not after a long simulation.
  for (const auto& [path, option] : {std::pair{o.json, "--json"}, std::pair{o.trace, "--trace"}}) {
    if (!path) continue;
    const std::filesystem::path folder = std::filesystem::path(*path).parent_path();
    std::error_code ec;
    if (!folder.empty() && !std::filesystem::is_directory(folder, ec))
      usage_error(std::string(option) + ": '" + folder.string() + "' is not a folder");
  }
  return p;
}

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

/// Memory of one attention layer's forward + backward on a rank: Q, O, dO, dQ (Hq heads), K, V, dK, dV
/// (Hkv heads) and fp32 LSE of its tokens, plus the larger of its programs' staging buffers.
double attention_memory_bytes(const AttentionShape& shape, double value_bytes, std::int64_t tokens,
                              double staging_bytes) {
  const double per_token = 4.0 * value_bytes * shape.head_dim * (shape.heads_q + shape.heads_kv) + 4.0 * shape.heads_q;
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
  const replay::CompiledStrategy compiled = candidate.compile(p.batch, p.shape, p.topology);
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
double gib(double bytes) {
  return bytes / replay::profiles::kGiB;
}
std::string format_gib(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f GiB", gib(bytes));
  return text;
}

std::string describe_batch(const Problem& p) {
  const int b = p.batch.num_sequences();
  const auto cuts = static_cast<std::int64_t>(p.batch.documents().size()) - p.documents;
  std::string s = std::to_string(p.batch.total_tokens()) + " tokens in " + std::to_string(b) +
                  (b == 1 ? " sequence, " : " sequences, ") + std::to_string(p.documents) + " documents (longest " +
                  std::to_string(p.longest_document) + ") from " + p.lengths_source;
  if (cuts > 0) s += "; " + std::to_string(cuts) + (cuts == 1 ? " cut" : " cuts") + " at sequence boundaries";
  return s;
}

void print_table(const Problem& p, const std::vector<Row>& rows, std::optional<std::size_t> pick) {
  const Topology& t = p.topology;
  const std::string what = p.attention_only
                               ? "one attention layer (fwd+bwd), heads " + std::to_string(p.shape.heads_q) + ":" +
                                     std::to_string(p.shape.heads_kv) + " x " + std::to_string(p.shape.head_dim)
                               : "training step of " + p.model->name;
  std::printf("%s: %s on %d x %s (%d node%s of %d)\n", kTool, what.c_str(), t.world_size, p.hardware.name.c_str(),
              t.num_nodes(), t.num_nodes() == 1 ? "" : "s", t.ranks_per_node);
  std::printf("  batch: %s\n", describe_batch(p).c_str());
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
  else
    std::printf("* %s: the fastest of the strategies that run the batch and fit in %s per rank%s\n",
                rows[*pick].name.c_str(), format_gib(p.hardware.memory_bytes).c_str(), over ? " ('!': over it)" : "");
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
      .add("tokens", p.batch.total_tokens())
      .add("sequences", p.batch.num_sequences())
      .add("documents", p.documents)
      .add("documents_after_packing", static_cast<std::int64_t>(p.batch.documents().size()))
      .add("longest_document", p.longest_document)
      .add("lengths_source", p.lengths_source);
  if (!p.attention_only)
    plan.add("zero_ranks", p.training.zero_ranks == 0 ? p.topology.world_size : p.training.zero_ranks)
        .add("checkpointing", p.training.checkpointing)
        .add("zero_prefetch", p.training.zero_prefetch)
        .add("micro_batches", p.training.micro_batches);
  plan.add("pick", pick ? rows[*pick].name : std::string());
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

void write_file(const std::string& path, const std::string& text, const char* option) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw std::runtime_error(std::string(option) + ": cannot open '" + path + "' for writing");
  out << text;
  out.close();
  if (!out) throw std::runtime_error(std::string(option) + ": cannot write '" + path + "'");
}

// ---- --pipeline-stages: DPP's chunk plan, 1F1B pipelines and checkpointing ------------------------------

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

int run_pipeline(const Options& o, const Problem& p) {
  const int stages = *o.pipeline_stages;
  plan::PipelineStepOptions opt;
  opt.model = *p.model;
  opt.hardware = p.hardware;
  opt.stages = stages;
  opt.sp_ranks = p.topology.world_size / stages;
  opt.zero_ranks = o.zero.value_or(0);
  if (opt.zero_ranks > opt.sp_ranks)
    usage_error("--zero " + std::to_string(opt.zero_ranks) + " is more than the " + std::to_string(opt.sp_ranks) +
                " ranks of a stage");
  opt.validate("seqpar-plan --pipeline-stages");
  const schedule::PipelineModel pm = plan::pipeline_model(opt);
  schedule::DynamicChunk chunker;
  chunker.args.cost = plan::chunk_cost(opt);
  chunker.args.token_capacity = o.chunk_tokens.value_or(default_chunk_tokens(pm, p.batch.total_tokens()));
  chunker.args.slices = o.chunk_slices.value_or(0);
  const schedule::ChunkPlan plan = chunker.plan(p.batch);

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
  std::printf("\n* %zu pipeline%s, %zu chunk%s, %lld layer%s recomputed; DPP's predicted time %.3f ms\n",
              sched.pipelines.size(), sched.pipelines.size() == 1 ? "" : "s", plan.chunks.size(),
              plan.chunks.size() == 1 ? "" : "s", recomputed, recomputed == 1 ? "" : "s", sched.seconds * 1e3);
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

int run(int argc, char** argv) {
  const Options o = parse_command_line(argc, argv);
  if (o.help) {
    print_help(stdout);
    return 0;
  }
  if (o.version) {
    std::printf("%s %d.%d.%d\n", kTool, SEQPAR_VERSION_MAJOR, SEQPAR_VERSION_MINOR, SEQPAR_VERSION_PATCH);
    return 0;
  }
  if (o.list) {
    print_list();
    return 0;
  }
  check_pipeline_options(o);
  const Problem p = make_problem(o);
  if (o.pipeline_stages) return run_pipeline(o, p);
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

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "%s: error: %s (see --help)\n", kTool, one_line(e.what()).c_str());
    return 2;
  } catch (const std::invalid_argument& e) {  // the library's validation of what the options gave it
    std::fprintf(stderr, "%s: error: %s (see --help)\n", kTool, one_line(e.what()).c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", kTool, one_line(e.what()).c_str());
    return 1;
  }
}
