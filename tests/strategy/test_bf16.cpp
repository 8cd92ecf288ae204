// SPDX-License-Identifier: Apache-2.0
// bf16 end to end: DistributedAttention with CpuFlash<bf16> for every partitioner x communicator
// configuration (tests/support/strategy_list.hpp), forward and backward against the fp64 reference on
// the same bf16-rounded inputs. The runtime sums partial gradients (dK/dV pieces sent back to their
// owners) in fp32 and rounds once (runtime::DataOps); before, `+=` on bf16 did not compile.
#include <doctest/doctest.h>

#include <seqpar/attention/cpu_flash.hpp>
#include <seqpar/seqpar.hpp>

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "support/distributed_check.hpp"
#include "support/strategy_list.hpp"

using namespace seqpar;

namespace {

// bf16 storage keeps 8 significant bits (relative 2^-9 per rounding): O, dQ, dK and dV are rounded
// once by the kernel, the backward reads the rounded O, and a gradient summed over ranks is rounded
// once per partial added. The kernel test's tolerances (tests/attention/test_cpu_flash.cpp), relative
// to the output's largest value: 1e-2 forward, 2e-2 backward; LSE is fp32.
constexpr double kForward = 1e-2, kBackward = 2e-2;

template <class Combination>
void check_bf16(Combination) {
  using S = typename Combination::strategy;
  using Kernel = attention::CpuFlash<attention::bf16>;
  const std::string name = Combination::name();
  typename S::Arguments args = Combination::arguments();
  int accepted = 0;
  for (const int world : {2, 4}) {
    std::mt19937 rng(static_cast<unsigned>(31 * world + name.size()));
    const DocumentBatch batch({test::lognormal_docs(70, 12.0, 1.0, rng), test::lognormal_docs(45, 6.0, 1.0, rng)});
    const AttentionShape shape{4, 2, 16};
    args.ranks_per_node = world / 2;  // two "nodes": the hierarchical levels both run
    INFO(name << ": world " << world << ", " << batch.documents().size() << " documents");
    if (!S::can_implement(args, batch, shape, Topology{world, args.ranks_per_node}).ok) continue;
    ++accepted;
    // (CpuFlash holds its thread pool, so each rank's engine makes its own kernel.)
    const test::Errors err = test::check_attention<Kernel>(
        batch, shape, world,
        [&](backend::inproc::Transport& t) -> std::unique_ptr<runtime::AttentionEngine<Kernel>> {
          return std::make_unique<DistributedAttention<S, Kernel>>(t, shape, args);
        },
        7);
    CHECK(err.o < kForward);
    CHECK(err.lse < kForward);
    CHECK(err.dq < kBackward);
    CHECK(err.dk < kBackward);
    CHECK(err.dv < kBackward);
    CHECK(err.bytes_match);
  }
  CHECK(accepted >= 1);  // every configuration runs bf16 on some world
}

}  // namespace

TEST_SUITE("strategy") {
  TEST_CASE("bf16 end to end: every strategy with CpuFlash<bf16> equals the fp64 reference within bf16 tolerance") {
    test::for_each_combination([](auto combination) { check_bf16(combination); });
  }
}
