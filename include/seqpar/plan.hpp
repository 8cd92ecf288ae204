// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// Umbrella header of the cost model: hardware profiles, model shapes, the program simulator, the
// training-step simulator, the planner's candidates and the workload generators.
#pragma once

#include "seqpar/cost/hardware.hpp"
#include "seqpar/cost/model_shape.hpp"
#include "seqpar/cost/costs.hpp"
#include "seqpar/cost/trace.hpp"
#include "seqpar/cost/simulator.hpp"
#include "seqpar/cost/predict.hpp"
#include "seqpar/cost/step.hpp"
#include "seqpar/cost/hybrid_cost.hpp"
#include "seqpar/cost/candidates.hpp"
#include "seqpar/cost/workloads.hpp"
#include "seqpar/cost/profile_json.hpp"
