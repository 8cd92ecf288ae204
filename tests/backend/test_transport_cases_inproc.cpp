// SPDX-License-Identifier: Apache-2.0
// The transport-generic cases (tests/support/transport_cases.hpp) on the in-process world; the same
// bodies run over MPI in tests/mpi/test_mpi.cpp.
#include <doctest/doctest.h>

#include <seqpar/backend/inproc/world.hpp>

#include <array>
#include <atomic>
#include <string>

#include "support/transport_cases.hpp"

using seqpar::backend::inproc::Transport;
using seqpar::backend::inproc::World;

namespace {

constexpr std::array kCaseWorldSizes{2, 4, 8};

template <class Body>
void on_every_world(Body&& body) {
  for (int n : kCaseWorldSizes) {
    INFO("world size " << n);
    seqpar::test::Failures failures;
    World(n).run([&](Transport& t) { body(t, failures); });
    for (const auto& m : failures.messages()) FAIL_CHECK(m);
  }
}

}  // namespace

TEST_SUITE("backend") {
  TEST_CASE("transport cases (inproc): point to point, tags, order, counters") {
    on_every_world([](Transport& t, seqpar::test::Failures& f) { seqpar::test::point_to_point_case(t, f); });
  }
  TEST_CASE("transport cases (inproc): isend/irecv ring") {
    on_every_world([](Transport& t, seqpar::test::Failures& f) { seqpar::test::ring_case(t, f); });
  }
  TEST_CASE("transport cases (inproc): all_to_all and all_to_all_v round trips") {
    on_every_world([](Transport& t, seqpar::test::Failures& f) {
      seqpar::test::all_to_all_case(t, f);
      seqpar::test::all_to_all_v_case(t, f);
    });
  }
  TEST_CASE("transport cases (inproc): all_gather and all_gather_v") {
    on_every_world([](Transport& t, seqpar::test::Failures& f) { seqpar::test::all_gather_case(t, f); });
  }
  TEST_CASE("transport cases (inproc): split groups") {
    on_every_world([](Transport& t, seqpar::test::Failures& f) { seqpar::test::split_case(t, f); });
  }
  TEST_CASE("transport cases (inproc): bad arguments and wrong-size messages") {
    on_every_world([](Transport& t, seqpar::test::Failures& f) {
      seqpar::test::bad_arguments_case(t, f);
      seqpar::test::protocol_case(t, f);
    });
  }
  TEST_CASE("transport cases (inproc): strategies against the fp64 reference") {
    for (int n : kCaseWorldSizes) {
      INFO("world size " << n);
      seqpar::test::Failures failures;
      std::atomic<int> accepted{0};
      World(n).run([&](Transport& t) {
        const int a = seqpar::test::all_strategy_cases(t, failures);
        if (t.rank() == 0) accepted = a;
      });
      for (const auto& m : failures.messages()) FAIL_CHECK(m);
      CHECK(accepted.load() == seqpar::test::kNumTransportStrategies);
    }
  }
}
