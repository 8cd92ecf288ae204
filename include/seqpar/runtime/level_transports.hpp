// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <utility>
#include <vector>

#include "seqpar/comm/program.hpp"
#include "seqpar/core/shard_plan.hpp"
#include "seqpar/runtime/any_transport.hpp"

namespace seqpar::runtime {

/// The sub-communicators a plan runs on, split from the world: its rank group (BASP groups; the world
/// itself when the group is every rank in order) and a hierarchical communicator's inner and outer
/// levels. Kept per *grouping* (a placement's groups), at most kGroupingEntries of them, least recently
/// used evicted with their transports (BASP makes a new grouping for most batches, each holding its
/// transports' buffers).
///
/// Splits are collective: every rank must split the same levels in the same order. A grouping is touched
/// by every call after the ranks agree, so its recency, hence which one is evicted and when it is split
/// again, is the same on every rank. Levels are kept under the grouping as well as this rank's (color,
/// key): keyed by (color, key) alone a rank could find its level cached from an earlier batch with another
/// grouping while a peer must split, and the two would call different collectives (found running chunked
/// batches under BatchAware x Hierarchical). Each grouping has a serial: a holder of its transports
/// (an engine's cache entry) compares serials to know whether they are still alive.
class LevelTransports {
 public:
  static constexpr std::size_t kGroupingEntries = 8;

  /// The three transports of one plan (null: the level is not used), and the serial of their grouping.
  struct Levels {
    AnyTransport* group = nullptr;
    AnyTransport* inner = nullptr;
    AnyTransport* outer = nullptr;
    std::uint64_t serial = 0;  // 0: not connected
  };

  explicit LevelTransports(AnyTransport& world) : world_(world) {}

  [[nodiscard]] std::size_t groupings() const noexcept { return groupings_.size(); }
  [[nodiscard]] std::size_t transports() const noexcept {
    std::size_t n = 0;
    for (const Grouping& g : groupings_) n += (g.group ? 1 : 0) + g.levels.size();
    return n;
  }

  /// The grouping of `plan` (its groups flattened, -1 after each): the key `connect` takes.
  [[nodiscard]] static std::vector<int> grouping_of(const Placement& plan) {
    std::vector<int> out;
    for (const auto& g : plan.groups) {
      out.insert(out.end(), g.begin(), g.end());
      out.push_back(-1);
    }
    return out;
  }

  /// Touches `grouping` (every call, connected or not: the same LRU on every rank) and, when `held` is
  /// not its transports any more, splits what `program` needs (collective: only after the agreement).
  void connect(const std::vector<int>& grouping, const Placement& plan, const comm::CompiledAttention& program,
               Levels& held) {
    Grouping& g = touch(grouping);
    if (held.serial == g.serial) return;
    held.group = &group_transport(g, plan);
    held.inner = level_transport(g, program.forward.splits[static_cast<std::size_t>(comm::Level::kInner)], 0);
    held.outer = level_transport(g, program.forward.splits[static_cast<std::size_t>(comm::Level::kOuter)], 1);
    held.serial = g.serial;
  }

 private:
  struct Grouping {
    std::vector<int> signature;
    std::uint64_t serial = 0;
    std::unique_ptr<AnyTransport> group;  // null: the group is the whole world
    std::vector<std::pair<std::array<int, 3>, std::unique_ptr<AnyTransport>>> levels;  // (level, color, key)
  };

  // The grouping moved to the front of the LRU (no allocation on a hit), or added.
  Grouping& touch(const std::vector<int>& signature) {
    for (auto it = groupings_.begin(); it != groupings_.end(); ++it)
      if (it->signature == signature) {
        if (it != groupings_.begin()) groupings_.splice(groupings_.begin(), groupings_, it);
        return groupings_.front();
      }
    groupings_.push_front(Grouping{signature, ++serials_, nullptr, {}});
    if (groupings_.size() > kGroupingEntries) groupings_.pop_back();
    return groupings_.front();
  }

  // The plan's group of this rank as a sub-communicator, split once per grouping while it is cached.
  AnyTransport& group_transport(Grouping& g, const Placement& plan) {
    const int me = world_.rank();
    const int gi = plan.group_of(me);
    const auto& members = plan.groups[static_cast<std::size_t>(gi)];
    bool identity = static_cast<int>(members.size()) == world_.size();
    for (std::size_t i = 0; identity && i < members.size(); ++i) identity = members[i] == static_cast<int>(i);
    if (identity) return world_;
    if (!g.group) {
      const int key = static_cast<int>(std::find(members.begin(), members.end(), me) - members.begin());
      g.group = std::make_unique<AnyTransport>(world_.split(gi, key));
    }
    return *g.group;
  }

  AnyTransport* level_transport(Grouping& g, const comm::Program::LevelSplit& split, int level) {
    if (split.color < 0) return nullptr;
    const std::array<int, 3> key{level, split.color, split.key};
    for (auto& l : g.levels)
      if (l.first == key) return l.second.get();
    g.levels.emplace_back(key, std::make_unique<AnyTransport>(world_.split(split.color, split.key)));
    return g.levels.back().second.get();
  }

  AnyTransport& world_;
  std::list<Grouping> groupings_;  // most recently used first
  std::uint64_t serials_ = 0;
};

}  // namespace seqpar::runtime
