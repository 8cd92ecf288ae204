// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// DPP's pipeline scheduling over a chunk plan (InfiniPipe:
/// "Efficient Long-Context LLM Training with Dynamic Pipeline Parallelism"):
///  - 1F1B over the chunks of a pipeline on d_p stages (`one_f_one_b`): stage p runs d_p - 1 - p
///    warm-up forwards, then alternates forward and backward, then drains; backward order equals
///    forward order, so at any time a stage holds a contiguous window of chunks;
///  - stage-aware, chunk-level adaptive checkpointing with the diagonal constraint: chunk k on stage p
///    checkpoints C[k + d_p - 1 - p] of its stage's layers, one integer per schedule diagonal
///    (n + d_p - 1 of them), because a recomputation delay on one stage propagates as the same
///    bubble to all stages of its diagonal. Minimize sum C (recomputation time, F-hat x sum C)
///    subject to every stage's memory at every forward: static + sum over the window of
///    (I[k] - F[k] C) <= cap. `solve_checkpointing` is the greedy; `checkpoint_milp.hpp` has the
///    exact integer program (GLPK) behind an optional target;
///  - grouping of sequences into several 1F1B pipelines by DPP's dynamic program over sequences
///    ordered by chunk count (`group_pipelines`): dp[i] = min_k dp[k] + delta + T_ckpt(group k..i),
///    cut between chunk-count classes as DPP does (or between any two sequences: `GroupingOptions`).
///
/// @code
/// schedule::PipelineModel m{.stages = 4, .layers_per_stage = 8, .memory_cap = 60e9, ...};
/// auto groups = schedule::group_pipelines(plan, m);     // pipelines, their order and checkpointing
/// @endcode

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "seqpar/core/error.hpp"
#include "seqpar/schedule/dynamic_chunk.hpp"

namespace seqpar::schedule {

/// What the pipeline scheduler needs to know about the model and the machine.
struct PipelineModel {
  int stages = 1;                         ///< d_p
  int layers_per_stage = 1;               ///< L / d_p: most layers a chunk can checkpoint on a stage
  double static_bytes = 0;                ///< M_ms: weights, gradients, optimizer state per stage
  double memory_cap = 0;                  ///< G: bytes per stage
  double activation_bytes_per_token = 0;  ///< one layer's activations for one token, not checkpointed
  double kept_bytes_per_token = 0;        ///< what a checkpointed layer keeps per token (its input)
  double seconds_per_cost = 0;            ///< a chunk's cost (ChunkCost units) -> forward seconds per layer

