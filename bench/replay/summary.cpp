// SPDX-License-Identifier: Apache-2.0
// replay: the papers' figures against seqpar's (verdicts), BASP by node layout, and the summary on stdout.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "replay.hpp"

namespace seqpar::bench::papers {

std::vector<Verdict> verdicts(const Results& results) {
  std::vector<Verdict> out;
  // FlashCP: the paper's "up to" is compared with seqpar's best speedup over the mixes; the single
  // document with every single-document row.
  double flash_best = 0, flash_worst = std::numeric_limits<double>::infinity();
  std::string flash_best_w, flash_worst_w;
  std::map<std::string, std::pair<double, std::string>> per_mix;  // mix -> best speedup, its workload
  // DPP's "up to" figures: per baseline (Seq1F1B per context), the best speedup over the workloads.
  std::map<std::string, std::tuple<double, std::string, double>> dpp_best;  // -> speedup, workload, paper
  for (const Record& r : results.records) {
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
  for (const Record& r : results.records)
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

/// BASP by node layout: per layout, its all-to-all (+ permutes) against the paper's on the workloads with a
/// figure, how many step gains land within 2x, and BASP's all-to-all share of its step against the paper's
/// [S]. Reported, not claimed: the claim is the default layout's (the rows above). The last lines say
/// under which layouts each holds.
std::string layout_summary(const Results& results) {
  if (results.layouts.empty()) return "";
  std::string out =
      "BASP by node layout (reported, not claimed; the claim above is the default layout's): all-to-all +\n"
      "permutes vs the paper's, step gains within 2x, BASP's all-to-all share of its step vs the paper's [S]\n";
  char buf[512];
  std::snprintf(buf, sizeof buf, "%-34s %-40s %-14s %-15s %s\n", "layout", "a2a+copy x seqpar (paper)", "a2a within 2x",
                "step within 2x", "basp a2a % seqpar (paper)");
  out += buf;
  std::vector<std::string> a2a_holds, share_holds;
  std::vector<std::string> order;
  for (const LayoutRow& l : results.layouts)
    if (std::find(order.begin(), order.end(), l.layout) == order.end()) order.push_back(l.layout);
  for (const std::string& name : order) {
    std::string a2a, shares;
    int a2a_n = 0, a2a_ok = 0, step_n = 0, step_ok = 0, share_n = 0, share_ok = 0;
    bool is_default = false;
    for (const LayoutRow& l : results.layouts) {
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

const char* const kClaimText =
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
    "(bench/support/dpp_baselines.hpp), not seqpar programs. Memory is counted tensor by tensor\n"
    "(plan::stage_memory; --explain prints every term): it finds Megatron's 30B needing the checkpointing the\n"
    "paper ran, its 7B and 13B none (the paper ran 10 and 20 layers), and DPP's own plans binding at 80 GB\n"
    "only at 30B, so Seq1F1B and the no-checkpointing ablation rarely pay for memory. FlexSP is shown with its\n"
    "ZeRO-3 traffic hidden under compute (flexsp) and not overlapped (flexsp-zero-exposed); the paper measures\n"
    "its ZeRO and all-to-all at up to 3.2x DPP's. Where the model sees neither cost, it gives DPP less.\n";

std::string verdict_text(const Verdict& v) {
  if (v.floor) return v.direction_ok ? "at or above the floor" : "BELOW THE FLOOR";
  std::string s = v.direction_ok ? "direction ok" : "DIRECTION WRONG";
  if (std::isinf(v.seqpar)) return s + ", no all-to-all left (K = 1)";
  s += v.size_ok ? ", within " + fmt("%.1fx", v.factor) : ", outside " + fmt("%.1fx", v.factor);
  if (!v.claimed) s += " (reported, not claimed)";
  return s;
}

void print_summary(const Results& results, const std::vector<Verdict>& vs) {
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
  std::printf("\n%s", layout_summary(results).c_str());
  // Best composition per workload (every strategy seqpar ran there, paper's or beyond).
  std::printf("\n== best composition seqpar builds per workload ==\n");
  std::map<std::pair<std::string, std::string>, const Record*> best;
  for (const Record& r : results.records) {
    if (r.refused || std::isnan(r.predicted_s) || r.strategy.rfind("padding", 0) == 0) continue;
    if (r.paper == "HSAP" && r.baseline != "hsap" && r.strategy != "hsap") continue;
    auto& b = best[{r.paper, r.workload}];
    if (b == nullptr || r.predicted_s < b->predicted_s) b = &r;
  }
  for (const auto& [key, r] : best)
    std::printf("%-8s %-36s %-22s %s\n", key.first.c_str(), key.second.c_str(), r->strategy.c_str(), r->type.c_str());
}

}  // namespace seqpar::bench::papers
