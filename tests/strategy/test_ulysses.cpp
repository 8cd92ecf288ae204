// SPDX-License-Identifier: Apache-2.0
// Ulysses (Uniform + AllToAll) end to end on the in-process world, forward and backward,
// against the fp64 reference on the whole batch.
#include <doctest/doctest.h>

#include <seqpar/seqpar.hpp>

#include "support/distributed_check.hpp"

using namespace seqpar;
using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;

namespace {
// fp64 kernels: the only error is summation order, ~1e-12 relative to the output scale.
constexpr double kUlyssesTolerance = 1e-10;
}  // namespace

TEST_SUITE("strategy") {
  TEST_CASE("Ulysses matches the reference: world sizes 1..8, random document mixes, MHA") {
    for (int world : {1, 2, 3, 4, 8}) {
      for (std::uint32_t seed : {1u, 2u}) {
        const DocumentBatch batch =
            test::random_batch(2, 61 + 7 * world, 9.0, seed * 100 + static_cast<unsigned>(world));
        const AttentionShape shape{8, 8, 16};
        const auto err = test::check_strategy<Ulysses, attention::Reference<double>>(batch, shape, world);
        INFO("world " << world << " seed " << seed << " tokens " << batch.total_tokens());
        CHECK(err.max() < kUlyssesTolerance);
        CHECK(err.bytes_match);
        if (world > 1) CHECK(err.bytes_forward > 0);
      }
    }
  }

  TEST_CASE("Ulysses GQA: KV heads move once when heads_kv >= degree, replicate below") {
    const DocumentBatch batch = test::random_batch(1, 97, 12.0, 5);
    struct Case {
      int world, hq, hkv;
    };
    for (const Case c : {Case{4, 8, 4}, Case{2, 8, 2}, Case{8, 8, 2}, Case{4, 4, 1}, Case{3, 6, 3}, Case{8, 16, 4}}) {
      INFO("world " << c.world << " heads " << c.hq << ":" << c.hkv);
      const auto err = test::check_strategy<Ulysses, attention::Reference<double>>(batch, {c.hq, c.hkv, 8}, c.world);
      CHECK(err.max() < kUlyssesTolerance);
      CHECK(err.bytes_match);
    }
  }

  TEST_CASE("Ulysses uneven heads: head counts not divisible by the degree split unevenly") {
    const DocumentBatch batch = DocumentBatch({{1, 30, 2, 1}, {17, 4}});
    for (const auto& [world, hq, hkv] :
         {std::tuple{3, 4, 4}, std::tuple{4, 6, 6}, std::tuple{3, 5, 5}, std::tuple{8, 9, 3}, std::tuple{6, 12, 4}}) {
      INFO("world " << world << " heads " << hq << ":" << hkv);
      const auto err = test::check_strategy<Ulysses, attention::Reference<double>>(batch, {hq, hkv, 8}, world);
      CHECK(err.max() < kUlyssesTolerance);
      CHECK(err.bytes_match);
    }
  }

  TEST_CASE("Ulysses moves exactly the all-to-all volume") {
    // 2 ranks, 40 tokens (20 each), MHA 4 heads, d 8, double: each rank sends half its heads of Q, K, V
    // (3 * 20 * 2 * 8 * 8 B) and gets back O (same) and LSE (2 heads * 20 * 8 B).
    const DocumentBatch batch = DocumentBatch::single({40});
    const auto err = test::check_strategy<Ulysses, attention::Reference<double>>(batch, {4, 4, 8}, 2);
    const std::uint64_t per_tensor = 20 * 2 * 8 * 8;
    CHECK(err.bytes_forward == 2 * (3 * per_tensor + per_tensor + 2 * 20 * 8));
    CHECK(err.max() < kUlyssesTolerance);
  }

  TEST_CASE("AllToAll refuses more ranks than query heads, before any communication") {
    const DocumentBatch batch = DocumentBatch::single({64});
    const Status s = Ulysses::can_implement({}, batch, {4, 4, 8}, Topology{8, 8});
    CHECK_FALSE(s.ok);
    CHECK(s.reason.find("heads_q = 4") != std::string::npos);
    CHECK(Ulysses::can_implement({}, batch, {8, 1, 8}, Topology{8, 8}).ok);
  }
}
