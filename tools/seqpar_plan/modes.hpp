// SPDX-License-Identifier: Apache-2.0
// seqpar-plan's two modes: compare the strategies (the default; a training step, or one attention layer
// with --attention-only) or plan DPP's pipeline (--pipeline-stages). Each prints its plan and returns the
// exit status.
#pragma once

#include "options.hpp"
#include "problem.hpp"

namespace seqpar::tools {

/// Every candidate compiled and replayed on the profile, the table, the pick, --json and --trace
/// (strategy_mode.cpp).
int run_strategies(const Options& o, const Problem& p);

/// The pipeline options against the rest of the command line, before anything is computed
/// (pipeline_mode.cpp). Throws UsageError.
void check_pipeline_options(const Options& o);
/// DynamicChunk's chunk plan, the 1F1B pipelines of DPP's grouping and their checkpointing
/// (pipeline_mode.cpp).
int run_pipeline(const Options& o, const Problem& p);

}  // namespace seqpar::tools