  void validate(const char* where) const {
    seqpar::detail::require(stages >= 1, where, "model.stages", stages, "must be >= 1");
    // A NaN compares false everywhere, so a NaN model would pass every bound below and make a NaN
    // plan "feasible"; an infinite one makes every window infeasible or none. Refuse both by name.
    for (const auto& [name, value] :
         {std::pair{"model.static_bytes", static_bytes}, std::pair{"model.memory_cap", memory_cap},
          std::pair{"model.activation_bytes_per_token", activation_bytes_per_token},
          std::pair{"model.kept_bytes_per_token", kept_bytes_per_token},
          std::pair{"model.seconds_per_cost", seconds_per_cost}})
      seqpar::detail::require(std::isfinite(value), where, name, value, "must be finite");
    seqpar::detail::require(static_bytes >= 0, where, "model.static_bytes", static_bytes, "must be >= 0");
    seqpar::detail::require(layers_per_stage >= 1, where, "model.layers_per_stage", layers_per_stage, "must be >= 1");
    seqpar::detail::require(memory_cap > 0, where, "model.memory_cap", memory_cap, "must be > 0 bytes");
    seqpar::detail::require(activation_bytes_per_token >= kept_bytes_per_token && kept_bytes_per_token >= 0, where,
                            "model.kept_bytes_per_token", kept_bytes_per_token,
                            "must be in [0, activation_bytes_per_token]");
    seqpar::detail::require(seconds_per_cost >= 0, where, "model.seconds_per_cost", seconds_per_cost, "must be >= 0");
  }
  /// I[k]: a chunk's activations on one stage without checkpointing.
  [[nodiscard]] double full_bytes(std::int64_t tokens) const noexcept {
    return activation_bytes_per_token * static_cast<double>(tokens) * layers_per_stage;
  }
  /// F[k]: bytes one checkpointed layer of the chunk saves.
  [[nodiscard]] double saved_bytes(std::int64_t tokens) const noexcept {
    return (activation_bytes_per_token - kept_bytes_per_token) * static_cast<double>(tokens);
  }
};

/// One step of a stage: forward or backward of a chunk (index into the pipeline's chunks).
struct StageOp {
  bool backward = false;
  int chunk = 0;
  friend bool operator==(const StageOp&, const StageOp&) = default;
};

namespace pipeline_detail {
/// Refuses an order that is not a permutation of [0, n): a repeated or missing chunk would make a
/// stage forward a chunk twice or erase a chunk it never held (memory_windows) and index past the
/// decisions. O(n).
inline void require_permutation(const std::vector<int>& order, std::size_t n, const char* where, const char* name) {
  seqpar::detail::require(order.size() == n, where, std::string(name) + ".size()", order.size(),
                          "must equal the number of chunks " + std::to_string(n));
  std::vector<char> seen(n, 0);
  for (std::size_t i = 0; i < order.size(); ++i) {
    const int k = order[i];
    const bool fresh = k >= 0 && static_cast<std::size_t>(k) < n && seen[static_cast<std::size_t>(k)] == 0;
    if (!fresh)
      seqpar::detail::throw_invalid(
          where, std::string(name) + "[" + std::to_string(i) + "]", k,
          "must be a permutation of [0, " + std::to_string(n) + ") (out of range or repeated)");
    seen[static_cast<std::size_t>(k)] = 1;
  }
}
}  // namespace pipeline_detail

/// The 1F1B order of `backward_order.size()` chunks on each of `stages` stages. Forwards run in chunk
/// order; backwards in `backward_order` (a permutation: a split document's chunks backward last slice
/// first, since a slice's prefix gradients come from the later slices). Stage p warms up with
/// d_p - 1 - p forwards, then alternates forward and backward, keeping that lead over the furthest
/// chunk a backward has needed (a reversed split document pulls forwards ahead).
[[nodiscard]] inline std::vector<std::vector<StageOp>> one_f_one_b(const std::vector<int>& backward_order, int stages) {
  constexpr const char* where = "schedule::one_f_one_b";
  seqpar::detail::require(stages >= 1, where, "stages", stages, "must be >= 1");
  pipeline_detail::require_permutation(backward_order, backward_order.size(), where, "backward_order");
  const int n = static_cast<int>(backward_order.size());
  std::vector<std::vector<StageOp>> out(static_cast<std::size_t>(stages));
  for (int p = 0; p < stages; ++p) {
    auto& ops = out[static_cast<std::size_t>(p)];
    const int warmup = std::min(stages - 1 - p, n);
    int f = 0, need = -1;
    for (; f < warmup; ++f) ops.push_back({false, f});
    for (int b : backward_order) {
      // Keep the stage's warm-up lead over the furthest chunk a backward has needed so far: forwarding
      // only up to `b` would cost the stage its lead, and every backward would wait a full round trip
      // through the stages (found by plan::simulate_pipeline_step: 73% bubble instead of 13%).
      need = std::max(need, b);
      if (f < n) ops.push_back({false, f++});
      while (f < n && f <= need + stages - 1 - p) ops.push_back({false, f++});
      ops.push_back({true, b});
    }
  }
  return out;
}
/// 1F1B with backward order = forward order (no split documents).
[[nodiscard]] inline std::vector<std::vector<StageOp>> one_f_one_b(int chunks, int stages) {
  std::vector<int> order(static_cast<std::size_t>(chunks));
  std::iota(order.begin(), order.end(), 0);
  return one_f_one_b(order, stages);
}

/// A memory constraint of the checkpointing problem: after a forward on `stage`, `chunks` are in
/// flight (forwarded, not yet backwarded).
struct MemoryWindow {
  int stage = 0;
  std::vector<int> chunks;
};

/// Every (stage, window) of a 1F1B schedule: one per forward (memory peaks right after a forward).
[[nodiscard]] inline std::vector<MemoryWindow> memory_windows(const std::vector<int>& backward_order, int stages) {
  std::vector<MemoryWindow> out;
  const auto order = one_f_one_b(backward_order, stages);
  for (int p = 0; p < stages; ++p) {
    std::vector<int> live;
    for (const StageOp& op : order[static_cast<std::size_t>(p)]) {
      if (op.backward) {
        live.erase(std::find(live.begin(), live.end(), op.chunk));
      } else {
        live.push_back(op.chunk);
        out.push_back({p, live});
      }
    }
  }
  return out;
}
[[nodiscard]] inline std::vector<MemoryWindow> memory_windows(int chunks, int stages) {
  std::vector<int> order(static_cast<std::size_t>(chunks));
  std::iota(order.begin(), order.end(), 0);
  return memory_windows(order, stages);
}

/// The checkpointing problem of one pipeline: chunk token counts, the backward order and the model.
/// The decision for chunk k on stage p is C[position of k in the backward order + d_p - 1 - p]: the
/// schedule diagonal its backward lies on (DPP's ckpt(p, k) = C[f2b[k] + d_p - p], 0-based).
struct CheckpointProblem {
  std::vector<std::int64_t> tokens;  ///< per chunk, in forward order
  PipelineModel model;
  std::vector<int> backward_order;  ///< empty: forward order

