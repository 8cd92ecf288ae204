// SPDX-License-Identifier: Apache-2.0
// plan_scale: how long the cost model takes to plan big. For each rank count and strategy, the wall time
// to compile every rank's programs (the planner's view: all ranks) and to simulate one training step of
// Llama-3.1-8B on H100 nodes of 8, over a 1M-token batch of lognormal documents (median 2K). The issue's
// goal: 1024 ranks and a 1M-token batch simulated in under 10 s on this machine (2 cores).
//   plan_scale [--smoke] [--json FILE] [--tokens N] [--ranks a,b,c] [--strategies a,b]
#include <seqpar/plan/candidates.hpp>
#include <seqpar/plan/step.hpp>
#include <seqpar/plan/workloads.hpp>
#include <seqpar/seqpar.hpp>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "support/json.hpp"

using namespace seqpar;

int main(int argc, char** argv) {
  bool smoke = false;
  std::string json;
  std::int64_t tokens = 1 << 20;
  std::vector<int> ranks{64, 256, 1024};
  std::vector<std::string> wanted{"hierarchical", "zigzag-ring-aware", "ring", "hybrid-aware",
                                  "basp-hybrid-hierarchical"};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--smoke") {
      smoke = true;
    } else if (a == "--json" && i + 1 < argc) {
      json = argv[++i];
    } else if (a == "--tokens" && i + 1 < argc) {
      tokens = std::stoll(argv[++i]);
    } else if (a == "--ranks" && i + 1 < argc) {
      ranks.clear();
      std::stringstream ss(argv[++i]);
      for (std::string x; std::getline(ss, x, ',');) ranks.push_back(std::stoi(x));
    } else if (a == "--strategies" && i + 1 < argc) {
      wanted.clear();
      std::stringstream ss(argv[++i]);
      for (std::string x; std::getline(ss, x, ',');) wanted.push_back(x);
    } else {
      std::fprintf(stderr,
                   "usage: plan_scale [--smoke] [--json FILE] [--tokens N] [--ranks a,b,c] [--strategies a,b]\n");
      return 2;
    }
  }
  if (smoke) tokens = 65536, ranks = {16};
  const replay::ModelShape model = replay::models::llama31_8b();
  replay::SimulationOptions sim;
  sim.hardware = replay::profiles::h100_sxm();
  plan::TrainingOptions training;
  training.model = model;
  // Eight packed sequences (the batch-aware candidate forms groups from them; the others see one batch).
  std::vector<std::vector<std::int64_t>> seqs;
  for (int b = 0; b < 8; ++b) seqs.push_back(plan::workloads::sample_lengths("lognormal", tokens / 8, 1000u + b));
  const DocumentBatch batch(seqs);

  std::printf("plan_scale: %lld tokens in 8 sequences, %zu documents, %s on %s nodes of 8\n",
              static_cast<long long>(tokens), batch.documents().size(), model.name.c_str(), sim.hardware.name.c_str());
  std::printf("%6s  %-26s %10s %10s %10s %12s %10s\n", "ranks", "strategy", "compile s", "simulate s", "total s",
              "step ms", "goal");
  std::vector<bench::JsonRecord> records;
  for (const int p : ranks) {
    const Topology topo{p, 8};
    for (const plan::Candidate& c : plan::standard_candidates(sim.hardware, model)) {
      if (std::find(wanted.begin(), wanted.end(), c.name) == wanted.end()) continue;
      const auto t0 = std::chrono::steady_clock::now();
      const replay::CompiledStrategy compiled = c.compile(batch, model.attention(), topo);
      const auto t1 = std::chrono::steady_clock::now();
      bench::JsonRecord r;
      r.add("ranks", p).add("tokens", tokens).add("strategy", c.name);
      if (!compiled.status) {
        std::printf("%6d  %-26s refused: %s\n", p, c.name.c_str(), compiled.status.reason.c_str());
        records.push_back(r.add("refused", true).add("reason", compiled.status.reason));
        continue;
      }
      const plan::StepReport step = plan::simulate_step(compiled, topo, training, sim);
      const auto t2 = std::chrono::steady_clock::now();
      const double compile_s = std::chrono::duration<double>(t1 - t0).count();
      const double simulate_s = std::chrono::duration<double>(t2 - t1).count();
      const double total = compile_s + simulate_s;
      const char* goal = p < 1024 ? "" : (total < 10 ? "met (<10 s)" : "NOT met");
      std::printf("%6d  %-26s %10.2f %10.2f %10.2f %12.1f %10s\n", p, c.name.c_str(), compile_s, simulate_s, total,
                  step.step_s * 1e3, goal);
      records.push_back(r.add("refused", false)
                            .add("compile_s", compile_s)
                            .add("simulate_s", simulate_s)
                            .add("total_s", total)
                            .add("predicted_step_s", step.step_s)
                            .add("error_bound_s", step.error_bound_s));
    }
  }
  if (!json.empty() && !bench::write_json(json, records)) return 1;
  return 0;
}
