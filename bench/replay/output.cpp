// SPDX-License-Identifier: Apache-2.0
// replay: the output files (--json, --markdown, --svg-dir).
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "replay.hpp"
#include "support/json.hpp"

namespace seqpar::bench::papers {
namespace {

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

}  // namespace

bool write_json(const std::string& path, const Results& results, bool smoke) {
  std::vector<bench::JsonRecord> records;
  for (const Record& r : results.records) {
    bench::JsonRecord j;
    j.add("paper", r.paper).add("workload", r.workload).add("strategy", r.strategy).add("type", r.type);
    j.add("baseline", r.baseline).add("metric", r.metric).add("refused", r.refused).add("reason", r.reason);
    j.add("predicted_step_s", r.predicted_s).add("baseline_step_s", r.baseline_s);
    j.add("speedup_vs_baseline", r.speedup).add("paper_speedup", r.paper_speedup);
    j.add("paper_figure", r.paper_figure).add("paper_is_upper_bound", r.paper_bound).add("beyond_paper", r.beyond);
    j.add("a2a_s", r.a2a_s).add("a2a_speedup", r.a2a_speedup).add("paper_a2a_speedup", r.paper_a2a_speedup);
    j.add("a2a_with_copies_s", r.a2a_copy_s).add("a2a_with_copies_speedup", r.a2a_copy_speedup);
    j.add("a2a_share_of_step", r.a2a_share).add("smoke", smoke).add("notes", r.notes);
    records.push_back(j);
  }
  // BASP by node layout (LayoutRow): Ulysses and BASP replayed on each reading of the paper's node.
  for (const LayoutRow& l : results.layouts) {
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
    j.add("smoke", smoke);
    records.push_back(j);
  }
  return bench::write_json(path, records);
}

bool write_markdown(const std::string& path, const Results& results, const std::vector<Verdict>& vs) {
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
  if (const std::string layouts = layout_summary(results); !layouts.empty())
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
    for (const Record& r : results.records) {
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

bool write_svgs(const std::string& dir, const Results& results) {
  bool ok = true;
  for (const char* paper : {"BASP", "HSAP", "FlashCP", "DPP"}) {
    std::vector<std::tuple<std::string, double, double, bool>> groups;
    std::string title;
    for (const Record& r : results.records) {
      if (r.paper != paper || r.refused || std::isnan(r.paper_speedup)) continue;
      std::string label = r.workload;
      if (r.paper == std::string("HSAP") || r.paper == std::string("DPP")) label += " vs " + r.baseline;
      groups.emplace_back(label, r.speedup, r.paper_speedup, r.paper_bound);
    }
    if (std::string(paper) == "BASP") {
      title = "BASP vs Ulysses: end-to-end step speedup (2 x 4 A100-40GB)";
      // The all-to-all ratios (up to ~85x) get their own chart so that the step speedups stay readable.
      std::vector<std::tuple<std::string, double, double, bool>> a2a;
      for (const Record& r : results.records)
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

}  // namespace seqpar::bench::papers