  [[nodiscard]] int chunks() const noexcept { return static_cast<int>(tokens.size()); }
  [[nodiscard]] int diagonals() const noexcept { return chunks() + model.stages - 1; }
  /// The model's values, token counts >= 0 and a backward order that is empty or a permutation of
  /// the chunks: the solvers index by it, so a bad one would read and write out of bounds.
  void validate(const char* where) const {
    model.validate(where);
    for (std::size_t k = 0; k < tokens.size(); ++k)
      seqpar::detail::require(tokens[k] >= 0, where, "problem.tokens[" + std::to_string(k) + "]", tokens[k],
                              "must be >= 0");
    if (!backward_order.empty())
      pipeline_detail::require_permutation(backward_order, tokens.size(), where, "problem.backward_order");
  }
  [[nodiscard]] std::vector<int> order() const {
    if (!backward_order.empty()) return backward_order;
    std::vector<int> o(tokens.size());
    std::iota(o.begin(), o.end(), 0);
    return o;
  }
  /// Each chunk's position in the backward order (the inverse permutation).
  [[nodiscard]] std::vector<int> positions() const {
    std::vector<int> pos(tokens.size());
    const std::vector<int> o = order();
    for (std::size_t i = 0; i < o.size(); ++i) pos[static_cast<std::size_t>(o[i])] = static_cast<int>(i);
    return pos;
  }
  /// The diagonal of chunk k on stage p (O(n): the solvers use positions()).
  [[nodiscard]] int diagonal(int k, int p) const {
    int pos = k;
    if (!backward_order.empty())
      pos = static_cast<int>(std::find(backward_order.begin(), backward_order.end(), k) - backward_order.begin());
    return pos + model.stages - 1 - p;
  }
  /// Memory of stage p with window w under decisions c (bytes); `pos` = positions().
  [[nodiscard]] double memory(const MemoryWindow& w, const std::vector<int>& c, const std::vector<int>& pos) const {
    double m = model.static_bytes;
    for (int k : w.chunks) {
      const auto t = tokens[static_cast<std::size_t>(k)];
      const int j = pos[static_cast<std::size_t>(k)] + model.stages - 1 - w.stage;
      m += model.full_bytes(t) - model.saved_bytes(t) * c[static_cast<std::size_t>(j)];
    }
    return m;
  }
  [[nodiscard]] double memory(const MemoryWindow& w, const std::vector<int>& c) const {
    return memory(w, c, positions());
  }
};

/// Checkpointing decisions: layers per diagonal, and the memory they leave.
struct CheckpointPlan {
  bool feasible = false;
  std::vector<int> diagonals;       ///< C[j], j in [0, n + d_p - 1)
  std::vector<double> peak_bytes;   ///< per stage
  long long layers_recomputed = 0;  ///< sum C: the objective
  std::string solver;               ///< "greedy", "glpk", ...

