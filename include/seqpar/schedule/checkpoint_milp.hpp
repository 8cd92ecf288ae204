// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// DPP's checkpointing integer program solved exactly with GLPK (target seqpar::glpk, option
/// SEQPAR_ENABLE_GLPK; Debian's libglpk-dev). Variables C_j in {0, ..., layers_per_stage}, one per
/// schedule diagonal; minimize sum C_j subject to, for every stage p and 1F1B window W after a
/// forward: sum_{k in W} F[k] C_{k + d_p - 1 - p} >= static + sum_{k in W} I[k] - cap
/// (pipeline.hpp has the model and the greedy). The paper solves the same program with SCIP at a 2%
/// gap; this one is solved to optimality (branch and cut), meant for plans of up to a few hundred
/// chunks.

#include <glpk.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "seqpar/core/error.hpp"
#include "seqpar/schedule/pipeline.hpp"

namespace seqpar::schedule {

/// The optimum of the checkpointing program (infeasible plan when even full checkpointing exceeds
/// the cap). Bytes are scaled by the cap, so that GLPK sees coefficients of order one.
[[nodiscard]] inline CheckpointPlan solve_checkpointing_milp(const CheckpointProblem& prob) {
  prob.model.validate("schedule::solve_checkpointing_milp");
  const int stages = prob.model.stages, m = prob.diagonals();
  const auto windows = memory_windows(prob.order(), stages);
  const double cap = prob.model.memory_cap;
  const std::unique_ptr<glp_prob, decltype(&glp_delete_prob)> lp(glp_create_prob(), &glp_delete_prob);
  glp_set_obj_dir(lp.get(), GLP_MIN);
  glp_add_cols(lp.get(), m);
  for (int j = 1; j <= m; ++j) {
    glp_set_col_kind(lp.get(), j, GLP_IV);
    glp_set_col_bnds(lp.get(), j, GLP_DB, 0.0, static_cast<double>(prob.model.layers_per_stage));
    glp_set_obj_coef(lp.get(), j, 1.0);
  }
  std::vector<int> idx{0};
  std::vector<double> val{0.0};
  int rows = 0;
  for (const MemoryWindow& w : windows) {
    double need = prob.model.static_bytes - cap;
    idx.assign(1, 0);
    val.assign(1, 0.0);
    for (int k : w.chunks) {
      const auto t = prob.tokens[static_cast<std::size_t>(k)];
      need += prob.model.full_bytes(t);
      idx.push_back(prob.diagonal(k, w.stage) + 1);
      val.push_back(prob.model.saved_bytes(t) / cap);
    }
    if (need <= 0) continue;  // fits without checkpointing
    glp_add_rows(lp.get(), 1);
    ++rows;
    glp_set_row_bnds(lp.get(), rows, GLP_LO, need / cap, 0.0);
    glp_set_mat_row(lp.get(), rows, static_cast<int>(idx.size()) - 1, idx.data(), val.data());
  }
  glp_iocp parm;
  glp_init_iocp(&parm);
  parm.presolve = GLP_ON;
  parm.msg_lev = GLP_MSG_OFF;
  const int rc = glp_intopt(lp.get(), &parm);
  const int status = glp_mip_status(lp.get());
  std::vector<int> c(static_cast<std::size_t>(m), prob.model.layers_per_stage);
  if (rc == 0 && (status == GLP_OPT || status == GLP_FEAS)) {
    for (int j = 1; j <= m; ++j)
      c[static_cast<std::size_t>(j - 1)] = static_cast<int>(std::lround(glp_mip_col_val(lp.get(), j)));
  } else if (rc != 0 && rc != GLP_ENOPFS && rc != GLP_ENODFS) {
    throw Error(Errc::kStepFailed,
                "schedule::solve_checkpointing_milp: glp_intopt failed with code " + std::to_string(rc));
  }
  // An infeasible program leaves full checkpointing, which evaluate() reports as infeasible.
  return evaluate(prob, std::move(c), "glpk");
}

}  // namespace seqpar::schedule
