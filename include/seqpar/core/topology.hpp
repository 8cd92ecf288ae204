// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include "seqpar/core/error.hpp"

namespace seqpar {

/// The ranks a strategy runs on. Ranks r and s share a node (fast links) iff
/// r / ranks_per_node == s / ranks_per_node. The last node may be partly filled.
struct Topology {
  int world_size = 1;
  int ranks_per_node = 1;

  [[nodiscard]] int node_of(int rank) const noexcept { return rank / ranks_per_node; }
  [[nodiscard]] bool same_node(int a, int b) const noexcept { return node_of(a) == node_of(b); }
  [[nodiscard]] int num_nodes() const noexcept { return (world_size + ranks_per_node - 1) / ranks_per_node; }

  void validate(const char* where = "Topology") const {
    detail::require(world_size >= 1, where, "world_size", world_size, "must be >= 1");
    detail::require(ranks_per_node >= 1, where, "ranks_per_node", ranks_per_node, "must be >= 1");
  }
  friend bool operator==(const Topology&, const Topology&) = default;
};

}  // namespace seqpar
