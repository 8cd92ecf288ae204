// SPDX-License-Identifier: Apache-2.0
#include <doctest/doctest.h>

#include "support/expect_error.hpp"

#include <seqpar/partition/batch_aware.hpp>
#include <seqpar/partition/hybrid.hpp>
#include <seqpar/partition/per_doc.hpp>
#include <seqpar/partition/uniform.hpp>
#include <seqpar/partition/whole_doc.hpp>
#include <seqpar/partition/zigzag.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

using namespace seqpar;
using partition::BatchAware;
using partition::Hybrid;
using partition::PerDoc;
using partition::Uniform;
using partition::WholeDoc;
using partition::Zigzag;

namespace {

using Lengths = std::vector<std::int64_t>;

// Portable sampling (the standard distributions differ between standard libraries; mt19937_64's raw
// output does not), so the mixes and the figures below are the same everywhere.
struct Rng {
  std::mt19937_64 gen;
  explicit Rng(std::uint64_t seed) : gen(seed) {}
  double uniform() { return static_cast<double>(gen() >> 11) * 0x1.0p-53; }
  double normal() {
    const double u = 1.0 - uniform();  // (0, 1]
    return std::sqrt(-2.0 * std::log(u)) * std::cos(2.0 * std::numbers::pi * uniform());
  }
  std::int64_t lognormal(double median, double sigma) {
    return static_cast<std::int64_t>(std::llround(median * std::exp(sigma * normal())));
  }
  std::int64_t pareto(double scale, double alpha) {
    return static_cast<std::int64_t>(scale / std::pow(1.0 - uniform(), 1.0 / alpha));
  }
  std::int64_t between(std::int64_t lo, std::int64_t hi) {
    return lo + static_cast<std::int64_t>(gen() % static_cast<std::uint64_t>(hi - lo + 1));
  }
};

enum class Mix { kLognormal, kLongTail, kUniform, kSingle };

// Documents of one sequence of `total` tokens; the last document is cut to fit.
Lengths fill(std::int64_t total, Mix mix, Rng& rng) {
  Lengths docs;
  std::int64_t left = total;
  while (left > 0) {
    std::int64_t s = 0;
    switch (mix) {
      case Mix::kLognormal:
        s = rng.lognormal(static_cast<double>(total) / 8.0, 1.0);
        break;
      case Mix::kLongTail:
        s = rng.pareto(4.0, 0.8);
        break;
      case Mix::kUniform:
        s = rng.between(1, total);
        break;
      case Mix::kSingle:
        s = total;
        break;
    }
    s = std::clamp<std::int64_t>(s, 1, left);
    docs.push_back(s);
    left -= s;
  }
  return docs;
}

struct Case {
  std::string name;
  DocumentBatch batch;
};

// Random batches: several distributions, B in {1, 2, 3, 5}, equal and unequal sequence lengths.
std::vector<Case> random_cases() {
  std::vector<Case> out;
  std::uint64_t seed = 1234;
  for (Mix mix : {Mix::kLognormal, Mix::kLongTail, Mix::kUniform, Mix::kSingle})
    for (int b : {1, 2, 3, 5})
      for (bool equal : {true, false}) {
        if (b == 1 && !equal) continue;
        Rng rng(++seed);
        std::vector<Lengths> seqs;
        for (int i = 0; i < b; ++i) seqs.push_back(fill(equal ? 1536 : rng.between(7, 2500), mix, rng));
        out.push_back({"mix " + std::to_string(static_cast<int>(mix)) + " B=" + std::to_string(b) +
                           (equal ? " equal" : " unequal") + " seed " + std::to_string(seed),
                       DocumentBatch(seqs)});
      }
  return out;
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) {
  return (a + b - 1) / b;
}

// Index of the document holding token t.
std::size_t doc_of(const DocumentBatch& batch, std::int64_t t) {
  const auto cu = batch.cu_seqlens();
  return static_cast<std::size_t>(std::upper_bound(cu.begin(), cu.end(), t) - cu.begin() - 1);
}

// Sorted, merged copy of a range list.
std::vector<Range> merged(std::vector<Range> rs) {
  std::sort(rs.begin(), rs.end(), [](Range a, Range b) { return a.begin < b.begin; });
  std::vector<Range> out;
  for (const Range& r : rs) {
    if (r.empty()) continue;
    if (!out.empty() && out.back().end >= r.begin)
      out.back().end = std::max(out.back().end, r.end);
    else
      out.push_back(r);
  }
  return out;
}

// Whether r lies inside a sorted, merged cover.
bool inside(Range r, const std::vector<Range>& cover) {
  const auto it =
      std::upper_bound(cover.begin(), cover.end(), r.begin, [](std::int64_t t, Range c) { return t < c.begin; });
  return it != cover.begin() && std::prev(it)->end >= r.end;
}

bool covered_by(Range r, std::vector<Range> cover) {
  return inside(r, merged(std::move(cover)));
}

std::vector<std::int64_t> tokens_per_rank(const ShardPlan& p) {
  std::vector<std::int64_t> t;
  for (int r = 0; r < p.world_size(); ++r) t.push_back(p.local_tokens(r));
  return t;
}

std::vector<std::int64_t> area_per_rank(const ShardPlan& p) {
  std::vector<std::int64_t> a;
  for (const auto& s : p.slices) a.push_back(total_area(s));
  return a;
}

// What every plan of every partitioner must satisfy, beyond ShardPlan::check_invariants:
// owned ranges ascending and not adjacent, slices exactly the document-causal pieces of the owned
// tokens (with a window: keys from w - 1 before the piece, a sliding-window mask where it binds), and no
// slice reading keys outside its rank's group.
void check_plan(const ShardPlan& p, const DocumentBatch& batch, const Topology& topo) {
  REQUIRE(p.topology == topo);
  REQUIRE_NOTHROW(p.check_invariants(batch));
  const auto docs = batch.documents();
  for (int r = 0; r < p.world_size(); ++r) {
    const auto& own = p.owned[static_cast<std::size_t>(r)];
    for (std::size_t i = 1; i < own.size(); ++i) REQUIRE(own[i - 1].end < own[i].begin);
    for (const Range& o : own) REQUIRE_FALSE(o.empty());
    std::int64_t q_tokens = 0;
    std::vector<Range> group_tokens;
    for (int peer : p.groups[static_cast<std::size_t>(p.group_of(r))])
      for (const Range& o : p.owned[static_cast<std::size_t>(peer)]) group_tokens.push_back(o);
    group_tokens = merged(std::move(group_tokens));
    for (const AttnSlice& s : p.slices[static_cast<std::size_t>(r)]) {
      const Document& d = docs[doc_of(batch, s.q_range.begin)];
      if (s.q_range.size() > 1 && s.mask == Mask::sliding_window(1) && p.mask.window == 1) {
        // Window 1: every query sees itself only, so pieces of documents and one-token documents of
        // one sequence run together into diagonal slices.
        REQUIRE(s.k_range == s.q_range);
        for (std::int64_t t = s.q_range.begin; t < s.q_range.end; ++t)
          REQUIRE(docs[doc_of(batch, t)].sequence == d.sequence);
        REQUIRE(inside(s.k_range, group_tokens));
        q_tokens += s.q_range.size();
        continue;
      }
      if (s.q_range.size() > 1 && s.mask == Mask::sliding_window(1)) {
        // A run of one-token documents of one sequence merged into one slice (append_slice): each
        // query sees itself only, as its own document-causal slice would.
        REQUIRE(s.k_range == s.q_range);
        for (std::int64_t t = s.q_range.begin; t < s.q_range.end; ++t) {
          const Document& one = docs[doc_of(batch, t)];
          REQUIRE(one.tokens == Range{t, t + 1});
          REQUIRE(one.sequence == d.sequence);
        }
        REQUIRE(inside(s.k_range, group_tokens));
        q_tokens += s.q_range.size();
        continue;
      }
      REQUIRE(s.q_range.end <= d.tokens.end);
      const std::int64_t w = p.mask.window;
      if (w > 0 && s.q_range.end - w > d.tokens.begin) {  // the last row does not see the document's start
        const std::int64_t first = std::max(d.tokens.begin, s.q_range.begin - w + 1);
        REQUIRE(s.k_range == Range{first, s.q_range.end});
        REQUIRE(s.mask == Mask::sliding_window(w, s.q_range.begin - first));
      } else {
        REQUIRE(s.k_range == Range{d.tokens.begin, s.q_range.end});
        REQUIRE(s.mask == Mask::causal(s.q_range.begin - d.tokens.begin));
      }
      REQUIRE(inside(s.k_range, group_tokens));
      q_tokens += s.q_range.size();
    }
    REQUIRE(q_tokens == p.local_tokens(r));
  }
}

// Per-rank token counts differ by at most one: max = ceil(T/P), min = floor(T/P).
void check_token_balance(const ShardPlan& p, const DocumentBatch& batch) {
  const auto t = tokens_per_rank(p);
  const auto n = static_cast<std::int64_t>(t.size());
  CHECK(*std::max_element(t.begin(), t.end()) == ceil_div(batch.total_tokens(), n));
  CHECK(*std::min_element(t.begin(), t.end()) == batch.total_tokens() / n);
}

// PerDoc's bounds: per document, rank areas within 4s + 4P of each other; overall
// compute imbalance <= 1 + 4P * sum_d (s_d + P) / A.
void check_per_doc_compute(const ShardPlan& p, const DocumentBatch& batch) {
  const auto docs = batch.documents();
  const auto n = static_cast<std::int64_t>(p.world_size());
  std::vector<std::vector<std::int64_t>> area(docs.size(), std::vector<std::int64_t>(static_cast<std::size_t>(n), 0));
  for (int r = 0; r < p.world_size(); ++r)
    for (const AttnSlice& s : p.slices[static_cast<std::size_t>(r)])
      area[doc_of(batch, s.q_range.begin)][static_cast<std::size_t>(r)] += s.area();
  double bound_sum = 0;
  for (std::size_t d = 0; d < docs.size(); ++d) {
    const std::int64_t s = docs[d].tokens.size();
    const auto [lo, hi] = std::minmax_element(area[d].begin(), area[d].end());
    CHECK(*hi - *lo <= 4 * s + 4 * n);
    bound_sum += static_cast<double>(s + n);
  }
  CHECK(p.balance().compute_imbalance <=
        1.0 + 4.0 * static_cast<double>(n) * bound_sum / static_cast<double>(batch.causal_area()));
}

// Every document lies inside one owned range of one rank.
void check_documents_whole(const ShardPlan& p, const DocumentBatch& batch) {
  for (const Document& d : batch.documents()) {
    int holders = 0;
    for (const auto& own : p.owned)
      for (const Range& o : own) holders += (o.begin <= d.tokens.begin && d.tokens.end <= o.end) ? 1 : 0;
    CHECK(holders == 1);
  }
}

// Hybrid's default proxy, recomputed from the plan: max_r area_r + max(0, 256 recv_r - area_r / 2).
double proxy_cost(const ShardPlan& p) {
  double worst = 0;
  for (int r = 0; r < p.world_size(); ++r) {
    const auto area = static_cast<double>(total_area(p.slices[static_cast<std::size_t>(r)]));
    const auto comm = 256.0 * static_cast<double>(partition::received_kv_tokens(p, r));
    worst = std::max(worst, area + std::max(0.0, comm - 0.5 * area));
  }
  return worst;
}

using test::invalid_message;

bool contains(const std::string& s, const std::string& what) {
  return s.find(what) != std::string::npos;
}

// A lognormal mix of `total` tokens (median 2K, sigma 1), one sequence.
DocumentBatch lognormal_128k(std::uint64_t seed, std::int64_t total = 128 * 1024) {
  Rng rng(seed);
  Lengths docs;
  std::int64_t left = total;
  while (left > 0) {
    const std::int64_t s = std::clamp<std::int64_t>(rng.lognormal(2048.0, 1.0), 1, left);
    docs.push_back(s);
    left -= s;
  }
  return DocumentBatch::single(docs);
}

}  // namespace

