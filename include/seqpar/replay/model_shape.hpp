// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// Transitional: ModelShape and the model table moved to seqpar/plan/model_shape.hpp (namespace
/// seqpar::plan); the replayer never used them. These names remain only until bench/replay.cpp and
/// tools/seqpar_plan.cpp, being split, say plan::ModelShape and plan::models; then this file goes.
/// New code includes <seqpar/plan/model_shape.hpp>.

#include "seqpar/plan/model_shape.hpp"

namespace seqpar::replay {
using plan::ModelShape;
namespace models = plan::models;
}  // namespace seqpar::replay