  /// Layers chunk k checkpoints on stage p.
  [[nodiscard]] int layers(const CheckpointProblem& prob, int k, int p) const {
    return diagonals[static_cast<std::size_t>(prob.diagonal(k, p))];
  }
};

/// Fills peak_bytes and feasibility of decisions `c`.
[[nodiscard]] inline CheckpointPlan evaluate(const CheckpointProblem& prob, std::vector<int> c, std::string solver) {
  constexpr const char* where = "schedule::evaluate";
  prob.validate(where);
  // Decisions planned for another stage count (or chunk count) would be read past their end.
  seqpar::detail::require(c.size() == static_cast<std::size_t>(prob.diagonals()), where, "decisions.size()", c.size(),
                          "must be chunks + stages - 1 = " + std::to_string(prob.diagonals()));
  for (std::size_t j = 0; j < c.size(); ++j)
    seqpar::detail::require(c[j] >= 0 && c[j] <= prob.model.layers_per_stage, where,
                            "decisions[" + std::to_string(j) + "]", c[j],
                            "must be in [0, layers_per_stage = " + std::to_string(prob.model.layers_per_stage) + "]");
  CheckpointPlan plan;
  plan.diagonals = std::move(c);
  plan.solver = std::move(solver);
  plan.peak_bytes.assign(static_cast<std::size_t>(prob.model.stages), prob.model.static_bytes);
  plan.feasible = true;
  const std::vector<int> pos = prob.positions();
  for (const MemoryWindow& w : memory_windows(prob.order(), prob.model.stages)) {
    const double m = prob.memory(w, plan.diagonals, pos);
    auto& peak = plan.peak_bytes[static_cast<std::size_t>(w.stage)];
    peak = std::max(peak, m);
    if (m > prob.model.memory_cap * (1 + 1e-12)) plan.feasible = false;
  }
  plan.layers_recomputed = std::accumulate(plan.diagonals.begin(), plan.diagonals.end(), 0LL);
  return plan;
}

/// Greedy checkpointing: while a window exceeds the cap, add one checkpointed layer to the diagonal
/// that removes the most excess bytes summed over the windows still over the cap. Not optimal in
/// general (the MILP is); feasible whenever full checkpointing is. Incremental: a step updates only
/// the windows that hold the chosen diagonal and the gains of their diagonals, so a solve costs
/// O(steps x windows per diagonal x window length) after O(sum of window lengths) of setup.
[[nodiscard]] inline CheckpointPlan solve_checkpointing(const CheckpointProblem& prob) {
  prob.validate("schedule::solve_checkpointing");
  const int stages = prob.model.stages, top = prob.model.layers_per_stage;
  const auto m = static_cast<std::size_t>(prob.diagonals());
  const std::vector<int> pos = prob.positions();
  const auto windows = memory_windows(prob.order(), stages);
  const double cap = prob.model.memory_cap, tol = cap * 1e-12;
  // Flat tables: per window its excess over the cap and its (diagonal, saved bytes) entries; per
  // diagonal the (window, saved bytes) entries that hold it (a window holds a diagonal at most once).
  std::vector<double> excess(windows.size());
  std::vector<std::size_t> w_begin(windows.size() + 1, 0), d_begin(m + 1, 0);
  std::vector<std::size_t> w_diag;
  std::vector<double> w_saved;
  for (std::size_t w = 0; w < windows.size(); ++w) {
    double mem = prob.model.static_bytes;
    for (int k : windows[w].chunks) {
      const auto t = prob.tokens[static_cast<std::size_t>(k)];
      mem += prob.model.full_bytes(t);
      w_diag.push_back(static_cast<std::size_t>(pos[static_cast<std::size_t>(k)] + stages - 1 - windows[w].stage));
      w_saved.push_back(prob.model.saved_bytes(t));
      ++d_begin[w_diag.back() + 1];
    }
    excess[w] = mem - cap;
    w_begin[w + 1] = w_diag.size();
  }
  for (std::size_t j = 0; j < m; ++j) d_begin[j + 1] += d_begin[j];
  std::vector<std::size_t> d_window(w_diag.size());
  std::vector<double> d_saved(w_diag.size());
  {
    std::vector<std::size_t> fill(d_begin.begin(), d_begin.end() - 1);
    for (std::size_t w = 0; w < windows.size(); ++w)
      for (std::size_t e = w_begin[w]; e < w_begin[w + 1]; ++e) {
        const std::size_t at = fill[w_diag[e]]++;
        d_window[at] = w;
        d_saved[at] = w_saved[e];
      }
  }
  // gain[j]: the excess bytes one more layer on diagonal j removes, over the windows over the cap.
  const auto share = [tol](double over, double saved) { return over > tol ? std::min(over, saved) : 0.0; };
  std::vector<double> gain(m, 0.0);
  std::size_t over = 0;
  for (std::size_t w = 0; w < windows.size(); ++w) {
    if (excess[w] <= tol) continue;
    ++over;
    for (std::size_t e = w_begin[w]; e < w_begin[w + 1]; ++e) gain[w_diag[e]] += share(excess[w], w_saved[e]);
  }
  std::vector<int> c(m, 0);
  while (over > 0) {
    std::size_t best = m;
    for (std::size_t j = 0; j < m; ++j)
      if (c[j] < top && (best == m || gain[j] > gain[best])) best = j;
    // Gains are updated incrementally; a real one is at least min(excess, one token's bytes) > tol.
    if (best == m || gain[best] <= tol) break;  // infeasible even with the violated windows checkpointed
    ++c[best];
    for (std::size_t e = d_begin[best]; e < d_begin[best + 1]; ++e) {
      const std::size_t w = d_window[e];
      const double before = excess[w], after = before - d_saved[e];
      excess[w] = after;
      if (before <= tol) continue;
      if (after <= tol) --over;
      for (std::size_t f = w_begin[w]; f < w_begin[w + 1]; ++f)
        gain[w_diag[f]] += share(after, w_saved[f]) - share(before, w_saved[f]);
    }
  }
  return evaluate(prob, std::move(c), "greedy");
}

/// A 1F1B pipeline of the plan: its chunks (indices into the chunk plan, in run order), its
/// checkpointing and its predicted time.
struct Pipeline {
  std::vector<int> chunks;          ///< forward order (indices into the chunk plan)
  std::vector<int> backward_order;  ///< positions in `chunks`, in backward order
  CheckpointPlan checkpointing;
  double seconds = 0;  ///< delta + steady time + recomputation
};

struct PipelineSchedule {
  std::vector<Pipeline> pipelines;
  double seconds = 0;
  /// ChunkPlan::fingerprint() of the plan grouped (set by group_pipelines; 0: not known, a hand-made
  /// schedule, then not checked): validate_schedule refuses a schedule grouped from another plan, such
  /// as the last batch's plan of the same chunk count.
  std::uint64_t plan_fingerprint = 0;
};

/// The units DPP groups: a document with all its chunks (a split document's slices and the hybrid
/// chunk of its tail; chunks linked by a shared document stay together), in plan order.
[[nodiscard]] inline std::vector<std::vector<int>> sequence_units(const ChunkPlan& plan) {
  const int n = static_cast<int>(plan.chunks.size());
  std::vector<int> parent(static_cast<std::size_t>(n));
  std::iota(parent.begin(), parent.end(), 0);
  const std::function<int(int)> find = [&](int x) {
    while (parent[static_cast<std::size_t>(x)] != x)
      x = parent[static_cast<std::size_t>(x)] = parent[static_cast<std::size_t>(parent[static_cast<std::size_t>(x)])];
    return x;
  };
  std::vector<int> first_chunk_of_doc;
  for (int c = 0; c < n; ++c)
    for (const ChunkPiece& p : plan.pieces[static_cast<std::size_t>(c)]) {
      if (p.document >= static_cast<int>(first_chunk_of_doc.size()))
        first_chunk_of_doc.resize(static_cast<std::size_t>(p.document) + 1, -1);
      int& f = first_chunk_of_doc[static_cast<std::size_t>(p.document)];
      if (f < 0)
        f = c;
      else
        parent[static_cast<std::size_t>(find(c))] = find(f);
    }
  std::vector<std::vector<int>> units;
  std::vector<int> unit_of(static_cast<std::size_t>(n), -1);
  for (int c = 0; c < n; ++c) {
    const int root = find(c);
    if (unit_of[static_cast<std::size_t>(root)] < 0) {
      unit_of[static_cast<std::size_t>(root)] = static_cast<int>(units.size());
      units.emplace_back();
    }
    units[static_cast<std::size_t>(unit_of[static_cast<std::size_t>(root)])].push_back(c);
  }
  // Longer sequences (more chunks) first: within a 1F1B pipeline they must lead (DPP).
  std::stable_sort(units.begin(), units.end(), [](const auto& a, const auto& b) { return a.size() > b.size(); });
  return units;
}

/// Backward order of a pipeline's chunks (positions in `chunks`, which are in forward order): a chunk
/// goes backward only after every later chunk that reads its tokens as prefix, so the chunks of a
/// split document go last slice first; otherwise forward order. Each backward is placed as early as
/// that allows: right after the last chunk that reads it.
[[nodiscard]] inline std::vector<int> backward_order(const ChunkPlan& plan, const std::vector<int>& chunks) {
  const int n = static_cast<int>(chunks.size());
  // reader[i]: the last position j > i whose prefix overlaps chunk i's tokens (i itself when none).
  std::vector<int> last_reader(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) {
    last_reader[static_cast<std::size_t>(i)] = i;
    const Chunk& ci = plan.chunks[static_cast<std::size_t>(chunks[static_cast<std::size_t>(i)])];
    for (int j = i + 1; j < n; ++j) {
      const Chunk& cj = plan.chunks[static_cast<std::size_t>(chunks[static_cast<std::size_t>(j)])];
      bool reads = false;
      for (const Range& pre : cj.prefix)
        for (const Range& t : ci.tokens) reads = reads || std::max(pre.begin, t.begin) < std::min(pre.end, t.end);
      if (reads) last_reader[static_cast<std::size_t>(i)] = std::max(last_reader[static_cast<std::size_t>(i)], j);
    }
  }
  // Reading is transitive through the slices of a document; close it.
  for (int i = n - 1; i >= 0; --i)
    for (int j = i + 1; j <= last_reader[static_cast<std::size_t>(i)]; ++j)
      last_reader[static_cast<std::size_t>(i)] =
          std::max(last_reader[static_cast<std::size_t>(i)], last_reader[static_cast<std::size_t>(j)]);
  std::vector<int> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  // By the position of the last reader, later positions first among equal readers.
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    const int ra = last_reader[static_cast<std::size_t>(a)], rb = last_reader[static_cast<std::size_t>(b)];
    return ra != rb ? ra < rb : a > b;
  });
  return order;
}