TEST_SUITE("partition") {
  TEST_CASE("AttnSlice::area: closed form equals the row walk") {
    // Row qi sees key kj when kj <= qi + offset (and kj > qi + offset - window with a sliding window).
    const auto walk = [](const AttnSlice& s) {
      std::int64_t n = 0;
      for (std::int64_t qi = 0; qi < s.q_range.size(); ++qi)
        for (std::int64_t kj = 0; kj < s.k_range.size(); ++kj) {
          const std::int64_t diag = qi + s.mask.causal_offset;
          const bool seen = s.mask.kind == MaskKind::kFull ||
                            (kj <= diag && (s.mask.kind != MaskKind::kSlidingWindow || kj > diag - s.mask.window));
          n += seen ? 1 : 0;
        }
      return n;
    };
    Rng rng(7);
    for (int i = 0; i < 400; ++i) {
      const std::int64_t m = rng.between(0, 40), n = rng.between(0, 40), off = rng.between(-50, 50);
      const AttnSlice causal{{0, m}, {100, 100 + n}, Mask::causal(off)};
      CHECK(causal.area() == walk(causal));
      const AttnSlice full{{0, m}, {0, n}, Mask::full()};
      CHECK(full.area() == walk(full));
      const AttnSlice window{{0, m}, {0, n}, Mask::sliding_window(rng.between(1, 20), off)};
      CHECK(window.area() == walk(window));
    }
  }

  TEST_CASE("Zigzag: 10 tokens on 2 ranks, exact") {
    const auto batch = DocumentBatch::single({10});
    const auto p = Zigzag{}.plan(batch, {2, 2});
    // chunks [0,3) [3,6) [6,8) [8,10): the two remainder tokens go one each to ranks 0 and 1.
    CHECK(p.owned[0] == std::vector<Range>{{0, 3}, {8, 10}});
    CHECK(p.owned[1] == std::vector<Range>{{3, 8}});
    CHECK(p.slices[0] ==
          std::vector<AttnSlice>{{{0, 3}, {0, 3}, Mask::causal(0)}, {{8, 10}, {0, 10}, Mask::causal(8)}});
    CHECK(p.slices[1] == std::vector<AttnSlice>{{{3, 8}, {0, 8}, Mask::causal(3)}});
    CHECK(p.groups == std::vector<std::vector<int>>{{0, 1}});
    CHECK(area_per_rank(p) == std::vector<std::int64_t>{6 + 19, 30});
  }

  TEST_CASE("Zigzag: per sequence, remainder cursor carried across sequences") {
    const DocumentBatch batch({{5}, {3}});
    const auto p = Zigzag{}.plan(batch, {2, 2});
    // Sequence 0: 1 extra token -> rank 0 (front chunk). Sequence 1 (3 tokens, all remainder):
    // ranks 1, 0, 1 -> rank 1 gets both its chunks, rank 0 its front chunk, chunk 3 is empty.
    CHECK(p.owned[0] == std::vector<Range>{{0, 2}, {4, 6}});
    CHECK(p.owned[1] == std::vector<Range>{{2, 4}, {6, 8}});
    check_plan(p, batch, {2, 2});
  }

  TEST_CASE("Zigzag: a sequence shorter than 2P leaves ranks empty, nothing padded") {
    const auto batch = DocumentBatch::single({3});
    const auto p = Zigzag{}.plan(batch, {4, 4});
    CHECK(p.owned[0] == std::vector<Range>{{0, 1}});
    CHECK(p.owned[1] == std::vector<Range>{{1, 2}});
    CHECK(p.owned[2] == std::vector<Range>{{2, 3}});
    CHECK(p.owned[3].empty());
    check_plan(p, batch, {4, 4});
  }

  TEST_CASE("PerDoc: documents {8, 3} on 2 ranks, exact") {
    const auto batch = DocumentBatch::single({8, 3});
    const auto p = PerDoc{}.plan(batch, {2, 2});
    // Doc 0: chunks [0,2) [2,4) [4,6) [6,8). Doc 1 (all remainder): ranks 0, 1, 0 -> chunks
    // [8,9) (rank 0), [9,10) (rank 1), empty (rank 1 tail), [10,11) (rank 0 tail).
    CHECK(p.owned[0] == std::vector<Range>{{0, 2}, {6, 9}, {10, 11}});
    CHECK(p.owned[1] == std::vector<Range>{{2, 6}, {9, 10}});
    CHECK(p.slices[0] == std::vector<AttnSlice>{{{0, 2}, {0, 2}, Mask::causal(0)},
                                                {{6, 8}, {0, 8}, Mask::causal(6)},
                                                {{8, 9}, {8, 9}, Mask::causal(0)},
                                                {{10, 11}, {8, 11}, Mask::causal(2)}});
    CHECK(p.slices[1] ==
          std::vector<AttnSlice>{{{2, 6}, {0, 6}, Mask::causal(2)}, {{9, 10}, {8, 10}, Mask::causal(1)}});
    CHECK(tokens_per_rank(p) == std::vector<std::int64_t>{6, 5});
    CHECK(area_per_rank(p) == std::vector<std::int64_t>{3 + 15 + 1 + 3, 18 + 2});
  }

  TEST_CASE("every partitioner, world sizes 1..8, random document mixes") {
    const auto cases = random_cases();
    for (int n = 1; n <= 8; ++n) {
      const Topology topo{n, n};
      for (const Case& c : cases) {
        CAPTURE(c.name);
        CAPTURE(n);
        const DocumentBatch& batch = c.batch;
        {
          const auto p = Uniform{}.plan(batch, topo);
          check_plan(p, batch, topo);
          check_token_balance(p, batch);
        }
        {
          REQUIRE(Zigzag{}.can_implement(batch, topo));
          const auto p = Zigzag{}.plan(batch, topo);
          check_plan(p, batch, topo);
          check_token_balance(p, batch);
        }
        {
          REQUIRE(PerDoc{}.can_implement(batch, topo));
          const auto p = PerDoc{}.plan(batch, topo);
          check_plan(p, batch, topo);
          check_token_balance(p, batch);
          check_per_doc_compute(p, batch);
        }
        {
          const WholeDoc wd{};
          const std::int64_t cap = wd.capacity(batch, topo);
          CHECK(cap ==
                std::max(ceil_div(batch.total_tokens(), n),
                         static_cast<std::int64_t>(std::ceil(1.25 * static_cast<double>(batch.total_tokens()) / n))));
          std::int64_t longest = 0;
          for (const Document& d : batch.documents()) longest = std::max(longest, d.tokens.size());
          const Status st = wd.can_implement(batch, topo);
          if (longest > cap) {
            CHECK_FALSE(st);
            CHECK(contains(st.reason, "capacity"));
            CHECK(contains(invalid_message([&] { (void)wd.plan(batch, topo); }), st.reason));
          } else if (st) {
            const auto p = wd.plan(batch, topo);
            check_plan(p, batch, topo);
            check_documents_whole(p, batch);
            const auto t = tokens_per_rank(p);
            CHECK(*std::max_element(t.begin(), t.end()) <= cap);
          } else {
            CHECK(contains(st.reason, "no placement"));
          }
          // Capacity that cannot bind: LPT's guarantees on the max per-rank area.
          const WholeDoc loose{{.capacity_factor = static_cast<double>(n)}};
          REQUIRE(loose.can_implement(batch, topo));
          const auto p = loose.plan(batch, topo);
          check_plan(p, batch, topo);
          check_documents_whole(p, batch);
          const double mean = static_cast<double>(batch.causal_area()) / n;
          double biggest = 0;
          for (const Document& d : batch.documents())
            biggest = std::max(biggest, static_cast<double>(d.tokens.size() * (d.tokens.size() + 1) / 2));
          const auto max_area = static_cast<double>(p.balance().max_area);
          // List scheduling: the rank that ends highest got its last document when it was the
          // least loaded, so max <= mean + (1 - 1/P) * largest document.
          CHECK(max_area <= mean + (1.0 - 1.0 / n) * biggest + 1e-6);
        }
        {
          const Hybrid h{};
          REQUIRE(h.can_implement(batch, topo));
          const auto rep = h.plan_with_report(batch, topo);
          const auto& p = rep.plan;
          check_plan(p, batch, topo);
          const auto t = tokens_per_rank(p);
          CHECK(*std::max_element(t.begin(), t.end()) <= WholeDoc{}.capacity(batch, topo));
          CHECK(rep.tokens == t);
          CHECK(rep.area == area_per_rank(p));
          int per_doc = 0;
          for (const Document& d : batch.documents()) per_doc += d.tokens.size() > rep.threshold ? 1 : 0;
          CHECK(rep.per_doc_documents == per_doc);
          CHECK(rep.cost == doctest::Approx(proxy_cost(p)));
          // tau = 0 is exactly PerDoc: the sweep never ends more than `tolerance` above it.
          CHECK(rep.cost <= 1.01 * proxy_cost(PerDoc{}.plan(batch, topo)) + 1e-9);
          for (const Document& d : batch.documents()) {
            if (d.tokens.size() > rep.threshold) continue;
            int holders = 0;
            for (const auto& own : p.owned)
              for (const Range& o : own) holders += (o.begin <= d.tokens.begin && d.tokens.end <= o.end) ? 1 : 0;
            CHECK(holders == 1);
          }
        }
        for (int rpn : {n, 2, 3}) {
          const Topology nodes{n, rpn};
          CAPTURE(rpn);
          for (const ShardPlan& p : {BatchAware<Uniform>{}.plan(batch, nodes), BatchAware<Zigzag>{}.plan(batch, nodes),
                                     BatchAware<PerDoc>{}.plan(batch, nodes), BatchAware<Hybrid>{}.plan(batch, nodes)})
            check_plan(p, batch, nodes);
        }
      }
    }
  }

  TEST_CASE("BatchAware: group layout, divisible and equal sequences -> K = N/B consecutive ranks") {
    for (int b : {1, 2, 4, 8}) {
      std::vector<Lengths> seqs;
      Rng rng(static_cast<std::uint64_t>(b));
      for (int i = 0; i < b; ++i) seqs.push_back(fill(1024, Mix::kLognormal, rng));  // equal lengths, different mixes
      const DocumentBatch batch(seqs);
      const Topology topo{8, 4};
      const BatchAware<PerDoc> basp{};
      const auto groups = basp.layout(batch, topo);
      REQUIRE(groups.size() == static_cast<std::size_t>(b));
      for (int g = 0; g < b; ++g) {
        CHECK(groups[static_cast<std::size_t>(g)].first_rank == g * (8 / b));
        CHECK(groups[static_cast<std::size_t>(g)].size == 8 / b);
        CHECK(groups[static_cast<std::size_t>(g)].sequences == std::vector<int>{g});
      }
      const auto p = basp.plan(batch, topo);
      check_plan(p, batch, topo);
      REQUIRE(p.groups.size() == static_cast<std::size_t>(b));
      for (int g = 0; g < b; ++g) {
        std::vector<int> expect;
        for (int r = 0; r < 8 / b; ++r) expect.push_back(g * (8 / b) + r);
        CHECK(p.groups[static_cast<std::size_t>(g)] == expect);
        // The group owns exactly its sequence.
        std::vector<Range> owned;
        for (int r : expect)
          owned.insert(owned.end(), p.owned[static_cast<std::size_t>(r)].begin(),
                       p.owned[static_cast<std::size_t>(r)].end());
        CHECK(covered_by(batch.sequence(g), owned));
        std::int64_t n_tok = 0;
        for (const Range& o : owned) n_tok += o.size();
        CHECK(n_tok == batch.sequence(g).size());
      }
    }
  }

  TEST_CASE("BatchAware: hand-checked mapping back to global ranks and tokens") {
    const DocumentBatch batch({{10}, {10}});
    const auto p = BatchAware<Zigzag>{}.plan(batch, {4, 4});
    CHECK(p.owned == std::vector<std::vector<Range>>{{{0, 3}, {8, 10}}, {{3, 8}}, {{10, 13}, {18, 20}}, {{13, 18}}});
    CHECK(p.slices[2] ==
          std::vector<AttnSlice>{{{10, 13}, {10, 13}, Mask::causal(0)}, {{18, 20}, {10, 20}, Mask::causal(8)}});
    CHECK(p.slices[3] == std::vector<AttnSlice>{{{13, 18}, {10, 18}, Mask::causal(3)}});
    CHECK(p.groups == std::vector<std::vector<int>>{{0, 1}, {2, 3}});
    check_plan(p, batch, {4, 4});

    // B > N: three equal sequences on two ranks; LPT puts sequences 0 and 2 on rank 0. Uniform's one
    // range over the sub-batch maps back to two ranges (the sequences are not adjacent globally).
    const DocumentBatch three({{5}, {5}, {5}});
    const BatchAware<Uniform> basp{};
    CHECK(basp.layout(three, {2, 2}) == std::vector<partition::SequenceGroup>{{0, 1, {0, 2}}, {1, 1, {1}}});
    const auto q = basp.plan(three, {2, 2});
    CHECK(q.owned == std::vector<std::vector<Range>>{{{0, 5}, {10, 15}}, {{5, 10}}});
    CHECK(q.groups == std::vector<std::vector<int>>{{0}, {1}});
    check_plan(q, three, {2, 2});
  }

  TEST_CASE("BatchAware: unequal sequences get ranks by cost; groups avoid straddling nodes") {
    // Sequence costs 1 : 2 : 1 (2, 4 and 2 documents of 100 tokens) on 8 ranks -> sizes 2, 4, 2.
    const DocumentBatch batch({{100, 100}, {100, 100, 100, 100}, {100, 100}});
    BatchAware<Uniform> basp{};
    // With 4 ranks per node, the 4-rank group goes first so that no group straddles a node.
    CHECK(basp.layout(batch, {8, 4}) == std::vector<partition::SequenceGroup>{{0, 4, {1}}, {4, 2, {0}}, {6, 2, {2}}});
    basp.args.respect_nodes = false;
    CHECK(basp.layout(batch, {8, 4}) == std::vector<partition::SequenceGroup>{{0, 2, {0}}, {2, 4, {1}}, {6, 2, {2}}});
    // When the given order already straddles no node it is kept.
    basp.args.respect_nodes = true;
    CHECK(basp.layout(batch, {8, 2}) == std::vector<partition::SequenceGroup>{{0, 2, {0}}, {2, 4, {1}}, {6, 2, {2}}});
    const auto p = basp.plan(batch, {8, 4});
    check_plan(p, batch, {8, 4});
    CHECK(p.groups == std::vector<std::vector<int>>{{0, 1, 2, 3}, {4, 5}, {6, 7}});
  }

  TEST_CASE("BatchAware: cost-balanced sizes are minimax-optimal for any N and B <= N") {
    for (const Case& c : random_cases())
      for (int n = 1; n <= 8; ++n) {
        const DocumentBatch& batch = c.batch;
        const int b = batch.num_sequences();
        CAPTURE(c.name);
        CAPTURE(n);
        const auto groups = BatchAware<Uniform>{}.layout(batch, {n, n});
        // Consecutive, disjoint, covering the world; every sequence in exactly one group.
        int at = 0;
        std::vector<int> seen(static_cast<std::size_t>(b), 0);
        for (const auto& g : groups) {
          CHECK(g.first_rank == at);
          CHECK(g.size >= 1);
          at += g.size;
          for (int s : g.sequences) ++seen[static_cast<std::size_t>(s)];
        }
        CHECK(at == n);
        CHECK(std::all_of(seen.begin(), seen.end(), [](int k) { return k == 1; }));
        if (b > n) {
          CHECK(groups.size() == static_cast<std::size_t>(n));
          continue;
        }
        REQUIRE(groups.size() == static_cast<std::size_t>(b));
        const bool equal_lengths = std::all_of(groups.begin(), groups.end(), [&](const auto& g) {
          return batch.sequence(g.sequences[0]).size() == batch.sequence(0).size();
        });
        if (equal_lengths && n % b == 0) {
          for (const auto& g : groups) CHECK(g.size == n / b);
          continue;
        }
        // No move of one rank from one group to another lowers max_g cost_g / size_g.
        std::vector<double> cost, size;
        for (const auto& g : groups) {
          double a = 0;
          for (const Document& d : batch.documents_of(g.sequences[0]))
            a += static_cast<double>(d.tokens.size() * (d.tokens.size() + 1) / 2);
          cost.push_back(a);
          size.push_back(g.size);
        }
        const auto worst = [&] {
          double w = 0;
          for (std::size_t g = 0; g < cost.size(); ++g) w = std::max(w, cost[g] / size[g]);
          return w;
        };
        const double best = worst();
        for (std::size_t from = 0; from < size.size(); ++from)
          for (std::size_t to = 0; to < size.size(); ++to) {
            if (from == to || size[from] < 2) continue;
            --size[from];
            ++size[to];
            CHECK(worst() >= best);
            ++size[from];
            --size[to];
          }
      }
  }

  TEST_CASE("BatchAware: group_size override") {
    const DocumentBatch batch({{64}, {64}, {32}, {200}});
    BatchAware<Zigzag> basp{{.group_size = 2}};
    const auto groups = basp.layout(batch, {8, 8});
    CHECK(groups == std::vector<partition::SequenceGroup>{{0, 2, {0}}, {2, 2, {1}}, {4, 2, {2}}, {6, 2, {3}}});
    check_plan(basp.plan(batch, {8, 8}), batch, {8, 8});
    basp.args.group_size = 4;  // two groups for four sequences: LPT by cost
    const auto two = basp.layout(batch, {8, 8});
    CHECK(two == std::vector<partition::SequenceGroup>{{0, 4, {3}}, {4, 4, {0, 1, 2}}});
    check_plan(basp.plan(batch, {8, 8}), batch, {8, 8});
  }

  TEST_CASE("refused combinations answer a Status with a reason") {
    const auto batch = DocumentBatch::single({900, 50, 50});
    const Topology topo{4, 4};
    // WholeDoc: a document longer than the capacity (ceil(1.25 * 1000 / 4) = 313 tokens).
    const Status wd = WholeDoc{}.can_implement(batch, topo);
    CHECK_FALSE(wd);
    CHECK(contains(wd.reason, "document 0 has 900 tokens"));
    CHECK(contains(wd.reason, "capacity of 313"));
    CHECK(contains(invalid_message([&] { (void)WholeDoc{}.plan(batch, topo); }), "document 0 has 900 tokens"));
    CHECK(contains(WholeDoc{{.capacity_factor = 0.5}}.can_implement(batch, topo).reason, "capacity_factor"));
    CHECK(contains(WholeDoc{{.linear_weight = -1.0}}.can_implement(batch, topo).reason, "linear_weight"));
    CHECK(WholeDoc{{.capacity_factor = 4.0}}.can_implement(batch, topo));
    // Every document fits but no placement does: 3 documents of 6 tokens on 2 ranks of capacity 9.
    const Status tight = WholeDoc{{.capacity_factor = 1.0}}.can_implement(DocumentBatch::single({6, 6, 6}), {2, 2});
    CHECK_FALSE(tight);
    CHECK(contains(tight.reason, "no placement"));
    // Hybrid: a fixed threshold that keeps the long document whole cannot fit; a negative weight.
    Hybrid h{{.threshold = 1000}};
    CHECK_FALSE(h.can_implement(batch, topo));
    CHECK(contains(h.can_implement(batch, topo).reason, "threshold = 1000"));
    CHECK(contains(invalid_message([&] { (void)h.plan(batch, topo); }), "threshold = 1000"));
    h.args.threshold = 100;
    CHECK(h.can_implement(batch, topo));
    CHECK(h.plan_with_report(batch, topo).threshold == 100);
    CHECK(contains(Hybrid{{.comm_weight = -1.0}}.can_implement(batch, topo).reason, "comm_weight"));
    CHECK(contains(Hybrid{{.overlap = 1.5}}.can_implement(batch, topo).reason, "overlap"));
    CHECK(contains(Hybrid{{.threshold = -5}}.can_implement(batch, topo).reason, "threshold"));
    // BatchAware: a group_size that does not divide the world, or leaves a group without a sequence.
    const DocumentBatch two({{10}, {10}});
    CHECK(contains(BatchAware<Uniform>{{.group_size = 3}}.can_implement(two, {8, 4}).reason, "does not divide"));
    CHECK(contains(BatchAware<Uniform>{{.group_size = 2}}.can_implement(two, {8, 4}).reason, "4 groups for only 2"));
    CHECK(contains(invalid_message([&] {
                     (void)BatchAware<Uniform>{{.group_size = 3}}.plan(two, {8, 4});
                   }),
                   "does not divide"));
    // BatchAware<WholeDoc>: the refusal of the inner partitioner names the group.
    const DocumentBatch uneven({{10}, {30, 2}});
    const Status inner = BatchAware<WholeDoc>{}.can_implement(uneven, {4, 4});
    CHECK_FALSE(inner);
    CHECK(contains(inner.reason, "group 1"));
    CHECK(contains(inner.reason, "document 0 has 30 tokens"));
    CHECK(BatchAware<PerDoc>{}.can_implement(uneven, {4, 4}));
    CHECK(contains(invalid_message([] { (void)Zigzag{}.plan(DocumentBatch::single({4}), {0, 1}); }), "world_size = 0"));
    CHECK_FALSE(Zigzag{}.can_implement(DocumentBatch::single({4}), {0, 1}));
  }

  TEST_CASE("Hybrid: long documents Per-Doc, short ones whole; the cost function is replaceable") {
    Lengths docs{4000};
    for (int i = 0; i < 40; ++i) docs.push_back(100);
    const auto batch = DocumentBatch::single(docs);
    const Topology topo{4, 4};
    const auto rep = Hybrid{}.plan_with_report(batch, topo);
    CHECK(rep.threshold == 100);
    CHECK(rep.per_doc_documents == 1);
    CHECK(rep.candidates_evaluated >= 2);
    check_plan(rep.plan, batch, topo);
    // Only the Per-Doc document moves KV; sharding-aware: rank r reads chunks 0..2P-1-r.
    // 4000 = 8 chunks of 500: rank r receives (7 - r) - 1 chunks = 500 * (6 - r) tokens.
    CHECK(rep.received_kv_tokens == std::vector<std::int64_t>{3000, 2500, 2000, 1500});
    // A cost function that prefers Per-Doc everywhere picks tau = 0 (the PerDoc plan).
    Hybrid h{};
    h.args.cost = [](const partition::HybridCandidate& c) { return static_cast<double>(c.threshold); };
    const auto all_split = h.plan_with_report(batch, topo);
    CHECK(all_split.threshold == 0);
    CHECK(all_split.per_doc_documents == 41);
    CHECK(all_split.plan.owned == PerDoc{}.plan(batch, topo).owned);
  }

  TEST_CASE("balance on a 128K lognormal mix (median 2K) at P = 8, and on one 128K document") {
    const Topology topo{8, 8};
    const auto batch = lognormal_128k(2026);
    const auto hybrid = Hybrid{}.plan_with_report(batch, topo);
    const auto hb = hybrid.plan.balance();
    const auto zb = Zigzag{}.plan(batch, topo).balance();
    const auto pb = PerDoc{}.plan(batch, topo).balance();
    const auto ub = Uniform{}.plan(batch, topo).balance();
    const WholeDoc wd{};
    const bool wd_ok = static_cast<bool>(wd.can_implement(batch, topo));
    const auto wb = wd_ok ? wd.plan(batch, topo).balance() : Balance{};
    MESSAGE("128K lognormal mix, "
            << batch.documents().size() << " documents, P = 8 (token / compute imbalance): "
            << "Uniform " << ub.token_imbalance << " / " << ub.compute_imbalance << ", Zigzag " << zb.token_imbalance
            << " / " << zb.compute_imbalance << ", PerDoc " << pb.token_imbalance << " / " << pb.compute_imbalance
            << ", WholeDoc "
            << (wd_ok ? std::to_string(wb.token_imbalance) + " / " + std::to_string(wb.compute_imbalance) : "refused")
            << ", Hybrid " << hb.token_imbalance << " / " << hb.compute_imbalance << " (threshold " << hybrid.threshold
            << ", " << hybrid.per_doc_documents << " documents Per-Doc, max KV received "
            << *std::max_element(hybrid.received_kv_tokens.begin(), hybrid.received_kv_tokens.end())
            << " tokens vs PerDoc " <<
            [&] {
              const auto p = PerDoc{}.plan(batch, topo);
              std::int64_t m = 0;
              for (int r = 0; r < 8; ++r) m = std::max(m, partition::received_kv_tokens(p, r));
              return m;
            }()
            << ")");
    CHECK(hb.compute_imbalance <= 1.05);
    CHECK(pb.compute_imbalance <= 1.01);
    CHECK(hb.token_imbalance <= 1.25 + 1e-9);
    CHECK(zb.token_imbalance == doctest::Approx(1.0));
    CHECK(hybrid.per_doc_documents < static_cast<int>(batch.documents().size()));  // short documents stay whole

    for (std::uint64_t seed : {1, 2, 3}) {
      CAPTURE(seed);
      const auto mix = lognormal_128k(seed);
      CHECK(Hybrid{}.plan(mix, topo).balance().compute_imbalance <= 1.05);
    }

    const auto one = DocumentBatch::single({128 * 1024});
    const auto h1 = Hybrid{}.plan(one, topo).balance();
    const auto z1 = Zigzag{}.plan(one, topo).balance();
    CHECK(h1.compute_imbalance <= z1.compute_imbalance);
    CHECK(z1.compute_imbalance <= 1.0001);
  }

  TEST_CASE("windowed batches: every partitioner's slices are the windowed pieces, areas add up") {
    const auto cases = random_cases();
    for (int n = 1; n <= 8; ++n)
      for (const Case& c : cases)
        for (const std::int64_t w : {1, 7, 50}) {
          CAPTURE(c.name);
          CAPTURE(n);
          CAPTURE(w);
          const DocumentBatch& batch = c.batch;
          const AttentionMask m{w};
          const Topology topo{n, n};
          check_plan(Uniform{}.plan(batch, topo, m), batch, topo);
          check_plan(Zigzag{}.plan(batch, topo, m), batch, topo);
          const auto per_doc = PerDoc{}.plan(batch, topo, m);
          check_plan(per_doc, batch, topo);
          check_token_balance(per_doc, batch);  // the windowed cut keeps Per-Doc's token balance
          check_plan(Hybrid{}.plan(batch, topo, m), batch, topo);
          const WholeDoc loose{{.capacity_factor = static_cast<double>(n)}};
          check_plan(loose.plan(batch, topo, m), batch, topo);
          const Topology nodes{n, std::min(n, 2)};
          check_plan(BatchAware<Uniform>{}.plan(batch, nodes, m), batch, nodes);
          check_plan(BatchAware<PerDoc>{}.plan(batch, nodes, m), batch, nodes);
        }
  }

  TEST_CASE("windowed balance on the 128K lognormal mix and one 128K document (w = 4K)") {
    // The work is the windowed area, no longer the causal triangle: the planners that weigh area
    // (Hybrid, WholeDoc, BatchAware) weigh this one, the layouts (Zigzag, PerDoc) stay balanced.
    const Topology topo{8, 8};
    const std::int64_t w = 4096;
    const auto batch = lognormal_128k(2026);
    const AttentionMask m{w};
    const auto hb = Hybrid{}.plan(batch, topo, m).balance();
    const auto pb = PerDoc{}.plan(batch, topo, m).balance();
    MESSAGE("128K lognormal, w = 4K, P = 8, compute imbalance: Hybrid " << hb.compute_imbalance << ", PerDoc "
                                                                        << pb.compute_imbalance);
    CHECK(hb.compute_imbalance <= 1.05);
    CHECK(pb.compute_imbalance <= 1.01);
    // WholeDoc's list scheduling on windowed costs: max <= mean + (1 - 1/P) * the largest windowed document.
    const WholeDoc loose{{.capacity_factor = 8.0}};
    const auto p = loose.plan(batch, topo, m);
    const double mean = static_cast<double>(batch.attention_area(m)) / 8;
    double biggest = 0;
    for (const Document& d : batch.documents())
      biggest = std::max(biggest, static_cast<double>(document_area(d.tokens.size(), w)));
    CHECK(static_cast<double>(p.balance().max_area) <= mean + (1.0 - 1.0 / 8) * biggest + 1e-6);
    // One document: every row past the first w costs w pairs. Zigzag and Uniform cut tokens evenly, so
    // the rank holding the first rows is short by at most the ramp's deficit w(w-1)/2 (about 1.6% here);
    // Per-Doc and Hybrid cut the ramp zigzag and the band evenly, which balances both.
    const auto one = DocumentBatch::single({128 * 1024});
    const auto z1 = Zigzag{}.plan(one, topo, m).balance();
    const auto u1 = Uniform{}.plan(one, topo, m).balance();
    const auto p1 = PerDoc{}.plan(one, topo, m).balance();
    const auto h1 = Hybrid{}.plan(one, topo, m).balance();
    MESSAGE("one 128K document, w = 4K, P = 8, compute imbalance: Zigzag "
            << z1.compute_imbalance << ", Uniform " << u1.compute_imbalance << ", PerDoc " << p1.compute_imbalance
            << ", Hybrid " << h1.compute_imbalance);
    const double mean1 = static_cast<double>(one.attention_area(m)) / 8;
    CHECK(static_cast<double>(z1.max_area) <= mean1 + static_cast<double>(w * (w - 1) / 2));
    CHECK(static_cast<double>(u1.max_area) <= mean1 + static_cast<double>(w * (w - 1) / 2));
    CHECK(p1.compute_imbalance <= 1.001);
    CHECK(h1.compute_imbalance <= 1.001);
  }

  TEST_CASE("one-token documents: runs are one slice, whole-document packers keep them in runs") {
    // 20,000 one-token documents in two sequences with a few longer ones between: the plan stays a
    // handful of ranges and slices per rank (a slice per document was 10^6 slices at 10^6 documents)
    // and the invariants hold.
    std::vector<std::vector<std::int64_t>> seqs(2);
    for (std::size_t b = 0; b < 2; ++b)
      for (int i = 0; i < 10000; ++i) seqs[b].push_back(i % 2500 == 1250 ? 40 : 1);
    const DocumentBatch batch(seqs);
    const Topology topo{4, 4};
    const auto few = [](const ShardPlan& p, std::size_t most) {
      for (int r = 0; r < p.world_size(); ++r) {
        CHECK(p.owned[static_cast<std::size_t>(r)].size() <= most);
        CHECK(p.slices[static_cast<std::size_t>(r)].size() <= 2 * most + 8);
      }
    };
    const auto uniform = Uniform{}.plan(batch, topo);
    check_plan(uniform, batch, topo);
    few(uniform, 1);
    const auto zigzag = Zigzag{}.plan(batch, topo);
    check_plan(zigzag, batch, topo);
    few(zigzag, 4);
    const auto whole = WholeDoc{}.plan(batch, topo);
    check_plan(whole, batch, topo);
    few(whole, 64);
    const auto hybrid = Hybrid{}.plan(batch, topo);
    check_plan(hybrid, batch, topo);
    few(hybrid, 64);
    const auto basp = BatchAware<Zigzag>{}.plan(batch, topo);
    check_plan(basp, batch, topo);
    few(basp, 4);
    // Per-Doc deals one-token documents round-robin: single-token ranges, but still exact.
    check_plan(PerDoc{}.plan(batch, topo), batch, topo);
  }

  TEST_CASE("PerDoc compute imbalance stays small for long documents") {
    Rng rng(99);
    Lengths docs;
    for (int i = 0; i < 24; ++i) docs.push_back(rng.between(4096, 16384));
    const auto batch = DocumentBatch::single(docs);
    for (int n : {3, 6, 8}) {
      const auto p = PerDoc{}.plan(batch, {n, n});
      CHECK(p.balance().compute_imbalance <= 1.01);
      check_per_doc_compute(p, batch);
    }
  }

  TEST_CASE(
      "document_causal_area_for equals the area of document_causal_slices_for (windows, pieces across documents)") {
    std::mt19937 rng(2905);
    for (int trial = 0; trial < 300; ++trial) {
      std::vector<std::vector<std::int64_t>> seqs(1 + rng() % 3);
      for (auto& seq : seqs)
        for (int d = 0; d < 1 + static_cast<int>(rng() % 6); ++d)
          seq.push_back(1 + static_cast<std::int64_t>(rng() % 40));
      const DocumentBatch batch(seqs);
      const AttentionMask mask{trial % 3 == 0 ? 0 : 1 + static_cast<std::int64_t>(rng() % 30)};
      // Random disjoint pieces, some crossing document boundaries, in random order.
      std::vector<Range> pieces;
      for (std::int64_t t = 0; t < batch.total_tokens();) {
        const std::int64_t len = 1 + static_cast<std::int64_t>(rng() % 25);
        const Range r{t, std::min(batch.total_tokens(), t + len)};
        if (rng() % 2 == 0) pieces.push_back(r);
        t = r.end;
      }
      std::shuffle(pieces.begin(), pieces.end(), rng);
      std::int64_t want = 0;
      for (const AttnSlice& s : seqpar::detail::document_causal_slices_for(pieces, batch, mask)) want += s.area();
      CHECK(seqpar::detail::document_causal_area_for(pieces, batch, mask) == want);
    }
  }
}
