// SPDX-License-Identifier: Apache-2.0
// Bounded memory over a training run: DistributedAttention sees a new batch shape (and, under BASP, a
// new rank grouping) at most steps; its caches (compiled batches, groupings with their split
// transports) must stay within their documented bounds whatever the
// number of shapes, and an evicted grouping must be split again (collectively, no hang) with the
// same results bit for bit. Counted in entries, not RSS, so that the test does not depend on timing.
#include <doctest/doctest.h>

#include <seqpar/seqpar.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <random>
#include <set>
#include <vector>

using namespace seqpar;

namespace {

// Two to four sequences of random lengths on 8 ranks: BASP gives each sequence a group of ranks in
// proportion to its cost, so the grouping changes with the lengths (a few dozen distinct ones). The
// same seed gives every rank the same batches.
DocumentBatch random_batch(std::mt19937& rng) {
  std::vector<std::vector<std::int64_t>> seqs(2 + rng() % 3);
  for (auto& docs : seqs) {
    const int n = 1 + static_cast<int>(rng() % 3);
    for (int i = 0; i < n; ++i) docs.push_back(1 + static_cast<std::int64_t>(rng() % 100));
  }
  return DocumentBatch(seqs);
}

template <class Engine>
std::vector<double> forward_output(Engine& attn, const DocumentBatch& batch, const AttentionShape& shape) {
  const std::int64_t n = attn.local_tokens(batch);
  ThdTensor<double> q(n, shape.heads_q, shape.head_dim), kv(n, shape.heads_kv, shape.head_dim),
      o(n, shape.heads_q, shape.head_dim);
  LseTensor<double> lse(shape.heads_q, n);
  const auto& owned = attn.owned_ranges(batch);
  std::size_t at = 0;  // values from the global token index: the same rows whatever the plan
  for (const Range& r : owned)
    for (std::int64_t t = r.begin; t < r.end; ++t, ++at) {
      for (std::size_t x = 0; x < static_cast<std::size_t>(shape.heads_q * shape.head_dim); ++x)
        q.storage[at * static_cast<std::size_t>(shape.heads_q * shape.head_dim) + x] =
            std::sin(0.37 * static_cast<double>(t) + 0.11 * static_cast<double>(x));
      for (std::size_t x = 0; x < static_cast<std::size_t>(shape.heads_kv * shape.head_dim); ++x)
        kv.storage[at * static_cast<std::size_t>(shape.heads_kv * shape.head_dim) + x] =
            std::cos(0.23 * static_cast<double>(t) + 0.07 * static_cast<double>(x));
    }
  attn.forward(batch, q.view(), kv.view(), kv.view(), o.view(), lse.view());
  return o.storage;
}

}  // namespace

TEST_SUITE("runtime") {
  TEST_CASE("caches stay bounded over 300 batches of new shapes; an evicted grouping splits again, same bits") {
    using Engine = runtime::AttentionEngine<attention::Reference<double>>;
    using S = Strategy<partition::BatchAware<partition::Uniform>, comm::Hierarchical<comm::AllToAll, comm::Ring>>;
    S::Arguments args;
    args.ranks_per_node = 4;
    const AttentionShape shape{12, 12, 2};  // AllToAll inside a node: heads divisible by 1..4 ranks
    std::mutex mu;
    std::set<std::vector<std::vector<int>>> groupings;  // distinct groupings seen (rank 0)
    std::size_t most_batches = 0, most_placements = 0, most_groupings = 0, most_transports = 0;
    bool same_bits = true;
    backend::inproc::World(8).run([&](backend::inproc::Transport& t) {
      DistributedAttention<S, attention::Reference<double>> attn(t, shape, args);
      std::mt19937 rng(2027);
      const DocumentBatch first = random_batch(rng);
      const std::vector<double> o_first = forward_output(attn, first, shape);
      for (int step = 0; step < 300; ++step) {
        const DocumentBatch batch = random_batch(rng);
        (void)forward_output(attn, batch, shape);
        const auto sizes = attn.cache_sizes();
        std::lock_guard lock(mu);
        most_batches = std::max(most_batches, sizes.batches);
        most_placements = std::max(most_placements, sizes.placements);
        most_groupings = std::max(most_groupings, sizes.groupings);
        most_transports = std::max(most_transports, sizes.transports);
        if (t.rank() == 0) groupings.insert(attn.plan(batch).groups);
      }
      const std::vector<double> o_again = forward_output(attn, first, shape);  // long evicted: compiled, split again
      std::lock_guard lock(mu);
      same_bits = same_bits && o_again == o_first;
    });
    MESSAGE(groupings.size() << " distinct groupings over 300 batches");
    CHECK(groupings.size() > Engine::kGroupingEntries);  // else the bound is never exercised
    CHECK(most_batches <= Engine::kCacheEntries);
    CHECK(most_placements <= Engine::kPlacementEntries);
    CHECK(most_groupings <= Engine::kGroupingEntries);
    CHECK(most_transports <= 3 * Engine::kGroupingEntries);  // a group and two levels per grouping
    CHECK(same_bits);
  }
}