/// Refuses a schedule that does not belong to `plan` on `stages` stages of `layers_per_stage` layers:
/// no pipeline, or an empty one (nothing would run and the step's loss would be 0); a chunk outside
/// the plan or not in exactly one pipeline; a backward order that is not a permutation of the
/// pipeline's positions; a schedule grouped from another plan (PipelineSchedule::plan_fingerprint);
/// checkpointing decisions planned for another stage count (one per diagonal:
/// chunks + stages - 1; a run on more stages would read past them) or out of [0, layers_per_stage].
/// Whoever runs or simulates a schedule calls this first. O(chunks + stages x pipelines).
inline void validate_schedule(const ChunkPlan& plan, const PipelineSchedule& schedule, int stages, int layers_per_stage,
                              const char* where) {
  const int total = static_cast<int>(plan.chunks.size());
  seqpar::detail::require(stages >= 1, where, "stages", stages, "must be >= 1");
  seqpar::detail::require(plan.pieces.size() == plan.chunks.size(), where, "plan.pieces.size()", plan.pieces.size(),
                          "must equal plan.chunks.size() = " + std::to_string(total));
  seqpar::detail::require(!schedule.pipelines.empty(), where, "schedule.pipelines.size()", 0,
                          "must be >= 1 (an empty schedule runs nothing)");
  if (schedule.plan_fingerprint != 0 && schedule.plan_fingerprint != plan.fingerprint())
    seqpar::detail::throw_invalid(where, "schedule.plan_fingerprint", schedule.plan_fingerprint,
                                  "is not this chunk plan's (" + std::to_string(plan.fingerprint()) +
                                      ", of the batch with fingerprint " + std::to_string(plan.batch_fingerprint) +
                                      "): a schedule grouped from another plan (the last batch's, of the same chunk "
                                      "count?); group_pipelines(plan, ...) of this plan");
  std::vector<int> seen(static_cast<std::size_t>(total), 0);
  std::vector<int> home(static_cast<std::size_t>(total), -1);  // a pipeline a chunk runs in
  for (std::size_t pi = 0; pi < schedule.pipelines.size(); ++pi) {
    const Pipeline& pipe = schedule.pipelines[pi];
    const std::string name = "schedule.pipelines[" + std::to_string(pi) + "]";
    seqpar::detail::require(!pipe.chunks.empty(), where, name + ".chunks.size()", 0, "must be >= 1");
    for (int c : pipe.chunks) {
      seqpar::detail::require(c >= 0 && c < total, where, name + ".chunks", c,
                              "is not a chunk of the plan (" + std::to_string(total) + " chunks)");
      ++seen[static_cast<std::size_t>(c)];
      home[static_cast<std::size_t>(c)] = static_cast<int>(pi);
    }
  }
  // Chunks first: a pipeline that lost a chunk also has one diagonal too many, which would otherwise be
  // reported as a schedule of another stage count.
  for (int c = 0; c < total; ++c) {
    const int n = seen[static_cast<std::size_t>(c)];
    if (n == 0) {
      // The pipeline that lost it: the one whose checkpointing was planned for one chunk more.
      std::string lost;
      for (std::size_t pi = 0; pi < schedule.pipelines.size() && lost.empty(); ++pi) {
        const Pipeline& pipe = schedule.pipelines[pi];
        if (pipe.checkpointing.diagonals.size() == pipe.chunks.size() + static_cast<std::size_t>(stages))
          lost = " (schedule.pipelines[" + std::to_string(pi) + "] holds " + std::to_string(pipe.chunks.size()) +
                 " chunks but its checkpointing was planned for " + std::to_string(pipe.chunks.size() + 1) +
                 ": the chunk was lost from it)";
      }
      seqpar::detail::throw_invalid(where, "schedule (pipelines of chunk " + std::to_string(c) + ")", 0,
                                    "chunk " + std::to_string(c) + " of the plan (" +
                                        std::to_string(plan.chunks[static_cast<std::size_t>(c)].batch.total_tokens()) +
                                        " tokens) runs in no pipeline" + lost +
                                        ": every chunk must run in exactly one pipeline");
    }
    seqpar::detail::require(n == 1, where, "schedule (pipelines of chunk " + std::to_string(c) + ")", n,
                            "every chunk must run in exactly one pipeline (chunk " + std::to_string(c) +
                                " runs twice; once in schedule.pipelines[" +
                                std::to_string(home[static_cast<std::size_t>(c)]) + "])");
  }
  for (std::size_t pi = 0; pi < schedule.pipelines.size(); ++pi) {
    const Pipeline& pipe = schedule.pipelines[pi];
    const std::string name = "schedule.pipelines[" + std::to_string(pi) + "]";
    const std::size_t diagonals = pipe.chunks.size() + static_cast<std::size_t>(stages) - 1;
    seqpar::detail::require(pipe.checkpointing.diagonals.size() == diagonals, where,
                            name + ".checkpointing.diagonals.size()", pipe.checkpointing.diagonals.size(),
                            "must be chunks + stages - 1 = " + std::to_string(diagonals) +
                                " (was the schedule planned for " + std::to_string(stages) + " stages?)");
    if (!pipe.backward_order.empty())
      pipeline_detail::require_permutation(pipe.backward_order, pipe.chunks.size(), where,
                                           (name + ".backward_order").c_str());
    for (int c : pipe.checkpointing.diagonals)
      seqpar::detail::require(c >= 0 && c <= layers_per_stage, where, name + ".checkpointing.diagonals", c,
                              "must be in [0, layers per stage = " + std::to_string(layers_per_stage) + "]");
  }
}

