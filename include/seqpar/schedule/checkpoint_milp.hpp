// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// DPP's checkpointing integer program solved with GLPK (target seqpar::glpk, option
/// SEQPAR_ENABLE_GLPK; Debian's libglpk-dev). Variables C_j in {0, ..., layers_per_stage}, one per
/// schedule diagonal; minimize sum C_j subject to, for every stage p and 1F1B window W after a
/// forward: sum_{k in W} F[k] C_{diagonal(k, p)} >= static + sum_{k in W} I[k] - cap (pipeline.hpp has
/// the model and the greedy). By default it is solved to optimality (branch and cut), which takes
/// seconds to minutes beyond a hundred chunks on 32 stages; `MilpOptions` bound it as DPP bounds SCIP
/// (a 2% gap) and by time, with the greedy's decisions as the first incumbent, so a bounded solve is
/// never worse than the greedy.
///
/// @code
/// auto exact = schedule::solve_checkpointing_milp(problem);
/// auto bounded = schedule::milp_solver({.relative_gap = 0.02, .time_limit_s = 1.0});  // a CheckpointSolver
/// @endcode

#include <glpk.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "seqpar/core/error.hpp"
#include "seqpar/schedule/pipeline.hpp"

namespace seqpar::schedule {

struct MilpOptions {
  double relative_gap = 0;   ///< stop once the incumbent is within this fraction of the bound (0: optimal)
  double time_limit_s = 0;   ///< 0: none; at most kMaxMilpSeconds; at the limit, the best decisions found
  bool greedy_start = true;  ///< give GLPK the greedy's decisions as its first incumbent
};

/// The checkpointing program's optimum (or, under `options`' bounds, the best decisions found; the
/// plan's solver says "glpk", "glpk (gap)" or "glpk (time limit)"). Infeasible plan when even full
/// checkpointing exceeds the cap. Bytes are scaled by the cap, so that GLPK sees coefficients of order one.
[[nodiscard]] inline CheckpointPlan solve_checkpointing_milp(const CheckpointProblem& prob,
                                                             const MilpOptions& options = {}) {
  constexpr const char* where = "schedule::solve_checkpointing_milp";
  prob.validate(where);
  seqpar::detail::require(std::isfinite(options.relative_gap) && options.relative_gap >= 0, where,
                          "options.relative_gap", options.relative_gap, "must be finite and >= 0");
  // GLPK takes the limit as an int of milliseconds: a larger value (about 24.8 days or more, or
  // infinity) would overflow it, which GLPK answers by aborting the process. Refused, not clamped:
  // a caller asking for that long means "no limit", which is 0.
  seqpar::detail::require(
      std::isfinite(options.time_limit_s) && options.time_limit_s >= 0 && options.time_limit_s <= kMaxMilpSeconds,
      where, "options.time_limit_s", options.time_limit_s,
      "must be in [0, " + std::to_string(static_cast<long long>(kMaxMilpSeconds)) +
          "] seconds (GLPK's int milliseconds; 0 = none)");
  const int stages = prob.model.stages, m = prob.diagonals();
  const auto windows = memory_windows(prob.order(), stages);
  const std::vector<int> pos = prob.positions();
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
      idx.push_back(pos[static_cast<std::size_t>(k)] + stages - 1 - w.stage + 1);
      val.push_back(prob.model.saved_bytes(t) / cap);
    }
    if (need <= 0) continue;  // fits without checkpointing
    glp_add_rows(lp.get(), 1);
    ++rows;
    glp_set_row_bnds(lp.get(), rows, GLP_LO, need / cap, 0.0);
    glp_set_mat_row(lp.get(), rows, static_cast<int>(idx.size()) - 1, idx.data(), val.data());
  }
  if (rows == 0) return evaluate(prob, std::vector<int>(static_cast<std::size_t>(m), 0), "glpk");
  // The greedy's decisions, handed to GLPK's heuristic callback once (on the original columns: the
  // MIP presolver is off and the LP relaxation is solved first, as GLPK then requires).
  struct Start {
    std::vector<double> x;  // 1-based
    bool given = false;
  } start;
  const CheckpointPlan greedy = options.greedy_start ? solve_checkpointing(prob) : CheckpointPlan{};
  if (greedy.feasible) {
    start.x.assign(static_cast<std::size_t>(m) + 1, 0.0);
    for (int j = 0; j < m; ++j)
      start.x[static_cast<std::size_t>(j) + 1] = greedy.diagonals[static_cast<std::size_t>(j)];
  }
  glp_smcp simplex;
  glp_init_smcp(&simplex);
  simplex.msg_lev = GLP_MSG_OFF;
  const int lp_rc = glp_simplex(lp.get(), &simplex);
  std::vector<int> c(static_cast<std::size_t>(m), prob.model.layers_per_stage);
  if (lp_rc != 0 || glp_get_status(lp.get()) != GLP_OPT) {
    // No LP optimum: the relaxation is infeasible (full checkpointing does not fit) or GLPK failed.
    if (lp_rc != 0 && lp_rc != GLP_ENOPFS && lp_rc != GLP_ENODFS)
      throw Error(Errc::kStepFailed, std::string(where) + ": glp_simplex failed with code " + std::to_string(lp_rc));
    return evaluate(prob, std::move(c), "glpk");
  }
  glp_iocp parm;
  glp_init_iocp(&parm);
  parm.presolve = GLP_OFF;
  parm.msg_lev = GLP_MSG_OFF;
  parm.mip_gap = options.relative_gap;
  if (options.time_limit_s > 0) parm.tm_lim = static_cast<int>(std::ceil(options.time_limit_s * 1000));
  if (!start.x.empty()) {
    parm.cb_info = &start;
    parm.cb_func = [](glp_tree* tree, void* info) {
      auto* s = static_cast<Start*>(info);
      if (glp_ios_reason(tree) == GLP_IHEUR && !s->given) {
        s->given = true;
        (void)glp_ios_heur_sol(tree, s->x.data());  // rejected only when GLPK already has a better one
      }
    };
  }
  const int rc = glp_intopt(lp.get(), &parm);
  const int status = glp_mip_status(lp.get());
  std::string solver = "glpk";
  if (rc == GLP_EMIPGAP) solver = "glpk (gap)";
  if (rc == GLP_ETMLIM) solver = "glpk (time limit)";
  if ((rc == 0 || rc == GLP_EMIPGAP || rc == GLP_ETMLIM) && (status == GLP_OPT || status == GLP_FEAS)) {
    for (int j = 1; j <= m; ++j)
      c[static_cast<std::size_t>(j - 1)] = static_cast<int>(std::lround(glp_mip_col_val(lp.get(), j)));
  } else if (rc == GLP_ETMLIM && greedy.feasible) {
    c = greedy.diagonals;  // no incumbent of GLPK's own in time (the greedy's was rejected or not asked for)
  } else if (rc != 0 && rc != GLP_ENOPFS && rc != GLP_ENODFS && rc != GLP_ETMLIM) {
    throw Error(Errc::kStepFailed, std::string(where) + ": glp_intopt failed with code " + std::to_string(rc));
  }
  // An infeasible program leaves full checkpointing, which evaluate() reports as infeasible.
  return evaluate(prob, std::move(c), solver);
}

/// `solve_checkpointing_milp` with `options`, as a CheckpointSolver for group_pipelines and
/// refine_checkpointing.
[[nodiscard]] inline CheckpointSolver milp_solver(MilpOptions options = {}) {
  return [options](const CheckpointProblem& prob) { return solve_checkpointing_milp(prob, options); };
}

}  // namespace seqpar::schedule
