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
// `seqpar-plan --help` lists every option; the option table (options.cpp) is the single source of it.
//
// The files: options (the command line, --help, --list), problem (the options checked together into a
// Problem: hardware, topology, model, batch, candidates), strategy_mode (the default: compare the
// strategies), pipeline_mode (--pipeline-stages), main (this: dispatch and exit status).
#include <seqpar/version.hpp>

#include <cstdio>
#include <exception>
#include <stdexcept>

#include "modes.hpp"
#include "options.hpp"
#include "problem.hpp"

namespace seqpar::tools {
namespace {

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
  return run_strategies(o, p);
}

}  // namespace
}  // namespace seqpar::tools

int main(int argc, char** argv) {
  using namespace seqpar::tools;
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