/// The longest time limit the MILP (checkpoint_milp.hpp) accepts: GLPK takes its limit as an int of
/// milliseconds, so about 24.8 days. Here, not there, so that tools built without GLPK check it too.
inline constexpr double kMaxMilpSeconds = static_cast<double>(std::numeric_limits<int>::max() / 1000);

/// Checkpointing solver used by the grouping (the greedy, or the MILP of checkpoint_milp.hpp).
using CheckpointSolver = std::function<CheckpointPlan(const CheckpointProblem&)>;

/// The checkpointing problem of a pipeline's chunks (its `chunks` and `backward_order` set).
[[nodiscard]] inline CheckpointProblem checkpoint_problem(const ChunkPlan& plan, const PipelineModel& model,
                                                          const Pipeline& pipeline) {
  CheckpointProblem prob{{}, model, pipeline.backward_order};
  for (int c : pipeline.chunks) prob.tokens.push_back(plan.chunks[static_cast<std::size_t>(c)].batch.total_tokens());
  return prob;
}

namespace pipeline_detail {
/// Forward + backward (2x) of one chunk on one stage, seconds.
[[nodiscard]] inline double chunk_seconds(const ChunkPlan& plan, const PipelineModel& model, int c) {
  return 3.0 * plan.chunks[static_cast<std::size_t>(c)].cost * model.seconds_per_cost * model.layers_per_stage;
}
/// DPP's time of a pipeline: delta = (d_p - 1) x the average chunk's forward + backward, plus every
/// chunk's, plus the recomputed layers at the average chunk's forward time per layer (F-hat).
[[nodiscard]] inline double seconds(const ChunkPlan& plan, const PipelineModel& model, const Pipeline& p) {
  double total = 0;
  for (int c : p.chunks) total += chunk_seconds(plan, model, c);
  const double avg = total / static_cast<double>(p.chunks.size());
  const double f_hat = avg / 3.0 / model.layers_per_stage;
  return (model.stages - 1) * avg + total + f_hat * static_cast<double>(p.checkpointing.layers_recomputed);
}
}  // namespace pipeline_detail

