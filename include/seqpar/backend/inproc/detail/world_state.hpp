// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "seqpar/backend/inproc/memory.hpp"
#include "seqpar/core/error.hpp"

namespace seqpar::backend::inproc::detail {

using Clock = std::chrono::steady_clock;

/// Something that threads block on and that must be woken when the world fails
/// (a communicator's mailboxes and rendezvous).
class Wakeable {
 public:
  virtual void wake_all() noexcept = 0;

 protected:
  ~Wakeable() = default;
};

/// State shared by every rank and every communicator of one World::run: the timeout, the memory the
/// payloads live in, and the failure record (first failing rank, its message and its exception).
///
/// Lock order: WorldState::mutex_ is never held while a communicator's mutex is taken, so a
/// waiter may read the failure record (immutable once failed() is true) under its own lock.
class WorldState {
 public:
  explicit WorldState(std::chrono::milliseconds timeout, Memory memory = {}) : timeout_(timeout), memory_(memory) {}

  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  [[nodiscard]] const Memory& memory() const noexcept { return memory_; }
  [[nodiscard]] Clock::time_point deadline() const noexcept { return Clock::now() + timeout_; }

  [[nodiscard]] bool failed() const noexcept { return failed_.load(std::memory_order_acquire); }

  /// Records the first failure (later ones are echoes or secondary) and wakes every waiter.
  void fail(int world_rank, std::exception_ptr error) noexcept {
    std::vector<std::shared_ptr<Wakeable>> to_wake;
    {
      std::lock_guard lock(mutex_);
      if (failed_.load(std::memory_order_relaxed)) return;
      failed_rank_ = world_rank;
      first_error_ = error;
      try {
        failed_message_ = describe(error);
      } catch (...) {
        failed_message_.clear();
      }
      failed_.store(true, std::memory_order_release);
      to_wake.reserve(registry_.size());
      for (const auto& weak : registry_) {
        if (auto strong = weak.lock()) to_wake.push_back(std::move(strong));
      }
    }
    for (const auto& w : to_wake) w->wake_all();
  }

  /// The exception to rethrow from World::run (null if no rank failed).
  [[nodiscard]] std::exception_ptr first_error() const {
    std::lock_guard lock(mutex_);
    return first_error_;
  }

  /// Throws Errc::kPeerFailed "rank R failed: <message>" if the world has failed.
  void throw_if_failed() const {
    if (failed()) throw_peer_failed();
  }
  [[noreturn]] void throw_peer_failed() const {
    // failed_rank_ and failed_message_ are written once, before the release store of failed_.
    throw Error(Errc::kPeerFailed, "rank " + std::to_string(failed_rank_) + " failed: " + failed_message_);
  }

  /// Registers a communicator to be woken on failure (weakly: it dies with its transports).
  void add(const std::shared_ptr<Wakeable>& w) {
    std::lock_guard lock(mutex_);
    std::erase_if(registry_, [](const std::weak_ptr<Wakeable>& p) { return p.expired(); });
    registry_.push_back(w);
  }

  [[nodiscard]] static std::string describe(const std::exception_ptr& error) {
    if (!error) return "unknown error";
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      return e.what();
    } catch (...) {
      return "non-standard exception";
    }
  }

 private:
  std::chrono::milliseconds timeout_;
  Memory memory_;
  mutable std::mutex mutex_;
  std::atomic<bool> failed_{false};
  int failed_rank_ = -1;
  std::string failed_message_;
  std::exception_ptr first_error_;
  std::vector<std::weak_ptr<Wakeable>> registry_;
};

/// Blocks on `cv` until `ready()`, the world fails (throws kPeerFailed) or `deadline` passes
/// (throws `timeout_error()`, an Error). Before throwing it calls `leave()` with the lock held, so
/// the waiter can withdraw what it posted. `ready` is checked first: an operation that completed
/// wins over a failure that raced with it.
template <class Ready, class Leave, class TimeoutError>
void wait_until_ready(std::unique_lock<std::mutex>& lock, std::condition_variable& cv, const WorldState& world,
                      Clock::time_point deadline, Ready&& ready, Leave&& leave, TimeoutError&& timeout_error) {
  for (;;) {
    if (ready()) return;
    if (world.failed()) {
      leave();
      world.throw_peer_failed();
    }
    if (Clock::now() >= deadline) {
      auto error = timeout_error();  // before leave(): the message describes the state waited on
      leave();
      throw error;
    }
    cv.wait_until(lock, deadline);
  }
}

}  // namespace seqpar::backend::inproc::detail
