// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "seqpar/backend/inproc/detail/comm_state.hpp"
#include "seqpar/backend/inproc/detail/world_state.hpp"
#include "seqpar/backend/inproc/memory.hpp"
#include "seqpar/backend/inproc/transport.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/timeout.hpp"

namespace seqpar::backend::inproc {

/// An in-process "cluster": `run(fn)` starts n std::threads, calls `fn(transport)` on each with
/// the `Transport` of rank i of n, and joins them. The transport for tests, examples and laptops;
/// every strategy runs on it unchanged.
///
/// Failure semantics (DESIGN.md invariant 3: a failing rank makes its peers fail, never hang):
///  - if a rank throws, the world is marked failed with that rank and message; every rank blocked
///    in a receive, wait or collective (and every later operation) throws
///    `seqpar::Error(Errc::kPeerFailed, "rank R failed: <what>")`;
///  - a rank blocked longer than `Options::timeout` throws `Errc::kTimeout` naming itself, the
///    operation and the peer(s), which fails the world in turn;
///  - after joining, `run` rethrows the first exception that left a rank (the root cause, with
///    its original type), not the kPeerFailed echoes;
///  - a rank still running `Options::stuck_grace` after another failed is stuck outside the
///    transport (a kernel in an endless loop: every transport wait is bounded). A thread cannot be
///    cancelled, and returning would leave it running on the caller's dead stack frame, so `run`
///    prints which ranks are stuck and calls std::abort() instead of waiting forever.
/// Each `run` starts from a fresh state (mailboxes, failure), so a World can be run repeatedly.
/// Cost: n thread creations per run; `fn` is called concurrently from n threads.
///
/// @code
/// using namespace seqpar::backend::inproc;
/// World(4, {.timeout = std::chrono::seconds(10)}).run([](Transport& t) {
///   int token = t.rank();
///   if (t.rank() == 0) t.send(std::as_bytes(std::span(&token, 1)), 1, /*tag=*/0);
///   if (t.rank() == 1) t.recv(std::as_writable_bytes(std::span(&token, 1)), 0, 0);
///   t.barrier();
/// });
/// @endcode
class World {
 public:
  struct Options {
    /// Longest a rank may block in one operation before it throws Errc::kTimeout.
    /// Default 30 s, or the environment variable SEQPAR_TIMEOUT_S (seconds) when set (core/timeout.hpp).
    std::chrono::milliseconds timeout{seqpar::detail::default_timeout()};
    /// Where payloads live and how they are copied (host memory and std::memcpy by default).
    Memory memory{};
    /// After a rank failed, how long `run` waits for the others before it reports the stuck ones
    /// and aborts the process (0: max(2 x timeout, 10 s)). Ranks blocked in the transport are
    /// released at once or within `timeout`; only a rank stuck outside it is ever waited this long.
    std::chrono::milliseconds stuck_grace{0};
  };

  explicit World(int n) : World(n, Options{}) {}
  World(int n, Options options) : size_(n), options_(options) {
    seqpar::detail::require(n >= 1, "inproc::World", "n", n, "must be >= 1");
    options_.timeout = seqpar::detail::checked_timeout("inproc::World", "options.timeout", options.timeout);
    seqpar::detail::require(options.stuck_grace.count() >= 0, "inproc::World", "options.stuck_grace",
                            std::to_string(options.stuck_grace.count()) + " ms", "must be >= 0 (0: the default)");
    options_.stuck_grace = std::min(options.stuck_grace, seqpar::detail::kLongestTimeout);
    const Memory& m = options.memory;
    seqpar::detail::require(m.copy != nullptr && m.allocate != nullptr && m.release != nullptr, "inproc::World",
                            "options.memory", "a null function", "copy, allocate and release must be set");
  }

  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] const Options& options() const noexcept { return options_; }

  /// Runs `fn(Transport&)` on size() threads, rank i on thread i; returns when all have
  /// finished; rethrows the root-cause exception if any rank threw.
  template <class F>
  requires std::invocable<F&, Transport&>
  void run(F&& fn) {
    auto world = std::make_shared<detail::WorldState>(options_.timeout, options_.memory);
    std::vector<int> ranks(static_cast<std::size_t>(size_));
    std::iota(ranks.begin(), ranks.end(), 0);
    const auto comm = detail::CommState::create(world, std::move(ranks));
    std::vector<std::thread> threads;
    threads.reserve(static_cast<std::size_t>(size_));
    Running running(size_);
    try {
      for (int r = 0; r < size_; ++r) {
        threads.emplace_back([&fn, &world, &comm, &running, r] {
          try {
            Transport transport(comm, r);
            std::invoke(fn, transport);
          } catch (...) {
            world->fail(r, std::current_exception());
          }
          running.finished(r);
        });
      }
    } catch (...) {
      // Could not start every rank: release the started ones, then report why.
      world->fail(-1, std::current_exception());
      for (int r = static_cast<int>(threads.size()); r < size_; ++r) running.finished(r);
    }
    const auto grace = options_.stuck_grace.count() > 0
                           ? options_.stuck_grace
                           : std::max<std::chrono::milliseconds>(2 * options_.timeout, std::chrono::seconds(10));
    running.wait(*world, grace);
    for (auto& t : threads) t.join();
    if (const std::exception_ptr error = world->first_error()) std::rethrow_exception(error);
  }

 private:
  // Which rank threads have returned, so that run can tell a slow world from a stuck rank.
  class Running {
   public:
    explicit Running(int n) : done_(static_cast<std::size_t>(n), false), left_(n) {}
    void finished(int r) {
      std::lock_guard lock(mu_);
      done_[static_cast<std::size_t>(r)] = true;
      --left_;
      cv_.notify_all();
    }
    // Returns when every rank has returned; aborts when some rank failed and others are still
    // running `grace` later.
    void wait(const detail::WorldState& world, std::chrono::milliseconds grace) {
      using clock = std::chrono::steady_clock;
      std::unique_lock lock(mu_);
      std::optional<clock::time_point> failed_at;
      while (left_ > 0) {
        cv_.wait_for(lock, std::chrono::milliseconds(20));
        if (left_ == 0) break;
        if (!failed_at && world.failed()) failed_at = clock::now();
        if (failed_at && clock::now() - *failed_at > grace) {
          std::string stuck;
          for (std::size_t r = 0; r < done_.size(); ++r)
            if (!done_[r]) stuck += (stuck.empty() ? "" : ", ") + std::to_string(r);
          std::fprintf(stderr,
                       "seqpar: inproc::World: rank(s) %s still running %lld ms after a rank failed (stuck outside "
                       "the transport, e.g. in a kernel); a thread cannot be cancelled: aborting\n",
                       stuck.c_str(), static_cast<long long>(grace.count()));
          std::fflush(stderr);
          std::abort();
        }
      }
    }

   private:
    std::mutex mu_;
    std::condition_variable cv_;
    std::vector<bool> done_;
    int left_;
  };

  int size_;
  Options options_;
};

}  // namespace seqpar::backend::inproc
