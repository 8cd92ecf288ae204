// SPDX-License-Identifier: Apache-2.0
// replay (bench/replay/): what the per-paper replays share. Each paper's file (basp.cpp, hsap.cpp,
// flashcp.cpp, dpp.cpp) runs its workloads, prints its table and appends one Record per comparison to
// Results; summary.cpp judges the records against the papers (Verdict) and prints the summary;
// output.cpp writes them as JSON, markdown and SVG charts; main.cpp reads the command line.
#pragma once

#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

namespace seqpar::bench::papers {

inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

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

/// What the replays found, in the order they ran.
struct Results {
  std::vector<Record> records;
  std::vector<LayoutRow> layouts;  ///< BASP's node-layout table
};

inline std::string fmt(const char* f, double v) {
  if (std::isnan(v)) return "-";
  if (std::isinf(v)) return "inf";
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

inline double ratio(double a, double b) {
  return b > 0 ? a / b : (a > 0 ? std::numeric_limits<double>::infinity() : kNaN);
}

/// Whether `x` lies within `factor` of `paper` either way.
inline bool within(double x, double paper, double factor) {
  return x / paper <= factor && paper / x <= factor;
}

// ---- the papers (one file each): print the paper's table, append its records to `out` ----------------
// `smoke`: a tiny subset of the workloads (CTest's bench_smoke case).

void run_basp(bool smoke, Results& out);                       // basp.cpp
void run_hsap(bool smoke, Results& out);                       // hsap.cpp
void run_flashcp(bool smoke, Results& out);                    // flashcp.cpp
void run_dpp(bool smoke, Results& out, bool explain = false);  // dpp.cpp; explain: memory terms

// ---- summary.cpp: direction and size against the papers ----------------------------------------------

/// The factors we claim; kClaimText says why.
inline constexpr double kClaimedFactor = 2.0;
inline constexpr double kA2AFactor = 2.0;
inline constexpr double kFlashCpFloor = 0.95;  ///< FlashCP never below this fraction of the best baseline (issue 16)

struct Verdict {
  std::string paper, workload, comparison;
  double seqpar = kNaN, paper_value = kNaN;
  bool bound = false;
  bool direction_ok = false, size_ok = false;
  bool claimed = true;  ///< counted in the claim (false: reported only)
  double factor = kClaimedFactor;
  bool floor = false;  ///< a lower bound (paper_value is the floor), not a ratio to the paper
};

/// The claim and its reasons, printed above the verdicts.
extern const char* const kClaimText;

std::vector<Verdict> verdicts(const Results& results);
std::string verdict_text(const Verdict& v);
/// BASP by node layout (empty when BASP did not run).
std::string layout_summary(const Results& results);
/// The verdicts, BASP's layouts and the best composition per workload, on stdout.
void print_summary(const Results& results, const std::vector<Verdict>& vs);

// ---- output.cpp: the files --------------------------------------------------------------------------

/// --json: one record per Record, then one per LayoutRow.
bool write_json(const std::string& path, const Results& results, bool smoke);
/// --markdown: the verdicts and every paper's records as tables.
bool write_markdown(const std::string& path, const Results& results, const std::vector<Verdict>& vs);
/// --svg-dir: one grouped bar chart per paper (BASP: two).
bool write_svgs(const std::string& dir, const Results& results);

}  // namespace seqpar::bench::papers
