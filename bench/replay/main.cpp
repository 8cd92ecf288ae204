// SPDX-License-Identifier: Apache-2.0
// replay: the headline results of BASP, HSAP, FlashCP and DPP, replayed with seqpar's own compiled programs
// on the cost model (include/seqpar/replay, include/seqpar/plan), printed next to the papers' figures.
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
// One file per paper (basp.cpp, hsap.cpp, flashcp.cpp, dpp.cpp); replay.hpp says what they share.
//
//   replay [--smoke] [--explain] [--paper NAME] [--json FILE] [--markdown FILE] [--svg-dir DIR]
//   --smoke      a tiny subset (a few seconds; CTest runs it)
//   --explain    DPP: every memory term of each plan's stages and of the baselines, and the checkpointed
//                layers the baselines need beside the paper's
//   --paper      only this paper's replay (BASP, HSAP, FlashCP or DPP; case-insensitive)
//   --json       one record per (paper, workload, strategy, baseline)
//   --markdown   the tables as markdown (default: next to --json, .md)
//   --svg-dir    one grouped bar chart per paper: seqpar's speedup next to the paper's, per workload
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "replay.hpp"

int main(int argc, char** argv) {
  namespace papers = seqpar::bench::papers;
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::string json, markdown, svg_dir, only;
  bool smoke = false;
  bool explain = false;  // DPP: every memory term of every plan and baseline
  const auto lower = [](std::string x) {
    std::transform(x.begin(), x.end(), x.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    return x;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--smoke")
      smoke = true;
    else if (a == "--explain")
      explain = true;
    else if (a == "--json" && i + 1 < argc)
      json = argv[++i];
    else if (a == "--markdown" && i + 1 < argc)
      markdown = argv[++i];
    else if (a == "--paper" && i + 1 < argc)
      only = lower(argv[++i]);
    else if (a == "--svg-dir" && i + 1 < argc)
      svg_dir = argv[++i];
    else {
      std::fprintf(stderr,
                   "usage: %s [--smoke] [--explain] [--paper NAME] [--json FILE] [--markdown FILE] [--svg-dir DIR]\n",
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
  papers::Results results;
  if (wanted("BASP")) papers::run_basp(smoke, results);
  if (wanted("HSAP")) papers::run_hsap(smoke, results);
  if (wanted("FlashCP")) papers::run_flashcp(smoke, results);
  if (wanted("DPP")) papers::run_dpp(smoke, results, explain);
  const std::vector<papers::Verdict> vs = papers::verdicts(results);
  papers::print_summary(results, vs);
  std::printf("\nreplayed in %.1f s\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());

  bool ok = true;
  if (!json.empty()) ok = papers::write_json(json, results, smoke) && ok;
  if (!markdown.empty()) ok = papers::write_markdown(markdown, results, vs) && ok;
  if (!svg_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(svg_dir, ec);  // the charts' folder, like --json's file, is made on demand
    ok = papers::write_svgs(svg_dir, results) && ok;
  }
  return ok ? 0 : 1;
}
