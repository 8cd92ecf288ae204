// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <chrono>
#include <concepts>
#include <exception>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "seqpar/backend/inproc/detail/comm_state.hpp"
#include "seqpar/backend/inproc/detail/world_state.hpp"
#include "seqpar/backend/inproc/memory.hpp"
#include "seqpar/backend/inproc/transport.hpp"
#include "seqpar/core/error.hpp"

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
///    its original type), not the kPeerFailed echoes.
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
    std::chrono::milliseconds timeout{std::chrono::seconds{120}};
    /// Where payloads live and how they are copied (host memory and std::memcpy by default).
    Memory memory{};
  };

  explicit World(int n) : World(n, Options{}) {}
  World(int n, Options options) : size_(n), options_(options) {
    seqpar::detail::require(n >= 1, "inproc::World", "n", n, "must be >= 1");
    seqpar::detail::require(options.timeout.count() > 0, "inproc::World", "options.timeout",
                            std::to_string(options.timeout.count()) + " ms", "must be > 0");
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
    try {
      for (int r = 0; r < size_; ++r) {
        threads.emplace_back([&fn, &world, &comm, r] {
          try {
            Transport transport(comm, r);
            std::invoke(fn, transport);
          } catch (...) {
            world->fail(r, std::current_exception());
          }
        });
      }
    } catch (...) {
      // Could not start every rank: release the started ones, then report why.
      world->fail(-1, std::current_exception());
    }
    for (auto& t : threads) t.join();
    if (const std::exception_ptr error = world->first_error()) std::rethrow_exception(error);
  }

 private:
  int size_;
  Options options_;
};

}  // namespace seqpar::backend::inproc
