// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "seqpar/backend/inproc/detail/world_state.hpp"

namespace seqpar::backend::inproc::detail {

enum class CollectiveOp : std::uint8_t { kAllToAll, kAllToAllV, kAllGather, kAllGatherV, kBarrier, kSplit };

[[nodiscard]] inline const char* op_name(CollectiveOp op) noexcept {
  switch (op) {
    case CollectiveOp::kAllToAll:
      return "all_to_all";
    case CollectiveOp::kAllToAllV:
      return "all_to_all_v";
    case CollectiveOp::kAllGather:
      return "all_gather";
    case CollectiveOp::kAllGatherV:
      return "all_gather_v";
    case CollectiveOp::kBarrier:
      return "barrier";
    case CollectiveOp::kSplit:
      return "split";
  }
  return "collective";
}

/// What one rank publishes for a collective: its operation and a view of its send buffer.
/// Peers copy straight out of it (one copy per byte, no staging).
struct Slot {
  CollectiveOp op = CollectiveOp::kBarrier;
  const std::byte* send = nullptr;
  std::size_t send_size = 0;                 // whole send buffer
  std::size_t block = 0;                     // all_to_all block / all_gather contribution
  std::span<const std::size_t> send_counts;  // all_to_all_v
  std::vector<std::size_t> send_displs;      // all_to_all_v (capacity reused across calls)
  int color = 0;                             // split
  int key = 0;                               // split
};

/// Shared-memory rendezvous for the collectives of one communicator, in two phases:
///  1. arrive(): every rank has published its Slot (a rank that gives up, on failure or timeout,
///     withdraws its arrival, so no peer ever reads a slot whose owner has left);
///  2. depart(): every rank has finished reading the others' slots and buffers, so each owner may
///     return and reuse its buffers. Between the phases a rank only copies memory (it never
///     blocks), so depart() waits without a timeout and never needs a failure exit; every rank
///     that passed phase 1 reaches it, even when it throws (see Departure).
class Rendezvous {
 public:
  explicit Rendezvous(int size)
      : size_(size), slots_(static_cast<std::size_t>(size)), present_(static_cast<std::size_t>(size), false) {}

  /// The caller's own slot; write it before arrive() and not again before depart() returns.
  [[nodiscard]] Slot& slot(int rank) noexcept { return slots_[static_cast<std::size_t>(rank)]; }
  /// A peer's slot; read it only between arrive() and depart().
  [[nodiscard]] const Slot& peer(int rank) const noexcept { return slots_[static_cast<std::size_t>(rank)]; }

  /// Phase 1. Returns the collective's sequence number (equal on every rank).
  /// `timeout_error(missing)` builds the timeout Error from the ranks not yet arrived ("1, 3").
  template <class TimeoutError>
  std::uint64_t arrive(int rank, const WorldState& world, Clock::time_point deadline, TimeoutError&& timeout_error) {
    std::unique_lock lock(mutex_);
    const std::uint64_t generation = arrive_generation_;
    present_[static_cast<std::size_t>(rank)] = true;
    if (++arrived_ == size_) {
      arrived_ = 0;
      present_.assign(present_.size(), false);
      ++arrive_generation_;
      lock.unlock();
      cv_.notify_all();
      return generation;
    }
    wait_until_ready(
        lock, cv_, world, deadline, [&] { return arrive_generation_ != generation; },
        [&] {
          --arrived_;
          present_[static_cast<std::size_t>(rank)] = false;
        },
        [&] { return timeout_error(missing()); });
    return generation;
  }

  /// Phase 2: waits until every rank has finished reading.
  void depart() noexcept {
    std::unique_lock lock(mutex_);
    const std::uint64_t generation = depart_generation_;
    if (++departed_ == size_) {
      departed_ = 0;
      ++depart_generation_;
      lock.unlock();
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return depart_generation_ != generation; });
  }

  void wake_all() noexcept {
    { std::lock_guard lock(mutex_); }
    cv_.notify_all();
  }

 private:
  // Comma-separated ranks that have not arrived (called with the lock held).
  [[nodiscard]] std::string missing() const {
    std::string out;
    for (int r = 0; r < size_; ++r) {
      if (present_[static_cast<std::size_t>(r)]) continue;
      if (!out.empty()) out += ", ";
      out += std::to_string(r);
    }
    return out;
  }

  int size_;
  std::vector<Slot> slots_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  std::uint64_t arrive_generation_ = 0;
  int departed_ = 0;
  std::uint64_t depart_generation_ = 0;
  std::vector<bool> present_;
};

/// Calls depart() when the read phase ends, normally or by an exception.
class Departure {
 public:
  explicit Departure(Rendezvous& rv) noexcept : rv_(rv) {}
  Departure(const Departure&) = delete;
  Departure& operator=(const Departure&) = delete;
  ~Departure() { rv_.depart(); }

 private:
  Rendezvous& rv_;
};

}  // namespace seqpar::backend::inproc::detail