/// Solves each pipeline's checkpointing again with `solve` (e.g. the MILP after a grouping by the
/// greedy, whose solves the grouping's dynamic program repeats many times) and keeps the new decisions
/// when they are feasible and recompute no more layers; updates the pipelines' and the schedule's times.
inline void refine_checkpointing(const ChunkPlan& plan, const PipelineModel& model, PipelineSchedule& schedule,
                                 const CheckpointSolver& solve) {
  model.validate("schedule::refine_checkpointing");
  schedule.seconds = 0;
  for (Pipeline& p : schedule.pipelines) {
    CheckpointPlan better = solve(checkpoint_problem(plan, model, p));
    if (better.feasible && (!p.checkpointing.feasible || better.layers_recomputed <= p.checkpointing.layers_recomputed))
      p.checkpointing = std::move(better);
    p.seconds = pipeline_detail::seconds(plan, model, p);
    schedule.seconds += p.seconds;
  }
}

/// Where `group_pipelines` may cut the units (ordered by chunk count) into pipelines.
enum class GroupBoundaries : std::uint8_t {
  /// DPP's classes: only between units of different chunk counts (S[i] = the sequences of i chunks),
  /// O(classes^2) checkpointing solves, classes <= slices + 1. When no grouping at these cuts fits,
  /// every unit boundary is tried (a pipeline of fewer chunks than stages has smaller 1F1B windows,
  /// so cutting inside a class can fit what the whole class cannot).
  kChunkCount,
  /// Between any two units: O(units^2) solves; never worse than kChunkCount, much slower at scale.
  kEveryUnit,
};

struct GroupingOptions {
  GroupBoundaries boundaries = GroupBoundaries::kChunkCount;
};

