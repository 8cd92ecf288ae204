// SPDX-License-Identifier: Apache-2.0
// seqpar-plan's command line: the options, their parsing and checks (UsageError), --help and --list.
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace seqpar::tools {

inline constexpr const char* kTool = "seqpar-plan";

/// A bad command line. main() prints it on one line, with a pointer to --help, and exits with 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

[[noreturn]] inline void usage_error(const std::string& what) {
  throw UsageError(what);
}

/// `s` with its line breaks made spaces (errors are printed on one line).
std::string one_line(std::string s);
std::string join(const std::vector<std::string>& items, const char* sep = ", ");
std::vector<std::string> split(std::string_view text, char sep);
std::string_view trim(std::string_view s);
/// `text`, all of it, as a document length in [1, DocumentBatch::kMaxTokens]; otherwise a usage error that
/// starts with `what`.
std::int64_t parse_length(const std::string& what, std::string_view text);

/// What the command line gave (an empty optional: the option was not given).
struct Options {
  std::optional<std::string> profile, profile_file;
  std::optional<int> ranks, ranks_per_node;
  std::optional<std::string> model;
  bool attention_only = false;
  std::optional<int> heads_q, heads_kv, head_dim, head_dim_v;
  std::optional<std::string> dtype;
  std::optional<std::string> lengths, lengths_file, distribution;
  std::optional<std::int64_t> tokens;
  std::optional<std::uint64_t> seed;
  std::optional<int> sequences;
  std::optional<std::int64_t> sequence_tokens;
  std::optional<std::int64_t> window;
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

/// The options of the command line, each checked alone (the checks across options come later:
/// make_problem, check_pipeline_options). Throws UsageError.
Options parse_command_line(int argc, char** argv);
/// --help, printed from the option table (so that it cannot miss an option).
void print_help(std::FILE* out);
/// --list: the profiles, models, distributions and strategies.
void print_list();

}  // namespace seqpar::tools
