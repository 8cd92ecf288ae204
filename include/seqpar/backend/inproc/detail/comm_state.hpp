// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "seqpar/backend/inproc/detail/mailbox.hpp"
#include "seqpar/backend/inproc/detail/rendezvous.hpp"
#include "seqpar/backend/inproc/detail/world_state.hpp"

namespace seqpar::backend::inproc::detail {

/// What the ranks of one communicator share: one inbox per rank (so messages of different
/// communicators never mix), the collective rendezvous, the world's failure state, and the
/// hand-off of sub-communicators created by split().
class CommState final : public Wakeable {
 public:
  CommState(std::shared_ptr<WorldState> world, std::vector<int> world_ranks)
      : world_(std::move(world)), world_ranks_(std::move(world_ranks)), rendezvous_(size()) {
    inboxes_.reserve(world_ranks_.size());
    for (std::size_t i = 0; i < world_ranks_.size(); ++i) inboxes_.push_back(std::make_unique<Inbox>(world_->memory()));
  }

  /// Creates a communicator and registers it for failure wake-ups.
  [[nodiscard]] static std::shared_ptr<CommState> create(std::shared_ptr<WorldState> world,
                                                         std::vector<int> world_ranks) {
    auto comm = std::make_shared<CommState>(world, std::move(world_ranks));
    world->add(comm);
    return comm;
  }

  [[nodiscard]] int size() const noexcept { return static_cast<int>(world_ranks_.size()); }
  [[nodiscard]] int world_rank(int rank) const noexcept { return world_ranks_[static_cast<std::size_t>(rank)]; }
  [[nodiscard]] WorldState& world() noexcept { return *world_; }
  [[nodiscard]] Inbox& inbox(int rank) noexcept { return *inboxes_[static_cast<std::size_t>(rank)]; }
  [[nodiscard]] Rendezvous& rendezvous() noexcept { return rendezvous_; }

  /// Hands the sub-communicator for (split number, color) to each of its `members` ranks: the
  /// first to ask creates it, the last to ask removes the hand-off entry.
  [[nodiscard]] std::shared_ptr<CommState> take_split(std::uint64_t split, int color, std::vector<int> world_ranks) {
    const int members = static_cast<int>(world_ranks.size());
    if (members == 1) return create(world_, std::move(world_ranks));
    std::lock_guard lock(split_mutex_);
    const auto key = std::pair{split, color};
    auto it = pending_splits_.find(key);
    if (it == pending_splits_.end()) {
      auto comm = create(world_, std::move(world_ranks));
      pending_splits_.emplace(key, PendingSplit{comm, members - 1});
      return comm;
    }
    auto comm = it->second.comm;
    if (--it->second.remaining == 0) pending_splits_.erase(it);
    return comm;
  }

  void wake_all() noexcept override {
    for (auto& inbox : inboxes_) inbox->wake_all();
    rendezvous_.wake_all();
  }

 private:
  struct PendingSplit {
    std::shared_ptr<CommState> comm;
    int remaining;
  };
  std::shared_ptr<WorldState> world_;
  std::vector<int> world_ranks_;
  std::vector<std::unique_ptr<Inbox>> inboxes_;
  Rendezvous rendezvous_;
  std::mutex split_mutex_;
  std::map<std::pair<std::uint64_t, int>, PendingSplit> pending_splits_;
};

}  // namespace seqpar::backend::inproc::detail
