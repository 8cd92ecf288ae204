// SPDX-License-Identifier: Apache-2.0
// The trainer glue of include/seqpar/train/ against the unsharded batch, for every partitioner on 1-8
// ranks: shard / unshard (shard.hpp), per-row metadata and labels (token_meta.hpp), loss totals and
// gradient scale (loss.hpp), all_reduce_sum (all_reduce.hpp). One translation unit: they share the
// plans (train/plans.hpp), whose partitioners dominate the compile time.
#include <doctest/doctest.h>

#include "support/expect_error.hpp"
#include "train/plans.hpp"

#include <seqpar/strategy.hpp>
#include <seqpar/train/all_reduce.hpp>
#include <seqpar/train/loss.hpp>
#include <seqpar/train/shard.hpp>
#include <seqpar/train/token_meta.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <vector>

using namespace seqpar;
namespace {

// Values that name their element: token t, head h, lane x -> t * 100 + h * 10 + x (exact in float).
ThdTensor<double> coded(std::int64_t n, int heads, int dim) {
  ThdTensor<double> g(n, heads, dim);
  for (std::int64_t t = 0; t < n; ++t)
    for (int h = 0; h < heads; ++h)
      for (int x = 0; x < dim; ++x) g.view()(t, h, x) = double(t * 100 + h * 10 + x);
  return g;
}

// The global tokens of rank r's local rows, in order (the plan's owned ranges, concatenated).
std::vector<std::int64_t> tokens_of(const ShardPlan& plan, int r) {
  std::vector<std::int64_t> out;
  for (const Range& g : plan.owned[std::size_t(r)])
    for (std::int64_t t = g.begin; t < g.end; ++t) out.push_back(t);
  return out;
}

}  // namespace

