// SPDX-License-Identifier: Apache-2.0
#include <doctest/doctest.h>

#include "support/expect_error.hpp"
#include "train/plans.hpp"

#include <seqpar/train/all_reduce.hpp>
#include <seqpar/train/loss.hpp>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <random>
#include <string>
#include <vector>

using namespace seqpar;

namespace {

constexpr int kVocab = 7;
constexpr std::int32_t kIgnore = -1;

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
    const auto y = train::labels(t, plan, m, std::span<const std::int32_t>(ids), kIgnore);
    std::vector<double> loss(ids.size(), 123.0);  // rows without a label keep a value local_loss must skip
    std::vector<double> scratch(kVocab);
    for (std::size_t i = 0; i < ids.size(); ++i)
      if (y[i] != kIgnore) loss[i] = cross_entropy(logits.view().row(std::int64_t(i), 0), y[i], 1.0, scratch.data());
    const train::LossTotals mine = train::local_loss(std::span<const double>(loss), m);
    const train::LossTotals total = train::combine(t, mine);
    // The same totals combined inside the rank's BASP group only (what a group-local mean would give).
    auto group = t.split(plan.group_of(r), r);
    const train::LossTotals in_group = train::combine(group, mine);
    for (std::size_t i = 0; i < ids.size(); ++i)
      if (y[i] != kIgnore)
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

  TEST_CASE("BASP: the mean of the groups' means is not the batch loss; the world's totals are") {
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
    CHECK(message.find("train::all_reduce_sum: rank") != std::string::npos);
    CHECK(message.find("has 3 values, rank 1 has 4") != std::string::npos);
    const DocumentBatch batch = DocumentBatch::single({4});
    const train::TokenMeta m = train::token_meta(batch, partition::Uniform{}.plan(batch, Topology{1, 1}), 0);
    const std::vector<float> two(2);
    CHECK(test::invalid_message([&] {
            (void)train::local_loss(std::span<const float>(two), m);
          }).find("train::local_loss: per_row_loss.size() = 2: expected 4") != std::string::npos);
  }
}
