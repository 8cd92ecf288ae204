// SPDX-License-Identifier: Apache-2.0
// SelectedAttention: the fastest predicted strategy runs, exactly; refusals are skipped; all refused -> error.
#include <doctest/doctest.h>

#include "support/distributed_check.hpp"
#include "support/expect_error.hpp"

#include <seqpar/plan/selected_attention.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>

using namespace seqpar;

namespace {
using Kernel = attention::CpuFlash<double>;
using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
using ZigzagRing = Strategy<partition::Zigzag, comm::Ring>;
using HybridRing = Strategy<partition::Hybrid, comm::Ring>;
using Selected = plan::SelectedAttention<Kernel, Ulysses, ZigzagRing, HybridRing>;

Selected::Arguments arguments(const replay::HardwareProfile& hw) {
  Selected::Arguments a;
  a.names = {"ulysses", "zigzag-ring", "hybrid-aware"};
  std::get<2>(a.strategies).comm.sharding_aware = true;
  a.simulation.hardware = hw;
  return a;
}
}  // namespace

TEST_SUITE("plan") {
  TEST_CASE("SelectedAttention runs the strategy with the lowest prediction, exactly, on every rank") {
    const DocumentBatch batch = test::random_batch(2, 700, 90.0, 11);
    const AttentionShape shape{4, 2, 16, 0};
    for (const bool slow_network : {false, true}) {
      CAPTURE(slow_network);
      replay::HardwareProfile hw = replay::profiles::h100_sxm();
      if (slow_network) hw.intra.bandwidth = 1e6;  // traffic dominates: the least-moving strategy wins
      std::vector<Selected::Choice> seen(4);
      const auto err = test::check_attention<Kernel>(
          batch, shape, 4,
          [&](backend::inproc::Transport& t) -> std::unique_ptr<runtime::AttentionEngine<Kernel>> {
            auto s = std::make_unique<Selected>(t, shape, arguments(hw));
            seen[static_cast<std::size_t>(t.rank())] = s->choice(batch);
            return s;
          },
          5);
      CHECK(err.max() < 1e-10);
      CHECK(err.bytes_match);
      const Selected::Choice& c = seen[0];
      for (const auto& other : seen) CHECK(other.index == c.index);
      REQUIRE(c.index >= 0);
      for (double p : c.predictions)
        if (!std::isnan(p)) CHECK(c.predicted_s <= p);
      CHECK(c.predicted_s == c.predictions[static_cast<std::size_t>(c.index)]);
      if (slow_network) CHECK(c.name != "zigzag-ring");  // the plain ring moves the most bytes
    }
  }

  TEST_CASE("SelectedAttention skips refusals and names them when every strategy refuses") {
    const DocumentBatch batch = test::random_batch(1, 300, 50.0, 3);
    const AttentionShape shape{2, 2, 16, 0};  // Ulysses cannot split 2 heads over 4 ranks
    std::vector<Selected::Choice> seen(4);
    const auto err = test::check_attention<Kernel>(
        batch, shape, 4,
        [&](backend::inproc::Transport& t) -> std::unique_ptr<runtime::AttentionEngine<Kernel>> {
          auto s = std::make_unique<Selected>(t, shape, arguments(replay::profiles::a100_40gb()));
          seen[static_cast<std::size_t>(t.rank())] = s->choice(batch);
          return s;
        },
        9);
    CHECK(err.max() < 1e-10);
    CHECK(seen[0].index != 0);
    CHECK(std::isnan(seen[0].predictions[0]));
    CHECK(seen[0].refusals[0].find("heads_q") != std::string::npos);

    using OnlyUlysses = plan::SelectedAttention<Kernel, Ulysses>;
    std::string message;
    backend::inproc::World(4).run([&](backend::inproc::Transport& t) {
      OnlyUlysses::Arguments a;
      a.simulation.hardware = replay::profiles::h100_sxm();
      OnlyUlysses attn(t, shape, a);
      const std::string m = test::invalid_message([&] { (void)attn.choice(batch); });
      if (t.rank() == 0) message = m;
    });
    CHECK(message.find("every strategy refuses") != std::string::npos);
    CHECK(message.find("heads_q") != std::string::npos);
  }

  TEST_CASE("SelectedAttention keeps at most kChoiceEntries choices over many shapes; an evicted one is chosen again") {
    const AttentionShape shape{4, 2, 16, 0};
    std::size_t most = 0;
    bool same = true;
    backend::inproc::World(2).run([&](backend::inproc::Transport& t) {
      Selected attn(t, shape, arguments(replay::profiles::a100_40gb()));
      const DocumentBatch first = test::random_batch(1, 64, 8.0, 1);
      const int index = attn.choice(first).index;
      for (std::uint32_t i = 0; i < 60; ++i) {
        (void)attn.choice(test::random_batch(1, 64 + i, 8.0, 100 + i));
        if (t.rank() == 0) most = std::max(most, attn.cached_choices());
      }
      if (t.rank() == 0) same = attn.choice(first).index == index;  // evicted long ago: chosen again
    });
    CHECK(most <= Selected::kChoiceEntries);
    CHECK(same);
  }
}