TEST_SUITE("train") {
  TEST_CASE("shard and unshard_local round-trip every partitioner on 1-8 ranks (fp64 <-> fp32, strided heads)") {
    int plans = 0;
    test::for_each_plan([&](const std::string& name, const DocumentBatch& batch, const ShardPlan& plan) {
      INFO(name);
      ++plans;
      const std::int64_t n = batch.total_tokens();
      const ThdTensor<double> g = coded(n, 3, 4);
      ThdTensor<double> back(n, 2, 4);  // heads 1..2 of g come back here
      std::vector<int> seen(std::size_t(n), 0);
      for (int r = 0; r < plan.world_size(); ++r) {
        const auto tokens = tokens_of(plan, r);
        ThdTensor<float> l(plan.local_tokens(r), 2, 4);
        train::shard(plan, r, g.view().heads_slice(1, 2), l.view());  // strided global, converting
        bool rows_ok = true;
        for (std::size_t i = 0; i < tokens.size(); ++i) {
          ++seen[std::size_t(tokens[i])];
          for (int h = 0; h < 2; ++h)
            for (int x = 0; x < 4; ++x)
              rows_ok = rows_ok && l.view()(std::int64_t(i), h, x) == float(tokens[i] * 100 + (h + 1) * 10 + x);
        }
        CHECK(rows_ok);
        train::unshard_local(plan, r, l.view(), back.view());
      }
      CHECK(std::all_of(seen.begin(), seen.end(), [](int s) { return s == 1; }));
      bool back_ok = true;
      for (std::int64_t t = 0; t < n; ++t)
        for (int h = 0; h < 2; ++h)
          for (int x = 0; x < 4; ++x) back_ok = back_ok && back.view()(t, h, x) == g.view()(t, h + 1, x);
      CHECK(back_ok);
    });
    CHECK(plans > 150);  // every partitioner, most batches and world sizes
  }

  TEST_CASE("unshard gathers THD, LSE and per-token values on every rank over the in-process transport") {
    test::for_each_plan([&](const std::string& name, const DocumentBatch& batch, const ShardPlan& plan) {
      INFO(name);
      const std::int64_t n = batch.total_tokens();
      const ThdTensor<double> g64 = coded(n, 3, 5);
      ThdTensor<float> g(n, 3, 5);
      std::copy(g64.storage.begin(), g64.storage.end(), g.storage.begin());
      LseTensor<float> lse(3, n);
      for (int h = 0; h < 3; ++h)
        for (std::int64_t t = 0; t < n; ++t) lse.view()(h, t) = float(h * 1000 + t);
      std::vector<std::int32_t> ids(static_cast<std::size_t>(n));
      for (std::int64_t t = 0; t < n; ++t) ids[std::size_t(t)] = std::int32_t(7 * t + 3);
      std::atomic<int> bad{0};
      backend::inproc::World(plan.world_size()).run([&](backend::inproc::Transport& t) {
        const int r = t.rank();
        const std::int64_t local = plan.local_tokens(r);
        // THD: a local view with padding between tokens (heads 0..2 of a 4-head buffer).
        ThdTensor<float> padded(local, 4, 5);
        const ThdView<float> l = padded.view().heads_slice(0, 3);
        train::shard(plan, r, g.view(), l);
        ThdTensor<float> got(n, 3, 5);
        train::unshard(t, plan, ThdView<const float>(l), got.view());
        if (got.storage != g.storage) ++bad;
        // LSE (heads, tokens).
        LseTensor<float> llse(3, local), glse(3, n);
        train::shard(plan, r, lse.view(), llse.view());
        train::unshard(t, plan, std::as_const(llse).view(), glse.view());
        if (glse.storage != lse.storage) ++bad;
        // One value per token.
        std::vector<std::int32_t> lids(static_cast<std::size_t>(local)), gids(static_cast<std::size_t>(n));
        train::shard(plan, r, std::span<const std::int32_t>(ids), std::span(lids));
        train::unshard(t, plan, std::span<const std::int32_t>(lids), std::span(gids));
        if (gids != ids) ++bad;
      });
      CHECK(bad == 0);
    });
  }

  TEST_CASE("shard and unshard reject views and transports that do not fit the plan") {
    const DocumentBatch batch({{10, 6}});
    const ShardPlan plan = partition::Zigzag{}.plan(batch, Topology{2, 2});
    ThdTensor<float> g(16, 2, 4), l(plan.local_tokens(0), 2, 4), wrong(plan.local_tokens(0) + 1, 2, 4);
    ThdTensor<float> heads3(plan.local_tokens(0), 3, 4);
    CHECK(test::invalid_message([&] {
            train::shard(plan, 0, g.view(), wrong.view());
          }).find("train::shard: local.tokens = 9") != std::string::npos);
    CHECK(test::invalid_message([&] { train::shard(plan, 0, g.view(), heads3.view()); }).find("heads") !=
          std::string::npos);
    CHECK(test::invalid_message([&] {
            train::shard(plan, 2, g.view(), l.view());
          }).find("train::shard: rank = 2: must be in [0, 2)") != std::string::npos);
    CHECK(test::invalid_message([&] { train::unshard_local(plan, -1, l.view(), g.view()); }).find("rank = -1") !=
          std::string::npos);
    ThdTensor<float> short_global(15, 2, 4);
    CHECK(test::invalid_message([&] {
            train::shard(plan, 0, short_global.view(), l.view());
          }).find("global.tokens = 15") != std::string::npos);
    std::string message;
    backend::inproc::World(3).run([&](backend::inproc::Transport& t) {
      const std::string m = test::invalid_message([&] { train::unshard(t, plan, std::as_const(l).view(), g.view()); });
      if (t.rank() == 0) message = m;
    });
    CHECK(message.find("train::unshard: transport.size() = 3: must equal the plan's world size 2") !=
          std::string::npos);
  }
}

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

  TEST_CASE("token_meta refuses a strategy's plan of another batch with the same token count (fingerprint)") {
    using Zigzag = Strategy<partition::Zigzag, comm::AllToAll>;
    const DocumentBatch batch({{10, 6}}), other({{6, 10}});  // 16 tokens each, other documents
    const AttentionShape shape{2, 2, 8};
    const ShardPlan plan = Zigzag::plan({}, batch, shape, Topology{2, 2}).plan;
    CHECK(plan.batch_fingerprint == batch.fingerprint());
    CHECK(batch.fingerprint() != other.fingerprint());
    const std::string message = test::invalid_message([&] { (void)train::token_meta(other, plan, 0); });
    CAPTURE(message);
    CHECK(message.find("train::token_meta: plan.batch_fingerprint") != std::string::npos);
    CHECK(message.find("belongs to another batch") != std::string::npos);
    CHECK(train::token_meta(batch, plan, 1).rows() == plan.local_tokens(1));  // its own batch: accepted
  }

  TEST_CASE(
      "shard, unshard_local and unshard given the batch refuse a plan of another batch with the same token count") {
    using Zigzag = Strategy<partition::Zigzag, comm::AllToAll>;
    const DocumentBatch batch({{10, 6}}), other({{6, 10}});  // 16 tokens each, other documents
    const ShardPlan plan = Zigzag::plan({}, batch, AttentionShape{2, 2, 8}, Topology{2, 2}).plan;
    const ThdTensor<double> g = coded(16, 2, 4);
    ThdTensor<double> l(plan.local_tokens(0), 2, 4), back(16, 2, 4);
    LseTensor<double> lg(2, 16), ll(2, plan.local_tokens(0));
    std::vector<int> ids(16), local_ids(std::size_t(plan.local_tokens(0)));
    const auto refused = [](const std::string& message, const char* where) {
      CAPTURE(message);
      CHECK(message.find(std::string(where) + ": plan.batch_fingerprint") != std::string::npos);
      CHECK(message.find("belongs to another batch") != std::string::npos);
    };
    refused(test::invalid_message([&] { train::shard(other, plan, 0, g.view(), l.view()); }), "train::shard");
    refused(test::invalid_message([&] { train::shard(other, plan, 0, lg.view(), ll.view()); }), "train::shard");
    refused(test::invalid_message(
                [&] { train::shard(other, plan, 0, std::span<const int>(ids), std::span<int>(local_ids)); }),
            "train::shard");
    refused(test::invalid_message([&] { train::unshard_local(other, plan, 0, l.view(), back.view()); }),
            "train::unshard_local");
    refused(test::invalid_message([&] { train::unshard_local(other, plan, 0, ll.view(), lg.view()); }),
            "train::unshard_local");
    CHECK(test::invalid_message([&] {
            train::shard(DocumentBatch({{10, 7}}), plan, 0, g.view(), l.view());
          }).find("train::shard: plan = 16 tokens: is not a plan of this batch (17 tokens)") != std::string::npos);
    // Its own batch: accepted, the same rows as without it.
    train::shard(batch, plan, 0, g.view(), l.view());
    ThdTensor<double> want(plan.local_tokens(0), 2, 4);
    train::shard(plan, 0, g.view(), want.view());
    CHECK(l.storage == want.storage);
    // unshard: every rank refuses before the gather (none waits), on the in-process world.
    std::mutex mu;
    std::vector<std::string> errors(2);
    backend::inproc::World(2, {.timeout = std::chrono::seconds(5)}).run([&](backend::inproc::Transport& t) {
      ThdTensor<double> mine(plan.local_tokens(t.rank()), 2, 4), all(16, 2, 4);
      const std::string m = test::invalid_message([&] { train::unshard(t, other, plan, mine.view(), all.view()); });
      std::lock_guard lock(mu);
      errors[std::size_t(t.rank())] = m;
    });
    for (const std::string& e : errors) refused(e, "train::unshard");
  }

  TEST_CASE("labels refuse a TokenMeta of another rank, plan or batch before the gather") {
    using Zigzag = Strategy<partition::Zigzag, comm::AllToAll>;
    const DocumentBatch batch({{10, 6}}), other({{6, 10}});
    const ShardPlan plan = Zigzag::plan({}, batch, AttentionShape{2, 2, 8}, Topology{2, 2}).plan;
    const ShardPlan other_plan = Zigzag::plan({}, other, AttentionShape{2, 2, 8}, Topology{2, 2}).plan;
    std::mutex mu;
    std::vector<std::string> errors(4);
    backend::inproc::World(2, {.timeout = std::chrono::seconds(5)}).run([&](backend::inproc::Transport& t) {
      const int r = t.rank();
      const train::TokenMeta peer = train::token_meta(batch, plan, 1 - r);     // another rank's rows
      const train::TokenMeta stale = train::token_meta(other, other_plan, r);  // another batch's plan
      std::vector<int> ids(std::size_t(plan.local_tokens(r)));
      const std::string a =
          test::invalid_message([&] { (void)train::labels(t, plan, peer, std::span<const int>(ids), -1); });
      const std::string b =
          test::invalid_message([&] { (void)train::labels(t, plan, stale, std::span<const int>(ids), -1); });
      std::lock_guard lock(mu);
      errors[std::size_t(2 * r)] = a, errors[std::size_t(2 * r + 1)] = b;
    });
    for (std::size_t i = 0; i < errors.size(); ++i) {
      const std::string& e = errors[i];
      CAPTURE(e);
      // Zigzag gives both batches the same rows: the stale meta is told by its batch, the peer's by its rows.
      CHECK(e.find(i % 2 == 0 ? "train::labels: meta = global_index[" : "train::labels: meta.batch_fingerprint = ") !=
            std::string::npos);
      CHECK(e.find("meta of another plan, batch or rank") != std::string::npos);
    }
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

namespace {

constexpr int kVocab = 7;
constexpr std::int32_t kNoLabel = -1;

// Cross-entropy of one row of logits against `label`, and its gradient (softmax - one_hot) * scale.
double cross_entropy(const double* logits, std::int32_t label, double scale, double* grad) {
  double mx = logits[0];
  for (int v = 1; v < kVocab; ++v) mx = std::max(mx, logits[v]);
  double z = 0;
  for (int v = 0; v < kVocab; ++v) z += std::exp(logits[v] - mx);
  for (int v = 0; v < kVocab; ++v) grad[v] = scale * (std::exp(logits[v] - mx) / z - (v == label ? 1.0 : 0.0));
  return std::log(z) + mx - logits[label];
}

struct Problem {
  std::vector<double> logits;  // (tokens, kVocab)
  std::vector<std::int32_t> ids;
};
Problem problem(const DocumentBatch& batch, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 2.0);
  Problem p;
  for (std::int64_t t = 0; t < batch.total_tokens() * kVocab; ++t) p.logits.push_back(normal(rng));
  for (std::int64_t t = 0; t < batch.total_tokens(); ++t) p.ids.push_back(std::int32_t(rng() % kVocab));
  return p;
}

// Single device: mean cross-entropy over every token with a next-token label in its document, and the
// gradient of that mean with respect to the logits.
double single_device(const DocumentBatch& batch, const Problem& p, std::vector<double>& grad) {
  std::int64_t count = 0;
  for (const Document& d : batch.documents()) count += d.tokens.size() - 1;
  grad.assign(p.logits.size(), 0.0);
  double sum = 0;
  for (const Document& d : batch.documents())
    for (std::int64_t t = d.tokens.begin; t + 1 < d.tokens.end; ++t)
      sum += cross_entropy(&p.logits[std::size_t(t * kVocab)], p.ids[std::size_t(t + 1)], 1.0 / double(count),
                           &grad[std::size_t(t * kVocab)]);
  return sum / double(count);
}

struct Distributed {
  std::vector<double> loss_on_rank, group_mean;  // per rank: the combined mean; its group's own mean
  std::vector<double> grad;                      // gathered (tokens, kVocab)
};

// Each rank: its logits and ids (shard), labels over the transport, cross-entropy of its rows, totals
// combined over the world; the gradient scaled by the combined count and gathered back.
Distributed distributed(const DocumentBatch& batch, const ShardPlan& plan, const Problem& p) {
  const int world = plan.world_size();
  Distributed out{std::vector<double>(static_cast<std::size_t>(world)),
                  std::vector<double>(static_cast<std::size_t>(world)), std::vector<double>(p.logits.size())};
  std::mutex mu;
  backend::inproc::World(world).run([&](backend::inproc::Transport& t) {
    const int r = t.rank();
    const train::TokenMeta m = train::token_meta(batch, plan, r);
    ThdTensor<double> logits(m.rows(), 1, kVocab), grad(m.rows(), 1, kVocab);
    train::shard(plan, r, ThdView<const double>::dense(p.logits.data(), batch.total_tokens(), 1, kVocab),
                 logits.view());
    std::vector<std::int32_t> ids(std::size_t(m.rows()));
    train::shard(plan, r, std::span<const std::int32_t>(p.ids), std::span(ids));
    const auto y = train::labels(t, plan, m, std::span<const std::int32_t>(ids), kNoLabel);
    std::vector<double> loss(ids.size(), 123.0);  // rows without a label keep a value local_loss must skip
    std::vector<double> scratch(kVocab);
    for (std::size_t i = 0; i < ids.size(); ++i)
      if (y[i] != kNoLabel) loss[i] = cross_entropy(logits.view().row(std::int64_t(i), 0), y[i], 1.0, scratch.data());
    const train::LossTotals mine = train::local_loss(std::span<const double>(loss), m);
    const train::LossTotals total = train::combine(t, mine);
    // The same totals combined inside the rank's BASP group only (what a group-local mean would give).
    auto group = t.split(plan.group_of(r), r);
    const train::LossTotals in_group = train::combine(group, mine);
    for (std::size_t i = 0; i < ids.size(); ++i)
      if (y[i] != kNoLabel)
        (void)cross_entropy(logits.view().row(std::int64_t(i), 0), y[i], total.gradient_scale(),
                            grad.view().row(std::int64_t(i), 0));
    ThdTensor<double> all(batch.total_tokens(), 1, kVocab);
    train::unshard(t, plan, std::as_const(grad).view(), all.view());
    std::lock_guard lock(mu);
    out.loss_on_rank[std::size_t(r)] = total.mean();
    out.group_mean[std::size_t(r)] = in_group.mean();
    if (r == 0) out.grad = all.storage;
  });
  return out;
}

double max_rel(const std::vector<double>& got, const std::vector<double>& want) {
  double e = 0, s = 0;
  for (std::size_t i = 0; i < want.size(); ++i)
    e = std::max(e, std::abs(got[i] - want[i])), s = std::max(s, std::abs(want[i]));
  return e / s;
}

}  // namespace

