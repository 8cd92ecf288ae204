// SPDX-License-Identifier: Apache-2.0
#include <doctest/doctest.h>

#include "support/expect_error.hpp"
#include "train/plans.hpp"

#include <seqpar/train/token_meta.hpp>

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

using namespace seqpar;

namespace {

// The unsharded batch's per-token facts, by a plain scan over its documents.
struct Unsharded {
  std::vector<std::int64_t> position, document, next;  // next: t + 1 within the document, else -1
  std::vector<int> sequence;
  std::vector<std::int32_t> ids, labels;  // labels: ids[t + 1] within the document, else kIgnore
};
constexpr std::int32_t kIgnore = -100;

Unsharded unsharded(const DocumentBatch& batch) {
  Unsharded u;
  const auto docs = batch.documents();
  for (std::size_t d = 0; d < docs.size(); ++d)
    for (std::int64_t t = docs[d].tokens.begin; t < docs[d].tokens.end; ++t) {
      u.position.push_back(t - docs[d].tokens.begin);
      u.document.push_back(std::int64_t(d));
      u.sequence.push_back(docs[d].sequence);
      u.next.push_back(t + 1 < docs[d].tokens.end ? t + 1 : -1);
      u.ids.push_back(std::int32_t((t * 37 + 11) % 1000));
    }
  for (std::size_t t = 0; t < u.ids.size(); ++t) u.labels.push_back(u.next[t] < 0 ? kIgnore : u.ids[t + 1]);
  return u;
}

}  // namespace

TEST_SUITE("train") {
  TEST_CASE("token_meta: positions, documents, sequences and labels equal the unsharded batch's, token by token") {
    test::for_each_plan([&](const std::string& name, const DocumentBatch& batch, const ShardPlan& plan) {
      INFO(name);
      const Unsharded u = unsharded(batch);
      std::int64_t labelled = 0;
      std::vector<int> seen(u.ids.size(), 0);
      for (int r = 0; r < plan.world_size(); ++r) {
        const train::TokenMeta m = train::token_meta(batch, plan, r);
        REQUIRE(m.rows() == plan.local_tokens(r));
        const std::vector<std::int32_t> y = train::labels(m, std::span<const std::int32_t>(u.ids), kIgnore);
        // Row i is the i-th token of the rank's owned ranges (the order shard() uses).
        std::size_t i = 0;
        bool ok = true;
        for (const Range& g : plan.owned[std::size_t(r)])
          for (std::int64_t t = g.begin; t < g.end; ++t, ++i) {
            const auto ut = std::size_t(t);
            ++seen[ut];
            ok = ok && m.global_index[i] == t && m.position[i] == u.position[ut] && m.document[i] == u.document[ut] &&
                 m.sequence[i] == u.sequence[ut] && m.label_index[i] == u.next[ut] &&
                 (m.last_in_document[i] == 1) == (u.next[ut] < 0) && y[i] == u.labels[ut];
          }
        CHECK(ok);
        labelled += m.label_count;
        // cu_seqlens: pieces of consecutive tokens of one document covering the rows; max_seqlen their longest.
        REQUIRE(m.cu_seqlens.size() >= 1);
        CHECK(m.cu_seqlens.front() == 0);
        CHECK(m.cu_seqlens.back() == m.rows());
        std::int64_t longest = 0;
        bool pieces_ok = true;
        for (std::size_t p = 0; p + 1 < m.cu_seqlens.size(); ++p) {
          const std::int64_t b = m.cu_seqlens[p], e = m.cu_seqlens[p + 1];
          pieces_ok = pieces_ok && e > b;
          longest = std::max(longest, e - b);
          for (std::int64_t k = b + 1; k < e; ++k)
            pieces_ok = pieces_ok && m.global_index[std::size_t(k)] == m.global_index[std::size_t(k - 1)] + 1 &&
                        m.document[std::size_t(k)] == m.document[std::size_t(b)] &&
                        m.position[std::size_t(k)] == m.position[std::size_t(k - 1)] + 1;
        }
        CHECK(pieces_ok);
        CHECK(m.max_seqlen == longest);
      }
      CHECK(std::all_of(seen.begin(), seen.end(), [](int s) { return s == 1; }));
      CHECK(labelled == batch.total_tokens() - std::int64_t(batch.documents().size()));
    });
  }

  TEST_CASE("labels fetched over the transport from local ids only equal the unsharded batch's labels") {
    test::for_each_plan([&](const std::string& name, const DocumentBatch& batch, const ShardPlan& plan) {
      INFO(name);
      const Unsharded u = unsharded(batch);
      std::atomic<int> bad{0};
      backend::inproc::World(plan.world_size()).run([&](backend::inproc::Transport& t) {
        const train::TokenMeta m = train::token_meta(batch, plan, t.rank());
        std::vector<std::int32_t> local(std::size_t(m.rows()));
        for (std::size_t i = 0; i < local.size(); ++i) local[i] = u.ids[std::size_t(m.global_index[i])];
        const auto y = train::labels(t, plan, m, std::span<const std::int32_t>(local), kIgnore);
        for (std::size_t i = 0; i < y.size(); ++i)
          if (y[i] != u.labels[std::size_t(m.global_index[i])]) ++bad;
      });
      CHECK(bad == 0);
    });
  }

  TEST_CASE("token_meta rejects a plan of another batch and a rank outside the plan") {
    const DocumentBatch batch({{10, 6}});
    const ShardPlan plan = partition::Zigzag{}.plan(batch, Topology{2, 2});
    CHECK(test::invalid_message([&] {
            (void)train::token_meta(DocumentBatch({{10, 7}}), plan, 0);
          }).find("train::token_meta: plan = 16 tokens: is not a plan of this batch (17 tokens)") != std::string::npos);
    CHECK(test::invalid_message([&] { (void)train::token_meta(batch, plan, 5); }).find("rank = 5") !=
          std::string::npos);
    const train::TokenMeta m = train::token_meta(batch, plan, 0);
    const std::vector<int> short_ids(3);
    CHECK(test::invalid_message([&] {
            (void)train::labels(m, std::span<const int>(short_ids), -1);
          }).find("train::labels: global_ids.size() = 3") != std::string::npos);
  }
}
