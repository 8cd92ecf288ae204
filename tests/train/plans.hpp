// SPDX-License-Identifier: Apache-2.0
// The plans the train tests run over: every partitioner (test::Partitioners) on 1..8 ranks, on packed
// batches of several shapes (one long document, lognormal mixes, many sequences of short documents).
#pragma once

#include "support/distributed_check.hpp"
#include "support/strategy_list.hpp"

#include <functional>
#include <string>
#include <tuple>
#include <vector>

namespace seqpar::test {

inline std::vector<DocumentBatch> train_batches() {
  return {DocumentBatch::single({97}), random_batch(1, 120, 9.0, 11), random_batch(3, 40, 6.0, 12),
          DocumentBatch({{5, 1, 30}, {2}, {17, 17}, {1, 1, 1}})};
}

/// Calls fn(name, batch, plan) for every partitioner that accepts the batch on 1..8 ranks (two ranks
/// per node, so that node-aware partitioners take their node paths too).
inline void for_each_plan(const std::function<void(const std::string&, const DocumentBatch&, const ShardPlan&)>& fn) {
  for (const DocumentBatch& batch : train_batches())
    for (int n = 1; n <= 8; ++n) {
      const Topology topo{n, 2};
      std::apply(
          [&]<class... P>(P...) {
            (
                [&] {
                  const P p{};
                  if (!p.can_implement(batch, topo)) return;
                  const ShardPlan plan = p.plan(batch, topo);
                  fn(std::string(partitioner_name<P>) + " on " + std::to_string(n) + " ranks, " +
                         std::to_string(batch.total_tokens()) + " tokens",
                     batch, plan);
                }(),
                ...);
          },
          Partitioners{});
    }
}

}  // namespace seqpar::test