/// DPP's grouping of sequences into 1F1B pipelines run one after another: over the units ordered by
/// chunk count, dp[i] = min over k < i of dp[k] + delta + T_ckpt(units k..i-1), delta = (d_p - 1) x
/// the average chunk's forward + backward time (warm-up and drain), T_ckpt = the recomputed layers'
/// forward time; i and k range over the boundaries `options` allows. A group whose checkpointing is
/// infeasible is not a candidate. Throws std::invalid_argument when no grouping fits the memory cap.
[[nodiscard]] inline PipelineSchedule group_pipelines(const ChunkPlan& plan, const PipelineModel& model,
                                                      const CheckpointSolver& solve = solve_checkpointing,
                                                      GroupingOptions options = {}) {
  constexpr const char* where = "schedule::group_pipelines";
  model.validate(where);
  seqpar::detail::require(!plan.chunks.empty(), where, "plan.chunks.size()", 0,
                          "must be >= 1 (an empty plan has nothing to schedule)");
  const auto units = sequence_units(plan);
  const int u = static_cast<int>(units.size());
  const auto chunk_seconds = [&](int c) { return pipeline_detail::chunk_seconds(plan, model, c); };
  const auto build = [&](int from, int to) {  // units [from, to)
    Pipeline p;
    for (int i = from; i < to; ++i)
      for (int c : units[static_cast<std::size_t>(i)]) p.chunks.push_back(c);
    std::sort(p.chunks.begin(), p.chunks.end());  // the plan's order keeps each document's slices in order
    p.backward_order = backward_order(plan, p.chunks);
    p.checkpointing = solve(checkpoint_problem(plan, model, p));
    p.seconds = pipeline_detail::seconds(plan, model, p);
    return p;
  };
  // Per unit prefix sums of chunk seconds and chunk counts: a group's time without recomputation,
  // (d_p - 1) x avg + total, is a lower bound of its time, known before its checkpointing is solved.
  std::vector<double> seconds_before(static_cast<std::size_t>(u) + 1, 0.0);
  std::vector<std::int64_t> chunks_before(static_cast<std::size_t>(u) + 1, 0);
  for (int i = 0; i < u; ++i) {
    double t = 0;
    for (int c : units[static_cast<std::size_t>(i)]) t += chunk_seconds(c);
    seconds_before[static_cast<std::size_t>(i) + 1] = seconds_before[static_cast<std::size_t>(i)] + t;
    chunks_before[static_cast<std::size_t>(i) + 1] =
        chunks_before[static_cast<std::size_t>(i)] +
        static_cast<std::int64_t>(units[static_cast<std::size_t>(i)].size());
  }
  const auto lower_bound = [&](int from, int to) {
    const double total = seconds_before[static_cast<std::size_t>(to)] - seconds_before[static_cast<std::size_t>(from)];
    const auto n = static_cast<double>(chunks_before[static_cast<std::size_t>(to)] -
                                       chunks_before[static_cast<std::size_t>(from)]);
    return (model.stages - 1) * total / n + total;
  };
  // The DP over the allowed cuts. For each end, candidate starts are tried by increasing lower bound
  // and the solves stop once the bound reaches the best time found (the optimum is unchanged: a
  // candidate's time is at least its bound); each end's best last pipeline is kept, so the
  // reconstruction solves nothing again.
  const auto group = [&](GroupBoundaries boundaries) {
    std::vector<int> cuts{0};
    for (int i = 1; i < u; ++i)
      if (boundaries == GroupBoundaries::kEveryUnit ||
          units[static_cast<std::size_t>(i)].size() != units[static_cast<std::size_t>(i) - 1].size())
        cuts.push_back(i);
    cuts.push_back(u);
    const std::size_t m = cuts.size();
    const double inf = std::numeric_limits<double>::infinity();
    std::vector<double> dp(m, inf);
    std::vector<std::size_t> from(m, 0);
    std::vector<Pipeline> last(m);
    dp[0] = 0;
    std::vector<std::pair<double, std::size_t>> candidates;
    for (std::size_t i = 1; i < m; ++i) {
      candidates.clear();
      for (std::size_t k = 0; k < i; ++k)
        if (dp[k] < inf) candidates.emplace_back(dp[k] + lower_bound(cuts[k], cuts[i]), k);
      std::sort(candidates.begin(), candidates.end());
      for (const auto& [bound, k] : candidates) {
        if (bound > dp[i] * (1 + 1e-12)) break;  // slack: the bound and the time sum in different orders
        Pipeline p = build(cuts[k], cuts[i]);
        if (!p.checkpointing.feasible) continue;
        const double t = dp[k] + p.seconds;
        if (t < dp[i]) {
          dp[i] = t;
          from[i] = k;
          last[i] = std::move(p);
        }
      }
    }
    PipelineSchedule out;
    out.seconds = dp[m - 1];
    if (dp[m - 1] == inf) return out;
    for (std::size_t i = m - 1; i > 0; i = from[i]) out.pipelines.insert(out.pipelines.begin(), std::move(last[i]));
    return out;
  };
  PipelineSchedule out = group(options.boundaries);
  if (out.pipelines.empty() && options.boundaries != GroupBoundaries::kEveryUnit)
    out = group(GroupBoundaries::kEveryUnit);
  if (out.pipelines.empty())
    seqpar::detail::throw_invalid(where, "model.memory_cap", model.memory_cap,
                                  "no grouping of the chunks fits, even with full checkpointing");
  out.plan_fingerprint = plan.fingerprint();
  return out;
}

}  // namespace seqpar::schedule
