// SPDX-License-Identifier: Apache-2.0
// seqpar-plan: make_problem (the options checked together, the documents read or drawn and packed).
#include "problem.hpp"

#include <seqpar/plan/workloads.hpp>
#include <seqpar/replay/profile_json.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <string_view>
#include <system_error>
#include <utility>

namespace seqpar::tools {
namespace {

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

/// The lengths of a --lengths-file, one sequence per '---'-separated block (one block without separators).
std::vector<std::vector<std::int64_t>> lengths_from_stream(std::istream& in, const std::string& path) {
  std::vector<std::vector<std::int64_t>> out(1);
  std::string line;
  int last_separator = 0;
  for (int number = 1; std::getline(in, line); ++number) {
    std::string_view text(line);
    if (const auto hash = text.find('#'); hash != std::string_view::npos) text = text.substr(0, hash);
    text = trim(text);
    if (text.empty()) continue;
    if (text == "---") {
      if (out.back().empty())
        usage_error("--lengths-file " + path + ":" + std::to_string(number) +
                    ": '---' ends an empty sequence (a sequence needs at least one document)");
      out.emplace_back();
      last_separator = number;
      continue;
    }
    out.back().push_back(parse_length("--lengths-file " + path + ":" + std::to_string(number), text));
  }
  if (in.bad()) usage_error("--lengths-file: cannot read '" + path + "'");
  if (out.size() == 1 && out.front().empty()) usage_error("--lengths-file: '" + path + "' holds no lengths");
  if (out.back().empty())
    usage_error("--lengths-file " + path + ":" + std::to_string(last_separator) +
                ": '---' ends the last sequence with no document after it");
  return out;
}

std::vector<std::vector<std::int64_t>> lengths_from_file(const std::string& path) {
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

}  // namespace

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
  const bool heads = o.heads_q || o.heads_kv || o.head_dim || o.head_dim_v;
  if (heads && !o.attention_only) usage_error("--heads-q/--heads-kv/--head-dim/--head-dim-v need --attention-only");
  if (heads && o.model)
    usage_error("--heads-q/--heads-kv/--head-dim/--head-dim-v exclude --model (the model fixes its heads)");
  if (o.model) {
    p.model = plan::models::by_name(*o.model);
    p.shape = p.model->attention();
  } else if (o.attention_only) {
    if (!o.heads_q || !o.heads_kv || !o.head_dim)
      usage_error("--attention-only without --model needs --heads-q, --heads-kv and --head-dim");
    p.shape = AttentionShape{*o.heads_q, *o.heads_kv, *o.head_dim, 0.0, o.head_dim_v.value_or(0)};
  } else {
    usage_error("no model: give --model NAME, or --attention-only with --heads-q/--heads-kv/--head-dim");
  }
  p.shape.validate("seqpar-plan");

  // Element type: what every byte count and memory figure is counted in.
  if (o.dtype) {
    if (*o.dtype == "bf16" || *o.dtype == "fp16")
      p.hardware.value_bytes = 2;
    else if (*o.dtype == "fp32")
      p.hardware.value_bytes = 4;
    else
      usage_error("--dtype: '" + *o.dtype + "' is not an element type (bf16, fp16, fp32)");
    p.dtype = *o.dtype;
  } else {
    p.dtype = p.hardware.value_bytes == 2 ? "bf16" : p.hardware.value_bytes == 4 ? "fp32" : "fp64";
  }

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
  std::vector<std::vector<std::int64_t>> explicit_sequences;  // --lengths-file with '---' lines
  if (o.lengths) {
    lengths = lengths_from_list(*o.lengths);
    p.lengths_source = "--lengths";
  } else if (o.lengths_file) {
    explicit_sequences = lengths_from_file(*o.lengths_file);
    for (const auto& seq : explicit_sequences) lengths.insert(lengths.end(), seq.begin(), seq.end());
    if (explicit_sequences.size() == 1) explicit_sequences.clear();  // no '---': packed as the options say
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
  if (!explicit_sequences.empty() && (o.sequences || o.sequence_tokens))
    usage_error(std::string(o.sequences ? "--sequences" : "--sequence-tokens") +
                " packs the documents itself, but --lengths-file gives the sequences ('---' lines)");
  if (o.sequences && *o.sequences > total)
    usage_error("--sequences " + std::to_string(*o.sequences) + " is more than the " + std::to_string(total) +
                " tokens");
  const std::int64_t sequence_tokens = o.sequence_tokens ? *o.sequence_tokens
                                       : o.sequences     ? (total + *o.sequences - 1) / *o.sequences
                                                         : total;
  p.batch =
      explicit_sequences.empty() ? DocumentBatch(pack(lengths, sequence_tokens)) : DocumentBatch(explicit_sequences);
  p.documents = static_cast<std::int64_t>(lengths.size());
  // The layers' mask: placements are balanced for it, and with --pipeline-stages each layer's carry is
  // cut to it (the chunks themselves are the batch's).
  if (o.window && *o.window > 0) {
    p.mask = AttentionMask{*o.window};
    p.masks = MaskMix::only(p.mask);
  }

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

double gib(double bytes) {
  return bytes / replay::profiles::kGiB;
}
std::string format_gib(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f GiB", gib(bytes));
  return text;
}

std::string describe_elements(const Problem& p) {
  return "elements: " + p.dtype + ", " + std::to_string(p.hardware.value_bytes) +
         " bytes (--dtype): the bytes moved and the memory below are counted in them";
}

std::string describe_batch(const Problem& p) {
  const int b = p.batch.num_sequences();
  const auto cuts = static_cast<std::int64_t>(p.batch.documents().size()) - p.documents;
  std::string s = std::to_string(p.batch.total_tokens()) + " tokens in " + std::to_string(b) +
                  (b == 1 ? " sequence, " : " sequences, ") + std::to_string(p.documents) + " documents (longest " +
                  std::to_string(p.longest_document) + ") from " + p.lengths_source;
  if (cuts > 0) s += "; " + std::to_string(cuts) + (cuts == 1 ? " cut" : " cuts") + " at sequence boundaries";
  if (p.mask.window > 0) s += "; sliding window " + std::to_string(p.mask.window);
  return s;
}

void write_file(const std::string& path, const std::string& text, const char* option) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw std::runtime_error(std::string(option) + ": cannot open '" + path + "' for writing");
  out << text;
  out.close();
  if (!out) throw std::runtime_error(std::string(option) + ": cannot write '" + path + "'");
}

}  // namespace seqpar::tools
