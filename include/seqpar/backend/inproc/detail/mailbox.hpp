// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "seqpar/backend/inproc/detail/world_state.hpp"

namespace seqpar::backend::inproc::detail {

/// The messages addressed to one rank of one communicator, one FIFO channel per (source, tag).
///
/// Receives are matched in the order they are posted, not the order they are waited on: every
/// receive takes a ticket from its channel at post time and completes with the message of that
/// index. So `irecv(a); recv(b); wait(a)` gives `a` the first message, as MPI does.
/// Senders copy the payload in (eager); only the owning rank posts and takes.
class Inbox {
 public:
  /// Appends a message to channel (src, tag) and wakes the owner.
  void deliver(int src, int tag, std::vector<std::byte> payload) {
    {
      std::lock_guard lock(mutex_);
      Channel& ch = channels_[{src, tag}];
      ch.messages.emplace(ch.delivered++, std::move(payload));
    }
    cv_.notify_all();
  }

  /// Reserves the next message of channel (src, tag) for a receive posted now.
  [[nodiscard]] std::uint64_t post(int src, int tag) {
    std::lock_guard lock(mutex_);
    return channels_[{src, tag}].posted++;
  }

  /// Blocks until message `ticket` of channel (src, tag) has arrived and returns it.
  template <class TimeoutError>
  [[nodiscard]] std::vector<std::byte> take(int src, int tag, std::uint64_t ticket, const WorldState& world,
                                            Clock::time_point deadline, TimeoutError&& timeout_error) {
    std::unique_lock lock(mutex_);
    const auto key = std::pair{src, tag};
    auto ch = channels_.find(key);
    if (ch == channels_.end()) ch = channels_.emplace(key, Channel{}).first;
    // Map nodes are stable and only this rank erases channels, so `ch` stays valid while waiting.
    wait_until_ready(
        lock, cv_, world, deadline, [&] { return ch->second.messages.contains(ticket); }, [] {}, timeout_error);
    auto node = ch->second.messages.extract(ticket);
    if (ch->second.messages.empty() && ch->second.posted == ch->second.delivered) channels_.erase(ch);
    return std::move(node.mapped());
  }

  void wake_all() noexcept {
    { std::lock_guard lock(mutex_); }
    cv_.notify_all();
  }

 private:
  struct Channel {
    std::uint64_t posted = 0;     // receives posted so far (next ticket)
    std::uint64_t delivered = 0;  // messages delivered so far (next message index)
    std::map<std::uint64_t, std::vector<std::byte>> messages;
  };
  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<std::pair<int, int>, Channel> channels_;
};

}  // namespace seqpar::backend::inproc::detail
