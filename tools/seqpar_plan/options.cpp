// SPDX-License-Identifier: Apache-2.0
// seqpar-plan's command line: the option table (the single source of --help), parsing, --help and --list.
#include "options.hpp"

#include <seqpar/plan/candidates.hpp>
#include <seqpar/plan/model_shape.hpp>
#include <seqpar/plan/workloads.hpp>
#include <seqpar/replay/hardware.hpp>
#include <seqpar/schedule/pipeline.hpp>
#include <seqpar/seqpar.hpp>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <functional>
#include <limits>
#include <set>
#include <type_traits>

namespace seqpar::tools {

std::string one_line(std::string s) {
  std::replace_if(
      s.begin(), s.end(), [](char c) { return c == '\n' || c == '\r'; }, ' ');
  return s;
}

std::string join(const std::vector<std::string>& items, const char* sep) {
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

namespace {

constexpr int kMaxRanks = 1 << 16;  // the replay keeps per-rank state; beyond this it is a typo

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

}  // namespace

std::int64_t parse_length(const std::string& what, std::string_view text) {
  return parse_integer<std::int64_t>(what, text, 1, DocumentBatch::kMaxTokens);
}

namespace {

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
       "--model or from --heads-q/--heads-kv/--head-dim[/--head-dim-v]",
       [](Options& o, const S&, const S&) { o.attention_only = true; }},
      {"Model", "--heads-q", "H", "query heads (with --attention-only and no --model)",
       [](Options& o, const S& n, const S& v) { o.heads_q = as_int(n, v, 1); }},
      {"Model", "--heads-kv", "H", "key/value heads, dividing --heads-q (with --attention-only and no --model)",
       [](Options& o, const S& n, const S& v) { o.heads_kv = as_int(n, v, 1); }},
      {"Model", "--head-dim", "D", "head dimension, 1..1024 (with --attention-only and no --model)",
       [](Options& o, const S& n, const S& v) { o.head_dim = as_int(n, v, 1, 1024); }},
      {"Model", "--head-dim-v", "D",
       "value (and attention output) head dimension, 1..1024, when it differs from --head-dim (MLA: 192 and "
       "128; default: --head-dim; with --attention-only and no --model)",
       [](Options& o, const S& n, const S& v) { o.head_dim_v = as_int(n, v, 1, 1024); }},
      {"Model", "--dtype", "T",
       "element type of Q/K/V/O and activations: bf16, fp16 (2 bytes) or fp32 (4 bytes); sets the bytes moved "
       "and kept (default: the profile's, bf16 on the GPU profiles); compute rates stay the profile's",
       [](Options& o, const S&, const S& v) { o.dtype = v; }},

      {"Documents (exactly one of --lengths, --lengths-file, --distribution)", "--lengths", "L,L,...",
       "document lengths in tokens, comma-separated positive integers",
       [](Options& o, const S&, const S& v) { o.lengths = v; }},
      {"Documents (exactly one of --lengths, --lengths-file, --distribution)", "--lengths-file", "FILE",
       "document lengths, one per line; '#' starts a comment, blank lines are skipped; a line '---' ends a "
       "sequence (explicit sequence boundaries: no --sequence-tokens/--sequences then); '-' reads stdin",
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
      {"Documents (exactly one of --lengths, --lengths-file, --distribution)", "--window", "W",
       "sliding-window attention: each query sees its W most recent keys of its document (0: none, the "
       "default); plans, costs and bytes are those of the windowed layer",
       [](Options& o, const S& n, const S& v) {
         o.window = parse_integer<std::int64_t>(n, v, 0, DocumentBatch::kMaxTokens);
       }},

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
       [](Options& o, const S& n, const S& v) {
         o.chunk_slices = as_int(n, v, 0, schedule::DynamicChunk::kMaxSlices);
       }},
      {"Pipeline (DPP)", "--checkpoint-solver", "NAME",
       "auto (default: glpk when seqpar-plan is built with seqpar::glpk, else greedy), greedy, or glpk: the "
       "grouping runs the greedy, then glpk solves each chosen pipeline's checkpointing again (DPP's 2% gap, "
       "the greedy as first incumbent)",
       [](Options& o, const S&, const S& v) { o.checkpoint_solver = v; }},
      {"Pipeline (DPP)", "--milp-seconds", "S", "GLPK's time limit per pipeline, seconds (default 10)",
       [](Options& o, const S& n, const S& v) {
         o.milp_seconds = parse_number(n, v, 0.001);
         // GLPK's limit is an int of milliseconds: beyond it GLPK would abort the whole process.
         if (*o.milp_seconds > schedule::kMaxMilpSeconds)
           usage_error(n + ": " + v +
                       " must be <= " + std::to_string(static_cast<long long>(schedule::kMaxMilpSeconds)) +
                       " seconds (GLPK's limit in milliseconds is an int)");
       }},

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

}  // namespace

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

namespace {

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

}  // namespace

void print_help(std::FILE* out) {
  std::fprintf(out,
               "usage: %s (--profile NAME | --profile-file FILE) --ranks N\n"
               "                   (--model NAME | --attention-only (--model NAME | --heads-q H --heads-kv H "
               "--head-dim D [--head-dim-v D]))\n"
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
  for (const plan::ModelShape& m : plan::models::all()) models.push_back(m.name);
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
  for (const plan::ModelShape& m : plan::models::all()) {
    // "x 128", or "x 192/128" when the value heads are smaller (MLA).
    const AttentionShape a = m.attention();
    const std::string dims = std::to_string(a.qk_dim()) + (a.split_dims() ? "/" + std::to_string(a.v_dim()) : "");
    std::printf("  %-17s %5.2fB params, %2d layers, hidden %5d, heads %2d:%2d x %-7s ffn %5d, vocab %d\n",
                m.name.c_str(), m.params() / 1e9, m.layers, m.hidden, m.heads_q, m.heads_kv, (dims + ",").c_str(),
                m.ffn, m.vocab);
  }
  std::printf("distributions:\n  %s\n", join(plan::workloads::distribution_names()).c_str());
  std::printf("strategies:\n");
  for (const plan::Candidate& c : plan::standard_candidates())
    std::printf("  %-26s %s\n", c.name.c_str(), c.description.c_str());
}

}  // namespace seqpar::tools