TEST_SUITE("train") {
  TEST_CASE("loss and gradient combined over the world equal the single-device ones for every partitioner") {
    test::for_each_plan([&](const std::string& name, const DocumentBatch& batch, const ShardPlan& plan) {
      INFO(name);
      const Problem p = problem(batch, 5);
      std::vector<double> want_grad;
      const double want = single_device(batch, p, want_grad);
      const Distributed got = distributed(batch, plan, p);
      for (double l : got.loss_on_rank) CHECK(l == doctest::Approx(want).epsilon(1e-12));
      CHECK(max_rel(got.grad, want_grad) < 1e-12);
    });
  }

  TEST_CASE("BASP: the mean of the groups' means is not the batch loss, the world's totals are") {
    // Two groups of two ranks, one sequence each, with different label counts: 63 in one document of 64
    // tokens, 32 in 32 documents of 2 tokens.
    const DocumentBatch batch({{64}, std::vector<std::int64_t>(32, 2)});
    const ShardPlan plan = partition::BatchAware<partition::Zigzag>{{.group_size = 2}}.plan(batch, Topology{4, 4});
    REQUIRE(plan.groups.size() == 2);
    const Problem p = problem(batch, 9);
    std::vector<double> want_grad;
    const double want = single_device(batch, p, want_grad);
    const Distributed got = distributed(batch, plan, p);
    for (double l : got.loss_on_rank) CHECK(l == doctest::Approx(want).epsilon(1e-12));
    CHECK(max_rel(got.grad, want_grad) < 1e-12);
    const double mean_of_means = (got.group_mean[0] + got.group_mean[2]) / 2;
    CHECK(got.group_mean[0] == got.group_mean[1]);
    CHECK(std::abs(mean_of_means - want) > 1e-3 * want);  // the pitfall the world-wide totals avoid
  }

  TEST_CASE("all_reduce_sum: the rank-order sum, the same bits on every rank, on 1-8 ranks") {
    for (int world = 1; world <= 8; ++world)
      for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{5}, std::size_t{1000}}) {
        INFO(world << " ranks, " << n << " values");
        std::vector<std::vector<float>> in(static_cast<std::size_t>(world), std::vector<float>(n));
        for (int r = 0; r < world; ++r)
          for (std::size_t i = 0; i < n; ++i) in[std::size_t(r)][i] = float(std::sin(double(r * 1000 + int(i)))) * 1e3f;
        std::vector<float> want(n, 0.f);  // from stored values: no multiply-add for the compiler to fuse
        for (int r = 0; r < world; ++r)
          for (std::size_t i = 0; i < n; ++i) want[i] += in[std::size_t(r)][i];
        std::vector<std::vector<float>> got(static_cast<std::size_t>(world));
        backend::inproc::World(world).run([&](backend::inproc::Transport& t) {
          std::vector<float> v = in[std::size_t(t.rank())];
          train::all_reduce_sum(t, std::span(v));
          got[std::size_t(t.rank())] = v;
        });
        for (const auto& g : got) CHECK(g == want);  // bit-identical: summed in rank order, as `want` was
      }
  }

  TEST_CASE("all_reduce_sum and local_loss reject mismatched sizes") {
    std::string message;
    try {
      backend::inproc::World(2).run([&](backend::inproc::Transport& t) {
        std::vector<double> v(std::size_t(3 + t.rank()));
        train::all_reduce_sum(t, std::span(v));
      });
    } catch (const Error& e) {
      message = e.what();
    }
    CHECK(message.find("train::all_reduce_sum: ranks disagree on the number of values: 3, 4 (rank order)") !=
          std::string::npos);
    const DocumentBatch batch = DocumentBatch::single({4});
    const train::TokenMeta m = train::token_meta(batch, partition::Uniform{}.plan(batch, Topology{1, 1}), 0);
    const std::vector<float> two(2);
    CHECK(test::invalid_message([&] {
            (void)train::local_loss(std::span<const float>(two), m);
          }).find("train::local_loss: per_row_loss.size() = 2: expected 4") != std::string::npos);
  }
}

