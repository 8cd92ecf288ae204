// SPDX-License-Identifier: Apache-2.0
#include <doctest/doctest.h>

#include "support/expect_error.hpp"

#include <seqpar/backend/inproc/world.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <numeric>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using seqpar::Errc;
using seqpar::backend::inproc::Transport;
using seqpar::backend::inproc::World;
using namespace std::chrono_literals;

namespace {

constexpr std::array kWorldSizes{1, 2, 3, 4, 8};

// Payload byte i of the block rank `src` sends to rank `dst`: any misrouted or shifted byte shows.
std::byte code(int src, int dst, std::size_t i) {
  const auto h = static_cast<std::uint32_t>(src) * 2654435761u ^ static_cast<std::uint32_t>(dst) * 40503u ^
                 static_cast<std::uint32_t>(i) * 2246822519u;
  return static_cast<std::byte>((h >> 13) ^ (h >> 5) ^ static_cast<std::uint32_t>(i));
}

std::vector<std::byte> block(int src, int dst, std::size_t bytes) {
  std::vector<std::byte> b(bytes);
  for (std::size_t i = 0; i < bytes; ++i) b[i] = code(src, dst, i);
  return b;
}

std::span<const std::byte> cbytes(const std::vector<std::byte>& v) {
  return {v.data(), v.size()};
}
std::span<std::byte> wbytes(std::vector<std::byte>& v) {
  return {v.data(), v.size()};
}

// Collects CHECK failures from rank threads (doctest assertions are not thread-safe).
class Failures {
 public:
  void expect(bool ok, const std::string& what) {
    if (ok) return;
    std::lock_guard lock(mutex_);
    messages_.push_back(what);
  }
  void check() const {
    for (const auto& m : messages_) FAIL_CHECK(m);
    CHECK(messages_.empty());
  }

 private:
  std::mutex mutex_;
  std::vector<std::string> messages_;
};

std::string at(int rank, const std::string& what) {
  return "rank " + std::to_string(rank) + ": " + what;
}

// Counters must equal exactly the bytes this rank sent to other ranks.
void expect_counters(Failures& f, const Transport& t, const std::vector<std::uint64_t>& to_peer,
                     std::uint64_t messages) {
  const auto& c = t.counters();
  f.expect(c.bytes_to_peer == to_peer, at(t.rank(), "bytes_to_peer"));
  f.expect(c.bytes_sent == std::accumulate(to_peer.begin(), to_peer.end(), std::uint64_t{0}),
           at(t.rank(), "bytes_sent"));
  f.expect(c.messages_sent == messages, at(t.rank(), "messages_sent = " + std::to_string(c.messages_sent)));
}

struct Boom : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Runs `world.run(fn)`, expects it to rethrow Boom("boom") and returns the elapsed time.
template <class F>
std::chrono::milliseconds expect_boom(World world, F&& fn) {
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(world.run(fn), "boom", Boom);
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
}

using seqpar::test::invalid_message;

// A World::Options::memory that counts what goes through it (the device world's shape, on the host).
namespace counting {
std::atomic<std::uint64_t> copied{0}, fences{0}, live{0}, allocations{0};
void copy(std::byte* to, const std::byte* from, std::size_t bytes) {
  copied += bytes;
  std::memcpy(to, from, bytes);
}
void fence() {
  ++fences;
}
void* allocate(std::size_t bytes) {
  ++live, ++allocations;
  return ::operator new(bytes);
}
void release(void* p) noexcept {
  --live;
  ::operator delete(p);
}
}  // namespace counting

}  // namespace

