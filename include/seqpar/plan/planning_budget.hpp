// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// The planning budgets: how many slices or pieces a tool compiling every rank's programs (seqpar-plan,
// the replays) accepts before refusing a placement instead of exhausting memory.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "seqpar/core/document_batch.hpp"
#include "seqpar/core/shard_plan.hpp"
#include "seqpar/core/status.hpp"
#include "seqpar/plan/hybrid_cost.hpp"

namespace seqpar::plan {

/// Per-Doc cuts every document it splits into 2P pieces, and a ring over P ranks then runs ~4 slices per
/// split document per rank per step: about 4 * D * P^2 slices in the compiled programs (per_doc_slices:
/// fewer for documents shorter than 2P). Planning tools refuse a candidate above this many (measured
/// ~200 bytes each with their pieces) instead of exhausting memory: at 256 ranks a 2M-token batch of 2K
/// documents is ~160 M slices. A trainer compiles only its own rank's program (P times less) and is
/// unaffected.
inline constexpr double kMaxPlannedSlices = 1e7;

/// Refuses Per-Doc cuts of the documents of `batch` longer than `longer_than` over `ranks` above the
/// planning budget.
[[nodiscard]] inline Status check_split_budget(const DocumentBatch& batch, int ranks, std::int64_t longer_than = 0) {
  const double slices = per_doc_slices(batch, ranks, longer_than);
  if (slices <= kMaxPlannedSlices) return Status::success();
  std::int64_t split = 0;
  for (const Document& d : batch.documents()) split += d.tokens.size() > longer_than ? 1 : 0;
  return Status::refuse(
      "Per-Doc would cut " + std::to_string(split) + " documents into up to " + std::to_string(2 * ranks) +
      " pieces each: ~" + std::to_string(static_cast<long long>(slices / 1e6)) +
      " M slices to plan across all ranks (budget " + std::to_string(static_cast<long long>(kMaxPlannedSlices / 1e6)) +
      " M); use fewer ranks per "
      "ring (Hierarchical, BatchAware) or longer documents");
}

/// Plain AllGather lists, on every rank, every peer's ranges for K and V both ways: ~8 P^2 x sequences
/// pieces over all programs with Zigzag's 2P chunks per sequence.
[[nodiscard]] inline Status check_gather_budget(int sequences, int ranks) {
  const double pieces = 8.0 * sequences * static_cast<double>(ranks) * ranks;
  if (pieces <= kMaxPlannedSlices) return Status::success();
  return Status::refuse("AllGather over " + std::to_string(ranks) + " ranks would list ~" +
                        std::to_string(static_cast<long long>(pieces / 1e6)) +
                        " M KV pieces across all ranks "
                        "(budget " +
                        std::to_string(static_cast<long long>(kMaxPlannedSlices / 1e6)) +
                        " M); gather within smaller groups (BatchAware) or use a ring");
}

/// The length below which a placement keeps every document whole: one less than its shortest document
/// held by more than one rank (Hybrid cuts every document longer than its threshold), the longest
/// document when none is split.
[[nodiscard]] inline std::int64_t split_threshold(const Placement& placement, const DocumentBatch& batch) {
  const auto docs = batch.documents();
  std::vector<int> holder(docs.size(), -1);
  std::int64_t shortest_split = std::numeric_limits<std::int64_t>::max(), longest = 0;
  for (int r = 0; r < placement.world_size(); ++r)
    for (const Range& piece : placement.owned[static_cast<std::size_t>(r)]) {
      auto it = std::upper_bound(docs.begin(), docs.end(), piece.begin,
                                 [](std::int64_t t, const Document& d) { return t < d.tokens.end; });
      for (; it != docs.end() && it->tokens.begin < piece.end; ++it) {
        int& h = holder[static_cast<std::size_t>(it - docs.begin())];
        if (h >= 0 && h != r) shortest_split = std::min(shortest_split, it->tokens.size());
        h = r;
      }
    }
  for (const Document& d : docs) longest = std::max(longest, d.tokens.size());
  return shortest_split == std::numeric_limits<std::int64_t>::max() ? longest : shortest_split - 1;
}

}  // namespace seqpar::plan
