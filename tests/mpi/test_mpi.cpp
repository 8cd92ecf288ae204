// SPDX-License-Identifier: Apache-2.0
// The MPI transport: the transport-generic cases and strategies (tests/support/transport_cases.hpp,
// the same bodies the in-process world runs), the large-message paths, and failure behaviour (bad
// arguments, timeouts that name the rank, operation and peer). Every rank runs every test case in
// the same order (run under mpirun -np 2, 4, 8; see tests/CMakeLists.txt).
#include <doctest/doctest.h>

#include <seqpar/backend/mpi.hpp>

#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/transport_cases.hpp"

using seqpar::Errc;
using seqpar::backend::mpi::Transport;
using namespace std::chrono_literals;

namespace {

// Long enough for an oversubscribed node, short enough that a bug fails instead of hanging CI.
constexpr Transport::Options kOptions{.timeout = 60s};

void report(const seqpar::test::Failures& f) {
  for (const auto& m : f.messages()) FAIL_CHECK(m);
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_SUITE("mpi") {
  TEST_CASE("mpi: transport cases") {
    Transport t(MPI_COMM_WORLD, kOptions);
    CHECK(t.size() >= 2);
    seqpar::test::Failures f;
    seqpar::test::all_transport_cases(t, f);
    report(f);
  }

  TEST_CASE("mpi: strategies against the fp64 reference") {
    Transport t(MPI_COMM_WORLD, kOptions);
    seqpar::test::Failures f;
    CHECK(seqpar::test::all_strategy_cases(t, f) == seqpar::test::kNumTransportStrategies);
    report(f);
  }

  TEST_CASE("mpi: messages and blocks above the per-call count limit use derived datatypes") {
    Transport::Options small = kOptions;
    small.max_bytes_per_call = 1000;  // stands in for INT_MAX: 4096-byte messages take the large path
    Transport t(MPI_COMM_WORLD, small);
    seqpar::test::Failures f;
    seqpar::test::ring_case(t, f, 4096);
    seqpar::test::all_to_all_case(t, f, {0, 999, 1000, 1001, 4096});
    seqpar::test::all_to_all_v_case(t, f, 4);
    seqpar::test::all_gather_case(t, f);
    report(f);
    // A variable collective whose counts (gcd 1) do not fit the limit is refused before communicating.
    Transport::Options tiny = kOptions;
    tiny.max_bytes_per_call = 16;
    Transport u(MPI_COMM_WORLD, tiny);
    std::vector<std::size_t> sc, rc;
    for (int i = 0; i < u.size(); ++i)
      sc.push_back(17 + static_cast<std::size_t>(i % 2)), rc.push_back(17 + u.rank() % 2);
    std::vector<std::byte> s(17 * sc.size() + sc.size() / 2), r(rc[0] * rc.size());
    CHECK_THROWS_AS(u.all_to_all_v(s, sc, r, rc), std::invalid_argument);
    u.barrier();
  }

  TEST_CASE("mpi: bad arguments throw std::invalid_argument locally") {
    Transport t(MPI_COMM_WORLD, kOptions);
    std::vector<std::byte> b(8);
    CHECK_THROWS_AS(t.send(b, t.size(), 0), std::invalid_argument);
    CHECK_THROWS_AS(t.recv(b, 0, -1), std::invalid_argument);
    CHECK_THROWS_AS((void)Transport(MPI_COMM_WORLD, {.timeout = 0ms}), std::invalid_argument);
    CHECK_THROWS_AS((void)Transport(MPI_COMM_WORLD, {.timeout = 1s, .max_bytes_per_call = 0}), std::invalid_argument);
    try {
      t.send(b, -4, 0);
    } catch (const std::invalid_argument& e) {
      CHECK(contains(e.what(), "peer = -4"));
    }
    t.barrier();  // nothing was sent: every rank meets here
  }

  TEST_CASE("mpi: a receive from a peer that never sends times out naming rank, operation and peer") {
    Transport t(MPI_COMM_WORLD, kOptions);
    Transport quick(MPI_COMM_WORLD, {.timeout = 300ms});
    if (t.rank() == 0) {
      std::vector<std::byte> b(8);
      const auto start = std::chrono::steady_clock::now();
      try {
        quick.recv(b, 1, 7);
        FAIL("recv from a silent peer returned");
      } catch (const seqpar::Error& e) {
        const auto took = std::chrono::steady_clock::now() - start;
        CHECK(e.errc() == Errc::kTimeout);
        CHECK(took >= 300ms);
        CHECK(took < 5s);
        INFO(e.what());
        CHECK(contains(e.what(), "rank 0"));
        CHECK(contains(e.what(), "recv"));
        CHECK(contains(e.what(), "with rank 1"));
        CHECK(contains(e.what(), "300 ms"));
      }
      // irecv + wait: the same, and the timed-out receive is cancelled (nothing pending at MPI_Finalize).
      auto req = quick.irecv(b, t.size() - 1, 8);
      try {
        quick.wait(req);
        FAIL("wait on a receive from a silent peer returned");
      } catch (const seqpar::Error& e) {
        CHECK(e.errc() == Errc::kTimeout);
        CHECK(contains(e.what(), "wait(irecv) with rank " + std::to_string(t.size() - 1)));
      }
      CHECK_FALSE(req.pending());
      // A pending receive that is dropped is cancelled too.
      { auto dropped = quick.irecv(b, 1, 9); }
    }
    t.barrier();
  }

  TEST_CASE("mpi: a collective a rank never enters times out on the others") {
    Transport t(MPI_COMM_WORLD, kOptions);
    Transport quick(MPI_COMM_WORLD, {.timeout = 300ms});
    if (t.rank() != 0) {
      try {
        quick.barrier();
        FAIL("barrier without rank 0 returned");
      } catch (const seqpar::Error& e) {
        CHECK(e.errc() == Errc::kTimeout);
        INFO(e.what());
        CHECK(contains(e.what(), "barrier"));
        CHECK(contains(e.what(), "rank " + std::to_string(t.rank())));
      }
    }
    t.barrier();
    // Rank 0 enters late: that completes the others' abandoned MPI_Ibarrier, so nothing stays pending.
    if (t.rank() == 0) {
      CHECK_NOTHROW(quick.barrier());
    }
    t.barrier();
  }
}