TEST_SUITE("backend") {
  TEST_CASE("inproc: send/recv keeps per-tag order, tags do not mix, sizes are checked") {
    Failures f;
    World(2).run([&](Transport& t) {
      f.expect(t.size() == 2 && t.world_rank() == t.rank(), "size/world_rank");
      if (t.rank() == 0) {
        for (int i = 0; i < 3; ++i) {
          t.send(cbytes(block(0, 1, 8 + static_cast<std::size_t>(i))), 1, /*tag=*/1);
          t.send(cbytes(block(0, 100 + i, 4)), 1, /*tag=*/2);
        }
        t.send({}, 1, 3);  // empty messages are messages
        // Self-send is eager, so it cannot deadlock, and it is not traffic.
        t.send(cbytes(block(0, 0, 5)), 0, 0);
        std::vector<std::byte> self(5);
        t.recv(wbytes(self), 0, 0);
        f.expect(self == block(0, 0, 5), "self message");
        expect_counters(f, t, {0, 3 * 8 + 3 + 3 * 4}, 7);
      } else {
        // Tag 2 first: the tag-1 messages wait in their own channel, in order.
        for (int i = 0; i < 3; ++i) {
          std::vector<std::byte> b(4);
          t.recv(wbytes(b), 0, 2);
          f.expect(b == block(0, 100 + i, 4), "tag 2 message " + std::to_string(i));
        }
        for (int i = 0; i < 3; ++i) {
          std::vector<std::byte> b(8 + static_cast<std::size_t>(i));
          t.recv(wbytes(b), 0, 1);
          f.expect(b == block(0, 1, b.size()), "tag 1 message " + std::to_string(i));
        }
        t.recv({}, 0, 3);
        expect_counters(f, t, {0, 0}, 0);
      }
    });
    f.check();

    // A message of the wrong size is a protocol error naming both sizes; the world fails.
    std::string what;
    try {
      World(2, {.timeout = 5s}).run([](Transport& t) {
        std::vector<std::byte> b(t.rank() == 0 ? 12 : 16);
        if (t.rank() == 0) t.send(cbytes(b), 1, 0);
        if (t.rank() == 1) t.recv(wbytes(b), 0, 0);
      });
    } catch (const seqpar::Error& e) {
      CHECK(e.errc() == Errc::kProtocol);
      what = e.what();
    }
    CHECK(what.find("12 bytes") != std::string::npos);
    CHECK(what.find("16 bytes") != std::string::npos);
  }

  TEST_CASE("inproc: isend/irecv ring exchange; receives match in post order") {
    for (const int n : kWorldSizes) {
      CAPTURE(n);
      Failures f;
      World(n).run([&](Transport& t) {
        const int right = (t.rank() + 1) % n, left = (t.rank() + n - 1) % n;
        const std::size_t bytes = 64 + static_cast<std::size_t>(t.rank());
        std::vector<std::byte> in(64 + static_cast<std::size_t>(left));
        const auto out = block(t.rank(), right, bytes);
        auto r = t.irecv(wbytes(in), left, 7);
        f.expect(r.pending(), "irecv pending");
        auto s = t.isend(cbytes(out), right, 7);
        t.wait(s);
        t.wait(r);
        f.expect(!r.pending(), "irecv done");
        t.wait(r);  // waiting on an empty request is a no-op
        f.expect(in == block(left, t.rank(), in.size()), at(t.rank(), "ring payload"));
        std::vector<std::uint64_t> to_peer(static_cast<std::size_t>(n), 0);
        if (right != t.rank()) to_peer[static_cast<std::size_t>(right)] = bytes;
        expect_counters(f, t, to_peer, right != t.rank() ? 1 : 0);
      });
      f.check();
    }

    Failures f;
    World(2).run([&](Transport& t) {
      if (t.rank() == 0) {
        for (int i = 0; i < 3; ++i) t.send(cbytes(block(0, i, 3)), 1, 0);
      } else {
        std::vector<std::byte> a(3), b(3), c(3);
        auto ra = t.irecv(wbytes(a), 0, 0);
        auto rb = t.irecv(wbytes(b), 0, 0);
        t.recv(wbytes(c), 0, 0);  // posted third: gets the third message
        auto moved = std::move(rb);
        t.wait(moved);
        t.wait(ra);
        f.expect(a == block(0, 0, 3) && b == block(0, 1, 3) && c == block(0, 2, 3), "post order");
      }
    });
    f.check();
  }

  TEST_CASE("inproc: all_to_all round trip, world sizes 1..8, zero-size blocks") {
    for (const int n : kWorldSizes) {
      for (const std::size_t blk : {std::size_t{0}, std::size_t{1}, std::size_t{37}, std::size_t{4096}}) {
        CAPTURE(n);
        CAPTURE(blk);
        Failures f;
        World(n).run([&](Transport& t) {
          const auto un = static_cast<std::size_t>(n);
          std::vector<std::byte> s, r(un * blk), back(un * blk);
          for (int dst = 0; dst < n; ++dst) {
            const auto b = block(t.rank(), dst, blk);
            s.insert(s.end(), b.begin(), b.end());
          }
          t.all_to_all(cbytes(s), wbytes(r));
          bool ok = true;
          for (int src = 0; src < n; ++src)
            for (std::size_t i = 0; i < blk; ++i)
              ok = ok && r[static_cast<std::size_t>(src) * blk + i] == code(src, t.rank(), i);
          f.expect(ok, at(t.rank(), "all_to_all payload"));
          t.all_to_all(cbytes(r), wbytes(back));  // the transpose of the transpose
          f.expect(back == s, at(t.rank(), "all_to_all round trip"));
          std::vector<std::uint64_t> to_peer(un, 2 * blk);
          to_peer[static_cast<std::size_t>(t.rank())] = 0;
          expect_counters(f, t, to_peer, blk == 0 ? 0 : 2 * (un - 1));
        });
        f.check();
      }
    }
  }

  TEST_CASE("inproc: all_to_all_v with uneven and zero counts") {
    // Rank src sends count(src, dst) bytes to rank dst; a third of the pairs send nothing.
    const auto count = [](int src, int dst) {
      return static_cast<std::size_t>((src * 7 + dst * 5) % 3 * (3 + src + 2 * dst));
    };
    for (const int n : kWorldSizes) {
      CAPTURE(n);
      Failures f;
      World(n).run([&](Transport& t) {
        const auto un = static_cast<std::size_t>(n);
        std::vector<std::size_t> sc(un), rc(un);
        std::vector<std::byte> s;
        for (int p = 0; p < n; ++p) {
          sc[static_cast<std::size_t>(p)] = count(t.rank(), p);
          rc[static_cast<std::size_t>(p)] = count(p, t.rank());
          const auto b = block(t.rank(), p, sc[static_cast<std::size_t>(p)]);
          s.insert(s.end(), b.begin(), b.end());
        }
        std::vector<std::byte> r(std::accumulate(rc.begin(), rc.end(), std::size_t{0}));
        t.all_to_all_v(cbytes(s), sc, wbytes(r), rc);
        std::vector<std::byte> want;
        for (int p = 0; p < n; ++p) {
          const auto b = block(p, t.rank(), rc[static_cast<std::size_t>(p)]);
          want.insert(want.end(), b.begin(), b.end());
        }
        f.expect(r == want, at(t.rank(), "all_to_all_v payload"));
        std::vector<std::byte> back(s.size());
        t.all_to_all_v(cbytes(r), rc, wbytes(back), sc);
        f.expect(back == s, at(t.rank(), "all_to_all_v round trip"));
        std::vector<std::uint64_t> to_peer(un, 0);
        std::uint64_t messages = 0;
        for (int p = 0; p < n; ++p) {
          if (p == t.rank()) continue;
          to_peer[static_cast<std::size_t>(p)] = sc[static_cast<std::size_t>(p)] + rc[static_cast<std::size_t>(p)];
          messages += (sc[static_cast<std::size_t>(p)] != 0) + (rc[static_cast<std::size_t>(p)] != 0);
        }
        expect_counters(f, t, to_peer, messages);
      });
      f.check();
    }
  }

  TEST_CASE("inproc: all_gather and all_gather_v") {
    for (const int n : kWorldSizes) {
      CAPTURE(n);
      Failures f;
      World(n).run([&](Transport& t) {
        const auto un = static_cast<std::size_t>(n);
        const auto mine = block(t.rank(), -1, 24);
        std::vector<std::byte> r(un * 24);
        t.all_gather(cbytes(mine), wbytes(r));
        std::vector<std::byte> want;
        for (int p = 0; p < n; ++p) {
          const auto b = block(p, -1, 24);
          want.insert(want.end(), b.begin(), b.end());
        }
        f.expect(r == want, at(t.rank(), "all_gather"));

        // Rank p contributes 5 * p bytes (rank 0: nothing).
        std::vector<std::size_t> counts(un);
        for (int p = 0; p < n; ++p) counts[static_cast<std::size_t>(p)] = 5 * static_cast<std::size_t>(p);
        const auto v = block(t.rank(), -2, counts[static_cast<std::size_t>(t.rank())]);
        std::vector<std::byte> rv(std::accumulate(counts.begin(), counts.end(), std::size_t{0}));
        t.all_gather_v(cbytes(v), wbytes(rv), counts);
        want.clear();
        for (int p = 0; p < n; ++p) {
          const auto b = block(p, -2, counts[static_cast<std::size_t>(p)]);
          want.insert(want.end(), b.begin(), b.end());
        }
        f.expect(rv == want, at(t.rank(), "all_gather_v"));
        std::vector<std::uint64_t> to_peer(un, 24 + v.size());
        to_peer[static_cast<std::size_t>(t.rank())] = 0;
        expect_counters(f, t, to_peer, (un - 1) * (v.empty() ? 1 : 2));
      });
      f.check();
    }
  }

  TEST_CASE("inproc: back-to-back collectives with changing sizes and fresh buffers") {
    // Each iteration frees its buffers on return: a rank that returned before its peers finished
    // reading would hand them freed or overwritten memory (ASan / payload check).
    Failures f;
    World(4).run([&](Transport& t) {
      for (int it = 0; it < 150; ++it) {
        const std::size_t blk = static_cast<std::size_t>(it * 7 % 13);
        std::vector<std::byte> s, r(4 * blk);
        for (int dst = 0; dst < 4; ++dst) {
          const auto b = block(t.rank() + 10 * it, dst, blk);
          s.insert(s.end(), b.begin(), b.end());
        }
        if (t.rank() == it % 4) std::this_thread::yield();
        t.all_to_all(cbytes(s), wbytes(r));
        bool ok = true;
        for (int src = 0; src < 4; ++src)
          for (std::size_t i = 0; i < blk; ++i)
            ok = ok && r[static_cast<std::size_t>(src) * blk + i] == code(src + 10 * it, t.rank(), i);
        f.expect(ok, at(t.rank(), "iteration " + std::to_string(it)));
      }
    });
    f.check();
  }

  TEST_CASE("inproc: barrier separates phases") {
    for (const int n : kWorldSizes) {
      CAPTURE(n);
      Failures f;
      std::atomic<int> arrived{0};
      World(n).run([&](Transport& t) {
        for (int round = 1; round <= 20; ++round) {
          if ((t.rank() + round) % 3 == 0) std::this_thread::yield();
          arrived.fetch_add(1);
          t.barrier();
          f.expect(arrived.load() == round * n, at(t.rank(), "barrier let a rank through early"));
          t.barrier();
        }
        expect_counters(f, t, std::vector<std::uint64_t>(static_cast<std::size_t>(n), 0), 0);
      });
      f.check();
    }
  }

  TEST_CASE("inproc: split into groups; collectives and messages of different groups never mix") {
    Failures f;
    World(8).run([&](Transport& t) {
      const int color = t.rank() % 2;
      // Key reverses the order: even group = world ranks {6, 4, 2, 0}, odd = {7, 5, 3, 1}.
      Transport g = t.split(color, -t.rank());
      f.expect(g.size() == 4, at(t.rank(), "group size"));
      f.expect(g.rank() == (7 - t.rank()) / 2, at(t.rank(), "group rank follows the key"));
      f.expect(g.world_rank() == t.rank(), at(t.rank(), "world_rank"));

      // Different sizes per group: a mixed-up rendezvous would fail a size check or the payload.
      const std::size_t blk = color == 0 ? 3 : 11;
      std::vector<std::byte> s, r(4 * blk);
      for (int dst = 0; dst < 4; ++dst) {
        const auto b = block(100 * color + g.rank(), dst, blk);
        s.insert(s.end(), b.begin(), b.end());
      }
      g.all_to_all(cbytes(s), wbytes(r));
      bool ok = true;
      for (int src = 0; src < 4; ++src)
        for (std::size_t i = 0; i < blk; ++i)
          ok = ok && r[static_cast<std::size_t>(src) * blk + i] == code(100 * color + src, g.rank(), i);
      f.expect(ok, at(t.rank(), "group all_to_all"));

      const int wr = t.rank();
      std::vector<int> members(4);
      g.all_gather(std::as_bytes(std::span(&wr, 1)), std::as_writable_bytes(std::span(members)));
      f.expect(members == (color == 0 ? std::vector<int>{6, 4, 2, 0} : std::vector<int>{7, 5, 3, 1}),
               at(t.rank(), "group all_gather order"));

      // Same (peer number, tag) on parent and group: the messages stay in their communicator.
      const auto on_parent = block(t.rank(), 1000, 6);
      const auto on_group = block(t.rank(), 2000, 6);
      g.send(cbytes(on_group), (g.rank() + 1) % 4, 0);
      t.send(cbytes(on_parent), (t.rank() + 1) % 8, 0);
      std::vector<std::byte> from_parent(6), from_group(6);
      t.recv(wbytes(from_parent), (t.rank() + 7) % 8, 0);
      g.recv(wbytes(from_group), (g.rank() + 3) % 4, 0);
      f.expect(from_parent == block((t.rank() + 7) % 8, 1000, 6), at(t.rank(), "parent message"));
      f.expect(from_group == block(members[static_cast<std::size_t>((g.rank() + 3) % 4)], 2000, 6),
               at(t.rank(), "group message"));

      // Counters are per object and indexed by that object's ranks.
      std::vector<std::uint64_t> group_to_peer(4, blk + sizeof(int));
      group_to_peer[static_cast<std::size_t>(g.rank())] = 0;
      group_to_peer[static_cast<std::size_t>((g.rank() + 1) % 4)] += 6;
      expect_counters(f, g, group_to_peer, 3 + 3 + 1);
      std::vector<std::uint64_t> parent_to_peer(8, 0);
      parent_to_peer[static_cast<std::size_t>((t.rank() + 1) % 8)] = 6;
      expect_counters(f, t, parent_to_peer, 1);

      // Split of a split, and a singleton group.
      Transport pair = g.split(g.rank() / 2, g.rank());
      f.expect(pair.size() == 2 && pair.rank() == g.rank() % 2, at(t.rank(), "nested split"));
      int sum = 0;
      std::vector<int> both(2);
      pair.all_gather(std::as_bytes(std::span(&wr, 1)), std::as_writable_bytes(std::span(both)));
      sum = both[0] + both[1];
      const int partner = members[static_cast<std::size_t>(g.rank() ^ 1)];
      f.expect(sum == wr + partner, at(t.rank(), "nested all_gather"));
      Transport alone = t.split(t.rank(), 0);
      f.expect(alone.size() == 1 && alone.rank() == 0, at(t.rank(), "singleton split"));
      alone.barrier();
      t.barrier();
    });
    f.check();
  }

  TEST_CASE("inproc: a rank that throws releases peers blocked in recv, wait, all_to_all, barrier") {
    // Rank 1 throws after the others are blocked; they must get kPeerFailed naming rank 1 well
    // before the (backstop) timeout, and run() rethrows rank 1's own exception.
    struct Seen {
      std::mutex mutex;
      std::vector<std::string> messages;
      int peer_failed = 0;
    };
    const auto body = [](Seen& seen, int op) {
      return [&seen, op](Transport& t) {
        if (t.rank() == 1) {
          std::this_thread::sleep_for(50ms);
          throw Boom("boom");
        }
        try {
          std::vector<std::byte> b(static_cast<std::size_t>(4 * t.size())), r(b.size());
          if (op == 0) t.recv(wbytes(b), 1, 0);
          if (op == 1) {
            auto req = t.irecv(wbytes(b), 1, 0);
            t.wait(req);
          }
          if (op == 2) t.all_to_all(cbytes(b), wbytes(r));
          if (op == 3) t.barrier();
          if (op == 4) {  // blocked in split, which rank 1 never enters
            Transport everyone = t.split(0, t.rank());
            everyone.barrier();
          }
        } catch (const seqpar::Error& e) {
          std::lock_guard lock(seen.mutex);
          seen.messages.emplace_back(e.what());
          seen.peer_failed += e.errc() == Errc::kPeerFailed;
          throw;
        }
      };
    };
    for (int op = 0; op < 4; ++op) {
      CAPTURE(op);
      Seen seen;
      const auto elapsed = expect_boom(World(4, {.timeout = 10s}), body(seen, op));
      CHECK(elapsed < 5s);
      CHECK(seen.peer_failed == 3);
      for (const auto& m : seen.messages) CHECK(m.find("rank 1 failed: boom") != std::string::npos);
    }
    {
      // Rank 1 never enters split: the others are released from it.
      Seen seen;
      const auto elapsed = expect_boom(World(3, {.timeout = 10s}), body(seen, 4));
      CHECK(elapsed < 5s);
      CHECK(seen.peer_failed == 2);
    }
    {
      // Failure inside a sub-communicator while the other group waits in the parent.
      Seen seen;
      const auto elapsed = expect_boom(World(4, {.timeout = 10s}), [&](Transport& t) {
        Transport g = t.split(t.rank() % 2, t.rank());
        if (t.rank() == 1) {
          g.barrier();  // never completes: its peer (rank 3) waits in the parent
          throw Boom("unreachable");
        }
        try {
          if (t.rank() == 3) {
            std::this_thread::sleep_for(20ms);
            throw Boom("boom");
          }
          t.barrier();
        } catch (const seqpar::Error& e) {
          std::lock_guard lock(seen.mutex);
          seen.peer_failed +=
              e.errc() == Errc::kPeerFailed && std::string(e.what()).find("rank 3 failed") != std::string::npos;
          throw;
        }
      });
      CHECK(elapsed < 5s);
      CHECK(seen.peer_failed == 2);
    }
    // The world runs again after a failure, from a clean state.
    int ran = 0;
    std::mutex m;
    World w(3);
    for (int i = 0; i < 2; ++i) {
      w.run([&](Transport& t) {
        t.barrier();
        std::lock_guard lock(m);
        ++ran;
      });
    }
    CHECK(ran == 6);
  }

  TEST_CASE("inproc: a peer that never sends times out naming rank, operation and peer") {
    const auto run_expect_timeout = [](auto&& fn) {
      std::string what;
      Errc errc{};
      const auto start = std::chrono::steady_clock::now();
      try {
        World(3, {.timeout = 200ms}).run(fn);
      } catch (const seqpar::Error& e) {
        errc = e.errc();
        what = e.what();
      }
      const auto elapsed = std::chrono::steady_clock::now() - start;
      CHECK(errc == Errc::kTimeout);
      CHECK(elapsed >= 200ms);
      CHECK(elapsed < 3s);
      return what;
    };
    const std::string recv_what = run_expect_timeout([](Transport& t) {
      if (t.rank() != 0) return;  // ranks 1 and 2 finish without sending
      std::vector<std::byte> b(4);
      t.recv(wbytes(b), 2, 5);
    });
    CAPTURE(recv_what);
    CHECK(recv_what.find("rank 0") != std::string::npos);
    CHECK(recv_what.find("recv from rank 2") != std::string::npos);
    CHECK(recv_what.find("tag 5") != std::string::npos);

    const std::string barrier_what = run_expect_timeout([](Transport& t) {
      if (t.rank() == 1) return;  // never enters the barrier
      t.barrier();
    });
    CAPTURE(barrier_what);
    CHECK(barrier_what.find("barrier") != std::string::npos);
    // Rank 1 is missing; rank 0 or 2 may already have given up too (it times out as well).
    CHECK((barrier_what.find("waiting for rank(s) 1 to") != std::string::npos ||
           barrier_what.find("waiting for rank(s) 0, 1 to") != std::string::npos ||
           barrier_what.find("waiting for rank(s) 1, 2 to") != std::string::npos));
  }

  TEST_CASE("inproc: ranks that disagree get kProtocol, not garbage") {
    const auto protocol_what = [](auto&& fn) {
      std::string what;
      try {
        World(2, {.timeout = 5s}).run(fn);
      } catch (const seqpar::Error& e) {
        CHECK(e.errc() == Errc::kProtocol);
        what = e.what();
      }
      CHECK(!what.empty());
      return what;
    };
    CHECK(protocol_what([](Transport& t) {
            if (t.rank() == 0) t.barrier();
            std::vector<std::byte> s(4), r(8);
            if (t.rank() == 1) t.all_gather(cbytes(s), wbytes(r));
          }).find("barrier") != std::string::npos);
    CHECK(protocol_what([](Transport& t) {
            const std::vector<std::size_t> sc{2, 2}, rc{2, t.rank() == 0 ? std::size_t{3} : std::size_t{2}};
            std::vector<std::byte> s(4), r(rc[0] + rc[1]);
            t.all_to_all_v(cbytes(s), sc, wbytes(r), rc);
          }).find("all_to_all_v") != std::string::npos);
    protocol_what([](Transport& t) {
      std::vector<std::byte> s(t.rank() == 0 ? 4 : 6), r(s.size());
      t.all_to_all(cbytes(s), wbytes(r));
    });
  }

  TEST_CASE("inproc: every payload byte goes through World::Options::memory, mailbox buffers too") {
    constexpr int kRanks = 4;
    constexpr std::size_t kMessage = 100;
    counting::copied = counting::fences = counting::live = counting::allocations = 0;
    seqpar::backend::inproc::Memory memory;
    memory.copy = &counting::copy;
    memory.fence = &counting::fence;
    memory.allocate = &counting::allocate;
    memory.release = &counting::release;
    Failures f;
    World(kRanks, {.timeout = 10s, .memory = memory}).run([&](Transport& t) {
      const int me = t.rank(), next = (me + 1) % kRanks, prev = (me + kRanks - 1) % kRanks;
      // A ring of sends: each message copied into the receiver's mailbox and out of it.
      const auto out = block(me, next, kMessage);
      std::vector<std::byte> in(kMessage);
      t.send(cbytes(out), next, 1);
      t.recv(wbytes(in), prev, 1);
      f.expect(in == block(prev, me, kMessage), at(me, "ring message"));
      // all_to_all_v: (src + 1) * 10 bytes from every src to every dst, self included.
      std::vector<std::size_t> sc(kRanks, static_cast<std::size_t>(me + 1) * 10), rc(kRanks);
      std::vector<std::byte> s, r;
      for (int dst = 0; dst < kRanks; ++dst) {
        const auto b = block(me, dst, sc[0]);
        s.insert(s.end(), b.begin(), b.end());
        rc[static_cast<std::size_t>(dst)] = static_cast<std::size_t>(dst + 1) * 10;
      }
      r.resize(std::accumulate(rc.begin(), rc.end(), std::size_t{0}));
      t.all_to_all_v(cbytes(s), sc, wbytes(r), rc);
      std::size_t at_byte = 0;
      for (int src = 0; src < kRanks; ++src) {
        const auto want = block(src, me, rc[static_cast<std::size_t>(src)]);
        f.expect(std::equal(want.begin(), want.end(), r.begin() + static_cast<std::ptrdiff_t>(at_byte)),
                 at(me, "all_to_all_v block from " + std::to_string(src)));
        at_byte += want.size();
      }
      t.barrier();
    });
    f.check();
    // 4 messages x 2 copies x 100 bytes, and every all_to_all_v block once: 4 x 10 x (1 + 2 + 3 + 4).
    CHECK(counting::copied == kRanks * 2 * kMessage + kRanks * 10 * (1 + 2 + 3 + 4));
    CHECK(counting::fences >= 2 * kRanks + kRanks);  // a send, a receive, a collective: each completes its copies
    CHECK(counting::allocations > 0);
    CHECK(counting::live == 0);  // every mailbox buffer went back when the world ended
    seqpar::backend::inproc::Memory no_copy;
    no_copy.copy = nullptr;
    CHECK(invalid_message([&] { World(2, {.memory = no_copy}); }).find("options.memory") != std::string::npos);
  }

  TEST_CASE("inproc: bad arguments throw std::invalid_argument naming the argument and value") {
    CHECK(invalid_message([] { World(0); }).find("n = 0") != std::string::npos);
    CHECK(invalid_message([] { World(2, {.timeout = 0ms}); }).find("timeout") != std::string::npos);
    std::mutex m;
    std::vector<std::string> messages;
    // Every rank makes the same bad call, so nobody waits for a peer that already left.
    World(2, {.timeout = 5s}).run([&](Transport& t) {
      std::vector<std::byte> s(6), r(6), big(8);
      const std::vector<std::size_t> two{3, 3}, three{2, 2, 2}, short_sum{1, 1};
      const std::vector<std::string> got{
          invalid_message([&] { t.send(cbytes(s), 2, 0); }),
          invalid_message([&] { t.recv(wbytes(r), -1, 0); }),
          invalid_message([&] { t.send(cbytes(s), 1, -3); }),
          invalid_message([&] { (void)t.irecv(wbytes(r), 5, 0); }),
          invalid_message([&] { t.all_to_all(cbytes(s), wbytes(big)); }),
          invalid_message([&] { t.all_to_all(std::span(s).first(5), std::span(r).first(5)); }),
          invalid_message([&] { t.all_to_all(cbytes(s), std::span(s)); }),
          invalid_message([&] { t.all_to_all_v(cbytes(s), three, wbytes(r), two); }),
          invalid_message([&] { t.all_to_all_v(cbytes(s), two, wbytes(r), short_sum); }),
          invalid_message([&] { t.all_gather(cbytes(s), wbytes(r)); }),
          invalid_message([&] { t.all_gather_v(std::span(s).first(2), wbytes(r), two); }),
          invalid_message([&] { (void)t.split(-1, 0); }),
      };
      std::lock_guard lock(m);
      messages.insert(messages.end(), got.begin(), got.end());
    });
    REQUIRE(messages.size() == 24);
    const std::vector<std::string> want{"peer = 2",
                                        "peer = -1",
                                        "tag = -3",
                                        "peer = 5",
                                        "r.size() = 8",
                                        "s.size() = 5",
                                        "overlaps s",
                                        "send_counts.size() = 3",
                                        "sum(recv_counts) = 2",
                                        "r.size() = 6",
                                        "recv_counts[",
                                        "color = -1"};
    for (std::size_t i = 0; i < messages.size(); ++i) {
      CAPTURE(messages[i]);
      CHECK(messages[i].find(want[i % want.size()]) != std::string::npos);
    }
  }
}
