// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// Umbrella header of planning by simulation. The replay (seqpar::replay: hardware profiles, model
// shapes, the program simulator and its costs, traces) knows only compiled programs; the planning on
// it (seqpar::plan: compiling a Strategy for every rank, the training-step simulator, Hybrid's cost
// functions, the named strategies and the planner's candidates, the workload generators, SelectedAttention) knows the
// strategies.
#pragma once

#include "seqpar/plan/candidates.hpp"
#include "seqpar/plan/compile_all.hpp"
#include "seqpar/plan/hybrid_cost.hpp"
#include "seqpar/plan/model_shape.hpp"
#include "seqpar/plan/named_strategies.hpp"
#include "seqpar/plan/pipeline_step.hpp"
#include "seqpar/plan/pipeline_step_options.hpp"
#include "seqpar/plan/planning_budget.hpp"
#include "seqpar/plan/selected_attention.hpp"
#include "seqpar/plan/stage_memory.hpp"
#include "seqpar/plan/step.hpp"
#include "seqpar/plan/workloads.hpp"
#include "seqpar/replay/costs.hpp"
#include "seqpar/replay/hardware.hpp"
#include "seqpar/replay/predict.hpp"
#include "seqpar/replay/profile_json.hpp"
#include "seqpar/replay/simulator.hpp"
#include "seqpar/replay/trace.hpp"