TEST_SUITE("train") {
  TEST_CASE("rows given as global ranges (a DPP chunk's rows): shard_rows, unshard_rows and token_meta") {
    const DocumentBatch batch({{5, 1, 9}, {4, 6}});  // 25 tokens, documents [0,5) [5,6) [6,15) | [15,19) [19,25)
    const std::vector<Range> rows{{13, 17}, {2, 6}, {24, 25}};  // across documents and a sequence boundary
    const std::span<const Range> span(rows);
    // token_meta of listed rows: the same rows a plan owning exactly these ranges would give.
    ShardPlan one;
    one.owned = {rows, {{0, 2}, {6, 13}, {17, 24}}};
    one.slices = {{}, {}};
    one.groups = {{0, 1}};
    const train::TokenMeta by_rows = train::token_meta(batch, span), by_plan = train::token_meta(batch, one, 0);
    CHECK(by_rows.global_index == by_plan.global_index);
    CHECK(by_rows.position == by_plan.position);
    CHECK(by_rows.label_index == by_plan.label_index);
    CHECK(by_rows.cu_seqlens == by_plan.cu_seqlens);
    // Hand-checked: 13,14 are positions 7,8 of [6,15) (14 its last: no label); 15,16 positions 0,1 of
    // [15,19); 2,3,4 positions 2,3,4 of [0,5) (4 last); 5 the one-token document; 24 the last of [19,25).
    CHECK(by_rows.global_index == std::vector<std::int64_t>{13, 14, 15, 16, 2, 3, 4, 5, 24});
    CHECK(by_rows.position == std::vector<std::int64_t>{7, 8, 0, 1, 2, 3, 4, 0, 5});
    CHECK(by_rows.label_index == std::vector<std::int64_t>{14, -1, 16, 17, 3, 4, -1, -1, -1});
    CHECK(by_rows.label_count == 5);
    // shard_rows / unshard_rows: the listed rows in order, and back (THD, LSE, per token).
    ThdTensor<double> global(25, 2, 3), local(9, 2, 3), back(25, 2, 3);
    for (std::size_t i = 0; i < global.storage.size(); ++i) global.storage[i] = static_cast<double>(i);
    train::shard_rows(span, global.view(), local.view());
    for (std::int64_t i = 0; i < 9; ++i)
      CHECK(local.view()(i, 1, 2) == global.view()(by_rows.global_index[static_cast<std::size_t>(i)], 1, 2));
    train::unshard_rows(span, local.view(), back.view());
    for (std::int64_t t = 0; t < 25; ++t) {
      const bool listed = std::any_of(rows.begin(), rows.end(), [t](Range r) { return r.contains(t); });
      CHECK(back.view()(t, 0, 1) == (listed ? global.view()(t, 0, 1) : 0.0));
    }
    LseTensor<float> lg(2, 25), ll(2, 9);
    for (std::int64_t t = 0; t < 25; ++t) lg.view()(1, t) = static_cast<float>(t);
    train::shard_rows(span, lg.view(), ll.view());
    CHECK(ll.view()(1, 0) == 13.0f);
    CHECK(ll.view()(1, 8) == 24.0f);
    std::vector<int> ids(25), mine(9);
    for (int t = 0; t < 25; ++t) ids[static_cast<std::size_t>(t)] = 100 + t;
    train::shard_rows(span, std::span<const int>(ids), std::span<int>(mine));
    CHECK(mine == std::vector<int>{113, 114, 115, 116, 102, 103, 104, 105, 124});
    // A range outside the tensor, or reversed, is refused by name.
    const std::vector<Range> bad{{2, 6}, {20, 26}};
    CHECK(seqpar::test::invalid_message([&] {
            (void)train::token_meta(batch, std::span<const Range>(bad));
          }).find("rows[1]") != std::string::npos);
    ThdTensor<double> small(8, 2, 3);
    CHECK(seqpar::test::invalid_message([&] {
            train::shard_rows(std::span<const Range>(bad), global.view(), small.view());
          }).find("rows[1] = [20, 26)") != std::string::npos);
    CHECK(seqpar::test::invalid_message([&] {
            train::shard_rows(span, global.view(), small.view());
          }).find("local.tokens") != std::string::npos);
  }
}
